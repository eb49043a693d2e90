"""Llama-style decoder, single process: the reference forward of the decoder family (issue 46).

RMSNorm -> grouped-query attention with RoPE and a causal mask -> residual -> RMSNorm -> SwiGLU
MLP -> residual, L times; a final RMSNorm and the (tied) LM head. Prefill runs the prompt's T
tokens as rows; decode runs one token against the KV cache. Numerics follow transformers'
LlamaForCausalLM in float32 (tests/test_llama.py holds the two within 1e-3 on SmolLM2-135M).

Shapes: T new tokens, C hidden, H query heads, KV key/value heads, G = H // KV queries per KV
head, D head dim, F MLP width, V vocabulary, N tokens in the cache after this step.

Weights arrive by the names of the decoder layout (`hepti.weights.decoder`), whole, in stored
orientation: q/k/v, gate and up as [N_out, K_in] (as HF), o and down as [K_in, N_out] (HF.T),
so that a rank's share of heads or MLP columns is a range of rows of each.

RoPE is the half-split layout (HF `rotate_half`: dimension j pairs with j + D/2). GGUF files
store Q and K rows permuted for llama.cpp's interleaved RoPE; the converter undoes that
permutation (`hepti.weights.gguf.unpermute_qk`), after which half-split is what matches.

The cache (`KVCache`) holds, per layer, K and V as [KV, ctx, D]: a rank that owns KV heads
kv0..kv1 keeps `k[kv0:kv1]`, a slice of axis 0, and the query heads kv0*G .. kv1*G with it.

Kernels (`kernels=True`, the default): the six projections and the LM head run on hepti's
packed GeMM (`hepti.kernels.gemm`, weights packed once here; the residual adds are fused into
the o and down GeMMs), the attention probabilities on `hepti.kernels.softmax_rows`. Plain
numpy does the rest: RMSNorm (the kernels' norm is LayerNorm), RoPE, SiLU * up, and the two
attention products (batched matmuls over KV heads; the kernels' attention core has a key mask
but no causal one). `kernels=False` runs every product in numpy too (float32), a second path
to compare against.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import numpy as np

from hepti import kernels as K
from hepti.errors import ConfigError, InputError

F32_MIN = np.float32(np.finfo(np.float32).min)  # a masked score: exp() of it minus the max is 0


@dataclass(frozen=True)
class LlamaConfig:
    """Shape and numerics of a Llama-style decoder (HF LlamaConfig's names).

    Lives with the forward; the family registry (hepti.families) declares it as the "llama"
    family's config. The encoder commands refuse a converted decoder with a clear message
    (its executor, "decoder", is not run by `hepti run` or serve yet).
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    name: str = ""

    def __post_init__(self):
        for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "intermediate_size", "head_dim",
                  "max_position_embeddings"):
            v = getattr(self, k)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"{k} must be a positive integer, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads ({self.num_attention_heads}) must be a "
                              f"multiple of num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def group(self) -> int:
        """Query heads per KV head (G)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def shape(self) -> dict:
        return {"layers": self.num_hidden_layers, "hidden": self.hidden_size,
                "heads": self.num_attention_heads, "kv_heads": self.num_key_value_heads,
                "ffn": self.intermediate_size, "vocab": self.vocab_size}

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, name: str = "") -> "LlamaConfig":
        if d.get("model_type") != "llama":
            raise ConfigError(f"model_type {d.get('model_type')!r} is not a Llama decoder")
        known = {f.name for f in fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw.setdefault("head_dim", d["hidden_size"] // d["num_attention_heads"])
        kw.setdefault("num_key_value_heads", d["num_attention_heads"])
        if name:
            kw["name"] = name
        try:
            return cls(**kw)
        except TypeError as e:
            raise ConfigError(f"a Llama config needs {e}") from None


class KVCache:
    """Keys and values of the tokens seen so far, per layer [KV, ctx, D] (RoPE applied to K).

    `n` is the number of cached tokens; positions n.. of each array are free. A rank owning KV
    heads kv0..kv1 would hold `k[layer][kv0:kv1]` only.
    """

    def __init__(self, config: LlamaConfig, ctx: int):
        if ctx < 1:
            raise InputError(f"the context must hold at least one token, got {ctx}")
        shape = (config.num_key_value_heads, int(ctx), config.head_dim)
        self.ctx = int(ctx)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.n = 0

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)


def rms_norm(x: np.ndarray, gamma: np.ndarray, eps: float) -> np.ndarray:
    """x [T, C] / sqrt(mean(x^2) + eps) * gamma, in float32 as HF's LlamaRMSNorm."""
    var = np.mean(np.square(x), axis=-1, keepdims=True, dtype=np.float32)
    return (x * (np.float32(1.0) / np.sqrt(var + np.float32(eps)))) * gamma


def rope_tables(theta: float, head_dim: int,
                positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, D] for the half-split layout (HF: emb = cat(freqs, freqs)), as HF computes
    them: inverse frequencies and angles in float32."""
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.int64)
                                                    .astype(np.float32) / np.float32(head_dim))))
    freqs = positions.astype(np.float32)[:, None] * inv[None, :].astype(np.float32)  # [T, D/2]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """x [heads, T, D] rotated: x * cos + rotate_half(x) * sin, rotate_half = cat(-x2, x1)."""
    half = x.shape[-1] // 2
    rot = np.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rot * sin


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1.0) + np.exp(-x))


class LlamaModel:
    """A Llama decoder on one process, its weights whole in RAM (float32)."""

    def __init__(self, config: LlamaConfig, weights: dict[str, np.ndarray], kernels: bool = True):
        self.config = config
        self.kernels = bool(kernels)
        c = config
        self.emb = np.ascontiguousarray(weights["emb.word"], np.float32)  # [V, C]
        self.final_gamma = np.asarray(weights["final_ln.gamma"], np.float32)
        head = weights.get("head.weight", self.emb) if not c.tie_word_embeddings else self.emb
        self.layers = []
        for i in range(c.num_hidden_layers):
            w = {k: np.asarray(weights[f"layer.{i}.{k}"], np.float32) for k in LAYER_TENSORS}
            self.layers.append({k: self._linear(w[k], TRANSPOSED[k]) if k in TRANSPOSED else w[k]
                                for k in LAYER_TENSORS})
        self.head = self._linear(head, False)

    def _linear(self, w: np.ndarray, stored_kn: bool):
        """A weight ready for `_mm`: packed for the GeMM kernel, or as numpy's [K, N] view."""
        w = np.ascontiguousarray(w, np.float32)
        if self.kernels:
            return K.pack_b(w, trans=not stored_kn)
        return w if stored_kn else w.T

    def _mm(self, x: np.ndarray, w, residual: np.ndarray | None = None) -> np.ndarray:
        """x [T, K] @ W [K, N] (+ residual [T, N])."""
        if self.kernels:
            return K.gemm(np.ascontiguousarray(x), w, residual=residual)
        y = x @ w
        return y if residual is None else y + residual

    def new_cache(self, ctx: int | None = None) -> KVCache:
        return KVCache(self.config, ctx or self.config.max_position_embeddings)

    # --- one forward over T new tokens ---------------------------------------------------
    def forward(self, ids, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` [T] after the cache's n tokens; returns the last position's logits
        [V] (or every position's [T, V] with all_logits) and advances the cache by T."""
        c = self.config
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        T = ids.shape[0]
        if T == 0:
            raise InputError("no tokens to run: the prompt is empty")
        if ids.min() < 0 or ids.max() >= c.vocab_size:
            raise InputError(f"token ids must be in [0, {c.vocab_size}), got "
                             f"{int(ids.min())}..{int(ids.max())}")
        p0 = cache.n
        if p0 + T > cache.ctx:
            raise InputError(f"{p0 + T} tokens do not fit the context of {cache.ctx}")
        cos, sin = rope_tables(c.rope_theta, c.head_dim, np.arange(p0, p0 + T))
        x = self.emb[ids]  # (T, C)
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w["ln1.gamma"], c.rms_norm_eps)
            ctx = self._attention(h, w, cache, i, p0, cos, sin)  # (T, H*D)
            x = self._mm(ctx, w["attn.o.weight"], residual=x)  # (T, C)
            h = rms_norm(x, w["ln2.gamma"], c.rms_norm_eps)
            a = silu(self._mm(h, w["ffn.gate.weight"])) * self._mm(h, w["ffn.up.weight"])  # (T, F)
            x = self._mm(a, w["ffn.down.weight"], residual=x)  # (T, C)
        cache.n = p0 + T
        last = x if all_logits else x[-1:]
        logits = self._mm(rms_norm(last, self.final_gamma, c.rms_norm_eps), self.head)  # (t, V)
        return logits if all_logits else logits[0]

    def _attention(self, h, w, cache: KVCache, layer: int, p0: int, cos, sin) -> np.ndarray:
        """Causal grouped-query attention of T new rows over the cache's p0 + T keys."""
        c = self.config
        T, KV, G, D = h.shape[0], c.num_key_value_heads, c.group, c.head_dim
        q = self._mm(h, w["attn.q.weight"]).reshape(T, KV * G, D).transpose(1, 0, 2)  # (H, T, D)
        k = self._mm(h, w["attn.k.weight"]).reshape(T, KV, D).transpose(1, 0, 2)  # (KV, T, D)
        v = self._mm(h, w["attn.v.weight"]).reshape(T, KV, D).transpose(1, 0, 2)  # (KV, T, D)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        n = p0 + T
        kc, vc = cache.k[layer], cache.v[layer]
        kc[:, p0:n], vc[:, p0:n] = k, v
        qg = q.reshape(KV, G * T, D)  # (KV, G*T, D): query head kv*G + g, row t -> g*T + t
        s = np.matmul(qg, kc[:, :n].transpose(0, 2, 1))  # (KV, G*T, n)
        s *= np.float32(1.0 / np.sqrt(D))
        s = s.reshape(KV, G, T, n)
        s[:, :, np.arange(n)[None, :] > (p0 + np.arange(T))[:, None]] = F32_MIN  # causal
        s = s.reshape(KV * G * T, n)
        if self.kernels:
            K.softmax_rows(s, out=s)
        else:
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
        ctx = np.matmul(s.reshape(KV, G * T, n), vc[:, :n])  # (KV, G*T, D)
        return ctx.reshape(KV * G, T, D).transpose(1, 0, 2).reshape(T, KV * G * D)  # (T, H*D)

    # --- prefill, decode, greedy generation -----------------------------------------------
    def prefill(self, prompt_ids, cache: KVCache) -> np.ndarray:
        """The prompt's tokens as rows into an empty cache; the last position's logits [V]."""
        if cache.n:
            raise InputError("prefill needs an empty cache")
        return self.forward(prompt_ids, cache)

    def decode(self, token: int, cache: KVCache) -> np.ndarray:
        """One token after the cached ones; its logits [V]."""
        return self.forward([int(token)], cache)

    def generate(self, prompt_ids, max_tokens: int, stop_ids=(), ctx: int | None = None,
                 logits_out: list | None = None) -> list[int]:
        """Greedy: prefill, then up to max_tokens decode steps (fewer at a token of stop_ids,
        which is kept). `logits_out`, a list, receives the prefill's last-position logits."""
        if max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1, got {max_tokens}")
        n_prompt = len(prompt_ids)
        need = n_prompt + max_tokens
        if need > self.config.max_position_embeddings:
            raise InputError(f"the prompt ({n_prompt} tokens) and {max_tokens} new ones do not "
                             f"fit the model's context of {self.config.max_position_embeddings}")
        cache = KVCache(self.config, ctx or need)
        logits = self.prefill(prompt_ids, cache)
        if logits_out is not None:
            logits_out.append(logits)
        out: list[int] = []
        while True:
            tok = int(np.argmax(logits))
            out.append(tok)
            if tok in stop_ids or len(out) == max_tokens:
                return out
            logits = self.decode(tok, cache)


# The stored tensors of one layer (local names; `hepti.weights.decoder` says how each is laid
# out and sliced). TRANSPOSED: the matrices used as y = x @ W, with whether the stored array
# is already W [K, N] (o and down) rather than HF's [N, K] (q, k, v, gate, up).
LAYER_TENSORS = ("ln1.gamma", "attn.q.weight", "attn.k.weight", "attn.v.weight",
                 "attn.o.weight", "ln2.gamma", "ffn.gate.weight", "ffn.up.weight",
                 "ffn.down.weight")
TRANSPOSED = {"attn.q.weight": False, "attn.k.weight": False, "attn.v.weight": False,
              "attn.o.weight": True, "ffn.gate.weight": False, "ffn.up.weight": False,
              "ffn.down.weight": True}
