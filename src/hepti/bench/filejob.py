"""`bin/bench-file.sh`: the main job, a file of short lines embedded on N ranks to --output.

Per launch: `mpiexec -n N /usr/bin/time -f %M hepti run --input LINES --output OUT.npy
--report R.json`, timed whole (launch, load, the pass, writing), with rank 0's peak RSS from
/usr/bin/time and, from the report, the pass's wall time against the sum of its batches'
forward times (`pass_s`). The lines are made here, deterministically: 3-12 words from a small
vocabulary, one sentence a line. With `--against REV`, the same launch runs from a checkout of
commit REV (a git worktree under a temporary folder, on PYTHONPATH), taking turns with this
tree, so the two are compared on the same machine in the same minutes; the figure is the
median of each side and the ratio of medians.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from hepti.bench import hepti_cmd, mpiexec, result_doc, write_json

WORDS = ("the a cat dog sat on mat ran quickly slowly over under river bank money market stock "
         "fell rose guitar plays man woman child house tree green blue red small large").split()


def make_lines(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + ".\n")


def launch(model: str, lines: Path, out_dir: Path, tag: str, ranks: int, pythonpath: str | None) -> dict:
    out, report = out_dir / f"{tag}.npy", out_dir / f"{tag}.json"
    for p in out_dir.glob(f"{tag}.npy*"):
        p.unlink()
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    cmd = [mpiexec(), "-n", str(ranks), "/usr/bin/time", "-f", "hepti-maxrss-kb %M", *hepti_cmd(),
           "run", "--model", model, "--input", str(lines), "--output", str(out), "--report", str(report)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    rss = [int(ln.split()[1]) * 1024 for ln in p.stderr.splitlines() if ln.startswith("hepti-maxrss-kb")]
    rep = json.loads(report.read_text())
    return {"wall_s": wall, "peak_rss_bytes_max": max(rss), "peak_rss_bytes_by_process": rss,
            "pass_s": rep.get("pass_s"), "load_s": rep.get("load_s"),
            "output_bytes": out.stat().st_size}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="weights/minilm-l6")
    ap.add_argument("--lines", type=int, default=10000)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--against", metavar="REV", help="also run commit REV, taking turns")
    ap.add_argument("--out", default="results/filejob.json")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="hepti-filejob-"))
    sides = {"now": None}
    try:
        lines = tmp / "lines.txt"
        make_lines(lines, args.lines)
        if args.against:
            tree = tmp / "against"
            subprocess.run(["git", "worktree", "add", "--detach", str(tree), args.against],
                           check=True, capture_output=True)
            sides[args.against] = str(tree / "src")
        runs = {side: [] for side in sides}
        for r in range(args.rounds):
            for side, path in sides.items():
                res = launch(args.model, lines, tmp, f"{r}-{side}".replace("/", "_"), args.ranks, path)
                runs[side].append(res)
                print(f"round {r + 1} {side}: {res['wall_s']:.1f} s, peak RSS "
                      f"{res['peak_rss_bytes_max'] / 1e6:.0f} MB", flush=True)
        summary = {side: {"wall_s_median": statistics.median(x["wall_s"] for x in rs),
                          "peak_rss_bytes_median": statistics.median(x["peak_rss_bytes_max"] for x in rs)}
                   for side, rs in runs.items()}
        if args.against:
            summary["wall_ratio_against_over_now"] = (summary[args.against]["wall_s_median"]
                                                      / summary["now"]["wall_s_median"])
        doc = result_doc("filejob", model=args.model, lines=args.lines, ranks=args.ranks,
                         rounds=args.rounds, against=args.against, summary=summary, runs=runs)
        write_json(doc, args.out)
        print(json.dumps(summary, indent=2))
        print(f"wrote {args.out}")
    finally:
        if args.against:
            subprocess.run(["git", "worktree", "remove", "--force", str(tmp / "against")],
                           capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
