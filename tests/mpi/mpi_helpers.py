"""Collective test helpers (heat's assert style): every rank passes or fails together."""
from __future__ import annotations

from mpi4py import MPI

COMM = MPI.COMM_WORLD


def all_ok(ok: bool, msg: str = "") -> None:
    """Collective assertion: fails on every rank if it failed on any, naming the ranks."""
    oks = COMM.allgather((bool(ok), msg))
    bad = [f"rank {r}: {m}" for r, (o, m) in enumerate(oks) if not o]
    assert not bad, "; ".join(bad)
