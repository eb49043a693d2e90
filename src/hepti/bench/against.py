"""`hepti bench against REV`: this tree's latency against commit REV's, interleaved.

A change to the runtime must not make it slower; on this shared machine that is only visible
when the two versions take turns. This checks REV out into a temporary git worktree, then for
each round runs every configuration once from each tree, the order of the trees alternating
between rounds and that of the configurations rotating (hepti.bench.harness; `hepti run --repeat
R --json`, the same venv, PYTHONPATH choosing the tree's src/), and reports per configuration
the median over rounds of each tree's median latency and their ratio (this tree / REV;
`paired_ratio`: the median of the rounds' ratios). Configurations: each model at 1 rank, and at
2 ranks with each of `--strategies`, on fixed-shape synthetic inputs
(hepti.bench.scaling.synthetic_input).
Writes results/against.json.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

from hepti.bench.harness import (ROOT, checkout, git_commit, hepti_cmd, interleave, launch,
                                 positive_int, result_doc, round_order, summarise, write_json)
from hepti.bench.registry import module_main
from hepti.bench.scaling import synthetic_input

TREES = ("this", "rev")


def run_once(src: Path, model_dir: str, inp, ranks: int, strategy: str | None, repeat: int) -> float:
    """One `hepti run --repeat R --json` from the tree whose src/ is `src`: its median latency."""
    cmd = hepti_cmd() + ["run", "--model", model_dir, inp[0], str(inp[1]), "--repeat", str(repeat), "--json"]
    if ranks > 1:
        cmd += ["--strategy", strategy]
    return launch(cmd, ranks=ranks if ranks > 1 else None, pythonpath=src).json()["latency_s"]["median"]


def add_arguments(ap) -> None:
    ap.add_argument("rev", help="the commit to compare against, e.g. HEAD~3 or cad4aac")
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ",
                    help="a model and its token count (default: weights/minilm-l6:128 and "
                         "weights/bert-base:256)")
    ap.add_argument("--strategies", default="rows,tensor", help="at 2 ranks (default %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--repeat", type=positive_int, default=10, help="timed runs inside each launch (default 10)")
    ap.add_argument("--out", default="results/against.json", help="default %(default)s")


def run(args) -> int:
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    cases = args.case or ["weights/minilm-l6:128", "weights/bert-base:256"]
    tmp = Path(tempfile.mkdtemp(prefix="hepti-against-"))
    configs = [(case, ranks, strategy) for case in cases
               for ranks, strategy in [(1, None)] + [(2, s) for s in args.strategies.split(",")]]
    try:
        inputs = {c: synthetic_input(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1]), tmp) for c in cases}
        with checkout(args.rev) as rev_src, \
                tqdm(total=args.rounds * len(configs) * 2, desc="against", unit="run", file=sys.stderr) as bar:
            trees = {"this": ROOT / "src", "rev": rev_src}

            def both(config, k):  # the two trees back to back, which first alternating
                case, ranks, strategy = config
                out = {}
                for tree in round_order(TREES, k):
                    out[tree] = run_once(trees[tree], case.rsplit(":", 1)[0], inputs[case], ranks,
                                         strategy, args.repeat)
                    bar.update(1)
                return out
            times = interleave(configs, args.rounds, both)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    print(f"{'case':40s} {'rev ms':>9s} {'this ms':>9s} {'this/rev':>9s}")
    for (case, ranks, strategy), per_round in times.items():
        key = f"{case} {ranks} {strategy or 'single'}"
        v = {tree: [r[tree] for r in per_round] for tree in TREES}
        fig = summarise(v, baseline="rev")
        a, b = fig["this"]["median"], fig["rev"]["median"]
        rows.append({"config": key, "this_s": v["this"], "rev_s": v["rev"], "median_this_s": a,
                     "median_rev_s": b, "ratio": fig["this"]["ratio"],
                     "paired_ratio": fig["this"]["paired_ratio"]})
        print(f"{key:40s} {b * 1e3:9.2f} {a * 1e3:9.2f} {fig['this']['ratio']:9.3f}")
    write_json(result_doc("against", git_commit(), rev=args.rev, rounds=args.rounds,
                          repeat=args.repeat, results=rows), args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
