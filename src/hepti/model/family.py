"""What the runtime needs of a model family besides its graph: the primary rank's operators (the
embeddings, which read the family's own inputs) and how to warm the kernels up.

The layers are the graph's (hepti.graph.encoder) and run on the interpreter
(hepti.parallel.interpreter), on one process (`SingleDevice`) or split across ranks
(hepti.parallel.engine.Job); this registry is how both find a family's own code by the config's
`model_type`, so that neither names a family.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

log = logging.getLogger("hepti")
# A warm Numba cache loads every kernel in well under a second; past this, it is compiling.
COMPILE_NOTICE_S = 1.5


@dataclass(frozen=True)
class Family:
    """primary_ops(config, store) -> {op kind: fn(batch) -> [M, C]} for the operators rank 0
    runs alone, reading their weights from the store; load_kernels(threads) has Numba load every
    kernel a forward calls."""

    name: str
    primary_ops: Callable
    load_kernels: Callable


def _bert() -> Family:
    from hepti.model import bert
    return Family("bert", bert.primary_ops, bert.load_kernels)


def _vit() -> Family:
    from hepti.model import vit
    return Family("vit", vit.primary_ops, vit.load_kernels)


FAMILIES = {"bert": _bert, "vit": _vit}


def family(config) -> Family:
    try:
        return FAMILIES[config.model_type]()
    except KeyError:
        raise ValueError(f"no runtime for model_type {config.model_type!r}; known: "
                         f"{', '.join(FAMILIES)}") from None


def load_kernels(config, threads: int = 1, announce: bool = True) -> None:
    """Load every kernel a forward of this model calls before any forward is timed. On a cold
    Numba cache (a new clone, edited kernels) that compiles them, once, for up to a few minutes
    on a slow device: if it takes longer than COMPILE_NOTICE_S, say so while it runs (rank 0
    alone: `announce`), so that a first run neither looks hung nor reports compile time as
    forward time."""
    if config.model_type == "cnn":  # the CNNs have no Family entry yet: no primary operators
        from hepti.model.cnn import load_kernels as load
    else:
        load = family(config).load_kernels
    t0 = time.perf_counter()
    notice = threading.Timer(COMPILE_NOTICE_S, lambda: log.info(
        "compiling kernels (once; later runs load them from Numba's cache)..."))
    if announce:
        notice.daemon = True
        notice.start()
    try:
        load(threads)
    finally:
        notice.cancel()
    if announce and time.perf_counter() - t0 > COMPILE_NOTICE_S:
        log.info("kernels ready in %.1f s", time.perf_counter() - t0)


class SingleDevice:
    """The single-device engine: the graph's `single` schedule (every operator whole) run by the
    interpreter on a group of one process, the same code that runs every distributed strategy.
    `run(batch)` -> the last hidden state [B, T, C]."""

    def __init__(self, config, layers, executor, primary_bytes: int):
        self.config, self.layers, self.executor = config, layers, executor
        self.primary_bytes = primary_bytes

    @classmethod
    def from_store(cls, store, threads: int = 1, progress=None) -> "SingleDevice":
        from hepti.graph import lower
        from hepti.graph.encoder import family_graph
        from hepti.parallel.comm import Comm
        from hepti.parallel.interpreter import Interpreter
        from hepti.parallel.layers import ResidentLayers, slice_packer
        from hepti.parallel.slices import outside_layers

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
