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
HUGE_PAGE = 1 << 21  # bytes: a transparent huge page on x86-64
_local = threading.local()


def aligned_empty(shape, align: int = ALIGN, huge: bool = False) -> np.ndarray:
    """An uninitialised float32 C-contiguous array whose data starts on an `align`-byte boundary.

    Packed panels are read one 128-byte row per k step; misaligned, every row would straddle
    three cache lines instead of two.

    huge: a buffer kept for the life of a model (a chain's weights, its arena of maps) in whole
    2 MiB pages of its own (zero-filled, `_huge_empty`), not from the heap, so that it lies
    alike in every process. numpy advises huge pages for arrays of 4 MiB or more, but malloc
    may hand out memory it had already touched in 4 KiB pages: ResNet-50's 11 MB arena was in
    huge pages in some processes and half in 4 KiB ones in others (/proc/self/pagemap). The
    forward's time did not follow it beyond the machine's noise (docs/cnn.md, "Feature maps
    on a 64-byte boundary"). Not for outputs made per call: each new mapping's pages are
    faulted and zeroed again.
    """
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    size = int(np.prod(shape))
    if huge:
        return _huge_empty(shape, size)
    raw = np.empty(size + align // ITEM, np.float32)
    start = (-raw.ctypes.data % align) // ITEM
    return raw[start:start + size].reshape(shape)


def _huge_empty(shape: tuple, size: int) -> np.ndarray:
    """A zero-filled float32 array of `size` floats starting on a 2 MiB boundary, in an
    anonymous mapping of its own advised MADV_HUGEPAGE and rounded up to whole 2 MiB pages,
    so that every page of it is a huge one when the kernel has them (transparent huge pages
    `madvise` or `always`): the same placement in every process (physically contiguous 2 MiB
    at a time, one TLB entry each). Where it has none, the pages are 4 KiB ones, as before."""
    nbytes = -(-max(size * ITEM, 1) // HUGE_PAGE) * HUGE_PAGE
    buf = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = np.frombuffer(buf, np.uint8)  # holds the mapping for as long as a view of it lives
    start = -raw.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes)
        except OSError:  # a kernel without transparent huge pages: 4 KiB pages
            pass
    return raw[start:start + size * ITEM].view(np.float32).reshape(shape)


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
