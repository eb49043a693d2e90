"""The partitioner's linear program for one set of participating ranks, built from a `Program`.

For every split dimension d and participating rank i, x[d,i] is rank i's count (whole heads are
integers, which makes it a small MILP; FFN columns and token rows are continuous and rounded
afterwards by the largest remainder). With n participants fixed, every collective's per-rank
time is linear in the rank's own block (hepti.plan.costmodel.link_terms), so, in milliseconds:

    minimise  sum over distinct phases of  multiplicity * (tc_p + tm_c)
    subject to
      tc_p >= compute of rank i in phase p                 (linear in x[., i])
      tm_c >= const_b(n) + coef_b(n) * block_i             (every branch b of every participant)
      memory_i(x) <= cap_i                                 (weights, each step's activations)
      sum_i x[d,i] = total_d;  x[d,i] = 0 for ranks that do not take part

This is exactly the cost model for fixed speeds. Only the GeMM speed's dependence on the slice
size is not linear, so `solve` takes the speeds at reference counts and the caller iterates.
Which ranks take part is searched outside (hepti.plan.search), one LP per candidate set: a
formulation with binary participation and big-M terms was tried first and took seconds at 16-32
devices, because its LP relaxation spreads work thinly over every rank at almost no cost.
`stream` adds a per-layer time at least every rank's read of its slices, and one memory budget
that every rank's window must fit (the runtime's --mem-budget).
"""
from __future__ import annotations

import math

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from hepti.plan.costmodel import ACTIVE, ROOT, Collective, Program, link_terms, steps_of
from hepti.plan.profile import Profile

MS = 1e3  # the LP works in milliseconds: coefficients near 1 solve more reliably
MIP_GAP = 1e-3  # whole heads: the MILP stops within 0.1% of its bound


try:  # HiGHS itself, as scipy ships it (scipy >= 1.15); see _Model.solve
    from scipy.optimize._highspy import _core as _highs
except ImportError:  # pragma: no cover - older scipy: milp alone
    _highs = None


class _Model:
    """A tiny sparse-LP builder, solved by HiGHS."""

    def __init__(self):
        self.lb, self.ub, self.cost, self.integer = [], [], [], []
        self.rows, self.cols, self.vals, self.rlb, self.rub = [], [], [], [], []

    def var(self, lb=0.0, ub=math.inf, cost=0.0, integer=False) -> int:
        self.lb.append(lb)
        self.ub.append(ub)
        self.cost.append(cost)
        self.integer.append(1 if integer else 0)
        return len(self.lb) - 1

    def row(self, coeffs: dict[int, float], lb=-math.inf, ub=math.inf) -> None:
        r = len(self.rlb)
        for j, v in coeffs.items():
            if v != 0.0:
                self.rows.append(r)
                self.cols.append(j)
                self.vals.append(v)
        self.rlb.append(lb)
        self.rub.append(ub)

    def solve(self, time_limit: float, direct: bool = True) -> tuple[np.ndarray, float] | None:
        """(x, objective), or None if infeasible (or, for a MILP, no solution in time).

        A plan solves 10-30 of these LPs (40-120 variables), HiGHS taking 0.2-0.3 ms on each.
        scipy's `milp` wraps that in 0.7 ms of checking its options and collecting duals and
        slacks we do not read, which was over half of the planner's time at 32 devices; so the
        model goes to the HiGHS object scipy ships (`scipy.optimize._highspy`, not public API)
        and through `milp` only where that module is missing (or `direct` is False: the tests
        check that both give the same answer)."""
        A = coo_matrix((self.vals, (self.rows, self.cols)), shape=(len(self.rlb), len(self.lb)))
        mip = any(self.integer)
        if _highs is None or not direct:
            # a plain LP this small solves faster without HiGHS's presolve (0.2-0.3 ms of ~1.2)
            options = ({"time_limit": time_limit, "mip_rel_gap": MIP_GAP} if mip
                       else {"time_limit": time_limit, "presolve": False})
            res = milp(c=np.array(self.cost), integrality=np.array(self.integer),
                       bounds=Bounds(np.array(self.lb), np.array(self.ub)),
                       constraints=[LinearConstraint(A.tocsr(), np.array(self.rlb), np.array(self.rub))],
                       options=options)
            return None if res.x is None else (res.x, float(res.fun))
        A = A.tocsc()
        lp_ = _highs.HighsLp()
        lp_.num_col_, lp_.num_row_ = A.shape[1], A.shape[0]
        lp_.col_cost_ = np.array(self.cost, float)
        lp_.col_lower_, lp_.col_upper_ = np.array(self.lb, float), np.array(self.ub, float)
        lp_.row_lower_, lp_.row_upper_ = np.array(self.rlb, float), np.array(self.rub, float)
        mat = lp_.a_matrix_
        mat.format_ = _highs.MatrixFormat.kColwise
        mat.num_col_, mat.num_row_ = A.shape[1], A.shape[0]
        mat.start_, mat.index_, mat.value_ = A.indptr, A.indices, A.data
        options = _highs.HighsOptions()
        options.output_flag = False
        options.time_limit = float(time_limit)
        if mip:
            lp_.integrality_ = [_highs.HighsVarType(i) for i in self.integer]
            options.mip_rel_gap = MIP_GAP
        else:
            options.presolve = "off"
        h = _highs._Highs()
        h.passOptions(options)
        h.passModel(lp_)
        h.run()
        status, info = h.getModelStatus(), h.getInfo()
        S = _highs.HighsModelStatus
        # a MILP stopped by its time limit still has a usable solution if it found one
        ok = status == S.kOptimal or (mip and status in (S.kTimeLimit, S.kIterationLimit, S.kSolutionLimit)
                                      and info.objective_function_value < _highs.kHighsInf)
        if not ok:
            return None
        return np.array(h.getSolution().col_value), float(info.objective_function_value)


def _add(acc: dict[int, float], j: int, v: float) -> None:
    acc[j] = acc.get(j, 0.0) + v


def solve(program: Program, profile: Profile, caps: list[float], ref_counts: dict[str, list[float]],
          active: list[bool], time_limit: float = 5.0, relax: bool = False,
          fixed: dict[str, list[float]] | None = None, direct: bool = True) -> dict | None:
    """Optimal counts when exactly the `active` ranks take part (rank 0 always does), with
    speeds taken at `ref_counts`; None if they cannot fit the memory caps. `relax` drops the
    integrality of whole heads (a plain LP); `fixed` pins the counts of some dimensions;
    `direct` False solves through scipy's public `milp` (see _Model.solve)."""
    N = profile.world_size
    devs = profile.devices
    act = [i for i in range(N) if active[i] or i == 0]
    n = len(act)
    m = _Model()
    integer = () if relax else program.integer_dims
    x = {d: [m.var(0.0, float(program.totals[d]) if (active[i] or i == 0) else 0.0,
                   integer=d in integer) for i in range(N)]
         for d in program.totals}
    for d, vec in (fixed or {}).items():
        for i in range(N):
            m.lb[x[d][i]] = m.ub[x[d][i]] = float(vec[i])
    for d, total in program.totals.items():
        m.row({x[d][i]: 1.0 for i in act}, float(total), float(total))

    tc: dict[tuple, int] = {}
    tm: dict[Collective, int] = {}
    per_layer_terms: dict[str, dict[int, float]] = {"layer": {}, "end": {}}
    objective: dict[int, float] = {}
    for phase, mult, group in program.phases():
        if phase.works not in tc:
            v = tc[phase.works] = m.var()
            for i in act:
                row, const = {v: 1.0}, 0.0
                for w in phase.works:
                    if w.dim == ROOT:
                        const += MS * w.seconds(devs[0], 1.0) if i == 0 else 0.0
                        continue
                    ref = ref_counts[w.dim][i] or program.totals[w.dim] / n
                    _add(row, x[w.dim][i], -MS * w.per_unit / w.speed(devs[i], ref))
                    const += MS * devs[i].call_overhead_s  # charged as if every work runs
                m.row(row, lb=const)
        terms = [tc[phase.works]]
        coll = phase.collective
        if coll is not None and n > 1:
            if coll not in tm:
                tm[coll] = _collective_var(m, coll, program, profile, x, act)
            terms.append(tm[coll])
        target = (per_layer_terms[group] if program.stream is not None and group != "start"
                  else objective)
        w_ = 1.0 if target is not objective else float(mult)
        for j in terms:
            _add(target, j, w_)

    budget = None
    if program.stream is not None:
        st = program.stream
        read = m.var()  # the slowest rank's read of one layer's slices, ms
        for i in act:
            bw = devs[i].disk_read_Bps
            row = {read: 1.0}
            for d, b in st.read_per_unit.items():
                _add(row, x[d][i], -MS * b / bw)
            m.row(row, lb=MS * st.read_fixed / bw)
        serial = 1.0 if st.window < 2 else 0.0
        for group, mult in (("layer", program.repeat), ("end", 1)):
            t = m.var()
            _add(objective, t, float(mult))
            m.row({t: 1.0, **{j: -v for j, v in per_layer_terms[group].items()}, read: -serial}, lb=0.0)
            if st.window >= 2:
                m.row({t: 1.0, read: -1.0}, lb=0.0)
        budget = m.var()

    # --- memory: caps, and for stream the one budget every rank's window must fit -----------
    # Activations differ by step of the schedule (MemTerm.step): every step's must fit, so
    # each gets its own row (the steps no other step dominates: a few per program), unless it
    # would fit even with every unit on this rank (then it cannot bind: most rows, most plans).
    held = program.n_layers if program.stream is None else program.stream.window
    steps = list(steps_of(program.memory).values()) or [[]]
    for i in act:
        for step in steps:
            per_layer, other, const, most = {}, {}, 0.0, 0.0
            for t in [t for t in program.memory if t.step is None] + step:
                if t.dim == ACTIVE or (t.dim == ROOT and i == 0):
                    amount = t.per_unit
                    if t.per_layer:
                        per_layer[-1] = per_layer.get(-1, 0.0) + amount
                    else:
                        const += amount
                elif t.dim in program.totals:
                    _add(per_layer if t.per_layer else other, x[t.dim][i], t.per_unit)
                    most += t.per_unit * (held if t.per_layer else 1) * program.totals[t.dim]
            slice_const = per_layer.pop(-1, 0.0)
            if const + held * slice_const > caps[i]:
                return None  # cannot even hold its fixed part
            if budget is None and const + held * slice_const + most <= caps[i]:
                continue
            row = dict(other)
            for j, v in per_layer.items():
                _add(row, j, held * v)
            m.row(row, ub=caps[i] - const - held * slice_const)
            if budget is not None:
                m.row({budget: 1.0, **other}, ub=caps[i] - const)
                if step is steps[0]:  # the window's slices: the same for every step
                    m.row({budget: -1.0, **{j: held * v for j, v in per_layer.items()}},
                          ub=-held * slice_const)

    for j, v in objective.items():
        m.cost[j] += v
    res = m.solve(time_limit, direct)
    if res is None:
        return None
    xs, fun = res
    out = {d: [max(0.0, float(xs[x[d][i]])) for i in range(N)] for d in program.totals}
    for d in integer:
        out[d] = [float(round(v)) for v in out[d]]
    return {"counts": out, "objective_s": fun / MS}


def _collective_var(m: _Model, coll: Collective, program: Program, profile: Profile, x,
                    act: list[int]) -> int:
    """A variable at least every participant's time in `coll` (each branch of link_terms)."""
    t = m.var()
    unit = coll.unit_bytes
    S = coll.unit_bytes if coll.dim is None else unit * program.totals[coll.dim]
    for i in act:
        for const, coef in link_terms(coll, len(act), S, profile.devices[i], i == 0, profile.network):
            row = {t: 1.0}
            if coll.dim is not None:
                _add(row, x[coll.dim][i], -MS * coef * unit)
            m.row(row, lb=MS * const)
    return t
