"""`hepti run` under mpiexec (or with --strategy), on every rank: check the inputs and open the
output on rank 0, then run the family's job: hepti.parallel.engine's for the transformers,
hepti.parallel.cnn_job's for the CNNs. `run_guarded` adds the failure discipline of
hepti.parallel.engine's docstring.

It sits above both jobs, so that neither imports the other.
"""
from __future__ import annotations

import time
from pathlib import Path

import numba
from mpi4py import MPI

from hepti.families import family
from hepti.parallel.cnn_job import run_cnn
from hepti.parallel.comm import Comm
from hepti.parallel.engine import agree, run_guarded_fn, run_prepared
from hepti.parallel.trace import Tracer
from hepti.runner import prepare
from hepti.weights import WeightStore


def run_distributed(args) -> int:
    """`hepti run` under mpiexec (or with --strategy): every rank calls this."""
    t_start = time.perf_counter()
    mpi = MPI.COMM_WORLD
    world = Comm(mpi, Tracer(mpi.Get_rank()))
    rank = world.rank
    rank0 = rank == 0
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))

    store = agree(world, lambda: WeightStore(args.model))  # each device's own copy of the files
    cfg = store.config
    # Every input is checked, and the output opened (or resumed), before any weights load.
    prep = agree(world, lambda: prepare(args, cfg, Path(args.model)) if rank0 else None)
    try:
        if family(cfg).executor == "bands":  # split by height: hepti.parallel.bands
            return run_cnn(args, world, store, prep, t_start)
        return run_prepared(args, world, store, prep, t_start)
    finally:
        if prep is not None and prep.out is not None:
            prep.out.close()  # a no-op once committed; else the partial file stays for --resume


def run_guarded(args) -> int:
    """run_distributed with the failure discipline of the module docstring."""
    return run_guarded_fn("run", run_distributed, args)
