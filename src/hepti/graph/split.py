"""A height split's geometry, which the executor (hepti.parallel.bands) and the planner
(hepti.plan.coedge) both read: which rows of each feature map a rank owns, and which it must
compute or fetch in a group of ops. No MPI, no kernels."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hepti.counts import counts, offsets
from hepti.graph.cnn import SPATIAL, Graph


@dataclass(frozen=True)
class Split:
    """How a CNN runs across ranks: `ratios` (every map's rows, and the head's columns),
    `groups` (the spatial ops' [start, stop) index ranges, in order, covering them all; one op
    each when None) and how the linear head is split ("cols" or "primary"). `per_group`, if
    given, overrides `ratios` group by group: the maps a group makes are split by its own
    vector (a pipeline: each group's vector one-hot on the rank that runs it)."""

    ratios: tuple[float, ...]
    groups: tuple[tuple[int, int], ...] | None = None
    head: str = "cols"
    per_group: tuple[tuple[float, ...], ...] | None = None

    def group_ratios(self, k: int) -> tuple[float, ...]:
        return self.ratios if self.per_group is None else self.per_group[k]

    def members(self) -> list[int]:
        """The ranks a forward needs: rank 0 (the pixels and the logits) and every rank with
        a share of some group's rows or of the head (hepti.parallel.cnn_job runs the forward
        on their sub-communicator; hepti.plan.coedge charges the tail's collectives to them)."""
        vectors = [self.ratios] + list(self.per_group or ())
        return sorted({0} | {i for v in vectors for i, r in enumerate(v) if r > 0})

    def on(self, ranks: list[int]) -> "Split":
        """This split on the sub-communicator of `ranks` (in rank order: rank 0 first)."""
        pick = lambda v: tuple(v[i] for i in ranks)  # noqa: E731
        return dataclasses.replace(self, ratios=pick(self.ratios),
                                   per_group=tuple(pick(v) for v in self.per_group)
                                   if self.per_group else None)

    def owners(self, graph: Graph) -> dict[str, tuple[float, ...] | None]:
        """Tensor -> the ratio vector its rows are owned by (the group that made it); None
        for the pixels, which rank 0 holds whole."""
        out = {graph.input: None}
        for k, (a, b) in enumerate(self.group_ranges(graph)):
            for op in graph.ops[a:b]:
                out[op.output] = self.group_ratios(k)
        return out

    def group_ranges(self, graph: Graph) -> list[tuple[int, int]]:
        n = spatial_ops(graph)
        if self.groups is None:
            return [(i, i + 1) for i in range(n)]
        at = 0
        for a, b in self.groups:
            if a != at or b <= a:
                raise ValueError(f"fused groups {list(self.groups)} must cover ops 0..{n} in order")
            at = b
        if at != n:
            raise ValueError(f"fused groups {list(self.groups)} end at op {at}, the spatial part "
                             f"has {n} ops")
        return [tuple(g) for g in self.groups]


def spatial_ops(graph: Graph) -> int:
    """How many of the graph's first ops are spatial (the part a height split runs)."""
    n = 0
    while n < len(graph.ops) and graph.ops[n].kind in SPATIAL:
        n += 1
    return n


def owned(h: int, ratios, size: int | None = None) -> list[tuple[int, int]]:
    """Each rank's rows [lo, hi) of a map of h rows; ratios None: rank 0 holds them all (of
    `size` ranks)."""
    if ratios is None:
        return [(0, h)] + [(0, 0)] * (size - 1)
    c = counts(h, ratios)
    return [(o, o + n) for o, n in zip(offsets(c), c)]


def union(a, b):
    if a is None or a[1] <= a[0]:
        return b
    if b is None or b[1] <= b[0]:
        return a
    return min(a[0], b[0]), max(a[1], b[1])


def needs(graph: Graph, shapes: dict, group: tuple[int, int], ratios, rank: int) -> dict:
    """Rows [lo, hi) of each tensor that `rank` computes (made in the group) or reads (from
    before it) to make its own rows of every tensor the group hands on."""
    a, b = group
    ops = graph.ops[a:b]
    made = {op.output for op in ops}
    need = {}
    for i, op in enumerate(ops, start=a):  # handed on: read after the group, or the last op's
        if max(graph.consumers.get(op.output, [len(graph.ops)])) >= b or i == b - 1:
            need[op.output] = owned(shapes[op.output][0], ratios)[rank]
    for op in reversed(ops):
        r = need.get(op.output)
        if r is None or r[1] <= r[0]:
            continue
        need[op.input] = union(need.get(op.input), op.in_rows(*r, shapes[op.input][0]))
        if op.residual is not None:
            need[op.residual] = union(need.get(op.residual), r)
    return {t: r for t, r in need.items() if t in made or r[1] > r[0]}


def gaps(want, have) -> list[tuple[int, int]]:
    """Parts of range `want` outside range `have`."""
    lo, hi = want
    if have is None or have[1] <= have[0]:
        return [want] if hi > lo else []
    out = []
    if lo < have[0]:
        out.append((lo, min(hi, have[0])))
    if hi > have[1]:
        out.append((max(lo, have[1]), hi))
    return [g for g in out if g[1] > g[0]]
