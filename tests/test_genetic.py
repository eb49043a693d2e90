"""GenEFlow (hepti.plan.genetic): reproducible from its seed, never worse than the LP's plan
under the same cost model, every cap respected, and a cap nothing meets is a clear PlanError
(and a non-zero exit without a traceback from `hepti plan`). No timing thresholds here."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from hepti.families import preset_config
from hepti.errors import PlanError
from hepti.graph import lower
from hepti.families import family_graph
from hepti.plan.costmodel import evaluate
from hepti.plan.genetic import (DEFAULTS, UNIT, ROWS, assignment_program, block_assignment,
                                blocks_of, genetic_search, make_genetic_plan, single_device_peak)
from hepti.plan.partition import make_plan
from hepti.plan.planfile import Plan
from hepti.plan.profile import declared_profile

SMALL = dict(population=12, generations=8)  # enough to exercise every operator, quickly


def cluster(n: int = 3):
    """Three devices of different speed and link (a mini PC, a Pi 4, a Pi 3 on Wi-Fi), 1 GB each."""
    devs = [dict(gemm_flops=5e10, memory_bytes=1e9, latency_s=5e-5, bandwidth_Bps=1.1e8),
            dict(gemm_flops=3e10, memory_bytes=1e9, latency_s=5e-5, bandwidth_Bps=1.1e8),
            dict(gemm_flops=1.5e10, memory_bytes=1e9, latency_s=1e-4, bandwidth_Bps=3e7)]
    return declared_profile(devs[:n])


@pytest.fixture(scope="module")
def cfg():
    return preset_config("bert-base")


def test_the_cli_defaults_are_the_modules():
    from hepti.cli import GA_DEFAULTS
    assert all(DEFAULTS[k] == v for k, v in GA_DEFAULTS.items())


def test_block_genes_give_the_strategies_assignments(cfg):
    g = family_graph(cfg, 1, 16)
    blocks = blocks_of(g)
    assert blocks == ("attention", "ffn")
    assert block_assignment(g, blocks, (ROWS, ROWS)) == lower.assignment(g, "rows")
    assert block_assignment(g, blocks, (UNIT, UNIT)) == lower.assignment(g, "tensor")
    mixed = block_assignment(g, blocks, (UNIT, ROWS))
    assert lower.check_assignment(g, mixed) == mixed
    assert lower.sliced_units(g, mixed) == {"heads"}


def test_the_same_seed_gives_the_same_plan(cfg):
    a = make_genetic_plan(cfg, cluster(), 64, 1, 3.5e8, seed=7, **SMALL)
    b = make_genetic_plan(cfg, cluster(), 64, 1, 3.5e8, seed=7, **SMALL)
    for p in (a, b):  # all but the clock
        p.solve_s = None
        p.predicted["genetic"].pop("search_s")
        p.explanation = re.sub(r"in [0-9.]+ s\)", "", p.explanation)
    assert a.to_dict() == b.to_dict()
    g = a.predicted["genetic"]
    for k in ("seed", "population", "generations", "crossover", "mutation"):
        assert k in g and str(g[k]) in a.explanation


@pytest.mark.parametrize("cap", [None, 0.75, 0.5])
@pytest.mark.parametrize("n", [2, 3])
def test_never_worse_than_the_lp_and_within_every_cap(cfg, n, cap):
    profile = cluster(n)
    budget = None if cap is None else cap * single_device_peak(cfg, profile, 64)
    lp = make_plan(cfg, profile, 64, 1, "auto", mem_budget=budget)
    res = genetic_search(cfg, profile, 64, 1, budget, seed=1, lp_plan=lp, **SMALL)
    assert res.candidate.latency_s <= lp.predicted_latency_s * (1 + 1e-12)
    assert res.seeds["lp plan"] == pytest.approx(lp.predicted_latency_s, rel=1e-12)
    caps = [min(d.usable_bytes, budget or float("inf")) for d in profile.devices]
    pred = res.candidate.prediction
    assert all(r.mem_bytes <= caps[r.rank] * (1 + 1e-9) for r in pred.per_rank if r.active)
    # the prediction is the cost program's own for the plan's assignment and counts
    g = family_graph(cfg, 1, 64)
    if not res.genome.window:
        again = evaluate(assignment_program(g, res.assignment), res.candidate.counts, profile)
        assert again.latency_s == pytest.approx(res.candidate.latency_s, rel=1e-12)


def test_a_mixed_plan_file_round_trips_and_names_its_splits(cfg):
    g = family_graph(cfg, 1, 16)
    assign = block_assignment(g, blocks_of(g), (ROWS, UNIT))
    plan = Plan("mixed", 2, {d: [0.5, 0.5] for d in ("heads", "ffn", "rows")}, assignment=assign)
    again = Plan.from_dict(json.loads(plan.to_json())).validate(2)
    assert again.assignment == assign
    with pytest.raises(PlanError, match="assignment"):
        Plan("mixed", 2, {d: [0.5, 0.5] for d in ("heads", "ffn", "rows")}).validate(2)
    # an old plan file (no assignment field) still reads
    d = plan.to_dict()
    d.pop("assignment")
    d["strategy"] = "tensor"
    assert Plan.from_dict(d).assignment is None


def test_an_assignment_that_cannot_be_lowered_is_a_plan_error(cfg):
    from hepti.parallel.plans import plan_assignment
    g = family_graph(cfg, 1, 16)
    bad = dict(block_assignment(g, blocks_of(g), (UNIT, UNIT)), attention="rows")  # heads' columns
    plan = Plan("mixed", 2, {d: [0.5, 0.5] for d in ("heads", "ffn", "rows")}, assignment=bad)
    with pytest.raises(PlanError, match="does not fit"):
        plan_assignment(plan, g)
    with pytest.raises(PlanError, match="no operator named"):
        plan_assignment(Plan("mixed", 2, plan.ratios, assignment={**bad, "nope": "rows"}), g)


def test_a_cap_nothing_meets_is_a_plan_error(cfg):
    with pytest.raises(PlanError, match="no plan fits the memory caps.*raise --mem-cap"):
        make_genetic_plan(cfg, cluster(), 64, 1, 20 * 2**20, seed=0, **SMALL)


def test_the_cli_exits_non_zero_without_a_traceback(tmp_path, tiny_dir):
    prof = tmp_path / "p.json"
    prof.write_text(cluster().to_json())
    base = [sys.executable, "-m", "hepti.cli", "plan", "--model", str(tiny_dir), "--profile",
            str(prof), "--seq", "16", "--search", "genetic", "--generations", "2"]
    r = subprocess.run(base + ["--mem-cap", "1%"], capture_output=True, text=True)
    assert r.returncode != 0
    assert "no plan fits the memory caps" in r.stderr
    assert "Traceback" not in r.stderr
    ok = subprocess.run(base + ["--mem-cap", "75%", "--json"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    plan = Plan.from_dict(json.loads(ok.stdout)).validate(3)
    assert plan.predicted["genetic"]["generations"] == 2


# --- CNNs: fused groups and each group's rows split (hepti.plan.genetic_cnn) ------------------

def _cnn():
    from test_plan_coedge import H, W, _costs, _graph
    g = _graph()
    return g, _costs(g, [3.0, 1.5, 1.0], latency=2e-4, bandwidth=2e7), H, W


def test_cnn_search_is_reproducible_and_never_worse_than_coedge():
    from hepti.plan.genetic_cnn import genetic_cnn_search
    g, costs, H, W = _cnn()
    a = genetic_cnn_search(g, costs, H, W, 1, [1e10] * 3, seed=5, **SMALL)
    b = genetic_cnn_search(g, costs, H, W, 1, [1e10] * 3, seed=5, **SMALL)
    assert a[0] == b[0]
    best, pred, report = a
    assert pred["latency_s"] <= report["seeds_s"]["coedge lp"] * (1 + 1e-12)
    assert report["lp_latency_s"] == report["seeds_s"]["coedge lp"]


def test_cnn_caps_hold_and_a_cap_below_the_weights_says_why():
    from hepti.plan.genetic_cnn import band_memory, genetic_cnn_search, single_device_peak_cnn
    g, costs, H, W = _cnn()
    peak = single_device_peak_cnn(g, H, W)
    cap = g.weight_bytes() + 0.6 * (peak - g.weight_bytes())  # the activations must be split
    best, pred, _ = genetic_cnn_search(g, costs, H, W, 1, [cap] * 3, seed=0, **SMALL)
    assert all(m <= cap * (1 + 1e-9) for m in band_memory(g, best.split(), H, W, 1, 3))
    with pytest.raises(PlanError, match="no plan fits the memory caps"):
        genetic_cnn_search(g, costs, H, W, 1, [0.2 * g.weight_bytes()] * 3, seed=0, **SMALL)


def test_cnn_a_cap_below_the_weights_is_met_by_channel_splits():
    """No rows split fits a cap below the weights (each rank with rows of an op holds its
    whole weight); splitting some ops by channels slices them, and the caps hold."""
    from hepti.plan.genetic_cnn import band_memory, genetic_cnn_search
    g, costs, H, W = _cnn()
    cap = 0.9 * g.weight_bytes()
    best, pred, _ = genetic_cnn_search(g, costs, H, W, 1, [cap] * 3, seed=0, **SMALL)
    split = best.split()
    assert split.dims is not None and "channels" in split.dims
    assert all(m <= cap * (1 + 1e-9) for m in band_memory(g, split, H, W, 1, 3))


@pytest.mark.parametrize("name", ["resnet50", "mobilenet_v2"])
def test_cnn_weight_bytes_are_what_each_rank_loads(name):
    """The memory model's weights per rank (weight_bytes_of) equal what hepti.model.cnn's
    Weights loads for that rank's conv and head rows, under a split mixing rows (a rank
    without rows in a group loads none of its convs) and channels (a grouped conv too)."""
    import numpy as np
    import dataclasses
    from hepti.graph.split import Split, conv_rows, head_rows, spatial_ops, streamed_convs
    from hepti.model.cnn import Weights, tensors_reader
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.plan.genetic_cnn import weight_bytes_of
    from order_helpers import TINY
    g = build(CNNConfig(**TINY[name]))
    assert name != "mobilenet_v2" or any(op.depthwise for op in g.ops)
    n = spatial_ops(g)
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s).astype(np.float32) for k, s in g.weights().items()}
    per = tuple((0.5, 0.0, 0.5) if k % 4 == 1 else (0.2, 0.5, 0.3) for k in range(n))
    dims = tuple("channels" if k % 3 == 2 else "rows" for k in range(n))
    split = Split((0.2, 0.5, 0.3), tuple((k, k + 1) for k in range(n)), "cols", per, dims)
    total = 0
    for r in range(3):
        w = Weights(g, tensors_reader(tensors), head_rows(g, split, r, 3), conv_rows(g, split, r, 3))
        assert w.nbytes == weight_bytes_of(g, split, r, 3)
        total += w.nbytes
    assert total < 3 * g.weight_bytes()
    # the same with every other group streamed: resident, plus the largest streamed conv twice
    streamed = tuple(k % 2 == 0 for k in range(n))
    split = dataclasses.replace(split, streamed=streamed)
    names = streamed_convs(g, split)
    assert names and all(g.op(x).kind == "conv" for x in names)
    for r in range(3):
        w = Weights(g, tensors_reader(tensors), head_rows(g, split, r, 3),
                    conv_rows(g, split, r, 3), names)
        for name in names:  # as the executor runs them
            w.fetch(name)
            w.drop(name)
        assert not names & set(w.conv)
        assert w.nbytes + 2 * w.streamed_bytes == weight_bytes_of(g, split, r, 3)


def test_layers_may_split_differently(cfg):
    """Per-layer genes: "name@i" entries, each layer's weights counted as it splits."""
    from hepti.plan.costmodel import held_bytes
    g = family_graph(cfg, 1, 16)
    blocks = blocks_of(g)
    genes = (ROWS, ROWS) + (UNIT, UNIT) * (g.n_layers - 1)  # layer 0 by token rows, the rest not
    assign = block_assignment(g, blocks, genes)
    assert lower.per_layer(assign) and assign["qkv"] == "rows" and assign["qkv@1"] == "cols"
    assert lower.check_assignment(g, assign) == assign
    assert lower.sliced_units(g, assign, 0) == set() and lower.sliced_units(g, assign, 1) == {"heads", "ffn"}
    prog = assignment_program(g, assign)
    layer = sum(w.whole_bytes() for op in g.layer for w in (g.weights[n] for n in op.weights))
    H, F = g.units["heads"], g.units["ffn"]
    # half the heads and FFN columns: layer 0 whole, the other layers' slices half
    mem = held_bytes([t for t in prog.memory if t.what == "weights" and t.dim != "root"],
                     {"heads": H / 2, "ffn": F / 2, "rows": 8}, False, g.n_layers)["weights"]
    sliced = sum(w.whole_bytes() for op in g.layer for w in (g.weights[n] for n in op.weights)
                 if w.split is not None)
    assert mem == pytest.approx(layer + (g.n_layers - 1) * (layer - sliced / 2))
    with pytest.raises(ValueError, match="layer"):
        lower.check_assignment(g, {**assign, f"qkv@{g.n_layers}": "rows"})
