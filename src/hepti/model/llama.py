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

One forward for one device and for a rank of many (`tensor`, hepti.parallel.decoder): a
`LlamaModel` holds a `Shard` of the model, KV heads kv0..kv1 (with their query heads), MLP
columns f0..f1 and vocabulary rows v0..v1; the whole model is the shard of everything. Each
sublayer ends in a partial sum [T, C] over the rank's heads or columns, which `sync` (given by
the caller: the parallel layer's collectives, or nothing for one device) sums over the group;
one rank of the group (`Shard.residual`) adds the residual stream into its partial, so the sum
is the next residual stream. The embedding is split by vocabulary like the tied head: each rank
looks up the ids in its rows (zeros elsewhere) and `sync` sums them. So every sync point of a
step is visible in `forward` and `layer`: one for the embedding, two per layer.

Kernels (`kernels=True`, the default): the projections (q, k and v joined into one matrix, o,
gate and up joined, down) and the LM head run on hepti's packed GeMM (`hepti.kernels.gemm`,
weights packed once here; the residual adds are fused into the o and down GeMMs), RMSNorm on
`hepti.kernels.rms_norm`, the attention probabilities on `hepti.kernels.softmax_rows`. Plain
numpy does the rest: RoPE, SiLU * up, and the two attention products (batched matmuls over KV heads; the kernels' attention core has a key mask
but no causal one). `kernels=False` runs every product in numpy too (float32), a second path
to compare against.

int8 (an int8 folder, `hepti convert --dtype int8`): the matrices arrive as
`hepti.kernels.int8.QuantMatrix` (the embedding too, being the tied head). They are packed by
`K.pack_weight`, float32 or int8 alike, and every product runs through `K.gemm_any`, so both
folders run this same code: the int8 GeMV streams a quarter of the bytes per decode step. The
embedding lookup widens only the rows of the ids it looks up. `kernels=False` widens each int8
matrix once at load (the numpy reference of the same quantised weights).
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
    (its executor, "decoder", hepti.parallel.decoder, is run by `hepti generate`, not by
    `hepti run` or serve).
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


@dataclass(frozen=True)
class Shard:
    """A rank's share of a decoder, as half-open ranges: KV heads (with their G query heads
    each), MLP columns and vocabulary rows (the embedding and the head). `residual`: this rank
    adds the residual stream into its partial sums (exactly one rank of a group does)."""

    kv: tuple[int, int]
    ffn: tuple[int, int]
    vocab: tuple[int, int]
    residual: bool = True

    @classmethod
    def whole(cls, config: "LlamaConfig") -> "Shard":
        """Everything: the single device."""
        return cls((0, config.num_key_value_heads), (0, config.intermediate_size),
                   (0, config.vocab_size))

    def heads(self, config: "LlamaConfig") -> tuple[int, int]:
        """The query heads that share this shard's KV heads."""
        return self.kv[0] * config.group, self.kv[1] * config.group

    def check(self, config: "LlamaConfig") -> "Shard":
        for what, (a, b), n in (("kv", self.kv, config.num_key_value_heads),
                                ("ffn", self.ffn, config.intermediate_size),
                                ("vocab", self.vocab, config.vocab_size)):
            if not 0 <= a <= b <= n:
                raise ValueError(f"shard {what} range {a}:{b} out of 0:{n}")
        return self


class KVCache:
    """Keys and values of the tokens seen so far, per layer [KV, ctx, D] (RoPE applied to K).

    `n` is the number of cached tokens; positions n.. of each array are free. A rank owning KV
    heads kv0..kv1 holds only those: `kv_heads` = kv1 - kv0 (all of them by default).
    """

    def __init__(self, config: LlamaConfig, ctx: int, kv_heads: int | None = None):
        if ctx < 1:
            raise InputError(f"the context must hold at least one token, got {ctx}")
        kv = config.num_key_value_heads if kv_heads is None else int(kv_heads)
        shape = (kv, int(ctx), config.head_dim)
        self.ctx = int(ctx)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.n = 0
        self._rope = None  # cos, sin [ctx, D] of every position, made at the first forward
        self._rope_of = (config.rope_theta, config.head_dim)

    def rope(self, p0: int, t: int) -> tuple[np.ndarray, np.ndarray]:
        """RoPE's cos and sin [t, D] of positions p0 .. p0 + t: rows of tables made once for
        the whole context (`rope_tables`, elementwise, so each row is what it computes for
        that position alone). A decode step made them anew: 9 us hot, 145 us as a step meets
        it, after its layers' weights went through the caches."""
        if self._rope is None:
            self._rope = rope_tables(*self._rope_of, np.arange(self.ctx))
        cos, sin = self._rope
        return cos[p0:p0 + t], sin[p0:p0 + t]

    def check_room(self, t: int) -> None:
        """InputError unless `t` more tokens fit after the n cached ones."""
        if self.n + t > self.ctx:
            raise InputError(f"{self.n + t} tokens do not fit the context of {self.ctx}")

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    @staticmethod
    def bytes_for(config: LlamaConfig, ctx: int, kv_heads: int) -> int:
        """What a cache of `ctx` tokens for `kv_heads` KV heads holds (K and V, float32)."""
        return 2 * config.num_hidden_layers * kv_heads * int(ctx) * config.head_dim * 4


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


def silu_times(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    """silu(g) * u, the same operations in the same order, into one new array (five
    temporaries before: each numpy call and allocation costs at a decode step's one row)."""
    t = np.negative(g)
    np.exp(t, out=t)
    t += np.float32(1.0)
    np.divide(g, t, out=t)
    t *= u
    return t


class LlamaModel:
    """A Llama decoder's `Shard` on one process, its weights in RAM (float32, or the matrices
    int8): the whole model by default, or a rank's share with `weights` holding only the shard's
    rows (as `hepti.weights.decoder.read_shard` reads them; names and orientation as stored)."""

    def __init__(self, config: LlamaConfig, weights: dict, kernels: bool = True,
                 shard: Shard | None = None, consume: bool = False):
        """consume=True empties `weights` as it packs them, so that each stored array can be
        freed once its packed copy exists: a rank then peaks near its shard's size plus one
        layer, not twice its shard (a float32 llama-1b split over two 4 GiB devices was
        OOM-killed holding both)."""
        self.config = config
        self.kernels = bool(kernels)
        self.shard = (shard or Shard.whole(config)).check(config)
        c = config
        self.n_kv = self.shard.kv[1] - self.shard.kv[0]  # this shard's KV heads
        self.n_ffn = self.shard.ffn[1] - self.shard.ffn[0]  # its MLP columns
        self.n_vocab = self.shard.vocab[1] - self.shard.vocab[0]  # its vocabulary rows
        take = weights.pop if consume else weights.__getitem__
        emb = _matrix(take("emb.word"))  # (nv, C), float32 or a QuantMatrix
        if emb.shape != (self.n_vocab, c.hidden_size):
            raise ValueError(f"emb.word is {list(emb.shape)}, the shard's vocabulary rows "
                             f"{self.shard.vocab} need [{self.n_vocab}, {c.hidden_size}]")
        self.final_gamma = np.asarray(take("final_ln.gamma"), np.float32)
        self.layers = [self._layer_weights({k: _matrix(take(f"layer.{i}.{k}"))
                                            for k in LAYER_TENSORS})
                       for i in range(c.num_hidden_layers)]
        head = emb if c.tie_word_embeddings else _matrix(take("head.weight"))
        self.head = self._linear(head, False)
        # The embedding lookup: from the packed tied head's columns (no second copy), else
        # from the stored rows.
        self.emb = None if (self.kernels and c.tie_word_embeddings) else emb

    def _layer_weights(self, w: dict) -> dict:
        """One layer's stored tensors as the forward uses them. q, k and v are joined into one
        matrix (rows side by side, [N_q + 2 N_kv, C]) and gate and up into another: a decode
        step then makes 4 products a layer, not 7, each over more columns. A one-row product
        is bound by reading its weights plus a fixed cost a call (~20 us of checks and
        dispatch), and SmolLM2's 30 layers spent a third of a float32 decode step outside the
        products before. Each output column is computed as before, so the values are the same."""
        return {"ln1.gamma": w["ln1.gamma"], "ln2.gamma": w["ln2.gamma"],
                "qkv": self._linear(_join([w["attn.q.weight"], w["attn.k.weight"],
                                           w["attn.v.weight"]]), False),
                "o": self._linear(w["attn.o.weight"], True),
                "gate_up": self._linear(_join([w["ffn.gate.weight"], w["ffn.up.weight"]]), False),
                "down": self._linear(w["ffn.down.weight"], True)}

    def _linear(self, w, stored_kn: bool):
        """A weight (float32 or QuantMatrix) ready for `_mm`: packed for the GeMM kernels
        (`K.pack_weight`: int8 stays int8), or numpy's float32 [K, N] view; None for a shard
        with no rows of it (a rank with a zero share)."""
        if w.shape[0] * w.shape[1] == 0:
            return None
        if self.kernels:
            return K.pack_weight(w, trans=not stored_kn)
        w = w.dequantize() if isinstance(w, K.QuantMatrix) else w
        return w if stored_kn else w.T

    def _norm(self, x: np.ndarray, gamma: np.ndarray) -> np.ndarray:
        """RMSNorm of x [T, C]: the kernel (one call), or numpy's `rms_norm` (kernels=False)."""
        if self.kernels:
            return K.rms_norm(x, gamma, self.config.rms_norm_eps)
        return rms_norm(x, gamma, self.config.rms_norm_eps)

    def _mm(self, x: np.ndarray, w, residual: np.ndarray | None = None) -> np.ndarray:
        """x [T, K] @ W [K, N] (+ residual [T, N]), W float32 or int8."""
        if self.kernels:
            return K.gemm_any(np.ascontiguousarray(x), w, residual=residual)
        y = x @ w
        return y if residual is None else y + residual

    def new_cache(self, ctx: int | None = None) -> KVCache:
        """A cache for this shard's KV heads, `ctx` tokens (the model's context by default)."""
        return KVCache(self.config, ctx or self.config.max_position_embeddings, self.n_kv)

    # --- one forward over T new tokens ---------------------------------------------------
    def forward(self, ids, cache: KVCache, all_logits: bool = False, sync=None) -> np.ndarray:
        """Run tokens `ids` [T] after the cache's n tokens; returns the last position's logits
        of this shard's vocabulary rows [nv] (every position's [T, nv] with all_logits) and
        advances the cache by T. `sync(partial [T, C]) -> [T, C]` sums a partial over the
        group (None: a group of one); it is called on every rank in the same order."""
        c = self.config
        sync = sync or no_sync
        ids = checked_ids(ids, c.vocab_size)
        T = ids.shape[0]
        cache.check_room(T)
        p0 = cache.n
        cos, sin = cache.rope(p0, T)
        x = sync(self.embed(ids))  # (T, C): sync 1, the rows of every rank's vocabulary
        for i in range(c.num_hidden_layers):
            x = self.layer(x, i, cache, p0, cos, sin, sync)  # syncs 2 and 3 of each layer
        cache.n = p0 + T
        last = x if all_logits else x[-1:]
        if self.head is None:  # no vocabulary rows here
            logits = np.empty((last.shape[0], 0), np.float32)
        else:
            h = self._norm(last, self.final_gamma)
            logits = self._mm(h, self.head)  # (t, nv)
        return logits if all_logits else logits[0]

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """ids [T] -> (T, C): the embeddings of the ids in this shard's vocabulary rows, zeros
        for the others (the sum over a group's shards is the whole lookup)."""
        v0, v1 = self.shard.vocab
        x = np.zeros((ids.shape[0], self.config.hidden_size), np.float32)
        if ids.shape[0] == 1:  # a decode step's one id: no masks (each numpy call costs)
            i = int(ids[0])
            if not v0 <= i < v1:
                return x
            rows = np.array([i - v0])
            if self.emb is None:
                x[:] = K.columns_any(self.head, rows)
            else:
                x[:] = self._emb_rows(rows)
            return x
        mine = (ids >= v0) & (ids < v1)
        rows = ids[mine] - v0
        if not rows.size:
            return x
        if self.emb is None:  # the tied head's columns (int8 widened for these rows only)
            x[mine] = K.columns_any(self.head, rows)
        else:
            x[mine] = self._emb_rows(rows)
        return x

    def _emb_rows(self, rows: np.ndarray) -> np.ndarray:
        """Rows of the stored embedding, float32 (an int8 one widened for these rows only)."""
        if isinstance(self.emb, K.QuantMatrix):
            e = self.emb
            return K.QuantMatrix(e.q[rows], e.scales[rows], e.group).dequantize()
        return self.emb[rows]

    def layer(self, x: np.ndarray, i: int, cache: KVCache, p0: int, cos, sin, sync) -> np.ndarray:
        """One decoder layer on this shard: x (T, C), the same on every rank -> the next x.
        Attention over the shard's heads and the MLP over its columns each end in a partial
        sum that `sync` adds up over the group (with the residual from the `residual` rank)."""
        c, w, T = self.config, self.layers[i], x.shape[0]
        res = x if self.shard.residual else None
        h = self._norm(x, w["ln1.gamma"])
        ctx = self._attention(h, w, cache, i, p0, cos, sin) if self.n_kv else None  # (T, h*D)
        x = sync(self._partial(ctx, w["o"], res, T))  # (T, C)
        res = x if self.shard.residual else None
        h = self._norm(x, w["ln2.gamma"])
        a = None
        if self.n_ffn:
            gu = self._mm(h, w["gate_up"])  # (T, 2f): gate's columns, then up's
            a = silu_times(gu[:, :self.n_ffn], gu[:, self.n_ffn:])  # (T, f)
        return sync(self._partial(a, w["down"], res, T))  # (T, C)

    def _partial(self, a: np.ndarray | None, w, residual: np.ndarray | None, T: int
                 ) -> np.ndarray:
        """a @ W (+ residual): this shard's partial sum of a block-wise GeMM, (T, C). A shard
        with no rows of W (a = None) contributes the residual, or zeros."""
        if a is not None:
            return self._mm(a, w, residual=residual)
        if residual is not None:
            return residual.copy()
        return np.zeros((T, self.config.hidden_size), np.float32)

    def _attention(self, h, w, cache: KVCache, layer: int, p0: int, cos, sin) -> np.ndarray:
        """Causal grouped-query attention of T new rows over the cache's p0 + T keys, for this
        shard's KV heads and their query heads."""
        c = self.config
        T, KV, G, D = h.shape[0], self.n_kv, c.group, c.head_dim
        qkv = self._mm(h, w["qkv"])  # (T, (KV*G + 2*KV) * D): q's columns, then k's, then v's
        nq = KV * G * D
        # q's and k's heads rotated in one call (each numpy call costs, cold, at one row)
        qk = apply_rope(qkv[:, :nq + KV * D].reshape(T, KV * G + KV, D).transpose(1, 0, 2),
                        cos, sin)  # (h + kv, T, D)
        q, k = qk[:KV * G], qk[KV * G:]  # (h, T, D), (kv, T, D)
        v = qkv[:, nq + KV * D:].reshape(T, KV, D).transpose(1, 0, 2)  # (kv, T, D)
        n = p0 + T
        kc, vc = cache.k[layer], cache.v[layer]
        kc[:, p0:n], vc[:, p0:n] = k, v
        qg = q.reshape(KV, G * T, D)  # (kv, G*T, D): query head kv*G + g, row t -> g*T + t
        s = np.matmul(qg, kc[:, :n].transpose(0, 2, 1))  # (kv, G*T, n)
        s *= np.float32(1.0 / np.sqrt(D))
        s = s.reshape(KV, G, T, n)
        if T > 1:  # one new row sees every cached key: nothing to mask
            s[:, :, np.arange(n)[None, :] > (p0 + np.arange(T))[:, None]] = F32_MIN  # causal
        s = s.reshape(KV * G * T, n)
        if self.kernels:
            K.softmax_rows(s, out=s)
        else:
            s = np.exp(s - s.max(axis=-1, keepdims=True))
            s /= s.sum(axis=-1, keepdims=True)
        ctx = np.matmul(s.reshape(KV, G * T, n), vc[:, :n])  # (kv, G*T, D)
        return ctx.reshape(KV * G, T, D).transpose(1, 0, 2).reshape(T, KV * G * D)  # (T, h*D)

    # --- prefill, decode, generation --------------------------------------------------------
    def prefill(self, prompt_ids, cache: KVCache, sync=None) -> np.ndarray:
        """The prompt's tokens as rows into an empty cache; the last position's logits [nv]."""
        if cache.n:
            raise InputError("prefill needs an empty cache")
        return self.forward(prompt_ids, cache, sync=sync)

    def decode(self, token: int, cache: KVCache, sync=None) -> np.ndarray:
        """One token after the cached ones; its logits [nv]."""
        return self.forward([int(token)], cache, sync=sync)

    def generate(self, prompt_ids, max_tokens: int, stop_ids=(), ctx: int | None = None,
                 logits_out: list | None = None, choose=None, sync=None, on_token=None
                 ) -> list[int]:
        """Prefill, then up to max_tokens decode steps (fewer at a token of stop_ids, which is
        kept). `choose(logits [nv]) -> token id` picks each token (greedy argmax over a whole
        model by default; across ranks, hepti.parallel.decoder's chooser); `on_token(id)` sees
        each as it is made; `logits_out`, a list, receives the prefill's last-position logits."""
        check_request(self.config, len(prompt_ids), max_tokens)
        cache = self.new_cache(ctx or len(prompt_ids) + max_tokens)
        choose = choose or _argmax
        logits = self.prefill(prompt_ids, cache, sync=sync)
        if logits_out is not None:
            logits_out.append(logits)
        out: list[int] = []
        while True:
            tok = int(choose(logits))
            out.append(tok)
            if on_token is not None:
                on_token(tok)
            if tok in stop_ids or len(out) == max_tokens:
                return out
            logits = self.decode(tok, cache, sync=sync)


def check_request(config: LlamaConfig, n_prompt: int, max_tokens: int) -> None:
    """A generation request the model can run: a prompt, new tokens, the context holds both."""
    if max_tokens < 1:
        raise InputError(f"max_tokens must be at least 1, got {max_tokens}")
    if n_prompt < 1:
        raise InputError("no tokens to run: the prompt is empty")
    if n_prompt + max_tokens > config.max_position_embeddings:
        raise InputError(f"the prompt ({n_prompt} tokens) and {max_tokens} new ones do not "
                         f"fit the model's context of {config.max_position_embeddings}; "
                         "shorten the prompt or ask for fewer tokens")


def checked_ids(ids, vocab: int) -> np.ndarray:
    """Token ids as int64 [T]; InputError if there are none or one is outside the vocabulary."""
    if type(ids) is list and len(ids) == 1 and type(ids[0]) is int:  # a decode step's (cheap)
        if not 0 <= ids[0] < vocab:
            raise InputError(f"token ids must be in [0, {vocab}), got {ids[0]}..{ids[0]}")
        return np.array(ids, np.int64)
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if ids.shape[0] == 0:
        raise InputError("no tokens to run: the prompt is empty")
    if ids.min() < 0 or ids.max() >= vocab:
        raise InputError(f"token ids must be in [0, {vocab}), got {int(ids.min())}.."
                         f"{int(ids.max())}")
    return ids


def _matrix(w):
    """A stored tensor as the forward keeps it: a QuantMatrix as it is, anything else as a
    contiguous float32 array."""
    if isinstance(w, K.QuantMatrix):
        return w
    return np.ascontiguousarray(w, np.float32)


def _join(mats: list):
    """Stored matrices [N_i, C] (float32 or QuantMatrix) as one [sum N_i, C], rows in order."""
    if isinstance(mats[0], K.QuantMatrix):
        return K.QuantMatrix.concat(mats)
    return np.concatenate(mats, axis=0)


def no_sync(partial: np.ndarray) -> np.ndarray:
    """The sync of a group of one, or of a pipeline stage's whole layers: the partial sum is
    the sum."""
    return partial


def _argmax(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


# The stored tensors of one layer (local names; `hepti.weights.decoder` says how each is laid
# out and sliced). o and down are stored as W [K, N] for y = x @ W; q, k, v, gate and up as
# HF's [N, K] (`_layer_weights` packs each the right way round).
LAYER_TENSORS = ("ln1.gamma", "attn.q.weight", "attn.k.weight", "attn.v.weight",
                 "attn.o.weight", "ln2.gamma", "ffn.gate.weight", "ffn.up.weight",
                 "ffn.down.weight")
