"""hepti.graph: layouts, sync points, and the cost program lowered from an assignment.

What the executors send is checked against the lowered program under MPI
(tests/mpi/test_equivalence.py); here the lowering itself, on the graph alone.
"""
from __future__ import annotations

import pytest

from hepti.config import RANDOM_PRESETS, BertConfig
from hepti.families import preset_config
from hepti.graph import ir, lower
from hepti.families import family, family_graph
from hepti.model.sizes import embedding_bytes, layer_slice_bytes

# the interpreter's presets: the encoders' (a CNN's: test_cnn.py; a decoder's programs:
# test_plan_decoder.py)
CONFIGS = [c for c in map(preset_config, RANDOM_PRESETS)
           if family(c).executor == "interpreter"] + [
    BertConfig.from_dict({"model_type": "bert", "vocab_size": 10, "hidden_size": 64,
                          "num_hidden_layers": L, "num_attention_heads": 4, "intermediate_size": 96})
    for L in (1, 2)]


def test_transitions_name_the_collective_and_refuse_what_none_does():
    assert ir.transition(ir.ROWS, ir.FULL) == "allgatherv"
    assert ir.transition(ir.PARTIAL, ir.ROWS) == "reduce_scatter"
    assert ir.transition(ir.PRIMARY, ir.FULL) == "bcast"
    assert ir.transition(ir.PRIMARY, ir.ROWS) == "scatterv"
    assert ir.transition(ir.ROWS, ir.PRIMARY) == "gatherv"
    assert ir.transition(ir.FULL, ir.ROWS) is None and ir.transition(ir.FULL, ir.PRIMARY) is None
    with pytest.raises(ValueError, match="no collective turns a partial tensor into a local"):
        ir.transition(ir.PARTIAL, ir.LOCAL)


def _syncs(phases):
    return [(p.collective.kind, p.collective.name) for p in phases if p.collective is not None]


def test_sync_points_follow_from_layouts():
    """The messages per layer a reader of the executors counts: `rows` one Allgatherv of K/V;
    `tensor` two Reduce_scatters and two Allgathervs of [M, C]; the last layer gathers its rows
    on rank 0."""
    cfg = preset_config("tiny-odd")  # 3 layers
    g = family_graph(cfg, 1, 16)
    start, layer, end, repeat = lower.compress(g, lower.assignment(g, "rows"))
    assert repeat == 2
    assert _syncs(start) == [("bcast", "shape"), ("bcast", "mask"), ("scatterv", "x"), ("allgatherv", "kv")]
    assert _syncs(layer) == [("allgatherv", "kv")]
    assert _syncs(end) == [("gatherv", "x")]
    start, layer, end, repeat = lower.compress(g, lower.assignment(g, "tensor"))
    assert _syncs(start) == [("bcast", "shape"), ("bcast", "mask"), ("bcast", "x")]
    assert _syncs(layer) == [("reduce_scatter", "attn_out"), ("allgatherv", "x1"),
                             ("reduce_scatter", "ffn_out"), ("allgatherv", "x")]
    assert _syncs(end) == [("reduce_scatter", "attn_out"), ("allgatherv", "x1"),
                           ("reduce_scatter", "ffn_out"), ("gatherv", "x")]
    assert [p.name for p in layer] == ["attention", "add+ln 1", "ffn", "add+ln 2"]
    assert [w.name for w in layer[0].works] == ["qkv", "attention", "o-proj"]


@pytest.mark.parametrize("strategy", ["rows", "tensor", "stream"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name or 'L'}{c.num_hidden_layers}")
def test_folded_program_unrolls_to_the_whole_inference(cfg, strategy):
    g = family_graph(cfg, 2, 8)
    assign = lower.assignment(g, strategy)
    start, layer, end, repeat = lower.compress(g, assign, stream=strategy == "stream")
    assert repeat == cfg.num_hidden_layers - 1 and layer  # the LP sees each layer phase once
    assert start + layer * repeat + end == lower.phases(g, assign, cfg.num_hidden_layers,
                                                        stream=strategy == "stream")


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name or 'L'}{c.num_hidden_layers}")
def test_weight_memory_matches_the_runtime_slice_sizes(cfg):
    """Per-unit weight bytes from the graph's weights, against hepti.model.sizes' formula (which
    the runtime budgets with) for a few shares."""
    g = family_graph(cfg, 1, 8)
    terms = lower.weight_memory(g, lower.assignment(g, "tensor"))
    per = {t.dim: t.per_unit for t in terms}
    for h, f in ((1, 1), (cfg.num_attention_heads, cfg.intermediate_size), (2, 37)):
        assert per["heads"] * h + per["ffn"] * f + per["active"] == layer_slice_bytes(cfg, h, f)
    assert per["root"] == embedding_bytes(cfg)
    whole = {t.dim: t.per_unit for t in lower.weight_memory(g, lower.assignment(g, "rows"))}
    assert whole["active"] == layer_slice_bytes(cfg, cfg.num_attention_heads, cfg.intermediate_size)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.name or 'L'}{c.num_hidden_layers}")
def test_an_int8_folders_weights_are_counted_at_their_stored_bytes(cfg):
    """With `int8_group` the programs count the layers' GeMM matrices as int8 plus a float32
    scale per group (hepti.model.sizes' int8 count, which the runtime budgets with), the
    embeddings float32; `stream` reads and packs those bytes too; compute is unchanged."""
    g = family_graph(cfg, 1, 8)
    assign = lower.assignment(g, "tensor")
    per = {t.dim: t.per_unit for t in lower.weight_memory(g, assign, int8_group=64)}
    for h, f in ((1, 1), (cfg.num_attention_heads, cfg.intermediate_size), (2, 37)):
        want = layer_slice_bytes(cfg, h, f, "int8")
        assert per["heads"] * h + per["ffn"] * f + per["active"] == pytest.approx(want)
        assert want < layer_slice_bytes(cfg, h, f) / 2  # about 1.06 bytes a weight, not 4
    assert per["root"] == embedding_bytes(cfg)
    reads = lower.stream_reads(g, lower.assignment(g, "stream"), 2, int8_group=64)
    assert reads.read_per_unit == {d: per[d] for d in reads.read_per_unit}

    def loads(int8_group):
        phases = lower.phases(g, lower.assignment(g, "stream"), 1, True, int8_group)
        return {w.dim: w.per_unit for ph in phases for w in ph.works if w.kind == "load"}

    assert loads(64) == {d: per[d] for d in loads(64)} and loads(64) != loads(None)
    flops = [w for ph in lower.phases(g, assign, 1) for w in ph.works]
    assert flops == [w for ph in lower.phases(g, assign, 1, int8_group=64) for w in ph.works]


def test_flops_of_a_split_add_up_to_the_whole():
    """Every split of a GeMM does the whole GeMM's FLOPs between the ranks: [M,k]x[k,n] = 2Mkn."""
    cfg = preset_config("bert-base")
    g = family_graph(cfg, 1, 128)
    M = g.units["rows"]
    for op in g.layer:
        if op.kind != "gemm":
            continue
        whole = 2.0 * M * op.k * op.n
        for split in op.splits:
            w = lower.work(g, op, split)
            assert w.per_unit * g.units[w.dim] == pytest.approx(whole), (op.name, split)


def test_stream_loads_each_slice_in_the_phase_that_uses_it():
    cfg = preset_config("tiny-odd")
    g = family_graph(cfg, 1, 16)
    _, layer, _, _ = lower.compress(g, lower.assignment(g, "stream"), stream=True)
    loads = {p.name: [(w.dim, w.per_unit) for w in p.works if w.kind == "load"] for p in layer}
    C, D = cfg.hidden_size, cfg.head_dim
    assert loads == {"attention": [("heads", 4 * (4 * D * C + 3 * D))], "add+ln 1": [],
                     "ffn": [("ffn", 4 * (2 * C + 1))], "add+ln 2": []}


def test_unknown_family_and_strategy_are_refused():
    cfg = preset_config("tiny-odd")
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'; hepti supports: bert, vit, cnn, llama"):
        family_graph(type("C", (), {"model_type": "gpt2"})(), 1, 8)
    with pytest.raises(ValueError, match="no assignment for strategy 'zigzag'"):
        lower.assignment(family_graph(cfg, 1, 8), "zigzag")


def test_schedule_runs_every_op_once_in_order_with_the_program_s_syncs():
    """The rank schedule the executors are to run and the cost program are one list: its ops
    in graph order, layer by layer, and its sync steps the program's collectives."""
    cfg = preset_config("tiny-odd")
    g = family_graph(cfg, 1, 16)
    for strategy in ("rows", "tensor"):
        assign = lower.assignment(g, strategy)
        steps = lower.schedule(g, assign, g.n_layers)
        ops = [(s.op.name, s.layer) for s in steps if s.kind == "op"]
        assert ops == [(op.name, None) for op in g.prologue] + [
            (op.name, i) for i in range(g.n_layers) for op in g.layer]
        syncs = [(s.kind, s.tensor) for s in steps if s.kind != "op"]
        program = [(p.collective.kind, p.collective.name)
                   for p in lower.phases(g, assign, g.n_layers) if p.collective is not None]
        assert [("bcast", "shape")] + syncs == program


def test_activation_memory_counts_the_tensors_live_at_each_step():
    """Worked by hand from the schedule: `tensor` in the MLP holds the FFN's input gathered
    whole (M x C), the down projection's partial sums (M x C) and its FFN columns' hidden
    state (M per column); `rows` at attention holds every row's K/V (M x 2C), the scores'
    [T, T] block, and its own rows' fused QKV output (3C), the layer's input (C, the residual)
    and the context (C). Both hold the mask (M floats), which every attention reads."""
    from hepti.plan.costmodel import steps_of
    cfg = preset_config("tiny-odd")
    B, T = 2, 8
    M, C = B * T, cfg.hidden_size
    g = family_graph(cfg, B, T)
    held = {name: [{t.dim: t.per_unit for t in ts}
                   for ts in steps_of(lower.program_activations(g, lower.assignment(g, name))).values()]
            for name in ("tensor", "rows")}
    assert {"active": 4.0 * (2 * M * C + M), "ffn": 4.0 * M} in held["tensor"]
    assert {"active": 4.0 * (2 * M * C + T * T + M), "rows": 4.0 * 5 * C} in held["rows"]
    # no step kept that another holds at least as much of in every dimension
    for steps in held.values():
        for a in steps:
            assert not any(b is not a and all(b.get(d, 0) >= v for d, v in a.items()) for b in steps)
