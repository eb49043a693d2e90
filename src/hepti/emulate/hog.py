"""Another program on an emulated device that takes memory: a schedule's `mem_hog`.

On a real edge device the memory that hepti's ranks planned with is not theirs alone: another
service grows, someone opens a browser. The launcher emulates that with a small process in
the device's cgroups (memory and CPU) that takes the given bytes, touches every page so they
are really charged (an untouched mapping costs nothing), says "held" on stdout and sleeps. It
is the realistic squeeze of a device in use, where lowering the cap is not: cgroup v1 refuses
a cap below what the device holds (EBUSY) instead of OOM-killing (hepti.emulate.spec).

If it takes more than the device has free, the kernel's OOM killer picks a victim inside the
device, the process with the most memory (usually a rank, which then is a lost device to
`hepti serve`), exactly as it would on the board. Its own size counts: the program is a bare
`python -S` (about 8 MiB before it takes anything), and takes the rest up to the size asked.

It is not tied to the launcher with PR_SET_PDEATHSIG: that signal follows the *thread* that
started the child, and the schedule's thread ends after its last event, which would kill the
program while the scenario still runs. It watches its parent instead, and exits once it is
orphaned; teardown kills every process of the device's cgroups anyway.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

# The program, run as `python -S -c HOG_CODE BYTES`: as small as Python gets, so the device's
# memory goes to what the scenario asks for and not to the program's own imports.
HOG_CODE = r"""
import mmap, os, sys, time
want, parent = int(sys.argv[1]), os.getppid()
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
take = max(0, want - rss() - (1 << 20))  # the 1 MiB chunk below is its own too
chunk = b"\x01" * (1 << 20)
held = mmap.mmap(-1, take) if take else None
for off in range(0, take, len(chunk)):
    held.write(chunk[:min(len(chunk), take - off)])
sys.stdout.write(f"held {rss()}\n")
sys.stdout.flush()
while os.getppid() == parent:
    time.sleep(1.0)
"""
HELD_WITHIN_S = 30.0  # touching 1 GiB takes ~0.3 s of CPU; a 0.1-core device needs ~3 s


def start(cgroup_dirs: list[str], nbytes: int) -> subprocess.Popen:
    """Start the program in the given cgroup directories (a device's leaves); it takes
    `nbytes` in all, itself included."""
    def join_device():
        for d in cgroup_dirs:
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
    return subprocess.Popen([sys.executable, "-S", "-c", HOG_CODE, str(int(nbytes))],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            preexec_fn=join_device, start_new_session=True)


def wait_held(proc: subprocess.Popen, timeout: float = HELD_WITHIN_S) -> int | None:
    """The bytes the program holds once it has taken them all; None if it died first (the
    OOM killer took it: its exit status says) or did not finish within `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            break
        line = proc.stdout.readline()
        if not line:  # it ended without saying so
            proc.wait()
            return None
        if line.startswith("held "):
            return int(line.split()[1])
    return None


def stop(proc: subprocess.Popen) -> None:
    """End the program; its memory goes back to the device at once."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
