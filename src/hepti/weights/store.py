"""Reading a converted model's tensors, or only a rank's slices of them, from the HDF5 shards.

Each read is one hyperslab read (`dset[a:b]`, rows of the stored tensor; see `layout`), into a
fresh C-contiguous float32 array. HDF5 fetches exactly the chunks those rows touch and checks
each chunk's Fletcher32 checksum; `bytes_read` adds up the stored size of those chunks, so it
counts what a rank pulls from its storage (metadata, a few KiB, aside). The chunk cache is off
(`rdcc_nbytes=0`): RAM is the scarce resource, and every chunk is read once per load anyway.

Reads are safe from several threads (the runtime prefetches the next layer on a background
thread): h5py serialises HDF5 calls under its own lock, and the counter has a lock of its own.
"""
from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np

from hepti.errors import WeightsError
from hepti.weights import layout
from hepti.weights.index import INDEX_NAME, index_config, load_index


class WeightStore:
    """Open a converted model folder (index.json + shard-*.h5) for reading slices.

    Checks at open: index.json, every shard present with its recorded size, every tensor
    present with its recorded shape. Damage inside a chunk shows up on the read that touches it.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.index = load_index(self.path)
        self.config = index_config(self.index)
        self._lock = threading.Lock()
        self._bytes_read = 0
        self._files: dict[str, h5py.File] = {}
        self._dsets: dict[str, h5py.Dataset] = {}
        try:
            self._open()
        except BaseException:
            self.close()
            raise

    def _open(self) -> None:
        fix = f"run `hepti verify {self.path}`, then re-run `hepti convert` to rewrite it"
        for shard, info in self.index["shards"].items():
            p = self.path / shard
            if not p.is_file():
                raise WeightsError(f"{p}: shard file missing (listed in {INDEX_NAME}); "
                                   f"copy it back or re-run `hepti convert` into {self.path}")
            size = p.stat().st_size
            if size != info["bytes"]:
                raise WeightsError(f"{p}: {size} bytes but {INDEX_NAME} records {info['bytes']} "
                                   f"(truncated or replaced); {fix}")
            try:
                self._files[shard] = h5py.File(p, "r", rdcc_nbytes=0)
            except OSError as e:
                raise WeightsError(f"{p}: HDF5 cannot open it ({e}); {fix}") from None
        for name, t in self.index["tensors"].items():
            shard = t.get("shard")
            if shard not in self._files:
                raise WeightsError(f"{self.path / INDEX_NAME}: tensor {name} is in shard "
                                   f"{shard!r}, which the index does not list; {fix}")
            try:
                dset = self._files[shard][name]
            except (KeyError, OSError) as e:
                raise WeightsError(f"{self.path / shard}: tensor {name} cannot be opened ({e}); "
                                   f"{fix}") from None
            if dset.shape != tuple(t["shape"]) or dset.dtype != np.float32:
                raise WeightsError(f"{self.path / shard}: tensor {name} is {dset.dtype}"
                                   f"{list(dset.shape)}, {INDEX_NAME} says float32{t['shape']}; {fix}")
            self._dsets[name] = dset

    # --- what is stored -------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.index["tensors"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._entry(name)["shape"])

    @property
    def bytes_read(self) -> int:
        """Stored bytes of every chunk the reads so far touched (a partial chunk counts whole)."""
        with self._lock:
            return self._bytes_read

    def stored_bytes(self, name: str, rows: tuple[int, int] | None = None) -> int:
        """Bytes a read of `rows` of `name` fetches from storage (what bytes_read would add)."""
        t = self._entry(name)
        a, b = self._rows(name, rows)
        return layout.stored_chunk_bytes(tuple(t["shape"]), t["chunk_rows"], a, b)

    def slice_bytes(self, i: int, heads: tuple[int, int] | None = None,
                    ffn: tuple[int, int] | None = None, *, whole: bool = True) -> int:
        """Bytes `read_layer_slice` with these arguments fetches from storage."""
        return sum(self.stored_bytes(n, rows) for n, rows in self._layer_reads(i, heads, ffn, whole))

    # --- reading ----------------------------------------------------------------------------
    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray:
        """Rows [a, b) of a stored tensor (all rows if None): float32, C-contiguous, one read."""
        t = self._entry(name)
        a, b = self._rows(name, rows)
        out = np.empty((b - a,) + tuple(t["shape"][1:]), dtype=np.float32)
        if b == a:
            return out
        dset = self._dsets.get(name)
        if dset is None:
            raise WeightsError(f"{self.path}: the weight store is closed")
        try:
            dset.read_direct(out, source_sel=np.s_[a:b])
        except (OSError, ValueError, RuntimeError) as e:
            shard = self.path / t["shard"]
            raise WeightsError(
                f"{shard}: tensor {name} (rows {a}:{b}) cannot be read: {e}. The file is damaged "
                f"(checksum failure) or was changed; run `hepti verify {self.path}` and re-run "
                "`hepti convert` to rewrite it") from None
        with self._lock:
            self._bytes_read += layout.stored_chunk_bytes(tuple(t["shape"]), t["chunk_rows"], a, b)
        return out

    def read_layer_slice(self, i: int, heads: tuple[int, int] | None = None,
                         ffn: tuple[int, int] | None = None, *, whole: bool = True
                         ) -> dict[str, np.ndarray]:
        """A rank's slice of layer i, keyed by local name ('attn.q.weight', ...; the family's
        `layout.layer_tensors(config)`).

        heads=(h0, h1) and ffn=(f0, f1) are half-open ranges (None: all). Sliced tensors hold
        the rows `layout.row_range` gives; an empty range gives 0-row arrays and reads nothing.
        Tensors that are never sliced (LayerNorms, block-wise biases) are read whole, or left
        out with whole=False (for a rank that holds no token rows either).
        """
        return {layout.local_name(n)[1]: self.read(n, rows)
                for n, rows in self._layer_reads(i, heads, ffn, whole)}

    def _layer_reads(self, i, heads, ffn, whole) -> list[tuple[str, tuple[int, int] | None]]:
        """(full name, rows) of every read a layer slice consists of."""
        cfg = self.config
        if not 0 <= i < cfg.num_hidden_layers:
            raise IndexError(f"layer {i} out of range; the model has {cfg.num_hidden_layers}")
        ranges = {"heads": _check_range("heads", heads, cfg.num_attention_heads),
                  "ffn": _check_range("ffn", ffn, cfg.intermediate_size)}
        reads = []
        for local in layout.layer_tensors(cfg):
            dim = layout.slice_dim(local, cfg)
            if dim is not None:
                reads.append((layout.layer_name(i, local),
                              layout.row_range(local, *ranges[dim], cfg)))
            elif whole:
                reads.append((layout.layer_name(i, local), None))
        return reads

    def _entry(self, name: str) -> dict:
        try:
            return self.index["tensors"][name]
        except KeyError:
            raise WeightsError(f"{self.path}: no tensor {name!r} in this model") from None

    def _rows(self, name: str, rows: tuple[int, int] | None) -> tuple[int, int]:
        n = self.index["tensors"][name]["shape"][0]
        if rows is None:
            return 0, n
        a, b = int(rows[0]), int(rows[1])
        if not 0 <= a <= b <= n:
            raise ValueError(f"rows {a}:{b} of {name} out of range 0:{n}")
        return a, b

    # --- lifetime ----------------------------------------------------------------------------
    def close(self) -> None:
        """Close every shard; idempotent."""
        self._dsets = {}
        files, self._files = self._files, {}
        for f in files.values():
            try:
                f.close()
            except Exception:  # closing a damaged file must not hide the error that got us here
                pass

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"WeightStore({str(self.path)!r}, {self.config.num_hidden_layers} layers, "
                f"{len(self._files)} shards)")


def _check_range(what: str, rng: tuple[int, int] | None, total: int) -> tuple[int, int]:
    if rng is None:
        return 0, total
    a, b = int(rng[0]), int(rng[1])
    if not 0 <= a <= b <= total:
        raise ValueError(f"{what} range {a}:{b} out of range 0:{total}")
    return a, b
