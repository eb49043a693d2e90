"""Input checks and the flat views the @njit kernels take instead of 2-D arrays.

Every kernel addresses a matrix whose rows are contiguous as one flat float32 array plus a row
stride ("ld", leading dimension), so that the same compiled code serves C-contiguous arrays,
row slices, column blocks of a bigger buffer (e.g. q, k, v inside a fused QKV output) and
preallocated `out=` views. Numba then sees one 1-D C-contiguous type for all of them, which
keeps row loads and stores vectorised and the number of compiled specialisations at one.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np
from numpy.lib.stride_tricks import as_strided

EMPTY = np.empty(0, np.float32)  # stands in for an absent optional array (bias, residual)
ITEM = 4  # bytes per float32
ALIGN = 64  # bytes: one cache line, one zmm register
_local = threading.local()


def aligned_empty(shape, align: int = ALIGN) -> np.ndarray:
    """An uninitialised float32 C-contiguous array whose data starts on an `align`-byte boundary.

    Packed panels are read one 128-byte row per k step; misaligned, every row would straddle
    three cache lines instead of two.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = int(np.prod(shape))
    raw = np.empty(size + align // ITEM, np.float32)
    start = (-raw.ctypes.data % align) // ITEM
    return raw[start:start + size].reshape(shape)


HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
_PAGE = mmap.PAGESIZE


def huge_empty(size: int) -> np.ndarray:
    """An uninitialised float32 [size] array starting on a 2 MiB boundary, in private anonymous
    memory advised MADV_HUGEPAGE, so that the kernel may back its whole 2 MiB stretches with
    transparent huge pages (THP "always" or "madvise"); below 2 MiB, or without madvise, an
    `aligned_empty` one. The mapping ends at the array's last 4 KiB page, so its tail (and the
    untouched lead up to the boundary) costs no memory.

    Why: numpy advises huge pages only for arrays of 4 MiB and more, and glibc's mapping of a
    smaller one is rarely 2 MiB-aligned, so a transformer layer's packed weights (MiniLM's are
    0.6-2.4 MB each) sat in 4 KiB pages at physical addresses that differ from process to
    process. One mapping a layer (parallel/slices.py) took MiniLM's forward to 0.95-0.97x and
    its process-to-process spread from ~1.5% to ~0.5% (2026-12-01, docs/results/model.md).
    ResNet-50's bottleneck chain (its 94 MB of weights, its 11 MB arena) had come from malloc's
    heap, in huge pages in some processes and half in 4 KiB ones in others (/proc/self/pagemap):
    in huge pages of their own, hepti/onnxruntime read 0.983x main's over 8 alternated launch
    pairs (docs/cnn.md). For buffers kept for a model's life only: each new mapping's pages
    are faulted again."""
    nbytes = int(size) * ITEM
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return aligned_empty(size)
    m = mmap.mmap(-1, HUGE_PAGE + -(-nbytes // _PAGE) * _PAGE,
                  flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel without THP: plain pages
        pass
    raw = np.frombuffer(m, np.float32)  # keeps the mapping alive as long as a view of it
    start = (-raw.ctypes.data % HUGE_PAGE) // ITEM
    return raw[start:start + size]


def pad16(n: int) -> int:
    """n rounded up to a multiple of 16 floats (64 bytes), to keep workspace parts aligned."""
    return -(-n // 16) * 16


def workspace(size: int) -> np.ndarray:
    """A reusable aligned float32 scratch array of at least `size` floats, one per thread.

    Kernels need scratch (packed A, a panel of B, partial tiles) of up to a few hundred KiB;
    allocating that per call costs page faults every time, so it is kept and grown as needed.
    The contents are garbage; a caller must not hand it to two kernels at once.
    """
    ws = getattr(_local, "ws", None)
    if ws is None or ws.size < size:
        ws = aligned_empty(max(size, 1024))
        _local.ws = ws
    return ws


def check_float32(x: np.ndarray, name: str, ndim: int) -> None:
    """Raise unless x is a float32 ndarray with ndim dimensions."""
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be a numpy array, got {type(x).__name__}")
    if x.dtype != np.float32:
        raise TypeError(f"{name} must be float32, got {x.dtype}; convert it once with "
                        f"{name}.astype(np.float32)")
    if x.ndim != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {x.shape}")


def flat_rows(x: np.ndarray, name: str) -> tuple[np.ndarray, int]:
    """(flat, ld) for a float32 [rows, cols] array whose rows are contiguous.

    flat is a 1-D view starting at x[0, 0] and ending at x[-1, -1]; element (i, j) is
    flat[i * ld + j]. No data is copied. Raises if the rows are not contiguous.
    """
    check_float32(x, name, 2)
    rows, cols = x.shape
    if rows == 0 or cols == 0:
        return EMPTY, max(cols, 1)
    if x.flags.c_contiguous:  # the common case, and 10x cheaper than as_strided
        return x.reshape(-1), cols
    s_row, s_col = x.strides
    if cols > 1 and s_col != ITEM:
        raise ValueError(f"{name} must have contiguous rows (stride 1 on the last axis), got "
                         f"strides {x.strides}; pass np.ascontiguousarray({name})")
    if rows == 1:
        ld = cols
    else:
        if s_row % ITEM or s_row < cols * ITEM:
            raise ValueError(f"{name} rows overlap or are misaligned (strides {x.strides}); "
                             f"pass np.ascontiguousarray({name})")
        ld = s_row // ITEM
    span = (rows - 1) * ld + cols
    base = x.base
    if (isinstance(base, np.ndarray) and base.dtype == np.float32 and base.flags.c_contiguous
            and x.flags.writeable == base.flags.writeable):
        # A column block of a contiguous array (e.g. q, k, v of a fused QKV output): slice the
        # base's flat view, ~20x cheaper than as_strided, which costs ~10 us a call.
        off = x.__array_interface__["data"][0] - base.__array_interface__["data"][0]
        if off % ITEM == 0 and 0 <= off and off // ITEM + span <= base.size:
            return base.reshape(-1)[off // ITEM: off // ITEM + span], ld
    return as_strided(x, shape=(span,), strides=(ITEM,)), ld


def vector(x: np.ndarray | None, name: str, n: int) -> np.ndarray:
    """A contiguous, writeable float32 [n] vector (EMPTY for None), copied only if needed.

    (Numba compiles a separate specialisation for read-only arrays; copying a vector is cheaper
    than compiling the kernel again.)
    """
    if x is None:
        return EMPTY
    check_float32(x, name, 1)
    if x.shape[0] != n:
        raise ValueError(f"{name} must have {n} entries, got {x.shape[0]}")
    if not x.flags.writeable:
        return x.copy()
    return np.ascontiguousarray(x)


def output(out: np.ndarray | None, shape: tuple[int, int], name: str = "out") -> np.ndarray:
    """A new float32 array of this shape, or `out` checked to be one with contiguous rows."""
    if out is None:
        return np.empty(shape, np.float32)
    check_float32(out, name, 2)
    if out.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {out.shape}")
    if not out.flags.writeable:
        raise ValueError(f"{name} is read-only")
    return out


def check_no_overlap(out: np.ndarray, other: np.ndarray | None, other_name: str,
                     out_name: str = "out") -> None:
    """Raise if `out` shares memory with an input that the kernel still reads while writing."""
    if other is not None and np.shares_memory(out, other):
        raise ValueError(f"{out_name} overlaps {other_name}; the kernel reads {other_name} "
                         f"while writing {out_name}: pass a separate output buffer")
