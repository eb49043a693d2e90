"""MobileNetV2's inverted-residual block as one kernel (hepti.kernels.inverted) against its
float64 twin (hepti.kernels.naive's convolutions in a chain) and against the three separate
float32 kernels (the same arithmetic in the same order: equal bit for bit), and the band
executor running it (hepti.parallel.bands) against the ops one by one.

Shapes: stride 1 and 2, with and without the expand (MobileNetV2's first block), a residual,
batch 2, rows a multiple of MR wide (the 1x1s read x in place) and not, a band's own top and
bottom padding (0 or 1 each), tiles of 1 row, a few rows and the whole map."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hepti.kernels import conv2d, naive, pack_conv_weight
from hepti.kernels.inverted import InvertedBlock, inverted_residual, tile_rows
from hepti.kernels.inverted_chain import InvertedChain

RNG = np.random.default_rng(20261129)


def rand(*shape, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def block(cin, hid, cout, expand=True):
    """Weights of one block: [(torch weight, bias)] for expand (if any), depthwise, project."""
    ws = [(rand(hid, cin, 1, 1, scale=1 / math.sqrt(cin)), rand(hid))] if expand else []
    ws.append((rand(hid, 1, 3, 3, scale=1 / 3), rand(hid)))
    ws.append((rand(cout, hid, 1, 1, scale=1 / math.sqrt(hid)), rand(cout)))
    return ws


def packed(ws):
    *e, d, p = ws
    out = [(pack_conv_weight(e[0][0]), e[0][1])] if e else [(None, None)]
    out.append((pack_conv_weight(d[0], groups=d[0].shape[0]), d[1]))
    out.append((pack_conv_weight(p[0]), p[1]))
    return [v for pair in out for v in pair]


def oracle(x, ws, stride, pad, residual):
    """The float64 twin, and the same chain of |x| and |w| (the error's scale)."""
    *e, d, p = ws
    pad4 = (pad[0], pad[1], 1, 1)
    t = naive.conv2d(x, e[0][0], e[0][1], relu="relu6") if e else x
    t = naive.conv2d(t, d[0], d[1], stride, pad4, groups=d[0].shape[0], relu="relu6")
    y = naive.conv2d(t, p[0], p[1], residual=residual)
    a = lambda v: None if v is None else np.abs(v)  # noqa: E731
    s = naive.conv2d(np.abs(x), a(e[0][0]), a(e[0][1])) if e else np.abs(x)
    s = naive.conv2d(s, a(d[0]), a(d[1]), stride, pad4, groups=d[0].shape[0])
    s = naive.conv2d(s, a(p[0]), a(p[1]), residual=a(residual))
    return y, s


def separate(x, ws, stride, pad, residual):
    """The three float32 kernels one after the other (what the executor runs unfused)."""
    *e, d, p = ws
    t = conv2d(x, pack_conv_weight(e[0][0]), e[0][1], relu="relu6") if e else x
    t = conv2d(t, pack_conv_weight(d[0], groups=d[0].shape[0]), d[1], stride,
               (pad[0], pad[1], 1, 1), relu="relu6")
    return conv2d(t, pack_conv_weight(p[0]), p[1], residual=residual)


# (n, h, w, cin, hid, cout, expand, stride, (pad top, bottom), residual)
CASES = [
    (1, 9, 11, 8, 48, 8, True, 1, (1, 1), True),  # rows not a multiple of MR: packed 1x1s
    (1, 16, 16, 16, 96, 24, True, 2, (1, 1), False),  # 16 wide: the 1x1s read x in place
    (2, 7, 13, 6, 36, 6, True, 1, (1, 1), True),  # batch 2
    (1, 12, 8, 16, 16, 8, False, 1, (1, 1), False),  # no expand (MobileNetV2's block 1)
    (1, 11, 9, 8, 40, 12, True, 2, (1, 0), False),  # a band's padding: top only
    (1, 10, 16, 8, 40, 8, True, 1, (0, 1), True),  # bottom only
    (1, 10, 10, 8, 40, 16, True, 2, (0, 0), False),  # inside the map: no padding
    (1, 3, 5, 8, 24, 8, True, 1, (1, 1), True),  # a map smaller than a tile
    # the 1x1s on the fused store (_tiles_1x1): whole panels, and a last panel of 16 or 24
    (1, 9, 12, 16, 64, 32, True, 1, (1, 1), True),  # 32 and 64: whole panels, residual
    (1, 10, 13, 24, 48, 16, True, 1, (1, 1), True),  # 48 = 32 + 16, project to 16 + res
    (1, 12, 9, 16, 56, 24, True, 2, (1, 1), False),  # 56 = 32 + 24, project to 24
    (1, 11, 16, 16, 16, 16, False, 1, (1, 1), True),  # no expand, project to 16
    (2, 6, 7, 24, 144, 24, True, 1, (1, 1), True),  # MobileNetV2's 144 and 24, batch 2
]


@pytest.mark.parametrize("n,h,w,cin,hid,cout,expand,stride,pad,res", CASES)
@pytest.mark.parametrize("tile", [0, 1, 3, 1000])
def test_inverted_residual_against_float64(n, h, w, cin, hid, cout, expand, stride, pad, res,
                                           tile):
    x = rand(n, h, w, cin)
    ws = block(cin, hid, cout, expand)
    ho = (h + pad[0] + pad[1] - 3) // stride + 1
    wo = (w - 1) // stride + 1
    residual = rand(n, ho, wo, cout) if res else None
    y = inverted_residual(x, *packed(ws)[:4], *packed(ws)[4:], stride=stride, padding=pad,
                          residual=residual, tile=tile)
    ref, scale = oracle(x, ws, stride, pad, residual)
    assert y.shape == ref.shape == (n, ho, wo, cout)
    tol = 1e-5 * math.sqrt(9 + cin + hid) * scale + 1e-6
    err = np.abs(y.astype(np.float64) - ref)
    assert np.all(err <= tol), f"max error {err.max()} (tolerance there {tol.flat[err.argmax()]})"
    # the three kernels one by one: the same sums in the same order
    np.testing.assert_array_equal(y, separate(x, ws, stride, pad, residual))


def test_inverted_residual_writes_out():
    x = rand(1, 8, 8, 8)
    ws = block(8, 32, 8)
    out = np.full((1, 8, 8, 8), np.nan, np.float32)
    y = inverted_residual(x, *packed(ws), stride=1, residual=x, out=out)
    assert y is out
    np.testing.assert_array_equal(out, separate(x, ws, 1, (1, 1), x))


@pytest.mark.parametrize("width", [16, 24])
@pytest.mark.parametrize("has_res, act, last_rows", [(True, 0, 8), (False, 2, 5), (True, 1, 1)])
def test_narrow_tiles_on_the_ir_tile(width, has_res, act, last_rows):
    """`narrow_tiles_ir` (the IR tile of width 16 or 24, which inverted.py runs where the
    generated narrow tile does not fit the registers: AVX2) on the first columns of a 32-wide
    panel: against float64, bit-equal to the generated `narrow_tiles_epi{width}`, and nothing
    written past the width, past last_rows or between the rows (row stride 40)."""
    from hepti.kernels import _microkernels as mk
    from hepti.kernels.inverted import narrow_tiles_ir
    rng = np.random.default_rng(width + last_rows)
    i64, nt, kc, ldc = np.int64, 3, 150, 40
    a = rng.standard_normal(nt * 8 * kc).astype(np.float32)
    bp = rng.standard_normal((kc, 32)).astype(np.float32)
    bias = rng.standard_normal(32).astype(np.float32)[:width]
    res = rng.standard_normal(nt * 8 * ldc + 8).astype(np.float32)
    got = np.full(nt * 8 * ldc + 8, 7.0, np.float32)
    gen = got.copy()
    args = (i64(nt), i64(kc), a, i64(0), i64(kc), bp)
    tail = (i64(last_rows), bias, res, i64(2), i64(ldc), has_res, i64(act))
    narrow_tiles_ir(i64(width), *args, got, i64(3), i64(ldc), *tail)
    getattr(mk, f"narrow_tiles_epi{width}")(*args, gen, i64(3), i64(ldc), *tail)
    np.testing.assert_array_equal(got, gen)
    want = np.full(got.shape, 7.0)
    for row in range(nt * 8 - 8 + last_rows):
        acc = a[row * kc:(row + 1) * kc].astype(np.float64) @ bp[:, :width] + bias
        if has_res:
            acc += res[2 + row * ldc:][:width]
        if act:
            acc = np.maximum(acc, 0.0) if act == 1 else np.clip(acc, 0.0, 6.0)
        want[3 + row * ldc:][:width] = acc
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)


def test_tile_rows_bounds():
    assert tile_rows(112, 112, 96, 2, 56) >= 4  # at least MIN_TILE
    assert tile_rows(7, 7, 960, 1, 7) == 7  # a small map: one tile
    assert 8 <= tile_rows(56, 56, 144, 1, 56) < 56



def test_inverted_block_keeps_a_plan_per_shape():
    """One InvertedBlock called on shapes that change (sizes, batch, a band's padding, stride,
    tile), and back: each result is a fresh `inverted_residual`'s, bit for bit."""
    ws = block(16, 48, 16)
    blk = InvertedBlock(*packed(ws))
    shapes = [(1, 12, 10, 1, (1, 1), 0), (2, 7, 9, 1, (1, 1), 0), (1, 12, 10, 2, (1, 1), 0),
              (1, 9, 10, 1, (1, 0), 0), (1, 9, 10, 1, (0, 1), 2), (1, 12, 10, 1, (1, 1), 0)]
    for n, h, w, stride, pad, tile in shapes:
        x = rand(n, h, w, 16)
        ho, wo = (h + pad[0] + pad[1] - 3) // stride + 1, (w - 1) // stride + 1
        res = rand(n, ho, wo, 16) if stride == 1 else None
        y = blk(x, stride, pad, res, tile=tile)
        assert y.shape == (n, ho, wo, 16)
        np.testing.assert_array_equal(
            y, inverted_residual(x, *packed(ws), stride=stride, padding=pad, residual=res,
                                 tile=tile))
        np.testing.assert_array_equal(y, separate(x, ws, stride, pad, res))
    with pytest.raises(ValueError, match="expand"):
        blk(rand(1, 8, 8, 8))
    with pytest.raises(ValueError, match="stride"):
        blk(rand(1, 8, 8, 16), stride=3)

def test_inverted_residual_rejects_bad_arguments():
    x = rand(1, 8, 8, 8)
    e, be, d, bd, p, bp = packed(block(8, 32, 8))
    with pytest.raises(ValueError, match="expand"):
        inverted_residual(rand(1, 8, 8, 4), e, be, d, bd, p, bp)
    with pytest.raises(ValueError, match="depthwise"):
        inverted_residual(x, e, be, p, bp, p, bp)
    with pytest.raises(ValueError, match="project"):
        inverted_residual(x, e, be, d, bd, d, bd)
    with pytest.raises(ValueError, match="stride"):
        inverted_residual(x, e, be, d, bd, p, bp, stride=3)
    with pytest.raises(ValueError, match="padding"):
        inverted_residual(x, e, be, d, bd, p, bp, padding=(2, 1))
    with pytest.raises(ValueError, match="without an expand"):
        inverted_residual(x, None, None, d, bd, p, bp)
    with pytest.raises(ValueError, match="residual"):
        inverted_residual(x, e, be, d, bd, p, bp, residual=rand(1, 4, 4, 8))
    with pytest.raises(ValueError, match="overlaps"):
        inverted_residual(x, e, be, d, bd, p, bp, out=x)


# --- a run of blocks as one call (InvertedChain) ------------------------------------------------

# per block: (cin, hid, cout, expand, stride, residual); a band's input rows and each block's
# (pad top, bottom) and residual rows (its output's offset in its input band)
CHAIN = [(16, 16, 16, False, 1, True), (16, 96, 24, True, 2, False), (24, 144, 24, True, 1, True),
         (24, 144, 32, True, 2, False), (32, 192, 32, True, 1, True), (32, 48, 16, True, 1, False)]


@pytest.mark.parametrize("n,h,w,pads,rows", [
    (1, 21, 19, ((1, 1),) * 6, (0,) * 6),  # a whole map
    (2, 13, 10, ((1, 1),) * 6, (0,) * 6),  # batch 2
    (1, 30, 12, ((0, 0),) * 6, (1, 0, 1, 0, 1, 0)),  # a band inside the map: halos each side
    (1, 27, 9, ((1, 0),) * 6, (0,) * 6),  # a band at the top
    (2, 27, 9, ((1, 0),) * 6, (0,) * 6),  # batch 2 on it: a residual not one piece (by image)
    (3, 30, 12, ((0, 0),) * 6, (1, 0, 1, 0, 1, 0)),  # batch 3, halos each side
])
def test_inverted_chain_is_its_blocks_one_by_one(n, h, w, pads, rows):
    """The chain's output equals (bit for bit) its blocks run one by one, each block's residual
    its input's rows that its output rows are; the blocks' weights then live in the chain's
    buffer, and the blocks alone still give the same."""
    blocks = [InvertedBlock(*packed(block(ci, hi, co, e))) for ci, hi, co, e, _, _ in CHAIN]
    strides = tuple(c[4] for c in CHAIN)
    res_rows = tuple(r if c[5] else None for c, r in zip(CHAIN, rows))
    x = rand(n, h, w, CHAIN[0][0])
    want = x
    for blk, s, pad, rr in zip(blocks, strides, pads, res_rows):
        y = blk(want, s, pad)
        res = None if rr is None else np.ascontiguousarray(want[:, rr:rr + y.shape[1]])
        want = blk(want, s, pad, res)
    chain = InvertedChain(blocks)
    for _ in range(2):  # the second time on the kept plan and workspaces
        np.testing.assert_array_equal(chain(x, strides, pads, res_rows), want)
    assert all(np.shares_memory(b.wp, chain.wts) for b in blocks)
    out = np.empty_like(want)
    assert chain(x, strides, pads, res_rows, out=out) is out
    np.testing.assert_array_equal(out, want)
    one = x
    for blk, s, pad, rr in zip(blocks, strides, pads, res_rows):  # the views: the same weights
        y = blk(one, s, pad)
        res = None if rr is None else np.ascontiguousarray(one[:, rr:rr + y.shape[1]])
        one = blk(one, s, pad, res)
    np.testing.assert_array_equal(one, want)


def test_inverted_chain_rejects_bad_arguments():
    a = InvertedBlock(*packed(block(8, 24, 8)))
    b = InvertedBlock(*packed(block(16, 48, 8)))
    with pytest.raises(ValueError, match="input channels"):
        InvertedChain([a, b])
    with pytest.raises(ValueError, match="at least one"):
        InvertedChain([])
    chain = InvertedChain([a, InvertedBlock(*packed(block(8, 24, 8)))])
    x = rand(1, 8, 8, 8)
    with pytest.raises(ValueError, match="channels"):
        chain(rand(1, 8, 8, 4), (1, 1), ((1, 1), (1, 1)), (None, None))
    with pytest.raises(ValueError, match="one entry per block"):
        chain(x, (1,), ((1, 1),), (None,))
    with pytest.raises(ValueError, match="residual"):
        chain(x, (1, 2), ((1, 1), (1, 1)), (None, 0))  # stride 2: no residual
    with pytest.raises(ValueError, match="residual"):
        chain(x, (1, 1), ((0, 0), (1, 1)), (3, None))  # rows past the band
    with pytest.raises(ValueError, match="overlaps"):
        chain(x, (1, 1), ((1, 1), (1, 1)), (None, None), out=x)


# --- the band executor ------------------------------------------------------------------------

def _tiny_mobilenet():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from order_helpers import pixels, random_cnn
    return random_cnn("mobilenet_v2"), pixels


@pytest.mark.parametrize("groups", ["one", "by_op", "cut"])
def test_band_executor_runs_blocks_fused_where_it_can(groups):
    """The executor runs each inverted-residual block whose ops share a group as one kernel,
    the logits equal (bit for bit) to the ops one by one (what it runs with a counter); with
    one op a group, or a block cut by a group's end, it runs the ops one by one."""
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    model, pixels = _tiny_mobilenet()
    g = model.graph
    n = spatial_ops(g)
    split = {"one": Split((1.0,), ((0, n),)), "by_op": Split((1.0,)),
             "cut": Split((1.0,), ((0, 5), (5, n)))}[groups]  # 5 cuts block 2 after its dw
    ex = BandExecutor(Comm(None), g, split, model.weights)
    x = pixels(1, 48, 40)
    got = ex.forward(x)
    want = ex.forward(x, counter=AllocationCounter())
    np.testing.assert_array_equal(got, want)
    fused = {grp.ops[j][0].name: k for grp in ex.program(48, 40)
             for j, k in getattr(grp, "fused", {}).items()}
    if groups == "by_op":
        assert fused == {}
    else:
        assert fused["features.1.conv.0.0"] == 2 and fused["features.3.conv.0.0"] == 3
        assert ("features.2.conv.0.0" in fused) == (groups == "one")
    # runs of blocks as one call: from block 1 on with one group; after the cut with two
    chains = {grp.ops[j][0].name: len(blocks) for grp in ex.program(48, 40)
              for j, blocks in getattr(grp, "chains", {}).items()}
    if groups == "one":
        assert chains["features.1.conv.0.0"] == 17
    elif groups == "cut":
        assert chains["features.1.conv.0.0"] == 1 and chains["features.3.conv.0.0"] == 15
    # a tap on a block's inner map: that block runs op by op, and the tap is its band
    taps = {"features.3.conv.0": None}
    np.testing.assert_array_equal(ex.forward(x, taps=taps), want)
    assert taps["features.3.conv.0"] is not None


def test_band_executor_blocks_right_when_the_size_changes():
    """The kept blocks (hepti.model.cnn `Weights.inverted`, each with its plan per shape) give
    the ops' own results at every size, back and forth; with streamed weights a block is
    made from the weights fetched each time and let go with them."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from order_helpers import random_tensors
    from hepti.graph.cnn import CONV
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.cnn import Weights, tensors_reader
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    model, pixels = _tiny_mobilenet()
    g = model.graph
    ex = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)), model.weights)
    for h, w in [(48, 40), (32, 32), (40, 56), (48, 40)]:
        x = pixels(1, h, w)
        np.testing.assert_array_equal(ex.forward(x), ex.forward(x, counter=AllocationCounter()))
    assert model.weights._blocks  # the fused path ran
    streamed = Weights(g, tensors_reader(random_tensors("mobilenet_v2")),
                       streamed={op.name for op in g.ops if op.kind == CONV})
    exs = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)), streamed)
    x = pixels(1, 48, 40)
    np.testing.assert_array_equal(exs.forward(x), ex.forward(x))
    np.testing.assert_array_equal(exs.forward(pixels(1, 32, 32)), ex.forward(pixels(1, 32, 32)))
    assert not streamed._blocks and not streamed.conv  # dropped with their weights


def test_band_executor_makes_a_run_again_when_a_conv_is_packed_again():
    """A run of blocks is kept on its group while no conv's entry changed (`Weights.version`);
    a conv packed again (here the same weights: new arrays) makes its chain again, on them."""
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    model, pixels = _tiny_mobilenet()
    g, weights = model.graph, model.weights
    ex = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)), weights)
    x = pixels(1, 40, 40)
    want = ex.forward(x, counter=AllocationCounter())
    np.testing.assert_array_equal(ex.forward(x), want)
    (grp,) = ex.program(40, 40)
    (before,) = [v[1] for v in grp.kernels.values()]
    op = next(op for op in g.ops if op.name == "features.5.conv.1.0")  # a depthwise, mid-run
    weights._load(op, None)
    np.testing.assert_array_equal(ex.forward(x), want)
    (after,) = [v[1] for v in grp.kernels.values()]
    assert after is not before
    assert np.shares_memory(weights.conv[op.name][0].taps, after.wts)
