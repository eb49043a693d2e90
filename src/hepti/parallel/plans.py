"""Plan resolution: the plan every rank of a job runs, the same on each, for every executor
kind, and what a plan means for the ranks (which work, what a streamed rank may hold).

- the interpreter's families (`interpreter_plan`): --plan, else --strategy and --ratios (even
  shares by default; `resolve_plan`), else the LP planner on a profile (`plan_with_profile`:
  --profile's, a cached one, or one measured now: `get_profile`);
- the CNNs' height split (`bands_plan`): a "bands" --plan, --ratios, or the CoEdge planner on
  --profile or on a profile measured at this input.
Each check that any rank can fail goes through `agree` (hepti.parallel.world), so every rank
raises the same error; the planner runs on rank 0 and its plan is broadcast.
"""
from __future__ import annotations

import json
import logging
import sys

from hepti.counts import counts
from hepti.errors import PlanError
from hepti.graph import lower
from hepti.graph.cnn import build
from hepti.graph.split import spatial_ops
from hepti.model.sizes import layer_slice_bytes
from hepti.parallel.pipeline import layer_ranges
from hepti.parallel.profiling import cached_profile, measure_cnn_profile
from hepti.parallel.world import agree
from hepti.plan.coedge import CNN_STRATEGIES, make_cnn_plan
from hepti.plan.planfile import DIMS, Plan, parse_bytes, parse_ratios
from hepti.plan.profile import load_profile, profile_from_dict

log = logging.getLogger("hepti")
PLANNED = ("auto", "proportional")  # the strategies the planner chooses shares for


# --- the interpreter's families ----------------------------------------------------------

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


def counts_of(plan: Plan, cfg) -> dict:
    """Each rank's whole heads and FFN columns under `plan`."""
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
        c = counts_of(plan, cfg)
        works = [bool(c["heads"][r] or c["ffn"][r] or plan.ratios["rows"][r] > 0) for r in range(n)]
    return [p] + [r for r in range(n) if works[r] and r != p]


def sub_ratios(plan: Plan, active: list[int]) -> dict:
    """The plan's ratio vectors restricted to the ranks that work, in group order."""
    return {d: [plan.ratios[d][r] for r in active] for d in DIMS}


def stream_window(plan: Plan, cfg, rank: int) -> int:
    """Layers of its slices a rank may hold under --mem-budget (checked before any work)."""
    c = counts_of(plan, cfg)
    per_layer = layer_slice_bytes(cfg, c["heads"][rank], c["ffn"][rank])
    window = plan.mem_budget // max(per_layer, 1)
    if window < 1:
        raise PlanError(
            f"--mem-budget {plan.mem_budget} bytes is below one layer's slice on rank {rank} "
            f"({per_layer} bytes for {c['heads'][rank]} heads and {c['ffn'][rank]} FFN columns); "
            f"raise it to at least {per_layer} or give rank {rank} a smaller share")
    return int(min(window, cfg.num_hidden_layers))


def check_stream_windows(world, plan: Plan, cfg) -> None:
    """Collective: every working rank's window under a stream plan, as one agreed error."""
    if plan.strategy == "stream":
        agree(world, lambda: [stream_window(plan, cfg, r) for r in active_ranks(plan, cfg)])


def plan_assignment(plan: Plan, graph) -> dict[str, str]:
    """A mixed plan's assignment, checked against the model's graph (every operator named,
    each split one it supports, and a layout the collectives can reach from the one before:
    hepti.graph.lower.check_assignment), as a PlanError saying what is wrong."""
    try:
        return lower.check_assignment(graph, plan.assignment or {})
    except ValueError as e:
        raise PlanError(f"the plan's assignment does not fit this model: {e}; make the plan "
                        "again with `hepti plan --search genetic`") from None


def get_profile(args, world, cfg, batch: int, seq_len: int):
    """--profile's (checked against the model), else a cached or newly measured one; on every
    rank, as a cached one is. (A --profile on rank 0 alone once made `plan_with_profile`,
    given None on the other ranks, read it again there, alone: `hepti serve --replan on`
    given a profile by its supervisor hung at start.)"""
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
    """Whether the run's plan is the planner's (a planned strategy, or a --profile given)."""
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


def interpreter_plan(args, world, store, shape: tuple[int, int]) -> Plan:
    """`hepti run`'s plan for an interpreter family whose first batch is `shape` (B, T):
    the planner's, or --plan's (its notes on the model logged by rank 0), or --strategy's."""
    cfg = store.config
    if needs_planner(args):
        plan = plan_with_profile(args, world, cfg, batch=shape[0], seq_len=shape[1])
    else:
        plan = agree(world, lambda: resolve_plan(args, world.size, cfg))
    if args.plan:
        notes = agree(world, lambda: plan.check_model(cfg, source=f"--plan {args.plan}"))
        if world.rank == 0:
            for note in notes:
                log.warning(note)
    check_stream_windows(world, plan, cfg)
    return plan


# --- the CNNs' height split --------------------------------------------------------------

def bands_plan(args, world, store, shape: tuple[int, tuple[int, int]]) -> Plan:
    """`hepti run`'s plan for a CNN whose first batch is `shape` (N, (H, W)): --plan (a
    bands plan), else --ratios, else --strategy (even by default; auto and proportional plan
    on --profile or on a profile measured now, at this input)."""
    batch, size_hw = shape
    cfg, P = store.config, world.size
    strategy = getattr(args, "strategy", None)

    def checked():  # --plan's, or the flags checked; an error the same on every rank
        if args.plan:
            plan = Plan.load(args.plan).validate(P)
            if plan.strategy != "bands":
                raise PlanError(f"--plan {args.plan} is a {plan.strategy} plan; a CNN runs a "
                                "bands plan: make one with `hepti plan --model MODEL_DIR "
                                "--profile P.json`")
            return plan
        if strategy is not None and strategy not in CNN_STRATEGIES:
            raise PlanError(f"--strategy {strategy}: a CNN is split by height (CoEdge's "
                            f"bands); choose {', '.join(CNN_STRATEGIES)}")
        if args.ratios and strategy not in (None, "auto"):
            raise PlanError(f"--ratios gives the shares itself; drop --strategy {strategy}")
        return None
    plan = agree(world, checked)
    if plan is not None:
        return plan
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
