"""Byte counts of weight slices, from the model's graph alone (no weights needed).

The runtime checks a memory budget with these before it reads anything; the planner's cost model
uses the same numbers, so the two agree on what a share costs. Any family: the weights are the
ones its graph's operators name (hepti.graph), with how a unit of a split cuts them.

`dtype` is the folder's (index.json's "dtype", `WeightStore.dtype`): in an int8 folder the
layers' GeMM matrices (`quantized_weights`) are int8 plus one float32 scale per GROUP values of
a stored row (hepti.kernels.int8), about 1.06 bytes a weight instead of 4; the rest stays
float32. A float32 count of an int8 folder overstates its layers about 3.8 times.
"""
from __future__ import annotations

from functools import lru_cache

from hepti.graph.ir import F32, ON_PRIMARY
from hepti.families import family_graph
from hepti.kernels.int8 import GROUP, n_groups

INT8 = "int8"  # the folder dtype whose GeMM matrices are int8 (hepti.weights.layout.INT8)


@lru_cache(maxsize=32)
def _graph(cfg):
    return family_graph(cfg, 1, 1)


def _names(ops) -> list[str]:
    return list(dict.fromkeys(w for op in ops for w in op.weights))


@lru_cache(maxsize=32)
def quantized_weights(cfg) -> frozenset[str]:
    """Local names of the layer weights an int8 folder stores as int8: the matrices of the
    layer's GeMMs (attention projections, MLP); hepti.weights.layout.quantized_tensors."""
    return frozenset(w for op in _graph(cfg).layer if op.kind == "gemm" for w in op.matrices)


def _bytes(cfg, name: str, elements: int, dtype: str) -> float:
    """Stored bytes of `elements` values (whole rows) of layer weight `name` in a folder of
    `dtype`: float32, or int8 values and a float32 scale per group of each stored row."""
    w = _graph(cfg).weights[name]
    if dtype != INT8 or name not in quantized_weights(cfg):
        return F32 * elements
    row = w.shape[1]
    return elements / row * (row + F32 * n_groups(row, GROUP))


def layer_slice_bytes(cfg, n_heads: int, n_ffn: int, dtype: str = "float32") -> int:
    """Weight bytes of one layer's slice with `n_heads` whole heads and `n_ffn` FFN columns:
    each sliced weight's share, every other layer weight whole."""
    g = _graph(cfg)
    count = {"heads": n_heads, "ffn": n_ffn}
    total = 0.0
    for name in _names(g.layer):
        w = g.weights[name]
        n = w.per_unit * count[w.split] if w.split is not None else w.elements
        total += _bytes(cfg, name, n, dtype)
    return int(round(total))


def layer_bytes(cfg, dtype: str = "float32") -> int:
    """Weight bytes of one whole encoder layer."""
    return layer_slice_bytes(cfg, cfg.num_attention_heads, cfg.intermediate_size, dtype)


def embedding_bytes(cfg) -> int:
    """Weight bytes of the operators the primary runs alone (the embeddings: float32 in every
    folder)."""
    g = _graph(cfg)
    ops = [op for op in g.prologue + g.epilogue if ON_PRIMARY in op.splits]
    return F32 * sum(g.weights[n].elements for n in _names(ops))


def model_bytes(cfg, dtype: str = "float32") -> int:
    g = _graph(cfg)
    rest = _names([op for op in g.prologue + g.epilogue if ON_PRIMARY not in op.splits])
    return (embedding_bytes(cfg) + cfg.num_hidden_layers * layer_bytes(cfg, dtype)
            + F32 * sum(g.weights[n].elements for n in rest))


def spec_bytes(cfg, spec, dtype: str = "float32") -> float:
    """The bytes of a layer_spec's weights (hepti.parallel.engine.layer_spec): a stream
    spec's window of layers, or the resident layers' slices."""
    if spec is None:
        return 0.0
    kind, heads, ffn, extra = spec
    if kind == "layers":  # each layer its own (heads, ffn) ranges (a GenEFlow plan)
        return float(sum(layer_slice_bytes(cfg, h[1] - h[0], f[1] - f[0], dtype)
                         for h, f in heads))
    layers = extra if kind == "stream" else extra[1] - extra[0]
    return float(layer_slice_bytes(cfg, heads[1] - heads[0], ffn[1] - ffn[0], dtype) * layers)
