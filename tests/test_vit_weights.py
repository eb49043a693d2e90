"""ViT weights: config, convert (both HF spellings) -> WeightStore, slices, random presets, refusals.

The stored tensors are checked against the HF tensors of tests/fixtures/vit-tiny-odd (made by
transformers, make_vit_fixture.py) under the mapping written out here by hand, not through
hepti's own map, so a wrong entry in layout's tables fails.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hepti.config import BertConfig, ViTConfig
from hepti.families import config_from_dict, config_from_json, preset_config
from hepti.errors import ConfigError, WeightsError
from hepti.weights import WeightStore, convert_checkpoint, verify, write_random
from hepti.weights import layout

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "vit-tiny-odd"
C, F, H, D, L, P = 90, 150, 5, 18, 2, 8  # hidden, FFN, heads, head dim, layers, patch
SEQ = 1 + (32 // P) ** 2                 # CLS + 16 patches
TINY_VIT = dict(model_type="vit", hidden_size=24, num_hidden_layers=2, num_attention_heads=3,
                intermediate_size=40, image_size=12, patch_size=4, num_channels=1)
# transformers 5.24's conversion_mapping["ViTModel"]: hub names -> its in-memory ViTModel names
V5_RENAMES = [(r"^encoder\.layer\.", "layers."), ("attention.attention.query", "attention.q_proj"),
              ("attention.attention.key", "attention.k_proj"),
              ("attention.attention.value", "attention.v_proj"),
              ("attention.output.dense", "attention.o_proj"), ("intermediate.dense", "mlp.fc1"),
              ("output.dense", "mlp.fc2")]


def hf_fixture() -> dict[str, np.ndarray]:
    return load_file(str(FIXTURE / "model.safetensors"))


def v5_name(key: str) -> str:
    for a, b in V5_RENAMES:
        key = re.sub(a, b, key) if a.startswith("^") else key.replace(a, b)
    return key


def expected_stored(hf: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What hepti must store for the fixture's HF (hub-spelt) tensors, written out by hand."""
    e = {"emb.patch.weight": hf["embeddings.patch_embeddings.projection.weight"].reshape(C, -1),
         "emb.patch.bias": hf["embeddings.patch_embeddings.projection.bias"],
         "emb.cls": hf["embeddings.cls_token"][0, 0],
         "emb.position": hf["embeddings.position_embeddings"][0],
         "final_ln.gamma": hf["layernorm.weight"], "final_ln.beta": hf["layernorm.bias"]}
    for i in range(L):
        p = f"encoder.layer.{i}."
        for ours, theirs in (("q", "query"), ("k", "key"), ("v", "value")):
            e[f"layer.{i}.attn.{ours}.weight"] = hf[p + f"attention.attention.{theirs}.weight"]
            e[f"layer.{i}.attn.{ours}.bias"] = hf[p + f"attention.attention.{theirs}.bias"]
        e[f"layer.{i}.attn.o.weight"] = hf[p + "attention.output.dense.weight"].T
        e[f"layer.{i}.attn.o.bias"] = hf[p + "attention.output.dense.bias"]
        e[f"layer.{i}.ffn.up.weight"] = hf[p + "intermediate.dense.weight"]
        e[f"layer.{i}.ffn.up.bias"] = hf[p + "intermediate.dense.bias"]
        e[f"layer.{i}.ffn.down.weight"] = hf[p + "output.dense.weight"].T
        e[f"layer.{i}.ffn.down.bias"] = hf[p + "output.dense.bias"]
        for ours, theirs in (("ln1", "layernorm_before"), ("ln2", "layernorm_after")):
            e[f"layer.{i}.{ours}.gamma"] = hf[p + theirs + ".weight"]
            e[f"layer.{i}.{ours}.beta"] = hf[p + theirs + ".bias"]
    return e


def read_all(model: Path) -> dict[str, np.ndarray]:
    with WeightStore(model) as store:
        return {n: store.read(n) for n in store.index["tensors"]}


def write_checkpoint(folder: Path, tensors: dict[str, np.ndarray],
                     config: dict | None = None) -> Path:
    folder.mkdir(parents=True)
    cfg = config if config is not None else json.loads((FIXTURE / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def vit_model(tmp_path_factory) -> Path:
    return convert_checkpoint(FIXTURE, tmp_path_factory.mktemp("vit") / "model", progress=False)


# --- convert the transformers-made fixture --------------------------------------------------
def test_fixture_converts_to_the_mapped_tensors(vit_model):
    hf = hf_fixture()
    want = expected_stored(hf)
    got = read_all(vit_model)
    config = ViTConfig(hidden_size=C, num_hidden_layers=L, num_attention_heads=H,
                       intermediate_size=F, image_size=32, patch_size=P)
    # file order: embeddings, final LayerNorm, layers
    assert list(got) == list(layout.expected_shapes(config, pooler=False))
    assert set(got) == set(want)
    for name, value in want.items():
        assert got[name].dtype == np.float32 and got[name].flags.c_contiguous
        np.testing.assert_array_equal(got[name], value, err_msg=name)
    assert got["emb.patch.weight"].shape == (C, 3 * P * P) and got["emb.position"].shape == (SEQ, C)
    index = json.loads((vit_model / "index.json").read_text())
    t = index["tensors"]
    assert t["layer.1.attn.o.weight"]["from"] == "encoder.layer.1.attention.output.dense.weight"
    assert t["layer.1.attn.o.weight"]["transposed"] and t["layer.1.ffn.down.weight"]["transposed"]
    assert not t["layer.1.attn.q.weight"]["transposed"] and not t["emb.patch.weight"]["transposed"]
    # chunking as for BERT: a head's rows, 16 FFN rows, 1-D tensors whole
    assert t["layer.0.attn.q.weight"]["chunk_rows"] == D == t["layer.0.attn.o.weight"]["chunk_rows"]
    assert t["layer.0.ffn.up.weight"]["chunk_rows"] == layout.FFN_ROWS_PER_CHUNK
    assert t["layer.0.ffn.down.weight"]["chunk_rows"] == layout.FFN_ROWS_PER_CHUNK
    assert t["layer.0.ln1.gamma"]["chunk_rows"] == C and t["emb.cls"]["chunk_rows"] == C
    assert sorted(index["source"]["skipped"]) == ["pooler.dense.bias", "pooler.dense.weight"]
    assert "preprocessor_config.json" in index["files"]
    assert ((vit_model / "preprocessor_config.json").read_text()
            == (FIXTURE / "preprocessor_config.json").read_text())
    assert verify(vit_model) == []


def test_patch_weight_times_a_flattened_patch_is_the_convolution(vit_model):
    """emb.patch.weight [C, ch*P*P]: patches flattened in (channel, row, col) order times its
    transpose give the stride-P convolution with HF's [C, ch, P, P] kernel."""
    conv = hf_fixture()["embeddings.patch_embeddings.projection.weight"]  # [C, 3, P, P]
    pixels = np.random.default_rng(0).standard_normal((3, 32, 32)).astype(np.float32)
    g = 32 // P
    direct = np.einsum("cyhxw,ochw->yxo", pixels.reshape(3, g, P, g, P), conv)  # [g, g, C]
    patches = pixels.reshape(3, g, P, g, P).transpose(1, 3, 0, 2, 4).reshape(g * g, -1)  # [16, 192]
    with WeightStore(vit_model) as store:
        w = store.read("emb.patch.weight")
    np.testing.assert_allclose(patches @ w.T, direct.reshape(g * g, C), rtol=1e-5, atol=1e-5)


def test_config_round_trips(vit_model):
    with WeightStore(vit_model) as store:
        cfg = store.config
    assert isinstance(cfg, ViTConfig)
    assert cfg == ViTConfig.from_json(FIXTURE / "config.json", name="vit-tiny-odd")
    assert cfg == config_from_json(FIXTURE / "config.json", name="vit-tiny-odd")
    assert config_from_dict(cfg.to_dict(), name=cfg.name) == cfg
    assert (cfg.head_dim, cfg.n_patches, cfg.seq_len) == (D, 16, SEQ)
    assert (cfg.image_size, cfg.patch_size, cfg.num_channels, cfg.qkv_bias) == (32, P, 3, True)
    assert cfg.shape == {"layers": L, "hidden": C, "heads": H, "ffn": F}


def test_read_layer_slice_gives_the_rows_of_heads_and_ffn_columns(vit_model):
    hf = hf_fixture()
    p = "encoder.layer.0."
    with WeightStore(vit_model) as store:
        part = store.read_layer_slice(0, (1, 3), (10, 60))
        before = store.bytes_read
        empty = store.read_layer_slice(0, (2, 2), (5, 5), whole=False)
        assert empty["attn.q.weight"].shape == (0, C) and "ln1.gamma" not in empty
        assert store.bytes_read == before  # empty ranges read nothing
    assert list(part) == list(layout.layer_tensors(WeightStore(vit_model).config))
    assert {"ln1.gamma", "ln1.beta", "ln2.gamma", "ln2.beta"} <= set(part)
    heads = slice(1 * D, 3 * D)  # heads 1 and 2: rows 18..54
    want = {"attn.q.weight": hf[p + "attention.attention.query.weight"][heads],
            "attn.k.bias": hf[p + "attention.attention.key.bias"][heads],
            "attn.v.weight": hf[p + "attention.attention.value.weight"][heads],
            "attn.o.weight": hf[p + "attention.output.dense.weight"][:, heads].T,
            "attn.o.bias": hf[p + "attention.output.dense.bias"],
            "ffn.up.weight": hf[p + "intermediate.dense.weight"][10:60],
            "ffn.up.bias": hf[p + "intermediate.dense.bias"][10:60],
            "ffn.down.weight": hf[p + "output.dense.weight"][:, 10:60].T,
            "ffn.down.bias": hf[p + "output.dense.bias"],
            "ln1.gamma": hf[p + "layernorm_before.weight"],
            "ln2.beta": hf[p + "layernorm_after.bias"]}
    for name, value in want.items():
        np.testing.assert_array_equal(part[name], value, err_msg=name)


def test_layout_is_the_graph_s_and_the_families_share_attention_and_ffn():
    bert = BertConfig.from_dict(dict(model_type="bert", vocab_size=10, hidden_size=C,
                                     num_hidden_layers=1, num_attention_heads=H, intermediate_size=96))
    vit = ViTConfig(hidden_size=C, num_hidden_layers=L, num_attention_heads=H, intermediate_size=96,
                    image_size=32, patch_size=P)
    bert_layer = layout.layer_tensors(bert)
    assert len(bert_layer) == 16 and "attn.ln.gamma" in bert_layer and "ln1.gamma" not in bert_layer
    assert set(layout.layer_tensors(vit)) == (set(bert_layer) - {
        "attn.ln.gamma", "attn.ln.beta", "ffn.ln.gamma", "ffn.ln.beta"}) | {
        "ln1.gamma", "ln1.beta", "ln2.gamma", "ln2.beta"}
    assert layout.embedding_tensors(vit) == ("emb.patch.weight", "emb.patch.bias", "emb.cls",
                                             "emb.position", "final_ln.gamma", "final_ln.beta")
    for cfg in (bert, vit):
        assert layout.slice_dim("attn.o.weight", cfg) == "heads"
        assert layout.slice_dim("ffn.down.weight", cfg) == "ffn"
        assert layout.slice_dim("attn.o.bias", cfg) is None
        assert layout.row_range("attn.k.bias", 1, 3, cfg) == (D, 3 * D)
        assert layout.row_range("ffn.down.weight", 10, 60, cfg) == (10, 60)
    assert layout.slice_dim("ln1.gamma", vit) is None
    with pytest.raises(ValueError, match="bert, vit"):
        layout.of("gpt2")


# --- the transformers 5.x spelling and task-model prefixes ----------------------------------
@pytest.mark.parametrize("case", ["v5", "classifier", "v5-classifier"])
def test_other_spellings_convert_to_identical_tensors(tmp_path, vit_model, case):
    hf = hf_fixture()
    if case.startswith("v5"):
        hf = {v5_name(k): v for k, v in hf.items()}
        assert "layers.0.attention.q_proj.weight" in hf and "layers.1.mlp.fc2.bias" in hf
        assert not any(k.startswith("encoder.") for k in hf)
    if case.endswith("classifier"):  # ViTForImageClassification: vit.* encoder (no pooler) + head
        hf = {"vit." + k: v for k, v in hf.items() if not k.startswith("pooler.")}
        hf["classifier.weight"] = np.ones((4, C), np.float32)
        hf["classifier.bias"] = np.zeros(4, np.float32)
    src = write_checkpoint(tmp_path / "hf", hf)
    out = convert_checkpoint(src, tmp_path / "model", progress=False)
    ref, got = read_all(vit_model), read_all(out)
    assert list(got) == list(ref)
    for name in ref:
        np.testing.assert_array_equal(got[name], ref[name], err_msg=name)
    index = json.loads((out / "index.json").read_text())
    prefix = "vit." if case.endswith("classifier") else ""
    if case.startswith("v5"):
        down = index["tensors"]["layer.1.ffn.down.weight"]
        assert down["from"] == prefix + "layers.1.mlp.fc2.weight" and down["transposed"]
    if case.endswith("classifier"):
        assert {"classifier.weight", "classifier.bias"} <= set(index["source"]["skipped"])


def test_mixed_spellings_are_refused(tmp_path):
    hf = {(v5_name(k) if k.startswith("encoder.layer.1.") else k): v
          for k, v in hf_fixture().items()}
    src = write_checkpoint(tmp_path / "hf", hf)
    with pytest.raises(WeightsError, match="mix spellings") as err:
        convert_checkpoint(src, tmp_path / "m", progress=False)
    msg = str(err.value)
    assert "transformers 5.x" in msg and "encoder.layer.0." in msg and "layers.1." in msg
    assert not (tmp_path / "m").exists()


# --- refusing bad checkpoints ---------------------------------------------------------------
def test_missing_and_misshapen_tensors_are_named(tmp_path):
    hf = hf_fixture()
    del hf["encoder.layer.1.layernorm_after.weight"]
    del hf["embeddings.patch_embeddings.projection.bias"]
    hf["embeddings.cls_token"] = hf["embeddings.cls_token"][0]                  # [1, 90]
    hf["embeddings.patch_embeddings.projection.weight"] = np.zeros((C, 3, 4, 16), np.float32)
    hf["encoder.layer.0.attention.attention.key.weight"] = np.zeros((C, 80), np.float32)
    src = write_checkpoint(tmp_path / "hf", hf)
    with pytest.raises(WeightsError) as err:
        convert_checkpoint(src, tmp_path / "m", progress=False)
    msg = str(err.value)
    assert "missing 2 tensor(s)" in msg
    assert "encoder.layer.1.layernorm_after.weight" in msg
    assert "embeddings.patch_embeddings.projection.bias" in msg
    assert "embeddings.cls_token has shape [1, 90], config.json implies [1, 1, 90]" in msg
    assert ("embeddings.patch_embeddings.projection.weight has shape [90, 3, 4, 16], config.json "
            "implies [90, 3, 8, 8]") in msg
    assert "encoder.layer.0.attention.attention.key.weight has shape [90, 80]" in msg
    assert not (tmp_path / "m").exists()


def test_missing_tensor_is_named_in_the_checkpoints_spelling(tmp_path):
    hf = {v5_name(k): v for k, v in hf_fixture().items()}
    del hf["layers.0.mlp.fc2.weight"]
    src = write_checkpoint(tmp_path / "hf", hf)
    with pytest.raises(WeightsError, match=r"missing 1 tensor\(s\): layers\.0\.mlp\.fc2\.weight"):
        convert_checkpoint(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_unknown_encoder_tensor_and_more_layers_than_the_config(tmp_path):
    hf = hf_fixture()
    hf["encoder.layer.0.attention.attention.relative_bias"] = np.zeros(C, np.float32)
    src = write_checkpoint(tmp_path / "hf", hf)
    with pytest.raises(WeightsError, match="unrecognised encoder tensor .*relative_bias.*ViTModel"):
        convert_checkpoint(src, tmp_path / "m", progress=False)
    cfg = json.loads((FIXTURE / "config.json").read_text())
    src2 = write_checkpoint(tmp_path / "hf2", hf_fixture(), dict(cfg, num_hidden_layers=1))
    with pytest.raises(WeightsError, match="tensors beyond config.json .*encoder.layer.1"):
        convert_checkpoint(src2, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


# --- config errors --------------------------------------------------------------------------
VIT_DICT = json.loads((FIXTURE / "config.json").read_text())
DROP = object()  # a change that removes the key


@pytest.mark.parametrize("change, message", [
    ({"model_type": "swin"}, "unsupported model_type 'swin'; hepti supports: bert, vit"),
    ({"model_type": DROP}, "no model_type; hepti supports: bert, vit"),
    ({"image_size": 30}, "image_size 30 is not divisible by patch_size 8"),
    ({"image_size": [32, 48]}, "image_size [32, 48] is not square"),
    ({"patch_size": 0}, "patch_size must be positive, got 0"),
    ({"num_attention_heads": 4}, "hidden_size 90 is not divisible by num_attention_heads 4"),
    ({"qkv_bias": False}, "qkv_bias False is not supported"),
    ({"hidden_act": "gelu_new"}, "unsupported hidden_act 'gelu_new'"),
    ({"hidden_size": DROP}, "lacks hidden_size"),
])
def test_bad_configs_are_refused_with_the_reason(change, message):
    d = {k: v for k, v in {**VIT_DICT, **change}.items() if v is not DROP}
    with pytest.raises(ConfigError) as err:
        config_from_dict(d)
    assert message in str(err.value)


def test_each_class_refuses_the_other_family():
    with pytest.raises(ConfigError, match="config_from_dict"):
        BertConfig.from_dict(VIT_DICT)
    with pytest.raises(ConfigError, match="config_from_dict"):
        ViTConfig.from_dict({**VIT_DICT, "model_type": "bert"})
    assert config_from_dict({**VIT_DICT, "image_size": [32, 32]}).image_size == 32


def test_unknown_model_type_checkpoint_is_refused(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(FIXTURE, src)
    (src / "config.json").write_text(json.dumps({**VIT_DICT, "model_type": "deit"}))
    with pytest.raises(ConfigError, match="unsupported model_type 'deit'; hepti supports: bert"):
        convert_checkpoint(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


# --- random presets -------------------------------------------------------------------------
@pytest.mark.parametrize("name, shape", [("vit-base", (12, 768, 12, 3072)),
                                         ("vit-large", (24, 1024, 16, 4096))])
def test_vit_presets_have_the_standard_shapes(name, shape):
    cfg = preset_config(name)
    assert isinstance(cfg, ViTConfig) and cfg.name == f"random-{name}"
    assert tuple(cfg.shape.values()) == shape
    assert (cfg.image_size, cfg.patch_size, cfg.num_channels, cfg.seq_len, cfg.head_dim) == (
        224, 16, 3, 197, 64)
    shapes = layout.expected_shapes(cfg, pooler=False)
    c, f = shape[1], shape[3]
    assert shapes["emb.patch.weight"] == (c, 3 * 16 * 16) and shapes["emb.position"] == (197, c)
    assert shapes[f"layer.{shape[0] - 1}.ffn.down.weight"] == (f, c)
    assert len(shapes) == 6 + 16 * shape[0]
    assert isinstance(preset_config("bert-base"), BertConfig)


def test_random_vit_writes_the_config_shapes(tmp_path):
    cfg = config_from_dict(TINY_VIT, name="tiny-vit")
    out = write_random(cfg, tmp_path / "a", seed=3, progress=False)
    again = write_random(cfg, tmp_path / "b", seed=3, progress=False)
    other = write_random(cfg, tmp_path / "c", seed=4, progress=False)
    with WeightStore(out) as store:
        assert store.config == cfg
        got = {n: store.shape(n) for n in store.index["tensors"]}
        part = store.read_layer_slice(1, (0, 1), (0, 16))
        gamma = store.read("final_ln.gamma")
    assert got == layout.expected_shapes(cfg, pooler=False)
    assert got["emb.patch.weight"] == (24, 16) and got["emb.position"] == (10, 24)
    assert got["emb.cls"] == (24,) and got["layer.1.ln2.beta"] == (24,)
    assert part["attn.q.weight"].shape == (8, 24) and part["ffn.down.weight"].shape == (16, 24)
    assert abs(gamma.mean() - 1) < 0.05 and abs(part["ln1.beta"].mean()) < 0.05
    a, b, c = read_all(out), read_all(again), read_all(other)
    for n in a:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
    assert not np.array_equal(a["layer.0.attn.q.weight"], c["layer.0.attn.q.weight"])
    assert verify(out) == []
