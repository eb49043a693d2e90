"""`hepti profile`: measure every rank's speed, memory and link, as a profile for the planner.

All ranks measure at the same time, so ranks sharing a machine see each other's load as they
will during a run. Per rank:
- GeMM FLOP/s with the engine's own kernel (`hepti.kernels.gemm` on `pack_b` weights) on one
  layer's four GeMMs at the model's shapes, for a few row counts m up to M = batch * seq_len:
  a table by the GeMM's smallest dimension (small slices run slower per FLOP);
- the fixed cost of one kernel call (Python and dispatch), charged per operation;
- attention FLOP/s (`hepti.kernels.attention`), timed inside that layer's work, for the same
  row counts: a table by the FLOPs of one call;
- elementwise elements/s (`add_layernorm`) on [M, C];
- memory available to hepti: MemAvailable (or the cgroup's limit minus usage other than page
  cache, if lower) shared
  by the ranks on the same machine, and at most the user's cap;
- optionally, reading a file from local disk (page cache dropped first);
- turning stored weights into packed slices (HDF5 read + checks + pack_b), bytes/s: the CPU
  work `stream` adds to every layer;
- its link: MPI ping-pong with rank 0 at a few message sizes, least-squares fitted to
  one-way time = latency + bytes / bandwidth. Rank 0's own link is taken as the fastest path it
  measured (a star's path is as slow as its slower end).
Under `hepti emulate` (unless HEPTI_EMULATE_STRETCH=0) each timing round is stretched as one
unit of work, as the runtime's compute spans are (hepti.emulate.stretch), so the profile measures
the stretched device as it would a slow board.
A run takes a few seconds. `cached_profile` keeps the result per hostfile, model, world size,
shape and every rank's caps (cgroup CPU quota and memory limit, emulated device) under
$HEPTI_CACHE (default ~/.cache/hepti) and measures again when it is older than asked.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
import time
from pathlib import Path
import threading

import numpy as np

from hepti.config import ModelConfig
from hepti.families import config_from_dict
from hepti.emulate import stretch as _stretch
from hepti.emulate.state import current_device, read_state
from hepti.errors import PlanError
from hepti.plan.profile import NETWORK_DEFAULTS, SCHEMA_VERSION, Profile, load_profile, profile_from_dict
from hepti.resources import (_return_freed_memory, available_memory, cgroup_memory_stat, cpu_limit,
                             memory_limit, process_rss)
from hepti import kernels as K
from hepti.counts import counts, counts as split, offsets
from hepti.graph import lower
from hepti.graph.cnn import CONV
from hepti.families import family_graph
from hepti.graph.split import Split, spatial_ops
from hepti.model.cnn import CNNModel, Weights, apply
from hepti.parallel.bands import BandExecutor, lay_out_channels
from hepti.parallel.comm import Comm, wait
from hepti.parallel.interpreter import _mlp_pair
from hepti.parallel.slices import LayerSlice
from hepti.parallel.trace import Tracer
from hepti.plan.costmodel import Collective, collective_times
from hepti.weights import WeightStore
from hepti.weights.layout import expected_shapes
from hepti.weights.writer import TensorSpec, write_model

PING_SIZES = (8, 4096, 65536, 262144, 1 << 20, 4 << 20)  # bytes; larger skipped on slow links
PING_TARGET_S = 0.06  # the largest message should take about this long one way
MIN_TIME_S = 0.03  # time each compute measurement for at least this long
QUOTA_PERIODS = 20  # under a CPU quota, time each round over at least this many CFS periods
DISK_PROBE_BYTES = 32 << 20
MEMORY_STAT_KEYS = ("total_rss", "total_cache", "total_mapped_file", "total_active_file",
                    "total_inactive_file", "anon", "file", "file_mapped", "active_file",
                    "inactive_file")  # kept in the profile: what the cgroup's usage is made of
COLD_WEIGHT_BYTES = 48 << 20  # more than this machine's L2s together; see measure_layer
# Interleaved rounds of the layer timing. With 4, two identical cores of this machine came out
# 10% apart in one profile (BERT-base, 128 rows: 114.7 and 127.2 GFLOP/s), and the planner
# gave the "faster" one 136 of 256 rows, which ran 5% slower than 128 each.
LAYER_ROUNDS = 8
# The speed probe (`SpeedProbe`): its GeMM's rows, its rounds, each round's least length (of
# unstretched calls: a round lasts about PROBE_WINDOW_S / share on an emulated device), and the
# probes whose median the profile records, each after a sleep of PROBE_GAP_S (`measure_probe`)
PROBE_ROWS, PROBE_ROUNDS, PROBE_WINDOW_S, PROFILE_PROBES, PROBE_GAP_S = 32, 3, 1e-3, 5, 0.1


# --- compute ---------------------------------------------------------------------------------

def _timed(fn, min_time: float = MIN_TIME_S, rounds: int = 3) -> float:
    """Seconds per call of fn() (see `_timed_many`)."""
    return _timed_many({0: fn}, rounds=rounds, min_time=min_time)[0]


def timing_window(min_time: float) -> float:
    """Seconds to time each round for: `min_time`, or under a CFS CPU quota at least
    `QUOTA_PERIODS` of its periods. A capped process runs its quota's worth at full speed, then
    waits for the next period: a call shorter than the quota is usually timed at full speed,
    so 0.15 and 0.3 of a core once profiled at 2-4x their share. Whole periods hold whole
    quotas, so a window of many periods, timed end to end, gets the share right to within
    1/QUOTA_PERIODS whatever the calls' length."""
    _, period = cpu_limit()
    return min_time if period is None else max(min_time, QUOTA_PERIODS * period)


def _timed_many(fns: dict, rounds: int = 4, min_time: float = MIN_TIME_S / 3,
                window: float | None = None) -> dict:
    """Seconds per call of each fn: in each of `rounds` interleaved rounds, the wall time of
    at least 2 calls, back to back, over at least `window` seconds (default
    `timing_window(min_time)`), divided by the calls; the median over the rounds. Interleaving
    spreads a burst of load from elsewhere over all fns instead of spoiling one. One warm-up
    call each first (it also compiles)."""
    window = timing_window(min_time) if window is None else window
    for fn in fns.values():
        fn()
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key, fn in fns.items():
            # on an emulated device the round's calls are one unit of work, stretched once at
            # its end: back to back, as a slow board runs them. Stretching each call put a
            # sleep between calls, and a short call after a sleep takes more CPU (cold caches:
            # a 0.25-core device profiled its 8-row GeMMs at 0.73 of its share). It starts
            # level (`stretch.settle`): no debt from before, and no credit from an earlier
            # sleep's overshoot, which would make a short round read unstretched (see SpeedProbe)
            if _stretch.ON:
                _stretch.settle()
                _stretch.span_enter("batch")
            start, n = time.perf_counter(), 0
            while n < 2 or time.perf_counter() - start < window:
                fn()
                n += 1
            if _stretch.ON:
                _stretch.span_exit("batch")
            times[key].append((time.perf_counter() - start) / n)
    return {key: statistics.median(v) for key, v in times.items()}


class SpeedProbe:
    """A rank's speed in one small measurement, the same at profile time (the profile's
    `probe_s` for the rank) and while serving (hepti.serve.worker: a rank the plan leaves idle
    has no batches to show its speed, so it probes after each one, and the monitor compares the
    two: hepti.serve.monitor.IdleWatch). Seconds per call of one GeMM, [PROBE_ROWS, C] x
    [C, C] with the engine's kernel on packed weights, timed as the profile times everything
    (`_timed_many`): PROBE_ROUNDS rounds, each at least 2 calls back to back over
    PROBE_WINDOW_S as one unit of work (on an emulated device, stretched once at its end, and
    started level: `stretch.settle`), after one warm-up call; the median round.

    Why not single calls, each its own stretched span (the serving probe until 2026-11-29): a
    payment that oversleeps leaves up to `stretch.CREDIT_MAX_S` (1 ms) of credit, and the next
    span runs unstretched until it is spent. On the AVX-512 machine one call at MiniLM's shape
    is 0.18 ms of CPU, 0.45 ms stretched at 0.4 core: shorter than the credit. On a busy host
    345 of 996 such calls began with credit and read 0.40x their stretched time (the rest
    0.79x), and an idle device whose speed had not changed probed 0.44x and 0.35x its
    baseline (issue 44's 0.48x). Timed in rounds of ~9 calls, started level, the same device's
    rounds read 0.97-1.2x their stretched time (quartiles)."""

    def __init__(self, hidden: int):
        rng = np.random.default_rng(0)
        self.a = rng.standard_normal((PROBE_ROWS, hidden), dtype=np.float32)
        self.b = K.pack_b(rng.standard_normal((hidden, hidden), dtype=np.float32))
        self.c = np.empty((PROBE_ROWS, hidden), np.float32)
        self.gemm = K.gemm

    def _call(self) -> None:
        self.gemm(self.a, self.b, out=self.c)

    def __call__(self) -> float:
        """Seconds per call (see the class docstring)."""
        return _timed_many({0: self._call}, rounds=PROBE_ROUNDS, window=PROBE_WINDOW_S)[0]


def measure_probe(hidden: int, repeats: int = PROFILE_PROBES, probe: SpeedProbe | None = None
                  ) -> float:
    """The profile's `probe_s`: the median of `repeats` SpeedProbe readings (a serving rank's
    monitor takes the median of several too: hepti.serve.monitor.IdleWatch), each after a
    PROBE_GAP_S sleep, with every rank doing the same once all are done with the heavier
    measurements (`measure_profile` calls it after a barrier): as an idle rank probes while
    serving, a short burst after a wait, not a call inside a sustained loop. On a busy shared
    host a rank in a sustained loop gets its fair part of the contended CPU, below its share,
    and a rank that slept runs at once: read beside the layer timings, the 0.4-core device's
    probe_s was 2.07 ms, and the same device idle while serving probed 1.09 ms (median of 257),
    0.53x; after sleeps, three ranks at once, 0.98 ms against 1.01 in a serving-like loop.
    A serving rank re-measured by the re-planner reads it the same way (`probe`: its own)."""
    probe = probe or SpeedProbe(hidden)
    readings = []
    for _ in range(repeats):
        time.sleep(PROBE_GAP_S)
        readings.append(probe())
    return statistics.median(readings)


def gemm_sizes(config: ModelConfig, rows: int) -> list[int]:
    """Row counts m at which to time a layer's GeMMs: small slices up to all M rows, and half of
    them (two ranks' `rows` shares: measured, not interpolated)."""
    sizes = {s for s in (8, 32, 128, 512) if s < rows} | {rows} | ({rows // 2} if rows >= 16 else set())
    return sorted(sizes)


def measure_layer(config: ModelConfig, batch: int, seq_len: int, threads: int = 1
                  ) -> tuple[list[list[float]], list[list[float]]]:
    """(GeMM table, attention table), from one layer of the model's graph (hepti.graph) run as
    a `rows` forward runs it, for a few row counts m up to M = batch * seq_len: each GeMM
    operator on m rows with its weights packed as the runtime packs them (+ bias, GeLU), an
    MLP pair in one `ffn` call as the interpreter runs it, and attention of m query rows on
    every head against all M keys (the K/V of a fused QKV output go into an [M, 2C] buffer, as
    the Allgatherv leaves them). Elementwise operators are the profile's elementwise speed, not
    timed here.
    GeMM: [[min(m, C), FLOP/s], ...], keyed by the GeMM's smallest dimension (most of them).
    Attention: [[FLOPs of the call, FLOP/s], ...], 4 m T C FLOPs each: keyed by the call's
    size so that one table serves `rows` (m rows, every head) and `tensor` (M rows, h heads).

    Attention is timed here rather than alone: on hot buffers, back to back, it ran 71 GFLOP/s
    on BERT-base's 128 of 256 rows, but in a forward (the layer's GeMMs between calls) 50-53,
    and MiniLM's 64 of 128 rows 49 against 35 (`hepti run --trace`); timed alone at all M rows
    (as before), 2-rank `rows` plans were predicted 0.8 ms (MiniLM) and 8 ms (BERT-base) fast
    per forward."""
    rng = np.random.default_rng(0)
    g = family_graph(config, batch, seq_len)
    C, T, M = config.hidden_size, seq_len, batch * seq_len
    steps = [s for s in lower.schedule(g, lower.assignment(g, "rows"), 1)
             if s.kind == "op" and s.layer == 0 and s.op.kind in ("gemm", "attention")]
    readers: dict[str, int] = {}
    for op in g.layer:
        for t in op.inputs:
            readers[t] = readers.get(t, 0) + 1
    calls = []  # (step, its MLP partner or None), as the interpreter groups them
    for s in steps:
        if calls and calls[-1][1] is None and _mlp_pair(calls[-1][0], s, readers):
            calls[-1] = (calls[-1][0], s)
        else:
            calls.append((s, None))
    gemm_ops = [s.op for s in steps if s.op.kind == "gemm"]

    def weight(k, n):
        return K.pack_b(rng.standard_normal((k, n), dtype=np.float32) * np.float32(0.05))

    # A real forward meets each layer's weights cold (the layers before evicted them), so cycle
    # through enough copies of the layer that none is still in cache when its turn comes.
    layer_bytes = 4 * sum(op.k * op.n for op in gemm_ops)
    copies = max(2, -(-COLD_WEIGHT_BYTES // layer_bytes))
    layers = [{op.name: weight(op.k, op.n) for op in gemm_ops} for _ in range(copies)]
    biases = {op.name: np.zeros(op.n, np.float32) for op in gemm_ops if op.bias}
    kv_all = rng.standard_normal((M, 2 * C), dtype=np.float32)  # every row's K/V, gathered
    mask = np.ones((batch, seq_len), np.float32)
    attention_s = {}

    made: set[str] = set()
    stand_ins = []  # what the calls read that no call makes (elementwise outputs): random rows
    for step, pair in calls:
        stand_ins += [t for t in step.op.inputs if t not in made and t not in stand_ins]
        made.update((pair or step).op.outputs + step.op.outputs)

    def layer_fn(m: int):
        x = {t: rng.standard_normal((m, g.tensors[t].width), dtype=np.float32) for t in stand_ins}
        turn = [0]
        spent = attention_s[m] = []  # (attention, whole layer) CPU seconds of each call but the first

        def layer():
            w = layers[turn[0] % copies]
            turn[0] += 1
            env, att = dict(x), 0.0
            start = time.process_time()
            for step, pair in calls:
                op = step.op
                if op.kind == "attention":
                    qkv = env[op.inputs[0]]
                    kv_all[:m] = qkv[:, C:]
                    t0 = time.process_time()
                    env[op.outputs[0]] = K.attention_qkv(qkv, mask, op.heads, kv=kv_all, threads=threads)
                    att += time.process_time() - t0
                elif pair is not None:
                    env[pair.op.outputs[0]] = K.ffn(env[op.inputs[0]], w[op.name], biases.get(op.name),
                                                    w[pair.op.name], threads=threads)
                else:
                    y = K.gemm(env[op.inputs[0]], w[op.name], bias=biases.get(op.name),
                               gelu=op.act == "gelu", threads=threads)
                    for t in op.outputs:  # a fused output (Q | K V): its readers take all of it
                        env[t] = y
            if turn[0] > 1:
                spent.append((att, time.process_time() - start))
        return layer

    sizes = gemm_sizes(config, M)
    seconds = _timed_many({m: layer_fn(m) for m in sizes}, rounds=LAYER_ROUNDS)
    flops_per_row = 2.0 * sum(op.k * op.n for op in gemm_ops)
    gemm, attention = [], []
    for m in sizes:
        # attention's part of a layer, from the calls timed one by one, applied to the layer's
        # time over whole windows: under a CPU quota a single call usually runs unthrottled, so
        # its own time is too short for the quota, while the windows get the share right
        # (`timing_window`); subtracting an unthrottled attention from a throttled layer made
        # the GeMMs of capped devices look slow (emu-starved predicted 15% slow).
        # The part is a part of the calls' CPU time (process_time), not of their wall time: a
        # capped process is throttled in whole periods, which land mostly in the long GeMMs, so
        # by the wall clock a 1 ms attention was a fifth of its true part. A 0.15-core device
        # profiled attention at 34 GFLOP/s, 4.5x its share of the 50 uncapped (a 0.6-core one
        # at 47-55), and `even` on emu-pair-940-quarter ran 20% over its prediction, all of it
        # in the attention phase of the 0.15-core rank (52 ms against 44 per layer).
        part = statistics.median(a / t for a, t in attention_s[m])
        att = part * seconds[m]
        gemm.append([float(min(m, C)), m * flops_per_row / max(seconds[m] - att, 1e-9)])
        flops = 4.0 * m * T * C
        attention.append([flops, flops / att])
    return gemm, attention


def measure_call_overhead() -> float:
    """Seconds of a kernel call that does almost nothing: its Python and dispatch cost."""
    w = K.pack_b(np.ones((8, 32), np.float32))
    a = np.ones((1, 8), np.float32)
    return _timed(lambda: K.gemm(a, w), min_time=0.005)


def measure_elementwise(config: ModelConfig, rows: int) -> float:
    """Elements/s of `hepti.kernels.add_layernorm` (bias + residual + LayerNorm) on [M, C]."""
    rng = np.random.default_rng(2)
    C = config.hidden_size
    x, res = (rng.standard_normal((rows, C), dtype=np.float32) for _ in range(2))
    bias, gamma, beta = (rng.standard_normal(C, dtype=np.float32) for _ in range(3))
    out = np.empty_like(x)
    eps = config.layer_norm_eps
    return rows * C / _timed(lambda: K.add_layernorm(x, bias, res, gamma, beta, eps, out=out))


def measure_disk(directory: str | None = None, nbytes: int = DISK_PROBE_BYTES) -> float | None:
    """Bytes/s reading a fresh file from local disk with its pages dropped from the cache."""
    if not hasattr(os, "posix_fadvise"):
        return None
    fd, path = tempfile.mkstemp(prefix="hepti-disk-", dir=directory)
    try:
        block = np.random.default_rng(3).integers(0, 255, 1 << 20, dtype=np.uint8).tobytes()
        with os.fdopen(fd, "wb") as f:
            for _ in range(nbytes // len(block)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.read(1 << 22):
                pass
        return nbytes / (time.perf_counter() - t0)
    finally:
        os.unlink(path)


def measure_weight_load(config: ModelConfig, directory: str | None = None, rounds: int = 3,
                        cold: bool = True) -> float:
    """Stored bytes/s of turning weights into a packed layer slice, as `stream` does for every
    layer of every forward, *as it costs the compute running beside it*: what the planner
    counts as per-layer CPU work ("load" Work of hepti.plan.workloads.stream_program).

    The load is `WeightStore.read_layer_slice` (HDF5, Fletcher32 checked) and
    `LayerSlice.pack` (pack_b), on a quarter of one layer of this shape, written to a
    temporary folder first. With `cold` (the default) the probe's pages are dropped from the
    page cache before every load, so each read goes to the disk as `stream`'s do: it is
    planned when the slices do not fit in memory, so neither do they in the page cache, and a
    rank at its memory cap re-reads them from disk every forward (emu-starved: 1583 ms when the
    shards' pages were charged to the capped ranks, 1280-1350 ms when an earlier run had left
    them cached outside). The kernel's read path and reclaim are CPU work too: 235 MB/s cold
    vs 333 warm at half a core. `stream` makes slices on a prefetch thread while the main thread
    computes, so this times the same: a thread makes `n` slices back to back while this thread
    runs a small GeMM over and over until they are done; the time the GeMMs lost against their
    speed alone, per slice, is what a slice costs (bytes / that). On a device whose CPU is a
    quota (or one core per rank) that is about the slice's own time, or more: the loader and
    the GeMM burn the quota in bursts and h5py holds the GIL while it reads, so the main
    thread's Python between kernels waits (alone: 770-900 MB/s on one uncapped core here, 437
    at half a core; beside a GeMM at half a core: see the profile). With a core to spare for
    the loader the GeMMs lose nothing and the figure is large: loading is then overlapped, as
    it should be counted. Floor: a slice costs at least 1% of its time alone."""
    d = {**config.to_dict(), "num_hidden_layers": 1}
    if "vocab_size" in d:  # a token embedding table the probe does not need
        d["vocab_size"] = 8
    one = config_from_dict(d, name="weight-load-probe")

    def zeros(shape):
        return lambda a, b: np.zeros((b - a,) + tuple(shape[1:]), np.float32)

    specs = [TensorSpec(n, s, zeros(s)) for n, s in expected_shapes(one, pooler=False).items()]
    heads = (0, max(1, one.num_attention_heads // 4))
    ffn = (0, max(1, one.intermediate_size // 4))
    graph = family_graph(one, 1, 1)
    with tempfile.TemporaryDirectory(prefix="hepti-load-", dir=directory) as tmp:
        path = write_model(Path(tmp) / "probe", one, specs, source={"probe": "weight load"},
                           progress=False)
        shards = sorted(Path(path).glob("shard-*.h5"))
        for f in shards:  # clean pages, so that dropping them below really drops them
            with open(f, "rb+") as fh:
                os.fsync(fh.fileno())
        store = WeightStore(path)
        try:
            def load():
                if cold and hasattr(os, "posix_fadvise"):
                    for f in shards:
                        fd = os.open(f, os.O_RDONLY)
                        try:
                            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                        finally:
                            os.close(fd)
                return LayerSlice.pack(graph, 0, store.read_layer_slice(0, heads, ffn))

            before = store.bytes_read
            shard = load()
            per_load = store.bytes_read - before
            x = np.random.default_rng(0).standard_normal((64, one.hidden_size)).astype(np.float32)

            up = next(shard.params[op.name][0] for op in graph.layer  # an FFN column slice
                      if op.kind == "gemm" and op.unit == "ffn")

            def gemm():
                K.gemm(x, up, threads=1)

            if _stretch.ON:  # the loader's CPU counts in the process's, hence in these calls'
                gemm = _stretch.wrap(gemm)

            times = _timed_many({"load": load, "gemm": gemm})
            alone, gemm_s = times["load"], times["gemm"]
            n = max(4, math.ceil(timing_window(MIN_TIME_S) / alone))
            costs = []
            for _ in range(rounds):
                done = threading.Event()
                failed: list[BaseException] = []

                def loader():
                    try:
                        for _ in range(n):
                            load()
                    except BaseException as e:  # noqa: BLE001 - re-raised below
                        failed.append(e)
                    finally:
                        done.set()

                t = threading.Thread(target=loader, name="hepti-load-probe")
                start, calls = time.perf_counter(), 0
                t.start()
                while not done.is_set():
                    gemm()
                    calls += 1
                wall = time.perf_counter() - start
                t.join()
                if failed:
                    raise failed[0]
                costs.append((wall - calls * gemm_s) / n)
            seconds = max(statistics.median(costs), alone / 100)
        finally:
            store.close()
    return per_load / seconds


# --- memory ----------------------------------------------------------------------------------

def resource_limits() -> dict:
    """This rank's caps as its own cgroups set them, and its emulated device (spec name, CPU
    share, memory cap, link rate now) when it runs under `hepti emulate`: what makes two
    clusters with the same host names differ (the profile cache's key, and a record in the
    profile)."""
    cores, period = cpu_limit()
    out = {"cpu_cores": None if cores is None else round(cores, 4),
           "cpu_period_s": period, "mem_limit_bytes": memory_limit()}
    state = read_state()
    device = current_device(state)
    if state is not None and device is not None:
        out["emulated"] = {"spec": state.get("spec"), "stretch": _stretch.ON,
                           **{k: device.get(k) for k in ("name", "cpu", "mem_bytes", "link_mbit")}}
    return out



# --- links -----------------------------------------------------------------------------------

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
        _barrier(comm)
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
        out.append({"rank": peer, "points": points, "latency_s": lat, "bandwidth_Bps": bw})
    return out


# --- the whole profile -------------------------------------------------------------------------

def _barrier(comm) -> None:
    """A barrier that waits as the runtime waits (`hepti.parallel.comm.wait`: asleep on a
    CPU-capped rank). MPICH's blocking barrier spins: a rank done measuring early would burn its
    quota and, sharing a CPU with a rank still measuring, evict that rank's caches."""
    wait(comm.Ibarrier())


def measure_profile(comm, config: ModelConfig, seq_len: int, mem_cap: float | None = None,
                    batch: int = 1, threads: int = 1, hostfile: str | None = None,
                    disk: bool = True) -> dict:
    """Measure every rank (all ranks call this) -> the same profile dict on every rank."""
    comm = getattr(comm, "mpi", comm)  # a hepti Comm or an mpi4py communicator
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    t_start = time.perf_counter()
    rank, size = comm.Get_rank(), comm.Get_size()
    M = batch * seq_len
    _barrier(comm)
    gemm, attention = measure_layer(config, batch, seq_len, threads)
    elementwise = measure_elementwise(config, M)
    overhead = measure_call_overhead()
    weight_load = measure_weight_load(config)
    _barrier(comm)
    probe_s = measure_probe(config.hidden_size)  # after the barrier: see measure_probe
    disk_bps = measure_disk() if disk else None
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    on_host = local.Get_size()
    local.Free()
    _return_freed_memory()  # the probes' garbage is not the device's use
    avail, mem_source = available_memory()
    memory = avail / on_host
    if mem_cap is not None:
        memory = min(memory, float(mem_cap))
    _barrier(comm)
    links = measure_links(comm)
    mine = {"rank": rank, "host": MPI.Get_processor_name(), "gemm_flops": gemm,
            "attention_flops": attention, "elementwise_per_s": elementwise,
            "memory_bytes": float(memory), "disk_read_Bps": disk_bps, "call_overhead_s": overhead,
            "weight_load_Bps": weight_load, "probe_s": probe_s,
            "measured": {"memory_source": mem_source, "ranks_on_host": on_host,
                         "rss_bytes": process_rss() or 0, "threads": threads,
                         "cgroup_memory_stat": {k: v for k, v in cgroup_memory_stat().items()
                                                if k in MEMORY_STAT_KEYS},
                         "limits": resource_limits()}}
    devices = _with_links(comm.allgather(mine), links)
    for d in devices:
        if d["disk_read_Bps"] is None:
            del d["disk_read_Bps"]
    elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
    prof = {"hepti_profile": SCHEMA_VERSION, "created": time.time(), "source": "measured",
            "hostfile": hostfile, "model": config.name or None, "model_shape": config.shape,
            "seq_len": seq_len,
            "network": dict(NETWORK_DEFAULTS), "devices": devices,
            "measure_s": elapsed, "batch": batch}
    prof = comm.bcast(prof, root=0)
    if size > 1:
        prof["network"]["calibration"] = calibrate_collectives(comm, prof, config, M)
    profile_from_dict(prof, "measured profile")  # the schema check the planner will make
    return prof


def _with_links(devices: list[dict], links: list[dict]) -> list[dict]:
    """Each device's link figures from `measure_links` (rank 0's: its fastest path's latency
    and the highest bandwidth any rank reached it at)."""
    paths = {p["rank"]: p for p in links}
    if len(devices) > 1:
        fastest = min(paths.values(), key=lambda p: (p["latency_s"], -p["bandwidth_Bps"]))
        devices[0]["latency_s"] = fastest["latency_s"]
        devices[0]["bandwidth_Bps"] = max(p["bandwidth_Bps"] for p in paths.values())
        for r in range(1, len(devices)):
            devices[r]["latency_s"] = paths[r]["latency_s"]
            devices[r]["bandwidth_Bps"] = paths[r]["bandwidth_Bps"]
            devices[r]["measured"]["ping_pong"] = paths[r]["points"]
    else:  # one rank: no link is used; any positive figures will do
        devices[0]["latency_s"], devices[0]["bandwidth_Bps"] = 0.0, 1e12
    return devices


def measure_cnn_ops(model, h: int, w: int, batch: int = 1, rounds: int = 5) -> list[float]:
    """Seconds of each op of a CNN (hepti.model.cnn.CNNModel) over the whole h x w map, batch
    `batch`: the median of `rounds` forwards after a warm-up, each op timed alone (stretched as
    one unit of work on an emulated device, as the runtime's compute spans are)."""
    g = model.graph
    g.shapes(h, w)
    run = _stretch.wrap(apply) if _stretch.ON else apply
    x0 = np.random.default_rng(4).standard_normal((batch, h, w, 3), dtype=np.float32)
    times = [[] for _ in g.ops]
    last = g.last_use()
    for r in range(rounds + 1):
        env = {g.input: x0}
        for i, op in enumerate(g.ops):
            res = env[op.residual] if op.residual is not None else None
            t0 = time.perf_counter()
            env[op.output] = run(op, env[op.input], model.weights, res, threads=model.threads)
            if r:
                times[i].append(time.perf_counter() - t0)
            for t in (op.input, op.residual):
                if t is not None and last.get(t) == i:
                    del env[t]
    return [statistics.median(t) for t in times]


def measure_layout_rate(rounds: int = 9) -> float:
    """Seconds per byte of laying a map split by channels out whole (hepti.parallel.bands
    `lay_out_channels`, what every member of a split by channels does after each op's
    allgather), as the device pays them (stretched on an emulated one): ResNet-50's 14x14x1024
    map from two halves, 0.8 MB."""
    shape, per = (1, 14, 14, 1024), [512, 512]
    flat = np.random.default_rng(6).standard_normal(14 * 14 * 1024, dtype=np.float32)
    run = _stretch.wrap(lay_out_channels) if _stretch.ON else lay_out_channels
    run(flat, per, shape)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run(flat, per, shape)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / flat.nbytes


class _Unsent:
    """Rank 0 of two whose messages are not sent (`measure_band_costs`): the exchange
    runs its span and zeroes what it would receive, and the verbs after the spatial part hand
    back what one rank has. Every other line of a forward is the band executor's own."""

    size, rank = 2, 0

    def __init__(self):
        self.tracer = Tracer(0)

    def bcast_obj(self, obj):
        return obj

    def exchange(self, sends: dict, recvs: dict) -> None:
        with self.tracer.span("Halo", "halo"):
            for buf in recvs.values():
                buf.fill(0.0)

    def allgather_rows(self, a, counts):
        out = np.zeros((sum(counts),) + a.shape[1:], np.float32)
        out[:a.shape[0]] = a
        return out


BAND_FRACTIONS = (0.15, 0.5)  # the bands `measure_band_costs` times: a slow device's, a half
# The band rounds go on past their minimum count until this many seconds have passed (and so
# do the stream pairs). Seven rounds of MobileNetV2's bands take under a second, and this
# host's speed moves in spells of seconds (a matmul probe's median, 3.8 or 6 ms by turns): the
# same plan was predicted 47.2, 30.6 and 30.5 ms from three profiles of its devices taken
# minutes apart (2026-11-27). ResNet-50's seven rounds already take longer than this.
BAND_MIN_S = 4.0
BAND_MAX_ROUNDS = 61


def measure_band_costs(model, h: int, w: int, batch: int = 1, rounds: int = 7,
                       fractions: tuple = BAND_FRACTIONS, read=None,
                       min_s: float = BAND_MIN_S) -> tuple:
    """(points, spread, stream). Points: per op, [(k, seconds)] for a band of k output rows
    at each fraction of the rows, as the band executor runs it at h x w: rank 0 of a two-rank
    split with the messages left out (`_Unsent`), one group per op, each band made from the
    one before as a forward makes it, stretched on an emulated device as the runtime is; the
    fractions interleaved round by round (at least `rounds`, and on for `min_s`), the median
    of the rounds. An op's time is from the end of the op before to its own end: the
    executor's bookkeeping around it, the exchange's copies and the stretch's payment for both
    are in it; None for the ops after the spatial part. `pooled_band` makes each device's
    a + b x k of them. Spread: `band_spread` of the rounds at the larger band. Stream (with
    `read`, the weight store's): per conv, the seconds its weights add when streamed
    (`Weights.fetch` and `drop` around it, as a streamed group runs it): after the bands'
    rounds (a streamed forward's reads and allocations would be in the next forward's times),
    the largest band with every conv streamed, alternating with the resident one, for as
    long, the median of each pair's difference; None for other ops (`stream_fit` fits them).

    Why not the whole-map timings and a one-row band, joined by a line (profiler revision 8):
    on emu-geneflow4 (four devices sharing two cores, 2026-11-27) MobileNetV2's bands ran
    1.34, 1.51, 1.67 and 1.84 times that line at 15% of the rows and 1.10-1.38 at 40% (the
    four devices, fastest first), and natively 1.1-1.3 times (a map made long before, or on
    another core, is read from further away than the whole-map forward's just-made one);
    GenEFlow's plans that give the slow devices small bands ran 30-60% over their prediction."""
    g = model.graph
    shapes = g.shapes(h, w)
    n = spatial_ops(g)
    x = np.random.default_rng(5).standard_normal((batch, 3, h, w), dtype=np.float32)
    runs = []
    for f in fractions:
        unsent = _Unsent()
        unsent.tracer.record_events = True
        ex = BandExecutor(unsent, g, Split((f, 1.0 - f), head="primary"), model.weights,
                          model.threads)
        run = _stretch.wrap(ex.forward) if _stretch.ON else ex.forward
        run(x)
        runs.append((f, unsent.tracer, run, [[] for _ in range(n)]))
    for f, tracer, run, spans in _band_rotation(runs, rounds, min_s):
        _band_round(tracer, run, x, spans, n)
    stream = None
    if read is not None:  # the largest band again, every conv's weights streamed
        unsent = _Unsent()
        unsent.tracer.record_events = True
        streamed = Weights(g, read, streamed={op.name for op in g.ops if op.kind == CONV})
        ex = BandExecutor(unsent, g, Split((fractions[-1], 1.0 - fractions[-1]),
                                           head="primary"), streamed, model.threads)
        run = _stretch.wrap(ex.forward) if _stretch.ON else ex.forward
        run(x)
        pair = [(unsent.tracer, run, [[] for _ in range(n)]),
                (runs[-1][1], runs[-1][2], [[] for _ in range(n)])]
        # after the bands' rounds: its reads stay out of their times
        for tracer, run, spans in _band_rotation(pair, rounds, min_s):
            _band_round(tracer, run, x, spans, n)
        (_, _, s_spans), (_, _, r_spans) = pair
        stream = [statistics.median(a - b for a, b in zip(s_spans[l], r_spans[l]))
                  if l < n and g.ops[l].kind == CONV else None for l in range(len(g.ops))]
    out = []
    for l, op in enumerate(g.ops):
        pts = []
        for f, _, _, spans in runs if l < n else ():
            k = counts(shapes[op.output][0], (f, 1.0 - f))[0]
            if k and spans[l]:
                pts.append((k, statistics.median(spans[l])))
        out.append(sorted(pts) or None)
    return out, band_spread(runs[-1][3]), stream


def stream_fit(stream: list, graph) -> tuple[float, float]:
    """(seconds a fetch, stored bytes/s) of a device's streamed convs: fixed + bytes / rate
    through `measure_band_costs`' per-conv stream seconds and each conv's stored bytes, by
    least squares on the relative error (the planner prices each conv by its own timing and
    takes from this only how a slice of it scales: `stream_seconds`); through the origin when
    the fixed part comes out negative. Relative, not absolute: ResNet-50's largest convs
    (2-9 MB) load slower per byte than its small ones, and a plain fit's fixed part came out
    -1.8 to 0 ms where its smallest convs took 1.2-4.7 ms. Why in the executor's forward,
    with every rank measuring at once: timed alone (each conv's `fetch` and `drop` in a loop,
    page cache warm, profiler revisions 7-9) MobileNetV2's load rate on emu-geneflow4's four
    devices ranged 327-525, 147-427, 77-221 and 42-192 MB/s over five profiles, and in the
    forward 394-583, 282-368, 140-223 and 66-156 (2026-11-27); GenEFlow's 2-device plan at a
    50% cap, 19 of its 48 groups streamed, ran 27% over its prediction on the lone timing,
    its streamed groups at 1.3-2.7 times their modelled compute, and -7% to +7% on this."""
    row = graph.row_bytes()
    pts = [(row[op.name] * op.cout, t) for op, t in zip(graph.ops, stream or ())
           if op.kind == CONV and t is not None]
    if not pts:
        return 0.0, 1e12  # nothing streamed: no cost
    b = np.array([p[0] for p in pts], float)
    t = np.maximum(np.array([p[1] for p in pts], float), 0.0)
    rel = 1.0 / np.maximum(t, 1e-5)
    if len(pts) >= 2 and np.ptp(b) > 0:
        (fixed, per_byte), *_ = np.linalg.lstsq(np.vstack([rel, b * rel]).T, t * rel,
                                                rcond=None)
        if per_byte > 0 and fixed >= 0:
            return float(fixed), float(1.0 / per_byte)
        per_byte = float(np.median(t / b))  # a line through the origin, then
        if per_byte > 0:
            return 0.0, 1.0 / per_byte
    return 0.0, float(b.sum() / max(t.sum(), 1e-12))


def _band_rotation(items: list, rounds: int, min_s: float):
    """`items` round by round, each round starting one further along (a burst of load from
    elsewhere falls on all of them alike): at least `rounds` rounds, and more until `min_s`
    seconds have passed, `BAND_MAX_ROUNDS` at most."""
    start, r = time.perf_counter(), 0
    while r < rounds or (time.perf_counter() - start < min_s and r < BAND_MAX_ROUNDS):
        k = r % len(items)
        yield from items[k:] + items[:k]
        r += 1


def _band_round(tracer, run, x, spans: list[list[float]], n: int) -> None:
    """One forward of a `measure_band_costs` executor: each of the first n ops' seconds, from
    the end of the op before to its own end, appended to its list."""
    tracer.reset()
    tracer.set_epoch()
    run(x)
    ends = [e["ts"] + e["dur"] for e in tracer.events if e["cat"] == "compute"]
    for l, (t0, t1) in enumerate(zip([0.0] + ends, ends[:n])):
        spans[l].append((t1 - t0) * 1e-6)


def band_spread(spans: list[list[float]]) -> tuple[float, float]:
    """(relative, seconds): a device's spread of one op's time from round to round, the median
    over ops of 1.4826 x the median absolute deviation (a normal's sigma), over the op's median
    and in seconds. The cost model's `straggle` takes the relative one: a group ends when the
    slowest of its ranks ends, and the slowest of k ranks whose times scatter ends later than
    the slowest mean. (The seconds, charged alike to every group, predicted ResNet-50's
    capped 4-device plans 9% and 21% above what they measured; the relative spread 2% and 1%.)"""
    rel, ab = [], []
    for ts in spans:
        if len(ts) >= 3:
            m = statistics.median(ts)
            if m > 0:
                ab.append(1.4826 * statistics.median(abs(t - m) for t in ts))
                rel.append(ab[-1] / m)
    return (statistics.median(rel), statistics.median(ab)) if rel else (0.0, 0.0)


def pooled_band(points: list[list]) -> list[list]:
    """Each device's (a, b) per op (seconds of a band of k rows = a + b x k) from its
    `measure_band_costs` points: its own time at the largest band, split into a and b by the
    devices' median share of it that is fixed (the line through a device's own two points
    alone moved with every burst of load: MobileNetV2's fixed parts summed to 28-50 ms on
    emu-geneflow4's 0.15-core device in profiles minutes apart). None where not timed."""
    out = [[None] * len(p) for p in points]
    for l in range(len(points[0]) if points else 0):
        shares, tops = [], []
        for per in points:
            pts = per[l]
            if not pts:
                tops.append(None)
                continue
            (k1, t1), (k2, t2) = pts[0], pts[-1]
            tops.append((k2, t2))
            if k2 > k1 and t2 > 0:
                b = max(0.0, (t2 - t1) / (k2 - k1))
                shares.append(min(max(t1 - b * k1, 0.0), t2) / t2)
        share = statistics.median(shares) if shares else 0.0
        for i, top in enumerate(tops):
            if top is not None:
                k2, t2 = top
                out[i][l] = (share * t2, (1.0 - share) * t2 / k2)
    return out


def pooled_overhead(op_s: list[list[float]], measured: list[float]) -> list[float]:
    """Each device's per-op overhead as the devices' least (measured overhead / the device's
    summed op seconds), times its own summed op seconds: the same code pays its bookkeeping
    in proportion to how fast the device runs it, and load from elsewhere only ever adds time,
    so the least inflated reading is the closest to the device's own cost (as the least of
    repeated timings is). Why: on emu-geneflow4 node-d's own figure for ResNet-50 read 1.2 to
    2.3 ms in eight profiles over 2.5 hours, node-c's 0.85 to 1.6 ms, and GenEFlow's capped
    plans, which load the slow devices, were predicted 16-20% slow. A traced run of one such
    plan showed 0.30, 0.46, 0.73 and 1.28 ms on the four devices (each rank's compute less its
    ops' predicted arithmetic); pooled by the least, the 02:12 profile gives 0.31, 0.50, 0.78
    and 1.03 ms; pooled by the median, 0.37, 0.59, 0.93 and 1.24 (the grid at 5cda293, with
    the median, then predicted ResNet-50's plans 10-29% slow). On real devices whose
    bookkeeping and arithmetic scale apart (a board whose GeMM is slower than its Python),
    the pooled figure is as wrong as that gap."""
    totals = [sum(t) for t in op_s]
    norm = [o / t for o, t in zip(measured, totals) if t > 0 and o > 0]
    if len(norm) < 2:
        return [float(o) for o in measured]
    k = min(norm)
    return [k * t for t in totals]


def measure_cnn_profile(comm, store, h: int, w: int, batch: int = 1, threads: int = 1,
                        mem_cap: float | None = None, hostfile: str | None = None,
                        power: list | None = None, band_min_s: float = BAND_MIN_S) -> dict:
    """A CNN's profile (all ranks call this): every op timed on every rank at h x w (the
    profile's `cnn` table, which hepti.plan.coedge plans from), each rank's memory, and its
    link to rank 0. `power`: declared (compute W, transmit W) per rank, for the energy
    objective; nothing measures power here. `band_min_s`: `measure_band_costs`' `min_s`."""
    comm = getattr(comm, "mpi", comm)
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    t_start = time.perf_counter()
    rank = comm.Get_rank()
    model = CNNModel.from_store(store, threads)
    graph = model.graph
    _barrier(comm)
    op_s = measure_cnn_ops(model, h, w, batch)
    overhead = measure_call_overhead()
    layout = measure_layout_rate()
    _barrier(comm)  # every rank at once, as a forward has them
    band, spread, stream = measure_band_costs(model, h, w, batch, read=store.read,
                                              min_s=band_min_s)
    fetch_s, conv_load = stream_fit(stream, graph)
    _barrier(comm)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    on_host = local.Get_size()
    local.Free()
    per_row, shapes = graph.flops_per_row(h, w), graph.shapes(h, w)
    conv_flops = batch * sum(per_row[op.name] * shapes[op.output][0]
                             for op in graph.ops if op.kind == CONV)
    conv_s = sum(t for op, t in zip(graph.ops, op_s) if op.kind == CONV)
    del model
    _return_freed_memory()
    avail, mem_source = available_memory()
    memory = avail / on_host if mem_cap is None else min(avail / on_host, float(mem_cap))
    _barrier(comm)
    links = measure_links(comm)
    collectives = measure_collectives(comm)
    mine = {"rank": rank, "host": MPI.Get_processor_name(),
            "gemm_flops": conv_flops / max(conv_s, 1e-9),  # the convolutions' overall rate
            "memory_bytes": float(memory), "call_overhead_s": overhead,
            "weight_load_Bps": conv_load,
            "measured": {"memory_source": mem_source, "ranks_on_host": on_host,
                         "threads": threads, "limits": resource_limits()}}
    devices = _with_links(comm.allgather(mine), links)
    all_op_s = comm.allgather(op_s)
    all_layout = comm.allgather(layout)
    all_fetch = comm.allgather(fetch_s)
    all_stream = comm.allgather(stream)
    all_band = comm.allgather(band)
    all_spread = comm.allgather(spread)
    cfg = store.config
    elapsed = comm.allreduce(time.perf_counter() - t_start, op=MPI.MAX)
    table = {"arch": cfg.arch, "ops": [op.name for op in graph.ops],
             "input": [h, w], "batch": batch, "op_s": all_op_s,
             "layout_s_per_byte": pooled_overhead(all_op_s, all_layout),
             "layout_s_per_byte_measured": all_layout,
             "fetch_overhead_s": all_fetch, "op_stream_measured": all_stream,
             "op_band_s": [[None if ab is None else list(ab) for ab in r]
                           for r in pooled_band(all_band)],
             "op_band_measured": all_band, "band_spread": [r for r, _ in all_spread],
             "band_sigma_s": [a for _, a in all_spread],
             "allgather_s": {str(k): list(v) for k, v in collectives.items()}}
    if power is not None:
        table["power"] = [list(p) for p in power]
    prof = {"hepti_profile": SCHEMA_VERSION, "created": time.time(), "source": "measured",
            "hostfile": hostfile, "model": cfg.name or None, "model_shape": cfg.shape,
            "seq_len": None, "network": dict(NETWORK_DEFAULTS), "devices": devices,
            "measure_s": elapsed, "batch": batch, "cnn": table}
    prof = comm.bcast(prof, root=0)
    profile_from_dict(prof, "measured profile")
    return prof


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
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

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
    everyone = [True] * size
    factors = {}
    def timed(fn, before) -> float:
        ts = []
        for _ in range(reps):
            before()
            _barrier(comm)  # a spinning barrier would spend a capped rank's quota first
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    for kind, fn in probes.items():
        fn()
        mine_s = max(timed(fn, compute), timed(fn, no_compute))
        measured = comm.allreduce(mine_s, op=MPI.MAX)
        coll = Collective(kind, None if kind == "bcast" else "rows", 4.0 * C * (rows if kind == "bcast" else 1))
        modelled = max(collective_times(coll, {"rows": rc}, everyone, profile))
        factors[kind] = float(min(max(measured / modelled, 0.2), 50.0)) if modelled > 0 else 1.0
    # Scatterv/Gatherv move the same bytes from/to one root as a Bcast does to all
    factors["scatterv"] = factors["gatherv"] = factors["bcast"]
    g.close()
    return factors


# --- cache -------------------------------------------------------------------------------------

# Part of the cache key: bump it when what a profile measures changes, so cached profiles
# measured the old way are measured again (2: attention timed inside a layer, by call size;
# 3: its part of the layer scaled to the windowed layer time; 4: collectives calibrated through
# the runtime's direct-exchange verbs; 5: the MLP's GeMMs timed as one `ffn` call; 6: ranks on
# one host calibrate the shared-memory transport; 7: a CNN's halo exchange's own work and its
# streamed convs' load rate; 8: a CNN op's fixed seconds, timed on a band of one row, a
# split by channels' layout copy, and a streamed conv's fixed cost a fetch; 9: a CNN op's
# cost on two bands, as the band executor runs them, their spread, and its allgathers among
# 2..N ranks; 10: a streamed conv's fetch timed inside the band executor's forward, and the
# whole-map, one-row and 32x32 timings that the bands replaced no longer made; 11: the band
# rounds timed for at least `BAND_MIN_S`; 12: the allgathers timed on long messages too,
# a second line past a link's burst; 13: the speed probe's `probe_s`, and every timing round
# starts level on an emulated device, `stretch.settle`).
PROFILER_REVISION = 13


def cache_dir() -> Path:
    return Path(os.environ.get("HEPTI_CACHE") or Path.home() / ".cache" / "hepti")


def profile_cache_path(hostfile: str | None, model_name: str, world_size: int,
                       hosts: list[str] | None = None, limits: list[dict] | None = None,
                       rows: int | None = None, threads: int = 1) -> Path:
    """Where the profile of this hostfile (its contents count) or these rank host names, model
    and world size is kept. Also keyed by each rank's caps (`resource_limits`: its cgroup CPU
    quota and memory limit, its emulated device and spec), so that clusters with the same host
    names but other caps or links (emu-mixed4, emu-tight and emu-starved) never share a profile,
    and by the token rows per batch and threads the speeds were measured at, and by
    `PROFILER_REVISION`."""
    host_text = ",".join(hosts) if hosts else ""
    if hostfile:
        try:
            host_text = Path(hostfile).read_text()
        except OSError:
            host_text = str(Path(hostfile).resolve())
    key = json.dumps([host_text, str(model_name), int(world_size), limits or None, rows, int(threads),
                      PROFILER_REVISION], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(model_name))[:40]
    return cache_dir() / f"profile-{safe}-n{world_size}-{digest}.json"


def cached_profile(comm, config: ModelConfig, seq_len: int, hostfile: str | None = None,
                   max_age_s: float = 24 * 3600, mem_cap: float | None = None, batch: int = 1,
                   threads: int = 1, refresh: bool = False) -> tuple[Profile, bool, Path]:
    """(profile, measured_now, cache file): the cached profile if fresh enough, else measure and
    cache it.
    All ranks call this; rank 0 decides and writes the file. Without a hostfile the cache is
    keyed by every rank's host name, in rank order; with or without one, also by every rank's
    caps (see `profile_cache_path`)."""
    comm = getattr(comm, "mpi", comm)
    size = comm.Get_size()
    hosts = comm.allgather(os.uname().nodename)
    limits = comm.allgather(resource_limits())
    path = profile_cache_path(hostfile, config.name, size, hosts=hosts, limits=limits,
                              rows=batch * seq_len, threads=threads)
    text = None
    if comm.Get_rank() == 0 and path.exists() and not refresh:
        try:
            load_profile(path, world_size=size, max_age_s=max_age_s)
            text = path.read_text()
        except PlanError:
            text = None  # stale, from another world size, or damaged: measure again
    text = comm.bcast(text, root=0)
    if text is not None:
        return profile_from_dict(json.loads(text), str(path)), False, path
    prof = measure_profile(comm, config, seq_len, mem_cap, batch, threads, hostfile)
    if comm.Get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(prof, indent=2) + "\n")
        tmp.replace(path)
    comm.Barrier()
    return profile_from_dict(prof, "measured profile"), True, path
