"""The Llama decoder's stored layout, and reading a converted decoder whole (single process).

Same format as every family (sharded HDF5 + index.json, `hepti.weights.index`), same rule:
the dimension a rank slices is axis 0 of the stored tensor.

| name                       | stored shape  | orientation    | sliced by (rows)                         |
|----------------------------|---------------|----------------|------------------------------------------|
| emb.word                   | [V, C]        | as HF          | vocabulary (the tied head's rows)        |
| head.weight (untied only)  | [V, C]        | as HF          | vocabulary                               |
| final_ln.gamma             | [C]           |                | read whole                               |
| layer.{i}.ln1.gamma        | [C]           | (input_layernorm) | read whole                            |
| layer.{i}.attn.q.weight    | [H*D, C]      | [N, K] (as HF) | query heads: rows h0*D..h1*D             |
| layer.{i}.attn.k.weight    | [KV*D, C]     | [N, K] (as HF) | KV heads: rows kv0*D..kv1*D              |
| layer.{i}.attn.v.weight    | [KV*D, C]     | [N, K] (as HF) | KV heads                                 |
| layer.{i}.attn.o.weight    | [H*D, C]      | [K, N] (HF.T)  | query heads (block-wise: input rows)     |
| layer.{i}.ln2.gamma        | [C]           | (post_attention_layernorm) | read whole                   |
| layer.{i}.ffn.gate.weight  | [F, C]        | [N, K] (as HF) | MLP columns f0..f1                       |
| layer.{i}.ffn.up.weight    | [F, C]        | [N, K] (as HF) | MLP columns                              |
| layer.{i}.ffn.down.weight  | [F, C]        | [K, N] (HF.T)  | MLP columns (block-wise: input rows)     |

q and k are in Hugging Face's row order (half-split RoPE), not GGUF's permuted one.

int8 (`hepti convert --dtype int8`, `int8_tensors`): every matrix above (the seven per layer
and the embedding, which is the tied head) is int8 [R, C] plus float32 scales [R, C / 64]
(down: [R, C / 32]) (`hepti.kernels.int8`) unless `--keep-float32` names it (`int8_tensors`
says why), groups along axis 1, C, the hidden size: the axis no rank slices, since every
split in the table is of rows (heads' rows of q/k/v, MLP columns of gate/up, o and down
by their K rows, vocabulary rows). So a rank's rows keep whole groups at any uneven share; for
q/k/v, gate, up and the head that is along K (as llama.cpp's Q8_0), for o and down along N.
The embedding is quantised too although a lookup reads a few rows: it *is* the LM head, the
largest matrix (V x C, 113 MB float32 for SmolLM2, a fifth of the model), and decode reads all
of it every token; a lookup widens only the rows it reads (`LlamaModel.embed`). The norms stay
float32.

Chunks: a head's D rows for attention matrices, `layout.FFN_ROWS_PER_CHUNK` rows for MLP
matrices, about `layout.WHOLE_CHUNK_BYTES` for the embedding, 1-D tensors whole.

The tokenizer is stored beside the shards as tokenizer.json, and the chat template, BOS/EOS
tokens in tokenizer_config.json (Hugging Face's file names).

The family registry (hepti.families) knows model_type "llama", so `WeightStore` and `hepti
verify` read these folders; `load_decoder` reads one whole, checking each shard's size and every
tensor's shape against the config.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

import h5py
import numpy as np
from tokenizers import Tokenizer

from hepti.errors import ConfigError, WeightsError
from hepti.families import family
from hepti.kernels.int8 import GROUP, QuantMatrix
from hepti.model.llama import LAYER_TENSORS, LlamaConfig, Shard
from hepti.resources import glibc
from hepti.resources import trim_heap as _trim
from hepti.weights import layout
from hepti.weights.index import INDEX_NAME, load_index

DOWN_GROUP = 32  # int8 group of the MLP's down matrices (`int8_tensors` says why)
HEAD_ROWS = ("attn.q.weight", "attn.k.weight", "attn.v.weight", "attn.o.weight")
FFN_ROWS = ("ffn.gate.weight", "ffn.up.weight", "ffn.down.weight")


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every stored tensor -> its shape, in file order."""
    c = config
    C, D, F = c.hidden_size, c.head_dim, c.intermediate_size
    H, KV = c.num_attention_heads, c.num_key_value_heads
    shapes = {"emb.word": (c.vocab_size, C), "final_ln.gamma": (C,)}
    if not c.tie_word_embeddings:
        shapes["head.weight"] = (c.vocab_size, C)
    per = {"ln1.gamma": (C,), "attn.q.weight": (H * D, C), "attn.k.weight": (KV * D, C),
           "attn.v.weight": (KV * D, C), "attn.o.weight": (H * D, C), "ln2.gamma": (C,),
           "ffn.gate.weight": (F, C), "ffn.up.weight": (F, C), "ffn.down.weight": (F, C)}
    assert tuple(per) == LAYER_TENSORS
    for i in range(c.num_hidden_layers):
        shapes.update({layout.layer_name(i, k): s for k, s in per.items()})
    return shapes


def int8_tensors(config: LlamaConfig, keep_float32: Iterable[str] = ()) -> dict[str, int]:
    """The stored names `--dtype int8` makes int8, each with its group size: every matrix
    (module docstring) but those named in `keep_float32` (`hepti convert --keep-float32`),
    which stay float32 beside them; `down` in groups of DOWN_GROUP, the rest of GROUP.

    Why: `down`'s input, silu(gate) * up, is heavy-tailed (a channel's peak is 35-840x the
    input's RMS), and channel f's value multiplies row f of `down` (stored [F, C], groups along
    C), so that row's int8 rounding reaches the output as much larger. Finer groups shrink it
    for 1/16 more of `down`'s bytes (its GeMV folds a row's scale into x either way: no extra
    work); at the few layers with *massive activations* (SmolLM2's 11 and 28, ~800x) only float32
    removes it. SmolLM2's top-1 agreement with float32 (issue 46) is lost there, not in the
    head: docs/generate.md."""
    matrices = [n for n, shape in expected_shapes(config).items() if len(shape) == 2]
    keep = set(keep_float32)
    unknown = sorted(keep - set(matrices))
    if unknown:
        raise WeightsError(f"--keep-float32: {', '.join(unknown)} is not a matrix of this "
                           f"{config.num_hidden_layers}-layer model; give stored names such as "
                           f"layer.0.ffn.down.weight or emb.word (index.json lists them)")
    return {n: DOWN_GROUP if n.endswith(".ffn.down.weight") else GROUP
            for n in matrices if n not in keep}


def chunk_rows(name: str, shape: tuple[int, ...], config: LlamaConfig) -> int:
    """Rows per HDF5 chunk (the rule in the module docstring)."""
    rows = int(shape[0])
    if len(shape) == 1:
        return max(rows, 1)
    local = layout.local_name(name)[1]
    if local in HEAD_ROWS:
        return min(config.head_dim, rows)
    if local in FFN_ROWS:
        return min(layout.FFN_ROWS_PER_CHUNK, rows)
    row_bytes = layout.ITEMSIZE * int(np.prod(shape[1:]))
    return max(1, min(rows, layout.WHOLE_CHUNK_BYTES // max(row_bytes, 1)))


def shard_rows(name: str, shard: Shard, config: LlamaConfig) -> tuple[int, int] | None:
    """The stored rows of tensor `name` a rank holding `shard` reads (None: the whole tensor),
    by the table in the module docstring."""
    local = layout.local_name(name)[1]
    D = config.head_dim
    if local in ("attn.q.weight", "attn.o.weight"):
        h0, h1 = shard.heads(config)
        return h0 * D, h1 * D
    if local in ("attn.k.weight", "attn.v.weight"):
        return shard.kv[0] * D, shard.kv[1] * D
    if local in FFN_ROWS:
        return shard.ffn
    if local in ("emb.word", "head.weight"):
        return shard.vocab
    return None


class ShardWeights(dict):
    """A rank's stored tensors (`read_shard`) that hand the heap's freed pages back to the
    system as `LlamaModel(..., consume=True)` takes them a layer at a time: on the first `pop`
    of each layer's tensors, glibc's `malloc_trim`.

    Why: the model packs a layer and frees its stored arrays, but glibc's dynamic mmap
    threshold rises to the size of the first large array freed, so the later arrays of that
    size come from the heap, and the heap keeps their pages after they are freed. On
    emu-mixed4's rank 0 (a 627 MiB int8 share of llama-1b) the load peaked 738 MiB over the
    process's memory before it and kept 750 - 51 MiB; trimmed a layer at a time, 708 and 663
    MiB (the packed model alone is 658), in the same 15-16 s. Not trimmed, the heap's pages
    are the model's memory until the process ends."""

    _layer: str | None = None

    def pop(self, name, *default):
        layer = name.split(".", 2)[1] if name.startswith("layer.") else None
        if layer is not None and layer != self._layer:
            self._layer = layer
            trim_heap()
        return super().pop(name, *default)


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc mallopt's parameters
LOAD_MMAP_THRESHOLD = 1 << 20  # while loading: arrays from 1 MiB up are mapped on their own
MMAP_THRESHOLD_MAX = 32 << 20  # after: glibc's own ceiling (64-bit) of its dynamic threshold,
TRIM_THRESHOLD_AFTER = 2 * MMAP_THRESHOLD_MAX  # and the trim threshold glibc pairs with it


_libc = glibc  # the C library the load's calls go to (a test gives its own)


def trim_heap() -> None:
    """`hepti.resources.trim_heap` on this module's `_libc()`."""
    _trim(_libc())


class arrays_mapped:
    """A context for loading a shard: glibc maps every allocation of 1 MiB or more on its own
    (`mallopt(M_MMAP_THRESHOLD)`), so a stored array freed once its layer is packed goes back
    to the system at once, whatever the process allocated before; on leaving, the threshold
    is glibc's ceiling for its dynamic one (32 MiB), where a profile's probes had left it, and
    the heap's top is trimmed past twice that, as glibc's dynamic rule would (setting one
    threshold fixes both: left at 128 KiB, a prefill's arrays would be faulted in anew each
    call).

    Why: glibc raises its threshold to the size of each mapped array freed (up to 32 MiB); a
    process that profiled first had freed arrays of tens of MiB, so every stored array and its
    packed copy came from the heap, and a layer's freed arrays stayed in it until the next
    trim. emu-mixed4's rank 0, planned 744 MiB for a 623 MiB int8 share of llama-1b over the
    127 MiB it held after profiling, was OOM-killed holding 1042 MiB of anonymous memory (the
    kernel's report). One process loading a 627 MiB share after a 30 MiB array was freed
    peaked 748 MiB over its memory before the load; under this context (and `ShardWeights`'
    trims), 706. No-op without glibc."""

    def __enter__(self):
        libc = _libc()
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, LOAD_MMAP_THRESHOLD)
        return self

    def __exit__(self, *exc):
        libc = _libc()
        if libc is not None and hasattr(libc, "mallopt"):
            libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX)
            libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_AFTER)
        trim_heap()
        return False


def read_shard(store, shard: Shard) -> ShardWeights:
    """A rank's rows of every stored tensor (`hepti.weights.WeightStore.read`, one hyperslab
    each): what `LlamaModel(config, weights, shard=shard)` takes (as a `ShardWeights`, which
    trims the heap as the model consumes it a layer at a time). A rank reads nothing of the
    rows it does not own."""
    config = store.config
    return ShardWeights((name, store.read(name, shard_rows(name, shard, config)))
                        for name in expected_shapes(config))


def is_decoder(path: str | Path) -> bool:
    try:
        return family(load_index(path)["config"].get("model_type")).executor == "decoder"
    except (WeightsError, ConfigError):
        return False


def load_decoder(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray | QuantMatrix]]:
    """A converted decoder's config and every tensor, whole: float32 arrays, and QuantMatrix
    for the int8 matrices of an int8 folder (what `LlamaModel` takes either way)."""
    path = Path(path)
    index = load_index(path)
    config = LlamaConfig.from_dict(index["config"])
    fix = f"re-run `hepti convert` into {path}"
    for shard, info in index["shards"].items():
        p = path / shard
        if not p.is_file() or p.stat().st_size != info["bytes"]:
            raise WeightsError(f"{p}: missing or not the size {INDEX_NAME} records; {fix}")
    want = expected_shapes(config)
    missing = [n for n in want if n not in index["tensors"]]
    if missing:
        raise WeightsError(f"{path / INDEX_NAME}: tensors missing: {', '.join(missing[:4])}; {fix}")
    out: dict[str, np.ndarray] = {}
    files: dict[str, h5py.File] = {}
    try:
        for name, shape in want.items():
            shard = index["tensors"][name]["shard"]
            if shard not in files:
                files[shard] = h5py.File(path / shard, "r")
            dset = files[shard][name]
            if dset.shape != shape:
                raise WeightsError(f"{path / shard}: {name} is {list(dset.shape)}, the config "
                                   f"says {list(shape)}; {fix}")
            entry = index["tensors"][name]
            out[name] = dset[()]
            if entry.get("dtype") == layout.INT8:
                out[name] = QuantMatrix(out[name], files[shard][entry["scales"]][()],
                                        int(entry["group"]))
    except OSError as e:
        raise WeightsError(f"{path}: a shard cannot be read ({e}); {fix}") from None
    finally:
        for f in files.values():
            f.close()
    return config, out


def load_tokenizer(path: str | Path):
    """The converted decoder's tokenizer (a `tokenizers.Tokenizer`) and tokenizer_config.json
    (chat_template, bos_token, eos_token, add_bos_token); None, {} when it has none."""
    path = Path(path)
    tok, meta = None, {}
    if (path / "tokenizer.json").is_file():
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    if (path / "tokenizer_config.json").is_file():
        meta = json.loads((path / "tokenizer_config.json").read_text())
    return tok, meta
