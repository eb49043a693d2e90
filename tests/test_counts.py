"""Ratios -> counts, and the plan file's ratio parsing and validation."""
from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hepti.counts import counts, offsets
from hepti.errors import PlanError
from hepti.plan.planfile import Plan, parse_ratios


@settings(max_examples=300, deadline=None)
@given(total=st.integers(0, 5000),
       ratios=st.lists(st.floats(0, 10, allow_nan=False), min_size=1, max_size=12).filter(lambda r: sum(r) > 0))
def test_counts_properties(total, ratios):
    c = counts(total, ratios)
    assert len(c) == len(ratios) and sum(c) == total and min(c) >= 0
    s = sum(ratios)
    for ci, r in zip(c, ratios):
        assert abs(ci - total * r / s) < 1 + 1e-9  # largest remainder: within one unit of the quota
        if r == 0:
            assert ci == 0


def test_counts_examples():
    assert counts(12, [0.7, 0.2, 0.1]) == [9, 2, 1]
    assert counts(12, [0.5, 0, 0.5]) == [6, 0, 6]
    assert counts(5, [1, 1]) == [3, 2]  # ties go to the lower rank
    assert counts(0, [1, 2]) == [0, 0]
    assert offsets([3, 0, 2]) == [0, 3, 3]


@pytest.mark.parametrize("bad", [[-0.1, 1.1], [math.nan, 1], [0, 0], [], [math.inf, 1]])
def test_counts_rejects(bad):
    with pytest.raises(ValueError) as e:
        counts(10, bad)
    assert "10" in str(e.value)


def test_parse_ratios():
    r = parse_ratios("0.7,0.2,0.1", 3)
    assert r["heads"] == r["ffn"] == r["rows"]
    r = parse_ratios("heads=1,1;ffn=3,1", 2)
    assert r["ffn"] == [0.75, 0.25] and r["rows"] == [0.5, 0.5]
    for text, n, msg in [("0.5,0.5", 3, "3 ranks"), ("0.5,-1", 2, "finite and >= 0"),
                         ("0,0", 2, "all zeros"), ("a,b", 2, "numbers"), ("nan,1", 2, "finite"),
                         ("layers=1,1", 2, "unknown dimension")]:
        with pytest.raises(PlanError, match=msg):
            parse_ratios(text, n)


def test_plan_roundtrip_and_validation(tmp_path):
    p = Plan(strategy="tensor", world_size=2, ratios={d: [0.75, 0.25] for d in ("heads", "ffn", "rows")})
    f = tmp_path / "plan.json"
    f.write_text(p.to_json())
    q = Plan.load(f).validate(2)
    assert q.ratios == p.ratios
    with pytest.raises(PlanError, match="launch with"):
        q.validate(3)
    f.write_text('{"strategy": "tensor"}')
    with pytest.raises(PlanError, match="not a hepti plan"):
        Plan.load(f)
