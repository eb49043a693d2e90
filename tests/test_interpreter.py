"""hepti.parallel.interpreter on one process: how it groups a schedule into runs (kernel calls,
fused MLPs, partial sums into the reduce_scatter's buffer, layer slices released), and a
pipeline stage's part of a schedule. What it computes is checked against transformers
(test_model.py: the single-device engine is the interpreter) and every strategy against that
(tests/mpi/test_equivalence.py)."""
from __future__ import annotations

from hepti.families import preset_config
from hepti.graph import lower
from hepti.families import family_graph
from hepti.parallel.comm import Comm
from hepti.parallel.interpreter import Interpreter
from hepti.graph.lower import stage_steps


class _Group:
    """Rank 0 of a group of two, as far as laying out the runs goes."""
    rank, solo = 0, False


def _runs(strategy: str, n_layers: int = 2, group=None):
    cfg = preset_config("tiny-odd")
    g = family_graph(cfg, 1, 8)
    steps = lower.schedule(g, lower.assignment(g, strategy), n_layers)
    units = {"heads": [cfg.num_attention_heads], "ffn": [cfg.intermediate_size]}
    return Interpreter(group or _Group(), g, steps, None, {}, [1.0], units)._plan


def _describe(plan):
    out = []
    for e in plan:
        if e[0] == "sync":
            out.append(e[1])
        else:
            ops = ["+".join(s.op.name for s in item[:2] if s is not None)
                   + ("->" + item[2] if item[2] else "") for item in e[1]]
            out.append((ops, e[2]))  # (items, the layer released after it)
    return out


def test_tensor_runs_fuse_the_mlp_and_write_partial_sums_into_the_reduce_scatter():
    d = _describe(_runs("tensor", 1))
    assert d == ["bcast", (["embed"], None), "bcast",
                 (["qkv", "attention", "o-proj->attn_out"], None), "reduce_scatter",
                 (["add+ln 1"], None), "allgatherv",
                 (["ffn up+ffn down->ffn_out"], None), "reduce_scatter",
                 (["add+ln 2"], 0), "gatherv"]


def test_each_tensor_is_dropped_after_its_last_reader():
    """As hepti.graph.lower.activation_memory counts them: the fused QKV output goes once
    attention has read it, the FFN's input once the MLP has, a layer's input once its residual
    add has, and the output stays."""
    drops = {"+".join(s.op.name for s in item[:2] if s is not None): set(item[3])
             for e in _runs("tensor", 1) if e[0] == "ops" for item in e[1]}
    assert drops == {"embed": {"ids"}, "qkv": set(), "attention": {"q", "kv"}, "o-proj": {"ctx"},
                     "add+ln 1": {"attn_out", "x"}, "ffn up+ffn down": {"h"},
                     "add+ln 2": {"ffn_out", "x1"}}


def test_a_group_of_one_skips_the_verbs():
    d = _describe(_runs("single", 1, Comm(None)))
    assert d == [(["embed"], None), (["qkv", "attention", "o-proj"], None), (["add+ln 1"], None),
                 (["ffn up+ffn down"], None), (["add+ln 2"], 0)]


def test_rows_runs_split_at_the_kv_allgather_and_release_each_layer_after_its_last_op():
    d = _describe(_runs("rows", 2))
    assert d[:4] == ["bcast", (["embed"], None), "scatterv", (["qkv"], None)]
    assert d[4] == "allgatherv"
    assert (["ffn up+ffn down"], None) in d  # the MLP fused on token rows too
    releases = [x[1] for x in d if isinstance(x, tuple) and x[1] is not None]
    assert releases == [0, 1]
    assert d[-1] == "gatherv"


def test_a_pipeline_stage_runs_its_layers_and_the_last_one_what_follows_them():
    cfg = preset_config("tiny-odd")
    g = family_graph(cfg, 1, 8)
    steps = lower.schedule(g, lower.assignment(g, "single"), 3)
    mid = stage_steps(steps, 1, 2, last=False)
    assert {s.layer for s in mid} == {1} and all(s.kind == "op" for s in mid)
    assert [s.op.name for s in mid] == [op.name for op in g.layer]
    assert len(stage_steps(steps, 2, 3, last=True)) == len(g.layer) + len(g.epilogue)
