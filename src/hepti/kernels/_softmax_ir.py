"""Attention's softmax down one panel of 32 queries (`softmax_panel` of _microkernels.py) as
explicit-vector LLVM IR: `softmax_panel8(st, t, mask, scale, ap, tq0, tot)`, the generated
kernel's arguments and result for NR = 32 and MR = 8 (ap C-contiguous); an intrinsic, so
called from njit code only.

st [t, 32] (flat) holds S^T: row p, key p's scores for the panel's 32 queries. For each query
j, with x = s * scale + add_p (add_p = (1 - mask[p]) * float32 min, 0 for mask 1) and m_j its
column maximum, e = exp(x - m_j) is written into P's packed tiles (ap[tq0 + g, p, i] = the e
of query MR*g + i) and the column sums into tot[0:32].

How: the 32 columns are two <16 x float> values; the maxima and sums stay in registers. The
exponent is taken in base 2: x2 = s * (scale * log2 e) + add_p, y = x2 - max x2 <= 0, and
2**y = 2**n * 2**r with n = round(y) and r = y - n in [-0.5, 0.5] exact, 2**r a degree-5
polynomial (relative error 9e-8 in exact arithmetic, within 1.6 ulp in float32 Horner). With
AVX-512 (`SCALEF`), n = roundeven(y) (vrndscaleps) and e = 2**r * 2**n by vscalefps, which
is exactly 0 for n below -151 and needs no clamp for a finite y: an unmasked row's y is a
finite score minus its column's maximum. Without it, n comes from adding and subtracting
1.5 * 2**23 + 127 (which also leaves n + 127 in the low bits of the sum: shifted left by 23
they are 2**n's float bits), after a clamp at -127, where n + 127 = 0 makes 2**n (and e)
exactly 0. Masked rows (y near float32's lowest, or -inf were a maximum that large) are
clamped either way, at -152 with vscalefps. A row of mask 1 (the usual case) costs one FMA
for y (s * c - max) and, in the max pass, one max over the raw scores (scaled once at the end:
for scale > 0, x2 is monotone in s; other scales take a general pass); masked rows take the
add. At MiniLM's shape the degree-5 polynomial, vscalefps and the unmasked rows' clamp
dropped took the panel to 0.79-0.80x of the degree-6 / shift-and-multiply one (48 panels,
41.4 against 52.2 us, in cache, 60 interleaved rounds; 2026-12-01). Before that (degree 6,
the shift), against Cephes' expf in `exp_nonpos` (natural base: a multiply by log2 e, a
floor, a two-constant ln 2 reduction, a degree-7 form, a convert, an underflow select) and
the generated panel's two FMA-and-max passes, about 20 vector operations per 16 scores where
there were about 30: at MiniLM's shape (T = 128, 12 heads) 43.8 us a layer against
72.2 (0.61x), attention 307 us against 332 (0.92x), interleaved, 1 thread. The masked keys'
add is not scaled by log2 e: it only has to send e to 0 (or, every key masked, be the same
for all keys: the softmax of equal scores, HF's result), which it does in either base. The
results are the generated panel's within float32 rounding of the exponent's argument (the
extra rounding of scale * log2 e: relative 6e-8 of |y|), not bit-equal.

Plain LLVM IR (llvm.fma, llvm.maxnum, llvm.roundeven, shifts and bitcasts) but for vscalefps
(`llvm.x86.avx512.mask.scalef.ps.512`), used only where the target has AVX-512F: an AVX2 CPU
gets the shift-and-multiply form as pairs of ymm. Numba's cache does not see this file change
under kernels that inline it; hepti.kernels._cache does (attention_core imports it).
"""
from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hepti.kernels.config import simd_status

NR = 32  # queries in a panel: two 16-float vectors
_LANES = 16
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, _LANES)
_VI = ir.VectorType(_I32, _LANES)
_FAST = ("contract", "nsz")  # no reassociation: the rounding trick needs the add then the sub

LOG2E = 1.4426950408889634
# 2**r ~ 1 + C[0] r + ... + C[4] r**5 on [-0.5, 0.5] (relative least squares, Lawson-weighted
# to minimax; float32-rounded coefficients). Degree 6 (relative 2e-9, 0.84 ulp in float32)
# took one more FMA a value for nothing the softmax's tolerance sees.
C = (0.6931470036506653, 0.24022242426872253, 0.05550733953714371, 0.009671509265899658,
     0.0013264698209241033)
_MAGIC = 12582912.0 + 127.0  # 1.5 * 2**23 + 127: adding it rounds to an integer, biased by 127
_Y_LOW = -127.0  # the shift-and-multiply form's clamp: 2**n exactly 0 there
_Y_LOW_SCALEF = -152.0  # vscalefps's, masked rows only: 2**r * 2**-152 rounds to exactly 0
# vscalefps for 2**n where the code generator targets AVX-512F (as hepti.kernels.config sets it)
SCALEF = simd_status()["avx512f"]
F32_MIN = float(np.finfo(np.float32).min)


def _splat(value: float):
    return ir.Constant(_V, [value] * _LANES)


def exp2_nonpos_ref(y: np.ndarray, scalef: bool = SCALEF) -> np.ndarray:
    """The kernel's 2**y for float32 y <= 0 (a masked row's: clamped), in numpy (the same
    operations in the same order, without the FMA's single rounding): for tests. scalef: the
    AVX-512 form (roundeven, then 2**n by ldexp, which rounds as vscalefps does)."""
    y = np.asarray(y, np.float32)
    if scalef:
        y = np.maximum(y, np.float32(_Y_LOW_SCALEF))
        n = np.round(y)  # half to even, as llvm.roundeven
        r = y - n
    else:
        y = np.maximum(y, np.float32(_Y_LOW))
        t = y + np.float32(_MAGIC)
        n = t - np.float32(_MAGIC)
        r = y - n
    p = np.float32(C[-1])
    for c in C[-2::-1]:
        p = p * r + np.float32(c)
    p = p * r + np.float32(1.0)
    if scalef:
        return np.ldexp(p, n.astype(np.int32)).astype(np.float32)
    scale = (t.view(np.int32) << 23).view(np.float32)
    return p * scale


def _make(mr: int, scalef: bool = SCALEF):
    """The intrinsic for P's tiles of height mr (a divisor of 16); scalef: 2**n by vscalefps
    (AVX-512F only)."""

    @intrinsic
    def panel(typingctx, st, t, mask, scale, ap, tq0, tot):
        flat = (st, mask, tot)
        if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32
                    for a in flat)
                and isinstance(ap, types.Array) and ap.ndim == 3 and ap.dtype == types.float32
                and ap.layout == "C" and isinstance(t, types.Integer)
                and isinstance(tq0, types.Integer) and isinstance(scale, types.Float)):
            return None
        sig = types.void(st, t, mask, scale, ap, tq0, tot)

        def codegen(context, builder, signature, args):
            sa = signature.args
            S = context.make_array(sa[0])(context, builder, args[0])
            M = context.make_array(sa[2])(context, builder, args[2])
            A = context.make_array(sa[4])(context, builder, args[4])
            T = context.make_array(sa[6])(context, builder, args[6])
            t_ = context.cast(builder, args[1], sa[1], types.int64)
            tq0_ = context.cast(builder, args[5], sa[5], types.int64)
            scale_ = context.cast(builder, args[3], sa[3], types.float32)
            ldm = builder.sdiv(cgutils.unpack_tuple(builder, M.strides, 1)[0], _I64(4))
            lda = builder.mul(cgutils.unpack_tuple(builder, A.shape, 3)[1], _I64(mr))
            mod = builder.module
            fma = cgutils.get_or_insert_function(mod, ir.FunctionType(_V, [_V, _V, _V]),
                                                 "llvm.fma.v16f32")
            clamp = cgutils.get_or_insert_function(mod, ir.FunctionType(_V, [_V, _V]),
                                                   "llvm.maxnum.v16f32")
            undef = ir.Constant(_V, ir.Undefined)
            if scalef:
                rint = cgutils.get_or_insert_function(mod, ir.FunctionType(_V, [_V]),
                                                      "llvm.roundeven.v16f32")
                vscalef = cgutils.get_or_insert_function(
                    mod, ir.FunctionType(_V, [_V, _V, _V, ir.IntType(16), _I32]),
                    "llvm.x86.avx512.mask.scalef.ps.512")
            splat0 = ir.Constant(_VI, [0] * _LANES)

            def splat(x):
                return builder.shuffle_vector(builder.insert_element(undef, x, _I32(0)), undef,
                                              splat0)

            c2 = splat(builder.fmul(scale_, _F32(LOG2E)))

            def vptr(base, index, vt=_V):
                return builder.bitcast(builder.gep(base, [index]), vt.as_pointer())

            nv = NR // _LANES
            one = _F32(1.0)

            def row_of(p):
                """Row p's mask value, whether it is 1, and its NR // 16 score vectors."""
                mp = builder.load(builder.gep(M.data, [builder.mul(p, ldm)]))
                row = builder.gep(S.data, [builder.mul(p, _I64(NR))])
                s = [builder.load(vptr(row, _I64(_LANES * j)), align=4) for j in range(nv)]
                return mp, builder.fcmp_ordered("==", mp, one), s

            def scaled(mp, s):
                """x2 = s * scale * log2 e + (1 - mask) * float32 min."""
                add = splat(builder.fmul(builder.fsub(one, mp), _F32(F32_MIN)))
                return [builder.call(fma, [v, c2, add]) for v in s]

            def vmax(a, b):  # a plain max: the scores are not NaN (maxnum would check)
                return builder.select(builder.fcmp_ordered(">", a, b), a, b)

            def update(slots, values):
                for slot, v in zip(slots, values):
                    builder.store(vmax(builder.load(slot), v), slot)

            # pass 1: the column maxima of x2. With scale > 0, an unmasked row's x2 is
            # monotone in s: its maximum is taken over the raw scores and scaled once.
            mx = [cgutils.alloca_once_value(builder, _splat(-math.inf)) for _ in range(nv)]
            raw = [cgutils.alloca_once_value(builder, _splat(-math.inf)) for _ in range(nv)]
            positive = builder.fcmp_ordered(">", scale_, _F32(0.0))
            with builder.if_else(positive, likely=True) as (fast, general):
                with fast:
                    with cgutils.for_range(builder, t_) as loop:
                        mp, unmasked, s = row_of(loop.index)
                        with builder.if_else(unmasked, likely=True) as (plain, masked):
                            with plain:
                                update(raw, s)
                            with masked:
                                update(mx, scaled(mp, s))
                    update(mx, [builder.fmul(builder.load(slot), c2) for slot in raw])
                with general:
                    with cgutils.for_range(builder, t_) as loop:
                        mp, _, s = row_of(loop.index)
                        update(mx, scaled(mp, s))
            m = [builder.load(slot) for slot in mx]
            neg_m = [builder.fneg(v) for v in m]
            sums = [cgutils.alloca_once_value(builder, _splat(0.0)) for _ in range(nv)]
            ys = [cgutils.alloca_once(builder, _V) for _ in range(nv)]
            tile = ir.VectorType(_F32, mr)
            with cgutils.for_range(builder, t_) as loop:
                p = loop.index
                mp, unmasked, s = row_of(p)
                with builder.if_else(unmasked, likely=True) as (plain, masked):
                    with plain:  # y = s * scale * log2 e - max, one FMA
                        for slot, v, nm in zip(ys, s, neg_m):
                            builder.store(builder.call(fma, [v, c2, nm]), slot)
                    with masked:
                        for slot, x, mj in zip(ys, scaled(mp, s), m):
                            y = builder.fsub(x, mj, flags=_FAST)
                            if scalef:  # only here: an unmasked row's y is finite
                                y = builder.call(clamp, [y, _splat(_Y_LOW_SCALEF)])
                            builder.store(y, slot)
                for j in range(nv):
                    y = builder.load(ys[j])
                    if scalef:
                        n = builder.call(rint, [y])
                    else:
                        y = builder.call(clamp, [y, _splat(_Y_LOW)])
                        tt = builder.fadd(y, _splat(_MAGIC))
                        n = builder.fsub(tt, _splat(_MAGIC))
                    r = builder.fsub(y, n)
                    poly = _splat(C[-1])
                    for c in C[-2::-1]:
                        poly = builder.call(fma, [poly, r, _splat(c)])
                    poly = builder.call(fma, [poly, r, _splat(1.0)])
                    if scalef:  # poly * 2**n, all lanes, current rounding
                        e = builder.call(vscalef, [poly, n, undef, ir.Constant(ir.IntType(16), -1),
                                                   _I32(4)])
                    else:
                        bits = builder.shl(builder.bitcast(tt, _VI),
                                           ir.Constant(_VI, [23] * _LANES))
                        e = builder.fmul(poly, builder.bitcast(bits, _V), flags=_FAST)
                    builder.store(builder.fadd(builder.load(sums[j]), e, flags=_FAST), sums[j])
                    # queries 16j + k go to ap[tq0 + (16j + k) // mr, p, k % mr]
                    for g in range(_LANES // mr):
                        lanes = ir.Constant(ir.VectorType(_I32, mr),
                                            list(range(g * mr, (g + 1) * mr)))
                        v = builder.shuffle_vector(e, undef, lanes)
                        ti = builder.add(tq0_, _I64(j * (_LANES // mr) + g))
                        off = builder.add(builder.mul(ti, lda), builder.mul(p, _I64(mr)))
                        builder.store(v, vptr(A.data, off, tile), align=4)
            for j in range(nv):
                builder.store(builder.load(sums[j]), vptr(T.data, _I64(_LANES * j)), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return panel


softmax_panel8 = _make(8)  # config.MR; _make(4) would serve MR = 4 (untested: no such config)
# the shift-and-multiply form, for tests on an AVX-512 machine (what an AVX2 one runs)
softmax_panel8_shift = _make(8, scalef=False) if SCALEF else softmax_panel8
