"""Text -> ids with the model's own tokenizer.json (the `tokenizers` package)."""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from hepti.errors import InputError

log = logging.getLogger("hepti")


class TextTokenizer:
    """Pads a batch to its longest text and truncates to the model's positions (with a warning)."""

    def __init__(self, path: str | Path, max_len: int, pad_id: int = 0):
        from tokenizers import Tokenizer

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
        self.tok.no_truncation()
        self.max_len = max_len
        self.pad_id = pad_id

    def encode(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> ids [B, T] int64, mask [B, T] int64 (1 = real token), token_type [B, T] int64."""
        if not texts:
            raise InputError("no input texts")
        encs = self.tok.encode_batch(list(texts))
        long = [i for i, e in enumerate(encs) if len(e.ids) > self.max_len]
        if long:
            log.warning("%d input(s) longer than the model's %d positions were truncated "
                        "(first: input %d, %d tokens)", len(long), self.max_len, long[0],
                        len(encs[long[0]].ids))
            self.tok.enable_truncation(self.max_len)
            try:
                encs = self.tok.encode_batch(list(texts))
            finally:
                self.tok.no_truncation()
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
