"""hepti.kernels._cache: a module's cached kernels go when its source or that of a kernel module
it imports changes (Numba's own check sees the module's file alone), and no others."""
from pathlib import Path

from hepti.kernels import _cache


def _tree(tmp_path: Path) -> tuple[Path, Path]:
    src = tmp_path / "kernels"
    src.mkdir()
    (src / "config.py").write_text("FAST = 1\n")
    (src / "gemm.py").write_text("from hepti.kernels.config import FAST\n")
    (src / "conv.py").write_text("from hepti.kernels import config\n"
                                 "from hepti.kernels.gemm import x\n")
    (src / "norm.py").write_text("import numpy\n")
    cache = src / "__pycache__"
    cache.mkdir()
    return src, cache


def _fill(cache: Path) -> None:
    for mod in ("gemm", "conv", "norm"):
        for ext in ("nbi", "1.nbc"):
            (cache / f"{mod}._kernel-12.py311.{ext}").write_text("x")
    (cache / "conv.cpython-311.pyc").write_text("x")


def _left(cache: Path) -> set[str]:
    return {f.name.split(".", 1)[0] for f in cache.iterdir() if f.suffix in (".nbi", ".nbc")}


def test_an_edit_drops_its_importers_caches_and_no_others(tmp_path):
    src, cache = _tree(tmp_path)
    _fill(cache)
    assert _cache.drop_stale(cache, _cache.fingerprints(src)) == 6  # no stamp yet: all go
    _fill(cache)
    assert _cache.drop_stale(cache, _cache.fingerprints(src)) == 0  # unchanged: all stay
    assert _left(cache) == {"gemm", "conv", "norm"}

    (src / "gemm.py").write_text("from hepti.kernels.config import FAST  # edited\n")
    assert _cache.drop_stale(cache, _cache.fingerprints(src)) == 4
    assert _left(cache) == {"norm"}  # conv calls into gemm: its inlined copy was stale too
    assert (cache / "conv.cpython-311.pyc").exists()  # Python's own bytecode is not touched

    _fill(cache)
    (src / "config.py").write_text("FAST = 2\n")  # imported by conv as `from ... import config`
    assert _cache.drop_stale(cache, _cache.fingerprints(src)) == 4
    assert _left(cache) == {"norm"}


def test_a_folder_it_cannot_write_is_left_alone(tmp_path):
    """A read-only install: the lock cannot be opened (here: a folder in its place, which
    fails for root too), so nothing is removed and nothing raised."""
    src, cache = _tree(tmp_path)
    _fill(cache)
    (cache / "hepti-sources.lock").mkdir()
    assert _cache.drop_stale(cache, _cache.fingerprints(src)) == 0
    assert _left(cache) == {"gemm", "conv", "norm"}


def test_the_package_s_own_stamp_is_current_after_import():
    import json

    import hepti.kernels  # noqa: F401  (its import ran drop_stale)
    stamp = _cache.HERE / "__pycache__" / _cache.STAMP
    if stamp.exists():  # absent only where the package cannot write beside its sources
        assert json.loads(stamp.read_text()) == _cache.fingerprints()
        assert set(_cache.fingerprints()) >= {"conv", "packed_gemm", "config", "int8"}
