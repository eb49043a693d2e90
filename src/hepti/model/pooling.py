"""Sentence embeddings from hidden states: none, mean over real tokens, or CLS; optional L2."""
from __future__ import annotations

import numpy as np

POOLS = ("none", "mean", "cls")


def pool(hidden: np.ndarray, mask: np.ndarray, kind: str = "mean", normalize: bool = False
         ) -> np.ndarray:
    """hidden [B, T, C], mask [B, T] -> [B, C] (mean/cls) or [B, T, C] (none)."""
    if kind == "none":
        out = hidden
    elif kind == "cls":
        out = hidden[:, 0, :]
    elif kind == "mean":
        m = mask.astype(np.float32)[:, :, None]  # (B, T, 1)
        out = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
    else:
        raise ValueError(f"unknown pooling {kind!r}; choose one of {', '.join(POOLS)}")
    if normalize:
        norm = np.linalg.norm(out, axis=-1, keepdims=True)
        out = out / np.maximum(norm, 1e-12)  # as torch.nn.functional.normalize
    return np.ascontiguousarray(out, dtype=np.float32)
