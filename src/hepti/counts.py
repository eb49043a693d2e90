"""Ratio vectors -> integer counts: the one pure function the planner and the runtime share.

A ratio vector gives each rank's share of a split dimension (heads, FFN columns, token rows).
`counts(total, ratios)` turns it into whole units by the largest-remainder method: every rank
gets floor(total * share), and the units left over go to the largest fractional parts, ties to
the lower rank. It is deterministic, so every rank computes the same counts without talking.
"""
from __future__ import annotations

import math
from typing import Sequence


def validate_ratios(ratios: Sequence[float], what: str = "ratio vector") -> list[float]:
    """Check a ratio vector and return it normalised to sum 1.

    Raises ValueError naming the vector when an entry is negative, NaN/inf, or all are zero.
    Vectors need not sum to 1 ("3,1" means 0.75,0.25); they are normalised.
    """
    vals = [float(r) for r in ratios]
    if not vals:
        raise ValueError(f"{what} is empty; give one share per rank, e.g. 0.5,0.5")
    bad = [(i, r) for i, r in enumerate(vals) if not math.isfinite(r) or r < 0]
    if bad:
        i, r = bad[0]
        raise ValueError(f"{what} {vals}: entry {i} is {r}; shares must be finite and >= 0")
    s = sum(vals)
    if s <= 0:
        raise ValueError(f"{what} {vals} is all zeros; at least one rank needs a positive share")
    return [r / s for r in vals]


def counts(total: int, ratios: Sequence[float]) -> list[int]:
    """Split `total` units by `ratios` (largest remainder). One entry per rank, summing to total.

    >>> counts(12, [0.7, 0.2, 0.1])
    [9, 2, 1]
    >>> counts(5, [0.5, 0, 0.5])
    [3, 0, 2]
    """
    if int(total) != total or total < 0:
        raise ValueError(f"total {total} must be a whole number >= 0 (ratios {list(ratios)})")
    total = int(total)
    try:
        shares = validate_ratios(ratios)
    except ValueError as e:
        raise ValueError(f"cannot split total {total}: {e}") from None
    quotas = [total * s for s in shares]
    base = [int(math.floor(q)) for q in quotas]
    left = total - sum(base)
    # largest fractional part first; ties to the lower rank (stable sort). Fractions are rounded
    # so that float noise (12*0.7 = 8.4000000000000004) cannot break a tie differently on
    # different vectors that mean the same split.
    order = sorted(range(len(shares)), key=lambda i: -round(quotas[i] - base[i], 9))
    for i in order[:left]:
        base[i] += 1
    assert sum(base) == total and all(c >= 0 for c in base), (total, ratios, base)
    return base


def offsets(cnts: Sequence[int]) -> list[int]:
    """Start offset of each rank's part: offsets([3, 0, 2]) == [0, 3, 3]."""
    out, acc = [], 0
    for c in cnts:
        out.append(acc)
        acc += int(c)
    return out
