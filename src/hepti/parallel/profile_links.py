"""What `hepti profile` measures of the network: each rank's link to rank 0 (ping-pong, fitted
to latency + bytes / bandwidth), allgathers among 2..N ranks through the runtime's own verb,
and the collectives' calibration against the cost model. All ranks call each measurement.

Messages go through the verbs module (hepti.parallel.comm: `Comm`, and `wait`, which sleeps
rather than spins on a capped rank); the ping-pong and the barriers use the communicator's own
non-blocking calls, waited for the same way. mpi4py is imported inside the functions that time
with MPI's clock, so importing this module does not start MPI.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

from hepti import kernels as K
from hepti.config import ModelConfig
from hepti.counts import counts as split, offsets
from hepti.emulate import stretch as _stretch
from hepti.graph.decoder import GREEDY_PAIR_BYTES, int8_bytes
from hepti.kernels.int8 import GROUP
from hepti.parallel.comm import Comm, wait
from hepti.plan.costmodel import Collective, collective_times
from hepti.plan.profile import profile_from_dict

PING_SIZES = (8, 4096, 65536, 262144, 1 << 20, 4 << 20)  # bytes; larger skipped on slow links
PING_TARGET_S = 0.06  # the largest message should take about this long one way


def barrier(comm) -> None:
    """A barrier that waits as the runtime waits (`hepti.parallel.comm.wait`: asleep on a
    CPU-capped rank). MPICH's blocking barrier spins: a rank done measuring early would burn its
    quota and, sharing a CPU with a rank still measuring, evict that rank's caches."""
    wait(comm.Ibarrier())


def fit_link(points: list[tuple[float, float]]) -> tuple[float, float]:
    """one-way time = latency + bytes / bandwidth -> (latency_s, bandwidth_Bps): the bandwidth
    from the two largest messages, the latency from the smallest. (A shaped link, like a switch
    port, passes a burst at line rate: a fit over all sizes took 940/240/100 Mbit/s links for
    1533/329/173.)"""
    pts = sorted(points)
    x = np.array([p[0] for p in pts], float)
    y = np.array([p[1] for p in pts], float)
    slope = (y[-1] - y[-2]) / (x[-1] - x[-2]) if len(x) > 1 else y[-1] / x[-1]
    if slope <= 0:  # all sizes equally fast: take the largest message's rate
        slope = y[-1] / x[-1]
    return float(max(y[0] - x[0] * slope, 0.0)), float(1.0 / slope)


def link_credit(points: list[tuple[float, float]], latency_s: float, bandwidth_Bps: float
                ) -> float:
    """Bytes a link passes at once after an idle spell, beyond latency + bytes / bandwidth:
    the most any message below the two that fit the bandwidth (`fit_link`) came in ahead of
    that line, at most its own size; 0 on a link with no such credit. A ping-pong's message
    finds the link idle (the reply went the other way), as a halo exchange after a rank's
    compute does. The emulator's shaper (hepti.emulate.net: a 1 ms bucket and one packet)
    passed 17-19 KB of a 32-64 KB exchange at once on a 100 Mbit/s link and ~90 KB on a
    940 Mbit/s one (2026-12-01, two ranks exchanging both ways after 3 ms idle: 64 KB in 3.93
    ms where the line says 5.29); hepti.plan.coedge `exchange_seconds` takes it off each
    exchange's bytes."""
    pts = sorted(points)[:-2]
    best = 0.0
    for nbytes, t in pts:
        ahead = nbytes - max(0.0, t - latency_s) * bandwidth_Bps
        best = max(best, min(float(nbytes), ahead))
    return best


def ping_pong(comm, peer: int, nbytes: int, reps: int) -> float:
    """Median one-way seconds (half the round trip) of nbytes between rank 0 and `peer`, as
    timed by rank 0; both must call it. The first round trip is a warm-up."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    buf = np.zeros(max(nbytes, 1), np.uint8)
    rank = comm.Get_rank()
    times = []
    for _ in range(reps + 1):
        t0 = MPI.Wtime()
        if rank == 0:  # waited for as the runtime waits (hepti.parallel.comm.wait)
            wait(comm.Isend([buf, nbytes, MPI.BYTE], dest=peer, tag=7))
            wait(comm.Irecv([buf, nbytes, MPI.BYTE], source=peer, tag=7))
        else:
            wait(comm.Irecv([buf, nbytes, MPI.BYTE], source=0, tag=7))
            wait(comm.Isend([buf, nbytes, MPI.BYTE], dest=0, tag=7))
        times.append((MPI.Wtime() - t0) / 2)
    return statistics.median(times[1:])


COLLECTIVE_FLOATS = (16, 16384)  # per rank: an allgather's fixed cost, and its bytes' rate
COLLECTIVE_LONG_FLOATS = (65536, 262144)  # per rank: the rate a long allgather keeps up


def _line(x: tuple, t: tuple) -> tuple[float, float]:
    """(intercept, slope >= 0) of the line through (x[0], t[0]) and (x[1], t[1])."""
    slope = max(0.0, (t[1] - t[0]) / (x[1] - x[0]))
    return t[0] - x[0] * slope, slope


def measure_collectives(comm, reps: int = 15, long_reps: int = 5) -> dict:
    """{k: (seconds, seconds per byte, seconds, seconds per byte)} for k = 2..size: an allgather
    among ranks 0..k-1 through the runtime's own verb (hepti.parallel.comm `allgather_rows`,
    over the transport a forward uses), as two lines in the bytes a rank moves (the larger of
    sent and received), each fitted to two sizes: short messages (`COLLECTIVE_FLOATS`) and long
    ones (`COLLECTIVE_LONG_FLOATS`). The cost model takes the larger line (hepti.plan.coedge
    `CNNCosts.allgather`).

    Why two: a link shaped by a token bucket (the emulator's HTB, a switch's buffers) passes a
    burst faster than its rate. Fitted to 64 B and 64 KiB alone, the 4 emulated gigabit devices
    of emu-geneflow4 moved 150-190 MB/s, and a channel split's late maps, 0.2-0.8 MB a rank,
    took 1.3-1.75x that line's price; past the burst they went at 119 MB/s, the link's rate, on
    a line through ~0 (measured, 2-4 ranks, 0.26-3.1 MB a port). Each call starts after a
    barrier, as ranks sleep between tests of their requests on a capped device, and counts
    until the last of the k has it. All ranks call it; an empty dict on one rank."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    size, rank = comm.Get_size(), comm.Get_rank()
    out = {}
    if size == 1:
        return out
    world = Comm(comm)
    for k in range(2, size + 1):
        sub = world.split(rank < k)
        if sub is not None:
            times = {}
            for floats in COLLECTIVE_FLOATS + COLLECTIVE_LONG_FLOATS:
                a = np.ones((1, floats), np.float32)
                ts = []
                for r in range((reps if floats in COLLECTIVE_FLOATS else long_reps) + 1):
                    wait(sub.mpi.Ibarrier())
                    t0 = time.perf_counter()
                    sub.allgather_rows(a, [1] * k)
                    ts.append(time.perf_counter() - t0)
                times[floats] = statistics.median(
                    sub.mpi.allreduce(t, op=MPI.MAX) for t in ts[1:])
            lines = []
            for sizes in (COLLECTIVE_FLOATS, COLLECTIVE_LONG_FLOATS):
                nbytes = tuple(4 * f * (k - 1) for f in sizes)
                lines += _line(nbytes, tuple(times[f] for f in sizes))
            lines[0] = max(0.0, lines[0])  # a fixed cost; the long line's may be below 0
            out[k] = tuple(lines)
            sub.close()
        barrier(comm)
    world.close()
    return comm.bcast(out, root=0)


def measure_links(comm) -> list[dict]:
    """Every rank's path to rank 0: points, latency_s, bandwidth_Bps (rank 0's: None)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    out = []
    for peer in range(1, size):
        points = []
        for nbytes in PING_SIZES:
            reps = 20 if nbytes <= 65536 else 5
            t = ping_pong(comm, peer, nbytes, reps) if rank in (0, peer) else 0.0
            t = comm.bcast(t, root=0)
            points.append((nbytes, t))
            if t > PING_TARGET_S:  # a slow link: larger messages would take too long
                break
        lat, bw = fit_link(points)
        out.append({"rank": peer, "points": points, "latency_s": lat, "bandwidth_Bps": bw,
                    "credit_bytes": link_credit(points, lat, bw)})
    return out


def calibrate_collectives(comm, prof: dict, config: ModelConfig, rows: int, reps: int = 15) -> dict:
    """{kind: measured / modelled seconds} for the collectives the strategies use, timed for
    real on an [rows, C] activation split evenly over all ranks, through the runtime's own
    verbs. The analytic model (the verbs' algorithms over the measured links) has the right
    shape across sizes and subsets, but over shared memory or a real NIC its constants can be
    several times off; this puts them right at the size that matters.

    Each kind is timed two ways, and the slower counts. (1) After what precedes it in a
    forward: a GeMM (the FFN's down projection, on this rank's share of the columns) that
    writes the buffer it sends, then a barrier. Over shared memory that is what a forward
    pays: MiniLM's collectives (MPI's own, then) took 85-100 us there, as in the runtime's
    traces, against 35-40 us back to back; calibrated back to back only, 2-rank `tensor` on
    MiniLM was predicted 14-15% fast, all of it in the collectives. (2) Back to back, after a
    barrier only. Over a shaped link (hepti emulate's token bucket) the pause for the GeMM lets
    the bucket refill, and the collective then passes partly at veth speed: timed that way
    alone, Allgatherv came out 15-20% faster than back to back, and emulated `tensor` plans
    were predicted faster than they ran."""
    size, rank = comm.Get_size(), comm.Get_rank()
    C, F = config.hidden_size, config.intermediate_size
    rc = split(rows, [1.0] * size)
    row0 = offsets(rc)[rank]
    full = np.ones((rows, C), np.float32)
    mine = np.ones((rc[rank], C), np.float32)
    f = max(1, F // size)
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((rows, f), dtype=np.float32)
    down = K.pack_b(rng.standard_normal((f, C), dtype=np.float32) / np.float32(math.sqrt(f)))

    g = Comm(comm)
    part = [full]  # where the partial sums are: the verb's own buffer, as in a forward, if any

    def compute():  # the down projection's partial sums, and this rank's rows of them
        buf = g.partial_buffer(full.shape)
        part[0] = full if buf is None else buf
        K.gemm(x, down, out=part[0])
        mine[:] = part[0][row0:row0 + rc[rank]]

    def no_compute():
        part[0] = full

    if _stretch.ON:
        compute = _stretch.wrap(compute)

    probes = {  # the runtime's own verbs
        "reduce_scatter": lambda: g.reduce_scatter_rows(part[0], rc),
        "allgatherv": lambda: g.allgather_rows(mine, rc),
        "bcast": lambda: g.bcast_to_all(full, full.shape),
    }
    profile = profile_from_dict(prof, "measured profile")
    factors = {}
    for kind, fn in probes.items():
        coll = Collective(kind, None if kind == "bcast" else "rows", 4.0 * C * (rows if kind == "bcast" else 1))
        factors[kind] = _factor(comm, fn, (compute, no_compute), coll, {"rows": rc}, profile, reps)
    # Scatterv/Gatherv move the same bytes from/to one root as a Bcast does to all
    factors["scatterv"] = factors["gatherv"] = factors["bcast"]
    g.close()
    return factors


def _factor(comm, fn, befores, coll: Collective, counts: dict, profile, reps: int) -> float:
    """Measured / modelled seconds of `coll`, run by `fn` on every rank: each rank's median of
    `reps` calls, each after one of `befores` (the slowest of those ways) and a barrier; the
    slowest rank's against the cost model's time, held to [0.2, 50]."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    def timed(before) -> float:
        ts = []
        for _ in range(reps):
            before()
            barrier(comm)  # a spinning barrier would spend a capped rank's quota first
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    fn()
    measured = comm.allreduce(max(timed(b) for b in befores), op=MPI.MAX)
    modelled = max(collective_times(coll, counts, [True] * comm.Get_size(), profile))
    return float(min(max(measured / modelled, 0.2), 50.0)) if modelled > 0 else 1.0


# The one-row allreduce is timed after this many decode layers' segments (an attention and an
# MLP GeMV, each followed by the sync, as a decode step makes them), and its weights are cycled
# in at most this many copies (enough to exceed the caches at llama-1b's width; a small model's
# fit in cache anyway)
CADENCE_LAYERS, CADENCE_MAX_COPIES = 24, 64


def decode_segments(config, share: float, rng, cold_bytes: float = 48 << 20,
                    max_copies: int = CADENCE_MAX_COPIES) -> list[tuple]:
    """This rank's two GeMVs of one decode layer at `share` of its weights, int8 (groups of
    `GROUP`) as x [1, C] times packed [C, n]: the attention's (q, k, v and o: (2G + 2) D per KV
    head) and the MLP's (3F) columns, at least one group each; in copies that together exceed
    `cold_bytes` (at most `max_copies`), so that each meets its weights cold, as a decode step
    meets every layer's."""
    C, D, G = config.hidden_size, config.head_dim, config.group
    cols = ((2 * G + 2) * D * config.num_key_value_heads, 3 * config.intermediate_size)
    ns = [max(GROUP, int(round(share * c / GROUP)) * GROUP) for c in cols]
    one = sum(C * n for n in ns) * int8_bytes(GROUP)
    copies = int(min(max_copies, max(2, math.ceil(cold_bytes / one))))

    def gemv(n):
        q = rng.integers(-127, 128, (n, C), dtype=np.int8)
        scales = rng.random((n, -(-C // GROUP)), dtype=np.float32) * np.float32(1e-3)
        return K.pack_q(K.QuantMatrix(q, scales, GROUP), trans=True)

    return [tuple(gemv(n) for n in ns) for _ in range(copies)]


def cadence_allreduce_s(g: Comm, segments: list[tuple], C: int, layers: int = CADENCE_LAYERS
                        ) -> tuple[list[float], list[float]]:
    """(waits, segments' seconds) of this rank in each one-row allreduce of `layers` decode
    layers, timed as a decode step meets it: each of `segments`' GeMVs (cycled) writes the row
    and the allreduce follows at once, with no barrier, all inside one work span as
    `DecoderGroup.generate` runs them. On an emulated device the backlog is paid first (an
    empty wait span), so a wait runs from this rank's arrival to the verb's return (its wait
    for the last rank, then the transfer), and a segment's seconds from the previous verb's
    return to this arrival (its compute as the device runs it). One layer's warm-up first."""
    x = np.ones((1, C), np.float32)
    outs = [np.empty((1, w.n), np.float32) for w in segments[0]]
    row = np.zeros((1, C), np.float32)
    k = [min(C, w.n) for w in segments[0]]
    waits: list[float] = []
    spans: list[float] = []
    with g.tracer.span("decode cadence", "compute"):
        back = time.perf_counter()
        for i in range(layers + 1):
            for j, w in enumerate(segments[i % len(segments)]):
                K.gemm_any(x, w, out=outs[j])
                row[0, :k[j]] = outs[j][0, :k[j]]
                with g.tracer.span("pay", "wait"):  # the stretch's backlog, before arriving
                    pass
                t0 = time.perf_counter()
                g.allreduce_sum(row)
                t1 = time.perf_counter()
                if i:
                    waits.append(t1 - t0)
                    spans.append(t0 - back)
                back = t1
    return waits, spans


def sync_figures(spans: list[list[float]], waits: list[list[float]]) -> tuple[float, float]:
    """(jitter, seconds) of a group's decode syncs from each rank's segment seconds and its
    waits in the verb, call by call (`cadence_allreduce_s` on every rank of the group, the same
    calls). Every call waits for the last rank to arrive: with z = d / (the rank's mean d) - 1,
    the jitter is the mean over calls of the group's largest z (0 for one rank), the part of a
    phase's compute a sync adds past the slowest rank's mean. The ranks leave the previous
    verb together (to within its transfer), so a rank's wait is (the largest d - its d) and the
    transfer: the seconds are the mean over calls and ranks of what is left of the wait."""
    m = min(len(d) for d in spans)
    d = np.array([x[:m] for x in spans], float)
    w = np.array([x[:m] for x in waits], float)
    z = d / np.maximum(d.mean(axis=1, keepdims=True), 1e-12) - 1.0
    jitter = max(float(z.max(axis=0).mean()), 0.0) if len(d) > 1 else 0.0
    transfer = float(np.maximum(w - (d.max(axis=0) - d), 0.0).mean())
    return jitter, transfer


def calibrate_decoder_collectives(comm, prof: dict, config, reps: int = 30
                                  ) -> tuple[dict, dict]:
    """({kind: measured / modelled seconds}, jitter) for a decode step's collectives, through
    the verbs it calls (hepti.parallel.decoder): "allreduce", the one-row sum of C floats that
    every layer makes twice and the embedding once (`Comm.allreduce_sum`), and "allgather",
    greedy's (value, index) pair a rank (`Comm.allgather_small`). They are latency-bound, 1 +
    2L a token, so the link model's latency, fitted to ping-pongs of MPI's own, prices them only
    as well as the verbs' fixed costs (Python, the shared-memory slot's handshake, `wait`'s
    sleeps on a capped rank) match MPI's. Each is timed after a GeMV that makes its buffer (a
    rank's share of the MLP's down projection at one row) and a barrier, and back to back; the
    slower counts, as `calibrate_collectives` does for the encoders'.

    A decode step's syncs (the profile's `decode_syncs`: {"jitter": [J(1), ..., J(N)],
    "seconds": [S(1), ..., S(N)]}, for rank 0 with its n - 1 fastest others, the groups
    `tensor` is searched over): after a barrier the ranks arrive together, but in a step each
    arrives when its own GeMVs end and every sync waits for the last, and a group's transfer is
    its own, not the all-rank calibration's scaled to its links. So each group times its
    allreduce as a step meets it (`cadence_allreduce_s`: a layer's GeMV segments, each rank's
    share of a layer by its measured int8 GeMV bytes/s (`decode_segments`), each followed at
    once by the allreduce, no barrier), and `sync_figures` parts its waits into the jitter J(n)
    (relative to the compute: float32's longer steps scale it) and the seconds S(n) of the
    transfer (its mean, tail and all: a step pays the sum). On emu-equal2 (2 x 0.4 core) a
    decode step's 33 syncs took 1.2-2.3 ms each (identical GeMVs took 2.0-4.7 ms of CPU from
    one call to the next on the shared host, stretched 2.5x: arrivals 1-2 ms apart) against
    0.3 ms after a barrier, and the profile priced llama-1b int8 at 8.1 tokens/s where it ran
    6.1; on emu-mixed4 the all-rank factor priced the two fast ranks' syncs at 0.11 ms where
    they took 1.2-1.5 (docs/results/llm.md).
    """
    size, rank = comm.Get_size(), comm.Get_rank()
    C = config.hidden_size
    f = max(1, config.intermediate_size // size)
    rng = np.random.default_rng(rank)
    a = rng.standard_normal((1, f), dtype=np.float32)
    down = K.pack_b(rng.standard_normal((f, C), dtype=np.float32) / np.float32(math.sqrt(f)))
    row = np.empty((1, C), np.float32)

    def compute():
        K.gemm_any(a, down, out=row)

    if _stretch.ON:
        compute = _stretch.wrap(compute)
    g = Comm(comm)
    profile = profile_from_dict(prof, "measured profile")
    pair = (1.0, float(rank))
    probes = {"allreduce": (lambda: g.allreduce_sum(row), Collective("allreduce", None, C * 4.0)),
              "allgather": (lambda: g.allgather_small(pair),
                            Collective("allgather", None, GREEDY_PAIR_BYTES))}
    factors = {kind: _factor(comm, fn, (compute, lambda: None), c, {}, profile, reps)
               for kind, (fn, c) in probes.items()}
    rates = [d.gemv_bytes_per_s(True) for d in profile.devices]
    by_speed = sorted(range(1, size), key=lambda i: -rates[i])
    jitter, seconds = [0.0], [0.0]
    for n in range(2, size + 1):  # rank 0 with its n - 1 fastest others, as `tensor` is searched
        members = [0] + by_speed[:n - 1]
        sub = g.split(rank in members)
        if sub is not None:
            share = rates[rank] / sum(rates[i] for i in members)
            segments = decode_segments(config, share, rng)
            waits, spans = cadence_allreduce_s(sub, segments, C)
            del segments
            got = sub.mpi.gather((spans, waits), root=0)
            sub.close()
            if rank == 0:
                j, t = sync_figures([x[0] for x in got], [x[1] for x in got])
                jitter.append(j)
                seconds.append(t)
        barrier(comm)
    jitter, seconds = comm.bcast((jitter, seconds), root=0)
    g.close()
    return factors, {"jitter": jitter, "seconds": seconds}
