"""The memory model of operator order: how many bytes an execution order needs at its peak.

An order is a topological order of an OpDag's operators (hepti.graph.opdag). The default model
(docs/order.md, "Memory model"):

- **What counts**: activations, the tensors operators write. Weights are not in the graph
  (`OpDag.weight_bytes` reports them apart). Graph inputs and outputs are the caller's and do
  not count, unless `count_io`.
- **Lifetime**: a tensor is allocated when its producer runs and freed once its last consumer
  in the order has run. A tensor nobody reads lives only while its producer runs. With
  `count_io`, a graph input is live from the start until its last consumer, and a graph output
  from its producer to the end.
- **A step**: while operator o runs, its inputs and its outputs are live together, with every
  other tensor allocated before and not yet freed:
  `step(S, o) = resident(S) + bytes(outputs of o) - inplace(S, o)`, where S is the set of
  operators already run and `resident(S)` is what S left allocated (o's inputs among it).
- **Peak**: the largest step of the order, in bytes at the graph's batch and input shape.
- **In place** (`inplace`, off by default): an operator of a type in INPLACE_OP_TYPES
  (element-wise ones such as Relu, Add, Mul, BatchNormalization; and views such as Reshape,
  Flatten, Dropout) with one output may write it over an input when it is that input's last
  consumer in the order, the input is counted and is neither a graph input nor a graph output,
  and the input is at least as large as the output: the output takes no new bytes, so
  `inplace(S, o)` is the output's size.

The step depends on S and o alone, never on the order S was run in; the search
(hepti.order.search) and the exact checks (hepti.order.exact) stand on that. Not modelled:
memory inside an operator (im2col buffers, attention scores), allocator alignment and
fragmentation, and anything a runtime keeps besides the tensors.

`Problem` is the model compiled to integers and bitmasks (operator i is bit i) for the search.
`step_bytes` prices one step straight from the definitions above; `peak` sweeps a whole order
in linear time; `peak_by_definition` takes every step from `step_bytes` (the tests hold the two
equal).
"""
from __future__ import annotations

from dataclasses import dataclass

from hepti.graph.opdag import OpDag

# Operators whose output may take the place of an input in the in-place option: ONNX's
# element-wise operators and views, and hepti's own element-wise kind.
INPLACE_OP_TYPES = frozenset({
    "Relu", "LeakyRelu", "PRelu", "Elu", "Selu", "Celu", "Sigmoid", "HardSigmoid", "Tanh",
    "Softplus", "Softsign", "HardSwish", "Mish", "Gelu", "Erf", "Exp", "Log", "Neg", "Abs",
    "Sqrt", "Reciprocal", "Clip", "Add", "Sub", "Mul", "Div", "Pow", "Sum", "Max", "Min",
    "Mean", "BatchNormalization", "Dropout", "Identity", "Cast",
    "Reshape", "Flatten", "Squeeze", "Unsqueeze",
    "elementwise",  # hepti.graph.ir: add, LayerNorm, add + LayerNorm, row by row
})


@dataclass
class Problem:
    """An OpDag under one memory model, as integers: operator i is bit i of a set.

    Per counted tensor j: `size[j]`, `producer[j]` (an operator, or -1: present at the start),
    `consumers[j]` (a bitmask), `held[j]` (stays allocated to the end: a counted graph output,
    or, in a block of a larger graph, read after the block), `reusable[j]` (an in-place output
    may take its buffer). Per operator: `preds` (bitmask), `succs`, the counted tensors it
    reads (`ins`) and writes (`outs`), `inplace_pairs` ((input tensor, bytes saved) it may
    write over). `offset`: bytes live throughout that no operator here touches (a block's
    share of a larger graph). `position`: each operator's index in the OpDag it came from."""

    names: list[str]
    preds: list[int]
    succs: list[list[int]]
    ins: list[list[int]]
    outs: list[list[int]]
    inplace_pairs: list[list[tuple[int, int]]]
    size: list[int]
    producer: list[int]
    consumers: list[int]
    held: list[bool]
    reusable: list[bool]
    offset: int = 0
    position: list[int] | None = None

    @property
    def n(self) -> int:
        return len(self.names)

    @property
    def full(self) -> int:
        return (1 << self.n) - 1

    # --- the definition, one step at a time --------------------------------------------------
    def resident(self, done: int) -> int:
        """Bytes the operators in `done` leave allocated (with those present from the start)."""
        total = self.offset
        for j, s in enumerate(self.size):
            p = self.producer[j]
            if (p < 0 or done >> p & 1) and (self.held[j] or self.consumers[j] & ~done):
                total += s
        return total

    def inplace_saving(self, done: int, o: int) -> int:
        """Bytes operator o saves by writing over an input it is the last reader of."""
        best = 0
        for j, saved in self.inplace_pairs[o]:
            if not self.consumers[j] & ~(done | 1 << o):
                best = max(best, saved)
        return best

    def step_bytes(self, done: int, o: int) -> int:
        """Memory while operator o runs after the operators in `done` (o must be ready)."""
        return (self.resident(done) + sum(self.size[j] for j in self.outs[o])
                - self.inplace_saving(done, o))

    def check_order(self, order: list[int]) -> None:
        if sorted(order) != list(range(self.n)):
            raise ValueError(f"an order must run each of the {self.n} operators once")
        done = 0
        for o in order:
            if self.preds[o] & ~done:
                raise ValueError(f"{self.names[o]!r} runs before an operator it reads from")
            done |= 1 << o

    def peak_by_definition(self, order: list[int]) -> int:
        """The order's peak, every step priced by step_bytes (quadratic; for checking)."""
        self.check_order(order)
        done, peak = 0, 0
        for o in order:
            peak = max(peak, self.step_bytes(done, o))
            done |= 1 << o
        return peak

    # --- the same, swept in linear time ------------------------------------------------------
    def profile(self, order: list[int]) -> list[int]:
        """Each step's bytes along a (valid) order, by a sweep that frees a tensor when the
        last of its consumers has run."""
        left = [bin(c).count("1") for c in self.consumers]  # readers still to run
        resident = self.offset + sum(s for j, s in enumerate(self.size)
                                     if self.producer[j] < 0 and (self.held[j] or left[j]))
        steps = []
        for o in order:
            saving = 0
            for j, saved in self.inplace_pairs[o]:
                if left[j] == 1:
                    saving = max(saving, saved)
            out = 0
            for j in self.outs[o]:
                out += self.size[j]
            steps.append(resident + out - saving)
            for j in self.outs[o]:
                if self.held[j] or left[j]:
                    resident += self.size[j]
            for j in self.ins[o]:
                left[j] -= 1
                if left[j] == 0 and not self.held[j]:
                    resident -= self.size[j]
        return steps

    def peak(self, order: list[int]) -> int:
        self.check_order(order)
        return max(self.profile(order), default=self.offset)


def compile_problem(dag: OpDag, inplace: bool = False, count_io: bool = False) -> Problem:
    """The OpDag under the memory model with these options (see the module docstring).
    Dependencies come from every tensor, counted or not; sizes from the counted ones."""
    n = len(dag.ops)
    preds = [0] * n
    succs = [dag.succs(i) for i in range(n)]
    for i in range(n):
        for p in dag.preds(i):
            preds[i] |= 1 << p
    io = set(dag.inputs) | set(dag.outputs)
    ids: dict[str, int] = {}
    size, producer, consumers, held, reusable = [], [], [], [], []
    for t, info in dag.tensors.items():
        in_graph = t in dag.producer or t in dag.consumers
        if not in_graph or info.bytes == 0 or (t in io and not count_io):
            continue
        ids[t] = len(size)
        size.append(info.bytes)
        producer.append(dag.producer.get(t, -1))
        mask = 0
        for c in dag.consumers.get(t, ()):
            mask |= 1 << c
        consumers.append(mask)
        held.append(t in dag.outputs)
        reusable.append(t not in io)
    ins = [[ids[t] for t in dict.fromkeys(op.inputs) if t in ids] for op in dag.ops]
    outs = [[ids[t] for t in op.outputs if t in ids] for op in dag.ops]
    pairs: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    if inplace:
        for i, op in enumerate(dag.ops):
            if op.op_type not in INPLACE_OP_TYPES or len(op.outputs) != 1 or len(outs[i]) != 1:
                continue
            out = outs[i][0]
            pairs[i] = [(j, size[out]) for j in ins[i]
                        if reusable[j] and size[j] >= size[out]]
    return Problem([op.name for op in dag.ops], preds, succs, ins, outs, pairs, size, producer,
                   consumers, held, reusable, 0, list(range(n)))


def order_peak(dag: OpDag, names: list[str], inplace: bool = False,
               count_io: bool = False) -> int:
    """The peak of the order given by operator names, under the memory model."""
    pb = compile_problem(dag, inplace, count_io)
    try:
        order = [dag.index[nm] for nm in names]
    except KeyError as e:
        raise ValueError(f"{dag.name} has no operator {e.args[0]!r}") from None
    return pb.peak(order)
