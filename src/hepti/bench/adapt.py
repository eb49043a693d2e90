"""`hepti bench adapt` (bin/bench-adapt.sh, root): re-planning while serving, on an
emulated cluster whose links and CPUs change on a schedule.

Each variant is one `hepti emulate --schedule-on-usr1 -- hepti serve ...` launch on the same
spec (hostfiles/emu-drift4.json); once the service is up, the benchmark sends the launcher
SIGUSR1 (the schedule's clock starts) and a closed-loop client sends one request at a time
(SEQ token ids, one input) for DURATION seconds, recording each request's start and latency.
Variants:
- `adaptive`: `--strategy auto --replan on`;
- `static`: `--strategy auto`, the plan made at t = 0, kept;
- `oracle-K` for each distinct phase K of the schedule: `--plan P_K`, where P_K is `hepti plan`
  on a profile that `hepti profile` measured on the spec with phase K's conditions; the
  piecewise oracle takes, in each phase, the oracle made for it;
- `even`: `--strategy even`.
Figures (results/adapt.json, .csv, .png): per phase, each variant's median latency; per event,
when the adaptive service flagged it (requests and seconds after it) and whether within 5
requests the median of its next 20 came within 1.10x of the phase's oracle; the time-weighted
mean latency of each variant (sum of latency^2 / sum of latency: a closed loop's requests
cover the time); the re-plans with their reasons, solve times, stalls and bytes read.

    sudo hepti bench adapt [--duration 100] [--seq 256] [--model weights/bert-base]
                           [--variants adaptive,static,oracle,even] [--flap]
                           [--rounds 3] [--quiet PAIRS] [--quiet-ab SECONDS]
`--flap` runs the second scenario instead: after `--flap-after` seconds (default 20) on the
steady link, node-c's link flaps 940 <-> 100 Mbit/s every 2 s for DURATION s, `adaptive`
against the static plans made for each of the two links, over the flapping seconds alone. (With
the flapping from the first request, as before 2026-11-27, the monitor has no baselines yet
for its first 8-10 s: see hepti.serve.monitor.)
`--rounds R` (default 3) runs every variant once per round, R rounds, each round in a rotated
order (hepti.bench.harness.interleave): the shared host's load drifts over the minutes a round
takes (one plan served phase 0 at 725 to 791 ms from launch to launch in one round at aef435f),
so each figure is taken within a round, adaptive against that round's oracle, and the median
over rounds is quoted.
`--quiet PAIRS` runs the spec with no schedule, `--replan on` and `off` interleaved PAIRS
times: the monitor's overhead (median over pairs of on / off median latency) and the re-plans
and flags it made with nothing to find (results/adapt-quiet.json). `--quiet-ab SECONDS` is one
launch with the monitor paused for every other run of 20 batches (`hepti serve --replan-ab`,
`quiet_ab`): the overhead without the spread between launches, which is wider than 1%.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from hepti.bench.harness import (command, drop_stale, git_commit, hepti_cmd, interleave, launch,
                                 positive_int, result_doc, round_order, service, write_csv,
                                 write_json)
from hepti.bench.registry import module_main
from hepti.emulate.spec import SpecError, format_mem, parse_hog, parse_mem

ROOT = Path(__file__).resolve().parents[3]
SPEC = ROOT / "hostfiles" / "emu-drift4.json"
RECOVER_WITHIN, RECOVER_NEXT, RECOVER_RATIO = 5, 20, 1.10
REVERT_RATIO = 1.05  # a restore: back within this of the plan made at t = 0, same phase


def phases(spec: dict, duration: float) -> list[dict]:
    """The schedule cut into phases: [{start, end, devices (conditions)}], events at a time merged."""
    devs = copy.deepcopy(spec["devices"])
    names = [d["name"] for d in devs]
    out, t = [], 0.0
    events = sorted(spec.get("schedule", []), key=lambda e: e["t"])
    times = sorted({e["t"] for e in events if e["t"] < duration})
    for nxt in times + [duration]:
        out.append({"start": t, "end": nxt, "devices": copy.deepcopy(devs)})
        for e in (e for e in events if e["t"] == nxt):
            i = e["device"] if isinstance(e["device"], int) else names.index(e["device"])
            devs[i].update({k: v for k, v in e.items() if k not in ("t", "device")})
        t = nxt
    return out


def is_out(dev: dict) -> bool:
    """The device serves nothing under these conditions: it hangs, or its link is silent."""
    return bool(dev.get("hang")) or dev.get("loss", 0) >= 100


def conditions_key(devs: list[dict]) -> str:
    return json.dumps([(d["cpu"], d.get("link_mbit"), d.get("mem"), d.get("mem_hog") or 0, is_out(d))
                       for d in devs])


def steady_spec(base: dict, devs: list[dict], name: str) -> dict:
    """`base` with these conditions held still: no schedule, and without the devices that are
    out (what a service started fresh on the devices that answer would run on)."""
    keep = [{k: v for k, v in d.items() if k in ("name", "cpu", "mem", "link_mbit")}
            for d in devs if not is_out(d)]
    for d, src in zip(keep, [d for d in devs if not is_out(d)]):
        if src.get("mem_hog"):  # another program holds memory: the device has that much less
            held, leave = parse_hog(src["mem_hog"])
            if held is None:  # sized at the event from what the ranks then used: not known here
                raise SpecError(f"{name}: {d['name']}'s mem_hog {src['mem_hog']} is sized from "
                                "its free memory while the service runs, so no steady cap can "
                                "stand for it; give bench adapt a spec with a fixed mem_hog "
                                "(e.g. \"250MiB\")")
            d["mem"] = format_mem(parse_mem(d["mem"]) - held)
    return {**{k: v for k, v in base.items() if k != "schedule"}, "name": name, "devices": keep}


# --- one served run ---------------------------------------------------------------------------

def served_run(spec_path: Path, model: str, n: int, serve_args: list[str], duration: float,
               seq: int, port: int, log_path: Path) -> dict:
    """Launch hepti serve on the emulated spec, start the schedule, drive requests; the
    requests (t from the schedule's start, latency) and the service's /metrics at the end."""
    cmd = command(["hepti", "serve", "--model", model, "-n", str(n), "--port", str(port),
                   "--plan-seq", str(seq), *serve_args],
                  spec=spec_path, emulate=["--schedule-on-usr1"], timeout=duration + 900)
    url = f"http://127.0.0.1:{port}"
    with service(cmd, url, log_path, ready_timeout=900, stop=signal.SIGINT) as p:
        ids = [(7 * i + 3) % 30000 + 1000 for i in range(seq)]
        body = json.dumps({"input": ids, "encoding_format": "base64"}).encode()
        _post(url, body)  # one request before the clock: first-touch costs are not a phase
        os.kill(p.pid, signal.SIGUSR1)
        t0 = time.time()
        reqs, lost = [], []
        while time.time() - t0 < duration:
            a = time.time()
            try:
                _post(url, body)
            except (urllib.error.URLError, OSError) as e:  # an HTTPError too: not answered
                lost.append((a - t0, time.time() - a, str(e)))
                time.sleep(0.2)
                continue
            reqs.append((a - t0, time.time() - a))
        metrics = json.loads(urllib.request.urlopen(url + "/metrics", timeout=60).read())
    return {"t0": t0, "requests": reqs, "lost": lost, "metrics": metrics, "command": cmd}


def _post(url: str, body: bytes) -> None:
    req = urllib.request.Request(url + "/v1/embeddings", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        r.read()


# --- oracle plans --------------------------------------------------------------------------------

def oracle_plan(spec: dict, model: str, seq: int, work: Path, k: int) -> tuple[Path, Path]:
    """`hepti profile` on `spec` (a `steady_spec`: one phase's conditions, no schedule), then
    `hepti plan`: (the spec's file, the plan's file)."""
    spec_path = work / f"oracle-{k}.json"
    spec_path.write_text(json.dumps(spec))
    n = len(spec["devices"])
    prof, plan = work / f"profile-{k}.json", work / f"plan-{k}.json"
    launch(["hepti", "profile", "--model", model, "--seq", str(seq), "--out", str(prof)],
           ranks=n, spec=spec_path)
    launch([*hepti_cmd(), "plan", "--model", model, "--profile", str(prof), "--seq", str(seq),
            "--out", str(plan)], timeout=600)
    return spec_path, plan


# --- figures ----------------------------------------------------------------------------------------

def in_phase(reqs, ph) -> list[float]:
    return [lat for t, lat in reqs if ph["start"] <= t < ph["end"]]


def phase_lats(run: dict, ph: dict) -> list[float]:
    """A run's latencies for phase `ph`: those of requests sent during it, or, for a steady run
    (one phase's conditions from its start, `steady_spec`), those of its first end - start s."""
    if run.get("steady"):
        return [lat for t, lat in run["requests"] if t < ph["end"] - ph["start"]]
    return in_phase(run["requests"], ph)


def longest_wait(run: dict, t_ev: float, t_end: float) -> float | None:
    """The longest a client waited for an answer from `t_ev` on, through `t_end`: from the
    event, or from the answer before, to the next answer (s). After a device hangs or its link
    goes silent, the time to the first answer; None if none came at all."""
    prev, worst = t_ev, None
    for c in sorted(t + lat for t, lat in run["requests"]):
        if c <= t_ev:
            continue
        if c > t_end and worst is not None:
            break
        worst = max(worst or 0.0, c - prev)
        prev = c
    return worst


def time_weighted(lats: list[float]) -> float | None:
    return sum(x * x for x in lats) / sum(lats) if lats else None


def summarize(runs: dict, phs: list[dict], oracle_of_phase: list[str | None]) -> dict:
    out = {"phases": [], "variants": {}}
    piecewise = []
    for i, ph in enumerate(phs):
        row = {"start": ph["start"], "end": ph["end"], "median_ms": {}}
        o = oracle_of_phase[i]
        for name, r in runs.items():
            lats = phase_lats(r, ph) if not r.get("steady") or name == o else []
            row["median_ms"][name] = statistics.median(lats) * 1e3 if lats else None
        row["oracle"] = o
        if o in runs:
            piecewise += phase_lats(runs[o], ph)
        out["phases"].append(row)
    out["piecewise_oracle_tw_ms"] = (time_weighted(piecewise) or 0) * 1e3
    for name, r in runs.items():
        lats = [lat for _, lat in r["requests"]]
        tw = time_weighted(lats)
        out["variants"][name] = {"requests": len(lats), "lost": len(r.get("lost", [])),
                                 "time_weighted_ms": tw * 1e3 if tw else None,
                                 "vs_piecewise_oracle": (tw * 1e3 / out["piecewise_oracle_tw_ms"])
                                 if tw and out["piecewise_oracle_tw_ms"] else None}
    if "adaptive" in runs:
        out["events"] = events_figures(runs["adaptive"], phs, runs, oracle_of_phase)
    return out


def events_figures(run: dict, phs: list[dict], runs: dict, oracle_of_phase) -> list[dict]:
    """Per phase change: when the adaptive service first flagged it (a monitor flag or a
    re-plan, whichever came first), when it first re-planned, its recovery, the longest wait
    for an answer from the event on (`longest_wait`) and the requests lost; for a phase
    whose conditions are the first phase's (a restore), the revert against the plan made at
    t = 0 (`static`) in the same phase."""
    t0, reqs = run["t0"], run["requests"]
    replans = [dict(e, at=e["t"] - t0) for e in run["metrics"].get("replans", []) if "t" in e]
    flags = [dict(e, at=e["t"] - t0) for e in run["metrics"].get("flags", []) if "t" in e]
    out = []

    def after_event(t_ev, at):
        return {"s": at - t_ev, "requests": sum(1 for t, lat in reqs if t_ev <= t + lat <= at)}
    for i, ph in enumerate(phs[1:], 1):
        t_ev = ph["start"]
        row = {"t": t_ev, "flagged_after_s": None, "flagged_after_requests": None,
               "replanned_after_s": None, "replanned_after_requests": None}
        acted = next((e for e in replans if t_ev <= e["at"] < ph["end"]), None)
        seen = [e for e in flags + replans if t_ev <= e["at"] < ph["end"]]
        if seen:
            first = min(seen, key=lambda e: e["at"])
            a = after_event(t_ev, first["at"])
            row.update(flagged_after_s=a["s"], flagged_after_requests=a["requests"],
                       flag=first.get("reason") or f"rank {first.get('rank')} {first.get('kind')} "
                                                    f"{first.get('factor', 0):.2f}x")
        if acted is not None:
            a = after_event(t_ev, acted["at"])
            row.update(replanned_after_s=a["s"], replanned_after_requests=a["requests"],
                       decision=acted.get("decision"), reason=acted.get("reason"))
        after = [(t, lat) for t, lat in reqs if t >= t_ev and t < ph["end"]]
        nxt = [lat for _, lat in after[RECOVER_WITHIN:RECOVER_WITHIN + RECOVER_NEXT]]
        o = oracle_of_phase[i]
        o_lats = phase_lats(runs[o], ph) if o in runs else []
        oracle = statistics.median(o_lats) if o_lats else None
        row["first_answer_s"] = longest_wait(run, t_ev, ph["end"])
        row["lost"] = sum(1 for t, *_ in run.get("lost", []) if t_ev <= t < ph["end"])
        if nxt and oracle:
            row["recovered_median_ms"] = statistics.median(nxt) * 1e3
            row["oracle_median_ms"] = oracle * 1e3
            row["ratio"] = statistics.median(nxt) / oracle
            row["met"] = row["ratio"] <= RECOVER_RATIO
        if conditions_key(ph["devices"]) == conditions_key(phs[0]["devices"]) and "static" in runs:
            orig = in_phase(runs["static"]["requests"], ph)
            if nxt and orig:
                row["revert_vs_original_plan"] = statistics.median(nxt) / statistics.median(orig)
                row["revert_met"] = row["revert_vs_original_plan"] <= REVERT_RATIO
        out.append(row)
    return out


def switches(replans: list[dict]) -> list[dict]:
    """The re-plan events that changed the plan (a switch or a rollback), of /metrics' list."""
    return [e for e in replans if e.get("decision") in ("switch", "rollback")]


def quiet_pairs(spec_path: Path, model: str, n: int, pairs: int, duration: float, seq: int,
                port: int, work: Path) -> dict:
    """No changes: `pairs` x (--replan on, --replan off), interleaved, `duration` s each. The
    monitor's overhead (the median over pairs of on's median latency over off's) and what it
    did with nothing to find (re-plans and flags over every `on` run)."""
    replans, flags = [], []

    def one(mode: str, k: int) -> dict:
        print(f"[bench-adapt] quiet pair {k + 1}/{pairs}: --replan {mode}", file=sys.stderr, flush=True)
        r = served_run(spec_path, model, n, ["--strategy", "auto", "--replan", mode], duration,
                       seq, port, work / f"quiet-{k}-{mode}.log")
        r["mode"] = mode
        if mode == "on":
            replans.extend(r["metrics"].get("replans", []))
            flags.extend(r["metrics"].get("flags", []))
        return r
    by_mode = interleave(["on", "off"], pairs, one)
    runs = [r for pair in zip(by_mode["on"], by_mode["off"]) for r in pair]
    ratios = [statistics.median(lat for _, lat in on["requests"])
              / statistics.median(lat for _, lat in off["requests"])
              for on, off in zip(by_mode["on"], by_mode["off"])]
    return {"pairs": pairs, "duration_s": duration, "on_over_off": ratios,
            "overhead_median_ratio": statistics.median(ratios),
            "replans": replans, "flags": flags, "watched_s": pairs * duration,
            "switches": len(switches(replans)),
            "runs": runs}


def quiet_ab(spec_path: Path, model: str, n: int, duration: float, every: int, seq: int,
             port: int, work: Path) -> dict:
    """No changes, one launch: --replan on with the monitor paused for every other run of
    `every` batches (`hepti serve --replan-ab`). The overhead is the median over adjacent
    (on, off) runs of on's median latency over off's. Why one launch: launches of the same
    service differ by more than the 1% looked for. Quiet pairs of 60 s launches on
    emu-drift4 (2026-11-27) read off at 0.746 and 0.816 s and on at 0.762 and 0.780 s, and of
    two --replan on launches one spent 6-9% more CPU per request on each busy device than the
    other; within a launch, runs of 20 requests take turns every 15 s, so a drift of the shared
    machine falls on both alike."""
    r = served_run(spec_path, model, n, ["--strategy", "auto", "--replan", "on",
                                         "--replan-ab", str(every)],
                   duration, seq, port, work / "quiet-ab.log")
    ab = (r["metrics"].get("monitor_ab") or {}).get("runs") or []
    # whole runs only (the first and the last may be cut short), paired as they ran
    full = [x for x in ab if len(x["latencies_ms"]) >= every]
    pairs = []
    for a, b in zip(full, full[1:]):
        if b["run"] == a["run"] + 1 and a["monitor"] != b["monitor"]:
            on, off = (a, b) if a["monitor"] else (b, a)
            if not pairs or pairs[-1]["runs"][1] < min(a["run"], b["run"]):  # disjoint pairs
                pairs.append({"runs": [a["run"], b["run"]],
                              "on_ms": statistics.median(on["latencies_ms"]),
                              "off_ms": statistics.median(off["latencies_ms"])})
    ratios = [p["on_ms"] / p["off_ms"] for p in pairs]
    replans = r["metrics"].get("replans", [])
    return {"ab_every": every, "ab_duration_s": duration, "ab_pairs": pairs,
            "ab_on_over_off": ratios,
            "ab_overhead_median_ratio": statistics.median(ratios) if ratios else None,
            "ab_switches": len(switches(replans)),
            "ab_replans": replans, "ab_run": r}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def combine(rounds: list[dict]) -> dict:
    """The figures over rounds: each is taken within its round (adaptive against that round's
    oracle) and the median over rounds is quoted; the worst round's detection and switches,
    since a bound must hold in every round. Each round's own summary stays under `rounds`."""
    sums = [r["summary"] for r in rounds]
    first = sums[0]
    out: dict = {"rounds": len(sums), "phases": [], "variants": {}}
    for i, ph in enumerate(first["phases"]):
        out["phases"].append({"start": ph["start"], "end": ph["end"], "oracle": ph["oracle"],
                              "median_ms": {v: _median([s["phases"][i]["median_ms"].get(v) for s in sums])
                                            for v in ph["median_ms"]}})
    out["piecewise_oracle_tw_ms"] = _median([s["piecewise_oracle_tw_ms"] for s in sums])
    for v in first["variants"]:
        per = [s["variants"][v] for s in sums]
        out["variants"][v] = {"time_weighted_ms": _median([x["time_weighted_ms"] for x in per]),
                              "lost": [x.get("lost", 0) for x in per],
                              "vs_piecewise_oracle": _median([x["vs_piecewise_oracle"] for x in per]),
                              "vs_piecewise_oracle_rounds": [x["vs_piecewise_oracle"] for x in per],
                              "requests": [x["requests"] for x in per]}
    if "events" in first:
        out["events"] = []
        for i, ev in enumerate(first["events"]):
            per = [s["events"][i] for s in sums]
            row = {"t": ev["t"]}
            for k in ("flagged_after_s", "flagged_after_requests", "replanned_after_s",
                      "replanned_after_requests", "first_answer_s", "lost"):
                vals = [e[k] for e in per]
                row[k + "_worst"] = None if None in vals else max(vals)
                row[k + "_rounds"] = vals
            for k in ("ratio", "revert_vs_original_plan"):
                vals = [e.get(k) for e in per]
                if any(x is not None for x in vals):
                    row[k] = _median(vals)
                    row[k + "_rounds"] = vals
            if "ratio" in row:
                row["met"] = row["ratio"] <= RECOVER_RATIO
            if "revert_vs_original_plan" in row:
                row["revert_met"] = row["revert_vs_original_plan"] <= REVERT_RATIO
            out["events"].append(row)
    if "flap" in first:
        per = [s["flap"] for s in sums]
        out["flap"] = {"switches_rounds": [f["switches"] for f in per],
                       "switches_worst": max(f["switches"] for f in per),
                       "adaptive_vs_best_static": _median([f["adaptive_vs_best_static"] for f in per]),
                       "adaptive_vs_best_static_rounds": [f["adaptive_vs_best_static"] for f in per]}
    return out


def plot(runs: dict, phs: list[dict], path: Path) -> bool:
    try:
        import matplotlib  # local: optional dependency
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # local: optional dependency
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(11, 5))
    for name, r in runs.items():
        ax.plot([t for t, _ in r["requests"]], [lat * 1e3 for _, lat in r["requests"]], label=name,
                lw=1.4 if name == "adaptive" else 0.8, alpha=1.0 if name == "adaptive" else 0.6)
    for ph in phs[1:]:
        ax.axvline(ph["start"], color="k", ls="--", lw=0.8)
    if "adaptive" in runs:
        r = runs["adaptive"]
        for e in switches(r["metrics"].get("replans", [])):
            if "t" in e:
                ax.axvline(e["t"] - r["t0"], color="tab:red", lw=0.6, alpha=0.6)
    ax.set_xlabel("s since the schedule started (dashed: events; red: adaptive's switches)")
    ax.set_ylabel("request latency, ms")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def flap_spec(base: dict, duration: float, lead: float = 0.0) -> dict:
    """node-c's link 940 -> 100 Mbit/s at lead + 2 s, back at lead + 4 s, and so on every 2 s
    until lead + duration."""
    spec = copy.deepcopy(base)
    spec["name"] = "emu-drift4-flap"
    spec["schedule"] = [{"t": lead + t, "device": "node-c", "link_mbit": 100 if (t // 2) % 2 else 940}
                        for t in range(2, int(duration), 2)]
    return spec


def flap_figures(runs: dict, ph: dict) -> dict:
    """The flapping phase's figures: adaptive's time-weighted latency over the better static
    plan's, both over the phase's requests alone, and adaptive's switches in the run."""
    tw = {v: time_weighted(in_phase(r["requests"], ph)) for v, r in runs.items()}
    best_static = min(tw[v] for v in runs if v.startswith("static-"))
    return {"switches": len(switches(runs["adaptive"]["metrics"].get("replans", []))),
            "phase": [ph["start"], ph["end"]],
            "adaptive_tw_ms": tw["adaptive"] * 1e3, "best_static_tw_ms": best_static * 1e3,
            "adaptive_vs_best_static": tw["adaptive"] / best_static}


def add_arguments(ap) -> None:
    ap.add_argument("--duration", type=float, default=100.0, help="seconds of requests per run")
    ap.add_argument("--seq", type=int, default=256, help="tokens per request (default 256)")
    ap.add_argument("--model", default="weights/bert-base")
    ap.add_argument("--variants", default=None,
                    help="comma-separated, of adaptive, static, oracle, even (default all four; "
                         "adaptive,oracle when the schedule hangs a device or silences a link, "
                         "where a fixed plan and even shares recover as adaptive does)")
    ap.add_argument("--spec", default=None, metavar="SPEC.json",
                    help="another emulated cluster with its schedule (default "
                         "hostfiles/emu-drift4.json; --flap flaps its device named node-c), e.g. "
                         "hostfiles/emu-drop3.json, issue 44's")
    ap.add_argument("--flap", action="store_true", help="the flapping-link scenario instead")
    ap.add_argument("--flap-after", type=float, default=20.0, metavar="S",
                    help="--flap: serve S seconds on the steady link before the flapping starts "
                         "(as a service runs before a link goes bad), then --duration seconds of "
                         "flapping, which alone the figures cover (default 20; 0: flapping from "
                         "the first request, before the monitor has its baselines)")
    ap.add_argument("--quiet", type=int, default=0, metavar="PAIRS",
                    help="no schedule: PAIRS interleaved --replan on/off runs of --duration s "
                         "each (the monitor's overhead, and re-plans with nothing to find); "
                         "writes results/adapt-quiet.json")
    ap.add_argument("--quiet-ab", type=float, default=0.0, metavar="SECONDS",
                    help="one launch of SECONDS, no schedule, with the monitor paused for every "
                         "other run of --ab-every batches (`hepti serve --replan-ab`): the "
                         "monitor's overhead free of the spread between launches; after "
                         "--quiet's pairs if given, else alone (results/adapt-quiet-ab.json)")
    ap.add_argument("--ab-every", type=int, default=20, metavar="N",
                    help="batches per run under --quiet-ab (default 20)")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="run every variant once per round, in a rotated order, this many rounds; "
                         "figures are taken within a round and their median quoted (default 3)")
    ap.add_argument("--port", type=int, default=8790)
    ap.add_argument("--out", default=None, help="default results/adapt.json (results/adapt-flap.json)")


def run(args) -> int:
    if os.geteuid() != 0:
        print("bench-adapt: needs root (hepti emulate)", file=sys.stderr)
        return 2
    if not (Path(args.model) / "index.json").exists():
        print(f"bench-adapt: no converted model in {args.model}; make it with "
              f"`hepti convert --random bert-base --out {args.model}`", file=sys.stderr)
        return 2
    out = Path(args.out or ("results/adapt-flap.json" if args.flap else
                            "results/adapt-quiet.json" if args.quiet else
                            "results/adapt-quiet-ab.json" if args.quiet_ab else "results/adapt.json"))
    commit = git_commit()
    base = json.loads(Path(args.spec or SPEC).read_text())
    n = len(base["devices"])
    lead = args.flap_after if args.flap else 0.0
    run_s = lead + args.duration  # each run's seconds of requests
    spec = flap_spec(base, args.duration, lead) if args.flap else base
    work = Path(tempfile.mkdtemp(prefix="hepti-adapt-"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(spec))
    if args.quiet or args.quiet_ab:
        quiet = {k: v for k, v in base.items() if k != "schedule"}
        spec_path.write_text(json.dumps(quiet))
        res = {}
        if args.quiet:
            res = quiet_pairs(spec_path, args.model, n, args.quiet, args.duration, args.seq,
                              args.port, work)
        if args.quiet_ab:
            res.update(quiet_ab(spec_path, args.model, n, args.quiet_ab, args.ab_every, args.seq,
                                args.port, work))
        doc = result_doc("adapt-quiet", commit=commit, spec=quiet, seq=args.seq, model=args.model,
                         **res)
        write_json(doc, out)
        print(json.dumps({k: v for k, v in res.items() if k not in ("runs", "ab_run")}, indent=1))
        print(f"wrote {out}")
        return 0
    phs = phases(spec, args.duration) if not args.flap else (
        ([{"start": 0.0, "end": lead, "devices": base["devices"]}] if lead else [])
        + [{"start": lead, "end": run_s, "devices": base["devices"]}])
    # A device out (hung, silent) in some phase: every oracle is a steady run of its phase's
    # conditions on the devices that answer (a service started fresh there), since a fixed plan
    # on the scheduled spec would itself stall and recover in the outage and after it.
    outage = any(is_out(d) for ph in phs for d in ph["devices"])
    variants = (args.variants or ("adaptive,oracle" if outage else "adaptive,static,oracle,even")).split(",")
    serve = {"adaptive": ["--strategy", "auto", "--replan", "on"], "static": ["--strategy", "auto"],
             "even": ["--strategy", "even"]}
    # oracle plans: one per distinct condition (for --flap: the two links)
    oracle_of_phase: list[str | None] = [None] * len(phs)
    plans: dict[str, Path] = {}
    launches: dict[str, tuple[Path, int, float]] = {}  # variant -> (spec, ranks, seconds), if not the run's
    if "oracle" in variants or args.flap:
        if args.flap:
            slow = copy.deepcopy(base["devices"])
            slow[2]["link_mbit"] = 100
            conds = [("link-940", base["devices"]), ("link-100", slow)]
            for name, devs in conds:
                _, plans[name] = oracle_plan(steady_spec(base, devs, f"adapt-oracle-{len(plans)}"),
                                             args.model, args.seq, work, len(plans))
                serve[f"static-{name}"] = ["--plan", str(plans[name])]
        else:
            seen: dict[str, str] = {}
            for i, ph in enumerate(phs):
                key = conditions_key(ph["devices"])
                if key not in seen:
                    name = f"oracle-{len(seen)}"
                    print(f"[bench-adapt] profiling and planning {name} (phase {ph['start']:g}-"
                          f"{ph['end']:g} s)", file=sys.stderr, flush=True)
                    steady = steady_spec(base, ph["devices"], f"adapt-oracle-{i}")
                    o_spec, plans[name] = oracle_plan(steady, args.model, args.seq, work, i)
                    serve[name] = ["--plan", str(plans[name])]
                    if outage:
                        longest = max(p["end"] - p["start"] for p in phs
                                      if conditions_key(p["devices"]) == key)
                        launches[name] = (o_spec, len(steady["devices"]), longest)
                    seen[key] = name
                oracle_of_phase[i] = seen[key]
    names = ([v for v in variants if v != "oracle"] + [k for k in serve if k.startswith("oracle-")]
             if not args.flap else ["adaptive"] + [k for k in serve if k.startswith("static-")])

    def one(name: str, k: int) -> dict:
        where, ranks, secs = launches.get(name, (spec_path, n, run_s))
        print(f"[bench-adapt] round {k + 1}/{args.rounds}, {name}: {secs:g} s of requests"
              + (f" on the {ranks} devices that answer, held still" if name in launches else ""),
              file=sys.stderr, flush=True)
        r = served_run(where, args.model, ranks, serve[name], secs, args.seq, args.port,
                       work / f"{name}-{k}.log")
        r["steady"] = name in launches
        lats = [lat for _, lat in r["requests"]]
        print(f"[bench-adapt] {name}: {len(lats)} requests, median {statistics.median(lats) * 1e3:.0f} ms"
              + (f", {len(r['lost'])} lost" if r["lost"] else ""), file=sys.stderr, flush=True)
        return r
    by_name = interleave(names, args.rounds, one)
    rounds = []
    for k in range(args.rounds):
        runs = {name: by_name[name][k] for name in names}  # the same key order in every round
        summary = summarize(runs, phs, oracle_of_phase)
        if args.flap:
            summary["flap"] = flap_figures(runs, phs[-1])
        rounds.append({"order": round_order(names, k), "summary": summary, "runs": runs})
    summary = combine(rounds)
    doc = result_doc("adapt", commit=commit, spec=spec, duration_s=args.duration, seq=args.seq,
                     model=args.model, phases=[{k: v for k, v in p.items()} for p in phs],
                     plans={k: json.loads(v.read_text()) for k, v in plans.items()},
                     summary=summary, rounds=rounds)
    write_json(doc, out)
    write_csv([{"round": k, "variant": name, "t_s": f"{t:.3f}", "latency_ms": f"{lat * 1e3:.2f}"}
               for k, rd in enumerate(rounds) for name, r in rd["runs"].items() for t, lat in r["requests"]],
              ["round", "variant", "t_s", "latency_ms"], out.with_suffix(".csv"))
    # the plot shows the round whose adaptive figure is the median one
    key = "adaptive_vs_best_static" if args.flap else None
    fig = [rd["summary"]["flap"][key] if key else rd["summary"]["variants"]["adaptive"]["vs_piecewise_oracle"]
           for rd in rounds]
    mid = sorted(range(len(rounds)), key=lambda k: fig[k] or 0)[len(rounds) // 2]
    drawn = plot(rounds[mid]["runs"], phs, out.with_suffix(".png"))
    if not drawn:
        drop_stale(out.with_suffix(".png"), "bench-adapt", "no plot drawn (matplotlib missing)")
    print(json.dumps(summary, indent=1))
    print(f"wrote {out}, {out.with_suffix('.csv')}" + (f", {out.with_suffix('.png')} (round {mid + 1})" if drawn else ""))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
