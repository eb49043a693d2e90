"""Executing in an order (issue 20): the executors run the operators in a given order and free
each activation after its last reader; the allocation counter (hepti.model.livebytes) reads
what they hold from the arrays themselves, and equals the memory model's peak
(hepti.order.memory) where the model applies. Outputs do not depend on the order."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.config import CNNConfig
from hepti.graph.cnn import build
from hepti.graph.opdag import from_cnn
from hepti.model.livebytes import AllocationCounter, TrackedDict, buffer_of
from hepti.order.memory import compile_problem, order_peak
from hepti.parallel.single import SingleCNN
from order_helpers import TINY, encoder_batch, late_downsample_order, pixels, random_cnn

# --- the counter itself ---------------------------------------------------------------------

def test_counter_counts_buffers_once_and_replacement_overlaps():
    c = AllocationCounter(record=True)
    y = np.zeros((4, 6), np.float32)
    env = TrackedDict(c)
    env["q"], env["kv"] = y[:, :2], y[:, 2:]  # two views of one buffer: its bytes once
    assert c.live == y.nbytes
    env.pop("q")
    assert c.live == y.nbytes  # K/V still view it
    env["kv"] = np.ones((4, 4), np.float32)  # replaced: both held for a moment
    assert c.peak == y.nbytes + 64 and c.live == 64
    del env["kv"]
    assert c.live == 0 and buffer_of(y[:, 1:]) is y


def test_an_aligned_arrays_slack_is_not_counted():
    """hepti.kernels._views.aligned_empty's array starts on a line inside a buffer 64 bytes
    longer: the activation's own bytes count, as for numpy's own arrays; a view of part of
    a buffer still counts the whole buffer."""
    from hepti.kernels._views import aligned_empty
    c = AllocationCounter()
    env = TrackedDict(c)
    env["x"] = a = aligned_empty((3, 5, 16))
    assert buffer_of(a).nbytes == a.nbytes + 64 and c.live == a.nbytes
    env["y"] = a[1:]  # the same buffer, held once
    del env["x"]
    assert c.live == a.nbytes
    del env["y"]
    env["z"] = np.zeros(40, np.float32)[:20]  # half a buffer: the buffer's bytes
    assert c.live == 160


def test_a_huge_page_array_is_held_by_its_views_and_counted():
    """huge_empty (a chain's weights and arena, a layer's packed weights): from 2 MiB on a
    mapping of its own on a 2 MiB boundary, held by its views alone after the array goes; the
    counter counts its bytes as a buffer like any other, below 2 MiB as at it."""
    import gc
    from hepti.kernels._views import HUGE_PAGE, huge_empty
    a = huge_empty(HUGE_PAGE // 4 + 3)
    assert a.dtype == np.float32 and a.flags.c_contiguous and a.flags.writeable
    assert a.shape == (HUGE_PAGE // 4 + 3,) and a.ctypes.data % HUGE_PAGE == 0
    tail = a[-3:]
    del a
    gc.collect()
    tail[...] = 1.0  # the mapping lives while a view of it does
    assert tail.sum() == 3.0
    for n in (100, HUGE_PAGE // 4 + 3):
        c = AllocationCounter()
        env = TrackedDict(c)
        env["w"] = huge_empty(n)
        assert c.live >= 4 * n
        del env["w"]
        assert c.live == 0


# --- one process (the band executor on a group of one, every spatial op in one group) -------

@pytest.mark.parametrize("name", sorted(TINY))
def test_counter_equals_the_model_peak_in_file_and_btsearch_order(name):
    """The counter's high-water is the model's peak exactly, with the executor's input copy
    and the output it hands back counted (count_io), in the file order and in BTSearch's. At
    a height whose every row some op reads: the band executor makes only the rows its
    readers need (at 48, VGG's last 2x2 pool skips a 3-row map's last row, and the executor
    holds 256 bytes less than the whole-map model there)."""
    from hepti.order.search import executor_order
    model = random_cnn(name)
    h, w = 64, 40
    dag = from_cnn(model.graph, 1, h, w)
    best = executor_order(dag)
    for order in (None, best.order):
        model.set_order(order)
        c = AllocationCounter(record=True)
        SingleCNN(model).forward(pixels(1, h, w), counter=c)
        names = order or [op.name for op in model.graph.ops]
        assert c.peak == order_peak(dag, names, count_io=True)
        # step by step too: after each op, the counter holds the model's step
        pb = compile_problem(dag, count_io=True)
        steps = pb.profile([dag.index[n] for n in names])
        made = [v for label, v in c.steps[1:]]  # the first is the pixels' copy
        assert made == steps
        assert c.live == dag.tensors[model.graph.output].bytes  # only the logits remain


def test_resnet_in_another_order_same_logits_and_the_counter_follows_the_model():
    ref = random_cnn("resnet50")
    x = pixels(2, 56, 48)
    want = SingleCNN(ref).forward(x)
    order = late_downsample_order(ref.graph)
    assert order != [op.name for op in ref.graph.ops]
    model = random_cnn("resnet50", order=order)
    c = AllocationCounter(record=True)
    got = SingleCNN(model).forward(x, counter=c)
    np.testing.assert_array_equal(got, want)  # bit for bit: each op's arithmetic is the same
    dag = from_cnn(model.graph, 2, 56, 48)
    pb = compile_problem(dag, count_io=True)
    steps = pb.profile([dag.index[n] for n in order])
    assert [v for _, v in c.steps[1:]] == steps
    assert steps != pb.profile(list(range(len(dag.ops))))  # the order did change what is held
    assert c.peak == order_peak(dag, order, count_io=True)


def test_an_order_that_is_not_topological_is_refused():
    g = build(CNNConfig(**TINY["resnet50"]))
    names = [op.name for op in g.ops]
    with pytest.raises(ValueError, match="before the op that makes"):
        g.run_order(names[1:2] + names[:1] + names[2:])
    with pytest.raises(ValueError, match="once"):
        g.run_order(names[:-1])


# --- the band executor on one rank ----------------------------------------------------------

@pytest.mark.parametrize("name", sorted(TINY))
@pytest.mark.parametrize("fused", [False, True])
def test_band_executor_on_one_rank_holds_the_model_peak(name, fused):
    """On one rank the height-split executor holds what the model prices for its sequence
    (rank_dag), fused groups included: it lets each band go after its last reader."""
    from hepti.graph.split import Split
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    model = random_cnn(name)
    g = model.graph
    split = Split((1.0,), ((0, 3), (3, spatial_ops(g))) if fused else None)
    ex = BandExecutor(Comm(None), g, split, model.weights)
    x = pixels(1, 48, 40)
    c = AllocationCounter()
    got = ex.forward(x, counter=c)
    np.testing.assert_allclose(got, SingleCNN(model).forward(x), rtol=1e-5, atol=1e-6)
    dag, order = ex.rank_dag(48, 40, 1, 0)
    assert c.peak == order_peak(dag, order, count_io=True)


def test_band_executor_follows_a_given_order_inside_a_fused_group():
    from hepti.graph.split import Split
    from hepti.parallel.bands import BandExecutor
    from hepti.parallel.comm import Comm
    model = random_cnn("resnet50")
    g = model.graph
    order = late_downsample_order(g)
    split = Split((1.0,), ((0, spatial_ops(g)),))  # one group: the order decides everything
    ex = BandExecutor(Comm(None), g, split, model.weights, order=order)
    assert [g.ops[i].name for i in ex.sequence] == order
    x = pixels(1, 56, 48)
    c = AllocationCounter()
    default = BandExecutor(Comm(None), g, split, model.weights)
    np.testing.assert_array_equal(ex.forward(x, counter=c), default.forward(x))
    dag, seq = ex.rank_dag(56, 48, 1, 0)
    assert c.peak == order_peak(dag, seq, count_io=True)


def spatial_ops(g):
    from hepti.graph.split import spatial_ops as n
    return n(g)


# --- the planner: a memory cap priced by the order's peak -----------------------------------

def test_cnn_planner_caps_a_share_by_the_peak_of_btsearchs_order():
    """ResNet-50 at 224 on a fast device with little memory and a slow one with plenty: the
    fast one's share is capped by (memory - weights) / the activations' peak. Priced by the
    largest input + output of one op (4.8 MB) it got 0.8 of the rows, and its executor would
    have held 0.8 x 7.2 MB against a 3.9 MB room; priced by BTSearch's order's peak, which the
    executors hold (tests above), it gets what fits."""
    import math
    from hepti.plan.coedge import CNNCosts, activation_peak, solve_ratios
    from hepti.order.search import executor_order
    g = build(CNNConfig("resnet50"))
    h = w = 224
    shapes = g.shapes(h, w)
    L = sum(op.kind in ("conv", "maxpool") for op in g.ops)
    crude = max(4 * (math.prod(shapes[op.input]) + math.prod(shapes[op.output]))
                for op in g.ops[:L])
    peak = activation_peak(g, h, w)
    assert peak == executor_order(from_cnn(g, 1, h, w)).peak_bytes > 1.4 * crude
    W = g.weight_bytes()
    room = 0.8 * crude
    costs = CNNCosts(op_s=[[1e-3] * len(g.ops), [3e-3] * len(g.ops)], overhead_s=[0.0, 0.0],
                     latency_s=[1e-4, 1e-4], bandwidth_Bps=[1e9, 1e9],
                     memory_bytes=[W + room, 1e12], h=h, w=w)
    r = solve_ratios(g, costs, [0, 1], h, w, 1, weight_bytes=[W, W])
    assert r is not None
    assert r[0] == pytest.approx(room / peak, rel=1e-6)  # the cap binds: as much as fits
    old_share = room / crude  # what the one-op figure allowed: 0.8
    assert old_share * peak > 1.4 * room  # ... and its executor would have needed 40% more


# --- the transformer interpreter ------------------------------------------------------------

@pytest.mark.parametrize("which", ["tiny_dir", "vit_dir"])
def test_interpreter_counter_equals_the_schedule_model(which, request):
    """One rank: the interpreter's held tensors (its MLP's hidden one included) come to
    lower.activation_memory's peak without kernel scratch, exactly. The encoder graph is a
    chain: one order, which it runs."""
    from hepti.graph import lower
    from hepti.families import family_graph
    from hepti.parallel.comm import Comm
    from hepti.parallel.engine import Job
    from hepti.plan.costmodel import held_bytes
    from hepti.plan.planfile import DIMS, Plan
    from hepti.weights import WeightStore
    store = WeightStore(request.getfixturevalue(which))
    cfg = store.config
    b, T = encoder_batch(cfg, 9)
    job = Job(Comm(None), store, Plan(strategy="single", world_size=1,
                                      ratios={d: [1.0] for d in DIMS}))
    c = AllocationCounter()
    job.executor.forward(b, 1, T, counter=c)
    g = family_graph(cfg, 1, T)
    steps = lower.schedule(g, lower.assignment(g, "single"), cfg.num_hidden_layers)
    terms = lower.activation_memory(g, steps, keep=(g.output,), scratch=False)
    units = {"rows": T, "heads": cfg.num_attention_heads, "ffn": cfg.intermediate_size}
    modelled = held_bytes(terms, units, True, 1)["activations"]
    assert c.peak == modelled
    job.close()
    store.close()
