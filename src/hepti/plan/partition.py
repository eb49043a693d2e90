"""The planner: strategy by memory status, ratio vectors by LP, baselines, and the explanation.

`make_plan(config, profile, seq_len, ...)` is what `hepti plan` and `hepti run --strategy auto`
call. With strategy "auto":

- every device can hold the whole model -> `rows` or `tensor`, whichever the cost model
  predicts faster (`stream` is tensor plus reading from disk, and nothing caps tensor's shares
  here, so it cannot win);
- only the devices' combined memory holds it -> the faster of `tensor` with memory-capped
  shares and `stream` (and `rows` on the ranks that can hold the whole model, if rank 0 is one:
  it always takes part). Capping the fast devices' shares can force work onto slow devices and
  slow links, and then streaming, which pays for reading and packing every slice on every
  forward, can still be the faster of the two.
  Stream is solved only where a lower bound says it could beat the best so far (its sets'
  bounds are tensor's);
- not even that -> `stream` (a window of 2 layers if it fits, else 1);
- nothing fits -> PlanError saying how much memory is missing.
The explanation names the predicted latencies compared ("stream: predicted X ms vs tensor with
capped shares Y ms").

Shares come from hepti.plan.search: an LP per candidate set of participating ranks (whole heads
rounded by a min-max rule), judged by the exact cost model (hepti.plan.costmodel.evaluate). A
rank whose share would only add communication gets nothing and drops out; up to 5 devices every
set is considered, so adding a device never makes the plan slower (see search.py for larger
clusters). The plan explains itself in a sentence or two: the memory status, who dropped out and
why (memory, link or compute), whose share memory capped. Baselines for benchmarks: `even` (Megatron-LM),
`proportional` (shares by GeMM speed alone; planned as `tensor`), `pipeline` (PipeEdge's
dynamic program), `single` (rank 0 alone). With `ratios` the plan is evaluated, not optimised.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
import re

from hepti.config import ModelConfig
from hepti.counts import counts as split_counts
from hepti.counts import offsets
from hepti.errors import PlanError
from hepti.families import family_graph
from hepti.model.sizes import model_bytes
from hepti.plan.costmodel import ACTIVE, ROOT, Prediction, Program, envelope, evaluate
from hepti.plan.pipeline import evaluate_pipeline, pipeline_ranges
from hepti.plan import strategies
from hepti.plan.planfile import DIMS, Plan, parse_ratios
from hepti.plan.profile import Profile
from hepti.plan.search import Candidate, fits_memory, min_footprint, optimise, stream_budget
from hepti.plan.workloads import program_for

PLANNERS = strategies.names(strategies.INTERPRETER, choosable=True)
DEFAULT_DISK_READ_BPS = 100e6  # assumed when a stream plan meets a device without disk_read_Bps


# --- memory --------------------------------------------------------------------------------

def memory_caps(profile: Profile, mem_budget: float | None = None) -> list[float]:
    """Bytes each rank may use for the model: its usable memory, capped by the user's budget."""
    caps = [dev.usable_bytes for dev in profile.devices]
    if mem_budget is not None:
        caps = [min(c, float(mem_budget)) for c in caps]
    return caps


# --- evaluation of given shares -------------------------------------------------------------

def counts_from_ratios(program: Program, ratios: dict[str, list[float]]) -> dict[str, list[float]]:
    return {d: [float(c) for c in split_counts(t, ratios[d])] for d, t in program.totals.items()}


def evaluate_ratios(program: Program, profile: Profile, ratios: dict[str, list[float]],
                    strategy: str | None = None) -> Candidate:
    cnt = counts_from_ratios(program, ratios)
    if program.stream is not None:
        program.stream.budget = stream_budget(program, cnt)
    pred = evaluate(program, cnt, profile)
    c = Candidate(strategy or program.name, cnt, pred, program, pred.latency_s)
    if program.stream is not None:
        c.mem_budget = int(program.stream.budget)
    return c


def _pipeline_candidate(cfg, B, T, profile, caps, ranges=None) -> Candidate | None:
    if ranges is None:
        ranges = pipeline_ranges(cfg, B, T, profile, caps)
        if ranges is None:
            return None
    ev = evaluate_pipeline(cfg, B, T, profile, ranges)
    L = cfg.num_hidden_layers
    share = [(b - a) / L for a, b in ranges]
    pred = Prediction(ev["latency_s"], ev["per_rank"], [], {})
    c = Candidate("pipeline", {d: share for d in DIMS}, pred, None, ev["latency_s"],
                  layers=[list(r) for r in ranges], extra={"bottleneck_s": ev["bottleneck_s"]})
    return c


# --- explanations --------------------------------------------------------------------------

def _mb(b: float) -> str:
    return f"{b / 1e6:,.0f} MB" if b >= 1e6 else f"{b / 1e3:,.0f} kB"


def _link(dev) -> str:
    mbit = dev.bandwidth_Bps * 8 / 1e6
    bw = f"{mbit / 1000:.1f} Gbit/s" if mbit >= 1000 else f"{mbit:.0f} Mbit/s"
    return f"{bw} link" + (f" ({dev.latency_s * 1e3:.1f} ms latency)" if dev.latency_s >= 1e-3 else "")


def _sentences(parts: list[str]) -> str:
    """Join clauses into sentences, each capitalised and ended with a full stop."""
    return " ".join(p[0].upper() + p[1:] + ("" if p.endswith(".") else ".") for p in parts if p)


def _who(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:6])) + (f" and {len(ranks) - 6} more" if len(ranks) > 6 else "")
    return f"rank {shown} gets" if len(ranks) == 1 else f"ranks {shown} get"


def _compute_and_comm(pred: Prediction) -> tuple[float, float, int]:
    """A prediction's compute (slowest rank per phase) and communication, summed over the
    inference, and how many collectives with a cost it runs."""
    compute = sum(ph["times"] * ph["compute_s"] for ph in pred.phases)
    comm = sum(ph["times"] * ph["comm_s"] for ph in pred.phases)
    return compute, comm, sum(ph["times"] for ph in pred.phases if ph["comm_s"] > 0)


def _join_effect(cand: Candidate, profile: Profile, ranks: list[int],
                 speeds_of: int | None = None) -> tuple[float, float, int]:
    """By the cost model: what shares for `ranks` beside the active ranks (all shares by GeMM
    speed) would change: (compute saved, communication added, collectives then run).
    speeds_of: give `ranks` that rank's compute figures instead of their own (a what-if)."""
    devices = list(profile.devices)
    if speeds_of is not None:
        f = devices[speeds_of]
        for i in ranks:
            devices[i] = dataclasses.replace(
                devices[i], gemm=f.gemm, attention=f.attention, elementwise_per_s=f.elementwise_per_s,
                call_overhead_s=f.call_overhead_s, weight_load_Bps=f.weight_load_Bps)
    what_if = dataclasses.replace(profile, devices=devices)
    members = [r.rank for r in cand.prediction.per_rank if r.active] + list(ranks)
    speed = sum(devices[i].gemm.peak for i in members)
    vec = [devices[i].gemm.peak / speed if i in members else 0.0 for i in range(len(devices))]
    program = copy.deepcopy(cand.program)  # evaluate_ratios sets a stream program's budget
    joined = evaluate_ratios(program, what_if, {d: vec for d in program.totals}).prediction
    (c0, m0, _), (c1, m1, n) = _compute_and_comm(cand.prediction), _compute_and_comm(joined)
    return c0 - c1, m1 - m0, n


def _pays(effect: tuple[float, float, int]) -> bool:
    saved, added, _ = effect
    return saved > added


def _us(s: float) -> str:
    return f"{s * 1e6:.0f} us" if s < 1e-3 else _ms(s)


def _dropout_reasons(cand: Candidate, profile: Profile, caps: list[float]) -> list[str]:
    """Why ranks got nothing, grouped: memory too small, link too slow, the work too small to
    be worth splitting, or compute too slow.

    A rank with nothing against its memory or link is "too slow" only if a share would pay
    were it as fast as the fastest active rank; if even then the compute it saves is below the
    communication it adds, the work is too small (MiniLM at a few tokens on equal ranks), and
    the cost model's figures for that are quoted."""
    if cand.prediction is None or cand.program is None:
        return []
    members = [profile.devices[r.rank] for r in cand.prediction.per_rank if r.active]
    slowest_bw = min(d.bandwidth_Bps for d in members)
    worst_lat = max(d.latency_s for d in members)
    memory, link, compute = [], [], []
    for i, dev in enumerate(profile.devices):
        if i == 0 or cand.prediction.per_rank[i].active:
            continue
        if min_footprint(cand.program, i) > caps[i]:
            memory.append(i)
        elif dev.bandwidth_Bps < slowest_bw or dev.latency_s > worst_lat:
            link.append(i)
        else:
            compute.append(i)
    out = []
    if memory:
        need = min(min_footprint(cand.program, i) for i in memory)
        mem = f"its {_mb(caps[memory[0]])} of memory" if len(memory) == 1 else "their memory"
        out.append(f"{_who(memory)} no share: {mem} cannot hold even the smallest part ({_mb(need)})")
    if link:
        if len(link) == 1:
            why = f"its {_link(profile.devices[link[0]])} would cost more than its compute saves"
        else:
            why = "their links would cost more than their compute saves"
        out.append(f"{_who(link)} no share: {why}")
    fastest = max(members, key=lambda d: d.gemm.peak).rank
    small = [i for i in compute if profile.devices[i].gemm.peak >= profile.devices[fastest].gemm.peak
             or not _pays(_join_effect(cand, profile, [i], speeds_of=fastest))]
    if small:
        saved, added, n = effect = _join_effect(cand, profile, small)
        total = _compute_and_comm(cand.prediction)[0]
        them = f"a share for rank {small[0]}" if len(small) == 1 else "shares for them"
        figures = (f"{_us(total)} of compute; {them} would save {_us(saved)} of it but add "
                   f"{_us(added)} over {n} collectives, about {_us(added / n)} each"
                   if not _pays(effect) and n else
                   f"{_us(total)} of compute; one more rank adds more to the collectives than "
                   "its share saves")  # the LP's integer steps can differ from shares by speed
        out.append(f"{_who(small)} no share: the work is too small to be worth splitting "
                   f"({figures}); longer inputs or larger batches split better")
    slow = [i for i in compute if i not in small]
    if slow:
        out.append(f"{_who(slow)} no share: too slow to save more compute than one more rank "
                   f"adds to every collective (GeMM {_gflops(slow, profile)} against "
                   f"{profile.devices[fastest].gemm.peak / 1e9:.0f} on rank {fastest})")
    return out


def _gflops(ranks: list[int], profile: Profile) -> str:
    g = [profile.devices[i].gemm.peak / 1e9 for i in ranks]
    return f"{g[0]:.0f} GFLOP/s" if len(g) == 1 else f"{min(g):.0f}-{max(g):.0f} GFLOP/s"


def _capped(cand: Candidate, caps: list[float]) -> list[str]:
    if cand.prediction is None:
        return []
    return [f"rank {r.rank}'s share is capped by its memory ({_mb(caps[r.rank])})"
            for r in cand.prediction.per_rank
            if r.active and r.rank and r.mem_bytes >= 0.985 * caps[r.rank] and cand.strategy != "rows"]


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 10 else f"{s:.1f} s"


# --- strategies ----------------------------------------------------------------------------

def _normalise_ratios(ratios, world_size: int) -> dict[str, list[float]] | None:
    if ratios is None:
        return None
    if isinstance(ratios, str):
        return parse_ratios(ratios, world_size)
    if isinstance(ratios, dict):
        text = ";".join(f"{d}={','.join(str(v) for v in vec)}" for d, vec in ratios.items())
        return parse_ratios(text, world_size)
    return parse_ratios(",".join(str(v) for v in ratios), world_size)


def _stream_candidate(cfg, B, T, profile, caps, ratios=None, cutoff: float = math.inf,
                      memo: dict | None = None) -> tuple[Candidate | None, bool]:
    """The best stream plan (window 2, else 1) and whether a default disk speed was assumed.
    With a `cutoff` latency, None also when no plan could beat it (`memo`: see optimise)."""
    assumed = any(dev.disk_read_Bps is None for dev in profile.devices)
    prof = profile
    if assumed:
        prof = copy.deepcopy(profile)
        for dev in prof.devices:
            dev.disk_read_Bps = dev.disk_read_Bps or DEFAULT_DISK_READ_BPS
    for window in (2, 1):
        program = program_for("stream", cfg, B, T, window)
        if ratios is not None:
            c = evaluate_ratios(program, prof, ratios, "stream")
        else:
            c = optimise(program, prof, caps, cutoff=cutoff, memo=memo)
        # given ratios that fit no window are still evaluated (the plan says what is missing)
        if c is not None and (not fits_memory(c.prediction, caps) or (ratios is not None and window == 1)):
            c.extra["window"] = window
            return c, assumed
    return None, assumed


def _missing_memory_error(cfg: ModelConfig, B: int, T: int, profile: Profile, caps: list[float]):
    program = program_for("stream", cfg, B, T, 1)
    fixed, need_units = [], 0.0
    memory = envelope(program.memory)
    for i in range(profile.world_size):
        f = 0.0
        for t in memory:
            if t.dim == ACTIVE:
                f += t.per_unit
            elif t.dim == ROOT and i == 0:
                f += t.per_unit
        fixed.append(f)
    for t in memory:
        if t.dim in program.totals:
            need_units += t.per_unit * program.totals[t.dim]
    if caps[0] < fixed[0] + 1:
        raise PlanError(
            f"nothing fits: rank 0 (which embeds the tokens and collects the outputs) needs at least "
            f"{_mb(fixed[0])} for the embeddings and activations at {B}x{T} tokens but has "
            f"{_mb(caps[0])}; give rank 0 {_mb(fixed[0] - caps[0])} more, or use shorter inputs")
    avail = sum(max(0.0, c - f) for c, f in zip(caps, fixed))
    missing = need_units - avail
    raise PlanError(
        f"nothing fits, not even streaming one layer at a time: the devices have {_mb(sum(caps))} "
        f"for hepti, and one layer's slices plus activations at {B}x{T} tokens need about "
        f"{_mb(missing)} more than is left after each rank's fixed part; add a device or memory, "
        f"or use shorter inputs")


def _rank0_alone(cand: Candidate) -> bool:
    """Whether a rows, tensor or pipeline candidate gives every part of the work to rank 0."""
    if cand.strategy not in ("rows", "tensor", "pipeline") or cand.mem_budget is not None:
        return False
    if cand.layers is not None:
        return all(b <= a for a, b in cand.layers[1:])
    return all(not any(v[1:]) for v in cand.counts.values())


def _as_single(cand: Candidate, cfg: ModelConfig, B: int, T: int, profile: Profile) -> Candidate:
    """A plan that leaves every rank but the primary idle runs as `single`: the same forward
    with no group, no scatter or gather, the peers not even waiting in a collective (`rows` on
    rank 0 alone ran MiniLM in 58.4 ms against `single`'s 54.0 on emu-pair-940-quarter). It
    is predicted as `single` is. A plan whose only worker is another rank stays as it is:
    the primary still sends it the inputs and takes the outputs back, which is not `single`."""
    one = [1.0] + [0.0] * (profile.world_size - 1)
    return evaluate_ratios(program_for("tensor", cfg, B, T), profile, {d: one for d in DIMS}, "single")


def _finish(cand: Candidate, cfg: ModelConfig, B: int, T: int, profile: Profile, caps,
            explanation: str, solve_s: float | None, extra_pred: dict | None = None) -> Plan:
    N = profile.world_size
    if N > 1 and _rank0_alone(cand):
        explanation += (f" {cand.strategy} gives all the work to rank 0, so it runs as single "
                        "(rank 0 alone).")
        cand = _as_single(cand, cfg, B, T, profile)
    strategy = cand.strategy
    if cand.layers is None:
        totals = family_graph(cfg, B, T).units
        cnt = {d: [int(round(v)) for v in cand.counts.get(d, [0] * N)] for d in DIMS}
        for d in DIMS:  # dimensions the strategy does not split run whole on the active ranks
            if d not in cand.counts:
                cnt[d] = split_counts(totals[d], cand.counts["rows"])
        ratios = {d: [c / totals[d] for c in cnt[d]] for d in DIMS}
        for d in DIMS:
            assert split_counts(totals[d], ratios[d]) == cnt[d], (d, cnt[d], ratios[d])
    else:
        ratios = {d: list(cand.counts[d]) for d in DIMS}
        cnt = {"layers": [b - a for a, b in cand.layers]}
    pred = cand.prediction
    over = fits_memory(pred, caps)
    per_rank = [dict(r.to_dict(), host=profile.devices[r.rank].host) for r in pred.per_rank]
    predicted = {"per_rank": per_rank, "phases": pred.phases, "fits_memory": not over,
                 "mem_caps": list(caps)}
    predicted.update(cand.extra)
    predicted.update(extra_pred or {})
    if over:
        explanation += " " + "; ".join(
            f"rank {i} would need {_mb(pred.per_rank[i].mem_bytes)} but has {_mb(caps[i])}"
            for i in over) + "."
    return Plan(strategy=strategy, world_size=N, ratios=ratios, layers=cand.layers,
                mem_budget=cand.mem_budget, counts=cnt, model=cfg.name, model_shape=cfg.shape,
                seq_len=T, batch=B,
                predicted_latency_s=cand.latency_s, predicted=predicted, solve_s=solve_s,
                explanation=explanation.strip())


def make_plan(config: ModelConfig, profile: Profile, seq_len: int, batch: int = 1,
              strategy: str = "auto", ratios=None, mem_budget: float | None = None) -> Plan:
    """A plan for `batch` inputs of `seq_len` tokens on the profiled devices.

    strategy: one of PLANNERS. ratios (evaluate instead of optimise): a vector for every
    dimension, a dict per dimension, or the `--ratios` text. mem_budget caps every rank's memory
    for hepti (bytes), on top of the profile.

    The primary (embeddings, the output's collection) is rank 0, unless the plan gives rank 0
    no share of the work: then the same strategy is also planned with the rank that has the
    largest share as the primary (`_moved_primary`), and kept if faster.
    """
    t0 = time.perf_counter()
    plan = _make_plan(config, profile, seq_len, batch, strategy, ratios, mem_budget)
    if ratios is None and strategy in ("rows", "tensor", "stream", "auto"):
        plan = _moved_primary(plan, config, profile, seq_len, batch, strategy, mem_budget)
        plan.solve_s = time.perf_counter() - t0
    return plan


def _moved_primary(plan: Plan, cfg: ModelConfig, profile: Profile, T: int, B: int,
                   strategy: str, mem_budget: float | None) -> Plan:
    """`plan`, or the same strategy planned with another rank as the primary, if that is
    predicted faster. Tried where rank 0 makes a poor primary: it has no share of `plan`'s work
    (yet would embed, scatter and gather, and under `rows` hold the whole model), or its link is
    less than half as fast as every other's (every batch's scatter and gather cross it).

    Rank 0 keeps reading the inputs and writing the outputs (hepti.parallel.engine), so a
    primary p > 0 costs handing it each batch and taking the output back: added to the
    prediction as two messages each way over the slower of the two links. The planner itself
    always puts the primary first: it plans on the profile with the devices reordered so that
    p is first, and reorders the result back."""
    N = profile.world_size
    cnt = plan.counts or {}
    if N < 2 or plan.strategy == "single" or not cnt:
        return plan
    idle = not any(cnt[d][0] for d in cnt)
    slow_link = profile.devices[0].bandwidth_Bps * 2 < min(d.bandwidth_Bps for d in profile.devices[1:])
    if not (idle or slow_link):
        return plan
    share = [sum(cnt[d][r] / max(1, sum(cnt[d])) for d in cnt) for r in range(N)]
    p = max(range(1, N), key=lambda r: share[r])
    order = [p] + [r for r in range(N) if r != p]
    moved = dataclasses.replace(profile, devices=[dataclasses.replace(profile.devices[r], rank=i)
                                                  for i, r in enumerate(order)])
    try:
        other = _make_plan(cfg, moved, T, B, strategy, None, mem_budget)
    except PlanError:
        return plan
    a, b = profile.devices[0], profile.devices[p]
    g = family_graph(cfg, B, T)
    nbytes = B * T * (sum(t.row_bytes() for t in g.tensors.values() if t.kind == "input")
                      + g.tensors[g.output].row_bytes())
    relay = 2 * (a.latency_s + b.latency_s) + nbytes / min(a.bandwidth_Bps, b.bandwidth_Bps)
    if other.predicted_latency_s is None or plan.predicted_latency_s is None or (
            other.predicted_latency_s + relay >= plan.predicted_latency_s):
        return plan
    back = [order.index(r) for r in range(N)]  # world rank -> its place in `order`
    other.explanation = _renumbered(other.explanation, order)
    other.predicted["mem_caps"] = [other.predicted["mem_caps"][i] for i in back]
    other.ratios = {d: [v[i] for i in back] for d, v in other.ratios.items()}
    other.counts = {d: [v[i] for i in back] for d, v in other.counts.items()}
    per_rank = other.predicted.get("per_rank", [])
    if per_rank:
        other.predicted["per_rank"] = [dict(per_rank[i], rank=r, host=profile.devices[r].host)
                                       for r, i in enumerate(back)]
    other.predicted["relay_s"] = relay
    other.predicted_latency_s += relay
    other.primary = p
    why = "has no share of the work" if idle else "has the slowest link by far"
    other.explanation += (f" Rank {p} is the primary (it embeds the inputs and collects the "
                          f"outputs): rank 0 {why}, and handing rank {p} each batch "
                          f"({_ms(relay)}) costs less than keeping rank 0 in every collective "
                          f"({_ms(plan.predicted_latency_s)} with rank 0 as the primary).")
    return other


def _renumbered(text: str, order: list[int]) -> str:
    """`text` with the rank numbers of the reordered devices ("rank 2", "ranks 1, 3 and 4")
    turned back into world ranks."""
    def ranks(m):
        return m.group(1) + re.sub(r"\d+", lambda n: str(order[int(n.group())]), m.group(2))
    return re.sub(r"\b([Rr]anks? )(\d+(?:(?:, | and |-)\d+(?!\d| more))*)", ranks, text)


def _make_plan(config: ModelConfig, profile: Profile, seq_len: int, batch: int = 1,
               strategy: str = "auto", ratios=None, mem_budget: float | None = None) -> Plan:
    if strategy not in PLANNERS:
        raise PlanError(f"unknown strategy {strategy!r}; choose one of {', '.join(PLANNERS)}")
    if seq_len < 1 or batch < 1:
        raise PlanError(f"seq_len {seq_len} and batch {batch} must be at least 1")
    if seq_len > config.max_tokens:
        raise PlanError(f"seq_len {seq_len} exceeds the model's {config.max_tokens} positions")
    t0 = time.perf_counter()
    N, B, T = profile.world_size, batch, seq_len
    caps = memory_caps(profile, mem_budget)
    given = _normalise_ratios(ratios, N)
    if given is not None and strategy in ("even", "single", "proportional"):
        raise PlanError(f"--strategy {strategy} sets its own shares; drop --ratios, or use "
                        "--strategy tensor (or rows, stream, pipeline) with your ratios")
    if strategy == "pipeline":
        if given is not None:
            per = split_counts(config.num_hidden_layers, given["rows"])
            ranges = [(o, o + n) for o, n in zip(offsets(per), per)]  # as the executor splits
            cand = _pipeline_candidate(config, B, T, profile, caps, ranges)
            why = "Pipeline (PipeEdge) with the given layer shares."
        else:
            cand = _pipeline_candidate(config, B, T, profile, caps)
            if cand is None:
                raise PlanError("no pipeline fits: some layer range must fit each stage's memory; "
                                "use --strategy stream or add memory")
            used = [i for i, (a, b) in enumerate(cand.layers) if b > a]
            why = (f"Pipeline baseline (PipeEdge's dynamic program): layer ranges on ranks "
                   f"{', '.join(map(str, used))} minimise the slowest stage "
                   f"({_ms(cand.extra['bottleneck_s'])} per batch, transfers included).")
        return _finish(cand, config, B, T, profile, caps, why, time.perf_counter() - t0)

    if strategy in ("even", "proportional", "single"):
        program = program_for("tensor", config, B, T)
        if strategy == "even":
            vec = [1.0 / N] * N
            why = "Even baseline (Megatron-LM): equal shares of heads, FFN columns and rows."
        elif strategy == "single":
            vec = [1.0] + [0.0] * (N - 1)
            why = "Single-device baseline: rank 0 runs the whole model alone."
        else:
            speed = [dev.gemm.peak for dev in profile.devices]
            vec = [s / sum(speed) for s in speed]
            why = ("Proportional baseline (MoDNN's rule): tensor shares by GeMM speed alone, "
                   "the network ignored.")
        cand = evaluate_ratios(program, profile, {d: vec for d in DIMS},
                               "single" if strategy == "single" else ("even" if strategy == "even" else "tensor"))
        return _finish(cand, config, B, T, profile, caps, why, time.perf_counter() - t0,
                       {"planner": strategy})

    # rows / tensor / stream / auto
    if strategy in ("rows", "tensor"):
        program = program_for(strategy, config, B, T)
        if given is not None:
            cand = evaluate_ratios(program, profile, given, strategy)
            why = f"{strategy} with the given ratios (evaluated, not optimised)."
        else:
            cand = optimise(program, profile, caps)
            if cand is None:
                raise PlanError(_infeasible_message(strategy, config, B, T, profile, caps))
            why = _sentences([f"{strategy} with shares chosen by the LP"]
                             + _dropout_reasons(cand, profile, caps) + _capped(cand, caps))
        return _finish(cand, config, B, T, profile, caps, why, time.perf_counter() - t0)

    if strategy == "stream":
        cand, assumed = _stream_candidate(config, B, T, profile, caps, given)
        if cand is None:
            _missing_memory_error(config, B, T, profile, caps)
        why = (f"stream: each rank holds a window of {cand.extra['window']} layer(s) of its slices "
               f"(--mem-budget {_mb(cand.mem_budget)}) and reads the next from disk while computing.")
        if assumed:
            why += f" Disk speed not in the profile: assumed {DEFAULT_DISK_READ_BPS / 1e6:.0f} MB/s."
        return _finish(cand, config, B, T, profile, caps, why, time.perf_counter() - t0)

    # auto: strategy by memory status
    return _auto(config, B, T, profile, caps, given, t0)


def _auto(cfg: ModelConfig, B: int, T: int, profile: Profile, caps: list[float], given, t0: float) -> Plan:
    """`auto`: every device holds the whole model -> rows or tensor by predicted latency; else
    the combined memory holds it sliced -> the fastest of tensor with memory-capped shares,
    stream, and rows on the ranks that hold the whole model (if rank 0 does); else stream."""
    mb = model_bytes(cfg)
    rows_program = program_for("rows", cfg, B, T)
    tensor_program = program_for("tensor", cfg, B, T)
    holds_all = [cap >= min_footprint(rows_program, i) for i, cap in enumerate(caps)]
    options: dict[str, Candidate] = {}
    memo: dict = {}  # shared cost tables, candidate sets and bounds (see optimise)
    for s, program in (("rows", rows_program), ("tensor", tensor_program)):
        if given is not None:
            c = evaluate_ratios(program, profile, given, s)
            if not fits_memory(c.prediction, caps):
                options[s] = c
        elif s == "tensor" or holds_all[0]:
            c = optimise(program, profile, caps, memo=memo)
            if c is not None:
                options[s] = c
    lat = {s: c.latency_s for s, c in options.items()}
    note = "" if given is None else " Shares as given (evaluated, not optimised)."

    if options and all(holds_all):
        # stream is tensor plus reading from disk, and nothing caps tensor's shares: it cannot win
        best = min(options.values(), key=lambda c: c.latency_s)
        why = (f"Every device can hold the whole model ({_mb(mb)}), so rows and tensor were both "
               f"considered; {_versus(best.strategy, lat)}.")
        return _finish(best, cfg, B, T, profile, caps, _explain(why, best, profile, caps, given) + note,
                       time.perf_counter() - t0, {"candidates_s": lat})

    # not every device holds the model: tensor's shares may be capped by memory, and streaming
    # the slices from disk can then be faster; it is solved only where it could beat the best
    # so far (its sets' lower bounds are tensor's: it is tensor plus reading)
    cutoff = min(lat.values(), default=math.inf) if given is None else math.inf
    stream, assumed = _stream_candidate(cfg, B, T, profile, caps, given, cutoff, memo)
    if stream is not None:
        lat["stream"] = stream.latency_s
        options["stream"] = stream
    if not options:
        _missing_memory_error(cfg, B, T, profile, caps)
    best = min(options.values(), key=lambda c: (c.latency_s, c.strategy == "stream"))
    disk = (f" Disk speed not in the profile: assumed {DEFAULT_DISK_READ_BPS / 1e6:.0f} MB/s."
            if best.strategy == "stream" and assumed else "")
    names = dict(lat)
    if "tensor" in names and (_memory_bound(options["tensor"], caps) or not all(
            min_footprint(tensor_program, i) <= caps[i] for i in range(profile.world_size))):
        names["tensor with capped shares"] = names.pop("tensor")
    versus = _versus(_label(best.strategy, names), names)
    if "stream" not in lat and "tensor" in options and given is None:
        versus += "; stream cannot be faster (a lower bound on its latency is not below that)"
    if best.strategy == "stream":
        versus = (f"streaming is faster ({versus}): each rank holds a window of "
                  f"{best.extra['window']} layer(s) of its slices and reads the next from disk "
                  f"while computing")
    if "tensor" not in options and "rows" not in options:
        why = (f"Not even the devices' combined memory ({_mb(sum(caps))}) holds the model ({_mb(mb)}) "
               f"at these shapes, so each rank streams its slices from disk, holding a window of "
               f"{best.extra['window']} layer(s).")
    elif "rows" in options:
        can = [i for i, h in enumerate(holds_all) if h]
        who = (f"rank {can[0]}" if len(can) == 1 else f"ranks {', '.join(map(str, can))}" if len(can) <= 6
               else f"{len(can)} of the {len(caps)} devices")
        why = f"Only {who} can hold the whole model ({_mb(mb)}); {versus}."
    elif best.strategy == "stream":
        why = (f"The model ({_mb(mb)}) fits only in the devices' combined memory, where memory caps "
               f"tensor's shares; {versus}.")
    else:
        why = (f"The model ({_mb(mb)}) fits only in the devices' combined memory, so the weights are "
               f"sliced (tensor) with memory-capped shares; {versus}.")
    return _finish(best, cfg, B, T, profile, caps, _explain(why, best, profile, caps, given) + note + disk,
                   time.perf_counter() - t0, {"candidates_s": lat})


def _memory_bound(cand: Candidate, caps: list[float]) -> bool:
    """Whether some rank's share stops at its memory cap."""
    return any(r.active and r.mem_bytes >= 0.985 * caps[r.rank] for r in cand.prediction.per_rank)


def _label(strategy: str, names: dict[str, float]) -> str:
    return "tensor with capped shares" if strategy == "tensor" and strategy not in names else strategy


def _versus(winner: str, lat: dict[str, float]) -> str:
    """'stream: predicted 757.0 ms vs tensor with capped shares 1.6 s'."""
    others = " vs ".join(f"{s} {_ms(v)}" for s, v in lat.items() if s != winner)
    return f"{winner}: predicted {_ms(lat[winner])}" + (f" vs {others}" if others else "")


def _explain(why: str, best: Candidate, profile: Profile, caps, given) -> str:
    if given is not None:
        return why
    capped = _capped(best, caps) if best.strategy != "stream" else []
    return _sentences([why] + _dropout_reasons(best, profile, caps) + capped)


def _infeasible_message(strategy, cfg, B, T, profile, caps) -> str:
    program = program_for(strategy, cfg, B, T)
    need0 = min_footprint(program, 0)
    if strategy == "rows":
        return (f"rows needs rank 0 (always taking part) to hold the whole model and its activations "
                f"({_mb(need0)}) but it has {_mb(caps[0])}; use --strategy tensor or stream")
    total = sum(t.per_unit * (cfg.num_hidden_layers if t.per_layer else 1)
                * (program.totals[t.dim] if t.dim in program.totals else 1)
                for t in envelope(program.memory) if t.dim != ROOT) + sum(
        t.per_unit for t in envelope(program.memory) if t.dim == ROOT)
    return (f"tensor does not fit: the model's slices and activations need about {_mb(total)} "
            f"across the ranks, which have {_mb(sum(caps))}; use --strategy stream")
