"""`rows`: weights replicated, token rows split by the ratio vector (row-wise MatMuls).

Each rank computes Q, K, V for its own rows, then **K and V rows are exchanged with one
Allgatherv** so its queries can attend to every token. Exchanging K/V rather than the layer
input: the input exchange would make every rank recompute the K and V projections for all M
rows (2/3 of the QKV GeMM, replicated), while K/V costs twice the bytes of the input but no
extra FLOPs — on edge links bytes are cheaper than redoing a third of the layer's GeMMs.
Per layer: 1 Allgatherv. Per batch: 1 Scatterv of the embedded rows, 1 Gatherv of the output.
"""
from __future__ import annotations

from hepti import kernels as K
from hepti.counts import counts, offsets


class RowsExecutor:
    name = "rows"

    def __init__(self, group, cfg, layers, embeddings, ratios, threads=1):
        self.g, self.cfg, self.layers, self.emb = group, cfg, layers, embeddings
        self.ratios, self.threads = ratios, threads

    def forward(self, x0, key_mask, B, T):
        """x0 [M, C] embedded rows (primary only) -> hidden [M, C] on the primary, else None."""
        g, cfg, tr, th = self.g, self.cfg, self.g.tracer, self.threads
        C, H, eps = cfg.hidden_size, cfg.num_attention_heads, cfg.layer_norm_eps
        rc = counts(B * T, self.ratios["rows"])  # token rows per rank
        r0 = offsets(rc)[g.rank]
        x = g.scatter_rows(x0, rc, (C,))  # [r, C]
        for i in range(cfg.num_hidden_layers):
            with tr.span(f"L{i} weights", "io"):
                s = self.layers.get(i)  # resident: at once; stream: waits for the prefetch
            with tr.span(f"L{i} qkv", "compute"):
                qkv = K.gemm(x, s.qkv, bias=s.qkv_bias, threads=th)  # [r, 3C]: q | k | v
            kv = g.allgather_rows(qkv[:, C:], rc)  # [M, 2C]  <- sync: every rank's K/V rows
            with tr.span(f"L{i} attention", "compute"):
                ctx = K.attention_qkv(qkv, key_mask, H, kv=kv, row0=r0, threads=th)  # [r, C]
            with tr.span(f"L{i} o-proj+ln", "compute"):
                x = K.add_layernorm(K.gemm(ctx, s.o, threads=th), s.o_bias, x, *s.ln1, eps)
            with tr.span(f"L{i} ffn+ln", "compute"):
                x = K.add_layernorm(s.ffn_partial(x, th), s.down_bias, x, *s.ln2, eps)
            self.layers.done(i)
        return g.gather_rows(x, rc)  # [M, C] on the primary  <- sync
