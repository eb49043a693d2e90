"""BTSearch on one block, and the pieces every order search shares (hepti.order.search's whole-graph
search and hepti.order.hierarchical's hierarchical one): cheap orders, the fast step evaluation,
ancestry and lower bounds, the search itself, and cutting a Problem into blocks. The method is in
hepti.order.search's docstring.
"""
from __future__ import annotations

import random
import sys
import time
from dataclasses import dataclass

from hepti.order.memory import Problem

DEFAULT_TIME_LIMIT = 10.0  # seconds per block
DEFAULT_MAX_STATES = 2_000_000  # states per block (each a partial order the search reached)


# --- cheap orders ----------------------------------------------------------------------------

def topological(pb: Problem, pick=min) -> list[int]:
    """A topological order, choosing among the ready operators with `pick` (min: the lowest
    index, so an OpDag's file order when it is one)."""
    done, ready, order = 0, [o for o in range(pb.n) if not pb.preds[o]], []
    while ready:
        o = pick(ready)
        ready.remove(o)
        order.append(o)
        done |= 1 << o
        ready += [s for s in pb.succs[o] if not pb.preds[s] & ~done]
    if len(order) != pb.n:
        raise ValueError("the operators have a cycle")
    return order


def reverse_postorder(pb: Problem) -> list[int]:
    """Depth first from the operators without predecessors, successors in index order; the
    reverse of the finishing order is topological and keeps each branch together."""
    seen, post = [False] * pb.n, []
    for root in reversed([o for o in range(pb.n) if not pb.preds[o]]):
        if seen[root]:
            continue
        seen[root] = True
        stack = [(root, iter(reversed(pb.succs[root])))]
        while stack:
            o, it = stack[-1]
            nxt = next((s for s in it if not seen[s]), None)
            if nxt is None:
                post.append(o)
                stack.pop()
            else:
                seen[nxt] = True
                stack.append((nxt, iter(reversed(pb.succs[nxt]))))
    return post[::-1]


def greedy_least_peak(pb: Problem) -> list[int]:
    """At each step the ready operator with the smallest step, then the smallest resident
    after it, then the lowest index."""
    fast = StepUpdates(pb)
    done, resident, order = 0, fast.start, []
    ready = [o for o in range(pb.n) if not pb.preds[o]]
    while ready:
        best = None
        for o in ready:
            step, after = fast.expand(o, done, resident)
            if best is None or (step, after, o) < best:
                best = (step, after, o)
        _, resident, o = best
        ready.remove(o)
        order.append(o)
        done |= 1 << o
        ready += [s for s in pb.succs[o] if not pb.preds[s] & ~done]
    return order


def random_order(pb: Problem, rng: random.Random) -> list[int]:
    """A random execution order: a uniformly random ready operator at each step (not uniform
    over all topological orders; the usual meaning of a random order)."""
    return topological(pb, pick=rng.choice)


# --- the search ------------------------------------------------------------------------------

class StepUpdates:
    """The memory model's step and resident updates, incremental: what every search runs (this
    module's BTSearch, and hepti.order.hierarchical's top level and groups)."""

    def __init__(self, pb: Problem):
        self.pb = pb
        self.keep = [sum(pb.size[j] for j in pb.outs[o]
                         if pb.held[j] or pb.consumers[j]) for o in range(pb.n)]
        self.out = [sum(pb.size[j] for j in pb.outs[o]) for o in range(pb.n)]
        self.start = pb.offset + sum(s for j, s in enumerate(pb.size)
                                     if pb.producer[j] < 0 and (pb.held[j] or pb.consumers[j]))

    def expand(self, o: int, done: int, resident: int) -> tuple[int, int]:
        """(bytes while o runs, bytes resident after it) from the set `done` with `resident`."""
        pb = self.pb
        nd = done | 1 << o
        saving = 0
        for j, saved in pb.inplace_pairs[o]:
            if saved > saving and not pb.consumers[j] & ~nd:
                saving = saved
        after = resident + self.keep[o]
        for j in pb.ins[o]:
            if not pb.held[j] and not pb.consumers[j] & ~nd:
                after -= pb.size[j]
        return resident + self.out[o] - saving, after


def ancestry(pb: Problem) -> tuple[list[int], list[int]]:
    """(ancestors, descendants) of each operator, as bitmasks."""
    order = topological(pb)
    anc, desc = [0] * pb.n, [0] * pb.n
    for o in order:
        m = pb.preds[o]
        for p in set_bits(pb.preds[o]):
            m |= anc[p]
        anc[o] = m
    for o in reversed(order):
        m = 0
        for s in pb.succs[o]:
            m |= desc[s] | 1 << s
        desc[o] = m
    return anc, desc


def lower_bounds(pb: Problem, anc=None, desc=None) -> list[int]:
    """Per operator, bytes live while it runs in every order: its inputs and outputs (less the
    largest in-place saving it might get), every tensor written before it (by an ancestor, or
    present from the start) and read after it (by a descendant, or held), and the offset."""
    if anc is None:
        anc, desc = ancestry(pb)
    full = pb.full
    lb = [pb.offset + sum(pb.size[j] for j in pb.ins[o]) + sum(pb.size[j] for j in pb.outs[o])
          - max((s for _, s in pb.inplace_pairs[o]), default=0) for o in range(pb.n)]
    for j, s in enumerate(pb.size):
        p = pb.producer[j]
        after = full if p < 0 else desc[p]
        if pb.held[j]:
            before = full
        else:
            before = 0
            for c in set_bits(pb.consumers[j]):
                before |= anc[c]
        for o in set_bits(after & before & ~pb.consumers[j]):
            lb[o] += s
    return lb


class _Budget(Exception):
    pass


@dataclass
class SearchResult:
    """One Problem's search: the best order found (operator indices) and its peak, whether it
    is proven the least, the states reached (partial orders the search visited) and seconds;
    `start_peak` is the incumbent's and `lower_bound` the static bound's."""

    order: list[int]
    peak: int
    proven: bool
    states: int
    seconds: float
    start_peak: int
    start: str
    lower_bound: int
    stopped: str = ""  # why an unproven search stopped: "time", "states"


def btsearch(pb: Problem, incumbent: list[int] | None = None, bound: bool = True,
             hashing: bool = True, dominance: bool = True,
             time_limit: float = DEFAULT_TIME_LIMIT,
             max_states: int = DEFAULT_MAX_STATES, floor: int = 0) -> SearchResult:
    """The least-peak order of one Problem (see the module docstring). `incumbent`: a starting
    order (default: the best cheap order; with `bound` off, none is used and every order is
    walked, so an exhaustive search's states count the orders' prefixes). `floor`: a peak
    that is good enough (a block's search in a graph whose peak is already that high): the
    search stops at the first order at or under it (`stopped` "floor"), proven or not."""
    t0 = time.perf_counter()
    fast = StepUpdates(pb)
    anc, desc = ancestry(pb)
    lb = lower_bounds(pb, anc, desc)
    lb_global = max(lb, default=pb.offset)
    by_lb = sorted(range(pb.n), key=lambda o: -lb[o])
    if incumbent is None:
        cands = {"file": topological(pb), "reverse post-order": reverse_postorder(pb),
                 "greedy least-peak": greedy_least_peak(pb)}
        start, incumbent = min(cands.items(), key=lambda kv: (pb.peak(kv[1]), list(cands).index(kv[0])))
    else:
        start = "given"
    start_peak = pb.peak(incumbent)
    best = [start_peak, list(incumbent)]
    if not bound:
        best[0] = float("inf")
    if bound and start_peak <= lb_global:
        return SearchResult(list(incumbent), start_peak, True, 0, time.perf_counter() - t0,
                            start_peak, start, lb_global)
    if bound and start_peak <= floor:
        return SearchResult(list(incumbent), start_peak, False, 0, time.perf_counter() - t0,
                            start_peak, start, lb_global, "floor")

    seen: dict[int, int] = {}
    prefix: list[int] = []
    states = 0
    full = pb.full
    deadline = t0 + time_limit
    preds, succs = pb.preds, pb.succs

    def remaining_bound(done: int) -> int:
        for o in by_lb:
            if not done >> o & 1:
                return lb[o]
        return 0

    def dfs(done: int, resident: int, peak: int, ready: list[int]) -> None:
        nonlocal states
        states += 1
        if states > max_states:
            raise _Budget("states")
        if not states & 255 and time.perf_counter() > deadline:
            raise _Budget("time")
        if done == full:
            if peak < best[0]:
                best[0], best[1] = peak, list(prefix)
                if bound and peak <= floor:
                    raise _Budget("floor")
            return
        if hashing:
            was = seen.get(done)
            if was is not None and was <= peak:
                return
            seen[done] = peak
        if bound and max(peak, remaining_bound(done)) >= best[0]:
            return
        children = []
        for o in ready:
            step, after = fast.expand(o, done, resident)
            p = step if step > peak else peak
            if bound and p >= best[0]:
                continue
            if dominance and step <= peak and after <= resident:
                children = [(p, after, o)]
                break
            children.append((p, after, o))
        children.sort()
        for p, after, o in children:
            nd = done | 1 << o
            nready = [r for r in ready if r != o]
            nready += [s for s in succs[o] if not preds[s] & ~nd]
            prefix.append(o)
            dfs(nd, after, p, nready)
            prefix.pop()
            if bound and peak >= best[0]:
                return

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, pb.n + 200))
    stopped = ""
    try:
        dfs(0, fast.start, 0, [o for o in range(pb.n) if not preds[o]])
    except _Budget as e:
        stopped = str(e)
    finally:
        sys.setrecursionlimit(limit)
    peak, order = best
    if not bound and peak == float("inf"):
        peak, order = start_peak, list(incumbent)
    proven = not stopped or peak <= lb_global
    if stopped == "floor" and peak <= lb_global:
        stopped = ""
    return SearchResult(order, int(peak), proven, states, time.perf_counter() - t0, start_peak,
                        start, lb_global, stopped)


# --- decomposition ---------------------------------------------------------------------------

def blocks(pb: Problem) -> list[list[int]]:
    """The operators in runs between cuts (see the module docstring), in order: each cut is a
    block of its own, and so is each stretch of operators between two cuts."""
    anc, desc = ancestry(pb)
    full = pb.full
    cut = [(anc[o] | desc[o] | 1 << o) == full for o in range(pb.n)]
    out, current = [], []
    for o in sorted(range(pb.n), key=lambda o: (bin(anc[o]).count("1"), o)):
        if cut[o]:
            if current:
                out.append(current)
                current = []
            out.append([o])
        else:
            current.append(o)
    if current:
        out.append(current)
    return out


def restrict(pb: Problem, ops: list[int], before: int) -> Problem:
    """The Problem of the operators `ops` when those in `before` have run and every other one
    runs after: tensors from before are present at the start, tensors read after are held,
    tensors that live across without being touched are the offset."""
    index = {o: k for k, o in enumerate(ops)}
    inside = 0
    for o in ops:
        inside |= 1 << o
    after = pb.full & ~inside & ~before
    ids: dict[int, int] = {}
    size, producer, consumers, held, reusable = [], [], [], [], []
    offset = pb.offset
    touched = set()
    for o in ops:
        touched.update(pb.ins[o])
        touched.update(pb.outs[o])
    for j, s in enumerate(pb.size):
        p = pb.producer[j]
        from_before = p < 0 or before >> p & 1
        read_after = pb.held[j] or bool(pb.consumers[j] & after)
        if j not in touched:
            if from_before and read_after:
                offset += s
            continue
        ids[j] = len(size)
        size.append(s)
        producer.append(index[p] if not from_before else -1)
        mask = 0
        for c in set_bits(pb.consumers[j] & inside):
            mask |= 1 << index[c]
        consumers.append(mask)
        held.append(read_after)
        reusable.append(pb.reusable[j])
    preds = []
    for o in ops:
        m = 0
        for q in set_bits(pb.preds[o] & inside):
            m |= 1 << index[q]
        preds.append(m)
    succs = [[index[s] for s in pb.succs[o] if s in index] for o in ops]
    ins = [[ids[j] for j in pb.ins[o]] for o in ops]
    outs = [[ids[j] for j in pb.outs[o]] for o in ops]
    pairs = [[(ids[j], saved) for j, saved in pb.inplace_pairs[o] if not held[ids[j]]]
             for o in ops]
    pos = pb.position or list(range(pb.n))
    return Problem([pb.names[o] for o in ops], preds, succs, ins, outs, pairs, size, producer,
                   consumers, held, reusable, offset, [pos[o] for o in ops])


def set_bits(mask: int):
    """The set bits of a mask, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low
