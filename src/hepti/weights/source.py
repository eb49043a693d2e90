"""Reading a Hugging Face BERT or ViT checkpoint folder: safetensors files, names, validation.

A checkpoint folder holds config.json and either one `model.safetensors` or several shards
listed in `model.safetensors.index.json`. Tensors are memory-mapped and handed out a block of
rows at a time (in hepti's stored orientation), so converting never holds a whole model in RAM.
The safetensors format is read here directly (8-byte header length, JSON header, raw data)
rather than through `safetensors.numpy`, because numpy has no bfloat16 and many checkpoints are
BF16; the parser checks every offset against the file size. The family (config.json's
model_type) decides which HF names are expected: `layout.LAYOUTS`, by its family's layout.
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hepti.config import ModelConfig
from hepti.families import config_from_json
from hepti.errors import WeightsError
from hepti.weights import layout

# safetensors dtype -> numpy dtype of the raw data ("BF16" is widened by hand).
SOURCE_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "BF16": np.uint16}
# Top-level prefixes of task heads that BERT checkpoints carry and the encoder does not use.
HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.", "lm_head.")
MODEL_PREFIX = "bert."  # BertForMaskedLM, ... wrap the encoder (each family's: layout.Layout)
MAX_HEADER_BYTES = 100 * 1024 * 1024
ITEMSIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
             "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


class SafetensorsFile:
    """One .safetensors file, memory-mapped; `rows()` copies out only the rows asked for."""

    def __init__(self, path: Path):
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as fh:
            head = fh.read(8)
            if len(head) < 8:
                raise WeightsError(f"{self.path}: {size} bytes, too short for a safetensors file")
            (n,) = struct.unpack("<Q", head)
            if n > min(size - 8, MAX_HEADER_BYTES):
                raise WeightsError(f"{self.path}: header length {n} does not fit the file "
                                   f"({size} bytes); the file is truncated or not safetensors")
            try:
                header = json.loads(fh.read(n))
            except ValueError as e:
                raise WeightsError(f"{self.path}: unreadable safetensors header ({e})") from None
        header.pop("__metadata__", None)
        data_start, data_len = 8 + n, size - 8 - n
        self.entries: dict[str, tuple[str, tuple[int, ...], int, int]] = {}
        for key, e in header.items():
            dtype, shape, (b0, b1) = e["dtype"], tuple(int(s) for s in e["shape"]), e["data_offsets"]
            itemsize = ITEMSIZES.get(dtype)
            nbytes = int(np.prod(shape, dtype=np.int64)) * (itemsize or 0)
            if not (0 <= b0 <= b1 <= data_len and (itemsize is None or b1 - b0 == nbytes)):
                raise WeightsError(f"{self.path}: tensor {key} has data offsets {b0}..{b1} that "
                                   f"do not match its shape {list(shape)} or the file size; "
                                   "the file is truncated or corrupted")
            self.entries[key] = (dtype, shape, data_start + b0, data_start + b1)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r") if size else None

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key][1]

    def dtype(self, key: str) -> str:
        return self.entries[key][0]

    def rows(self, key: str, start: int, stop: int, transpose: bool,
             shape: tuple[int, ...] | None = None) -> np.ndarray:
        """Rows [start, stop) of the tensor (of its transpose if `transpose`), as float32.
        `shape`: view the data as this shape first (row-major, same number of elements)."""
        dtype, stored, b0, b1 = self.entries[key]
        raw = self._map[b0:b1].view(SOURCE_DTYPES[dtype]).reshape(shape or stored)
        part = raw[:, start:stop].T if transpose else raw[start:stop]
        if dtype == "BF16":  # bfloat16 is the top half of a float32
            wide = np.empty(part.shape, np.uint32)  # C order, whatever the view's order
            wide[...] = part
            wide <<= 16
            return wide.view(np.float32)
        return np.ascontiguousarray(part, dtype=np.float32)

    def close(self) -> None:
        self._map = None


def map_hf_key(key: str, model_type: str = "bert") -> tuple[str, bool] | None:
    """HF key -> (our name, transpose?), or None for a tensor the encoder does not use.

    Raises WeightsError for an unknown key inside the encoder (embeddings, layers, ...): it
    would change the arithmetic, so silently dropping it would give wrong outputs.
    """
    mapped = _map_key(key, layout.of(model_type))
    return None if mapped is None else mapped[:2]


def _map_key(key: str, fam: layout.Layout) -> tuple[str, bool, str | None] | None:
    """map_hf_key, plus the spelling (label in fam.hf_layers) of a per-layer key, else None."""
    k = key[len(fam.hf_model_prefix):] if key.startswith(fam.hf_model_prefix) else key
    k = re.sub(r"LayerNorm\.gamma$", "LayerNorm.weight", k)
    k = re.sub(r"LayerNorm\.beta$", "LayerNorm.bias", k)
    if k.endswith(layout.HF_IGNORED_SUFFIXES) or k.startswith(fam.hf_skipped):
        return None
    for spelling, prefix, table in fam.hf_layers:
        m = re.fullmatch(_layer_pattern(prefix), k)
        if m and m.group(2) in table:
            local, transpose = table[m.group(2)]
            return layout.layer_name(int(m.group(1)), local), transpose, spelling
    if k in fam.hf_other:
        return (*fam.hf_other[k], None)
    if k.startswith(fam.hf_refused):
        raise WeightsError(f"unrecognised encoder tensor {key!r}: hepti converts standard "
                           f"{fam.label} encoders ({fam.hf_model} layout) only")
    return None


def _layer_pattern(prefix: str) -> str:
    """'encoder.layer.{i}.' -> a regex matching 'encoder.layer.3.<rest>' (groups: 3, rest)."""
    return re.escape(prefix).replace(re.escape("{i}"), r"(\d+)") + "(.+)"


@dataclass
class SourceTensor:
    """Where one of our tensors comes from in the checkpoint."""

    name: str
    hf_key: str
    file: SafetensorsFile
    transpose: bool
    shape: tuple[int, ...]  # stored shape (after the transpose)
    view: tuple[int, ...] | None = None  # stored shape, when it is a reshape of the HF one

    def rows(self, start: int, stop: int) -> np.ndarray:
        if self.view is not None:
            return self.file.rows(self.hf_key, start, stop, self.transpose, shape=self.view)
        return self.file.rows(self.hf_key, start, stop, self.transpose)


@dataclass
class Checkpoint:
    """A validated HF checkpoint: config, every tensor we need, and what was skipped."""

    path: Path
    config: ModelConfig
    tensors: dict[str, SourceTensor]  # in stored file order (layout.expected_shapes)
    skipped: list[str]
    files: list[SafetensorsFile]

    def close(self) -> None:
        for f in self.files:
            f.close()


def safetensors_files(src: Path) -> list[Path]:
    """The checkpoint's .safetensors files: model.safetensors, the index's shards, or all."""
    single, index = src / "model.safetensors", src / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise WeightsError(f"{index}: unreadable or has no weight_map ({e})") from None
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (src / n).is_file()]
        if missing:
            raise WeightsError(f"{index} lists shard files that are missing: "
                               f"{', '.join(missing)}; download the checkpoint again")
        return [src / n for n in names]
    found = sorted(src.glob("*.safetensors"))
    if not found:
        hint = (" (it has PyTorch .bin weights: re-save them as safetensors with "
                "`model.save_pretrained(dir, safe_serialization=True)`)"
                if any(src.glob("*.bin")) else "")
        raise WeightsError(f"{src}: no *.safetensors weights found{hint}")
    return found


def open_checkpoint(src: str | Path, name: str | None = None) -> Checkpoint:
    """Open and validate a HF checkpoint folder; nothing is read beyond headers.

    Checks: config.json is a supported model (BERT or ViT); every tensor the config implies is
    present once with the right shape; no unknown encoder tensors; one spelling of the HF names
    (ViT has two); pooler weight and bias come together. `name` (default: the folder's name)
    becomes config.name.
    """
    src = Path(src)
    if not src.is_dir():
        raise WeightsError(f"{src}: no such checkpoint folder (expected config.json + *.safetensors)")
    config = config_from_json(src / "config.json", name=name or src.name)
    fam = layout.of(config.model_type)
    files = [SafetensorsFile(p) for p in safetensors_files(src)]
    found: dict[str, SourceTensor] = {}
    skipped: list[str] = []
    errors: list[str] = []
    spellings: dict[str, str] = {}  # spelling of per-layer names -> first key spelt so
    for f in files:
        for key in f.entries:
            try:
                mapped = _map_key(key, fam)
            except WeightsError as e:
                errors.append(str(e))
                continue
            if mapped is None:
                skipped.append(key)
                continue
            name, transpose, spelling = mapped
            if spelling is not None:
                spellings.setdefault(spelling, key)
            if f.dtype(key) not in SOURCE_DTYPES:
                errors.append(f"{key} has dtype {f.dtype(key)}; hepti converts float checkpoints "
                              f"({', '.join(SOURCE_DTYPES)}) only")
                continue
            if name in found:
                errors.append(f"{name} comes from both {found[name].hf_key} and {key}")
                continue
            shape = f.shape(key)[::-1] if transpose else f.shape(key)
            found[name] = SourceTensor(name, key, f, transpose, shape)
    if len(spellings) > 1:
        errors.append("the per-layer tensor names mix spellings: " + "; ".join(
            f"{s} ({k}, ...)" for s, k in spellings.items()) + ". Re-save the checkpoint with "
            "one transformers version")
    spelling = next(iter(spellings), fam.hf_layers[0][0])
    pooler = "pooler.weight" in found or "pooler.bias" in found
    expected = layout.expected_shapes(config, pooler=pooler)
    missing = [n for n in expected if n not in found]
    if missing:
        errors.append(f"missing {len(missing)} tensor(s): {_hf_names(missing, fam, spelling)}")
    extra = [n for n in found if n not in expected]
    if extra:
        errors.append(f"tensors beyond config.json (num_hidden_layers="
                      f"{config.num_hidden_layers}): {', '.join(found[n].hf_key for n in extra[:8])}")
    reshaped = layout.hf_shapes(config)  # HF shape of tensors stored as a reshape of it
    for n, shape in expected.items():
        if n not in found:
            continue
        t = found[n]
        if n in reshaped:
            assert not t.transpose, n
            want, ok = reshaped[n], t.file.shape(t.hf_key) == reshaped[n]
            if ok:
                t.shape = t.view = shape
        else:
            want, ok = (shape[::-1] if t.transpose else shape), t.shape == shape
        if not ok:
            errors.append(f"{t.hf_key} has shape {list(t.file.shape(t.hf_key))}, config.json "
                          f"implies {list(want)}")
    if errors:
        for f in files:
            f.close()
        raise WeightsError(f"{src} is not a checkpoint hepti can convert:\n  " + "\n  ".join(errors))
    return Checkpoint(src, config, {n: found[n] for n in expected}, skipped, files)


def _hf_names(names: list[str], fam: layout.Layout, spelling: str, limit: int = 8) -> str:
    """Our names -> HF names (in `spelling`) for an error message, shortened after `limit`."""
    prefix, table = next((p, t) for s, p, t in fam.hf_layers if s == spelling)
    inverse = {v[0]: k for k, v in table.items()}
    inverse_other = {v[0]: k for k, v in fam.hf_other.items() if "gamma" not in k and "beta" not in k}
    shown = []
    for n in names[:limit]:
        i, local = layout.local_name(n)
        shown.append(prefix.format(i=i) + inverse[local] if i is not None else inverse_other[n])
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(shown) + more
