"""The job behind `mpiexec -n N hepti run`, for every executor kind: one rank's part of a run
(`Job` on the interpreter, `BandJob` on the height split), and the one driver over them
(`run_prepared`: plan, load, passes, gather, trace, report, resume).

Rank 0 reads the inputs, and pools and writes each batch's output as it completes
(hepti.runner). A job's primary (rank 0 unless the plan says otherwise) runs the operators only
it runs (embeddings, the pixels' first exchange) and collects each batch's output: it is its
group's rank 0, the root of the verbs. Ranks with no share take part in nothing costly: they
wait for the end in a sleeping poll. The plan comes from hepti.parallel.plans; the failure
discipline (errors every rank agrees on, abort on any other) is hepti.parallel.world's.

**The job interface** (`JOBS`, by the family's executor kind), what the driver asks of a job:
- `input_shape(source, k)` (static, rank 0): the shape of batch k that plans are made for;
- `plan_for(args, world, store, shape)` (class, collective): the plan every rank runs;
- `Job(world, store, plan, threads)` (collective): this rank's weights and executor;
- `watch_scale(plan, args, source, start, shape)` (static, rank 0): the largest batch of the
  run against the plan's, for the stall watch's timeout;
- `run_all(batches, n, on_output)`, `rank_stats(per_pass)`, `close()`, `active` (the ranks
  that work) and `report_fields(shape)` (rank 0: the report's fields of this kind).
"""
from __future__ import annotations

import json
import os
import statistics
import time

import numpy as np

from hepti.counts import counts, offsets
from hepti.families import family, family_graph, load_kernels
from hepti.graph import lower
from hepti.graph.cnn import build
from hepti.graph.lower import prologue_steps, stage_steps
from hepti.graph.split import conv_rows, streamed_convs
from hepti.model.cnn import Weights
from hepti.parallel import watchdog
from hepti.parallel.bands import BandExecutor, btsearch_order, head_rows
from hepti.parallel.comm import Comm
from hepti.parallel.interpreter import Interpreter
from hepti.parallel.layers import ResidentLayers, StreamingLayers, slice_packer
from hepti.parallel.pipeline import PipelineExecutor
from hepti.parallel.plans import (active_ranks, bands_plan, check_stream_windows, counts_of,
                                  interpreter_plan, plan_assignment, stream_window, sub_ratios)
from hepti.parallel.slices import outside_layers
from hepti.parallel.trace import chrome_trace
from hepti.parallel.watchdog import cnn_scale, transformer_scale
from hepti.parallel.world import agree, gentle_barrier, world_comm
from hepti.plan.coedge import split_of
from hepti.plan.planfile import Plan
from hepti.resources import current_rss, peak_rss, reset_peak_rss
from hepti.runner import base_report, finish, run_passes
from hepti.weights import WeightStore

FAULT_ENV = "HEPTI_FAULT_RANK"  # test-only: this rank raises in its first forward


def layer_spec(plan: Plan, cfg, rank: int) -> tuple | None:
    """What this rank's layer weights are under `plan`, as a key: two plans with the same key
    hold the same weights on this rank (a new plan can keep them: hepti.serve re-plans).
    None for a rank that holds none."""
    H, F, L = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers
    s = plan.strategy
    if rank not in active_ranks(plan, cfg):
        return None
    if s == "pipeline":
        a, b = plan.layers[rank]
        return ("resident", (0, H), (0, F), (a, b)) if b > a else None
    if s in ("rows", "single"):
        return ("resident", (0, H), (0, F), (0, L))
    c = counts_of(plan, cfg)
    ho, fo = offsets(c["heads"]), offsets(c["ffn"])
    heads = (ho[rank], ho[rank] + c["heads"][rank])
    ffn = (fo[rank], fo[rank] + c["ffn"][rank])
    if s == "mixed":  # a block split by token rows needs its unit's weights whole
        graph = family_graph(cfg, 1, 1)
        assign = plan_assignment(plan, graph)
        if lower.per_layer(assign):  # each layer its own ranges
            per = []
            for i in range(L):
                sliced = lower.sliced_units(graph, assign, i)
                per.append((heads if "heads" in sliced else (0, H), ffn if "ffn" in sliced else (0, F)))
            return ("layers", tuple(per), None, (0, L))
        sliced = lower.sliced_units(graph, assign)
        heads = heads if "heads" in sliced else (0, H)
        ffn = ffn if "ffn" in sliced else (0, F)
    if s == "stream":
        return ("stream", heads, ffn, stream_window(plan, cfg, rank))
    return ("resident", heads, ffn, (0, L))


def build_layers(store, spec: tuple, pack, on_layer=None):
    """The layer weights a `layer_spec` names, read from this device's own files (no MPI: a
    background thread may build them while another plan serves). `on_layer(slice)` sees each
    resident slice as it is read (hepti.parallel.layers.ResidentLayers)."""
    kind, heads, ffn, extra = spec
    L = store.config.num_hidden_layers
    if kind == "stream":
        return StreamingLayers(store, L, heads, ffn, pack, extra)
    if kind == "layers":  # per layer (heads, ffn): `heads` holds them
        return ResidentLayers(store, L, None, None, pack, ranges=heads, on_layer=on_layer)
    layers = None if extra == (0, L) else range(*extra)
    return ResidentLayers(store, L, heads, ffn, pack, layers=layers, on_layer=on_layer)


class Job:
    """One rank's part of a distributed run of an interpreter family: its group, its slices,
    its executor (the interpreter, or a pipeline of interpreters).

    `layers`, when given, are this rank's weights for `plan` built ahead (`build_layers` of its
    `layer_spec`), and `primary_ops` the primary's embeddings from a job before; the job then
    reads neither. Collective over the world (the group's split)."""

    def __init__(self, world, store, plan: Plan, threads: int = 1, layers=None, primary_ops=None):

        self.world, self.store, self.plan = world, store, plan
        cfg = self.cfg = store.config
        rank = world.rank
        self.active = active_ranks(plan, cfg)
        self.is_active = rank in self.active
        fam = family(cfg)
        if self.is_active:  # the kernels' code (~70 MiB) is the runtime's, not the job's
            load_kernels(cfg, threads, announce=rank == 0, dtype=store.dtype)
        reset_peak_rss()
        self.rss_before_load = current_rss()
        # one sub-communicator of the ranks that work (freed by close()); the others skip
        # straight to the end. `single`'s is rank 0 alone: a group of one, whose verbs return
        self.group = world.split(self.is_active, first=rank == plan.primary)
        self.layers = self.executor = None
        self._layers_peak = 0  # the layers' peak once closed (`close` lets them go)
        self.primary_ops = {}
        self.spec = layer_spec(plan, cfg, rank)
        if not self.is_active:
            return
        if rank == plan.primary:  # the operators only it runs (embeddings), with their weights
            self.primary_ops = primary_ops or fam.primary_ops(cfg, store)
        H, F, L = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers
        s = plan.strategy
        graph = family_graph(cfg, 1, 1)  # the schedule does not depend on the batch's shape
        pack = slice_packer(graph)
        if self.spec is not None:
            self.layers = layers if layers is not None else build_layers(store, self.spec, pack)
        if s == "pipeline":  # each stage its layers whole, on a group of itself alone
            ranges = [tuple(x) for x in plan.layers]
            a, b = ranges[rank]
            whole = lower.schedule(graph, lower.assignment(graph, "single"), L)
            units = {"heads": [H], "ffn": [F]}
            if rank == 0:  # the embeddings of each batch as it enters the pipeline
                self.prologue = Interpreter(Comm(None, tracer=world.tracer), graph,
                                            prologue_steps(whole), None, self.primary_ops, [1.0],
                                            units, threads)
            stage = None
            if b > a:
                last = rank == max(r for r, (x, y) in enumerate(ranges) if y > x)
                stage = Interpreter(Comm(None, tracer=world.tracer), graph,
                                    stage_steps(whole, a, b, last), self.layers, {}, [1.0], units,
                                    threads, outside_layers(graph, store) if last else None)
            self.executor = PipelineExecutor(world, stage, ranges)
            return
        if s in ("rows", "single"):
            # `rows` on one active rank is the single-device forward: run it as `single` does,
            # by heads and columns of one rank (attention on the QKV output in place; `rows`
            # would gather K/V into a copy and attend through it, 3-5% slower at half a core:
            # emu-mixed4, MiniLM, where `auto` leaves rank 0 alone)
            split = s == "rows" and len(self.active) > 1
            rows = sub_ratios(plan, self.active)["rows"] if split else [1.0]
            units = {"heads": [H] * len(rows), "ffn": [F] * len(rows)}
            assign = lower.assignment(graph, "rows" if split else "single")
        else:
            c = counts_of(plan, cfg)
            rows = sub_ratios(plan, self.active)["rows"]
            units = {u: [c[u][r] for r in self.active] for u in ("heads", "ffn")}
            if s == "mixed":  # GenEFlow: each block its own split (hepti.plan.genetic)
                assign = plan_assignment(plan, graph)
                whole = {"heads": H, "ffn": F}
                for u in set(units) - lower.sliced_units(graph, assign):
                    units[u] = [whole[u]] * len(self.active)
            else:
                assign = lower.assignment(graph, "tensor")
        self.executor = Interpreter(self.group, graph, lower.schedule(graph, assign, L), self.layers,
                                    self.primary_ops, rows, units, threads,
                                    outside_layers(graph, store))

    def run_all(self, batches, n: int, on_output=None) -> None:
        """Run n batches, in order. `batches` is an iterable on rank 0 (ignored elsewhere);
        there on_output(i, hidden [B, T, C]) is called as the i-th completes, so rank 0 never
        holds more than the batches in flight. With a primary other than rank 0, rank 0 sends
        it each batch (before its own part of the batch, if it has one) and receives the
        output after."""
        rank0, p = self.world.rank == 0, self.plan.primary
        relay = p != 0 and (rank0 or self.world.rank == p)
        if not self.is_active and not relay:
            return
        fault = os.environ.get(FAULT_ENV)
        if fault is not None and int(fault) == self.world.rank:
            raise RuntimeError(f"injected fault ({FAULT_ENV}={fault})")
        if self.plan.strategy == "pipeline":
            self._run_pipeline(batches if rank0 else (), n, on_output)
            return
        w = self.world
        it = iter(batches) if rank0 else None
        for k in range(n):
            b = next(it) if rank0 else None
            with w.tracer.span(f"batch {k}", "batch"):
                if relay and rank0:
                    w.send_obj(b, p)
                elif relay:
                    b = w.recv_obj(0)
                out = self._one_batch(b) if self.is_active else None
                if relay and rank0:
                    out = w.recv_array(p)[0]
                elif relay:
                    w.send_array(out, 0)
            if rank0 and on_output is not None:
                on_output(k, out)

    def _run_pipeline(self, batches, n: int, on_output) -> None:
        """The primary embeds each batch as it enters the pipeline, and gets [B, T, C] back."""
        C, shapes = self.cfg.hidden_size, {}

        def inputs():  # on the primary only
            layers_read = self.prologue.graph.layer[0].inputs[0]
            for k, b in enumerate(batches):
                shapes[k] = B, T = b.mask.shape
                yield self.prologue.run({}, b, B, T, layers_read), b.mask.astype(np.float32)

        def done(k, out):
            if on_output is not None:
                on_output(k, out.reshape(*shapes.pop(k), C))

        self.executor.forward_many(inputs(), n, done)

    def _one_batch(self, b):
        """One batch through the executor: its shape first (every rank needs it), then the
        schedule. Returns hidden [B, T, C] on the primary."""
        g, C = self.group, self.cfg.hidden_size
        rank0 = g.rank == 0  # the primary
        # the shape as two integers, not a pickled tuple (40 us inside a forward, against 2-5)
        B, T = (int(v) for v in g.bcast_to_all(np.array(b.mask.shape, np.int64) if rank0 else None,
                                               (2,), np.int64))
        h = self.executor.forward(b, B, T)  # the mask to every rank, the embedding, the layers
        return h.reshape(B, T, C) if rank0 else None

    def close(self, keep_layers: bool = False):
        """Collective over the active ranks (the group frees its shared window). keep_layers:
        the weights stay open for a next job that holds the same (`layer_spec`). A closed job
        refers to no weights (its executor binds the slices' arrays too): the caller decides
        what outlives it, and a serve rank's switch reads the next plan's slices only once the
        current ones are gone (hepti.serve.worker)."""
        if self.layers is not None:
            # kept for rank_stats after close (run_plan closes before its callers read it)
            self._layers_peak = self.layers.peak_bytes
            if not keep_layers:
                self.layers.close()
        self.layers = self.executor = None
        if self.group is not None:
            self.group.close()

    def rank_stats(self, runs: list[dict]) -> dict:
        """This rank's figures: medians over the timed runs, plus memory and disk reads."""
        layer_bytes = self.layers.peak_bytes if self.layers is not None else self._layers_peak
        emb = sum(getattr(f, "nbytes", 0) for f in self.primary_ops.values())
        return {**pass_figures(self.world.rank, self.is_active, runs),
                "layer_weight_bytes_resident": int(layer_bytes),
                "weight_bytes_resident": int(layer_bytes + emb),
                "weight_bytes_read": int(self.store.bytes_read),
                "rss_before_load_bytes": self.rss_before_load}

    # --- what the driver asks of the interpreter's job (the module docstring) ------------
    @staticmethod
    def input_shape(source, k: int) -> tuple[int, int]:
        """(B, T) of batch k, from the source's counts (no batch is made)."""
        a, b = source.rows(k)
        return b - a, source.lengths[k]

    @classmethod
    def plan_for(cls, args, world, store, shape) -> Plan:
        return interpreter_plan(args, world, store, shape)

    @staticmethod
    def watch_scale(plan: Plan, args, source, start: int, shape) -> float:
        return transformer_scale(plan.batch, plan.seq_len, min(args.batch_size, source.n),
                                 max(source.lengths[start:], default=shape[1]))

    def report_fields(self, shape) -> dict:
        """What the report says of this run's plan: who works, each rank's whole heads, FFN
        columns and token rows of the first batch (layers, for a pipeline)."""
        plan, cfg = self.plan, self.cfg
        used = ({"layers": plan.layers} if plan.strategy == "pipeline" else
                {**counts_of(plan, cfg), "rows": counts(shape[0] * shape[1], plan.ratios["rows"])})
        out = {"primary": plan.primary, "counts": used}
        if plan.mem_budget:
            out["mem_budget"] = plan.mem_budget
        return out


def pass_figures(rank: int, active: bool, runs: list[dict]) -> dict:
    """One rank's figures over the timed passes (`runs`: each pass's wall time, the tracer's
    seconds by kind and bytes), every job's alike: medians of wall, compute, each kind of
    communication and I/O wait; bytes sent and received; the peak RSS."""
    def med(values):
        values = list(values)
        return statistics.median(values) if values else 0.0
    kinds = sorted({k for r in runs for k in r["seconds"] if k not in ("compute", "io", "batch")})
    comm_s = {k: med(r["seconds"].get(k, 0.0) for r in runs) for k in kinds}
    return {"rank": rank, "host": os.uname().nodename, "active": active,
            "wall_s": med(r["wall"] for r in runs),
            "compute_s": med(r["seconds"].get("compute", 0.0) for r in runs),
            "comm_s": comm_s, "comm_total_s": sum(comm_s.values()),
            "io_wait_s": med(r["seconds"].get("io", 0.0) for r in runs),
            "bytes_sent": int(med(r["bytes_sent"] for r in runs)),
            "bytes_recv": int(med(r["bytes_recv"] for r in runs)),
            "peak_rss_bytes": peak_rss()}


class BandJob:
    """One rank's part of a CNN run: its weights (every conv of a group it has rows of, its
    channels of a conv split by channels, its columns of the head) and the band executor.
    `run_all(batches, n, on_output)` as `Job`'s: rank 0 reads the batches and gets
    on_output(i, logits [B, 1, classes]).

    The executor runs on a sub-communicator of the ranks that work (a share of some group's
    rows or of the head) and rank 0, which holds the pixels and the logits; the others load
    nothing and skip every batch, as an encoder's idle ranks do. On the whole world, an idle
    device on a slow link sat in each forward's broadcast and in the pooling's allreduce
    (MobileNetV2 on emu-mixed4, two of four ranks active: 2.6 ms of allreduce on rank 0 for
    [1, 1280] floats, over the 240 and 100 Mbit/s links of ranks it does not need)."""

    def __init__(self, world, store, plan: Plan, threads: int = 1):
        self.world, self.store, self.plan = world, store, plan
        graph = build(store.config)
        split = split_of(plan)
        self.active = [i for i, r in enumerate(split.ratios) if r > 0]
        self.members = split.members()
        if world.rank in self.members:  # compiled before the job counts its memory or time
            load_kernels(store.config, threads, announce=world.rank == 0)
        reset_peak_rss()
        self.rss_before_load = current_rss()
        self.group = world.split(world.rank in self.members, first=world.rank == 0)
        self.weights = self.executor = None
        if self.group is None:
            return
        sub = split.on(self.members)
        self.weights = Weights(graph, store.read,
                               head_rows(graph, sub, self.group.rank, self.group.size),
                               conv_rows(graph, sub, self.group.rank, self.group.size),
                               streamed_convs(graph, sub))
        self.executor = BandExecutor(self.group, graph, sub, self.weights, threads,
                                     btsearch_order(graph))

    def run_all(self, batches, n: int, on_output=None) -> None:
        if self.executor is None:
            return
        w, rank0 = self.world, self.world.rank == 0
        it = iter(batches) if rank0 else None
        for k in range(n):
            b = next(it) if rank0 else None
            with w.tracer.span(f"batch {k}", "batch"):
                logits = self.executor.forward(b.pixels if rank0 else None)
            if rank0 and on_output is not None:
                on_output(k, logits[:, None, :])

    def rank_stats(self, runs: list[dict]) -> dict:
        held = int(self.weights.nbytes if self.weights else 0)
        return {**pass_figures(self.world.rank, self.world.rank in self.active, runs),
                "layer_weight_bytes_resident": held, "weight_bytes_resident": held,
                "streamed_weight_bytes_max": int(self.weights.streamed_bytes
                                                 if self.weights else 0),
                "weight_bytes_read": int(self.store.bytes_read),
                "rss_before_load_bytes": self.rss_before_load}

    def close(self) -> None:
        """Collective over the members (the group's communicator is freed)."""
        if self.group is not None:
            self.group.close()

    # --- what the driver asks of the band job (the module docstring) ---------------------
    @staticmethod
    def input_shape(source, k: int) -> tuple[int, tuple[int, int]]:
        """(N, (H, W)) of batch k: its pixels' (images of any size are resized per batch)."""
        px = source.batch(k).pixels
        return px.shape[0], tuple(px.shape[2:])

    @classmethod
    def plan_for(cls, args, world, store, shape) -> Plan:
        return bands_plan(args, world, store, shape)

    @staticmethod
    def watch_scale(plan: Plan, args, source, start: int, shape) -> float:
        return cnn_scale(plan.batch, (plan.predicted or {}).get("input"), *shape)

    def report_fields(self, shape) -> dict:
        """The plan's fused groups, head split and per-group counts, at the first input's size."""
        plan = self.plan
        return {"groups": plan.groups, "head": plan.head, "input_hw": list(shape[1]),
                "counts": plan.counts or {}, "explanation": plan.explanation}


JOBS = {"interpreter": Job, "bands": BandJob}  # hepti.families EXECUTORS that `hepti run` runs

def run_plan(model_dir, plan: Plan, batches, threads: int = 1, world=None):
    """Library entry: run `batches` (needed on the primary only) under `plan` on every rank of
    the world. Returns (hidden states per batch on the primary / [] elsewhere, the Job)."""
    world = world or world_comm()
    store = agree(world, lambda: WeightStore(model_dir))
    plan = agree(world, lambda: plan.validate(world.size))
    check_stream_windows(world, plan, store.config)
    n = world.bcast_obj(len(batches) if world.rank == 0 else None)
    job = agree(world, lambda: Job(world, store, plan, threads))
    outs = []
    try:
        job.run_all(batches, n, lambda i, h: outs.append(h))
        return outs, job
    finally:
        job.close()
        gentle_barrier(world.mpi)


def run_prepared(args, world, store, prep, t_start: float, kind: str) -> int:
    """`hepti run` on every rank once the inputs are checked and the output open (`prep`,
    rank 0), for a family whose executor is `kind` (`JOBS`): the plan for the first batch's
    shape, the job, the passes (resuming where `prep`'s output left off), each rank's figures
    gathered, the trace, the report."""
    job_kind = JOBS[kind]
    mpi, rank0, size, cfg = world.mpi, world.rank == 0, world.size, store.config
    source = prep.source if rank0 else None
    start = prep.out.start if rank0 and prep.out is not None else 0
    first = min(start, source.n_batches - 1) if rank0 else None  # the plan is made for its shape
    n, shape = world.bcast_obj((source.n_batches - start, job_kind.input_shape(source, first))
                               if rank0 else None)
    plan = job_kind.plan_for(args, world, store, shape)
    t0 = time.perf_counter()
    job = agree(world, lambda: job_kind(world, store, plan, args.threads))
    load_s = time.perf_counter() - t0

    world.tracer.record_events = bool(args.trace)
    per_pass = []

    def start_pass():
        gentle_barrier(mpi)  # start together; idle ranks sleep instead of spinning
        world.tracer.reset()
        world.tracer.set_epoch()

    def end_pass(run):
        per_pass.append({"wall": run["wall_s"], "seconds": dict(world.tracer.seconds),
                         "bytes_sent": world.tracer.bytes_sent, "bytes_recv": world.tracer.bytes_recv})

    # the largest batch this run computes, against the plan's shape
    scale = job_kind.watch_scale(plan, args, source, start, shape) if rank0 else 1.0
    watch = start_watch(world, args, plan, scale)
    try:
        runs = run_passes(job, prep, n, args, start_pass=start_pass, end_pass=end_pass,
                          watch=watch)
        events = world.tracer.events
        gentle_barrier(mpi)
        stats = mpi.gather(job.rank_stats(per_pass), root=0)
        all_events = mpi.gather(events, root=0) if args.trace else None
        job.close()
    finally:
        if watch is not None:
            watch.close()
    if not rank0:
        return 0

    report = base_report(args, cfg, prep, load_s, runs, plan.strategy, size, t_start)
    report.update({
        "active_ranks": sorted(job.active),
        "ratios": plan.ratios,
        "throughput_inputs_per_s": (prep.source.n / report["latency_s"]["median"]
                                    if runs and report["latency_s"]["median"] > 0 else None),
        "per_rank": stats,
        "stall_timeout_s": watch.timeout if watch is not None else None,
        **job.report_fields(shape),
    })
    attach_prediction(report, stats, plan)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(all_events, {"strategy": plan.strategy, "world_size": size}), f)
        report["trace"] = args.trace
    finish(args, report, runs)
    if not args.json:
        print(format_plan_line(report, plan))
        print(format_rank_table(report))
    return 0


def start_watch(world, args, plan: Plan, scale: float = 1.0):
    """Collective: the stall watch over a job's passes (hepti.parallel.watchdog), or None on
    one rank or with --stall-timeout 0. Rank 0 chooses the timeout: --stall-timeout, else
    from the plan's predicted batch time, scaled to the run's largest batch (`scale`)."""
    timeout = None
    if world.rank == 0:
        given = getattr(args, "stall_timeout", None)
        timeout = (watchdog.default_stall_timeout(plan.predicted_latency_s, scale)
                   if given is None else given)
    return watchdog.start(world, timeout, args)


def attach_prediction(report: dict, stats: list[dict], plan: Plan) -> None:
    """A planned run's report: the plan's prediction beside each rank's measurement."""
    if plan.predicted_latency_s is None:
        return
    report["predicted_latency_s"] = plan.predicted_latency_s
    report["predicted"] = plan.predicted
    for st, pr in zip(stats, plan.predicted.get("per_rank", [])):
        st["predicted"] = pr
    report["explanation"] = plan.explanation


def format_plan_line(report: dict, plan: Plan) -> str:
    c = report["counts"]
    parts = [f"plan: {plan.strategy} on ranks {sorted(report['active_ranks'])}"]
    if plan.primary:
        parts.append(f"primary rank {plan.primary}")
    parts += [f"{k} {v}" for k, v in c.items()]
    line = ", ".join(parts)
    if plan.explanation:
        line += f"\n  why: {plan.explanation}"
    if plan.predicted_latency_s:
        line += f"\n  predicted latency {plan.predicted_latency_s * 1e3:.1f} ms"
    return line


def format_rank_table(report: dict) -> str:
    lines = [f"{'rank':>4} {'compute ms':>10} {'comm ms':>9} {'sent KB':>9} {'recv KB':>9} "
             f"{'layer w MB':>10} {'read MB':>8} {'peak RSS MB':>11}"]
    for s in report["per_rank"]:
        lines.append(f"{s['rank']:>4} {s['compute_s'] * 1e3:>10.2f} {s['comm_total_s'] * 1e3:>9.2f} "
                     f"{s['bytes_sent'] / 1e3:>9.1f} {s['bytes_recv'] / 1e3:>9.1f} "
                     f"{s['layer_weight_bytes_resident'] / 1e6:>10.2f} {s['weight_bytes_read'] / 1e6:>8.2f} "
                     f"{s['peak_rss_bytes'] / 1e6:>11.1f}")
    return "\n".join(lines)
