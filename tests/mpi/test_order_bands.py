"""Under mpiexec -n 2: the height-split executor in a given operator order gives the same
logits as in its own order, and each rank's allocation counter (hepti.model.livebytes) comes
to exactly the memory model's peak of that rank's part (`BandExecutor.rank_dag`: its bands,
and each widening of a band by a halo as a step of its own), heads split either way."""
from __future__ import annotations

import numpy as np
import pytest

from mpi_helpers import COMM, all_ok

from hepti.config import CNNConfig
from hepti.graph.cnn import build
from order_helpers import TINY, late_downsample_order, pixels, random_tensors


def _run(name, split, order=None, h=56, w=48):
    from hepti.graph.split import conv_rows
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.bands import BandExecutor, head_rows
    from hepti.parallel.comm import Comm
    from hepti.order.memory import order_peak
    from hepti.model.cnn import Weights, tensors_reader
    comm = Comm(COMM)
    graph = build(CNNConfig(**TINY[name]))  # every rank: the same seeded weights, its columns
    weights = Weights(graph, tensors_reader(random_tensors(name)),
                      head_rows(graph, split, comm.rank, comm.size),
                      conv_rows(graph, split, comm.rank, comm.size))
    ex = BandExecutor(comm, graph, split, weights, order=order)
    x = pixels(1, h, w)
    c = AllocationCounter()
    got = ex.forward(x if comm.rank == 0 else None, counter=c)
    dag, seq = ex.rank_dag(h, w, 1, comm.rank)
    modelled = order_peak(dag, seq, count_io=True)
    comm.close()
    return got, c.peak, modelled


@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("ratios,head,fuse", [((0.5, 0.5), "cols", 0), ((0.7, 0.3), "primary", 0),
                                              ((0.3, 0.7), "cols", 4)])
def test_counter_equals_the_rank_model(name, ratios, head, fuse):
    from hepti.graph.split import Split, spatial_ops
    n = spatial_ops(build(CNNConfig(**TINY[name])))
    groups = tuple((a, min(a + fuse, n)) for a in range(0, n, fuse)) if fuse else None
    got, peak, modelled = _run(name, Split(ratios, groups, head))
    all_ok(peak == modelled, f"{name} {ratios} {head}: counter {peak}, model {modelled}")


def test_a_fused_resnet_in_another_order_same_logits_and_the_rank_model_exactly():
    from hepti.graph.split import Split, spatial_ops
    g = build(CNNConfig(**TINY["resnet50"]))
    whole = Split((0.6, 0.4), ((0, spatial_ops(g)),))
    order = late_downsample_order(g)
    want, _, _ = _run("resnet50", whole)
    got, peak, modelled = _run("resnet50", whole, order)
    if COMM.Get_rank() == 0:
        all_ok(np.array_equal(got, want), "logits differ in another order")
    else:
        all_ok(got is None and want is None, "a rank other than 0 returned logits")
    all_ok(peak == modelled, f"counter {peak}, model {modelled}")


@pytest.mark.parametrize("name", sorted(TINY))
def test_counter_equals_the_rank_model_split_by_channels(name):
    """Groups split by channels (whole maps on every rank) beside groups split by rows."""
    from hepti.graph.split import Split, spatial_ops
    n = spatial_ops(build(CNNConfig(**TINY[name])))
    dims = tuple("channels" if i % 3 else "rows" for i in range(n))
    split = Split((0.6, 0.4), tuple((i, i + 1) for i in range(n)), "cols", dims=dims)
    got, peak, modelled = _run(name, split)
    all_ok(peak == modelled, f"{name} by channels: counter {peak}, model {modelled}")
