"""Numba kernels: arithmetic only (no I/O, no MPI).

Public API (what the model code calls):
    PackedB, pack_b(w, trans=False)                  weights packed once, at load time
    gemm(a, pb, bias, gelu, residual, out, threads)  a @ B with a fused epilogue
    matmul(a, b, out=None, threads=1)                a @ b, packing b on the fly
    ffn(x, up, up_bias, down, threads=1)             GeLU(x @ up + up_bias) @ down in one call
    layernorm(x, gamma, beta, eps, out=None)
    add_layernorm(x, bias, residual, gamma, beta, eps, out=None)
    embed_layernorm(ids, token_type, word, position, type_table, gamma, beta, eps)
    softmax_rows(x, key_mask=None, scale=1.0, out=None)
    attention(q, k, v, key_mask, n_heads, row0=0, out=None, threads=1)
    attention_qkv(qkv, key_mask, n_heads, kv=None, row0=0, threads=1)   on a fused QKV output
naive.py holds a plain numpy reference for each. config is imported first: it sets the Numba
code-generation options the kernels need before anything is compiled.
"""
from hepti.kernels import config  # noqa: F401  (first: sets up Numba before any compile)
from hepti.kernels.attention_core import attention, attention_qkv
from hepti.kernels.norm import add_layernorm, embed_layernorm, layernorm
from hepti.kernels.packed_gemm import PackedB, ffn, gemm, matmul, pack_b
from hepti.kernels.softmax import softmax_rows

__all__ = ["PackedB", "pack_b", "gemm", "ffn", "matmul", "layernorm", "add_layernorm",
           "embed_layernorm", "softmax_rows", "attention", "attention_qkv"]
