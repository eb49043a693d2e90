"""`hepti bench model`: median single-thread forward latency of an encoder, against PyTorch and
onnxruntime, and against the limit the GeMM peak sets, all interleaved in one run.

None of the others is a dependency: when torch and transformers import, the same weights are
loaded into transformers' BertModel (sdpa attention, 1 thread); when onnx and onnxruntime import
too, that model is exported to ONNX (written out as transformers 4's BertModel was, since the
fusions do not recognise transformers 5's attention: `classic_bert`) and run by
onnxruntime twice: as exported (`ort`, every ORT graph optimisation) and after the
onnxruntime.transformers optimizer's BERT fusions (`ort-fused`: Attention,
SkipLayerNormalization, Gelu), both with 1 intra-op thread.
`gemm-peak` is a variant of the same rounds: hepti's pre-packed `gemm` on the transformer
shapes of `hepti bench kernels`, whose best median GFLOP/s is the peak; the model's FLOPs
(`model_flops`: its GeMMs and attention's two products) over that peak are the limit, and
hepti's median over the limit the ratio the issue asks about. CPU time (the calling thread's,
on which every engine computes at 1 thread) is reported beside wall time: on a loaded, shared
machine the scheduler preempts a whole forward far more than a 1 ms GeMM, which inflates the
wall-time ratio to the limit; the CPU-time one is not. Every engine runs alternately on
the same input in interleaved rounds (hepti.bench.harness), so machine noise hits all alike;
the ratios to quote are the medians of each round's ratio.
"""
from __future__ import annotations

import json
import math
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

from hepti.bench.cnnsingle import ort_session, settled
from hepti.bench.harness import interleave, positive_int, summarise
from hepti.bench.kernels import TRANSFORMER_SHAPES
from hepti.kernels import gemm, pack_b
from hepti.bench.registry import module_main
from hepti.weights.layout import HF_LAYER_MAP, HF_OTHER_MAP
from hepti.parallel.single import BertEncoder
from hepti.weights import WeightStore

_PEAK_REPS = 3  # gemm calls per shape in each round of the peak variant, a weight each in turn


def synthetic_batch(config, batch: int, seq: int, seed: int = 0):
    """Deterministic random ids [batch, seq] (no padding): a fixed-shape input for timing."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000 if config.vocab_size > 2000 else 1, config.vocab_size, (batch, seq))
    ids[:, 0] = min(101, config.vocab_size - 1)  # [CLS] for BERT vocabularies
    return ids.astype(np.int64), np.ones((batch, seq), np.int64)


def model_flops(config, batch: int, seq: int) -> dict:
    """An encoder forward's FLOPs (2 per multiply-add): the GeMMs (QKV, output projection, the
    two MLP ones) and attention's two products (Q K^T and P V), every layer; the embeddings,
    softmax and LayerNorms are left out (a few MFLOP, not GeMM work)."""
    M, C, F = batch * seq, config.hidden_size, config.intermediate_size
    gemm = 2.0 * M * C * (3 * C + C + 2 * F) * config.num_hidden_layers
    attention = 2.0 * 2 * batch * seq * seq * C * config.num_hidden_layers
    return {"gemm": gemm, "attention": attention, "total": gemm + attention}


def torch_model(store, threads: int = 1):
    """transformers BertModel holding the store's weights, or None when torch isn't importable."""
    try:
        import torch  # local: optional dependency
        try:  # an installed torchvision (bin/setup --with-torch) must import first, or
            # transformers' BertModel import fails beside a CPU-only torch
            from hepti.bench.cnnsingle import import_torchvision  # local: only beside torch
            import_torchvision()
        except ImportError:
            pass
        import transformers  # local: optional dependency
    except ImportError:
        return None
    cfg = store.config
    hf_cfg = transformers.BertConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        intermediate_size=cfg.intermediate_size, max_position_embeddings=cfg.max_position_embeddings,
        type_vocab_size=cfg.type_vocab_size, layer_norm_eps=cfg.layer_norm_eps, hidden_act="gelu")
    model = transformers.BertModel(hf_cfg, add_pooling_layer=False).eval()
    sd = {}
    for hf, (ours, tr) in HF_OTHER_MAP.items():
        if store.has(ours) and not ours.startswith("pooler") and not hf.endswith(("gamma", "beta")):
            a = store.read(ours)
            sd[hf] = torch.from_numpy(np.ascontiguousarray(a.T if tr else a))
    for i in range(cfg.num_hidden_layers):
        for hf, (ours, tr) in HF_LAYER_MAP.items():
            a = store.read(f"layer.{i}.{ours}")
            sd[f"encoder.layer.{i}.{hf}"] = torch.from_numpy(np.ascontiguousarray(a.T if tr else a))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"torch weight mapping failed: missing {missing}, unexpected {unexpected}")
    torch.set_num_threads(int(threads))
    return model


def classic_bert(tm):
    """transformers 4.x's BertModel forward written out (view/permute heads, Div by sqrt(D),
    additive extended mask), on tm's modules: the graph onnxruntime.transformers' fusions match."""
    import torch  # local: optional dependency (torch)
    cfg = tm.config
    H = cfg.num_attention_heads
    D = cfg.hidden_size // H

    class Classic(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = tm

        def forward(self, input_ids, attention_mask):
            emb = self.bert.embeddings
            B, T = input_ids.shape
            pos = torch.arange(T, dtype=torch.long).unsqueeze(0)
            tt = torch.zeros_like(input_ids)
            x = emb.word_embeddings(input_ids) + emb.token_type_embeddings(tt) + emb.position_embeddings(pos)
            x = emb.LayerNorm(x)
            ext = (1.0 - attention_mask[:, None, None, :].to(torch.float32)) * torch.finfo(torch.float32).min
            def heads(y):
                return y.view(y.size()[:-1] + (H, D)).permute(0, 2, 1, 3)
            for layer in self.bert.encoder.layer:
                a = layer.attention
                q = heads(a.self.query(x))
                k = heads(a.self.key(x))
                v = heads(a.self.value(x))
                s = torch.matmul(q, k.transpose(-1, -2))
                s = s / math.sqrt(D)
                s = s + ext
                p = torch.nn.functional.softmax(s, dim=-1)
                c = torch.matmul(p, v).permute(0, 2, 1, 3).contiguous()
                c = c.view(c.size()[:-2] + (H * D,))
                x = a.output.LayerNorm(a.output.dense(c) + x)
                h = layer.intermediate.dense(x)
                h = torch.nn.functional.gelu(h)
                x = layer.output.LayerNorm(layer.output.dense(h) + x)
            return x
    return Classic().eval()


def ort_sessions(store, ids: np.ndarray, mask: np.ndarray, folder: Path,
                 threads: int = 1) -> tuple[dict, dict]:
    """({"ort": session, "ort-fused": session}, fused model's op counts), or ({}, {}) when onnx
    or onnxruntime isn't importable. The store's weights in `classic_bert`, exported
    (TorchScript exporter, opset 17, fixed shapes) to folder/model.onnx; `ort-fused` is that
    file after onnxruntime.transformers' optimize_model(model_type="bert"). Each session runs
    as cnn-single's do (`ort_session`: `threads` intra-op threads, every graph
    optimisation)."""
    try:
        import onnx  # noqa: F401  (torch.onnx.export needs it)
        import onnxruntime  # noqa: F401  (local: optional dependency; ort_session's)
        import torch  # local: optional dependency
        from onnxruntime.transformers import optimizer  # local: optional dependency
    except ImportError:
        return {}, {}
    cfg = store.config
    tm = torch_model(store, threads)
    if tm is None:
        return {}, {}
    plain, fused = folder / "model.onnx", folder / "model-fused.onnx"

    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        torch.onnx.export(classic_bert(tm), (torch.from_numpy(ids), torch.from_numpy(mask)), str(plain),
                          opset_version=17, dynamo=False,
                          input_names=["input_ids", "attention_mask"],
                          output_names=["last_hidden_state"])
        opt = optimizer.optimize_model(str(plain), model_type="bert",
                                       num_heads=cfg.num_attention_heads,
                                       hidden_size=cfg.hidden_size, use_gpu=False)
        opt.save_model_to_file(str(fused))
    ops: dict[str, int] = {}
    for node in opt.model.graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return {"ort": ort_session(plain, threads), "ort-fused": ort_session(fused, threads)}, ops


def peak_variant(threads: int = 1):
    """(run(k) -> seconds, per-shape wall times, per-shape CPU times): hepti's `gemm` with B
    packed beforehand on the transformer shapes of `hepti bench kernels`
    (hepti.bench.kernels.TRANSFORMER_SHAPES), a few weights in turn as a model's layers use
    them; per shape and round, the fastest of those calls (B last read a few weights ago);
    on `threads` threads."""
    rng = np.random.default_rng(0)
    cases = []
    for m, k, n in TRANSFORMER_SHAPES:
        a = rng.standard_normal((m, k), dtype=np.float32)
        ws = [pack_b(rng.standard_normal((k, n), dtype=np.float32)) for _ in range(_PEAK_REPS)]
        cases.append(((m, k, n), a, ws, np.empty((m, n), np.float32)))
    wall = {shape: [] for shape, *_ in cases}
    cpu = {shape: [] for shape, *_ in cases}
    for _, a, ws, out in cases:
        gemm(a, ws[0], out=out, threads=threads)  # compile / warm up

    def run(_k: int) -> float:
        total = 0.0
        for shape, a, ws, out in cases:
            best, best_cpu = float("inf"), float("inf")
            for w in ws:
                c0, t0 = time.thread_time(), time.perf_counter()
                gemm(a, w, out=out, threads=threads)
                best = min(best, time.perf_counter() - t0)
                best_cpu = min(best_cpu, time.thread_time() - c0)
            wall[shape].append(best)
            cpu[shape].append(best_cpu)
            total += best
        return total
    return run, wall, cpu


def peak_of(times: dict) -> dict:
    """The best median GFLOP/s over the peak variant's shapes, and its shape."""
    rows = [(2.0 * m * k * n / float(np.median(ts)) / 1e9, (m, k, n)) for (m, k, n), ts in times.items()]
    gflops, shape = max(rows)
    return {"gflops": gflops, "shape": list(shape),
            "by_shape": {"x".join(map(str, s)): g for g, s in rows}}


def run_model_bench(model_dir: str, seq: int = 128, batch: int = 1, repeat: int = 30,
                    torch: bool = True, ort: bool = True, peak: bool = True,
                    progress: bool = True, threads: int = 1) -> dict:
    import numba  # local: start-up time (numba loads in about 0.5 s)
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)

    numba.set_num_threads(1)
    store = WeightStore(model_dir)
    cfg = store.config
    engine = BertEncoder.from_store(store, threads=threads)
    ids, mask = synthetic_batch(cfg, batch, min(seq, cfg.max_position_embeddings))
    tm = torch_model(store, threads) if torch else None
    tmp = tempfile.TemporaryDirectory(prefix="hepti-bench-model-")
    sessions, fused_ops = (ort_sessions(store, ids, mask, Path(tmp.name), threads) if ort
                           else ({}, {}))
    store.close()
    runs, outs = {}, {}

    def run_hepti():
        t0 = time.perf_counter()
        out = engine.forward(ids, mask)
        return time.perf_counter() - t0, out
    runs["hepti"] = run_hepti
    if threads > 1:  # the same engine on 1 thread, in the same rounds: the speedup
        executor = engine.engine.executor

        def run_hepti_1t():
            executor.threads = 1
            try:
                return run_hepti()
            finally:
                executor.threads = threads
        runs["hepti-1t"] = run_hepti_1t

    if tm is not None:
        import torch as th  # local: optional dependency (torch)
        tids, tmask = th.from_numpy(ids), th.from_numpy(mask)

        def run_torch():
            with th.inference_mode():
                t0 = time.perf_counter()
                out = tm(input_ids=tids, attention_mask=tmask).last_hidden_state
                return time.perf_counter() - t0, out.numpy()
        runs["torch"] = run_torch

    def ort_runner(sess):
        feed = {"input_ids": ids, "attention_mask": mask}
        feed = {i.name: feed[i.name] for i in sess.get_inputs()}

        def run_ort():
            t0 = time.perf_counter()
            out = sess.run(None, feed)[0]
            return time.perf_counter() - t0, out
        return run_ort
    for name, sess in sessions.items():
        runs[name] = ort_runner(sess)

    for _ in range(3):  # warm-up: JIT, caches, torch's and ORT's first-call setup
        for name, fn in runs.items():
            outs[name] = fn()[1]
    res = {"model": cfg.name or model_dir, "seq": int(ids.shape[1]), "batch": batch,
           "threads": threads, "repeat": repeat, "hepti_s": [], "torch_s": None}
    h = outs["hepti"].reshape(batch, -1, cfg.hidden_size)
    for name in runs:
        if name != "hepti":
            res[f"max_abs_diff_vs_{name}"] = float(np.abs(h - outs[name].reshape(h.shape)).max())
    if tm is not None:
        import torch as th  # local: optional dependency (torch)
        res["torch_version"] = th.__version__
    if sessions:
        import onnxruntime as ortlib  # local: optional dependency
        res["onnxruntime_version"] = ortlib.__version__
        res["ort_fused_ops"] = fused_ops
    cpu: dict[str, list] = {name: [] for name in runs}  # the calling thread's CPU seconds

    def cpu_timed(name):
        def timed_run():
            c0 = time.thread_time()
            wall = runs[name]()[0]
            cpu[name].append(time.thread_time() - c0)
            return wall
        return timed_run
    timed = {name: cpu_timed(name) for name in runs}
    peak_times = peak_cpu = None
    if peak:
        timed["gemm-peak"], peak_times, peak_cpu = peak_variant(threads)
    with tqdm(total=repeat * len(timed), desc="bench model", disable=not progress,
              file=sys.stderr) as bar:
        times = interleave(list(timed), repeat,
                           lambda name, k: settled(threads) or (
                               timed[name](k) if name == "gemm-peak" else timed[name]()),
                           bar)
    tmp.cleanup()
    # the ratio of each round's pair is robust to slow drifts of the shared machine
    fig = summarise({n: ts for n, ts in times.items() if n != "gemm-peak"}, baseline="hepti")
    res["hepti_s"], res["hepti_median_s"] = times["hepti"], fig["hepti"]["median"]
    if threads > 1:  # hepti on 1 thread over hepti on `threads`, round by round
        res["hepti_1t_s"], res["hepti_1t_median_s"] = times["hepti-1t"], fig["hepti-1t"]["median"]
        res["speedup"] = float(np.median([a / b for a, b in zip(times["hepti-1t"], times["hepti"])]))
    if tm is not None:
        res["torch_s"], res["torch_median_s"] = times["torch"], fig["torch"]["median"]
        res["ratio_torch_over_hepti"] = fig["torch"]["paired_ratio"]
    for name in sessions:
        key = name.replace("-", "_")
        res[f"{key}_s"], res[f"{key}_median_s"] = times[name], fig[name]["median"]
        res[f"ratio_{key}_over_hepti"] = fig[name]["paired_ratio"]
    flops = model_flops(cfg, batch, int(ids.shape[1]))
    res["flops"] = flops
    # CPU time (time.thread_time: every engine computes on the calling thread at 1 thread)
    # leaves out the time the scheduler gave other processes: on a shared machine a 15-70 ms
    # forward is preempted every round, a 1 ms GeMM of the peak rarely in its best of three
    if threads == 1:  # on more, the calling thread's CPU time leaves out the others'
        cfig = summarise(cpu, baseline="hepti")
        res["cpu"] = {name: {"median_s": cfig[name]["median"],
                             "ratio_over_hepti": cfig[name].get("paired_ratio")} for name in cpu}
    if peak_times is not None:
        pk = peak_of(peak_times)
        res["gemm_peak"] = pk
        limit = flops["total"] / (pk["gflops"] * 1e9)
        res["limit_s"] = limit
        res["hepti_over_limit"] = res["hepti_median_s"] / limit
        # per round: hepti's time over that round's limit (the peak shape's time in that round)
        m, k, n = pk["shape"]
        per_round = [t / (flops["total"] * p / (2.0 * m * k * n))
                     for t, p in zip(times["hepti"], peak_times[tuple(pk["shape"])])]
        res["hepti_over_limit_paired"] = float(np.median(per_round))
        if threads == 1:
            pkc = peak_of(peak_cpu)
            res["gemm_peak_cpu"] = pkc
            res["limit_cpu_s"] = flops["total"] / (pkc["gflops"] * 1e9)
            res["hepti_cpu_over_limit"] = res["cpu"]["hepti"]["median_s"] / res["limit_cpu_s"]
    res["hepti_gflops"] = flops["total"] / res["hepti_median_s"] / 1e9
    return res


def format_model_bench(res: dict) -> str:
    th = res.get("threads", 1)
    lines = [f"model {res['model']}, batch {res['batch']} x {res['seq']} tokens, {th} "
             f"thread{'s' if th > 1 else ''}, median of {res['repeat']} interleaved runs",
             f"  hepti     {res['hepti_median_s'] * 1e3:8.2f} ms  {res['hepti_gflops']:6.1f} GFLOP/s"]
    if res.get("speedup") is not None:
        lines.append(f"  hepti-1t  {res['hepti_1t_median_s'] * 1e3:8.2f} ms  (1 thread; speedup "
                     f"on {th}: {res['speedup']:.3f}, median of per-round ratios)")
    if res.get("torch_s") is not None:
        lines.append(f"  torch     {res['torch_median_s'] * 1e3:8.2f} ms  (PyTorch {res['torch_version']})")
    else:
        lines.append("  (PyTorch not importable: install it with `bin/setup --with-torch` to compare)")
    for key, label in (("ort", "ort      "), ("ort_fused", "ort-fused")):
        if res.get(f"{key}_median_s") is not None:
            lines.append(f"  {label} {res[f'{key}_median_s'] * 1e3:8.2f} ms  (onnxruntime "
                         f"{res['onnxruntime_version']}{', BERT fusions' if key == 'ort_fused' else ''})")
    for key in ("torch", "ort", "ort_fused"):
        if res.get(f"ratio_{key}_over_hepti") is not None:
            lines.append(f"  {key}/hepti time ratio {res[f'ratio_{key}_over_hepti']:.3f} "
                         f"(>1: hepti is faster); max |diff| "
                         f"{res[f'max_abs_diff_vs_{key.replace(chr(95), chr(45))}']:.2e}")
    if res.get("ort_fused_ops"):
        ops = res["ort_fused_ops"]
        lines.append("  ort-fused graph: " + ", ".join(
            f"{ops[o]} {o}" for o in ("Attention", "SkipLayerNormalization", "BiasGelu",
                                      "EmbedLayerNormalization", "FastGelu", "Gelu") if o in ops))
    fl = res["flops"]
    lines.append(f"  FLOPs {fl['total'] / 1e9:.3f} G (GeMMs {fl['gemm'] / 1e9:.3f}, "
                 f"attention {fl['attention'] / 1e9:.3f})")
    if res.get("gemm_peak"):
        pk = res["gemm_peak"]
        lines.append(f"  GeMM peak {pk['gflops']:.1f} GFLOP/s at {'x'.join(map(str, pk['shape']))} "
                     f"(same rounds) -> limit {res['limit_s'] * 1e3:.2f} ms; hepti / limit "
                     f"{res['hepti_over_limit']:.3f} (per round {res['hepti_over_limit_paired']:.3f})")
    if res.get("cpu"):
        c = res["cpu"]
        parts = [f"hepti {c['hepti']['median_s'] * 1e3:.2f} ms"] + [
            f"{n} {c[n]['median_s'] * 1e3:.2f} ms ({c[n]['ratio_over_hepti']:.3f}x hepti)"
            for n in c if n != "hepti"]
        lines.append("  CPU time (thread_time), medians: " + ", ".join(parts))
        if res.get("gemm_peak_cpu"):
            lines.append(f"  CPU-time GeMM peak {res['gemm_peak_cpu']['gflops']:.1f} GFLOP/s -> "
                         f"limit {res['limit_cpu_s'] * 1e3:.2f} ms; hepti CPU / limit "
                         f"{res['hepti_cpu_over_limit']:.3f}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="weights/minilm-l6", help="converted model (default %(default)s)")
    ap.add_argument("--seq", type=positive_int, default=128, help="tokens (default 128)")
    ap.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    ap.add_argument("--repeat", type=positive_int, default=30, help="timed rounds (default 30)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--no-ort", action="store_true",
                    help="skip onnxruntime (plain and with the BERT fusions)")
    ap.add_argument("--no-peak", action="store_true",
                    help="skip the GeMM peak (and so the limit ratio)")
    ap.add_argument("--threads", type=positive_int, default=1,
                    help="threads of every engine (hepti's, torch's, onnxruntime's intra-op) and "
                         "of the GeMM peak; above 1, hepti on 1 thread is timed in the same "
                         "rounds too (hepti-1t, and its speedup) (default 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    res = run_model_bench(args.model, seq=args.seq, batch=args.batch, repeat=args.repeat,
                          torch=not args.no_torch, ort=not args.no_ort, peak=not args.no_peak,
                          progress=not args.json, threads=args.threads)
    print(json.dumps(res, indent=2) if args.json else format_model_bench(res))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
