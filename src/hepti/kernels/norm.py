"""Row LayerNorm, alone or fused with the bias + residual add that precedes it in BERT, or with
the embedding lookup and sum that precede it at the input; and a decoder's RMSNorm.

`add_layernorm` is what runs after the attention output projection and after the second MLP
GeMM, including in tensor parallelism after a Reduce_scatter of partial sums (the bias is added
once, after the sum). One pass over each row: the sum is formed while the row is written, then
variance and normalisation while the row is in L1. Statistics are float32, as in PyTorch.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from hepti.kernels._views import EMPTY, check_float32, flat_rows, output, vector
from hepti.kernels.config import FASTMATH_ROWS, JIT


@njit(inline="always", fastmath=FASTMATH_ROWS, **JIT)
def _normalise(yr, c, mean, inv_c, gamma, beta, eps):
    """yr[j] = (yr[j] - mean) / sqrt(var + eps) * gamma[j] + beta[j] over a row of c floats
    whose mean is given: the squared deviations, then the normalisation (the row in L1)."""
    sq = np.float32(0.0)
    for j in range(c):
        d = yr[j] - mean
        sq += d * d
    rstd = np.float32(1.0) / np.sqrt(sq * inv_c + eps)
    for j in range(c):
        yr[j] = (yr[j] - mean) * rstd * gamma[j] + beta[j]


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _add_layernorm(x, ldx, m, c, bias, has_bias, res, ldr, has_res, gamma, beta, eps, y, ldy):
    """y[i] = LayerNorm(x[i] (+ bias) (+ res[i])) * gamma + beta for i < m; rows of c floats.

    Three passes over a row: the sum written and added up, the squared deviations, the
    normalisation (the row stays in L1 between them)."""
    inv_c = np.float32(1.0) / np.float32(c)
    for i in range(m):
        xr = x[i * ldx:i * ldx + c]
        yr = y[i * ldy:i * ldy + c]
        total = np.float32(0.0)
        if has_res:
            rr = res[i * ldr:i * ldr + c]
            if has_bias:
                for j in range(c):
                    v = xr[j] + bias[j] + rr[j]
                    yr[j] = v
                    total += v
            else:
                for j in range(c):
                    v = xr[j] + rr[j]
                    yr[j] = v
                    total += v
        elif has_bias:
            for j in range(c):
                v = xr[j] + bias[j]
                yr[j] = v
                total += v
        else:
            for j in range(c):
                v = xr[j]
                yr[j] = v
                total += v
        _normalise(yr, c, total * inv_c, inv_c, gamma, beta, eps)


def add_layernorm(x: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None,
                  gamma: np.ndarray, beta: np.ndarray, eps: float,
                  out: np.ndarray | None = None) -> np.ndarray:
    """y = LayerNorm(x + bias + residual) over the last axis of float32 [M, C] arrays.

    bias [C] and residual [M, C] may be None. out may be x or residual (in place) or another
    [M, C] buffer; all 2-D arrays need contiguous rows only.
    """
    check_float32(x, "x", 2)
    m, c = x.shape
    y = output(out, (m, c))
    x_flat, ldx = flat_rows(x, "x")
    y_flat, ldy = flat_rows(y, "out")
    bias_v = vector(bias, "bias", c)
    gamma_v = vector(gamma, "gamma", c)
    beta_v = vector(beta, "beta", c)
    if residual is not None:
        check_float32(residual, "residual", 2)
        if residual.shape != (m, c):
            raise ValueError(f"residual must have shape {(m, c)}, got {residual.shape}")
        res_flat, ldr = flat_rows(residual, "residual")
    else:
        res_flat, ldr = EMPTY, 1
    if m and c:
        _add_layernorm(x_flat, ldx, m, c, bias_v, bias is not None, res_flat, ldr,
                       residual is not None, gamma_v, beta_v, np.float32(eps), y_flat, ldy)
    return y


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _add_ln_rows(x, bias, res, gamma, beta, eps, y):
    """_add_layernorm on C-contiguous [m, c] x, res and y (bias, res empty when absent): seven
    arguments, not fourteen; inside a forward each costs its Numba call ~1 us, cold."""
    m, c = y.shape
    _add_layernorm(x.reshape(-1), c, m, c, bias, bias.shape[0] > 0, res.reshape(-1), c,
                   res.shape[0] > 0, gamma, beta, eps, y.reshape(-1), c)


_EMPTY_ROWS = np.empty((0, 0), np.float32)


def add_layernorm_rows(x: np.ndarray, bias: np.ndarray | None, residual: np.ndarray | None,
                       gamma: np.ndarray, beta: np.ndarray, eps: float) -> np.ndarray:
    """add_layernorm(x, bias, residual, gamma, beta, eps) into a new array, for a caller (the
    interpreter) that hands it what its kernels made and the layer's own parameters: float32
    throughout, bias, gamma and beta contiguous writeable [C]. Only the shapes and the rows'
    contiguity are checked here (anything else goes to add_layernorm and its checks): inside a
    forward, with the interpreter's data out of the caches, add_layernorm's checks of every
    operand cost ~20 us a call."""
    m, c = x.shape
    if (not x.flags.c_contiguous or m == 0 or gamma.shape != (c,) or beta.shape != (c,)
            or (bias is not None and bias.shape != (c,))
            or (residual is not None
                and (residual.shape != (m, c) or not residual.flags.c_contiguous))):
        return add_layernorm(x, bias, residual, gamma, beta, eps)
    y = np.empty((m, c), np.float32)
    _add_ln_rows(x, EMPTY if bias is None else bias,
                 _EMPTY_ROWS if residual is None else residual, gamma, beta, np.float32(eps), y)
    return y


_NO_LN = (_EMPTY_ROWS, EMPTY, EMPTY, np.float32(0.0), False, False)


def ln_tail(residual: np.ndarray | None, ln: tuple | None, m: int, n: int) -> tuple:
    """The (residual, gamma, beta, eps, has_res, has_ln) tuple a GeMM kernel that ends in
    `+ residual, then LayerNorm(gamma, beta, eps)` takes (attention_block, ffn), checked: the
    residual float32 [m, n] (copied if its rows are not one C-contiguous block)."""
    if residual is None and ln is None:
        return _NO_LN
    res, has_res = _EMPTY_ROWS, residual is not None
    if has_res:
        check_float32(residual, "residual", 2)
        if residual.shape != (m, n):
            raise ValueError(f"residual must have shape {(m, n)}, got {residual.shape}")
        res = residual if residual.flags.c_contiguous else np.ascontiguousarray(residual)
    if ln is None:
        return (res, EMPTY, EMPTY, np.float32(0.0), has_res, False)
    gamma, beta, eps = ln
    return (res, vector(gamma, "gamma", n), vector(beta, "beta", n), np.float32(eps), has_res,
            True)


def layernorm(x: np.ndarray, gamma: np.ndarray, beta: np.ndarray, eps: float,
              out: np.ndarray | None = None) -> np.ndarray:
    """y = (x - mean) / sqrt(var + eps) * gamma + beta over the last axis of float32 [M, C]."""
    return add_layernorm(x, None, None, gamma, beta, eps, out=out)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _embed_layernorm(ids, types, word, position, type_table, gamma, beta, eps, y):
    """y[b*T + t] = LayerNorm(word[ids[b, t]] + position[t] + type_table[types[b, t]])."""
    n_seq, t_len = ids.shape
    c = word.shape[1]
    for b in range(n_seq):
        for t in range(t_len):
            yr = y[b * t_len + t]
            w, p, ty = word[ids[b, t]], position[t], type_table[types[b, t]]
            for j in range(c):
                yr[j] = w[j] + p[j] + ty[j]  # numpy's order: (word + position) + type
    layernorm_inplace(y, gamma, beta, eps)


@njit(fastmath=FASTMATH_ROWS, **JIT)
def layernorm_inplace(y, gamma, beta, eps):
    """y[i] = LayerNorm(y[i]) * gamma + beta for the rows of a C-contiguous [m, c] y:
    `_add_layernorm` in place, less its copy (reading and writing one array, those loops
    would not vectorise). For kernels that leave the sum to normalise in y (the embedding, a
    GeMM whose epilogue added the bias and residual)."""
    m, c = y.shape
    inv_c = np.float32(1.0) / np.float32(c)
    for i in range(m):
        yr = y[i]
        total = np.float32(0.0)
        for j in range(c):
            total += yr[j]
        _normalise(yr, c, total * inv_c, inv_c, gamma, beta, eps)


def embed_layernorm(ids: np.ndarray, token_type: np.ndarray, word: np.ndarray,
                    position: np.ndarray, type_table: np.ndarray, gamma: np.ndarray,
                    beta: np.ndarray, eps: float) -> np.ndarray:
    """x [B*T, C] = LayerNorm(word[ids] + position[:T] + type_table[token_type]), in one pass.

    ids, token_type: int64 [B, T], already checked against the tables' sizes (the caller's
    input validation); the tables float32 with contiguous rows. numpy's gathers and sums made
    three [B, T, C] temporaries: 0.13 ms of a MiniLM forward at 128 tokens, which in a
    distributed run every other rank waits out.
    """
    for name, x in (("word", word), ("position", position), ("type_table", type_table)):
        check_float32(x, name, 2)
    n_seq, t_len = ids.shape
    c = word.shape[1]
    if position.shape[1] != c or type_table.shape[1] != c or t_len > position.shape[0]:
        raise ValueError(f"embedding tables disagree: word {word.shape}, position "
                         f"{position.shape}, token type {type_table.shape}, {t_len} tokens")
    y = np.empty((n_seq * t_len, c), np.float32)
    if y.size:
        _embed_layernorm(np.ascontiguousarray(ids, np.int64), np.ascontiguousarray(token_type, np.int64),
                         word, position, type_table, vector(gamma, "gamma", c),
                         vector(beta, "beta", c), np.float32(eps), y)
    return y


@njit(fastmath=FASTMATH_ROWS, **JIT)
def _rms_norm(x, ldx, m, c, gamma, eps, y, ldy):
    """y[i] = x[i] / sqrt(mean(x[i]^2) + eps) * gamma for i < m; rows of c floats."""
    inv_c = np.float32(1.0) / np.float32(c)
    for i in range(m):
        xr = x[i * ldx:i * ldx + c]
        yr = y[i * ldy:i * ldy + c]
        sq = np.float32(0.0)
        for j in range(c):
            sq += xr[j] * xr[j]
        r = np.float32(1.0) / np.sqrt(sq * inv_c + eps)
        for j in range(c):
            yr[j] = (xr[j] * r) * gamma[j]


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float,
             out: np.ndarray | None = None) -> np.ndarray:
    """y = x / sqrt(mean(x^2) + eps) * gamma over the last axis of float32 [M, C] (Llama's
    RMSNorm; statistics in float32, as transformers' LlamaRMSNorm). One call a row block: the
    five numpy operations it replaces cost ~40 us at a decode step's one row, twice a layer."""
    check_float32(x, "x", 2)
    m, c = x.shape
    y = output(out, (m, c))
    x_flat, ldx = flat_rows(x, "x")
    y_flat, ldy = flat_rows(y, "out")
    if m and c:
        _rms_norm(x_flat, ldx, m, c, vector(gamma, "gamma", c), np.float32(eps), y_flat, ldy)
    return y
