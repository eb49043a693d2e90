#!/usr/bin/env python
"""int8 kernels against the float32 ones, one thread: GeMV GB/s of weight bytes and GeMM GFLOP/s.

    PYTHONPATH=src .venv/bin/python bin/bench-int8.py [--repeat 15]

Medians of interleaved repetitions (the machine is shared and noisy). GeMV: one row times a
weight too big for the caches (llama-1b's MLP matrices, 16-64 MiB in float32), in both stored
orientations; float32 is `gemm` on pre-packed panels (M = 1) and `matmul`'s streaming GeMV.
GB/s counts the weight bytes each reads (int8 + scales, or float32). GeMM: MiniLM's MLP and a
llama-1b projection at 128 rows, int8 `gemm_q` against float32 `gemm`, both pre-packed.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from hepti import kernels as K


def median_seconds(fns: dict, repeat: int) -> dict:
    """Each function's median time, run in turn `repeat` times (after one warm-up each)."""
    for f in fns.values():
        f()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, f in fns.items():
            t = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("GeMV (M = 1): median ms and GB/s of weight bytes read")
    for k, n, trans in [(2048, 8192, True), (8192, 2048, False), (2048, 2048, True)]:
        w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        b = np.ascontiguousarray(w.T) if trans else w
        x = rng.standard_normal((1, k), dtype=np.float32)
        pf, qb = K.pack_b(w, trans=trans), K.pack_q(K.quantize(w), trans=trans)
        t = median_seconds({"f32 packed": lambda: K.gemm(x, pf), "f32 stream": lambda: K.matmul(x, b),
                            "int8": lambda: K.gemm_q(x, qb)}, args.repeat)
        nbytes = {"f32 packed": 4 * k * n, "f32 stream": 4 * k * n, "int8": qb.nbytes}
        cells = "  ".join(f"{name} {s * 1e3:6.2f} ms {nbytes[name] / s / 1e9:6.1f} GB/s"
                          for name, s in t.items())
        print(f"  K={k:5d} N={n:5d} {'[N,K]' if trans else '[K,N]'}  {cells}  "
              f"int8 speed-up x{t['f32 packed'] / t['int8']:.2f}")
    print("GeMM: median GFLOP/s")
    for m, k, n, trans in [(128, 384, 1536, True), (128, 1536, 384, False),
                           (128, 2048, 2048, True)]:
        w = rng.standard_normal((n, k) if trans else (k, n), dtype=np.float32)
        a = rng.standard_normal((m, k), dtype=np.float32)
        pf, qb = K.pack_b(w, trans=trans), K.pack_q(K.quantize(w), trans=trans)
        t = median_seconds({"f32": lambda: K.gemm(a, pf), "int8": lambda: K.gemm_q(a, qb)},
                           args.repeat)
        cells = "  ".join(f"{name} {2 * m * k * n / s / 1e9:6.1f}" for name, s in t.items())
        print(f"  M={m} K={k:5d} N={n:5d} {'[N,K]' if trans else '[K,N]'}  {cells}  "
              f"int8/f32 x{t['f32'] / t['int8']:.2f}")


if __name__ == "__main__":
    main()
