"""Uniform slowdown of an emulated device: every compute phase takes 1/s of its uncapped time.

Why not the CPU quota alone. A CFS quota of s core lets a process run at full speed until the
quota of the current period is spent. A rank that waited at a collective arrives at its next
phase with the quota unspent, so short phases (and MPI's progress) ran at full speed: measured
with `python -m hepti.bench.slowdown` (results/slowdown.json), 0.1-1 ms phases between waits
ran 2-3x faster than share x speed, while the profile, which times sustained GeMMs over whole
periods, saw the device as uniformly slow. A real slow board has no such bursts.

What this does. The launcher (hepti.emulate.launch) leaves the quota in place as a guard,
above s (`GUARD`), and each rank stretches its own compute: it accounts the CPU time
its process spends computing and sleeps until the wall clock has caught up with a virtual
CPU of speed s doing that work. Accounting is by CPU time rather than by the length of a span,
which makes it hold where a span's wall time does not:
- a phase slowed by the guard quota, or by another process on the machine, has already spent
  part of its 1/s in wall time; only the rest is slept (wall = CPU / s, not wall x 1/s);
- every thread of the process counts (process CPU time): `stream`'s prefetch thread, Numba's
  worker threads, the kernel's read path. Work that a background thread does while the main
  thread waits at a collective is counted too, and the wait's wall time pays for it, as a slow
  board overlaps a prefetch with a wait;
- the main thread's own CPU while it waits (MPI polling, Python of the verbs) is not work.
The state is a backlog B (seconds the virtual CPU is behind the wall clock): after an interval
of wall time dt in which the process did CPU work c, B += c / s - dt, never making credit out
of idle time (a board cannot bank the time it waited). B is paid by sleeping (timer slack
lowered to 1 ns, the last ~30 us spun): at the end of each compute span when it exceeds
`PAY_MIN_S`, and in full before every wait (a collective must not send results the slow board
would not have yet) and at the end of a batch or of a profiler call. Oversleeping is credited,
up to `CREDIT_MAX_S`.

Where it runs: `hepti.parallel.trace.Tracer` spans (cat "compute" and "batch" are work, every
other cat is a wait) and the profiler's timed calls (hepti.parallel.profile_compute and
profile_cnn) through `wrap`. The kernels and the planner do not know about it. It is on in a process started by
`hepti emulate` for a device (HEPTI_EMULATE_DEVICE and HEPTI_EMULATE_STATE set) unless
HEPTI_EMULATE_STRETCH=0, which makes the launcher set the quota at s exactly, as before (see
`stretch_wanted`). The share is re-read from the launcher's state file (hepti.emulate.state) at
most every `POLL_S`, so a schedule that changes a device's CPU changes its stretch too. Outside `hepti emulate`,
`ON` is False and every hook is one test of it.
"""
from __future__ import annotations

import ctypes
import os
import threading
import time

from hepti.emulate.state import current_device, read_state

ENV = "HEPTI_EMULATE_STRETCH"  # "0": the quota alone; else stretch (quota = GUARD x share)
DEVICE_ENV, STATE_ENV = "HEPTI_EMULATE_DEVICE", "HEPTI_EMULATE_STATE"  # hepti.emulate.state's
# The launcher's CPU quota is GUARD x share when the stretch is on. It was 1.25: then a rank
# waiting at an exchange spent the quota polling (50 us sleeps between tests) and on the
# stretch's last-30-us spins, and the next short phase was throttled on top of its stretch:
# at 0.15 core, 0.16 ms of throttling per 0.1 ms phase between MPI exchanges (the phase
# 1.11-1.15x its 1/share time), none with 2.0 (1.02-1.07x; throttled_s in
# `python -m hepti.bench.slowdown --shares 0.15 --modes stretch`, 2026-11-26). The stretch
# sets the speed; the guard only bounds what escapes its accounting.
GUARD = 2.0
PAY_MIN_S = 5e-5  # a compute span pays its backlog at its end when it is at least this
SPIN_S = 3e-5  # the last part of a payment is spun, not slept (sleep overshoots ~10-25 us)
CREDIT_MAX_S = 1e-3  # oversleeping is credited up to this
POLL_S = 0.1  # re-read the state file (a schedule may change the share) at most this often
PR_SET_TIMERSLACK = 29
WORK_CATS = ("compute", "batch")

ON = False  # the only thing a hook tests when the stretch is off

_share = 1.0
_owner = None  # the thread that accounts (the one that enabled it: the main thread)
_state_path = None
_state_mtime = None
_device = None
_next_poll = 0.0
_backlog = 0.0
_p = _m = _w = 0.0  # process CPU, owner-thread CPU and wall clock at the last checkpoint
_work = 0  # open work spans
_waits = 0  # open wait spans
_stats = {"paid_s": 0.0, "payments": 0, "work_cpu_s": 0.0}


def stretch_wanted(env=None) -> bool:
    """Whether devices run stretched: yes unless HEPTI_EMULATE_STRETCH=0 (the quota alone).
    On by default since bin/bench-hetero.sh and bin/bench-offload.sh were remade with it
    (results/hetero.json: 35 of 41 strategies within 15% of their own prediction, where the
    quota alone put `proportional` 53% under it; docs/results/hetero.md). Phases of 1 ms and
    more ran at 1/share within 5% on a quiet host (results/slowdown-stretch.json); 0.1 ms phases within
    6% of the matched reference once the guard was 2x (tests/test_emulate_stretch.py says why
    that reference)."""
    return (env if env is not None else os.environ).get(ENV, "1").strip() != "0"


def enable(share: float, state_path: str | None = None, device: int | None = None) -> None:
    """Stretch this process's compute to a device of `share` cores (from this thread)."""
    global ON, _share, _owner, _state_path, _device, _state_mtime, _next_poll, _backlog
    global _p, _m, _w, _work, _waits
    if not share > 0:
        raise ValueError(f"stretch share must be positive, got {share!r}")
    _share, _owner = float(share), threading.get_ident()
    _state_path, _device = state_path, device
    _state_mtime = _mtime(state_path) if state_path else None
    _backlog, _work, _waits = 0.0, 0, 0
    _p, _m, _w = time.process_time(), time.thread_time(), time.perf_counter()
    _next_poll = _w + POLL_S
    try:  # precise sleeps for this thread (the default slack, 50 us, overshoots short payments)
        ctypes.CDLL(None).prctl(PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    ON = True


def disable() -> None:
    global ON
    ON = False


def share() -> float | None:
    return _share if ON else None


def describe() -> dict:
    """What the stretch is doing in this process (for reports and benchmarks)."""
    return {"on": ON, "share": _share if ON else None, "guard": GUARD, **_stats}


def _mtime(path):
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return None


def _poll(now: float) -> None:
    """Take a new share from the state file if the launcher rewrote it (a schedule event)."""
    global _next_poll, _state_mtime, _share
    _next_poll = now + POLL_S
    mt = _mtime(_state_path)
    if mt is None or mt == _state_mtime:
        return
    _state_mtime = mt
    state = read_state(_state_path)
    try:
        cpu = float(state["devices"][_device]["cpu"])
    except (TypeError, KeyError, IndexError, ValueError):
        return
    if cpu > 0:
        _share = cpu


def _checkpoint(pay_interval: bool = False) -> float:
    """Account the interval since the last checkpoint; returns the wall clock now."""
    global _backlog, _p, _m, _w
    p, m, w = time.process_time(), time.thread_time(), time.perf_counter()
    c = p - _p
    if pay_interval or _waits or not _work:  # the owner thread was waiting, not working
        c -= m - _m
    else:
        _stats["work_cpu_s"] += m - _m
    before = _backlog
    b = before + max(c, 0.0) / _share - (w - _w)
    if pay_interval:  # our own oversleep is credit
        _backlog = max(b, -CREDIT_MAX_S)
    else:  # idle time is not
        _backlog = max(b, min(before, 0.0))
    _p, _m, _w = p, m, w
    if w > _next_poll and _state_path:
        _poll(w)
    return w


def _pay(now: float, at_least: float) -> float:
    """Sleep (then spin) the backlog off if it is at least `at_least`; seconds spent."""
    b = _backlog
    if b < at_least or b <= 0.0:
        return 0.0
    end = now + b
    if b > SPIN_S:
        time.sleep(b - SPIN_S)
    while time.perf_counter() < end:
        pass
    t = _checkpoint(pay_interval=True)
    _stats["paid_s"] += t - now
    _stats["payments"] += 1
    return t - now


def span_enter(cat: str) -> float:
    """A Tracer span opens: account, and before a wait pay the whole backlog. Returns the
    seconds paid (the caller counts them as compute)."""
    global _work, _waits
    if threading.get_ident() != _owner:
        return 0.0
    now = _checkpoint()
    paid = 0.0
    if cat in WORK_CATS:
        _work += 1
    else:
        paid = _pay(now, 0.0)
        _waits += 1
    return paid


def span_exit(cat: str) -> None:
    """A Tracer span closes (before it reads the clock): account, and pay at the end of work."""
    global _work, _waits
    if threading.get_ident() != _owner:
        return
    now = _checkpoint()
    if cat in WORK_CATS:
        _work = max(_work - 1, 0)
        _pay(now, PAY_MIN_S if cat == "compute" else 0.0)
    else:
        _waits = max(_waits - 1, 0)


def settle() -> None:
    """Before a measurement (the profiler's timing rounds, the speed probe): account the time
    since the last checkpoint, pay any backlog, and forfeit any credit, so that the measurement
    times its own work at the share. A credit is an earlier sleep's overshoot; spent by a
    measurement shorter than it, it made that measurement read unstretched: 0.40x (at 0.4
    core) for the serving speed probe's 0.45 ms calls (hepti.parallel.profile_compute's
    SpeedProbe)."""
    global _backlog
    if threading.get_ident() != _owner:
        return
    _pay(_checkpoint(), 0.0)
    _backlog = max(_backlog, 0.0)


def wrap(fn):
    """fn as one unit of work, its backlog paid in full before it returns (the profiler's
    timed calls). Use only when ON."""
    def stretched(*a, **kw):
        span_enter("batch")
        try:
            return fn(*a, **kw)
        finally:
            span_exit("batch")
    return stretched


def _from_environment() -> None:
    """On at import in a rank that `hepti emulate` started for a device, unless turned off."""
    # first the environment alone: every run imports this module (hepti.parallel.trace), and
    # outside `hepti emulate` it must not import the emulator's state module
    index, path = os.environ.get(DEVICE_ENV), os.environ.get(STATE_ENV)
    if not index or not path or not index.isdigit() or not stretch_wanted():
        return
    device = current_device(read_state(path))
    if device is None or not device.get("cpu"):
        return
    enable(float(device["cpu"]), state_path=path, device=int(index))


_from_environment()
