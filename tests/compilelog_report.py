"""Sum up a compile log (tests/compilelog/sitecustomize.py): `python tests/compilelog_report.py
DIR [--top N]`. CPU seconds throughout (a loaded machine stretches wall time, not CPU time)."""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re

LITERAL = re.compile(r"Literal\[(int|bool)\]\([^)]*\)")


def kind(rec: dict) -> str:
    """Which process: pytest, the warmer, or the `hepti` command (its subcommand)."""
    argv = " ".join(rec["argv"])
    if "pytest" in argv:
        return "pytest"
    if "warm.py" in argv:
        return "tests/warm.py"
    if rec["argv"] and rec["argv"][0].endswith(os.path.join("hepti", "__main__.py")):
        return "hepti " + " ".join(rec["argv"][1:2])
    return argv[:60]


def plain(sig: str) -> str:
    """The signature with each literal constant's type in place of the constant."""
    return LITERAL.sub(lambda m: "int64" if m.group(1) == "int" else "bool", sig)


def report(folder: str, top: int = 25) -> str:
    recs = [json.loads(line) for f in sorted(glob.glob(os.path.join(folder, "c-*.jsonl")))
            for line in open(f)]
    for r in recs:  # an older log: wall time only
        r.setdefault("cpu", r.get("excl", 0.0))
    made = [r for r in recs if r["miss"]]
    loaded = [r for r in recs if r["hit"]]
    out = [f"{len(recs)} overloads in {len({r['pid'] for r in recs})} processes: "
           f"{len(made)} compiled ({sum(r['cpu'] for r in made):.0f} s CPU), "
           f"{len(loaded)} loaded from the cache ({sum(r['cpu'] for r in loaded):.1f} s)"]
    by_kind = collections.defaultdict(lambda: [0, 0.0, set()])
    for r in made:
        k = by_kind[kind(r)]
        k[0] += 1
        k[1] += r["cpu"]
        k[2].add(r["pid"])
    out.append("compiled, by process: signatures, CPU s, processes")
    out += [f"  {n:5d} {s:7.1f} {len(p):4d}  {k}" for k, (n, s, p) in
            sorted(by_kind.items(), key=lambda x: -x[1][1])[:top]]
    first = collections.defaultdict(list)
    for r in sorted(made, key=lambda r: r["t"]):
        first[(r["fn"], r["sig"])].append(r)
    # a function without cache=True (Numba's own overloads) compiles in each process anyway
    again = [x for v in first.values() for x in v[1:] if x.get("cached", True)]
    out.append(f"compiled again, cache=True functions (one signature in two processes, or twice): "
               f"{len(again)} times, "
               f"{sum(r['cpu'] for r in again):.0f} s CPU; by the process that did it again: "
               + ", ".join(f"{k} {s:.0f} s" for k, s in collections.Counter(
                   {k: sum(r['cpu'] for r in again if kind(r) == k) for k in {kind(r) for r in again}}).most_common(6)))
    groups = collections.defaultdict(list)
    for (fn, sig), v in first.items():
        groups[(fn, plain(sig))].append(v[0]["cpu"])
    extra = sum(sum(v) - max(v) for v in groups.values())
    out.append(f"distinct signatures {len(first)} ({sum(v[0]['cpu'] for v in first.values()):.0f} s "
               f"CPU once each); {len(first) - len(groups)} of them differ from another only in "
               f"literal constants ({extra:.0f} s CPU beyond one per group)")
    per_fn = collections.defaultdict(lambda: [0, 0.0])
    for (fn, _), v in first.items():
        per_fn[fn][0] += 1
        per_fn[fn][1] += v[0]["cpu"]
    out.append("by function: signatures, CPU s (once each)")
    out += [f"  {n:4d} {s:7.1f}  {fn}" for fn, (n, s) in sorted(per_fn.items(), key=lambda x: -x[1][1])[:top]]
    per_test = collections.defaultdict(float)
    for r in made:
        per_test[(r["test"].rsplit(" (", 1)[0] or "(no test)", "pytest" if kind(r) == "pytest" else
                  "warm" if kind(r) == "tests/warm.py" else "subprocess")] += r["cpu"]
    out.append("by test: CPU s compiling, in which process")
    out += [f"  {s:7.1f} {where:10s} {t}" for (t, where), s in sorted(per_test.items(), key=lambda x: -x[1])[:top]]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("folder")
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    print(report(a.folder, a.top))


if __name__ == "__main__":
    main()
