"""2-D convolution and pooling on NHWC float32 feature maps, for the CNN family (MobileNetV2,
ResNet-50, VGG-16).

Layout: x is [N, H, W, C] (channels innermost, what the GeMM wants as its K axis and what
vectorises in depthwise and pooling loops); weights arrive in PyTorch's layout
[Cout, Cin/groups, kh, kw] and are packed once at load time by `pack_conv_weight`.

A convolution is a GeMM per group g: the M = N*Ho*Wo output pixels are the rows, a pixel's
receptive field is its row of K = kh*kw*Cin_g values (ordered ky, kx, c, so that for one ky
and dilation 1 the kx and c part is one contiguous run of kw*Cin floats in NHWC x), and the
packed weight [K, Cout_g] is B. Per block of MC output rows (packed_gemm.row_block: the block
stays in L2) the patches are packed straight from x into the A tiles the micro-kernel reads
(`_pack_patches`: implicit im2col, no [M, K] patch matrix), then every packed panel of B runs
over the block with the GeMM's fused bias / residual epilogue, then ReLU/ReLU6 on the block
while it is still in L2. A 1x1 convolution with stride 1 and no padding needs no patches at
all: its A is x itself, [N*H*W, C] (`_pack_a` on x).

Measured 2026-11-26 (ms, batch 1, one thread, median of 7, bias + ReLU included; 2-core Zen 4
EPYC with other benchmarks running, load average 2.2; `python -m hepti.bench.convbench
--repeat 7`):
    layer                                    explicit  im2col/block  implicit (GFLOP/s)
    MobileNetV2 stem 224x224x3 3x3 s2 -> 32     1.38        1.40        0.53  (41)
    ResNet-50 stem 224x224x3 7x7 s2 -> 64       8.26        7.42        3.23  (73)
    ResNet-50 56x56x64 3x3 -> 64                3.20        3.02        2.66  (87)
    ResNet-50 14x14x256 3x3 -> 256              2.37        2.33        2.28  (101)
    VGG-16 224x224x64 3x3 -> 64                55.7        49.2        44.0   (84)
    1x1 stride 1                             gemm(x)+relu  direct (conv2d's path)
    MobileNetV2 112x112x32 -> 16                0.50        0.52  (memory-bound: K=32, N=16)
    MobileNetV2 56x56x24 -> 144                 0.45        0.45
explicit = the whole [M, K] patch matrix, then one gemm(); im2col/block = each MC-row block's
patch rows copied into a buffer, then packed; implicit = packed straight from x (what conv2d
does). Implicit won every shape: by 2.5x on the 3-channel stems (a patch row there is many
3-float copies; packing 8 pixels at once from x reads kw*3 contiguous floats per tap row) and
by 4-27% on the wide layers (the patch copy is traffic the GeMM does not need; least where
K = 2304 makes the GeMM dominate). In three later runs under heavier load (load average 4-5,
medians up to 2x slower) implicit stayed the fastest on every shape (by median, and by min
in the two that recorded it). Rows per block (64 .. 2048) changed nothing beyond noise, so
packed_gemm.row_block's choice is kept.

Where a tile of MR output pixels reads all its taps inside x, even packing is a copy the GeMM
need not make (`_MODE_ROWS`, what conv2d picks where it applies): one kernel row's taps of a
pixel are one contiguous run of kw*C floats in NHWC x, and the tile's MR pixels start sw*C
apart, so x itself is the tile of A with lda = sw*C (`direct_tiles`; the kernel rows are
summed in registers, those in the padding skipped). Only each output row's border columns
and short tail are packed. Measured 2026-11-27 (ms, same conditions, `python -m
hepti.bench.convbench --repeat 7`, medians; GFLOP/s of the in-place one):
    layer                                    implicit (or direct)  in place (GFLOP/s)
    VGG-16 224x224x64 3x3 -> 64                 48.8                  38.3  (97)
    VGG-16 112x112x128 3x3 -> 128               43.7                  37.2  (99)
    VGG-16 56x56x256 3x3 -> 256                 38.9                  34.9  (106)
    VGG-16 28x28x512 3x3 -> 512                 47.7                  40.2  (92)
    ResNet-50 56x56x64 3x3 -> 64                3.08                  2.59  (89)
    ResNet-50 56x56x128 3x3 s2 -> 128           2.88                  2.58  (90)
    ResNet-50 stem 224x224x3 7x7 s2 -> 64       4.28                  3.51  (67)
    ResNet-50 1x1 56x56x256 -> 64 (direct)      1.34                  1.11  (93)
    MobileNetV2 1x1 112x112x32 -> 16 (direct)   0.53                  0.44  (29)
The copy is about a cycle per float of A and the GeMM does Cout/16 vector FMAs per float of
A, so the gain is largest where Cout is small. Rows up to 16 wide (a 3x3 kernel, padding 1)
leave no whole tile in place after the left border's packed tile: they stay implicit (in
place was slower in 4 of 5 interleaved readings, by 4-24%, and 10% faster in one;
`_direct_span`). A 1x1 stride-1 layer stays direct when its rows are not whole tiles (direct
packs across rows, with no short tile per row). VGG-16 went from 1.04x torch's latency to
0.93-0.94x with this (`bin/bench-cnn-single.sh`).

Fused store (2026-11-29). Where Cout is whole panels of NR (groups 1: all of ResNet-50's and
VGG-16's convolutions), each MR x NR tile of C is stored once, with the bias, the residual and
ReLU/ReLU6 applied to it in registers (`direct_tiles_epi`): no epilogue pass over each strip,
no activation pass over each block. A 1x1 convolution at stride 1 reads x as A in place over
the flat M (`_MODE_FLAT`: tiles cross output rows, so 14- and 28-wide rows leave no short
tile); rows of whole tiles keep reading patches in place, their border tiles gathered as
patch rows (`_MODE_ROWS_FUSED`); other shapes gather each block's patch rows row-major
(`_MODE_PATCHES`, an im2col per block, which the fused store made the faster way on 28-, 14-
and 7-wide maps and at stride 2). out may be the residual itself: the fused store reads each
residual element just before it overwrites it. Measured (ms, min of 15 interleaved rounds,
1 thread, load average ~2; the old default mode against the new, each forced with _mode;
`python -m hepti.bench.convbench` times the new one as "fused"):
    layer (ResNet-50 at 224)                 before   fused   (GFLOP/s fused)
    1x1 56x56x64 -> 256 + residual + ReLU      2.36     1.43   (72; 0.98 written over the
                                                                residual, against 1.09 apart)
    1x1 28x28x128 -> 512 + residual            1.30     1.00   (103)
    1x1 14x14x256 -> 1024 + residual           1.08     0.94   (109)
    1x1 28x28x512 -> 128                       1.15     0.94   (109)
    1x1 56x56x64 -> 64                         0.35     0.27   (97)
    3x3 14x14x256 -> 256                       2.46     2.26   (102)
    3x3 28x28x256 -> 256 stride 2              2.44     2.25   (103)
    stem 224x224x3 7x7 stride 2                2.79     2.70   (87)
On the whole model (each op timed alone, min of 9, against onnxruntime's per-node profile,
load average 5-6) the convolutions went from 95.0 ms to 86.9 ms, onnxruntime's 75.5: 1x1s
46.5 -> 39.2 (ORT 33.0), 3x3s 30.7 -> 31.1 (27.0), stem 2.87 -> 2.61 (2.16).

Padded rows (2026-11-29, later). The fused tile is explicit-vector LLVM IR (`_tile_ir`), and
a variant of it takes each of its rows' A offsets from an array: on a zero-padded copy of x
(`_zero_padded`: the input's size, not the patches' K floats a pixel) a tile of MRF
consecutive output pixels may cross output rows and still read every patch in place, with no
border tiles (`_MODE_PADDED`, `_padded_fused`). It replaces `_MODE_PATCHES` wherever a kernel
row is one contiguous run (28-, 14- and 7-wide maps, stride 2), and `_MODE_ROWS_FUSED` where
those runs are short at a stride of 2 (kw * Cin < PADDED_RUN: the stem). Interleaved
against the previous conv2d (min of 11-15 rounds, load 2.5-3; the image at 224 / at 160, where
the same layers are 20, 10 and 5 wide): 3x3 28x28x128 2.14 -> 2.03 ms / 1.11 -> 1.04, 3x3
14x14x256 2.08 -> 2.03 / 1.06 -> 1.04, VGG-16's 28x28x512 33.3 -> 32.7 / 17.1 -> 16.8, its
14x14x512 8.45 -> 8.23 / 4.26 -> 4.26, 3x3 stride 2 56 -> 28 2.14 -> 2.09 / 1.11 -> 1.07, 1x1
stride 2 1.88 -> 1.84 / 0.96 -> 0.94, the stem 2.26 -> 2.17 / 1.18 -> 1.11; the 7x7 maps
unchanged.

Bordered pairs (2026-11-30). That copy goes too where a 1x1 at stride 1 makes the map: the
1x1 (`ConvLayer.into`, `_into_fused`) stores each tile's rows at offsets of their own
(`_tile_ir.tile_scattered8`), into the interior of the zero-bordered map the next
convolution reads in place (`ConvLayer.border`, `ConvLayer.bordered`; hepti.model.cnn
`apply_pair`, ResNet-50's bottleneck). A 3x3 that would run `_MODE_ROWS_FUSED` runs
`_MODE_PADDED` on such a map (`BORDERED_ROWS`: no gathered border tiles). Outputs bit-equal.
Interleaved per pair (1x1 then 3x3, ResNet-50's shapes, 1 thread, load ~8, 41-61 rounds):
0.97-0.99x the time at 160 (0.32 ms a forward), 0.965-0.97x at stride 2 and 0.99-1.0x
elsewhere at 224 (0.37 ms a forward).

`depthwise_conv2d` (groups == C == Cout, MobileNetV2's 3x3s) has its own kernel, with the
loop over contiguous channels innermost (it vectorises). A 3x3 at stride 1 or 2 runs an
explicit-vector LLVM IR kernel over bands of rows (`_dw_ir`): per 16-channel block the nine
taps stay in registers, the input columns slide along each row (each loaded once per kernel
row), border pixels included (zero rows and columns outside the image), the residual and
ReLU/ReLU6 applied before the store. MobileNetV2's seventeen depthwise layers took 1.16 ms
with the scalar 4-pixel groups Numba's SLP vectoriser packed (`_dw3x3_quads`, `_dw3x3_pairs`,
a generated 4 x 16 tile) and their borders tap by tap, 0.69 ms with it (interleaved, 1
thread, load ~3; stride 1: 59-92 GFLOP/s against 30-42, 2.0-2.4x; stride 2: 30-40 against
26-31, 1.1-1.5x). Other 3x3s (dilated columns, stride 3) take their interior pixels' nine
taps in registers (`_dw3x3_span`), other kernel sizes and their borders the tap-by-tap loop
(`_dw_pixel`). Pools likewise, except 3x3 and 2x2 max pools, whose interior pixels take
their taps at once in registers (`_max3x3_span`, `_max2x2_span`; VGG-16's five 2x2 pools at
224: 1.14 -> 0.42 ms, interleaved, 1 thread, load 3.4).

Padding is per side, (top, bottom, left, right), so that a band of output rows can be computed
from a band of input rows with padding only where the band meets the image border (a height
split: see docs/cnn.md, "Height split").
"""
from __future__ import annotations

import functools
import sys

import numba
import numpy as np
from numba import njit, prange

from hepti.kernels import config
from hepti.kernels._dw_ir import dw3x3_s1, dw3x3_s2
from hepti.kernels._intrinsics import max_f32, prefetch_l2, prefetch_w
from hepti.kernels._microkernels import (MR, MRF, NR, direct_tiles, direct_tiles_epi,
                                         direct_tiles_epi1, direct_tiles_epi4, full_tiles,
                                         micro_tile, pack_a_tile)
from hepti.kernels._tile_ir import (MR_NINE, MR_WIDE, tile_epi8_pf, tile_epi9_pf,
                                    tile_gathered1, tile_gathered4, tile_gathered8,
                                    tile_gathered8_pf, tile_gathered9_pf, tile_scattered1,
                                    tile_scattered4, tile_scattered8, tile_scattered8_pf,
                                    tile_scattered9_pf, tile_wide6_pf)
from hepti.kernels._views import EMPTY, aligned_empty, check_float32, pad16, vector, workspace
from hepti.kernels.config import FASTMATH_GEMM, FASTMATH_ROWS, JIT
from hepti.kernels.packed_gemm import (_epilogue, _finish, _pack_a, _pack_all, _panel_range,
                                      panel_group, row_block, run_chunks)

_ACT = {None: 0, "relu": 1, "relu6": 2}
# input bytes of the output rows one call of the depthwise IR kernel runs at stride 1 (each
# channel block walks them all, its input rows reused from L1): 0.76-0.89x the time of one row
# per call at 56x56x144, 28x28x192 and 14x14x384-576, 0.85-1.08x at 112x112x32 and 7x7x960
# (two runs); at stride 2 one row per call was 1.03-1.2x faster than several in one run, with
# one exception (interleaved, 1 thread, load ~4; MobileNetV2's shapes)
DW_ROWS_BYTES = 1 << 18
# how A is formed (_conv_rows); the last three store each tile once, its epilogue applied
_MODE_DIRECT, _MODE_IMPLICIT, _MODE_IM2COL, _MODE_ROWS = 0, 1, 2, 3
_MODE_FLAT, _MODE_PATCHES, _MODE_ROWS_FUSED = 4, 5, 6
_MODE_PADDED = 7  # fused, on a zero-padded copy of x: every tile's rows read x in place
_FUSED_MODES = (_MODE_FLAT, _MODE_PATCHES, _MODE_ROWS_FUSED, _MODE_PADDED)
# _MODE_PADDED, not _MODE_ROWS_FUSED, at a stride across > 1 and below this many floats a
# kernel row (kw * Cin): the segments are short there and the border tiles a larger share of
# a row's (interleaved, forced modes, 61 rounds, twice: ResNet-50's stem, 7 x 3 = 21 floats,
# 0.95-0.96x the time at 224, 0.94x at 160; at stride 1 VGG-16's first layer, 3 x 3 = 9,
# measured 1.00-1.02x, and a 3x3 on 64 channels, 192, 1.00x: they keep _MODE_ROWS_FUSED)
PADDED_RUN = 64
# _MODE_PADDED's row blocks on one thread hold at least this many output pixels (or all of
# them) where the packed weight is over half of L2: the mode packs no A, so packed_gemm's
# row_block (an A block of half of L2) only sets how often the panels are read again from L3
# (24 pixels a block at K = 4608: ResNet-50's 7x7 stage read its 9.4 MB weight per 24
# pixels). Forced blocks, interleaved, 1 thread (CPU time, 9-11 rounds, outputs bit-equal;
# ResNet-50's and VGG-16's 3x3s at 224): 7x7x512 0.93-0.94x the time, 14x14x512 stride 2
# 0.92x, 56x56x128 stride 2 0.96x, 14x14x512 0.97-0.98x, 28x28x512 0.99x, 28x28x128 and
# 14x14x256 0.98-0.99x; blocks of 784 to the whole map measured alike. _MODE_ROWS_FUSED
# keeps its blocks (VGG-16's 56- and 112-wide maps: 1.03-1.10x the time in blocks of 896
# and more).
PADDED_BLOCK = 784
# `_padded_into` runs pairs of panels as one MR_WIDE x 64 tile where a pair fits in L2 (K up to
# this; VGG-16's K = 4608 layers measured 1.00-1.01x the time with it, its K <= 2304 ones
# 0.83-0.99x: hepti.kernels.plain_chain)
PADDED_WIDE_K = config.L2_BYTES // (2 * NR * 4)
# a convolution that would run _MODE_ROWS_FUSED runs _MODE_PADDED where the layer before it
# writes its input into a zero-bordered map (ConvLayer.border; ResNet-50's 3x3s on 56-wide
# maps): no copy to make there, and no gathered border tiles
BORDERED_ROWS = True
# `_tiles_fused` (a 1x1 at stride 1 on x in place) runs every panel on a tile before the next
# tile where the packed weight (K x Cout) takes at most this many bytes, and each panel over
# all the tiles before the next panel above it. Panel by panel, each pass reads (the residual)
# and writes 32 floats of every output row, Cout * 4 bytes apart (1 KB on layer1's 56x56x256
# map): streams the L2 prefetcher does not follow across 4 KB pages, from L3 or memory on maps
# larger than L2. Tile by tile, the tile's rows are read and written whole, one after the
# other, and the panels come again from L2 for each tile, which pays while they are a small
# part of it. On an Emerald Rapids core (2 MiB L2; in-process, interleaved, bit-equal, 40
# rounds, thread time, median ratios), with the residual (ResNet-50's 1x1 that ends each
# bottleneck, written over it): 64 -> 256 at 56x56 0.82x the time (105 -> 137 GFLOP/s), 128 ->
# 512 at 28x28 0.98x, at 160 (40x40, 20x20) 0.91x and 0.95x, 256 -> 1024 (1 MB of weight)
# 1.02x, so a quarter of L2, not half; without (layer1's downsample): 64 -> 256 at 56x56 0.87x,
# 64 -> 64 0.92x, 128 -> 512 0.96x, 256 -> 64 and 512 -> 128 0.98-1.02x.
# Tile by tile, each panel's call also prefetches into L2 the next tile's residual lines of
# its panel (the panel-by-panel loop had; here nothing did, and each tile's epilogue waited
# on L3 for them): with the maps in L3, Emerald Rapids, in-process against the tree before,
# interleaved, thread time, 40-60 rounds, bit-equal: 64 -> 256 at 56x56 0.88x and 0.93x the
# time, 128 -> 512 at 28x28 0.90-0.93x. The same for the output lines without a
# residual (prefetched for writing, as the panel-by-panel loop does) read 1.04-1.11x: not.
BY_TILES_BYTES = config.L2_BYTES // 4
# The fused tiles of a panel prefetch the next panel into L2 along their k loops, an equal
# share each (`_pf_share`, `_tile_ir._make`'s prefetch), where this panel and the next fit in
# L2 together. In a forward the weights come from memory (ResNet-50's 100 MB pass through L3
# once), and the L2 streamer, which stops at each 4 KB page, left the first tile of every panel
# waiting on it: on an Emerald Rapids core the 7x7x512 3x3 (9.4 MB of weight, 7 tiles a panel)
# ran 1.6x the time with its weight fresh from memory as with it in L3; prefetched, 0.73x the
# time of the same cold run, as fast as warm (in-process scratch, interleaved, bit-equal).
# Whole forwards in one process, the two trees taking turns (median of per-round ratios, 20-30
# rounds): ResNet-50 at 224 0.90-0.92x the time, VGG-16 0.96x. VGG-16's pairs of panels at K =
# 4608 (1.2 MB a pair) prefetching the next pair ran 1.04-1.10x the time cold: two pairs do not
# fit in a 2 MiB L2, hence the cap.
PANEL_PREFETCH = True
# A 1x1's tile prefetches the next tile's rows of A into L2 along its k loop where it reads
# them first: every tile over its panels (BY_TILES_BYTES), else the first panel's tiles (the
# others prefetch the next panel). The tile reads its MRF rows as MRF streams a row apart (1 KB
# on layer1's 56x56x256 map), which the L2 streamer follows poorly from a map larger than L2.
# Emerald Rapids, tile by tile, in-process scratch, maps fresh from memory (warm: in cache),
# bit-equal: 56x56 256 -> 64 0.76-0.80x the time (warm 0.80-0.86x), 256 -> 128 0.92x (0.93x),
# 28x28 512 -> 128 0.88-0.99x (0.95-1.05x).
ROWS_PREFETCH = True
# `ConvLayer.pooled` makes its convolution's output rows this many at a time, the max pool's
# rows that read them right after (in-process scratch, interleaved, bit-equal: VGG-16's
# conv1_2 then its 2x2 pool 0.987x the time of the two apart in blocks of 2 rows, 0.991x of
# 4, 0.994x of 8; ResNet-50's stem and 3x3/2 pool 0.95-0.97x in blocks of 2 to 16), where
# its panels fit in half of L2 (`pooled_rows`)
POOLED_ROWS = 2


class ConvWeight:
    """A convolution weight packed once (at load time) for `conv2d`.

    panels: float32 [groups, n_panels, kh*kw*cin_g, NR]; panels[g] are the pack_b panels of
    group g's B [K_g, Cout_g], B[(ky*kw + kx)*cin_g + c, j] = w[g*Cout_g + j, c, ky, kx].
    A depthwise weight (groups == Cin == Cout) is kept instead as taps: float32 [kh*kw, C],
    taps[ky*kw + kx, c] = w[c, 0, ky, kx], and panels is empty.
    """

    __slots__ = ("panels", "taps", "cout", "cin", "kh", "kw", "groups")

    def __init__(self, panels: np.ndarray, taps: np.ndarray, cout: int, cin: int, kh: int,
                 kw: int, groups: int):
        self.panels, self.taps = panels, taps
        self.cout, self.cin, self.kh, self.kw, self.groups = cout, cin, kh, kw, groups

    @property
    def depthwise(self) -> bool:
        """True when this is a depthwise weight (one input and one output channel per group)."""
        return self.taps.size > 0

    @property
    def k(self) -> int:
        """Rows of each group's B: kh * kw * Cin/groups."""
        return self.kh * self.kw * (self.cin // self.groups)

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes + self.taps.nbytes

    def __repr__(self) -> str:
        return (f"ConvWeight(cout={self.cout}, cin={self.cin}, kernel={self.kh}x{self.kw}, "
                f"groups={self.groups}, nbytes={self.nbytes})")


# ------------------------------------------------------------------------------------------
# @njit kernels: arithmetic only
# ------------------------------------------------------------------------------------------
# geo, the geometry of one convolution, is the int tuple
#   (n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg)
# (batch, input height/width/channels, output height/width, kernel, stride, top/left padding,
# dilation, channels per group). Output pixel m = (b*Ho + oy)*Wo + ox; tap (ky, kx) of it
# reads input row iy = oy*sh - pt + ky*dh, column ix = ox*sw - pl + kx*dw (zero outside).


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _patch_row(x, geo, c0, m, dst, d_off):
    """dst[d_off : d_off + K] = the receptive field of output pixel m, channels c0 .. c0+cg-1
    of each tap, ordered (ky, kx, c); zeros where a tap falls in the padding."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    b = m // (ho * wo)
    oy = (m // wo) % ho
    ox = m % wo
    p = d_off
    for ky in range(kh):
        iy = oy * sh - pt + ky * dh
        if iy < 0 or iy >= h:
            for q in range(p, p + kw * cg):
                dst[q] = 0.0
            p += kw * cg
            continue
        row = (b * h + iy) * w
        for kx in range(kw):
            ix = ox * sw - pl + kx * dw
            seg = dst[p:p + cg]
            if 0 <= ix < w:
                src = x[(row + ix) * c + c0:(row + ix) * c + c0 + cg]
                for q in range(cg):
                    seg[q] = src[q]
            else:
                for q in range(cg):
                    seg[q] = 0.0
            p += cg


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _im2col(x, geo, c0, m0, m1, dst, ldd):
    """Rows m0 .. m1-1 of the patch matrix into dst (flat, row i at dst[i * ldd])."""
    for m in range(m0, m1):
        _patch_row(x, geo, c0, m, dst, (m - m0) * ldd)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _pack_row_tile(x, geo, c0, b, oy, ox, tile):
    """tile [K, MR] = the patches of the MR output pixels (b, oy, ox .. ox+MR-1), one row of
    the output. For each tap the MR pixels read x at a fixed stride (sw * C), so a tap whose
    columns are inside the image for all of them is packed from x by the 8-row packer; a tap
    row (ky) whose kw*C floats are contiguous (groups 1, dilation 1) is packed in one go."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    lda = sw * c
    ix_first = ox * sw - pl
    whole_rows = cg == c and (dw == 1 or kw == 1) and ix_first >= 0 and \
        ix_first + (MR - 1) * sw + kw - 1 < w
    p = 0
    for ky in range(kh):
        iy = oy * sh - pt + ky * dh
        if iy < 0 or iy >= h:
            for q in range(p, p + kw * cg):
                t = tile[q]
                for i in range(MR):
                    t[i] = 0.0
            p += kw * cg
            continue
        row = (b * h + iy) * w
        if whole_rows:
            pack_a_tile(x, (row + ix_first) * c, lda, kw * c, tile[p:p + kw * c])
            p += kw * c
            continue
        for kx in range(kw):
            ix0 = ix_first + kx * dw
            seg = tile[p:p + cg]
            if ix0 >= 0 and ix0 + (MR - 1) * sw < w:
                pack_a_tile(x, (row + ix0) * c + c0, lda, cg, seg)
            else:
                for i in range(MR):
                    ix = ix0 + i * sw
                    if 0 <= ix < w:
                        src = x[(row + ix) * c + c0:(row + ix) * c + c0 + cg]
                        for q in range(cg):
                            seg[q, i] = src[q]
                    else:
                        for q in range(cg):
                            seg[q, i] = 0.0
            p += cg


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _pack_patches(x, geo, c0, m0, rows, k, apack, tilebuf):
    """apack [tiles, K, MR] = the patches of output pixels m0 .. m0+rows-1 (implicit im2col).

    A tile of MR pixels within one output row is packed from x directly (`_pack_row_tile`);
    one that crosses a row (or the short last one) goes through tilebuf [MR * K]: its patch
    rows are gathered there, then packed.
    """
    ho, wo = geo[4], geo[5]
    for t in range(-(-rows // MR)):
        tile = apack[t]
        r = m0 + t * MR
        nr = min(MR, m0 + rows - r)
        ox = r % wo
        if nr == MR and ox + MR <= wo:
            _pack_row_tile(x, geo, c0, r // (ho * wo), (r // wo) % ho, ox, tile)
            continue
        for i in range(nr):
            _patch_row(x, geo, c0, r + i, tilebuf, i * k)
        if nr == MR:
            pack_a_tile(tilebuf, 0, k, k, tile)
        else:
            for i in range(nr):
                src = tilebuf[i * k:(i + 1) * k]
                for p in range(k):
                    tile[p, i] = src[p]


@njit(**JIT)
def _edge_starts(ox_lo, ox_hi, wo, mr):
    """First columns of the packed tiles of an output row: mr at a time over 0 .. ox_lo-1,
    then over ox_hi .. wo-1 (each tile ends at its range's end)."""
    starts = []
    for ox in range(0, ox_lo, mr):
        starts.append(ox)
    for ox in range(ox_hi, wo, mr):
        starts.append(ox)
    return starts


@njit(**JIT)
def _direct_span(geo, mr):
    """(ox0, n_tiles): output columns ox0 .. ox0 + n_tiles*mr - 1 of every output row read all
    their taps inside x, as n_tiles tiles of mr pixels (MR, or MRF for `_rows_fused`), so
    `_rows_block` reads their A from x in place; the columns left and right of them are
    packed. ox0 is the first multiple of mr at or past the first such column, so the left
    border is one full packed tile, not a sliver: short tiles run on a stack of narrower
    kernels, each a pass over B. (Starting at the first in-image column instead measured
    4-20% slower on ResNet-50's and VGG-16's 3x3 layers, interleaved; on rows 14 wide it
    left 1 tile in place and 6 columns in two slivers, 4-24% slower than packing them all in
    4 of 5 readings.)"""
    w, wo, kw, sw, pl, dw = geo[2], geo[5], geo[7], geo[9], geo[11], geo[13]
    ox_lo = -(-pl // sw)  # first column whose first tap reads ix >= 0
    # column ox's last tap reads ix = ox*sw - pl + (kw-1)*dw, which must be < w
    span = w - 1 + pl - (kw - 1) * dw
    ox_hi = min(wo, span // sw + 1) if span >= 0 else 0
    ox0 = -(-ox_lo // mr) * mr
    return ox0, max(0, ox_hi - ox0) // mr


@njit(**JIT)
def _rows_inside(oy, sh, pt, kh, dh, h):
    """(ky0, ky1): the kernel rows ky0 .. ky1-1 of output row oy that fall inside the h input
    rows (iy = oy*sh - pt + ky*dh rises with ky); the rest read padding."""
    ky0 = 0
    while ky0 < kh and oy * sh - pt + ky0 * dh < 0:
        ky0 += 1
    ky1 = ky0
    while ky1 < kh and oy * sh - pt + ky1 * dh < h:
        ky1 += 1
    return ky0, ky1


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _rows_block(x, geo, k, n_g, panels, c, ldc, m0, rows, epi, edge, buf, scratch):
    """Output pixels m0 .. m0+rows-1 (whole output rows) of a convolution with groups 1 and
    one contiguous run of kw*C floats per kernel row (dilation 1 across, or kw 1), its A read
    from x in place (`direct_tiles`) wherever a tile's patches lie inside x.

    For each kernel row ky, the MR pixels of a tile read kw*C contiguous floats each, at a
    stride of sw*C: a tile of A with lda = sw*C, whose B rows are ky*kw*C onward. The kernel
    rows that fall in the padding are skipped (their products are zero); the others are
    summed in registers. The columns left and right of the in-place tiles (`_direct_span`)
    are packed into edge (`_pack_patches`, MR pixels or fewer a tile) and run on the packed
    kernels over the same rows of K. Then the GeMM's epilogue (bias, residual) as in
    packed_gemm._strip; scratch [rows * NR] takes a partial last panel.
    """
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    run = kw * cin
    lda = sw * cin
    ox_lo, n_direct = _direct_span(geo, MR)  # columns ox_lo .. ox_hi-1 are read in place
    ox_hi = ox_lo + n_direct * MR
    n_rows = rows // wo
    r0 = m0 // wo  # first output row, b * Ho + oy
    starts = _edge_starts(ox_lo, ox_hi, wo, MR)  # the packed tiles' first columns, every row
    n_edge = len(starts)
    for r in range(n_rows):
        for e in range(n_edge):
            ox = starts[e]
            nr = min(MR, (ox_lo if ox < ox_lo else wo) - ox)
            _pack_patches(x, geo, 0, m0 + r * wo + ox, nr, k,
                          edge[r * n_edge + e:r * n_edge + e + 1], buf)
    pf = x[:0]
    z, one, no = np.int64(0), np.int64(1), np.bool_(False)  # not literals: one signature each
    for jp in range(-(-n_g // NR)):
        j0 = jp * NR
        ncols = min(NR, n_g - j0)
        bp = panels[jp]
        if ncols == NR:
            dst, base, ldd = c, m0 * ldc + j0, ldc
        else:
            dst, base, ldd = scratch, 0, NR
        for r in range(n_rows):
            b, oy = (r0 + r) // ho, (r0 + r) % ho
            d_row = base + r * wo * ldd
            ky0, ky1 = _rows_inside(oy, sh, pt, kh, dh, h)
            if ky1 == ky0:  # every tap of this output row is padding: the products are zero
                for i in range(wo):
                    dst[d_row + i * ldd:d_row + i * ldd + ncols] = 0.0
                continue
            iy0 = oy * sh - pt + ky0 * dh
            x_row = ((b * h + iy0) * w - pl) * cin  # column ox's A row: x_row + ox * lda
            direct_tiles(z, n_direct, ky1 - ky0, run, x, x_row + ox_lo * lda, dh * w * cin,
                         lda, bp, ky0 * run, dst, d_row + ox_lo * ldd, np.int64(ldd), no)
            k0, kc = ky0 * run, (ky1 - ky0) * run  # the packed tiles: those rows of K at once
            for e in range(n_edge):
                ox, s = starts[e], r * n_edge + e
                nr = min(MR, (ox_lo if ox < ox_lo else wo) - ox)
                if nr == MR:
                    full_tiles(z, one, kc, edge[s:s + 1], bp, k0, k0, dst, d_row + ox * ldd,
                               np.int64(ldd), no, pf, z, z)
                else:
                    micro_tile(nr, kc, edge[s], bp, k0, k0, dst, d_row + ox * ldd,
                               np.int64(ldd), no)
        _finish(rows, c, m0 * ldc, ldc, j0, ncols, scratch, epi)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _patch_tile(x, geo, k, m, nr, dst):
    """dst [MRF * K] = the patch rows (row-major, K apart) of output pixels m .. m+nr-1, zero
    rows after them: a border tile's A for `direct_tiles_epi`. Groups 1 and one contiguous
    run per kernel row (`_rows_apply`): the taps of a kernel row inside the image are one
    copy (tap by tap, `_patch_row`, the 7x7 stem's borders took longer than the rest)."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    run = kw * c
    for i in range(nr):
        mm = m + i
        b, oy, ox = mm // (ho * wo), (mm // wo) % ho, mm % wo
        ix0 = ox * sw - pl
        kx_lo, kx_hi = max(0, -ix0), min(kw, w - ix0)  # taps kx_lo .. kx_hi-1 inside x
        for ky in range(kh):
            seg = dst[i * k + ky * run:i * k + (ky + 1) * run]
            iy = oy * sh - pt + ky * dh
            if iy < 0 or iy >= h or kx_hi <= kx_lo:
                seg[:] = 0.0
                continue
            seg[:kx_lo * c] = 0.0
            seg[kx_hi * c:] = 0.0
            src0 = ((b * h + iy) * w + ix0 + kx_lo) * c
            cnt = (kx_hi - kx_lo) * c
            src = x[src0:src0 + cnt]
            t = seg[kx_lo * c:kx_lo * c + cnt]
            for q in range(cnt):
                t[q] = src[q]
    dst[nr * k:MRF * k] = 0.0


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _padding_row(c, d_off, ldc, cols, j0, bias, res, r_off, ldr, has_res, act):
    """An output row all of whose taps are padding: act(bias + residual) on cols pixels."""
    for i in range(cols):
        c[d_off + i * ldc:d_off + i * ldc + NR] = 0.0
    nr = np.int64(NR)  # np.int64 and np.bool_, not literals: the callees' one signature
    _epilogue(c, d_off, ldc, cols, nr, j0, (bias, np.bool_(True), np.bool_(False), res,
                                            np.int64(r_off), np.int64(ldr), np.bool_(has_res)))
    if act:
        _activate(c, d_off, ldc, cols, nr, np.int64(act))


@njit(**JIT)
def _i64(x):
    """x as a plain int64. Numba compiles a jitted callee once per distinct argument type, and
    a constant argument (0, MRF) or a parameter that a caller fixed (has_res=False) arrives as a
    *literal* type, one compile per value: `direct_tiles_epi`, when it was a fully unrolled 8 x
    32 tile of named scalars (~60 s to compile; the IR tile of `_tile_ir` takes seconds), got
    eight specialisations from its four call sites, ~8 of the fresh test suite's minutes. A
    call's result is never a literal, so wrapping each argument leaves one specialisation."""
    return np.int64(x)


@njit(**JIT)
def _flag(x):
    """x as a plain bool (see `_i64`)."""
    return x != 0


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _rows_fused(x, geo, k, n_g, panels, c, ldc, m0, rows, bias, res, r_off, ldr, has_res, act,
                edge):
    """`_rows_block` with every tile stored once, its bias, residual and activation applied in
    registers (`direct_tiles_epi`): no epilogue pass over the strip, no activation pass over
    the block. n_g is whole panels. The border tiles' patches are gathered row-major into edge
    (MRF * K floats a tile, `_patch_tile`) and run on the same kernel with lda = K. bias [Cout]
    (zeros when the convolution has none); the residual's element of c[0] is res[r_off]."""
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    run = kw * cin
    lda = sw * cin
    ox_lo, n_direct = _direct_span(geo, MRF)
    ox_hi = ox_lo + n_direct * MRF
    n_rows = rows // wo
    r0 = m0 // wo
    starts = _edge_starts(ox_lo, ox_hi, wo, MRF)
    n_edge = len(starts)
    tile = MRF * k
    for r in range(n_rows):
        for e in range(n_edge):
            ox = starts[e]
            nr = min(MRF, (ox_lo if ox < ox_lo else wo) - ox)
            s = r * n_edge + e
            _patch_tile(x, geo, k, m0 + r * wo + ox, nr, edge[s * tile:(s + 1) * tile])
    for jp in range(n_g // NR):
        j0 = jp * NR
        bp = panels[jp]
        bj = bias[j0:j0 + NR]
        for r in range(n_rows):
            b, oy = (r0 + r) // ho, (r0 + r) % ho
            d_row = (m0 + r * wo) * ldc + j0
            r_row = r_off + (m0 + r * wo) * ldr + j0
            ky0, ky1 = _rows_inside(oy, sh, pt, kh, dh, h)
            if ky1 == ky0:
                _padding_row(c, d_row, ldc, wo, j0, bias, res, r_row, ldr, has_res, act)
                continue
            iy0 = oy * sh - pt + ky0 * dh
            x_row = ((b * h + iy0) * w - pl) * cin
            direct_tiles_epi(_i64(0), _i64(n_direct), _i64(ky1 - ky0), _i64(run), x,
                             _i64(x_row + ox_lo * lda), _i64(dh * w * cin), _i64(lda), bp,
                             _i64(ky0 * run), c, _i64(d_row + ox_lo * ldc), _i64(ldc), _i64(MRF),
                             bj, res, _i64(r_row + ox_lo * ldr), _i64(ldr), _flag(has_res),
                             _i64(act))
            for e in range(n_edge):
                ox = starts[e]
                nr = min(MRF, (ox_lo if ox < ox_lo else wo) - ox)
                direct_tiles_epi(_i64(0), _i64(1), _i64(1), _i64(k), edge,
                                 _i64((r * n_edge + e) * tile), _i64(0), _i64(k), bp, _i64(0), c,
                                 _i64(d_row + ox * ldc), _i64(ldc), _i64(nr), bj, res,
                                 _i64(r_row + ox * ldr), _i64(ldr), _flag(has_res), _i64(act))


@njit(inline="always", **JIT)
def _pf_share(k, n_t, n_next):
    """(lines, every) for n_t tiles of k steps each, prefetching between them the next
    n_next panels (k rows of NR floats, NR / 16 cache lines each) into L2 along their k
    loops: `lines` lines a tile, one every `every` k steps (PANEL_PREFETCH)."""
    if not PANEL_PREFETCH or 2 * n_next * k * NR * 4 > config.L2_BYTES:  # they'd evict these
        return 0, k
    per = -(-(n_next * k * NR // 16) // max(n_t, 1))
    return per, max(1, k // per)


@njit(inline="always", **JIT)
def _pf_rows(k, lda, n_t):
    """(lines, every) for n_t tiles of k steps each (one tile's panels), prefetching between
    them the next tile's MRF rows of A, lda floats apart (read as MRF * lda contiguous floats,
    MRF * lda / 16 lines), into L2 along their k loops (ROWS_PREFETCH)."""
    if not ROWS_PREFETCH:
        return 0, k
    per = -(-(MRF * lda // 16) // max(n_t, 1))
    return per, max(1, k // per)


@njit(inline="always", **JIT)
def _prefetch_rows(c, c0, ldc):
    """The MRF rows of NR floats at c[c0 + i*ldc] (a tile's output, 64-byte aligned),
    prefetched for writing."""
    for i in range(MRF):
        prefetch_w(c, c0 + i * ldc)
        prefetch_w(c, c0 + i * ldc + NR - 1)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _tiles_fused(a, a_off, lda, k, n_g, panels, c, ldc, m0, rows, bias, res, r_off, ldr,
                 has_res, act, buf):
    """Output pixels m0 .. m0+rows-1 whose A rows lie row-major in a (row i at a_off +
    i*lda): every panel over their tiles, each stored once with its epilogue
    (`tile_epi8_pf`, MRF rows a tile, the next panel prefetched along them: PANEL_PREFETCH),
    or every panel on a tile before the next (BY_TILES_BYTES). A short last tile of MRF - 1
    rows runs that tile on a copy of its rows in buf [MRF * K]; one of fewer rows, tiles of 4
    and of 1 row (`direct_tiles_epi4`, `direct_tiles_epi1`: an MRF-row tile cost as much for
    one row as for MRF); one row past a whole tile, that tile and the row as one of MR_NINE
    rows (`tile_epi9_pf`). The residual rows of a tile and the next are prefetched into L2;
    without a residual, each tile's rows are prefetched for writing while the tile before it
    runs (`prefetch_w`). buf holds the short tile's rows either way
    (`inverted._tiles_1x1` reads them). (_MODE_FLAT: a is x itself, a 1x1 convolution at
    stride 1; _MODE_PATCHES: a is the block's patch rows.)"""
    n_full = rows // MRF
    rem = rows - n_full * MRF
    nine = rem == 1 and n_full > 0
    n_8 = n_full - 1 if nine else n_full  # the tiles of MRF rows
    if rem:
        for i in range(rem):
            src = a[a_off + (n_full * MRF + i) * lda:a_off + (n_full * MRF + i) * lda + k]
            dst = buf[i * k:(i + 1) * k]
            for p in range(k):
                dst[p] = src[p]
        buf[rem * k:MRF * k] = 0.0
    m_rem = m0 + n_full * MRF
    by_tiles = n_8 > 0 and k * n_g * 4 <= BY_TILES_BYTES
    n_p = n_g // NR
    if by_tiles:  # every panel on a tile, then the next tile (BY_TILES_BYTES), its panels
        # sharing out the next tile's rows to prefetch (ROWS_PREFETCH)
        per_a, every_a = _pf_rows(k, lda, n_p)
        for t in range(n_8):
            m_t = m0 + t * MRF
            pa = a_off + (t + 1) * MRF * lda
            pn_a = per_a if t + 1 < n_full else 0
            for jp in range(n_p):
                j0 = jp * NR
                if has_res and t + 1 < n_8:  # the next tile's residual in this panel: to L2
                    ro = r_off + (m_t + MRF) * ldr + j0
                    for i in range(MRF):
                        prefetch_l2(res, ro + i * ldr)
                        prefetch_l2(res, ro + i * ldr + NR - 1)
                tile_epi8_pf(a, a_off + t * MRF * lda, 1, k, 0, lda, panels[jp], 0, c,
                             m_t * ldc + j0, ldc, MRF, bias[j0:j0 + NR], res,
                             r_off + m_t * ldr + j0, ldr, has_res, act, a, pa + jp * per_a * 16,
                             pn_a, every_a)
    per, every = _pf_share(k, n_8 + nine, 1)
    per_a, every_a = _pf_rows(k, lda, 1)
    for jp in range(n_p):
        j0 = jp * NR
        bp = panels[jp]
        bj = bias[j0:j0 + NR]
        nxt = panels[min(jp + 1, n_p - 1)]  # the next panel, into L2 (PANEL_PREFETCH)
        pn = per if jp + 1 < n_p and not by_tiles else 0
        if n_8 and not by_tiles:
            for t in range(n_8):
                c_t = (m0 + t * MRF) * ldc + j0
                ro = r_off + (m0 + t * MRF) * ldr + j0
                if has_res:  # the residual rows of this tile (the first) and the next: to L2
                    for q in range(0 if t == 0 else 1, 2 if t + 1 < n_8 else 1):
                        for i in range(MRF):
                            prefetch_l2(res, ro + (q * MRF + i) * ldr)
                            prefetch_l2(res, ro + (q * MRF + i) * ldr + NR - 1)
                elif t + 1 < n_8:
                    _prefetch_rows(c, c_t + MRF * ldc, ldc)
                if jp == 0:  # the first pass over the rows: the next tile's (ROWS_PREFETCH)
                    tile_epi8_pf(a, a_off + t * MRF * lda, 1, k, 0, lda, bp, 0, c, c_t, ldc, MRF,
                                 bj, res, ro, ldr, has_res, act, a,
                                 a_off + (t + 1) * MRF * lda, per_a if t + 1 < n_full else 0,
                                 every_a)
                else:
                    tile_epi8_pf(a, a_off + t * MRF * lda, 1, k, 0, lda, bp, 0, c, c_t, ldc, MRF,
                                 bj, res, ro, ldr, has_res, act, nxt, t * per * 16, pn, every)
        if nine:
            m9 = m0 + n_8 * MRF
            tile_epi9_pf(a, a_off + n_8 * MRF * lda, 1, k, 0, lda, bp, 0, c, m9 * ldc + j0, ldc,
                         MR_NINE, bj, res, r_off + m9 * ldr + j0, ldr, has_res, act, nxt,
                         n_8 * per * 16, pn, every)
        elif rem == MRF - 1:  # the MRF-row tile on buf's copy (and a zero row)
            direct_tiles_epi(_i64(0), _i64(1), _i64(1), _i64(k), buf, _i64(0), _i64(0), _i64(k),
                             bp, _i64(0), c, _i64(m_rem * ldc + j0), _i64(ldc), _i64(rem), bj,
                             res, _i64(r_off + m_rem * ldr + j0), _i64(ldr), _flag(has_res),
                             _i64(act))
        elif rem:  # a tile of 4 rows, then tiles of 1 (on a's rows in place)
            i = 0
            if rem >= 4:
                direct_tiles_epi4(_i64(0), _i64(1), _i64(1), _i64(k), a,
                                  _i64(a_off + n_full * MRF * lda), _i64(0), _i64(lda), bp,
                                  _i64(0), c, _i64(m_rem * ldc + j0), _i64(ldc), _i64(4), bj,
                                  res, _i64(r_off + m_rem * ldr + j0), _i64(ldr),
                                  _flag(has_res), _i64(act))
                i = 4
            if rem > i:
                direct_tiles_epi1(_i64(0), _i64(rem - i), _i64(1), _i64(k), a,
                                  _i64(a_off + (n_full * MRF + i) * lda), _i64(0), _i64(lda), bp,
                                  _i64(0), c, _i64((m_rem + i) * ldc + j0), _i64(ldc), _i64(1),
                                  bj, res, _i64(r_off + (m_rem + i) * ldr + j0), _i64(ldr),
                                  _flag(has_res), _i64(act))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _padded_fused(x, geo, k, n_g, panels, c, ldc, m0, rows, bias, res, r_off, ldr, has_res,
                  act):
    """Output pixels m0 .. m0+rows-1 of a convolution on a zero-padded x (geo's padding 0,
    every tap inside x; groups 1, one contiguous run of kw*C floats per kernel row), every
    panel over tiles of MRF consecutive pixels, each stored once with its epilogue: a tile's
    rows may cross output rows, each row reading its patch from x in place at an offset of
    its own (`_tile_ir.tile_gathered8`, kh segments of kw*C floats, dh*w*C apart). No patch
    copy (`_MODE_PATCHES` copies K floats a pixel) and no border tiles (`_rows_fused`'s
    gathered edges, and its short tiles on rows not a multiple of MRF wide). A short last tile
    as `_tiles_fused` runs it (one row past a whole tile: the two as one `tile_gathered9_pf`);
    without a residual, the next tile's rows prefetched for writing (`prefetch_w`)."""
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    n_full = rows // MRF
    rem = rows - n_full * MRF
    nine = rem == 1 and n_full > 0
    n_8 = n_full - 1 if nine else n_full  # the tiles of MRF rows
    offs = np.empty((n_full + 1) * MRF, np.int64)
    for i in range((n_full + 1) * MRF):
        mm = m0 + min(i, rows - 1)  # rows past `rows` (a short tile's) read the last pixel
        b, r = mm // (ho * wo), mm % (ho * wo)
        offs[i] = ((b * h + (r // wo) * sh) * w + (r % wo) * sw) * cin
    run, seg_a = kw * cin, dh * w * cin
    n_p = n_g // NR
    per, every = _pf_share(k, n_8 + nine, 1)
    for jp in range(n_p):
        j0 = jp * NR
        bp = panels[jp]
        bj = bias[j0:j0 + NR]
        nxt = panels[min(jp + 1, n_p - 1)]  # the next panel, into L2 (PANEL_PREFETCH)
        pn = per if jp + 1 < n_p else 0
        for t in range(n_8):
            ro = r_off + (m0 + t * MRF) * ldr + j0
            if has_res and t + 1 < n_full:  # the next tile's residual rows: to L2
                for i in range(MRF):
                    prefetch_l2(res, ro + (MRF + i) * ldr)
                    prefetch_l2(res, ro + (MRF + i) * ldr + NR - 1)
            elif not has_res and t + 1 < n_8:  # the next tile's rows, for writing
                _prefetch_rows(c, (m0 + (t + 1) * MRF) * ldc + j0, ldc)
            tile_gathered8_pf(x, offs[t * MRF:(t + 1) * MRF], kh, run, seg_a, 0, bp, 0, c,
                              (m0 + t * MRF) * ldc + j0, ldc, MRF, bj, res, ro, ldr, has_res,
                              act, nxt, t * per * 16, pn, every)
        if nine:
            i = n_8 * MRF
            tile_gathered9_pf(x, offs[i:i + MR_NINE], kh, run, seg_a, 0, bp, 0, c,
                              (m0 + i) * ldc + j0, ldc, MR_NINE, bj, res,
                              r_off + (m0 + i) * ldr + j0, ldr, has_res, act, nxt,
                              n_8 * per * 16, pn, every)
            continue
        # a short last tile as `_tiles_fused` runs it: MRF rows for MRF - 1, else 4 and 1s
        i = n_full * MRF
        if rem == MRF - 1:
            tile_gathered8(x, offs[i:i + MRF], kh, run, seg_a, 0, bp, 0, c, (m0 + i) * ldc + j0,
                           ldc, rem, bj, res, r_off + (m0 + i) * ldr + j0, ldr, has_res, act)
            continue
        if rem >= 4:
            tile_gathered4(x, offs[i:i + 4], kh, run, seg_a, 0, bp, 0, c, (m0 + i) * ldc + j0,
                           ldc, 4, bj, res, r_off + (m0 + i) * ldr + j0, ldr, has_res, act)
            i += 4
        while i < rows:
            tile_gathered1(x, offs[i:i + 1], kh, run, seg_a, 0, bp, 0, c, (m0 + i) * ldc + j0,
                           ldc, 1, bj, res, r_off + (m0 + i) * ldr + j0, ldr, has_res, act)
            i += 1


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _scattered_tail(x, offs, co, i, rows, kh, run, seg_a, bp, cj, bj, act):
    """Rows i .. rows-1 (fewer than MRF) of one panel of `_padded_into` as `_tiles_fused`
    runs a short last tile: MRF rows for MRF - 1 (the missing row not stored), else a tile of
    4 and tiles of 1."""
    rem = rows - i
    if rem == MRF - 1:
        tile_scattered8(x, offs[i:i + MRF], kh, run, seg_a, 0, bp, 0, cj, co[i:i + MRF], 0, rem,
                        bj, bj, 0, 0, False, act)
        return
    if rem >= 4:
        tile_scattered4(x, offs[i:i + 4], kh, run, seg_a, 0, bp, 0, cj, co[i:i + 4], 0, 4, bj,
                        bj, 0, 0, False, act)
        i += 4
    while i < rows:
        tile_scattered1(x, offs[i:i + 1], kh, run, seg_a, 0, bp, 0, cj, co[i:i + 1], 0, 1, bj,
                        bj, 0, 0, False, act)
        i += 1


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _padded_into(x, geo, k, n_g, panels, c, co, m0, rows, bias, act, wide):
    """Output pixels m0 .. m0+rows-1 of a convolution on a zero-bordered x (geo's padding 0,
    as `_padded_fused`'s: groups 1, one contiguous run of kw*C floats per kernel row), pixel
    m0 + i stored at c[co[i]:] (co int64, rows + MRF entries or more): into the interior of
    the zero-bordered map the next convolution reads (hepti.kernels.plain_chain). Bias and
    act, no residual. wide: pairs of panels run as one MR_WIDE x 64 tile (`tile_wide6_pf`: 6
    broadcasts of A for 24 FMAs, not 8 for 16), the rows past the last whole MR_WIDE on the
    32-wide tiles; an odd last panel, and all of them without wide, on the 8 x 32 tiles.
    Every output the same sum in the same order either way: bit for bit `_padded_fused`'s."""
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    offs = np.empty(rows + MRF, np.int64)
    for i in range(rows + MRF):
        mm = m0 + min(i, rows - 1)  # rows past `rows` (a short tile's) read the last pixel
        b, r = mm // (ho * wo), mm % (ho * wo)
        offs[i] = ((b * h + (r // wo) * sh) * w + (r % wo) * sw) * cin
    run, seg_a = kw * cin, dh * w * cin
    n_p = n_g // NR
    n_pairs = n_p // 2 if wide else 0
    n_w = rows // MR_WIDE
    per, every = _pf_share(k, n_w, 2)  # the next pair of panels (PANEL_PREFETCH)
    for q in range(n_pairs):
        j0 = 2 * q * NR
        bw = bias[j0:j0 + 2 * NR]
        cj = c[j0:]
        pn = per if 2 * q + 2 < n_p else 0
        for t in range(n_w):
            tile_wide6_pf(x, offs[t * MR_WIDE:(t + 1) * MR_WIDE], kh, run, seg_a, panels, 2 * q,
                          cj, co[t * MR_WIDE:(t + 1) * MR_WIDE], bw, act, panels,
                          (2 * q + 2) * k * NR + t * per * 16, pn, every)
        for jp in range(2 * q, 2 * q + 2):
            jj = jp * NR
            _scattered_tail(x, offs, co, n_w * MR_WIDE, rows, kh, run, seg_a, panels[jp],
                            c[jj:], bias[jj:jj + NR], act)
    n_full = rows // MRF
    per, every = _pf_share(k, n_full, 1)
    for jp in range(2 * n_pairs, n_p):
        j0 = jp * NR
        bp = panels[jp]
        bj = bias[j0:j0 + NR]
        cj = c[j0:]
        nxt = panels[min(jp + 1, n_p - 1)]
        pn = per if jp + 1 < n_p else 0
        for t in range(n_full):
            tile_scattered8_pf(x, offs[t * MRF:(t + 1) * MRF], kh, run, seg_a, 0, bp, 0, cj,
                               co[t * MRF:(t + 1) * MRF], 0, MRF, bj, bj, 0, 0, False, act, nxt,
                               t * per * 16, pn, every)
        _scattered_tail(x, offs, co, n_full * MRF, rows, kh, run, seg_a, bp, cj, bj, act)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _into_fused(x, cin, n_g, panels, c, c_offs, blk_lo, blk_hi, mb, m, bias, act):
    """A 1x1 convolution at stride 1 without padding (`_MODE_FLAT`: x [M, cin] is A in place)
    whose output pixel i is stored at c[c_offs[i]:] (c_offs [M] int64, `into_offsets`: the
    interior of a zero-bordered map that the next convolution reads in place, `_MODE_PADDED`,
    with no copy of its input). Row blocks blk_lo .. blk_hi-1 of mb pixels, every panel over
    each block's tiles of MRF pixels (`_tile_ir.tile_scattered8_pf`: a tile may cross rows
    of the map; the next panel prefetched along them), each stored once with bias and act (no
    residual). A short last tile as `_padded_fused`'s: MRF rows for MRF - 1 (the missing row
    reads and would store the last pixel's, not stored), one row past a whole tile the two as
    one `tile_scattered9_pf`, else 4 and 1s. Each tile's rows are prefetched for writing while
    the tile before it runs (`prefetch_w`)."""
    a_offs = np.empty(mb + MRF, np.int64)
    co = np.empty(mb + MRF, np.int64)
    for blk in range(blk_lo, blk_hi):
        m0 = blk * mb
        rows = min(mb, m - m0)
        for i in range(rows + MRF):
            mm = m0 + min(i, rows - 1)
            a_offs[i] = mm * cin
            co[i] = c_offs[mm]
        n_full = rows // MRF
        rem = rows - n_full * MRF
        nine = rem == 1 and n_full > 0
        n_8 = n_full - 1 if nine else n_full  # the tiles of MRF rows
        n_p = n_g // NR
        per, every = _pf_share(cin, n_8 + nine, 1)
        per_a, every_a = _pf_rows(cin, cin, 1)
        for jp in range(n_p):
            j0 = jp * NR
            bp = panels[jp]
            bj = bias[j0:j0 + NR]
            cj = c[j0:]
            nxt = panels[min(jp + 1, n_p - 1)]  # the next panel, into L2 (PANEL_PREFETCH)
            pn = per if jp + 1 < n_p else 0
            for t in range(n_8):
                if t + 1 < n_8:  # the next tile's rows, for writing
                    for i in range((t + 1) * MRF, (t + 2) * MRF):
                        prefetch_w(cj, co[i])
                        prefetch_w(cj, co[i] + NR - 1)
                if jp == 0:  # the first pass over x's rows: the next tile's (ROWS_PREFETCH)
                    tile_scattered8_pf(x, a_offs[t * MRF:(t + 1) * MRF], 1, cin, 0, 0, bp, 0, cj,
                                       co[t * MRF:(t + 1) * MRF], 0, MRF, bj, bj, 0, 0, False,
                                       act, x, a_offs[(t + 1) * MRF],
                                       per_a if t + 1 < n_full else 0, every_a)
                else:
                    tile_scattered8_pf(x, a_offs[t * MRF:(t + 1) * MRF], 1, cin, 0, 0, bp, 0, cj,
                                       co[t * MRF:(t + 1) * MRF], 0, MRF, bj, bj, 0, 0, False,
                                       act, nxt, t * per * 16, pn, every)
            if nine:
                i = n_8 * MRF
                tile_scattered9_pf(x, a_offs[i:i + MR_NINE], 1, cin, 0, 0, bp, 0, cj,
                                   co[i:i + MR_NINE], 0, MR_NINE, bj, bj, 0, 0, False, act, nxt,
                                   n_8 * per * 16, pn, every)
                continue
            i = n_full * MRF
            if rem == MRF - 1:
                tile_scattered8(x, a_offs[i:i + MRF], 1, cin, 0, 0, bp, 0, cj, co[i:i + MRF],
                                0, rem, bj, bj, 0, 0, False, act)
                continue
            if rem >= 4:
                tile_scattered4(x, a_offs[i:i + 4], 1, cin, 0, 0, bp, 0, cj, co[i:i + 4], 0, 4,
                                bj, bj, 0, 0, False, act)
                i += 4
            while i < rows:
                tile_scattered1(x, a_offs[i:i + 1], 1, cin, 0, 0, bp, 0, cj, co[i:i + 1], 0, 1,
                                bj, bj, 0, 0, False, act)
                i += 1


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _into_parallel(n_chunks, x, cin, n_g, panels, c, c_offs, n_blocks, mb, m, bias, act,
                   by_panels):
    """`_into_fused` on n_chunks threads: contiguous ranges of the row blocks, or with
    by_panels every block and a contiguous range of the panels each (as `_conv_parallel`)."""
    n_panels = panels.shape[0]
    for chunk in prange(n_chunks):
        if by_panels:
            p0, p1 = chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks
            _into_fused(x, cin, (p1 - p0) * NR, panels[p0:p1], c[p0 * NR:], c_offs, 0,
                        n_blocks, mb, m, bias[p0 * NR:p1 * NR], act)
        else:
            _into_fused(x, cin, n_g, panels, c, c_offs, chunk * n_blocks // n_chunks,
                        (chunk + 1) * n_blocks // n_chunks, mb, m, bias, act)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _pair_rows(x, cin, n_g, panels, xp, offs, n_blocks, mb, m, bias, act, geo_p, k2, n_g2,
               panels2, y, n_blocks2, mb2, m2, blocks2, epi2, act2, mode2, ws):
    """`ConvLayer.pair` on one thread: the 1x1 into the zero-bordered map xp
    (`_into_fused`), then the convolution reading it in place (`_conv_rows` on geo_p, groups
    1, Cout n_g2 = its row stride), in one call."""
    _into_fused(x, cin, n_g, panels, xp, offs, 0, n_blocks, mb, m, bias, act)
    _conv_rows(xp, geo_p, np.int64(1), k2, n_g2, panels2, y, n_g2, np.int64(0), n_blocks2, mb2,
               m2, blocks2, epi2, act2, mode2, ws)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _activate(y, off, ldy, rows, cols, act):
    """In place on rows x cols of the flat y from off (row stride ldy): act 1 = ReLU,
    2 = ReLU6 (min(max(v, 0), 6))."""
    zero, six = np.float32(0.0), np.float32(6.0)
    for i in range(rows):
        yr = y[off + i * ldy:off + i * ldy + cols]
        if act == 1:
            for j in range(cols):
                v = yr[j]
                yr[j] = v if v > zero else zero
        else:
            for j in range(cols):
                v = yr[j]
                v = v if v > zero else zero
                yr[j] = v if v < six else six


@njit(inline="always", **JIT)
def _pad16(n):
    return -(-n // 16) * 16


@njit(**JIT)
def _conv_sizes(mb, k, mode, wo):
    """Workspace floats of one chunk of _conv_rows: packed A, patch buffer, partial strip.
    (_MODE_ROWS packs at most wo // MR + 2 tiles of each of its mb // wo output rows; the
    fused modes, whose n_g is whole panels, need no partial strip and take tiles of MRF.)"""
    if mode == _MODE_PADDED:  # reads x in place, no workspace
        return (0, 0, 0)
    fused = mode == _MODE_FLAT or mode == _MODE_PATCHES or mode == _MODE_ROWS_FUSED
    mr = MRF if fused else MR
    buf = mb * k if mode == _MODE_IM2COL else (0 if mode == _MODE_DIRECT else mr * k)
    by_rows = mode == _MODE_ROWS or mode == _MODE_ROWS_FUSED
    tiles = (mb // wo) * (wo // mr + 2) if by_rows else -(-mb // mr)
    if mode == _MODE_FLAT:  # A is x itself; a short last tile goes through buf
        return (0, buf, 0)
    return (tiles * k * mr, buf, 0 if mode == _MODE_PATCHES else mb * NR)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _conv_rows(x, geo, groups, k, n_g, panels, c, ldc, blk_lo, blk_hi, mb, m, blocks, epi,
               act, mode, ws):
    """Output rows of blocks blk_lo .. blk_hi-1 (mb pixels each, M in all) of the convolution.

    c is the flat output [M, groups * n_g] (row stride ldc); panels [groups, n_panels, K, NR].
    mode says how a block's A is formed: _MODE_DIRECT packs x's rows (1x1, stride 1, no
    padding), _MODE_ROWS reads most patches from x in place (`_rows_block`; mb is then whole
    output rows), _MODE_IMPLICIT packs patches from x (`_pack_patches`), _MODE_IM2COL copies
    the block's patch rows into a buffer first and packs that (kept for the benchmark).
    epi is the GeMM epilogue tuple for group 0 at row 0; act is applied after it.
    Fused (groups 1, n_g whole panels, epi's bias [Cout] zeros if none): every tile is stored
    once with bias, residual and act applied in registers. _MODE_FLAT reads x as A in place
    (1x1, stride 1, no padding), _MODE_PATCHES gathers the block's patch rows row-major, and
    _MODE_ROWS_FUSED is _MODE_ROWS so (`_rows_fused`).
    """
    sizes = _conv_sizes(mb, k, mode, geo[5])
    apack = ws[:sizes[0]].reshape((sizes[0] // (k * MR), k, MR))
    o = _pad16(sizes[0])
    buf = ws[o:o + sizes[1]]
    o += _pad16(sizes[1])
    scratch = ws[o:o + sizes[2]]
    no_buf = ws[:0].reshape((0, 1, NR))  # _panel_range's buffer for packing B: unused
    cin, cg = geo[3], geo[14]
    n_panels = -(-n_g // NR)
    bias, has_bias, gelu, res, r_off, ldr, has_res = epi
    for blk in range(blk_lo, blk_hi):
        m0 = blk * mb
        rows = min(mb, m - m0)
        if mode == _MODE_ROWS_FUSED:
            _rows_fused(x, geo, k, n_g, panels[0], c, ldc, m0, rows, bias, res, r_off, ldr,
                        has_res, act, ws[:sizes[0]])
            continue
        if mode == _MODE_FLAT:
            _tiles_fused(x, m0 * cin, cin, k, n_g, panels[0], c, ldc, m0, rows, bias, res,
                         r_off, ldr, has_res, act, buf)
            continue
        if mode == _MODE_PADDED:
            _padded_fused(x, geo, k, n_g, panels[0], c, ldc, m0, rows, bias, res, r_off, ldr,
                          has_res, act)
            continue
        if mode == _MODE_PATCHES:
            _im2col(x, geo, 0, m0, m0 + rows, ws, k)
            _tiles_fused(ws, np.int64(0), k, k, n_g, panels[0], c, ldc, m0, rows, bias, res,
                         r_off, ldr, has_res, act, buf)
            continue
        if mode == _MODE_ROWS:
            _rows_block(x, geo, k, n_g, panels[0], c, ldc, m0, rows,
                        (bias, has_bias, gelu, res, r_off + m0 * ldr, ldr, has_res), apack, buf,
                        scratch)
        else:
            for g in range(groups):
                if mode == _MODE_DIRECT:
                    _pack_a(x, g * cg, cin, m0, m0 + rows, k, apack)
                elif mode == _MODE_IMPLICIT:
                    _pack_patches(x, geo, g * cg, m0, rows, k, apack, buf)
                else:
                    _im2col(x, geo, g * cg, m0, m0 + rows, buf, k)
                    _pack_a(buf, np.int64(0), k, np.int64(0), rows, k, apack)
                bias_g = bias[g * n_g:(g + 1) * n_g] if has_bias else bias
                epi_g = (bias_g, has_bias, gelu, res, r_off + m0 * ldr + g * n_g, ldr, has_res)
                _panel_range(np.int64(0), n_panels, apack, rows, k, n_g, panels[g], x,
                             np.int64(0), np.int64(1), no_buf, c,
                             m0 * ldc + g * n_g, ldc, blocks, scratch, epi_g, ws, np.int64(0))
        if act:
            _activate(c, m0 * ldc, ldc, rows, ldc, act)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _conv_parallel(n_chunks, x, geo, groups, k, n_g, panels, c, ldc, n_blocks, mb, m, blocks,
                   epi, act, mode, ws, ws_chunk, by_panels):
    """_conv_rows with the row blocks split into n_chunks contiguous ranges, one per thread;
    with by_panels (a fused mode: groups 1, whole panels, no pass over the rows after them),
    every thread takes every row block and a contiguous range of the output panels instead
    (each output element is still one micro-kernel's sum over the same k: the same bits)."""
    n_panels = panels.shape[1]
    bias, has_bias, gelu, res, r_off, ldr, has_res = epi
    for chunk in prange(n_chunks):
        w = ws[chunk * ws_chunk:(chunk + 1) * ws_chunk]
        if by_panels:
            p0, p1 = chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks
            j0, j1 = p0 * NR, p1 * NR
            sub = panels.reshape(-1)[p0 * k * NR:p1 * k * NR].reshape((1, p1 - p0, k, NR))
            _conv_rows(x, geo, groups, k, j1 - j0, sub, c[j0:], ldc, np.int64(0), n_blocks, mb, m,
                       blocks, (bias[j0:j1], has_bias, gelu, res, r_off + j0, ldr, has_res),
                       act, mode, w)
        else:
            _conv_rows(x, geo, groups, k, n_g, panels, c, ldc, chunk * n_blocks // n_chunks,
                       (chunk + 1) * n_blocks // n_chunks, mb, m, blocks, epi, act, mode, w)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _dw_pixel(x, geo, taps, bias, b, oy, ox, yr):
    """yr [C] = bias + sum over the in-image taps of depthwise output pixel (b, oy, ox)."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    for j in range(c):
        yr[j] = bias[j]
    for ky in range(kh):
        iy = oy * sh - pt + ky * dh
        if iy < 0 or iy >= h:
            continue
        row = (b * h + iy) * w
        for kx in range(kw):
            ix = ox * sw - pl + kx * dw
            if ix < 0 or ix >= w:
                continue
            xr = x[(row + ix) * c:(row + ix + 1) * c]
            wr = taps[ky * kw + kx]
            for j in range(c):
                yr[j] += xr[j] * wr[j]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _dw3x3_span(x, geo, taps, bias, b, oy, ox0, ox1, y, y_off):
    """Output pixels ox0 .. ox1-1 of row (b, oy) of a 3x3 depthwise convolution, all nine taps
    inside the image: per channel the nine products are summed in registers (one load of
    each x and weight, one store of y), not accumulated into y tap by tap."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    w0, w1, w2, w3, w4, w5, w6, w7, w8 = (taps[0], taps[1], taps[2], taps[3], taps[4],
                                          taps[5], taps[6], taps[7], taps[8])
    r0 = ((b * h + oy * sh - pt) * w - pl) * c  # x offset of tap (0, 0) for ox = 0
    r1 = r0 + dh * w * c
    r2 = r1 + dh * w * c
    dx = dw * c
    for ox in range(ox0, ox1):
        o = ox * sw * c
        x0 = x[r0 + o:r0 + o + c]
        x1 = x[r0 + o + dx:r0 + o + dx + c]
        x2 = x[r0 + o + 2 * dx:r0 + o + 2 * dx + c]
        x3 = x[r1 + o:r1 + o + c]
        x4 = x[r1 + o + dx:r1 + o + dx + c]
        x5 = x[r1 + o + 2 * dx:r1 + o + 2 * dx + c]
        x6 = x[r2 + o:r2 + o + c]
        x7 = x[r2 + o + dx:r2 + o + dx + c]
        x8 = x[r2 + o + 2 * dx:r2 + o + 2 * dx + c]
        yr = y[y_off + (ox - ox0) * c:y_off + (ox - ox0 + 1) * c]
        for j in range(c):
            yr[j] = (bias[j] + x0[j] * w0[j] + x1[j] * w1[j] + x2[j] * w2[j]
                     + x3[j] * w3[j] + x4[j] * w4[j] + x5[j] * w5[j]
                     + x6[j] * w6[j] + x7[j] * w7[j] + x8[j] * w8[j])


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _depthwise(x, geo, taps, bias, res, has_res, act, y, row_lo, row_hi):
    """Output rows row_lo .. row_hi-1 (of N*Ho, flat y [M, C]) of a depthwise convolution:
    bias + taps, then the residual, then act. A 3x3 kernel at stride 1 or 2 without column
    dilation runs the vector IR kernel (`_dw_ir.dw3x3_s1` / `dw3x3_s2`) over bands of rows
    (DW_ROWS_BYTES at stride 1, single rows at stride 2), borders included (a kernel row
    outside the image reads a row of zeros), with the residual and act applied in registers.
    Other 3x3s take `_dw3x3_span` for their pixels with every tap inside the image, and
    everything else `_dw_pixel`, then the residual and act."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    ox_lo = min(wo, (pl + sw - 1) // sw)  # first ox whose leftmost tap is inside
    ox_hi = max(ox_lo, min(wo, (w - 1 + pl - (kw - 1) * dw) // sw + 1))
    oy_lo = min(ho, (pt + sh - 1) // sh)  # likewise the rows whose taps are all inside
    oy_hi = max(oy_lo, min(ho, (h - 1 + pt - (kh - 1) * dh) // sh + 1))
    if kh == 3 and kw == 3 and dw == 1 and (sw == 1 or sw == 2):
        border = False  # does a row in range have a kernel row outside the image?
        for r in range(row_lo, row_hi):
            border = border or not (oy_lo <= r % ho < oy_hi)
        zero = np.zeros(w * c if border else 0, np.float32)
        rows = max(1, DW_ROWS_BYTES // (w * c * 4)) if sw == 1 else 1
        for b in range(row_lo // ho, (row_hi - 1) // ho + 1):  # the rows of each image
            for r0 in range(max(row_lo, b * ho), min(row_hi, (b + 1) * ho), rows):
                nr = min(rows, row_hi - r0, (b + 1) * ho - r0)
                iy0 = (r0 - b * ho) * sh - pt
                if sw == 1:
                    dw3x3_s1(x, b * h * w * c, iy0, h, dh, nr, zero, w, c, wo, pl, taps, bias,
                             res, has_res, y, r0 * wo * c, act)
                else:
                    dw3x3_s2(x, b * h * w * c, iy0, h, dh, nr, zero, w, c, wo, pl, taps, bias,
                             res, has_res, y, r0 * wo * c, act)
        return
    for r in range(row_lo, row_hi):
        b = r // ho
        oy = r % ho
        off = r * wo * c
        if kh == 3 and kw == 3 and oy_lo <= oy < oy_hi and ox_hi > ox_lo:
            _dw3x3_span(x, geo, taps, bias, b, oy, ox_lo, ox_hi, y, off + ox_lo * c)
            for ox in range(ox_lo):
                _dw_pixel(x, geo, taps, bias, b, oy, ox, y[off + ox * c:off + (ox + 1) * c])
            for ox in range(ox_hi, wo):
                _dw_pixel(x, geo, taps, bias, b, oy, ox, y[off + ox * c:off + (ox + 1) * c])
        else:
            for ox in range(wo):
                _dw_pixel(x, geo, taps, bias, b, oy, ox, y[off + ox * c:off + (ox + 1) * c])
        if has_res:
            yr = y[off:off + wo * c]
            rr = res[off:off + wo * c]
            for j in range(wo * c):
                yr[j] += rr[j]
        if act:
            _activate(y, off, wo * c, 1, wo * c, act)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _depthwise_parallel(n_chunks, x, geo, taps, bias, res, has_res, act, y, n_rows):
    """_depthwise with the output rows split into n_chunks contiguous ranges, one per thread."""
    for chunk in prange(n_chunks):
        _depthwise(x, geo, taps, bias, res, has_res, act, y, chunk * n_rows // n_chunks,
                   (chunk + 1) * n_rows // n_chunks)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _pool_pixel(x, geo, is_max, inv, b, oy, ox, yr):
    """yr [C] = max (is_max) or average over the window of output pixel (b, oy, ox), tap by
    tap: the first tap inside x is copied, the others folded in (a max ignores the padding;
    an average counts it as zeros and multiplies by inv = 1 / (kh*kw))."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    first = True
    for ky in range(kh):
        iy = oy * sh - pt + ky * dh
        if iy < 0 or iy >= h:
            continue
        row = (b * h + iy) * w
        for kx in range(kw):
            ix = ox * sw - pl + kx * dw
            if ix < 0 or ix >= w:
                continue
            xr = x[(row + ix) * c:(row + ix + 1) * c]
            if first:
                for j in range(c):
                    yr[j] = xr[j]
                first = False
            elif is_max:
                for j in range(c):
                    v = xr[j]
                    yr[j] = v if v > yr[j] else yr[j]
            else:
                for j in range(c):
                    yr[j] += xr[j]
    if first:  # every tap in the padding
        for j in range(c):
            yr[j] = -np.inf if is_max else 0.0
    if not is_max:
        for j in range(c):
            yr[j] *= inv


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _max3x3_span(x, geo, b, oy, ox0, ox1, y, y_off):
    """Output pixels ox0 .. ox1-1 of row (b, oy) of a 3x3 max pool, all nine taps inside x:
    per channel the max of the nine is taken in registers and stored once (tap by tap,
    `_pool_pixel` loads and stores y nine times a pixel; ResNet-50's pool took 2.5x
    onnxruntime's time).

    The nine views are written out as in `_dw3x3_span`, on purpose: one inline helper
    returning them for both ran 1.39x / 1.14x slower (max / depthwise) at 112x112x32 and
    1.03x / 1.02x at 14x14x576 (interleaved in one process, bit-equal outputs)."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    r0 = ((b * h + oy * sh - pt) * w - pl) * c  # x offset of tap (0, 0) for ox = 0
    r1 = r0 + dh * w * c
    r2 = r1 + dh * w * c
    dx = dw * c
    for ox in range(ox0, ox1):
        o = ox * sw * c
        x0 = x[r0 + o:r0 + o + c]
        x1 = x[r0 + o + dx:r0 + o + dx + c]
        x2 = x[r0 + o + 2 * dx:r0 + o + 2 * dx + c]
        x3 = x[r1 + o:r1 + o + c]
        x4 = x[r1 + o + dx:r1 + o + dx + c]
        x5 = x[r1 + o + 2 * dx:r1 + o + 2 * dx + c]
        x6 = x[r2 + o:r2 + o + c]
        x7 = x[r2 + o + dx:r2 + o + dx + c]
        x8 = x[r2 + o + 2 * dx:r2 + o + 2 * dx + c]
        yr = y[y_off + (ox - ox0) * c:y_off + (ox - ox0 + 1) * c]
        for j in range(c):
            a = max_f32(x0[j], x1[j])
            a = max_f32(a, x2[j])
            a = max_f32(a, x3[j])
            a = max_f32(a, x4[j])
            a = max_f32(a, x5[j])
            a = max_f32(a, x6[j])
            a = max_f32(a, x7[j])
            yr[j] = max_f32(a, x8[j])


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _max2x2_span(x, geo, b, oy, ox0, ox1, y, y_off):
    """Output pixels ox0 .. ox1-1 of row (b, oy) of a 2x2 max pool, all four taps inside x:
    the max of the four in registers, stored once (VGG-16's pools, tap by tap through
    `_pool_pixel`, took 1.3-1.5x onnxruntime's time)."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    r0 = ((b * h + oy * sh - pt) * w - pl) * c  # x offset of tap (0, 0) for ox = 0
    r1 = r0 + dh * w * c
    dx = dw * c
    for ox in range(ox0, ox1):
        o = ox * sw * c
        x0 = x[r0 + o:r0 + o + c]
        x1 = x[r0 + o + dx:r0 + o + dx + c]
        x2 = x[r1 + o:r1 + o + c]
        x3 = x[r1 + o + dx:r1 + o + dx + c]
        yr = y[y_off + (ox - ox0) * c:y_off + (ox - ox0 + 1) * c]
        for j in range(c):
            yr[j] = max_f32(max_f32(x0[j], x1[j]), max_f32(x2[j], x3[j]))


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _pool(x, geo, is_max, y):
    """y (flat [M, C]) = max (is_max) or average over each window of x; an average divides by
    kh*kw whatever the padding (PyTorch's count_include_pad=True), a max ignores the padding.
    A 3x3 or 2x2 max pool takes the pixels whose taps all lie inside x all taps at once
    (`_max3x3_span`, `_max2x2_span`), the others tap by tap (`_pool_pixel`)."""
    for b in range(geo[0]):
        _pool_rows(x, geo, is_max, y, b, np.int64(0), geo[4])  # not a literal: one signature


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _pool_rows(x, geo, is_max, y, b, oy0, oy1):
    """Output rows oy0 .. oy1-1 of image b of `_pool`."""
    n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    inv = np.float32(1.0) / np.float32(kh * kw)
    span = is_max and ((kh == 3 and kw == 3) or (kh == 2 and kw == 2))
    # the columns whose taps are all inside x: ox_lo .. ox_hi-1
    ox_lo = -(-pl // sw)
    last = w - 1 + pl - (kw - 1) * dw  # ox*sw must be <= last
    ox_hi = min(wo, last // sw + 1) if last >= 0 else 0
    if ox_hi <= ox_lo:
        span = False
    for oy in range(oy0, oy1):
        ky0, ky1 = _rows_inside(oy, sh, pt, kh, dh, h)
        m_row = (b * ho + oy) * wo
        if span and ky0 == 0 and ky1 == kh:
            for ox in range(ox_lo):
                _pool_pixel(x, geo, is_max, inv, b, oy, ox,
                            y[(m_row + ox) * c:(m_row + ox + 1) * c])
            if kh == 3:
                _max3x3_span(x, geo, b, oy, ox_lo, ox_hi, y, (m_row + ox_lo) * c)
            else:
                _max2x2_span(x, geo, b, oy, ox_lo, ox_hi, y, (m_row + ox_lo) * c)
            for ox in range(ox_hi, wo):
                _pool_pixel(x, geo, is_max, inv, b, oy, ox,
                            y[(m_row + ox) * c:(m_row + ox + 1) * c])
        else:
            for ox in range(wo):
                _pool_pixel(x, geo, is_max, inv, b, oy, ox,
                            y[(m_row + ox) * c:(m_row + ox + 1) * c])


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _conv_pooled(x, geo, k, n_g, panels, c, bias, act, mode, edge, blk, pgeo, y):
    """A fused-store convolution (`_rows_fused`, or `_padded_fused` on a zero-padded x) then
    a max pool of its output c (pgeo), by blocks of blk output rows: each pool row made as
    soon as the rows its taps read exist, while they are in L2 (the pool alone read them
    back cold). y the pool's output, bit for bit `_conv_rows` then `_pool`'s."""
    for b in range(geo[0]):
        _pooled_rows(x, geo, k, n_g, panels, c, bias, act, mode, edge, blk, pgeo, y, b, 0,
                     pgeo[4])


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _pooled_rows(x, geo, k, n_g, panels, c, bias, act, mode, edge, blk, pgeo, y, b, py0,
                 py1):
    """Pool rows py0 .. py1-1 of image b of `_conv_pooled`: the convolution's rows they read
    (from the first, in blocks of blk), each pool row made once the rows it reads exist."""
    ho, wo = geo[4], geo[5]
    psh, ppt, pkh, pdh = pgeo[8], pgeo[10], pgeo[6], pgeo[12]
    if py1 <= py0:
        return
    r0 = max(0, py0 * psh - ppt)
    r_end = min(ho, (py1 - 1) * psh - ppt + (pkh - 1) * pdh + 1)
    py = py0
    z, no, yes = np.int64(0), np.bool_(False), np.bool_(True)  # not literals: one signature
    while r0 < r_end:
        r1 = min(r_end, r0 + blk)
        m0 = (b * ho + r0) * wo
        if mode == _MODE_PADDED:
            _padded_fused(x, geo, k, n_g, panels, c, n_g, m0, (r1 - r0) * wo, bias, bias, z, z,
                          no, act)  # (bias: the absent residual's stand-in)
        else:
            _rows_fused(x, geo, k, n_g, panels, c, n_g, m0, (r1 - r0) * wo, bias, bias, z, z,
                        no, act, edge)
        q = py
        while q < py1 and (r1 == r_end or q * psh - ppt + (pkh - 1) * pdh < r1):
            q += 1
        if q > py:
            _pool_rows(c, pgeo, yes, y, b, py, q)
            py = q
        r0 = r1


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _pooled_parallel(n_chunks, x, geo, k, n_g, panels, c, bias, act, mode, edge, blk, pgeo,
                     y):
    """`_conv_pooled` on n_chunks threads: each a contiguous range of every image's pool
    rows, making the convolution's rows they read into c [n_chunks, N * ho * wo * n_g] (its own:
    a convolution row two ranges read is made by both, the same bits), edge one chunk's
    workspace after another. Bit for bit `_conv_pooled`'s y."""
    pho = pgeo[4]
    c_size = c.size // n_chunks
    e_size = edge.size // n_chunks
    for chunk in prange(n_chunks):
        cc = c[chunk * c_size:(chunk + 1) * c_size]
        ee = edge[chunk * e_size:(chunk + 1) * e_size]
        for b in range(geo[0]):
            _pooled_rows(x, geo, k, n_g, panels, cc, bias, act, mode, ee, blk, pgeo, y, b,
                         chunk * pho // n_chunks, (chunk + 1) * pho // n_chunks)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _padded_blocks(x, geo, k, n_g, panels, c, co, mb, bias, act, wide):
    """`_padded_into` over all the output pixels, in blocks of mb (co: every pixel's offset in
    c, and MRF more)."""
    m = geo[0] * geo[4] * geo[5]
    for m0 in range(0, m, mb):
        _padded_into(x, geo, k, n_g, panels, c, co[m0:], m0, min(mb, m - m0), bias, act, wide)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _pooled_into(x, geo, k, n_g, panels, buf, bco, bias, act, wide, pk, q, y, y_rows):
    """`_padded_into` on a zero-bordered x, then a pk x pk max pool at stride pk without
    padding of its output, by blocks of q * pk output rows: each block's rows made into buf
    (bco: their offsets there, q*pk*wo + MRF entries) and the q pool rows that read them made
    from it while in L2, pool row r of image b stored from y[y_rows[b * pool rows + r]] on
    (into the zero-bordered map the next convolution reads). The rows past the last whole
    window (none read them) are not made. Bit for bit the convolution then `_pool`."""
    n, ho, wo = geo[0], geo[4], geo[5]
    pho, pwo = (ho - pk) // pk + 1, (wo - pk) // pk + 1
    z, one = np.int64(0), np.int64(1)  # not literals: _pool_rows' one signature
    pgeo = (one, pk, wo, n_g, one, pwo, pk, pk, pk, pk, z, z, one, one, one)
    step = pk * wo * n_g  # floats of buf a pool row reads
    for b in range(n):
        for py in range(0, pho, q):
            nq = min(q, pho - py)
            _padded_into(x, geo, k, n_g, panels, buf, bco, (b * ho + py * pk) * wo,
                         nq * pk * wo, bias, act, wide)
            for i in range(nq):
                _pool_rows(buf[i * step:], pgeo, np.bool_(True), y[y_rows[b * pho + py + i]:], z,
                           z, one)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _global_avg(x, n, hw, c, y):
    """y [n * c] = mean over the hw pixels of each image of x (flat [n, hw, c])."""
    inv = np.float32(1.0) / np.float32(hw)
    for b in range(n):
        yr = y[b * c:(b + 1) * c]
        for j in range(c):
            yr[j] = 0.0
        for p in range(hw):
            xr = x[(b * hw + p) * c:(b * hw + p + 1) * c]
            for j in range(c):
                yr[j] += xr[j]
        for j in range(c):
            yr[j] *= inv


# ------------------------------------------------------------------------------------------
# Public API: checks, allocation, block sizes
# ------------------------------------------------------------------------------------------


def _pair(v, name: str) -> tuple[int, int]:
    """(vertical, horizontal) from an int or a pair, each >= 1."""
    pair = (v, v) if np.isscalar(v) else tuple(v)
    if len(pair) != 2 or any(int(p) != p or p < 1 for p in pair):
        raise ValueError(f"{name} must be a positive int or a pair of them, got {v!r}")
    return int(pair[0]), int(pair[1])


def _padding(v) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) from an int, a pair (rows, columns) or a 4-tuple, each >= 0."""
    pads = (v,) * 4 if np.isscalar(v) else tuple(v)
    if len(pads) == 2:
        pads = (pads[0], pads[0], pads[1], pads[1])
    if len(pads) != 4 or any(int(p) != p or p < 0 for p in pads):
        raise ValueError(f"padding must be an int >= 0, a pair (rows, columns) or (top, bottom, "
                         f"left, right), got {v!r}")
    return tuple(int(p) for p in pads)


def _geometry(x_shape, kh, kw, stride, padding, dilation, cg, what) -> tuple:
    """The geo tuple of the kernels (see above) for x [N, H, W, C]; raises if no output pixel.
    Kept per arguments: a network calls each layer with the same ones every forward, and the
    checks cost a small layer (MobileNetV2's at 7x7) a third of its call."""
    try:
        return _geometry_kept(tuple(x_shape), kh, kw, stride, padding, dilation, cg, what)
    except TypeError:  # an unhashable argument (a list): not kept
        return _geometry_checked(x_shape, kh, kw, stride, padding, dilation, cg, what)


def _geometry_checked(x_shape, kh, kw, stride, padding, dilation, cg, what) -> tuple:
    n, h, w, c = x_shape
    sh, sw = _pair(stride, "stride")
    dh, dw = _pair(dilation, "dilation")
    pt, pb, pl, pr = _padding(padding)
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    if ho < 1 or wo < 1:
        raise ValueError(f"{what}: input {tuple(x_shape)} padded by (top, bottom, left, right) "
                         f"{(pt, pb, pl, pr)} is smaller than the {kh}x{kw} window with "
                         f"dilation {(dh, dw)}")
    return (n, h, w, c, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg)


_geometry_kept = functools.lru_cache(maxsize=4096)(_geometry_checked)


def _nhwc(x, name: str = "x") -> np.ndarray:
    """x checked to be float32 [N, H, W, C]; x itself if C-contiguous and writeable, else a
    copy (Numba compiles a separate specialisation of every kernel for read-only arrays)."""
    check_float32(x, name, 4)
    return x if x.flags.c_contiguous and x.flags.writeable else np.array(x, order="C")


def _out4(out, shape, name: str = "out") -> np.ndarray:
    """A new float32 array of this shape, or `out` checked to be a C-contiguous one."""
    if out is None:
        return aligned_empty(shape)
    check_float32(out, name, len(shape))
    if out.shape != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {out.shape}")
    if not out.flags.c_contiguous or not out.flags.writeable:
        raise ValueError(f"{name} must be a writeable C-contiguous array")
    return out


def _residual(residual, shape, y) -> np.ndarray:
    if residual is None:
        return EMPTY
    residual = _nhwc(residual, "residual")
    if residual.shape != tuple(shape):
        raise ValueError(f"residual must have the output's shape {tuple(shape)}, got "
                         f"{residual.shape}")
    if y is not None and np.shares_memory(residual, y):
        raise ValueError("out overlaps residual; the kernel reads the residual after writing "
                         "the output: pass a separate output buffer")
    return residual.reshape(-1)


def _act(relu) -> int:
    if relu not in _ACT:
        raise ValueError(f"relu must be None, 'relu' or 'relu6', got {relu!r}")
    return _ACT[relu]


def pack_conv_weight(w: np.ndarray, groups: int = 1) -> ConvWeight:
    """Pack a PyTorch-layout conv weight [Cout, Cin/groups, kh, kw] for `conv2d`, once.

    Each group's [Cout_g, Cin_g, kh, kw] becomes B [kh*kw*Cin_g, Cout_g] (rows ordered ky, kx,
    c, matching an NHWC patch) in pack_b's panels; a depthwise weight (groups == Cin == Cout)
    becomes taps [kh*kw, C] for `depthwise_conv2d`.
    """
    check_float32(w, "w", 4)
    cout, cin_g, kh, kw = w.shape
    if groups < 1 or cout % groups:
        raise ValueError(f"groups={groups} must be >= 1 and divide Cout={cout} of the weight "
                         f"[Cout, Cin/groups, kh, kw] = {w.shape}")
    if min(w.shape) < 1:
        raise ValueError(f"weight {w.shape} has an empty dimension")
    cin = cin_g * groups
    if groups == cin == cout:
        taps = np.ascontiguousarray(w.reshape(cout, kh * kw).T)  # [kh*kw, C]
        return ConvWeight(np.zeros((0, 0, 0, NR), np.float32), taps, cout, cin, kh, kw, groups)
    cout_g, k = cout // groups, kh * kw * cin_g
    n_panels = -(-cout_g // NR)
    panels = aligned_empty((groups, n_panels, k, NR))
    for g in range(groups):
        # [Cout_g, Cin_g, kh, kw] -> [kh, kw, Cin_g, Cout_g] -> B [K, Cout_g]
        b = np.ascontiguousarray(w[g * cout_g:(g + 1) * cout_g].transpose(2, 3, 1, 0))
        _pack_all(b.reshape(-1), 0, cout_g, False, k, cout_g, panel_group(k),
                  config.PREFETCH_ROWS, panels[g])
    return ConvWeight(panels, np.zeros((0, 0), np.float32), cout, cin, kh, kw, groups)


def _tile_rows(mode: int) -> int:
    """Output pixels a micro-kernel tile takes in this mode: MRF in the fused ones, else MR."""
    return MRF if mode in _FUSED_MODES else MR


def _block_units(m: int, mb: int, mode: int, wo: int) -> list[int]:
    """The micro-kernel tiles of each row block (mb pixels) of M output pixels: a short tile
    costs a whole one. By rows (_MODE_ROWS*), a block is whole output rows of ceil(wo / mr)
    tiles each (mr: `_tile_rows`)."""
    mr = _tile_rows(mode)
    if mode in (_MODE_ROWS, _MODE_ROWS_FUSED):
        return [min(mb, m - m0) // wo * -(-wo // mr) for m0 in range(0, m, mb)]
    return [-(-min(mb, m - m0) // mr) for m0 in range(0, m, mb)]


def _split_rows(m: int, k: int, mode: int, threads: int, wo: int) -> tuple[int, int]:
    """(rows per block, most tiles of a thread) splitting M's row blocks into `threads`
    contiguous ranges: packed_gemm.row_block's blocks, their count rounded up to a multiple
    of the threads (7 blocks of 448 pixels on 2 threads were 3 and 4 blocks: 12% idle), each
    a multiple of the mode's tile (`_tile_rows`; by rows: whole output rows). Not by rows, up
    to four times as many blocks where they share the tiles out more evenly: ResNet-50's 28x28
    3x3s (98 tiles) in 8 blocks of 13 tiles were 52 and 46 a thread, in 14 of 7 are 49 and
    49."""
    if mode in (_MODE_ROWS, _MODE_ROWS_FUSED):
        n_rows = m // wo
        n_blocks = -(-n_rows // max(1, round(row_block(m, k) / wo)))
        n_blocks = min(n_rows, -(-n_blocks // threads) * threads)
        mb = -(-n_rows // n_blocks) * wo
    else:  # and up to four times as many blocks where they split the tiles 1% more evenly
        # (row_block's blocks follow L2: with 2 MiB, ResNet-50's 28x28 3x3s start from 4
        # blocks, and twice as many never reached the 14 that split 98 tiles 49 and 49)
        n0 = -(-m // min(row_block(m, k), m))
        n0 = -(-n0 // threads) * threads
        mr = _tile_rows(mode)
        best = None
        for n_blocks in range(n0, max(n0, min(4 * n0, -(-m // mr))) + 1, threads):
            mb = -(-(-(-m // n_blocks)) // mr) * mr
            busiest = _busiest(_block_units(m, mb, mode, wo), threads)
            if best is None or busiest < 0.99 * best[1]:
                best = (mb, busiest)
        return best
    return mb, _busiest(_block_units(m, mb, mode, wo), threads)


def _busiest(units: list[int], threads: int) -> int:
    """The most tiles of a thread, the blocks (of `units` tiles each) cut into `threads`
    contiguous ranges as the parallel kernels cut them."""
    n = len(units)
    chunks = min(threads, n)
    return max(sum(units[c * n // chunks:(c + 1) * n // chunks]) for c in range(chunks))


def pooled_rows(m: int, k: int, n_panels: int, wo: int) -> int:
    """Convolution rows a block of a convolution made with the max pool after it (`ConvLayer.
    pooled`, plain_chain's pooled steps): POOLED_ROWS, or where its panels are over half of
    L2, the rows of `_padded_rows`' block. Each block reads every panel, from L3 once they
    overflow L2: VGG-16's pooled 3x3s at K = 4608 (9.4 MB of weight) in blocks of 2 rows read
    it 14 times at 28x28 and ran 1.28x onnxruntime's time where the same layer unpooled ran
    1.04x (Emerald Rapids, 2 MiB L2; in the padded mode's blocks, 1.08x)."""
    if 2 * k * n_panels * NR * 4 <= config.L2_BYTES:
        return POOLED_ROWS
    return max(POOLED_ROWS, _padded_rows(m, k, n_panels) // wo)


def _padded_rows(m: int, k: int, n_panels: int) -> int:
    """Rows per block of `_MODE_PADDED` over n_panels panels of k rows on one thread:
    row_block's, or equal blocks of whole tiles of PADDED_BLOCK pixels or more (all M when
    fewer) where the panels are over half of L2 (it packs no A; see PADDED_BLOCK)."""
    mb = min(row_block(m, k), m)
    if 2 * k * n_panels * NR * 4 <= config.L2_BYTES:
        return mb
    n_blocks = -(-m // max(mb, PADDED_BLOCK))
    per_block = -(-m // n_blocks)
    return min(m, -(-per_block // MRF) * MRF)  # whole tiles


@functools.lru_cache(maxsize=512)
def _conv_plan(m: int, k: int, mode: int, threads: int, mb: int = 0, wo: int = 1,
               n_panels: int = 0) -> tuple:
    """(chunks, rows per block, blocks, workspace floats per chunk, split by panels) for one
    conv shape.

    Rows per block: packed_gemm.row_block (the packed A block fills about half of L2).
    _MODE_ROWS rounds a block to whole output rows (wo pixels each); a row's working set
    there is the x rows it reads, not a packed block, and the rows per block measured alike
    from 1 to 8 on VGG-16's 224x224x64 layer. _MODE_PADDED on one thread (and on each
    thread of a split by panels) takes larger blocks where the panels are over half of L2
    (`_padded_rows`).
    On threads > 1, the row blocks are split among the threads (`_split_rows`) or, for a
    fused mode with n_panels output panels (n_panels > 0), every thread takes every row and
    a share of the panels, whichever leaves the busiest thread fewer tiles: a small map
    (ResNet-50's 7x7 and 14x14 stages: 7 or 25 tiles) cannot be cut evenly by rows, its
    256-2048 channels can. (The panel split repeats a block's patch gathering on each
    thread: a copy of the block per thread, against its products with n_panels / threads
    panels; so it wants at least 4 panels a thread, and a 2% better balance.)
    """
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    threads = min(threads, numba.config.NUMBA_NUM_THREADS)
    by_panels = False
    if mb:  # forced (convbench, tests): at least one block per thread, as it comes
        if mode in (_MODE_ROWS, _MODE_ROWS_FUSED):
            mb = min(max(1, round(mb / wo)), m // wo) * wo
    elif threads == 1:
        if mode in (_MODE_ROWS, _MODE_ROWS_FUSED):
            mb = min(max(1, round(row_block(m, k) / wo)), m // wo) * wo
        else:
            mb = (_padded_rows(m, k, n_panels) if mode == _MODE_PADDED
                  else min(row_block(m, k), m))
    else:
        mb, busiest = _split_rows(m, k, mode, threads, wo)
        if n_panels >= 4 * threads and mode in _FUSED_MODES:
            mb_p = (min(max(1, round(row_block(m, k) / wo)), m // wo) * wo
                    if mode == _MODE_ROWS_FUSED else _padded_rows(m, k, n_panels // threads)
                    if mode == _MODE_PADDED else min(row_block(m, k), m))
            tiles = sum(_block_units(m, mb_p, mode, wo))
            if -(-n_panels // threads) * tiles < 0.98 * busiest * n_panels:
                mb, by_panels = mb_p, True
    n_blocks = -(-m // mb)
    n_chunks = max(1, min(threads, n_panels if by_panels else n_blocks))
    sizes = _conv_sizes(mb, k, mode, wo)
    ws_chunk = sum(pad16(s) for s in sizes)
    return n_chunks, mb, n_blocks, ws_chunk, by_panels


def _rows_apply(geo: tuple, groups: int, mr: int = MR) -> bool:
    """Whether `_rows_block` (tiles of mr = MR) or `_rows_fused` (MRF) can take this
    convolution: groups 1, each kernel row's taps one contiguous run of x (dilation 1 across,
    or a single column), and at least one tile per output row that reads x in place."""
    return groups == 1 and (geo[13] == 1 or geo[7] == 1) and _direct_span(geo, mr)[1] > 0


def _padded_extent(geo: tuple) -> tuple:
    """(hp, wp, top, left): the zero-bordered map `_MODE_PADDED` reads for geo's x, as many
    rows and columns as the taps reach, x's at (top, left) in it."""
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    return (max(h + pt, (ho - 1) * sh + (kh - 1) * dh + 1),
            max(w + pl, (wo - 1) * sw + (kw - 1) * dw + 1), pt, pl)


def _bordered(n: int, h: int, w: int, c: int, extent: tuple) -> np.ndarray:
    """An [n, hp, wp, c] map whose border around the h x w interior at (top, left) is zero;
    the interior is left for the caller to write."""
    hp, wp, pt, pl = extent
    xp = aligned_empty((n, hp, wp, c))
    xp[:, :pt] = 0.0
    xp[:, pt + h:] = 0.0
    xp[:, pt:pt + h, :pl] = 0.0
    xp[:, pt:pt + h, pl + w:] = 0.0
    return xp


def _zero_padded(x: np.ndarray, geo: tuple) -> tuple[np.ndarray, tuple]:
    """(x with its zero padding written in, geo for it with padding 0) for `_MODE_PADDED`: as
    many rows and columns as the taps reach (x itself when they stay inside it)."""
    n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
    extent = _padded_extent(geo)
    hp, wp = extent[:2]
    if pt or pl or hp > h or wp > w:  # zeros only where x does not go (np.zeros wrote all)
        xp = _bordered(n, h, w, cin, extent)
        xp[:, pt:pt + h, pl:pl + w] = x
        x, h, w = xp, hp, wp
    return x, (n, h, w, cin, ho, wo, kh, kw, sh, sw, 0, 0, dh, dw, cg)


def conv2d(x: np.ndarray, w, bias: np.ndarray | None = None, stride=1, padding=0, dilation=1,
           groups: int | None = None, relu: str | None = None,
           residual: np.ndarray | None = None, out: np.ndarray | None = None,
           threads: int = 1, _mode: int | None = None, _mb: int = 0) -> np.ndarray:
    """y = act(conv(x, w) + bias + residual) for x float32 [N, H, W, Cin] (NHWC).

    w: a ConvWeight from `pack_conv_weight` (pack once, at load time), or a PyTorch-layout
    weight [Cout, Cin/groups, kh, kw] that is packed on each call. bias [Cout]; residual
    [N, Ho, Wo, Cout] added after the bias (ResNet's identity); relu None, "relu" or "relu6",
    applied last. stride and dilation: an int or (vertical, horizontal); padding: an int,
    (rows, columns) or (top, bottom, left, right). groups defaults to the packed weight's.
    out: optional C-contiguous float32 [N, Ho, Wo, Cout], not overlapping x or residual,
    except that out may be the residual array itself: where the fused store applies (groups
    1, Cout a multiple of NR) y is then written over the residual, each element read just
    before it is overwritten (no second map to write: the output's lines are the residual's,
    already in cache); elsewhere y is then a new array. Use the returned array.
    threads > 1 splits the output rows over that many Numba threads. A depthwise weight runs
    `depthwise_conv2d`. (_mode and _mb force the way A is formed and the rows per block: for
    hepti.bench.convbench and the tests only.)
    """
    if isinstance(w, ConvWeight):
        cw = w
        if groups is not None and groups != cw.groups:
            raise ValueError(f"groups={groups} but the weight was packed with groups={cw.groups}")
    else:
        cw = pack_conv_weight(w, 1 if groups is None else groups)
    x = _nhwc(x)
    if x.shape[3] != cw.cin:
        raise ValueError(f"x {x.shape} has {x.shape[3]} channels but the weight expects "
                         f"Cin={cw.cin} ({cw!r})")
    if cw.depthwise:
        return _depthwise_run(x, cw, bias, stride, padding, dilation, relu, residual, out,
                              threads)
    act = _act(relu)
    groups = cw.groups
    geo = _geometry(x.shape, cw.kh, cw.kw, stride, padding, dilation, cw.cin // groups,
                    "conv2d")
    n, ho, wo = geo[0], geo[4], geo[5]
    y = _out4(out, (n, ho, wo, cw.cout))
    if np.shares_memory(y, x):
        raise ValueError("out overlaps x; the kernel reads x while writing out: pass a "
                         "separate output buffer")
    in_place = residual is not None and residual is y
    res = _residual(residual, y.shape, None if in_place else y)
    bias_v = vector(bias, "bias", cw.cout)
    if n * ho * wo == 0:
        return y
    plan = _conv_shape(cw.kh, cw.kw, cw.cout, groups, geo, int(threads), _mode, _mb)
    if in_place and not plan[1]:
        y = aligned_empty(y.shape)  # the unfused epilogue adds it after a strip: apart
    if plan[1] and bias is None:
        bias_v = np.zeros(cw.cout, np.float32)  # the fused store always adds a bias
    _conv_run(x, cw, geo, y, (bias_v, bias is not None, False, res, 0, cw.cout,
                              residual is not None), act, plan)
    return y


def _conv_shape_checked(kh: int, kw: int, cout: int, groups: int, geo: tuple, threads: int,
                        mode: int | None = None, mb: int = 0) -> tuple:
    """(mode, fused, chunks, rows per block, blocks, workspace floats per chunk, split by
    panels) of a conv2d: how A is formed (`mode` forces it: checked here) and `_conv_plan`'s
    blocks, from the weight's shape and the geometry alone (`_conv_shape` keeps them)."""
    n, h, w, c, ho, wo = geo[:6]
    n_g = cout // groups
    plain = (kh == kw == 1 and geo[8] == geo[9] == 1 and geo[10] == geo[11] == 0
             and ho == h and wo == w)
    rows = _rows_apply(geo, groups)
    rows_f = _rows_apply(geo, groups, MRF)
    fusable = groups == 1 and n_g % NR == 0  # whole panels: every tile stored once, fused
    if mode is None:
        if fusable:
            runs = geo[13] == 1 or geo[7] == 1  # one contiguous run of x per kernel row
            short_strided = kw * (c // groups) < PADDED_RUN and geo[9] > 1  # the stem
            mode = (_MODE_FLAT if plain else
                    _MODE_ROWS_FUSED if rows_f and wo % MRF == 0 and not short_strided else
                    _MODE_PADDED if runs else _MODE_PATCHES)
        elif plain:  # x is A as it is: in place by rows unless rows leave short tiles
            mode = _MODE_ROWS if rows and wo % MR == 0 else _MODE_DIRECT
        else:
            mode = _MODE_ROWS if rows else _MODE_IMPLICIT
    elif mode == _MODE_PADDED and not (geo[13] == 1 or geo[7] == 1):
        raise ValueError("_MODE_PADDED needs one contiguous run per kernel row")
    elif mode == _MODE_ROWS and not rows or mode == _MODE_ROWS_FUSED and not rows_f:
        raise ValueError("_MODE_ROWS needs groups 1, one contiguous run per kernel row and a "
                         "tile inside x on every output row")
    fused = mode in _FUSED_MODES
    if fused and not fusable or mode == _MODE_FLAT and not plain:
        raise ValueError("the fused modes need groups 1 and Cout a multiple of NR "
                         "(_MODE_FLAT: a 1x1 convolution at stride 1 without padding)")
    return (mode, fused) + _conv_plan(n * ho * wo, kh * kw * (c // groups), mode, threads, mb,
                                      wo, n_g // NR if fused else 0)


_conv_shape = functools.lru_cache(maxsize=1024)(_conv_shape_checked)


def _conv_run(x, cw, geo, y, epi, act, plan, pad: bool = True) -> None:
    """The convolution of checked x into y (`_conv_shape`'s plan; epi the GeMM epilogue).
    pad False: x is `_MODE_PADDED`'s zero-bordered map already (geo its, padding 0)."""
    mode, _, n_chunks, mb, n_blocks, ws_chunk, by_panels = plan
    m = geo[0] * geo[4] * geo[5]
    if mode == _MODE_PADDED and pad:
        x, geo = _zero_padded(x, geo)
    blocks = (mb, config.KC, 1, config.PREFETCH_ROWS)
    ws = workspace(n_chunks * ws_chunk)
    args = (x.reshape(-1), geo, cw.groups, cw.k, cw.cout // cw.groups, cw.panels,
            y.reshape(-1), cw.cout)
    if n_chunks == 1:
        _conv_rows(*args, 0, n_blocks, mb, m, blocks, epi, act, mode, ws)
    else:
        previous = numba.get_num_threads()
        numba.set_num_threads(n_chunks)
        try:
            _conv_parallel(n_chunks, *args, n_blocks, mb, m, blocks, epi, act, mode, ws,
                           ws_chunk, by_panels)
        finally:
            numba.set_num_threads(previous)


_F32 = np.dtype(np.float32)


class ConvLayer:
    """One convolution's packed weight, bias, stride, dilation and activation, checked once,
    and its plan per input shape (`_conv_shape`, the output's shape), kept: `__call__` is
    `conv2d` on them without redoing per call what depends on the weight alone or on the
    input's shape alone. ResNet-50 runs 53 convolutions a forward (hepti.model.cnn
    `Weights.layer` keeps one per op). x of another kind than a writeable C-contiguous
    float32 array, an unhashable padding and depthwise weights take `conv2d` itself."""

    def __init__(self, w: ConvWeight, bias: np.ndarray | None = None, stride=1, dilation=1,
                 relu: str | None = None):
        if not isinstance(w, ConvWeight):
            raise TypeError(f"w must be a ConvWeight (pack_conv_weight), got {type(w).__name__}")
        _pair(stride, "stride")
        _pair(dilation, "dilation")
        self.w, self.bias, self.stride, self.dilation, self.relu = w, bias, stride, dilation, relu
        self.act = _act(relu)
        if not w.depthwise:
            self.bias_v = vector(bias, "bias", w.cout)
            # the fused store always adds a bias
            self.bias_f = np.zeros(w.cout, np.float32) if bias is None else self.bias_v
        # (x's shape, padding, threads) -> `_shape`; also `_bordered_plan`'s and `into`'s
        self._shapes: dict = {}

    def _shape(self, x_shape: tuple, padding, threads) -> tuple:
        """(the output's shape, geo, `_conv_shape`'s plan) for x of this shape (checked here,
        once per shape, as conv2d checks it)."""
        cw = self.w
        if x_shape[3] != cw.cin:
            raise ValueError(f"x {x_shape} has {x_shape[3]} channels but the weight expects "
                             f"Cin={cw.cin} ({cw!r})")
        geo = _geometry_checked(x_shape, cw.kh, cw.kw, self.stride, padding, self.dilation,
                                cw.cin // cw.groups, "conv2d")
        n, ho, wo = geo[0], geo[4], geo[5]
        plan = _conv_shape(cw.kh, cw.kw, cw.cout, cw.groups, geo, int(threads)) \
            if n * ho * wo else None
        if len(self._shapes) >= 64:  # bands of many sizes (a planner's trials): start again
            self._shapes.clear()
        got = self._shapes[(x_shape, padding, threads)] = ((n, ho, wo, cw.cout), geo, plan)
        return got

    def __call__(self, x: np.ndarray, padding=0, residual: np.ndarray | None = None,
                 out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
        """y = the convolution of x [N, H, W, Cin], as `conv2d`'s with this layer's weight,
        bias, stride, dilation and relu."""
        cw = self.w
        if cw.depthwise or type(x) is not np.ndarray or x.dtype is not _F32 or \
                x.ndim != 4 or not (x.flags.c_contiguous and x.flags.writeable):
            return conv2d(x, cw, self.bias, self.stride, padding, self.dilation,
                          relu=self.relu, residual=residual, out=out, threads=threads)
        try:
            got = self._shapes.get((x.shape, padding, threads))
        except TypeError:  # an unhashable padding (a list)
            return conv2d(x, cw, self.bias, self.stride, padding, self.dilation,
                          relu=self.relu, residual=residual, out=out, threads=threads)
        shape, geo, plan = got if got is not None else self._shape(x.shape, padding, threads)
        if out is not None and out is residual and plan is not None and plan[1] and \
                type(out) is np.ndarray and out.dtype is _F32 and out.shape == shape:
            # the band executor's y written over its residual (ResNet's 1x1 with the
            # identity): the checks below at once (each numpy call ~5-10 us with the caches
            # cold between kernels: 60 us an op in all against 25 for the kernel's dispatch)
            flags = out.flags
            if flags.c_contiguous and flags.writeable and not np.shares_memory(out, x):
                _conv_run(x, cw, geo, out, (self.bias_f, self.bias is not None, False,
                                            out.reshape(-1), 0, cw.cout, True), self.act, plan)
                return out
        if out is None:
            y = aligned_empty(shape)
        else:
            y = _out4(out, shape)
            if np.shares_memory(y, x):
                raise ValueError("out overlaps x; the kernel reads x while writing out: pass "
                                 "a separate output buffer")
        if residual is None:
            res = EMPTY
        else:  # a new y cannot overlap it; out may be the residual itself
            res = _residual(residual, shape, None if out is None or residual is y else y)
        if plan is None:
            return y
        if not plan[1] and residual is y:
            y = aligned_empty(shape)  # the unfused epilogue adds it after a strip: apart
        _conv_run(x, cw, geo, y, (self.bias_f if plan[1] else self.bias_v, self.bias is not None,
                                  False, res, 0, cw.cout, residual is not None), self.act, plan)
        return y

    def pooled(self, x: np.ndarray, padding, kernel: int, stride: int,
               pool_padding, threads: int = 1) -> np.ndarray | None:
        """`max_pool2d(kernel, stride, pool_padding)` of this layer's output on x as one
        kernel call (`_conv_pooled`: each pool row made while the rows it reads are in L2):
        bit for bit the two one after the other; None where the convolution does not run a
        fused mode by rows here (`_MODE_ROWS_FUSED`, `_MODE_PADDED`): call the two.
        On `threads` > 1, each thread makes a contiguous range of the pool rows from the
        convolution rows they read (`_pooled_parallel`; a row two ranges read, made twice),
        where the convolution's own plan there splits by rows and its panels fit in half of
        L2 (POOLED_ROWS rows a block would read larger ones again from L3 per block): else
        None."""
        cw = self.w
        if cw.depthwise or type(x) is not np.ndarray or x.dtype is not _F32 or \
                x.ndim != 4 or not (x.flags.c_contiguous and x.flags.writeable):
            return None
        threads = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS))
        try:
            got = self._shapes.get((x.shape, padding, threads))
        except TypeError:  # an unhashable padding (a list)
            return None
        shape, geo, plan = got if got is not None else self._shape(x.shape, padding, threads)
        if plan is None or plan[0] not in (_MODE_ROWS_FUSED, _MODE_PADDED):
            return None
        if threads > 1 and (plan[6] or 2 * cw.panels.nbytes > config.L2_BYTES):
            return None
        pgeo = _geometry(shape, kernel, kernel, stride, pool_padding, 1, 1, "max_pool2d")
        y = aligned_empty((pgeo[0], pgeo[4], pgeo[5], pgeo[3]))
        if y.size == 0:
            return None
        chunks = min(threads, pgeo[4])
        c = aligned_empty((chunks,) + shape)
        blk = pooled_rows(geo[0] * geo[4] * geo[5], cw.k, cw.cout // NR, geo[5])
        if plan[0] == _MODE_PADDED:
            x, geo = _zero_padded(x, geo)
        e_size = pad16(max(16, _conv_sizes(blk * geo[5], cw.k, plan[0], geo[5])[0]))
        edge = workspace(chunks * e_size)
        args = (x.reshape(-1), geo, cw.k, cw.cout, cw.panels[0], c.reshape(-1), self.bias_f,
                self.act, plan[0], edge, blk, pgeo, y.reshape(-1))
        run_chunks(chunks, _conv_pooled, _pooled_parallel, args)
        return y

    # A pair of convolutions, the second reading the first's output alone, where the second
    # runs `_MODE_PADDED` and the first `_MODE_FLAT` (ResNet-50's bottleneck: the 1x1 before
    # each 3x3 on a 28-, 14- or 7-wide map or at stride 2): the first writes its output into
    # the interior of the zero-bordered map the second reads in place (`border`, `into`,
    # `bordered`), and `_zero_padded`'s copy of it goes (hepti.model.cnn `apply_pair`).

    def _bordered_plan(self, x_shape: tuple, padding, threads) -> tuple | None:
        """`_shape`'s (output shape, geo, plan) with the plan `_MODE_PADDED`'s, where this
        layer reads x of this shape from a zero-bordered map when one is given: where it makes
        that map itself, and where it runs `_MODE_ROWS_FUSED` (with BORDERED_ROWS), whose
        gathered border tiles cost about what the copy did; None elsewhere."""
        key = ("bordered", x_shape, padding, threads)
        got = self._shapes.get(key)
        if got is not None or key in self._shapes:
            return got
        cw = self.w
        shape, geo, plan = self._shapes.get((x_shape, padding, threads)) or \
            self._shape(x_shape, padding, threads)
        if cw.depthwise or plan is None or not (
                plan[0] == _MODE_PADDED or BORDERED_ROWS and plan[0] == _MODE_ROWS_FUSED):
            got = None
        else:
            got = (shape, geo, plan if plan[0] == _MODE_PADDED else _conv_shape(
                cw.kh, cw.kw, cw.cout, cw.groups, geo, int(threads), _MODE_PADDED))
        self._shapes[key] = got
        return got

    def border(self, x_shape: tuple, padding, threads: int = 1) -> tuple | None:
        """The extent (hp, wp, top, left) of the zero-bordered map this layer reads x of this
        shape from when given one (`_bordered_plan`), None when it reads x otherwise."""
        got = self._bordered_plan(x_shape, padding, threads)
        return None if got is None else _padded_extent(got[1])

    def into(self, x: np.ndarray, extent: tuple, threads: int = 1,
             reuse: bool = False) -> np.ndarray | None:
        """This layer (a 1x1 at stride 1 without padding, `_MODE_FLAT`) on x, written into
        the interior of a new zero-bordered map of `extent` (`border`'s): that map [N, hp, wp,
        Cout]; None where this layer does not run `_MODE_FLAT` (call it as usual then).

        reuse: the map may be one an earlier call with reuse made for a map of this shape
        (any layer's: `_KEPT_MAPS`), when nothing else holds it any more (its refcount says
        so): only its interior is written (the kernel writes all of it), its border is still
        the zeros it was made with. For a caller that lets the map go before the next pair
        (hepti.model.cnn `apply_pair`). A new map's np.empty and four border stores cost
        ~30 us a pair in a forward (cold caches between multi-ms kernels; ~4 us hot), ~0.5-1
        ms of ResNet-50's at 224; the maps kept are one per shape (7 at 224, 4.9 MB)."""
        cw = self.w
        got = self._flat(x, threads)
        if got is None:
            return None
        shape, plan = got
        n, h, w, cout = shape
        xp, offs = self._map(x.shape, shape, extent, reuse)
        _, _, n_chunks, mb, n_blocks, _, by_panels = plan
        args = (x.reshape(-1), cw.cin, cw.cout, cw.panels[0], xp.reshape(-1), offs)
        if n_chunks == 1:
            _into_fused(*args, 0, n_blocks, mb, n * h * w, self.bias_f, self.act)
        else:
            previous = numba.get_num_threads()
            numba.set_num_threads(n_chunks)
            try:
                _into_parallel(n_chunks, *args, n_blocks, mb, n * h * w, self.bias_f,
                               self.act, by_panels)
            finally:
                numba.set_num_threads(previous)
        return xp

    def _flat(self, x: np.ndarray, threads: int) -> tuple | None:
        """(output shape, plan) where this layer runs on x as `_MODE_FLAT` (a 1x1 at stride 1
        without padding, x a C-contiguous float32 [N, H, W, Cin]), else None."""
        if self.w.depthwise or type(x) is not np.ndarray or x.dtype is not _F32 or \
                x.ndim != 4 or not x.flags.c_contiguous:
            return None
        shape, _, plan = self._shapes.get((x.shape, 0, threads)) or \
            self._shape(x.shape, 0, threads)
        if plan is None or plan[0] != _MODE_FLAT:
            return None
        return shape, plan

    def _map(self, x_shape: tuple, shape: tuple, extent: tuple, reuse: bool) -> tuple:
        """(the zero-bordered map `into` writes this layer's output of `shape` into, the
        offsets of its pixels there): a kept one with reuse when nobody holds it (`into`)."""
        key = ("into", x_shape, extent)
        offs = self._shapes.get(key)
        if offs is None:
            offs = self._shapes[key] = into_offsets(*shape, extent)
        if reuse:
            kept = _KEPT_MAPS.get((shape, extent))
            # held by the dict alone (as `_free_refs` counts it): nobody else has it
            if kept is not None and sys.getrefcount(kept) == _FREE_REFS:
                return kept, offs
        xp = _bordered(*shape, extent)
        if reuse:
            if len(_KEPT_MAPS) >= 16:  # many shapes (a planner's trials): start again
                _KEPT_MAPS.clear()
            _KEPT_MAPS[(shape, extent)] = xp
        return xp, offs

    def pair(self, second: "ConvLayer", x: np.ndarray, extent: tuple, padding,
             residual: np.ndarray | None = None) -> np.ndarray | None:
        """`into(x, extent, reuse=True)` then second's `bordered` on it, on one thread, as one
        kernel call (`_pair_rows`): second's output, bit for bit theirs; None where either
        would not run so on one thread (call them, or the layers, as usual then). A kernel
        call's dispatch costs ~16-20 us in a forward (its arguments unboxed with the caches
        cold after the kernel before it), the Python between the two calls as much again."""
        cw, cw2 = self.w, second.w
        got = self._flat(x, 1)
        if got is None or got[1][2] != 1:
            return None
        shape, plan = got
        got = second._bordered_plan(shape, padding, 1)
        if got is None or got[2][2] != 1:
            return None
        shape2, geo, plan2 = got
        n, h, w, cout = shape
        hp, wp = _padded_extent(geo)[:2]
        if (hp, wp) != extent[:2]:
            raise ValueError(f"extent {extent} is not the bordered map {second!r} reads for "
                             f"x {shape} (padding {padding})")
        xp, offs = self._map(x.shape, shape, extent, True)
        y = aligned_empty(shape2)
        res = EMPTY if residual is None else _residual(residual, shape2, y)
        _, h_, w_, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
        geo_p = (n, hp, wp, cin, ho, wo, kh, kw, sh, sw, 0, 0, dh, dw, cg)
        _, _, _, mb, n_blocks, ws_chunk, _ = plan
        mode2, _, _, mb2, n_blocks2, ws_chunk2, _ = plan2
        _pair_rows(x.reshape(-1), cw.cin, cout, cw.panels[0], xp.reshape(-1), offs, n_blocks,
                   mb, n * h * w, self.bias_f, self.act, geo_p, cw2.k, cw2.cout, cw2.panels,
                   y.reshape(-1), n_blocks2, mb2, n * ho * wo,
                   (mb2, config.KC, 1, config.PREFETCH_ROWS),
                   (second.bias_f, second.bias is not None, False, res, 0, cw2.cout,
                    residual is not None), second.act, mode2, workspace(ws_chunk2))
        return y

    def bordered(self, xp: np.ndarray, x_shape: tuple, padding,
                 residual: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
        """This layer on the map x of x_shape held in xp, the zero-bordered map of `border`'s
        extent (from `into`): as `__call__` on x, with no copy of it."""
        cw = self.w
        shape, geo, plan = self._bordered_plan(x_shape, padding, threads) or (None, None, None)
        if plan is None or xp.shape[:3] != (x_shape[0],) + _padded_extent(geo)[:2]:
            raise ValueError(f"xp {xp.shape} is not the bordered map this layer reads for x "
                             f"{x_shape} (padding {padding})")
        y = aligned_empty(shape)
        res = EMPTY if residual is None else _residual(residual, shape, y)
        n, h, w, cin, ho, wo, kh, kw, sh, sw, pt, pl, dh, dw, cg = geo
        geo_p = (n, xp.shape[1], xp.shape[2], cin, ho, wo, kh, kw, sh, sw, 0, 0, dh, dw, cg)
        _conv_run(xp, cw, geo_p, y, (self.bias_f, self.bias is not None, False, res, 0,
                                     cw.cout, residual is not None), self.act, plan, False)
        return y


# (output shape, extent) -> the zero-bordered map `ConvLayer.into(reuse=True)` made last for
# it, written again once nobody holds it
_KEPT_MAPS: dict = {}


def _free_refs() -> int:
    """sys.getrefcount of an array a dict alone holds, read as `ConvLayer._map` reads it (3
    on CPython 3.11: the dict, the local, the call's argument; an interpreter that borrows the
    local's reference counts fewer, and a fixed 3 would then let a held map be written)."""
    d = {0: np.empty(0, np.float32)}
    kept = d.get(0)
    return sys.getrefcount(kept)


_FREE_REFS = _free_refs()


def into_offsets(n: int, h: int, w: int, c: int, extent: tuple) -> np.ndarray:
    """int64 [n*h*w]: where pixel (b, y, x) of an [n, h, w, c] map starts in the flat
    zero-bordered map of extent (hp, wp, top, left) (`ConvLayer.into`)."""
    hp, wp, pt, pl = extent
    b, yy, xx = np.meshgrid(np.arange(n), np.arange(h), np.arange(w), indexing="ij")
    return (((b * hp + yy + pt) * wp + xx + pl) * c).reshape(-1).astype(np.int64)


def _depthwise_run(x, cw, bias, stride, padding, dilation, relu, residual, out, threads):
    """depthwise_conv2d on checked x and a depthwise ConvWeight."""
    act = _act(relu)
    geo = _geometry(x.shape, cw.kh, cw.kw, stride, padding, dilation, 1, "depthwise_conv2d")
    n, ho, wo = geo[0], geo[4], geo[5]
    y = _out4(out, (n, ho, wo, cw.cout))
    if np.shares_memory(y, x):
        raise ValueError("out overlaps x; the kernel reads x while writing out: pass a "
                         "separate output buffer")
    res = _residual(residual, y.shape, y)
    bias_v = np.zeros(cw.cout, np.float32) if bias is None else vector(bias, "bias", cw.cout)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n_rows = n * ho
    n_chunks = max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS, n_rows))
    args = (x.reshape(-1), geo, cw.taps, bias_v, res, residual is not None, act, y.reshape(-1))
    if y.size == 0:
        return y
    if n_chunks == 1:
        _depthwise(*args, 0, n_rows)
    else:
        previous = numba.get_num_threads()
        numba.set_num_threads(n_chunks)
        try:
            _depthwise_parallel(n_chunks, *args, n_rows)
        finally:
            numba.set_num_threads(previous)
    return y


def depthwise_conv2d(x: np.ndarray, w, bias: np.ndarray | None = None, stride=1, padding=0,
                     dilation=1, relu: str | None = None, residual: np.ndarray | None = None,
                     out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """Depthwise convolution (groups == C, one filter per channel) of x float32 [N, H, W, C].

    w: a depthwise ConvWeight from pack_conv_weight(w, groups=C), or PyTorch's [C, 1, kh, kw].
    Arguments otherwise as for `conv2d`. Any kernel size; 3x3 is MobileNetV2's.
    """
    x = _nhwc(x)
    if isinstance(w, ConvWeight):
        cw = w
    else:
        check_float32(w, "w", 4)
        if w.shape[1] != 1 or w.shape[0] != x.shape[3]:
            raise ValueError(f"a depthwise weight for x {x.shape} must be [C={x.shape[3]}, 1, "
                             f"kh, kw], got {w.shape}")
        cw = pack_conv_weight(w, groups=w.shape[0])
    if not cw.depthwise or cw.cin != x.shape[3]:
        raise ValueError(f"x {x.shape} needs a depthwise weight of {x.shape[3]} channels, got "
                         f"{cw!r}")
    return _depthwise_run(x, cw, bias, stride, padding, dilation, relu, residual, out, threads)


def _pool_run(x, kernel_size, stride, padding, is_max, out, what):
    x = _nhwc(x)
    kh, kw = _pair(kernel_size, "kernel_size")
    geo = _geometry(x.shape, kh, kw, kernel_size if stride is None else stride, padding, 1,
                    1, what)
    y = _out4(out, (geo[0], geo[4], geo[5], geo[3]))
    if np.shares_memory(y, x):
        raise ValueError(f"{what}: out overlaps x: pass a separate output buffer")
    if y.size:
        _pool(x.reshape(-1), geo, is_max, y.reshape(-1))
    return y


def max_pool2d(x: np.ndarray, kernel_size, stride=None, padding=0,
               out: np.ndarray | None = None) -> np.ndarray:
    """Max over each kernel_size window of x float32 [N, H, W, C] (padding never wins; a
    window entirely in the padding gives -inf). stride defaults to kernel_size, as in
    PyTorch; floor of the output size (ceil_mode=False)."""
    return _pool_run(x, kernel_size, stride, padding, True, out, "max_pool2d")


def avg_pool2d(x: np.ndarray, kernel_size, stride=None, padding=0,
               out: np.ndarray | None = None) -> np.ndarray:
    """Mean over each kernel_size window of x float32 [N, H, W, C], padding counted as zeros
    (PyTorch's count_include_pad=True, ceil_mode=False)."""
    return _pool_run(x, kernel_size, stride, padding, False, out, "avg_pool2d")


def global_avg_pool(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Mean over H and W: x float32 [N, H, W, C] -> [N, C]."""
    x = _nhwc(x)
    n, h, w, c = x.shape
    if h * w == 0:
        raise ValueError(f"global_avg_pool needs at least one pixel, got x {x.shape}")
    y = _out4(out, (n, c))
    if y.size:
        _global_avg(x.reshape(-1), n, h * w, c, y.reshape(-1))
    return y


def _elementwise(x, out, act, what):
    if not isinstance(x, np.ndarray) or x.dtype != np.float32:
        raise TypeError(f"{what} takes a float32 numpy array, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if out is None:
        y = np.empty_like(x, order="C")
        src = np.ascontiguousarray(x)
    else:
        y = _out4(out, x.shape)
        src = x if out is x else np.ascontiguousarray(x)
    if out is not x:
        y[...] = src
    if y.size:
        _activate(y.reshape(-1), 0, y.size, 1, y.size, act)
    return y


def relu(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """max(x, 0) elementwise for a float32 array of any shape; out=x works in place."""
    return _elementwise(x, out, 1, "relu")


def relu6(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """min(max(x, 0), 6) elementwise for a float32 array of any shape; out=x works in place."""
    return _elementwise(x, out, 2, "relu6")


def fold_batchnorm(w: np.ndarray, b: np.ndarray | None, gamma: np.ndarray, beta: np.ndarray,
                   mean: np.ndarray, var: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """(w', b') with conv(x, w') + b' == BatchNorm(conv(x, w) + b) in inference mode.

    w [Cout, ...] (PyTorch layout, any trailing dims), b [Cout] or None; BatchNorm's
    gamma, beta, running mean, running var [Cout]. scale = gamma / sqrt(var + eps);
    w' = w * scale per output channel, b' = (b - mean) * scale + beta. Computed in float64,
    returned as float32 (numpy; used when converting weights).
    """
    w64 = np.asarray(w, np.float64)
    cout = w64.shape[0] if w64.ndim else 0
    params = {"gamma": gamma, "beta": beta, "mean": mean, "var": var}
    if b is not None:
        params["b"] = b
    for name, v in params.items():
        if np.shape(v) != (cout,):
            raise ValueError(f"{name} must have shape ({cout},) to match w {w64.shape}, got "
                             f"{np.shape(v)}")
    scale = np.asarray(gamma, np.float64) / np.sqrt(np.asarray(var, np.float64) + eps)
    w_f = w64 * scale.reshape((cout,) + (1,) * (w64.ndim - 1))
    b0 = np.zeros(cout) if b is None else np.asarray(b, np.float64)
    b_f = (b0 - np.asarray(mean, np.float64)) * scale + np.asarray(beta, np.float64)
    return w_f.astype(np.float32), b_f.astype(np.float32)
