"""int8 weights with one float32 scale per group: quantisation, packing, GeMM and GeMV.

Storage form (`QuantMatrix`): a matrix stored [R, C] (as hepti.weights.layout stores it) is
int8 q [R, C] plus float32 scales [R, ceil(C / G)]; w[r, c] ~= q[r, c] * scales[r, c // G].
Groups run along axis 1, the axis a rank never slices (ranks read row ranges): so a row slice
keeps whole groups, whatever the uneven shares. For the column-split projections (stored
[N, K]) that is along K, as llama.cpp's Q8_0 does; for the block-split ones (stored [K, N],
ranks slice K) it is along N: groups along K there would be cut by a share boundary.

Quantisation is symmetric, round to nearest: scale = max|w| over the group / 127, q =
rint(w / scale) in [-127, 127] (a group of zeros has scale 0). When C is not a multiple of G
the last group is shorter: it is quantised over its own values, as if padded with zeros (a
zero never raises the max), and nothing is stored for the padding. Each weight's error is at
most scale / 2.

G = 64 (`GROUP`): one group of int8 weights is one 64-byte cache line; the scales add 1/16 to
the weight bytes (G = 32 would add 1/8, and GeMV is bound by bytes read); the error of a
product stays well under 1% (about 0.6% relative for Gaussian weights); it divides every K and
N of MiniLM, BERT, ViT and SmolLM2 (384, 576, 768, 1536, 3072). G must be a power of two and a
multiple of NR (32), so that a packed panel row of a [K, N]-stored matrix has one scale.

Packed form (`QuantB`, by `pack_q`): like `PackedB`, NR-wide column panels of B [K, N], int8
[n_panels, K, NR], with scales [n_panels, S, W]: per k-group and column (S = ceil(K / G),
W = NR) when the groups run along K, per k row (S = K, W = 1) when they run along N.

Kernels (the float32 GeMM's blocking, micro-kernels and epilogue, packed_gemm.py):
- GeMM (M >= 2): for each A block and panel, each KC x NR slice of the panel is dequantised
  into an L1-sized float32 buffer, then every MR-row tile of A runs over it with the float32
  micro-kernel. No whole matrix is ever widened; the dequantisation costs K x NR per panel per
  A block, small next to the M x K x NR multiply-adds when M is large.
- GeMV (M = 1): streams the int8 panels once, accumulates x[p] * q[p, :] per group and scales
  the group's sum (groups along K), or folds the row's scale into x[p] (groups along N).
`gemm_any` / `ffn_any` take a PackedB or a QuantB, so callers (the interpreter, a decoder) need
not know which a folder holds.

For a decoder: at load, `pack_weight(store.read(name, rows), trans=...)` packs whatever the
folder holds (a QuantMatrix from an int8 folder, float32 otherwise), or
`pack_q(quantize(w), trans=...)` quantises float32 weights (say, dequantised GGUF) on the fly;
then `gemm_any(x, w, residual=...)` runs the GeMV for one decode row and the GeMM for a prefill.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit, prange

from hepti.kernels._microkernels import NR
from hepti.kernels._views import aligned_empty, check_float32, workspace
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.packed_gemm import (PackedB, _carve, _epilogue, _finish, _kblock, _pack_a,
                                       _plan, _shift_epi, ffn, gemm, operands, pack_b,
                                       run_chunks, workspace_size)

GROUP = 64  # values per scale along the stored rows (see the module docstring for why)
QMAX = 127  # symmetric: -127 .. 127 (-128 unused, so that -q is always representable)


@dataclass
class QuantMatrix:
    """A stored matrix [R, C] in int8: q [R, C], scales float32 [R, ceil(C / group)]."""

    q: np.ndarray
    scales: np.ndarray
    group: int

    def __post_init__(self):
        check_group(self.group)
        if self.q.dtype != np.int8 or self.q.ndim != 2:
            raise TypeError(f"q must be a 2-D int8 array, got {self.q.dtype}{list(self.q.shape)}")
        want = (self.q.shape[0], n_groups(self.q.shape[1], self.group))
        if self.scales.dtype != np.float32 or self.scales.shape != want:
            raise ValueError(f"scales must be float32{list(want)} for q {list(self.q.shape)} "
                             f"in groups of {self.group}, got "
                             f"{self.scales.dtype}{list(self.scales.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def dequantize(self) -> np.ndarray:
        """The float32 [R, C] the int8 values stand for (tests and references only: the kernels
        never widen a whole matrix)."""
        return dequantize(self.q, self.scales, self.group)

    @staticmethod
    def concat(mats: list["QuantMatrix"]) -> "QuantMatrix":
        """Row-wise concatenation (Q, K and V side by side along N, as one GeMM)."""
        if len(mats) == 1:
            return mats[0]
        if len({m.group for m in mats}) != 1:
            raise ValueError("cannot join int8 matrices quantised in different group sizes")
        return QuantMatrix(np.concatenate([m.q for m in mats]),
                           np.concatenate([m.scales for m in mats]), mats[0].group)


def check_group(group: int) -> None:
    """Raise unless `group` is a power of two and a multiple of NR (32, 64, 128, ...)."""
    if not isinstance(group, (int, np.integer)) or group < NR or group & (group - 1):
        raise ValueError(f"the int8 group size must be a power of two >= {NR}, got {group!r}")


def n_groups(c: int, group: int) -> int:
    """Scales per row of C values: the last group may be shorter."""
    return -(-int(c) // int(group))


def quantize(w: np.ndarray, group: int = GROUP) -> QuantMatrix:
    """Symmetric per-group int8 of a float32 [R, C], groups of `group` along axis 1, rounded to
    nearest; the last group of an odd C is quantised over its own values (zero-padded)."""
    check_float32(w, "w", 2)
    check_group(group)
    r, c = w.shape
    g = n_groups(c, group)
    padded = np.zeros((r, g * group), np.float32)
    padded[:, :c] = w
    blocks = padded.reshape(r, g, group)
    scales = (np.abs(blocks).max(axis=2) / np.float32(QMAX)).astype(np.float32)
    safe = np.where(scales > 0, scales, np.float32(1))
    q = np.clip(np.rint(blocks / safe[:, :, None]), -QMAX, QMAX).astype(np.int8)
    return QuantMatrix(np.ascontiguousarray(q.reshape(r, g * group)[:, :c]), scales, int(group))


def dequantize(q: np.ndarray, scales: np.ndarray, group: int) -> np.ndarray:
    """float32 [R, C] = q * the scale of each value's group."""
    return (q.astype(np.float32) * np.repeat(scales, group, axis=1)[:, :q.shape[1]]).astype(
        np.float32)


class QuantB:
    """B [K, N] packed for `gemm_q`: int8 panels [n_panels, K, NR] and their scales.

    scales [n_panels, S, W]: per_col (groups along K): S = ceil(K / group), W = NR, and
    B[p, jp*NR + j] ~= q[jp, p, j] * scales[jp, p // group, j]; otherwise (groups along N)
    S = K, W = 1 and the scale is scales[jp, p, 0].
    """

    __slots__ = ("q", "scales", "k", "n", "group", "per_col")

    def __init__(self, q: np.ndarray, scales: np.ndarray, n: int, group: int, per_col: bool):
        self.q, self.scales, self.n, self.group, self.per_col = q, scales, n, group, per_col
        self.k = q.shape[1]

    @property
    def k_group(self) -> int:
        """k rows that share a scale in the packed panels (1 when the groups run along N)."""
        return self.group if self.per_col else 1

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scales.nbytes

    def __repr__(self) -> str:
        return f"QuantB(k={self.k}, n={self.n}, group={self.group}, nbytes={self.nbytes})"


def pack_q(m: QuantMatrix, trans: bool = False) -> QuantB:
    """Pack an int8 weight for `gemm_q`: m is B [K, N] (groups along N), or with trans=True
    its transpose [N, K] (groups along K: PyTorch's [out, in] Linear weights)."""
    if not isinstance(m, QuantMatrix):
        raise TypeError(f"pack_q takes a QuantMatrix (quantize()), got {type(m).__name__}")
    q, s, g = m.q, m.scales, m.group
    n, k = q.shape if trans else q.shape[::-1]
    n_panels = -(-n // NR)
    panels = np.zeros((n_panels, k, NR), np.int8)
    if trans:  # q [N, K] -> panels[jp, p, j] = q[jp*NR + j, p]; scales likewise per column
        qp = np.zeros((n_panels * NR, k), np.int8)
        qp[:n] = q
        panels[:] = qp.reshape(n_panels, NR, k).transpose(0, 2, 1)
        sp = np.zeros((n_panels * NR, s.shape[1]), np.float32)
        sp[:n] = s
        scales = aligned_empty((n_panels, s.shape[1], NR))
        scales[:] = sp.reshape(n_panels, NR, s.shape[1]).transpose(0, 2, 1)
    else:  # q [K, N] -> panels[jp, p, j] = q[p, jp*NR + j]; one scale per (panel, k row)
        qp = np.zeros((k, n_panels * NR), np.int8)
        qp[:, :n] = q
        panels[:] = qp.reshape(k, n_panels, NR).transpose(1, 0, 2)
        scales = aligned_empty((n_panels, k, 1))
        scales[:, :, 0] = s[:, np.arange(n_panels) * NR // g].T
    return QuantB(panels, scales, n, g, bool(trans))


# ------------------------------------------------------------------------------------------
# @njit kernels: arithmetic only
# ------------------------------------------------------------------------------------------


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _dequant(qp, sc, per_col, gk, k0, kc, buf):
    """buf[0:kc] = rows k0 .. k0+kc-1 of one int8 panel qp [K, NR] times their scales sc.

    The loops over a row run to nr = qp.shape[1] (NR, but read at run time): with the constant
    NR, LLVM unrolls them fully before vectorising and converts the int8 values one by one
    (scalar vcvtsi2ss, measured 3x slower); a run-time bound gets the vector loop
    (vpmovsxbd + vcvtdq2ps)."""
    nr = qp.shape[1]
    for p in range(kc):
        qr = qp[k0 + p]
        br = buf[p]
        if per_col:
            sr = sc[(k0 + p) // gk]
            for j in range(nr):
                br[j] = np.float32(qr[j]) * sr[j]
        else:
            s = sc[k0 + p, 0]
            for j in range(nr):
                br[j] = np.float32(qr[j]) * s


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _q_panels(p_lo, p_hi, apack, rows, k, n, qpanels, scales, per_col, gk, kc_max, buf, c,
              c_off, ldc, scratch, epi):
    """C[0:rows, panels p_lo .. p_hi-1] = epilogue(packed A block @ B), each KC x NR slice
    of an int8 panel dequantised into buf [KC, NR] (L1) right before the row tiles use it."""
    n_kblocks = max(1, -(-k // kc_max))
    for jp in range(p_lo, p_hi):
        j0 = jp * NR
        ncols = min(NR, n - j0)
        if ncols == NR:
            dst, d_off, ldd = c, c_off + j0, ldc
        else:
            dst, d_off, ldd = scratch, 0, NR
        for kb in range(n_kblocks):
            k0 = kb * kc_max
            kc = min(kc_max, k - k0)
            _dequant(qpanels[jp], scales[jp], per_col, gk, k0, kc, buf)
            _kblock(apack, rows, k0, kc, buf, 0, dst, d_off, ldd, kb > 0, scratch, 0, 0)
        _finish(rows, c, c_off, ldc, j0, ncols, scratch, epi)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _qgemm_serial(a, lda, m, k, n, qpanels, scales, per_col, gk, c, ldc, blocks, epi, ws):
    """int8 GeMM on the calling thread: row blocks of A, each packed, times every panel."""
    mc, kc_max = blocks[0], blocks[1]
    buf_rows = min(k, kc_max)
    apack, bufs, scratches = _carve(ws, 1, mc, k, 1, buf_rows)
    buf = bufs[0, :buf_rows * NR].reshape((buf_rows, NR))
    for m0 in range(0, m, mc):
        m1 = min(m, m0 + mc)
        _pack_a(a, 0, lda, m0, m1, k, apack)
        _q_panels(0, qpanels.shape[0], apack, m1 - m0, k, n, qpanels, scales, per_col, gk,
                  kc_max, buf, c, m0 * ldc, ldc, scratches[0], _shift_epi(epi, m0, 0))


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _qgemm_parallel(n_chunks, a, lda, m, k, n, qpanels, scales, per_col, gk, c, ldc, blocks,
                    epi, ws):
    """int8 GeMM with the panels split into n_chunks contiguous ranges, one per thread."""
    mc, kc_max = blocks[0], blocks[1]
    buf_rows = min(k, kc_max)
    n_panels = qpanels.shape[0]
    apack, bufs, scratches = _carve(ws, n_chunks, mc, k, 1, buf_rows)
    for m0 in range(0, m, mc):
        m1 = min(m, m0 + mc)
        _pack_a(a, 0, lda, m0, m1, k, apack)
        for chunk in prange(n_chunks):
            buf = bufs[chunk, :buf_rows * NR].reshape((buf_rows, NR))
            _q_panels(chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks, apack,
                      m1 - m0, k, n, qpanels, scales, per_col, gk, kc_max, buf, c, m0 * ldc,
                      ldc, scratches[chunk], _shift_epi(epi, m0, 0))


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _rows_into(acc, x, qp, p0, p1, sc, row_scaled):
    """acc[:] += sum over p in [p0, p1) of x[p] (* sc[p, 0] if row_scaled) * qp[p, :], four
    rows per pass over acc (a quarter of its loads and stores, as packed_gemm._gemv)."""
    nr = acc.shape[0]
    p = p0
    while p + 4 <= p1:
        x0, x1, x2, x3 = x[p], x[p + 1], x[p + 2], x[p + 3]
        if row_scaled:
            x0, x1, x2, x3 = x0 * sc[p, 0], x1 * sc[p + 1, 0], x2 * sc[p + 2, 0], x3 * sc[p + 3, 0]
        r0, r1, r2, r3 = qp[p], qp[p + 1], qp[p + 2], qp[p + 3]
        for j in range(nr):
            acc[j] += ((x0 * np.float32(r0[j]) + x1 * np.float32(r1[j]))
                       + (x2 * np.float32(r2[j]) + x3 * np.float32(r3[j])))
        p += 4
    while p < p1:
        x0 = x[p] * sc[p, 0] if row_scaled else x[p]
        r0 = qp[p]
        for j in range(nr):
            acc[j] += x0 * np.float32(r0[j])
        p += 1


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _qgemv_panels(p_lo, p_hi, x, k, n, qpanels, scales, per_col, gk, c):
    """c[panels p_lo .. p_hi-1] = x [k] @ B, reading each int8 panel once, in order.

    Groups along K: the products of a group are summed unscaled, then the sum is scaled (one
    multiply per group and column); groups along N: x[p] * its row's scale is the multiplier.
    Row loops run to a run-time nr, as in `_dequant`, so that they vectorise.
    """
    nr = qpanels.shape[2]
    acc = np.empty(nr, np.float32)
    part = np.empty(nr, np.float32)
    for jp in range(p_lo, p_hi):
        qp = qpanels[jp]
        sc = scales[jp]
        for j in range(nr):
            acc[j] = 0.0
        if per_col:
            for g0 in range(0, k, gk):
                for j in range(nr):
                    part[j] = 0.0
                _rows_into(part, x, qp, g0, min(k, g0 + gk), sc, False)
                sr = sc[g0 // gk]
                for j in range(nr):
                    acc[j] += part[j] * sr[j]
        else:
            _rows_into(acc, x, qp, 0, k, sc, True)
        j0 = jp * NR
        cr = c[j0:min(n, j0 + NR)]
        for j in range(cr.shape[0]):
            cr[j] = acc[j]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _qgemv_serial(x, k, n, qpanels, scales, per_col, gk, c, epi):
    _qgemv_panels(0, qpanels.shape[0], x, k, n, qpanels, scales, per_col, gk, c)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _qgemv_parallel(n_chunks, x, k, n, qpanels, scales, per_col, gk, c, epi):
    n_panels = qpanels.shape[0]
    for chunk in prange(n_chunks):
        _qgemv_panels(chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks, x, k, n,
                      qpanels, scales, per_col, gk, c)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


def gemm_q(a: np.ndarray, qb: QuantB, bias: np.ndarray | None = None, gelu: bool = False,
           residual: np.ndarray | None = None, out: np.ndarray | None = None,
           threads: int = 1) -> np.ndarray:
    """c = a @ B (+ bias [N]) (then GeLU) (+ residual [M, N]) with B int8 (`pack_q`); the
    same arguments and epilogue as packed_gemm.gemm. One row of a (M = 1) runs the GeMV."""
    if not isinstance(qb, QuantB):
        raise TypeError(f"qb must be a QuantB from pack_q(), got {type(qb).__name__}")
    check_float32(a, "a", 2)
    if a.shape[1] != qb.k:
        raise ValueError(f"a has {a.shape[1]} columns but the int8 B has K={qb.k} rows")
    m, k, n = a.shape[0], qb.k, qb.n
    c, a_flat, lda, c_flat, ldc, epi = operands(a, k, n, bias, gelu, residual, out)
    if m == 0 or n == 0:
        return c
    n_chunks, blocks, _ = _plan(m, k, n, int(threads), False)
    common = (k, n, qb.q, qb.scales, qb.per_col, qb.k_group)
    if m == 1:  # a_flat and c_flat start at the row: k and n values of it
        run_chunks(n_chunks, _qgemv_serial, _qgemv_parallel, (a_flat, *common, c_flat, epi))
        return c
    ws = workspace(workspace_size(n_chunks, blocks[0], k, 1, min(k, blocks[1])))
    run_chunks(n_chunks, _qgemm_serial, _qgemm_parallel,
               (a_flat, lda, m, *common, c_flat, ldc, blocks, epi, ws))
    return c


def gemm_any(a: np.ndarray, w, bias=None, gelu: bool = False, residual=None, out=None,
             threads: int = 1) -> np.ndarray:
    """`gemm` for a float32 PackedB, `gemm_q` for an int8 QuantB (a layer holds either)."""
    if isinstance(w, QuantB):
        return gemm_q(a, w, bias=bias, gelu=gelu, residual=residual, out=out, threads=threads)
    return gemm(a, w, bias=bias, gelu=gelu, residual=residual, out=out, threads=threads)


def ffn_any(x: np.ndarray, up, up_bias, down, threads: int = 1, out=None,
            hidden=None) -> np.ndarray:
    """GeLU(x @ up + up_bias) @ down (packed_gemm.ffn) for float32 or int8 weights."""
    if isinstance(up, PackedB) and isinstance(down, PackedB):
        return ffn(x, up, up_bias, down, threads=threads, out=out, hidden=hidden)
    h = gemm_any(x, up, bias=up_bias, gelu=True, out=hidden, threads=threads)
    return gemm_any(h, down, out=out, threads=threads)


def columns_any(w, idx) -> np.ndarray:
    """Columns `idx` of a packed B [K, N] (PackedB or QuantB) as float32 rows [len(idx), K]:
    B[:, idx].T, widened from int8 where B is int8.

    A tied LM head is the embedding packed (B = emb.T), so its column v is the embedding of
    token v: the lookup reads it from the head's panels and the model keeps no second copy of
    its largest matrix (llama-1b: 262 MB in float32)."""
    idx = np.asarray(idx, np.int64).reshape(-1)
    if idx.size and (idx.min() < 0 or idx.max() >= w.n):
        raise IndexError(f"columns {int(idx.min())}..{int(idx.max())} of a B with {w.n}")
    jp, j = idx // NR, idx % NR
    if isinstance(w, PackedB):
        return np.ascontiguousarray(w.panels[jp, :, j])
    rows = w.q[jp, :, j].astype(np.float32)  # [n, K]
    if w.per_col:  # a scale per group of k rows and column
        return rows * np.repeat(w.scales[jp, :, j], w.group, axis=1)[:, :w.k]
    return rows * w.scales[jp, :, 0]  # a scale per k row (the same for every column of a panel)


def pack_weight(m, trans: bool = False):
    """`pack_b` for a float32 array, `pack_q` for a QuantMatrix: what a stored weight needs."""
    if isinstance(m, QuantMatrix):
        return pack_q(m, trans=trans)
    return pack_b(m, trans=trans)
