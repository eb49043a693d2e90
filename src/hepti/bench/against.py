"""`python -m hepti.bench.against REV`: this tree's latency against commit REV's, interleaved.

A change to the runtime must not make it slower; on this shared machine that is only visible
when the two versions take turns. This checks REV out into a temporary git worktree, then for
each round runs every configuration once from each tree, the order of the trees alternating
between rounds (`hepti run --repeat R --json`, the same venv, PYTHONPATH choosing the tree's
src/), and reports per configuration the median over rounds of each tree's median latency and
their ratio (this tree / REV). Configurations: each model at 1 rank, and at 2 ranks with each of
`--strategies`, on fixed-shape synthetic inputs (hepti.bench.scaling.synthetic_input).
Writes results/against.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from hepti.bench import git_commit, mpiexec, result_doc, write_json
from hepti.bench.scaling import synthetic_input

ROOT = Path(__file__).resolve().parents[3]


def run_once(src: Path, model_dir: str, inp, ranks: int, strategy: str | None, repeat: int) -> float:
    cmd = [sys.executable, "-m", "hepti", "run", "--model", model_dir, inp[0], str(inp[1]),
           "--repeat", str(repeat), "--json"]
    if ranks > 1:
        cmd = [mpiexec(), "-n", str(ranks)] + cmd + ["--strategy", strategy]
    env = dict(os.environ, PYTHONPATH=str(src))
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (PYTHONPATH={src}) failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)["latency_s"]["median"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rev", help="the commit to compare against, e.g. HEAD~3 or cad4aac")
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ",
                    help="a model and its token count (default: weights/minilm-l6:128 and "
                         "weights/bert-base:256)")
    ap.add_argument("--strategies", default="rows,tensor")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default="results/against.json")
    args = ap.parse_args(argv)
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    cases = args.case or ["weights/minilm-l6:128", "weights/bert-base:256"]
    tmp = Path(tempfile.mkdtemp(prefix="hepti-against-"))
    old = tmp / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(old), args.rev],
                   check=True, capture_output=True)
    trees = {"this": ROOT / "src", "rev": old / "src"}
    configs = [(1, None)] + [(2, s) for s in args.strategies.split(",")]
    total = args.rounds * len(cases) * len(configs) * 2
    times: dict = {}
    try:
        with tqdm(total=total, desc="against", unit="run", file=sys.stderr) as bar:
            inputs = {c: synthetic_input(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1]), tmp)
                      for c in cases}
            for k in range(args.rounds):
                order = ("this", "rev") if k % 2 == 0 else ("rev", "this")
                for case in cases:
                    model_dir = case.rsplit(":", 1)[0]
                    for ranks, strategy in configs:
                        key = f"{case} {ranks} {strategy or 'single'}"
                        for tree in order:
                            t = run_once(trees[tree], model_dir, inputs[case], ranks, strategy,
                                         args.repeat)
                            times.setdefault(key, {"this": [], "rev": []})[tree].append(t)
                            bar.update(1)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                       capture_output=True)
    rows = []
    print(f"{'case':40s} {'rev ms':>9s} {'this ms':>9s} {'this/rev':>9s}")
    for key, v in times.items():
        a, b = statistics.median(v["this"]), statistics.median(v["rev"])
        rows.append({"config": key, "this_s": v["this"], "rev_s": v["rev"], "median_this_s": a,
                     "median_rev_s": b, "ratio": a / b})
        print(f"{key:40s} {b * 1e3:9.2f} {a * 1e3:9.2f} {a / b:9.3f}")
    write_json(result_doc("against", git_commit(), rev=args.rev, rounds=args.rounds,
                          repeat=args.repeat, results=rows), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
