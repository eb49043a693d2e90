"""Transformer encoders as operator graphs, built from two shared pieces (attention, FFN).

A family's builder says how its layer is put together from those pieces and what comes before
and after the layers; the pieces say how each operator can be split. BERT: embeddings (on rank
0), then post-LayerNorm layers (x = LN(x + Attn(x)); x = LN(x + MLP(x))). ViT: patch
embeddings (on rank 0), pre-LayerNorm layers (x += Attn(LN(x)); x += MLP(LN(x))), a final
LayerNorm.

Weight names are the stored local names of hepti.weights.layout (`layer.{i}.<name>`).
"""
from __future__ import annotations

from hepti.graph.ir import BY_COLS, BY_K, BY_ROWS, BY_UNIT, ON_PRIMARY, Graph, Op, Tensor, Weight


def attention_ops(C: int, H: int, x: str, out: str) -> tuple[list[Op], list[Weight]]:
    """qkv = x W_qkv + b (one GeMM: Q | K | V); ctx = attention(q, kv) on H heads; out = ctx W_o.
    Split by token rows, or by whole heads: QKV column-wise, attention per head, the output
    projection block-wise (its input rows are the heads' columns), leaving partial sums."""
    D = C // H
    weights = [Weight(f"attn.{w}.weight", (C, C), "heads", D * C) for w in "qkv"]
    weights += [Weight(f"attn.{w}.bias", (C,), "heads", D) for w in "qkv"]
    weights += [Weight("attn.o.weight", (C, C), "heads", D * C)]
    ops = [
        Op("qkv", "gemm", (x,), ("q", "kv"), (BY_ROWS, BY_COLS), k=C, n=3 * C, unit="heads",
           unit_width=3 * D, weights=tuple(w.name for w in weights[:6]), block="attention",
           matrices=tuple(w.name for w in weights[:3]), bias=tuple(w.name for w in weights[3:6])),
        Op("attention", "attention", ("q", "kv"), ("ctx",), (BY_ROWS, BY_UNIT), k=D, heads=H,
           unit="heads", block="attention"),
        Op("o-proj", "gemm", ("ctx",), (out,), (BY_ROWS, BY_K), k=C, n=C, unit="heads", unit_width=D,
           weights=("attn.o.weight",), block="attention", matrices=("attn.o.weight",)),
    ]
    return ops, weights


def ffn_ops(C: int, F: int, x: str, out: str) -> tuple[list[Op], list[Weight]]:
    """h = GeLU(x W_up + b_up); out = h W_down. Split by token rows, or by FFN columns: up
    column-wise, down block-wise (partial sums)."""
    weights = [Weight("ffn.up.weight", (F, C), "ffn", C), Weight("ffn.up.bias", (F,), "ffn", 1),
               Weight("ffn.down.weight", (F, C), "ffn", C)]
    ops = [
        Op("ffn up", "gemm", (x,), ("h",), (BY_ROWS, BY_COLS), k=C, n=F, unit="ffn", unit_width=1,
           weights=("ffn.up.weight", "ffn.up.bias"), block="ffn", matrices=("ffn.up.weight",),
           bias=("ffn.up.bias",), act="gelu"),
        Op("ffn down", "gemm", ("h",), (out,), (BY_ROWS, BY_K), k=F, n=C, unit="ffn", unit_width=1,
           weights=("ffn.down.weight",), block="ffn", matrices=("ffn.down.weight",)),
    ]
    return ops, weights


def add_layernorm_op(name: str, C: int, total: str, residual: str, out: str,
                     weights: tuple[str, ...], eps: float) -> Op:
    """out = LayerNorm(total + bias + residual), on each rank's own rows; weights (bias,
    gamma, beta)."""
    return Op(name, "elementwise", (total, residual), (out,), (BY_ROWS,), per_row=float(C),
              weights=weights, fn="add_ln", eps=eps)


def bert(cfg, B: int, T: int) -> Graph:
    """A BERT-family encoder (hepti.config.BertConfig) for batches of B x T tokens."""
    C, H, F = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size
    attn, attn_w = attention_ops(C, H, "x", "attn_out")
    ffn, ffn_w = ffn_ops(C, F, "x1", "ffn_out")
    ln1_w = ("attn.o.bias", "attn.ln.gamma", "attn.ln.beta")
    ln2_w = ("ffn.down.bias", "ffn.ln.gamma", "ffn.ln.beta")
    eps = cfg.layer_norm_eps
    layer = attn + [add_layernorm_op("add+ln 1", C, "attn_out", "x", "x1", ln1_w, eps)] + ffn + [
        add_layernorm_op("add+ln 2", C, "ffn_out", "x1", "x", ln2_w, eps)]
    weights = attn_w + ffn_w + [Weight(n, (C,)) for n in ln1_w + ln2_w]
    emb = [Weight("emb.word", (cfg.vocab_size, C)),
           Weight("emb.position", (cfg.max_position_embeddings, C)),
           Weight("emb.token_type", (cfg.type_vocab_size, C)),
           Weight("emb.ln.gamma", (C,)), Weight("emb.ln.beta", (C,))]
    # gather three embedding rows, add, LayerNorm: about 4 passes over [M, C]
    embed = Op("embed", "embed", ("ids",), ("x",), (ON_PRIMARY,), per_row=4.0 * C,
               weights=tuple(w.name for w in emb))
    tensors = [Tensor("ids", 1, "input"), Tensor("mask", 1, "input"), Tensor("x", C),
               Tensor("q", C), Tensor("kv", 2 * C), Tensor("ctx", C), Tensor("attn_out", C),
               Tensor("x1", C), Tensor("h", F), Tensor("ffn_out", C)]
    return Graph("bert", {t.name: t for t in tensors}, {w.name: w for w in weights + emb},
                 [embed], layer, [], cfg.num_hidden_layers, {"heads": H, "ffn": F, "rows": B * T},
                 seq_len=T, output="x", inputs_everywhere=("mask",), whole_units=("heads",))


def layernorm_op(name: str, C: int, x: str, out: str, weights: tuple[str, str], eps: float) -> Op:
    """out = LayerNorm(x), on each rank's own rows; weights (gamma, beta)."""
    return Op(name, "elementwise", (x,), (out,), (BY_ROWS,), per_row=float(C), weights=weights,
              fn="ln", eps=eps)


def add_op(name: str, C: int, total: str, residual: str, out: str, bias: str) -> Op:
    """out = total + bias + residual, on each rank's own rows."""
    return Op(name, "elementwise", (total, residual), (out,), (BY_ROWS,), per_row=float(C),
              weights=(bias,), fn="add")


def vit(cfg, B: int, T: int) -> Graph:
    """A ViT encoder (hepti.config.ViTConfig) for batches of B images, T = patches + 1 tokens:
    the patch embedding, CLS token and positions (on rank 0), then pre-LayerNorm layers
    (x1 = x + Attn(LN1(x)); x = x1 + MLP(LN2(x1))), then a final LayerNorm."""
    C, H, F, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size, cfg.layer_norm_eps
    attn, attn_w = attention_ops(C, H, "y", "attn_out")
    ffn, ffn_w = ffn_ops(C, F, "y2", "ffn_out")
    ln = ("ln1.gamma", "ln1.beta", "ln2.gamma", "ln2.beta")
    layer = ([layernorm_op("ln 1", C, "x", "y", ln[:2], eps)] + attn
             + [add_op("add 1", C, "attn_out", "x", "x1", "attn.o.bias"),
                layernorm_op("ln 2", C, "x1", "y2", ln[2:], eps)] + ffn
             + [add_op("add 2", C, "ffn_out", "x1", "x", "ffn.down.bias")])
    weights = attn_w + ffn_w + [Weight(n, (C,)) for n in ln + ("attn.o.bias", "ffn.down.bias")]
    k = cfg.num_channels * cfg.patch_size ** 2
    emb = [Weight("emb.patch.weight", (C, k)), Weight("emb.patch.bias", (C,)), Weight("emb.cls", (C,)),
           Weight("emb.position", (cfg.seq_len, C))]
    # patches [B * (T - 1), k] x [k, C]; the CLS row and the positions are additions
    embed = Op("embed", "embed", ("pixels",), ("x",), (ON_PRIMARY,), k=k, n=C,
               weights=tuple(w.name for w in emb))
    final = [Weight("final_ln.gamma", (C,)), Weight("final_ln.beta", (C,))]
    tensors = [Tensor("pixels", k, "input"), Tensor("x", C), Tensor("y", C), Tensor("q", C),
               Tensor("kv", 2 * C), Tensor("ctx", C), Tensor("attn_out", C), Tensor("x1", C),
               Tensor("y2", C), Tensor("h", F), Tensor("ffn_out", C), Tensor("out", C)]
    return Graph("vit", {t.name: t for t in tensors}, {w.name: w for w in weights + emb + final},
                 [embed], layer, [layernorm_op("final ln", C, "x", "out", ("final_ln.gamma",
                                                                           "final_ln.beta"), eps)],
                 cfg.num_hidden_layers, {"heads": H, "ffn": F, "rows": B * T}, seq_len=T,
                 output="out", whole_units=("heads",))
