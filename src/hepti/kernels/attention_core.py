"""Scaled dot-product attention core, per head and per sequence, on the GeMM micro-kernels.

For one sequence b and head h (q, k, v rows of width D = head_dim):
    S = Q_h K_h^T / sqrt(D) + (1 - mask_b) * float32_min     [nq, T]
    P = softmax(S) row by row                                   (HF BERT semantics)
    ctx_h = P V_h                                               [nq, D]
Both products run on the register-tiled kernels of packed_gemm. The scores are made transposed,
S^T = K_h Q_h^T, a panel of NR queries at a time: K_h is the A operand, its full MR-row tiles
read in place by the IR tile (`direct_tiles_epi`, conv.py's, a zero bias), and Q_h^T a B panel
(`_pack_qt`: 16 x 16 register transposes, _transpose_ir). The IR tile, not the generated
named-scalar one (`direct_tiles`), because on AVX2 that tile's 32 ymm of accumulators spilled
in the k loop, where the IR tile runs in passes that fit (`register_passes`): Zen 3, MiniLM
@128 in one process against the tree before, the trees taking turns (`hepti bench against
6fc4534 --in-process`, 20 rounds), 0.914x the time, BERT-base @256 0.918x; outputs within
rounding (within 1e-6 of the largest). A panel's S^T [T, NR] stays in L1 while the softmax runs down its
columns, across queries in vector lanes with no horizontal reduction, the column maxima and sums
in registers (`softmax_panel`: for NR = 32 the IR panel of _softmax_ir, a base-2 exp),
writing e straight into P's packed-A tiles; then P V_h on
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

from hepti.kernels import _softmax_ir
from hepti.kernels._transpose_ir import transpose16
from hepti.kernels._microkernels import MR, NR, direct_tiles_epi, micro_tile, softmax_panel
from hepti.kernels._views import (EMPTY, check_float32, check_no_overlap, flat_rows, output,
                                 vector, workspace)
from hepti.kernels.config import FASTMATH_GEMM, JIT, KC
from hepti.kernels.norm import add_layernorm, layernorm_inplace, ln_tail
from hepti.kernels.packed_gemm import (PackedB, _pack_a, _pack_panel,
                                       _gemm_serial, _plan,
                                       _strip, gemm)

_ONE = np.float32(1.0)
# the score tiles' bias: the IR tile adds one; zero leaves each score's bits (but -0.0's sign,
# which neither the maximum nor exp sees)
_NO_BIAS = np.zeros(NR, np.float32)

if NR == _softmax_ir.NR and MR == 8:
    # the explicit-vector IR panel (base-2 exp, 0.61x the generated one's time at MiniLM's
    # shape); other tile sizes keep the generated named-scalar panel
    softmax_panel = _softmax_ir.softmax_panel8  # noqa: F811


@njit(**JIT)
def _head_sizes(nq, t, d):
    """Workspace parts for one (sequence, head) item of `_attend`, in floats, each padded to
    16: one packed tile of K (its last rows, when T is not a multiple of MR), one packed Q^T
    panel, one panel's scores^T [T, NR], packed P (whole panels of tiles: NR // MR per panel
    of queries, the last one's tiles past nq written, never read), packed V panels, a partial
    strip, the per-query sums."""
    n_qp, n_dp = -(-nq // NR), -(-d // NR)
    sizes = (d * MR, d * NR, t * NR, n_qp * NR * t, n_dp * t * NR, max(nq, t) * NR,
             n_qp * NR)
    total = 0
    for size in sizes:
        total += -(-size // 16) * 16
    return sizes, total


@njit(**JIT)
def _pack_qt(q, q_off, ldq, d, j0, ncols, qt, qt_flat):
    """qt [d, NR] (qt_flat: the same floats, flat) = query rows j0 .. j0+ncols-1 of Q
    transposed, zero-padded to NR columns: `_pack_panel(q, q_off, ldq, True, d, j0, ncols,
    qt)`. A full panel with d a multiple of 16 goes by 16 x 16 register transposes (MiniLM's
    32 x 32 panels: 5.2 us a layer against 14.1, interleaved); the rest as _pack_panel does."""
    if NR % 16 == 0 and ncols == NR and d % 16 == 0:
        for i0 in range(0, NR, 16):
            for p0 in range(0, d, 16):
                transpose16(q, q_off + (j0 + i0) * ldq + p0, ldq, qt_flat, p0 * NR + i0, NR)
    else:
        _pack_panel(q, q_off, ldq, True, d, j0, ncols, qt)


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
    qt_flat = ws[o:o + sizes[1]]
    qt = qt_flat.reshape((d, NR))
    o += -(-sizes[1] // 16) * 16
    st = ws[o:o + sizes[2]]  # one panel's scores^T / probabilities^T, [t, NR] row-major
    o += -(-sizes[2] // 16) * 16
    ap = ws[o:o + sizes[3]].reshape((n_qp * (NR // MR), t, MR))
    o += -(-sizes[3] // 16) * 16
    vp = ws[o:o + sizes[4]].reshape((n_dp, t, NR))
    o += -(-sizes[4] // 16) * 16
    scratch = ws[o:o + sizes[5]]
    o += -(-sizes[5] // 16) * 16
    total = ws[o:o + n_qp * NR]

    n_kf = t // MR  # full tiles of key rows, read in place; the rest packed into ak[0]
    # np.int64 / np.bool_, not literals: the tile kernels' signature of the CNN kernels' calls
    z, one, no = np.int64(0), np.int64(1), np.bool_(False)
    if t > n_kf * MR:
        _pack_a(kf, k_off, ldk, n_kf * MR, t, d, ak)
    for jp in range(n_qp):
        # S^T panel = K Q^T[:, panel]: Q^T is zero-padded past nq (those columns never read)
        _pack_qt(q, q_off, ldq, d, jp * NR, min(NR, nq - jp * NR), qt, qt_flat)
        direct_tiles_epi(z, n_kf, one, np.int64(d), kf, np.int64(k_off), z, np.int64(ldk), qt,
                         z, st, z, np.int64(NR), np.int64(MR), _NO_BIAS, st, z, z, no, z)
        if t > n_kf * MR:
            micro_tile(t - n_kf * MR, d, ak[0], qt, 0, 0, st, n_kf * MR * NR, NR, False)
        tot = total[jp * NR:(jp + 1) * NR]
        softmax_panel(st, t, mask, scale, ap, jp * (NR // MR), tot)
    # ctx = (E V) / sum, row by row
    for jp in range(n_dp):
        _pack_panel(vf, v_off, ldv, False, t, jp * NR, min(NR, d - jp * NR), vp[jp])
        _strip(ap, nq, t, kc_max, vp[jp], out, o_off, ldo, jp * NR, min(NR, d - jp * NR),
               scratch, epi, st, z, z)
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
    _items(np.int64(0), work.shape[0], work, q, ldq, kf, ldk, vf, ldv, key_mask, t, d, row0,
           scale, out, ldo, kc_max, epi, ws)  # np.int64: _parallel's signature, not a literal's


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


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _block_serial(x, wqkv, qkv_bias, key_mask, wo, o_bias, y, work, sizes, ws, tail):
    """y [m, n_o] = attention(x [m, c] @ Wqkv + qkv_bias) @ Wo + o_bias (+ residual, then
    LayerNorm) on the calling thread: `attention_block`'s kernels in one call, qkv [m, n3] and
    ctx [m, n3 / 3] between them. A bias is absent when empty; sizes = (n3, d, scale, qkv
    blocks, o blocks, KC); tail = (residual [m, n_o], gamma, beta, eps, has_res, has_ln). Few
    arguments: inside a forward each costs the call ~1 us, cold."""
    n3, d, scale, qkv_blocks, o_blocks, kc_max = sizes
    m, c = x.shape
    n_o = y.shape[1]
    t = key_mask.shape[1]
    width = n3 // 3
    none = np.empty(0, np.float32)
    qkv = np.empty(m * n3, np.float32)
    ctx = np.empty(m * width, np.float32)
    z, one, no = np.int64(0), np.int64(1), np.bool_(False)  # no literals: _gemm_serial says why
    qkv_epi = (qkv_bias, qkv_bias.shape[0] > 0, no, none, z, one, no)
    # the QKV projection's last panel prefetches the output projection's first
    _gemm_serial(x.reshape(-1), z, c, m, c, n3, wqkv, none, z, one, qkv, z, n3, qkv_blocks,
                 qkv_epi, ws, wo.reshape(-1), width * NR)
    no_epi = (none, no, no, none, z, one, no)
    _items(z, work.shape[0], work, qkv, n3, qkv[width:], n3, qkv[2 * width:], n3, key_mask, t,
           d, z, scale, ctx, width, kc_max, no_epi, ws)
    res, gamma, beta, eps, has_res, has_ln = tail
    o_epi = (o_bias, o_bias.shape[0] > 0, no, res.reshape(-1), z, n_o, has_res)
    _gemm_serial(ctx, z, width, m, width, n_o, wo, none, z, one, y.reshape(-1), z, n_o, o_blocks,
                 o_epi, ws, none, z)
    if has_ln:
        layernorm_inplace(y, gamma, beta, eps)


@functools.lru_cache(maxsize=64)
def _block_plan(m: int, c: int, n3: int, n_o: int, n_seq: int, t: int, n_heads: int):
    """(sizes, work items, workspace floats) of one `attention_block` shape."""
    width = n3 // 3
    d = width // n_heads
    _, qkv_blocks, qkv_ws = _plan(m, c, n3, 1, False)
    _, o_blocks, o_ws = _plan(m, width, n_o, 1, False)
    work, att_ws, _ = _work_plan(n_seq, t, 0, m, n_heads, d, 1)
    sizes = (n3, d, np.float32(1.0 / math.sqrt(d)), qkv_blocks, o_blocks, KC)
    return sizes, work, max(qkv_ws, o_ws, att_ws)


def attention_block(x: np.ndarray, wqkv: PackedB, qkv_bias: np.ndarray | None,
                    key_mask: np.ndarray, n_heads: int, wo: PackedB,
                    o_bias: np.ndarray | None = None, residual: np.ndarray | None = None,
                    ln: tuple | None = None) -> np.ndarray:
    """attention_qkv(gemm(x, wqkv, qkv_bias), key_mask, n_heads) @ wo (+ o_bias) (+ residual
    [B*T, N]) (then LayerNorm with ln = (gamma, beta, eps)), one thread, every row's own keys
    and values: a BERT layer's attention piece (and its add+ln) as one kernel call.

    x: float32 [B*T, C]; wqkv packs [C, 3*H*D] (columns q | k | v); wo packs [H*D, N].
    Returns a new [B*T, N]. The same kernels in the same order as the three calls, so the
    same floats; one call, because inside a forward the Python around each kernel call runs
    with the interpreter's data pushed out of the caches by the GeMMs (~20 us a call, MiniLM).
    """
    if not isinstance(wqkv, PackedB) or not isinstance(wo, PackedB):
        raise TypeError("wqkv and wo must be PackedB from pack_b()")
    check_float32(x, "x", 2)
    check_float32(key_mask, "key_mask", 2)
    m, c = x.shape
    n3, width, n_o = wqkv.n, wqkv.n // 3, wo.n
    n_seq, t = key_mask.shape
    if c != wqkv.k or n3 % 3 or wo.k != width or m != n_seq * t:
        raise ValueError(f"cannot chain x {x.shape} -> qkv [K={wqkv.k}, N={n3}] -> attention "
                         f"(key_mask {key_mask.shape}) -> wo [K={wo.k}, N={n_o}]")
    n_heads = int(n_heads)
    if n_heads < 1 or width % n_heads:
        raise ValueError(f"the qkv width {width} is not a multiple of n_heads={n_heads}")
    tail = ln_tail(residual, ln, m, n_o)
    if m == 0 or width == 0 or n_o == 0:  # nothing to fuse: the separate calls
        y = gemm(attention_qkv(gemm(x, wqkv, bias=qkv_bias), key_mask, n_heads), wo,
                 bias=o_bias, residual=residual)
        return y if ln is None else add_layernorm(y, None, None, ln[0], ln[1], ln[2], out=y)
    sizes, work, ws = _block_plan(m, c, n3, n_o, n_seq, t, n_heads)
    y = np.empty((m, n_o), np.float32)
    _block_serial(x if x.flags.c_contiguous else np.ascontiguousarray(x), wqkv.panels,
                  vector(qkv_bias, "qkv_bias", n3),
                  key_mask if key_mask.flags.c_contiguous else np.ascontiguousarray(key_mask),
                  wo.panels, vector(o_bias, "o_bias", n_o), y, work, sizes, workspace(ws), tail)
    return y


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
