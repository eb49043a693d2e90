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

Packed form (`QuantB`, by `pack_q`): NR-wide column panels of B [K, N], k-interleaved: int8
[n_panels, ceil(K / 4), NR, 4], the 4 bytes of an int32 lane being 4 consecutive k of one
column (the operand layout of the integer dot products; K padded with zeros to a multiple of
4). One copy of the weights serves every kernel. Scales [n_panels, S, W]: per k-group and
column (S = ceil(K / G), W = NR) when the groups run along K, per k row (S = K, W = 1) when
they run along N.

Kernels (the float32 GeMM's blocking, micro-kernels and epilogue, packed_gemm.py):
- GeMM (M >= 2): for each A block and panel, each KC x NR slice of the panel is dequantised
  into an L1-sized float32 buffer, then every MR-row tile of A runs over it with the float32
  micro-kernel. No whole matrix is ever widened; the dequantisation costs K x NR per panel per
  A block, small next to the M x K x NR multiply-adds when M is large.
- GeMV (M = 1), integer (`config.INT_DOT`: AVX-512 VNNI or AVX2, chosen in Python at each
  call): the activation row is rounded to int16 per block of k (one float scale a block, as
  Q8_0 rounds its activations, but int16: a step of 2**-15 of the block's largest value, so
  that one of a decoder's massive activations (50-800x the RMS at down's input) does not
  leave the rest of its block a few int8 steps),
  each panel's int8 weights are sign-extended to int16 and multiplied in pairs into int32
  sums (vpdpwssd / vpmaddwd, _vnni.py), and the sums are scaled once per block and column.
  Groups along K: x is rounded once a call, per weight group; groups along N (o, down): the
  row's scale is folded into x (x[k] * scale[k, panel's group]) and that is rounded per
  XQ_BLOCK of k, once per group of columns, so the integer sum over k meets a constant scale
  (a rank's K slice rounds in blocks from its own first row, so a split decode differs from
  one rank's by that rounding). Against the widening float GeMV it replaced (13 G weights/s
  on one quiet core, compute-bound), interleaved on a loaded machine: 2-5x on SmolLM2's and
  llama-1b's shapes with groups along K, about 2x along N (rounding x times the scales for
  each panel costs about as much as its sums). Float path (INT_DOT = 0, any CPU):
  the widened weights times x, as before.
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

from hepti.kernels import config
from hepti.kernels._microkernels import NR
from hepti.kernels._intrinsics import max_f32
from hepti.kernels._vnni import dequant_quad, isa_tag, isum_i16
from hepti.kernels._views import aligned_empty, check_float32, workspace
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.packed_gemm import (PackedB, _carve, _epilogue, _finish, _kblock, _pack_a,
                                       _plan, _shift_epi, ffn, gemm, operands, pack_b,
                                       run_chunks, workspace_size)

GROUP = 64  # values per scale along the stored rows (see the module docstring for why)
QMAX = 127  # symmetric: -127 .. 127 (-128 unused, so that -q is always representable)
XQMAX = 32767  # the integer GeMV's int16 activations: -32767 .. 32767
XQ_BLOCK = 64  # k per activation scale where the weights' groups run along N (row-scaled)
# The activation quantiser may reassociate its max (so that it vectorises): the max is the same
# in any order; activations are finite.
FASTMATH_QUANT = {"nnan", "ninf", "nsz", "arcp", "contract", "afn", "reassoc"}
XQ_GROUP_MAX = 256  # longest int32 sum of int16 x int8 products that cannot overflow (< 516)
HOST_INT_DOT = config.host_int_dot()
_TAGS = [isa_tag(level) for level in range(len(config.INT_DOT_NAMES))]
# the tag of the kernel to run for each setting of config.INT_DOT, capped at the CPU's
_RUN_TAGS = [_TAGS[min(level, HOST_INT_DOT)] for level in range(len(config.INT_DOT_NAMES))]


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
    """B [K, N] packed for `gemm_q`: int8 panels [n_panels, ceil(K / 4), NR, 4] and their scales.

    k-interleaved: q[jp, p // 4, j, p % 4] is B's int8 value at row p, column jp*NR + j, so the
    4 bytes of an int32 lane are 4 consecutive k of one column, the operand layout of the
    integer dot products (_vnni.py); rows past K are zero. scales [n_panels, S, W]: per_col
    (groups along K): S = ceil(K / group), W = NR, and B[p, jp*NR + j] ~= q[...] *
    scales[jp, p // group, j]; otherwise (groups along N) S = K, W = 1 and the scale is
    scales[jp, p, 0].
    """

    __slots__ = ("q", "q32", "scales", "k", "n", "group", "per_col")

    def __init__(self, q: np.ndarray, scales: np.ndarray, k: int, n: int, group: int,
                 per_col: bool):
        self.q, self.scales, self.k, self.n = q, scales, k, n
        self.group, self.per_col = group, per_col
        # the same bytes as int32 [n_panels, K/4, NR]: one lane per column and quad of k (what
        # the kernels take; made once, as a view costs microseconds a call)
        self.q32 = q.view(np.int32).reshape(q.shape[:3])

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
    n_panels, kq = -(-n // NR), -(-k // 4)
    # One panel at a time, [p, j] (k padded to quads) -> [p // 4, j, p % 4]: a rank loading its
    # shard holds the stored matrix and its packed copy, never a third whole-matrix temporary
    # (the decoder's memory plan counts the two: hepti.plan.workloads.with_overhead).
    panels = np.empty((n_panels, kq, NR, 4), np.int8)
    by_row = np.empty((kq * 4, NR), np.int8)
    for jp in range(n_panels):
        by_row[:] = 0
        if trans:  # q [N, K]: panels[jp, p, j] = q[jp*NR + j, p]
            cols = q[jp * NR:(jp + 1) * NR]
            by_row[:k, :cols.shape[0]] = cols.T
        else:  # q [K, N]: panels[jp, p, j] = q[p, jp*NR + j]
            cols = q[:, jp * NR:(jp + 1) * NR]
            by_row[:k, :cols.shape[1]] = cols
        panels[jp] = by_row.reshape(kq, 4, NR).transpose(0, 2, 1)
    if trans:  # a scale per group of k and column
        sp = np.zeros((n_panels * NR, s.shape[1]), np.float32)
        sp[:n] = s
        scales = aligned_empty((n_panels, s.shape[1], NR))
        scales[:] = sp.reshape(n_panels, NR, s.shape[1]).transpose(0, 2, 1)
    else:  # one scale per (panel, k row)
        scales = aligned_empty((n_panels, k, 1))
        scales[:, :, 0] = s[:, np.arange(n_panels) * NR // g].T
    return QuantB(panels, scales, k, n, g, bool(trans))


# ------------------------------------------------------------------------------------------
# @njit kernels: arithmetic only
# ------------------------------------------------------------------------------------------


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _dequant(qp, sc, per_col, gk, k0, kc, buf):
    """buf[0:kc] = rows k0 .. k0+kc-1 (k0 a multiple of 4) of one int8 panel times their
    scales sc. qp is the panel as int32 [K/4, NR]: byte t of qp[q, j] is row 4q + t of column j.
    Whole quads go through `_vnni.dequant_quad` (one byte shuffle a row, plain LLVM IR): the
    GeMM at a 30-row prefill measured 1.0-1.17x the old row-major panels' (interleaved),
    where taking the bytes out with Numba's shifts cost 0.95x. The last rows of K not a multiple
    of 4 (and any NR other than 32) take the shifts.

    The loops over a row run to nr = qp.shape[1] (NR, but read at run time): with the constant
    NR, LLVM unrolls them fully before vectorising and converts the int8 values one by one
    (scalar vcvtsi2ss, measured 3x slower); a run-time bound gets the vector loop."""
    nr = qp.shape[1]
    p = 0
    if nr == NR and buf.shape[1] == NR:  # whole quads by the shuffle intrinsic
        bflat = buf.reshape(-1)
        qflat = qp.reshape(-1)
        sflat = sc.reshape(-1)
        while p + 4 <= kc:
            kk = k0 + p
            dequant_quad(bflat, p * NR, qflat, (kk >> 2) * NR, sflat,
                         (kk // gk) * NR if per_col else kk, per_col)
            p += 4
    while p < kc:
        kk = k0 + p
        r = qp[kk >> 2]
        shift = 8 * (kk & 3)
        br = buf[p]
        if per_col:
            sr = sc[kk // gk]
            for j in range(nr):
                br[j] = np.float32(np.int8(r[j] >> shift)) * sr[j]
        else:
            s = sc[kk, 0]
            for j in range(nr):
                br[j] = np.float32(np.int8(r[j] >> shift)) * s
        p += 1


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
def _quads_into(acc, v, qp, q0, q1):
    """acc[:] += sum over quads q in [q0, q1) and t < 4 of v[4q + t] * (byte t of qp[q, :])
    (float; qp the panel as int32 [K/4, NR], as in `_dequant`)."""
    nr = acc.shape[0]
    for qd in range(q0, q1):
        x0, x1, x2, x3 = v[4 * qd], v[4 * qd + 1], v[4 * qd + 2], v[4 * qd + 3]
        r = qp[qd]
        for j in range(nr):
            w = r[j]
            acc[j] += ((x0 * np.float32(np.int8(w)) + x1 * np.float32(np.int8(w >> 8)))
                       + (x2 * np.float32(np.int8(w >> 16)) + x3 * np.float32(np.int8(w >> 24))))


@njit(fastmath=FASTMATH_QUANT, **JIT)
def _round16(y):
    """y (|y| <= 32767 up to rounding) to the nearest int16, halves away from zero."""
    y = min(max(y + (np.float32(0.5) if y >= 0 else np.float32(-0.5)), np.float32(-32767.5)),
            np.float32(32767.5))
    return np.int16(np.int32(y))


@njit(fastmath=FASTMATH_QUANT, **JIT)
def _quantize16(v, s, k, blk, xq, sx):
    """xq[p] = round(v[p] * s[p] / sx[b]) as int16, sx[b] = max |v * s| over block b of `blk`
    values / 32767 (0 for zeros), p < k; xq is zero from k to its own length (whole quads).
    s is the weights' row scale folded into v, or empty for none. Blocks of blk = XQ_BLOCK
    run loops of that constant trip count, which LLVM vectorises whole (a run-time bound
    measured 10x slower)."""
    scaled = s.shape[0] > 0
    for b in range(sx.shape[0]):
        p0 = b * blk
        n = min(k, p0 + blk) - p0
        m = np.float32(0.0)
        if n == XQ_BLOCK:
            for i in range(XQ_BLOCK):
                m = max_f32(m, abs(v[p0 + i] * s[p0 + i] if scaled else v[p0 + i]))
            inv = np.float32(XQMAX) / m if m > 0 else np.float32(0.0)
            for i in range(XQ_BLOCK):
                xq[p0 + i] = _round16((v[p0 + i] * s[p0 + i] if scaled else v[p0 + i]) * inv)
        else:
            for i in range(n):
                m = max_f32(m, abs(v[p0 + i] * s[p0 + i] if scaled else v[p0 + i]))
            inv = np.float32(XQMAX) / m if m > 0 else np.float32(0.0)
            for i in range(n):
                xq[p0 + i] = _round16((v[p0 + i] * s[p0 + i] if scaled else v[p0 + i]) * inv)
        sx[b] = m / np.float32(XQMAX)
    for p in range(k, xq.shape[0]):
        xq[p] = 0


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _qgemv_panels(p_lo, p_hi, x, k, n, qpanels, scales, per_col, gk, c, tag, xq, sx):
    """c[panels p_lo .. p_hi-1] = x [k] @ B, reading each int8 panel once, in order.

    gk is the weights' group. Integer kernels (tag.ndim > 1, _vnni.isum_i16): x is rounded to
    int16 per block of k (xq, sx). Groups along K: once by the caller, a block per group;
    int32 sums per group and column, then acc[j] += sx[g] * scale[g, j] * isum[j]. Groups
    along N: the row's scale is folded into x (x * scale[:, panel]) and that is rounded per
    XQ_BLOCK of k, once per group of gk columns (a panel, or two for groups of 64), so the sums
    need only sx. The float path (tag.ndim == 1) multiplies by the widened int8 weights,
    scaling a group's sums (along K) or folding the row scale into x (along N) likewise.
    """
    nr = qpanels.shape[2]
    kq = qpanels.shape[1]
    use_int = tag.ndim > 1
    qflat = qpanels.reshape(-1)  # isum_i16 takes byte offsets into it
    work = np.empty(2 * nr, np.float32)  # (a few allocations cost more than a small panel)
    acc, part = work[:nr], work[nr:]
    isum = np.empty(nr, np.int32)
    v = np.zeros(0 if use_int else kq * 4, np.float32)
    if not per_col:
        xq = np.empty(kq * 4, np.int16)
        sx = np.empty(-(-k // XQ_BLOCK), np.float32)
    elif not use_int:
        v[:k] = x[:k]
    for jp in range(p_lo, p_hi):
        qp = qpanels[jp]
        sc = scales[jp]
        base = jp * kq * nr
        for j in range(nr):
            acc[j] = 0.0
        if per_col:
            for g in range(sc.shape[0]):
                q0 = g * gk // 4
                q1 = min(kq, q0 + gk // 4)
                sr = sc[g]
                if use_int:
                    isum_i16(tag, isum, qflat, 4 * (base + q0 * nr), xq, q0 * 4, q1 - q0)
                    s = sx[g]
                    for j in range(nr):
                        acc[j] += np.float32(isum[j]) * (s * sr[j])
                else:
                    for j in range(nr):
                        part[j] = 0.0
                    _quads_into(part, v, qp, q0, q1)
                    for j in range(nr):
                        acc[j] += part[j] * sr[j]
        else:
            if use_int:
                if jp == p_lo or (jp * NR) // gk != ((jp - 1) * NR) // gk:  # else same scales
                    _quantize16(x, sc.reshape(-1), k, XQ_BLOCK, xq, sx)  # sc [K, 1]
                for b in range(sx.shape[0]):
                    q0 = b * XQ_BLOCK // 4
                    q1 = min(kq, q0 + XQ_BLOCK // 4)
                    isum_i16(tag, isum, qflat, 4 * (base + q0 * nr), xq, q0 * 4, q1 - q0)
                    s = sx[b]
                    for j in range(nr):
                        acc[j] += np.float32(isum[j]) * s
            else:
                for p in range(k):
                    v[p] = x[p] * sc[p, 0]
                _quads_into(acc, v, qp, 0, kq)
        j0 = jp * NR
        cr = c[j0:min(n, j0 + NR)]
        for j in range(cr.shape[0]):
            cr[j] = acc[j]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _x_int16(x, k, kq, per_col, gk, tag):
    """The activation row in int16 per weight group of k (xq, sx) where the integer kernels
    run with groups along K; empty otherwise (the kernel quantises per panel, or not at all)."""
    if tag.ndim > 1 and per_col:
        xq = np.empty(4 * kq, np.int16)
        sx = np.empty(-(-k // gk), np.float32)
        _quantize16(x, x[:0], k, gk, xq, sx)
        return xq, sx
    return np.empty(0, np.int16), np.empty(0, np.float32)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _qgemv_serial(x, k, n, qpanels, scales, per_col, gk, c, epi, tag):
    xq, sx = _x_int16(x, k, qpanels.shape[1], per_col, gk, tag)
    _qgemv_panels(0, qpanels.shape[0], x, k, n, qpanels, scales, per_col, gk, c, tag, xq, sx)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _qgemv_parallel(n_chunks, x, k, n, qpanels, scales, per_col, gk, c, epi, tag):
    n_panels = qpanels.shape[0]
    xq, sx = _x_int16(x, k, qpanels.shape[1], per_col, gk, tag)
    for chunk in prange(n_chunks):
        _qgemv_panels(chunk * n_panels // n_chunks, (chunk + 1) * n_panels // n_chunks, x, k, n,
                      qpanels, scales, per_col, gk, c, tag, xq, sx)
    if epi[1] or epi[2] or epi[6]:
        _epilogue(c, 0, n, 1, n, 0, epi)


def int_dot_level() -> int:
    """The integer-dot kernel the one-row product runs now: config.INT_DOT (HEPTI_INT_DOT),
    capped at what this CPU has (0: the float path)."""
    return max(0, min(int(config.INT_DOT), HOST_INT_DOT))


def quantize_x16(x: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(xq int16 [4 * ceil(K / 4)], sx float32 [ceil(K / block)]): x [K] in int16 per block, as
    the integer GeMV quantises its activation row (x ~= xq * sx[p // block]); tests read it."""
    x = np.ascontiguousarray(x, np.float32).reshape(-1)
    return _x_int16(x, x.shape[0], -(-x.shape[0] // 4), True, int(block), _TAGS[2])


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
    # KC, not the float32 path's deeper KC_PACKED: each k-block's int8 slice is dequantised
    # into a buffer [KC, NR] meant to stay in L1
    n_chunks, blocks, _ = _plan(m, k, n, int(threads), False, config.KC)
    common = (k, n, qb.q32, qb.scales, qb.per_col, qb.group)
    if m == 1:  # a_flat and c_flat start at the row: k and n values of it
        tag = _RUN_TAGS[config.INT_DOT] if qb.group <= XQ_GROUP_MAX else _TAGS[0]
        run_chunks(n_chunks, _qgemv_serial, _qgemv_parallel, (a_flat, *common, c_flat, epi, tag))
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
    rows = w.q[jp, :, j].reshape(idx.size, -1)[:, :w.k].astype(np.float32)  # [n, K]
    if w.per_col:  # a scale per group of k rows and column
        return rows * np.repeat(w.scales[jp, :, j], w.group, axis=1)[:, :w.k]
    return rows * w.scales[jp, :, 0]  # a scale per k row (the same for every column of a panel)


def pack_weight(m, trans: bool = False):
    """`pack_b` for a float32 array, `pack_q` for a QuantMatrix: what a stored weight needs."""
    if isinstance(m, QuantMatrix):
        return pack_q(m, trans=trans)
    return pack_b(m, trans=trans)
