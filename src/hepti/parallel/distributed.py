"""`hepti run` under mpiexec (or with --strategy), on every rank: check the inputs and open the
output on rank 0, then run the job of the family's executor kind (hepti.parallel.engine's
one driver, `run_prepared`). `run_guarded` adds the failure discipline of
hepti.parallel.world.
"""
from __future__ import annotations

import time
from pathlib import Path

import numba
from mpi4py import MPI

from hepti.families import family
from hepti.parallel.comm import Comm
from hepti.parallel.engine import run_prepared
from hepti.parallel.trace import Tracer
from hepti.parallel.world import agree, run_guarded_fn
from hepti.runner import prepare
from hepti.weights import WeightStore


def run_distributed(args) -> int:
    """`hepti run` under mpiexec (or with --strategy): every rank calls this."""
    t_start = time.perf_counter()
    mpi = MPI.COMM_WORLD
    world = Comm(mpi, Tracer(mpi.Get_rank()))
    rank0 = world.rank == 0
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))

    store = agree(world, lambda: WeightStore(args.model))  # each device's own copy of the files
    cfg = store.config
    # Every input is checked, and the output opened (or resumed), before any weights load.
    prep = agree(world, lambda: prepare(args, cfg, Path(args.model)) if rank0 else None)
    try:
        return run_prepared(args, world, store, prep, t_start, family(cfg).executor)
    finally:
        if prep is not None and prep.out is not None:
            prep.out.close()  # a no-op once committed; else the partial file stays for --resume


def run_guarded(args) -> int:
    """run_distributed with the failure discipline of hepti.parallel.world."""
    return run_guarded_fn("run", run_distributed, args)
