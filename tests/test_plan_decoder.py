"""The decoder's cost programs and plans (issue 46): numbers by hand on a tiny config, the new
collective kinds, the GeMV field of a profile, the memory check with the KV cache, and `auto`
choosing `single` on slow links and `tensor` on fast ones."""
from __future__ import annotations

import math

import pytest

from hepti.errors import PlanError
from hepti.graph.decoder import (ATTENTION_CALLS, DECODE_CALLS, MLP_CALLS, decode_program,
                                 int8_bytes, prefill_program)
from hepti.model.llama import KVCache, LlamaConfig
from hepti.plan.costmodel import Collective, collective_times, evaluate, rank_bytes
from hepti.plan.decoder import (Request, evaluate_tensor, head_splits, pipeline_hops,
                                plan_decoder)
from hepti.plan.profile import GEMV_BYTES_PER_GEMM_FLOP, declared_profile, profile_from_dict

# C 8, 4 query heads over 2 KV heads (G 2), D 2, F 6, V 10, 2 layers
TINY = LlamaConfig(vocab_size=10, hidden_size=8, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, intermediate_size=6, head_dim=2)
SMOL = LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                   head_dim=64)
DEV = dict(gemm_flops=1e9, memory_bytes=4e9, latency_s=1e-3, bandwidth_Bps=1e6,
           elementwise_per_s=1e8, gemv_Bps=1e6)


def _collectives(p):
    return [(ph.collective.kind, ph.collective.unit_bytes, m) for ph, m, _ in p.phases()
            if ph.collective is not None]


def test_decode_program_by_hand():
    ctx = 5
    p = decode_program(TINY, ctx)
    # per KV head: q and o G*D*C each, k and v D*C each: (2*2 + 2) * 2 * 8 floats = 96 floats
    qkvo, cache = p.layer[0].works[:2]  # then calls of no arithmetic (test_calls_...)
    assert (qkvo.kind, qkvo.dim, qkvo.per_unit) == ("gemv", "heads", 96 * 4)
    assert (cache.kind, cache.per_unit) == ("gemv", 2 * ctx * 2 * 4)  # K and V of 5 tokens
    assert p.layer[1].works[0].per_unit == 3 * 8 * 4  # gate, up, down: C floats a column
    assert p.end[0].works[0].per_unit == 8 * 4  # the head: C floats a vocabulary row
    # 1 + 2L one-row allreduces of C floats, then greedy's pair
    assert _collectives(p) == [("allreduce", 32, 1), ("allreduce", 32, 2), ("allreduce", 32, 2),
                               ("allgather", 16, 1)]
    # one device: every byte at 1e6 B/s, no collective
    one = declared_profile([DEV])
    whole = {"heads": [2], "ffn": [6], "vocab": [10]}
    nbytes = 2 * (2 * 96 * 4 + 2 * 2 * ctx * 2 * 4 + 6 * 3 * 8 * 4) + 10 * 8 * 4
    assert evaluate(p, whole, one).latency_s == pytest.approx(nbytes / 1e6)
    # memory: weights (heads, columns, vocabulary, norms) and the cache, by hand
    mem = evaluate(p, whole, one).per_rank[0].mem
    weights = 2 * (2 * 96 * 4 + 6 * 3 * 8 * 4 + 2 * 8 * 4) + 10 * 8 * 4 + 8 * 4
    assert mem["weights"] == weights
    assert mem["kv_cache"] == KVCache.bytes_for(TINY, ctx, 2)


def test_calls_cost_the_profiles_call_overhead_each_on_a_rank_with_their_dimension():
    """A layer's calls (ATTENTION_CALLS with KV heads, MLP_CALLS with MLP columns) each cost
    `call_overhead_s`, whatever the rank's share; the head is one more."""
    for program in (decode_program(TINY, 5), prefill_program(TINY, 4)):
        assert [len(ph.works) for ph in program.layer if ph.works] == [ATTENTION_CALLS, MLP_CALLS]
    assert DECODE_CALLS == ATTENTION_CALLS + MLP_CALLS
    p = decode_program(TINY, 5)
    whole = {"heads": [2], "ffn": [6], "vocab": [10]}
    fast, slow = (declared_profile([dict(DEV, call_overhead_s=o)]) for o in (0.0, 1e-3))
    extra = evaluate(p, whole, slow).latency_s - evaluate(p, whole, fast).latency_s
    assert extra == pytest.approx((2 * DECODE_CALLS + 1) * 1e-3)
    # two ranks, rank 1 with MLP columns but no KV heads: its layers cost MLP_CALLS calls
    two = declared_profile([dict(DEV, call_overhead_s=1e-3)] * 2)
    split = {"heads": [2, 0], "ffn": [3, 3], "vocab": [5, 5]}
    r1 = evaluate(p, split, two).per_rank[1].compute_s
    r1_free = evaluate(p, split, declared_profile([DEV, DEV])).per_rank[1].compute_s
    assert r1 - r1_free == pytest.approx((2 * MLP_CALLS + 1) * 1e-3)


def test_a_tokens_work_outside_the_layers_costs_the_profiles_token_overhead_once_a_step():
    """The "token" Work at the head costs `token_overhead_s` once a step (no call overhead
    with it), on every rank with vocabulary rows, in prefill too."""
    whole = {"heads": [2], "ffn": [6], "vocab": [10]}
    for p in (decode_program(TINY, 5), prefill_program(TINY, 1)):
        free, tok = (declared_profile([dict(DEV, token_overhead_s=o)]) for o in (0.0, 2e-3))
        extra = evaluate(p, whole, tok).latency_s - evaluate(p, whole, free).latency_s
        assert extra == pytest.approx(2e-3)
    two = declared_profile([dict(DEV, token_overhead_s=2e-3)] * 2)
    split = {"heads": [1, 1], "ffn": [3, 3], "vocab": [5, 5]}
    got = evaluate(decode_program(TINY, 5), split, two)
    free = evaluate(decode_program(TINY, 5), split, declared_profile([DEV, DEV]))
    for a, b in zip(got.per_rank, free.per_rank):
        assert a.compute_s - b.compute_s == pytest.approx(2e-3)
    assert declared_profile([dict(DEV, token_overhead_s=2e-3)]).devices[0].to_json()[
        "token_overhead_s"] == 2e-3


def test_decode_split_by_hand():
    """Two ranks, 1 KV head and 3 columns and 5 vocabulary rows each: half the bytes each, and
    per allreduce (n-1) latency + S / bandwidth + the adds."""
    p = decode_program(TINY, 5)
    two = declared_profile([DEV, DEV])
    half = {"heads": [1, 1], "ffn": [3, 3], "vocab": [5, 5]}
    compute = evaluate(p, {"heads": [2], "ffn": [6], "vocab": [10]},
                       declared_profile([DEV])).latency_s / 2
    allreduce = 1e-3 + 32 / 1e6 + 32 / (4 * 1e8)
    allgather = 1e-3 + 16 / 1e6
    assert evaluate(p, half, two).latency_s == pytest.approx(compute + 5 * allreduce + allgather)


def test_prefill_program_by_hand():
    T = 4
    p = prefill_program(TINY, T)
    qkvo, att = p.layer[0].works[:2]
    assert (qkvo.kind, qkvo.per_unit, qkvo.size_fixed) == ("gemm", 2 * T * 96, T)  # 2 T flops a weight
    assert (att.kind, att.per_unit) == ("attention", 4 * 2 * T * T * 2)
    assert p.layer[2].works[0].per_unit == 2 * T * 8 * 3
    # each sum is a reduce-scatter over the rows, then an allgatherv of them
    assert [k for k, _, _ in _collectives(p)] == ["reduce_scatter", "allgatherv"] * 3 + ["allgather"]
    assert p.totals["rows"] == T
    assert _collectives(prefill_program(TINY, 1))[0][0] == "allreduce"  # a one-token prompt


def test_int8_weights_price_at_the_int8_rate():
    p = decode_program(TINY, 5, weight_bytes=int8_bytes(64))
    assert p.layer[1].works[0].kind == "gemv_int8"
    assert p.layer[0].works[1].kind == "gemv"  # the cache stays float32
    dev = declared_profile([dict(DEV, gemv_int8_Bps=3e5)]).devices[0]
    assert p.layer[1].works[0].speed(dev, 1) == 3e5


def test_allreduce_and_allgather_bytes():
    for kind in ("allreduce", "allgather"):
        c = Collective(kind, None, 100.0)
        assert rank_bytes(c, {}, [True, True, True]) == [(200.0, 200.0)] * 3
        assert rank_bytes(c, {}, [True, False]) == [(0.0, 0.0)] * 2
    prof = declared_profile([DEV, dict(DEV, latency_s=2e-3, bandwidth_Bps=5e5)])
    t = collective_times(Collective("allgather", None, 100.0), {}, [True, True], prof)
    assert t == pytest.approx([1e-3 + 100 / 1e6, 2e-3 + 100 / 5e5])


def test_profile_gemv_field_and_estimate():
    old = declared_profile([dict(DEV, gemv_Bps=None)])
    dev = old.devices[0]
    assert dev.gemv_bytes_per_s() == pytest.approx(1e9 * GEMV_BYTES_PER_GEMM_FLOP)
    notes = old.gemv_estimates()
    assert len(notes) == 1 and "rank 0" in notes[0] and "gemv_Bps" in notes[0]
    new = declared_profile([dict(DEV, gemv_int8_Bps=2e5)])
    assert new.gemv_estimates() == []
    d = new.to_dict()
    assert d["devices"][0]["gemv_Bps"] == 1e6 and d["devices"][0]["gemv_int8_Bps"] == 2e5
    assert profile_from_dict(d).devices[0].gemv_int8_Bps == 2e5
    with pytest.raises(PlanError, match="gemv_Bps"):
        declared_profile([dict(DEV, gemv_Bps=-1)])


def _pair(latency_s, bandwidth_Bps, **kw):
    dev = dict(gemm_flops=1e11, memory_bytes=4e9, latency_s=latency_s,
               bandwidth_Bps=bandwidth_Bps, gemv_Bps=1.5e10, **kw)
    return declared_profile([dev, dev])


def test_auto_picks_single_on_slow_links_and_tensor_on_fast():
    req = Request(prompt=20, max_tokens=64)
    slow = plan_decoder(SMOL, _pair(2e-3, 1.2e7), req)
    assert slow.chosen.strategy == "single"
    fast = plan_decoder(SMOL, _pair(1e-5, 1e9), req)
    assert fast.chosen.strategy == "tensor"
    for plan in (slow, fast):
        text = plan.format()
        for what in ("single on rank 0", "tensor", "pipeline", "tok/s"):
            assert what in text
        assert text.splitlines()[-1].startswith(f"-> {plan.chosen.strategy}")
        assert {c.strategy for c in plan.candidates} == {"single", "tensor", "pipeline"}
        assert [c for c in plan.candidates if c.strategy == "pipeline"][0].runnable
    # on fast links tensor's predicted decode beats either device alone
    single = min(c.decode_s for c in fast.candidates if c.strategy == "single")
    assert fast.chosen.decode_s < single


def test_tensor_leaves_out_a_device_whose_link_costs_more_than_it_computes():
    """Three equal devices, the third behind a slow link: tensor's search keeps rank 0 and the
    fast one and gives the third no share (it then leaves the group and its link with it),
    and that is predicted faster than the three together."""
    fast = dict(DEV, gemv_Bps=1e10, gemm_flops=1e11, latency_s=1e-5, bandwidth_Bps=1e9)
    slow = dict(fast, latency_s=5e-3, bandwidth_Bps=1e6)
    profile = declared_profile([fast, fast, slow])
    plan = plan_decoder(SMOL, profile, Request(prompt=20, max_tokens=64), strategy="tensor")
    assert plan.chosen.ratios["ffn"][2] == 0 and plan.chosen.ratios["heads"][2] == 0
    assert min(plan.chosen.ratios["ffn"][:2]) > 0
    all3 = evaluate_tensor(SMOL, profile, Request(prompt=20, max_tokens=64),
                           {d: [1 / 3] * 3 for d in ("heads", "ffn", "rows")})
    assert plan.chosen.decode_s < all3.decode_s


def test_pipeline_hops_and_when_auto_chooses_it():
    """The hops hepti.parallel.decoder_pipeline makes (tests/mpi/test_decoder_agreement.py
    holds the executor to them), and `auto` choosing pipeline where it is priced best: slow
    links (a token crosses each link once, where tensor syncs 61 times) and devices that
    cannot hold the model alone."""
    C = SMOL.hidden_size
    assert pipeline_hops([20, 10], 7, C) == [(0, 1, 7 * C * 4), (1, 0, C * 4)]
    assert pipeline_hops([0, 30], 1, C) == [(0, 1, C * 4), (1, 0, C * 4)]
    assert pipeline_hops([10, 0, 20], 3, C) == [(0, 2, 3 * C * 4), (2, 0, C * 4)]
    assert pipeline_hops([30, 0], 5, C) == []  # rank 0 holds every layer: nothing moves
    plan = plan_decoder(SMOL, _pair(2e-3, 1.2e7), Request(20, 64), mem_budget=4e8)
    pipe = [c for c in plan.candidates if c.strategy == "pipeline"][0]
    assert plan.chosen is pipe and pipe.layers == [15, 15], plan.format()
    assert [c for c in plan.candidates if c.strategy == "single"][0].short is not None
    # rank 0 holds the embedding, which is the head: more bytes than rank 1 for as many layers
    assert pipe.mem[0] > pipe.mem[1] and plan.to_dict()["layers"] == [15, 15]


def test_the_kv_cache_counts_and_a_plan_that_does_not_fit_says_where():
    prof = _pair(1e-5, 1e9)
    short, long = (evaluate_tensor(SMOL, prof, Request(20, n), {d: [0.5, 0.5] for d in
                                                                 ("heads", "ffn", "rows")})
                   for n in (64, 4000))
    # rank 0 holds 2 of 3 KV heads: 2 * 30 layers * 2 heads * 64 * 4 bytes more a token
    assert short.mem[0] - long.mem[0] == pytest.approx(-(4000 - 64) * 2 * 30 * 2 * 64 * 4)
    tight = declared_profile([dict(gemm_flops=1e11, memory_bytes=3.5e8, latency_s=1e-5,
                                   bandwidth_Bps=1e9, gemv_Bps=1e10)] * 2)
    with pytest.raises(PlanError, match=r"rank 0 short by [0-9.]+ MiB") as e:
        plan_decoder(SMOL, tight, Request(20, 64), strategy="single")
    assert "--max-tokens" in str(e.value)
    # tensor fits where single does not: its halves, with the load's overhead, under 350 MB
    assert plan_decoder(SMOL, tight, Request(20, 64)).chosen.strategy == "tensor"
    assert math.isfinite(short.tokens_per_s)


def test_head_splits_are_every_split_of_the_whole_heads():
    assert head_splits(3, [0.5, 0.5]) == [[0, 1], [1 / 3, 2 / 3], [2 / 3, 1 / 3], [1, 0]]
    assert len(head_splits(8, [0.25] * 4)) == 1  # 165 splits: too many, the shares' own only
    # the plan's tensor holds whole heads that sum to the model's
    plan = plan_decoder(SMOL, _pair(1e-5, 1e9), Request(20, 64))
    heads = [round(h * 3) for h in plan.chosen.ratios["heads"]]
    assert sum(heads) == 3 and plan.chosen.ratios["heads"] == [h / 3 for h in heads]


def test_weight_bytes_of_an_int8_folder_counts_each_matrix_as_stored():
    """A value's bytes, averaged over the folder's matrices by size: int8 with its group's
    scale share, a matrix kept float32 (`--keep-float32`) at 4; vectors (norms) not counted."""
    from hepti.plan.decoder import weight_bytes_of
    t = {"a": {"shape": [100, 64], "dtype": "int8", "group": 64},
         "b": {"shape": [100, 64], "dtype": "int8", "group": 32},
         "c": {"shape": [50, 64], "dtype": "float32"},
         "ln": {"shape": [64], "dtype": "float32"}}
    want = (6400 * (1 + 4 / 64) + 6400 * (1 + 4 / 32) + 3200 * 4) / 16000
    assert weight_bytes_of({"dtype": "int8", "tensors": t}) == pytest.approx(want)
    assert weight_bytes_of({"dtype": "float32", "tensors": t}) == 4.0


def test_tensor_prices_its_decode_syncs_as_the_profile_measured_a_group_of_its_size():
    """A profile's `decode_syncs` (hepti.parallel.profile_links measures them per group of n
    ranks): `tensor`'s decode step on n ranks pays S(n) at each of its 2L + 2 syncs and J(n) of
    its phases' compute, in place of the cost model's collectives; a group of one (every share
    on rank 0), prefill and `single` are as before; a profile without them says so."""
    from dataclasses import replace

    from hepti.plan.decoder import (SYNCS_KEY, _programs, decode_syncs, evaluate_single,
                                    sync_figures, tensor_counts)
    req = Request(prompt=20, max_tokens=8)
    base = _pair(1e-5, 1e9)
    figs = {"jitter": [0.0, 0.25], "seconds": [0.0, 1e-3]}
    syn = replace(base, extra={**base.extra, SYNCS_KEY: figs})
    assert sync_figures(base) is None and sync_figures(syn) == figs
    assert decode_syncs(SMOL) == 62
    half = {"heads": [2 / 3, 1 / 3], "ffn": [0.5, 0.5], "rows": [0.5, 0.5]}
    a, b = (evaluate_tensor(SMOL, p, req, half) for p in (base, syn))
    _, dec = _programs(SMOL, req, 4.0)
    cnt = tensor_counts(SMOL, half, req.prompt)
    pred = evaluate(dec, {k: cnt[k] for k in dec.totals}, base)
    compute = sum(ph["times"] * ph["compute_s"] for ph in pred.phases)
    comm = sum(ph["times"] * ph["comm_s"] for ph in pred.phases)
    assert compute > 0 and comm > 0
    assert b.decode_s == pytest.approx(a.decode_s - comm + 62 * 1e-3 + 0.25 * compute)
    assert b.prefill_s == a.prefill_s
    alone = {"heads": [1.0, 0.0], "ffn": [1.0, 0.0], "rows": [1.0, 0.0]}
    assert (evaluate_tensor(SMOL, syn, req, alone).decode_s
            == evaluate_tensor(SMOL, base, req, alone).decode_s)
    assert evaluate_single(SMOL, syn, req, 0).decode_s == evaluate_single(SMOL, base, req, 0).decode_s
    assert any("spread" in n for n in plan_decoder(SMOL, base, req).notes)
    assert not any("spread" in n for n in plan_decoder(SMOL, syn, req).notes)
    for bad in ([0.1], {"jitter": [0.1]}, {"jitter": [-1.0], "seconds": [0.0]},
                {"jitter": [0.0, 0.1], "seconds": [0.0]}, {"jitter": [True], "seconds": [0.0]}):
        assert sync_figures(replace(base, extra={SYNCS_KEY: bad})) is None
