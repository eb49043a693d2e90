"""Run several of tests/mpi's standalone check scripts in one MPI job, one after another:
  mpiexec -n N python -m mpi4py tests/mpi/several.py SCRIPT [ARGS...] [-- SCRIPT [ARGS...]]...

A launch's fixed cost (N interpreters importing hepti and numpy, loading Numba's kernels, on a
shared 2-core machine 10-20 s) is then paid once for all of them. Each SCRIPT is a file in
tests/mpi with a `main(argv) -> exit code` that prints one JSON line per case on rank 0 (as
cnn_equivalence.py and cnn_agreement.py do); before a script's lines rank 0 prints
{"script": SCRIPT}, so the caller can tell whose lines follow. Every script runs even when an
earlier one found a case off; the job exits 1 if any did. (tests/test_distributed_launch.py:
`launch_scripts`.)
"""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def groups(argv: list[str]) -> list[list[str]]:
    """SCRIPT ARGS... [-- SCRIPT ARGS...] -> one [SCRIPT, *ARGS] per script."""
    out, cur = [], []
    for a in argv + ["--"]:
        if a == "--":
            if cur:
                out.append(cur)
            cur = []
        else:
            cur.append(a)
    return out


def load(script: str):
    """tests/mpi/SCRIPT as a module (its main not run: each guards it with __name__)."""
    path = HERE / script
    if not path.is_file():
        raise SystemExit(f"several.py: no script {path}; name a file in tests/mpi")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    from mpi4py import MPI  # noqa: F401  (MPI_Init here, when run standalone)
    rank0 = MPI.COMM_WORLD.Get_rank() == 0
    bad = 0
    for script, *args in groups(sys.argv[1:] if argv is None else argv):
        if rank0:
            print(json.dumps({"script": script}), flush=True)
        bad += load(script).main(args) != 0
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
