"""Numba's on-disk cache, made to follow the kernels' sources as a whole, and filled once by
processes that start together (share_compiles, at the end).

Numba keys each cached function on its own source file's time stamp and size alone. A kernel in
conv.py that calls one in packed_gemm.py is compiled with that callee inlined, so after an edit
of packed_gemm.py (a `git pull`, a merge) conv.py's cache still holds the old callee and Numba
loads it without a word: the new code runs only where the caller's file changed too. The same
holds for config.py's compile-time constants (the fastmath sets).

So the package keeps, beside the cache, each module's SHA-256 over its source and those of the
kernel modules it imports (directly or not); on import, a module whose hash changed has its
cached kernels (.nbi index, .nbc code: `conv._tiles_fused-494.py311.1.nbc`) removed before
anything is loaded, and its next calls compile afresh. One process does it (a lock), whichever of the ranks or
test workers starting together comes first; the others find the stamp current.

Only the cache beside the sources is handled (`__pycache__`, where Numba puts it when it can
write there). An install Numba cannot write into caches under NUMBA_CACHE_DIR or the user's
cache folder: clear that by hand after changing the kernels.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import re
import time
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
STAMP = "hepti-sources.json"
_IMPORT = re.compile(r"^\s*from hepti\.kernels(?:\.(\w+) import| import ([\w, ]+))", re.M)


def fingerprints(folder: Path = HERE) -> dict[str, str]:
    """{module: SHA-256 over its source and those of every kernel module it imports, directly
    or not} for the folder's .py files: what a module's compiled kernels were made from."""
    src = {p.stem: p.read_bytes() for p in sorted(folder.glob("*.py"))}
    deps = {}
    for name, text in src.items():
        found = set()
        for mod, names in _IMPORT.findall(text.decode(errors="replace")):
            found.update([mod] if mod else (n.strip() for n in names.split(",")))
        deps[name] = found & src.keys()
    out = {}
    for name in src:
        seen, todo = set(), [name]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                todo.extend(deps[m])
        h = hashlib.sha256()
        for m in sorted(seen):
            h.update(m.encode() + b"\0" + src[m] + b"\0")
        out[name] = h.hexdigest()
    return out


def _read(stamp: Path) -> dict:
    try:
        return json.loads(stamp.read_text())
    except (OSError, ValueError):
        return {}


def drop_stale(cache: Path = HERE / "__pycache__", want: dict[str, str] | None = None) -> int:
    """Remove the cached kernels in `cache` of each module whose sources, its imports' included,
    are not those its stamp names (`want`, default `fingerprints()`), then write the stamp.
    Returns how many files went. A folder it cannot write (a read-only install) is left as it
    is."""
    want = fingerprints() if want is None else want
    stamp = cache / STAMP
    if _read(stamp) == want:
        return 0
    try:
        cache.mkdir(exist_ok=True)
        with open(cache / "hepti-sources.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            had = _read(stamp)  # another process may have done it while this one waited
            stale = {m for m in want if had.get(m) != want[m]}
            gone = 0
            for f in cache.iterdir():
                if f.suffix in (".nbi", ".nbc") and f.name.split(".", 1)[0] in stale:
                    f.unlink(missing_ok=True)
                    gone += 1
            tmp = cache / (STAMP + f".{os.getpid()}")
            tmp.write_text(json.dumps(want, indent=0, sort_keys=True))
            os.replace(tmp, stamp)
            return gone
    except OSError:
        return 0


# --- one process compiles a kernel, the others starting it at the same time load it --------------

LOCK = "hepti-compile.lock"
SAVES = 1 << 32  # the lock file's bytes from here on stand for a function's index (its saves)
WAIT_S = 120.0  # a process waits at most this long for another's compile, then compiles itself
# False in a low-priority process (tests/warm.py, at nice 19): it waits for the others' compiles
# but holds no lock while it compiles, so that a test never waits for a process the machine
# starves (it compiles the signature itself, as before)
HOLD = True
SAVE_WAIT_S = 30.0  # and this long for another's save, then saves unlocked
_lock_fds: dict[str, int] = {}


def _lock_fd(folder: str) -> int | None:
    """This process's descriptor of the cache folder's lock file (kept open: closing any
    descriptor of a file drops the process's record locks on it), or None if it cannot be
    made."""
    fd = _lock_fds.get(folder)
    if fd is None:
        try:
            fd = os.open(os.path.join(folder, LOCK), os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:
            return None
        _lock_fds[folder] = fd
    return fd


def _acquire(fd: int, offset: int, wait_s: float) -> bool:
    """Take the exclusive record lock on byte `offset` of the lock file, trying every 50 ms for
    at most wait_s; False if it could not (held all that time, or no record locks here)."""
    give_up = time.monotonic() + wait_s
    while True:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, 1, offset)
            return True
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN) or time.monotonic() > give_up:
                return False
            time.sleep(0.05)


def lock_offset(func, sig) -> int:
    """The byte of the lock file that stands for compiling `sig` of the Python function `func`
    (the same in every process)."""
    return zlib.crc32(f"{func.__module__}.{func.__qualname__}\0{sig}".encode())


def share_compiles() -> bool:
    """Make processes that need the same kernel signature at the same moment compile it once:
    the first compiles, the others wait, then load it from the on-disk cache. Numba alone has
    each process compile it (it checks the cache only before it starts), so on a cold cache
    the ranks of a job on one machine, or the test suite and the warmer beside it
    (tests/warm.py), each spent the whole compile on it.

    Numba's Dispatcher.compile is wrapped: for a cached function (cache=True) and a signature
    this process has not got yet, it takes an exclusive record lock on one byte of the cache
    folder's hepti-compile.lock, at an offset hashed from the function and the signature, for
    as long as the compile (or the load) takes; Numba's own compile then finds the signature
    in the cache if another process saved it meanwhile. Callees compile inside their caller's
    compile, so a process holds the locks of a chain of callers while it waits: the call graph
    has no cycles, so neither have the waits. A process that dies holding a lock releases it;
    one stopped while compiling (SIGSTOP, a frozen emulated device) holds it, so a waiter tries
    every 50 ms and after WAIT_S compiles the signature itself, as does a process whose lock
    file cannot be made. Numba's Cache.save_overload is wrapped too, so that two processes
    saving two signatures of one function (an index of several entries) do not drop one
    another's entry. Returns whether the wrappers are in place."""
    try:
        from numba.core import caching, dispatcher, sigutils  # local: after config sets Numba up
    except ImportError:
        return False
    Dispatcher = dispatcher.Dispatcher
    plain = Dispatcher.compile
    if getattr(plain, "_hepti_shared", False):
        return True

    def compile(self, sig):
        cache = self._cache
        folder = getattr(cache, "_cache_path", None)
        if not isinstance(cache, caching.Cache) or folder is None:
            return plain(self, sig)
        args, _ = sigutils.normalize_signature(sig)
        if tuple(args) in self.overloads:
            return plain(self, sig)
        fd = _lock_fd(folder)
        if fd is None:
            return plain(self, sig)
        key = lock_offset(self.py_func, sig)
        if not _acquire(fd, key, WAIT_S):
            return plain(self, sig)  # compile it as Numba would
        if not HOLD:  # only waited for another's compile: this one's is nobody's to wait for
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, key)
            return plain(self, sig)
        try:
            return plain(self, sig)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, key)
    compile._hepti_shared = True
    Dispatcher.compile = compile

    save = caching.Cache.save_overload

    def save_overload(self, sig, data):
        """Numba's save, one process at a time per function: it reads the function's index,
        adds its entry and writes the index back, so two processes saving two signatures of
        one function at once left one of them out (compiled again by its next user)."""
        fd = _lock_fd(self._cache_path)
        index = getattr(getattr(self, "_cache_file", None), "_index_name", None)
        if fd is None or index is None:
            return save(self, sig, data)
        key = SAVES + zlib.crc32(index.encode())  # the index file's name: the same in every process
        if not _acquire(fd, key, SAVE_WAIT_S):  # a save takes milliseconds, and nests nothing
            return save(self, sig, data)
        try:
            return save(self, sig, data)
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN, 1, key)
    caching.Cache.save_overload = save_overload
    return True
