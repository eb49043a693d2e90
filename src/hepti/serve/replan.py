"""Re-planning while serving: after each batch, watch the plan (hepti.serve.monitor); on an
alarm, re-fit the profile, re-solve with the same planner, and switch plans when it pays.

The steps, all between batches on the front end's thread that talks to the workers:
0. a flag (a large residual: hepti.serve.monitor) is noted in `/metrics` at once; it becomes an
   alarm when the next batch confirms it;
1. an alarm: a rank's compute drifted (its speeds are scaled by the measured factor), or the
   communication did with no compute alarm (the links are re-probed: `probe`), or a device's
   memory moved (its free memory, reported with every batch: its cap follows, `_check_memory`,
   and a plan that no longer fits is replaced whatever the speed);
2. re-solve (`make_plan` on the re-fitted profile, at the recent batch shape, with the
   service's strategy) and compare with the current plan evaluated on the same profile;
3. switch only if the predicted gain per batch, over the batches expected in the horizon
   (`HORIZON_S`, or how long conditions lasted of late where they moved more often: `_horizon`),
   beats the switch's cost (`SWITCH_COST_S`: the stall, and the slower batches while the next
   plan's weights load beside the serving one), and not within `COOLDOWN_S` of the last switch;
4. `prepare`: every rank reads its new slices on a background thread (nothing if they are
   unchanged) while batches keep running on the current plan; once every rank reports ready
   (a flag in each batch's gather), `switch`: all ranks change plans together, between two
   batches, so no request sees two plans;
5. judge the new plan on its first `JUDGE_N` batches against the old plan's batches measured
   under the same conditions (those run between the alarm and the switch); if it is slower by
   more than `ROLLBACK_MARGIN`, switch back. A plan rolled back is not tried again until one of
   the conditions it was chosen on moves (`ROLLED_BACK_N`);
6. a plan switched to, or kept on links just re-probed, that runs more than `MISS_MARGIN` over
   its own prediction has what it relies on measured again (its links in full, its ranks'
   speed probes), and is decided anew on that (`_verify`).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time

from hepti.errors import PlanError
from hepti.model.sizes import spec_bytes
from hepti.parallel.engine import layer_spec
from hepti.plan.partition import make_plan
from hepti.plan.planfile import Plan
from hepti.plan.profile import profile_from_dict
from hepti.serve.monitor import (COMM_LAMBDA, IDLE_MOVE, MIN_TRANSFER_S, SKIP_N, SMALL_STEP,
                                 SWING_RANGE, Alarm, Monitor, predict, scaled_speed, with_links)
from hepti.serve.protocol import CHECK_SIZES

log = logging.getLogger("hepti")
HORIZON_S = 10.0  # conditions are assumed to hold this long after a change
# ... unless the service has seen them move more often than that: then the horizon is how long
# they have lasted of late, the median gap between the last HORIZON_N re-plans on compute and
# this decision (`_horizon`). CI at 64746ba (stop 55, a shared host): a neighbour's bursts
# moved MiniLM's emulated ranks by 0.3-2.5x in turn, a compute re-plan every 0.3-1 s. Against
# 10 s, predicted gains of 3-6 ms a batch at ~50 batches/s paid for switches the next burst
# undid, and the plans each left behind (a previous plan's slices, an idle rank's standby copy
# of the model) sat in node-b's memory as another program took it: the OOM killer took the
# rank. A switch kept back only by a short horizon is decided again once its conditions have
# held as long as it needs to pay (`redecide`), so a change that lasts is still acted on, a few
# seconds late; changes as far apart as bench-adapt's (20 s and more) keep the full horizon.
HORIZON_N = 3
SWITCH_COST_S = 0.5  # what a switch costs, in seconds of serving, besides loading weights
# Loading a rank's new slices competes with its serving for its CPU: bench-adapt's first runs
# switched rows onto a 0.15-core device, whose 340 MB load took its batches from 0.8 to
# 1.7-2.1 s for about 5 s. So a switch is charged its slowest rank's load time as well
# (bytes / the profile's weight_load_Bps, scaled by the rank's factor), at this fraction.
LOAD_COST_FRACTION = 1.0
MIN_GAIN = 0.05  # a new plan must be predicted at least this much faster (fraction)
COOLDOWN_S = 3.0  # no new decision this soon after a switch
JUDGE_N = 5  # batches of a new plan judged before it is kept
ROLLBACK_MARGIN = 0.05  # a new plan measured this much slower than the old one is undone
# A link whose probes moved FLAP_CHANGES times within FLAP_WINDOW_S flaps: the plan takes its
# worst recent state (bench-adapt --flap: 940 <-> 100 Mbit/s every 2 s; the plan made for 100
# served at 746 ms in both states, the one for 940 at 853 ms)
FLAP_CHANGES, FLAP_WINDOW_S = 3, 20.0
# When the communication swings (hepti.serve.monitor.swinging), the links are probed after
# each of the next FLAP_PROBES batches (3-4 s at BERT-base: both states of a 2 s flap); a
# link whose probes spread by FLAP_SPREAD flaps, and is planned at its worst for FLAP_HOLD_S.
FLAP_PROBES, FLAP_SPREAD, FLAP_HOLD_S = 4, 1.5, 60.0
# A link planned below its profiled rate is checked this often (`_check_slow_links`): a rank
# the slow link left idle has no residuals to show it came back (bench-adapt: the restore at
# 60 s went unseen, 810 ms against the original plan's 701 until the end).
LINK_CHECK_S = 5.0
# A link planned slow that LINK_BACK_N periodic checks in a row read at its profiled rate, and
# whose re-plans kept the plan in force, is taken as back: until then `_unless_switched` keeps
# it planned slow (it may be flapping). Without an end, one slow probe on a busy host kept a
# steady link planned slow for good, and probed twice every LINK_CHECK_S: bench-adapt
# --quiet-ab 600 at 0962d8a read node-b's link back 15 times in a row ("rank 1 ... Mbit/s
# again -> keep") and never let it go. Three checks span 15 s, several periods of the flaps
# bench-adapt --flap makes; but checks every 5 s against a 4 s flap can still read a flapping
# link back three times in a row (bench-adapt --flap at ef98488, at 45 s), and then the
# rollback of the switch made for it holds the link as flapping (`_links_back_since`).
LINK_BACK_N = 3
# A link that went slow less than FLAP_WINDOW_S ago is taken as back (re-planned on) only at
# its LINK_BACK_N-th check in a row that reads it back, not at the first: bench-adapt --flap
# at cdce509 read node-c's flapping link back at the first check, 5 s after it had dropped,
# switched to the plan for the fast link and rolled it back 3 s later (requests of 1.2-1.6 s
# against 0.75). A link back after a longer while (bench-adapt's restore 40 s after the drop)
# is re-planned on at the first reading.
MOVED = 0.2  # a link more than this far (fraction) from its profiled rate has moved
# A device's memory: what it could hold now ("room": its free memory, the median of its last
# MEM_N reports, plus what its plan and any copy kept beside it hold) against the room it had
# when first judged steady under this plan; a change of MEM_MOVED of its cap either way moves
# its cap by as much (never above the profile's) and re-plans. A device whose free memory fell
# (another program took it) moves the plan from `rows` (every rank holds the whole model) to
# `tensor` or `stream`. Against a baseline, not the profile's figure: what the runtime itself
# holds (Python, Numba, buffers) is in neither the profile nor the prediction.
MEM_N, MEM_MOVED = 3, 0.25
# A device squeezed (issue 44: another program takes most of its free memory) has room for
# its plan on paper (the plan's need plus what little is free), and no margin: the next batch
# of a longer shape, or the program taking a little more, and the OOM killer takes the rank.
# So a device whose free memory (with what it holds beside the plan, which it gives up first)
# falls below MEM_HEADROOM of its profiled memory is planned with that much left free: its cap
# becomes its room minus the headroom, the plan in force no longer fits it, and the re-plan
# must move (`stream`, a smaller share, or none). The figure, on hostfiles/emu-squeeze.json's
# devices (MiniLM, 3 ranks, 400 MiB caps; 293 MiB usable as profiled, so 44 MiB of headroom)
# under --strategy auto with another program holding 200 MiB of node-b: its rank served on at
# 57 MiB free (19%) and, kept on its plan at 15 MiB free (5%), its device reached its cap
# (peak 400/400 MiB: page cache reclaimed, no OOM kill yet).
MEM_HEADROOM = 0.15
# A plan rolled back is remembered with the conditions it was chosen under (each rank's speed
# factor, each re-probed link, each memory cap), at most ROLLED_BACK_N of them; a re-plan that
# picks it again while none of those has moved (MOVED; MEM_MOVED for memory) keeps the plan in
# force instead (`_rolled_back`). Issue 44: with nothing changing, an idle device's false
# speed-up was read four times in a few minutes, and each time the same plan was tried and
# rolled back.
ROLLED_BACK_N = 8
# A plan switched to, or kept after its links were re-probed, is checked on its first JUDGE_N
# batches against its own prediction: over it by more than MISS_MARGIN, the devices and links
# it relies on are measured again (every link to a rank with a share, probed in full; every
# such rank's speed probe, the median of REMEASURE_PROBES, against the profile's probe_s) and
# the plan decided anew on what they read (`_verify`). Issue 44: after a link fell to 40
# Mbit/s the re-plan read it at 41 and kept a plan predicted at 168 ms, which served at 234 ms,
# 1.32x a plan made fresh for the new link. "Its prediction" is the cost model's times the
# service's standing ratio of measured to predicted batch times (the median of the last
# STANDING_N batches before the decision): on the busy AVX-512 host MiniLM's batches ran 1.2x
# their predictions whatever the plan, BERT-base's 0.75-0.9x, and against the bare prediction
# every MiniLM switch was re-measured, and each re-measure moved the plan again.
MISS_MARGIN, REMEASURE_PROBES, STANDING_N = 0.15, 3, 20
# A change the new plan did not make: while it is judged, a rank computes at a speed (its
# factor times a flag's or an alarm's) more than EXTERNAL_MOVE away from what it was taken to
# be before the switch, and the new plan gave no idle rank a share. Its slower batches are
# then not held against it (no rollback): the judging ends and the change is re-planned on.
# bench-adapt at 5c5e3ed: a switch at 77 s (rank 3 read 1.30x on the busy host) was judged
# over node-d's fall to 0.05 core at 80 s; the new plan's batches, slowed by it, took 1186 ms
# against the old plan's 1059 before it, the switch was undone to the plan that gave node-d
# more rows, and the re-plan on its 7.29x came 10 s after the event (requests of 2-4.8 s).
# A rank's speed back where it was before the switch (a false speed-up that the switch took:
# its factor times the alarm lands near 1) stays the plan's own doing, as does any slowdown
# under a plan that woke an idle rank (issue 44's quiet minutes: rank 0 waited for the rank
# the false speed-up had given a share).
EXTERNAL_MOVE = 1.5


def _links_again(links: dict) -> str:
    return ", ".join(f"rank {r} {v['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s again"
                     for r, v in sorted(links.items()))


class PlanWatcher:
    def __init__(self, sup, profile: dict):
        self.sup = sup
        self.cfg = sup.config
        # the profile is always the measured one with what serving has learnt applied: each
        # rank's compute factor and each re-probed link (`_refit`), never a refit of a refit,
        # so a wrong step is undone by undoing it (a rollback restores both)
        self.base = profile_from_dict(profile, "the workers' profile")
        self.factors = [1.0] * self.base.world_size
        self.links: dict = {}
        self.memory: dict[int, float] = {}  # rank -> usable bytes, where its memory moved
        self.free_seen: dict[int, list[float]] = {}  # rank -> its last MEM_N free-memory reports
        self.room0: dict[int, float] = {}  # rank -> its room when first judged under this plan
        self.profile = self.base
        self.plan = Plan.from_dict(sup.plan)
        self.strategy = _strategy(sup.worker_args)
        self.monitor = Monitor(self.cfg, self.profile, self.plan)
        self.pending = None  # (plan, event) whose weights the ranks are loading
        self.previous = None  # (plan, walls measured under the new conditions) for a rollback
        self.judging: list[float] | None = None
        self.previous_before = None  # (factors, links) before the switch being judged
        self.external = None  # (rank, speed) a change the judged plan did not make (EXTERNAL_MOVE)
        self.rolled_back: list[dict] = []  # {"plan", "conditions", "t"}: see ROLLED_BACK_N
        self.verifying: dict | None = None  # {"walls", "shapes", "why", "standing"}: MISS_MARGIN
        self.standing: list[float] = []  # the last STANDING_N batches' measured / predicted
        self.confirming = None  # alarms waiting one batch to size their step
        self.comm_lambda_scale = 1.0  # doubled by each probe that found the links unchanged
        self.link_changes: dict[str, list] = {}  # rank -> [(when, probed link)] that moved
        self.flap_hold: dict[str, float] = {}  # rank -> until when its link is held at its worst
        self.back_reads: dict[str, int] = {}  # rank -> checks in a row that read its link back
        self.slow_since: dict[str, float] = {}  # rank -> since when its link is planned slow
        self.since_before: dict[str, float] = {}  # slow_since before the last links read back
        self.burst = None  # {"event", "probes"}: links probed over several batches (a flap)
        self.swing_range = SWING_RANGE
        self.last_link_check = -math.inf
        self.requested = None  # a plan asked for from outside (Supervisor.switch_plan)
        self.redecide = None  # {"at", "since", "reason"}: a switch kept back by the horizon
        # per rank, the layer_spec of weights it still holds from a plan before (JSON, or None):
        # from each switch's answer, and dropped when a batch says the rank let them go
        self.held: list = [None] * self.base.world_size
        H, F, L = self.cfg.num_attention_heads, self.cfg.intermediate_size, self.cfg.num_hidden_layers
        self.whole = ["resident", [0, H], [0, F], [0, L]]  # layer_spec of rows, in JSON
        self.walls_since_alarm: list[float] = []
        self.last_switch = -math.inf
        self.shapes: list[tuple[int, int]] = []
        self.batch_times: list[float] = []
        self.last_residuals: dict = {}

    # --- after every batch -----------------------------------------------------------------
    def after_batch(self, sock, shape: tuple[int, int], ranks_s: list, wall: float) -> None:
        now = time.monotonic()
        self.shapes = (self.shapes + [shape])[-20:]
        self.batch_times = (self.batch_times + [now])[-20:]
        self.walls_since_alarm.append(wall)
        if self.verifying is not None and self.pending is None:
            self.verifying["walls"].append(wall)
            self.verifying["shapes"].append(shape)
        elif self.pending is None and self.judging is None and self.monitor.batches >= SKIP_N:
            predicted = self.monitor.predicted(*shape).predicted_latency_s
            if predicted > 0:  # the model's standing ratio on this service (MISS_MARGIN)
                self.standing = (self.standing + [wall / predicted])[-STANDING_N:]
        for r, m in enumerate(ranks_s):  # what each rank holds beside its plan (worker's [5])
            if len(m) > 5 and not m[5]:
                self.held[r] = None
            elif len(m) > 5 and m[5] == 2.0:  # an idle rank's standby copy: the whole model
                self.held[r] = self.whole
            if len(m) > 2 and m[2] > 0:
                seen = self.free_seen.setdefault(r, [])
                seen.append(m[2])
                del seen[:-MEM_N]
            elif len(m) > 2:  # loading weights: judged anew once done
                self.free_seen.pop(r, None)
                self.room0.pop(r, None)
        observed = None
        if self.judging is not None:
            # the new plan is judged on its first batches, and watched all the same: a change
            # as large as a confirmed flag ends the judging (the old plan's batches no longer
            # tell what it would do) and is acted on (bench-adapt: node-b's CPU came back
            # during a judging, and was seen 6 batches late)
            observed = self._observe(shape, ranks_s)
            self._note_external(observed + list(self.monitor.flags))
            if not any(a.fast or a.absolute for a in observed):
                self._judge(sock, wall)
                return
            # unless the new plan already runs slower than the old one did: then the change
            # is likely the plan's own, and it is undone first (bench-adapt --quiet-ab at
            # e4eaaa4: a false speed-up of the idle rank gave it a share; the new plan ran
            # 1.0 s against 0.75, rank 0's waits for that rank alarmed two batches into the
            # judging, and the 35% slower plan served the next 10 minutes)
            if self._judge(sock, wall, early=True):
                return
            self.judging, self.previous = None, None
        if self.pending is not None:
            if all(r[3] for r in ranks_s):  # every rank's next weights are loaded
                self._switch(sock, *self.pending)
            return
        if self.verifying is not None and len(self.verifying["walls"]) >= JUDGE_N and \
                now - self.last_switch > COOLDOWN_S and self._verify(sock):
            return
        if self.burst is not None:
            self._burst_probe(sock)
            return
        if now - self.last_link_check > LINK_CHECK_S and now - self.last_switch > COOLDOWN_S \
                and self._check_slow_links(sock):
            return
        if now - self.last_switch > COOLDOWN_S and self._check_memory(sock, shape):
            return
        if self.requested is not None:
            plan, self.requested = self.requested, None
            event = {"t": time.time(), "reason": "asked for (Supervisor.switch_plan)",
                     "asked": True, "decision": "switch", "new_strategy": plan.strategy,
                     "new_ratios": plan.ratios, "before": (list(self.factors), dict(self.links))}
            self.sup.replans.append(event)
            self._prepare(sock, plan, event)
            return
        if self.redecide is not None and time.time() >= self.redecide["at"] and \
                now - self.last_switch > COOLDOWN_S:
            held = time.time() - self.redecide["since"]
            event = {"t": time.time(), "batch_shape": list(shape), "alarms": [],
                     "before": (list(self.factors), dict(self.links)),
                     "redecided": self.redecide["reason"],
                     "reason": f"the conditions of the re-plan {held:.1f} s ago held "
                               f"({self.redecide['reason']}): decided again"}
            event["since"] = self.redecide["since"]
            self._decide(sock, event, horizon=held)
            return
        alarms = observed if observed is not None else self._observe(shape, ranks_s)
        if self.confirming is not None:  # one more batch in the new regime sizes the step
            alarms, self.confirming = self.confirming, None
            for a in alarms:
                if a.kind == "compute" and not a.absolute:
                    a.factor = math.exp(self.monitor.compute[a.rank].shift())
        elif alarms and alarms[0].kind == "compute" and not alarms[0].absolute \
                and not all(a.fast for a in alarms):  # a confirmed flag is sized already
            self.confirming = alarms
            return
        flagged = False
        if not alarms and self.confirming is None and self.monitor.flags and \
                all(f.kind == "comm" for f in self.monitor.flags):
            # communication far off at once and no compute with it: a probe tells in a moment
            # whether a link moved, so it need not wait for a second batch to confirm
            alarms, flagged = self.monitor.flags, True
        if not alarms or now - self.last_switch < COOLDOWN_S:
            return
        event = {"t": time.time(), "batch_shape": list(shape),
                 "alarms": [a.__dict__ for a in alarms]}
        t0 = time.perf_counter()
        event["before"] = (list(self.factors), dict(self.links))
        back = {}  # links planned slow that read back (a re-plan on compute checks them)
        if alarms[0].kind == "compute":
            alarms = alarms + self._alongside(alarms)
            shared = self._shared_step(alarms, shape)
            if shared is not None:
                event["shared_step"] = shared
                for a in alarms:  # what the ranks share, and each one's own step beyond it
                    if not a.absolute and abs(math.log(a.factor / shared)) < SMALL_STEP:
                        a.factor = shared
                for r, iw in self.monitor.idle.items():  # an idle rank shares the host too
                    if not iw.profiled:  # against its profile, its probes show the host's step
                        iw.factor *= shared
                    self._scale(r, shared)
            event["alarms"] = [a.__dict__ for a in alarms]
            for a in alarms:
                if a.absolute:  # an idle rank: its probes against its own baseline
                    self.factors[a.rank] = a.factor
                else:
                    self._scale(a.rank, a.factor)
            # a link planned slow may be back at the same moment, with nothing in the
            # residuals to show it (the slow link left its rank idle): checked now, not at the
            # next LINK_CHECK_S after the cooldown. bench-adapt at 4de90d9: node-b's CPU and
            # node-c's link came back together at t = 60; the re-plan on node-b's compute
            # kept node-c out, and the link check 5 s later put it back (816 ms against the
            # oracle's 744 over that phase)
            back = self._slow_links_back(sock)
            self.links.update(back)
            self._refit()
            event["reason"] = "; ".join(
                f"rank {a.rank} {'probes' if a.absolute else 'computes'} {a.factor:.2f}x its "
                f"{'profiled time' if a.absolute else 'predicted time'}" for a in alarms)
            if back:
                event.update(links_changed=True, reason=event["reason"] + "; link check: "
                             + _links_again(back))
        elif alarms[0].flap:  # probe over the next batches, then decide (`_burst_probe`)
            if any(until > now for until in self.flap_hold.values()):
                return  # already planned at a flapping link's worst state
            event["reason"] = (f"communication swings (up to {alarms[0].factor:.2f}x its median): "
                               f"links probed over the next {FLAP_PROBES} batches")
            self.burst = {"event": event, "probes": []}
            self._burst_probe(sock)
            return
        else:
            answer = self._probe_changed(sock)
            before = self.profile
            now_t = time.monotonic()
            for r, v in answer["links"].items():
                if self.flap_hold.get(r, 0.0) > now_t:
                    continue  # a flapping link stays planned at its worst state for a while
                if _moved(before.devices[int(r)], v):
                    seen = self.link_changes.setdefault(r, [])
                    seen.append((now_t, v))
                    seen[:] = [x for x in seen if now_t - x[0] < FLAP_WINDOW_S]
                    if len(seen) >= FLAP_CHANGES:  # flapping: plan for its worst recent state
                        v = min((x[1] for x in seen), key=lambda x: x["bandwidth_Bps"])
                        event["flapping"] = sorted(set(event.get("flapping", []) + [int(r)]))
                        self.flap_hold[r] = now_t + FLAP_HOLD_S
                self.links[r] = v
            self._refit()
            moved = any(_moved(before.devices[int(r)], v) for r, v in self.links.items())
            event["links_changed"] = moved
            if flagged and not moved:  # a flag the links do not explain: the detectors go on
                self.links = dict(event["before"][1])
                self._refit()
                event.update(reason="communication flagged {:.2f}x; links re-probed, unchanged".format(
                    alarms[0].factor), decision="keep", probe_s=time.perf_counter() - t0)
                self.sup.replans.append(event)
                return
            if not moved or "flapping" in event:
                # a false alarm, or a link that flaps: probing each swing costs more than it
                # tells; wait for a larger excursion before probing again
                self.comm_lambda_scale = min(8.0, self.comm_lambda_scale * 2)
            event["reason"] = "communication {:.2f}x its prediction; links re-probed: {}".format(
                alarms[0].factor, ", ".join(
                    f"rank {r} {v['bandwidth_Bps'] * 8 / 1e6:.0f} Mbit/s"
                    for r, v in sorted(answer["links"].items())) or "none moved")
            event["probe_s"] = time.perf_counter() - t0
            event["light_mbit"] = {r: round(v["bandwidth_Bps"] * 8e-6)
                                   for r, v in answer["checked"].items()}
        self._decide(sock, event)
        self._unless_switched(back, event)

    def _alongside(self, alarms: list) -> list:
        """Every other active rank whose compute moved too (the median of its last three
        residuals beyond its series' DELTA), as alarms: the re-fit scales each rank by what it
        measured, not the alarmed one alone. A slowdown that every rank shares (a neighbour's
        burst on the host they share) then leaves their relative speeds, and so the plan, as
        they were: bench-adapt --quiet at 2618843 saw ranks 1 and 2 at 1.43x and 1.35x, and
        switched on rank 2's alarm alone."""
        alarmed = {a.rank for a in alarms}
        out = []
        for r, c in sorted(self.monitor.compute.items()):
            if r in alarmed or c.baseline is None or len(c.recent) < 3:
                continue
            step = statistics.median(c.recent)
            if abs(step) > c.delta:
                out.append(Alarm("compute", r, 1 if step > 0 else -1, math.exp(step)))
        return out

    def _shared_step(self, alarms: list, shape: tuple[int, int]) -> float | None:
        """The step every busy rank took together, if each of them (two or more) moved the same
        way: the least of their steps. The host they share was busy, or a burst of the
        machine's own: bench-adapt --quiet at 30c886b saw the three busy ranks compute 1.25x,
        1.33x and 1.55x together, twice in 600 quiet seconds, and re-fitted each by its own
        step. Their spread read as a change of relative speed, and the idle 0.15-core rank,
        not slowed in the re-fit, got a share: 3 switches. So the shared part scales every
        rank alike, idle ones too, and a rank keeps a step of its own only beyond SMALL_STEP
        (1.5x) on top of the shared one: the changes to act on are 2x and more, one device at
        a time."""
        per_rank = self.monitor.predicted(*shape).predicted.get("per_rank", [])
        busy = {r for r, p in enumerate(per_rank) if p.get("active", True)} & \
            set(self.monitor.compute)
        moved = {a.rank: a for a in alarms if a.kind == "compute" and not a.absolute}
        if len(busy) < 2 or not busy <= set(moved):
            return None
        if len({moved[r].direction for r in busy}) != 1:
            return None
        return min((moved[r].factor for r in busy), key=lambda f: abs(math.log(f)))

    def _scale(self, r: int, factor: float) -> None:
        """Rank r's speed factor times a measured step. Back within MOVED of its profile from
        a change, it is taken at its profile, as a link is: the product of two measured steps
        is noisy (bench-adapt at 24b11d0: 2.21 x 0.52 = 1.15 after node-b's CPU came back, and
        the planner gave the 0.15-core node-d a share for the last 20 s)."""
        was = self.factors[r]
        self.factors[r] *= factor
        if _moved_factor(was) and not _moved_factor(self.factors[r]):
            self.factors[r] = 1.0

    def expectation(self, shape: tuple[int, int]) -> dict | None:
        """What rank 0 should see during the next batch, for its in-batch watch
        (hepti.serve.worker._InBatchWatch): its predicted communication at this shape, times its
        series' baseline (the model's standing bias there), and the batch's predicted time.
        None while there is nothing to compare with (the first batches of a plan, a series
        still learning its baseline, rank 0 without transfers worth watching) or while rank 0's
        communication is flagged already (one flag per change, not one per batch)."""
        m = self.monitor
        c = m.comm.get(0)
        if m.batches < SKIP_N or c is None or c.baseline is None or c.flag:
            return None
        got = m.predicted(*shape)
        p = got.predicted.get("per_rank", [{}])[0]
        transfers = sum(p.get("comm_s", {}).values())
        if not p.get("active", True) or transfers < MIN_TRANSFER_S:
            return None
        return {"comm_s": (transfers + p.get("wait_s", 0.0)) * math.exp(c.baseline),
                "wall_s": got.predicted_latency_s}

    def early_flag(self, header: dict, shape: tuple[int, int]) -> None:
        """Rank 0's communication far off inside a batch: a flag, in /metrics at once. It
        changes nothing by itself: the batch's end gives every rank's residuals, which say
        what changed."""
        self.sup.flags.append({"t": time.time(), "kind": "comm", "rank": 0,
                               "factor": header.get("factor"), "batch_shape": list(shape),
                               "in_batch_s": header.get("at_s")})
        log.info("serve: rank 0 waits %.1fx its prediction %.2f s into a batch",
                 header.get("factor", 0.0), header.get("at_s", 0.0))

    def _observe(self, shape, ranks_s) -> list:
        """The monitor on this batch: its alarms; its flags go to /metrics as they come."""
        alarms = self.monitor.observe(*shape, ranks_s, self.factors)
        self._note_residuals(shape, ranks_s)
        for f in self.monitor.flags:  # detections, whether or not they are acted on
            self.sup.flags.append({"t": time.time(), "kind": f.kind, "rank": f.rank,
                                   "factor": f.factor, "batch_shape": list(shape)})
        return alarms

    def _slow_links_back(self, sock) -> dict:
        """The links the plan takes as slower than profiled that read their profiled rate
        again: each checked with a light probe (CHECK_SIZES), those back probed in full;
        {rank: link} of those."""
        self.last_link_check = time.monotonic()
        slow = [r for r, v in self.links.items()
                if v["bandwidth_Bps"] < self.base.devices[int(r)].bandwidth_Bps / (1 + MOVED)
                and self.flap_hold.get(r, 0.0) < self.last_link_check]
        if not slow:
            return {}
        light = self.sup.command(sock, {"op": "probe", "ranks": [int(r) for r in slow],
                                        "sizes": CHECK_SIZES})
        back = [r for r, v in light["links"].items()
                if v["bandwidth_Bps"] > self.base.devices[int(r)].bandwidth_Bps / (1 + MOVED)]
        for r in slow:  # checks in a row that read it back; one that reads it slow starts again
            if r in back:
                self.back_reads[r] = self.back_reads.get(r, 0) + 1
            else:
                self.back_reads.pop(r, None)
        now = time.monotonic()  # a link slow only a moment ago must read back LINK_BACK_N times
        back = [r for r in back if now - self.slow_since.get(r, -math.inf) >= FLAP_WINDOW_S
                or self.back_reads[r] >= LINK_BACK_N]
        if not back:
            return {}
        self.since_before = dict(self.slow_since)  # `_unless_switched` keeps them if kept slow
        return self.sup.command(sock, {"op": "probe", "ranks": [int(r) for r in back]})["links"]

    def _unless_switched(self, back: dict, event: dict) -> None:
        """Links read back that the re-plan did not switch for stay planned slow: the plan in
        force was made for them slow, and a link that read fast once may be flapping. Taken as
        fast while the plan was kept, it misled the next re-plan: bench-adapt --flap at
        9cf07ba, round 2, a link check read node-c's flapping link at 928 Mbit/s and kept the
        plan; 47 s later a re-plan on node-d's compute (1.16x) gave node-c a share again, and
        its batches took 1.2 s against 0.76 until the rollback. The periodic check (and each
        re-plan on compute) reads them again, and a switch takes them; so does the
        LINK_BACK_N-th check in a row that reads one back."""
        if not back or event.get("decision") == "switch":
            for r in back:
                self.back_reads.pop(r, None)
            return
        steady = [r for r in back if self.back_reads.get(r, 0) >= LINK_BACK_N]
        for r in steady:  # read back LINK_BACK_N checks in a row: it is back (LINK_BACK_N)
            self.back_reads.pop(r)
        event["links_back"] = sorted(int(r) for r in steady)
        back = [r for r in back if r not in steady]
        if not back:
            return
        for r in back:
            self.links[r] = event["before"][1][r]
        self._refit()
        for r in back:  # planned slow since then, still
            if r in self.since_before:
                self.slow_since[r] = self.since_before[r]
        self._refitted(alarmed=set())
        event["links_kept_slow"] = sorted(int(r) for r in back)
        self.verifying = None  # the plan's figures are as they were: nothing new to check

    def _check_slow_links(self, sock) -> bool:
        """A link the plan takes as slower than profiled may have come back, and a rank that
        the slow link left idle shows nothing in its residuals: check such links every
        LINK_CHECK_S (and in every re-plan on compute: `after_batch`); one that reads its
        profiled rate again is re-planned on. True if it re-planned."""
        t0 = time.perf_counter()
        before = (list(self.factors), dict(self.links))
        back = self._slow_links_back(sock)
        if not back:
            return False
        event = {"t": time.time(), "alarms": [], "before": before}
        self.links.update(back)
        self._refit()
        event.update(links_changed=True, probe_s=time.perf_counter() - t0,
                     reason="link check: " + _links_again(back))
        self._decide(sock, event)
        self._unless_switched(back, event)
        return True

    def _check_memory(self, sock, shape) -> bool:
        """Re-plan when a device's memory moved (MEM_MOVED): its room is its free memory plus
        what it holds for its plan (the plan's predicted weights and activations) and beside
        it (a previous plan's slices, a standby copy: freed when memory runs short,
        hepti.serve.worker `_trim`), against its room when first judged under this plan; or
        when a device with a share is squeezed, its free memory under MEM_HEADROOM: then the
        plan in force no longer fits and is replaced. True if it re-planned."""
        pred = self.monitor.predicted(*shape).predicted.get("per_rank", [])
        moved = {}
        for r, p in enumerate(pred):
            seen = self.free_seen.get(r, [])
            if len(seen) < MEM_N:
                continue
            room = statistics.median(seen) + p.get("mem_bytes", 0.0) + self._held_bytes(r)
            cap, base = self.profile.devices[r].usable_bytes, self.base.devices[r].usable_bytes
            squeezed = room - MEM_HEADROOM * base  # what it may plan for, leaving the headroom
            if p.get("active", True) and p.get("mem_bytes", 0.0) > squeezed:
                moved[r] = max(0.0, min(cap, squeezed))
                continue
            if r not in self.room0:
                self.room0[r] = room
                continue
            delta = room - self.room0[r]
            if abs(delta) > MEM_MOVED * cap and not (delta > 0 and cap >= base):
                moved[r] = min(base, max(0.0, cap + delta))
        if not moved:
            return False
        event = {"t": time.time(), "alarms": [], "batch_shape": list(shape),
                 "before": (list(self.factors), dict(self.links))}
        event["reason"] = "memory: " + ", ".join(
            f"rank {r} can hold {v / 2**20:.0f} MiB (planned for "
            f"{self.profile.devices[r].usable_bytes / 2**20:.0f}; "
            f"{statistics.median(self.free_seen[r]) / 2**20:.0f} MiB free)"
            for r, v in sorted(moved.items()))
        for r, v in moved.items():
            if v >= self.base.devices[r].usable_bytes:
                self.memory.pop(r, None)
            else:
                self.memory[r] = v
            self.free_seen.pop(r, None)  # judged anew, on what it can hold from now on
            self.room0.pop(r, None)
        self._refit()
        # a rank squeezed reads its next slices only after letting its current ones go: beside
        # them it would eat the headroom the re-plan is for (worker.py `prepare`)
        event["defer"] = sorted(moved)
        self._decide(sock, event, must=self._over_memory(shape))
        return True

    def _held_bytes(self, r: int) -> float:
        """The weights rank r keeps beside its plan (`held`: a previous plan's, or the whole
        model as an idle rank's standby copy)."""
        return spec_bytes(self.cfg, self.held[r])

    def _over_memory(self, shape) -> list[int]:
        """The ranks the current plan would overfill on the re-fitted profile."""
        got = predict(self.cfg, self.profile, self.plan, *shape).predicted.get("per_rank", [])
        return [r for r, p in enumerate(got)
                if p.get("active", True) and p.get("mem_bytes", 0.0) > self.profile.devices[r].usable_bytes]

    def _probe_changed(self, sock) -> dict:
        """The links that moved: every link checked with a light probe (CHECK_SIZES: 5-50 ms
        a link). The full probe of every link, on every communication alarm, took 0.73 s
        inside the request that raised it (bench-adapt at 24b11d0). A light probe may read a
        shaped link high, never low (a burst passes at line rate), so only two readings move
        the plan: a link slower than the plan takes it (by MOVED), taken at its light
        reading, and a link the plan takes as slow that reads faster (it may be back), probed
        in full first. Reading every link "moved" from a high reading cost 26760b9's run
        0.82 s at the 20 s event. {"links": {rank: link}, "checked": every light reading}."""
        others = [r for r in range(self.profile.world_size) if r != 0]
        light = self.sup.command(sock, {"op": "probe", "ranks": others, "sizes": CHECK_SIZES})
        slower, back = {}, []
        for r, v in light["links"].items():
            now, base = self.profile.devices[int(r)], self.base.devices[int(r)]
            if _slower(now, v):
                slower[r] = v
            elif now.bandwidth_Bps < base.bandwidth_Bps / (1 + MOVED) and \
                    v["bandwidth_Bps"] > now.bandwidth_Bps * (1 + MOVED):
                back.append(int(r))
        # a link that reads slower is taken at its light reading: a light probe never reads
        # low, and read node-c's 100 Mbit/s link as 107-108 (eaf09ea), where the full probe
        # took 0.7 s inside the request; one that reads faster is confirmed in full first
        full = self.sup.command(sock, {"op": "probe", "ranks": back}) if back else {"links": {}}
        return {"links": {**slower, **full["links"]}, "checked": light["links"]}

    def _probe(self, sock, light: bool = False) -> dict:
        """Rank 0's ping-pong with every other rank: {"links": {rank: link}}; `light`, with
        CHECK_SIZES (~50 ms a link at 100 Mbit/s against ~0.25 s): a flap's burst probes after
        each of FLAP_PROBES batches, and a false swing's burst (26760b9's run, under the
        slow link) cost 0.73 s in each of 4 requests with full probes."""
        header = {"op": "probe", "ranks": [r for r in range(self.profile.world_size) if r != 0]}
        if light:
            header["sizes"] = CHECK_SIZES
        return self.sup.command(sock, header)

    def _burst_probe(self, sock) -> None:
        """One more light probe of a burst. It ends after FLAP_PROBES, or at once when a link
        reads slower than the plan takes it (by MOVED): the communication swings, and that
        link is in its low state (a light probe reads a shaped link high, never low). Its
        first run waited for all four probes and switched 3.9 s after the alarm (bench-adapt
        --flap at e4cba12), while node-c read 107 Mbit/s on the third. Then a link whose
        probes spread by FLAP_SPREAD, or that read slow, is flapping and is planned at its
        worst state for FLAP_HOLD_S; another link is taken at its median only where that is
        slower than planned (light probes read node-b's and node-d's 940 Mbit/s links at
        1.7-1.8 Gbit/s, and the plan took that). Then decide."""
        probe = self._probe(sock, light=True)
        self.burst["probes"].append(probe)
        low = [r for r, v in probe["links"].items() if _slower(self.profile.devices[int(r)], v)]
        if len(self.burst["probes"]) < FLAP_PROBES and not low:
            return
        event, probes, self.burst = self.burst["event"], self.burst["probes"], None
        now_t = time.monotonic()
        before = self.profile
        event["before"] = (list(self.factors), dict(self.links))
        flapping = []
        for r in probes[0]["links"]:
            seen = sorted((p["links"][r] for p in probes), key=lambda v: v["bandwidth_Bps"])
            if r in low or seen[-1]["bandwidth_Bps"] > FLAP_SPREAD * seen[0]["bandwidth_Bps"]:
                self.links[r] = seen[0]
                self.flap_hold[r] = now_t + FLAP_HOLD_S
                flapping.append(int(r))
            elif _slower(before.devices[int(r)], seen[len(seen) // 2]):
                self.links[r] = seen[len(seen) // 2]
        self._refit()
        event.update(flapping=flapping, links_changed=bool(flapping) or any(
            _moved(before.devices[int(r)], v) for r, v in self.links.items()),
            probed_mbit={r: [round(p["links"][r]["bandwidth_Bps"] * 8e-6) for p in probes]
                         for r in probes[0]["links"]})
        if not event["links_changed"]:  # swings from noise, not a link: look less eagerly
            self.comm_lambda_scale = min(8.0, self.comm_lambda_scale * 2)
            self.swing_range = min(4 * SWING_RANGE, 2 * self.swing_range)
            self.monitor.swing_range = self.swing_range
        event["reason"] += "; " + (f"rank(s) {flapping} flap: planned at their slowest probe"
                                   if flapping else "no link flaps")
        self._decide(sock, event)

    # --- deciding ------------------------------------------------------------------------------
    def _decide(self, sock, event: dict, must: list[int] | None = None,
                horizon: float | None = None) -> None:
        """Re-solve on the re-fitted profile and switch if it pays over the horizon (`_horizon`
        unless given), or, `must`: ranks the current plan overfills, if the new plan differs
        at all."""
        self.verifying = None  # a decision anew: the plan it leaves in force is checked anew
        self.redecide = None
        B = int(statistics.median(s[0] for s in self.shapes))
        T = int(statistics.median(s[1] for s in self.shapes))
        t0 = time.perf_counter()
        try:
            best = make_plan(self.cfg, self.profile, T, B, strategy=self.strategy)
        except PlanError as e:  # nothing fits: serve on with the current plan, and say so
            event.update(decision="keep", reason=f"{event['reason']}; no plan fits: {e}",
                         solve_s=time.perf_counter() - t0)
            log.warning("serve: re-plan: %s", event["reason"])
            self.sup.replans.append(event)
            self._refitted(alarmed=set())
            return
        tried = None if must or _same(best, self.plan) else self._rolled_back(best)
        if tried is not None:
            event["reason"] += (f"; the best plan was rolled back {time.time() - tried['t']:.0f} s "
                                f"ago under the same conditions: not tried again")
            event["rolled_back_before"] = True
            other = self._other_strategy(best, B, T)
            if other is not None:  # the best of another strategy, not rolled back
                event["reason"] += f"; the best {other.strategy} plan instead"
                best, tried = other, None
        event["solve_s"] = time.perf_counter() - t0
        now = predict(self.cfg, self.profile, self.plan, B, T).predicted_latency_s
        new = best.predicted_latency_s
        rate = self._batches_per_s()
        horizon = self._horizon() if horizon is None else min(HORIZON_S, horizon)
        gain = now - new
        event.update(current_predicted_s=now, new_predicted_s=new, new_strategy=best.strategy,
                     new_ratios=best.ratios, batches_per_s=rate, horizon_s=horizon)
        load_s = self._load_seconds(best)
        cost = SWITCH_COST_S + LOAD_COST_FRACTION * load_s
        event.update(load_s=load_s, switch_cost_s=cost)
        if must:
            event["overfilled_ranks"] = must
        if tried is not None or _same(best, self.plan) or \
                (not must and (gain < MIN_GAIN * now or gain * rate * horizon < cost)):
            event["decision"] = "keep"
            if tried is None and not _same(best, self.plan) and gain >= MIN_GAIN * now and \
                    gain * rate * HORIZON_S >= cost and rate > 0:
                # it would pay if its conditions last: decided again once they have lasted
                since = event.get("since", time.time())  # the conditions' start
                self.redecide = {"since": since,
                                 "at": max(since + cost / (gain * rate), time.time() + 0.5),
                                 "reason": event.get("redecided", event["reason"])}
                event["redecide_in_s"] = cost / (gain * rate)
            # links as profiled: the communication's new level is this plan's normal, not a
            # change to act on again
            self._refitted(alarmed={a["rank"] for a in event["alarms"]},
                           relearn_comm=event.get("links_changed") is False)
            if event.get("links_changed") and not event.get("remeasure"):
                # kept on links just re-probed: the plan's new prediction is checked
                self.verifying = self._verification("kept")
        else:
            event["decision"] = "switch"
            self._prepare(sock, best, event)
        log.info("serve: re-plan: %s -> %s (predicted %.1f -> %.1f ms)", event["reason"],
                 event["decision"], now * 1e3, new * 1e3)
        self.sup.replans.append(event)

    def _prepare(self, sock, plan, event) -> None:
        """Every rank starts loading its slices for `plan`; when none has anything to read
        (rows to rows, or slices held from before), switch now rather than after one more
        batch on the old plan (bench-adapt at 24b11d0: each event cost that batch, 0.9-1.8 s).
        The rollback then judges against the batch that raised the alarm."""
        answer = self.sup.command(sock, {"op": "prepare", "plan": plan.to_dict(),
                                         "defer": event.get("defer", [])})
        assert answer["op"] == "prepared", answer
        self.pending = (plan, event)
        if not any(answer.get("loads", [True])):
            self.walls_since_alarm = self.walls_since_alarm[-1:]
            self._switch(sock, plan, event)
            return
        self.walls_since_alarm = []

    def _switch(self, sock, plan, event) -> None:
        rollback = event.get("decision") == "rollback"
        answer = self.sup.command(sock, {"op": "switch"})
        assert answer["op"] == "switched", answer
        self.previous = None if rollback else (self.plan, list(self.walls_since_alarm))
        self.previous_before = event.get("before")
        self.external = None
        for r in answer["ranks"]:
            self.held[r["rank"]] = r.get("holds")
        self.plan, self.pending = plan, None
        self.last_switch = time.monotonic()
        self.free_seen, self.room0 = {}, {}  # what each rank holds changed: rooms judged anew
        event.update(switched_at=time.time(),
                     stall_s=max(r["stall_s"] for r in answer["ranks"]),
                     bytes_read=[r["bytes_read"] for r in answer["ranks"]])
        deferred = [r["rank"] for r in answer["ranks"] if r.get("deferred")]
        if deferred:  # no room for both plans (or the kernel took the next plan's while it
            # waited: SpareLayers): read after letting the old one go
            event["deferred_ranks"] = deferred
        with self.sup._cv:
            self.sup.epoch += 1
            self.sup.plan = plan.to_dict()
        event["epoch"] = self.sup.epoch
        # a plan the memory forced is not judged against one that no longer fits, nor one
        # asked for from outside (it is what was asked for: tests/test_serve.py saw such a
        # switch rolled back on a busy host)
        self.judging = None if rollback or event.get("overfilled_ranks") or \
            event.get("asked") else []
        # the new plan is checked against its prediction (MISS_MARGIN); the plan a rollback
        # returns to, and one switched to on a re-measure, are not checked again
        self.verifying = None if rollback or event.get("remeasure") else \
            self._verification("switched")
        # each rank's series go on with their baselines: relearning them would leave the
        # monitor blind for BASELINE_N batches, 6-12 s at BERT-base's 0.7-1.3 s per request
        # (bench-adapt's first run: the CPU halving was flagged 11 s late). Where the new plan
        # sits differently against the model (other shares, other GeMM sizes), that shows as an
        # alarm on its first batches and is re-fitted as any other.
        self._refitted(alarmed=None)

    def _judge(self, sock, wall: float, early: bool = False) -> bool:
        """The new plan's first batches against the old plan's under the same conditions;
        whether it rolled back. `early`: an alarm ends the judging now; roll back if the
        batches so far are already slower, else leave the judging to the caller."""
        self.judging.append(wall)
        if len(self.judging) < JUDGE_N and not early:
            return False
        old_plan, old_walls = self.previous
        new_med = statistics.median(self.judging)
        worse = bool(old_walls) and new_med > statistics.median(old_walls) * (1 + ROLLBACK_MARGIN)
        if worse and self.external is not None:  # slower for a change it did not make
            r, speed = self.external
            self.sup.replans.append({"t": time.time(), "decision": "keep", "reason":
                                     f"the new plan's batches took {new_med * 1e3:.1f} ms, the "
                                     f"old one's {statistics.median(old_walls) * 1e3:.1f} ms, "
                                     f"but rank {r} computes {speed:.2f}x its profiled time "
                                     "since: not the plan's doing, no rollback"})
            log.info("serve: re-plan: %s", self.sup.replans[-1]["reason"])
            self.judging, self.previous, self.external = None, None, None
            return False
        if early and not worse:
            return False
        self.judging = None
        if worse:
            event = {"t": time.time(), "reason": f"the new plan's batches took {new_med * 1e3:.1f} ms, "
                     f"the old one's {statistics.median(old_walls) * 1e3:.1f} ms",
                     "decision": "rollback", "new_strategy": old_plan.strategy,
                     "new_ratios": old_plan.ratios}
            self.sup.replans.append(event)
            log.info("serve: re-plan: %s -> rollback", event["reason"])
            self.rolled_back = (self.rolled_back + [{"plan": self.plan, "t": time.time(),
                                                     "conditions": self._conditions()}]
                                )[-ROLLED_BACK_N:]
            # what the switch was made for was wrong: forget it too
            came_back = self._links_back_since(self.previous_before[1])
            self.factors, self.links = (list(x) if isinstance(x, list) else dict(x)
                                        for x in self.previous_before)
            now_t = time.monotonic()
            for r in came_back:  # read back, switched for, slower: it flaps (FLAP_HOLD_S)
                self.flap_hold[r] = now_t + FLAP_HOLD_S
            if came_back:
                event["flapping"] = sorted(int(r) for r in came_back)
            self._refit()
            self.previous = None
            # the old plan's weights load on the ranks' threads; switch when they are in (now,
            # if they are held)
            self._prepare(sock, old_plan, event)
        return worse

    def _links_back_since(self, before: dict) -> list[str]:
        """The links planned slow in `before` that the plan in force takes as back (MOVED).
        A switch made for such a link that is rolled back says the link flaps: bench-adapt
        --flap at 18ff887 read node-c's flapping link back twice, switched for it each time,
        and rolled back each time (five plan changes in 60 s, 1.14x the better static plan),
        as the comm alarms' own flap detection never saw the link checks' readings."""
        return [r for r, v in before.items()
                if r in self.links and self.links[r]["bandwidth_Bps"] > v["bandwidth_Bps"] * (1 + MOVED)]

    def _note_external(self, alarms: list) -> None:
        """Note a change the plan being judged did not make (EXTERNAL_MOVE): a compute flag or
        alarm on a rank whose speed, as it reads now, is far from what it was taken to be
        before the switch, under a plan that gave no idle rank a share."""
        if self.external is not None or self.previous is None or self.previous_before is None:
            return
        if _active(self.plan) - _active(self.previous[0]):
            return
        before = self.previous_before[0]
        for a in alarms:
            if a.kind != "compute" or a.absolute:
                continue
            speed = self.factors[a.rank] * a.factor
            if abs(math.log(speed / before[a.rank])) > math.log(EXTERNAL_MOVE):
                self.external = (a.rank, speed)
                return

    def _verification(self, why: str) -> dict:
        """A check of the plan in force to come (`_verify`), with the model's standing ratio
        of measured to predicted batch times so far (1.0 before any)."""
        standing = statistics.median(self.standing) if self.standing else 1.0
        return {"walls": [], "shapes": [], "why": why, "standing": standing}

    def _verify(self, sock) -> bool:
        """The plan in force (switched to, or kept on re-probed links) against its prediction
        (times the standing ratio, MISS_MARGIN) at its first JUDGE_N batches' shape: more than
        MISS_MARGIN over it, re-measure (`_remeasure`) and decide anew. True if it re-measured."""
        v, self.verifying = self.verifying, None
        B = int(statistics.median(s[0] for s in v["shapes"]))
        T = int(statistics.median(s[1] for s in v["shapes"]))
        model = predict(self.cfg, self.profile, self.plan, B, T).predicted_latency_s
        predicted = v["standing"] * model
        measured = statistics.median(v["walls"])
        if measured <= (1 + MISS_MARGIN) * predicted:
            return False
        self._remeasure(sock, measured, predicted, (B, T), v["why"])
        return True

    def _remeasure(self, sock, measured: float, predicted: float, shape, why: str) -> None:
        """Measure again what the plan in force relies on, and decide on what it reads: every
        rank with a share, its link (rank 0's ping-pong at PROBE_SIZES) and its speed (its
        speed probe, the median of REMEASURE_PROBES read as the profile read probe_s, each
        after a sleep, against probe_s and the busy ranks' standing offset from the profile, as
        an idle rank's probes are read; a rank whose factor moved by IDLE_MOVE, the probes'
        threshold, takes it: on the busy host ranks read 0.67-0.91x of their probe_s by turns,
        and at MOVED each re-measure moved the plan). Probes
        read straight after a batch ran 2.2-3.8x the profile's on the busy host (bench-adapt
        --spec emu-drop3.json at 3efb043), and moved the plan for nothing. A link that reads within
        MOVED of its profile is taken at its profile; a link held at a flap's worst stays."""
        t0 = time.perf_counter()
        event = {"t": time.time(), "batch_shape": list(shape), "alarms": [],
                 "before": (list(self.factors), dict(self.links)), "remeasure": True}
        per_rank = predict(self.cfg, self.profile, self.plan, *shape).predicted.get("per_rank", [])
        relied = [r for r, p in enumerate(per_rank) if p.get("active", True)]
        answer = self.sup.command(sock, {"op": "probe", "ranks": [r for r in relied if r != 0],
                                         "speed": REMEASURE_PROBES})
        now_t, before = time.monotonic(), self.profile
        read = {}
        for r, v in answer["links"].items():
            read[f"link {r}"] = f"{v['bandwidth_Bps'] * 8e-6:.0f} Mbit/s"
            if self.flap_hold.get(r, 0.0) > now_t:
                continue
            if _moved(self.base.devices[int(r)], v):
                self.links[r] = {"latency_s": v["latency_s"], "bandwidth_Bps": v["bandwidth_Bps"]}
            else:
                self.links.pop(r, None)
        speeds, bias = answer.get("speeds") or [], self.monitor.host_bias()
        for r in relied:
            profiled = self.base.devices[r].probe_s
            if not profiled or r >= len(speeds) or not speeds[r] > 0:
                continue
            f = speeds[r] / (profiled * bias)  # as an idle rank's probes are read (IdleWatch)
            read[f"rank {r}"] = f"{f:.2f}x"
            if abs(math.log(f / self.factors[r])) > math.log(IDLE_MOVE):  # as an idle rank's
                self.factors[r] = f if _moved_factor(f) else 1.0
        self._refit()
        event.update(
            links_changed=any(_moved(before.devices[int(r)], v)
                              for r, v in answer["links"].items()),
            probe_s=time.perf_counter() - t0, remeasured=read,
            reason=f"the plan {why} took {measured * 1e3:.1f} ms a batch, "
                   f"{measured / predicted:.2f}x its prediction ({predicted * 1e3:.1f} ms): "
                   "re-measured " + (", ".join(f"{k} {v}" for k, v in read.items())
                                     or "nothing it relies on"))
        self._decide(sock, event)

    def _load_seconds(self, plan) -> float:
        """The slowest rank's time to read and pack its new slices for `plan` (0 for a rank
        whose slices stay, or that still holds them from the plan before: `layer_spec`)."""
        cfg, worst = self.cfg, 0.0
        for r, dev in enumerate(self.base.devices):
            new, old = layer_spec(plan, cfg, r), layer_spec(self.plan, cfg, r)
            if new is None or new == old:
                continue
            if self.held[r] is not None and json.loads(json.dumps(new)) == self.held[r]:
                continue
            nbytes = spec_bytes(cfg, new)
            speed = (dev.weight_load_Bps or dev.disk_read_Bps or 50e6) / self.factors[r]
            worst = max(worst, nbytes / speed)
        return worst

    def _other_strategy(self, barred, B: int, T: int):
        """With `--strategy auto`, the fastest plan of the strategies other than `barred`'s
        (rows, tensor, stream) that is not rolled back under the present conditions, or None.
        bench-adapt at eb4ed56: node-b's CPU halved, the re-plan's best was `tensor`, predicted
        1.09 s a request and measured 3.5 s (rolled back); barred, the service stayed on the
        plan made for node-b at full speed (1.8 s), where a fresh profile's `rows` plan ran
        0.94 s."""
        if self.strategy != "auto":
            return None
        found = None
        for s in ("rows", "tensor", "stream"):
            if s == barred.strategy:
                continue
            try:
                p = make_plan(self.cfg, self.profile, T, B, strategy=s)
            except PlanError:  # that strategy does not fit
                continue
            if self._rolled_back(p) is None and not _same(p, barred) and \
                    (found is None or p.predicted_latency_s < found.predicted_latency_s):
                found = p
        return found

    def _conditions(self) -> dict:
        """What a plan is chosen on, besides the profile as measured: each rank's speed factor,
        each re-probed link, each memory cap that moved (copies)."""
        return {"factors": list(self.factors), "links": dict(self.links),
                "memory": dict(self.memory)}

    def _rolled_back(self, plan) -> dict | None:
        """The remembered rollback of `plan` whose conditions still hold (none of the factors,
        links and memory caps it was chosen on has moved since), or None. Entries whose
        conditions have moved are forgotten: the plan may be tried again."""
        now = self._conditions()
        kept, found = [], None
        for e in self.rolled_back:
            if not _conditions_moved(e["conditions"], now, self.base):
                kept.append(e)
                if found is None and _same(plan, e["plan"]):
                    found = e
        self.rolled_back = kept
        return found

    def _refit(self) -> None:
        p = self.base
        for r, f in enumerate(self.factors):
            if f != 1.0:
                p = scaled_speed(p, r, f)
        if self.memory:
            devs = list(p.devices)
            for r, usable in self.memory.items():
                devs[r] = dataclasses.replace(devs[r], memory_bytes=usable + devs[r].reserved_bytes)
            p = dataclasses.replace(p, devices=devs)
        self.profile = with_links(p, self.links) if self.links else p
        now = time.monotonic()  # since when each link is planned slow (LINK_BACK_N)
        for r in list(self.slow_since):
            if r not in self.links or not _slower(self.base.devices[int(r)], self.links[r]):
                del self.slow_since[r]
        for r, v in self.links.items():
            if _slower(self.base.devices[int(r)], v):
                self.slow_since.setdefault(r, now)

    def _refitted(self, alarmed: set | None, relearn_comm: bool = False) -> None:
        """Predictions anew (a re-fitted profile, or a new plan); every series keeps its
        baseline (the model's standing bias there) and noise; the sums of the alarmed ranks'
        series (all, if None) start from zero, and the communication's baselines are learnt
        anew if asked (links that were probed unchanged)."""
        old = self.monitor
        self.monitor = Monitor(self.cfg, self.profile, self.plan)
        self.monitor.batches = old.batches
        self.monitor.idle = old.idle
        pairs = [(self.monitor.compute, old.compute)]
        if not relearn_comm:
            pairs.append((self.monitor.comm, old.comm))
        for mine, theirs in pairs:
            for r, c in theirs.items():
                if alarmed is None or r in alarmed:
                    c.restart()
                mine[r] = c
        self.monitor.comm_lambda = COMM_LAMBDA * self.comm_lambda_scale
        self.monitor.swing_range = self.swing_range
        for c in self.monitor.comm.values():
            c.lam = max(c.lam, self.monitor.comm_lambda)

    # --- figures ---------------------------------------------------------------------------------
    def _horizon(self) -> float:
        """How long the conditions a decision is made on may be expected to hold (HORIZON_N):
        HORIZON_S, or less where the re-plans on compute came more often than that."""
        ts = [e["t"] for e in self.sup.replans
              if any(a.get("kind") == "compute" for a in e.get("alarms", []))][-HORIZON_N:]
        ts.append(time.time())  # this decision's
        if len(ts) < 2:
            return HORIZON_S
        return min(HORIZON_S, statistics.median(b - a for a, b in zip(ts, ts[1:])))

    def _batches_per_s(self) -> float:
        t = self.batch_times
        return (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 1.0

    def _note_residuals(self, shape, ranks_s) -> None:
        pred = self.monitor.predicted(*shape).predicted.get("per_rank", [])
        self.last_residuals = {
            "batch_shape": list(shape),
            "ranks": [{"rank": r, "compute_s": m[0], "comm_s": m[1],
                       "predicted_compute_s": p["compute_s"],
                       "predicted_comm_s": sum(p.get("comm_s", {}).values()) + p.get("wait_s", 0.0),
                       "free_bytes": m[2]}
                      for r, (p, m) in enumerate(zip(pred, ranks_s))]}

    def residuals(self) -> dict:
        """The last batch's residuals, and each rank's detector bounds: its series' baseline
        and the drift, alarm and flag bounds its warm-up noise set (log), which say why a
        change was or was not flagged (bench-adapt: node-b's 2x speed-up at the restore went
        unflagged for 3 s in one round of three)."""
        def bounds(c):
            return None if c is None or c.baseline is None else {
                "baseline": c.baseline, "delta": c.delta, "lambda": c.lam,
                "flag_bound": c.flag_bound}
        m = self.monitor
        return {**self.last_residuals,
                "detector": [{"rank": r, "compute": bounds(m.compute.get(r)),
                              "comm": bounds(m.comm.get(r))}
                             for r in range(len(self.factors))]}


def _active(plan) -> set[int]:
    """The ranks a plan gives a share of some dimension."""
    return {r for shares in (plan.ratios or {}).values() for r, x in enumerate(shares) if x > 0}


def _moved(dev, link: dict, by: float = MOVED) -> bool:
    """A re-probed link more than `by` away from the profile's, in bandwidth or latency."""
    bw = link["bandwidth_Bps"] / dev.bandwidth_Bps
    return abs(math.log(bw)) > math.log1p(by) or abs(link["latency_s"] - dev.latency_s) > 2e-3


def _slower(dev, link: dict, by: float = MOVED) -> bool:
    """A light probe's reading of a link slower than `dev` has it, by `by` (bandwidth) or 2 ms
    (latency). Only this direction counts from a light probe: it may read a shaped link high."""
    return link["bandwidth_Bps"] < dev.bandwidth_Bps / (1 + by) or \
        link["latency_s"] > dev.latency_s + 2e-3


def _conditions_moved(a: dict, b: dict, base) -> bool:
    """Whether conditions `b` differ from `a` (`PlanWatcher._conditions`): a rank's factor by
    more than MOVED, a link (a rank with none re-probed has its profile's) by MOVED or 2 ms,
    a memory cap by MEM_MOVED of the profile's."""
    if any(_moved_factor(fb / fa) for fa, fb in zip(a["factors"], b["factors"])):
        return True
    for r in set(a["links"]) | set(b["links"]):
        dev = base.devices[int(r)]
        la = a["links"].get(r) or {"bandwidth_Bps": dev.bandwidth_Bps, "latency_s": dev.latency_s}
        lb = b["links"].get(r) or {"bandwidth_Bps": dev.bandwidth_Bps, "latency_s": dev.latency_s}
        if _moved(dataclasses.replace(dev, bandwidth_Bps=la["bandwidth_Bps"],
                                      latency_s=la["latency_s"]), lb):
            return True
    for r in set(a["memory"]) | set(b["memory"]):
        cap = base.devices[r].usable_bytes
        if abs(a["memory"].get(r, cap) - b["memory"].get(r, cap)) > MEM_MOVED * cap:
            return True
    return False


def _moved_factor(f: float, by: float = MOVED) -> bool:
    """A compute factor more than `by` away from the profile's speed."""
    return abs(math.log(f)) > math.log1p(by)


def _same(a, b) -> bool:
    if a.strategy != b.strategy or a.primary != b.primary:
        return False
    return all(abs(x - y) < 0.02 for d in a.ratios for x, y in zip(a.ratios[d], b.ratios[d]))


def _strategy(worker_args: list[str]) -> str:
    """The service's strategy (the workers' --strategy), or auto."""
    s = "auto"
    for i, a in enumerate(worker_args[:-1]):
        if a == "--strategy":
            s = worker_args[i + 1]
    return s
