"""What `bin/bench-hetero.sh` writes: results/hetero.json, hetero.csv, hetero.png, the summary
table and the issue's targets checked against the measurements.

Pure functions of the result document (a dict, see `hepti.bench.hetero`), so they are tested on
small hand-made documents. A run record:

    {"spec": "emu-mixed4", "model": "bert-base", "seq": 256, "strategy": "auto",
     "status": "ok" | "refused" | "cannot_run" | "oom" | "timeout" | "failed",
     "reason": "why it did not run (the planner's or the launcher's message)",
     "ran": "rows",                      # the strategy that actually ran (auto's choice)
     "median_latency_s": 0.98, "latencies_s": [...], "predicted_latency_s": 0.66,
     "prediction_error": 0.47,           # measured / predicted - 1
     "per_rank": [{"rank": 0, "host": "minipc-a", "active": true, "compute_s": .., "comm_total_s": ..,
                   "comm_s": {kind: s}, "predicted_compute_s": .., "predicted_comm_s": ..,
                   "device_peak_mem_bytes": .., "oom_kills": 0}, ...]}
"""
from __future__ import annotations

import csv
import io
import statistics
from pathlib import Path

HEADLINE = ("emu-mixed4", "bert-base", 256)
FIT_TOLERANCE = 0.15
FASTEST_TOLERANCE = 0.03  # auto is the fastest strategy run, or within this of it
STATUS_LABEL = {"refused": "refused", "cannot_run": "cannot run", "oom": "OOM kill",
                "timeout": "timeout", "failed": "failed"}
CSV_FIELDS = ("spec", "model", "seq", "strategy", "status", "ran", "median_ms", "predicted_ms",
              "prediction_error_pct", "rank", "host", "active", "compute_ms", "comm_ms",
              "predicted_compute_ms", "predicted_comm_ms", "device_peak_mem_mib", "oom_kills", "reason")


def _ms(s) -> float | None:
    return None if s is None else round(s * 1e3, 3)


def groups(runs: list[dict]) -> dict[tuple, list[dict]]:
    """Runs by (spec, model, seq), in the order they first appear."""
    out: dict[tuple, list[dict]] = {}
    for r in runs:
        out.setdefault((r["spec"], r["model"], r["seq"]), []).append(r)
    return out


def find(runs: list[dict], spec: str, model: str, seq: int, strategy: str) -> dict | None:
    for r in runs:
        if (r["spec"], r["model"], r["seq"], r["strategy"]) == (spec, model, seq, strategy):
            return r
    return None


def merge_rounds(runs: list[dict]) -> list[dict]:
    """One record per (spec, model, seq, strategy) from the records of every round (`round`
    0, 1, ...): the round whose median latency is the median of the rounds' (the lower middle
    one for an even count), with `median_latency_s` the median of the rounds' medians,
    `round_latency_s` every round's median and `spread_s` their range. Rounds that did not run
    are dropped when another round ran; `rounds_not_ok` says how many. Records without a
    `round` (one-round documents) pass through unchanged."""
    merged: dict[tuple, list[dict]] = {}
    for r in runs:
        merged.setdefault((r["spec"], r["model"], r["seq"], r["strategy"]), []).append(r)
    out = []
    for rs in merged.values():
        if len(rs) == 1 and "round" not in rs[0]:
            out.append(rs[0])
            continue
        ok = [r for r in rs if r["status"] == "ok" and r.get("median_latency_s") is not None]
        if not ok:
            out.append({**rs[0], "rounds": len(rs), "rounds_not_ok": len(rs)})
            continue
        meds = sorted(r["median_latency_s"] for r in ok)
        mid = meds[(len(meds) - 1) // 2]
        pick = next(r for r in ok if r["median_latency_s"] == mid)
        med = statistics.median(meds)
        pred = pick.get("predicted_latency_s")
        out.append({**pick, "median_latency_s": med,
                    "round_latency_s": [r["median_latency_s"] for r in ok],
                    "spread_s": meds[-1] - meds[0], "rounds": len(rs),
                    "rounds_not_ok": len(rs) - len(ok),
                    "prediction_error": None if not pred else med / pred - 1})
    return out


# --- JSON and CSV ----------------------------------------------------------------------------

def csv_rows(runs: list[dict]) -> list[dict]:
    """One row per run and rank (a run that did not start has one row without a rank)."""
    rows = []
    for r in runs:
        base = {"spec": r["spec"], "model": r["model"], "seq": r["seq"], "strategy": r["strategy"],
                "status": r["status"], "ran": r.get("ran") or "",
                "median_ms": _ms(r.get("median_latency_s")),
                "predicted_ms": _ms(r.get("predicted_latency_s")),
                "prediction_error_pct": (None if r.get("prediction_error") is None
                                         else round(100 * r["prediction_error"], 1)),
                "reason": r.get("reason") or ""}
        ranks = r.get("per_rank") or [None]
        for pr in ranks:
            row = dict(base)
            if pr is not None:
                peak = pr.get("device_peak_mem_bytes")
                row.update({"rank": pr["rank"], "host": pr.get("host", ""), "active": pr.get("active"),
                            "compute_ms": _ms(pr.get("compute_s")), "comm_ms": _ms(pr.get("comm_total_s")),
                            "predicted_compute_ms": _ms(pr.get("predicted_compute_s")),
                            "predicted_comm_ms": _ms(pr.get("predicted_comm_s")),
                            "device_peak_mem_mib": None if peak is None else round(peak / 2**20, 1),
                            "oom_kills": pr.get("oom_kills")})
            rows.append(row)
    return rows


def csv_text(runs: list[dict]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for row in csv_rows(runs):
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_csv(runs: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(csv_text(runs))


# --- the summary table -----------------------------------------------------------------------

def _cell_ms(s) -> str:
    return "" if s is None else f"{s * 1e3:,.1f}"


def format_table(runs: list[dict]) -> str:
    """Per cluster and model: each strategy's status, median and predicted latency, the
    prediction's error, and how much lower auto's latency is."""
    lines = []
    for (spec, model, seq), rs in groups(runs).items():
        auto = next((r for r in rs if r["strategy"] == "auto" and r["status"] == "ok"), None)
        lines.append(f"{spec}  {model} @{seq} tokens")
        lines.append(f"  {'strategy':<13}{'status':<11}{'ran':<10}{'median ms':>11}{'predicted':>11}"
                     f"{'error':>8}{'auto lower':>12}")
        for r in rs:
            med, pred = r.get("median_latency_s"), r.get("predicted_latency_s")
            err = r.get("prediction_error")
            lower = ""
            if auto is not None and r is not auto and med:
                lower = f"{100 * (1 - auto['median_latency_s'] / med):+.0f}%"
            status = STATUS_LABEL.get(r["status"], r["status"])
            lines.append(f"  {r['strategy']:<13}{status:<11}{(r.get('ran') or ''):<10}{_cell_ms(med):>11}"
                         f"{_cell_ms(pred):>11}{'' if err is None else f'{100 * err:+.0f}%':>8}{lower:>12}")
            if r["status"] != "ok" and r.get("reason"):
                lines.append(f"      {r['reason'][:150]}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# --- the targets ---------------------------------------------------------------------

def _target(name: str, ok, detail: str) -> dict:
    return {"target": name, "ok": ok, "detail": detail}


def _lower_by(runs, spec, model, seq, base: str, at_least: float | None) -> dict:
    """auto's median at least `at_least` lower than `base`'s (or simply lower when None)."""
    name = (f"{spec} {model}@{seq}: auto " +
            (f">= {at_least:.0%} lower than {base}" if at_least else f"lower than {base}"))
    a, b = find(runs, spec, model, seq, "auto"), find(runs, spec, model, seq, base)
    if a is None or b is None:
        return _target(name, None, "not run")
    if a["status"] != "ok":
        return _target(name, False, f"auto did not run: {a['status']}: {a.get('reason', '')}")
    if b["status"] != "ok":
        return _target(name, None, f"{base} has no measurement ({b['status']}: {b.get('reason', '')[:100]})")
    gain = 1 - a["median_latency_s"] / b["median_latency_s"]
    need = at_least or 0.0
    return _target(name, gain >= need if at_least else gain > 0,
                   f"auto {a['median_latency_s'] * 1e3:.0f} ms ({a.get('ran')}) vs {base} "
                   f"{b['median_latency_s'] * 1e3:.0f} ms: {gain:+.1%} lower")


CNN_HEADLINES = (("emu-mixed4", "resnet50", 224), ("emu-mixed4", "mobilenet-v2", 224))
FUSE_SPECS = ("emu-pair-240-full", "emu-pair-940-full")  # slow and fast link (issue 19)
FUSE_TOLERANCE = 0.05  # the planner's fusion within this of the best fixed depth measured


def check_targets(runs: list[dict]) -> list[dict]:
    """The issue's targets that this benchmark measures, each ok True/False (None: not measured)."""
    spec, model, seq = HEADLINE
    out = [_lower_by(runs, spec, model, seq, "even", 0.30),
           _lower_by(runs, spec, model, seq, "proportional", 0.15),
           _lower_by(runs, spec, model, seq, "single", None),
           _lower_by(runs, spec, model, seq, "pipeline", None)]
    for spec, model, seq in CNN_HEADLINES:  # issue 19: the CNNs, split by height
        if find(runs, spec, model, seq, "auto") is None:
            continue
        out += [_lower_by(runs, spec, model, seq, "even", 0.30),
                _lower_by(runs, spec, model, seq, "proportional", 0.15),
                _lower_by(runs, spec, model, seq, "single", None),
                _lower_by(runs, spec, model, seq, "grid", None)]
    out += _fusion_targets(runs)
    for r in runs:  # every strategy that ran, against its own prediction (issue 16)
        who = r["strategy"]
        name = f"{r['spec']} {r['model']}@{r['seq']}: {who} within {FIT_TOLERANCE:.0%} of its prediction"
        if r["status"] != "ok" or r.get("predicted_latency_s") is None:
            if who == "auto":  # auto must run; a baseline that cannot is not a miss of this target
                out.append(_target(name, False, f"auto {r['status']}: {r.get('reason', '')[:120]}"))
            continue
        err = r["prediction_error"]
        out.append(_target(name, abs(err) <= FIT_TOLERANCE,
                           f"measured {r['median_latency_s'] * 1e3:.0f} ms, predicted "
                           f"{r['predicted_latency_s'] * 1e3:.0f} ms ({err:+.1%}), ran {r.get('ran')}"))
    for (spec_name, model, seq), rs in groups(runs).items():
        out += _auto_fastest(spec_name, model, seq, rs)
    for spec_name, want in (("emu-tight", "tensor"), ("emu-starved", "stream")):
        for r in runs:
            if r["spec"] == spec_name and r["strategy"] == "auto":
                name = f"{spec_name} {r['model']}@{r['seq']}: auto picks {want} and completes without OOM"
                ok = r["status"] == "ok" and r.get("ran") == want
                out.append(_target(name, ok, f"status {r['status']}, ran {r.get('ran')}"
                                   + (f": {r['reason'][:150]}" if r.get("reason") else "")))
    for r in runs:
        if r["spec"] == "emu-tight" and r["strategy"] == "rows":
            name = f"emu-tight {r['model']}@{r['seq']}: rows refused by the planner before it starts"
            out.append(_target(name, r["status"] == "refused",
                               f"status {r['status']}" + (f": {r['reason'][:150]}" if r.get("reason") else "")))
    return out


def _fusion_targets(runs: list[dict]) -> list[dict]:
    """Issue 19: the planner fuses more on the slow link than on the fast one, and its choice
    is within FUSE_TOLERANCE of the best fixed fusing depth measured ("auto/fuseK" runs)."""
    out, depth = [], {}
    for (spec, model, seq), rs in groups(runs).items():
        fixed = [r for r in rs if r["strategy"].startswith("auto/fuse") and r["status"] == "ok"]
        auto = next((r for r in rs if r["strategy"] == "auto" and r["status"] == "ok"), None)
        if not fixed or auto is None:
            continue
        best = min(fixed, key=lambda r: r["median_latency_s"])
        a, b = auto["median_latency_s"], best["median_latency_s"]
        out.append(_target(f"{spec} {model}@{seq}: the planner's fusion within "
                           f"{FUSE_TOLERANCE:.0%} of the best fixed depth",
                           a <= b * (1 + FUSE_TOLERANCE),
                           f"auto {a * 1e3:.1f} ms ({auto.get('groups')} groups) vs "
                           f"{best['strategy']} {b * 1e3:.1f} ms: {a / b - 1:+.1%}"))
        depth[(spec, model, seq)] = auto.get("groups")
    for (spec, model, seq), n_slow in depth.items():
        if spec != FUSE_SPECS[0]:
            continue
        n_fast = depth.get((FUSE_SPECS[1], model, seq))
        if n_slow is None or n_fast is None:
            continue
        out.append(_target(f"{model}@{seq}: fuses more on the slow link ({FUSE_SPECS[0]}) than "
                           f"on the fast one ({FUSE_SPECS[1]})", n_slow < n_fast,
                           f"{n_slow} groups on the slow link, {n_fast} on the fast"))
    return out


def _auto_fastest(spec: str, model: str, seq: int, rs: list[dict]) -> list[dict]:
    """auto is the fastest of the strategies run, or within FASTEST_TOLERANCE of it; and never
    slower than single beyond the rounds' spread (the larger of the two strategies' spreads)."""
    ok = [r for r in rs if r["status"] == "ok" and r.get("median_latency_s")
          and "/" not in r["strategy"]]  # auto's fixed-fusion variants are not rivals
    auto = next((r for r in ok if r["strategy"] == "auto"), None)
    if auto is None or len(ok) < 2:
        return []
    a = auto["median_latency_s"]
    best = min(ok, key=lambda r: r["median_latency_s"])
    b = best["median_latency_s"]
    out = [_target(f"{spec} {model}@{seq}: auto fastest, or within {FASTEST_TOLERANCE:.0%} of it",
                   a <= b * (1 + FASTEST_TOLERANCE),
                   f"auto {a * 1e3:.0f} ms ({auto.get('ran')}); fastest {best['strategy']} "
                   f"{b * 1e3:.0f} ms: auto {a / b - 1:+.1%}")]
    single = next((r for r in ok if r["strategy"] == "single"), None)
    if single is not None:
        s = single["median_latency_s"]
        spread = max(auto.get("spread_s") or 0.0, single.get("spread_s") or 0.0)
        out.append(_target(f"{spec} {model}@{seq}: auto not slower than single beyond the rounds' spread",
                           a - s <= spread,
                           f"auto {a * 1e3:.0f} ms vs single {s * 1e3:.0f} ms ({a / s - 1:+.1%}); "
                           f"spread {spread * 1e3:.0f} ms over {auto.get('rounds', 1)} rounds"))
    return out


def format_targets(targets: list[dict]) -> str:
    mark = {True: "MET ", False: "MISS", None: "n/a "}
    return "\n".join(f"  [{mark[t['ok']]}] {t['target']}: {t['detail']}" for t in targets) + "\n"


# --- the plot ----------------------------------------------------------------------------------

def draw(runs: list[dict], path: Path) -> str | None:
    """Latency by strategy per cluster (one panel per cluster and model), predicted latency
    marked; strategies that did not run are labelled with why. Returns None when drawn, else
    the reason it was not (matplotlib missing)."""
    try:
        import matplotlib  # local: optional dependency
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # local: optional dependency
    except ImportError:
        return ("matplotlib is not installed, so no plot was drawn (JSON and CSV are written); "
                "install it with `pip install -e '.[plot]'` (or `pip install matplotlib`) in hepti's venv")
    panels = list(groups(runs).items())
    if not panels:
        return "no runs to draw"
    ncol = min(4, len(panels))
    nrow = (len(panels) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(max(4.2 * ncol, 6.5), 3.6 * nrow + 0.4), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, ((spec, model, seq), rs) in zip(axes.flat, panels):
        names = [r["strategy"] for r in rs]
        meas = [r.get("median_latency_s") or 0.0 for r in rs]
        colors = ["tab:green" if n == "auto" else "tab:gray" for n in names]
        x = range(len(rs))
        ax.bar(x, [m * 1e3 for m in meas], color=colors)
        pred = [(i, r["predicted_latency_s"] * 1e3) for i, r in enumerate(rs)
                if r.get("predicted_latency_s") is not None and r["status"] == "ok"]
        if pred:
            ax.scatter([p[0] for p in pred], [p[1] for p in pred], marker="_", s=400, color="black",
                       linewidths=2, zorder=3, label="predicted")
        top = max([m * 1e3 for m in meas] + [p[1] for p in pred] + [1.0])
        for i, r in enumerate(rs):
            if r["status"] != "ok":
                ax.text(i, top * 0.03, STATUS_LABEL.get(r["status"], r["status"]), rotation=90,
                        ha="center", va="bottom", fontsize=8, color="tab:red")
            elif r["strategy"] == "auto" and r.get("ran"):
                ax.text(i, meas[i] * 1e3, r["ran"], ha="center", va="bottom", fontsize=8)
        ax.set_xticks(list(x))
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
        ax.set_ylim(0, top * 1.15)
        ax.set_title(f"{spec}\n{model} @{seq} tokens", fontsize=9)
        ax.set_ylabel("median latency (ms)", fontsize=8)
        if pred:
            ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("hepti on emulated clusters: auto (green) vs baselines, black mark = predicted",
                 fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None
