"""COMMAND as `hepti emulate` runs it: find MPICH's mpiexec and refuse flags that would escape.

The user's `mpiexec -n N ...` needs no extra flags: the launcher hands Hydra its hosts and
launcher through the environment. Flags that choose hosts, launcher or interface would override
that and run ranks outside their devices, so they are refused with a message naming the flag.
"""
from __future__ import annotations

import ctypes
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from hepti.emulate.spec import EmulateError

PREFIX = "[hepti emulate]"
MPIEXEC_NAMES = ("mpiexec", "mpirun", "mpiexec.hydra")
# mpiexec flags that would undo the emulation (hosts, launcher, interface)
FORBIDDEN_FLAGS = ("-f", "-hostfile", "-machinefile", "-hosts", "-host", "-launcher",
                   "-launcher-exec", "-bootstrap", "-bootstrap-exec", "-iface", "-ppn", "-rmk",
                   "-configfile")
VALUE_FLAGS = FORBIDDEN_FLAGS + ("-n", "-np", "-genvlist", "-envlist", "-wdir", "-bind-to",
                                 "-map-by", "-gpus-per-proc", "-prepend-pattern")
PAIR_FLAGS = ("-genv", "-env")


def log(msg: str) -> None:
    """One line on stderr, marked as the launcher's (COMMAND's own output is not)."""
    print(f"{PREFIX} {msg}", file=sys.stderr, flush=True)


def find_mpiexec() -> str:
    """MPICH's mpiexec: next to the running Python (the hepti venv) first, then on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise EmulateError(f"no mpiexec next to {sys.executable} or on PATH; install MPICH's with "
                       "`pip install mpich` into hepti's environment (bin/setup does)")


def _is_hydra(mpiexec: str) -> bool:
    try:
        p = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "HYDRA" in p.stdout + p.stderr


def prepare_command(command: list[str], n_devices: int) -> list[str]:
    """Check COMMAND and resolve a bare mpiexec; refuse what would escape the emulation."""
    if not command:
        raise EmulateError("no COMMAND given; write it after `--`, e.g. "
                           "`hepti emulate --cluster SPEC.json -- mpiexec -n 4 hepti profile`")
    command = list(command)
    serve = "serve" in command[:4] and any(Path(c).name == "hepti" for c in command[:3])
    if serve:  # hepti serve runs `mpiexec -n N` itself, with the hosts the environment names
        return command
    if not any("mpiexec" in c or "mpirun" in c for c in command):
        log("note: COMMAND does not call mpiexec; processes not started by mpiexec run in the head "
            "namespace without any device's caps")
        return command
    if Path(command[0]).name not in MPIEXEC_NAMES:
        return command  # a script or shell that calls mpiexec itself; the environment does the rest
    if "/" not in command[0]:
        command[0] = find_mpiexec()
    if not _is_hydra(command[0]):
        raise EmulateError(f"{command[0]} is not MPICH's mpiexec (Hydra); emulation needs MPICH "
                           "(Open MPI cannot span network namespaces). Use the one `pip install "
                           "mpich` puts next to hepti's Python")
    args, k = command[1:], 0
    while k < len(args) and args[k].startswith("-"):
        flag = args[k]
        if flag in FORBIDDEN_FLAGS:
            raise EmulateError(f"COMMAND passes {flag} to mpiexec; hepti emulate chooses the hosts, "
                               f"launcher and interface itself (one host per device). Drop {flag}")
        if flag in ("-n", "-np") and k + 1 < len(args):
            try:
                n = int(args[k + 1])
            except ValueError:
                raise EmulateError(f"mpiexec {flag} {args[k + 1]!r}: not a number") from None
            if n > n_devices:
                raise EmulateError(f"mpiexec {flag} {n} asks for more ranks than the spec has devices "
                                   f"({n_devices}); each rank runs on one device")
        k += 3 if flag in PAIR_FLAGS else 2 if flag in VALUE_FLAGS else 1
    return command


PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """In a child before exec (`preexec_fn`): be sent `sig` when the parent dies, so a killed
    launcher or service leaves no job running. (Use with start_new_session=True to take the
    child out of the parent's process group as well.)"""
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
