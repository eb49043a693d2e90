"""What the runtime needs of a model family besides its graph: the primary rank's operators (the
embeddings, which read the family's own inputs) and how to warm the kernels up.

The layers are the graph's (hepti.graph.encoder) and run on the interpreter
(hepti.parallel.interpreter), on one process (hepti.parallel.single.SingleDevice) or split across
ranks (hepti.parallel.engine.Job); this registry is how both find a family's own code by the config's
`model_type`, so that neither names a family.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

from hepti.model import bert, cnn, vit

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


FAMILIES = {"bert": Family("bert", bert.primary_ops, bert.load_kernels),
            "vit": Family("vit", vit.primary_ops, vit.load_kernels)}


def family(config) -> Family:
    try:
        return FAMILIES[config.model_type]
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
        load = cnn.load_kernels
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
