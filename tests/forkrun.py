"""`python -m hepti ARGS` for the tests, as a new process forked from one that has already
imported hepti's heavy modules (numpy, Numba, h5py, the model and planner code).

A plain subprocess spends about 1.5 s on a quiet 2-core machine, and several under load,
importing before it does anything; the unit tests start a few hundred of them. Here a server
process (started once per test session, on first use) imports them once, then forks a child
per command. The child is a fresh process as far as the command can tell: its own pid, the
caller's argv, working directory and environment, stdout and stderr to the caller's files,
`python -m hepti`'s own code path (runpy, so an uncaught exception prints its traceback and
exits 1 as the interpreter would), and its exit code returned. What it shares with the server
is only what was imported, never MPI: the server refuses to start if an import initialised
MPI (a forked MPI process is broken), and commands that read an environment variable at
import time still see the caller's value, since a caller whose NUMBA_*/HEPTI_*/OMP_*
variables differ from the server's gets a plain subprocess instead.

`run(args, cwd=None, timeout=300) -> subprocess.CompletedProcess` (text stdout and stderr),
as `subprocess.run([sys.executable, "-m", "hepti", *args], capture_output=True, text=True)`.
HEPTI_TEST_FORK=0 turns it off (every command a plain subprocess).
"""
from __future__ import annotations

import atexit
import json
import os
import runpy
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from pathlib import Path

# imported by the server before it forks: what `hepti run/convert/plan/order/...` import first.
# Not hepti.generate (it imports mpi4py.MPI, which initialises MPI).
PRELOAD = ("hepti.cli", "hepti.runner", "hepti.families", "hepti.weights", "hepti.weights.convert",
           "hepti.images", "hepti.output", "hepti.inputs", "hepti.order", "hepti.graph",
           "hepti.plan", "hepti.parallel.profiling")
# environment variables a module may read at import: a caller whose values differ from the
# server's runs a plain subprocess
IMPORT_TIME_ENV = ("NUMBA_", "HEPTI_", "OMP_", "OPENBLAS_", "MKL_", "PYTHON")

_lock = threading.Lock()
_server: dict = {}


def _env_key(env) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_ENV) and k != "HEPTI_TEST_FORK"}


def _plain(args, cwd, timeout) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hepti", *map(str, args)], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def _start() -> dict | None:
    """The server for this session (started on first use), or None where it cannot run."""
    if "sock" in _server or "failed" in _server:
        return _server.get("sock") and _server
    path = Path(tempfile.mkdtemp(prefix="hepti-forkrun-")) / "sock"
    proc = subprocess.Popen([sys.executable, __file__, str(path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready = proc.stdout.readline().strip()
    if ready != "ready":
        _server["failed"] = (ready + proc.stderr.read())[-2000:]
        proc.kill()
        warnings.warn(f"tests/forkrun.py: no fork server, plain subprocesses instead: {_server['failed']}")
        return None
    _server.update(sock=str(path), proc=proc, env=_env_key(os.environ))

    def stop():
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
    atexit.register(stop)
    return _server


def run(args, cwd=None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m hepti ARGS` (see the module docstring): returncode, stdout, stderr."""
    args = [str(a) for a in args]
    if os.environ.get("HEPTI_TEST_FORK", "1") == "0":
        return _plain(args, cwd, timeout)
    with _lock:
        server = _start()
    if server is None or _env_key(os.environ) != server["env"]:
        return _plain(args, cwd, timeout)
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err, \
            socket.socket(socket.AF_UNIX) as s:
        s.connect(server["sock"])
        request = json.dumps({"argv": args, "cwd": str(cwd or os.getcwd()),
                              "env": dict(os.environ)}).encode()
        socket.send_fds(s, [struct.pack("!I", len(request)) + request],
                        [out.fileno(), err.fileno()])
        f = s.makefile("r")
        pid = int(f.readline())
        s.settimeout(timeout)
        try:
            code = int(f.readline())
        except (TimeoutError, socket.timeout):
            try:
                os.killpg(pid, signal.SIGKILL)  # the command and what it started (its own group)
            except ProcessLookupError:
                pass
            raise subprocess.TimeoutExpired(["hepti", *args], timeout) from None
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(["hepti", *args], code, out.read(), err.read())


# --- the server ----------------------------------------------------------------------------------

def _child(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m hepti ARGV` and exit with its code."""
    os.setsid()  # its own group, as a subprocess's kill by the caller would reach
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a new process's global generator is seeded afresh (`random`
        sys.modules["numpy"].random.seed()  # reseeds itself after a fork)
    sys.argv = [sys.argv[0], *request["argv"]]
    code = 0
    try:
        runpy.run_module("hepti", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - as the interpreter does: the traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _handle(conn: socket.socket) -> None:
    """In a handler process: fork the command, report its pid, wait, report its exit code."""
    head, fds, _, _ = socket.recv_fds(conn, 4, 2)
    (n,) = struct.unpack("!I", head)
    data = b""
    while len(data) < n:
        data += conn.recv(n - len(data))
    request = json.loads(data)
    pid = os.fork()
    if pid == 0:
        conn.close()
        _child(request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(f"{pid}\n".encode())
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    try:
        conn.sendall(f"{code}\n".encode())
    except OSError:
        pass  # the caller gave up (its timeout)


def serve(path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    sys.modules["hepti.cli"].build_parser()  # it imports what every command's options need
    if "mpi4py.MPI" in sys.modules:
        print(f"forkrun: an import of {PRELOAD} initialised MPI; not forking", flush=True)
        return
    sys.stdout.flush()
    sys.stderr.flush()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # handler processes are reaped by the kernel
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(path)
        s.listen(16)
        print("ready", flush=True)
        s.settimeout(5.0)
        parent = os.getppid()
        while os.getppid() == parent:  # a test session killed without its atexit: end too
            try:
                conn, _ = s.accept()
            except TimeoutError:
                continue
            conn.settimeout(None)
            if os.fork() == 0:
                s.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    _handle(conn)
                finally:
                    os._exit(0)
            conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
