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


def dequantize_int8(q, scales, group):
    """float64 [R, C] that int8 q [R, C] with one scale per `group` values of a row stands for."""
    idx = np.arange(q.shape[1]) // group
    return np.asarray(q, np.float64) * np.asarray(scales, np.float64)[:, idx]


def layernorm(x, gamma, beta, eps):
    """(x - mean) / sqrt(var + eps) * gamma + beta over the last axis (biased variance)."""
    x = np.asarray(x, np.float64)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def rms_norm(x, gamma, eps):
    """x / sqrt(mean(x^2) + eps) * gamma over the last axis."""
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * gamma


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


# --- CNN references (NHWC feature maps, PyTorch-layout weights) --------------------------------


def _pad4(padding):
    """(top, bottom, left, right) from an int, a pair (rows, columns) or a 4-tuple."""
    if np.isscalar(padding):
        return (int(padding),) * 4
    padding = tuple(int(p) for p in padding)
    return padding if len(padding) == 4 else (padding[0], padding[0], padding[1], padding[1])


def _two(v):
    return (int(v), int(v)) if np.isscalar(v) else tuple(int(p) for p in v)


def _windows(x, kh, kw, stride, padding, dilation, fill):
    """For x [N, H, W, C] padded with `fill`: an array [N, Ho, Wo, kh, kw, C] of the windows."""
    sh, sw = _two(stride)
    dh, dw = _two(dilation)
    pt, pb, pl, pr = _pad4(padding)
    n, h, w, c = x.shape
    xp = np.full((n, h + pt + pb, w + pl + pr, c), fill, np.float64)
    xp[:, pt:pt + h, pl:pl + w] = x
    ho = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1
    wo = (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    win = np.empty((n, ho, wo, kh, kw, c))
    for ky in range(kh):
        for kx in range(kw):
            win[:, :, :, ky, kx] = xp[:, ky * dh:ky * dh + (ho - 1) * sh + 1:sh,
                                      kx * dw:kx * dw + (wo - 1) * sw + 1:sw]
    return win


def conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, groups=1, residual=None,
           relu=None):
    """act(conv(x, w) + bias + residual) in float64: x [N, H, W, Cin], w [Cout, Cin/groups, kh,
    kw] (PyTorch's layout), output [N, Ho, Wo, Cout]; padding per side as conv.conv2d takes it.
    Depthwise is groups == Cin."""
    x = np.asarray(x, np.float64)
    w = np.asarray(w, np.float64)
    cout, cg, kh, kw = w.shape
    win = _windows(x, kh, kw, stride, padding, dilation, 0.0)  # [N, Ho, Wo, kh, kw, Cin]
    og = cout // groups
    y = np.concatenate([
        np.einsum("nhwyxc,ocyx->nhwo", win[..., g * cg:(g + 1) * cg],
                  w[g * og:(g + 1) * og])
        for g in range(groups)], axis=-1)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if residual is not None:
        y = y + np.asarray(residual, np.float64)
    if relu == "relu":
        y = np.maximum(y, 0.0)
    elif relu == "relu6":
        y = relu6(y)
    return y


def depthwise_conv2d(x, w, bias=None, stride=1, padding=0, dilation=1, residual=None,
                     relu=None):
    """conv2d with groups == C and w [C, 1, kh, kw]."""
    return conv2d(x, w, bias, stride, padding, dilation, np.shape(x)[-1], residual, relu)


def max_pool2d(x, kernel_size, stride=None, padding=0):
    """Max over each window; the padding is -inf (never wins)."""
    kh, kw = _two(kernel_size)
    win = _windows(np.asarray(x, np.float64), kh, kw,
                   kernel_size if stride is None else stride, padding, 1, -np.inf)
    return win.max(axis=(3, 4))


def avg_pool2d(x, kernel_size, stride=None, padding=0):
    """Mean over each window with the zero padding counted (count_include_pad=True)."""
    kh, kw = _two(kernel_size)
    win = _windows(np.asarray(x, np.float64), kh, kw,
                   kernel_size if stride is None else stride, padding, 1, 0.0)
    return win.sum(axis=(3, 4)) / (kh * kw)


def global_avg_pool(x):
    """[N, H, W, C] -> [N, C] mean over the pixels."""
    return np.asarray(x, np.float64).mean(axis=(1, 2))


def relu6(x):
    return np.minimum(np.maximum(np.asarray(x, np.float64), 0.0), 6.0)


def batchnorm(x, gamma, beta, mean, var, eps):
    """Inference BatchNorm over the last (channel) axis of an NHWC array."""
    x = np.asarray(x, np.float64)
    return (x - mean) / np.sqrt(np.asarray(var, np.float64) + eps) * gamma + beta
