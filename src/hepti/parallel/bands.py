"""A CNN split by height across ranks (CoEdge), in fused groups of layers (DeepThings).

Every feature map's rows are split by one ratio vector: rank i owns rows
counts(H, ratios)[i] of each map, in rank order (`owned`). The spatial ops (convolutions and
pools) run in groups of consecutive ops (`Split.groups`). Per group, each rank:
1. works out, from the end of the group back, which rows of each tensor it must compute
   (`needs`): its own rows of what leaves the group, and through each op the input rows they
   read (hepti.graph.cnn `Op.in_rows`: kernel, stride, padding, dilation), and a residual's
   rows as its output's;
2. fetches the rows of the group's inputs it needs and does not hold from their owners, point
   to point, once (`Comm.exchange`): a group of one op exchanges the usual halo; a fused group
   exchanges a deeper one once and recomputes the overlap instead of exchanging again;
3. runs the group's ops on its bands (hepti.model.cnn `apply`, with the band's own padding).
Residual adds stay local: a residual's rows are its output's, which the rank computes anyway.
The pixels start on rank 0, which owns all their rows: the first exchange scatters them.

After the spatial part, global pooling sums each rank's own rows and allgathers the partial
sums (`pooled_sum`); a pooling to a grid (VGG's 7x7) gathers the whole map first. The linear
head is split by output columns in the same ratios (`Split.head` "cols": each rank reads only
its rows of each [out, in] weight, and an allgather joins the columns), or runs on rank 0
alone ("primary").

**Groups split by channels** (`Split.dims`, GenEFlow's vertical split): every rank with a
share fetches the whole of the group's input maps, by the same exchange (so a band split's
rows are gathered); each op then makes the rank's output channels of the whole map (its rows
of each weight: hepti.graph.split `conv_rows`, all a rank loads) and an allgather over the
channels hands every rank the whole map, which the next group reads without an exchange.
Weights are sliced, activations are whole: the split for a device short of memory for
weights, such as ResNet-50's last stages (small maps, most of the weights).

**Streamed groups** (`Split.streamed`): their convs' weights (the rank's rows of them) are
read from the rank's local weight files and packed just before each op runs, and let go
after it (hepti.model.cnn `Weights.fetch`/`drop`): one conv's weights resident at a time, for
a device that cannot hold even its slice of them. Nothing crosses the network for it.

Every rank computes every rank's needs, the same way, so both ends of each message know its
rows without asking. Nothing here imports MPI: the verbs are hepti.parallel.comm's.

**Order and memory.** Within each group the ops run in a given operator order (BTSearch's,
hepti.order.search; the graph's own when none): the groups stay the planner's, their ops sorted
by their place in that order, so the sequence run (`sequence`) is one topological order of
the graph. Each band is let go as soon as the last op to read it in that sequence has run,
inside a fused group too (a fused group used to hold every band it made until its end). So a
rank holds what the memory model of operator order (hepti.order.memory) prices for the
sequence with each tensor at this rank's rows of it: `rank_dag` is that graph, and an
allocation counter (hepti.model.livebytes) passed to `forward` measures what is held. (Without
a counter, a run of VGG's convolutions runs as one hepti.kernels.plain_chain across the
exchanges, `_band_runs`; the chain keeps its zero-bordered maps between forwards, as on one
rank: ~19 MB a rank at 224 on 2 equal bands, outside that model.)
"""
from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass

import numpy as np

from hepti import kernels as K
from hepti.kernels.bottleneck_chain import fused_cout
from hepti.counts import counts
from hepti.graph.cnn import ADAPTIVE_AVG, CONV, LINEAR, Graph
from hepti.graph.split import (Split, channel_needs, channel_slice, fetches, first_holders,
                               gaps, head_rows, hold, needs, out_channels, owned,  # noqa: F401
                               spatial_ops, union)
from hepti.graph.opdag import F32, OpDag, OpNode, TensorInfo, from_cnn
from hepti.model.cnn import (adaptive_avg_pool, apply, apply_inverted, apply_pair,
                             apply_pooled, bordered_pair, bottleneck_block, inverted_block,
                             pairable, plain_step, poolable)
from hepti.model.livebytes import track
from hepti.order.search import executor_order


def lay_out_channels(flat: np.ndarray, per_rank: list[int], shape: tuple) -> np.ndarray:
    """The map [N, H, W, C] from every rank's channels, gathered one after another (rank r's
    [N, H, W, per_rank[r]], flat): each piece copied to its channels. The profile times it
    (hepti.parallel.profile_cnn `measure_layout_rate`), and the cost model charges it to every
    member of a split by channels, once an op."""
    n, hh, ww, c = shape
    px = n * hh * ww
    full = np.empty(shape, np.float32)
    ch = off = 0
    for k in per_rank:
        if k:
            full[..., ch:ch + k] = flat[off:off + px * k].reshape(n, hh, ww, k)
        ch, off = ch + k, off + px * k
    return full


def btsearch_order(graph: Graph) -> list[str]:
    """BTSearch's operator order for `graph` at its model's own image size, batch 1: the order
    `hepti run` runs a CNN in, on one rank or many (for hepti's CNNs its peak is the file
    order's)."""
    side = graph.config.image_size
    return executor_order(from_cnn(graph, 1, side, side)).order


@dataclass
class Band:
    """Rows [lo, lo + x.shape[1]) of a feature map, [N, rows, W, C]. `x` may be a view of
    `buf`, an allocation of rows [buf_lo, buf_lo + buf.shape[1]) that the band's later halos
    are received into (`BandExecutor.program`'s `alloc`)."""

    lo: int
    x: np.ndarray
    buf_lo: int = 0
    buf: np.ndarray | None = None

    def widened(self, lo: int, hi: int) -> "Band | None":
        """Rows [lo, hi) of this band's allocation as a band, its own rows already in place;
        None when the allocation does not cover them."""
        b = self.buf
        if b is None or lo < self.buf_lo or hi > self.buf_lo + b.shape[1]:
            return None
        return Band(lo, b[:, lo - self.buf_lo:hi - self.buf_lo], self.buf_lo, b)

    @property
    def hi(self) -> int:
        return self.lo + self.x.shape[1]

    def rows(self, lo: int, hi: int) -> np.ndarray:
        """Rows [lo, hi) of the map: x itself when they are all of it (one rank's whole map,
        every op of a forward on one process), else a view of them."""
        x, at = self.x, self.lo
        if lo == at and hi - lo == x.shape[1]:
            return x
        assert at <= lo and hi <= at + x.shape[1], (at, at + x.shape[1], lo, hi)
        return x[:, lo - at:hi - at]


@dataclass
class _Group:
    """One fused group of a forward on one rank (`BandExecutor.program`)."""

    name: str  # the tracer's span
    exchange_name: str  # what an allocation counter charges the exchange to
    sends: dict  # peer -> [(tensor, row lo, row hi)] this rank sends it, in order
    recvs: dict  # peer -> [(tensor, row lo, row hi)] this rank receives from it, in order
    widen: list  # [(tensor, lo, hi)]: the band this rank holds of it becomes rows [lo, hi)
    ops: list  # [(op, its output rows or None, its input rows, band padding, tensors to free,
    #  a channel split's (c0, c1, i0, i1, each rank's channel count) or None, the rows to
    #  allocate its output with when wider than its own: `alloc`)]
    channels: bool = False  # split by channels: each op's compute, then its allgather


def pooled_sum(comm, rows, n: int, c: int, holders: list[bool]) -> np.ndarray:
    """[n, c]: the sum over every rank's rows ([n, k, w, c] on a rank that `holders` says has
    some, else None) of a map, on every rank: each holder's partial sums allgathered and added
    in rank order (the same float32 result everywhere, as a reduction's must be). An allgather
    of the partials, not MPI's allreduce: with each rank sleeping between tests of its request
    (`hepti.parallel.comm.wait` on a capped device), MPI_Iallreduce of 1,280 floats took 0.32,
    0.62 and 0.79 ms among 2, 3 and 4 emulated devices (emu-geneflow4), the allgather 0.13,
    0.28 and 0.35 ms: one round of messages, where the reduction's algorithm takes several."""
    part = (rows.sum(axis=(1, 2), dtype=np.float64).astype(np.float32)[None] if rows is not None
            else np.empty((0, n, c), np.float32))
    parts = comm.allgather_rows(part, [1 if h else 0 for h in holders])
    return parts.sum(axis=0, dtype=np.float64).astype(np.float32)


def _chain_padding(entry) -> tuple:
    """A program entry's convolution padding (top, bottom, left, right) as a chain's step takes
    it: the rows' own where the band sets them (its first or last rank's edge), else the op's."""
    op, pad = entry[0], entry[3]
    return (pad if pad is not None else (op.padding,) * 2) + (op.padding,) * 2


def _adjacent(grp: "_Group", key: str, fits, taps: dict | None) -> tuple:
    """The positions j in grp.ops (`_Group.ops` entries) where op j+1 alone reads op j's
    output and `fits(entry j, entry j+1)`: both with output rows to make, op j+1 reading
    the rows op j makes, neither split by channels, op j's output no wider than its rows.
    Worked out once per group (kept as grp.<key>); less those whose output is tapped.
    `_pairs` and `_pooled` say what each runs as one call."""
    if not hasattr(grp, key):
        ops = grp.ops
        setattr(grp, key, tuple(
            j for j, (a, b) in enumerate(zip(ops, ops[1:]))
            if fits(a, b) and a[0].output in b[4] and a[1] is not None and b[1] is not None
            and a[5] is None and b[5] is None and a[6] is None and b[2] == a[1]))
    found = getattr(grp, key)
    if not taps:
        return found
    return tuple(j for j in found if grp.ops[j][0].output not in taps)


class BandExecutor:
    """The height split of one CNN on one rank of `comm` (a Comm): `forward(pixels)` on rank 0
    (pixels [N, 3, H, W], torch's layout) -> logits [N, classes] on rank 0 (None elsewhere);
    every rank calls it. `weights`: this rank's (hepti.model.cnn.Weights; only its columns of
    the head's linears with head "cols": `head_rows`)."""

    def __init__(self, comm, graph: Graph, split: Split, weights, threads: int = 1,
                 order: list[str] | None = None, band_runs: bool = True):
        """`order`: the operator order to follow within each group (names of all the ops:
        hepti.graph.cnn `Graph.run_order`); the graph's own when None. `band_runs`: False
        runs VGG's convolutions on bands of several ranks one by one, each its group's one
        compute span (hepti.parallel.profile_cnn times them so), not as `_band_runs`."""
        self.comm, self.graph, self.split, self.weights = comm, graph, split, weights
        self.threads, self.band_runs = threads, band_runs
        self.groups = split.group_ranges(graph)
        self.n_spatial = spatial_ops(graph)
        self.owners = split.owners(graph)
        self._schedules: dict = {}  # (h, w) -> (shapes, needs): `schedule`
        self._programs: dict = {}  # (h, w, rank) -> [_Group]: `program`
        self._banded: dict = {}  # id(program) -> (program, its `_band_runs`)
        at = {i: k for k, i in enumerate(graph.run_order(order))}
        # each group's ops in the order's sequence, then the head in its own
        self.runs = [sorted(range(a, b), key=at.__getitem__) for a, b in self.groups]
        self.sequence = [i for run in self.runs for i in run] + list(
            range(self.n_spatial, len(graph.ops)))
        self.last = graph.last_use([graph.ops[i].name for i in self.sequence])

    # --- the plan of one input size, the same on every rank ---------------------------------
    def schedule(self, h: int, w: int) -> tuple[dict, list[list[dict]]]:
        """(shapes, per group per rank its needs) for an h x w input (kept per size: a few
        ms of Python for ResNet-50's 54 spatial ops at 4 ranks, every forward otherwise)."""
        if (h, w) not in self._schedules:
            shapes = self.graph.shapes(h, w)
            per = [[(channel_needs if self.split.group_dim(k) == "channels" else needs)(
                        self.graph, shapes, g, self.split.group_ratios(k), r)
                    for r in range(self.comm.size)] for k, g in enumerate(self.groups)]
            self._schedules[(h, w)] = (shapes, per)
        return self._schedules[(h, w)]

    def program(self, h: int, w: int, rank: int | None = None) -> list["_Group"]:
        """`rank`'s (this rank's when None) forward of an h x w input, group by group, worked
        out once per size: what it sends and receives (which rows of which tensor, to and
        from whom, in the order both ends agree on), which bands it widens, and for each op
        its rows, input rows and band padding. Every forward used to redo this in Python for
        every group: MobileNetV2's band executor at 32x32 on one rank took 2.2x the plain
        model's time per op then, 0.8x now (the fixed cost is the profile's `op_overhead_s`).

        `alloc`: an op whose output this rank later widens by a halo (a later group reads rows
        of it this rank does not make) writes its rows into an allocation of every row the
        rank will hold of it, and the halo rows are received beside them (`_fetch`). Widening
        used to allocate the wider band and copy the rank's own rows into it: at 224,
        MobileNetV2 split 0.7/0.3 one op a group, 65-130 us a copy of an early map at full
        speed, 2-7x that on an emulated 0.5-0.15 core device. (Batch 1 only: a band of
        N > 1 images is not contiguous inside a wider one, and the kernels write to a
        contiguous `out`.)"""
        rank = self.comm.rank if rank is None else rank
        if (h, w, rank) in self._programs:
            return self._programs[(h, w, rank)]
        g, size = self.graph, self.comm.size
        shapes, per = self.schedule(h, w)
        holders = first_holders(g, h, size)  # who holds which rows
        held = {g.input: (0, h)} if rank == 0 else {}  # the rows of each tensor this rank holds
        prog, step = [], 0
        for k, ((a, b), run, need) in enumerate(zip(self.groups, self.runs, per)):
            by_channels = self.split.group_dim(k) == "channels"
            made = {op.output for op in g.ops[a:b]}
            sends: dict[int, list] = {}
            recvs: dict[int, list] = {}
            inputs = sorted({t for nd in need for t in nd} - made)
            # every rank's missing rows, each from its owner
            for t, j, i, s0, s1 in fetches(need, inputs, self.owners, holders, shapes, size):
                if j == rank:
                    sends.setdefault(i, []).append((t, s0, s1))
                elif i == rank:
                    recvs.setdefault(j, []).append((t, s0, s1))
            widen = []  # the rank's bands of its inputs, with their halos
            for t, r in need[rank].items():
                if t in made:
                    continue
                old = held.get(t)
                if old is not None and old[0] <= r[0] and r[1] <= old[1]:
                    continue  # it has every row already: no copy (one rank, a later reader)
                held[t] = union(old, r)  # keep what it had: a later group may read those
                widen.append((t,) + held[t])  # rows again (ResNet's identity)
            ops = []
            for i in run:
                op = g.ops[i]
                r = need[rank].get(op.output)
                frees = tuple(t for t in (op.input, op.residual)
                              if t is not None and self.last.get(t) == step)
                if by_channels:  # every rank joins the allgather, and holds the whole map
                    ratios, c = self.split.group_ratios(k), shapes[op.output][2]
                    whole = (0, shapes[op.output][0])
                    chan = channel_slice(op, ratios, rank, c)[:4] + (out_channels(op, ratios, c),)
                    ops.append((op, whole, (0, shapes[op.input][0]), None, frees, chan))
                    held[op.output] = whole
                elif r is not None and r[1] > r[0]:
                    h_in = shapes[op.input][0]
                    ops.append((op, r, op.in_rows(*r, h_in), op.band_padding(*r, h_in), frees,
                                None))
                    held[op.output] = r
                else:
                    ops.append((op, None, (0, 0), None, frees, None))
                step += 1
            hold(holders, need, inputs, [op.output for op in g.ops[a:b]], by_channels, shapes,
                 size)  # what every rank holds from now on
            prog.append(_Group(f"ops {a}-{b - 1}", f"exchange before {g.ops[run[0]].name}",
                               sends, recvs, widen, ops, by_channels))
        for grp in prog:  # held: every row of each tensor the rank holds at some point
            grp.ops = [e + ((held[e[0].output] if not grp.channels and e[1] is not None
                             and held[e[0].output] != e[1] else None),) for e in grp.ops]
        self._programs[(h, w, rank)] = prog
        return prog

    def forward(self, pixels: np.ndarray | None, counter=None, taps: dict | None = None
                ) -> np.ndarray | None:
        """pixels float32 [N, 3, H, W] on rank 0 (None elsewhere) -> logits [N, classes] on
        rank 0. `counter`: a hepti.model.livebytes.AllocationCounter told of every band and
        vector this rank holds and lets go (not the exchange's message buffers; the NHWC
        copy of the pixels and the logits handed back included). `taps`, a dict, receives
        this rank's band ([N, rows, W, C]; the whole map on a group of one) of every tensor
        named in it as it is made."""
        comm, g, rank = self.comm, self.graph, self.comm.rank
        if rank == 0 and (pixels.ndim != 4 or pixels.shape[1] != g.config.num_channels):
            raise ValueError(f"pixels must be [N, {g.config.num_channels}, H, W], got "
                             f"{list(pixels.shape)}")
        head = comm.bcast_obj(pixels.shape if rank == 0 else None)
        n, _, h, w = head
        shapes, _ = self.schedule(h, w)
        running = [g.input]
        have = track({}, counter, lambda: running[0],  # tensor -> Band this rank holds
                     lambda v: v.x if isinstance(v, Band) else v)
        if rank == 0:
            have[g.input] = Band(0, K.nchw_to_nhwc(pixels))  # numpy's transposed copy: 20x
        step = 0
        prog = self.program(h, w)
        banded = {} if counter is not None or comm.size == 1 or self.threads != 1 or taps \
            or not self.band_runs else self._band_runs(prog)
        past = 0  # groups before this one ran inside a band run
        for k, grp in enumerate(prog):
            if k < past:
                continue
            if counter is not None:
                running[0] = grp.exchange_name
            if grp.sends or grp.recvs or grp.widen:
                self._fetch(grp, have, shapes, n)
            band = self._band_plan(prog, banded[k], shapes, n) if k in banded else None
            if grp.channels:  # each op's compute span, then its allgather (not inside it)
                for op, _, _, _, frees, chan, _ in grp.ops:
                    if counter is not None:
                        running[0] = op.name
                    have[op.output] = Band(0, self._by_channels(op, chan, have, shapes, n))
                    if taps is not None and op.output in taps:
                        taps[op.output] = have[op.output].x
                    for t in frees:
                        if t in have:
                            del have[t]
                    step += 1
                continue
            chains = {} if counter is not None or self.threads != 1 else \
                self._chains(grp, taps)
            paired = () if counter is not None or comm.size != 1 else \
                self._pairs(grp, taps)
            bottlenecks = {} if counter is not None or comm.size != 1 else \
                self._bottlenecks(grp, taps)
            pooled = () if counter is not None or comm.size != 1 else \
                self._pooled(grp, taps)
            plains = {} if counter is not None or comm.size != 1 or self.threads != 1 else \
                self._plains(grp, taps)
            if band is not None:  # the entries before the run (the run's ops: in it)
                chains = paired = bottlenecks = pooled = plains = {}
            stop = banded[k][0][0][1] if band is not None else len(grp.ops)
            with comm.tracer.span(grp.name, "compute") if stop else contextlib.nullcontext():
                entries = enumerate(grp.ops[:stop])
                for j, (op, r, (i0, i1), pad, frees, _, alloc) in entries:
                    if counter is not None:  # the step an allocation is charged to
                        running[0] = op.name
                    if j in chains:  # then past the entries it ran (what they read let go)
                        skip = self._run_chain(grp, chains[j], have, shapes, taps)
                        next(itertools.islice(entries, skip, skip), None)
                        step += skip
                    elif j in bottlenecks and (skip := self._run_bottlenecks(
                            grp, bottlenecks[j], have, taps)):
                        next(itertools.islice(entries, skip, skip), None)
                        step += skip
                    elif j in plains and (skip := self._run_plain(grp, plains[j], have,
                                                                  taps)):
                        next(itertools.islice(entries, skip, skip), None)
                        step += skip
                    elif j in paired and self._run_pair(grp.ops[j:j + 2], have, shapes, n,
                                                        taps):
                        next(entries, None)  # the pair's second, run with it
                        step += 1
                    elif j in pooled:
                        self._run_pooled(grp.ops[j:j + 2], have, taps)
                        next(entries, None)  # the pool, made with it
                        step += 1
                    elif r is not None:
                        x = have[op.input].rows(i0, i1)
                        res = have[op.residual].rows(*r) if op.residual is not None else None
                        buf = out = None
                        if alloc is not None and n == 1:  # room for the halos to come
                            buf = np.empty((1, alloc[1] - alloc[0]) + tuple(shapes[op.output][1:]),
                                           np.float32)
                            out = buf[:, r[0] - alloc[0]:r[1] - alloc[0]]
                        self.weights.fetch(op.name)  # a streamed conv's, else nothing
                        res = None if res is None else np.ascontiguousarray(res)
                        if out is None and res is not None and comm.size == 1 and \
                                counter is None and op.residual in frees and \
                                op.residual != op.input and op.kind == CONV and \
                                not op.depthwise and (taps is None or op.residual not in taps):
                            # its last reader: conv2d writes y over it where its store is
                            # fused (ResNet's 1x1 with the identity: ~0.1-0.5 ms an op less
                            # at 224, the output's lines being the residual's, in cache). Not
                            # with a counter: hepti.order.memory prices a new output, and the
                            # counter checks the executor against that model, byte for byte.
                            out = res
                        y = apply(op, np.ascontiguousarray(x), self.weights, res,
                                  pad=pad, threads=self.threads, out=out)
                        self.weights.drop(op.name)
                        have[op.output] = (Band(r[0], y) if buf is None else
                                           Band(r[0], y, alloc[0], buf))
                        if taps is not None and op.output in taps:
                            taps[op.output] = y
                    for t in frees:
                        if t in have:
                            del have[t]
                    step += 1
            if band is not None:
                step += self._run_bands(prog, banded[k], band, have, n)
                past = banded[k][-1][-1][0] + 1
        return self._tail(have, shapes, n, step, running)

    def _band_runs(self, prog: list) -> dict[int, list]:
        """{group index: [each step's entries, [(group, position)] (a convolution, and the
        max pool of its output after it if any)]} of each run of two or more `plain_step`s
        that hepti.kernels.plain_chain runs as one chain on this rank's bands (`_run_bands`),
        across the exchanges between them: each convolution writing its rows into the
        zero-bordered map the next one reads, the halo rows the next one needs received
        into that map's rows above and below them. A run ends at its last group's last
        entry (the entries before it in its first group run one by one first); every
        convolution makes rows, none split by
        channels or streamed; each step reads the one before's output, let go in it; an
        exchange inside a run moves only that output's rows (the halo), its band widened to
        exactly the rows the next convolution reads. Worked out once per program."""
        kept = self._banded.get(id(prog))
        if kept is not None and kept[0] is prog:
            return kept[1]
        flat = [(k, j) for k, grp in enumerate(prog) if not grp.channels
                for j in range(len(grp.ops))]
        entry = lambda kj: prog[kj[0]].ops[kj[1]]  # noqa: E731
        quiet = lambda grp: not (grp.sends or grp.recvs or grp.widen)  # noqa: E731

        def conv_ok(e):
            return plain_step([e[0]]) and e[1] is not None and e[5] is None and \
                not self.weights.streams(e[0].name)

        def follows(prev, kj):  # step kj's convolution reads the step `prev` ends with
            (ka, ja), (kb, jb) = prev, kj
            a, b = entry(prev), entry(kj)
            t = a[0].output
            if b[0].input != t or t not in b[4]:
                return False
            if kb == ka:
                return jb == ja + 1 and b[2] == a[1] and a[6] is None
            grp = prog[kb]
            if kb != ka + 1 or jb != 0 or ja != len(prog[ka].ops) - 1 or grp.channels:
                return False
            pieces = [x for xs in (*grp.sends.values(), *grp.recvs.values()) for x in xs]
            if any(x[0] != t for x in pieces) or any(wd[0] != t for wd in grp.widen):
                return False
            lo, hi = b[2]
            if not grp.widen:
                return b[2] == a[1] and a[6] is None
            got = sum(s1 - s0 for xs in grp.recvs.values() for _, s0, s1 in xs)
            return (len(grp.widen) == 1 and grp.widen[0][1:] == (lo, hi) and
                    lo <= a[1][0] and a[1][1] <= hi and got == hi - lo - (a[1][1] - a[1][0])
                    and a[6] in (None, (lo, hi)))

        runs, cur, i = {}, None, 0
        while i < len(flat):
            kj = flat[i]
            e = entry(kj)
            if not conv_ok(e):
                cur, i = None, i + 1
                continue
            step = [kj]
            if i + 1 < len(flat):  # its pool, if any (in its group or the next, no exchange)
                pk = flat[i + 1]
                p = entry(pk)
                if (pk[0] == kj[0] or (pk[0] == kj[0] + 1 and pk[1] == 0 and
                                       kj[1] == len(prog[kj[0]].ops) - 1 and
                                       quiet(prog[pk[0]]))) and \
                        plain_step([e[0], p[0]]) and p[1] is not None and p[5] is None and \
                        p[2] == e[1] and e[0].output in p[4] and p[3] in (None, (0, 0)) and \
                        e[6] is None:
                    step.append(pk)
            if cur is not None and follows(cur[-1][-1], kj):
                cur.append(step)
            else:
                cur = runs[kj[0]] = [step]
            i += len(step)
        out = {}
        for k, run in runs.items():
            while run and run[-1][-1][1] != len(prog[run[-1][-1][0]].ops) - 1:
                run = run[:-1]  # it ends with its last group
            if len(run) >= 2:
                out[k] = run
        self._banded[id(prog)] = (prog, out)
        return out

    def _band_plan(self, prog: list, run: list, shapes, n: int):
        """(the run's kept kernel and geometry, the chain's plan at this input) for a run of
        `_band_runs`' steps, or None where the chain does not take it (the ops then run one by
        one). Asked before its first group's entries run."""
        entry = lambda kj: prog[kj[0]].ops[kj[1]]  # noqa: E731
        key = ("bands", tuple(kj for st in run for kj in st))
        grp0 = prog[run[0][0][0]]
        kept = grp0.__dict__.setdefault("kernels", {}).get(key)
        if kept is None or kept[0] != self.weights.version:
            steps = [[entry(kj) for kj in st] for st in run]
            chain = self.weights.plain([[e[0] for e in st] for st in steps])
            pads = tuple(_chain_padding(st[0]) for st in steps)
            bands = tuple((b[0][2][1] - b[0][2][0], a[-1][1][0] - b[0][2][0])
                          for a, b in zip(steps, steps[1:]))
            frees = tuple(t for st in steps for e in st for t in e[4])
            kept = grp0.kernels[key] = (self.weights.version, chain, pads, bands, frees, steps)
        chain, pads, bands, steps = kept[1], kept[2], kept[3], kept[5]
        if chain is None:
            return None
        first = steps[0][0]
        x_shape = (n, first[2][1] - first[2][0]) + tuple(shapes[first[0].input][1:])
        plan = chain.prepare(x_shape, pads, bands)
        return None if plan is None else (kept, plan)

    def _run_bands(self, prog: list, run: list, band, have, n: int) -> int:
        """A run of `_band_runs`' steps as one PlainChain on this rank's bands (`band`:
        `_band_plan`'s): the first step reads its input band (fetched already), each later
        group's exchange sends this rank's edge rows from the zero-bordered map the step
        before wrote and receives the neighbours' into its rows above and below them
        (straight in where they are one run of memory: one image's rows, else through a
        buffer), then the step. Returns how many entries it ran."""
        (_, chain, _, _, frees, steps), plan = band
        first = steps[0][0]
        chain.start(plan, have[first[0].input].rows(*first[2]))
        tracer = self.comm.tracer
        for i, (st, kjs) in enumerate(zip(steps, run)):
            grp = prog[kjs[0][0]]
            if i and kjs[0][1] == 0 and (grp.sends or grp.recvs):  # the halo, into the map
                self._halo_into(grp, chain.input_rows(plan, i), st[0][2][0])
            with tracer.span(grp.name if len(kjs) == 1 else f"{grp.name}+", "compute"):
                chain.step(plan, i)
        last = steps[-1][-1]
        have[last[0].output] = Band(last[1][0], chain.finish(plan))
        for t in frees:
            if t in have and t != last[0].output:
                del have[t]
        return sum(len(st) for st in steps)

    def _halo_into(self, grp: "_Group", band: np.ndarray, lo: int) -> None:
        """The group's exchange (`_fetch`'s messages) with this rank's rows of the tensor
        sent from `band` (rows [lo, ...) of it, [N, rows, W, C], a view of a zero-bordered
        map) and the neighbours' received into it."""
        def view(s0, s1):
            return band[:, s0 - lo:s1 - lo]
        sends = {p: (view(*xs[0][1:]).reshape(-1) if len(xs) == 1 and
                     view(*xs[0][1:]).flags.c_contiguous else
                     np.concatenate([view(s0, s1).ravel() for _, s0, s1 in xs]))
                 for p, xs in grp.sends.items()}
        recvs, later = {}, []
        for p, xs in grp.recvs.items():
            if len(xs) == 1 and view(*xs[0][1:]).flags.c_contiguous:
                recvs[p] = view(*xs[0][1:]).reshape(-1)  # a view: straight into the map
            else:
                recvs[p] = np.empty(sum(view(s0, s1).size for _, s0, s1 in xs), np.float32)
                later.append((recvs[p], xs))
        self.comm.exchange(sends, recvs)
        for buf, xs in later:
            at = 0
            for _, s0, s1 in xs:
                v = view(s0, s1)
                v[...] = buf[at:at + v.size].reshape(v.shape)
                at += v.size

    def _fusions(self, grp: "_Group", taps: dict | None) -> dict[int, int]:
        """{position in grp.ops: its length} of each MobileNetV2 inverted-residual block
        (hepti.model.cnn `inverted_block`) this rank can run as one kernel: its ops next to
        each other in the group's sequence, each with rows to make, the block's inner maps
        read by the next op alone (let go at it, not widened for a later group, not tapped),
        and each op's input rows the previous op's output rows. Elsewhere (the ops in
        different groups, a split by channels, one op's rows none) the ops run one by one."""
        if not hasattr(grp, "fused"):
            out, ops, j = {}, grp.ops, 0
            while j < len(ops):
                for k in (3, 2):
                    run = ops[j:j + k]
                    if len(run) == k and inverted_block([e[0] for e in run]) and all(
                            e[1] is not None and e[5] is None for e in run) and all(
                            a[6] is None and a[0].output in b[4] and b[2] == a[1]
                            for a, b in zip(run, run[1:])):
                        out[j] = k
                        j += k - 1
                        break
                j += 1
            grp.fused = out
        if not taps:
            return grp.fused
        return {j: k for j, k in grp.fused.items()
                if not any(e[0].output in taps for e in grp.ops[j:j + k - 1])}

    def _chains(self, grp: "_Group", taps: dict | None) -> dict[int, list[tuple[int, int]]]:
        """{position in grp.ops: [(position, length) of each block]} of each run of
        `_fusions`' blocks that hepti.kernels.inverted_chain runs as one call: each block
        next to the one before in the sequence, reading its output rows as they are, that
        output read by this block alone (not widened, not tapped) and let go in it; each
        block's residual, if any, its own input; no streamed weights. A block on its own is
        a run of one."""
        if not taps and hasattr(grp, "chains"):
            return grp.chains
        fused, ops = self._fusions(grp, taps), grp.ops
        out, cur = {}, None
        for j in sorted(fused):
            k = fused[j]
            run = ops[j:j + k]
            ok = run[-1][0].residual in (None, run[0][0].input) and \
                (run[-1][0].residual is None or
                 run[0][2][0] <= run[-1][1][0] and run[-1][1][1] <= run[0][2][1]) and \
                not any(self.weights.streams(e[0].name) for e in run)
            if ok and cur is not None and cur[-1][0] + cur[-1][1] == j:
                last = ops[j - 1]
                t = last[0].output
                if run[0][0].input == t and run[0][2] == last[1] and last[6] is None and \
                        any(t in e[4] for e in run) and not (taps and t in taps):
                    cur.append((j, k))
                    continue
            cur = [(j, k)] if ok else None
            out[j] = cur if ok else [(j, k)]
        if not taps:
            grp.chains = out
        return out

    def _run_chain(self, grp: "_Group", blocks, have, shapes, taps) -> int:
        """A run of blocks (`_chains`) as one kernel call (an InvertedChain on their
        weights): the last block's rows, as `_run_fused` on each in turn would make them.
        Returns how many of the group's next entries it ran."""
        at = (blocks[0][0], blocks[-1][0])  # (taps may end a run sooner)
        kept = grp.__dict__.setdefault("kernels", {}).get(at)
        if kept is None:  # what does not change from one forward to the next
            runs = [grp.ops[j:j + k] for j, k in blocks]
            dws = [run[-2] for run in runs]
            kept = grp.kernels[at] = [
                None, None, runs,
                tuple(None if run[-1][0].residual is None else run[-1][1][0] - run[0][2][0]
                      for run in runs),
                tuple(d[0].stride for d in dws),
                tuple(d[3] if d[3] is not None else (d[0].padding, d[0].padding) for d in dws),
                tuple(t for run in runs for e in run for t in e[4])]
        version, chain, runs, res_rows, strides, pads, frees = kept
        if len(runs) == 1:
            return self._run_fused(runs[0], have, shapes, taps)
        x = have[runs[0][0][0].input].rows(*runs[0][0][2])
        if version != self.weights.version:  # a conv's entry was made or let go since
            chain = self.weights.chain([[e[0] for e in run] for run in runs])
            kept[0], kept[1] = self.weights.version, chain  # (Weights.chain checks each op's:
        last = runs[-1][-1]  # ~10 us hot, 20-40 in a forward)
        p = last[0]
        alloc, r, out, buf = last[6], last[1], None, None
        if alloc is not None and x.shape[0] == 1:  # room for the halos to come
            buf = np.empty((1, alloc[1] - alloc[0]) + tuple(shapes[p.output][1:]), np.float32)
            out = buf[:, r[0] - alloc[0]:r[1] - alloc[0]]
        y = chain(np.ascontiguousarray(x), strides, pads, res_rows, out=out)
        return self._landed(runs, Band(r[0], y) if buf is None else Band(r[0], y, alloc[0], buf),
                            frees, have, taps)

    @staticmethod
    def _landed(runs, band: Band, frees, have, taps) -> int:
        """A run of ops made in one call (`_run_chain`, `_run_bottlenecks`, `_run_pooled`): its
        last op's output put in `have` (and in `taps` if asked), the maps its ops let go
        dropped; how many of the group's entries after the run's first it ran."""
        name = runs[-1][-1][0].output
        have[name] = band
        if taps is not None and name in taps:
            taps[name] = band.x
        for t in frees:
            if t in have:
                del have[t]
        return sum(len(run) for run in runs) - 1

    def _bottlenecks(self, grp: "_Group", taps: dict | None) -> dict[int, list]:
        """{position in grp.ops: [(position, length) of each block]} of each run of ResNet
        bottleneck blocks (hepti.model.cnn `bottleneck_block`) that
        hepti.kernels.bottleneck_chain runs as one call: each block's ops next to each other
        in the group's sequence, every row of each made here (a group of one rank), each
        inner map (the downsample's, conv1's, conv2's) let go in the block and not tapped,
        no streamed weights; each block reading the previous one's output, let go in it and
        not tapped; every convolution's output channels whole panels (`fused_cout`: else
        the chain would decline it at every size). (On one rank: `forward` asks only then.)"""
        if not taps and hasattr(grp, "bottlenecks"):
            return grp.bottlenecks
        ops, out, cur, j = grp.ops, {}, None, 0
        tapped = set(taps or ())
        while j < len(ops):
            k = next((k for k in (4, 3) if j + k <= len(ops) and
                      self._bottleneck_at(ops[j:j + k], tapped)), 0)
            if not k:
                cur, j = None, j + 1
                continue
            if cur is not None and cur[-1][0] + cur[-1][1] == j:
                last, run = ops[j - 1], ops[j:j + k]
                t = last[0].output
                if run[-3][0].input == t and run[-3][2] == last[1] and t not in tapped and \
                        any(t in e[4] for e in run):
                    cur.append((j, k))
                    j += k
                    continue
            cur = out[j] = [(j, k)]
            j += k
        if not taps:
            grp.bottlenecks = out
        return out

    def _bottleneck_at(self, run, tapped) -> bool:
        """Whether grp.ops entries `run` are one block `_bottlenecks` may chain."""
        if not bottleneck_block([e[0] for e in run]) or any(
                e[1] is None or e[5] is not None or e[6] is not None or
                self.weights.streams(e[0].name) or not fused_cout(e[0].cout) for e in run):
            return False
        *ds, c1, c2, c3 = run
        inner = [c1, c2] + ds
        return (c2[2] == c1[1] and c3[2] == c2[1] and all(e[1] == c3[1] for e in ds)
                and all(e[2][0] == c1[2][0] and e[2][1] <= c1[2][1] for e in ds)
                and c1[0].output in c2[4] and c2[0].output in c3[4]
                and all(e[0].output in c3[4] for e in ds)
                and not any(e[0].output in tapped for e in inner))

    def _run_bottlenecks(self, grp: "_Group", blocks, have, taps) -> int:
        """A run of bottleneck blocks (`_bottlenecks`) as one kernel call (a
        BottleneckChain on their weights): the last block's output, as the ops one by one
        would make it. Returns how many of the group's next entries it ran, 0 where the
        chain does not take this input (the ops then run one by one)."""
        return self._run_whole(  # each conv2's padding; the input is conv1's (a downsample at
            grp, "bottlenecks", blocks, have, taps, self.weights.bottlenecks,  # stride 2 reads
            lambda run: run[-2], lambda runs: runs[0][-3], threads=self.threads)  # fewer rows)

    def _run_whole(self, grp: "_Group", kind: str, blocks, have, taps, make, padded, reads,
                   **kw) -> int:
        """A run of blocks ([(position, length)] in grp.ops) as one kernel call: `make(ops of
        each block)` the chain on their weights (None: it takes none), `padded(block's
        entries)` the entry whose padding each block's chain step takes, `reads(blocks'
        entries)` the entry whose input rows it reads; chain(x, pads, **kw) the last block's
        output, or None where it does not take x. Returns how many of the group's next
        entries it ran, 0 where it ran nothing (the ops then run one by one). What does not
        change between forwards is kept per group, while the weights' version holds."""
        key = (kind, tuple(blocks))  # (taps may end a run sooner)
        kept = grp.__dict__.setdefault("kernels", {}).get(key)
        if kept is None or kept[0] != self.weights.version:
            runs = [grp.ops[j:j + k] for j, k in blocks]
            chain = make([[e[0] for e in run] for run in runs])
            pads = tuple(_chain_padding(padded(run)) for run in runs)
            frees = tuple(t for run in runs for e in run for t in e[4])
            kept = grp.kernels[key] = (self.weights.version, chain, pads, runs, frees)
        _, chain, pads, runs, frees = kept
        if chain is None:
            return 0
        first = reads(runs)
        y = chain(np.ascontiguousarray(have[first[0].input].rows(*first[2])), pads, **kw)
        if y is None:
            return 0
        return self._landed(runs, Band(runs[-1][-1][1][0], y), frees, have, taps)

    def _plains(self, grp: "_Group", taps: dict | None) -> dict[int, list]:
        """{position in grp.ops: [(position, length) of each step]} of each run of two or
        more `plain_step`s (hepti.model.cnn: a convolution, and the max pool of its output
        after it) that hepti.kernels.plain_chain runs as one call: every row of each op made
        here (a group of one rank), none split by channels or widened for a later group, no
        streamed weights; each step reading the one before's output, let go in it and not
        tapped. (On one rank and thread: `forward` asks only then.)"""
        if not taps and hasattr(grp, "plains"):
            return grp.plains
        ops, out, cur, j = grp.ops, {}, None, 0
        tapped = set(taps or ())

        def fits(run):
            return plain_step([e[0] for e in run]) and all(
                e[1] is not None and e[5] is None and e[6] is None for e in run) and \
                not self.weights.streams(run[0][0].name) and (
                    len(run) == 1 or (run[0][0].output in run[1][4] and
                                      run[1][2] == run[0][1] and run[1][3] in (None, (0, 0))
                                      and run[0][0].output not in tapped))
        while j < len(ops):
            k = next((k for k in (2, 1) if j + k <= len(ops) and fits(ops[j:j + k])), 0)
            if not k:
                cur, j = None, j + 1
                continue
            if cur is not None and cur[-1][0] + cur[-1][1] == j:
                last = ops[j - 1]
                t = last[0].output
                if ops[j][0].input == t and ops[j][2] == last[1] and t in ops[j][4] and \
                        t not in tapped:
                    cur.append((j, k))
                    j += k
                    continue
            cur = out[j] = [(j, k)]
            j += k
        out = {j: run for j, run in out.items() if len(run) >= 2}
        if not taps:
            grp.plains = out
        return out

    def _run_plain(self, grp: "_Group", steps, have, taps) -> int:
        """A run of plain steps (`_plains`) as one kernel call (a PlainChain on their
        weights): the last step's output, as the ops one by one would make it. Returns how
        many of the group's next entries it ran, 0 where the chain does not take this input
        (the ops then run one by one)."""
        return self._run_whole(grp, "plains", steps, have, taps, self.weights.plain,
                               lambda run: run[0], lambda runs: runs[0][0])

    def _pairs(self, grp: "_Group", taps: dict | None) -> tuple:
        """The positions in grp.ops of each op whose output the next op alone reads, the two
        `pairable` (hepti.model.cnn), both with every row to make (a group of one rank: no
        halo), its output not tapped: where `_run_pair` may write it straight into the
        zero-bordered map the next op reads (`bordered_pair` decides, per input shape). A
        position inside a run of inverted blocks never comes up: `forward` steps past the
        entries a run made."""
        return _adjacent(grp, "pairs", lambda a, b: pairable(a[0], b[0]), taps)

    def _pooled(self, grp: "_Group", taps: dict | None) -> tuple:
        """The positions in grp.ops of each convolution whose output a max pool right after
        it alone reads, the two `poolable` (hepti.model.cnn), both with every row to make (a
        group of one rank), the convolution's weights resident and its output not tapped:
        `_run_pooled` makes the pool from the convolution's rows as they are made."""
        return _adjacent(grp, "pooled", lambda a, b: poolable(a[0], b[0]) and b[6] is None
                         and not self.weights.streams(a[0].name), taps)

    def _run_pooled(self, run, have, taps) -> None:
        """A convolution and the max pool after it (`_pooled`) as hepti.model.cnn
        `apply_pooled`: the pool's output, as `apply` on each would make it."""
        (a, _, (i0, i1), pad_a, frees_a, _, _), (b, rb, _, pad_b, frees_b, _, _) = run
        y = apply_pooled(a, b, np.ascontiguousarray(have[a.input].rows(i0, i1)), self.weights,
                         pad_a, pad_b, self.threads)
        self._landed([run], Band(rb[0], y), frees_a + frees_b, have, taps)

    def _run_pair(self, run, have, shapes, n: int, taps) -> bool:
        """Two convolutions of `_pairs` as hepti.model.cnn `apply_pair` (the second's output
        as `apply` on each would make it), when `bordered_pair` finds them such; False (and
        nothing run) otherwise."""
        (a, ra, (i0, i1), _, frees_a, _, _), (b, rb, _, pad, frees_b, _, alloc) = run
        self.weights.fetch(a.name)
        self.weights.fetch(b.name)
        x_shape = (n, ra[1] - ra[0]) + tuple(shapes[a.output][1:])
        extent = bordered_pair(a, b, x_shape, self.weights, pad, self.threads)
        if extent is None:
            return False
        x = have[a.input].rows(i0, i1)
        res = have[b.residual].rows(*rb) if b.residual is not None else None
        y = apply_pair(a, b, np.ascontiguousarray(x), self.weights, extent, pad,
                       None if res is None else np.ascontiguousarray(res), self.threads)
        self.weights.drop(a.name)
        self.weights.drop(b.name)
        if alloc is not None and n == 1:  # room for the halos to come
            buf = np.empty((1, alloc[1] - alloc[0]) + tuple(shapes[b.output][1:]), np.float32)
            buf[:, rb[0] - alloc[0]:rb[1] - alloc[0]] = y
            have[b.output] = Band(rb[0], buf[:, rb[0] - alloc[0]:rb[1] - alloc[0]], alloc[0],
                                  buf)
        else:
            have[b.output] = Band(rb[0], y)
        if taps is not None and b.output in taps:
            taps[b.output] = have[b.output].x
        for t in frees_a + frees_b:
            if t in have:
                del have[t]
        return True

    def _run_fused(self, run, have, shapes, taps) -> int:
        """One inverted-residual block (`_fusions`) on this rank's bands: the project's rows,
        from the expand's input rows, as `apply` on each op would make them. Returns how many
        of the group's next entries it ran (len(run) - 1)."""
        ops = [e[0] for e in run]
        first, dw, last = run[0], run[-2], run[-1]
        x = have[ops[0].input].rows(*first[2])
        res = have[ops[-1].residual].rows(*last[1]) if ops[-1].residual is not None else None
        alloc, r, out, buf = last[6], last[1], None, None
        if alloc is not None and x.shape[0] == 1:  # room for the halos to come
            buf = np.empty((1, alloc[1] - alloc[0]) + tuple(shapes[ops[-1].output][1:]),
                           np.float32)
            out = buf[:, r[0] - alloc[0]:r[1] - alloc[0]]
        for op in ops:
            self.weights.fetch(op.name)  # a streamed conv's, else nothing
        y = apply_inverted(ops, np.ascontiguousarray(x), self.weights,
                           None if res is None else np.ascontiguousarray(res), pad=dw[3],
                           out=out)
        for op in ops:
            self.weights.drop(op.name)
        have[ops[-1].output] = Band(r[0], y) if buf is None else Band(r[0], y, alloc[0], buf)
        if taps is not None and ops[-1].output in taps:
            taps[ops[-1].output] = y
        for e in run:
            for t in e[4]:
                if t in have:
                    del have[t]
        return len(run) - 1

    def _by_channels(self, op, chan, have, shapes, n) -> np.ndarray:
        """This rank's output channels [c0, c1) of op over the whole map, from the whole
        input (its channels [i0, i1) of it), then every rank's, allgathered: the whole map.
        Each rank sends its channels as they are ([N, H, W, c1 - c0], contiguous) and every
        rank lays the pieces side by side into the map (`lay_out_channels`, one copy, which
        the cost model charges). It used to transpose each piece to channels-first to gather
        it and the whole map back: two copies, 4x slower than this one for ResNet's 1024 and
        2048 channels (power-of-two strides), about 1 ms an op on a 0.45-core device."""
        c0, c1, i0, i1, per_rank = chan
        hh, ww, c = shapes[op.output]
        with self.comm.tracer.span(f"{op.name} (channels {c0}-{c1})", "compute"):
            if c1 > c0:
                x = have[op.input].x
                if (i0, i1) != (0, x.shape[3]):
                    x = x[..., i0:i1]
                res = have[op.residual].x[..., c0:c1] if op.residual is not None else None
                self.weights.fetch(op.name)
                y = apply(op, np.ascontiguousarray(x), self.weights,
                          None if res is None else np.ascontiguousarray(res),
                          threads=self.threads)
                self.weights.drop(op.name)
                y = y.reshape(-1)
            else:
                y = np.empty(0, np.float32)
        flat = self.comm.allgather_rows(y, [n * hh * ww * k for k in per_rank])
        with self.comm.tracer.span(f"{op.name} (channels laid out)", "compute"):
            return lay_out_channels(flat, per_rank, (n, hh, ww, c))

    def _fetch(self, grp: "_Group", have, shapes, n):
        """The group's inputs: every rank's missing rows, from the ranks that own them, in
        one exchange (one message per peer: the pieces side by side, in the order both
        ends worked out in `program`); then the bands this rank widens."""
        def piece(t, s0, s1):
            return (n, s1 - s0) + tuple(shapes[t][1:])
        send_flat = {p: np.concatenate([have[t].rows(s0, s1).ravel() for t, s0, s1 in xs])
                     for p, xs in grp.sends.items()}
        recv_flat = {p: np.empty(sum(math.prod(piece(*x)) for x in xs), np.float32)
                     for p, xs in grp.recvs.items()}
        self.comm.exchange(send_flat, recv_flat)
        got: dict[str, list] = {}
        for p, xs in grp.recvs.items():
            at = 0
            for t, s0, s1 in xs:
                shape = piece(t, s0, s1)
                size = math.prod(shape)
                got.setdefault(t, []).append((s0, recv_flat[p][at:at + size].reshape(shape)))
                at += size
        for t, lo, hi in grp.widen:
            old = have.get(t)
            wide = old.widened(lo, hi) if old is not None else None
            if wide is None:  # a new band, the rows held copied in
                wide = Band(lo, np.empty(piece(t, lo, hi), np.float32))
                if old is not None:
                    a, b = max(lo, old.lo), min(hi, old.hi)
                    if b > a:
                        wide.x[:, a - lo:b - lo] = old.rows(a, b)
            for s0, buf in got.get(t, ()):
                wide.x[:, s0 - lo:s0 - lo + buf.shape[1]] = buf
            have[t] = wide

    def _free(self, have, tensors, step: int):
        """Let go of the tensors (of those given) whose last reader was step `step`."""
        for t in tensors:
            if t is not None and self.last.get(t) == step and t in have:
                del have[t]

    def _tail(self, have, shapes, n, step: int, running):
        """Pooling and the linear head, each result held in `have` under its tensor's name
        (so that a counter sees it) until its reader has run."""
        g, rank = self.graph, self.comm.rank
        for op in g.ops[self.n_spatial:]:
            running[0] = op.name
            x = self._tail_op(op, have, shapes, n)
            if x is None:
                return None  # rank 0 runs the head alone
            have[op.output] = x
            self._free(have, (op.input,), step)
            step += 1
        return np.ascontiguousarray(have[g.output]) if rank == 0 else None

    def _tail_op(self, op, have, shapes, n):
        """One op after the spatial part; None on a rank a head on rank 0 alone leaves out."""
        comm, rank = self.comm, self.comm.rank
        if op.kind == ADAPTIVE_AVG:
            hh, ww, c = shapes[op.input]
            mine = owned(hh, self.owners[op.input], comm.size)
            lo, hi = mine[rank]
            band = have.get(op.input)
            if comm.size == 1:  # a group of one holds the whole map: the kernel pools it
                return apply(op, band.x, self.weights, threads=self.threads)
            if op.out_hw == (1, 1):  # partial sums of own rows, summed across ranks
                return pooled_sum(comm, band.rows(lo, hi) if hi > lo else None, n, c,
                                  [o1 > o0 for o0, o1 in mine]) / np.float32(hh * ww)
            # a grid pool reads the whole map
            c_rows = [o1 - o0 for o0, o1 in mine]
            mine = band.rows(lo, hi) if hi > lo else np.empty((n, 0, ww, c), np.float32)
            full = comm.allgather_rows(np.ascontiguousarray(mine.transpose(1, 0, 2, 3)),
                                       c_rows)  # may be a shared window's: copied
            return adaptive_avg_pool(full.transpose(1, 0, 2, 3).copy(), op.out_hw)
        if op.kind == LINEAR:
            if self.split.head == "primary" and rank != 0:
                return None
            x = np.ascontiguousarray(have[op.input].reshape(n, -1), np.float32)
            if self.split.head == "primary" or comm.size == 1:
                return apply(op, x, self.weights, threads=self.threads)
            cols = counts(op.cout, self.split.ratios)
            y = apply(op, x, self.weights, threads=self.threads) if cols[rank] else \
                np.empty((n, 0), np.float32)
            return comm.allgather_rows(np.ascontiguousarray(y.T), cols).T.copy()
        raise ValueError(f"{op.name}: a {op.kind} op after the spatial part")

    # --- the memory model of what this rank holds ----------------------------------------
    def rank_dag(self, h: int, w: int, n: int, rank: int):
        """(OpDag, order): `rank`'s part of a forward of n images of h x w as the memory
        model of operator order sees it, in the order `forward` runs it. Each feature map's
        bytes are the rows this rank holds of it. A map this rank makes and later widens is
        allocated with every row it will hold from the start (`program`'s `alloc`, batch 1);
        otherwise widening a band by the halo a group needs is an operator of its own (`halo
        <tensor> <k>`: it reads the band held and writes the wider one, so for a moment both
        are held, as in `_fetch`), and the group's ops read the wider band; a band received
        whole is such an operator with nothing to read.
        The vectors after pooling are whole (none on a rank a head on rank 0 alone leaves
        out). Message buffers are not in it, as they are not in the counter."""
        g = self.graph
        shapes, _ = self.schedule(h, w)
        tensors: dict[str, TensorInfo] = {}
        current: dict[str, str] = {}  # tensor -> the name of the band held now

        def band(name: str, t: str, r) -> str:
            s = shapes[t]
            rows = r[1] - r[0] if r is not None else 0
            tensors[name] = TensorInfo(F32 * n * rows * s[1] * s[2], (n, rows) + tuple(s[1:]))
            current[t] = name
            return name

        band(g.input, g.input, (0, h) if rank == 0 else None)
        ops, order = [], []
        roomy = set()  # tensors made in an allocation their halos are received into
        for k, grp in enumerate(self.program(h, w, rank)):
            for t, lo, hi in grp.widen:
                if t in roomy:  # no new band: the rows land beside the ones held
                    continue
                src = current[t]
                new = band(f"{t}@{k}", t, (lo, hi))
                name = f"halo {t} {k}"
                ops.append(OpNode(name, "halo", (src,), (new,)))
                order.append(name)
            for op, r, _, _, _, _, alloc in grp.ops:
                ins = (current[op.input],) + ((current[op.residual],) if op.residual else ())
                if alloc is not None and n == 1:
                    roomy.add(op.output)
                    r = alloc
                band(op.output, op.output, r)
                ops.append(OpNode(op.name, op.kind, ins, (op.output,)))
                order.append(op.name)
        alone = self.split.head == "primary" and self.comm.size > 1 and rank != 0
        for op in g.ops[self.n_spatial:]:
            size = F32 * n * math.prod(shapes[op.output])
            tensors[op.output] = TensorInfo(0 if alone and op.kind == LINEAR else size,
                                            (n,) + tuple(shapes[op.output]))
            ops.append(OpNode(op.name, op.kind, (current.get(op.input, op.input),),
                              (op.output,)))
            order.append(op.name)
        dag = OpDag(f"{g.config.arch} rank {rank}", ops, tensors, (g.input,), (g.output,),
                    0, n, {"source": "hepti.parallel.bands rank_dag", "input_hw": [h, w]})
        return dag, order
