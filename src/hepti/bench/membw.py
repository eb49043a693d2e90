"""This machine's memory read bandwidth: one process alone against one per core at once, over
several launches. Nothing of hepti's runs in it: a plain Numba loop sums a 2 GB float32 array.

    hepti bench membw [--rounds 6] [--out results/membw.json]

Why: decode is bound by reading the weights, and two ranks on one box share its memory. On
this project's 2-core VM, `tensor` on 2 ranks decoded llama-1b at one of two speeds from launch
to launch (docs/results/scaling.md). This bench shows whether the machine itself does that,
with no MPI, no hepti kernel and no model: each round launches one process pinned to core 0,
then one pinned to each core at the same time; each sums its own array 15 times and reports
the median GB/s. The rounds' totals for "all cores" are the figure to read: one value, or two
clusters.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
from numba import njit

from hepti.bench.harness import positive_int, result_doc, write_json
from hepti.bench.registry import module_main

FLOATS = 500_000_000  # 2 GB: far beyond any cache
PASSES = 15


@njit(fastmath=True, cache=True)
def _sum(a):
    t = np.float32(0.0)
    for i in range(a.shape[0]):
        t += a[i]
    return t


def child(core: int) -> float:
    """One process on `core`: the median GB/s of PASSES sums of its own array."""
    os.sched_setaffinity(0, {core})
    a = np.ones(FLOATS, np.float32)
    _sum(a[:1024])
    rates = []
    for _ in range(PASSES):
        t = time.perf_counter()
        _sum(a)
        rates.append(a.nbytes / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def _launch(cores: list[int]) -> list[float]:
    procs = [subprocess.Popen([sys.executable, "-m", "hepti.bench.membw", "--child", str(c)],
                              stdout=subprocess.PIPE, text=True) for c in cores]
    out = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"a bandwidth child failed: {[p.returncode for p in procs]}")
    return [float(s) for s in out]


def add_arguments(ap) -> None:
    ap.add_argument("--rounds", type=positive_int, default=6,
                    help="launches of each (one core; all cores at once), alternating (default 6)")
    ap.add_argument("--out", default="results/membw.json",
                    help="the result file (default results/membw.json)")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # one process


def run(args) -> int:
    if args.child is not None:
        print(child(args.child))
        return 0
    cores = sorted(os.sched_getaffinity(0))
    rounds = []
    for r in range(args.rounds):
        one = _launch(cores[:1])[0]
        every = _launch(cores)
        rounds.append({"one_core_gb_s": one, "all_cores_gb_s": every, "all_cores_total": sum(every)})
        print(f"round {r + 1}/{args.rounds}: one core {one:.1f} GB/s; {len(cores)} cores "
              f"{' + '.join(f'{x:.1f}' for x in every)} = {sum(every):.1f} GB/s", flush=True)
    doc = result_doc("membw", cores=cores, floats=FLOATS, passes=PASSES, rounds=rounds,
                     one_core_median=statistics.median(x["one_core_gb_s"] for x in rounds),
                     all_cores_total_median=statistics.median(x["all_cores_total"] for x in rounds))
    write_json(doc, args.out)
    print(json.dumps({k: doc[k] for k in ("one_core_median", "all_cores_total_median")}))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
