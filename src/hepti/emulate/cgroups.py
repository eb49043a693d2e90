"""CPU and memory caps for emulated devices, through cgroup v1 or v2, whichever the kernel uses.

A run makes one group `hepti-emu-<pid>` with a leaf per device (`dev<i>`) and one for the head
(`head`: mpiexec and COMMAND, no caps; it is there so teardown can find and kill every process).

- cgroup v1 (this machine: cpu and memory each mounted under /sys/fs/cgroup/): the group is
  made under the launcher's own cgroup in each hierarchy, so accounting stays where the caller
  put it. CPU: `cpu.cfs_period_us` / `cpu.cfs_quota_us`; memory: `memory.limit_in_bytes` (and
  `memory.memsw.limit_in_bytes` when swap is accounted, so a device cannot swap past its cap);
  OOM kills are counted in `memory.oom_control` (`oom_kill N`). A device's leaf in the freezer
  hierarchy, where it is mounted, lets a schedule hang the device (`freezer.state` FROZEN).
- cgroup v2 (most current distributions): controllers can only be enabled in a group with no
  processes of its own, so the group is made under the root. `cpu.max`, `memory.max`,
  `memory.swap.max` = 0, OOM kills in `memory.events`, a hang by `cgroup.freeze`. Written to
  the kernel's documentation; this machine has no v2 controllers, so that path is untested here.

The CFS period is 10 ms (a capped rank runs in slices of at most 10 ms instead of the default
100 ms, so it does not stutter); the kernel's smallest quota is 1 ms, so shares below 0.1 core
get a longer period (1 ms / share).

Weights matter when the machine is busy. CFS shares CPU between sibling groups by weight, so
with default weights the whole emulation (one group) competed like a single process against
every other busy process: with three other busy jobs on this 2-core machine a 1-core device
got 0.35 core. The group's weight is 4x the default per device, so devices get their quotas
on a moderately busy machine (never more: the quotas cap them), and each device's weight is
proportional to its share, so under heavier contention all devices slow down by the same
factor and their speed ratios, which the planner relies on, stay as specified.
"""
from __future__ import annotations

import math
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from hepti.emulate.actions import Action, Mkdir, Rmdir, Write
from hepti.emulate.names import CGROUP_RE, RunNames
from hepti.emulate.spec import ClusterSpec, EmulateError
from hepti.resources import cgroup_mounts, cgroup_path, cgroup_room, own_cgroups

PERIOD_US = 10_000
MIN_QUOTA_US = 1_000
SCAN_DEPTH = 6
GROUP_WEIGHT_PER_DEVICE = 4  # x the default weight (1024 in v1, 100 in v2), see the docstring


def cpu_quota(cpu: float) -> tuple[int, int]:
    """(quota_us, period_us) giving `cpu` cores with a period of 10 ms or just long enough."""
    period = max(PERIOD_US, math.ceil(MIN_QUOTA_US / cpu))
    return max(MIN_QUOTA_US, round(cpu * period)), period


@dataclass(frozen=True)
class Cgroups:
    """Where this run's groups live and how caps are written (v1 or v2)."""

    version: int
    cpu_base: str  # directory the run's group is made in, cpu hierarchy
    memory_base: str  # same, memory hierarchy (equal to cpu_base under v2)
    quota_factor: float = 1.0  # quota = factor x share (hepti.emulate.stretch.GUARD when stretched)
    freezer_base: str | None = None  # v1's freezer hierarchy, if mounted (a schedule's `hang`)

    @classmethod
    def detect(cls) -> "Cgroups":
        """Find the cpu and memory controllers, or say what is missing."""
        mounts = cgroup_mounts()
        own = own_cgroups()
        v1 = {}
        for fstype, point, root, opts in mounts:
            if fstype == "cgroup":
                for c in ("cpu", "memory", "freezer"):
                    if c in opts.split(",") and c not in v1:
                        v1[c] = cgroup_path(point, root, own.get(c, "/"))
        if "cpu" in v1 and "memory" in v1:
            return cls(1, v1["cpu"], v1["memory"], freezer_base=v1.get("freezer"))
        for fstype, point, root, _ in mounts:
            if fstype == "cgroup2":
                try:
                    ctrls = Path(point, "cgroup.controllers").read_text().split()
                except OSError:
                    continue
                if "cpu" in ctrls and "memory" in ctrls:
                    return cls(2, point, point)
        raise EmulateError(
            "hepti emulate needs the cpu and memory cgroup controllers, and this kernel offers "
            f"neither cgroup v1 hierarchies nor a cgroup v2 root with both (found: {sorted(v1) or 'none'} "
            "in v1). Boot with them enabled (e.g. `cgroup_enable=memory` on the kernel command line)")

    def bases(self) -> list[str]:
        if self.version == 2:
            return [self.cpu_base]
        return [self.cpu_base, self.memory_base] + ([self.freezer_base] if self.freezer_base else [])

    @property
    def can_freeze(self) -> bool:
        return self.version == 2 or self.freezer_base is not None

    def group_dirs(self, names: RunNames) -> list[str]:
        return [f"{b}/{names.cgroup_group}" for b in self.bases()]

    def leaf_dirs(self, names: RunNames, i: int | None) -> list[str]:
        """The cgroup directories a process of device i (head when None) must join."""
        return [f"{b}/{names.cgroup_leaf(i)}" for b in self.bases()]

    def _cpu_dir(self, names: RunNames, i: int) -> str:
        return f"{self.cpu_base}/{names.cgroup_leaf(i)}"

    def _mem_dir(self, names: RunNames, i: int) -> str:
        return f"{self.memory_base}/{names.cgroup_leaf(i)}"

    def cpu_actions(self, names: RunNames, i: int, cpu: float) -> list[Action]:
        """Quota and period for `cpu` cores (times `quota_factor`), and a weight proportional
        to the share."""
        quota, period = cpu_quota(cpu * self.quota_factor)
        d = self._cpu_dir(names, i)
        if self.version == 2:
            return [Write(f"{d}/cpu.max", f"{quota} {period}"),
                    Write(f"{d}/cpu.weight", str(min(10_000, max(1, round(100 * cpu)))))]
        return [Write(f"{d}/cpu.cfs_period_us", str(period)), Write(f"{d}/cpu.cfs_quota_us", str(quota)),
                Write(f"{d}/cpu.shares", str(min(262_144, max(2, round(1024 * cpu)))))]

    def group_weight_actions(self, names: RunNames) -> list[Action]:
        g = f"{self.cpu_base}/{names.cgroup_group}"
        n = GROUP_WEIGHT_PER_DEVICE * names.n_devices
        if self.version == 2:
            return [Write(f"{g}/cpu.weight", str(min(10_000, 100 * n)))]
        return [Write(f"{g}/cpu.shares", str(min(262_144, 1024 * n)))]

    def mem_actions(self, names: RunNames, i: int, mem_bytes: int) -> list[Action]:
        d = self._mem_dir(names, i)
        if self.version == 2:  # swap files exist only when swap is accounted
            return [Write(f"{d}/memory.max", str(mem_bytes)),
                    Write(f"{d}/memory.swap.max", "0", optional=True)]
        return [Write(f"{d}/memory.limit_in_bytes", str(mem_bytes)),
                Write(f"{d}/memory.memsw.limit_in_bytes", str(mem_bytes), optional=True)]

    def freeze_actions(self, names: RunNames, i: int, frozen: bool) -> list[Action]:
        """Device i hung (every process of it stopped where it stands, as a board whose kernel
        froze: no exit, no closed socket, no error anywhere) or running again.

        The freezer, not SIGSTOP: a process that joins the device later (a probe launched to see
        whether it answers again) is frozen too, and nothing it runs can tell. Under v1 a frozen
        process cannot even die of SIGKILL until thawed, like a hung board that nobody can reach;
        teardown and `--cleanup` thaw a group before they kill (`kill_procs`)."""
        if self.version == 2:
            return [Write(f"{self.cpu_base}/{names.cgroup_leaf(i)}/cgroup.freeze", "1" if frozen else "0")]
        if self.freezer_base is None:
            raise EmulateError("a schedule's `hang` needs the freezer cgroup controller, which is not "
                               "mounted here (mount it: `mount -t cgroup -o freezer freezer "
                               "/sys/fs/cgroup/freezer`)")
        return [Write(f"{self.freezer_base}/{names.cgroup_leaf(i)}/freezer.state",
                      "FROZEN" if frozen else "THAWED")]

    def mem_change_actions(self, names: RunNames, i: int, mem_bytes: int) -> list[Action]:
        """A running device's new cap (a schedule's `mem`). v1 keeps memsw.limit (memory plus
        swap) at least memory.limit at every write, so, whether the cap rises or falls, memsw
        is lifted first and set to the cap last. Below what the device uses and cannot
        reclaim, v1 refuses the limit with EBUSY (the caller says so and puts memsw back:
        `mem_restore_actions`); v2 reclaims and then OOM-kills."""
        d = self._mem_dir(names, i)
        if self.version == 2:
            return [Write(f"{d}/memory.max", str(mem_bytes))]
        return [Write(f"{d}/memory.memsw.limit_in_bytes", "-1", optional=True),
                Write(f"{d}/memory.limit_in_bytes", str(mem_bytes)),
                Write(f"{d}/memory.memsw.limit_in_bytes", str(mem_bytes), optional=True)]

    def mem_restore_actions(self, names: RunNames, i: int, mem_bytes: int | None) -> list[Action]:
        """After a refused `mem_change_actions`: memsw back to the cap that stayed."""
        if self.version == 2:
            return []
        return [Write(f"{self._mem_dir(names, i)}/memory.memsw.limit_in_bytes",
                      "-1" if mem_bytes is None else str(mem_bytes), optional=True)]

    def mem_used(self, names: RunNames, i: int) -> int | None:
        """What device i uses now (bytes; RSS plus page cache), if the kernel says."""
        d = self._mem_dir(names, i)
        f = f"{d}/memory.current" if self.version == 2 else f"{d}/memory.usage_in_bytes"
        try:
            return int(Path(f).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def mem_room(self, names: RunNames, i: int) -> tuple[int, int, int] | None:
        """(cap, used, page cache) of device i now, in bytes (hepti.resources.cgroup_room: it
        has cap - used + cache free, as its ranks read it); None without a cap."""
        d = self._mem_dir(names, i)
        if self.version == 2:
            return cgroup_room(f"{d}/memory.max", f"{d}/memory.current")
        return cgroup_room(f"{d}/memory.limit_in_bytes", f"{d}/memory.usage_in_bytes")

    def create_actions(self, names: RunNames, spec: ClusterSpec) -> list[Action]:
        """Make the group, its leaves, and write every device's caps."""
        acts: list[Action] = []
        if self.version == 2:
            acts.append(Write(f"{self.cpu_base}/cgroup.subtree_control", "+cpu +memory"))
        for g in self.group_dirs(names):
            acts.append(Mkdir(g))
            if self.version == 2:
                acts.append(Write(f"{g}/cgroup.subtree_control", "+cpu +memory"))
        acts += self.group_weight_actions(names)
        for i in [None] + list(range(len(spec.devices))):
            acts += [Mkdir(d) for d in self.leaf_dirs(names, i)]
        for i, dev in enumerate(spec.devices):
            acts += self.cpu_actions(names, i, dev.cpu)
            if dev.mem_bytes is not None:
                acts += self.mem_actions(names, i, dev.mem_bytes)
        return acts

    def remove_actions(self, names: RunNames) -> list[Action]:
        acts: list[Action] = []
        for i in [None] + list(range(names.n_devices)):
            acts += [Rmdir(d) for d in self.leaf_dirs(names, i)]
        return acts + [Rmdir(g) for g in self.group_dirs(names)]

    def oom_kills(self, names: RunNames, i: int) -> int:
        """How many processes of device i the OOM killer has killed."""
        d = self._mem_dir(names, i)
        f = f"{d}/memory.events" if self.version == 2 else f"{d}/memory.oom_control"
        try:
            for line in Path(f).read_text().splitlines():
                k, _, v = line.partition(" ")
                if k == "oom_kill":
                    return int(v)
        except OSError:
            pass
        return 0

    def peak_mem(self, names: RunNames, i: int) -> int | None:
        """Largest memory use of device i so far (bytes; RSS plus page cache), if the kernel says."""
        d = self._mem_dir(names, i)
        f = f"{d}/memory.peak" if self.version == 2 else f"{d}/memory.max_usage_in_bytes"
        try:
            return int(Path(f).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None


def procs_in(dirs: list[str]) -> list[int]:
    """Pids in the given cgroup directories and all their descendants."""
    pids: set[int] = set()
    for d in dirs:
        for root, _, files in os.walk(d):
            if "cgroup.procs" in files:
                try:
                    pids.update(int(x) for x in Path(root, "cgroup.procs").read_text().split())
                except (OSError, ValueError):
                    pass
    return sorted(pids)


def thaw(dirs: list[str]) -> None:
    """Let every frozen group under `dirs` run again (a device a schedule hung): under cgroup v1 a
    frozen process does not die of SIGKILL until it is thawed."""
    for d in dirs:
        for root, _, files in os.walk(d):
            for f, running in (("freezer.state", "THAWED"), ("cgroup.freeze", "0")):
                if f in files:
                    try:
                        Path(root, f).write_text(running)
                    except OSError:
                        pass


def kill_procs(dirs: list[str], extra: list[int] = (), wait_s: float = 5.0) -> list[int]:
    """SIGKILL every process in the cgroups (and `extra`) until none is left; return who was killed."""
    thaw(dirs)
    killed: list[int] = []
    deadline = time.monotonic() + wait_s
    todo = sorted(set(procs_in(dirs)) | set(extra))
    while todo:
        for pid in todo:
            try:
                os.kill(pid, signal.SIGKILL)
                if pid not in killed:
                    killed.append(pid)
            except ProcessLookupError:
                pass
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
        todo = procs_in(dirs)
    return killed


def remove_tree(d: str, wait_s: float = 5.0) -> None:
    """rmdir a cgroup directory and its sub-groups, bottom-up (they must be empty of processes).

    Freshly killed processes take a moment to leave their group, so busy groups are retried."""
    deadline = time.monotonic() + wait_s
    subdirs = [root for root, _, _ in os.walk(d)]
    for sub in sorted(subdirs, key=len, reverse=True):
        while True:
            try:
                os.rmdir(sub)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if time.monotonic() > deadline:
                    raise EmulateError(f"cannot remove cgroup {sub}: {e.strerror}; processes left: "
                                       f"{procs_in([sub]) or 'none'}") from None
                time.sleep(0.05)


def find_groups() -> list[tuple[str, int]]:
    """(path, owner pid) of every `hepti-emu-<pid>` group in any cgroup hierarchy."""
    found: list[tuple[str, int]] = []
    seen: set[str] = set()
    for _, point, _, _ in cgroup_mounts():
        if point in seen:
            continue
        seen.add(point)
        stack = [(point, 0)]
        while stack:
            d, depth = stack.pop()
            try:
                entries = list(os.scandir(d))
            except OSError:
                continue
            for e in entries:
                if not e.is_dir(follow_symlinks=False):
                    continue
                m = CGROUP_RE.match(e.name)
                if m:
                    found.append((e.path, int(m.group(1))))
                elif depth + 1 < SCAN_DEPTH:
                    stack.append((e.path, depth + 1))
    return found
