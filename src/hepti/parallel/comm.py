"""Every collective hepti uses, in one module, named by direction and driven by counts.

Arrays are split along axis 0 ("rows"); `counts[i]` is rank i's number of rows, from
`hepti.counts.counts`. Each verb times itself and counts its bytes on the rank's `Tracer`, and a
world of one rank returns at once (no MPI call, no copy where none is needed). Communication
happens only through these verbs, so the strategies' forwards show every sync point.

Buffers are float32; the verbs allocate their outputs (a Scatterv root's own rows are a view
of its input).

Every verb posts non-blocking calls and `wait`s for them. An uncapped rank blocks in MPI; a rank
whose CPU is capped sleeps between tests, so it does not spend its quota polling (`wait`).

The row verbs (Scatterv, Gatherv, Allgatherv, Reduce_scatter) are direct exchanges of
point-to-point messages: each rank posts one receive per peer's block and one send per block a
peer needs, then sums what it received where the verb reduces. Between two ranks on this
machine MPICH 5's Allgatherv and Reduce_scatter took 1.1-1.4x as long for the same bytes
(`mpiexec -n 2 hepti bench comm` -> results/comm.json), and in a forward, where the ranks
arrive at different moments, the gap was wider: MiniLM's 12 Reduce_scatters per 2-rank
`tensor` forward went from about 1.9 to 1.0 ms (`hepti run --trace`, when this was written).
A direct exchange sends each byte once, as a ring does, in one round instead of N-1; hepti's
clusters have a handful of devices, where one round of N-1 messages per rank is the better
trade. Bcast stays MPI's own: a tree matters there, and it carries one array a batch.
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
        o, r = _offsets(tuple(counts)), self.rank
        with self.tracer.span("Scatterv", "scatterv"):
            if r == root:
                a = np.ascontiguousarray(a, np.float32)
                wait([self.mpi.Isend(a[o[j]:o[j] + counts[j]], dest=j, tag=_TAG_SCATTER)
                      for j in self._peers(counts)])
                out = a[o[r]:o[r] + counts[r]]
            else:
                out = np.empty((counts[r], *tail), np.float32)
                if counts[r]:
                    wait(self.mpi.Irecv(out, source=root, tag=_TAG_SCATTER))
        sent = 4 * math.prod(tail) * (sum(counts) - counts[root]) if r == root else 0
        self.tracer.add_bytes(sent, 0 if r == root else out.nbytes)
        return out

    # --- all to one ----------------------------------------------------------------------
    def gather_rows(self, a: np.ndarray, counts: list[int], root: int = 0) -> np.ndarray | None:
        """Gatherv: each rank's [counts[rank], *tail] -> root's [sum(counts), *tail]; None elsewhere."""
        if self.solo:
            return a
        o, r = _offsets(tuple(counts)), self.rank
        with self.tracer.span("Gatherv", "gatherv"):
            if r != root:
                if counts[r]:
                    wait(self.mpi.Isend(np.ascontiguousarray(a, np.float32), dest=root,
                                        tag=_TAG_GATHER))
                self.tracer.add_bytes(a.nbytes, 0)
                return None
            out = np.empty((sum(counts), *a.shape[1:]), np.float32)
            reqs = [self.mpi.Irecv(out[o[j]:o[j] + counts[j]], source=j, tag=_TAG_GATHER)
                    for j in self._peers(counts)]
            out[o[r]:o[r] + counts[r]] = a
            wait(reqs)
        self.tracer.add_bytes(0, out.nbytes - a.nbytes)
        return out

    # --- all to all ----------------------------------------------------------------------
    def allgather_rows(self, a: np.ndarray, counts: list[int]) -> np.ndarray:
        """Allgatherv: each rank's [counts[rank], *tail] -> everyone's [sum(counts), *tail].
        `a` may be a strided view (e.g. K/V columns of a QKV output): it is copied once, into
        its rows of the result, and sent from there."""
        if self.solo:
            return a
        o, r = _offsets(tuple(counts)), self.rank
        out = np.empty((sum(counts), *a.shape[1:]), np.float32)
        mine = out[o[r]:o[r] + counts[r]]
        with self.tracer.span("Allgatherv", "allgatherv"):
            reqs = [self.mpi.Irecv(out[o[j]:o[j] + counts[j]], source=j, tag=_TAG_ALLGATHER)
                    for j in self._peers(counts)]
            mine[...] = a
            if counts[r]:
                reqs += [self.mpi.Isend(mine, dest=j, tag=_TAG_ALLGATHER)
                         for j in range(self.size) if j != r]
            wait(reqs)
        self.tracer.add_bytes(mine.nbytes * (self.size - 1), out.nbytes - mine.nbytes)
        return out

    def reduce_scatter_rows(self, partial: np.ndarray, counts: list[int]) -> np.ndarray:
        """Reduce_scatter (sum): everyone's partial [sum(counts), *tail] -> this rank's summed
        rows [counts[rank], *tail]. Summed in rank order on every rank, so a result does not
        depend on which messages came first."""
        if self.solo:
            return partial
        o, r, n = _offsets(tuple(counts)), self.rank, self.size
        partial = np.ascontiguousarray(partial, np.float32)
        blocks = [partial[o[j]:o[j] + counts[j]] for j in range(n)]
        got = [partial[o[r]:o[r] + counts[r]] if j == r else np.empty_like(blocks[r])
               for j in range(n)]  # got[j]: rank j's partial of my rows
        with self.tracer.span("Reduce_scatter", "reduce_scatter"):
            reqs = [self.mpi.Irecv(got[j], source=j, tag=_TAG_REDUCE) for j in range(n)
                    if j != r and counts[r]]
            reqs += [self.mpi.Isend(blocks[j], dest=j, tag=_TAG_REDUCE) for j in self._peers(counts)]
            wait(reqs)
            # into a received block (ours to overwrite), in rank order: got[1] + got[0] is
            # got[0] + got[1] exactly, so rank 0 may start from rank 1's block
            first = 1 if r == 0 else 0
            out = got[first]
            out += got[1 - first]
            for j in range(2, n):
                out += got[j]
        self.tracer.add_bytes(partial.nbytes - blocks[r].nbytes, blocks[r].nbytes * (n - 1))
        return out

    def _peers(self, counts: list[int]) -> tuple[int, ...]:
        """The other ranks with rows: every block a direct exchange moves is one of theirs."""
        return _peers(tuple(counts), self.rank)

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


# one tag per row verb: a verb's messages can never match another's, whatever the order of posting
_TAG_SCATTER, _TAG_GATHER, _TAG_ALLGATHER, _TAG_REDUCE = 101, 102, 103, 104


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
def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Row offsets of row blocks `counts` (the same few layouts recur every layer)."""
    return tuple(offsets(list(counts)))


@functools.lru_cache(maxsize=256)
def _peers(counts: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(j for j in range(len(counts)) if j != rank and counts[j])


@functools.cache
def _MPI():
    from mpi4py import MPI
    return MPI
