"""A CNN's height split (hepti.graph.split `Split`) written as a `Program` of steps, the data
types the transformers' lowering writes (hepti.graph.program), so that one link model prices
both families (hepti.plan.costmodel) and one agreement test holds both to what their executors'
verbs move (tests/mpi/agreement.py, tests/mpi/cnn_agreement.py).

The program of a band plan, in the order hepti.parallel.bands `BandExecutor.forward` runs it:

    per group split by rows:      [halo]  the group's inputs' missing rows, point to point
                                  compute its ops on the rank's bands (overlap recomputed)
    per group split by channels:  [halo]  every member fetches the whole input map
                                  per op: compute its channels, then allgatherv of the map
    global pooling (1x1):         compute the partial sums of the rank's own rows, then
                                  allgatherv of the partials (the pooled sum's reduce:
                                  hepti.parallel.bands `pooled_sum`, an allgather + local sum)
    grid pooling (VGG's 7x7):     allgatherv of the map's rows, then compute the pool
    head split by columns:        per linear: compute its columns, then allgatherv of them

A halo exchange moves different rows between different pairs of ranks, not a block per rank
of one dimension, so its `Collective` (kind "halo") carries every rank's bytes sent and
received and how many peers it exchanges with (`Collective.moves`): the same rows
hepti.graph.split `fetches` lists for the executor and the CoEdge model. A phase with none
of a group's halo (no rank misses a row) has no collective.

Compute is written as `Work` on one dimension per op (the op's name): a rank's count is the
output rows it computes of it times the batch (a channel split's: those rows times its share
of the channels; a linear's: its share of the columns), `per_unit` the op's FLOPs per row
(`Graph.flops_per_row`). Each Work's counts are the rows of *this* plan (a fused group's
recomputed overlap included), so `band_program` returns the counts beside the program: they
are not a ratio vector's largest-remainder counts, as a transformer program's are.

Not covered: a split with a rank that has no share of anything (the executor then runs on a
sub-communicator of the members: build the program for `split.on(members)`), streamed
weights' reads, and the executor's copies (laying out a channel split's map, the halos' own
copies), which the CoEdge model takes from its band timings.
"""
from __future__ import annotations

from hepti.graph.cnn import ADAPTIVE_AVG, CONV, LINEAR, Graph
from hepti.graph.program import Collective, Phase, Program, Work
from hepti.graph.split import (Split, channel_needs, fetches, first_holders, hold, needs,
                               out_channels, owned, spatial_ops)

F32 = 4


def _work(op, flops: dict) -> Work:
    return Work("gemm" if op.kind in (CONV, LINEAR) else "elementwise", op.name,
                flops[op.name], name=op.name)


def band_program(graph: Graph, split: Split, h: int, w: int, n: int = 1, size: int | None = None
                 ) -> tuple[Program, dict[str, list[float]]]:
    """(program, counts) of `split` on `size` ranks (len(split.ratios) when None) for a
    forward of n images of h x w. Phase names say what each step is: "halo G", "compute G",
    "allgather OP" (a channel split's map, a grid pool's map, a head's columns) and
    "pooled sum"."""
    P = len(split.ratios) if size is None else size
    if len(split.members()) < P:
        raise ValueError(f"{split}: a rank without a share runs on a sub-communicator; build "
                         f"the program for split.on(split.members())")
    shapes = graph.shapes(h, w)
    flops = graph.flops_per_row(h, w)
    owners = split.owners(graph)
    holders = first_holders(graph, h, P)
    cnt: dict[str, list[float]] = {}
    totals: dict[str, int] = {}
    phases: list[Phase] = []

    def count(dim: str, per_rank: list[float], total: int):
        cnt[dim] = [float(x) for x in per_rank]
        totals[dim] = int(total)

    for k, (a, b) in enumerate(split.group_ranges(graph)):
        ratios = split.group_ratios(k)
        by_channels = split.group_dim(k) == "channels"
        need = [(channel_needs if by_channels else needs)(graph, shapes, (a, b), ratios, r)
                for r in range(P)]
        made = {op.output for op in graph.ops[a:b]}
        inputs = sorted({t for nd in need for t in nd} - made)
        sent, got = [0.0] * P, [0.0] * P
        peers = [set() for _ in range(P)]
        for t, j, i, lo, hi in fetches(need, inputs, owners, holders, shapes, P):
            nbytes = F32 * n * (hi - lo) * shapes[t][1] * shapes[t][2]
            sent[j] += nbytes
            got[i] += nbytes
            peers[j].add(i)
            peers[i].add(j)
        if any(sent) or any(got):
            phases.append(Phase((), Collective(
                "halo", None, 0.0, name=f"halo {k}",
                moves=tuple((sent[i], got[i], len(peers[i])) for i in range(P))),
                name=f"halo {k}"))
        ops = graph.ops[a:b]
        if by_channels:
            for op in ops:
                hh, ww, c = shapes[op.output]
                per = out_channels(op, ratios, c)
                count(op.name, [n * hh * x / c for x in per], n * hh)
                ch = f"{op.name} channels"
                count(ch, per, c)
                phases.append(Phase((_work(op, flops),), Collective(
                    "allgatherv", ch, F32 * n * hh * ww, name=f"allgather {op.name}"),
                    name=f"compute {op.name}"))
        else:
            for op in ops:
                rows = [nd.get(op.output) for nd in need]
                count(op.name, [n * (r[1] - r[0]) if r else 0 for r in rows],
                      n * shapes[op.output][0])
            phases.append(Phase(tuple(_work(op, flops) for op in ops), None,
                                name=f"compute {k}"))
        hold(holders, need, inputs, [op.output for op in ops], by_channels, shapes, P)

    for op in graph.ops[spatial_ops(graph):]:
        if op.kind == ADAPTIVE_AVG:
            hh, ww, c = shapes[op.input]
            rows = owned(hh, owners.get(op.input, split.ratios), P)
            if op.out_hw == (1, 1):  # partial sums of the own rows, allgathered and added
                count(op.name, [n * (r1 - r0) for r0, r1 in rows], n * hh)
                count("pooled sum", [1 if r1 > r0 else 0 for r0, r1 in rows],
                      sum(r1 > r0 for r0, r1 in rows))
                phases.append(Phase((_work(op, flops),), Collective(
                    "allgatherv", "pooled sum", F32 * n * c, name="pooled sum"),
                    name=f"compute {op.name}"))
            else:  # the whole map gathered, then pooled on every rank
                dim = f"{op.name} rows"
                count(dim, [r1 - r0 for r0, r1 in rows], hh)
                phases.append(Phase((), Collective("allgatherv", dim, F32 * n * ww * c,
                                                   name=f"allgather {op.name}"),
                                    name=f"gather {op.name}"))
                count(op.name, [n * hh] * P, n * hh)
                phases.append(Phase((_work(op, flops),), None, name=f"compute {op.name}"))
        elif op.kind == LINEAR:
            if split.head == "primary" or P == 1:
                count(op.name, [n] + [0] * (P - 1), n)
                phases.append(Phase((_work(op, flops),), None, name=f"compute {op.name}"))
                continue
            cols = owned(op.cout, split.ratios, P)
            cw = [c1 - c0 for c0, c1 in cols]
            count(op.name, [n * x / op.cout for x in cw], n)
            dim = f"{op.name} cols"
            count(dim, cw, op.cout)
            phases.append(Phase((_work(op, flops),), Collective(
                "allgatherv", dim, F32 * n, name=f"allgather {op.name}"),
                name=f"compute {op.name}"))
        else:
            raise ValueError(f"{op.name}: a {op.kind} op after the spatial part")
    prog = Program(f"{graph.config.arch} bands", totals, phases, [], [], 0, [])
    return prog, cnt
