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
    from hepti.graph.split import conv_rows, streamed_convs
    from hepti.model.cnn import Weights
    from hepti.parallel.bands import BandExecutor, head_rows
    from hepti.parallel.comm import Comm
    from hepti.parallel.single import SingleCNN
    from hepti.weights import WeightStore
    comm = Comm(COMM)
    with WeightStore(model_dir) as store:
        graph = build(store.config)
        rows = head_rows(graph, split, comm.rank, comm.size)
        w = Weights(graph, store.read, rows, conv_rows(graph, split, comm.rank, comm.size),
                    streamed_convs(graph, split))
        got = BandExecutor(comm, graph, split, w, threads).forward(
            pixels if comm.rank == 0 else None)
        want = SingleCNN.from_store(store).forward(pixels) if comm.rank == 0 else None
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
    # one op a group (the blocks run op by op), a group per block and the whole net as one
    # group (each block one kernel, hepti.kernels.inverted, on a band with its halo)
    for split in [Split((0.65, 0.35)), Split((0.5, 0.5), groups=tuple(blocks)),
                  Split((0.3, 0.7), groups=((0, n),))]:
        want, got = _both(mobilenet_dir, split, e["image_pixels"])
        _check(want, got, f"mobilenet {split.ratios} {split.groups and len(split.groups)}")


@pytest.mark.parametrize("groups", [None, "fused", "channels"])
def test_cost_model_counts_the_halo_bytes(resnet_tiny_dir, groups):
    """The planner's exchange bytes (hepti.plan.coedge.predict) equal what the executor's
    verbs moved, per rank: rows held from an earlier exchange, and the whole maps a split by
    channels leaves on every rank, are not fetched again, and the model does not charge them."""
    from hepti.graph.cnn import build
    from hepti.graph.split import conv_rows
    from hepti.model.cnn import Weights
    from hepti.parallel.bands import BandExecutor, Split, head_rows, spatial_ops
    from hepti.parallel.comm import Comm
    from hepti.parallel.trace import Tracer
    from hepti.plan.coedge import CNNCosts, predict
    from hepti.weights import WeightStore
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    comm = Comm(COMM, Tracer(COMM.Get_rank(), record_messages=True))
    with WeightStore(resnet_tiny_dir) as store:
        g = build(store.config)
        n_sp = spatial_ops(g)
        if groups == "channels":  # two ops by channels (a group each, as GenEFlow makes
            # them) between rows groups: a rows group after them holds its input whole
            split = Split((0.6, 0.4), ((0, 4), (4, 5), (5, 6), (6, 20), (20, n_sp)),
                          dims=("rows", "channels", "channels", "rows", "rows"))
        else:
            split = Split((0.6, 0.4), ((0, 4), (4, 20), (20, n_sp)) if groups else None)
        w = Weights(g, store.read, head_rows(g, split, comm.rank, comm.size),
                    conv_rows(g, split, comm.rank, comm.size))
        BandExecutor(comm, g, split, w).forward(px if comm.rank == 0 else None)
    moved = [sum(s for k, s, _ in comm.tracer.messages if k == "halo"),
             sum(r for k, _, r in comm.tracer.messages if k == "halo")]
    comm.close()
    costs = CNNCosts(op_s=[[1e-3] * len(g.ops)] * 2, overhead_s=[0.0] * 2, latency_s=[0.0] * 2,
                     bandwidth_Bps=[1e9] * 2, memory_bytes=[1e9] * 2, h=65, w=57, n=2)
    pr = predict(g, split, costs, 65, 57, n=2)["per_rank"][COMM.Get_rank()]
    model = [pr["halo_bytes_sent"], pr["halo_bytes_recv"]]
    all_ok(moved == model, f"halo bytes moved {moved}, the model's {model}")


def test_pipeline_and_grid_splits_equal_single(resnet_tiny_dir):
    """Per-group ratio vectors (a pipeline: each range of ops on one rank, whole maps) and the
    grid (equal bands, every layer in one group) give one device's logits."""
    from hepti.graph.cnn import build
    from hepti.parallel.bands import Split, spatial_ops
    from hepti.plan.coedge import CNNCosts, pipeline_split
    from hepti.weights import WeightStore
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(resnet_tiny_dir) as st:
        g = build(st.config)
    n = spatial_ops(g)
    costs = CNNCosts(op_s=[[1e-3] * len(g.ops), [3e-3] * len(g.ops)], overhead_s=[0.0] * 2,
                     latency_s=[0.0] * 2, bandwidth_Bps=[1e9] * 2, memory_bytes=[1e9] * 2,
                     h=65, w=57)
    pipe = pipeline_split(g, costs)
    all_ok(len(pipe.groups) == 2 and pipe.groups[0][1] > n // 2, f"pipeline {pipe.groups}")
    for split in (pipe, Split((0.5, 0.5), ((0, n),))):
        want, got = _both(resnet_tiny_dir, split, px)
        _check(want, got, f"{split}")


def test_genetic_splits_equal_single(resnet_tiny_dir):
    """GenEFlow's CNN genomes (hepti.plan.genetic_cnn): fused groups of any length, each group
    its own ratio vector (a rank idle in some groups, busy in others), either head."""
    from hepti.graph.cnn import build
    from hepti.plan.genetic_cnn import CNNSearch
    from hepti.weights import WeightStore
    from hepti.plan.coedge import CNNCosts
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(resnet_tiny_dir) as st:
        g = build(st.config)
    costs = CNNCosts(op_s=[[1e-3] * len(g.ops)] * 2, overhead_s=[0.0] * 2, latency_s=[0.0] * 2,
                     bandwidth_Bps=[1e9] * 2, memory_bytes=[1e9] * 2, h=65, w=57)
    search = CNNSearch(g, costs, 65, 57, 1, [1e9] * 2, seed=3)
    for k in range(3):  # the same genomes on every rank: the generator is seeded alike
        genome = search.mutate(search.random_genome())
        split = genome.split()
        want, got = _both(resnet_tiny_dir, split, px)
        _check(want, got, f"genome {k}: groups {split.groups}, per group {split.per_group}")


def _alternating(n: int, every: int) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    """One op per group, every `every`-th split by channels, the rest by rows."""
    dims = tuple("channels" if i % every == every - 1 else "rows" for i in range(n))
    return dims, tuple((i, i + 1) for i in range(n))


@pytest.mark.parametrize("ratios", [(0.5, 0.5), (0.8, 0.2), (0.0, 1.0), (1.0, 0.0)])
def test_channel_splits_equal_single(resnet_tiny_dir, vgg_tiny_dir, ratios):
    """GenEFlow's vertical split (Split.dims "channels"): every op split by output channels
    (dense convs, ResNet's downsample and identity adds, max pools, VGG's grid pool after),
    then channels and rows alternating (the layouts reconciled by the exchange), with a rank
    that has no channels; each rank loads only its rows of each conv weight."""
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, spatial_ops
    from hepti.weights import WeightStore
    for model_dir, npz in ((resnet_tiny_dir, "resnet50_tiny"), (vgg_tiny_dir, "vgg16_tiny")):
        px = np.load(FIXTURES / f"{npz}_expected.npz")["pixels"].astype(np.float32)
        with WeightStore(model_dir) as st:
            n = spatial_ops(build(st.config))
        for every in (1, 2, 3):
            dims, groups = _alternating(n, every)
            split = Split(ratios, groups, "cols", dims=dims)
            want, got = _both(model_dir, split, px)
            _check(want, got, f"{npz} {ratios} channels every {every}")


def test_depthwise_channel_split_equal_single(mobilenet_dir):
    """MobileNetV2's depthwise convs split by channels (each rank its own input channels),
    per-group vectors that differ, next to fused groups split by rows."""
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, spatial_ops
    from hepti.weights import WeightStore
    e = np.load(FIXTURES / "mobilenet_v2_expected.npz")
    with WeightStore(mobilenet_dir) as st:
        n = spatial_ops(build(st.config))
    groups = ((0, 3),) + tuple((i, i + 1) for i in range(3, n))
    dims = ("rows",) + tuple("channels" if i % 2 else "rows" for i in range(3, n))
    per = tuple((0.3, 0.7) if k % 3 else (0.75, 0.25) for k in range(len(groups)))
    want, got = _both(mobilenet_dir, Split((0.4, 0.6), groups, "cols", per, dims),
                      e["image_pixels"])
    _check(want, got, "mobilenet channels")


def test_streamed_groups_equal_single(resnet_tiny_dir):
    """Groups whose weights are read from the store as each op runs (Split.streamed), split
    by rows and by channels, fused and not: one device's logits."""
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, spatial_ops
    from hepti.weights import WeightStore
    px = np.load(FIXTURES / "resnet50_tiny_expected.npz")["pixels"].astype(np.float32)
    with WeightStore(resnet_tiny_dir) as st:
        n = spatial_ops(build(st.config))
    groups = ((0, 4),) + tuple((i, i + 1) for i in range(4, n))
    dims = tuple("channels" if k % 2 else "rows" for k in range(len(groups)))
    streamed = tuple(k % 3 != 1 for k in range(len(groups)))
    want, got = _both(resnet_tiny_dir, Split((0.7, 0.3), groups, "cols", None, dims, streamed), px)
    _check(want, got, "streamed groups")


@pytest.mark.parametrize("split", [((0.5, 0.5), None), ((0.6, 0.4), None),
                                   ((0.45, 0.55), ((0, 5), (5, 18)))])
def test_vgg_band_chain_equals_one_rank(split):
    """VGG's convolutions on 2 ranks' bands as one PlainChain across the halo exchanges
    (`BandExecutor._band_runs`: each writing into the zero-bordered map the next reads, the
    halo received into its rows above and below the band; at 1/2 width, every Cout whole
    32-wide panels): the logits bit for bit one rank's (its chain), even and uneven bands,
    odd heights, a batch of 2, fused groups; and the runs are there."""
    from hepti.config import CNNConfig
    from hepti.graph.cnn import build
    from hepti.graph.split import Split, conv_rows, spatial_ops, streamed_convs
    from hepti.model.cnn import Weights, tensors_reader
    from hepti.parallel.bands import BandExecutor, head_rows
    from hepti.parallel.comm import Comm
    cfg = CNNConfig(arch="vgg16", width_divisor=2, num_classes=10, classifier_hidden=64,
                    name="v2")
    rng = np.random.default_rng(0)
    g = build(cfg)
    tensors = {k: rng.standard_normal(s, dtype=np.float32) *
               np.float32((0.5 / max(1, np.prod(s[1:]))) ** 0.5)
               for k, s in g.weights().items()}
    ratios, groups = split
    assert groups is None or groups[-1][1] == spatial_ops(g)
    sp = Split(ratios, groups=groups, head="primary")
    comm = Comm(COMM)
    w = Weights(g, tensors_reader(tensors), head_rows(g, sp, comm.rank, comm.size),
                conv_rows(g, sp, comm.rank, comm.size), streamed_convs(g, sp))
    ex = BandExecutor(comm, g, sp, w, 1)
    one = BandExecutor(Comm(None), g, Split((1.0,), ((0, spatial_ops(g)),)),
                       Weights(g, tensors_reader(tensors)), 1) if comm.rank == 0 else None
    for b, h, wd in [(1, 32, 32), (2, 44, 38)]:  # a batch: the halo through a buffer
        x = rng.standard_normal((b, 3, h, wd), dtype=np.float32)
        got = ex.forward(x if comm.rank == 0 else None)
        again = ex.forward(x if comm.rank == 0 else None)  # the kept plan and maps
        runs = ex._band_runs(ex.program(h, wd))
        all_ok(sum(len(st) for run in runs.values() for st in run) >= (4 if groups else 12),
               f"{split} {h}x{wd}: runs {runs}")
        if comm.rank == 0:
            want = one.forward(x)
            all_ok(np.array_equal(got, want) and np.array_equal(again, want),
                   f"{split} {h}x{wd}: error {float(np.abs(got - want).max()):.2e}")
        else:
            all_ok(got is None and again is None, "rank 1 returned logits")
    comm.close()
