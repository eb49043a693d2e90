"""A post-LayerNorm encoder layer (BERT's) in one kernel call, and layers in a row in one:
    x1 = LayerNorm(attention_block(x) + o_bias + x)          (gamma1, beta1)
    y  = LayerNorm(GeLU(x1 @ up + up_bias) @ down + down_bias + x1)   (gamma2, beta2)
the same kernels in the same order as `attention_block(..., residual=x, ln=ln1)` then
`ffn(..., residual=x1, ln=ln2)`, so the same floats.

Why: inside a forward, every return from a kernel to Python and call back costs far more than
its arguments' checks say. The dispatch of a layer call takes ~2 us hot, but ~33 us right after
a layer's kernels (a no-op kernel taking the same arguments, timed there), and the kernel that
follows runs the slower for it: MiniLM's six layer calls took 0.30-0.52 ms more CPU time
inside the calls than one call doing the six (2026-11-30, 40-60 interleaved rounds, load
8-10). The wrappers' checks and the count of arrays passed are not the cost (12 arrays against
5 in one array: -0.03 ms a forward). So the interpreter hands a resident model's layers over
at once (`encoder_layers`), LAYERS_PER_CALL a call.

`EncoderLayer` holds a layer's weights checked once, as the tuple `_layers_serial` takes
(`ConvLayer`'s way), and its plan per pair of shapes; a call checks only x and the mask.
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
# layers a kernel call runs at most: its weights are a tuple of this many layers' (one compiled
# signature whatever a model's count; a call with fewer repeats the last)
LAYERS_PER_CALL = 8


@njit(fastmath=FASTMATH_GEMM, **JIT)
def _layers_serial(x, key_mask, layers, n, plan, ws):
    """y [m, c] = the first n of `layers` one after the other on x [m, c] (C-contiguous).
    layers: a tuple of LAYERS_PER_CALL layers' weights (the rest repeats: one compiled
    signature for any count of layers), each (wqkv panels, qkv_bias, wo panels, o_bias,
    gamma1, beta1, eps1, up panels, up_bias, down panels, down_bias, gamma2, beta2, eps2), a
    bias empty when absent; plan = (attention's sizes, its work items, (up's blocks, down's
    blocks), the FFN's width). The layer's body is written here, not in a function of its
    own: a cold compile then makes the GeMMs' machine code once more, not twice (3.9 s of
    CPU time, against 7.2)."""
    sizes, work, ffn_blocks, f = plan
    m, c = x.shape
    yes = np.bool_(True)  # not a literal: the callees' one compiled signature
    for i in range(n):
        wqkv, qkv_bias, wo, o_bias, gamma1, beta1, eps1, up, up_bias, down, down_bias, \
            gamma2, beta2, eps2 = layers[i]
        x1 = np.empty((m, c), np.float32)
        _block_serial(x, wqkv, qkv_bias, key_mask, wo, o_bias, x1, work, sizes, ws,
                      (x, gamma1, beta1, eps1, yes, yes))
        h = np.empty((m, f), np.float32)
        y = np.empty((m, c), np.float32)
        _ffn_serial(x1, up, up_bias, h, down, y, ffn_blocks, ws, down_bias,
                    (x1, gamma2, beta2, eps2, yes, yes))
        x = y
    return x


@functools.lru_cache(maxsize=64)
def _layer_plan(m: int, c: int, n3: int, f: int, n_seq: int, t: int, n_heads: int) -> tuple:
    """(`_layers_serial`'s plan, workspace floats) of one layer shape."""
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
        """(`_layers_serial`'s plan, workspace floats) for x and key_mask of these shapes,
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
        return encoder_layers((self,), x, key_mask)


def encoder_layers(layers, x: np.ndarray, key_mask: np.ndarray) -> np.ndarray:
    """x through `layers` (EncoderLayer, all of one shape) one after the other, as many as
    LAYERS_PER_CALL in one kernel call: layers[-1](...(layers[0](x, key_mask))...)."""
    first, n = layers[0], len(layers)
    if (type(x) is not np.ndarray or type(key_mask) is not np.ndarray
            or x.dtype is not _F32 or key_mask.dtype is not _F32
            or not (x.flags.c_contiguous and key_mask.flags.c_contiguous)):
        first._shape(x, key_mask)  # raises on what is not float32 [M, C], [B, T]
        x, key_mask = np.ascontiguousarray(x), np.ascontiguousarray(key_mask)
    got = first._shapes.get((x.shape, key_mask.shape)) or first._shape(x, key_mask)
    for layer in layers[1:]:
        if (layer.c, layer.n3, layer.f, layer.n_heads) != (first.c, first.n3, first.f,
                                                           first.n_heads):
            raise ValueError(f"encoder_layers: layers of one shape only, got [C={layer.c}, "
                             f"3C={layer.n3}, F={layer.f}, heads {layer.n_heads}] after "
                             f"[C={first.c}, 3C={first.n3}, F={first.f}, heads {first.n_heads}]")
    ws = workspace(got[1])
    for i in range(0, n, LAYERS_PER_CALL):
        group = tuple(layer.weights for layer in layers[i:i + LAYERS_PER_CALL])
        k = len(group)
        x = _layers_serial(x, key_mask, group + group[-1:] * (LAYERS_PER_CALL - k), k, got[0],
                           ws)
    return x
