"""Every Numba kernel against its plain-numpy reference (hepti.kernels.naive, float64).

Shapes are chosen to hit the edges of the blocking: 1x1, one row, primes, K past one k-block
(KC) and N past one panel (NR) without being multiples of them, M not a multiple of MR. Inputs
are also given as views (row slices, column blocks of a fused buffer) and outputs as column
blocks of a bigger buffer. Tolerance: 1e-5 * sqrt(K) relative to sum_k |a_ik| |b_kj|.
"""
from __future__ import annotations

import math

import numba
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hepti.kernels import (EncoderLayer, PackedB, add_layernorm, attention, attention_block,
                           attention_qkv, config, encoder_layers,
                           embed_layernorm, ffn, gemm, layernorm, matmul, naive, pack_b, rms_norm,
                           softmax_rows)
from hepti.kernels import _gen_microkernels
from hepti.kernels.norm import add_layernorm_rows

RNG = np.random.default_rng(20240601)
KC, MR, NR = config.KC, config.MR, config.NR


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


def assert_gemm_close(c, ref, a, b, k):
    """|c - ref| <= 1e-5 * sqrt(K) * (|a| @ |b|) elementwise (plus a tiny floor)."""
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    tol = 1e-5 * math.sqrt(max(k, 1)) * scale + 1e-30
    err = np.abs(c.astype(np.float64) - ref)
    worst = np.unravel_index(np.argmax(err - tol), err.shape) if err.size else ()
    assert np.all(err <= tol), f"max error {err[worst]} > tol {tol[worst]} at {worst}"


def test_generated_microkernels_are_current():
    """_microkernels.py on disk is what the generator writes for config's MR and NR."""
    assert _gen_microkernels.TARGET.read_text() == _gen_microkernels.source(), \
        "run: python src/hepti/kernels/_gen_microkernels.py"


# --- GeMM -------------------------------------------------------------------------------------

SHAPES = [
    (1, 1, 1), (1, 384, 1536), (7, 13, 17), (MR, KC, NR), (MR + 1, KC + 1, NR + 1),
    (3 * MR - 1, 2 * KC + 37, 3 * NR - 5), (127, 383, 1531), (64, 100, 200), (2, 5, 3),
]


@pytest.mark.parametrize("m,k,n", SHAPES)
def test_matmul_shapes(m, k, n):
    a, b = rand(m, k), rand(k, n)
    assert_gemm_close(matmul(a, b), naive.gemm(a, b), a, b, k)


@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_several_groups_and_kblocks(threads):
    """matmul packs B a group of panels per k-block: N spanning more than two groups with a
    partial last panel, K spanning two k-blocks, M with a short last tile."""
    from hepti.kernels.packed_gemm import otf_group
    m, k, n = MR + 3, KC + 5, 2 * otf_group(KC) * NR + 17
    a, b = rand(m, k), rand(k, n)
    assert_gemm_close(matmul(a, b, threads=threads), naive.gemm(a, b), a, b, k)


def test_matmul_single_row_views():
    """One row of A (the direct GEMV path) from a column block, B and out as column blocks."""
    k, n = 70, 45
    a = rand(3, 2 * k)[1:2, k:]
    big_b = rand(k, 3 * n)
    b = big_b[:, n:2 * n]
    big_out = np.full((2, 2 * n), 7.0, np.float32)
    out = big_out[1:2, :n]
    assert matmul(a, b, out=out) is out
    assert_gemm_close(out, naive.gemm(a, b), a, b, k)
    assert np.all(big_out[0] == 7.0) and np.all(big_out[1, n:] == 7.0)


@pytest.mark.parametrize("m,k,n", SHAPES)
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_packed_both_orientations(m, k, n, trans, threads):
    a, b = rand(m, k), rand(k, n)
    pb = pack_b(np.ascontiguousarray(b.T), trans=True) if trans else pack_b(b)
    assert (pb.k, pb.n) == (k, n)
    assert pb.nbytes == -(-n // NR) * k * NR * 4
    assert_gemm_close(gemm(a, pb, threads=threads), naive.gemm(a, b), a, b, k)


@pytest.mark.parametrize("n", [4 * NR, 5 * NR - 3, 6 * NR + 1, 7 * NR, 11 * NR - 1])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_single_row_panel_groups(n, threads):
    """One row against a pre-packed B walks four panels side by side (`_gemv_panels`): panel
    counts that leave 0 to 3 panels over (per thread too), a partial last panel, and out as a
    column block of a bigger buffer, which keeps its other values."""
    k = KC + 3
    a, b = rand(1, k), rand(k, n)
    big_out = np.full((2, n + 9), 7.0, np.float32)
    out = big_out[1:2, 4:4 + n]
    assert gemm(a, pack_b(b), out=out, threads=threads) is out
    assert_gemm_close(out, naive.gemm(a, b), a, b, k)
    assert np.all(big_out[0] == 7.0) and np.all(big_out[1, :4] == 7.0)
    assert np.all(big_out[1, 4 + n:] == 7.0)


def test_pack_orientations_give_identical_panels():
    n = NR + 13
    b = rand(70, n)
    assert np.array_equal(pack_b(b).panels, pack_b(np.ascontiguousarray(b.T), trans=True).panels)
    panels = pack_b(b).panels  # [2, 70, NR]
    assert np.array_equal(panels[0], b[:, :NR])
    assert np.array_equal(panels[1, :, :13], b[:, NR:])
    assert np.all(panels[1, :, 13:] == 0.0)  # zero padding past N


def test_pack_b_read_only_weights():
    """Weights mapped read-only from a file pack like any others."""
    b = rand(40, 50)
    ro = b.copy()
    ro.flags.writeable = False
    ro_t = np.ascontiguousarray(b.T)
    ro_t.flags.writeable = False
    assert np.array_equal(pack_b(ro).panels, pack_b(b).panels)
    assert np.array_equal(pack_b(ro_t, trans=True).panels, pack_b(b).panels)


@pytest.mark.parametrize("bias,gelu,residual", [
    (True, False, False), (False, True, False), (False, False, True), (True, True, False),
    (True, False, True), (True, True, True),
])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (37, 300, 70), (16, 64, 64)])
@pytest.mark.parametrize("threads", [1, 2])
def test_gemm_epilogues(m, k, n, bias, gelu, residual, threads):
    a, b = rand(m, k), rand(k, n)
    bv = rand(n) if bias else None
    rv = rand(m, n) if residual else None
    c = gemm(a, pack_b(b), bias=bv, gelu=gelu, residual=rv, threads=threads)
    ref = naive.gemm(a, b, bv, gelu, rv)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b) + (np.abs(bv) if bias else 0)
    tol = 1e-5 * math.sqrt(k) * scale + (np.abs(rv) * 1e-6 if residual else 0) + 1e-6
    assert np.all(np.abs(c - ref) <= tol)


@pytest.mark.parametrize("bias,gelu,residual", [
    (True, False, False), (False, True, False), (False, False, True), (True, True, True),
])
def test_epilogue_of_a_full_strip_equals_the_general_one(bias, gelu, residual):
    """epilogue_strip (generated: a full strip's rows in named scalars) gives bit for bit what
    _epilogue's loops give, for each part of the epilogue, on a strip inside a wider C."""
    from hepti.kernels._microkernels import epilogue_strip
    from hepti.kernels.packed_gemm import _epilogue
    m, n, j0 = 19, 3 * NR, NR
    c = rand(m, n).reshape(-1)
    b, r = rand(n), rand(m, n).reshape(-1)
    epi = (b, bias, gelu, r if residual else c[:0], j0, n, residual)
    want, got = c.copy(), c.copy()
    _epilogue(want, j0, n, m, NR, j0, epi)
    epilogue_strip(got, j0, n, m, j0, epi)
    assert np.array_equal(got, want)
    assert np.array_equal(got.reshape(m, n)[:, NR + NR:], c.reshape(m, n)[:, 2 * NR:])


def test_gemm_views_in_and_out():
    """a as a row slice and as a column block, out as a column block of a bigger buffer."""
    m, k, n = 45, 130, 70
    big_a = rand(m + 10, 3 * k)
    a = big_a[5:5 + m, k:2 * k]  # rows contiguous, row stride 3k
    b = rand(k, n)
    res_big = rand(m, 2 * n)
    residual = res_big[:, n:]
    big_out = np.full((m, 3 * n), 7.0, np.float32)
    out = big_out[:, n:2 * n]
    bias = rand(n)
    c = gemm(a, pack_b(b), bias=bias, residual=residual, out=out, threads=2)
    assert c is out
    assert_gemm_close(out, naive.gemm(a, b, bias, False, residual), a, b, k + 2)
    assert np.all(big_out[:, :n] == 7.0) and np.all(big_out[:, 2 * n:] == 7.0)
    out2 = big_out[:, 2 * n:]
    matmul(a, b, out=out2)
    assert_gemm_close(out2, naive.gemm(a, b), a, b, k)


def test_gemm_k_zero_and_empty():
    a, b = np.zeros((3, 0), np.float32), np.zeros((0, 4), np.float32)
    assert np.array_equal(matmul(a, b), np.zeros((3, 4), np.float32))
    bias = rand(4)
    assert np.allclose(gemm(a, pack_b(b), bias=bias), np.broadcast_to(bias, (3, 4)))
    assert matmul(np.zeros((0, 5), np.float32), rand(5, 4)).shape == (0, 4)


def test_gemm_rejects_bad_arguments():
    a, b = rand(4, 5), rand(5, 6)
    pb = pack_b(b)
    with pytest.raises(TypeError, match="float32"):
        gemm(a.astype(np.float64), pb)
    with pytest.raises(ValueError, match="columns"):
        gemm(rand(4, 6), pb)
    with pytest.raises(ValueError, match="shape"):
        gemm(a, pb, out=np.empty((4, 5), np.float32))
    with pytest.raises(ValueError, match="overlaps"):
        r = rand(4, 6)
        gemm(a, pb, residual=r, out=r)
    with pytest.raises(ValueError, match="contiguous rows"):
        matmul(np.asfortranarray(rand(4, 5)), b)
    with pytest.raises(TypeError, match="PackedB"):
        gemm(a, b)
    assert isinstance(pb, PackedB)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 300), n=st.integers(1, 100),
       bias=st.booleans(), gelu=st.booleans(), threads=st.sampled_from([1, 2]))
def test_gemm_random_shapes(m, k, n, bias, gelu, threads):
    a, b = rand(m, k), rand(k, n)
    bv = rand(n) if bias else None
    c = gemm(a, pack_b(b), bias=bv, gelu=gelu, threads=threads)
    ref = naive.gemm(a, b, bv, gelu)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b) + (np.abs(bv) if bias else 0)
    assert np.all(np.abs(c - ref) <= 1e-5 * math.sqrt(k) * scale + 1e-6)
    assert_gemm_close(matmul(a, b, threads=threads), naive.gemm(a, b), a, b, k)


# --- elementwise math -------------------------------------------------------------------------


def test_gelu_matches_erf_form():
    """The erf approximation stays within a few float32 ulps of the exact erf GeLU."""
    x = np.linspace(-12, 12, 100_001).astype(np.float32)[None, :]
    eye = pack_b(np.eye(1, dtype=np.float32))
    y = gemm(x.T.copy(), eye, gelu=True)[:, 0]  # GeLU through the real epilogue
    ref = naive.gemm(x.T, np.eye(1), gelu=True)[:, 0]
    assert np.max(np.abs(y - ref)) < 2e-6
    # full NR-column panels of full MR-row tiles: the GeLU of the IR register tile (_gemm_ir)
    xm = np.linspace(-12, 12, 3200 * NR).astype(np.float32).reshape(3200, NR)
    ym = gemm(xm, pack_b(np.eye(NR, dtype=np.float32)), gelu=True)
    refm = naive.gemm(xm, np.eye(NR), gelu=True)
    assert np.max(np.abs(ym - refm)) < 2e-6


# --- LayerNorm --------------------------------------------------------------------------------


@pytest.mark.parametrize("m,c", [(1, 1), (3, 7), (17, 384), (5, 1000)])
def test_layernorm(m, c):
    x, g, b = rand(m, c) * 3 + 1, rand(c), rand(c)
    np.testing.assert_allclose(layernorm(x, g, b, 1e-12), naive.layernorm(x, g, b, 1e-12),
                               rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("m,c", [(1, 576), (7, 33), (65, 2048)])
def test_rms_norm(m, c):
    """Against the float64 twin; rows of a bigger array and in place."""
    x, g = rand(m, c) * 3 + 1, rand(c)
    np.testing.assert_allclose(rms_norm(x, g, 1e-5), naive.rms_norm(x, g, 1e-5), rtol=1e-5,
                               atol=2e-5)
    big = rand(m, c + 5)
    view, ref = big[:, 2:2 + c], naive.rms_norm(big[:, 2:2 + c], g, 1e-5)
    assert rms_norm(view, g, 1e-5, out=view) is view
    np.testing.assert_allclose(view, ref, rtol=1e-5, atol=2e-5)


@pytest.mark.parametrize("with_bias,with_res", [(True, True), (False, True), (True, False)])
def test_add_layernorm_and_in_place(with_bias, with_res):
    m, c = 9, 96
    x, g, b = rand(m, c), rand(c), rand(c)
    bias = rand(c) if with_bias else None
    res = rand(m, c) if with_res else None
    ref = naive.add_layernorm(x, bias, res, g, b, 1e-5)
    np.testing.assert_allclose(add_layernorm(x, bias, res, g, b, 1e-5), ref, rtol=1e-5,
                               atol=2e-5)
    x2 = x.copy()
    add_layernorm(x2, bias, res, g, b, 1e-5, out=x2)
    np.testing.assert_allclose(x2, ref, rtol=1e-5, atol=2e-5)
    big = rand(m + 2, 2 * c)  # input and output as strided views
    big[1:1 + m, c:] = x
    out_big = np.zeros((m, 3 * c), np.float32)
    add_layernorm(big[1:1 + m, c:], bias, res, g, b, 1e-5, out=out_big[:, c:2 * c])
    np.testing.assert_allclose(out_big[:, c:2 * c], ref, rtol=1e-5, atol=2e-5)
    assert not out_big[:, :c].any() and not out_big[:, 2 * c:].any()


@pytest.mark.parametrize("with_bias,with_res", [(True, True), (False, True), (True, False),
                                               (False, False)])
def test_add_layernorm_rows_is_add_layernorm(with_bias, with_res):
    """The interpreter's entry (shapes and rows checked only) gives add_layernorm's floats, up
    to the order of the row sums, and hands anything it does not take (strided rows, no rows)
    to add_layernorm (the very same floats).

    Not bit for bit in the first case: `_add_ln_rows` calls `_add_layernorm`, and the sums may
    reassociate (FASTMATH_ROWS), so LLVM may vectorise them differently where it inlines the
    callee. Whether it does depends on how the code was made: compiled afresh in the process
    the two agreed; loaded from Numba's cache, 138 of 864 floats differed by an ulp or two
    (2026-11-30, this test failing in a warm tree and passing with an empty NUMBA_CACHE_DIR)."""
    m, c = 9, 96
    x, g, b = rand(m, c), rand(c), rand(c)
    bias = rand(c) if with_bias else None
    res = rand(m, c) if with_res else None
    np.testing.assert_allclose(add_layernorm_rows(x, bias, res, g, b, 1e-5),
                               add_layernorm(x, bias, res, g, b, 1e-5), rtol=2e-6, atol=2e-6)
    big = rand(m, 2 * c)
    np.testing.assert_array_equal(add_layernorm_rows(big[:, c:], bias, res, g, b, 1e-5),
                                  add_layernorm(big[:, c:], bias, res, g, b, 1e-5))
    assert add_layernorm_rows(x[:0], bias, None, g, b, 1e-5).shape == (0, c)
    with pytest.raises(ValueError, match="gamma"):
        add_layernorm_rows(x, bias, res, g[:-1], b, 1e-5)


# --- softmax ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [1, 5, 16, 37, 128, 300])
def test_softmax_rows_with_padding(n):
    x = rand(6, n) * 4
    mask = (RNG.random(n) > 0.3).astype(np.float32)
    mask[0] = 1.0
    y = softmax_rows(x, mask, scale=0.125)
    np.testing.assert_allclose(y, naive.softmax_rows(x, mask, 0.125), rtol=1e-5, atol=1e-7)
    assert np.all(y[:, mask == 0] == 0.0)
    np.testing.assert_allclose(y.sum(axis=1), 1.0, rtol=1e-5)


def test_softmax_rows_edge_cases():
    x = rand(3, 20)
    np.testing.assert_allclose(softmax_rows(x), naive.softmax_rows(x), rtol=1e-5, atol=1e-7)
    all_masked = softmax_rows(x, np.zeros(20, np.float32))  # HF: uniform
    np.testing.assert_allclose(all_masked, 1 / 20, rtol=1e-5)
    big = np.full((1, 4), 80.0, np.float32)
    big[0, 0] = 200.0  # needs the max subtraction
    np.testing.assert_allclose(softmax_rows(big), naive.softmax_rows(big), atol=1e-7)
    x2 = x.copy()
    assert softmax_rows(x2, out=x2) is x2
    np.testing.assert_allclose(x2, naive.softmax_rows(x), rtol=1e-5, atol=1e-7)


# --- attention --------------------------------------------------------------------------------


def attention_case(n_seq, t, h, d, pad):
    """Fused QKV [B*T, 3*H*D] and a key mask whose sequence b has `pad[b]` padded keys."""
    qkv = rand(n_seq * t, 3 * h * d)
    mask = np.ones((n_seq, t), np.float32)
    for b, p in enumerate(pad):
        if p:
            mask[b, t - p:] = 0.0
    hd = h * d
    return qkv[:, :hd], qkv[:, hd:2 * hd], qkv[:, 2 * hd:], mask


@pytest.mark.parametrize("n_seq,t,h,d,pad", [
    (1, 1, 1, 1, [0]), (2, 7, 3, 5, [0, 3]), (2, 50, 2, 48, [10, 0]), (3, 33, 4, 32, [0, 5, 32]),
    (1, 128, 12, 32, [40]), (1, 70, 2, 64, [0]),
])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_fused_qkv(n_seq, t, h, d, pad, threads):
    """q, k, v are column blocks of one fused QKV output (row stride 3*H*D), with padding."""
    q, k, v, mask = attention_case(n_seq, t, h, d, pad)
    ctx = attention(q, k, v, mask, h, threads=threads)
    np.testing.assert_allclose(ctx, naive.attention(q, k, v, mask, h), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("row0,mq", [(0, 1), (5, 10), (30, 20), (39, 1), (0, 120), (37, 83)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_row_ranges(row0, mq, threads):
    """A rank's query rows start anywhere and may span sequences (T = 40 here)."""
    n_seq, t, h, d = 3, 40, 2, 16
    q, k, v, mask = attention_case(n_seq, t, h, d, [0, 7, 39])
    ref = naive.attention(q, k, v, mask, h)
    big_out = np.full((mq, 3 * h * d), 3.0, np.float32)
    out = big_out[:, h * d:2 * h * d]  # output as a column block of a bigger buffer
    ctx = attention(q[row0:row0 + mq], k, v, mask, h, row0=row0, out=out, threads=threads)
    assert ctx is out
    np.testing.assert_allclose(out, ref[row0:row0 + mq], rtol=1e-4, atol=1e-5)
    assert np.all(big_out[:, :h * d] == 3.0) and np.all(big_out[:, 2 * h * d:] == 3.0)


def _softmax_panels():
    from hepti.kernels import _softmax_ir
    from hepti.kernels._microkernels import softmax_panel
    panels = {"generated": softmax_panel}
    if NR == _softmax_ir.NR and MR == 8:
        ir_panel = _softmax_ir.softmax_panel8

        @numba.njit
        def call_ir(st, t, mask, scale, ap, tq0, tot):  # an intrinsic runs inside njit only
            ir_panel(st, t, mask, scale, ap, tq0, tot)

        panels["ir"] = call_ir
        shift_panel = _softmax_ir.softmax_panel8_shift

        @numba.njit
        def call_shift(st, t, mask, scale, ap, tq0, tot):  # without vscalefps (AVX2's form)
            shift_panel(st, t, mask, scale, ap, tq0, tot)

        panels["ir-shift"] = call_shift
    return panels


@pytest.mark.parametrize("panel", ["generated", "ir", "ir-shift"])
@pytest.mark.parametrize("t,masked,scale", [
    (1, "some", 1 / math.sqrt(32)), (9, "some", 1 / math.sqrt(32)),
    (37, "some", 1 / math.sqrt(32)), (128, "none", 1 / math.sqrt(32)),
    (37, "all", 1 / math.sqrt(32)), (9, "half", 1 / math.sqrt(32)), (37, "some", -0.3),
])
def test_softmax_panel_against_the_reference(panel, t, masked, scale):
    """softmax_panel (generated: maxima and sums in registers, e written into P's tiles; or
    the IR panel of _softmax_ir, base-2 exp) gives the float64 softmax of each query's column,
    padded keys included (every key padded: the softmax of equal scores, HF's result), and
    writes only the panel's own tiles. A negative scale takes the IR panel's general pass."""
    fn = _softmax_panels().get(panel)
    if fn is None:
        pytest.skip(f"no IR panel for NR = {NR}, MR = {MR}")
    st = rand(t, NR).reshape(-1) * np.float32(4.0)
    mask = np.ones(t, np.float32)
    if masked == "some":
        mask[t // 2::3] = 0.0
    elif masked == "all":
        mask[:] = 0.0
    elif masked == "half":
        mask[::2] = 0.5  # a fractional mask value: a finite, very negative add
    scale = np.float32(scale)
    ap1 = np.zeros((2 * NR // MR, t, MR), np.float32)
    tot1 = np.zeros(NR, np.float32)
    fn(st.copy(), t, mask, scale, ap1, NR // MR, tot1)
    assert not ap1[:NR // MR].any()  # only the panel's own tiles are written
    e = ap1[NR // MR:].transpose(1, 0, 2).reshape(t, NR)  # [key, query]
    add = ((1 - mask) * np.finfo(np.float32).min).astype(np.float32)
    ref = naive.softmax_rows(st.reshape(t, NR).T * scale + add)
    np.testing.assert_allclose(e / tot1, ref.T, rtol=1e-5, atol=1e-7)
    if masked == "some" and t > 1:
        assert not e[mask == 0].any()  # padded keys' e is exactly 0


@pytest.mark.parametrize("scalef", [True, False])
def test_exp2_of_the_ir_softmax_against_float64(scalef):
    """The IR panel's 2**y (its numpy transcription, in either form: 2**n by vscalefps or by
    shifting n's bits) is within 2 ulp of 2**y for y in [-126, 0], exactly 1 at 0, and 0 for
    a masked row's y far below (-152 and lower, -inf included)."""
    from hepti.kernels._softmax_ir import exp2_nonpos_ref
    y = -np.linspace(0.0, 126.0, 400_001).astype(np.float32)
    ref = np.exp2(y.astype(np.float64))
    rel = np.abs(exp2_nonpos_ref(y, scalef) - ref) / ref
    assert rel.max() < 2 * 2.0 ** -23
    assert exp2_nonpos_ref(np.float32([0.0]), scalef)[0] == 1.0
    assert not exp2_nonpos_ref(np.float32([-152.0, -200.0, -3.4e38, -np.inf]), scalef).any()


@pytest.mark.parametrize("d,ncols", [(32, NR), (64, NR), (32, 7), (24, NR), (16, NR), (48, 1)])
def test_pack_qt_is_pack_panel(d, ncols):
    """attention's Q^T panel (16 x 16 register transposes for a full panel, d a multiple of 16)
    is exactly _pack_panel's transposing pack, zero padding included."""
    from hepti.kernels.attention_core import _pack_qt
    from hepti.kernels.packed_gemm import _pack_panel

    @numba.njit
    def both(q, d, ncols, a, b, bf):
        _pack_panel(q, 5, 3 * 96, True, d, 3, ncols, a)
        _pack_qt(q, 5, 3 * 96, d, 3, ncols, b, bf)

    q = rand(40 * 3 * 96)
    a = np.full((d, NR), 7.0, np.float32)
    bf = np.full(d * NR, 7.0, np.float32)
    both(q, d, ncols, a, bf.reshape(d, NR), bf)
    assert np.array_equal(a, bf.reshape(d, NR))


def test_transpose16_stages():
    """The shuffle stages of _transpose_ir, on Python lists, transpose a 16 x 16 block."""
    from hepti.kernels._transpose_ir import transpose_ref
    a = np.arange(256).reshape(16, 16)
    assert np.array_equal(np.array(transpose_ref(a.tolist())), a.T)


def test_pack8_stages():
    """pack8's shuffle stages, on Python lists, give the packed A tile of an 8 x 16 block."""
    from hepti.kernels._transpose_ir import pack8_ref
    a = np.arange(128).reshape(8, 16)
    assert np.array_equal(np.array(pack8_ref(a.tolist())), a.T.reshape(-1))


@pytest.mark.parametrize("m,k", [(16, 48), (24, 37), (13, 16), (8, 15), (5, 40)])
def test_pack_a_tiles(m, k):
    """_pack_a (full tiles by pack8, 16 columns at a time, the rest and short tiles by scalar
    copies) lays A out as apack[t, p, i] = A[t*MR + i, p], from an offset and a row stride."""
    from hepti.kernels.packed_gemm import _pack_a
    MR = 8
    lda = k + 3
    flat = np.random.default_rng(k).standard_normal(2 + m * lda).astype(np.float32)
    a = flat[2:].reshape(m, lda)[:, :k]
    apack = np.full((-(-m // MR), k, MR), np.nan, np.float32)
    _pack_a(flat, 2, lda, 0, m, k, apack)
    for t in range(apack.shape[0]):
        rows = min(MR, m - t * MR)
        np.testing.assert_array_equal(apack[t, :, :rows], a[t * MR:t * MR + rows].T)


def test_attention_contiguous_inputs_match_strided():
    q, k, v, mask = attention_case(2, 21, 3, 8, [0, 4])
    strided = attention(q, k, v, mask, 3)
    dense = attention(q.copy(), k.copy(), v.copy(), mask, 3)
    np.testing.assert_array_equal(strided, dense)


@pytest.mark.parametrize("row0,mq", [(0, 120), (0, 1), (37, 83), (39, 1)])
@pytest.mark.parametrize("threads", [1, 2])
def test_attention_qkv_equals_attention_on_views(row0, mq, threads):
    """The fused-QKV entry point: all rows (`tensor`, one device) and a rank's rows against
    gathered K/V (`rows`) give what attention() gives on the column views."""
    n_seq, t, h, d = 3, 40, 2, 16
    q, k, v, mask = attention_case(n_seq, t, h, d, [0, 7, 39])
    qkv = q.base
    np.testing.assert_array_equal(attention_qkv(qkv, mask, h, threads=threads),
                                  attention(q, k, v, mask, h, threads=threads))
    kv = np.ascontiguousarray(qkv[:, h * d:])
    mine = np.ascontiguousarray(qkv[row0:row0 + mq])
    np.testing.assert_array_equal(attention_qkv(mine, mask, h, kv=kv, row0=row0, threads=threads),
                                  attention(q[row0:row0 + mq], k, v, mask, h, row0=row0,
                                            threads=threads))


@pytest.mark.parametrize("n_seq,t,h,d,n_o,pad,bias", [
    (1, 1, 1, 1, 1, [0], True), (2, 7, 3, 5, 17, [0, 3], False), (3, 33, 4, 32, 40, [0, 5, 32], True),
    (1, 128, 12, 32, 384, [40], True),
])
def test_attention_block_is_the_three_calls(n_seq, t, h, d, n_o, pad, bias):
    """attention_block (QKV GeMM, attention, output GeMM in one kernel call) gives the same
    floats as gemm -> attention_qkv -> gemm, and those are the float64 reference's."""
    c = 24
    x = rand(n_seq * t, c)
    w, wo = rand(c, 3 * h * d), rand(h * d, n_o)
    bq, bo = (rand(3 * h * d), rand(n_o)) if bias else (None, None)
    mask = attention_case(n_seq, t, h, d, pad)[3]
    pw, po = pack_b(w), pack_b(wo)
    y = attention_block(x, pw, bq, mask, h, po, bo)
    three = gemm(attention_qkv(gemm(x, pw, bias=bq), mask, h), po, bias=bo)
    np.testing.assert_array_equal(y, three)
    qkv = x.astype(np.float64) @ w + (0 if bq is None else bq)
    hd = h * d
    ctx = naive.attention(qkv[:, :hd], qkv[:, hd:2 * hd], qkv[:, 2 * hd:], mask, h)
    ref = ctx @ wo + (0 if bo is None else bo)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


@pytest.mark.parametrize("n_seq,t,h,d,n_o", [(1, 1, 1, 1, 1), (2, 7, 3, 5, 17), (1, 40, 4, 32, 96)])
def test_attention_block_with_add_layernorm(n_seq, t, h, d, n_o):
    """With residual and ln, attention_block is add_layernorm(three calls, bias, residual)
    (float32 sums in another order: close, not equal)."""
    c = 24
    x, res = rand(n_seq * t, c), rand(n_seq * t, n_o)
    pw, po = pack_b(rand(c, 3 * h * d)), pack_b(rand(h * d, n_o))
    bq, bo, g, be = rand(3 * h * d), rand(n_o), rand(n_o), rand(n_o)
    mask = attention_case(n_seq, t, h, d, [0] * n_seq)[3]
    y = attention_block(x, pw, bq, mask, h, po, bo, residual=res, ln=(g, be, 1e-12))
    ref = add_layernorm(gemm(attention_qkv(gemm(x, pw, bias=bq), mask, h), po), bo, res, g, be,
                        1e-12)
    np.testing.assert_allclose(y, ref, rtol=1e-5, atol=1e-5)
    y = attention_block(x, pw, bq, mask, h, po, None, residual=res)
    np.testing.assert_array_equal(y, gemm(attention_qkv(gemm(x, pw, bias=bq), mask, h), po,
                                          residual=res))
    with pytest.raises(ValueError, match="residual"):
        attention_block(x, pw, bq, mask, h, po, bo, residual=res[1:], ln=(g, be, 1e-12))


@pytest.mark.parametrize("n_seq,t,h,d,f,pad", [(1, 1, 1, 1, 1, [0]), (2, 7, 3, 8, 40, [0, 3]),
                                                 (1, 40, 4, 16, 96, [5])])
def test_encoder_layer_is_attention_block_then_ffn(n_seq, t, h, d, f, pad):
    """EncoderLayer (a BERT layer in one kernel call) gives the same floats as attention_block
    then ffn, each with its add+ln, and those the float64 reference's."""
    c = h * d
    x = rand(n_seq * t, c)
    w, wo, w1, w2 = rand(c, 3 * c), rand(c, c), rand(c, f), rand(f, c)
    bq, bo, b1, b2 = rand(3 * c), rand(c), rand(f), rand(c)
    ln1, ln2 = (rand(c), rand(c), 1e-12), (rand(c), rand(c), 1e-5)
    mask = attention_case(n_seq, t, h, d, pad)[3]
    pw, po, p1, p2 = pack_b(w), pack_b(wo), pack_b(w1), pack_b(w2)
    layer = EncoderLayer(pw, bq, h, po, bo, ln1, p1, b1, p2, b2, ln2)
    y = layer(x, mask)
    x1 = attention_block(x, pw, bq, mask, h, po, bo, residual=x, ln=ln1)
    np.testing.assert_array_equal(y, ffn(x1, p1, b1, p2, down_bias=b2, residual=x1, ln=ln2))
    x64 = x.astype(np.float64)
    qkv = x64 @ w + bq
    ctx = naive.attention(qkv[:, :c], qkv[:, c:2 * c], qkv[:, 2 * c:], mask, h)
    x1 = naive.add_layernorm(ctx @ wo, bo, x64, *ln1)
    ref = naive.add_layernorm(naive.gemm(x1, w1, b1, gelu=True) @ w2, b2, x1, *ln2)
    np.testing.assert_allclose(y, ref, rtol=1e-3, atol=1e-3 * np.abs(ref).max())


def test_encoder_layers_is_the_layers_one_by_one():
    """encoder_layers runs 10 layers (two kernel calls: 8, then 2 and repeats) as the layers'
    own calls do, and refuses layers of different shapes."""
    c, h, f = 16, 2, 24
    mask = attention_case(2, 5, h, c // h, [0, 2])[3]
    layers = [EncoderLayer(pack_b(rand(c, 3 * c)), rand(3 * c), h, pack_b(rand(c, c)), rand(c),
                           (rand(c), rand(c), 1e-12), pack_b(rand(c, f)), rand(f),
                           pack_b(rand(f, c)), rand(c), (rand(c), rand(c), 1e-12))
              for _ in range(10)]
    x = y = rand(10, c)
    for layer in layers:
        y = layer(y, mask)
    np.testing.assert_array_equal(encoder_layers(layers, x, mask), y)
    np.testing.assert_array_equal(encoder_layers(layers[:1], np.asfortranarray(x), mask),
                                  layers[0](x, mask))
    other = EncoderLayer(pack_b(rand(c, 3 * c)), None, 4, pack_b(rand(c, c)), None,
                         (rand(c), rand(c), 1e-12), pack_b(rand(c, f)), None,
                         pack_b(rand(f, c)), None, (rand(c), rand(c), 1e-12))
    with pytest.raises(ValueError, match="one shape"):
        encoder_layers(layers[:2] + [other], x, mask)


def test_encoder_layer_rejects_bad_arguments():
    p8, mask = pack_b(rand(8, 24)), np.ones((2, 10), np.float32)
    po, p1, p2 = pack_b(rand(8, 8)), pack_b(rand(8, 16)), pack_b(rand(16, 8))
    ln = (rand(8), rand(8), 1e-12)
    layer = EncoderLayer(p8, None, 2, po, None, ln, p1, None, p2, None, ln)
    with pytest.raises(ValueError, match="do not fit"):
        layer(rand(19, 8), mask)
    with pytest.raises(ValueError, match="cannot chain"):
        EncoderLayer(p8, None, 2, po, None, ln, p2, None, p1, None, ln)
    with pytest.raises(ValueError, match="n_heads"):
        EncoderLayer(p8, None, 3, po, None, ln, p1, None, p2, None, ln)
    with pytest.raises(TypeError, match="PackedB"):
        EncoderLayer(rand(8, 24), None, 2, po, None, ln, p1, None, p2, None, ln)


def test_attention_block_rejects_bad_arguments():
    x, mask = rand(20, 8), np.ones((2, 10), np.float32)
    pw, po = pack_b(rand(8, 12)), pack_b(rand(4, 5))
    with pytest.raises(ValueError, match="cannot chain"):
        attention_block(x[:19], pw, None, mask, 2, po)
    with pytest.raises(ValueError, match="cannot chain"):
        attention_block(x, pw, None, mask, 2, pack_b(rand(5, 5)))
    with pytest.raises(ValueError, match="n_heads"):
        attention_block(x, pw, None, mask, 3, po)
    with pytest.raises(TypeError, match="PackedB"):
        attention_block(x, rand(8, 12), None, mask, 2, po)


def test_attention_qkv_rejects_bad_arguments():
    q, k, v, mask = attention_case(2, 10, 2, 4, [0, 0])
    qkv = q.base
    with pytest.raises(ValueError, match="C-contiguous"):
        attention_qkv(qkv[:, :-1], mask, 2)
    with pytest.raises(ValueError, match="all 20 rows"):
        attention_qkv(qkv[:5].copy(), mask, 2)
    with pytest.raises(ValueError, match="kv must be"):
        attention_qkv(qkv[:5].copy(), mask, 2, kv=qkv[:, 8:17].copy())
    with pytest.raises(ValueError, match="outside"):
        attention_qkv(qkv[:5].copy(), mask, 2, kv=np.ascontiguousarray(qkv[:, 8:]), row0=16)


def test_attention_rejects_bad_arguments():
    q, k, v, mask = attention_case(2, 10, 2, 4, [0, 0])
    with pytest.raises(ValueError, match="n_heads"):
        attention(q, k, v, mask, 3)
    with pytest.raises(ValueError, match="outside"):
        attention(q[:5], k, v, mask, 2, row0=16)
    with pytest.raises(ValueError, match="shape"):
        attention(q, k[:10], v, mask, 2)
    with pytest.raises(ValueError, match="overlaps"):
        attention(q, k, v, mask, 2, out=q)


def test_embed_layernorm_equals_numpy_gathers_then_layernorm():
    rng = np.random.default_rng(3)
    word, position, types = rand(50, 24), rand(16, 24), rand(2, 24)
    gamma, beta = rand(24), rand(24)
    ids = rng.integers(0, 50, (3, 11))
    token_type = rng.integers(0, 2, (3, 11))
    x = (word[ids] + position[:11][None] + types[token_type]).reshape(33, 24)
    np.testing.assert_allclose(embed_layernorm(ids, token_type, word, position, types, gamma, beta, 1e-12),
                               naive.layernorm(x, gamma, beta, 1e-12), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="tables disagree"):
        embed_layernorm(ids, token_type, word, position[:5], types, gamma, beta, 1e-12)


@pytest.mark.parametrize("m", [1, 8, 37, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_ffn_with_bias_residual_and_layernorm(m, threads):
    """ffn's tail: + down_bias + residual, then LayerNorm, as add_layernorm on ffn's output
    (the same floats before the LayerNorm; its sums in another order: close, not equal)."""
    x, up, down, bias = rand(m, 40), pack_b(rand(40, 70)), pack_b(rand(70, 24)), rand(70)
    b2, res, g, be = rand(24), rand(m, 24), rand(24), rand(24)
    plain = ffn(x, up, bias, down)
    np.testing.assert_array_equal(ffn(x, up, bias, down, threads=threads, down_bias=b2,
                                      residual=res), gemm(plain, pack_b(np.eye(24, dtype=np.float32)),
                                                          bias=b2, residual=res))
    want = add_layernorm(plain, b2, res, g, be, 1e-12)
    got = ffn(x, up, bias, down, threads=threads, down_bias=b2, residual=res, ln=(g, be, 1e-12))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="residual"):
        ffn(x, up, bias, down, residual=res[:, 1:])


def test_ffn_with_row_blocks_equals_two_gemms():
    """A hidden width past the A block budget: the down projection runs in several row blocks,
    each block's last panel prefetching the first again (packed_gemm._gemm_serial)."""
    from hepti.kernels import config
    f = config.GEMM_A_BLOCK_BYTES // (4 * 64) + 8  # so that fewer than 64 rows of h make a block
    x, up, down, bias = rand(128, 40), pack_b(rand(40, f)), pack_b(rand(f, 24)), rand(f)
    want = gemm(gemm(x, up, bias=bias, gelu=True), down)
    np.testing.assert_array_equal(ffn(x, up, bias, down), want)


@pytest.mark.parametrize("m", [1, 8, 37, 128])
@pytest.mark.parametrize("threads", [1, 2])
def test_ffn_equals_two_gemms(m, threads):
    x, up, down, bias = rand(m, 40), pack_b(rand(40, 70)), pack_b(rand(70, 24)), rand(70)
    want = gemm(gemm(x, up, bias=bias, gelu=True), down)
    np.testing.assert_array_equal(ffn(x, up, bias, down, threads=threads), want)
    with pytest.raises(ValueError, match="cannot chain"):
        ffn(x, up, bias, pack_b(rand(24, 70)))
    out = np.full((m, 24), np.nan, np.float32)  # a buffer of the caller's (tensor's shared slot)
    assert ffn(x, up, bias, down, threads=threads, out=out) is out
    np.testing.assert_array_equal(out, want)
    wide = np.full((m, 30), np.nan, np.float32)  # a column block: rows contiguous, not the whole
    got = ffn(x, up, bias, down, threads=threads, out=wide[:, 3:27])
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(wide[:, 3:27], want)


# --- huge pages ---------------------------------------------------------------------------------


def test_huge_empty_is_a_2mib_aligned_writeable_array():
    """huge_empty(n): float32 [n], writeable; from 2 MiB on it starts on a 2 MiB boundary (so
    the kernel may back it with huge pages), below that it is an ordinary aligned array."""
    from hepti.kernels import HUGE_PAGE, huge_empty
    big = huge_empty(HUGE_PAGE // 4 + 1000)
    assert big.dtype == np.float32 and big.shape == (HUGE_PAGE // 4 + 1000,)
    assert big.ctypes.data % HUGE_PAGE == 0 and big.flags.writeable
    big[:] = 3.0
    assert big[-1] == 3.0
    small = huge_empty(1000)
    assert small.shape == (1000,) and small.ctypes.data % 64 == 0 and small.flags.writeable


def test_a_layer_slice_packs_into_one_huge_page_mapping():
    """A layer's packed fp32 weights share one mapping (parallel/slices.py) and keep their
    values: the same panels as pack_b's own arrays."""
    from hepti.parallel.slices import _into_huge_pages
    rng = np.random.default_rng(0)
    ws = [rng.standard_normal((384, 1536), dtype=np.float32) for _ in range(2)]
    packed = [pack_b(w) for w in ws]
    want = [p.panels.copy() for p in packed]
    _into_huge_pages(packed)
    roots = {id(p.panels.base) for p in packed}
    assert len(roots) == 1 and packed[0].panels.ctypes.data % (2 << 20) == 0
    assert all(np.array_equal(p.panels, w) for p, w in zip(packed, want))
    assert all(p.panels.ctypes.data % 64 == 0 for p in packed)


def test_packed_tile_prefetches_deep_k_blocks_into_l1():
    """packed_gemm's IR tile (`_gemm_ir.tile_packed8`) prefetches a k-block's B rows
    _tile_ir.B_L1_AHEAD ahead into L1 (prefetcht0) where the block is deeper than B_L1_BYTES,
    as the fused convolution tiles do; the next panel's L2 prefetch is prefetcht1. The tile in
    a function of its own, not cached (Numba shows no assembly for cached code)."""
    import platform

    from numba import njit

    from hepti.kernels import _gemm_ir, _tile_ir
    if platform.machine() not in ("x86_64", "AMD64") or not _tile_ir.B_L1_AHEAD:
        pytest.skip("x86 assembly, with the L1 prefetch on")

    @njit(cache=False)
    def tile(ap, kc, bp, c, bias, pf):
        _gemm_ir.tile_packed8(ap, 0, kc, bp, 0, c, 0, 32, False, bias, 0, True, False, c, 0, 0,
                              False, pf, 0, 4, 16)

    rng = np.random.default_rng(7)
    kc = 400  # 50 KB of B: deeper than half of any L1 this code meets
    a = rng.standard_normal((8, kc)).astype(np.float32)
    bp = rng.standard_normal((kc, 32)).astype(np.float32)
    bias, pf = rng.standard_normal(32).astype(np.float32), np.zeros(64 * 16, np.float32)
    c = np.zeros(8 * 32, np.float32)
    tile(np.ascontiguousarray(a.T).reshape(-1), kc, bp, c, bias, pf)  # A packed k-major
    np.testing.assert_allclose(c.reshape(8, 32), a.astype(np.float64) @ bp + bias,
                               rtol=1e-4, atol=1e-4)
    asm = "".join(tile.inspect_asm().values())
    assert "prefetcht0" in asm and "prefetcht1" in asm
