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

ViT (model_type "vit") stores the same attention and FFN tensors under the same names, sliced
the same way; its LayerNorms come before each sublayer (pre-norm) and are named for that:
`ln1.{gamma,beta}` (HF layernorm_before) and `ln2.{gamma,beta}` (HF layernorm_after), read whole.
Not per layer: `emb.patch.weight` [C, ch*P*P] (the patch convolution's [C, ch, P, P] weight with
each filter flattened in (channel, row, col) order, so a patch flattened the same way times its
transpose is the convolution), `emb.patch.bias` [C], `emb.cls` [C], `emb.position` [S, C]
(S = patches + 1), and the final LayerNorm `final_ln.{gamma,beta}` [C]. The pooler and task
heads are not stored.

Which tensors a family stores, their shapes, and the unit that slices each are its operator
graph's weights (hepti.graph.encoder: `layer_tensors`, `expected_shapes`, `slice_dim` read
it); the tables above describe them. What stays here per family is how Hugging Face names
them (`LAYOUTS`, by the layout name a family declares in hepti.families).

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

from dataclasses import dataclass, field
from functools import lru_cache

from hepti.graph.cnn import build
from hepti import families
from hepti.errors import WeightsError
from hepti.families import family_graph

FFN_ROWS_PER_CHUNK = 16
WHOLE_CHUNK_BYTES = 64 * 1024  # target chunk size of matrices that are read whole
DTYPE = "float32"              # every stored tensor of a float32 folder
ITEMSIZE = 4
CHECKSUM_BYTES = 4             # Fletcher32 appends 4 bytes to every stored chunk
INT8 = "int8"                  # `hepti convert --dtype int8`: see `quantized_tensors`
DTYPES = (DTYPE, INT8)
SCALES_SUFFIX = ".scales"      # the float32 scales of an int8 tensor NAME: dataset NAME.scales


def layer_name(i: int, local: str) -> str:
    """Full dataset name of a per-layer tensor, e.g. layer_name(3, 'attn.q.weight')."""
    return f"layer.{i}.{local}"


@lru_cache(maxsize=32)
def _graph(config):
    """The model's operator graph (hepti.graph): which tensors a family stores, their shapes,
    and which unit slices each, come from its operators' weights."""
    return family_graph(config, 1, 1)


def _weights(ops) -> list:
    return list(dict.fromkeys(w for op in ops for w in op.weights))


def slice_dim(local: str, config) -> str | None:
    """'heads', 'ffn' or None (read whole) for a per-layer tensor's local name."""
    g = _graph(config)
    return g.weights[local].split if local in _weights(g.layer) else None


def row_range(local: str, start: int, stop: int, config) -> tuple[int, int]:
    """Rows of the stored tensor for a slice [start, stop) of heads or FFN columns: a unit is
    the stored rows over the units (a head's D rows, one FFN column's row)."""
    dim = slice_dim(local, config)
    if dim is None:
        raise KeyError(f"{local} is not sliced; read it whole")
    g = _graph(config)
    per = g.weights[local].shape[0] // g.units[dim]
    return start * per, stop * per


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

# Hugging Face ViT names, as on the hub and as transformers 4.x (and 5.x's save_pretrained) write
# them: per layer under `encoder.layer.{i}.`
VIT_HF_LAYER_MAP = {
    "attention.attention.query.weight": ("attn.q.weight", False),
    "attention.attention.query.bias": ("attn.q.bias", False),
    "attention.attention.key.weight": ("attn.k.weight", False),
    "attention.attention.key.bias": ("attn.k.bias", False),
    "attention.attention.value.weight": ("attn.v.weight", False),
    "attention.attention.value.bias": ("attn.v.bias", False),
    "attention.output.dense.weight": ("attn.o.weight", True),
    "attention.output.dense.bias": ("attn.o.bias", False),
    "intermediate.dense.weight": ("ffn.up.weight", False),
    "intermediate.dense.bias": ("ffn.up.bias", False),
    "output.dense.weight": ("ffn.down.weight", True),
    "output.dense.bias": ("ffn.down.bias", False),
    "layernorm_before.weight": ("ln1.gamma", False),
    "layernorm_before.bias": ("ln1.beta", False),
    "layernorm_after.weight": ("ln2.gamma", False),
    "layernorm_after.bias": ("ln2.beta", False),
}
# transformers 5.x's in-memory ViTModel names (its conversion_mapping "ViTModel" renames the hub
# names to these on load): per layer under `layers.{i}.`; the other names are unchanged.
VIT_HF_LAYER_MAP_V5 = {
    "attention.q_proj.weight": ("attn.q.weight", False),
    "attention.q_proj.bias": ("attn.q.bias", False),
    "attention.k_proj.weight": ("attn.k.weight", False),
    "attention.k_proj.bias": ("attn.k.bias", False),
    "attention.v_proj.weight": ("attn.v.weight", False),
    "attention.v_proj.bias": ("attn.v.bias", False),
    "attention.o_proj.weight": ("attn.o.weight", True),
    "attention.o_proj.bias": ("attn.o.bias", False),
    "mlp.fc1.weight": ("ffn.up.weight", False),
    "mlp.fc1.bias": ("ffn.up.bias", False),
    "mlp.fc2.weight": ("ffn.down.weight", True),
    "mlp.fc2.bias": ("ffn.down.bias", False),
    "layernorm_before.weight": ("ln1.gamma", False),
    "layernorm_before.bias": ("ln1.beta", False),
    "layernorm_after.weight": ("ln2.gamma", False),
    "layernorm_after.bias": ("ln2.beta", False),
}
VIT_HF_OTHER_MAP = {
    "embeddings.patch_embeddings.projection.weight": ("emb.patch.weight", False),  # reshaped
    "embeddings.patch_embeddings.projection.bias": ("emb.patch.bias", False),
    "embeddings.cls_token": ("emb.cls", False),                       # [1, 1, C] -> [C]
    "embeddings.position_embeddings": ("emb.position", False),        # [1, S, C] -> [S, C]
    "layernorm.weight": ("final_ln.gamma", False),
    "layernorm.bias": ("final_ln.beta", False),
}


@dataclass(frozen=True)
class Layout:
    """How one model family's (a config's model_type) Hugging Face checkpoints map onto the
    stored tensors; which tensors those are, their shapes and slicing, are its graph's.

    `hf_layers` lists the spellings of Hugging Face per-layer names the converter accepts, each
    as (label, layer prefix with {i}, map of names after the prefix); a checkpoint uses one.
    Keys under `hf_refused` prefixes that are not in the maps would change the arithmetic and
    are refused; `hf_skipped` keys are known and not needed (the ViT pooler, its mask token).
    `pooler`: the family may store BERT's pooler (unused by hepti's pooling).
    """

    model_type: str
    label: str     # for messages: "BERT", "ViT"
    hf_model: str  # the transformers class whose state dict the HF names are: "BertModel", ...
    hf_layers: tuple[tuple[str, str, dict], ...] = ()
    hf_other: dict = field(default_factory=dict)
    hf_model_prefix: str = ""  # stripped: the encoder inside a task model (BertForMaskedLM, ...)
    hf_refused: tuple[str, ...] = ()
    hf_skipped: tuple[str, ...] = ()
    pooler: bool = False


LAYOUTS = {  # by layout name: a family's `layout` (hepti.families)
    "bert": Layout("bert", "BERT", "BertModel",
                   hf_layers=(("BERT", "encoder.layer.{i}.", HF_LAYER_MAP),),
                   hf_other=HF_OTHER_MAP, hf_model_prefix="bert.",
                   hf_refused=("embeddings.", "encoder.", "pooler."), pooler=True),
    "vit": Layout("vit", "ViT", "ViTModel",
                  hf_layers=(("transformers 4.x / hub", "encoder.layer.{i}.", VIT_HF_LAYER_MAP),
                             ("transformers 5.x", "layers.{i}.", VIT_HF_LAYER_MAP_V5)),
                  hf_other=VIT_HF_OTHER_MAP, hf_model_prefix="vit.",
                  hf_refused=("embeddings.", "encoder.", "layers.", "layernorm."),
                  hf_skipped=("pooler.", "embeddings.mask_token")),
}


def of(model_type: str) -> Layout:
    """The Hugging Face checkpoint layout of a model family (hepti.families names it);
    ValueError for a family without one."""
    name = families.family(model_type).layout
    try:
        return LAYOUTS[name]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} has no Hugging Face checkpoint layout; "
                         f"those with one: {', '.join(LAYOUTS)}") from None


def layer_tensors(config) -> tuple[str, ...]:
    """Local names of a layer's stored tensors, in file order (the order its operators name
    them)."""
    return tuple(_weights(_graph(config).layer))


def embedding_tensors(config) -> tuple[str, ...]:
    """Stored tensors outside the layers (pooler aside), read by the primary rank only."""
    g = _graph(config)
    return tuple(_weights(g.prologue + g.epilogue))


def local_name(name: str) -> tuple[int | None, str]:
    """Split 'layer.3.attn.q.weight' into (3, 'attn.q.weight'); other names give (None, name)."""
    if name.startswith("layer."):
        _, i, local = name.split(".", 2)
        return int(i), local
    return None, name


def chunk_rows(name: str, shape: tuple[int, ...], config) -> int:
    """Rows per HDF5 chunk of a stored tensor (full name), by the chunking rule above."""
    rows = int(shape[0])
    if len(shape) == 1:
        return max(rows, 1)
    layer, local = local_name(name)
    dim = slice_dim(local, config) if layer is not None else None
    if dim == "heads":
        return min(config.head_dim, rows)
    if dim == "ffn":
        return min(FFN_ROWS_PER_CHUNK, rows)
    row_bytes = ITEMSIZE * _prod(shape[1:])
    return max(1, min(rows, WHOLE_CHUNK_BYTES // max(row_bytes, 1)))


def stored_chunk_bytes(shape: tuple[int, ...], rows_per_chunk: int, start: int, stop: int,
                       itemsize: int = ITEMSIZE) -> int:
    """Bytes on disk of the chunks that rows [start, stop) touch (whole chunks + checksums)."""
    if stop <= start:
        return 0
    first, last = start // rows_per_chunk, (stop - 1) // rows_per_chunk
    chunk = rows_per_chunk * _prod(shape[1:]) * itemsize + CHECKSUM_BYTES
    return (last - first + 1) * chunk


def quantized_tensors(config) -> tuple[str, ...]:
    """Local names of the per-layer tensors `--dtype int8` stores as int8: the matrices of the
    layer's GeMMs (attention projections, MLP). Embeddings, LayerNorms and biases stay float32:
    they are small, or (embeddings) read a few rows at a time by rank 0.

    Each is int8 [R, C] plus float32 scales [R, ceil(C / G)] (hepti.kernels.int8), groups along
    axis 1: ranks read row ranges (the rule above), so a slice keeps whole groups. That is
    along K for the column-split matrices stored [N, K] and along N for the block-split ones
    stored [K, N], whose K a rank slices by its (uneven) share.
    """
    check_dtype(INT8, config)
    return tuple(dict.fromkeys(w for op in _graph(config).layer if op.kind == "gemm"
                               for w in op.matrices))


def check_dtype(dtype: str, config) -> None:
    """Raise WeightsError unless `dtype` is one a folder of this config's family can be stored in."""
    if dtype not in DTYPES:
        raise WeightsError(f"weights dtype {dtype!r} unknown; choose one of {', '.join(DTYPES)}")
    kind = families.family(config).layout
    if dtype == INT8 and kind not in LAYOUTS:
        raise WeightsError(f"int8 weights are for the encoder families ({', '.join(LAYOUTS)}); "
                         f"a {families.family(config).label} model is stored float32: drop "
                         "--dtype int8")


def expected_shapes(config, pooler: bool) -> dict[str, tuple[int, ...]]:
    """Every stored tensor name -> its stored shape for a config, in file order: the graph's
    weights outside the layers, the pooler if stored (`pooler`: BERT's only), every layer's.
    A CNN's: its graph's (hepti.graph.cnn), BatchNorm folded into each conv.
    """
    if families.family(config).layout == "cnn":
        return build(config).weights()
    g = _graph(config)
    shapes = {n: tuple(g.weights[n].shape) for n in embedding_tensors(config)}
    if pooler and of(config.model_type).pooler:
        c = config.hidden_size
        shapes["pooler.weight"] = (c, c)
        shapes["pooler.bias"] = (c,)
    for i in range(config.num_hidden_layers):
        for local in layer_tensors(config):
            shapes[layer_name(i, local)] = tuple(g.weights[local].shape)
    return shapes


def hf_shapes(config) -> dict[str, tuple[int, ...]]:
    """Stored tensors whose Hugging Face shape is a reshape of the stored one (more than a
    transpose) -> that HF shape; the data are the same in row-major order."""
    if families.family(config).layout != "vit":
        return {}
    c, p = config.hidden_size, config.patch_size
    return {"emb.patch.weight": (c, config.num_channels, p, p), "emb.cls": (1, 1, c),
            "emb.position": (1, config.seq_len, c)}


def _prod(dims) -> int:
    n = 1
    for d in dims:
        n *= int(d)
    return n
