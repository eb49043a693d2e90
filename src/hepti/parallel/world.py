"""All the ranks of one job acting together: the world as a Comm, errors every rank agrees
on, a barrier that sleeps, and the failure discipline under mpiexec (`run_guarded_fn`).

The discipline, for `hepti run`, `profile`, `bench comm` and serve's workers alike:
- checks that every rank can make alone (plan, ratios, budget) run identically everywhere and
  raise `AgreedError`: rank 0 prints it, every rank exits 2, nobody is left in a collective;
- checks only some ranks can make (input files on the primary, weight files on each device's
  disk) go through `agree()`, which turns them into the same AgreedError on every rank;
- anything else on any rank is fatal: the rank and the cause are printed and MPI_Abort ends
  every rank at once; Ctrl-C ends every rank with one line and exit 130.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback

from hepti.errors import HeptiError
from hepti.parallel.comm import Comm, wait_idle
from hepti.parallel.trace import Tracer

ABORT_GRACE_S = 0.3  # a failing rank's message gets this long to reach mpiexec before the abort


class AgreedError(HeptiError):
    """An error every rank raised together; the primary reports it."""


def agree(world, fn):
    """Run fn on every rank; if a HeptiError was raised on any, raise AgreedError on all."""
    err, result = None, None
    try:
        result = fn()
    except HeptiError as e:
        err = str(e)
    errs = world.mpi.allgather(err) if not world.solo else [err]
    bad = [(r, e) for r, e in enumerate(errs) if e]
    if bad:
        msgs = {e for _, e in bad}
        if len(msgs) == 1 and len(bad) == len(errs):
            raise AgreedError(bad[0][1])
        raise AgreedError("; ".join(f"rank {r}: {e}" for r, e in bad))
    return result


def world_comm(trace: bool = False):
    """The world as a Comm (MPI.COMM_WORLD with a Tracer)."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)

    return Comm(MPI.COMM_WORLD, Tracer(MPI.COMM_WORLD.Get_rank(), record_events=trace))


def gentle_barrier(mpi_comm, interval: float = 0.0005, spin_s: float = 0.002):
    """A barrier that polls for `spin_s`, then sleeps `interval` between tests.

    MPICH's blocking barrier spins and burns a core, which an idle rank (zero share, or waiting
    for the next request) must not do. But sleeping from the start released ranks up to one
    `interval` apart, and the timed loop's barrier then put that lag into every measured
    latency (0.45 ms of a 19 ms MiniLM forward). Polling first keeps short waits exact."""
    wait_idle(mpi_comm.Ibarrier(), spin_s, interval)


def _on_interrupt(name: str, rank: int):
    """Ctrl-C: mpiexec passes it to every rank. One line from the primary, no traceback, exit
    130 without MPI_Finalize (which would wait for a peer inside a collective that never
    completes; the process manager ends such a peer). Python raises KeyboardInterrupt only
    between bytecodes, and a rank blocked in an MPI wait for a peer that has already left
    would never get there: so a watcher thread, woken through the signal wakeup fd (mpi4py
    releases the GIL in blocking calls), does the same at once. Returns the function both
    call; whichever is first ends the process."""
    once = threading.Lock()

    def interrupted():
        with once:
            if rank == 0:
                sys.stderr.write(f"hepti {name}: interrupted\n")
                sys.stderr.flush()
            time.sleep(ABORT_GRACE_S)  # for mpiexec to forward the line (see below)
            os._exit(130)

    if threading.current_thread() is threading.main_thread():
        r, w = os.pipe()
        os.set_blocking(w, False)
        signal.set_wakeup_fd(w, warn_on_full_buffer=False)

        def watch():
            while True:
                got = os.read(r, 64)
                if signal.SIGINT in got:
                    interrupted()

        threading.Thread(target=watch, name="hepti-interrupt", daemon=True).start()
    return interrupted


def run_guarded_fn(name: str, fn, args) -> int:
    """Run fn(args) on every rank: agreed errors are reported once by rank 0 (exit 2); any
    other failure on any rank names the rank and aborts the whole job."""
    from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
    rank = MPI.COMM_WORLD.Get_rank()
    interrupted = _on_interrupt(name, rank)
    try:
        return fn(args)
    except AgreedError as e:
        if rank == 0:
            print(f"hepti {name}: error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        interrupted()  # the partial output was closed on the way here (a `finally`)
    except BaseException as e:  # noqa: BLE001 - any other failure ends the whole job
        if isinstance(e, HeptiError):
            text = f"hepti {name}: rank {rank}: error: {e}\n"
        else:
            text = (traceback.format_exc() + f"hepti {name}: rank {rank} failed: "
                    f"{type(e).__name__}: {e}; aborting all ranks\n")
        # One write, then a moment for mpiexec to forward it: MPI_Abort tears down the
        # process managers' pipes at once, and a fresh-clone test run once caught only the
        # traceback's first line, without the rank and the cause.
        sys.stderr.write(text)
        sys.stderr.flush()
        time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)
        return 1
