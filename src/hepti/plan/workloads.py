"""What each strategy does, as cost-model programs: BERT `rows`, `tensor`, `stream`, and the
Hepti paper's chain of MatMuls (with blocking collectives, and as hepti.bench.offload runs it).

Each program mirrors its executor in hepti.parallel (rows.py, tensor.py, engine.py) phase by
phase: one Phase per stretch of compute that ends in a collective. Per batch, the engine first
broadcasts the batch shape (an int64 [B, T]) and the key mask [B, T], and rank 0 embeds the
tokens. Notation: M = B*T token rows, C hidden, F FFN width, H heads, D = C/H, L layers;
GeMM [m,k]x[k,n] = 2mkn FLOPs; attention of m query rows on h heads against T keys = 4mThD,
at the profile's attention speed for a call of that many FLOPs.
The FFN's GeLU (and every bias) is fused into its GeMM's epilogue, so it has no Work of its own:
the profiler's GeMM speed is measured on a layer's GeMMs with that epilogue.

Memory is an estimate of what the executors hold at their peak: weights (hepti.model.sizes, the
numbers the runtime itself budgets with), activations and collective buffers.
"""
from __future__ import annotations

from hepti.config import BertConfig
from hepti.model.sizes import embedding_bytes, layer_bytes
from hepti.plan.costmodel import ACTIVE, ROOT, Collective, MemTerm, Phase, Program, Stream, Work

F32 = 4
# The GeMM kernel's blocks (hepti.kernels.config.MR and NR, which tests/test_plan.py checks;
# not imported, since importing the kernels sets Numba up, which the planner does not
# need): row tiles of MR rows, weight panels of NR output columns.
GEMM_ROW_TILE = 8
GEMM_COL_PANEL = 32
SHAPE_BYTES = 16  # the int64 [B, T] the engine broadcasts before each batch (engine.Job._one_batch)
# Memory a rank holds beyond its packed weights' own bytes, per byte of them: the heap keeps
# what loading freed (each slice is read raw, packed into fresh panels, and the raw arrays
# freed between panels that stay). Measured here on BERT-large's 10-of-16-heads slices: RSS
# grew 825 MiB for 732 MiB of packed layers (+12.8%), and 134 for 121 MiB of embeddings; in
# bin/bench-hetero.sh runs peak RSS exceeded the plan's memory by about 12% of the weights. A
# plan that filled a 1 GiB device to 99% of its free memory without this was OOM-killed.
ALLOC_OVERHEAD = 0.13


def with_overhead(memory: list[MemTerm]) -> list[MemTerm]:
    """`memory` plus "overhead": ALLOC_OVERHEAD per byte of every weights term, and one layer's
    slice read raw while it is packed (its peak: raw and packed side by side)."""
    extra = [MemTerm("overhead", t.dim, ALLOC_OVERHEAD * t.per_unit, t.per_layer)
             for t in memory if t.what == "weights"]
    extra += [MemTerm("overhead", t.dim, t.per_unit) for t in memory
              if t.what == "weights" and t.per_layer]
    return memory + extra


def _preamble(B: int, T: int) -> list[Phase]:
    return [Phase((), Collective("bcast", None, SHAPE_BYTES, "shape"), "batch shape"),
            Phase((), Collective("bcast", None, F32 * B * T, "mask"), "key mask")]


def _embed(cfg: BertConfig, M: int) -> Work:
    # gather three embedding rows, add, LayerNorm: about 4 passes over [M, C]
    return Work("elementwise", ROOT, 4.0 * M * cfg.hidden_size, name="embed")


def rows_program(cfg: BertConfig, B: int, T: int) -> Program:
    """`rows`: weights replicated; each rank's r_i token rows; K/V rows Allgatherv'd per layer."""
    C, F, L, M = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, B * T
    tile = GEMM_ROW_TILE
    qkv = Work("gemm", "rows", 2.0 * C * 3 * C, C, 1, "qkv", tile)  # [r,C]x[C,3C]
    attn = Work("attention", "rows", 4.0 * T * C, size_per_unit=4.0 * T * C,
                name="attention")  # r rows vs T keys; speed by the call's FLOPs
    out = Work("gemm", "rows", 2.0 * C * C, C, 1, "o-proj", tile)
    ln = Work("elementwise", "rows", 1.0 * C, name="add+ln")
    up = Work("gemm", "rows", 2.0 * C * F, C, 1, "ffn up", tile)
    down = Work("gemm", "rows", 2.0 * F * C, C, 1, "ffn down", tile)
    kv = Collective("allgatherv", "rows", F32 * 2 * C, "K/V rows")
    body = (attn, out, ln, up, down, ln)
    start = _preamble(B, T) + [
        Phase((_embed(cfg, M),), Collective("scatterv", "rows", F32 * C, "input rows"), "embed+scatter"),
        Phase((qkv,), kv, "layer 0 qkv"),
    ]
    layer = [Phase(body + (qkv,), kv, "layer")]
    end = [Phase(body, Collective("gatherv", "rows", F32 * C, "output rows"), "last layer")]
    memory = [
        MemTerm("weights", ACTIVE, float(layer_bytes(cfg)), per_layer=True),
        MemTerm("weights", ROOT, float(embedding_bytes(cfg))),
        MemTerm("activations", ACTIVE, F32 * (2.0 * M * C + T * T + B * T)),  # all K/V, scores
        MemTerm("activations", "rows", F32 * (9.0 * C + F)),  # x, qkv, ctx, ffn hidden, outputs
        MemTerm("activations", ROOT, F32 * 4.0 * M * C),  # embedding temporaries, gathered output
        MemTerm("buffers", ACTIVE, F32 * 2.0 * M * C),  # Allgatherv temporaries
    ]
    memory = with_overhead(memory)
    return Program("rows", {"rows": M}, start, layer, end, L - 1, memory, n_layers=L)


def _tensor_layer(cfg: BertConfig, B: int, T: int, last: bool) -> list[Phase]:
    C, D, M = cfg.hidden_size, cfg.head_dim, B * T
    qkv = Work("gemm", "heads", 2.0 * M * C * 3 * D, min(M, C), 3 * D, "qkv")  # [M,C]x[C,3hD]
    attn = Work("attention", "heads", 4.0 * M * T * D, size_per_unit=4.0 * M * T * D,
                name="attention")  # speed by the call's FLOPs
    out = Work("gemm", "heads", 2.0 * M * D * C, min(M, C), D, "o-proj")  # [M,hD]x[hD,C]
    ln = Work("elementwise", "rows", 1.0 * C, name="add+ln")
    up = Work("gemm", "ffn", 2.0 * M * C, min(M, C), 1, "ffn up", GEMM_COL_PANEL)  # [M,C]x[C,f]
    down = Work("gemm", "ffn", 2.0 * M * C, min(M, C), 1, "ffn down")  # [M,f]x[f,C]
    rs = Collective("reduce_scatter", "rows", F32 * C, "partial sums")
    ag = Collective("allgatherv", "rows", F32 * C, "rows")
    final = Collective("gatherv", "rows", F32 * C, "output rows") if last else ag
    return [Phase((qkv, attn, out), rs, "attention"), Phase((ln,), ag, "add+ln 1"),
            Phase((up, down), rs, "ffn"), Phase((ln,), final, "add+ln 2")]


def _slice_bytes(cfg: BertConfig) -> dict[str, float]:
    """Stored bytes of one layer's slice per head (Q, K, V, O rows + QKV bias) and per FFN
    column (up and down rows + bias); plus 6 C whole vectors (hepti.model.sizes.layer_slice_bytes)."""
    C, D = cfg.hidden_size, cfg.head_dim
    return {"heads": F32 * (4.0 * D * C + 3 * D), "ffn": F32 * (2.0 * C + 1)}


def _tensor_memory(cfg: BertConfig, B: int, T: int) -> list[MemTerm]:
    """What a `tensor` rank holds, before `with_overhead` (`stream` holds a window instead)."""
    C, D, M = cfg.hidden_size, cfg.head_dim, B * T
    per = _slice_bytes(cfg)
    return [
        MemTerm("weights", "heads", per["heads"], per_layer=True),
        MemTerm("weights", "ffn", per["ffn"], per_layer=True),
        MemTerm("weights", ACTIVE, F32 * 6.0 * C, per_layer=True),
        MemTerm("weights", ROOT, float(embedding_bytes(cfg))),
        MemTerm("activations", ACTIVE, F32 * (4.0 * M * C + T * T + B * T)),  # x, partials, scores
        MemTerm("activations", "heads", F32 * 4.0 * M * D),  # qkv [M,3hD], ctx [M,hD]
        MemTerm("activations", "ffn", F32 * 1.0 * M),  # ffn hidden [M, f]
        MemTerm("activations", "rows", F32 * 2.0 * C),  # own rows after Reduce_scatter
        MemTerm("activations", ROOT, F32 * 3.0 * M * C),  # embedding temporaries, output
        MemTerm("buffers", ACTIVE, F32 * 1.0 * M * C),  # collective temporaries
    ]


def tensor_program(cfg: BertConfig, B: int, T: int, name: str = "tensor") -> Program:
    """`tensor` (also `even`, `single`): heads, FFN columns and token rows split by ratio."""
    H, F, L, M = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers, B * T
    start = _preamble(B, T) + [
        Phase((_embed(cfg, M),), Collective("bcast", None, F32 * M * cfg.hidden_size, "input"),
              "embed+bcast")]
    return Program(name, {"heads": H, "ffn": F, "rows": M}, start,
                   _tensor_layer(cfg, B, T, last=False), _tensor_layer(cfg, B, T, last=True),
                   L - 1, with_overhead(_tensor_memory(cfg, B, T)), integer_dims=("heads",), n_layers=L)


def stream_program(cfg: BertConfig, B: int, T: int, window: int) -> Program:
    """`stream`: `tensor` with `window` layers of slices in RAM, the next read while computing.
    The `end` phases are the last layer, so the per-layer read bound applies to them too.

    Besides waiting for the disk (`Stream`, overlapped with compute when window >= 2), the
    prefetch thread spends CPU on every layer's slices (checksum, copy, pack: the profile's
    `weight_load_Bps`). That CPU is the rank's own, shared with its compute on a capped device,
    so each layer's phases carry it as "load" Work: its heads' slices (Q, K, V, O rows and QKV
    bias) in the attention phase, its FFN columns in the FFN phase, which is about when the
    prefetch thread makes them (it starts the next layer's slices, heads first, as a layer
    begins). The 6 C whole vectors per layer (18 KiB) are left out. On a device with a core to
    spare for the prefetch thread this over-counts; leave `weight_load_Bps` out there."""
    per_unit = _slice_bytes(cfg)
    prog = tensor_program(cfg, B, T, "stream")
    # A window's peak is set by the runtime's budget (window = budget // slice bytes) and stays
    # within it plus a constant (tests/mpi): no `with_overhead` for the whole model here.
    prog.memory = _tensor_memory(cfg, B, T)
    prog.stream = Stream(per_unit, F32 * 6.0 * cfg.hidden_size, window)
    load = {"attention": Work("load", "heads", per_unit["heads"], name="load heads"),
            "ffn": Work("load", "ffn", per_unit["ffn"], name="load ffn")}

    def with_load(phases: list[Phase]) -> list[Phase]:
        return [Phase(p.works + (load[p.name],), p.collective, p.name) if p.name in load else p
                for p in phases]

    prog.layer, prog.end = with_load(prog.layer), with_load(prog.end)
    return prog


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


def program_for(strategy: str, cfg: BertConfig, B: int, T: int, window: int = 2) -> Program:
    if strategy == "rows":
        return rows_program(cfg, B, T)
    if strategy in ("tensor", "even", "single"):
        return tensor_program(cfg, B, T, strategy)
    if strategy == "stream":
        return stream_program(cfg, B, T, window)
    raise ValueError(f"no program for strategy {strategy!r}")
