"""Reading a converted model's tensors, or only a rank's slices of them, from the HDF5 shards.

Each read is one hyperslab read (`dset[a:b]`, rows of the stored tensor; see `layout`), into a
fresh C-contiguous float32 array. HDF5 fetches exactly the chunks those rows touch and checks
each chunk's Fletcher32 checksum; `bytes_read` adds up the stored size of those chunks, so it
counts what a rank pulls from its storage (metadata, a few KiB, aside). The chunk cache is off
(`rdcc_nbytes=0`): RAM is the scarce resource, and every chunk is read once per load anyway.

An int8 folder (`hepti convert --dtype int8`, `layout.quantized_tensors`) stores the layers'
GeMM matrices as int8 with float32 scales beside them: `read` gives those as a
`hepti.kernels.int8.QuantMatrix` of the same rows (a row range keeps whole groups, which run
along the rows), which the kernels multiply with directly; every other tensor as before.

Reads are safe from several threads (the runtime prefetches the next layer on a background
thread): h5py serialises HDF5 calls under its own lock, and the counter has a lock of its own.
"""
from __future__ import annotations

import threading
from pathlib import Path

import h5py
import numpy as np

from hepti.errors import WeightsError
from hepti.kernels.int8 import QuantMatrix, n_groups
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
        self.dtype = self.index.get("dtype", layout.DTYPE)  # "int8": see the module docstring
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
            want = t.get("dtype", layout.DTYPE)
            if want not in layout.DTYPES:
                raise WeightsError(f"{self.path / INDEX_NAME}: tensor {name} has dtype {want!r}, "
                                   f"this hepti reads {', '.join(layout.DTYPES)}; upgrade hepti "
                                   f"or {fix}")
            if dset.shape != tuple(t["shape"]) or dset.dtype != np.dtype(want):
                raise WeightsError(f"{self.path / shard}: tensor {name} is {dset.dtype}"
                                   f"{list(dset.shape)}, {INDEX_NAME} says {want}{t['shape']}; {fix}")
            self._dsets[name] = dset
            if want == layout.INT8:
                self._dsets[t["scales"]] = self._open_scales(name, t, fix)

    def _open_scales(self, name: str, t: dict, fix: str) -> h5py.Dataset:
        """The float32 scales dataset of int8 tensor `name`, checked against its shape."""
        shard = t["shard"]
        want = (t["shape"][0], n_groups(t["shape"][1], t.get("group", 0) or 1))
        try:
            dset = self._files[shard][t["scales"]]
        except (KeyError, OSError, TypeError) as e:
            raise WeightsError(f"{self.path / shard}: the scales of int8 tensor {name} cannot "
                               f"be opened ({e}); {fix}") from None
        if dset.shape != want or dset.dtype != np.float32:
            raise WeightsError(f"{self.path / shard}: the scales of int8 tensor {name} are "
                               f"{dset.dtype}{list(dset.shape)}, expected float32{list(want)} "
                               f"(groups of {t.get('group')}); {fix}")
        return dset

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
        """Bytes a read of `rows` of `name` fetches from storage (what bytes_read would add):
        an int8 tensor's chunks of int8 values and of scales."""
        t = self._entry(name)
        a, b = self._rows(name, rows)
        shape, per = tuple(t["shape"]), t["chunk_rows"]
        if t.get("dtype", layout.DTYPE) != layout.INT8:
            return layout.stored_chunk_bytes(shape, per, a, b)
        scales = (shape[0], n_groups(shape[1], t["group"]))
        return (layout.stored_chunk_bytes(shape, per, a, b, itemsize=1)
                + layout.stored_chunk_bytes(scales, per, a, b))

    def slice_bytes(self, i: int, heads: tuple[int, int] | None = None,
                    ffn: tuple[int, int] | None = None, *, whole: bool = True) -> int:
        """Bytes `read_layer_slice` with these arguments fetches from storage."""
        return sum(self.stored_bytes(n, rows) for n, rows in self._layer_reads(i, heads, ffn, whole))

    # --- reading ----------------------------------------------------------------------------
    def read(self, name: str, rows: tuple[int, int] | None = None) -> np.ndarray | QuantMatrix:
        """Rows [a, b) of a stored tensor (all rows if None): float32, C-contiguous, one read;
        an int8 tensor's as a QuantMatrix (its int8 rows and their scales' rows, two reads)."""
        t = self._entry(name)
        a, b = self._rows(name, rows)
        shape = (b - a,) + tuple(t["shape"][1:])
        if t.get("dtype", layout.DTYPE) == layout.INT8:
            out = QuantMatrix(self._read_rows(name, t, name, a, b, np.empty(shape, np.int8)),
                              self._read_rows(name, t, t["scales"], a, b, np.empty(
                                  (b - a, n_groups(shape[1], t["group"])), np.float32)),
                              t["group"])
        else:
            out = self._read_rows(name, t, name, a, b, np.empty(shape, np.float32))
        with self._lock:
            self._bytes_read += self.stored_bytes(name, (a, b))
        return out

    def _read_rows(self, name: str, t: dict, dset_name: str, a: int, b: int,
                   out: np.ndarray) -> np.ndarray:
        """Rows [a, b) of dataset `dset_name` (tensor `name`'s, or its scales) into `out`."""
        if b == a:
            return out
        dset = self._dsets.get(dset_name)
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
