"""The on-disk layout of converted weights: names, orientation, and how slices map to rows.

Rule: **the dimension a rank slices is axis 0 of the stored tensor**, so a rank's slice is a
contiguous range of rows and one HDF5 hyperslab read (`dset[a:b]`) fetches exactly it.

For a linear layer y = x @ W (x [M, K], W [K, N]; PyTorch stores `weight` as [N, K]):

| name                      | stored shape | orientation    | sliced by (rows of the stored array)          |
|---------------------------|--------------|----------------|-----------------------------------------------|
| layer.{i}.attn.q.weight   | [C, C]       | [N, K] (as HF) | column-wise: heads h0..h1 -> rows h0*D..h1*D  |
| layer.{i}.attn.k.weight   | [C, C]       | [N, K] (as HF) | same                                          |
| layer.{i}.attn.v.weight   | [C, C]       | [N, K] (as HF) | same                                          |
| layer.{i}.attn.o.weight   | [C, C]       | [K, N] (HF.T)  | block-wise: input rows h0*D..h1*D             |
| layer.{i}.ffn.up.weight   | [F, C]       | [N, K] (as HF) | column-wise: FFN columns f0..f1 -> rows f0..f1 |
| layer.{i}.ffn.down.weight | [F, C]       | [K, N] (HF.T)  | block-wise: input rows f0..f1                 |

Biases of column-wise layers (`attn.{q,k,v}.bias` [C], `ffn.up.bias` [F]) are sliced like the
weight's rows; biases of block-wise layers (`attn.o.bias`, `ffn.down.bias`) and the LayerNorms
(`attn.ln.{gamma,beta}`, `ffn.ln.{gamma,beta}`, [C]) are small and read whole.

Embeddings (`emb.word` [V, C], `emb.position` [P, C], `emb.token_type` [T, C],
`emb.ln.{gamma,beta}`) are read by the primary rank only. The pooler (`pooler.weight` [K, N],
`pooler.bias`) is kept when the checkpoint has it; hepti's pooling (mean/CLS) does not use it.

Chunking (`chunk_rows`): HDF5 chunks span whole rows and a small number of them (a head's D
rows for attention weights, `FFN_ROWS_PER_CHUNK` rows for FFN weights), so a slice touches only
its own chunks (plus at most one partial chunk at each end), and Fletcher32 checks exactly those.
1-D tensors (biases, LayerNorms; at most 16 KiB even in bert-large) are one chunk each: a sliced
bias is read whole, which costs less than hundreds of tiny chunks. Other matrices (embeddings,
pooler) get `WHOLE_CHUNK_BYTES`-sized chunks, small enough that reading a few embedding rows
would not pull the whole table. Every chunk is stored at full size (also the partial edge
chunk) plus a 4-byte Fletcher32 checksum, which is what `stored_chunk_bytes` counts.
"""
from __future__ import annotations

# Matrices whose rows are a rank's slice, and by which dimension ("heads" or "ffn").
COLUMN_WISE = {"attn.q.weight": "heads", "attn.k.weight": "heads", "attn.v.weight": "heads",
               "ffn.up.weight": "ffn"}
BLOCK_WISE = {"attn.o.weight": "heads", "ffn.down.weight": "ffn"}
SLICED_BIASES = {"attn.q.bias": "heads", "attn.k.bias": "heads", "attn.v.bias": "heads",
                 "ffn.up.bias": "ffn"}
WHOLE = ("attn.o.bias", "attn.ln.gamma", "attn.ln.beta", "ffn.down.bias", "ffn.ln.gamma",
         "ffn.ln.beta")
LAYER_TENSORS = tuple(COLUMN_WISE) + tuple(BLOCK_WISE) + tuple(SLICED_BIASES) + WHOLE
EMBEDDING_TENSORS = ("emb.word", "emb.position", "emb.token_type", "emb.ln.gamma", "emb.ln.beta")
FFN_ROWS_PER_CHUNK = 16
WHOLE_CHUNK_BYTES = 64 * 1024  # target chunk size of matrices that are read whole
DTYPE = "float32"              # every stored tensor
ITEMSIZE = 4
CHECKSUM_BYTES = 4             # Fletcher32 appends 4 bytes to every stored chunk


def layer_name(i: int, local: str) -> str:
    """Full dataset name of a per-layer tensor, e.g. layer_name(3, 'attn.q.weight')."""
    return f"layer.{i}.{local}"


def slice_dim(local: str) -> str | None:
    """'heads', 'ffn' or None (read whole) for a per-layer tensor's local name."""
    return {**COLUMN_WISE, **BLOCK_WISE, **SLICED_BIASES}.get(local)


def row_range(local: str, start: int, stop: int, head_dim: int) -> tuple[int, int]:
    """Rows of the stored tensor for a slice [start, stop) of heads or FFN columns."""
    dim = slice_dim(local)
    if dim == "heads":
        return start * head_dim, stop * head_dim
    if dim == "ffn":
        return start, stop
    raise KeyError(f"{local} is not sliced; read it whole")


# Hugging Face BERT name -> (our name, transpose?) ; {i} is the layer index.
HF_LAYER_MAP = {
    "attention.self.query.weight": ("attn.q.weight", False),
    "attention.self.query.bias": ("attn.q.bias", False),
    "attention.self.key.weight": ("attn.k.weight", False),
    "attention.self.key.bias": ("attn.k.bias", False),
    "attention.self.value.weight": ("attn.v.weight", False),
    "attention.self.value.bias": ("attn.v.bias", False),
    "attention.output.dense.weight": ("attn.o.weight", True),
    "attention.output.dense.bias": ("attn.o.bias", False),
    "attention.output.LayerNorm.weight": ("attn.ln.gamma", False),
    "attention.output.LayerNorm.bias": ("attn.ln.beta", False),
    "intermediate.dense.weight": ("ffn.up.weight", False),
    "intermediate.dense.bias": ("ffn.up.bias", False),
    "output.dense.weight": ("ffn.down.weight", True),
    "output.dense.bias": ("ffn.down.bias", False),
    "output.LayerNorm.weight": ("ffn.ln.gamma", False),
    "output.LayerNorm.bias": ("ffn.ln.beta", False),
}
HF_OTHER_MAP = {
    "embeddings.word_embeddings.weight": ("emb.word", False),
    "embeddings.position_embeddings.weight": ("emb.position", False),
    "embeddings.token_type_embeddings.weight": ("emb.token_type", False),
    "embeddings.LayerNorm.weight": ("emb.ln.gamma", False),
    "embeddings.LayerNorm.bias": ("emb.ln.beta", False),
    # old checkpoints name LayerNorm parameters gamma/beta
    "embeddings.LayerNorm.gamma": ("emb.ln.gamma", False),
    "embeddings.LayerNorm.beta": ("emb.ln.beta", False),
    "pooler.dense.weight": ("pooler.weight", True),
    "pooler.dense.bias": ("pooler.bias", False),
}
# Keys that carry no weights (buffers); skipped, and listed among what convert skipped.
HF_IGNORED_SUFFIXES = ("position_ids",)


def local_name(name: str) -> tuple[int | None, str]:
    """Split 'layer.3.attn.q.weight' into (3, 'attn.q.weight'); other names give (None, name)."""
    if name.startswith("layer."):
        _, i, local = name.split(".", 2)
        return int(i), local
    return None, name


def chunk_rows(name: str, shape: tuple[int, ...], head_dim: int) -> int:
    """Rows per HDF5 chunk of a stored tensor (full name), by the chunking rule above."""
    rows = int(shape[0])
    if len(shape) == 1:
        return max(rows, 1)
    _, local = local_name(name)
    dim = slice_dim(local)
    if dim == "heads":
        return min(head_dim, rows)
    if dim == "ffn":
        return min(FFN_ROWS_PER_CHUNK, rows)
    row_bytes = ITEMSIZE * _prod(shape[1:])
    return max(1, min(rows, WHOLE_CHUNK_BYTES // max(row_bytes, 1)))


def stored_chunk_bytes(shape: tuple[int, ...], rows_per_chunk: int, start: int, stop: int) -> int:
    """Bytes on disk of the chunks that rows [start, stop) touch (whole chunks + checksums)."""
    if stop <= start:
        return 0
    first, last = start // rows_per_chunk, (stop - 1) // rows_per_chunk
    chunk = rows_per_chunk * _prod(shape[1:]) * ITEMSIZE + CHECKSUM_BYTES
    return (last - first + 1) * chunk


def expected_shapes(config, pooler: bool) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> its stored shape for a BertConfig, in file order."""
    c, f = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "emb.word": (config.vocab_size, c),
        "emb.position": (config.max_position_embeddings, c),
        "emb.token_type": (config.type_vocab_size, c),
        "emb.ln.gamma": (c,),
        "emb.ln.beta": (c,),
    }
    if pooler:
        shapes["pooler.weight"] = (c, c)
        shapes["pooler.bias"] = (c,)
    per_layer = {
        "attn.q.weight": (c, c), "attn.k.weight": (c, c), "attn.v.weight": (c, c),
        "attn.o.weight": (c, c), "ffn.up.weight": (f, c), "ffn.down.weight": (f, c),
        "attn.q.bias": (c,), "attn.k.bias": (c,), "attn.v.bias": (c,), "ffn.up.bias": (f,),
        "attn.o.bias": (c,), "attn.ln.gamma": (c,), "attn.ln.beta": (c,),
        "ffn.down.bias": (c,), "ffn.ln.gamma": (c,), "ffn.ln.beta": (c,),
    }
    assert set(per_layer) == set(LAYER_TENSORS)
    for i in range(config.num_hidden_layers):
        for local in LAYER_TENSORS:
            shapes[layer_name(i, local)] = per_layer[local]
    return shapes


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n
