"""Files an MPI job leaves behind when it is killed, and removing them without harming a live job.

MPICH and its launcher, Hydra, make files in places we cannot choose:

- /dev/shm/mpich_shm_<job>_<node> (1-3 MiB; also mpich_vci_*): made by the first rank of a node
  in MPI_Init, removed in MPI_Finalize; left when a rank is killed.
- /dev/shm/mpich_shar_tmp* (in /tmp when /dev/shm is full): MPI_Win_allocate_shared's segment
  (parallel/comm.py's windows), removed once every rank attached; left by a kill in between.
- /tmp/hydra_hwloc_xmlfile_* (5 KiB): each Hydra proxy's topology for its ranks, removed as the
  proxy exits; left when the proxy is killed.
- $TMPDIR/hepti-serve-<pid>-*: hepti serve's front end's directory (its launches' hostfiles),
  removed at stop; left when the front end is killed.

They are left by `kill -9` of a rank (a "device unplugged", the OOM killer), by `hepti emulate`'s
teardown (which SIGKILLs every process of the run, proxies included) and by a second Ctrl-C.

Why sweep instead of pointing them into a per-job directory: Hydra's path is fixed in its source
(`/tmp/hydra_hwloc_xmlfile_XXXXXX`; TMPDIR is not read) and shm_open() always means /dev/shm.
Setting HWLOC_XMLFILE stops Hydra writing its XML, but then hwloc loads the topology from that
file instead of the machine: a file we would have to produce (no lstopo here) and keep current,
or ranks would be bound by a stale topology. So whoever launches a job sweeps after it:

* A file is *held* while a live process has it open (/proc/*/fd) or mapped (/proc/*/maps). Each
  file above is held by its maker from the moment it exists (mkstemp() and shm_open() return an
  open descriptor, a rank maps its segment before closing that descriptor and keeps it mapped
  until MPI_Finalize, and Hydra's proxy never closes its XML), so a file that nobody holds
  belongs to a job that is over: another job still running holds its own. (The proxy's open
  descriptor is what keeps a running job's XML; test_jobfiles checks that MPICH still works so.)
  A hepti-serve directory is held while the pid in its name runs (a pid that a later process
  reuses does not count).
* `sweep(since)` removes the unheld files that are not in `since`, a `snapshot()` taken before
  the launch: what our job left (and any other finished job's files from that time), nothing
  older. `hepti emulate --cleanup` calls `sweep()` without a snapshot: every unheld one.

Limits: processes in another pid namespace (a container sharing /dev/shm) are not seen; a user
who is not root sees only their own processes, so only their own files are considered.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
TMP_DIR = Path("/tmp")
SERVE_PREFIX = "hepti-serve-"  # + "<pid>-" + tempfile's random part (hepti.serve.supervisor)
_SHM_RE = re.compile(r"^(mpich_shm_|mpich_vci_|mpich_shar_tmp)")
_XML_RE = re.compile(r"^hydra_hwloc_xmlfile_")
_SERVE_RE = re.compile(rf"^{SERVE_PREFIX}(\d+)-")


@dataclass(frozen=True)
class JobFile:
    path: Path
    kind: str  # "MPICH shared memory", "Hydra topology file", "hepti serve directory"
    inode: int
    mtime: float
    size: int
    owner_pid: int | None = None  # hepti serve directories: the front end's pid

    def describe(self) -> str:
        size = f", {self.size / 2**20:.1f} MiB" if self.size >= 2**20 else ""
        return f"{self.kind} {self.path}{size}"


Snapshot = frozenset  # of (path, inode): what existed before a launch


def serve_dir_prefix(pid: int | None = None) -> str:
    """The prefix hepti serve's temporary directory gets: its front end's pid in the name, so a
    directory whose front end was killed can be told from one in use."""
    return f"{SERVE_PREFIX}{os.getpid() if pid is None else pid}-"


def _tmp_dirs() -> list[Path]:
    dirs = [TMP_DIR, Path(tempfile.gettempdir())]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i]]


def find_files() -> list[JobFile]:
    """Every file of the kinds above on this machine (held or not), ours to remove (own uid, or root)."""
    uid = os.geteuid()
    out: list[JobFile] = []

    def add(path: Path, kind: str, owner_pid: int | None = None) -> None:
        try:
            st = path.lstat()
        except OSError:  # removed meanwhile
            return
        if uid == 0 or st.st_uid == uid:
            out.append(JobFile(path, kind, st.st_ino, st.st_mtime, st.st_size, owner_pid))

    for d in (SHM_DIR, *_tmp_dirs()):
        try:
            names = os.listdir(d)
        except OSError:
            continue
        for name in names:
            if _SHM_RE.match(name):
                add(d / name, "MPICH shared memory")
            elif d != SHM_DIR and _XML_RE.match(name):
                add(d / name, "Hydra topology file")
            elif d != SHM_DIR and (m := _SERVE_RE.match(name)):
                add(d / name, "hepti serve directory", int(m.group(1)))
    return out


def snapshot() -> Snapshot:
    """What exists now; `sweep(since=...)` leaves these alone."""
    return frozenset((f.path, f.inode) for f in find_files())


@dataclass
class _Live:
    """What the live processes hold: the paths they have open or mapped, and when each started."""
    paths: set[str]
    started: dict[int, float]


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


def _live() -> _Live:
    boot, tick = _boot_time(), os.sysconf("SC_CLK_TCK")
    live = _Live(set(), {})
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        proc = f"/proc/{entry}"
        try:
            stat = Path(proc, "stat").read_text()
            started = boot + int(stat.rsplit(")", 1)[1].split()[19]) / tick
        except (OSError, ValueError, IndexError):  # gone meanwhile
            continue
        live.started[int(entry)] = started
        try:
            for fd in os.listdir(proc + "/fd"):
                try:
                    live.paths.add(os.readlink(f"{proc}/fd/{fd}"))
                except OSError:
                    continue
        except OSError:  # another user's process (not root), or gone
            pass
        try:
            with open(proc + "/maps") as maps:
                for line in maps:
                    i = line.find("/")
                    if i >= 0:
                        live.paths.add(line[i:].rstrip("\n"))
        except OSError:
            pass
    return live


def _held(f: JobFile, live: _Live) -> bool:
    if f.owner_pid is not None:  # a serve directory: its front end runs (and started before it)
        started = live.started.get(f.owner_pid)
        if started is not None and started <= f.mtime + 1.0:  # (1 s: ticks vs. file times)
            return True
        inside = str(f.path) + "/"
        return any(p.startswith(inside) for p in live.paths)
    return str(f.path) in live.paths


def leftovers(since: Snapshot | None = None) -> list[JobFile]:
    """The files no live process holds (and, given a snapshot, that were not there then)."""
    files = [f for f in find_files() if since is None or (f.path, f.inode) not in since]
    if not files:
        return []
    live = _live()  # read after listing: a file listed was made by a process alive then, or before
    return sorted((f for f in files if not _held(f, live)), key=lambda f: str(f.path))


def sweep(since: Snapshot | None = None) -> list[str]:
    """Remove `leftovers(since)`; a line per file removed."""
    removed = []
    for f in leftovers(since):
        try:
            if f.owner_pid is not None:
                shutil.rmtree(f.path)
            else:
                f.path.unlink()
        except FileNotFoundError:  # its own job removed it meanwhile
            continue
        except OSError:
            continue
        removed.append(f.describe())
    return removed



def save_snapshot(path: str | Path) -> None:
    Path(path).write_text(json.dumps(sorted([str(p), ino] for p, ino in snapshot())))


def load_snapshot(path: str | Path) -> Snapshot:
    return frozenset((Path(p), ino) for p, ino in json.loads(Path(path).read_text()))


def main(argv: list[str] | None = None) -> int:
    """`python -m hepti.emulate.jobfiles snapshot FILE`, then `... sweep [--since FILE]`: the
    same around jobs that no hepti launcher starts (bin/test's distributed tests, a script's
    own mpiexec). Prints a line per file removed."""
    ap = argparse.ArgumentParser(prog="python -m hepti.emulate.jobfiles", description=main.__doc__)
    sub = ap.add_subparsers(dest="verb", required=True)
    sub.add_parser("snapshot").add_argument("file")
    sub.add_parser("sweep").add_argument("--since", metavar="FILE")
    args = ap.parse_args(argv)
    if args.verb == "snapshot":
        save_snapshot(args.file)
    else:
        for line in sweep(load_snapshot(args.since) if args.since else None):
            print(f"removed {line}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
