"""`hepti bench cnn-ops`: ResNet-50 (or VGG-16) op by op, hepti against onnxruntime's own
per-node profile, one thread, interleaved in one process.

Each round times one hepti forward op by op (hepti.parallel.profile_cnn.measure_cnn_ops: each
op alone on the previous op's output, as the forward runs them) and one onnxruntime forward
with its profiler on (`enable_profiling`: each node's kernel time), then a whole forward of
each (onnxruntime's in a session without the profiler). The table gives, per op, the minimum over rounds of each (this machine's noise is from
outside the VM: minima are what the kernels can do, medians what a user sees), GFLOP/s and the
difference; the sums; and the whole forwards' minima and medians. onnxruntime runs the
bench's ONNX export of torchvision's model holding hepti's weights (`hepti bench cnn-single`'s),
its NCHWc convolutions fused with their bias, ReLU and residual add, as hepti's are.

ResNet-50 and VGG-16: onnxruntime names each fused node after its torchvision module's
output (`/layer1/layer1.0/relu_1/Relu` is layer1.0's 3x3 with its ReLU,
`/features/features.3/Relu` VGG-16's features.2 with its), which `ort_node` and `vgg_node` map
to hepti's op names; other models' exports name their nodes otherwise. VGG-16's 13
convolutions and 5 pools run on one rank as one `PlainChain` call, each convolution writing
into the zero-bordered map the next reads (docs/cnn.md), which op by op they do not: there each
step of the chain (a convolution and the max pool after it, if any) is timed alone on the
chain's own maps (`PlainChain.step`, after the step before it), set beside onnxruntime's
convolution node plus its pool's; the head's ops, op by op.
Writes results/cnn-ops-MODEL-SIZE.json and .csv.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import sys  # noqa: E402

import numpy as np  # noqa: E402

from hepti.bench import cnnsingle, harness  # noqa: E402
from hepti.bench.harness import result_doc, write_json  # noqa: E402
from hepti.bench.registry import module_main  # noqa: E402
from hepti.graph.cnn import CONV  # noqa: E402
from hepti.kernels.plain_chain import PlainChain  # noqa: E402
from hepti.model.cnn import plain_step  # noqa: E402
from hepti.parallel.profile_cnn import measure_cnn_ops  # noqa: E402
from hepti.parallel.single import SingleCNN  # noqa: E402
from hepti.weights import WeightStore  # noqa: E402

MODELS = ("resnet50", "vgg16")


def ort_node(op_name: str) -> str:
    """onnxruntime's node for a hepti op of ResNet-50 (its fused node, named by the torchvision
    module output it ends with)."""
    if op_name == "conv1":
        return "/relu/Relu"
    if op_name in ("maxpool", "avgpool"):
        return {"maxpool": "/maxpool/MaxPool", "avgpool": "/avgpool/GlobalAveragePool"}[op_name]
    if op_name == "fc":
        return "/fc/Gemm"
    layer, block, part = op_name.split(".")[:3]
    where = f"/{layer}/{layer}.{block}"
    if part == "downsample":
        return f"{where}/downsample/downsample.0/Conv"
    return {"conv1": f"{where}/relu/Relu", "conv2": f"{where}/relu_1/Relu",
            "conv3": f"{where}/conv3/Conv"}[part]


def vgg_node(op) -> str:
    """onnxruntime's node for a hepti op of VGG-16: a convolution's is the ReLU after it (the
    fused node), features.N's `/features/features.N+1/Relu`."""
    if op.name == "avgpool":
        return "/avgpool/AveragePool"
    part, n = op.name.rsplit(".", 1)
    if part == "classifier":
        return f"/classifier/{op.name}/Gemm"
    return f"/features/features.{int(n) + 1}/Relu" if op.kind == CONV else \
        f"/features/{op.name}/MaxPool"


def vgg_steps(model) -> list[tuple]:
    """VGG-16's convolutions, each with the max pool after it or None: the steps of the
    `PlainChain` its one-rank forward runs (hepti.model.cnn `plain_step`)."""
    ops, steps, i = model.graph.ops, [], 0
    while i < len(ops):
        if i + 1 < len(ops) and plain_step(ops[i:i + 2]):
            steps.append((ops[i], ops[i + 1]))
            i += 2
        elif plain_step(ops[i:i + 1]):
            steps.append((ops[i], None))
            i += 1
        else:
            i += 1
    return steps


def _chain_timer(model, steps, pixels):
    """() -> each step's seconds, one pass of the chain on pixels (NCHW)."""
    chain = PlainChain([(model.weights.layer(c), p.kernel if p else 0) for c, p in steps])
    x = np.ascontiguousarray(pixels.transpose(0, 2, 3, 1))
    plan = chain.prepare(x.shape, tuple((c.padding,) * 4 for c, _ in steps))
    if plan is None:
        raise SystemExit("hepti bench cnn-ops: VGG-16's convolutions do not run as one chain "
                         "at this size")

    def times() -> list[float]:
        out = []
        chain.start(plan, x)
        for i in range(len(steps)):
            t0 = time.perf_counter()
            chain.step(plan, i)
            out.append(time.perf_counter() - t0)
        chain.finish(plan)
        return out
    return times


def _ort_ms(nodes: dict, names: list[str], pick) -> float | None:
    """pick (min or median) over rounds of the named nodes' summed kernel times, in ms."""
    got = [nodes.get(n) or nodes.get(f"fused {n}") for n in names]
    if any(g is None for g in got):
        return None
    return pick([sum(r) for r in zip(*got)]) * 1e3


def node_times(profile: Path, skip: int) -> dict[str, list[float]]:
    """Each node's kernel times (s) in an onnxruntime profile, its first `skip` runs left out."""
    out = collections.defaultdict(list)
    for e in json.loads(profile.read_text()):
        name = e.get("name", "")
        if e.get("cat") == "Node" and name.endswith("_kernel_time"):
            node = name[:-len("_kernel_time")].replace("_output_0_nchwc", "")
            out[node.replace("_output_0", "")].append(e["dur"] / 1e6)
    return {k: v[skip:] for k, v in out.items()}


def run(args) -> int:
    from tqdm import tqdm  # local: start-up time
    has_torch, has_ort, missing = cnnsingle.optional_runtimes(print)
    if not (has_torch and has_ort):
        raise SystemExit(f"hepti bench cnn-ops needs torch and onnxruntime ({', '.join(missing)} "
                         "missing): bin/setup --with-torch installs them")
    import onnxruntime as ort  # local: optional dependency (onnxruntime)
    model = args.model
    folder = cnnsingle.ensure_weights(model, Path(args.weights) / model, print)
    store = WeightStore(folder)
    hepti = SingleCNN.from_store(store, threads=1)
    graph = hepti.model.graph
    tensors = {n: store.read(n) for n in graph.weights()}
    config = store.config
    store.close()
    size = args.size
    pixels = np.random.default_rng(cnnsingle.SEED).standard_normal((1, 3, size, size),
                                                                   dtype=np.float32)
    state = cnnsingle.torch_state(graph, tensors)
    del tensors
    tmodel = cnnsingle.torchvision_model(config, graph, state)
    steps = vgg_steps(hepti.model) if model == "vgg16" else []
    in_chain = {op.name for st in steps for op in st if op is not None}
    with tempfile.TemporaryDirectory(prefix="hepti-cnnops-") as tmp:
        path = Path(tmp) / f"{model}.onnx"
        cnnsingle.export_onnx(tmodel, pixels, path)
        del tmodel
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        plain = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        so.enable_profiling = True
        so.profile_file_prefix = str(Path(tmp) / "ort")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        warm = 3
        for _ in range(warm):
            sess.run(None, {"pixels": pixels})
            plain.run(None, {"pixels": pixels})
            hepti.forward(pixels)
        chain_times = _chain_timer(hepti.model, steps, pixels) if steps else None
        measure_cnn_ops(hepti.model, size, size, rounds=1)
        h_ops, h_steps, fwd = [], [], {"hepti": [], "ort": []}
        bar = tqdm(total=args.rounds, desc="cnn-ops", unit="round")
        for _ in range(args.rounds):
            h_ops.append(measure_cnn_ops(hepti.model, size, size, rounds=1))
            if chain_times is not None:
                h_steps.append(chain_times())
            sess.run(None, {"pixels": pixels})
            t0 = time.perf_counter()
            plain.run(None, {"pixels": pixels})
            fwd["ort"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            hepti.forward(pixels)
            fwd["hepti"].append(time.perf_counter() - t0)
            bar.update(1)
        bar.close()
        nodes = node_times(Path(sess.end_profiling()), warm)
    flops = cnnsingle.op_flops(graph, size, size)
    shapes = graph.shapes(size, size)
    node = vgg_node if model == "vgg16" else (lambda op: ort_node(op.name))
    rows = []
    for i, (conv, pool) in enumerate(steps):  # the chain's steps
        names = [node(conv)] + ([node(pool)] if pool is not None else [])
        hs = [r[i] for r in h_steps]
        rows.append({"op": conv.name + (f"+{pool.name}" if pool is not None else ""),
                     "label": cnnsingle.op_label(conv, shapes) + (" +pool" if pool else ""),
                     "hepti_ms": min(hs) * 1e3, "ort_ms": _ort_ms(nodes, names, min),
                     "hepti_median_ms": statistics.median(hs) * 1e3,
                     "ort_median_ms": _ort_ms(nodes, names, statistics.median),
                     "gflop": flops.get(conv.name, 0.0) / 1e9})
    for i, op in enumerate(graph.ops):
        if op.name in in_chain:
            continue
        hs = [r[i] for r in h_ops]
        rows.append({"op": op.name, "label": cnnsingle.op_label(op, shapes),
                     "hepti_ms": min(hs) * 1e3, "ort_ms": _ort_ms(nodes, [node(op)], min),
                     "hepti_median_ms": statistics.median(hs) * 1e3,
                     "ort_median_ms": _ort_ms(nodes, [node(op)], statistics.median),
                     "gflop": flops.get(op.name, 0.0) / 1e9})
    doc = result_doc("cnn-ops", model=model, size=size, rounds=args.rounds,
                     versions=cnnsingle.versions(), ops=rows,
                     forward_min_ms={k: min(v) * 1e3 for k, v in fwd.items()},
                     forward_median_ms={k: statistics.median(v) * 1e3 for k, v in fwd.items()})
    print(format_table(doc))
    out = Path(args.out or f"results/cnn-ops-{model}-{size}.json")
    write_json(doc, out)
    harness.write_csv(rows, list(rows[0]), out.with_suffix(".csv"))
    print(f"wrote {out}, {out.with_suffix('.csv')}")
    return 0


def _rate(gflop: float, ms: float | None) -> str:
    return f"{gflop / ms * 1e3:6.1f}" if ms else "     -"


def format_table(doc: dict) -> str:
    lines = [f"{'op':24s} {'what':34s} {'hepti ms':>9s} {'ort ms':>8s} {'diff':>7s} "
             f"{'GF/s':>6s} {'ort':>6s}"]
    th = to = 0.0
    for r in doc["ops"]:
        o = r["ort_ms"]
        th += r["hepti_ms"]
        to += o or 0.0
        diff = f"{r['hepti_ms'] - o:+7.3f}" if o else "      -"
        lines.append(f"{r['op']:24s} {r['label']:34s} {r['hepti_ms']:9.3f} "
                     f"{o if o else float('nan'):8.3f} {diff} {_rate(r['gflop'], r['hepti_ms'])} "
                     f"{_rate(r['gflop'], o)}")
    fmin, fmed = doc["forward_min_ms"], doc["forward_median_ms"]
    lines.append(f"sum of the ops' minima: hepti {th:.2f} ms, onnxruntime {to:.2f} ms "
                 f"({th / to:.3f})")
    lines.append(f"whole forwards: minima hepti {fmin['hepti']:.2f} ms, onnxruntime "
                 f"{fmin['ort']:.2f} ({fmin['hepti'] / fmin['ort']:.3f}); medians "
                 f"{fmed['hepti']:.2f}, {fmed['ort']:.2f} ({fmed['hepti'] / fmed['ort']:.3f})")
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", choices=MODELS, default="resnet50",
                    help="the model (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=15,
                    help="interleaved rounds (default %(default)s)")
    ap.add_argument("--size", type=int, default=224, help="image side (default %(default)s)")
    ap.add_argument("--weights", default="weights",
                    help="folder of the converted models, DIR/MODEL (default %(default)s)")
    ap.add_argument("--out", default=None,
                    help="the JSON; the CSV goes beside it (default "
                         "results/cnn-ops-MODEL-SIZE.json)")


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
