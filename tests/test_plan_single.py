"""A plan that gives all the work to rank 0 runs as `single` (issue 16)."""
from __future__ import annotations

from hepti.config import BertConfig
from hepti.plan.partition import make_plan
from hepti.plan.planfile import DIMS
from hepti.plan.profile import declared_profile

MINILM = BertConfig.from_dict(dict(model_type="bert", vocab_size=30522, hidden_size=384,
                                   num_hidden_layers=6, num_attention_heads=12,
                                   intermediate_size=1536, max_position_embeddings=512,
                                   type_vocab_size=2), name="minilm-shape")
FAST = dict(gemm_flops=9e10, memory_bytes=4e9, latency_s=1e-4, bandwidth_Bps=1.2e8)


def test_rank0_alone_runs_as_single():
    """MiniLM at 3 tokens: rank 1's share would only add communication; `auto`, `rows` and
    `tensor` all leave it out, and the plan says `single`, predicted as `single` is."""
    p = declared_profile([FAST, dict(FAST, gemm_flops=2e10)])
    single = make_plan(MINILM, p, 3, strategy="single")
    for strategy in ("auto", "rows", "tensor"):
        plan = make_plan(MINILM, p, 3, strategy=strategy)
        assert plan.strategy == "single", (strategy, plan.explanation)
        assert all(plan.counts[d][1] == 0 for d in DIMS)
        assert plan.predicted_latency_s == single.predicted_latency_s
        assert "runs as single" in plan.explanation


def test_work_on_both_ranks_stays_split():
    p = declared_profile([dict(FAST, bandwidth_Bps=1e9)] * 2)
    plan = make_plan(MINILM, p, 128, strategy="tensor")
    assert plan.strategy == "tensor" and plan.counts["heads"][1] > 0


def test_given_ratios_on_rank_0_alone_run_as_single():
    p = declared_profile([FAST, FAST])
    plan = make_plan(MINILM, p, 128, strategy="rows", ratios="1,0")
    assert plan.strategy == "single"
