"""Threaded kernels against their single-thread results (issue 47: two threads on one rank).

The threads split the work, never a sum: each output element is one micro-kernel's sum over
the same k in the same order whichever thread makes it, so the results are the same bits.
Shapes pick each split: row blocks, and (ResNet-50's small maps) output panels, where the
planner chooses them (`conv._conv_plan`), with bias, residual (also written in place over
the residual) and activation; and the float64 reference besides. No timing here.
"""
from __future__ import annotations

import numba
import numpy as np
import pytest

from hepti.kernels import conv, conv2d, naive, pack_conv_weight
from hepti.kernels.config import NR

RNG = np.random.default_rng(47)
THREADS = min(2, numba.config.NUMBA_NUM_THREADS)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


# (h, w, cin, cout, kernel, stride, padding): the map's size picks the split
CONV_CASES = [
    (7, 7, 64, 8 * NR, 1, 1, 0),     # 1x1 on a 7x7 map: 7 tiles, by panels
    (7, 7, 32, 8 * NR, 3, 1, 1),     # 3x3 gathered patches (7 is no multiple of MR): by panels
    (14, 14, 32, 8 * NR, 3, 2, 1),   # stride 2 down to 7x7
    (3, 16, 16, 8 * NR, 3, 1, 1),    # by output rows, 3 of them: by panels
    (16, 16, 16, 2 * NR, 3, 1, 1),   # by output rows, 16 of them: by rows
    (14, 14, 64, 2 * NR, 1, 1, 0),   # too few panels to split: by rows
    (5, 5, 8, 3 * NR + 5, 3, 1, 1),  # Cout not whole panels (unfused): by rows
]


@pytest.mark.parametrize("h,w,cin,cout,kernel,stride,padding", CONV_CASES)
def test_conv2d_threads_match_one_thread(h, w, cin, cout, kernel, stride, padding):
    x, wt, bias = rand(1, h, w, cin), rand(cout, cin, kernel, kernel), rand(cout)
    cw = pack_conv_weight(wt)
    y1 = conv2d(x, cw, bias, stride, padding, relu="relu", threads=1)
    res = rand(*y1.shape)
    r1 = conv2d(x, cw, bias, stride, padding, relu="relu6", residual=res, threads=1)
    y2 = conv2d(x, cw, bias, stride, padding, relu="relu", threads=THREADS)
    r2 = conv2d(x, cw, bias, stride, padding, relu="relu6", residual=res, threads=THREADS)
    np.testing.assert_array_equal(y2, y1)
    np.testing.assert_array_equal(r2, r1)
    # written over the residual (its last reader, as the band executor does)
    own = res.copy()
    r3 = conv2d(x, cw, bias, stride, padding, relu="relu6", residual=own, out=own,
                threads=THREADS)
    np.testing.assert_array_equal(r3, r1)
    ref = naive.conv2d(x, wt, bias, stride, padding, 1, 1, res, "relu6")
    np.testing.assert_allclose(r2, ref, rtol=1e-4, atol=1e-4 * np.sqrt(cin * kernel * kernel))


def test_conv_plan_splits_small_maps_by_panels():
    """ResNet-50's 7x7 stage splits by panels on 2 threads; 56x56 and the unfused modes by
    rows; one thread never splits."""
    m, k = 49, 512
    n_chunks, mb, n_blocks, _, by_panels = conv._conv_plan(m, k, conv._MODE_FLAT, 2, 0, 7, 64)
    assert by_panels and n_chunks == 2 and mb * n_blocks >= m
    assert not conv._conv_plan(m, k, conv._MODE_FLAT, 1, 0, 7, 64)[4]
    assert not conv._conv_plan(m, k, conv._MODE_DIRECT, 2, 0, 7, 0)[4]
    assert not conv._conv_plan(56 * 56, 64 * 9, conv._MODE_ROWS_FUSED, 2, 0, 56, 2)[4]


def test_padded_blocks_grow_with_the_weight():
    """_MODE_PADDED (no packed A) takes blocks of PADDED_BLOCK pixels or the whole map where
    its panels are over half of L2, equal and whole tiles; row_block's where they fit."""
    L2 = conv.config.L2_BYTES
    for m, k, n_panels in ((49, 4608, 16), (784, 4608, 16), (12544, 2304, 16)):
        assert 2 * k * n_panels * conv.NR * 4 > L2
        mb, n_blocks = conv._conv_plan(m, k, conv._MODE_PADDED, 1, 0, 7, n_panels)[1:3]
        assert mb * n_blocks >= m and (mb == m or mb >= conv.PADDED_BLOCK)
        assert mb == m or mb % conv.MRF == 0
        assert mb * (n_blocks - 1) < m  # no empty block
    m, k = 12544, 147  # the stem: 2 panels of 147 rows fit
    assert conv._conv_plan(m, k, conv._MODE_PADDED, 1, 0, 112, 2)[1] == \
        min(conv.row_block(m, k), m)


@pytest.mark.parametrize("m,k,mode,wo", [(3136, 256, 4, 56), (784, 1152, 5, 28),
                                         (3136, 576, 6, 56), (196, 1024, 4, 14)])
def test_split_rows_balances_the_tiles(m, k, mode, wo):
    """Rounding the row blocks to a multiple of the threads leaves the busier of two threads
    at most one block's share over half (7 blocks were cut 3 and 4 before)."""
    mb, busiest = conv._split_rows(m, k, mode, 2, wo)
    units = conv._block_units(m, mb, mode, wo)
    assert sum(units) >= -(-m // 8) and busiest <= -(-sum(units) // 2) + max(units) // 2 + 1


def test_split_rows_takes_more_blocks_where_they_share_the_tiles_evenly():
    """ResNet-50's 28x28 3x3s read in place (98 tiles): row_block's 8 blocks of 13 tiles
    were 52 and 46 a thread; 14 blocks of 7 are 49 and 49. A split already even keeps its
    blocks (56x56: row_block's)."""
    m, k = 28 * 28, 9 * 128
    mb, busiest = conv._split_rows(m, k, conv._MODE_PADDED, 2, 28)
    units = conv._block_units(m, mb, conv._MODE_PADDED, 28)
    assert sum(units) == 98 and busiest == 49 and mb % conv.MRF == 0
    assert conv._busiest(conv._block_units(m, 104, conv._MODE_PADDED, 28), 2) == 52
    m, k = 56 * 56, 256
    n0 = -(-m // conv.row_block(m, k))
    n0 = -(-n0 // 2) * 2
    assert conv._split_rows(m, k, conv._MODE_FLAT, 2, 56)[0] == \
        -(-(-(-m // n0)) // conv.MRF) * conv.MRF


@pytest.mark.parametrize("m,k,n", [(256, 768, 4 * NR), (100, 3072, 3 * NR + 7), (9, 64, 2 * NR),
                                   (1, 128, 5 * NR)])
def test_gemm_threads_match_one_thread(m, k, n):
    """Panels split over the threads, each row block of A packed by the threads (K = 3072:
    several blocks, the last short), GeMV for one row; with bias, GeLU and residual."""
    from hepti.kernels import gemm, pack_b
    a, w, bias, res = rand(m, k), rand(k, n), rand(n), rand(m, n)
    pb = pack_b(w)
    y1 = gemm(a, pb, bias=bias, gelu=True, residual=res, threads=1)
    y2 = gemm(a, pb, bias=bias, gelu=True, residual=res, threads=THREADS)
    np.testing.assert_array_equal(y2, y1)
    ref = a.astype(np.float64) @ w.astype(np.float64) + bias
    ref = 0.5 * ref * (1 + np.vectorize(__import__("math").erf)(ref / np.sqrt(2))) + res
    np.testing.assert_allclose(y2, ref, rtol=1e-3, atol=1e-3 * np.sqrt(k))
