"""A 16 x 16 float32 block transpose as explicit-vector LLVM IR (a Numba intrinsic):
`transpose16(src, s_off, lds, dst, d_off, ldd)` sets dst[d_off + j*ldd + i] = src[s_off + i*lds + j]
for i, j < 16 (src, dst flat float32 arrays; no bounds checks: the caller's indices).

How: the 16 rows are loaded as <16 x float> values and the off-diagonal blocks of size 8, 4,
2, 1 swapped in turn (four stages of 16 two-source shuffles: vpermt2ps / vshuf* on AVX-512),
then the 16 columns stored. Attention's Q^T panel (`attention_core._pack_qt`) was an element
by element gather, one scalar load and store per float. Plain LLVM IR: no x86 intrinsic.

`pack8(src, s_off, lds, dst, d_off)` does the same for a GeMM's packed A tile: 8 rows of 16
floats to dst[d_off + p*8 + i] = src[s_off + i*lds + p] (i < 8, p < 16), the k-major layout
`packed_gemm._pack_a` writes, in 24 two-source shuffles (`pack8_masks`) and 8 contiguous
stores. Scalar, a float at a time, that pack was 2% of a MiniLM forward (the down projection's
A, 128 x 1536, 54 us a layer).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_LANES = 16
_F32, _I32, _I64 = ir.FloatType(), ir.IntType(32), ir.IntType(64)
_V = ir.VectorType(_F32, _LANES)


def stages(n: int = _LANES):
    """[(s, mask_low, mask_high)]: stage s makes, from rows a = v[i], b = v[i + s] (i & s == 0),
    v[i] = shuffle(a, b, mask_low) and v[i + s] = shuffle(a, b, mask_high)."""
    out = []
    s = n // 2
    while s:
        low = [l if not l & s else n + l - s for l in range(n)]
        high = [l + s if not l & s else n + l for l in range(n)]
        out.append((s, low, high))
        s //= 2
    return out


def transpose_ref(rows: list) -> list:
    """The shuffles applied to Python lists (for tests): rows[i][j] -> out[j][i]."""
    v = [list(r) for r in rows]
    for s, low, high in stages(len(v)):
        for i in range(len(v)):
            if i & s:
                continue
            ab = v[i] + v[i + s]
            v[i], v[i + s] = [ab[k] for k in low], [ab[k] for k in high]
    return v


@intrinsic
def transpose16(typingctx, src, s_off, lds, dst, d_off, ldd):
    if not (all(isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.float32
                for a in (src, dst))
            and all(isinstance(x, types.Integer) for x in (s_off, lds, d_off, ldd))):
        return None
    sig = types.void(src, s_off, lds, dst, d_off, ldd)

    def codegen(context, builder, signature, args):
        sa = signature.args
        S = context.make_array(sa[0])(context, builder, args[0])
        D = context.make_array(sa[3])(context, builder, args[3])
        s_off_, lds_, d_off_, ldd_ = (context.cast(builder, args[k], sa[k], types.int64)
                                      for k in (1, 2, 4, 5))

        def vptr(base, off):
            return builder.bitcast(builder.gep(base, [off]), _V.as_pointer())

        v = [builder.load(vptr(S.data, builder.add(s_off_, builder.mul(_I64(i), lds_))), align=4)
             for i in range(_LANES)]
        for s, low, high in stages():
            for i in range(_LANES):
                if i & s:
                    continue
                a, b = v[i], v[i + s]
                v[i] = builder.shuffle_vector(a, b, ir.Constant(ir.VectorType(_I32, _LANES), low))
                v[i + s] = builder.shuffle_vector(a, b,
                                                  ir.Constant(ir.VectorType(_I32, _LANES), high))
        for j in range(_LANES):
            builder.store(v[j], vptr(D.data, builder.add(d_off_, builder.mul(_I64(j), ldd_))),
                          align=4)
        return context.get_dummy_value()

    return sig, codegen


def _pack8_layouts():
    """The four layouts of pack8, each a function (vector v, lane l) -> (row i, column p) of
    the 8 x 16 block: the rows as loaded; then rows' bits 2, 1, 0 traded in turn for columns'
    bits 3, 2, 1 (each stage pairs vectors that differ in one bit: two-source shuffles); the
    last lane order (p & 1, i) is the packed tile's, two k steps of 8 rows a vector."""
    def b(x, n):
        return (x >> n) & 1
    return [
        lambda v, l: (v, l),
        # vector (p3, i1, i0), lane (i2, p2, p1, p0)
        lambda v, l: (b(l, 3) * 4 + (v & 3), b(v, 2) * 8 + (l & 7)),
        # vector (p3, p2, i0), lane (i2, i1, p1, p0)
        lambda v, l: (b(l, 3) * 4 + b(l, 2) * 2 + (v & 1), (v >> 1) * 4 + (l & 3)),
        # vector (p3, p2, p1), lane (p0, i2, i1, i0)
        lambda v, l: (l & 7, v * 2 + b(l, 3)),
    ]


def pack8_masks():
    """[(bit, [(v, lo source, hi source, mask)] for the 8 vectors)] for pack8's three stages:
    vector v of the next layout is shuffle(prev[lo], prev[hi], mask), lo and hi the two
    vectors of the previous layout that differ in `bit`; found by looking every element up."""
    lay = _pack8_layouts()
    out = []
    for stage, bit in zip(range(1, 4), (2, 1, 0)):
        prev, nxt = lay[stage - 1], lay[stage]
        where = {prev(v, l): (v, l) for v in range(8) for l in range(_LANES)}
        vecs = []
        for v in range(8):
            lo, hi = v & ~(1 << bit), v | (1 << bit)
            mask = []
            for l in range(_LANES):
                sv, sl = where[nxt(v, l)]
                if sv not in (lo, hi):
                    raise AssertionError("pack8 layouts: a stage needs a third source")
                mask.append(sl if sv == lo else _LANES + sl)
            vecs.append((v, lo, hi, mask))
        out.append((bit, vecs))
    return out


def pack8_ref(rows: list) -> list:
    """pack8's shuffles on Python lists (for tests): 8 rows of 16 -> the 128 packed floats."""
    v = [list(r) for r in rows]
    for _, vecs in pack8_masks():
        v = [[(v[lo] + v[hi])[k] for k in mask] for _, lo, hi, mask in vecs]
    return [x for vec in v for x in vec]


@intrinsic
def pack8(typingctx, src, s_off, lds, dst, d_off):
    # dst: any float32 array whose memory from d_off on is contiguous (a packed A tile [k, 8],
    # however Numba types its layout); its data pointer is all that is used
    if not (isinstance(src, types.Array) and src.ndim == 1 and src.dtype == types.float32
            and isinstance(dst, types.Array) and dst.dtype == types.float32
            and all(isinstance(x, types.Integer) for x in (s_off, lds, d_off))):
        return None
    sig = types.void(src, s_off, lds, dst, d_off)
    masks = pack8_masks()

    def codegen(context, builder, signature, args):
        sa = signature.args
        S = context.make_array(sa[0])(context, builder, args[0])
        D = context.make_array(sa[3])(context, builder, args[3])
        s_off_, lds_, d_off_ = (context.cast(builder, args[k], sa[k], types.int64)
                                for k in (1, 2, 4))

        def vptr(base, off):
            return builder.bitcast(builder.gep(base, [off]), _V.as_pointer())

        v = [builder.load(vptr(S.data, builder.add(s_off_, builder.mul(_I64(i), lds_))), align=4)
             for i in range(8)]
        for _, vecs in masks:
            v = [builder.shuffle_vector(v[lo], v[hi],
                                        ir.Constant(ir.VectorType(_I32, _LANES), mask))
                 for _, lo, hi, mask in vecs]
        for q in range(8):
            builder.store(v[q], vptr(D.data, builder.add(d_off_, _I64(q * _LANES))), align=4)
        return context.get_dummy_value()

    return sig, codegen
