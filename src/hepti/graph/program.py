"""A program's data types: the phases, collectives and memory terms one inference is written as.

`hepti.graph.lower` writes a graph under an assignment as a `Program`; the cost model
(hepti.plan.costmodel) prices it and the partitioner's LP is built from it. The types live here,
in the graph layer, so that lowering needs nothing from the planner above it. `Work` prices
itself on a device (`seconds`) through the device's measured speeds (hepti.plan.profile.Device,
passed in: this module imports nothing of the planner's).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

ROOT = "root"  # pseudo-dimension: work or memory on rank 0 only (embeddings)
ACTIVE = "active"  # pseudo-dimension: memory every active rank holds whatever its share


@dataclass(frozen=True)
class Work:
    """Compute a rank does in a phase: `per_unit * count` FLOPs (elements; bytes for "transfer")
    of `kind`.

    The speed is looked up at size min(size_fixed, size_per_unit * count): the GeMM's smallest
    dimension, which is what makes small slices slower per FLOP.
    """

    kind: str  # "gemm" | "attention" | "elementwise" | "transfer" (bytes over the rank's link)
    #            | "load" (stored weight bytes made into packed slices on the rank's CPU)
    #            | "gemv" / "gemv_int8" (bytes a one-row product reads: float32 / int8 weights,
    #              at the device's GeMV bytes/s; the decoder's decode, hepti.graph.decoder)
    #            | "token" (`per_unit` times a token's fixed work outside a decoder's layers,
    #              the device's `token_overhead_s`: hepti.graph.decoder; no call overhead)
    dim: str  # "heads" | "ffn" | "rows" | "vocab" | ROOT
    per_unit: float
    size_fixed: float = math.inf
    size_per_unit: float = math.inf
    name: str = ""
    # The kernel does this dimension in blocks of `quantum` units and a partial block costs
    # about a whole one: the GeMM's row tiles of MR rows (`rows`), its column panels of NR
    # (`ffn` as output columns). See `blocks`.
    quantum: int = 1

    def size(self, count: float) -> float:
        return min(self.size_fixed, self.size_per_unit * count)

    def blocks(self, count: float) -> float:
        """`count` rounded up to whole blocks of `quantum` units: what the kernel computes.
        Measured on MiniLM's four layer GeMMs: 65 rows took 11.2 ms like 72 (11.7), not like 64
        (10.5), and 63 took 11.2 too (the rows past 8 tiles run as 4 + 2 + 1-row strips, each a
        pass over the weights). An LP cannot see these steps; hepti.plan.search's
        `snap_to_blocks` and `polish` do."""
        if self.quantum <= 1:
            return count
        return math.ceil(count / self.quantum - 1e-9) * self.quantum

    def speed(self, dev, count: float) -> float:
        if self.kind == "transfer":  # to/from rank 0, at the rank's link speed
            return math.inf if dev.rank == 0 else dev.bandwidth_Bps
        if self.kind == "gemm":
            return dev.gemm_flops(self.size(count))
        if self.kind == "attention":
            return dev.attention_flops(self.size(count))
        if self.kind == "load":  # not counted without a measured or declared figure
            return dev.weight_load_Bps or math.inf
        if self.kind in ("gemv", "gemv_int8"):
            return dev.gemv_bytes_per_s(self.kind == "gemv_int8")
        return dev.elementwise_per_s

    def seconds(self, dev, count: float) -> float:
        """Time of this work on `dev` for `count` units: FLOPs / speed + one kernel call."""
        if count <= 0 or (self.kind == "transfer" and dev.rank == 0):
            return 0.0
        if self.kind == "load" and dev.weight_load_Bps is None:
            return 0.0
        if self.kind == "token":  # measured whole, its calls included
            return self.per_unit * dev.token_overhead_s
        return self.per_unit * self.blocks(count) / self.speed(dev, count) + dev.call_overhead_s


@dataclass(frozen=True)
class Collective:
    """A collective over the active ranks. Blocks are `unit_bytes * count[dim]` per rank; a
    bcast (dim None) moves `unit_bytes` from rank 0 to all.

    A "halo" (a height split's exchange of rows between neighbours, point to point:
    hepti.graph.band_program) is no block per rank of one dimension: `moves` holds each rank's
    (bytes sent, bytes received, peers it exchanges with), and dim is None."""

    kind: str  # "bcast" | "scatterv" | "gatherv" | "allgatherv" | "reduce_scatter" | "halo"
    #            | "allreduce" / "allgather" (dim None: every rank's whole `unit_bytes` to every
    #              peer in one round; the decoder's one-row sums and its token choice)
    dim: str | None
    unit_bytes: float
    name: str = ""
    moves: tuple[tuple[float, float, int], ...] | None = None  # "halo": per rank


@dataclass(frozen=True)
class Phase:
    works: tuple[Work, ...]
    collective: Collective | None = None
    name: str = ""


@dataclass(frozen=True)
class MemTerm:
    """Memory a rank holds: `per_unit` bytes per unit of `dim` (ACTIVE: once if active; ROOT:
    on rank 0). `what` is "weights", "activations" or "overhead". A `per_layer` term is held
    once per resident layer: L times, or a stream window's worth. A term with a `step` is held
    at that step of the schedule only: a rank holds the largest step's (hepti.graph.lower's
    activation_memory), all of whose terms share the same `what`."""

    what: str
    dim: str
    per_unit: float
    per_layer: bool = False
    step: int | None = None


def envelope(memory: list[MemTerm]) -> list[MemTerm]:
    """`memory` with the stepped terms replaced by one term per dimension, its largest over
    the steps: linear in a rank's counts, and never below the largest step's memory."""
    top: dict[tuple[str, str], float] = {}
    out = []
    for t in memory:
        if t.step is None:
            out.append(t)
        else:
            top[(t.what, t.dim)] = max(top.get((t.what, t.dim), 0.0), t.per_unit)
    return out + [MemTerm(what, dim, b) for (what, dim), b in top.items()]


def steps_of(memory: list[MemTerm]) -> dict[int, list[MemTerm]]:
    """The stepped terms of `memory`, by step."""
    out: dict[int, list[MemTerm]] = {}
    for t in memory:
        if t.step is not None:
            out.setdefault(t.step, []).append(t)
    return out


@dataclass
class Stream:
    """`stream` strategy: each layer's slices are read from disk during the previous layer.

    `read_per_unit[dim]` bytes per unit and `read_fixed` bytes per active rank, per layer.
    `window` is the number of layers each rank holds (>= 2 overlaps reading with compute)."""

    read_per_unit: dict[str, float]
    read_fixed: float
    window: int
    budget: float | None = None  # the runtime's --mem-budget: window_i = budget // slice_i


@dataclass
class Program:
    """One inference: start phases, `repeat` x layer phases, end phases; and its memory."""

    name: str
    totals: dict[str, int]  # units of each split dimension (heads H, ffn F, rows M)
    start: list[Phase]
    layer: list[Phase]
    end: list[Phase]
    repeat: int
    memory: list[MemTerm]
    integer_dims: tuple[str, ...] = ()
    stream: Stream | None = None
    n_layers: int = 1  # layers whose per_layer memory terms are resident (unless streaming)

    def phases(self):
        """(phase, multiplicity, group) over the whole inference; group: start/layer/end."""
        for p in self.start:
            yield p, 1, "start"
        for p in self.layer:
            yield p, self.repeat, "layer"
        for p in self.end:
            yield p, 1, "end"
