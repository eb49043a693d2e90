"""Distributed runs launched by the test itself: world sizes other than 2, fault handling, and
bad plans rejected before any work. (The bulk of the distributed tests runs under
`mpiexec -n 2` in tests/mpi.)"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import hepti

ROOT = Path(__file__).resolve().parents[1]


def mpiexec() -> str:
    exe = Path(sys.executable).parent / "mpiexec"
    found = str(exe) if exe.exists() else shutil.which("mpiexec")
    if not found:
        pytest.skip("no mpiexec (install the `mpich` wheel: bin/setup does)")
    return found


def launch(n: int, *args, env=None, timeout=600):
    cmd = [mpiexec(), "-n", str(n), sys.executable, *map(str, args)]
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    return p.returncode, p.stdout, p.stderr, time.monotonic() - t0


def launch_cases(n: int, script: str, *args, timeout=600) -> list[dict]:
    """tests/mpi/SCRIPT run standalone at N ranks -> the JSON line it printed per case (the job
    must exit 0: a case off makes it exit 1)."""
    code, out, err, _ = launch(n, "-m", "mpi4py", ROOT / "tests/mpi" / script, *args, timeout=timeout)
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert code == 0, err[-3000:] + "\n" + "\n".join(map(str, rows))
    return rows


def launch_scripts(n: int, scripts: dict[str, list], timeout=600) -> dict[str, list[dict]]:
    """Several tests/mpi scripts run one after another in one job at N ranks (tests/mpi/several.py:
    the ranks' start-up, imports and kernels paid once) -> each script's JSON lines by name."""
    argv = [x for script, args in scripts.items() for x in ("--", script, *args)][1:]
    rows, by_script = launch_cases(n, "several.py", *argv, timeout=timeout), {}
    for r in rows:
        if set(r) == {"script"}:
            current = by_script.setdefault(r["script"], [])
        else:
            current.append(r)
    assert list(by_script) == list(scripts), by_script.keys()
    return by_script


def launch_runs(n: int, *commands: list, timeout=600
                ) -> tuple[list[int], list[str], list[str]]:
    """Several `hepti` command lines run one after another in one job at N ranks
    (tests/mpi/runs.py) -> (each command's exit code, what each wrote on stdout, and on
    stderr; what came after the last command's line, a rank's late output, counts as the last
    command's). A line one rank wrote could reach mpiexec after another rank's end-of-command
    line: a check that no rank but the primary wrote something counts it in the whole job's
    output too, not only in its command's part."""
    argv = [str(x) for cmd in commands for x in ("--", *cmd)][1:]
    code, out, err, _ = launch(n, "-m", "mpi4py", ROOT / "tests/mpi" / "runs.py", *argv,
                               timeout=timeout)
    assert code == 0, err[-3000:]
    codes = [json.loads(ln)["code"] for ln in out.splitlines() if ln.startswith('{"runs.py"')]
    assert len(codes) == len(commands), (out[-2000:], err[-2000:])
    outs, errs = _runs_parts(out), _runs_parts(err)
    assert len(outs) == len(errs) == len(commands), (out[-2000:], err[-3000:])
    return codes, outs, errs


def _runs_parts(text: str) -> list[str]:
    """tests/mpi/runs.py's output cut at its {"runs.py": ...} lines: one part per command (what
    follows the last line added to the last part)."""
    parts, part = [], []
    for ln in text.splitlines(keepends=True):
        if ln.startswith('{"runs.py"'):
            parts.append("".join(part))
            part = []
        else:
            part.append(ln)
    if parts:
        parts[-1] += "".join(part)
    return parts


def test_equivalence_other_world_sizes(tiny_dir, minilm_dir, vit_dir):
    """Every strategy and ratio vector at 1 rank equals the single-device engine (1e-4), for
    both families (3 ranks: the next test; 4 ranks: with the CNNs, below)."""
    check_equivalence(1, launch_cases(1, "equivalence.py", "--model", tiny_dir, "--model",
                                      minilm_dir, "--model", vit_dir))


def check_equivalence(n: int, rows: list[dict]) -> None:
    """equivalence.py's lines at N ranks: every case of every model equal (1e-4)."""
    # (strategies x ratio vectors, "moved" too) per model; GenEFlow's three mixed plans: 3 and 12
    expected = 3 * (9 if n == 1 else 29)
    assert len(rows) == expected and all(r["ok"] for r in rows), rows


def test_both_families_and_the_cnns_equal_one_device_at_4_ranks(
        tiny_dir, minilm_dir, vit_dir, mobilenet_dir, resnet_tiny_dir, vgg_tiny_dir):
    """One launch at 4 ranks for two scripts (each had its own; the ranks' start-up paid once):
    tests/mpi/equivalence.py (every strategy and ratio vector equals the single-device engine,
    1e-4, for both families, as at 1 rank above) and tests/mpi/cnn_equivalence.py (as
    test_cnn_equivalence_other_world_sizes checks it at 2 ranks, below)."""
    got = launch_scripts(4, {
        "equivalence.py": ["--model", tiny_dir, "--model", minilm_dir, "--model", vit_dir],
        "cnn_equivalence.py": ["--model", mobilenet_dir, "--model", resnet_tiny_dir,
                               "--model", vgg_tiny_dir]}, timeout=900)
    check_equivalence(4, got["equivalence.py"])
    check_cnn_equivalence(4, got["cnn_equivalence.py"])


def test_equivalence_and_messages_equal_the_program_at_3_ranks(tiny_dir, minilm_dir, vit_dir):
    """tests/mpi/agreement.py --outputs at 3 ranks, one run per case for two checks: every
    strategy and ratio vector equals the single-device engine (1e-4), and its verb calls (kind,
    bytes sent and received per rank) equal its cost program's collectives, for both families.
    (Two launches of every case, equivalence.py's and agreement.py's, had checked one each.)"""
    rows = launch_cases(3, "agreement.py", "--outputs", "--model", tiny_dir, "--model", minilm_dir,
                        "--model", vit_dir)
    assert len(rows) == 3 * 29, rows  # 29 cases per model
    assert all(r["ok"] and r["outputs_checked"] for r in rows), rows


def test_cnns_equal_torchvision_and_band_messages_equal_the_program_at_3_ranks(
        resnet_tiny_dir, vgg_tiny_dir, mobilenet_dir):
    """One launch at 3 ranks for two scripts (each had its own): tests/mpi/cnn_equivalence.py
    (as the next test checks it at 2 and 4 ranks), and tests/mpi/cnn_agreement.py: the band
    executor's verb calls (halos, allgathers of channels, pooled sums and head columns) equal
    its band program's collectives."""
    models = ["--model", mobilenet_dir, "--model", resnet_tiny_dir, "--model", vgg_tiny_dir]
    got = launch_scripts(3, {"cnn_equivalence.py": models, "cnn_agreement.py": models}, timeout=1500)
    check_cnn_equivalence(3, got["cnn_equivalence.py"])
    rows = got["cnn_agreement.py"]
    assert len(rows) == 3 * 8 and all(r["ok"] for r in rows), rows  # 8 cases per model


@pytest.fixture
def ids_file(tmp_path):
    f = tmp_path / "ids.npz"
    np.savez(f, ids=np.array([[2, 5, 7, 9, 11, 0], [3, 4, 5, 6, 7, 8]]),
             mask=np.array([[1, 1, 1, 1, 1, 0], [1] * 6]))
    return f


def test_fault_on_rank_1_ends_job(tiny_dir, ids_file, sweeps_killed_job):
    import os
    env = dict(os.environ, HEPTI_FAULT_RANK="1")
    code, out, err, secs = launch(2, "-m", "hepti", "run", "--model", tiny_dir, "--input-ids",
                                  ids_file, "--strategy", "tensor", env=env, timeout=120)
    assert code != 0
    assert secs < 30, f"took {secs:.1f} s to end"
    assert "rank 1" in err and "injected fault" in err, err


# bad --ratios vectors and --mem-budgets, each refused before any work with its message
BAD_VECTORS = [
    (["--strategy", "tensor", "--ratios", "0.5,0.3,0.2"], "3 entries but there are 2 ranks"),
    (["--strategy", "tensor", "--ratios", "0.5,-0.5"], "finite and >= 0"),
    (["--strategy", "rows", "--ratios", "nan,1"], "finite and >= 0"),
    (["--strategy", "tensor", "--ratios", "0,0"], "all zeros"),
    (["--strategy", "stream", "--mem-budget", "1000"], "below one layer's slice"),
    (["--strategy", "stream"], "needs --mem-budget"),
]


def test_bad_vectors_and_plans_rejected_before_work(tiny_dir, ids_file, tmp_path):
    """Each bad vector above, and a plan for 3 ranks in a job of 2, is refused before any work:
    a non-zero exit, its message written once (only the primary reports an error every rank
    agrees on), no traceback. The seven `hepti run`s in one job at 2 ranks (tests/mpi/runs.py:
    each command's exit code and stderr; the ranks' start-up paid once, not seven times)."""
    from hepti.plan.planfile import Plan
    p = tmp_path / "plan.json"
    p.write_text(Plan(strategy="tensor", world_size=3,
                      ratios={d: [0.5, 0.25, 0.25] for d in ("heads", "ffn", "rows")}).to_json())
    cases = BAD_VECTORS + [(["--plan", p], "plan is for 3 ranks but the job has 2")]
    codes, _, errs = launch_runs(2, *[["run", "--model", tiny_dir, "--input-ids", ids_file, *extra]
                                   for extra, _ in cases], timeout=300)
    for (extra, msg), code, err in zip(cases, codes, errs):
        assert code != 0 and msg in err, (extra, err)
        assert "Traceback" not in err, (extra, err)
        assert err.count(msg) == 1, ("only the primary reports an error every rank agrees on",
                                     extra, err)
    # and none in another command's part (a rank's line written late): each message as often
    # in the whole job's stderr as commands expect it
    for msg in {m for _, m in cases}:
        assert "".join(errs).count(msg) == sum(m == msg for _, m in cases), (msg, errs)


def test_run_json_reports_per_rank(tiny_dir, ids_file, tmp_path):
    trace, report = tmp_path / "trace.json", tmp_path / "report.json"
    code, out, err, _ = launch(2, "-m", "hepti", "run", "--model", tiny_dir, "--input-ids", ids_file,
                               "--strategy", "tensor", "--ratios", "0.75,0.25", "--json",
                               "--repeat", "3", "--trace", trace, "--report", report, timeout=120)
    assert code == 0, err
    rep = json.loads(out)
    assert json.loads(report.read_text()) == rep  # --report: the same report, in a file
    assert rep["strategy"] == "tensor" and rep["counts"]["heads"] == [5, 1]  # 4.5|1.5: tie to rank 0
    assert len(rep["per_rank"]) == 2
    for r in rep["per_rank"]:
        for k in ("compute_s", "comm_s", "bytes_sent", "bytes_recv", "weight_bytes_resident",
                  "weight_bytes_read", "peak_rss_bytes"):
            assert k in r
        assert set(r["comm_s"]) >= {"reduce_scatter", "allgatherv"}
        assert r["bytes_sent"] > 0 and r["bytes_recv"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    tracks = {e["tid"] for e in events if e.get("ph") == "X"}
    assert tracks == {0, 1}
    names = {e["name"] for e in events if e.get("ph") == "X"}
    assert {"Reduce_scatter", "Allgatherv"} <= names


def test_cnn_run_at_3_ranks_equals_one(resnet_tiny_dir, tmp_path, sweeps_killed_job):
    """`hepti run` of a CNN under mpiexec -n 3: --strategy auto (a profile measured on the spot,
    the LP, fusion), even, and a plan file from `hepti profile` + `hepti plan`; each output
    equals one device's (1e-4 relative), and bad CNN strategies are refused before work."""
    e = np.load(ROOT / "tests/fixtures/resnet50_tiny_expected.npz")
    px = tmp_path / "px.npy"
    np.save(px, e["pixels"].astype(np.float32))
    want = e["logits"]
    prof, plan = tmp_path / "p.json", tmp_path / "plan.json"
    code, _, err, _ = launch(3, "-m", "hepti", "profile", "--model", resnet_tiny_dir,
                             "--image-size", "65x57", "--batch", "2", "--out", prof)
    assert code == 0, err[-2000:]
    measured = json.loads(prof.read_text())  # each conv's seconds when streamed, in the
    table = measured["cnn"]  # executor's forward, and the fixed cost and rate fitted to them
    from hepti.graph.cnn import CONV
    from hepti.model.cnn import build
    from hepti.weights import WeightStore
    graph = build(WeightStore(resnet_tiny_dir).config)
    convs = {i for i, op in enumerate(graph.ops) if op.kind == CONV}
    assert len(table["op_stream_measured"]) == 3, table.keys()
    for per in table["op_stream_measured"]:
        assert {i for i, t in enumerate(per) if t is not None} == convs, per
        assert all(-0.05 < per[i] < 0.5 for i in convs), per
    assert len(table["fetch_overhead_s"]) == 3
    assert all(0 <= x < 0.05 for x in table["fetch_overhead_s"]), table["fetch_overhead_s"]
    assert all(d["weight_load_Bps"] > 1e6 for d in measured["devices"]), measured["devices"]
    # every spatial op timed on two bands as the executor runs them (a + b x rows), and the
    # allgathers among 2 and 3 ranks
    for per in table["op_band_s"]:
        spatial = [ab for ab in per if ab is not None]
        assert len(spatial) == len(per) - 2, per  # the pooling and the head: whole-map op_s
        assert all(a >= 0 and b >= 0 for a, b in spatial) and any(b > 0 for _, b in spatial)
    assert sorted(table["allgather_s"]) == ["2", "3"], table["allgather_s"]
    assert len(table["band_spread"]) == 3 and all(0 <= s < 5 for s in table["band_spread"])
    for f, b, f_long, b_long in table["allgather_s"].values():  # short and long messages' lines
        assert 0 < f < 0.05 and b >= 0 and b_long >= 0 and f_long < 0.05
    code, _, err = hepti("plan", "--model", resnet_tiny_dir, "--profile", prof, "--out", plan)
    assert code == 0, err
    # GenEFlow under a cap below the weights (380 KB of them; 60% of one device's 485 KB):
    # only ops split by channels, each rank loading its slice of their weights, can meet it
    gplan = tmp_path / "genetic.json"
    code, _, err = hepti("plan", "--model", resnet_tiny_dir, "--profile", prof, "--search", "genetic",
                         "--mem-cap", "60%", "--generations", "8", "--out", gplan)
    assert code == 0, err
    assert "channels" in json.loads(gplan.read_text())["group_dims"]
    # the four runs and the refusal in one job (tests/mpi/runs.py: the ranks' start-up paid once)
    cases = (["--strategy", "auto"], ["--strategy", "even"], ["--plan", plan], ["--plan", gplan])
    outs = [tmp_path / f"y{i}.npy" for i in range(len(cases))]
    codes, _, errs = launch_runs(3, *[["run", "--model", resnet_tiny_dir, "--input-pixels", px,
                                   "--output", out, "--force", "--json", *extra]
                                  for out, extra in zip(outs, cases)],
                             ["run", "--model", resnet_tiny_dir, "--input-pixels", px,
                              "--strategy", "tensor"])
    assert codes[:-1] == [0] * len(cases), (codes, errs)
    for out, extra in zip(outs, cases):
        got = np.load(out)
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), extra
    assert codes[-1] != 0 and "split by height" in errs[-1] and "Traceback" not in errs[-1], errs


# --- issue 19: the CNNs against torchvision across ranks ------------------------------------

def _cnn_equivalence():
    """tests/mpi/cnn_equivalence.py as a module (its cases; it imports MPI only in main)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("cnn_equivalence",
                                                  ROOT / "tests/mpi/cnn_equivalence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cnn_equivalence_other_world_sizes(mobilenet_dir, resnet_tiny_dir, vgg_tiny_dir):
    """tests/mpi/cnn_equivalence.py at 2 ranks, one launch: every CNN strategy (planned on
    unequal declared devices) and --ratios vector (skewed, with zeros) gives torchvision's
    logits (1e-3) and, for the three photos through MobileNetV2, its top-5; the tiny ResNet-50
    and VGG-16 too. (3 ranks: in one launch with cnn_agreement.py, above; 4 ranks: with the
    transformers' equivalence.py, above.)"""
    rows = launch_cases(2, "cnn_equivalence.py", "--model", mobilenet_dir, "--model",
                        resnet_tiny_dir, "--model", vgg_tiny_dir, timeout=300)
    check_cnn_equivalence(2, rows)


def check_cnn_equivalence(n: int, rows: list[dict]) -> None:
    """cnn_equivalence.py's lines at N ranks: every case of every model, each within bounds."""
    helper = _cnn_equivalence()
    cases = [f"--strategy {s}" for s in helper.strategies()]
    cases += [f"--ratios {name}" for name in helper.RATIOS[n]]
    want = [(m, c) for m in ("mobilenet_v2", "resnet50", "vgg16") for c in cases]
    assert [(r["model"], r["case"]) for r in rows] == want, rows
    assert all(r["ok"] and r["max_abs_diff_torchvision"] <= 1e-3 for r in rows), rows
    assert all(r["top5_equal"] for r in rows if r["model"] == "mobilenet_v2"), rows


def test_cnn_photos_run_at_3_ranks(mobilenet_dir, tmp_path):
    """`hepti run --image` of the three photos under mpiexec -n 3 with --strategy auto (a
    profile measured on the spot, the LP, fusion): each photo's top-5 is torchvision's and its
    logits are within 1e-3 of torchvision's."""
    e = np.load(ROOT / "tests/fixtures/mobilenet_v2_expected.npz")
    photos = {"chelsea": "cnn_image.png", "coffee": "cnn_coffee.png",
              "astronaut": "cnn_astronaut.png"}
    out = tmp_path / "y.npy"
    code, stdout, err, _ = launch(3, "-m", "hepti", "run", "--model", mobilenet_dir, "--image",
                                  *[ROOT / "tests/fixtures" / f for f in photos.values()],
                                  "--strategy", "auto", "--output", out, "--json", timeout=300)
    assert code == 0, err[-2000:]
    report = json.loads(stdout)
    logits = np.load(out)
    for i, name in enumerate(photos):
        top5 = list(e[f"{name}_top5"][0])
        assert [c["class"] for c in report["top"][i]["top"]] == top5, (name, report["ratios"])
        assert np.abs(logits[i] - e[f"{name}_logits"][0]).max() <= 1e-3, (name, report["ratios"])
