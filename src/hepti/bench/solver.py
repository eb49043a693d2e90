"""How long the planner takes to solve: `hepti bench solver` (issue 4's figure: <= 50 ms at 32).

For each cluster size it declares a random profile (seeded: speeds 5-100 GFLOP/s, 0.3-1.5 GB of
memory, links of 40 Mbit/s to 2.4 Gbit/s, 20 us to 3 ms), flat or with size-dependent GeMM
speeds (tables that fall to 20-100% of the peak on thin slices, as measured profiles do), and
times `make_plan` for BERT-base at 256 tokens with each strategy, interleaved round by round.
The figure is the plan's own `solve_s` (the solver's wall time, what `hepti plan --json`
reports); the median over the rounds is quoted. The planner never imports MPI, so neither does
this.
"""
from __future__ import annotations

import json
import random
import statistics
import sys
import time

from hepti.bench.harness import interleave, positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.families import preset_config
from hepti.errors import InputError, PlanError
from hepti.plan.partition import make_plan
from hepti.plan.profile import declared_profile

DEVICES = (2, 4, 8, 16, 32)
STRATEGIES = ("auto", "tensor", "rows", "stream")
SEQ = 256


def random_devices(n: int, seed: int, tables: bool) -> list[dict]:
    """n declared devices (the profile schema's fields), reproducible from the seed."""
    rng = random.Random(seed * 1000 + n)
    devs = []
    for _ in range(n):
        g = rng.uniform(5e9, 1e11)
        gemm = [[4, (low := rng.uniform(0.2, 1.0)) * g], [32, (1 + low) / 2 * g], [128, g]] if tables else g
        devs.append({"gemm_flops": gemm, "memory_bytes": rng.uniform(3e8, 1.5e9),
                     "latency_s": rng.uniform(2e-5, 3e-3), "bandwidth_Bps": rng.uniform(5e6, 3e8),
                     "disk_read_Bps": rng.uniform(5e7, 1e9)})
    return devs


def run_solver_bench(devices=DEVICES, strategies=STRATEGIES, rounds: int = 15, seed: int = 0,
                     progress: bool = True) -> dict:
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)


    cfg = preset_config("bert-base")
    cases = [(n, tables, s) for n in devices for tables in (False, True) for s in strategies]
    profiles = {(n, t): declared_profile(random_devices(n, seed, t)) for n in devices for t in (False, True)}
    refused: dict[tuple, str] = {}
    t0 = time.perf_counter()

    def solve(case: tuple, _k: int) -> float | None:
        n, tables, strategy = case
        if case in refused:
            return None
        try:
            return make_plan(cfg, profiles[(n, tables)], SEQ, strategy=strategy).solve_s
        except PlanError as e:  # e.g. no rows plan when no device holds the model
            refused[case] = str(e)
            return None
    for case in cases:  # warm-up: imports, scipy's first solve
        solve(case, -1)
    with tqdm(total=rounds * len(cases), desc="solver", unit="plan", disable=not progress) as bar:
        times = {c: [t for t in ts if t is not None]
                 for c, ts in interleave(cases, rounds, solve, bar).items()}
    rows = []
    for case in cases:
        n, tables, strategy = case
        t = times[case]
        rows.append({"devices": n, "speeds": "size-dependent" if tables else "flat", "strategy": strategy,
                     "median_solve_s": statistics.median(t) if t else None,
                     "max_solve_s": max(t) if t else None, "runs": len(t), "refused": refused.get(case)})
    return result_doc("solver", model="bert-base", seq_len=SEQ, rounds=rounds, seed=seed,
                      wall_s=time.perf_counter() - t0, target="solve_s <= 50 ms at 32 devices",
                      results=rows)


def format_solver(res: dict) -> str:
    lines = [f"planner solve time, BERT-base @{res['seq_len']} tokens, median of {res['rounds']} "
             "interleaved rounds (ms)",
             f"{'devices':>7}  {'speeds':<15}" + "".join(f"{s:>9}" for s in STRATEGIES)]
    by = {(r["devices"], r["speeds"], r["strategy"]): r for r in res["results"]}
    for n in sorted({r["devices"] for r in res["results"]}):
        for speeds in ("flat", "size-dependent"):
            cells = []
            for s in STRATEGIES:
                r = by.get((n, speeds, s))
                cells.append("        -" if r is None or r["median_solve_s"] is None
                             else f"{r['median_solve_s'] * 1e3:9.1f}")
            lines.append(f"{n:>7}  {speeds:<15}" + "".join(cells))
    top = max(r["devices"] for r in res["results"])
    worst = max((r["median_solve_s"] for r in res["results"]
                 if r["devices"] == top and r["median_solve_s"] is not None), default=None)
    if worst is not None:
        verdict = f" ({'MET' if worst <= 0.05 else 'MISS'}: {res['target']})" if top == 32 else ""
        lines.append(f"slowest median at {top} devices: {worst * 1e3:.1f} ms{verdict}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--devices", default="2,4,8,16,32", help="cluster sizes (default %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=15, help="interleaved rounds (default 15)")
    ap.add_argument("--out", default="results/solver.json", help="write the JSON here (default %(default)s)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    try:
        devices = tuple(int(x) for x in args.devices.split(","))
    except ValueError:
        raise InputError(f"--devices {args.devices!r}: give cluster sizes like 2,4,8,16,32") from None
    if any(n < 1 for n in devices):
        raise InputError(f"--devices {args.devices!r}: every cluster size must be at least 1")
    res = run_solver_bench(devices, rounds=args.rounds, progress=not args.json)
    write_json(res, args.out)
    print(json.dumps(res, indent=2) if args.json else format_solver(res) + f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
