"""The ViT family's own code: its input (normalised pixels, torch's [n, 3, H, W] layout) and its
embeddings, the primary rank's operator: patches times the patch embedding (the stride-P
convolution as a GeMM, each patch flattened in (channel, row, column) order, as the stored
`emb.patch.weight` [C, channels * P * P] is), a CLS row in front, positions added.

The layers are the graph's (hepti.graph.encoder.vit) and run on the interpreter; images become
pixels in hepti.images.
"""
from __future__ import annotations

import numpy as np

from hepti import kernels as K
from hepti.model.bert import load_kernels as layers_kernels


class PatchEmbeddings:
    """pixels [B, channels, H, W] -> x [B * T, C], T = patches + 1 (CLS first)."""

    def __init__(self, config, t: dict[str, np.ndarray]):
        self.config = config
        f32 = lambda a: np.ascontiguousarray(a, np.float32)  # noqa: E731
        self.weight = K.pack_b(f32(t["emb.patch.weight"]), trans=True)  # [C, k] stored [n, k]
        self.bias, self.cls = f32(t["emb.patch.bias"]), f32(t["emb.cls"])
        self.position = f32(t["emb.position"])  # [T, C]
        self.nbytes = self.weight.nbytes + sum(a.nbytes for a in (self.bias, self.cls, self.position))

    def __call__(self, batch) -> np.ndarray:
        cfg, x = self.config, batch.pixels
        B, c, Hh, Ww = x.shape
        P = cfg.patch_size
        h, w = Hh // P, Ww // P
        patches = np.ascontiguousarray(
            x.reshape(B, c, h, P, w, P).transpose(0, 2, 4, 1, 3, 5).reshape(B * h * w, c * P * P),
            np.float32)
        emb = K.gemm(patches, self.weight, bias=self.bias)  # [B * N, C]
        C = emb.shape[1]
        out = np.empty((B, h * w + 1, C), np.float32)
        out[:, 0] = self.cls
        out[:, 1:] = emb.reshape(B, h * w, C)
        out += self.position
        return out.reshape(B * (h * w + 1), C)


def primary_ops(config, store) -> dict:
    """The operators rank 0 runs alone: {"embed": fn(batch) -> x [M, C]}."""
    names = ("emb.patch.weight", "emb.patch.bias", "emb.cls", "emb.position")
    return {"embed": PatchEmbeddings(config, {n: store.read(n) for n in names})}


def load_kernels(threads: int = 1, int8: bool = False) -> None:
    """BERT's set (the layers' kernels are the same; the int8 ones for an int8 folder) and
    LayerNorm without a residual."""
    layers_kernels(threads, int8=int8)
    x = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)
    K.add_layernorm(x, None, None, np.ones(64, np.float32), np.zeros(64, np.float32), 1e-12)
