"""`hepti run` of a CNN under mpiexec: the plan (a "bands" plan file, --ratios, or the CoEdge
planner on a profile), a `BandJob` on every rank, the runner's passes, the report.

The transformer families' counterpart is hepti.parallel.engine's `run_prepared` and `Job`;
what the two share (the passes, checking inputs first, writing as it goes, the report's common
fields, the failure discipline) is hepti.runner's and engine's, used here as there.
"""
from __future__ import annotations

import json
import logging
import os
import statistics
import sys
import time

from hepti.errors import PlanError
from hepti.plan.coedge import CNN_STRATEGIES, make_cnn_plan, split_of
from hepti.graph.cnn import build
from hepti.graph.opdag import from_cnn
from hepti.graph.split import conv_rows, spatial_ops, streamed_convs
from hepti.model.cnn import Weights
from hepti.families import load_kernels
from hepti.parallel.bands import BandExecutor, head_rows
from hepti.parallel.engine import (agree, attach_prediction, current_rss, format_plan_line,
                                   format_rank_table, gentle_barrier, parse_bytes, peak_rss,
                                   reset_peak_rss, start_watch)
from hepti.parallel.profiling import measure_cnn_profile
from hepti.parallel.trace import chrome_trace
from hepti.parallel.watchdog import cnn_scale
from hepti.order.search import executor_order
from hepti.plan.planfile import Plan, parse_ratios
from hepti.plan.profile import load_profile, profile_from_dict
from hepti.runner import base_report, finish, run_passes

log = logging.getLogger("hepti")


class BandJob:
    """One rank's part of a CNN run: its weights (every conv of a group it has rows of, its
    channels of a conv split by channels, its columns of the head) and the band executor. `run_all(batches, n, on_output)` as hepti.parallel.engine.Job's: rank 0
    reads the batches and gets on_output(i, logits [B, 1, classes]).

    The executor runs on a sub-communicator of the ranks that work (a share of some group's
    rows or of the head) and rank 0, which holds the pixels and the logits; the others load
    nothing and skip every batch, as an encoder's idle ranks do. On the whole world, an idle
    device on a slow link sat in each forward's broadcast and in the pooling's allreduce
    (MobileNetV2 on emu-mixed4, two of four ranks active: 2.6 ms of allreduce on rank 0 for
    [1, 1280] floats, over the 240 and 100 Mbit/s links of ranks it does not need)."""

    def __init__(self, world, store, plan, threads: int = 1):
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
        # BTSearch's order within each group (for hepti's CNNs its peak is the file order's)
        side = store.config.image_size
        order = executor_order(from_cnn(graph, 1, side, side)).order
        self.executor = BandExecutor(self.group, graph, sub, self.weights, threads, order)

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
        med = lambda key: statistics.median(r[key] for r in runs) if runs else 0.0  # noqa: E731
        kinds = sorted({k for r in runs for k in r["seconds"] if k not in ("compute", "batch")})
        comm_s = {k: statistics.median(r["seconds"].get(k, 0.0) for r in runs) for k in kinds}
        return {"rank": self.world.rank, "host": os.uname().nodename,
                "active": self.world.rank in self.active, "wall_s": med("wall"),
                "compute_s": statistics.median(r["seconds"].get("compute", 0.0) for r in runs)
                if runs else 0.0,
                "comm_s": comm_s, "comm_total_s": sum(comm_s.values()),
                "bytes_sent": int(med("bytes_sent")), "bytes_recv": int(med("bytes_recv")),
                "layer_weight_bytes_resident": int(self.weights.nbytes if self.weights else 0),
                "weight_bytes_resident": int(self.weights.nbytes if self.weights else 0),
                "streamed_weight_bytes_max": int(self.weights.streamed_bytes
                                                 if self.weights else 0),
                "weight_bytes_read": int(self.store.bytes_read),
                "peak_rss_bytes": peak_rss(), "rss_before_load_bytes": self.rss_before_load}

    def close(self) -> None:
        """Collective over the members (the group's communicator is freed)."""
        if self.group is not None:
            self.group.close()


def resolve_cnn_plan(args, world, store, size_hw: tuple[int, int], batch: int):
    """The plan every rank runs: --plan, else --ratios, else --strategy (even by default;
    auto and proportional plan on --profile or on a profile measured now, at this input)."""
    cfg, P = store.config, world.size
    strategy = getattr(args, "strategy", None)
    if args.plan:
        plan = agree(world, lambda: Plan.load(args.plan).validate(P))
        if plan.strategy != "bands":
            raise PlanError(f"--plan {args.plan} is a {plan.strategy} plan; a CNN runs a bands "
                            "plan: make one with `hepti plan --model MODEL_DIR --profile P.json`")
        return plan
    if strategy is not None and strategy not in CNN_STRATEGIES:
        raise PlanError(f"--strategy {strategy}: a CNN is split by height (CoEdge's bands); "
                        f"choose {', '.join(CNN_STRATEGIES)}")
    if args.ratios and strategy not in (None, "auto"):
        raise PlanError(f"--ratios gives the shares itself; drop --strategy {strategy}")
    fuse_depth = getattr(args, "fuse_depth", None)
    if not args.profile and (args.ratios or strategy in (None, "even", "single", "grid")):
        # no profile needed (with one, every strategy is planned below, with its prediction)
        def given():
            if args.ratios:
                vec = parse_ratios(args.ratios, P)["rows"]
            elif strategy == "single":
                vec = [1.0] + [0.0] * (P - 1)
            else:
                vec = [1.0 / P] * P
            groups = [[0, spatial_ops(build(cfg))]] if strategy == "grid" else None
            return Plan(strategy="bands", world_size=P, ratios={"rows": vec}, groups=groups,
                        head="primary" if strategy == "single" else "cols",
                        explanation=f"{'--ratios' if args.ratios else strategy or 'even'} shares "
                                    "of every map's rows" + (", every layer fused (DeepThings)"
                                                             if groups else "")).validate(P)
        return agree(world, given)
    profile = _cnn_profile(args, world, store, size_hw, batch)

    def on_primary():
        if world.rank != 0:
            return None
        ratios = parse_ratios(args.ratios, P)["rows"] if args.ratios else None
        return make_cnn_plan(cfg, profile, strategy or ("auto" if not ratios else "even"),
                             ratios=ratios, size=size_hw, batch=batch, fuse_depth=fuse_depth)
    plan = agree(world, on_primary)
    return Plan.from_dict(json.loads(world.bcast_obj(plan.to_json() if world.rank == 0 else None)))


def _cnn_profile(args, world, store, size_hw, batch):
    """--profile's (rank 0), else one measured now on every rank (rank 0 gets it)."""
    if args.profile:
        return agree(world, lambda: load_profile(args.profile, world_size=world.size)
                     if world.rank == 0 else None)
    cap = parse_bytes(args.mem_cap, "--mem-cap") if getattr(args, "mem_cap", None) else None
    # band_min_s=0: a run that profiles first starts within seconds; `hepti profile` takes
    # the longer, steadier band timings that a plan kept for later deserves
    prof = agree(world, lambda: measure_cnn_profile(world, store, *size_hw, batch=batch,
                                                    threads=args.threads, mem_cap=cap,
                                                    band_min_s=0.0))
    if world.rank == 0 and not args.json:
        print("profiled the devices at this input", file=sys.stderr)
    return profile_from_dict(prof, "measured profile") if world.rank == 0 else None


def run_cnn(args, world, store, prep, t_start: float) -> int:
    """`hepti run` of a CNN on every rank, once the inputs are checked (`prep`, rank 0)."""
    mpi, rank0 = world.mpi, world.rank == 0
    source = prep.source if rank0 else None
    start = prep.out.start if rank0 and prep.out is not None else 0
    if rank0:
        first = min(start, source.n_batches - 1)
        px = source.batch(first).pixels
        head = (source.n_batches - start, px.shape[0], tuple(px.shape[2:]))
    n, batch, size_hw = world.bcast_obj(head if rank0 else None)
    plan = resolve_cnn_plan(args, world, store, size_hw, batch)
    t0 = time.perf_counter()
    job = agree(world, lambda: BandJob(world, store, plan, args.threads))
    load_s = time.perf_counter() - t0
    world.tracer.record_events = bool(args.trace)
    per_pass = []

    def start_pass():
        gentle_barrier(mpi)
        world.tracer.reset()
        world.tracer.set_epoch()

    def end_pass(run):
        per_pass.append({"wall": run["wall_s"], "seconds": dict(world.tracer.seconds),
                         "bytes_sent": world.tracer.bytes_sent,
                         "bytes_recv": world.tracer.bytes_recv})

    watch = start_watch(world, args, plan,
                        cnn_scale(plan.batch, (plan.predicted or {}).get("input"), batch, size_hw))
    try:
        runs = run_passes(job, prep, n, args, start_pass=start_pass, end_pass=end_pass,
                          watch=watch)
        gentle_barrier(mpi)
        stats = mpi.gather(job.rank_stats(per_pass), root=0)
        all_events = mpi.gather(world.tracer.events, root=0) if args.trace else None
        job.close()
    finally:
        if watch is not None:
            watch.close()
    if not rank0:
        return 0
    report = base_report(args, store.config, prep, load_s, runs, "bands", world.size, t_start)
    report.update({"active_ranks": job.active, "ratios": plan.ratios, "groups": plan.groups,
                   "head": plan.head, "input_hw": list(size_hw), "per_rank": stats,
                   "counts": plan.counts or {},
                   "stall_timeout_s": watch.timeout if watch is not None else None})
    attach_prediction(report, stats, plan)
    report.setdefault("explanation", plan.explanation)
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump(chrome_trace(all_events, {"strategy": "bands", "world_size": world.size}), f)
        report["trace"] = args.trace
    finish(args, report, runs)
    if not args.json:
        print(format_plan_line(report, plan))
        print(format_rank_table(report))
    return 0
