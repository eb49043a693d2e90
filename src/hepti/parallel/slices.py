"""A rank's slice of one layer, packed for the kernels, keyed by the graph's operators.

`LayerSlice.pack` reads what the graph says each operator needs from the tensors a rank read
(hepti.weights.store.read_layer_slice: its rows of every sliced weight, the small ones whole):
- a gemm: its `matrices` side by side along n, packed for the GeMM kernel (`K.pack_weight`:
  `K.pack_b`, or `K.pack_q` for an int8 folder's matrices), and its
  `bias` pieces joined. A weight is stored with the dimension a rank slices as axis 0
  (hepti.weights.layout), so a gemm that can be split by columns has its matrices stored
  [n, k] (packed transposed) and one split block-wise stored [k, n]. A rank that holds none of
  a sliced gemm's units gets None;
- any other operator: its `weights`, in order, as float32 arrays.
Nothing here knows a family: the operator names and weight names come from the graph.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hepti import kernels as K
from hepti.graph.ir import BY_COLS, Graph, ON_PRIMARY


def _f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def _join(mats: list):
    """A gemm's matrices side by side along n (stored rows): float32, or int8 (an int8 folder's
    QuantMatrix, which K.pack_weight packs for the int8 kernels)."""
    if isinstance(mats[0], K.QuantMatrix):
        return K.QuantMatrix.concat(mats)
    return _f32(np.concatenate(mats) if len(mats) > 1 else mats[0])


@dataclass
class LayerSlice:
    """Layer `index`: `params[op name]` is (PackedB | QuantB | None, bias | None) for a gemm and the
    tuple of its weights for any other operator; `nbytes` what that holds in RAM."""

    index: int
    params: dict[str, tuple]
    nbytes: int

    @classmethod
    def pack(cls, graph: Graph, index: int, tensors: dict[str, np.ndarray],
             ops=None) -> "LayerSlice":
        """Layer `index` from its tensors; or, with `ops`, those operators' weights (index -1)."""
        params, nbytes = {}, 0
        for op in (graph.layer if ops is None else ops):
            if op.kind == "gemm":
                by_cols = BY_COLS in op.splits  # stored [n, k]; else [k, n]
                m = _join([tensors[w] for w in op.matrices])
                packed = K.pack_weight(m, trans=by_cols) if m.shape[0] else None
                bias = _f32(np.concatenate([tensors[w] for w in op.bias])) if op.bias else None
                params[op.name] = (packed, bias)
                nbytes += (packed.nbytes if packed is not None else 0)
                nbytes += bias.nbytes if bias is not None else 0
            elif op.weights:
                vecs = tuple(_f32(tensors[w]) for w in op.weights)
                params[op.name] = vecs
                nbytes += sum(v.nbytes for v in vecs)
        _into_huge_pages([p for p, _ in (params[op.name] for op in (graph.layer if ops is None
                                                                   else ops) if op.kind == "gemm")
                          if isinstance(p, K.PackedB)])
        return cls(index, params, nbytes)


def _into_huge_pages(packed: list) -> None:
    """Move a layer's packed fp32 weights into one mapping that may live in 2 MiB pages
    (`K.huge_empty`), each on a 64-byte line, and let their own arrays go. In 4 KiB pages the
    panels' physical placement, and with it how they meet in the physically indexed L2, changed
    from process to process: MiniLM's forward read 0.95-0.97x with the layers' weights in huge
    pages, in processes alive at once taking turns (2026-12-01, docs/results/model.md)."""
    sizes = [-(-p.panels.size // 16) * 16 for p in packed]
    if not packed or sum(sizes) * 4 < K.HUGE_PAGE:
        return
    arena = K.huge_empty(sum(sizes))
    if arena.base is None or not arena.flags.writeable:
        return
    o = 0
    for p, size in zip(packed, sizes):
        view = arena[o:o + p.panels.size].reshape(p.panels.shape)
        view[...] = p.panels
        p.panels = view
        o += size


def outside_layers(graph: Graph, store) -> "LayerSlice":
    """The weights of the operators before and after the layers that every rank may run (not
    the primary's own, which its family code reads): read whole from the store."""
    ops = [op for op in graph.prologue + graph.epilogue if ON_PRIMARY not in op.splits]
    return LayerSlice.pack(graph, -1, {w: store.read(w) for op in ops for w in op.weights}, ops)
