"""Benchmarks. The batch scripts (bin/bench-*.sh) launch hepti as a user would, through these."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from hepti.emulate.command import find_mpiexec
from hepti.info import cpu_model


def hepti_cmd() -> list[str]:
    """hepti in this Python (the venv the bin/bench-*.sh scripts set up)."""
    return [sys.executable, "-m", "hepti"]


def mpiexec() -> str:
    """MPICH's mpiexec: next to this Python first, then on PATH (a clear error if neither)."""
    return find_mpiexec()


def run_cmd(cmd: list[str], timeout: float = 1800) -> str:
    """Run a command to the end; its stdout, or a RuntimeError with the command and the tail of
    its stderr."""
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    return p.stdout


def write_json(doc: dict, path, compact: bool = False) -> None:
    """A result file under results/ (its folder made if missing); `compact`: one line, for a
    file that keeps whole profiles (indented, GenEFlow's CNN grid came to 6.6 MB, 2.7 flat)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, separators=(",", ":")) if compact else json.dumps(doc, indent=2)
    Path(path).write_text(text + "\n")



def drop_stale(path, program: str, why: str) -> None:
    """Remove an earlier run's output that this run did not write again (a plot it could not
    draw, a table with nothing in it), saying so on stderr: left in place beside this run's
    JSON, it would read as this run's."""
    path = Path(path)
    if path.exists():
        path.unlink()
        print(f"{program}: removed {path}, an earlier run's: {why}", file=sys.stderr)

def git_commit() -> str | None:
    """The commit of the hepti tree being measured (with '+dirty' if its code, src/ bin/
    setup.py, has uncommitted changes; results/ written by earlier benchmarks do not count),
    or None outside a git checkout."""
    root = Path(__file__).resolve().parents[3]
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no",
                                "--", "src", "bin", "setup.py"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev.stdout.strip() + ("+dirty" if dirty else "")


def result_doc(benchmark: str, commit: str | None = None, **fields) -> dict:
    """The head every results/*.json shares (what ran, when, at which commit, on which
    machine: this project's machine is not always the same CPU), then fields. A long run
    passes the `commit` it took when it started (git_commit()); otherwise it is taken now."""
    return {"benchmark": benchmark, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "commit": commit or git_commit(),
            "machine": {"cores": os.cpu_count(), "cpu": cpu_model(), "node": os.uname().nodename},
            **fields}
