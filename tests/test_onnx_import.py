"""ONNX graphs for operator order: the nine Model Zoo topologies the onnx wheel ships, small
hand-made models, bad files; BTSearch against the downset DP on the shipped graphs."""
from __future__ import annotations

from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper  # noqa: E402

from hepti.errors import GraphError  # noqa: E402
from hepti.graph.onnx_import import import_onnx  # noqa: E402
from hepti.graph.load import load_graph  # noqa: E402
from hepti.graph.opdag import OpDag  # noqa: E402
from hepti.order.exact import downset_dp  # noqa: E402
from hepti.order.memory import compile_problem  # noqa: E402
from hepti.order.search import order_graph  # noqa: E402

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
# operators left once weights are folded away (Conv, Relu, ... kept; ConstantOfShape and the
# Unsqueeze of BatchNorm scales gone)
OPS = {"bvlc_alexnet": 24, "densenet121": 668, "inception_v1": 143, "inception_v2": 371,
       "resnet50": 176, "shufflenet": 203, "squeezenet": 66, "vgg19": 46, "zfnet512": 22}


def light(name: str) -> Path:
    return LIGHT / f"light_{name}.onnx"


def save(tmp_path: Path, nodes, inputs, outputs, initializers=(), name="m.onnx", opset=13) -> Path:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    path = tmp_path / name
    path.write_bytes(model.SerializeToString())
    return path


def vi(name, dims, t=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, t, dims)


# --- the shipped topologies -----------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(OPS))
def test_light_models_fold_their_weights(name):
    g = import_onnx(light(name))
    assert len(g.ops) == OPS[name]
    assert not {"ConstantOfShape", "Constant"} & {op.op_type for op in g.ops}
    assert len(g.inputs) == 1 and len(g.outputs) == 1 and g.batch == 1
    assert g.meta["file_order_topological"]


def test_sizes_and_weights_match_known_figures():
    g = import_onnx(light("resnet50"))
    first = g.ops[0]
    assert first.op_type == "Conv"
    assert g.tensors[first.outputs[0]].shape == (1, 64, 112, 112)
    assert g.tensors[first.outputs[0]].bytes == 4 * 64 * 112 * 112
    # AlexNet (BVLC) has 60,965,224 parameters and VGG-19 143,667,240: float32, plus the
    # Reshape's int64 target [2] (16 bytes)
    assert import_onnx(light("bvlc_alexnet")).weight_bytes == 4 * 60_965_224 + 16
    assert import_onnx(light("vgg19")).weight_bytes == 4 * 143_667_240 + 16


def test_dropout_masks_nobody_reads_are_not_made():
    g = import_onnx(light("vgg19"))
    assert len(g.meta["unsized_unread_outputs"]) == 2
    for t in g.meta["unsized_unread_outputs"]:
        assert g.tensors[t].bytes == 0 and t not in g.consumers


def test_batch_scales_every_activation():
    one, four = import_onnx(light("squeezenet")), import_onnx(light("squeezenet"), batch=4)
    assert four.batch == 4
    for t, info in one.tensors.items():
        assert four.tensors[t].bytes == 4 * info.bytes
    assert order_graph(four, random_count=0).peak_bytes == 4 * order_graph(one, random_count=0).peak_bytes


def test_input_shape_is_inferred_through():
    g = import_onnx(light("squeezenet"), input_shape=(3, 256, 256))
    assert g.tensors[g.inputs[0]].shape == (1, 3, 256, 256)
    assert g.tensors[g.ops[0].outputs[0]].shape[2:] != import_onnx(light("squeezenet")).tensors[
        g.ops[0].outputs[0]].shape[2:]
    with pytest.raises(GraphError, match="takes 3"):
        import_onnx(light("squeezenet"), input_shape=(256, 256))


def test_json_round_trip_keeps_the_graph(tmp_path):
    g = import_onnx(light("shufflenet"))
    path = tmp_path / "g.json"
    import json
    path.write_text(json.dumps(g.to_dict()))
    back = load_graph(path)
    assert back.ops == g.ops and back.tensors == g.tensors and back.weight_bytes == g.weight_bytes
    assert order_graph(back, random_count=0).peak_bytes == order_graph(g, random_count=0).peak_bytes
    assert load_graph(path, batch=2).tensors[g.inputs[0]].bytes == 2 * g.tensors[g.inputs[0]].bytes
    with pytest.raises(GraphError, match="not a hepti operator graph"):
        OpDag.from_dict({"ops": []})


@pytest.mark.parametrize("name", [n for n in sorted(OPS) if n != "inception_v2"])
def test_btsearch_equals_the_downset_dp(name):
    """Every shipped graph but Inception v2 (60k downsets: bench-order checks it)."""
    g = import_onnx(light(name))
    for inplace in (False, True):
        dp, order, _ = downset_dp(compile_problem(g, inplace=inplace), max_states=20_000)
        r = order_graph(g, inplace=inplace, random_count=10)
        assert r.proven and r.peak_bytes == dp
        assert r.peak_bytes <= r.file_order_peak_bytes and r.peak_bytes <= r.random["best_bytes"]


def test_shufflenet_is_below_its_file_order():
    """The one shipped graph whose peak the order changes: a unit's two branches (shortcut
    pooling and the grouped convolutions) run one after the other in the file."""
    r = order_graph(import_onnx(light("shufflenet")))
    assert r.peak_bytes < r.file_order_peak_bytes


# --- small models and bad files -------------------------------------------------------------

def test_a_hand_made_model(tmp_path):
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3, 1, 1], [0.1] * 12)
    shape = helper.make_tensor("s", TensorProto.INT64, [1], [4])
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], name="conv"),
             helper.make_node("ConstantOfShape", ["s"], ["b"], name="bias"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Add", ["r", "c"], ["y"], name="add")]
    path = save(tmp_path, nodes, [vi("x", [1, 3, 8, 8])], [vi("y", [1, 4, 8, 8])], [w, shape])
    g = import_onnx(path)
    assert [op.name for op in g.ops] == ["conv", "relu", "add"]  # the constant node folded
    assert g.ops[0].inputs == ("x",)  # the weight is not an input
    assert g.weight_bytes == 4 * 12
    assert g.tensors["c"].bytes == 4 * 4 * 8 * 8
    # conv: c; relu: c + r; add: r + c (y is the caller's)
    assert order_graph(g).peak_bytes == 2 * 4 * 4 * 64


def test_a_symbolic_batch_takes_the_batch(tmp_path):
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Sigmoid", ["r"], ["y"], name="sig")]
    path = save(tmp_path, nodes, [vi("x", ["N", 16])], [vi("y", ["N", 16])])
    assert import_onnx(path, batch=3).tensors["r"].bytes == 3 * 16 * 4
    with pytest.raises(GraphError, match=r"graph input 'x' could not be inferred \(it has \[N, 16\]\)"):
        import_onnx(path)  # N left symbolic


def test_not_onnx_files_are_refused(tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("this is not a model\n" * 20)
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    for p in (text, empty):
        with pytest.raises(GraphError, match="is not an ONNX model"):
            import_onnx(p)
    with pytest.raises(GraphError, match="no such file"):
        load_graph(tmp_path / "missing.onnx")


def cycle_model(tmp_path) -> Path:
    nodes = [helper.make_node("Add", ["x", "b"], ["a"], name="first"),
             helper.make_node("Relu", ["a"], ["b"], name="second"),
             helper.make_node("Relu", ["b"], ["y"], name="third")]
    return save(tmp_path, nodes, [vi("x", [1, 4])], [vi("y", [1, 4])], name="cycle.onnx")


def custom_op_model(tmp_path) -> Path:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"),
             helper.make_node("Mystery", ["r"], ["m"], name="mystery", domain="com.example"),
             helper.make_node("Relu", ["m"], ["y"], name="out")]
    graph = helper.make_graph(nodes, "g", [vi("x", [1, 4])], [vi("y", [1, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13),
                                                    helper.make_opsetid("com.example", 1)])
    path = tmp_path / "custom.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def test_a_cycle_is_refused_with_its_operators(tmp_path):
    with pytest.raises(GraphError, match="cycle.*(first -> second -> first|second -> first -> second)"):
        import_onnx(cycle_model(tmp_path))


def test_an_operator_without_inferable_shapes_is_named(tmp_path):
    with pytest.raises(GraphError, match=r"operator 'mystery' \(Mystery\)'s output 'm' could not"):
        import_onnx(custom_op_model(tmp_path))
