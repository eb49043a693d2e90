"""hepti.kernels.layout: torch's NCHW pixels to NHWC, against numpy's transposed copy (a copy:
equal bit for bit), on RGB images (the unrolled three-plane path) and other channel counts,
batches, a float64 input, `out`, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.kernels import nchw_to_nhwc

RNG = np.random.default_rng(20261130)


@pytest.mark.parametrize("shape", [(1, 3, 224, 224), (2, 3, 7, 5), (1, 3, 1, 1), (2, 4, 6, 5),
                                   (1, 1, 3, 3), (3, 16, 2, 9), (0, 3, 4, 4)])
def test_nchw_to_nhwc_is_numpys_transpose(shape):
    x = RNG.standard_normal(shape).astype(np.float32)
    y = nchw_to_nhwc(x)
    assert y.dtype == np.float32 and y.flags.c_contiguous
    np.testing.assert_array_equal(y, x.transpose(0, 2, 3, 1))


def test_nchw_to_nhwc_converts_and_reads_views():
    x = RNG.standard_normal((2, 3, 8, 6))
    np.testing.assert_array_equal(nchw_to_nhwc(x), x.transpose(0, 2, 3, 1).astype(np.float32))
    wide = RNG.standard_normal((2, 3, 8, 12)).astype(np.float32)
    view = wide[:, :, :, ::2]  # not contiguous
    np.testing.assert_array_equal(nchw_to_nhwc(view), view.transpose(0, 2, 3, 1))


def test_nchw_to_nhwc_into_out():
    x = RNG.standard_normal((1, 3, 5, 7)).astype(np.float32)
    out = np.empty((1, 5, 7, 3), np.float32)
    assert nchw_to_nhwc(x, out=out) is out
    np.testing.assert_array_equal(out, x.transpose(0, 2, 3, 1))


def test_nchw_to_nhwc_bad_input():
    x = np.zeros((1, 3, 4, 4), np.float32)
    with pytest.raises(ValueError, match="N, C, H, W"):
        nchw_to_nhwc(x[0])
    with pytest.raises(TypeError, match="float"):
        nchw_to_nhwc(x.astype(np.int32))
    with pytest.raises(ValueError, match="out must be"):
        nchw_to_nhwc(x, out=np.empty((1, 3, 4, 4), np.float32))
    with pytest.raises(ValueError, match="out must be"):
        nchw_to_nhwc(x, out=np.empty((1, 4, 4, 3), np.float64))
