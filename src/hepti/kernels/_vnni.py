"""Integer dot products of int8 weight panels with int16 activations, and the widening of a
panel's quad of rows, as Numba intrinsics (`dequant_quad`: plain LLVM IR, every CPU).

`isum_i16(tag, out, w, w_off, xq, x_off, nquads)` computes, for one k-interleaved panel
(int8.QuantB's layout: [K/4, NR, 4], 4 consecutive k of a column in 4 bytes; w an int8 or
int32 array, w_off in bytes) and `nquads` quads of k from the panel row at w_off:

    out[j] = sum over t < 4 * nquads of xq[x_off + t] * w[k0 + t, j]     (j < NR = 32; int32)

The whole loop over the quads is emitted as LLVM IR, so its accumulators stay in registers:
each 32 bytes of a quad row (8 columns x 4 k) are sign-extended to int16 (vpmovsxbw) and
multiplied by the quad's 4 activations, broadcast, in pairs (vpdpwssd on AVX-512 VNNI:
x0 w0 + x1 w1 into one int32 lane, x2 w2 + x3 w3 into the next; 16-byte loads, pmaddwd and
vpaddd on AVX2). At the end the two lanes of each column are added. Two chains of
accumulators take alternate quads, so that the multiply-add latency is hidden.

int32 cannot overflow: |xq| <= 32767 and |w| <= 127, so a sum of t products stays below
2**31 for t <= 516; callers keep a block at most 256 k (int8.XQ_GROUP_MAX).

Which instructions: `tag` is an empty array whose ndim names the level (`isa_tag`, levels as
config.INT_DOT_NAMES), a type, so Numba compiles and caches one specialisation per level and
a CPU only ever compiles the level Python hands it (int8.py caps it at the CPU's). A branch on
a run-time value would compile both, and LLVM cannot select VNNI instructions for a CPU
without them; closures per level were tried and are not cached by Numba across processes.
The x86 intrinsics are declared in their int32-vector forms, which LLVM >= 21 upgrades to its
int16 ones when it reads the module. On a VNNI CPU LLVM fuses the AVX2 level's pmaddwd + add
into a 256-bit vpdpwssd, so the tests here exercise its arithmetic, not its instructions.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I16, _I32, _I64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_QUAD_BYTES = 128  # one quad row of a panel: NR = 32 columns x 4 k


def _vec(t, n):
    return ir.VectorType(t, n)


def _splat_quad(builder, xptr, quad, lanes64):
    """The 4 int16 activations of one quad, broadcast to every 64-bit lane (as <2*l x i32>)."""
    p = builder.bitcast(builder.gep(xptr, [builder.mul(quad, _I64(4))]), _I64.as_pointer())
    v = builder.load(p, align=2)
    vec = builder.insert_element(ir.Constant(_vec(_I64, lanes64), None), v, _I32(0))
    splat = builder.shuffle_vector(vec, vec, ir.Constant(_vec(_I32, lanes64), [0] * lanes64))
    return builder.bitcast(splat, _vec(_I32, 2 * lanes64))


def _codegen_isum(vec_bytes, dot):
    """IR for the quad loop with loads of `vec_bytes` int8 (-> int16 lanes) at a time and
    `dot(builder, acc, x_splat, w16) -> acc` as the pairwise multiply-add."""
    lanes = vec_bytes // 2  # int32 lanes of an accumulator (2 per column)
    n_acc = _QUAD_BYTES // vec_bytes  # accumulators per chain, 8 // (lanes / 4) columns each
    acc_t = _vec(_I32, lanes)

    def codegen(context, builder, sig, args):
        out_t, w_t, _, x_t, _, _ = sig.args
        out = context.make_array(out_t)(context, builder, args[0])
        w = context.make_array(w_t)(context, builder, args[1])
        xq = context.make_array(x_t)(context, builder, args[3])
        w_off, x_off, nquads = (context.cast(builder, a, t, types.int64)
                                for a, t in ((args[i], sig.args[i]) for i in (2, 4, 5)))
        wptr = builder.gep(builder.bitcast(w.data, _I8.as_pointer()), [w_off])  # w_off: bytes
        xptr = builder.gep(xq.data, [x_off])
        zero = ir.Constant(acc_t, None)
        slots = [[cgutils.alloca_once_value(builder, zero) for _ in range(n_acc)]
                 for _ in range(2)]

        def body(quad, chain):
            xb = _splat_quad(builder, xptr, quad, lanes // 2)
            base = builder.gep(wptr, [builder.mul(quad, _I64(_QUAD_BYTES))])
            for a in range(n_acc):
                p = builder.bitcast(builder.gep(base, [_I64(a * vec_bytes)]),
                                    _vec(_I8, vec_bytes).as_pointer())
                w16 = builder.sext(builder.load(p, align=1), _vec(_I16, vec_bytes))
                slot = slots[chain][a]
                builder.store(dot(builder, builder.load(slot), xb,
                                  builder.bitcast(w16, acc_t)), slot)

        half = builder.sdiv(nquads, _I64(2))
        with cgutils.for_range(builder, half) as loop:
            q0 = builder.mul(loop.index, _I64(2))
            body(q0, 0)
            body(builder.add(q0, _I64(1)), 1)
        with builder.if_then(builder.icmp_signed("!=", builder.mul(half, _I64(2)), nquads)):
            body(builder.sub(nquads, _I64(1)), 0)
        # column j of accumulator a sits in lanes 2j and 2j+1: add them, store 32 int32
        sums = [builder.add(builder.load(slots[0][a]), builder.load(slots[1][a]))
                for a in range(n_acc)]
        optr = builder.bitcast(out.data, _I32.as_pointer())
        evens = ir.Constant(_vec(_I32, lanes), list(range(0, 2 * lanes, 2)))
        odds = ir.Constant(_vec(_I32, lanes), list(range(1, 2 * lanes, 2)))
        for a in range(0, n_acc, 2):
            even = builder.shuffle_vector(sums[a], sums[a + 1], evens)
            odd = builder.shuffle_vector(sums[a], sums[a + 1], odds)
            p = builder.bitcast(builder.gep(optr, [_I64(a * lanes // 2)]), acc_t.as_pointer())
            builder.store(builder.add(even, odd), p, align=4)
        return context.get_dummy_value()

    return codegen


def _typer(out, w, w_off, xq, x_off, nquads):
    ok = (isinstance(out, types.Array) and out.ndim == 1 and out.dtype == types.int32
          and isinstance(w, types.Array) and w.ndim == 1 and w.dtype in (types.int8, types.int32)
          and isinstance(xq, types.Array) and xq.ndim == 1 and xq.dtype == types.int16
          and all(isinstance(t, types.Integer) for t in (w_off, x_off, nquads)))
    return types.void(out, w, w_off, xq, x_off, nquads) if ok else None


def _call(builder, name, ret_t, *vals):
    fnty = ir.FunctionType(ret_t, [v.type for v in vals])
    return builder.call(cgutils.get_or_insert_function(builder.module, fnty, name), list(vals))


def _dot_vnni512(builder, acc, xb, w16):
    return _call(builder, "llvm.x86.avx512.vpdpwssd.512", acc.type, acc, xb, w16)


def _dot_avx2(builder, acc, xb, w16):
    v16 = _vec(_I16, 16)
    prod = _call(builder, "llvm.x86.avx2.pmadd.wd", acc.type, builder.bitcast(xb, v16),
                 builder.bitcast(w16, v16))
    return builder.add(acc, prod)


def isa_tag(level: int):
    """The empty array that names integer-dot kernel `level` (config.INT_DOT_NAMES) by its ndim
    (level + 1): the kernels take it as an argument, so Numba compiles (and caches) one
    specialisation per level, and a CPU compiles only the level Python hands it."""
    return np.empty((0,) * (int(level) + 1), np.int8)


@intrinsic
def isum_i16(typingctx, tag, out, w, w_off, xq, x_off, nquads):
    """out[0:32] = int32 sums of xq (int16) times a panel's int8 quads, by the kernel `tag`
    names (isa_tag): AVX-512 VNNI (level 2), AVX2 (level 1); level 0 emits nothing (the
    float path never calls it)."""
    sig = _typer(out, w, w_off, xq, x_off, nquads)
    if sig is None or not isinstance(tag, types.Array):
        return None
    level = tag.ndim - 1
    inner = {2: _codegen_isum(32, _dot_vnni512), 1: _codegen_isum(16, _dot_avx2)}.get(level)

    def codegen(context, builder, signature, args):
        if inner is not None:
            inner(context, builder, sig, args[1:])
        return context.get_dummy_value()

    return types.void(tag, *sig.args), codegen


@intrinsic
def dequant_quad(typingctx, buf, b_off, q, q_off, sc, s_off, per_col):
    """Rows 4 of one quad of an int8 panel, widened and scaled, into a float32 buffer:
    buf[b_off + t*32 + j] = float(byte t of q[q_off + j]) * (sc[s_off + j] if per_col else
    sc[s_off + t]), t < 4, j < 32 (q the panel's int32 lanes, offsets in elements).

    Plain LLVM vector IR (a byte shuffle per row, sitofp, fmul), which any CPU's backend
    lowers (vpermb / vpermt2b with AVX-512 VBMI): the bytes of a row come out with one shuffle
    instead of the shift pairs Numba's integer code makes."""
    arrays = (buf, q, sc)
    if not (all(isinstance(a, types.Array) for a in arrays)
            and buf.dtype == types.float32 and q.dtype == types.int32
            and sc.dtype == types.float32
            and all(isinstance(t, types.Integer) for t in (b_off, q_off, s_off))
            and isinstance(per_col, types.Boolean)):
        return None
    sig = types.void(buf, b_off, q, q_off, sc, s_off, per_col)

    def codegen(context, builder, signature, args):
        b_a = context.make_array(signature.args[0])(context, builder, args[0])
        q_a = context.make_array(signature.args[2])(context, builder, args[2])
        s_a = context.make_array(signature.args[4])(context, builder, args[4])
        offs = [context.cast(builder, args[i], signature.args[i], types.int64) for i in (1, 3, 5)]
        f32 = ir.FloatType()
        v32f = _vec(f32, 32)
        bptr = builder.gep(b_a.data, [offs[0]])
        qptr = builder.bitcast(builder.gep(q_a.data, [offs[1]]), _vec(_I8, 128).as_pointer())
        sptr = builder.gep(s_a.data, [offs[2]])
        qv = builder.load(qptr, align=4)
        rows = []
        for t in range(4):
            mask = ir.Constant(_vec(_I32, 32), [4 * j + t for j in range(32)])
            rows.append(builder.sitofp(builder.shuffle_vector(qv, qv, mask), v32f))

        def store(t, scale):
            p = builder.bitcast(builder.gep(bptr, [_I64(32 * t)]), v32f.as_pointer())
            builder.store(builder.fmul(rows[t], scale), p, align=4)

        with builder.if_else(args[6]) as (col, row):
            with col:
                svec = builder.load(builder.bitcast(sptr, v32f.as_pointer()), align=4)
                for t in range(4):
                    store(t, svec)
            with row:
                for t in range(4):
                    s = builder.load(builder.gep(sptr, [_I64(t)]))
                    v = builder.insert_element(ir.Constant(v32f, None), s, _I32(0))
                    store(t, builder.shuffle_vector(v, v, ir.Constant(_vec(_I32, 32), [0] * 32)))
        return context.get_dummy_value()

    return sig, codegen
