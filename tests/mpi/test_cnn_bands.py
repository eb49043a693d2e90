"""The height split (hepti.parallel.bands) at 2 ranks against the single-device CNN (itself
checked against torchvision in tests/test_cnn.py): uneven ratios, a rank with no rows, fused
groups, and both ways of splitting the head, on maps whose heights do not divide evenly."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import FIXTURES
from mpi_helpers import COMM, all_ok

TOL = 2e-5


def _both(model_dir, split, pixels, threads=1):
    """(single-device logits, banded logits) on rank 0; (None, None) elsewhere."""
    from hepti.graph.cnn import build
    from hepti.model.cnn import CNNModel, Weights
    from hepti.parallel.bands import BandExecutor, head_rows
    from hepti.parallel.comm import Comm
    from hepti.weights import WeightStore
    comm = Comm(COMM)
    with WeightStore(model_dir) as store:
        graph = build(store.config)
        rows = head_rows(graph, split, comm.rank, comm.size)
        w = Weights(graph, store.read, rows if split.head == "cols" else
                    {k: v for k, v in rows.items()})
        got = BandExecutor(comm, graph, split, w, threads).forward(
            pixels if comm.rank == 0 else None)
        want = CNNModel.from_store(store).forward(pixels) if comm.rank == 0 else None
    comm.close()
    return want, got


def _check(want, got, what):
    if COMM.Get_rank() == 0:
        err = float(np.abs(got - want).max() / np.abs(want).max())
        all_ok(got.shape == want.shape and err <= TOL, f"{what}: error {err:.2e}")
    else:
        all_ok(got is None, f"{what}: rank {COMM.Get_rank()} returned logits")


@pytest.mark.parametrize("ratios", [(0.5, 0.5), (0.8, 0.2), (0.3, 0.7), (1.0, 0.0)])
@pytest.mark.parametrize("head", ["cols", "primary"])
def test_resnet_bands_equal_single(resnet_tiny_dir, ratios, head):
    from hepti.parallel.bands import Split
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    want, got = _both(resnet_tiny_dir, Split(ratios, head=head), px)
    _check(want, got, f"resnet {ratios} {head}")


def test_fused_groups_equal_single(resnet_tiny_dir, vgg_tiny_dir):
    """Groups of several ops (one exchange each, overlap recomputed), the whole net as one
    group, and VGG's grid pool (the whole map gathered) with its 3-linear head."""
    from hepti.graph.cnn import build
    from hepti.parallel.bands import Split, spatial_ops
    from hepti.weights import WeightStore
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(resnet_tiny_dir) as st:
        n = spatial_ops(build(st.config))
    for groups in [((0, 2), (2, 9), (9, n)), ((0, n),)]:
        want, got = _both(resnet_tiny_dir, Split((0.6, 0.4), groups=groups), px)
        _check(want, got, f"resnet groups {groups}")
    px = np.load(FIXTURES / "vgg16_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(vgg_tiny_dir) as st:
        n = spatial_ops(build(st.config))
    for split in [Split((0.7, 0.3)), Split((0.45, 0.55), groups=((0, 5), (5, n)))]:
        want, got = _both(vgg_tiny_dir, split, px)
        _check(want, got, f"vgg {split}")


def test_mobilenet_bands_equal_single(mobilenet_dir):
    """MobileNetV2's depthwise convolutions and residual adds, on the real image, fused by
    inverted-residual block."""
    from hepti.graph.cnn import build
    from hepti.parallel.bands import Split, spatial_ops
    from hepti.weights import WeightStore
    e = np.load(FIXTURES / "mobilenet_v2_expected.npz")
    with WeightStore(mobilenet_dir) as st:
        g = build(st.config)
    n = spatial_ops(g)
    blocks, at = [], 0  # one group per features.i
    for i in range(1, n + 1):
        if i == n or g.ops[i].name.split(".")[1] != g.ops[i - 1].name.split(".")[1]:
            blocks.append((at, i))
            at = i
    for split in [Split((0.65, 0.35)), Split((0.5, 0.5), groups=tuple(blocks))]:
        want, got = _both(mobilenet_dir, split, e["image_pixels"])
        _check(want, got, f"mobilenet {split.ratios} {'fused' if split.groups else ''}")
