"""Plans for a decoder (issue 46): `single`, `tensor` and `pipeline`, compared by their programs.

A generation request is a prefill of the prompt's P tokens and D - 1 decode steps (the first new
token comes from the prefill). Each strategy is priced from the decoder's cost programs
(hepti.graph.decoder) by the cost model (hepti.plan.costmodel.evaluate) on a profile:

- `single` on each device alone (the whole model, its own profile of one);
- `tensor`: KV heads, MLP columns and vocabulary rows by ratio vectors, as
  hepti.parallel.decoder runs it. The ratios are the best of a small search, not an LP: MLP
  and vocabulary shares equal, by GeMV bytes/s (decode is bandwidth-bound), mixes of the two,
  and for two ranks a grid of rank 0's share in steps of 0.05; with each, every split of the
  whole KV heads (`head_splits`). Whole KV heads make the LP a MILP whose one coarse dimension
  the search enumerates; the plan's notes say "search";
- `pipeline`: contiguous layer ranges in rank order, ranges by GeMV bytes/s (PipeEdge's
  balance), as hepti.parallel.decoder_pipeline runs it: rank 0 embeds, the hidden rows go
  through every rank that holds layers in turn (`pipeline_hops`: [T, C] a hop), the last row
  comes back to rank 0, which holds the final norm and the tied head, and rank 0 sends the
  chosen token to the group. A step costs the sum of the stages' compute, priced from the
  same programs' phases (a stage runs its layers' Work on every unit), plus those transfers.

What a step costs beyond its bytes and FLOPs comes from the profile (docs/generate.md,
"Plans"): each of a layer's calls at `call_overhead_s`, and the collectives scaled by the
profile's calibration of them (the decode step's one-row allreduce and greedy's allgather,
timed through the verbs on the ranks at once); a profile without that calibration is priced
from the link model alone, and the plan's notes say so. `tensor`'s decode step of n ranks
prices its 2L + 2 syncs as the profile's `decode_syncs` measured a group of n meet them
(`measured_syncs_s`), where it has them: S(n) seconds each, and J(n) of its phases' compute,
since a phase of the cost model ends when the slowest rank's mean compute does, but a sync
ends when the last rank arrives, and a rank's GeMVs vary from call to call (on emu-equal2 the
syncs took 1.2-2.3 ms where the allreduce after a barrier takes 0.3, and llama-1b int8 was
priced at 0.76 of the speed it ran; docs/results/llm.md). Prefill's few syncs after long GeMMs
are left as they were.

The request's cost is prefill + (D - 1) decode steps, each at the longest context (P + D
tokens: an upper bound). Memory per rank: its weights and its KV heads' cache for the request's
context (the programs' memory terms) against the device's usable bytes; a candidate that does
not fit says which rank and by how much, and if none fits the plan fails with that.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace

from hepti.counts import counts
from hepti.errors import InputError, PlanError
from hepti.graph.decoder import F32, decode_program, int8_bytes, prefill_program
from hepti.graph.program import Program
from hepti.plan.costmodel import evaluate, held_bytes
from hepti.plan.pipeline import transfer
from hepti.plan.profile import Profile
from hepti.plan.workloads import with_overhead

NOT_RANK0 = "the executor runs single on rank 0"
GRID_STEP = 0.05  # two ranks: rank 0's share in these steps
MIX = (0.25, 0.5, 0.75)  # mixes of equal and bandwidth-proportional shares
MAX_HEAD_SPLITS = 64  # KV-head splits tried with each share vector (`head_splits`)
TOKEN_BYTES = 8  # pipeline: the chosen token (int64), from rank 0 to the rest of the group
SYNCS_KEY = "decode_syncs"  # the profile's (hepti.parallel.profile_links measures it)


@dataclass
class Request:
    """What is generated: prompt tokens, new tokens, and the KV cache's context."""

    prompt: int
    max_tokens: int
    ctx: int | None = None  # default prompt + max_tokens

    def check(self, config) -> "Request":
        """InputError unless the context holds the prompt and the new tokens and the model's
        context holds it."""
        if self.prompt < 1 or self.max_tokens < 1:
            raise InputError(f"a request needs a prompt and new tokens; got {self.prompt} and "
                             f"{self.max_tokens}")
        if self.ctx is not None and self.ctx < self.prompt + self.max_tokens:
            raise InputError(f"--ctx {self.ctx} is shorter than the prompt ({self.prompt}) and "
                             f"--max-tokens ({self.max_tokens}); give at least "
                             f"{self.prompt + self.max_tokens} or leave --ctx out")
        if self.context > config.max_position_embeddings:
            raise InputError(f"a context of {self.context} tokens is over the model's "
                             f"{config.max_position_embeddings}; ask for fewer tokens")
        return self

    @property
    def context(self) -> int:
        return self.ctx or self.prompt + self.max_tokens


@dataclass
class Candidate:
    """One strategy's prediction for the request."""

    strategy: str
    label: str  # "single on rank 0", "tensor 0.6/0.4", "pipeline 20/10 layers"
    prefill_s: float
    decode_s: float  # one decode step
    mem: list[float]  # bytes per rank (0: not taking part)
    usable: list[float]
    ratios: dict[str, list[float]] | None = None
    rank: int | None = None
    layers: list[int] | None = None
    why_not: str = ""  # why it is shown but cannot be chosen ("" if it can)

    @property
    def runnable(self) -> bool:
        return not self.why_not

    def total_s(self, req: Request) -> float:
        return self.prefill_s + (req.max_tokens - 1) * self.decode_s

    @property
    def tokens_per_s(self) -> float:
        return 1.0 / self.decode_s if self.decode_s > 0 else float("inf")

    @property
    def short(self) -> tuple[int, float] | None:
        """(rank, bytes) of the rank furthest over its memory, or None if every rank fits."""
        over = [(m - u, i) for i, (m, u) in enumerate(zip(self.mem, self.usable)) if m > u]
        if not over:
            return None
        b, i = max(over)
        return i, b

    def to_dict(self, req: Request) -> dict:
        return {"strategy": self.strategy, "label": self.label, "prefill_s": self.prefill_s,
                "decode_s": self.decode_s, "decode_tokens_per_s": self.tokens_per_s,
                "request_s": self.total_s(req), "mem_bytes": self.mem, "ratios": self.ratios,
                "rank": self.rank, "layers": self.layers, "runnable": self.runnable,
                "why_not": self.why_not or None, "fits": self.short is None}


@dataclass
class DecoderPlan:
    """The candidates compared and the one chosen (a runnable one that fits, fastest request)."""

    request: Request
    candidates: list[Candidate]
    chosen: Candidate
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        c = self.chosen
        return {"hepti_decoder_plan": 1, "strategy": c.strategy, "ratios": c.ratios,
                "rank": c.rank, "layers": c.layers, "request": {"prompt": self.request.prompt,
                                            "max_tokens": self.request.max_tokens,
                                            "ctx": self.request.context},
                "candidates": [x.to_dict(self.request) for x in self.candidates],
                "notes": list(self.notes)}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        """The comparison, one candidate a line, and the choice."""
        req = self.request
        lines = [f"decoder plan for a prompt of {req.prompt} tokens, {req.max_tokens} new, "
                 f"KV cache for {req.context} tokens:"]
        for c in self.candidates:
            tail = ""
            if c.short is not None:
                r, b = c.short
                tail = f"  (does not fit: rank {r} needs {b / 2**20:.1f} MiB more)"
            elif not c.runnable:
                tail = f"  ({c.why_not})"
            lines.append(f"  {c.label}: {c.tokens_per_s:.1f} tok/s predicted, prefill "
                         f"{c.prefill_s * 1e3:.1f} ms, request {c.total_s(req):.2f} s, memory "
                         f"{'/'.join(f'{m / 2**20:.0f}' for m in c.mem)} MiB{tail}")
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"-> {self.chosen.strategy}" + (f" ({self.chosen.label})"
                                                      if self.chosen.strategy != "tensor"
                                                      else self.chosen.label[6:]))
        return "\n".join(lines)


def weight_bytes_of(index: dict) -> float:
    """Bytes a stored weight value of a model folder takes, from its index (hepti.weights.index):
    4 (float32), or for an int8 folder the mean over its matrices (2-D tensors) of their stored
    bytes a value: int8 with its group's share of a float32 scale, float32 for a matrix kept
    so (`hepti convert --keep-float32`, each group as recorded), weighted by size."""
    if index.get("dtype") != "int8":
        return F32
    total = values = 0.0
    for t in index.get("tensors", {}).values():
        shape = t.get("shape", [])
        if len(shape) != 2:
            continue
        n = float(shape[0]) * float(shape[1])
        values += n
        total += n * (int8_bytes(t.get("group") or 64) if t.get("dtype") == "int8" else F32)
    return total / values if values else F32


def tensor_counts(config, ratios: dict[str, list[float]], rows: int) -> dict[str, list[float]]:
    """The programs' counts from the executor's ratio vectors (hepti.parallel.decoder.shards:
    vocabulary rows by the `ffn` vector)."""
    out = {"heads": counts(config.num_key_value_heads, ratios["heads"]),
           "ffn": counts(config.intermediate_size, ratios["ffn"]),
           "vocab": counts(config.vocab_size, ratios["ffn"]),
           "rows": counts(rows, ratios["rows"])}
    return {d: [float(x) for x in v] for d, v in out.items()}


def _programs(config, req: Request, wb: float) -> tuple[Program, Program]:
    """The request's prefill and decode programs, their memory with the encoders' allocation
    overhead (`with_overhead`: what the heap keeps of the load, and one layer read raw while it
    is packed). Without it a plan filled emu-mixed4's 400 MiB boards with an int8 llama-1b
    quarter the program counted at 265 MiB, which peaked at 490 MiB and was OOM-killed."""
    pre = prefill_program(config, req.prompt, req.context, wb)
    dec = decode_program(config, req.context, wb)
    return (replace(pre, memory=with_overhead(pre.memory)),
            replace(dec, memory=with_overhead(dec.memory)))


def _usable(profile: Profile) -> list[float]:
    return [d.usable_bytes for d in profile.devices]


def sync_figures(profile: Profile) -> dict[str, list[float]] | None:
    """The profile's `decode_syncs` (hepti.parallel.profile_links
    `calibrate_decoder_collectives`): {"jitter": [J(1), ..., J(N)], "seconds": [S(1), ...,
    S(N)]} for a group of n ranks, rank 0 with its fastest others; None if not measured (or
    not two equal lists of non-negative numbers)."""
    v = profile.extra.get(SYNCS_KEY)
    if not isinstance(v, dict):
        return None
    out = {}
    for k in ("jitter", "seconds"):
        x = v.get(k)
        if not isinstance(x, list) or not x or not all(
                isinstance(y, (int, float)) and not isinstance(y, bool) and math.isfinite(y)
                and y >= 0 for y in x):
            return None
        out[k] = [float(y) for y in x]
    return out if len(out["jitter"]) == len(out["seconds"]) else None


def decode_syncs(config) -> int:
    """A decode step's syncs on a group of more than one (the decode program's collectives):
    the embedding's allreduce, two a layer, and greedy's allgather."""
    return 2 * config.num_hidden_layers + 2


def measured_syncs_s(config, profile: Profile, prediction, group: int) -> float | None:
    """Seconds a decode step of `group` ranks spends at its syncs as the profile measured a
    group of that size meet them: its 2L + 2 syncs at S(group) each, and J(group) of every
    phase's compute (the slowest rank's), which the cost model's phases do not hold (every sync
    waits for the last rank to arrive); None for a group of one or without the figures."""
    f = sync_figures(profile)
    if group < 2 or f is None:
        return None
    n = min(group, len(f["jitter"])) - 1
    compute = sum(ph["times"] * ph["compute_s"] for ph in prediction.phases)
    return decode_syncs(config) * f["seconds"][n] + f["jitter"][n] * compute


def evaluate_tensor(config, profile: Profile, req: Request, ratios: dict[str, list[float]],
                    wb: float = F32, label: str | None = None) -> Candidate:
    """`tensor` with these ratio vectors. With more than one rank taking part, its decode
    step's syncs are priced as the profile measured a group of that size meet them
    (`measured_syncs_s`) in place of the cost model's collectives, if it did (module
    docstring)."""
    pre, dec = _programs(config, req, wb)
    cnt = tensor_counts(config, ratios, req.prompt)
    p = evaluate(pre, {d: cnt[d] for d in pre.totals}, profile)
    d = evaluate(dec, {k: cnt[k] for k in dec.totals}, profile)
    mem = [r.mem_bytes for r in d.per_rank]  # decode's memory: the whole context's cache
    share = "/".join(f"{x:.2f}".rstrip("0").rstrip(".") for x in ratios["ffn"])
    heads = "/".join(str(int(h)) for h in cnt["heads"])
    decode_s = d.latency_s
    syncs = measured_syncs_s(config, profile, d, sum(1 for r in d.per_rank if r.active))
    if syncs is not None:
        decode_s += syncs - sum(ph["times"] * ph["comm_s"] for ph in d.phases)
    return Candidate("tensor", label or f"tensor {share} (KV heads {heads})", p.latency_s,
                     decode_s, mem, _usable(profile), ratios=ratios)


def _alone(profile: Profile, rank: int) -> Profile:
    """A profile of device `rank` alone (as rank 0)."""
    return replace(profile, devices=[replace(profile.devices[rank], rank=0)])


def _whole(program: Program) -> dict[str, list[float]]:
    return {d: [float(n)] for d, n in program.totals.items()}


def evaluate_single(config, profile: Profile, req: Request, rank: int, wb: float = F32
                    ) -> Candidate:
    """The whole model on device `rank` alone."""
    pre, dec = _programs(config, req, wb)
    one = _alone(profile, rank)
    p, d = evaluate(pre, _whole(pre), one), evaluate(dec, _whole(dec), one)
    mem = [0.0] * profile.world_size
    mem[rank] = d.per_rank[0].mem_bytes
    return Candidate("single", f"single on rank {rank}", p.latency_s, d.latency_s, mem,
                     _usable(profile), rank=rank, why_not=NOT_RANK0 if rank else "")


def _stage_seconds(program: Program, dev, first: bool, last: bool, n_layers: int) -> float:
    """A pipeline stage's compute: its layers' phases on every unit, the start phases (the
    embedding) if `first`, the end phases (the head) if `last`: both on rank 0."""
    def run(phases):
        return sum(w.seconds(dev, program.totals[w.dim]) for p in phases for w in p.works)
    return ((run(program.start) if first else 0.0) + n_layers * run(program.layer)
            + (run(program.end) if last else 0.0))


def _stage_memory(program: Program, n_layers: int, rank0: bool) -> float:
    """Bytes a stage holds: its layers' weights and cache on every unit, and on rank 0 the
    vocabulary (the embedding, which is the tied head)."""
    layer_terms = [t for t in program.memory if t.per_layer]
    whole = {d: float(n) for d, n in program.totals.items()}
    mem = sum(held_bytes(layer_terms, whole, False, n_layers).values())
    vocab = sum(held_bytes([t for t in program.memory if not t.per_layer], whole, True, 0).values())
    return mem + (vocab if rank0 else 0.0)


def pipeline_path(layers: list[int]) -> list[int]:
    """The ranks a forward's hidden rows pass through, in order: rank 0 (it embeds), then every
    other rank that holds layers, in rank order; a rank of 0 layers but rank 0 is skipped."""
    return [0] + [r for r, n in enumerate(layers) if n > 0 and r != 0]


def pipeline_hops(layers: list[int], rows: int, hidden: int) -> list[tuple[int, int, float]]:
    """(from rank, to rank, bytes) of one forward of `rows` tokens, in the order they run: the
    [rows, C] float32 hidden state from each rank of the path to the next, then the last row
    back to rank 0 for the final norm and the tied head (none if rank 0 holds every layer)."""
    path = pipeline_path(layers)
    hops = [(j, k, rows * hidden * F32) for j, k in zip(path, path[1:])]
    if path[-1] != 0:
        hops.append((path[-1], 0, hidden * F32))
    return hops


def evaluate_pipeline(config, profile: Profile, req: Request, layers: list[int], wb: float = F32
                      ) -> Candidate:
    """Layers in ranges in rank order, `layers[i]` on rank i (zeros skip a rank)."""
    pre, dec = _programs(config, req, wb)
    path = pipeline_path(layers)

    def step(program: Program, rows: int) -> float:
        t = sum(_stage_seconds(program, profile.devices[r], r == 0, r == 0, layers[r])
                for r in path)
        t += sum(transfer(profile, j, k, b, 0)
                 for j, k, b in pipeline_hops(layers, rows, config.hidden_size))
        return t + max((transfer(profile, 0, r, TOKEN_BYTES, 0) for r in path), default=0.0)

    mem = [_stage_memory(dec, layers[i], i == 0) if i in path else 0.0
           for i in range(profile.world_size)]
    return Candidate("pipeline", f"pipeline {'/'.join(map(str, layers))} layers",
                     step(pre, req.prompt), step(dec, 1), mem, _usable(profile),
                     layers=list(layers))


def _norm(v: list[float]) -> list[float]:
    s = sum(v)
    return [x / s for x in v]


def tensor_ratio_candidates(profile: Profile, int8: bool = False) -> list[list[float]]:
    """The shares `tensor` is searched over (module docstring): over every rank, and over
    rank 0 with the k fastest others (k = 1 .. N-2), the rest at 0. A rank of no share leaves
    the group (hepti.parallel.decoder.group_members) and with it its link from every one of a token's
    1 + 2L syncs: on emu-mixed4 the two 0.15-core boards behind 240 and 100 Mbit/s links slow
    llama-1b's decode more than their compute speeds it."""
    N = profile.world_size
    rate = [d.gemv_bytes_per_s(int8) for d in profile.devices]
    by_speed = sorted(range(1, N), key=lambda i: -rate[i])
    out = []
    for k in range(N - 1, 0, -1):  # every rank first, then fewer
        kept = [0] + by_speed[:k]
        even = [1.0 / len(kept) if i in kept else 0.0 for i in range(N)]
        prop = _norm([rate[i] if i in kept else 0.0 for i in range(N)])
        out += [even, prop] + [_norm([(1 - a) * e + a * p for e, p in zip(even, prop)])
                               for a in MIX]
    if N == 2:
        k = round(1 / GRID_STEP)
        out += [[i / k, 1 - i / k] for i in range(1, k)]
    seen, uniq = set(), []
    for r in out:
        key = tuple(round(x, 6) for x in r)
        if key not in seen:
            seen.add(key)
            uniq.append(r)
    return uniq


def _compositions(total: int, parts: int):
    """Every way of writing `total` as `parts` non-negative integers, in order."""
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in _compositions(total - first, parts - 1):
            yield (first, *rest)


def head_splits(kv_heads: int, ratios: list[float]) -> list[list[float]]:
    """KV-head shares to try with MLP and vocabulary shares `ratios`: the heads are few and
    whole (SmolLM2: 3), so the split that follows `ratios` may be far from it, and another may
    balance better; every split of the heads into the ranks (at most MAX_HEAD_SPLITS of them;
    past that, only `ratios` itself)."""
    n = len(ratios)
    if math.comb(kv_heads + n - 1, n - 1) > MAX_HEAD_SPLITS:
        return [list(ratios)]
    return [[c / kv_heads for c in split] for split in _compositions(kv_heads, n)]


def _pipeline_layers(config, profile: Profile, int8: bool) -> list[int]:
    return counts(config.num_hidden_layers, [d.gemv_bytes_per_s(int8) for d in profile.devices])


def candidates(config, profile: Profile, req: Request, wb: float = F32,
               strategies=("single", "tensor", "pipeline")) -> list[Candidate]:
    """Every strategy's candidates: single on each device, tensor's searched shares (the best
    that fits, else the best), pipeline's ranges (with more than one rank)."""
    int8 = wb != F32
    out: list[Candidate] = []
    if "single" in strategies:
        out += [evaluate_single(config, profile, req, r, wb) for r in range(profile.world_size)]
    if profile.world_size > 1 and "tensor" in strategies:
        tried = [evaluate_tensor(config, profile, req, {"heads": h, "ffn": r, "rows": r}, wb)
                 for r in tensor_ratio_candidates(profile, int8)
                 for h in head_splits(config.num_key_value_heads, r)]
        fit = [c for c in tried if c.short is None] or tried
        out.append(min(fit, key=lambda c: c.total_s(req)))
    if profile.world_size > 1 and "pipeline" in strategies:
        out.append(evaluate_pipeline(config, profile, req, _pipeline_layers(config, profile, int8),
                                     wb))
    return out


def choose(cands: list[Candidate], req: Request) -> Candidate:
    """The runnable candidate that fits with the fastest request; PlanError if none fits,
    naming each one's rank short of memory and by how much."""
    ok = [c for c in cands if c.runnable and c.short is None]
    if ok:
        return min(ok, key=lambda c: c.total_s(req))
    why = "; ".join(f"{c.label}: rank {c.short[0]} short by {c.short[1] / 2**20:.1f} MiB"
                    for c in cands if c.runnable and c.short is not None)
    raise PlanError(f"no plan fits these devices' memory with a KV cache for {req.context} "
                    f"tokens ({why}); ask for fewer tokens (--max-tokens, --ctx), use int8 "
                    "weights (hepti convert --dtype int8) or add devices")


def plan_decoder(config, profile: Profile, req: Request, wb: float = F32,
                 strategy: str = "auto", ratios: dict[str, list[float]] | None = None,
                 mem_budget: float | None = None) -> DecoderPlan:
    """`auto` compares single, tensor and pipeline; `single`, `tensor` or `pipeline` plans that one
    (`tensor` with `ratios`: those shares, evaluated). `mem_budget` caps every rank's usable
    bytes. Notes say what was estimated."""
    if strategy not in ("auto", "single", "tensor", "pipeline"):
        raise InputError(f"--strategy {strategy}: a decoder is planned as auto, single, "
                         "tensor or pipeline")
    req.check(config)
    if mem_budget is not None:
        profile = replace(profile, devices=[
            replace(d, memory_bytes=min(d.memory_bytes, d.reserved_bytes + mem_budget))
            for d in profile.devices])
    notes = profile.gemv_estimates(wb != F32)
    if profile.world_size > 1 and "allreduce" not in profile.network.get("calibration", {}):
        notes.append("the one-row allreduce is priced from the link model alone (this profile "
                     "did not calibrate it: measure one with `hepti profile --model` on this "
                     "decoder's folder)")
    if profile.world_size > 1 and sync_figures(profile) is None:
        notes.append("a decode step's syncs are priced without the spread of the ranks' "
                     "arrivals (this profile did not measure it: `hepti profile --model` on "
                     "this decoder's folder does)")
    if strategy == "tensor" and ratios is not None:
        cands = [evaluate_tensor(config, profile, req, ratios, wb)]
    else:
        cands = candidates(config, profile, req, wb,
                           ("single", "tensor", "pipeline") if strategy == "auto" else (strategy,))
    if not cands:
        raise PlanError(f"--strategy {strategy} needs more than one rank; this profile has "
                        f"{profile.world_size}")
    chosen = choose(cands, req)
    if any(c.strategy == "tensor" for c in cands) and ratios is None:
        notes.append("tensor's shares: the best of a search over equal, bandwidth-proportional "
                     "and mixed shares, over every rank and over rank 0 with its fastest others "
                     "(and a grid of 0.05 steps at two ranks), each with every split of the KV "
                     "heads; not an LP")
    return DecoderPlan(req, cands, chosen, notes)
