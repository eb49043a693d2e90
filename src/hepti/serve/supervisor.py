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

A rank that hangs (stopped, a frozen board, behind a silent link) ends nothing by itself: MPI
waits for it. Every rank beats on its watch line (hepti.serve.worker's `_Heartbeat`, every
0.5 s, from a thread that runs while the rank computes or waits in MPI); a rank silent for
LATE_AFTER_S is late: /health answers 503 "degraded" naming it (rank, host, pid, seconds
silent, the batch it was in), /metrics marks it, and a request that times out names it. A rank
still silent once the phase the front end waits for (a batch, a command, the idle time between)
is past its deadline is declared lost (hepti.serve.stall: the deadline, and which ranks): it is
SIGKILLed where it runs on this machine (a stopped process too), the channel and the mpiexec job
are ended, the batch in flight goes back to the head of the queue without counting against its
inputs (a hang is not theirs), and an answer that comes after the declaration is dropped (the
batch runs again), so no accepted request is lost or answered twice. The job is relaunched
without the lost ranks' hosts, as after a kill.

A decoder's requests are generations (`generate`, `tokens`): one at a time, in arrival order,
each a batch of its own for the relaunch and the deadlines (`_generate_one`: the deadline
restarts at every token). Its tokens reach the HTTP thread as events while they are made; a
request that no longer wants them (`Generation.cancel`) is cancelled on the workers between two
tokens. One that fails before its first token runs again on the next job; after it, it fails.

On this machine alone (no hostfile), a spare job of one rank fewer is started as soon as a
job says hello (`_keep_spare`): it loads as a relaunch would and waits at its hello on its own
listener, so the relaunch after a loss takes it (`_take_spare`) and answers within a batch of
the declaration, instead of paying the imports, the kernels and the weights then (8-16 s on
this shared 2-core machine at a load of 10-16; bench/stall.py times both). A job declared lost
is torn down on a thread of its own while the next one starts. With a hostfile no spare is
kept: which device will be lost is not known ahead.

Every lost device (hung or killed) is probed in the background (hepti.serve.stall's
`probe_device`, `DeviceBench`) and re-admitted when it answers again with the re-planner's
hysteresis, make-before-break (`_start_admission`): the job with it (and with the original
--ratios/--plan once the world is whole again) is started while the job without it serves on,
its hello read on its own listener (`_preload`), and the service switches to it between two
batches (the batch in flight finishes on the old job, which is then told to stop and torn
down in the background). Stopping the serving job first left no answers for a launch's time
(bench-adapt on emu-hang3: 11 s). If the job with it never says hello (the device hangs again,
`_admit_start_s`), the serving job serves on and the device goes back to the bench. Both jobs
share the devices while the new one loads: where a device that would run both has no room
for the new job's ranks (`_no_room_for_both`: conservative, the plan not being known yet), or
its free memory is not reported (--replan off, with a hostfile), the job is stopped and
relaunched with the device as before, and the log says why.
"""
from __future__ import annotations

import collections
import functools
import json
import logging
import os
import queue
import re
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
from hepti.emulate.command import die_with_parent, find_mpiexec
from hepti.families import family
from hepti.model.sizes import model_bytes
from hepti.plan.planfile import Plan
from hepti.resources import available_memory, mem_total
from hepti.serve import ServiceUnavailable, protocol
from hepti.serve.replan import MEM_HEADROOM, PlanWatcher
from hepti.serve.stall import (ADMIT_START_FACTOR, ADMIT_START_MIN_S, END_GRACE_S, PROBE_EVERY_S,
                               RANK_RUNTIME_BYTES, SERVE_BEFORE_ADMIT_S, STALL_FLOOR_S,
                               DeviceBench, Phase, expected_batch_s, hung_ranks, kill_if_ours,
                               phase_deadline, probe_device, rank_rss)
from hepti.weights import WeightStore
from hepti.weights.decoder import load_tokenizer

log = logging.getLogger("hepti")
MAX_FAILED_STARTS = 2  # launches in a row that never said hello before the service gives up
MAX_ATTEMPTS = 2  # failures an input's batch may be part of before the input is refused
LATENCY_WINDOW = 2000  # requests whose latency /metrics' percentiles cover
REPLANS_KEPT = 500  # re-plan events /metrics lists
AB_RUNS_KEPT = 200  # --replan-ab's runs of batches /metrics lists
# A rank whose watch line has carried nothing for this long is late (/health: 503 "degraded").
# Its beats (every hepti.serve.worker.BEAT_EVERY_S = 0.5 s) come from a thread of their own
# that runs while the rank computes (nogil kernels) or waits in MPI, so only a rank that is
# stopped, starved of CPU or cut off misses six in a row: a device capped at 0.15 core still
# runs the thread every cgroup period (100 ms), and a shaped link delays a beat by its queue
# (tens of ms), not by a batch's transfers.
LATE_AFTER_S = 3.0
MAX_BEAT_BYTES = 4096  # a watch line's frame (a beat: ~80 bytes); larger is not a rank's
# The watch thread looks at the deadlines this often; a look that comes over WATCH_LAG_S after
# the one before (the front end itself was starved of CPU) decides nothing: the lines' silence
# may be its own.
STALL_CHECK_S, WATCH_LAG_S = 0.25, 1.5
PER_TOKEN_WINDOW = 20  # recent batches whose seconds per padded token a deadline scales
_READMIT = object()  # what `_take_batch` returns when a lost device is to be re-admitted
_SWITCH = object()  # ... when the job started ahead with it said hello, or never will


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
    attempts: int = 0  # failures its batch was part of (hangs not counted: `_requeue`)
    answered: bool = False  # its row was written: a second answer is counted, never written


@dataclass
class WatchLine:
    """A rank's watch line, as the front end reads it: who, and when it last heard from it."""
    rank: int
    host: str
    pid: int | None
    last: float = field(default_factory=time.monotonic)  # when anything last came (monotonic)
    in_batch: int | None = None  # the batch the rank said it was in (None: between batches)
    closed: bool = False
    closed_at: float | None = None  # when it closed (monotonic): the first names a killed rank
    garbled: bool = False  # it sent something that is not frames: only its liveness is read
    buf: bytes = b""

    def hear(self, data: bytes) -> None:
        """Bytes off the line: any of them is a sign of life; beats also say the batch."""
        self.last = time.monotonic()
        if self.garbled:
            return
        try:
            frames, self.buf = protocol.split_frames(self.buf + data, MAX_BEAT_BYTES)
        except (ValueError, TypeError) as e:
            log.warning("serve: rank %d's watch line sent something unexpected (%s); only "
                        "whether it is silent is read from now on", self.rank, e)
            self.garbled, self.buf = True, b""
            return
        for head in frames:
            if head.get("op") == "beat":
                batch = head.get("batch")
                self.in_batch = batch if isinstance(batch, int) else None


@dataclass
class Generation(Request):
    """A decoder's generation request (`Supervisor.generate`): its prompt is its one input;
    the tokens come as events, ("token", id) each, then ("done", finish reason) or ("error",
    exception), read by `Supervisor.tokens`. `cancel` set: the client no longer wants it (it
    went away, or a stop string was reached); the workers are told between two tokens."""
    sampling: dict = field(default_factory=dict)  # max_tokens, temperature, top_p, seed
    events: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    sent: int = 0  # tokens delivered: a generation that failed after some is not run again


class WorkerFailed(ServiceUnavailable):
    """An input that was in flight when the workers failed MAX_ATTEMPTS times."""


@dataclass
class _Job:
    """One mpiexec job of workers, from its start on: its process, the thread that forwards its
    output, and the listening socket its ranks connect to (a job of its own each, so that a
    spare's lines and hello wait in their own backlog while another job serves)."""
    proc: subprocess.Popen
    reader: threading.Thread
    listener: socket.socket
    n: int
    args: list[str]
    started_at: float  # time.time()
    files_before: jobfiles.Snapshot | None  # what existed before it started (`jobfiles.sweep`)
    tail: collections.deque  # its output's last lines
    spare: bool = False  # started ahead, for the world one rank smaller (`Supervisor._keep_spare`)
    hosts: list | None = None  # each rank's host (None on this machine alone)
    # a job started ahead with lost devices back in it (`Supervisor._start_admission`): the
    # devices (hepti.serve.stall.Benched), its watch lines and hello once read (`_preload`),
    # when the hello came (time.time()), or why it never will
    admits: list = field(default_factory=list)
    lines: list = field(default_factory=list)  # [(WatchLine, socket)]
    hello: tuple | None = None  # (channel socket, hello header)
    hello_at: float | None = None
    failed: str | None = None
    cancelled: bool = False


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
                 replan_ab: int | None = None, stall_floor_s: float = STALL_FLOOR_S,
                 spare: bool = True):
        self.model_dir = Path(model_dir)
        cfg = WeightStore(self.model_dir).config
        self.config = cfg
        self.name = cfg.name or self.model_dir.name
        self.hidden_size = cfg.hidden_size
        self.max_tokens = cfg.max_position_embeddings
        self.vocab_size = cfg.vocab_size
        self.tokenizer = _load_tokenizer(self.model_dir / "tokenizer.json")
        # a decoder generates, one request at a time (hepti.serve.generation); its chat
        # template and end-of-sequence tokens are in tokenizer_config.json
        self.decoder = family(cfg).executor == "decoder"
        self.chat_meta = load_tokenizer(self.model_dir)[1] if self.decoder else {}
        if self.decoder:
            max_batch_inputs = 1
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
        # the world as asked for: lost devices come back to it (`_readmit`), and a fixed
        # --ratios/--plan made for it applies again once it is whole
        self._first_entries = list(self.entries) if self.entries is not None else None
        self._first_n, self._first_args = n, list(self.worker_args)
        self._profile: tuple[dict | None, list | None] = (None, None)  # the serving job's, its hosts
        # hung ranks (hepti.serve.stall): the deadline's floor (0: never declared lost), what
        # the front end waits for now, and the declaration once made (until the relaunch)
        self.stall_floor_s = stall_floor_s
        self._phase: Phase | None = None
        self._stall: dict | None = None
        self._channel: socket.socket | None = None
        self._first_batch = True  # the next batch is its launch's first (a slow phase)
        self._overdue_said: tuple | None = None  # the phase "past its deadline" was logged for
        self._per_token: collections.deque[float] = collections.deque(maxlen=PER_TOKEN_WINDOW)
        # lost devices, probed until they answer again; those to re-admit between two batches,
        # and those the current launch took back (lost again if it never says hello)
        self.bench = DeviceBench()
        self._bench_lock = threading.Lock()
        self._admit: list[str] = []
        self._admitting: list[tuple[str, int]] = []  # (host, ranks)
        # make-before-break: the job with the confirmed devices back, started while this one
        # serves (`_start_admission`); the one that said hello, to switch to (`_serve` -> `_life`);
        # devices taken off the bench for a job that will not be taken, for the next launch
        self._incoming: _Job | None = None
        self._switching: _Job | None = None
        self._carry: list = []
        self._cv = threading.Condition()
        self._queue: collections.deque[Piece] = collections.deque()
        self._status, self._failure = "starting", ""
        self._stopping = False
        self._job: _Job | None = None  # the job serving, or starting to
        # a job started ahead for the world one rank smaller, parked before its hello until a
        # rank is lost (`_keep_spare`); with `spare` False, or with ranks on other hosts, none
        self.spare_enabled = spare
        self._spare_job: _Job | None = None
        self._spare_lock = threading.Lock()
        # our pid in its name: `hepti emulate --cleanup` removes it if we are killed (jobfiles)
        self._tmp = tempfile.TemporaryDirectory(prefix=jobfiles.serve_dir_prefix())
        self._token = secrets.token_hex(16)
        self._thread = threading.Thread(target=self._life, name="hepti-serve-workers", daemon=True)
        self._watch = selectors.DefaultSelector()  # each rank's watch line (hepti.serve.worker)
        self._lines: dict[int, WatchLine] = {}  # the current launch's, by rank
        self._ready_at = time.monotonic()  # when the current launch said hello
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
        threading.Thread(target=self._probe_lost, name="hepti-serve-probe", daemon=True).start()
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
            late = self.late_ranks()
            why = f"workers {self._status}" if not late else _late_text(late)
            # the HTTP answer adds "retry later"
            raise ServiceUnavailable(f"no answer within {self.request_timeout_s:g} s ({why})")
        if req.error is not None:
            raise req.error
        self._latencies.append(time.perf_counter() - req.t_submit)
        return req.out

    def generate(self, ids: list[int], sampling: dict) -> Generation:
        """Queue a generation (a decoder's; requests run one at a time, in arrival order);
        read its tokens with `tokens`."""
        req = Generation([np.asarray(ids, np.int64)], np.empty(0), remaining=1,
                         sampling=dict(sampling))
        with self._cv:
            if self._status == "failed":
                raise ServiceUnavailable(self._failure)
            self.counts["accepted"] += 1
            self._queue.append(Piece(req, 0, req.inputs[0]))
            self._cv.notify_all()
        return req

    def tokens(self, req: Generation):
        """A queued generation's events as they come: ("token", id) ..., then ("done",
        finish reason). ServiceUnavailable when none comes within the request timeout (the
        generation is then cancelled) or the workers failed it."""
        while True:
            try:
                kind, value = req.events.get(timeout=self.request_timeout_s)
            except queue.Empty:
                req.cancel.set()
                with self._cv:
                    self._drop(req)
                late = self.late_ranks()
                why = f"workers {self._status}" if not late else _late_text(late)
                raise ServiceUnavailable(f"no token within {self.request_timeout_s:g} s "
                                         f"({why})") from None
            if kind == "error":
                raise value
            yield kind, value
            if kind == "done":
                self._latencies.append(time.perf_counter() - req.t_submit)
                return

    def health(self) -> dict:
        """"ok", or why not: "starting", "relaunching", "failed", "stopping", or "degraded"
        (the workers are up, but a rank is late: `late` names it, `message` says it)."""
        late = self.late_ranks()
        out = {"status": "degraded" if late else self._status, "model": self.name,
               "plan_epoch": self.epoch, "world_size": len(self.ranks) or None,
               "queued": len(self._queue), "late": late,
               "lost": [d["host"] for d in self.lost_devices()]}
        if late:
            out["message"] = _late_text(late) + "; requests wait for it"
        return out

    def heartbeats(self) -> dict[int, dict]:
        """Each rank of the serving job (by rank): how long its watch line has been silent,
        the batch it was in when last heard, and whether that makes it late. Empty while no
        job is serving (starting, relaunching)."""
        if self._status != "ok":
            return {}
        now, lines, out = time.monotonic(), self._lines, {}
        for r in self.ranks:
            line = lines.get(r["rank"])  # every rank's line comes before the hello; else
            silent = now - (line.last if line else self._ready_at)  # silent since it
            out[r["rank"]] = {"rank": r["rank"], "host": r.get("host"), "pid": r.get("pid"),
                              "silent_s": round(silent, 2),
                              "in_batch": line.in_batch if line else None,
                              "line": "missing" if line is None else
                              "closed" if line.closed else "open",
                              "late": silent >= LATE_AFTER_S}
        return out

    def lost_devices(self) -> list[dict]:
        """The devices declared lost and not yet re-admitted, with what their probes said."""
        with self._bench_lock:
            return self.bench.snapshot()

    def late_ranks(self) -> list[dict]:
        """The serving job's ranks silent for LATE_AFTER_S or more (`heartbeats`)."""
        return [{k: v for k, v in b.items() if k != "late"}
                for b in self.heartbeats().values() if b["late"]]

    def metrics(self) -> dict:
        lat = sorted(self._latencies)

        def pct(p):
            return lat[min(len(lat) - 1, int(p / 100 * len(lat)))] * 1e3 if lat else None
        per_rank = []
        predicted = (self.plan or {}).get("predicted", {}).get("per_rank", [])
        beats = self.heartbeats()
        for r in self.ranks:
            k = r["rank"]
            beat = beats.get(k, {})
            per_rank.append({**r, "shares": {d: v[k] for d, v in (self.plan or {}).get("ratios", {}).items()},
                             "predicted": predicted[k] if k < len(predicted) else None,
                             # its watch line: seconds silent, the batch it was in, late or not
                             **{f: beat.get(f) for f in ("silent_s", "in_batch", "line", "late")}})
        late = [b["rank"] for b in beats.values() if b["late"]]
        return {
            "status": "degraded" if late else self._status, "model": self.name,
            "plan_epoch": self.epoch, "late_after_s": LATE_AFTER_S, "late": late,
            "plan": None if self.plan is None else {
                k: self.plan.get(k) for k in ("strategy", "ratios", "primary", "layers", "group",
                                              "predicted_latency_s", "explanation")},
            "ranks": per_rank,
            "requests": {"accepted": self.counts["accepted"], "answered": self.counts["answered"],
                         "failed": self.counts["failed"], "queued_inputs": len(self._queue),
                         # an input answered a second time (never written): 0 unless a bug
                         "inputs_answered": self.counts["inputs_answered"],
                         "duplicates": self.counts["duplicates"],
                         # generations stopped early: a client went away, a stop string came
                         "cancelled": self.counts["cancelled"]},
            "latency_ms": {"count": len(lat), "p50": pct(50), "p90": pct(90), "p99": pct(99)},
            "batches": {"count": self.counts["batches"],
                        "wall_ms_p50": statistics.median(self._batch_walls) * 1e3 if self._batch_walls else None},
            "launches": self.launches,
            # hung ranks: the deadline now, and the devices lost and probed (hepti.serve.stall)
            "stall": {"floor_s": self.stall_floor_s, "phase": self._phase_now(),
                      "lost_devices": self.lost_devices()},
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
        self._discard_spare()
        with self._cv:
            ahead, self._incoming = self._incoming, None
        if ahead is not None:
            ahead.cancelled = True
            self._end_job(ahead, 3.0)
        if self._job is not None:
            self._end_job(self._job, grace_s=3.0)
        with self._cv:
            self._fail_all(ServiceUnavailable("the service is shutting down"))
        self._tmp.cleanup()

    @property
    def _proc(self) -> subprocess.Popen | None:
        """The serving (or starting) job's mpiexec."""
        return self._job.proc if self._job is not None else None

    # --- the workers' life ---------------------------------------------------------------------
    def _listen(self, entries: list[tuple[str, int]] | None) -> socket.socket:
        host = "127.0.0.1"
        if entries:
            host = route_address(entries[0][0])
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        s.listen(64)  # every rank's watch line, then rank 0's channel
        s.settimeout(0.5)
        return s

    def _command(self, n: int, entries: list[tuple[str, int]] | None, args: list[str],
                 tag: str) -> list[str]:
        cmd = [find_mpiexec(), "-n", str(n)]
        if entries is not None:
            path = Path(self._tmp.name) / f"hostfile-{tag}"
            path.write_text("".join(f"{h}:{s}\n" for h, s in entries))
            cmd += ["-f", str(path)]
        return cmd + [sys.executable, "-m", "hepti.serve.worker", "--model", str(self.model_dir),
                      *args]

    def _start_job(self, n: int, entries: list[tuple[str, int]] | None, args: list[str],
                   spare: bool = False, admit: bool = False) -> _Job:
        """Start mpiexec: its ranks load, plan, connect to the job's own listener and say hello
        there (`_await_hello` reads it, now or, for a spare, when it is taken; `_preload`, for
        a job started ahead with lost devices back in it, `admit`)."""
        listener = self._listen(entries)
        env = dict(os.environ)
        env[protocol.CONTROL_ENV] = "%s:%d" % listener.getsockname()
        env[protocol.TOKEN_ENV] = self._token
        tag = "-spare" if spare else "-admit" if admit else ""
        hosts = [entries[i][0] for i in rank_hosts(entries, n)] if entries is not None else None
        cmd = self._command(n, entries, args + self._known_profile(n, hosts, args),
                            f"{len(self.launches)}{tag}")
        log.info("serve: starting %s%d worker rank(s): %s", "a spare job of " if spare else
                 "ahead, while the job serves on, " if admit else "", n, " ".join(cmd))
        files_before = jobfiles.snapshot()
        started_at = time.time()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, errors="replace",
                                start_new_session=True,  # our own group: killpg
                                preexec_fn=functools.partial(die_with_parent, signal.SIGTERM))
        tail: collections.deque[str] = collections.deque(maxlen=60)
        reader = threading.Thread(target=self._forward_output,
                                  args=(proc, tail, "workers (spare)" if spare else
                                        "workers (admitting)" if admit else "workers"),
                                  daemon=True)
        reader.start()
        return _Job(proc, reader, listener, n, list(args), started_at, files_before, tail, spare,
                    hosts=hosts)

    def _known_profile(self, n: int, hosts: list | None, args: list[str]) -> list[str]:
        """`--profile FILE` for a job on devices the serving job's profile already covers (a
        loss, or a spare: the same devices less some), else nothing. Without it a job on a
        world whose profile is not cached measures one first: the relaunch after node-b's link
        went silent in bench-adapt --spec emu-silent3.json (at 18ff887) loaded for 19.2 s, 17 of
        them profiling [node-a, node-c], and the first answer came 24 s after the link went
        quiet (6.5 s after the same device hung, whose smaller world happened to be cached).
        A device's figures do not depend on which others run beside it (the star network:
        each device's own link), so the serving profile's rows for these devices are theirs."""
        prof, had = self._profile
        if prof is None or "--profile" in args or n >= len(prof["devices"]):
            return []
        if hosts is None:  # this machine alone: its rank slots are alike
            keep = list(range(n))
        else:
            if had is None:
                return []
            pool = list(enumerate(had))
            keep = []
            for h in hosts:  # each rank: a rank of the profiled world on the same host
                i = next((k for k, (r, x) in enumerate(pool) if x == h), None)
                if i is None:
                    return []
                keep.append(pool.pop(i)[0])
        sub = dict(prof, devices=[dict(prof["devices"][r], rank=i) for i, r in enumerate(keep)])
        path = Path(self._tmp.name) / f"profile-{'-'.join(map(str, keep))}.json"
        path.write_text(json.dumps(sub))
        log.info("serve: the new job plans on the serving profile's figures for its %d "
                 "device(s) (%s), not a new measurement", n, path.name)
        return ["--profile", str(path)]

    def _life(self) -> None:
        self._ahead: _Job | None = None  # started ahead with devices back, said hello: next
        try:
            self._relaunch_loop()
        finally:
            if self._ahead is not None:  # stopped between the switch and its launch
                self._end_ahead(self._ahead)

    def _relaunch_loop(self) -> None:
        failed_starts = 0
        while not self._stopping:
            ahead = self._ahead
            launch = {"epoch": self.epoch + 1, "n": self.n, "started_at": time.time(),
                      "hosts": None if self.entries is None else [h for h, _ in self.entries]}
            if self._admitting:
                launch["readmitting"] = [h for h, _ in self._admitting]
            if ahead is not None:  # make-before-break: started while the job before served
                launch.update(readmitting=[d.host for d in ahead.admits], make_before_break=True,
                              switched_at=launch["started_at"], started_at=ahead.started_at)
            self.launches.append(launch)
            reason, relost, job, switched = "the workers ended", False, None, None
            try:
                job = ahead or self._take_spare() or \
                    self._start_job(self.n, self.entries, self.worker_args)
                self._ahead = None
                self._job, self._stderr_tail = job, job.tail
                if job.spare:  # started ahead while the job before served
                    launch.update(spare=True, taken_at=launch["started_at"],
                                  started_at=job.started_at)
                sock = self._await_hello(job, self._admit_start_s() if self._admitting else None)
                if sock is None:
                    reason = "stopped before the workers started"
                    break
                failed_starts = 0
                self._admitting = []
                self._keep_spare()
                reason = self._serve(sock)
                switched, self._switching = self._switching, None
            except _StartFailed as e:
                reason = str(e)
                if self._admitting:  # the device taken back is not fit yet: lost again
                    launch["end"], relost = reason, True
                    self._relose(launch)
                else:
                    failed_starts += 1
            except OSError as e:  # the channel closed (protocol.ChannelClosed), or broke mid-send
                reason = f"the channel closed ({e})"
            finally:
                launch["ended_at"] = time.time()
                launch.setdefault("end", reason)
                if job is not None and (self._stall is not None or switched is not None) \
                        and not self._stopping:
                    # declared lost: the ranks to drop are known, and the job's end tells
                    # nothing more, so the next job starts while this one is torn down; or
                    # told to stop for the job started ahead, which serves from now on
                    threading.Thread(target=self._end_job, args=(job, END_GRACE_S, launch),
                                     name="hepti-serve-teardown", daemon=True).start()
                elif job is not None:
                    self._end_job(job, 5.0, launch)
                with self._cv:
                    self._phase, self._channel = None, None
            if self._stopping:
                if switched is not None:
                    self._end_ahead(switched)
                break
            if switched is not None:  # its world from now on; it said hello already
                self._apply_admit(switched.admits, started=True)
                self._ahead = switched
                log.warning("serve: %s; %d rank(s) serving", reason, self.n)
                continue
            self._cancel_incoming()  # made for a world that is changing now
            stall, self._stall = self._stall, None
            if stall is not None:
                reason = (f"rank(s) {', '.join(stall['silent_s'])} silent in "
                          f"{_phase_text(Phase(stall['phase'], 0.0, 0.0, stall['batch']))} "
                          f"past its {stall['deadline_s']:g} s deadline")
                if stall["ranks"]:
                    self._drop_ranks(stall["ranks"], launch, "silent past its deadline")
                # last: /metrics, read on another thread, never shows a stall without its
                # lost ranks
                launch["stall"] = stall
            elif not relost:
                lost = self._lost_rank(launch.get("exit_code"), job.tail if job else ())
                if lost is not None:
                    self._drop_ranks([lost], launch, "killed")
            with self._cv:
                admit, self._admit = self._admit, []
            carry, self._carry = self._carry, []
            if admit or carry:  # devices that answer again join the next launch
                self._apply_admit(carry + self._bench_admit(admit))
            if self.n < 1 or failed_starts >= MAX_FAILED_STARTS:
                self._discard_spare()
                tail = "\n".join(list(self._stderr_tail)[-15:])
                self._fail(f"the workers could not be started ({reason}); their last words:\n{tail}")
                return
            with self._cv:
                self._status = "relaunching"
            log.warning("serve: %s; relaunching on %d rank(s)", reason, self.n)

    def _await_hello(self, job: _Job, start_timeout_s: float | None = None) -> socket.socket | None:
        """Wait for the job's ranks' watch lines and rank 0's hello (within start_timeout_s of
        now, else the service's start timeout from the job's start); the connected channel. A
        job started ahead with devices back in it has said hello already (`_preload`): its
        lines and channel are taken as they are."""
        self.watcher = None  # the next hello brings the new job's plan and profile
        mine = {id(line) for line, _ in job.lines}
        for key in list(self._watch.get_map().values()):  # the last launch's lines
            if id(key.data) in mine:
                continue
            try:
                self._watch.unregister(key.fileobj)
            except (KeyError, ValueError):  # closed by _watch_ranks meanwhile
                continue
            key.fileobj.close()
        if job.hello is not None:
            self._lines = {line.rank: line for line, _ in job.lines}
            sock, hello = job.hello
        else:
            self._lines = {}
            deadline = time.monotonic() + start_timeout_s if start_timeout_s else \
                job.started_at - time.time() + time.monotonic() + self.start_timeout_s
            got = self._accept_hello(job, deadline, start_timeout_s or self.start_timeout_s,
                                     self._register_line, lambda: self._stopping)
            if got is None:
                return None
            sock, hello = got
        with self._cv:
            self.epoch += 1
            self.plan, self.ranks = hello["plan"], hello["ranks"]
            self._ready_at = time.monotonic()
            self._status = "ok"
            self._channel, self._first_batch = sock, True
            self._per_token.clear()  # another world: other seconds per token
            self._set_phase("idle")
        if hello.get("profile"):  # what a smaller world can plan on (`_known_profile`)
            self._profile = (hello["profile"], job.hosts)
        if self.replan and hello.get("profile"):
            self.watcher = PlanWatcher(self, hello["profile"])
        launch = self.launches[-1]
        launch.update(ready_s=(job.hello_at or time.time()) - launch["started_at"],
                      strategy=self.plan["strategy"], ratios=self.plan.get("ratios"))
        # where a launch's time goes: mpiexec, Python and the imports, then the load (weights,
        # kernels, plan: the worker's load_s), then the connections; a spare's all ahead
        log.info("serve: ready (plan epoch %d: %s on %d rank(s); %.1f s from mpiexec to "
                 "hello: %.1f s to load, the rest to start and import%s)", self.epoch,
                 self.plan["strategy"], hello["world_size"], launch["ready_s"],
                 hello["load_s"], "; a spare, taken %.2f s ago"
                 % (launch["started_at"] + launch["ready_s"] - launch["taken_at"]) if job.spare
                 else "; started ahead, switched to between two batches" if job.hello_at
                 else "")
        return sock

    def _register_line(self, line: WatchLine, sock: socket.socket) -> None:
        """A rank's watch line of the job starting now: watched (`_watch_ranks`), and judged."""
        self._lines[line.rank] = line
        self._watch.register(sock, selectors.EVENT_READ, line)

    def _accept_hello(self, job: _Job, deadline: float, start_timeout_s: float, on_line,
                      cancelled) -> tuple[socket.socket, dict] | None:
        """Accept the job's connections on its listener until rank 0's hello: each rank's watch
        line to `on_line(line, socket)`, then (channel, hello). None once `cancelled()`;
        _StartFailed when the job exits or `deadline` (monotonic) passes first."""
        while not cancelled():
            if job.proc.poll() is not None:
                raise _StartFailed(f"the workers exited ({job.proc.returncode}) before they were ready")
            if time.monotonic() > deadline:
                raise _StartFailed(f"the workers were not ready within {start_timeout_s:g} s")
            try:
                sock, _ = job.listener.accept()
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
                on_line(WatchLine(int(hello["rank"]), str(hello.get("host", "")),
                                  hello.get("pid")), sock)
                continue
            sock.settimeout(None)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock, hello
        return None

    # --- the spare job -------------------------------------------------------------------------
    def _spare_target(self) -> tuple[int, list[str]] | None:
        """The job a spare is started for: this world one rank smaller, with the worker args a
        loss would give it (`_drop_ranks`); None when no spare is kept: turned off, stall
        handling off, a single rank, or ranks on hosts of a hostfile (which device will be
        lost is not known ahead, and a spare per device would hold the weights n times)."""
        if not self.spare_enabled or self.stall_floor_s <= 0 or self.entries is not None \
                or self.n < 2:
            return None
        args = self.worker_args
        if _fixed_for_old_world(args):
            args = _replan_args(args)
        return self.n - 1, list(args)

    def _keep_spare(self) -> None:
        """After a job says hello: keep a spare that fits the world one rank smaller, or start
        one. Why a spare: a relaunch after a hang costs 3-12 s on this shared 2-core machine
        (Python, numba and mpi4py imports, kernels from Numba's cache, weights: 1.5 s of CPU
        that a load average of 10-16 stretches; `python -m hepti.bench.stall --stages 5`), on
        top of the 4 s detection, and the issue asks for the first answer within 10 s of the
        stop: without a spare 3 of 5 stops made it (median 8.1 s), with one 5 of 5 (4.1-4.4 s).
        Neither a lighter start nor starting at the declaration with the teardown alongside
        (done: `_life`) can hold that: the CPU itself is what the load takes. A spare has paid all of it ahead and waits at its
        hello (rank 0 in a socket read, the others asleep in bcast_idle: no CPU), so taking it
        costs what its first batch does. Its price: one more copy of the weights and kernels
        per rank of the smaller world, for as long as the service runs."""
        target = self._spare_target()
        with self._spare_lock:
            old = self._spare_job
            if old is not None and target is not None and old.proc.poll() is None \
                    and (old.n, old.args) == target:
                return
            self._spare_job = None
        if old is not None:
            self._end_spare(old)
        if target is None or self._stopping:
            return
        try:
            job = self._start_job(target[0], None, target[1], spare=True)
        except OSError as e:  # a spare is an optimisation: serve on without one
            log.warning("serve: could not start a spare job (%s); a relaunch will start afresh", e)
            return
        with self._spare_lock:
            self._spare_job = job

    def _take_spare(self) -> _Job | None:
        """The spare, if it fits the world the next launch is for (else it is ended)."""
        with self._spare_lock:
            job, self._spare_job = self._spare_job, None
        if job is None:
            return None
        alive = job.proc.poll() is None
        if alive and self.entries is None and (job.n, job.args) == (self.n, self.worker_args):
            log.info("serve: taking the spare job of %d rank(s), started %.1f s ago", job.n,
                     time.time() - job.started_at)
            return job
        if alive and (job.n, job.args) == self._spare_target():  # a relaunch on the same
            with self._spare_lock:  # world (every rank was silent): it stays the spare
                self._spare_job = job
            return None
        self._end_spare(job)
        return None

    def _discard_spare(self) -> None:
        with self._spare_lock:
            job, self._spare_job = self._spare_job, None
        if job is not None:
            self._end_spare(job, wait=True)

    def _end_spare(self, job: _Job, wait: bool = False) -> None:
        """Stop a spare that will not serve (its own process group), off this thread unless
        `wait`."""
        try:
            os.killpg(job.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if wait:
            self._end_job(job, 3.0)
        else:
            threading.Thread(target=self._end_job, args=(job, 3.0), daemon=True,
                             name="hepti-serve-spare-end").start()

    def _watch_ranks(self) -> None:
        """Read each rank's beats off its watch line (`WatchLine.hear`), and note when each
        line closes: a killed rank's first, then the others' as mpiexec ends them (MPICH's own
        report names whichever of them it saw first). Between reads, declare lost the ranks
        silent past the current phase's deadline (`_check_stall`)."""
        checked = time.monotonic()
        while True:
            now = time.monotonic()
            if now - checked >= STALL_CHECK_S:
                # a look long after the last one: this thread was starved, and the lines may
                # hold beats it has not read yet; they are read first, and the next look decides
                if now - checked < WATCH_LAG_S:
                    try:
                        self._check_stall(now)
                    except Exception:  # noqa: BLE001 - the watch must go on; logged
                        log.exception("serve: checking the ranks' deadlines failed")
                checked = now
            for key, _ in self._watch.select(timeout=STALL_CHECK_S):
                line: WatchLine = key.data
                try:
                    data = key.fileobj.recv(MAX_BEAT_BYTES)
                except OSError:
                    data = b""
                if data:
                    line.hear(data)
                    continue
                line.closed, line.closed_at = True, time.monotonic()
                try:
                    self._watch.unregister(key.fileobj)
                except (KeyError, ValueError):  # a new launch cleared it
                    continue
                key.fileobj.close()

    # --- hung ranks (hepti.serve.stall) --------------------------------------------------------
    def _set_phase(self, kind: str, batch: list[Piece] | None = None,
                   batch_id: int | None = None) -> None:
        """What the front end waits for from now on, and its deadline (under self._cv)."""
        slow = kind not in ("idle", "batch") or (kind == "batch" and self._first_batch)
        expected = None
        if batch is not None:
            p = self.plan or {}
            per_token = statistics.median(self._per_token) if self._per_token else None
            expected = expected_batch_s(_shape(batch), p.get("predicted_latency_s"),
                                        (p.get("batch"), p.get("seq_len")), per_token)
        elif kind == "idle":
            expected = 0.0  # between batches: nothing to wait for but the floor
        self._phase = Phase(kind, time.monotonic(),
                            phase_deadline(expected, self.stall_floor_s, slow), batch_id)

    def _phase_now(self) -> dict | None:
        ph = self._phase
        if ph is None:
            return None
        return {"kind": ph.kind, "batch": ph.batch, "deadline_s": round(ph.deadline_s, 2),
                "elapsed_s": round(time.monotonic() - ph.since, 2)}

    def _check_stall(self, now: float) -> None:
        """Declare lost the ranks silent for LATE_AFTER_S once the current phase is past its
        deadline (hepti.serve.stall.hung_ranks), or say once that a phase is overdue while
        every rank beats (a slow batch: it is waited for)."""
        if self.stall_floor_s <= 0 or self._stall is not None or self._status != "ok":
            return
        ph, lines = self._phase, self._lines
        if ph is None or now - ph.since < ph.deadline_s:
            return
        # a rank whose line closed has ended (killed, or told to stop), not hung: the job's end
        # tells about it (`_lost_rank`); a line that never came is silent since the hello
        silent = {r["rank"]: now - (lines[r["rank"]].last if r["rank"] in lines else self._ready_at)
                  for r in self.ranks if not (r["rank"] in lines and lines[r["rank"]].closed)}
        ranks, how = hung_ranks(silent, LATE_AFTER_S)
        if how == "none":  # idle past the floor is no news; a slow batch is, once
            if ph.kind != "idle" and self._overdue_said != (ph.kind, ph.since):
                self._overdue_said = (ph.kind, ph.since)
                log.warning("serve: %s is past its deadline (%.1f s) but every rank beats: "
                            "waiting for it", _phase_text(ph), ph.deadline_s)
            return
        victims = ranks if how == "some" else sorted(silent)
        proc = self._proc  # this job's mpiexec (the next launch's is never ended from here)
        with self._cv:
            if self._phase is not ph or self._stall is not None:  # it ended meanwhile
                return
            stall = {"at": time.time(), "phase": ph.kind, "batch": ph.batch,
                     "deadline_s": round(ph.deadline_s, 2), "elapsed_s": round(now - ph.since, 2),
                     "silent_s": {str(r): round(silent[r], 2) for r in victims},
                     "ranks": ranks, "all_silent": how == "all"}
            self._stall = stall
            self._cv.notify_all()  # `_take_batch` may be waiting
        by_rank = {r["rank"]: r for r in self.ranks}
        who = ", ".join(f"rank {r} on {by_rank[r].get('host')} (pid {by_rank[r].get('pid')}, "
                        f"silent {silent[r]:.1f} s)" for r in victims)
        if how == "all":
            log.warning("serve: every rank is silent in %s past its deadline (%.1f s): %s; "
                        "ending the job and relaunching on the same hosts (nothing tells a hung "
                        "device from a stall on this side)", _phase_text(ph), ph.deadline_s, who)
        else:
            log.warning("serve: %s is past its deadline (%.1f s) and %s stopped beating: "
                        "declared lost", _phase_text(ph), ph.deadline_s, who)
        self._end_hung(stall, [by_rank[r] for r in victims], proc)

    def _end_hung(self, stall: dict, victims: list[dict], proc: subprocess.Popen | None) -> None:
        """SIGKILL each hung rank that runs on this machine, then end the channel (rank 0's
        answer can no longer come: `_serve` sees it closed) and, if a hung rank is out of
        reach (another host), the mpiexec job, whose end makes the others exit."""
        out_of_reach = [r for r in victims if not kill_if_ours(r.get("pid"), self._token)]
        stall["killed"] = [r["rank"] for r in victims if r not in out_of_reach]
        sock = self._channel
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if out_of_reach and proc is not None and proc.poll() is None:
            log.warning("serve: rank(s) %s cannot be signalled from here; ending the mpiexec "
                        "job", ", ".join(str(r["rank"]) for r in out_of_reach))
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def _drop_ranks(self, ranks: list[int], launch: dict, why: str) -> None:
        """Relaunch without the lost ranks' hosts (on one machine, that many ranks fewer); each
        host goes on the bench, probed until it answers again (`_probe_lost`)."""
        lost: dict[str, int] = {}  # host -> ranks it ran
        if self.entries is not None:
            where = rank_hosts(self.entries, self.n)
            host_of = {r: self.entries[where[r]][0] for r in ranks}
            for i in sorted({where[r] for r in ranks}, reverse=True):
                host, _ = self.entries.pop(i)
                lost[host] = where.count(i)
        else:
            host_of = {r: "localhost" for r in ranks}
            lost["localhost"] = len(ranks)
        self.n -= sum(lost.values())
        now = time.monotonic()
        with self._bench_lock:
            for host, count in lost.items():
                self.bench.lose(host, count, why, now)
        first = min(ranks)
        launch["lost"] = {"rank": first, "host": host_of[first]}
        if len(ranks) > 1:
            launch["lost_ranks"] = {str(r): host_of[r] for r in sorted(ranks)}
        if self.n >= 1 and _fixed_for_old_world(self.worker_args):
            self.worker_args = _replan_args(self.worker_args)
        log.warning("serve: rank(s) %s lost (%s; %s); %d rank(s) remain; probing every %g s "
                    "until it answers again", ", ".join(map(str, sorted(ranks))), why,
                    ", ".join(lost), self.n, PROBE_EVERY_S)

    def _probe_lost(self) -> None:
        """The background prober: each lost device every PROBE_EVERY_S (hepti.serve.stall's
        `probe_device`); those the bench finds ready are re-admitted between two batches. A
        device that never answers costs a probe per period and nothing in the log."""
        while not self._stopping:
            time.sleep(0.5)
            with self._bench_lock:
                due = self.bench.due(time.monotonic())
            for d in due:
                answered = probe_device(None if d.host == "localhost" and self.entries is None
                                        else d.host)
                with self._bench_lock:
                    self.bench.record(d.host, answered, time.monotonic())
                if answered and d.answers == 1:
                    log.info("serve: lost device %s answers again; re-admitted once it is "
                             "confirmed", d.host)
            # under the bench's lock, so that a device `_readmit` took back meanwhile is not
            # asked for again (the lock order: the bench's, then self._cv; never the reverse)
            with self._bench_lock:
                ready = [d.host for d in self.bench.ready(time.monotonic())]
                if ready:
                    with self._cv:
                        new = [h for h in ready if h not in self._admit]
                        if new and self._status != "failed":
                            self._admit.extend(new)
                            self._cv.notify_all()

    def _readmit(self, hosts: list[str]) -> None:
        """Take the devices back in the next launch (stop-and-relaunch: `_life`)."""
        self._apply_admit(self._bench_admit(hosts))

    def _bench_admit(self, hosts: list[str]) -> list:
        """The devices off the bench (their re-admission noted, for flapping): their Benched."""
        now = time.monotonic()
        with self._bench_lock:
            back = [d for d in (self.bench.admit(h, now) for h in hosts) if d is not None]
            with self._cv:  # asked for again by the prober meanwhile: no longer to do
                self._admit = [h for h in self._admit if h not in {d.host for d in back}]
        return back

    def _world_with(self, back: list) -> tuple[list[tuple[str, int]] | None, int, list[str]]:
        """The world with these devices back: their hosts return to the host list in their
        first order (on one machine, their ranks to -n), and the original --ratios/--plan
        applies again once the world is whole. (entries, n, worker args)"""
        entries = self.entries
        if entries is not None:
            keep = {h for h, _ in entries} | {d.host for d in back}
            entries = [e for e in self._first_entries if e[0] in keep]
        n = self.n + sum(d.ranks for d in back)
        args = self.worker_args
        if n == self._first_n and (entries is None or len(entries) == len(self._first_entries)):
            args = list(self._first_args)
        return entries, n, args

    def _apply_admit(self, back: list, started: bool = False) -> None:
        """The world is the one with these devices back from the next launch on; unless that
        launch `started` already (make-before-break), it must say hello in `_admit_start_s` or
        they are lost again (`_relose`)."""
        if not back:
            return
        self.entries, self.n, self.worker_args = self._world_with(back)
        self._admitting = [] if started else [(d.host, d.ranks) for d in back]
        if not started:
            log.warning("serve: re-admitting %s (it answered %d probes in a row); relaunching "
                        "on %d rank(s)", ", ".join(d.host for d in back),
                        max(d.answers for d in back), self.n)

    # --- make-before-break re-admission --------------------------------------------------------
    def _start_admission(self) -> bool:
        """Between two batches, the confirmed devices are due: start the job with them back
        (`_start_job`, its own listener, as a spare) while this one serves on, and read its
        hello in the background (`_preload`); `_serve` switches to it between two batches once
        it has said hello (`_SWITCH`). Why: stopping the serving job first left no answers for
        a whole launch (emu-hang3: 11 s). False when it cannot start ahead (no room on a device
        that would run both jobs: `_no_room_for_both`; or the start itself failed): the job is
        then stopped and relaunched with them, as before, and the log says why.

        The longest wait for an answer around a re-admission (`python -m hepti.bench.stall
        --readmit`, medians of runs; 2026-11-29 on this shared 2-core machine): under `hepti
        emulate` of hostfiles/emu-hang3.json with bench-adapt's client (`--spec`, 3 runs each)
        4.70 s (4.54-5.33) stopping first, at load 9.6-15.7, against 0.77 s (0.66-1.22) with
        this, at load 14.5-15.4, while the job with the device loaded 9.6-12.6 s beside it; in
        process, `-n 2` (5 runs each) 3.44 s (1.97-12.8) at load 5.7-8.4 against 0.50 s
        (0.39-1.04) at load 10.7-12.5. No request lost or answered twice in any run."""
        with self._cv:
            hosts = list(self._admit)
        with self._bench_lock:
            back = [self.bench.devices[h] for h in hosts if h in self.bench.devices]
        if not back:
            with self._cv:
                self._admit = [h for h in self._admit if h not in hosts]
            return True
        entries, n, args = self._world_with(back)
        why = self._no_room_for_both(entries, n)
        if why is not None:
            log.warning("serve: re-admitting %s stops the serving job and relaunches (no "
                        "answers meanwhile): %s", ", ".join(hosts), why)
            return False
        back = self._bench_admit(hosts)
        try:
            job = self._start_job(n, entries, args, admit=True)
        except OSError as e:
            log.warning("serve: could not start the job that re-admits %s ahead (%s); stopping "
                        "the serving job to relaunch with it", ", ".join(hosts), e)
            self._carry.extend(back)
            return False
        job.admits = back
        with self._cv:
            self._incoming = job
        log.warning("serve: re-admitting %s (it answered %d probes in a row): starting %d "
                    "rank(s) with it while %d serve on", ", ".join(d.host for d in back),
                    max(d.answers for d in back), n, self.n)
        timeout = self._admit_start_s()
        threading.Thread(target=self._preload, args=(job, timeout), daemon=True,
                         name="hepti-serve-admit").start()
        return True

    def _preload(self, job: _Job, timeout_s: float) -> None:
        """The thread that reads a job started ahead up to its hello: its watch lines are
        watched as they come (beats read, not judged: not the serving job's) and kept with the
        hello on the job; or why it never said hello (exited, not within timeout_s)."""
        def on_line(line: WatchLine, sock: socket.socket) -> None:
            job.lines.append((line, sock))
            self._watch.register(sock, selectors.EVENT_READ, line)
        try:
            got = self._accept_hello(job, time.monotonic() + timeout_s, timeout_s, on_line,
                                     lambda: self._stopping or job.cancelled)
        except _StartFailed as e:
            job.failed = str(e)
        except (OSError, ValueError) as e:
            job.failed = f"its channel failed ({e})"
        else:
            if got is None:
                job.failed = "cancelled"
            else:
                job.hello_at, job.hello = time.time(), got
        with self._cv:
            self._cv.notify_all()  # `_take_batch` may be waiting

    def _incoming_settled(self) -> bool:
        """The job started ahead said hello, or never will (under self._cv)."""
        inc = self._incoming
        return inc is not None and (inc.hello is not None or inc.failed is not None)

    def _end_ahead(self, job: _Job) -> None:
        """End a job started ahead that will not serve, off this thread; its lines with it."""
        job.cancelled = True
        for _, sock in job.lines:
            try:
                self._watch.unregister(sock)
            except (KeyError, ValueError):
                pass
            sock.close()
        if job.hello is not None:
            job.hello[0].close()
        self._end_spare(job)

    def _abandon_incoming(self) -> None:
        """The job started ahead never said hello (the device hung again, a start timeout):
        the serving job serves on, and its devices go back to the bench (flapping, as
        `_relose` does)."""
        with self._cv:
            job, self._incoming = self._incoming, None
        if job is None:
            return
        self._end_ahead(job)
        now = time.monotonic()
        with self._bench_lock:
            for d in job.admits:
                self.bench.lose(d.host, d.ranks, "did not start when re-admitted", now)
        if self.launches:
            self.launches[-1].setdefault("admissions_failed", []).append(
                {"hosts": [d.host for d in job.admits], "n": job.n,
                 "started_at": job.started_at, "end": job.failed})
        log.warning("serve: the job that re-admitted %s did not start (%s); serving on without "
                    "it", ", ".join(d.host for d in job.admits), job.failed)

    def _cancel_incoming(self) -> None:
        """The serving job ended some other way (a loss, a failure) while a job with devices
        back was starting ahead: that job is ended (it was made for a world that changed), and
        its devices join the relaunch (`_carry`)."""
        with self._cv:
            job, self._incoming = self._incoming, None
        if job is None:
            return
        self._end_ahead(job)
        self._carry.extend(job.admits)

    def _no_room_for_both(self, entries: list[tuple[str, int]] | None, n: int) -> str | None:
        """None when every device that would run both jobs while the new one loads has room
        for the new job's ranks there; else why not, for the log.

        Conservative on purpose, as the plan the new job makes is not known before it says
        hello: each of its ranks is taken to hold the whole model (`hepti.model.sizes.
        model_bytes`: what `rows`, or an idle rank's standby copy under --replan, holds; any
        split holds less) on top of what a serving rank of this job holds now (its resident
        memory, `rank_rss`: Python, Numba, MPI, its share, its buffers; RANK_RUNTIME_BYTES
        where the rank is not on this machine); and the device must keep MEM_HEADROOM of its
        profiled memory free after it. What a device has free: on this machine alone (no
        hostfile), this machine's available memory, read here; with a hostfile, the free
        memory its ranks report with each batch (the re-planner's `free_seen`: --replan on),
        and with no report (--replan off, or none yet) it is not started ahead."""
        rss = [rank_rss(r.get("pid"), self._token) for r in self.ranks]
        held = max([x for x in rss if x is not None], default=RANK_RUNTIME_BYTES)
        per_rank = model_bytes(self.config) + held
        if entries is None:  # this machine is every rank's device, of both jobs
            free, total = float(available_memory()[0]), mem_total()
            need = n * per_rank + MEM_HEADROOM * total
            if free < need:
                return (f"this machine has {free / 2**20:.0f} MiB free; {n} rank(s) loading "
                        f"beside the serving ones may need {need / 2**20:.0f} MiB")
            return None
        watcher = self.watcher
        if watcher is None:
            return "the workers report no free memory (they do with --replan on)"
        old_at, new_at = rank_hosts(self.entries, self.n), rank_hosts(entries, n)
        new_hosts = [h for h, _ in entries]
        for i, (host, _) in enumerate(self.entries):
            ranks = [r for r, k in enumerate(old_at) if k == i]
            k_new = sum(new_hosts[k] == host for k in new_at)
            if not k_new:
                continue
            seen = [watcher.free_seen.get(r) for r in ranks]
            if not all(seen):
                return f"no free-memory report yet from {host}"
            free = sum(statistics.median(x) for x in seen)
            profiled = [watcher.base.devices[r].usable_bytes for r in ranks
                        if r < len(watcher.base.devices)]
            need = k_new * per_rank + MEM_HEADROOM * max(profiled, default=0.0)
            if free < need:
                return (f"{host} has {free / 2**20:.0f} MiB free; the new job's {k_new} "
                        f"rank(s) there may need {need / 2**20:.0f} MiB while the serving "
                        "job runs beside them")
        return None

    def _relose(self, launch: dict) -> None:
        """A launch that took devices back did not start: they are lost again (flapping, to
        the bench), and the next launch goes without them; not a failed start of the service."""
        back, self._admitting = self._admitting, []
        now = time.monotonic()
        for host, count in back:
            if self.entries is not None:
                self.entries = [e for e in self.entries if e[0] != host]
            self.n -= count
            with self._bench_lock:
                self.bench.lose(host, count, "did not start when re-admitted", now)
        launch["lost_again"] = [h for h, _ in back]
        if self.n >= 1 and _fixed_for_old_world(self.worker_args):
            self.worker_args = _replan_args(self.worker_args)
        log.warning("serve: the launch that re-admitted %s did not start (%s); going on without",
                    ", ".join(h for h, _ in back), launch.get("end"))

    def _admit_start_s(self) -> float:
        """How long a launch that takes a device back may take to say hello."""
        ready = [x["ready_s"] for x in self.launches if "ready_s" in x]
        return min(self.start_timeout_s,
                   max(ADMIT_START_MIN_S, ADMIT_START_FACTOR * (ready[-1] if ready else 0.0)))

    def _serve(self, sock: socket.socket) -> str:
        """Send batches until the service stops (then tell the workers) or the channel breaks."""
        try:
            while True:
                batch = self._take_batch()
                if batch is _READMIT and self._start_admission():
                    continue  # the job with it starts ahead: this one serves on
                if batch is _SWITCH:
                    if self._incoming is None:  # stopping meanwhile
                        continue
                    if self._incoming.hello is None:  # it never will: serve on without it
                        self._abandon_incoming()
                        continue
                    with self._cv:  # no batch in flight here: the switch loses none
                        self._switching, self._incoming = self._incoming, None
                        self._phase = None
                    protocol.send(sock, {"op": "stop"})
                    return "switched to the job that re-admits " + \
                        ", ".join(d.host for d in self._switching.admits)
                if batch is None or batch is _READMIT:
                    with self._cv:  # the ranks go quiet as they end: no deadline now
                        self._phase = None
                    protocol.send(sock, {"op": "stop"})
                    return "stopped" if batch is None else "stopped to re-admit a lost device"
                if self.decoder:
                    self._generate_one(sock, batch[0], self.counts["batches"])
                    continue
                lengths, flat = protocol.pack_ids([p.ids for p in batch])
                batch_id = self.counts["batches"]
                with self._cv:
                    self._set_phase("batch", batch, batch_id)
                    self._first_batch = False
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
                            # report (--replan)
                            if not self._deliver(batch, np.frombuffer(data, np.float32).reshape(
                                    header["shape"]), batch_id):
                                raise protocol.ChannelClosed("the job was declared lost")
                            wall = time.perf_counter() - t0
                            self._note_wall(batch, wall)
                        else:
                            break
                    if wall is None:
                        emb = np.frombuffer(data, np.float32).reshape(header["shape"])
                        if not self._deliver(batch, emb, batch_id):
                            raise protocol.ChannelClosed("the job was declared lost")
                        wall = time.perf_counter() - t0
                        self._note_wall(batch, wall)
                except (OSError, protocol.ChannelClosed) as e:
                    if wall is None:  # answered inputs are not run again
                        self._requeue(batch, counted=self._stall is None)
                    raise protocol.ChannelClosed(str(e)) from None
                with self._cv:
                    self._set_phase("idle")
                # a batch the monitor skipped has no report ("ranks_s"): the workers skipped it
                if self.watcher is not None and "ranks_s" in header:
                    self._watch_plan(sock, batch, header["ranks_s"], wall)
        finally:
            with self._cv:  # the job is ending (`_end_job` sees to it): no deadline now
                self._phase = None
            sock.close()

    def _generate_one(self, sock: socket.socket, piece: Piece, batch_id: int) -> None:
        """One generation on the workers: each token to its request as it comes, the phase's
        deadline renewed at every token (a stall is a silent rank within one step, however
        long the answer), a cancel sent once when the request no longer wants its tokens."""
        req: Generation = piece.request
        if req.done.is_set():  # timed out in the queue
            return
        head = {"op": "generate", "id": batch_id, **req.sampling}
        cancelled = False
        try:
            with self._cv:
                self._set_phase("batch", [piece], batch_id)
                self._first_batch = False
            protocol.send(sock, head, np.asarray(piece.ids, np.int64))
            while True:
                header, _ = protocol.recv(sock)
                with self._cv:
                    if self._stall is not None:
                        raise protocol.ChannelClosed("the job was declared lost")
                    self._set_phase("batch", [piece], batch_id)
                if header.get("op") == "token":
                    req.sent += 1
                    if not req.done.is_set():
                        req.events.put(("token", int(header["token"])))
                    if (req.cancel.is_set() or req.done.is_set()) and not cancelled:
                        protocol.send(sock, {"op": "cancel", "id": batch_id})
                        cancelled = True
                    continue
                break  # the result
        except (OSError, protocol.ChannelClosed) as e:
            if req.sent == 0:  # nothing streamed yet: it runs again on the next job
                self._requeue([piece], counted=self._stall is None)
            else:
                with self._cv:
                    self._finish(req, WorkerFailed(
                        f"the workers failed after {req.sent} tokens of this generation "
                        "(already sent, so it is not run again)"))
            raise protocol.ChannelClosed(str(e)) from None
        with self._cv:
            self._set_phase("idle")
            piece.answered = True
            self.counts["cancelled"] += header.get("finish_reason") == "cancelled"
            if not req.done.is_set():
                self.counts["answered"] += 1
                req.events.put(("done", header.get("finish_reason", "length")))
                req.done.set()
        self._batch_walls.append(float(header.get("wall_s", 0.0)))

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
        """One command to the workers between batches (probe, prepare, switch): its answer.
        A slow phase for the stall deadline (a switch may read weights)."""
        with self._cv:
            self._set_phase(str(header.get("op")))
        protocol.send(sock, header)
        answer, _ = protocol.recv(sock)
        with self._cv:
            self._set_phase("idle")
        return answer

    def _note_wall(self, batch: list[Piece], wall: float) -> None:
        self._batch_walls.append(wall)
        B, T = _shape(batch)
        self._per_token.append(wall / (B * T))

    def _take_batch(self) -> list[Piece] | None:
        """The next batch from the queue (waiting for one), None when stopping, _READMIT when
        a lost device is to be taken back, or _SWITCH when the job started ahead with it said
        hello or never will (all between two batches)."""
        with self._cv:
            while not self._queue and not self._stopping and not self._admit_due() \
                    and not self._incoming_settled():
                if self._stall is not None:
                    raise protocol.ChannelClosed("a rank was declared lost while idle")
                self._cv.wait(0.5)
                if self._proc is not None and self._proc.poll() is not None:
                    raise protocol.ChannelClosed("the workers exited while idle")
            if self._stopping:
                return None
            if self._stall is not None:
                raise protocol.ChannelClosed("a rank was declared lost")
            if self._incoming_settled():
                return _SWITCH
            if self._admit_due():
                return _READMIT
            batch, longest = [], 0
            while self._queue and len(batch) < self.max_batch_inputs:
                t = max(longest, len(self._queue[0].ids))
                if batch and (len(batch) + 1) * t > self.max_batch_tokens:
                    break
                batch.append(self._queue.popleft())
                longest = t
            self.counts["batches"] += 1
            return batch

    def _admit_due(self) -> bool:
        """A lost device is to be re-admitted now: it is confirmed, the job has served
        SERVE_BEFORE_ADMIT_S without it, and no job is starting ahead already (under self._cv)."""
        return bool(self._admit) and self._incoming is None and \
            time.monotonic() - self._ready_at >= SERVE_BEFORE_ADMIT_S

    def _deliver(self, batch: list[Piece], emb: np.ndarray, batch_id: int) -> bool:
        """A batch's embeddings to their requests; False, and nothing written, when the job was
        declared lost before they came (the batch goes back to the queue and runs again)."""
        with self._cv:
            if self._stall is not None:
                return False
            for j, p in enumerate(batch):
                r = p.request
                if p.answered:  # never: a batch is requeued only when not answered
                    self.counts["duplicates"] += 1
                    log.error("serve: input %d of a request was answered twice; the second "
                              "answer is dropped", p.index)
                    continue
                p.answered = True
                if r.done.is_set():  # timed out or failed meanwhile
                    continue
                r.out[p.index] = emb[j]
                self.counts["inputs_answered"] += 1
                r.remaining -= 1
                if r.remaining == 0:
                    self.counts["answered"] += 1
                    if self.replan_ab:
                        self._ab_note(batch_id, time.perf_counter() - r.t_submit)
                    r.done.set()
        return True

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

    def _requeue(self, batch: list[Piece], counted: bool = True) -> None:
        """The batch in flight when the workers failed: back to the head of the queue, in order;
        an input on its MAX_ATTEMPTS-th failure fails its request instead. A hang (`counted`
        False) is not counted: a stopped board or a silent link is no input's doing (a rank
        that an input makes compute long still beats), and an input must not be refused for
        two hangs of the devices."""
        with self._cv:
            for p in reversed(batch):
                p.attempts += counted
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
            if isinstance(req, Generation):  # its reader waits on the events
                req.events.put(("error", error))

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

    def _forward_output(self, proc: subprocess.Popen, tail: collections.deque,
                        who: str = "workers") -> None:
        """A job's output, to our log line by line (and its tail kept for diagnosis)."""
        for line in proc.stdout:
            line = line.rstrip("\n")
            tail.append(line)
            if line.strip():
                log.info("%s: %s", who, line)

    def _end_job(self, job: _Job, grace_s: float, launch: dict | None = None) -> int | None:
        """Wait for a job's mpiexec to end (then stop it), and for its last words to be read;
        remove what it left (`jobfiles.sweep`), close its listener, and note its exit code in
        its `launch` record."""
        p = job.proc
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
        job.reader.join(5.0)  # MPICH's report of a killed rank comes as the job ends
        job.listener.close()
        if job.files_before is not None and p.poll() is not None:  # what a killed rank left
            for line in jobfiles.sweep(job.files_before):
                log.info("serve: removed %s, left by the workers that ended", line)
            job.files_before = None
        if launch is not None:
            launch["exit_code"] = p.poll()
        return p.poll()

    def _lost_rank(self, exit_code: int | None, tail=()) -> int | None:
        """The rank that was killed (a device gone, an OOM kill), if that is how the job ended:
        the first whose watch line closed. A rank that raised reports itself and aborts the job
        (exit code 1): the hosts stay.

        mpiexec's exit code says "killed" (9, or 137, or a signal) only when its proxies run on
        this machine: with proxies started over ssh (a hostfile's hosts; `hepti emulate`'s
        devices) a killed rank makes the proxies fail and mpiexec exit 255, and its report,
        in the job's output (`tail`), is what names the signal: "EXIT CODE: 9". Reading only
        the exit code relaunched on the same hosts, the killed device included."""
        killed = exit_code is not None and (exit_code < 0 or exit_code in (9, 137)) or \
            _reports_kill(tail)
        closed = [(line.closed_at, line.rank) for line in self._lines.values()
                  if line.closed_at is not None]
        if not killed or not closed:
            return None
        return min(closed)[1]


class _StartFailed(Exception):
    pass


# MPICH's report of the process it saw end badly: "=   EXIT CODE: 9", or, from some launchers,
# "... THE EXIT STRING: Killed (signal 9)"; 137 is a shell's 128 + 9
_KILL_REPORT = re.compile(r"EXIT CODE: (9|137)\s*$|\(signal 9\)")


def _reports_kill(tail) -> bool:
    """Whether a job's last words say MPICH saw a rank end by SIGKILL, and no rank aborted (a
    rank that raised calls MPI_Abort; Hydra then kills the others itself)."""
    lines = list(tail)
    return any(_KILL_REPORT.search(x) for x in lines) and not any("MPI_Abort" in x for x in lines)


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
    from tokenizers import Tokenizer  # local: only a model with a tokenizer.json needs it
    tok = Tokenizer.from_file(str(path))
    tok.no_padding()
    tok.no_truncation()
    return tok


def _late_text(late: list[dict]) -> str:
    """Late ranks (`Supervisor.late_ranks`) in a sentence for a person."""
    who = ", ".join(f"rank {b['rank']} on {b['host']} (pid {b['pid']}) silent for "
                    f"{b['silent_s']:.1f} s" for b in late)
    return f"{who}: stopped, starved of CPU or cut off"


def _phase_text(ph: Phase) -> str:
    return f"batch {ph.batch}" if ph.kind == "batch" else \
        "the idle time between batches" if ph.kind == "idle" else f"the {ph.kind} command"


def _shape(batch: list[Piece]) -> tuple[int, int]:
    """A batch's (inputs, longest)."""
    return len(batch), max(len(p.ids) for p in batch)
