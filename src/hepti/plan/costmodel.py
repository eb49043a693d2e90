"""The cost model's generic core: a program of compute phases and collectives, and its evaluation.

A `Program` is what one inference does, written as phases. A phase is some compute on every rank
(`Work`: FLOPs or elements proportional to the rank's count of a split dimension) followed by at
most one collective. Collectives synchronise the ranks, so a phase costs the slowest rank's
compute plus the collective's time; the inference costs the sum over phases (layers repeat).
The encoder strategies (hepti.plan.workloads) and the Hepti paper's 5-MatMul experiment are
programs, and the partitioner's LP (hepti.plan.partition) is built from the very same phase list
and the same per-rank collective formulas (`link_terms`), so the two cannot disagree.

Network model: a star through a switch, each device's own full-duplex link (latency alpha_i,
bandwidth beta_i) is its bottleneck. A collective costs the slowest participant's
`steps * alpha_i + bytes_i / beta_i` (+ its reduction work), where steps is the number of
messages the rank posts and bytes_i what crosses its link, for the algorithm the runtime uses:

    allgatherv      direct exchange (hepti.parallel.comm): rank i posts n-1 receives and n-1
                    sends of its block; it receives S - c_i and sends (n-1) c_i
    reduce_scatter  direct exchange: rank i sends S - c_i (each peer its rows), receives
                    (n-1) c_i and adds it
    bcast           MPI's own, MPICH's choice: binomial tree (ceil(log2 n) hops of the whole
                    buffer) below 12 KiB or 8 ranks, else scatter + allgather (the root's link
                    carries about 2 S); thresholds in the profile's "network" section
    scatterv/gatherv root 0 posts one message per peer: (n-1) alpha_0 + (S - c_0)/beta_0;
                    peer i: alpha_i + c_i / beta_i
    allreduce       the decoder's one-row sum (hepti.parallel.comm `Comm.allreduce_sum`): rank i sends
                    its whole S to each of the n-1 peers and receives theirs, one round:
                    (n-1) alpha_i + (n-1) S / beta_i, plus (n-1) S / 4 float adds
    allgather       the decoder's token choice (`Comm.allgather_small`): the same exchange of a few
                    numbers (S: one rank's), no adds
    halo            a height split's exchange (hepti.parallel.comm `exchange`: every receive
                    posted, then every send, one message per peer each way): rank i with p_i
                    peers, sending s_i and receiving r_i bytes, p_i alpha_i + max(s_i, r_i) /
                    beta_i (full duplex: in and out overlap); 0 for a rank that moves nothing.
                    Its bytes are the plan's rows (`Collective.moves`), not a rank's block, so
                    the LP (hepti.plan.partition) cannot take it: CNNs are planned by
                    hepti.plan.coedge, and priced here

Participants are the active ranks: rank 0 (it holds inputs and outputs) and every rank with a
nonzero count. c_i is rank i's block in bytes, S the whole buffer. Compute speeds come from the
profile (GeMM FLOP/s by the GeMM's smallest dimension, attention FLOP/s, elementwise elements/s),
and every Work a rank does costs it one kernel call's fixed overhead (`call_overhead_s`).

One kind of Work is not arithmetic: a "transfer" is bytes crossing the rank's own link to or
from rank 0 while the other ranks compute (the Hepti paper's offload experiment,
hepti.bench.offload: rank 0 posts non-blocking sends and receives, computes its own rows, and
the replies wait in its socket buffers). Rank i > 0 spends bytes / beta_i on it, rank 0 nothing,
so such a phase costs max(rank 0's compute, max over i > 0 of its transfers + compute). It is
reported as communication (comm_s["transfer"]), not compute. It leaves out link latency (tenths
of a ms against tens of ms of transfer) and the sharing of rank 0's link by several peers (exact
for one), so that it stays linear in the rank's own block for the LP.

A decoder's decode step prices its Work by bytes: "gemv" ("gemv_int8") is the bytes of weights
(and KV cache) a one-row product reads, over the profile's GeMV bytes/s (`Device.gemv_bytes_per_s`,
an estimate from the GeMM speed when the profile has none): hepti.graph.decoder.

Another is "load": `stream` turning a layer's stored weight slices into packed ones (read from
the page cache, checksum, pack) on the rank's prefetch thread, bytes / the profile's
`weight_load_Bps` (0 if the profile has none: not counted). It is CPU work on the rank's own
CPU, which a capped device (a cgroup quota; or one core per rank) shares with its compute, so
it is counted in the phase like compute, not overlapped; it is reported as `load_s`, apart
from compute. Waiting for the disk is not CPU work: that part stays overlapped (`Stream`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from hepti.graph.program import (ACTIVE, ROOT, Collective, MemTerm, Phase, Program, Stream, Work,
                                 envelope, steps_of)
from hepti.plan.profile import Device, Profile

__all__ = ["ACTIVE", "ROOT", "Collective", "MemTerm", "Phase", "Program", "Stream", "Work",
           "envelope", "steps_of"]  # defined in hepti.graph.program, priced here

# --- collectives ---------------------------------------------------------------------------

def _log2c(n: int) -> int:
    return max(0, math.ceil(math.log2(n))) if n > 1 else 0


def link_terms(coll: Collective, n: int, total_bytes: float, dev: Device, is_root: bool,
               network: dict) -> list[tuple[float, float]]:
    """Rank time in a collective as max over branches of (const + coef * own_block_bytes).

    n is the number of participants, total_bytes the whole buffer S. Linear in the rank's own
    block for a fixed n: this is what lets the partitioner write it as LP constraints.
    """
    return branch_terms(coll.kind, n, total_bytes, dev.latency_s, dev.bandwidth_Bps,
                  dev.elementwise_per_s, is_root, network)


def branch_terms(kind: str, n: int, S: float, a, b, e, is_root: bool, network: dict) -> list[tuple]:
    """link_terms on plain numbers, or on numpy arrays of every rank's a, b, e at once, scaled
    by the profile's measured calibration of that collective kind (network["calibration"]:
    measured / modelled time of the real collective at the profiled size; a factor on both
    terms keeps them linear in the rank's block)."""
    f = float(network.get("calibration", {}).get(kind, 1.0))
    terms = _branch_terms(kind, n, S, a, b, e, is_root, network)
    return terms if f == 1.0 else [(c * f, k * f) for c, k in terms]


def _branch_terms(kind: str, n: int, S: float, a, b, e, is_root: bool, network: dict) -> list[tuple]:
    if n <= 1:
        return [(0.0 * a, 0.0 * a)]
    zero = 0.0 * a
    if kind == "allgatherv":  # direct exchange
        return [((n - 1) * a + S / b, -1.0 / b),  # receiving S - c_i
                ((n - 1) * a + zero, (n - 1) / b)]  # sending (n-1) c_i
    if kind == "reduce_scatter":  # direct exchange
        red = (n - 1) / (4.0 * e)  # seconds per own-block byte: (n-1) c_i / 4 float adds
        return [((n - 1) * a + S / b, -1.0 / b + red),  # sending S - c_i
                ((n - 1) * a + zero, (n - 1) / b + red)]  # receiving (n-1) c_i
    if kind in ("allreduce", "allgather"):  # one round, every rank's whole S to every peer
        red = (n - 1) * S / (4.0 * e) if kind == "allreduce" else zero
        return [((n - 1) * a + (n - 1) * S / b + red, zero)]
    if kind == "bcast":
        if S < network["bcast_short_bytes"] or n < network["bcast_min_procs"]:
            hops = _log2c(n)  # binomial tree
            return [(hops * (a + S / b), zero)]
        steps = _log2c(n) + n - 1  # scatter + ring allgather
        vol = 2.0 * S * (n - 1) / n if is_root else S
        return [(steps * a + vol / b, zero)]
    if kind in ("scatterv", "gatherv"):
        if is_root:
            return [((n - 1) * a + S / b, -1.0 / b)]
        return [(a + zero, 1.0 / b)]
    if kind == "halo":
        raise ValueError("a halo's bytes are the plan's rows, not a rank's block: it has no "
                         "linear branch terms (price it with collective_times)")
    raise ValueError(f"unknown collective kind {kind!r}")


def collective_times(coll: Collective, counts: dict[str, list[float]], active: list[bool],
                     profile: Profile) -> list[float]:
    """Each rank's time in `coll` (0 for ranks that do not take part)."""
    N = profile.world_size
    n = sum(active)
    if coll.kind == "halo":
        f = float(profile.network.get("calibration", {}).get("halo", 1.0))
        return [f * (p * dev.latency_s + max(s, r) / dev.bandwidth_Bps) if active[i] and (s or r)
                else 0.0 for i, (dev, (s, r, p)) in enumerate(zip(profile.devices, coll.moves))]
    if coll.dim is None:
        blocks = [0.0] * N
        S = coll.unit_bytes
    else:
        blocks = [coll.unit_bytes * c for c in counts[coll.dim]]
        S = sum(blocks)
    out = []
    for i, dev in enumerate(profile.devices):
        if not active[i]:
            out.append(0.0)
            continue
        terms = link_terms(coll, n, S, dev, i == 0, profile.network)
        out.append(max(c + k * blocks[i] for c, k in terms))
    return out


def rank_bytes(coll: Collective, counts: dict[str, list[float]], active: list[bool]
               ) -> list[tuple[float, float]]:
    """(bytes sent, bytes received) of each rank in `coll`: the data hepti.parallel.comm's verbs
    hand over and take, which tests/mpi/agreement.py holds equal to what they record. For the
    direct exchanges and Scatterv/Gatherv these are what the branch terms above charge; a Bcast
    is MPI's own, so there the root's count is its data for every peer, not what its link
    carries (the branch terms model MPICH's algorithm). A collective among fewer than two
    active ranks moves nothing."""
    N, n = len(active), sum(active)
    if n <= 1:
        return [(0.0, 0.0)] * N
    if coll.kind == "halo":  # the plan's own rows, each rank's (hepti.graph.band_program)
        return [(float(s), float(r)) if active[i] else (0.0, 0.0)
                for i, (s, r, _) in enumerate(coll.moves)]
    c = [coll.unit_bytes * x for x in counts[coll.dim]] if coll.dim is not None else [0.0] * N
    S = sum(c) if coll.dim is not None else coll.unit_bytes
    out = []
    for i in range(N):
        if not active[i]:
            out.append((0.0, 0.0))
        elif coll.kind == "allgatherv":
            out.append(((n - 1) * c[i], S - c[i]))
        elif coll.kind == "reduce_scatter":
            out.append((S - c[i], (n - 1) * c[i]))
        elif coll.kind == "bcast":
            out.append(((n - 1) * S, 0.0) if i == 0 else (0.0, S))
        elif coll.kind in ("allreduce", "allgather"):
            out.append(((n - 1) * S, (n - 1) * S))
        elif coll.kind == "scatterv":
            out.append((S - c[0], 0.0) if i == 0 else (0.0, c[i]))
        elif coll.kind == "gatherv":
            out.append((0.0, S - c[0]) if i == 0 else (c[i], 0.0))
        else:
            raise ValueError(f"unknown collective kind {coll.kind!r}")
    return out


# --- evaluation ----------------------------------------------------------------------------

def active_ranks(program: Program, counts: dict[str, list[float]], world_size: int) -> list[bool]:
    """Rank 0 always takes part; any other rank with a nonzero count of some dimension does."""
    return [i == 0 or any(counts[d][i] > 0 for d in program.totals) for i in range(world_size)]


@dataclass
class RankPrediction:
    rank: int
    active: bool
    compute_s: float = 0.0
    comm_s: dict[str, float] = field(default_factory=dict)  # transfer time per collective kind
    wait_s: float = 0.0  # idle at sync points, waiting for slower ranks' compute
    read_s: float = 0.0  # stream: disk reading (overlapped with compute when window >= 2)
    load_s: float = 0.0  # stream: making slices on the rank's CPU ("load" Work, not overlapped)
    mem: dict[str, float] = field(default_factory=dict)  # bytes: weights, activations, overhead

    @property
    def mem_bytes(self) -> float:
        return sum(self.mem.values())

    @property
    def comm_total_s(self) -> float:
        return sum(self.comm_s.values())

    def to_dict(self) -> dict:
        return {"rank": self.rank, "active": self.active, "compute_s": self.compute_s,
                "comm_s": dict(self.comm_s), "wait_s": self.wait_s, "read_s": self.read_s, "load_s": self.load_s,
                "mem_bytes": self.mem_bytes, "mem": dict(self.mem)}


@dataclass
class Prediction:
    latency_s: float
    per_rank: list[RankPrediction]
    phases: list[dict]  # per distinct phase: name, multiplicity, compute_s (max), comm_s
    counts: dict[str, list[float]]

    def to_dict(self) -> dict:
        return {"latency_s": self.latency_s, "per_rank": [r.to_dict() for r in self.per_rank],
                "phases": self.phases}


def layer_slice_bytes(program: Program, counts: dict[str, list[float]], rank: int) -> float:
    """Bytes of one layer's weights on this rank (the per_layer memory terms)."""
    total = 0.0
    for t in program.memory:
        if t.per_layer:
            total += t.per_unit if t.dim == ACTIVE else t.per_unit * counts[t.dim][rank]
    return total


def layers_held(program: Program, counts: dict[str, list[float]], active: list[bool]) -> list[int]:
    """Layers of weights each rank holds: all of them, or its stream window (0 if inactive).
    With a budget, the window is what the runtime derives: budget // slice bytes, at most L."""
    out = []
    for i, a in enumerate(active):
        if not a:
            out.append(0)
        elif program.stream is None:
            out.append(program.n_layers)
        elif program.stream.budget is not None:
            per = layer_slice_bytes(program, counts, i)
            out.append(int(min(program.n_layers, program.stream.budget // max(per, 1.0))))
        else:
            out.append(program.stream.window)
    return out


def memory_bytes(program: Program, counts: dict[str, list[float]], active: list[bool],
                 rank: int) -> dict[str, float]:
    """A rank's memory by kind (weights / activations / overhead) for these counts."""
    mem: dict[str, float] = {}
    if not active[rank]:
        return mem
    held = layers_held(program, counts, active)[rank]
    mine = {d: c[rank] for d, c in counts.items()}
    return held_bytes(program.memory, mine, rank == 0, held)


def held_bytes(memory: list[MemTerm], counts: dict[str, float], primary: bool, layers: int
               ) -> dict[str, float]:
    """Bytes by kind a rank holds with these counts of each dimension, on the primary or not,
    with `layers` layers' weights resident: every term without a step, and the step whose
    terms come to the most. (One pass: the planner calls this for every rank of every
    candidate.)"""
    mem: dict[str, float] = {}
    at: dict[int, float] = {}
    what = ""
    for t in memory:
        if t.dim == ACTIVE:
            b = t.per_unit
        elif t.dim == ROOT:
            b = t.per_unit if primary else 0.0
        else:
            b = t.per_unit * counts[t.dim]
        if t.per_layer:
            b *= layers
        if t.step is None:
            mem[t.what] = mem.get(t.what, 0.0) + b
        else:
            at[t.step] = at.get(t.step, 0.0) + b
            what = t.what
    if at:
        mem[what] = mem.get(what, 0.0) + max(at.values())
    return mem


def read_bytes(program: Program, counts: dict[str, list[float]], rank: int) -> float:
    s = program.stream
    return s.read_fixed + sum(b * counts[d][rank] for d, b in s.read_per_unit.items())


def _phase_seconds(phase: Phase, counts: dict[str, list[float]], active: list[bool],
                   profile: Profile) -> tuple[list[float], list[float]]:
    """Each rank's busy time in a phase before its collective (compute, transfers, loads), and
    the parts of it that are "transfer" and "load" Work."""
    busy, moved, loaded = [], [], []
    for i, dev in enumerate(profile.devices):
        t = [(w.kind, w.seconds(dev, counts[w.dim][i])) for w in phase.works] if active[i] else []
        busy.append(sum(s for _, s in t))
        moved.append(sum(s for k, s in t if k == "transfer"))
        loaded.append(sum(s for k, s in t if k == "load"))
    return busy, moved, loaded


def evaluate(program: Program, counts: dict[str, list[float]], profile: Profile) -> Prediction:
    """Predict latency, per-rank compute/communication/wait and memory for these counts."""
    N = profile.world_size
    for d, total in program.totals.items():
        if len(counts[d]) != N:
            raise ValueError(f"counts[{d!r}] has {len(counts[d])} entries for {N} ranks")
    counts = {**counts, ROOT: [1.0] + [0.0] * (N - 1)}
    active = active_ranks(program, counts, N)
    ranks = [RankPrediction(i, active[i]) for i in range(N)]
    latency = 0.0
    layer_s = end_s = 0.0
    phases = []
    comp_of: dict[tuple, tuple] = {}  # phases repeat: each distinct one computed once
    coll_of: dict[Collective, float] = {}
    for phase, mult, group in program.phases():
        if phase.works not in comp_of:
            comp_of[phase.works] = _phase_seconds(phase, counts, active, profile)
        comp, moved, loaded = comp_of[phase.works]
        slowest = max(comp)
        coll_s = 0.0
        if phase.collective is not None:
            if phase.collective not in coll_of:
                coll_of[phase.collective] = max(collective_times(phase.collective, counts, active, profile))
            coll_s = coll_of[phase.collective]
        t = slowest + coll_s
        latency += mult * t
        if group == "layer":
            layer_s += t
        elif group == "end":
            end_s += t
        for i in range(N):
            r = ranks[i]
            r.compute_s += mult * (comp[i] - moved[i] - loaded[i])
            r.load_s += mult * loaded[i]
            if moved[i] > 0:
                r.comm_s["transfer"] = r.comm_s.get("transfer", 0.0) + mult * moved[i]
            if active[i]:
                r.wait_s += mult * (slowest - comp[i])
                if phase.collective is not None:
                    k = phase.collective.kind
                    r.comm_s[k] = r.comm_s.get(k, 0.0) + mult * coll_s
        phases.append({"name": phase.name, "times": mult, "compute_s": slowest, "comm_s": coll_s})
    if program.stream is not None:
        # every layer (the `end` phases are the last one) lasts at least its slowest read
        windows = layers_held(program, counts, active)
        reads = [read_bytes(program, counts, i) / profile.devices[i].disk_read_Bps if active[i]
                 else 0.0 for i in range(N)]
        overlapped = max((reads[i] for i in range(N) if windows[i] >= 2), default=0.0)
        serial = max((reads[i] for i in range(N) if windows[i] == 1), default=0.0)
        extra = 0.0
        for t, mult in ((layer_s, program.repeat), (end_s, 1)):
            extra += mult * (max(t + serial, overlapped) - t)
        latency += extra
        for i in range(N):
            ranks[i].read_s = (program.repeat + 1) * reads[i]
            if active[i]:
                ranks[i].wait_s += extra
    for i in range(N):
        ranks[i].mem = memory_bytes(program, counts, active, i)
    return Prediction(latency, ranks, phases, {d: list(counts[d]) for d in program.totals})
