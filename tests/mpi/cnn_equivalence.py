"""A CNN split by height equals torchvision, for every CNN strategy and several ratio vectors.

Run by tests/test_distributed_launch.py at several world sizes, many cases in one process:
  mpiexec -n N python -m mpi4py tests/mpi/cnn_equivalence.py --model DIR [--model DIR ...]
prints one JSON line per case on rank 0 and exits 1 if any case is off.

Inputs and references (tests/fixtures, made by make_cnn_fixtures.py):
- MobileNetV2 (real weights): the three photos (chelsea, coffee, astronaut) through hepti's
  image preprocessing, as `hepti run --image` reads them, one batch of 3; torchvision's logits
  (within 1e-3, absolute) and top-5 (equal) of each;
- the tiny ResNet-50 / VGG-16: the fixture's random pixels and torchvision's logits.
Each case's logits are also held to the single-device engine's (1e-4 of the largest).

Cases: each of hepti.plan.coedge's strategies, planned by `plan_cnn` on declared costs that
make the ranks unequal (rank i is SPEEDS[i] as fast; the last of 4 nearly useless, so the LP
drops it; a link latency that makes fusion worth it), and --ratios-style vectors: skewed, and
with zeros (ranks with no rows of any map). The ResNet's 65x57 input leaves maps of 2-3 rows
deep in the net, so at 3 and 4 ranks some ranks own no row of them and idle there.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
PHOTOS = {"chelsea": "cnn_image.png", "coffee": "cnn_coffee.png",
          "astronaut": "cnn_astronaut.png"}
TINY = {"resnet50": "resnet50_tiny_expected.npz", "vgg16": "vgg16_tiny_expected.npz"}
ATOL = 1e-3        # logits against torchvision's, absolute
SINGLE_TOL = 1e-4  # against the single-device engine, relative to the largest logit
SPEEDS = (1.0, 0.6, 0.35, 0.005)  # declared relative speed of ranks 0..3
LATENCY_S = 2e-4   # declared per-exchange link latency: fusing some groups pays
RATIOS = {  # --ratios vectors per world size
    1: {"one": [1.0]},
    2: {"skewed": [0.7, 0.3], "zero": [0.0, 1.0]},
    3: {"skewed": [0.7, 0.2, 0.1], "zero": [0.5, 0.0, 0.5], "one-hot": [0.0, 1.0, 0.0]},
    4: {"skewed": [0.7, 0.15, 0.1, 0.05], "zero": [0.5, 0.0, 0.5, 0.0],
        "one-hot": [0.0, 1.0, 0.0, 0.0]},
}


def inputs_for(model_dir: Path, config) -> tuple[np.ndarray, np.ndarray, bool]:
    """(pixels [N, 3, H, W], torchvision's logits [N, classes], compare top-5?) of a model."""
    if config.arch == "mobilenet_v2":
        from hepti.images import load_preprocessor, preprocess
        e = np.load(FIXTURES / "mobilenet_v2_expected.npz")
        pixels = preprocess([FIXTURES / f for f in PHOTOS.values()], load_preprocessor(model_dir))
        want = np.concatenate([e[f"{name}_logits"] for name in PHOTOS])  # [3, 1000]
        return pixels, want, True
    e = np.load(FIXTURES / TINY[config.arch])
    return e["pixels"].astype(np.float32), e["logits"], False  # random nets: logits only


def declared_costs(graph, h: int, w: int, n: int, world: int):
    """CNNCosts as a profile would give them: device i does op l in (its FLOPs / 1e9) /
    SPEEDS[i] seconds, over links of LATENCY_S and 1 GB/s."""
    from hepti.graph.cnn import ADAPTIVE_AVG
    from hepti.plan.coedge import CNNCosts
    shapes, per_row = graph.shapes(h, w), graph.flops_per_row(h, w)
    base = []
    for op in graph.ops:
        out = shapes[op.output]
        rows = shapes[op.input][0] if op.kind == ADAPTIVE_AVG else (out[0] if len(out) == 3 else 1)
        base.append(n * per_row[op.name] * rows / 1e9 + 1e-6)
    speeds = SPEEDS[:world]
    return CNNCosts(op_s=[[t / s for t in base] for s in speeds], overhead_s=[1e-5] * world,
                    latency_s=[LATENCY_S] * world, bandwidth_Bps=[1e9] * world,
                    memory_bytes=[1e10] * world, h=h, w=w, n=n)


def strategies() -> tuple[str, ...]:
    from hepti.plan import coedge
    return getattr(coedge, "CNN_STRATEGIES", ("auto", "even", "proportional", "single"))


def cases(graph, h: int, w: int, n: int, world: int):
    """(case name, Split): every strategy as the planner makes it, then the --ratios vectors
    (as `hepti run --ratios` runs them: one group per op, the head split by columns)."""
    from hepti.graph.split import Split
    from hepti.plan.coedge import plan_cnn
    costs = declared_costs(graph, h, w, n, world)
    for strategy in strategies():
        yield f"--strategy {strategy}", plan_cnn(graph, costs, h, w, n, strategy)["split"]
    for name, vec in RATIOS[world].items():
        yield f"--ratios {name}", Split(tuple(vec))


def run_case(comm, store, graph, split, pixels):
    """The banded forward of `split` on every rank -> logits on rank 0 (None elsewhere)."""
    from hepti.model.cnn import Weights
    from hepti.parallel.bands import BandExecutor, head_rows
    weights = Weights(graph, store.read, head_rows(graph, split, comm.rank, comm.size))
    return BandExecutor(comm, graph, split, weights).forward(pixels if comm.rank == 0 else None)


def describe(split) -> dict:
    groups = split.groups
    return {"ratios": [round(r, 4) for r in split.ratios], "head": split.head,
            "groups": None if groups is None else len(groups),
            "per_group": getattr(split, "per_group", None) is not None}


def main(argv=None) -> int:
    from mpi4py import MPI

    from hepti.graph.cnn import build
    from hepti.parallel.comm import Comm
    from hepti.parallel.single import SingleCNN
    from hepti.weights import WeightStore
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    args = ap.parse_args(argv)
    comm = Comm(MPI.COMM_WORLD)
    rank0, world = comm.rank == 0, comm.size
    bad = 0
    for d in map(Path, args.model):
        with WeightStore(d) as store:
            graph = build(store.config)
            pixels = want = single = None
            if rank0:
                pixels, want, top5 = inputs_for(d, store.config)
                single = SingleCNN.from_store(store).forward(pixels)
            n, _, h, w = comm.mpi.bcast(pixels.shape if rank0 else None)
            plans = comm.mpi.bcast(list(cases(graph, h, w, n, world)) if rank0 else None)
            for name, split in plans:
                got = run_case(comm, store, graph, split, pixels)
                if not rank0:
                    continue
                if got is None or got.shape != want.shape:  # rank 0 must get the logits
                    got = np.full(want.shape, np.inf, np.float32)
                diff = float(np.abs(got - want).max())
                rel = float(np.abs(got - single).max() / np.abs(single).max())
                same_top = all(list(np.argsort(-g)[:5]) == list(np.argsort(-t)[:5])
                               for g, t in zip(got, want)) if top5 else None
                ok = diff <= ATOL and rel <= SINGLE_TOL and same_top is not False
                bad += not ok
                print(json.dumps({"model": store.config.arch, "world": world, "case": name,
                                  **describe(split), "input": [n, h, w],
                                  "max_abs_diff_torchvision": diff, "rel_diff_single": rel,
                                  "top5_equal": same_top, "ok": ok}), flush=True)
    bad = comm.mpi.bcast(bad)
    comm.close()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
