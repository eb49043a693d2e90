"""GeMM speed of hepti's Numba kernels against numpy's BLAS, single-threaded, shape by shape.

Each repetition times hepti's `matmul` (packs B on the fly), `gemm` (B packed beforehand) and
numpy's `a @ b` back to back, their order rotating (hepti.bench.harness.interleave), so that
load from other processes hits all three alike; the
report gives each one's median GFLOP/s and the median of the per-repetition ratios to numpy. numpy is single-threaded only
if OPENBLAS_NUM_THREADS (or OMP/MKL equivalents) was 1 before numpy was imported (the `hepti`
CLI does that); the result records the setting it ran under.
"""
from __future__ import annotations

import json
import os
import platform
import sys
import time

import numpy as np

from hepti.bench.harness import interleave, positive_int
from hepti.bench.registry import module_main
from hepti.info import cpu_flags, cpu_model
from hepti.kernels import config, gemm, matmul, pack_b

# Transformer shapes (MiniLM FFN1, BERT-base FFN1, a square one) and awkward ones.
DEFAULT_SHAPES = [
    (128, 384, 1536),
    (128, 768, 3072),
    (256, 1024, 1024),
    (1, 384, 1536),
    (127, 383, 1531),
    (64, 100, 200),
]
TRANSFORMER_SHAPES = DEFAULT_SHAPES[:3]
_BLAS_THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
_N_WEIGHTS = 3  # distinct B matrices per shape, used in turn


def _cpu_flags() -> dict:
    """CPU model name and AVX-512 / AVX2 presence (from hepti.info, which `hepti info` prints)."""
    flags = cpu_flags()
    return {"machine": platform.machine(), "model": cpu_model(), "avx512f": "avx512f" in flags,
            "avx2": "avx2" in flags}


def _blas_threads() -> dict:
    """The BLAS thread settings numpy started under, and whether they mean one thread."""
    env = {name: os.environ.get(name) for name in _BLAS_THREAD_VARS}
    single = env["OPENBLAS_NUM_THREADS"] == "1" or (
        env["OPENBLAS_NUM_THREADS"] is None and env["OMP_NUM_THREADS"] == "1")
    return {"env": env, "single_threaded": single}


def _gflops(m: int, k: int, n: int, seconds: float) -> float:
    return 2.0 * m * k * n / seconds / 1e9


def run_kernel_bench(repeat: int = 20, shapes=None, progress: bool = True) -> dict:
    """Median GFLOP/s of hepti matmul, hepti gemm (pre-packed B) and numpy a @ b per shape."""
    from tqdm import tqdm  # local: start-up time (the bar is drawn on rank 0 only)


    shapes = [tuple(int(v) for v in s) for s in (shapes or DEFAULT_SHAPES)]
    rng = np.random.default_rng(0)
    rows = []
    bar = tqdm(total=len(shapes) * repeat, desc="kernel bench", unit="rep", disable=not progress)
    for m, k, n in shapes:
        a = rng.standard_normal((m, k), dtype=np.float32)
        # a few different weights in turn, as a model's layers do, so B is not always in cache
        bs = [rng.standard_normal((k, n), dtype=np.float32) for _ in range(_N_WEIGHTS)]
        pbs = [pack_b(b) for b in bs]
        # numpy gets its own copies: timed right after matmul on the same array, it would find
        # B freshly cached by matmul's read of it (worth ~5% at 256x1024x1024) while matmul and
        # gemm find theirs as a model does, last read a few weights ago
        bs_np = [b.copy() for b in bs]
        out = np.empty((m, n), np.float32)
        ref = a @ bs[0]
        err = float(np.max(np.abs(gemm(a, pbs[0]) - ref))
                    / max(float(np.max(np.abs(ref))), 1e-30))
        matmul(a, bs[0], out=out)  # compile / warm up
        calls = {"matmul": lambda rep: matmul(a, bs[rep % _N_WEIGHTS], out=out),
                 "gemm": lambda rep: gemm(a, pbs[rep % _N_WEIGHTS], out=out),
                 "numpy": lambda rep: np.matmul(a, bs_np[rep % _N_WEIGHTS], out=out)}

        def timed(name: str, rep: int) -> float:
            t0 = time.perf_counter()
            calls[name](rep)
            return time.perf_counter() - t0
        times = interleave(list(calls), repeat, timed)
        bar.update(repeat)
        med = {name: float(np.median(ts)) for name, ts in times.items()}
        row = {"m": m, "k": k, "n": n, "max_rel_err": err}
        for name, seconds in med.items():
            row[f"{name}_ms"] = seconds * 1e3
            row[f"{name}_gflops"] = _gflops(m, k, n, seconds)
        # ratio per repetition (the three calls ran back to back under the same load), median
        t_np = np.array(times["numpy"])
        row["matmul_vs_numpy"] = float(np.median(t_np / np.array(times["matmul"])))
        row["gemm_vs_numpy"] = float(np.median(t_np / np.array(times["gemm"])))
        rows.append(row)
    bar.close()
    return {
        "repeat": repeat,
        "rows": rows,
        "blas_threads": _blas_threads(),
        "cpu": _cpu_flags(),
        "codegen": config.simd_status(),
        "numpy": np.__version__,
    }


def format_kernel_table(result: dict) -> str:
    """A plain-text table of run_kernel_bench's result."""
    cpu, gen, blas = result["cpu"], result["codegen"], result["blas_threads"]
    lines = [
        f"CPU: {cpu.get('model') or cpu.get('machine')}  avx512f={cpu.get('avx512f')}  "
        f"numba target={gen['cpu_name']} zmm={gen['zmm']} slp={gen['slp_vectorize']}",
        "numpy BLAS threads: " + ", ".join(f"{k}={v}" for k, v in blas["env"].items())
        + ("" if blas["single_threaded"] else "   (WARNING: numpy may be multi-threaded)"),
        f"median of {result['repeat']} interleaved repetitions, GFLOP/s (higher is better); "
        "ratios: median of per-repetition numpy_time / hepti_time",
        "",
        f"{'M x K x N':>18} {'matmul':>8} {'gemm':>8} {'numpy':>8} {'matmul/np':>10} "
        f"{'gemm/np':>8} {'rel err':>9}",
    ]
    for r in result["rows"]:
        shape = f"{r['m']}x{r['k']}x{r['n']}"
        lines.append(
            f"{shape:>18} {r['matmul_gflops']:8.1f} {r['gemm_gflops']:8.1f} "
            f"{r['numpy_gflops']:8.1f} {r['matmul_vs_numpy']:10.2f} {r['gemm_vs_numpy']:8.2f} "
            f"{r['max_rel_err']:9.1e}")
    return "\n".join(lines)


def add_arguments(ap) -> None:
    ap.add_argument("--repeat", type=positive_int, default=20, help="repetitions per shape (default 20)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")


def run(args) -> int:
    res = run_kernel_bench(repeat=args.repeat, progress=not args.json)
    print(json.dumps(res, indent=2) if args.json else format_kernel_table(res))
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
