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

`--in-process` times the 1-rank configurations in this one process instead: REV's src/hepti is
copied as the package `hepti_rev` (its absolute imports renamed; `import_tree`) and imported
beside this tree's, each model is built once in each tree, and every round runs one forward
from each, the order alternating. Launches differ by several percent on this machine (where
the process lands, what else runs); forwards in one process differ by much less, so a change
of a few percent in a kernel shows. Each tree compiles its kernels first (minutes on a cold
cache). The outputs are checked to agree (`--in-process` reports max |this - rev| / max |rev|).
Writes results/against.json.
"""
from __future__ import annotations

import importlib
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import hepti
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


def import_tree(src: Path, name: str, into: Path):
    """Tree `src`'s package hepti, copied into `into`/`name` with its absolute imports of hepti
    renamed to `name`, imported (hepti's modules import one another only absolutely)."""
    dst = into / name
    shutil.copytree(src / "hepti", dst, ignore=shutil.ignore_patterns("__pycache__"))
    pat = re.compile(r"\b(from|import) hepti\b")
    for f in dst.rglob("*.py"):
        text = f.read_text()
        f.write_text(pat.sub(lambda m: f"{m.group(1)} {name}", text))
    sys.path.insert(0, str(into))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def forward_fn(pkg, model_dir: str, inp: tuple[str, Path]):
    """A one-thread forward of the model in `model_dir` on the input file `inp` (from
    synthetic_input), built with package `pkg` (hepti or a tree's copy): () -> its output."""
    def imp(mod: str):
        return importlib.import_module(f"{pkg.__name__}.{mod}")
    store = imp("weights").WeightStore(model_dir)
    cfg = store.config
    engine = imp("parallel.single").SINGLE[imp("families").family(cfg).executor].from_store(store, threads=1)
    if inp[0] == "--input-pixels":
        pixels = np.load(inp[1])
        if hasattr(engine, "forward"):  # a CNN: the logits
            return lambda: engine.forward(pixels)
        batch = imp("model.batch").Batch(None, np.ones((1, engine.config.seq_len), np.int64), None, pixels)
    else:
        z = np.load(inp[1])
        batch = imp("model.batch").Batch(z["ids"], z["mask"], np.zeros_like(z["ids"]))
    return lambda: engine.run(batch)


def run_in_process(args, cases, inputs, rev_src: Path, tmp: Path) -> tuple[dict, dict]:
    """Per case, the two trees' forwards in this process, taking turns: ({(case, 1, None):
    [{tree: s}] by round}, {case: max |this - rev| / max |rev|})."""
    from tqdm import tqdm  # local: start-up time
    import numba  # local: start-up time (numba loads in about 0.5 s)
    numba.set_num_threads(1)
    pkgs = {"this": hepti, "rev": import_tree(rev_src, "hepti_rev", tmp / "trees")}
    out, diffs = {}, {}
    for case in cases:
        model_dir = case.rsplit(":", 1)[0]
        fns, ys = {}, {}
        for tree in TREES:
            print(f"{case}: building and compiling in {tree} tree", file=sys.stderr)
            try:
                fns[tree] = forward_fn(pkgs[tree], model_dir, inputs[case])
            except (ImportError, AttributeError, KeyError) as e:  # an older tree's other API
                raise SystemExit(f"--in-process cannot build {model_dir} with {tree} tree "
                                 f"({args.rev if tree == 'rev' else 'HEAD'}): {e!r}; it needs "
                                 "hepti.parallel.single.SINGLE, so compare launches instead "
                                 "(without --in-process)") from e
            for _ in range(2):  # compile, then touch
                ys[tree] = np.asarray(fns[tree]())
        diffs[case] = float(np.max(np.abs(ys["this"] - ys["rev"])) / max(np.max(np.abs(ys["rev"])), 1e-30))
        print(f"{case}: max |this - rev| / max |rev| = {diffs[case]:.2e}", file=sys.stderr)

        def both(_, k):
            times = {}
            for tree in round_order(TREES, k):
                t0 = time.perf_counter()
                fns[tree]()
                times[tree] = time.perf_counter() - t0
            return times
        with tqdm(total=args.rounds, desc=case, unit="round", file=sys.stderr) as bar:
            out[(case, 1, None)] = interleave(["round"], args.rounds, both, bar=bar)["round"]
    return out, diffs


def add_arguments(ap) -> None:
    ap.add_argument("rev", help="the commit to compare against, e.g. HEAD~3 or cad4aac")
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ",
                    help="a model and its token count (default: weights/minilm-l6:128 and "
                         "weights/bert-base:256)")
    ap.add_argument("--strategies", default="rows,tensor", help="at 2 ranks (default %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--repeat", type=positive_int, default=10, help="timed runs inside each launch (default 10)")
    ap.add_argument("--out", default="results/against.json", help="default %(default)s")
    ap.add_argument("--in-process", action="store_true",
                    help="1 rank only: both trees in this process, one forward each a round "
                         "(use 30 or more --rounds)")


def run_launches(args, configs, inputs) -> dict:
    """Every configuration launched from each tree, the two back to back, which first
    alternating: {config: [{tree: median latency s}] by round}."""
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)
    with checkout(args.rev) as rev_src, \
            tqdm(total=args.rounds * len(configs) * 2, desc="against", unit="run", file=sys.stderr) as bar:
        trees = {"this": ROOT / "src", "rev": rev_src}

        def both(config, k):
            case, ranks, strategy = config
            out = {}
            for tree in round_order(TREES, k):
                out[tree] = run_once(trees[tree], case.rsplit(":", 1)[0], inputs[case], ranks,
                                     strategy, args.repeat)
                bar.update(1)
            return out
        return interleave(configs, args.rounds, both)


def run(args) -> int:
    cases = args.case or ["weights/minilm-l6:128", "weights/bert-base:256"]
    tmp = Path(tempfile.mkdtemp(prefix="hepti-against-"))
    configs = [(case, ranks, strategy) for case in cases
               for ranks, strategy in [(1, None)] + [(2, s) for s in args.strategies.split(",")]]
    diffs = {}
    try:
        inputs = {c: synthetic_input(c.rsplit(":", 1)[0], int(c.rsplit(":", 1)[1]), tmp) for c in cases}
        if args.in_process:
            with checkout(args.rev) as rev_src:
                times, diffs = run_in_process(args, cases, inputs, rev_src, tmp)
        else:
            times = run_launches(args, configs, inputs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    rows = []
    print(f"{'case':40s} {'rev ms':>9s} {'this ms':>9s} {'this/rev':>9s} {'paired':>9s}")
    for (case, ranks, strategy), per_round in times.items():
        key = f"{case} {ranks} {strategy or 'single'}"
        v = {tree: [r[tree] for r in per_round] for tree in TREES}
        fig = summarise(v, baseline="rev")
        a, b = fig["this"]["median"], fig["rev"]["median"]
        row = {"config": key, "this_s": v["this"], "rev_s": v["rev"], "median_this_s": a,
               "median_rev_s": b, "ratio": fig["this"]["ratio"],
               "paired_ratio": fig["this"]["paired_ratio"]}
        if case in diffs:
            row["max_rel_diff"] = diffs[case]
        rows.append(row)
        print(f"{key:40s} {b * 1e3:9.2f} {a * 1e3:9.2f} {fig['this']['ratio']:9.3f} "
              f"{fig['this']['paired_ratio']:9.3f}")
    write_json(result_doc("against", git_commit(), rev=args.rev, rounds=args.rounds,
                          repeat=None if args.in_process else args.repeat,
                          mode="in-process" if args.in_process else "launches", results=rows),
               args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
