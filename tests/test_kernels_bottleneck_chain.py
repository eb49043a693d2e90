"""A run of ResNet bottleneck blocks as one call (hepti.kernels.bottleneck_chain) against the
layers one by one (the same kernels in the same order: equal bit for bit) and against its
float64 twin (hepti.kernels.naive's convolutions), and the band executor running it
(hepti.parallel.bands `_bottlenecks`) against the ops one by one.

Shapes: a downsample at stride 2 and at stride 1, blocks without one, batch 1 and 2, maps
whose rows are a multiple of the 8-pixel tile and not, conv2's own bottom padding 0 (a
stride-2 band), an `out`."""
from __future__ import annotations

import math

import numpy as np
import pytest

from hepti.kernels import ConvLayer, naive, pack_conv_weight
from hepti.kernels.bottleneck_chain import BottleneckChain

RNG = np.random.default_rng(20261130)


def rand(*shape, scale=1.0) -> np.ndarray:
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def conv(cout, cin, k, stride=1, relu="relu"):
    """(ConvLayer, its torch weight and bias)."""
    w, b = rand(cout, cin, k, k, scale=1 / math.sqrt(cin * k * k)), rand(cout, scale=0.1)
    return ConvLayer(pack_conv_weight(w), b, stride, relu=relu), (w, b, stride, relu)


def stage(cin, planes, blocks, stride, downsample=True):
    """[(ds or None, c1, c2, c3)] of ConvLayers and the same of their torch weights."""
    layers, torch = [], []
    for b in range(blocks):
        s = stride if b == 0 else 1
        got = [conv(planes * 4, cin, 1, s, None) if b == 0 and downsample else (None, None),
               conv(planes, cin, 1), conv(planes, planes, 3, s), conv(planes * 4, planes, 1)]
        layers.append(tuple(g[0] for g in got))
        torch.append(tuple(g[1] for g in got))
        cin = planes * 4
    return layers, torch


def one_by_one(blocks, x, pads):
    for (ds, c1, c2, c3), pad in zip(blocks, pads):
        identity = ds(x) if ds is not None else x
        x = c3(c2(c1(x), pad), 0, identity)
    return x


def oracle(torch, x, pads):
    """The float64 twin, and the same blocks on |x| and |w| (the error's scale)."""
    y, s = x.astype(np.float64), np.abs(x).astype(np.float64)
    for blk, pad in zip(torch, pads):
        outs = []
        for v, absolute in ((y, False), (s, True)):
            a = (lambda t: np.abs(t)) if absolute else (lambda t: t)  # noqa: E731
            run = lambda t, c, p=0: naive.conv2d(  # noqa: E731
                t, a(c[0]), a(c[1]), c[2], p, relu=None if absolute else c[3])
            ds, c1, c2, c3 = blk
            identity = run(v, ds) if ds is not None else v
            t = run(run(v, c1), c2, pad)
            outs.append(naive.conv2d(t, a(c3[0]), a(c3[1]), residual=identity,
                                     relu=None if absolute else "relu"))
        y, s = outs
    return y, s


@pytest.mark.parametrize("n,h,w,stride,pads", [
    (1, 14, 14, 2, None),  # stride 2: 7-wide maps, no whole tiles
    (2, 11, 9, 2, None),  # batch 2, odd sizes
    (1, 16, 16, 1, None),  # stride 1: 16-wide rows, conv2 reading the bordered map in place
    (1, 14, 12, 2, ((1, 0, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1))),  # conv2's bottom padding 0
])
def test_bottleneck_chain_is_its_layers_one_by_one(n, h, w, stride, pads):
    """Equal bit for bit to the layers one by one (twice: the second time on the kept plan and
    arena), within float32 rounding of the float64 twin; the panels then live in the chain's
    buffer and the layers alone still give the same; `out` is written."""
    blocks, torch = stage(64, 32, 3, stride)
    pads = pads or ((1, 1, 1, 1),) * 3
    x = rand(n, h, w, 64)
    want = one_by_one(blocks, x, pads)
    chain = BottleneckChain(blocks)
    for _ in range(2):
        np.testing.assert_array_equal(chain(x, pads), want)
    assert all(np.shares_memory(c.w.panels, chain.wts) for blk in blocks for c in blk if c)
    np.testing.assert_array_equal(one_by_one(blocks, x, pads), want)
    out = np.empty_like(want)
    assert chain(x, pads, out=out) is out
    np.testing.assert_array_equal(out, want)
    ref, scale = oracle(torch, x, pads)
    err = np.abs(want.astype(np.float64) - ref)
    assert err.max() <= 1e-5 * scale.max() + 1e-6, (err.max(), scale.max())


def test_bottleneck_chain_without_a_downsample_and_across_stages():
    """A run that starts on a block without a downsample (its input never written) and
    crosses into the next stages (a downsample at stride 2 reading the map before, in one of
    the two maps between blocks, not the one it writes: each stage's maps smaller)."""
    a, _ = stage(128, 32, 2, 1, downsample=False)
    b, _ = stage(128, 64, 2, 2)
    c, _ = stage(256, 64, 2, 2)
    d, _ = stage(256, 64, 2, 2)
    blocks, pads = a + b + c + d, ((1, 1, 1, 1),) * 8
    x = rand(1, 24, 20, 128)
    keep = x.copy()
    want = one_by_one(blocks, x, pads)
    chain = BottleneckChain(blocks)
    for threads in (1, 2):
        np.testing.assert_array_equal(chain(x, pads, threads=threads), want)
        np.testing.assert_array_equal(x, keep)


def test_bottleneck_chain_declines_and_rejects():
    """None where a convolution would not run fused (Cout not whole 32-wide panels: the
    caller runs the layers then); errors for blocks that do not fit together."""
    blocks, _ = stage(16, 4, 2, 1)  # 4 and 16 output channels: partial panels
    chain = BottleneckChain(blocks)
    assert chain(rand(1, 8, 8, 16), ((1, 1, 1, 1),) * 2) is None
    a, _ = stage(64, 32, 1, 1)
    b, _ = stage(64, 32, 1, 1)  # reads 64 channels, a gives 128
    with pytest.raises(ValueError, match="input channels"):
        BottleneckChain(a + b)
    with pytest.raises(ValueError, match="at least one"):
        BottleneckChain([])
    chain = BottleneckChain(a)
    with pytest.raises(ValueError, match="channels"):
        chain(rand(1, 8, 8, 32), ((1, 1, 1, 1),))
    with pytest.raises(ValueError, match="one entry per block"):
        chain(rand(1, 8, 8, 64), ((1, 1, 1, 1),) * 2)
    big = np.empty((1, 8, 8, 128), np.float32)
    x = big.reshape(-1)[:8 * 8 * 64].reshape(1, 8, 8, 64)  # the first half of big's memory
    with pytest.raises(ValueError, match="overlaps"):
        chain(x, ((1, 1, 1, 1),), out=big)


@pytest.mark.parametrize("order,threads", [("file", 1), ("late_downsample", 1), ("file", 2)])
def test_band_executor_runs_bottlenecks_in_one_call(order, threads):
    """On one rank and one thread the executor runs each run of bottleneck blocks whose
    convolutions fuse (layer3 and layer4 at 1/8 width: one run across the stages) as one
    call, the logits and every stage's output equal (bit for bit) to the ops one by one
    (what it runs with a counter); a tap on a block's inner map or output ends the run
    there; with the downsample after conv2 (another order) the first blocks run op by op.
    On 2 threads each convolution of the chain is split as the layer alone splits it."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from order_helpers import late_downsample_order, pixels
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.cnn import CNNModel, tensors_reader
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    cfg = CNNConfig(arch="resnet50", width_divisor=8, num_classes=10, name="r8")
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s, dtype=np.float32) * 0.1
               for k, s in build(cfg).weights().items()}
    model = CNNModel(cfg, tensors_reader(tensors))
    g = model.graph
    names = late_downsample_order(g) if order == "late_downsample" else None
    ex = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)), model.weights,
                      threads, names)
    for n, h, w in [(1, 64, 56), (2, 40, 48)]:
        x = pixels(n, h, w)
        want = ex.forward(x, counter=AllocationCounter())
        np.testing.assert_array_equal(ex.forward(x), want)
        taps = {"layer3.2.b": None, "layer4.0": None, "layer4.2": None}
        np.testing.assert_array_equal(ex.forward(x, taps=taps), want)
        assert all(v is not None for v in taps.values())
    chains = [kept[2] for kept in model.weights._bottlenecks.values()]
    assert chains and all(p is not None for c in chains for p in c._shapes.values())
    runs = {grp.ops[j][0].name: [grp.ops[i][0].name for i, _ in blocks]
            for grp in ex.program(40, 48) for j, blocks in grp.bottlenecks.items()}
    if order == "file":  # layer3's and layer4's convolutions fuse at 1/8 width (128, 256)
        assert runs == {"layer3.0.downsample.0": [
            "layer3.0.downsample.0", "layer3.1.conv1", "layer3.2.conv1", "layer3.3.conv1",
            "layer3.4.conv1", "layer3.5.conv1", "layer4.0.downsample.0", "layer4.1.conv1",
            "layer4.2.conv1"]}
    else:
        assert runs == {"layer3.1.conv1": [f"layer3.{b}.conv1" for b in range(1, 6)],
                        "layer4.1.conv1": ["layer4.1.conv1", "layer4.2.conv1"]}
