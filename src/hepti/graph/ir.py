"""The operator graph's pieces: tensors, operators, the graph, and the layouts between ranks.

Every activation is a matrix of token rows, [M, width] with M = B * T (a mask is width 1), so a
tensor's shape is its width; weights have a stored shape and say which unit splits them. An
operator does one kernel call's work and names the ways it can be split across ranks (`Op.splits`).

How a split places an operator's inputs and outputs on the ranks, and so which collective a
tensor needs between two operators, is `needs` and `produces`; hepti.graph.lower turns those
into sync points.
"""
from __future__ import annotations

from dataclasses import dataclass

F32 = 4

# Where a tensor's values are, across the active ranks:
FULL = "full"  # every active rank holds all M rows
ROWS = "rows"  # rank i holds its own rows (counts["rows"][i] of them)
PARTIAL = "partial"  # every rank holds all M rows of a partial sum; the sum is the value
LOCAL = "local"  # rank i holds its own columns (a column split's output), for the same split
PRIMARY = "primary"  # rank 0 alone holds it

# Split choices an operator may support:
BY_ROWS = "rows"  # each rank its token rows; weights whole on every rank
BY_COLS = "cols"  # each rank its output columns, in units of `Op.unit` (heads or FFN columns)
BY_K = "k"  # each rank its block of the reduction dimension: the output is a partial sum
BY_UNIT = "unit"  # attention: each rank its whole heads
ON_PRIMARY = "primary"  # rank 0 alone (the embeddings)


@dataclass(frozen=True)
class Tensor:
    """An activation [M, width] (float32), or an input every rank needs before the first op."""

    name: str
    width: int
    kind: str = "activation"  # "activation" | "input" (made by the engine on rank 0)

    def row_bytes(self) -> int:
        return F32 * self.width


@dataclass(frozen=True)
class Weight:
    """A stored weight and its stored `shape` (hepti.weights.layout: the dimension a rank
    slices is axis 0). `split`: the unit ("heads", "ffn") a sliced weight is cut by, with
    `per_unit` of its elements per unit; None when every rank that needs it reads it whole."""

    name: str
    shape: tuple[int, ...]
    split: str | None = None
    per_unit: int = 0

    @property
    def elements(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def whole_bytes(self) -> int:
        return F32 * self.elements


@dataclass(frozen=True)
class Op:
    """One kernel call's work on token rows.

    kind "gemm": [m, k] x [k, n] (+ bias, + GeLU: fused, no cost of their own), m token rows;
    its stored `matrices` (side by side along n, each stored with the dimension a rank slices
    as axis 0: [n, k] for a column split, [k, n] for a block-wise one: hepti.weights.layout),
    `bias` (its pieces, side by side) and `act` ("gelu" or ""). Several outputs are its
    columns, side by side, in proportion to their widths (Q | K V).
    kind "attention": softmax(q k^T) v for `heads` heads of width `k` against `T` keys;
    inputs (q, kv), q the first columns of a fused QKV GeMM's output.
    kind "elementwise": `per_row` elements of work per token row, one pass; `fn` says which:
    "add_ln" is LayerNorm(total + bias + residual) over inputs (total, residual) with weights
    (bias, gamma, beta) and `eps`; "ln" LayerNorm(x) with (gamma, beta); "add" total + bias +
    residual with (bias,). kind "embed": on rank 0, done by the family's own code (the runtime
    is handed it): `per_row` elements per row, or a [m, k] x [k, n] GeMM when k and n are set
    (patches times the patch embedding).
    `unit` names what a cols, k or unit split counts ("heads", "ffn"); `unit_width` how many
    of the split dimension's elements one unit is (a head's D columns of each of Q, K, V: 3D).
    """

    name: str
    kind: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    splits: tuple[str, ...]
    weights: tuple[str, ...] = ()
    k: int = 0
    n: int = 0
    heads: int = 0
    per_row: float = 0.0
    unit: str | None = None
    unit_width: int = 1
    block: str = ""  # the piece it belongs to ("attention", "ffn"); phases are named by blocks
    matrices: tuple[str, ...] = ()  # gemm: stored weight matrices, side by side along n
    bias: tuple[str, ...] = ()  # gemm: bias pieces, side by side
    act: str = ""  # gemm: "gelu" after the bias
    fn: str = ""  # elementwise: "add_ln", "ln", "add"
    eps: float = 0.0  # elementwise: LayerNorm's epsilon

    @property
    def piece(self) -> str:
        return self.block or self.name


@dataclass
class Graph:
    """A model: ops in execution order, repeated layers marked, tensors and weights by name.

    `prologue` runs once before the layers, `layer` is one layer's ops (run `n_layers` times:
    a layer rewrites the tensors the one before wrote, under the same names), `epilogue` once
    after. Each layer has its own weights, under the same local names (layer.{i}.<name>)."""

    family: str
    tensors: dict[str, Tensor]
    weights: dict[str, Weight]
    prologue: list[Op]
    layer: list[Op]
    epilogue: list[Op]
    n_layers: int
    units: dict[str, int]  # how many of each split unit: {"rows": M, "heads": H, "ffn": F}
    seq_len: int  # T: keys per query (attention's cost)
    output: str = "x"  # what rank 0 must hold at the end
    inputs_everywhere: tuple[str, ...] = ()  # sent to every rank before the first op (the mask)
    whole_units: tuple[str, ...] = ()  # units that cannot be cut ("heads")


# --- layouts: what a split needs and makes ----------------------------------------------------

def needs(op: Op, split: str) -> list[tuple[str, str]]:
    """(tensor, layout) the op needs of each input under `split`. A FULL tensor also serves
    ROWS (a rank takes its own rows) and PRIMARY."""
    if split == ON_PRIMARY:
        return [(t, PRIMARY) for t in op.inputs]
    if split == BY_ROWS:
        if op.kind == "attention":  # own query rows against every key and value
            return [(op.inputs[0], ROWS), (op.inputs[1], FULL)]
        return [(t, ROWS) for t in op.inputs]
    if split == BY_COLS:  # all rows of the input, own columns of the output
        return [(t, FULL) for t in op.inputs]
    if split in (BY_K, BY_UNIT):  # own columns of the input, as the split before made them
        return [(t, LOCAL) for t in op.inputs]
    raise ValueError(f"{op.name}: unknown split {split!r}")


def produces(op: Op, split: str) -> str:
    return {ON_PRIMARY: PRIMARY, BY_ROWS: ROWS, BY_COLS: LOCAL, BY_K: PARTIAL, BY_UNIT: LOCAL}[split]


def satisfies(have: str, need: str) -> bool:
    return have == need or (have == FULL and need in (ROWS, PRIMARY))


def transition(have: str, need: str) -> str | None:
    """The collective that turns layout `have` into `need` (None: nothing to send)."""
    if satisfies(have, need):
        return None
    table = {(ROWS, FULL): "allgatherv", (PARTIAL, ROWS): "reduce_scatter",
             (PRIMARY, FULL): "bcast", (PRIMARY, ROWS): "scatterv", (ROWS, PRIMARY): "gatherv"}
    try:
        return table[(have, need)]
    except KeyError:
        raise ValueError(f"no collective turns a {have} tensor into a {need} one") from None


def after(have: str, need: str) -> str:
    """The tensor's layout once `need` is met (a FULL tensor stays FULL)."""
    return have if satisfies(have, need) else need
