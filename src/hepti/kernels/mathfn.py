"""Scalar float32 math written as plain arithmetic, so that LLVM vectorises loops that call it.

Numba lowers `math.exp` and `math.erf` to libm calls, which stay scalar without Intel SVML
(~5 ns each: 0.2 M of them per attention layer would cost ~1 ms). These versions are
branch-free polynomials and vectorise:

* `exp_nonpos(x)`: e**x for x <= 0 (softmax after subtracting the row max); Cephes' expf
  polynomial, within 2 ulp; returns 0 below -87.3 (where e**x is below float32's normal range).
* `erf32(x)`: the rational approximation used by Eigen and XLA for float32, within ~2e-7
  absolute of erf on the whole line.
* `gelu32(x)`: 0.5 * x * (1 + erf(x / sqrt(2))), the erf form BERT uses.

`F32_MIN` is float32's lowest value, HF's mask value (torch.finfo(float32).min).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hepti.kernels._intrinsics import int32_bits_as_float32
from hepti.kernels.config import JIT


F32_MIN = np.float32(np.finfo(np.float32).min)
_LOG2E = np.float32(1.44269504088896341)
_LN2_HI = np.float32(0.693359375)  # Cephes split of ln 2: hi + lo
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LOW = np.float32(-87.3)  # e**x below this is flushed to 0 (2**-126 is the smallest normal)
_P0 = np.float32(1.9875691500e-4)
_P1 = np.float32(1.3981999507e-3)
_P2 = np.float32(8.3334519073e-3)
_P3 = np.float32(4.1665795894e-2)
_P4 = np.float32(1.6666665459e-1)
_P5 = np.float32(5.0000001201e-1)
_ONE = np.float32(1.0)
_HALF = np.float32(0.5)
_ZERO = np.float32(0.0)


@njit(inline="always", **JIT)
def exp_nonpos(x):
    """e**x for float32 x <= 0; 0 for x < -87.3 (and for -inf)."""
    xc = max(x, _EXP_LOW)
    n = np.floor(xc * _LOG2E + _HALF)
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = _P0 * r + _P1
    p = p * r + _P2
    p = p * r + _P3
    p = p * r + _P4
    p = p * r + _P5
    p = p * (r * r) + r + _ONE
    scale = int32_bits_as_float32((np.int32(n) + 127) << 23)
    return _ZERO if x < _EXP_LOW else p * scale


_ERF_CLAMP = np.float32(4.0)  # erf(4) rounds to 1 in float32
_A1 = np.float32(-1.60960333262415e-02)
_A3 = np.float32(-2.95459980854025e-03)
_A5 = np.float32(-7.34990630326855e-04)
_A7 = np.float32(-5.69250639462346e-05)
_A9 = np.float32(-2.10102402082508e-06)
_A11 = np.float32(2.77068142495902e-08)
_A13 = np.float32(-2.72614225801306e-10)
_B0 = np.float32(-1.42647390514189e-02)
_B2 = np.float32(-7.37332916720468e-03)
_B4 = np.float32(-1.68282697438203e-03)
_B6 = np.float32(-2.13374055278905e-04)
_B8 = np.float32(-1.45660718464996e-05)
_INV_SQRT2 = np.float32(0.7071067811865476)


@njit(inline="always", **JIT)
def erf32(x):
    """erf(x) in float32 (rational approximation, odd numerator over even denominator)."""
    xc = min(max(x, -_ERF_CLAMP), _ERF_CLAMP)
    x2 = xc * xc
    p = _A13 * x2 + _A11
    p = p * x2 + _A9
    p = p * x2 + _A7
    p = p * x2 + _A5
    p = p * x2 + _A3
    p = p * x2 + _A1
    q = _B8 * x2 + _B6
    q = q * x2 + _B4
    q = q * x2 + _B2
    q = q * x2 + _B0
    return xc * p / q


@njit(inline="always", **JIT)
def gelu32(x):
    """GeLU, erf form: 0.5 * x * (1 + erf(x / sqrt(2)))."""
    return _HALF * x * (_ONE + erf32(x * _INV_SQRT2))
