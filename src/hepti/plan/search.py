"""Which ranks take part, and their counts: the partitioner's search around the LP.

For a fixed set of participants the best counts are an LP (hepti.plan.lp). The set itself is
searched. With up to EXACT_MAX_OPTIONAL optional ranks (5 devices) every set containing rank 0
is a candidate: a cheap lower bound of each (`set_bounds`: compute perfectly balanced, each
collective at its own best blocks) orders them, and LPs are solved until the next bound exceeds
the best latency found, so the result is the optimum of the cost model (up to whole-head
rounding, below) and adding a device can never make it slower (the old set is still a
candidate). With more devices, an approximate model (every phase perfectly balanced by speed,
collectives at even blocks) orders the ranks by backward elimination; the sets of that nested
sequence are solved from the approximate model's favourite on, then by lower bound until the
bound passes the best latency found: the best set of the sequence, usually after one to four
sets. The best set need not be in the sequence: on 48 random 6-8 device profiles (rows and
tensor, half with size-dependent speeds) it was 44 times, and the worst miss was 5% (the walk
along the sequence this replaced did no better on any of them).

Each set is solved on a profile of its own ranks (`solve_set`), so a set of 4 costs the same
in a cluster of 32 as alone; the bounds and the elimination share one table of every
collective's terms at every participant count.

Whole heads: the LP is solved with continuous heads, then heads are assigned by the greedy
min-max rule (give the next head to the rank that would finish its attention soonest), which is
optimal for the attention phase given each rank's bound ceil(LP heads); if that breaks a memory
cap the LP is solved again with those heads fixed, and as a last resort as a MILP.
Speeds that depend on the slice size (profile tables) make the cost nonlinear. Every candidate
set is therefore solved at its own counts: the LP starts from speeds at the best counts found so
far (an even split over the set for the first), and is solved again with the speeds at the
counts it chose until they agree (up to LP_ITERATIONS LPs, usually two); the set is judged by
the exact cost model at its best counts after `polish`.
Solving the sets at one even split over all ranks and re-solving only the winner judged thin
slices at thick-slice speeds, and on the Hepti paper's offload pair with the secondary at a
quarter CPU chose no offload where the model's own optimum is 10-14%.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from hepti.counts import counts as split_counts
from hepti.plan import lp
from hepti.plan.costmodel import (ACTIVE, ROOT, Collective, Prediction, Program, RankPrediction, branch_terms,
                                  envelope, evaluate, layer_slice_bytes, link_terms)
from hepti.plan.profile import Profile

EXACT_MAX_OPTIONAL = 4  # up to 5 devices: every set of participants is a candidate ...
EXACT_MAX_SETS = 16  # ... solved in order of its lower bound, until the bound passes the best
LP_ITERATIONS = 3  # LPs per set at most, each with the speeds at the previous one's counts
HOPELESS = 0.04  # a set whose first LP is this much slower than the best set so far is not
#                  solved again nor polished: on 768 random plans of 3-32 devices, iterating such
#                  a set never won (at 1% some plans lost up to 1.2%; at 3-6% none did)


@dataclass
class Candidate:
    """One strategy's best (or evaluated) assignment and its prediction."""

    strategy: str
    counts: dict[str, list[float]]
    prediction: Prediction | None = None
    program: Program | None = None
    latency_s: float = math.inf
    layers: list[list[int]] | None = None
    mem_budget: int | None = None
    extra: dict = field(default_factory=dict)


def fits_memory(pred: Prediction, caps: list[float]) -> list[int]:
    """Ranks whose predicted memory exceeds their cap."""
    return [r.rank for r in pred.per_rank if r.active and r.mem_bytes > caps[r.rank] * (1 + 1e-9)]


def min_footprint(program: Program, rank: int) -> float:
    """Memory a rank needs to take part with one unit of its cheapest dimension."""
    held = program.n_layers if program.stream is None else program.stream.window
    fixed, per_dim = 0.0, {d: 0.0 for d in program.totals}
    for t in envelope(program.memory):
        k = held if t.per_layer else 1
        if t.dim == ACTIVE:
            fixed += t.per_unit * k
        elif t.dim == ROOT:
            fixed += t.per_unit if rank == 0 else 0.0
        else:
            per_dim[t.dim] += t.per_unit * k
    return fixed + min(per_dim.values(), default=0.0)


def rounding_margin(program: Program) -> float:
    """Memory of one unit of every continuous dimension: rounding adds at most that."""
    held = program.n_layers if program.stream is None else program.stream.window
    return sum(t.per_unit * (held if t.per_layer else 1) for t in envelope(program.memory)
               if t.dim in program.totals and t.dim not in program.integer_dims)


def round_counts(program: Program, raw: dict[str, list[float]]) -> dict[str, list[float]]:
    """Integer counts: integer dimensions as solved, the others by the largest remainder."""
    out = {}
    for d, total in program.totals.items():
        if d in program.integer_dims:
            out[d] = [float(round(v)) for v in raw[d]]
        else:
            out[d] = [float(c) for c in split_counts(total, [max(v, 0.0) for v in raw[d]])]
    return out


def stream_budget(program: Program, cnt: dict[str, list[float]]) -> float:
    """The smallest --mem-budget that gives every active rank its planned window of layers."""
    N = len(next(iter(cnt.values())))
    active = [i == 0 or any(cnt[d][i] > 0 for d in program.totals) for i in range(N)]
    per = [layer_slice_bytes(program, cnt, i) for i in range(N) if active[i]]
    return float(math.ceil(program.stream.window * max(per)))


def _evaluate(program: Program, cnt, profile) -> Prediction:
    if program.stream is not None:
        program.stream.budget = stream_budget(program, cnt)
    return evaluate(program, cnt, profile)


def _greedy_heads(program: Program, profile: Profile, dim: str, raw: list[float], ref) -> list[float]:
    """Whole units of `dim` by the min-max rule, each rank at most ceil(its LP share)."""
    total = program.totals[dim]
    N = profile.world_size
    cost = [0.0] * N  # seconds per unit on each rank, summed over the works of this dimension
    for phase, mult, _ in program.phases():
        for w in phase.works:
            if w.dim == dim:
                for i in range(N):
                    r = ref[dim][i] or total / N
                    cost[i] += mult * w.per_unit / w.speed(profile.devices[i], r)
    bound = [math.ceil(v - 1e-6) if v > 1e-6 else 0 for v in raw]
    h = [0] * N
    for _ in range(int(total)):
        best = min((i for i in range(N) if h[i] < bound[i]), key=lambda i: (cost[i] * (h[i] + 1), i))
        h[best] += 1
    return [float(v) for v in h]


def set_reference(program: Program, active: list[bool]) -> dict[str, list[float]]:
    """Counts of an even split over the ranks of `active` (rank 0 always among them): where
    a set's speeds are first read."""
    members = [i == 0 or a for i, a in enumerate(active)]
    n = sum(members)
    return {d: [t / n if m else 0.0 for m in members] for d, t in program.totals.items()}


def speeds_agree(program: Program, profile: Profile, ref, cnt) -> bool:
    """Whether every rank with work runs each of its Works at the same speed at `cnt` as at
    `ref`: then an LP solved with speeds at `ref` was exact for `cnt`. The LP reads a rank with
    no reference count at an even split over the participants (hepti.plan.lp)."""
    N = profile.world_size
    devs = profile.devices
    n = sum(1 for i in range(N) if i == 0 or any(cnt[d][i] > 0 for d in program.totals))
    seen = set()
    for phase, _, _ in program.phases():
        for w in phase.works:
            if w.dim == ROOT or w.kind in ("elementwise", "transfer") or w in seen:
                continue
            seen.add(w)
            for i in range(N):
                c = cnt[w.dim][i]
                if c > 0:
                    r = ref[w.dim][i] or program.totals[w.dim] / n
                    a, b = w.speed(devs[i], r), w.speed(devs[i], c)
                    if abs(a - b) > 1e-9 * max(a, b):
                        return False
    return True


def _solve_once(program: Program, profile: Profile, caps: list[float], ref, active: list[bool],
                time_limit: float) -> Candidate | None:
    """One LP with speeds at `ref` (whole-head repair, exact evaluation at the rounded counts)."""
    lp_caps = [c - rounding_margin(program) for c in caps]
    sol = lp.solve(program, profile, lp_caps, ref, active, time_limit, relax=True)
    if sol is None:
        return None
    raw = sol["counts"]
    if program.integer_dims:
        for d in program.integer_dims:
            raw[d] = _greedy_heads(program, profile, d, raw[d], ref)
        cnt = round_counts(program, raw)
        pred = _evaluate(program, cnt, profile)
        if fits_memory(pred, caps):
            fixed = {d: raw[d] for d in program.integer_dims}
            sol = lp.solve(program, profile, lp_caps, ref, active, time_limit, relax=True, fixed=fixed)
            if sol is None:
                sol = lp.solve(program, profile, lp_caps, ref, active, time_limit)
                if sol is None:
                    return None
            raw = sol["counts"]
    cnt = round_counts(program, raw)
    pred = _evaluate(program, cnt, profile)
    # The LP sees a GeMM's time as linear in its rows, but 65 rows cost what 72 do: two equal
    # ranks were planned 65 + 63 rows, both 6% slower than at 64 + 64. Whole blocks, if better.
    snapped = snap_to_blocks(program, cnt)
    if snapped != cnt:
        other = _evaluate(program, snapped, profile)
        if other.latency_s < pred.latency_s and not fits_memory(other, caps):
            cnt, pred = snapped, other
    c = Candidate(program.name, cnt, pred, program, pred.latency_s,
                  extra={"lp_objective_s": sol["objective_s"]})
    if program.stream is not None:
        c.mem_budget = int(program.stream.budget)
    return c


def solve_set(program: Program, profile: Profile, caps: list[float], active: list[bool],
              time_limit: float = 5.0, ref=None, best_s: float = math.inf) -> Candidate | None:
    """The best counts when exactly `active` take part (rank 0 always does), judged by the
    exact cost model; None if they cannot fit the memory caps.

    The LP takes each rank's speeds at reference counts (first an even split over the set, or
    `ref`). Where a speed depends on the slice size, the LP is solved again with the speeds at
    the counts it chose, until they agree (or after LP_ITERATIONS LPs); the set is worth the
    best of those evaluated at their own counts, polished unit by unit. A set whose LP comes out
    more than HOPELESS slower than `best_s` (the best set found so far) keeps its first LP as it
    is: iterating and polishing gain a few percent, not that much. Reading the speeds at an
    even split over all ranks instead made a thin slice look as fast as a thick one: on the
    offload pair at a quarter CPU it judged a 14% share slower than none at all. The work is
    done on a profile of the set's ranks alone (rank 0 first), so that it costs the same
    whether the cluster has 4 devices or 32."""
    N = profile.world_size
    idx = [i for i in range(N) if i == 0 or active[i]]
    sub = Profile(devices=[profile.devices[i] for i in idx], network=profile.network)
    sub_caps = [caps[i] for i in idx]
    members = [True] * len(idx)
    ref = (set_reference(program, members) if ref is None
           else {d: [ref[d][i] for i in idx] for d in program.totals})
    best = None
    for _ in range(LP_ITERATIONS):
        c = _solve_once(program, sub, sub_caps, ref, members, time_limit)
        if c is None:
            break
        if best is None or c.latency_s < best.latency_s:
            best = c
        if speeds_agree(program, sub, ref, c.counts) or c.latency_s > best_s * (1 + HOPELESS):
            break
        ref = c.counts
    if best is None:
        return None
    if best.latency_s > best_s * (1 + HOPELESS):
        return _expand(best, idx, N)
    return _expand(polish(program, sub, sub_caps, best), idx, N)


def _expand(cand: Candidate, idx: list[int], N: int) -> Candidate:
    """A candidate solved on the ranks `idx` alone, as a candidate of all N ranks (the others
    inactive, with nothing: exactly what evaluating it on all ranks gives)."""
    def spread(vec):
        out = [0.0] * N
        for v, i in zip(vec, idx):
            out[i] = v
        return out

    cnt = {d: spread(v) for d, v in cand.counts.items()}
    pred = cand.prediction
    per_rank = [RankPrediction(i, False) for i in range(N)]
    for r, i in zip(pred.per_rank, idx):
        r.rank = i
        per_rank[i] = r
    full = Prediction(pred.latency_s, per_rank, pred.phases, {d: spread(v) for d, v in pred.counts.items()})
    return Candidate(cand.strategy, cnt, full, cand.program, cand.latency_s, cand.layers,
                     cand.mem_budget, cand.extra)


# --- the approximate model that orders ranks for large clusters ----------------------------

def _phase_groups(program: Program) -> tuple[list[tuple[tuple, float]], dict[Collective, float]]:
    """The program's distinct compute (phases with the same works) with their summed
    multiplicities, and each distinct collective's multiplicity."""
    works: dict[tuple, float] = {}
    colls: dict[Collective, float] = {}
    for phase, mult, _ in program.phases():
        works[phase.works] = works.get(phase.works, 0.0) + mult
        if phase.collective is not None:
            colls[phase.collective] = colls.get(phase.collective, 0.0) + mult
    return list(works.items()), colls


def _elimination_sequence(program: Program, profile: Profile, eligible: list[bool], table=None
                          ) -> tuple[list[list[bool]], list[float]]:
    """Nested sets from all eligible ranks down to rank 0 alone, each step dropping the rank
    whose removal the approximate model likes best; and the approximate latency of each set.

    The approximate model: each phase perfectly balanced by the ranks' speeds at full size
    (time = multiplicity / sum of rates), each collective at even blocks. `table`: the
    collectives' `_branch_table` at every participant count, if already made."""
    N = profile.world_size
    devs = profile.devices
    full = {d: float(t) for d, t in program.totals.items()}
    rates, weights = [], []  # per distinct phase: each rank's rate (1/s for the whole phase)
    groups, colls = _phase_groups(program)
    for works, mult in groups:
        t = np.array([sum(w.seconds(devs[i], full[w.dim]) for w in works if w.dim != ROOT)
                      for i in range(N)])
        if t.max() > 0:
            rates.append(1.0 / np.maximum(t, 1e-30))
            weights.append(float(mult))
    rates_a = np.array(rates).reshape(len(rates), N)
    w_a = np.array(weights)[:, None]
    cmult = np.array(list(colls.values()))[:, None]
    if colls and N > 1:
        S, A, G = table if table is not None else _branch_table(program, profile, list(colls),
                                                                  list(range(2, N + 1)))
        ns = np.arange(N + 1)
        with np.errstate(divide="ignore", invalid="ignore"):  # n = 0, 1: never used
            even = S[:, None] / np.maximum(ns, 1)[None, :]  # [C, N+1] bytes per rank
            link_at = (A + G * even[:, :, None, None]).max(axis=2)  # [C, N+1, N]

    def links(n: int) -> np.ndarray:  # [collectives, N]: each rank's time with n taking part
        return link_at[:, n]

    def approx(members: np.ndarray, n: int) -> float:
        comp = float(np.sum(w_a[:, 0] / rates_a[:, members].sum(axis=1))) if len(weights) else 0.0
        comm = float(np.sum(cmult[:, 0] * links(n)[:, members].max(axis=1))) if n > 1 and colls else 0.0
        return comp + comm

    cur = np.array([bool(x) or i == 0 for i, x in enumerate(eligible)])
    seq, values = [cur.tolist()], [approx(np.flatnonzero(cur), int(cur.sum()))]
    while cur.sum() > 1:
        members = np.flatnonzero(cur)
        n = len(members)
        cand = members[members != 0]  # rank 0 always stays
        # compute without each candidate: every phase's total rate minus its rate
        denom = rates_a[:, members].sum(axis=1, keepdims=True) - rates_a[:, cand]  # [P, k]
        comp = (w_a / np.maximum(denom, 1e-30)).sum(axis=0) if len(weights) else np.zeros(len(cand))
        comm = np.zeros(len(cand))
        if n - 1 > 1 and colls:
            lm = links(n - 1)[:, members]  # [C, n]
            order = np.argsort(lm, axis=1)
            top1 = lm[np.arange(len(colls)), order[:, -1]]
            top2 = lm[np.arange(len(colls)), order[:, -2]]
            pos = {r: k for k, r in enumerate(members)}
            idx = np.array([pos[r] for r in cand])
            excl = np.where(order[:, -1][:, None] == idx[None, :], top2[:, None], top1[:, None])
            comm = (cmult * excl).sum(axis=0)
        total = comp + comm
        k = int(np.argmin(total))
        cur[cand[k]] = False
        seq.append(cur.tolist())
        values.append(float(total[k]))
    return seq, values


def optimise(program: Program, profile: Profile, caps: list[float], time_limit: float = 5.0,
             cutoff: float = math.inf, memo: dict | None = None) -> Candidate | None:
    """The best participants and counts for `program` under the caps, or None if nothing fits
    (or, given a `cutoff` latency, if no set's lower bound is below it: it cannot win).

    `memo`: a dict shared by calls on the same devices (speeds, links; disk speeds do not
    matter) keeps the candidate sets and their bounds (`stream` at windows 2 and 1 share them
    when the same ranks are eligible), and the collectives' cost tables (`_branch_table`),
    which programs with the same collectives (`tensor`, `stream`) share."""
    N = profile.world_size
    eligible = [min_footprint(program, i) <= caps[i] for i in range(N)]
    if not eligible[0]:
        return None
    tried: dict[tuple, Candidate | None] = {}

    def attempt(active: list[bool], best_s: float) -> Candidate | None:
        key = tuple(active)
        if key not in tried:
            # speeds first read at the best counts so far (the sets share most ranks): fewer LPs
            found = [c for c in tried.values() if c is not None]
            warm = min(found, key=lambda c: c.latency_s).counts if found else None
            tried[key] = solve_set(program, profile, caps, active, time_limit, warm, best_s)
        return tried[key]

    groups, colls = _phase_groups(program)
    key = (tuple(groups), tuple(colls.items()), tuple(program.totals.items()), tuple(eligible))
    if memo is not None and key in memo:
        sets, first, bounds = memo[key]
    else:
        sets, first, bounds = _candidate_sets(program, profile, eligible, memo)
        if memo is not None:
            memo[key] = sets, first, bounds
    exact = first is None
    order = [int(k) for k in np.argsort(bounds, kind="stable")]
    if first is not None:
        order.remove(first)
        order.insert(0, first)
    best_s = cutoff
    for k in order:
        if bounds[k] >= best_s * (1 - 1e-9):
            if k == first:  # out of bound order: the others may still be below
                continue
            break
        if len(tried) >= EXACT_MAX_SETS:
            exact = False  # the bound is weak here: keep the best of the most promising
            break
        c = attempt(sets[k], best_s)
        if c is not None:
            best_s = min(best_s, c.latency_s)
    found = [c for c in tried.values() if c is not None]
    if not found:
        return None
    # a rank the LP left empty does not take part: solve that smaller set too
    for c in sorted(found, key=lambda c: c.latency_s)[:1]:
        actual = [r.active for r in c.prediction.per_rank]
        attempt(actual, best_s)
    best = min((c for c in tried.values() if c is not None), key=lambda c: c.latency_s)
    if program.stream is not None:
        program.stream.budget = best.mem_budget
    best.extra["sets_tried"] = len(tried)
    best.extra["exact_search"] = exact
    return best


def _candidate_sets(program: Program, profile: Profile, eligible: list[bool], memo: dict | None = None
                    ) -> tuple[list[list[bool]], int | None, np.ndarray]:
    """The sets of participants `optimise` considers, the one to solve first (None: cheapest
    bound first), and each set's lower bound."""
    N = profile.world_size
    optional = [i for i in range(1, N) if eligible[i]]
    _, colls = _phase_groups(program)
    key = ("branch_table", tuple(colls), tuple(program.totals.items()))
    table = None if memo is None else memo.get(key)
    if len(optional) <= EXACT_MAX_OPTIONAL:
        # every set, cheapest lower bound first; once the bound reaches the best latency
        # found, no later set can win
        sets = [[i == 0 or i in sub for i in range(N)]
                for k in range(len(optional) + 1) for sub in itertools.combinations(optional, k)]
        return sets, None, set_bounds(program, profile, np.array(sets, bool), table)
    # the nested sets of the approximate model, its favourite first, then by lower bound: the
    # best set of the sequence (unless EXACT_MAX_SETS stops it), not of all sets
    if table is None:
        table = _branch_table(program, profile, list(colls), list(range(2, N + 1)))
        if memo is not None:
            memo[key] = table
    sets, approx = _elimination_sequence(program, profile, eligible, table)
    return sets, int(np.argmin(approx)), set_bounds(program, profile, np.array(sets, bool), table)


def _fastest_seconds(w, dev, count: float) -> float:
    """`w.seconds(dev, count)` at the best speed of any slice of up to `count` units: a lower
    bound on the time per unit of every smaller slice too (measured tables often peak below the
    largest size)."""
    if count <= 0 or (w.kind == "transfer" and dev.rank == 0):
        return 0.0
    speed = w.speed(dev, count)
    table = {"gemm": dev.gemm, "attention": dev.attention}.get(w.kind)
    if table is not None:
        size = w.size(count)
        speed = max([speed] + [v for s, v in zip(table.sizes, table.values) if s <= size])
    return w.per_unit * count / speed + dev.call_overhead_s


BOUND_BISECTIONS = 8  # from the even-block time down: the bound is within 0.4% of it. Each costs
#                        0.15 ms at 32 devices; 8 instead of 14 changed no plan of 768 random ones


def _branch_table(program: Program, profile: Profile, colls: list[Collective], ns: list[int]):
    """Each collective's whole buffer S [C] and its branches at each participant count n in
    `ns`, as const A and coefficient G of every rank's block: [C, N+1, 2, N], padded to two
    branches (a padding branch has const -inf and coefficient 0: it never binds). Rank 0's
    entries are its root terms."""
    N = profile.world_size
    devs = profile.devices
    a = np.array([d.latency_s for d in devs])
    b = np.array([d.bandwidth_Bps for d in devs])
    e = np.array([d.elementwise_per_s for d in devs])
    C = len(colls)
    A = np.full((C, N + 1, 2, N), -np.inf)
    G = np.zeros((C, N + 1, 2, N))
    S = np.zeros(C)
    for ci, coll in enumerate(colls):
        total = coll.unit_bytes if coll.dim is None else coll.unit_bytes * program.totals[coll.dim]
        S[ci] = 0.0 if coll.dim is None else total
        for n in ns:
            terms = branch_terms(coll.kind, n, total, a, b, e, False, profile.network)
            root = link_terms(coll, n, total, devs[0], True, profile.network)
            for br, ((c, k), (rc, rk)) in enumerate(zip(terms, root)):
                A[ci, n, br], G[ci, n, br] = c, (0.0 if coll.dim is None else k)
                A[ci, n, br, 0], G[ci, n, br, 0] = rc, (0.0 if coll.dim is None else rk)
    return S, A, G


def set_bounds(program: Program, profile: Profile, sets: np.ndarray, table=None) -> np.ndarray:
    """A lower bound on the latency of each set of participants (rows of `sets`, [K, N] bool).

    Compute: every phase perfectly balanced over the set, each rank at the best speed its
    table gives at any slice size up to the whole (`_fastest_seconds`; each rank pays a call's
    overhead at most once per work).
    Communication: each collective on its own at its best blocks, min over blocks summing to S
    of max over ranks of link_terms (found by bisection on the time, from the time at even
    blocks down; the lower end is returned); the collectives share one block vector in
    reality, so the sum of their separate minima is a lower bound. Memory is ignored.
    Vectorised over all sets at once. `table`: the collectives' `_branch_table`, if made."""
    N = profile.world_size
    devs = profile.devices
    K = sets.shape[0]
    full = {d: float(t) for d, t in program.totals.items()}
    out = np.zeros(K)
    groups, colls = _phase_groups(program)
    for works, mult in groups:
        t = np.array([sum(_fastest_seconds(w, devs[i], full[w.dim]) for w in works if w.dim != ROOT)
                      for i in range(N)])
        root = sum(w.seconds(devs[0], 1.0) for w in works if w.dim == ROOT)
        rate = sets @ np.where(t > 0, 1.0 / np.maximum(t, 1e-30), 0.0)  # [K]
        out += mult * np.maximum(np.where(rate > 0, 1.0 / np.maximum(rate, 1e-300), 0.0), root)
    if not colls or N == 1:
        return out
    sizes = sets.sum(axis=1)
    S, A, G = table if table is not None else _branch_table(
        program, profile, list(colls), sorted(set(sizes.tolist()) - {0, 1}))
    mult = np.array(list(colls.values()))
    C = len(colls)
    As, Gs = A[:, sizes], G[:, sizes]  # [C, K, 2, N]
    member = sets[None, :, :]  # [1, K, N]
    Sb = S[:, None]  # [C, 1]
    # even blocks are feasible: their time bounds the minimum from above
    with np.errstate(invalid="ignore"):
        even = (As + Gs * (Sb / np.maximum(sizes, 1)[None, :])[:, :, None, None]).max(axis=2)
    hi = np.where(member, even, -np.inf).max(axis=2) * (1 + 1e-9) + 1e-12  # [C, K]
    hi = np.where(sizes[None, :] > 1, hi, 0.0)
    lo = np.zeros((C, K))
    neg, pos, flat = Gs < 0, Gs > 0, Gs == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        for _ in range(BOUND_BISECTIONS):
            t = 0.5 * (lo + hi)
            tt = t[:, :, None, None]
            cut = (tt - As) / Gs  # block bound of each branch at time t
            low = np.where(neg, cut, 0.0).max(axis=2).clip(0.0)  # [C, K, N]
            up = np.minimum(np.where(pos, cut, np.inf).min(axis=2), Sb[:, :, None])
            flat_ok = np.where(flat, As <= tt, True).all(axis=2)
            rank_ok = ((low <= up) & flat_ok) | ~member
            ok = (rank_ok.all(axis=2) & (np.where(member, low, 0.0).sum(axis=2) <= Sb)
                  & (np.where(member, up, 0.0).sum(axis=2) >= Sb))
            hi = np.where(ok, t, hi)
            lo = np.where(ok, lo, t)
    out += (mult[:, None] * np.where(sizes[None, :] > 1, lo, 0.0)).sum(axis=0)
    return out


POLISH_MAX_UNITS = 1024  # dimensions this small are polished unit by unit after rounding
POLISH_PASSES = 8


def block_sizes(program: Program) -> dict[str, int]:
    """Each split dimension's kernel block (`Work.quantum`; the largest of its Works'), 1 for
    a dimension no kernel blocks."""
    quanta = {d: 1 for d in program.totals}
    for phase, _, _ in program.phases():
        for w in phase.works:
            if w.dim in quanta:
                quanta[w.dim] = max(quanta[w.dim], w.quantum)
    return quanta


def snap_to_blocks(program: Program, counts: dict[str, list[float]]) -> dict[str, list[float]]:
    """`counts` with every dimension that a kernel does in blocks (`block_sizes`: GeMM row
    tiles, weight panels) in whole blocks, by the largest remainder, and the total's odd part
    (total mod quantum) on the rank with the most. Nothing else changes."""
    out = {d: list(v) for d, v in counts.items()}
    for d, q in block_sizes(program).items():
        total = int(program.totals[d])
        if q <= 1 or total < 2 * q:
            continue
        blocks = split_counts(total // q, [max(v, 0.0) for v in counts[d]])
        snapped = [float(b * q) for b in blocks]
        snapped[int(np.argmax(snapped))] += total % q
        out[d] = snapped
    return out


def polish(program: Program, profile: Profile, caps: list[float], cand: Candidate) -> Candidate:
    """Move single units (whole heads, token rows) from the busiest rank of a dimension to one of
    its three least busy ranks while the exact cost model improves. Rounding the LP's shares can
    cost a few percent when one unit is a large part of a slow rank's work (a row on a slow
    primary that also embeds); when the rounded plan is within 0.2% of the LP's own objective
    there is nothing to win and this returns at once. A dimension done in kernel blocks
    (`Work.quantum`) also moves a block at a time."""
    N = profile.world_size
    devs = profile.devices
    best = cand
    lp_s = best.extra.get("lp_objective_s")
    if lp_s is not None and best.latency_s <= lp_s * 1.002:
        return best
    works = {d: [w for p, _, _ in program.phases() for w in p.works if w.dim == d] for d in program.totals}
    # moves of one unit, and of one kernel block where the dimension has them (from 56 + 72
    # rows, 48 + 80 is one move; 55 + 73 and 57 + 71 both add a partial tile)
    quanta = block_sizes(program)
    steps = {d: sorted({s for s in (1, quanta[d]) if total / s <= POLISH_MAX_UNITS})
             for d, total in program.totals.items()}
    for _ in range(POLISH_PASSES):
        improved = False
        for d in program.totals:
            if not works[d] or not steps[d]:
                continue
            active = [i for i in range(N) if best.prediction.per_rank[i].active]
            load = {i: sum(w.seconds(devs[i], best.counts[d][i]) for w in works[d]) for i in active}
            order = sorted(active, key=lambda i: load[i])
            donor = order[-1]
            moves = [(donor, j, step) for j in order[:3] for step in steps[d]]
            q = quanta[d]
            if q > 1:  # a rank's partial block: to a least busy other rank, or filled by the busiest
                for i in active:
                    rem = int(best.counts[d][i]) % q
                    if rem:
                        moves += [(i, j, rem) for j in [k for k in order if k != i][:2]]
                        moves.append((donor, i, q - rem))
            for src, dst, step in moves:
                if src == dst or best.counts[d][src] < step:
                    continue
                cnt = {k: list(v) for k, v in best.counts.items()}
                cnt[d][src] -= step
                cnt[d][dst] += step
                pred = _evaluate(program, cnt, profile)
                if pred.latency_s < best.latency_s * (1 - 1e-9) and not fits_memory(pred, caps):
                    best = Candidate(best.strategy, cnt, pred, program, pred.latency_s,
                                     extra=dict(best.extra))
                    improved = True
                    break
        if not improved:
            break
    if program.stream is not None:  # the budget of the counts kept, not of the last one tried
        program.stream.budget = stream_budget(program, best.counts)
        best.mem_budget = int(program.stream.budget)
    return best

