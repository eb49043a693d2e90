"""Strategies as assignments of split choices, and lowering an assignment to a rank schedule
and to the cost program.

An assignment maps each operator to one of its splits; a key "name@i" overrides operator
`name`'s split in layer i alone (`split_in`: GenEFlow's per-layer genes, hepti.plan.genetic). Walking the operators in order with
each tensor's layout (hepti.graph.ir), every input whose layout is not what the operator needs
becomes a sync point: the collective `ir.transition` names (`schedule`). A cost-program Phase
is the work between two sync points, ending in the collective (`phases`, folded by `compress`).
Nothing here knows a model family.

Weight bytes (memory, and what `stream` reads and packs) are the folder's stored bytes: float32,
or with `int8_group` (an int8 folder, `hepti convert --dtype int8`: index.json's tensors'
"group") the layers' GeMM matrices as int8 with one float32 scale per group of a stored row,
the rest float32 (`weight_bytes`; hepti.model.sizes counts the same). Compute is FLOPs either
way: the int8 GeMM runs at float32's rate.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from hepti.graph.ir import (BY_COLS, BY_K, BY_ROWS, BY_UNIT, F32, FULL, LOCAL, ON_PRIMARY, PARTIAL,
                            PRIMARY, ROWS, Graph, Op, after, needs, produces, transition)
from hepti.graph.program import ACTIVE, ROOT, Collective, MemTerm, Phase, Stream, Work

# The GeMM kernel's blocks (hepti.kernels.config.MR and NR, which tests/test_plan.py checks;
# not imported, since importing the kernels sets Numba up, which the planner does not
# need): row tiles of MR rows, weight panels of NR output columns.
GEMM_ROW_TILE = 8
GEMM_COL_PANEL = 32
SHAPE_BYTES = 16  # the int64 [B, T] the engine broadcasts before each batch (engine.Job._one_batch)

ROWS_SPLITS = {"gemm": BY_ROWS, "attention": BY_ROWS, "elementwise": BY_ROWS, "embed": ON_PRIMARY}
UNIT_SPLITS = {"gemm": None, "attention": BY_UNIT, "elementwise": BY_ROWS, "embed": ON_PRIMARY}


def assignment(graph: Graph, strategy: str) -> dict[str, str]:
    """Each operator's split under a strategy. `rows`: every operator on its token rows
    (weights replicated). `tensor` (and `even`, `single`, `stream`, which differ in shares or in
    where the weights live): GeMMs split by their unit, column-wise where they read a whole
    input and block-wise (partial sums) where they read the split before's columns; attention
    by heads; elementwise work on token rows."""
    ops = graph.prologue + graph.layer + graph.epilogue
    if strategy == "rows":
        return {op.name: ROWS_SPLITS[op.kind] for op in ops}
    if strategy in ("tensor", "even", "single", "stream"):
        out = {}
        for op in ops:
            split = UNIT_SPLITS[op.kind]
            if split is None:
                split = BY_K if BY_K in op.splits and _reads_split_columns(graph, op, out) else BY_COLS
            out[op.name] = split
        return out
    raise ValueError(f"no assignment for strategy {strategy!r}")


def split_in(assign: dict[str, str], op: Op, layer: int | None) -> str:
    """`op`'s split in `layer` (None: outside the layers): its "name@layer" entry if any."""
    if layer is not None:
        split = assign.get(f"{op.name}@{layer}")
        if split is not None:
            return split
    return assign[op.name]


def per_layer(assign: dict[str, str]) -> bool:
    """Whether some layer's operators split unlike the others' ("name@i" entries)."""
    return any("@" in k for k in assign)


def check_assignment(graph: Graph, assign: dict[str, str]) -> dict[str, str]:
    """`assign` if it gives every operator of the graph one of its splits (in every layer, for
    "name@i" entries) and lowers to a schedule (each input's layout reachable by a collective:
    `ir.transition`), else ValueError naming the first operator that does not. Names of
    operators or layers the graph lacks are errors too."""
    ops = graph.prologue + graph.layer + graph.epilogue
    by_name = {op.name: op for op in ops}
    layer_ops = {op.name for op in graph.layer}
    for key, split in assign.items():
        name, _, at = key.partition("@")
        if name not in by_name:
            raise ValueError(f"no operator named {name!r} (the graph's: {', '.join(sorted(by_name))})")
        if at and (name not in layer_ops or not at.isdigit() or int(at) >= graph.n_layers):
            raise ValueError(f"{key!r}: a per-layer entry names a layer operator and a layer "
                             f"0..{graph.n_layers - 1}")
        if split not in by_name[name].splits:
            raise ValueError(f"operator {key!r} has split {split!r}; it supports "
                             f"{', '.join(by_name[name].splits)}")
    missing = [op.name for op in ops if op.name not in assign]
    if missing:
        raise ValueError(f"operator {missing[0]!r} has no split")
    schedule(graph, assign, graph.n_layers if per_layer(assign) else 1)  # ValueError if unreachable
    return dict(assign)


def sliced_units(graph: Graph, assign: dict[str, str], layer: int | None = None) -> set[str]:
    """The units whose weights `assign` slices across ranks (a GeMM split by columns or by its
    block of k) in `layer`, or in any layer (None): the rest every active rank holds whole."""
    layers = range(graph.n_layers) if layer is None else (layer,)
    return {graph.weights[w].split for i in layers for op in graph.layer
            if split_in(assign, op, i) in (BY_COLS, BY_K)
            for w in op.weights if graph.weights[w].split is not None}


def _reads_split_columns(graph: Graph, op: Op, done: dict[str, str]) -> bool:
    made_by = {t: o for o in graph.prologue + graph.layer + graph.epilogue for t in o.outputs}
    src = made_by.get(op.inputs[0])
    return src is not None and done.get(src.name) in (BY_COLS, BY_UNIT)


# --- cost ------------------------------------------------------------------------------------

def work(graph: Graph, op: Op, split: str) -> Work:
    """What `op` costs a rank under `split`, per unit of the dimension the rank's count is in."""
    M, T = graph.units["rows"], graph.seq_len
    if op.kind == "embed" and op.k and op.n:  # a GeMM on rank 0 (patch embedding)
        return Work("gemm", ROOT, 2.0 * M * op.k * op.n, min(M, op.k, op.n), name=op.name)
    if op.kind == "embed":
        return Work("elementwise", ROOT, M * op.per_row, name=op.name)
    if op.kind == "elementwise":
        return Work("elementwise", "rows", op.per_row, name=op.name)
    if op.kind == "attention":
        per = 4.0 * T * op.k * op.heads if split == BY_ROWS else 4.0 * M * T * op.k
        dim = "rows" if split == BY_ROWS else op.unit
        return Work("attention", dim, per, size_per_unit=per, name=op.name)  # speed by call FLOPs
    k, n = op.k, op.n
    if split == BY_ROWS:  # [r, k] x [k, n]
        return Work("gemm", "rows", 2.0 * k * n, min(k, n), 1, op.name, GEMM_ROW_TILE)
    if split == BY_COLS:  # [M, k] x [k, u w]
        w = op.unit_width
        return Work("gemm", op.unit, 2.0 * M * k * w, min(M, k), w, op.name, max(1, GEMM_COL_PANEL // w))
    if split == BY_K:  # [M, u w] x [u w, n]
        w = op.unit_width
        return Work("gemm", op.unit, 2.0 * M * w * n, min(M, n), w, op.name)
    raise ValueError(f"{op.name}: no cost for split {split!r}")


def _collective(graph: Graph, kind: str, tensor: str) -> Collective:
    t = graph.tensors[tensor]
    if kind == "bcast":
        return Collective("bcast", None, float(graph.units["rows"] * t.row_bytes()), tensor)
    return Collective(kind, "rows", float(t.row_bytes()), tensor)


def int8_weights(graph: Graph) -> frozenset[str]:
    """The weights an int8 folder stores as int8: the matrices of the layer's GeMMs
    (hepti.weights.layout.quantized_tensors)."""
    return frozenset(w for op in graph.layer if op.kind == "gemm" for w in op.matrices)


def weight_bytes(graph: Graph, name: str, elements: float, int8_group: int | None = None
                 ) -> float:
    """Stored bytes of `elements` values (whole stored rows) of weight `name`: float32, or, with
    `int8_group` and a GeMM matrix of a layer, int8 values and a float32 scale per group of
    each stored row (hepti.kernels.int8)."""
    if int8_group is None or name not in int8_weights(graph):
        return F32 * elements
    row = graph.weights[name].shape[1]
    return elements / row * (row + F32 * math.ceil(row / int8_group))


def _load_works(graph: Graph, ops: list[tuple[Op, str]], int8_group: int | None = None
                ) -> tuple[Work, ...]:
    """`stream`: the CPU of turning the phase's ops' stored slices into packed ones, one Work
    per unit (hepti.plan.workloads' `stream_program` says why it sits in the phase)."""
    per: dict[str, float] = {}
    for op, split in ops:
        if split in (BY_COLS, BY_K):
            for w in op.weights:
                wt = graph.weights[w]
                if wt.split is not None:
                    per[wt.split] = (per.get(wt.split, 0.0)
                                     + weight_bytes(graph, w, wt.per_unit, int8_group))
    return tuple(Work("load", u, b, name=f"load {u}") for u, b in per.items())


@dataclass(frozen=True)
class Step:
    """One entry of a rank's schedule: run `op` under `split` in `layer` (None outside the
    layers), or sync: the collective `kind` on `tensor`."""

    kind: str  # "op" | a collective: "bcast", "scatterv", "gatherv", "allgatherv", "reduce_scatter"
    op: Op | None = None
    split: str | None = None
    layer: int | None = None
    tensor: str | None = None
    own_rows: tuple[str, ...] = ()  # inputs held whole (FULL) of which the op takes its rank's rows


def schedule(graph: Graph, assign: dict[str, str], n_layers: int) -> list[Step]:
    """Every rank's schedule for one batch, layers unrolled: the inputs every rank needs, then
    each operator, with a sync step wherever an input's layout is not the one it needs (the
    collective `ir.transition` names), and at the end the output gathered on rank 0. The cost
    program (`phases`) is cut from this same list."""
    steps = [Step("bcast", tensor=t) for t in graph.inputs_everywhere]
    layout = {t: PRIMARY for t, ten in graph.tensors.items() if ten.kind == "input"}
    layout.update({t: FULL for t in graph.inputs_everywhere})
    ops = ([(op, None) for op in graph.prologue]
           + [(op, i) for i in range(n_layers) for op in graph.layer]
           + [(op, None) for op in graph.epilogue])
    for op, layer in ops:
        split = split_in(assign, op, layer)
        own = []
        for t, need in needs(op, split):
            kind = transition(layout[t], need)
            if kind is not None:
                steps.append(Step(kind, tensor=t))
            elif layout[t] == FULL and need == ROWS:
                own.append(t)
            layout[t] = after(layout[t], need)
        steps.append(Step("op", op, split, layer, own_rows=tuple(own)))
        for t in op.outputs:
            layout[t] = produces(op, split)
    kind = transition(layout[graph.output], PRIMARY)
    if kind is not None:
        steps.append(Step(kind, tensor=graph.output))
    return steps


def prologue_steps(steps: list[Step]) -> list[Step]:
    """The operators before the first layer's (the embeddings, which a pipeline's primary runs
    as each batch enters it)."""
    first = min(i for i, s in enumerate(steps) if s.layer is not None)
    return [s for s in steps[:first] if s.kind == "op"]


def stage_steps(steps: list[Step], start: int, stop: int, last: bool) -> list[Step]:
    """A pipeline stage's part of a one-rank schedule (`schedule` with every operator whole):
    the operators of layers [start, stop), and on the last stage the ones after the layers.
    Its sync steps are the pipeline's sends, not collectives: dropped."""
    end = max(i for i, s in enumerate(steps) if s.layer is not None)
    return [s for i, s in enumerate(steps) if s.kind == "op" and (
        (s.layer is not None and start <= s.layer < stop) or (last and i > end))]


def phases(graph: Graph, assign: dict[str, str], n_layers: int, stream: bool = False,
           int8_group: int | None = None) -> list[Phase]:
    """The whole inference's phases, layers unrolled: the engine's batch header, then the
    schedule cut at its sync steps, each phase the work before one, ending in its collective
    (`stream`: and the loads of its slices, `int8_group` as in `weight_bytes`)."""
    out = [Phase((), Collective("bcast", None, SHAPE_BYTES, "shape"), "batch shape")]
    pending: list[tuple[Op, str]] = []

    def close(coll: Collective | None) -> None:
        works = tuple(work(graph, op, s) for op, s in pending)
        if stream:
            works += _load_works(graph, pending, int8_group)
        name = "+".join(dict.fromkeys(op.piece for op, _ in pending)) or coll.name
        out.append(Phase(works, coll, name))
        pending.clear()

    for step in schedule(graph, assign, n_layers):
        if step.kind == "op":
            pending.append((step.op, step.split))
        else:
            close(_collective(graph, step.kind, step.tensor))
    if pending:
        close(None)
    return out


def compress(graph: Graph, assign: dict[str, str], stream: bool = False,
             int8_group: int | None = None) -> tuple[list[Phase], list[Phase], list[Phase], int]:
    """(start, layer, end, repeat): the unrolled phases with the layers' repeating part folded,
    so that the LP has one set of constraints per distinct phase. The repeating block is found
    on a lowering with two more layers (so that it shows at least twice), then checked."""
    L = graph.n_layers
    full = phases(graph, assign, L, stream, int8_group)
    more = phases(graph, assign, L + 2, stream, int8_group)
    p = len(phases(graph, assign, L + 1, stream, int8_group)) - len(full)
    for s in range(len(more) - 2 * p + 1):
        block = more[s:s + p]
        if p > 0 and more[s + p:s + 2 * p] == block:
            start, end = full[:s], full[s + (L - 1) * p:]
            if start + block * (L - 1) + end == full:
                return start, block, end, L - 1
            break
    return full, [], [], 0


def totals(graph: Graph, assign: dict[str, str]) -> dict[str, int]:
    """The split dimensions the assignment uses (token rows, or an op's unit), with their counts."""
    used = set()
    by_name = {op.name: op for op in graph.prologue + graph.layer + graph.epilogue}
    for key, split in assign.items():
        op = by_name[key.partition("@")[0]]
        if split == BY_ROWS:
            used.add("rows")
        elif split in (BY_COLS, BY_K, BY_UNIT):
            used.add(op.unit)
    return {d: n for d, n in graph.units.items() if d in used}


def layer_weight_bytes(graph: Graph, assign: dict[str, str], layer: int | None,
                       int8_group: int | None = None) -> tuple[dict[str, float], float]:
    """One layer's weights under `assign`: (bytes per unit of each sliced unit, bytes held
    whole), stored bytes (`weight_bytes`)."""
    sliced: dict[str, float] = {}
    whole = 0.0
    for op in graph.layer:
        split = split_in(assign, op, layer)
        for w in op.weights:
            wt = graph.weights[w]
            if wt.split is not None and split in (BY_COLS, BY_K):
                sliced[wt.split] = (sliced.get(wt.split, 0.0)
                                    + weight_bytes(graph, w, wt.per_unit, int8_group))
            else:
                whole += weight_bytes(graph, w, wt.elements, int8_group)
    return sliced, whole


def weight_memory(graph: Graph, assign: dict[str, str], int8_group: int | None = None
                  ) -> list[MemTerm]:
    """Weights a rank holds: per unit of its share for sliced weights, whole (every active
    rank) for the rest, and the prologue's (the embeddings) on rank 0. Per layer (`per_layer`
    terms, held once per resident layer), or, where layers split differently ("name@i"
    entries), summed over the layers as terms held once. Stored bytes (`weight_bytes`)."""
    if per_layer(assign):
        sliced, whole = {}, 0.0
        for i in range(graph.n_layers):
            s_i, w_i = layer_weight_bytes(graph, assign, i, int8_group)
            for u, b in s_i.items():
                sliced[u] = sliced.get(u, 0.0) + b
            whole += w_i
        terms = [MemTerm("weights", u, b) for u, b in sliced.items()]
        terms.append(MemTerm("weights", ACTIVE, whole))
    else:
        sliced, whole = layer_weight_bytes(graph, assign, None, int8_group)
        terms = [MemTerm("weights", u, b, per_layer=True) for u, b in sliced.items()]
        terms.append(MemTerm("weights", ACTIVE, whole, per_layer=True))
    root = sum(graph.weights[w].whole_bytes() for op in graph.prologue + graph.epilogue
               if assign[op.name] == ON_PRIMARY for w in op.weights)
    terms.append(MemTerm("weights", ROOT, float(root)))
    return terms


def stream_reads(graph: Graph, assign: dict[str, str], window: int,
                 int8_group: int | None = None) -> Stream:
    """What `stream` reads per layer: each sliced weight's bytes per unit, the rest whole."""
    terms = weight_memory(graph, assign, int8_group)
    per_unit = {t.dim: t.per_unit for t in terms if t.per_layer and t.dim != ACTIVE}
    fixed = sum(t.per_unit for t in terms if t.per_layer and t.dim == ACTIVE)
    return Stream(per_unit, fixed, window)


# --- activation memory: the tensors live at each step -----------------------------------------

def mlp_pair(a: Step, b: Step, readers: dict[str, int]) -> bool:
    """Whether op steps a then b are an MLP the interpreter runs as one K.ffn call: a's one
    output read by b alone, a with GeLU, b with no bias or activation, split alike (rows and
    rows, or a's columns and b's block of k). `readers`: how many of the graph's operators
    read each tensor."""
    if a.kind != "op" or b.kind != "op":
        return False
    x, y = a.op, b.op
    return (x.kind == y.kind == "gemm" and len(x.outputs) == 1 and y.inputs == x.outputs
            and readers.get(x.outputs[0]) == 1 and x.act == "gelu" and not y.act and not y.bias
            and (a.split, b.split) in ((BY_ROWS, BY_ROWS), (BY_COLS, BY_K)) and a.layer == b.layer)


def _readers(graph: Graph) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in graph.prologue + graph.layer + graph.epilogue:
        for t in op.inputs:
            out[t] = out.get(t, 0) + 1
    return out


def _placed(graph: Graph, tensor: str, layout: str, unit: str | None) -> dict[str, float]:
    """Bytes a rank holds of `tensor` in `layout`, by the dimension they scale with: every
    row (FULL, PARTIAL: ACTIVE; PRIMARY: ROOT), its own rows ("rows"), or its units' columns
    (LOCAL, per unit of the split that made it: the tensor's width over the units)."""
    b = graph.units["rows"] * graph.tensors[tensor].row_bytes()
    if layout in (FULL, PARTIAL):
        return {ACTIVE: float(b)}
    if layout == PRIMARY:
        return {ROOT: float(b)}
    if layout == ROWS:
        return {"rows": float(graph.tensors[tensor].row_bytes())}
    if layout == LOCAL:
        return {unit: b / graph.units[unit]}
    raise ValueError(f"{tensor}: unknown layout {layout!r}")


def _scratch(graph: Graph, step: Step) -> dict[str, float]:
    """What a step allocates beyond the tensors it makes, for its own duration: attention's
    scores (a [T, T] block at a time), the embeddings' temporaries (per_row passes or the
    patch matrix, on rank 0), and a Reduce_scatter's received blocks (bounded by all rows)."""
    M, T = graph.units["rows"], graph.seq_len
    if step.kind == "reduce_scatter":
        return {ACTIVE: float(M * graph.tensors[step.tensor].row_bytes())}
    if step.kind != "op":
        return {}
    op = step.op
    if op.kind == "attention":
        return {ACTIVE: float(F32 * T * T)}
    if op.kind == "embed":
        return {ROOT: float(F32 * M * max(op.per_row, op.k))}
    return {}


def activation_memory(graph: Graph, steps: list[Step], keep: tuple[str, ...] = (),
                      scratch: bool = True) -> list[MemTerm]:
    """A rank's activation memory over `steps` (a schedule, or a pipeline stage's part), from
    the tensors live at each step, as the interpreter holds them (it drops each tensor after
    its last reader; an MLP pair, `mlp_pair`, is one kernel call, so the first GeMM's input
    is held until the second's output is made): one allocation per operator's outputs (a fused QKV output is one array
    until its K/V columns are gathered into their own), one per collective's result, each
    live from the step that makes it to the last step that reads it, or to the end for the
    tensors in `keep` (what the steps hand back). Tensors read before any step makes them (the
    inputs, a stage's received activations) are live from the start, whole on every rank.

    Returns MemTerms ("activations") with a `step`: each step's bytes by the dimension they
    scale with (every rank, rank 0, per row or unit of a rank's share). A rank holds the step
    that comes to the most for its counts (costmodel.held_bytes); the LP caps every step. Steps
    that hold no more of any dimension than another step are left out. `scratch` False leaves
    out what a step allocates inside its kernel (`_scratch`): the tensors alone, what an
    allocation counter on the interpreter's tensors measures (hepti.bench.order_exec)."""
    lives: list[tuple[int, int, dict[str, float]]] = []  # (first step, last step, bytes)
    held: dict[str, int] = {}  # tensor -> the allocation its current value is part of
    end = len(steps) - 1

    def make(tensors, j: int, where: str, unit: str | None) -> None:
        size: dict[str, float] = {}
        for t in tensors:
            for d, b in _placed(graph, t, where, unit).items():
                size[d] = size.get(d, 0.0) + b
            held[t] = len(lives)
        lives.append((j, j, size))

    def read(t: str, j: int) -> None:
        if t not in held:  # an input (on rank 0 unless sent to all), or a stage's activations
            on_primary = graph.tensors[t].kind == "input" and t not in graph.inputs_everywhere
            make([t], -1, PRIMARY if on_primary else FULL, None)
        a = held[t]
        first, last, size = lives[a]
        lives[a] = (first, max(last, j), size)

    readers = _readers(graph)
    for j, s in enumerate(steps):
        if s.kind == "op":
            # an MLP pair is one kernel call: the first GeMM's input is held through the second
            fused = j + 1 < len(steps) and mlp_pair(s, steps[j + 1], readers)
            for t in s.op.inputs:
                read(t, j + 1 if fused else j)
            make(s.op.outputs, j, produces(s.op, s.split), s.op.unit)
        else:
            read(s.tensor, j)
            new = {"allgatherv": FULL, "bcast": FULL, "reduce_scatter": ROWS,
                   "scatterv": ROWS, "gatherv": PRIMARY}[s.kind]
            make([s.tensor], j, new, None)
    for t in tuple(keep) + tuple(graph.inputs_everywhere):  # the mask: every attention reads
        if t in held:  # it (not as an operator input), so the interpreter holds it throughout
            first, _, size = lives[held[t]]
            lives[held[t]] = (first, end, size)
    at: list[dict[str, float]] = []
    for j, s in enumerate(steps):
        now = dict(_scratch(graph, s)) if scratch else {}
        for first, last, size in lives:
            if first <= j <= last:
                for d, b in size.items():
                    now[d] = now.get(d, 0.0) + b
        at.append(now)
    dims = sorted({d for now in at for d in now})
    vecs = sorted({tuple(now.get(d, 0.0) for d in dims) for now in at}, reverse=True)
    kept: list[tuple[float, ...]] = []
    for v in vecs:  # the steps no other step holds at least as much as in every dimension
        if not any(all(a >= b for a, b in zip(k, v)) for k in kept):
            kept.append(v)
    return [MemTerm("activations", d, b, step=k) for k, v in enumerate(kept)
            for d, b in zip(dims, v) if b]


def program_activations(graph: Graph, assign: dict[str, str]) -> list[MemTerm]:
    """`activation_memory` of an inference under `assign`: two layers show every tensor's
    lifetime across a layer's boundary; more only repeat them (unless layers split
    differently: then all of them)."""
    steps = schedule(graph, assign, graph.n_layers if per_layer(assign) else min(graph.n_layers, 2))
    return activation_memory(graph, steps, keep=(graph.output,))
