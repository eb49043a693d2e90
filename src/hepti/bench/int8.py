"""int8 weights against float32, one thread: GeMV GB/s of weight bytes read, GeMM GFLOP/s.

    hepti bench int8 [--repeat 15] [--out results/int8.json]

GeMV: one row times a weight too big for the caches (llama-1b's MLP matrices, 16-64 MiB in
float32), in both stored orientations ([N, K] as q/k/v/gate/up are stored, [K, N] as o/down);
float32 is `gemm` on pre-packed panels (M = 1) and `matmul`'s streaming GeMV; GB/s counts the
weight bytes each reads (int8 + scales, or float32). Decode is bound by these bytes, so this is
what int8 buys a decoder. GeMM: MiniLM's MLP and a llama-1b projection at 128 rows, int8
`gemm_q` against float32 `gemm`, both pre-packed. The variants of a shape run interleaved
(hepti.bench.harness.interleave); medians, and the median of the per-repetition ratios to
float32 packed.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from hepti import kernels as K
from hepti.bench.harness import interleave, positive_int, result_doc, summarise, write_json
from hepti.bench.registry import module_main

GEMV_SHAPES = [(2048, 8192, True), (8192, 2048, False), (2048, 2048, True)]  # (K, N, [N, K]?)
GEMM_SHAPES = [(128, 384, 1536, True), (128, 1536, 384, False), (128, 2048, 2048, True)]


def _timed(fns: dict, repeat: int) -> dict:
    """{variant: summary} of `fns` run interleaved `repeat` times after one warm-up each,
    against "f32 packed"."""
    for f in fns.values():
        f()

    def one(name, _k):
        t = time.perf_counter()
        fns[name]()
        return time.perf_counter() - t
    return summarise(interleave(list(fns), repeat, one), baseline="f32 packed")


def run_int8_bench(repeat: int) -> dict:
    rng = np.random.default_rng(0)
    gemv, gemm = [], []
    for k, n, trans in GEMV_SHAPES:
        w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        b = np.ascontiguousarray(w.T) if trans else w
        x = rng.standard_normal((1, k), dtype=np.float32)
        pf, qb = K.pack_b(w, trans=trans), K.pack_q(K.quantize(w), trans=trans)
        s = _timed({"f32 packed": lambda: K.gemm(x, pf), "f32 stream": lambda: K.matmul(x, b),
                    "int8": lambda: K.gemm_q(x, qb)}, repeat)
        nbytes = {"f32 packed": 4 * k * n, "f32 stream": 4 * k * n, "int8": qb.nbytes}
        gemv.append({"k": k, "n": n, "stored": "[N,K]" if trans else "[K,N]", "variants": {
            v: {"ms": r["median"] * 1e3, "gb_s": nbytes[v] / r["median"] / 1e9,
                "bytes": nbytes[v], "vs_f32_packed": r["paired_ratio"]} for v, r in s.items()}})
    for m, k, n, trans in GEMM_SHAPES:
        w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        a = rng.standard_normal((m, k), dtype=np.float32)
        pf, qb = K.pack_b(w, trans=trans), K.pack_q(K.quantize(w), trans=trans)
        s = _timed({"f32 packed": lambda: K.gemm(a, pf), "int8": lambda: K.gemm_q(a, qb)}, repeat)
        gemm.append({"m": m, "k": k, "n": n, "stored": "[N,K]" if trans else "[K,N]", "variants": {
            v: {"ms": r["median"] * 1e3, "gflops": 2 * m * k * n / r["median"] / 1e9,
                "vs_f32_packed": r["paired_ratio"]} for v, r in s.items()}})
    return result_doc("int8", repeat=repeat, gemv=gemv, gemm=gemm)


def format_int8(doc: dict) -> str:
    lines = [f"median of {doc['repeat']} interleaved repetitions, 1 thread; time ratio to "
             "f32 packed (below 1 is faster)", "GeMV (M = 1): ms, GB/s of weight bytes read"]
    for r in doc["gemv"]:
        cells = "  ".join(f"{v} {c['ms']:6.2f} ms {c['gb_s']:6.1f} GB/s x{c['vs_f32_packed']:.2f}"
                          for v, c in r["variants"].items())
        lines.append(f"  K={r['k']:5d} N={r['n']:5d} {r['stored']}  {cells}")
    lines.append("GeMM: GFLOP/s")
    for r in doc["gemm"]:
        cells = "  ".join(f"{v} {c['gflops']:6.1f} x{c['vs_f32_packed']:.2f}"
                          for v, c in r["variants"].items())
        lines.append(f"  M={r['m']} K={r['k']:5d} N={r['n']:5d} {r['stored']}  {cells}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--repeat", type=positive_int, default=15,
                    help="interleaved repetitions per shape (default 15)")
    ap.add_argument("--out", default="results/int8.json", help="the result file "
                    "(default results/int8.json)")
    ap.add_argument("--json", action="store_true", help="print the result as JSON")


def run(args) -> int:
    doc = run_int8_bench(args.repeat)
    write_json(doc, args.out)
    print(json.dumps(doc, indent=2) if args.json else format_int8(doc))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
