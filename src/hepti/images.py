"""Image files -> pixel arrays [n, 3, H, W], as transformers' ViT image processor makes them.

A vision model's inputs are normalised pixels, and the model's own preprocessor_config.json says
how to get them. hepti never imports torch or transformers, so this module redoes, with numpy and
Pillow only, what transformers' PIL backend (ViTImageProcessorPil) does, step for step, so the
numbers agree bit for bit: Pillow resizes the uint8 RGB image with the config's resample filter,
the middle crop_size is cut out (zero-padded where the image is smaller), then x * rescale_factor
in float64 rounded to float32, then (x - mean) / std in float32.

Files are read as transformers' `load_image` reads them for its pipelines: the EXIF orientation is
applied, then Pillow's convert("RGB"): grayscale is repeated into three channels, a palette is
expanded, and an alpha channel is dropped (not composited onto any background). Animated files
give their first frame, with a warning, and so does an image much smaller than the model's input.
16- and 32-bit images are refused rather than clipped to 0..255.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from hepti.errors import ConfigError, InputError

log = logging.getLogger("hepti")
# transformers' ViTImageProcessor defaults, used for whatever preprocessor_config.json leaves out
VIT_DEFAULTS = {
    "do_resize": True, "size": {"height": 224, "width": 224}, "resample": 2,  # bilinear
    "do_center_crop": False, "crop_size": None,
    "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
}
# Pillow's codes, which Hugging Face configs use for `resample` (PILImageResampling)
RESAMPLE_NAMES = {0: "nearest", 1: "lanczos", 2: "bilinear", 3: "bicubic", 4: "box", 5: "hamming"}
# 8-bit modes whose RGB meaning is plain; anything else (16-bit "I;16", 32-bit "I" and "F",
# premultiplied "La"/"RGBa", "LAB", "HSV") Pillow would clip or cannot convert
RGB_CONVERTIBLE = {"1", "L", "LA", "P", "PA", "RGB", "RGBA", "RGBX", "CMYK", "YCbCr"}
# keys of other processors that change the numbers in ways this module does not do
UNSUPPORTED = ("crop_pct", "do_pad", "do_flip_channel_order", "do_reduce_labels")


def load_preprocessor(model_dir: str | Path) -> dict:
    """The model folder's preprocessor_config.json over ViT's defaults, checked and normalised.

    `size` becomes {"height", "width"} or {"shortest_edge"}, `crop_size` {"height", "width"}.
    `defaults_used` is True when the folder has no such file, so the caller can say that the
    ViT defaults (224x224, bilinear, x/255, mean and std 0.5) were assumed.
    """
    path = Path(model_dir) / "preprocessor_config.json"
    if not path.is_file():
        return {**VIT_DEFAULTS, "defaults_used": True}
    try:
        given = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON ({e}); restore it from the model's checkpoint "
                          "or delete it to use the ViT defaults") from None
    if not isinstance(given, dict):
        raise ConfigError(f"{path} must hold a JSON object of settings; it holds a "
                          f"{type(given).__name__}")
    cfg = {**VIT_DEFAULTS, **{k: v for k, v in given.items() if k in VIT_DEFAULTS and v is not None}}
    _refuse_unsupported(path, given)
    cfg["size"] = _size_dict(path, "size", cfg["size"], allow_shortest=True)
    if cfg["do_center_crop"]:
        cfg["crop_size"] = _size_dict(path, "crop_size", cfg["crop_size"], allow_shortest=False)
    _check_resample(path, cfg["resample"])
    for key in ("image_mean", "image_std"):
        cfg[key] = _per_channel(path, key, cfg[key])
    if 0 in cfg["image_std"]:
        raise ConfigError(f"{path}: image_std {cfg['image_std']} has a zero; it divides the pixels")
    return {**cfg, "defaults_used": False}


def _refuse_unsupported(path: Path, given: dict) -> None:
    """A switched-on option this module does not implement would silently change the pixels."""
    used = [k for k in UNSUPPORTED if given.get(k)]
    if used:
        raise ConfigError(f"{path} sets {', '.join(used)}, which hepti's image preprocessing does "
                          "not implement (it does what ViTImageProcessor does); preprocess the "
                          "images yourself and pass the pixels with --input-pixels")


def _size_dict(path: Path, key: str, value, allow_shortest: bool) -> dict:
    """{"height", "width"} (from such a dict, an int meaning a square, or [h, w]), or
    {"shortest_edge"} where allowed, as transformers reads a ViT config."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = {"height": value, "width": value}
    elif isinstance(value, (list, tuple)) and len(value) == 2:
        value = {"height": value[0], "width": value[1]}
    forms = [{"height", "width"}] + ([{"shortest_edge"}] if allow_shortest else [])
    if not isinstance(value, dict) or set(value) not in forms:
        wanted = " or ".join("{" + ", ".join(f'"{k}": N' for k in sorted(f)) + "}" for f in forms)
        raise ConfigError(f"{path}: {key} {value!r} is not a size hepti can use; give {wanted}")
    if not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in value.values()):
        raise ConfigError(f"{path}: {key} {value} must hold positive whole numbers of pixels")
    return dict(value)


def _check_resample(path: Path, code) -> None:
    if not isinstance(code, int) or isinstance(code, bool) or code not in RESAMPLE_NAMES:
        known = ", ".join(f"{c} {n}" for c, n in RESAMPLE_NAMES.items())
        raise ConfigError(f"{path}: resample {code!r} is not a Pillow filter code ({known})")


def _per_channel(path: Path, key: str, value) -> list[float]:
    """Three numbers, one per RGB channel (a single number is used for all three)."""
    values = [value] * 3 if isinstance(value, (int, float)) else value
    if (not isinstance(values, list) or len(values) != 3
            or not all(isinstance(v, (int, float)) for v in values)):
        raise ConfigError(f"{path}: {key} {value!r} must be 3 numbers, one per RGB channel")
    return [float(v) for v in values]


def preprocess(paths: list[str | Path], cfg: dict) -> np.ndarray:
    """Read, resize, crop, rescale and normalise each image as `cfg` says -> float32 [n, 3, H, W]."""
    if not paths:
        raise InputError("no input images")
    images = []
    for p in paths:
        img = read_rgb(p)
        _warn_if_tiny(p, img.height, img.width, cfg)
        images.append(_pixels(img, cfg))  # [3, H, W]
    shapes = {img.shape for img in images}
    if len(shapes) > 1:
        raise InputError(f"the images end up with different sizes {sorted(s[1:] for s in shapes)} "
                         "because the preprocessor config neither resizes nor crops to one size")
    return np.stack(images)


def read_rgb(path: str | Path):
    """A Pillow RGB image of the file, upright (EXIF orientation applied), as `load_image` does."""
    from PIL import Image, ImageOps, UnidentifiedImageError  # local: optional dependency (Pillow), and start-up time

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{path}: no such image file")
    try:
        with Image.open(path) as img:
            img.load()  # decode now: a truncated file fails here, not later
            frames = getattr(img, "n_frames", 1)
            img = ImageOps.exif_transpose(img)
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise InputError(f"{path} is not an image Pillow can read: {e}") from None
    if frames > 1:
        log.warning("%s has %d frames; only the first is used", path, frames)
    if img.mode not in RGB_CONVERTIBLE:
        raise InputError(f"{path} has pixel mode {img.mode} ({len(img.getbands())} channels: "
                         f"{', '.join(img.getbands())}), which hepti does not turn into 8-bit RGB; "
                         "save it as an 8-bit RGB, RGBA or grayscale PNG or JPEG")
    return img.convert("RGB")


def _warn_if_tiny(path, height: int, width: int, cfg: dict) -> None:
    """Warn when an image is much smaller than what the model looks at: it is blown up (or, with
    no resize, padded with zeros), and the answer may mean little. Twice the image's side is
    the line: every photo gets resized, and a bit of upscaling is ordinary."""
    if cfg["do_resize"]:
        want_h, want_w = _resized_size(height, width, cfg["size"])
    elif cfg["do_center_crop"]:
        want_h, want_w = cfg["crop_size"]["height"], cfg["crop_size"]["width"]
    else:
        return
    if want_h >= 2 * height or want_w >= 2 * width:
        how = "upscaled" if cfg["do_resize"] else "padded with zeros"
        log.warning("%s is only %dx%d pixels; it was %s to %dx%d, so its answer may mean little",
                    path, width, height, how, want_w, want_h)


def _pixels(img, cfg: dict) -> np.ndarray:
    """One RGB Pillow image -> float32 [3, H, W], each step as transformers' PIL backend does it."""
    if cfg["do_resize"]:
        height, width = _resized_size(img.height, img.width, cfg["size"])
        img = img.resize((width, height), resample=cfg["resample"])  # Pillow takes (w, h)
    x = np.asarray(img).transpose(2, 0, 1)  # uint8 [3, H, W]
    if cfg["do_center_crop"]:
        x = center_crop(x, cfg["crop_size"]["height"], cfg["crop_size"]["width"])
    if cfg["do_rescale"]:
        x = (x.astype(np.float64) * cfg["rescale_factor"]).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if cfg["do_normalize"]:
        mean = np.array(cfg["image_mean"], dtype=np.float32)[:, None, None]  # [3, 1, 1]
        std = np.array(cfg["image_std"], dtype=np.float32)[:, None, None]
        x = (x - mean) / std
    return x


def _resized_size(height: int, width: int, size: dict) -> tuple[int, int]:
    """(height, width) after resizing: the given one, or the shortest edge set to
    size["shortest_edge"] and the other scaled with it, rounded down (transformers' rule)."""
    if "shortest_edge" not in size:
        return size["height"], size["width"]
    short, long = sorted((height, width))
    new_short, new_long = size["shortest_edge"], int(size["shortest_edge"] * long / short)
    return (new_long, new_short) if width <= height else (new_short, new_long)


def center_crop(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """The middle height x width of x [C, H, W]; where x is smaller along an axis, x is put in the
    middle of zeros instead (the odd pixel of padding goes first), as transformers does."""
    cuts, pads = [slice(None)], [(0, 0)]
    for have, want in zip(x.shape[1:], (height, width)):
        if want <= have:
            start = (have - want) // 2
            cuts.append(slice(start, start + want))
            pads.append((0, 0))
        else:
            before = (want - have + 1) // 2
            cuts.append(slice(None))
            pads.append((before, want - have - before))
    return np.pad(x[tuple(cuts)], pads)


def check_pixels(arr: np.ndarray, image_size: int | tuple[int, int] | None,
                 channels: int = 3) -> np.ndarray:
    """A ready --input-pixels array checked against the model: float [n, channels, H, W] with
    (H, W) the model's image size (any, if None: a CNN's), finite. Returns it as contiguous
    float32."""
    if image_size is None:
        image_size = tuple(arr.shape[2:]) if arr.ndim == 4 else ("H", "W")
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    want = f"[n, {channels}, {h}, {w}]"
    got = f"[{', '.join(map(str, arr.shape))}]"
    if arr.ndim != 4:
        hint = " (a single image needs a leading batch axis: arr[None])" if arr.ndim == 3 else ""
        raise InputError(f"pixels must be a 4-D array {want}; got shape {got}{hint}")
    if arr.shape[0] == 0:
        raise InputError(f"pixels hold no images: shape {got}, expected {want}")
    if arr.shape[1] != channels:
        raise InputError(f"pixels must have {channels} channels on axis 1, as {want}; got shape {got}"
                         " (channels-last [n, H, W, C] arrays need arr.transpose(0, 3, 1, 2))")
    if arr.shape[2:] != (h, w):
        raise InputError(f"pixels must be {h}x{w}, the model's image size: expected {want}, got "
                         f"shape {got}; resize the images, or give image files to preprocess")
    if not np.issubdtype(arr.dtype, np.floating):
        raise InputError(f"pixels must be normalised floats (float32); got dtype {arr.dtype}, which "
                         "looks like raw 0..255 values: give image files to preprocess instead")
    if not np.isfinite(arr).all():
        raise InputError("pixels hold NaN or infinite values")
    return np.ascontiguousarray(arr, dtype=np.float32)
