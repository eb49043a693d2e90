"""Exporting a converted Llama decoder for the peers: a Hugging Face folder and a GGUF file.

Issue 46 compares hepti with distributed-llama and llama.cpp on the *same* weights
(`hepti convert --random llama-1b --export-hf DIR --export-gguf FILE`):

- **Hugging Face folder** (`export_hf`): config.json (LlamaForCausalLM), model.safetensors
  (float32, HF's key names and orientation), tokenizer.json and tokenizer_config.json
  (`tokenizer_class` PreTrainedTokenizerFast). That is what distributed-llama's
  `converter/convert-hf.py` reads (it needs `hidden_act`, `rope_theta`, `rms_norm_eps` of 1e-5
  or 1e-6, and takes `lm_head.weight` from the embedding when the head is tied) and what
  `convert-tokenizer-hf.py` reads (BOS/EOS from config.json). transformers loads it too.
- **GGUF** (`export_gguf`): llama.cpp's format, F32, F16 or Q8_0, written with the `gguf`
  package's GGUFWriter, metadata as llama.cpp's converter names it, Q and K rows permuted for
  its interleaved RoPE (`permute_qk`, the inverse of `hepti.weights.gguf.unpermute_qk`), and the
  tokenizer as "gpt2" tokens, merges and token types, with the folder's pre-tokenizer name and
  chat template (from the source GGUF), so llama.cpp splits a prompt as hepti does. Q8_0 is
  quantised by the `gguf` package's own `gguf.quants.quantize` (llama.cpp's blocks of 32 with
  one scale each), from the same float32 weights hepti's int8 folder is quantised from: issue
  46 compares llama.cpp's Q8_0 with hepti's int8 on SmolLM2 that way (docs/results/llm.md).

Both stream: a tensor is read from the HDF5 shards, written and dropped before the next, so
llama-1b (4.2 GB in float32) never sits whole in memory. The safetensors file is written here
directly (8-byte header length, JSON header, raw data: the layout `hepti.weights.source` reads)
because `safetensors.numpy.save_file` wants every tensor in memory at once.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Iterator

import h5py
import numpy as np

from hepti.errors import WeightsError
from hepti.model.llama import LlamaConfig
from hepti.weights import decoder, layout
from hepti.weights.gguf import LAYER_MAP, OTHER_MAP, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER
from hepti.weights.index import load_index

# stored local name -> Hugging Face name (per layer: after "model.layers.{i}.")
HF_LAYER = {"ln1.gamma": "input_layernorm.weight", "attn.q.weight": "self_attn.q_proj.weight",
            "attn.k.weight": "self_attn.k_proj.weight", "attn.v.weight": "self_attn.v_proj.weight",
            "attn.o.weight": "self_attn.o_proj.weight",
            "ln2.gamma": "post_attention_layernorm.weight",
            "ffn.gate.weight": "mlp.gate_proj.weight", "ffn.up.weight": "mlp.up_proj.weight",
            "ffn.down.weight": "mlp.down_proj.weight"}
HF_OTHER = {"emb.word": "model.embed_tokens.weight", "final_ln.gamma": "model.norm.weight",
            "head.weight": "lm_head.weight"}
# stored name -> (GGUF name, stored transposed): hepti.weights.gguf's maps, inverted
GGUF_LAYER = {local: (g, t) for g, (local, t) in LAYER_MAP.items()}
GGUF_OTHER = {stored: (g, t) for g, (stored, t) in OTHER_MAP.items()}
# --gguf-type -> llama.cpp's file type (LLAMA_FTYPE_ALL_F32, MOSTLY_F16, MOSTLY_Q8_0); the
# tensors' type is gguf.GGMLQuantizationType[name.upper()]
GGUF_FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7}
GGUF_TYPES = tuple(GGUF_FILE_TYPE)
ALIGN = 8  # safetensors pads its header so the data starts 8-byte aligned


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF's Q/K rows -> llama.cpp's (convert_hf_to_gguf.py's `permute`): per head, rows
    j and j + D/2 become rows 2j and 2j + 1. w [n_heads * D, C]."""
    d = w.shape[0] // n_heads
    return np.ascontiguousarray(w.reshape(n_heads, 2, d // 2, *w.shape[1:]).swapaxes(1, 2)
                                .reshape(w.shape))


def check_targets(hf_dir: str | Path | None, gguf_file: str | Path | None) -> None:
    """Refuse export targets that are taken before converting (a conversion can take minutes)."""
    if hf_dir and Path(hf_dir).exists() and (not Path(hf_dir).is_dir()
                                             or any(Path(hf_dir).iterdir())):
        raise WeightsError(f"{hf_dir} exists and is not an empty folder; give a new or empty "
                           "folder for --export-hf")
    if gguf_file and Path(gguf_file).exists():
        raise WeightsError(f"{gguf_file} exists; give a new file name for --export-gguf")


def open_decoder(model_dir: str | Path) -> tuple[LlamaConfig, dict]:
    """A converted decoder's config and index (WeightsError if the folder is not one)."""
    index = load_index(model_dir)
    if index["config"].get("model_type") != "llama":
        raise WeightsError(f"{model_dir}: --export-hf and --export-gguf take a Llama decoder; "
                           f"this model is a {index['config'].get('model_type')!r}")
    return LlamaConfig.from_dict(index["config"]), index


def stored_tensors(model_dir: Path, config: LlamaConfig,
                   index: dict) -> Iterator[tuple[str, np.ndarray]]:
    """(stored name, float32 array as stored), one tensor at a time, in file order."""
    files: dict[str, h5py.File] = {}
    try:
        for name, shape in decoder.expected_shapes(config).items():
            shard = index["tensors"][name]["shard"]
            if shard not in files:
                files[shard] = h5py.File(model_dir / shard, "r")
            a = files[shard][name][()]
            if a.shape != shape:
                raise WeightsError(f"{model_dir / shard}: {name} is {list(a.shape)}, the config "
                                   f"says {list(shape)}; re-run `hepti convert`")
            yield name, a
    finally:
        for f in files.values():
            f.close()


def hf_name(stored: str) -> tuple[str, bool]:
    """(Hugging Face name, whether the stored array is HF's transposed)."""
    i, local = layout.local_name(stored)
    if i is None:
        return HF_OTHER[stored], False
    return f"model.layers.{i}.{HF_LAYER[local]}", GGUF_LAYER[local][1]


def gguf_name(stored: str) -> tuple[str, bool]:
    """(GGUF name, whether the stored array is HF's transposed)."""
    i, local = layout.local_name(stored)
    if i is None:
        return GGUF_OTHER[stored]
    g, t = GGUF_LAYER[local]
    return f"blk.{i}.{g}", t


# --- Hugging Face -------------------------------------------------------------------------------

def hf_config(config: LlamaConfig) -> dict:
    """config.json of a LlamaForCausalLM of `config`'s shape."""
    c = config
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
            "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
            "max_position_embeddings": c.max_position_embeddings, "rope_theta": c.rope_theta,
            "rms_norm_eps": c.rms_norm_eps, "tie_word_embeddings": c.tie_word_embeddings,
            "bos_token_id": c.bos_token_id, "eos_token_id": c.eos_token_id,
            "attention_bias": False, "mlp_bias": False, "torch_dtype": "float32",
            "initializer_range": 0.02, "rope_scaling": None}


def export_hf(model_dir: str | Path, out: str | Path) -> Path:
    """Write the converted decoder `model_dir` as a Hugging Face folder `out` (module docstring)."""
    model_dir, out = Path(model_dir), Path(out)
    config, index = open_decoder(model_dir)
    _check_tokenizer(model_dir)
    check_targets(out, None)
    out.mkdir(parents=True, exist_ok=True)
    shapes = decoder.expected_shapes(config)
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for stored, shape in shapes.items():
        name, transposed = hf_name(stored)
        n = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": list(shape[::-1] if transposed else shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % ALIGN)
    with open(out / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for stored, a in stored_tensors(model_dir, config, index):
            np.ascontiguousarray(a.T if hf_name(stored)[1] else a, "<f4").tofile(f)
    (out / "config.json").write_text(json.dumps(hf_config(config), indent=1) + "\n")
    (out / "tokenizer.json").write_bytes((model_dir / "tokenizer.json").read_bytes())
    meta = json.loads((model_dir / "tokenizer_config.json").read_text())
    meta.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
    (out / "tokenizer_config.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


# --- GGUF ---------------------------------------------------------------------------------------

def export_gguf(model_dir: str | Path, out: str | Path, dtype: str = "f32") -> Path:
    """Write the converted decoder `model_dir` as the GGUF file `out`, weights in `dtype`
    (f32, f16 or q8_0; norms stay f32, as llama.cpp's converter keeps 1-D tensors)."""
    import gguf  # local: an optional dependency (bin/setup installs it), asked for only here
    model_dir, out = Path(model_dir), Path(out)
    if dtype not in GGUF_TYPES:
        raise WeightsError(f"GGUF weight type {dtype!r} is not one hepti writes; choose one "
                           f"of {', '.join(GGUF_TYPES)}")
    config, index = open_decoder(model_dir)
    matrix_type = gguf.GGMLQuantizationType[dtype.upper()]
    _check_blocks(config, matrix_type, gguf.GGML_QUANT_SIZES[matrix_type][0])
    tok, meta = _check_tokenizer(model_dir)
    check_targets(None, out)
    out.parent.mkdir(parents=True, exist_ok=True)
    c, a = config, "llama"
    w = gguf.GGUFWriter(str(out), a)
    w.add_name(c.name or model_dir.name)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(float(c.rope_theta))
    w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(GGUF_FILE_TYPE[dtype])
    _add_tokenizer(w, tok, meta, config)
    shapes = decoder.expected_shapes(config)
    for stored, shape in shapes.items():
        name, transposed = gguf_name(stored)
        qtype = gguf.GGMLQuantizationType.F32 if len(shape) == 1 else matrix_type
        hf_shape = shape[::-1] if transposed else shape
        nbytes = int(np.prod(gguf.quant_shape_to_byte_shape(hf_shape, qtype)))
        w.add_tensor_info(name, hf_shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for stored, arr in stored_tensors(model_dir, config, index):
        name, transposed = gguf_name(stored)
        arr = arr.T if transposed else arr
        if name.endswith("attn_q.weight"):
            arr = permute_qk(arr, c.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            arr = permute_qk(arr, c.num_key_value_heads)
        qtype = gguf.GGMLQuantizationType.F32 if arr.ndim == 1 else matrix_type
        w.write_tensor_data(gguf.quants.quantize(np.ascontiguousarray(arr, np.float32), qtype))
    w.close()
    return out


def _check_blocks(config: LlamaConfig, qtype, block: int) -> None:
    """A block type (Q8_0: 32 values a block) needs every matrix row to hold whole blocks; the
    rows as written run along the hidden size or, for o and down, the heads' or MLP's width."""
    widths = {"hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
              "heads x head_dim": config.num_attention_heads * config.head_dim}
    odd = [f"{k} {v}" for k, v in widths.items() if v % block]
    if odd:
        raise WeightsError(f"GGUF type {qtype.name} stores rows in blocks of {block}; this "
                           f"model's {', '.join(odd)} are not multiples of {block}. Export "
                           "f32 or f16 instead (--gguf-type)")


def _add_tokenizer(w, tok: dict, meta: dict, config: LlamaConfig) -> None:
    """The tokenizer.json's byte-level BPE as GGUF's "gpt2" tokens, merges and types."""
    model = tok["model"]
    vocab = model["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    types = [TOKEN_NORMAL] * len(tokens)
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i >= len(tokens):
            raise WeightsError(f"added token {added['content']!r} (id {i}) is outside the "
                               f"vocabulary of {len(tokens)}; hepti exports BPE vocabularies "
                               "that hold every token")
        types[i] = TOKEN_CONTROL if added.get("special") else TOKEN_USER
    if len(tokens) != config.vocab_size or None in tokens:
        raise WeightsError(f"the tokenizer has {len(vocab)} tokens, the model's vocabulary "
                           f"{config.vocab_size}; the GGUF needs one token per id")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(meta.get("tokenizer_pre") or "default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if config.bos_token_id is not None:
        w.add_bos_token_id(config.bos_token_id)
    if config.eos_token_id is not None:
        w.add_eos_token_id(config.eos_token_id)
    w.add_add_bos_token(bool(meta.get("add_bos_token", False)))
    if meta.get("chat_template"):
        w.add_chat_template(meta["chat_template"])


def _check_tokenizer(model_dir: Path) -> tuple[dict, dict]:
    """The folder's tokenizer.json (a BPE) and tokenizer_config.json, parsed."""
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise WeightsError(f"{model_dir} has no tokenizer.json, which the peers need; convert "
                           "it from a GGUF or with --random (both write one)")
    tok = json.loads(path.read_text())
    if tok.get("model", {}).get("type") != "BPE":
        raise WeightsError(f"{path}: a {tok.get('model', {}).get('type')!r} tokenizer; hepti "
                           "exports byte-level BPE tokenizers only")
    cfg = model_dir / "tokenizer_config.json"
    meta = json.loads(cfg.read_text()) if cfg.is_file() else {}
    return tok, meta
