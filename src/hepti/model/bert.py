"""The BERT family's own code: its inputs (token ids, mask, token types), its embeddings (the
primary rank's operator), and the single-device engine.

A BERT layer is not written here: hepti.graph.encoder describes it as operators, and
hepti.parallel.interpreter runs them, on one process (`BertEncoder`) or split across ranks.

Shapes: token rows of a batch are flattened, row g = b*T + t, so activations are [M, C] with
M = B*T; `key_mask` is [B, T] float32 (1 = real token, 0 = padding).
"""
from __future__ import annotations

import numpy as np

from hepti import kernels as K
from hepti.config import BertConfig
from hepti.errors import InputError
from hepti.model.batch import Batch


def validate_inputs(config: BertConfig, ids: np.ndarray, mask: np.ndarray | None,
                    token_type: np.ndarray | None):
    """Check ids/mask/token types against the model; return them as int64 / float32 arrays."""
    ids = np.asarray(ids)
    if ids.ndim != 2 or ids.shape[0] == 0 or ids.shape[1] == 0:
        raise InputError(f"ids must be a non-empty 2-D array [n, L]; got shape {ids.shape}")
    if not np.issubdtype(ids.dtype, np.integer):
        raise InputError(f"ids must be integers; got dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= config.vocab_size:
        b, t = np.argwhere((ids < 0) | (ids >= config.vocab_size))[0]
        raise InputError(f"token id {ids[b, t]} at [{b}, {t}] is outside the vocabulary "
                         f"[0, {config.vocab_size}) of this model")
    if ids.shape[1] > config.max_position_embeddings:
        raise InputError(f"inputs have {ids.shape[1]} tokens but the model has only "
                         f"{config.max_position_embeddings} positions; shorten them")
    mask = np.ones(ids.shape, np.float32) if mask is None else np.asarray(mask)
    if mask.shape != ids.shape:
        raise InputError(f"mask shape {mask.shape} differs from ids shape {ids.shape}")
    if not ((mask == 0) | (mask == 1)).all():  # np.isin's sort: ~40 us a forward
        raise InputError("mask must hold only 0 (padding) and 1 (real token)")
    if token_type is None:
        token_type = np.zeros(ids.shape, np.int64)
    else:
        token_type = np.asarray(token_type)
        if token_type.shape != ids.shape:
            raise InputError(f"token_type shape {token_type.shape} differs from ids shape "
                             f"{ids.shape}")
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

    def __call__(self, batch) -> np.ndarray:
        """A batch's ids, token_type [B, T] -> x [B*T, C] float32."""
        return K.embed_layernorm(batch.ids, batch.token_type, self.word, self.position,
                                 self.token_type, self.ln[0], self.ln[1], self.config.layer_norm_eps)


def primary_ops(config: BertConfig, store) -> dict:
    """The operators rank 0 runs alone: {"embed": fn(batch) -> x [M, C]}."""
    emb = Embeddings(config, {n: store.read(n) for n in (
        "emb.word", "emb.position", "emb.token_type", "emb.ln.gamma", "emb.ln.beta")})
    return {"embed": emb}


def load_kernels(threads: int = 1, int8: bool = False) -> None:
    """Have Numba load (or, on a cold cache, compile) every kernel a forward calls, by running
    each once on tiny random arrays with the call types the runtime uses; with `int8` (an int8
    folder) the int8 GeMM and GeMV too (`int8_kernels`).

    A kernel's first call in a process maps its compiled code: about 70 MiB of RSS for the set
    here, the same for any model. A distributed job calls this before it counts its own memory,
    so that what it reports against a plan or --mem-budget is slices, activations and buffers,
    and so that the first request does not pay for the loading either.
    """
    if int8:
        int8_kernels(threads)
    rng = np.random.default_rng(0)
    C, H, F, T = 64, 2, 64, 8  # hidden, heads (head_dim 32), FFN columns, tokens
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    qkv_w, o = K.pack_b(r(3 * C, C), trans=True), K.pack_b(r(C, C))  # both orientations
    up, down = K.pack_b(r(F, C), trans=True), K.pack_b(r(F, C))
    cfg = BertConfig(vocab_size=16, hidden_size=C, num_hidden_layers=1, num_attention_heads=H,
                     intermediate_size=F, max_position_embeddings=T)
    emb = Embeddings(cfg, {"emb.word": r(16, C), "emb.position": r(T, C),
                           "emb.token_type": r(2, C), "emb.ln.gamma": r(C), "emb.ln.beta": r(C)})
    ids = np.arange(T, dtype=np.int64).reshape(1, T)
    key_mask = np.ones((1, T), np.float32)
    x = emb(Batch(ids, key_mask, np.zeros_like(ids)))  # [T, C]
    # every row's own keys and values (`single`, `tensor`), partial sums into a caller's buffer
    qkv = K.gemm(x, qkv_w, bias=r(3 * C), threads=threads)
    ctx = K.attention_qkv(qkv, key_mask, H, threads=threads)
    part = K.gemm(ctx, o, out=np.empty_like(x), threads=threads)
    x = K.add_layernorm(part, r(C), x, r(C), r(C), cfg.layer_norm_eps)
    K.ffn(x, up, r(F), down, threads=threads, out=np.empty_like(x))
    K.ffn(x, up, r(F), down, threads=threads)
    if threads == 1:  # one process, one thread: each piece and its add+ln in one call
        x = K.attention_block(x, qkv_w, r(3 * C), key_mask, H, o, r(C), residual=x,
                              ln=(r(C), r(C), cfg.layer_norm_eps))
        x = K.ffn(x, up, r(F), down, down_bias=r(C), residual=x,
                  ln=(r(C), r(C), cfg.layer_norm_eps))
        # the two in one call (the interpreter's on a BERT layer)
        x = K.EncoderLayer(qkv_w, r(3 * C), H, o, r(C), (r(C), r(C), cfg.layer_norm_eps), up,
                           r(F), down, r(C), (r(C), r(C), cfg.layer_norm_eps))(x, key_mask)
    # `rows`: own query rows against every row's gathered keys and values
    kv = np.ascontiguousarray(qkv[:, C:])
    ctx = K.attention_qkv(np.ascontiguousarray(qkv[:4]), key_mask, H, kv=kv, row0=0, threads=threads)
    K.add_layernorm(K.gemm(ctx, o, threads=threads), r(C), x[:4], r(C), r(C), cfg.layer_norm_eps)


def int8_kernels(threads: int = 1) -> None:
    """Load the int8 GeMM (several rows) and GeMV (one row) of hepti.kernels.int8, for weights
    stored [N, K] (groups along K) and [K, N] (along N), with the epilogues the layers use. Only
    for int8 folders: a float32 folder never calls them, so it does not pay for loading them."""
    rng = np.random.default_rng(1)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    for trans in (True, False):
        w = K.pack_q(K.quantize(r(64, 64)), trans=trans)
        for rows in (8, 1):
            x = r(rows, 64)
            K.gemm_any(x, w, bias=r(64), gelu=True, threads=threads)
            K.gemm_any(x, w, residual=r(rows, 64), out=np.empty_like(x), threads=threads)
