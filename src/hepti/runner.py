"""`hepti run`: read inputs, tokenise, batch, run an engine, pool, write outputs, time it.

The engine is the single-device `BertEncoder` or, under mpiexec, a distributed strategy from
hepti.parallel; both turn a batch of ids into hidden states [B, T, C] on the primary rank.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from hepti.errors import InputError
from hepti.inputs import Batch, check_output_path, pad_to, read_ids, read_texts
from hepti.model.pooling import pool

log = logging.getLogger("hepti")


def encode_inputs(args, config, model_dir: Path) -> list[Batch]:
    """Turn --text/--input/--input-ids into padded batches (each padded to its own longest)."""
    bs = args.batch_size
    if args.input_ids:
        ids, mask, tt = read_ids(args.input_ids)
        ids = np.asarray(ids)
        mask = np.ones(ids.shape, np.int64) if mask is None else np.asarray(mask)
        tt = np.zeros(ids.shape, np.int64) if tt is None else np.asarray(tt)
        if mask.shape != ids.shape or tt.shape != ids.shape:
            raise InputError(f"--input-ids: mask/token_type shapes {mask.shape}/{tt.shape} differ "
                             f"from ids {ids.shape}")
        from hepti.model.bert import validate_inputs
        validate_inputs(config, ids, mask, tt)  # fail before any work
        return [Batch(ids[i:i + bs], mask[i:i + bs], tt[i:i + bs]) for i in range(0, len(ids), bs)]
    texts = read_texts(args.text, args.input)
    from hepti.model.tokenize import TextTokenizer
    max_len = min(config.max_position_embeddings, args.seq) if args.seq else config.max_position_embeddings
    tok = TextTokenizer(model_dir / "tokenizer.json", max_len, pad_id=config.pad_token_id)
    batches = [Batch(*tok.encode(texts[i:i + bs])) for i in range(0, len(texts), bs)]
    if args.seq:
        batches = [pad_to(b, args.seq, config.pad_token_id) for b in batches]
    return batches


def assemble(outputs: list[np.ndarray], batches: list[Batch], pool_kind: str) -> np.ndarray:
    """Concatenate per-batch outputs; hidden states are zero-padded to the longest batch."""
    if pool_kind != "none":
        return np.concatenate(outputs)
    L = max(o.shape[1] for o in outputs)
    out = np.zeros((sum(o.shape[0] for o in outputs), L, outputs[0].shape[2]), np.float32)
    i = 0
    for o in outputs:
        out[i:i + len(o), :o.shape[1]] = o
        i += len(o)
    return out


def run_batches(forward, batches, args, progress: bool):
    """Run every batch through `forward`; return per-batch pooled outputs (None off the primary)."""
    from tqdm import tqdm

    outs = []
    # No tqdm object at all when no bar is shown: even a disabled one costs ~0.1 ms to make
    # and close, which every timed run (--repeat) would count.
    show = progress and len(batches) > 1
    it = tqdm(batches, desc="batches", unit="batch", file=sys.stderr) if show else batches
    for b in it:
        hidden = forward(b)
        if hidden is not None:
            outs.append(pool(hidden, b.mask, args.pool, args.normalize))
    return outs


def timed_runs(forward, batches, args, progress: bool):
    """One run (or a warm-up and --repeat timed runs); returns (outputs, latencies)."""
    outs = run_batches(forward, batches, args, progress)  # also the warm-up (JIT, caches)
    lat = []
    for _ in range(args.repeat if args.repeat > 1 else 0):
        t0 = time.perf_counter()
        outs = run_batches(forward, batches, args, False)
        lat.append(time.perf_counter() - t0)
    if not lat:  # a single run: time a second pass so the figure excludes compilation/loading
        t0 = time.perf_counter()
        outs = run_batches(forward, batches, args, False)
        lat.append(time.perf_counter() - t0)
    return outs, lat


def similarity_table(texts: list[str], emb: np.ndarray) -> str:
    e = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    sim = e @ e.T
    names = [f"[{i}]" for i in range(len(texts))]
    lines = ["cosine similarity:"] + [f"  {n} {t[:60]}" for n, t in zip(names, texts)]
    lines.append("       " + " ".join(f"{n:>6}" for n in names))
    for i, n in enumerate(names):
        lines.append(f"  {n:>4} " + " ".join(f"{sim[i, j]:6.3f}" for j in range(len(names))))
    return "\n".join(lines)


def run_single(args) -> int:
    """The single-device job (no MPI)."""
    from hepti.model.bert import BertEncoder
    from hepti.weights import WeightStore

    check_output_path(args.output)
    check_output_path(args.report, "--report")
    store = WeightStore(args.model)
    config = store.config
    batches = encode_inputs(args, config, Path(args.model))
    import numba
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    t0 = time.perf_counter()
    engine = BertEncoder.from_store(store, threads=args.threads)
    load_s = time.perf_counter() - t0

    def forward(b: Batch):
        return engine.forward(b.ids, b.mask, b.token_type)

    outs, lat = timed_runs(forward, batches, args, progress=not args.json)
    result = assemble(outs, batches, args.pool)
    report = {
        **base_report(args, config, result, batches, load_s, lat, "single", 1),
        "weight_bytes_resident": engine.layer_bytes + engine.embeddings.nbytes,
        "weight_bytes_read": store.bytes_read,
    }
    finish(args, result, report, batches)
    return 0


def base_report(args, config, result, batches, load_s: float, latencies: list[float],
                strategy: str, world_size: int) -> dict:
    """The fields every `hepti run --json` report has, single-device or distributed."""
    return {
        "model": config.name or Path(args.model).name,
        "strategy": strategy,
        "world_size": world_size,
        "n_inputs": int(result.shape[0]),
        "tokens": [int(b.ids.shape[1]) for b in batches],
        "pool": args.pool,
        "threads": args.threads,
        "load_s": load_s,
        "latency_s": {"median": statistics.median(latencies), "runs": latencies},
    }


def finish(args, result: np.ndarray, report: dict, batches) -> None:
    """Write --output and --report, then print --json or a human summary (primary rank only)."""
    if args.output:
        np.save(args.output, result)
        report["output"] = str(args.output)
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"model {report['model']}: {report['n_inputs']} input(s) -> {args.pool} "
          f"{'normalised ' if args.normalize else ''}output {tuple(result.shape)}")
    print(f"latency {report['latency_s']['median'] * 1e3:.1f} ms (median of "
          f"{len(report['latency_s']['runs'])}), strategy {report['strategy']}, "
          f"{report['world_size']} rank(s)")
    texts = args.text or (read_texts(None, args.input) if args.input else None)
    if texts and args.pool != "none" and 1 < len(texts) <= 12:
        print(similarity_table(texts, result))
    if args.output:
        print(f"wrote {args.output}")
