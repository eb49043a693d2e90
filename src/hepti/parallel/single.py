"""The single-device engine: a model's graph run by the interpreter on a group of one process
(`SingleDevice`), and `BertEncoder`, the same on token ids that it checks first.

These are executors, so they live in the parallel layer beside the distributed ones (a group of
one is the `single` strategy); the family's own operators come from hepti.model.family.
"""
from __future__ import annotations

import numpy as np

from hepti.graph import lower
from hepti.families import family_graph
from hepti.model.batch import Batch
from hepti.model.bert import validate_inputs
from hepti.families import family
from hepti.parallel.comm import Comm
from hepti.parallel.interpreter import Interpreter
from hepti.parallel.layers import ResidentLayers, slice_packer
from hepti.parallel.slices import outside_layers


class SingleDevice:
    """The single-device engine: the graph's `single` schedule (every operator whole) run by the
    interpreter on a group of one process, the same code that runs every distributed strategy.
    `run(batch)` -> the last hidden state [B, T, C]."""

    def __init__(self, config, layers, executor, primary_bytes: int):
        self.config, self.layers, self.executor = config, layers, executor
        self.primary_bytes = primary_bytes

    @classmethod
    def from_store(cls, store, threads: int = 1, progress=None) -> "SingleDevice":
        cfg = store.config
        ops = family(cfg).primary_ops(cfg, store)
        H, F, L = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers
        graph = family_graph(cfg, 1, 1)
        layers = ResidentLayers(store, L, (0, H), (0, F), slice_packer(graph), progress=progress)
        steps = lower.schedule(graph, lower.assignment(graph, "single"), L)
        executor = Interpreter(Comm(None), graph, steps, layers, ops, [1.0],
                               {"heads": [H], "ffn": [F]}, threads, outside_layers(graph, store))
        return cls(cfg, layers, executor, sum(getattr(f, "nbytes", 0) for f in ops.values()))

    @property
    def layer_bytes(self) -> int:
        return self.layers.resident_bytes

    def run(self, batch) -> np.ndarray:
        """A checked batch (hepti.inputs.Batch) -> last hidden state [B, T, C]."""
        B, T = batch.mask.shape
        return self.executor.forward(batch, B, T).reshape(B, T, -1)


class BertEncoder:
    """The single-device engine on token ids (`SingleDevice`), checking them."""

    def __init__(self, engine):
        self.engine, self.config = engine, engine.config

    @classmethod
    def from_store(cls, store, threads: int = 1, progress=None) -> "BertEncoder":
        return cls(SingleDevice.from_store(store, threads, progress))

    def forward(self, ids, mask=None, token_type=None) -> np.ndarray:
        """ids [B, T] -> last hidden state [B, T, C]."""
        ids, key_mask, token_type = validate_inputs(self.config, ids, mask, token_type)
        return self.engine.run(Batch(ids, key_mask, token_type))
