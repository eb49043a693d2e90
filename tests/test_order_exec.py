"""Executing in an order (issue 20): the executors run the operators in a given order and free
each activation after its last reader; the allocation counter (hepti.model.livebytes) reads
what they hold from the arrays themselves, and equals the memory model's peak
(hepti.plan.memory) where the model applies. Outputs do not depend on the order."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.config import CNNConfig
from hepti.graph.cnn import build
from hepti.graph.opdag import from_cnn
from hepti.model.livebytes import AllocationCounter, TrackedDict, buffer_of
from hepti.plan.memory import compile_problem, order_peak

TINY = {"resnet50": dict(arch="resnet50", width_divisor=16, num_classes=10),
        "mobilenet_v2": dict(arch="mobilenet_v2", width_divisor=8, num_classes=10),
        "vgg16": dict(arch="vgg16", width_divisor=16, num_classes=10, classifier_hidden=64)}


def random_cnn(name: str, order=None):
    """A tiny CNN of hepti's families with seeded random weights, in memory."""
    from hepti.model.cnn import CNNModel, tensors_reader
    cfg = CNNConfig(**TINY[name], name=name)
    rng = np.random.default_rng(0)
    tensors = {k: (rng.standard_normal(s, dtype=np.float32) * 0.1)
               for k, s in build(cfg).weights().items()}
    return CNNModel(cfg, tensors_reader(tensors), order=order)


def pixels(n=1, h=48, w=40, seed=1):
    return np.random.default_rng(seed).standard_normal((n, 3, h, w), dtype=np.float32)


def late_downsample_order(graph) -> list[str]:
    """ResNet's file order with every downsample run after its block's conv2 instead of
    first: another topological order, with a different peak."""
    names = [op.name for op in graph.ops]
    for op in graph.ops:
        if op.name.endswith(".downsample.0"):
            names.remove(op.name)
            names.insert(names.index(op.name.replace("downsample.0", "conv2")) + 1, op.name)
    return names


# --- the counter itself ---------------------------------------------------------------------

def test_counter_counts_buffers_once_and_replacement_overlaps():
    c = AllocationCounter(record=True)
    y = np.zeros((4, 6), np.float32)
    env = TrackedDict(c)
    env["q"], env["kv"] = y[:, :2], y[:, 2:]  # two views of one buffer: its bytes once
    assert c.live == y.nbytes
    env.pop("q")
    assert c.live == y.nbytes  # K/V still view it
    env["kv"] = np.ones((4, 4), np.float32)  # replaced: both held for a moment
    assert c.peak == y.nbytes + 64 and c.live == 64
    del env["kv"]
    assert c.live == 0 and buffer_of(y[:, 1:]) is y


# --- one process ----------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TINY))
def test_counter_equals_the_model_peak_in_file_and_btsearch_order(name):
    """The counter's high-water is the model's peak exactly, with the executor's input copy
    and the output it hands back counted (count_io), in the file order and in BTSearch's."""
    from hepti.plan.order import executor_order
    model = random_cnn(name)
    h, w = 48, 40
    dag = from_cnn(model.graph, 1, h, w)
    best = executor_order(dag)
    for order in (None, best.order):
        model.set_order(order)
        c = AllocationCounter(record=True)
        model.forward(pixels(1, h, w), counter=c)
        names = order or [op.name for op in model.graph.ops]
        assert c.peak == order_peak(dag, names, count_io=True)
        # step by step too: after each op, the counter holds the model's step
        pb = compile_problem(dag, count_io=True)
        steps = pb.profile([dag.index[n] for n in names])
        made = [v for label, v in c.steps[1:]]  # the first is the pixels' copy
        assert made == steps
        assert c.live == dag.tensors[model.graph.output].bytes  # only the logits remain


def test_resnet_in_another_order_same_logits_and_the_counter_follows_the_model():
    ref = random_cnn("resnet50")
    x = pixels(2, 56, 48)
    want = ref.forward(x)
    order = late_downsample_order(ref.graph)
    assert order != [op.name for op in ref.graph.ops]
    model = random_cnn("resnet50", order=order)
    c = AllocationCounter(record=True)
    got = model.forward(x, counter=c)
    np.testing.assert_array_equal(got, want)  # bit for bit: each op's arithmetic is the same
    dag = from_cnn(model.graph, 2, 56, 48)
    pb = compile_problem(dag, count_io=True)
    steps = pb.profile([dag.index[n] for n in order])
    assert [v for _, v in c.steps[1:]] == steps
    assert steps != pb.profile(list(range(len(dag.ops))))  # the order did change what is held
    assert c.peak == order_peak(dag, order, count_io=True)


def test_an_order_that_is_not_topological_is_refused():
    g = build(CNNConfig(**TINY["resnet50"]))
    names = [op.name for op in g.ops]
    with pytest.raises(ValueError, match="before the op that makes"):
        g.run_order(names[1:2] + names[:1] + names[2:])
    with pytest.raises(ValueError, match="once"):
        g.run_order(names[:-1])
