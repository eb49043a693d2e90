"""tests/warm.py, the cache warmer bin/test runs beside pytest: the data files it writes take
numbers no other process takes, and a process without its numbering loads what it compiled."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from helpers import ROOT

WARM = ROOT / "tests" / "warm.py"

KERNEL = """
from numba import njit

@njit(cache=True)
def twice(x):
    return 2 * x
"""

# imports tests/warm.py by path, numbers this process's cache files as bin/test's warmer does
# when WARM is set, then compiles or loads both signatures and says which it loaded
RUN = """
import importlib.util, os, sys
sys.path.insert(0, sys.argv[1])
if os.environ.get("WARM"):
    spec = importlib.util.spec_from_file_location("warm", sys.argv[2])
    warm = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(warm)
    assert warm.own_numbers()
import kernel
print(kernel.twice(3), kernel.twice(1.5), len(kernel.twice.stats.cache_hits))
"""


def _run(tmp_path: Path, warm: bool) -> str:
    env = {"PATH": "/usr/bin:/bin", **({"WARM": "1"} if warm else {})}
    p = subprocess.run([sys.executable, "-c", RUN, str(tmp_path), str(WARM)], env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    return p.stdout.split()


def test_warm_numbers_its_files_apart_and_others_load_them(tmp_path):
    (tmp_path / "kernel.py").write_text(textwrap.dedent(KERNEL))
    assert _run(tmp_path, warm=True) == ["6", "3.0", "0"]  # compiled, saved
    names = sorted(p.name.split(".")[-2] for p in (tmp_path / "__pycache__").glob("*.nbc"))
    assert names == ["1001", "1002"]
    assert _run(tmp_path, warm=False) == ["6", "3.0", "2"]  # both loaded by a plain process


def test_steps_and_bad_arguments():
    p = subprocess.run([sys.executable, str(WARM), "--list"], capture_output=True, text=True)
    assert p.returncode == 0 and {"cnn", "int8", "models", "bert"} <= set(p.stdout.split())
    p = subprocess.run([sys.executable, str(WARM), "gpu"], capture_output=True, text=True)
    assert p.returncode == 2 and "unknown step gpu" in p.stderr
