"""Under mpiexec -n 2: `measure_profile` gives every rank the same valid profile, the cache
reuses a fresh one and re-measures a stale one, and the planner accepts what was measured."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.families import preset_config  # noqa: E402
from hepti.model.llama import LlamaConfig  # noqa: E402
from hepti.parallel.profiling import cached_profile, measure_profile  # noqa: E402
from hepti.resources import available_memory  # noqa: E402
from hepti.plan.partition import make_plan  # noqa: E402
from hepti.plan.profile import profile_from_dict  # noqa: E402

CFG = preset_config("tiny-odd")


@pytest.fixture(scope="module")
def measured():
    return measure_profile(COMM, CFG, seq_len=32, mem_cap=None)


def test_a_decoders_profile_has_its_gemvs_its_call_cost_and_its_collectives_calibrated():
    """A decoder's profile: GeMV bytes/s and a decode call's seconds on every rank, and the
    one-row allreduce and greedy's allgather calibrated through the verbs a decode step calls
    (hepti.parallel.profile_links `calibrate_decoder_collectives`), and the jitter of the
    ranks' arrivals at a decode step's syncs, as numbers the planner reads."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, head_dim=16, model_type="llama")
    got = measure_profile(COMM, cfg, seq_len=4, mem_cap=None, disk=False)
    prof = profile_from_dict(got)
    for dev in prof.devices:
        all_ok(dev.gemv_Bps > 1e6 and dev.gemv_int8_Bps > 1e6, f"rank {dev.rank}: {dev.to_json()}")
        all_ok(0 < dev.call_overhead_s < 0.01, f"rank {dev.rank}: call {dev.call_overhead_s}")
    cal = got["network"].get("calibration", {})
    all_ok(set(cal) == {"allreduce", "allgather"} and all(0.2 <= f <= 50 for f in cal.values()),
           f"decoder calibration: {cal}")
    syncs = got.get("decode_syncs")  # per group size: J(n) and S(n) of a decode step's syncs
    all_ok(isinstance(syncs, dict) and all(
        len(syncs[k]) == COMM.Get_size() and syncs[k][0] == 0 and all(0 <= x < 10 for x in syncs[k])
        for k in ("jitter", "seconds")), f"decode syncs: {syncs!r}")
    all_ok(prof.extra.get("decode_syncs") == syncs, "the syncs are not in the profile")


def test_every_rank_gets_the_same_valid_profile(measured):
    texts = COMM.allgather(json.dumps(measured, sort_keys=True))
    all_ok(len(set(texts)) == 1, "ranks disagree on the profile")
    prof = profile_from_dict(measured)
    all_ok(prof.world_size == COMM.Get_size() and prof.source == "measured", f"{prof.world_size}")
    avail, _ = available_memory()
    for dev in prof.devices:
        all_ok(dev.gemm.peak > 1e8 and dev.attention_flops() > 1e7 and dev.elementwise_per_s > 1e6,
               f"rank {dev.rank}: implausible speeds {dev.to_json()}")
        all_ok(0 < dev.memory_bytes <= avail * 1.5, f"rank {dev.rank}: memory {dev.memory_bytes}")
        all_ok(dev.bandwidth_Bps > 1e6 and dev.latency_s >= 0, f"rank {dev.rank}: link {dev.to_json()}")
    table = measured["devices"][0]["gemm_flops"]
    all_ok(len(table) >= 2 and table[0][0] < table[-1][0], f"GeMM table by size: {table}")
    if COMM.Get_rank() == 0:
        print(json.dumps({k: v for k, v in measured.items() if k != "devices"}),
              *(json.dumps(d) for d in measured["devices"]), sep="\n")


def test_memory_cap_is_applied():
    prof = measure_profile(COMM, CFG, seq_len=16, mem_cap=123_456_789, disk=False)
    all_ok(all(d["memory_bytes"] == 123_456_789 for d in prof["devices"]), "cap not applied")


def test_a_profile_measured_now_holds_the_memory_left_now(measured):
    """`_memory_as_now`: a device's memory is lowered to what its rank has now where that is
    less (the measuring kept some of it), never raised: the same figure on every rank."""
    from hepti.parallel.profiling import _memory_as_now
    big = json.loads(json.dumps(measured))
    for d in big["devices"]:
        d["memory_bytes"] = 1e18  # more than any machine: lowered to what is there now
    low = _memory_as_now(COMM, big, None)["devices"]
    small = json.loads(json.dumps(measured))
    for d in small["devices"]:
        d["memory_bytes"] = 1000.0
    kept = _memory_as_now(COMM, small, None)["devices"]
    capped = _memory_as_now(COMM, big, 123_456_789)["devices"]
    all_ok(all(0 < d["memory_bytes"] < 1e18 for d in low)
           and all(d["memory_bytes"] == 1000.0 for d in kept)
           and all(d["memory_bytes"] == 123_456_789 for d in capped)
           and COMM.allgather(low) == [low] * COMM.Get_size(), f"{low} {kept} {capped}")


def test_cache_reuses_a_fresh_profile_and_remeasures_a_stale_one(tmp_path, monkeypatch):
    base = COMM.bcast(str(tmp_path) if COMM.Get_rank() == 0 else None)
    monkeypatch.setenv("HEPTI_CACHE", base)
    hostfile = Path(base) / "hosts"
    if COMM.Get_rank() == 0:
        hostfile.write_text("localhost:2\n")
    COMM.Barrier()
    first, new1, _ = cached_profile(COMM, CFG, 16, hostfile=str(hostfile), max_age_s=3600)
    again, new2, _ = cached_profile(COMM, CFG, 16, hostfile=str(hostfile), max_age_s=3600)
    all_ok(new1 and not new2 and again.created == first.created, f"{new1} {new2}")
    later, new3, _ = cached_profile(COMM, CFG, 16, hostfile=str(hostfile), max_age_s=0.0)
    all_ok(new3 and later.created > first.created, "a stale profile was not re-measured")


def test_a_measured_profile_plans(measured):
    prof = profile_from_dict(measured)
    plan = make_plan(CFG, prof, 32)
    plan.validate(COMM.Get_size())
    all_ok(plan.predicted_latency_s > 0 and plan.explanation != "", plan.explanation)


def test_a_profile_file_reaches_every_rank_and_plans_without_a_second_read(measured):
    """`--profile FILE` (what hepti serve's supervisor gives a smaller world): every rank gets
    the profile, and planning on it is one collective on every rank. Until 2026-11-29 the
    file was on rank 0 alone and `plan_with_profile` made the others read it again, alone:
    the job hung at start."""
    import argparse
    import tempfile

    from hepti.parallel.comm import Comm
    from hepti.parallel.plans import get_profile, plan_with_profile
    from hepti.parallel.trace import Tracer
    path = COMM.bcast(tempfile.mkdtemp() + "/p.json" if COMM.Get_rank() == 0 else None)
    if COMM.Get_rank() == 0:
        Path(path).write_text(json.dumps(measured))
    COMM.Barrier()
    world = Comm(COMM, Tracer(COMM.Get_rank()))
    args = argparse.Namespace(profile=path, strategy="auto", ratios=None, mem_budget=None,
                              mem_cap=None, threads=1, json=True)
    prof = get_profile(args, world, CFG, 1, 32)
    all_ok(prof is not None and prof.world_size == COMM.Get_size(), f"rank {COMM.Get_rank()}: {prof}")
    plan = plan_with_profile(args, world, CFG, 1, 32, prof)
    all_ok(plan.validate(COMM.Get_size()) is not None, "no plan")
