"""Profiles (schema, validation, clear errors) and the cost model's arithmetic."""
from __future__ import annotations

import json
import math
import time

import pytest

from hepti.families import preset_config
from hepti.errors import PlanError
from hepti.model.sizes import embedding_bytes, layer_bytes, layer_slice_bytes
from hepti.plan import profile as prof_mod
from hepti.plan.costmodel import Collective, evaluate, link_terms
from hepti.plan.partition import make_plan
from hepti.plan.profile import SpeedTable, declared_profile, load_profile, profile_from_dict
from hepti.plan.workloads import (ALLOC_OVERHEAD, matmul_chain_program, rows_program, stream_program,
                                  tensor_program)

MINIMAL = {"hepti_profile": 1, "created": 0, "source": "declared",
           "devices": [
               {"rank": 0, "gemm_flops": 5e10, "memory_bytes": 2e9, "latency_s": 1e-4, "bandwidth_Bps": 1.2e8},
               {"rank": 1, "gemm_flops": 2e10, "memory_bytes": 1e9, "latency_s": 2e-3, "bandwidth_Bps": 1.2e7}]}


def write(tmp_path, obj, name="p.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


# --- profiles ------------------------------------------------------------------------------

def test_minimal_declared_profile_from_the_docstring_loads(tmp_path):
    assert '"gemm_flops": 5e10' in prof_mod.__doc__  # the documented example is this one
    p = load_profile(write(tmp_path, MINIMAL), world_size=2, max_age_s=60)  # declared: no age
    assert p.world_size == 2 and p.source == "declared"
    d1 = p.devices[1]
    assert d1.gemm_flops(100) == 2e10 and d1.attention_flops() == 2e10  # attention defaults to GeMM
    assert d1.elementwise_per_s == pytest.approx(2e10 * prof_mod.ELEMENTWISE_PER_GEMM_FLOP)
    assert d1.disk_read_Bps is None and d1.usable_bytes == 1e9


def test_profile_round_trips_through_json(tmp_path):
    d = json.loads(json.dumps(MINIMAL))
    d["devices"][0]["gemm_flops"] = [[16, 2e10], [256, 6e10]]
    d["devices"][1]["disk_read_Bps"] = 3e8
    p = profile_from_dict(d)
    path = tmp_path / "rt.json"
    p.save(path)
    q = load_profile(path)
    assert q.to_dict() == p.to_dict()
    assert q.devices[0].gemm_flops(64) == p.devices[0].gemm_flops(64)


def test_speed_table_interpolates_in_log_size_and_clamps():
    t = SpeedTable([(16, 1e10), (256, 5e10)])
    assert t.at(1) == 1e10 and t.at(16) == 1e10 and t.at(10_000) == 5e10
    assert t.at(64) == pytest.approx(3e10)  # 64 is halfway between 16 and 256 in log2
    assert t.peak == 5e10


@pytest.mark.parametrize("mutate, words", [
    (lambda d: d["devices"][1].pop("bandwidth_Bps"), ["rank 1", "bandwidth_Bps"]),
    (lambda d: d.pop("devices"), ["missing 'devices'"]),
    (lambda d: d["devices"][0].update(gemm_flops=0), ["rank 0", "gemm_flops", "positive"]),
    (lambda d: d["devices"][1].update(gemm_flops=[[64, 1e10], [128, -1]]), ["gemm_flops", "positive"]),
    (lambda d: d["devices"][1].update(memory_bytes=0), ["rank 1", "memory_bytes", "cannot take part"]),
    (lambda d: d["devices"][1].update(bandwidth_Bps=-5), ["bandwidth_Bps"]),
    (lambda d: d["devices"][1].update(latency_s="fast"), ["latency_s", "number"]),
    (lambda d: d["devices"][1].update(rank=3), ["ranks [0, 3]", "0..1"]),
    (lambda d: d.update(source="guessed"), ["source", "measured"]),
    (lambda d: d.update(hepti_profile=7), ["not a hepti profile"]),
    (lambda d: d["devices"][0].update(reserved_bytes=3e9), ["reserved_bytes", "leaves nothing"]),
])
def test_bad_profiles_get_clear_messages(tmp_path, mutate, words):
    d = json.loads(json.dumps(MINIMAL))
    mutate(d)
    with pytest.raises(PlanError) as e:
        load_profile(write(tmp_path, d))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_malformed_and_missing_files(tmp_path):
    with pytest.raises(PlanError, match="not valid JSON.*hepti profile"):
        load_profile(write(tmp_path, '{"hepti_profile": 1, "devices": [', "bad.json"))
    with pytest.raises(PlanError, match="no such profile"):
        load_profile(tmp_path / "absent.json")


def test_rank_count_must_match_the_world(tmp_path):
    with pytest.raises(PlanError) as e:
        load_profile(write(tmp_path, MINIMAL), world_size=3)
    msg = str(e.value)
    assert "2 devices" in msg and "3 ranks" in msg and "mpiexec -n 3 hepti profile" in msg


def test_stale_measured_profile_says_its_age_and_how_to_remeasure(tmp_path):
    d = dict(json.loads(json.dumps(MINIMAL)), source="measured", created=time.time() - 3 * 3600)
    path = write(tmp_path, d)
    with pytest.raises(PlanError) as e:
        load_profile(path, max_age_s=3600)
    msg = str(e.value)
    assert "3.0 h ago" in msg and "60 min" in msg and "hepti profile" in msg
    assert load_profile(path, max_age_s=4 * 3600).source == "measured"  # fresh enough


# --- the cost model ------------------------------------------------------------------------

def flat(n, **kw):
    base = dict(gemm_flops=1e11, memory_bytes=1e10, latency_s=1e-4, bandwidth_Bps=1e8)
    return declared_profile([dict(base, **kw) for _ in range(n)])


def test_one_rank_costs_only_its_flops():
    prog = matmul_chain_program(256, 1024, 1024, 5)
    p = flat(1, gemm_flops=2.5e10)
    pred = evaluate(prog, {"rows": [256.0]}, p)
    assert pred.latency_s == pytest.approx(5 * 2 * 256 * 1024 * 1024 / 2.5e10)
    assert pred.per_rank[0].comm_s == {"scatterv": 0.0, "gatherv": 0.0}


def test_rows_split_of_the_chain_is_compute_plus_scatter_and_gather():
    prog = matmul_chain_program(256, 1024, 1024, 5)
    p = declared_profile([dict(gemm_flops=2e10, memory_bytes=1e9, latency_s=1e-4, bandwidth_Bps=1e8),
                          dict(gemm_flops=6e10, memory_bytes=1e9, latency_s=3e-4, bandwidth_Bps=5e7)])
    pred = evaluate(prog, {"rows": [64.0, 192.0]}, p)
    flops_per_row = 5 * 2 * 1024 * 1024
    compute = max(64 * flops_per_row / 2e10, 192 * flops_per_row / 6e10)
    moved = 192 * 1024 * 4  # rank 1's rows, in and out, each over the slower of the two links
    one_way = max(1e-4 + moved / 1e8, 3e-4 + moved / 5e7)
    assert pred.latency_s == pytest.approx(compute + 2 * one_way)
    assert pred.per_rank[1].wait_s == pytest.approx(compute - 192 * flops_per_row / 6e10)


def test_allgather_direct_exchange_charges_each_rank_its_busier_direction():
    """Rank i receives S - c_i and sends its own block to each of the n-1 others: with equal
    links the smallest block receives most, the largest sends most, and the larger decides."""
    coll = Collective("allgatherv", "rows", 4.0)
    p = flat(3, bandwidth_Bps=1e6, latency_s=0.0)
    S = 4.0 * 300
    blocks = [50, 100, 150]
    times = [max(c + k * 4 * b for c, k in link_terms(coll, 3, S, p.devices[i], i == 0, p.network))
             for i, b in enumerate(blocks)]
    assert times == pytest.approx([(S - 4 * 50) / 1e6, 2 * 4 * 100 / 1e6, 2 * 4 * 150 / 1e6])


def test_reduce_scatter_direct_exchange_receives_n_minus_1_blocks():
    coll = Collective("reduce_scatter", "rows", 4.0 * 768)
    p = flat(4, latency_s=0.0, bandwidth_Bps=1e8, elementwise_per_s=1e30)
    S = 4.0 * 768 * 256
    c = S / 2  # a rank owning half the rows receives 3 half-buffers, and sends one
    t = max(a + k * c for a, k in link_terms(coll, 4, S, p.devices[1], False, p.network))
    assert t == pytest.approx(3 * c / 1e8)
    c = S / 8  # one owning an eighth sends 7 eighths and receives 3
    t = max(a + k * c for a, k in link_terms(coll, 4, S, p.devices[1], False, p.network))
    assert t == pytest.approx(7 * c / 1e8)


def test_profiles_with_mpi_algorithm_settings_still_load():
    """Profiles measured before the row verbs were direct exchanges name MPICH's Allgatherv and
    Reduce_scatter switch points; they load, and the settings are ignored."""
    d = flat(2).to_dict()
    d["network"] = {"allgather_long_bytes": 524288, "reduce_scatter_long_bytes": 524288,
                    "bcast_short_bytes": 4096}
    p = profile_from_dict(d, "old profile")
    assert p.network["bcast_short_bytes"] == 4096 and "allgather_long_bytes" not in p.network
    with pytest.raises(PlanError, match="unknown network setting 'allgather_fast'"):
        profile_from_dict({**d, "network": {"allgather_fast": 1}}, "bad profile")


def test_tensor_compute_conserves_flops_and_single_rank_matches_rows():
    cfg = preset_config("bert-base")
    B, T = 1, 128
    M, C, F, L = B * T, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    p = flat(3, gemm_flops=1e11, attention_flops=1e11, elementwise_per_s=1e30)
    gemm = 2 * M * C * (3 * C + C + 2 * F) * L
    attn = 4 * M * T * C * L
    # FFN columns in whole weight panels (32), so that no partial panel is charged as a whole
    pred = evaluate(tensor_program(cfg, B, T), {"heads": [6.0, 4.0, 2.0], "ffn": [992.0, 1024.0, 1056.0],
                                                "rows": [50.0, 50.0, 28.0]}, p)
    assert sum(r.compute_s for r in pred.per_rank) == pytest.approx((gemm + attn) / 1e11, rel=1e-6)
    one = flat(1, gemm_flops=1e11, attention_flops=1e11, elementwise_per_s=1e30)
    t1 = evaluate(tensor_program(cfg, B, T), {"heads": [12.0], "ffn": [float(F)], "rows": [128.0]}, one)
    r1 = evaluate(rows_program(cfg, B, T), {"rows": [128.0]}, one)
    assert t1.latency_s == pytest.approx(r1.latency_s) == pytest.approx((gemm + attn) / 1e11, rel=1e-6)


def test_partial_gemm_blocks_cost_whole_ones_and_the_planner_avoids_them():
    """65 rows cost what 72 do in the GeMM (8-row tiles): two equal ranks get 64 + 64 rows of
    128, not the 65 + 63 a continuous model is indifferent to; FFN columns go in panels of 32."""
    from hepti.kernels.config import MR, NR
    from hepti.plan.workloads import GEMM_COL_PANEL, GEMM_ROW_TILE
    assert (GEMM_ROW_TILE, GEMM_COL_PANEL) == (MR, NR)  # the planner's copy of the kernel's blocks
    cfg = preset_config("bert-base")
    one = flat(1, gemm_flops=1e11, attention_flops=1e11, elementwise_per_s=1e30)
    prog = rows_program(cfg, 1, 128)
    t = {r: evaluate(prog, {"rows": [float(r)]}, one).latency_s for r in (64, 65, 72)}
    assert t[64] < t[65] and t[65] == pytest.approx(t[72], rel=0.02)
    # rank 0 a hair faster: a continuous optimum near 64.2 rows; the plan is still 64 + 64
    p = flat(2, latency_s=1e-5, bandwidth_Bps=1e10, elementwise_per_s=1e30)
    p.devices[0].gemm = SpeedTable([(0.0, 1.004e11)])
    for strategy in ("rows", "tensor"):
        plan = make_plan(cfg, p, seq_len=128, strategy=strategy)
        assert plan.counts["rows"] == [64, 64], (strategy, plan.counts)
        assert all(c % 32 == 0 for c in plan.counts["ffn"]), plan.counts


def test_memory_model_uses_the_runtime_slice_sizes():
    cfg = preset_config("bert-base")
    p = flat(2)
    pred = evaluate(tensor_program(cfg, 1, 128), {"heads": [7.0, 5.0], "ffn": [2000.0, 1072.0],
                                                  "rows": [64.0, 64.0]}, p)
    L = cfg.num_hidden_layers
    assert pred.per_rank[1].mem["weights"] == pytest.approx(L * layer_slice_bytes(cfg, 5, 1072))
    assert pred.per_rank[0].mem["weights"] == pytest.approx(L * layer_slice_bytes(cfg, 7, 2000)
                                                            + embedding_bytes(cfg))
    rows = evaluate(rows_program(cfg, 1, 128), {"rows": [64.0, 64.0]}, p)
    assert rows.per_rank[1].mem["weights"] == L * layer_bytes(cfg)  # every rank holds it all
    assert all(r.mem_bytes > 0 for r in pred.per_rank)
    assert math.isfinite(pred.latency_s)
    # what the heap keeps after packing, and one raw layer slice while it is packed
    assert pred.per_rank[1].mem["overhead"] == pytest.approx(
        ALLOC_OVERHEAD * L * layer_slice_bytes(cfg, 5, 1072) + layer_slice_bytes(cfg, 5, 1072))
    assert rows.per_rank[0].mem["overhead"] == pytest.approx(
        ALLOC_OVERHEAD * (L * layer_bytes(cfg) + embedding_bytes(cfg)) + layer_bytes(cfg))
    stream = evaluate(stream_program(cfg, 1, 128, 2), {"heads": [7.0, 5.0], "ffn": [2000.0, 1072.0],
                                                       "rows": [64.0, 64.0]}, flat(2, disk_read_Bps=1e15))
    assert "overhead" not in stream.per_rank[1].mem  # a window's peak is its budget's


def test_weight_load_is_parsed_round_trips_and_must_be_positive():
    d = json.loads(json.dumps(MINIMAL))
    d["devices"][1]["weight_load_Bps"] = 4e8
    p = profile_from_dict(d)
    assert p.devices[0].weight_load_Bps is None and p.devices[1].weight_load_Bps == 4e8
    assert profile_from_dict(p.to_dict()).to_dict() == p.to_dict()
    d["devices"][1]["weight_load_Bps"] = 0
    with pytest.raises(PlanError, match="weight_load_Bps"):
        profile_from_dict(d)


def test_stream_counts_slice_loading_as_cpu_work_of_every_layer():
    """On one rank (no collectives, reading from a fast disk) loading adds exactly each layer's
    slice bytes / weight_load_Bps per layer; without the figure nothing changes."""
    from hepti.plan.workloads import stream_program
    cfg = preset_config("bert-base")
    L, H, F = cfg.num_hidden_layers, cfg.num_attention_heads, cfg.intermediate_size
    cnt = {"heads": [float(H)], "ffn": [float(F)], "rows": [128.0]}
    plain = evaluate(stream_program(cfg, 1, 128, 2), cnt, flat(1, disk_read_Bps=1e15))
    loaded = evaluate(stream_program(cfg, 1, 128, 2), cnt,
                      flat(1, disk_read_Bps=1e15, weight_load_Bps=5e8))
    sliced = layer_slice_bytes(cfg, H, F) - 4 * 6 * cfg.hidden_size  # the whole vectors aside
    assert plain.per_rank[0].load_s == 0.0
    assert loaded.per_rank[0].load_s == pytest.approx(L * sliced / 5e8)
    assert loaded.latency_s - plain.latency_s == pytest.approx(L * sliced / 5e8)
    assert loaded.per_rank[0].compute_s == pytest.approx(plain.per_rank[0].compute_s)
    assert plain.latency_s == pytest.approx(evaluate(tensor_program(cfg, 1, 128), cnt, flat(1)).latency_s)
