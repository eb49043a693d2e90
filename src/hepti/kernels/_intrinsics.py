"""LLVM operations Numba does not expose, written as Numba intrinsics.

* `int32_bits_as_float32(i)`: reinterpret an integer's low 32 bits as a float32 (builds 2**n in
  the vectorisable exp of mathfn.py).
* `prefetch_l2(arr, i)`: hint the CPU to bring the cache line holding arr[i] into L2 ahead of
  use (prefetcht1). The GeMM issues these for the next B panel while it computes the current
  one, so that panel arrives from L3/memory during arithmetic instead of stalling it. A
  prefetch never faults, so i may point past the array.
* `max_f32(a, b)`: float32 max as llvm.maxnum, so that a max reduction vectorises (the int8
  GeMV's activation quantiser).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def int32_bits_as_float32(typingctx, bits):
    """Reinterpret the low 32 bits of an integer as a float32 (a register move; vectorises)."""
    if not isinstance(bits, types.Integer):
        return None
    sig = types.float32(bits)

    def codegen(context, builder, signature, args):
        low = builder.trunc(args[0], ir.IntType(32)) if bits.bitwidth > 32 else args[0]
        return builder.bitcast(low, ir.FloatType())

    return sig, codegen


def _prefetch(name: str, rw: int, locality: int):
    """The intrinsic `name`(arr, index): the cache line of arr[index] (1-D array, no bounds
    check; a prefetch never faults) prefetched by llvm.prefetch with rw and locality."""
    def fetch(typingctx, arr, index):
        if not (isinstance(arr, types.Array) and arr.ndim == 1
                and isinstance(index, types.Integer)):
            return None
        sig = types.void(arr, index)

        def codegen(context, builder, signature, args):
            ary = context.make_array(signature.args[0])(context, builder, args[0])
            ptr = builder.gep(ary.data, [args[1]])
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
            fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0")
            # args: address, rw, locality, cache = 1 (data)
            builder.call(fn, [builder.bitcast(ptr, i8p), i32(rw), i32(locality), i32(1)])
            return context.get_dummy_value()

        return sig, codegen

    fetch.__name__ = fetch.__qualname__ = name
    return intrinsic(fetch)


# arr[index]'s line into L2 (rw 0: read; locality 2 -> prefetcht1)
prefetch_l2 = _prefetch("prefetch_l2", 0, 2)
# arr[index]'s line for writing (rw 1: prefetchw, locality 3): the line arrives owned, so a
# tile's store to it does not wait for the read-for-ownership a store to a line not in cache
# makes. For the fused tiles' outputs where no residual is read before them (conv.py's
# `_tiles_fused`, `_padded_fused`, `_into_fused`: the next tile's rows, ResNet-50's maps
# written fresh each block, 0.8-3.3 MB at 224).
prefetch_w = _prefetch("prefetch_w", 1, 3)


@intrinsic
def max_f32(typingctx, a, b):
    """max(a, b) of two float32 as llvm.maxnum (no NaN handling): a max reduction written with
    it vectorises, where Numba's max() (NaN-aware branches) keeps the loop scalar."""
    if not (a == types.float32 and b == types.float32):
        return None
    sig = types.float32(a, b)

    def codegen(context, builder, signature, args):
        f32 = ir.FloatType()
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [f32, f32]),
                                            "llvm.maxnum.f32")
        return builder.call(fn, list(args), fastmath=("nnan", "nsz"))

    return sig, codegen
