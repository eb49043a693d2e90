"""`hepti run`'s stall watch: a rank that stops answering ends the job, instead of hanging it.

A dead rank closes its sockets and mpiexec ends the job; a hung one (SIGSTOP, a frozen board,
a silent Wi-Fi link) closes nothing, and MPI waits for it forever. Only a deadline, read
outside MPI, tells the two apart (DESIGN.md, "Stall vs death"). So, for the passes of a
distributed `hepti run`:

- every rank other than 0 holds one plain TCP line to rank 0 and beats on it every
  BEAT_EVERY_S from a thread of its own (`Beat`); rank 0 beats back on each line (`Watch`).
  The beats need the GIL for a moment only: the kernels are nogil, and mpi4py releases the GIL
  in the verbs' waits (Waitall, Test, bcast, gather, recv; measured with mpi4py 4.1: only the
  pickled `allreduce` holds it, which the job's loop never calls), so a healthy rank beats
  while it computes or waits for a slower peer;
- rank 0 knows when the batch in progress started (`runner.run_passes` tells it as each pass
  starts and each batch completes). When that batch has run past the stall timeout AND some
  rank has been silent for longer than `silent_after(timeout)` (a few seconds), that rank is
  stalled (`find_stall`). Either alone is not enough: a slow batch with every rank beating is
  slow, not stuck (rank 0 warns once and keeps waiting); a beat missed for a few seconds
  (a starved CPU, a congested link) inside a batch still on time is no reason to kill a job;
- rank 0 then writes what it has (every complete batch is already in OUT.npy.partial; the
  file is flushed and synced under the lock the batches are written under), prints ONE
  message naming the silent rank, its host, the batch, the rows kept and the `--resume`
  command that continues the run, and leaves with `os._exit(STALL_EXIT)`: a rank that ends
  without MPI_Finalize makes Hydra kill every other rank, a stopped one too, and mpiexec
  returns that exit code (MPICH 5.0's Hydra, measured for rank 0 leaving and for another);
- rank 0 stopped is seen from the other side: its beats carry how long its batch has run,
  so rank 1 (then rank 2, a second later, and so on) declares rank 0 stalled when it has been
  silent past the same two limits plus RANK0_GRACE_S (rank 0, which sees more, decides
  first when both could), and ends the job the same way.

Not watched: profiling, planning and loading weights (before the passes: h5py holds the GIL
while it reads, and the profile's pickled allreduce does too, so a busy rank could look
silent there), and a rank stopped between saying goodbye and exiting.

This is not MPI communication between the ranks' computations, so it is not a verb of
`hepti.parallel.comm`: it is a side channel that must work exactly when MPI does not. Its
setup is the only collective here (rank 0's address out, every rank's host back), and it goes
through the verbs. Each line starts with a nonce from that setup, so a connection that reaches
some other program listening on the same port (a guessed address on another host) is dropped.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import select
import shlex
import socket
import sys
import threading
import time
import fcntl
import struct

log = logging.getLogger("hepti")

BEAT_EVERY_S = 0.5  # each side beats this often (a beat is ~60 bytes)
SILENT_S = 5.0  # a rank silent this long (ten beats missed) may be stalled: see `silent_after`
STALL_FLOOR_S = 30.0  # the default stall timeout is never below this
STALL_FACTOR = 10.0  # ... and is this many times the plan's predicted batch time
STALL_UNPLANNED_S = 120.0  # the default when the plan predicts nothing (even, --ratios, --plan
# without a prediction)
POKE_EVERY_S = 0.05  # rank 0 tells the others its batch at most this often between beats
RANK0_GRACE_S = 2.0  # rank 1 waits this much longer than rank 0 would, rank r (r-1) s more
STALL_EXIT = 3  # mpiexec's exit code after a stall: not 1 (a rank failed), 2 (bad input), 124
# (what `timeout` returns, so a wrapper's own deadline and ours stay apart), 130 (Ctrl-C)
CONNECT_TIMEOUT_S = 2.0  # per address rank 0 might be reached at
ABORT_GRACE_S = 0.3  # the message gets this long to reach mpiexec before the exit
MAX_LINE = 4096  # a frame longer than this is not ours


# --- the arithmetic (pure) -----------------------------------------------------------------

def default_stall_timeout(predicted_s: float | None, scale: float = 1.0) -> float:
    """The stall timeout when --stall-timeout is not given: STALL_FACTOR times the plan's
    predicted time of one batch (`predicted_s` for the plan's shape, times `scale` for the
    run's largest batch), at least STALL_FLOOR_S; STALL_UNPLANNED_S without a prediction.

    The factor covers a profile that has drifted and a shared machine; the floor covers the
    first batch (Numba specialises kernels to new shapes there, although they are loaded and
    compiled before any forward) and predictions of milliseconds."""
    if predicted_s is None or not math.isfinite(predicted_s) or predicted_s <= 0:
        return STALL_UNPLANNED_S
    if not math.isfinite(scale) or scale <= 0:
        scale = 1.0
    return max(STALL_FLOOR_S, STALL_FACTOR * predicted_s * scale)


def transformer_scale(plan_batch: int | None, plan_tokens: int | None, batch: int,
                      tokens: int) -> float:
    """How much more work a batch of [batch, tokens] is than the plan's [plan_batch,
    plan_tokens]: linear in rows, and quadratic in tokens once past the plan's (attention),
    an upper bound either way. 1 when the plan does not say its shape."""
    if not plan_batch or not plan_tokens:
        return 1.0
    t = tokens / plan_tokens
    return (batch / plan_batch) * t * max(1.0, t)


def cnn_scale(plan_batch: int | None, plan_hw, batch: int, hw) -> float:
    """A CNN's batch against its plan's: linear in images and in pixels."""
    if not plan_batch or not plan_hw:
        return 1.0
    return (batch / plan_batch) * (hw[0] * hw[1]) / (plan_hw[0] * plan_hw[1])


def silent_after(timeout: float) -> float:
    """How long a rank must have been silent to be stalled: SILENT_S, or the timeout itself
    when that is shorter (but at least four beats)."""
    return max(4 * BEAT_EVERY_S, min(SILENT_S, timeout))


def find_stall(now: float, progress_t: float, timeout: float, last_heard: dict[int, float],
               silent: float) -> tuple[int, float] | None:
    """(rank, seconds silent) of the stalled rank, or None: the batch in progress started
    (`progress_t`) more than `timeout` ago and some rank was last heard more than `silent`
    ago. Of several silent ranks, the one silent longest (the first to stop) is named."""
    if now - progress_t <= timeout:
        return None
    quiet = {r: now - t for r, t in last_heard.items() if now - t > silent}
    if not quiet:
        return None
    rank = max(quiet, key=lambda r: (quiet[r], -r))
    return rank, quiet[rank]


def resume_argv(args: list[str], launcher: list[str] | None, size: int, prog: list[str],
                resume: bool = True) -> list[str]:
    """The command that continues this run: the mpiexec command line that started it
    (`launcher`, when it ends with this rank's own `args`: every mpiexec option is kept, a
    hostfile too), else `mpiexec -n SIZE PROG ARGS`; with --resume added when `resume` and
    missing."""
    own = list(args)
    if launcher and len(launcher) > len(own) and launcher[len(launcher) - len(own):] == own:
        head = launcher[:len(launcher) - len(own)]
    else:
        head = ["mpiexec", "-n", str(size), *prog]
    if resume and "--resume" not in own:
        own.append("--resume")
    return head + own


def stall_message(rank: int, host: str, where: str, silent_s: float, timeout: float,
                  kept: str, command: list[str] | None) -> str:
    """The one line a stall prints (without the "hepti run: error: " prefix)."""
    text = (f"rank {rank} on {host} stopped answering {where} (silent {silent_s:.1f} s, "
            f"--stall-timeout {timeout:g} s); {kept}")
    if command:
        text += f"; continue with: {shlex.join(command)}"
    return text


# --- the launch (read from /proc) ----------------------------------------------------------

def _ppid(pid: int | str) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def launcher_argv() -> list[str] | None:
    """The command line of the mpiexec that started this rank, when it runs on this host
    (Hydra: mpiexec -> hydra_pmi_proxy -> this rank); None elsewhere."""
    pid = _ppid("self")
    for _ in range(2):
        pid = _ppid(pid) if pid else None
        if not pid:
            return None
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[:-1]]
        except OSError:
            return None
        if any(os.path.basename(a).startswith(("mpiexec", "mpirun")) for a in argv[:2]):
            return argv
    return None


def program() -> list[str]:
    """How this hepti was started, for a command printed without a launcher: `hepti` (the
    console script) or `python -m hepti`."""
    if os.path.basename(sys.argv[0]) == "hepti":
        return ["hepti"]
    return ["python", "-m", "hepti"]


def local_addresses() -> list[str]:
    """This host's IPv4 addresses, loopback last (Linux: SIOCGIFADDR per interface)."""
    found = []
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for _, name in socket.if_nameindex():
                try:
                    packed = fcntl.ioctl(s.fileno(), 0x8915,  # SIOCGIFADDR
                                         struct.pack("256s", name[:15].encode()))
                except OSError:
                    continue
                found.append(socket.inet_ntoa(packed[20:24]))
    except OSError:
        pass
    found = list(dict.fromkeys(found)) or ["127.0.0.1"]
    return sorted(found, key=lambda a: a.startswith("127."))


# --- the lines ---------------------------------------------------------------------------------

class _Line:
    """One TCP line, non-blocking: JSON frames, one per text line."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock, self.buf, self.rank = sock, b"", None
        self.out = b""  # the rest of a frame the socket took only part of

    def send(self, obj) -> bool:
        """One frame; False when the line is gone. While the peer reads nothing (a stopped
        rank; its buffers full) new frames are dropped, a beat being worth nothing late, but
        a frame begun is finished first, so the line never carries half a frame."""
        frame = json.dumps(obj).encode() + b"\n" if len(self.out) < MAX_LINE else b""
        data = self.out + frame
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return False
        self.out = data[sent:]
        return True

    def read(self) -> list | None:
        """The frames that arrived; None once the line is closed (or sent garbage)."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return []
        except OSError:
            return None
        if not data:
            return None
        self.buf += data
        *lines, self.buf = self.buf.split(b"\n")
        if len(self.buf) > MAX_LINE:
            return None
        frames = []
        for ln in lines:
            try:
                obj = json.loads(ln)
            except ValueError:
                return None
            if isinstance(obj, dict):
                frames.append(obj)
        return frames

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _declare(text: str, newline: bool = False) -> None:
    """Print the stall's one line and end this process; Hydra ends the others."""
    sys.stderr.write(("\n" if newline else "") + f"hepti run: error: {text}\n")
    sys.stderr.flush()
    time.sleep(ABORT_GRACE_S)  # for mpiexec to forward the line before the job is torn down
    os._exit(STALL_EXIT)


class Watch:
    """Rank 0's side: accepts the other ranks' lines, beats back, knows the batch in progress,
    and declares a stall (`find_stall`). `runner.run_passes` calls `follow`, `begin`,
    `batch_done` and `end`, and writes each batch's rows holding `lock`."""

    def __init__(self, timeout: float, nonce: str, size: int, resume_cmd, output: str | None):
        self.timeout, self.silent = timeout, silent_after(timeout)
        self.nonce, self.size = nonce, size
        self.resume_cmd, self.output = resume_cmd, output  # resume_cmd(resume: bool) -> argv
        self.listener = socket.create_server(("0.0.0.0", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.lines: list[_Line] = []
        self.hosts: dict[int, str] = {}
        self.last: dict[int, float] = {}  # watched rank -> when last heard (monotonic)
        self.gone: set[int] = set()  # ranks that said goodbye or whose line closed
        self.watching = False
        self.lock = threading.Lock()  # held while a batch's rows are written (run_passes)
        self._mu = threading.Lock()  # last, gone, watching: never held across any I/O
        self.progress_t = time.monotonic()
        self.out = None  # the OutputFile (duck-typed: next, partial, path, f), or None
        self.n_batches = self.batch = None  # total; in progress (0-based), None between
        self.passes, self.pass_no, self.warmup = 1, 0, False
        self.bar_open = False  # a progress bar is drawn on stderr: the message starts a line
        self.warned_t = None
        # what rank 0 is doing goes out soon after it changes (the others name it if rank 0
        # stops), at most every POKE_EVERY_S: a byte on this pipe wakes the thread
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poked = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hepti-watch", daemon=True)
        self._thread.start()

    # --- what the pass loop tells it ---
    def follow(self, out, n_batches: int, passes: int) -> None:
        self.out, self.n_batches, self.passes = out, n_batches, passes

    def begin(self, batch: int, pass_no: int = 0, warmup: bool = False) -> None:
        self.batch, self.pass_no, self.warmup = batch, pass_no, warmup
        self.progress_t = time.monotonic()
        self._poke(force=True)

    def batch_done(self, k: int) -> None:
        self.batch = k + 1 if self.n_batches is None or k + 1 < self.n_batches else None
        self.progress_t = time.monotonic()
        self._poke()

    def end(self) -> None:
        self.batch, self.warmup = None, False
        self.progress_t = time.monotonic()
        self._poke(force=True)

    def _poke(self, force: bool = False) -> None:
        """Wake the thread to beat now (a few microseconds; at most every POKE_EVERY_S)."""
        if force or self.progress_t - self._poked > POKE_EVERY_S:
            self._poked = self.progress_t
            try:
                os.write(self._wake_w, b".")
            except OSError:  # full (the thread is behind) or closed
                pass

    def where(self) -> str:
        if self.warmup:
            return f"during the warm-up (batch {self.batch + 1})"
        if self.batch is None:
            return ("after the last batch" if self.n_batches is not None
                    else "before the first batch")
        where = f"during batch {self.batch + 1} of {self.n_batches}"
        return where + (f" (pass {self.pass_no + 1} of {self.passes})" if self.passes > 1 else "")

    # --- the thread ---
    def expect(self, hosts: list[str], reached: list[bool]) -> None:
        """After the setup's gather: each rank's host, and whether it reached this listener
        (those that did not are not watched; they warned)."""
        now = time.monotonic()
        self.hosts = dict(enumerate(hosts))
        with self._mu:
            for r in range(1, self.size):
                if reached[r]:
                    self.last.setdefault(r, now)
            self.progress_t = now
            self.watching = True

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            socks = [self.listener, self._wake_r] + [ln.sock for ln in self.lines]
            try:
                ready, _, _ = select.select(socks, [], [], 0.1)
            except (OSError, ValueError):
                ready = []
            now = time.monotonic()
            beat_now = False
            for s in ready:
                if s is self.listener:
                    self._accept()
                    continue
                if s is self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except OSError:
                        pass
                    beat_now = True
                    continue
                ln = next((x for x in self.lines if x.sock is s), None)
                if ln is not None:
                    self._hear(ln, now)
            if now >= next_beat or beat_now:
                next_beat = now + BEAT_EVERY_S
                beat = {"age": now - self.progress_t, "where": self.where(),
                        "bar": self.bar_open if self.n_batches is not None else None}
                for ln in self.lines:
                    if ln.rank is not None:
                        ln.send(beat)
            if self.watching:
                self._check(now)

    def _accept(self) -> None:
        try:
            sock, _ = self.listener.accept()
        except OSError:
            return
        self.lines.append(_Line(sock))

    def _hear(self, ln: _Line, now: float) -> None:
        frames = ln.read()
        if frames is None:  # closed: a rank that died (mpiexec's business) or a stranger
            self.lines.remove(ln)
            ln.close()
            if ln.rank is not None:
                with self._mu:
                    self.gone.add(ln.rank)
            return
        for f in frames:
            if ln.rank is None:
                rank = f.get("hello")
                if f.get("nonce") != self.nonce or not isinstance(rank, int):
                    self.lines.remove(ln)  # not one of this job's ranks
                    ln.close()
                    return
                ln.rank = rank
                ln.send({"ok": self.nonce})
            elif f.get("bye"):
                with self._mu:
                    self.gone.add(ln.rank)
            if ln.rank is not None:
                with self._mu:
                    self.last[ln.rank] = now

    def _check(self, now: float) -> None:
        with self._mu:
            heard = {r: t for r, t in self.last.items() if r not in self.gone}
        progress_t = self.progress_t
        found = find_stall(now, progress_t, self.timeout, heard, self.silent)
        if found is not None:
            self._stalled(*found)
        # late but alive: said once per batch, once a stopped rank would have been named
        if now - progress_t > self.timeout + self.silent and self.warned_t != progress_t:
            self.warned_t = progress_t
            log.warning("%s: %.0f s without progress, past --stall-timeout %g s, but every "
                        "rank still answers: waiting (Ctrl-C stops the run; --resume then "
                        "continues it)", self.where(), now - progress_t, self.timeout)

    def _stalled(self, rank: int, silent_s: float) -> None:
        """Keep what was written, say so once, and end the job."""
        self.lock.acquire(timeout=5.0)  # a batch being written completes first (never released:
        # the process ends below, and no batch may be written after the count)
        out, command = self.out, None
        try:
            if out is None:
                if self.output:  # stalled before the passes knew the output
                    kept = f"the rows written so far are kept in {self.output}.partial"
                    command = self.resume_cmd(True)
                else:
                    kept = "nothing was written (no --output)"
                    command = self.resume_cmd(False)
            elif out.f.closed:  # committed: the output is whole, only the report is lost
                kept = f"the output {out.path} is complete"
            else:
                try:
                    out.f.flush()
                    os.fsync(out.f.fileno())
                except (OSError, ValueError):
                    pass
                done = out.next
                kept = (f"no batch had completed ({out.partial} holds none yet)" if done == 0 else
                        f"all {done} batches are kept in {out.partial}" if done == self.n_batches
                        else f"the {done} complete batch{'es' if done != 1 else ''} "
                             f"{'are' if done != 1 else 'is'} kept in {out.partial}")
                command = self.resume_cmd(True)
            text = stall_message(rank, self.hosts.get(rank, "?"), self.where(), silent_s,
                                 self.timeout, kept, command)
        except Exception as e:  # noqa: BLE001 - the job must end whatever the message's fate
            text = f"rank {rank} stopped answering ({type(e).__name__} while saying so: {e})"
        _declare(text, newline=self.bar_open)

    def close(self) -> None:
        """The job is over: say goodbye on every line, stop watching."""
        self._stop.set()
        self._thread.join(2 * BEAT_EVERY_S)
        for ln in self.lines:
            ln.send({"bye": True})
            ln.close()
        self.listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)


class Beat:
    """Another rank's side: beats to rank 0 on its line, and watches rank 0's beats, which
    carry how long rank 0's batch in progress has run and which it is."""

    def __init__(self, line: _Line, rank: int, timeout: float, host0: str, resume_cmd,
                 output: str | None, bar_likely: bool):
        self.line, self.rank, self.timeout, self.host0 = line, rank, timeout, host0
        self.silent = silent_after(timeout)
        self.grace = RANK0_GRACE_S + (rank - 1)  # rank 0 first, then rank 1, 2, ...
        self.resume_cmd, self.output = resume_cmd, output
        now = time.monotonic()
        self.last0 = self.age_t = now  # rank 0 last heard; when its age was reported
        self.age, self.where0 = 0.0, "before the first batch"
        # rank 0 draws a progress bar, so its line is open on mpiexec's stderr: as its beats
        # say, or, before one has, as likely (a bar is drawn unless --json)
        self.bar0 = bar_likely
        self.watching = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hepti-beat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self.line.sock], [], [], 0.1)
            except (OSError, ValueError):
                return
            now = time.monotonic()
            if ready:
                frames = self.line.read()
                if frames is None:  # rank 0 is gone (or done): nothing left to watch or tell
                    return
                for f in frames:
                    self.last0 = now
                    if f.get("bye"):
                        self.watching = False
                    elif "age" in f:
                        self.age, self.age_t = float(f["age"]), now
                        self.where0 = str(f.get("where", self.where0))
                        if f.get("bar") is not None:
                            self.bar0 = bool(f["bar"])
            if now >= next_beat:
                next_beat = now + BEAT_EVERY_S
                if not self.line.send({"beat": self.rank}):
                    return
            if self.watching:
                age = self.age + (now - self.age_t)
                found = find_stall(now, now - age, self.timeout + self.grace,
                                   {0: self.last0}, self.silent + self.grace)
                if found is not None:
                    self._stalled(found[1])

    def _stalled(self, silent_s: float) -> None:
        if self.output:
            kept = f"the batches it completed are kept in {self.output}.partial on {self.host0}"
            command = self.resume_cmd(True)
        else:
            kept = "nothing was written (no --output)"
            command = self.resume_cmd(False)
        _declare(stall_message(0, self.host0, self.where0, silent_s, self.timeout, kept,
                               command), newline=self.bar0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2 * BEAT_EVERY_S)
        self.line.send({"bye": True})
        self.line.close()


def _connect(addrs: list[str], port: int, nonce: str, rank: int) -> _Line | None:
    """A line to rank 0's listener: the first address that answers our hello with the nonce."""
    for addr in addrs:
        try:
            sock = socket.create_connection((addr, port), timeout=CONNECT_TIMEOUT_S)
        except OSError:
            continue
        try:
            sock.sendall(json.dumps({"hello": rank, "nonce": nonce}).encode() + b"\n")
            buf, t_end = b"", time.monotonic() + CONNECT_TIMEOUT_S
            while b"\n" not in buf and time.monotonic() < t_end:
                sock.settimeout(max(0.01, t_end - time.monotonic()))
                data = sock.recv(4096)
                if not data:
                    break
                buf += data
            reply = json.loads(buf.split(b"\n", 1)[0]) if b"\n" in buf else {}
            if isinstance(reply, dict) and reply.get("ok") == nonce:
                line = _Line(sock)
                line.buf = buf.split(b"\n", 1)[1]
                return line
        except (OSError, ValueError):
            pass
        sock.close()
    return None


def start(world, timeout: float | None, args=None):
    """Collective over the world: set up the stall watch for a job's passes. `timeout` (rank 0
    only; the others pass None) in seconds, 0 or None for none. Returns rank 0's `Watch`,
    another rank's `Beat`, or None (one rank, no timeout, or a rank that could not reach rank
    0: it says so, and is not watched)."""
    if world.solo:
        return None
    rank0 = world.rank == 0
    output = getattr(args, "output", None)
    argv = list(sys.argv[1:])
    launcher = launcher_argv()

    def resume_cmd(resume: bool) -> list[str]:
        return resume_argv(argv, launcher, world.size, program(), resume)

    watch = None
    if rank0 and timeout:
        try:
            nonce = secrets.token_hex(8)
            watch = Watch(float(timeout), nonce, world.size, resume_cmd, output)
        except OSError as e:
            log.warning("cannot open the stall watch's socket (%s): a rank that stops answering "
                        "will hang the run instead of ending it", e)
    head = world.bcast_obj({"timeout": watch.timeout, "port": watch.port, "nonce": watch.nonce,
                            "host": os.uname().nodename, "addrs": local_addresses()}
                           if watch is not None else None)
    if head is None:
        return None
    line = None
    if not rank0:
        addrs = list(head["addrs"])
        if head["host"] == os.uname().nodename:
            addrs.sort(key=lambda a: not a.startswith("127."))
        line = _connect(addrs, head["port"], head["nonce"], world.rank)
        if line is None:
            log.warning("rank %d cannot reach rank 0's stall watch at %s port %d: if rank %d "
                        "stops answering, the run will hang instead of ending", world.rank,
                        ", ".join(addrs), head["port"], world.rank)
    hosts = world.gather_obj((os.uname().nodename, line is not None))
    if rank0:
        watch.expect([h for h, _ in hosts], [True] + [ok for _, ok in hosts[1:]])
        return watch
    if line is None:
        return None
    return Beat(line, world.rank, head["timeout"], head["host"], resume_cmd, output,
                bar_likely=not getattr(args, "json", False))
