"""`hepti bench hetero` (bin/bench-hetero.sh, root): hepti's plans against the baselines on
emulated heterogeneous clusters.

For each cluster spec (hostfiles/emu-*.json) and model case, every strategy runs in its own
launch, `hepti emulate --cluster SPEC -- mpiexec -n N hepti run --repeat R --json`, so an
out-of-memory kill is the launch's own and the baselines run in the same runtime as hepti:

1. `auto` first, with a fresh profile cache per spec: it profiles the devices under the
   emulation, plans and runs. (A CNN's every strategy, `auto` too, is planned from a profile
   taken as each round starts.) Its cached profile is the one the baselines are planned with
   (`--profile`), so every strategy gets a prediction from the same measurements. (Specs whose
   device names are equal would share one cache entry otherwise; emu-mixed4/tight/starved do.)
2. Each baseline (`even`, `proportional`, `pipeline`, `single`) is first planned in this
   process: when the planner says it cannot fit the devices' memory it is recorded as
   `cannot_run` with the planner's reason instead of being run into an OOM kill
   (`--run-unfit` runs it anyway). Extra strategies (default: `rows` on emu-tight) are run
   as they are, so a refusal is the runtime planner's own.
3. R (timed runs inside one launch, after a warm-up run) is chosen from the prediction so a
   launch times about `--target-s` seconds, between `--min-repeat` and `--repeat`.
4. `--rounds` K (default 3): the strategies above run K times, taking turns (round k starts k
   strategies further on: hepti.bench.harness.round_order). A strategy's figure is the median of
   its rounds' medians, the range of those its spread (`hetero_report.merge_rounds`);
   `round_runs` in the JSON keeps every launch. The targets check every strategy against its own
   prediction, and `auto` against the fastest strategy and against `single` beyond the spread
   (issue 16).

The default set, about 15 minutes a round here: BERT-base @256 tokens on every spec, MiniLM @128,
BERT-large @128 and ViT-L/16 @224 (197 tokens) on emu-mixed4 only (`--case` changes it); `--quick` is one pair spec with
MiniLM, one round, the page cache kept (under 2 minutes). Each record keeps the machine's load average around its
launch: device quotas are caps, so other jobs on a shared machine slow the devices down.

Numba's cache is warmed outside the emulation first (a 0.15-core device compiling kernels would
take minutes and LLVM's memory could exceed its cap). The figure per run is the median latency
over its R runs; per-rank compute and communication are the medians the runtime reports, next to
the planner's predicted ones. Results: results/hetero.json, hetero.csv, hetero.png and a table.
"""
from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from hepti.families import family
from hepti.bench import harness
from hepti.bench.harness import HOSTFILES, drop_stale, git_commit, hepti_cmd, positive_int, result_doc, write_json
from hepti.bench.registry import build_parser, module_main
from hepti.bench import hetero_report as report
from hepti.bench.scaling import synthetic_input
from hepti.emulate import stretch
from hepti.emulate.spec import load_spec
from hepti.errors import HeptiError
from hepti.plan.coedge import make_cnn_plan
from hepti.plan.partition import make_plan
from hepti.plan.profile import load_profile
from hepti.weights import WeightStore

SPECS = ("emu-mixed4", "emu-tight", "emu-starved", "emu-pair-940-full", "emu-pair-940-quarter",
         "emu-pair-240-full", "emu-pair-240-quarter")
STRATEGIES = ("auto", "even", "proportional", "pipeline", "single")
BASELINES = ("even", "proportional", "pipeline", "single")  # checked against memory before a launch
# a CNN's (SEQ is its image side): CoEdge's LP, and the baselines of issue 19
CNN_STRATEGIES = ("auto", "even", "proportional", "grid", "pipeline", "single")
# issue 19's fusing choice: auto at fixed fusing depths ("auto/fuseK": --fuse-depth K; 0: all
# layers), next to auto's own choice, on a slow and a fast link
FUSE_DEPTHS = (1, 2, 4, 8, 0)
EXTRA = ("emu-tight:rows",) + tuple(f"{sp}:auto/fuse{k}" for sp in ("emu-pair-240-full",
                                                                     "emu-pair-940-full")
                                    for k in FUSE_DEPTHS)
CASES = ("weights/bert-base:256", "weights/minilm-l6:128:emu-mixed4", "weights/bert-large:128:emu-mixed4",
         "weights/vit-large:197:emu-mixed4", "weights/resnet50:224:emu-mixed4",
         "weights/mobilenet-v2:224:emu-mixed4+emu-pair-240-full+emu-pair-940-full")
# --quick keeps the page cache: its launches are checked for running, not timed against a cold
# disk, and each drop cost a launch 13 -> 19 s here (this machine's Python libraries and
# Numba's cache read back from disk), and slowed whatever else ran beside it
QUICK = {"spec": ["emu-pair-940-quarter"], "case": ["weights/minilm-l6:128"], "repeat": 3, "rounds": 1,
         "min_repeat": 2, "target_s": 2.0, "timeout": 120.0, "keep_page_cache": True}
LAUNCHER_OOM = re.compile(r"rank \d+ \(device [^)]*\) was killed by the out-of-memory killer[^\n]*")


# --- launching ---------------------------------------------------------------------------------

def launch(spec_path: Path, n: int, hepti_args: list[str], cache: Path, timeout: float,
           workdir: Path, keep_page_cache: bool = False) -> dict:
    """One `hepti emulate ... -- mpiexec -n n hepti ARGS`: return code, stdout, stderr, the
    launcher's summary (OOM kills and peak memory per device) and the wall time."""
    summary = workdir / f"summary-{time.monotonic_ns()}.json"
    emulate = ["--summary", str(summary)] + (["--keep-page-cache"] if keep_page_cache else [])
    res = harness.launch(hepti_cmd() + hepti_args, ranks=n, spec=spec_path,
                         emulate=emulate, env={"HEPTI_CACHE": str(cache)},
                         timeout=timeout, check=False)
    out = {"rc": res.rc, "stdout": res.stdout, "stderr": res.stderr, "wall_s": res.wall_s,
           "summary": None, "loadavg_1min": res.loadavg_1min}
    if summary.exists():
        out["summary"] = json.loads(summary.read_text())
        summary.unlink()
    return out


def _error_lines(stderr: str) -> list[str]:
    return [ln.strip() for ln in stderr.splitlines()
            if ln.strip() and not ln.startswith("[hepti emulate]") and "%|" not in ln]


def classify(res: dict) -> tuple[str, str, dict | None]:
    """(status, reason, hepti's JSON report) of one launch."""
    summ = res["summary"] or {}
    killed = [d for d in summ.get("devices", []) if d.get("oom_kills")]
    if killed:
        msgs = LAUNCHER_OOM.findall(res["stderr"])
        return "oom", "; ".join(msgs) or "out-of-memory kill on " + ", ".join(d["name"] for d in killed), None
    if summ.get("timed_out") or res["rc"] == 124:
        return "timeout", f"stopped after the time limit ({res['wall_s']:.0f} s)", None
    if res["rc"] == 0:
        try:
            return "ok", "", json.loads(res["stdout"])
        except json.JSONDecodeError:
            return "failed", "exit 0 but no JSON report on stdout", None
    lines = _error_lines(res["stderr"])
    refusal = [ln.split("error:", 1)[1].strip() for ln in lines if ln.startswith("hepti run: error:")]
    if res["rc"] == 2 and refusal:
        return "refused", refusal[-1], None
    launcher = [ln for ln in res["stderr"].splitlines() if ln.startswith("hepti emulate: error:")]
    reason = launcher[-1] if launcher else " | ".join(lines[-3:]) or f"exit code {res['rc']}"
    return "failed", f"exit {res['rc']}: {reason}", None


def run_record(spec, case: dict, strategy: str, status: str, reason: str, rep: dict | None,
               res: dict | None, repeat: int | None) -> dict:
    """The result record of one strategy on one spec (see hepti.bench.hetero_report)."""
    rec = {"spec": spec.name, "model": case["name"], "seq": case["seq"], "strategy": strategy,
           "status": status, "reason": reason, "repeat": repeat,
           "launch_s": None if res is None else round(res["wall_s"], 2),
           # the machine's 1-minute load average before and after the launch: other jobs on
           # this shared machine slow the emulated devices down (their quotas are caps, not
           # shares). hepti emulate's idle fillers (one SCHED_IDLE loop per CPU) count in it
           # while a launch runs: about +1 per CPU, decaying over the next minute
           "loadavg_1min": None if res is None else res.get("loadavg_1min")}
    devices = (res or {}).get("summary") or {}
    dev = {d["device"]: d for d in devices.get("devices", [])}
    if rep is None:
        if dev:
            rec["per_rank"] = [{"rank": i, "host": d["name"], "device_peak_mem_bytes": d.get("peak_mem_bytes"),
                                "mem_cap_bytes": d.get("mem_bytes"), "oom_kills": d.get("oom_kills")}
                               for i, d in sorted(dev.items())]
        return rec
    med = rep["latency_s"]["median"]
    pred = rep.get("predicted_latency_s")
    rec.update({"ran": rep["strategy"], "active_ranks": rep.get("active_ranks"), "counts": rep.get("counts"),
                "groups": len(rep["groups"]) if rep.get("groups") else None,
                "median_latency_s": med, "latencies_s": rep["latency_s"]["runs"],
                "predicted_latency_s": pred, "prediction_error": None if not pred else med / pred - 1,
                "load_s": rep.get("load_s"), "mem_budget": rep.get("mem_budget"),
                "explanation": rep.get("explanation", "")})
    ranks = []
    for s in rep["per_rank"]:
        p = s.get("predicted") or {}
        d = dev.get(s["rank"], {})
        ranks.append({"rank": s["rank"], "host": s["host"], "active": s["active"],
                      "compute_s": s["compute_s"], "comm_s": s["comm_s"], "comm_total_s": s["comm_total_s"],
                      "io_wait_s": s.get("io_wait_s"), "bytes_sent": s["bytes_sent"], "bytes_recv": s["bytes_recv"],
                      "predicted_compute_s": p.get("compute_s"),
                      "predicted_comm_s": sum(p["comm_s"].values()) if p.get("comm_s") is not None
                      else None,
                      "predicted_comm_by_kind_s": p.get("comm_s"), "predicted_wait_s": p.get("wait_s"),
                      "predicted_mem_bytes": p.get("mem_bytes"),
                      "weight_bytes_resident": s["weight_bytes_resident"], "peak_rss_bytes": s["peak_rss_bytes"],
                      "device_peak_mem_bytes": d.get("peak_mem_bytes"), "mem_cap_bytes": d.get("mem_bytes"),
                      "oom_kills": d.get("oom_kills")})
    rec["per_rank"] = ranks
    return rec


# --- planning in this process (predictions, memory pre-check) ---------------------------------

def find_cached_profile(cache: Path, n: int, model_name: str) -> Path | None:
    """The profile `auto` measured and cached for this spec and model (newest first)."""
    paths = sorted(glob.glob(str(cache / f"profile-*-n{n}-*.json")), key=os.path.getmtime, reverse=True)
    for p in paths:
        try:
            if json.loads(Path(p).read_text()).get("model") in (model_name, None):
                return Path(p)
        except (OSError, json.JSONDecodeError):
            continue
    return None


def plan_baseline(case: dict, profile_path: Path, strategy: str):
    """(plan or None, reason it cannot run or ''): the planner's view of a baseline."""
    try:
        if family(case["config"]).executor == "bands":
            name, _, fuse = strategy.partition("/fuse")
            return make_cnn_plan(case["config"], load_profile(profile_path), name,
                                 fuse_depth=int(fuse) if fuse else None), ""
        plan = make_plan(case["config"], load_profile(profile_path), case["seq"], 1, strategy=strategy)
    except HeptiError as e:
        return None, f"the planner refuses it: {e}"
    if not plan.predicted.get("fits_memory", True):
        caps = plan.predicted.get("mem_caps", [])
        over = [f"rank {r['rank']} needs {r['mem_bytes'] / 2**20:,.0f} MiB but has {caps[r['rank']] / 2**20:,.0f} MiB"
                for r in plan.predicted["per_rank"] if r["active"] and r["mem_bytes"] > caps[r["rank"]]]
        return plan, "does not fit memory (planner): " + "; ".join(over)
    return plan, ""


UNPLANNED_REPEAT = 6  # `auto` plans inside its launch, so nothing predicts its length here


def choose_repeat(predicted_s: float | None, args) -> int:
    """Timed runs per launch: about target_s seconds of them, within [min_repeat, repeat];
    UNPLANNED_REPEAT (at most `repeat`) without a prediction: 20 runs of auto on BERT-large took
    the full run from 873 s to 941 s, past its 15-minute budget."""
    if not predicted_s:
        return min(args.repeat, UNPLANNED_REPEAT)
    return int(min(args.repeat, max(args.min_repeat, math.ceil(args.target_s / predicted_s))))


def profile_summary(spec, case: dict, profile_path: Path, source: str) -> dict:
    """The profile next to the spec: measured link rate and memory against the spec's, and
    GeMM speed per core of CPU share (equal across devices when the caps are faithful)."""
    prof = json.loads(profile_path.read_text())
    devs = []
    for d, dev in zip(prof["devices"], spec.devices):
        g = d["gemm_flops"]
        peak = max(v for _, v in g) if isinstance(g, list) else g
        devs.append({"rank": d["rank"], "host": d.get("host"), "cpu_share": dev.cpu,
                     "gemm_peak_gflops": round(peak / 1e9, 2),
                     "gemm_gflops_per_core_share": round(peak / 1e9 / dev.cpu, 1),
                     "link_mbit_spec": dev.link_mbit,
                     "link_mbit_profiled": round(d["bandwidth_Bps"] * 8 / 1e6, 1),
                     "latency_ms_profiled": round(d["latency_s"] * 1e3, 3),
                     "mem_cap_mib_spec": None if dev.mem_bytes is None else round(dev.mem_bytes / 2**20),
                     "memory_mib_profiled": round(d["memory_bytes"] / 2**20)})
    return {"spec": spec.name, "model": case["name"], "seq": case["seq"], "source": source,
            "devices": devs, "profile": prof}


# --- the sweep ---------------------------------------------------------------------------------

def parse_case(text: str, specs: list[str]) -> dict:
    """MODEL_DIR:SEQ[:SPEC+SPEC...] -> {"dir", "name", "seq", "specs"}."""
    parts = text.split(":")
    if len(parts) not in (2, 3) or not parts[1].isdigit():
        raise SystemExit(f"--case {text!r}: write MODEL_DIR:SEQ or MODEL_DIR:SEQ:SPEC+SPEC")
    only = parts[2].split("+") if len(parts) == 3 else list(specs)
    return {"dir": parts[0], "name": Path(parts[0]).name, "seq": int(parts[1]),
            "specs": [s for s in only if s in specs]}


def make_inputs(case: dict, workdir: Path) -> None:
    """Fixed-shape synthetic input (no padding: token ids, or a vision model's pixels) and the
    model's config, into the case."""
    case["input"] = list(synthetic_input(case["dir"], case["seq"], workdir))
    case["config"] = WeightStore(case["dir"]).config


def warm_numba(cases: list[dict], workdir: Path) -> float:
    """Compile or load every kernel outside the emulation: each model once on one process, and
    the distributed paths (profile, tensor, rows, pipeline, stream) on two ranks."""
    t0 = time.perf_counter()
    small = workdir / "warm-ids.npz"
    ids, mask = np.full((1, 16), 101, np.int64), np.ones((1, 16), np.int64)
    np.savez(small, ids=ids, mask=mask)
    env = {"HEPTI_CACHE": str(workdir / "warm-cache")}
    # (ranks: None for one process, argv)
    cmds = [(None, ["run", *map(str, c["input"]), "--json", "--model", c["dir"]]) for c in cases]
    cnn = next((c for c in cases if family(c["config"]).executor == "bands"), None)
    if cnn is not None:  # the band executor and the CNN profile, on two ranks
        cmds.append((2, ["profile", "--model", cnn["dir"], "--image-size", "64",
                         "--out", str(workdir / "warm-cnn-profile.json")]))
        cmds.append((2, ["run", "--model", cnn["dir"], *map(str, cnn["input"]), "--json",
                         "--strategy", "even"]))
    encoders = [c for c in cases if family(c["config"]).executor != "bands"]
    if encoders:
        first = encoders[0]
        text = first["input"][0] == "--input-ids"  # a vision model: its own pixels and tokens
        base = (["run", "--input-ids", str(small), "--json"] if text
                else ["run", *map(str, first["input"]), "--json"])
        cmds.append((2, ["profile", "--model", first["dir"], *(["--seq", "16"] if text else []),
                         "--out", str(workdir / "warm-profile.json")]))
        for extra in (["--strategy", "tensor"], ["--strategy", "rows"], ["--strategy", "pipeline"],
                      ["--strategy", "stream", "--mem-budget", "2GiB"]):
            cmds.append((2, base + ["--model", first["dir"]] + extra))
    for ranks, argv in cmds:
        harness.launch(hepti_cmd() + argv, ranks=ranks, env=env, timeout=900)
    return time.perf_counter() - t0


def sweep(args, specs: list, cases: list[dict], workdir: Path, bar) -> tuple[list[dict], list[dict]]:
    """Every strategy on every spec and case; returns (run records, profile summaries)."""
    runs, profiles = [], []
    extras = [e.split(":", 1) for e in args.extra]
    for spec, spec_path in specs:
        n = len(spec.devices)
        for case in cases:
            if spec.name not in case["specs"]:
                continue
            cache = workdir / "cache" / f"{spec.name}-{case['name']}"
            cache.mkdir(parents=True, exist_ok=True)
            strategies = case_strategies(args, spec.name, case, extras)
            common = ["run", "--model", case["dir"], *map(str, case["input"]), "--json"]
            profile_path = None
            # rounds take turns: round k starts k strategies further on (round 0 with auto,
            # whose profile the baselines are planned with), so a slow minute of this shared
            # machine does not fall on one strategy's every run
            order = [(k, harness.round_order(strategies, k)) for k in range(args.rounds)]
            for k, strategy in ((k, s) for k, ss in order for s in ss):
                if family(case["config"]).executor == "bands" and strategy == order[k][1][0]:
                    # every strategy of a round planned on one profile, taken as the round
                    # starts: the machine's speed drifts over a sweep's minutes (a MobileNetV2
                    # plan predicted from a profile 70 minutes old ran +74% over it, and +10%
                    # and -7% over its prediction from a fresh one: hepti.bench.geneflow.replan)
                    profile_path = workdir / f"profile-{spec.name}-{case['name']}-r{k}.json"
                    launch(spec_path, n, ["profile", "--model", case["dir"], "--image-size",
                                          str(case["seq"]), "--out", str(profile_path)],
                           cache, args.timeout, workdir, args.keep_page_cache)
                    if profile_path.exists():
                        profiles.append({**profile_summary(spec, case, profile_path,
                                                           "hepti profile"), "round": k})
                    else:
                        profile_path = None
                bar.set_description(f"{spec.name} {case['name']}@{case['seq']} {strategy}")
                if strategy != "auto" and profile_path is None:
                    profile_path = find_cached_profile(cache, n, case["config"].name)
                    source = "auto's own profile (cached)"
                    if profile_path is None:  # auto did not get as far: measure one for the baselines
                        profile_path = workdir / f"profile-{spec.name}-{case['name']}.json"
                        launch(spec_path, n, ["profile", "--model", case["dir"], "--seq", str(case["seq"]),
                                              "--out", str(profile_path)], cache, args.timeout,
                               workdir, args.keep_page_cache)
                        source = "hepti profile (auto did not profile)"
                        if not profile_path.exists():
                            profile_path = None
                    if profile_path is not None:
                        profiles.append(profile_summary(spec, case, profile_path, source))
                plan, unfit = None, ""
                cnn = family(case["config"]).executor == "bands"
                if (strategy in BASELINES or cnn) and profile_path is not None:
                    plan, unfit = plan_baseline(case, profile_path, strategy)
                if unfit and not args.run_unfit:
                    runs.append({**run_record(spec, case, strategy, "cannot_run", unfit, None, None, None),
                                 "round": k})
                    bar.update(1)
                    continue
                repeat = choose_repeat(plan.predicted_latency_s if plan is not None else None, args)
                name, _, fuse = strategy.partition("/fuse")
                extra = ["--strategy", name, "--repeat", str(repeat)]
                if fuse:
                    extra += ["--fuse-depth", fuse]
                if (strategy != "auto" or cnn) and profile_path is not None:
                    extra += ["--profile", str(profile_path)]
                res = launch(spec_path, n, common + extra, cache, args.timeout, workdir,
                             args.keep_page_cache)
                status, reason, rep = classify(res)
                runs.append({**run_record(spec, case, strategy, status, reason, rep, res, repeat),
                             "round": k})
                bar.update(1)
    return runs, profiles


def case_strategies(args, spec_name: str, case: dict, extras: list) -> list[str]:
    """The strategies a case runs on a spec: a CNN's own set (and auto at fixed fusing depths
    where asked), else --strategies; then the extras for that spec."""
    cnn = family(case["config"]).executor == "bands"
    base = list(CNN_STRATEGIES) if cnn else list(args.strategies)
    return base + [s for sp, s in extras if sp == spec_name and ("/fuse" in s) == cnn]


def _emulator_mode() -> dict:
    """How the devices were slowed down: the CPU quota alone, or the stretch with a guard quota."""
    on = stretch.stretch_wanted()
    return {"stretch": on, "quota_factor": stretch.GUARD if on else 1.0}


def count_runs(args, specs, cases) -> int:
    """Launches the sweep will make (the progress bar's total)."""
    extras = [e.split(":", 1) for e in args.extra]
    return args.rounds * sum(len(case_strategies(args, spec.name, case, extras))
                             for spec, _ in specs for case in cases if spec.name in case["specs"])


def add_arguments(ap) -> None:
    """The options of `hepti bench hetero` (and bin/bench-hetero.sh)."""
    ap.add_argument("--quick", action="store_true",
                    help="CI: one pair spec, MiniLM at 128 tokens, fewer runs (under 2 minutes)")
    ap.add_argument("--spec", action="append", metavar="NAME", help=f"emu spec name (default: {', '.join(SPECS)})")
    ap.add_argument("--case", action="append", metavar="MODEL_DIR:SEQ[:SPEC+SPEC]",
                    help="a model folder and token count, optionally only on some specs "
                         f"(default: {' '.join(CASES)})")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="default: %(default)s")
    ap.add_argument("--extra", action="append", metavar="SPEC:STRATEGY",
                    help=f"one more strategy on one spec, run as is (default: {' '.join(EXTRA)})")
    ap.add_argument("--rounds", type=positive_int, default=3,
                    help="launches per strategy, taking turns; each figure is the median of the "
                         "rounds' medians, and their range is the spread (default: %(default)s)")
    ap.add_argument("--repeat", type=int, default=20,
                    help="at most this many timed runs per launch (fast cases: medians of more runs)")
    ap.add_argument("--min-repeat", type=int, default=2, help="at least this many timed runs per launch")
    ap.add_argument("--target-s", type=float, default=4.0,
                    help="aim for this many seconds of timed runs per launch (by the prediction)")
    ap.add_argument("--timeout", type=float, default=300.0, help="stop a launch after S seconds")
    ap.add_argument("--run-unfit", action="store_true",
                    help="run baselines even when the planner says they do not fit memory")
    ap.add_argument("--out-dir", default="results", help="where hetero.json/.csv/.png go")
    ap.add_argument("--no-warm", action="store_true", help="skip warming Numba's cache")
    ap.add_argument("--keep-page-cache", action="store_true",
                    help="pass --keep-page-cache to hepti emulate: launches start with the files "
                         "earlier runs cached (--quick's default)")


def run(args) -> int:
    if args.quick:
        defaults = build_parser("hetero")
        for k, v in QUICK.items():
            if getattr(args, k) in (None, defaults.get_default(k)):
                setattr(args, k, v)
    args.spec = args.spec or list(SPECS)
    args.case = args.case or list(CASES)
    args.extra = EXTRA if args.extra is None else args.extra
    args.strategies = [s for s in args.strategies.split(",") if s]
    if os.geteuid() != 0:
        print("bench-hetero: needs root (hepti emulate makes network namespaces, tc shapers and "
              "cgroups); run it with sudo", file=sys.stderr)
        return 2
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    specs = [(load_spec(HOSTFILES / f"{s}.json"), HOSTFILES / f"{s}.json") for s in args.spec]
    cases = [parse_case(c, args.spec) for c in args.case]
    missing = [c["dir"] for c in cases if not (Path(c["dir"]) / "index.json").exists()]
    if missing:
        print(f"bench-hetero: no converted model in {', '.join(missing)}; make it with e.g. "
              f"`hepti convert --random bert-large --out weights/bert-large`", file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    commit = git_commit()  # of the code measured: the run takes minutes, HEAD may move
    workdir = Path(tempfile.mkdtemp(prefix="hepti-hetero-"))
    try:
        for c in cases:
            make_inputs(c, workdir)
        warm_s = 0.0 if args.no_warm else warm_numba(cases, workdir)
        bar = tqdm(total=count_runs(args, specs, cases), unit="run", file=sys.stderr)
        round_runs, profiles = sweep(args, specs, cases, workdir, bar)
        bar.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    runs = report.merge_rounds(round_runs)
    targets = report.check_targets(runs)
    doc = result_doc(
        "hetero", commit=commit,
        settings={"quick": args.quick, "specs": args.spec, "cases": args.case,
                  "strategies": args.strategies, "extra": list(args.extra), "repeat": args.repeat,
                  "min_repeat": args.min_repeat, "target_s": args.target_s, "timeout_s": args.timeout,
                  "run_unfit": args.run_unfit, "threads_per_rank": 1, "rounds": args.rounds,
                  "keep_page_cache": args.keep_page_cache},
        specs={s.name: s.to_dict() for s, _ in specs},
        duration_s=round(time.perf_counter() - t_start, 1), numba_warm_s=round(warm_s, 1),
        runs=runs, targets=targets, profiles=profiles, round_runs=round_runs,
        emulator=_emulator_mode())
    out = Path(args.out_dir)
    write_json(doc, out / "hetero.json")
    report.write_csv(runs, out / "hetero.csv")
    why_not = report.draw(runs, out / "hetero.png")
    print(report.format_table(runs))
    print("targets (issues 5 and 16):")
    print(report.format_targets(targets))
    print(f"wrote {out / 'hetero.json'}, {out / 'hetero.csv'}"
          + (f", {out / 'hetero.png'}" if why_not is None else ""))
    if why_not:
        print(f"bench-hetero: {why_not}", file=sys.stderr)
        drop_stale(out / "hetero.png", "bench-hetero", "no plot drawn")
    print(f"took {doc['duration_s']:.0f} s (Numba warm-up {warm_s:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
