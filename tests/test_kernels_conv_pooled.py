"""hepti.kernels.conv `ConvLayer.pooled`: a convolution and the max pool of its output in one
kernel call, each pool row made from the convolution's rows as they are made. Its result is
the layer's then `max_pool2d`'s, bit for bit (the same tiles on the same plan, the same pool
rows), in either fused mode by rows, at batch 2, on bands with their own padding, with pool
rows that read past the map's last row; a layer that runs another mode declines (None). On 2
threads (each a range of the pool rows, from the convolution rows they read) the same bits."""
from __future__ import annotations

import numba
import numpy as np
import pytest

from hepti.kernels import ConvLayer, max_pool2d, pack_conv_weight
from hepti.kernels.config import NR
from hepti.kernels.conv import _MODE_PADDED, _MODE_ROWS_FUSED

RNG = np.random.default_rng(20261130)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


# (Cin, Cout, kernel, stride, conv padding, x [N, H, W], pool kernel, stride, padding, mode)
CASES = [
    (16, 2 * NR, 3, 1, (1, 1, 1, 1), (1, 16, 32), 2, 2, (0, 0, 0, 0), _MODE_ROWS_FUSED),
    (16, NR, 3, 1, (1, 1, 1, 1), (2, 13, 32), 2, 2, (0, 0, 0, 0), _MODE_ROWS_FUSED),
    (16, NR, 3, 1, (1, 1, 1, 1), (1, 14, 16), 2, 2, (0, 0, 0, 0), _MODE_PADDED),
    (3, NR, 7, 2, (3, 3, 3, 3), (1, 30, 30), 3, 2, (1, 1, 1, 1), _MODE_PADDED),
    (3, NR, 7, 2, (3, 3, 3, 3), (2, 23, 19), 3, 2, (1, 1, 1, 1), _MODE_PADDED),
    (16, NR, 3, 1, (0, 1, 1, 1), (1, 9, 32), 3, 2, (1, 0, 1, 1), _MODE_ROWS_FUSED),
]


@pytest.mark.parametrize("cin,cout,k,stride,padding,shape,pk,ps,pp,mode", CASES)
def test_pooled_is_the_layer_then_the_pool(cin, cout, k, stride, padding, shape, pk, ps, pp,
                                           mode):
    layer = ConvLayer(pack_conv_weight(rand(cout, cin, k, k)), rand(cout), stride, 1, "relu")
    x = rand(*shape, cin)
    assert layer._shape(x.shape, padding, 1)[2][0] == mode
    want = max_pool2d(layer(x, padding), pk, ps, pp)
    got = layer.pooled(x, padding, pk, ps, pp)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(layer.pooled(x, padding, pk, ps, pp), want)  # kept plan


def test_pooled_declines_other_modes():
    """A 1x1 at stride 1 reads x flat (`_MODE_FLAT`): not by rows, so None."""
    layer = ConvLayer(pack_conv_weight(rand(NR, 16, 1, 1)), rand(NR), 1, 1, "relu")
    assert layer.pooled(rand(1, 8, 8, 16), (0, 0, 0, 0), 2, 2, (0, 0, 0, 0)) is None


@pytest.mark.parametrize("cin,cout,k,stride,padding,shape,pk,ps,pp,mode", CASES)
def test_pooled_on_two_threads_is_one_threads(cin, cout, k, stride, padding, shape, pk, ps,
                                              pp, mode):
    """Each thread a contiguous range of the pool rows (a convolution row both ranges read,
    made by both): bit for bit one thread's, and the layer then the pool on 2 threads."""
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    layer = ConvLayer(pack_conv_weight(rand(cout, cin, k, k)), rand(cout), stride, 1, "relu")
    x = rand(*shape, cin)
    want = layer.pooled(x, padding, pk, ps, pp)
    got = layer.pooled(x, padding, pk, ps, pp, threads)
    assert got is not None
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(max_pool2d(layer(x, padding, threads=threads), pk, ps, pp),
                                  want)


def test_pooled_on_two_threads_declines_a_split_by_panels():
    """Where the convolution's plan on 2 threads splits by output panels (a 7x7 map of 8
    panels), blocks of POOLED_ROWS rows would read every panel again per block: None."""
    threads = min(2, numba.config.NUMBA_NUM_THREADS)
    layer = ConvLayer(pack_conv_weight(rand(8 * NR, 32, 3, 3)), rand(8 * NR), 1, 1, "relu")
    x = rand(1, 7, 7, 32)
    if threads < 2 or not layer._shape(x.shape, (1, 1, 1, 1), threads)[2][6]:
        pytest.skip("no split by panels here")
    assert layer.pooled(x, (1, 1, 1, 1), 2, 2, (0, 0, 0, 0), threads) is None
