"""How to form a convolution's GeMM operand: explicit im2col, im2col per row block, or packing
patches straight from x (implicit), on CNN layer shapes, batch 1, one thread.

Each repetition runs every variant of a shape back to back, the order rotating (so load from
other processes hits them alike) with bias and ReLU; the report gives each variant's median (and
min) milliseconds and GFLOP/s (2 * M * K * Cout per convolution). Variants:
    explicit   the whole [N*Ho*Wo, kh*kw*Cin] patch matrix, then one gemm() with the bias, then
               relu() over the output
    im2col     conv2d's row blocks with the block's patch rows copied into a buffer, then packed
    implicit   conv2d's row blocks packed from x directly (what conv2d does when rows does not
               apply)
    rows       whole output rows, each tile's A read from x in place where the tile lies
               inside x, its border tiles packed (what conv2d does where it applies)
    gemm       1x1 stride 1 only: gemm() on x viewed as [N*H*W, Cin] (no copy), then relu()
    direct     1x1 stride 1 only: conv2d's row blocks packing x's rows (what conv2d does)
and then depthwise_conv2d on MobileNetV2's depthwise shapes (3x3, bias, ReLU6).
Usage: hepti bench conv [--repeat 7]
"""
from __future__ import annotations

import sys
import time

import numpy as np

from hepti.bench.harness import interleave, positive_int
from hepti.bench.registry import module_main
from hepti.kernels import conv, depthwise_conv2d, pack_conv_weight
from hepti.kernels.packed_gemm import PackedB, gemm

# name, (H, W, Cin), (kh, stride, padding), Cout
SHAPES = [
    ("mbv2 1x1 112x112x32->16", (112, 112, 32), (1, 1, 0), 16),
    ("mbv2 1x1 56x56x24->144", (56, 56, 24), (1, 1, 0), 144),
    ("mbv2 stem 3x3s2 224x224x3->32", (224, 224, 3), (3, 2, 1), 32),
    ("resnet 3x3 56x56x64->64", (56, 56, 64), (3, 1, 1), 64),
    ("resnet stem 7x7s2 224x224x3->64", (224, 224, 3), (7, 2, 3), 64),
    ("resnet 3x3 14x14x256->256", (14, 14, 256), (3, 1, 1), 256),
    ("vgg 3x3 224x224x64->64", (224, 224, 64), (3, 1, 1), 64),
    ("vgg 3x3 112x112x128->128", (112, 112, 128), (3, 1, 1), 128),
    ("vgg 3x3 56x56x256->256", (56, 56, 256), (3, 1, 1), 256),
    ("vgg 3x3 28x28x512->512", (28, 28, 512), (3, 1, 1), 512),
    ("resnet 1x1 56x56x256->64", (56, 56, 256), (1, 1, 0), 64),
    ("resnet 1x1s2 56x56x256->512", (56, 56, 256), (1, 2, 0), 512),
    ("resnet 3x3s2 56x56x128->128", (56, 56, 128), (3, 2, 1), 128),
]
# MobileNetV2's 3x3 depthwise layers: (H, W, C, stride) -> how many times the shape occurs
DEPTHWISE_SHAPES = {(112, 112, 32, 1): 1, (112, 112, 96, 2): 1, (56, 56, 144, 1): 1,
                    (56, 56, 144, 2): 1, (28, 28, 192, 1): 2, (28, 28, 192, 2): 1,
                    (14, 14, 384, 1): 4, (14, 14, 576, 1): 2, (14, 14, 576, 2): 1,
                    (7, 7, 960, 1): 3}


def _variants(x, cw, bias, stride, padding):
    """{name: zero-argument callable} for one shape."""
    n, h, w, cin = x.shape
    geo = conv._geometry(x.shape, cw.kh, cw.kw, stride, padding, 1, cin, "bench")
    m, k = n * geo[4] * geo[5], cw.k
    pb = PackedB(cw.panels[0], cw.cout)
    out = np.empty((n, geo[4], geo[5], cw.cout), np.float32)
    patches = np.empty((m, k), np.float32)
    flat_out = out.reshape(m, cw.cout)

    def explicit():
        conv._im2col(x.reshape(-1), geo, 0, 0, m, patches.reshape(-1), k)
        gemm(patches, pb, bias=bias, out=flat_out)
        conv.relu(out, out=out)

    def run(mode):
        return lambda: conv.conv2d(x, cw, bias, stride, padding, relu="relu", out=out,
                                   _mode=mode)

    plain = cw.kh == 1 and stride == 1 and padding == 0
    if plain:
        def direct_gemm():
            gemm(x.reshape(m, cin), pb, bias=bias, out=flat_out)
            conv.relu(out, out=out)
        variants = {"gemm": direct_gemm, "direct": run(conv._MODE_DIRECT)}
    else:
        variants = {"explicit": explicit, "im2col": run(conv._MODE_IM2COL),
                    "implicit": run(conv._MODE_IMPLICIT)}
    if conv._rows_apply(geo, 1):
        variants["rows"] = run(conv._MODE_ROWS)
    if cw.groups == 1 and cw.cout % conv.NR == 0:
        variants["fused"] = run(None)  # conv2d's own choice there: the fused store
    return variants


def run_conv_bench(repeat: int = 7, shapes=None) -> list[dict]:
    """One row per shape and variant: median ms and GFLOP/s over `repeat` repetitions."""
    rng = np.random.default_rng(0)
    rows = []
    for name, (h, w, cin), (kh, stride, padding), cout in shapes or SHAPES:
        x = rng.standard_normal((1, h, w, cin), dtype=np.float32)
        cw = conv.pack_conv_weight(rng.standard_normal((cout, cin, kh, kh), dtype=np.float32))
        bias = rng.standard_normal(cout, dtype=np.float32)
        variants = _variants(x, cw, bias, stride, padding)
        for fn in variants.values():  # compile and warm up
            fn()

        def timed(v: str, _k: int) -> float:
            t0 = time.perf_counter()
            variants[v]()
            return time.perf_counter() - t0
        times = interleave(list(variants), repeat, timed)
        ho = (h + 2 * padding - kh) // stride + 1
        wo = (w + 2 * padding - kh) // stride + 1
        flops = 2.0 * ho * wo * kh * kh * cin * cout
        for v, ts in times.items():
            med = float(np.median(ts))
            rows.append({"shape": name, "variant": v, "ms": med * 1e3, "min_ms": min(ts) * 1e3,
                         "gflops": flops / med / 1e9})
    return rows


def run_depthwise_bench(repeat: int = 7) -> list[dict]:
    """One row per MobileNetV2 depthwise shape: median and min ms, GFLOP/s, occurrences, and
    the bytes it must move (x read, y written) per second, against a copy of as many bytes
    (x into a buffer of its size, then a buffer of y's size written: `np.copyto`), timed in
    turn with it: a depthwise 3x3 does 18 FLOPs a value, so memory, not FLOPs, should bound
    it (issue 47)."""
    rng = np.random.default_rng(0)
    rows = []
    for (h, w, c, stride), count in DEPTHWISE_SHAPES.items():
        x = rng.standard_normal((1, h, w, c), dtype=np.float32)
        cw = pack_conv_weight(rng.standard_normal((c, 1, 3, 3), dtype=np.float32), groups=c)
        bias = rng.standard_normal(c, dtype=np.float32)
        out = depthwise_conv2d(x, cw, bias, stride, 1, relu="relu6")
        xc, oc = np.empty_like(x), np.empty_like(out)
        ts, tc = [], []
        for _ in range(repeat):
            t0 = time.perf_counter()
            depthwise_conv2d(x, cw, bias, stride, 1, relu="relu6", out=out)
            ts.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            np.copyto(xc, x)
            np.copyto(oc, out)
            tc.append(time.perf_counter() - t0)
        med, moved = float(np.median(ts)), x.nbytes + out.nbytes
        rows.append({"shape": f"mbv2 dw 3x3s{stride} {h}x{w}x{c}", "variant": f"x{count}",
                     "ms": med * 1e3, "min_ms": min(ts) * 1e3,
                     "gflops": 2.0 * out.size * 9 / med / 1e9, "count": count,
                     "gbps": moved / med / 1e9,
                     "copy_gbps": 2 * moved / float(np.median(tc)) / 1e9})
    return rows


def add_arguments(ap) -> None:
    ap.add_argument("--repeat", type=positive_int, default=7, help="interleaved repetitions (default 7)")


def run(args) -> int:
    import numba  # local: start-up time (numba loads in about 0.5 s)
    numba.set_num_threads(1)
    dw_rows = run_depthwise_bench(args.repeat)
    for row in run_conv_bench(args.repeat) + dw_rows:
        bw = (f"  {row['gbps']:5.1f} GB/s moved (a copy of as many bytes: "
              f"{row['copy_gbps']:5.1f})" if "gbps" in row else "")
        print(f"{row['shape']:34s} {row['variant']:9s} {row['ms']:9.3f} ms "
              f"(min {row['min_ms']:8.3f}) {row['gflops']:7.1f} GFLOP/s{bw}")
    total = sum(row["ms"] * row["count"] for row in dw_rows)
    print(f"MobileNetV2's 17 depthwise layers: {total:.3f} ms (sum of medians)")
    return 0


if __name__ == "__main__":
    sys.exit(module_main(__spec__.name))
