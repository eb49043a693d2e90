"""Bad inputs to the CNN commands, through the CLI (issue 19): each is refused with a message
that says what is wrong, a non-zero exit and no traceback, before any work; or, where the input
is only unusual, the job is done right.

- `hepti convert` of a .pth whose pickle names a global outside torchzip's allow-list (built
  here by hand from pickle opcodes, tests/test_torchzip.py's helpers): refused, nothing run;
- `hepti convert` of torchvision's MobileNetV2 file cut short at several points;
- `hepti run` of inputs so small that some rank owns no row of some feature map (a ResNet
  layer4 map of 1 row at 4 ranks, every MobileNetV2 map 1 row for a 1x1 image): those ranks
  idle for that layer and the logits are torchvision's;
- an image smaller than the network: MobileNetV2 and ResNet-50 pad every map to at least 1x1,
  so even a 1x1 image runs (and matches torchvision); VGG-16's unpadded pools refuse it, at
  one rank and under mpiexec.
"""
from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from helpers import FIXTURES
from test_cli import assert_clean_error, hepti
from test_distributed_launch import launch, launch_runs
from test_torchzip import payloads, write_legacy, write_zip

ATOL = 1e-3  # logits against torchvision's, absolute


# --- hepti convert ------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt,payload", [
    ("zip", "os.system"), ("zip", "builtins.eval"), ("legacy", "builtins.eval"),
    ("zip", "builtins.open (in a state_dict)")])
def test_convert_refuses_foreign_global(tmp_path, fmt, payload):
    """A torch file named as torchvision's MobileNetV2 whose data.pkl would run a shell
    command, eval or open a file: refused by name, the marker the payload would create never
    appears, no model is written. (The control: plain pickle does run the payload.)"""
    marker = tmp_path / "marker"
    pkl = payloads(marker, legacy=fmt == "legacy")[payload]
    if payload == "os.system":
        pickle.loads(pkl)  # the control: `touch marker` through the shell
        assert marker.exists()
        marker.unlink()
    pth = tmp_path / "mobilenet_v2-b0353104.pth"  # the name tells hepti the architecture
    if fmt == "zip":
        write_zip(pth, pkl, {"0": bytes(16)})
    else:
        write_legacy(pth, pkl, {"0": (4, bytes(16))})
    out = tmp_path / "model"
    code, _, err = hepti("convert", pth, "--out", out)
    assert_clean_error(code, err, "refused to load", f"global {payload.split(' ')[0]}.",
                       "Nothing in the file was run")
    assert not marker.exists()
    assert not out.exists()


@pytest.fixture(scope="module")
def mobilenet_pth():
    from hepti.weights.cnn import find_package_pth
    return find_package_pth()


@pytest.mark.parametrize("keep,needle", [
    (0, "is not a PyTorch checkpoint"),           # empty
    (60, "is not a readable pickle"),              # inside the legacy format's first pickles
    (20_000, "is not a readable pickle"),          # inside the state_dict's pickle
    (0.5, "the file ends inside storage"),         # half the tensors' bytes
    (-1, "the file ends inside storage"),          # one byte short
])
def test_convert_refuses_truncated_pth(tmp_path, mobilenet_pth, keep, needle):
    """torchvision's real mobilenet_v2-b0353104.pth (the legacy format) cut at several points:
    each says the file is truncated, and writes nothing."""
    data = mobilenet_pth.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    cut = tmp_path / mobilenet_pth.name
    cut.write_bytes(data[:n])
    out = tmp_path / "model"
    code, _, err = hepti("convert", cut, "--out", out)
    assert_clean_error(code, err, needle)
    assert n == 0 or "truncated" in err, err
    assert not out.exists()


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_convert_refuses_unreadable_pth(tmp_path, kind):
    """A .pth that is not there, or is a directory (these were tracebacks)."""
    pth = tmp_path / "mobilenet_v2-b0353104.pth"
    if kind == "directory":
        pth.mkdir()
    code, _, err = hepti("convert", pth, "--out", tmp_path / "model")
    assert_clean_error(code, err, str(pth), "cannot read it",
                       "No such file" if kind == "missing" else "Is a directory")


# --- hepti run: inputs smaller than the network, ranks without rows ----------------------------

def _small(name: str, hw: str, tmp_path):
    """(pixels file, torchvision's logits) of make_cnn_fixtures.py's small input `hw`."""
    e = np.load(FIXTURES / f"{name}_expected.npz")
    px = tmp_path / f"px_{hw}.npy"
    np.save(px, e[f"small_{hw}_pixels"].astype(np.float32))
    return px, e[f"small_{hw}_logits"]


@pytest.mark.parametrize("name", ["mobilenet_v2", "resnet50_tiny"])
def test_one_pixel_image_runs(tmp_path, name, mobilenet_dir, resnet_tiny_dir):
    """A 1x1 image: padding keeps every map of MobileNetV2 and ResNet-50 at 1x1 (torchvision
    runs it too), so hepti runs it, with torchvision's logits."""
    px, want = _small(name, "1x1", tmp_path)
    model = mobilenet_dir if name == "mobilenet_v2" else resnet_tiny_dir
    code, _, err = hepti("run", "--model", model, "--input-pixels", px,
                         "--output", tmp_path / "y.npy")
    assert code == 0, err
    assert np.abs(np.load(tmp_path / "y.npy") - want).max() <= ATOL


def test_vgg_refuses_one_pixel_image(tmp_path, vgg_tiny_dir):
    """VGG-16's 2x2 pools have no padding: a 1x1 image would leave an empty map."""
    np.save(tmp_path / "px.npy", np.zeros((1, 3, 1, 1), np.float32))
    code, _, err = hepti("run", "--model", vgg_tiny_dir, "--input-pixels", tmp_path / "px.npy")
    assert_clean_error(code, err, "a 1x1 image is too small for vgg16")


def _zero_row_maps(model_dir, h: int, w: int, ratios) -> list[str]:
    """The spatial ops whose output map leaves some rank with a share but no rows."""
    from hepti.counts import counts
    from hepti.graph.cnn import build
    from hepti.graph.split import spatial_ops
    from hepti.weights import WeightStore
    with WeightStore(model_dir) as store:
        g = build(store.config)
    shapes = g.shapes(h, w)
    return [op.name for op in g.ops[:spatial_ops(g)]
            if any(c == 0 and r > 0 for c, r in zip(counts(shapes[op.output][0], ratios),
                                                    ratios))]


@pytest.mark.parametrize("n,cases", [
    (4, [("resnet50_tiny", "9x7", ["--ratios", "0.1,0.2,0.3,0.4"]),  # layer3, layer4: 1 row
         ("resnet50_tiny", "2x3", ["--strategy", "auto"])]),          # measured, planned on 1 row
    (3, [("mobilenet_v2", "1x1", ["--strategy", "even"])]),           # every map 1 row
], ids=["resnet50_tiny-4", "mobilenet_v2-3"])
def test_ranks_without_rows_idle(tmp_path, n, cases, mobilenet_dir, resnet_tiny_dir):
    """`hepti run` under mpiexec on maps with fewer rows than ranks: a rank with a share of the
    rows but none of some map idles for that layer (no exchange, no compute), and the logits
    are still torchvision's. The runs at one world size in one job (tests/mpi/runs.py: the
    ranks' start-up paid once; each run's --report read for its ratios)."""
    runs = []
    for i, (name, hw, args) in enumerate(cases):
        px, want = _small(name, hw, tmp_path)
        model = mobilenet_dir if name == "mobilenet_v2" else resnet_tiny_dir
        out, report = tmp_path / f"y{i}.npy", tmp_path / f"report{i}.json"
        runs.append((name, hw, args, model, want, out, report,
                     ["run", "--model", model, "--input-pixels", px, "--output", out,
                      "--report", report, *args]))
    codes, _, errs = launch_runs(n, *[r[-1] for r in runs], timeout=300)
    for (name, hw, args, model, want, out, report, _), code, err in zip(runs, codes, errs):
        assert code == 0, (name, hw, err[-2000:])
        ratios = json.loads(report.read_text())["ratios"]["rows"]
        if args[0] != "--strategy" or args[1] != "auto":  # auto may well put it on one rank
            h, w = map(int, hw.split("x"))
            assert _zero_row_maps(model, h, w, ratios), "no rank went without rows: a weak test"
        assert np.abs(np.load(out) - want).max() <= ATOL, (name, hw, ratios)


def test_too_small_refused_once_under_mpiexec(tmp_path, vgg_tiny_dir):
    """VGG's too-small input at 3 ranks: one clear message from rank 0, every rank exits,
    quickly (no rank left waiting)."""
    np.save(tmp_path / "px.npy", np.zeros((1, 3, 20, 40), np.float32))
    code, _, err, secs = launch(3, "-m", "hepti", "run", "--model", vgg_tiny_dir,
                                "--input-pixels", tmp_path / "px.npy", "--strategy", "auto",
                                timeout=120)
    assert_clean_error(code, err, "a 20x40 image is too small for vgg16")
    assert err.count("too small") == 1, err
    assert secs < 30, f"took {secs:.1f} s to end"
