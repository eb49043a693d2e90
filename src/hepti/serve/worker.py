"""The MPI side of `hepti serve`: every rank runs `python -m hepti.serve.worker ...` under the
front end's mpiexec.

Each rank opens its own copy of the weights and the ranks plan as `hepti run` does (a fixed
strategy, a plan file, or the planner on a measured profile), then build one `Job` and keep it:
the weights stay loaded between requests. Rank 0 connects to the front end's channel
(hepti.serve.protocol) and says hello (the secret, the plan, each rank's host and pid). Then,
per batch the front end sends, rank 0 broadcasts a command, [op, batch id], and all ranks run
the batch through the job; rank 0 pools the hidden states and answers. Between batches the
other ranks wait in `Comm.bcast_idle`, asleep, and rank 0 in a socket read. A decoder plans
nothing and runs "generate" commands instead of batches (hepti.serve.generation).

Every rank also holds a watch line to the front end, and beats on it (`_Heartbeat`): the
front end sees which rank is hung or cut off without MPI, and which closed its line first
when the job ends.

A failure on any rank ends the whole job (`run_guarded_fn`), as in `hepti run`: the front end
sees the channel close and mpiexec exit, and relaunches (hepti.serve.supervisor).
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time

import numba
import numpy as np

from hepti.families import family, family_graph
from hepti.inputs import Batch
from hepti.model.pooling import pool
from hepti.model.sizes import layer_slice_bytes, spec_bytes
from hepti.parallel.comm import Comm
from hepti.parallel.engine import Job, build_layers, layer_spec
from hepti.parallel.plans import get_profile, needs_planner, plan_with_profile, resolve_plan
from hepti.parallel.world import agree, run_guarded_fn
from hepti.parallel.layers import ResidentLayers, SpareLayers, slice_packer
from hepti.parallel.profile_compute import SpeedProbe, measure_probe
from hepti.parallel.profile_links import fit_link, ping_pong
from hepti.parallel.trace import Tracer
from hepti.plan.planfile import Plan
from hepti.resources import _return_freed_memory, available_memory, exit_without_collecting
from hepti.serve import protocol
from hepti.serve.generation import DecoderWorker, stray_cancel
from hepti.serve.protocol import BEAT_EVERY_S, CHECK_SIZES, PROBE_SIZES
from hepti.weights import WeightStore

OP_STOP, OP_BATCH, OP_PROBE, OP_PREPARE, OP_SWITCH, OP_GENERATE = 0, 1, 2, 3, 4, 5
OPS = {"stop": OP_STOP, "batch": OP_BATCH, "probe": OP_PROBE, "prepare": OP_PREPARE,
       "switch": OP_SWITCH, "generate": OP_GENERATE}


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m hepti.serve.worker",
                                 description="hepti serve's MPI workers (started by `hepti serve`)")
    ap.add_argument("--model", required=True)
    ap.add_argument("--strategy", default=None)
    ap.add_argument("--ratios", default=None)
    ap.add_argument("--plan", default=None)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--mem-cap", default=None)
    ap.add_argument("--mem-budget", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plan-seq", type=int, default=128, help="tokens per input the plan is made for")
    ap.add_argument("--plan-batch", type=int, default=1, help="inputs per batch the plan is made for")
    ap.add_argument("--pool", choices=("mean", "cls"), default="mean")
    ap.add_argument("--normalize", type=int, default=1)
    ap.add_argument("--replan", type=int, default=0,
                    help="1: send the profile and each batch's per-rank times (hepti.serve.monitor)")
    args = ap.parse_args(argv)
    args.json = True  # plan_with_profile: no chatter on stdout
    return args


def make_batch(inputs: list[np.ndarray], pad_id: int):
    """Token id lists -> one Batch padded to the longest (mask 0 on padding)."""
    B, T = len(inputs), max(len(x) for x in inputs)
    ids = np.full((B, T), pad_id, np.int64)
    mask = np.zeros((B, T), np.int64)
    for i, x in enumerate(inputs):
        ids[i, :len(x)] = x
        mask[i, :len(x)] = 1
    return Batch(ids, mask, np.zeros((B, T), np.int64))


def serve(args) -> int:
    """Every rank: load, plan, then run the front end's commands until it says stop or goes
    away."""
    from mpi4py import MPI  # local: it starts MPI; tests and bench/stall import this module


    t_start = time.perf_counter()
    mpi = MPI.COMM_WORLD
    world = Comm(mpi, Tracer(mpi.Get_rank()))
    rank0 = world.rank == 0
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    store = agree(world, lambda: WeightStore(args.model))
    cfg = store.config
    profile = None
    if family(cfg).executor == "decoder":  # generation requests (hepti.serve.generation)
        state = DecoderWorker(world, store, args)
        plan_dict = state.plan
    else:
        if needs_planner(args) or args.replan:
            profile = get_profile(args, world, cfg, args.plan_batch, args.plan_seq)
        if needs_planner(args):
            plan = plan_with_profile(args, world, cfg, args.plan_batch, args.plan_seq, profile)
        else:
            plan = agree(world, lambda: resolve_plan(args, world.size, cfg))
        job = agree(world, lambda: Job(world, store, plan, args.threads))
        state = _State(world, store, job, args)
        plan_dict = plan.to_dict()
    me = {"rank": world.rank, "host": os.uname().nodename, "pid": os.getpid()}
    # a line to the front end that stays open while this rank lives: when the job ends, the one
    # that closed first names the rank that was lost (hepti.serve.supervisor)
    watch = protocol.connect(os.environ[protocol.CONTROL_ENV])
    protocol.send(watch, {"op": "watch", "token": os.environ.get(protocol.TOKEN_ENV, ""), **me})
    beat = _Heartbeat(watch, world.rank)
    ranks = world.gather_obj(me)  # after every rank's watch line: the hello comes last
    sock = None
    state.on_host = world.ranks_on_host()
    if args.replan:  # idle ranks load their standby copies before the service is up
        state.standby()
        world.barrier_idle()
    if rank0:
        sock = protocol.connect(os.environ[protocol.CONTROL_ENV])
        protocol.send(sock, {"op": "hello", "token": os.environ.get(protocol.TOKEN_ENV, ""),
                             "plan": plan_dict, "ranks": ranks,
                             "world_size": world.size, "hidden_size": cfg.hidden_size,
                             "profile": profile.to_dict() if profile is not None else None,
                             "load_s": time.perf_counter() - t_start})
    try:
        while True:
            header = data = None
            if rank0:
                try:
                    header, data = protocol.recv(sock)
                    while stray_cancel(header):  # its generation had ended: nothing to stop
                        header, data = protocol.recv(sock)
                except protocol.ChannelClosed:
                    header = {"op": "stop"}
                # [2]: whether this batch reports (with --replan: the front end pauses the
                # monitor for --replan-ab's other half); every rank must agree, for the gather
                cmd = np.array([OPS[header["op"]], int(header.get("id", 0)),
                                int(header.get("report", True))], np.int64)
            else:
                cmd = None
            op, batch_id, report = (int(v) for v in world.bcast_idle(cmd, 3))
            if op == OP_STOP:
                return 0
            beat.batch = batch_id if op in (OP_BATCH, OP_GENERATE) else None
            if op == OP_GENERATE:
                answer = state.generate(header, data, sock)
            elif op == OP_BATCH:
                answer = state.batch(header, data, bool(args.replan and report),
                                     (lambda msg, payload=None:
                                      protocol.send(sock, {"id": batch_id, **msg}, payload))
                                     if rank0 else None)
            elif op == OP_PROBE:
                answer = state.probe(header)
            elif op == OP_PREPARE:
                answer = state.prepare(header)
            else:
                answer = state.switch()
            beat.batch = None
            if rank0:
                head, payload = answer
                protocol.send(sock, {"id": batch_id, **head}, payload)
    finally:
        if sock is not None:
            sock.close()
        state.close()
        beat.stop()
        watch.close()


class _Heartbeat:
    """A rank's sign of life for the front end, without MPI: a daemon thread sends a frame
    {"op": "beat", "rank", "batch": the batch this rank is in (None between batches), "t": its
    clock} on the rank's watch line every BEAT_EVERY_S.

    It beats while the main thread computes (the kernels release the GIL: nogil) or waits in
    MPI (mpi4py releases it in blocking calls, and `bcast_idle` sleeps), so a rank that stops
    beating is stopped (SIGSTOP, a frozen device), starved or cut off, not merely busy or
    waiting for a slower peer. A send that fails (the front end went away) ends the beats,
    never the rank: die-with-parent ends the rank, as before."""

    def __init__(self, sock, rank: int):
        self.sock, self.rank = sock, rank
        self.batch: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hepti-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(BEAT_EVERY_S):
            try:
                protocol.send(self.sock, {"op": "beat", "rank": self.rank, "batch": self.batch,
                                          "t": time.time()})
            except OSError:  # the front end is gone: nothing to beat to
                return

    def stop(self) -> None:
        """End the beats (before the line closes: a send never meets a closed socket)."""
        self._stop.set()
        self._thread.join(2 * BEAT_EVERY_S)


# A rank reads the next plan's slices beside the current ones only with this many times their
# bytes free; else at the switch, after letting the current ones go (a stall, not a crash).
# $HEPTI_SERVE_LOAD_ROOM sets it (tests/test_serve.py defers every load with a huge one).
LOAD_ROOM = float(os.environ.get("HEPTI_SERVE_LOAD_ROOM", "1.5"))


# A rank keeps the resident weights of the plan it switched away from while its free memory
# is at least this many times their size: the switch back (a device restored, a rollback)
# then reads nothing. bench-adapt's restore at 60 s waited 10 s for its better plan because a
# 0.2-core device had to read back the 340 MB it had dropped when it went idle.
KEEP_PREVIOUS_FREE = 2.0
MEM_READ_S = 2.0  # a rank's free memory, read at most this often while serving (`_free_memory`)
# An idle rank probes as a batch starts when batches come this many times its probe's time
# apart (its report is then this batch's own), else after the gather, off the batch's path
# (MiniLM's batches of a few ms would wait for a 0.15-core device's probe)
EARLY_PROBE_CYCLES = 10
# Rank 0's watch inside a batch (`_InBatchWatch`): how often it looks, as a fraction of the
# batch's predicted wall time (within 10-100 ms); from what fraction on; and how far its
# communication so far must exceed what that fraction predicts, as a ratio and as a fraction
# of the predicted wall (one slow collective early in a batch is not a change)
WATCH_EVERY, WATCH_FROM, WATCH_RATIO, WATCH_EXCESS = 1 / 20, 0.25, 1.8, 0.10


class _InBatchWatch:
    """Rank 0 watches its own communication while a batch runs, and tells the front end at
    once when it is far above the plan's prediction (hepti.serve.replan notes it as a flag).

    Why: a residual is known only at the batch's end, and a batch that a change slows takes
    the longer: bench-adapt at 30ad712 flagged node-b's CPU halving 1.77 s after it, at the end
    of the first request run wholly under it (1.52 s). Rank 0's time inside collectives holds
    every peer's lateness (a slower CPU anywhere, or a slower link), so a quarter into that
    request it already read 4-5x its prediction. The signal costs no MPI message: rank 0 reads
    its tracer on a thread and writes one line to the front end's socket, at most once a batch;
    the thread is joined before the batch's answer goes on the same socket. A change of rank
    0's own speed does not show here (its waits stay as predicted): the batch's end tells it.

    `expect`: {"comm_s": rank 0's predicted communication (transfers and waits, times the
    series' baseline), "wall_s": the batch's predicted time}, from the front end."""

    def __init__(self, tracer, expect: dict, notify):
        self.tracer, self.notify = tracer, notify
        self.comm_s, self.wall_s = float(expect["comm_s"]), float(expect["wall_s"])
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hepti-batch-watch", daemon=True)
        self._thread.start()

    def _comm_so_far(self) -> float:
        sec = self.tracer.seconds
        # the dict may gain a key on the main thread meanwhile: copy its items, retrying
        for _ in range(3):
            try:
                return sum(v for k, v in list(sec.items())
                           if k not in ("compute", "io", "batch"))
            except RuntimeError:
                continue
        return 0.0

    def _run(self) -> None:
        every = min(0.1, max(0.01, WATCH_EVERY * self.wall_s))
        while not self._stop.wait(every):
            elapsed = time.perf_counter() - self.t0
            if elapsed < WATCH_FROM * self.wall_s:
                continue
            got = self._comm_so_far()
            expected = self.comm_s * min(1.0, elapsed / self.wall_s)
            if got > WATCH_RATIO * expected and got - expected > WATCH_EXCESS * self.wall_s:
                self.notify({"op": "flag", "kind": "comm", "rank": 0,
                             "factor": got / max(expected, 1e-9), "at_s": elapsed})
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


class _State:
    """A rank's serving state: its job, the next plan's weights while they load, and the
    previous plan's (`kept`, which the kernel may take back: SpareLayers), while memory
    allows."""

    def __init__(self, world, store, job, args):
        self.world, self.store, self.job, self.args = world, store, job, args
        self.cfg = store.config
        self.next = None  # (plan, spec, thread, holder) while a new plan's weights load
        self.kept = None  # (spec, SpareLayers) of the plan before the current one
        self._probe = None  # speed_probe's SpeedProbe
        self._probed = 0.0  # an idle rank's last speed probe (s), sent with the next batch
        self._free_after = -1.0  # free memory read after the last batch's gather (`batch`)
        self._probe_s = math.inf  # how long its last probe took, all told
        self._last_batch = time.perf_counter()  # when the last batch started, on this rank
        self.kept_whole = False  # `kept` is the standby copy (the whole model), not a plan's
        self.on_host = 1  # ranks on this host: its free memory is shared between them
        self._mem = None  # (when, bytes): the last reading of `_free_memory`

    def _free_memory(self) -> float:
        """This rank's free memory beside what it keeps (hepti.resources.available_memory,
        which counts a lazily free `kept` as free: the re-planner adds what a rank keeps to its
        free memory itself), read at most every MEM_READ_S: its cgroup files cost 0.5-2 ms of
        CPU a reading, 3-10 ms on a 0.15- to 0.2-core device, after every batch (bench-adapt
        --quiet-ab at 4de90d9: the monitor cost 1.9% of a BERT-base request)."""
        now = time.monotonic()
        if self._mem is None or now - self._mem[0] >= MEM_READ_S:
            lazy = sum(spare.lazy_bytes for spare in self._spares())
            self._mem = (now, float(available_memory()[0] - lazy))
        return self._mem[1]

    def _spares(self) -> list:
        """What this rank holds lazily free (SpareLayers): the weights it keeps beside its
        plan, and the next plan's once read, until the switch."""
        spares = [self.kept[1]] if self.kept is not None else []
        if self.next is not None and "spare" in self.next[3]:
            spares.append(self.next[3]["spare"])
        return spares

    def _trim(self) -> None:
        """Drop the weights kept beside the plan once they are no use: the kernel took some of
        their pages (memory ran short: SpareLayers), looked at as often as the free memory is
        read; or, where the kernel cannot take them, the free memory is under their size."""
        if self.kept is None or self.next is not None:
            return
        spare = self.kept[1]
        if spare.lazy:
            gone = (self._mem is None or time.monotonic() - self._mem[0] >= MEM_READ_S) \
                and spare.lost()
        else:
            gone = self._free_memory() < spare.nbytes
        if gone:
            self._drop_kept()

    def _drop_kept(self) -> None:
        self.kept[1].close()
        self.kept, self.kept_whole = None, False
        self._give_back()

    def _give_back(self) -> None:
        """Hand weights just let go back to the system, and read the free memory afresh.

        A layer's slices are arrays of 1-9 MB; once glibc has freed one large mapping its mmap
        threshold rises (up to 32 MiB), so later slices live in the heap, and freeing them
        keeps the pages in the process. Measured (tests/test_serve_memory.py, MiniLM, a rank
        squeezed to 37 MiB free): its switch from `rows` to a smaller `tensor` share left it
        15 MiB free, not the 50 the plans' difference gives, and the re-planner, reading that,
        took its last share too. `malloc_trim` returns them (as the profile does after its
        probes: hepti.resources._return_freed_memory)."""
        _return_freed_memory()
        self._mem = None

    def standby(self) -> None:
        """A rank the plan leaves idle loads the whole model, as `rows` would give it, if its
        free memory is KEEP_PREVIOUS_FREE times that: a re-plan that gives it rows later
        reads nothing (bench-adapt: a 0.15-core device's 340 MB load, done on the re-plan,
        slowed 8 s of batches to 1.5-4.5 s). It loads before the service is up (every rank
        waits for it at a barrier). Loaded on a background thread while serving, one layer a
        batch (until 2026-11-27), it slowed the first 12-15 requests of bench-adapt from
        0.75 s to 0.8-1.75 s (adaptive 851 ms against static 771 over the first 20 s, at
        4de90d9): on one host its reads and packing share the CPU with the busy devices, and
        on a device of its own it holds up the gathers it takes part in. The service is up
        about 2.5 s later on emu-drift4 (ready 11.0 s against 8.5, node-d's 436 MB)."""
        cfg = self.cfg
        H, F, L = cfg.num_attention_heads, cfg.intermediate_size, cfg.num_hidden_layers
        need = layer_slice_bytes(cfg, H, F) * L
        if self.job.spec is not None or available_memory()[0] < KEEP_PREVIOUS_FREE * need:
            return
        spec = ("resident", (0, H), (0, F), (0, L))
        try:
            spare = SpareLayers()   # each slice lazily free once read, as the next plan's
            spare.layers = build_layers(self.store, spec, slice_packer(family_graph(cfg, 1, 1)),
                                        on_layer=spare.add)
            self.kept = (spec, spare)
            self.kept_whole = True
        except Exception:  # noqa: BLE001 - a standby copy is an optimisation; serve on
            self.kept = None

    def batch(self, header, data, report: bool, notify=None):
        """One batch through the job; rank 0's answer: the pooled embeddings, and when the
        batch `report`s (--replan, the monitor not paused) every rank's compute and
        communication seconds (one small gather). Then rank 0 sends the embeddings ahead
        through `notify` (op "answer") and the report after the gather (op "result", no
        payload). Rank 0 watches its communication during the batch when the front end sent
        what to expect (`watch`), and tells it early through `notify` too (`_InBatchWatch`).
        A batch that does not report does what a --replan off service does: no gather, no
        speed probe, no memory reading."""
        w, rank0 = self.world, self.world.rank == 0
        batch = None
        if rank0:
            batch = make_batch(protocol.unpack_ids(header["lengths"], data), self.cfg.pad_token_id)
        w.tracer.reset()
        out = {}
        now = time.perf_counter()
        cycle, self._last_batch = now - self._last_batch, now
        # an idle rank whose batches are long next to its probe probes as the batch starts, and
        # the batch's own report carries it: bench-adapt at 9113200 (probes after each gather,
        # reported with the next batch) flagged node-d's fall 2.0 s after it, two requests
        early = report and not self.job.is_active and \
            cycle > EARLY_PROBE_CYCLES * self._probe_s
        if early:
            self._probed = self.speed_probe()
        watch = _InBatchWatch(w.tracer, header["watch"], notify) \
            if rank0 and notify is not None and header.get("watch") else None
        t0 = time.perf_counter()
        try:
            self.job.run_all([batch] if rank0 else (), 1, lambda k, h: out.setdefault("h", h))
        finally:
            if watch is not None:
                watch.stop()
        wall = time.perf_counter() - t0
        head = {"op": "result", "wall_s": wall}
        emb = None
        if rank0:
            emb = pool(out["h"], batch.mask, self.args.pool, bool(self.args.normalize))
            head["shape"] = list(emb.shape)
            if report and notify is not None:
                # the answer goes before the report's gather, which waits for the slowest
                # rank's bookkeeping: the client has its embeddings meanwhile. bench-adapt's
                # quiet pairs at 8faad96 (answer after the gather) read the monitor's cost
                # as 2.1% of a 740 ms request, against the 1%
                notify({"op": "answer", "shape": head["shape"], "wall_s": wall}, emb)
                emb = None
        if report:
            sec = w.tracer.seconds
            compute = sum(v for k, v in sec.items() if k in ("compute", "io"))
            comm = sum(v for k, v in sec.items() if k not in ("compute", "io", "batch"))
            ready = self.next is None or not self.next[2].is_alive()
            # [5]: what this rank holds beside its plan: 0 nothing, 1 the previous plan's
            # slices (named in the switch's answer), 2 the whole model (`standby`)
            holds = 0.0 if self.kept is None else 2.0 if self.kept_whole else 1.0
            # [2]: free memory, as `hepti profile` counts it, read after the last batch's
            # gather (`_free_after`: a memory figure need not hold up this one), at most every
            # MEM_READ_S (`_free_memory`); -1 while weights load (the standby copy, the next
            # plan's): the figure is on its way down, not a change
            free = -1.0 if not ready else self._free_after
            mine = [compute, comm, float(free), float(ready), self._probed, holds]
            head["ranks_s"] = w.gather_floats(mine)
            self._trim()
            self._free_after = -1.0 if not ready else \
                self._free_memory() / self.on_host
            # an idle rank probes its speed after the gather, off the batch's path: rank 0
            # answers without waiting for it, and the next batch's gather carries the figure
            # (`speed_probe`: the median of several rounds; single probes at 0.15-0.2 core read
            # 0.76-1.85x of each other within 4 s in bench-adapt, and one misled a re-plan)
            if not early:
                self._probed = 0.0 if self.job.is_active else self.speed_probe()
        if not rank0:
            return None
        return head, emb  # emb None: it went ahead (`notify`)

    def speed_probe(self) -> float:
        """A rank with no share of the plan still tells its speed: the seconds per call of
        the profile's own speed probe (hepti.parallel.profile_compute.SpeedProbe, a small GeMM timed
        the way the profile times, stretched on an emulated device as its work is), which the
        profile recorded for this rank as `probe_s`: the monitor compares like with like.
        Single probe calls, each its own stretched span, read 0.4-2.5x of each other with
        nothing changed (a sleep's overshoot credited to the next call: SpeedProbe says why)."""
        if self._probe is None:
            self._probe = SpeedProbe(self.cfg.hidden_size)
        start = time.perf_counter()
        seconds = self._probe()
        self._probe_s = time.perf_counter() - start
        return seconds

    def probe(self, header):
        """Rank 0 times a ping-pong with each rank named (at three sizes, or the header's
        `sizes`: [[bytes, round trips], ...]) and fits its link. With `speed`: N, every rank
        then reads its speed probe N times as the profile read it (`measure_probe`) and rank 0
        gathers the medians (`speeds`, by rank): the re-planner re-measures the devices of a
        plan that missed its prediction."""
        w = self.world
        peers, sizes, speed = w.bcast_obj(
            (header["ranks"], header.get("sizes") or PROBE_SIZES, int(header.get("speed", 0)))
            if w.rank == 0 else None)
        links = {}
        for peer in peers:
            points = []
            for nbytes, reps in sizes:
                if w.rank in (0, peer):
                    points.append((nbytes, ping_pong(w.mpi, peer, nbytes, reps)))
            if w.rank == 0:
                lat, bw = fit_link(points)
                links[str(peer)] = {"latency_s": lat, "bandwidth_Bps": bw, "points": points}
        answer = {"op": "probed", "links": links}
        if speed:  # as the profile read probe_s (after sleeps: a rank just done with a batch
            # reads its probe 2-4x slow on a busy host, in the run that first re-measured)
            if self._probe is None:
                self._probe = SpeedProbe(self.cfg.hidden_size)
            answer["speeds"] = w.gather_obj(measure_probe(self.cfg.hidden_size, speed, self._probe))
        return (answer, None) if w.rank == 0 else None

    def prepare(self, header):
        """Start reading this rank's weights for the next plan on a background thread, unless
        they are the ones it holds; the current plan keeps serving meanwhile."""
        w = self.world
        # `defer`: the ranks the re-plan moves for their memory (hepti.serve.replan
        # `_check_memory`), which read their next slices only once their current ones are gone
        plan, defer = w.bcast_obj((header["plan"], header.get("defer", []))
                                  if w.rank == 0 else None)
        plan = Plan.from_dict(plan).validate(w.size)
        spec = layer_spec(plan, self.cfg, w.rank)
        holder = {"read0": self.store.bytes_read}
        # the copy kept beside the plan holds the next one's slices: it stays the kernel's to
        # take until the switch (taken back there, or read afresh there if the kernel took some)
        if self.kept is not None and spec == self.kept[0] and self.kept[1].lost():
            self._drop_kept()  # the kernel took some of it back already: read afresh below
        # whether this rank reads anything for the next plan
        loads = spec is not None and spec != self.job.spec and \
            (self.kept is None or spec != self.kept[0])
        # no room for the next plan's slices beside the current ones (the re-plan may be for
        # that very reason): they are read at the switch, once the current ones are let go
        holder["deferred"] = bool(loads) and (
            w.rank in defer or
            available_memory()[0] / self.on_host < LOAD_ROOM * spec_bytes(self.cfg, spec))
        loads = w.gather_obj(loads)

        def load():
            if holder["deferred"]:
                return
            try:
                if spec is not None and spec != self.job.spec and \
                        (self.kept is None or spec != self.kept[0]):
                    # until the switch they serve nothing: the kernel may take each slice
                    # from the moment it is read (`switch` reads again what it took)
                    spare = holder["spare"] = SpareLayers()
                    layers = build_layers(self.store, spec,
                                          slice_packer(family_graph(self.cfg, 1, 1)),
                                          on_layer=spare.add)
                    holder["layers"] = spare.layers = layers
                    if not isinstance(layers, ResidentLayers):  # streamed: nothing to keep
                        del holder["spare"]
            except BaseException as e:  # noqa: BLE001 - raised by switch(), on the main thread
                holder["error"] = e
        thread = threading.Thread(target=load, name="hepti-next-plan", daemon=True)
        thread.start()
        self.next = (plan, spec, thread, holder)
        return ({"op": "prepared", "loads": loads}, None) if w.rank == 0 else None

    def switch(self):
        """Every rank together, between batches: wait for the next plan's weights, close the
        current job (keeping its weights if the next plan holds the same) and start the next.
        Rank 0's answer: the stall, and each rank's bytes read for the switch.

        Never two plans' weights in plain memory at once, so that a squeeze at the switch (a
        re-plan for speed just before another program takes the device's memory:
        tests/test_serve_memory.py's squeeze, node-b OOM-killed under load) finds the kernel
        something to take. The current plan's slices are handed to it (`going`) before the
        next plan's are taken back from it (read beside them, or kept from the plan before);
        a next copy the kernel took from is read afresh once the current one is let go (a
        deferred load); and the closed job refers to no weights, so what is let go is gone
        before those reads, and before `_give_back` returns it to the system."""
        w = self.world
        t0 = time.perf_counter()
        plan, spec, thread, holder = self.next
        thread.join()
        if "error" in holder:
            raise holder["error"]
        keep = spec is not None and spec == self.job.spec
        old_spec, old_layers = self.job.spec, self.job.layers
        going = SpareLayers(old_layers) if not keep and not holder["deferred"] \
            and isinstance(old_layers, ResidentLayers) else None
        from_kept = not keep and self.kept is not None and spec == self.kept[0]
        spare = self.kept[1] if from_kept else holder.pop("spare", None)
        if spare is not None and not spare.take():
            # memory ran short while they waited, and the kernel took pages of them: read
            # them at the switch, as a deferred load, once the current ones are let go
            holder["deferred"] = True
        if holder["deferred"]:  # the current weights go first, then the next plan's are read
            for copy in (spare, going):
                if copy is not None:
                    copy.close()
            old_layers = going = spare = holder["layers"] = None
            self.job.close()
            if self.kept is not None:
                self.kept[1].close()
                self.kept, self.kept_whole = None, False
            self._give_back()  # before the reads, not after: the room is for them
            holder["layers"] = build_layers(self.store, spec, slice_packer(family_graph(self.cfg, 1, 1)))
            self.job = Job(w, self.store, plan, self.args.threads, layers=holder["layers"])
            self.next = None
            per_rank = w.gather_obj({"rank": w.rank, "bytes_read": self.store.bytes_read - holder["read0"],
                                     "kept": False, "holds": None, "deferred": True,
                                     "stall_s": time.perf_counter() - t0})
            return ({"op": "switched", "ranks": per_rank, "strategy": plan.strategy}, None) \
                if w.rank == 0 else None
        if keep:
            layers = old_layers
        elif from_kept:
            layers, self.kept, self.kept_whole = spare.layers, None, False
        else:
            layers = holder.get("layers")
        ops = self.job.primary_ops or None  # the primary's embeddings, if it stays the primary
        self.job.close(keep_layers=True)
        if going is not None:  # the one before stays beside the new plan while there is room
            if self.kept is not None:
                self.kept[1].close()
            # what is free beside it: the kernel counts its lazily free pages as free
            room = available_memory()[0] - going.lazy_bytes
            self.kept = (old_spec, going) \
                if room >= KEEP_PREVIOUS_FREE * old_layers.resident_bytes and not going.lost() \
                else None
            self.kept_whole = False
            if self.kept is None:
                going.close()
        elif not keep and old_layers is not None:
            old_layers.close()
        old_layers = going = spare = None
        if not keep:
            self._give_back()
        self.job = Job(w, self.store, plan, self.args.threads, layers=layers, primary_ops=ops)
        self.next = None
        read = self.store.bytes_read - holder["read0"]
        stall = time.perf_counter() - t0
        per_rank = w.gather_obj({"rank": w.rank, "bytes_read": read, "kept": keep,
                                 "holds": None if self.kept is None else self.kept[0],
                                 "stall_s": stall})
        return ({"op": "switched", "ranks": per_rank, "strategy": plan.strategy}, None) \
            if w.rank == 0 else None

    def close(self):
        if self.next is not None:
            self.next[2].join()
        if self.kept is not None:
            self.kept[1].close()
        self.job.close()


def main(argv=None) -> int:
    exit_without_collecting()  # a stopped service's ranks end 0.2-0.4 s of CPU sooner
    return run_guarded_fn("serve (worker)", serve, parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
