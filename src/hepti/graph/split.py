"""A CNN split's geometry, which the executor (hepti.parallel.bands) and the planners
(hepti.plan.coedge, hepti.plan.genetic_cnn) all read: which rows of each feature map a rank
owns, which it must compute or fetch in a group of ops, and, in a group split by channels,
which output channels (and so which rows of each weight) are its. No MPI, no kernels."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hepti.counts import counts, offsets
from hepti.graph.cnn import CONV, LINEAR, SPATIAL, Graph


@dataclass(frozen=True)
class Split:
    """How a CNN runs across ranks: `ratios` (every map's rows, and the head's columns),
    `groups` (the spatial ops' [start, stop) index ranges, in order, covering them all; one op
    each when None) and how the linear head is split ("cols" or "primary"). `per_group`, if
    given, overrides `ratios` group by group: the maps a group makes are split by its own
    vector (a pipeline: each group's vector one-hot on the rank that runs it). `dims`, if
    given, says per group how it is split: "rows" (by height, CoEdge's) or "channels" (each
    conv's output channels, so its weight's rows, by the group's vector: every rank that
    takes part reads the whole input map, computes its channels of the whole output, and an
    allgather gives every rank the whole map; GenEFlow's vertical split). `streamed`, if
    given, says per group whether its convs' weights stay resident or are read from the
    rank's local weight files just before each op runs and let go after it (hepti's `stream`,
    for a device that cannot hold even its slice of the weights)."""

    ratios: tuple[float, ...]
    groups: tuple[tuple[int, int], ...] | None = None
    head: str = "cols"
    per_group: tuple[tuple[float, ...], ...] | None = None
    dims: tuple[str, ...] | None = None
    streamed: tuple[bool, ...] | None = None

    def group_streamed(self, k: int) -> bool:
        return bool(self.streamed and self.streamed[k])

    def group_ratios(self, k: int) -> tuple[float, ...]:
        return self.ratios if self.per_group is None else self.per_group[k]

    def group_dim(self, k: int) -> str:
        return "rows" if self.dims is None else self.dims[k]

    def members(self) -> list[int]:
        """The ranks a forward needs: rank 0 (the pixels and the logits) and every rank with
        a share of some group's rows or of the head (hepti.parallel.engine `BandJob` runs the forward
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
            if self.dims is not None and len(self.dims) != n:
                raise ValueError(f"dims {list(self.dims)}: one per op ({n}) when no groups")
            if self.streamed is not None and len(self.streamed) != n:
                raise ValueError(f"streamed {list(self.streamed)}: one per op ({n}) when no "
                                 f"groups")
            return [(i, i + 1) for i in range(n)]
        if self.streamed is not None and len(self.streamed) != len(self.groups):
            raise ValueError(f"streamed {list(self.streamed)}: one flag per group "
                             f"({len(self.groups)} groups)")
        if self.dims is not None:
            if len(self.dims) != len(self.groups) or not set(self.dims) <= set(DIMS):
                raise ValueError(f"dims {list(self.dims)}: one of {', '.join(DIMS)} per group "
                                 f"({len(self.groups)} groups)")
        at = 0
        for a, b in self.groups:
            if a != at or b <= a:
                raise ValueError(f"fused groups {list(self.groups)} must cover ops 0..{n} in order")
            at = b
        if at != n:
            raise ValueError(f"fused groups {list(self.groups)} end at op {at}, the spatial part "
                             f"has {n} ops")
        return [tuple(g) for g in self.groups]


DIMS = ("rows", "channels")


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


def channel_needs(graph: Graph, shapes: dict, group: tuple[int, int], ratios, rank: int) -> dict:
    """`needs` of a group split by channels: a rank with a share reads every row of the
    group's inputs and makes every row of what it makes (its channels of it); one without
    reads and makes nothing (the allgathers still hand it every made map)."""
    if not ratios[rank] > 0:
        return {}
    need = {}
    for op in graph.ops[group[0]:group[1]]:
        for t in (op.input, op.residual, op.output):
            if t is not None:
                need[t] = (0, shapes[t][0])
    return need


def channel_unit(op) -> int:
    """The channels a channel split moves together: a group of a grouped (not depthwise)
    conv, one channel otherwise."""
    if op.kind == CONV and op.groups > 1 and not op.depthwise:
        return op.cout // op.groups
    return 1


def out_channels(op, ratios, channels: int | None = None) -> list[int]:
    """Each rank's count of op's output channels (`channels`: a pooling's, which has no
    cout of its own) under a channel split by `ratios`."""
    unit = channel_unit(op)
    return [c * unit for c in counts((channels or op.cout) // unit, ratios)]


def channel_slice(op, ratios, rank: int, channels: int | None = None
                  ) -> tuple[int, int, int, int, int]:
    """(c0, c1, i0, i1, groups): `rank`'s output channels [c0, c1) of op under a channel split,
    the input channels [i0, i1) they read (all of them for a dense conv, their own for a
    depthwise or grouped one, and a pooling's), and the group count of that slice's conv."""
    c = out_channels(op, ratios, channels)
    c0 = offsets(c)[rank]
    c1 = c0 + c[rank]
    if op.kind != CONV:  # a pooling: each channel reads its own
        return c0, c1, c0, c1, 1
    if op.groups == 1:
        return c0, c1, 0, op.cin, 1
    unit, cin_g = op.cout // op.groups, op.cin // op.groups
    g0, g1 = c0 // unit, c1 // unit
    return c0, c1, g0 * cin_g, g1 * cin_g, g1 - g0


def conv_rows(graph: Graph, split: Split, rank: int, size: int) -> dict[str, tuple[int, int]]:
    """Rows [lo, hi) of each conv's stored weight [cout, ...] (and bias) `rank` reads: all of
    them in a group split by rows where it has a share, none where it has none, its output
    channels in a group split by channels."""
    out = {}
    for k, (a, b) in enumerate(split.group_ranges(graph)):
        ratios = split.group_ratios(k)
        for op in graph.ops[a:b]:
            if op.kind != CONV:
                continue
            if size == 1:
                out[op.name] = (0, op.cout)
            elif split.group_dim(k) == "channels":
                out[op.name] = channel_slice(op, ratios, rank)[:2]
            else:
                out[op.name] = (0, op.cout) if ratios[rank] > 0 else (0, 0)
    return out


def streamed_convs(graph: Graph, split: Split) -> set[str]:
    """The convs whose weights a rank reads as each runs (`Split.streamed`), not at load."""
    return {op.name for k, (a, b) in enumerate(split.group_ranges(graph))
            if split.group_streamed(k) for op in graph.ops[a:b] if op.kind == CONV}


def fetches(need: list[dict], inputs, owners: dict, holders: dict, shapes: dict, size: int
            ) -> list[tuple[str, int, int, int, int]]:
    """A group's exchange: (tensor, from rank, to rank, row lo, row hi) for every row of the
    group's `inputs` a rank needs (`need[i]`: `needs` or `channel_needs` of rank i) and does
    not hold yet (`holders[t][i]`, a range), each from the rank that owns it (`owners[t]`,
    Split.owners). In the order both ends agree on. The executor (hepti.parallel.bands)
    sends and receives exactly these, and the cost model (hepti.plan.coedge) prices them:
    one list, so the planner cannot charge a transfer the runtime does not make (it once
    charged every group after a channel split for a whole map every rank already held)."""
    out = []
    for t in inputs:
        own = owned(shapes[t][0], owners[t], size)
        for i, nd in enumerate(need):
            if t not in nd:
                continue
            for lo, hi in gaps(nd[t], holders[t][i]):
                for j, (o0, o1) in enumerate(own):
                    s0, s1 = max(lo, o0), min(hi, o1)
                    if s1 > s0 and j != i:
                        out.append((t, j, i, s0, s1))
    return out


def hold(holders: dict, need: list[dict], inputs, made, by_channels: bool, shapes: dict,
         size: int) -> None:
    """What each rank holds of each tensor once a group has run (`holders`, updated): the
    rows of its inputs it held or fetched, and of what the group made, its rows of it (the
    whole map after a split by channels, whose allgathers hand every rank all of it)."""
    for t in inputs:
        holders[t] = [union(h, nd.get(t)) for h, nd in zip(holders[t], need)]
    for t in made:
        holders[t] = ([(0, shapes[t][0])] * size if by_channels else
                      [nd.get(t, (0, 0)) for nd in need])


def first_holders(graph: Graph, h: int, size: int) -> dict:
    """`holders` before the first group: rank 0 holds the pixels."""
    return {graph.input: owned(h, None, size)}


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


def head_rows(graph: Graph, split: Split, rank: int, size: int) -> dict[str, tuple[int, int]]:
    """Rows [lo, hi) of each linear's stored [out, in] weight this rank reads (its output
    columns), for a head split by columns; every row on rank 0 for "primary"."""
    out = {}
    for op in graph.ops:
        if op.kind != LINEAR:
            continue
        if split.head == "primary" or size == 1:
            out[op.name] = (0, op.cout) if rank == 0 else (0, 0)
        else:
            c = counts(op.cout, split.ratios)
            out[op.name] = (offsets(c)[rank], offsets(c)[rank] + c[rank])
    return out
