"""Watching the plan while serving: each batch's per-rank times against the cost model's, drift
detection, and the re-fit of the profile that the planner then re-solves on.

**Residuals.** Per batch and rank, x = log(measured / predicted), for compute (the rank's own
kernels: its speed) and for communication (time inside collectives, which includes waiting for
slower peers and the links). Predictions come from the same cost model the planner used, for
the batch's own shape, on the current profile.

**Detection: CUSUM with a baseline and a two-sample confirmation.** A series' baseline mu0 is
the median of its first `BASELINE_N` residuals after a (re)start: the cost model's standing
bias for that rank (a few percent) is not a change. Then the two one-sided sums
S+ = max(0, S+ + x - mu0 - DELTA) and S- = max(0, S- - x + mu0 - DELTA) alarm past LAMBDA,
each residual adding at most SAMPLE_CAP x LAMBDA, and only when the last two residuals both
lie beyond mu0 +- DELTA: one outlier (a neighbour's burst on a shared host) never alarms
alone, nor with one ordinary sample after it. Why CUSUM and not Page-Hinkley: PH compares with
the running mean since the start, which absorbs part of a step and so alarms later; against a
frozen baseline a step of size d > DELTA alarms after max(2, ceil(LAMBDA / (d - DELTA)))
batches: a halved or doubled speed (|d| = 0.69) on the 2nd batch after it. A step under
SMALL_STEP (1.5x) must also have lasted PERSIST_N batches, as a neighbour's burst on a shared
host does not: a 25% slowdown alarms on the 6th (tests/test_serve_monitor.py). False alarms, simulated on Gaussian residual noise:
none in 200,000 batches at a standard deviation of 0.03 or 0.05, one at 0.08; a series whose
warm-up is noisier than that widens its own bounds (DELTA to 2.5 sigma, LAMBDA to 6 sigma).
The re-planner waits one more batch before it acts, and sizes the step by the median of the
last three residuals (the first after a change may straddle it).

**Flags: one large residual, at once.** CUSUM is built for small shifts; a device that halves
its speed or a link that drops tenfold moves a residual by 0.7-2.2 (log) in one batch. So each
series also flags a single residual beyond `FLAG_MIN` (35%), or `FLAG_SIGMA` of its own noise
if that is more, as soon as it is seen (a Shewhart rule beside the CUSUM): the flag is the
detection `/metrics` reports. The flag alone does nothing; when the next residual lies beyond
the flag's bound on the same side, the step is confirmed (`Alarm.fast`) and sized by that
second residual alone (the flagged one may straddle the change). One outlier, or an outlier
and an ordinary batch, never confirms: on Gaussian noise of 5%, a flag needs a 6-sigma sample.

**A link that flaps.** A link that swings between two rates every few seconds moves the
communication residuals up and down by turns: each swing may be too short to confirm, and a
baseline learnt across them sits between the two. So the monitor also keeps each rank's last
`SWING_N` communication residuals and raises a flap alarm (`Alarm.flap`) when they cross
between high and low (the outer quarters of their range) at least `SWING_CHANGES` times,
spanning at least `SWING_RANGE`. The re-planner then probes the links over the next batches
(hepti.serve.replan) to find which one swings and its worst state.

**Telling compute from links.** A slower rank raises its own compute residual; every rank
then waits longer at collectives, so communication residuals rise too. A communication alarm
therefore counts only in a batch where no compute residual alarms, and it triggers a brief
re-probe of the links (rank 0's ping-pong with each rank, hepti.serve.worker): the link that
changed is the one whose measured bandwidth or latency moved.
"""
from __future__ import annotations

import dataclasses
import math
import statistics
from collections import OrderedDict

from hepti.plan.partition import make_plan
from hepti.plan.profile import SpeedTable

DELTA = 0.10  # residual drift allowed (log): 10%, or 2.5 sigma of the series if that is more
LAMBDA = 0.40  # CUSUM alarm threshold (log), or 6 sigma of the series if that is more
BASELINE_N = 6  # residuals that set a series' baseline and noise after a (re)start
FLAG_MIN, FLAG_SIGMA = 0.30, 5.0  # one residual this far out flags a change (log; see above)
SAMPLE_CAP = 0.7  # of LAMBDA: what one residual may add to a sum (two are needed to alarm)
# A moderate step (under SMALL_STEP, log) alarms only once it has lasted: at least
# PERSIST_N - 1 of the series' last PERSIST_N residuals beyond DELTA on its side. A neighbour's
# burst on a shared host lasts a few seconds: bench-adapt --quiet at 2618843 saw ranks 1 and 2
# compute 1.35-1.43x for three batches (2.4 s) with nothing changed, and re-planned on rank 2's
# 1.33x. Larger steps (a halved CPU, a link 9x slower) are not delayed: they flag and confirm
# on the next batch.
SMALL_STEP, PERSIST_N = math.log(1.5), 6
SKIP_N = 3  # batches of a new plan not watched at all (first touch of buffers, caches)
# an idle rank: the median of its last IDLE_WINDOW reports (each the speed probe's median of
# 3 rounds, hepti.parallel.profile_compute.SpeedProbe) moved 1.8x (single probes at 0.2 core read
# 0.7-2.3x of the truth on this shared host: bench-adapt's first run). 1.6x until 12565b5,
# whose quiet pairs switched once in 600 s on the 0.15-core device's window reading 0.62x
# (1.61x); the changes an idle rank must be seen to make in bench-adapt are 2x and more (a
# halved or restored CPU, 0.15 -> 0.05 core)
IDLE_N, IDLE_MOVE = 3, 1.8
IDLE_FLAG = math.log(2.0)  # one report this far (log) from the rank's factor flags it
IDLE_WINDOW = 5  # the reports whose median is an idle rank's factor (IdleWatch)
MIN_PREDICTED_S = 2e-3  # series whose prediction is shorter than this are too noisy to watch
# Communication includes waiting for the slowest peer, so its residual carries every rank's
# compute noise: 2-7x swings on 2-rank MiniLM batches whose transfers are predicted at a few
# ms (940 Mbit/s). It is watched with wider bounds, and only where transfers alone (not the
# wait) are predicted to take MIN_TRANSFER_S: a link that drops from 940 to 100 Mbit/s makes
# them about 9x longer (log 2.2), still 2 batches to an alarm.
COMM_DELTA, COMM_LAMBDA, MIN_TRANSFER_S = 0.35, 1.2, 3e-3
# A communication residual flags at 1.8x (its noise is wider than compute's). It was e (2.7x):
# the request a link drop lands in carries the drop for part of its collectives only, and was
# not flagged (bench-adapt at eaf09ea: node-c's 940 -> 100 Mbit/s flagged 2.0 s after, on the
# next request). A false flag costs a light probe of the links (~50 ms), which clears it.
COMM_FLAG_MIN = math.log(1.8)
SWING_N, SWING_CHANGES, SWING_RANGE = 7, 3, math.log(2.0)  # a flapping link (see above)
# Nothing alarms before the baselines (SKIP_N + BASELINE_N batches, 8-10 s at BERT-base), so a
# link flapping from 2 s in is seen 9-15 s in. Tried at 78763a5 and reverted: one residual 1.8x
# over the plan's prediction while learning set off the link probes at once. bench-adapt
# --flap read 1.33x the better fixed plan (rounds 1.33, 1.11, 1.40) against 1.11x without it:
# at 3-5 s the idle rank's standby copy is not in yet, so the new plan had to load (a 3.7 s
# stall), or its load cost kept the old plan while the link stayed held at its worst.


class Cusum:
    """Two-sided CUSUM on log residuals against a frozen baseline (see the module docstring)."""

    def __init__(self, delta: float = DELTA, lam: float = LAMBDA, flag_min: float = FLAG_MIN):
        self.baseline: float | None = None
        self.delta, self.lam, self.flag_bound = delta, lam, flag_min
        self.flag = 0  # +1 / -1: the last residual lay beyond flag_bound on that side
        self.fast = False  # the last alarm was a confirmed flag (sized by `last[-1]` alone)
        self.flagged = False  # the last residual raised a flag the one before had not
        self.warm: list[float] = []
        self.up = self.down = 0.0
        self.last: list[float] = []
        self.recent: list[float] = []  # the last three (the step's size, once confirmed)
        self.history: list[float] = []  # the last PERSIST_N (a moderate step's persistence)

    def add(self, x: float) -> int:
        """Take one residual; +1 (slower than predicted), -1 (faster) or 0 (no alarm)."""
        if self.baseline is None:
            self.warm.append(x)
            if len(self.warm) >= BASELINE_N:
                self.baseline = statistics.median(self.warm)
                sigma = 1.4826 * statistics.median(abs(w - self.baseline) for w in self.warm)
                self.delta, self.lam = max(self.delta, 2.5 * sigma), max(self.lam, 6 * sigma)
                self.flag_bound = max(self.flag_bound, FLAG_SIGMA * sigma)
            return 0
        d = x - self.baseline
        before, self.flag = self.flag, (d > self.flag_bound) - (d < -self.flag_bound)
        self.flagged = bool(self.flag) and self.flag != before
        cap = SAMPLE_CAP * self.lam  # one sample, however far out, fills at most this much
        self.up = max(0.0, self.up + min(d - self.delta, cap))
        self.down = max(0.0, self.down + min(-d - self.delta, cap))
        self.last = (self.last + [d])[-2:]
        self.recent = (self.recent + [d])[-3:]
        self.history = (self.history + [d])[-PERSIST_N:]
        # two residuals in a row beyond the flag's bound, on the same side, the second a step
        # of SMALL_STEP at least (a moderate one goes the CUSUM's way, which asks it to last)
        self.fast = bool(before and self.flag == before) and abs(d) >= SMALL_STEP
        if self.fast:
            return before
        if self.up > self.lam and len(self.last) == 2 and min(self.last) > self.delta \
                and self._lasted(1):
            return 1
        if self.down > self.lam and len(self.last) == 2 and max(self.last) < -self.delta \
                and self._lasted(-1):
            return -1
        return 0

    def _lasted(self, side: int) -> bool:
        """A step of SMALL_STEP or more, or one that has lasted (see PERSIST_N)."""
        if abs(statistics.median(self.recent)) >= SMALL_STEP:
            return True
        return sum(side * d > self.delta for d in self.history) >= PERSIST_N - 1

    def shift(self) -> float:
        """The step's size in log: after a confirmed flag, the last residual less the baseline;
        else the median of the last three (at an alarm the first of them may straddle the
        change: see PlanWatcher's confirmation)."""
        if self.fast and self.last:
            return self.last[-1]
        return statistics.median(self.recent) if self.recent else 0.0

    def restart(self) -> None:
        """After a re-fit of the same plan: the sums from zero, the baseline and noise kept."""
        self.up = self.down = 0.0
        self.last, self.recent, self.history = [], [], []
        self.flag, self.fast, self.flagged = 0, False, False


@dataclasses.dataclass
class Alarm:
    kind: str  # "compute" or "comm"
    rank: int
    direction: int  # +1 slower, -1 faster
    factor: float  # measured / predicted, against the baseline
    absolute: bool = False  # the rank's whole speed factor, not a step (an idle rank's probes)
    fast: bool = False  # a confirmed flag: two large residuals in a row, sized by the second
    flap: bool = False  # communication that swings up and down by turns (a flapping link)


class IdleWatch:
    """An idle rank's speed, from its probes (hepti.parallel.profile_compute.SpeedProbe, run after
    each batch by hepti.serve.worker): the median of its last IDLE_WINDOW reports (at least
    IDLE_N) against the profile's own reading of the same probe (`probe_s`) is its factor,
    after every report. The probe and the profile measure the same GeMM the same way, so a
    device whose speed did not change reads 1.0x its profile, up to the standing offset that
    every rank shows between the host's load when the profile was measured and now: the
    monitor passes the busy ranks' (`host_bias`), as their own residuals are judged against
    their baselines, not against the profile. On the busy AVX-512 host the 0.4-core device
    read 0.80x its probe_s while the busy ranks computed 0.77-0.86x their profiled times.

    Until 2026-11-29 the baseline was the median of the rank's first IDLE_N reports while
    idle, at the factor it had then, and the probe a few single calls: on the AVX-512 machine
    those calls were shorter than the stretch's credit for an oversleep and read 0.4x or 0.8-1x
    by turns, and an unchanged idle device probed 0.48x its baseline (issue 44: four switches,
    each rolled back, in quiet minutes). A profile without `probe_s` (declared, or measured
    before it) still learns the baseline that way (`profiled_s` None). The window slides, so a
    change is seen as soon as the window's majority has it, whatever the phase (in disjoint
    blocks of 3, node-d's fall to 0.05 core was seen 1.4 s after it in one run and 3.4 s in the
    next, df403be); it holds 5, as a sliding window of 3 tests three times as often and read
    the 0.15-core device 0.60x once in 300 quiet seconds (a false switch, 2a9e56f). The
    detection comes first anyway: `last` is the latest report alone, which the monitor flags
    at 2x."""

    def __init__(self, factor: float, profiled_s: float | None = None):
        self.profiled = profiled_s is not None
        # against the profile the factor is absolute (the profile's speed is 1.0); against a
        # learnt baseline it is relative to the factor the rank had while it was learnt
        self.factor = 1.0 if self.profiled else factor
        self.base, self.seen = profiled_s, []
        self.last: float | None = None

    def add(self, probe_s: float, host_bias: float = 1.0) -> float | None:
        """One report; the rank's factor (the median of the window), or None while there are
        fewer than IDLE_N reports (or the baseline is still being learnt). `host_bias`: the
        busy ranks' measured over profiled compute at their baselines (against the profile
        only)."""
        if self.base is None:
            self.seen.append(probe_s)
            if len(self.seen) == IDLE_N:
                self.base = statistics.median(self.seen)
            return None
        base = self.base * (host_bias if self.profiled else 1.0)
        self.seen = (self.seen + [probe_s])[-IDLE_WINDOW:]
        self.last = self.factor * probe_s / base
        if len(self.seen) < IDLE_N:
            return None
        return self.factor * statistics.median(self.seen) / base


class Monitor:
    """Per-rank detectors for one plan (restarted at every switch or re-fit)."""

    def __init__(self, cfg, profile, plan):
        self.cfg, self.profile, self.plan = cfg, profile, plan
        self.compute: dict[int, Cusum] = {}
        self.comm: dict[int, Cusum] = {}
        self.idle: dict[int, IdleWatch] = {}  # ranks with no share: their speed
        self.comm_lambda = COMM_LAMBDA  # raised after probes that found nothing (PlanWatcher)
        self._predicted: OrderedDict = OrderedDict()
        self.batches = 0
        self.flags: list[Alarm] = []  # series that flagged on the last batch (newly)
        self.swings: dict[int, list[float]] = {}  # each rank's last SWING_N comm residuals
        self.swing_range = SWING_RANGE  # doubled by a probe burst that found no flapping link

    def host_bias(self) -> float:
        """The busy ranks' standing offset from the profile: the median of their compute
        series' baselines (measured over predicted, learnt on their first batches), 1.0 before
        any is learnt. What the host's load at profile time put into every rank's figures, the
        idle rank's probe_s too (`IdleWatch`)."""
        learnt = [c.baseline for c in self.compute.values() if c.baseline is not None]
        return math.exp(statistics.median(learnt)) if learnt else 1.0

    def predicted(self, B: int, T: int):
        """The plan's per-rank prediction at this batch shape (cached)."""
        key = (B, T)
        got = self._predicted.get(key)
        if got is None:
            got = predict(self.cfg, self.profile, self.plan, B, T)
            self._predicted[key] = got
            if len(self._predicted) > 256:
                self._predicted.popitem(last=False)
        return got

    def observe(self, B: int, T: int, ranks_s: list[list[float]], factors=None) -> list[Alarm]:
        """One batch's measured [compute_s, comm_s, free, ready, probe_s, holds] per rank -> its
        alarms. An idle rank (no share) is judged by its speed probes against the profile's
        reading of the same probe (`IdleWatch`)."""
        self.batches += 1
        self.flags = []
        if self.batches <= SKIP_N:
            return []
        pred = self.predicted(B, T).predicted.get("per_rank", [])
        compute_alarms, comm_alarms = [], []
        for r, (p, m) in enumerate(zip(pred, ranks_s)):
            now = factors[r] if factors else 1.0
            if not p.get("active", True):
                # not while it loads weights ([2], its free memory, reads -1 then): a loader
                # thread's CPU is stretched on an emulated device, and the stretch is paid as
                # the probe's span ends. bench-adapt --quiet-ab at e4eaaa4 learnt node-d's
                # baseline while its standby copy loaded; when the load ended its probes read
                # 0.55x of it, and the re-plan gave the 0.15-core device a share: 35% slower
                if len(m) > 4 and m[4] > 0 and not (len(m) > 2 and m[2] < 0):
                    iw = self.idle.setdefault(r, IdleWatch(now, self.profile.devices[r].probe_s))
                    was = iw.last
                    f = iw.add(m[4], self.host_bias())
                    if f is not None and abs(math.log(f / now)) > math.log(IDLE_MOVE):
                        compute_alarms.append(Alarm("compute", r, 1 if f > now else -1, f, True))
                    elif iw.last is not None and abs(math.log(iw.last / now)) > IDLE_FLAG and \
                            (was is None or abs(math.log(was / now)) <= IDLE_FLAG):
                        # one report far off: a flag (the detection /metrics shows), not yet
                        # an alarm: the median of the window moves when a second one agrees
                        self.flags.append(Alarm("compute", r, 1 if iw.last > now else -1,
                                                iw.last, True))
                continue
            self.idle.pop(r, None)  # active again: a later idle spell learns its own baseline
            pc = p["compute_s"]
            if pc >= MIN_PREDICTED_S and m[0] > 0:
                c = self.compute.setdefault(r, Cusum())
                a = c.add(math.log(m[0] / pc))
                self._flagged("compute", r, c)
                if a:
                    compute_alarms.append(Alarm("compute", r, a, math.exp(c.shift()), fast=c.fast))
            transfers = sum(p.get("comm_s", {}).values())
            pm = transfers + p.get("wait_s", 0.0)
            if transfers >= MIN_TRANSFER_S and m[1] > 0:
                c = self.comm.setdefault(r, Cusum(COMM_DELTA, self.comm_lambda, COMM_FLAG_MIN))
                x = math.log(m[1] / pm)
                a = c.add(x)
                seen = self.swings.setdefault(r, [])
                seen.append(x)
                del seen[:-SWING_N]
                if not a and swinging(seen, self.swing_range):
                    self.swings.clear()  # one flap alarm for all ranks (they wait together)
                    comm_alarms.append(Alarm("comm", r, 1, math.exp(max(seen) - statistics.median(seen)),
                                             flap=True))
                    continue
                self._flagged("comm", r, c)
                if a:
                    comm_alarms.append(Alarm("comm", r, a, math.exp(c.shift()), fast=c.fast))
        return compute_alarms or comm_alarms

    def _flagged(self, kind: str, rank: int, c: Cusum) -> None:
        """Note a series that flagged on this batch and not on the one before."""
        if c.flagged:
            self.flags.append(Alarm(kind, rank, c.flag, math.exp(c.last[-1])))


def swinging(xs: list[float], span: float = SWING_RANGE) -> bool:
    """Residuals that span at least `span` and cross between high and low (the outer quarters
    of their range) at least SWING_CHANGES times: a link flapping between two rates. One
    outlier crosses twice, so it is not enough."""
    lo, hi = min(xs), max(xs)
    if len(xs) < SWING_N or hi - lo < span:
        return False
    mid, band = (hi + lo) / 2, (hi - lo) / 4
    sides = [1 if x > mid else -1 for x in xs if abs(x - mid) > band]
    return sum(a != b for a, b in zip(sides, sides[1:])) >= SWING_CHANGES


def predict(cfg, profile, plan, B: int, T: int):
    """`plan`'s shares evaluated on `profile` at this shape: a Plan with `predicted`."""
    s = plan.strategy
    if s == "single":
        return make_plan(cfg, profile, T, B, strategy="single")
    if s in ("even", "proportional"):
        s = "tensor"
    ratios = plan.ratios if s != "pipeline" else {d: [(b - a) / cfg.num_hidden_layers
                                                       for a, b in plan.layers] for d in plan.ratios}
    return make_plan(cfg, profile, T, B, strategy=s, ratios=ratios,
                     mem_budget=plan.mem_budget if s == "stream" else None)


def scaled_speed(profile, rank: int, factor: float):
    """The profile with rank's compute `factor` times slower (gemm, attention, elementwise)."""
    devs = list(profile.devices)
    d = devs[rank]

    def slower(t):
        return SpeedTable([(s, v / factor) for s, v in zip(t.sizes, t.values)])
    devs[rank] = dataclasses.replace(d, gemm=slower(d.gemm), attention=slower(d.attention),
                                     elementwise_per_s=d.elementwise_per_s / factor)
    return dataclasses.replace(profile, devices=devs)


def with_links(profile, links: dict):
    """The profile with re-probed links: {rank: {"latency_s", "bandwidth_Bps"}}."""
    devs = list(profile.devices)
    for r, link in links.items():
        r = int(r)
        devs[r] = dataclasses.replace(devs[r], latency_s=link["latency_s"],
                                      bandwidth_Bps=link["bandwidth_Bps"])
    return dataclasses.replace(profile, devices=devs)
