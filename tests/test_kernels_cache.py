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


def test_a_kernel_another_process_is_compiling_is_loaded_not_compiled_again(tmp_path):
    """share_compiles: a process that needs a signature while another compiles it waits for
    that one's lock, then loads what it saved (Numba alone compiles it a second time)."""
    import fcntl
    import os
    import subprocess
    import sys
    import time

    from numba import types
    (tmp_path / "kern.py").write_text(
        "from numba import njit\n\n\n@njit(cache=True)\ndef plus(x):\n    return x + 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        import kern
    finally:
        sys.path.remove(str(tmp_path))
    assert _cache.share_compiles()  # already in place: hepti.kernels put it there
    fd = _cache._lock_fd(kern.plus._cache._cache_path)
    # this process "is compiling" plus(int64): it holds that signature's byte of the lock file
    fcntl.lockf(fd, fcntl.LOCK_EX, 1, _cache.lock_offset(kern.plus.py_func, (types.int64,)))
    child = subprocess.Popen(
        [sys.executable, "-c", "import hepti.kernels, kern; print('ready', flush=True); "
         "print(kern.plus(1), sum(kern.plus._cache_misses.values()), "
         "sum(kern.plus._cache_hits.values()))"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(tmp_path), os.environ.get("PYTHONPATH", "")])},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "ready\n", child.communicate()
        time.sleep(1.0)  # the child asks for plus(int64): without the lock it compiles it now
        assert kern.plus(1) == 2  # compiled here and saved; the lock goes after
        out, err = child.communicate(timeout=120)
    finally:
        sys.modules.pop("kern", None)  # after the compile: Numba's cache names its module
        if child.poll() is None:
            child.kill()
    assert child.returncode == 0, err
    assert sum(kern.plus._cache_misses.values()) == 1
    assert out.split() == ["2", "0", "1"], (out, err)  # the child compiled nothing: it loaded
