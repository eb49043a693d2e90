"""Run a command on an emulated heterogeneous cluster: `hepti emulate --cluster SPEC -- COMMAND`.

How a rank lands on its device (no flags needed on the user's mpiexec):
1. The launcher builds the network (net.py) and cgroups (cgroups.py), writes a hostfile with one
   host per device (`10.213.0.(10+i):1`) and a launcher script, `launch.sh`.
2. It runs COMMAND in the head namespace (10.213.0.1, unshaped) and in the head cgroup, with
   `HYDRA_HOST_FILE`, `HYDRA_LAUNCHER=ssh`, `HYDRA_LAUNCHER_EXEC=launch.sh` and
   `HYDRA_IFACE=emu0` in its environment: MPICH's mpiexec (Hydra) reads them as if they were
   `-f`, `-launcher`, `-launcher-exec` and `-iface` flags.
3. Hydra "ssh"es to host i by running `launch.sh -x 10.213.0.(10+i) PROXY-COMMAND`. The script
   puts itself into device i's cgroups, enters its network namespace with `nsenter --net`
   (not `ip netns exec`, which remounts /sys and so hides /sys/fs/cgroup) and a new UTS
   namespace whose hostname is the device name, sets `HEPTI_EMULATE_DEVICE=i` and execs the
   proxy; the proxy starts rank i there. Rank i therefore runs on device i (ranks beyond the
   device count are refused: one rank per device).
4. MPICH is told to use TCP over the shaped links: `MPIR_CVAR_NOLOCAL=1`,
   `MPIR_CVAR_CH4_NETMOD=ofi`, `FI_PROVIDER=tcp`, `FI_TCP_IFACE=emu0` (without NOLOCAL it would
   use shared memory; distinct hostnames per device also keep it off shared memory), and
   `HEPTI_COMM=p2p` keeps hepti's own shared-window transport (parallel/comm.py) off them too.
   Open MPI cannot do this (its PMIx server binds 127.0.0.1), so COMMAND's mpiexec must be
   MPICH's Hydra; a bare `mpiexec` is taken from next to sys.executable (the hepti venv) first,
   and that directory leads COMMAND's PATH, so the ranks' bare `hepti` or `python` is found too.

Around COMMAND: a monitor thread applies the spec's schedule and rewrites the state file
(state.py), and idle fillers keep the CPUs from halting (idle.py); when COMMAND ends,
out-of-memory kills are reported per device. A schedule's `mem` rewrites a device's cap, and
says so when the kernel refuses one below what the device uses (EBUSY); its `mem_hog` starts
another program in the device that takes memory (hog.py: a fixed size, or all the device has
free at that moment but a size, read from its cgroup), and reports any OOM kill that made
room for it. Before COMMAND starts, the host's clean page cache
is dropped (`--keep-page-cache` skips it): a device's RAM holds its own page cache, and a cgroup
is charged only for the file pages it faults in first, so weights an earlier run left cached
outside the caps would be served to a capped device for free. emu-starved's `stream`, which
re-reads its slices every forward, took 1380 ms after earlier runs had cached the shards and
1500-1580 ms with the pages charged to its own ranks, as on a device with that little RAM.
Teardown (kill every
process in the run's cgroups and namespaces, delete veths, bridge, namespaces, cgroups, run
directory) happens on success, failure, Ctrl-C, SIGTERM/SIGHUP and `timeout`; a second Ctrl-C
skips the grace period. Then the files that COMMAND's MPI jobs left outside the run directory
(MPICH's /dev/shm segments, Hydra's /tmp topology files, a killed `hepti serve`'s temporary
directory: the teardown's SIGKILL gives them no chance to remove their own) are removed: those
made during the run that no live process holds (jobfiles.py). If the launcher itself is
SIGKILLed, mpiexec dies with it (PR_SET_PDEATHSIG) and the next run finds the leftovers and
points to `hepti emulate --cleanup`.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hepti.emulate import actions, hog, idle, jobfiles, net, stretch
from hepti.emulate.cgroups import Cgroups, kill_procs, remove_tree
from hepti.emulate.command import die_with_parent, find_mpiexec, log, prepare_command
from hepti.emulate.leftovers import (check_leftovers, cleanup, find_runs, proc_starttime,
                                     require_root, require_tools)
from hepti.emulate.names import INNER_IFACE, RunNames
from hepti.emulate.spec import (MIN_HOG, ClusterSpec, EmulateError, check_cpu_fits, format_mem,
                                load_spec)
from hepti.emulate.state import DEVICE_ENV, HOST_NETNS_ENV, STATE_ENV, write_state

MPICH_TCP_ENV = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp",
                 "FI_TCP_IFACE": INNER_IFACE, "HEPTI_COMM": "p2p"}
GRACE_S = (3.0, 3.0)  # after SIGINT, then after SIGTERM, before SIGKILL
_ONE_RUN = threading.Lock()  # names derive from the pid: one run per process at a time

__all__ = ["run_emulated", "cleanup", "find_mpiexec", "find_runs"]  # what the CLI and tests use


def _launch_script(names: RunNames, spec: ClusterSpec, cg: Cgroups) -> str:
    """The script Hydra runs in place of ssh to start device i's proxy (see the module docstring)."""
    lines = [
        "#!/bin/sh",
        f"# Generated by `hepti emulate` (launcher pid {names.pid}, spec {spec.name}).",
        "# MPICH's Hydra runs it in place of ssh (HYDRA_LAUNCHER=ssh, HYDRA_LAUNCHER_EXEC=this file) as",
        "#   launch.sh [ssh options] HOST COMMAND...",
        "# and it starts COMMAND (Hydra's proxy, which starts the rank) as device HOST: in the",
        "# device's cgroups, in its network namespace, with the device name as hostname.",
        'while [ $# -gt 0 ]; do',
        '    case "$1" in',
        "        -[bcDEeFIiJLlmOopQRSWw]) shift 2 ;;",
        "        -*) shift ;;",
        "        *) break ;;",
        "    esac",
        "done",
        'host="$1"; shift',
        'case "$host" in',
    ]
    for i, dev in enumerate(spec.devices):
        lines.append(f"    {names.address(i)})")
        for d in cg.leaf_dirs(names, i):
            lines.append(f"        echo $$ > {shlex.quote(d + '/cgroup.procs')} || exit 255")
        lines.append(f"        exec nsenter --net=/run/netns/{names.netns(i)} unshare --uts sh -c "
                     f"\"echo {dev.name} > /proc/sys/kernel/hostname && {DEVICE_ENV}={i} exec $*\" ;;")
    lines += [f'    *) echo "hepti emulate: $host is not a device of spec {spec.name}" >&2; exit 255 ;;',
              "esac", ""]
    return "\n".join(lines)


def _head_script(names: RunNames, cg: Cgroups) -> str:
    """The wrapper that puts COMMAND into the head cgroup and namespace before exec'ing it."""
    lines = ["#!/bin/sh",
             "# Generated by `hepti emulate`: runs COMMAND in the head cgroup and network namespace."]
    lines += [f"echo $$ > {shlex.quote(d + '/cgroup.procs')} || exit 255"
              for d in cg.leaf_dirs(names, None)]
    lines += [f'exec nsenter --net=/run/netns/{names.head_netns} -- "$@"', ""]
    return "\n".join(lines)


class _Interrupted(Exception):
    """A signal arrived during setup: abandon it (the caller tears down)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


DROP_CACHES = "/proc/sys/vm/drop_caches"


def drop_page_cache() -> None:
    """Write back dirty pages, then drop every clean page-cache page on the host."""
    os.sync()
    try:
        Path(DROP_CACHES).write_text("1\n")
    except OSError as e:  # e.g. a container without a writable /proc/sys: say so, go on warm
        log(f"could not drop the page cache ({e}); devices may read files cached by earlier "
            "runs for free; pass --keep-page-cache to skip this step")


@dataclass
class _Run:
    """One emulation: its names, files, state and the COMMAND process."""

    spec: ClusterSpec
    names: RunNames
    cg: Cgroups
    phase: str = "setup"
    stop_signal: int | None = None
    force: bool = False
    timed_out: bool = False
    idle_fill: bool = True
    cold_cache: bool = True
    started_at: float = 0.0
    schedule_on_usr1: bool = False  # the schedule's clock starts at SIGUSR1, not with COMMAND
    schedule_t0: float | None = None
    schedule_go: threading.Event = field(default_factory=threading.Event)
    devices_now: list[dict] = field(default_factory=list)
    applied: list[dict] = field(default_factory=list)
    stop_monitor: threading.Event = field(default_factory=threading.Event)
    hogs: dict = field(default_factory=dict)  # device -> the program taking its memory (mem_hog)

    # -- files ---------------------------------------------------------------------------------
    @property
    def run_dir(self) -> Path:
        return self.names.run_dir

    @property
    def state_path(self) -> Path:
        return self.run_dir / "state.json"

    def env(self) -> dict[str, str]:
        """COMMAND's environment: the caller's, plus Hydra's hosts/launcher and MPICH over TCP."""
        env = dict(os.environ)
        for k in ("HYDRA_BOOTSTRAP", "HYDRA_BOOTSTRAP_EXEC", "HYDRA_HOST_FILE", "HYDRA_CONFIG_FILE"):
            env.pop(k, None)
        env.update(MPICH_TCP_ENV)
        # Hydra's proxies execvp the program after mpiexec's options (`hepti`, `python`) by
        # PATH. The mpiexec is taken from hepti's venv even when the venv is not on PATH
        # (`.venv/bin/hepti emulate ...`), so its programs would fail with a bare "execvp error
        # on file hepti"; the venv's bin goes first, as activating it would do.
        venv_bin = os.path.dirname(sys.executable)
        if venv_bin not in env.get("PATH", "").split(os.pathsep):
            env["PATH"] = os.pathsep.join(p for p in (venv_bin, env.get("PATH")) if p)
        env.update({"HYDRA_HOST_FILE": str(self.run_dir / "hostfile"), "HYDRA_LAUNCHER": "ssh",
                    "HYDRA_LAUNCHER_EXEC": str(self.run_dir / "launch.sh"),
                    "HYDRA_LAUNCHER_AUTOFORK": "0", "HYDRA_IFACE": INNER_IFACE,
                    STATE_ENV: str(self.state_path),
                    # the host's own network, where a service under COMMAND (`hepti serve`) opens
                    # its port, so that 127.0.0.1:PORT on the host reaches it
                    HOST_NETNS_ENV: f"/proc/{os.getpid()}/ns/net"})
        return env

    def files(self) -> dict[str, str]:
        n = self.names
        hostfile = "".join(f"{n.address(i)}:1\n" for i in range(len(self.spec.devices)))
        owner = {"pid": n.pid, "starttime": proc_starttime(n.pid), "spec": self.spec.name,
                 "n_devices": len(self.spec.devices), "finished": False}
        return {"hostfile": hostfile, "launch.sh": _launch_script(n, self.spec, self.cg),
                "head.sh": _head_script(n, self.cg), "owner.json": json.dumps(owner)}

    def write_files(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=False)
        for name, text in self.files().items():
            p = self.run_dir / name
            p.write_text(text)
            if name.endswith(".sh"):
                p.chmod(0o755)
        self.devices_now = [{**d.to_dict(), "address": self.names.address(i),
                             "netns": self.names.netns(i), "loss": 0.0, "mem_hog_bytes": 0}
                            for i, d in enumerate(self.spec.devices)]
        self.save_state()

    def save_state(self) -> None:
        pending = [e.to_dict() for e in self.spec.schedule[len(self.applied):]]
        write_state(self.state_path, {
            "spec": self.spec.name, "launcher_pid": self.names.pid, "started_at": self.started_at or None,
            "updated_at": time.time(), "devices": self.devices_now, "applied": self.applied,
            "pending": pending})

    def mark_finished(self) -> None:
        p = self.run_dir / "owner.json"
        owner = json.loads(p.read_text())
        owner["finished"] = True
        p.write_text(json.dumps(owner))

    # -- setup / schedule -----------------------------------------------------------------------
    def setup_actions(self) -> list[actions.Action]:
        return self.cg.create_actions(self.names, self.spec) + net.setup_actions(self.names, self.spec)

    def event_actions(self, ev, memory: bool = True) -> list[actions.Action]:
        """The writes and commands of one event; `memory`: with its cap change (`mem`), which
        `apply_event` runs on its own (`_set_mem`). A `mem_hog` is a process, not an action."""
        acts: list[actions.Action] = []
        if ev.link_mbit is not None:
            acts += net.shape_actions(self.names, ev.device, ev.link_mbit, change=True)
        if ev.cpu is not None:
            acts += self.cg.cpu_actions(self.names, ev.device, ev.cpu)
        if ev.loss is not None:
            acts += net.loss_actions(self.names, ev.device, ev.loss)
        if memory and ev.mem_bytes is not None:
            acts += self.cg.mem_change_actions(self.names, ev.device, ev.mem_bytes)
        if ev.hang is not None:
            acts += self.cg.freeze_actions(self.names, ev.device, ev.hang)
        return acts

    def _set_mem(self, ev, dev: dict) -> tuple[str, str | None]:
        """A `mem` event: the device's new cap. (what changed, why it failed or None)."""
        old, new = dev.get("mem_bytes"), ev.mem_bytes
        was = "none" if old is None else format_mem(old)
        try:
            actions.run_all(self.cg.mem_change_actions(self.names, ev.device, new))
        except EmulateError as e:
            actions.run_tolerant(self.cg.mem_restore_actions(self.names, ev.device, old))
            used = self.cg.mem_used(self.names, ev.device)
            uses = "?" if used is None else f"{used / 2**20:.0f} MiB"
            if getattr(e, "errno", None) == errno.EBUSY:
                why = (f"cap not lowered to {format_mem(new)}: the device uses {uses} that the kernel "
                       "cannot reclaim (no swap), and cgroup v1 refuses a cap below that (EBUSY) "
                       f"instead of OOM-killing; it stays {was}. Give a cap above what the "
                       "device uses, or take memory from under its ranks with mem_hog")
            else:
                why = f"cap not changed, it stays {was}: {e}"
            return f"mem {was} -> {format_mem(new)} refused", why
        dev["mem_bytes"], dev["mem"] = new, format_mem(new)
        return f"mem {was} -> {format_mem(new)}", None

    def hog_size(self, ev) -> tuple[int | None, str]:
        """(bytes, how they were worked out) of the program a `mem_hog` event starts: its size,
        or for `{"leave": SIZE}` all the device's free memory now (cap - used + page cache, as its
        ranks read it: the kernel reclaims the cache before it OOM-kills) but SIZE; None (and
        why) when that is below MIN_HOG or the device's memory cannot be read."""
        if ev.hog_leave is None:
            return ev.hog_bytes, ""
        room = self.cg.mem_room(self.names, ev.device)
        if room is None:
            return None, "the device's cap and use could not be read"
        cap, used, cache = room
        free = cap - used + cache
        take = free - ev.hog_leave
        how = (f"the device had {free / 2**20:.0f} MiB free (cap {cap / 2**20:.0f}, used "
               f"{used / 2**20:.0f} of which page cache {cache / 2**20:.0f}), leave "
               f"{format_mem(ev.hog_leave)}")
        if take < MIN_HOG:
            return None, how + f": less than {format_mem(MIN_HOG)} to take"
        return take, how

    def _set_hog(self, ev, dev: dict) -> tuple[str, str | None]:
        """A `mem_hog` event: the program taking the device's memory is replaced by one that
        takes `hog_bytes`, or all the device has free but `hog_leave` (`hog_size`, worked out
        once the one before is gone), or none for 0. (what changed, why it failed or None)."""
        i = ev.device
        before = self.hogs.pop(i, None)
        if before is not None:
            hog.stop(before)
        had, dev["mem_hog_bytes"] = dev.get("mem_hog_bytes", 0), 0
        if not ev.hog_bytes and ev.hog_leave is None:
            return f"another program lets its {had / 2**20:.0f} MiB go", None
        want, sized = self.hog_size(ev)
        if want is None:
            return (f"another program would leave {format_mem(ev.hog_leave)} free",
                    f"it takes nothing: {sized}")
        sized = f" ({sized})" if sized else ""
        kills0 = self.cg.oom_kills(self.names, i)
        proc = hog.start(self.cg.leaf_dirs(self.names, i), want)
        held = hog.wait_held(proc)
        kills = self.cg.oom_kills(self.names, i) - kills0
        used = self.cg.mem_used(self.names, i)
        cap = dev.get("mem_bytes")
        room = f"; the OOM killer killed {kills} process(es) of the device to make room" \
            if kills else ""
        if held is None:
            rc = proc.poll()
            hog.stop(proc)
            how = "the OOM killer took it" if rc == -signal.SIGKILL else \
                f"it ended with status {rc}" if rc is not None else \
                f"it did not finish within {hog.HELD_WITHIN_S:g} s"
            return (f"another program asked for {format_mem(want)}{sized}" + room,
                    f"it does not hold it: {how}")
        self.hogs[i] = proc
        dev["mem_hog_bytes"] = held
        use = "" if used is None or cap is None else \
            f" (the device now uses {used / 2**20:.0f} of {cap / 2**20:.0f} MiB)"
        return f"another program takes {held / 2**20:.0f} MiB{sized}{use}{room}", None

    def stop_hogs(self) -> None:
        for proc in self.hogs.values():
            hog.stop(proc)
        self.hogs.clear()

    def apply_event(self, ev) -> None:
        """Change one device now (tc, cgroup, another program's memory), record it in the
        state file, say so on stderr."""
        failures = actions.run_tolerant(self.event_actions(ev, memory=False))
        dev = self.devices_now[ev.device]
        changes = []
        refused = []
        for field_set, setter in ((ev.mem_bytes is not None, self._set_mem),
                                  (ev.has_hog, self._set_hog)):
            if field_set:
                what, why = setter(ev, dev)
                changes.append(what)
                if why:
                    refused.append(why)
        if ev.link_mbit is not None:
            changes.append(f"link {dev['link_mbit']:g} -> {ev.link_mbit:g} Mbit/s")
            dev["link_mbit"] = ev.link_mbit
        if ev.cpu is not None:
            changes.append(f"cpu {dev['cpu']:g} -> {ev.cpu:g} core")
            dev["cpu"] = ev.cpu
        if ev.loss is not None:
            changes.append(f"loss {dev.get('loss', 0):g} -> {ev.loss:g}%"
                           + (" (silent)" if ev.loss >= 100 else " (restored)"))
            dev["loss"] = ev.loss
        if ev.hang is not None:
            changes.append("hangs (frozen)" if ev.hang else "runs again (thawed)")
            dev["hang"] = ev.hang
        record = {**ev.to_dict(), "applied_at": time.time()}
        if ev.has_hog:  # what the program took (a `leave` one is sized only now)
            record["mem_hog_bytes"] = dev["mem_hog_bytes"]
        if refused:
            record["failed"] = "; ".join(refused)
        self.applied.append(record)
        self.save_state()
        log(f"t={ev.t:g} s: device {ev.device} ({dev['name']}) " + ", ".join(changes))
        for f in failures + refused:
            log(f"warning: {f}")

    def monitor(self) -> None:
        """Apply schedule events at their times until stopped (times from COMMAND's start, or
        with schedule_on_usr1 from the SIGUSR1 that starts the schedule's clock)."""
        if self.schedule_on_usr1:
            while not self.schedule_go.wait(1.0):
                if self.stop_monitor.is_set():
                    return
            log("schedule started (SIGUSR1)")
        t0 = self.schedule_t0 if self.schedule_t0 is not None else self.started_at
        for ev in self.spec.schedule:
            while True:
                wait = t0 + ev.t - time.time()
                if wait <= 0:
                    break
                if self.stop_monitor.wait(min(wait, 1.0)):
                    return
            if self.stop_monitor.is_set():
                return
            self.apply_event(ev)

    # -- signals ---------------------------------------------------------------------------------
    def on_usr1(self, signum, frame) -> None:
        if self.schedule_t0 is None:
            self.schedule_t0 = time.time()
            self.schedule_go.set()

    def on_signal(self, signum, frame) -> None:
        if self.phase == "setup":
            raise _Interrupted(signum)
        if self.phase == "teardown":
            log(f"got {signal.Signals(signum).name} while tearing down; finishing the teardown first")
            return
        if self.stop_signal is not None:
            self.force = True
        else:
            self.stop_signal = signum

    # -- COMMAND -----------------------------------------------------------------------------------
    def run_command(self, command: list[str], timeout: float | None) -> int:
        """Run COMMAND to its end; on a signal or timeout stop it: SIGINT, SIGTERM, then SIGKILL."""
        self.started_at = time.time()
        self.save_state()
        self.phase = "running"  # from here a signal stops COMMAND instead of aborting setup
        if self.cold_cache:
            drop_page_cache()
        fillers = idle.start_fillers(idle.filler_cpus()) if self.idle_fill else []
        try:
            proc = subprocess.Popen([str(self.run_dir / "head.sh"), *command], env=self.env(),
                                    start_new_session=True, preexec_fn=die_with_parent)
        except BaseException:
            idle.stop_fillers(fillers)
            raise
        mon = threading.Thread(target=self.monitor, name="hepti-emulate-schedule", daemon=True)
        mon.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        stage, stage_t = 0, 0.0
        try:
            while True:
                try:
                    rc = proc.wait(timeout=0.1)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self.stop_signal is None and deadline is not None and time.monotonic() > deadline:
                    self.timed_out = True
                    self.stop_signal = signal.SIGTERM
                    log(f"COMMAND ran longer than {timeout:g} s; stopping it")
                if self.stop_signal is None:
                    continue
                now = time.monotonic()
                if stage == 0:
                    if not self.timed_out:
                        log(f"got {signal.Signals(self.stop_signal).name}; stopping COMMAND "
                            "(again to skip the grace period)")
                    self._signal_group(proc, signal.SIGINT)
                    stage, stage_t = 1, now
                elif stage == 1 and (self.force or now - stage_t > GRACE_S[0]):
                    self._signal_group(proc, signal.SIGTERM)
                    stage, stage_t = 2, now
                elif stage == 2 and (self.force or now - stage_t > GRACE_S[1]):
                    self._signal_group(proc, signal.SIGKILL)
                    kill_procs(self.all_cgroup_dirs(), wait_s=1.0)
                    stage = 3
        finally:
            self.phase = "teardown"
            self.stop_monitor.set()
            if proc.poll() is None:
                self._signal_group(proc, signal.SIGKILL)
                proc.wait()
            idle.stop_fillers(fillers)
            mon.join(timeout=5)
            self.stop_hogs()
        if self.timed_out:
            return 124
        if self.stop_signal is not None:
            return 128 + int(self.stop_signal)
        return 128 - rc if rc < 0 else rc

    @staticmethod
    def _signal_group(proc: subprocess.Popen, sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    def all_cgroup_dirs(self) -> list[str]:
        return self.cg.group_dirs(self.names)

    # -- after COMMAND -------------------------------------------------------------------------------
    def report(self) -> list[dict]:
        """Per-device OOM kills and peak memory; OOM kills are explained on stderr."""
        out = []
        peaks = []
        for i, dev in enumerate(self.spec.devices):
            kills = self.cg.oom_kills(self.names, i)
            peak = self.cg.peak_mem(self.names, i)
            now = self.devices_now[i] if i < len(self.devices_now) else {}
            out.append({"device": i, "name": dev.name, "oom_kills": kills, "peak_mem_bytes": peak,
                        "mem_bytes": dev.mem_bytes,
                        # as the schedule left them (`mem`, `mem_hog`)
                        "mem_bytes_end": now.get("mem_bytes", dev.mem_bytes),
                        "mem_hog_bytes_end": now.get("mem_hog_bytes", 0)})
            if dev.mem_bytes is not None and peak is not None:
                peaks.append(f"{dev.name} {peak / 2**20:.0f}/{dev.mem_bytes / 2**20:.0f}")
            if kills and dev.mem_bytes is None:
                log(f"rank {i} (device {dev.name}, no memory cap) was killed by the out-of-memory "
                    "killer: the machine itself ran out of memory")
            elif kills and any(e.device == i and e.takes_memory
                               for e in self.spec.schedule[:len(self.applied)]):
                log(f"{kills} process(es) of device {dev.name} killed by the out-of-memory killer "
                    "after the schedule squeezed it (cap "
                    f"{format_mem(now.get('mem_bytes') or dev.mem_bytes)}, another program holding "
                    f"{now.get('mem_hog_bytes', 0) / 2**20:.0f} MiB at the end): what ran there "
                    "did not give memory back in time")
            elif kills:
                log(f"rank {i} (device {dev.name}) was killed by the out-of-memory killer: its "
                    f"{format_mem(dev.mem_bytes)} cap is too small for what it ran"
                    + (f" (peak use {peak / 2**20:.0f} MiB)" if peak else "")
                    + f". Give {dev.name} more memory in {self.spec.source}, or run a plan that needs "
                    "less (`tensor` slices the weights, `stream` keeps only a window of layers)")
        if peaks:
            log("peak memory (MiB used/cap): " + ", ".join(peaks))
        return out

    def teardown(self) -> list[str]:
        """Remove everything this run made; return problems (empty when all went)."""
        problems = []
        dirs = self.all_cgroup_dirs()
        ns_pids = [p for ns in self.names.all_netns() for p in net.netns_pids(ns)]
        kill_procs(dirs, extra=ns_pids)
        problems += actions.run_tolerant(net.teardown_actions(self.names))
        for d in dirs:
            try:
                remove_tree(d)
            except EmulateError as e:
                problems.append(str(e))
        shutil.rmtree(self.run_dir, ignore_errors=True)
        left = find_runs().get(self.names.pid)
        if left is not None and not left.empty():
            problems.append(f"still present after teardown: {left.describe()}")
        return problems


def _dry_run(run: _Run, command: list[str]) -> None:
    """Print the whole run as shell: files, setup, COMMAND with its environment, schedule, teardown."""
    spec, names = run.spec, run.names
    out = [f"# hepti emulate --dry-run: {spec.name}, {len(spec.devices)} devices, "
           f"{spec.total_cpu:g} of {os.cpu_count()} cores, cgroup v{run.cg.version}",
           f"mkdir -p {names.run_dir}   # hostfile, launch.sh, head.sh, owner.json, state.json"]
    for name, text in run.files().items():
        if name != "owner.json":
            out.append(f"# --- {names.run_dir}/{name} ---")
            out += ["#   " + line for line in text.rstrip("\n").splitlines()]
    out += [actions.render(a) for a in run.setup_actions()]
    if run.cold_cache:
        out.append(f"sync; echo 1 > {DROP_CACHES}   # every device starts with a cold page cache")
    if run.idle_fill:
        out.append(idle.describe(idle.filler_cpus()))
    out.append("# COMMAND, in the head namespace and cgroup:")
    env = {k: v for k, v in run.env().items() if os.environ.get(k) != v}
    out.append(shlex.join(["env", *(f"{k}={v}" for k, v in sorted(env.items())),
                           str(names.run_dir / "head.sh"), *command]))
    for ev in spec.schedule:
        out.append(f"# at t={ev.t:g} s:")
        out += [actions.render(a) for a in run.event_actions(ev)]
        if ev.has_hog:
            leaves = " ".join(d + "/cgroup.procs" for d in run.cg.leaf_dirs(names, ev.device))
            size = format_mem(ev.hog_bytes) if ev.hog_leave is None else \
                f"all the device then has free but {format_mem(ev.hog_leave)}"
            out.append(f"# another program on {spec.devices[ev.device].name}: the previous one "
                       "(if any) is killed" + (f"; a new one joins {leaves} and takes "
                                               f"{size} (hepti.emulate.hog)"
                                               if ev.hog_bytes or ev.hog_leave is not None
                                               else ""))
    out.append("# teardown: kill every process in the run's cgroups, then")
    out += [actions.render(a) for a in net.teardown_actions(names)]
    out += [actions.render(a) for a in run.cg.remove_actions(names)]
    out.append(f"rm -r {names.run_dir}")
    print("\n".join(out), flush=True)


def run_emulated(spec_path, command: list[str], *, keep: bool = False, dry_run: bool = False,
                 timeout: float | None = None, summary_path=None, idle_fill: bool = True,
                 cold_cache: bool = True, schedule_on_usr1: bool = False) -> int:
    """Run COMMAND on the cluster described by the spec at spec_path; return its exit code.

    keep: leave namespaces, cgroups and the run directory for inspection (remove them later with
    `hepti emulate --cleanup`). dry_run: print the commands instead of running them (no root
    needed). timeout: stop COMMAND after this many seconds (exit code 124). summary_path: write a
    JSON summary (exit code, per-device OOM kills and peak memory, schedule events applied).
    idle_fill: keep the CPUs from halting while COMMAND runs (hepti.emulate.idle explains why).
    cold_cache: drop the host's clean page cache before COMMAND (see the module docstring).
    schedule_on_usr1: the schedule's times count from the SIGUSR1 this process receives (a
    benchmark sends it when its measured part begins, after COMMAND's start-up). Exit code 128+N when stopped by signal N (130 for Ctrl-C)."""
    spec = load_spec(spec_path)
    check_cpu_fits(spec, os.cpu_count() or 1)
    command = prepare_command(list(command), len(spec.devices))
    # stretched devices (hepti.emulate.stretch) keep a quota a little above their share as a guard
    cg = dataclasses.replace(Cgroups.detect(), quota_factor=stretch.GUARD if stretch.stretch_wanted() else 1.0)
    if any(ev.hang is not None for ev in spec.schedule) and not cg.can_freeze:
        cg.freeze_actions(RunNames(os.getpid(), len(spec.devices)), 0, True)  # says what is missing
    run = _Run(spec=spec, names=RunNames(os.getpid(), len(spec.devices)), cg=cg,
               idle_fill=idle_fill, cold_cache=cold_cache, schedule_on_usr1=schedule_on_usr1)
    if dry_run:
        _dry_run(run, command)
        return 0
    require_root("hepti emulate")
    require_tools()
    if not _ONE_RUN.acquire(blocking=False):
        raise EmulateError("an emulation is already running in this process; names are per "
                           "process, so run them one after another")
    try:
        return _run(run, command, keep=keep, timeout=timeout, summary_path=summary_path)
    finally:
        _ONE_RUN.release()


def _run(run: _Run, command: list[str], *, keep: bool, timeout: float | None, summary_path) -> int:
    """Set up, run COMMAND, report, tear down (or keep); signals are handled throughout."""
    spec = run.spec
    check_leftovers(run.names.pid)
    files_before = jobfiles.snapshot()

    in_main = threading.current_thread() is threading.main_thread()
    old = {}
    if in_main:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[s] = signal.signal(s, run.on_signal)
        if run.schedule_on_usr1:
            old[signal.SIGUSR1] = signal.signal(signal.SIGUSR1, run.on_usr1)
    rc, t0 = 1, time.monotonic()
    oom: list[dict] = []
    set_up = False
    try:
        run.write_files()
        actions.run_all(run.setup_actions())
        net.probe_mesh(run.names)
        log(f"{spec.name}: {len(spec.devices)} devices up in {time.monotonic() - t0:.1f} s ("
            + ", ".join(f"{d.name} {d.cpu:g} core"
                        + (f" {format_mem(d.mem_bytes)}" if d.mem_bytes else "")
                        + (f" {d.link_mbit:g} Mbit/s" if d.link_mbit else "") for d in spec.devices)
            + ")")
        set_up = True
        rc = run.run_command(command, timeout)
        oom = run.report()
        return rc
    except _Interrupted as e:
        log(f"got {e} during setup; tearing down")
        rc = 128 + e.signum
        return rc
    finally:
        run.phase = "teardown"
        if summary_path is not None:
            Path(summary_path).write_text(json.dumps({
                "spec": spec.name, "returncode": rc, "signal": None if run.stop_signal is None
                else signal.Signals(run.stop_signal).name, "timed_out": run.timed_out,
                "duration_s": time.monotonic() - t0, "devices": oom, "schedule_applied": run.applied},
                indent=1))
        if keep and set_up:
            run.mark_finished()
            log(f"kept the emulated cluster: namespaces {', '.join(run.names.all_netns())}; look with "
                f"e.g. `tc -n {run.names.netns(0)} -s qdisc`; remove with `hepti emulate --cleanup`")
        else:
            for p in run.teardown():
                log(f"teardown problem: {p}; `hepti emulate --cleanup` retries")
        left = jobfiles.sweep(files_before)  # with --keep too: only files no process holds
        if left:
            log(f"removed {len(left)} file(s) that COMMAND's MPI jobs left: " + "; ".join(left))
        for s, h in old.items():
            signal.signal(s, h)
