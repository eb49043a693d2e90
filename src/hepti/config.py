"""Model configuration: the subset of a Hugging Face `config.json` hepti runs, validated.

Three families: BERT text encoders (`BertConfig`), ViT image encoders (`ViTConfig`) and
convolutional image classifiers (`CNNConfig`: MobileNetV2, ResNet-50, VGG-16, whose operator
graphs hepti.graph.cnn builds). `hepti.families.config_from_dict` / `config_from_json` pick the
class by the config's `model_type`; use them wherever a config of any family may turn up
(checkpoints, converted models, plans).
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Union

from hepti.errors import ConfigError

SUPPORTED_ACTS = ("gelu",)  # erf form, as BERT and ViT use


class _Encoder:
    """What every family's config has: the transformer's shape, JSON in and out."""

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_json(cls, path: str | Path, name: str = ""):
        return cls.from_dict(_read_json(path), name=name)

    def to_dict(self) -> dict:
        """HF-style dict (round-trips through from_dict)."""
        return asdict(self)

    @property
    def shape(self) -> dict:
        """What the cost of running this model depends on: plans and profiles record it."""
        return {"layers": self.num_hidden_layers, "hidden": self.hidden_size,
                "heads": self.num_attention_heads, "ffn": self.intermediate_size}


@dataclass(frozen=True)
class BertConfig(_Encoder):
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
    def max_tokens(self) -> int:
        """The most tokens an input may have (positions)."""
        return self.max_position_embeddings

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "BertConfig":
        mt = _check_model_type(d, "bert")
        act = _check_act(d)
        pet = d.get("position_embedding_type", "absolute")
        if pet != "absolute":
            raise ConfigError(f"unsupported position_embedding_type {pet!r}; only 'absolute' is")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        _check_required(d, required)
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
        _check_positive(cfg, required)
        _check_heads(cfg)
        return cfg


@dataclass(frozen=True)
class ViTConfig(_Encoder):
    """Shape and numerics of a ViT image encoder (Hugging Face ViTModel): square images of
    `image_size` pixels cut into (image_size // patch_size) ** 2 square patches, plus a CLS
    token."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    image_size: int = 224
    patch_size: int = 16
    num_channels: int = 3
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    qkv_bias: bool = True
    model_type: str = "vit"
    name: str = ""

    @property
    def n_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: the CLS token and one per patch."""
        return self.n_patches + 1

    @property
    def max_tokens(self) -> int:
        """The most tokens an input may have: every image has seq_len."""
        return self.seq_len

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "ViTConfig":
        mt = _check_model_type(d, "vit")
        act = _check_act(d)
        qkv_bias = d.get("qkv_bias", True)
        if qkv_bias is not True:
            raise ConfigError(f"qkv_bias {qkv_bias!r} is not supported: hepti's ViT layers have "
                              "query/key/value biases (qkv_bias true, as every standard ViT)")
        required = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
        _check_required(d, required)
        cfg = cls(
            hidden_size=int(d["hidden_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            intermediate_size=int(d["intermediate_size"]),
            image_size=_square(d, "image_size", 224),
            patch_size=_square(d, "patch_size", 16),
            num_channels=int(d.get("num_channels", 3)),
            layer_norm_eps=float(d.get("layer_norm_eps", 1e-12)),
            hidden_act=act,
            qkv_bias=True,
            model_type=mt,
            name=name or str(d.get("_name_or_path", "")),
        )
        _check_positive(cfg, required + ("image_size", "patch_size", "num_channels"))
        _check_heads(cfg)
        if cfg.image_size % cfg.patch_size:
            raise ConfigError(f"image_size {cfg.image_size} is not divisible by patch_size "
                              f"{cfg.patch_size}; ViT cuts the image into whole patches")
        return cfg


CNN_ARCHS = ("mobilenet_v2", "resnet50", "vgg16")


@dataclass(frozen=True)
class CNNConfig:
    """A convolutional image classifier: torchvision's `arch` (its layers are built by
    hepti.graph.cnn), every channel width divided by `width_divisor` (the tests' tiny nets:
    16), `num_classes` outputs; VGG's two hidden classifier widths are `classifier_hidden`.
    `image_size` is the side of the crop its preprocessing makes (preprocessor_config.json
    holds the rest); a height split takes any H and W."""

    arch: str
    num_classes: int = 1000
    width_divisor: int = 1
    classifier_hidden: int = 4096
    image_size: int = 224
    num_channels: int = 3
    model_type: str = "cnn"
    name: str = ""

    @property
    def seq_len(self) -> int:
        """Rows of output per image: one, its logits (hepti.runner treats an image's output as
        a sequence of one token)."""
        return 1

    @property
    def shape(self) -> dict:
        """What the cost of running this model depends on: plans and profiles record it."""
        return {"arch": self.arch, "width_divisor": self.width_divisor,
                "classes": self.num_classes, "classifier_hidden": self.classifier_hidden}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, path: str | Path, name: str = ""):
        return cls.from_dict(_read_json(path), name=name)

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "CNNConfig":
        mt = _check_model_type(d, "cnn")
        _check_required(d, ("arch",))
        if d["arch"] not in CNN_ARCHS:
            raise ConfigError(f"unsupported CNN arch {d['arch']!r}; hepti builds: "
                              f"{', '.join(CNN_ARCHS)}")
        ints = ("num_classes", "width_divisor", "classifier_hidden", "image_size", "num_channels")
        for k in ints:
            v = d.get(k, 1)
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"config {k} must be a whole number, got {v!r}")
        cfg = cls(arch=d["arch"], **{k: int(d[k]) for k in ints if k in d}, model_type=mt,
                  name=name or str(d.get("name", "")))
        _check_positive(cfg, ints)
        if cfg.num_channels != 3:
            raise ConfigError(f"num_channels {cfg.num_channels}: hepti's CNNs take RGB images (3)")
        return cfg


ModelConfig = Union[BertConfig, ViTConfig, CNNConfig]
def _read_json(path: str | Path) -> dict:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file; a model folder needs config.json") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None


def _check_model_type(d: dict, want: str) -> str:
    mt = d.get("model_type")
    if mt == want:
        return mt
    raise ConfigError(f"model_type {mt!r} is not a {want!r} config; load it with "
                      "hepti.families.config_from_dict, which picks the class by model_type")


def _check_act(d: dict) -> str:
    act = d.get("hidden_act", "gelu")
    if act not in SUPPORTED_ACTS:
        raise ConfigError(
            f"unsupported hidden_act {act!r}; hepti supports: {', '.join(SUPPORTED_ACTS)}"
        )
    return act


def _check_required(d: dict, required: tuple[str, ...]) -> None:
    missing = [k for k in required if k not in d]
    if missing:
        raise ConfigError(f"config.json lacks {', '.join(missing)}")


def _check_positive(cfg, keys: tuple[str, ...]) -> None:
    for k in keys:
        if getattr(cfg, k) <= 0:
            raise ConfigError(f"config {k} must be positive, got {getattr(cfg, k)}")


def _check_heads(cfg) -> None:
    if cfg.hidden_size % cfg.num_attention_heads:
        raise ConfigError(
            f"hidden_size {cfg.hidden_size} is not divisible by num_attention_heads "
            f"{cfg.num_attention_heads}"
        )


def _square(d: dict, key: str, default: int) -> int:
    """An int, or a [height, width] pair of equal ints (some configs spell sizes so)."""
    v = d.get(key, default)
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            raise ConfigError(f"config {key} {list(v)} is not square; hepti's ViT takes square "
                              "images and patches")
        v = v[0]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
        raise ConfigError(f"config {key} must be a whole number, got {v!r}")
    return int(v)


def model_mismatch(name: str | None, shape: dict | None,
                   config: ModelConfig) -> tuple[str | None, bool]:
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
# Entries without a model_type are BERT.
RANDOM_PRESETS = {
    "bert-base": dict(vocab_size=30522, hidden_size=768, num_hidden_layers=12,
                      num_attention_heads=12, intermediate_size=3072),
    "bert-large": dict(vocab_size=30522, hidden_size=1024, num_hidden_layers=24,
                       num_attention_heads=16, intermediate_size=4096),
    "tiny-odd": dict(vocab_size=1000, hidden_size=96, num_hidden_layers=3,
                     num_attention_heads=6, intermediate_size=200),
    "vit-base": dict(model_type="vit", hidden_size=768, num_hidden_layers=12,
                     num_attention_heads=12, intermediate_size=3072, image_size=224,
                     patch_size=16),
    "vit-large": dict(model_type="vit", hidden_size=1024, num_hidden_layers=24,
                      num_attention_heads=16, intermediate_size=4096, image_size=224,
                      patch_size=16),
    "mobilenet-v2": dict(model_type="cnn", arch="mobilenet_v2"),
    "resnet50": dict(model_type="cnn", arch="resnet50"),
    "vgg16": dict(model_type="cnn", arch="vgg16"),
    # issue 46's benchmark decoder (about 1.04 B parameters; `hepti convert --random llama-1b
    # --export-hf DIR --export-gguf FILE` also writes it for distributed-llama and llama.cpp)
    "llama-1b": dict(model_type="llama", vocab_size=32000, hidden_size=2048,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     intermediate_size=8192),
}
# What a preset leaves out, per family (HF's defaults)
PRESET_DEFAULTS = {
    "bert": dict(max_position_embeddings=512, type_vocab_size=2, layer_norm_eps=1e-12,
                 hidden_act="gelu"),
    "vit": dict(num_channels=3, layer_norm_eps=1e-12, hidden_act="gelu", qkv_bias=True),
    "cnn": dict(num_classes=1000, image_size=224),
    # Llama's and SmolLM2's defaults; ids 0-2 are the random decoders' special tokens
    # (hepti.weights.vocab: <|endoftext|>, <|im_start|>, <|im_end|>)
    "llama": dict(max_position_embeddings=2048, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=1, eos_token_id=2),
}
