"""The profiler's pure parts: the link fit and the cache path (the MPI part is tests/mpi)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from hepti.parallel.profile_cnn import pooled_overhead
from hepti.parallel.profile_compute import gemm_sizes
from hepti.parallel.profile_links import fit_link, link_credit
from hepti.parallel.profiling import profile_cache_path
from hepti.families import preset_config


def test_link_fit_recovers_latency_and_bandwidth():
    alpha, beta = 1.5e-4, 1.2e8
    points = [(n, alpha + n / beta) for n in (8, 4096, 65536, 1 << 20)]
    lat, bw = fit_link(points)
    assert lat == pytest.approx(alpha, rel=1e-6) and bw == pytest.approx(beta, rel=1e-6)
    # noisy loopback figures: never a negative latency, bandwidth from the large messages
    lat, bw = fit_link([(8, 2e-6), (4096, 1.8e-6), (1 << 20, 1.7e-4), (4 << 20, 6.5e-4)])
    assert lat >= 0 and 5e9 < bw < 8e9



def test_link_credit_is_what_a_mid_sized_message_came_in_ahead_of_the_line():
    """A shaped link passes its first bytes at once after an idle spell: `link_credit` is
    the most any message below the two that fit the bandwidth came in ahead of latency +
    bytes / bandwidth (at most its own size); 0 on a link that keeps to the line."""
    lat, bw, credit = 5e-5, 12.5e6, 18000.0
    t = lambda b: lat + max(0.0, b - credit) / bw  # noqa: E731
    points = [(b, t(b)) for b in (8, 4096, 65536, 262144, 1 << 20)]
    assert link_credit(points, lat, bw) == pytest.approx(credit)
    line = [(b, lat + b / bw) for b in (8, 4096, 65536, 262144, 1 << 20)]
    assert link_credit(line, lat, bw) == pytest.approx(0.0, abs=1e-6)
    # a small message all at once gives its own size, no more
    assert link_credit([(8, lat), (4096, lat), (1 << 20, 1.0), (4 << 20, 2.0)], lat, bw) == 4096

def test_cache_path_depends_on_hostfile_contents_model_and_world(tmp_path, monkeypatch):
    monkeypatch.setenv("HEPTI_CACHE", str(tmp_path))
    hosts = tmp_path / "hosts"
    hosts.write_text("pi-a:1\npi-b:1\n")
    p = profile_cache_path(str(hosts), "all-MiniLM-L6-v2", 2)
    assert p.parent == tmp_path and p.name.startswith("profile-all-MiniLM-L6-v2-n2-")
    assert profile_cache_path(str(hosts), "all-MiniLM-L6-v2", 2) == p
    assert profile_cache_path(str(hosts), "bert-base", 2) != p
    assert profile_cache_path(str(hosts), "all-MiniLM-L6-v2", 3) != p
    hosts.write_text("pi-a:1\npi-c:1\n")
    assert profile_cache_path(str(hosts), "all-MiniLM-L6-v2", 2) != p
    assert profile_cache_path(None, "m", 1).parent == tmp_path


def test_gemm_sizes_reach_all_rows_and_half_of_them():
    cfg = preset_config("bert-base")
    assert gemm_sizes(cfg, 256) == [8, 32, 128, 256]
    assert gemm_sizes(cfg, 200) == [8, 32, 100, 128, 200]
    assert gemm_sizes(cfg, 16) == [8, 16]


def test_layer_measurement_gives_gemm_and_attention_tables_by_call_size():
    """Both tables come from one layer's work; attention is keyed by the FLOPs of the call
    (4 m T C for m query rows), which the cost model's attention Works look up."""
    from hepti.config import BertConfig
    from hepti.parallel.profile_compute import measure_layer
    from hepti.plan.profile import SpeedTable
    from hepti.plan.workloads import rows_program
    cfg = BertConfig.from_dict({"model_type": "bert", "vocab_size": 10, "hidden_size": 64,
                                "num_hidden_layers": 1, "num_attention_heads": 4,
                                "intermediate_size": 128})
    T = 32
    gemm, attention = measure_layer(cfg, batch=1, seq_len=T)
    assert [s for s, _ in gemm] == [8.0, 16.0, 32.0]  # min(m, C) for m = 8, 16, 32
    assert [s for s, _ in attention] == [4.0 * m * T * 64 for m in (8, 16, 32)]
    assert all(v > 0 and v < 1e13 for _, v in gemm + attention)
    work = next(w for p in rows_program(cfg, 1, T).layer for w in p.works if w.kind == "attention")
    assert work.size(16) == attention[1][0]  # a 16-row `rows` share reads the 16-row entry
    assert SpeedTable(attention).at(work.size(16)) == attention[1][1]


def test_weight_load_probe_gives_a_finite_speed_and_leaves_no_files(tmp_path):
    """The probe writes a one-layer model, makes slices beside a GeMM and cleans up."""
    from hepti.parallel.profile_compute import measure_weight_load
    cfg = preset_config("tiny-odd")
    bps = measure_weight_load(cfg, directory=str(tmp_path), rounds=1)
    assert 0 < bps < float("inf")
    assert list(tmp_path.iterdir()) == []


def test_pooled_overhead_scales_the_least_ratio_by_each_devices_op_time():
    # devices 2, 3 and 4 times slower than the first; two readings inflated by load
    op_s = [[0.1, 0.1], [0.2, 0.2], [0.3, 0.3], [0.4, 0.4]]
    measured = [0.01, 0.03, 0.03, 0.08]
    assert pooled_overhead(op_s, measured) == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert pooled_overhead(op_s[:1], measured[:1]) == [0.01]  # one device: as measured
    # a device that read no overhead at all (max(0, ...) of a noisy difference) is not taken
    assert pooled_overhead(op_s, [0.0, 0.02, 0.03, 0.04]) == pytest.approx([0.01, 0.02, 0.03, 0.04])


def test_stream_fit_recovers_a_fetchs_fixed_cost_and_rate_from_per_conv_times():
    """`stream_fit`: each conv's streamed seconds = fixed + its stored bytes / rate, fitted over
    the convs alone; through the origin when the fit's fixed part comes out negative, and a
    harmless figure when nothing was streamed."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import CONV, build
    from hepti.parallel.profile_cnn import stream_fit
    from helpers import TINY_CNNS
    g = build(CNNConfig(**TINY_CNNS["resnet50_tiny"]))
    row = g.row_bytes()
    size = [row[op.name] * op.cout if op.kind == CONV else None for op in g.ops]
    exact = [None if b is None else 2e-3 + b / 4e8 for b in size]
    fixed, rate = stream_fit(exact, g)
    assert fixed == pytest.approx(2e-3) and rate == pytest.approx(4e8)
    slow = [None if b is None else 2e-3 + b / 1e6 for b in size]  # bytes the larger part
    noisy = [None if t is None else t * (1.05 if i % 2 else 0.95) for i, t in enumerate(slow)]
    fixed, rate = stream_fit(noisy, g)
    assert fixed == pytest.approx(2e-3, rel=0.5) and rate == pytest.approx(1e6, rel=0.1)
    by_bytes = [None if b is None else b / 1e6 - 1e-4 for b in size]  # a negative intercept
    fixed, rate = stream_fit(by_bytes, g)
    assert fixed == 0.0 and 0 < rate < 1e12
    assert stream_fit([None] * len(g.ops), g) == (0.0, 1e12)


def test_band_timings_pool_the_fixed_share_across_devices():
    """`pooled_band`: each device keeps its own time at the largest band; the part of it that
    is fixed is the devices' median share (one device's noisy pair of points moves only its
    own level), and an op timed nowhere stays None."""
    from hepti.parallel.profile_cnn import pooled_band
    pts = [[[(1, 2.0), (5, 6.0)], None],  # a = 1, b = 1: fixed share 1/6
           [[(1, 4.0), (5, 12.0)], None],  # a = 2, b = 2: 1/6
           [[(1, 9.0), (5, 10.0)], None]]  # a noisy pair: a = 8.75, 0.875 of it
    out = pooled_band(pts)
    assert out[0][1] is None
    for i, top in enumerate((6.0, 12.0, 10.0)):
        a, b = out[i][0]
        assert a == pytest.approx(top / 6) and a + 5 * b == pytest.approx(top)


def test_band_rounds_rotate_and_run_at_least_rounds_and_at_most_the_cap(monkeypatch):
    """`_band_rotation`: each round starts one item further along; with no time asked for,
    exactly `rounds` rounds; asked for more time than the cap allows, `BAND_MAX_ROUNDS`."""
    from hepti.parallel import profile_cnn
    assert list(profile_cnn._band_rotation(["a", "b"], 3, 0.0)) == ["a", "b", "b", "a", "a", "b"]
    monkeypatch.setattr(profile_cnn, "BAND_MAX_ROUNDS", 5)
    assert len(list(profile_cnn._band_rotation(["a", "b", "c"], 2, 3600.0))) == 15


def test_the_compute_measurements_need_no_communication():
    """A rank's compute is measured alone (profile_compute, profile_cnn): importing them starts
    no MPI and loads not even the verbs module. The links' module does the talking: it loads
    the verbs (and this check would see it, were it wrong)."""
    code = ("import sys, hepti.parallel.profile_compute, hepti.parallel.profile_cnn; "
            "mods = ('mpi4py', 'mpi4py.MPI', 'hepti.parallel.comm'); "
            "print(sorted(m for m in mods if m in sys.modules)); "
            "import hepti.parallel.profile_links; print('hepti.parallel.comm' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split("\n")[:2] == ["[]", "True"], out.stdout + out.stderr


def test_decode_segments_are_a_layers_share_of_gemvs_in_copies_past_the_caches():
    """The allreduce's calibration times it after a decode layer's GeMVs (profile_links
    `decode_segments`): the attention's and the MLP's columns at the rank's share, whole
    groups, int8, in copies that together exceed the cache bytes (at most the cap)."""
    import numpy as np

    from hepti.kernels.int8 import GROUP
    from hepti.model.llama import LlamaConfig
    from hepti.parallel.profile_links import decode_segments
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=512, head_dim=32)
    rng = np.random.default_rng(0)
    segs = decode_segments(cfg, 0.5, rng, cold_bytes=1 << 20)
    attn, mlp = segs[0]
    assert (attn.k, mlp.k) == (128, 128)
    assert attn.n == round(0.5 * (2 * 2 + 2) * 32 * 2 / GROUP) * GROUP  # q, k, v, o a KV head
    assert mlp.n == 0.5 * 3 * 512
    one = (attn.nbytes + mlp.nbytes)
    assert len(segs) * one >= (1 << 20) > (len(segs) - 1) * one * 0.9
    assert len(decode_segments(cfg, 0.01, rng, cold_bytes=1 << 30, max_copies=3)) == 3
    tiny = decode_segments(cfg, 0.01, rng, cold_bytes=0)  # a share under a group: one group
    assert tiny[0][0].n == GROUP and tiny[0][1].n == GROUP and len(tiny) == 2


def test_cadence_timing_runs_every_layers_two_syncs_after_a_warm_up_layer():
    """`cadence_allreduce_s` on a group of one: two timed allreduces a layer and their
    segments, the warm-up layer's not counted, each a non-negative time."""
    import numpy as np

    from hepti.model.llama import LlamaConfig
    from hepti.parallel.comm import Comm
    from hepti.parallel.profile_links import cadence_allreduce_s, decode_segments
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, head_dim=16)
    segs = decode_segments(cfg, 1.0, np.random.default_rng(1), cold_bytes=0)
    waits, spans = cadence_allreduce_s(Comm(None), segs, cfg.hidden_size, layers=5)
    assert len(waits) == len(spans) == 10 and all(t >= 0 for t in waits + spans)


def test_sync_figures_part_a_groups_waits_into_jitter_and_transfer():
    """`sync_figures` by hand: ranks whose calls vary together (or not at all) have no jitter,
    two whose slow calls alternate wait for the slow one every call; what a wait holds beyond
    (the largest segment - the rank's) is the transfer."""
    from hepti.parallel.profile_links import sync_figures
    assert sync_figures([[1.0, 1.0], [2.0, 2.0]], [[1.1, 1.1], [0.1, 0.1]]) == (0.0, pytest.approx(0.1))
    assert sync_figures([[1.0, 3.0], [2.0, 6.0]], [[1.2, 3.2], [0.2, 0.2]])[0] == 0.0
    # means 2 and 2: excesses (-0.5, +0.5) and (+0.5, -0.5): the larger is 0.5 every call;
    # the waits: 2 (for the other) + 0.3, then 0.3
    j, t = sync_figures([[1.0, 3.0], [3.0, 1.0]], [[2.3, 0.3], [0.3, 2.3]])
    assert j == pytest.approx(0.5) and t == pytest.approx(0.3)
    assert sync_figures([[1.0, 3.0]], [[0.2, 0.4]]) == (0.0, pytest.approx(0.3))  # a group of one


def test_a_decode_calls_cost_is_timed_on_a_ranks_layer_shape():
    """`measure_decode_step` times a decode step of a rank's shape at even shares
    (`decode_call_config`): the whole width and head size, its KV heads (at least one) with
    their query heads, its MLP columns in whole groups (at least one), and gives a positive
    cost a call and a positive cost of the token's work outside the layers."""
    from hepti.kernels.int8 import GROUP
    from hepti.model.llama import LlamaConfig
    from hepti.parallel.profile_compute import (decode_call_config, measure_decode_step,
                                                measure_gemv)
    cfg = LlamaConfig(vocab_size=64, hidden_size=128, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=512, head_dim=16)
    two = decode_call_config(cfg, ranks=2, copies=3, ctx=10)
    assert (two.hidden_size, two.head_dim, two.num_hidden_layers) == (128, 16, 3)
    assert (two.num_key_value_heads, two.num_attention_heads, two.intermediate_size) == (2, 4, 256)
    many = decode_call_config(cfg, ranks=16)
    assert (many.num_key_value_heads, many.num_attention_heads, many.intermediate_size) == (1, 2, GROUP)
    got = measure_decode_step(cfg, ctx=10, ranks=2, cold_bytes=1 << 20)
    assert 0 < got["call_overhead_s"] < 0.01 and 0 < got["token_overhead_s"] < 0.01
    # the GeMVs' bytes/s on the same shapes, cycled (float32 and int8)
    assert measure_gemv(128, config=cfg, ranks=2, nbytes=1 << 20) > 0
    assert measure_gemv(128, int8=True, config=cfg, ranks=2, nbytes=1 << 20) > 0


def test_a_devices_memory_is_what_the_re_planner_reads_shared_and_capped(monkeypatch):
    """`_device_memory`: the memory a rank has for a model is what the host or its cgroup has
    available (page cache counted as free, as the serving re-planner reads it: not less the
    process's file pages), shared by the ranks on the host, at most the cap; the process's
    resident file pages are recorded beside it (`resident_file_bytes`)."""
    from hepti.parallel import profiling as P
    mib = 1 << 20
    monkeypatch.setattr(P, "_return_freed_memory", lambda: None)
    monkeypatch.setattr(P, "available_memory", lambda: (1000 * mib, "MemAvailable"))
    assert P._device_memory(1, None) == (1000 * mib, "MemAvailable")
    assert P._device_memory(2, None)[0] == 500 * mib
    assert P._device_memory(1, 400 * mib)[0] == 400 * mib
    monkeypatch.undo()
    status = "Name:\tpython\nVmRSS:\t  300 kB\nRssAnon:\t  100 kB\nRssFile:\t  180 kB\n"
    assert P.resident_file_bytes(status) == 180 * 1024
    assert P.resident_file_bytes("Name:\tpython\n") == 0
    assert P.resident_file_bytes("RssFile: x kB\n") == 0
    assert P.resident_file_bytes() > 0  # this process runs from files too (Linux)


def test_joined_ranges_cut_mobilenets_blocks_into_four_and_resnet_has_none():
    """`joined_ranges`: the spatial ops in four ranges of about as many inverted blocks each,
    every cut where a block starts (so that each range's blocks run joined, as in a plan's
    group); None for a network without such blocks (its profile times no joined forward)."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build, inverted_runs
    from hepti.graph.split import spatial_ops
    from hepti.parallel.profile_cnn import joined_ranges
    g = build(CNNConfig(arch="mobilenet_v2", width_divisor=8, num_classes=10))
    n = spatial_ops(g)
    ranges = joined_ranges(g, n)
    starts = [j for j, _ in inverted_runs(g.ops[:n])]
    assert len(ranges) == 4 and ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a == b for (_, a), (b, _) in zip(ranges, ranges[1:]))
    assert all(a in starts for a, _ in ranges[1:])
    per = [sum(a <= j < b for j in starts) for a, b in ranges]
    assert max(per) - min(per) <= 1, per
    r50 = build(CNNConfig(arch="resnet50", width_divisor=16, num_classes=10))
    assert joined_ranges(r50, spatial_ops(r50)) is None
