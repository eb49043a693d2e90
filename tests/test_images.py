"""hepti.images against transformers' ViT image processor (tests/fixtures/vit_expected.npz), and
its refusals: files that are not images, pixel modes with no plain RGB meaning, bad configs and
pixel arrays of the wrong shape. No MPI, no torch."""
from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from hepti.errors import ConfigError, InputError
from hepti.images import center_crop, check_pixels, load_preprocessor, preprocess

# One uint8 level is 1/255/std >= 0.017 after normalising, so this still catches any pixel off by
# one level; with the Pillow that made the fixture the arrays are bit-identical.
ATOL = 1e-5


@pytest.fixture(scope="module")
def expected(fixtures_dir):
    return np.load(fixtures_dir / "vit_expected.npz")


@pytest.fixture(scope="module")
def vit_cfg(fixtures_dir):
    return load_preprocessor(fixtures_dir / "vit-tiny-odd")


def save(tmp_path, array, name="img.png"):
    path = tmp_path / name
    Image.fromarray(array).save(path)
    return path


# ---------------------------------------------------------------- against transformers
def test_fixture_config_is_read(vit_cfg):
    assert vit_cfg["defaults_used"] is False
    assert vit_cfg["size"] == {"height": 40, "width": 36}
    assert vit_cfg["do_center_crop"] and vit_cfg["crop_size"] == {"height": 32, "width": 32}
    assert vit_cfg["resample"] == 2 and vit_cfg["image_mean"] == [0.485, 0.456, 0.406]


def test_rgb_png_matches_transformers(fixtures_dir, vit_cfg, expected):
    got = preprocess([fixtures_dir / "vit_image.png"], vit_cfg)
    assert got.dtype == np.float32 and got.shape == expected["processed"].shape == (1, 3, 32, 32)
    np.testing.assert_allclose(got, expected["processed"], rtol=0, atol=ATOL)


def test_shortest_edge_bicubic_matches_transformers(fixtures_dir, vit_cfg, expected):
    cfg = {**vit_cfg, "size": {"shortest_edge": 34}, "resample": 3}  # 37x45 -> 34x41 -> 32x32
    got = preprocess([fixtures_dir / "vit_image.png"], cfg)
    np.testing.assert_allclose(got, expected["processed_shortest_edge"], rtol=0, atol=ATOL)


def test_la_png_drops_alpha_like_transformers(fixtures_dir, vit_cfg, expected):
    got = preprocess([fixtures_dir / "vit_image_la.png"], vit_cfg)
    np.testing.assert_allclose(got, expected["processed_la"], rtol=0, atol=ATOL)


def test_batch_keeps_order(fixtures_dir, vit_cfg, expected):
    got = preprocess([fixtures_dir / "vit_image_la.png", fixtures_dir / "vit_image.png"], vit_cfg)
    np.testing.assert_allclose(got[1:], expected["processed"], rtol=0, atol=ATOL)


# ---------------------------------------------------------------- other files and modes
def test_grayscale_becomes_three_equal_channels(tmp_path):
    gray = np.arange(12 * 10, dtype=np.uint8).reshape(12, 10)
    cfg = {**load_preprocessor(tmp_path), "size": {"height": 8, "width": 8}}
    got = preprocess([save(tmp_path, gray)], cfg)
    assert got.shape == (1, 3, 8, 8)
    assert np.array_equal(got[0, 0], got[0, 1]) and np.array_equal(got[0, 0], got[0, 2])


def test_rgba_alpha_is_dropped(tmp_path):
    rgba = np.random.default_rng(0).integers(0, 256, (9, 11, 4), dtype=np.uint8)
    rgba[..., 3] = 0  # fully transparent: the colours under it are what counts
    cfg = {**load_preprocessor(tmp_path), "size": {"height": 8, "width": 8}}
    got = preprocess([save(tmp_path, rgba, "a.png"), save(tmp_path, rgba[..., :3], "b.png")], cfg)
    assert np.array_equal(got[0], got[1])


def test_text_file_named_png_is_refused(tmp_path, vit_cfg):
    path = tmp_path / "notes.png"
    path.write_text("not an image\n")
    with pytest.raises(InputError, match=r"notes\.png is not an image Pillow can read: ") as e:
        preprocess([path], vit_cfg)
    assert "\n" not in str(e.value)


def test_truncated_png_is_refused(tmp_path, fixtures_dir, vit_cfg):
    path = tmp_path / "cut.png"
    path.write_bytes((fixtures_dir / "vit_image.png").read_bytes()[:600])
    with pytest.raises(InputError, match=r"cut\.png is not an image Pillow can read"):
        preprocess([path], vit_cfg)


def test_16bit_image_is_refused_not_clipped(tmp_path, vit_cfg):
    path = save(tmp_path, np.full((6, 5), 1000, dtype=np.uint16))
    with pytest.raises(InputError, match=r"img\.png has pixel mode I;16 \(1 channels: .*8-bit RGB"):
        preprocess([path], vit_cfg)


def test_missing_file_and_empty_list(tmp_path, vit_cfg):
    with pytest.raises(InputError, match="no such image file"):
        preprocess([tmp_path / "gone.jpg"], vit_cfg)
    with pytest.raises(InputError, match="no input images"):
        preprocess([], vit_cfg)


def test_sizes_must_agree_without_resize(tmp_path):
    cfg = {**load_preprocessor(tmp_path), "do_resize": False}
    paths = [save(tmp_path, np.zeros((4, 4, 3), np.uint8), "a.png"),
             save(tmp_path, np.zeros((5, 4, 3), np.uint8), "b.png")]
    with pytest.raises(InputError, match="different sizes"):
        preprocess(paths, cfg)


def test_center_crop_pads_a_smaller_image_with_zeros():
    x = np.arange(1, 7, dtype=np.uint8).reshape(1, 2, 3)  # [C=1, H=2, W=3]
    got = center_crop(x, 5, 2)  # taller than x: 3 rows of padding, 2 before; narrower: cut
    want = np.array([[0, 0], [0, 0], [1, 2], [4, 5], [0, 0]], dtype=np.uint8)
    assert np.array_equal(got[0], want)


# ---------------------------------------------------------------- preprocessor config
def test_missing_config_gives_vit_defaults_and_says_so(tmp_path):
    cfg = load_preprocessor(tmp_path)
    assert cfg["defaults_used"] is True
    assert cfg["size"] == {"height": 224, "width": 224} and cfg["resample"] == 2
    assert cfg["rescale_factor"] == 1 / 255
    assert cfg["image_mean"] == cfg["image_std"] == [0.5, 0.5, 0.5]
    assert not cfg["do_center_crop"]


def write_config(tmp_path, **settings):
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(settings))
    return tmp_path


def test_legacy_int_size_is_a_square_and_missing_keys_default(tmp_path):
    cfg = load_preprocessor(write_config(tmp_path, size=48, image_mean=0.4))
    assert cfg["size"] == {"height": 48, "width": 48} and cfg["image_mean"] == [0.4] * 3
    assert cfg["image_std"] == [0.5] * 3 and cfg["defaults_used"] is False


@pytest.mark.parametrize("settings, message", [
    ({"size": {"longest_edge": 30}}, r"size \{'longest_edge': 30\} is not a size"),
    ({"size": {"height": 0, "width": 4}}, "positive whole numbers"),
    ({"do_center_crop": True}, "crop_size None is not a size"),
    ({"resample": 7}, r"resample 7 is not a Pillow filter code \(0 nearest"),
    ({"image_mean": [0.5, 0.5]}, "image_mean .* must be 3 numbers"),
    ({"image_std": [0.5, 0, 0.5]}, "has a zero"),
    ({"crop_pct": 0.875}, "sets crop_pct, which hepti's image preprocessing does not implement"),
])
def test_bad_configs_are_refused(tmp_path, settings, message):
    with pytest.raises(ConfigError, match=message):
        load_preprocessor(write_config(tmp_path, **settings))


def test_unreadable_config_is_refused(tmp_path):
    (tmp_path / "preprocessor_config.json").write_text("{size: 3")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        load_preprocessor(tmp_path)


# ---------------------------------------------------------------- ready pixel arrays
def test_good_pixels_pass_as_float32(expected):
    got = check_pixels(expected["pixels"].astype(np.float64), 32, 3)
    assert got.dtype == np.float32 and np.array_equal(got, expected["pixels"])
    assert check_pixels(expected["pixels"], (32, 32)).shape == (3, 3, 32, 32)


@pytest.mark.parametrize("shape, message", [
    ((3, 32, 32), r"4-D array \[n, 3, 32, 32\]; got shape \[3, 32, 32\] \(a single image"),
    ((2, 32, 32, 3), r"3 channels on axis 1, as \[n, 3, 32, 32\]; got shape \[2, 32, 32, 3\]"),
    ((2, 3, 32, 30), r"32x32, the model's image size: expected \[n, 3, 32, 32\], got shape \[2, 3, 32, 30\]"),
    ((0, 3, 32, 32), "no images"),
])
def test_wrong_shapes_are_refused(shape, message):
    with pytest.raises(InputError, match=message):
        check_pixels(np.zeros(shape, np.float32), 32, 3)


def test_raw_or_broken_pixels_are_refused():
    with pytest.raises(InputError, match="normalised floats .* got dtype uint8"):
        check_pixels(np.zeros((1, 3, 32, 32), np.uint8), 32, 3)
    bad = np.zeros((1, 3, 32, 32), np.float32)
    bad[0, 1, 2, 3] = np.nan
    with pytest.raises(InputError, match="NaN"):
        check_pixels(bad, 32, 3)
