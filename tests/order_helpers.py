"""Tiny CNNs of hepti's families with seeded random weights, in memory, and another order to
run them in; one seeded batch for an encoder: what tests/test_order_exec.py and
tests/mpi/test_order_bands.py, test_order_interp.py share."""
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
    """A tiny CNN of hepti's families with seeded random weights, in memory (its graph, packed
    weights and order: hepti.parallel.single `SingleCNN(model)` runs it on one process)."""
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


def encoder_batch(cfg, text_tokens: int):
    """(a seeded batch of one input, its token count) for BERT (`text_tokens` ids) or ViT (an
    image of the model's size: its patches and class token)."""
    from hepti.inputs import Batch
    rng = np.random.default_rng(0)
    if cfg.model_type == "vit":
        T = cfg.seq_len
        return Batch(None, np.ones((1, T), np.int64), None,
                     pixels=rng.standard_normal((1, 3, cfg.image_size, cfg.image_size),
                                                dtype=np.float32)), T
    T = text_tokens
    return Batch(rng.integers(1, cfg.vocab_size, (1, T)), np.ones((1, T), np.int64),
                 np.zeros((1, T), np.int64)), T
