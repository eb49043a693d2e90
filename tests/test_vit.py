"""The ViT family on one process against transformers' ViTModel (tests/fixtures/vit_expected.npz,
made by tests/fixtures/make_vit_fixture.py), and `hepti run` on images and pixel arrays, with the
bad inputs a user can give it. Every strategy at 2-4 ranks is checked against this engine in
tests/mpi/test_equivalence.py and tests/test_distributed_launch.py."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from helpers import FIXTURES
from test_cli import assert_clean_error, hepti

TOL = 1e-4


@pytest.fixture(scope="module")
def expected():
    return np.load(FIXTURES / "vit_expected.npz")


def _run(model_dir, pixels):
    from hepti.inputs import Batch
    from hepti.parallel.single import SingleDevice
    from hepti.weights import WeightStore
    store = WeightStore(model_dir)
    engine = SingleDevice.from_store(store)
    return engine.run(Batch(None, np.ones((len(pixels), store.config.seq_len), np.int64), None,
                            pixels))


def test_single_device_matches_transformers(vit_dir, expected):
    h = _run(vit_dir, expected["pixels"])
    assert h.shape == expected["hidden"].shape == (3, 17, 90)
    assert np.abs(h - expected["hidden"]).max() <= TOL
    assert np.abs(h[:, 0] - expected["cls"]).max() <= TOL  # CLS after the final LayerNorm
    assert np.abs(h.mean(axis=1) - expected["mean"]).max() <= TOL


def test_run_pixels_writes_hidden_states_and_pools(vit_dir, expected, tmp_path):
    px = tmp_path / "px.npy"
    np.save(px, expected["pixels"])
    out = tmp_path / "h.npy"
    code, _, err = hepti("run", "--model", vit_dir, "--input-pixels", px, "--pool", "none",
                         "--output", out)
    assert code == 0, err
    assert np.abs(np.load(out) - expected["hidden"]).max() <= TOL
    cls = tmp_path / "cls.npy"
    code, _, err = hepti("run", "--model", vit_dir, "--input-pixels", px, "--pool", "cls",
                         "--output", cls, "--batch-size", "2")
    assert code == 0, err
    assert np.abs(np.load(cls) - expected["cls"]).max() <= TOL


def test_run_images_preprocesses_as_transformers(vit_dir, expected, tmp_path):
    """--image: the file preprocessed (as transformers' processor did: `processed`), then the
    model; the same as --input-pixels on the processor's output."""
    out, ref = tmp_path / "a.npy", tmp_path / "b.npy"
    code, _, err = hepti("run", "--model", vit_dir, "--image", FIXTURES / "vit_image.png",
                         FIXTURES / "vit_image_la.png", "--pool", "cls", "--output", out)
    assert code == 0, err
    px = tmp_path / "px.npy"
    np.save(px, np.concatenate([expected["processed"], expected["processed_la"]]))
    code, _, err = hepti("run", "--model", vit_dir, "--input-pixels", px, "--pool", "cls",
                         "--output", ref)
    assert code == 0, err
    assert np.abs(np.load(out) - np.load(ref)).max() <= TOL
    assert np.abs(np.load(out)).max() > 0


def test_missing_preprocessor_config_uses_defaults_and_says_so(vit_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(vit_dir, bare)
    (bare / "preprocessor_config.json").unlink(missing_ok=True)
    code, _, err = hepti("run", "--model", bare, "--image", FIXTURES / "vit_image.png")
    # the ViT defaults resize to 224x224; this model takes 32x32: a clear refusal, no traceback
    assert "no preprocessor_config.json" in err and "defaults" in err, err
    assert_clean_error(code, err, "32x32")


def test_bad_inputs_are_refused_clearly(vit_dir, minilm_dir, tmp_path):
    not_image = tmp_path / "notes.png"
    not_image.write_text("not an image")
    code, _, err = hepti("run", "--model", vit_dir, "--image", not_image)
    assert_clean_error(code, err, str(not_image))
    gray = tmp_path / "gray.npy"
    np.save(gray, np.zeros((2, 1, 32, 32), np.float32))
    code, _, err = hepti("run", "--model", vit_dir, "--input-pixels", gray)
    assert_clean_error(code, err, "3 channels")
    wrong = tmp_path / "wrong.npy"
    np.save(wrong, np.zeros((2, 3, 30, 32), np.float32))
    code, _, err = hepti("run", "--model", vit_dir, "--input-pixels", wrong)
    assert_clean_error(code, err, "32x32")
    code, _, err = hepti("run", "--model", vit_dir, "--text", "a cat")
    assert_clean_error(code, err, "--image")
    code, _, err = hepti("run", "--model", minilm_dir, "--input-pixels", wrong)
    assert_clean_error(code, err, "vision models")


def test_profile_and_plan_take_the_images_token_count(vit_dir, tmp_path):
    """A vision model has one token count (patches + CLS): profile and plan use it without
    --seq, and refuse another."""
    prof = tmp_path / "p.json"
    code, _, err = hepti("profile", "--model", vit_dir, "--out", prof)
    assert code == 0, err
    code, out, err = hepti("plan", "--model", vit_dir, "--profile", prof)
    assert code == 0, err
    assert "17 tokens" in out, out
    code, _, err = hepti("plan", "--model", vit_dir, "--profile", prof, "--seq", "100")
    assert_clean_error(code, err, "17 tokens per image")
