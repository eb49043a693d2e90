"""A run of ResNet bottleneck blocks, each reading the one before, as one Numba call:
`BottleneckChain` over the blocks' `ConvLayer`s ([downsample 1x1,] 1x1, 3x3, 1x1 with the
residual), on one thread, on a whole map (one rank).

Op by op, a bottleneck block on one thread is two or three kernel calls (the 1x1 and the 3x3
as one, `ConvLayer.pair`; the last 1x1 written over its residual; the downsample), each
with its Python and its cold dispatch around it: with the caches cold after a multi-ms
kernel, ~16-20 us a call's dispatch and as much again of the executor's Python per op, about
5 ms of ResNet-50's forward at 224 (docs/cnn.md). Here the blocks' weights lie in one flat
buffer (each ConvWeight's panels a view of it: held once, as `inverted_chain` does), their
convolutions' geometry and plans (the same `_conv_shape` plans the layers run alone on one
thread) in one int64 table worked out once per input shape, and the maps between blocks,
the 3x3s' outputs, the zero-bordered maps the 1x1s write into (one per shape, their borders
zeroed once) and the workspace in one arena kept per shape; `_chain` runs the same kernels
(`_into_fused`, `_conv_rows`) in the same order on the same data: outputs bit-equal to the
layers run one by one.

Each block's output is written over its residual where that is a map of the chain's own
(the previous block's output, or the downsample's): the residual's lines are in cache, as
the band executor's 1x1 written over its residual has them. Only the last block's output
is new per call (or `out`); the chain's input is never written.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit

from hepti.kernels import config
from hepti.kernels._microkernels import NR
from hepti.kernels._views import aligned_empty, huge_empty, pad16
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.conv import (_MODE_FLAT, _MODE_PADDED, ConvLayer, _conv_parallel,
                                _conv_rows, _flag, _i64, _into_fused, _into_parallel, _nhwc,
                                _out4, _padded_extent, into_offsets)

# meta's columns per convolution: geo (15: n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw,
# cg; a 3x3's on its zero-bordered map, padding 0), then these
_KIND, _MODE, _MB, _NB, _M, _K, _CO, _NP = 15, 16, 17, 18, 19, 20, 21, 22
_W, _B, _ACT, _HB = 23, 24, 25, 26  # panels' and bias's offsets in wts, act, has a bias
_SRC, _DST, _RES = 27, 30, 33  # (buffer, offset, floats) each: buffer 0 x, 1 y, 2 the arena
_OF = 36  # offset of a 1x1-into's pixel offsets in offs
_CH, _WSC, _BP = 37, 38, 39  # the plan's chunks (threads), workspace per chunk, by panels
_COLS = 40
_INTO, _ROWS = 1, 0  # kinds: a 1x1 into a zero-bordered map (`_into_fused`), `_conv_rows`
_X, _Y, _MEM = 0, 1, 2


@njit(**JIT)
def _buf(x, y, mem, which, off, size):
    """floats off .. off+size-1 of x, y or mem (which: 0, 1, 2)."""
    if which == 0:
        return x[off:off + size]
    if which == 1:
        return y[off:off + size]
    return mem[off:off + size]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _chain(x, y, mem, meta, wts, offs, ws, kc, prefetch):
    """The convolutions of meta (one row each, the columns above) in turn: each
    `_into_fused` (a 1x1 into the interior of a zero-bordered map of mem) or `_conv_rows`
    (its residual, if any, read before each element of its output is stored: it may be the
    output itself), reading and writing x (never written), y and mem; where its plan has
    more than one chunk, their `_into_parallel` / `_conv_parallel` (the caller set Numba's
    threads), as `ConvLayer` runs it."""
    for s in range(meta.shape[0]):
        m = meta[s]
        geo = (m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], m[8], m[9], m[10], m[11], m[12],
               m[13], m[14])
        k, co, n_p = m[_K], m[_CO], m[_NP]
        panels = wts[m[_W]:m[_W] + n_p * k * NR].reshape((1, n_p, k, NR))
        bias = wts[m[_B]:m[_B] + co]
        src = _buf(x, y, mem, m[_SRC], m[_SRC + 1], m[_SRC + 2])
        dst = _buf(x, y, mem, m[_DST], m[_DST + 1], m[_DST + 2])
        ch = m[_CH]
        if m[_KIND] == _INTO:
            c_offs = offs[m[_OF]:m[_OF] + m[_M]]
            if ch == 1:
                _into_fused(src, m[3], co, panels[0], dst, c_offs, _i64(0), m[_NB], m[_MB],
                            m[_M], bias, m[_ACT])
            else:
                _into_parallel(ch, src, m[3], co, panels[0], dst, c_offs, m[_NB], m[_MB],
                               m[_M], bias, m[_ACT], _flag(m[_BP]))
            continue
        has_res = m[_RES] >= 0
        res = _buf(x, y, mem, m[_RES], m[_RES + 1], m[_RES + 2]) if has_res else dst[:0]
        blocks = (m[_MB], kc, _i64(1), prefetch)
        epi = (bias, _flag(m[_HB]), _flag(0), res, _i64(0), co, _flag(has_res))
        if ch == 1:
            _conv_rows(src, geo, _i64(1), k, co, panels, dst, co, _i64(0), m[_NB], m[_MB],
                       m[_M], blocks, epi, m[_ACT], m[_MODE], ws)
        else:
            _conv_parallel(ch, src, geo, _i64(1), k, co, panels, dst, co, m[_NB], m[_MB],
                           m[_M], blocks, epi, m[_ACT], m[_MODE], ws, m[_WSC], _flag(m[_BP]))


def fused_cout(cout: int) -> bool:
    """Whether a convolution of cout output channels can be in a chain: whole panels of NR
    (every tile stored once with its epilogue, as `_conv_rows`' fused modes need)."""
    return cout % NR == 0


class BottleneckChain:
    """ResNet bottleneck blocks (each (downsample or None, conv1, conv2, conv3) ConvLayers:
    conv1 a 1x1 at stride 1, conv2 reading its output (with the padding of the call), conv3 a
    1x1 at stride 1 adding the downsample's output, or the block's input, before its ReLU;
    block k+1 reading block k's output) run as one kernel call on one thread. Their panels
    move into one flat buffer: each ConvWeight's panels become a view of it."""

    def __init__(self, blocks: list[tuple]):
        if not blocks:
            raise ValueError("a chain needs at least one block")
        for blk in blocks:
            if len(blk) != 4 or not all(isinstance(c, ConvLayer) for c in blk[1:]) or not (
                    blk[0] is None or isinstance(blk[0], ConvLayer)):
                raise ValueError("a block is (downsample ConvLayer or None, conv1, conv2, conv3)")
        for a, b in zip(blocks, blocks[1:]):
            if b[1].w.cin != a[3].w.cout:
                raise ValueError(f"a block of {b[1].w.cin} input channels cannot read one of "
                                 f"{a[3].w.cout} output channels")
        self.blocks = [tuple(b) for b in blocks]
        layers = [c for blk in self.blocks for c in blk if c is not None]
        if any(c.w.depthwise or c.w.groups != 1 for c in layers):
            raise ValueError("a bottleneck chain takes dense convolutions (groups 1)")
        total = sum(pad16(c.w.panels.size) + pad16(c.w.cout) for c in layers)
        self.wts = huge_empty(max(total, 1))
        self._at, at = {}, 0  # id(layer) -> (panels' offset, bias's offset)
        for c in layers:
            p = c.w.panels
            view = self.wts[at:at + p.size].reshape(p.shape)
            view[...] = p
            c.w.panels = view
            self.wts[at + pad16(p.size):at + pad16(p.size) + c.w.cout] = c.bias_f
            self._at[id(c)] = (at, at + pad16(p.size))
            at += pad16(p.size) + pad16(c.w.cout)
        self._shapes: dict = {}  # (x's shape, paddings, threads) -> `_plan`'s
        # Numba's thread pool, launched: `_chain` calls the parallel kernels (on more than
        # one thread), and loaded from the cache it calls them without launching it (a
        # segfault, even where only its one-thread branch runs); their own dispatcher, or
        # get_num_threads, launches it
        numba.get_num_threads()

    @property
    def cin(self) -> int:
        return self.blocks[0][1].w.cin

    @property
    def cout(self) -> int:
        return self.blocks[-1][3].w.cout

    def _row(self, layer, kind, geo, plan, src, dst, res=None, of=0) -> np.ndarray:
        m = np.zeros(_COLS, np.int64)
        m[:15] = [int(v) for v in geo]
        mode, _, n_chunks, mb, n_blocks, ws_chunk, by_panels = plan
        cw = layer.w
        w_at, b_at = self._at[id(layer)]
        m[_KIND], m[_MODE], m[_MB], m[_NB] = kind, mode, mb, n_blocks
        m[_M], m[_K], m[_CO], m[_NP] = geo[0] * geo[4] * geo[5], cw.k, cw.cout, cw.panels.shape[1]
        m[_W], m[_B], m[_ACT], m[_HB] = w_at, b_at, layer.act, layer.bias is not None
        m[_SRC:_SRC + 3], m[_DST:_DST + 3] = src, dst
        m[_RES:_RES + 3] = (-1, 0, 0) if res is None else res
        m[_OF] = of
        m[_CH], m[_WSC], m[_BP] = n_chunks, ws_chunk, by_panels
        return m

    def _plan(self, shape: tuple, paddings: tuple, threads: int) -> tuple | None:
        """(meta, the output's shape, the arena, offs, ws) for an input of this shape, each
        conv2 with its padding of paddings (an int or (top, bottom, left, right)), each
        convolution on its plan for `threads`; None where a convolution would not run here
        as it runs alone (conv1 or conv3 not `_MODE_FLAT`, conv2 with no bordered plan, a
        downsample needing a padded copy)."""
        rows, sizes = [], []  # per block: the convs' (shape, geo, plan); the maps' floats
        x_shape = shape
        if len(paddings) != len(self.blocks):
            raise ValueError(f"paddings needs one entry per block ({len(self.blocks)})")
        for blk, p in zip(self.blocks, paddings):
            ds, c1, c2, c3 = blk
            got_ds = None
            if ds is not None:
                got_ds = ds._shape(x_shape, 0, threads)
                if got_ds[2] is None or not got_ds[2][1]:
                    return None
                g = got_ds[1]
                if got_ds[2][0] == _MODE_PADDED and _padded_extent(g)[:2] != g[1:3]:
                    return None  # (a 1x1 never reads padding; its taps stay inside x)
            s1, g1, p1 = c1._shape(x_shape, 0, threads)
            if p1 is None or p1[0] != _MODE_FLAT:
                return None
            got2 = c2._bordered_plan(s1, p, threads)
            if got2 is None:
                return None
            s2, g2, p2 = got2
            extent = _padded_extent(g2)
            s3, g3, p3 = c3._shape(s2, 0, threads)
            if p3 is None or p3[0] != _MODE_FLAT or \
                    s3 != (got_ds[0] if ds is not None else x_shape):
                return None
            rows.append((got_ds, (s1, g1, p1), (s2, g2, p2, extent), (s3, g3, p3)))
            x_shape = s3
        n = shape[0]
        # the arena: two maps between blocks, the 3x3s' outputs, a bordered map per shape
        p_size = max([int(np.prod(r[3][0])) for r in rows[:-1]] + [0])
        t_size = max(int(np.prod(r[2][0])) for r in rows)
        maps, at = {}, 2 * pad16(p_size) + pad16(t_size)
        offs, of_at = [], 0
        for r in rows:
            key = (r[1][0], r[2][3])
            if key not in maps:
                hp, wp = r[2][3][:2]
                o = into_offsets(*r[1][0], r[2][3])
                maps[key] = (at, n * hp * wp * r[1][0][3], of_at)
                at += pad16(maps[key][1])
                offs.append(o)
                of_at += o.size
        mem = huge_empty(max(at, 1))  # on a 2 MiB boundary in huge pages of its own: alike in
        mem.fill(0.0)  # every process; the borders stay zero
        p_bufs = [(_MEM, 0, p_size), (_MEM, pad16(p_size), p_size)]
        t_buf = (_MEM, 2 * pad16(p_size), t_size)
        meta, ws = [], 0
        src = (_X, 0, int(np.prod(shape)))
        for k, (blk, r) in enumerate(zip(self.blocks, rows)):
            ds, c1, c2, c3 = blk
            (s1, g1, p1), (s2, g2, p2, extent), (s3, g3, p3) = r[1:]
            size3 = int(np.prod(s3))
            if k == len(rows) - 1:
                out = (_Y, 0, size3)
            elif ds is None and src[0] == _MEM:
                out = src  # written over its residual, the block's input
            else:
                out = p_bufs[1] if src[:2] == p_bufs[0][:2] else p_bufs[0]  # not src
                out = (out[0], out[1], size3)
            if ds is not None:
                meta.append(self._row(ds, _ROWS, r[0][1], r[0][2], src, out))
                ws = max(ws, r[0][2][2] * r[0][2][5])
            xp_at, xp_size, of = maps[(s1, extent)]
            xp = (_MEM, xp_at, xp_size)
            meta.append(self._row(c1, _INTO, g1, p1, src, xp, of=of))
            geo_p = (n,) + tuple(extent[:2]) + tuple(g2[3:10]) + (0, 0) + tuple(g2[12:])
            t = (t_buf[0], t_buf[1], int(np.prod(s2)))
            meta.append(self._row(c2, _ROWS, geo_p, p2, xp, t))
            meta.append(self._row(c3, _ROWS, g3, p3, t, out, out if ds is not None else src))
            ws = max(ws, p2[2] * p2[5], p3[2] * p3[5])
            src = out
        return (np.stack(meta), x_shape, mem, np.concatenate(offs).astype(np.int64),
                aligned_empty(max(ws, 16)))

    def __call__(self, x: np.ndarray, paddings: tuple, out: np.ndarray | None = None,
                 threads: int = 1) -> np.ndarray | None:
        """The blocks over x [N, H, W, Cin] in turn, block k's conv2 with padding
        paddings[k] (as `ConvLayer.__call__` takes it: hashable), each convolution on
        `threads` as the layer alone would run it: the last block's output; None where a
        convolution would not run here as alone (`_plan`: call the layers then). The arena
        is kept: one call at a time per chain."""
        x = _nhwc(x)
        if x.shape[3] != self.cin:
            raise ValueError(f"x {x.shape} has {x.shape[3]} channels; the chain reads "
                             f"{self.cin}")
        key = (x.shape, paddings, threads)
        got = self._shapes.get(key)
        if got is None and key not in self._shapes:
            if len(self._shapes) >= 4:  # an arena a shape (~12 MB for ResNet-50 at 224)
                self._shapes.clear()
            got = self._shapes[key] = self._plan(x.shape, tuple(paddings), int(threads))
        if got is None:
            return None
        meta, shape, mem, offs, ws = got
        y = _out4(out, shape)
        if out is not None and np.shares_memory(y, x):
            raise ValueError("out overlaps x: pass a separate output buffer")
        args = (x.reshape(-1), y.reshape(-1), mem, meta, self.wts, offs, ws, config.KC,
                config.PREFETCH_ROWS)
        if threads == 1:
            _chain(*args)
            return y
        previous = numba.get_num_threads()
        numba.set_num_threads(min(int(threads), numba.config.NUMBA_NUM_THREADS))
        try:
            _chain(*args)
        finally:
            numba.set_num_threads(previous)
        return y
