"""Output rows of a 3x3 depthwise convolution (stride 1 or 2, no column dilation) as LLVM
IR with explicit vector types, written by a Numba intrinsic the way `_vnni.py` writes its loops.

`dw3x3_s1` / `dw3x3_s2(x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res,
has_res, y, y_off, act)`: nrows output rows of wo pixels of one image, flat NHWC with c
channels, the image's h rows of w pixels starting at x[x_img]. Kernel row ky of output row r
reads input row iy0 + r * s + ky * dh (s the stride), or the row of zeros `zero` (w * c floats)
when that row lies outside 0 .. h-1; output pixel i's tap (ky, kx) is that row's column
i * s - pl + kx, zero outside 0 .. w-1. Pixel i of row r is stored at
y[y_off + (r * wo + i) * c:][:c] as act(bias + the nine products (+ res at the same offset
as y when has_res)); act 0 none, 1 ReLU, 2 ReLU6. taps is [9, c] (conv.ConvWeight.taps).

How: one 16-channel block (one zmm) at a time, its nine taps and bias held in registers, walks
the rows. The input columns slide: each step of PIXELS outputs loads only the 3 * s * PIXELS
column vectors it does not share with the step before, the 3 - s shared ones stay in
registers, and its PIXELS independent FMA chains hide the FMA latency. Only the first and last
pixels, whose columns may lie outside the image, check their loads (one column at a time,
a select to zero). A channel count that is not a multiple of 16 ends with one masked block
(llvm.masked.load / store). ReLU / ReLU6 are a compare and a select against constants (one
max / min each); each (act, residual) pair has its own loop, chosen once per call.

Why: Numba's SLP vectoriser left the scalar versions of this (the 4-pixel `_dw3x3_quads`, a
generated 4 x 16-channel tile) at about twice the cycles their loads and FMAs need, and the
border pixels went tap by tap (`conv._dw_pixel`). The IR is plain LLVM (llvm.fma,
llvm.masked.*, no x86 intrinsic), so it compiles for any CPU; LLVM splits <16 x float> into
two ymm on AVX2.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

LANES = 16  # channels per block: one zmm register of float32
PIXELS = 6  # outputs per step along a row (independent FMA chains; 2, 4, 8: 2-10% slower)

_F32, _I1, _I32, _I64 = ir.FloatType(), ir.IntType(1), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, LANES)
_M = ir.VectorType(_I1, LANES)


def _splat(value: float):
    return ir.Constant(_V, [value] * LANES)


class _Emit:
    """IR helpers bound to one builder: vector loads and stores (masked or not), fma."""

    def __init__(self, builder, mask):
        self.b, self.mask = builder, mask
        mod = builder.module
        self.fma = cgutils.get_or_insert_function(
            mod, ir.FunctionType(_V, [_V, _V, _V]), "llvm.fma.v16f32")
        if mask is not None:
            self.mload = cgutils.get_or_insert_function(
                mod, ir.FunctionType(_V, [_V.as_pointer(), _I32, _M, _V]),
                "llvm.masked.load.v16f32.p0")
            self.mstore = cgutils.get_or_insert_function(
                mod, ir.FunctionType(ir.VoidType(), [_V, _V.as_pointer(), _I32, _M]),
                "llvm.masked.store.v16f32.p0")

    def ptr(self, base, off):
        return self.b.bitcast(self.b.gep(base, [off]), _V.as_pointer())

    def load(self, base, off):
        p = self.ptr(base, off)
        if self.mask is None:
            return self.b.load(p, align=4)
        return self.b.call(self.mload, [p, _I32(4), self.mask, ir.Constant(_V, None)])

    def store(self, value, base, off):
        p = self.ptr(base, off)
        if self.mask is None:
            self.b.store(value, p, align=4)
        else:
            self.b.call(self.mstore, [value, p, _I32(4), self.mask])


def _codegen(stride: int, step: int = PIXELS):
    s = stride
    keep = 3 - s  # input columns a step shares with the next one

    def block(builder, e, rows, dims, j0, act, has_res):
        """One channel block from channel j0 of all the output rows."""
        xp, zp, x_img, iy0, h, dh, nrows = rows
        tp, bp, rp, yp, w, c, wo, pl, y_off0 = dims
        k = [e.load(tp, builder.add(builder.mul(_I64(t), c), j0)) for t in range(9)]
        bias = e.load(bp, j0)
        carry = [[cgutils.alloca_once(builder, _V) for _ in range(keep)] for _ in range(3)]
        with cgutils.for_range(builder, nrows) as row:
            xrows = []
            for ky in range(3):  # a kernel row outside the image reads the zero row
                iy = builder.add(builder.add(iy0, builder.mul(row.index, _I64(s))),
                                 builder.mul(_I64(ky), dh))
                inside = builder.and_(builder.icmp_signed(">=", iy, _I64(0)),
                                      builder.icmp_signed("<", iy, h))
                o = builder.add(x_img, builder.mul(builder.mul(iy, w), c))
                xrows.append(builder.select(inside, builder.gep(xp, [o]), zp))
            y_off = builder.add(y_off0, builder.mul(row.index, builder.mul(wo, c)))
            _row(builder, e, k, bias, carry, xrows, w, c, wo, pl, rp, yp, y_off, j0, act,
                 has_res)

    def _row(builder, e, k, bias, carry, xrows, w, c, wo, pl, rp, yp, y_off, j0, act,
             has_res):
        """Output row from its kernel rows' pointers xrows, channel block j0."""
        zero = ir.Constant(_V, None)

        def col(ky, q, checked):  # input column q of kernel row ky (checked: zero outside)
            if not checked:
                return e.load(xrows[ky], builder.add(builder.mul(q, c), j0))
            inside = builder.and_(builder.icmp_signed(">=", q, _I64(0)),
                                  builder.icmp_signed("<", q, w))
            v = e.load(xrows[ky], builder.add(builder.mul(builder.select(inside, q, _I64(0)),
                                                          c), j0))
            return builder.select(inside, v, zero)

        def finish(accs, i0):
            for i, v in enumerate(accs):
                yo = builder.add(builder.add(y_off, builder.mul(builder.add(i0, _I64(i)), c)),
                                 j0)
                if has_res:
                    v = builder.fadd(v, e.load(rp, yo))
                if act:
                    v = builder.select(builder.fcmp_ordered(">", v, zero), v, zero)
                if act == 2:
                    six = _splat(6.0)
                    v = builder.select(builder.fcmp_ordered("<", v, six), v, six)
                e.store(v, yp, yo)

        def pixels(i0, n, checked):
            """n outputs from output pixel i0: its first 3 - s columns from the carry, the
            rest loaded (checked: zero outside the image), the last 3 - s kept."""
            q0 = builder.sub(builder.mul(i0, _I64(s)), pl)
            cols = [[builder.load(carry[ky][q]) for q in range(keep)] for ky in range(3)]
            for ky in range(3):
                for q in range(keep, s * (n - 1) + 3):
                    cols[ky].append(col(ky, builder.add(q0, _I64(q)), checked))
            accs = [bias] * n
            for ky in range(3):
                for kx in range(3):
                    for i in range(n):
                        accs[i] = builder.call(e.fma, [cols[ky][s * i + kx], k[3 * ky + kx],
                                                       accs[i]])
            finish(accs, i0)
            for ky in range(3):
                for q in range(keep):
                    builder.store(cols[ky][s * n + q], carry[ky][q])

        def clamp(v, lo, hi):
            v = builder.select(builder.icmp_signed("<", v, lo), lo, v)
            return builder.select(builder.icmp_signed(">", v, hi), hi, v)

        # pixels [i_a, i_b) load only columns inside the image: i*s - pl + 3 - s >= 0 and
        # i*s - pl + 2 <= w - 1 (numerators checked for sign: sdiv truncates)
        num_a = builder.sub(pl, _I64(keep))
        i_a = builder.select(builder.icmp_signed("<=", num_a, _I64(0)), _I64(0),
                             builder.sdiv(builder.add(num_a, _I64(s - 1)), _I64(s)))
        i_a = clamp(i_a, _I64(0), wo)
        num_b = builder.add(builder.sub(w, _I64(3)), pl)
        i_b = builder.select(builder.icmp_signed("<", num_b, _I64(0)), _I64(0),
                             builder.add(builder.sdiv(num_b, _I64(s)), _I64(1)))
        i_b = clamp(i_b, i_a, wo)
        q0 = builder.sub(_I64(0), pl)  # the carry for pixel 0
        for ky in range(3):
            for q in range(keep):
                builder.store(col(ky, builder.add(q0, _I64(q)), True), carry[ky][q])
        with cgutils.for_range(builder, i_a) as loop:
            pixels(loop.index, 1, True)
        steps = builder.sdiv(builder.sub(i_b, i_a), _I64(step))
        with cgutils.for_range(builder, steps) as loop:
            pixels(builder.add(i_a, builder.mul(loop.index, _I64(step))), step, False)
        tail0 = builder.add(i_a, builder.mul(steps, _I64(step)))
        with cgutils.for_range(builder, builder.sub(i_b, tail0)) as loop:
            pixels(builder.add(tail0, loop.index), 1, False)
        with cgutils.for_range(builder, builder.sub(wo, i_b)) as loop:
            pixels(builder.add(i_b, loop.index), 1, True)

    def codegen(context, builder, sig, args):
        def arg64(i):
            return context.cast(builder, args[i], sig.args[i], types.int64)

        def data(i):
            return context.make_array(sig.args[i])(context, builder, args[i]).data

        rows = (data(0), data(6), arg64(1), arg64(2), arg64(3), arg64(4), arg64(5))
        w, c, wo, pl = (arg64(i) for i in (7, 8, 9, 10))
        dims = (data(11), data(12), data(13), data(15), w, c, wo, pl, arg64(16))
        act = arg64(17)
        has_res = context.cast(builder, args[14], sig.args[14], types.boolean)
        variant = builder.add(act, builder.select(has_res, _I64(3), _I64(0)))
        nblk = builder.sdiv(c, _I64(LANES))
        c16 = builder.mul(nblk, _I64(LANES))
        rem = builder.sub(c, c16)
        lane = ir.Constant(ir.VectorType(_I64, LANES), list(range(LANES)))
        rem_v = builder.insert_element(ir.Constant(ir.VectorType(_I64, LANES), None), rem,
                                       _I32(0))
        rem_v = builder.shuffle_vector(rem_v, rem_v,
                                       ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES))
        mask = builder.icmp_signed("<", lane, rem_v)
        end = builder.append_basic_block("dw_end")
        cases = [(a, hr, builder.append_basic_block(f"dw_act{a}_res{int(hr)}"))
                 for a in (0, 1, 2) for hr in (False, True)]
        switch = builder.switch(variant, end)
        for a, hr, bb in cases:
            switch.add_case(_I64(a + 3 * hr), bb)
        for a, hr, bb in cases:
            builder.position_at_end(bb)
            with cgutils.for_range(builder, nblk) as blk:
                block(builder, _Emit(builder, None), rows, dims,
                      builder.mul(blk.index, _I64(LANES)), a, hr)
            with builder.if_then(builder.icmp_signed(">", rem, _I64(0))):
                block(builder, _Emit(builder, mask), rows, dims, c16, a, hr)
            builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return codegen


def _typer(x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res, has_res, y,
           y_off, act):
    f32_1d = all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32
                 for a in (x, zero, bias, res, y))
    ok = (f32_1d and isinstance(taps, types.Array) and taps.ndim == 2 and taps.layout == "C"
          and taps.dtype == types.float32 and isinstance(has_res, types.Boolean)
          and all(isinstance(t, types.Integer)
                  for t in (x_img, iy0, h, dh, nrows, w, c, wo, pl, y_off, act)))
    if not ok:
        return None
    return types.void(x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res, has_res,
                      y, y_off, act)


@intrinsic
def dw3x3_s1(typingctx, x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res,
             has_res, y, y_off, act):
    """Output rows of a stride-1 depthwise 3x3 convolution (see the module docstring)."""
    sig = _typer(x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res, has_res, y,
                 y_off, act)
    return None if sig is None else (sig, _codegen(1))


@intrinsic
def dw3x3_s2(typingctx, x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res,
             has_res, y, y_off, act):
    """Output rows of a stride-2 depthwise 3x3 convolution (see the module docstring)."""
    sig = _typer(x, x_img, iy0, h, dh, nrows, zero, w, c, wo, pl, taps, bias, res, has_res, y,
                 y_off, act)
    return None if sig is None else (sig, _codegen(2))
