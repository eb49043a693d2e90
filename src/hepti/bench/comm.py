"""`mpiexec -n N hepti bench comm`: hepti's row verbs against MPI's own collectives.

hepti.parallel.comm moves rows by direct point-to-point exchange instead of calling
MPI_Allgatherv / MPI_Reduce_scatter, or, when every rank is on one host, through a shared
window (see its docstring). This measures both choices on the shapes of a forward: for each
case, MPI's collective ("mpi"), hepti's verb over point-to-point messages ("p2p") and, on one
host, over the shared window ("shm") run in turn in one loop (the order rotating), each call on
freshly written input (a forward sends what a kernel has just written, which is slower to move
between cores than a buffer sent again and again; on "shm" a Reduce_scatter's input is written
straight into the verb's buffer, as the forward's GeMM writes it). The median of each is quoted
with the ratios. Every rank takes part; rank 0 prints and writes the JSON.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np

from hepti.bench.harness import interleave, positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.counts import counts, offsets
from hepti.errors import InputError
from hepti.parallel.comm import Comm, choose_transport
from hepti.parallel.world import run_guarded_fn

# (case, verb, rows, width): MiniLM at 128 tokens (hidden 384) and BERT-base at 256 (hidden 768)
CASES = (("MiniLM@128 rows K/V", "allgather", 128, 768),
         ("MiniLM@128 tensor rows", "allgather", 128, 384),
         ("MiniLM@128 tensor partial sums", "reduce_scatter", 128, 384),
         ("BERT-base@256 rows K/V", "allgather", 256, 1536),
         ("BERT-base@256 tensor partial sums", "reduce_scatter", 256, 768))


def run_comm_bench(mpi_comm, repeat: int = 200, progress: bool = True) -> dict | None:
    """Median seconds per call of each verb each way; the dict on rank 0, None elsewhere."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)


    groups = {"p2p": Comm(mpi_comm, transport="p2p")}
    if choose_transport(mpi_comm, "auto") == "shm":
        groups["shm"] = Comm(mpi_comm, transport="shm")
    r, n = mpi_comm.Get_rank(), mpi_comm.Get_size()
    results = []
    bar = tqdm(total=len(CASES) * repeat, desc="comm", unit="round",
               disable=not progress or r != 0)
    for name, verb, m, w in CASES:
        rc = counts(m, [1.0 / n] * n)
        o = offsets(rc)
        sizes, displs = [c * w for c in rc], [x * w for x in o]
        ways = {}
        if verb == "allgather":
            src = np.empty((rc[r], w), np.float32)
            full = np.empty((m, w), np.float32)
            ways["mpi"] = (lambda: src, lambda a: mpi_comm.Allgatherv(a, [full, (sizes, displs), MPI.FLOAT]))
            for t, g in groups.items():
                ways[t] = (lambda: src, lambda a, g=g: g.allgather_rows(a, rc))
        else:
            src = np.empty((m, w), np.float32)
            mine = np.empty((rc[r], w), np.float32)
            ways["mpi"] = (lambda: src, lambda a: mpi_comm.Reduce_scatter(a, mine, sizes, op=MPI.SUM))
            for t, g in groups.items():  # "shm": the input written into the verb's own buffer
                ways[t] = (lambda g=g: _or(g.partial_buffer((m, w)), src),
                           lambda a, g=g: g.reduce_scatter_rows(a, rc))

        def call(way: str, k: int) -> float:
            target, fn = ways[way]
            a = target()
            a.fill(k)  # freshly written, as a kernel's output is
            mpi_comm.Barrier()
            t0 = time.perf_counter()
            fn(a)
            return time.perf_counter() - t0
        times = interleave(list(ways), repeat, call)
        bar.update(repeat)
        slowest = {way: max(mpi_comm.allgather(statistics.median(t))) for way, t in times.items()}
        row = {"case": name, "verb": verb, "rows": m, "width": w, "row_counts": rc}
        row.update({f"{way}_s": t for way, t in slowest.items()})
        row["mpi_over_p2p"] = slowest["mpi"] / slowest["p2p"]
        if "shm" in slowest:
            row["p2p_over_shm"] = slowest["p2p"] / slowest["shm"]
        results.append(row)
    bar.close()
    for g in groups.values():
        g.close()
    if r != 0:
        return None
    return result_doc("comm", ranks=n, repeat=repeat, transports=["mpi", *groups],
                      mpi_library=MPI.Get_library_version().splitlines()[0].strip(),
                      note="median seconds per call, the slowest rank's; the ways take turns, "
                           "their order rotating", results=results)


def _or(a, b):
    return b if a is None else a


def format_comm(res: dict) -> str:
    shm = "shm" in res["transports"]
    lines = [f"row verbs on {res['ranks']} ranks, median of {res['repeat']} calls each, taking "
             f"turns ({res['mpi_library']})",
             f"{'case':<34} {'verb':<15} {'MPI us':>8} {'p2p us':>8}" + (f" {'shm us':>8}" if shm else "")
             + f" {'MPI/p2p':>8}" + (f" {'p2p/shm':>8}" if shm else "")]
    for x in res["results"]:
        line = f"{x['case']:<34} {x['verb']:<15} {x['mpi_s'] * 1e6:>8.1f} {x['p2p_s'] * 1e6:>8.1f}"
        line += f" {x['shm_s'] * 1e6:>8.1f}" if shm else ""
        line += f" {x['mpi_over_p2p']:>8.2f}" + (f" {x['p2p_over_shm']:>8.2f}" if shm else "")
        lines.append(line)
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--repeat", type=positive_int, default=200, help="calls of each (default 200)")
    ap.add_argument("--out", default="results/comm.json", help="write the JSON here (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    """Every rank measures; an exception on any rank ends the job (run_guarded_fn)."""
    return run_guarded_fn("bench comm", _run, args)


def _run(args) -> int:
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    if MPI.COMM_WORLD.Get_size() < 2:
        raise InputError("bench comm needs two or more ranks: mpiexec -n 2 hepti bench comm")
    res = run_comm_bench(MPI.COMM_WORLD, repeat=args.repeat, progress=not args.json)
    if res is not None:
        write_json(res, args.out)
        print(json.dumps(res, indent=2) if args.json else format_comm(res) + f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
