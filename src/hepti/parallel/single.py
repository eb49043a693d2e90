"""The single-device engines, each a distributed executor on a group of one process: a
model's graph run by the interpreter (`SingleDevice`; `BertEncoder`, the same on token ids
that it checks first), and a CNN run by the height split's executor (`SingleCNN`).
`SINGLE` maps a family's executor kind to its engine.

These are executors, so they live in the parallel layer beside the distributed ones (a group of
one is the `single` strategy); the family's own operators come from hepti.model.family.
"""
from __future__ import annotations

import numpy as np

from hepti.families import family, family_graph
from hepti.graph import lower
from hepti.graph.split import Split, spatial_ops
from hepti.model.batch import Batch
from hepti.model.bert import validate_inputs
from hepti.model.cnn import CNNModel
from hepti.parallel.bands import BandExecutor, btsearch_order
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


class SingleCNN:
    """A CNN on one process: the height split's executor (hepti.parallel.bands) on a group of
    one, every spatial op in one group (no exchange, one trace span a forward), the ops in
    the model's order, each tensor let go after its last reader in it: what the memory model
    of operator order prices (hepti.order.memory). `forward(pixels)` -> logits [N, classes];
    `run(batch)` -> logits as [B, 1, classes] (one output row per image, which the runner's
    pooling passes through)."""

    def __init__(self, model: CNNModel):
        self.model, self.config = model, model.config
        g = model.graph
        self.executor = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)),
                                     model.weights, model.threads, model.order)
        self.layer_bytes, self.primary_bytes = model.weights.nbytes, 0

    @classmethod
    def from_store(cls, store, threads: int = 1) -> "SingleCNN":
        """The model's weights from `store`, run in BTSearch's order (as `hepti run` runs it
        on many ranks)."""
        model = CNNModel.from_store(store, threads)
        model.set_order(btsearch_order(model.graph))
        return cls(model)

    def forward(self, pixels: np.ndarray, counter=None, taps: dict | None = None) -> np.ndarray:
        """pixels float32 [N, 3, H, W], normalised (torch's layout) -> logits [N, classes].
        `counter` and `taps` as hepti.parallel.bands `BandExecutor.forward`'s (NHWC maps)."""
        return self.executor.forward(pixels, counter=counter, taps=taps)

    def run(self, batch) -> np.ndarray:
        return self.forward(batch.pixels)[:, None, :]


SINGLE = {"interpreter": SingleDevice, "bands": SingleCNN}  # by hepti.families executor kind
