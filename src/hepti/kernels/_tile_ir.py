"""The fused convolution tile (`direct_tiles_epi*` in _microkernels.py) as explicit-vector LLVM
IR: `tile_epi8`, `tile_epi4`, `tile_epi1`, one mr x 32 register tile each (mr = 8, 4, 1).

    tile_epiMR(a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro, ldr,
               has_res, act)

computes, for i < mr and j < 32,

    acc[i, j] = sum_(s < n_seg) sum_(p < kc) a[ao + s*seg_a + i*lda + p] * bp[bk0 + s*kc + p, j]
    c[co + i*ldc + j] = act(acc[i, j] + bias[j] (+ res[ro + i*ldr + j] when has_res))

for the rows i < nv only (act 0 none, 1 ReLU, 2 ReLU6); a, c, bias, res flat float32, bp a 2-D
[K, 32] panel (any row stride). No bounds checks: the callers' index arithmetic is the
generated kernels'.

Why IR: the generated Numba kernel wrote the tile as 256 named scalars that LLVM's SLP
vectoriser packs into zmm registers. Its k loop was as tight as this one (two B loads, eight
broadcasts, 16 FMAs a k, unrolled by 2); around it, each segment re-derived its nine slices
with wraparound checks and stack spills. In cache, interleaved, this tile took 0.95x the
named scalars' time at kc 64, 0.96-0.99x at 3 segments of 192 and 0.98x at 3 of 768 (A read
in place; the same IR tile on packed A, one pointer, ran 112-116 GFLOP/s where both ran
93-113, so reading A in place from 8 row pointers, not the code, is most of what is left).
Here the accumulators are <16 x float> values from the start (mem2reg'd allocas), the FMAs
`llvm.fma.v16f32`, the activation `llvm.maxnum` / `llvm.minnum`: plain LLVM IR, no x86
intrinsics, so an AVX2 CPU gets the same tile as pairs of ymm registers. Where the tile's
accumulators do not fit the register file (AVX2's 16 ymm), it runs as passes over parts of it
that do (`register_passes`).
`tile_gathered{8,4,1}` take each row's start from an array (conv.py's `_MODE_PADDED`: tiles
whose rows cross output rows of a zero-padded x); `tile_scattered{8,4,1}` also store each
row at an offset from an array (conv.py's `_into_fused`: a 1x1's output written into the
interior of the zero-bordered map the next convolution reads). `tile_wide6_pf` is a gathered and
scattered 6 x 64 tile over two panels at once, without a residual (conv.py's `_padded_into`: 6
broadcasts of A for 24 FMAs, where the 8 x 32 tile has 8 for 16). `tile_*9` (MR_NINE rows) take
a block's last whole tile and the one row past it at once.

Numba's own cache does not see this file change under the cached kernels that inline it
(_microkernels.py's, conv.py's); hepti.kernels._cache does (each module's stamp covers the
kernel modules it imports), and drops them on the next import.
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from hepti.kernels import config

NR = 32  # columns of the tile: two 16-float vectors
_LANES = 16
_NV = NR // _LANES
_F32, _I64, _I32 = ir.FloatType(), ir.IntType(64), ir.IntType(32)
_V = ir.VectorType(_F32, _LANES)
_FAST = ("contract", "nnan", "nsz")
# The fused tiles (`_make`'s) read the whole K x 32 panel for every tile: there is no k-block,
# since each tile is stored once with its epilogue, so a panel deeper than L1 (K > ~300) comes
# from L2 a row of B (two lines) per k step. Each k step also prefetches into L1 the row
# B_L1_AHEAD steps ahead (0: none), so those loads do not rest on the core's own window to hide
# L2's latency. 16 rows is 2 KB of L1 and ~130 cycles of lead at the FMA peak (8 cycles a step),
# far more than L2's latency, for when the core runs slower than that. Emerald Rapids guest, in
# one process against the tree without it, the trees taking turns, bit-equal (2026-12-02;
# `hepti bench against REV --in-process`, 40 rounds): ResNet-50 0.955x the time at 160, 0.978x
# and 0.988x at 224; MobileNetV2 0.962x at 160, 0.975x at 224; VGG-16 1.001x. In scratch
# runs, ungated: 8 ahead 0.983x, 4 ahead 1.002x (ResNet-50). Not in the 6 x 64 tile
# (`_make_wide`: not measured). Not measured on Zen 4.
B_L1_AHEAD = 16
# ... where the panel is deeper than this many bytes (K x 32 floats; half of L1: the tile's A
# rows take the rest). A shallower panel stays in L1 from tile to tile, and the prefetches
# cost issue slots for nothing: with them everywhere MobileNetV2, whose 1x1s are mostly
# shallow, took 1.018x the time.
B_L1_BYTES = config.L1_BYTES // 2


def _vptr(builder, base, index):
    """A <16 x float>* at float index `index` of the float* `base`."""
    return builder.bitcast(builder.gep(base, [index]), _V.as_pointer())


def _lanes_mask(n: int):
    """<16 x i1>: the first n lanes."""
    return ir.Constant(ir.VectorType(ir.IntType(1), _LANES), [1] * n + [0] * (_LANES - n))


def load_cols(builder, ptr, n: int = _LANES):
    """The <16 x float> at ptr (a <16 x float>*), only its first n floats read (the rest 0)."""
    if n == _LANES:
        return builder.load(ptr, align=4)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(_V, [ptr.type, _I32, ir.VectorType(ir.IntType(1),
                                                                            _LANES), _V]),
        "llvm.masked.load.v16f32.p0")
    return builder.call(fn, [ptr, _I32(4), _lanes_mask(n), ir.Constant(_V, None)])


def store_cols(builder, value, ptr, n: int = _LANES) -> None:
    """Store the <16 x float> value at ptr, only its first n floats."""
    if n == _LANES:
        builder.store(value, ptr, align=4)
        return
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [_V, ptr.type, _I32,
                                                        ir.VectorType(ir.IntType(1), _LANES)]),
        "llvm.masked.store.v16f32.p0")
    builder.call(fn, [value, ptr, _I32(4), _lanes_mask(n)])


def _vector_fns(builder) -> tuple:
    """(fma, maxnum, minnum) on <16 x float> in the builder's module."""
    def fn(name, n):
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(_V, [_V] * n),
                                              name)
    return fn("llvm.fma.v16f32", 3), fn("llvm.maxnum.v16f32", 2), fn("llvm.minnum.v16f32", 2)


def _splat(builder, x):
    """<16 x float> of the float x in every lane."""
    return builder.shuffle_vector(
        builder.insert_element(ir.Constant(_V, ir.Undefined), x, _I32(0)),
        ir.Constant(_V, ir.Undefined), ir.Constant(ir.VectorType(_I32, _LANES), [0] * _LANES))


def _activation(builder, vmax, vmin, act_):
    """vals -> act(vals), act_ an int64 (0 none, 1 ReLU, 2 ReLU6), chosen by selects."""
    is_act = builder.icmp_signed("!=", act_, _I64(0))
    is_six = builder.icmp_signed("==", act_, _I64(2))
    zero, six = ir.Constant(_V, None), ir.Constant(_V, [6.0] * _LANES)

    def act(vals):
        relu = [builder.call(vmax, [v, zero]) for v in vals]
        relu6 = [builder.call(vmin, [v, six]) for v in relu]
        return [builder.select(is_act, builder.select(is_six, r6, r), v)
                for v, r, r6 in zip(vals, relu, relu6)]
    return act


def prefetcher(context, builder, st, args):
    """For a tile whose last four arguments are (pf, pq, pn, every): a function that, called
    once a k step inside the k loop, prefetches into L2 the next of pn lines of pf's memory
    from float pq of it on every `every` calls (`_make`'s prefetch; pf a float32 array of any
    shape, read as the contiguous floats from its start: a packed panel)."""
    n = len(st)
    P = context.make_array(st[n - 4])(context, builder, args[n - 4])
    pq_, pn_, every_ = (context.cast(builder, args[k], st[k], types.int64)
                        for k in (n - 3, n - 2, n - 1))
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
        "llvm.prefetch.p0")
    countdown = cgutils.alloca_once_value(builder, every_)
    line = cgutils.alloca_once_value(builder, pq_)
    end = builder.add(pq_, builder.mul(pn_, _I64(16)))

    def step():
        cd = builder.sub(builder.load(countdown), _I64(1))
        builder.store(cd, countdown)
        with builder.if_then(builder.icmp_signed("==", cd, _I64(0)), likely=False):
            builder.store(every_, countdown)
            q = builder.load(line)
            with builder.if_then(builder.icmp_signed("<", q, end)):
                builder.call(fn, [builder.bitcast(builder.gep(P.data, [q]), i8p),
                                  _I32(0), _I32(2), _I32(1)])
                builder.store(builder.add(q, _I64(16)), line)
    return step


def l1_prefetch(builder):
    """A function that, given the float* of B's row for this k step, the panel's row stride
    (floats) and the row's 16-float columns a pass reads, prefetches into L1 their lines in the
    row B_L1_AHEAD rows on (`b_row`'s, in the loops `by_depth` emits for a deep panel)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]),
        "llvm.prefetch.p0")

    def ahead(bq, ldb, cols):
        row = builder.gep(bq, [builder.mul(_I64(B_L1_AHEAD), ldb)])
        for j in cols:  # 16 floats: one line (read, L1)
            builder.call(fn, [builder.bitcast(builder.gep(row, [_I64(_LANES * j)]), i8p),
                              _I32(0), _I32(3), _I32(1)])
    return ahead


def b_row(builder, bbase, p, ldb, ahead, cols=range(_NV)):
    """Row p of a B panel (float* bbase, ldb floats a row) as {j: <16 x float>} for the
    16-float columns j in `cols`, those lines of the row B_L1_AHEAD on prefetched into L1
    first where `ahead` (an `l1_prefetch`) is given."""
    bq = builder.gep(bbase, [builder.mul(p, ldb)])
    if ahead is not None:
        ahead(bq, ldb, cols)
    return {j: builder.load(_vptr(builder, bq, _I64(_LANES * j)), align=4) for j in cols}


# --- register passes -----------------------------------------------------------------------
# A tile of mr rows x nv 16-float columns keeps mr * nv accumulators in registers, plus one
# row of B (nv) and a broadcast of A. AVX-512 holds an 8 x 32 tile in 19 of its 32 zmm; AVX2
# has 16 ymm of 8 floats, where the same tile wants 32 + 4 + 1: LLVM spilled accumulators to
# the stack in the k loop, and `hepti bench kernels`' gemm ran at 28-33 GFLOP/s on a Zen 3
# core where numpy's BLAS ran 55-67. Such a tile runs as passes over its rows and columns that
# each fit (6 x 16 floats: 12 accumulators, 2 of B, 1 broadcast, BLIS's Haswell shape), each
# pass the whole k loop and its own stores: B is read once a pass, not once a tile. Every
# output's sum takes the same FMAs in the same order, so the bits do not change. Zen 3, in one
# process, interleaved (2026-12-02, `hepti bench kernels --repeat 10`): gemm 53-66 GFLOP/s
# (0.85-0.98x numpy's time) where it ran 28-33; passes of 2 x 32 ran 44-50, of 3 x 32 (17
# registers: one accumulator spilled) 32-34. Whole forwards against the tree before, in one
# process, the trees taking turns, bit-equal (`hepti bench against 4e1bdd6 --in-process`, 12
# rounds): ResNet-50 @224 0.662x the time, VGG-16 0.507x, MobileNetV2 0.757x, MiniLM @128
# 0.612x (docs/cnn.md, "On a Zen 3 core"). Taking a deep panel's k in L1-sized chunks, every
# pass over a chunk before the next (the partial sums in a stack tile), so that B comes from L2
# once a tile and not once a pass, was slower: ResNet-50 1.10x, VGG-16 1.16x the time (`hepti
# bench against f75cc6e --in-process`, 12 rounds); the passes' long runs down the panel stream
# from L2 well. Nor did the 9-row tile's runs of 5 + 4 rows (10 and 8 accumulators, not 6 + 6
# + 3 + 3) change ResNet-50 (0.992x at 160, 1.016x at 224, 16 rounds).
def register_passes(mr: int, nv: int) -> list:
    """The passes, as (rows, columns) index tuples, that cover an mr x nv tile (nv 16-float
    columns) with each pass's accumulators, B row and broadcast in config's vector registers
    (read at each call, when a tile is compiled): the whole tile where it fits; else runs of
    rows as tall as a one-column pass holds, each with all columns where that fits and else
    one pass a column."""
    per_v = max(1, _LANES // config.VECTOR_LANES)  # hardware registers a <16 x float> takes

    def fits(r, c):
        return per_v * (r * c + c) + 1 <= config.VECTOR_REGS

    if fits(mr, nv):
        return [(tuple(range(mr)), tuple(range(nv)))]
    run = max([r for r in range(1, mr + 1) if fits(r, 1)], default=1)
    passes = []
    for r0 in range(0, mr, run):
        rows = tuple(range(r0, min(mr, r0 + run)))
        if fits(len(rows), nv):
            passes.append((rows, tuple(range(nv))))
        else:
            passes += [(rows, (j,)) for j in range(nv)]
    return passes


def accumulators(builder, rows, cols) -> dict:
    """acc[i][j], a zeroed <16 x float> slot (mem2reg makes it a register) for each i, j."""
    zero = ir.Constant(_V, None)
    return {i: {j: cgutils.alloca_once_value(builder, zero) for j in cols} for i in rows}


def fma_rows(builder, fma, acc, x_of, bv) -> None:
    """One k step of a pass: acc[i][j] += x_of(i) * bv[j] for its rows i and columns j, x_of(i)
    emitting the broadcast of row i's element of A."""
    for i in acc:
        xv = x_of(i)
        for j, b in bv.items():
            slot = acc[i][j]
            builder.store(builder.call(fma, [xv, b, builder.load(slot)]), slot)


def by_depth(builder, depth, k_loops) -> None:
    """Emit k_loops(True) for a panel or k-block of `depth` bytes (an i64) deeper than
    B_L1_BYTES, where its rows come from L2 and are prefetched into L1 (`l1_prefetch`), and
    k_loops(False) for a shallower one; only k_loops(False) when B_L1_AHEAD is 0."""
    if not B_L1_AHEAD:
        k_loops(False)
        return
    with builder.if_else(builder.icmp_signed(">", depth, _I64(B_L1_BYTES))) as (deep, shallow):
        with deep:
            k_loops(True)
        with shallow:
            k_loops(False)


def _make(mr: int, gathered: bool = False, scattered: bool = False, prefetch: bool = False,
          width: int = NR):
    """The intrinsic for an mr x width tile (width 32, or 16 or 24: the first columns of a
    32-wide panel, their bias, residual and output read and written only that far; MobileNetV2's
    narrow 1x1s, inverted.py); `gathered`: ao is an int64 array, row i of the tile
    starting at a[ao[i]] (lda unused), for tiles whose rows cross output rows; `scattered`
    (with gathered): co is one too, row i stored at c[co[i]] (ldc unused), for a tile whose
    output rows cross rows of a zero-bordered map (conv.py's `_into_fused`). `prefetch`: four
    more arguments (pf, pq, pn, every), and while the k loop runs pn cache lines of the
    float32 pf (its contiguous floats) from float pq on, one every `every` k steps, are
    prefetched into L2 (as _gemm_ir.tile_packed8's: the next panel, whose first tile would
    otherwise wait on memory; conv.py's PANEL_PREFETCH)."""

    def typer(a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro, ldr, has_res,
              act, *pf_args):
        if prefetch and not (isinstance(pf_args[0], types.Array)
                             and pf_args[0].dtype == types.float32):
            return None
        arrays = (a, c, bias, res)
        if gathered != (isinstance(ao, types.Array) and ao.dtype == types.int64):
            return None
        if scattered != (isinstance(co, types.Array) and co.dtype == types.int64):
            return None
        if not (all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32
                    for t in arrays)
                and isinstance(bp, types.Array) and bp.ndim == 2 and bp.dtype == types.float32):
            return None
        sig = types.void(a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro,
                         ldr, has_res, act, *pf_args)

        def codegen(context, builder, signature, args):
            st = signature.args
            A = context.make_array(st[0])(context, builder, args[0])
            B = context.make_array(st[6])(context, builder, args[6])
            step = prefetcher(context, builder, st, args) if prefetch else None
            ahead = l1_prefetch(builder)  # (`k_loops`, where the panel is deep)
            C = context.make_array(st[8])(context, builder, args[8])
            E = context.make_array(st[12])(context, builder, args[12])
            R = context.make_array(st[13])(context, builder, args[13])

            def i64(k):
                return context.cast(builder, args[k], st[k], types.int64)

            n_seg_, kc_, seg_a_, lda_, bk0_ = (i64(k) for k in (2, 3, 4, 5, 7))
            if gathered:
                offs = context.make_array(st[1])(context, builder, args[1]).data
                starts = [builder.load(builder.gep(offs, [_I64(i)])) for i in range(mr)]
            else:
                ao_ = i64(1)
                starts = [builder.add(ao_, builder.mul(_I64(i), lda_)) for i in range(mr)]
            nv_, ro_, ldr_, act_ = (i64(k) for k in (11, 14, 15, 17))
            if scattered:
                coffs = context.make_array(st[9])(context, builder, args[9]).data
                c_rows = [builder.load(builder.gep(coffs, [_I64(i)])) for i in range(mr)]
            else:
                co_, ldc_ = i64(9), i64(10)
                c_rows = [builder.add(co_, builder.mul(_I64(i), ldc_)) for i in range(mr)]
            has_res_ = context.cast(builder, args[16], st[16], types.boolean)
            ldb = builder.sdiv(cgutils.unpack_tuple(builder, B.strides, 2)[0], _I64(4))
            fma, vmax, vmin = _vector_fns(builder)
            act = _activation(builder, vmax, vmin, act_)

            def k_loops(acc, cols, from_l2):
                with cgutils.for_range(builder, n_seg_) as seg:
                    s = seg.index
                    abase = builder.gep(A.data, [builder.mul(s, seg_a_)])
                    rows = {i: builder.gep(abase, [starts[i]]) for i in acc}
                    brow0 = builder.add(bk0_, builder.mul(s, kc_))
                    bbase = builder.gep(B.data, [builder.mul(brow0, ldb)])
                    with cgutils.for_range(builder, kc_) as kl:
                        p = kl.index
                        if step is not None:
                            step()
                        bv = b_row(builder, bbase, p, ldb, ahead if from_l2 else None, cols)
                        fma_rows(builder, fma, acc, lambda i: _splat(builder, builder.load(
                            builder.gep(rows[i], [p]), align=4)), bv)

            nv = -(-width // _LANES)

            def n_of(j):
                """The floats of 16-float column j inside the tile's width."""
                return min(_LANES, width - _LANES * j)

            def store(acc, cols):
                bv = {j: load_cols(builder, _vptr(builder, E.data, _I64(_LANES * j)), n_of(j))
                      for j in cols}
                for i in acc:
                    with builder.if_then(builder.icmp_signed(">", nv_, _I64(i)), likely=True):
                        vals = [builder.fadd(builder.load(acc[i][j]), bv[j], flags=_FAST)
                                for j in cols]
                        rrow = builder.gep(R.data, [builder.add(ro_, builder.mul(_I64(i), ldr_))])
                        with_res = []
                        with builder.if_else(has_res_) as (then, otherwise):
                            with then:
                                r_vals = [builder.fadd(v, load_cols(
                                    builder, _vptr(builder, rrow, _I64(_LANES * j)), n_of(j)),
                                    flags=_FAST) for j, v in zip(cols, vals)]
                                then_bb = builder.block
                            with otherwise:
                                else_bb = builder.block
                        for r_val, val in zip(r_vals, vals):
                            phi = builder.phi(_V)
                            phi.add_incoming(r_val, then_bb)
                            phi.add_incoming(val, else_bb)
                            with_res.append(phi)
                        out = act(with_res)
                        crow = builder.gep(C.data, [c_rows[i]])
                        for j, v in zip(cols, out):
                            store_cols(builder, v, _vptr(builder, crow, _I64(_LANES * j)),
                                       n_of(j))

            depth = builder.mul(builder.mul(n_seg_, kc_), _I64(NR * 4))
            for rows_, cols in register_passes(mr, nv):
                acc = accumulators(builder, rows_, cols)
                by_depth(builder, depth, lambda deep: k_loops(acc, cols, deep))
                store(acc, cols)
            return context.get_dummy_value()

        return sig, codegen

    if prefetch:
        @intrinsic
        def tile_pf(typingctx, a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res,
                    ro, ldr, has_res, act, pf, pq, pn, every):
            return typer(a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro,
                         ldr, has_res, act, pf, pq, pn, every)
        return tile_pf

    @intrinsic
    def tile(typingctx, a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro,
             ldr, has_res, act):
        return typer(a, ao, n_seg, kc, seg_a, lda, bp, bk0, c, co, ldc, nv, bias, res, ro, ldr,
                     has_res, act)
    return tile


def _make_wide(mr: int):
    """The intrinsic for an mr x 64 tile over two panels at once (four <16 x float> columns),
    row i of A starting at a[ao[i]] and stored at c[co[i]] (ao, co int64 arrays, as
    `tile_scattered8`'s), bias and act applied, no residual:

        tile_wide(a, ao, n_seg, kc, seg_a, panels, jp, c, co, bias, act, pf, pq, pn, every)

    computes for i < mr and j < 64 (panel jp + j // 32, column j % 32)

        acc[i, j] = sum_(s < n_seg) sum_(p < kc) a[ao[i] + s*seg_a + p] * B[s*kc + p, j]
        c[co[i] + j] = act(acc[i, j] + bias[j])

    panels a C-contiguous [n_panels, K, 32] array. Each output's sum runs over the same k in
    the same order as the 32-wide tiles': the same bits. (s61-hA measured this tile, stored
    by ldc, on ResNet-50's zero-padded copies: 0.95-0.99x per layer, the forward within its
    noise; VGG-16's 3x3s on maps they no longer copy: conv.py's `_padded_into`.) Four more
    arguments (pf, pq, pn, every) prefetch the next pair of panels, as `_make`'s prefetch does."""

    @intrinsic
    def tile(typingctx, a, ao, n_seg, kc, seg_a, panels, jp, c, co, bias, act, pf, pq, pn,
             every):
        if not (isinstance(pf, types.Array) and pf.dtype == types.float32):
            return None
        if not (all(isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32
                    for t in (a, c, bias))
                and all(isinstance(t, types.Array) and t.dtype == types.int64 for t in (ao, co))
                and isinstance(panels, types.Array) and panels.ndim == 3
                and panels.dtype == types.float32 and panels.layout == "C"):
            return None
        sig = types.void(a, ao, n_seg, kc, seg_a, panels, jp, c, co, bias, act, pf, pq, pn,
                         every)
        nv = 2 * _NV

        def codegen(context, builder, signature, args):
            st = signature.args
            A = context.make_array(st[0])(context, builder, args[0])
            step = prefetcher(context, builder, st, args)
            P = context.make_array(st[5])(context, builder, args[5])
            C = context.make_array(st[7])(context, builder, args[7])
            E = context.make_array(st[9])(context, builder, args[9])

            def i64(k):
                return context.cast(builder, args[k], st[k], types.int64)

            n_seg_, kc_, seg_a_, jp_, act_ = (i64(k) for k in (2, 3, 4, 6, 10))
            offs = context.make_array(st[1])(context, builder, args[1]).data
            starts = [builder.load(builder.gep(offs, [_I64(i)])) for i in range(mr)]
            coffs = context.make_array(st[8])(context, builder, args[8]).data
            c_rows = [builder.load(builder.gep(coffs, [_I64(i)])) for i in range(mr)]
            lds = builder.sdiv(cgutils.unpack_tuple(builder, P.strides, 3)[0], _I64(4))
            ldb = _I64(NR)  # C-contiguous panels: the k loop's B addresses fold
            pbase = [builder.gep(P.data, [builder.mul(builder.add(jp_, _I64(q)), lds)])
                     for q in range(2)]
            fma, vmax, vmin = _vector_fns(builder)
            act = _activation(builder, vmax, vmin, act_)
            for rows_, cols in register_passes(mr, nv):
                acc = accumulators(builder, rows_, cols)
                with cgutils.for_range(builder, n_seg_) as seg:
                    s = seg.index
                    abase = builder.gep(A.data, [builder.mul(s, seg_a_)])
                    rows = {i: builder.gep(abase, [starts[i]]) for i in rows_}
                    brow0 = builder.mul(builder.mul(s, kc_), ldb)
                    bbase = [builder.gep(q, [brow0]) for q in pbase]
                    with cgutils.for_range(builder, kc_) as kl:
                        p = kl.index
                        step()
                        bq = [builder.gep(q, [builder.mul(p, ldb)]) for q in bbase]
                        bv = {j: builder.load(_vptr(builder, bq[j // _NV],
                                                    _I64(_LANES * (j % _NV))), align=4)
                              for j in cols}
                        fma_rows(builder, fma, acc, lambda i: _splat(builder, builder.load(
                            builder.gep(rows[i], [p]), align=4)), bv)
                bv = {j: builder.load(_vptr(builder, E.data, _I64(_LANES * j)), align=4)
                      for j in cols}
                for i in rows_:
                    vals = [builder.fadd(builder.load(acc[i][j]), bv[j], flags=_FAST)
                            for j in cols]
                    crow = builder.gep(C.data, [c_rows[i]])
                    for j, v in zip(cols, act(vals)):
                        builder.store(v, _vptr(builder, crow, _I64(_LANES * j)), align=4)
            return context.get_dummy_value()

        return sig, codegen

    return tile


# the heights _gen_microkernels.py may ask for (MR_FUSED and TAIL_HEIGHTS); each compiles only
# where a kernel uses it
tile_epi8 = _make(8)
tile_epi4 = _make(4)
tile_epi1 = _make(1)
tile_gathered8 = _make(8, True)
tile_gathered4 = _make(4, True)
tile_gathered1 = _make(1, True)
tile_scattered8 = _make(8, True, True)
tile_scattered4 = _make(4, True, True)
tile_scattered1 = _make(1, True, True)
# a block's last whole tile and the one row past it as one tile (rows = 8k + 1: ResNet-50's
# 7x7 maps at 224, its 5x5 at 160): 18 accumulators; the 1-row tile runs its two FMA chains at
# their latency, a quarter of the 8-row tile's time for an eighth of its rows (conv.py's
# `_tiles_fused`, `_padded_fused`, `_into_fused`)
MR_NINE = 9
# the 8- and 9-row tiles prefetching the next panel into L2 along the k loop (`_make`'s
# prefetch; conv.py's PANEL_PREFETCH)
tile_epi8_pf = _make(8, prefetch=True)
tile_epi9_pf = _make(MR_NINE, prefetch=True)
tile_gathered8_pf = _make(8, True, prefetch=True)
tile_gathered9_pf = _make(MR_NINE, True, prefetch=True)
tile_scattered8_pf = _make(8, True, True, prefetch=True)
tile_scattered9_pf = _make(MR_NINE, True, True, prefetch=True)
# 8 x 16 and 8 x 24 on the first columns of a panel (inverted.py's narrow 1x1s, where the
# generated narrow tiles do not fit the registers)
tile_narrow16 = _make(8, width=16)
tile_narrow24 = _make(8, width=24)
# MR_WIDE x 64 over two panels, gathered and scattered (conv.py's `_padded_into`)
MR_WIDE = 6
tile_wide6_pf = _make_wide(MR_WIDE)
