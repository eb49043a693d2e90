"""Byte counts of weight slices, from the config alone (no weights needed).

The runtime checks a memory budget with these before it reads anything; the planner's cost model
uses the same numbers, so the two agree on what a share costs.
"""
from __future__ import annotations

from hepti.config import BertConfig

F32 = 4


def layer_slice_bytes(cfg: BertConfig, n_heads: int, n_ffn: int) -> int:
    """Weight bytes of one layer's slice with `n_heads` whole heads and `n_ffn` FFN columns."""
    C, D = cfg.hidden_size, cfg.head_dim
    hd = n_heads * D
    sliced = 3 * hd * C + 3 * hd + hd * C + 2 * n_ffn * C + n_ffn  # QKV(+bias), O rows, up(+bias), down rows
    whole = 6 * C  # o bias, ln1 gamma/beta, down bias, ln2 gamma/beta
    return F32 * (sliced + whole)


def layer_bytes(cfg: BertConfig) -> int:
    """Weight bytes of one whole encoder layer."""
    return layer_slice_bytes(cfg, cfg.num_attention_heads, cfg.intermediate_size)


def embedding_bytes(cfg: BertConfig) -> int:
    C = cfg.hidden_size
    return F32 * (cfg.vocab_size * C + cfg.max_position_embeddings * C + cfg.type_vocab_size * C + 2 * C)


def model_bytes(cfg: BertConfig) -> int:
    return embedding_bytes(cfg) + cfg.num_hidden_layers * layer_bytes(cfg)
