"""hepti.emulate.stretch: the bookkeeping (fake clocks, any user) and the uniform slowdown of
an emulated device (root: a real `hepti emulate` run, the one timing threshold the issue asks
for)."""
from __future__ import annotations

import json
import os
import sys

import pytest

from hepti.emulate import stretch
from hepti.emulate.state import DEVICE_ENV
from test_emulate import root_env  # noqa: F401 - the fixture: root, MPICH, no leftovers


class FakeClocks:
    """process_time, thread_time, perf_counter and sleep of one made-up process."""

    def __init__(self):
        self.wall = self.proc = self.thread = 0.0
        self.slept = []

    def run(self, cpu: float, main: bool = True, wall: float | None = None):
        """The process computes `cpu` seconds (on the main thread or another) over `wall`."""
        self.proc += cpu
        if main:
            self.thread += cpu
        self.wall += cpu if wall is None else wall

    def tick(self) -> float:
        """The wall clock, a tenth of a microsecond later than last read (a spin ends)."""
        self.wall += 1e-7
        return self.wall

    def sleep(self, s: float):
        self.slept.append(s)
        self.wall += s


@pytest.fixture
def clocks(monkeypatch):
    c = FakeClocks()
    monkeypatch.setattr(stretch.time, "process_time", lambda: c.proc)
    monkeypatch.setattr(stretch.time, "thread_time", lambda: c.thread)
    monkeypatch.setattr(stretch.time, "perf_counter", c.tick)
    monkeypatch.setattr(stretch.time, "sleep", c.sleep)
    stretch.enable(0.25)
    yield c
    stretch.disable()


def test_compute_span_pays_cpu_over_share(clocks):
    stretch.span_enter("compute")
    clocks.run(0.004)
    stretch.span_exit("compute")
    assert clocks.wall == pytest.approx(0.004 / 0.25, abs=1e-5)  # 4 ms of work at a quarter core: 16 ms


def test_small_debt_is_carried_then_paid_before_a_wait(clocks):
    stretch.span_enter("compute")
    clocks.run(1e-5)  # 30 us owed: below PAY_MIN_S, carried
    stretch.span_exit("compute")
    assert clocks.wall == pytest.approx(1e-5, abs=2e-6)
    stretch.span_enter("allgatherv")  # a collective must not start before the work is done
    assert clocks.wall == pytest.approx(4e-5, abs=2e-6)


def test_waiting_is_not_work_but_a_background_thread_is(clocks):
    stretch.span_enter("recv")
    clocks.run(0.002)  # the main thread polls: not work
    clocks.run(0.001, main=False, wall=0.0)  # a prefetch thread loads beside it: work
    stretch.span_exit("recv")
    # 1 ms of background work needs 4 ms of the virtual CPU; the wait gave it 2 ms
    assert stretch._backlog == pytest.approx(0.002, abs=1e-5)
    stretch.span_enter("compute")
    stretch.span_exit("compute")
    assert clocks.wall == pytest.approx(0.004, abs=1e-5)


def test_idle_time_is_not_banked(clocks):
    stretch.span_enter("sleep")
    clocks.run(0.0, wall=0.1)
    stretch.span_exit("sleep")
    stretch.span_enter("compute")
    clocks.run(0.001)
    stretch.span_exit("compute")
    assert clocks.wall == pytest.approx(0.1 + 0.004, abs=1e-5)


def test_preempted_compute_sleeps_only_the_rest(clocks):
    stretch.span_enter("compute")
    clocks.run(0.001, wall=0.003)  # descheduled or throttled for 2 ms of it
    stretch.span_exit("compute")
    assert clocks.wall == pytest.approx(0.004, abs=1e-5)


def test_settle_forfeits_an_oversleeps_credit(clocks, monkeypatch):
    """A payment that oversleeps leaves credit (up to CREDIT_MAX_S) that the next work spends
    unstretched; a measurement settles first, so its work is stretched in full (issue 44: the
    idle rank's 0.45 ms probe calls read 0.40x after an oversleep)."""
    stretch.span_enter("compute")
    clocks.run(0.001)
    monkeypatch.setattr(stretch.time, "sleep", lambda s: clocks.sleep(s + 0.005))  # 5 ms late
    stretch.span_exit("compute")
    assert stretch._backlog == pytest.approx(-stretch.CREDIT_MAX_S)
    monkeypatch.setattr(stretch.time, "sleep", clocks.sleep)
    stretch.settle()
    assert stretch._backlog == 0.0
    t0 = clocks.wall
    stretch.span_enter("batch")
    clocks.run(0.0005)
    stretch.span_exit("batch")
    assert clocks.wall - t0 == pytest.approx(0.0005 / 0.25, abs=1e-5)


def test_profile_rounds_start_level(clocks):
    """`_timed_many` (the profile's rounds and the speed probe) settles before each round: a
    credit left by an earlier oversleep does not shorten the round."""
    from hepti.parallel.profile_compute import _timed_many
    stretch._backlog = -stretch.CREDIT_MAX_S  # an earlier payment overslept
    per_call = _timed_many({0: lambda: clocks.run(1e-4)}, rounds=1, window=1e-3)[0]
    assert per_call == pytest.approx(1e-4 / 0.25, rel=0.01)


def test_tracer_counts_the_stretch_as_compute(clocks):
    from hepti.parallel.trace import Tracer
    tr = Tracer(0)
    with tr.span("gemm", "compute"):
        clocks.run(0.002)
    assert tr.seconds["compute"] == pytest.approx(0.008, abs=1e-5)


def test_off_outside_the_emulator():
    if os.environ.get(DEVICE_ENV) is None:
        assert not stretch.ON
    assert stretch.stretch_wanted({stretch.ENV: "1"}) and not stretch.stretch_wanted({stretch.ENV: "0"})
    assert stretch.stretch_wanted({})  # on by default (under hepti emulate only: ON above)
    from hepti.emulate import state  # the names the stretch reads without importing it
    assert (stretch.DEVICE_ENV, stretch.STATE_ENV) == (state.DEVICE_ENV, state.STATE_ENV)


def test_a_long_wait_wakes_seldom_and_sees_its_message_soon():
    """A capped rank's sleeping wait (hepti.parallel.comm `sleep_interval`): short waits test
    every WAIT_SLEEP_S as before; a long one backs off, so that the waiting ranks of a pipeline
    stop waking on the cores the computing rank uses, and sees its message at most a sixteenth
    of its wait (and WAIT_SLEEP_MAX_S) late; a wait shorter than WAIT_BACKOFF_AFTER_S (a band's
    halo exchange) tests every WAIT_SLEEP_S as before."""
    from hepti.parallel import comm
    assert comm.sleep_interval(0.0) == comm.sleep_interval(3.9e-3) == comm.WAIT_SLEEP_S
    steps = [comm.sleep_interval(t * 1e-4) for t in range(1000)]
    assert steps == sorted(steps) and max(steps) == comm.WAIT_SLEEP_MAX_S
    for wait_s in (0.5e-3, 3e-3, 7e-3, 30e-3):  # a message arriving after wait_s
        t = tests = 0
        while t < wait_s:
            t += comm.sleep_interval(t)
            tests += 1
        late = t - wait_s
        assert late <= max(comm.WAIT_SLEEP_S, min(wait_s / 16, comm.WAIT_SLEEP_MAX_S)) + 1e-12
        # 20 tests a millisecond for 4 ms, then 17/16 of the time waited each, then 0.5 ms
        assert tests <= 80 + 23 + max(0.0, wait_s - 8e-3) / comm.WAIT_SLEEP_MAX_S + 1
    assert tests < 160  # a 30 ms wait (the last stage of MobileNetV2's pipeline): 600 at 50 us


SHARES = (0.15, 0.3, 0.6)
TOLERANCE = 0.10
# A 0.1 ms phase is judged against the matched hub reference alone (each hub phase one device
# cycle after the last): on this VM the CPU such a phase takes is itself 1.0-1.5x its
# back-to-back time, by how long the core idled before it (0.096 ms warm, 0.148 ms after 0.6 ms
# asleep: the docstring of hepti.bench.slowdown), and a device slowed by sleeping idles between
# phases by construction, so against the back-to-back hub it reads up to 1.1-1.8 at share 0.15.
# With the guard quota at 1.25x the share, 0.1 ms phases between MPI exchanges at 0.15 core read
# 1.11-1.15 of the matched reference (throttled 0.16 ms each after polling spent the quota);
# with 2x (hepti.emulate.stretch.GUARD), every 0.1 ms phase read 0.94-1.06 of it on a quiet
# host (2026-11-26, 49d578f). On a loaded host (another suite beside it) one read 1.28: run it
# alone. The quota alone ran these phases at 0.24-0.83 of their nominal time.
SHORT_S, SHORT_TOLERANCE = 1e-4, 0.10


OPT_IN = "HEPTI_SLOWDOWN_TEST"


def test_uniform_slowdown(root_env, tmp_path):  # noqa: F811
    """Under `hepti emulate`, a device at share s runs GeMM phases of 1, 10 and 100 ms (sized on
    an uncapped hub) in 1/s of the hub's time, within 10% of both hub references, and phases of
    0.1 ms within 10% of the matched one (SHORT_TOLERANCE), back to back and between waits (a
    sleep, an MPI exchange): hepti.bench.slowdown, one launch per share, the median of 2 rounds per
    phase and way, each against the hub's block right before it. About 5 minutes."""
    if os.environ.get(OPT_IN) != "1":
        pytest.skip(f"takes 5 minutes of a quiet machine (two copies run at once by two suites "
                    f"failed each other); run it with {OPT_IN}=1 as root")
    from hepti.bench import slowdown
    runs = []
    for share in SHARES:
        r = slowdown.launch(share, "stretch", 2, tmp_path)
        r["mode"] = "stretch"
        runs.append(r)
    table = slowdown.summarize(runs)
    print("\n" + slowdown.format_table(table))
    bad = []
    for share, row in table["stretch"].items():
        for name, ph in row["phases"].items():
            short = name == f"{SHORT_S * 1e3:g}ms"
            tol = SHORT_TOLERANCE if short else TOLERANCE
            refs = ("_matched",) if short else ("", "_matched")
            for way in slowdown.WAYS:
                for ref in refs:
                    ratio = ph[f"{way}_median_ratio{ref}"]
                    if abs(ratio - 1.0) > tol:
                        bad.append(f"share {share} {name} {way}{ref or ''}: {ratio:.2f} "
                                   f"(allowed {1 - tol:.2f}-{1 + tol:.2f})")
    assert not bad, "not within its tolerance of 1/share of the uncapped time: " + "; ".join(bad)
    json.dumps(table)  # the summary stays JSON


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
