"""Exact references for BTSearch, independent of it: brute force and a DP over downsets.

- `brute_force(problem)`: every topological order, each priced step by step from the memory
  model's definition (`Problem.peak_by_definition`); for graphs of about ten operators.
- `downset_dp(problem)`: the sets of operators an order can have run at some point are the
  DAG's downsets (ideals: closed under predecessors). The least peak with which a downset D
  can be reached is `best(D) = min over o in D with D - {o} a downset of
  max(best(D - {o}), step(D - {o}, o))`, because a step depends on D - {o} and o alone. The DP
  fills `best` breadth first, level by level (downsets of k operators, then k + 1), and follows
  the choices back from the full set. Resident bytes are recomputed for each downset from the
  definition (`Problem.resident`), not carried along as the search does. It visits every
  downset, so it stops with an error past `max_states` of them: fine for chains of blocks
  (CNNs, Inception modules), hopeless for wide random graphs.

Neither uses bound, hashing, dominance, decomposition or the search's incremental updates; the
tests and the benchmark hold BTSearch's peaks equal to theirs.
"""
from __future__ import annotations

from hepti.order.memory import Problem


class TooLarge(Exception):
    """The exact method would visit more states than allowed."""


def linear_extensions(pb: Problem, limit: int | None = None):
    """Every topological order of the Problem's operators (a generator); TooLarge past
    `limit` of them."""
    order: list[int] = []
    count = 0

    def extend(done: int):
        nonlocal count
        if len(order) == pb.n:
            count += 1
            if limit is not None and count > limit:
                raise TooLarge(f"more than {limit} topological orders")
            yield list(order)
            return
        for o in range(pb.n):
            if not done >> o & 1 and not pb.preds[o] & ~done:
                order.append(o)
                yield from extend(done | 1 << o)
                order.pop()

    yield from extend(0)


def brute_force(pb: Problem, limit: int = 1_000_000) -> tuple[int, list[int], int]:
    """(least peak, an order with it, orders priced) over all topological orders."""
    best, best_order, n = None, None, 0
    for order in linear_extensions(pb, limit):
        n += 1
        peak = pb.peak_by_definition(order)
        if best is None or peak < best:
            best, best_order = peak, order
    return best, best_order, n


def count_orders(pb: Problem, limit: int = 10**12) -> int:
    """How many topological orders the Problem has (a DP over downsets: paths to each);
    TooLarge if the downsets pass `limit`."""
    paths = {0: 1}
    for _ in range(pb.n):
        nxt: dict[int, int] = {}
        for done, k in paths.items():
            for o in range(pb.n):
                if not done >> o & 1 and not pb.preds[o] & ~done:
                    d = done | 1 << o
                    nxt[d] = nxt.get(d, 0) + k
        if len(nxt) > limit:
            raise TooLarge(f"more than {limit} downsets")
        paths = nxt
    return sum(paths.values())


def downset_dp(pb: Problem, max_states: int = 2_000_000) -> tuple[int, list[int], int]:
    """(least peak, an order with it, downsets visited); TooLarge past `max_states`."""
    level = {0: 0}  # downset -> least peak to reach it
    back: dict[int, tuple[int, int]] = {}  # downset -> (downset before, operator run)
    visited = 1
    for _ in range(pb.n):
        nxt: dict[int, int] = {}
        for done, peak in level.items():
            resident = pb.resident(done)
            for o in range(pb.n):
                if done >> o & 1 or pb.preds[o] & ~done:
                    continue
                step = resident + sum(pb.size[j] for j in pb.outs[o]) - pb.inplace_saving(done, o)
                d, p = done | 1 << o, max(peak, step)
                if d not in nxt or p < nxt[d]:
                    nxt[d] = p
                    back[d] = (done, o)
        visited += len(nxt)
        if visited > max_states:
            raise TooLarge(f"more than {max_states} downsets")
        level = nxt
    (full, peak), = level.items()
    order, d = [], full
    while d:
        d, o = back[d]
        order.append(o)
    return peak, order[::-1], visited
