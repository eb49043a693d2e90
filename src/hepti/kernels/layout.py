"""Layout changes of feature maps: torch's NCHW pixels to the kernels' NHWC.

numpy's `np.ascontiguousarray(x.transpose(0, 2, 3, 1))` of a [1, 3, 224, 224] image took
180 us of CPU time (92 us at 160x160; 330-360 us of wall time at load 2-4): the largest piece
of MobileNetV2's forward outside its ops (~8.3 ms in all at 224, 2026-11, one thread);
`nchw_to_nhwc` takes 18 us (10 at 160).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hepti.kernels._views import aligned_empty
from hepti.kernels.config import JIT


@njit(**JIT)
def _rgb(x0, x1, x2, y, hw):
    """y[3p + k] = xk[p]: three planes of hw floats, pixel by pixel."""
    for p in range(hw):
        y[3 * p] = x0[p]
        y[3 * p + 1] = x1[p]
        y[3 * p + 2] = x2[p]


@njit(**JIT)
def _nchw_to_nhwc(x, n, c, hw, y):
    """y[(b*hw + p)*c + ch] = x[(b*c + ch)*hw + p] over flat float32 x and y. Three channels
    (an RGB image): `_rgb` on each plane's slice, 14 us at 224x224 (the same loop on offsets
    into x and y here took 110 us, and a loop over the channels inside the pixel loop 230 us:
    LLVM vectorised neither); other counts plane by plane."""
    for b in range(n):
        xb = b * c * hw
        yb = b * hw * c
        if c == 3:
            _rgb(x[xb:xb + hw], x[xb + hw:xb + 2 * hw], x[xb + 2 * hw:xb + 3 * hw],
                 y[yb:yb + 3 * hw], hw)
        else:
            for ch in range(c):
                for p in range(hw):
                    y[yb + p * c + ch] = x[xb + ch * hw + p]


def nchw_to_nhwc(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """x [N, C, H, W] (any float dtype; converted to float32 first) -> float32 [N, H, W, C],
    C-contiguous (into `out` when given: float32, C-contiguous, that shape, not x)."""
    x = np.asarray(x)
    if x.ndim != 4:
        raise ValueError(f"x must be [N, C, H, W], got shape {list(x.shape)}")
    if not np.issubdtype(x.dtype, np.floating):
        raise TypeError(f"x must be a float array, got {x.dtype}")
    n, c, h, w = x.shape
    x = np.ascontiguousarray(x, np.float32)
    if out is None:
        y = aligned_empty((n, h, w, c))
    else:
        y = out
        if not isinstance(y, np.ndarray) or y.dtype != np.float32 or \
                y.shape != (n, h, w, c) or not y.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {(n, h, w, c)}")
        if np.shares_memory(y, x):
            raise ValueError("out overlaps x: pass a separate output buffer")
    if y.size:
        _nchw_to_nhwc(x.reshape(-1), n, c, h * w, y.reshape(-1))
    return y
