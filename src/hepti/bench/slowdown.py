"""`hepti bench slowdown`: is an emulated device uniformly slower? (root)

A device emulated at share s should run every compute phase, however short, in 1/s of the time
it takes uncapped, and still move bytes at its link's rate. This measures both on two-device
clusters under `hepti emulate`: rank 0 ("hub", 1.0 core: a single thread is never throttled)
and rank 1 (the device under test, s core), 940 Mbit/s links. Per round, interleaved:
- the hub times each phase uncapped: a Numba GeMM (`hepti.kernels.gemm`, [m, 768] x [768, 768],
  m sized on the hub to take 0.1, 1, 10 or 100 ms), by its CPU seconds, each after a sleep as
  long as the gap the device leaves between its phases (so that both meet caches equally cold:
  a 0.1 ms phase reads a 2.4 MB weight that the machine's other jobs evict in the gaps, and
  took 0.5 ms of CPU after 3 ms asleep against 0.1 back to back), right before the device's
  block;
- the device times the same phases three ways: `alone` (back to back), `sleep` (each phase
  followed by a sleep of 1/s of the phase's uncapped time, as a rank waits for a peer of its
  own speed) and `mpi` (each phase followed by an exchange with the hub, which answers after
  that long; through hepti.parallel.comm's verbs, as a forward waits at a collective). Each
  phase and wait is a `Tracer` span, as in the executors;
- ping-pong with the hub (hepti.parallel.profiling.ping_pong, the profile's own) at 1 and 4 MiB,
  alone and each right after a 10 ms compute phase.
The ratio quoted is measured / (uncapped / s), each device block against the hub's block just
before it (the machine is shared: its speed drifts over minutes), the median: 1.0 is a faithful
device; below 1 it ran faster than its share. `_matched` ratios take instead a second hub block
run right after the device's, each phase one device cycle (phase and wait, as measured) after
the last: on this VM a phase that follows an idle gap costs more CPU than one back to back (a
0.1 ms GeMM: 0.096 ms warm, 0.148 ms after 0.6 ms asleep), and a device slowed by sleeping
idles longer between phases than the first block's nominal gap assumes, so at 0.1 ms the two
references differ; the stretch scales the CPU the phase took, whichever it was. `median` is the
median phase; `mean` the block's wall time per phase. Bandwidth is one-way payload bytes/s
against the link's rate.

    sudo hepti bench slowdown [--rounds 3] [--launches 2] [--shares 0.15,0.3,0.6]
                              [--modes quota,stretch] [--out results/slowdown.json]

`--modes`: `quota` runs with HEPTI_EMULATE_STRETCH=0 (the device is a CFS quota of s alone),
`stretch` with HEPTI_EMULATE_STRETCH=1 (hepti.emulate.stretch). Launches take turns over shares
and modes (hepti.bench.harness.interleave), and each launch runs `--rounds` interleaved rounds;
medians over every round.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hepti import kernels as K
from hepti.bench import harness
from hepti.bench.harness import git_commit, positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.emulate.state import current_device
from hepti.parallel.comm import Comm, wait
from hepti.parallel.profile_links import ping_pong
from hepti.parallel.trace import Tracer

TARGETS_S = (1e-4, 1e-3, 1e-2, 1e-1)
WIDTH = 768
LINK_MBIT = 940.0
PING_BYTES = (1 << 20, 4 << 20)
WAYS = ("alone", "sleep", "mpi")
STRETCH_ENV = "HEPTI_EMULATE_STRETCH"


def _reps(target: float) -> int:
    return {1e-4: 200, 1e-3: 60, 1e-2: 12, 1e-1: 4}[target]


# --- the worker: runs on the emulated pair ----------------------------------------------------

def worker(out: str, rounds: int) -> None:
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)


    mpi = MPI.COMM_WORLD
    rank = mpi.Get_rank()
    assert mpi.Get_size() == 2, "hepti.bench.slowdown runs on 2 ranks: hub and device"
    tr = Tracer(rank)
    g = Comm(mpi, tr, transport="p2p")
    rng = np.random.default_rng(rank)
    w = K.pack_b(rng.standard_normal((WIDTH, WIDTH), dtype=np.float32) * np.float32(0.03))

    def gemm_s(m: int, n: int = 5) -> float:
        x = rng.standard_normal((m, WIDTH), dtype=np.float32)
        c = np.empty((m, WIDTH), np.float32)
        K.gemm(x, w, out=c)
        ts = []
        for _ in range(n):
            t0 = time.perf_counter()
            K.gemm(x, w, out=c)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    # sizes, on the uncapped hub: m with gemm time ~ target
    if rank == 0:
        per_row = gemm_s(2048) / 2048
        ms = []
        for t in TARGETS_S:
            m = max(1, round(t / per_row))
            for _ in range(3):  # small m are slower per row: correct twice
                m = max(1, round(m * t / gemm_s(m, 9)))
            ms.append(m)
    else:
        ms = None
    ms = mpi.bcast(ms, root=0)
    share = mpi.bcast(None if rank == 0 else _my_share(), root=1)
    hot = {m: statistics.median(gemm_s(m, 9) for _ in range(3)) for m in ms} if rank == 0 else None
    if rank == 0:  # the hub is the uncapped reference, never stretched
        try:
            from hepti.emulate import stretch  # local: guarded for trees from before the stretch
            stretch.disable()
        except ImportError:
            pass
    bufs = {m: (rng.standard_normal((m, WIDTH), dtype=np.float32), np.empty((m, WIDTH), np.float32))
            for m in ms}
    token = np.zeros(16, np.float32)
    rec = {"share": share, "rows": ms, "uncapped": {}, "device": {}, "ping": {}}
    for t in TARGETS_S:
        rec["uncapped"][str(t)] = []
        rec["device"][str(t)] = {way: {"median": [], "mean": []} for way in WAYS}
    for key in ("alone", "after_compute"):
        rec["ping"][key] = {str(b): [] for b in PING_BYTES}

    def phase(m: int) -> float:
        x, c = bufs[m]
        t0 = time.perf_counter()
        with tr.span("phase", "compute"):
            K.gemm(x, w, out=c)
        return time.perf_counter() - t0

    def hub_phase(m: int) -> float:
        """The uncapped reference: the phase's CPU seconds (its wall time, less what other jobs
        of this shared machine took from it), with the same span around it as the device's
        `phase`: a slow board runs the Python around a kernel slower too, and at 0.1 ms that
        is a visible part of the phase."""
        x, c = bufs[m]
        t0 = time.thread_time()
        with tr.span("phase", "compute"):
            K.gemm(x, w, out=c)
        return time.thread_time() - t0

    def sync():
        wait(mpi.Ibarrier())

    for rnd in range(rounds):
        ways = harness.round_order(WAYS, rnd)
        for t, m in zip(TARGETS_S, ms):
            n = _reps(t)
            for way in ways:
                # the hub uncapped, then the device, back to back: the machine is shared, and a
                # reference taken minutes apart from what it is compared with drifts with its load
                sync()
                if rank == 0:
                    hub_phase(m)
                    hub = []
                    # the device's timeline, uncapped: each phase after the gap the device
                    # leaves between its phases (its stretch, and its wait), so that both meet
                    # caches as cold (this shared machine's other jobs run in the gaps)
                    gap = hot[m] * (1 / share - 1) + (hot[m] / share if way != "alone" else 0.0)
                    for _ in range(n):
                        hub.append(hub_phase(m))
                        time.sleep(gap)
                    rec["uncapped"][str(t)].append(statistics.median(hub))
                    rec.setdefault("uncapped_by_way", {}).setdefault(f"{t}:{way}", []).append(
                        statistics.median(hub))
                wait_s = mpi.bcast(hot[m] / share if rank == 0 else None, root=0)
                sync()
                if rank == 1:
                    phase(m)
                    times = []
                    throttled = _throttled_us()
                    start = time.perf_counter()
                    for _ in range(n):
                        times.append(phase(m))
                        if way == "sleep":
                            with tr.span("wait", "sleep"):
                                time.sleep(wait_s)
                        elif way == "mpi":
                            g.send_array(token, 0)
                            g.recv_array(0)
                    block = time.perf_counter() - start
                    d = rec["device"][str(t)][way]
                    if throttled is not None:  # the quota's share of the block, per phase
                        d.setdefault("throttled_s", []).append((_throttled_us() - throttled) / 1e6 / n)
                    d["median"].append(statistics.median(times))
                    d["mean"].append(sum(times) / n if way != "alone" else block / n)
                    mpi.send(block / n, dest=0, tag=7)
                else:
                    if way == "mpi":
                        for _ in range(n):
                            g.recv_array(1)
                            time.sleep(wait_s)
                            g.send_array(token, 1)
                    # the matched reference: the hub again, right after, each phase starting
                    # one device cycle after the last (the device's measured time per phase and
                    # wait), so that its caches sit idle as long as the device's did
                    cycle = mpi.recv(source=1, tag=7)
                    hub = []
                    for _ in range(n):
                        t0 = time.perf_counter()
                        hub.append(hub_phase(m))
                        time.sleep(max(0.0, cycle - (time.perf_counter() - t0)))
                    rec.setdefault("uncapped_matched_by_way", {}).setdefault(f"{t}:{way}", []).append(
                        statistics.median(hub))
        # ping-pong, alone and right after a 10 ms compute phase on the device
        m10 = ms[TARGETS_S.index(1e-2)]
        for key in ("alone", "after_compute"):
            for nbytes in PING_BYTES:
                ts = []
                for _ in range(5):
                    sync()
                    if key == "after_compute" and rank == 1:
                        phase(m10)
                    ts.append(ping_pong(mpi, 1, nbytes, 1))
                if rank == 0:
                    rec["ping"][key][str(nbytes)].append(nbytes / statistics.median(ts))
    rec["device_stretch"] = mpi.bcast(_stretch_state() if rank == 1 else None, root=1)
    if rank == 0:
        dev = mpi.recv(source=1, tag=99)
        rec["device"] = dev
        Path(out).write_text(json.dumps(rec))
    else:
        mpi.send(rec["device"], dest=0, tag=99)


def _stretch_state() -> dict | None:
    try:
        from hepti.emulate import stretch  # local: guarded for trees from before the stretch
    except ImportError:  # before the stretch existed: the quota alone
        return None
    return stretch.describe()


def _throttled_us() -> float | None:
    """Microseconds this process's cgroup has been throttled by its CPU quota (`cpu.stat`:
    cgroup v1's throttled_time in ns, v2's throttled_usec), or None where it cannot be read: a
    block that was throttled ran slower than its stretch alone would make it."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            if "cpu" in controllers.split(","):  # v1
                stat, key, scale = Path(f"/sys/fs/cgroup/{controllers}{rel}/cpu.stat"), "throttled_time", 1e-3
                break
        else:  # v2: the one line "0::/path"
            rel = Path("/proc/self/cgroup").read_text().strip().split(":", 2)[2]
            stat, key, scale = Path(f"/sys/fs/cgroup{rel}/cpu.stat"), "throttled_usec", 1.0
        for line in stat.read_text().splitlines():
            k, value = line.split()
            if k == key:
                return float(value) * scale
    except (OSError, IndexError, ValueError):
        pass
    return None


def _my_share() -> float:
    dev = current_device()
    if dev is None:
        raise SystemExit("hepti.bench.slowdown worker: run it under `hepti emulate` (no device found)")
    return float(dev["cpu"])


# --- the driver: launches the pairs and sums up ---------------------------------------------------

def spec(share: float) -> dict:
    return {"name": f"slowdown-{share:g}", "description": "hepti.bench.slowdown: hub + device",
            "devices": [{"name": "hub", "cpu": 1.0, "link_mbit": LINK_MBIT},
                        {"name": "device", "cpu": share, "link_mbit": LINK_MBIT}]}


def launch(share: float, mode: str, rounds: int, tmp: Path) -> dict:
    spec_path = tmp / f"spec-{share:g}.json"
    spec_path.write_text(json.dumps(spec(share)))
    out = tmp / f"out-{share:g}-{mode}.json"
    harness.launch([sys.executable, "-m", "hepti.bench.slowdown", "--worker", str(out),
                   "--rounds", str(rounds)], ranks=2, spec=spec_path,
                   env={STRETCH_ENV: "0" if mode == "quota" else "1"})
    return json.loads(out.read_text())


def _hub(r: dict, t: float, way: str, matched: bool = False) -> list[float]:
    """The hub's uncapped phase medians that preceded each of the device's blocks (older
    files: the round's one uncapped figure for every way), or with `matched` the ones that
    followed it on the device's own timeline (None in older files)."""
    if matched:
        by_way = r.get("uncapped_matched_by_way")
        return None if by_way is None else by_way[f"{t}:{way}"]
    by_way = r.get("uncapped_by_way")
    if by_way is not None:
        return by_way[f"{t}:{way}"]
    return r["uncapped"][str(t)]


def summarize(runs: list[dict]) -> dict:
    """Medians over every round of every launch, by mode, share, phase and way."""
    out: dict = {}
    for r in runs:
        out.setdefault(r["mode"], {}).setdefault(str(r["share"]), []).append(r)
    table = {}
    for mode, by_share in out.items():
        table[mode] = {}
        for share, rs in by_share.items():
            s = float(share)
            row = {"phases": {}, "ping": {}, "stretch": rs[0].get("device_stretch")}
            for t in TARGETS_S:
                unc = statistics.median(x for r in rs for x in r["uncapped"][str(t)])
                ph = {"uncapped_s": unc, "nominal_s": unc / s}
                for way in WAYS:
                    for stat in ("median", "mean"):
                        ph[f"{way}_{stat}_s"] = statistics.median(
                            d for r in rs for d in r["device"][str(t)][way][stat])
                        # each device block against the hub's block just before it, same way,
                        # and against the one right after it on its own timeline (when recorded)
                        for suffix, matched in (("", False), ("_matched", True)):
                            hubs = [_hub(r, t, way, matched) for r in rs]
                            if any(h is None for h in hubs):
                                continue
                            ph[f"{way}_{stat}_ratio{suffix}"] = statistics.median(
                                d / (h / s) for r, hs in zip(rs, hubs)
                                for d, h in zip(r["device"][str(t)][way][stat], hs))
                    throttled = [x for r in rs for x in r["device"][str(t)][way].get("throttled_s", [])]
                    if throttled:  # the guard quota's throttling, per phase (should be ~0 below 1 ms)
                        ph[f"{way}_throttled_s"] = statistics.median(throttled)
                row["phases"][f"{t * 1e3:g}ms"] = ph
            for key in ("alone", "after_compute"):
                for b in PING_BYTES:
                    bps = statistics.median(x for r in rs for x in r["ping"][key][str(b)])
                    row["ping"][f"{key}_{b >> 20}MiB"] = {"Bps": bps,
                                                         "ratio_to_link": bps * 8 / (LINK_MBIT * 1e6)}
            table[mode][share] = row
    return table


def format_table(table: dict) -> str:
    lines = []
    for mode, by_share in table.items():
        lines.append(f"mode {mode}: measured / (uncapped / share), median phase (mean) matched")
        lines.append(f"{'share':>6} {'phase':>6} {'alone':>18} {'sleep':>18} {'mpi':>18}   uncapped")
        for share, row in sorted(by_share.items(), key=lambda kv: float(kv[0])):
            for name, ph in row["phases"].items():
                cells = [f"{ph[f'{w}_median_ratio']:.2f} ({ph[f'{w}_mean_ratio']:.2f})"
                         + (f" {ph[f'{w}_median_ratio_matched']:.2f}" if f"{w}_median_ratio_matched" in ph else "")
                         for w in WAYS]
                lines.append(f"{float(share):>6g} {name:>6} " + " ".join(f"{c:>18}" for c in cells)
                             + f"   {ph['uncapped_s'] * 1e3:.3f} ms")
            pings = ", ".join(f"{k} {v['ratio_to_link']:.2f}" for k, v in row["ping"].items())
            lines.append(f"{'':>6} ping-pong / link: {pings}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds per launch (default 3)")
    ap.add_argument("--launches", type=positive_int, default=2,
                    help="launches per share and mode, interleaved (default 2)")
    ap.add_argument("--shares", default="0.15,0.3,0.6", help="default %(default)s")
    ap.add_argument("--modes", default="quota,stretch", help="default %(default)s")
    ap.add_argument("--out", default="results/slowdown.json", help="default %(default)s")
    ap.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)  # a rank of one launch


def run(args) -> int:
    if args.worker:
        worker(args.worker, args.rounds)
        return 0
    commit = git_commit()
    shares = [float(x) for x in args.shares.split(",")]
    modes = args.modes.split(",")
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="hepti-slowdown-") as tmp:
        def one(case, _k):
            share, mode = case
            r = launch(share, mode, args.rounds, Path(tmp))
            r["mode"] = mode
            print(f"[{time.time() - t0:.0f} s] share {share:g} {mode}: done", file=sys.stderr)
            return r
        by_case = harness.interleave([(sh, m) for sh in shares for m in modes], args.launches, one)
    runs = [r for rs in by_case.values() for r in rs]
    table = summarize(runs)
    print(format_table(table))
    doc = result_doc("slowdown", commit=commit, shares=shares, modes=modes, rounds=args.rounds,
                     launches=args.launches, link_mbit=LINK_MBIT, targets_s=list(TARGETS_S),
                     summary=table, runs=runs)
    write_json(doc, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
