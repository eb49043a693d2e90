"""Writing a converted model: sharded HDF5 + index.json, atomically, one block of rows at a time.

Tensors arrive as `TensorSpec`s whose `rows(a, b)` produce float32 rows in stored orientation,
so a writer never holds more than one block (`BLOCK_BYTES`) of one tensor. Everything is written
into a hidden sibling folder, fsync'ed, and renamed into place at the end: an interrupted or
failed write leaves no folder behind and never a half model (an existing model being replaced
stays intact until the final rename).

One writer per folder: `write_model` holds an exclusive `flock` on `.NAME.lock` beside the
folder from its first check to the rename, and a second writer into the same folder is refused
at once, naming the first one's pid. flock (not a pid file made with O_EXCL) because the kernel
drops it when its process dies, so a convert killed with -9 leaves no lock that blocks the next
one; the file itself is removed by the writer that held it. Whether the folder already holds a
model is checked again under the lock, right before the rename, so a model that appeared while
this one was being written (by a writer that took no lock) is not replaced without overwrite.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import sys
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import h5py
import numpy as np
from tqdm import tqdm

import hepti
from hepti.config import ModelConfig
from hepti.errors import WeightsError
from hepti.kernels.int8 import GROUP, quantize
from hepti.weights import layout
from hepti.weights.index import FORMAT, INDEX_NAME, format_version, is_model_dir, shard_name
from hepti.weights.verify import file_sha256

BLOCK_BYTES = 8 * 1024 * 1024  # rows handed to HDF5 per write (rounded to whole chunks)
# HDF5 file-format bounds: 1.10 brings the compact fixed-array chunk index; files stay
# readable by any HDF5 >= 1.10 (h5py wheels since 2.8), which edge devices may still carry.
LIBVER = ("v110", "v110")


@dataclass
class TensorSpec:
    """One tensor to write: its stored name and shape, and where its rows come from."""

    name: str
    shape: tuple[int, ...]
    rows: Callable[[int, int], np.ndarray]  # (start, stop) -> float32 [stop-start, *shape[1:]]
    origin: str | None = None  # HF name it was converted from
    transposed: bool = False
    group: int | None = None  # stored int8 in groups of this many values (None: float32)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows as they come (float32): what the progress bar counts."""
        return int(np.prod(self.shape, dtype=np.int64)) * layout.ITEMSIZE


def check_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse to write over anything but an empty folder, or a hepti model with overwrite."""
    if out.exists() and not out.is_dir():
        raise WeightsError(f"{out} exists and is a file; give a folder path for the converted model")
    if out.is_dir() and any(out.iterdir()):
        if not is_model_dir(out):
            raise WeightsError(f"{out} is not empty and is not a hepti model; refusing to write "
                               "there. Choose a new or empty folder")
        if not overwrite:
            raise WeightsError(f"{out} already holds a converted model; pass --force to "
                               "replace it (overwrite=True from Python), or choose another "
                               "folder")


def lock_path(out: Path) -> Path:
    """The lock file of writes into `out`: hidden, beside the folder (the folder is renamed)."""
    return out.parent / f".{out.name}.lock"


@contextmanager
def write_lock(out: Path) -> Iterator[None]:
    """Hold the one-writer lock of `out`, or raise WeightsError at once if another holds it."""
    path = lock_path(out)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = os.read(fd, 64).decode(errors="replace").strip()
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise WeightsError(f"could not lock {path} ({e}); convert into a folder on a "
                                   "local disk") from None
            who = f"process {holder}" if holder.isdigit() else "another process"
            raise WeightsError(f"another `hepti convert` ({who}) is writing a model into {out} "
                               f"right now (it holds {path}). Wait for it to finish and use its "
                               "model (re-run with --force once it is done to replace it), or "
                               "choose another --out") from None
        # The previous holder removes the file on release; if it did so between our open and
        # our flock, we hold a lock on a deleted file that the next writer cannot see: retry.
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
        fst = os.fstat(fd)
        if st is not None and (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino):
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        yield
    finally:
        try:
            os.unlink(path)  # while still locked, so no one else is holding this file
        except FileNotFoundError:
            pass
        os.close(fd)


def plan_shards(specs: list[TensorSpec], shard_layers: int | None,
                max_shard_bytes: int | None) -> list[list[TensorSpec]]:
    """Group tensors into shards: whole layers, at most `shard_layers` layers and about
    `max_shard_bytes` bytes per shard (either limit may be None); embeddings (and pooler)
    open the first shard. A group bigger than the byte cap gets a shard of its own."""
    if shard_layers is not None and shard_layers < 1:
        raise ValueError(f"shard_layers must be >= 1 or None, got {shard_layers}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1 or None, got {max_shard_bytes}")
    groups: list[tuple[int | None, list[TensorSpec]]] = []
    for spec in specs:
        layer, _ = layout.local_name(spec.name)
        if not groups or groups[-1][0] != layer:
            groups.append((layer, []))
        groups[-1][1].append(spec)
    shards: list[list[TensorSpec]] = [[]]
    n_layers = n_bytes = 0
    for layer, group in groups:
        size = sum(s.nbytes for s in group)
        full = ((layer is not None and shard_layers is not None and n_layers >= shard_layers)
                or (max_shard_bytes is not None and n_bytes + size > max_shard_bytes))
        if shards[-1] and full:
            shards.append([])
            n_layers = n_bytes = 0
        shards[-1].extend(group)
        n_layers += layer is not None
        n_bytes += size
    return shards


def write_model(out: str | Path, config: ModelConfig, specs: list[TensorSpec], *, source: dict,
                copy_files: dict[str, Path] | None = None, shard_layers: int | None = 4,
                max_shard_bytes: int | None = None, overwrite: bool = False,
                progress: bool = True, desc: str = "convert",
                chunk_rows: Callable | None = None, dtype: str = layout.DTYPE,
                quantized: Iterable[str] | Mapping[str, int] | None = None) -> Path:
    """Write `specs` as shard-*.h5 + index.json into `out` atomically; returns `out`.

    `chunk_rows(name, shape, config)`: rows per HDF5 chunk, for a family whose operator graph
    `layout.chunk_rows` does not know yet (the decoder: `hepti.weights.decoder.chunk_rows`).
    dtype "int8" stores the layers' GeMM matrices (`layout.quantized_tensors`) as int8 with
    one float32 scale per group of `hepti.kernels.int8.GROUP` values (a dataset NAME.scales
    beside each), recorded in index.json (format version 2); the rest stays float32.
    `quantized`: the stored names to make int8, for a family whose operator graph
    `layout.quantized_tensors` does not know (the decoder: `hepti.weights.decoder.int8_tensors`);
    a mapping gives each its group size (index.json records a group per tensor).
    """
    out = Path(out)
    layout.check_dtype(dtype, config)
    if dtype == layout.INT8:
        if quantized is None:
            own = set(layout.quantized_tensors(config))
            quantized = [s.name for s in specs if _in_layer(s.name, own)]
        groups = dict(quantized) if isinstance(quantized, Mapping) else dict.fromkeys(quantized,
                                                                                       GROUP)
        specs = [_with_group(s, groups[s.name]) if s.name in groups else s for s in specs]
    check_out_dir(out, overwrite)
    shards = plan_shards(specs, shard_layers, max_shard_bytes)
    out.parent.mkdir(parents=True, exist_ok=True)
    with write_lock(out):
        check_out_dir(out, overwrite)  # a writer may have finished between the check and the lock
        return _write_locked(out, config, specs, shards, source=source, copy_files=copy_files,
                             overwrite=overwrite, progress=progress, desc=desc,
                             chunk_rows=chunk_rows or layout.chunk_rows, dtype=dtype)


def _in_layer(name: str, locals_: set[str]) -> bool:
    """Whether `name` is a per-layer tensor whose local name is among `locals_`."""
    layer, local = layout.local_name(name)
    return layer is not None and local in locals_


def _with_group(spec: TensorSpec, group: int) -> TensorSpec:
    return TensorSpec(spec.name, spec.shape, spec.rows, spec.origin, spec.transposed, group)


def _write_locked(out: Path, config: ModelConfig, specs: list[TensorSpec],
                  shards: list[list[TensorSpec]], *, source: dict,
                  copy_files: dict[str, Path] | None, overwrite: bool, progress: bool,
                  desc: str, chunk_rows: Callable = layout.chunk_rows,
                  dtype: str = layout.DTYPE) -> Path:
    """write_model's body, run while holding out's write lock."""
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        index = {"format": FORMAT, "format_version": format_version(dtype),
                 "hepti_version": hepti.__version__, "source": source,
                 "config": config.to_dict(), "files": [], "tensors": {}, "shards": {}}
        if dtype != layout.DTYPE:
            index["dtype"] = dtype
        total = sum(s.nbytes for s in specs)
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc,
                  disable=not progress, file=sys.stderr) as bar:
            for k, group in enumerate(shards):
                fname = shard_name(k)
                with h5py.File(tmp / fname, "w", libver=LIBVER) as h5:
                    for spec in group:
                        rows = _write_tensor(h5, spec, config, bar, chunk_rows)
                        entry = index["tensors"][spec.name] = {
                            "shard": fname, "shape": list(spec.shape), "dtype": layout.DTYPE,
                            "chunk_rows": rows, "from": spec.origin, "transposed": spec.transposed}
                        if spec.group is not None:
                            entry.update(dtype=layout.INT8, group=spec.group,
                                         scales=spec.name + layout.SCALES_SUFFIX)
                index["shards"][fname] = {"sha256": _sha256_and_sync(tmp / fname),
                                          "bytes": (tmp / fname).stat().st_size}
        for name, path in sorted((copy_files or {}).items()):
            shutil.copyfile(path, tmp / name)
            _sha256_and_sync(tmp / name)
            index["files"].append(name)
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=1) + "\n")
        _sha256_and_sync(tmp / INDEX_NAME)
        _fsync_dir(tmp)
        check_out_dir(out, overwrite)  # again, under the lock: what is there now is replaced
        _install(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_tensor(h5: h5py.File, spec: TensorSpec, config: ModelConfig, bar: tqdm,
                  chunk_rows: Callable = layout.chunk_rows) -> int:
    """Create one chunked, Fletcher32-checked dataset and fill it block by block; an int8
    one (spec.group) gets its scales dataset beside it, chunked by the same rows, each block
    quantised as it comes (groups run along a row, so blocks of rows quantise alone)."""
    rows = chunk_rows(spec.name, spec.shape, config)
    quant = spec.group is not None
    dset = h5.create_dataset(spec.name, shape=spec.shape,
                             dtype=layout.INT8 if quant else layout.DTYPE,
                             chunks=(rows,) + tuple(spec.shape[1:]), fletcher32=True)
    if quant:
        s_shape = (spec.shape[0], -(-spec.shape[1] // spec.group))
        sdset = h5.create_dataset(spec.name + layout.SCALES_SUFFIX, shape=s_shape,
                                  dtype=layout.DTYPE, chunks=(rows, s_shape[1]),
                                  fletcher32=True)
    row_bytes = spec.nbytes // max(spec.shape[0], 1)
    block = max(rows, (BLOCK_BYTES // max(row_bytes, 1)) // rows * rows)
    for a in range(0, spec.shape[0], block):
        b = min(a + block, spec.shape[0])
        data = spec.rows(a, b)  # [b-a, *shape[1:]]
        if data.shape != (b - a,) + tuple(spec.shape[1:]) or data.dtype != np.float32:
            raise AssertionError(f"{spec.name} rows {a}:{b} came as {data.dtype}{data.shape}")
        if quant:
            qm = quantize(np.ascontiguousarray(data), spec.group)
            dset.write_direct(qm.q, dest_sel=np.s_[a:b])
            sdset.write_direct(qm.scales, dest_sel=np.s_[a:b])
        else:
            dset.write_direct(np.ascontiguousarray(data), dest_sel=np.s_[a:b])
        bar.update(data.nbytes)
    return rows


def _sha256_and_sync(path: Path) -> str:
    """sha256 of a file, and fsync it so it survives a power cut once renamed into place."""
    return file_sha256(path, fsync=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _install(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place, replacing an old model only at the last step."""
    old = None
    if out.exists():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(tmp, out)
    except OSError as e:
        if old is not None:
            os.rename(old, out)
        raise WeightsError(f"could not move the converted model into {out} ({e}); "
                           "was something else writing there?") from None
    _fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
