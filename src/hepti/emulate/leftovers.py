"""Finding and removing what emulation runs leave behind (`hepti emulate --cleanup`).

Every object carries its launcher's pid (names.py). A run is *alive* when its run directory's
owner.json names a process that is still running (same pid and start time) and the run was not
a finished `--keep` run; anything else is a leftover. A new run refuses to start while leftovers
exist (they would distort timings or hold stale processes); `cleanup()` kills the processes in
their cgroups and namespaces and removes links, namespaces, cgroups and the run directory.
Runs that are alive (another user's emulation in progress) are left alone. `cleanup()` also
removes the files killed MPI jobs leave outside any run (MPICH's /dev/shm segments, Hydra's /tmp
topology files, a killed `hepti serve`'s temporary directory) that no live process holds:
jobfiles.py says how that is told safely while other jobs run.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hepti.emulate import actions, jobfiles, net
from hepti.emulate.cgroups import find_groups, kill_procs, remove_tree
from hepti.emulate.command import log
from hepti.emulate.names import RUN_ROOT, RunNames, owner_of_link, owner_of_netns
from hepti.emulate.spec import EmulateError

TOOLS = {"ip": "iproute2", "tc": "iproute2", "nsenter": "util-linux", "unshare": "util-linux"}


def proc_starttime(pid: int) -> str | None:
    """The kernel's start time of process pid (tells a live owner from a reused pid)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


@dataclass
class RunLeftovers:
    """What one run (by launcher pid) still has on the system."""

    pid: int
    netns: list[str] = field(default_factory=list)
    links: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)
    run_dir: str | None = None
    alive: bool = False

    def empty(self) -> bool:
        return not (self.netns or self.links or self.cgroups or self.run_dir)

    def describe(self) -> str:
        parts = []
        if self.netns:
            parts.append("network namespaces " + ", ".join(sorted(self.netns)))
        if self.links:
            parts.append("links " + ", ".join(sorted(self.links)))
        if self.cgroups:
            parts.append("cgroups " + ", ".join(sorted(self.cgroups)))
        if self.run_dir:
            parts.append(f"run directory {self.run_dir}")
        return "; ".join(parts)


def _run_alive(pid: int) -> bool:
    """Is the launcher that owns these objects still running (and not a --keep run that ended)?"""
    try:
        owner = json.loads((RUN_ROOT / str(pid) / "owner.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return not owner.get("finished") and owner.get("starttime") == proc_starttime(pid)


def find_runs() -> dict[int, RunLeftovers]:
    """Every hepti emulate run with objects on this machine, by launcher pid."""
    runs: dict[int, RunLeftovers] = {}

    def get(pid: int) -> RunLeftovers:
        return runs.setdefault(pid, RunLeftovers(pid))

    for ns in net.list_netns():
        pid = owner_of_netns(ns)
        if pid is not None:
            get(pid).netns.append(ns)
    for link in net.list_links():
        pid = owner_of_link(link)
        if pid is not None:
            get(pid).links.append(link)
    for path, pid in find_groups():
        get(pid).cgroups.append(path)
    if RUN_ROOT.is_dir():
        for d in RUN_ROOT.iterdir():
            if d.name.isdigit():
                get(int(d.name)).run_dir = str(d)
    for pid, run in runs.items():
        run.alive = _run_alive(pid)
    return runs


def require_root(what: str) -> None:
    """Refuse, saying how to run it, unless we are root."""
    if os.geteuid() != 0:
        raise EmulateError(f"{what} needs root (network namespaces, tc and cgroups); run it with "
                           "sudo, e.g. `sudo env PATH=$PATH hepti emulate ...`")


def require_tools() -> None:
    """Refuse, naming the Debian packages, when ip, tc, nsenter or unshare is missing."""
    missing = sorted({pkg for tool, pkg in TOOLS.items() if shutil.which(tool) is None})
    if missing:
        raise EmulateError(f"hepti emulate needs {', '.join(t for t in TOOLS if shutil.which(t) is None)}; "
                           f"install them with `apt-get install -y {' '.join(missing)}` (Debian/Ubuntu)")


def cleanup(*, include_live: bool = False, pid: int | None = None) -> list[str]:
    """Remove what earlier `hepti emulate` runs left behind; return a line per removed object.

    Runs whose launcher is still running are left alone unless include_live is True; `pid`
    limits the clean-up to the run of that launcher pid. Without `pid`, the MPI jobs' files that
    no live process holds go too (after the dead runs' processes are killed)."""
    require_root("hepti emulate --cleanup")
    removed: list[str] = []
    for owner, run in sorted(find_runs().items()):
        if (run.alive and not include_live) or (pid is not None and owner != pid):
            continue
        dirs = run.cgroups
        ns_pids = [p for ns in run.netns for p in net.netns_pids(ns)]
        for p in kill_procs(dirs, extra=ns_pids):
            removed.append(f"process {p}")
        names = RunNames(owner, 0)
        for a in net.teardown_actions(names, netns=run.netns, links=run.links):
            actions.run(a)
        removed += [f"link {x}" for x in sorted(run.links)]
        removed += [f"network namespace {x}" for x in sorted(run.netns)]
        for d in dirs:
            remove_tree(d)
            removed.append(f"cgroup {d}")
        if run.run_dir:
            shutil.rmtree(run.run_dir, ignore_errors=True)
            removed.append(f"run directory {run.run_dir}")
    if pid is None:
        removed += jobfiles.sweep()
    return removed


def check_leftovers(own_pid: int) -> None:
    """Refuse while an earlier run's objects remain; note other live runs (they share the cores)."""
    runs = find_runs()
    dead = [r for r in runs.values() if not r.alive]
    if dead:
        what = "; ".join(f"launcher pid {r.pid} (not running): {r.describe()}" for r in dead)
        raise EmulateError(f"leftovers of an earlier `hepti emulate` run are still here ({what}). "
                           "Remove them with `hepti emulate --cleanup`, then run again")
    for r in runs.values():
        if r.pid != own_pid:
            log(f"note: another emulation (launcher pid {r.pid}) is running; both share this "
                "machine's cores, so timings will be slower than the specs say")
