"""A post-LayerNorm encoder layer (BERT's) in one kernel call:
    x1 = LayerNorm(attention_block(x) + o_bias + x)          (gamma1, beta1)
    y  = LayerNorm(GeLU(x1 @ up + up_bias) @ down + down_bias + x1)   (gamma2, beta2)
the same kernels in the same order as `attention_block(..., residual=x, ln=ln1)` then
`ffn(..., residual=x1, ln=ln2)`, so the same floats.

Why one call: inside a forward, every return from a kernel to Python and call back costs far
more than its arguments' checks say. Measured 2026-11-30 (MiniLM at 128 tokens, one process,
40 interleaved rounds, thread CPU time, load 6-7): a loop of the 12 `attention_block` / `ffn`
calls ran 0.32-0.46 ms a forward under the interpreter's; the same 12 kernels called straight
from Python, wrappers and checks skipped, 0.50; one call a layer, 6 a forward, 0.76-0.80; one
call for the six layers 0.81-0.94. The wrappers' checks are not the cost: the round trip is
(the interpreter, the dispatcher and the arguments' unboxing run cold after a 2 ms kernel
that streamed megabytes of weights through the caches).

`EncoderLayer` holds a layer's weights checked once, as the tuple `_layer_serial` takes
(`ConvLayer`'s way), and the plan per token count; `__call__` checks only x and the mask.
"""
from __future__ import annotations

import functools

import numpy as np
from numba import njit

from hepti.kernels._views import check_float32, vector, workspace
from hepti.kernels.attention_core import _block_plan, _block_serial
from hepti.kernels.config import FASTMATH_GEMM, JIT
from hepti.kernels.packed_gemm import PackedB, _ffn_serial, _plan

_F32 = np.dtype(np.float32)


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _layer_serial(x, key_mask, w, plan, ws):
    """y [m, c] = the layer on x [m, c] (C-contiguous): w = (wqkv panels, qkv_bias, wo panels,
    o_bias, gamma1, beta1, eps1, up panels, up_bias, down panels, down_bias, gamma2, beta2,
    eps2), a bias empty when absent; plan = (attention's sizes, its work items, (up's blocks,
    down's blocks), the FFN's width)."""
    wqkv, qkv_bias, wo, o_bias, gamma1, beta1, eps1, up, up_bias, down, down_bias, gamma2, \
        beta2, eps2 = w
    sizes, work, ffn_blocks, f = plan
    m, c = x.shape
    yes = np.bool_(True)  # not a literal: the callees' one compiled signature
    x1 = np.empty((m, c), np.float32)
    _block_serial(x, wqkv, qkv_bias, key_mask, wo, o_bias, x1, work, sizes, ws,
                  (x, gamma1, beta1, eps1, yes, yes))
    h = np.empty((m, f), np.float32)
    y = np.empty((m, c), np.float32)
    _ffn_serial(x1, up, up_bias, h, down, y, ffn_blocks, ws, down_bias,
                (x1, gamma2, beta2, eps2, yes, yes))
    return y


@functools.lru_cache(maxsize=64)
def _layer_plan(m: int, c: int, n3: int, f: int, n_seq: int, t: int, n_heads: int) -> tuple:
    """(`_layer_serial`'s plan, workspace floats) of one layer shape."""
    sizes, work, att_ws = _block_plan(m, c, n3, c, n_seq, t, n_heads)
    _, up_blocks, up_ws = _plan(m, c, f, 1, False)
    _, down_blocks, down_ws = _plan(m, f, c, 1, False)
    return (sizes, work, (up_blocks, down_blocks), f), max(att_ws, up_ws, down_ws)


class EncoderLayer:
    """A post-LayerNorm encoder layer's weights, checked once: the attention piece
    (`attention_block`'s wqkv [C, 3*H*D] packed, qkv_bias, n_heads, wo [H*D, C] packed, o_bias)
    with ln1 = (gamma, beta, eps) after it, and the MLP (`ffn`'s up [C, F] packed, up_bias,
    down [F, C] packed, down_bias) with ln2 after it. `layer(x, key_mask)` is

        ffn(x1, up, up_bias, down, down_bias=down_bias, residual=x1, ln=ln2),
        x1 = attention_block(x, wqkv, qkv_bias, key_mask, n_heads, wo, o_bias, residual=x,
                             ln=ln1)

    on one thread, in one kernel call: a new [B*T, C] for x float32 [B*T, C], key_mask
    float32 [B, T]."""

    __slots__ = ("weights", "c", "n3", "f", "n_heads", "_shapes")

    def __init__(self, wqkv: PackedB, qkv_bias, n_heads: int, wo: PackedB, o_bias, ln1: tuple,
                 up: PackedB, up_bias, down: PackedB, down_bias, ln2: tuple):
        for name, pb in (("wqkv", wqkv), ("wo", wo), ("up", up), ("down", down)):
            if not isinstance(pb, PackedB):
                raise TypeError(f"{name} must be a PackedB from pack_b(), got "
                                f"{type(pb).__name__}")
        c, n3, f = wqkv.k, wqkv.n, up.n
        n_heads = int(n_heads)
        if (n3 == 0 or n3 % 3 or wo.k != n3 // 3 or wo.n != c or up.k != c or down.k != f
                or down.n != c):
            raise ValueError(f"cannot chain x [M, {c}] -> qkv [K={c}, N={n3}] -> wo "
                             f"[K={wo.k}, N={wo.n}] -> up [K={up.k}, N={f}] -> down "
                             f"[K={down.k}, N={down.n}]")
        if n_heads < 1 or (n3 // 3) % n_heads:
            raise ValueError(f"the qkv width {n3 // 3} is not a multiple of n_heads={n_heads}")
        (g1, b1, eps1), (g2, b2, eps2) = ln1, ln2
        self.weights = (wqkv.panels, vector(qkv_bias, "qkv_bias", n3), wo.panels,
                        vector(o_bias, "o_bias", c), vector(g1, "gamma1", c),
                        vector(b1, "beta1", c), np.float32(eps1), up.panels,
                        vector(up_bias, "up_bias", f), down.panels,
                        vector(down_bias, "down_bias", c), vector(g2, "gamma2", c),
                        vector(b2, "beta2", c), np.float32(eps2))
        self.c, self.n3, self.f, self.n_heads = c, n3, f, n_heads
        self._shapes: dict = {}  # (x's shape, key_mask's) -> `_shape`

    def _shape(self, x: np.ndarray, key_mask: np.ndarray) -> tuple:
        """(`_layer_serial`'s plan, workspace floats) for x and key_mask of these shapes,
        checked here, once per pair of shapes."""
        check_float32(x, "x", 2)
        check_float32(key_mask, "key_mask", 2)
        m, c = x.shape
        n_seq, t = key_mask.shape
        if c != self.c or m != n_seq * t or m == 0:
            raise ValueError(f"x {x.shape} and key_mask {key_mask.shape} do not fit a layer of "
                             f"width {self.c} (x must have B*T >= 1 rows)")
        if len(self._shapes) >= 64:  # batches of many sizes: start again
            self._shapes.clear()
        got = self._shapes[x.shape, key_mask.shape] = _layer_plan(m, c, self.n3, self.f, n_seq,
                                                                  t, self.n_heads)
        return got

    def __call__(self, x: np.ndarray, key_mask: np.ndarray) -> np.ndarray:
        if (type(x) is not np.ndarray or type(key_mask) is not np.ndarray
                or x.dtype is not _F32 or key_mask.dtype is not _F32):
            return self._call(x, key_mask)
        got = self._shapes.get((x.shape, key_mask.shape))
        if got is None or not (x.flags.c_contiguous and key_mask.flags.c_contiguous):
            return self._call(x, key_mask)
        return _layer_serial(x, key_mask, self.weights, got[0], workspace(got[1]))

    def _call(self, x, key_mask) -> np.ndarray:
        """`__call__` checking everything (a new shape, another type, rows not contiguous)."""
        plan, ws = self._shape(x, key_mask)
        return _layer_serial(np.ascontiguousarray(x), np.ascontiguousarray(key_mask),
                             self.weights, plan, workspace(ws))
