"""hepti's layers import one way (docs/architecture.md).

Every module's imports are read with `ast`, those inside functions included, and checked against
four rules:

- `layer`: a module imports only from its own layer or from layers below it (`LAYERS`, lowest
  first; layers of the same rank, such as kernels and the emulator, do not import each other);
- `cycle`: no two modules import each other, directly or through others;
- `local`: an import inside a function (kept there for an optional dependency, for start-up time
  or for a side effect at import, such as MPI_Init) says why in a comment on its line.
- `mpi`: mpi4py (whose import starts MPI) is imported from the parallel layer and above only.

    .venv/bin/python -m pytest tests/test_layers.py
"""
from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parent.parent / "src"

# Lowest first: (rank, layer, module patterns). A pattern ending in ".*" is a package and its
# modules; the most specific pattern wins (hepti.parallel's plans, engine and distributed are the
# job's, the rest of hepti.parallel is not).
LAYERS = [
    (0, "base", ["hepti", "hepti.errors", "hepti.counts", "hepti.resources"]),
    (1, "kernels", ["hepti.kernels.*"]),
    (1, "emulate", ["hepti.emulate.*"]),
    (2, "graph", ["hepti.graph.*", "hepti.config"]),
    # the family registry sees configs, graph builders and each family's own operators; the
    # graph loader opens a model folder through it
    (3, "model", ["hepti.model.*", "hepti.inputs", "hepti.images", "hepti.families",
                  "hepti.graph.load"]),
    # operator order reads the graph alone (opdag); the planner, the job and `hepti order` read it
    (3, "order", ["hepti.order.*"]),
    (4, "weights", ["hepti.weights.*"]),
    (5, "plan", ["hepti.plan.*"]),
    (6, "parallel", ["hepti.parallel.*", "hepti.info"]),
    (7, "job", ["hepti.runner", "hepti.output", "hepti.parallel.plans", "hepti.parallel.engine",
                "hepti.parallel.distributed", "hepti.generate"]),
    (8, "serve", ["hepti.serve.*"]),
    (9, "bench", ["hepti.bench.*"]),  # it measures the service, too (bench/stall, bench/serve)
    (10, "cli", ["hepti.cli", "hepti.__main__"]),
]
MPI_FROM_RANK = 6  # the parallel layer: kernels, graph, model, weights and plan never start MPI



@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module (hepti's own resolved to a module; others by top name)
    line: int
    local: bool  # inside a function
    commented: bool  # a comment on one of its lines


def modules() -> dict[str, Path]:
    out = {}
    for p in sorted((SRC / "hepti").rglob("*.py")):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


def _resolve(name: str, mods) -> str:
    while name not in mods and "." in name:
        name = name.rpartition(".")[0]
    return name


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import statement of every module, one entry per imported module."""
    found = []
    for mod, path in mods.items():
        text = path.read_text()
        lines = text.splitlines()
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]

        def commented(node) -> bool:
            return any("#" in ln for ln in lines[node.lineno - 1:node.end_lineno])

        def visit(node, local: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.Import):
                    for a in child.names:
                        t = _resolve(a.name, mods) if a.name.split(".")[0] == "hepti" else a.name
                        found.append(Import(mod, t, child.lineno, local, commented(child)))
                elif isinstance(child, ast.ImportFrom):
                    base = child.module or ""
                    if child.level:
                        up = package.split(".")[:len(package.split(".")) - child.level + 1]
                        base = ".".join(up + ([base] if base else []))
                    if base.split(".")[0] != "hepti":
                        found.append(Import(mod, base, child.lineno, local, commented(child)))
                        continue
                    targets = {(f"{base}.{a.name}" if f"{base}.{a.name}" in mods
                                else _resolve(base, mods)) for a in child.names}
                    for t in sorted(targets):
                        found.append(Import(mod, t, child.lineno, local, commented(child)))
                visit(child, local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef,
                                                           ast.Lambda)))
        visit(ast.parse(text, str(path)), False)
    return found


def layer_of(mod: str) -> tuple[int, str]:
    best, size = None, -1
    for rank, name, patterns in LAYERS:
        for pat in patterns:
            hit = (mod == pat[:-2] or mod.startswith(pat[:-1])) if pat.endswith(".*") else mod == pat
            if hit and len(pat) > size:
                best, size = (rank, name), len(pat)
    if best is None:
        raise AssertionError(f"{mod} is in no layer: add it to LAYERS in tests/test_layers.py "
                             "and to docs/architecture.md")
    return best


def cycles(edges: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each as a closed path."""
    index, low, stack, on, out, n = {}, {}, [], set(), [], [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, {}):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(_path(edges, set(comp)))

    for v in sorted(edges):
        if v not in index:
            strong(v)
    return out


def _path(edges, comp: set[str]) -> list[str]:
    """A closed path through a strongly connected component, from its first module back to it."""
    start = min(comp)
    prev, queue = {start: None}, [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(edges.get(v, {})):
            if w == start:
                path = [v]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return list(reversed(path)) + [start]
            if w in comp and w not in prev:
                prev[w] = v
                queue.append(w)
    return sorted(comp)


def violations(imps: list[Import]) -> list[tuple[Import, str, str]]:
    """(import, rule, why) for every import against the rules."""
    out = []
    for imp in imps:
        rank, layer = layer_of(imp.module)
        if imp.target.split(".")[0] == "hepti" and imp.target != imp.module:
            t_rank, t_layer = layer_of(imp.target)
            if t_layer != layer and t_rank >= rank:
                out.append((imp, "layer", f"layer {layer} ({rank}) imports layer {t_layer} "
                                          f"({t_rank}); a layer imports only layers below it"))
        if imp.target.split(".")[0] == "mpi4py" and rank < MPI_FROM_RANK:
            out.append((imp, "mpi", f"layer {layer} imports mpi4py; MPI starts in the parallel "
                                    "layer and above"))
        if imp.local and not imp.commented:
            out.append((imp, "local", "an import inside a function, with no comment on its line "
                                      "saying why (optional dependency, start-up time, MPI_Init); "
                                      "move it to the module's top or say why"))
    return out


@pytest.fixture(scope="module")
def found():
    mods = modules()
    return mods, imports(mods)


def test_every_module_has_a_layer(found):
    mods, _ = found
    for mod in mods:
        layer_of(mod)


def test_no_import_cycles(found):
    _, imps = found
    edges: dict[str, dict[str, int]] = {}
    for imp in imps:
        if imp.target.split(".")[0] == "hepti" and imp.target != imp.module:
            edges.setdefault(imp.module, {}).setdefault(imp.target, imp.line)
    found_cycles = cycles(edges)
    text = ["cycle: " + " -> ".join(f"{a} (line {edges[a][b]})" for a, b in zip(c, c[1:]))
            + f" -> {c[-1]}" for c in found_cycles]
    assert not found_cycles, "modules import each other (rule `cycle`):\n" + "\n".join(text)


def test_imports_run_one_way(found):
    _, imps = found
    text = [f"{i.module} line {i.line}: imports {i.target}: rule `{rule}`: {why}"
            for i, rule, why in violations(imps)]
    assert not text, "\n".join(text)


def test_the_checker_sees_a_cycle_and_an_upward_import():
    """The rules themselves: a hand-made cycle and an upward import are caught, with the
    importing module, its line and the rule in the message."""
    edges = {"hepti.graph.a": {"hepti.graph.b": 3}, "hepti.graph.b": {"hepti.graph.a": 7}}
    assert cycles(edges) == [["hepti.graph.a", "hepti.graph.b", "hepti.graph.a"]]
    up = Import("hepti.graph.lower", "hepti.plan.costmodel", 17, False, False)
    (imp, rule, why), = violations([up])
    assert (imp.line, rule) == (17, "layer") and "layer graph (2) imports layer plan (5)" in why
    side = Import("hepti.kernels.conv", "hepti.emulate.stretch", 5, False, False)
    assert [r for _, r, _ in violations([side])] == ["layer"]
    local = Import("hepti.plan.lp", "scipy", 9, True, False)
    assert [r for _, r, _ in violations([local])] == ["local"]
    assert violations([Import("hepti.plan.lp", "scipy", 9, True, True)]) == []
    assert [r for _, r, _ in violations([Import("hepti.plan.lp", "mpi4py", 2, False, False)])] \
        == ["mpi"]


def _stats(imps):  # pragma: no cover - for the report: `python tests/test_layers.py`
    own = [i for i in imps if i.target.split(".")[0] == "hepti"]
    stmts = {(i.module, i.line, i.local) for i in own}
    return (f"{len(stmts)} import statements of hepti's own modules, "
            f"{sum(1 for s in stmts if s[2])} inside functions; "
            f"{len({(i.module, i.line) for i in imps if i.local})} statements inside functions "
            "in all")


if __name__ == "__main__":  # pragma: no cover
    mods = modules()
    imps = imports(mods)
    print(_stats(imps))
    for i, rule, why in violations(imps):
        print(f"{i.module} line {i.line}: {i.target}: {rule}")
    edges: dict = {}
    for i in imps:
        if i.target.split(".")[0] == "hepti" and i.target != i.module:
            edges.setdefault(i.module, {}).setdefault(i.target, i.line)
    for c in cycles(edges):
        print("cycle:", " -> ".join(c))
