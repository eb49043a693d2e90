"""Model configuration: the subset of a Hugging Face `config.json` hepti runs, validated."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from hepti.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("bert",)
SUPPORTED_ACTS = ("gelu",)  # erf form, as BERT uses


@dataclass(frozen=True)
class BertConfig:
    """Shape and numerics of a BERT-family encoder."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    model_type: str = "bert"
    name: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "BertConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"unsupported model_type {mt!r}; hepti supports: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        act = d.get("hidden_act", "gelu")
        if act not in SUPPORTED_ACTS:
            raise ConfigError(
                f"unsupported hidden_act {act!r}; hepti supports: {', '.join(SUPPORTED_ACTS)}"
            )
        pet = d.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise ConfigError(f"unsupported position_embedding_type {pet!r}; only 'absolute' is")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [k for k in required if k not in d]
        if missing:
            raise ConfigError(f"config.json lacks {', '.join(missing)}")
        cfg = cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            max_position_embeddings=int(d.get("max_position_embeddings", 512)),
            type_vocab_size=int(d.get("type_vocab_size", 2)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            pad_token_id=int(d.get("pad_token_id", 0) or 0),
            model_type=mt,
            name=name or str(d.get("_name_or_path", "")),
        )
        for k in required:
            if getattr(cfg, k) <= 0:
                raise ConfigError(f"config {k} must be positive, got {getattr(cfg, k)}")
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(
                f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
                f"{cfg.num_attention_heads}"
            )
        return cfg

    @classmethod
    def from_json(cls, path: str | Path, name: str = "") -> "BertConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file; a model folder needs config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(d, name=name)

    def to_dict(self) -> dict:
        """HF-style dict (round-trips through from_dict)."""
        return asdict(self)

    @property
    def shape(self) -> dict:
        """What the cost of running this model depends on: plans and profiles record it."""
        return {"layers": self.num_hidden_layers, "hidden": self.hidden_size,
                "heads": self.num_attention_heads, "ffn": self.intermediate_size}


def model_mismatch(name: str | None, shape: dict | None, config: BertConfig) -> tuple[str | None, bool]:
    """Compare a plan's or profile's record of its model with `config`: (what differs, or None;
    whether that makes it unusable). A different shape does; a different name with the same
    shape does not (costs depend on the shape alone), unless no shape was recorded."""
    if shape:
        diff = [f"{k} {shape.get(k)} vs {v}" for k, v in config.shape.items() if shape.get(k) != v]
        if diff:
            return (f"it was made for {name or 'a model'} ({', '.join(diff)} in this model)", True)
    if name and config.name and name != config.name:
        return (f"it was made for {name}, not {config.name}", not shape)
    return None, False


# Standard shapes for `hepti convert --random` (benchmarks need them; no pretrained weights offline).
RANDOM_PRESETS = {
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                       num_attention_heads=16, intermediate_size=4096),
    "tiny-odd": dict(vocab_size=1000, hidden_size=96, num_hidden_layers=3,
                     num_attention_heads=6, intermediate_size=200),
}


def preset_config(name: str) -> BertConfig:
    if name not in RANDOM_PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(RANDOM_PRESETS)} "
                          "or give a config.json path")
    d = dict(RANDOM_PRESETS[name], model_type="bert", max_position_embeddings=512,
             type_vocab_size=2, layer_norm_eps=1e-12, hidden_act="gelu")
    return BertConfig.from_dict(d, name=f"random-{name}")
