"""The time to the first answer after a worker rank of `hepti serve` is stopped (SIGSTOP), with
and without the spare job (issue 44: within 10 s), and where that time goes.

Each run starts a service in this process (hepti.serve.supervisor, `-n RANKS --strategy
tensor`), waits until it serves and, with the spare, until the spare waits at its hello (its
ranks' connections queued on its listener), lets two closed-loop clients post for a few seconds,
then SIGSTOPs worker rank 1 and times, from the stop: the declaration (`declared`), the old
job's end as `_serve` saw it (`ended`), the next job's hello (`ready`) and the first answer
(`first`). Runs alternate between the settings (hepti.bench.harness.interleave), so that both
meet the same drift of the machine's load; the 1-minute load average at each stop is printed
with the run. The figures: the median and range of each over the runs.

    hepti bench stall [--model weights/minilm-l6] [--ranks 2] [--runs 5]
                      [--settings spare,fresh] [--out results/tmp/stall.json]

`--readmit` instead times a lost device's re-admission: the longest wait for an answer around
it (`readmit_run`; medians over `--runs`). Without `--spec`, in this process: `-n RANKS`,
SIGSTOP of rank 1 (declared lost, relaunched without it), two closed-loop clients, until the
device is back and serving; with `--spec` (root), `hepti emulate` of that spec under
hepti.bench.adapt's client (`served_run`: one closed-loop client, `--strategy auto --replan
on`, the schedule's hang), for `--duration` seconds. Run the file with another tree's src on
PYTHONPATH to time that tree (the service is that tree's; this bench's code is only the
client and the figures):

    PYTHONPATH=/work/main/src python src/hepti/bench/stall.py --readmit --runs 5

`--stages N` instead times what a fresh relaunch of one rank does, N times: `mpiexec -n 1`
of this module's `_stages`, which does the worker's steps in its order and prints when each
ended, counted from before mpiexec started (wall) and in CPU seconds: Python and numpy, numba,
mpi4py (MPI_Init), hepti's modules, the weights' index, the kernels (Numba's cache), the
job (weights read and packed), a first and a second batch.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from hepti.bench.harness import interleave, launch, positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.bench.adapt import served_run
from hepti.serve.supervisor import Supervisor

TEXTS = ["A cat sat.", "A dog sat on the mat, and then it slept for a very long time indeed.",
         "hello", "Edge devices differ in speed, memory and link."]


def _queued(listener) -> int:
    """Connections waiting in a listening socket's accept queue (/proc/net/tcp's rx_queue of
    a socket in LISTEN): a spare's ranks are all connected when it holds RANKS + 1."""
    port = listener.getsockname()[1]
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            cols = line.split()
            if int(cols[1].split(":")[1], 16) == port and cols[3] == "0A":
                return int(cols[4].split(":")[1], 16)
    return 0


def _clients(sup, ids: list, stop: threading.Event, requests: list, errors: list) -> list:
    """Two closed-loop clients posting `ids` in turn until `stop`: each answer's (sent,
    answered) wall times go to `requests`, each failure to `errors`; the started threads."""
    def client(k):
        i = k
        while not stop.is_set():
            a = time.time()
            try:
                sup.embed([ids[i % len(ids)]])
                requests.append((a, time.time()))
            except Exception as e:  # noqa: BLE001 - counted, reported
                errors.append(repr(e))
            i += 2
    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(2)]
    [t.start() for t in threads]
    return threads


def _mono(wall: float) -> float:
    return wall - time.time() + time.monotonic()


def one_run(model: str, ranks: int, spare: bool, settle_s: float = 3.0) -> dict:
    # a tree from before the spare (run this file with its src on PYTHONPATH): `fresh` only
    kw = {"spare": spare} if "spare" in inspect.signature(Supervisor).parameters else {}
    sup = Supervisor(model, ranks, worker_args=["--strategy", "tensor"], **kw).start()
    stop_clients = threading.Event()
    requests: list[tuple[float, float]] = []  # (sent, answered), wall time
    errors: list[str] = []
    stopped = None
    try:
        ids = [np.array(e.ids, np.int64) for e in sup.tokenizer.encode_batch(TEXTS)]
        sup.embed(ids)  # up, and its first batch done
        if spare:  # the spare started at the hello: wait until it waits at its own
            t_end = time.monotonic() + 300
            while True:
                job = sup._spare_job
                if job is not None and _queued(job.listener) >= ranks:  # ranks - 1 lines + hello
                    break
                if time.monotonic() > t_end:
                    raise RuntimeError("the spare was not ready within 300 s")
                time.sleep(0.2)
        threads = _clients(sup, ids, stop_clients, requests, errors)
        time.sleep(settle_s)
        victim = next(r for r in sup.ranks if r["rank"] == 1)
        load = os.getloadavg()[0]
        t_stop = time.monotonic()
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = victim["pid"]
        t_end = t_stop + 300
        while not (len(sup.launches) >= 2 and "ready_s" in sup.launches[1]
                   and any(b > sup.launches[0]["ended_at"] for _, b in list(requests))):
            if time.monotonic() > t_end:
                raise RuntimeError("no answer within 300 s of the stop")
            time.sleep(0.05)
        lost, nxt = sup.launches[0], sup.launches[1]
        first = _mono(min(b for _, b in list(requests) if b > lost["ended_at"])) - t_stop
        stop_clients.set()
        [t.join(120) for t in threads]
        ready = _mono(nxt["started_at"] + nxt["ready_s"]) - t_stop
        return {"spare": spare, "load1": round(load, 2),
                "declared_s": round(_mono(lost["stall"]["at"]) - t_stop, 2),
                "ended_s": round(_mono(lost["ended_at"]) - t_stop, 2),
                "ready_s": round(ready, 2), "first_s": round(first, 2),
                "next_launch": {k: nxt.get(k) for k in ("n", "spare", "ready_s")},
                "errors": len(errors)}
    finally:
        stop_clients.set()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        sup.stop()


# --- re-admission --------------------------------------------------------------------------------
# The window whose requests count as "around the re-admission": from this long before the job
# with the device back started (before make-before-break, the serving job was stopped then) to
# this long after it said hello.
AROUND_S = 5.0


def _load_sampler(stop: threading.Event, out: list) -> None:
    """The 1-minute load average every second, (time.time(), load1), until `stop`."""
    while not stop.wait(1.0):
        out.append((time.time(), os.getloadavg()[0]))


def _admission(launches: list[dict]) -> dict | None:
    """The launch that took a lost device back and said hello (its `readmitting` record)."""
    return next((x for x in launches if x.get("readmitting") and "ready_s" in x), None)


def readmit_figures(requests: list[tuple[float, float]], launches: list[dict],
                    loads: list[tuple[float, float]]) -> dict:
    """From requests as (submitted, answered) in time.time() seconds and the service's launch
    records: around the re-admission (AROUND_S before its job started, to AROUND_S after its
    hello), the longest any request waited (its latency, for every request in flight at some
    time in that window) and the longest time without an answer (between consecutive answers);
    the load average nearest the hello."""
    back = _admission(launches)
    if back is None:
        raise RuntimeError("no re-admission in the launch records")
    lo = back["started_at"] - AROUND_S
    ready = back["started_at"] + back["ready_s"]
    hi = ready + AROUND_S
    inside = [(a, b) for a, b in requests if b >= lo and a <= hi]
    answers = sorted(b for _, b in requests if lo <= b <= hi)
    edges = [lo] + answers + [hi]
    load = min(loads, key=lambda x: abs(x[0] - ready))[1] if loads else os.getloadavg()[0]
    return {"load1": round(load, 2),
            "longest_wait_s": round(max((b - a for a, b in inside), default=float("nan")), 3),
            "longest_gap_s": round(max(y - x for x, y in zip(edges, edges[1:])), 3),
            "answered_in_window": len(answers),
            "make_before_break": bool(back.get("make_before_break")),
            "admission_ready_s": round(back["ready_s"], 2)}


def readmit_run(model: str, ranks: int, settle_s: float = 3.0, after_s: float = 8.0) -> dict:
    """One service in this process: SIGSTOP of rank 1, then two closed-loop clients until the
    device is back and the job with it has served `after_s`; `readmit_figures` of it."""
    sup = Supervisor(model, ranks, worker_args=["--strategy", "tensor"]).start()
    stop_clients, stop_load = threading.Event(), threading.Event()
    requests: list[tuple[float, float]] = []
    errors: list[str] = []
    loads: list[tuple[float, float]] = []
    threading.Thread(target=_load_sampler, args=(stop_load, loads), daemon=True).start()
    stopped = None
    try:
        ids = [np.array(e.ids, np.int64) for e in sup.tokenizer.encode_batch(TEXTS)]
        sup.embed(ids)
        threads = _clients(sup, ids, stop_clients, requests, errors)
        time.sleep(settle_s)
        victim = next(r for r in sup.ranks if r["rank"] == 1)
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = victim["pid"]
        t_end = time.monotonic() + 600
        while (back := _admission(sup.launches)) is None or \
                time.time() < back["started_at"] + back["ready_s"] + after_s:
            if time.monotonic() > t_end:
                raise RuntimeError("the device was not back within 600 s of the stop")
            time.sleep(0.2)
        stop_clients.set()
        [t.join(120) for t in threads]
        m = sup.metrics()["requests"]
        return {**readmit_figures(requests, sup.launches, loads), "errors": len(errors),
                "duplicates": m["duplicates"], "failed": m["failed"],
                "requests": len(requests)}
    finally:
        stop_clients.set()
        stop_load.set()
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        sup.stop()


def readmit_spec_run(spec: str, model: str, seq: int, duration: float, log_path: Path) -> dict:
    """One `hepti emulate` launch of `spec` under hepti.bench.adapt's closed-loop client (its
    `adaptive` variant's service: `--strategy auto --replan on`); `readmit_figures` of it."""
    n = len(json.loads(Path(spec).read_text())["devices"])
    stop_load, loads = threading.Event(), []
    threading.Thread(target=_load_sampler, args=(stop_load, loads), daemon=True).start()
    try:
        r = served_run(Path(spec), model, n, ["--strategy", "auto", "--replan", "on"], duration,
                       seq, 18000 + os.getpid() % 1000, log_path)
    finally:
        stop_load.set()
    t0 = r["t0"]
    requests = [(t0 + a, t0 + a + lat) for a, lat in r["requests"]]
    req = r["metrics"]["requests"]
    return {**readmit_figures(requests, r["metrics"]["launches"], loads),
            "lost": len(r["lost"]), "duplicates": req["duplicates"], "failed": req["failed"],
            "requests": len(requests), "log": str(log_path)}


def _stages(model: str) -> None:
    """Under `mpiexec -n 1`: the worker's start, step by step (see the module's docstring)."""
    t0 = float(os.environ["HEPTI_STAGES_T0"])
    marks = [("python+numpy", time.time(), time.process_time())]  # numpy: imported above
    import numba  # noqa: F401 - local: timed, the stage this mark measures
    marks.append(("numba", time.time(), time.process_time()))
    from mpi4py import MPI  # local: timed; and it starts MPI
    marks.append(("mpi4py", time.time(), time.process_time()))
    from hepti.families import load_kernels  # local: timed, as the ones below
    from hepti.parallel.comm import Comm  # local: timed
    from hepti.parallel.engine import Job  # local: timed
    from hepti.parallel.plans import resolve_plan  # local: timed
    from hepti.parallel.trace import Tracer  # local: timed
    from hepti.serve.worker import make_batch, parse_args  # local: timed
    from hepti.weights import WeightStore  # local: timed
    marks.append(("hepti", time.time(), time.process_time()))
    args = parse_args(["--model", model, "--strategy", "tensor"])
    world = Comm(MPI.COMM_WORLD, Tracer(0))
    store = WeightStore(args.model)
    plan = resolve_plan(args, world.size, store.config)
    marks.append(("store+plan", time.time(), time.process_time()))
    load_kernels(store.config, 1, announce=False)
    marks.append(("kernels", time.time(), time.process_time()))
    job = Job(world, store, plan, 1)
    marks.append(("weights", time.time(), time.process_time()))
    batch = make_batch([np.arange(101, 120)] * 2, 0)
    for name in ("batch1", "batch2"):
        job.run_all([batch], 1, lambda k, h: None)
        marks.append((name, time.time(), time.process_time()))
    print(json.dumps({"load1": round(os.getloadavg()[0], 2),
                      "wall": {k: round(t - t0, 2) for k, t, _ in marks},
                      "cpu": {k: round(c, 2) for k, _, c in marks}}), flush=True)


def stages(model: str, runs: int) -> dict:
    out = []
    for _ in range(runs):
        p = launch([sys.executable, "-m", "hepti.bench.stall", "--stage-child", "--model", model],
                   ranks=1, env={"HEPTI_STAGES_T0": repr(time.time())})
        out.append(json.loads(p.stdout.strip().splitlines()[-1]))
        print(json.dumps(out[-1]), flush=True)
    keys = list(out[0]["wall"])
    return {"load1": statistics.median(r["load1"] for r in out),
            "wall_median": {k: statistics.median(r["wall"][k] for r in out) for k in keys},
            "cpu_median": {k: statistics.median(r["cpu"][k] for r in out) for k in keys}}


def spread(runs: list[dict], keys) -> dict:
    """The median, min and max over the runs of each figure in keys."""
    return {key: {"median": statistics.median(r[key] for r in runs),
                  "min": min(r[key] for r in runs), "max": max(r[key] for r in runs)} for key in keys}


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="weights/minilm-l6", help="default %(default)s")
    ap.add_argument("--ranks", type=positive_int, default=2, help="default %(default)s")
    ap.add_argument("--runs", type=positive_int, default=5,
                    help="rounds: each setting once a round, the order alternating "
                         "(default %(default)s)")
    ap.add_argument("--settings", default="spare,fresh", help="spare, fresh, or both (the order of the first round)")
    ap.add_argument("--out", default=None, help="write every run and the medians as JSON (results/...)")
    ap.add_argument("--stages", type=int, default=0, metavar="N",
                    help="time a fresh one-rank start's steps N times instead")
    ap.add_argument("--stage-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--readmit", action="store_true",
                    help="time a lost device's re-admission instead (see the description)")
    ap.add_argument("--spec", default=None, help="with --readmit: an emulated spec (root)")
    ap.add_argument("--seq", type=positive_int, default=128, help="with --spec: tokens a request")
    ap.add_argument("--duration", type=float, default=150.0,
                    help="with --spec: seconds of requests after the schedule starts")


def run(args) -> int:
    if args.stage_child:
        _stages(args.model)
        return 0
    if args.stages:
        print(json.dumps(stages(args.model, args.stages), indent=1))
        return 0
    if args.readmit:
        def one(_setting, k):
            if args.spec:
                log_path = Path(tempfile.gettempdir()) / f"hepti-readmit-{os.getpid()}-{k}.log"
                r = readmit_spec_run(args.spec, args.model, args.seq, args.duration, log_path)
            else:
                r = readmit_run(args.model, args.ranks)
            print(json.dumps(r), flush=True)
            return r
        runs = interleave(["readmit"], args.runs, one)["readmit"]
        summary = spread(runs, ("load1", "longest_wait_s", "longest_gap_s", "admission_ready_s"))
        summary["make_before_break"] = f"{sum(r['make_before_break'] for r in runs)}/{len(runs)}"
        name = "stall-readmit"
    else:
        settings = [s.strip() for s in args.settings.split(",") if s.strip()]

        def one(setting, _k):
            r = one_run(args.model, args.ranks, setting == "spare")
            print(json.dumps(r), flush=True)
            return r
        by_setting = interleave(settings, args.runs, one)
        runs = [r for rs in zip(*by_setting.values()) for r in rs]
        summary = {}
        for setting, mine in by_setting.items():
            summary[setting] = spread(mine, ("load1", "declared_s", "ended_s", "ready_s", "first_s"))
            summary[setting]["within_10s"] = f"{sum(r['first_s'] <= 10 for r in mine)}/{len(mine)}"
        name = "stall"
    print(json.dumps(summary, indent=1))
    if args.out:
        write_json(result_doc(name, model=args.model, ranks=args.ranks, runs=runs, summary=summary),
                   args.out)
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
