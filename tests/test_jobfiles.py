"""The files a killed MPI job leaves (hepti.emulate.jobfiles): which are told apart as leftovers
(fake files in a temporary directory: none held, one open, one mapped, a serve directory whose
front end is gone), and that the launchers remove a real killed job's files: hepti serve's
supervisor after a `kill -9` of a rank and at stop, `hepti emulate` at teardown (root), and
`hepti emulate --cleanup` (root).

Other jobs may run on this machine at the same time, and older hepti versions leave files too,
so the real-job tests do not count /dev/shm: they note the files their own job's processes hold
while it runs and check that exactly those are gone afterwards."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hepti.emulate import jobfiles
from test_distributed_launch import mpiexec
from test_emulate import SRC, _write, root_env  # noqa: F401 - the fixture: root, MPICH, no leftovers


@pytest.fixture
def fake_dirs(tmp_path, monkeypatch):
    """jobfiles looks in tmp_path/shm and tmp_path/tmp instead of /dev/shm and /tmp."""
    shm, tmp = tmp_path / "shm", tmp_path / "tmp"
    shm.mkdir()
    tmp.mkdir()
    monkeypatch.setattr(jobfiles, "SHM_DIR", shm)
    monkeypatch.setattr(jobfiles, "TMP_DIR", tmp)
    monkeypatch.setattr(jobfiles.tempfile, "tempdir", str(tmp))
    return shm, tmp


HOLD = """import mmap, os, sys
f = open(sys.argv[1], "r+b")
if sys.argv[2] == "map":  # mapped, descriptor closed: as an MPICH rank keeps its segment
    m = mmap.mmap(f.fileno(), 0)
    f.close()
print("held", flush=True)
sys.stdin.read()
"""


def _holder(path: Path, how: str) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(path), how], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_unheld_files_are_leftovers_and_held_ones_are_not(fake_dirs):
    shm, tmp = fake_dirs
    for name in ("mpich_shm_1a2b_0", "mpich_shm_1a2b_1", "mpich_shm_3c4d_0", "other_file"):
        (shm / name).write_bytes(b"\0" * 4096)
    (tmp / "hydra_hwloc_xmlfile_AbC123").write_text("<topology/>")
    ours = tmp / (jobfiles.serve_dir_prefix() + "x1")  # this process runs: held
    gone = tmp / (jobfiles.serve_dir_prefix(_dead_pid()) + "x2")
    for d in (ours, gone):
        d.mkdir()
        (d / "hostfile-1").write_text("10.0.0.1:1\n")
    holders = [_holder(shm / "mpich_shm_1a2b_1", "open"), _holder(shm / "mpich_shm_3c4d_0", "map")]
    try:
        found = {f.path.name for f in jobfiles.leftovers()}
        assert found == {"mpich_shm_1a2b_0", "hydra_hwloc_xmlfile_AbC123", gone.name}, found
        removed = jobfiles.sweep()
        assert len(removed) == 3 and any("mpich_shm_1a2b_0" in r for r in removed), removed
        assert sorted(os.listdir(shm)) == ["mpich_shm_1a2b_1", "mpich_shm_3c4d_0", "other_file"]
        assert sorted(os.listdir(tmp)) == [ours.name]
    finally:
        for p in holders:
            p.communicate("")
    assert {f.path.name for f in jobfiles.leftovers()} == {"mpich_shm_1a2b_1", "mpich_shm_3c4d_0"}


def test_a_snapshot_keeps_older_files(fake_dirs):
    shm, tmp = fake_dirs
    (shm / "mpich_shm_old_0").write_bytes(b"\0")
    before = jobfiles.snapshot()
    (shm / "mpich_shm_new_0").write_bytes(b"\0")
    (tmp / "hydra_hwloc_xmlfile_New").write_text("x")
    assert [Path(r.split()[-1]).name for r in jobfiles.sweep(before)] == [
        "mpich_shm_new_0", "hydra_hwloc_xmlfile_New"]
    assert os.listdir(shm) == ["mpich_shm_old_0"]


def test_the_command_line_sweeps_since_a_snapshot_file(fake_dirs, tmp_path, capsys):
    """bin/test's use: `python -m hepti.emulate.jobfiles snapshot F`, jobs, `... sweep --since F`."""
    shm, _ = fake_dirs
    (shm / "mpich_shm_old_0").write_bytes(b"\0")
    jobfiles.main(["snapshot", str(tmp_path / "before.json")])
    (shm / "mpich_shm_new_0").write_bytes(b"\0")
    jobfiles.main(["sweep", "--since", str(tmp_path / "before.json")])
    assert capsys.readouterr().out == f"removed MPICH shared memory {shm}/mpich_shm_new_0\n"
    assert os.listdir(shm) == ["mpich_shm_old_0"]


def _job_files(pids: list[int]) -> set[str]:
    """The MPICH and Hydra files these processes (ranks) and their parents (Hydra's proxies)
    hold open or mapped."""
    held = set()
    for pid in pids:
        ppid = int(next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                        if line.startswith("PPid:")))
        for p in (pid, ppid):
            for fd in Path(f"/proc/{p}/fd").iterdir():
                try:
                    held.add(os.readlink(fd))
                except OSError:
                    pass
            held |= {line[line.index("/"):] for line in Path(f"/proc/{p}/maps").read_text().splitlines()
                     if "/" in line}
    return {h for h in held if Path(h).name.startswith(("mpich_", "hydra_hwloc_xmlfile_"))}


def test_serve_removes_what_a_killed_rank_left(tiny_dir):
    """kill -9 of a worker rank: the relaunch finds the old job's /dev/shm segment gone (MPICH
    would have left it), and at stop the second job's files and the temporary directory go."""
    mpiexec()
    from hepti.serve.supervisor import Supervisor
    sup = Supervisor(tiny_dir, 2, worker_args=["--strategy", "tensor"]).start()
    try:
        sup.embed([[2, 5, 7]])
        first = _job_files([r["pid"] for r in sup.ranks])
        # what MPICH makes for 2 ranks on one machine: a segment, and the proxy's topology file
        assert any("/dev/shm/mpich_shm_" in f for f in first), first
        assert any("/tmp/hydra_hwloc_xmlfile_" in f for f in first), first
        # while the job runs, none of its files is a leftover: the sweep would leave them
        assert not first & {str(f.path) for f in jobfiles.leftovers()}
        os.kill(sup.ranks[1]["pid"], signal.SIGKILL)
        sup.embed([[3, 4]])  # answered by the relaunched job (one rank)
        assert sup.epoch == 2
        assert not [f for f in first if os.path.exists(f)], "left by the killed job"
        second = _job_files([r["pid"] for r in sup.ranks])
    finally:
        sup.stop()
    assert not [f for f in second if os.path.exists(f)]
    assert not os.path.exists(sup._tmp.name)


PROBE = """import json, os, sys, time
from mpi4py import MPI
sys.path.insert(0, os.environ["HEPTI_SRC"])
comm = MPI.COMM_WORLD
with open(f"{sys.argv[1]}.{comm.rank}.tmp", "w") as f:
    json.dump(os.getpid(), f)
os.replace(f"{sys.argv[1]}.{comm.rank}.tmp", f"{sys.argv[1]}.{comm.rank}")
time.sleep(120)
"""


def test_emulate_teardown_removes_what_the_killed_job_left(root_env, tmp_path):  # noqa: F811
    """Ctrl-C twice (no grace period) under `hepti emulate`: the teardown SIGKILLs the ranks and
    Hydra's proxies, whose /dev/shm segments and /tmp topology files then go with the run."""
    spec = _write(tmp_path, "two.json", {"name": "test-files", "devices": [
        {"name": "a", "cpu": 0.3, "link_mbit": 100}, {"name": "b", "cpu": 0.3, "link_mbit": 100}]})
    probe, out = tmp_path / "probe.py", tmp_path / "pid"
    probe.write_text(PROBE)
    code = (f"import sys; sys.path.insert(0, {str(SRC)!r})\nfrom hepti.emulate.launch import run_emulated\n"
            f"sys.exit(run_emulated({str(spec)!r}, ['mpiexec', '-n', '2', sys.executable, "
            f"{str(probe)!r}, {str(out)!r}], idle_fill=False))")
    p = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "HEPTI_SRC": str(SRC)})
    try:
        deadline = time.monotonic() + 120
        while not all(Path(f"{out}.{r}").exists() for r in (0, 1)):
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()
            time.sleep(0.2)
        files = _job_files([json.loads(Path(f"{out}.{r}").read_text()) for r in (0, 1)])
        assert any("hydra_hwloc_xmlfile_" in f for f in files), files
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)  # again: SIGKILL at once
        assert p.wait(60) == 130
    finally:
        if p.poll() is None:
            p.kill()
    err = p.stderr.read()
    left = [f for f in files if os.path.exists(f)]
    assert not left, f"left by the killed job: {left}\n{err[-2000:]}"


def test_emulate_cleanup_reports_and_removes_orphans(root_env, fake_dirs):  # noqa: F811
    """`hepti emulate --cleanup` finds what no one holds: a segment, a topology file, and a
    serve directory whose front end is gone; a held segment stays."""
    from hepti.emulate.leftovers import cleanup
    shm, tmp = fake_dirs
    (shm / "mpich_shm_dead_0").write_bytes(b"\0" * (3 << 20))
    (shm / "mpich_shm_live_0").write_bytes(b"\0")
    (tmp / "hydra_hwloc_xmlfile_Zz9").write_text("x")
    stale = tmp / (jobfiles.serve_dir_prefix(_dead_pid()) + "abc")
    stale.mkdir()
    holder = _holder(shm / "mpich_shm_live_0", "map")
    try:
        removed = cleanup()
    finally:
        holder.communicate("")
    assert f"MPICH shared memory {shm}/mpich_shm_dead_0, 3.0 MiB" in removed, removed
    assert f"Hydra topology file {tmp}/hydra_hwloc_xmlfile_Zz9" in removed
    assert f"hepti serve directory {stale}" in removed
    assert os.listdir(shm) == ["mpich_shm_live_0"] and os.listdir(tmp) == []
