"""This process's system resources: its cgroup's CPU and memory caps, the memory it still has,
the machine's, and resident set sizes (its own and another process's).

A leaf: it imports nothing of hepti's, so the collectives (hepti.parallel.comm), the profiler
(hepti.parallel.profiling), the job, the service (hepti.serve) and the emulator
(hepti.emulate.cgroups) all read /proc and the cgroup files the same way, here alone.
"""
from __future__ import annotations

import atexit
import ctypes
import functools
import gc
import os
import resource
import sys
from pathlib import Path


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _memory_stat(d: str) -> dict[str, int]:
    """A memory cgroup directory's memory.stat as {name: bytes} ({} if unreadable)."""
    try:
        lines = Path(f"{d}/memory.stat").read_text().splitlines()
    except OSError:
        return {}
    pairs = (ln.split() for ln in lines)
    return {p[0]: int(p[1]) for p in pairs if len(p) == 2 and p[1].isdigit()}


def cgroup_memory_stat() -> dict[str, int]:
    """This process's own memory cgroup's memory.stat (v2 or v1), e.g. {"total_rss",
    "total_cache", "total_inactive_file", ...} or {"anon", "file", "inactive_file", ...}."""
    for d in cgroup_dirs("")[:1] + cgroup_dirs("memory")[:1]:
        stat = _memory_stat(d)
        if stat:
            return stat
    return {}


def reclaimable_cache(stat: dict[str, int]) -> int:
    """Bytes of a memory cgroup's page cache (memory.stat's active and inactive file pages, v1
    or v2), which the kernel reclaims before it lets the group exceed its limit, as MemAvailable
    counts it for the whole machine. Part of it is shared libraries' code in use, which comes
    back by page faults when needed; the planner's activation estimates leave room for that."""
    def get(v1: str, v2: str) -> int:
        return stat.get(v1, stat.get(v2, 0))
    return get("total_active_file", "active_file") + get("total_inactive_file", "inactive_file")


_GLIBC: list = []


def glibc():
    """The C library as ctypes sees it (loaded once), or None where it is not glibc's."""
    if not _GLIBC:
        try:
            _GLIBC.append(ctypes.CDLL("libc.so.6"))
        except OSError:
            _GLIBC.append(None)
    return _GLIBC[0]


def trim_heap(libc=None) -> None:
    """glibc's `malloc_trim(0)` (of `libc`, default `glibc()`): the heap's free pages back to
    the system; nothing without glibc."""
    libc = glibc() if libc is None else libc
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


MADV_FREE = 8  # <asm-generic/mman-common.h>: the same on every Linux architecture


def lazy_free(addr: int, nbytes: int, libc=None) -> bool:
    """Tell the kernel it may take the pages of [addr, addr + nbytes) (page-aligned, private
    anonymous memory) when memory runs short: `madvise(MADV_FREE)`. They stay as they are
    until then, and read back as zeros once taken; a write to a page keeps it. MemAvailable and
    a cgroup's inactive file pages count them as free meanwhile. True if the kernel took the
    advice (Linux 4.5 on); False without glibc, elsewhere, or for a file-backed mapping."""
    libc = glibc() if libc is None else libc
    if libc is None or not sys.platform.startswith("linux") or not hasattr(libc, "madvise"):
        return False
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(addr, nbytes, MADV_FREE) == 0


_EXIT_SET: list = []


def exit_without_collecting() -> None:
    """Have this process's exit skip the garbage collector's passes over the objects it holds
    by then (`gc.freeze` as the last exit handler): the interpreter's teardown of a process
    that loaded Numba, SciPy and mpi4py otherwise spent 0.2-0.4 s of CPU (0.6-1.1 s at load
    8, against 0.08-0.16 frozen) collecting what the system is about to take back, after its
    work, before its parent or mpiexec saw it end. Every exit handler still runs (MPI_Finalize,
    weakref finalizers, h5py's), the standard streams are still flushed, and objects that are
    not in reference cycles are still released as the modules are cleared; only a cycle's
    finalizers do not run, which Python does not promise at exit anyway. For entry points
    (the `hepti` command, a service's worker ranks); once a process."""
    if not _EXIT_SET:
        atexit.register(gc.freeze)
        _EXIT_SET.append(True)


def _return_freed_memory() -> None:
    """Collect garbage and hand the heap's free pages back to the system (`trim_heap`),
    so that memory the probes freed is not counted as used: freed arrays below glibc's mmap
    threshold stay in the heap, and the layer probe left 72-165 MiB of RSS behind (ViT-L),
    which the profile then subtracted from what a device has."""
    gc.collect()
    trim_heap()


def available_memory() -> tuple[int, str]:
    """(bytes, source): MemAvailable, or what the cgroup still allows if that is less: its limit
    minus its usage, except page cache (`reclaimable_cache`). A capped device is charged for the
    files its processes touch first: on emu-starved's rank 0, 57-160 MiB of cache (shared
    libraries, Numba's cache files) next to 137 MiB of anonymous memory that was the same in
    every run, so counting the cache as used measured rank 0 with 42-185 MiB free from run to
    run under one 340 MiB cap, and the plan changed with it."""
    avail, source = _kib_field("/proc/meminfo", "MemAvailable"), "MemAvailable"
    if avail is None:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        source = "free pages"
    for limit_f, usage_f in cgroup_memory_files():
        room = cgroup_room(limit_f, usage_f)
        if room is None:
            continue
        limit, usage, cache = room
        if limit - usage + cache < avail:
            avail, source = max(0, limit - usage + cache), f"cgroup limit ({limit_f})"
    return avail, source


def cgroup_room(limit_f: str, usage_f: str) -> tuple[int, int, int] | None:
    """(limit, usage, page cache) in bytes of one memory cgroup, from its limit and usage files
    and the memory.stat beside them; None if one is unreadable or it has no limit. What it has
    free is limit - usage + cache (`reclaimable_cache`): what a rank reads (`available_memory`)
    and what `hepti emulate` sizes a `mem_hog` that leaves a size free by."""
    limit, usage = _read_int(limit_f), _read_int(usage_f)
    if limit is None or usage is None or limit >= (1 << 60):  # v1 says "no limit" with ~2^63
        return None
    return limit, usage, min(usage, reclaimable_cache(_memory_stat(str(Path(limit_f).parent))))


def cgroup_mounts(mountinfo: str | None = None) -> list[tuple[str, str, str, str]]:
    """(fstype "cgroup" or "cgroup2", mount point, mount root, super options) of every cgroup
    mount, in /proc/self/mountinfo's order (from its text when given); [] if unreadable."""
    if mountinfo is None:
        try:
            mountinfo = Path("/proc/self/mountinfo").read_text()
        except OSError:
            return []
    out = []
    for line in mountinfo.splitlines():
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) >= 5 and len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
            out.append((rfields[0], fields[4], fields[3], rfields[2]))
    return out


def _cgroup_mounts(mountinfo: str) -> dict[str, tuple[str, str]]:
    """Controller ('' for cgroup v2) -> (mount point, mount root), the first mount of each."""
    out: dict[str, tuple[str, str]] = {}
    for fstype, point, root, opts in cgroup_mounts(mountinfo):
        for c in [""] if fstype == "cgroup2" else opts.split(","):
            out.setdefault(c, (point, root))
    return out


def own_cgroups(proc_cgroup: str | None = None) -> dict[str, str]:
    """Controller ('' for cgroup v2) -> this process's cgroup path in that hierarchy, from
    /proc/self/cgroup (or its text when given); {} if unreadable."""
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            return {}
    out = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out.setdefault(c, path)
    return out


def cgroup_path(mount: str, root: str, path: str) -> str:
    """The directory of cgroup `path` (as /proc/self/cgroup names it) under a mount whose root
    is `root` (a cgroup namespace's mount shows only its part of the hierarchy)."""
    if root != "/" and path.startswith(root):
        path = path[len(root):] or "/"
    return os.path.normpath(mount + "/" + path.lstrip("/"))


def cgroup_dirs(controller: str, proc_cgroup: str | None = None,
                mountinfo: str | None = None) -> list[str]:
    """This process's cgroup directory for `controller` ('cpu', 'memory'; '' for cgroup v2) and
    each of its ancestors up to the hierarchy's root, innermost first. From /proc/self/cgroup
    and /proc/self/mountinfo unless their texts are given. (Without a cgroup namespace the files
    at the mount's root are the root group's, not ours: `hepti emulate` caps each device's group.)"""
    try:
        proc_cgroup = proc_cgroup if proc_cgroup is not None else Path("/proc/self/cgroup").read_text()
        mountinfo = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    except OSError:
        return []
    mounts, own = _cgroup_mounts(mountinfo), own_cgroups(proc_cgroup)
    if controller not in mounts or controller not in own:
        return []
    point, root = mounts[controller]
    path = own[controller]
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    parts = [p for p in path.split("/") if p]
    return ["/".join([point.rstrip("/")] + parts[:k]) for k in range(len(parts), -1, -1)]


@functools.lru_cache(maxsize=1)
def cgroup_memory_files() -> tuple[tuple[str, str], ...]:
    """(limit file, usage file) of this process's own memory cgroup and each of its ancestors,
    v2 and v1. Worked out once a process: a process stays in the group it was started in (`hepti
    emulate` starts each rank inside its device's), and the two /proc files it takes to find
    them were half of `available_memory`'s 2 ms, which `hepti serve --replan on` pays on every
    rank after every batch, 10 ms on a 0.2-core device."""
    return tuple([(f"{d}/memory.max", f"{d}/memory.current") for d in cgroup_dirs("")]
                 + [(f"{d}/memory.limit_in_bytes", f"{d}/memory.usage_in_bytes")
                    for d in cgroup_dirs("memory")])


def memory_limit(**paths) -> int | None:
    """The tightest memory limit (bytes) on this process's cgroup or its ancestors; None if none."""
    limits = [_read_int(f"{d}/memory.max") for d in cgroup_dirs("", **paths)]
    limits += [_read_int(f"{d}/memory.limit_in_bytes") for d in cgroup_dirs("memory", **paths)]
    limits = [x for x in limits if x is not None and x < (1 << 60)]  # v1 says "no limit" with ~2^63
    return min(limits) if limits else None


def cpu_limit(**paths) -> tuple[float | None, float | None]:
    """(cores, CFS period in seconds) of the tightest CPU quota on this process's cgroup or its
    ancestors (cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us, v2 cpu.max); (None, None) if none."""
    found = []
    for d in cgroup_dirs("", **paths):
        try:
            quota, period = Path(f"{d}/cpu.max").read_text().split()[:2]
        except (OSError, ValueError):
            continue
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            found.append((int(quota) / int(period), int(period) / 1e6))
    for d in cgroup_dirs("cpu", **paths):
        quota, period = _read_int(f"{d}/cpu.cfs_quota_us"), _read_int(f"{d}/cpu.cfs_period_us")
        if quota is not None and period:  # a quota of -1 (none) is not read as a number
            found.append((quota / period, period / 1e6))
    return min(found) if found else (None, None)


def _kib_field(path: str, name: str) -> int | None:
    """Bytes of the "name: N kB" line of a /proc file (status, meminfo); None if unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(name + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def process_rss(pid: int | str = "self") -> int | None:
    """Resident set size (bytes, VmRSS) of process `pid` (this one by default); None if it is
    gone or unreadable."""
    return _kib_field(f"/proc/{pid}/status", "VmRSS")


def mem_total() -> int:
    """This machine's memory (MemTotal), in bytes; 0 when unreadable."""
    return _kib_field("/proc/meminfo", "MemTotal") or 0


def reset_peak_rss() -> None:
    """Start the peak-RSS count afresh (Linux: writing 5 to clear_refs resets VmHWM), so a
    job's peak is its own and not an earlier job's in the same process."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def peak_rss() -> int:
    """Peak resident set size (bytes) since the last reset_peak_rss (VmHWM), else lifetime."""
    hwm = _kib_field("/proc/self/status", "VmHWM")
    return hwm if hwm is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """Resident set size now (bytes), from /proc/self/statm."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
