"""`hepti bench file` (bin/bench-file.sh): the main job, a file of short lines embedded on N
ranks to --output.

Per launch: `mpiexec -n N /usr/bin/time -f %M hepti run --input LINES --output OUT.npy
--report R.json`, timed whole (launch, load, the pass, writing), with rank 0's peak RSS from
/usr/bin/time and, from the report, the pass's wall time against the sum of its batches'
forward times (`pass_s`). The lines are made here, deterministically: 3-12 words from a small
vocabulary, one sentence a line. With `--against REV`, the same launch runs from a checkout of
commit REV (a git worktree under a temporary folder, on PYTHONPATH), taking turns with this
tree (hepti.bench.harness: interleaved rounds, the order alternating), so the two are compared
on the same machine in the same minutes; the figure is the median of each side and the ratio of
medians.
"""
from __future__ import annotations

import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from hepti.bench.harness import (checkout, hepti_cmd, interleave, launch, positive_int, result_doc,
                                 summarise, write_json)
from hepti.bench.registry import module_main

WORDS = ("the a cat dog sat on mat ran quickly slowly over under river bank money market stock "
         "fell rose guitar plays man woman child house tree green blue red small large").split()


def make_lines(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + ".\n")


def launch_job(model: str, lines: Path, out_dir: Path, tag: str, ranks: int, pythonpath) -> dict:
    """One launch of the file job (from the tree whose src/ is `pythonpath`, None: this one):
    its wall time, each process's peak RSS, and the report's pass and load times."""
    out, report = out_dir / f"{tag}.npy", out_dir / f"{tag}.json"
    for p in out_dir.glob(f"{tag}.npy*"):
        p.unlink()
    res = launch(["/usr/bin/time", "-f", "hepti-maxrss-kb %M", *hepti_cmd(), "run", "--model", model,
                  "--input", str(lines), "--output", str(out), "--report", str(report)],
                 ranks=ranks, pythonpath=pythonpath, timeout=3600)
    rss = [int(ln.split()[1]) * 1024 for ln in res.stderr.splitlines() if ln.startswith("hepti-maxrss-kb")]
    rep = json.loads(report.read_text())
    return {"wall_s": res.wall_s, "peak_rss_bytes_max": max(rss), "peak_rss_bytes_by_process": rss,
            "pass_s": rep.get("pass_s"), "load_s": rep.get("load_s"),
            "output_bytes": out.stat().st_size, "loadavg_1min": res.loadavg_1min}


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="weights/minilm-l6", help="default %(default)s")
    ap.add_argument("--lines", type=positive_int, default=10000, help="lines to embed (default %(default)s)")
    ap.add_argument("--ranks", type=positive_int, default=2, help="default %(default)s")
    ap.add_argument("--rounds", type=positive_int, default=2, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--against", metavar="REV", help="also run commit REV, taking turns")
    ap.add_argument("--out", default="results/filejob.json", help="default %(default)s")


def run(args) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="hepti-filejob-"))
    try:
        lines = tmp / "lines.txt"
        make_lines(lines, args.lines)
        with contextlib.ExitStack() as stack:
            sides = {"now": None}
            if args.against:
                sides[args.against] = stack.enter_context(checkout(args.against))

            def one(side: str, r: int) -> dict:
                res = launch_job(args.model, lines, tmp, f"{r}-{side}".replace("/", "_"), args.ranks,
                                 sides[side])
                print(f"round {r + 1} {side}: {res['wall_s']:.1f} s, peak RSS "
                      f"{res['peak_rss_bytes_max'] / 1e6:.0f} MB", flush=True)
                return res
            runs = interleave(list(sides), args.rounds, one)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    wall = summarise({side: [x["wall_s"] for x in rs] for side, rs in runs.items()}, baseline="now")
    summary = {side: {"wall_s_median": wall[side]["median"],
                      "peak_rss_bytes_median": statistics.median(x["peak_rss_bytes_max"] for x in rs)}
               for side, rs in runs.items()}
    if args.against:
        summary["wall_ratio_against_over_now"] = wall[args.against]["ratio"]
    doc = result_doc("filejob", model=args.model, lines=args.lines, ranks=args.ranks,
                     rounds=args.rounds, against=args.against, summary=summary, runs=runs)
    write_json(doc, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
