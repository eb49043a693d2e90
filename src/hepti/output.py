"""A run's output written as it is computed: one .npy array, filled batch by batch.

The array's shape is known before the first batch (n rows; hidden states padded to the longest
batch), so its header is written first and every completed batch's rows are appended in order
to `OUT.npy.partial`, beside the output. Only a complete array takes the output's name (an
atomic rename), so a file under that name is never half written. A run that is killed leaves
the partial file and `OUT.npy.partial.json`, which says which job it belongs to; `--resume`
checks that it is the same job and continues from the last complete batch. Rows of a batch that
was being written when the run died are cut off and computed again, so a resumed output is byte
for byte the output of a run that was never interrupted.
"""
from __future__ import annotations

import io
import json
import os
from pathlib import Path

import numpy as np

from hepti.errors import InputError

DTYPE = np.dtype("<f4")
PARTIAL_VERSION = 1


def npy_header(shape: tuple[int, ...]) -> bytes:
    """The .npy header np.save writes for a C-ordered float32 array of this shape."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(
        buf, {"descr": np.lib.format.dtype_to_descr(DTYPE), "fortran_order": False, "shape": shape})
    return buf.getvalue()


class OutputFile:
    """Write `shape` float32 rows to `path` in batches of `batch_rows`, from batch `start`."""

    def __init__(self, path: Path, shape: tuple[int, ...], batch_rows: int, job: dict,
                 resume: bool = False):
        self.path, self.shape, self.batch_rows = Path(path), tuple(int(d) for d in shape), batch_rows
        self.partial = self.path.with_name(self.path.name + ".partial")
        self.meta = self.path.with_name(self.path.name + ".partial.json")
        self.row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * DTYPE.itemsize
        self.header = npy_header(self.shape)
        self.job = {"hepti_partial": PARTIAL_VERSION, "shape": list(self.shape),
                    "batch_rows": batch_rows, **job}
        self.start = 0  # the first batch this run computes
        self.resumed = False
        n_batches = -(-self.shape[0] // batch_rows)
        if self.partial.exists():
            done = self._complete_batches(n_batches)
            if not resume:
                raise InputError(
                    f"{self.partial} holds {min(done * batch_rows, self.shape[0])} of "
                    f"{self.shape[0]} rows from an interrupted run; add --resume to continue it, "
                    f"or delete {self.partial} to start over")
            self._check_same_job()
            self.start, self.resumed = done, True
            self.f = open(self.partial, "r+b")
            self.f.truncate(len(self.header) + done * batch_rows * self.row_bytes)
            self.f.seek(0, os.SEEK_END)
        else:
            self.f = self._create()
        self.next = self.start

    def _create(self):
        try:
            tmp = self.meta.with_name(self.meta.name + ".tmp")
            tmp.write_text(json.dumps(self.job, indent=1) + "\n")
            os.replace(tmp, self.meta)
            f = open(self.partial, "wb")
        except OSError as e:
            raise InputError(f"--output {self.path}: cannot write beside it ({e.strerror or e}); "
                             "choose a folder you can write to") from None
        f.write(self.header)
        return f

    def _complete_batches(self, n_batches: int) -> int:
        """Whole batches in the partial file (a batch cut short by a kill does not count)."""
        rows = max(0, self.partial.stat().st_size - len(self.header)) // self.row_bytes
        return min(n_batches, rows // self.batch_rows) if rows < self.shape[0] else n_batches

    def _check_same_job(self) -> None:
        try:
            had = json.loads(self.meta.read_text())
        except (OSError, ValueError):
            raise InputError(f"{self.partial} has no readable {self.meta.name}, so it cannot be "
                             f"told whose rows it holds; delete {self.partial} to start over") from None
        differ = sorted(k for k in set(had) | set(self.job) if had.get(k) != self.job.get(k))
        if differ:
            raise InputError(
                f"--resume: {self.partial} was written by a different job ({', '.join(differ)} "
                f"differ); run the same command as before, or delete {self.partial} to start over")
        with open(self.partial, "rb") as f:
            if f.read(len(self.header)) != self.header:
                raise InputError(f"--resume: {self.partial} does not start with the expected "
                                 f"header; delete it to start over")

    def write(self, k: int, rows: np.ndarray) -> None:
        """Batch k's rows [b, ...], in order: batch k follows batch k-1."""
        if k != self.next:
            raise RuntimeError(f"batch {k} written out of order (expected {self.next})")
        rows = np.ascontiguousarray(rows, DTYPE)
        if rows.shape[1:] != self.shape[1:]:
            raise RuntimeError(f"batch {k}: rows of shape {rows.shape[1:]}, expected {self.shape[1:]}")
        self.f.write(rows.data)
        self.f.flush()  # to the page cache: a killed process keeps every batch written
        self.next += 1

    def commit(self) -> None:
        """Every row is in: sync, and give the array its final name."""
        size = self.f.tell()
        want = len(self.header) + self.shape[0] * self.row_bytes
        if size != want:
            raise RuntimeError(f"{self.partial}: {size} bytes written, expected {want}")
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.partial, self.path)
        self.meta.unlink(missing_ok=True)

    def close(self) -> None:
        """Stop without completing (an error or Ctrl-C): the partial file stays for --resume,
        unless it holds nothing of this job yet."""
        if self.f.closed:
            return
        self.f.close()
        if self.next == 0:
            self.partial.unlink(missing_ok=True)
            self.meta.unlink(missing_ok=True)
