"""Scaled dot-product attention core, per head and per sequence, on the GeMM micro-kernels.

For one sequence b and head h (q, k, v rows of width D = head_dim):
    S = Q_h K_h^T / sqrt(D) + (1 - mask_b) * float32_min     [nq, T]
    P = softmax(S) row by row                                   (HF BERT semantics)
    ctx_h = P V_h                                               [nq, D]
Both products run on the register-tiled kernels of packed_gemm. The scores are made transposed,
S^T = K_h Q_h^T, a panel of NR queries at a time: K_h is the A operand, its full MR-row tiles
read in place (`direct_tiles`), and Q_h^T a B panel (Q_h's rows read in place: the
transpose-packing of pack_b). A panel's S^T [T, NR] stays in L1 while the softmax runs down its
columns, across queries in vector lanes with no horizontal reduction, the column maxima and sums
in registers (`_softmax_panel32`), writing e straight into P's packed-A tiles; then P V_h on
V_h's panels, each ctx row scaled by its query's 1 / sum. (S = Q K^T row by row, as before
2026-11-29, took ~8% longer at MiniLM's shape: horizontal max and sum per row and a transposing
pack of P; the maxima and sums kept in workspace, and K packed, ~23% longer than now.) Every
operand is addressed through a flat view
with a row stride, so q, k and v may be column blocks of one fused QKV output and ctx may be a
column block of a bigger buffer; nothing is copied beyond the small per-head packing.

Rows are flattened token rows, g = b*T + t. q holds rows row0 .. row0+Mq-1 (a rank may own any
contiguous range, spanning sequences); k, v hold all B*T rows. Work items are (sequence, head)
pairs; threads > 1 spreads them over Numba threads.
"""
from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import njit, prange

from hepti.kernels._microkernels import MR, NR, direct_tiles, micro_tile
from hepti.kernels._views import EMPTY, check_float32, check_no_overlap, flat_rows, output, workspace
from hepti.kernels.config import FASTMATH_GEMM, JIT, KC
from hepti.kernels.packed_gemm import _pack_a, _pack_panel, _strip
from hepti.kernels.mathfn import exp_nonpos
from hepti.kernels.softmax import F32_MIN

_ONE, _ZERO = np.float32(1.0), np.float32(0.0)


@njit(**JIT)
def _head_sizes(nq, t, d):
    """Workspace parts for one (sequence, head) item of `_attend`, in floats, each padded to
    16: one packed tile of K (its last rows, when T is not a multiple of MR), one packed Q^T
    panel, one panel's scores^T [T, NR], packed P (whole panels of tiles: NR // MR per panel
    of queries, the last one's tiles past nq written, never read), packed V panels, a partial
    strip, the per-query max and sum."""
    n_qp, n_dp = -(-nq // NR), -(-d // NR)
    sizes = (d * MR, d * NR, t * NR, n_qp * NR * t, n_dp * t * NR, max(nq, t) * NR,
             NR + n_qp * NR)
    total = 0
    for size in sizes:
        total += -(-size // 16) * 16
    return sizes, total


@njit(inline="always", **JIT)
def _copy_mr(src, o, dst):
    """dst[0:MR] = src[o:o+MR]; for MR = 8 written out, so that it is one vector load and
    store (a loop of 8 between slices of one workspace stays scalar behind alias checks)."""
    if MR == 8:
        a0, a1, a2, a3 = src[o], src[o + 1], src[o + 2], src[o + 3]
        a4, a5, a6, a7 = src[o + 4], src[o + 5], src[o + 6], src[o + 7]
        dst[0], dst[1], dst[2], dst[3] = a0, a1, a2, a3
        dst[4], dst[5], dst[6], dst[7] = a4, a5, a6, a7
    else:
        for i in range(MR):
            dst[i] = src[o + i]


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _softmax_panel32(st, t, mask, scale, ap, tq0, tot):
    """One panel's softmax, for NR = 32 and MR = 8: st [t, 32] holds S^T (row p: key p's
    scores for the panel's 32 queries). Writes e = exp(s * scale + mask add - column max)
    straight into P's packed tiles ap[tq0 .. tq0+3] (row p of tile tq0+g: the e of
    queries 8g .. 8g+7; ap must have those 4 tiles even past the last query), and each
    query's sum of e into tot[0:32]. The 32 column maxima and sums are named scalars, so
    that they stay in registers: kept in a workspace slice, every row's update was a
    scalar load and store per query (the slices may alias st, so nothing vectorised)."""
    row = st[0:NR]
    add = _ZERO if mask[0] == _ONE else (_ONE - mask[0]) * F32_MIN
    m0 = row[0] * scale + add; m1 = row[1] * scale + add; m2 = row[2] * scale + add
    m3 = row[3] * scale + add; m4 = row[4] * scale + add; m5 = row[5] * scale + add
    m6 = row[6] * scale + add; m7 = row[7] * scale + add; m8 = row[8] * scale + add
    m9 = row[9] * scale + add; m10 = row[10] * scale + add; m11 = row[11] * scale + add
    m12 = row[12] * scale + add; m13 = row[13] * scale + add; m14 = row[14] * scale + add
    m15 = row[15] * scale + add; m16 = row[16] * scale + add; m17 = row[17] * scale + add
    m18 = row[18] * scale + add; m19 = row[19] * scale + add; m20 = row[20] * scale + add
    m21 = row[21] * scale + add; m22 = row[22] * scale + add; m23 = row[23] * scale + add
    m24 = row[24] * scale + add; m25 = row[25] * scale + add; m26 = row[26] * scale + add
    m27 = row[27] * scale + add; m28 = row[28] * scale + add; m29 = row[29] * scale + add
    m30 = row[30] * scale + add; m31 = row[31] * scale + add
    for p in range(1, t):
        row = st[p * NR:(p + 1) * NR]
        add = _ZERO if mask[p] == _ONE else (_ONE - mask[p]) * F32_MIN
        x0 = row[0] * scale + add; x1 = row[1] * scale + add; x2 = row[2] * scale + add
        x3 = row[3] * scale + add; x4 = row[4] * scale + add; x5 = row[5] * scale + add
        x6 = row[6] * scale + add; x7 = row[7] * scale + add; x8 = row[8] * scale + add
        x9 = row[9] * scale + add; x10 = row[10] * scale + add; x11 = row[11] * scale + add
        x12 = row[12] * scale + add; x13 = row[13] * scale + add; x14 = row[14] * scale + add
        x15 = row[15] * scale + add; x16 = row[16] * scale + add; x17 = row[17] * scale + add
        x18 = row[18] * scale + add; x19 = row[19] * scale + add; x20 = row[20] * scale + add
        x21 = row[21] * scale + add; x22 = row[22] * scale + add; x23 = row[23] * scale + add
        x24 = row[24] * scale + add; x25 = row[25] * scale + add; x26 = row[26] * scale + add
        x27 = row[27] * scale + add; x28 = row[28] * scale + add; x29 = row[29] * scale + add
        x30 = row[30] * scale + add; x31 = row[31] * scale + add
        m0 = x0 if x0 > m0 else m0; m1 = x1 if x1 > m1 else m1; m2 = x2 if x2 > m2 else m2
        m3 = x3 if x3 > m3 else m3; m4 = x4 if x4 > m4 else m4; m5 = x5 if x5 > m5 else m5
        m6 = x6 if x6 > m6 else m6; m7 = x7 if x7 > m7 else m7; m8 = x8 if x8 > m8 else m8
        m9 = x9 if x9 > m9 else m9; m10 = x10 if x10 > m10 else m10
        m11 = x11 if x11 > m11 else m11; m12 = x12 if x12 > m12 else m12
        m13 = x13 if x13 > m13 else m13; m14 = x14 if x14 > m14 else m14
        m15 = x15 if x15 > m15 else m15; m16 = x16 if x16 > m16 else m16
        m17 = x17 if x17 > m17 else m17; m18 = x18 if x18 > m18 else m18
        m19 = x19 if x19 > m19 else m19; m20 = x20 if x20 > m20 else m20
        m21 = x21 if x21 > m21 else m21; m22 = x22 if x22 > m22 else m22
        m23 = x23 if x23 > m23 else m23; m24 = x24 if x24 > m24 else m24
        m25 = x25 if x25 > m25 else m25; m26 = x26 if x26 > m26 else m26
        m27 = x27 if x27 > m27 else m27; m28 = x28 if x28 > m28 else m28
        m29 = x29 if x29 > m29 else m29; m30 = x30 if x30 > m30 else m30
        m31 = x31 if x31 > m31 else m31
    s0 = _ZERO; s1 = _ZERO; s2 = _ZERO; s3 = _ZERO; s4 = _ZERO; s5 = _ZERO; s6 = _ZERO; s7 = _ZERO
    s8 = _ZERO; s9 = _ZERO; s10 = _ZERO; s11 = _ZERO; s12 = _ZERO; s13 = _ZERO; s14 = _ZERO
    s15 = _ZERO; s16 = _ZERO; s17 = _ZERO; s18 = _ZERO; s19 = _ZERO; s20 = _ZERO; s21 = _ZERO
    s22 = _ZERO; s23 = _ZERO; s24 = _ZERO; s25 = _ZERO; s26 = _ZERO; s27 = _ZERO; s28 = _ZERO
    s29 = _ZERO; s30 = _ZERO; s31 = _ZERO
    for p in range(t):
        row = st[p * NR:(p + 1) * NR]
        add = _ZERO if mask[p] == _ONE else (_ONE - mask[p]) * F32_MIN
        e0 = exp_nonpos(row[0] * scale + add - m0); e1 = exp_nonpos(row[1] * scale + add - m1)
        e2 = exp_nonpos(row[2] * scale + add - m2); e3 = exp_nonpos(row[3] * scale + add - m3)
        e4 = exp_nonpos(row[4] * scale + add - m4); e5 = exp_nonpos(row[5] * scale + add - m5)
        e6 = exp_nonpos(row[6] * scale + add - m6); e7 = exp_nonpos(row[7] * scale + add - m7)
        e8 = exp_nonpos(row[8] * scale + add - m8); e9 = exp_nonpos(row[9] * scale + add - m9)
        e10 = exp_nonpos(row[10] * scale + add - m10)
        e11 = exp_nonpos(row[11] * scale + add - m11)
        e12 = exp_nonpos(row[12] * scale + add - m12)
        e13 = exp_nonpos(row[13] * scale + add - m13)
        e14 = exp_nonpos(row[14] * scale + add - m14)
        e15 = exp_nonpos(row[15] * scale + add - m15)
        e16 = exp_nonpos(row[16] * scale + add - m16)
        e17 = exp_nonpos(row[17] * scale + add - m17)
        e18 = exp_nonpos(row[18] * scale + add - m18)
        e19 = exp_nonpos(row[19] * scale + add - m19)
        e20 = exp_nonpos(row[20] * scale + add - m20)
        e21 = exp_nonpos(row[21] * scale + add - m21)
        e22 = exp_nonpos(row[22] * scale + add - m22)
        e23 = exp_nonpos(row[23] * scale + add - m23)
        e24 = exp_nonpos(row[24] * scale + add - m24)
        e25 = exp_nonpos(row[25] * scale + add - m25)
        e26 = exp_nonpos(row[26] * scale + add - m26)
        e27 = exp_nonpos(row[27] * scale + add - m27)
        e28 = exp_nonpos(row[28] * scale + add - m28)
        e29 = exp_nonpos(row[29] * scale + add - m29)
        e30 = exp_nonpos(row[30] * scale + add - m30)
        e31 = exp_nonpos(row[31] * scale + add - m31)
        s0 += e0; s1 += e1; s2 += e2; s3 += e3; s4 += e4; s5 += e5; s6 += e6; s7 += e7; s8 += e8
        s9 += e9; s10 += e10; s11 += e11; s12 += e12; s13 += e13; s14 += e14; s15 += e15
        s16 += e16; s17 += e17; s18 += e18; s19 += e19; s20 += e20; s21 += e21; s22 += e22
        s23 += e23; s24 += e24; s25 += e25; s26 += e26; s27 += e27; s28 += e28; s29 += e29
        s30 += e30; s31 += e31
        d = ap[tq0 + 0, p]
        d[0] = e0; d[1] = e1; d[2] = e2; d[3] = e3; d[4] = e4; d[5] = e5; d[6] = e6; d[7] = e7
        d = ap[tq0 + 1, p]
        d[0] = e8; d[1] = e9; d[2] = e10; d[3] = e11; d[4] = e12; d[5] = e13; d[6] = e14
        d[7] = e15
        d = ap[tq0 + 2, p]
        d[0] = e16; d[1] = e17; d[2] = e18; d[3] = e19; d[4] = e20; d[5] = e21; d[6] = e22
        d[7] = e23
        d = ap[tq0 + 3, p]
        d[0] = e24; d[1] = e25; d[2] = e26; d[3] = e27; d[4] = e28; d[5] = e29; d[6] = e30
        d[7] = e31
    tot[0] = s0; tot[1] = s1; tot[2] = s2; tot[3] = s3; tot[4] = s4; tot[5] = s5; tot[6] = s6
    tot[7] = s7; tot[8] = s8; tot[9] = s9; tot[10] = s10; tot[11] = s11; tot[12] = s12
    tot[13] = s13; tot[14] = s14; tot[15] = s15; tot[16] = s16; tot[17] = s17; tot[18] = s18
    tot[19] = s19; tot[20] = s20; tot[21] = s21; tot[22] = s22; tot[23] = s23; tot[24] = s24
    tot[25] = s25; tot[26] = s26; tot[27] = s27; tot[28] = s28; tot[29] = s29; tot[30] = s30
    tot[31] = s31


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _softmax_panel(st, t, mask, scale, ap, tq0, tot, top):
    """`_softmax_panel32` for any NR and MR (top: NR floats of workspace for the maxima)."""
    # scale and mask each key's row (HF: a padded key's score + float32_min; a select for
    # a real key, so fast-math cannot reassociate it), each query's max down its column
    for p in range(t):
        row = st[p * NR:(p + 1) * NR]
        m = mask[p]
        if m == _ONE:
            for j in range(NR):
                row[j] = row[j] * scale
        else:
            add = (_ONE - m) * F32_MIN
            for j in range(NR):
                row[j] = row[j] * scale + add
        if p == 0:
            for j in range(NR):
                top[j] = row[j]
                tot[j] = _ZERO
        else:
            for j in range(NR):
                top[j] = max(top[j], row[j])
    # e = exp(s - max) in place and each query's sum, then the rows into P's tiles
    for p in range(t):
        row = st[p * NR:(p + 1) * NR]
        for j in range(NR):
            e = exp_nonpos(row[j] - top[j])
            row[j] = e
            tot[j] += e
    for tq in range(tq0, tq0 + NR // MR):
        tile = ap[tq]
        c0 = (tq - tq0) * MR
        for p in range(t):
            _copy_mr(st, p * NR + c0, tile[p])


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _attend(q, q_off, ldq, nq, kf, k_off, ldk, vf, v_off, ldv, t, d, mask, scale,
              out, o_off, ldo, kc_max, epi, ws):
    """ctx [nq, d] at out[o_off + i*ldo + j] for one head of one sequence.

    The scores are made transposed (key rows, query columns: S^T = K Q^T), a panel of NR
    queries at a time, so that a panel's scores [T, NR] stay in L1 while its softmax runs down
    the columns, vectorised across queries with no horizontal reductions, and so that its
    probabilities are already P's packed-A layout for P V (P's tile of MR queries at key p is
    MR contiguous floats of row p). Each query's 1/sum scales its ctx row (d floats) rather
    than its T probabilities.

    Query row i is q[q_off + i*ldq : ... + d]; key/value row r is kf[k_off + r*ldk : ... + d]
    (vf likewise), r < t; mask [t] is the sequence's key mask.
    """
    n_qp, n_dp = -(-nq // NR), -(-d // NR)
    sizes, _ = _head_sizes(nq, t, d)
    o = 0
    ak = ws[o:o + sizes[0]].reshape((1, d, MR))
    o += -(-sizes[0] // 16) * 16
    qt = ws[o:o + sizes[1]].reshape((d, NR))
    o += -(-sizes[1] // 16) * 16
    st = ws[o:o + sizes[2]]  # one panel's scores^T / probabilities^T, [t, NR] row-major
    o += -(-sizes[2] // 16) * 16
    ap = ws[o:o + sizes[3]].reshape((n_qp * (NR // MR), t, MR))
    o += -(-sizes[3] // 16) * 16
    vp = ws[o:o + sizes[4]].reshape((n_dp, t, NR))
    o += -(-sizes[4] // 16) * 16
    scratch = ws[o:o + sizes[5]]
    o += -(-sizes[5] // 16) * 16
    top = ws[o:o + NR]
    total = ws[o + NR:o + NR + n_qp * NR]

    n_kf = t // MR  # full tiles of key rows, read in place; the rest packed into ak[0]
    if t > n_kf * MR:
        _pack_a(kf, k_off, ldk, n_kf * MR, t, d, ak)
    for jp in range(n_qp):
        # S^T panel = K Q^T[:, panel]: Q^T is zero-padded past nq (those columns never read)
        _pack_panel(q, q_off, ldq, True, d, jp * NR, min(NR, nq - jp * NR), qt)
        direct_tiles(0, n_kf, 1, d, kf, k_off, 0, ldk, qt, 0, st, 0, NR, False)
        if t > n_kf * MR:
            micro_tile(t - n_kf * MR, d, ak[0], qt, 0, 0, st, n_kf * MR * NR, NR, False)
        tot = total[jp * NR:(jp + 1) * NR]
        if NR == 32 and MR == 8:
            _softmax_panel32(st, t, mask, scale, ap, jp * (NR // MR), tot)
        else:
            _softmax_panel(st, t, mask, scale, ap, jp * (NR // MR), tot, top)
    # ctx = (E V) / sum, row by row
    for jp in range(n_dp):
        _pack_panel(vf, v_off, ldv, False, t, jp * NR, min(NR, d - jp * NR), vp[jp])
        _strip(ap, nq, t, kc_max, vp[jp], out, o_off, ldo, jp * NR, min(NR, d - jp * NR),
               scratch, epi, st, 0, 0)
    for i in range(nq):
        inv = _ONE / total[i]
        r = out[o_off + i * ldo:o_off + i * ldo + d]
        for j in range(d):
            r[j] *= inv


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _items(lo, hi, work, q, ldq, kf, ldk, vf, ldv, key_mask, t, d, row0, scale, out, ldo,
           kc_max, epi, ws):
    """Work items lo .. hi-1; work[w] = (sequence b, head h, first row g0, end row g1)."""
    for w in range(lo, hi):
        b, h, g0, g1 = work[w, 0], work[w, 1], work[w, 2], work[w, 3]
        _attend(q, (g0 - row0) * ldq + h * d, ldq, g1 - g0, kf, b * t * ldk + h * d, ldk,
                vf, b * t * ldv + h * d, ldv, t, d, key_mask[b], scale,
                out, (g0 - row0) * ldo + h * d, ldo, kc_max, epi, ws)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _attention_serial(work, q, ldq, kf, ldk, vf, ldv, key_mask, t, d, row0, scale, out, ldo,
                      kc_max, epi, ws):
    """All work items on the calling thread."""
    _items(0, work.shape[0], work, q, ldq, kf, ldk, vf, ldv, key_mask, t, d, row0, scale, out,
           ldo, kc_max, epi, ws)


@njit(fastmath=FASTMATH_GEMM, parallel=True, **JIT)
def _attention_parallel(n_chunks, work, q, ldq, kf, ldk, vf, ldv, key_mask, t, d, row0, scale,
                        out, ldo, kc_max, epi, ws, ws_per_chunk):
    """Work items split into n_chunks contiguous ranges, one per thread, each with its own
    slice of the workspace."""
    n = work.shape[0]
    for chunk in prange(n_chunks):
        _items(chunk * n // n_chunks, (chunk + 1) * n // n_chunks, work, q, ldq, kf, ldk, vf,
               ldv, key_mask, t, d, row0, scale, out, ldo, kc_max, epi,
               ws[chunk * ws_per_chunk:(chunk + 1) * ws_per_chunk])


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, key_mask: np.ndarray, n_heads: int,
              row0: int = 0, out: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """ctx [Mq, H*D]: per head, softmax(q_h k_h^T / sqrt(D) masked) v_h, each query row
    attending to the keys of its own sequence.

    q: float32 [Mq, H*D], flattened rows row0 .. row0+Mq-1 (row g = b*T + t).
    k, v: float32 [B*T, H*D], all rows. key_mask: float32 [B, T], 1 = real token, 0 = padding.
    q, k, v and out need contiguous rows only (column blocks of a fused QKV output are fine);
    out must not overlap them.
    """
    for name, x in (("q", q), ("k", k), ("v", v), ("key_mask", key_mask)):
        check_float32(x, name, 2)
    n_seq, t = key_mask.shape
    mq, width = q.shape
    if k.shape != (n_seq * t, width) or v.shape != (n_seq * t, width):
        raise ValueError(f"k and v must have shape {(n_seq * t, width)} (B*T rows for key_mask "
                         f"{key_mask.shape}, q's width), got {k.shape} and {v.shape}")
    ctx = output(out, (mq, width))
    if out is not None:
        for name, x in (("q", q), ("k", k), ("v", v)):
            check_no_overlap(ctx, x, name)
    return _attend_all(flat_rows(q, "q"), flat_rows(k, "k"), flat_rows(v, "v"), key_mask, ctx,
                       n_heads, row0, threads)


def attention_qkv(qkv: np.ndarray, key_mask: np.ndarray, n_heads: int,
                  kv: np.ndarray | None = None, row0: int = 0, threads: int = 1) -> np.ndarray:
    """attention() on the output of a fused QKV GeMM, as the encoder layers call it.

    qkv: C-contiguous float32 [Mq, 3*H*D], columns q | k | v of rows row0 .. row0+Mq-1. With
    kv (C-contiguous float32 [B*T, 2*H*D], columns k | v of every row: what `rows` gathers),
    the queries attend to kv's keys; without it, qkv holds every row and its own k and v.
    Returns a new ctx [Mq, H*D].

    The same computation as attention(q, k, v) on column views, but the views are taken here
    as offsets into the flat arrays: inside a forward, where the layer's GeMMs have just pushed
    the interpreter's own data out of the caches, working them out from the views' base arrays
    cost about 30 us of a MiniLM layer's ~550 us attention call.
    """
    check_float32(qkv, "qkv", 2)
    check_float32(key_mask, "key_mask", 2)
    mq, w3 = qkv.shape
    if w3 % 3 or not qkv.flags.c_contiguous:
        raise ValueError(f"qkv must be C-contiguous [Mq, 3*H*D], got shape {qkv.shape}")
    width = w3 // 3
    n_seq, t = key_mask.shape
    flat = qkv.reshape(-1)
    if kv is None:
        if mq != n_seq * t:
            raise ValueError(f"qkv has {mq} rows; without kv it must hold all {n_seq * t} rows "
                             f"of key_mask {key_mask.shape}")
        k, v = (flat[width:], w3), (flat[2 * width:], w3)
    else:
        check_float32(kv, "kv", 2)
        if kv.shape != (n_seq * t, 2 * width) or not kv.flags.c_contiguous:
            raise ValueError(f"kv must be C-contiguous {(n_seq * t, 2 * width)}, got {kv.shape}")
        kf = kv.reshape(-1)
        k, v = (kf, 2 * width), (kf[width:], 2 * width)
    ctx = np.empty((mq, width), np.float32)
    return _attend_all((flat, w3), k, v, key_mask, ctx, n_heads, row0, threads)


@functools.lru_cache(maxsize=64)
def _work_plan(n_seq: int, t: int, row0: int, mq: int, n_heads: int, d: int, threads: int):
    """(work items, workspace floats per chunk, chunks) for one call shape; the same few shapes
    recur every layer, so they are worked out once."""
    work = []
    for b in range(row0 // t, -(-(row0 + mq) // t)):
        g0, g1 = max(row0, b * t), min(row0 + mq, (b + 1) * t)
        work += [(b, h, g0, g1) for h in range(n_heads)]
    work = np.array(work, np.int64)
    longest = int((work[:, 3] - work[:, 2]).max())
    n_chunks = max(1, min(threads, numba.config.NUMBA_NUM_THREADS, len(work)))
    return work, _head_sizes(longest, t, d)[1], n_chunks


_EPI_NONE = (EMPTY, False, False, EMPTY, 0, 1, False)  # no bias, GeLU or residual


def _attend_all(q, k, v, key_mask, ctx, n_heads, row0, threads):
    """Shared tail: check the head split and rows, then run every (sequence, head) item.
    q, k, v are (flat, ld) pairs."""
    n_seq, t = key_mask.shape
    mq, width = ctx.shape
    n_heads = int(n_heads)
    if n_heads < 1 or width % n_heads:
        raise ValueError(f"q's width {width} is not a multiple of n_heads={n_heads}")
    row0 = int(row0)
    if row0 < 0 or row0 + mq > n_seq * t:
        raise ValueError(f"query rows {row0} .. {row0 + mq - 1} are outside the {n_seq * t} "
                         f"rows of the batch")
    threads = int(threads)
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    if mq == 0 or width == 0:
        return ctx
    d = width // n_heads
    (q_flat, ldq), (k_flat, ldk), (v_flat, ldv) = q, k, v
    o_flat, ldo = flat_rows(ctx, "out")
    mask = key_mask if key_mask.flags.c_contiguous else np.ascontiguousarray(key_mask)
    work, ws_item, n_chunks = _work_plan(n_seq, t, row0, mq, n_heads, d, threads)
    ws = workspace(n_chunks * ws_item)
    scale = np.float32(1.0 / math.sqrt(d))
    if n_chunks == 1:
        _attention_serial(work, q_flat, ldq, k_flat, ldk, v_flat, ldv, mask, t, d, row0, scale,
                          o_flat, ldo, KC, _EPI_NONE, ws)
    else:
        previous = numba.get_num_threads()
        numba.set_num_threads(n_chunks)
        try:
            _attention_parallel(n_chunks, work, q_flat, ldq, k_flat, ldk, v_flat, ldv, mask, t,
                                d, row0, scale, o_flat, ldo, KC, _EPI_NONE, ws, ws_item)
        finally:
            numba.set_num_threads(previous)
    return ctx
