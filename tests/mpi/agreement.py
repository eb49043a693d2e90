"""What the executors send == what the planner's program says they send.

For each strategy and ratio vector, one batch runs with every verb call recorded (kind, bytes
sent, bytes received, per rank: hepti.parallel.trace `record_messages`), and the sequence is
compared with the collectives of the program the planner evaluates for the same counts
(hepti.plan.workloads.program_for, lowered from the model's graph), each rank's bytes by
hepti.plan.costmodel.rank_bytes; for `pipeline`, with the hops PipeEdge's program charges
(hepti.plan.pipeline.stage_hops). Equal, or the test fails: a change to either side alone shows.

Each case's run also hands back its outputs, so the same run is held to the single-device
engine too (equivalence.py's check): the two checks need one run per case, not two.

Used two ways, like equivalence.py:
- by tests/mpi/test_equivalence.py under `mpiexec -n 2 ... pytest` (both checks);
- standalone for other world sizes (tests/test_distributed_launch.py launches it):
  mpiexec -n N python -m mpi4py tests/mpi/agreement.py [--outputs] --model DIR [--model DIR ...]
  prints one JSON line per case on rank 0 and exits 1 if any case disagrees (with --outputs,
  or its outputs differ from the single-device engine's).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from equivalence import (cases, inputs_for, make_plan, output_diffs, output_verdict,  # noqa: E402
                         primary_of)  # (every strategy and ratio vector; the outputs' check)
from hepti.counts import counts as split_counts  # noqa: E402
from hepti.parallel.comm import Comm  # noqa: E402
from hepti.parallel.engine import run_plan  # noqa: E402
from hepti.parallel.plans import active_ranks as group_order  # noqa: E402
from hepti.parallel.trace import Tracer  # noqa: E402
from hepti.plan.costmodel import active_ranks, rank_bytes  # noqa: E402
from hepti.plan.pipeline import activation_bytes, stage_hops  # noqa: E402
from hepti.plan.workloads import program_for  # noqa: E402
from hepti.weights import WeightStore  # noqa: E402

def predicted(model_dir, strategy: str, plan, B: int, T: int, rank: int) -> list[tuple[str, int, int]]:
    """This rank's (kind, sent, received) for every collective of the program, in order; for
    `pipeline`, its sends and receives of the hidden state (hepti.plan.pipeline.stage_hops)."""
    cfg = WeightStore(model_dir).config
    if strategy == "pipeline":
        S = activation_bytes(cfg, B, T)
        return [("send", S, 0) if j == rank else ("recv", 0, S)
                for j, k in stage_hops([tuple(r) for r in plan.layers]) if rank in (j, k)]
    if plan.strategy == "mixed":  # GenEFlow's programs: hepti.plan.genetic
        from hepti.families import family_graph
        from hepti.plan.genetic import assignment_program
        prog = assignment_program(family_graph(cfg, B, T), plan.assignment)
    else:
        prog = program_for(strategy, cfg, B, T)
    cnt = {d: [float(x) for x in split_counts(total, plan.ratios[d])] for d, total in prog.totals.items()}
    out = []
    if plan.primary:  # the program's ranks are the group's: the primary first (its root)
        order = group_order(plan, cfg)
        cnt = {d: [v[r] for r in order] for d, v in cnt.items()}
        if "rows" in cnt:  # as the runtime splits rows: by the ratios in group order
            cnt["rows"] = [float(x) for x in split_counts(prog.totals["rows"],
                                                           [plan.ratios["rows"][r] for r in order])]
        active = active_ranks(prog, cnt, len(order))
        me = order.index(rank) if rank in order else None
    else:
        active = active_ranks(prog, cnt, plan.world_size)
        me = rank if active[rank] else None
    if me is not None and sum(active) >= 2:
        for phase in prog.start + prog.layer * prog.repeat + prog.end:  # in the order they run
            if phase.collective is not None:
                sent, recv = rank_bytes(phase.collective, cnt, active)[me]
                out.append((phase.collective.kind, int(sent), int(recv)))
    out_bytes = 4 * B * T * cfg.hidden_size  # a primary other than rank 0 sends it the output
    if plan.primary and rank == plan.primary:
        out.append(("send", out_bytes, 0))
    if plan.primary and rank == 0:
        out.append(("recv", 0, out_bytes))
    return out


def traced(model_dir, plan, world_mpi) -> tuple[list[tuple[str, int, int]], list]:
    """This rank's verb calls during one batch of the fixture inputs, and the run's outputs
    (rank 0's; none elsewhere)."""
    tracer = Tracer(world_mpi.Get_rank(), record_messages=True)
    world = Comm(world_mpi, tracer)
    batches = inputs_for(model_dir)
    outs, _ = run_plan(model_dir, plan, batches, world=world)
    return list(tracer.messages), outs


def check_case(model_dir, strategy: str, vec, world_mpi, primary: int = 0) -> tuple[bool, str, list]:
    """One case run on every rank -> (its verb calls equal the program's?, why, the outputs)."""
    cfg = WeightStore(model_dir).config
    n, rank = world_mpi.Get_size(), world_mpi.Get_rank()
    plan = make_plan(strategy, vec, cfg, n, primary)
    b = inputs_for(model_dir)[0]
    B, T = b.mask.shape
    got, outs = traced(model_dir, plan, world_mpi)
    want = predicted(model_dir, strategy, plan, B, T, rank)
    if got == want:
        return True, f"{len(got)} verb calls agree", outs
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), min(len(got), len(want)))
    return False, (f"{len(got)} traced, {len(want)} in the program; first difference at call {first}: "
                   f"traced {got[first] if first < len(got) else None}, "
                   f"program {want[first] if first < len(want) else None}"), outs


def main(argv=None) -> int:
    from mpi4py import MPI
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    ap.add_argument("--outputs", action="store_true",
                    help="also hold each case's outputs to the single-device engine's (1e-4)")
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    bad = 0
    for d in args.model:
        for strategy, rname, vec in cases(comm.Get_size()):
            ok, msg, outs = check_case(d, strategy, vec, comm, primary_of(rname, comm.Get_size()))
            if args.outputs:
                out_ok, out_msg = output_verdict(output_diffs(d, outs), comm.Get_rank())
                ok, msg = ok and out_ok, f"{msg}; outputs: {out_msg}"
            results = comm.gather((ok, msg), root=0)
            if comm.Get_rank() == 0:
                good = all(o for o, _ in results)
                bad += not good
                print(json.dumps({"model": Path(d).name, "world": comm.Get_size(), "strategy": strategy,
                                  "ratios": rname, "ok": good, "outputs_checked": args.outputs,
                                  "ranks": [m for _, m in results]}), flush=True)
    bad = comm.bcast(bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
