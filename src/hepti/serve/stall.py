"""A hung rank under `hepti serve`: when to declare it lost, how to end it, and when its device
may come back (DESIGN.md, "Stall vs death").

A dead rank closes its sockets and mpiexec ends; a hung one (a frozen board, a stopped process,
a link that drops every packet) closes nothing, and MPI waits for it forever. Only a deadline
tells them apart. Every rank beats on its watch line from a thread of its own
(hepti.serve.worker's `_Heartbeat`), while it computes and while it waits in a collective, so a
healthy rank that waits for a hung peer keeps beating: the rank that fell silent is the hung
one. The front end (hepti.serve.supervisor) declares a rank lost when both hold:

- it has been silent for LATE_AFTER_S (it is "late": /health already names it), and
- the phase the front end waits for (a batch, a command between batches, or the idle time
  between them) is past its deadline (`phase_deadline`).

The deadline keeps a legitimate slow phase (a first batch, a re-plan's switch that reads
weights) from being taken for a hang even if beats come late in it; the silence keeps a slow
batch whose ranks all beat from being taken for one. A rank whose line closed has ended (a
death, or a stop it was told): never hung.

A lost device is probed in the background (`probe_device`) and re-admitted once it answers
again, with the re-planner's hysteresis (`DeviceBench`), once the job without it has served
SERVE_BEFORE_ADMIT_S.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from hepti.emulate.command import find_mpiexec
from hepti.resources import process_rss
from hepti.serve import protocol
from hepti.serve.defaults import STALL_FLOOR_S
from hepti.serve.replan import COOLDOWN_S, FLAP_HOLD_S, FLAP_WINDOW_S, HORIZON_S, LINK_CHECK_S

# A batch's deadline is this many times its expected time when that is above the floor: the
# plan's prediction is within 15% on a quiet host (results/), but an emulated capped rank ran
# 2x its prediction (DESIGN.md: quota bursts) and this 2-core machine is shared.
STALL_FACTOR = 5.0
# A phase that may be slow for reasons other than a hang gets at least this long: the first
# batch after a launch (kernels loaded from Numba's cache, page cache cold), and the commands
# between batches (a link probe; a switch that reads the next plan's weights, tens of seconds
# on a 0.15-core device). Its ranks beat all the same; this is for beats delayed in it.
SLOW_PHASE_S = 60.0
# After a hung rank is killed, how long mpiexec gets to end the job itself before it is
# stopped (MPICH ends a job whose rank was killed in well under a second here).
END_GRACE_S = 2.0
# A lost device is probed this often (the re-planner's period for checking a slow link):
# a TCP connect or a process start each time, so a device that never comes back costs one
# probe per period, indefinitely, and one log line when it was lost.
PROBE_EVERY_S = LINK_CHECK_S
PROBE_TIMEOUT_S = 2.0  # a probe that has no answer by then counts as silent
# The port a host of a hostfile is probed on: Hydra starts ranks there over ssh, so it is
# open; a refusal counts as an answer too (the host's kernel and its link answered).
PROBE_PORT = 22
# A process started on a probed host (through mpiexec's launcher, ssh on a real cluster) gets
# this many probe timeouts to run and exit: an ssh login and a Python start on a board.
PROBE_START_FACTOR = 5
# Answers in a row before a device is re-admitted: one to notice, one to confirm, as the
# re-planner acts on an alarm only once the next batch confirms it.
CONFIRM_PROBES = 2
MAX_HOLD_S = 3600.0  # a device that keeps flapping is held out at most this long at a time
# Re-admitting a device starts the job with it while the job without it serves on
# (make-before-break, hepti.serve.supervisor `_start_admission`); only where a device that
# would run both has no room for that does it stop the job and relaunch, with no answers for
# a launch's time (8-16 s for MiniLM on this shared 2-core machine). Either way the job that
# serves without it first serves this long, the re-planner's horizon (a change is assumed to
# hold that long): a device confirmed while its job is still starting (on one machine, 10 s
# after the loss) does not cost a second launch's CPU the moment that job says hello.
# $HEPTI_SERVE_BEFORE_ADMIT_S sets it, read once (tests/test_serve_stall.py's emulated
# re-admissions wait 1 s, not for a horizon that holds no check of theirs).
SERVE_BEFORE_ADMIT_S = float(os.environ.get("HEPTI_SERVE_BEFORE_ADMIT_S", HORIZON_S))
# What a rank holds besides the model's weights, where its resident memory cannot be read
# here (a rank on another host): a MiniLM worker of `hepti serve -n 2 --strategy tensor` on
# this machine held 302 MiB resident (Python, numpy, Numba's kernels, MPI, its weights and
# buffers), with a margin. Used only to decide whether a job may load beside the serving one.
RANK_RUNTIME_BYTES = 400 * 2**20
# A launch that takes a re-admitted device back must say hello within this many seconds, or
# that device is lost again (flapping) and the job relaunched without it: the queue waits
# meanwhile, so the service's usual start timeout (900 s) would be far too long here.
ADMIT_START_MIN_S = 60.0
ADMIT_START_FACTOR = 3.0  # ... or this many times the last launch's time to hello, if longer


@dataclass
class Phase:
    """What the front end waits for from the workers: `kind` "batch", "idle" (between
    batches) or a command's op ("probe", "prepare", "switch"); since when (monotonic), and for
    how long before a silent rank in it is declared lost."""
    kind: str
    since: float
    deadline_s: float
    batch: int | None = None


def expected_batch_s(shape: tuple[int, int], predicted_s: float | None = None,
                     plan_shape: tuple[int | None, int | None] = (None, None),
                     per_token_s: float | None = None) -> float | None:
    """A batch's expected seconds: the larger of the plan's prediction scaled to the batch's
    shape and the recent batches' measured seconds per padded token times its tokens (None:
    neither known). `shape` is (inputs, longest), as the batch is padded; `plan_shape` the
    (batch, seq_len) the plan was predicted for; `per_token_s` a recent median of a batch's
    wall over its inputs x longest.

    Scaled by tokens, and again by how much longer the inputs are than the plan's (attention's
    part grows with the square of the length): an overestimate for long inputs, which only
    makes the deadline later, never a healthy batch's end."""
    B, T = shape
    out = []
    B0, T0 = plan_shape
    if predicted_s and predicted_s > 0:
        B0, T0 = B0 or 1, T0 or T
        out.append(predicted_s * (B * T) / (B0 * T0) * max(1.0, T / T0))
    if per_token_s and per_token_s > 0:
        out.append(per_token_s * B * T)
    return max(out) if out else None


def phase_deadline(expected_s: float | None, floor_s: float = STALL_FLOOR_S,
                   slow: bool = False) -> float:
    """How long a phase may last before a rank silent in it is declared lost: STALL_FACTOR x
    its expected seconds, at least `floor_s`, and at least SLOW_PHASE_S for a slow phase (or
    when nothing is expected yet)."""
    deadline = max(floor_s, STALL_FACTOR * expected_s) if expected_s else floor_s
    if slow or expected_s is None:
        deadline = max(deadline, SLOW_PHASE_S)
    return deadline


def hung_ranks(silent_s: dict[int, float], late_after_s: float) -> tuple[list[int], str]:
    """Which ranks to declare lost once a phase is past its deadline, given each rank's seconds
    of silence: every rank silent for late_after_s or more, longest first, with a word on why.

    A healthy rank keeps beating while it waits for a hung one, so the silent are the hung,
    however many. When every rank is silent, nothing tells them apart from a stall on the
    front end's side (its network, its own CPU): the ranks are ended, and relaunched on the
    same hosts, none of them dropped (`[]`, "all")."""
    silent = sorted((r for r, s in silent_s.items() if s >= late_after_s),
                    key=lambda r: (-silent_s[r], r))
    if not silent:
        return [], "none"
    if len(silent) == len(silent_s):
        return [], "all"
    return silent, "some"


def kill_if_ours(pid: int | None, token: str) -> bool:
    """SIGKILL `pid` if it is one of this service's workers on this machine (its environment
    holds the service's secret, which only the ranks mpiexec started for it have). A stopped
    process is killed too. False when no such process is here: a rank on another host, whose
    process only ending the mpiexec job can reach."""
    if not pid:
        return False
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            env = f.read().split(b"\0")
    except (OSError, ValueError):
        return False
    if f"{protocol.TOKEN_ENV}={token}".encode() not in env:
        return False
    try:
        os.kill(int(pid), signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def rank_rss(pid: int | None, token: str) -> float | None:
    """The resident bytes of `pid` if it is one of this service's workers on this machine (its
    environment holds the service's secret, as `kill_if_ours` checks), else None."""
    if not pid:
        return None
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            if f"{protocol.TOKEN_ENV}={token}".encode() not in f.read().split(b"\0"):
                return None
    except (OSError, ValueError):
        return None
    rss = process_rss(int(pid))
    return None if rss is None else float(rss)


def probe_device(host: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Whether a lost device answers again: a new process started on it runs and exits.

    A host of a hostfile (a board, or an emulated device's address): first a TCP connect to
    its PROBE_PORT, accepted or refused within timeout_s (its kernel and its link answer; a
    link that drops every packet leaves it unanswered, an unreachable host fails it, and
    either costs no more). Then a process on it, started as its ranks are (`mpiexec -n 1
    -hosts HOST`), within PROBE_START_FACTOR x timeout_s: a board whose processes no longer run
    answers the connect from its kernel all the same. Under `hepti emulate` a hung device is
    one whose processes are frozen while the machine's shared kernel still answers for it: the
    connect alone re-admitted it 3 s after it was declared lost, frozen still (bench-adapt
    --spec emu-hang3.json), and a launch on it would have hung in turn.

    None, this machine (`hepti serve -n N` without a hostfile: a device is one of its rank
    slots): a new process started here runs and exits within timeout_s x 5. The stopped rank
    itself was killed when it was declared lost, so what can answer again is the slot, not
    that process: on a machine that runs processes, this answers at once, and re-admission
    then waits only for the hysteresis (`DeviceBench`)."""
    if host is None:
        return _runs([sys.executable, "-I", "-S", "-c", "pass"], 5 * timeout_s)
    try:
        with socket.create_connection((host, PROBE_PORT), timeout=timeout_s):
            pass
    except ConnectionRefusedError:
        pass
    except OSError:  # timed out, host or network unreachable, no such name
        return False
    return _runs([find_mpiexec(), "-n", "1", "-hosts", host, sys.executable, "-I", "-S", "-c", "pass"],
                 PROBE_START_FACTOR * timeout_s)


def _runs(argv: list[str], timeout_s: float) -> bool:
    """`argv` ran and exited 0 within timeout_s. On a timeout its whole process group is
    killed (mpiexec and the launcher it started; a frozen process dies once it thaws)."""
    try:
        p = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    except OSError:
        return False
    try:
        return p.wait(timeout_s) == 0
    except subprocess.TimeoutExpired:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
        return False


@dataclass
class Benched:
    """A device declared lost: what it ran, and what its probes said since."""
    host: str  # a hostfile's host, or "localhost" (a slot of this machine)
    ranks: int  # how many ranks it ran: given back when it is re-admitted
    why: str
    lost_at: float
    hold_until: float  # not re-admitted before this (monotonic)
    flaps: int = 0  # how many times it was lost soon after being re-admitted
    probes: int = 0
    answers: int = 0  # probes answered in a row (the last ones)
    last_probe: float | None = None
    last_answer: float | None = None

    def to_dict(self, now: float) -> dict:
        return {"host": self.host, "ranks": self.ranks, "why": self.why,
                "lost_s_ago": round(now - self.lost_at, 1), "probes": self.probes,
                "answered_in_a_row": self.answers, "flaps": self.flaps,
                "held_s": round(max(0.0, self.hold_until - now), 1)}


@dataclass
class DeviceBench:
    """The devices declared lost, probed every PROBE_EVERY_S until they answer again.

    A device is re-admitted once CONFIRM_PROBES probes in a row answer, and not within the
    re-planner's COOLDOWN_S of being lost. Flapping, as the re-planner judges a link: lost,
    back, lost again within FLAP_WINDOW_S of coming back (three changes within the window) is
    a device that flaps, and it is held out FLAP_HOLD_S before its next re-admission, twice
    as long each further time (at most MAX_HOLD_S), so a flapping device costs a relaunch now
    and then rather than one every few seconds. Pure bookkeeping: the caller probes and keeps
    the clock (tests/test_serve_stall.py runs it on a fake one)."""
    devices: dict[str, Benched] = field(default_factory=dict)
    admitted_at: dict[str, tuple[float, int]] = field(default_factory=dict)  # host -> (when, flaps)

    def lose(self, host: str, ranks: int, why: str, now: float) -> Benched:
        """`host` was declared lost (or lost again before being re-admitted: its ranks add)."""
        if host in self.devices:
            d = self.devices[host]
            d.ranks += ranks
            d.answers = 0
            return d
        when, flaps = self.admitted_at.pop(host, (None, 0))
        hold = COOLDOWN_S
        if when is not None and now - when < FLAP_WINDOW_S:
            flaps += 1
            hold = min(MAX_HOLD_S, FLAP_HOLD_S * 2 ** (flaps - 1))
        else:  # it held after coming back: its flapping is over
            flaps = 0
        d = Benched(host, ranks, why, lost_at=now, hold_until=now + hold, flaps=flaps)
        self.devices[host] = d
        return d

    def due(self, now: float) -> list[Benched]:
        """The devices whose next probe is due."""
        return [d for d in self.devices.values()
                if now - (d.last_probe if d.last_probe is not None else d.lost_at) >= PROBE_EVERY_S]

    def record(self, host: str, answered: bool, now: float) -> None:
        d = self.devices.get(host)
        if d is None:
            return
        d.probes += 1
        d.last_probe = now
        d.answers = d.answers + 1 if answered else 0
        if answered:
            d.last_answer = now

    def ready(self, now: float) -> list[Benched]:
        """The devices to re-admit now."""
        return [d for d in self.devices.values()
                if d.answers >= CONFIRM_PROBES and now >= d.hold_until]

    def admit(self, host: str, now: float) -> Benched | None:
        """`host` is back in the job (its flaps remembered for FLAP_WINDOW_S)."""
        d = self.devices.pop(host, None)
        if d is not None:
            self.admitted_at[host] = (now, d.flaps)
        return d

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = time.monotonic() if now is None else now
        return [d.to_dict(now) for d in list(self.devices.values())]
