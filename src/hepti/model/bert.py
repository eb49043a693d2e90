"""The BERT-family encoder on the Numba kernels, as operations on a rank's weight slices.

A `LayerShard` is one rank's slice of one encoder layer, packed for the GeMM kernel at load time:
whole heads of Q/K/V (fused into one [C, 3*h*D] GeMM) and the matching input rows of the output
projection, a range of FFN columns of the up-projection and the matching input rows of the
down-projection, plus the small whole tensors (block-wise biases, LayerNorms). The single-device
engine is the slice that holds everything; the parallel strategies (hepti.parallel) hold less and
put their collectives between the same operations.

Shapes: token rows of a batch are flattened, row g = b*T + t, so activations are [M, C] with
M = B*T; `key_mask` is [B, T] float32 (1 = real token, 0 = padding).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hepti import kernels as K
from hepti.config import BertConfig
from hepti.errors import InputError


@dataclass
class LayerShard:
    """A rank's packed slice of encoder layer `index`: heads [h0, h1), FFN columns [f0, f1)."""

    index: int
    heads: tuple[int, int]
    ffn: tuple[int, int]
    qkv: K.PackedB | None  # [C, 3*h*D]: columns [q heads | k heads | v heads]
    qkv_bias: np.ndarray  # [3*h*D]
    o: K.PackedB | None  # [h*D, C] rows of the output projection (block-wise)
    o_bias: np.ndarray  # [C]
    ln1: tuple[np.ndarray, np.ndarray]  # attention LayerNorm gamma, beta [C]
    up: K.PackedB | None  # [C, f] columns of the FFN up-projection
    up_bias: np.ndarray  # [f]
    down: K.PackedB | None  # [f, C] rows of the FFN down-projection (block-wise)
    down_bias: np.ndarray  # [C]
    ln2: tuple[np.ndarray, np.ndarray]
    nbytes: int  # weight bytes resident for this shard (packed panels + vectors)

    @property
    def n_heads(self) -> int:
        return self.heads[1] - self.heads[0]

    @property
    def n_ffn(self) -> int:
        return self.ffn[1] - self.ffn[0]

    @classmethod
    def from_tensors(cls, index: int, t: dict[str, np.ndarray], heads: tuple[int, int],
                     ffn: tuple[int, int]) -> "LayerShard":
        """Pack a layer slice read by WeightStore.read_layer_slice (names of weights.layout)."""
        f32 = lambda a: np.ascontiguousarray(a, dtype=np.float32)  # noqa: E731
        qkv_nk = np.concatenate([t["attn.q.weight"], t["attn.k.weight"], t["attn.v.weight"]])  # [3hD, C]
        has_heads, has_ffn = heads[1] > heads[0], ffn[1] > ffn[0]
        qkv = K.pack_b(f32(qkv_nk), trans=True) if has_heads else None
        o = K.pack_b(f32(t["attn.o.weight"]), trans=False) if has_heads else None  # [hD, C]
        up = K.pack_b(f32(t["ffn.up.weight"]), trans=True) if has_ffn else None  # stored [f, C]
        down = K.pack_b(f32(t["ffn.down.weight"]), trans=False) if has_ffn else None  # [f, C]
        qkv_bias = f32(np.concatenate([t["attn.q.bias"], t["attn.k.bias"], t["attn.v.bias"]]))
        vecs = [qkv_bias, f32(t["attn.o.bias"]), f32(t["attn.ln.gamma"]), f32(t["attn.ln.beta"]),
                f32(t["ffn.up.bias"]), f32(t["ffn.down.bias"]), f32(t["ffn.ln.gamma"]),
                f32(t["ffn.ln.beta"])]
        nbytes = sum(p.nbytes for p in (qkv, o, up, down) if p is not None)
        nbytes += sum(v.nbytes for v in vecs)
        return cls(index, heads, ffn, qkv, vecs[0], o, vecs[1], (vecs[2], vecs[3]), up, vecs[4],
                   down, vecs[5], (vecs[6], vecs[7]), nbytes)

    # --- the operations the strategies compose ------------------------------------------
    def attention_partial(self, x: np.ndarray, key_mask: np.ndarray, threads: int = 1,
                          out: np.ndarray | None = None) -> np.ndarray:
        """x [M, C] (all rows) -> this shard's partial sum of the attention output [M, C]
        (out-projection of its heads only; without bias), in `out` if given. Zero heads ->
        zeros."""
        if self.qkv is None:
            return _zeros(out, x.shape)
        qkv = K.gemm(x, self.qkv, bias=self.qkv_bias, threads=threads)  # [M, 3hD]
        ctx = K.attention_qkv(qkv, key_mask, self.n_heads, threads=threads)  # [M, hD]
        return K.gemm(ctx, self.o, out=out, threads=threads)  # [M, C] partial

    def ffn_partial(self, x: np.ndarray, threads: int = 1, out: np.ndarray | None = None
                    ) -> np.ndarray:
        """x [M, C] -> this shard's partial sum of the FFN output [M, C] (without bias), in
        `out` if given."""
        if self.up is None:
            return _zeros(out, x.shape)
        return K.ffn(x, self.up, self.up_bias, self.down, threads=threads, out=out)


def _zeros(out: np.ndarray | None, shape: tuple) -> np.ndarray:
    if out is None:
        return np.zeros(shape, np.float32)
    out[...] = 0.0
    return out


def validate_inputs(config: BertConfig, ids: np.ndarray, mask: np.ndarray | None,
                    token_type: np.ndarray | None):
    """Check ids/mask/token types against the model; return them as int64 / float32 arrays."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"ids must be a non-empty 2-D array [n, L]; got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"ids must be integers; got dtype {ids.dtype}")
    bad = (ids < 0) | (ids >= config.vocab_size)
    if bad.any():
        b, t = np.argwhere(bad)[0]
        raise InputError(f"token id {ids[b, t]} at [{b}, {t}] is outside the vocabulary "
                         f"[0, {config.vocab_size}) of this model")
    if ids.shape[1] > config.max_position_embeddings:
        raise InputError(f"inputs have {ids.shape[1]} tokens but the model has only "
                         f"{config.max_position_embeddings} positions; shorten them")
    mask = np.ones(ids.shape, np.float32) if mask is None else np.asarray(mask)
    if mask.shape != ids.shape:
        raise InputError(f"mask shape {mask.shape} differs from ids shape {ids.shape}")
    if not np.isin(mask, (0, 1)).all():
        raise InputError("mask must hold only 0 (padding) and 1 (real token)")
    token_type = np.zeros(ids.shape, np.int64) if token_type is None else np.asarray(token_type)
    if token_type.shape != ids.shape:
        raise InputError(f"token_type shape {token_type.shape} differs from ids shape {ids.shape}")
    if ((token_type < 0) | (token_type >= config.type_vocab_size)).any():
        raise InputError(f"token types must be in [0, {config.type_vocab_size})")
    return ids.astype(np.int64), mask.astype(np.float32), token_type.astype(np.int64)


class Embeddings:
    """Word + position + token-type embeddings and their LayerNorm (the primary rank's job)."""

    def __init__(self, config: BertConfig, t: dict[str, np.ndarray]):
        self.config = config
        self.word, self.position, self.token_type = t["emb.word"], t["emb.position"], t["emb.token_type"]
        self.ln = (t["emb.ln.gamma"], t["emb.ln.beta"])
        self.nbytes = sum(a.nbytes for a in t.values())

    def __call__(self, ids: np.ndarray, token_type: np.ndarray) -> np.ndarray:
        """ids, token_type [B, T] -> x [B*T, C] float32."""
        return K.embed_layernorm(ids, token_type, self.word, self.position, self.token_type,
                                 self.ln[0], self.ln[1], self.config.layer_norm_eps)


class BertEncoder:
    """The single-device engine: embeddings and every layer's whole slice on one process."""

    def __init__(self, config: BertConfig, embeddings: Embeddings, layers: list[LayerShard],
                 threads: int = 1):
        self.config, self.embeddings, self.layers, self.threads = config, embeddings, layers, threads

    @classmethod
    def from_store(cls, store, threads: int = 1, progress=None) -> "BertEncoder":
        cfg = store.config
        emb = Embeddings(cfg, {n: store.read(n) for n in
                               ("emb.word", "emb.position", "emb.token_type", "emb.ln.gamma",
                                "emb.ln.beta")})
        heads, ffn = (0, cfg.num_attention_heads), (0, cfg.intermediate_size)
        layers = []
        for i in range(cfg.num_hidden_layers):
            layers.append(LayerShard.from_tensors(i, store.read_layer_slice(i, heads, ffn),
                                                  heads, ffn))
            if progress is not None:
                progress.update(1)
        return cls(cfg, emb, layers, threads)

    @property
    def layer_bytes(self) -> int:
        return sum(s.nbytes for s in self.layers)

    def layer(self, s: LayerShard, x: np.ndarray, key_mask: np.ndarray) -> np.ndarray:
        """One encoder layer on all rows: x [M, C] -> [M, C]."""
        eps = self.config.layer_norm_eps
        part = s.attention_partial(x, key_mask, self.threads)  # [M, C]
        x = K.add_layernorm(part, s.o_bias, x, s.ln1[0], s.ln1[1], eps)
        part = s.ffn_partial(x, self.threads)  # [M, C]
        return K.add_layernorm(part, s.down_bias, x, s.ln2[0], s.ln2[1], eps)

    def forward(self, ids, mask=None, token_type=None) -> np.ndarray:
        """ids [B, T] -> last hidden state [B, T, C]."""
        ids, key_mask, token_type = validate_inputs(self.config, ids, mask, token_type)
        B, T = ids.shape
        x = self.embeddings(ids, token_type)  # [M, C]
        for s in self.layers:
            x = self.layer(s, x, key_mask)
        return x.reshape(B, T, -1)


def load_kernels(threads: int = 1) -> None:
    """Have Numba load (or, on a cold cache, compile) every kernel a forward calls, by running
    each once on a tiny random one-layer model with the call types the runtime uses.

    A kernel's first call in a process maps its compiled code: about 70 MiB of RSS for the set
    here, the same for any model. A distributed job calls this before it counts its own memory,
    so that what it reports against a plan or --mem-budget is slices, activations and buffers,
    and so that the first request does not pay for the loading either.
    """
    rng = np.random.default_rng(0)
    C, H, F, T = 64, 2, 64, 8  # hidden, heads (head_dim 32), FFN columns, tokens
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    t = {"attn.q.weight": r(C, C), "attn.k.weight": r(C, C), "attn.v.weight": r(C, C),
         "attn.q.bias": r(C), "attn.k.bias": r(C), "attn.v.bias": r(C),
         "attn.o.weight": r(C, C), "attn.o.bias": r(C), "attn.ln.gamma": r(C), "attn.ln.beta": r(C),
         "ffn.up.weight": r(F, C), "ffn.up.bias": r(F), "ffn.down.weight": r(F, C),
         "ffn.down.bias": r(C), "ffn.ln.gamma": r(C), "ffn.ln.beta": r(C)}
    s = LayerShard.from_tensors(0, t, (0, H), (0, F))  # pack_b, both orientations
    cfg = BertConfig(vocab_size=16, hidden_size=C, num_hidden_layers=1, num_attention_heads=H,
                     intermediate_size=F, max_position_embeddings=T)
    emb = Embeddings(cfg, {"emb.word": r(16, C), "emb.position": r(T, C),
                           "emb.token_type": r(2, C), "emb.ln.gamma": r(C), "emb.ln.beta": r(C)})
    ids = np.arange(T, dtype=np.int64).reshape(1, T)
    key_mask = np.ones((1, T), np.float32)
    x = emb(ids, np.zeros_like(ids))  # [T, C]
    # the single-device / `tensor` layer, partial sums into a caller's buffer as well
    x = BertEncoder(cfg, emb, [s], threads).layer(s, x, key_mask)
    s.attention_partial(x, key_mask, threads, out=np.empty_like(x))
    s.ffn_partial(x, threads, out=np.empty_like(x))
    # the `rows` layer: own query rows against every row's gathered keys and values
    qkv = K.gemm(x[:4], s.qkv, bias=s.qkv_bias, threads=threads)  # [4, 3C]
    kv = np.ascontiguousarray(K.gemm(x, s.qkv, bias=s.qkv_bias, threads=threads)[:, C:])  # [T, 2C]
    ctx = K.attention_qkv(qkv, key_mask, H, kv=kv, row0=0, threads=threads)
    K.add_layernorm(K.gemm(ctx, s.o, threads=threads), s.o_bias, x[:4], *s.ln1, cfg.layer_norm_eps)
