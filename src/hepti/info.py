"""`hepti info`: versions and CPU facts that save hours of support (like `heat --info`)."""
from __future__ import annotations

import os
import platform
import sys

import hepti


def _version(mod: str) -> str:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception as e:  # noqa: BLE001 - report, don't fail
        return f"not importable ({type(e).__name__}: {e})"


def cpu_flags() -> list[str]:
    """The vector-unit flags that matter for the kernels, of those this CPU has."""
    interesting = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
                   "avx512_bf16", "neon", "asimd")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [x for x in interesting if x in have]
    except OSError:
        pass
    return []


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), e.g. 'AMD EPYC'; results name it, as the machine
    behind a session can change."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def collect_info() -> dict:
    info = {
        "hepti": hepti.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cpu_flags": cpu_flags(),
    }
    for mod in ("numpy", "numba", "mpi4py", "h5py", "scipy", "tokenizers", "safetensors", "tqdm"):
        info[mod] = _version(mod)
    try:
        import h5py  # local: start-up time (h5py)
        info["hdf5"] = h5py.version.hdf5_version
    except Exception:  # noqa: BLE001
        pass
    try:
        from mpi4py import MPI  # local: importing mpi4py.MPI starts MPI (MPI_Init)
        info["mpi_library"] = MPI.Get_library_version().strip().splitlines()[0]
        info["mpi_standard"] = "%d.%d" % MPI.Get_version()
    except Exception as e:  # noqa: BLE001
        info["mpi_library"] = f"unavailable ({e})"
    try:
        import numba  # local: start-up time (numba loads in about 0.5 s)
        info["numba_threads"] = numba.config.NUMBA_NUM_THREADS
        info["numba_threading_layer"] = numba.config.THREADING_LAYER
    except Exception:  # noqa: BLE001
        pass
    info["blas_threads_env"] = os.environ.get("OPENBLAS_NUM_THREADS")
    return info


def format_info(info: dict) -> str:
    w = max(len(k) for k in info)
    return "\n".join(f"{k:<{w}}  {', '.join(v) if isinstance(v, list) else v}" for k, v in info.items())
