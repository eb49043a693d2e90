"""Every collective hepti uses, in one module, named by direction and driven by counts.

Arrays are split along axis 0 ("rows"); `counts[i]` is rank i's number of rows, from
`hepti.counts.counts`. Each verb times itself and counts its bytes on the rank's `Tracer`, and a
world of one rank returns at once (no MPI call, no copy where none is needed). Communication
happens only through these verbs, so the strategies' forwards show every sync point.

Buffers are float32 and C-contiguous; the verbs allocate their outputs.

Every verb posts the non-blocking call and `wait`s for it. An uncapped rank blocks in MPI; a rank
whose CPU is capped sleeps between tests, so it does not spend its quota polling (`wait`).
"""
from __future__ import annotations

import functools
import math
import os
import time

import numpy as np

from hepti.counts import offsets
from hepti.parallel.trace import Tracer


class Comm:
    """A group of ranks (an mpi4py communicator, or None for one process) with its verbs."""

    def __init__(self, mpi_comm=None, tracer: Tracer | None = None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1
        self.tracer = tracer or Tracer(self.rank)

    @property
    def solo(self) -> bool:
        return self.size == 1

    # --- one to all ----------------------------------------------------------------------
    def bcast_to_all(self, a: np.ndarray | None, shape, dtype=np.float32, root: int = 0) -> np.ndarray:
        """Bcast: root's array `a` of known shape to every rank."""
        if self.solo:
            return a
        buf = np.ascontiguousarray(a, dtype=dtype) if self.rank == root else np.empty(shape, dtype)
        with self.tracer.span("Bcast", "bcast"):
            wait(self.mpi.Ibcast(buf, root=root))
        n = buf.nbytes
        self.tracer.add_bytes(n * (self.size - 1) if self.rank == root else 0, 0 if self.rank == root else n)
        return buf

    def bcast_obj(self, obj, root: int = 0):
        """Small Python objects (headers, verdicts); pickled."""
        if self.solo:
            return obj
        with self.tracer.span("bcast(obj)", "bcast"):
            return self.mpi.bcast(obj, root=root)

    def scatter_rows(self, a: np.ndarray | None, counts: list[int], tail: tuple, root: int = 0
                     ) -> np.ndarray:
        """Scatterv: root's [sum(counts), *tail] -> this rank's [counts[rank], *tail]."""
        if self.solo:
            return a
        w = math.prod(tail)
        out = np.empty((counts[self.rank], *tail), np.float32)
        sizes, displs = _layout(tuple(counts), w)
        send = [np.ascontiguousarray(a, np.float32), (sizes, displs),
                _MPI().FLOAT] if self.rank == root else None
        with self.tracer.span("Scatterv", "scatterv"):
            wait(self.mpi.Iscatterv(send, out, root=root))
        if self.rank == root:
            self.tracer.add_bytes(4 * (sum(sizes) - sizes[root]), 0)
        else:
            self.tracer.add_bytes(0, out.nbytes)
        return out

    # --- all to one ----------------------------------------------------------------------
    def gather_rows(self, a: np.ndarray, counts: list[int], root: int = 0) -> np.ndarray | None:
        """Gatherv: each rank's [counts[rank], *tail] -> root's [sum(counts), *tail]; None elsewhere."""
        if self.solo:
            return a
        tail = a.shape[1:]
        w = math.prod(tail)
        sizes, displs = _layout(tuple(counts), w)
        out = np.empty((sum(counts), *tail), np.float32) if self.rank == root else None
        recv = [out, (sizes, displs), _MPI().FLOAT] if self.rank == root else None
        with self.tracer.span("Gatherv", "gatherv"):
            wait(self.mpi.Igatherv(np.ascontiguousarray(a, np.float32), recv, root=root))
        if self.rank == root:
            self.tracer.add_bytes(0, 4 * (sum(sizes) - sizes[root]))
        else:
            self.tracer.add_bytes(a.nbytes, 0)
        return out

    # --- all to all ----------------------------------------------------------------------
    def allgather_rows(self, a: np.ndarray, counts: list[int]) -> np.ndarray:
        """Allgatherv: each rank's [counts[rank], *tail] -> everyone's [sum(counts), *tail]."""
        if self.solo:
            return a
        tail = a.shape[1:]
        w = math.prod(tail)
        sizes, displs = _layout(tuple(counts), w)
        out = np.empty((sum(counts), *tail), np.float32)
        with self.tracer.span("Allgatherv", "allgatherv"):
            wait(self.mpi.Iallgatherv(np.ascontiguousarray(a, np.float32),
                                      [out, (sizes, displs), _MPI().FLOAT]))
        mine = sizes[self.rank] * 4
        self.tracer.add_bytes(mine * (self.size - 1), out.nbytes - mine)
        return out

    def reduce_scatter_rows(self, partial: np.ndarray, counts: list[int]) -> np.ndarray:
        """Reduce_scatter (sum): everyone's partial [sum(counts), *tail] -> this rank's summed
        rows [counts[rank], *tail]."""
        if self.solo:
            return partial
        tail = partial.shape[1:]
        w = math.prod(tail)
        out = np.empty((counts[self.rank], *tail), np.float32)
        with self.tracer.span("Reduce_scatter", "reduce_scatter"):
            wait(self.mpi.Ireduce_scatter(np.ascontiguousarray(partial, np.float32), out,
                                          _layout(tuple(counts), w)[0], op=_MPI().SUM))
        self.tracer.add_bytes(partial.nbytes - out.nbytes, out.nbytes * (self.size - 1))
        return out

    # --- point to point (pipeline) -------------------------------------------------------
    def send_array(self, a: np.ndarray, dest: int, meta=None, tag: int = 0):
        """Send a float32 array; a small pickled header (shape, meta) goes first."""
        with self.tracer.span("Send", "send"):
            self.mpi.send((a.shape, meta), dest=dest, tag=tag)
            wait(self.mpi.Isend(np.ascontiguousarray(a, np.float32), dest=dest, tag=tag))
        self.tracer.add_bytes(a.nbytes, 0)

    def recv_array(self, source: int, tag: int = 0):
        """-> (array, meta) sent by send_array."""
        with self.tracer.span("Recv", "recv"):
            shape, meta = wait_obj(self.mpi.irecv(source=source, tag=tag))
            out = np.empty(shape, np.float32)
            wait(self.mpi.Irecv(out, source=source, tag=tag))
        self.tracer.add_bytes(0, out.nbytes)
        return out, meta

    def barrier(self):
        if not self.solo:
            self.mpi.Barrier()


WAIT_SLEEP_S = 50e-6  # between tests of a pending request; far below a message's time on a link


def _choose_sleepy() -> bool:
    """Sleep between tests only where spinning costs: a rank whose CPU is capped below one core
    (an emulated device, or a container slice) spends its quota polling and is then throttled
    just when the data arrives. An uncapped rank blocks in MPI's own progress loop, which
    completes a shared-memory collective in tens of microseconds; a sleeping loop made every
    one of MiniLM's 24 collectives per forward at least one timer slack (~60-100 us) late.
    `HEPTI_MPI_WAIT=sleep|block` overrides the choice."""
    forced = os.environ.get("HEPTI_MPI_WAIT", "").strip().lower()
    if forced in ("sleep", "block"):
        return forced == "sleep"
    from hepti.parallel.profiling import cpu_limit  # the profile reads the same caps
    cores, _ = cpu_limit()
    return cores is not None and cores < 1.0


SLEEPY = _choose_sleepy()


def wait(req) -> None:
    """Complete a non-blocking MPI request, or a list of them: block in MPI, or sleep between
    tests (see `_choose_sleepy`)."""
    reqs = req if isinstance(req, list) else [req]  # Waitall of one: +0.2 us, nothing per forward
    MPI = _MPI()
    if not SLEEPY:
        MPI.Request.Waitall(reqs)
        return
    while not MPI.Request.Testall(reqs):
        time.sleep(WAIT_SLEEP_S)


def wait_obj(req):
    """Complete a non-blocking pickled receive (mpi4py `irecv`) the same way; its object."""
    if not SLEEPY:
        return req.wait()
    while True:
        done, obj = req.test()
        if done:
            return obj
        time.sleep(WAIT_SLEEP_S)


@functools.lru_cache(maxsize=256)
def _layout(counts: tuple, w: int) -> tuple[list[int], list[int]]:
    """Element counts and displacements of row blocks `counts` of rows w floats wide (the same
    few layouts recur every layer, so they are built once)."""
    return [c * w for c in counts], [o * w for o in offsets(list(counts))]


@functools.cache
def _MPI():
    from mpi4py import MPI
    return MPI
