"""Tests of `hepti bench model`'s pure parts: the FLOP count (MiniLM's 2.87 GFLOP at 128
tokens, the figure issue 47's limit is made of), the peak pick, the report; and, where torch and
transformers import, that `classic_bert` (the graph exported for onnxruntime's BERT fusions)
computes what transformers' BertModel does on the same weights. Nothing here is timed.
"""
from __future__ import annotations

import numpy as np
import pytest

from hepti.bench import model as bm
from hepti.config import BertConfig

MINILM = BertConfig.from_dict(dict(model_type="bert", vocab_size=30522, hidden_size=384,
                                   num_hidden_layers=6, num_attention_heads=12,
                                   intermediate_size=1536, max_position_embeddings=512))


def test_model_flops_minilm():
    flops = bm.model_flops(MINILM, 1, 128)
    # per layer: 2*M*C*(3C + C + 2F) for the GeMMs, 2 * 2*T*T*C for Q K^T and P V
    assert flops["gemm"] == 2 * 128 * 384 * (4 * 384 + 2 * 1536) * 6
    assert flops["attention"] == 4 * 128 * 128 * 384 * 6
    assert flops["total"] / 1e9 == pytest.approx(2.869, abs=5e-4)
    two = bm.model_flops(MINILM, 2, 128)
    assert two["total"] == 2 * flops["total"]  # attention stays within each sequence


def test_peak_of_takes_the_best_median():
    times = {(128, 384, 1536): [1e-3, 2e-3, 1e-3], (1, 10, 10): [1.0, 1.0, 1.0]}
    pk = bm.peak_of(times)
    assert pk["shape"] == [128, 384, 1536]
    assert pk["gflops"] == pytest.approx(2 * 128 * 384 * 1536 / 1e-3 / 1e9)
    assert set(pk["by_shape"]) == {"128x384x1536", "1x10x10"}


def test_format_model_bench_reports_every_ratio():
    res = {"model": "m", "batch": 1, "seq": 128, "repeat": 3, "hepti_median_s": 0.015,
           "hepti_gflops": 191.0, "torch_s": [0.03], "torch_median_s": 0.03,
           "torch_version": "2", "ort_median_s": 0.02, "ort_fused_median_s": 0.018,
           "onnxruntime_version": "1", "ratio_torch_over_hepti": 2.0,
           "ratio_ort_over_hepti": 1.3, "ratio_ort_fused_over_hepti": 1.2,
           "max_abs_diff_vs_torch": 1e-6, "max_abs_diff_vs_ort": 1e-6,
           "max_abs_diff_vs_ort-fused": 1e-6, "ort_fused_ops": {"Attention": 6},
           "flops": bm.model_flops(MINILM, 1, 128),
           "gemm_peak": {"gflops": 234.0, "shape": [128, 384, 1536]}, "limit_s": 0.0123,
           "hepti_over_limit": 1.22, "hepti_over_limit_paired": 1.21,
           "cpu": {"hepti": {"median_s": 0.014, "ratio_over_hepti": None},
                   "torch": {"median_s": 0.028, "ratio_over_hepti": 2.0}},
           "gemm_peak_cpu": {"gflops": 240.0, "shape": [128, 384, 1536]}, "limit_cpu_s": 0.012,
           "hepti_cpu_over_limit": 1.17}
    text = bm.format_model_bench(res)
    for needle in ("torch/hepti time ratio 2.000", "ort/hepti time ratio 1.300",
                   "ort_fused/hepti time ratio 1.200", "6 Attention", "FLOPs 2.869 G",
                   "GeMM peak 234.0 GFLOP/s", "hepti / limit 1.220",
                   "torch 28.00 ms (2.000x hepti)", "hepti CPU / limit 1.170"):
        assert needle in text


def test_classic_bert_matches_transformers(tiny_dir):
    """The ONNX export's module (transformers 4's forward written out) gives BertModel's
    last hidden state on the same weights, padding included."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from hepti.weights import WeightStore
    store = WeightStore(tiny_dir)
    tm = bm.torch_model(store)
    ids, mask = bm.synthetic_batch(store.config, 2, 9)
    mask[1, 6:] = 0
    ti, tmask = torch.from_numpy(ids), torch.from_numpy(mask)
    with torch.inference_mode():
        want = tm(input_ids=ti, attention_mask=tmask).last_hidden_state.numpy()
        got = bm.classic_bert(tm)(ti, tmask).numpy()
    real = mask.astype(bool)
    np.testing.assert_allclose(got[real], want[real], atol=1e-5)


def test_format_model_bench_reports_the_speedup_over_one_thread():
    res = {"model": "m", "batch": 1, "seq": 256, "repeat": 3, "threads": 2,
           "hepti_median_s": 0.25, "hepti_gflops": 180.0, "hepti_1t_median_s": 0.46,
           "speedup": 1.84, "flops": bm.model_flops(MINILM, 1, 256)}
    text = bm.format_model_bench(res)
    assert "2 threads" in text
    assert "hepti-1t    460.00 ms  (1 thread; speedup on 2: 1.840" in text
    assert "CPU time" not in text


def test_threads_option_parses():
    import argparse
    ap = argparse.ArgumentParser()
    bm.add_arguments(ap)
    assert ap.parse_args([]).threads == 1
    assert ap.parse_args(["--threads", "2"]).threads == 2
    with pytest.raises(SystemExit):
        ap.parse_args(["--threads", "0"])
