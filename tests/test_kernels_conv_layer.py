"""hepti.kernels.conv `ConvLayer`: conv2d with the weight checked once and the plan kept per
input shape. Its results are conv2d's, bit for bit (the same kernel on the same plan), on
every shape it sees, in any order; bad input raises what conv2d raises."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.kernels import ConvLayer, conv2d, pack_conv_weight
from hepti.kernels.config import NR

RNG = np.random.default_rng(20261129)


def rand(*shape) -> np.ndarray:
    return RNG.standard_normal(shape, dtype=np.float32)


# (Cout, Cin, kernel, stride, dilation, relu, bias): fused (Cout whole panels) and not, 1x1,
# 3x3, 7x7 at stride 2, dilation 2, no bias
LAYERS = [
    (2 * NR, 16, 1, 1, 1, "relu", True),
    (NR + 8, 16, 1, 1, 1, None, True),
    (NR, 16, 3, 1, 1, "relu6", True),
    (NR, 3, 7, 2, 1, "relu", False),
    (40, 16, 3, 2, 2, None, True),
]
# the shapes one layer sees in turn (a band's padding, a new size, a batch, back again)
SHAPES = [((1, 16, 18), (1, 1, 1, 1)), ((1, 9, 18), (1, 0, 1, 1)), ((1, 9, 18), (0, 1, 1, 1)),
          ((2, 11, 8), (1, 1, 1, 1)), ((1, 16, 18), (1, 1, 1, 1)), ((1, 16, 18), 2)]


@pytest.mark.parametrize("cout,cin,k,stride,dilation,act,with_bias", LAYERS)
def test_conv_layer_keeps_a_plan_per_shape(cout, cin, k, stride, dilation, act, with_bias):
    """One layer over six shapes and back (each twice, the second from its kept plan), with
    and without a residual and on two threads: conv2d's result, bit for bit."""
    w, bias = rand(cout, cin, k, k), rand(cout) if with_bias else None
    cw = pack_conv_weight(w)
    layer = ConvLayer(cw, bias, stride, dilation, act)
    for (n, h, wd), padding in SHAPES:
        x = rand(n, h, wd, cin)
        want = conv2d(x, cw, bias, stride, padding, dilation, relu=act)
        for _ in range(2):
            np.testing.assert_array_equal(layer(x, padding), want)
        res = rand(*want.shape)
        np.testing.assert_array_equal(
            layer(x, padding, residual=res),
            conv2d(x, cw, bias, stride, padding, dilation, relu=act, residual=res))
        np.testing.assert_array_equal(layer(x, padding, threads=2), want)
    assert len(layer._shapes) == 2 * len(SHAPES) - 2  # one and two threads, two shapes again


def test_conv_layer_out_and_out_is_the_residual():
    """out= a buffer (also a band inside a wider one) and out= the residual itself (written
    over it where the store is fused, else a new array), as conv2d."""
    x = rand(1, 9, 16, 8)
    for cout in (NR, 40):
        cw, bias = pack_conv_weight(rand(cout, 8, 3, 3)), rand(cout)
        layer = ConvLayer(cw, bias, relu="relu")
        res = rand(1, 9, 16, cout)
        want = conv2d(x, cw, bias, 1, 1, relu="relu", residual=res)
        r = res.copy()
        got = layer(x, 1, residual=r, out=r)
        assert (got is r) == (cout % NR == 0)
        np.testing.assert_array_equal(got, want)
        buf = np.zeros((1, 12, 16, cout), np.float32)
        got = layer(x, 1, residual=res, out=buf[:, 2:11])
        assert got.base is buf or got.base is buf.base
        np.testing.assert_array_equal(buf[:, 2:11], want)
        assert not buf[:, :2].any() and not buf[:, 11:].any()


def test_conv_layer_other_inputs_take_conv2d():
    """A read-only or non-contiguous x, a list padding and a depthwise weight give conv2d's
    answer (conv2d runs them)."""
    x, w, bias = rand(1, 8, 8, 16), rand(NR, 16, 3, 3), rand(NR)
    cw = pack_conv_weight(w)
    layer = ConvLayer(cw, bias, relu="relu")
    want = conv2d(x, cw, bias, 1, 1, relu="relu")
    ro = x.copy()
    ro.flags.writeable = False
    np.testing.assert_array_equal(layer(ro, 1), want)
    wide = np.zeros((1, 8, 8, 32), np.float32)
    wide[..., :16] = x
    np.testing.assert_array_equal(layer(wide[..., :16], 1), want)
    np.testing.assert_array_equal(layer(x, [1, 1]), want)
    dw = pack_conv_weight(rand(16, 1, 3, 3), groups=16)
    np.testing.assert_array_equal(ConvLayer(dw, bias[:16], 2, relu="relu6")(x, 1),
                                  conv2d(x, dw, bias[:16], 2, 1, relu="relu6"))


def test_conv_layer_rejects_bad_input():
    """conv2d's errors, for a new shape and for one whose plan is kept."""
    cw = pack_conv_weight(rand(8, 4, 3, 3))
    x = rand(1, 6, 6, 4)
    with pytest.raises(TypeError, match="ConvWeight"):
        ConvLayer(rand(8, 4, 3, 3))
    with pytest.raises(ValueError, match="bias"):
        ConvLayer(cw, rand(7))
    with pytest.raises(ValueError, match="relu"):
        ConvLayer(cw, relu="gelu")
    with pytest.raises(ValueError, match="stride"):
        ConvLayer(cw, stride=0)
    layer = ConvLayer(cw)
    layer(x)  # its plan kept
    for _ in range(2):
        with pytest.raises(ValueError, match="channels"):
            layer(rand(1, 6, 6, 5))
        with pytest.raises(ValueError, match="4-D"):
            layer(rand(6, 6, 4))
        with pytest.raises(TypeError, match="float32"):
            layer(x.astype(np.float64))
        with pytest.raises(ValueError, match="smaller than"):
            layer(rand(1, 2, 6, 4))
        with pytest.raises(ValueError, match="padding"):
            layer(x, (1, 2, 3))
        with pytest.raises(ValueError, match="threads"):
            layer(x, threads=0)
        with pytest.raises(ValueError, match="residual"):
            layer(x, residual=rand(1, 4, 4, 7))
        with pytest.raises(ValueError, match="shape"):
            layer(x, out=np.empty((1, 4, 4, 7), np.float32))
        with pytest.raises(ValueError, match="overlaps"):
            flat = rand(4 * 4 * 8 + 8)  # out and residual overlap, shifted by a pixel
            layer(x, residual=flat[8:].reshape(1, 4, 4, 8), out=flat[:-8].reshape(1, 4, 4, 8))
    same = ConvLayer(pack_conv_weight(rand(4, 4, 1, 1)))  # out = x has the output's shape
    for _ in range(2):
        with pytest.raises(ValueError, match="overlaps x"):
            same(x, out=x)


def _plain_layers(weights):
    """`weights.layer` replaced by conv2d itself on the op's arguments (the reference)."""
    class Plain:
        def __init__(self, op):
            self.op = op

        def border(self, x_shape, padding, threads=1):  # never reads a zero-bordered map:
            return None  # the executor runs each op on its own (no `apply_pair`)

        def __call__(self, x, padding, residual=None, out=None, threads=1):
            op = self.op
            cw, bias = weights.conv[op.name]
            return conv2d(x, cw, bias, op.stride, padding, op.dilation, relu=op.act or None,
                          residual=residual, out=out, threads=threads)
    weights.layer = Plain
    return weights


@pytest.mark.parametrize("name", ["resnet50", "vgg16"])
def test_band_executor_layers_right_when_the_size_changes(name):
    """The kept layers (hepti.model.cnn `Weights.layer`, each with its plan per shape) give
    conv2d's logits at every size, back and forth, on one group and one op a group (bands
    of other paddings); with streamed weights a layer is made from the weights fetched each
    time and let go with them."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from order_helpers import TINY, pixels, random_tensors
    from hepti.config import CNNConfig
    from hepti.graph.cnn import CONV, build
    from hepti.graph.split import Split, spatial_ops
    from hepti.model.cnn import Weights, tensors_reader
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    g = build(CNNConfig(**TINY[name], name=name))
    tensors = random_tensors(name)
    kept = Weights(g, tensors_reader(tensors))
    plain = _plain_layers(Weights(g, tensors_reader(tensors)))
    one = Split((1.0,), ((0, spatial_ops(g)),))
    for split in (one, Split((1.0,))):
        ex, ref = (BandExecutor(Comm(None), g, split, w) for w in (kept, plain))
        for h, w in [(48, 40), (32, 32), (40, 56), (48, 40)]:
            x = pixels(1, h, w)
            np.testing.assert_array_equal(ex.forward(x), ref.forward(x))
    convs = [op for op in g.ops if op.kind == CONV]
    assert set(kept._layers) == {op.name for op in convs}
    assert all(kept.layer(op) is kept._layers[op.name][1] for op in convs)  # kept, not remade
    streamed = Weights(g, tensors_reader(tensors), streamed={op.name for op in convs})
    exs = BandExecutor(Comm(None), g, one, streamed)
    ref = BandExecutor(Comm(None), g, one, plain)
    for h, w in [(48, 40), (32, 32)]:
        np.testing.assert_array_equal(exs.forward(pixels(1, h, w)), ref.forward(pixels(1, h, w)))
    assert not streamed._layers and not streamed.conv  # dropped with their weights
