"""Collective test helpers (heat's assert style): every rank passes or fails together."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from mpi4py import MPI

COMM = MPI.COMM_WORLD
_SHARED: list[str] = []  # the session's one folder that every rank reads, made at first use


def shared_dir(name: str) -> Path:
    """A folder `name` that rank 0 fills and every rank reads (one machine), inside one
    temporary folder per session that `remove_shared()` removes at its end. Collective at the
    first call (every rank calls the same fixtures in the same order)."""
    if not _SHARED:
        _SHARED.append(COMM.bcast(tempfile.mkdtemp(prefix="hepti-mpi-") if COMM.Get_rank() == 0 else None))
    return Path(_SHARED[0]) / name


def remove_shared() -> None:
    """Rank 0 removes the session's folder (before this, each fixture's mkdtemp stayed in /tmp)."""
    if _SHARED and COMM.Get_rank() == 0:
        shutil.rmtree(_SHARED.pop(), ignore_errors=True)


def all_ok(ok: bool, msg: str = "") -> None:
    """Collective assertion: fails on every rank if it failed on any, naming the ranks."""
    oks = COMM.allgather((bool(ok), msg))
    bad = [f"rank {r}: {m}" for r, (o, m) in enumerate(oks) if not o]
    assert not bad, "; ".join(bad)
