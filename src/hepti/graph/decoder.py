"""The decoder's cost programs (issue 46): prefill and decode of a Llama-style model as `Program`s.

Written from the decoder's shape (a `hepti.model.llama.LlamaConfig`, read by attribute: this
module is in the graph layer and imports nothing of the model's) as hepti.parallel.decoder's
`tensor` runs it, so that the cost model (hepti.plan.costmodel) prices it and
tests/mpi/decoder_agreement.py holds its collectives equal to the verbs the executor calls.

Split dimensions (the executor's ratio vectors, hepti.parallel.decoder `shards`):

    heads   KV heads, each with the G query heads that share it, and its slice of the KV cache
    ffn     MLP columns (gate and up column-wise, down block-wise)
    vocab   vocabulary rows of the embedding and the tied head (counts from the `ffn` vector)
    rows    prefill's token rows between its reduce-scatter and its allgather

Compute, per unit of a dimension:

- decode (one row against a cache of N tokens) is bound by memory bandwidth: every weight is
  read once per token for 2 FLOPs. Its Work is "gemv": the bytes read (weights at
  `weight_bytes` a value, 4 for float32, 1 + 4/64 for int8 with a scale per 64; the cache's K
  and V in float32), priced at the device's GeMV bytes/s (`Device.gemv_Bps`; "gemv_int8" at
  its int8 rate);
- prefill (T rows) is bound by arithmetic: "gemm" FLOPs (2 T K N) at the GeMM rate for T rows,
  and the causal attention's products as "attention" FLOPs (4 G T^2 D a KV head: the kernel
  computes the whole square and masks it). Its last position alone goes through the head, a
  GeMV like decode's.

RMSNorm, RoPE and SiLU's arithmetic is left out (elementwise over [T, C] or [T, F/N]: under 1%
of a layer's time at SmolLM2's shapes), but not their calls: a layer makes ATTENTION_CALLS
kernel and numpy calls on a rank with KV heads and MLP_CALLS on one with MLP columns, each
costing the profile's `call_overhead_s` (for a decoder, measured on `LlamaModel.layer` itself:
hepti.parallel.profile_compute `measure_decode_step`) whatever its bytes. At one row these fixed
costs are a part of a decode step the bytes do not show, and they do not shrink as a rank's
share does: each Work costs one call, and `_calls` adds the rest as Works of no arithmetic.
A token's own work outside the layers (its ids checked, the embedding looked up, RoPE's row,
the final RMSNorm, the choice's argmax and Python) is one "token" Work at the head, the
profile's `token_overhead_s` (timed with the layers' calls: `measure_decode_step`): 0.6-0.9 ms
of CPU a token on llama-1b, 2 ms of an emulated 0.4-core step, which the program did not count.

Collectives, as `DecoderGroup.sync` and `TokenChooser.greedy` call the verbs: the embedding's
sum and two per layer (after o and after down): for one row an "allreduce" of C floats (one
round, every rank sends its row to every peer), for T > 1 rows a "reduce_scatter" over the
`rows` shares then an "allgatherv" of them; after the head, greedy's choice is an "allgather"
of one (value, index) pair of float64s a rank. Sampling (temperature > 0) sends other small
allgathers instead; the program prices greedy's.

Memory per rank: its weights (vocabulary rows, its heads' q/k/v/o rows, its MLP columns, the
norms), and the KV cache of its heads for `ctx` tokens (float32, `KVCache.bytes_for`). A
program's `ctx` is the context the request asks for (prompt + new tokens), not the model's.
"""
from __future__ import annotations

from hepti.graph.program import ACTIVE, Collective, MemTerm, Phase, Program, Work

F32 = 4.0
GREEDY_PAIR_BYTES = 16.0  # the token choice: one (value, index) pair of float64 a rank
# Kernel and numpy calls a layer makes at one row (`LlamaModel.layer`), each one
# `call_overhead_s`: attention's RMSNorm, the q|k|v product, RoPE of q and of k, the cache
# write, scores, their scale, softmax, the context and o; the MLP's RMSNorm, the gate|up
# product, SiLU, the product of the two and down.
ATTENTION_CALLS, MLP_CALLS = 10, 5
DECODE_CALLS = ATTENTION_CALLS + MLP_CALLS


def int8_bytes(group: int) -> float:
    """Bytes a weight value takes as int8 with one float32 scale per `group` values."""
    return 1.0 + F32 / group


def sync_phases(rows: int, C: int, works: tuple = (), name: str = "") -> list[Phase]:
    """`works` then the sum of a [rows, C] partial over the group, as `DecoderGroup.sync` does
    it: one allreduce for one row; a reduce-scatter over the row shares then an allgatherv of
    the summed rows for more (two phases: a phase has at most one collective)."""
    if rows == 1:
        return [Phase(works, Collective("allreduce", None, F32 * C, name), name)]
    return [Phase(works, Collective("reduce_scatter", "rows", F32 * C, name), name),
            Phase((), Collective("allgatherv", "rows", F32 * C, name + " gather"), name)]


def _calls(dim: str, works: tuple, calls: int) -> tuple:
    """`works` and Works of no arithmetic on `dim` to make them `calls` calls in all (a Work
    costs one call's overhead on a rank with some of `dim`, none on a rank without)."""
    return works + tuple(Work("elementwise", dim, 0.0, name="call")
                         for _ in range(calls - len(works)))


def _gemv_kind(weight_bytes: float) -> str:
    return "gemv" if weight_bytes == F32 else "gemv_int8"


def weight_memory(config, weight_bytes: float) -> list[MemTerm]:
    """Weights a rank holds: per KV head its q/k/v/o rows, per MLP column its gate/up/down
    rows (each a layer), per vocabulary row its embedding row (tied: the head's too), and the
    norms' gammas (float32) on every active rank."""
    C, D, G = config.hidden_size, config.head_dim, config.group
    return [MemTerm("weights", "heads", (2 * G + 2) * D * C * weight_bytes, per_layer=True),
            MemTerm("weights", "ffn", 3 * C * weight_bytes, per_layer=True),
            MemTerm("weights", ACTIVE, 2 * C * F32, per_layer=True),
            MemTerm("weights", "vocab", C * weight_bytes),
            MemTerm("weights", ACTIVE, C * F32)]


def kv_memory(config, ctx: int) -> list[MemTerm]:
    """The KV cache: per KV head and layer, K and V of `ctx` tokens, float32."""
    return [MemTerm("kv_cache", "heads", 2 * ctx * config.head_dim * F32, per_layer=True)]


def _program(name: str, config, rows: int, ctx: int, weight_bytes: float,
             start: list[Phase], layer: list[Phase], end: list[Phase]) -> Program:
    totals = {"heads": config.num_key_value_heads, "ffn": config.intermediate_size,
              "vocab": config.vocab_size}
    if rows > 1:
        totals["rows"] = rows
    return Program(name, totals, start, layer, end, repeat=config.num_hidden_layers,
                   memory=weight_memory(config, weight_bytes) + kv_memory(config, ctx),
                   integer_dims=tuple(totals), n_layers=config.num_hidden_layers)


def _head(config, weight_bytes: float) -> list[Phase]:
    """The tied head on one row (a GeMV over the rank's vocabulary rows), then greedy's choice;
    with them the token's work outside the layers (a "token" Work: the profile's
    `token_overhead_s`, on a rank with vocabulary rows)."""
    head = Work(_gemv_kind(weight_bytes), "vocab", config.hidden_size * weight_bytes, name="head")
    token = Work("token", "vocab", 1.0, name="token")
    return [Phase((head, token), Collective("allgather", None, GREEDY_PAIR_BYTES, "choose"),
                  "head")]


def decode_program(config, ctx: int, weight_bytes: float = F32) -> Program:
    """One decode step: one new token against a cache of `ctx` tokens (the longest it gets,
    so the step costs at most this), its memory with the cache for `ctx` tokens."""
    C, D, G = config.hidden_size, config.head_dim, config.group
    kind = _gemv_kind(weight_bytes)
    attn = _calls("heads", (Work(kind, "heads", (2 * G + 2) * D * C * weight_bytes, name="qkvo"),
                            Work("gemv", "heads", 2 * ctx * D * F32, name="kv cache")),  # K, V once
                  ATTENTION_CALLS)
    mlp = _calls("ffn", (Work(kind, "ffn", 3 * C * weight_bytes, name="mlp"),), MLP_CALLS)
    return _program("decode", config, 1, ctx, weight_bytes,
                    start=sync_phases(1, C, name="embed"),
                    layer=sync_phases(1, C, attn, "attention") + sync_phases(1, C, mlp, "mlp"),
                    end=_head(config, weight_bytes))


def prefill_program(config, rows: int, ctx: int | None = None, weight_bytes: float = F32
                    ) -> Program:
    """The prompt's `rows` tokens into an empty cache (held for `ctx` tokens, default `rows`),
    and the first token's choice."""
    C, D, G, T = config.hidden_size, config.head_dim, config.group, rows
    attn = _calls("heads", (Work("gemm", "heads", 2 * T * C * (2 * G + 2) * D, size_fixed=T,
                                 name="qkvo"),
                            Work("attention", "heads", 4 * G * T * T * D,
                                 size_per_unit=4 * G * T * T * D, name="attention")),
                  ATTENTION_CALLS)
    mlp = _calls("ffn", (Work("gemm", "ffn", 2 * T * C * 3, size_fixed=T, name="mlp"),),
                 MLP_CALLS)
    return _program("prefill", config, T, ctx or T, weight_bytes,
                    start=sync_phases(T, C, name="embed"),
                    layer=sync_phases(T, C, attn, "attention") + sync_phases(T, C, mlp, "mlp"),
                    end=_head(config, weight_bytes))
