"""The `pipeline` baseline: PipeEdge's dynamic program over contiguous layer ranges.

The executor (hepti.parallel.pipeline) runs stages in rank order: rank 0 embeds, every rank with
layers runs its range [a, b) on all M rows and Sends [M, C] (after a small pickled header with
the key mask) to the next stage; the last stage Sends the result back to rank 0. Sends block, so
a stage's period is receive + compute + send; a stream of batches moves at the slowest period.

PipeEdge (Hu et al., 2022) chooses the ranges by dynamic programming to minimise the slowest
stage, counting transfers. Here the stage order is the rank order (the executor's), so the
program is f(k, l) = min over an earlier stage (j, a) of max(f(j, a), in(j->k) + compute_k(a, l)):
the slowest period so far when rank k's stage ends at layer l, each transfer charged to its
receiver (the last stage also pays the return to rank 0). Ranges that do not fit a rank's
memory are excluded. O(N^2 L^2); exact periods and latency are then evaluated for the winner.
"""
from __future__ import annotations

import math
from functools import lru_cache

from hepti.config import ModelConfig
from hepti.graph import lower
from hepti.families import family_graph
from hepti.model.sizes import embedding_bytes, layer_bytes
from hepti.plan.costmodel import RankPrediction, held_bytes
from hepti.plan.profile import Profile
from hepti.plan.workloads import ALLOC_OVERHEAD, F32, embed_works, layer_works

HEADER_BYTES = 256  # pickled (shape, key mask) header before each activation (plus the mask)


def _layer_seconds(cfg: ModelConfig, B: int, T: int, profile: Profile) -> list[float]:
    """One whole layer's compute on each device (all heads, columns and rows)."""
    full = family_graph(cfg, B, T).units  # a stage runs every row and unit of its layers
    works = layer_works(cfg, B, T)
    return [sum(w.seconds(dev, full[w.dim]) for w in works) for dev in profile.devices]


def _embed_seconds(cfg: ModelConfig, B: int, T: int, profile: Profile) -> float:
    return sum(w.seconds(profile.devices[0], 1.0) for w in embed_works(cfg, B, T))


def transfer(profile: Profile, j: int, k: int, nbytes: float, header: float) -> float:
    """Seconds to move nbytes (after a header message) from rank j to rank k through the switch."""
    if j == k:
        return 0.0
    a, b = profile.devices[j], profile.devices[k]
    bw = min(a.bandwidth_Bps, b.bandwidth_Bps)
    msgs = 2 if header else 1
    return msgs * (a.latency_s + b.latency_s) + (nbytes + header) / bw


def stage_memory(cfg: ModelConfig, B: int, T: int, rank: int, n_layers: int) -> dict[str, float]:
    """What a stage of `n_layers` whole layers holds (rank 0 also embeds and collects the
    output): weights, and the activations its part of a one-rank schedule keeps live at its
    peak (hepti.graph.lower.activation_memory), every split dimension at its whole count."""
    mem = {"weights": float(n_layers * layer_bytes(cfg)),
           "activations": _stage_activations(cfg, B, T, rank == 0, min(n_layers, 2))}
    if rank == 0:
        mem["weights"] += embedding_bytes(cfg)
    # see hepti.plan.workloads.with_overhead: heap kept after loading, one raw layer in packing
    mem["overhead"] = ALLOC_OVERHEAD * mem["weights"] + (layer_bytes(cfg) if n_layers else 0.0)
    return mem


@lru_cache(maxsize=256)
def _stage_activations(cfg: ModelConfig, B: int, T: int, primary: bool, n_layers: int) -> float:
    """Peak activation bytes of a stage (its layers, all of their rows and units; the
    prologue too on the primary); two layers show all a longer stage holds."""
    g = family_graph(cfg, B, T)
    steps = lower.schedule(g, lower.assignment(g, "single"), max(1, n_layers))
    part = lower.stage_steps(steps, 0, n_layers, last=True) if n_layers else []
    if primary:
        part = lower.prologue_steps(steps) + part
    if not part:
        return 0.0
    layer_in = g.layer[0].inputs[0]  # what a stage receives and passes on
    terms = lower.activation_memory(g, part, keep=(g.output, layer_in))
    return held_bytes(terms, dict(g.units), primary, 1).get("activations", 0.0)


def pipeline_ranges(cfg: ModelConfig, B: int, T: int, profile: Profile, caps: list[float]
                    ) -> list[tuple[int, int]] | None:
    """PipeEdge's ranges [start, stop) per rank (empty for unused ranks), or None if no
    assignment fits the memory caps."""
    N, L = profile.world_size, cfg.num_hidden_layers
    lt = _layer_seconds(cfg, B, T, profile)
    emb = _embed_seconds(cfg, B, T, profile)
    S = activation_bytes(cfg, B, T)
    head = HEADER_BYTES + F32 * B * T
    fits = [[sum(stage_memory(cfg, B, T, k, n).values()) <= caps[k] for n in range(L + 1)]
            for k in range(N)]
    if not fits[0][0]:
        return None
    INF = math.inf
    # f[k][l]: slowest period so far with rank k's stage ending at layer l; back-pointers
    f = [[INF] * (L + 1) for _ in range(N)]
    back: dict[tuple[int, int], tuple[int, int] | None] = {}
    for l in range(L + 1):  # rank 0 runs layers [0, l) after embedding (l may be 0)
        if fits[0][l]:
            f[0][l] = emb + l * lt[0]
            back[(0, l)] = None
    for k in range(1, N):
        ret = transfer(profile, k, 0, S, 0)  # paid by rank k if its stage is the last
        for l in range(1, L + 1):
            best, arg = INF, None
            for j in range(k):
                tr = transfer(profile, j, k, S, head) + (ret if l == L else 0.0)
                for a in range(l):
                    if f[j][a] == INF or not fits[k][l - a]:
                        continue
                    v = max(f[j][a], tr + (l - a) * lt[k])
                    if v < best:
                        best, arg = v, (j, a)
            f[k][l] = best
            back[(k, l)] = arg
    end = min(range(N), key=lambda k: f[k][L])
    if f[end][L] == INF:
        return None
    ranges = [(0, 0)] * N
    k, l = end, L
    while True:
        prev = back[(k, l)]
        a = 0 if prev is None else prev[1]
        ranges[k] = (a, l)
        if prev is None:
            break
        k, l = prev
    # unused ranks get an empty range where the layers before them end (rank order)
    out, pos = [], 0
    for k in range(N):
        a, b = ranges[k]
        if b > a:
            pos = b
            out.append((a, b))
        else:
            out.append((pos, pos))
    return out


def activation_bytes(cfg: ModelConfig, B: int, T: int) -> int:
    """Bytes of the [M, C] hidden state each hop of `stage_hops` carries."""
    g = family_graph(cfg, B, T)
    return B * T * g.tensors[g.layer[0].inputs[0]].row_bytes()  # the layers' input and output


def stage_hops(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The executor's messages of [M, C] activations for one batch, in order, as (from, to):
    into each stage from the one before (rank 0 embeds, so the first comes from rank 0),
    then from the last stage back to rank 0. Each but the return follows a header message
    (HEADER_BYTES and the key mask)."""
    stages = [k for k in range(len(ranges)) if ranges[k][1] > ranges[k][0] and k != 0]
    hops, prev = [], 0
    for k in stages:
        hops.append((prev, k))
        prev = k
    if prev != 0:
        hops.append((prev, 0))
    return hops


def pipeedge_bottleneck(cfg: ModelConfig, B: int, T: int, profile: Profile,
                        ranges: list[tuple[int, int]]) -> float:
    """The dynamic program's objective for given ranges: the slowest stage period with each
    transfer charged to its receiver (and the return to rank 0 to the last stage)."""
    lt = _layer_seconds(cfg, B, T, profile)
    S = activation_bytes(cfg, B, T)
    head = HEADER_BYTES + F32 * B * T
    periods = {0: _embed_seconds(cfg, B, T, profile) + (ranges[0][1] - ranges[0][0]) * lt[0]}
    for j, k in stage_hops(ranges):
        if k == 0:  # the return: the last stage's
            periods[j] += transfer(profile, j, k, S, 0)
        else:
            periods[k] = transfer(profile, j, k, S, head) + (ranges[k][1] - ranges[k][0]) * lt[k]
    return max(periods.values())


def evaluate_pipeline(cfg: ModelConfig, B: int, T: int, profile: Profile,
                      ranges: list[tuple[int, int]]) -> dict:
    """Latency of one batch, the slowest period, and per-rank predictions for these ranges."""
    N = profile.world_size
    lt = _layer_seconds(cfg, B, T, profile)
    emb = _embed_seconds(cfg, B, T, profile)
    S = activation_bytes(cfg, B, T)
    head = HEADER_BYTES + F32 * B * T
    stages = [k for k in range(N) if ranges[k][1] > ranges[k][0]]
    ranks = [RankPrediction(k, k == 0 or k in stages) for k in range(N)]
    ranks[0].compute_s = emb + (ranges[0][1] - ranges[0][0]) * lt[0]
    latency = ranks[0].compute_s
    periods = {0: ranks[0].compute_s}
    for j, k in stage_hops(ranges):
        t = transfer(profile, j, k, S, head if k != 0 else 0)
        comp = (ranges[k][1] - ranges[k][0]) * lt[k] if k != 0 else 0.0
        latency += t + comp
        ranks[k].compute_s += comp
        ranks[k].comm_s["recv"] = ranks[k].comm_s.get("recv", 0.0) + t
        ranks[j].comm_s["send"] = ranks[j].comm_s.get("send", 0.0) + t
        periods[j] = periods.get(j, 0.0) + t
        if k != 0:
            periods[k] = periods.get(k, 0.0) + t + comp
    for k in range(N):
        if ranks[k].active:
            ranks[k].mem = stage_memory(cfg, B, T, k, ranges[k][1] - ranges[k][0])
    return {"latency_s": latency, "bottleneck_s": max(periods.values()), "per_rank": ranks}
