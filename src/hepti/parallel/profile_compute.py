"""What `hepti profile` measures of a rank's compute for the transformers: how fast this process
runs the engine's kernels and one layer of the model, the speed probe, and reading weights.

No MPI and no communication: each function times this process alone. hepti.parallel.profiling
runs them on every rank at once, between barriers, so that ranks sharing a machine see each
other's load as they will during a run. The module sits in the parallel layer only because it
times the work as the runtime groups and packs it (the interpreter's MLP pairs, the streamed
layers' `LayerSlice`); it never imports mpi4py.

- timing: `_timed_many` (interleaved rounds over windows long enough for a CFS quota, stretched
  as one unit of work on an emulated device: hepti.emulate.stretch) and `timing_window`;
- the speed probe (`SpeedProbe`, `measure_probe`): the profile's `probe_s`, which a serving rank
  reads again (hepti.serve.worker);
- one layer's GeMM and attention tables (`measure_layer`), a kernel call's fixed cost, the
  elementwise speed;
- reading a file from disk, and the rate `stream` turns stored weights into packed slices
  (`measure_disk`, `measure_weight_load`).
A CNN's compute is measured in hepti.parallel.profile_cnn.
"""
from __future__ import annotations

import math
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hepti import kernels as K
from hepti.config import ModelConfig
from hepti.emulate import stretch as _stretch
from hepti.families import config_from_dict, family_graph
from hepti.graph import lower
from hepti.graph.decoder import DECODE_CALLS
from hepti.kernels.int8 import GROUP
from hepti.model.llama import LlamaConfig, LlamaModel
from hepti.parallel.interpreter import _mlp_pair
from hepti.parallel.slices import LayerSlice
from hepti.resources import cpu_limit
from hepti.weights import WeightStore
from hepti.weights import decoder as decoder_weights
from hepti.weights.layout import expected_shapes
from hepti.weights.writer import TensorSpec, write_model

MIN_TIME_S = 0.03  # time each compute measurement for at least this long
QUOTA_PERIODS = 20  # under a CPU quota, time each round over at least this many CFS periods
DISK_PROBE_BYTES = 32 << 20
COLD_WEIGHT_BYTES = 48 << 20  # more than this machine's L2s together; see measure_layer
# Interleaved rounds of the layer timing. With 4, two identical cores of this machine came out
# 10% apart in one profile (BERT-base, 128 rows: 114.7 and 127.2 GFLOP/s), and the planner
# gave the "faster" one 136 of 256 rows, which ran 5% slower than 128 each.
LAYER_ROUNDS = 8
# The speed probe (`SpeedProbe`): its GeMM's rows, its rounds, each round's least length (of
# unstretched calls: a round lasts about PROBE_WINDOW_S / share on an emulated device), and the
# probes whose median the profile records, each after a sleep of PROBE_GAP_S (`measure_probe`)
PROBE_ROWS, PROBE_ROUNDS, PROBE_WINDOW_S, PROFILE_PROBES, PROBE_GAP_S = 32, 3, 1e-3, 5, 0.1


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
                K.gemm_any(x, up, threads=1)  # float32 or int8 (an int8 folder)

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


# --- a decoder's compute (issue 46) -------------------------------------------------------------

def measure_gemv(hidden: int, int8: bool = False, nbytes: int = COLD_WEIGHT_BYTES,
                 threads: int = 1, config=None, ranks: int = 1) -> float:
    """Bytes/s of weights one row's products read (a decode step's GeMVs): x [1, K] times
    weights packed as the decoder packs them (float32 `pack_b`; int8 `pack_q` of an [N, K]
    matrix in groups along K, as stored), as a decode step meets them cold. Bytes are the
    stored bytes (int8: values and their scales), so a plan prices the bytes a rank holds.

    With a decoder's `config`: the four products of a layer (q|k|v, o, gate|up, down) at the
    shapes a rank holds at even shares over `ranks` (`decode_call_config`), through as many
    layers as make `nbytes` at least (each at most 2 `nbytes`: a wider layer is timed at the
    shape of a finer share), one after the other, as a step runs them. Until 2026-11-29 this
    timed one [C, N] matrix of `nbytes` again and again (the figure without `config`): 1.3x
    the bytes/s of llama-1b's real layers cycled the same way in one process (30 against 23
    GB/s of CPU, 1 and 2 ranks' shapes, interleaved), and emulated decode steps spent 1.3x
    the GeMV time the plan counted."""
    rng = np.random.default_rng(3)
    vb = 1 + 4 / GROUP if int8 else 4  # stored bytes of one weight value

    def packed(n, k, trans):  # B [k, n] stored as the decoder stores it ([n, k] if trans,
        # as HF's q/k/v and gate/up; [k, n] as o and down), packed as it packs it
        shape = (n, k) if trans else (k, n)
        if int8:  # int8 values and scales made as such: quantising a float32 matrix of the
            # same shape held 4x the bytes a few times over (a 0.8 GiB peak for llama-1b's
            # width, more than an 800 MiB emulated board has)
            q = rng.integers(-127, 128, shape, dtype=np.int8)
            scales = rng.random((shape[0], -(-shape[1] // GROUP)), dtype=np.float32)
            return K.pack_q(K.QuantMatrix(q, scales * np.float32(1e-3), GROUP), trans=trans)
        return K.pack_b(rng.standard_normal(shape, dtype=np.float32), trans=trans)

    if config is None:
        n = max(GROUP, int(nbytes // (hidden * vb)) // GROUP * GROUP)
        shapes = [(n, hidden, True)]
    else:
        share = max(1, int(ranks))
        while True:
            one = decode_call_config(config, share)
            C, D, kv, f = (one.hidden_size, one.head_dim, one.num_key_value_heads,
                           one.intermediate_size)
            layer = [((one.group + 2) * kv * D, C, True), (C, one.group * kv * D, False),
                     (2 * f, C, True), (C, f, False)]  # q|k|v, o, gate|up, down: (N, K, HF's)
            layer_bytes = sum(n * k for n, k, _ in layer) * vb
            if layer_bytes <= 2 * nbytes or (kv == 1 and f == GROUP):
                break
            share *= 2
        shapes = layer * int(min(DECODE_CALL_MAX_COPIES, max(1, math.ceil(nbytes / layer_bytes))))
    mats = [(packed(n, k, t), rng.standard_normal((1, k), dtype=np.float32),
             np.empty((1, n), np.float32)) for n, k, t in shapes]
    total = sum(n * k for n, k, _ in shapes) * vb

    def run():
        for w, x, out in mats:
            K.gemm_any(x, w, out=out, threads=threads)

    return total / _timed(run)


def measure_gemvs(hidden: int, threads: int = 1, config=None, ranks: int = 1) -> dict:
    """The profile's `gemv_Bps` and `gemv_int8_Bps` (`measure_gemv`; with a decoder's
    `config`, on a rank's layer shapes at even shares over `ranks`). A one-row product is
    bound by memory bandwidth, which ranks on one machine share while they decode, so
    hepti.parallel.profiling calls this on every rank at once, right after a barrier: each
    rank's figure is its share with the others reading too, as in a run (under `hepti emulate`
    each rank is also held to its own CPU share)."""
    kw = {"threads": threads, "config": config, "ranks": ranks}
    return {"gemv_Bps": measure_gemv(hidden, **kw),
            "gemv_int8_Bps": measure_gemv(hidden, int8=True, **kw)}


DECODE_CALL_MAX_COPIES = 16  # layers `measure_decode_step` cycles through at most


def decode_call_config(config, ranks: int = 1, copies: int = 1, ctx: int = 64):
    """A decoder of `copies` layers, each of the shape one of `ranks` ranks holds of `config`'s
    at even shares: the whole hidden width and head size, its KV heads (at least one) with
    their query heads, its MLP columns (at least one group of `GROUP`), a vocabulary of 64."""
    kv = max(1, round(config.num_key_value_heads / ranks))
    ffn = max(GROUP, round(config.intermediate_size / ranks / GROUP) * GROUP)
    return LlamaConfig(vocab_size=64, hidden_size=config.hidden_size, num_hidden_layers=copies,
                       num_attention_heads=kv * config.group, num_key_value_heads=kv,
                       intermediate_size=ffn, head_dim=config.head_dim,
                       max_position_embeddings=ctx + 1, rms_norm_eps=config.rms_norm_eps,
                       rope_theta=config.rope_theta)


def measure_decode_step(config, ctx: int = 64, ranks: int = 1,
                        cold_bytes: float = COLD_WEIGHT_BYTES) -> dict:
    """What a decode step costs beyond its GeMVs' bytes, as a step meets it: the profile's
    `call_overhead_s` for a decoder (seconds of one of the calls a layer makes, which the
    decode program charges for each of the calls it counts: hepti.graph.decoder
    `DECODE_CALLS` a layer) and `token_overhead_s` (seconds of a step's work outside its
    layers and its head's GeMV: the ids checked, the embedding looked up, RoPE's row, the
    final RMSNorm, the choice's argmax and Python; one "token" Work a step).

    A decode step's layer is some fifteen calls on one row (RMSNorm, q|k|v, RoPE, the cache,
    scores, softmax, context, o; RMSNorm, gate|up, SiLU, the product, down): each costs
    microseconds of Python and dispatch, and the elementwise ones and attention more as the
    width and the heads grow, and at one row that adds up to a part of the step the GeMVs'
    bytes do not show. So this times `LlamaModel.forward` itself, one token against a cache
    of `ctx` tokens, and the choice of the next (argmax over the rank's share of the
    vocabulary, and greedy's merge of `ranks` pairs), at a rank's shape (`decode_call_config`:
    its KV heads, MLP columns and the whole width at even shares over `ranks`), int8 weights
    in layers that together exceed `cold_bytes` (a decode step meets each layer, and what its
    calls read, after the others' weights went through the caches). The head's GeMV is left
    out (its bytes are priced; its logits are a fixed array of the rank's vocabulary rows).
    The parts outside the GeMVs, by the CPU time of the calls (as `measure_layer` parts
    attention: the GeMVs' thread time against the step's), scaled to the step's timed seconds.

    Until 2026-11-29 this timed a 64-wide layer of one KV head, hot: 133 us a layer of
    llama-1b where a rank's half of the real layer spent 264 us outside its GeMVs (uncapped,
    one process), and an emulated 0.4-core rank 0.36 ms of CPU (14 ms of its 164 ms step
    where the plan counted 4.3; docs/results/llm.md). Then it timed the layer alone, and a
    step's 0.6-0.9 ms of CPU outside its layers (20-22 ms of an emulated 0.4-core step
    outside the GeMVs where the plan counted 9) went uncounted."""
    rng = np.random.default_rng(5)
    one = decode_call_config(config, ranks, 1, ctx)
    C, D, kv, f = one.hidden_size, one.head_dim, one.num_key_value_heads, one.intermediate_size
    layer_bytes = C * ((2 * one.group + 2) * D * kv + 3 * f) * (1 + 4 / GROUP)
    copies = int(min(DECODE_CALL_MAX_COPIES, max(2, math.ceil(cold_bytes / layer_bytes))))
    cfg = decode_call_config(config, ranks, copies, ctx)

    def weight(name, shape):
        if len(shape) == 2:
            q = rng.integers(-127, 128, shape, dtype=np.int8)
            scales = rng.random((shape[0], -(-shape[1] // GROUP)), dtype=np.float32)
            return K.QuantMatrix(q, scales * np.float32(1e-3), GROUP)
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(0.05)

    weights = {n: weight(n, shape) for n, shape in decoder_weights.expected_shapes(cfg).items()}
    model = LlamaModel(cfg, weights, consume=True)
    del weights
    cache = model.new_cache(ctx + 1)
    # the head's logits: the rank's share of the real vocabulary, not computed (see above)
    logits = rng.standard_normal((1, max(1, round(config.vocab_size / ranks))), dtype=np.float32)
    gemv_cpu, layer_cpu = [0.0], [0.0]
    mm, layer = model._mm, model.layer

    def timed_mm(a, w, residual=None):
        if w is model.head:
            return logits
        c0 = time.thread_time()
        y = mm(a, w, residual=residual)
        gemv_cpu[0] += time.thread_time() - c0
        return y

    def timed_layer(*a):
        c0 = time.thread_time()
        y = layer(*a)
        layer_cpu[0] += time.thread_time() - c0
        return y

    model._mm, model.layer = timed_mm, timed_layer
    pairs = np.zeros((max(ranks, 1), 2))
    turn, parts = [0], []  # (calls, token) CPU fractions of each step

    def step():
        gemv_cpu[0] = layer_cpu[0] = 0.0
        turn[0] += 1
        c0 = time.thread_time()
        cache.n = ctx
        z = model.forward([turn[0] % cfg.vocab_size], cache)
        i = int(np.argmax(z))  # TokenChooser.greedy's own work, its allgather left out
        pairs[0] = (float(z[i]), i)
        int(pairs[np.lexsort((pairs[:, 1], -pairs[:, 0]))[0], 1])
        total = time.thread_time() - c0
        if total > 0:
            parts.append((max(layer_cpu[0] - gemv_cpu[0], 0.0) / total,
                          max(total - layer_cpu[0], 0.0) / total))

    step()
    parts.clear()
    step_s = _timed(step)
    return {"call_overhead_s": statistics.median(p[0] for p in parts) * step_s
            / (copies * DECODE_CALLS),
            "token_overhead_s": statistics.median(p[1] for p in parts) * step_s}


def measure_decoder(config, rows: int, threads: int = 1, ranks: int = 1) -> dict:
    """A decoder's compute figures for the profile (hepti.plan.profile's device fields) but its
    GeMV bytes/s (`measure_gemv`, which hepti.parallel.profiling times with every rank at once):
    `gemm_flops`, a table by the GeMM's rows m up to the prompt's `rows` (the MLP's gate
    projection, [m, C] x [C, F], as prefill runs its GeMMs; the encoders' `measure_layer` times
    an encoder's layer graph, which a decoder has not), `elementwise_per_s` (RMSNorm on
    [rows, C], as the decoder runs it), `call_overhead_s` and `token_overhead_s`
    (`measure_decode_step`, at a rank's shape at even shares over `ranks`).
    Attention is left to the GeMM's table (the profile's default)."""
    rng = np.random.default_rng(4)
    C, F = config.hidden_size, config.intermediate_size
    w = K.pack_b(rng.standard_normal((C, F), dtype=np.float32) * np.float32(0.05))
    sizes = sorted({s for s in (8, 32, 128, 512) if s < rows} | {rows})
    xs = {m: rng.standard_normal((m, C), dtype=np.float32) for m in sizes}
    secs = _timed_many({m: (lambda m=m: K.gemm(xs[m], w, threads=threads)) for m in sizes})
    gemm = [[float(min(m, C)), 2.0 * m * C * F / secs[m]] for m in sizes]
    x, gamma = xs[rows], np.ones(C, np.float32)
    norm_s = _timed(lambda: x * (1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True)
                                               + np.float32(config.rms_norm_eps))) * gamma)
    return {"gemm_flops": gemm, "elementwise_per_s": rows * C / norm_s,
            **measure_decode_step(config, ranks=ranks)}
