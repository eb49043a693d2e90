"""Masked row softmax with Hugging Face BERT's semantics.

HF adds (1 - mask) * float32_min to the scaled scores, then takes an ordinary softmax; a padded
key's probability is therefore exactly 0, and a row whose keys are all padding becomes uniform
(all its scores round to float32_min). `softmax_row` reproduces that in float32 with the
vectorisable exp of mathfn.py; attention.py calls it on each row of its score tiles.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hepti.kernels._microkernels import row_max
from hepti.kernels._views import EMPTY, check_float32, check_no_overlap, flat_rows, output
from hepti.kernels.config import FASTMATH_ROWS, JIT
from hepti.kernels.mathfn import F32_MIN, exp_nonpos

_ONE = np.float32(1.0)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def softmax_row(s, mask, has_mask, scale):
    """In place: s = softmax(s * scale + (1 - mask) * float32_min) over the 1-D row s.

    A key with mask 1 keeps its scaled score exactly (a select, not "+ 0 * float32_min"): with
    fast-math reassociation, v + (1 - m) * min could become (v + min) - m * min, which rounds
    every score to the same value. (Fractional masks are added in either order.)
    """
    n = s.shape[0]
    if has_mask:
        for j in range(n):
            v = s[j] * scale
            m = mask[j]
            s[j] = v if m == _ONE else v + (_ONE - m) * F32_MIN
    elif scale != _ONE:
        for j in range(n):
            s[j] = s[j] * scale
    top = row_max(s)
    total = np.float32(0.0)
    for j in range(n):
        e = exp_nonpos(s[j] - top)
        s[j] = e
        total += e
    inv = _ONE / total
    for j in range(n):
        s[j] *= inv


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _softmax_rows(x, ldx, y, ldy, m, n, mask, has_mask, scale, in_place):
    """y[i] = masked softmax of x[i] for each of m rows of n floats (in_place: y is x)."""
    for i in range(m):
        yr = y[i * ldy:i * ldy + n]
        if not in_place:
            xr = x[i * ldx:i * ldx + n]
            for j in range(n):
                yr[j] = xr[j]
        softmax_row(yr, mask, has_mask, scale)


def softmax_rows(x: np.ndarray, key_mask: np.ndarray | None = None, scale: float = 1.0,
                 out: np.ndarray | None = None) -> np.ndarray:
    """softmax(x * scale + (1 - key_mask) * float32_min) along each row of float32 x [M, N].

    key_mask: float32 [N], 1 for a real key and 0 for padding (None: no mask). The result goes
    to out (pass out=x to work in place) or a new array; it is returned either way.
    """
    check_float32(x, "x", 2)
    m, n = x.shape
    y = output(out, (m, n))
    if key_mask is not None:
        check_float32(key_mask, "key_mask", 1)
        if key_mask.shape[0] != n:
            raise ValueError(f"key_mask must have {n} entries (one per column), got "
                             f"{key_mask.shape[0]}")
        mask = np.ascontiguousarray(key_mask)
    else:
        mask = EMPTY
    in_place = (out is not None and out.ctypes.data == x.ctypes.data
                and out.strides == x.strides)
    if out is not None and not in_place:
        check_no_overlap(y, x, "x")
    if m and n:
        x_flat, ldx = flat_rows(x, "x")
        y_flat, ldy = flat_rows(y, "out")
        _softmax_rows(x_flat, ldx, y_flat, ldy, m, n, mask, key_mask is not None,
                      np.float32(scale), in_place)
    return y
