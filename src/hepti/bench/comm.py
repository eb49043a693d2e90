"""`mpiexec -n N hepti bench comm`: hepti's row verbs against MPI's own collectives.

hepti.parallel.comm moves rows by direct point-to-point exchange instead of calling
MPI_Allgatherv / MPI_Reduce_scatter (see its docstring). This measures the choice, on the
shapes of a forward: for each case, MPI's collective and hepti's verb run alternately in one
loop, each call on freshly written input (a forward sends what a kernel has just written, which
is slower to move between cores than a buffer sent again and again), and the median of each is
quoted with their ratio. Every rank takes part; rank 0 prints and writes the JSON.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from hepti.bench import result_doc

# (case, verb, rows, width): MiniLM at 128 tokens (hidden 384) and BERT-base at 256 (hidden 768)
CASES = (("MiniLM@128 rows K/V", "allgather", 128, 768),
         ("MiniLM@128 tensor rows", "allgather", 128, 384),
         ("MiniLM@128 tensor partial sums", "reduce_scatter", 128, 384),
         ("BERT-base@256 rows K/V", "allgather", 256, 1536),
         ("BERT-base@256 tensor partial sums", "reduce_scatter", 256, 768))


def run_comm_bench(mpi_comm, repeat: int = 200, progress: bool = True) -> dict | None:
    """Median seconds per call of each verb both ways; the dict on rank 0, None elsewhere."""
    from mpi4py import MPI
    from tqdm import tqdm

    from hepti.counts import counts, offsets
    from hepti.parallel.comm import Comm

    comm = Comm(mpi_comm)
    r, n = comm.rank, comm.size
    results = []
    bar = tqdm(total=len(CASES) * repeat, desc="comm", unit="pair",
               disable=not progress or r != 0)
    for name, verb, m, w in CASES:
        rc = counts(m, [1.0 / n] * n)
        o = offsets(rc)
        sizes, displs = [c * w for c in rc], [x * w for x in o]
        if verb == "allgather":
            src = np.empty((rc[r], w), np.float32)
            full = np.empty((m, w), np.float32)
            ours = lambda: comm.allgather_rows(src, rc)  # noqa: E731
            theirs = lambda: mpi_comm.Allgatherv(src, [full, (sizes, displs), MPI.FLOAT])  # noqa: E731
        else:
            src = np.empty((m, w), np.float32)
            mine = np.empty((rc[r], w), np.float32)
            ours = lambda: comm.reduce_scatter_rows(src, rc)  # noqa: E731
            theirs = lambda: mpi_comm.Reduce_scatter(src, mine, sizes, op=MPI.SUM)  # noqa: E731
        times = {"mpi": [], "hepti": []}
        for k in range(repeat):
            for way, fn in (("mpi", theirs), ("hepti", ours)) if k % 2 else (("hepti", ours), ("mpi", theirs)):
                src.fill(k)  # freshly written, as a kernel's output is
                mpi_comm.Barrier()
                t0 = time.perf_counter()
                fn()
                times[way].append(time.perf_counter() - t0)
            bar.update(1)
        slowest = {way: max(mpi_comm.allgather(statistics.median(t))) for way, t in times.items()}
        results.append({"case": name, "verb": verb, "rows": m, "width": w, "row_counts": rc,
                        "mpi_s": slowest["mpi"], "hepti_s": slowest["hepti"],
                        "mpi_over_hepti": slowest["mpi"] / slowest["hepti"]})
    bar.close()
    if r != 0:
        return None
    return result_doc("comm", ranks=n, repeat=repeat,
                      mpi_library=MPI.Get_library_version().splitlines()[0].strip(),
                      note="median seconds per call, the slowest rank's; calls of the two ways "
                           "alternate", results=results)


def format_comm(res: dict) -> str:
    lines = [f"row verbs on {res['ranks']} ranks, median of {res['repeat']} alternating calls "
             f"({res['mpi_library']})",
             f"{'case':<34} {'verb':<15} {'MPI us':>8} {'hepti us':>9} {'MPI/hepti':>10}"]
    for x in res["results"]:
        lines.append(f"{x['case']:<34} {x['verb']:<15} {x['mpi_s'] * 1e6:>8.1f} "
                     f"{x['hepti_s'] * 1e6:>9.1f} {x['mpi_over_hepti']:>10.2f}")
    return "\n".join(lines)
