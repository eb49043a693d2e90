"""Idle fillers: keep the CPUs busy at the lowest priority while an emulation runs.

A capped device runs its quota, then its group is throttled until the next 10 ms period. When
nothing else wants that CPU, the kernel halts it, and in a virtual machine (this one: KVM,
`haltpoll` with polling off) a halted vCPU gives its physical core back to the host: it comes
back with cold caches and a wake-up delay, every period. A real slow device pays no such toll.
Measured with `hepti profile` (3 devices at 0.5/0.25/0.25 core, MiniLM's shapes): a forward's
compute as the profile reads, per core of share, against an uncapped process run next, was
0.83-0.88 on the 0.25-core devices without fillers and 0.92-0.96 with them (attention alone
0.62-0.84 without, 0.83-0.98 with). A 9 MB matmul loop alone under a 0.25-core cap ran at 0.73
of its uncapped speed per CPU second without fillers and 0.92 with them.

So the launcher runs one busy loop per CPU under SCHED_IDLE: it gets only CPU time nobody else
wants (a waking task of any other policy preempts it at once), and the CPUs never halt. The
devices' CPU use stayed within about 1% of their quotas with it. It shows as load (one per
CPU) while the emulation runs. `hepti emulate --no-idle-fill` turns it off.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
LOOP = "while True:\n    pass\n"


def filler_cpus() -> list[int]:
    """The CPUs the devices may run on (the launcher's affinity, which its children inherit)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def _become_filler(cpu: int) -> None:
    """In the child before exec: pin to one CPU, lowest policy, die with the launcher."""
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def start_fillers(cpus: list[int]) -> list[subprocess.Popen]:
    """One SCHED_IDLE busy loop pinned to each CPU; they die with the launcher if it is killed."""
    procs = []
    try:
        for cpu in cpus:
            procs.append(subprocess.Popen(
                [sys.executable, "-S", "-c", LOOP], stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=lambda cpu=cpu: _become_filler(cpu)))
    except BaseException:
        stop_fillers(procs)
        raise
    return procs


def stop_fillers(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def describe(cpus: list[int]) -> str:
    """The fillers as a --dry-run comment."""
    return (f"# while COMMAND runs: one SCHED_IDLE busy loop pinned to each of CPUs "
            f"{', '.join(map(str, cpus))} (keeps them from halting; --no-idle-fill turns it off)")
