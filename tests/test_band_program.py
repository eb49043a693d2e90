"""A CNN band plan as a Program (hepti.graph.band_program), priced by the cost model's link terms
(hepti.plan.costmodel): its halos move exactly the bytes CoEdge's model charges (hepti.plan.coedge
`predict`, itself held to the executor's verbs by tests/mpi/test_cnn_bands.py -k halo_bytes, as
the program is by tests/mpi/test_cnn_agreement.py), its phases run in the executor's order, and
a halo costs each rank p_i alpha_i + max(s_i, r_i) / beta_i."""
from __future__ import annotations

import pytest

from helpers import TINY_CNNS
from hepti.config import CNNConfig
from hepti.graph.band_program import band_program
from hepti.graph.cnn import build
from hepti.graph.program import Collective
from hepti.graph.split import Split, spatial_ops
from hepti.plan.coedge import CNNCosts, predict
from hepti.plan.costmodel import active_ranks, collective_times, evaluate, rank_bytes
from hepti.plan.profile import declared_profile

H, W = 65, 57


def _splits(g, ratios):
    n = spatial_ops(g)
    return [Split(ratios), Split(ratios, head="primary"),
            Split(ratios, groups=((0, n // 3), (n // 3, n))),
            Split(ratios, groups=((0, 3), (3, 4), (4, 5), (5, n)),
                  dims=("rows", "channels", "channels", "rows"))]


@pytest.mark.parametrize("arch", ["resnet50_tiny", "vgg16_tiny", "mobilenet_v2"])
@pytest.mark.parametrize("ratios", [(0.7, 0.3), (0.5, 0.3, 0.2), (0.15, 0.25, 0.6)])
def test_halo_bytes_equal_coedge(arch, ratios):
    g = build(CNNConfig(**TINY_CNNS[arch]) if arch in TINY_CNNS else CNNConfig(arch=arch))
    P = len(ratios)
    costs = CNNCosts(op_s=[[1e-3] * len(g.ops)] * P, overhead_s=[0.0] * P, latency_s=[0.0] * P,
                     bandwidth_Bps=[1e9] * P, memory_bytes=[1e9] * P, h=H, w=W)
    for split in _splits(g, ratios):
        prog, cnt = band_program(g, split, H, W, 1, P)
        active = active_ranks(prog, cnt, P)
        moved = [[0.0, 0.0] for _ in range(P)]
        for phase, _, _ in prog.phases():
            if phase.collective is not None and phase.collective.kind == "halo":
                for i, (s, r) in enumerate(rank_bytes(phase.collective, cnt, active)):
                    moved[i][0] += s
                    moved[i][1] += r
        want = [[p["halo_bytes_sent"], p["halo_bytes_recv"]]
                for p in predict(g, split, costs, H, W)["per_rank"]]
        assert moved == want, (split, moved, want)


def test_phases_in_the_executors_order():
    g = build(CNNConfig(**TINY_CNNS["resnet50_tiny"]))
    n = spatial_ops(g)
    prog, cnt = band_program(g, Split((0.6, 0.4), groups=((0, 4), (4, n))), H, W)
    names = [p.name for p in prog.phases() for p in [p[0]]]
    kinds = [p.collective.kind if p.collective else None for p, _, _ in prog.phases()]
    assert names[:4] == ["halo 0", "compute 0", "halo 1", "compute 1"]
    assert kinds[-2:] == ["allgatherv", "allgatherv"]  # the pooled sum, the head's columns
    assert cnt["pooled sum"] == [1.0, 1.0]
    # a fused group computes its overlap: more rows than it owns, in all
    first = g.ops[0].name
    assert sum(cnt[first]) > prog.totals[first]


def test_halo_priced_by_each_ranks_link():
    prof = declared_profile([dict(gemm_flops=1e10, memory_bytes=1e9, latency_s=a, bandwidth_Bps=b)
                             for a, b in [(1e-4, 1e8), (2e-4, 5e7), (5e-5, 1e7)]])
    halo = Collective("halo", None, 0.0, moves=((1e6, 3e5, 1), (2e5, 9e5, 2), (1e5, 0.0, 1)))
    t = collective_times(halo, {}, [True] * 3, prof)
    assert t == pytest.approx([1e-4 + 1e6 / 1e8, 2 * 2e-4 + 9e5 / 5e7, 5e-5 + 1e5 / 1e7])
    g = build(CNNConfig(**TINY_CNNS["resnet50_tiny"]))
    prog, cnt = band_program(g, Split((0.5, 0.3, 0.2)), H, W)
    pred = evaluate(prog, cnt, prof)
    assert pred.latency_s > 0 and pred.per_rank[2].comm_s["halo"] > 0
