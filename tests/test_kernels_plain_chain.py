"""hepti.kernels.plain_chain `PlainChain`: a run of convolutions, each with an optional max pool
after it, each writing into the zero-bordered map the next reads (`conv._padded_into`,
`conv._pooled_into`; 6 x 64 tiles where a pair of panels fits in L2). Its output is the
layers' and `max_pool2d`'s one by one, bit for bit, and the float64 oracle's within float32
sums' tolerance; the band executor runs VGG's features as one call and changes no bit."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.kernels import ConvLayer, max_pool2d, naive, pack_conv_weight  # noqa: F401
from hepti.kernels.conv import PADDED_WIDE_K
from hepti.kernels.plain_chain import PlainChain

RNG = np.random.default_rng(20261130)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


def make(specs):
    """[(ConvLayer, pool)] and their weights from (cin, cout, kernel, stride, pool, relu)."""
    steps, raw = [], []
    for cin, cout, k, stride, pool, relu in specs:
        w, b = rand(cout, cin, k, k) * (2.0 / (cin * k * k)) ** 0.5, rand(cout) * 0.1
        steps.append((ConvLayer(pack_conv_weight(w), b, stride, 1, relu), pool))
        raw.append((w, b, stride, pool, relu))
    return steps, raw


VGG_LIKE = [(3, 64, 3, 1, 0, "relu"), (64, 64, 3, 1, 2, "relu"),  # K = 27; pairs of panels
            (64, 96, 3, 1, 0, "relu"), (96, 32, 3, 1, 2, None),  # a pair and an odd panel
            (32, 32, 3, 1, 3, "relu6")]  # one panel alone (8 x 32 tiles), a 3 x 3 pool
WIDE_K = (PADDED_WIDE_K // 9 // 32 + 1) * 32  # a 3x3 on this many channels: K over it
CASES = [
    (VGG_LIKE, (1, 32, 40), None),
    (VGG_LIKE, (2, 19, 23), None),  # odd sizes (pools drop the last row and column), batch 2
    ([(16, 64, 3, 1, 0, "relu"), (64, 64, 3, 2, 0, "relu"), (64, 64, 1, 1, 2, "relu")],
     (1, 17, 15), ((0, 1, 1, 1), (1, 1, 1, 1), (0, 0, 0, 0))),  # a band's padding, stride 2, 1x1
    ([(16, WIDE_K, 3, 1, 0, "relu"), (WIDE_K, 64, 3, 1, 2, "relu")], (1, 6, 9), None),
]


@pytest.mark.parametrize("specs,shape,paddings", CASES)
def test_plain_chain_is_its_layers_one_by_one(specs, shape, paddings):
    steps, raw = make(specs)
    paddings = paddings or tuple((s[2] // 2,) * 4 for s in specs)
    x = rand(*shape, specs[0][0])
    want, ref = x, x.astype(np.float64)
    for (layer, pool), (w, b, stride, _, relu), pad in zip(steps, raw, paddings):
        want = layer(want, pad)
        ref = naive.conv2d(ref, w, b, stride, pad, relu=relu)
        if pool:
            want = max_pool2d(want, pool, pool)
            ref = naive.max_pool2d(ref, pool, pool)
    chain = PlainChain(steps)
    got = chain(x, paddings)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    again = chain(x, paddings)  # the kept plan and maps; a new output
    np.testing.assert_array_equal(again, want)
    assert again is not got


def test_pooled_steps_whose_panels_overflow_l2_take_the_padded_modes_blocks(monkeypatch,
                                                                           request):
    """A pooled step whose panels are over half of L2 makes its rows in blocks of
    `_padded_rows`' (each block reads every panel again: from L3 once they overflow L2), not of
    POOLED_ROWS; the output stays the layers' one by one, bit for bit. L2 is made small here
    so that this machine's takes that path."""
    from hepti.kernels import config, conv
    from hepti.kernels.conv import POOLED_ROWS, pooled_rows
    for cached in (conv._conv_shape, conv._conv_plan):  # plans made on the small L2: dropped
        request.addfinalizer(cached.cache_clear)
    steps, _ = make(VGG_LIKE[:2])
    k, n_p = steps[1][0].w.k, steps[1][0].w.cout // 32
    assert pooled_rows(32 * 40, k, n_p, 40) == POOLED_ROWS  # 2 panels of K = 576: 147 KB
    monkeypatch.setattr(config, "L2_BYTES", 2 * k * n_p * 32 * 4 - 4)
    rows = pooled_rows(32 * 40, k, n_p, 40)
    assert rows > POOLED_ROWS
    x, paddings = rand(1, 32, 40, 3), ((1, 1, 1, 1),) * 2
    mid = steps[0][0](x, paddings[0])
    want = max_pool2d(steps[1][0](mid, paddings[1]), 2, 2)
    chain = PlainChain(steps)
    np.testing.assert_array_equal(chain(x, paddings), want)
    np.testing.assert_array_equal(steps[1][0].pooled(mid, paddings[1], 2, 2, 0), want)  # alone
    plan = chain.prepare(x.shape, paddings)
    assert plan[0][1][7] == rows // 2  # the pooled step's block, in pool rows


def test_plain_chain_declines():
    """A depthwise or grouped step, a partial panel of output channels, or a pool wider than
    its map: None (the layers run one by one)."""
    steps, _ = make([(16, 32, 3, 1, 0, "relu"), (32, 32, 3, 1, 2, "relu")])
    assert PlainChain(steps)(rand(1, 1, 8, 16), ((1, 1, 1, 1),) * 2) is None  # 1 row, pool 2
    assert PlainChain(steps)(rand(1, 8, 8, 16), ((1, 1, 1, 1),)) is None  # a padding short
    dw = ConvLayer(pack_conv_weight(rand(32, 1, 3, 3), groups=32), rand(32))
    assert not PlainChain.takes(dw)
    part = ConvLayer(pack_conv_weight(rand(48, 16, 3, 3)), rand(48))
    assert not PlainChain.takes(part)
    assert not PlainChain.takes(object())  # a test's stand-in for a layer


def test_band_executor_runs_vgg_features_in_one_call():
    """On one rank and one thread VGG's 13 convolutions and 5 pools run as one PlainChain
    (at 1/2 width: every Cout whole 32-wide panels), the logits bit for bit the ops one by
    one (what it runs with a counter); a tap on an inner map ends a run there."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.cnn import CNNModel, tensors_reader
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    cfg = CNNConfig(arch="vgg16", width_divisor=2, num_classes=10, classifier_hidden=64,
                    name="v2")
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s, dtype=np.float32) *
               np.float32((0.5 / max(1, np.prod(s[1:]))) ** 0.5)
               for k, s in build(cfg).weights().items()}
    model = CNNModel(cfg, tensors_reader(tensors))
    g = model.graph
    ex = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)), model.weights, 1)
    for n, h, w in [(1, 32, 32), (2, 40, 36)]:
        x = rng.standard_normal((n, 3, h, w), dtype=np.float32)
        want = ex.forward(x, counter=AllocationCounter())
        np.testing.assert_array_equal(ex.forward(x), want)
        taps = {"features.14": None}
        np.testing.assert_array_equal(ex.forward(x, taps=taps), want)
        assert taps["features.14"] is not None
    (runs,) = [grp.plains for grp in ex.program(32, 32)]
    assert [len(r) for r in runs.values()] == [13]  # every conv, its pool with it
