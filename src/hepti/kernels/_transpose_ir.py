"""A 16 x 16 float32 block transpose as explicit-vector LLVM IR (a Numba intrinsic):
`transpose16(src, s_off, lds, dst, d_off, ldd)` sets dst[d_off + j*ldd + i] = src[s_off + i*lds + j]
for i, j < 16 (src, dst flat float32 arrays; no bounds checks: the caller's indices).

How: the 16 rows are loaded as <16 x float> values and the off-diagonal blocks of size 8, 4,
2, 1 swapped in turn (four stages of 16 two-source shuffles: vpermt2ps / vshuf* on AVX-512),
then the 16 columns stored. Attention's Q^T panel (`attention_core._pack_qt`) was an element
by element gather, one scalar load and store per float. Plain LLVM IR: no x86 intrinsic.
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
