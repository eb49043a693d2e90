"""An ONNX file's structure and inferred shapes as an operator DAG (hepti.graph.opdag.OpDag).

What ordering needs of a model is which operator reads which activation and how many bytes
each activation holds; nothing is executed and no weight value is read. The representation:

- an **operator** is an ONNX node that computes on activations, under its own name (nodes
  without one get `op_type_N`, N its position in the file), with its `op_type`;
- a **tensor** is an activation: a graph input that is not an initializer, or any output of an
  operator. Its size is the product of its inferred dimensions (onnx.shape_inference, with
  data propagation, in strict mode) times its element type's width, at the file's batch;
- **weights are left out**: initializers, and every tensor computed from constants alone. The
  Model Zoo topologies the onnx wheel ships (onnx/backend/test/data/light/) replace each
  weight with a ConstantOfShape node fed by an initializer holding the shape (DenseNet-121 and
  Inception v2 also Unsqueeze the BatchNorm scales); such nodes are folded away, and the
  bytes of the constants that operators read are summed into `OpDag.weight_bytes`;
- the **file order** is the nodes' order (ONNX requires a topological one; a file that is not
  sorted gets the nearest topological order and `meta["file_order_topological"]` False).

An output that no operator reads, that is not a graph output and whose type inference leaves
unknown (Dropout's mask at opset 9, as in AlexNet, VGG-19 and SqueezeNet here) is taken as not
made: 0 bytes, listed in `meta["unsized_unread_outputs"]`. A runtime need not produce an
optional output nobody asks for.

A node with a subgraph (If, Loop, Scan) is one operator; activations its subgraph reads from
the outer graph count as its inputs. Optional inputs and outputs left empty ("") are skipped.

Batch and input shape: `input_shape` sets one sample's dims (all but the first) of the
graph's single input, or of named ones ({"data": (3, 299, 299)}). `batch` sets the first
dimension when the file leaves it symbolic; when the file fixes it (the light models fix 1,
and their Reshape targets spell the 1 out), the graph is inferred at the file's batch and
every tensor whose first dimension is that batch is scaled (OpDag.at_batch).

Errors are GraphErrors with the fix: a file that is not ONNX, a cycle, an operator whose
output shape cannot be inferred (a custom operator, a data-dependent shape, a dimension left
symbolic).
"""
from __future__ import annotations

import math
from pathlib import Path

from hepti.errors import GraphError
from hepti.graph.opdag import OpDag, OpNode, TensorInfo


def import_onnx(path: str | Path, batch: int | None = None,
                input_shape=None) -> OpDag:
    """The activation DAG of the ONNX file at `path` (see the module docstring).
    `input_shape`: one sample's dims (a tuple, for the single input) or {input name: dims}."""
    import onnx  # local: optional dependency (onnx)
    from google.protobuf.message import DecodeError  # local: optional dependency (onnx's protobuf)

    path = Path(path)
    try:
        model = onnx.load_model(str(path), load_external_data=False)
    except (DecodeError, ValueError, TypeError, RuntimeError) as e:
        raise GraphError(f"{path} is not an ONNX model (protobuf could not read it: {e})") from None
    except OSError as e:
        raise GraphError(f"{path}: cannot read it ({e.strerror or e})") from None
    g = model.graph
    if model.ir_version <= 0 or not g.node:
        raise GraphError(f"{path} is not an ONNX model: it has no IR version or no graph nodes "
                         "(an empty or a different kind of file?)")

    constants = _constant_tensors(g)
    real_inputs = [i for i in g.input if i.name not in constants]
    _set_input_dims(path, real_inputs, batch, input_shape)

    # Structure first, so a cycle is reported as one rather than as a shape failure.
    ops, op_nodes = [], []
    for k, node in enumerate(g.node):
        if all(o in constants for o in node.output if o):
            continue  # folded: a weight or a constant computed from weights
        name = node.name or f"{node.op_type}_{k}"
        ins = [t for t in node.input if t and t not in constants]
        ins += [t for t in _outer_refs(node) if t not in constants and t not in ins]
        ops.append(OpNode(name, node.op_type, tuple(dict.fromkeys(ins)),
                          tuple(o for o in node.output if o)))
        op_nodes.append(node)
    if not ops:
        raise GraphError(f"{path}: every node computes constants; there is nothing to order")
    produced = {t for op in ops for t in op.outputs}
    outputs = tuple(o.name for o in g.output if o.name in produced or
                    o.name in {i.name for i in real_inputs})
    names = [i.name for i in real_inputs]
    unsized = list(dict.fromkeys(t for op in ops for t in op.inputs + op.outputs))
    # sizes 0 for now: the structure (names, producers, cycles) is checked before inference
    OpDag(path.stem, ops, {t: TensorInfo(0) for t in unsized}, tuple(names), outputs)

    try:
        inferred = onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True,
                                                     data_prop=True)
    except Exception as e:  # onnx raises InferenceError, ValidationError, RuntimeError, ...
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise GraphError(f"{path}: ONNX shape inference failed: {first}") from None
    types = {v.name: v.type for v in list(inferred.graph.input) + list(inferred.graph.value_info)
             + list(inferred.graph.output)}
    owner = {t: (op, node) for op, node in zip(ops, op_nodes) for t in op.outputs}

    read = {t for op in ops for t in op.inputs} | set(outputs)
    file_batch = None
    tensors, dead = {}, []
    for t in unsized:
        shape, width = _shape_and_width(types.get(t))
        if shape is None and t not in read:
            tensors[t] = TensorInfo(0)  # an output nobody reads and inference left untyped
            dead.append(t)
            continue
        if shape is None:
            where = (f"operator {owner[t][0].name!r} ({owner[t][1].op_type})'s output {t!r}"
                     if t in owner else f"graph input {t!r}")
            dims = _dims_text(types.get(t))
            raise GraphError(
                f"{path}: the shape of {where} could not be inferred{dims}: a custom operator, "
                "a shape that depends on data, or a dimension left symbolic; give the batch "
                "with --batch and one sample's shape with --input-shape, or export the model "
                "with static shapes")
        tensors[t] = TensorInfo(width * math.prod(shape), shape)
    if real_inputs:
        first = tensors[real_inputs[0].name].shape
        file_batch = first[0] if first else 1
    weights = _weight_bytes(g, op_nodes, constants, types)
    meta = {"source": str(path), "opset": max((o.version for o in model.opset_import
                                               if o.domain in ("", "ai.onnx")), default=None),
            "onnx_nodes": len(g.node), "folded_nodes": len(g.node) - len(ops)}
    if dead:
        meta["unsized_unread_outputs"] = dead
    dag = OpDag(path.stem, ops, tensors, tuple(names), outputs, weights, file_batch or 1, meta)
    if batch and batch != dag.batch:
        dag = dag.at_batch(batch)
    return dag


def _constant_tensors(g) -> set[str]:
    """Initializers, and the outputs of nodes that read constants only (Constant,
    ConstantOfShape fed by an initializer, Unsqueeze of a weight, ...), to a fixed point so
    the file's node order does not matter. A node with a subgraph is never folded."""
    consts = {i.name for i in g.initializer} | {i.name for i in g.sparse_initializer}
    changed = True
    while changed:
        changed = False
        for node in g.node:
            if all(o in consts for o in node.output if o) or _has_subgraph(node):
                continue
            if all(t in consts for t in node.input if t):
                consts.update(o for o in node.output if o)
                changed = True
    return consts


def _has_subgraph(node) -> bool:
    import onnx  # local: optional dependency (onnx)
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
               for a in node.attribute)


def _outer_refs(node) -> list[str]:
    """Tensors a node's subgraphs read from the enclosing graphs."""
    import onnx  # local: optional dependency (onnx)
    out = []

    def visit(graph, bound: set[str]):
        bound = bound | {i.name for i in graph.input} | {i.name for i in graph.initializer}
        for n in graph.node:
            for t in n.input:
                if t and t not in bound and t not in out:
                    out.append(t)
            for a in n.attribute:
                for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                            list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
                    visit(sub, bound)
            bound |= set(n.output)

    for a in node.attribute:
        for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                    list(a.graphs) if a.type == onnx.AttributeProto.GRAPHS else []):
            visit(sub, set())
    return out


def _set_input_dims(path: Path, inputs, batch: int | None, input_shape) -> None:
    """Write the requested dims into the graph inputs before inference."""
    if input_shape is not None and not isinstance(input_shape, dict):
        if len(inputs) != 1:
            raise GraphError(f"{path} has {len(inputs)} inputs "
                             f"({', '.join(i.name for i in inputs)}); name the one to shape")
        input_shape = {inputs[0].name: tuple(input_shape)}
    by_name = {i.name: i for i in inputs}
    for name, dims in (input_shape or {}).items():
        if name not in by_name:
            raise GraphError(f"{path} has no input {name!r}; its inputs: "
                             f"{', '.join(by_name) or 'none'}")
        shape = by_name[name].type.tensor_type.shape
        if len(shape.dim) != len(dims) + 1:
            raise GraphError(f"{path}: input {name!r} has {len(shape.dim)} dimensions, so "
                             f"--input-shape takes {len(shape.dim) - 1} (one sample's), "
                             f"got {len(dims)}")
        for d, v in zip(list(shape.dim)[1:], dims):
            d.Clear()
            d.dim_value = int(v)
    if batch:
        for i in inputs:
            dims = i.type.tensor_type.shape.dim
            if len(dims) and not dims[0].HasField("dim_value"):
                dims[0].Clear()
                dims[0].dim_value = int(batch)


def _shape_and_width(tp):
    """(shape, bytes per element) of an inferred tensor type, or (None, 0) when any dimension
    or the element type is unknown."""
    import onnx  # local: optional dependency (onnx)
    if tp is None or not tp.HasField("tensor_type"):
        return None, 0
    tt = tp.tensor_type
    if tt.elem_type in (0, onnx.TensorProto.STRING) or not tt.HasField("shape"):
        return None, 0
    if any(not d.HasField("dim_value") for d in tt.shape.dim):
        return None, 0
    try:
        width = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None, 0
    return tuple(int(d.dim_value) for d in tt.shape.dim), width


def _dims_text(tp) -> str:
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return ""
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in tp.tensor_type.shape.dim]
    return f" (it has [{', '.join(dims)}])"


def _weight_bytes(g, op_nodes, constants: set[str], types) -> int:
    """Bytes of the constants operators read (weights, folded BatchNorm scales, shape
    vectors), from their initializers or inferred shapes (one whose shape stays unknown counts
    nothing)."""
    import onnx  # local: optional dependency (onnx)
    inits = {i.name: i for i in g.initializer}
    read = {t for node in op_nodes for t in node.input if t in constants}
    total = 0
    for t in read:
        if t in inits:
            i = inits[t]
            total += math.prod(i.dims) * onnx.helper.tensor_dtype_to_np_dtype(i.data_type).itemsize
        else:
            shape, width = _shape_and_width(types.get(t))
            total += math.prod(shape) * width if shape is not None else 0
    return total
