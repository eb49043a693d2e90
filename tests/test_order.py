"""Operator order: the memory model by hand, BTSearch against brute force and the downset DP.

Peaks are in bytes; the small graphs below are priced by hand in their comments.
"""
from __future__ import annotations

import random

import pytest

from hepti.errors import GraphError, PlanError
from hepti.graph.opdag import OpDag, OpNode, TensorInfo, from_cnn, from_encoder, random_dag
from hepti.order.memory import compile_problem, order_peak
from hepti.order.btsearch import (blocks, btsearch, greedy_least_peak, lower_bounds, random_order,
                                  restrict, reverse_postorder, topological)
from hepti.order.exact import TooLarge, brute_force, count_orders, downset_dp
from hepti.order.search import order_graph


def dag(ops, sizes, inputs=("x",), outputs=("y",), name="hand"):
    """ops: (name, op_type, inputs, outputs) with tensors given as space-separated names."""
    nodes = [OpNode(n, t, tuple(i.split()), tuple(o.split())) for n, t, i, o in ops]
    return OpDag(name, nodes, {t: TensorInfo(b, (1,)) for t, b in sizes.items()}, inputs, outputs)


# x -> P -> t(1); two branches t -> A1 -> a1(8) -> A2 -> a2(1) and t -> B1 -> b1(8) -> B2 -> b2(1);
# J(a2, b2) -> y. One branch at a time: the big tensors a1 and b1 are never live together.
BRANCHES = dict(
    ops=[("P", "Conv", "x", "t"), ("A1", "Conv", "t", "a1"), ("B1", "Conv", "t", "b1"),
         ("A2", "Conv", "a1", "a2"), ("B2", "Conv", "b1", "b2"), ("J", "Concat", "a2 b2", "y")],
    sizes={"x": 4, "t": 1, "a1": 8, "b1": 8, "a2": 1, "b2": 1, "y": 2})


# --- the memory model, by hand --------------------------------------------------------------

def test_chain_peak_is_the_largest_input_plus_output():
    # x(5) -> A -> t1(10) -> B -> t2(20) -> C -> y(7): steps A 10, B 10 + 20, C 20
    g = dag([("A", "Conv", "x", "t1"), ("B", "Conv", "t1", "t2"), ("C", "Conv", "t2", "y")],
            {"x": 5, "t1": 10, "t2": 20, "y": 7})
    pb = compile_problem(g)
    assert pb.profile([0, 1, 2]) == [10, 30, 20]
    # counting inputs and outputs: A 5 + 10, B 10 + 20 (x freed after A), C 20 + 7
    assert compile_problem(g, count_io=True).profile([0, 1, 2]) == [15, 30, 27]


def test_the_order_decides_which_tensors_are_live_together():
    g = dag(**BRANCHES)
    # file order P A1 B1 A2 B2 J: at B1, t + a1 + b1 = 17
    assert order_peak(g, ["P", "A1", "B1", "A2", "B2", "J"]) == 17
    # a branch at a time: A2 has t + a1 + a2 = 10, B1 has t + a2 + b1 = 10, B2 a2 + b1 + b2 = 10
    assert order_peak(g, ["P", "A1", "A2", "B1", "B2", "J"]) == 10
    r = order_graph(g)
    assert (r.peak_bytes, r.file_order_peak_bytes, r.proven) == (10, 17, True)
    assert r.order in (["P", "A1", "A2", "B1", "B2", "J"], ["P", "B1", "B2", "A1", "A2", "J"])
    # with the graph's input and output counted: x lives until P, y from J on
    assert order_graph(g, count_io=True).peak_bytes == 10
    assert order_peak(g, ["P", "A1", "A2", "B1", "B2", "J"], count_io=True) == 10
    assert compile_problem(g, count_io=True).profile([0, 1, 3, 2, 4, 5]) == [5, 9, 10, 10, 10, 4]


def test_inplace_reuses_an_input_only_at_its_last_read():
    # x -> C -> c(10) -> R (Relu) -> r(10) -> D -> y; R may write r over c
    chain = [("C", "Conv", "x", "c"), ("R", "Relu", "c", "r"), ("D", "Conv", "r", "y")]
    g = dag(chain, {"x": 1, "c": 10, "r": 10, "y": 1})
    assert compile_problem(g).profile([0, 1, 2]) == [10, 20, 10]
    assert compile_problem(g, inplace=True).profile([0, 1, 2]) == [10, 10, 10]
    # c is read again after R (by E), so R cannot overwrite it
    g2 = dag(chain[:2] + [("E", "Add", "r c", "y")], {"x": 1, "c": 10, "r": 10, "y": 1})
    assert compile_problem(g2, inplace=True).profile([0, 1, 2]) == [10, 20, 20]
    # a Conv never writes in place; an input smaller than the output is not overwritten
    g3 = dag([("C", "Conv", "x", "c"), ("R", "Relu", "c", "r"), ("D", "Conv", "r", "y")],
             {"x": 1, "c": 10, "r": 12, "y": 1})
    assert compile_problem(g3, inplace=True).profile([0, 1, 2]) == [10, 22, 12]
    # graph inputs are the caller's: not overwritten even when counted
    g4 = dag([("R", "Relu", "x", "r"), ("D", "Conv", "r", "y")], {"x": 10, "r": 10, "y": 1})
    assert compile_problem(g4, inplace=True, count_io=True).profile([0, 1]) == [20, 11]


def test_inplace_order_matters():
    # c(10) is read by R (Relu, may overwrite it) and by D; R last saves 10 bytes
    g = dag([("C", "Conv", "x", "c"), ("R", "Relu", "c", "r"), ("D", "Conv", "c", "d"),
             ("J", "Concat", "r d", "y")], {"x": 1, "c": 10, "r": 10, "d": 2, "y": 1})
    pb = compile_problem(g, inplace=True)
    assert pb.profile([0, 1, 2, 3]) == [10, 20, 22, 12]  # R first: c still read by D
    assert pb.profile([0, 2, 1, 3]) == [10, 12, 12, 12]  # R last: r takes c's buffer
    assert order_graph(g, inplace=True).peak_bytes == 12


def test_unread_outputs_live_only_during_their_step_and_reads_count_once():
    # A writes t(3) and a mask m(50) nobody reads; B reads t twice
    g = dag([("A", "Dropout", "x", "t m"), ("B", "Add", "t t", "y")], {"x": 1, "t": 3, "m": 50, "y": 4})
    assert compile_problem(g).profile([0, 1]) == [53, 3]
    assert compile_problem(g, count_io=True).profile([0, 1]) == [54, 7]


def test_weights_are_apart_and_the_profile_matches_the_definition():
    g = dag(**BRANCHES)
    g.weight_bytes = 1000
    r = order_graph(g)
    assert r.weight_bytes == 1000 and r.peak_bytes == 10
    for seed in range(200):
        for inplace, io in ((False, False), (True, False), (False, True), (True, True)):
            pb = compile_problem(random_dag(1 + seed % 12, seed), inplace, io)
            order = random_order(pb, random.Random(seed))
            assert pb.peak(order) == pb.peak_by_definition(order)


# --- graph checks ---------------------------------------------------------------------------

def test_a_cycle_is_named():
    with pytest.raises(GraphError, match="cycle.*A -> B -> A|cycle.*B -> A -> B"):
        dag([("A", "Relu", "x b", "a"), ("B", "Relu", "a", "b"), ("C", "Relu", "b", "y")],
            {"x": 1, "a": 1, "b": 1, "y": 1})


def test_malformed_graphs_are_refused():
    with pytest.raises(GraphError, match="written by both"):
        dag([("A", "Relu", "x", "a"), ("B", "Relu", "x", "a")], {"x": 1, "a": 1}, outputs=())
    with pytest.raises(GraphError, match="reads 'q'"):
        dag([("A", "Relu", "q", "y")], {"q": 1, "y": 1})
    with pytest.raises(GraphError, match="no size"):
        dag([("A", "Relu", "x", "y")], {"x": 1})
    with pytest.raises(GraphError, match="two operators"):
        dag([("A", "Relu", "x", "a"), ("A", "Relu", "a", "y")], {"x": 1, "a": 1, "y": 1})


def test_an_unsorted_file_gets_the_nearest_topological_order():
    g = dag([("B", "Relu", "a", "y"), ("A", "Relu", "x", "a")], {"x": 1, "a": 1, "y": 1})
    assert g.file_order == [1, 0] and g.meta["file_order_topological"] is False
    assert order_graph(g).order == ["A", "B"]


def test_cap_below_any_order_names_the_operator():
    g = dag(**BRANCHES)
    assert order_graph(g, cap=10).peak_bytes == 10
    # A1 holds t and a1 in every order: 9 bytes (so do A2, B1 and B2: the first is named)
    with pytest.raises(PlanError, match="no order fits in 8 bytes: operator 'A1' needs 9"):
        order_graph(g, cap=8)
    # 9 bytes: every operator fits by its own bound, but no order does (the least peak is 10)
    with pytest.raises(PlanError, match="least peak of any order is 10"):
        order_graph(g, cap=9)


# --- BTSearch is exact ----------------------------------------------------------------------

def small_random_problems(count: int, max_orders: int = 3000):
    """`count` seeded random DAGs of 1-10 operators with at most `max_orders` topological
    orders (the brute force's reach), cycling through the four memory-model options."""
    seed = 0
    made = 0
    while made < count:
        seed += 1
        g = random_dag(1 + seed % 10, seed)
        pb = compile_problem(g, inplace=bool(seed & 1), count_io=bool(seed & 2))
        try:
            count_orders(pb, limit=10**6) <= max_orders or _raise()
        except TooLarge:
            continue
        made += 1
        yield seed, g, pb


def _raise():
    raise TooLarge("too many orders")


def test_btsearch_equals_brute_force_on_1000_random_dags():
    sizes = set()
    for seed, g, pb in small_random_problems(1000):
        best, _, _ = brute_force(pb)
        res = btsearch(pb)
        assert res.proven and res.peak == best, seed
        assert pb.peak_by_definition(res.order) == best, seed
        whole = order_graph(g, inplace=bool(seed & 1), count_io=bool(seed & 2), random_count=3,
                            seed=seed)
        assert whole.peak_bytes == best and whole.proven, seed
        assert whole.file_order_peak_bytes >= best and whole.random["best_bytes"] >= best
        sizes.add(pb.n)
    assert sizes == set(range(1, 11))


def test_every_pruning_alone_and_none_stays_exact():
    for seed, g, pb in small_random_problems(150, max_orders=600):
        best, _, n_orders = brute_force(pb)
        for bound, hashing, dominance in ((False, False, False), (True, False, False),
                                          (False, True, False), (False, False, True)):
            res = btsearch(pb, bound=bound, hashing=hashing, dominance=dominance)
            assert res.peak == best and pb.peak(res.order) == best, (seed, bound, hashing)
        # no pruning walks every order: its leaves are the orders
        plain = btsearch(pb, bound=False, hashing=False, dominance=False)
        assert plain.states >= n_orders


def test_the_downset_dp_equals_brute_force():
    for seed, g, pb in small_random_problems(300, max_orders=2000):
        best, _, _ = brute_force(pb)
        peak, order, _ = downset_dp(pb)
        assert peak == best and pb.peak_by_definition(order) == best, seed


def test_btsearch_equals_the_dp_on_larger_random_dags():
    checked = 0
    for seed in range(60):
        g = random_dag(14 + seed % 12, 5000 + seed, density=0.25 + 0.01 * (seed % 20))
        for inplace in (False, True):
            pb = compile_problem(g, inplace=inplace)
            try:
                dp, _, _ = downset_dp(pb, max_states=20_000)
            except TooLarge:
                continue
            r = order_graph(g, inplace=inplace, random_count=0)
            assert r.proven and r.peak_bytes == dp, seed
            checked += 1
    assert checked >= 60


def test_budget_exhausted_keeps_the_best_and_says_not_proven():
    # a wide random graph: 2 states are not enough to prove anything
    g = random_dag(24, 77, density=0.1)
    pb = compile_problem(g)
    res = btsearch(pb, max_states=2)
    assert res.stopped == "states"
    assert res.peak == pb.peak(res.order) <= res.start_peak
    assert res.proven == (res.peak <= res.lower_bound)
    r = order_graph(g, max_states=2, random_count=0)
    assert r.proven == (not r.unproven_blocks or r.peak_bytes <= r.lower_bound_bytes)


# --- heuristics, bounds, blocks -------------------------------------------------------------

def test_cheap_orders_are_topological_and_bounds_hold():
    for seed in range(100):
        pb = compile_problem(random_dag(1 + seed % 15, seed), inplace=bool(seed & 1))
        orders = [topological(pb), reverse_postorder(pb), greedy_least_peak(pb)]
        for order in orders:
            pb.check_order(order)
        lb = lower_bounds(pb)
        # every operator's bound holds at its step in any order
        for order in orders + [random_order(pb, random.Random(seed))]:
            steps = pb.profile(order)
            for k, o in enumerate(order):
                assert steps[k] >= lb[o], (seed, pb.names[o])


def test_blocks_cut_chains_and_keep_branches_together():
    g = dag(**BRANCHES)
    pb = compile_problem(g)
    assert [[pb.names[o] for o in b] for b in blocks(pb)] == [["P"], ["A1", "B1", "A2", "B2"], ["J"]]
    chain = dag([("A", "Conv", "x", "a"), ("B", "Conv", "a", "b"), ("C", "Conv", "b", "y")],
                {"x": 1, "a": 1, "b": 1, "y": 1})
    assert blocks(compile_problem(chain)) == [[0], [1], [2]]


def test_a_block_priced_alone_matches_the_whole_graph():
    # a residual t skips the middle block (read by J at the end): it is the block's offset
    g = dag([("P", "Conv", "x", "t"), ("A1", "Conv", "t", "a1"), ("B1", "Conv", "t", "b1"),
             ("A2", "Conv", "a1", "a2"), ("B2", "Conv", "b1", "b2"), ("M", "Concat", "a2 b2", "m"),
             ("J", "Add", "m t", "y")],
            {"x": 4, "t": 3, "a1": 8, "b1": 8, "a2": 1, "b2": 1, "m": 2, "y": 2})
    pb = compile_problem(g)
    parts = blocks(pb)
    assert [len(b) for b in parts] == [1, 4, 1, 1]
    sub = restrict(pb, parts[1], before=1 << parts[0][0])
    assert sub.offset == 0 and sub.held[sub.producer.index(-1)]  # t: read by J after
    whole_order = [0, 1, 3, 2, 4, 5, 6]
    steps = pb.profile(whole_order)
    assert sub.profile([0, 2, 1, 3]) == steps[1:5]


def test_from_encoder_unrolls_layers_into_a_chain():
    from hepti.families import preset_config
    from hepti.families import family_graph
    cfg = preset_config("tiny-odd")
    g = from_encoder(family_graph(cfg, 2, 16))
    assert len(g.ops) == 1 + 7 * cfg.num_hidden_layers
    assert g.batch == 2 and g.inputs == ("ids",)
    # a chain: one order. Its widest step is attention (x, kept for add+ln 1, q, kv, ctx: 5C)
    # or ffn down (x1, kept for add+ln 2, h, ffn_out: 2C + F), rows M = 2 x 16, float32
    C, F = cfg.hidden_size, cfg.intermediate_size
    r = order_graph(g)
    assert r.peak_bytes == r.file_order_peak_bytes == r.random["worst_bytes"]
    assert r.peak_bytes == 4 * 32 * max(5 * C, 2 * C + F)


class _StandInCNN:
    """hepti.graph.cnn.Graph's interface (ops with name, kind, input, output, residual; shapes
    per image NHWC; weight_bytes), for a stem and one residual block."""

    class Op:
        def __init__(self, name, kind, input, output, residual=None):
            self.name, self.kind, self.input, self.output = name, kind, input, output
            self.residual = residual

    config = type("Cfg", (), {"arch": "stand-in"})
    input, output = "pixels", "logits"
    ops = [Op("conv1", "conv", "pixels", "stem"), Op("a", "conv", "stem", "a"),
           Op("b", "conv", "a", "b"), Op("c", "conv", "b", "block", residual="stem"),
           Op("pool", "adaptive_avg", "block", "pooled"), Op("fc", "linear", "pooled", "logits")]

    def shapes(self, h, w):
        return {"pixels": (h, w, 3), "stem": (h // 2, w // 2, 8), "a": (h // 2, w // 2, 4),
                "b": (h // 2, w // 2, 4), "block": (h // 2, w // 2, 8), "pooled": (8,),
                "logits": (10,)}

    def weight_bytes(self):
        return 1234


def test_from_cnn_keeps_the_residual_live_across_the_block():
    g = from_cnn(_StandInCNN(), batch=2, height=8, width=8)
    assert g.ops[3].inputs == ("b", "stem") and g.tensors["stem"].bytes == 2 * 4 * 4 * 8 * 4
    pb = compile_problem(g)
    # conv1 stem; a: stem (kept for c) + a; b: stem + a + b; c: stem + b + block; pool: block +
    # pooled; fc: pooled (the logits are the caller's)
    assert pb.profile(list(range(6))) == [1024, 1536, 2048, 2560, 1088, 64]
    r = order_graph(g)
    assert (r.peak_bytes, r.weight_bytes, r.batch) == (2560, 1234, 2)


@pytest.mark.parametrize("arch", ["mobilenet_v2", "resnet50", "vgg16"])
def test_hepti_cnns_order_changes_nothing(arch):
    """Plain CNNs peak at one layer whose live set is the same in any order: BTSearch proves the
    file order's peak is the least (DP agrees)."""
    cnn = pytest.importorskip("hepti.graph.cnn")
    from hepti.config import CNNConfig
    g = from_cnn(cnn.build(CNNConfig(arch=arch)), 1, 224, 224)
    r = order_graph(g, random_count=20)
    dp, _, _ = downset_dp(compile_problem(g))
    assert r.proven and r.peak_bytes == r.file_order_peak_bytes == r.random["worst_bytes"] == dp
    if arch == "resnet50":  # layer1's conv3: identity [56, 56, 256] + b [56, 56, 64] + output
        assert r.peak_bytes == 4 * 56 * 56 * (256 + 64 + 256)


def test_btsearch_equals_the_dp_on_random_wiring():
    """Wide graphs without a cut (a synthetic RandWire stage: 33 operators), where the order
    changes the peak by a fifth or more."""
    from hepti.graph.opdag import random_wiring
    gains = []
    for seed in range(3):
        g = random_wiring(32, seed)
        dp, _, _ = downset_dp(compile_problem(g), max_states=50_000)
        r = order_graph(g, random_count=20)
        assert r.proven and r.peak_bytes == dp and len(r.blocks) == 1
        gains.append(1 - r.peak_bytes / r.file_order_peak_bytes)
    assert min(gains) > 0
