"""`hepti verify DIR`: check a converted model end to end, listing every problem found.

Checks each shard's size and sha256 against index.json, every tensor the config implies is
recorded with the right shape, and every recorded tensor is in its shard as a chunked,
Fletcher32-checked dataset of its recorded dtype (an int8 one with its float32 scales beside
it, of the shape its group size implies). When a shard's hash is wrong, its tensors are read through
so the message can name the damaged ones (Fletcher32 catches damage inside chunk data).
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import h5py
import numpy as np

from hepti.errors import HeptiError, WeightsError
from hepti.families import family
from hepti.kernels.int8 import n_groups
from hepti.weights import decoder, layout
from hepti.weights.index import INDEX_NAME, index_config, load_index

READ_BLOCK_BYTES = 16 * 1024 * 1024


def verify(path: str | Path) -> list[str]:
    """Problems found in the converted model at `path`; an empty list means it is intact."""
    path = Path(path)
    try:
        index = load_index(path)
    except WeightsError as e:
        return [str(e)]
    problems: list[str] = []
    tensors, shards = index["tensors"], index["shards"]
    damaged: set[str] = set()
    for shard, info in shards.items():
        p = path / shard
        if not p.is_file():
            problems.append(f"{p}: shard file missing")
            damaged.add(shard)
            continue
        size = p.stat().st_size
        if size != info.get("bytes"):
            problems.append(f"{p}: {size} bytes, {INDEX_NAME} records {info.get('bytes')} "
                            "(truncated or replaced)")
            damaged.add(shard)
        digest = file_sha256(p)
        if digest != info.get("sha256"):
            problems.append(f"{p}: sha256 {digest[:16]}... does not match {INDEX_NAME} "
                            f"({str(info.get('sha256'))[:16]}...): the file is corrupted; re-run `hepti convert`")
            damaged.add(shard)
    try:
        config = index_config(index)
    except HeptiError as e:
        problems.append(f"{path / INDEX_NAME}: config: {e}")
        config = None
    if config is not None:
        pooler = "pooler.weight" in tensors or "pooler.bias" in tensors
        expected = (decoder.expected_shapes(config) if family(config).layout == "decoder"
                    else layout.expected_shapes(config, pooler=pooler))
        for name, shape in expected.items():
            if name not in tensors:
                problems.append(f"{path / INDEX_NAME}: tensor {name} missing")
            elif tuple(tensors[name].get("shape", ())) != shape:
                problems.append(f"{path / INDEX_NAME}: tensor {name} has shape "
                                f"{tensors[name].get('shape')}, the config implies {list(shape)}")
        for name in tensors:
            if name not in expected:
                problems.append(f"{path / INDEX_NAME}: unexpected tensor {name}")
    by_shard: dict[str, list[str]] = {}
    for name, t in tensors.items():
        by_shard.setdefault(t.get("shard"), []).append(name)
    for shard, names in by_shard.items():
        if shard not in shards:
            problems.append(f"{path / INDEX_NAME}: tensors {', '.join(names[:4])} are in shard "
                            f"{shard!r}, which is not listed among the shards")
            continue
        if (path / shard).is_file():
            problems += _check_datasets(path / shard, names, tensors, read_all=shard in damaged)
    return problems


def _check_datasets(p: Path, names: list[str], tensors: dict, read_all: bool) -> list[str]:
    """Each named dataset exists as recorded; with read_all, read it through its checksums."""
    problems = []
    try:
        h5 = h5py.File(p, "r", rdcc_nbytes=0)
    except OSError as e:
        return [f"{p}: HDF5 cannot open it ({e})"]
    with h5:
        for name in names:
            t = tensors[name]
            datasets = [(name, name, t.get("dtype", layout.DTYPE), tuple(t["shape"]))]
            if t.get("dtype") == layout.INT8:
                try:
                    scales = (t["shape"][0], n_groups(t["shape"][1], t["group"]))
                    datasets.append((f"the scales of {name}", t["scales"], layout.DTYPE, scales))
                except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError):
                    problems.append(f"{p}: int8 tensor {name} has no valid 'group' and "
                                    f"'scales' in {INDEX_NAME}")
            for what, dname, dtype, shape in datasets:
                problems += _check_dataset(p, h5, what, dname, dtype, shape, t["chunk_rows"],
                                           read_all)
    return problems


def _check_dataset(p: Path, h5: h5py.File, what: str, dname: str, dtype: str, shape: tuple,
                   chunk_rows: int, read_all: bool) -> list[str]:
    """Dataset `dname` is there with this dtype, shape and row chunking; with read_all, read
    it through its checksums. `what` names it in messages."""
    try:
        dset = h5[dname]
        wrong = (dset.shape != shape or dset.dtype != np.dtype(dtype) or not dset.fletcher32
                 or dset.chunks is None or dset.chunks[0] != chunk_rows)
    except (KeyError, OSError, ValueError, TypeError) as e:
        return [f"{p}: tensor {what} cannot be opened ({e})"]
    if wrong:
        return [f"{p}: tensor {what} is {dset.dtype}{list(dset.shape)} chunks {dset.chunks} "
                f"fletcher32={dset.fletcher32}; {INDEX_NAME} says {dtype}{list(shape)} with "
                f"{chunk_rows}-row chunks"]
    if read_all and not _reads_cleanly(dset):
        return [f"{p}: tensor {what} fails its Fletcher32 checksum (damaged data)"]
    return []


def _reads_cleanly(dset: h5py.Dataset) -> bool:
    """Read a dataset through, a block of whole chunks at a time; False on a checksum error."""
    rows = dset.shape[0]
    row_bytes = dset.dtype.itemsize * int(np.prod(dset.shape[1:], dtype=np.int64))
    step = max(dset.chunks[0], READ_BLOCK_BYTES // max(row_bytes, 1) // dset.chunks[0] * dset.chunks[0])
    try:
        for a in range(0, rows, step):
            dset[a:min(a + step, rows)]
    except (OSError, RuntimeError):
        return False
    return True


def file_sha256(p: Path, fsync: bool = False) -> str:
    """sha256 of a file, read in 1 MiB pieces; with fsync, also flush it to disk (the writer
    does, so a shard survives a power cut once renamed into place)."""
    digest = hashlib.sha256()
    with open(p, "rb") as fh:
        while chunk := fh.read(1 << 20):
            digest.update(chunk)
        if fsync:
            os.fsync(fh.fileno())
    return digest.hexdigest()
