"""GenEFlow for CNNs: a genetic search over fused groups and each group's split, by height
(horizontal) or by output channels (vertical), judged by CoEdge's cost model
(hepti.plan.coedge.predict), for `hepti plan --search genetic`.

**Chromosome** (`CNNGenome`): a cut bit after each spatial op (a group ends there; a group is
at most coedge.MAX_FUSE ops, so longer runs are cut), a ratio vector per spatial op (each
device's share of the rows, or of the output channels, of the maps it makes; a group uses its
first op's vector, so that moving a cut keeps every group's shares meaningful), each op's
split dimension ("rows" or "channels"; an op split by channels is a group of its own), whether
its weights are resident or streamed from local files as it runs (hepti's `stream`, per
group), and how the linear head is split (`cols` over the devices or `primary`). This is what
a "bands" plan file carries (`groups`, `group_ratios`, `group_dims`, `group_streamed`,
`head`), so every plan runs on the band executor as it is; where neighbouring groups split
differently, the executor's exchange gathers the rows a channel split reads whole. A device
with share 0 in every group takes no part.

Why both: a height split keeps a conv's whole weight on every device that has rows of it, so
a memory cap below the weights cannot be met by rows alone (ResNet-50: 97 MiB of weights). A
channel split slices the weights and pays an allgather of the whole map per op: cheap where
the maps are small and the weights large (the last stages), dear early on. Where even that
does not fit (two devices capped at half of one device's peak: the caps add up to one
device's need, and every split holds something twice), streaming a group's weights keeps
one conv's resident at a time, for the time of reading and packing them each forward.

**Fitness**: coedge.predict's latency, plus the constraint-violation term of hepti.plan.genetic
(`PENALTY` x latency x the summed relative excess over the caps) for the memory `band_memory`
estimates: the rank's weights (`weight_bytes_of`: as hepti.parallel.engine `BandJob` loads them), and
the rows of every tensor a rank holds in its largest group (what `split.needs` says it
computes or reads; whole maps in a channel split), as if all were live at once: an upper
bound.

**Seeds**: CoEdge's plan (hepti.plan.coedge.plan_cnn "auto": the LP per device subset, then the
fusion DP), its ratios one op per group and fused in fixed groups of 4, the even,
proportional and grid (DeepThings) baselines, the LP's and the proportional ratios with the
ops that hold the last 100% to 30% of the weights split by channels (`channels_from`),
resident or streamed, each with its shares moved off the devices over their caps (`fitted`),
and random genomes. Under tight caps the feasible genomes are few and far apart: without the
fitted seeds, ResNet-50 on 3 devices at 50% read 419 ms over 5 seeds (336-469); with them,
302 ms (293-318). Mutations include copying one group's shares to every group split the
same way, and moving shares off the devices over their caps. Elitism keeps the best, so the
result is never slower than CoEdge's plan under the same model. Deterministic from the seed.
No MPI here.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from hepti.errors import PlanError
from hepti.graph.cnn import F32, build
from hepti.graph.split import (Split, channel_needs, conv_rows, head_rows, needs,
                               out_channels, spatial_ops, streamed_convs)
from hepti.plan.genetic import DEFAULTS, PENALTY, Evolution
from hepti.counts import counts
from hepti.plan.coedge import CNNCosts, MAX_FUSE, fixed_groups, plan_cnn, predict
from hepti.plan.planfile import Plan

SHARE_FLOOR = 0.02  # a share below this is rounded to 0 (coedge.MIN_SHARE's band of a few rows)


@dataclass(frozen=True)
class CNNGenome:
    cuts: tuple[bool, ...]  # cuts[l]: a group ends after spatial op l (the last is always cut)
    ratios: tuple[tuple[float, ...], ...]  # per spatial op
    head: str  # "cols" | "primary"
    dims: tuple[str, ...] | None = None  # per spatial op, "rows" or "channels" (None: rows);
    # an op split by channels is a group of its own (CNNSearch._fix)
    streamed: tuple[bool, ...] | None = None  # per spatial op (None: every weight resident)

    def groups(self) -> tuple[tuple[int, int], ...]:
        out, a = [], 0
        for l, cut in enumerate(self.cuts):
            if cut or l == len(self.cuts) - 1:
                out.append((a, l + 1))
                a = l + 1
        return tuple(out)

    def split(self) -> Split:
        groups = self.groups()
        per = tuple(self.ratios[a] for a, _ in groups)
        dims = None if self.dims is None or "channels" not in self.dims else \
            tuple(self.dims[a] for a, _ in groups)
        streamed = None if not self.streamed else tuple(self.streamed[a] for a, _ in groups)
        # the global vector (the head's columns, the pooled map's owner when unfused) is the
        # last group's: the maps the tail reads are made there
        return Split(per[-1], groups, self.head, per, dims, streamed)


def weight_bytes_of(graph, split: Split, rank: int, size: int) -> float:
    """The weight bytes `rank` holds at most under `split` (what hepti.parallel.engine `BandJob`'s
    `Weights` reads): each conv's rows by `conv_rows`, each linear's by `head_rows`, all
    resident but a streamed group's convs, of which the largest is held twice (as read, and
    packed) while it runs."""
    streamed = streamed_convs(graph, split)
    per_row = graph.row_bytes()
    total, one = 0.0, 0.0
    for rows in (conv_rows(graph, split, rank, size), head_rows(graph, split, rank, size)):
        for name, (lo, hi) in rows.items():
            b = max(0, hi - lo) * per_row[name]
            if name in streamed:
                one = max(one, b)
            else:
                total += b
    return total + 2 * one


def band_memory(graph, split: Split, h: int, w: int, n: int, size: int) -> list[float]:
    """Each rank's bytes: its weights (`weight_bytes_of`: whole convs where it has rows,
    its channels where a group is split by channels, its columns of the head) and, in its
    largest group, the rows it computes or reads of every tensor there (`needs`), all
    counted live at once. In a group split by channels every member holds each made map
    whole, twice while the allgather's result is laid back out (and its own channels), and a
    rank with a share holds the inputs whole. Rank 0 holds the input image whole (it reads
    it)."""
    shapes = graph.shapes(h, w)
    members = split.members()
    out = []
    for i in range(size):
        if i not in members:
            out.append(0.0)
            continue
        peak = 0.0
        for k, g in enumerate(split.group_ranges(graph)):
            ratios = split.group_ratios(k)
            if split.group_dim(k) == "channels":
                made = [op.output for op in graph.ops[g[0]:g[1]]]
                need = {t: (0, shapes[t][0]) for t in made}
                need.update(channel_needs(graph, shapes, g, ratios, i))
                extra = max(F32 * n * shapes[t][0] * shapes[t][1] * (
                    shapes[t][2] + out_channels(graph.ops[a], ratios, shapes[t][2])[i])
                    for a, t in enumerate(made, start=g[0]))
            else:
                need, extra = needs(graph, shapes, g, ratios, i), 0.0
            b = sum(F32 * n * (hi - lo) * shapes[t][1] * shapes[t][2] for t, (lo, hi) in need.items())
            peak = max(peak, b + extra)
        if i == 0:
            hh, ww, c = shapes[graph.input]
            peak += F32 * n * hh * ww * c
        out.append(weight_bytes_of(graph, split, i, size) + peak)
    return out


def channel_split(graph, costs, h: int, w: int, n: int, caps: list[float]) -> Split | None:
    """The single-dimension vertical plan: every op split by output channels, one group each,
    the head by columns, in shares proportional to each device's speed (its time for the
    whole net), moved off any device over its cap (`band_memory`) onto the others in the
    same proportions; None if no such shares fit. (What `tensor` is to an encoder.)"""
    L = spatial_ops(graph)
    speed = np.array([1.0 / sum(t) for t in costs.op_s])
    r = speed / speed.sum()

    def split_of(r):
        v = tuple(float(x) for x in r)
        return Split(v, tuple((l, l + 1) for l in range(L)), "cols", (v,) * L, ("channels",) * L)

    for _ in range(50):
        mem = np.array(band_memory(graph, split_of(r), h, w, n, costs.size))
        over = mem > np.array(caps) * (1 + 1e-9)
        if not over.any():
            return split_of(r)
        weights = np.array([weight_bytes_of(graph, split_of(r), i, costs.size)
                            for i in range(costs.size)])
        fixed = mem - weights  # what does not shrink with the share: the maps, whole
        room = np.maximum(np.array(caps) - fixed, 0.0)
        new = r.copy()
        new[over] = r[over] * room[over] / np.maximum(weights[over], 1.0) * 0.99
        free = ~over & (r > 0)
        if not free.any():
            return None
        new[free] += (1.0 - new.sum()) * speed[free] / speed[free].sum()
        if np.allclose(new, r):
            return None
        r = np.maximum(new, 0.0) / np.maximum(new, 0.0).sum()
    return None


def single_device_peak_cnn(graph, h: int, w: int, n: int = 1) -> float:
    """One device alone: the weights and its largest op's input and output maps (coedge's LP
    counts activations so), and the image."""
    one = Split((1.0,), None, "primary")
    return band_memory(graph, one, h, w, n, 1)[0]


class CNNSearch(Evolution):
    def __init__(self, graph, costs, h: int, w: int, n: int, caps: list[float], seed: int = 0,
                 population: int = DEFAULTS["population"], generations: int = DEFAULTS["generations"],
                 crossover: float = DEFAULTS["crossover"], mutation: float = DEFAULTS["mutation"],
                 tournament: int = DEFAULTS["tournament"], elite: int = DEFAULTS["elite"],
                 random_seeds: int = DEFAULTS["random_seeds"]):
        self.graph, self.costs, self.h, self.w, self.n, self.caps = graph, costs, h, w, n, caps
        self.L, self.P, self.max_fuse = spatial_ops(graph), costs.size, MAX_FUSE
        self.settings = dict(seed=seed, population=population, generations=generations,
                             crossover=crossover, mutation=mutation, tournament=tournament,
                             elite=elite, random_seeds=random_seeds, penalty=PENALTY)
        self.rng = np.random.default_rng(seed)
        self._scores: dict[CNNGenome, tuple[float, float, dict]] = {}

    def score(self, g: CNNGenome) -> tuple[float, float, dict]:
        if g not in self._scores:
            split = g.split()
            pred = predict(self.graph, split, self.costs, self.h, self.w, self.n)
            mem = band_memory(self.graph, split, self.h, self.w, self.n, self.P)
            pred["mem_bytes"] = mem
            excess = sum(max(0.0, m / c - 1.0) for m, c in zip(mem, self.caps) if m)
            lat = pred["latency_s"]
            fit = lat * (1.0 + PENALTY * excess) + (lat if excess else 0.0)
            self._scores[g] = (fit, lat if excess == 0 else math.inf, pred)
        return self._scores[g]

    # --- genomes -------------------------------------------------------------------------------
    def _norm(self, v) -> tuple[float, ...]:
        v = np.maximum(np.asarray(v, float), 0.0)
        v[v < SHARE_FLOOR * v.sum()] = 0.0
        if v.sum() <= 0:
            v[0] = 1.0
        return tuple(float(x) for x in v / v.sum())

    def _fix(self, cuts, dims=None) -> tuple[bool, ...]:
        """Cut every run longer than MAX_FUSE (and after the last op), and on both sides of
        an op split by channels (fusing saves nothing there: each op gathers its map)."""
        cuts, run = list(cuts), 0
        for l in range(self.L):
            run += 1
            if run >= self.max_fuse:
                cuts[l] = True
            if dims is not None and (dims[l] == "channels" or
                                     (l + 1 < self.L and dims[l + 1] == "channels")):
                cuts[l] = True
            if cuts[l]:
                run = 0
        cuts[-1] = True
        return tuple(bool(c) for c in cuts)

    def _genome(self, cuts, ratios, head, dims, streamed=None) -> CNNGenome:
        dims = tuple(dims) if dims is not None and "channels" in dims else None
        streamed = tuple(bool(x) for x in streamed) if streamed is not None and any(streamed) \
            else None
        return CNNGenome(self._fix(cuts, dims), tuple(ratios), head, dims, streamed)

    def of_split(self, split: Split) -> CNNGenome:
        groups = split.group_ranges(self.graph)
        cuts = [False] * self.L
        ratios = [None] * self.L
        dims = ["rows"] * self.L
        streamed = [False] * self.L
        for k, (a, b) in enumerate(groups):
            cuts[b - 1] = True
            for l in range(a, b):
                ratios[l] = self._norm(split.group_ratios(k))
                dims[l] = split.group_dim(k)
                streamed[l] = split.group_streamed(k)
        return self._genome(cuts, ratios, split.head, dims, streamed)

    def random_genome(self) -> CNNGenome:
        members = [0] + [i for i in range(1, self.P) if self.rng.random() < 0.6]
        base = np.zeros(self.P)
        base[members] = self.rng.dirichlet(np.ones(len(members)))
        cuts = self.rng.random(self.L) < 0.4
        ratios = tuple(self._norm(base * np.exp(self.rng.normal(0, 0.2, self.P))) for _ in range(self.L))
        # channels from a random op on (the weights sit in the later layers), or none
        at = int(self.rng.integers(self.L + 1)) if self.P > 1 else self.L
        dims = ["rows"] * at + ["channels"] * (self.L - at)
        # streamed from a random op on, now and then
        at = int(self.rng.integers(self.L)) if self.rng.random() < 0.2 else self.L
        streamed = [False] * at + [True] * (self.L - at)
        return self._genome(cuts, ratios, str(self.rng.choice(["cols", "primary"])), dims,
                            streamed)

    def crossover(self, a: CNNGenome, b: CNNGenome) -> CNNGenome:
        x = int(self.rng.integers(1, self.L)) if self.L > 1 else 1  # one point, over ops
        cuts = a.cuts[:x] + b.cuts[x:]
        ratios = a.ratios[:x] + b.ratios[x:]
        dims = self._dims(a)[:x] + self._dims(b)[x:]
        streamed = self._streamed(a)[:x] + self._streamed(b)[x:]
        return self._genome(cuts, ratios, a.head if self.rng.random() < 0.5 else b.head, dims,
                            streamed)

    def channels_from(self, ratios, frac: float, streamed: bool = False) -> CNNGenome:
        """`ratios` for every op; the last ops that hold `frac` of the conv weights split by
        channels (one group each), the rest by rows one op a group; every op's weights
        streamed if `streamed`."""
        sizes = [self.graph.ops[l].cout * self.graph.ops[l].cin // max(1, self.graph.ops[l].groups)
                 * self.graph.ops[l].kernel ** 2 for l in range(self.L)]
        total, acc, at = sum(sizes), 0.0, self.L
        while at > 0 and acc < frac * total - 1e-9:
            at -= 1
            acc += sizes[at]
        dims = ["rows"] * at + ["channels"] * (self.L - at)
        return self._genome([True] * self.L, [self._norm(ratios)] * self.L, "cols", dims,
                            [streamed] * self.L)

    def fitted(self, g: CNNGenome, rounds: int = 12) -> CNNGenome:
        """`g` with its shares moved off the devices over their caps (`_toward_caps`) until
        every cap holds, or `rounds` times."""
        for _ in range(rounds):
            if self.score(g)[1] < math.inf:
                break
            ratios = self._toward_caps(g, list(g.ratios))
            if list(ratios) == list(g.ratios):
                break
            g = CNNGenome(g.cuts, tuple(ratios), g.head, g.dims, g.streamed)
        return g

    def _toward_caps(self, g: CNNGenome, ratios: list) -> list:
        """Each device over its cap (`band_memory`) loses share in every group by the
        square of its cap over its bytes (the weights it holds shrink with its share in a
        group split by channels, its bands in one split by rows)."""
        mem = self.score(g)[2]["mem_bytes"]
        f = np.array([min(1.0, c / m) ** 2 if m else 1.0 for m, c in zip(mem, self.caps)])
        if f.min() >= 1.0:
            return ratios
        return [self._norm(np.array(v) * f) for v in ratios]

    def _dims(self, g: CNNGenome) -> tuple[str, ...]:
        return g.dims or ("rows",) * self.L

    def _streamed(self, g: CNNGenome) -> tuple[bool, ...]:
        return g.streamed or (False,) * self.L

    def mutate(self, g: CNNGenome) -> CNNGenome:
        rng = self.rng
        cuts, ratios, head, dims = list(g.cuts), list(g.ratios), g.head, list(self._dims(g))
        streamed = list(self._streamed(g))
        kind = rng.random()
        if kind < 0.1 and self.P > 1:  # split one op the other way, or every op from it on
            l = int(rng.integers(self.L))
            other = "rows" if dims[l] == "channels" else "channels"
            for m in (range(l, self.L) if rng.random() < 0.5 else (l,)):
                dims[m] = other
        elif kind < 0.15:  # stream one op's weights or keep them, or every op's from it on
            l = int(rng.integers(self.L))
            flag = not streamed[l]
            for m in (range(l, self.L) if rng.random() < 0.5 else (l,)):
                streamed[m] = flag
        elif kind < 0.2:  # one group's shares for every group split the same way
            a, _ = _group_at(g.groups(), int(rng.integers(self.L)))
            for l in range(self.L):
                if dims[l] == dims[a]:
                    ratios[l] = ratios[a]
        elif kind < 0.25:  # shares off the devices over their caps, in every group
            ratios = self._toward_caps(g, ratios)
        elif kind < 0.3:  # move a group boundary: flip one cut
            l = int(rng.integers(self.L))
            cuts[l] = not cuts[l]
        elif kind < 0.4:
            head = "primary" if head == "cols" else "cols"
        elif kind < 0.55 and self.P > 1:  # drop or revive a device in one group's vector
            a, b = _group_at(g.groups(), int(rng.integers(self.L)))
            i = int(rng.integers(1, self.P))
            v = np.array(ratios[a])
            v[i] = 0.0 if v[i] > 0 else rng.uniform(0.05, 0.3)
            for l in range(a, b):
                ratios[l] = self._norm(v)
        else:  # perturb one group's shares (log-normal), or every group's alike
            sigma = float(rng.choice([0.05, 0.15]))
            noise = np.exp(rng.normal(0, sigma, self.P))
            span = [_group_at(g.groups(), int(rng.integers(self.L)))] if rng.random() < 0.7 else g.groups()
            for a, b in span:
                v = self._norm(np.array(ratios[a]) * noise)
                for l in range(a, b):
                    ratios[l] = v
        return self._genome(cuts, ratios, head, dims, streamed)


def _group_at(groups, l: int) -> tuple[int, int]:
    return next((a, b) for a, b in groups if a <= l < b)


def genetic_cnn_search(graph, costs, h: int, w: int, n: int, caps: list[float], seed: int = 0,
                       **settings) -> tuple[CNNGenome, dict, dict]:
    """GenEFlow on a CNN's graph and costs: (best feasible genome, its prediction, the run's
    account: settings, seed latencies, CoEdge's latency, history). PlanError if no split fits."""
    t0 = time.perf_counter()
    search = CNNSearch(graph, costs, h, w, n, caps, seed, **settings)
    seeds = {}
    lp_latency = math.inf
    try:
        lp = plan_cnn(graph, costs, h, w, n, "auto")
    except PlanError:
        lp = None
    if lp is not None:
        seeds["coedge lp"] = search.of_split(lp["split"])
        lp_latency = search.score(seeds["coedge lp"])[1]
        r = lp["split"].ratios
        seeds["lp unfused"] = search.of_split(Split(r, None, lp["split"].head))
        seeds["lp fused by 4"] = search.of_split(Split(r, fixed_groups(graph, 4), lp["split"].head))
    for name in ("even", "proportional", "grid"):
        seeds[name] = search.of_split(plan_cnn(graph, costs, h, w, n, name)["split"])
    if search.P > 1:  # the weights' side of the caps: channel splits from where they sit
        prop = plan_cnn(graph, costs, h, w, n, "proportional")["split"].ratios
        for name, ratios in (("lp", lp["split"].ratios if lp is not None else None),
                             ("proportional", prop)):
            if ratios is not None:
                for frac in (1.0, 0.9, 0.75, 0.6, 0.5, 0.3):
                    for streamed in (False, True):
                        seeds[f"{name} ratios, channels for {frac:.0%} of the weights"
                              + (", streamed" if streamed else "")] = search.fitted(
                            search.channels_from(ratios, frac, streamed))
    best, seed_lat, history = search.run(seeds)
    if best is None:
        need = min(max(m / c for m, c in zip(s[2]["mem_bytes"], caps) if m)
                   for s in search._scores.values())
        raise PlanError(
            f"no plan fits the memory caps: the leanest of {len(search._scores)} splits "
            f"searched (rows or channels, per op) needs {need:.2f}x a device's cap "
            f"({min(caps) / 2**20:,.1f} MiB at the least, against "
            f"{graph.weight_bytes() / 2**20:,.1f} MiB of weights); raise --mem-cap (or "
            f"--mem-budget), or add devices")
    lat = search.score(best)[1]
    report = {k: search.settings[k] for k in ("seed", "population", "generations", "crossover",
                                               "mutation", "tournament", "elite", "random_seeds",
                                               "penalty")}
    report.update(evaluations=len(search._scores), operators=len(graph.ops),
                  search_s=time.perf_counter() - t0,
                  lp_latency_s=lp_latency if lp_latency < math.inf else None,
                  gain_vs_lp=(1 - lat / lp_latency) * 100 if lp_latency < math.inf else None,
                  seeds_s=seed_lat, history_s=history)
    return best, search.score(best)[2], report


def make_genetic_cnn_plan(config, profile, mem_budget: float | None = None, seed: int = 0,
                          size: tuple[int, int] | None = None, batch: int | None = None,
                          **settings):
    """`hepti plan --search genetic` for a CNN: a "bands" plan file, the search reported in
    `predicted["genetic"]` and the explanation. PlanError if no height split fits the caps."""
    graph = build(config)
    costs = CNNCosts.from_profile(profile, graph)
    h, w = size or (costs.h, costs.w)
    n = batch or costs.n
    caps = [min(m, mem_budget) if mem_budget else m for m in costs.memory_bytes]
    best, pred, report = genetic_cnn_search(graph, costs, h, w, n, caps, seed, **settings)
    split = best.split()
    solve_s, lat = report["search_s"], pred["latency_s"]
    gain, lp_latency = report["gain_vs_lp"], report["lp_latency_s"]
    report.update(groups=len(split.groups), head=split.head, returned="genetic",
                  channel_groups=split.dims.count("channels") if split.dims else 0,
                  streamed_groups=sum(split.streamed) if split.streamed else 0)
    active = sorted({i for r in split.per_group for i, x in enumerate(r) if x > 0} | {0})
    why = (f"GenEFlow (genetic search, seed {seed}: population {report['population']}, "
           f"{report['generations']} generations, crossover {report['crossover']}, mutation "
           f"{report['mutation']}; {report['evaluations']} splits evaluated in {solve_s:.1f} s): "
           f"{len(split.groups)} fused groups, each its own rows split, over rank(s) "
           f"{', '.join(map(str, active))}, head {split.head}; predicted {lat * 1e3:.1f} ms; "
           + (f"CoEdge's LP plan is predicted {lp_latency * 1e3:.1f} ms" + (
               f", {gain:.1f}% slower" if gain > 0.05 else ", the same")
              if gain is not None else "CoEdge's LP found no split within the caps")
           + (f"; {split.dims.count('channels')} groups split by channels" if split.dims
              else "; every group split by rows")
           + (f"; {sum(split.streamed)} groups' weights streamed from local files"
              if split.streamed else "") + ".")
    return Plan(strategy="bands", world_size=costs.size, ratios={"rows": list(split.ratios)},
                groups=[list(g) for g in split.groups],
                group_ratios=[list(r) for r in split.per_group], head=split.head,
                group_dims=list(split.dims) if split.dims else None,
                group_streamed=list(split.streamed) if split.streamed else None,
                model=config.name, model_shape=config.shape, batch=n,
                counts={"rows": counts(graph.shapes(h, w)[graph.ops[0].output][0], split.ratios)},
                predicted_latency_s=lat,
                predicted={**{k: v for k, v in pred.items() if k != "mem_bytes"}, "input": [h, w],
                           "objective": "latency", "planner": "genetic", "genetic": report,
                           "mem_bytes": pred["mem_bytes"], "mem_caps": caps,
                           "fits_memory": True},
                solve_s=solve_s, explanation=why).validate()
