"""`hepti serve`'s front end: the request queue, the batcher, and the MPI job it launches and
relaunches.

The queue lives here, outside MPI, so the workers can die and be relaunched without losing an
accepted request. One thread (`_life`) owns the workers: it starts `mpiexec ... python -m
hepti.serve.worker`, waits for rank 0 to connect to the channel (hepti.serve.protocol) and say
hello, then sends batches one at a time. While a batch runs, requests queue up; the next batch
takes the queue's inputs in arrival order up to a token budget (inputs x longest input, as the
batch is padded to its longest). An HTTP handler thread calls `embed`, which queues its inputs
and waits.

When the workers end (a rank died, a device was unplugged: mpiexec exits and the channel
closes), the batch in flight goes back to the head of the queue and the job is relaunched. If
the job was ended by a signal (mpiexec exits 9: a rank was killed), the lost rank is the one
whose watch line closed first (every rank holds one open to the front end; MPICH's own report
names whichever rank it saw end first, often one it killed itself), and its host is taken out
of the host list (`-f hostfile` minus that host; on one machine, one rank fewer); the new job plans afresh
for what is left; a fixed --ratios or --plan, made for the old world size, gives way to `auto`.
An input whose batch was in flight at two failures is answered with an error rather than tried
a third time (it may be what kills the workers). Launches that fail before hello
`MAX_FAILED_STARTS` times in a row end the service: waiting requests get 503.
"""
from __future__ import annotations

import collections
import functools
import logging
import os
import secrets
import selectors
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hepti.emulate import jobfiles
from hepti.emulate.command import die_with_parent
from hepti.serve import ServiceUnavailable, protocol

log = logging.getLogger("hepti")
MAX_FAILED_STARTS = 2  # launches in a row that never said hello before the service gives up
MAX_ATTEMPTS = 2  # failures an input's batch may be part of before the input is refused
LATENCY_WINDOW = 2000  # requests whose latency /metrics' percentiles cover
REPLANS_KEPT = 500  # re-plan events /metrics lists
AB_RUNS_KEPT = 200  # --replan-ab's runs of batches /metrics lists


@dataclass
class Request:
    inputs: list[np.ndarray]
    out: np.ndarray
    t_submit: float = field(default_factory=time.perf_counter)
    remaining: int = 0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Piece:
    """One input of a request: what the batcher packs."""
    request: Request
    index: int
    ids: np.ndarray
    attempts: int = 0


class WorkerFailed(ServiceUnavailable):
    """An input that was in flight when the workers failed MAX_ATTEMPTS times."""


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """MPICH hostfile lines `host[:slots]` (comments on lines of their own) -> [(host, slots)]."""
    entries = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        entries.append((host.strip(), int(slots) if slots.strip() else 1))
    return entries


def rank_hosts(entries: list[tuple[str, int]], n: int) -> list[int]:
    """Which entry each of n ranks runs on: Hydra fills each host's slots in order, then wraps."""
    order = [i for i, (_, slots) in enumerate(entries) for _ in range(slots)]
    return [order[r % len(order)] for r in range(n)]


def route_address(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, 9))
            return s.getsockname()[0]
        except OSError:
            return "0.0.0.0"


class Supervisor:
    """The service behind the HTTP routes (hepti.serve.http): `embed`, `health`, `metrics`."""

    def __init__(self, model_dir: str | Path, n: int, hostfile: str | None = None,
                 worker_args: list[str] | None = None, max_batch_tokens: int = 8192,
                 max_batch_inputs: int = 64, start_timeout_s: float = 900.0,
                 request_timeout_s: float = 600.0, replan: bool = False,
                 replan_ab: int | None = None):
        from hepti.weights import WeightStore
        self.model_dir = Path(model_dir)
        cfg = WeightStore(self.model_dir).config
        self.config = cfg
        self.name = cfg.name or self.model_dir.name
        self.hidden_size = cfg.hidden_size
        self.max_tokens = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.tokenizer = _load_tokenizer(self.model_dir / "tokenizer.json")
        self.worker_args = list(worker_args or []) + (["--replan", "1"] if replan else [])
        self.replan = replan
        # --replan-ab N: batch k reports (the monitor on) when (k // N) is even; each run of N
        # batches' request latencies, kept for /metrics (`monitor_ab`)
        self.replan_ab = replan_ab if replan else None
        self._ab_runs: list[dict] = []
        self.max_batch_tokens, self.max_batch_inputs = max_batch_tokens, max_batch_inputs
        self.start_timeout_s, self.request_timeout_s = start_timeout_s, request_timeout_s
        # where ranks run: a hostfile's entries (yours, or hepti emulate's), else this machine
        hostfile = hostfile or os.environ.get("HYDRA_HOST_FILE")
        self.entries = read_hostfile(hostfile) if hostfile else None
        self.n = n
        self._cv = threading.Condition()
        self._queue: collections.deque[Piece] = collections.deque()
        self._status, self._failure = "starting", ""
        self._stopping = False
        self._proc: subprocess.Popen | None = None
        # our pid in its name: `hepti emulate --cleanup` removes it if we are killed (jobfiles)
        self._tmp = tempfile.TemporaryDirectory(prefix=jobfiles.serve_dir_prefix())
        self._files_before: jobfiles.Snapshot | None = None  # before the running job's launch
        self._token = secrets.token_hex(16)
        self._listener = self._listen()
        self._thread = threading.Thread(target=self._life, name="hepti-serve-workers", daemon=True)
        self._watch = selectors.DefaultSelector()  # each rank's watch line (hepti.serve.worker)
        self._closed: list[tuple[float, int]] = []  # (when, rank) as the lines close
        threading.Thread(target=self._watch_ranks, name="hepti-serve-watch", daemon=True).start()
        # what /metrics reports
        self.epoch = 0
        self.plan: dict | None = None
        self.ranks: list[dict] = []
        self.launches: list[dict] = []
        # each re-fit and its decision, for /metrics: the last REPLANS_KEPT (a service runs for
        # days, and a noisy device can make a "keep" decision every few seconds)
        self.replans: collections.deque[dict] = collections.deque(maxlen=REPLANS_KEPT)
        # the monitor's flags (a rank's residual far off at once: hepti.serve.monitor), acted
        # on or not: when each change was first seen
        self.flags: collections.deque[dict] = collections.deque(maxlen=REPLANS_KEPT)
        self.watcher = None  # hepti.serve.replan.PlanWatcher, with --replan on
        self.counts = collections.Counter()
        self._latencies: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._batch_walls: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._stderr_tail: collections.deque[str] = collections.deque(maxlen=60)

    # --- the service interface ---------------------------------------------------------------
    def start(self) -> "Supervisor":
        self._thread.start()
        return self

    def embed(self, inputs: list[np.ndarray]) -> np.ndarray:
        """Queue the inputs, wait for their embeddings [n, C] (float32)."""
        req = Request(inputs, np.empty((len(inputs), self.hidden_size), np.float32),
                      remaining=len(inputs))
        with self._cv:
            if self._status == "failed":
                raise ServiceUnavailable(self._failure)
            self.counts["accepted"] += 1
            self._queue.extend(Piece(req, i, x) for i, x in enumerate(inputs))
            self._cv.notify_all()
        if not req.done.wait(self.request_timeout_s):
            with self._cv:
                self._drop(req)
            raise ServiceUnavailable(f"no answer within {self.request_timeout_s:g} s "
                                     f"(workers {self._status}); try again")
        if req.error is not None:
            raise req.error
        self._latencies.append(time.perf_counter() - req.t_submit)
        return req.out

    def health(self) -> dict:
        return {"status": self._status, "model": self.name, "plan_epoch": self.epoch,
                "world_size": len(self.ranks) or None, "queued": len(self._queue)}

    def metrics(self) -> dict:
        lat = sorted(self._latencies)

        def pct(p):
            return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e3 if lat else None
        per_rank = []
        predicted = (self.plan or {}).get("predicted", {}).get("per_rank", [])
        for r in self.ranks:
            k = r["rank"]
            per_rank.append({**r, "shares": {d: v[k] for d, v in (self.plan or {}).get("ratios", {}).items()},
                             "predicted": predicted[k] if k < len(predicted) else None})
        return {
            "status": self._status, "model": self.name, "plan_epoch": self.epoch,
            "plan": None if self.plan is None else {
                k: self.plan.get(k) for k in ("strategy", "ratios", "primary", "layers",
                                              "predicted_latency_s", "explanation")},
            "ranks": per_rank,
            "requests": {"accepted": self.counts["accepted"], "answered": self.counts["answered"],
                         "failed": self.counts["failed"], "queued_inputs": len(self._queue)},
            "latency_ms": {"count": len(lat), "p50": pct(50), "p90": pct(90), "p99": pct(99)},
            "batches": {"count": self.counts["batches"],
                        "wall_ms_p50": statistics.median(self._batch_walls) * 1e3 if self._batch_walls else None},
            "launches": self.launches,
            "replans": list(self.replans),
            "flags": list(self.flags),
            "residuals": self.watcher.residuals() if self.watcher is not None else None,
            "monitor_ab": None if not self.replan_ab else {
                "every": self.replan_ab, "runs": self._ab_copy()},
        }

    def switch_plan(self, plan: dict) -> None:
        """Serve on `plan` (a plan file's JSON) from a batch boundary on, as a re-plan would:
        each rank loads its new slices beside the serving plan, then all switch together.
        Needs the re-planner (replan=True)."""
        from hepti.plan.planfile import Plan
        if self.watcher is None:
            raise RuntimeError("switch_plan needs the workers up with replan=True")
        self.watcher.requested = Plan.from_dict(plan).validate(len(self.ranks))

    def stop(self, grace_s: float = 10.0) -> None:
        """Tell the workers to stop, wait for them, and fail what is still queued."""
        with self._cv:
            self._stopping = True
            self._status = "stopping"
            self._cv.notify_all()
        self._thread.join(grace_s)
        self._end_proc(grace_s=3.0)
        with self._cv:
            self._fail_all(ServiceUnavailable("the service is shutting down"))
        self._listener.close()
        self._tmp.cleanup()

    # --- the workers' life ---------------------------------------------------------------------
    def _listen(self) -> socket.socket:
        host = "127.0.0.1"
        if self.entries:
            host = route_address(self.entries[0][0])
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen(64)  # every rank's watch line, then rank 0's channel
        s.settimeout(0.5)
        self.control_address = "%s:%d" % s.getsockname()
        return s

    def _command(self) -> list[str]:
        from hepti.emulate.command import find_mpiexec
        cmd = [find_mpiexec(), "-n", str(self.n)]
        if self.entries is not None:
            path = Path(self._tmp.name) / f"hostfile-{len(self.launches)}"
            path.write_text("".join(f"{h}:{s}\n" for h, s in self.entries))
            cmd += ["-f", str(path)]
        return cmd + [sys.executable, "-m", "hepti.serve.worker", "--model", str(self.model_dir),
                      *self.worker_args]

    def _life(self) -> None:
        failed_starts = 0
        while not self._stopping:
            launch = {"epoch": self.epoch + 1, "n": self.n, "started_at": time.time(),
                      "hosts": None if self.entries is None else [h for h, _ in self.entries]}
            self.launches.append(launch)
            reason = "the workers ended"
            try:
                sock = self._launch()
                if sock is None:
                    reason = "stopped before the workers started"
                    break
                failed_starts = 0
                reason = self._serve(sock)
            except _StartFailed as e:
                failed_starts += 1
                reason = str(e)
            except protocol.ChannelClosed as e:
                reason = f"the channel closed ({e})"
            finally:
                code = self._end_proc(grace_s=5.0)
                launch["ended_at"] = time.time()
                launch["exit_code"] = code
                launch["end"] = reason
            if self._stopping:
                break
            lost = self._lost_rank(launch.get("exit_code"))
            if lost is not None:
                self._drop_rank(lost, launch)
            if self.n < 1 or failed_starts >= MAX_FAILED_STARTS:
                tail = "\n".join(list(self._stderr_tail)[-15:])
                self._fail(f"the workers could not be started ({reason}); their last words:\n{tail}")
                return
            with self._cv:
                self._status = "relaunching"
            log.warning("serve: %s; relaunching on %d rank(s)", reason, self.n)

    def _launch(self) -> socket.socket | None:
        """Start mpiexec and wait for rank 0's hello; the connected channel."""
        env = dict(os.environ)
        env[protocol.CONTROL_ENV] = self.control_address
        env[protocol.TOKEN_ENV] = self._token
        cmd = self._command()
        log.info("serve: starting %d worker rank(s): %s", self.n, " ".join(cmd))
        self._stderr_tail.clear()
        self._closed.clear()
        self.watcher = None  # the next hello brings the new job's plan and profile
        for key in list(self._watch.get_map().values()):  # the last launch's lines
            try:
                self._watch.unregister(key.fileobj)
            except (KeyError, ValueError):  # closed by _watch_ranks meanwhile
                continue
            key.fileobj.close()
        self._files_before = jobfiles.snapshot()
        self._proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, errors="replace",
                                      start_new_session=True,  # our own group: killpg
                                      preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
        self._reader = threading.Thread(target=self._forward_output, args=(self._proc,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + self.start_timeout_s
        while not self._stopping:
            if self._proc.poll() is not None:
                raise _StartFailed(f"the workers exited ({self._proc.returncode}) before they were ready")
            if time.monotonic() > deadline:
                raise _StartFailed(f"the workers were not ready within {self.start_timeout_s:g} s")
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            sock.settimeout(30.0)
            try:
                hello, _ = protocol.recv(sock)
            except (OSError, ValueError, protocol.ChannelClosed):
                sock.close()
                continue
            if hello.get("op") not in ("hello", "watch") or not secrets.compare_digest(
                    str(hello.get("token", "")), self._token):
                log.warning("serve: a connection to the workers' channel without the secret; closed")
                sock.close()
                continue
            if hello["op"] == "watch":  # a rank's line, held open while it lives (_watch)
                self._watch.register(sock, selectors.EVENT_READ, int(hello["rank"]))
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._cv:
                self.epoch += 1
                self.plan, self.ranks = hello["plan"], hello["ranks"]
                self._status = "ok"
            if self.replan and hello.get("profile"):
                from hepti.serve.replan import PlanWatcher
                self.watcher = PlanWatcher(self, hello["profile"])
            launch = self.launches[-1]
            launch.update(ready_s=time.time() - launch["started_at"], strategy=self.plan["strategy"],
                          ratios=self.plan.get("ratios"))
            log.info("serve: ready (plan epoch %d: %s on %d rank(s), %.1f s to load)", self.epoch,
                     self.plan["strategy"], hello["world_size"], hello["load_s"])
            return sock
        return None

    def _watch_ranks(self) -> None:
        """Note when each rank's watch line closes: a killed rank's first, then the others' as
        mpiexec ends them (MPICH's own report names whichever of them it saw first)."""
        while True:
            for key, _ in self._watch.select(timeout=0.5):
                try:
                    data = key.fileobj.recv(64)
                except OSError:
                    data = b""
                if not data:
                    self._closed.append((time.monotonic(), key.data))
                    try:
                        self._watch.unregister(key.fileobj)
                    except (KeyError, ValueError):  # a new launch cleared it
                        continue
                    key.fileobj.close()

    def _serve(self, sock: socket.socket) -> str:
        """Send batches until the service stops (then tell the workers) or the channel breaks."""
        try:
            while True:
                batch = self._take_batch()
                if batch is None:
                    protocol.send(sock, {"op": "stop"})
                    return "stopped"
                lengths, flat = protocol.pack_ids([p.ids for p in batch])
                batch_id = self.counts["batches"]
                t0 = time.perf_counter()
                head = {"op": "batch", "id": batch_id, "lengths": lengths}
                monitored = self._monitored(batch_id)
                if self.replan and not monitored:
                    head["report"] = False
                watch = self._expectation(batch) if monitored else None
                if watch is not None:
                    head["watch"] = watch
                wall = None
                try:
                    protocol.send(sock, head, flat)
                    while True:
                        header, data = protocol.recv(sock)
                        if header.get("op") == "flag":  # rank 0's, from inside the batch
                            self.watcher.early_flag(header, _shape(batch))
                        elif header.get("op") == "answer":  # the embeddings, ahead of the
                            wall = time.perf_counter() - t0  # report (--replan)
                            self._batch_walls.append(wall)
                            self._deliver(batch, np.frombuffer(data, np.float32).reshape(
                                header["shape"]), batch_id)
                        else:
                            break
                except (OSError, protocol.ChannelClosed) as e:
                    if wall is None:  # answered inputs are not run again
                        self._requeue(batch)
                    raise protocol.ChannelClosed(str(e)) from None
                if wall is None:
                    wall = time.perf_counter() - t0
                    self._batch_walls.append(wall)
                    emb = np.frombuffer(data, np.float32).reshape(header["shape"])
                    self._deliver(batch, emb, batch_id)
                # a batch the monitor skipped has no report ("ranks_s"): the workers skipped it
                if self.watcher is not None and "ranks_s" in header:
                    self._watch_plan(sock, batch, header["ranks_s"], wall)
        finally:
            sock.close()

    def _monitored(self, batch_id: int) -> bool:
        """Whether the monitor watches this batch: always with --replan on, but for the
        paused half under --replan-ab."""
        return self.replan and (not self.replan_ab or (batch_id // self.replan_ab) % 2 == 0)

    def _expectation(self, batch: list[Piece]) -> dict | None:
        """What rank 0 should see during this batch (hepti.serve.replan), if re-planning; a
        fault there stops re-planning as one in `_watch_plan` does, not the service."""
        if self.watcher is None:
            return None
        try:
            return self.watcher.expectation(_shape(batch))
        except Exception as e:  # noqa: BLE001 - logged with its traceback, reported
            self._stop_replanning(e)
            return None

    def _stop_replanning(self, e: Exception) -> None:
        """Re-planning ends (the current plan serves on); /metrics says why."""
        log.exception("serve: re-planning failed; serving on with the current plan")
        self.replans.append({"t": time.time(), "decision": "stopped",
                             "reason": f"re-planning failed: {type(e).__name__}: {e}"})
        self.watcher = None

    def _watch_plan(self, sock, batch: list[Piece], ranks_s: list, wall: float) -> None:
        """The re-planner after a batch. A fault of its own ends re-planning, not the service:
        the current plan keeps serving, and /metrics says why it stopped."""
        shape = _shape(batch)
        try:
            self.watcher.after_batch(sock, shape, ranks_s, wall)
        except (OSError, protocol.ChannelClosed):
            raise  # the workers are gone: relaunch
        except Exception as e:  # noqa: BLE001 - logged with its traceback, reported
            self._stop_replanning(e)

    def command(self, sock: socket.socket, header: dict) -> dict:
        """One command to the workers between batches (probe, prepare, switch): its answer."""
        protocol.send(sock, header)
        answer, _ = protocol.recv(sock)
        return answer

    def _take_batch(self) -> list[Piece] | None:
        """The next batch from the queue (waiting for one), or None when stopping."""
        with self._cv:
            while not self._queue and not self._stopping:
                self._cv.wait(0.5)
                if self._proc is not None and self._proc.poll() is not None:
                    raise protocol.ChannelClosed("the workers exited while idle")
            if self._stopping:
                return None
            batch, longest = [], 0
            while self._queue and len(batch) < self.max_batch_inputs:
                t = max(longest, len(self._queue[0].ids))
                if batch and (len(batch) + 1) * t > self.max_batch_tokens:
                    break
                batch.append(self._queue.popleft())
                longest = t
            self.counts["batches"] += 1
            return batch

    def _deliver(self, batch: list[Piece], emb: np.ndarray, batch_id: int) -> None:
        with self._cv:
            for j, p in enumerate(batch):
                r = p.request
                if r.done.is_set():  # timed out or failed meanwhile
                    continue
                r.out[p.index] = emb[j]
                r.remaining -= 1
                if r.remaining == 0:
                    self.counts["answered"] += 1
                    if self.replan_ab:
                        self._ab_note(batch_id, time.perf_counter() - r.t_submit)
                    r.done.set()

    def _ab_copy(self) -> list[dict]:
        with self._cv:
            return [{**r, "latencies_ms": list(r["latencies_ms"])} for r in self._ab_runs]

    def _ab_note(self, batch_id: int, latency: float) -> None:
        """A request's latency under --replan-ab, in the run of batches that answered it."""
        run = batch_id // self.replan_ab
        if not self._ab_runs or self._ab_runs[-1]["run"] != run:
            self._ab_runs.append({"run": run, "monitor": run % 2 == 0, "latencies_ms": []})
            del self._ab_runs[:-AB_RUNS_KEPT]
        self._ab_runs[-1]["latencies_ms"].append(latency * 1e3)

    def _requeue(self, batch: list[Piece]) -> None:
        """The batch in flight when the workers failed: back to the head of the queue, in order;
        an input on its MAX_ATTEMPTS-th failure fails its request instead."""
        with self._cv:
            for p in reversed(batch):
                p.attempts += 1
                if p.request.done.is_set():
                    continue
                if p.attempts >= MAX_ATTEMPTS:
                    self._finish(p.request, WorkerFailed(
                        f"the workers failed {p.attempts} times while embedding input {p.index} "
                        "of this request; it was not tried again"))
                else:
                    self._queue.appendleft(p)

    def _finish(self, req: Request, error: BaseException) -> None:
        if not req.done.is_set():
            req.error = error
            self.counts["failed"] += 1
            req.done.set()

    def _drop(self, req: Request) -> None:
        """A request that gave up waiting: its queued inputs go."""
        self._queue = collections.deque(p for p in self._queue if p.request is not req)
        self._finish(req, ServiceUnavailable("timed out"))

    def _fail_all(self, error: BaseException) -> None:
        while self._queue:
            self._finish(self._queue.popleft().request, error)

    def _fail(self, message: str) -> None:
        log.error("serve: %s", message)
        with self._cv:
            self._status, self._failure = "failed", message
            self._fail_all(ServiceUnavailable(message))

    def _forward_output(self, proc: subprocess.Popen) -> None:
        """The workers' output, to our log line by line (and its tail kept for diagnosis)."""
        for line in proc.stdout:
            line = line.rstrip("\n")
            self._stderr_tail.append(line)
            if line.strip():
                log.info("workers: %s", line)

    def _end_proc(self, grace_s: float) -> int | None:
        """Wait for mpiexec to end (then stop it), and for its last words to be read."""
        p = self._proc
        if p is None:
            return None
        try:
            p.wait(grace_s)
        except subprocess.TimeoutExpired:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    p.wait(3.0)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._reader.join(5.0)  # MPICH's report of a killed rank comes as the job ends
        if self._files_before is not None and p.poll() is not None:  # what a killed rank left
            for line in jobfiles.sweep(self._files_before):
                log.info("serve: removed %s, left by the workers that ended", line)
            self._files_before = None
        return p.poll()

    def _lost_rank(self, exit_code: int | None) -> int | None:
        """The rank that was killed (a device gone, an OOM kill), if that is how the job ended:
        the first whose watch line closed. A rank that raised reports itself and aborts the job
        (exit code 1): the hosts stay."""
        killed = exit_code is not None and (exit_code < 0 or exit_code in (9, 137))
        if not killed or not self._closed:
            return None
        return min(self._closed)[1]

    def _drop_rank(self, rank: int, launch: dict) -> None:
        """Relaunch without the lost rank's host (one rank fewer on one machine)."""
        if self.entries is not None:
            where = rank_hosts(self.entries, self.n)
            host, _ = self.entries.pop(where[rank])
            self.n -= where.count(where[rank])
        else:
            host = "localhost"
            self.n -= 1
        launch["lost"] = {"rank": rank, "host": host}
        if self.n >= 1 and _fixed_for_old_world(self.worker_args):
            self.worker_args = _replan_args(self.worker_args)
        log.warning("serve: rank %d was lost (%s); %d rank(s) remain", rank,
                    launch["lost"]["host"], self.n)


class _StartFailed(Exception):
    pass


def _fixed_for_old_world(args: list[str]) -> bool:
    return any(a in ("--ratios", "--plan", "--profile") for a in args)


def _replan_args(args: list[str]) -> list[str]:
    """Drop --ratios/--plan/--profile/--strategy (made for the old world size): plan with `auto`."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        if a in ("--ratios", "--plan", "--profile", "--strategy"):
            skip = True
            continue
        out.append(a)
    return out + ["--strategy", "auto"]


def _load_tokenizer(path: Path):
    """The model's tokenizer (special tokens from its post-processor; no padding or
    truncation: the request checks decide), or None when the model has none."""
    if not path.exists():
        return None
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _shape(batch: list[Piece]) -> tuple[int, int]:
    """A batch's (inputs, longest)."""
    return len(batch), max(len(p.ids) for p in batch)
