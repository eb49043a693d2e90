"""Blocked float32 GeMM with a fused epilogue: C = A @ B (+ bias) (-> GeLU) (+ residual).

Two layers (STUMPY style): `pack_b`, `gemm` and `matmul` check arguments, allocate and choose
block sizes; the @njit functions below only do arithmetic.

Layout. B is cut into NR-wide column panels, each stored [K, NR] with rows contiguous
(`PackedB.panels`, [n_panels, K, NR]); the last panel is zero-padded. A and C are read and
written in place through flat views (see _views.py), so row slices and column blocks cost nothing.

Loop order with B pre-packed (`gemm`), for each block of MC rows of A (packed into MR-row
tiles, k-major; in L3 when not in L2: config.GEMM_A_BLOCK_BYTES says why):
    for each panel jp (prange over panel ranges when threads > 1)
        for each k-block of up to KC_PACKED rows of the panel (config.py: the C strip's
        read-modify-write per k-block costs more than streaming a deep slice from L2)
            for each MR-row tile: C tile (+)= A tile @ panel slice   (register tile)
            after the last k-block, bias, GeLU, residual on the tile in registers, one store
A full panel's full tiles run the explicit-vector IR tile (`_gemm_ir.tile_packed8`, epilogue
included); a partial last panel's full tiles and those of B packed on the fly (`_kblock`) run it
without the epilogue, which they get as a pass over the strip (`_finish`, `epilogue_strip`), as
does a short last tile (rows % MR, the generated Numba `micro_tile`). Since 2026-12-02 `_kblock`
no longer runs the generated 8 x 32 tile (`full_tiles`), whose named accumulators spilled on
AVX2's sixteen registers where the IR tile runs in passes that fit (`register_passes`).
Measured 2026-11-30, one process, interleaved, CPU time, load ~5: the IR tile took 0.94-0.97x
the named-scalar tile's time on the peak shapes (no epilogue) and on MiniLM's QKV, output and
up projections (bias; bias + GeLU), the down projection (K = 1536: two k-blocks) 1.00x; MiniLM's
forward 0.972x, outputs within 1.6e-6.
While a pre-packed panel is computed, the next one (contiguous after it) is prefetched into
L2 by software prefetch, one cache line every few k steps of the micro-kernel (see
`_ir_tiles`): MiniLM's weights, 42 MB, are read from DRAM every forward.

`matmul` packs B on the fly with the k-blocks outermost (`_on_the_fly`): for each k-block, a
group of panels (~L2/8) is packed from B's rows [KC, group * NR] into a per-thread buffer, each
row segment read in one sequential pass, then every row tile runs over each panel slice. So B
is read once per A block, a few pages per k-block rather than one page per row and panel (the
earlier panel-outer order read B at ~5 GB/s, page by page, and lost 10-15% to it). A single
row (M = 1) skips packing and streams B's rows (`_gemv`).

One row of A with B pre-packed (a decoder's decode step) skips the micro-kernel: it walks four
panels side by side (`_gemv_panels`), as many streams as the prefetchers follow best.
"""
from __future__ import annotations

import functools

import numba
import numpy as np
from numba import njit, prange

from hepti.kernels import config
from hepti.kernels._gemm_ir import tile_packed8
from hepti.kernels._intrinsics import prefetch_l2
from hepti.kernels._transpose_ir import pack8
from hepti.kernels._microkernels import (MR, NR, copy_row, epilogue_strip, micro_tile,
                                        pack_a_tile)
from hepti.kernels._views import (EMPTY, aligned_empty, check_float32, check_no_overlap,
                                  flat_rows, output, pad16, vector, workspace)
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.mathfn import gelu32
from hepti.kernels.norm import layernorm, layernorm_inplace, ln_tail

if (MR, NR) != (8, 32):  # _gemm_ir.tile_packed8 is written for 8 x 32 (two 16-float vectors)
    raise ImportError(f"packed_gemm's IR tile is 8 x 32, but config.py sets MR = {MR}, NR = {NR}: "
                      "give _gemm_ir a tile of that size, or set MR = 8, NR = 32")

_PANELS_NONE = np.zeros((0, 0, NR), np.float32)  # stands in for "no pre-packed B"
_ZERO = np.float32(0.0)


class PackedB:
    """A weight B [K, N] packed once (at load time) into NR-wide panels for `gemm`.

    panels: float32 [n_panels, K, NR]; panels[jp, p, j] = B[p, jp * NR + j], zero past N.
    """

    __slots__ = ("panels", "k", "n")

    def __init__(self, panels: np.ndarray, n: int):
        if panels.ndim != 3 or panels.shape[2] != NR or panels.shape[0] != -(-n // NR):
            raise ValueError(f"panels of shape {panels.shape} do not hold {n} columns in "
                             f"panels of {NR}")
        self.panels = panels  # [n_panels, K, NR]
        self.k = panels.shape[1]
        self.n = n

    @property
    def nbytes(self) -> int:
        """Bytes held by the packed panels (including the zero padding of the last one)."""
        return self.panels.nbytes

    def __repr__(self) -> str:
        return f"PackedB(k={self.k}, n={self.n}, nbytes={self.nbytes})"


# ------------------------------------------------------------------------------------------
# @njit kernels: arithmetic only
# ------------------------------------------------------------------------------------------


@njit(**JIT)
def _pack_panel(b, b_off, ldb, trans, k, j0, ncols, dst):
    """dst [k, NR] = columns j0 .. j0+ncols-1 of B, zero-padded to NR.

    B [K, N] is flat: B[p, j] = b[b_off + p*ldb + j], or when trans (B given as its
    transpose [N, K], e.g. PyTorch's [out, in] weights) B[p, j] = b[b_off + j*ldb + p].
    """
    if not trans:
        for p in range(k):
            src = b[b_off + p * ldb + j0:b_off + p * ldb + j0 + ncols]
            row = dst[p]
            if ncols == NR:
                copy_row(src, row)
                continue
            for j in range(ncols):
                row[j] = src[j]
            for j in range(ncols, NR):
                row[j] = 0.0
    else:
        for j in range(ncols):
            src = b[b_off + (j0 + j) * ldb:b_off + (j0 + j) * ldb + k]
            for p in range(k):
                dst[p, j] = src[p]
        for p in range(k):
            row = dst[p]
            for j in range(ncols, NR):
                row[j] = 0.0


@njit(**JIT)
def _pack_group(b, b_off, ldb, k, j0, ncols, pf_dist, dst, d0):
    """dst[d0:d0+g] = the g = ceil(ncols/NR) panels [k, NR] of columns j0 .. j0+ncols-1 of B.

    Reads each row of B once, contiguously (g * NR floats), and prefetches the row pf_dist
    ahead: rows of a wide B are pages apart, where hardware prefetchers do not follow.
    """
    g_full = ncols // NR
    rem = ncols - g_full * NR
    for p in range(k):
        if pf_dist > 0 and p + pf_dist < k:
            ahead = b_off + (p + pf_dist) * ldb + j0
            for q in range(0, ncols, 16):
                prefetch_l2(b, ahead + q)
            prefetch_l2(b, ahead + ncols - 1)
        src = b[b_off + p * ldb + j0:b_off + p * ldb + j0 + ncols]
        for g in range(g_full):
            copy_row(src[g * NR:g * NR + NR], dst[d0 + g, p])
        if rem:
            row = dst[d0 + g_full, p]
            for j in range(rem):
                row[j] = src[g_full * NR + j]
            for j in range(rem, NR):
                row[j] = 0.0


@njit(**JIT)
def _pack_all(b, b_off, ldb, trans, k, n, group, pf_dist, panels):
    """Pack all of B into panels [n_panels, k, NR], `group` panels per pass over B's rows."""
    n_panels = panels.shape[0]
    for g0 in range(0, n_panels, 1 if trans else group):
        j0 = g0 * NR
        if trans:
            _pack_panel(b, b_off, ldb, True, k, j0, min(NR, n - j0), panels[g0])
        else:
            g1 = min(n_panels, g0 + group)
            _pack_group(b, b_off, ldb, k, j0, min(n, g1 * NR) - j0, pf_dist, panels, g0)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _epilogue(c, c_off, ldc, rows, cols, j0, epi):
    """On C[rows, cols] at c_off: += bias[j0 + j], then GeLU, then += residual.

    epi = (bias [N], has_bias, gelu, residual flat, offset of the residual's element matching
    c[c_off], its row stride, has_residual).
    """
    bias, has_bias, gelu, res, r_off, ldr, has_res = epi
    for i in range(rows):
        cr = c[c_off + i * ldc:c_off + i * ldc + cols]
        if has_bias:
            br = bias[j0:j0 + cols]
            for j in range(cols):
                cr[j] += br[j]
        if gelu:
            for j in range(cols):
                cr[j] = gelu32(cr[j])
        if has_res:
            rr = res[r_off + i * ldr:r_off + i * ldr + cols]
            for j in range(cols):
                cr[j] += rr[j]


@njit(**JIT)
def _shift_epi(epi, rows, cols):
    """The epilogue tuple for a sub-block starting `rows` rows and `cols` columns further on,
    its flags and offsets as np.bool_ / np.int64 whatever the caller's (a literal True or 0 in
    a caller's tuple would otherwise give the kernels under it a signature of their own)."""
    bias, has_bias, gelu, res, r_off, ldr, has_res = epi
    return (bias, np.bool_(has_bias), np.bool_(gelu), res, np.int64(r_off + rows * ldr + cols),
            np.int64(ldr), np.bool_(has_res))


@njit(**JIT)
def _pack_a(a, a_off, lda, m0, m1, k, apack):
    """apack [n_tiles, k, MR]: rows m0 .. m1-1 of the flat A, MR rows per tile, k-major.

    apack[t, p, i] = A[m0 + t*MR + i, p]; rows past m1 in the last tile are left unset (the
    micro-kernel for a short tile never reads them). A full tile goes 16 columns at a time by
    register transposes (`_transpose_ir.pack8`): 0.36x the time of the scalar copy
    (`pack_a_tile`) at 128 x 1536, 0.33x at 128 x 384 (~60 us of a MiniLM layer's 5 ms).
    """
    for t in range(-(-(m1 - m0) // MR)):
        tile = apack[t]
        rows = min(MR, m1 - m0 - t * MR)
        if rows == MR and MR == 8:  # 16 columns at a time by register transposes
            off = a_off + (m0 + t * MR) * lda
            p0 = 0
            while p0 + 16 <= k:
                pack8(a, off + p0, lda, tile, p0 * MR)
                p0 += 16
            for p in range(p0, k):
                tp = tile[p]
                for i in range(MR):
                    tp[i] = a[off + i * lda + p]
            continue
        if rows == MR:
            pack_a_tile(a, a_off + (m0 + t * MR) * lda, lda, k, tile)
            continue
        for i in range(rows):
            r = a_off + (m0 + t * MR + i) * lda
            row = a[r:r + k]
            for p in range(k):
                tile[p, i] = row[p]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _kblock(apack, rows, k0, kc, bp, bk0, dst, d_off, ldd, accumulate, pf, pf_lo, pf_hi):
    """dst rows 0 .. rows-1 (flat, from d_off, stride ldd; NR wide) (+)= packed A block
    columns k0 .. k0+kc-1 @ bp rows bk0 .. bk0+kc-1, the full tiles on the IR tile
    (`_ir_tiles`, no epilogue). Meanwhile pf[pf_lo:pf_hi] is prefetched into L2, spread over
    the full tiles' k loops (all at once if there are none).

    Its callers pass constants (d_off 0, ldd NR, no prefetch 0, 0), which arrive as literal
    types: the tiles get plain np.int64 / np.bool_, one compiled signature each."""
    n_full = rows // MR
    rem = rows - n_full * MR
    if n_full == 0:
        for q in range(pf_lo, pf_hi, 16):
            prefetch_l2(pf, q)
    kc, k0, bk0, ldd = np.int64(kc), np.int64(k0), np.int64(bk0), np.int64(ldd)
    acc = np.bool_(accumulate)
    no = np.bool_(False)
    _ir_tiles(np.int64(n_full), kc, apack, bp, k0, bk0, dst, np.int64(d_off), ldd, acc,
              (pf[:0], no, no, pf[:0], np.int64(0), np.int64(1), no), np.int64(0), no, pf,
              np.int64(pf_lo), np.int64(pf_hi))
    if rem:
        micro_tile(np.int64(rem), kc, apack[n_full], bp, k0, bk0, dst,
                   np.int64(d_off + n_full * MR * ldd), ldd, acc)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _finish(rows, c, c_off, ldc, j0, ncols, scratch, epi):
    """After a strip's last k-block: copy a partial panel's ncols valid columns out of scratch
    [rows * NR] into C (a full one was written in place), then run the epilogue on the strip
    while it is still in L1/L2."""
    if ncols < NR:
        for i in range(rows):
            src = scratch[i * NR:i * NR + ncols]
            cr = c[c_off + i * ldc + j0:c_off + i * ldc + j0 + ncols]
            for j in range(ncols):
                cr[j] = src[j]
    if epi[1] or epi[2] or epi[6]:
        if ncols == NR:
            epilogue_strip(c, c_off + j0, ldc, rows, j0, _shift_epi(epi, 0, j0))
        else:
            _epilogue(c, c_off + j0, ldc, rows, ncols, j0, _shift_epi(epi, 0, j0))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _ir_tiles(n_full, kc, apack, bp, k0, bk0, c, c_off, ldc, accumulate, epi, j0, fuse, pf,
              pf_lo, pf_hi):
    """The full MR-row tiles 0 .. n_full-1 of a full NR-column strip of C (from c_off, row
    stride ldc; j0: the strip's first column): C (+)= apack[t] columns k0 .. k0+kc-1 @ bp rows
    bk0 .. bk0+kc-1, by the IR tile (`_gemm_ir.tile_packed8`); with `fuse`, the epilogue epi
    (its residual offset at the strip's row 0, column j0) is applied in registers before the
    store. Meanwhile pf[pf_lo:pf_hi] is prefetched into L2, an equal share per tile, spread
    over its k loop."""
    bias, has_bias, gelu, res, r_off, ldr, has_res = epi
    if not fuse:
        has_bias = has_res = gelu = False
    apf = apack.reshape(-1)
    tile_len = apack.shape[1] * MR
    n_lines = -(-(pf_hi - pf_lo) // 16)
    per_tile = -(-n_lines // max(n_full, 1))
    for t in range(n_full):
        q = pf_lo + t * per_tile * 16
        n_here = max(0, -(-(min(pf_hi, q + per_tile * 16) - q) // 16))
        while n_here > kc:  # more lines than k steps: the excess up front
            prefetch_l2(pf, q)
            q += 16
            n_here -= 1
        tile_packed8(apf, t * tile_len + k0 * MR, kc, bp, bk0, c, c_off + t * MR * ldc, ldc,
                     accumulate, bias, j0, has_bias, gelu, res, r_off + t * MR * ldr, ldr,
                     has_res, pf, q, n_here, max(1, kc // max(n_here, 1)))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _strip(apack, rows, k, kc_max, bp, c, c_off, ldc, j0, ncols, scratch, epi, pf, pf_lo,
           pf_hi):
    """C[0:rows, j0:j0+ncols] = epilogue(packed A block @ pre-packed panel bp [k, NR]).

    c_off and epi point at row 0 of the block. A full panel (ncols == NR) is written straight
    into C, its full MR-row tiles by the IR tile with the epilogue applied in registers after
    the last k-block (`_ir_tiles`); the last, partial panel goes through scratch
    [rows * NR] and gets the epilogue as a pass over the strip (`_finish`). Meanwhile B data
    needed next (pf[pf_lo:pf_hi], 64-byte aligned at pf_lo) is prefetched into L2, a share
    per k-block.
    """
    n_kblocks = max(1, -(-k // kc_max))
    per_block = -(-(pf_hi - pf_lo) // (n_kblocks * 16)) * 16  # whole cache lines
    if ncols < NR:
        for kb in range(n_kblocks):
            k0 = kb * kc_max
            lo = min(pf_hi, pf_lo + kb * per_block)
            _kblock(apack, rows, k0, min(kc_max, k - k0), bp, k0, scratch, 0, NR, kb > 0,
                    pf, lo, min(pf_hi, lo + per_block))
        _finish(rows, c, c_off, ldc, j0, ncols, scratch, epi)
        return
    n_full = rows // MR
    rem = rows - n_full * MR
    epi_j = _shift_epi(epi, 0, j0)
    for kb in range(n_kblocks):
        k0 = kb * kc_max
        kc = min(kc_max, k - k0)
        lo = min(pf_hi, pf_lo + kb * per_block)
        hi = min(pf_hi, lo + per_block)
        if n_full == 0:
            for q in range(lo, hi, 16):
                prefetch_l2(pf, q)
        _ir_tiles(n_full, kc, apack, bp, k0, k0, c, c_off + j0, ldc, kb > 0, epi_j, j0,
                  kb == n_kblocks - 1, pf, lo, hi)
        if rem:
            micro_tile(rem, kc, apack[n_full], bp, k0, k0, c, c_off + j0 + n_full * MR * ldc,
                       ldc, kb > 0)
    if rem and (epi[1] or epi[2] or epi[6]):
        epilogue_strip(c, c_off + j0 + n_full * MR * ldc, ldc, rem, j0,
                       _shift_epi(epi, n_full * MR, j0))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _on_the_fly(p_lo, p_hi, apack, rows, k, n, b, b_off, ldb, buf, c, c_off, ldc, blocks,
                scratch, epi):
    """Panels p_lo .. p_hi-1 of C for one packed block of A, B [K, N] packed as it is used.

    k-blocks outermost: for each, B's rows k0 .. k0+kc-1 are packed a group of panels at a
    time into buf [group, KC, NR] (each row segment read in one sequential pass: a few pages
    per k-block, which the hardware prefetchers follow, rather than one page per row and
    panel), then each panel of the group is multiplied into its C strip by every row tile
    while its KC x NR slice sits in L1. C strips accumulate over the k-blocks (a partial last
    panel in scratch [rows * NR]); the epilogue runs after the last. No software prefetch of
    the next group: measured no faster, sometimes slower.
    """
    kc_max, group = blocks[1], blocks[2]
    n_kblocks = max(1, -(-k // kc_max))
    for kb in range(n_kblocks):
        k0 = kb * kc_max
        kc = min(kc_max, k - k0)
        for g0 in range(p_lo, p_hi, group):
            g1 = min(p_hi, g0 + group)
            _pack_group(b, b_off + k0 * ldb, ldb, kc, g0 * NR, min(n, g1 * NR) - g0 * NR, 0,
                        buf, 0)
            for jp in range(g0, g1):
                j0 = jp * NR
                ncols = min(NR, n - j0)
                if ncols == NR:
                    dst, d_off, ldd = c, c_off + j0, ldc
                else:
                    dst, d_off, ldd = scratch, 0, NR
                _kblock(apack, rows, k0, kc, buf[jp - g0], 0, dst, d_off, ldd, kb > 0,
                        b, 0, 0)
                if kb == n_kblocks - 1:
                    _finish(rows, c, c_off, ldc, j0, ncols, scratch, epi)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _panel_range(p_lo, p_hi, apack, rows, k, n, panels, b, b_off, ldb, buf, c, c_off, ldc,
                 blocks, scratch, epi, nxt, nxt_n):
    """Panels p_lo .. p_hi-1 of C for one packed block of A.

    With pre-packed `panels`, the next panel is prefetched into L2 while one is computed, and
    while the last is, nxt[0:nxt_n] (what is read next: the range's first panel again when
    another row block follows, the next GeMM's first panel, or nothing when nxt_n = 0).
    Otherwise the flat B [K, N] (row p at b[b_off + p*ldb]) is packed as it is used
    (`_on_the_fly`, into buf) and nxt is not read.
    """
    if panels.shape[0] == 0:
        _on_the_fly(p_lo, p_hi, apack, rows, k, n, b, b_off, ldb, buf, c, c_off, ldc, blocks,
                    scratch, epi)
        return
    kc_max, pf_dist = blocks[1], blocks[3]
    panels_flat = panels.reshape(-1)
    for jp in range(p_lo, p_hi):
        pf, pf_lo, pf_hi = panels_flat, (jp + 1) * k * NR, (jp + 2) * k * NR  # contiguous
        if jp + 1 == p_hi:
            pf, pf_lo, pf_hi = nxt, 0, nxt_n
        _strip(apack, rows, k, kc_max, panels[jp], c, c_off, ldc, jp * NR,
               min(NR, n - jp * NR), scratch, epi, pf, pf_lo, pf_hi if pf_dist > 0 else pf_lo)


@njit(**JIT)
def _carve(ws, n_chunks, mc, k, buf_panels, buf_rows):
    """Split the workspace into packed A [tiles, k, MR], per-chunk B buffers
    [chunks, >= buf_panels * buf_rows * NR] and per-chunk partial C strips [chunks, >= mc * NR]."""
    n_a = -(-mc // MR) * k * MR
    n_buf = buf_panels * buf_rows * NR
    n_a16, n_buf16, n_s16 = -(-n_a // 16) * 16, -(-n_buf // 16) * 16, -(-mc * NR // 16) * 16
    apack = ws[:n_a].reshape((-(-mc // MR), k, MR))
    o = n_a16
    bufs = ws[o:o + n_chunks * n_buf16].reshape((n_chunks, n_buf16))
    o += n_chunks * n_buf16
    scratches = ws[o:o + n_chunks * n_s16].reshape((n_chunks, n_s16))
    return apack, bufs, scratches


def workspace_size(n_chunks: int, mc: int, k: int, buf_panels: int, buf_rows: int) -> int:
    """Floats of workspace `_carve` needs (keep in step with it)."""
    n_a = -(-mc // MR) * k * MR
    return pad16(n_a) + n_chunks * (pad16(buf_panels * buf_rows * NR) + pad16(mc * NR))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _gemm_serial(a, a_off, lda, m, k, n, panels, b, b_off, ldb, c, c_off, ldc, blocks, epi, ws,
                 nxt, nxt_n):
    """Whole GeMM on the calling thread: row blocks of A, each packed, times all panels.

    blocks = (MC rows of A per block, KC, panels per on-the-fly group, prefetch distance).
    With pre-packed `panels`, a row block's last panel prefetches the first panel again when
    another row block follows, else nxt[0:nxt_n]: the first panel of the GeMM that runs next
    (`_ffn_serial`, attention_core's `_block_serial`), or nothing (nxt_n = 0). Its callers
    pass non-literal scalars (np.int64, np.bool_, also inside the epilogue tuple): a literal 0
    or True types a call apart, and each such type is one more compiled signature of this
    function and of everything under it.
    """
    mc, group = blocks[0], blocks[2]
    buf_panels = 0 if panels.shape[0] > 0 else group
    buf_rows = min(k, blocks[1])
    apack, bufs, scratches = _carve(ws, 1, mc, k, buf_panels, buf_rows)
    buf = bufs[0, :buf_panels * buf_rows * NR].reshape((buf_panels, buf_rows, NR))
    panels_flat = panels.reshape(-1)
    for m0 in range(0, m, mc):
        m1 = min(m, m0 + mc)
        _pack_a(a, a_off, lda, m0, m1, k, apack)
        pf, pf_n = (panels_flat, k * NR) if m1 < m else (nxt, nxt_n)
        _panel_range(np.int64(0), -(-n // NR), apack, m1 - m0, k, n, panels, b, b_off, ldb, buf, c,
                     c_off + m0 * ldc, ldc, blocks, scratches[0], _shift_epi(epi, m0, 0),
                     pf, pf_n)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _gemm_parallel(n_chunks, a, a_off, lda, m, k, n, panels, b, b_off, ldb, c, c_off, ldc,
                   blocks, epi, ws):
    """Whole GeMM with the panels split into n_chunks contiguous ranges, one per thread.
    Each row block of A is packed by the threads too, a share of its MR-row tiles each: on
    one thread that copy was 1-4% of BERT-base's and MiniLM's GeMMs (the down projection's
    K = 3072 blocks: 280 us of 12.7 ms), time the other thread waited."""
    mc, group = blocks[0], blocks[2]
    buf_panels = 0 if panels.shape[0] > 0 else group
    buf_rows = min(k, blocks[1])
    n_panels = -(-n // NR)
    panels_flat = panels.reshape(-1)  # nothing of it prefetched after a chunk's last panel
    apack, bufs, scratches = _carve(ws, n_chunks, mc, k, buf_panels, buf_rows)
    for m0 in range(0, m, mc):
        m1 = min(m, m0 + mc)
        n_tiles = -(-(m1 - m0) // MR)
        for chunk in prange(n_chunks):
            t0, t1 = chunk * n_tiles // n_chunks, (chunk + 1) * n_tiles // n_chunks
            if t1 > t0:
                _pack_a(a, a_off, lda, m0 + t0 * MR, min(m1, m0 + t1 * MR), k, apack[t0:t1])
        for chunk in prange(n_chunks):
            buf = bufs[chunk, :buf_panels * buf_rows * NR].reshape((buf_panels, buf_rows, NR))
            _panel_range(chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks,
                         apack, m1 - m0, k, n, panels, b, b_off, ldb, buf, c,
                         c_off + m0 * ldc, ldc, blocks, scratches[chunk],
                         _shift_epi(epi, m0, 0), panels_flat, np.int64(0))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _gemv(a, a_off, k, n, b, b_off, ldb, c, c_off):
    """c[c_off:c_off+n] = a[a_off:a_off+k] @ B for the flat B [K, N] (row p at b[b_off+p*ldb]).

    One row of A needs each element of B once: packing would only add a copy, so B's rows
    are streamed in order (what the hardware prefetchers follow), four per pass over c.
    """
    cr = c[c_off:c_off + n]
    for j in range(n):
        cr[j] = 0.0
    p = 0
    while p + 4 <= k:
        x0, x1, x2, x3 = a[a_off + p], a[a_off + p + 1], a[a_off + p + 2], a[a_off + p + 3]
        r0 = b[b_off + p * ldb:b_off + p * ldb + n]
        r1 = b[b_off + (p + 1) * ldb:b_off + (p + 1) * ldb + n]
        r2 = b[b_off + (p + 2) * ldb:b_off + (p + 2) * ldb + n]
        r3 = b[b_off + (p + 3) * ldb:b_off + (p + 3) * ldb + n]
        for j in range(n):
            cr[j] += (x0 * r0[j] + x1 * r1[j]) + (x2 * r2[j] + x3 * r3[j])
        p += 4
    while p < k:
        x0 = a[a_off + p]
        r0 = b[b_off + p * ldb:b_off + p * ldb + n]
        for j in range(n):
            cr[j] += x0 * r0[j]
        p += 1


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _panel1_into(acc, x, k, pnl):
    """acc [NR] = x [k] @ pnl [k, NR]: one pre-packed panel, read once in order."""
    for j in range(NR):
        acc[j] = 0.0
    for p in range(k):
        xp = x[p]
        r = pnl[p]
        for j in range(NR):
            acc[j] += xp * r[j]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _panels4_into(acc, x, k, p0, p1, p2, p3):
    """acc [4, NR] = x [k] @ each of four pre-packed panels [k, NR], walked side by side."""
    a0, a1, a2, a3 = acc[0], acc[1], acc[2], acc[3]
    for j in range(NR):
        a0[j] = 0.0
        a1[j] = 0.0
        a2[j] = 0.0
        a3[j] = 0.0
    for p in range(k):
        xp = x[p]
        r0, r1, r2, r3 = p0[p], p1[p], p2[p], p3[p]
        for j in range(NR):
            a0[j] += xp * r0[j]
            a1[j] += xp * r1[j]
            a2[j] += xp * r2[j]
            a3[j] += xp * r3[j]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _gemv_panels(p_lo, p_hi, x, k, n, panels, c):
    """c[columns of panels p_lo .. p_hi-1] = x [k] @ B, B pre-packed ([n_panels, k, NR]).

    A decode step's GeMV (one row of A) is bound by reading B once from DRAM: each weight is
    used for one multiply-add. Through the GeMM's micro-kernel (one panel, one sequential
    stream, at a time) it read B at ~19 GB/s on an AVX-512 EPYC core; walking four panels side
    by side keeps four streams in flight for the hardware prefetchers and reads ~30 GB/s there
    (`hepti bench kernels`' gemv rows; numpy's sgemv on the unpacked matrix ~26). A fifth or
    more streams measured no better. So prefill (GeMM) and decode (GeMV) share one packed copy.
    """
    acc = np.empty((4, NR), np.float32)
    jp = p_lo
    while jp < p_hi:
        g = min(4, p_hi - jp)
        if g == 4:
            _panels4_into(acc, x, k, panels[jp], panels[jp + 1], panels[jp + 2], panels[jp + 3])
        else:
            for q in range(g):
                _panel1_into(acc[q], x, k, panels[jp + q])
        for q in range(g):
            j0 = (jp + q) * NR
            cr = c[j0:min(n, j0 + NR)]
            aq = acc[q]
            for j in range(cr.shape[0]):
                cr[j] = aq[j]
        jp += g


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _gemv_serial(x, k, n, panels, c, epi):
    _gemv_panels(0, panels.shape[0], x, k, n, panels, c)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _gemv_parallel(n_chunks, x, k, n, panels, c, epi):
    n_panels = panels.shape[0]
    for chunk in prange(n_chunks):
        _gemv_panels(chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks, x, k, n,
                     panels, c)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


# ------------------------------------------------------------------------------------------
# Public API: checks, allocation, block sizes
# ------------------------------------------------------------------------------------------


def row_block(m: int, k: int, budget: int = 0) -> int:
    """MC: rows of A per block, so that an MC x K block fits `budget` bytes (0: a
    convolution's, config.A_BLOCK_BYTES).

    The M rows are cut into equal blocks (a multiple of MR each), not full blocks plus a sliver.
    """
    cap = max(MR, (budget or config.A_BLOCK_BYTES) // (4 * max(k, 1)) // MR * MR)
    n_blocks = -(-m // cap)
    return min(cap, -(-(-(-m // n_blocks)) // MR) * MR)


def panel_group(k: int) -> int:
    """Panels packed per pass over B's rows by `pack_b`: a group of k-row panels fills ~L2/4."""
    return max(1, config.L2_BYTES // 4 // (max(k, 1) * NR * 4))


def otf_group(kc: int) -> int:
    """Panels packed at a time when packing on the fly, kc rows each: a group fills ~L2/8
    (256 KiB with a 2 MiB L2, 8 panels at KC = 256), leaving L2 to the packed A block.
    L2/4 and L2/16 measured within ~2% of it; L2/2 was ~5% slower."""
    return max(1, config.L2_BYTES // 8 // (max(kc, 1) * NR * 4))


def pack_b(w: np.ndarray, trans: bool = False) -> PackedB:
    """Pack a weight for `gemm`: w is float32 B [K, N], or with trans=True its transpose [N, K].

    PyTorch stores Linear weights as [out, in] = B^T, so pass those with trans=True; they are
    read in place (rows must be contiguous, else one contiguous copy is made first).
    """
    check_float32(w, "w", 2)
    if w.shape[1] > 1 and w.strides[1] != 4:
        w = np.ascontiguousarray(w)
    flat, ld = flat_rows(w, "w")
    n, k = w.shape if trans else w.shape[::-1]
    panels = aligned_empty((-(-n // NR), k, NR))
    if panels.size:
        _pack_all(flat, 0, ld, bool(trans), k, n, panel_group(k), config.PREFETCH_ROWS, panels)
    return PackedB(panels, n)


def operands(a, k, n, bias, gelu, residual, out):
    """Check a GeMM's A and epilogue operands and allocate C (the int8 kernels share this).

    Returns (c, a_flat, lda, c_flat, ldc, epi): C [M, N] (out, or new), the flat views the
    @njit kernels take, and the epilogue tuple `_epilogue` reads.
    """
    m = a.shape[0]
    c = np.empty((m, n), np.float32) if out is None else output(out, (m, n))
    a_flat, lda = (a.reshape(-1), k) if a.flags.c_contiguous and m else flat_rows(a, "a")
    c_flat, ldc = flat_rows(c, "out")
    bias_v = vector(bias, "bias", n)
    if residual is not None:
        check_float32(residual, "residual", 2)
        if residual.shape != (m, n):
            raise ValueError(f"residual must have shape {(m, n)}, got {residual.shape}")
        res_flat, ldr = flat_rows(residual, "residual")
    else:
        res_flat, ldr = EMPTY, 1
    if out is not None:
        check_no_overlap(c, a, "a")
        check_no_overlap(c, residual, "residual")
    epi = (bias_v, bias is not None, bool(gelu), res_flat, 0, ldr, residual is not None)
    return c, a_flat, lda, c_flat, ldc, epi


def _run(a, k, n, panels, b_flat, ldb, bias, gelu, residual, out, threads):
    """Shared tail of gemm/matmul: check epilogue operands, pick the path and run it."""
    m = a.shape[0]
    c, a_flat, lda, c_flat, ldc, epi = operands(a, k, n, bias, gelu, residual, out)
    if m == 0 or n == 0:
        return c
    n_chunks, blocks, ws_size = _plan(m, k, n, int(threads), panels.shape[0] == 0)
    if m == 1 and panels.shape[0]:  # a_flat and c_flat start at the row: k and n values of it
        run_chunks(n_chunks, _gemv_serial, _gemv_parallel, (a_flat, k, n, panels, c_flat, epi))
        return c
    ws = workspace(ws_size)
    args = (a_flat, 0, lda, m, k, n, panels, b_flat, 0, ldb, c_flat, 0, ldc, blocks, epi, ws)
    run_chunks(n_chunks, _gemm_alone, _gemm_parallel, args)
    return c


def _gemm_alone(*args) -> None:
    """`_gemm_serial` of a GeMM that nothing follows: its last panel prefetches nothing."""
    _gemm_serial(*args, EMPTY, 0)


def run_chunks(n_chunks: int, serial, parallel, args: tuple) -> None:
    """serial(*args) on the calling thread, or parallel(n_chunks, *args) on n_chunks Numba
    threads (the thread count restored after)."""
    if n_chunks == 1:
        serial(*args)
        return
    previous = numba.get_num_threads()
    numba.set_num_threads(n_chunks)
    try:
        parallel(n_chunks, *args)
    finally:
        numba.set_num_threads(previous)


@functools.lru_cache(maxsize=512)
def _plan(m: int, k: int, n: int, threads: int, on_the_fly: bool, kc: int = 0) -> tuple:
    """(chunks, blocks, workspace floats) of one GeMM shape. A forward repeats a few shapes,
    and inside one the interpreter's own data is cold (the GeMMs have just streamed megabytes
    of weights through the caches): working these out on every call cost 1-5 of the 12-25 us
    of Python per GeMM call in a MiniLM layer. kc: the k-block's depth (0: KC on the fly,
    else equal blocks of at most KC_PACKED)."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    n_panels = -(-n // NR)
    n_chunks = max(1, min(threads, numba.config.NUMBA_NUM_THREADS, n_panels))
    mc = min(row_block(m, k, config.GEMM_A_BLOCK_BYTES), m)
    buf_rows = min(k, config.KC)  # rows of B packed at a time on the fly: one k-block
    group = min(otf_group(buf_rows), -(-n_panels // n_chunks)) if on_the_fly else 1
    # pre-packed: k in equal blocks of at most KC_PACKED (config.py says why)
    if not kc:
        kc = config.KC if on_the_fly else -(-k // max(1, -(-k // config.KC_PACKED)))
    blocks = (mc, max(kc, 1), group, config.PREFETCH_ROWS)
    return n_chunks, blocks, workspace_size(n_chunks, mc, k, group if on_the_fly else 0, buf_rows)


def gemm(a: np.ndarray, pb: PackedB, bias: np.ndarray | None = None, gelu: bool = False,
         residual: np.ndarray | None = None, out: np.ndarray | None = None,
         threads: int = 1) -> np.ndarray:
    """c = a @ B (+ bias [N]) (then GeLU) (+ residual [M, N]) with B pre-packed by `pack_b`.

    a: float32 [M, K] with contiguous rows (may be a row slice or a column block of a bigger
    array). out: optional float32 [M, N] with contiguous rows (may be a column block of a bigger
    buffer); it must not overlap a or residual. threads > 1 splits the panels over that many
    Numba threads; threads == 1 runs on the calling thread (which releases the GIL).
    """
    if not isinstance(pb, PackedB):
        raise TypeError(f"pb must be a PackedB from pack_b(), got {type(pb).__name__}")
    check_float32(a, "a", 2)
    if a.shape[1] != pb.k:
        raise ValueError(f"a has {a.shape[1]} columns but the packed B has K={pb.k} rows")
    return _run(a, pb.k, pb.n, pb.panels, EMPTY, 1, bias, gelu, residual, out, threads)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _ffn_serial(x, up, up_bias, h, down, out, blocks, ws, down_bias, tail):
    """out [m, n] = GeLU(x [m, k] @ up + up_bias) @ down (+ down_bias) (+ residual, then
    LayerNorm), both GeMMs in one call, h [m, f] between them (all three C-contiguous; a bias
    empty when absent); blocks = (up's, down's); tail = (residual [m, n], gamma, beta, eps,
    has_res, has_ln). Few arguments: inside a forward each costs the call ~1 us, cold."""
    m, k = x.shape
    f, n = h.shape[1], out.shape[1]
    none = np.empty(0, np.float32)
    z, one, yes, no = np.int64(0), np.int64(1), np.bool_(True), np.bool_(False)  # no literals
    up_epi = (up_bias, up_bias.shape[0] > 0, yes, none, z, one, no)
    # the up projection's last panel prefetches the down projection's first
    _gemm_serial(x.reshape(-1), z, k, m, k, f, up, none, z, one, h.reshape(-1), z, f, blocks[0],
                 up_epi, ws, down.reshape(-1), f * NR)
    res, gamma, beta, eps, has_res, has_ln = tail
    down_epi = (down_bias, down_bias.shape[0] > 0, no, res.reshape(-1), z, n, has_res)
    _gemm_serial(h.reshape(-1), z, f, m, f, n, down, none, z, one, out.reshape(-1), z, n,
                 blocks[1], down_epi, ws, none, z)
    if has_ln:
        layernorm_inplace(out, gamma, beta, eps)


def ffn(x: np.ndarray, up: PackedB, up_bias: np.ndarray, down: PackedB,
        threads: int = 1, out: np.ndarray | None = None,
        hidden: np.ndarray | None = None, down_bias: np.ndarray | None = None,
        residual: np.ndarray | None = None, ln: tuple | None = None) -> np.ndarray:
    """GeLU(x @ up + up_bias) @ down for float32 x [M, K]: BERT's MLP, without its output bias
    unless down_bias is given, (+ residual [M, N]) (then LayerNorm with ln = (gamma, beta,
    eps): BERT's add+ln after it). out: optional float32 [M, N] with contiguous rows, as for
    gemm(); hidden: optional contiguous float32 [M, F] for GeLU(x @ up + up_bias), the tensor
    between the two GeMMs (the caller's, so that it can count it as the activation it is).

    The same arithmetic as gemm(gemm(x, up, up_bias, gelu=True), down), in one call on one
    thread: a forward makes six of these per rank, and each kernel call's Python runs with
    the interpreter's data pushed out of the caches by the GeMMs around it (~15 us a call in
    a MiniLM layer). threads > 1 runs the two gemm() calls.
    """
    if not isinstance(up, PackedB) or not isinstance(down, PackedB):
        raise TypeError("up and down must be PackedB from pack_b()")
    check_float32(x, "x", 2)
    if x.shape[1] != up.k or up.n != down.k:
        raise ValueError(f"cannot chain x {x.shape} -> up [K={up.k}, N={up.n}] -> down "
                         f"[K={down.k}, N={down.n}]")
    if (int(threads) != 1 or not x.flags.c_contiguous or x.shape[0] == 0
            or (out is not None and not out.flags.c_contiguous)
            or (hidden is not None and not hidden.flags.c_contiguous)):
        y = gemm(gemm(x, up, bias=up_bias, gelu=True, threads=threads, out=hidden), down,
                 bias=down_bias, residual=residual, out=out, threads=threads)
        return y if ln is None else layernorm(y, ln[0], ln[1], ln[2], out=y)
    m, k, f, n = x.shape[0], up.k, up.n, down.n
    tail = ln_tail(residual, ln, m, n)
    _, up_blocks, up_ws = _plan(m, k, f, 1, False)
    _, down_blocks, down_ws = _plan(m, f, n, 1, False)
    h = output(hidden, (m, f), "hidden")
    if out is None:  # a new array: nothing to overlap
        out = np.empty((m, n), np.float32)
    else:
        out = output(out, (m, n))
        check_no_overlap(out, x, "x")
        check_no_overlap(out, residual, "residual")
    _ffn_serial(x, up.panels, vector(up_bias, "up_bias", f), h, down.panels, out,
                (up_blocks, down_blocks), workspace(max(up_ws, down_ws)),
                vector(down_bias, "down_bias", n), tail)
    return out


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None,
           threads: int = 1) -> np.ndarray:
    """a @ b for float32 a [M, K] and b [K, N] (rows contiguous), packing b on the fly (a
    single row of a on one thread streams b directly instead: `_gemv`)."""
    check_float32(a, "a", 2)
    check_float32(b, "b", 2)
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"cannot multiply a {a.shape} by b {b.shape}: inner sizes differ")
    k, n = b.shape
    b_flat, ldb = flat_rows(b, "b")
    if a.shape[0] == 1 and int(threads) == 1 and k > 0 and n > 0:
        c = output(out, (1, n))
        check_no_overlap(c, a, "a")
        c_flat, _ = flat_rows(c, "out")
        _gemv(flat_rows(a, "a")[0], 0, k, n, b_flat, 0, ldb, c_flat, 0)
        return c
    return _run(a, k, n, _PANELS_NONE, b_flat, ldb, None, False, None, out, threads)
