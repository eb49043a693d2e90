"""What each strategy does, as cost-model programs: encoder `rows`, `tensor`, `stream` (lowered
from the model's operator graph, hepti.graph), and the Hepti paper's chain of MatMuls (with
blocking collectives, and as hepti.bench.offload runs it).

A strategy's phases, collectives and weight memory come from lowering its assignment of split
choices on the model's graph (hepti.graph.lower): one Phase per stretch of compute that ends in
a sync point, the same walk that places the executors' collectives. Notation: M = B*T token
rows, C hidden, F FFN width, H heads, D = C/H, L layers; GeMM [m,k]x[k,n] = 2mkn FLOPs;
attention of m query rows on h heads against T keys = 4mThD, at the profile's attention speed
for a call of that many FLOPs. The FFN's GeLU (and every bias) is fused into its GeMM's
epilogue, so it has no Work of its own: the profiler's GeMM speed is measured on a layer's
GeMMs with that epilogue.

Memory is an estimate of what the executors hold at their peak, all from the graph: weights
(what each rank's split keeps of every layer), and activations, the tensors live at each step
of the schedule (hepti.graph.lower.activation_memory), with what the allocator keeps
(`with_overhead`).
"""
from __future__ import annotations

from functools import lru_cache

from hepti.graph import lower
from hepti.families import family_graph
from hepti.plan.costmodel import ACTIVE, ROOT, Collective, MemTerm, Phase, Program, Work

F32 = 4
# Memory a rank holds beyond its packed weights' own bytes, per byte of them: the heap keeps
# what loading freed (each slice is read raw, packed into fresh panels, and the raw arrays
# freed between panels that stay). Measured here on BERT-large's 10-of-16-heads slices: RSS
# grew 825 MiB for 732 MiB of packed layers (+12.8%), and 134 for 121 MiB of embeddings; in
# bin/bench-hetero.sh runs peak RSS exceeded the plan's memory by about 12% of the weights. A
# plan that filled a 1 GiB device to 99% of its free memory without this was OOM-killed.
ALLOC_OVERHEAD = 0.13
GEMM_ROW_TILE, GEMM_COL_PANEL, SHAPE_BYTES = lower.GEMM_ROW_TILE, lower.GEMM_COL_PANEL, lower.SHAPE_BYTES


def with_overhead(memory: list[MemTerm]) -> list[MemTerm]:
    """`memory` plus "overhead": ALLOC_OVERHEAD per byte of every weights term, and one layer's
    slice read raw while it is packed (its peak: raw and packed side by side)."""
    extra = [MemTerm("overhead", t.dim, ALLOC_OVERHEAD * t.per_unit, t.per_layer)
             for t in memory if t.what == "weights"]
    extra += [MemTerm("overhead", t.dim, t.per_unit) for t in memory
              if t.what == "weights" and t.per_layer]
    return memory + extra


@lru_cache(maxsize=64)
def _lowering(cfg, B: int, T: int, strategy: str, stream: bool, int8_group: int | None = None):
    """The graph's lowering for a strategy: (graph, assignment, (start, layer, end, repeat)
    phases, dimensions, weight memory, activation memory). Read only: the planner asks for the
    same few programs for every candidate it weighs, so it is worked out once per shape.
    `int8_group`: an int8 folder's weight bytes (hepti.graph.lower `weight_bytes`)."""
    g = family_graph(cfg, B, T)
    assign = lower.assignment(g, strategy)
    return (g, assign, lower.compress(g, assign, stream=stream, int8_group=int8_group),
            lower.totals(g, assign), tuple(lower.weight_memory(g, assign, int8_group)),
            tuple(lower.program_activations(g, assign)))


def _lowered(cfg, B: int, T: int, strategy: str, window: int | None = None,
             overhead: bool = True, int8_group: int | None = None) -> Program:
    """The strategy's program from the graph: phases, and memory (weights, the activations
    live at each step, and with `overhead` what the allocator keeps: `with_overhead`); with a
    `window`, `stream`'s: loads in the phases and the per-layer reads."""
    g, assign, (start, layer, end, repeat), dims, weights, activations = _lowering(
        cfg, B, T, strategy, window is not None, int8_group)
    memory = list(weights) + list(activations)
    prog = Program(strategy, dict(dims), list(start), list(layer), list(end), repeat,
                   with_overhead(memory) if overhead else memory,
                   integer_dims=tuple(u for u in g.whole_units if u in dims), n_layers=g.n_layers)
    if window is not None:
        prog.stream = lower.stream_reads(g, assign, window, int8_group)
    return prog


def rows_program(cfg, B: int, T: int, int8_group: int | None = None) -> Program:
    """`rows`: weights replicated; each rank's r_i token rows; K/V rows Allgatherv'd per layer."""
    return _lowered(cfg, B, T, "rows", int8_group=int8_group)


def tensor_program(cfg, B: int, T: int, name: str = "tensor", int8_group: int | None = None
                   ) -> Program:
    """`tensor` (also `even`, `single`): heads, FFN columns and token rows split by ratio."""
    return _lowered(cfg, B, T, name, int8_group=int8_group)


def stream_program(cfg, B: int, T: int, window: int, int8_group: int | None = None) -> Program:
    """`stream`: `tensor` with `window` layers of slices in RAM, the next read while computing.
    The `end` phases are the last layer, so the per-layer read bound applies to them too.

    Besides waiting for the disk (`Stream`, overlapped with compute when window >= 2), the
    prefetch thread spends CPU on every layer's slices (checksum, copy, pack: the profile's
    `weight_load_Bps`). That CPU is the rank's own, shared with its compute on a capped device,
    so each layer's phases carry it as "load" Work: the slices of the weights the phase's
    operators use (hepti.graph.lower `_load_works`): its heads' slices (Q, K, V, O rows and QKV
    bias) in the attention phase, its FFN columns in the FFN phase, which is about when the
    prefetch thread makes them (it starts the next layer's slices, heads first, as a layer
    begins). The 6 C whole vectors per layer (18 KiB) are left out. On a device with a core to
    spare for the prefetch thread this over-counts; leave `weight_load_Bps` out there."""
    # A window's peak is set by the runtime's budget (window = budget // slice bytes) and stays
    # within it plus a constant (tests/mpi): no `with_overhead` for the whole model here.
    return _lowered(cfg, B, T, "stream", window, overhead=False, int8_group=int8_group)


def layer_works(cfg, B: int, T: int) -> list[Work]:
    """One whole layer's work on one device (the `pipeline` baseline's stage compute)."""
    g = family_graph(cfg, B, T)
    assign = lower.assignment(g, "tensor")
    return [lower.work(g, op, assign[op.name]) for op in g.layer]


def embed_works(cfg, B: int, T: int) -> list[Work]:
    """What rank 0 does before the first layer (the embeddings)."""
    g = family_graph(cfg, B, T)
    assign = lower.assignment(g, "tensor")
    return [lower.work(g, op, assign[op.name]) for op in g.prologue]


def _chain_parts(m: int, k: int, n: int, chain: int) -> tuple[tuple[Work, ...], list[MemTerm]]:
    """The chain's MatMuls (each [r,k]x[k,n] on a rank's r rows) and its memory."""
    mm = tuple(Work("gemm", "rows", 2.0 * k * n, min(k, n), 1, f"matmul {j}") for j in range(chain))
    memory = [MemTerm("weights", ACTIVE, F32 * chain * k * n),
              MemTerm("activations", "rows", F32 * 2.0 * max(k, n)),
              MemTerm("activations", ROOT, F32 * m * (k + n))]
    return mm, memory


def matmul_chain_program(m: int, k: int, n: int, chain: int) -> Program:
    """The Hepti paper's motivating experiment run with blocking collectives: `chain` MatMuls
    [m,k]x[k,n] (k == n) on rows split by ratio; input scattered once (Scatterv), output
    gathered once (Gatherv), weights replicated. Latency = scatter + slowest compute + gather."""
    mm, memory = _chain_parts(m, k, n, chain)
    start = [Phase((), Collective("scatterv", "rows", F32 * k, "input rows"), "scatter")]
    end = [Phase(mm, Collective("gatherv", "rows", F32 * n, "output rows"), "matmuls+gather")]
    return Program("matmul-chain", {"rows": m}, start, [], end, 0, memory)


def offload_chain_program(m: int, k: int, n: int, chain: int) -> Program:
    """The same chain as hepti.bench.offload runs it, communication overlapped with compute:
    rank 0 posts non-blocking sends of each other rank's input rows (and receives for their
    output rows), then computes its own rows of all `chain` MatMuls; rank i receives its rows,
    computes them and sends the outputs back, which land in rank 0's socket buffers while rank 0
    still computes (measured on shaped TCP links: with the secondary done first, rank 0 found
    them there within half a ms of its own compute's end). Each rank's transfers are "transfer"
    Works over its own link. With one secondary holding share s of the rows, t_p and t_s each
    device's time for all rows, c_in and c_out the transfer times of all rows:

        latency = max(t_p (1 - s), (c_in + t_s + c_out) s)

    minimal where the two cross, s* = t_p / (t_p + c_in + t_s + c_out): the best share falls as
    the link slows (c_in, c_out grow) and as the secondary slows (t_s grows)."""
    mm, memory = _chain_parts(m, k, n, chain)
    rows_in = Work("transfer", "rows", F32 * k, name="input rows (Isend)")
    rows_out = Work("transfer", "rows", F32 * n, name="output rows (Send)")
    end = [Phase((rows_in,) + mm + (rows_out,), None, "isend+matmuls+send")]
    return Program("offload-chain", {"rows": m}, [], [], end, 0, memory)


def program_for(strategy: str, cfg, B: int, T: int, window: int = 2,
                int8_group: int | None = None) -> Program:
    """The strategy's program; `int8_group` counts an int8 folder's weight bytes (its tensors'
    "group", hepti.graph.lower `weight_bytes`), None a float32 one's."""
    if strategy == "rows":
        return rows_program(cfg, B, T, int8_group)
    if strategy in ("tensor", "even", "single"):
        return tensor_program(cfg, B, T, strategy, int8_group)
    if strategy == "stream":
        return stream_program(cfg, B, T, window, int8_group)
    raise ValueError(f"no program for strategy {strategy!r}")
