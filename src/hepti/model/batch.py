"""One batch of a model's encoded inputs, as every family's primary operators take it."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class Batch:
    """One batch of encoded inputs: ids, mask, token_type [B, T] int64 (texts), or pixels
    [B, 3, H, W] float32 with a mask of ones [B, T] (images: T patches + CLS). The mask's shape
    is the batch's."""

    ids: np.ndarray | None
    mask: np.ndarray
    token_type: np.ndarray | None
    pixels: np.ndarray | None = None
