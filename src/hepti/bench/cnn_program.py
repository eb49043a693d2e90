"""The band program's price against CoEdge's network model, on measured emu-mixed4 runs.

    hepti bench cnn-program [--json OUT]

For each run of results/hetero-cnn-mnv2 and results/hetero-cnn-r50 (MobileNetV2 and ResNet-50
at 224 on emu-mixed4, every rank's profile measured in the run, the latency measured over 5
interleaved rounds), the same split is priced three ways:

- `coedge`: hepti.plan.coedge `predict`, the planner's model: per group each rank's compute
  from the profiled band timings; a halo costs a rank one latency + max(bytes out, in) / its
  bandwidth + its measured exchange work; a rank waits only for its exchange's peers (clocks
  carried through the groups, with the measured spread); pooling and head at the profile's
  measured allgather lines.
- `program (coedge compute)`: hepti.graph.band_program's Program, each phase priced as
  hepti.plan.costmodel `evaluate` does (the slowest rank's compute, then the collective's
  slowest rank: `p_i alpha_i + max(s_i, r_i) / beta_i` for a halo, the direct-exchange
  branch terms for an allgatherv), with each group's per-rank compute taken from the same
  band timings, so that only the network and synchronisation models differ.
- `program (its own Work)`: `evaluate` alone, compute priced by the profile's GeMM FLOP/s
  (a CNN's depthwise and small convs run far below it: a lower bound on compute).

The runs' plans are rebuilt from their row counts (ratios = counts of the first map / its
rows); a plan with `groups` N > 1 (the LP's fusion, the pipeline) is not rebuilt and skipped.
"""
from __future__ import annotations

import json
import sys
import tempfile

from hepti.bench.harness import ROOT, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.config import CNNConfig
from hepti.graph.band_program import band_program
from hepti.graph.cnn import build
from hepti.graph.split import Split, first_holders, spatial_ops
from hepti.plan.coedge import CNNCosts, group_cost, predict, tail_seconds
from hepti.plan.costmodel import active_ranks, collective_times, evaluate
from hepti.plan.profile import load_profile

RESULTS = ROOT / "results"
SOURCES = ["hetero-cnn-mnv2/hetero.json", "hetero-cnn-r50/hetero.json"]


def _profile(entry: dict):
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(entry["profile"], f)
    return load_profile(f.name)


def program_with_coedge_compute(graph, split, costs, prof, h, w):
    """The band program's phases, each a barrier: max over ranks of the group's compute
    (coedge's band timings) + the slowest rank's collective (hepti.plan.costmodel)."""
    prog, cnt = band_program(graph, split, h, w, 1, costs.size)
    shapes = graph.shapes(h, w)
    cnt_root = {**cnt, "root": [1.0] + [0.0] * (costs.size - 1)}
    active = active_ranks(prog, cnt, costs.size)
    holders = first_holders(graph, h, costs.size)
    owners = split.owners(graph)
    comp_groups = []
    for k, g in enumerate(split.group_ranges(graph)):
        _, _, comp, _ = group_cost(graph, shapes, g, split.group_ratios(k), costs, 1, w,
                                   None, owners, None, holders)
        comp_groups.append(max(comp))
    _, tail_comp, _ = tail_seconds(graph, shapes, split, costs, 1)
    compute = sum(comp_groups) + max(tail_comp)
    network = halo = 0.0
    for phase, _, _ in prog.phases():
        if phase.collective is not None:
            t = max(collective_times(phase.collective, cnt_root, active, prof))
            network += t
            halo += t if phase.collective.kind == "halo" else 0.0
    return compute + network, compute, network, halo


def add_arguments(ap) -> None:
    ap.add_argument("--json", metavar="OUT", help="write the rows here too, as a result document")


def run(args) -> int:
    rows = []
    for src in SOURCES:
        d = json.loads((RESULTS / src).read_text())
        entry = d["profiles"][0]
        prof = _profile(entry)
        graph = build(CNNConfig(arch=entry["profile"]["model_shape"]["arch"]))
        h = w = int(entry["seq"])
        costs = CNNCosts.from_profile(prof, graph)
        first = graph.shapes(h, w)[graph.ops[0].output][0]
        for run in d["runs"]:
            c = run["counts"]["rows"]
            if run["status"] != "ok" or sum(x > 0 for x in c) < 2:
                continue
            if run["groups"] not in (None, 1):
                continue
            ratios = tuple(x / first for x in c)
            n_sp = spatial_ops(graph)
            split = Split(ratios, groups=((0, n_sp),) if run["groups"] == 1 else None)
            co = predict(graph, split, costs, h, w)
            co_net = max(p["exchange_s"] for p in co["per_rank"])
            pc, pc_comp, pc_net, pc_halo = program_with_coedge_compute(graph, split, costs,
                                                                       prof, h, w)
            prog, cnt = band_program(graph, split, h, w, 1, costs.size)
            own = evaluate(prog, cnt, prof).latency_s
            row = {"model": entry["model"], "spec": entry["spec"], "strategy": run["strategy"],
                   "rows": c, "groups": run["groups"] or "per op",
                   "measured_ms": 1e3 * run["median_latency_s"],
                   "coedge_ms": 1e3 * co["latency_s"],
                   "coedge_exchange_ms_slowest_rank": 1e3 * co_net,
                   "program_coedge_compute_ms": 1e3 * pc,
                   "program_compute_ms": 1e3 * pc_comp, "program_network_ms": 1e3 * pc_net,
                   "program_halo_ms": 1e3 * pc_halo,
                   "program_own_work_ms": 1e3 * own}
            rows.append(row)
            print(f"{row['model']:13s} {row['strategy']:13s} rows {c} groups {row['groups']}: "
                  f"measured {row['measured_ms']:.1f} ms; coedge {row['coedge_ms']:.1f} "
                  f"(slowest rank's exchanges {row['coedge_exchange_ms_slowest_rank']:.1f}); "
                  f"program {row['program_coedge_compute_ms']:.1f} = compute "
                  f"{row['program_compute_ms']:.1f} + network {row['program_network_ms']:.1f} "
                  f"(halo {row['program_halo_ms']:.1f}); program, own Work "
                  f"{row['program_own_work_ms']:.1f}", flush=True)
    if args.json:
        write_json(result_doc("cnn-program", sources=SOURCES, rows=rows), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
