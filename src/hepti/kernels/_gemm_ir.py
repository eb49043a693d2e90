"""packed_gemm's 8 x 32 register tile on packed A as explicit-vector LLVM IR, with the GeMM's
epilogue (bias, GeLU, residual) applied to the tile while it is still in registers.

    tile_packed8(ap, ao, kc, bp, bk0, c, co, ldc, accumulate, bias, bo, has_bias, gelu,
                 res, ro, ldr, has_res, pf, pq, pn, every)

computes, for i < 8 and j < 32,

    acc[i, j] = sum_(p < kc) ap[ao + p*8 + i] * bp[bk0 + p, j]      (+ c[co + i*ldc + j]
                                                                       when accumulate)
    c[co + i*ldc + j] = (GeLU(acc[i, j] + bias[bo + j]) + res[ro + i*ldr + j])

with the bias, the GeLU and the residual each only when its flag is set (packed_gemm
`_epilogue`'s order). ap is one packed A tile's k-major data (packed_gemm `_pack_a`, flat),
bp a 2-D [K, 32] panel, the others flat float32. While the k loop runs, pn cache lines of
pf from pf[pq] on (one every `every` k steps) are prefetched into L2: the next B panel,
as `_microkernels.full_tiles` does. No bounds checks: the callers' index arithmetic is
full_tiles'.

Why: the up projection's bias + GeLU ran as a second pass over each finished strip
(`epilogue_strip`): 16 more loads and stores a tile, and the GeLU's ~20 vector operations a
register could not overlap the next tile's FMAs. Here the GeLU is mathfn.gelu32 on
<16 x float> values (the same rational function, `llvm.fma.v16f32`, one fdiv), before the
single store. As in _tile_ir.py, plain LLVM IR without x86 intrinsics.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hepti.kernels import mathfn
from hepti.kernels._tile_ir import (accumulators, b_row, by_depth, fma_rows, l1_prefetch,
                                    prefetcher, register_passes)

_LANES = 16
_NV = 2  # 32 columns: two 16-float vectors
_MR = 8
_F32, _I64, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
_V = ir.VectorType(_F32, _LANES)
_FAST = ("contract", "nnan", "nsz")


def _vptr(builder, base, index):
    """A <16 x float>* at float index `index` of the float* `base`."""
    return builder.bitcast(builder.gep(base, [index]), _V.as_pointer())


def _splat(value: float):
    return ir.Constant(_V, [float(value)] * _LANES)


def _gelu(builder, fma, vmax, vmin, x):
    """mathfn.gelu32 on a <16 x float>: x * (t P(t^2) + Qh(t^2)) / (2 Qh(t^2)), t = x clamped."""
    t = builder.call(vmin, [builder.call(vmax, [x, _splat(-mathfn._GELU_CLAMP)]),
                            _splat(mathfn._GELU_CLAMP)])
    s = builder.fmul(t, t, flags=_FAST)
    cp, cq = mathfn.GELU_P, mathfn.GELU_QH
    p = builder.call(fma, [_splat(_f32(cp[-1])), s, _splat(_f32(cp[-2]))])
    for c in cp[-3::-1]:
        p = builder.call(fma, [p, s, _splat(_f32(c))])
    qh = builder.call(fma, [_splat(_f32(cq[-1])), s, _splat(_f32(cq[-2]))])
    for c in cq[-3::-1]:
        qh = builder.call(fma, [qh, s, _splat(_f32(c))])
    num = builder.call(fma, [t, p, qh])
    den = builder.fadd(qh, qh, flags=_FAST)
    return builder.fdiv(builder.fmul(x, num, flags=_FAST), den, flags=_FAST)


def _f32(c: float) -> float:
    """c rounded to float32, as mathfn's scalar constants are."""
    return float(np.float32(c))


@intrinsic
def tile_packed8(typingctx, ap, ao, kc, bp, bk0, c, co, ldc, accumulate, bias, bo, has_bias,
                 gelu, res, ro, ldr, has_res, pf, pq, pn, every):
    flat = (ap, c, bias, res, pf)
    if not (all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32
                for t in flat)
            and isinstance(bp, types.Array) and bp.ndim == 2 and bp.dtype == types.float32):
        return None
    sig = types.void(ap, ao, kc, bp, bk0, c, co, ldc, accumulate, bias, bo, has_bias, gelu,
                     res, ro, ldr, has_res, pf, pq, pn, every)

    def codegen(context, builder, signature, args):
        st = signature.args
        A = context.make_array(st[0])(context, builder, args[0])
        B = context.make_array(st[3])(context, builder, args[3])
        C = context.make_array(st[5])(context, builder, args[5])
        E = context.make_array(st[9])(context, builder, args[9])
        R = context.make_array(st[13])(context, builder, args[13])

        def i64(k):
            return context.cast(builder, args[k], st[k], types.int64)

        def flag(k):
            return context.cast(builder, args[k], st[k], types.boolean)

        ao_, kc_, bk0_, co_, ldc_, bo_, ro_, ldr_ = (
            i64(k) for k in (1, 2, 4, 6, 7, 10, 14, 15))
        accumulate_, has_bias_, gelu_, has_res_ = (flag(k) for k in (8, 11, 12, 16))
        ldb = builder.sdiv(cgutils.unpack_tuple(builder, B.strides, 2)[0], _I64(4))
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V, _V, _V]),
                                             "llvm.fma.v16f32")
        vmax = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V, _V]),
                                              "llvm.maxnum.v16f32")
        vmin = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V, _V]),
                                              "llvm.minnum.v16f32")
        step = prefetcher(context, builder, st, args)  # pf, pq, pn, every: the last four
        splat_mask = ir.Constant(ir.VectorType(_I32, _LANES), [0] * _LANES)
        abase = builder.gep(A.data, [ao_])
        bbase = builder.gep(B.data, [builder.mul(bk0_, ldb)])
        ahead = l1_prefetch(builder)

        def k_loop(acc, cols, from_l2):
            with cgutils.for_range(builder, kc_) as kl:
                p = kl.index
                step()
                bv = b_row(builder, bbase, p, ldb, ahead if from_l2 else None, cols)
                arow = builder.gep(abase, [builder.mul(p, _I64(_MR))])

                def x_of(i):
                    x = builder.load(builder.gep(arow, [_I64(i)]), align=4)
                    return builder.shuffle_vector(
                        builder.insert_element(ir.Constant(_V, ir.Undefined), x, _I32(0)),
                        ir.Constant(_V, ir.Undefined), splat_mask)
                fma_rows(builder, fma, acc, x_of, bv)

        def update(acc, f):
            """acc[i][j] = f(i, j, acc[i][j]) for each of the pass's accumulators."""
            for i, row in acc.items():
                for j, slot in row.items():
                    builder.store(f(i, j, builder.load(slot)), slot)

        def c_vec(i, j):
            return _vptr(builder, c_rows[i], _I64(_LANES * j))

        def r_vec(i, j):
            rrow = builder.gep(R.data, [builder.add(ro_, builder.mul(_I64(i), ldr_))])
            return _vptr(builder, rrow, _I64(_LANES * j))

        c_rows = [builder.gep(C.data, [builder.add(co_, builder.mul(_I64(i), ldc_))])
                  for i in range(_MR)]
        # a k-block's slice deeper than half of L1 (KC_PACKED's are up to 96 KB) comes from
        # L2 for each tile: its rows are prefetched into L1 ahead, as the fused convolution
        # tiles' are (_tile_ir.B_L1_AHEAD). Emerald Rapids guest, `hepti bench against REV
        # --in-process --case weights/minilm-l6:128 --case weights/bert-base:256 --rounds 40`,
        # two launches (2026-12-02): MiniLM 0.944x and 0.973x the time, BERT-base 0.979x and
        # 0.953x. Not measured on Zen 4.
        depth = builder.mul(kc_, _I64(_NV * _LANES * 4))
        for rows, cols in register_passes(_MR, _NV):  # one pass where the tile fits
            acc = accumulators(builder, rows, cols)
            by_depth(builder, depth, lambda deep: k_loop(acc, cols, deep))
            with builder.if_then(accumulate_):
                update(acc, lambda i, j, v: builder.fadd(
                    v, builder.load(c_vec(i, j), align=4), flags=_FAST))
            with builder.if_then(has_bias_):
                ebase = builder.gep(E.data, [bo_])
                bias_v = {j: builder.load(_vptr(builder, ebase, _I64(_LANES * j)), align=4)
                          for j in cols}
                update(acc, lambda i, j, v: builder.fadd(v, bias_v[j], flags=_FAST))
            with builder.if_then(gelu_):
                update(acc, lambda i, j, v: _gelu(builder, fma, vmax, vmin, v))
            with builder.if_then(has_res_):
                update(acc, lambda i, j, v: builder.fadd(
                    v, builder.load(r_vec(i, j), align=4), flags=_FAST))
            for i, row in acc.items():
                for j, slot in row.items():
                    builder.store(builder.load(slot), c_vec(i, j), align=4)
        return context.get_dummy_value()

    return sig, codegen
