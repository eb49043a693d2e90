"""`tensor` (and `even`, `stream`): weights sliced by ratio, Megatron-style with uneven shares.

Per layer, with h_i heads, f_i FFN columns and r_i token rows on rank i:
  QKV column-wise (whole heads) -> attention on own heads -> out-projection block-wise (partial
  sums) -> **Reduce_scatter** over token rows -> bias + residual + LayerNorm on own rows
  (sequence-parallel, as Galaxy does) -> **Allgatherv** of rows -> FFN up column-wise + GeLU ->
  FFN down block-wise -> **Reduce_scatter** -> bias + residual + LayerNorm on own rows ->
  **Allgatherv** (the last layer's is a Gatherv to the primary).
So 2 Reduce_scatter + 2 Allgatherv of M*C floats per layer. `stream` is the same forward with
the layer slices coming through a StreamingLayers window.
"""
from __future__ import annotations

from hepti import kernels as K
from hepti.counts import counts, offsets


class TensorExecutor:
    name = "tensor"

    def __init__(self, group, cfg, layers, embeddings, ratios, threads=1):
        self.g, self.cfg, self.layers, self.emb = group, cfg, layers, embeddings
        self.ratios, self.threads = ratios, threads

    def forward(self, x0, key_mask, B, T):
        g, cfg, tr, th = self.g, self.cfg, self.g.tracer, self.threads
        C, eps, L = cfg.hidden_size, cfg.layer_norm_eps, cfg.num_hidden_layers
        M = B * T
        rc = counts(M, self.ratios["rows"])  # token rows per rank (for the LayerNorm shards)
        r0 = offsets(rc)[g.rank]
        mine = slice(r0, r0 + rc[g.rank])
        x = g.bcast_to_all(x0, (M, C))  # [M, C]  <- sync
        for i in range(L):
            with tr.span(f"L{i} weights", "io"):
                s = self.layers.get(i)  # resident: at once; stream: waits for the prefetch
            with tr.span(f"L{i} attention", "compute"):
                # [M, C] partial sums of own heads, straight into the Reduce_scatter's buffer
                part = s.attention_partial(x, key_mask, th, out=g.partial_buffer((M, C)))
            rows = g.reduce_scatter_rows(part, rc)  # [r, C]  <- sync
            with tr.span(f"L{i} add+ln", "compute"):
                x1 = K.add_layernorm(rows, s.o_bias, x[mine], *s.ln1, eps)  # [r, C]
            x = g.allgather_rows(x1, rc)  # [M, C]  <- sync
            with tr.span(f"L{i} ffn", "compute"):
                part = s.ffn_partial(x, th, out=g.partial_buffer((M, C)))  # own FFN columns'
            rows = g.reduce_scatter_rows(part, rc)  # [r, C]  <- sync
            with tr.span(f"L{i} add+ln", "compute"):
                x2 = K.add_layernorm(rows, s.down_bias, x[mine], *s.ln2, eps)  # [r, C]
            self.layers.done(i)
            x = g.allgather_rows(x2, rc) if i < L - 1 else g.gather_rows(x2, rc)  # <- sync
        return x  # [M, C] on the primary, None elsewhere
