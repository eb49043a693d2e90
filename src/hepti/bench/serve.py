"""`hepti bench serve` (bin/bench-serve.sh): `hepti serve`'s throughput and latency at 1, 4 and
16 concurrent clients, next to `hepti run --input` on the same texts.

One `hepti serve --model M -n N` runs for the whole benchmark. Each round, in turn (the order
rotates: hepti.bench.harness.interleave, so neither side always meets a warmer or a busier
machine): for each client count C, C threads post one line each per request (`POST /v1/embeddings`, closed loop: a client sends
its next request when its answer arrives) for `--seconds`; then `mpiexec -n N hepti run
--input LINES --output OUT.npy --report R.json` embeds every line once, and its throughput is
lines over the pass's wall time (`pass_s`: the launch and the load are not counted, as the
service's are not). The lines are bench-file's (3-12 words). Figures: requests/s and p50/p99
latency per client count, lines/s of the file job; medians over the rounds.

    hepti bench serve [--model weights/minilm-l6] [--ranks 2] [--clients 1,4,16]
                      [--seconds 20] [--rounds 3] [--lines 2000] [--out results/serve.json]
"""
from __future__ import annotations

import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from hepti.bench.filejob import make_lines
from hepti.bench.harness import (git_commit, hepti_cmd, interleave, launch, positive_int, result_doc,
                                 service, write_json)
from hepti.bench.registry import module_main


def drive(url: str, lines: list[str], clients: int, seconds: float) -> dict:
    """`clients` closed-loop clients for `seconds`: requests answered, and their latencies."""
    lat: list[float] = []
    errors: list[str] = []
    stop = time.monotonic() + seconds
    lock = threading.Lock()

    def client(k: int) -> None:
        i = k
        while time.monotonic() < stop:
            body = json.dumps({"input": lines[i % len(lines)]}).encode()
            req = urllib.request.Request(url + "/v1/embeddings", data=body,
                                         headers={"Content-Type": "application/json"})
            t0 = time.perf_counter()
            try:
                with urllib.request.urlopen(req, timeout=120) as r:
                    r.read()
            except Exception as e:  # noqa: BLE001 - counted and reported, not fatal
                with lock:
                    errors.append(str(e))
                continue
            with lock:
                lat.append(time.perf_counter() - t0)
            i += clients
    t0 = time.monotonic()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    lat.sort()

    def pct(p):
        return lat[min(len(lat) - 1, int(round(p / 100 * (len(lat) - 1))))] if lat else None
    return {"clients": clients, "requests": len(lat), "errors": len(errors), "wall_s": wall,
            "requests_per_s": len(lat) / wall, "p50_s": pct(50), "p99_s": pct(99)}


def file_job(model: str, lines: Path, ranks: int, work: Path, tag: str) -> dict:
    out, report = work / f"{tag}.npy", work / f"{tag}.json"
    out.unlink(missing_ok=True)  # `hepti run` keeps an existing output unless told --force
    launch([*hepti_cmd(), "run", "--model", model, "--input", str(lines), "--output", str(out),
            "--report", str(report)], ranks=ranks, timeout=3600)
    rep = json.loads(report.read_text())
    n = sum(1 for _ in open(lines))
    wall = rep["pass_s"]["wall_s"]  # the pass: reading, forwards, writing (not launch, load)
    return {"lines": n, "pass_s": wall, "lines_per_s": n / wall}


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="weights/minilm-l6", help="default %(default)s")
    ap.add_argument("--ranks", type=positive_int, default=2, help="default %(default)s")
    ap.add_argument("--clients", default="1,4,16", help="concurrent client counts (default %(default)s)")
    ap.add_argument("--seconds", type=float, default=20.0,
                    help="seconds of requests per client count (default %(default)s)")
    ap.add_argument("--rounds", type=positive_int, default=3, help="interleaved rounds (default %(default)s)")
    ap.add_argument("--lines", type=positive_int, default=2000,
                    help="lines of the texts (and of the file job) (default %(default)s)")
    ap.add_argument("--port", type=int, default=8791, help="the service's port (default %(default)s)")
    ap.add_argument("--out", default="results/serve.json", help="default %(default)s")


def run(args) -> int:
    counts = [int(c) for c in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="hepti-bench-serve-"))
    lines_path = work / "lines.txt"
    make_lines(lines_path, args.lines)
    lines = lines_path.read_text().splitlines()
    url = f"http://127.0.0.1:{args.port}"
    cmd = [*hepti_cmd(), "serve", "--model", args.model, "-n", str(args.ranks), "--port", str(args.port)]
    with service(cmd, url, work / "serve.log"):
        drive(url, lines, 2, 3.0)  # warm-up: first touches, Numba's first calls

        def step(what: tuple, r: int) -> dict:
            kind, c = what
            if kind == "serve":
                res = drive(url, lines, c, args.seconds)
                print(f"round {r + 1}: {c} clients: {res['requests_per_s']:.1f} req/s, p50 "
                      f"{res['p50_s'] * 1e3:.1f} ms, p99 {res['p99_s'] * 1e3:.1f} ms", flush=True)
            else:
                res = file_job(args.model, lines_path, args.ranks, work, f"file-{r}")
                print(f"round {r + 1}: hepti run --input: {res['lines_per_s']:.1f} lines/s", flush=True)
            return res
        runs = interleave([("serve", c) for c in counts] + [("file", None)], args.rounds, step)
        served = {c: runs[("serve", c)] for c in counts}
        filed = runs[("file", None)]
        metrics = json.loads(urllib.request.urlopen(url + "/metrics", timeout=60).read())
    med = statistics.median
    summary = {"serve": {str(c): {"requests_per_s": med(x["requests_per_s"] for x in rs),
                                  "p50_ms": med(x["p50_s"] for x in rs) * 1e3,
                                  "p99_ms": med(x["p99_s"] for x in rs) * 1e3,
                                  "errors": sum(x["errors"] for x in rs)}
                         for c, rs in served.items()},
               "file_job_lines_per_s": med(x["lines_per_s"] for x in filed)}
    for c, row in summary["serve"].items():
        row["vs_file_job"] = row["requests_per_s"] / summary["file_job_lines_per_s"]
    doc = result_doc("serve", commit=git_commit(), model=args.model, ranks=args.ranks,
                     clients=counts, seconds=args.seconds, rounds=args.rounds, lines=args.lines,
                     summary=summary, served={str(c): v for c, v in served.items()}, file_job=filed,
                     service_metrics=metrics)
    write_json(doc, args.out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
