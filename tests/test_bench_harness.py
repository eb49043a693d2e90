"""The benchmark harness (hepti.bench.harness) and the registry behind `hepti bench NAME`.

The harness's interleaving order, medians and ratios against a known series; its launcher's
command lines and its errors; the result document's provenance. Every registered bench
explains itself (`--help`), `hepti bench --help` lists them all, and `hepti --help` imports
none of them.

    .venv/bin/python -m pytest tests/test_bench_harness.py
"""
from __future__ import annotations

import csv
import importlib
import io
import json
import pkgutil
import subprocess
import sys

import pytest

import hepti.bench
from hepti.bench import harness, registry
from helpers import hepti as hepti_cli  # the name hepti is the package here

ROOT_SRC = harness.ROOT / "src"

HELPERS = {"harness", "registry", "hetero_report"}  # modules of hepti.bench that are not benches


def test_interleave_rotates_the_order_round_by_round():
    calls = []
    out = harness.interleave(["a", "b", "c"], 4, lambda v, k: calls.append((k, v)) or f"{v}{k}")
    assert [v for _, v in calls] == list("abc" "bca" "cab" "abc")
    assert [k for k, _ in calls] == [0] * 3 + [1] * 3 + [2] * 3 + [3] * 3
    assert out == {"a": ["a0", "a1", "a2", "a3"], "b": ["b0", "b1", "b2", "b3"],
                   "c": ["c0", "c1", "c2", "c3"]}  # each variant's results in round order


def test_interleave_alternate_sweeps_forward_then_back():
    calls = []
    harness.interleave([0, 1, 2], 3, lambda v, k: calls.append(v), order=harness.alternate)
    assert calls == [0, 1, 2, 2, 1, 0, 0, 1, 2]


def test_interleave_advances_the_bar_once_a_run_and_refuses_no_rounds():
    class Bar:
        n = 0

        def update(self, k):
            self.n += k
    bar = Bar()
    harness.interleave(["a", "b"], 3, lambda v, k: None, bar)
    assert bar.n == 6
    with pytest.raises(ValueError, match="rounds must be 1 or more"):
        harness.interleave(["a"], 0, lambda v, k: None)


def test_summarise_medians_and_ratios_against_the_baseline():
    times = {"base": [1.0, 4.0, 2.0, 3.0, 10.0], "new": [0.5, 1.0, 1.0, 3.0, 4.0]}
    fig = harness.summarise(times, baseline="base")
    assert fig["base"] == {"median": 3.0, "runs": 5, "ratio": 1.0, "paired_ratio": 1.0}
    assert fig["new"]["median"] == 1.0 and fig["new"]["ratio"] == pytest.approx(1 / 3)
    # per-round ratios 0.5, 0.25, 0.5, 1.0, 0.4: their median, not the ratio of the medians
    assert fig["new"]["paired_ratio"] == pytest.approx(0.5)
    assert "ratio" not in harness.summarise(times)["new"]
    with pytest.raises(ValueError, match="baseline 'old' is not one of"):
        harness.summarise(times, baseline="old")


def test_command_puts_mpiexec_and_the_emulator_around_argv():
    argv = harness.hepti_cmd() + ["run", "--json"]
    assert harness.command(argv) == argv
    mpi = harness.command(argv, ranks=2)
    assert mpi[1:3] == ["-n", "2"] and mpi[3:] == argv and mpi[0].endswith("mpiexec")
    emu = harness.command(argv, ranks=2, spec="hostfiles/x.json", emulate=["--summary", "s.json"],
                          timeout=60)
    head = harness.hepti_cmd() + ["emulate", "--cluster", "hostfiles/x.json", "--summary", "s.json",
                                  "--timeout", "60", "--"]
    assert emu[:len(head)] == head and emu[len(head):] == mpi


def test_launch_reports_output_and_names_a_failed_command():
    ok = harness.launch([sys.executable, "-c", "import os; print(os.environ['HEPTI_X'])"],
                        env={"HEPTI_X": "42"})
    assert ok.rc == 0 and ok.stdout.strip() == "42" and ok.json() == 42
    assert ok.wall_s > 0 and len(ok.loadavg_1min) == 2
    bad = [sys.executable, "-c", "import sys; sys.stderr.write('it broke'); sys.exit(3)"]
    with pytest.raises(harness.LaunchError, match=r"failed \(exit 3\):\nit broke"):
        harness.launch(bad)
    assert harness.launch(bad, check=False).rc == 3
    with pytest.raises(harness.LaunchError, match="printed no JSON object"):
        harness.launch([sys.executable, "-c", "print('no')"]).json()
    with pytest.raises(harness.LaunchError, match="did not finish in 0.5 s"):
        harness.launch([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5)


def test_result_doc_carries_its_provenance(tmp_path):
    doc = harness.result_doc("x", rounds=3)
    assert doc["benchmark"] == "x" and doc["rounds"] == 3
    assert {"created", "commit", "machine", "command", "loadavg"} <= set(doc)
    assert len(doc["loadavg"]) == 3 and doc["machine"]["cores"] >= 1
    assert harness.result_doc("x", command="hepti bench x")["command"] == "hepti bench x"
    harness.write_json(doc, tmp_path / "r" / "x.json")
    assert json.loads((tmp_path / "r" / "x.json").read_text()) == doc
    harness.write_csv([{"a": 1, "b": None, "c": "dropped"}], ["a", "b"], tmp_path / "r" / "x.csv")
    assert list(csv.DictReader(io.StringIO((tmp_path / "r" / "x.csv").read_text()))) == [
        {"a": "1", "b": ""}]


def test_every_bench_module_is_registered_with_add_arguments_and_run():
    modules = {m.name for m in pkgutil.iter_modules(hepti.bench.__path__)} - HELPERS
    registered = {mod for mod, _ in registry.BENCHES.values()}
    assert modules == registered, "a bench module without a registry entry, or the reverse"
    for name in registry.BENCHES:
        mod = registry.module(name)
        assert callable(mod.add_arguments) and callable(mod.run), name
        assert registry.name_of(mod.__name__) == name


@pytest.mark.parametrize("name", list(registry.BENCHES))
def test_every_bench_explains_itself(name, capsys):
    with pytest.raises(SystemExit) as e:
        registry.main(name, ["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hepti bench {name}") and "options:" in out


def test_hepti_bench_lists_every_bench_and_dispatches(tmp_path):
    code, out, err = hepti_cli("bench", "--help", timeout=120)
    assert code == 0, err
    for name, (_, line) in registry.BENCHES.items():
        assert f"    {name}" in out, name
    code, _, err = hepti_cli("bench", "solver", "--devices", "x", timeout=120)
    assert code == 2
    assert "hepti bench solver: error: --devices 'x': give cluster sizes like 2,4,8,16,32" in err
    code, _, err = hepti_cli("bench", "solver", "--rounds", "0", timeout=120)
    assert code == 2 and "0 must be at least 1" in err


def test_hepti_help_imports_no_bench():
    code = ("import sys; from hepti import cli; cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.startswith('hepti.bench.')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout.replace("'", '"')) == ["hepti.bench.registry"]


def test_import_tree_renames_every_absolute_import(tmp_path):
    """`hepti bench against --in-process` imports a tree's package under another name: every
    module of the copy must resolve to the copy, none to this tree's hepti."""
    from hepti.bench.against import import_tree
    pkg = import_tree(ROOT_SRC, "hepti_copy_under_test", tmp_path)
    try:
        mod = importlib.import_module("hepti_copy_under_test.bench.against")
        assert mod.__file__.startswith(str(tmp_path))
        assert mod.round_order.__module__ == "hepti_copy_under_test.bench.harness"
        assert pkg.__file__.startswith(str(tmp_path))
    finally:
        sys.path.remove(str(tmp_path))
        for name in [m for m in sys.modules if m.startswith("hepti_copy_under_test")]:
            del sys.modules[name]
