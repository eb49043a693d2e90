"""The registry of model families: each family declared once, and every lookup by `model_type`.

A `Family` says, in one place, what hepti needs of a family: its config class, its graph
builder, its own operators (what the primary rank runs alone, and how to warm the kernels up),
its weight layout (by name: the layout and its checkpoint key names are
`hepti.weights.layout.LAYOUTS[name]`), the inputs it takes, what it outputs, the executor that
runs it and the planner that splits it. Commands, the job driver and serve ask the record
(`family(config).inputs`, `.executor`, `.planner`) and never name a family.

Where it sits: in the model layer (docs/architecture.md). It must see the config classes and
graph builders (graph layer) and each family's own operators (model layer, the Llama config
included); the weight layout, the executors and the planners sit above it, so the record names
them and those layers map the name to their code. Below it, nothing looks a family up.

To add a family: docs/add-a-family.md.
"""
from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from hepti.config import (PRESET_DEFAULTS, RANDOM_PRESETS, BertConfig, CNNConfig, ModelConfig,
                          ViTConfig)
from hepti.errors import ConfigError
from hepti.graph import cnn as cnn_graph
from hepti.graph import encoder
from hepti.graph.ir import Graph
from hepti.model import bert, cnn, llama, vit

log = logging.getLogger("hepti")
# A warm Numba cache loads every kernel in well under a second; past this, it is compiling.
COMPILE_NOTICE_S = 1.5

# What a family takes: token texts, token id arrays, image files, pixel arrays
INPUT_KINDS = ("text", "ids", "image", "pixels")
# What runs it: the step-list interpreter (hepti.parallel.interpreter, one graph for every
# strategy), height bands (hepti.parallel.bands), the decoder's own forward on a shard
# (hepti.parallel.decoder: `single` and `tensor`, run by `hepti generate`; not by `hepti run`
# or serve)
EXECUTORS = ("interpreter", "bands", "decoder")
# What splits it: the LP and GenEFlow over the operator graph (hepti.plan.partition, .genetic),
# CoEdge's bands (hepti.plan.coedge, .genetic_cnn); None: not planned yet
PLANNERS = ("lp", "coedge", None)


@dataclass(frozen=True)
class Family:
    """One model family, declared once (module docstring)."""

    model_type: str                 # the config's model_type
    label: str                      # for messages: "BERT", "ViT", "CNN", "Llama"
    config: type                    # its config class: .from_dict(d, name=...)
    graph: Callable | None          # interpreter: (cfg, B, T) -> Graph; bands: (cfg) -> cnn Graph
    layout: str                     # hepti.weights.layout.LAYOUTS key: stored names, HF key maps
    inputs: tuple[str, ...]         # of INPUT_KINDS
    output: str                     # "embeddings" (pooled or per token), "logits", "tokens"
    executor: str                   # of EXECUTORS
    planner: str | None             # of PLANNERS
    load_kernels: Callable | None   # (threads) -> None: Numba loads every kernel a forward calls
    primary_ops: Callable | None = None  # (config, store) -> {op kind: fn(batch) -> [M, C]}
    any_image_size: bool = False    # images of any height and width (else the config's size)

    @property
    def vision(self) -> bool:
        return "pixels" in self.inputs


FAMILIES = {f.model_type: f for f in (
    Family("bert", "BERT", BertConfig, encoder.bert, "bert", ("text", "ids"), "embeddings",
           "interpreter", "lp", bert.load_kernels, bert.primary_ops),
    Family("vit", "ViT", ViTConfig, encoder.vit, "vit", ("image", "pixels"), "embeddings",
           "interpreter", "lp", vit.load_kernels, vit.primary_ops),
    Family("cnn", "CNN", CNNConfig, cnn_graph.build, "cnn", ("image", "pixels"), "logits",
           "bands", "coedge", cnn.load_kernels, any_image_size=True),
    Family("llama", "Llama", llama.LlamaConfig, None, "decoder", ("text", "ids"), "tokens",
           "decoder", None, None),
)}


def family(of) -> Family:
    """The family of a config (or of a model_type string); ConfigError names the known ones."""
    mt = of if isinstance(of, str) or of is None else getattr(of, "model_type", None)
    try:
        return FAMILIES[mt]
    except (KeyError, TypeError):
        raise ConfigError(unknown(mt)) from None


def unknown(mt) -> str:
    """The one message for a model_type hepti does not know."""
    known = ", ".join(FAMILIES)
    if mt is None:
        return f"the config has no model_type; hepti supports: {known}"
    return f"unsupported model_type {mt!r}; hepti supports: {known}"


def config_from_dict(d: dict, name: str = "") -> ModelConfig:
    """A family's config, its class chosen by d['model_type'] (ConfigError for other types)."""
    if not isinstance(d, dict):
        raise ConfigError(f"a model config must be a JSON object, not {type(d).__name__}")
    return family(d.get("model_type")).config.from_dict(d, name=name)


def config_from_json(path: str | Path, name: str = "") -> ModelConfig:
    """config_from_dict of a config.json file."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; a model folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return config_from_dict(d, name=name)


def preset_config(name: str) -> ModelConfig:
    """The config of a RANDOM_PRESETS entry (name 'random-NAME')."""
    if name not in RANDOM_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(RANDOM_PRESETS)} "
                          "or give a config.json path")
    d = dict(RANDOM_PRESETS[name])
    mt = d.setdefault("model_type", "bert")
    return config_from_dict({**PRESET_DEFAULTS[mt], **d}, name=f"random-{name}")


def family_graph(cfg, B: int, T: int) -> Graph:
    """The operator graph of an interpreter family's config, for batches of B x T tokens."""
    fam = family(cfg)
    if fam.executor != "interpreter":
        raise ValueError(f"no operator graph for model_type {cfg.model_type!r} (a {fam.label}, "
                         f"run by {fam.executor}); the interpreter's families: "
                         f"{', '.join(f.model_type for f in FAMILIES.values() if f.executor == 'interpreter')}")
    return fam.graph(cfg, B, T)


def load_kernels(config, threads: int = 1, announce: bool = True) -> None:
    """Load every kernel a forward of this model calls before any forward is timed. On a cold
    Numba cache (a new clone, edited kernels) that compiles them, once, for up to a few minutes
    on a slow device: if it takes longer than COMPILE_NOTICE_S, say so while it runs (rank 0
    alone: `announce`), so that a first run neither looks hung nor reports compile time as
    forward time."""
    load = family(config).load_kernels
    if load is None:
        return
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
