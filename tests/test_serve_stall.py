"""A hung rank under hepti serve (issue 44, items 1 and 2): the deadline arithmetic, which
ranks are declared lost, the re-admission hysteresis, the probes; then end to end, a worker
rank SIGSTOPped while two clients post in a loop, and a device whose link goes silent under
`hepti emulate` (root). The end-to-end tests print what they measured (pytest -s)."""
from __future__ import annotations

import collections
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from hepti.serve import stall
from hepti.serve.protocol import TOKEN_ENV
from hepti.serve.replan import COOLDOWN_S, FLAP_HOLD_S, FLAP_WINDOW_S
from hepti.serve.stall import (CONFIRM_PROBES, PROBE_EVERY_S, SLOW_PHASE_S, STALL_FACTOR,
                               STALL_FLOOR_S, DeviceBench, Phase, expected_batch_s, hung_ranks,
                               kill_if_ours, phase_deadline, probe_device)
from hepti.serve.supervisor import LATE_AFTER_S, Piece, Request, Supervisor, WatchLine
from helpers import serve_emulated, wait_for
from test_emulate import root_env  # noqa: F401 - the fixture: root, MPICH, no leftovers
from test_serve import TEXTS, http, served, single_device, texts_ids, wait_ready  # noqa: F401


# --- the arithmetic -------------------------------------------------------------------------------
def test_a_batch_deadline_is_its_expected_time_times_the_factor_with_a_floor():
    # MiniLM's plan: 20 ms for one input of 128 tokens
    assert expected_batch_s((1, 128), 0.020, (1, 128)) == pytest.approx(0.020)
    # 8 inputs of 64: half the tokens per input, 8 inputs: 4x the tokens
    assert expected_batch_s((8, 64), 0.020, (1, 128)) == pytest.approx(0.080)
    # 256 tokens: twice the tokens, and twice again for attention's square (an overestimate)
    assert expected_batch_s((1, 256), 0.020, (1, 128)) == pytest.approx(0.080)
    # the measured seconds per token, when they say more than the plan
    assert expected_batch_s((4, 100), 0.020, (1, 128), per_token_s=1e-3) == pytest.approx(0.4)
    assert expected_batch_s((4, 100), None, (None, None), per_token_s=1e-3) == pytest.approx(0.4)
    assert expected_batch_s((4, 100)) is None  # a fixed strategy's first batch: nothing known
    # short batches get the floor; a long one its factor; a slow phase or an unknown at least
    # SLOW_PHASE_S
    assert phase_deadline(0.02) == STALL_FLOOR_S
    assert phase_deadline(3.0) == pytest.approx(STALL_FACTOR * 3.0)
    assert phase_deadline(0.02, floor_s=8.0) == 8.0
    assert phase_deadline(0.02, slow=True) == SLOW_PHASE_S
    assert phase_deadline(None) == SLOW_PHASE_S
    assert phase_deadline(0.0) == STALL_FLOOR_S  # between batches
    assert STALL_FLOOR_S > LATE_AFTER_S  # a rank is named late before it is declared lost


def test_the_silent_ranks_are_declared_lost_and_all_silent_drops_none():
    assert hung_ranks({0: 0.2, 1: 4.5, 2: 0.4}, LATE_AFTER_S) == ([1], "some")
    # several silent (two boards behind one switch): all of them, the longest silent first
    assert hung_ranks({0: 0.2, 1: 3.5, 2: 9.0}, LATE_AFTER_S) == ([2, 1], "some")
    # a slow batch whose ranks all beat: nobody
    assert hung_ranks({0: 0.3, 1: 0.5}, LATE_AFTER_S) == ([], "none")
    # every rank silent: nothing tells a hang from our side's stall; none is dropped
    assert hung_ranks({0: 5.0, 1: 6.0}, LATE_AFTER_S) == ([], "all")


def test_a_lost_device_comes_back_after_confirmed_answers_and_a_flapping_one_is_held():
    bench, t = DeviceBench(), 1000.0
    bench.lose("node-b", 1, "silent", t)
    assert bench.due(t + 1) == [] and [d.host for d in bench.due(t + PROBE_EVERY_S)] == ["node-b"]
    bench.record("node-b", False, t + PROBE_EVERY_S)  # still silent
    bench.record("node-b", True, t + 2 * PROBE_EVERY_S)  # answers once: not yet
    assert bench.ready(t + 2 * PROBE_EVERY_S) == []
    bench.record("node-b", False, t + 3 * PROBE_EVERY_S)  # and not again: the count restarts
    for k in range(CONFIRM_PROBES):
        assert bench.ready(t + (4 + k) * PROBE_EVERY_S) == []
        bench.record("node-b", True, t + (4 + k) * PROBE_EVERY_S)
    t_back = t + (3 + CONFIRM_PROBES) * PROBE_EVERY_S
    assert [d.host for d in bench.ready(t_back)] == ["node-b"]
    assert bench.admit("node-b", t_back).ranks == 1 and bench.devices == {}
    # lost again soon after coming back (three changes within FLAP_WINDOW_S): it flaps, and is
    # held FLAP_HOLD_S however well it answers; a further flap doubles the hold
    t2 = t_back + FLAP_WINDOW_S / 2
    d = bench.lose("node-b", 1, "silent", t2)
    assert d.flaps == 1 and d.hold_until == t2 + FLAP_HOLD_S
    for k in range(1, 5):
        bench.record("node-b", True, t2 + k * PROBE_EVERY_S)
    assert bench.ready(t2 + 4 * PROBE_EVERY_S) == []
    assert [d.host for d in bench.ready(t2 + FLAP_HOLD_S)] == ["node-b"]
    bench.admit("node-b", t2 + FLAP_HOLD_S)
    d = bench.lose("node-b", 1, "silent", t2 + FLAP_HOLD_S + 1)
    assert d.flaps == 2 and d.hold_until == t2 + FLAP_HOLD_S + 1 + 2 * FLAP_HOLD_S
    # lost long after coming back: no flap, the re-planner's cooldown only
    bench.admit("node-b", t2 + 1000)
    d = bench.lose("node-b", 1, "silent", t2 + 1000 + FLAP_WINDOW_S + 1)
    assert d.flaps == 0 and d.hold_until == t2 + 1000 + FLAP_WINDOW_S + 1 + COOLDOWN_S


def test_a_probe_needs_the_host_to_answer_and_a_process_there_to_run(monkeypatch):
    """A host answers a connect (accepted or refused), and then a process started on it as its
    ranks are (mpiexec -hosts) must run: a device whose processes are frozen answers the
    connect from its kernel all the same. Silence or an unreachable host fails at the connect."""
    assert probe_device(None)  # this machine runs a new process
    started = []

    def runs(argv, timeout_s):
        started.append(argv)
        return ran
    monkeypatch.setattr(stall, "_runs", runs)
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        monkeypatch.setattr(stall, "PROBE_PORT", srv.getsockname()[1])
        ran = True
        assert probe_device("127.0.0.1", 1.0)  # accepted, and a process ran there
        ran = False
        assert not probe_device("127.0.0.1", 1.0)  # accepted, but nothing runs: frozen
    ran = True
    assert probe_device("127.0.0.1", 1.0)  # now refused: the host answered all the same
    assert all(a[1:5] == ["-n", "1", "-hosts", "127.0.0.1"] for a in started) and len(started) == 3

    def silent(address, timeout):  # a link that drops every packet
        raise TimeoutError("timed out")

    def unreachable(address, timeout):  # its ARP entry gone (emulated: the veth down)
        raise OSError(113, "No route to host")
    for fails in (silent, unreachable):
        monkeypatch.setattr(socket, "create_connection", fails)
        assert not probe_device("node-b", 0.3)
    assert len(started) == 3  # no process started where the connect failed


def test_a_probe_process_that_does_not_end_in_time_is_killed_with_its_children(tmp_path):
    assert stall._runs(["true"], 5.0) and not stall._runs(["false"], 5.0)
    child = tmp_path / "child.pid"
    assert not stall._runs(["sh", "-c", f"sleep 300 & echo $! > {child}; wait"], 1.0)
    pid = int(child.read_text())
    for _ in range(50):  # the killed child is reaped by init shortly
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the probe's child {pid} outlived the probe's timeout")


def test_only_a_process_holding_the_service_secret_is_killed():
    theirs = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, TOKEN_ENV: "s3cret"})
    try:
        os.kill(ours.pid, signal.SIGSTOP)  # a stopped process takes SIGKILL too
        time.sleep(0.2)
        assert not kill_if_ours(theirs.pid, "s3cret") and theirs.poll() is None
        assert not kill_if_ours(ours.pid, "another")
        assert kill_if_ours(ours.pid, "s3cret")
        assert ours.wait(10) == -signal.SIGKILL
        assert not kill_if_ours(None, "s3cret") and not kill_if_ours(2 ** 22 + 7, "s3cret")
    finally:
        for p in (theirs, ours):
            p.kill()
            p.wait()


def test_an_answer_after_the_declaration_is_dropped_and_the_hang_not_counted(minilm_dir):
    """The answer of a batch whose job was declared lost is not written (the batch goes back
    to the head of the queue and runs again: no request answered twice), and the hang does
    not count against its inputs (MAX_ATTEMPTS)."""
    sup = Supervisor(minilm_dir, 2)  # not started: its queue and delivery only
    try:
        req = Request([np.array([1, 2])], np.zeros((1, sup.hidden_size), np.float32), remaining=1)
        batch = [Piece(req, 0, req.inputs[0])]
        sup._stall = {"ranks": [1]}
        assert not sup._deliver(batch, np.ones((1, sup.hidden_size), np.float32), 0)
        assert not batch[0].answered and not req.done.is_set() and not req.out.any()
        for _ in range(3):  # three hangs: still queued, never refused
            sup._requeue(batch, counted=False)
            assert sup._queue.popleft() is batch[0]
        assert batch[0].attempts == 0
        sup._stall = None
        assert sup._deliver(batch, np.ones((1, sup.hidden_size), np.float32), 1)
        assert req.done.is_set() and req.out.all() and sup.counts["inputs_answered"] == 1
        assert sup._deliver(batch, np.ones((1, sup.hidden_size), np.float32), 2)  # a bug's echo
        assert sup.counts["duplicates"] == 1 and sup.counts["inputs_answered"] == 1
    finally:
        sup._tmp.cleanup()


@pytest.fixture
def idle_sup(minilm_dir):
    """A Supervisor that was never started: its bookkeeping only."""
    sup = Supervisor(minilm_dir, 2)
    yield sup
    sup._tmp.cleanup()


def test_only_a_rank_silent_past_the_deadline_is_declared_and_an_ended_one_never(idle_sup):
    sup, now = idle_sup, time.monotonic()
    sup._status = "ok"
    sup.ranks = [{"rank": 0, "host": "a", "pid": None}, {"rank": 1, "host": "b", "pid": None}]

    def lines(silent0, silent1, closed1=False):
        sup._lines = {0: WatchLine(0, "a", None, last=now - silent0),
                      1: WatchLine(1, "b", None, last=now - silent1, closed=closed1)}

    def check(phase_age, deadline=STALL_FLOOR_S, kind="batch"):
        sup._stall = None
        sup._phase = Phase(kind, now - phase_age, deadline, 7 if kind == "batch" else None)
        sup._check_stall(now)
        return sup._stall and sup._stall["ranks"]
    lines(0.3, 5.0)
    assert check(phase_age=STALL_FLOOR_S - 0.5) is None  # silent, but the batch is not late
    assert check(phase_age=STALL_FLOOR_S + 0.5) == [1]  # both: declared lost
    assert sup._stall["phase"] == "batch" and sup._stall["batch"] == 7
    assert check(phase_age=5.0, kind="idle") == [1]  # hung between batches too
    assert check(phase_age=30.0, deadline=SLOW_PHASE_S, kind="switch") is None  # a slow phase
    lines(0.3, 2.0)
    assert check(phase_age=30.0) is None  # a slow batch whose ranks beat: waited for
    lines(0.3, 9.0, closed1=True)
    assert check(phase_age=30.0) is None  # ended (killed, or told to stop): not hung
    lines(6.0, 5.0)
    assert check(phase_age=30.0) == [] and sup._stall["all_silent"]  # relaunched, none dropped
    sup._phase = None  # a deliberate stop: no deadline
    sup._stall = None
    sup._check_stall(now)
    assert sup._stall is None


def test_lost_hosts_leave_the_host_list_and_come_back_in_their_order(idle_sup, tmp_path):
    sup = idle_sup
    sup.entries = [("a", 2), ("b", 1), ("c", 1)]
    sup._first_entries, sup.n, sup._first_n = list(sup.entries), 4, 4
    sup.worker_args = sup._first_args = ["--strategy", "tensor", "--ratios", "4,3,2,1"]
    launch = {}
    sup._drop_ranks([2], launch, "silent")  # rank 2 runs on b (a holds ranks 0-1)
    assert sup.entries == [("a", 2), ("c", 1)] and sup.n == 3
    assert launch["lost"] == {"rank": 2, "host": "b"}
    assert "--ratios" not in sup.worker_args  # made for 4 ranks: planned afresh on 3
    sup._drop_ranks([0, 1], launch, "silent")  # a's two ranks at once
    assert sup.entries == [("c", 1)] and sup.n == 1
    assert launch["lost_ranks"] == {"0": "a", "1": "a"}
    assert {d["host"]: d["ranks"] for d in sup.lost_devices()} == {"b": 1, "a": 2}
    sup._readmit(["b"])
    assert sup.entries == [("b", 1), ("c", 1)] and sup.n == 2 and sup._admitting == [("b", 1)]
    sup._relose({"end": "not ready within 60 s"})  # its launch never said hello: lost again
    assert sup.entries == [("c", 1)] and sup.n == 1
    [b] = [d for d in sup.bench.devices.values() if d.host == "b"]
    assert b.flaps == 1  # lost again right after coming back: held FLAP_HOLD_S
    sup.bench.devices["b"].hold_until = 0.0
    sup._readmit(["a", "b"])
    assert sup.entries == [("a", 2), ("b", 1), ("c", 1)] and sup.n == 4
    assert sup.worker_args == ["--strategy", "tensor", "--ratios", "4,3,2,1"]  # whole again


# MPICH's words when a rank is killed under an ssh launcher (hepti emulate, a hostfile's hosts):
# mpiexec then exits 255, not 9, and only this report names the signal (emu-drop3, -n 3)
KILLED_TAIL = """\
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 25772 RUNNING AT 10.213.0.11
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
=   YOU CAN IGNORE THE BELOW CLEANUP MESSAGES
===================================================================================
[proxy:0@node-a] HYD_pmcd_pmip_control_cmd_cb (pmip_cb.c:490): assert (!closed) failed
[mpiexec@vm] HYDT_bscu_wait_for_completion (bscu_wait.c:109): one of the processes terminated badly; aborting""".splitlines()
# ... and when a rank raised (HEPTI_FAULT_RANK=1 under hepti emulate): exit code 1
ABORTED_TAIL = """\
hepti serve (worker): rank 1 failed: RuntimeError: injected fault (HEPTI_FAULT_RANK=1); aborting all ranks
Abort(1) on node 1 (rank 1 in comm 0): application called MPI_Abort(MPI_COMM_WORLD, 1) - process 1""".splitlines()


def test_a_killed_rank_is_found_from_mpichs_report_when_mpiexec_exits_255(idle_sup):
    """Under an ssh launcher a killed rank makes mpiexec exit 255: the relaunch kept the killed
    device (`hepti emulate ... serve -n 3`, kill -9 of a rank: "the workers exited while idle;
    relaunching on 3"). Its report's EXIT CODE 9 says it was killed; a rank that raised and
    aborted is not taken for a lost device, whatever the exit code."""
    sup, now = idle_sup, time.monotonic()
    sup._lines = {0: WatchLine(0, "node-a", 1, closed=True, closed_at=now + 0.3),
                  1: WatchLine(1, "node-b", 2, closed=True, closed_at=now),
                  2: WatchLine(2, "node-c", 3, closed=True, closed_at=now + 0.2)}
    assert sup._lost_rank(255, KILLED_TAIL) == 1
    assert sup._lost_rank(9) == 1 and sup._lost_rank(-9) == 1  # proxies on this machine
    assert sup._lost_rank(255, KILLED_TAIL[:2]) is None  # no signal named: the hosts stay
    assert sup._lost_rank(1, ABORTED_TAIL) is None
    assert sup._lost_rank(255, KILLED_TAIL + ABORTED_TAIL) is None  # Hydra killed the others
    sup._lines[1].closed, sup._lines[1].closed_at = False, None  # rank 1's line still open
    assert sup._lost_rank(255, KILLED_TAIL) == 2


def test_the_spare_is_kept_for_the_world_one_rank_smaller_only(idle_sup):
    """Which job a spare is started for (`_spare_target`): this machine's world one rank
    smaller, planned afresh when --ratios was made for the world as it is; none with a
    hostfile (which device will be lost is not known ahead), with one rank, with the stall
    handling off, or turned off."""
    sup = idle_sup
    sup.n, sup.worker_args = 3, ["--strategy", "tensor", "--ratios", "3,2,1"]
    assert sup._spare_target() == (2, ["--strategy", "auto"])
    sup.worker_args = ["--strategy", "tensor"]
    assert sup._spare_target() == (2, ["--strategy", "tensor"])
    sup.n = 1
    assert sup._spare_target() is None
    sup.n = 2
    for attr, value in (("entries", [("a", 1), ("b", 1)]), ("stall_floor_s", 0.0),
                        ("spare_enabled", False)):
        before = getattr(sup, attr)
        setattr(sup, attr, value)
        assert sup._spare_target() is None, attr
        setattr(sup, attr, before)
    assert sup._spare_target() == (1, ["--strategy", "tensor"])


def test_a_readmission_starts_ahead_only_with_room_and_a_failed_start_goes_back_to_the_bench(
        idle_sup, monkeypatch):
    """Make-before-break's bookkeeping: the world with the device back is computed without
    touching the serving one's (its ranks' hosts are still read from it); with a hostfile and
    no free-memory reports (--replan off) it is not started ahead (`_start_admission` False:
    stop and relaunch, as before, the log says why); with reports, a device that would run
    both jobs and lacks room for the new one's ranks says so; a job started ahead that never
    says hello leaves the serving world as it was and puts the device back on the bench, held
    as a flapping one."""
    from types import SimpleNamespace

    from hepti.model.sizes import model_bytes
    sup = idle_sup
    sup.entries = [("a", 1), ("b", 1), ("c", 1)]
    sup._first_entries, sup.n, sup._first_n = list(sup.entries), 3, 3
    sup.worker_args = sup._first_args = ["--strategy", "tensor", "--ratios", "3,2,1"]
    sup._drop_ranks([1], {}, "silent")
    assert sup.entries == [("a", 1), ("c", 1)] and sup.n == 2
    sup.bench.devices["b"].answers, sup.bench.devices["b"].hold_until = 2, 0.0
    sup._admit = ["b"]
    assert sup._world_with([sup.bench.devices["b"]]) == (
        [("a", 1), ("b", 1), ("c", 1)], 3, ["--strategy", "tensor", "--ratios", "3,2,1"])
    assert sup.entries == [("a", 1), ("c", 1)] and sup.n == 2  # the serving world: unchanged
    sup.ranks = [{"rank": 0, "pid": None}, {"rank": 1, "pid": None}]
    started = []
    monkeypatch.setattr(sup, "_start_job", lambda *a, **k: started.append(a))
    assert not sup._start_admission() and not started  # no reports: stop and relaunch
    assert sup._admit == ["b"] and "b" in sup.bench.devices  # for `_life`, as before
    assert "no free memory" in sup._no_room_for_both([("a", 1), ("b", 1), ("c", 1)], 3)
    per_rank = model_bytes(sup.config) + stall.RANK_RUNTIME_BYTES
    sup.watcher = SimpleNamespace(free_seen={0: [10 * per_rank] * 3, 1: [0.5 * per_rank] * 3},
                                  base=SimpleNamespace(devices=[SimpleNamespace(usable_bytes=0.0)] * 2))
    why = sup._no_room_for_both([("a", 1), ("b", 1), ("c", 1)], 3)
    assert why is not None and why.startswith("c has"), why  # rank 1 of the serving job is on c
    sup.watcher.free_seen[1] = [10 * per_rank] * 3
    assert sup._no_room_for_both([("a", 1), ("b", 1), ("c", 1)], 3) is None
    # started ahead, never said hello: the serving world stays, the device is benched again
    from hepti.serve.supervisor import _Job
    ended = []
    monkeypatch.setattr(sup, "_end_spare", lambda job, wait=False: ended.append(job))
    back = sup._bench_admit(["b"])
    assert sup.bench.devices == {} and sup._admit == []
    job = _Job(proc=None, reader=None, listener=None, n=3, args=[], started_at=time.time(),
               files_before=None, tail=collections.deque(), admits=back,
               failed="the workers were not ready within 60 s")
    sup._incoming = job
    sup.launches = [{"epoch": 2}]
    assert sup._incoming_settled()
    sup._abandon_incoming()
    assert ended == [job] and sup._incoming is None
    assert sup.entries == [("a", 1), ("c", 1)] and sup.n == 2
    assert sup.bench.devices["b"].flaps == 1 and sup.bench.devices["b"].ranks == 1
    assert sup.launches[-1]["admissions_failed"][0]["hosts"] == ["b"]


# --- end to end -----------------------------------------------------------------------------------
class Clients:
    """Two clients posting in a loop (each request one of `ids`), every answer kept."""

    def __init__(self, embed, ids, n=2):
        self.embed, self.ids = embed, ids
        self.answers: list[tuple[float, int, np.ndarray]] = []  # (when answered, input, row)
        self.spans: list[tuple[float, float]] = []  # (when sent, when answered), monotonic
        self.errors: list[BaseException] = []
        self.sent = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True)
                        for k in range(n)]
        [t.start() for t in self.threads]

    def _run(self, k):
        i = k
        while not self._stop.is_set():
            j = i % len(self.ids)
            i += len(self.threads)
            with self._lock:
                self.sent += 1
            t_sent = time.monotonic()
            try:
                row = self.embed(j)
            except Exception as e:  # noqa: BLE001 - recorded, asserted by the test
                self.errors.append(e)
                continue
            with self._lock:
                self.answers.append((time.monotonic(), j, row))
                self.spans.append((t_sent, self.answers[-1][0]))

    def first_after(self, t0: float) -> float | None:
        with self._lock:
            after = [t for t, _, _ in self.answers if t > t0]
        return min(after) - t0 if after else None

    def stop(self):
        self._stop.set()
        [t.join(300) for t in self.threads]
        assert not any(t.is_alive() for t in self.threads), "a client still waits"


def mono(wall: float) -> float:
    """A time.time() figure (the launches' records) on time.monotonic()'s clock."""
    return wall - time.time() + time.monotonic()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stopped_worker_is_declared_lost_and_its_device_admitted_make_before_break(served,
                                                                                     minilm_dir):
    """SIGSTOP of worker rank 1 of `-n 2` while two clients post in a loop (issue 44): past
    its batch's deadline the rank is declared lost and SIGKILLed, the job relaunched on one
    rank, and answers come again (the issue asks for the first within 10 s of the stop; the
    assertion allows 30 on this shared machine, and the figure is printed). SIGCONT then finds
    the stopped process gone (it was killed). The slot's probe (a process started on this
    machine) answers, and after the hysteresis the device is re-admitted make-before-break:
    the job of 2 ranks is started while the job of 1 serves on, and the service switches to it
    between two batches. The job of 1 answered while the job of 2 loaded, up to its hello; no
    request sent before that load began waited through it (under stop-and-relaunch, every
    request in flight then did). Every request is answered once and equals the single-device
    embeddings.

    One scenario for both halves (the loss, the re-admission): each needs the whole of it
    (a start, a stop, a relaunch, the hysteresis, a second start), which two tests ran twice."""
    sup = served(2, "--strategy", "tensor")
    ids = texts_ids(sup, TEXTS)
    want = single_device(minilm_dir, ids)
    sup.embed(ids)  # up, and its first batch done
    clients = Clients(lambda j: sup.embed([ids[j]])[0], ids)
    stopped = None
    try:
        wait_for("answers before the stop", lambda: len(clients.answers) >= 6, 120)
        victim = next(r for r in sup.ranks if r["rank"] == 1)
        t_stop = time.monotonic()
        os.kill(victim["pid"], signal.SIGSTOP)
        stopped = victim["pid"]
        wait_for("the rank declared lost", lambda: len(sup.launches) >= 2, 60)
        lost = sup.launches[0]
        assert lost["lost"] == {"rank": 1, "host": "localhost"}, lost
        assert lost["stall"]["ranks"] == [1] and lost["stall"]["killed"] == [1], lost["stall"]
        assert sup.launches[1]["n"] == 1
        # the first answer of the job relaunched without it (one in flight as the stop took
        # hold may have come before)
        first = wait_for("an answer after the stop",
                         lambda: clients.first_after(mono(lost["ended_at"])), 120)
        first += mono(lost["ended_at"]) - t_stop
        assert first < 30, first
        wait_for("the stopped process killed", lambda: not _alive(stopped), 30)
        try:
            os.kill(stopped, signal.SIGCONT)  # the board comes back; its process is gone
        except ProcessLookupError:
            pass
        stopped = None
        back = wait_for("the device admitted again", lambda: next(
            (x for x in sup.launches[2:] if x.get("readmitting") and "ready_s" in x), None), 240)
        assert back["n"] == 2 and back["readmitting"] == ["localhost"], back
        n_before = len(clients.answers)
        wait_for("answers on two ranks again", lambda: len(clients.answers) >= n_before + 4, 120)
        assert sup.health()["world_size"] == 2 and sup.health()["lost"] == []
    finally:
        if stopped is not None and _alive(stopped):
            os.kill(stopped, signal.SIGCONT)
        clients.stop()
    assert back["make_before_break"], back
    old = sup.launches[sup.launches.index(back) - 1]
    assert old["n"] == 1 and "switched to the job that re-admits localhost" in old["end"], old
    load_from, hello = mono(back["started_at"]), mono(back["started_at"] + back["ready_s"])
    switched = mono(back["switched_at"])
    assert load_from < hello <= switched  # started ahead; taken after its hello
    during = [t for t, _, _ in clients.answers if load_from < t < hello]
    assert during, "the job without the device answered nothing while the new one loaded"
    waited_through = [(a, b) for a, b in clients.spans if a < load_from and b > hello]
    assert waited_through == [], waited_through
    assert not clients.errors, clients.errors[:3]
    m = sup.metrics()["requests"]
    assert m["accepted"] == m["answered"] == clients.sent + 1 and m["failed"] == 0, m
    assert m["duplicates"] == 0 and m["inputs_answered"] == clients.sent + len(ids), m
    for _, j, row in clients.answers:
        np.testing.assert_allclose(row, want[j], atol=2e-5)
    nxt = sup.launches[1]
    relaunch = "the spare, started ahead" if nxt.get("spare") else \
        f"ready in {nxt['ready_s']:.1f} s"
    print(f"\nSIGSTOP of rank 1 (-n 2, tensor, 2 clients): declared lost "
          f"{mono(lost['stall']['at']) - t_stop:.1f} s after the stop (deadline "
          f"{lost['stall']['deadline_s']:g} s), first answer {first:.1f} s after it (the relaunch "
          f"on 1 rank: {relaunch}); 2 ranks serving again "
          f"{mono(back['started_at'] + back['ready_s']) - t_stop:.1f} s after the stop; "
          f"re-admitted make-before-break: the job of 2 loaded {back['ready_s']:.1f} s while "
          f"the job of 1 answered {len(during)} requests, switched {switched - hello:.3f} s "
          f"after its hello; {m['answered']} requests answered, 0 lost, {m['duplicates']} twice")


def test_a_silent_link_under_emulate_is_handled_as_a_hang(root_env, minilm_dir, tmp_path):  # noqa: F811
    """`hepti emulate` with a schedule that makes two devices' links drop every packet
    ("loss": 100) a few seconds into serving: dev-b's comes back ("loss": 0) later, dev-c's
    never does. Ranks 1 and 2 fall silent and are declared lost together, the service answers
    on dev-a alone, the probes get no answer while the links are silent, and once dev-b's is
    back it is admitted again; dev-c stays lost, probed every few seconds, and the log names
    it when it is lost and not after. Every request is answered once and equals the
    single-device embeddings."""
    # dev-b silent for 18 s: long enough for the declaration (the stall floor, 4 s), the
    # relaunch on dev-a and its probes (every PROBE_EVERY_S) to find the link still silent;
    # a longer silence (it was 28 s) only made the test wait
    loss_at, back_at = 2.0, 20.0
    spec = tmp_path / "three.json"
    spec.write_text(json.dumps({"name": "test-silent", "devices": [
        {"name": "dev-a", "cpu": 0.5, "link_mbit": 500},
        {"name": "dev-b", "cpu": 0.5, "link_mbit": 500},
        {"name": "dev-c", "cpu": 0.5, "link_mbit": 500}], "schedule": [
        {"t": loss_at, "device": "dev-b", "loss": 100}, {"t": loss_at, "device": "dev-c", "loss": 100},
        {"t": back_at, "device": "dev-b", "loss": 0}]}))
    p, url, said = serve_emulated(spec, minilm_dir, "--strategy", "tensor", usr1=True)
    clients = None
    try:
        wait_ready(url, timeout=300)
        texts = TEXTS[:3]
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
        tok.no_padding()
        want = single_device(minilm_dir, [e.ids for e in tok.encode_batch(texts)])

        def embed(j):
            code, body = http(url + "/v1/embeddings", {"input": texts[j]})
            if code != 200:
                raise AssertionError(f"{code}: {body}")
            return np.array(body["data"][0]["embedding"], np.float32)
        embed(0)
        clients = Clients(embed, texts)
        wait_for("answers before the loss", lambda: len(clients.answers) >= 4, 120)
        t0 = time.monotonic()
        p.send_signal(signal.SIGUSR1)  # the schedule's clock starts
        launches = lambda: http(url + "/metrics")[1]["launches"]  # noqa: E731
        lost = wait_for("ranks 1 and 2 declared lost",
                        lambda: next((x for x in launches() if x.get("stall")), None), 90)
        assert lost.get("lost_ranks") == {"1": "10.213.0.11", "2": "10.213.0.12"}, json.dumps(lost)
        # an emulated device's rank shares this machine's pids: killed where it hangs
        assert sorted(lost["stall"]["ranks"]) == [1, 2] and \
            sorted(lost["stall"]["killed"]) == [1, 2], lost
        first = wait_for("an answer on dev-a alone",
                         lambda: clients.first_after(mono(lost["ended_at"])), 120)
        first += mono(lost["ended_at"]) - (t0 + loss_at)
        assert first < 30, first
        # silent until back_at: probed without an answer, not re-admitted
        code, m = http(url + "/metrics")
        if time.monotonic() < t0 + back_at - 1:
            assert len(m["ranks"]) == 1, m["ranks"]
            assert all(d["answered_in_a_row"] == 0 for d in m["stall"]["lost_devices"]), m["stall"]
        back = wait_for("dev-b admitted again", lambda: next(
            (x for x in launches() if x.get("readmitting") and "ready_s" in x), None),
            back_at + 240)
        assert back["readmitting"] == ["10.213.0.11"], back
        assert mono(back["started_at"]) > t0 + back_at, back  # not while it was silent
        n_before = len(clients.answers)
        wait_for("answers on two devices again", lambda: len(clients.answers) >= n_before + 3, 120)
        # dev-c probed a few times while the service goes on (the silence is not waited out)
        wait_for("dev-c probed 3 times", lambda: all(
            d["probes"] >= 3 for d in http(url + "/metrics")[1]["stall"]["lost_devices"]),
            10 * PROBE_EVERY_S)
        clients.stop()
        code, m = http(url + "/metrics")  # every request sent has its answer now
        assert [r["host"] for r in m["ranks"]] == ["dev-a", "dev-b"]
        [never] = m["stall"]["lost_devices"]  # dev-c: still lost, still probed
        assert never["host"] == "10.213.0.12" and never["probes"] >= 3, never
        assert never["answered_in_a_row"] == 0, never
    finally:
        if clients is not None:
            clients.stop()
        p.send_signal(signal.SIGINT)
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
    assert not clients.errors, clients.errors[:3]
    req = m["requests"]
    assert req["accepted"] == req["answered"] == clients.sent + 1 and req["failed"] == 0, req
    assert req["duplicates"] == 0, req
    for _, j, row in clients.answers:
        np.testing.assert_allclose(row, want[j], atol=2e-5)
    # the link that never came back: named when lost, then probed without a word
    named = [x for x in said if "10.213.0.12" in x and "hepti: " in x]
    assert 1 <= len(named) <= 2, named
    print(f"\nsilent links of dev-b and dev-c at t={loss_at:g} s (emulated, -n 3, tensor, 2 "
          f"clients): declared lost {mono(lost['stall']['at']) - t0 - loss_at:.1f} s after the "
          f"loss, first answer {first:.1f} s after it (on dev-a alone); dev-b's link back at "
          f"t={back_at:g} s, 2 devices serving again "
          f"{mono(back['started_at'] + back['ready_s']) - t0 - back_at:.1f} s after; dev-c "
          f"never back: {never['probes']} probes unanswered, named in {len(named)} log line(s); "
          f"{req['answered']} requests answered, 0 lost, {req['duplicates']} twice")


def test_a_killed_rank_under_emulate_is_dropped_and_its_device_taken_back(root_env, minilm_dir,  # noqa: F811
                                                                          tmp_path, monkeypatch):
    """`kill -9` of worker rank 1 of `hepti serve -n 3` under `hepti emulate`, while idle. The
    proxies run through an ssh launcher there, so mpiexec mostly exits 255, not 9: the relaunch must
    still go without the killed rank's device (2 ranks, it used to keep all 3), and once its
    device answers the probes it comes back, to 3 ranks and never more. The answers equal the
    single-device embeddings.

    Before the kill, what any service under `hepti emulate` must do: the workers run on the
    emulated devices (their hostnames are the devices' names) and the test, in the host's
    network namespace, reaches the service at 127.0.0.1:PORT (test_serve.py's own emulated
    service checked only this; it is checked here, on a service this test starts anyway).

    The job of 2 serves 1 s before the device is taken back, not SERVE_BEFORE_ADMIT_S (10 s;
    `-k stopped` waits it): the probes' hysteresis is already over when the relaunch says
    hello here, so that wait was all this test waited for."""
    monkeypatch.setenv("HEPTI_SERVE_BEFORE_ADMIT_S", "1")
    spec = tmp_path / "three.json"
    spec.write_text(json.dumps({"name": "test-kill", "devices": [
        {"name": f"dev-{c}", "cpu": 0.4, "link_mbit": 500} for c in "abc"]}))
    p, url, said = serve_emulated(spec, minilm_dir, "--strategy", "tensor")
    try:
        assert url.startswith("http://127.0.0.1:"), url
        wait_ready(url, timeout=300)
        text = "A cat sat on the mat."
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
        tok.no_padding()
        want = single_device(minilm_dir, [tok.encode(text).ids])[0]

        def embed():
            code, body = http(url + "/v1/embeddings", {"input": text})
            assert code == 200, body
            return np.array(body["data"][0]["embedding"], np.float32)
        np.testing.assert_allclose(embed(), want, atol=2e-5)
        m = http(url + "/metrics")[1]
        assert [r["host"] for r in m["ranks"]] == ["dev-a", "dev-b", "dev-c"], m["ranks"]
        pid = next(r["pid"] for r in m["ranks"] if r["rank"] == 1)
        os.kill(pid, signal.SIGKILL)
        launches = lambda: http(url + "/metrics")[1]["launches"]  # noqa: E731
        nxt = wait_for("the relaunch", lambda: (lambda x: x[1] if len(x) > 1 and "ready_s" in x[1]
                                                else None)(launches()), 240)
        first = launches()[0]
        # mostly 255 (the ssh launcher's code, the signal named only in the job's report), at
        # times 9 when Hydra's report of the signal wins the race: either way the rank is found
        assert first["exit_code"] not in (0, None), first
        assert first.get("lost") == {"rank": 1, "host": "10.213.0.11"}, first
        assert nxt["n"] == 2 and nxt["hosts"] == ["10.213.0.10", "10.213.0.12"], nxt
        np.testing.assert_allclose(embed(), want, atol=2e-5)
        # the device itself answers (only its process was killed): taken back after the
        # hysteresis, to the world first asked for
        back = wait_for("the device taken back", lambda: next(
            (x for x in launches() if x.get("readmitting") and "ready_s" in x), None), 240)
        assert back["n"] == 3 and back["readmitting"] == ["10.213.0.11"], back
        np.testing.assert_allclose(embed(), want, atol=2e-5)
        assert max(x["n"] for x in launches()) == 3, launches()
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(90)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(30)
    print(f"\nkill -9 of rank 1 under hepti emulate (-n 3): mpiexec exited {first['exit_code']}, "
          f"relaunched on {nxt['n']} rank(s) ({', '.join(nxt['hosts'])}), the device back on "
          f"{back['n']}")


def test_a_smaller_world_plans_on_the_serving_profile_s_figures(tmp_path):
    """A relaunch without a lost device (or a spare) gets `--profile` with the serving
    profile's rows for the devices it runs on, instead of measuring a profile first (17 s of
    a 19 s relaunch after emu-silent3's link went quiet); a world with a device the profile
    does not cover (a re-admission) gets none and uses its cached one."""
    import tempfile
    sup = Supervisor.__new__(Supervisor)
    sup._tmp = tempfile.TemporaryDirectory(dir=tmp_path)
    prof = {"hepti_profile": 1, "devices": [{"rank": r, "name": f"d{r}"} for r in range(3)]}
    hosts = ["10.0.0.10", "10.0.0.11", "10.0.0.12"]
    sup._profile = (prof, hosts)
    args = sup._known_profile(2, ["10.0.0.10", "10.0.0.12"], ["--strategy", "auto"])
    assert args[0] == "--profile"
    got = json.loads(open(args[1]).read())
    assert [(d["rank"], d["name"]) for d in got["devices"]] == [(0, "d0"), (1, "d2")]
    assert sup._known_profile(3, hosts, []) == []  # the whole world: its cached profile
    assert sup._known_profile(2, ["10.0.0.10", "10.0.0.99"], []) == []  # a device it lacks
    assert sup._known_profile(2, hosts[:2], ["--profile", "x.json"]) == []  # given already
    assert sup._known_profile(2, None, [])[0] == "--profile"  # this machine: slots alike
    sup._profile = (None, None)
    assert sup._known_profile(2, hosts[:2], []) == []
