"""`hepti bench model`: median single-thread forward latency, with PyTorch interleaved if present.

PyTorch is never a dependency: when torch and transformers import, the same weights are loaded
into transformers' BertModel (sdpa attention, 1 thread) and both engines run alternately on the
same input in interleaved rounds (hepti.bench.harness), so machine noise hits both alike; the
ratio (the median of each round's torch / hepti) is the figure to quote.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from hepti.bench.harness import interleave, positive_int, summarise
from hepti.bench.registry import module_main
from hepti.weights.layout import HF_LAYER_MAP, HF_OTHER_MAP
from hepti.parallel.single import BertEncoder
from hepti.weights import WeightStore


def synthetic_batch(config, batch: int, seq: int, seed: int = 0):
    """Deterministic random ids [batch, seq] (no padding): a fixed-shape input for timing."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1000 if config.vocab_size > 2000 else 1, config.vocab_size, (batch, seq))
    ids[:, 0] = min(101, config.vocab_size - 1)  # [CLS] for BERT vocabularies
    return ids.astype(np.int64), np.ones((batch, seq), np.int64)


def torch_model(store):
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
    torch.set_num_threads(1)
    return model


def run_model_bench(model_dir: str, seq: int = 128, batch: int = 1, repeat: int = 30,
                    torch: bool = True, progress: bool = True) -> dict:
    import numba  # local: start-up time (numba loads in about 0.5 s)
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)


    numba.set_num_threads(1)
    store = WeightStore(model_dir)
    cfg = store.config
    engine = BertEncoder.from_store(store, threads=1)
    ids, mask = synthetic_batch(cfg, batch, min(seq, cfg.max_position_embeddings))
    tm = torch_model(store) if torch else None
    store.close()

    def run_hepti():
        t0 = time.perf_counter()
        out = engine.forward(ids, mask)
        return time.perf_counter() - t0, out

    if tm is not None:
        import torch as th  # local: optional dependency (torch)
        tids, tmask = th.from_numpy(ids), th.from_numpy(mask)

        def run_torch():
            with th.inference_mode():
                t0 = time.perf_counter()
                out = tm(input_ids=tids, attention_mask=tmask).last_hidden_state
                return time.perf_counter() - t0, out.numpy()

    for _ in range(3):  # warm-up: JIT, caches, torch's first-call setup
        _, h = run_hepti()
        if tm is not None:
            _, t = run_torch()
    res = {"model": cfg.name or model_dir, "seq": int(ids.shape[1]), "batch": batch,
           "threads": 1, "repeat": repeat, "hepti_s": [], "torch_s": [] if tm is not None else None}
    if tm is not None:
        res["max_abs_diff_vs_torch"] = float(np.abs(h - t).max())
        import torch as th  # local: optional dependency (torch)
        res["torch_version"] = th.__version__
    runs = {"hepti": lambda: run_hepti()[0]}
    if tm is not None:
        runs["torch"] = lambda: run_torch()[0]
    with tqdm(total=repeat * len(runs), desc="bench model", disable=not progress, file=sys.stderr) as bar:
        times = interleave(list(runs), repeat, lambda name, _k: runs[name](), bar)
    # the ratio of each round's pair is robust to slow drifts of the shared machine
    fig = summarise(times, baseline="hepti")
    res["hepti_s"], res["hepti_median_s"] = times["hepti"], fig["hepti"]["median"]
    if tm is not None:
        res["torch_s"], res["torch_median_s"] = times["torch"], fig["torch"]["median"]
        res["ratio_torch_over_hepti"] = fig["torch"]["paired_ratio"]
    return res


def format_model_bench(res: dict) -> str:
    lines = [f"model {res['model']}, batch {res['batch']} x {res['seq']} tokens, 1 thread, "
             f"median of {res['repeat']} interleaved runs",
             f"  hepti   {res['hepti_median_s'] * 1e3:8.2f} ms"]
    if res.get("torch_s") is not None:
        lines.append(f"  torch   {res['torch_median_s'] * 1e3:8.2f} ms  (PyTorch {res['torch_version']})")
        lines.append(f"  torch/hepti time ratio {res['ratio_torch_over_hepti']:.3f} "
                     f"(>1: hepti is faster); max |diff| {res['max_abs_diff_vs_torch']:.2e}")
    else:
        lines.append("  (PyTorch not importable: install it with `bin/setup --with-torch` to compare)")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--model", default="weights/minilm-l6", help="converted model (default %(default)s)")
    ap.add_argument("--seq", type=positive_int, default=128, help="tokens (default 128)")
    ap.add_argument("--batch", type=positive_int, default=1, help="batch size (default 1)")
    ap.add_argument("--repeat", type=positive_int, default=30, help="timed rounds (default 30)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch comparison")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    res = run_model_bench(args.model, seq=args.seq, batch=args.batch, repeat=args.repeat,
                          torch=not args.no_torch, progress=not args.json)
    print(json.dumps(res, indent=2) if args.json else format_model_bench(res))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
