"""Tests of `bin/bench-cnn-single.sh`'s pure parts, without torch: the FLOP count (against
torchvision's published multiply-adds), the stored-weights -> torchvision state_dict mapping
(the inverse of the converter's), the summary, the targets, the gap table and the report and CSV
of a small hand-made result document. Nothing here is timed.
"""
from __future__ import annotations

import csv
import io
import json

import numpy as np
import pytest

from hepti.bench import cnnsingle as cs
from hepti.bench import registry
from hepti.config import CNNConfig
from hepti.graph.cnn import build
from hepti.weights.cnn import fold


@pytest.mark.parametrize("arch, gmacs", [("resnet50", 4.09), ("vgg16", 15.47),
                                          ("mobilenet_v2", 0.30)])
def test_count_flops_matches_torchvision(arch, gmacs):
    """torchvision's model tables give ResNet-50 4.09, VGG-16 15.47 and MobileNetV2 0.30
    GFLOPS at 224x224, counting multiply-adds: our total is twice that (to their rounding)."""
    flops = cs.count_flops(build(CNNConfig(arch=arch)), 224, 224)
    assert flops["total"] == flops["conv"] + flops["linear"]
    assert flops["total"] / 2e9 == pytest.approx(gmacs, abs=0.006)
    assert 0 < flops["pool"] < 0.01 * flops["total"]
    two = cs.count_flops(build(CNNConfig(arch=arch)), 224, 224, batch=2)
    assert two["total"] == pytest.approx(2 * flops["total"])


def test_op_flops_add_up():
    graph = build(CNNConfig(arch="mobilenet_v2"))
    flops = cs.count_flops(graph, 160, 96)
    per_op = cs.op_flops(graph, 160, 96)
    assert list(per_op) == [op.name for op in graph.ops]
    assert sum(per_op.values()) == pytest.approx(flops["total"] + flops["pool"])


def test_torch_state_inverts_the_converter():
    """fold() of torch_state() gives back hepti's stored tensors: VGG (conv biases of its own,
    classifier.0's columns in torch's C, H, W order) and ResNet (every conv gains the bias its
    BatchNorm folded into; identity BatchNorms, as torchvision_model makes them, fold to it)."""
    rng = np.random.default_rng(0)
    for cfg in (CNNConfig(arch="vgg16", width_divisor=16, classifier_hidden=32),
                CNNConfig(arch="resnet50", width_divisor=16, num_classes=10)):
        graph = build(cfg)
        stored = {n: rng.standard_normal(s, dtype=np.float32) for n, s in graph.weights().items()}
        state = cs.torch_state(graph, stored)
        assert set(state) == set(stored)
        for op in graph.ops:  # identity BatchNorm: gamma 1, beta 0, mean 0, var 1 - eps
            if op.bn:
                c = op.cout
                state.update({f"{op.bn}.weight": np.ones(c, np.float32),
                              f"{op.bn}.bias": np.zeros(c, np.float32),
                              f"{op.bn}.running_mean": np.zeros(c, np.float32),
                              f"{op.bn}.running_var": np.full(c, 1 - 1e-5, np.float32)})
        # fold adds the conv's own bias only where torch has one (VGG); a folded conv's bias
        # comes from the BatchNorm's shift: put the stored bias there
        for op in graph.ops:
            if op.bn:
                state[f"{op.bn}.bias"] = state.pop(f"{op.name}.bias")
        again = fold(cfg, state)
        for name, want in stored.items():
            np.testing.assert_allclose(again[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    vgg = build(CNNConfig(arch="vgg16", width_divisor=16, classifier_hidden=32))
    w = np.arange(32 * 32 * 49, dtype=np.float32).reshape(32, 49 * 32)  # [out, (h, w, c)]
    stored = {n: np.zeros(s, np.float32) for n, s in vgg.weights().items()}
    stored["classifier.0.weight"] = w
    torch_w = cs.torch_state(vgg, stored)["classifier.0.weight"]  # [out, (c, h, w)]
    c, h, x = 5, 3, 4
    assert torch_w[7, c * 49 + h * 7 + x] == w[7, (h * 7 + x) * 32 + c]


def test_summarise_interleaved_rounds():
    times = {"hepti": [0.010, 0.012, 0.020], "torch": [0.011, 0.010, 0.040], "ort": []}
    s = cs.summarise(times)
    assert s["median_ms"] == pytest.approx({"hepti": 12.0, "torch": 11.0})
    assert s["min_ms"] == pytest.approx({"hepti": 10.0, "torch": 10.0})
    # per round 10/11, 12/10, 20/40: median 10/11
    assert s["ratio"] == pytest.approx({"hepti/torch": 10 / 11})
    assert s["ratio_of_medians"] == pytest.approx({"hepti/torch": 12 / 11})
    assert cs.summarise({"hepti": [0.01]})["ratio"] == {}


def test_gemm_peak_and_targets():
    kernels = {"rows": [{"m": 128, "k": 384, "n": 1536, "gemm_gflops": 80.0, "numpy_gflops": 90.0},
                        {"m": 256, "k": 1024, "n": 1024, "gemm_gflops": 95.5,
                         "numpy_gflops": 97.0}]}
    assert cs.gemm_peak(kernels) == {"gflops": 95.5, "shape": [256, 1024, 1024],
                                     "numpy_gflops_same_shape": 97.0}
    assert cs.target_verdict("resnet50", 1.0) == {"hepti/torch_max": 1.0, "met": True}
    assert cs.target_verdict("vgg16", 1.01)["met"] is False
    assert cs.target_verdict("mobilenet-v2", 1.19)["met"] is True
    assert cs.target_verdict("mobilenet-v2", None)["met"] is None


def test_gaps_rank_ops_and_add_up_classes():
    graph = build(CNNConfig(arch="resnet50", width_divisor=16, num_classes=10))
    n = len(graph.ops)
    torch_s = [1e-3] * n
    hepti_s = [1e-3] * n
    hepti_s[2] = 5e-3   # the first 1x1 conv (layer1.0.downsample.0) loses 4 ms
    hepti_s[-1] = 0.5e-3  # fc wins 0.5 ms
    g = cs.gaps(graph, hepti_s, torch_s, 64, 64, top=3)
    assert g["ops"][0]["op"] == graph.ops[2].name and g["ops"][0]["gap_ms"] == pytest.approx(4.0)
    assert len(g["ops"]) == 3 and len(g["all_ops"]) == n
    classes = {c["class"]: c for c in g["classes"]}
    assert classes["linear"]["gap_ms"] == pytest.approx(-0.5)
    assert sum(c["ops"] for c in g["classes"]) == n
    assert sum(c["hepti_ms"] for c in g["classes"]) == pytest.approx(g["hepti_total_ms"])
    assert {"stem", "maxpool", "conv1x1", "conv3x3", "conv3x3/s2", "conv1x1/s2", "avgpool",
            "linear"} == set(classes)
    text = cs.format_gaps("resnet50", g)
    assert "layer1.0.downsample.0" in text and "+4.00 ms" in text


def model_result(name, hepti_ms, torch_ms=None, ort_ms=None):
    ms = {"hepti": hepti_ms, "torch": torch_ms, "ort": ort_ms}
    ms = {k: v for k, v in ms.items() if v is not None}
    ratio = {f"hepti/{k}": hepti_ms / v for k, v in ms.items() if k != "hepti"}
    gflop = cs.count_flops(build(CNNConfig(arch=cs.MODELS[name])), 224, 224)
    return {"model": name, "weights": "random", "median_ms": ms, "ratio": ratio, "rounds": 15,
            "flops": gflop, "gflops": {k: gflop["total"] / v / 1e6 for k, v in ms.items()},
            "hepti_fraction_of_peak": gflop["total"] / hepti_ms / 1e6 / 100.0,
            "check": {"hepti_vs_torch": 1e-6} if torch_ms else {},
            "target": cs.target_verdict(name, ratio.get("hepti/torch"))}


def test_report_and_csv():
    doc = {"size": 224, "rounds": 15, "gemm_peak": {"gflops": 100.0, "shape": [256, 1024, 1024]},
           "notes": ["onnxruntime/onnx not importable"],
           "models": [model_result("resnet50", 90.0, 100.0, 80.0),
                      model_result("mobilenet-v2", 13.0, 10.0)]}
    text = cs.format_table(doc)
    assert "target resnet50: hepti/torch <= 1.0: met (0.900)" in text
    assert "target mobilenet-v2: hepti/torch <= 1.2: NOT met (1.300)" in text
    assert "100.0 GFLOP/s at 256x1024x1024" in text and "note: onnxruntime" in text
    rows = list(csv.DictReader(io.StringIO(cs.csv_text(doc))))
    assert [r["model"] for r in rows] == ["resnet50", "mobilenet-v2"]
    assert list(rows[0]) == cs.CSV_FIELDS
    assert rows[0]["hepti_over_torch"] == "0.9000" and rows[0]["target_met"] == "True"
    assert rows[1]["ort_ms"] == "" and rows[1]["hepti_over_ort"] == ""
    assert float(rows[0]["gflop"]) == pytest.approx(8.18, abs=0.01)
    assert rows[0]["hepti_fraction_of_peak"] == f"{doc['models'][0]['hepti_fraction_of_peak']:.3f}"
    alone = {**doc, "gemm_peak": None, "models": [model_result("vgg16", 500.0)]}
    text = cs.format_table(alone)
    assert "not measured (torch did not run)" in text and "GeMM peak" not in text
    assert list(csv.DictReader(io.StringIO(cs.csv_text(alone))))[0]["target_met"] == ""


def test_report_and_csv_with_threads():
    m = model_result("resnet50", 50.0, 100.0, 60.0)
    m["median_ms"]["hepti-1t"] = 92.0
    m.update(threads=2, speedup=1.84)
    doc = {"size": 224, "rounds": 5, "threads": 2, "models": [m]}
    text = cs.format_table(doc)
    assert "batch 1, 2 threads;" in text
    assert "resnet50: hepti on 2 threads 50.00 ms, on 1 thread 92.00 ms: speedup 1.840" in text
    row = next(csv.DictReader(io.StringIO(cs.csv_text(doc))))
    assert (row["threads"], row["hepti_1t_ms"], row["speedup"]) == ("2", "92.000", "1.840")


def test_unknown_model_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        registry.main("cnn-single", ["--models", "resnet50,alexnet"])
    assert e.value.code == 2
    assert "choose from resnet50, vgg16, mobilenet-v2" in capsys.readouterr().err


@pytest.mark.parametrize("n, out", [(5, 7), (7, 7), (14, 7), (9, 4), (13, 3), (1, 1)])
def test_pool_bins_are_pytorch_s_adaptive_average_pool(n, out):
    """The bin matrices that stand in for an adaptive pool ONNX cannot export (VGG-16 at 160:
    a 5x5 map to 7x7) pool as PyTorch does, both axes at once."""
    torch = pytest.importorskip("torch")
    x = torch.from_numpy(np.random.default_rng(n).standard_normal((2, 3, n, n + 2), dtype=np.float32))
    want = torch.nn.functional.adaptive_avg_pool2d(x, (out, out - 1 if out > 1 else 1)).numpy()
    ph, pw = cs.pool_bins(n, out), cs.pool_bins(n + 2, want.shape[-1])
    np.testing.assert_allclose(ph @ x.numpy() @ pw.T, want, rtol=1e-6, atol=1e-6)


def test_cnn_ops_names_every_resnet_op_by_its_onnxruntime_node(tmp_path):
    """hepti bench cnn-ops: each ResNet-50 op has onnxruntime's node of its own (the fused
    node named by the torchvision module output it ends with), and the profile's kernel
    times are read per node, the warm-up runs left out."""
    from hepti.bench import cnnops
    graph = build(CNNConfig(arch="resnet50", width_divisor=16, num_classes=10))
    names = [cnnops.ort_node(op.name) for op in graph.ops]
    assert len(set(names)) == len(names) == len(graph.ops)
    assert cnnops.ort_node("layer1.0.conv2") == "/layer1/layer1.0/relu_1/Relu"
    assert cnnops.ort_node("layer4.0.downsample.0") == "/layer4/layer4.0/downsample/downsample.0/Conv"
    events = [{"cat": "Node", "name": "/layer1/layer1.0/relu_1/Relu_output_0_nchwc_kernel_time",
               "dur": d} for d in (900, 800, 700)] + [{"cat": "Session", "name": "x", "dur": 1}]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(events))
    got = cnnops.node_times(path, skip=1)
    assert got == {"/layer1/layer1.0/relu_1/Relu": [0.0008, 0.0007]}


def test_cnn_ops_takes_vgg_by_its_chain_steps_and_names_their_onnxruntime_nodes():
    """hepti bench cnn-ops --model vgg16: VGG-16's 13 convolutions are the PlainChain's steps
    (5 with their max pool), each named by onnxruntime's fused node (the ReLU after it) and
    its pool's, and the head's ops by theirs."""
    from hepti.bench import cnnops
    graph = build(CNNConfig(arch="vgg16", width_divisor=16, num_classes=10))

    class Model:  # what vgg_steps reads of a CNNModel
        pass
    model = Model()
    model.graph = graph
    steps = cnnops.vgg_steps(model)
    assert len(steps) == 13 and sum(p is not None for _, p in steps) == 5
    assert [c.name for c, _ in steps[:2]] == ["features.0", "features.2"]
    assert steps[1][1].name == "features.4"
    assert cnnops.vgg_node(steps[1][0]) == "/features/features.3/Relu"
    assert cnnops.vgg_node(steps[1][1]) == "/features/features.4/MaxPool"
    ops = {op.name: op for op in graph.ops}
    assert cnnops.vgg_node(ops["classifier.0"]) == "/classifier/classifier.0/Gemm"
    assert cnnops.vgg_node(ops["avgpool"]) == "/avgpool/AveragePool"
    nodes = {"/features/features.3/Relu": [0.002, 0.001], "/features/features.4/MaxPool":
             [0.0005, 0.0004], "fused /classifier/classifier.0/Gemm": [0.003, 0.004]}
    assert cnnops._ort_ms(nodes, ["/features/features.3/Relu", "/features/features.4/MaxPool"],
                          min) == pytest.approx(1.4)
    assert cnnops._ort_ms(nodes, ["/classifier/classifier.0/Gemm"], min) == pytest.approx(3.0)
    assert cnnops._ort_ms(nodes, ["/nowhere"], min) is None
