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

**Ranks on one host share memory instead** (transport "shm"): the group maps one MPI-3 shared
window (`MPI_Win_allocate_shared`) cut into RING slots; a verb's ranks write their rows into
a slot, one barrier orders every write before any read, and each rank reads its peers' rows
where they lie (Scatterv, Gatherv and Bcast go the same way, their results copied out, as
the caller may keep them). MPICH moves a message between two local ranks through its own
cells (a copy in, a copy out, a handshake); here a byte is written once and read once, and
`tensor`'s GeMMs write their partial sums straight into the slot (`partial_buffer`). Measured in MiniLM's
2-rank forwards (`hepti run --trace`, the later rank's time in the verb): `rows`' K/V
Allgatherv 100 -> 65 us, `tensor`'s Allgatherv 38 -> 19 us and Reduce_scatter 54 -> 41-51
us; `bin/bench-scaling.sh` quotes what that does to the forward. (Writing `rows`' QKV GeMM
into the slot as well saved the K/V copy but not time: attention then read K/V with rows
three times wider, half of them from the other core's cache; A/B equal.)
It is chosen when every rank of the group is on one host (`MPI_COMM_TYPE_SHARED`), unless
$HEPTI_COMM=p2p or MPICH's MPIR_CVAR_NOLOCAL=1 asks for the network path; `hepti emulate` sets
both, so that its shaped links carry every byte. The bytes a verb counts are the same on both
transports: what crosses between ranks.
"""
from __future__ import annotations

import functools
import math
import os
import time

import numpy as np

from hepti.counts import offsets
from hepti.emulate import stretch
from hepti.errors import InputError
from hepti.parallel.trace import Tracer
from hepti.resources import cpu_limit

# one tag per verb: a verb's messages can never match another's, whatever the order of posting
_TAG_SCATTER, _TAG_GATHER, _TAG_ALLGATHER, _TAG_REDUCE, _TAG_OBJ = 101, 102, 103, 104, 105
_TAG_HALO = 106
_TAG_COMMAND, _TAG_REPORT = 107, 108
_TAG_ALLREDUCE, _TAG_SMALL = 109, 110  # the decoder's one-row sum and its token choice


class Comm:
    """A group of ranks (an mpi4py communicator, or None for one process) with its verbs.

    Constructing one is collective (it asks MPI which ranks share a host), and so is `close()`,
    which frees the shared window if the group has one."""

    def __init__(self, mpi_comm=None, tracer: Tracer | None = None, transport: str | None = None):
        self.mpi = mpi_comm
        self.rank = mpi_comm.Get_rank() if mpi_comm is not None else 0
        self.size = mpi_comm.Get_size() if mpi_comm is not None else 1
        self.tracer = tracer or Tracer(self.rank)
        self.transport = "solo" if self.solo else choose_transport(mpi_comm, transport)
        self.shm = _SharedSlots(mpi_comm) if self.transport == "shm" else None
        self._parts = self._my_part = None  # the slot of a pending partial_buffer()
        self._owns_mpi = False  # made by split(): close() frees the communicator too

    @property
    def solo(self) -> bool:
        return self.size == 1

    def split(self, member: bool, first: bool = False) -> "Comm | None":
        """Collective: the group of the ranks that pass member=True, in rank order but for the
        one that passes first=True, which is the group's rank 0 (the root of its verbs), as a
        Comm that owns its communicator (its close() frees it); None on the other ranks."""
        if self.solo:
            return Comm(None, self.tracer) if member else None
        sub = self.mpi.Split(0 if member else _MPI().UNDEFINED, key=0 if first else self.rank + 1)
        if not member:
            return None
        group = Comm(sub, self.tracer)
        group._owns_mpi = True
        return group

    def ranks_on_host(self) -> int:
        """Collective: how many of the group's ranks share this one's host (and its memory:
        a rank's part of the host's free memory is that over this, as `hepti profile` counts
        it)."""
        if self.solo:
            return 1
        node = self.mpi.Split_type(_MPI().COMM_TYPE_SHARED)
        n = node.Get_size()
        node.Free()
        return n

    def close(self) -> None:
        """Collective: frees the shared window, and the communicator if split() made it."""
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self._owns_mpi:
            self.mpi.Free()
            self._owns_mpi = False

    # --- one to all ----------------------------------------------------------------------
    def bcast_to_all(self, a: np.ndarray | None, shape, dtype=np.float32, root: int = 0) -> np.ndarray:
        """Bcast: root's array `a` of known shape to every rank."""
        if self.solo:
            return a
        with self.tracer.span("Bcast", "bcast"):
            if self.shm is not None and np.dtype(dtype) == np.float32:
                slot = self.shm.take(shape)
                if self.rank == root:
                    slot[...] = a
                self.shm.sync()
                buf = np.ascontiguousarray(a, np.float32) if self.rank == root else slot.copy()
            else:
                buf = np.ascontiguousarray(a, dtype=dtype) if self.rank == root else np.empty(shape, dtype)
                wait(self.mpi.Ibcast(buf, root=root))
        n = buf.nbytes
        if self.rank == root:
            self.tracer.add_bytes("bcast", n * (self.size - 1), 0)
        else:
            self.tracer.add_bytes("bcast", 0, n)
        return buf

    def bcast_obj(self, obj, root: int = 0):
        """Small Python objects (headers, verdicts); pickled."""
        if self.solo:
            return obj
        with self.tracer.span("bcast(obj)", "bcast"):
            return self.mpi.bcast(obj, root=root)

    def scatter_rows(self, a: np.ndarray | None, counts: list[int], tail: tuple, root: int = 0
                     ) -> np.ndarray:
        """Scatterv: root's [sum(counts), *tail] -> this rank's [counts[rank], *tail]. The
        root's rows come back as a copy of its own, not a view of `a`: a view would keep all
        of `a` allocated for as long as the rows live (the embeddings' whole output through
        the first layer, measured by hepti.bench.order_exec), for a copy of a few rows."""
        if self.solo:
            return a
        o, r = _offsets(tuple(counts)), self.rank
        with self.tracer.span("Scatterv", "scatterv"):
            if r == root:
                a = np.ascontiguousarray(a, np.float32)
                out = a[o[r]:o[r] + counts[r]]
            if self.shm is not None:
                slot = self.shm.take((sum(counts), *tail))
                if r == root:  # the peers' rows: the root keeps its own where they are
                    slot[:o[r]] = a[:o[r]]
                    slot[o[r] + counts[r]:] = a[o[r] + counts[r]:]
                self.shm.sync()
                if r != root:
                    out = slot[o[r]:o[r] + counts[r]].copy()
            elif r == root:
                wait([self.mpi.Isend(a[o[j]:o[j] + counts[j]], dest=j, tag=_TAG_SCATTER)
                      for j in self._peers(counts)])
            else:
                out = np.empty((counts[r], *tail), np.float32)
                if counts[r]:
                    wait(self.mpi.Irecv(out, source=root, tag=_TAG_SCATTER))
            if r == root:
                out = out.copy()
        sent = 4 * math.prod(tail) * (sum(counts) - counts[root]) if r == root else 0
        self.tracer.add_bytes("scatterv", sent, 0 if r == root else out.nbytes)
        return out

    # --- all to one ----------------------------------------------------------------------
    def gather_rows(self, a: np.ndarray, counts: list[int], root: int = 0) -> np.ndarray | None:
        """Gatherv: each rank's [counts[rank], *tail] -> root's [sum(counts), *tail]; None elsewhere."""
        if self.solo:
            return a
        o, r = _offsets(tuple(counts)), self.rank
        m = sum(counts)
        with self.tracer.span("Gatherv", "gatherv"):
            if self.shm is not None:
                slot = self.shm.take((m, *a.shape[1:]))
                if r != root:
                    slot[o[r]:o[r] + counts[r]] = a
                self.shm.sync()
                if r == root:
                    out = slot.copy()
                    out[o[r]:o[r] + counts[r]] = a
            elif r != root:
                if counts[r]:
                    wait(self.mpi.Isend(np.ascontiguousarray(a, np.float32), dest=root,
                                        tag=_TAG_GATHER))
            else:
                out = np.empty((m, *a.shape[1:]), np.float32)
                reqs = [self.mpi.Irecv(out[o[j]:o[j] + counts[j]], source=j, tag=_TAG_GATHER)
                        for j in self._peers(counts)]
                out[o[r]:o[r] + counts[r]] = a
                wait(reqs)
        if r != root:
            self.tracer.add_bytes("gatherv", a.nbytes, 0)
            return None
        self.tracer.add_bytes("gatherv", 0, out.nbytes - a.nbytes)
        return out

    # --- all to all ----------------------------------------------------------------------
    def allgather_rows(self, a: np.ndarray, counts: list[int]) -> np.ndarray:
        """Allgatherv: each rank's [counts[rank], *tail] -> everyone's [sum(counts), *tail].
        `a` may be a strided view (e.g. K/V columns of a QKV output): it is copied once, into
        its rows of the result, and sent from there.

        On the "shm" transport the result is a view of the shared window, written by every
        rank: read it, do not write it, and be done with it before this group's third verb
        call after this one (`RING`). The forwards use it within a layer. (Copying it out
        instead made `tensor` ~2.5% slower: its GeMMs stream the rows in place well.)"""
        if self.solo:
            return a
        o, r = _offsets(tuple(counts)), self.rank
        shape = (sum(counts), *a.shape[1:])
        with self.tracer.span("Allgatherv", "allgatherv"):
            if self.shm is not None:
                out = self.shm.take(shape)
                out[o[r]:o[r] + counts[r]] = a
                self.shm.sync()
            else:
                out = np.empty(shape, np.float32)
                mine = out[o[r]:o[r] + counts[r]]
                reqs = [self.mpi.Irecv(out[o[j]:o[j] + counts[j]], source=j, tag=_TAG_ALLGATHER)
                        for j in self._peers(counts)]
                mine[...] = a
                if counts[r]:
                    reqs += [self.mpi.Isend(mine, dest=j, tag=_TAG_ALLGATHER)
                             for j in range(self.size) if j != r]
                wait(reqs)
        mine_bytes = 4 * counts[r] * math.prod(shape[1:])
        self.tracer.add_bytes("allgatherv", mine_bytes * (self.size - 1), 4 * math.prod(shape) - mine_bytes)
        return out

    def partial_buffer(self, shape: tuple) -> np.ndarray | None:
        """Where to compute the partial sums that go to `reduce_scatter_rows` next: on the
        "shm" transport this rank's block of a shared slot (float32, `shape`, contiguous), so
        the verb copies nothing; otherwise None (compute into a fresh array). Call it on every
        rank of the group or on none, as a verb: it takes a slot of the ring; and hand the
        partial sums to reduce_scatter_rows before any other verb of the group."""
        if self.shm is None:
            return None
        n, size = self.size, math.prod(shape)
        stride = _pad16(size)  # each rank's block starts on a cache line
        flat = self.shm.take((n * stride,))
        self._parts = [flat[j * stride:j * stride + size].reshape(shape) for j in range(n)]
        self._my_part = self._parts[self.rank]
        return self._my_part

    def reduce_scatter_rows(self, partial: np.ndarray, counts: list[int]) -> np.ndarray:
        """Reduce_scatter (sum): everyone's partial [sum(counts), *tail] -> this rank's summed
        rows [counts[rank], *tail]. Summed in rank order on every rank and on either
        transport, so a result does not depend on which messages came first."""
        if self.solo:
            return partial
        o, r, n = _offsets(tuple(counts)), self.rank, self.size
        mine = slice(o[r], o[r] + counts[r])
        with self.tracer.span("Reduce_scatter", "reduce_scatter"):
            if self.shm is not None:
                if partial is not self._my_part:  # not computed in place: copy it in (into
                    # the pending slot if there is one: every rank must take the same slots)
                    mine_part = self._my_part if self._parts else self.partial_buffer(partial.shape)
                    mine_part[...] = partial
                parts, self._parts = self._parts, None
                self._my_part = None
                self.shm.sync()
                got = [p[mine] for p in parts]
                out = got[0] + got[1]
            else:
                partial = np.ascontiguousarray(partial, np.float32)
                blocks = [partial[o[j]:o[j] + counts[j]] for j in range(n)]
                got = [partial[mine] if j == r else np.empty_like(blocks[r])
                       for j in range(n)]  # got[j]: rank j's partial of my rows
                reqs = [self.mpi.Irecv(got[j], source=j, tag=_TAG_REDUCE) for j in range(n)
                        if j != r and counts[r]]
                reqs += [self.mpi.Isend(blocks[j], dest=j, tag=_TAG_REDUCE)
                         for j in self._peers(counts)]
                wait(reqs)
                # into a received block (ours to overwrite), in rank order: got[1] + got[0] is
                # got[0] + got[1] exactly, so rank 0 may start from rank 1's block
                first = 1 if r == 0 else 0
                out = got[first]
                out += got[1 - first]
            for j in range(2, n):
                out += got[j]
        mine_bytes = 4 * counts[r] * math.prod(partial.shape[1:])
        self.tracer.add_bytes("reduce_scatter", 4 * partial.size - mine_bytes, mine_bytes * (n - 1))
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
        self.tracer.add_bytes("send", a.nbytes, 0)

    def recv_array(self, source: int, tag: int = 0):
        """-> (array, meta) sent by send_array."""
        with self.tracer.span("Recv", "recv"):
            shape, meta = wait_obj(self.mpi.irecv(source=source, tag=tag))
            out = np.empty(shape, np.float32)
            wait(self.mpi.Irecv(out, source=source, tag=tag))
        self.tracer.add_bytes("recv", 0, out.nbytes)
        return out, meta

    def send_obj(self, obj, dest: int, tag: int = _TAG_OBJ):
        """Send a small Python object (a batch of token ids, a header), pickled: between
        hepti's own ranks only, never from a file."""
        with self.tracer.span("Send", "send"):
            wait(self.mpi.isend(obj, dest=dest, tag=tag))

    def recv_obj(self, source: int, tag: int = _TAG_OBJ):
        """-> the object send_obj sent, of any size (mpi4py's irecv takes 32 KiB at most: a
        batch of images is more), once a probe sees it: sleeping between probes, as `wait`."""
        with self.tracer.span("Recv", "recv"):
            t0 = time.perf_counter()
            while SLEEPY and not self.mpi.iprobe(source=source, tag=tag):
                time.sleep(sleep_interval(time.perf_counter() - t0))
            return self.mpi.recv(source=source, tag=tag)

    def send_known(self, a: np.ndarray, dest: int, tag: int = 0, name: str = "Send"):
        """Send a float32 array whose shape the receiver already knows (no header): the match
        of a receive posted with `post_recv`."""
        with self.tracer.span(name, "send"):
            wait(self.mpi.Isend(np.ascontiguousarray(a, np.float32), dest=dest, tag=tag))
        self.tracer.add_bytes("send", a.nbytes, 0)

    def post_recv(self, buf: np.ndarray, source: int, tag: int = 0):
        """Post a receive into `buf` now (float32, of the shape the sender sends) and return its
        handle; `complete_recv` waits for it. The pipeline posts its outputs' receives early."""
        return self.mpi.Irecv(buf, source=source, tag=tag), buf.nbytes

    def complete_recv(self, handle, name: str = "Recv") -> None:
        req, nbytes = handle
        with self.tracer.span(name, "recv"):
            wait(req)
        self.tracer.add_bytes("recv", 0, nbytes)

    def exchange(self, sends: dict, recvs: dict) -> None:
        """Point to point, all at once: `sends` {peer: float32 array} and `recvs` {peer: float32
        buffer of the shape that peer sends}, every receive posted before any send, then all
        waited together. A height split's halo exchange: each rank sends the rows of a feature
        map its neighbours need (hepti.parallel.bands), and both sides know the shapes."""
        if not sends and not recvs:
            return
        with self.tracer.span("Halo", "halo"):
            reqs = [self.mpi.Irecv(buf, source=p, tag=_TAG_HALO) for p, buf in recvs.items()]
            reqs += [self.mpi.Isend(np.ascontiguousarray(a, np.float32), dest=p, tag=_TAG_HALO)
                     for p, a in sends.items()]
            wait(reqs)
        self.tracer.add_bytes("halo", sum(a.nbytes for a in sends.values()),
                              sum(b.nbytes for b in recvs.values()))

    def barrier(self):
        if not self.solo:
            self.mpi.Barrier()

    def barrier_idle(self) -> None:
        """A barrier ranks may wait in for seconds (another rank loading weights): asleep
        between tests (`wait_idle`), so a waiting rank leaves the CPU to the one it waits for
        (on one host they share it)."""
        if not self.solo:
            wait_idle(self.mpi.Ibarrier())

    def bcast_idle(self, a: np.ndarray | None, n: int, spin_s: float = 0.002,
                   interval: float = 0.0005) -> np.ndarray:
        """Bcast of n int64 from rank 0 that the others may wait in for minutes (a service
        between requests): it polls for `spin_s`, then sleeps `interval` between tests, so an
        idle rank costs no CPU and a busy one's command arrives without a sleep's delay. Not
        traced: the wait is for work, not part of it.

        Rank 0 sends to every rank itself (as `gather_floats` receives from each), not through
        MPI's tree: there, inner ranks pass messages on only while inside MPI, and under `hepti
        serve --replan on` an idle rank spends the time between batches probing its speed (on
        4 ranks MPICH's trees run 0 - 2 - 3). With node-c idle on emu-drift4, serving ran at
        793-814 ms a request against 733-754 with --replan off, the same plan and the batch's
        own work the same; with both verbs flat, 738-749 against 739."""
        if self.solo:
            return a
        buf = np.ascontiguousarray(a, np.int64) if self.rank == 0 else np.empty(n, np.int64)
        if self.rank == 0:
            wait([self.mpi.Isend(buf, dest=j, tag=_TAG_COMMAND) for j in range(1, self.size)])
            return buf
        # a capped rank does not spin at all: it would spend its quota on it (`wait`)
        wait_idle(self.mpi.Irecv(buf, source=0, tag=_TAG_COMMAND), 0.0 if SLEEPY else spin_s,
                  interval)
        return buf

    def gather_obj(self, obj, root: int = 0) -> list | None:
        """Small Python objects (a rank's host and pid) to root; pickled, between hepti's own
        ranks only."""
        if self.solo:
            return [obj]
        return self.mpi.gather(obj, root=root)

    def gather_floats(self, values: list[float], root: int = 0) -> list[list[float]] | None:
        """Every rank's n floats (n the same everywhere) to root, as [size][n]; waited for as
        the verbs wait (`wait`: a capped rank sleeps instead of spending its quota spinning,
        which MPI's blocking Gather would do for as long as the slowest rank computes). Each
        rank sends to root directly: no rank waits on another's progress (`bcast_idle`)."""
        a = np.asarray(values, np.float64)
        if self.solo:
            return [a.tolist()]
        if self.rank != root:
            wait(self.mpi.Isend(a, dest=root, tag=_TAG_REPORT))
            return None
        out = np.empty((self.size, a.size), np.float64)
        out[root] = a
        wait([self.mpi.Irecv(out[j], source=j, tag=_TAG_REPORT)
              for j in range(self.size) if j != root])
        return out.tolist()

    def allreduce_sum(self, a: np.ndarray) -> np.ndarray:
        """Allreduce (sum): every rank's float32 array of one shape -> the sum, on every rank.

        For a decode step's [1, C] partial sums (a few KiB: latency-bound): one round, each rank
        sends its whole array to every peer (or writes it into one shared slot, "shm") and sums
        what it got in rank order, so every rank holds the same bits, which a tree or
        recursive doubling over a non-power-of-two group does not promise. Bytes grow as N-1
        times the array per rank: for many rows, `reduce_scatter_rows` then `allgather_rows`
        move fewer."""
        if self.solo:
            return a
        n, r = self.size, self.rank
        a = np.ascontiguousarray(a, np.float32)
        with self.tracer.span("Allreduce", "allreduce"):
            if self.shm is not None:
                slots = self.shm.take((n, a.size))
                slots[r] = a.reshape(-1)
                self.shm.sync()
                got = list(slots)
            else:
                got = [a.reshape(-1) if j == r else np.empty(a.size, np.float32) for j in range(n)]
                reqs = [self.mpi.Irecv(got[j], source=j, tag=_TAG_ALLREDUCE)
                        for j in range(n) if j != r]
                reqs += [self.mpi.Isend(a, dest=j, tag=_TAG_ALLREDUCE)
                         for j in range(n) if j != r]
                wait(reqs)
            out = got[0] + got[1]
            for j in range(2, n):
                out += got[j]
        self.tracer.add_bytes("allreduce", a.nbytes * (n - 1), a.nbytes * (n - 1))
        return out.reshape(a.shape)

    def allgather_small(self, values) -> np.ndarray:
        """Allgather: every rank's few float64 numbers (as many on every rank) -> [size, n] on
        every rank. For a token's choice across a vocabulary split: each rank's best (value, index)
        pairs and its softmax sums, never the logits themselves."""
        a = np.ascontiguousarray(values, np.float64).reshape(-1)
        if self.solo:
            return a[None, :]
        n, r = self.size, self.rank
        out = np.empty((n, a.size), np.float64)
        out[r] = a
        with self.tracer.span("Allgather", "allgather"):
            reqs = [self.mpi.Irecv(out[j], source=j, tag=_TAG_SMALL)
                    for j in range(n) if j != r]
            reqs += [self.mpi.Isend(a, dest=j, tag=_TAG_SMALL) for j in range(n) if j != r]
            wait(reqs)
        self.tracer.add_bytes("allgather", a.nbytes * (n - 1), a.nbytes * (n - 1))
        return out



WAIT_SLEEP_S = 50e-6  # between tests of a pending request; far below a message's time on a link
# A wait that has gone on longer than WAIT_BACKOFF_AFTER_S sleeps WAIT_BACKOFF_FRACTION of its
# age between tests, WAIT_SLEEP_MAX_S at most (`sleep_interval`).
WAIT_BACKOFF_AFTER_S = 4e-3
WAIT_BACKOFF_FRACTION = 1 / 16
WAIT_SLEEP_MAX_S = 0.5e-3


def sleep_interval(waited_s: float) -> float:
    """Seconds a sleeping wait (`wait`, on a capped rank) sleeps before its next test, after
    `waited_s` seconds of waiting: WAIT_SLEEP_S for the first WAIT_BACKOFF_AFTER_S, then a
    sixteenth of the time waited so far, WAIT_SLEEP_MAX_S at most. A message is then seen at
    most a sixteenth of its wait (and 0.5 ms) late, and a long wait wakes a few hundred times
    a second, not 20,000; a wait shorter than 4 ms (a band's halo exchange, mostly) is as it
    was.

    Why: every wake-up of a waiting rank lands on a core a computing rank may be using (an
    emulated cluster's devices share the host's two cores: a timer interrupt, a switch, a cold
    cache, charged to the rank that computes), and an emulated device's stretch turns that CPU
    into 1/share of wall time. In MobileNetV2's `pipeline` on emu-mixed4 three ranks wait
    while one computes, for the whole forward (rank 3 ~30 ms of it). Interleaved in one launch
    (2026-11-30, the host at load 8-10 from other jobs): the stages' CPU on the 0.3- and
    0.15-core devices ran 1.19-1.29x with every wait at 50 us what it did with the waits
    backed off by this rule (the last stage 1.59 ms against 1.23, planned 1.03, natively in a
    4-rank job 1.07), and the forward 46.7 ms against 39.9 (40.2 backing off from 1 ms at an
    eighth; 32 forwards each, in turns). A real board waits on its own core."""
    if waited_s < WAIT_BACKOFF_AFTER_S:
        return WAIT_SLEEP_S
    return min(WAIT_SLEEP_MAX_S, max(WAIT_SLEEP_S, waited_s * WAIT_BACKOFF_FRACTION))


def _choose_sleepy() -> bool:
    """Sleep between tests only where spinning costs: a rank whose CPU is capped below one core
    (an emulated device, or a container slice) spends its quota polling and is then throttled
    just when the data arrives. An uncapped rank blocks in MPI's own progress loop, which
    completes a shared-memory collective in tens of microseconds; a sleeping loop made every
    one of MiniLM's 24 collectives per forward at least one timer slack (~60-100 us) late.
    Under `hepti emulate` the device's share decides (its quota is a guard above it).
    `HEPTI_MPI_WAIT=sleep|block` overrides the choice."""
    forced = os.environ.get("HEPTI_MPI_WAIT", "").strip().lower()
    if forced in ("sleep", "block"):
        return forced == "sleep"
    if stretch.ON:  # an emulated device's share, not its guard quota (1.25x)
        return stretch.share() < 1.0
    cores, _ = cpu_limit()  # the profile reads the same caps (hepti.resources)
    return cores is not None and cores < 1.0


SLEEPY = _choose_sleepy()


def wait(req) -> None:
    """Complete a non-blocking MPI request, or a list of them: block in MPI, or sleep between
    tests (see `_choose_sleepy`), longer as the wait goes on (`sleep_interval`)."""
    reqs = req if isinstance(req, list) else [req]  # Waitall of one: +0.2 us, nothing per forward
    MPI = _MPI()
    if not SLEEPY:
        MPI.Request.Waitall(reqs)
        return
    t0 = time.perf_counter()
    while not MPI.Request.Testall(reqs):
        time.sleep(sleep_interval(time.perf_counter() - t0))


def wait_idle(req, spin_s: float = 0.002, interval: float = 0.0005) -> None:
    """Complete a request that may take long (the next command, the next pass): test it for
    `spin_s`, then sleep `interval` between tests. Blocking in MPI spins and burns a core an
    idle rank must not; sleeping from the start would add up to `interval` to short waits."""
    t_end = time.perf_counter() + spin_s
    while not req.Test():
        if time.perf_counter() > t_end:
            time.sleep(interval)


def wait_obj(req):
    """Complete a non-blocking pickled receive (mpi4py `irecv`) the same way; its object."""
    if not SLEEPY:
        return req.wait()
    t0 = time.perf_counter()
    while True:
        done, obj = req.test()
        if done:
            return obj
        time.sleep(sleep_interval(time.perf_counter() - t0))


# --- the shared-memory transport ---------------------------------------------------------------
TRANSPORT_ENV = "HEPTI_COMM"  # auto (default) | shm | p2p
RING = 4  # slots the shared window cycles through; an Allgatherv result lives until the
# group's third verb after it: its slot is written again RING verbs later, by a rank that has
# returned from the verb before that one, so every rank has entered verb +RING-1 by then.


def choose_transport(mpi_comm, requested: str | None = None) -> str:
    """"shm" when every rank of the group is on this host and nothing asks for the network
    path, else "p2p". `requested` (or $HEPTI_COMM) forces one; "shm" off one host is an error.
    Collective: every rank of the group calls it."""
    want = (requested or os.environ.get(TRANSPORT_ENV) or "auto").strip().lower()
    if want not in ("auto", "shm", "p2p"):
        raise InputError(f"{TRANSPORT_ENV}={want!r}: use auto, shm or p2p")
    node = mpi_comm.Split_type(_MPI().COMM_TYPE_SHARED)
    one_host = node.Get_size() == mpi_comm.Get_size()
    node.Free()
    if want == "shm" and not one_host:
        raise InputError(f"{TRANSPORT_ENV}=shm needs every rank on one host; these ranks span "
                         "several. Use auto or p2p.")
    # MPICH's NOLOCAL asks for the network even between local ranks (hepti emulate sets it,
    # with HEPTI_COMM=p2p, so that its shaped links carry every byte)
    nolocal = os.environ.get("MPIR_CVAR_NOLOCAL", "0").strip() not in ("", "0")
    if want == "p2p" or (want == "auto" and (nolocal or not one_host)):
        return "p2p"
    return "shm"


class _SharedSlots:
    """RING slots of float32 in one MPI-3 shared window over a group on one host.

    `take(shape)` hands out the next slot's first floats as an array of that shape (the same
    slot on every rank: verbs call it in the same order everywhere), growing the window when
    they do not fit; `sync()`
    orders every rank's writes before anyone's reads. A window outgrown is freed once no
    result can still point into it (RING verbs on), collectively, as all of this is."""

    def __init__(self, mpi_comm):
        self.mpi = mpi_comm
        self.win = None
        self.slots = np.empty((RING, 0), np.float32)
        self.k = 0  # slots taken so far
        self.retired: list[tuple[int, object]] = []  # (k when outgrown, window)

    def take(self, shape: tuple) -> np.ndarray:
        n = math.prod(shape)
        if n > self.slots.shape[1] or self.win is None:
            self._grow(n)
        while self.retired and self.k - self.retired[0][0] >= RING:
            self._free(self.retired.pop(0)[1])
        slot = self.slots[self.k % RING]
        self.k += 1
        return slot[:n].reshape(shape)

    def sync(self) -> None:
        self.win.Sync()
        wait(self.mpi.Ibarrier())
        self.win.Sync()

    def _grow(self, n: int) -> None:
        MPI = _MPI()
        cap = _pad16(max(n, 2 * self.slots.shape[1], 1 << 16))
        win = MPI.Win.Allocate_shared(RING * cap * 4 if self.mpi.Get_rank() == 0 else 0, 4,
                                      comm=self.mpi)
        win.Lock_all(MPI.MODE_NOCHECK)  # a passive epoch for Win.Sync (writes stay plain stores)
        buf, _ = win.Shared_query(0)
        if self.win is not None:
            self.retired.append((self.k, self.win))
        self.win, self.slots = win, np.ndarray(buffer=buf, dtype=np.float32, shape=(RING, cap))

    @staticmethod
    def _free(win) -> None:
        win.Unlock_all()
        win.Free()

    def close(self) -> None:
        for _, w in self.retired:
            self._free(w)
        if self.win is not None:
            self._free(self.win)
        self.win, self.retired = None, []
        self.slots = np.empty((RING, 0), np.float32)


def _pad16(n: int) -> int:
    return -(-n // 16) * 16


@functools.lru_cache(maxsize=256)
def _offsets(counts: tuple[int, ...]) -> tuple[int, ...]:
    """Row offsets of row blocks `counts` (the same few layouts recur every layer)."""
    return tuple(offsets(list(counts)))


@functools.lru_cache(maxsize=256)
def _peers(counts: tuple[int, ...], rank: int) -> tuple[int, ...]:
    return tuple(j for j in range(len(counts)) if j != rank and counts[j])


@functools.cache
def _MPI():
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    return MPI
