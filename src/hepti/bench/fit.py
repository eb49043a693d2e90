"""`hepti bench fit` (bin/bench-fit.sh): does the planner's predicted latency hold on this
machine's own ranks?

The loopback check of the planner issue: N ranks on this machine (shared memory between
them), for each case a fresh profile (`hepti profile`), then `hepti run --strategy auto` from
it, and the measured median latency against the plan's `predicted_latency_s`. One launch can
land on a busy spell of this shared host (a whole 30-run launch 20% slow, then the next at
the usual speed), so every case is measured in several interleaved rounds, each with its own
profile and plan; the JSON keeps every round. The figure is the median error over the rounds
(the target: within `--bound`), and how many rounds are within it.
"""
from __future__ import annotations

import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from hepti.bench.harness import hepti_cmd, interleave, launch, positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.bench.scaling import synthetic_input


def one_round(model_dir: str, seq: int, inp: tuple[str, Path], prof_file: Path, ranks: int,
              repeat: int) -> dict:
    """Profile, plan and run once; the plan's prediction against the measured median."""
    launch(hepti_cmd() + ["profile", "--model", model_dir, "--seq", str(seq), "--out", str(prof_file)],
           ranks=ranks)
    rep = launch(hepti_cmd() + ["run", "--model", model_dir, inp[0], str(inp[1]), "--profile",
                                str(prof_file), "--strategy", "auto", "--repeat", str(repeat),
                                "--json"], ranks=ranks).json()
    measured, predicted = rep["latency_s"]["median"], rep["predicted_latency_s"]
    return {"strategy": rep["strategy"], "counts": rep["counts"], "measured_s": measured,
            "predicted_s": predicted, "error": measured / predicted - 1,
            "per_rank": [{"rank": r["rank"], "compute_s": r["compute_s"],
                          "comm_total_s": r["comm_total_s"],
                          "predicted_compute_s": r["predicted"]["compute_s"],
                          "predicted_comm_s": sum(r["predicted"]["comm_s"].values())}
                         for r in rep["per_rank"]]}


def add_arguments(ap) -> None:
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ", required=True,
                    help="a model folder and a token count, e.g. weights/minilm-l6:128 (a "
                         "CNN's: the image side, e.g. weights/resnet50:224)")
    ap.add_argument("--ranks", type=positive_int, default=2, help="local ranks (default 2)")
    ap.add_argument("--rounds", type=positive_int, default=5,
                    help="profile + plan + run, per case, interleaved (default 5)")
    ap.add_argument("--repeat", type=positive_int, default=30, help="timed runs inside each launch (default 30)")
    ap.add_argument("--bound", type=float, default=0.15, help="target |error| (default 0.15)")
    ap.add_argument("--out", default="results/fit.json", help="default %(default)s")


def run(args) -> int:
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    tmp = Path(tempfile.mkdtemp(prefix="hepti-fit-"))
    cases = {}
    for case in args.case:
        model_dir, seq = case.rsplit(":", 1)
        cases[model_dir] = (int(seq), synthetic_input(model_dir, int(seq), tmp))
    bar = tqdm(total=len(cases) * args.rounds, desc="fit", unit="round", file=sys.stderr)
    try:
        rounds = interleave(list(cases), args.rounds, lambda m, _k: one_round(
            m, cases[m][0], cases[m][1], tmp / "profile.json", args.ranks, args.repeat), bar)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    results = []
    for model_dir, (seq, _) in cases.items():
        errs = [r["error"] for r in rounds[model_dir]]
        results.append({"model": Path(model_dir).name, "seq": seq, "ranks": args.ranks,
                        "median_error": statistics.median(errs), "min_error": min(errs),
                        "max_error": max(errs),
                        "rounds_within_bound": sum(abs(e) <= args.bound for e in errs),
                        "rounds": rounds[model_dir]})
    met = all(abs(r["median_error"]) <= args.bound for r in results)
    write_json(result_doc("fit", rounds=args.rounds, repeat_per_launch=args.repeat,
                          bound=args.bound, met=met, results=results), args.out)
    print(f"{'model':<14}{'seq':>5}  {'plans':<22}{'median':>8}{'min':>8}{'max':>8}  within")
    for r in results:
        plans = ",".join(sorted({x["strategy"] for x in r["rounds"]}))
        print(f"{r['model']:<14}{r['seq']:>5}  {plans:<22}{r['median_error']:>+8.1%}"
              f"{r['min_error']:>+8.1%}{r['max_error']:>+8.1%}  {r['rounds_within_bound']}/{args.rounds}")
    print(f"measured vs predicted latency, median of {args.rounds} rounds within {args.bound:.0%}: "
          f"{'MET' if met else 'NOT MET'}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
