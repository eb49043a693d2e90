"""`hepti bench scaling` (bin/bench-scaling.sh): 1 rank vs N ranks (rows, tensor; a CNN: even
bands and auto) at even shares, interleaved.

Each round runs every configuration once (each run is `hepti run --repeat R --json`, one thread
per rank, fixed-shape synthetic input with no padding), the order rotating from round to round
(hepti.bench.harness.interleave), so slow drifts of this shared machine hit every configuration
alike. The figure is the median over
rounds of each configuration's median latency, and the speedup is single / parallel. Beside
it, `speedup_paired` comes from the median of the per-round ratios (each round's N-rank launch
against the same round's 1-rank one), which a drift across the rounds moves less.
"""
from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from hepti.families import family
from hepti.bench.harness import (hepti_cmd, interleave, launch, positive_int, result_doc, summarise,
                                 write_json)
from hepti.bench.model import synthetic_batch
from hepti.bench.registry import module_main
from hepti.weights import WeightStore


def synthetic_input(model_dir: str, seq: int, tmp: Path) -> tuple[str, Path]:
    """(flag, file) of one fixed-shape input: token ids of `seq` tokens, or for a vision model
    one image's normalised pixels (a ViT's `seq` must be its tokens per image; a CNN's is the
    side of a square image)."""
    cfg = WeightStore(model_dir).config
    if family(cfg).any_image_size:  # `seq` is the image's side
        path = tmp / f"{Path(model_dir).name}-{seq}.npy"
        np.save(path, np.random.default_rng(0).standard_normal((1, 3, seq, seq)).astype(np.float32))
        return "--input-pixels", path
    if "pixels" in family(cfg).inputs:
        if seq != cfg.seq_len:
            raise SystemExit(f"{model_dir} takes {cfg.seq_len} tokens per image "
                             f"({cfg.image_size}px in {cfg.patch_size}px patches), not {seq}")
        path = tmp / f"{Path(model_dir).name}-{seq}.npy"
        px = np.random.default_rng(0).standard_normal(
            (1, cfg.num_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
        np.save(path, px)
        return "--input-pixels", path
    path = tmp / f"{Path(model_dir).name}-{seq}.npz"
    ids, mask = synthetic_batch(cfg, 1, seq)
    np.savez(path, ids=ids, mask=mask)
    return "--input-ids", path


def run_once(model_dir, inp: tuple[str, Path], ranks: int, strategy: str | None, repeat: int) -> dict:
    """One `hepti run --repeat R --json` launch (under mpiexec past one rank): its report."""
    cmd = hepti_cmd() + ["run", "--model", str(model_dir), inp[0], str(inp[1]),
                         "--pool", "mean", "--repeat", str(repeat), "--json"]
    if strategy:
        cmd += ["--strategy", strategy]
    return launch(cmd, ranks=ranks if ranks > 1 else None).json()


def add_arguments(ap) -> None:
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ", required=True,
                    help="a model folder and a token count, e.g. weights/minilm-l6:128 "
                         "(a vision model: its tokens per image, weights/vit-base:197; a CNN: "
                         "its image side, weights/resnet50:224)")
    ap.add_argument("--ranks", type=positive_int, default=2, help="ranks of the parallel runs (default 2)")
    ap.add_argument("--strategies", default="rows,tensor", help="a transformer's (default %(default)s)")
    ap.add_argument("--cnn-strategies", default="even,auto",
                    help="a CNN's (split by height; its SEQ is the image side): default %(default)s")
    ap.add_argument("--rounds", type=positive_int, default=5, help="interleaved rounds (default 5)")
    ap.add_argument("--repeat", type=positive_int, default=10, help="timed runs inside each launch (default 10)")
    ap.add_argument("--out", default="results/scaling.json", help="default %(default)s")


def run(args) -> int:
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    def configs_of(model_dir):
        cnn = family(WeightStore(model_dir).config).executor == "bands"
        names = (args.cnn_strategies if cnn else args.strategies).split(",")
        return [(1, None)] + [(args.ranks, s) for s in names]
    results = []
    tmp = Path(tempfile.mkdtemp(prefix="hepti-scaling-"))
    total = sum(args.rounds * len(configs_of(c.rsplit(":", 1)[0])) for c in args.case)
    bar = tqdm(total=total, desc="scaling", unit="run", file=sys.stderr)
    try:
        for case in args.case:
            model_dir, seq = case.rsplit(":", 1)
            configs = configs_of(model_dir)
            ids_file = synthetic_input(model_dir, int(seq), tmp)
            reps = interleave(configs, args.rounds,
                              lambda c, _k: run_once(model_dir, ids_file, c[0], c[1], args.repeat), bar)
            per = {c: [r["latency_s"]["median"] for r in rs] for c, rs in reps.items()}
            fig = summarise(per, baseline=(1, None))
            for c in configs:
                row = {"model": Path(model_dir).name, "seq": int(seq), "ranks": c[0],
                       "strategy": c[1] or "single", "median_latency_s": fig[c]["median"],
                       "round_medians_s": per[c], "speedup_vs_1_rank": 1 / fig[c]["ratio"],
                       "speedup_paired": 1 / fig[c]["paired_ratio"]}
                if c[0] > 1:
                    row["per_rank"] = [{k: r[k] for k in ("rank", "compute_s", "comm_total_s", "comm_s")}
                                       for r in reps[c][-1]["per_rank"]]
                results.append(row)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    write_json(result_doc("scaling", rounds=args.rounds, repeat_per_launch=args.repeat,
                          threads_per_rank=1, results=results), args.out)
    print(f"{'model':<14}{'seq':>5}{'ranks':>6}  {'strategy':<9}{'median ms':>10}{'speedup':>9}"
          f"{'paired':>8}")
    for r in results:
        print(f"{r['model']:<14}{r['seq']:>5}{r['ranks']:>6}  {r['strategy']:<9}"
              f"{r['median_latency_s'] * 1e3:>10.2f}{r['speedup_vs_1_rank']:>9.2f}"
              f"{r['speedup_paired']:>8.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
