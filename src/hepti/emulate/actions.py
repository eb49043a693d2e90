"""System changes as data: a command to run or a file to write, printable as shell for --dry-run.

net.py and cgroups.py describe what they would do as lists of actions; the launcher either runs
them or prints them (`hepti emulate --dry-run` output is a shell script a reader can follow).
Setup actions fail loudly; teardown actions tolerate "already gone".
"""
from __future__ import annotations

import errno
import os
import shlex
import subprocess
from dataclasses import dataclass

from hepti.emulate.spec import EmulateError

# stderr fragments of ip/tc meaning "the object is already gone"; teardown ignores them
GONE = ("Cannot find device", "No such file or directory", "does not exist", "Invalid handle")


@dataclass(frozen=True)
class Cmd:
    """Run argv; `gone_ok` makes "already gone" errors silent (teardown)."""

    argv: tuple[str, ...]
    gone_ok: bool = False


@dataclass(frozen=True)
class Write:
    """Write `value` to the (cgroup or proc) file `path`; an `optional` file may be absent."""

    path: str
    value: str
    optional: bool = False


@dataclass(frozen=True)
class Mkdir:
    path: str


@dataclass(frozen=True)
class Rmdir:
    """Remove an (empty, e.g. cgroup) directory; a missing one is fine."""

    path: str


Action = Cmd | Write | Mkdir | Rmdir


def cmd(*argv: str, gone_ok: bool = False) -> Cmd:
    return Cmd(tuple(str(a) for a in argv), gone_ok)


def render(action: Action) -> str:
    """The action as one line of shell."""
    if isinstance(action, Cmd):
        line = shlex.join(action.argv)
        return f"{line} 2>/dev/null || true" if action.gone_ok else line
    if isinstance(action, Write):
        line = f"echo {shlex.quote(action.value)} > {shlex.quote(action.path)}"
        return f"[ -e {shlex.quote(action.path)} ] && {line}" if action.optional else line
    if isinstance(action, Mkdir):
        return f"mkdir {shlex.quote(action.path)}"
    return f"rmdir {shlex.quote(action.path)} 2>/dev/null || true"


def run(action: Action) -> None:
    """Carry out one action; raise EmulateError saying which one failed and why."""
    try:
        if isinstance(action, Cmd):
            p = subprocess.run(action.argv, capture_output=True, text=True)
            if p.returncode != 0:
                err = (p.stderr or p.stdout).strip()
                if action.gone_ok and (not err or any(g in err for g in GONE)):
                    return
                raise EmulateError(f"`{render(action)}` failed: {err or f'exit code {p.returncode}'}")
        elif isinstance(action, Write):
            if action.optional and not os.path.exists(action.path):
                return
            with open(action.path, "w") as f:
                f.write(action.value)
        elif isinstance(action, Mkdir):
            os.mkdir(action.path)
        else:
            try:
                os.rmdir(action.path)
            except FileNotFoundError:
                pass
    except OSError as e:
        hint = ""
        if isinstance(action, Cmd) and e.filename == action.argv[0]:
            hint = f" ({action.argv[0]} is not installed; on Debian/Ubuntu: apt-get install iproute2 util-linux)"
        elif e.errno in (errno.EACCES, errno.EPERM):
            hint = " (hepti emulate needs root)"
        err = EmulateError(f"`{render(action)}` failed: {e.strerror}{hint}")
        err.errno = e.errno  # a caller may tell one refusal from another (EBUSY: hepti.emulate.launch)
        raise err from None


def run_all(actions: list[Action]) -> None:
    for a in actions:
        run(a)


def run_tolerant(actions: list[Action]) -> list[str]:
    """Run every action even if some fail (teardown); return the failures' messages."""
    failures = []
    for a in actions:
        try:
            run(a)
        except EmulateError as e:
            failures.append(str(e))
    return failures
