"""bench-geneflow's bookkeeping (hepti.bench.geneflow): the targets it checks and the
sub-profiles of the first n devices. The grid itself runs in bin/bench-geneflow.sh."""
from __future__ import annotations

import pytest

from hepti.bench.geneflow import same_plan, sub_profile, targets
from hepti.plan.planfile import Plan
from hepti.plan.profile import declared_profile


def _rec(cap, single, mean, lp, feasible=True, measured=None):
    r = {"cap": cap, "best_single_dim_s": single, "feasible": feasible, "all_within_caps": True,
         "operators": 100, "search_max_s": 2.0, "genetic_mean_s": mean, "lp_s": lp,
         "never_worse_than_lp": True, "gain_vs_lp": (1 - mean / lp) * 100 if mean and lp else None,
         "strictly_better_than_single_dim": single is None or (mean or 1e9) < single,
         "gain_vs_best_single_dim": (1 - mean / single) * 100 if mean and single else None}
    if measured:
        r["measured"] = {"genetic": {"median_latency_s": measured[0], "prediction_error": measured[1]}}
    return r


def test_targets_count_what_the_issue_asks():
    recs = [_rec("none", 1.0, 0.99, 1.0), _rec("75%", 1.0, 0.98, 0.98, measured=(1.0, 0.2)),
            _rec("50%", 1.0, 1.0, 1.0), _rec("50%", None, 2.0, None, measured=(2.1, 0.05))]
    t = {x["target"].split(" (")[0]: x for x in targets(recs)}
    assert t["strictly better than the best single-dimension plan in >= half the capped cases"]["ok"]
    assert "2 of 3 capped cases" in t["strictly better than the best single-dimension plan in >= half the capped cases"]["detail"]
    assert t["a feasible plan wherever the single-dimension plans fail the cap"]["ok"]
    assert not t["measured within 15% of predicted"]["ok"]


def test_sub_profiles_cut_devices_and_cnn_timings():
    p = declared_profile([dict(gemm_flops=1e10, memory_bytes=1e9, latency_s=1e-4, bandwidth_Bps=1e8)] * 3)
    p.extra["cnn"] = {"op_s": [[1.0], [2.0], [3.0]], "op_overhead_s": [0.1, 0.2, 0.3],
                      "op_band_s": [[[0.1, 0.01]], [[0.2, 0.02]], [[0.3, 0.03]]],
                      "fetch_overhead_s": [1e-3, 2e-3, 3e-3],
                      "op_stream_measured": [[0.01], [0.02], [0.03]],
                      "allgather_s": {"2": [1e-4, 0.0], "3": [3e-4, 0.0]}}
    two = sub_profile(p, 2)
    assert two.world_size == 2 and two.extra["cnn"]["op_s"] == [[1.0], [2.0]]
    assert two.extra["cnn"]["op_band_s"] == [[[0.1, 0.01]], [[0.2, 0.02]]]
    assert two.extra["cnn"]["fetch_overhead_s"] == [1e-3, 2e-3]
    assert two.extra["cnn"]["op_stream_measured"] == [[0.01], [0.02]]
    assert two.extra["cnn"]["allgather_s"] == {"2": [1e-4, 0.0]}  # among its own 2 only
    assert p.extra["cnn"]["op_s"] == [[1.0], [2.0], [3.0]]  # the full one untouched


def test_same_plan_compares_what_runs():
    a = Plan("mixed", 2, {"rows": [0.5, 0.5]}, counts={"rows": [1, 1]}, assignment={"x": "rows"})
    b = Plan("mixed", 2, {"rows": [0.5, 0.5]}, counts={"rows": [1, 1]}, assignment={"x": "cols"})
    assert same_plan(a, a) and not same_plan(a, b) and not same_plan(a, None)


def test_a_plans_launches_pool_to_the_median_error():
    """`pooled`: the median of the launches' medians and of their errors, the mean of the
    errors beside it (one outlying launch moves the mean, not the median); a failed launch
    leaves the plan's status failed, with the rest still reported."""
    from hepti.bench.geneflow import pooled
    a = {"status": "ok", "strategy": "bands", "median_latency_s": 0.10, "predicted_latency_s": 0.1,
         "prediction_error": 0.0}
    b = dict(a, median_latency_s=0.13, prediction_error=0.3)
    out = pooled([a, b])
    assert out["status"] == "ok" and out["prediction_error"] == pytest.approx(0.15)
    assert out["median_latency_s"] == pytest.approx(0.115)
    assert out["prediction_errors"] == [0.0, 0.3]
    c = dict(a, median_latency_s=0.169, prediction_error=0.69)
    three = pooled([dict(a, prediction_error=-0.03), dict(a, prediction_error=0.03), c])
    assert three["prediction_error"] == pytest.approx(0.03)
    assert three["prediction_error_mean"] == pytest.approx(0.23)
    failed = pooled([a, {"status": "timeout"}])
    assert failed["status"] == "timeout" and failed["prediction_error"] == 0.0
    assert pooled([])["status"] == "none" and "prediction_error" not in pooled([])


def test_the_measured_target_judges_the_median_and_counts_each_launch_once():
    """A plan within 15% by the median of its launches passes though their mean does not (the
    detail says both); a launch shared with the LP's plan (the same plan) counts once among
    single launches."""
    from hepti.bench.geneflow import SAME, pooled
    ok = {"status": "ok", "strategy": "bands", "median_latency_s": 0.1, "predicted_latency_s": 0.1}
    g = pooled([dict(ok, prediction_error=e) for e in (-0.03, 0.03, 0.69)])
    lp = pooled([dict(x, note=SAME) for x in g["launches"][:1]]
                + [dict(ok, prediction_error=0.1)])
    rec = _rec("none", 1.0, 0.99, 1.0)
    rec["measured"] = {"genetic": g, "lp": lp}
    t = {x["target"].split(" (")[0]: x for x in targets([rec])}["measured within 15% of predicted"]
    assert t["ok"]
    assert "2 of 2 measured plans" in t["detail"] and "1 by their mean" in t["detail"]
    assert "3 of 4 single launches" in t["detail"]


def test_a_killed_benchs_lock_does_not_hold_the_next_one(tmp_path, monkeypatch):
    """The bench lock is an flock: a holder killed without cleaning up (SIGKILL: no `finally`)
    leaves the file, naming it, but not the lock; while a live process holds it, no one else
    takes it."""
    import subprocess
    import sys
    import threading

    from hepti.bench import geneflow
    lock = tmp_path / "bench.lock"
    monkeypatch.setattr(geneflow, "LOCK", lock)
    monkeypatch.setattr(geneflow, "QUIET", tmp_path / "quiet")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from hepti.bench import geneflow as g; g.LOCK = Path(sys.argv[1]); "
         "g.QUIET = Path(sys.argv[1] + '.q'); ctx = g.bench_lock(); ctx.__enter__(); "
         "print('held', flush=True); time.sleep(60)", str(lock)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert f"pid {holder.pid}" in lock.read_text()
        taken = threading.Event()
        monkeypatch.setattr(geneflow.time, "sleep", lambda s: taken.wait(0.05))

        def take():
            with geneflow.bench_lock():
                taken.set()
        t = threading.Thread(target=take, daemon=True)
        t.start()
        assert not taken.wait(0.5)  # a live holder keeps it
        holder.kill()
        holder.wait()
        assert taken.wait(10)  # killed: the next one has it
        t.join(10)
    finally:
        holder.kill()
