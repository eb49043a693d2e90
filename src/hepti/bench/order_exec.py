"""Executed peaks (issue 20): each rank's measured activation high-water mark under BTSearch's
order against the memory model's peak, for the families hepti runs.

    hepti bench order-exec [--out results/order-exec.json]                      # 1 rank
    mpiexec -n 2 python -m mpi4py -m hepti bench order-exec --out ...-2.json     # 2 ranks

Per model and rank, three figures of one forward (batch 1, after a warm-up forward):
- `counter_peak_bytes`: the allocation counter (hepti.model.livebytes) on the executor's
  tensors, the bytes of the arrays it holds (each buffer once), at their high-water;
- `tracemalloc_peak_bytes`: Python's tracemalloc over the same forward (numpy reports its
  allocations to it), above what was allocated before: it also sees what kernels allocate
  from Python (an MLP's or attention's temporaries, collective buffers), but not what Numba
  allocates inside a kernel;
- `modelled_peak_bytes`: the model's peak for what that rank runs.
  CNNs: hepti.order.memory's peak of BTSearch's order (hepti.order.search.executor_order) with
  the executor's own copy of the pixels and the logits it hands back counted (count_io), on
  one rank; at 2 ranks, of the rank's part (`BandExecutor.rank_dag`: its bands, each widening
  by a halo a step). `modelled_peak_default_bytes` is the default model's figure (inputs and
  outputs left out: results/order.json's).
  BERT, ViT: hepti.graph.lower.activation_memory of the rank's schedule at its counts
  (costmodel.held_bytes), tensors only (`scratch=False`; `modelled_scratch_bytes` is the
  figure with attention's scores and a reduce_scatter's blocks added). Their graph is a
  chain: every operator is a cut, so BTSearch's order is the one order there is.
`ratio` = counter / model. The target: within 10%.

CNNs run with seeded random weights made in memory; BERT-base and ViT-B/16 from
`hepti convert --random bert-base|vit-base --out weights/bert-base|vit-base`.
"""
from __future__ import annotations

import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from hepti.bench.harness import positive_int, result_doc, write_json
from hepti.bench.registry import module_main
from hepti.config import CNNConfig
from hepti.counts import counts
from hepti.graph import lower
from hepti.graph.cnn import build
from hepti.families import family, family_graph
from hepti.graph.opdag import from_cnn
from hepti.graph.split import Split
from hepti.inputs import Batch
from hepti.model.cnn import CNNModel, Weights, tensors_reader
from hepti.model.livebytes import AllocationCounter
from hepti.parallel.bands import BandExecutor, head_rows
from hepti.parallel.comm import Comm
from hepti.parallel.single import SingleCNN
from hepti.parallel.engine import Job
from hepti.plan.costmodel import held_bytes
from hepti.order.memory import order_peak
from hepti.order.search import executor_order
from hepti.plan.planfile import DIMS, Plan
from hepti.weights import WeightStore

CNNS = {"mobilenet_v2": "mobilenet-v2", "resnet50": "resnet50", "vgg16": "vgg16"}
ENCODERS = {"bert-base-128": ("bert-base", 128), "bert-base-256": ("bert-base", 256),
            "vit-base-224": ("vit-base", None)}
DEFAULT = ["mobilenet_v2", "resnet50", "vgg16", "bert-base-128", "bert-base-256", "vit-base-224"]


def _traced(fn):
    """(fn's result, tracemalloc's peak above the start during fn)."""
    tracemalloc.start()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    try:
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return out, peak - base


def _row(name, world, counter, traced, modelled, **extra) -> dict:
    return {"model": name, "ranks": world.size, "rank": world.rank,
            "counter_peak_bytes": counter.peak, "counter_peak_at": counter.peak_at,
            "tracemalloc_peak_bytes": traced, "modelled_peak_bytes": int(modelled),
            "ratio": round(counter.peak / modelled, 4) if modelled else None, **extra}


def cnn_rows(arch: str, world, side: int = 224) -> dict:
    """One rank's row for a CNN at side x side, batch 1, under BTSearch's order."""
    cfg = CNNConfig(arch, name=arch)
    graph = build(cfg)
    rng = np.random.default_rng(0)
    tensors = {k: rng.standard_normal(s, dtype=np.float32) * np.float32(0.02)
               for k, s in graph.weights().items()}
    dag = from_cnn(graph, 1, side, side)
    best = executor_order(dag)
    file_names = [op.name for op in graph.ops]
    x = np.random.default_rng(1).standard_normal((1, 3, side, side), dtype=np.float32)
    extra = {"input": [1, 3, side, side], "order_differs_from_file": best.order != file_names,
             "file_order_modelled_peak_bytes": order_peak(dag, file_names, count_io=True),
             "modelled_peak_default_bytes": order_peak(dag, best.order),
             "order_proven": best.proven}
    if world.size == 1:
        model = SingleCNN(CNNModel(cfg, tensors_reader(tensors), order=best.order))
        del tensors
        model.forward(x)  # warm-up (Numba's compiled code, caches)
        counter = AllocationCounter()
        _, traced = _traced(lambda: model.forward(x, counter=counter))
        return _row(arch, world, counter, traced, best.peak_bytes, **extra)
    split = Split(tuple([1.0 / world.size] * world.size))
    weights = Weights(graph, tensors_reader(tensors), head_rows(graph, split, world.rank,
                                                                 world.size))
    del tensors
    ex = BandExecutor(world, graph, split, weights, order=best.order)
    ex.forward(x if world.rank == 0 else None)
    counter = AllocationCounter()
    _, traced = _traced(lambda: ex.forward(x if world.rank == 0 else None, counter=counter))
    part, seq = ex.rank_dag(side, side, 1, world.rank)
    extra.update(split="even rows, head by columns",
                 one_rank_modelled_peak_bytes=best.peak_bytes)
    return _row(arch, world, counter, traced, order_peak(part, seq, count_io=True), **extra)


def _weights(shape: str, root: Path) -> Path:
    out = root / shape
    if not (out / "index.json").exists():
        raise SystemExit(f"{out} is missing: make it with `hepti convert --random {shape} "
                         f"--out {out}`")
    return out


def encoder_rows(name: str, world, root: Path) -> dict:
    """One rank's row for BERT-base (seq T) or ViT-B/16 at 224: `single` on one rank,
    `tensor` with even shares on two."""
    shape, T = ENCODERS[name]
    store = WeightStore(_weights(shape, root))
    cfg = store.config
    rng = np.random.default_rng(0)
    if "pixels" in family(cfg).inputs:
        T = cfg.seq_len
        px = rng.standard_normal((1, 3, cfg.image_size, cfg.image_size), dtype=np.float32)
        batch = Batch(None, np.ones((1, T), np.int64), None, pixels=px)
    else:
        ids = rng.integers(1, cfg.vocab_size, (1, T))
        batch = Batch(ids, np.ones((1, T), np.int64), np.zeros((1, T), np.int64))
    P = world.size
    strategy = "single" if P == 1 else "tensor"
    plan = Plan(strategy=strategy, world_size=P, ratios={d: [1.0 / P] * P for d in DIMS})
    job = Job(world, store, plan)
    ex = job.executor
    b = batch if world.rank == 0 else None
    ex.forward(b, 1, T)  # warm-up
    counter = AllocationCounter()
    _, traced = _traced(lambda: ex.forward(b, 1, T, counter=counter))
    # the model: the rank's schedule at this shape, at its counts
    g = family_graph(cfg, 1, T)
    assign = lower.assignment(g, "single" if P == 1 else "tensor")
    steps = lower.schedule(g, assign, cfg.num_hidden_layers)
    cnt = {"rows": counts(T, ex.row_ratios)[world.rank],
           "heads": ex.units["heads"][world.rank], "ffn": ex.units["ffn"][world.rank]}
    primary = world.rank == 0
    model = {}
    for scratch in (False, True):
        terms = lower.activation_memory(g, steps, keep=(g.output,), scratch=scratch)
        model[scratch] = held_bytes(terms, cnt, primary, 1).get("activations", 0.0)
    job.close()
    store.close()
    return _row(name, world, counter, traced, model[False], input=[1, T],
                strategy=strategy, modelled_scratch_bytes=int(model[True]),
                order_note="a chain: every operator is a cut, one order exists")


def add_arguments(ap) -> None:
    ap.add_argument("--models", nargs="*", default=DEFAULT,
                    help=f"of {', '.join(list(CNNS) + list(ENCODERS))}")
    ap.add_argument("--side", type=positive_int, default=224, help="CNN input side (default 224)")
    ap.add_argument("--weights", default="weights", help="where bert-base/ and vit-base/ are")
    ap.add_argument("--out", default=None, help="write the rows as JSON here (rank 0)")


def run(args) -> int:
    try:
        from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
        world = Comm(MPI.COMM_WORLD) if MPI.COMM_WORLD.Get_size() > 1 else Comm(None)
    except ImportError:
        world = Comm(None)
    rows = []
    for name in args.models:
        t0 = time.perf_counter()
        if name in CNNS:
            row = cnn_rows(name, world, args.side)
        elif name in ENCODERS:
            row = encoder_rows(name, world, Path(args.weights))
        else:
            raise SystemExit(f"unknown model {name!r}")
        gathered = world.mpi.gather(row, root=0) if world.mpi is not None else [row]
        if world.rank == 0:
            for r in gathered:
                r["seconds"] = round(time.perf_counter() - t0, 2)
                print(f"{r['model']:16s} rank {r['rank']}/{r['ranks']}: counter "
                      f"{r['counter_peak_bytes'] / 2**20:8.2f} MiB  model "
                      f"{r['modelled_peak_bytes'] / 2**20:8.2f} MiB  ratio {r['ratio']}  "
                      f"tracemalloc {r['tracemalloc_peak_bytes'] / 2**20:8.2f} MiB",
                      file=sys.stderr)
            rows += gathered
    if world.rank == 0 and args.out:
        write_json(result_doc("order-exec", ranks=world.size,
                              target="counter within 10% of the modelled peak (|ratio - 1| <= 0.10)",
                              rows=rows, met=all(abs(r["ratio"] - 1) <= 0.10 for r in rows if r["ratio"])),
                   args.out)
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
