"""MobileNetV2's inverted-residual block as one kernel: expand (1x1 + bias + ReLU6) ->
depthwise 3x3 (+ bias + ReLU6) -> project (1x1 + bias, + residual), run by tiles of output
rows so that the expanded tensor (6x the block's input) is only ever a few rows, in L2.

x, y NHWC float32. A tile of output rows [o0, o1) of the depthwise conv reads expanded rows
[i0, i1) (the 3x3's halo: one row above and below at stride 1; 2 * rows + 1 at stride 2):
those rows of x are expanded into ebuf (`_conv_rows` of hepti.kernels.conv on the slice of x,
a 1x1 GeMM whose result stays in cache), the depthwise kernel (`_depthwise`) reads them
into dbuf, and the project GeMM writes the tile's rows of y (bias and residual in its
epilogue). The expanded rows two tiles share (the 3x3's halo: 2 rows at stride 1, 1 at
stride 2) are expanded once: they move to the top of ebuf and only the tile's new rows are
expanded after them. `tile_rows` chooses the rows per tile.

Both 1x1s store each tile once with the bias, the residual and ReLU6 applied in registers,
reading their A in place over the tile's flat rows (`_tiles_1x1`, conv2d's _MODE_FLAT),
wherever the channels are whole 32-wide panels plus at most a last one of 16 or 24: a 16- or
24-wide register tile (`narrow_tiles_epi16` / `24`) runs that last panel, not a 32-wide one
half or a quarter on zero padding. That covers every 1x1 of MobileNetV2 (projects to 16 and
24; expands to 144 = 4 * 32 + 16). Measured at 224 (each block alone, min of 21 interleaved
rounds, 1 thread, load average ~13 on 2 cores; scratch A/B of the 1x1s as before against
now): block 1 0.56 -> 0.41 ms, 2 0.98 -> 0.87, 3 0.91 -> 0.76, 4 0.57 -> 0.48, 5-14 10-25%
less, 15-17 (7x7 maps) alike; the blocks and the rest of the net 8.6 -> 7.7 ms.

Padding is per side (top, bottom) like the convolutions', so that a band of output rows can
be computed from a band of input rows (the height split: docs/cnn.md). The arithmetic is
the three separate kernels', summed in the same order: the results agree with
conv2d -> depthwise_conv2d -> conv2d exactly (bar fastmath's freedom).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from hepti.kernels import _tile_ir, config
from hepti.kernels._gen_microkernels import NARROW
from hepti.kernels._microkernels import MR, MRF, NR, narrow_tiles_epi16, narrow_tiles_epi24
from hepti.kernels._views import pad16, vector
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.conv import (_MODE_DIRECT, _MODE_FLAT, _MODE_ROWS, ConvWeight, _conv_rows,
                                _conv_sizes, _depthwise, _flag, _i64, _nhwc, _out4, _residual,
                                _tiles_fused)

# The generated narrow tiles hold 8 x 16 (or 24) accumulators as named scalars: 8 (or 16) of
# AVX-512's 32 zmm, but 16 (or 24) of AVX2's 16 ymm, where LLVM spilled them inside the k loop
# (Zen 3: 12 and 18 GFLOP/s, where the IR tile in register passes ran 84 on 32 columns). Where
# the tile does not fit the registers in one pass, the narrow columns run on the IR tile of
# their width (`_tile_ir.tile_narrow16` / `24`), in passes: bit-equal; alone 1.65x (16) and
# 2.55x (24) as fast; MobileNetV2's forward 0.912x the time at 224 and 0.944x at 160 (`hepti
# bench against edc36fc --in-process`, 30 rounds, Zen 3, 2026-12-02).
NARROW_IR = len(_tile_ir.register_passes(MRF, 1)) > 1
TILE_BYTES = 1 << 20  # expanded + depthwise rows of one tile aimed at (Zen 4's L2)
MIN_TILE = {1: 8, 2: 4}  # output rows: fewer paid a tile's fixed costs too often


def _mode_1x1(wo: int, cout: int) -> int:
    """How conv2d forms A for a plain 1x1 to cout channels over rows wo wide (conv2d's own
    choice where cout is whole panels): where cout is whole panels and at most a last one of
    16 or 24 columns (`_tiles_1x1`), x in place over the flat M with each tile stored once,
    its bias, residual and ReLU6 applied in registers (_MODE_FLAT); else x in place by rows,
    or packed where rows leave short tiles (conv2d's own way)."""
    if cout % NR == 0 or cout % NR in NARROW:
        return _MODE_FLAT
    return _MODE_ROWS if wo >= MR and wo % MR == 0 else _MODE_DIRECT


def tile_rows(h: int, w: int, hid: int, stride: int, ho: int, target: int = TILE_BYTES) -> int:
    """Output rows per tile: the most whose expanded rows (stride * rows + 2) and depthwise
    rows fit `target` bytes, but at least MIN_TILE[stride], at most ho. Measured on
    MobileNetV2 at 224 (each block fused against its three ops, interleaved, load average
    5 on 2 cores, so +-30% noise): tiles of 1-2 rows lost to their fixed costs (three kernel
    calls, the halo moved up); 8-16 rows and the whole map were the fastest, alike within
    noise. Before the halo rows were kept (each tile expanding its own), tiles of 2 lost to
    the recomputed rows on every map of 28x28 and smaller."""
    wo = (w - 1) // stride + 1
    per = 4 * hid * (stride * w + wo)  # one more output row: its expanded and depthwise rows
    fixed = 4 * hid * w * 2
    return int(max(1, min(ho, max(MIN_TILE[stride], (target - fixed) // per))))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def narrow_tiles_ir(width, n_tiles, kc, a, a_off, lda, bp, c, c_off, ldc, last_rows, bias, res,
                    r_off, ldr, has_res, act):
    """`narrow_tiles_epi16` / `24` (width 16 or 24) on the IR tile of that width, tile by tile:
    the same arguments, the same sums in the same order."""
    z, one = np.int64(0), np.int64(1)
    for t in range(n_tiles):
        nv = last_rows if t == n_tiles - 1 else np.int64(MRF)
        ao, co, ro = a_off + t * MRF * lda, c_off + t * MRF * ldc, r_off + t * MRF * ldr
        if width == 16:
            _tile_ir.tile_narrow16(a, ao, one, kc, z, lda, bp, z, c, co, ldc, nv, bias, res,
                                   ro, ldr, has_res, act)
        else:
            _tile_ir.tile_narrow24(a, ao, one, kc, z, lda, bp, z, c, co, ldc, nv, bias, res,
                                   ro, ldr, has_res, act)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _narrow_tiles(width, n_tiles, kc, a, a_off, lda, bp, c, c_off, ldc, last_rows, bias, res,
                  r_off, ldr, has_res, act):
    """The narrow tiles of `width` (16 or 24; `narrow_tiles_epi16`'s arguments): on the IR
    tile where the generated one does not fit the registers (NARROW_IR), else the generated."""
    if NARROW_IR:
        narrow_tiles_ir(width, n_tiles, kc, a, a_off, lda, bp, c, c_off, ldc, last_rows, bias,
                        res, r_off, ldr, has_res, act)
    elif width == 16:
        narrow_tiles_epi16(n_tiles, kc, a, a_off, lda, bp, c, c_off, ldc, last_rows, bias, res,
                           r_off, ldr, has_res, act)
    else:
        narrow_tiles_epi24(n_tiles, kc, a, a_off, lda, bp, c, c_off, ldc, last_rows, bias, res,
                           r_off, ldr, has_res, act)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _tiles_1x1(a, lda, k, n_out, panels, c, ldc, rows, bias, res, r_off, ldr, has_res, act,
               buf):
    """c[i, 0:n_out] (row stride ldc) = act(a[i] @ B + bias (+ res[r_off + i*ldr])) for the
    rows i < rows of a 1x1 convolution whose A rows lie in a (row i at i*lda, k values), B
    the packed panels [n_panels, k, NR]: the whole panels on conv's fused store
    (`_tiles_fused`), then a last panel of 16 or 24 columns on the register tile of its
    width (`_narrow_tiles`), the same sums in the same order. Both take tiles of
    MRF rows (the fused tile's height): a short last tile's rows go through buf [MRF * k],
    where `_tiles_fused` copied them."""
    _tiles_fused(a, _i64(0), lda, k, n_out, panels, c, ldc, _i64(0), rows, bias, res, r_off,
                 ldr, has_res, act, buf)
    tw = n_out % NR
    if tw == 0:
        return
    j0 = n_out - tw
    bp = panels[n_out // NR]
    bj = bias[j0:j0 + tw]
    n_full = rows // MRF
    rem = rows - n_full * MRF
    m_rem = n_full * MRF
    if n_full:
        _narrow_tiles(tw, n_full, k, a, _i64(0), lda, bp, c, j0, ldc, _i64(MRF), bj, res,
                      r_off + j0, ldr, has_res, act)
    if rem:
        _narrow_tiles(tw, _i64(1), k, buf, _i64(0), k, bp, c, m_rem * ldc + j0, ldc, rem, bj,
                      res, r_off + m_rem * ldr + j0, ldr, has_res, act)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _block(x, dims, we, be, taps, bd, wp, bp, res, has_res, y, t_rows, ebuf, dbuf, ws_e,
           ws_p, mode_e, mode_p, blocks_e, blocks_p):
    """y = the block over x (flat NHWC arrays), tile by tile (t_rows output rows each).
    dims = (n, h, w, cin, hid, cout, ho, wo, stride, pad_top, has_expand)."""
    n, h, w, cin, hid, cout, ho, wo, s, pt, has_expand = dims
    empty = y[:0]
    row = w * hid
    # np.int64 / np.bool_, not literals, in the geometries, epilogues and flags passed on:
    # _conv_rows and _depthwise then have the one signature a layer's call gives them
    z, one, three, yes, no = np.int64(0), np.int64(1), np.int64(3), np.bool_(True), np.bool_(False)
    for b in range(n):
        lo = hi = 0  # the expanded rows [lo, hi) in ebuf, from its start
        for o0 in range(0, ho, t_rows):
            o1 = min(ho, o0 + t_rows)
            i0 = max(o0 * s - pt, 0)
            i1 = min((o1 - 1) * s - pt + 3, h)
            ne = i1 - i0
            if has_expand:
                keep = hi - i0 if lo <= i0 < hi else 0  # the halo rows expanded already
                if keep and i0 > lo:  # moved to the top (forward: the source is after)
                    src = (i0 - lo) * row
                    for q in range(keep * row):
                        ebuf[q] = ebuf[src + q]
                if i1 > i0 + keep:
                    me = (i1 - i0 - keep) * w
                    xs = x[(b * h + i0 + keep) * w * cin:(b * h + i1) * w * cin]
                    if mode_e == _MODE_FLAT:
                        _tiles_1x1(xs, _i64(cin), _i64(cin), _i64(hid), we[0],
                                   ebuf[keep * row:ne * row], _i64(hid), _i64(me), be, empty,
                                   _i64(0), _i64(hid), _flag(False), _i64(2), ws_e)
                    else:
                        geo_e = (one, i1 - i0 - keep, w, cin, i1 - i0 - keep, w, one, one, one,
                                 one, z, z, one, one, cin)
                        _conv_rows(xs, geo_e, one, cin, hid, we, ebuf[keep * row:ne * row], hid,
                                   z, one, me, me, (me, blocks_e[1], blocks_e[2], blocks_e[3]),
                                   (be, yes, no, empty, z, hid, no), np.int64(2), mode_e, ws_e)
                lo, hi = i0, i1
                e = ebuf
            else:
                e = x[(b * h + i0) * w * cin:(b * h + i1) * w * cin]
            nt = o1 - o0
            geo_d = (one, ne, w, hid, nt, wo, three, three, s, s, i0 - (o0 * s - pt), one, one,
                     one, one)
            _depthwise(e, geo_d, taps, bd, empty, no, np.int64(2), dbuf, z, nt)
            mp = nt * wo
            y_off = (b * ho + o0) * wo * cout
            if mode_p == _MODE_FLAT:
                _tiles_1x1(dbuf, _i64(hid), _i64(hid), _i64(cout), wp[0],
                           y[y_off:y_off + mp * cout], _i64(cout), _i64(mp), bp, res,
                           _i64(y_off), _i64(cout), has_res, _i64(0), ws_p)
            else:
                geo_p = (one, nt, wo, hid, nt, wo, one, one, one, one, z, z, one, one, hid)
                _conv_rows(dbuf, geo_p, one, hid, cout, wp, y[y_off:y_off + mp * cout], cout, z,
                           one, mp, mp, (mp, blocks_p[1], blocks_p[2], blocks_p[3]),
                           (bp, yes, no, res, y_off, cout, has_res), z, mode_p, ws_p)


@functools.lru_cache(maxsize=256)
def _plan(h: int, w: int, cin: int, hid: int, cout: int, stride: int, ho: int, wo: int,
          tile: int, has_expand: bool) -> tuple:
    """(rows per tile, the expand's and the project's A modes, the lengths of ebuf, dbuf
    and the two GeMM workspaces) of a block's shape: the same on every call with that shape
    (MobileNetV2 runs 17 blocks a forward; worked out each time, this was ~3 us of a call's
    ~8 us of Python)."""
    t = tile if tile else tile_rows(h, w, hid, stride, ho)
    t = max(1, min(t, ho))
    ne_max = min(h, (t - 1) * stride + 3)
    mode_e, mode_p = _mode_1x1(w, hid), _mode_1x1(wo, cout)
    se = _conv_sizes(ne_max * w, cin, mode_e, w) if has_expand else (0, 0, 0)
    sp = _conv_sizes(t * wo, hid, mode_p, wo)
    return (t, mode_e, mode_p, ne_max * w * hid if has_expand else 0, t * wo * hid,
            sum(pad16(int(v)) for v in se), sum(pad16(int(v)) for v in sp))


class InvertedBlock:
    """One block's weights, checked once, and its plan per input shape, kept: `__call__` is
    `inverted_residual` on them without redoing per call what depends on the weights alone
    (their shapes, the biases as contiguous vectors) or on the input's shape alone (`_plan`,
    the output's size, the kernel's dims). MobileNetV2 runs 17 blocks a forward: its Python
    around the kernels (each kernel a no-op) went from 0.21 to 0.16 ms a forward, 3-8 us of
    each block's call (~230 us with the kernel at 14x14x64 -> 384). hepti.model.cnn
    `Weights.inverted` keeps one per block."""

    def __init__(self, expand, expand_bias, dw: ConvWeight, dw_bias, project: ConvWeight,
                 project_bias):
        if not dw.depthwise or (dw.kh, dw.kw) != (3, 3):
            raise ValueError(f"dw must be a depthwise 3x3 weight, got {dw!r}")
        hid = dw.cout
        if expand is not None:
            cin = expand.cin
            if expand.depthwise or (expand.kh, expand.kw, expand.cout) != (1, 1, hid):
                raise ValueError(f"expand must be a 1x1 conv {cin} -> {hid}, got {expand!r}")
        else:
            cin = hid
        if project.depthwise or (project.kh, project.kw, project.cin) != (1, 1, hid):
            raise ValueError(f"project must be a 1x1 conv from {hid} channels, got {project!r}")
        self.cin, self.hid, self.cout, self.has_expand = cin, hid, project.cout, expand is not None
        self.we = expand.panels if expand is not None else project.panels
        self.be = vector(expand_bias, "expand_bias", hid) if expand is not None else \
            np.zeros(hid, np.float32)
        self.taps, self.bd = dw.taps, vector(dw_bias, "dw_bias", hid)
        self.wp, self.bp = project.panels, vector(project_bias, "project_bias", self.cout)
        self._shapes: dict = {}  # (n, h, w, stride, pad top, pad bottom, tile) -> `_shape`

    def _shape(self, n: int, h: int, w: int, stride: int, pt: int, pb: int, tile: int) -> tuple:
        """(ho, wo, the kernel's dims, rows per tile, the 1x1s' modes, the buffers' lengths)
        of an input [n, h, w, cin] (checked here, once per shape)."""
        if stride not in (1, 2):
            raise ValueError(f"stride must be 1 or 2, got {stride}")
        if not (0 <= pt <= 1 and 0 <= pb <= 1):
            raise ValueError(f"padding (top, bottom) must be 0 or 1 each, got {(pt, pb)}")
        ho = (h + pt + pb - 3) // stride + 1
        wo = (w + 2 - 3) // stride + 1
        if ho < 1 or wo < 1:
            raise ValueError(f"x {(n, h, w, self.cin)} is too small for a 3x3 at stride "
                             f"{stride}, padding {(pt, pb)}")
        plan = _plan(h, w, self.cin, self.hid, self.cout, stride, ho, wo, tile, self.has_expand)
        dims = (n, h, w, self.cin, self.hid, self.cout, ho, wo, stride, pt, self.has_expand)
        if len(self._shapes) >= 64:  # bands of many sizes (a planner's trials): start again
            self._shapes.clear()
        out = self._shapes[(n, h, w, stride, pt, pb, tile)] = (ho, wo, dims) + plan
        return out

    def __call__(self, x: np.ndarray, stride: int = 1, padding: tuple[int, int] = (1, 1),
                 residual: np.ndarray | None = None, out: np.ndarray | None = None,
                 tile: int = 0) -> np.ndarray:
        """y = the block over x [N, H, W, Cin], as `inverted_residual`'s."""
        x = _nhwc(x)
        n, h, w, cin = x.shape
        if cin != self.cin:
            raise ValueError(f"x {x.shape} has {cin} channels: " + (
                f"the expand is a 1x1 conv {self.cin} -> {self.hid}" if self.has_expand else
                f"without an expand, x's channels must be the depthwise's {self.hid}"))
        pt, pb = int(padding[0]), int(padding[1])
        key = (n, h, w, int(stride), pt, pb, int(tile))
        got = self._shapes.get(key)
        ho, wo, dims, t, mode_e, mode_p, n_e, n_d, n_we, n_wp = \
            got if got is not None else self._shape(*key)
        y = _out4(out, (n, ho, wo, self.cout))
        if out is not None and np.shares_memory(y, x):
            raise ValueError("out overlaps x: pass a separate output buffer")
        res = _residual(residual, y.shape, y if out is not None else None)  # a new y: apart
        blocks = (0, config.KC, 1, config.PREFETCH_ROWS)
        _block(x.reshape(-1), dims, self.we, self.be, self.taps, self.bd, self.wp, self.bp, res,
               residual is not None, y.reshape(-1), t, np.empty(n_e, np.float32),
               np.empty(n_d, np.float32), np.empty(n_we, np.float32),
               np.empty(n_wp, np.float32), mode_e, mode_p, blocks, blocks)
        return y


def inverted_residual(x: np.ndarray, expand, expand_bias, dw: ConvWeight, dw_bias,
                      project: ConvWeight, project_bias, stride: int = 1,
                      padding: tuple[int, int] = (1, 1), residual: np.ndarray | None = None,
                      out: np.ndarray | None = None, tile: int = 0) -> np.ndarray:
    """y = project(relu6(dw3x3(relu6(expand(x) + be)) + bd)) + bp (+ residual), x float32
    [N, H, W, Cin] (NHWC), by tiles of output rows. expand: a 1x1 ConvWeight (Cin -> hid) or
    None (MobileNetV2's first block, t = 1: x is then the depthwise's input); dw: a depthwise
    3x3 ConvWeight of hid channels; project: a 1x1 ConvWeight hid -> Cout. padding: the
    depthwise's (top, bottom) rows (1, 1 on a whole map; a band's own, where it meets the
    image's border, else 0); left and right are 1. tile: output rows per tile (0: `tile_rows`).
    One thread. (A block run many times: `InvertedBlock`, which checks the weights once.)"""
    return InvertedBlock(expand, expand_bias, dw, dw_bias, project, project_bias)(
        x, stride, padding, residual, out, tile)
