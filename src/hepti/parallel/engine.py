"""The distributed job behind `mpiexec -n N hepti run`: plan -> load slices -> run -> report.

Rank 0 reads and tokenises the inputs, and pools and writes each batch's output as it
completes (hepti.runner). The plan's primary (rank 0 unless the plan says otherwise) embeds each
batch and collects its output: it is its group's rank 0, the root of the verbs. When the primary
is another rank, rank 0 hands it each batch and gets the output back (`Job.run_all`), and takes
part in the work only if the plan gives it a share.
Failure discipline:
- checks that every rank can make alone (plan, ratios, budget) run identically everywhere and
  raise `AgreedError`: rank 0 prints it, every rank exits 2, nobody is left in a collective;
- checks only some ranks can make (input files on the primary, weight files on each device's
  disk) go through `agree()`, which turns them into the same AgreedError on every rank;
- anything else on any rank is fatal: the CLI prints the rank and the cause and calls
  MPI_Abort, which ends every rank at once (see hepti.cli).
Ranks with no share take part in nothing costly: they wait for the end in a sleeping poll.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
import signal
import threading
import traceback

import numpy as np

from hepti.counts import counts, offsets
from hepti.errors import HeptiError, PlanError
from hepti.plan.planfile import DIMS, Plan, parse_bytes, parse_ratios
from hepti.resources import current_rss, peak_rss, reset_peak_rss
from hepti.graph import lower
from hepti.families import family_graph
from hepti.graph.lower import prologue_steps, stage_steps
from hepti.families import family, load_kernels
from hepti.model.sizes import layer_slice_bytes
from hepti.parallel import watchdog
from hepti.parallel.comm import Comm, wait_idle
from hepti.parallel.interpreter import Interpreter
from hepti.parallel.layers import ResidentLayers, StreamingLayers, slice_packer
from hepti.parallel.pipeline import PipelineExecutor, layer_ranges
from hepti.parallel.profiling import cached_profile
from hepti.parallel.slices import outside_layers
from hepti.parallel.trace import Tracer, chrome_trace
from hepti.parallel.watchdog import transformer_scale
from hepti.plan.profile import load_profile, profile_from_dict
from hepti.runner import base_report, finish, run_passes
from hepti.weights import WeightStore

log = logging.getLogger("hepti")
FAULT_ENV = "HEPTI_FAULT_RANK"  # test-only: this rank raises in its first forward
ABORT_GRACE_S = 0.3  # a failing rank's message gets this long to reach mpiexec before the abort


class AgreedError(HeptiError):
    """An error every rank raised together; the primary reports it."""


def agree(world, fn):
    """Run fn on every rank; if a HeptiError was raised on any, raise AgreedError on all."""
    err, result = None, None
    try:
        result = fn()
    except HeptiError as e:
        err = str(e)
    errs = world.mpi.allgather(err) if not world.solo else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        msgs = {e for _, e in bad}
        if len(msgs) == 1 and len(bad) == len(errs):
            raise AgreedError(bad[0][1])
        raise AgreedError("; ".join(f"rank {r}: {e}" for r, e in bad))
    return result


def resolve_plan(args, world_size: int, cfg) -> Plan:
    """The plan from --plan, or from --strategy and --ratios (even shares by default)."""
    if getattr(args, "plan", None):
        plan = Plan.load(args.plan).validate(world_size)
        if plan.strategy == "bands":
            raise PlanError(f"--plan {args.plan} is a CNN's (bands); make one for this model "
                            "with `hepti plan --model MODEL_DIR --profile P.json`")
        if getattr(args, "mem_budget", None):
            plan.mem_budget = parse_bytes(args.mem_budget)
    else:
        strategy = args.strategy or ("single" if world_size == 1 else "tensor")
        if strategy == "even" and args.ratios:
            raise PlanError("--strategy even always uses equal shares; drop --ratios, or use "
                            "--strategy tensor with your ratios")
        if strategy == "single" and args.ratios:
            raise PlanError("--strategy single runs on rank 0 alone; drop --ratios")
        if strategy == "single":
            vec = [1.0] + [0.0] * (world_size - 1)
            ratios = {d: list(vec) for d in DIMS}
        elif args.ratios and strategy != "even":
            ratios = parse_ratios(args.ratios, world_size)
        else:
            ratios = {d: [1.0 / world_size] * world_size for d in DIMS}
        plan = Plan(strategy=strategy, world_size=world_size, ratios=ratios,
                    mem_budget=parse_bytes(getattr(args, "mem_budget", None)))
        if strategy == "pipeline":
            plan.layers = [list(r) for r in layer_ranges(cfg.num_hidden_layers, ratios["rows"])]
        plan.validate(world_size)
    if plan.strategy == "stream" and not plan.mem_budget:
        raise PlanError("--strategy stream needs --mem-budget BYTES (per rank), e.g. --mem-budget 64MiB")
    if plan.strategy != "stream" and plan.mem_budget and not getattr(args, "plan", None):
        raise PlanError("--mem-budget applies to --strategy stream only")
    return plan


def _counts_of(plan: Plan, cfg) -> dict:
    return {"heads": counts(cfg.num_attention_heads, plan.ratios["heads"]),
            "ffn": counts(cfg.intermediate_size, plan.ratios["ffn"])}


def active_ranks(plan: Plan, cfg) -> list[int]:
    """Ranks that do any work, in group order: the primary first (it always takes part: it
    embeds the inputs and collects the outputs), then the others in rank order."""
    n, p = plan.world_size, plan.primary
    if plan.strategy == "single":
        return [0]
    if plan.strategy == "pipeline":
        works = [plan.layers[r][1] > plan.layers[r][0] for r in range(n)]
    elif plan.strategy == "rows":
        works = [plan.ratios["rows"][r] > 0 for r in range(n)]
    else:
        c = _counts_of(plan, cfg)
        works = [bool(c["heads"][r] or c["ffn"][r] or plan.ratios["rows"][r] > 0) for r in range(n)]
    return [p] + [r for r in range(n) if works[r] and r != p]


def stream_window(plan: Plan, cfg, rank: int) -> int:
    """Layers of its slices a rank may hold under --mem-budget (checked before any work)."""
    c = _counts_of(plan, cfg)
    per_layer = layer_slice_bytes(cfg, c["heads"][rank], c["ffn"][rank])
    window = plan.mem_budget // max(per_layer, 1)
    if window < 1:
        raise PlanError(
            f"--mem-budget {plan.mem_budget} bytes is below one layer's slice on rank {rank} "
            f"({per_layer} bytes for {c['heads'][rank]} heads and {c['ffn'][rank]} FFN columns); "
            f"raise it to at least {per_layer} or give rank {rank} a smaller share")
    return int(min(window, cfg.num_hidden_layers))


def sub_ratios(plan: Plan, active: list[int]) -> dict:
    return {d: [plan.ratios[d][r] for r in active] for d in DIMS}


def gentle_barrier(mpi_comm, interval: float = 0.0005, spin_s: float = 0.002):
    """A barrier that polls for `spin_s`, then sleeps `interval` between tests.

    MPICH's blocking barrier spins and burns a core, which an idle rank (zero share, or waiting
    for the next request) must not do. But sleeping from the start released ranks up to one
    `interval` apart, and the timed loop's barrier then put that lag into every measured
    latency (0.45 ms of a 19 ms MiniLM forward). Polling first keeps short waits exact."""
    wait_idle(mpi_comm.Ibarrier(), spin_s, interval)


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
    c = _counts_of(plan, cfg)
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


def plan_assignment(plan: Plan, graph) -> dict[str, str]:
    """A mixed plan's assignment, checked against the model's graph (every operator named,
    each split one it supports, and a layout the collectives can reach from the one before:
    hepti.graph.lower.check_assignment), as a PlanError saying what is wrong."""
    try:
        return lower.check_assignment(graph, plan.assignment or {})
    except ValueError as e:
        raise PlanError(f"the plan's assignment does not fit this model: {e}; make the plan "
                        "again with `hepti plan --search genetic`") from None


def build_layers(store, spec: tuple, pack):
    """The layer weights a `layer_spec` names, read from this device's own files (no MPI: a
    background thread may build them while another plan serves)."""
    kind, heads, ffn, extra = spec
    L = store.config.num_hidden_layers
    if kind == "stream":
        return StreamingLayers(store, L, heads, ffn, pack, extra)
    if kind == "layers":  # per layer (heads, ffn): `heads` holds them
        return ResidentLayers(store, L, None, None, pack, ranges=heads)
    layers = None if extra == (0, L) else range(*extra)
    return ResidentLayers(store, L, heads, ffn, pack, layers=layers)


class Job:
    """One rank's part of a distributed run: its group, its slices, its executor.

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
            c = _counts_of(plan, cfg)
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
        the weights stay open for a next job that holds the same (`layer_spec`)."""
        if self.layers is not None and not keep_layers:
            self.layers.close()
        if self.group is not None:
            self.group.close()

    def rank_stats(self, runs: list[dict]) -> dict:
        """This rank's figures: medians over the timed runs, plus memory and disk reads."""
        med = lambda key: statistics.median(r[key] for r in runs) if runs else 0.0  # noqa: E731
        kinds = sorted({k for r in runs for k in r["seconds"] if k not in ("compute", "io", "batch")})
        comm_s = {k: statistics.median(r["seconds"].get(k, 0.0) for r in runs) for k in kinds}
        layer_bytes = self.layers.peak_bytes if self.layers is not None else 0
        emb = sum(getattr(f, "nbytes", 0) for f in self.primary_ops.values())
        return {
            "rank": self.world.rank,
            "host": os.uname().nodename,
            "active": self.is_active,
            "wall_s": med("wall"),
            "compute_s": statistics.median(r["seconds"].get("compute", 0.0) for r in runs) if runs else 0.0,
            "comm_s": comm_s,
            "comm_total_s": sum(comm_s.values()),
            "io_wait_s": statistics.median(r["seconds"].get("io", 0.0) for r in runs) if runs else 0.0,
            "bytes_sent": int(med("bytes_sent")),
            "bytes_recv": int(med("bytes_recv")),
            "layer_weight_bytes_resident": int(layer_bytes),
            "weight_bytes_resident": int(layer_bytes + emb),
            "weight_bytes_read": int(self.store.bytes_read),
            "peak_rss_bytes": peak_rss(),
            "rss_before_load_bytes": self.rss_before_load,
        }


def world_comm(trace: bool = False):
    """The world as a Comm (MPI.COMM_WORLD with a Tracer)."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    return Comm(MPI.COMM_WORLD, Tracer(MPI.COMM_WORLD.Get_rank(), record_events=trace))


def run_plan(model_dir, plan: Plan, batches, threads: int = 1, world=None):
    """Library entry: run `batches` (needed on the primary only) under `plan` on every rank of
    the world. Returns (hidden states per batch on the primary / [] elsewhere, the Job)."""
    world = world or world_comm()
    store = agree(world, lambda: WeightStore(model_dir))
    plan = agree(world, lambda: plan.validate(world.size))
    if plan.strategy == "stream":
        agree(world, lambda: [stream_window(plan, store.config, r) for r in active_ranks(plan, store.config)])
    n = world.bcast_obj(len(batches) if world.rank == 0 else None)
    job = agree(world, lambda: Job(world, store, plan, threads))
    outs = []
    try:
        job.run_all(batches, n, lambda i, h: outs.append(h))
        return outs, job
    finally:
        job.close()
        gentle_barrier(world.mpi)


PLANNED = ("auto", "proportional")


def get_profile(args, world, cfg, batch: int, seq_len: int):
    """--profile's (checked against the model), else a cached or newly measured one; on every
    rank, as a cached one is. (Until 2026-11-29 a --profile was on rank 0 alone, and
    `plan_with_profile`, given None on the other ranks, made them read it again, alone: `hepti
    serve --replan on` given a profile by its supervisor hung at start.)"""
    if args.profile:
        def load_checked():
            if world.rank != 0:
                return None
            prof = load_profile(args.profile, world_size=world.size)
            for note in prof.check_model(cfg, source=f"--profile {args.profile}"):
                log.warning(note)
            return prof.to_dict()
        d = world.bcast_obj(agree(world, load_checked))
        return profile_from_dict(d, f"--profile {args.profile}")
    profile, measured, path = cached_profile(
        world.mpi, cfg, seq_len, batch=batch, threads=args.threads,
        mem_cap=parse_bytes(args.mem_cap, "--mem-cap") if args.mem_cap else None)
    if world.rank == 0:
        log.info("%s the devices' profile %s (kept a day; delete it, or run `hepti profile`, to "
                 "measure again)", "measured" if measured else "using", path)
    return profile


def needs_planner(args) -> bool:
    return getattr(args, "strategy", None) in PLANNED or bool(getattr(args, "profile", None))


def plan_with_profile(args, world, cfg, batch: int, seq_len: int, profile=None) -> Plan:
    """The planner's plan for this input shape: from --profile, else a fresh cached or newly
    measured profile (or `profile`, from `get_profile`). Rank 0 plans; every rank gets the same
    plan."""
    from hepti.plan.partition import make_plan  # local: start-up time (scipy.optimize, 0.4 s)
    if profile is None:
        profile = get_profile(args, world, cfg, batch, seq_len)

    def plan_on_primary():
        if world.rank != 0:
            return None
        return make_plan(cfg, profile, seq_len, batch, strategy=args.strategy or "auto",
                         ratios=args.ratios, mem_budget=parse_bytes(args.mem_budget))

    plan = agree(world, plan_on_primary)
    plan = Plan.from_dict(json.loads(world.bcast_obj(plan.to_json() if world.rank == 0 else None)))
    return agree(world, lambda: plan.validate(world.size))


def run_prepared(args, world, store, prep, t_start: float) -> int:
    """hepti.parallel.distributed.run_distributed once the inputs are checked and the output
    open (`prep`, primary only)."""
    mpi, rank, size, cfg = world.mpi, world.rank, world.size, store.config
    rank0 = rank == 0
    source = prep.source if rank0 else None
    start = prep.out.start if rank0 and prep.out is not None else 0
    if rank0:  # the plan is made for the first batch's shape
        first = min(start, source.n_batches - 1)
        a, b = source.rows(first)
        shape = (b - a, source.lengths[first])
    n, shape = world.bcast_obj((source.n_batches - start, shape) if rank0 else None)
    if needs_planner(args):
        plan = plan_with_profile(args, world, cfg, batch=shape[0], seq_len=shape[1])
    else:
        plan = agree(world, lambda: resolve_plan(args, size, cfg))
    if args.plan:
        notes = agree(world, lambda: plan.check_model(cfg, source=f"--plan {args.plan}"))
        if rank0:
            for note in notes:
                log.warning(note)
    if plan.strategy == "stream":
        agree(world, lambda: [stream_window(plan, cfg, r) for r in active_ranks(plan, cfg)])
    t0 = time.perf_counter()
    job = agree(world, lambda: Job(world, store, plan, args.threads))
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

    if rank0:  # the largest batch this run computes, against the plan's shape
        scale = transformer_scale(plan.batch, plan.seq_len, min(args.batch_size, source.n),
                                  max(source.lengths[start:], default=shape[1]))
    watch = start_watch(world, args, plan, scale if rank0 else 1.0)
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

    M = shape[0] * shape[1]
    used = {"heads": counts(cfg.num_attention_heads, plan.ratios["heads"]),
            "ffn": counts(cfg.intermediate_size, plan.ratios["ffn"]),
            "rows": counts(M, plan.ratios["rows"])}
    if plan.strategy == "pipeline":
        used = {"layers": plan.layers}
    report = base_report(args, cfg, prep, load_s, runs, plan.strategy, size, t_start)
    report.update({
        "active_ranks": sorted(job.active),
        "primary": plan.primary,
        "ratios": plan.ratios,
        "counts": used,
        "throughput_inputs_per_s": (prep.source.n / report["latency_s"]["median"]
                                    if runs and report["latency_s"]["median"] > 0 else None),
        "per_rank": stats,
        "stall_timeout_s": watch.timeout if watch is not None else None,
    })
    if plan.mem_budget:
        report["mem_budget"] = plan.mem_budget
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


def _on_interrupt(name: str, rank: int):
    """Ctrl-C: mpiexec passes it to every rank. One line from the primary, no traceback, exit
    130 without MPI_Finalize (which would wait for a peer inside a collective that never
    completes; the process manager ends such a peer). Python raises KeyboardInterrupt only
    between bytecodes, and a rank blocked in an MPI wait for a peer that has already left
    would never get there: so a watcher thread, woken through the signal wakeup fd (mpi4py
    releases the GIL in blocking calls), does the same at once. Returns the function both
    call; whichever is first ends the process."""
    once = threading.Lock()

    def interrupted():
        with once:
            if rank == 0:
                sys.stderr.write(f"hepti {name}: interrupted\n")
                sys.stderr.flush()
            time.sleep(ABORT_GRACE_S)  # for mpiexec to forward the line (see below)
            os._exit(130)

    if threading.current_thread() is threading.main_thread():
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def watch():
            while True:
                got = os.read(r, 64)
                if signal.SIGINT in got:
                    interrupted()

        threading.Thread(target=watch, name="hepti-interrupt", daemon=True).start()
    return interrupted


def run_guarded_fn(name: str, fn, args) -> int:
    """Run fn(args) on every rank: agreed errors are reported once by rank 0 (exit 2); any
    other failure on any rank names the rank and aborts the whole job."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    rank = MPI.COMM_WORLD.Get_rank()
    interrupted = _on_interrupt(name, rank)
    try:
        return fn(args)
    except AgreedError as e:
        if rank == 0:
            print(f"hepti {name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        interrupted()  # the partial output was closed on the way here (a `finally`)
    except BaseException as e:  # noqa: BLE001 - any other failure ends the whole job
        if isinstance(e, HeptiError):
            text = f"hepti {name}: rank {rank}: error: {e}\n"
        else:
            text = (traceback.format_exc() + f"hepti {name}: rank {rank} failed: "
                    f"{type(e).__name__}: {e}; aborting all ranks\n")
        # One write, then a moment for mpiexec to forward it: MPI_Abort tears down the
        # process managers' pipes at once, and a fresh-clone test run once caught only the
        # traceback's first line, without the rank and the cause.
        sys.stderr.write(text)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)
        return 1
