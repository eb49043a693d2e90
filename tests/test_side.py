"""tests/side.txt, the files bin/test runs in its second pytest (nice 19, on the second core):
each is there, and none starts a process or reads a clock (a test that did could be failed by
the starvation a nice-19 process meets, or would load the machine under the first stream's
timed tests)."""
from __future__ import annotations

import ast

from helpers import ROOT

SIDE = ROOT / "tests" / "side.txt"
# what starts a process, waits or times: no side file imports these modules or uses these names
# (helpers' hepti() and launch helpers start processes; hypothesis must keep deadline=None)
BANNED_MODULES = {"subprocess", "multiprocessing", "forkrun", "time", "signal", "socket", "threading"}
BANNED_NAMES = {"Popen", "hepti", "mpiexec", "launch", "launch_cases", "launch_scripts", "sleep",
                "monotonic", "perf_counter", "wait_for", "serve_emulated", "fork", "system"}


def side_files() -> list[str]:
    return [ln.strip() for ln in SIDE.read_text().splitlines()
            if ln.strip() and not ln.startswith("#")]


def test_the_side_files_exist_once_each_and_are_test_files():
    files = side_files()
    assert files and len(files) == len(set(files)), files
    for f in files:
        assert f.startswith("tests/test_") and f.endswith(".py") and "/mpi/" not in f, f
        assert (ROOT / f).is_file(), f"{f} is named in tests/side.txt but is not there"


def test_no_side_file_starts_a_process_or_reads_a_clock():
    for f in side_files():
        tree = ast.parse((ROOT / f).read_text())
        used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        modules = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                modules.add((node.module or "").split(".")[0])
                used |= {a.asname or a.name for a in node.names}
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                    "given" in ast.unparse(d) for d in node.decorator_list):
                assert any("deadline=None" in ast.unparse(d) for d in node.decorator_list), \
                    f"{f}::{node.name}: a hypothesis deadline can fail a starved process"
        bad = sorted((modules & BANNED_MODULES) | (used & BANNED_NAMES))
        assert not bad, f"{f} uses {bad}: move it out of tests/side.txt (bin/test's nice-19 stream)"
