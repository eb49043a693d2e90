"""A rank that stops answering (issue 44, item 3): `hepti run` under mpiexec ends within its
--stall-timeout, exit code 3, with one message naming the rank, its host and the --resume
command; that command completes the run, to the bytes of a run never interrupted. Plus the
arithmetic of hepti.parallel.watchdog, which needs no MPI."""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import left_after
from test_cli import hepti
from test_distributed_launch import ROOT, launch_runs, mpiexec
from test_run_file import _rank_pid, ids_file

N, BS, TIMEOUT = 1600, 16, 5  # 100 batches of the tiny model: seconds, not minutes
ROW_BYTES, HEADER = 96 * 4, 128


# --- the arithmetic ------------------------------------------------------------------------------

def test_default_stall_timeout():
    from hepti.parallel.watchdog import (STALL_FACTOR, STALL_FLOOR_S, STALL_UNPLANNED_S,
                                         default_stall_timeout)
    assert default_stall_timeout(None) == STALL_UNPLANNED_S == 120
    assert default_stall_timeout(float("nan")) == default_stall_timeout(0.0) == 120
    assert default_stall_timeout(0.015) == STALL_FLOOR_S == 30  # MiniLM's 15 ms: the floor
    assert default_stall_timeout(5.0) == STALL_FACTOR * 5.0 == 50
    assert default_stall_timeout(5.0, scale=4.0) == 200
    assert default_stall_timeout(5.0, scale=0.1) == 30  # smaller batches: still the floor
    assert default_stall_timeout(5.0, scale=math.inf) == 50  # a nonsense scale is ignored


def test_batch_scale():
    from hepti.parallel.watchdog import cnn_scale, transformer_scale
    assert transformer_scale(1, 128, 32, 128) == 32  # rows: linear
    assert transformer_scale(1, 128, 1, 256) == 4  # tokens past the plan's: quadratic
    assert transformer_scale(4, 128, 2, 64) == 0.25  # fewer tokens: linear (an upper bound)
    assert transformer_scale(None, None, 32, 512) == 1  # a plan without its shape
    assert cnn_scale(1, [224, 224], 2, (112, 112)) == 0.5
    assert cnn_scale(None, None, 8, (224, 224)) == 1


def test_find_stall_needs_a_late_batch_and_a_silent_rank():
    from hepti.parallel.watchdog import find_stall, silent_after
    assert silent_after(30) == 5 and silent_after(3) == 3 and silent_after(0.5) == 2
    heard = {1: 99.5, 2: 90.0, 3: 80.0}
    assert find_stall(100.0, 95.0, 10.0, heard, 5.0) is None  # the batch is on time
    assert find_stall(100.0, 80.0, 10.0, {1: 99.5, 2: 99.0}, 5.0) is None  # late, all beating
    assert find_stall(100.0, 80.0, 10.0, heard, 5.0) == (3, 20.0)  # the first to go silent
    assert find_stall(100.0, 80.0, 10.0, {1: 99.5, 2: 90.0}, 5.0) == (2, 10.0)


def test_resume_command():
    from hepti.parallel.watchdog import resume_argv, stall_message
    own = ["run", "--input", "t.txt", "--output", "o.npy"]
    launcher = ["/usr/bin/mpiexec", "-f", "hosts", "-n", "3", "hepti", *own]
    # the launcher's own command line, every option kept, --resume added once
    assert resume_argv(own, launcher, 3, ["hepti"]) == launcher + ["--resume"]
    assert resume_argv(own + ["--resume"], launcher + ["--resume"], 3, ["hepti"]) == \
        launcher + ["--resume"]
    # no launcher on this host (or another command line): mpiexec -n N and the program
    assert resume_argv(own, None, 2, ["python", "-m", "hepti"]) == \
        ["mpiexec", "-n", "2", "python", "-m", "hepti", *own, "--resume"]
    assert resume_argv(own, ["mpiexec", "-n", "2", "other"], 2, ["hepti"])[:4] == \
        ["mpiexec", "-n", "2", "hepti"]
    assert resume_argv(own[:3], None, 2, ["hepti"], resume=False)[-1] == "t.txt"
    msg = stall_message(1, "pi4", "during batch 7 of 40", 12.34, 10.0,
                        "the 6 complete batches are kept in o.npy.partial",
                        ["mpiexec", "-n", "2", "hepti", "run", "--text", "a b", "--resume"])
    assert msg == ("rank 1 on pi4 stopped answering during batch 7 of 40 (silent 12.3 s, "
                   "--stall-timeout 10 s); the 6 complete batches are kept in o.npy.partial; "
                   "continue with: mpiexec -n 2 hepti run --text 'a b' --resume")


def test_stall_timeout_0_watches_nothing():
    """--stall-timeout 0: rank 0 opens no socket and tells the others so (the one bcast)."""
    from hepti.parallel import watchdog

    class World:  # rank 0 of two, its verbs without MPI
        solo, rank, size = False, 0, 2
        sent = []

        def bcast_obj(self, obj, root=0):
            self.sent.append(obj)
            return obj

    world = World()
    assert watchdog.start(world, 0.0) is None and world.sent == [None]


def test_help_says_stall_timeout_and_exit_code():
    code, out, _ = hepti("run", "--help")
    assert code == 0 and "--stall-timeout" in out and "stopped answering" in out
    assert re.search(r"^\s+3\s+a rank stopped answering", out, re.M), out
    code, _, err = hepti("run", "--text", "a", "--stall-timeout", "-1")
    assert code == 2 and "--stall-timeout" in err


# --- a stopped rank, end to end ------------------------------------------------------------------

@pytest.fixture(scope="module")
def two_runs(tiny_dir, tmp_path_factory):
    """Two 2-rank runs in one job (tests/mpi/runs.py: the ranks' start-up paid once): the stall
    scenario's command uninterrupted, and a run planned on a slow declared profile -> (the
    first's command without --output, the bytes of its output, both runs' --json reports)."""
    from test_cli import DEV, _profile
    d = tmp_path_factory.mktemp("stall")
    run = ["-m", "hepti", "run", "--model", str(tiny_dir), "--input-ids",
           str(ids_file(d / "i.npz", N)), "--batch-size", str(BS), "--strategy", "tensor",
           "--ratios", "0.6,0.4"]
    whole = d / "whole.npy"
    prof = _profile(d, [dict(DEV, gemm_flops=2e6)] * 2)
    planned = ["run", "--model", tiny_dir, "--input-ids", ids_file(d / "p.npz", 8), "--batch-size",
               "4", "--strategy", "auto", "--profile", prof, "--json"]
    codes, outs, errs = launch_runs(2, [*run[2:], "--output", whole, "--json"], planned, timeout=600)
    assert codes == [0, 0], errs
    return run, whole.read_bytes(), [json.loads(out) for out in outs]


@pytest.fixture(scope="module")
def uninterrupted(two_runs):
    """The run's command (without --output) and the bytes of its output when nothing stops."""
    run, whole, (rep, _) = two_runs
    # no prediction (--ratios): the fixed default
    assert rep["stall_timeout_s"] == 120
    return run, whole


def test_planned_run_takes_its_timeout_from_the_prediction(two_runs):
    """A plan on a slow declared profile predicts seconds a batch: the default timeout is 10x
    that (above the 30 s floor), and the --json report says so."""
    rep = two_runs[2][1]
    assert rep["predicted_latency_s"] > 3.0  # so that 10x it is above the floor
    assert rep["stall_timeout_s"] == pytest.approx(10 * rep["predicted_latency_s"])


def _left_running(marker: str) -> list[str]:
    """Processes (other than zombies) whose command line holds marker."""
    left = []
    for pid in os.listdir("/proc"):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes() and \
                    Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                left.append(pid)
        except (OSError, IndexError):
            continue
    return left


@pytest.mark.parametrize("victim", [1, 0])
def test_stopped_rank_ends_run_and_resume_completes(uninterrupted, tmp_path, victim):
    """SIGSTOP rank `victim` after a few batches: the run ends within --stall-timeout (plus a
    generous margin for a shared machine), exit code 3, with exactly one error line naming the
    rank, its host and a --resume command, and leaves no process behind; that command, run as
    printed, completes the output to the bytes of the uninterrupted run."""
    run, whole = uninterrupted
    out = tmp_path / "o.npy"
    partial = Path(f"{out}.partial")
    cmd = [mpiexec(), "-n", "2", sys.executable, *run, "--output", str(out),
           "--stall-timeout", str(TIMEOUT)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    pid = None
    try:
        t_end = time.monotonic() + 300
        while p.poll() is None and not (partial.exists() and partial.stat().st_size
                                        >= HEADER + 2 * BS * ROW_BYTES):
            assert time.monotonic() < t_end, f"{partial.name} never held 2 batches"
            time.sleep(0.002)
        assert p.poll() is None, "the run finished before a rank could be stopped"
        pid = _rank_pid(str(out), victim)
        assert pid, f"rank {victim} not found"
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=TIMEOUT + 120)
        secs = time.monotonic() - t0
        left = left_after(lambda: _left_running(str(out)))
    finally:
        if pid is not None:  # whatever happened, nothing stays stopped
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        if p.poll() is None:
            p.kill()
            p.communicate()
    print(f"rank {victim} stopped: exit {p.returncode} after {secs:.1f} s")
    assert p.returncode == 3, err[-3000:]
    assert not left, f"processes left running: {left}"
    # not before the rank could have been silent long enough; well within the timeout + margin
    assert 4.0 <= secs < TIMEOUT + 25, f"ended {secs:.1f} s after the stop"
    assert "Traceback" not in err, err
    errors = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(errors) == 1, err
    msg = errors[0]
    print(msg)
    assert msg.startswith("hepti run: error: ")
    assert f"rank {victim} on {os.uname().nodename} stopped answering" in msg, msg
    assert f"--stall-timeout {TIMEOUT} s" in msg and str(partial) in msg, msg
    assert not out.exists()
    if victim == 1:  # rank 0 says exactly what it kept
        kept = int(re.search(r"the (\d+) complete batch", msg).group(1))
        assert (partial.stat().st_size - HEADER) // (BS * ROW_BYTES) == kept
        assert re.search(rf"during batch {kept + 1} of {N // BS}\b", msg), msg

    command = shlex.split(msg.split("continue with: ", 1)[1])
    assert command[-1] == "--resume" and command.count("--resume") == 1, command
    done = subprocess.run(command + ["--json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["resumed_from_batch"] >= 2
    assert out.read_bytes() == whole
    assert not partial.exists() and not Path(f"{out}.partial.json").exists()
