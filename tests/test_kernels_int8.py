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
"""
from __future__ import annotations

import numpy as np
import pytest

from hepti.kernels import (PackedB, QuantB, QuantMatrix, columns_any, config, ffn, ffn_any,
                           gemm_any, gemm_q, naive, pack_b, pack_q, pack_weight, quantize)
from hepti.kernels.int8 import GROUP
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
    assert_gemm_close(gemm_q(a, qb, threads=threads), naive.gemm(a, b), a, b, k)


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
