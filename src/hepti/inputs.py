"""Reading inference inputs (texts, text files, id arrays) and checking output paths, up front.

Every check here runs before any model work, so a bad flag loses nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hepti.errors import InputError


@dataclass
class Batch:
    """One batch of encoded inputs: ids, mask, token_type [B, T] int64."""

    ids: np.ndarray
    mask: np.ndarray
    token_type: np.ndarray


def read_texts(texts: list[str] | None, input_file: str | None) -> list[str]:
    if texts:
        if any(not t.strip() for t in texts):
            raise InputError("--text got an empty string; give non-empty texts")
        return list(texts)
    path = Path(input_file)
    if not path.is_file():
        raise InputError(f"--input {path}: no such file")
    try:
        lines = [ln.rstrip("\r\n") for ln in path.read_text(encoding="utf-8").splitlines()]
    except UnicodeDecodeError as e:
        raise InputError(f"--input {path}: not UTF-8 text ({e})") from None
    lines = [ln for ln in lines if ln.strip()]
    if not lines:
        raise InputError(f"--input {path} is empty; it needs one text per line")
    return lines


def read_ids(path: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """An .npz with `ids` [n, L] and optional `mask`, `token_type` [n, L]."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--input-ids {p}: no such file")
    try:
        z = np.load(p, allow_pickle=False)
    except Exception as e:  # noqa: BLE001 - numpy raises many kinds for a bad file
        raise InputError(f"--input-ids {p}: not a readable .npz file ({e})") from None
    if not hasattr(z, "files"):
        raise InputError(f"--input-ids {p}: expected an .npz archive with an `ids` array")
    if "ids" not in z.files:
        raise InputError(f"--input-ids {p} has no array `ids` (it has: {', '.join(z.files) or 'none'});"
                         " save it with np.savez(path, ids=..., mask=...)")
    ids = z["ids"]
    if ids.ndim == 1:
        ids = ids[None]
    mask = z["mask"] if "mask" in z.files else None
    tt = z["token_type"] if "token_type" in z.files else None
    return ids, mask, tt


def check_output_path(path: str | None, flag: str = "--output") -> None:
    """Fail before any work if `path` (given with `flag`) could not be written."""
    if path is None:
        return
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise InputError(f"{flag} {path}: folder {parent} does not exist; create it first "
                         f"(mkdir -p {parent})")


def pad_to(batch: Batch, length: int, pad_id: int) -> Batch:
    """Pad a batch with padding tokens to `length` (for fixed-shape benchmarks)."""
    B, T = batch.ids.shape
    if T > length:
        raise InputError(f"inputs have {T} tokens, more than --seq {length}")
    if T == length:
        return batch
    ids = np.full((B, length), pad_id, np.int64)
    mask = np.zeros((B, length), np.int64)
    tt = np.zeros((B, length), np.int64)
    ids[:, :T], mask[:, :T], tt[:, :T] = batch.ids, batch.mask, batch.token_type
    return Batch(ids, mask, tt)
