"""The CNN planner (hepti.plan.coedge) on declared costs: the LP's shares follow speed and
links, a useless device gets none, fusion pays where exchanges are dear, the energy objective
keeps its deadline, memory caps hold; and the plan file round-trips through `hepti plan`."""
from __future__ import annotations

import json

import pytest

from helpers import TINY_CNNS
from test_cli import assert_clean_error, hepti

H = W = 64


def _graph(name="resnet50_tiny"):
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    return build(CNNConfig(**TINY_CNNS[name]))


def _costs(graph, speeds, latency=0.0, bandwidth=1e12, memory=1e10, power=None):
    """Declared costs: device i runs every op in (its FLOPs / 1e9) / speeds[i] seconds."""
    from hepti.plan.coedge import CNNCosts
    shapes = graph.shapes(H, W)
    per_row = graph.flops_per_row(H, W)
    base = []
    for op in graph.ops:
        rows = shapes[op.input][0] if op.kind == "adaptive_avg" else (
            shapes[op.output][0] if len(shapes[op.output]) == 3 else 1)
        base.append(per_row[op.name] * rows / 1e9 + 1e-6)
    P = len(speeds)
    lat = latency if isinstance(latency, list) else [latency] * P
    bw = bandwidth if isinstance(bandwidth, list) else [bandwidth] * P
    mem = memory if isinstance(memory, list) else [memory] * P
    return CNNCosts(op_s=[[t / s for t in base] for s in speeds], overhead_s=[0.0] * P,
                    latency_s=lat, bandwidth_Bps=bw, memory_bytes=mem, h=H, w=W, power=power)


def test_free_links_share_by_speed():
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    out = plan_cnn(g, _costs(g, [3.0, 1.0]), H, W, fuse=False)
    r = out["split"].ratios
    assert r[0] == pytest.approx(0.75, abs=0.05) and r[1] == pytest.approx(0.25, abs=0.05)
    even = plan_cnn(g, _costs(g, [3.0, 1.0]), H, W, strategy="even")
    assert out["predicted"]["latency_s"] < even["predicted"]["latency_s"]


def test_useless_or_cut_off_device_gets_nothing():
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    slow = plan_cnn(g, _costs(g, [1.0, 1.0, 0.001]), H, W)
    assert slow["split"].ratios[2] == 0.0 and min(slow["split"].ratios[:2]) > 0.3
    cut = plan_cnn(g, _costs(g, [1.0, 1.0], latency=[0.0, 0.5]), H, W)
    assert cut["split"].ratios == (1.0, 0.0)


def test_fusion_pays_when_exchanges_are_dear():
    from hepti.graph.split import Split, spatial_ops
    from hepti.plan.coedge import choose_groups, predict
    g = _graph()
    costs = _costs(g, [1.0, 1.0], latency=2e-4)
    ratios = (0.5, 0.5)
    groups = choose_groups(g, ratios, costs, H, W)
    assert len(groups) < spatial_ops(g)
    fused = predict(g, Split(ratios, groups), costs, H, W)["latency_s"]
    assert fused < predict(g, Split(ratios), costs, H, W)["latency_s"]
    cheap = choose_groups(g, ratios, _costs(g, [1.0, 1.0], latency=1e-6), H, W)
    assert len(cheap) > len(groups)  # cheaper exchanges: more of them


def test_an_exchanges_own_work_is_paid_once_per_group_and_moves_fusion():
    """The profile's exchange_overhead_s: each rank with a halo to send or take pays it once
    per group (not per message, not when it has no exchange), and dearer exchanges fuse more."""
    import dataclasses

    from hepti.graph.split import Split, needs
    from hepti.plan.coedge import choose_groups, exchange_seconds, predict
    g = _graph()
    free = _costs(g, [1.0, 1.0], latency=1e-6)
    work = dataclasses.replace(free, exchange_s=[1e-4, 3e-4], _rows={})
    ratios = (0.5, 0.5)
    split = Split(ratios)  # one group per op
    a, b = predict(g, split, free, H, W), predict(g, split, work, H, W)
    shapes = g.shapes(H, W)
    with_halo = [0, 0]
    for grp in split.group_ranges(g):
        need = [needs(g, shapes, grp, ratios, r) for r in range(2)]
        _, sent, got = exchange_seconds(g, shapes, grp, ratios, need, free, 1)
        for i in range(2):
            with_halo[i] += bool(sent[i] or got[i])
    assert 0 < with_halo[0] < len(split.group_ranges(g))  # a 1x1 conv has no halo
    for i, extra in enumerate((1e-4, 3e-4)):
        assert b["per_rank"][i]["exchange_s"] - a["per_rank"][i]["exchange_s"] == \
            pytest.approx(extra * with_halo[i])
    one = predict(g, Split((1.0, 0.0)), work, H, W)
    assert one["per_rank"][1]["exchange_s"] == 0.0  # no share, no exchange, no work
    assert len(choose_groups(g, ratios, work, H, W)) < len(choose_groups(g, ratios, free, H, W))


def test_an_ops_fixed_part_is_paid_whole_by_any_band_and_keeps_a_sliver_off_a_slow_device():
    """The profile's op_fixed_s: a rank with rows of an op pays it whole, the rest by its rows
    (a whole map still costs op_s); with it a slow device is no longer worth a few rows."""
    import dataclasses

    from hepti.graph.split import Split, spatial_ops
    from hepti.plan.coedge import plan_cnn, predict
    g = _graph()
    costs = _costs(g, [1.0, 0.25])
    fixed = dataclasses.replace(costs, fixed_s=[[0.4 * t for t in r] for r in costs.op_s],
                                _rows={})
    one = Split((1.0, 0.0))
    assert predict(g, one, fixed, H, W)["latency_s"] == pytest.approx(
        predict(g, one, costs, H, W)["latency_s"])
    split = Split((0.8, 0.2))
    a, b = predict(g, split, costs, H, W), predict(g, split, fixed, H, W)
    L = spatial_ops(g)
    for i, share in enumerate((0.8, 0.2)):  # a thin band pays more, never less
        assert b["per_rank"][i]["compute_s"] > a["per_rank"][i]["compute_s"]
    # rank 1's extra: its fixed parts less their share by rows (about 0.4 x (1 - 0.2) of them)
    extra = b["per_rank"][1]["compute_s"] - a["per_rank"][1]["compute_s"]
    assert extra == pytest.approx(0.4 * 0.8 * sum(costs.op_s[1][:L]), rel=0.25)
    assert plan_cnn(g, fixed, H, W)["split"].ratios[1] < plan_cnn(g, costs, H, W)["split"].ratios[1]


def test_a_split_by_channels_pays_for_laying_its_map_out():
    """The profile's layout_s_per_byte: every member of a split by channels lays each op's
    gathered map out whole, a rank without a share of it too."""
    import dataclasses

    from hepti.graph.split import Split, spatial_ops
    from hepti.plan.coedge import predict
    g = _graph()
    costs = _costs(g, [1.0, 1.0, 1.0])
    layout = dataclasses.replace(costs, layout_s=[1e-9, 2e-9, 3e-9], _rows={})
    L = spatial_ops(g)
    k = L - 1  # the last conv by channels on ranks 0 and 1; rank 2 holds the head's columns
    split = Split((0.5, 0.3, 0.2), ((0, k), (k, L)), per_group=((0.5, 0.3, 0.2), (0.6, 0.4, 0.0)),
                  dims=("rows", "channels"))
    a, b = predict(g, split, costs, H, W), predict(g, split, layout, H, W)
    hh, ww, c = g.shapes(H, W)[g.ops[k].output]
    for i, rate in enumerate((1e-9, 2e-9, 3e-9)):
        extra = b["per_rank"][i]["compute_s"] - a["per_rank"][i]["compute_s"]
        assert extra >= 4 * hh * ww * c * rate * 0.999
    assert b["latency_s"] > a["latency_s"]


def test_a_streamed_group_pays_each_fetch():
    """The profile's fetch_overhead_s: a rank streaming a group's convs pays it once per conv
    it reads rows of, on top of the bytes at its load rate."""
    import dataclasses

    from hepti.graph.cnn import CONV
    from hepti.graph.split import Split, conv_rows, spatial_ops
    from hepti.plan.coedge import stream_seconds
    g = _graph()
    costs = dataclasses.replace(_costs(g, [1.0, 1.0]), load_Bps=[1e8, 1e8])
    fetching = dataclasses.replace(costs, fetch_s=[1e-3, 2e-3])
    L = spatial_ops(g)
    split = Split((0.6, 0.4), ((0, L),), streamed=(True,))
    rows = [conv_rows(g, split, i, 2) for i in range(2)]
    convs = sum(1 for op in g.ops[:L] if op.kind == CONV)
    a, b = stream_seconds(g, (0, L), rows, costs), stream_seconds(g, (0, L), rows, fetching)
    assert [y - x for x, y in zip(a, b)] == pytest.approx([convs * 1e-3, convs * 2e-3])
    alone = Split((1.0, 0.0), ((0, L),), streamed=(True,))
    rows = [conv_rows(g, alone, i, 2) for i in range(2)]
    assert stream_seconds(g, (0, L), rows, fetching)[1] == 0.0  # no rows, nothing fetched


def test_a_streamed_conv_costs_what_the_forward_timed_it_at_and_a_slice_scales_by_the_line():
    """The profile's op_stream_measured: a rank streaming a conv's whole weight pays the
    seconds the executor's forward took for it; a rank with a slice of its channels pays that
    time scaled by (fixed + slice bytes / rate) / (fixed + whole bytes / rate); a conv the
    profile did not time is priced by the line alone."""
    import dataclasses

    from hepti.graph.cnn import CONV
    from hepti.graph.split import Split, conv_rows, spatial_ops
    from hepti.plan.coedge import stream_seconds
    g = _graph()
    L = spatial_ops(g)
    convs = [l for l, op in enumerate(g.ops[:L]) if op.kind == CONV]
    timed = [[None] * len(g.ops) for _ in range(2)]
    for l in convs[1:]:  # the first conv untimed
        timed[0][l], timed[1][l] = 5e-3, 7e-3
    costs = dataclasses.replace(_costs(g, [1.0, 1.0]), load_Bps=[1e6, 1e6],
                                fetch_s=[1e-3, 1e-3], stream_s=timed)
    row = g.row_bytes()
    line = lambda l, k: 1e-3 + k * row[g.ops[l].name] / 1e6  # noqa: E731
    whole = Split((0.6, 0.4), ((0, L),), streamed=(True,))
    rows = [conv_rows(g, whole, i, 2) for i in range(2)]
    first = line(convs[0], g.ops[convs[0]].cout)
    assert stream_seconds(g, (0, L), rows, costs) == pytest.approx(
        [first + 5e-3 * (len(convs) - 1), first + 7e-3 * (len(convs) - 1)])
    l = convs[-1]
    op = g.ops[l]
    sliced = Split((0.5, 0.5), ((0, l), (l, L)), dims=("rows", "channels"),
                   streamed=(False, True))
    rows = [conv_rows(g, sliced, i, 2) for i in range(2)]
    k = [rows[i][op.name][1] - rows[i][op.name][0] for i in range(2)]
    assert 0 < k[0] < op.cout
    assert stream_seconds(g, (l, l + 1), rows, costs) == pytest.approx(
        [t * line(l, k[i]) / line(l, op.cout) for i, t in enumerate((5e-3, 7e-3))])


def test_energy_objective_keeps_the_deadline():
    from hepti.errors import PlanError
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    # device 1 is as fast and burns a tenth of the power: energy puts the work there
    costs = _costs(g, [1.0, 1.0], power=[(10.0, 1.0), (1.0, 1.0)])
    fast = plan_cnn(g, costs, H, W)["predicted"]["latency_s"]
    e = plan_cnn(g, costs, H, W, objective="energy", deadline_s=10 * fast)
    assert e["split"].ratios[1] > 0.9 and e["predicted"]["latency_s"] <= 10 * fast
    assert "not metered" in e["explanation"]
    tight = plan_cnn(g, costs, H, W, objective="energy", deadline_s=1.2 * fast)
    assert tight["predicted"]["latency_s"] <= 1.2 * fast
    assert tight["predicted"]["energy_j"] > e["predicted"]["energy_j"]
    with pytest.raises(PlanError, match="deadline"):
        plan_cnn(g, costs, H, W, objective="energy", deadline_s=fast / 10)
    with pytest.raises(PlanError, match="power"):
        plan_cnn(g, _costs(g, [1.0, 1.0]), H, W, objective="energy", deadline_s=1.0)


def test_memory_cap_moves_rows():
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    w = g.weight_bytes()
    roomy = plan_cnn(g, _costs(g, [1.0, 1.0]), H, W, fuse=False)["split"].ratios
    tight = plan_cnn(g, _costs(g, [1.0, 1.0], memory=[1e10, w + 20_000]), H, W,
                     fuse=False)["split"].ratios
    assert tight[1] < roomy[1]


def test_hepti_plan_cli_for_a_cnn(tmp_path, resnet_tiny_dir):
    """A declared profile with CNN timings -> `hepti plan` -> a bands plan file."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    g = build(CNNConfig(**TINY_CNNS["resnet50_tiny"]))
    costs = _costs(g, [2.0, 1.0])
    prof = {"hepti_profile": 1, "created": 0.0, "source": "declared",
            "devices": [{"rank": i, "gemm_flops": 1e9, "memory_bytes": 1e9, "latency_s": 1e-4,
                         "bandwidth_Bps": 1e8} for i in range(2)],
            "cnn": {"arch": "resnet50", "ops": [op.name for op in g.ops], "input": [H, W],
                    "batch": 1, "op_s": costs.op_s}}
    (tmp_path / "p.json").write_text(json.dumps(prof))
    code, out, err = hepti("plan", "--model", resnet_tiny_dir, "--profile", tmp_path / "p.json",
                           "--json", "--power", "5:1,2:1", "--objective", "energy",
                           "--deadline-ms", "1000")
    assert code == 0, err
    plan = json.loads(out)
    assert plan["strategy"] == "bands" and len(plan["ratios"]["rows"]) == 2
    assert plan["predicted"]["energy_note"].endswith("nothing was metered")
    code, out, err = hepti("plan", "--model", resnet_tiny_dir, "--profile", tmp_path / "p.json")
    assert code == 0 and "predicted latency" in out, err
    code, _, err = hepti("plan", "--model", resnet_tiny_dir, "--profile", tmp_path / "p.json",
                         "--objective", "energy", "--power", "5:1,2:1")
    assert_clean_error(code, err, "--deadline-ms")


def test_costs_scale_to_another_input_size():
    """Times measured at 64x64 predict a 128x128 input at about 4x the compute (twice the rows,
    each twice as wide) and a batch of 2 at 2x."""
    from hepti.graph.split import Split
    from hepti.plan.coedge import predict
    g = _graph()
    costs = _costs(g, [1.0])
    one = predict(g, Split((1.0,)), costs, H, W)["per_rank"][0]["compute_s"]
    big = predict(g, Split((1.0,)), costs, 2 * H, 2 * W)["per_rank"][0]["compute_s"]
    two = predict(g, Split((1.0,)), costs, H, W, n=2)["per_rank"][0]["compute_s"]
    assert big == pytest.approx(4 * one, rel=0.15) and two == pytest.approx(2 * one, rel=0.05)


def test_a_fixed_fusing_depth_is_still_a_split_where_one_device_would_win():
    """`--fuse-depth K` is what the planner's own fusion is measured against: the best split
    over two or more devices in groups of K ops, even where the link is so slow that `auto`
    keeps to one device."""
    from hepti.graph.split import spatial_ops
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    costs = _costs(g, [1.0, 1.0], latency=[0.0, 0.5])
    assert plan_cnn(g, costs, H, W)["split"].ratios == (1.0, 0.0)
    fixed = plan_cnn(g, costs, H, W, fuse=False, fuse_depth=2)["split"]
    assert min(fixed.ratios) > 0
    L = spatial_ops(g)
    assert fixed.groups == tuple((a, min(a + 2, L)) for a in range(0, L, 2))


def test_band_timings_set_each_ops_cost_and_fold_the_overheads_in():
    """The profile's op_band_s (profiler revision 9): op l on a band of k rows costs a + b x k
    on that device, so a rank's compute is exactly that sum, its whole map a + b x rows, and
    the per-op overhead and the exchange's own work (timed inside a and b) count zero."""
    from hepti.graph.split import Split, needs, spatial_ops
    from types import SimpleNamespace

    from hepti.plan.coedge import CNNCosts, predict
    g = _graph()
    L, shapes = spatial_ops(g), g.shapes(H, W)
    band = [[(1e-4 * (i + 1), 2e-5 * (i + 1)) if l < L else None for l in range(len(g.ops))]
            for i in range(2)]
    table = {"arch": "resnet", "ops": [op.name for op in g.ops], "input": [H, W], "batch": 1,
             "op_s": [[1e-3] * len(g.ops)] * 2, "op_fixed_s": [[1e-5] * len(g.ops)] * 2,
             "op_overhead_s": [3e-4, 3e-4], "exchange_overhead_s": [5e-4, 5e-4],
             "op_band_s": band}
    dev = SimpleNamespace(power=None, call_overhead_s=0.0, latency_s=0.0, bandwidth_Bps=1e12,
                          usable_bytes=1e10, weight_load_Bps=1e8, disk_read_Bps=None)
    costs = CNNCosts.from_profile(SimpleNamespace(extra={"cnn": table}, devices=[dev, dev]), g)
    assert costs.band_measured and costs.overhead_s == [0.0, 0.0]
    assert costs.exchange_s == [0.0, 0.0]
    for l, op in enumerate(g.ops[:L]):
        assert costs.fixed(1, l) == pytest.approx(2e-4)
        assert costs.op_s[1][l] == pytest.approx(2e-4 + 4e-5 * shapes[op.output][0])
    ratios = (0.6, 0.4)
    want = [0.0, 0.0]
    for l in range(L):
        for i in range(2):
            r = needs(g, shapes, (l, l + 1), ratios, i)[g.ops[l].output]
            if r[1] > r[0]:
                want[i] += band[i][l][0] + band[i][l][1] * (r[1] - r[0])
    got = predict(g, Split(ratios), costs, H, W)["per_rank"]
    for i in range(2):  # the spatial ops exactly; the pool and head (op_s) on top
        assert got[i]["compute_s"] >= want[i] - 1e-12
        assert got[i]["compute_s"] - want[i] < 3e-3


def test_the_pooling_and_head_allgathers_cost_what_the_profile_measured_for_their_ranks():
    """The profile's allgather_s: an allgather among k ranks costs its fixed seconds plus its
    bytes at its rate, by k (a link's latency and bytes when the profile has none)."""
    import dataclasses

    from hepti.graph.split import Split
    from hepti.plan.coedge import predict
    g = _graph()
    costs = _costs(g, [1.0, 1.0, 1.0], latency=1e-5, bandwidth=1e9)
    measured = dataclasses.replace(costs, allgather_s={2: (1e-4, 0.0), 3: (5e-4, 0.0)},
                                   _rows={})
    three, two = Split((0.4, 0.3, 0.3)), Split((0.5, 0.5, 0.0))
    for split, k in ((three, 3), (two, 2)):
        a, b = predict(g, split, costs, H, W), predict(g, split, measured, H, W)
        # two allgathers after the spatial part: the pooled partial sums and the columns
        assert b["latency_s"] - a["latency_s"] == pytest.approx(
            2 * measured.allgather_s[k][0] - 2 * 1e-5, rel=0.2, abs=2e-5)
    assert costs.allgather(0, 4, 1e6) == pytest.approx(1e-5 + 1e-3)


def test_an_allgather_past_the_burst_costs_the_long_messages_line():
    """Revision-12 profiles hold two lines per k (short messages, long ones): an allgather costs
    the larger, so a link's burst prices small maps and its rate large ones; a revision-11 pair
    is the short line alone."""
    import dataclasses
    g = _graph()
    costs = _costs(g, [1.0, 1.0], latency=1e-5, bandwidth=1e9)
    two = dataclasses.replace(costs, allgather_s={2: (1e-4, 1 / 180e6, -2e-4, 1 / 119e6)})
    one = dataclasses.replace(costs, allgather_s={2: (1e-4, 1 / 180e6)})
    assert two.allgather(0, 2, 1e3) == pytest.approx(1e-4 + 1e3 / 180e6)  # within the burst
    assert two.allgather(0, 2, 1e6) == pytest.approx(-2e-4 + 1e6 / 119e6)  # past it
    assert one.allgather(0, 2, 1e6) == pytest.approx(1e-4 + 1e6 / 180e6)


def test_the_latest_of_normal_times_by_clarks_moments():
    """expected_max: k ranks in step give E[max of k normals] x sigma; a rank far behind gives
    its own time; unequal ones agree with sampling (Clark's mean is exact for two)."""
    import numpy as np

    from hepti.plan.coedge import expected_max
    e_max = {2: 0.5642, 4: 1.0294}  # E[max of k independent standard normals]
    assert expected_max([(1.0, 0.04)] * 2)[0] == pytest.approx(1.0 + e_max[2] * 0.2, rel=1e-4)
    assert expected_max([(1.0, 0.04)] * 4)[0] == pytest.approx(1.0 + e_max[4] * 0.2, rel=0.01)
    assert expected_max([(1.0, 1e-4), (5.0, 4e-4)]) == pytest.approx((5.0, 4e-4))
    assert expected_max([(2.0, 0.0), (1.0, 0.0)]) == (2.0, 0.0)
    rng = np.random.default_rng(0)
    x = np.maximum(rng.normal(0.0, 1.0, 400_000), rng.normal(0.5, 2.0, 400_000))
    m, v = expected_max([(0.0, 1.0), (0.5, 4.0)])
    assert m == pytest.approx(x.mean(), abs=0.01) and v == pytest.approx(x.var(), rel=0.01)


def test_a_halo_waits_for_its_peers_and_an_allgather_for_everyone():
    """predict's latency follows the executor's waits: never more than a barrier after every
    group (the slowest rank of each, summed) and never less than the busiest rank's own work;
    split by channels everywhere, every op ends in an allgather, and it is the barrier's sum."""
    from hepti.graph.split import Split, first_holders
    from hepti.plan.coedge import channel_group_cost, group_cost, predict, tail_seconds
    g = _graph()
    costs = _costs(g, [3.0, 1.0, 2.0], latency=2e-5, bandwidth=1e8)
    n_groups = len(Split((1 / 3,) * 3).group_ranges(g))
    skew = tuple((0.6, 0.1, 0.3) if k % 2 else (0.2, 0.3, 0.5) for k in range(n_groups))
    for dims, equal in ((None, False), (("channels",) * n_groups, True)):
        split = Split((0.5, 0.2, 0.3), per_group=skew, dims=dims)
        got = predict(g, split, costs, H, W)
        shapes, holders = g.shapes(H, W), first_holders(g, H, 3)
        barrier = 0.0
        for k, grp in enumerate(split.group_ranges(g)):
            if dims:
                c, x, _, _ = channel_group_cost(g, shapes, grp, skew[k], costs, split.members(),
                                                owners=split.owners(g), holders=holders)
            else:
                c, x, _, _ = group_cost(g, shapes, grp, skew[k], costs, owners=split.owners(g),
                                        holders=holders)
            barrier += c + x
        tail = tail_seconds(g, shapes, split, costs)[0]
        own = max(r["compute_s"] + r["exchange_s"] for r in got["per_rank"])
        if equal:
            assert got["latency_s"] == pytest.approx(barrier + tail, rel=1e-9)
        else:
            assert own - 1e-12 <= got["latency_s"] < barrier + tail


def test_a_group_waits_for_its_slowest_rank_by_the_measured_spread():
    """The profile's band_spread: each group ends the expected latest of its ranks' normal
    times after its slowest mean: E[max of k normals] x sigma for k ranks in step (0 for one
    rank, more for more), about 0 for a rank far behind the rest."""
    import dataclasses

    import numpy as np

    from hepti.graph.split import Split
    from hepti.plan.coedge import group_cost, predict, straggle
    g = _graph()
    costs = _costs(g, [1.0, 1.0, 1.0, 1.0])
    spread = dataclasses.replace(costs, spread=[0.1, 0.1, 0.2, 0.1], _rows={})
    assert straggle(spread, [1.0, 0.0, 0.0, 0.0]) == 0.0
    assert straggle(spread, [1.0, 1.0, 0.0, 0.0]) == pytest.approx(0.1 / np.sqrt(np.pi))
    rng = np.random.default_rng(1)
    sampled = np.max(rng.normal(1.0, [[0.1], [0.1], [0.2], [0.1]], (4, 400_000)), axis=0).mean()
    assert 1.0 + straggle(spread, [1.0, 1.0, 1.0, 1.0]) == pytest.approx(sampled, abs=0.01)
    assert straggle(spread, [1.0, 0.5, 0.5, 0.5]) < 1e-4  # 5 sigma ahead: no one to wait for
    shapes = g.shapes(H, W)
    c0 = group_cost(g, shapes, (0, 1), (0.25,) * 4, costs)[0]
    c1 = group_cost(g, shapes, (0, 1), (0.25,) * 4, spread)
    assert c1[0] == pytest.approx(c0 + straggle(spread, c1[2])) and c1[0] > c0
    one = Split((1.0, 0.0, 0.0, 0.0))
    assert predict(g, one, spread, H, W)["latency_s"] == pytest.approx(
        predict(g, one, costs, H, W)["latency_s"])
    four = Split((0.25,) * 4)
    assert predict(g, four, spread, H, W)["latency_s"] > predict(g, four, costs, H, W)["latency_s"]


def test_a_groups_inverted_blocks_are_priced_by_the_measured_forward_in_one_group():
    """The profile's op_joined_measured (profiler revision 18): the bands in one group, where
    the executor runs each run of inverted blocks as one call, against the same bands one op
    a group. The blocks' ops of a group (every op of a block lying whole in it) are priced at
    the factor that makes the model's one-group bands that ratio of its op-by-op bands; other
    ops, and groups of one op, as before; and one device is one group (no exchange to save)."""
    import dataclasses
    from types import SimpleNamespace

    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, needs, spatial_ops
    from hepti.plan.coedge import CNNCosts, joined_ops, plan_cnn, predict
    g = build(CNNConfig(arch="mobilenet_v2", width_divisor=8, num_classes=10))
    L, shapes = spatial_ops(g), g.shapes(H, W)
    blocks = joined_ops(g, (0, L))
    assert len(blocks) == L - 2 and 0 not in blocks and L - 1 not in blocks  # stem, last 1x1
    assert joined_ops(g, (1, 2)) == frozenset()
    assert joined_ops(g, (0, 3)) == frozenset({1, 2})  # block 1: depthwise, project
    assert joined_ops(g, (0, 4)) == frozenset({1, 2})  # the next block's expand alone: not
    band = [[(1e-4, 2e-5) if l < L else None for l in range(len(g.ops))] for _ in range(2)]

    def model(ratios, groups, at=21):  # rank 0's spatial seconds op by op: ([in blocks
        inside, outside = [0.0, 0.0], 0.0  # before op `at` (a block's start), from it], outside)
        for a, b in groups:
            need = needs(g, shapes, (a, b), ratios, 0)
            for l in range(a, b):
                r = need.get(g.ops[l].output)
                if r and r[1] > r[0]:
                    t = 1e-4 + 2e-5 * (r[1] - r[0])
                    if l in joined_ops(g, (a, b)):
                        inside[l >= at] += t
                    else:
                        outside += t
        return inside, outside

    ranges, factor = [(0, 21), (21, L)], (0.6, 0.8)  # measured: each range's blocks at its
    pts = []  # factor of their op-by-op time
    for f in (0.15, 0.5, 1.0):
        row = [f, [], []]
        for (a, b), k in zip(ranges, factor):
            inside, outside = model((f, 1 - f), [(a, b)])
            row[1].append(k * sum(inside) + outside)
            alone = model((f, 1 - f), [(l, l + 1) for l in range(a, b)])
            row[2].append(sum(alone[0]) + alone[1])
        pts.append(row)
    table = {"arch": "mobilenet_v2", "ops": [op.name for op in g.ops], "input": [H, W],
             "batch": 1, "op_s": [[1e-3] * len(g.ops)] * 2, "op_band_s": band,
             "op_joined_ranges": ranges, "op_joined_measured": [pts, pts]}
    dev = SimpleNamespace(power=None, call_overhead_s=0.0, latency_s=0.0, bandwidth_Bps=1e12,
                          usable_bytes=1e10, weight_load_Bps=1e8, disk_read_Bps=None)
    costs = CNNCosts.from_profile(SimpleNamespace(extra={"cnn": table}, devices=[dev, dev]), g)
    for i in range(2):
        for l in range(len(g.ops)):
            want = factor[l >= 21] if l in blocks else 1.0
            assert costs.joined[i][l] == pytest.approx(want), (i, l)
    plain = dataclasses.replace(costs, joined=None, _rows={})
    for ratios, groups in [((0.3, 0.7), [(0, L)]), ((0.5, 0.5), [(0, 7), (7, L)]),
                           ((0.5, 0.5), [(l, l + 1) for l in range(L)])]:
        inside, outside = model(ratios, groups)
        split = Split(ratios, tuple(groups), "primary")
        was = predict(g, split, plain, H, W)["per_rank"][0]["compute_s"]
        got = predict(g, split, costs, H, W)["per_rank"][0]["compute_s"]
        assert got - was == pytest.approx(-0.4 * inside[0] - 0.2 * inside[1], abs=1e-12)
        assert sum(inside) > 0 or len(groups) == L
    single = plan_cnn(g, costs, H, W, strategy="single")["split"]
    assert single.groups == ((0, L),) and single.ratios == (1.0, 0.0)
    inside, _ = model((1.0, 0.0), [(0, L)])
    assert predict(g, single, costs, H, W)["latency_s"] == pytest.approx(
        predict(g, single, plain, H, W)["latency_s"] - 0.4 * inside[0] - 0.2 * inside[1])


def test_a_groups_inverted_blocks_take_the_factor_measured_at_their_bands_fraction():
    """What joining a range's blocks saves differs with the band (on emu-mixed4 MobileNetV2's
    blocks joined took 0.30-0.45 of their op-by-op time on bands of 15% of the rows, 0.51-0.61
    on the whole map): each fraction's factor is kept (`joined_points`), a band takes the one
    at its fraction of the rows, linear between the measured ones (`joined_at`), and a whole
    map the whole map's; `joined` stays the sum over the fractions."""
    import dataclasses
    from types import SimpleNamespace

    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.graph.split import needs, spatial_ops
    from hepti.plan.coedge import CNNCosts, joined_at, joined_ops, plan_cnn, predict
    assert joined_at((), 0.5) is None
    pts = ((0.3, 0.4), (0.5, 0.6), (1.0, 0.8))
    assert joined_at(pts, 0.1) == 0.4 and joined_at(pts, 1.0) == 0.8
    assert joined_at(pts, 0.75) == pytest.approx(0.7)
    g = build(CNNConfig(arch="mobilenet_v2", width_divisor=8, num_classes=10))
    L, shapes = spatial_ops(g), g.shapes(H, W)
    blocks = joined_ops(g, (0, L))
    band = [[(1e-4, 2e-5) if l < L else None for l in range(len(g.ops))] for _ in range(2)]

    def seconds(ratios, group):  # rank 0's seconds op by op: (in blocks, outside)
        need = needs(g, shapes, group, ratios, 0)
        inside = outside = 0.0
        for l in range(*group):
            r = need.get(g.ops[l].output)
            if r and r[1] > r[0]:
                t = 1e-4 + 2e-5 * (r[1] - r[0])
                if l in joined_ops(g, group):
                    inside += t
                else:
                    outside += t
        return inside, outside

    measured = []
    for f, k in pts:  # one range: the spatial ops; its blocks at k of their op-by-op time
        inside, outside = seconds((f, 1 - f), (0, L))
        alone = sum(sum(seconds((f, 1 - f), (l, l + 1))) for l in range(L))
        measured.append([f, [k * inside + outside], [alone]])
    table = {"arch": "mobilenet_v2", "ops": [op.name for op in g.ops], "input": [H, W],
             "batch": 1, "op_s": [[1e-3] * len(g.ops)] * 2, "op_band_s": band,
             "op_joined_ranges": [(0, L)], "op_joined_measured": [measured, measured]}
    dev = SimpleNamespace(power=None, call_overhead_s=0.0, latency_s=0.0, bandwidth_Bps=1e12,
                          usable_bytes=1e10, weight_load_Bps=1e8, disk_read_Bps=None)
    costs = CNNCosts.from_profile(SimpleNamespace(extra={"cnn": table}, devices=[dev, dev]), g)
    l = min(blocks)
    assert [k for _, k in costs.joined_pts[0][l]] == pytest.approx([0.4, 0.6, 0.8])
    assert 0.4 < costs.joined[0][l] < 0.8
    single = plan_cnn(g, costs, H, W, strategy="single")["split"]
    inside, outside = seconds((1.0, 0.0), (0, L))
    flat = dataclasses.replace(costs, joined_pts=None, _rows={})  # the sum's factor alone
    got = predict(g, single, costs, H, W)["per_rank"][0]["compute_s"]
    was = predict(g, single, flat, H, W)["per_rank"][0]["compute_s"]
    assert got - was == pytest.approx((0.8 - costs.joined[0][l]) * inside, rel=1e-9)


def test_a_links_credit_comes_off_each_exchanges_bytes_and_a_real_forwards_compute_is_added():
    """A link that passes its first bytes at once after an idle spell (the profile's
    link_credit_bytes: a shaper's bucket) takes them off each halo exchange's bytes, never
    below its latency; what a real forward's compute came to beyond the bands' (the profile's
    exchange_resume_s) is charged to every exchange a rank takes part in."""
    import dataclasses

    from hepti.graph.split import Split
    from hepti.plan.coedge import CNNCosts, exchange_seconds, predict
    from hepti.graph.split import needs
    g = _graph()
    shapes = g.shapes(H, W)
    costs = _costs(g, [1.0, 1.0], latency=1e-4, bandwidth=1e6)
    split = Split((0.5, 0.5))
    l = next(i for i, op in enumerate(g.ops) if getattr(op, "padding", 0) > 0 and i > 0)
    group = (l, l + 1)  # a padded conv past the stem: one halo each way
    need = [needs(g, shapes, group, split.ratios, r) for r in range(2)]
    plain, sent, got = exchange_seconds(g, shapes, group, split.ratios, need, costs, 1)
    nbytes = max(sent[0], got[0])
    assert nbytes > 0
    credited = dataclasses.replace(costs, credit_bytes=[nbytes / 2, 2 * nbytes], _rows={})
    secs, _, _ = exchange_seconds(g, shapes, group, split.ratios, need, credited, 1)
    assert secs[0] == pytest.approx(plain[0] - nbytes / 2 / costs.bandwidth_Bps[0])
    assert secs[1] == pytest.approx(costs.latency_s[1])  # all of it at once: the latency
    resumed = dataclasses.replace(costs, exchange_s=[1e-3, 2e-3], _rows={})
    secs, _, _ = exchange_seconds(g, shapes, group, split.ratios, need, resumed, 1)
    assert secs == pytest.approx([plain[0] + 1e-3, plain[1] + 2e-3])
    assert (predict(g, split, resumed, H, W)["latency_s"]
            > predict(g, split, costs, H, W)["latency_s"])


def test_a_cnn_plans_per_rank_prediction_has_the_plan_files_comm_s():
    """Every plan predicts each rank's communication as `comm_s` {kind: seconds} (the plan
    file's schema), which `hepti bench fit` and `bench hetero` sum: a CNN band plan's is its
    halo exchanges and allgathers, the seconds its report shows as `exchange_s`."""
    from hepti.plan.coedge import plan_cnn
    g = _graph()
    pred = plan_cnn(g, _costs(g, [1.0, 1.0], latency=1e-4, bandwidth=1e8), H, W)["predicted"]
    comm = [sum(pr["comm_s"].values()) for pr in pred["per_rank"]]
    assert all(c > 0 for c in comm)
    assert comm == [pr["exchange_s"] for pr in pred["per_rank"]]
