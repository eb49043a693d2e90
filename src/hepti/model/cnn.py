"""A CNN's operators on the kernels: its packed weights (`Weights`, `CNNModel`) and one op on a
feature map (`apply`).

`apply` runs one op on a feature map, optionally on a band of its rows (`pad` says the band's
own top and bottom padding). The height-split executor (hepti.parallel.bands) runs every CNN,
on one process (a group of one: hepti.parallel.single `SingleCNN`) or many, so one and many
ranks share every line of arithmetic.
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from hepti.graph.cnn import (ADAPTIVE_AVG, CONV, LINEAR, MAXPOOL, Graph, build,
                             inverted_block)  # noqa: F401 (the band executor's, from here)
from hepti import kernels as K
from hepti.kernels.bottleneck_chain import BottleneckChain
from hepti.kernels.inverted import InvertedBlock, inverted_residual
from hepti.kernels.inverted_chain import InvertedChain
from hepti.kernels.plain_chain import PlainChain


class Weights:
    """A CNN's weights packed for the kernels: convs as ConvWeight, linears as PackedB (the
    stored [out, in]). `read(name, rows)` gives a stored tensor, or rows [lo, hi) of it;
    `head_rows` {linear op: (lo, hi)} reads only those output columns of a linear (a rank's
    share of a head split by columns; none when lo == hi); `conv_rows` likewise a conv's
    output channels (hepti.graph.split `conv_rows`: a rank's share of a channel split, or
    none where it computes no rows of the op). The convs in `streamed` are not loaded here:
    `fetch(name)` reads and packs one just before it runs, `drop(name)` lets it go after
    (`nbytes` is what stays resident; `streamed_bytes` the largest one fetched at a time)."""

    def __init__(self, graph: Graph, read, head_rows: dict | None = None,
                 conv_rows: dict | None = None, streamed: set | None = None):
        self.conv, self.linear, self.nbytes, self.streamed_bytes = {}, {}, 0, 0
        self._read, self._later = read, {}
        self.version = 0  # one more each time a conv's entry is made or let go (`_load`, `drop`)
        # `inverted`: a block's last op -> (its ops' names, their conv entries, InvertedBlock)
        self._blocks: dict = {}
        self._layers: dict = {}  # `layer`: a conv op's name -> (its conv entry, ConvLayer)
        # `chain`: its blocks' last ops' names -> (all their ops' names, conv entries, chain);
        # `bottlenecks` likewise
        self._chains: dict = {}
        self._bottlenecks: dict = {}
        self._plains: dict = {}  # `plain`: likewise, keyed by the convolutions alone
        for op in graph.ops:
            if op.kind == CONV:
                rows = (conv_rows or {}).get(op.name)
                if rows is not None and rows[1] <= rows[0]:
                    continue
                if streamed and op.name in streamed:
                    self._later[op.name] = (op, rows)
                    continue
                self.nbytes += self._load(op, rows)
            elif op.kind == LINEAR:
                rows = (head_rows or {}).get(op.name)
                if rows is not None and rows[1] <= rows[0]:
                    continue
                w, b = read(f"{op.name}.weight", rows), read(f"{op.name}.bias", rows)
                self.linear[op.name] = (K.pack_b(w, trans=True), b)
                self.nbytes += w.nbytes + b.nbytes

    def _load(self, op, rows) -> int:
        """Read and pack conv op's weight rows (all if None); its stored bytes."""
        whole = rows is None or rows == (0, op.cout)
        w = self._read(f"{op.name}.weight", None if whole else rows)
        b = self._read(f"{op.name}.bias", None if whole else rows)
        # a slice of a grouped conv holds whole groups (hepti.graph.split channel_unit)
        groups = op.groups if whole or op.groups == 1 else \
            (rows[1] - rows[0]) // (op.cout // op.groups)
        self.conv[op.name] = (K.pack_conv_weight(w, groups), b)
        self.version += 1
        return w.nbytes + b.nbytes

    def fetch(self, name: str) -> None:
        """A streamed conv's weights, read from the store and packed, until `drop`."""
        if name in self._later and name not in self.conv:
            self.streamed_bytes = max(self.streamed_bytes, self._load(*self._later[name]))

    def streams(self, name: str) -> bool:
        """Whether conv `name`'s weights are streamed (`fetch` before it runs)."""
        return name in self._later

    def drop(self, name: str) -> None:
        if name in self._later:
            self.conv.pop(name, None)
            self.version += 1
            self._layers.pop(name, None)
            for key in [k for k, v in self._blocks.items() if name in v[0]]:
                del self._blocks[key]  # nor held by a block's kernel

    def layer(self, op) -> K.ConvLayer:
        """Conv op's `ConvLayer` on its weights, made once and kept while they are the ones
        loaded (as `inverted`'s blocks)."""
        entry, hit = self.conv[op.name], self._layers.get(op.name)
        if hit is not None and hit[0] is entry:
            return hit[1]
        layer = K.ConvLayer(entry[0], entry[1], op.stride, op.dilation, op.act or None)
        self._layers[op.name] = (entry, layer)
        return layer

    def inverted(self, ops) -> InvertedBlock:
        """The kernel of an `inverted_block`'s ops on their weights, made once and kept while
        those weights are the ones loaded (a streamed conv's are packed anew on each fetch:
        its block is then made again, and `drop` lets it go)."""
        conv, hit = self.conv, self._blocks.get(ops[-1].name)
        if hit is not None:
            for op, part in zip(ops, hit[1]):
                if conv[op.name] is not part:
                    break
            else:
                return hit[2]
        parts = tuple(conv[op.name] for op in ops)
        we, be = parts[0] if len(ops) == 3 else (None, None)
        block = InvertedBlock(we, be, *parts[-2], *parts[-1])
        self._blocks[ops[-1].name] = (tuple(op.name for op in ops), parts, block)
        return block

    def chain(self, runs) -> InvertedChain:
        """The kernel of consecutive `inverted_block`s (runs: each block's ops), on their
        weights (not streamed ones), made once and kept while its blocks are `inverted`'s.
        The chain holds the blocks' weights in one buffer; the ConvWeights they came from
        take its views of them too, so that they are held once."""
        hit = self._kept(self._chains, runs)  # (17 `inverted` calls: ~35 us a forward)
        if hit is not False:
            return hit
        blocks = [self.inverted(ops) for ops in runs]
        chain = InvertedChain(blocks)
        for ops, block in zip(runs, blocks):
            *e, d, p = ops
            if e:
                self.conv[e[0].name][0].panels = block.we
            self.conv[d.name][0].taps = block.taps
            self.conv[p.name][0].panels = block.wp
        return self._keep(self._chains, runs, chain)

    def _kept(self, kept: dict, runs):
        """The kernel `_keep` kept in `kept` for these runs of blocks while every op's conv
        entry is still the one it was made on; False where there is none (or it is stale)."""
        hit = kept.get(tuple(ops[-1].name for ops in runs))
        if hit is not None and all(map(operator.is_, map(self.conv.get, hit[0]), hit[1])):
            return hit[2]
        return False

    def _keep(self, kept: dict, runs, kernel):
        """kernel, kept in `kept` with the conv entries of runs' ops it was made on."""
        names = tuple(op.name for ops in runs for op in ops)
        kept[tuple(ops[-1].name for ops in runs)] = (names, tuple(self.conv[n] for n in names),
                                                      kernel)
        return kernel

    def bottlenecks(self, runs) -> BottleneckChain | None:
        """The kernel of consecutive `bottleneck_block`s (runs: each block's ops), on their
        weights (not streamed ones), made once and kept while every op's conv entry is the one
        it was made on. The chain holds the convolutions' panels in one buffer; their
        ConvWeights take its views of them, so that they are held once. None where `layer`
        gives something else than ConvLayers (a test's stand-in): run the ops one by one."""
        hit = self._kept(self._bottlenecks, runs)
        if hit is not False:
            return hit
        blocks = [((self.layer(ops[0]),) if len(ops) == 4 else (None,)) +
                  tuple(self.layer(op) for op in ops[-3:]) for ops in runs]
        if not all(isinstance(c, K.ConvLayer) for blk in blocks for c in blk if c is not None):
            return None
        return self._keep(self._bottlenecks, runs, BottleneckChain(blocks))


    def plain(self, runs) -> PlainChain | None:
        """The kernel of a run of `plain_step`s (runs: each step's ops, a convolution and
        the max pool after it, if any), on their weights (not streamed ones), made once and
        kept while every convolution's entry is the one it was made on. None where `layer`
        gives something else than ConvLayers (a test's stand-in): run the ops one by one."""
        convs = [ops[:1] for ops in runs]
        hit = self._kept(self._plains, convs)
        if hit is not False:
            return hit
        steps = [(self.layer(ops[0]), ops[1].kernel if len(ops) == 2 else 0) for ops in runs]
        if not all(isinstance(layer, K.ConvLayer) and PlainChain.takes(layer, pool)
                   for layer, pool in steps):
            return None
        return self._keep(self._plains, convs, PlainChain(steps))


def tensors_reader(tensors: dict):
    """`Weights`' read over a dict of arrays."""
    return lambda name, rows: tensors[name] if rows is None else tensors[name][rows[0]:rows[1]]


def apply(op, x: np.ndarray, weights: Weights, residual: np.ndarray | None = None,
          pad: tuple[int, int] | None = None, threads: int = 1,
          out: np.ndarray | None = None) -> np.ndarray:
    """One op on x [N, H, W, C] (a vector op: x [N, C]). `pad` (top, bottom) replaces the op's
    own vertical padding: x is then a band of rows, and so is the result. `out`: where a
    convolution or a max pool writes its result (C-contiguous), else a new array."""
    if op.kind in (CONV, MAXPOOL):
        top, bottom = (op.padding, op.padding) if pad is None else pad
        padding = (top, bottom, op.padding, op.padding)
        if op.kind == MAXPOOL:
            return K.max_pool2d(x, op.kernel, op.stride, padding, out=out)
        return weights.layer(op)(x, padding, residual, out, threads)
    if out is not None:
        raise ValueError(f"{op.name}: a {op.kind} op makes a new array; out= is for "
                         "convolutions and max pools")
    if op.kind == ADAPTIVE_AVG:
        if op.out_hw == (1, 1):
            return K.global_avg_pool(x)
        return adaptive_avg_pool(x, op.out_hw)
    if op.kind == LINEAR:
        pb, bias = weights.linear[op.name]
        y = K.gemm(np.ascontiguousarray(x.reshape(x.shape[0], -1)), pb, bias, threads=threads)
        return K.relu(y, out=y) if op.act == "relu" else y
    raise ValueError(f"{op.name}: unknown op kind {op.kind!r}")


def apply_inverted(ops, x: np.ndarray, weights: Weights, residual: np.ndarray | None = None,
                   pad: tuple[int, int] | None = None, out: np.ndarray | None = None
                   ) -> np.ndarray:
    """An `inverted_block`'s ops on x as one kernel (hepti.kernels.inverted): the project's
    output, what `apply` on each op in turn makes. `pad`: the depthwise's (top, bottom), x
    then the band of input rows that the project's output rows read (as `apply`'s)."""
    d = ops[-2]
    return weights.inverted(ops)(x, d.stride, (d.padding, d.padding) if pad is None else pad,
                                 residual, out)


def pairable(first, second) -> bool:
    """Whether second may read first's output from a zero-bordered map first writes
    (`bordered_pair` says whether it does, for an input's shape): first a 1x1 at stride 1
    without padding or residual, second a convolution (not depthwise) reading its output."""
    return (first.kind == CONV == second.kind and second.input == first.output
            and first.kernel == 1 and first.stride == 1 and first.padding == 0
            and first.dilation == 1 and first.groups == 1 and first.residual is None
            and not second.depthwise and second.residual != first.output)


def bordered_pair(first, second, x_shape: tuple, weights: Weights, pad: tuple[int, int],
                  threads: int = 1) -> tuple | None:
    """Whether `apply_pair` can run first then second (reading first's output, x_shape) with
    no copy between them: `pairable`, and second reads a zero-bordered copy of its input
    (hepti.kernels.conv `_MODE_PADDED`); the extent of that map (`ConvLayer.border`), else
    None. pad: second's (top, bottom), as `apply`'s."""
    if not pairable(first, second):
        return None
    return weights.layer(second).border(x_shape, pad + (second.padding, second.padding),
                                        threads)


def apply_pair(first, second, x: np.ndarray, weights: Weights, extent: tuple,
               pad: tuple[int, int], residual: np.ndarray | None = None,
               threads: int = 1) -> np.ndarray:
    """`apply` of first on x, then of second (pad its (top, bottom)) on that, as
    `bordered_pair` found them: first writes its output into the interior of the
    zero-bordered map second reads in place (`ConvLayer.into`, `ConvLayer.bordered`), and
    second's copy of it into one goes (ResNet-50's 1x1 before a 3x3 on a 28-, 14- or 7-wide
    map or at stride 2: 13 copies, 0.4 MB to 1.6 MB each at 224)."""
    padding = pad + (second.padding, second.padding)
    if threads == 1:  # both in one kernel call
        y = weights.layer(first).pair(weights.layer(second), x, extent, padding, residual)
        if y is not None:
            return y
    xp = weights.layer(first).into(x, extent, threads, reuse=True)  # let go below
    if xp is None:  # not a plain 1x1 after all: one after the other
        return apply(second, apply(first, x, weights, threads=threads), weights, residual,
                     pad, threads)
    x_shape = x.shape[:3] + (first.cout,)
    return weights.layer(second).bordered(xp, x_shape, padding, residual, threads)


def poolable(conv, pool) -> bool:
    """Whether `apply_pooled` may make pool (a max pool) from conv's rows: conv a dense
    convolution without residual, pool reading its output."""
    return (conv.kind == CONV and pool.kind == MAXPOOL and pool.input == conv.output
            and not conv.depthwise and conv.groups == 1 and conv.residual is None)


def apply_pooled(conv, pool, x: np.ndarray, weights: Weights,
                 pad: tuple[int, int] | None = None,
                 pool_pad: tuple[int, int] | None = None, threads: int = 1) -> np.ndarray:
    """`apply` of conv on x, then of pool on that (each pad as `apply`'s), `poolable`: one
    kernel call where `ConvLayer.pooled` takes them (each pool row made while the conv rows it
    reads are in L2: VGG-16's five pools, ResNet-50's after its stem), else the two."""
    layer = weights.layer(conv)
    if isinstance(layer, K.ConvLayer):
        top, bottom = (conv.padding, conv.padding) if pad is None else pad
        p_top, p_bottom = (pool.padding, pool.padding) if pool_pad is None else pool_pad
        y = layer.pooled(x, (top, bottom, conv.padding, conv.padding), pool.kernel,
                         pool.stride, (p_top, p_bottom, pool.padding, pool.padding), threads)
        if y is not None:
            return y
    return apply(pool, apply(conv, x, weights, pad=pad, threads=threads), weights,
                 pad=pool_pad)


def plain_step(ops) -> bool:
    """Whether `ops` (1 or 2 consecutive ops) are one step of a run that
    hepti.kernels.plain_chain runs as one call: a dense convolution wider than 1x1 without
    residual (1 group), then, if two, a max pool of its output alone at a stride of its
    kernel without padding (`poolable`; VGG-16's 3x3s and their 2x2 pools). Not a 1x1: those
    read their input flat in place, and ResNet's and MobileNetV2's run in their own chains."""
    if not ops or len(ops) > 2:
        return False
    conv = ops[0]
    if not (conv.kind == CONV and not conv.depthwise and conv.groups == 1
            and conv.residual is None and conv.kernel > 1):
        return False
    if len(ops) == 1:
        return True
    pool = ops[1]
    return poolable(conv, pool) and pool.stride == pool.kernel and pool.padding == 0


def bottleneck_block(ops) -> bool:
    """Whether `ops` (3 or 4 consecutive ops) are one ResNet bottleneck block that
    hepti.kernels.bottleneck_chain runs: [downsample 1x1 of the block's input, no
    activation,] conv1 (`pairable` with conv2), conv2 (dense, no residual), conv3 a 1x1 at
    stride 1 reading conv2's output and adding the downsample's output, or the block's
    input."""
    if len(ops) not in (3, 4) or any(op.kind != CONV for op in ops):
        return False
    *ds, c1, c2, c3 = ops
    plain = lambda op: (op.kernel == 1 and op.padding == 0 and op.groups == 1  # noqa: E731
                        and op.dilation == 1 and not op.depthwise)
    if ds and not (plain(ds[0]) and ds[0].input == c1.input and ds[0].residual is None
                   and not ds[0].act):
        return False
    return (pairable(c1, c2) and c2.groups == 1 and c2.residual is None and plain(c3)
            and c3.stride == 1 and c3.input == c2.output
            and c3.residual == (ds[0].output if ds else c1.input))


def adaptive_avg_pool(x: np.ndarray, out_hw: tuple[int, int]) -> np.ndarray:
    """torch's adaptive_avg_pool2d on NHWC x: output cell (i, j) averages input rows
    [floor(i H / oh), ceil((i + 1) H / oh)) and the columns likewise (cells overlap when the
    map is smaller than the output, as VGG's 7x7 pool of a small image's map does). The sums
    in float64, rows then columns, as two products with 0/1 matrices (`_pool_sums`), each
    divided by its cell's count: the 49 numpy means of a 5x5 map (VGG-16 at 160) took
    ~0.25 ms, more than the rest of its forward's Python."""
    n, h, w, c = x.shape
    oh, ow = out_hw
    if (h, w) == (oh, ow):
        return np.ascontiguousarray(x)
    (rows, per_row), (cols, per_col) = _pool_sums(h, oh), _pool_sums(w, ow)
    t = np.matmul(rows, x.astype(np.float64).reshape(n, h, w * c))  # [n, oh, w * c]
    y = np.matmul(cols, t.reshape(n * oh, w, c)).reshape(n, oh, ow, c)
    y /= (per_row[:, None] * per_col[None, :])[None, :, :, None]
    return y.astype(np.float32)


@functools.lru_cache(maxsize=64)
def _pool_sums(size: int, out: int) -> tuple[np.ndarray, np.ndarray]:
    """([out, size] float64 with 1 where output cell i sums input index r, the counts [out])
    of `adaptive_avg_pool` along one axis."""
    m = np.zeros((out, size))
    for i in range(out):
        m[i, i * size // out:-(-(i + 1) * size // out)] = 1.0
    m.flags.writeable = False
    counts = m.sum(axis=1)
    counts.flags.writeable = False
    return m, counts


class CNNModel:
    """A CNN's graph and its packed weights, and the operator order to run it in: what the
    executors (hepti.parallel.single `SingleCNN` on one process, hepti.parallel.bands on
    many) and the profiler's per-op timings (`apply` on each op) run. There is no forward
    here: a single-process CNN is the band executor on a group of one.

    `order`: the ops' names in the order to run them (BTSearch's, hepti.order.search; the
    graph's own when None), checked here (every op once, each after what it reads)."""

    def __init__(self, config, read, threads: int = 1, order: list[str] | None = None):
        """`read(name, rows)`: hepti.weights.WeightStore.read, or `tensors_reader`."""
        self.config, self.graph, self.threads = config, build(config), threads
        self.weights = Weights(self.graph, read)
        self.set_order(order)

    def set_order(self, order: list[str] | None) -> None:
        """Run the ops in `order` from now on (None: the graph's own order)."""
        self.graph.run_order(order)  # a ValueError naming what is wrong with it
        self.order = None if order is None else list(order)

    @classmethod
    def from_store(cls, store, threads: int = 1, order: list[str] | None = None) -> "CNNModel":
        return cls(store.config, store.read, threads, order)


def load_kernels(threads: int = 1) -> None:
    """Have Numba load (or, on a cold cache, compile) every kernel a CNN's forward calls, by
    running each once on tiny random arrays, as hepti.model.bert.load_kernels does for the
    encoders. The kernels' Numba signatures depend on dtypes and ranks, not on sizes or on the
    model (the conv's path, rows or implicit im2col, is a run-time argument of one function), so
    a 1x1, a 3x3 at stride 2 with a residual, a depthwise 3x3, an inverted-residual block
    (hepti.kernels.inverted) and a run of them (hepti.kernels.inverted_chain), a 1x1 written
    into the zero-bordered map of the 3x3 after it (`ConvLayer.into`, `bordered`; `pair`, both
    in one call), a convolution with the max pool after it (`ConvLayer.pooled`), a run of
    convolutions and pools each into the next one's zero-bordered map (`PlainChain`), a run of
    ResNet bottleneck blocks (hepti.kernels.bottleneck_chain), the pools, the head's GeMM and
    the pixels' NCHW -> NHWC copy cover MobileNetV2, ResNet-50 and VGG-16 alike, on one rank
    or on bands of rows."""
    rng = np.random.default_rng(0)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    x = r(1, 8, 8, 16)  # NHWC
    y = K.conv2d(x, K.pack_conv_weight(r(16, 16, 1, 1)), r(16), relu="relu6", threads=threads)
    y = K.conv2d(y, K.pack_conv_weight(r(16, 16, 3, 3)), r(16), 2, 1, relu="relu",
                 residual=r(1, 4, 4, 16), out=np.empty((1, 4, 4, 16), np.float32),
                 threads=threads)
    y = K.conv2d(y, K.pack_conv_weight(r(16, 16, 3, 3)), r(16), 1, 1, threads=threads)
    dw = K.pack_conv_weight(r(16, 1, 3, 3), groups=16)
    y = K.conv2d(y, dw, r(16), 1, 1, relu="relu6", residual=y.copy(), threads=threads)
    y = K.conv2d(y, dw, r(16), 2, 1, threads=threads)
    pw = K.pack_conv_weight(r(16, 16, 1, 1))  # an inverted-residual block, fused (bands.py)
    inverted_residual(x, pw, r(16), dw, r(16), pw, r(16), 1, (1, 0), residual=r(1, 7, 8, 16))
    inverted_residual(x, None, None, dw, r(16), pw, r(16), 2)
    InvertedChain([InvertedBlock(None, None, dw, r(16), pw, r(16)),  # a run of them (bands.py)
                   InvertedBlock(pw, r(16), dw, r(16), pw, r(16))])(x, (1, 2), ((1, 1), (1, 0)),
                                                                    (0, None))
    # a 1x1 into the next 3x3's zero-bordered map (bands.py `_run_pair`; whole panels of
    # 32 output channels: a partial one takes no fused mode)
    x32 = r(1, 8, 8, 32)
    first = K.ConvLayer(K.pack_conv_weight(r(32, 32, 1, 1)), r(32), relu="relu")
    second = K.ConvLayer(K.pack_conv_weight(r(32, 32, 3, 3)), r(32), 2, relu="relu")
    extent = second.border(x32.shape, (1, 1, 1, 1), threads)
    second.bordered(first.into(x32, extent, threads), x32.shape, (1, 1, 1, 1), threads=threads)
    first.pair(second, x32, extent, (1, 1, 1, 1))  # both in one call (one thread)
    second.pooled(x32, (1, 1, 1, 1), 2, 2, (0, 0, 0, 0), threads)  # with its max pool (bands.py)
    conv = lambda cin, k, s=1, relu="relu", cout=32: K.ConvLayer(  # noqa: E731
        K.pack_conv_weight(r(cout, cin, k, k)), r(cout), s, relu=relu)
    PlainChain([(conv(32, 3, cout=64), 0), (conv(64, 3, cout=64), 2)])(  # VGG's convolutions
        x32, ((1, 1, 1, 1),) * 2)  # into each other's zero-bordered maps (bands.py)
    BottleneckChain([(conv(32, 1, 2, None), conv(32, 1), conv(32, 3, 2), conv(32, 1)),
                     (None, conv(32, 1), conv(32, 3), conv(32, 1))])(  # a run of ResNet's
        x32, ((1, 1, 1, 1), (1, 1, 1, 1)))  # bottleneck blocks in one call (bands.py)
    K.max_pool2d(x, 3, 2, 1, out=np.empty((1, 4, 4, 16), np.float32))
    K.avg_pool2d(x, 2)
    v = K.global_avg_pool(x)
    # the head (two panels of outputs: on threads > 1 its parallel GeMV, as the 1000 classes')
    K.relu(K.gemm(v, K.pack_b(r(64, 16), trans=True), r(64), threads=threads))
    K.relu6(x)
    K.nchw_to_nhwc(r(1, 3, 8, 8))


def top_k(logits: np.ndarray, k: int) -> list[list[tuple[int, float]]]:
    """Per row: the k largest classes and their softmax probabilities, best first."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    idx = np.argsort(-logits, axis=1, kind="stable")[:, :k]
    return [[(int(c), float(p[i, c])) for c in row] for i, row in enumerate(idx)]
