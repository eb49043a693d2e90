"""The int8 kernels (hepti.kernels.int8) against their float64 twins, and the int8 error.

Two questions, kept apart:
- does the kernel compute what the int8 values stand for? gemm_q (GeMM and, at one row, GeMV)
  against float64 a @ dequantised B (naive.dequantize_int8), within float32 rounding
  (test_kernels' tolerance: 1e-5 * sqrt(K) relative to sum_k |a_ik| |b_kj|);
- how far is that from the float weights? Each weight moves by at most half its group's scale
  (round to nearest), so |a @ (B_q - B)| <= 0.5 * |a| @ scale(B) elementwise; for Gaussian
  weights the relative error of a product is about 0.6% with groups of 64, asserted < 1%.
Shapes hit the blocking edges: K not a multiple of the group (a short last group) nor of KC,
N not a multiple of NR, M = 1 (the GeMV) and M not a multiple of MR; both stored orientations
(groups along K for [N, K], along N for [K, N]); threads 1 and 2.

The one-row product (GeMV) has integer kernels (int16 activations x int8 weights, int32 sums;
config.INT_DOT picks AVX-512 VNNI, AVX2 or the float path, capped at what the CPU has); each
level this CPU runs is tested, the float fallback included:
- with groups along K, against a float64 twin of the same arithmetic (the kernel's own int16
  row from `quantize_x16`, exact integer sums, the scales applied in float64): equal to
  float32 rounding;
- against the float64 product with the int8 weights, within the activation rounding bound:
  each int16 value is within half its block's step sx of x (groups along K: x itself; along N:
  x times the row's weight scale, per XQ_BLOCK of k), so |c_j - (x @ B)_j| <= sum over k of
  sx(k) / 2 * |q[k, j]| (times the weight scale along K), plus float32 rounding.
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from hepti.kernels import (PackedB, QuantB, QuantMatrix, columns_any, config, ffn, ffn_any,
                           gemm_any, gemm_q, naive, pack_b, pack_q, pack_weight, quantize)
from hepti.kernels._vnni import isa_tag, isum_i16
from hepti.kernels.int8 import GROUP, XQ_BLOCK, XQMAX, quantize_x16
from tests.test_kernels import assert_gemm_close

RNG = np.random.default_rng(20261129)
KC, NR = config.KC, config.NR


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


def stored(k: int, n: int, trans: bool) -> np.ndarray:
    """A float weight as hepti stores it: [N, K] when trans (column-split), else [K, N]."""
    return rand(n, k) if trans else rand(k, n)


def as_b(x: np.ndarray, trans: bool) -> np.ndarray:
    """B [K, N] of a stored matrix."""
    return x.T if trans else x


def twin(qm: QuantMatrix, trans: bool) -> np.ndarray:
    """float64 B [K, N] the int8 matrix stands for."""
    return as_b(naive.dequantize_int8(qm.q, qm.scales, qm.group), trans)


@pytest.mark.parametrize("rows,cols,group", [(5, 64, 64), (7, 100, 64), (3, 33, 32),
                                             (4, 300, 128), (2, 1, 64)])
def test_quantize_rounds_to_nearest_per_group(rows, cols, group):
    w = rand(rows, cols)
    w[0, :min(cols, group)] = 0.0  # a group of zeros: scale 0, q 0
    qm = quantize(w, group)
    assert qm.q.dtype == np.int8 and qm.q.shape == (rows, cols)
    assert qm.scales.shape == (rows, -(-cols // group))
    assert np.abs(qm.q.astype(int)).max() <= 127
    assert qm.scales[0, 0] == 0 and not qm.q[0, :min(cols, group)].any()
    # every group (the short last one too) reaches +-127 at its largest value
    for g in range(qm.scales.shape[1]):
        block = qm.q[1:, g * group:(g + 1) * group]
        assert (np.abs(block.astype(int)).max(axis=1) == 127).all()
    # round to nearest: each weight within half its scale
    err = np.abs(naive.dequantize_int8(qm.q, qm.scales, group) - w)
    half = 0.5 * naive.dequantize_int8(np.ones_like(qm.q), qm.scales, group)
    assert (err <= half * (1 + 1e-6) + 1e-30).all()
    np.testing.assert_allclose(qm.dequantize(), naive.dequantize_int8(qm.q, qm.scales, group),
                               rtol=1e-7)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans", [True, False])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (1, 100, 70), (1, KC + 70, 2 * NR + 3),
                                   (2, 64, 32), (9, 100, 70), (17, KC + 70, 3 * NR + 5),
                                   (33, 2 * KC + 1, NR - 1)])
def test_gemm_q_matches_float64_twin(m, k, n, trans, threads):
    qm = quantize(stored(k, n, trans))
    qb = pack_q(qm, trans=trans)
    assert (qb.k, qb.n, qb.per_col) == (k, n, trans)
    a = rand(m, k)
    b = twin(qm, trans)
    got, ref = gemm_q(a, qb, threads=threads), naive.gemm(a, b)
    if m == 1:  # the GeMV rounds x to int16 where config.INT_DOT allows: its bound (below)
        tol = (activation_bound(a[0], qm, trans) * 1.0001
               + 1e-5 * np.sqrt(k) * (np.abs(a.astype(np.float64)) @ np.abs(b)))
        assert (np.abs(got - ref) <= tol).all()
    else:
        assert_gemm_close(got, ref, a, b, k)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 10])
@pytest.mark.parametrize("bias,gelu,residual", [(True, False, False), (True, True, False),
                                                (False, False, True), (True, True, True)])
def test_gemm_q_epilogues(m, bias, gelu, residual, threads):
    k, n = 130, 75
    qm = quantize(rand(n, k))
    a, b = rand(m, k), twin(qm, True)
    bv = rand(n) if bias else None
    rv = rand(m, n) if residual else None
    got = gemm_q(a, pack_q(qm, trans=True), bias=bv, gelu=gelu, residual=rv, threads=threads)
    ref = naive.gemm(a, b, bv, gelu, rv)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("m", [1, 6])
def test_gemm_q_views_in_and_out(m):
    """A row slice of a bigger A, C into a column block of a fused buffer."""
    k, n = 96, 40
    qm = quantize(rand(k, n))
    big_a = rand(m + 3, k + 8)
    a = big_a[2:2 + m, 4:4 + k]
    buf = np.zeros((m, 3 * n), np.float32)
    gemm_q(a, pack_q(qm), out=buf[:, n:2 * n])
    b = twin(qm, False)
    assert_gemm_close(buf[:, n:2 * n], naive.gemm(a, b), a, b, k)
    assert not buf[:, :n].any() and not buf[:, 2 * n:].any()


@pytest.mark.parametrize("trans", [True, False])
@pytest.mark.parametrize("m", [1, 16])
def test_int8_product_error_against_float_weights(m, trans):
    """What int8 costs: within the rounding bound everywhere, and < 1% of the product."""
    k, n = 384, 200
    w = stored(k, n, trans)
    qm = quantize(w)
    a = rand(m, k)
    exact = naive.gemm(a, as_b(w, trans))
    got = gemm_q(a, pack_q(qm, trans=trans)).astype(np.float64)
    half_scale = 0.5 * as_b(naive.dequantize_int8(np.ones_like(qm.q), qm.scales, GROUP), trans)
    bound = np.abs(a.astype(np.float64)) @ half_scale
    assert (np.abs(got - exact) <= bound * 1.001 + 1e-4).all()
    rel = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert rel < 0.01, f"int8 product relative error {rel:.4f}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 5])
def test_ffn_any_int8_and_float(m, threads):
    """GeLU(x up + b) down: int8 weights through gemm_q twice, float ones through K.ffn."""
    c, f = 72, 150
    up, down, b = rand(f, c), rand(f, c), rand(f)  # stored [F, C] both, as BERT's
    x = rand(m, c)
    up_q, down_q = quantize(up), quantize(down)
    got = ffn_any(x, pack_weight(up_q, trans=True), b, pack_weight(down_q), threads=threads)
    h = naive.gemm(x, twin(up_q, True), b, gelu=True)
    ref = naive.gemm(h, twin(down_q, False))
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    up_f, down_f = pack_weight(up, trans=True), pack_weight(down)
    assert isinstance(up_f, PackedB)
    np.testing.assert_array_equal(ffn_any(x, up_f, b, down_f, threads=threads),
                                  ffn(x, up_f, b, down_f, threads=threads))
    np.testing.assert_array_equal(gemm_any(x, up_f, bias=b),
                                  gemm_any(x, pack_b(up, trans=True), bias=b))


def test_quant_matrix_concat_keeps_rows_and_groups():
    parts = [quantize(rand(r, 100)) for r in (3, 5)]
    joined = QuantMatrix.concat(parts)
    np.testing.assert_array_equal(joined.dequantize(),
                                  np.concatenate([p.dequantize() for p in parts]))
    assert joined.nbytes == 8 * 100 + 8 * 2 * 4


def test_int8_rejects_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        quantize(rand(3, 10), group=48)
    with pytest.raises(ValueError, match="power of two"):
        quantize(rand(3, 10), group=16)
    with pytest.raises(TypeError, match="float32"):
        quantize(rand(3, 10).astype(np.float64))
    with pytest.raises(TypeError, match="QuantMatrix"):
        pack_q(rand(3, 10))
    qb = pack_q(quantize(rand(10, 20)), trans=True)
    assert isinstance(qb, QuantB)
    with pytest.raises(ValueError, match="K=20"):
        gemm_q(rand(2, 19), qb)
    with pytest.raises(TypeError, match="QuantB"):
        gemm_q(rand(2, 20), pack_b(rand(20, 10)))
    with pytest.raises(ValueError, match="scales must be"):
        QuantMatrix(np.zeros((2, 70), np.int8), np.zeros((2, 1), np.float32), 64)


@pytest.mark.parametrize("v,c", [(100, 64), (37, 130), (64, 576)])
def test_columns_any_reads_a_packed_head_back_as_embedding_rows(v, c):
    """A tied head is the embedding packed (B = emb.T): its columns are the embedding's rows,
    exactly, float32 or int8 (groups along K, as the head is packed; or along N)."""
    e = np.random.default_rng(v).standard_normal((v, c)).astype(np.float32)
    ids = np.array([0, v - 1, 5, 33 % v, 5])
    assert np.array_equal(columns_any(pack_weight(e, trans=True), ids), e[ids])
    q = quantize(e)
    assert np.array_equal(columns_any(pack_weight(q, trans=True), ids), q.dequantize()[ids])
    if v % 64 == 0:  # groups along N: a scale per k row of each panel
        qn = quantize(np.ascontiguousarray(e.T))
        np.testing.assert_array_equal(columns_any(pack_weight(qn), ids),
                                      qn.dequantize()[:, ids].T)
    with pytest.raises(IndexError):
        columns_any(pack_weight(e, trans=True), [v])


# --- the integer GeMV ----------------------------------------------------------------------

LEVELS = [lv for lv in range(len(config.INT_DOT_NAMES)) if lv <= config.host_int_dot()]


@pytest.fixture(params=LEVELS, ids=[config.INT_DOT_NAMES[lv] for lv in LEVELS])
def int_dot(request, monkeypatch):
    """Each integer-dot level this CPU runs (0: the float fallback), set for the test."""
    monkeypatch.setattr(config, "INT_DOT", request.param)
    return request.param


def test_pack_q_layout_is_k_interleaved_and_zero_padded():
    k, n = 10, 40
    qm = quantize(rand(k, n), 32)
    qb = pack_q(qm)
    assert qb.q.shape == (2, 3, NR, 4) and (qb.k, qb.n) == (k, n)
    full = np.zeros((2 * NR, 12), np.int8)  # [column, k] padded
    full[:n, :k] = qm.q.T
    for jp in range(2):
        for p in range(12):
            np.testing.assert_array_equal(qb.q[jp, p // 4, :, p % 4], full[jp * NR:(jp + 1) * NR, p])
    np.testing.assert_array_equal(qb.q32.view(np.int8).reshape(qb.q.shape), qb.q)


def test_quantize_x16_rounds_each_block_to_nearest():
    x = rand(150) * 3
    x[64:128] = 0.0  # a block of zeros: scale 0, values 0
    x[5] = 40.0  # a peak sets its block's step alone
    xq, sx = quantize_x16(x, 64)
    assert xq.shape == (152,) and sx.shape == (3,) and not xq[150:].any()
    assert sx[1] == 0 and not xq[64:128].any()
    np.testing.assert_allclose(sx, [40.0 / XQMAX, 0.0, np.abs(x[128:]).max() / XQMAX], rtol=1e-6)
    step = np.repeat(sx, 64)[:150].astype(np.float64)
    assert (np.abs(xq[:150] * step - x) <= 0.5 * step * (1 + 1e-5) + 1e-30).all()
    assert np.abs(xq).max() == XQMAX


def gemv_twin_same_arithmetic(x, qm):
    """float64 x @ B the way the integer GeMV computes it for groups along K (B stored [N, K]):
    its int16 row, exact integer sums per group, then sx[g] * scale[j, g] * sum."""
    g = qm.group
    k = qm.q.shape[1]
    xq, sx = quantize_x16(x, g)
    out = np.zeros(qm.q.shape[0])
    terms = np.zeros(qm.q.shape[0])  # sum of |term|, for the rounding tolerance
    for gi in range(sx.shape[0]):
        sl = slice(gi * g, min(k, (gi + 1) * g))
        isum = qm.q[:, sl].astype(np.int64) @ xq[sl].astype(np.int64)  # exact
        term = float(sx[gi]) * qm.scales[:, gi].astype(np.float64) * isum
        out += term
        terms += np.abs(term)
    return out, terms, sx.shape[0]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("k,n,group", [(1, 1, 64), (100, 70, 64), (576, 96, 64), (333, 45, 32),
                                       (KC + 70, 2 * NR + 3, 64), (700, 33, 256)])
def test_gemv_matches_twin_of_its_arithmetic(k, n, group, threads, int_dot):
    """Groups along K: the integer kernels equal their float64 twin to float32 rounding (the
    sums are exact; float32 rounds the scale products and the sum over groups)."""
    qm = quantize(rand(n, k), group)
    x = rand(1, k)
    got = gemm_q(x, pack_q(qm, trans=True), threads=threads)[0].astype(np.float64)
    if int_dot:
        twin64, terms, n_groups = gemv_twin_same_arithmetic(x[0], qm)
        tol = (n_groups + 3) * 2.0 ** -22 * terms + 1e-30
        assert (np.abs(got - twin64) <= tol).all(), np.abs(got - twin64).max()
    else:  # the float path: x unquantised, float32 rounding only
        b = twin(qm, True)
        assert_gemm_close(got[None, :], naive.gemm(x, b), x, b, k)


def activation_bound(x, qm, trans):
    """Elementwise bound on |x @ B - gemv| from the int16 activations (module docstring)."""
    q = np.abs(as_b(qm.q, trans).astype(np.float64))  # [K, N]
    k, n = q.shape
    x64 = x.astype(np.float64)
    if trans:  # groups along K: sx per group from x alone, the step times |q * scale|
        wabs = np.abs(twin(qm, True))
        sx = np.array([np.abs(x64[i:i + qm.group]).max() / XQMAX for i in range(0, k, qm.group)])
        return (0.5 * np.repeat(sx, qm.group)[:k]) @ wabs
    # groups along N: x' = x * the row's scale, stepped per XQ_BLOCK of k and column group
    s = np.repeat(qm.scales.astype(np.float64), qm.group, axis=1)[:, :n]  # [K, N]
    xs = np.abs(x64[:, None] * s)
    bound = np.zeros(n)
    for i in range(0, k, XQ_BLOCK):
        step = xs[i:i + XQ_BLOCK].max(axis=0) / XQMAX  # [N]
        bound += 0.5 * step * q[i:i + XQ_BLOCK].sum(axis=0)
    return bound


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("trans", [True, False])
@pytest.mark.parametrize("k,n,group", [(1, 1, 32), (100, 70, 64), (1536, 96, 32),
                                       (KC + 70, 2 * NR + 3, 64), (333, 45, 32), (130, 64, 64)])
def test_gemv_within_activation_rounding_of_float64(k, n, group, trans, threads, int_dot):
    """Every level, both scale cases, odd shapes: within the int16 rounding bound of the
    float64 product with the int8 weights (0 for the float path) plus float32 rounding."""
    qm = quantize(stored(k, n, trans), group)
    x = rand(1, k)
    x[0, k // 2] *= 300.0  # a massive activation, as a decoder's down sees
    got = gemm_q(x, pack_q(qm, trans=trans), threads=threads).astype(np.float64)
    b = twin(qm, trans)
    ref = naive.gemm(x, b)
    bound = activation_bound(x[0], qm, trans) if int_dot else 0.0
    float_tol = 1e-5 * np.sqrt(k) * (np.abs(x.astype(np.float64)) @ np.abs(b))
    assert (np.abs(got - ref) <= bound * 1.0001 + float_tol + 1e-30).all()


def test_int_dot_setting_from_the_environment(monkeypatch):
    host = config.host_int_dot()
    for value, want in [("0", 0), ("float", 0), ("avx2", min(1, host)), ("2", host), ("", host),
                        ("avx512_vnni", min(2, host))]:
        monkeypatch.setenv("HEPTI_INT_DOT", value)
        assert config._int_dot_setting() == want
    monkeypatch.setenv("HEPTI_INT_DOT", "sse9")
    with pytest.raises(ValueError, match="HEPTI_INT_DOT"):
        config._int_dot_setting()
    monkeypatch.setattr(config, "INT_DOT", 2)
    from hepti.kernels import int8
    assert int8.int_dot_level() == min(2, host)


@njit(cache=True)
def _isum(tag, out, w, w_off, xq, x_off, nquads):
    isum_i16(tag, out, w, w_off, xq, x_off, nquads)


@pytest.mark.parametrize("level", [lv for lv in LEVELS if lv > 0])
@pytest.mark.parametrize("nquads", [1, 2, 3, 16, 64])
def test_isum_i16_equals_exact_integer_sums(level, nquads):
    """The intrinsic's int32 sums of int16 x int8 products equal int64 ones exactly, at the
    extremes too (|x| = 32767, |w| = 127 over 256 k, the longest block the GeMV uses)."""
    rng = np.random.default_rng(nquads)
    w = rng.integers(-127, 128, size=(3, nquads, NR, 4)).astype(np.int8)
    xq = rng.integers(-32767, 32768, size=4 * nquads + 8).astype(np.int16)
    if nquads == 64:
        w[1] = 127 * np.where(rng.random((nquads, NR, 4)) < 0.5, -1, 1)
        xq[8:] = 32767 * np.sign(w[1, :, 0, :].reshape(-1)).astype(np.int16)
    out = np.zeros(NR, np.int32)
    _isum(isa_tag(level), out, w.reshape(-1), nquads * NR * 4, xq, 8, nquads)
    want = np.einsum("qjt,qt->j", w[1].astype(np.int64), xq[8:].reshape(nquads, 4).astype(np.int64))
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("trans", [True, False])
@pytest.mark.parametrize("k", [4, 130, 203])
def test_dequant_widens_panels_exactly(k, trans):
    """The GeMM's dequantisation (whole quads by a byte shuffle, the last rows by shifts) gives
    exactly q * scale in float32, as QuantMatrix.dequantize does, from any quad-aligned k0."""
    from hepti.kernels.int8 import _dequant
    n = 2 * NR + 5
    qm = quantize(stored(k, n, trans), 64)
    qb = pack_q(qm, trans=trans)
    b = as_b(qm.dequantize(), trans)  # float32 [K, N]
    for jp in range(qb.q.shape[0]):
        for k0 in (0, 4 * (k // 8)):
            kc = k - k0
            buf = np.full((kc, NR), np.nan, np.float32)
            _dequant(qb.q32[jp], qb.scales[jp], qb.per_col, qb.group, k0, kc, buf)
            cols = min(NR, n - jp * NR)
            np.testing.assert_array_equal(buf[:, :cols], b[k0:, jp * NR:jp * NR + cols])
            assert not buf[:, cols:].any()
