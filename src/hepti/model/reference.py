"""Plain-numpy BERT forward: the oracle the fast engine is tested against.

Written for obviousness, not speed: float64 accumulation, no fusion, no packing. It takes the
weights by the names of `hepti.weights.layout` (all of them, unsliced) and follows Hugging Face's
BertModel exactly: embeddings -> LayerNorm -> L x (self-attention, add & norm, GeLU FFN, add & norm).
"""
from __future__ import annotations

import numpy as np
from scipy.special import erf

from hepti.config import BertConfig


def _layernorm(x, gamma, beta, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * gamma + beta


def _gelu(x):
    return 0.5 * x * (1.0 + erf(x / np.sqrt(2.0)))


def reference_forward(weights: dict[str, np.ndarray], config: BertConfig, ids: np.ndarray,
                      mask: np.ndarray | None = None, token_type: np.ndarray | None = None
                      ) -> np.ndarray:
    """Last hidden state [B, T, C] (float32) for ids [B, T] with attention mask [B, T] (1 = real)."""
    w = {k: np.asarray(v, dtype=np.float64) for k, v in weights.items()}
    B, T = ids.shape
    C, H = config.hidden_size, config.num_attention_heads
    D = C // H
    eps = config.layer_norm_eps
    mask = np.ones((B, T)) if mask is None else np.asarray(mask, dtype=np.float64)
    token_type = np.zeros((B, T), dtype=np.int64) if token_type is None else token_type

    x = w["emb.word"][ids] + w["emb.position"][np.arange(T)][None] + w["emb.token_type"][token_type]
    x = _layernorm(x, w["emb.ln.gamma"], w["emb.ln.beta"], eps)  # (B, T, C)
    # HF: additive mask (1 - m) * finfo(float32).min on the key axis
    bias = (1.0 - mask)[:, None, None, :] * np.finfo(np.float32).min  # (B, 1, 1, T)

    for i in range(config.num_hidden_layers):
        p = f"layer.{i}."

        def proj(name, t):  # stored [N, K] (as HF): y = t @ W.T + b
            return t @ w[p + name + ".weight"].T + w[p + name + ".bias"]

        def heads(t):  # (B, T, C) -> (B, H, T, D)
            return t.reshape(B, T, H, D).transpose(0, 2, 1, 3)

        q, k, v = heads(proj("attn.q", x)), heads(proj("attn.k", x)), heads(proj("attn.v", x))
        scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D) + bias  # (B, H, T, T)
        scores -= scores.max(-1, keepdims=True)
        prob = np.exp(scores)
        prob /= prob.sum(-1, keepdims=True)
        ctx = (prob @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
        attn = ctx @ w[p + "attn.o.weight"] + w[p + "attn.o.bias"]  # o stored [K, N]
        x = _layernorm(attn + x, w[p + "attn.ln.gamma"], w[p + "attn.ln.beta"], eps)
        h = _gelu(proj("ffn.up", x))  # (B, T, F)
        out = h @ w[p + "ffn.down.weight"] + w[p + "ffn.down.bias"]  # down stored [K, N]
        x = _layernorm(out + x, w[p + "ffn.ln.gamma"], w[p + "ffn.ln.beta"], eps)
    return x.astype(np.float32)
