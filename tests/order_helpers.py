"""Tiny CNNs of hepti's families with seeded random weights, in memory, and another order to
run them in: what tests/test_order_exec.py and tests/mpi/test_order_bands.py share."""
from __future__ import annotations

import numpy as np

from hepti.config import CNNConfig
from hepti.graph.cnn import build

TINY = {"resnet50": dict(arch="resnet50", width_divisor=16, num_classes=10),
        "mobilenet_v2": dict(arch="mobilenet_v2", width_divisor=8, num_classes=10),
        "vgg16": dict(arch="vgg16", width_divisor=16, num_classes=10, classifier_hidden=64)}


def random_tensors(name: str) -> dict:
    """Seeded random weights of the tiny `name` (the same on every rank)."""
    cfg = CNNConfig(**TINY[name], name=name)
    rng = np.random.default_rng(0)
    return {k: (rng.standard_normal(s, dtype=np.float32) * 0.1)
            for k, s in build(cfg).weights().items()}


def random_cnn(name: str, order=None):
    """A tiny CNN of hepti's families with seeded random weights, in memory."""
    from hepti.model.cnn import CNNModel, tensors_reader
    return CNNModel(CNNConfig(**TINY[name], name=name), tensors_reader(random_tensors(name)),
                    order=order)


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
