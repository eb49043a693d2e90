"""Numba kernels: arithmetic only (no I/O, no MPI).

Public API (what the model code calls):
    PackedB, pack_b(w, trans=False)                  weights packed once, at load time
    huge_empty(size)                                 float32 [size] that may sit in 2 MiB pages
    gemm(a, pb, bias, gelu, residual, out, threads)  a @ B with a fused epilogue
    matmul(a, b, out=None, threads=1)                a @ b, packing b on the fly
    ffn(x, up, up_bias, down, threads=1)             GeLU(x @ up + up_bias) @ down in one call
    layernorm(x, gamma, beta, eps, out=None)
    add_layernorm(x, bias, residual, gamma, beta, eps, out=None)
    embed_layernorm(ids, token_type, word, position, type_table, gamma, beta, eps)
    rms_norm(x, gamma, eps, out=None)                 a decoder's RMSNorm
    softmax_rows(x, key_mask=None, scale=1.0, out=None)
    attention(q, k, v, key_mask, n_heads, row0=0, out=None, threads=1)
    attention_qkv(qkv, key_mask, n_heads, kv=None, row0=0, threads=1)   on a fused QKV output
    attention_block(x, wqkv, qkv_bias, key_mask, n_heads, wo, o_bias=None)   QKV GeMM,
                                                     attention and output GeMM in one call
    EncoderLayer(wqkv, qkv_bias, n_heads, wo, o_bias, ln1, up, up_bias, down, down_bias, ln2)
                                                     (x, key_mask): a BERT layer (attention_block
                                                     then ffn, each with its add+ln) in one call
    encoder_layers(layers, x, key_mask)              EncoderLayers in a row, up to 8 a call
int8 weights, one float32 scale per group of 64 along the stored rows (int8.py):
    QuantMatrix, quantize(w, group=64)               symmetric, round to nearest
    QuantB, pack_q(m, trans=False)                   int8 panels + scales, packed at load time
    gemm_q(a, qb, bias, gelu, residual, out, threads)  GeMM (M >= 2) or GeMV (M = 1)
    pack_weight, gemm_any, ffn_any                   the same calls for float32 or int8 weights
    columns_any(w, idx)                              columns of a packed B as rows (a tied head's
                                                     embedding lookup)
CNN kernels (NHWC feature maps [N, H, W, C], PyTorch-layout weights [Cout, Cin/groups, kh, kw]):
    ConvWeight, pack_conv_weight(w, groups=1)        conv weights packed once, at load time
    conv2d(x, w, bias, stride, padding, dilation, groups, relu, residual, out, threads)
                                                     act(conv + bias + residual), any groups
    ConvLayer(w, bias, stride, dilation, relu)(x, padding, residual, out, threads)
                                                     conv2d with its weight checked once and its
                                                     plan kept per input shape (a network's)
    depthwise_conv2d(x, w, bias, stride, padding, dilation, relu, residual, out, threads)
    max_pool2d / avg_pool2d(x, kernel_size, stride=None, padding=0, out=None)
    global_avg_pool(x, out=None)                     [N, H, W, C] -> [N, C]
    nchw_to_nhwc(x, out=None)                        torch's [N, C, H, W] pixels -> NHWC
    relu(x, out=None), relu6(x, out=None)            out=x works in place
    fold_batchnorm(w, b, gamma, beta, mean, var, eps)   -> (w, b) with BatchNorm folded in
naive.py holds a plain numpy reference for each. config is imported first: it sets the Numba
code-generation options the kernels need before anything is compiled. Before it, _cache drops
cached kernels compiled from sources that have changed since (Numba itself checks a kernel's
own file only, not the files it calls into).
"""
from hepti.kernels import _cache

_cache.drop_stale()  # before any kernel is loaded: cached code compiled from older imports goes
from hepti.kernels import config  # noqa: E402,F401  (first: sets up Numba before any compile)

# after config (which sets Numba up before importing it): a kernel signature several processes
# want at once is compiled by one of them, the others load it
_cache.share_compiles()
from hepti.kernels.attention_core import attention, attention_block, attention_qkv
from hepti.kernels.conv import (ConvLayer, ConvWeight, avg_pool2d, conv2d,
                                depthwise_conv2d, fold_batchnorm, global_avg_pool, max_pool2d,
                                pack_conv_weight, relu, relu6)
from hepti.kernels.encoder_layer import EncoderLayer, encoder_layers
from hepti.kernels.int8 import (QuantB, QuantMatrix, columns_any, ffn_any, gemm_any, gemm_q,
                               pack_q, pack_weight, quantize)
from hepti.kernels.layout import nchw_to_nhwc
from hepti.kernels.norm import add_layernorm, embed_layernorm, layernorm, rms_norm
from hepti.kernels.packed_gemm import PackedB, ffn, gemm, matmul, pack_b
from hepti.kernels.softmax import softmax_rows
from hepti.kernels._views import HUGE_PAGE, huge_empty

__all__ = ["PackedB", "pack_b", "gemm", "ffn", "matmul", "layernorm", "add_layernorm",
           "embed_layernorm", "rms_norm", "softmax_rows", "attention", "attention_qkv",
           "attention_block", "EncoderLayer", "encoder_layers",
           "ConvWeight", "ConvLayer", "pack_conv_weight", "conv2d", "depthwise_conv2d",
           "max_pool2d", "avg_pool2d", "global_avg_pool", "nchw_to_nhwc", "relu", "relu6",
           "fold_batchnorm",
           "QuantMatrix", "quantize", "QuantB", "pack_q", "gemm_q", "pack_weight", "gemm_any",
           "ffn_any", "columns_any", "huge_empty", "HUGE_PAGE"]
