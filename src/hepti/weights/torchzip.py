"""Reading a PyTorch state_dict (.pt/.pth) into numpy without torch and without running its pickle.

`torch.save` (torch >= 1.6) writes a zip: `<prefix>/data.pkl` pickles the dict, each tensor as a
call `torch._utils._rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks)`, each
storage as a persistent id `('storage', torch.FloatStorage, key, location, numel)` whose bytes
are the record `<prefix>/data/<key>`, in the byte order named by `<prefix>/byteorder` (little
when the record is absent, as torch assumes). Before 1.6 torch wrote the legacy stream, which
torchvision's own `mobilenet_v2-b0353104.pth` still is: five pickles back to back (magic number,
protocol 1001, system info, the dict with 6-tuple ids ending in a storage-view field, the list of
storage keys), then each storage as a little-endian int64 element count and its little-endian
bytes. `read_torch_file` takes either; `read_torch_zip` and `read_torch_legacy` one each.

A pickle is a program: unpickling calls whatever globals it names. Here `find_class` resolves
only the names in `ALLOWED` (tensor rebuilds, `collections.OrderedDict`, the storage types),
none of which is torch's own, and refuses anything else before it is imported or called. Tensors
leave the pickle as immutable placeholders and become numpy arrays afterwards, each offset, size
and stride checked against its storage. Values keep their dtype (float16 stays float16), except
bfloat16, which numpy lacks and which becomes float32 exactly (its bits are a float32's top half).
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, NamedTuple

import numpy as np

from hepti.errors import WeightsError

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # first pickle of torch's legacy format
LEGACY_PROTOCOL = 1001                 # its second pickle
ACCEPTED = ("hepti reads only PyTorch state_dicts of tensors (torch.save of model.state_dict(), "
            "zip or legacy format): the pickle may name tensor rebuilds, OrderedDict and storage "
            "types, nothing else")


class _StorageType(NamedTuple):
    """What the pickle gets for `torch.FloatStorage` & co.: a name and the numpy dtype of its data.

    Immutable and not callable, so no pickle opcode (REDUCE, BUILD) can use or alter it.
    """

    name: str
    dtype: type  # numpy scalar type of the stored elements (BFloat16: uint16, widened later)


STORAGE_TYPES = {t.name: t for t in (
    _StorageType("FloatStorage", np.float32), _StorageType("DoubleStorage", np.float64),
    _StorageType("HalfStorage", np.float16), _StorageType("BFloat16Storage", np.uint16),
    _StorageType("LongStorage", np.int64), _StorageType("IntStorage", np.int32),
    _StorageType("ShortStorage", np.int16), _StorageType("CharStorage", np.int8),
    _StorageType("ByteStorage", np.uint8), _StorageType("BoolStorage", np.bool_))}


class _Storage(NamedTuple):
    """A persistent id resolved: storage `key`, elements [start, start + length) of it."""

    key: str
    type: _StorageType
    start: int   # a legacy storage view's first element (0 otherwise)
    length: int  # elements this storage (view) holds


class _Tensor(NamedTuple):
    """A rebuilt tensor whose data is not read yet (`_to_array` checks its bounds then)."""

    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Refused(Exception):
    """A rebuild call whose arguments hepti will not accept; `_load_from` adds the path."""


class _Allowed(NamedTuple):
    """An allowed callable global: immutable, so a BUILD opcode cannot change what it calls."""

    name: str
    fn: Callable[..., Any]

    def __call__(self, *args):
        return self.fn(*args)


def _rebuild_tensor(storage, offset, size, stride) -> _Tensor:
    """torch._utils._rebuild_tensor's arguments, type-checked (bounds wait for the data)."""
    if not isinstance(storage, _Storage):
        raise _Refused(f"a tensor is rebuilt from {type(storage).__name__}, not a storage")
    if not (_is_int(offset) and _is_ints(size) and _is_ints(stride)):
        raise _Refused(f"a tensor has a malformed offset, size or stride: {str(offset)[:20]}, "
                       f"{str(size)[:40]}, {str(stride)[:40]}")
    return _Tensor(storage, offset, tuple(size), tuple(stride))


def _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, backward_hooks,
                       metadata=None) -> _Tensor:
    """torch._utils._rebuild_tensor_v2: hooks must be empty (torch never saves them), and a
    conjugate or negative view (`metadata`) would change the values, so it is refused."""
    if not isinstance(backward_hooks, dict) or backward_hooks:
        raise _Refused("a tensor carries backward hooks; torch never saves those")
    if metadata:
        raise _Refused(f"a tensor carries metadata {str(metadata)[:40]} (a conjugate or "
                       "negative view); save it with .resolve_conj().resolve_neg() first")
    return _rebuild_tensor(storage, offset, size, stride)


def _rebuild_parameter(data, requires_grad, backward_hooks) -> _Tensor:
    """torch._utils._rebuild_parameter: an nn.Parameter is its data."""
    if not isinstance(data, _Tensor):
        raise _Refused(f"a parameter wraps {type(data).__name__}, not a tensor")
    return data


ALLOWED: dict[str, Any] = {
    "torch._utils._rebuild_tensor_v2": _Allowed("_rebuild_tensor_v2", _rebuild_tensor_v2),
    "torch._utils._rebuild_tensor": _Allowed("_rebuild_tensor", _rebuild_tensor),
    "torch._utils._rebuild_parameter": _Allowed("_rebuild_parameter", _rebuild_parameter),
    "collections.OrderedDict": collections.OrderedDict,  # an immutable built-in type
    **{f"torch.{name}": t for name, t in STORAGE_TYPES.items()},
}


class _Unpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves only `ALLOWED` globals and torch's storage ids.

    `id_fields`: 4 after the 'storage' tag in the zip format, 5 (a view field) in the legacy one.
    Every storage seen is kept in `storages` (key -> (type, elements)).
    """

    def __init__(self, file: BinaryIO, path: Path, id_fields: int,
                 storages: dict[str, tuple[_StorageType, int]]):
        super().__init__(file, encoding="utf-8")  # torch.load's default for Python 2 strings
        self.path, self.id_fields, self.storages = path, id_fields, storages

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get(f"{module}.{name}")
        if found is None:
            raise WeightsError(f"{self.path}: refused to load: its pickle asks for the global "
                               f"{module}.{name}. {ACCEPTED}. Nothing in the file was run")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 1 + self.id_fields and pid[0] == "storage"):
            raise WeightsError(f"{self.path}: refused to load: unexpected persistent id "
                               f"{str(pid)[:80]} (torch writes ('storage', type, key, location, "
                               f"numel{', view' if self.id_fields == 5 else ''}))")
        stype, key, _location, numel = pid[1:5]
        if not (isinstance(stype, _StorageType) and isinstance(key, str) and _is_int(numel)
                and numel >= 0):
            raise WeightsError(f"{self.path}: malformed storage id {str(pid)[:80]}")
        known = self.storages.setdefault(key, (stype, numel))
        if known != (stype, numel):
            raise WeightsError(f"{self.path}: storage {key} is declared twice, as {known[0].name} "
                               f"x {known[1]} and as {stype.name} x {numel}")
        view = pid[5] if self.id_fields == 5 else None
        if view is None:
            return _Storage(key, stype, 0, numel)
        if not (isinstance(view, tuple) and len(view) == 3 and _is_int(view[1])
                and _is_int(view[2]) and 0 <= view[1] and 0 <= view[2]
                and view[1] + view[2] <= numel):
            raise WeightsError(f"{self.path}: storage {key} has a malformed view {view!r}")
        return _Storage(key, stype, view[1], view[2])


def read_torch_file(path: str | Path) -> dict[str, np.ndarray]:
    """A state_dict saved by torch.save, zip or legacy format: an OrderedDict name -> array."""
    path = Path(path)
    try:
        legacy = _looks_legacy(path)
    except OSError as e:  # no such file, a directory, no permission
        raise WeightsError(f"{path}: cannot read it ({e.strerror or e}); give a .pt/.pth file "
                           "written by torch.save") from None
    if legacy:  # first: its float data could end in bytes that look like a zip's
        return read_torch_legacy(path)
    if zipfile.is_zipfile(path):
        return read_torch_zip(path)
    if tarfile.is_tarfile(path):
        raise WeightsError(f"{path} is a tar archive, torch's format before 0.4 (or no torch "
                           "file at all); load it with an old torch and save the state_dict "
                           "again with torch.save")
    raise WeightsError(f"{path} is not a PyTorch checkpoint (neither torch.save's zip nor its "
                       "legacy pickle stream); give a .pt/.pth file written by torch.save")


def read_torch_zip(path: str | Path) -> dict[str, np.ndarray]:
    """A state_dict in torch.save's zip format (torch >= 1.6): an OrderedDict name -> array."""
    path = Path(path)
    if not zipfile.is_zipfile(path):
        legacy = (" It is torch's legacy (pre-1.6) format: read it with read_torch_file"
                  if _looks_legacy(path) else "")
        raise WeightsError(f"{path} is not a zip archive, so not a checkpoint that torch.save "
                           f"wrote in its zip format.{legacy}")
    try:
        with zipfile.ZipFile(path) as zf:
            return _read_zip(path, zf)
    except (zipfile.BadZipFile, EOFError) as e:  # a bad CRC, a cut record, ...
        raise WeightsError(f"{path}: corrupted zip archive ({e}); the file is truncated or "
                           "damaged, fetch it again") from None


def _read_zip(path: Path, zf: zipfile.ZipFile) -> dict[str, np.ndarray]:
    """read_torch_zip on the open archive: one <prefix>/data.pkl, its storages under data/."""
    names = set(zf.namelist())
    pickles = sorted(n for n in names if n.count("/") == 1 and n.endswith("/data.pkl"))
    if len(pickles) != 1:
        script = any(n.endswith("/constants.pkl") for n in names)
        what = ("a TorchScript archive (torch.jit.save)" if script else
                f"a zip with {len(pickles)} top-level */data.pkl records")
        raise WeightsError(f"{path} is {what}, not a torch.save checkpoint; save "
                           "model.state_dict() with torch.save")
    prefix = pickles[0][:-len("data.pkl")]
    order = zf.read(prefix + "byteorder") if prefix + "byteorder" in names else b"little"
    if order not in (b"little", b"big"):
        raise WeightsError(f"{path}: unknown byte order {order[:20]!r} in {prefix}byteorder "
                           "(torch writes 'little' or 'big')")
    storages: dict[str, tuple[_StorageType, int]] = {}
    obj = _load(zf.read(pickles[0]), path, "data.pkl", 4, storages)

    def read(key: str, stype: _StorageType, numel: int) -> bytes:
        record = prefix + "data/" + key
        if record not in names:
            raise WeightsError(f"{path}: storage {key} has no record {record}; the file is "
                               "truncated or corrupted")
        data, want = zf.read(record), numel * np.dtype(stype.dtype).itemsize
        if len(data) != want:
            raise WeightsError(f"{path}: storage {key} has {len(data)} bytes, {stype.name} x "
                               f"{numel} needs {want}; the file is truncated or corrupted")
        return data

    return _state_dict(path, obj, storages, read, "<" if order == b"little" else ">")


def read_torch_legacy(path: str | Path) -> dict[str, np.ndarray]:
    """A state_dict in torch's legacy (pre-1.6) stream format: an OrderedDict name -> array."""
    path = Path(path)
    with open(path, "rb") as fh:
        magic = _load_from(fh, path, "the magic number", 4, {})
        if magic != LEGACY_MAGIC:
            raise WeightsError(f"{path} is not torch's legacy format (it starts with "
                               f"{str(magic)[:40]}, not torch's magic number)")
        protocol = _load_from(fh, path, "the protocol version", 4, {})
        if protocol != LEGACY_PROTOCOL:
            raise WeightsError(f"{path}: legacy protocol {protocol!r}, torch writes "
                               f"{LEGACY_PROTOCOL}")
        _load_from(fh, path, "the system info", 4, {})  # byte order there: data is little-endian
        storages: dict[str, tuple[_StorageType, int]] = {}
        obj = _load_from(fh, path, "the state_dict", 5, storages)
        keys = _load_from(fh, path, "the storage keys", 4, {})
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
            raise WeightsError(f"{path}: the storage key list is malformed")
        size = os.fstat(fh.fileno()).st_size
        data: dict[str, bytes] = {}
        for key in keys:  # each: int64 element count, little-endian, then the elements
            if key not in storages or key in data:
                raise WeightsError(f"{path}: storage {key} is listed but not used, or twice")
            stype, numel = storages[key]
            head = fh.read(8)
            nbytes = numel * np.dtype(stype.dtype).itemsize
            left = size - fh.tell()
            if len(head) < 8 or nbytes > left:
                raise WeightsError(f"{path}: the file ends inside storage {key} ({stype.name} x "
                                   f"{numel}: {left} of its {nbytes} bytes are there); the file "
                                   "is truncated or corrupted: fetch it again")
            count = struct.unpack("<q", head)[0]
            if count != numel:
                raise WeightsError(f"{path}: storage {key} holds {count} elements where the "
                                   f"pickle declares {numel}; the file is truncated or corrupted")
            data[key] = fh.read(nbytes)

    def read(key: str, stype: _StorageType, numel: int) -> bytes:
        if key not in data:
            raise WeightsError(f"{path}: storage {key} is used but its data is not in the file")
        return data[key]

    return _state_dict(path, obj, storages, read, "<")


def _load(pickled: bytes, path: Path, what: str, id_fields: int,
          storages: dict[str, tuple[_StorageType, int]]) -> Any:
    return _load_from(io.BytesIO(pickled), path, what, id_fields, storages)


def _load_from(fh: BinaryIO, path: Path, what: str, id_fields: int,
               storages: dict[str, tuple[_StorageType, int]]) -> Any:
    """One pickle from `fh` through the allow-listing unpickler; any failure is a WeightsError."""
    try:
        return _Unpickler(fh, path, id_fields, storages).load()
    except WeightsError:
        raise
    except _Refused as e:
        raise WeightsError(f"{path}: refused to load: {e}") from None
    except Exception as e:  # malformed pickles raise all sorts: UnpicklingError, EOFError, ...
        raise WeightsError(f"{path}: {what} is not a readable pickle ({type(e).__name__}: "
                           f"{str(e)[:200]}); the file is truncated, corrupted, or not a torch "
                           "checkpoint") from None


def _state_dict(path: Path, obj: Any, storages: dict[str, tuple[_StorageType, int]],
                read: Callable[[str, _StorageType, int], bytes],
                order: str) -> dict[str, np.ndarray]:
    """The unpickled dict of placeholders -> OrderedDict of arrays, each storage read once."""
    if not isinstance(obj, dict):
        raise WeightsError(f"{path} holds a {type(obj).__name__}, not a state_dict; "
                           "save model.state_dict() with torch.save")
    flat: dict[str, np.ndarray] = {}
    out: dict[str, np.ndarray] = collections.OrderedDict()
    for name, value in obj.items():  # a state_dict's _metadata is an attribute: never seen here
        if not isinstance(value, _Tensor):
            hint = (" (a training checkpoint? save the model's state_dict alone)"
                    if isinstance(value, dict) else "")
            raise WeightsError(f"{path}: entry {str(name)[:80]!r} is a {type(value).__name__}, "
                               f"not a tensor{hint}. {ACCEPTED}")
        if not isinstance(name, str):
            raise WeightsError(f"{path}: a tensor name is a {type(name).__name__}, not a string")
        key = value.storage.key
        if key not in flat:
            stype, numel = storages[key]
            raw = np.dtype(stype.dtype).newbyteorder(order)
            flat[key] = np.frombuffer(read(key, stype, numel), dtype=raw, count=numel)
        out[name] = _to_array(path, name, value, flat[key])
    return out


def _to_array(path: Path, name: str, t: _Tensor, flat: np.ndarray) -> np.ndarray:
    """The tensor's elements as a C-contiguous native-order array, after checking its bounds."""
    st = t.storage
    base = flat[st.start:st.start + st.length]  # [length]
    where = (f"{path}: tensor {name} (size {list(t.size)}, stride {list(t.stride)}, offset "
             f"{t.offset}, storage {st.key} of {st.length} elements)")
    if len(t.size) != len(t.stride) or min((*t.size, *t.stride, t.offset), default=0) < 0:
        raise WeightsError(f"{where} has a malformed size or stride")
    count = int(np.prod(t.size, dtype=object))
    if count:
        last = t.offset + sum((n - 1) * s for n, s in zip(t.size, t.stride))
        if last >= st.length:
            raise WeightsError(f"{where} reaches past its storage; the file is corrupted")
        if count > st.length:
            raise WeightsError(f"{where} has more elements than its storage (an expanded, "
                               "stride-0 tensor); save it with .contiguous()")
    view = np.lib.stride_tricks.as_strided(
        base[t.offset:] if count else base[:0], shape=t.size,
        strides=[s * base.itemsize for s in t.stride], writeable=False)
    if st.type.name == "BFloat16Storage":  # bfloat16 is the top half of a float32
        wide = np.empty(t.size, np.uint32)
        wide[...] = view
        wide <<= 16
        return wide.view(np.float32)
    if st.type.name == "BoolStorage":  # bytes other than 0 and 1 are true, as in torch
        return np.not_equal(view.view(np.uint8), 0)
    return np.array(view, dtype=view.dtype.newbyteorder("="), order="C")


def _looks_legacy(path: Path) -> bool:
    """Does the file start with torch's legacy magic number (pickled with protocol 2)?"""
    with open(path, "rb") as fh:
        head = fh.read(14)
    return head == b"\x80\x02\x8a\x0a" + LEGACY_MAGIC.to_bytes(10, "little")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _is_ints(xs: Any) -> bool:
    return isinstance(xs, (tuple, list)) and all(type(x) is int for x in xs)
