"""Kernel constants (block sizes, fastmath flags, jit options) and the Numba code-generation setup.

Imported first by `hepti.kernels`, before any kernel is compiled, because two LLVM settings are
read when Numba compiles and both matter for the GeMM micro-kernel:

* SLP vectorisation (`NUMBA_SLP_VECTORIZE`, off by default in Numba) is what turns the
  micro-kernel's MR x NR scalar accumulators into vector registers.
* LLVM tunes AVX-512 cores such as Ice Lake / Sapphire Rapids with "prefer-256-bit", so even the
  SLP vectoriser emits ymm code (half the FMA width; ~112 GFLOP/s in-cache here instead of ~160).
  Adding "-prefer-256-bit" to the target features lets it use zmm. Numba builds its target
  machine once per process from `NUMBA_CPU_FEATURES`, so this must happen before the first
  compile in the process; `simd_status()` says whether it took effect.

SLP is set through the environment (so Numba's `reload_config`, which re-reads it whenever the
environment changes, keeps it). The CPU features are set on numba.config only, not exported,
so that a process started from this one (say an mpiexec rank on another machine) derives its
own; the target machine is then built at once, after which config changes cannot undo it.
Both are left alone when the user set them (NUMBA_SLP_VECTORIZE, NUMBA_CPU_NAME/_FEATURES),
and both apply to every Numba function compiled in this process.

Numba's on-disk cache is keyed on each kernel's own source file, not on this one; `_cache`
drops the cached kernels of every module that imports this one when this file changes (a
compile-time constant such as the fastmath sets).
"""
from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")

import numba  # noqa: E402  (after the environment above)
from numba.core.codegen import get_host_cpu_features  # noqa: E402
from numba.core.registry import cpu_target  # noqa: E402

numba.config.reload_config()
if numba.config.CPU_FEATURES is None and numba.config.CPU_NAME is None:
    from numba.core.codegen import get_host_cpu_features

    _features = get_host_cpu_features()
    if "+avx512f" in _features:
        numba.config.CPU_FEATURES = _features + ",-prefer-256-bit"
cpu_target.target_context  # noqa: B018  (builds the target machine with the settings above)

# --- GeMM blocking ---------------------------------------------------------------------------


def _cache_bytes(level: int, default: int) -> int:
    """Size of this CPU's level-`level` data (or unified) cache per core, from Linux sysfs."""
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            if int((index / "level").read_text()) != level:
                continue
            if (index / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            size = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
        try:
            return int(size.rstrip("KM")) * scale
        except ValueError:
            continue
    return default


MR = 8  # rows of C per micro-tile (the generated kernels in _microkernels.py fix this)
NR = 32  # columns per packed B panel = two zmm registers of float32
# rows of the fused convolution tile (direct_tiles_epi, kernels/conv.py's fused modes)
MR_FUSED = 8
L1_BYTES = _cache_bytes(1, 32 << 10)  # Zen 4: 32 KiB, Sapphire Rapids: 48 KiB
L2_BYTES = _cache_bytes(2, 1 << 20)  # Zen 4: 1 MiB, Sapphire Rapids: 2 MiB
# KC: depth of one k-block. The KC x NR slice of a B panel is reused by every row tile, so it
# should stay in L1 next to the streaming A tiles: about 2/3 of L1 (256 for 48 KiB).
KC = max(64, min(512, (L1_BYTES * 2 // 3) // (NR * 4) // 32 * 32))
# KC_PACKED: the deepest k-block of a GeMM on a pre-packed B (packed_gemm.gemm / ffn, attention's
# projections); k is cut into equal blocks of at most this depth. Each k-block after the first
# reads and rewrites the C strip, whose rows (ldc apart: at N = 384 .. 3072 they map to 2-16 of
# L1's 64 sets) do not stay in L1; on Zen 4 that pass costs more than streaming a slice deeper
# than L1 from L2. Measured 2026-11-30, in one process, interleaved, CPU time (loaded 2-core
# machine): MiniLM's layer GeMMs (M = 128) 2-8% faster than with KC (384 deep: one block, not
# 160 + 160 + 64), BERT-base's (M = 256) 1-5%; whole forwards 0.97-0.98x (MiniLM @128) and
# 0.965x (BERT-base @256); on the quiet machine, 20 rounds, MiniLM 0.978x. The peak shapes of
# `hepti bench model` gain as much or more (4-6%; quiet, 102.3 -> 108.3 GFLOP/s), so its ratio
# to the limit does not fall with it. Packing B on the fly, the int8 GeMM (its
# slice is dequantised into an L1 buffer) and the convolutions keep KC. The slice (KC_PACKED x
# NR floats, 96 KiB at 768) is held to an eighth of L2, so a device with a smaller L2 streams
# it from there too; 768 deep is as far as it was measured.
KC_PACKED = max(KC, min(768, L2_BYTES // 8 // (NR * 4) // 32 * 32))
# A is packed in blocks of up to MC rows x K. A convolution's blocks stay in L2 while all
# panels pass over them (A_BLOCK_BYTES).
A_BLOCK_BYTES = L2_BYTES // 2
# A GeMM's (packed_gemm: the transformers' projections, matmul, int8) may not: under L2 / 2 a
# 512 KiB L2 cut MiniLM's down projection (M = 128, K = 1536) into 4 blocks of 32 rows and
# BERT-base's (M = 256, K = 3072) into 16 of 16, and each block streamed all of B, the weights,
# from memory again. Reading the packed A block from L3 instead, once a panel, is one byte per
# 16 FLOPs (NR = 32 columns), a sequential stream the hardware prefetchers keep up with. Zen 3
# (512 KiB L2), in one process against the tree before, the trees taking turns, bit-equal
# (`hepti bench against 21ddbc5 --in-process`, 20 rounds): MiniLM @128 0.958x the time,
# BERT-base @256 0.712x. A budget of 2 x L2 measured about the same (12 rounds: 0.95x, 0.80x
# where 8 x L2 read 0.94x, 0.82x). The convolutions' blocks at 8 x L2 measured ResNet-50
# 0.98-1.00x and VGG-16 0.95-1.02x (noise, 12 rounds), so they keep theirs. Not measured on a
# device without an L3 (a Raspberry Pi's shared L2 is its last level): there the block would
# stream from DRAM once a panel.
GEMM_A_BLOCK_BYTES = L2_BYTES * 8
# Software prefetch (0 turns it off): the next pre-packed B panel is prefetched into L2 while
# the current one is computed, and packing B on the fly prefetches this many rows ahead.
PREFETCH_ROWS = 16

# --- fastmath ----------------------------------------------------------------------------------
# GeMM: no 'reassoc', so LLVM keeps the k-loop a chain of FMAs per accumulator (register tiles);
# with reassoc it vectorises the k reduction instead and the accumulators spill.
FASTMATH_GEMM = {"nnan", "ninf", "nsz", "arcp", "contract", "afn"}
# Row reductions (LayerNorm, softmax sums): 'reassoc' lets the sums vectorise (a 16-lane
# pairwise-like sum, no less accurate than the serial one). No 'nnan'/'ninf': masked scores
# sit near float32 min and must keep IEEE behaviour.
FASTMATH_ROWS = {"nsz", "arcp", "contract", "afn", "reassoc"}

# Numba compiles a callee that does not set `fastmath` with the flags of the caller it is first
# compiled for; a function whose result depends on strict IEEE order says fastmath=False.

# Options for every @njit kernel: nogil so the runtime can prefetch weights on another thread;
# error_model="numpy" so a division is a plain (vectorisable) IEEE division, not a
# ZeroDivisionError check.
JIT = dict(nogil=True, cache=True, error_model="numpy")


def simd_status() -> dict:
    """What the code generator targets: CPU name, whether AVX-512 is present and whether zmm is on."""
    codegen = cpu_target.target_context.codegen()
    features = getattr(codegen, "_tm_features", "") or ""
    return {
        "cpu_name": codegen._get_host_cpu_name(),
        "avx512f": "+avx512f" in features,
        "zmm": "+avx512f" in features and "-prefer-256-bit" in features,
        "slp_vectorize": bool(numba.config.SLP_VECTORIZE),
    }

# The vector register file the code generator targets: (registers, float32 lanes a register).
# The IR tiles (_tile_ir.register_passes) split a tile whose accumulators would not fit it into
# passes that do: an 8 x 32 tile is 16 of AVX-512's 32 zmm, but 32 of AVX2's 16 ymm.
def _vector_file() -> tuple[int, int]:
    status = simd_status()
    if status["zmm"]:
        return 32, 16
    if status["avx512f"]:  # AVX-512 held to ymm: 32 registers of 8 floats
        return 32, 8
    features = getattr(cpu_target.target_context.codegen(), "_tm_features", "") or ""
    return (16, 8) if "+avx" in features.split(",") else (16, 4)


VECTOR_REGS, VECTOR_LANES = _vector_file()

# --- integer dot products for the int8 GeMV ------------------------------------------------------
# Which integer-dot kernel int8.py's one-row product runs (chosen in Python at each call, so a
# test can switch it): 2 = AVX-512 VNNI (vpdpwssd), 1 = AVX2 (vpmaddwd), 0 = the plain-Numba
# float path, which every CPU runs. HEPTI_INT_DOT=0 (or 1, or a name) forces a lower one; a
# higher one than the CPU has is capped to the CPU's, since its instructions would not run.
INT_DOT_NAMES = ("float", "avx2", "avx512_vnni")


def host_int_dot() -> int:
    """The best integer-dot kernel this CPU runs (see INT_DOT_NAMES), from LLVM's host features."""
    features = set(get_host_cpu_features().split(","))
    if {"+avx512f", "+avx512bw", "+avx512vnni"} <= features:
        return 2
    return 1 if "+avx2" in features else 0


def _int_dot_setting() -> int:
    best = host_int_dot()
    env = os.environ.get("HEPTI_INT_DOT", "").strip().lower()
    if not env:
        return best
    level = INT_DOT_NAMES.index(env) if env in INT_DOT_NAMES else None
    if level is None and env.isdigit():
        level = int(env)
    if level is None or not 0 <= level < len(INT_DOT_NAMES):
        raise ValueError(f"HEPTI_INT_DOT={env!r}: use one of 0, 1, 2 or {INT_DOT_NAMES}")
    return min(level, best)


INT_DOT = _int_dot_setting()  # int8.py reads config.INT_DOT at each call; tests may set it
