"""GenEFlow: a genetic search over each operator group's split and each rank's share, for
transformer encoders (`hepti plan --search genetic`), judged by the LP's own cost model.

**Chromosome** (`Genome`). One gene per group of operators that must share a layout, in every
layer: an encoder layer's attention block (QKV GeMM, attention, output projection) and its FFN
block (up, down), so 2 L genes. Within a block the splits are tied: a QKV GeMM split by columns
leaves each rank its heads' columns (ir.LOCAL), which only a per-head attention can read, whose
output only a block-wise projection can read; a token-row split needs token rows all the way.
So a block's gene is its split dimension: token rows (horizontal: weights replicated,
activations gathered where all keys are needed) or its unit (vertical: heads for attention,
columns for the FFN; weights sliced, a Reduce_scatter of partial sums after). Layers may
differ: the assignment then carries "name@i" entries (hepti.graph.lower.split_in) and the
runtime loads each layer's own ranges (hepti.parallel.layers `ranges`). The elementwise
operators (add + LayerNorm) always run on token rows; the embeddings on the primary. The
genome also says whether the weights stay resident or stream from disk (`window`, only with
every block vertical: the runtime streams sliced weights alone). Then the proportions: every
rank's integer count of each split dimension (token rows, heads, FFN columns), shared by the
layers (the runtime has one vector per dimension); the number of parts is the number of ranks
with a nonzero count (a rank with none of any dimension does not take part). "Replicate" in
the issue's sense (every rank computing the whole operator) has no layout in hepti.graph.ir; a
row split with one rank's share at 100% is the nearest, and the search reaches it by moving
counts.

**Fitness**: the predicted latency of the lowered plan (hepti.graph.lower.compress, priced by
hepti.plan.costmodel.evaluate: the very program the LP's candidates are judged by), plus, for a
plan over any rank's memory cap, a constraint-violation term (`PENALTY` x latency x the summed
relative excess over the caps). The plan returned is the best *feasible* one ever evaluated,
so every returned plan respects every cap whatever the penalty's weight.

**Search**: a generational GA with elitism, memetic. Seeds of the first population: the LP
planner's plan (hepti.plan.partition.make_plan, `auto`, same caps) expressed as genes, the LP's
optimum (hepti.plan.search.optimise) for each uniform block structure (rows/rows and heads/cols
are the single-dimension plans; heads/rows and rows/cols the mixed ones), and random genomes
(a random structure, a random subset of ranks, Dirichlet shares). Selection by tournament;
crossover uniform over block genes and per dimension (a child takes each dimension's count
vector from either parent, or their rounded mean); mutation flips a block's gene in one layer
or in all, moves units (a GeMM row tile of 8 rows where it can) between two ranks, drops or
revives a rank, or switches streaming. The first time a block structure appears, the LP
solves its counts once (`learn`, up to `learn_max` structures) and that genome joins the
population: a structure judged with its parent's counts was judged unfairly (one token-row
vector serves every layer; a layer moved to token rows wants other rows). Elitism keeps the
best, so GenEFlow is never worse than its best seed, which includes the LP's plan: never
worse than the LP under the same model. The LP's plan is kept as it is (and returned) when it
puts the primary on another rank, which the genes do not express.

Why seed and learn with the LP rather than evolve counts alone: the LP solves a fixed
structure's proportions exactly (up to whole heads and kernel blocks), so a GA that had to find
them from scratch would mostly rediscover the LP; the GA's own work is the structure (2^(2L)
of them, which no LP enumerates), the participants and the integer steps the LP cannot see
(kernel blocks, size-dependent speeds, memory steps), which `search.polish` only walks greedily.

Deterministic from its seed (numpy's Generator; nothing else draws random numbers, and the
programs and the LP are deterministic). No MPI here.
"""
from __future__ import annotations

import copy
import dataclasses
import math
import time
from dataclasses import dataclass, field

import numpy as np

from hepti.counts import counts as split_counts
from hepti.errors import PlanError
from hepti.graph import lower
from hepti.families import family_graph
from hepti.graph.ir import Graph
from hepti.plan.costmodel import ACTIVE, MemTerm, Program, evaluate
from hepti.plan.planfile import DIMS, Plan, parse_bytes
from hepti.plan.profile import Profile
from hepti.plan.search import Candidate, optimise, stream_budget
from hepti.plan.workloads import with_overhead
from hepti.plan.partition import _finish, _ms, make_plan, memory_caps

ROWS, UNIT = "rows", "unit"  # a block's gene: token rows, or its own unit (heads, FFN columns)
PENALTY = 10.0  # constraint-violation weight: latency x (1 + PENALTY x summed relative excess)
DEFAULTS = dict(population=32, generations=40, crossover=0.9, mutation=0.3, tournament=3,
                elite=2, random_seeds=8, learn_max=100)
ROW_STEP = lower.GEMM_ROW_TILE  # token rows also move a whole GeMM row tile at a time
UNIT_NAMES = {"heads": "heads", "ffn": "columns"}
DEFAULT_DISK_READ_BPS = 100e6  # as hepti.plan.partition assumes when a profile has none


@dataclass(frozen=True)
class Genome:
    """Block genes (`blocks[i]` for the layer template's block `Search.blocks[i]`), the stream
    window (0: weights resident), and each rank's count of every dimension (`counts[k]` for
    DIMS[k], whole units summing to the dimension's total)."""

    blocks: tuple[str, ...]
    window: int
    counts: tuple[tuple[int, ...], ...]


@dataclass
class Result:
    """The search's outcome: the best feasible genome, its candidate, and the run's account."""

    genome: Genome
    candidate: Candidate
    assignment: dict[str, str]
    lp_latency_s: float
    seeds: dict[str, float]  # seed name -> latency (inf: over a cap or not found)
    history: list[float] = field(default_factory=list)  # best feasible latency per generation
    evaluations: int = 0
    settings: dict = field(default_factory=dict)


def blocks_of(graph: Graph) -> tuple[str, ...]:
    """The layer template's blocks that can be split two ways (attention, ffn), in order."""
    return tuple(dict.fromkeys(op.block for op in graph.layer if op.block))


def block_assignment(graph: Graph, blocks: tuple[str, ...], genes: tuple[str, ...]) -> dict[str, str]:
    """Each operator's split for these block genes: a block on ROWS takes the `rows`
    strategy's splits, on UNIT the `tensor` strategy's; operators outside the blocks
    (elementwise, embeddings) the `tensor` strategy's (token rows; the primary). `genes` is one
    per block (every layer alike) or one per block of every layer, layer by layer: then layer
    0's genes make the assignment and a layer whose gene differs gets "name@i" entries
    (hepti.graph.lower.split_in)."""
    rows, unit = lower.assignment(graph, "rows"), lower.assignment(graph, "tensor")
    nb = len(blocks)
    layers = [genes[i:i + nb] for i in range(0, len(genes), nb)]
    first = dict(zip(blocks, layers[0]))
    out = {op.name: (rows if first.get(op.block) == ROWS else unit)[op.name]
           for op in graph.prologue + graph.layer + graph.epilogue}
    for i, lg in enumerate(layers[1:], start=1):
        gene = dict(zip(blocks, lg))
        for op in graph.layer:
            if op.block and gene[op.block] != first[op.block]:
                out[f"{op.name}@{i}"] = (rows if gene[op.block] == ROWS else unit)[op.name]
    return out


def structure_name(blocks: tuple[str, ...], genes: tuple[str, ...], graph: Graph) -> str:
    """'attention by heads, ffn by token rows', or per run of layers alike: 'layers 0-3:
    attention by heads, ffn by token rows; layers 4-11: ...'."""
    units = {op.block: op.unit for op in graph.layer if op.block and op.unit}
    nb = len(blocks)
    layers = [genes[i:i + nb] for i in range(0, len(genes), nb)]

    def one(lg):
        return ", ".join(f"{b} by {UNIT_NAMES.get(units[b], units[b]) if g == UNIT else 'token rows'}"
                         for b, g in zip(blocks, lg))
    if all(lg == layers[0] for lg in layers):
        return one(layers[0])
    runs, a = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[a]:
            runs.append(f"layer{'s' if i - a > 1 else ''} {a}{f'-{i - 1}' if i - a > 1 else ''}: "
                        f"{one(layers[a])}")
            a = i
    return "; ".join(runs)


def assignment_program(graph: Graph, assign: dict[str, str], window: int = 0) -> Program:
    """The cost program of any assignment (what hepti.plan.workloads builds for a strategy's):
    phases cut at the schedule's sync points, weights and activations live per step, the
    allocator's overhead; with a `window`, `stream`'s loads and reads (and, as workloads'
    `stream_program` says, no overhead term)."""
    stream = window > 0
    start, layer, end, repeat = lower.compress(graph, assign, stream=stream)
    dims = lower.totals(graph, assign)
    memory = lower.weight_memory(graph, assign) + lower.program_activations(graph, assign)
    if not stream:
        memory = with_overhead(memory)
        if lower.per_layer(assign):  # the largest layer's slice, read raw while it is packed
            top: dict[str, float] = {}
            for i in range(graph.n_layers):
                sliced, whole = lower.layer_weight_bytes(graph, assign, i)
                for d, b in list(sliced.items()) + [(ACTIVE, whole)]:
                    top[d] = max(top.get(d, 0.0), b)
            memory += [MemTerm("overhead", d, b) for d, b in top.items()]
    prog = Program("mixed", dims, start, layer, end, repeat, memory,
                   integer_dims=tuple(u for u in graph.whole_units if u in dims),
                   n_layers=graph.n_layers)
    if stream:
        prog.stream = lower.stream_reads(graph, assign, window)
    return prog


def strategy_of(genes: tuple[str, ...], window: int) -> str:
    """The plan file's strategy: rows, tensor and stream where the genes are one of those, else
    "mixed" (the plan then carries its `assignment`)."""
    if window:
        return "stream"
    if all(g == ROWS for g in genes):
        return "rows"
    if all(g == UNIT for g in genes):
        return "tensor"
    return "mixed"


class Evolution:
    """The generational loop both searches share (`Search` here, the CNNs'
    hepti.plan.genetic_cnn.CNNSearch): a subclass gives `settings`, `rng`, `score(g)` ->
    (penalised fitness, feasible latency or inf), `random_genome`, `crossover`, `mutate`, and
    may give `learn(g)` (a better genome of the same structure, or None)."""

    def learn(self, g):
        return None

    def _pick(self, pop: list):
        idx = self.rng.integers(len(pop), size=self.settings["tournament"])
        return min((pop[int(i)] for i in idx), key=lambda g: self.score(g)[0])

    # --- the run -----------------------------------------------------------------------------
    def run(self, seeds: dict) -> tuple:
        """Evolve from `seeds` (name -> genome) topped up with random genomes; returns the best
        feasible genome ever evaluated (None if none), each seed's latency, and the best
        feasible latency after each generation."""
        s = self.settings
        pop = list(dict.fromkeys(seeds.values()))
        pop += [self.random_genome() for _ in range(max(s["random_seeds"], s["population"] - len(pop)))]
        pop = pop[:max(s["population"], len(seeds))]
        best = None

        def consider(g) -> None:
            nonlocal best
            lat = self.score(g)[1]
            if lat < math.inf and (best is None or lat < self.score(best)[1]):
                best = g

        for g in pop:
            consider(g)
        history = [self.score(best)[1] if best else math.inf]
        for _ in range(s["generations"]):
            pop.sort(key=lambda g: self.score(g)[0])
            nxt = pop[:s["elite"]]
            while len(nxt) < s["population"]:
                a = self._pick(pop)
                child = self.crossover(a, self._pick(pop)) if self.rng.random() < s["crossover"] else a
                if self.rng.random() < s["mutation"] or child == a:
                    child = self.mutate(child)
                consider(child)
                learned = self.learn(child)
                if learned is not None:
                    consider(learned)
                    if self.score(learned)[0] < self.score(child)[0]:
                        child = learned
                nxt.append(child)
            pop = nxt
            history.append(self.score(best)[1] if best else math.inf)
        return best, {k: self.score(g)[1] for k, g in seeds.items()}, history


class Search(Evolution):
    """One GenEFlow run on a model's graph, a profile and per-rank memory caps."""

    def __init__(self, graph: Graph, profile: Profile, caps: list[float], seed: int = 0,
                 population: int = DEFAULTS["population"], generations: int = DEFAULTS["generations"],
                 crossover: float = DEFAULTS["crossover"], mutation: float = DEFAULTS["mutation"],
                 tournament: int = DEFAULTS["tournament"], elite: int = DEFAULTS["elite"],
                 random_seeds: int = DEFAULTS["random_seeds"], learn_max: int = DEFAULTS["learn_max"]):
        if population < 2 or generations < 0:
            raise PlanError(f"--population {population} must be at least 2 and --generations "
                            f"{generations} at least 0")
        if not (0 <= crossover <= 1 and 0 <= mutation <= 1):
            raise PlanError(f"--crossover {crossover} and --mutation {mutation} are probabilities: "
                            "give values in [0, 1]")
        self.graph, self.caps = graph, list(caps)
        self.N = profile.world_size
        self.profile = profile
        # stream plans read from disk; a profile without a disk speed gets partition's default
        self.stream_profile = copy.deepcopy(profile)
        for dev in self.stream_profile.devices:
            dev.disk_read_Bps = dev.disk_read_Bps or DEFAULT_DISK_READ_BPS
        self.blocks = blocks_of(graph)
        self.L = graph.n_layers
        self.n_genes = self.L * len(self.blocks)  # one per block of every layer
        self.totals = [int(graph.units[d]) for d in DIMS]
        self.settings = dict(seed=seed, population=population, generations=generations,
                             crossover=crossover, mutation=mutation, tournament=tournament,
                             elite=elite, random_seeds=random_seeds, learn_max=learn_max,
                             penalty=PENALTY)
        self.rng = np.random.default_rng(seed)
        self._programs: dict = {}
        self._scores: dict[Genome, tuple[float, float, object]] = {}
        self._learned: dict = {}  # structures the LP has given counts (learn)

    # --- genome -> program, prediction, fitness ----------------------------------------------
    def program(self, genes: tuple[str, ...], window: int) -> Program:
        key = (genes, window)
        if key not in self._programs:
            assign = block_assignment(self.graph, self.blocks, genes)
            self._programs[key] = (assignment_program(self.graph, assign, window), assign)
        return self._programs[key][0]

    def score(self, g: Genome) -> tuple[float, float, object]:
        """(fitness, latency if every cap holds else inf, prediction), memoised."""
        if g not in self._scores:
            prog = self.program(g.blocks, g.window)
            cnt = {d: [float(c) for c in g.counts[k]] for k, d in enumerate(DIMS) if d in prog.totals}
            if prog.stream is not None:
                prog.stream.budget = stream_budget(prog, cnt)
            pred = evaluate(prog, cnt, self.stream_profile if g.window else self.profile)
            excess = sum(max(0.0, r.mem_bytes / self.caps[r.rank] - 1.0)
                         for r in pred.per_rank if r.active)
            fit = pred.latency_s * (1.0 + PENALTY * excess) + (pred.latency_s if excess else 0.0)
            self._scores[g] = (fit, pred.latency_s if excess == 0 else math.inf, pred)
        return self._scores[g]

    def candidate(self, g: Genome) -> Candidate:
        prog = copy.deepcopy(self.program(g.blocks, g.window))
        cnt = {d: [float(c) for c in g.counts[k]] for k, d in enumerate(DIMS) if d in prog.totals}
        pred = self.score(g)[2]
        c = Candidate(strategy_of(g.blocks, g.window), cnt, pred, prog, pred.latency_s)
        if prog.stream is not None:
            prog.stream.budget = stream_budget(prog, cnt)
            c.mem_budget = int(prog.stream.budget)
            c.extra["window"] = g.window
        return c

    # --- genomes from plans and candidates ---------------------------------------------------
    def _full_counts(self, cnt: dict[str, list[float]]) -> tuple[tuple[int, ...], ...]:
        """Counts of every dimension: those given, and the others split like token rows (or
        like the first given) so that a later flip of a block gene starts from a sensible share."""
        like = cnt.get("rows") or next(iter(cnt.values()))
        out = []
        for d, total in zip(DIMS, self.totals):
            v = cnt.get(d)
            out.append(tuple(int(round(x)) for x in v) if v is not None
                       else tuple(split_counts(total, [max(x, 0.0) for x in like])))
        return tuple(out)

    def genome_of(self, genes: tuple[str, ...], window: int, cnt: dict[str, list[float]]) -> Genome:
        return Genome(genes, window, self._full_counts(cnt))

    def genome_of_plan(self, plan: Plan) -> Genome | None:
        """The LP planner's plan as genes, or None for what they cannot express (pipeline, a
        primary other than rank 0)."""
        if plan.primary != 0 or plan.strategy not in ("rows", "tensor", "single", "stream", "even"):
            return None
        genes = tuple(ROWS if plan.strategy == "rows" else UNIT for _ in range(self.n_genes))
        window = int(plan.predicted.get("window", 0) or 0) if plan.strategy == "stream" else 0
        if plan.strategy == "stream" and not window:
            return None
        return Genome(genes, window, tuple(tuple(int(x) for x in plan.counts[d]) for d in DIMS))

    def random_genome(self) -> Genome:
        layer = [str(self.rng.choice([ROWS, UNIT])) for _ in self.blocks]
        genes = tuple(layer * self.L)  # every layer alike; mutation makes them differ
        members = [0] + [i for i in range(1, self.N) if self.rng.random() < 0.6]
        out = []
        for total in self.totals:
            share = np.zeros(self.N)
            share[members] = self.rng.dirichlet(np.ones(len(members)))
            out.append(tuple(split_counts(total, share.tolist())))
        return Genome(genes, 0, tuple(out))

    # --- variation ---------------------------------------------------------------------------
    def _valid(self, g: Genome) -> Genome:
        """Streaming needs both blocks vertical (the runtime streams sliced weights only)."""
        if g.window and any(x != UNIT for x in g.blocks):
            return dataclasses.replace(g, window=0)
        return g

    def crossover(self, a: Genome, b: Genome) -> Genome:
        rng = self.rng
        genes = tuple(x if rng.random() < 0.5 else y for x, y in zip(a.blocks, b.blocks))
        window = a.window if rng.random() < 0.5 else b.window
        out = []
        for k, total in enumerate(self.totals):
            r = rng.random()
            if r < 0.4:
                out.append(a.counts[k])
            elif r < 0.8:
                out.append(b.counts[k])
            else:  # the mean share, rounded by the largest remainder
                mean = [(x + y) / 2 for x, y in zip(a.counts[k], b.counts[k])]
                out.append(tuple(split_counts(total, mean)))
        return self._valid(Genome(genes, window, tuple(out)))

    def mutate(self, g: Genome) -> Genome:
        rng = self.rng
        genes, window = list(g.blocks), g.window
        cnt = [list(c) for c in g.counts]
        kind = rng.random()
        if kind < 0.08:  # flip one block's split dimension in every layer
            b = int(rng.integers(len(self.blocks)))
            new = ROWS if genes[b] == UNIT else UNIT
            for i in range(b, len(genes), len(self.blocks)):
                genes[i] = new
        elif kind < 0.15:  # flip one block's split dimension in one layer
            i = int(rng.integers(len(genes)))
            genes[i] = ROWS if genes[i] == UNIT else UNIT
        elif kind < 0.22:  # resident <-> streamed (window 2, else 1)
            window = 0 if window else int(rng.choice([1, 2]))
        elif kind < 0.32 and self.N > 1:  # drop a rank (its units to the others) or revive one
            i = int(rng.integers(1, self.N))
            if any(c[i] for c in cnt):
                for k, total in enumerate(self.totals):
                    rest = [x if j != i else 0 for j, x in enumerate(cnt[k])]
                    cnt[k] = split_counts(total, rest) if sum(rest) else cnt[k]
            else:
                for k, total in enumerate(self.totals):
                    n = max(1, int(total * rng.uniform(0.02, 0.2)))
                    donor = int(np.argmax(cnt[k]))
                    n = min(n, cnt[k][donor])
                    cnt[k][donor] -= n
                    cnt[k][i] += n
        else:  # move units of one dimension between two ranks
            k = int(rng.integers(len(self.totals)))
            src = [j for j in range(self.N) if cnt[k][j] > 0]
            if src and self.N > 1:
                s = int(rng.choice(src))
                d = int(rng.choice([j for j in range(self.N) if j != s]))
                total = self.totals[k]
                step = ROW_STEP if DIMS[k] == "rows" and rng.random() < 0.5 else 1
                n = max(1, int(abs(rng.normal(0, 0.05)) * total)) if rng.random() < 0.5 else step
                n = min(n, cnt[k][s])
                cnt[k][s] -= n
                cnt[k][d] += n
        return self._valid(Genome(tuple(genes), window, tuple(tuple(c) for c in cnt)))

    def learn(self, g: Genome) -> Genome | None:
        """The LP's counts for a block structure the search meets for the first time (at most
        `learn_max` structures a run; None otherwise): the genome with those counts. A new
        structure with its parent's counts is judged unfairly (one token-row vector serves
        every layer, and a layer moved to token rows wants other rows than its neighbours),
        so each gets the LP's best counts once: a memetic (Lamarckian) step, cached by
        structure."""
        key = (g.blocks, g.window)
        if key in self._learned or len(self._learned) >= self.settings["learn_max"] or g.window:
            return None
        prog = copy.deepcopy(self.program(g.blocks, 0))
        cand = optimise(prog, self.profile, self.caps)
        self._learned[key] = cand is not None
        return None if cand is None else self.genome_of(g.blocks, 0, cand.counts)

def genetic_search(cfg, profile: Profile, seq_len: int, batch: int = 1,
                   mem_budget: float | None = None, seed: int = 0, lp_plan: Plan | None = None,
                   **settings) -> Result:
    """GenEFlow for `batch` inputs of `seq_len` tokens on the profiled devices, each rank's
    memory capped by its profile and `mem_budget` (bytes). `lp_plan`: the LP planner's plan
    under the same caps (made here if not given). Raises PlanError if no plan fits."""
    t0 = time.perf_counter()
    graph = family_graph(cfg, batch, seq_len)
    caps = memory_caps(profile, mem_budget)
    search = Search(graph, profile, caps, seed, **settings)
    if lp_plan is None:
        try:
            lp_plan = make_plan(cfg, profile, seq_len, batch, "auto", mem_budget=mem_budget)
        except PlanError:
            lp_plan = None  # nothing the LP knows fits: the search may still find nothing either
    if lp_plan is not None and not lp_plan.predicted.get("fits_memory", True):
        lp_plan = None
    seeds: dict[str, Genome] = {}
    if lp_plan is not None:
        g = search.genome_of_plan(lp_plan)
        if g is not None:
            seeds["lp plan"] = g
    t_lp = time.perf_counter()
    for layer in _structures(len(search.blocks)):
        genes = layer * search.L
        prog = search.program(genes, 0)
        cand = optimise(copy.deepcopy(prog), profile, caps)
        if cand is not None:
            seeds[f"lp {structure_name(search.blocks, layer, graph)}"] = search.genome_of(genes, 0, cand.counts)
    lp_structures_s = time.perf_counter() - t_lp
    for g in seeds.values():  # the LP has solved these structures already
        search._learned[(g.blocks, g.window)] = True
    best, seed_lat, history = search.run(seeds)
    if best is not None and any(g != best.blocks[i % len(search.blocks)]
                                for i, g in enumerate(best.blocks)) and not best.window:
        # layers split differently: the LP's counts for that structure, if better (memetic)
        cand = optimise(copy.deepcopy(search.program(best.blocks, 0)), profile, caps)
        if cand is not None:
            refined = search.genome_of(best.blocks, 0, cand.counts)
            if search.score(refined)[1] < search.score(best)[1]:
                best = refined
                history.append(search.score(best)[1])
    lp_lat = lp_plan.predicted_latency_s if lp_plan is not None else math.inf
    if best is None:
        raise PlanError(_infeasible(search, caps))
    cand = search.candidate(best)
    assign = block_assignment(graph, search.blocks, best.blocks)
    res = Result(best, cand, assign, lp_lat, seed_lat, history, len(search._scores),
                 dict(search.settings, lp_structures_s=lp_structures_s,
                      search_s=time.perf_counter() - t0, operators=_operators(graph)))
    res.settings["lp_plan"] = lp_plan
    return res


def single_device_peak(cfg, profile: Profile, seq_len: int, batch: int = 1) -> float:
    """Bytes the whole model takes on one device (rank 0 alone: every weight, the embeddings,
    the activations and the allocator's overhead, as the cost model counts them): what
    `--mem-cap 75%` is a fraction of."""
    graph = family_graph(cfg, batch, seq_len)
    genes = tuple(UNIT for _ in blocks_of(graph))
    prog = assignment_program(graph, block_assignment(graph, blocks_of(graph), genes))  # noqa
    one = dataclasses.replace(profile, devices=profile.devices[:1])
    pred = evaluate(prog, {d: [float(t)] for d, t in prog.totals.items()}, one)
    return pred.per_rank[0].mem_bytes


def parse_mem_cap(text: str, peak) -> float:
    """`--mem-cap`: a size ("300MiB", "4e8") or a percentage of the single-device peak
    ("75%": `peak()`, called only then), as bytes every rank may use at most."""
    t = str(text).strip()
    if t.endswith("%"):
        try:
            frac = float(t[:-1]) / 100
        except ValueError:
            raise PlanError(f"--mem-cap {text!r}: not a percentage; write e.g. 75%") from None
        if not 0 < frac:
            raise PlanError(f"--mem-cap {text!r} must be a positive percentage, e.g. 75%")
        return frac * peak()
    return float(parse_bytes(t, "--mem-cap"))


def _structures(n: int) -> list[tuple[str, ...]]:
    """Every combination of block genes (2^n: four for an encoder layer's two blocks)."""
    out = [()]
    for _ in range(n):
        out = [o + (x,) for o in out for x in (ROWS, UNIT)]
    return out


def _operators(graph: Graph) -> int:
    """Operators in the unrolled model (the size the issue's search-time target counts)."""
    return len(graph.prologue) + graph.n_layers * len(graph.layer) + len(graph.epilogue)


def _infeasible(search: Search, caps: list[float]) -> str:
    """Why nothing fits: the least memory any evaluated plan needed on its fullest rank."""
    def fullest(g: Genome) -> float:
        return max(r.mem_bytes / caps[r.rank] for r in search.score(g)[2].per_rank if r.active)

    mib = lambda b: f"{b / 2**20:,.0f} MiB"  # noqa: E731
    if not search._scores:
        return f"no plan fits a memory cap of {mib(min(caps))} per rank"
    g = min(search._scores, key=fullest)
    pred = search.score(g)[2]
    worst = max((r for r in pred.per_rank if r.active), key=lambda r: r.mem_bytes / caps[r.rank])
    return (f"no plan fits the memory caps: the leanest of {len(search._scores)} plans searched "
            f"(any split, any shares, streaming included) still needs {mib(worst.mem_bytes)} on "
            f"rank {worst.rank}, which may use {mib(caps[worst.rank])}; raise --mem-cap (or "
            f"--mem-budget) towards {mib(worst.mem_bytes)}, add devices, or use shorter "
            f"inputs")


def make_genetic_plan(cfg, profile: Profile, seq_len: int, batch: int = 1,
                      mem_budget: float | None = None, seed: int = 0, lp_plan: Plan | None = None,
                      **settings) -> Plan:
    """`hepti plan --search genetic`: the GenEFlow plan as a plan file, its search reported in
    `predicted["genetic"]` and in the explanation. Returns the LP's plan itself where the LP's
    is faster (it moved the primary, which the genes cannot express). `lp_plan`: the LP's plan
    for the same caps, if already made (a benchmark's seeds share it)."""
    res = genetic_search(cfg, profile, seq_len, batch, mem_budget, seed, copy.deepcopy(lp_plan),
                         **settings)
    lp_plan = res.settings.pop("lp_plan")
    s = res.settings
    cand = res.candidate
    graph = family_graph(cfg, batch, seq_len)
    gained = (1 - cand.latency_s / res.lp_latency_s) * 100 if res.lp_latency_s < math.inf else None
    report = {k: s[k] for k in ("seed", "population", "generations", "crossover", "mutation",
                                "tournament", "elite", "random_seeds", "learn_max", "penalty")}
    report.update(evaluations=res.evaluations, operators=s["operators"],
                  search_s=s["search_s"], lp_latency_s=res.lp_latency_s if gained is not None else None,
                  gain_vs_lp=gained, seeds_s=res.seeds, history_s=res.history,
                  structure=structure_name(blocks_of(graph), res.genome.blocks, graph),
                  window=res.genome.window)
    if lp_plan is not None and res.lp_latency_s <= cand.latency_s * (1 - 1e-12) and \
            (lp_plan.primary != 0 or lp_plan.strategy == "pipeline"):
        lp_plan.predicted["genetic"] = dict(report, returned="lp plan")
        lp_plan.explanation += (f" GenEFlow (seed {s['seed']}) found nothing faster than this LP "
                                f"plan ({_ms(cand.latency_s)} at best).")
        return lp_plan
    vs = (f"the LP's plan ({lp_plan.strategy}) is predicted {_ms(res.lp_latency_s)}, "
          + (f"{gained:.1f}% slower" if gained and gained > 0.05 else "the same")
          if lp_plan is not None else "the LP planner found no plan within the caps")
    why = (f"GenEFlow (genetic search, seed {s['seed']}: population {s['population']}, "
           f"{s['generations']} generations, crossover {s['crossover']}, mutation "
           f"{s['mutation']}; {res.evaluations} plans evaluated in {s['search_s']:.1f} s): "
           f"{report['structure']}" + (f", weights streamed (window {res.genome.window})"
                                      if res.genome.window else "")
           + f", predicted {_ms(cand.latency_s)}; {vs}.")
    plan = _finish(cand, cfg, batch, seq_len, profile, memory_caps(profile, mem_budget), why,
                   s["search_s"], {"planner": "genetic", "genetic": dict(report, returned="genetic")})
    if plan.strategy == "mixed":
        plan.assignment = dict(res.assignment)
        plan.predicted["genetic"]["whole_units"] = sorted(
            {"heads", "ffn"} - lower.sliced_units(graph, res.assignment))
    return plan
