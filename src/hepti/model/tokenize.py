"""Text -> ids with the model's own tokenizer.json (the `tokenizers` package)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hepti.errors import InputError

log = logging.getLogger("hepti")


class TextTokenizer:
    """Pads a batch to its longest text and truncates to `max_len` tokens.

    `token_counts` measures texts before any work (how many will be truncated, how long the
    longest is); `encode` then turns one batch at a time into arrays."""

    def __init__(self, path: str | Path, max_len: int, pad_id: int = 0):
        from tokenizers import Tokenizer  # local: start-up time (tokenizers)

        path = Path(path)
        if not path.exists():
            raise InputError(f"{path.parent} has no tokenizer.json (a `hepti convert --random` "
                             "model has none), so texts cannot become token ids. Give the ids "
                             "with --input-ids FILE.npz: an .npz with an integer array `ids` "
                             "[n, L] and optionally `mask` [n, L] (1 = token, 0 = padding) and "
                             "`token_type` [n, L], e.g. np.savez('ids.npz', ids=ids, mask=mask). "
                             "Or convert a checkpoint that has tokenizer.json")
        self.tok = Tokenizer.from_file(str(path))
        # Padding and truncation are ours to set, whatever the file says.
        self.tok.no_padding()
        self.tok.enable_truncation(max_len)
        self.max_len = max_len
        self.pad_id = pad_id

    def token_counts(self, texts: list[str], chunk: int = 4096) -> np.ndarray:
        """Tokens per text before truncation, int64 [n] (in chunks: no ids are kept)."""
        self.tok.no_truncation()
        try:
            return np.array([len(e.ids) for i in range(0, len(texts), chunk)
                             for e in self.tok.encode_batch(texts[i:i + chunk])], np.int64)
        finally:
            self.tok.enable_truncation(self.max_len)

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> ids [B, T] int64, mask [B, T] int64 (1 = real token), token_type [B, T] int64."""
        if not texts:
            raise InputError("no input texts")
        encs = self.tok.encode_batch(list(texts))
        T = max(len(e.ids) for e in encs)
        B = len(encs)
        ids = np.full((B, T), self.pad_id, dtype=np.int64)
        mask = np.zeros((B, T), dtype=np.int64)
        tt = np.zeros((B, T), dtype=np.int64)
        for b, e in enumerate(encs):
            n = len(e.ids)
            ids[b, :n] = e.ids
            mask[b, :n] = 1
            tt[b, :n] = e.type_ids
        return ids, mask, tt
