"""CNN kernels (hepti.kernels.conv) against their float64 references in hepti.kernels.naive.

Shapes hit the edges of the implicit im2col: odd sizes, output rows not a multiple of MR (tiles
that cross an output row), stride 2, dilation, groups 1 / 2 / C, asymmetric padding, batch 1
and 3, kernels 1 / 3 / 5 / 7, K past one k-block and Cout past one panel. Tolerance as in
test_kernels.py: 1e-5 * sqrt(K) relative to the same convolution of |x| and |w| (plus |bias|
and |residual|); ReLU and ReLU6 do not increase an error.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from hepti.kernels import (ConvWeight, avg_pool2d, conv2d, depthwise_conv2d, fold_batchnorm,
                           global_avg_pool, max_pool2d, naive, pack_b, pack_conv_weight, relu,
                           relu6)
from hepti.kernels import conv
from hepti.kernels import _microkernels as mk
from hepti.kernels.config import NR

RNG = np.random.default_rng(20240602)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


def assert_conv_close(y, x, w, bias=None, stride=1, padding=0, dilation=1, groups=1,
                      residual=None, act=None):
    """y against naive.conv2d, elementwise within 1e-5 * sqrt(K) of the |x| * |w| scale."""
    ref = naive.conv2d(x, w, bias, stride, padding, dilation, groups, residual, act)
    scale = naive.conv2d(np.abs(x), np.abs(w), None if bias is None else np.abs(bias), stride,
                         padding, dilation, groups,
                         None if residual is None else np.abs(residual))
    k = w.shape[1] * w.shape[2] * w.shape[3]
    tol = 1e-5 * math.sqrt(k) * scale + 1e-6
    assert y.shape == ref.shape, f"shape {y.shape}, reference {ref.shape}"
    err = np.abs(y.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape)
    assert np.all(err <= tol), f"max error {err[worst]} > tol {tol[worst]} at {worst}"


# (N, H, W, Cin, Cout, (kh, kw), stride, padding, dilation, groups)
CONV_CASES = [
    (1, 9, 11, 6, 10, (3, 3), 1, 1, 1, 1),
    (3, 8, 7, 4, 40, (3, 3), 2, (1, 0, 2, 1), 2, 2),  # asymmetric padding, dilation, groups 2
    (1, 5, 5, 8, 8, (1, 1), 1, 0, 1, 1),  # 1x1 stride 1: x is A, no patches
    (3, 6, 5, 37, 33, (1, 1), 1, 0, 1, 1),  # ... batch 3, a partial panel
    (2, 9, 9, 8, 12, (1, 1), 2, 0, 1, 1),  # 1x1 stride 2 (ResNet's downsampling shortcut)
    (1, 17, 13, 3, 33, (7, 7), 2, 3, 1, 1),  # ResNet's stem, small
    (1, 12, 12, 6, 12, (5, 5), 2, 2, 1, 3),  # groups 3, kernel 5
    (2, 10, 10, 4, 8, (3, 3), 1, (0, 2, 1, 0), (2, 1), 4),  # groups 4, dilation (2, 1)
    (1, 20, 21, 64, 70, (3, 3), 1, 1, 1, 1),  # K = 576 > KC, 3 panels, tiles crossing rows
    (1, 7, 9, 5, 9, (1, 3), (1, 2), (0, 0, 1, 1), 1, 1),  # a 1x3 kernel
    (3, 4, 4, 2, 3, (3, 3), 1, 0, 1, 1),  # output 2x2: every tile crosses rows and images
]


@pytest.mark.parametrize("n,h,w,cin,cout,kernel,stride,padding,dilation,groups", CONV_CASES)
def test_conv2d_against_naive(n, h, w, cin, cout, kernel, stride, padding, dilation, groups):
    x = rand(n, h, w, cin)
    wt = rand(cout, cin // groups, *kernel)
    bias = rand(cout)
    y = conv2d(x, wt, bias, stride, padding, dilation, groups)
    assert_conv_close(y, x, wt, bias, stride, padding, dilation, groups)


@pytest.mark.parametrize("act", ["relu", "relu6"])
@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[1], CONV_CASES[3]])
def test_conv2d_residual_and_activation(case, act):
    """act(conv + bias + residual), ResNet's order; out as a preallocated buffer."""
    n, h, w, cin, cout, kernel, stride, padding, dilation, groups = case
    x, wt, bias = rand(n, h, w, cin) * 3, rand(cout, cin // groups, *kernel), rand(cout)
    y0 = naive.conv2d(x, wt, bias, stride, padding, dilation, groups)
    residual = rand(*y0.shape) * 3
    out = np.full(y0.shape, np.nan, np.float32)
    packed = pack_conv_weight(wt, groups)
    y = conv2d(x, packed, bias, stride, padding, dilation, relu=act, residual=residual, out=out)
    assert y is out
    assert_conv_close(y, x, wt, bias, stride, padding, dilation, groups, residual, act)
    if act == "relu6":
        assert y.max() <= 6.0 and y.min() >= 0.0


def test_conv2d_read_only_inputs():
    """Activations, residual and weights mapped read-only give what writeable ones give."""
    x, wt, bias, residual = rand(1, 6, 7, 5), rand(8, 5, 3, 3), rand(8), rand(1, 6, 7, 8)
    want = conv2d(x, wt, bias, 1, 1, residual=residual)
    for a in (x, wt, bias, residual):
        a.flags.writeable = False
    np.testing.assert_array_equal(conv2d(x, pack_conv_weight(wt), bias, 1, 1,
                                         residual=residual), want)


@pytest.mark.parametrize("mb,threads", [(8, 1), (24, 1), (0, 2), (16, 2)])
def test_conv2d_row_blocks_and_threads(mb, threads):
    """Several row blocks (the residual and output offsets move with them), split over two
    threads; mb=8 makes every block one tile."""
    x, wt, bias = rand(2, 11, 9, 12), rand(36, 6, 3, 3), rand(36)
    residual = rand(2, 6, 4, 36)
    y = conv2d(x, wt, bias, 2, (2, 1, 1, 0), groups=2, relu="relu", residual=residual,
               threads=threads, _mb=mb)
    assert_conv_close(y, x, wt, bias, 2, (2, 1, 1, 0), 1, 2, residual, "relu")


@pytest.mark.parametrize("mode", [2, 1])
def test_conv2d_im2col_modes_agree(mode):
    """The benchmark's im2col-per-block variant and the implicit one give the same result."""
    from hepti.kernels import conv
    x, wt = rand(1, 10, 13, 7), rand(9, 7, 3, 3)
    assert mode in (conv._MODE_IM2COL, conv._MODE_IMPLICIT)
    y = conv2d(x, wt, None, 1, 1, _mode=mode)
    assert_conv_close(y, x, wt, None, 1, 1)


# Shapes on which conv2d reads most patches from x in place (_MODE_ROWS): rows at least two
# tiles wide, so that some tile lies inside x. (N, H, W, Cin, Cout, kernel, stride, padding,
# dilation)
ROWS_CASES = [
    (1, 6, 20, 16, 32, 3, 1, 1, 1),  # border tiles packed, one tile in place, a tail of 4
    (2, 5, 29, 8, 40, 3, 1, 1, 1),  # batch 2, a partial panel, a tail of 5
    (1, 7, 33, 12, 33, 1, 2, 0, 1),  # 1x1 stride 2: lda = 2 * Cin
    (1, 9, 35, 5, 64, 3, 2, 1, 1),  # 3x3 stride 2
    (1, 6, 24, 16, 32, 3, 1, (0, 2, 1, 0), 1),  # asymmetric padding: the bottom rows pad
    (1, 5, 40, 7, 96, 5, 1, 2, 1),  # kernel 5, K = 35 per kernel row
    (1, 6, 40, 8, 32, 3, 1, 2, (2, 1)),  # dilation 2 down, 1 across
    (1, 3, 40, 8, 32, 3, 1, (3, 3, 1, 1), 1),  # rows whose every tap is padding: bias only
    (1, 4, 21, 64, 70, 3, 1, 1, 1),  # K per kernel row 192 > KC, three panels
    (1, 5, 24, 16, 32, 3, 1, 1, 1),  # tile 1 in place, tiles 0 and 2 packed
    (2, 9, 17, 8, 16, 3, 1, 1, 1),  # tile 1 in place reads the last column of x, a tail of 1
]


@pytest.mark.parametrize("n,h,w,cin,cout,k,stride,padding,dilation", ROWS_CASES)
@pytest.mark.parametrize("mb,threads", [(0, 1), (1, 1), (0, 2)])
def test_conv2d_reads_patches_in_place(n, h, w, cin, cout, k, stride, padding, dilation, mb,
                                       threads):
    """_MODE_ROWS (chosen on its own for these shapes) against the naive twin, with bias,
    residual and ReLU; one output row per block (mb=1) and two threads move the offsets."""
    from hepti.kernels import conv
    x, wt, bias = rand(n, h, w, cin), rand(cout, cin, k, k), rand(cout)
    geo = conv._geometry(x.shape, k, k, stride, padding, dilation, cin, "test")
    assert conv._rows_apply(geo, 1)
    residual = rand(n, geo[4], geo[5], cout)
    y = conv2d(x, wt, bias, stride, padding, dilation, relu="relu", residual=residual,
               threads=threads, _mb=mb)
    assert_conv_close(y, x, wt, bias, stride, padding, dilation, 1, residual, "relu")
    forced = conv2d(x, wt, bias, stride, padding, dilation, relu="relu", residual=residual,
                    threads=threads, _mode=conv._MODE_ROWS, _mb=mb)
    np.testing.assert_array_equal(forced, y)


# Shapes for the fused modes (Cout whole panels: each tile stored once with bias, residual and
# activation): (N, H, W, Cin, Cout, kernel, stride, padding)
FUSED_CASES = [
    (1, 5, 7, 8, 32, 1, 1, 0),  # 1x1: x is A in place, M = 35, a short last tile
    (1, 2, 7, 24, 32, 1, 1, 0),  # M = 14: the short tile as 4 + 1 + 1 rows
    (1, 3, 5, 8, 32, 1, 1, 0),  # M = 15: a short tile of MRF - 1 rows (zero-padded copy)
    (2, 6, 6, 16, 64, 1, 1, 0),  # batch 2, two panels
    (1, 9, 9, 8, 64, 1, 2, 0),  # 1x1 stride 2 (ResNet's downsampling shortcut)
    (1, 6, 24, 16, 32, 3, 1, 1),  # rows of whole tiles: in place, borders gathered
    (2, 9, 17, 8, 32, 3, 1, 1),  # tiles crossing rows and images
    (1, 3, 40, 8, 32, 3, 1, (3, 3, 1, 1)),  # rows whose every tap is padding
    (1, 17, 16, 3, 64, 7, 2, 3),  # the stem, small
    (1, 7, 7, 40, 32, 3, 2, 1),  # stride 2 on a 7x7 map
    (1, 7, 7, 8, 64, 1, 1, 0),  # M = 49 = 5 * 8 + 9: the last whole tile and its row over as one
    (1, 13, 13, 8, 32, 3, 2, 1),  # a 7x7 output (49 pixels) at stride 2, the same
]


@pytest.mark.parametrize("n,h,w,cin,cout,k,stride,padding", FUSED_CASES)
@pytest.mark.parametrize("mode", ["flat", "patches", "rows", "padded"])
@pytest.mark.parametrize("act,with_bias,with_res,mb,threads",
                         [("relu", True, True, 0, 1), (None, False, False, 1, 1),
                          ("relu6", True, False, 0, 2), ("relu", False, True, 9, 1)])
def test_conv2d_fused_modes_against_naive(n, h, w, cin, cout, k, stride, padding, mode, act,
                                          with_bias, with_res, mb, threads):
    """The fused modes (bias, residual and activation applied to the register tile before its
    one store) against the naive twin, wherever they apply."""
    from hepti.kernels import conv
    x, wt = rand(n, h, w, cin), rand(cout, cin, k, k)
    geo = conv._geometry(x.shape, k, k, stride, padding, 1, cin, "test")
    m_mode = {"flat": conv._MODE_FLAT, "patches": conv._MODE_PATCHES,
              "rows": conv._MODE_ROWS_FUSED, "padded": conv._MODE_PADDED}[mode]
    if mode == "flat" and not (k == 1 and stride == 1 and padding == 0):
        pytest.skip("_MODE_FLAT is a 1x1 convolution at stride 1 without padding")
    if mode == "rows" and not conv._rows_apply(geo, 1, conv.MRF):
        pytest.skip("no tile of these rows lies inside x")
    bias = rand(cout) if with_bias else None
    residual = rand(n, geo[4], geo[5], cout) if with_res else None
    if mode == "rows" and mb:
        mb = geo[5]  # whole output rows
    y = conv2d(x, wt, bias, stride, padding, relu=act, residual=residual, threads=threads,
               _mode=m_mode, _mb=mb)
    assert_conv_close(y, x, wt, bias, stride, padding, 1, 1, residual, act)


@pytest.mark.parametrize("n,h,w,cin,cmid,stride,threads", [
    (1, 7, 7, 16, 32, 1, 1),  # 49 pixels: 5 tiles of 8 and the last 9 rows as one tile
    (1, 9, 14, 40, 64, 1, 1),  # tiles crossing rows, two panels
    (2, 5, 5, 8, 32, 1, 1),  # batch 2: tiles crossing images, 50 = 6 * 8 + 2
    (1, 12, 10, 24, 64, 2, 1),  # the 3x3 at stride 2
    (1, 6, 7, 16, 256, 1, 2),  # two threads (8 panels)
    (1, 15, 7, 16, 32, 2, 2),  # two threads, 105 = 13 * 8 + 1, stride 2
    (1, 5, 16, 16, 32, 1, 1),  # rows of whole tiles: _MODE_ROWS_FUSED alone, padded here
])
def test_conv_layer_pair_writes_into_the_bordered_map(n, h, w, cin, cmid, stride, threads):
    """A 1x1 written straight into the zero-bordered map the next 3x3 reads in place
    (`ConvLayer.into`, `ConvLayer.bordered`): the map's interior is the 1x1's output (against
    the naive twin, and bit-equal to its own `_MODE_FLAT` run), its border zero, and the 3x3's
    output bit-equal to the 3x3 on the 1x1's output as usual (its own zero-padded copy, or
    in place with its border tiles gathered: `conv.BORDERED_ROWS`)."""
    w1, b1, w2, b2 = rand(cmid, cin, 1, 1), rand(cmid), rand(cmid, cmid, 3, 3), rand(cmid)
    first = conv.ConvLayer(conv.pack_conv_weight(w1), b1, relu="relu")
    second = conv.ConvLayer(conv.pack_conv_weight(w2), b2, stride, relu="relu")
    x, pad = rand(n, h, w, cin), (1, 1, 1, 1)
    mid = first(x, 0, threads=threads)
    extent = second.border(mid.shape, pad, threads)
    assert extent is not None and first.border(x.shape, 0, threads) is None
    xp = first.into(x, extent, threads)
    hp, wp, top, left = extent
    assert xp.shape == (n, hp, wp, cmid)
    inner = xp[:, top:top + h, left:left + w]
    assert_conv_close(inner, x, w1, b1, act="relu")
    np.testing.assert_array_equal(inner, mid)
    border = xp.copy()
    border[:, top:top + h, left:left + w] = 0.0
    assert not border.any()
    y = second.bordered(xp, mid.shape, pad, threads=threads)
    np.testing.assert_array_equal(y, second(mid, pad, threads=threads))
    # both in one kernel call (one thread): the same bits, residual or not
    np.testing.assert_array_equal(first.pair(second, x, extent, pad), y)
    res = rand(*y.shape)
    np.testing.assert_array_equal(first.pair(second, x, extent, pad, res),
                                  second(mid, pad, res, threads=threads))
    assert second.into(mid, extent, threads) is None  # a 3x3 is not written into a map
    with pytest.raises(ValueError, match="bordered map"):
        second.bordered(xp[:, 1:].copy(), mid.shape, pad, threads=threads)


def test_conv_layer_into_reuses_its_map_only_once_let_go():
    """`ConvLayer.into(reuse=True)` hands back the map of an earlier such call for this
    shape when nobody holds it any more (its border still zero, its interior the new input's
    1x1), and a new map while a caller still holds the old one."""
    from hepti.kernels import conv
    first = conv.ConvLayer(conv.pack_conv_weight(rand(32, 16, 1, 1)), rand(32), relu="relu")
    extent = (9, 9, 1, 1)
    conv._KEPT_MAPS.clear()
    x1, x2 = rand(1, 7, 7, 16), rand(1, 7, 7, 16)
    held = first.into(x1, extent, reuse=True)
    other = first.into(x2, extent, reuse=True)  # held: a new map, the old one untouched
    assert other is not held
    np.testing.assert_array_equal(held, first.into(x1, extent))
    addr = other.ctypes.data
    del held, other
    again = first.into(x2, extent, reuse=True)
    assert again.ctypes.data == addr  # let go: the same map, written again
    np.testing.assert_array_equal(again, first.into(x2, extent))
    other_layer = conv.ConvLayer(conv.pack_conv_weight(rand(32, 16, 1, 1)), rand(32))
    del again
    shared = other_layer.into(x1, extent, reuse=True)  # any layer's, of this shape
    assert shared.ctypes.data == addr
    np.testing.assert_array_equal(shared, other_layer.into(x1, extent))


def test_conv2d_fused_modes_refuse_partial_panels():
    """A fused mode asked for where Cout leaves a partial panel is an error, not a wrong
    answer."""
    from hepti.kernels import conv
    with pytest.raises(ValueError, match="fused modes"):
        conv2d(rand(1, 4, 4, 8), rand(NR + 1, 8, 1, 1), _mode=conv._MODE_FLAT)

@pytest.mark.parametrize("cout,k,stride,padding", [(64, 1, 1, 0), (32, 3, 1, 1), (32, 3, 2, 1),
                                                   (40, 1, 1, 0)])
def test_conv2d_out_is_the_residual(cout, k, stride, padding):
    """out=residual: the fused store writes y over the residual (the same array comes back);
    where it does not apply (Cout 40, a partial panel) a new array does. Same values as with
    a separate output."""
    x, wt, bias = rand(1, 9, 16, 8), rand(cout, 8, k, k), rand(cout)
    ho, wo = (9 + 2 * padding - k) // stride + 1, (16 + 2 * padding - k) // stride + 1
    residual = rand(1, ho, wo, cout)
    want = conv2d(x, wt, bias, stride, padding, relu="relu", residual=residual)
    r = residual.copy()
    got = conv2d(x, wt, bias, stride, padding, relu="relu", residual=r, out=r)
    assert (got is r) == (cout % NR == 0)
    np.testing.assert_array_equal(got, want)
    layer = conv.ConvLayer(conv.pack_conv_weight(wt), bias, stride, relu="relu")
    r = residual.copy()  # ConvLayer's own path for it (the band executor's call)
    got = layer(x, padding, r, out=r)
    assert (got is r) == (cout % NR == 0)
    np.testing.assert_array_equal(got, want)

@pytest.mark.parametrize("height, n_seg, kc, last_rows, has_res, act", [
    (8, 3, 21, 5, True, 1), (8, 1, 64, 8, False, 2), (4, 2, 9, 4, True, 0), (1, 1, 33, 1, True, 2),
    # panels deeper than _tile_ir.B_L1_BYTES (48 KB and more: L1 halves are 16-32 KB), whose
    # k loops prefetch B's rows into L1, up to B_L1_AHEAD rows past the panel's last
    (8, 3, 130, 7, True, 1), (4, 1, 400, 4, False, 0),
])
def test_fused_tiles_against_float64(height, n_seg, kc, last_rows, has_res, act):
    """The fused tile (`direct_tiles_epi*`, each tile `_tile_ir`'s IR) on its own: segments of
    A read in place at a row stride, a panel with a row stride of its own, bias, residual,
    ReLU / ReLU6, and a short last tile whose rows past last_rows stay untouched."""
    kern = {8: mk.direct_tiles_epi, 4: mk.direct_tiles_epi4, 1: mk.direct_tiles_epi1}[height]
    i64, nt, lda, seg_a, ldc, ldr = np.int64, 3, n_seg * kc + 5, kc + 1, 40, 36
    a = rand(nt * height * lda + n_seg * seg_a + kc)
    panel = rand(n_seg * kc + 7, 48)[4:, 8:40]  # rows 48 floats apart, from row 4 (bk0 = 3)
    bias, res = rand(NR), rand(nt * height * ldr + NR + 2)
    c = np.full(nt * height * ldc + NR + 1, 7.0, np.float32)
    kern(i64(0), i64(nt), i64(n_seg), i64(kc), a, i64(2), i64(seg_a), i64(lda), panel, i64(3),
         c, i64(1), i64(ldc), i64(last_rows), bias, res, i64(2), i64(ldr), has_res, i64(act))
    want = np.full(c.shape, 7.0)
    for t in range(nt):
        for i in range(last_rows if t == nt - 1 else height):
            row = t * height + i
            acc = np.zeros(NR)
            for s in range(n_seg):
                ar = a[2 + row * lda + s * seg_a:][:kc].astype(np.float64)
                acc += ar @ panel[3 + s * kc:3 + s * kc + kc].astype(np.float64)
            acc += bias
            if has_res:
                acc += res[2 + row * ldr:][:NR]
            if act:
                acc = np.maximum(acc, 0.0) if act == 1 else np.clip(acc, 0.0, 6.0)
            want[1 + row * ldc:][:NR] = acc
    np.testing.assert_allclose(c, want, rtol=1e-5, atol=1e-5 * math.sqrt(n_seg * kc))


def test_fused_tiles_prefetch_deep_panels_into_l1():
    """The fused tile's k loop prefetches B's rows B_L1_AHEAD ahead into L1 (prefetcht0, in
    the loop taken where the panel is deeper than B_L1_BYTES). The tile in a function of its
    own, not cached (Numba shows no assembly for cached code); `_make`'s L2 prefetch of the
    next panel is prefetcht1, and this tile (tile_epi8) has none."""
    import platform

    from numba import njit

    from hepti.kernels import _tile_ir
    if platform.machine() not in ("x86_64", "AMD64") or not _tile_ir.B_L1_AHEAD:
        pytest.skip("x86 assembly, with the L1 prefetch on")

    @njit(cache=False)
    def tile(a, kc, bp, c, bias):
        _tile_ir.tile_epi8(a, 0, 1, kc, 0, kc, bp, 0, c, 0, NR, 8, bias, bias, 0, 0, False, 0)

    kc = 400
    a, panel = rand(8 * kc), rand(kc, NR)
    c, bias = np.zeros(8 * NR, np.float32), rand(NR)
    tile(a, kc, panel, c, bias)
    np.testing.assert_allclose(c.reshape(8, NR), a.reshape(8, kc).astype(np.float64) @ panel + bias,
                               rtol=1e-4, atol=1e-4)
    asm = "".join(tile.inspect_asm().values())
    assert "prefetcht0" in asm and "prefetcht1" not in asm


@pytest.mark.parametrize("regs, lanes, mr, nv, plan", [
    (32, 16, 8, 2, [((0, 1, 2, 3, 4, 5, 6, 7), (0, 1))]),  # AVX-512: each tile in one pass
    (32, 16, 9, 2, [(tuple(range(9)), (0, 1))]),
    (32, 16, 6, 4, [(tuple(range(6)), (0, 1, 2, 3))]),
    (16, 8, 8, 2, [((0, 1, 2, 3, 4, 5), (0,)), ((0, 1, 2, 3, 4, 5), (1,)), ((6, 7), (0, 1))]),
    (16, 8, 1, 2, [((0,), (0, 1))]),  # AVX2: 4 accumulators, 4 of B, a broadcast
])
def test_register_passes_fit_the_register_file(monkeypatch, regs, lanes, mr, nv, plan):
    """`_tile_ir.register_passes` keeps a tile whole where its accumulators, one row of B and a
    broadcast fit the registers, and else covers every (row, column) once with passes that
    each fit."""
    from hepti.kernels import _tile_ir, config
    monkeypatch.setattr(config, "VECTOR_REGS", regs)
    monkeypatch.setattr(config, "VECTOR_LANES", lanes)
    assert _tile_ir.register_passes(mr, nv) == plan
    for mr, nv in ((8, 2), (9, 2), (4, 2), (6, 4)):
        passes = _tile_ir.register_passes(mr, nv)
        cells = [(i, j) for rows, cols in passes for i in rows for j in cols]
        assert sorted(cells) == [(i, j) for i in range(mr) for j in range(nv)]
        per_v = 16 // lanes
        assert all(per_v * (len(r) * len(c) + len(c)) + 1 <= regs for r, c in passes)


def test_tiles_in_passes_give_the_same_bits(monkeypatch):
    """The IR tiles compiled for AVX2's 16 ymm, where they run as several register passes,
    store the same bits as compiled for AVX-512's 32 zmm (one pass; only the register file
    `register_passes` reads is set, so both compile on any machine), and both agree with
    float64: the fused 8- and 9-row convolution tiles (bias, residual, ReLU6, a deep panel),
    the 6 x 64 tile, and packed_gemm's tile with all of its epilogue."""
    from numba import njit

    from hepti.kernels import _gemm_ir, _tile_ir, config
    rng = np.random.default_rng(3)
    kc, nt = 400, 2  # 400 x 32 floats: deeper than B_L1_BYTES, the L1-prefetching loop

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    a, panels, bias, res = f32(9 * kc), f32(2, kc, NR), f32(2 * NR), f32(9 * NR)
    ap = np.ascontiguousarray(a[:8 * kc].reshape(8, kc).T).reshape(-1)  # k-major, 8 rows
    ao = np.arange(9, dtype=np.int64) * kc
    pf = np.zeros(64 * 16, np.float32)

    def run():
        @njit(cache=False)
        def tiles(a, ao, panels, bias, res, ap, pf):
            c9 = np.zeros(9 * NR, np.float32)
            _tile_ir.tile_epi9_pf(a, 0, 1, kc, 0, kc, panels[0], 0, c9, 0, NR, 9, bias, res, 0,
                                  NR, True, 2, pf, 0, 4, 16)
            c8 = np.zeros(8 * NR, np.float32)
            _tile_ir.tile_epi8(a, 0, 1, kc, 0, kc, panels[1], 0, c8, 0, NR, 8, bias, res, 0,
                               NR, False, 1)
            cw = np.zeros(6 * 2 * NR, np.float32)
            _tile_ir.tile_wide6_pf(a, ao, 1, kc, 0, panels, 0, cw, ao[:6] // kc * 2 * NR,
                                   bias, 0, pf, 0, 4, 16)
            cg = np.ones(8 * NR, np.float32)
            _gemm_ir.tile_packed8(ap, 0, kc, panels[0], 0, cg, 0, NR, True, bias, 0, True,
                                  True, res, 0, NR, True, pf, 0, 4, 16)
            return c9, c8, cw, cg
        return tiles(a, ao, panels, bias, res, ap, pf)

    monkeypatch.setattr(config, "VECTOR_REGS", 32)
    monkeypatch.setattr(config, "VECTOR_LANES", 16)
    whole = run()
    monkeypatch.setattr(config, "VECTOR_REGS", 16)
    monkeypatch.setattr(config, "VECTOR_LANES", 8)
    assert len(_tile_ir.register_passes(8, 2)) > 1
    passes = run()
    for w, p in zip(whole, passes):
        np.testing.assert_array_equal(w, p)

    a64, b64 = a.astype(np.float64).reshape(9, kc), panels.astype(np.float64)
    r64 = res.astype(np.float64).reshape(9, NR)
    want9 = np.clip(a64 @ b64[0] + bias[:NR] + r64, 0.0, 6.0)
    want8 = np.maximum(a64[:8] @ b64[1] + bias[:NR], 0.0)
    want_w = a64[:6] @ np.concatenate([b64[0], b64[1]], axis=1) + bias
    h = a64[:8] @ b64[0] + 1.0 + bias[:NR]
    want_g = h * 0.5 * (1.0 + np.vectorize(math.erf)(h / math.sqrt(2.0))) + r64[:8]
    tol = dict(rtol=1e-4, atol=1e-4 * math.sqrt(kc))
    np.testing.assert_allclose(passes[0].reshape(9, NR), want9, **tol)
    np.testing.assert_allclose(passes[1].reshape(8, NR), want8, **tol)
    np.testing.assert_allclose(passes[2].reshape(6, 2 * NR), want_w, **tol)
    np.testing.assert_allclose(passes[3].reshape(8, NR), want_g, **tol)


def test_pack_conv_weight_layout():
    """Group g's panels are pack_b of B [kh*kw*Cin_g, Cout_g] with rows ordered (ky, kx, c)."""
    wt = rand(2 * (NR + 3), 5, 3, 2)  # 2 groups of NR + 3 output channels
    cw = pack_conv_weight(wt, groups=2)
    assert isinstance(cw, ConvWeight) and not cw.depthwise
    assert (cw.cout, cw.cin, cw.kh, cw.kw, cw.groups, cw.k) == (2 * (NR + 3), 10, 3, 2, 2, 30)
    for g in range(2):
        b = wt[g * (NR + 3):(g + 1) * (NR + 3)].transpose(2, 3, 1, 0).reshape(30, NR + 3)
        np.testing.assert_array_equal(cw.panels[g], pack_b(np.ascontiguousarray(b)).panels)
    dw = pack_conv_weight(rand(6, 1, 3, 3), groups=6)
    assert dw.depthwise and dw.taps.shape == (9, 6)


# --- depthwise --------------------------------------------------------------------------------

# (N, H, W, C, kernel, stride, padding, dilation)
DEPTHWISE_CASES = [
    (1, 13, 15, 32, 3, 1, 1, 1),  # 3x3: four-pixel groups, a leftover pixel, the borders
    (1, 14, 17, 24, 3, 2, 1, 1),  # 3x3 stride 2: pairs
    (3, 9, 8, 5, 3, 1, (0, 2, 1, 0), 1),  # batch 3, asymmetric padding, odd channels
    (1, 11, 10, 16, 3, 1, 2, 2),  # dilation 2
    (2, 9, 9, 7, 5, 2, 2, 1),  # kernel 5
    (1, 6, 7, 3, 1, 1, 0, 1),  # kernel 1
    (1, 15, 12, 4, 7, 3, 3, 1),  # kernel 7, stride 3
    (1, 3, 3, 40, 3, 1, 1, 1),  # no pixel has every tap inside
    (1, 6, 11, 48, 3, 1, 1, 1),  # the generated 4 x 16 tiles (c < 64), a leftover pixel
    (2, 7, 22, 16, 3, 1, (1, 0, 1, 1), 1),  # ... batch 2, asymmetric padding
]


@pytest.mark.parametrize("n,h,w,c,k,stride,padding,dilation", DEPTHWISE_CASES)
def test_depthwise_against_naive(n, h, w, c, k, stride, padding, dilation):
    x, wt, bias = rand(n, h, w, c) * 2, rand(c, 1, k, k), rand(c)
    y = depthwise_conv2d(x, wt, bias, stride, padding, dilation, relu="relu6")
    assert_conv_close(y, x, wt, bias, stride, padding, dilation, c, act="relu6")
    # the same through conv2d with groups = C, with a residual and without a bias
    residual = rand(*y.shape)
    y2 = conv2d(x, pack_conv_weight(wt, groups=c), None, stride, padding, dilation,
                residual=residual, threads=2)
    assert_conv_close(y2, x, wt, None, stride, padding, dilation, c, residual)


# (N, H, W, C, stride, padding): the vector kernel (_dw_ir) over whole rows, borders included
DEPTHWISE_IR_CASES = [
    (1, 9, 13, 16, 1, 1),  # one channel block, a tail of pixels after the groups of four
    (1, 10, 11, 32, 1, 1),  # MobileNetV2's first block's width, a row of whole groups + 1
    (2, 7, 9, 96, 2, 1),  # 6 blocks, stride 2, batch 2, odd sizes
    (1, 8, 8, 40, 2, (0, 1, 0, 1)),  # 2 blocks and a masked 8-lane block, no top/left pad
    (1, 5, 6, 21, 1, (2, 0, 1, 2)),  # a masked 5-lane block; pad 2: kernel rows all outside
    (1, 4, 3, 960, 1, 1),  # 60 blocks, too narrow for a group of four (no interior pixel...
    (1, 2, 2, 3, 2, 1),  # ... none at all: every pixel a border pixel)
    (1, 9, 9, 8, 1, (1, 1, 0, 0)),  # a single masked block, right-hand columns unpadded
]


@pytest.mark.parametrize("n,h,w,c,stride,padding", DEPTHWISE_IR_CASES)
@pytest.mark.parametrize("act", [None, "relu", "relu6"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_depthwise_vector_kernel(n, h, w, c, stride, padding, act, with_residual):
    """ReLU / ReLU6 and the residual applied in registers, against the float64 reference."""
    x, wt, bias = rand(n, h, w, c) * 3, rand(c, 1, 3, 3), rand(c)
    ho = (h + sum(_pads(padding)[:2]) - 3) // stride + 1
    wo = (w + sum(_pads(padding)[2:]) - 3) // stride + 1
    residual = rand(n, ho, wo, c) if with_residual else None
    y = depthwise_conv2d(x, wt, bias, stride, padding, relu=act, residual=residual)
    assert_conv_close(y, x, wt, bias, stride, padding, 1, c, residual, act=act)


@pytest.mark.parametrize("threads", [1, 2])
def test_depthwise_vector_kernel_bands(threads):
    """Stride-1 rows go to the kernel in bands of DW_ROWS_BYTES (here 6 rows of 13 per image,
    then 1), and threads split the rows mid-image."""
    x, wt, bias = rand(2, 13, 64, 160) * 3, rand(160, 1, 3, 3), rand(160)
    assert conv.DW_ROWS_BYTES // (64 * 160 * 4) == 6
    y = depthwise_conv2d(x, wt, bias, 1, 1, relu="relu6", threads=threads)
    assert_conv_close(y, x, wt, bias, 1, 1, 1, 160, act="relu6")


def _pads(padding):
    """(top, bottom, left, right) of an int or a 4-tuple padding."""
    return (padding,) * 4 if isinstance(padding, int) else padding


def test_depthwise_channel_multiplier_runs_as_grouped_gemm():
    """groups == Cin with 2 outputs per channel is not depthwise: the grouped GeMM runs it."""
    x, wt = rand(1, 8, 8, 4), rand(8, 1, 3, 3)
    cw = pack_conv_weight(wt, groups=4)
    assert not cw.depthwise
    assert_conv_close(conv2d(x, cw, None, 1, 1), x, wt, None, 1, 1, 1, 4)


# --- pooling and activations ------------------------------------------------------------------


@pytest.mark.parametrize("n,h,w,c,k,stride,padding", [
    (1, 12, 12, 8, 3, 2, 1),  # ResNet's max pool
    (3, 9, 7, 5, 2, None, 0),  # VGG's 2x2, odd sizes (floor)
    (1, 8, 8, 64, 2, None, 0),  # ... all four taps at once (_max2x2_span), whole rows
    (2, 9, 10, 16, 2, 1, 1),  # 2x2, stride 1, padding: border pixels tap by tap
    (1, 7, 9, 8, 2, 2, (0, 1, 1, 0)),  # 2x2, asymmetric padding
    (1, 10, 11, 3, 3, 1, (1, 0, 1, 1)),  # asymmetric padding
    (2, 7, 7, 17, (3, 2), (2, 1), (1, 0)),
    (2, 20, 23, 16, 3, 2, 1),  # 3x3 max pool: rows of pixels with all taps inside, at once
    (1, 9, 10, 5, 3, 1, 0),  # ... without padding, stride 1
    (1, 3, 3, 4, 3, 2, 1),  # ... no pixel with all its taps inside
])
def test_pools_against_naive(n, h, w, c, k, stride, padding):
    x = rand(n, h, w, c)
    np.testing.assert_array_equal(max_pool2d(x, k, stride, padding),
                                  naive.max_pool2d(x, k, stride, padding).astype(np.float32))
    np.testing.assert_allclose(avg_pool2d(x, k, stride, padding),
                               naive.avg_pool2d(x, k, stride, padding), rtol=1e-5, atol=1e-6)


def test_global_avg_pool():
    x = rand(3, 7, 5, 19)
    np.testing.assert_allclose(global_avg_pool(x), naive.global_avg_pool(x), rtol=1e-5,
                               atol=1e-6)
    assert global_avg_pool(rand(2, 1, 1, 4)).shape == (2, 4)


def test_relu_relu6_out_of_place_and_in_place():
    x = rand(2, 5, 3, 7) * 8
    np.testing.assert_array_equal(relu(x), np.maximum(x, 0))
    np.testing.assert_array_equal(relu6(x), naive.relu6(x).astype(np.float32))
    x2 = x.copy()
    assert relu6(x2, out=x2) is x2
    np.testing.assert_array_equal(x2, naive.relu6(x).astype(np.float32))
    v = rand(33)
    assert relu(v, out=v) is v and v.min() >= 0


# --- BatchNorm folding ------------------------------------------------------------------------


@pytest.mark.parametrize("with_bias", [True, False])
def test_fold_batchnorm_equals_conv_then_batchnorm(with_bias):
    cout, eps = 12, 1e-5
    x, wt = rand(2, 9, 8, 6), rand(cout, 3, 3, 3)
    b = rand(cout) if with_bias else None
    gamma, beta, mean = rand(cout), rand(cout), rand(cout)
    var = RNG.random(cout, dtype=np.float32) + 0.1
    w_f, b_f = fold_batchnorm(wt, b, gamma, beta, mean, var, eps)
    assert w_f.dtype == b_f.dtype == np.float32 and w_f.shape == wt.shape
    want = naive.batchnorm(naive.conv2d(x, wt, b, 2, 1, groups=2), gamma, beta, mean, var, eps)
    np.testing.assert_allclose(naive.conv2d(x, w_f, b_f, 2, 1, groups=2), want, rtol=1e-5,
                               atol=1e-5)
    got = conv2d(x, pack_conv_weight(w_f, groups=2), b_f, 2, 1)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# --- bad arguments ----------------------------------------------------------------------------


def test_conv_rejects_bad_arguments():
    x, wt = rand(1, 6, 6, 4), rand(8, 4, 3, 3)
    cw = pack_conv_weight(wt)
    with pytest.raises(ValueError, match="channels"):
        conv2d(rand(1, 6, 6, 5), cw)
    with pytest.raises(ValueError, match="4-D"):
        conv2d(rand(6, 6, 4), cw)
    with pytest.raises(TypeError, match="float32"):
        conv2d(x.astype(np.float64), cw)
    with pytest.raises(ValueError, match="smaller than"):
        conv2d(rand(1, 2, 6, 4), cw)
    with pytest.raises(ValueError, match="padding"):
        conv2d(x, cw, padding=(1, 2, 3))
    with pytest.raises(ValueError, match="stride"):
        conv2d(x, cw, stride=0)
    with pytest.raises(ValueError, match="groups"):
        conv2d(x, cw, groups=2)
    with pytest.raises(ValueError, match="divide"):
        pack_conv_weight(rand(6, 2, 3, 3), groups=4)
    with pytest.raises(ValueError, match="relu"):
        conv2d(x, cw, relu="gelu")
    with pytest.raises(ValueError, match="residual"):
        conv2d(x, cw, residual=rand(1, 4, 4, 7))
    with pytest.raises(ValueError, match="shape"):
        conv2d(x, cw, out=np.empty((1, 4, 4, 7), np.float32))
    with pytest.raises(ValueError, match="bias"):
        conv2d(x, cw, bias=rand(7))
    with pytest.raises(ValueError, match="overlaps"):
        flat = rand(4 * 4 * 8 + 8)  # out and residual overlap, shifted by a pixel
        conv2d(x, cw, residual=flat[8:].reshape(1, 4, 4, 8), out=flat[:-8].reshape(1, 4, 4, 8))
    with pytest.raises(ValueError, match="depthwise"):
        depthwise_conv2d(x, rand(4, 2, 3, 3))
    with pytest.raises(ValueError, match="depthwise"):
        depthwise_conv2d(x, cw)
    with pytest.raises(ValueError, match="kernel_size"):
        max_pool2d(x, 0)
    with pytest.raises(ValueError, match="smaller than"):
        avg_pool2d(x, 7)
    with pytest.raises(ValueError, match=r"gamma must have shape \(8,\)"):
        fold_batchnorm(wt, None, rand(7), rand(8), rand(8), rand(8), 1e-5)
