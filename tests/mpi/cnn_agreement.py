"""What the band executor sends == what its band program says it sends (CNNs' agreement test).

For each CNN, split and uneven ratio vector, one forward runs with every verb call recorded
(kind, bytes sent, bytes received, per rank: hepti.parallel.trace `record_messages`), and the
sequence is compared with the collectives of the program hepti.graph.band_program writes for
the same split (kinds, order, bytes per rank: hepti.plan.costmodel.rank_bytes). A halo
exchange a rank takes no part in (it neither sends nor receives a row) is no verb call there,
and so no entry in its expected list. The logits are held to the single-device model too.

Used two ways, like agreement.py:
- by tests/mpi/test_agreement.py under `mpiexec -n 2 ... pytest`;
- standalone at other world sizes:
  mpiexec -n 3 python -m mpi4py tests/mpi/cnn_agreement.py --model DIR [--model DIR ...]
  prints one JSON line per case on rank 0 and exits 1 if any case disagrees.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from helpers import FIXTURES  # noqa: E402
from hepti.graph.band_program import band_program  # noqa: E402
from hepti.graph.cnn import build  # noqa: E402
from hepti.graph.split import Split, conv_rows, head_rows, spatial_ops  # noqa: E402
from hepti.model.cnn import Weights  # noqa: E402
from hepti.parallel.bands import BandExecutor  # noqa: E402
from hepti.parallel.comm import Comm  # noqa: E402
from hepti.parallel.single import SingleCNN  # noqa: E402
from hepti.parallel.trace import Tracer  # noqa: E402
from hepti.plan.costmodel import active_ranks, rank_bytes  # noqa: E402
from hepti.weights import WeightStore  # noqa: E402

TOL = 2e-5
RATIOS = {2: [("70-30", (0.7, 0.3)), ("35-65", (0.35, 0.65))],
          3: [("50-30-20", (0.5, 0.3, 0.2)), ("15-25-60", (0.15, 0.25, 0.6))]}


def pixels_for(model_dir) -> np.ndarray:
    arch = WeightStore(model_dir).config.arch
    if arch == "mobilenet_v2":
        return np.load(FIXTURES / "mobilenet_v2_expected.npz")["image_pixels"].astype(np.float32)
    name = {"resnet50": "resnet50_tiny", "vgg16": "vgg16_tiny"}[arch]
    return np.load(FIXTURES / f"{name}_expected.npz")["pixels"].astype(np.float32)


def splits(graph, ratios) -> list[tuple[str, Split]]:
    """One op a group with either head; fused groups; and (where the net is long enough) two
    groups split by channels between groups split by rows."""
    n = spatial_ops(graph)
    third = max(1, n // 3)
    out = [("per-op cols", Split(ratios)), ("per-op primary", Split(ratios, head="primary")),
           ("fused", Split(ratios, groups=((0, third), (third, n))))]
    if n >= 8:
        out.append(("channels", Split(ratios, groups=((0, 3), (3, 4), (4, 5), (5, n)),
                                      dims=("rows", "channels", "channels", "rows"))))
    return out


def predicted(graph, split, h: int, w: int, n: int, rank: int, size: int
              ) -> list[tuple[str, int, int]]:
    """This rank's (kind, sent, received) for every collective of the band program, in order."""
    prog, cnt = band_program(graph, split, h, w, n, size)
    active = active_ranks(prog, cnt, size)
    if sum(active) < 2:
        return []
    out = []
    for phase, _, _ in prog.phases():
        c = phase.collective
        if c is None:
            continue
        sent, recv = rank_bytes(c, cnt, active)[rank]
        if c.kind == "halo" and not (sent or recv):
            continue
        out.append((c.kind, int(sent), int(recv)))
    return out


def check_case(model_dir, split: Split, world_mpi) -> tuple[bool, str]:
    rank, size = world_mpi.Get_rank(), world_mpi.Get_size()
    px = pixels_for(model_dir)
    tracer = Tracer(rank, record_messages=True)
    comm = Comm(world_mpi, tracer)
    with WeightStore(model_dir) as store:
        graph = build(store.config)
        w = Weights(graph, store.read, head_rows(graph, split, rank, size),
                    conv_rows(graph, split, rank, size))
        got_logits = BandExecutor(comm, graph, split, w).forward(px if rank == 0 else None)
        want_logits = SingleCNN.from_store(store).forward(px) if rank == 0 else None
    got = list(tracer.messages)
    comm.close()
    n, _, h, wd = px.shape
    want = predicted(graph, split, h, wd, n, rank, size)
    if rank == 0:
        err = float(np.abs(got_logits - want_logits).max() / np.abs(want_logits).max())
        if not err <= TOL:
            return False, f"logits differ from one device's by {err:.2e}"
    if got == want:
        return True, f"{len(got)} verb calls agree"
    first = next((i for i, (g, x) in enumerate(zip(got, want)) if g != x), min(len(got), len(want)))
    return False, (f"{len(got)} traced, {len(want)} in the program; first difference at call "
                   f"{first}: traced {got[first] if first < len(got) else None}, "
                   f"program {want[first] if first < len(want) else None}")


def cases(model_dir, size: int):
    with WeightStore(model_dir) as store:
        graph = build(store.config)
    for rname, vec in RATIOS[size]:
        for sname, split in splits(graph, vec):
            yield f"{sname} {rname}", split


def main(argv=None) -> int:
    from mpi4py import MPI  # noqa: F401  (MPI_Init here, when run standalone)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    args = ap.parse_args(argv)
    comm = MPI.COMM_WORLD
    bad = 0
    for d in args.model:
        for name, split in cases(d, comm.Get_size()):
            ok, msg = check_case(d, split, comm)
            results = comm.gather((ok, msg), root=0)
            if comm.Get_rank() == 0:
                good = all(o for o, _ in results)
                bad += not good
                print(json.dumps({"model": Path(d).name, "world": comm.Get_size(), "case": name,
                                  "ok": good, "ranks": [m for _, m in results]}), flush=True)
    bad = comm.bcast(bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
