"""BTSearch: the operator order with the smallest peak memory (MemoriaNova, Zhang et al. 2024).

Under hepti.order.memory's model, the memory of a step depends only on the set S of operators
already run and the operator run next, so an order is a path from the empty set to all
operators through the DAG's downsets, and its peak is the largest step on the path. BTSearch
walks these paths depth first over the ready operators, children tried least step first:

- **incumbent**: before searching, the best of cheap orders: the file's, a reverse post-order
  (depth first from the inputs) and a least-peak-first greedy (the ready operator whose step
  is smallest, then whose resident after is smallest). The search only looks for strictly
  better orders, so its answer is never worse than the file order;
- **bound**: a partial order whose peak already reaches the best found is cut, and so is one
  whose peak, or any remaining operator's static lower bound, reaches it. An operator's lower
  bound is its inputs + outputs (less what in place could save) + every tensor written by an
  ancestor and read by a descendant (live while it runs, in any order);
- **hashing**: the smallest peak each set S was reached with is kept; reaching S again at no
  lower peak is cut, as everything after S is the same;
- **dominance**: when a ready operator frees at least what it allocates and its step stays
  under the peak so far, running it at once is as good as any other choice, so the search does
  not branch there. (Moving it earlier only shortens its inputs' lives and delays nothing.)

**Decomposition.** An operator every other operator is an ancestor or a descendant of runs at
the same place in every order: a *cut*. Between two cuts lies a block whose orders are
independent of the rest: a tensor from before a block is live from its start, one read after
it is held to its end, and one that passes a block without touching it adds the same bytes to
each of its steps. So each block is searched apart, under its own budget (seconds and
states); the whole order is optimal when every block's is. A block whose search ran out of
budget keeps its best order and `proven` False, unless the peak found is already the lower
bound of the whole graph or of a block that was proven. A chain of operators is all cuts; an
Inception module is one block. A graph without cuts stays one block: NASNet's cells each read
the two cells before them, so no operator separates them. A block of HIER_MIN_OPS operators or
more that BTSearch could not prove within its budget is searched again the way HMCOS (Wang et
al., DAC 2022) does (hepti.order.hierarchical: chains run unbroken, cells run as groups in their
own least-peak order, the top level searched exactly, cells at the peak dissolved round by
round), from BTSearch's best; it keeps whichever order is better, and the block's report says
which method found it and, unless the peak meets the lower bound, why it is not proven.

`order_graph(dag)` is what `hepti order` and the planner call; `btsearch(problem)`
(hepti.order.btsearch, with the pieces both searches share) searches one Problem with any of
bound, hashing and dominance turned off (the benchmark's plot).
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import asdict, dataclass, field

from hepti.errors import PlanError
from hepti.graph.opdag import OpDag
from hepti.order.btsearch import (DEFAULT_MAX_STATES, DEFAULT_TIME_LIMIT, SearchResult, blocks,
                                  btsearch, greedy_least_peak, lower_bounds, random_order,
                                  restrict, reverse_postorder, topological)
from hepti.order.hierarchical import hierarchical
from hepti.order.memory import Problem, compile_problem

DEFAULT_HIER_TIME_LIMIT = 120.0  # seconds of hierarchical search per large block
HIER_MIN_OPS = 100  # an unproven block this large gets the hierarchical search too


# --- the whole graph -------------------------------------------------------------------------

@dataclass
class BlockReport:
    """One block: its first and last operator (file order), size, search and proof."""

    first: str
    last: str
    ops: int
    peak_bytes: int
    start_peak_bytes: int
    lower_bound_bytes: int
    states: int
    seconds: float
    proven: bool
    stopped: str = ""
    method: str = "BTSearch"  # or "hierarchical" (hepti.order.hierarchical) when that did better
    why: str = ""  # why the block is not proven, when it is not


@dataclass
class OrderResult:
    """What `hepti order` prints: the order found and its peak, against the file order and
    random orders, with the search's effort and whether the peak is proven the least."""

    graph: str
    ops: int
    batch: int
    inplace: bool
    count_io: bool
    peak_bytes: int
    order: list[str]
    file_order_peak_bytes: int
    heuristic_peak_bytes: dict[str, int]
    random: dict
    lower_bound_bytes: int
    weight_bytes: int
    states: int
    seconds: float
    proven: bool
    blocks: list[BlockReport] = field(default_factory=list)
    unproven_blocks: list[str] = field(default_factory=list)
    cap_bytes: int | None = None

    def to_dict(self) -> dict:
        d = asdict(self)
        d["random_mean_bytes"] = self.random["mean_bytes"]
        d["random_worst_bytes"] = self.random["worst_bytes"]
        return d


def random_peaks(pb: Problem, count: int = 100, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [pb.peak(random_order(pb, rng)) for _ in range(count)]


def order_graph(dag: OpDag, inplace: bool = False, count_io: bool = False,
                time_limit: float = DEFAULT_TIME_LIMIT, max_states: int = DEFAULT_MAX_STATES,
                decompose: bool = True, random_count: int = 100, seed: int = 0,
                bound: bool = True, hashing: bool = True, dominance: bool = True,
                cap: int | None = None,
                hier_time_limit: float = DEFAULT_HIER_TIME_LIMIT) -> OrderResult:
    """BTSearch on an OpDag under the memory model's options: cut into blocks (unless
    `decompose` is off), each block searched under `time_limit` seconds and `max_states`.
    `cap`: bytes the order must fit in; a PlanError says which operator cannot fit in any
    order, or that the least peak found is above it."""
    t0 = time.perf_counter()
    pb = compile_problem(dag, inplace, count_io)
    if cap is not None:
        lb = lower_bounds(pb)
        worst = max(range(pb.n), key=lambda o: lb[o])
        if lb[worst] > cap:
            raise PlanError(
                f"{dag.name}: no order fits in {cap:,} bytes: operator {pb.names[worst]!r} "
                f"needs {lb[worst]:,} bytes in every order (its inputs and outputs, and the "
                "tensors written before it and read after it)")
    file_order = topological(pb)
    heur = {"file": pb.peak(file_order), "reverse post-order": pb.peak(reverse_postorder(pb)),
            "greedy least-peak": pb.peak(greedy_least_peak(pb))}
    parts = blocks(pb) if decompose else [list(range(pb.n))]
    # The graph's peak is the largest block peak, and never under the static lower bound: a
    # block need not be searched below that bound or below a peak another block already
    # settled for (its floor). So the blocks are searched highest lower bound first (a
    # block's problem depends only on which operators run before it, not their order), and
    # each search stops at the floor. A block stopped there is proven when the floor is (the
    # graph's bound, or a proven block's peak): no order of it could lower the graph's peak.
    lb_all = lower_bounds(pb)
    lb_global = max(lb_all, default=0)
    subs, before = [], 0
    for ops in parts:
        subs.append(restrict(pb, ops, before) if decompose else pb)
        for o in ops:
            before |= 1 << o
    floor_proven = floor_any = lb_global if bound else 0
    results: list = [None] * len(parts)
    for i in sorted(range(len(parts)), key=lambda i: -max(lb_all[o] for o in parts[i])):
        ops, sub = parts[i], subs[i]
        method, why = "BTSearch", ""
        if len(ops) == 1:
            step = sub.peak([0])
            res = SearchResult([0], step, True, 0, 0.0, step, "only", step)
        else:
            res = btsearch(sub, bound=bound, hashing=hashing, dominance=dominance,
                           time_limit=time_limit, max_states=max_states,
                           floor=floor_any if decompose else 0)
            if res.stopped == "floor":
                res.proven = res.peak <= floor_proven
                why = ("" if res.proven else
                       f"stopped at the peak another block (not proven) already sets, "
                       f"{floor_any:,} B")
            elif not res.proven:
                why = (f"{len(ops)} operators without a cut; the search stopped at its "
                       f"{'time' if res.stopped == 'time' else 'state'} budget "
                       f"({time_limit:g} s, {max_states:,} states) "
                       f"{100 * (res.peak / res.lower_bound - 1):.1f}% above the lower bound")
            if (not res.proven and res.stopped != "floor" and hier_time_limit
                    and len(ops) >= HIER_MIN_OPS):
                h = hierarchical(sub, res.order, hier_time_limit,
                                 floor=floor_any if decompose else 0)
                res.states += h.states
                res.seconds += h.seconds
                if h.peak < res.peak or h.proven:
                    res.order, res.peak, res.proven = h.order, h.peak, h.proven
                    method = "hierarchical"
                if h.peak <= floor_proven:
                    res.proven = True
                why = h.why
        results[i] = (res, method, why)
        floor_any = max(floor_any, res.peak)
        if res.proven:
            floor_proven = max(floor_proven, res.peak)
    order, reports, states = [], [], 0
    for ops, sub, (res, method, why) in zip(parts, subs, results):
        order += [ops[k] for k in res.order]
        states += res.states
        if len(ops) > 1:
            reports.append(BlockReport(sub.names[0], sub.names[-1], len(ops), res.peak,
                                       res.start_peak, res.lower_bound, res.states,
                                       round(res.seconds, 4), res.proven, res.stopped,
                                       method, "" if res.proven else why))
        else:
            reports.append(BlockReport(sub.names[0], sub.names[0], 1, res.peak, res.peak,
                                       res.peak, 0, 0.0, True))
    peak = pb.peak(order)
    proven_floor = max([lb_global] + [b.peak_bytes for b in reports if b.proven])
    proven = all(b.proven for b in reports) or peak <= proven_floor
    rnd = random_peaks(pb, random_count, seed) if random_count else []
    random_doc = {"count": len(rnd), "seed": seed,
                  "mean_bytes": statistics.fmean(rnd) if rnd else None,
                  "worst_bytes": max(rnd, default=None), "best_bytes": min(rnd, default=None)}
    if cap is not None and peak > cap:
        how = ("the least peak of any order is" if proven else
               "the best order found (not proven the least) needs")
        raise PlanError(f"{dag.name}: no order found fits in {cap:,} bytes: {how} {peak:,}")
    # blocks of one operator are left out of the list (their order is forced)
    shown = [b for b in reports if b.ops > 1]
    return OrderResult(
        dag.name, pb.n, dag.batch, inplace, count_io, peak, [pb.names[o] for o in order],
        heur["file"], heur, random_doc, lb_global, dag.weight_bytes, states,
        round(time.perf_counter() - t0, 4), proven, shown,
        [f"{b.first} .. {b.last}" for b in reports if not b.proven], cap)


def executor_order(dag: OpDag, time_limit: float = 2.0) -> OrderResult:
    """The order an executor runs a graph in: BTSearch under the model of what an executor
    holds. An executor owns the copy of the input it makes (a CNN's NHWC pixels) and holds the
    output it hands back, so they count (`count_io`); no random orders are drawn. Seconds at
    most per block: the graphs hepti runs are proven in milliseconds (results/order.json)."""
    return order_graph(dag, count_io=True, time_limit=time_limit, random_count=0,
                       hier_time_limit=time_limit)


def format_result(r: OrderResult, names: int = 12) -> str:
    """`hepti order`'s text report."""
    def b(x) -> str:
        return f"{x:,.0f} B ({x / 2**20:.2f} MiB)"

    def vs(x) -> str:
        return f"{(r.peak_bytes - x) / x * 100:+.1f}%" if x else "n/a"

    largest = max((bl.ops for bl in r.blocks), default=1)
    lines = [
        f"graph    {r.graph}: {r.ops} operators, batch {r.batch}; weights "
        f"{r.weight_bytes / 2**20:.1f} MiB, not counted",
        f"model    activations; in place {'on' if r.inplace else 'off'}; graph inputs and "
        f"outputs {'counted' if r.count_io else 'not counted'}",
        f"peak     {b(r.peak_bytes)}  {'proven least' if r.proven else 'NOT proven least'}",
        f"file     {b(r.file_order_peak_bytes)}  (peak {vs(r.file_order_peak_bytes)} against it)",
    ]
    if r.random["count"]:
        lines.append(f"random   {r.random['count']} orders (seed {r.random['seed']}): mean "
                     f"{b(r.random['mean_bytes'])} ({vs(r.random['mean_bytes'])}), worst "
                     f"{b(r.random['worst_bytes'])} ({vs(r.random['worst_bytes'])})")
    lines.append(f"search   {r.states:,} states, {r.seconds:.2f} s; {len(r.blocks)} blocks to "
                 f"search (largest {largest} operators); lower bound {b(r.lower_bound_bytes)}")
    for bl in r.blocks:
        if not bl.proven:
            lines.append(f"unproven {bl.first} .. {bl.last} ({bl.method}): {bl.why}")
    shown = " ".join(r.order[:names]) + (f" ... ({r.ops} in all; --json lists them)"
                                         if r.ops > names else "")
    lines.append(f"order    {shown}")
    return "\n".join(lines)
