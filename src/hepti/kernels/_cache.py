"""Numba's on-disk cache, made to follow the kernels' sources as a whole.

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

import fcntl
import hashlib
import json
import os
import re
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
