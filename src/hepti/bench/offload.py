"""The Hepti paper's motivating experiment on MPI: offload a share of five chained MatMuls.

Five MatMuls [256,1024]x[1024,1024], weights replicated on every rank (packed once with
`hepti.kernels.pack_b`), the input [256,1024] on the primary (rank 0). A share of the rows goes
to the secondary (rank 1; `offload_once` takes any counts for any number of ranks):

    primary:   Isend(each other rank's rows), Irecv(their output rows) -> compute its own rows
               of all five MatMuls while they travel -> wait -> the whole [256,1024] output
    secondary: receive its rows -> compute all five MatMuls on them -> send the output rows back

Over TCP the secondary's output rows land in the primary's socket buffers while it still
computes, so both directions overlap the primary's compute. The planner models exactly this
schedule (hepti.plan.workloads.offload_chain_program):
latency = max(t_p (1 - s), (c_in + t_s + c_out) s). Waits sleep between tests instead of
spinning on a CPU-capped rank (`hepti.parallel.comm.wait`, as the runtime waits), so an emulated
device does not burn the CPU share it then needs to compute.

`run_offload_sweep` measures the latency for offloaded shares 0%..100% (interleaved rounds,
the sweep's direction alternating, medians) and asks the planner for its share given a profile measured right there: each rank's
speed on this chain at a few row counts, and the link by ping-pong at the sizes this experiment
sends (`measure_chain_links`).

    sudo hepti bench offload    (bin/bench-offload.sh: the four emulated pairs of
                                hostfiles/emu-pair-*.json, one launch each, then combined into
                                results/offload.json and .png)
    mpiexec -n 2 hepti bench offload --sweep --out FILE.json     (one sweep, on these ranks)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hepti.bench.harness import (HOSTFILES, alternate, at_least, hepti_cmd, interleave, launch, positive_int,
                                 result_doc, write_json)
from hepti.bench.registry import module_main
from hepti.counts import counts as split_counts
from hepti.errors import InputError
from hepti.parallel.comm import wait
from hepti import kernels as Kn
from hepti.emulate.state import read_state
from hepti.parallel.profile_links import fit_link, ping_pong
from hepti.plan.costmodel import evaluate
from hepti.plan.profile import NETWORK_DEFAULTS, SCHEMA_VERSION, profile_from_dict
from hepti.plan.search import optimise
from hepti.plan.workloads import offload_chain_program
from hepti.resources import available_memory

M, K, CHAIN = 256, 1024, 5  # the paper's shapes: CHAIN MatMuls [M,K]x[K,K]
TAG_IN, TAG_OUT = 41, 42
PROFILE_ROUNDS = 5
SPECS = ("emu-pair-940-full", "emu-pair-240-full", "emu-pair-940-quarter", "emu-pair-240-quarter")


# --- the problem and the chain -----------------------------------------------------------------

def make_weights(k: int = K, chain: int = CHAIN, seed: int = 0) -> list[np.ndarray]:
    """`chain` float32 [k, k] weights, scaled by 1/sqrt(k) so activations stay O(1) along the chain;
    the same on every rank (same seed): weights are replicated."""
    rng = np.random.default_rng(seed)
    scale = np.float32(1.0 / math.sqrt(k))
    return [rng.standard_normal((k, k), dtype=np.float32) * scale for _ in range(chain)]


def make_input(m: int = M, k: int = K, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((m, k), dtype=np.float32)  # [m, k]


def pack_weights(weights: list[np.ndarray]) -> list:
    return [Kn.pack_b(w) for w in weights]


def chain_rows(h: np.ndarray, packed: list, out: np.ndarray | None = None) -> np.ndarray:
    """h [r, k] through every MatMul -> [r, n], the last one written into `out` if given."""
    r = h.shape[0]
    n = packed[-1].n
    if out is None:
        out = np.empty((r, n), np.float32)
    if r == 0:
        return out
    scratch = [np.empty((r, w.n), np.float32) for w in packed[:2]]  # ping-pong [r, n]
    for j, w in enumerate(packed):
        dst = out if j == len(packed) - 1 else scratch[j % 2]
        h = Kn.gemm(h, w, out=dst)
    return out


# --- one offloaded run -----------------------------------------------------------------------

def _mpi(comm):
    return getattr(comm, "mpi", comm)  # a hepti Comm or an mpi4py communicator


def barrier_idle(comm) -> None:
    wait(comm.Ibarrier())


def offload_once(comm, x: np.ndarray | None, packed: list, counts: list[int]) -> tuple:
    """One run of the chain with `counts[i]` rows on rank i (rank 0's rows first). All ranks
    call it; rank 0 passes the input x [m, k]. Returns (output [m, n] on rank 0 else None,
    this rank's times in seconds from a common start after a barrier):
    rank 0: post_s (posting sends and receives), compute_s, out_s (compute end -> all done),
    latency_s; rank i > 0 with rows: in_s (its input arrived), compute_s, send_s."""
    comm = _mpi(comm)
    rank = comm.Get_rank()
    offs = [sum(counts[:i]) for i in range(len(counts))]
    n = packed[-1].n
    barrier_idle(comm)
    t0 = time.perf_counter()
    if rank == 0:
        m = x.shape[0]
        out = np.empty((m, n), np.float32)  # [m, n]
        peers = [(i, c) for i, c in enumerate(counts) if i > 0 and c > 0]
        reqs = [comm.Isend(x[offs[i]:offs[i] + c], dest=i, tag=TAG_IN) for i, c in peers]
        reqs += [comm.Irecv(out[offs[i]:offs[i] + c], source=i, tag=TAG_OUT) for i, c in peers]
        t_post = time.perf_counter()
        chain_rows(x[:counts[0]], packed, out[:counts[0]])
        t_comp = time.perf_counter()
        wait(reqs)
        t_end = time.perf_counter()
        return out, {"post_s": t_post - t0, "compute_s": t_comp - t_post,
                     "out_s": t_end - t_comp, "latency_s": t_end - t0}
    rows = counts[rank]
    if rows == 0:
        return None, {}
    h = np.empty((rows, packed[0].k), np.float32)  # [rows, k]
    wait(comm.Irecv(h, source=0, tag=TAG_IN))
    t_in = time.perf_counter()
    y = chain_rows(h, packed)  # [rows, n]
    t_comp = time.perf_counter()
    wait(comm.Isend(y, dest=0, tag=TAG_OUT))
    t_end = time.perf_counter()
    return None, {"in_s": t_in - t0, "compute_s": t_comp - t_in, "send_s": t_end - t_comp}


def share_counts(m: int, share: float, world: int) -> list[int]:
    """Rows per rank when rank 1 gets `share` of the m rows and rank 0 the rest."""
    primary, secondary = split_counts(m, [1.0 - share, share])
    return [primary, secondary] + [0] * (world - 2)


# --- the profile measured for the planner -------------------------------------------------------

def chain_speed_table(packed: list, m: int = M, rounds: int = PROFILE_ROUNDS) -> list[list[float]]:
    """[[rows, FLOP/s], ...]: this rank's speed on the chain at m/8, m/4, m/2 and m rows,
    timed in interleaved rounds (each size repeated to about one full chain's work), median."""
    rng = np.random.default_rng(2)
    k = packed[0].k
    flops_per_row = sum(2.0 * w.k * w.n for w in packed)
    sizes = sorted({max(1, m // 8), max(1, m // 4), max(1, m // 2), m})
    inputs = {r: rng.standard_normal((r, k), dtype=np.float32) for r in sizes}
    for r in sizes:
        chain_rows(inputs[r], packed)  # warm-up (compiles on a cold cache)

    def timed(r: int, _k: int) -> float:
        reps = max(1, round(m / r))
        t0 = time.perf_counter()
        for _ in range(reps):
            chain_rows(inputs[r], packed)
        return (time.perf_counter() - t0) / reps
    times = interleave(sizes, rounds, timed)
    return [[float(r), flops_per_row * r / statistics.median(times[r])] for r in sizes]


def measure_chain_links(comm, row_bytes: int, m: int = M, reps: int = 4) -> dict[int, dict]:
    """Each rank's link to rank 0: ping-pong at the sizes this experiment sends (m/8 .. m rows),
    fitted to latency + bytes / bandwidth (hepti.parallel.profiling.fit_link). Not
    `profiling.measure_links`: its small messages (8 B - 64 KiB) dominate its fit, and on a
    shaped link they pass within the token bucket's burst at veth speed (it gave 2352 Mbit/s on
    a 940 Mbit/s link, 387 on a 240 one)."""
    rank = comm.Get_rank()
    sizes = sorted({max(1, m // 8), max(1, m // 4), max(1, m // 2), m})
    out = {}
    for peer in range(1, comm.Get_size()):
        points = []
        for rows in sizes:
            nbytes = rows * row_bytes
            t = ping_pong(comm, peer, nbytes, reps) if rank in (0, peer) else 0.0
            points.append((nbytes, comm.bcast(t, root=0)))
        lat, bw = fit_link(points)
        out[peer] = {"latency_s": lat, "bandwidth_Bps": bw, "points": points}
    return out


def measure_offload_profile(comm, packed: list, m: int = M) -> dict:
    """A hepti profile (dict) of every rank: its chain speed table, memory, and its link to rank 0
    by ping-pong. All ranks call it; all get the same dict."""
    comm = _mpi(comm)
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    barrier_idle(comm)
    table = chain_speed_table(packed, m)
    barrier_idle(comm)
    links = measure_chain_links(comm, 4 * packed[0].k, m)
    mine = {"rank": comm.Get_rank(), "host": MPI.Get_processor_name(), "gemm_flops": table,
            "memory_bytes": float(available_memory()[0])}
    devices = comm.allgather(mine)
    for r in range(1, len(devices)):
        devices[r].update(latency_s=links[r]["latency_s"], bandwidth_Bps=links[r]["bandwidth_Bps"],
                          ping_pong=links[r]["points"])
    if len(devices) > 1:
        devices[0].update(latency_s=min(links[r]["latency_s"] for r in links),
                          bandwidth_Bps=max(links[r]["bandwidth_Bps"] for r in links))
    else:
        devices[0].update(latency_s=0.0, bandwidth_Bps=1e12)
    return {"hepti_profile": SCHEMA_VERSION, "created": time.time(), "source": "measured",
            "hostfile": None, "model": "offload-chain", "seq_len": m,
            "network": dict(NETWORK_DEFAULTS), "devices": devices}


def plan_share(profile: dict, m: int = M, k: int = K, chain: int = CHAIN) -> dict:
    """The planner's choice (hepti.plan.search.optimise) for the offload chain on this profile:
    rank 1's share, the row counts, the predicted latency and the solver's time. No MPI here."""
    prof = profile_from_dict(profile, "offload profile")
    program = offload_chain_program(m, k, k, chain)
    t0 = time.perf_counter()
    best = optimise(program, prof, [d.usable_bytes for d in prof.devices])
    solve_s = time.perf_counter() - t0
    rows = [int(c) for c in best.counts["rows"]]
    return {"share": rows[1] / m if len(rows) > 1 else 0.0, "rows": rows,
            "predicted_latency_s": best.latency_s, "solve_s": solve_s}


def predict(profile: dict, counts: list[int], m: int = M, k: int = K, chain: int = CHAIN) -> dict:
    """The cost model's latency, compute and communication for these row counts."""
    prof = profile_from_dict(profile, "offload profile")
    pred = evaluate(offload_chain_program(m, k, k, chain), {"rows": [float(c) for c in counts]}, prof)
    sec = pred.per_rank[1]
    return {"latency_s": pred.latency_s,
            "compute_s": [r.compute_s for r in pred.per_rank[:2]],
            "comm_s": sec.comm_total_s if sec.active else 0.0}


def model_best(profile: dict, m: int = M) -> dict:
    """The cost model's own optimum for two ranks, by trying every row count for rank 1: what
    the planner's search should find."""
    preds = [(predict(profile, [m - r, r] + [0] * (len(profile["devices"]) - 2))["latency_s"], r)
             for r in range(m + 1)]
    latency, rows = min(preds)
    return {"share": rows / m, "rows": [m - rows, rows], "predicted_latency_s": latency}


# --- the sweep -------------------------------------------------------------------------------------

def _summary(runs: list[tuple[dict, dict]]) -> dict:
    """Medians over repetitions of one share: latency, compute per device, communication.
    The input's transfer is the secondary's wait for its rows; the output's is the shorter of
    the secondary's Send and the primary's wait after its compute (each of the two also holds
    the other device's lateness when that one is the slower)."""
    med = statistics.median
    p = [r[0] for r in runs]
    s = [r[1] for r in runs]
    row = {"latency_s": med(x["latency_s"] for x in p),
           "latency_runs_s": [x["latency_s"] for x in p],
           "compute_s": [med(x["compute_s"] for x in p),
                         med(x["compute_s"] for x in s) if s[0] else 0.0]}
    if s[0]:
        comm_in = med(x["in_s"] for x in s)
        comm_out = med(min(b["send_s"], a["out_s"]) for a, b in zip(p, s))
    else:
        comm_in = comm_out = 0.0
    row.update(comm_in_s=comm_in, comm_out_s=comm_out, comm_s=comm_in + comm_out,
               post_s=med(x["post_s"] for x in p))
    return row


def run_offload_sweep(comm, steps: int = 11, repeat: int = 7, progress: bool = True,
                      scenario: str | None = None, seed: int = 0) -> dict:
    """Measure the chain's latency with rank 1's share at 0%..100% in `steps` steps, `repeat`
    interleaved rounds (alternating direction), medians; and the planner's share from a profile
    measured first. All ranks call it; every rank gets the result dict."""
    comm = _mpi(comm)
    rank, world = comm.Get_rank(), comm.Get_size()
    if world < 2:
        raise InputError("the offload experiment needs 2 or more ranks (rank 0 offloads to rank 1); "
                         "run it as `mpiexec -n 2 hepti bench offload --sweep`")
    if steps < 2 or repeat < 1:
        raise InputError(f"need steps >= 2 and repeat >= 1, got steps={steps}, repeat={repeat}")
    t_start = time.perf_counter()
    packed = pack_weights(make_weights(K, CHAIN, seed))
    x = make_input(M, K, seed + 1) if rank == 0 else None
    shares = [j / (steps - 1) for j in range(steps)]
    counts = [share_counts(M, s, world) for s in shares]

    # validate before timing: every split assembles the single-device chain's result
    reference = chain_rows(x, packed) if rank == 0 else None
    max_err = 0.0
    for c in counts:
        out, _ = offload_once(comm, x, packed, c)
        if rank == 0:
            max_err = max(max_err, float(np.max(np.abs(out - reference))))
    profile = measure_offload_profile(comm, packed, M)
    bar = None
    if progress and rank == 0:
        from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)
        bar = tqdm(total=steps * repeat, desc=f"offload {scenario or ''}".strip(), unit="run",
                   file=sys.stderr, leave=False)
    by_step = interleave(range(steps), repeat, lambda j, _k: offload_once(comm, x, packed, counts[j])[1],
                         bar, order=alternate)
    runs = [by_step[j] for j in range(steps)]
    if bar is not None:
        bar.close()
    secondary = comm.bcast(runs if rank == 1 else None, root=1)  # rank 1's times
    result = None
    if rank == 0:
        planner = plan_share(profile)
        model = model_best(profile)
        sweep = []
        for j, s in enumerate(shares):
            row = {"share": s, "rows": counts[j][:2]}
            row.update(_summary(list(zip(runs[j], secondary[j]))))
            pred = predict(profile, counts[j])
            row.update(predicted_latency_s=pred["latency_s"], predicted_compute_s=pred["compute_s"],
                       predicted_comm_s=pred["comm_s"])
            sweep.append(row)
        best = min(sweep, key=lambda r: r["latency_s"])
        state = read_state()  # the emulated devices, when run under `hepti emulate`
        result = {
            **result_doc("offload"), "scenario": scenario,
            "shape": {"m": M, "k": K, "n": K, "chain": CHAIN}, "world_size": world,
            "steps": steps, "repeat": repeat, "max_abs_err": max_err,
            "measured_best_share": best["share"], "measured_best_latency_s": best["latency_s"],
            "alone_latency_s": sweep[0]["latency_s"],
            "planner": planner, "model_best": model, "profile": profile, "sweep": sweep,
            "emulated": None if state is None else {
                "spec": state.get("spec"),
                "devices": [{k: d.get(k) for k in ("name", "cpu", "link_mbit")}
                            for d in state.get("devices", [])]},
        }
    result = comm.bcast(result, root=0)
    result["wall_s"] = time.perf_counter() - t_start
    return result


# --- reporting -------------------------------------------------------------------------------------

def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def format_offload(result: dict) -> str:
    """A table of one sweep: latency (measured and predicted) and its parts at every share."""
    prof = result["profile"]["devices"]
    speeds = [max(v for _, v in d["gemm_flops"]) / 1e9 for d in prof[:2]]
    link = prof[1]["bandwidth_Bps"] * 8 / 1e6
    head = (f"offload sweep{' ' + result['scenario'] if result.get('scenario') else ''}: "
            f"{result['shape']['chain']} MatMuls [{result['shape']['m']},{result['shape']['k']}]x"
            f"[{result['shape']['k']},{result['shape']['n']}], median of {result['repeat']}\n"
            f"profile: primary {speeds[0]:.1f} GFLOP/s, secondary {speeds[1]:.1f} GFLOP/s, "
            f"link {link:.0f} Mbit/s ({prof[1]['latency_s'] * 1e6:.0f} us)\n")
    lines = [f"{'share':>6} {'rows':>8} {'latency ms':>11} {'predicted':>10} "
             f"{'compute p/s ms':>15} {'comm ms':>8} {'(in+out)':>11}"]
    for r in result["sweep"]:
        lines.append(f"{r['share']:>6.0%} {r['rows'][0]:>3}/{r['rows'][1]:<4} {_ms(r['latency_s']):>11} "
                     f"{_ms(r['predicted_latency_s']):>10} "
                     f"{_ms(r['compute_s'][0]):>7}/{_ms(r['compute_s'][1]):<7} {_ms(r['comm_s']):>8} "
                     f"{_ms(r['comm_in_s']):>5}+{_ms(r['comm_out_s']):<5}")
    pl = result["planner"]
    tail = (f"measured best: {result['measured_best_share']:.0%} "
            f"({_ms(result['measured_best_latency_s'])} ms; "
            f"primary alone {_ms(result['alone_latency_s'])} ms); planner: {pl['share']:.1%} "
            f"({pl['rows'][1]} rows, predicted {_ms(pl['predicted_latency_s'])} ms, "
            f"solved in {pl['solve_s'] * 1e3:.0f} ms); the model's optimum (every row count): "
            f"{result['model_best']['share']:.1%}; result max |error| {result['max_abs_err']:.1e}")
    return head + "\n".join(lines) + "\n" + tail


# --- all scenarios: bin/bench-offload.sh -------------------------------------------------------

PAPER_BEST = {(940, "full"): 0.9, (240, "full"): 0.7, (940, "quarter"): 0.5, (240, "quarter"): 0.3}
NEAR_BEST = 0.03  # shares whose median latency is within 3% of the best are "near best"


def _scenario_key(result: dict) -> tuple[float, float]:
    """(secondary's link in Mbit/s, its CPU relative to the primary's), from the emulation."""
    emu = result.get("emulated") or {}
    devs = emu.get("devices") or []
    if len(devs) >= 2 and devs[0].get("cpu"):
        return float(devs[1]["link_mbit"]), float(devs[1]["cpu"]) / float(devs[0]["cpu"])
    link = result["profile"]["devices"][1]["bandwidth_Bps"] * 8 / 1e6
    return link, 1.0


def _label(result: dict) -> str:
    mbit, cpu = _scenario_key(result)
    return f"{mbit:.0f} Mbit/s, secondary CPU {cpu:.0%}"


def _within_one_step(result: dict) -> bool:
    """Is the planner's share within one step of the sweep's grid of the measured best? Compared
    in rows, as both are run: a step is the largest row difference between neighbouring grid
    shares (26 rows for 10% of 256), so 40% (102 rows, 39.8%) is one step from 50% (128)."""
    rows = [row["rows"][1] for row in result["sweep"]]
    step = max(abs(b - a) for a, b in zip(rows, rows[1:]))
    best = next(row["rows"][1] for row in result["sweep"]
                if row["share"] == result["measured_best_share"])
    return abs(result["planner"]["rows"][1] - best) <= step


def _move(before: float, after: float) -> str:
    return "falls" if after < before - 1e-9 else ("rises" if after > before + 1e-9 else "stays")


def collect(results: list[dict]) -> dict:
    """Combine per-scenario sweeps: a summary row each (measured best, planner's share, whether
    it is within one step) and the direction checks (does the best share fall when the link or
    the secondary's CPU does, as in the paper?)."""
    results = sorted(results, key=lambda r: (-_scenario_key(r)[1], -_scenario_key(r)[0]))  # paper order
    summary = []
    for r in results:
        mbit, cpu = _scenario_key(r)
        paper = PAPER_BEST.get((round(mbit), "full" if cpu > 0.5 else "quarter"))
        near = min(r["sweep"], key=lambda row: abs(row["share"] - r["planner"]["share"]))
        summary.append({
            "scenario": r.get("scenario"), "label": _label(r), "link_mbit": mbit, "secondary_cpu": cpu,
            "measured_best_share": r["measured_best_share"],
            "measured_best_latency_s": r["measured_best_latency_s"],
            "near_best_shares": [row["share"] for row in r["sweep"]
                                 if row["latency_s"] <= r["measured_best_latency_s"] * (1 + NEAR_BEST)],
            "alone_latency_s": r["alone_latency_s"],
            "planner_share": r["planner"]["share"],
            "planner_predicted_latency_s": r["planner"]["predicted_latency_s"],
            "latency_at_planner_step_s": near["latency_s"],  # measured, at the nearest grid share
            "model_best_share": r["model_best"]["share"],
            "planner_within_one_step": _within_one_step(r),
            "paper_best_share": paper})
    moves = []
    by_key = {(row["link_mbit"], row["secondary_cpu"]): row for row in summary}
    for (mbit, cpu), row in by_key.items():
        for (m2, c2), other in by_key.items():
            slower_link = c2 == cpu and m2 < mbit
            slower_cpu = m2 == mbit and c2 < cpu
            if slower_link or slower_cpu:
                a, b = row["measured_best_share"], other["measured_best_share"]
                pa, pb = row["planner_share"], other["planner_share"]
                moves.append({"from": row["label"], "to": other["label"],
                              "what": "link" if slower_link else "cpu",
                              "measured": [a, b], "planner": [pa, pb],
                              "measured_move": _move(a, b), "planner_move": _move(pa, pb)})
    checks = {
        "planner_within_one_step_everywhere": all(r["planner_within_one_step"] for r in summary),
        "measured_best_never_rises": all(m["measured_move"] != "rises" for m in moves),
        "measured_best_falls": f"{sum(m['measured_move'] == 'falls' for m in moves)} of {len(moves)}",
        "planner_share_falls": f"{sum(m['planner_move'] == 'falls' for m in moves)} of {len(moves)}",
    }
    return {**result_doc("offload"),
            "paper": {"alone_ms": 109.3, "best_share": {f"{k[0]} Mbit/s, {k[1]} CPU": v
                                                         for k, v in PAPER_BEST.items()}},
            "summary": summary, "moves": moves, "checks": checks, "scenarios": results}


def format_summary(combined: dict) -> str:
    lines = [f"{'scenario':<34} {'alone ms':>8} {'best':>5} {'best ms':>8} {'planner':>8} "
             f"{'at step ms':>10} {'model':>6} {'paper':>6}  {'within 1 step':<14} near best (3%)"]
    for r in combined["summary"]:
        paper = f"{r['paper_best_share']:.0%}" if r["paper_best_share"] is not None else "-"
        lines.append(f"{r['label']:<34} {r['alone_latency_s'] * 1e3:>8.1f} "
                     f"{r['measured_best_share']:>5.0%} "
                     f"{r['measured_best_latency_s'] * 1e3:>8.1f} {r['planner_share']:>8.1%} "
                     f"{r['latency_at_planner_step_s'] * 1e3:>10.1f} {r['model_best_share']:>6.1%} "
                     f"{paper:>6}  {'yes' if r['planner_within_one_step'] else 'NO':<14} "
                     + ", ".join(f"{v:.0%}" for v in r["near_best_shares"]))
    for m in combined["moves"]:
        lines.append(f"{m['what']:>4} falls: {m['from']} -> {m['to']}: measured best "
                     f"{m['measured'][0]:.0%} -> {m['measured'][1]:.0%} ({m['measured_move']}), planner "
                     f"{m['planner'][0]:.1%} -> {m['planner'][1]:.1%} ({m['planner_move']})")
    c = combined["checks"]
    lines.append(f"planner within one 10% step of the measured best everywhere: "
                 f"{'yes' if c['planner_within_one_step_everywhere'] else 'NO'}; measured best never "
                 f"rises: {'yes' if c['measured_best_never_rises'] else 'NO'} (falls in "
                 f"{c['measured_best_falls']}); planner's share falls in {c['planner_share_falls']}")
    return "\n".join(lines)


def plot_offload(combined: dict, path: str) -> bool:
    """Latency against offloaded share, one line per scenario (measured medians, solid; the cost
    model, dashed), measured best (star) and planner's share (triangle) marked; the right panel
    zooms on the minima. False (and a message) when matplotlib is missing."""
    try:
        import matplotlib  # local: optional dependency
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # local: optional dependency
        from matplotlib.lines import Line2D  # local: optional dependency
    except ImportError:
        print("bench offload: matplotlib is not installed, so no plot was drawn (the JSON is "
              "written); `pip install matplotlib` to get it", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), gridspec_kw={"width_ratios": [1.2, 1]})
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    zoom_max = 0.0
    for j, r in enumerate(combined["scenarios"]):
        col = colors[j % len(colors)]
        x = [row["share"] * 100 for row in r["sweep"]]
        y = [row["latency_s"] * 1e3 for row in r["sweep"]]
        yp = [row["predicted_latency_s"] * 1e3 for row in r["sweep"]]
        best = r["measured_best_share"] * 100, r["measured_best_latency_s"] * 1e3
        pl = r["planner"]["share"] * 100, r["planner"]["predicted_latency_s"] * 1e3
        zoom_max = max(zoom_max, r["alone_latency_s"] * 1e3)
        for ax in axes:
            ax.plot(x, y, "o-", color=col, lw=1.8, ms=4, label=_label(r))
            ax.plot(x, yp, "--", color=col, lw=1.0, alpha=0.8)
            ax.plot(*best, "*", color=col, ms=16, mec="black", mew=0.8, zorder=5)
            ax.plot(*pl, "^", color=col, ms=10, mec="black", mew=0.8, zorder=5)
            ax.axvline(pl[0], color=col, ls=":", lw=0.9, alpha=0.7)
    axes[0].set_title("Latency against the share offloaded to the secondary")
    axes[1].set_title("Near the best shares")
    axes[1].set_xlim(-2, 62)
    axes[1].set_ylim(0, zoom_max * 1.6)
    for ax in axes:
        ax.set_xlabel("rows offloaded to the secondary (%)")
        ax.set_ylabel("latency (ms, median)")
        ax.grid(alpha=0.3)
    first = combined["scenarios"][0] if combined["scenarios"] else {}
    shape = first.get("shape", {})
    devs = (first.get("emulated") or {}).get("devices") or []
    where = f"emulated pairs, primary {devs[0]['cpu']:g} core" if devs else "two ranks"
    handles = axes[0].get_legend_handles_labels()[0] + [
        Line2D([], [], color="gray", ls="--", label="cost model (measured profile)"),
        Line2D([], [], color="gray", marker="*", ls="", ms=12, mec="black", label="measured best"),
        Line2D([], [], color="gray", marker="^", ls="", ms=9, mec="black", label="planner's share")]
    axes[0].legend(handles=handles, fontsize=8, loc="upper left")
    fig.suptitle(f"Hepti's motivating experiment, {where}: {shape.get('chain', CHAIN)} MatMuls "
                 f"[{shape.get('m', M)},{shape.get('k', K)}]x[{shape.get('k', K)},{shape.get('n', K)}]",
                 fontsize=11)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def warm() -> None:
    """Compile (or load from Numba's cache) the kernels the sweep runs, outside any emulation:
    a capped 0.15-core device would otherwise spend many seconds compiling them."""
    packed = pack_weights(make_weights(K, 2))
    for rows in (1, 7, 33, M):
        chain_rows(make_input(rows, K), packed)


def add_arguments(ap) -> None:
    ap.add_argument("--specs", default=",".join(SPECS),
                    help="the emulated pairs (hostfiles/NAME.json) the driver sweeps, one launch "
                         "each (default %(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per launch (default 600)")
    ap.add_argument("--out", metavar="FILE.json", default=None,
                    help="write the result here (default results/offload.json; with --sweep: "
                         "only if given)")
    ap.add_argument("--plot", metavar="FILE.png", default=None,
                    help="draw latency against share (default results/offload.png beside --out)")
    ap.add_argument("--steps", type=at_least(2), default=11,
                    help="shares 0..1 in steps-1 steps (default 11)")
    ap.add_argument("--repeat", type=positive_int, default=7, help="interleaved rounds (default 7)")
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--sweep", action="store_true",
                      help="one sweep, under `mpiexec -n 2` (what each launch of the driver runs)")
    mode.add_argument("--collect", nargs="+", metavar="SWEEP.json",
                      help="combine these sweeps (no MPI)")
    mode.add_argument("--warm", action="store_true", help="compile the kernels and exit (no MPI)")
    ap.add_argument("--scenario", help="with --sweep: a name for this run, e.g. the emulated spec's")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")


def run(args) -> int:
    if args.warm:
        warm()
        return 0
    if args.sweep:
        return sweep_under_mpi(args)
    if args.collect:
        sweeps = [json.loads(Path(p).read_text()) for p in args.collect]
    else:
        sweeps = drive(args)
    combined = collect(sweeps)
    out = Path(args.out or "results/offload.json")
    write_json(combined, out)
    print(f"wrote {out}", file=sys.stderr)
    plot = args.plot or str(out.with_suffix(".png"))
    if plot_offload(combined, plot):
        print(f"wrote {plot}", file=sys.stderr)
    print(format_summary(combined))
    return 0


def drive(args) -> list[dict]:
    """The kernels compiled here, then one `hepti emulate --cluster SPEC -- mpiexec -n 2 hepti
    bench offload --sweep` per spec (root): the sweeps."""
    specs = [s for s in args.specs.split(",") if s]
    paths = [HOSTFILES / f"{s}.json" for s in specs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        raise InputError(f"no such spec: {', '.join(missing)}; the pairs are in hostfiles/")
    if os.geteuid() != 0:
        raise InputError("the sweeps run under `hepti emulate`, which needs root: run it with "
                         "sudo, or sweep by hand with `mpiexec -n 2 hepti bench offload --sweep`")
    warm()  # compile the kernels here, not on a 0.15-core device
    sweeps = []
    with tempfile.TemporaryDirectory(prefix="hepti-offload-") as tmp:
        for name, path in zip(specs, paths):
            print(f"== {name}", file=sys.stderr, flush=True)
            out = Path(tmp) / f"{name}.json"
            launch(hepti_cmd() + ["bench", "offload", "--sweep", "--scenario", name, "--repeat",
                                  str(args.repeat), "--steps", str(args.steps), "--out", str(out)],
                   ranks=2, spec=path, timeout=args.timeout)
            sweeps.append(json.loads(out.read_text()))
    return sweeps


def sweep_under_mpi(args) -> int:
    """One sweep on this job's ranks; rank 0 prints (and writes --out)."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    comm = MPI.COMM_WORLD
    try:
        res = run_offload_sweep(comm, steps=args.steps, repeat=args.repeat,
                                progress=not args.no_progress, scenario=args.scenario)
    except InputError as e:
        if comm.Get_rank() == 0:
            print(f"hepti bench offload: {e}", file=sys.stderr)
        return 2
    if comm.Get_rank() == 0:
        if args.out:
            write_json(res, args.out)
        print(json.dumps(res, indent=2) if args.json else format_offload(res))
        if args.out:
            print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
