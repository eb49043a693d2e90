"""`hepti order` and `hepti graph import` end to end: the JSON they print, and bad input answered
with a clear message and a non-zero exit, no traceback."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

onnx = pytest.importorskip("onnx")

from helpers import hepti  # noqa: E402
from test_onnx_import import LIGHT, custom_op_model, cycle_model  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"


def assert_clean_error(code, err, *needles):
    assert code == 2
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


def test_order_an_onnx_file_as_json():
    code, out, err = hepti("order", LIGHT / "light_shufflenet.onnx", "--json", "--random", "20")
    assert code == 0, err
    r = json.loads(out)
    for key in ("peak_bytes", "order", "file_order_peak_bytes", "random_mean_bytes",
                "random_worst_bytes", "states", "seconds", "proven"):
        assert key in r
    assert len(r["order"]) == len(set(r["order"])) == r["ops"] == 203
    assert r["peak_bytes"] < r["file_order_peak_bytes"] and r["proven"]
    assert r["random"]["count"] == 20


def test_import_then_order_the_stored_graph(tmp_path):
    out = tmp_path / "squeezenet.json"
    code, text, err = hepti("graph", "import", LIGHT / "light_squeezenet.onnx", "--out", out)
    assert code == 0, err
    assert "66 operators" in text and "folded      39 constant nodes of 105" in text
    code, a, err = hepti("order", out, "--json", "--inplace", "--batch", "2", "--random", "0")
    assert code == 0, err
    code, b, err = hepti("order", LIGHT / "light_squeezenet.onnx", "--json", "--inplace",
                         "--batch", "2", "--random", "0")
    assert code == 0, err
    assert json.loads(a)["peak_bytes"] == json.loads(b)["peak_bytes"]
    assert json.loads(a)["batch"] == 2


def test_order_a_model_folder_text_report():
    code, out, err = hepti("order", FIXTURES / "tiny-odd", "--input-shape", "16")
    assert code == 0, err
    assert "proven least" in out and "(peak +0.0% against it)" in out  # a chain: one order


def test_order_a_cnn_model_folder(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "cnn", "arch": "mobilenet_v2"}')
    code, out, err = hepti("order", tmp_path, "--batch", "2", "--input-shape", "3x64x64",
                           "--json", "--random", "5")
    assert code == 0, err
    r = json.loads(out)
    assert (r["ops"], r["batch"], r["proven"]) == (54, 2, True)
    assert r["order"][0] == "features.0.0" and r["weight_bytes"] > 0
    assert_clean_error(*hepti("order", tmp_path, "--input-shape", "64x64")[::2], "3xHxW")
    vgg = tmp_path / "vgg"
    vgg.mkdir()
    (vgg / "config.json").write_text('{"model_type": "cnn", "arch": "vgg16"}')
    # five 2x2 max pools take 8 rows to 0
    assert_clean_error(*hepti("order", vgg, "--input-shape", "3x8x8")[::2], "too small")


def test_bad_input_gets_a_message_not_a_traceback(tmp_path):
    text = tmp_path / "notes.onnx"
    text.write_text("not a model at all\n" * 10)
    assert_clean_error(*hepti("order", text)[::2], "is not an ONNX model")
    assert_clean_error(*hepti("graph", "import", text)[::2], "is not an ONNX model")
    assert_clean_error(*hepti("order", cycle_model(tmp_path))[::2], "has a cycle")
    assert_clean_error(*hepti("order", custom_op_model(tmp_path))[::2],
                       "operator 'mystery' (Mystery)'s output 'm' could not be inferred")
    assert_clean_error(*hepti("order", tmp_path)[::2], "neither index.json nor config.json")
    # a cap below what one operator needs in any order
    assert_clean_error(*hepti("order", LIGHT / "light_squeezenet.onnx", "--cap", "1MiB")[::2],
                       "no order fits in 1,048,576 bytes: operator")


def test_bad_stored_graphs_get_a_message_not_a_traceback(tmp_path):
    import gzip
    bad = tmp_path / "g.json.gz"
    bad.write_bytes(b"not gzip at all")
    assert_clean_error(*hepti("order", bad)[::2], "is not a JSON operator graph")
    # a stored graph whose operators read each other in a ring
    ring = {"format": "hepti-opdag", "version": 1, "name": "ring", "inputs": ["x"],
            "outputs": ["b"], "tensors": {t: {"bytes": 4, "shape": [1]} for t in "xab"},
            "ops": [{"name": "A", "op_type": "Add", "inputs": ["x", "b"], "outputs": ["a"]},
                    {"name": "B", "op_type": "Relu", "inputs": ["a"], "outputs": ["b"]}]}
    cyc = tmp_path / "ring.json.gz"
    cyc.write_bytes(gzip.compress(json.dumps(ring).encode()))
    code, _, err = hepti("order", cyc)
    assert_clean_error(code, err, "has a cycle")
    assert "A -> B -> A" in err or "B -> A -> B" in err, err
    # a cap between the operators' own need and the least peak: no order found fits
    code, out, err = hepti("order", LIGHT / "light_shufflenet.onnx", "--json", "--random", "0")
    r = json.loads(out)
    assert r["lower_bound_bytes"] < r["peak_bytes"]
    assert_clean_error(*hepti("order", LIGHT / "light_shufflenet.onnx", "--random", "0",
                              "--cap", str(r["peak_bytes"] - 1))[::2],
                       "no order found fits in", f"the least peak of any order is "
                       f"{r['peak_bytes']:,}")
    assert hepti("order", LIGHT / "light_shufflenet.onnx", "--random", "0",
                 "--cap", str(r["peak_bytes"]))[0] == 0


def test_bench_order_writes_rows_that_agree_with_the_dp(tmp_path):
    from hepti.bench.registry import main
    out = tmp_path / "order.json"
    assert main("order", ["--what", "table", "--only", "squeezenet", "ws(32,4,0.75)-1", "bert-base",
                 "--out", str(out)]) == 0
    rows = {r["graph"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"onnx:squeezenet", "synthetic:ws(32,4,0.75)-1", "hepti:bert-base"}
    for r in rows.values():
        assert r["dp_agrees"] and r["proven"] and r["below_file_pct"] >= 0
    assert rows["synthetic:ws(32,4,0.75)-1"]["below_random_mean_pct"] > 0
    assert (tmp_path / "order.csv").read_text().startswith("graph,kind,ops")
    p = subprocess.run([sys.executable, "-m", "hepti.bench.order", "--help"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "usage" in p.stdout
