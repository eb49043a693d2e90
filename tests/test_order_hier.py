"""The hierarchical order search (hepti.order.hierarchical) on NASNet-like cell graphs, and the
exported graphs of tests/fixtures/graphs (tests/fixtures/make_order_graphs.py)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from hepti.graph.opdag import OpDag, OpNode, TensorInfo
from hepti.order.btsearch import topological
from hepti.order.exact import downset_dp
from hepti.order.hierarchical import groups, hierarchical, post_dominators, sequences
from hepti.order.memory import compile_problem
from hepti.order.search import order_graph

GRAPHS = Path(__file__).parent / "fixtures" / "graphs"


def cells(n_cells: int, seed: int, blocks: int = 3) -> OpDag:
    """A NASNet-like graph: cell c reads the outputs of cells c-1 and c-2 (the stem's for the
    first), prepares each (one operator), then `blocks` blocks each add two branches (a chain
    of one or two operators on a prepared input or an earlier block), and concatenates the
    blocks (the cell's output, read by the next two cells). Sizes random, seeded; the file
    order runs each cell branch-wide (all first operators, then all second ones), which keeps
    the big intermediates live together."""
    rng = random.Random(seed)
    ops, sizes = [], {"x": 8}

    def op(name, kind, ins, size):
        ops.append(OpNode(name, kind, tuple(ins), (name,)))
        sizes[name] = size

    op("stem", "Conv", ["x"], 16)
    prev, prev2 = "stem", "stem"
    for c in range(n_cells):
        p0, p1 = f"c{c}.prep0", f"c{c}.prep1"
        op(p0, "Conv", [prev2], rng.randint(4, 12))
        op(p1, "Conv", [prev], rng.randint(4, 12))
        avail = [p0, p1]
        plan = []
        for b in range(blocks):
            branch = []
            for side in "lr":
                src = rng.choice(avail)
                depth = rng.choice((1, 2))
                branch.append((side, src, depth, [rng.randint(10, 40) for _ in range(depth)]))
            plan.append(branch)
            avail.append(f"c{c}.b{b}")
        for step in range(2):  # branch-wide: first operators of every branch, then second
            for b, branch in enumerate(plan):
                for side, src, depth, sz in branch:
                    if step < depth:
                        ins = [src] if step == 0 else [f"c{c}.b{b}{side}0"]
                        op(f"c{c}.b{b}{side}{step}", "Conv", ins, sz[step])
        for b, branch in enumerate(plan):
            ins = [f"c{c}.b{b}{side}{depth - 1}" for side, _, depth, _ in branch]
            op(f"c{c}.b{b}", "Add", ins, rng.randint(4, 12))
        op(f"c{c}.out", "Concat", [f"c{c}.b{b}" for b in range(blocks)], rng.randint(12, 30))
        prev2, prev = prev, f"c{c}.out"
    op("head", "Conv", [prev], 4)
    # an Add reads its block's branches, which an earlier block's Add may follow: re-sort
    dag = OpDag(f"cells-{n_cells}-{seed}", ops, {t: TensorInfo(b, (1,)) for t, b in sizes.items()},
                ("x",), ("head",))
    order = dag.file_order
    return OpDag(dag.name, [ops[i] for i in order], dag.tensors, ("x",), ("head",))


def test_post_dominators_and_cells():
    g = cells(3, 0)
    pb = compile_problem(g)
    ipdom = post_dominators(pb)
    idx = {n: i for i, n in enumerate(pb.names)}
    assert ipdom[idx["head"]] == -1
    for c in range(3):  # every path from inside cell c runs through its concatenation
        for n in pb.names:
            if n.startswith(f"c{c}.") and n != f"c{c}.out":
                o = idx[n]
                while o not in (-1, idx[f"c{c}.out"]):
                    o = ipdom[o]
                assert o == idx[f"c{c}.out"], n
    found = [{pb.names[o] for o in grp} for grp in groups(pb)]
    assert found == [{n for n in pb.names if n.startswith(f"c{c}.")} for c in range(3)]


def test_sequences_cover_every_operator_once_in_order():
    for seed in range(5):
        pb = compile_problem(cells(3, seed))
        seqs = sequences(pb)
        assert sorted(o for s in seqs for o in s) == list(range(pb.n))
        for s in seqs:
            for a, b in zip(s, s[1:]):  # a chain: b's only predecessor is a, a's only successor b
                assert pb.preds[b] == 1 << a and pb.succs[a] == [b]


@pytest.mark.parametrize("seed", range(6))
def test_hierarchical_is_valid_never_worse_and_finds_the_dp_optimum(seed):
    g = cells(2, seed)
    pb = compile_problem(g)
    file_order = topological(pb)
    h = hierarchical(pb, file_order, time_limit=20)
    pb.check_order(h.order)
    assert h.peak == pb.peak(h.order) <= pb.peak(file_order)
    dp, _, _ = downset_dp(pb, max_states=200_000)
    assert h.peak >= dp
    # on two small cells, dissolving the cells at the peak reaches the optimum
    assert h.peak == dp, (h.peak, dp, h.why)
    exact = h.complete and not h.groups_left and h.sequences == pb.n
    assert h.proven == (h.peak <= h.lower_bound or exact)
    if not h.proven:
        assert "HMCOS" in h.why and "lower bound" in h.why


def test_order_graph_says_which_method_and_why_unproven():
    g = cells(12, 3)
    r = order_graph(g, time_limit=0.2, max_states=2000, hier_time_limit=5, random_count=5)
    assert r.peak_bytes <= r.file_order_peak_bytes
    (big,) = [b for b in r.blocks if b.ops > 100]
    assert big.method in ("BTSearch", "hierarchical")
    if not big.proven:
        assert big.why and r.unproven_blocks
    # without the hierarchical search, the same budget finds no better order
    plain = order_graph(g, time_limit=0.2, max_states=2000, hier_time_limit=0, random_count=0)
    assert r.peak_bytes <= plain.peak_bytes
