"""Under mpiexec -n 2 (or more): the offload experiment's runtime assembles exactly the
single-device chain's result for any split of the rows, and its sweep returns the same
well-formed result on every rank."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.bench.offload import (chain_rows, make_input, make_weights, offload_once,  # noqa: E402
                                 pack_weights, run_offload_sweep)
from hepti.counts import counts as split_counts  # noqa: E402

RANK, WORLD = COMM.Get_rank(), COMM.Get_size()


def _splits(m: int) -> list[list[int]]:
    """Row counts per rank: all on rank 0, all on rank 1, single rows, uneven and even splits."""
    out = [[m] + [0] * (WORLD - 1), [0, m] + [0] * (WORLD - 2), [m - 1, 1] + [0] * (WORLD - 2),
           [1, m - 1] + [0] * (WORLD - 2)]
    out += [split_counts(m, r) for r in ([1.0] * WORLD, [3.0] + [1.0] * (WORLD - 1),
                                         [0.0] + [1.0] * (WORLD - 1))]
    return out


def test_every_split_assembles_the_single_device_result():
    m, k, chain = 37, 96, 3  # small, odd sizes: partial register tiles on every rank
    packed = pack_weights(make_weights(k, chain, seed=5))
    x = make_input(m, k, seed=6) if RANK == 0 else None
    if RANK == 0:
        single = chain_rows(x, packed)  # [m, k] on one device
        ref = x.astype(np.float64)
        for w in make_weights(k, chain, seed=5):
            ref = ref @ w.astype(np.float64)
        all_ok(np.allclose(single, ref, rtol=1e-4, atol=1e-4),
               f"chain_rows differs from numpy by {np.max(np.abs(single - ref)):.2e}")
    else:
        all_ok(True)
    for counts in _splits(m):
        out, times = offload_once(COMM, x, packed, counts)
        if RANK == 0:
            err = float(np.max(np.abs(out - single)))
            ok = out.shape == (m, k) and err <= 1e-6 and times["latency_s"] >= times["compute_s"] >= 0
            msg = f"split {counts}: max |error| {err:.2e}, times {times}"
        elif counts[RANK] > 0:
            ok = out is None and min(times.values()) >= 0 and times["compute_s"] > 0
            msg = f"split {counts}: {times}"
        else:
            ok, msg = out is None and times == {}, f"split {counts}: an idle rank reported {times}"
        all_ok(ok, msg)


def test_the_paper_shape_at_an_even_split():
    packed = pack_weights(make_weights())
    x = make_input() if RANK == 0 else None
    counts = split_counts(256, [1.0, 1.0] + [0.0] * (WORLD - 2))
    out, _ = offload_once(COMM, x, packed, counts)
    if RANK == 0:
        err = float(np.max(np.abs(out - chain_rows(x, packed))))
        all_ok(err <= 1e-6, f"[256,1024] x5 split {counts}: max |error| {err:.2e}")
    else:
        all_ok(True)


def test_a_short_sweep_gives_every_rank_the_same_result():
    res = run_offload_sweep(COMM, steps=3, repeat=1, progress=False, scenario="test")
    res.pop("wall_s")
    texts = COMM.allgather(json.dumps(res, sort_keys=True))
    all_ok(len(set(texts)) == 1, "ranks disagree on the sweep's result")
    sweep = res["sweep"]
    all_ok([r["share"] for r in sweep] == [0.0, 0.5, 1.0] and sweep[1]["rows"] == [128, 128],
           f"{[(r['share'], r['rows']) for r in sweep]}")
    all_ok(res["max_abs_err"] <= 1e-6, f"max |error| {res['max_abs_err']}")
    all_ok(all(r["latency_s"] > 0 and r["predicted_latency_s"] > 0 for r in sweep), f"{sweep}")
    all_ok(sweep[0]["compute_s"][1] == 0.0 and sweep[0]["comm_s"] == 0.0, f"{sweep[0]}")
    all_ok(sweep[2]["compute_s"][1] > 0 and sweep[2]["comm_in_s"] > 0, f"{sweep[2]}")
    planner = res["planner"]
    all_ok(0.0 <= planner["share"] <= 1.0 and sum(planner["rows"]) == 256, f"{planner}")
    all_ok(res["measured_best_share"] in (0.0, 0.5, 1.0), f"{res['measured_best_share']}")
    link = res["profile"]["devices"][1]
    all_ok(link["bandwidth_Bps"] > 1e6 and link["latency_s"] >= 0, f"{link}")
