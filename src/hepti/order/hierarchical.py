"""Hierarchical order search for blocks too large to search whole (NASNet's cells).

BTSearch (hepti.order.search) proves its order by walking the downsets of a block; a NASNet-A
large has about a thousand operators and no cut (each cell reads the two cells before it), so
that walk never ends. HMCOS (Wang et al., "Hierarchical Memory-Constrained Operator Scheduling
of Neural Architecture Search Networks", DAC 2022) schedules such graphs on a hierarchy; this
module does the same in hepti's terms, its own way:

- **Sequences.** A chain a -> b (a's only successor is b, b's only predecessor a) is run
  unbroken when running b at once does not raise the footprint: b's step stays within the
  steps the sequence has taken so far and b frees at least what it writes (HMCOS's join rule).
- **Groups (cells).** An operator with three or more predecessors (a cell's concatenation in
  NASNet and PNASNet; HMCOS takes Concat) closes a cell: its group is every operator not yet
  grouped that it post-dominates (each of whose paths to the graph's end runs through it). The
  group runs together, its operators in the least-peak order for the context it runs in (a
  BTSearch of the group, with the tensors it reads from outside held when an outside operator
  still reads them; kept per group and context, as HMCOS keeps group schedules per the values
  the group frees).
- **The top level** is searched exactly over these units (groups and sequences), depth first
  with BTSearch's bound, hashing and dominance, from the incumbent (never worse than it).
- **Ungrouping.** As in HMCOS's iterative scheduling, the groups at the order's peak (the group
  running at the peak step, the groups whose tensors are live there, and the groups that read
  them) are dissolved into their sequences and the top level is searched again, while the
  peak falls or groups remain at it, until `time_limit`.

The answer is the least peak under the restrictions still in force (groups that stayed
groups, sequences unbroken), not a proof: `proven` comes from the peak meeting the lower
bound (hepti.order.btsearch.lower_bounds), or from a last search that ended with no group left and
no chain joined (then it was BTSearch over single operators, exact); `why` says what was fixed
when neither holds.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass

from hepti.order.btsearch import (StepUpdates, ancestry, btsearch, lower_bounds, restrict,
                                  set_bits, topological)
from hepti.order.memory import Problem

GROUP_MIN_PREDS = 3  # an operator with this many predecessors closes a cell
GROUP_SEARCH_SECONDS = 2.0  # one group's inner search, per context
GROUP_SEARCH_STATES = 200_000


@dataclass
class HierResult:
    order: list[int]
    peak: int
    start_peak: int
    lower_bound: int
    proven: bool
    states: int
    seconds: float
    sequences: int  # units after joining chains
    groups: int  # cells found
    groups_left: int  # still grouped in the last search
    rounds: int  # top-level searches (one per ungrouping)
    complete: bool  # the last top-level search ended without its budget running out
    why: str


def sequences(pb: Problem) -> list[list[int]]:
    """Chains joined by HMCOS's rule (module docstring), in topological order of their heads."""
    fast = StepUpdates(pb)
    seq_of = [-1] * pb.n
    seqs: list[list[int]] = []
    state: list[tuple[int, int]] = []  # per sequence: (highest step, latest), relative
    for o in topological(pb):
        preds = list(set_bits(pb.preds[o]))
        if len(preds) == 1 and len(pb.succs[preds[0]]) == 1:
            s = seq_of[preds[0]]
            top, latest = state[s]
            inc = fast.out[o]
            dec = sum(pb.size[j] for j in pb.ins[o]
                      if not pb.held[j] and pb.consumers[j] == 1 << o)
            if latest + inc <= top and inc <= dec:
                seqs[s].append(o)
                seq_of[o] = s
                state[s] = (top, latest + fast.keep[o] - dec)
                continue
        seq_of[o] = len(seqs)
        seqs.append([o])
        state.append((fast.out[o], fast.keep[o]))
    return seqs


def post_dominators(pb: Problem) -> list[int]:
    """Each operator's immediate post-dominator (-1: the graph's end). An operator whose
    outputs are held or read by no one reaches the end directly."""
    order = topological(pb)
    ipdom = [-2] * pb.n
    depth = {-1: 0}

    def lca(a: int, b: int) -> int:
        while a != b:
            if depth[a] < depth[b]:
                a, b = b, a
            a = ipdom[a]
        return a

    for o in reversed(order):
        ends = not pb.succs[o] or any(pb.held[j] or not pb.consumers[j] for j in pb.outs[o])
        cur = -1 if ends else None
        for s in pb.succs[o]:
            cur = s if cur is None else lca(cur, s)
        ipdom[o] = cur
        depth[o] = depth[cur] + 1
    return ipdom


def groups(pb: Problem) -> list[list[int]]:
    """Cells: for each operator with GROUP_MIN_PREDS or more predecessors, in topological
    order, the operators not yet grouped that it post-dominates (itself included), less those
    with a path out of the group and back in (a group must run as one unit)."""
    ipdom = post_dominators(pb)
    anc, desc = ancestry(pb)
    kids: dict[int, list[int]] = {}
    for o, p in enumerate(ipdom):
        kids.setdefault(p, []).append(o)
    taken = [False] * pb.n
    out = []
    for o in topological(pb):
        if taken[o] or bin(pb.preds[o]).count("1") < GROUP_MIN_PREDS:
            continue
        members, stack = [], [o]
        while stack:
            v = stack.pop()
            if taken[v]:
                continue
            taken[v] = True
            members.append(v)
            stack += kids.get(v, [])
        # a group runs as one unit, so it must be convex: a member from which a path leaves
        # the group and comes back (NASNet's stem, post-dominated only by the third cell's
        # concatenation, feeds the two cells before it) is left out, until none is
        mask = 0
        for v in members:
            mask |= 1 << v
        while True:
            outside = anc[o] & ~mask
            drop = [v for v in members if desc[v] & outside]
            if not drop:
                break
            for v in drop:
                taken[v] = False
                mask &= ~(1 << v)
            members = [v for v in members if mask >> v & 1]
        if len(members) > 1:
            out.append(sorted(members))
        else:
            taken[o] = False
    return out


class _Units:
    """The top level: units (a group or a sequence), their predecessors as a mask over units,
    and how each runs from a set of executed operators."""

    def __init__(self, pb: Problem, grouped: list[list[int]], seqs: list[list[int]],
                 deadline: float, memo: dict):
        self.pb = pb
        in_group = {o for g in grouped for o in g}
        self.units = [("group", g) for g in grouped]
        self.units += [("seq", s) for s in seqs if not in_group & set(s)]
        # a sequence crossing a group's edge is split back into single operators
        for s in seqs:
            if in_group & set(s) and not set(s) <= in_group:
                self.units += [("seq", [o]) for o in s if o not in in_group]
        unit_of = {}
        for u, (_, ops) in enumerate(self.units):
            for o in ops:
                unit_of[o] = u
        self.masks = []
        self.preds = []
        for _, ops in self.units:
            m = 0
            for o in ops:
                m |= 1 << o
            self.masks.append(m)
        for u, (_, ops) in enumerate(self.units):
            pm = 0
            for o in ops:
                for q in set_bits(pb.preds[o] & ~self.masks[u]):
                    pm |= 1 << unit_of[q]
            self.preds.append(pm)
        self.succs = [[v for v in range(len(self.units)) if self.preds[v] >> u & 1]
                      for u in range(len(self.units))]
        # outside operators whose running changes a group's context: the other readers of
        # the tensors the group reads from outside
        self.context = []
        for kind, ops in self.units:
            m = 0
            if kind == "group":
                inside = self.masks[len(self.context)]
                for o in ops:
                    for j in pb.ins[o]:
                        p = pb.producer[j]
                        if p < 0 or not inside >> p & 1:
                            m |= pb.consumers[j] & ~inside
            self.context.append(m)
        self.memo = memo  # (group's first op, context bits) -> inner order
        self.deadline = deadline
        self.inner_states = 0

    def inner(self, u: int, done: int) -> list[int]:
        kind, ops = self.units[u]
        if kind == "seq" or len(ops) == 1:
            return ops
        key = (ops[0], len(ops), done & self.context[u])
        if key not in self.memo:
            sub = restrict(self.pb, ops, done)
            left = max(0.05, min(GROUP_SEARCH_SECONDS, self.deadline - time.perf_counter()))
            res = btsearch(sub, time_limit=left, max_states=GROUP_SEARCH_STATES)
            self.inner_states += res.states
            self.memo[key] = [ops[k] for k in res.order]
        return self.memo[key]


class _OutOfTime(Exception):
    pass


def _search_units(pb: Problem, fast: StepUpdates, U: _Units, best: list, lb: list[int],
                  deadline: float, floor: int = 0) -> tuple[int, bool]:
    """Depth first over the units from the empty set; `best` = [peak, order] is improved in
    place. Returns (states, complete)."""
    by_lb = sorted(range(pb.n), key=lambda o: -lb[o])
    seen: dict[int, int] = {}
    prefix: list[int] = []
    states = 0
    full = pb.full

    def remaining(done: int) -> int:
        for o in by_lb:
            if not done >> o & 1:
                return lb[o]
        return 0

    def run(u: int, done: int, resident: int, peak: int):
        ops = U.inner(u, done)
        top = 0
        for o in ops:
            step, resident = fast.expand(o, done, resident)
            if step > top:
                top = step
            done |= 1 << o
        return ops, done, resident, max(peak, top), top

    def dfs(done: int, udone: int, resident: int, peak: int, ready: list[int]) -> None:
        nonlocal states
        states += 1
        if not states & 63 and time.perf_counter() > deadline:
            raise _OutOfTime
        if done == full:
            if peak < best[0]:
                best[0], best[1] = peak, list(prefix)
                if peak <= floor:
                    raise _OutOfTime  # good enough: see hierarchical's `floor`
            return
        was = seen.get(done)
        if was is not None and was <= peak:
            return
        seen[done] = peak
        if max(peak, remaining(done)) >= best[0]:
            return
        children = []
        for u in ready:
            ops, nd, after, p, top = run(u, done, resident, peak)
            if p >= best[0]:
                continue
            if top <= peak and after <= resident:
                children = [(p, after, u, ops, nd)]
                break
            children.append((p, after, u, ops, nd))
        children.sort(key=lambda c: c[:3])
        for p, after, u, ops, nd in children:
            nu = udone | 1 << u
            nready = [r for r in ready if r != u]
            nready += [s for s in U.succs[u] if not U.preds[s] & ~nu]
            prefix.extend(ops)
            dfs(nd, nu, after, p, nready)
            del prefix[len(prefix) - len(ops):]
            if peak >= best[0]:
                return

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, len(U.units) + 500))
    try:
        dfs(0, 0, fast.start, 0, [u for u in range(len(U.units)) if not U.preds[u]])
        return states, True
    except _OutOfTime:
        return states, False
    finally:
        sys.setrecursionlimit(limit)


def hierarchical(pb: Problem, incumbent: list[int], time_limit: float = 60.0,
                 floor: int = 0) -> HierResult:
    """The least-peak order under HMCOS's hierarchy, ungrouped around the peak round by round
    (module docstring), starting from `incumbent` and never worse than it; it stops at the
    first order whose peak is at or under `floor` (btsearch's `floor`)."""
    t0 = time.perf_counter()
    deadline = t0 + time_limit
    fast = StepUpdates(pb)
    anc, desc = ancestry(pb)
    lb = lower_bounds(pb, anc, desc)
    lb_global = max(lb, default=pb.offset)
    start_peak = pb.peak(incumbent)
    best = [start_peak, list(incumbent)]
    seqs = sequences(pb)
    cells = groups(pb)
    grouped = list(cells)
    memo: dict = {}
    states, rounds, complete, searched_grouped = 0, 0, False, len(cells)
    while time.perf_counter() < deadline and best[0] > max(lb_global, floor):
        U = _Units(pb, grouped, seqs, deadline, memo)
        searched_grouped = len(grouped)  # groups in force in the search that just ran
        s, complete = _search_units(pb, fast, U, best, lb, deadline, floor)
        states += s + U.inner_states
        rounds += 1
        if not complete or not grouped:
            break
        # dissolve the groups at the peak: the one running there, those whose tensors are
        # live there, and those reading them
        steps = pb.profile(best[1])
        at = {best[1][k] for k, st in enumerate(steps) if st == best[0]}
        done, hot = 0, set(at)
        pos = {o: k for k, o in enumerate(best[1])}
        for o in at:
            done = 0
            for q in best[1][:pos[o]]:
                done |= 1 << q
            for j, size in enumerate(pb.size):
                p = pb.producer[j]
                if p >= 0 and done >> p & 1 and (pb.held[j] or pb.consumers[j] & ~done):
                    hot.add(p)
                    hot.update(set_bits(pb.consumers[j]))
        keep = [g for g in grouped if not hot & set(g)]
        if len(keep) == len(grouped):
            break
        grouped = keep
    peak, order = best
    pb.check_order(order)
    # with every cell dissolved and no chain joined, the last search ran over single
    # operators with BTSearch's own bound, hashing and dominance: when it ended, it is exact
    exact = (rounds > 0 and complete and not searched_grouped
             and all(len(q) == 1 for q in seqs))
    proven = peak <= lb_global or exact
    if proven:
        why = ""
    else:
        restr = (f"{len(grouped)} of {len(cells)} cells still run as groups, "
                 if grouped else f"all {len(cells)} cells dissolved, ")
        why = (f"{pb.n} operators and no cut; searched in the way of HMCOS: {restr}"
               f"{len(seqs)} chains run unbroken; "
               + ("the least order under those restrictions was found" if complete else
                  f"stopped at the floor {floor:,} B (a peak the graph already has)"
                  if peak <= floor else f"the search ran out of its {time_limit:g} s")
               + f"; {100 * (peak / lb_global - 1):.1f}% above this block's lower bound")
    return HierResult(order, peak, start_peak, lb_global, proven, states,
                      time.perf_counter() - t0, len(seqs), len(cells), searched_grouped, rounds,
                      complete, why)
