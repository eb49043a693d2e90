"""`hepti run`: check every input, then one pass over the batches, each pooled and written as
it completes; time the pass that runs anyway.

The engine is the family's single-device one (hepti.parallel.single `SINGLE`: its executor on
a group of one process) or, under mpiexec, its kind's job from hepti.parallel.engine (`JOBS`).
Both have `run_all(batches, n, on_output)`, which calls on_output(k, hidden [B, T, C]) on the
primary rank as batch k completes, so the primary holds a batch or two, never the whole
input's hidden states. The pieces here (`prepare`, `Feed`, `Sink`,
`run_passes`, `finish`) are shared by both paths.

Timing: pass 1 is the real job (it writes the output) and is timed; its forward time is its
wall time less what the primary spent making batches and pooling and writing them. `--repeat
N` (N > 1) is a benchmark option: a warm-up on the first batch, then pass 1, then N - 1 more
passes that write nothing, and `latency_s` is the median of the N passes' forward times.
"""
from __future__ import annotations

import json
import logging
import statistics
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
import hashlib

import numpy as np

from hepti.errors import InputError
from hepti.inputs import (InputSource, check_output_path, npy_output_path, read_npy,
                          read_texts)
from hepti.model.pooling import pool
from hepti.output import OutputFile
from hepti.images import check_pixels, load_preprocessor, preprocess
from hepti.model.cnn import top_k
from hepti.families import FAMILIES, family, load_kernels
from hepti.model.tokenize import TextTokenizer
from hepti.parallel.single import SINGLE
from hepti.weights import WeightStore
from hepti.weights.cnn import read_labels

log = logging.getLogger("hepti")
EXECUTORS = tuple(SINGLE)  # of hepti.families.EXECUTORS: what `hepti run` runs
SHOW_SIMILARITY_MAX = 12  # texts: up to this many, the summary prints their similarity table


def open_inputs(args, config, model_dir: Path) -> InputSource:
    """--text/--input/--input-ids as an InputSource, every input checked (and texts counted
    in tokens) before any model work."""
    bs = args.batch_size
    image, pixels = getattr(args, "image", None), getattr(args, "input_pixels", None)
    fam = family(config)
    vision = "pixels" in fam.inputs
    if (image or pixels) and not vision:
        raise InputError(f"--image and --input-pixels are for vision models; {model_dir} is a "
                         f"{config.model_type} model: give it --text, --input or --input-ids")
    if vision and not (image or pixels):
        raise InputError(f"{model_dir} is a vision model ({config.model_type}): give it "
                         "--image FILE ... or --input-pixels FILE.npy")
    if image or pixels:
        return open_pixels(image, pixels, config, model_dir, bs)
    if args.input_ids:
        return InputSource.from_ids(args.input_ids, config, bs)
    texts = read_texts(args.text, args.input)
    max_len = min(config.max_position_embeddings, args.seq or config.max_position_embeddings)
    tok = TextTokenizer(model_dir / "tokenizer.json", max_len, pad_id=config.pad_token_id)
    return InputSource.from_texts(texts, tok, bs, args.seq, config.pad_token_id)


def open_pixels(image, pixels, config, model_dir: Path, bs: int) -> InputSource:
    """--image files preprocessed as the model's preprocessor config says, or --input-pixels,
    checked against the model's image size and channels."""
    if image:
        pre = load_preprocessor(model_dir)
        if pre["defaults_used"]:
            log.warning("%s has no preprocessor_config.json: using ViT's defaults (resize to "
                        "224x224, bilinear, x/255, mean and std 0.5)", model_dir)
        arr = preprocess(image, pre)
        h = hashlib.sha256()
        for p in image:
            h.update(Path(p).read_bytes())
        digest = h.hexdigest()
    else:
        arr = read_npy(pixels, "--input-pixels")
        digest = hashlib.sha256(Path(pixels).read_bytes()).hexdigest()
    fam = family(config)
    if fam.any_image_size:  # any height and width the network does not shrink to 0
        arr = check_pixels(arr, None, config.num_channels)
        try:
            fam.graph(config).shapes(*arr.shape[2:])
        except ValueError as e:
            raise InputError(f"pixels [{', '.join(map(str, arr.shape))}]: {e}") from None
    else:
        arr = check_pixels(arr, config.image_size, config.num_channels)
    return InputSource.from_pixels(arr, config, bs, digest)


def output_shape(args, config, source: InputSource) -> tuple[int, ...]:
    if family(config).output == "logits":
        return (source.n, config.num_classes)
    C = config.hidden_size
    return (source.n, max(source.lengths), C) if args.pool == "none" else (source.n, C)


def check_flags(args) -> None:
    """Flags that would fail only after the work: the report and trace files."""
    check_output_path(args.report, "--report")
    check_output_path(getattr(args, "trace", None), "--trace")
    if getattr(args, "top", None) is not None and args.top < 1:
        raise InputError(f"--top {args.top}: give a number of classes, 1 or more")
    if args.resume and not args.output:
        raise InputError("--resume continues an interrupted --output file; give the same "
                         "--output as the run that was interrupted")


@dataclass
class Prepared:
    source: InputSource
    out: OutputFile | None


def prepare(args, config, model_dir: Path) -> Prepared:
    """Check every input and open the output (resuming if asked), before any weights load."""
    path = npy_output_path(args.output, getattr(args, "force", False), args.resume)
    check_flags(args)
    fam = family(config)
    if fam.executor not in EXECUTORS:
        raise InputError(f"{model_dir} is a {fam.label} {fam.executor} ({config.model_type}); "
                         f"`hepti run` runs the families whose executor is "
                         f"{' or '.join(EXECUTORS)}: "
                         f"{', '.join(f.model_type for f in FAMILIES.values() if f.executor in EXECUTORS)}")
    logits = fam.output == "logits"
    if logits and (args.normalize or args.pool == "none"):
        raise InputError(f"{model_dir} is an image classifier: its output is the logits [n, "
                         f"{config.num_classes}]; --normalize and --pool none are for encoders")
    if not logits and getattr(args, "top", None) is not None:
        raise InputError(f"--top is for image classifiers; {model_dir} is a {config.model_type} "
                         "encoder, whose output is embeddings")
    if logits and args.top is None and getattr(args, "image", None):
        args.top = 5
    source = open_inputs(args, config, model_dir)
    out = None
    if path is not None:
        job = {"model": config.name or Path(model_dir).name,
               "model_shape": config.shape,
               "inputs": source.digest, "seq": args.seq, "pool": args.pool,
               "normalize": bool(args.normalize)}
        out = OutputFile(path, output_shape(args, config, source), args.batch_size, job,
                         resume=args.resume)
    elif args.repeat == 1 and not (keeps_for_summary(args, source.n) and
                                   (not args.json or getattr(args, "top", None) is not None)):
        log.warning("no --output: the %d result(s) will be computed but neither saved nor "
                    "shown; add --output FILE.npy to keep them", source.n)
    return Prepared(source, out)


def keeps_for_summary(args, n: int) -> bool:
    """Whether pass 1 keeps results for the summary: a classifier's top classes (printed, and in
    --json's report), or the rows of a few --text inputs for the similarity table (printed
    unless --json). `prepare` warns when nothing would be shown or saved."""
    return getattr(args, "top", None) is not None or (
        args.pool != "none" and args.text is not None and 1 < n <= SHOW_SIMILARITY_MAX)


class Feed:
    """Batches [start, n) for one pass, made on demand; keeps each batch's mask until the sink
    pools it, and the seconds spent making them (tokenising), which are not forward time."""

    def __init__(self, source: InputSource, start: int, stop: int | None = None):
        self.source, self.start = source, start
        self.stop = source.n_batches if stop is None else stop
        self.masks: dict[int, np.ndarray] = {}
        self.seconds = 0.0

    def __iter__(self):
        for k in range(self.start, self.stop):
            t0 = time.perf_counter()
            b = self.source.batch(k)
            self.masks[k] = b.mask
            self.seconds += time.perf_counter() - t0
            yield b


class Sink:
    """Pools each completed batch and writes it at its rows; keeps a few results for the
    summary's similarity table; advances the progress bar. Counts its own seconds."""

    def __init__(self, args, feed: Feed, out: OutputFile | None, bar=None, keep: bool = False):
        self.args, self.feed, self.out, self.bar = args, feed, out, bar
        self.kept: list[np.ndarray] | None = [] if keep else None
        self.seconds = 0.0
        self.width = max(feed.source.lengths) if args.pool == "none" else None

    def __call__(self, i: int, hidden: np.ndarray) -> None:
        t0 = time.perf_counter()
        k = self.feed.start + i
        rows = pool(hidden, self.feed.masks.pop(k), self.args.pool, self.args.normalize)
        if self.width is not None and rows.shape[1] < self.width:  # hidden states, zero-padded
            rows = np.pad(rows, ((0, 0), (0, self.width - rows.shape[1]), (0, 0)))
        if self.out is not None:
            self.out.write(k, rows)
        if self.kept is not None and getattr(self.args, "top", None) is not None:
            self.kept.extend(top_k(rows, self.args.top))
        elif self.kept is not None:
            self.kept.append(rows)
        self.seconds += time.perf_counter() - t0
        if self.bar is not None:
            self.bar.update()


def progress_bar(args, source: InputSource, start: int):
    """A bar over the batches this pass computes (none for one batch, or under --json when
    stderr is not a terminal, where nobody would see it)."""
    if source.n_batches - start <= 1 or (args.json and not sys.stderr.isatty()):
        return None
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)
    return tqdm(total=source.n_batches, initial=start, desc="batches", unit="batch",
                file=sys.stderr, dynamic_ncols=True)


def run_passes(job, prep: Prepared | None, n: int, args, start_pass=None, end_pass=None,
               watch=None) -> list[dict]:
    """Pass 1 over the n batches left to compute, through job.run_all, writing as it goes; with
    --repeat N, a warm-up on one batch first and N - 1 timed passes after. Returns one dict per
    pass: wall, forward, inputs and output seconds. Every rank of a distributed job calls this,
    the primary with its inputs and output (`prep`), the others with None; start_pass and
    end_pass are the job's barrier and per-pass counters. `watch` (the primary's, from
    hepti.parallel.watchdog) is told when each pass starts and each batch completes, so it
    knows how long the batch in progress has run; each batch is written holding its lock, so
    a stall declared meanwhile finds whole batches in the output."""
    primary = prep is not None
    start = prep.out.start if primary and prep.out is not None else 0
    watch = watch if primary else None  # another rank's side only beats
    if watch is not None:
        watch.follow(prep.out, prep.source.n_batches, args.repeat)
    if args.repeat > 1 and n > 0:  # JIT, first touch, caches: on one batch, not the input
        if watch is not None:
            watch.begin(start, warmup=True)
        job.run_all(Feed(prep.source, start, start + 1) if primary else (), 1)
    runs = []
    for p in range(args.repeat if n > 0 else 0):
        feed = sink = bar = None
        if primary:
            feed = Feed(prep.source, start)
            bar = progress_bar(args, prep.source, start) if p == 0 else None
            keep = p == 0 and keeps_for_summary(args, prep.source.n)
            sink = Sink(args, feed, prep.out if p == 0 else None, bar, keep)
        on_output = sink
        if watch is not None:  # the pass's barrier counts as its first batch's time
            # before `begin`: its beats tell the other ranks whether rank 0's bar holds a line
            # open, and the bar drew its first line when it was made
            watch.bar_open = bar is not None
            watch.begin(start, p)

            def on_output(i, hidden, sink=sink):
                with watch.lock:
                    sink(i, hidden)
                watch.batch_done(start + i)
        if start_pass:
            start_pass()
        t0 = time.perf_counter()
        try:
            job.run_all(feed if primary else (), n, on_output)
        finally:
            if bar is not None:
                bar.close()
            if watch is not None:
                watch.bar_open = False
        wall = time.perf_counter() - t0
        own = (feed.seconds + sink.seconds) if primary else 0.0
        runs.append({"wall_s": wall, "forward_s": wall - own,
                     "inputs_s": feed.seconds if primary else 0.0,
                     "output_s": sink.seconds if primary else 0.0,
                     "kept": sink.kept if primary else None})
        if end_pass:
            end_pass(runs[-1])
    if watch is not None:
        watch.end()
    if primary and prep.out is not None:
        with watch.lock if watch is not None else nullcontext():
            prep.out.commit()
    return runs


class SingleJob:
    """The single-device engine behind the same run_all as a distributed Job."""

    def __init__(self, engine):
        self.engine = engine

    def run_all(self, batches, n: int, on_output=None) -> None:
        for i, b in enumerate(batches):
            hidden = self.engine.run(b)
            if on_output is not None:
                on_output(i, hidden)


def run_single(args) -> int:
    """The single-device job (no MPI)."""
    t_start = time.perf_counter()
    store = WeightStore(args.model)
    config = store.config
    prep = prepare(args, config, Path(args.model))
    try:
        import numba  # local: start-up time (numba loads in about 0.5 s)
        numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
        t0 = time.perf_counter()
        load_kernels(config, args.threads, dtype=store.dtype)  # as a Job does: passes time forwards, not compiles
        # the family's executor on a group of one process
        engine = SINGLE[family(config).executor].from_store(store, threads=args.threads)
        load_s = time.perf_counter() - t0
        start = prep.out.start if prep.out is not None else 0
        runs = run_passes(SingleJob(engine), prep, prep.source.n_batches - start, args)
    finally:
        if prep.out is not None:
            prep.out.close()
    report = {
        **base_report(args, config, prep, load_s, runs, "single", 1, t_start),
        "weight_bytes_resident": engine.layer_bytes + engine.primary_bytes,
        "weight_bytes_read": store.bytes_read,
    }
    finish(args, report, runs)
    return 0


def base_report(args, config, prep: Prepared, load_s: float, runs: list[dict], strategy: str,
                world_size: int, t_start: float) -> dict:
    """The fields every `hepti run --json` report has, single-device or distributed."""
    source, out = prep.source, prep.out
    start = out.start if out is not None else 0
    forward = [r["forward_s"] for r in runs]
    first = runs[0] if runs else {"wall_s": 0.0, "forward_s": 0.0, "inputs_s": 0.0, "output_s": 0.0}
    return {
        "model": config.name or Path(args.model).name,
        "strategy": strategy,
        "world_size": world_size,
        "n_inputs": source.n,
        "batches": source.n_batches,
        "resumed_from_batch": start if out is not None and out.resumed else None,
        "tokens": source.lengths,
        "pool": args.pool,
        "classes": getattr(config, "num_classes", None),
        "threads": args.threads,
        "load_s": load_s,
        # pass 1, the one that wrote the output: its wall time, the forwards' share of it, and
        # the primary's own work between them (making batches; pooling and writing them)
        "pass_s": {k: first[k] for k in ("wall_s", "forward_s", "inputs_s", "output_s")},
        "elapsed_s": time.perf_counter() - t_start,
        "latency_s": {"median": statistics.median(forward) if forward else 0.0, "runs": forward},
    }


def similarity_table(texts: list[str], emb: np.ndarray) -> str:
    e = emb / np.maximum(np.linalg.norm(emb, axis=1, keepdims=True), 1e-12)
    sim = e @ e.T
    names = [f"[{i}]" for i in range(len(texts))]
    lines = ["cosine similarity:"] + [f"  {n} {t[:60]}" for n, t in zip(names, texts)]
    lines.append("       " + " ".join(f"{n:>6}" for n in names))
    for i, n in enumerate(names):
        lines.append(f"  {n:>4} " + " ".join(f"{sim[i, j]:6.3f}" for j in range(len(names))))
    return "\n".join(lines)


def top_classes(args, runs: list[dict]) -> list[dict] | None:
    """A classifier's --top K: per input, its K best classes (id, label, probability)."""
    kept = runs[0]["kept"] if runs else None
    if not kept or getattr(args, "top", None) is None:
        return None
    labels = read_labels(args.model)
    names = [str(p) for p in args.image] if getattr(args, "image", None) else None
    out = []
    for i, row in enumerate(kept):
        out.append({"input": names[i] if names else i, "top": [
            {"class": c, "label": labels[c] if labels and c < len(labels) else None,
             "probability": p} for c, p in row]})
    return out


def top_table(top: list[dict]) -> str:
    lines = []
    for t in top:
        lines.append(f"{t['input']}:")
        lines += [f"  {c['probability']:6.3f}  {c['class']:>4}  {c['label'] or ''}"
                  for c in t["top"]]
    return "\n".join(lines)


def finish(args, report: dict, runs: list[dict]) -> None:
    """Write --report, then print --json or a human summary (primary rank only). The output
    itself is already written, batch by batch."""
    if args.output:
        report["output"] = str(args.output)
    top = top_classes(args, runs)
    if top is not None:
        report["top"] = top
    if args.report:
        Path(args.report).write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report, indent=2))
        return
    n, shape_tail = report["n_inputs"], ("L", "C") if args.pool == "none" else ("C",)
    if report.get("classes"):
        print(f"model {report['model']}: {n} image(s) -> logits [{n}, {report['classes']}]")
    else:
        print(f"model {report['model']}: {n} input(s) -> {args.pool} "
              f"{'normalised ' if args.normalize else ''}output [{n}, {', '.join(shape_tail)}]")
    if report["resumed_from_batch"] is not None:
        print(f"resumed at batch {report['resumed_from_batch']} of {report['batches']}: the "
              f"earlier run's rows were kept")
    lat, ps = report["latency_s"], report["pass_s"]
    if len(lat["runs"]) > 1:
        print(f"forward {lat['median'] * 1e3:.1f} ms (median of {len(lat['runs'])} passes over "
              f"{report['batches']} batch(es)), strategy {report['strategy']}, "
              f"{report['world_size']} rank(s)")
    elif lat["runs"]:
        print(f"forward {lat['median'] * 1e3:.1f} ms over {report['batches']} batch(es) "
              f"({ps['wall_s'] * 1e3:.1f} ms with preparing inputs, pooling and writing), strategy "
              f"{report['strategy']}, {report['world_size']} rank(s)")
    kept = runs[0]["kept"] if runs else None
    if kept and report.get("top"):
        print(top_table(report["top"]))
    elif kept:
        print(similarity_table(args.text, np.concatenate(kept)))
    if args.output:
        print(f"wrote {args.output}")
