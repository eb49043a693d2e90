"""Where the suite's Numba compiles go: `HEPTI_TEST_COMPILE_LOG=DIR bin/test` puts this folder
first on PYTHONPATH, so every Python process of the run (pytest, tests/warm.py, the forked
`hepti` commands, mpiexec's ranks, the processes `hepti emulate` starts) imports it at start-up.
It logs each new overload of a Numba dispatcher to DIR/c-PID.jsonl: the function, its type
signature, loaded from the on-disk cache or compiled, its wall and CPU seconds (exclusive of the
callees it compiled on the way), the process (pid, argv) and the test running (pytest's
PYTEST_CURRENT_TEST, which the test's subprocesses inherit). `python tests/compilelog_report.py
DIR` sums it up. It changes nothing else: without the variable it does nothing at all.

A module named sitecustomize is imported by the interpreter itself (site.py); Numba is patched
only once something imports numba.core.dispatcher, so a process that never uses Numba pays
nothing.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import json
import os
import sys
import time

LOG = os.environ.get("HEPTI_TEST_COMPILE_LOG")


def _patch(module) -> None:
    Dispatcher = module.Dispatcher
    plain = Dispatcher.compile
    nested: list[list[float]] = []  # per compile in progress: its callees' [wall, cpu]

    def compile(self, sig):
        hits, misses, had = (sum(self._cache_hits.values()), sum(self._cache_misses.values()),
                             len(self.overloads))
        nested.append([0.0, 0.0])
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return plain(self, sig)
        finally:
            wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
            inner = nested.pop()
            if nested:
                nested[-1][0] += wall
                nested[-1][1] += cpu
            if len(self.overloads) != had:  # a new overload: loaded or compiled
                rec = {"pid": os.getpid(), "argv": sys.argv[:6],
                       "test": os.environ.get("PYTEST_CURRENT_TEST", ""),
                       "fn": f"{self.py_func.__module__}.{self.py_func.__qualname__}",
                       "sig": str(sig), "cached": type(self._cache).__name__ != "NullCache",
                       "hit": sum(self._cache_hits.values()) > hits,
                       "miss": sum(self._cache_misses.values()) > misses,
                       "wall": wall - inner[0], "cpu": cpu - inner[1], "t": time.time()}
                with open(os.path.join(LOG, f"c-{os.getpid()}.jsonl"), "a") as f:
                    f.write(json.dumps(rec) + "\n")
    Dispatcher.compile = compile


class _OnImport(importlib.abc.MetaPathFinder):
    """Patch numba.core.dispatcher right after it is first imported."""

    def find_spec(self, name, path, target=None):
        if name != "numba.core.dispatcher":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)
        spec.loader.exec_module = exec_module
        return spec


if LOG:
    os.makedirs(LOG, exist_ok=True)
    sys.meta_path.insert(0, _OnImport())
