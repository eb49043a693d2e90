"""A run over a file, the main job: one pass, row i is input i, the output written batch by batch
(under its name only when complete), --resume after a kill, and every input checked before any
work, with exit code 2 and no traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import left_after
from test_cli import DEV, _profile, assert_clean_error, hepti
from test_distributed_launch import ROOT, launch, mpiexec


def ids_file(path: Path, n: int, seed: int = 0) -> Path:
    """n inputs of 3-12 real tokens (ids within tiny-odd's vocabulary), padded to 12."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, 13, n)
    mask = (np.arange(12)[None, :] < lengths[:, None]).astype(np.int64)
    ids = rng.integers(1, 1000, (n, 12)) * mask
    np.savez(path, ids=ids, mask=mask)
    return path


# --- one pass -----------------------------------------------------------------------------------

def test_one_pass_runs_each_batch_once(tiny_dir, tmp_path, monkeypatch):
    """--repeat 1 (the default) runs every batch once: no second, timed pass over the input."""
    from hepti import cli
    from hepti.parallel.single import SingleDevice
    calls = []
    run = SingleDevice.run
    monkeypatch.setattr(SingleDevice, "run", lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    out = tmp_path / "o.npy"
    assert cli.main(["run", "--model", str(tiny_dir), "--input-ids", str(ids_file(tmp_path / "i.npz", 10)),
                     "--batch-size", "3", "--output", str(out), "--json"]) == 0
    assert len(calls) == 4  # ceil(10 / 3) batches, once each
    assert np.load(out).shape == (10, 96)
    calls.clear()
    assert cli.main(["run", "--model", str(tiny_dir), "--input-ids", str(tmp_path / "i.npz"),
                     "--batch-size", "3", "--repeat", "3", "--json"]) == 0
    assert len(calls) == 1 + 3 * 4  # a warm-up on one batch, then 3 passes


# --- item 3: row i is line i ---------------------------------------------------------------------

def test_blank_lines_are_empty_texts(minilm_dir, tmp_path):
    f = tmp_path / "in.txt"
    f.write_bytes(b"first\n\nthird\r\n   \nlast")  # blank, CRLF, spaces only, no final newline
    out, ref = tmp_path / "e.npy", tmp_path / "r.npy"
    code, _, err = hepti("run", "--model", minilm_dir, "--input", f, "--output", out)
    assert code == 0, err
    code, _, err = hepti("run", "--model", minilm_dir, "--text", "first", "", "third", "   ", "last",
                         "--output", ref)
    assert code == 0, err
    e = np.load(out)
    assert e.shape == (5, 384)
    assert np.abs(e - np.load(ref)).max() < 1e-5
    assert np.abs(e[1] - e[0]).max() > 1e-2  # the blank line has a row of its own


def test_help_says_blank_lines_are_kept():
    code, out, _ = hepti("run", "--help")
    assert code == 0 and "blank line" in out and "--resume" in out


# --- item 4: --output checked before any work ----------------------------------------------------

@pytest.mark.parametrize("name,needle", [
    ("/proc/hepti-x.npy", "cannot write into /proc"),
    ("DIR", "is a folder"),
    ("emb", "must end in .npy"),
])
def test_bad_output_refused_before_work(tiny_dir, tmp_path, name, needle):
    (tmp_path / "DIR").mkdir()
    path = name if name.startswith("/") else tmp_path / name
    ids = ids_file(tmp_path / "i.npz", 3)
    code, out, err = hepti("run", "--model", tiny_dir, "--input-ids", ids, "--output", path)
    assert code == 2
    assert_clean_error(code, err, needle)
    assert not Path(f"{path}.npy").exists() and "wrote" not in out
    assert not list(tmp_path.glob("*.partial*"))


def test_output_appears_only_when_complete(tiny_dir, tmp_path):
    """Nothing is under the output's name until the last row is in; then no partial is left."""
    out = tmp_path / "o.npy"
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 7),
                         "--batch-size", "2", "--output", out)
    assert code == 0, err
    assert np.load(out).shape == (7, 96)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["i.npz", "o.npy"]


def test_hidden_states_padded_to_longest_batch(tiny_dir, tmp_path):
    ids = np.array([[2, 5, 7, 0], [3, 4, 5, 6], [9, 9, 0, 0]])
    f = tmp_path / "ids.npz"
    np.savez(f, ids=ids, mask=(ids > 0).astype(np.int64))
    out = tmp_path / "h.npy"
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", f, "--pool", "none",
                         "--batch-size", "2", "--output", out)
    assert code == 0, err
    assert np.load(out).shape == (3, 4, 96)


# --- item 5: plans and profiles checked against the model ----------------------------------------

def _plan(tmp_path, model_dir, strategy, devices=1):
    prof = _profile(tmp_path, [dict(DEV)] * devices)
    p = tmp_path / f"plan-{strategy}.json"
    code, out, err = hepti("plan", "--model", model_dir, "--profile", prof, "--strategy", strategy,
                           "--out", p)
    assert code == 0, err
    return p


def test_plan_for_another_model_refused(minilm_dir, tiny_dir, tmp_path):
    plan = _plan(tmp_path, minilm_dir, "tensor")
    code, out, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 2),
                           "--plan", plan)
    assert code == 2
    assert_clean_error(code, err, "does not fit this model", "layers 6 vs 3", "hepti plan --model")


def test_pipeline_plan_for_more_layers_refused(tiny_dir, tmp_path):
    """A pipeline plan made for a 12-layer model, without a recorded shape (an older plan file)."""
    from hepti.plan.planfile import Plan
    p = tmp_path / "plan.json"
    p.write_text(Plan(strategy="pipeline", world_size=1, ratios={d: [1.0] for d in ("heads", "ffn", "rows")},
                      layers=[[0, 12]]).to_json())
    code, out, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 2),
                           "--plan", p)
    assert code == 2
    assert_clean_error(code, err, "cover 12 layers but the model has 3")


def test_profile_for_another_model_refused(tiny_dir, tmp_path):
    prof = _profile(tmp_path, [dict(DEV)], source="measured", created=time.time(),
                    model="random-bert-base",
                    model_shape={"layers": 12, "hidden": 768, "heads": 12, "ffn": 3072})
    code, _, err = hepti("plan", "--model", tiny_dir, "--profile", prof)
    assert_clean_error(code, err, "does not fit this model", "hepti profile --model")
    assert code == 2
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 2),
                         "--strategy", "auto", "--profile", prof)
    assert code == 2
    assert_clean_error(code, err, "does not fit this model")


@pytest.mark.parametrize("budget", ["0", "-5MiB"])
def test_mem_budget_must_be_positive(tiny_dir, tmp_path, budget):
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 2),
                         "--strategy", "stream", f"--mem-budget={budget}")
    assert code == 2
    assert_clean_error(code, err, "must be a positive size")


# --- item 6: Ctrl-C ------------------------------------------------------------------------------

def _interrupt(cmd, partial: Path, timeout=120):
    """Start cmd, wait until the partial output holds a batch, send SIGINT; (rc, stderr)."""
    # Ctrl-C as a terminal delivers it: with SIGINT's default action. A suite started in the
    # background (`bin/test &`) inherits SIGINT ignored, and so would the child, which would
    # then run to the end (a fresh-clone run did: exit 0)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        t_end = time.monotonic() + timeout
        while not (partial.exists() and partial.stat().st_size > 4096) and time.monotonic() < t_end:
            if p.poll() is not None:
                break
            time.sleep(0.01)
        assert p.poll() is None, "finished before it could be interrupted: give it more work"
        assert partial.exists(), f"no {partial.name} after {timeout} s"
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
        return p.returncode, err
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("ranks", [1, 2])
def test_ctrl_c_one_line_exit_130(tiny_dir, tmp_path, ranks, sweeps_killed_job):
    out = tmp_path / "o.npy"
    run = ["-m", "hepti", "run", "--model", str(tiny_dir), "--input-ids",
           str(ids_file(tmp_path / "i.npz", 60000)), "--batch-size", "2", "--output", str(out)]
    cmd = [sys.executable, *run] if ranks == 1 else [mpiexec(), "-n", "2", sys.executable, *run]
    code, err = _interrupt(cmd, Path(f"{out}.partial"))
    assert code == 130, err
    assert "Traceback" not in err, err
    assert err.count("interrupted") == 1, err
    assert not out.exists()  # nothing half-written under the output's name
    left = left_after(lambda: subprocess.run(["pgrep", "-f", str(out)], capture_output=True,
                                             text=True).stdout.split())
    assert not left, f"processes left running: {left}"


# --- resume --------------------------------------------------------------------------------------

def _rank_pid(marker: str, rank: int) -> int | None:
    """The pid of MPI rank `rank` of the job whose command line holds `marker`."""
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"mpiexec" not in cmdline.split(b"\0")[0] \
                and f"PMI_RANK={rank}".encode() in env:
            return int(pid)
    return None


def test_resume_after_kill_equals_uninterrupted_run(tiny_dir, tmp_path, sweeps_killed_job):
    """kill -9 rank 1 halfway through 3,000 inputs on 2 ranks, then --resume: the output is
    byte for byte the output of a run that was never interrupted, and the report says where it
    resumed (so how many batches were computed again). Both ranks are stopped (SIGSTOP) the
    moment the output holds half the rows, so the job cannot run on to its end while rank 1 is
    found and killed, however loaded the machine: it needs no more inputs than the half before
    the kill (10,000 had bought that margin, at 2.5 times the work)."""
    n, bs = 3000, 4
    ids = ids_file(tmp_path / "i.npz", n)
    run = ["-m", "hepti", "run", "--model", tiny_dir, "--input-ids", ids, "--batch-size", bs,
           "--strategy", "tensor", "--ratios", "0.6,0.4"]
    whole = tmp_path / "whole.npy"
    code, _, err, _ = launch(2, *run, "--output", whole, timeout=600)
    assert code == 0, err

    out = tmp_path / "resumed.npy"
    partial = Path(f"{out}.partial")
    cmd = [mpiexec(), "-n", "2", sys.executable, *map(str, run), "--output", str(out)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    stopped = []
    try:
        t_end = time.monotonic() + 300
        pids = [None, None]
        while p.poll() is None and None in pids:  # the ranks start long before they write rows
            assert time.monotonic() < t_end, "the ranks were not found"
            pids = [_rank_pid(str(out), r) for r in (0, 1)]
            time.sleep(0.01)
        half = 128 + n // 2 * 96 * 4  # header + half the rows
        while p.poll() is None and not (partial.exists() and partial.stat().st_size >= half):
            assert time.monotonic() < t_end, f"{partial.name} never reached half the rows"
            time.sleep(0.005)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            except ProcessLookupError:  # ended: the assertion below says so
                pass
        assert p.poll() is None and len(stopped) == 2, "the run finished before it could be killed"
        os.kill(pids[1], signal.SIGKILL)
        os.kill(pids[0], signal.SIGCONT)  # it finds rank 1 gone: the job ends
        stopped.clear()
        p.communicate(timeout=120)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode != 0 and not out.exists()
    rows_kept = (partial.stat().st_size - 128) // (96 * 4)
    assert n // 4 < rows_kept < n

    code, stdout, err, _ = launch(2, *run, "--output", out, "--resume", "--json", timeout=600)
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["resumed_from_batch"] == rows_kept // bs  # only a batch cut short is computed again
    assert out.read_bytes() == whole.read_bytes()
    assert not partial.exists() and not Path(f"{out}.partial.json").exists()


def test_partial_left_needs_resume_or_delete(tiny_dir, tmp_path):
    out = tmp_path / "o.npy"
    Path(f"{out}.partial").write_bytes(b"\x93NUMPY")
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids_file(tmp_path / "i.npz", 2),
                         "--output", out)
    assert code == 2
    assert_clean_error(code, err, "--resume", "delete")


def test_resume_continues_only_the_same_job(tiny_dir, tmp_path):
    """A partial output left after 3 batches: --resume with other inputs is refused; with the
    same inputs it completes to the bytes of an uninterrupted run."""
    from hepti import cli, runner
    from hepti.weights import WeightStore
    a, b = ids_file(tmp_path / "a.npz", 40, seed=1), ids_file(tmp_path / "b.npz", 40, seed=2)
    whole = tmp_path / "whole.npy"
    assert hepti("run", "--model", tiny_dir, "--input-ids", a, "--output", whole, "--batch-size", "4")[0] == 0

    out = tmp_path / "o.npy"
    args = cli.build_parser().parse_args(["run", "--model", str(tiny_dir), "--input-ids", str(a),
                                          "--output", str(out), "--batch-size", "4"])
    prep = runner.prepare(args, WeightStore(tiny_dir).config, Path(tiny_dir))
    rows = np.load(whole)
    for k in range(3):
        prep.out.write(k, rows[4 * k:4 * k + 4])
    prep.out.f.write(rows[12:14].tobytes())  # half of batch 3, as a kill mid-write leaves it
    prep.out.close()
    assert not out.exists() and Path(f"{out}.partial").exists()

    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", b, "--output", out,
                         "--batch-size", "4", "--resume")
    assert code == 2
    assert_clean_error(code, err, "different job", "inputs")
    code, stdout, err = hepti("run", "--model", tiny_dir, "--input-ids", a, "--output", out,
                              "--batch-size", "4", "--resume", "--json")
    assert code == 0, err
    assert json.loads(stdout)["resumed_from_batch"] == 3
    assert out.read_bytes() == whole.read_bytes()
