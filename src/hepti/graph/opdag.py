"""A plain operator DAG, for choosing the order operators run in (hepti.order.search).

hepti.graph.ir says how a transformer's operators split across ranks; ordering needs less, and
needs it for any graph, including ones hepti cannot run (ONNX files):

- `OpNode(name, op_type, inputs, outputs)`: one operator. `inputs` and `outputs` name
  activation tensors only; weights are not in the graph (`OpDag.weight_bytes` reports them).
- `OpDag`: the operators in the source's own order (the file order, or the order hepti's
  executor runs them), `tensors` (name -> `TensorInfo`: bytes at `batch`, and the shape they
  came from), graph `inputs` (tensors no operator produces) and `outputs` (what the caller gets
  back). An edge runs from a tensor's producer to each of its consumers; the edges are implied
  by the names, never stored.

Checked when built (a `GraphError` says what is wrong): names are unique, every tensor has one
producer or is a graph input, every tensor has a size, and the graph has no cycle.

Builders: hepti.graph.onnx_import (an ONNX file's structure and inferred shapes), `from_cnn`
(hepti.graph.cnn's MobileNetV2, ResNet-50 and VGG-16), `from_encoder` (BERT and ViT, layers
unrolled). `to_dict` / `from_dict` are the structure-only JSON that `hepti graph import --out`
writes and `hepti order` reads back; hepti.graph.load's `load_graph` opens any of them from a
path (a .json graph may be gzipped: .json.gz).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from collections import Counter
import heapq
import random as _random

from hepti.errors import GraphError

F32 = 4
FORMAT = "hepti-opdag"
FORMAT_VERSION = 1


@dataclass(frozen=True)
class OpNode:
    """One operator: its unique `name`, `op_type` (ONNX's, or hepti's kind), and the activation
    tensors it reads and writes."""

    name: str
    op_type: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]


@dataclass(frozen=True)
class TensorInfo:
    """An activation's size in bytes at the graph's batch, and its shape (batch first; () when
    not known, as for a JSON file written without shapes)."""

    bytes: int
    shape: tuple[int, ...] = ()


@dataclass
class OpDag:
    """Operators in the source's order, the tensors between them, graph inputs and outputs."""

    name: str
    ops: list[OpNode]
    tensors: dict[str, TensorInfo]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    weight_bytes: int = 0
    batch: int = 1
    meta: dict = field(default_factory=dict)

    def __post_init__(self):
        self.inputs, self.outputs = tuple(self.inputs), tuple(self.outputs)
        self.index = {}  # op name -> position in `ops`
        self.producer = {}  # tensor -> op position
        for i, op in enumerate(self.ops):
            if op.name in self.index:
                raise GraphError(f"{self.name}: two operators are named {op.name!r}")
            self.index[op.name] = i
            for t in op.outputs:
                if t in self.producer:
                    raise GraphError(f"{self.name}: tensor {t!r} is written by both "
                                     f"{self.ops[self.producer[t]].name!r} and {op.name!r}")
                if t in self.inputs:
                    raise GraphError(f"{self.name}: graph input {t!r} is also written by "
                                     f"operator {op.name!r}")
                self.producer[t] = i
        self.consumers = {}  # tensor -> op positions, in order
        for i, op in enumerate(self.ops):
            for t in dict.fromkeys(op.inputs):  # an op reading a tensor twice reads it once
                if t not in self.producer and t not in self.inputs:
                    raise GraphError(f"{self.name}: operator {op.name!r} reads {t!r}, which no "
                                     "operator writes and which is not a graph input")
                self.consumers.setdefault(t, []).append(i)
        for t in self.outputs:
            if t not in self.producer and t not in self.inputs:
                raise GraphError(f"{self.name}: graph output {t!r} is written by no operator")
        for op in self.ops:
            for t in op.inputs + op.outputs:
                if t not in self.tensors:
                    raise GraphError(f"{self.name}: tensor {t!r} of {op.name!r} has no size")
        self.file_order = self._topological_order()

    # --- structure ----------------------------------------------------------------------------
    def preds(self, i: int) -> list[int]:
        """Positions of the operators that produce op i's inputs."""
        return sorted({self.producer[t] for t in self.ops[i].inputs if t in self.producer})

    def succs(self, i: int) -> list[int]:
        return sorted({c for t in self.ops[i].outputs for c in self.consumers.get(t, ())})

    def _topological_order(self) -> list[int]:
        """The source's order when it is a topological one (ONNX requires it), else the stable
        topological sort nearest to it; a GraphError naming a cycle if there is one."""
        n = len(self.ops)
        if all(self.producer.get(t, -1) < i for i, op in enumerate(self.ops) for t in op.inputs):
            self.meta.setdefault("file_order_topological", True)
            return list(range(n))
        indeg = [len(self.preds(i)) for i in range(n)]
        heap = [i for i in range(n) if indeg[i] == 0]
        heapq.heapify(heap)
        order = []
        while heap:
            i = heapq.heappop(heap)
            order.append(i)
            for s in self.succs(i):
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, s)
        if len(order) < n:
            cycle = self._a_cycle({i for i in range(n) if indeg[i] > 0})
            raise GraphError(f"{self.name}: the graph has a cycle, so no order can run it: "
                             + " -> ".join(self.ops[i].name for i in cycle))
        self.meta["file_order_topological"] = False
        return order

    def _a_cycle(self, stuck: set[int]) -> list[int]:
        """One cycle among the operators Kahn's sort could not place (each has a predecessor
        among them): walk predecessors until one repeats."""
        i, seen, path = min(stuck), {}, []
        while i not in seen:
            seen[i] = len(path)
            path.append(i)
            i = next(p for p in self.preds(i) if p in stuck)
        cycle = path[seen[i]:]
        return list(reversed(cycle)) + [cycle[-1]]

    # --- sizes --------------------------------------------------------------------------------
    def activation_bytes(self) -> int:
        """All activations at once (what an executor that frees nothing would hold)."""
        return sum(self.tensors[t].bytes for t in self.producer)

    def at_batch(self, batch: int) -> "OpDag":
        """The same graph at another batch: a tensor whose first dimension is this graph's
        batch scales with it (the rest, such as a Shape operator's output, stay)."""
        if batch == self.batch:
            return self
        if batch % self.batch:
            raise GraphError(f"{self.name}: its sizes are at batch {self.batch}; batch {batch} "
                             "is not a multiple of it")
        k = batch // self.batch
        tensors = {}
        for t, info in self.tensors.items():
            if not info.shape and info.bytes:
                raise GraphError(f"{self.name}: tensor {t!r} has no shape, so its size at batch "
                                 f"{batch} is unknown; import the graph again at that batch")
            if info.shape and info.shape[0] == self.batch:
                tensors[t] = TensorInfo(info.bytes * k, (batch,) + info.shape[1:])
            else:
                tensors[t] = info
        return OpDag(self.name, self.ops, tensors, self.inputs, self.outputs, self.weight_bytes,
                     batch, dict(self.meta))

    def describe(self) -> str:
        """A few lines on what the graph holds (`hepti graph import`)."""
        kinds = Counter(op.op_type for op in self.ops).most_common()
        mib = 2 ** 20
        return "\n".join([
            f"graph       {self.name}: {len(self.ops)} operators, {len(self.producer)} "
            f"activations, batch {self.batch}",
            f"inputs      {', '.join(f'{t} {list(self.tensors[t].shape)}' for t in self.inputs)}",
            f"outputs     {', '.join(f'{t} {list(self.tensors[t].shape)}' for t in self.outputs)}",
            f"operators   {', '.join(f'{k} {v}' for k, v in kinds)}",
            f"activations {self.activation_bytes() / mib:.2f} MiB in all; the largest "
            f"{max((self.tensors[t].bytes for t in self.producer), default=0) / mib:.2f} MiB",
            f"weights     {self.weight_bytes / mib:.2f} MiB (left out of the graph)"]
            + ([f"folded      {self.meta['folded_nodes']} constant nodes of "
                f"{self.meta['onnx_nodes']}"] if "folded_nodes" in self.meta else []))

    # --- JSON ---------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"format": FORMAT, "version": FORMAT_VERSION, "name": self.name,
                "batch": self.batch, "weight_bytes": self.weight_bytes,
                "inputs": list(self.inputs), "outputs": list(self.outputs),
                "ops": [{"name": o.name, "op_type": o.op_type, "inputs": list(o.inputs),
                         "outputs": list(o.outputs)} for o in self.ops],
                "tensors": {t: {"bytes": i.bytes, "shape": list(i.shape)}
                            for t, i in self.tensors.items()},
                "meta": self.meta}

    @classmethod
    def from_dict(cls, d: dict, source: str = "graph") -> "OpDag":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise GraphError(f"{source} is not a hepti operator graph (no \"format\": "
                             f"\"{FORMAT}\"); make one with `hepti graph import FILE.onnx --out`")
        if d.get("version") != FORMAT_VERSION:
            raise GraphError(f"{source}: graph format version {d.get('version')!r}, this hepti "
                             f"reads {FORMAT_VERSION}")
        try:
            ops = [OpNode(str(o["name"]), str(o["op_type"]), tuple(o["inputs"]),
                          tuple(o["outputs"])) for o in d["ops"]]
            tensors = {str(t): TensorInfo(int(v["bytes"]), tuple(int(x) for x in v["shape"]))
                       for t, v in d["tensors"].items()}
            return cls(str(d.get("name", source)), ops, tensors, tuple(d["inputs"]),
                       tuple(d["outputs"]), int(d.get("weight_bytes", 0)),
                       int(d.get("batch", 1)), dict(d.get("meta", {})))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if isinstance(e, GraphError):
                raise
            raise GraphError(f"{source}: a malformed operator graph ({type(e).__name__}: {e})") from None


# --- hepti's own families --------------------------------------------------------------------

def from_cnn(graph, batch: int = 1, height: int = 224, width: int = 224, name: str = "") -> OpDag:
    """A hepti.graph.cnn Graph at `batch` images of height x width: one operator per kernel
    call (a convolution reads its residual too), float32 NHWC tensors as `Graph.shapes` gives
    them, the weights (BatchNorm folded) reported apart."""
    shapes = graph.shapes(height, width)
    ops = [OpNode(op.name, op.kind, (op.input,) + ((op.residual,) if op.residual else ()),
                  (op.output,)) for op in graph.ops]
    tensors = {t: TensorInfo(F32 * batch * math.prod(s), (batch,) + tuple(s))
               for t, s in shapes.items()}
    arch = getattr(graph.config, "arch", "cnn")
    return OpDag(name or arch, ops, tensors, (graph.input,), (graph.output,),
                 graph.weight_bytes(), batch, {"source": f"hepti.graph.cnn {arch}",
                                               "input_hw": [height, width]})


def from_encoder(graph, name: str = "") -> OpDag:
    """A hepti.graph.ir Graph (BERT, ViT) with its layers unrolled: a layer rewrites the tensors
    the one before wrote under the same names, so each write gets a name of its own
    (`layer.{i}.x`), and each read the newest one. Tensors are [M, width] float32 with
    M = `units["rows"]` (B x T); `batch` is B. Attention's score matrix is inside its kernel,
    not a tensor here."""
    M = graph.units["rows"]
    B = M // graph.seq_len
    current: dict[str, str] = {}  # local name -> the newest unrolled name
    tensors: dict[str, TensorInfo] = {}
    ops: list[OpNode] = []
    inputs = []

    def read(t: str) -> str:
        if t not in current:  # an input the engine makes (token ids, pixels)
            current[t] = t
            inputs.append(t)
            tensors[t] = TensorInfo(graph.tensors[t].row_bytes() * M, (M, graph.tensors[t].width))
        return current[t]

    def emit(prefix: str, op):
        ins = tuple(read(t) for t in op.inputs)
        outs = []
        for t in op.outputs:
            current[t] = f"{prefix}{t}"
            tensors[current[t]] = TensorInfo(graph.tensors[t].row_bytes() * M,
                                             (M, graph.tensors[t].width))
            outs.append(current[t])
        ops.append(OpNode(f"{prefix}{op.name}", op.kind, ins, tuple(outs)))

    for op in graph.prologue:
        emit("", op)
    for i in range(graph.n_layers):
        for op in graph.layer:
            emit(f"layer.{i}.", op)
    for op in graph.epilogue:
        emit("", op)
    per_layer = {w for op in graph.layer for w in op.weights}
    weights = sum(w.whole_bytes() * (graph.n_layers if n in per_layer else 1)
                  for n, w in graph.weights.items())
    return OpDag(name or graph.family, ops, tensors, tuple(inputs), (current[graph.output],),
                 weights, B, {"source": f"hepti.graph.encoder {graph.family}",
                              "tokens": graph.seq_len})


# --- random graphs (the tests' and the benchmark's) ------------------------------------------

def random_dag(n: int, seed: int, density: float | None = None) -> OpDag:
    """A seeded random DAG of n operators: each reads, with probability `density` (drawn in
    [0.1, 0.6] when None), each earlier operator's first output, and at least one tensor; one
    output, or two (the second nobody reads: a transient); sizes 1-64 bytes. Op types mix
    in-place candidates (Relu, Add) with others (Conv, Concat). A tensor nobody reads is a
    graph output, or dead. Node i is named `op{i}`; the file order is i's."""
    rng = _random.Random(seed)
    p = rng.uniform(0.1, 0.6) if density is None else density
    tensors = {"x": TensorInfo(rng.randint(1, 64), (1,))}
    ops, firsts, read = [], ["x"], set()
    for i in range(n):
        ins = [firsts[k + 1] for k in range(i) if rng.random() < p]
        if not ins:
            ins = [rng.choice(firsts)]
        outs = [f"t{i}"] + ([f"t{i}b"] if rng.random() < 0.15 else [])
        for t in outs:
            tensors[t] = TensorInfo(rng.randint(1, 64), (1,))
        ops.append(OpNode(f"op{i}", rng.choice(("Conv", "Relu", "Add", "Concat")), tuple(ins),
                          tuple(outs)))
        firsts.append(outs[0])
        read.update(ins)
    unread = [t for op in ops for t in op.outputs if t not in read]
    outputs = [t for t in unread if t == unread[-1] or rng.random() < 0.6]
    return OpDag(f"random-{n}-{seed}", ops, tensors, ("x",), tuple(outputs))


def random_wiring(n: int, seed: int, k: int = 4, p: float = 0.75, size: int = 1) -> OpDag:
    """A synthetic randomly wired stage after RandWire (Xie et al., 2019): a Watts-Strogatz
    graph WS(n, k, p) (a ring where each node links its k/2 next neighbours, each link moved
    to a random node with probability p), edges pointing from the lower index to the higher.
    One operator per node reads its predecessors (or the stage's input) and writes one tensor
    of `size` bytes; an `out` operator averages the nodes nobody reads. Structure only: not an
    export of a trained RandWire, whose nodes are several operators each."""
    rng = _random.Random(seed)
    edges: set[tuple[int, int]] = set()
    for u in range(n):
        for j in range(1, k // 2 + 1):
            v = (u + j) % n
            if rng.random() < p:
                taken = {b for a, b in edges if a == u} | {a for a, b in edges if b == u}
                free = [w for w in range(n) if w != u and w not in taken]
                v = rng.choice(free) if free else v
            edges.add((min(u, v), max(u, v)))
    preds = {i: sorted(a for a, b in edges if b == i) for i in range(n)}
    read = {a for a, _ in edges}
    ops = [OpNode(f"node{i}", "Conv", tuple(f"t{q}" for q in preds[i]) or ("x",), (f"t{i}",))
           for i in range(n)]
    ops.append(OpNode("out", "Mean", tuple(f"t{i}" for i in range(n) if i not in read), ("y",)))
    tensors = {t: TensorInfo(size, (1,)) for t in ["x", "y"] + [f"t{i}" for i in range(n)]}
    return OpDag(f"ws({n},{k},{p})-{seed}", ops, tensors, ("x",), ("y",))
