"""Plain numpy references for every kernel: slow, obviously correct, computed in float64.

The tests compare each fast kernel with its reference here; nothing else should import this.
Semantics follow Hugging Face BERT: GeLU is the erf form, masked scores get
(1 - mask) * float32_min added before the softmax.
"""
from __future__ import annotations

import numpy as np
from scipy.special import erf

F32_MIN = float(np.finfo(np.float32).min)


def gemm(a, b, bias=None, gelu=False, residual=None):
    """a [M, K] @ b [K, N] (+ bias) (then GeLU) (+ residual), in float64."""
    c = np.asarray(a, np.float64) @ np.asarray(b, np.float64)
    if bias is not None:
        c = c + np.asarray(bias, np.float64)
    if gelu:
        c = 0.5 * c * (1.0 + erf(c / np.sqrt(2.0)))
    if residual is not None:
        c = c + np.asarray(residual, np.float64)
    return c


def layernorm(x, gamma, beta, eps):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased variance)."""
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def add_layernorm(x, bias, residual, gamma, beta, eps):
    """LayerNorm(x + bias + residual); bias and residual may be None."""
    y = np.asarray(x, np.float64)
    if bias is not None:
        y = y + bias
    if residual is not None:
        y = y + residual
    return layernorm(y, gamma, beta, eps)


def softmax_rows(x, key_mask=None, scale=1.0):
    """softmax(x * scale + (1 - key_mask) * float32_min) along the last axis."""
    s = np.asarray(x, np.float64) * scale
    if key_mask is not None:
        s = s + (1.0 - np.asarray(key_mask, np.float64)) * F32_MIN
    s = s - s.max(axis=-1, keepdims=True)
    e = np.exp(s)
    return e / e.sum(axis=-1, keepdims=True)


def attention(q, k, v, key_mask, n_heads, row0=0):
    """ctx [Mq, H*D] for flattened query rows row0.. attending within their own sequence."""
    n_seq, t = key_mask.shape
    mq, width = q.shape
    d = width // n_heads
    ctx = np.zeros((mq, width))
    for i in range(mq):
        g = row0 + i
        b = g // t
        keys = slice(b * t, (b + 1) * t)
        for h in range(n_heads):
            cols = slice(h * d, (h + 1) * d)
            scores = np.asarray(k[keys, cols], np.float64) @ np.asarray(q[i, cols], np.float64)
            p = softmax_rows(scores[None, :], key_mask[b], scale=1.0 / np.sqrt(d))[0]
            ctx[i, cols] = p @ np.asarray(v[keys, cols], np.float64)
    return ctx
