"""The MPI side of `hepti serve`: every rank runs `python -m hepti.serve.worker ...` under the
front end's mpiexec.

Each rank opens its own copy of the weights and the ranks plan as `hepti run` does (a fixed
strategy, a plan file, or the planner on a measured profile), then build one `Job` and keep it:
the weights stay loaded between requests. Rank 0 connects to the front end's channel
(hepti.serve.protocol) and says hello (the secret, the plan, each rank's host and pid). Then,
per batch the front end sends, rank 0 broadcasts a command, [op, batch id], and all ranks run
the batch through the job; rank 0 pools the hidden states and answers. Between batches the
other ranks wait in `Comm.bcast_idle`, asleep, and rank 0 in a socket read.

A failure on any rank ends the whole job (`run_guarded_fn`), as in `hepti run`: the front end
sees the channel close and mpiexec exit, and relaunches (hepti.serve.supervisor).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

OP_STOP, OP_BATCH = 0, 1


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hepti.serve.worker",
                                 description="hepti serve's MPI workers (started by `hepti serve`)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--strategy", default=None)
    ap.add_argument("--ratios", default=None)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--mem-cap", default=None)
    ap.add_argument("--mem-budget", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plan-seq", type=int, default=128, help="tokens per input the plan is made for")
    ap.add_argument("--plan-batch", type=int, default=1, help="inputs per batch the plan is made for")
    ap.add_argument("--pool", choices=("mean", "cls"), default="mean")
    ap.add_argument("--normalize", type=int, default=1)
    args = ap.parse_args(argv)
    args.json = True  # plan_with_profile: no chatter on stdout
    return args


def make_batch(inputs: list[np.ndarray], pad_id: int):
    """Token id lists -> one Batch padded to the longest (mask 0 on padding)."""
    from hepti.inputs import Batch
    B, T = len(inputs), max(len(x) for x in inputs)
    ids = np.full((B, T), pad_id, np.int64)
    mask = np.zeros((B, T), np.int64)
    for i, x in enumerate(inputs):
        ids[i, :len(x)] = x
        mask[i, :len(x)] = 1
    return Batch(ids, mask, np.zeros((B, T), np.int64))


def serve(args) -> int:
    """Every rank: load, plan, then run batches until the front end says stop or goes away."""
    import numba
    from mpi4py import MPI

    from hepti.model.pooling import pool
    from hepti.parallel.comm import Comm
    from hepti.parallel.engine import (Job, agree, needs_planner, plan_with_profile,
                                       resolve_plan)
    from hepti.parallel.trace import Tracer
    from hepti.serve import protocol
    from hepti.weights import WeightStore

    t_start = time.perf_counter()
    mpi = MPI.COMM_WORLD
    world = Comm(mpi, Tracer(mpi.Get_rank()))
    rank0 = world.rank == 0
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    store = agree(world, lambda: WeightStore(args.model))
    cfg = store.config
    if needs_planner(args):
        plan = plan_with_profile(args, world, cfg, batch=args.plan_batch, seq_len=args.plan_seq)
    else:
        plan = agree(world, lambda: resolve_plan(args, world.size, cfg))
    job = agree(world, lambda: Job(world, store, plan, args.threads))
    me = {"rank": world.rank, "host": os.uname().nodename, "pid": os.getpid()}
    # a line to the front end that stays open while this rank lives: when the job ends, the one
    # that closed first names the rank that was lost (hepti.serve.supervisor)
    watch = protocol.connect(os.environ[protocol.CONTROL_ENV])
    protocol.send(watch, {"op": "watch", "token": os.environ.get(protocol.TOKEN_ENV, ""), **me})
    ranks = world.gather_obj(me)  # after every rank's watch line: the hello comes last
    sock = None
    if rank0:
        sock = protocol.connect(os.environ[protocol.CONTROL_ENV])
        protocol.send(sock, {"op": "hello", "token": os.environ.get(protocol.TOKEN_ENV, ""),
                             "plan": json.loads(plan.to_json()), "ranks": ranks, "world_size": world.size,
                             "hidden_size": cfg.hidden_size, "load_s": time.perf_counter() - t_start})
    try:
        while True:
            header = data = None
            if rank0:
                try:
                    header, data = protocol.recv(sock)
                except protocol.ChannelClosed:
                    header = {"op": "stop"}
                op = OP_BATCH if header["op"] == "batch" else OP_STOP
                cmd = np.array([op, int(header.get("id", 0))], np.int64)
            else:
                cmd = None
            op, batch_id = (int(v) for v in world.bcast_idle(cmd, 2))
            if op == OP_STOP:
                return 0
            batch = None
            if rank0:
                inputs = protocol.unpack_ids(header["lengths"], data)
                batch = make_batch(inputs, cfg.pad_token_id)
            out = {}
            t0 = time.perf_counter()
            job.run_all([batch] if rank0 else (), 1, lambda k, h: out.setdefault("h", h))
            if rank0:
                wall = time.perf_counter() - t0
                emb = pool(out["h"], batch.mask, args.pool, bool(args.normalize))
                protocol.send(sock, {"op": "result", "id": batch_id, "shape": list(emb.shape),
                                     "wall_s": wall}, emb)
    finally:
        if sock is not None:
            sock.close()
        job.close()
        watch.close()


def main(argv=None) -> int:
    from hepti.parallel.engine import run_guarded_fn
    return run_guarded_fn("serve (worker)", serve, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
