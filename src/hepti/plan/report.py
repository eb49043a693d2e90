"""A plan as a table a person reads: per rank its shares, predicted times and memory."""
from __future__ import annotations

from hepti.plan.planfile import DIMS, Plan


def _share(count, ratio) -> str:
    return f"{count:>5} {ratio * 100:5.1f}%" if ratio else f"{'-':>12}"


def format_bands(plan: Plan) -> str:
    """A CNN's plan: per rank its rows of the first map, predicted compute, halo exchange and
    (with declared powers) energy; then the latency, the groups and the explanation."""
    per_rank = plan.predicted.get("per_rank", [])
    energy = "energy_j" in plan.predicted
    lines = [f"{'rank':>4} {'rows':>12} {'share':>7} {'compute ms':>10} {'exchange ms':>11}"
             + (f" {'energy J*':>9}" if energy else "")]
    for i in range(plan.world_size):
        r = per_rank[i] if i < len(per_rank) else {}
        lo, hi = r.get("rows", (0, 0))
        rows = f"{lo}-{hi}" if hi > lo else "-"
        lines.append(f"{i:>4} {rows:>12} {plan.ratios['rows'][i] * 100:6.1f}% "
                     f"{r.get('compute_s', 0.0) * 1e3:>10.2f} {r.get('exchange_s', 0.0) * 1e3:>11.2f}"
                     + (f" {r.get('energy_j', 0.0):>9.3f}" if energy else ""))
    lines.append("")
    size = plan.predicted.get("input")
    lines.append(f"strategy bands, model {plan.model}" + (f", {size[0]}x{size[1]} input" if size
                                                         else ""))
    if plan.predicted_latency_s is not None:
        lines.append(f"predicted latency {plan.predicted_latency_s * 1e3:.2f} ms"
                     + (f"; planned in {plan.solve_s * 1e3:.1f} ms" if plan.solve_s else ""))
    if energy:
        lines.append(f"* energy {plan.predicted['energy_j']:.3f} J: "
                     f"{plan.predicted.get('energy_note', 'predicted')}")
    if plan.explanation:
        lines.append(plan.explanation)
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    """Per rank: share per dimension (count and percent), predicted compute, communication,
    waiting and memory; then the predicted latency and the explanation."""
    if plan.strategy == "bands":
        return format_bands(plan)
    per_rank = plan.predicted.get("per_rank", [])
    caps = plan.predicted.get("mem_caps")
    pipeline = plan.strategy == "pipeline"
    head = (f"{'rank':>4} {'host':<10} "
            + (f"{'layers':>12}" if pipeline else " ".join(f"{d:>12}" for d in DIMS))
            + f" {'compute ms':>10} {'comm ms':>8} {'wait ms':>8} {'memory MB':>10} {'of MB':>7}")
    lines = [head]
    for i in range(plan.world_size):
        r = per_rank[i] if i < len(per_rank) else {}
        if pipeline:
            a, b = plan.layers[i]
            shares = f"{f'{a}-{b}' if b > a else '-':>12}"
        else:
            cnt = plan.counts or {}
            # rows: every rank holds every weight; a mixed plan: those of its row-split blocks
            whole = (plan.predicted.get("genetic", {}).get("whole_units", [])
                     if plan.strategy == "mixed" else DIMS if plan.strategy == "rows" else ())
            shares = " ".join(
                f"{'all' if plan.ratios['rows'][i] or i == plan.primary else '-':>12}"
                if d in whole and d != "rows"
                else _share(cnt.get(d, [0] * plan.world_size)[i], plan.ratios[d][i]) for d in DIMS)
        comm = sum(r.get("comm_s", {}).values()) * 1e3
        mem = r.get("mem_bytes", 0.0) / 1e6
        cap = f"{caps[i] / 1e6:7.0f}" if caps else f"{'':>7}"
        lines.append(f"{i:>4} {r.get('host', '')[:10]:<10} {shares} {r.get('compute_s', 0.0) * 1e3:>10.2f} "
                     f"{comm:>8.2f} {r.get('wait_s', 0.0) * 1e3:>8.2f} {mem:>10.1f} {cap}")
    lat = plan.predicted_latency_s
    tail = f"strategy {plan.strategy}"
    if plan.model:
        tail += f", model {plan.model}"
    if plan.seq_len:
        tail += f", {plan.batch or 1} x {plan.seq_len} tokens"
    if plan.primary:
        tail += f", primary rank {plan.primary} (rank 0 hands it the inputs)"
    lines.append("")
    lines.append(tail)
    if lat is not None:
        line = f"predicted latency {lat * 1e3:.2f} ms"
        if plan.predicted.get("bottleneck_s"):
            line += f" (slowest pipeline stage {plan.predicted['bottleneck_s'] * 1e3:.2f} ms)"
        if plan.solve_s is not None:
            line += f"; planned in {plan.solve_s * 1e3:.1f} ms"
        lines.append(line)
    if plan.mem_budget:
        lines.append(f"memory budget for layer slices: {plan.mem_budget / 1e6:.1f} MB per rank")
    if plan.explanation:
        lines.append(plan.explanation)
    return "\n".join(lines)


def format_profile(profile) -> str:
    """A table of the profiled devices: speeds, memory and link, one row per rank."""
    lines = [f"profile ({profile.source}, {profile.world_size} ranks)",
             f"{'rank':>4} {'host':<14} {'GeMM GF/s':>10} {'attn GF/s':>10} {'memory GB':>10} "
             f"{'latency us':>11} {'link MB/s':>10}"]
    for d in profile.devices:
        lines.append(f"{d.rank:>4} {d.host[:14]:<14} {d.gemm.peak / 1e9:>10.1f} "
                     f"{d.attention.peak / 1e9:>10.1f} {d.usable_bytes / 1e9:>10.2f} "
                     f"{d.latency_s * 1e6:>11.1f} {d.bandwidth_Bps / 1e6:>10.1f}")
    return "\n".join(lines)
