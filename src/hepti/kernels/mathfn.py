"""Scalar float32 math written as plain arithmetic, so that LLVM vectorises loops that call it.

Numba lowers `math.exp` and `math.erf` to libm calls, which stay scalar without Intel SVML
(~5 ns each: 0.2 M of them per attention layer would cost ~1 ms). These versions are
branch-free polynomials and vectorise:

* `exp_nonpos(x)`: e**x for x <= 0 (softmax after subtracting the row max); Cephes' expf
  polynomial, within 2 ulp; returns 0 below -87.3 (where e**x is below float32's normal range).
* `gelu32(x)`: 0.5 * x * (1 + erf(x / sqrt(2))), the erf form BERT uses, as one rational
  function of x fitted to GeLU's absolute error (within 1.9e-6 in float32): 11 multiply-adds
  and a division a value where an erf to ~1 ulp (Eigen's and XLA's 7/4 rational) then GeLU
  around it took 15.

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


# GeLU(x) = x * Phi(x), Phi(x) = 0.5 + 0.5 * erf(x / sqrt 2), as x * N / D on t = x clamped
# to [-5, 5] (1 - Phi(5) = 2.9e-7): N = t * P(t^2) + Qh(t^2), D = 2 * Qh(t^2), P of degree 5,
# Qh of degree 3 (Phi = 0.5 + t * P / (2 Qh)), fitted to GeLU itself: linearised least squares
# in s = t^2, reweighted (Lawson) towards the minimax of GeLU's absolute error, which is
# s * |d(P / 2Qh)| on [0, 5] and |x| * 5 * |d(P / 2Qh)(25)| on the clamped tail 5 < |x| <= 12;
# the clamp 5 was the best of 4.6 .. 6.0. In exact arithmetic within 1.0e-6 of GeLU on the
# whole line; in float32 within 1.9e-6 on [-12, 12] (2 ulp at 12; the erf form before it: 1).
_GELU_CLAMP = np.float32(5.0)
GELU_P = (0.39895156025886536, 0.025379067286849022, 0.0038320396561175585,
          2.833133294188883e-05, 1.714624886517413e-07, -2.4110029528401355e-09)
GELU_QH = (0.5, 0.11518049240112305, 0.011455144733190536, 0.0005781656946055591)
_G0, _G1, _G2, _G3, _G4, _G5 = (np.float32(c) for c in GELU_P)
_H0, _H1, _H2, _H3 = (np.float32(c) for c in GELU_QH)


@njit(inline="always", **JIT)
def gelu32(x):
    """GeLU, erf form (0.5 * x * (1 + erf(x / sqrt(2)))), as x * N(t) / D(t) for t = x clamped
    to [-5, 5]: a degree-11 odd-plus-even numerator over a degree-6 even denominator, within
    1.9e-6 of the exact GeLU in float32. _gemm_ir._gelu is the same arithmetic on vectors."""
    t = min(max(x, -_GELU_CLAMP), _GELU_CLAMP)
    s = t * t
    p = _G5 * s + _G4
    p = p * s + _G3
    p = p * s + _G2
    p = p * s + _G1
    p = p * s + _G0
    qh = _H3 * s + _H2
    qh = qh * s + _H1
    qh = qh * s + _H0
    return x * (t * p + qh) / (qh + qh)  # x * (Qh + t P) / 2Qh = x * Phi(x)
