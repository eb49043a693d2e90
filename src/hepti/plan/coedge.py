"""The CNN planner: CoEdge's linear program over each device's share of the rows, then
DeepThings' fusion, chosen per group by the cost model.

**Cost model** (`predict`). Each group of ops of a height-split forward (hepti.parallel.bands)
starts with one halo exchange, point to point between the ranks whose rows meet.
- Compute: rank i's time for op l is a + b x rows_i(l) when it has rows (`CNNCosts`, from the
  profile's `cnn` table: every op timed on every device at the input size as the band
  executor runs it, on bands of two sizes, its bookkeeping and exchange copies included:
  `op_band_s`; older profiles: the whole map's time by its rows, plus a one-row band's fixed
  part and a call's overhead). A fused group recomputes its overlap:
  rows_i(l) are the rows it must compute (`bands.needs`), not the rows it owns. The ops of
  each MobileNetV2 block that lies whole in a group, which the executor runs as one call a
  run of blocks, take that time times the device's measured factor for their range of the
  net at the band's fraction of the rows (`joined_points`, `joined_at`, from the profile's
  op_joined_measured: a whole map saves less than a thin band).
- Exchange: the rows each rank receives and sends are exact (`bands.needs` on the integer
  row counts); rank i's time is its link's latency plus the larger of its bytes in and out,
  less the link's credit (what it passes at once after an idle spell: the profile's
  link_credit_bytes, 0 on a link that keeps to its rate), over its bandwidth (a full-duplex
  port on a switch, as the profile measured it). Its own work around the messages is in the
  band timings; what waiting at the exchange adds to the compute after it, measured on a
  real forward of the `even` split (the profile's exchange_resume_s), is charged to each
  exchange (`CNNCosts.exchange_s`; older profiles: their `exchange_overhead_s`, or none).
- Latency: each rank's clock runs through the groups, a group starting when the rank and
  its exchange's peers are done (the expected latest of them, each rank's time a normal
  with its device's measured spread: `expected_max`), then the pooling (an allgather of each
  rank's partial sums [N, C]) and the head (each rank's share of the columns, an allgather),
  both at the profile's measured allgather (`allgather_s`), which wait for every rank. The
  fusion search and the LP still cost a group as its slowest rank plus `straggle` plus its
  slowest exchange (`group_cost`): a bound that is additive over groups.
- A streamed group (`Split.streamed`) adds to each rank's compute the reading and packing of
  its rows of the group's conv weights, a fetch's fixed cost plus bytes /
  `CNNCosts.load_Bps` (the profile's fetch_overhead_s and weight_load_Bps, fitted to the
  streamed convs of a band executor's forward: hepti.parallel.profile_cnn `stream_fit`; from
  the page cache, as on one box, where a cold disk would add its read), not overlapped: the
  executor reads each op's weights just before it runs.
- A group split by channels (`channel_group_cost`, GenEFlow's vertical split): the exchange
  that brings every rank with a share the whole input map, then per op, the slowest rank's
  compute (its share of the channels of every row) and the slowest rank's allgather of the
  whole output map (every member receives what the others made, over its link). It starts
  when every rank is done.

**The linear program** (`solve_ratios`), CoEdge's formulation for a set of active devices,
one group per op: variables r_i (each device's share of every map's rows) and T_l (op l's
time); T_l >= r_i H_l p_il + o_i + c_il for every active i, where H_l p_il is device i's time
for all of l's rows, o_i its call overhead, and c_il the halo exchange of an interior band of l
over its link (its one neighbour's rows at either end of the order); sum r_i = 1;
r_i (the activations' peak under BTSearch's order, `activation_peak`) + the weights <= each
device's memory. Minimise sum T_l
(latency), or with `objective="energy"` minimise sum_i (P_i^compute x compute_i +
P_i^transmit x exchange_i) under sum T_l <= the deadline: CoEdge's own objective. Energy is
predicted only: there is no power meter here, and the powers are the profile's declared
figures. Every subset of devices is solved (in rank order: the bands follow it), each solution
evaluated exactly by `predict`, and the best kept.

**Fusion** (`choose_groups`): for the chosen ratios, dynamic programming over the spatial ops:
best[b] = min over a of best[a] + cost(group [a, b)), groups of at most MAX_FUSE ops, cost
from `predict`'s group model: fusing saves exchanges (their latencies and syncs) and pays for
deeper halos and recomputed rows.

Nothing here imports MPI.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field

import numpy as np

from hepti.counts import counts
from hepti.errors import PlanError
from hepti.graph.cnn import ADAPTIVE_AVG, CONV, F32, Graph, LINEAR, build, inverted_runs
from hepti.graph.split import (Split, channel_needs, channel_slice, conv_rows, fetches,
                               first_holders, hold, needs, out_channels, owned, spatial_ops)
from hepti.graph.opdag import from_cnn
from hepti.order.search import executor_order
from hepti.plan.planfile import Plan
from hepti.plan.strategies import BANDS, names

CNN_STRATEGIES = names(BANDS, choosable=True)  # hepti.plan.strategies
MAX_FUSE = 8  # ops in one fused group at most (deeper halos grow fast: DeepThings fuses ~4-16)
MIN_SHARE = 0.02  # an active device's share at least this (a band of a few rows at worst)
EXHAUSTIVE_MAX = 6  # up to this many devices, every subset is solved; beyond, prefixes by speed
FUSE_CANDIDATES = 3  # the best splits over several devices whose fusion is searched
DEFAULT_LOAD_BPS = 100e6  # a streamed weight's read and pack, when the profile says nothing


@dataclass
class CNNCosts:
    """Per device: seconds of each op over the whole map (`op_s[i][l]`, measured at `h` x `w`,
    batch `n`), what the band executor adds per op beyond them (`overhead_s`: 0 from band
    timings, an older profile's `op_overhead_s`), link latency and bandwidth, memory, and
    declared power."""

    op_s: list[list[float]]
    overhead_s: list[float]
    latency_s: list[float]
    bandwidth_Bps: list[float]
    memory_bytes: list[float]
    h: int
    w: int
    n: int = 1
    power: list[tuple[float, float]] | None = None  # (compute W, transmit W) per device
    # stored weight bytes/s a device reads and packs for a streamed group (the profile's
    # weight_load_Bps, else disk_read_Bps; DEFAULT_LOAD_BPS when it has neither)
    load_Bps: list[float] | None = None
    # per device, seconds of its own work in each halo exchange it takes part in, beyond the
    # link's latency and bytes (the profile's exchange_resume_s: a real forward's compute
    # beyond its bands'; older profiles' exchange_overhead_s; else 0)
    exchange_s: list[float] | None = None
    # per device and op, the part of op_s[i][l] a band of any rows pays whole (reading and
    # packing the weight, the kernel call: the profile's op_fixed_s; 0 in older profiles)
    fixed_s: list[list[float]] | None = None
    # per device, seconds per byte of the copies a split by channels makes (the profile's
    # layout_s_per_byte: laying the gathered map out whole; 0 in older profiles)
    layout_s: list[float] | None = None
    # per device, seconds one streamed conv's fetch costs beyond its bytes at load_Bps (the
    # profile's fetch_overhead_s: hepti.parallel.profile_cnn `stream_fit`; 0 in older profiles)
    fetch_s: list[float] | None = None
    # per device and conv, the seconds its whole weight adds when streamed, as timed in the
    # band executor's forward (the profile's op_stream_measured; None elsewhere, and in older
    # profiles): `stream_seconds`
    stream_s: list[list] | None = None
    # k -> (seconds, seconds per byte[, seconds, seconds per byte]) of an allgather among k
    # ranks, short messages' line and long ones' (the profile's allgather_s: hepti.parallel.
    # profile_links.measure_collectives; a link's latency and bytes in older profiles)
    allgather_s: dict | None = None
    # op_s and fixed_s timed on bands as the executor runs them (the profile's op_band_s):
    # fixed_s then holds the executor's own work around each op too, which a rank with any
    # channels of an op pays whole (`channel_group_cost`)
    band_measured: bool = False
    # per device, the relative spread (sigma / mean) of an op's time from one run to the next
    # (the profile's band_spread; none in older profiles): `straggle`
    spread: list[float] | None = None
    # per device and op, what an op of a group's inverted-residual blocks costs against its
    # band timing when the executor runs them as one call (the profile's op_joined_measured,
    # through `joined_points`; None in older profiles and for networks without such blocks)
    joined: list[list[float]] | None = None
    # the same per device and op at each measured band fraction ((fraction, factor), ...):
    # `joined_points`; group_cost takes a band's own (None: `joined` alone)
    joined_pts: list[list[tuple]] | None = None
    # per device, the bytes its link passes at once after an idle spell, beyond latency +
    # bytes / bandwidth (the profile's link_credit_bytes: hepti.parallel.profile_links
    # `link_credit`; none in older profiles): `exchange_seconds`
    credit_bytes: list[float] | None = None
    _rows: dict = field(default_factory=dict, repr=False, compare=False)  # row_seconds' memo

    @property
    def size(self) -> int:
        return len(self.op_s)

    @classmethod
    def from_profile(cls, profile, graph: Graph) -> "CNNCosts":
        table = profile.extra.get("cnn")
        if not table:
            raise PlanError("this profile has no CNN timings: measure one for this model with "
                            "`mpiexec -n N hepti profile --model MODEL_DIR --out PROFILE.json`")
        names = [op.name for op in graph.ops]
        if table.get("ops") != names:
            raise PlanError(f"the profile's CNN timings are for another network "
                            f"({table.get('arch')}); measure this model's")
        devs = profile.devices
        power = None
        if all(getattr(d, "power", None) for d in devs):
            power = [tuple(d.power) for d in devs]
        elif table.get("power"):
            power = [tuple(p) for p in table["power"]]
        over = table.get("op_overhead_s") or [d.call_overhead_s for d in devs]
        op_s = [list(map(float, r)) for r in table["op_s"]]
        fixed = ([list(map(float, r)) for r in table["op_fixed_s"]]
                 if table.get("op_fixed_s") else None)
        exchange = [float(x) for x in table.get("exchange_overhead_s") or [0.0] * len(devs)]
        if table.get("op_band_s"):  # each op as the band executor ran it (profiler rev. 9)
            op_s, fixed, over, exchange = _band_costs(table, graph, op_s)
            if table.get("exchange_resume_s"):  # a real forward's compute beyond the bands'
                exchange = [float(x) for x in table["exchange_resume_s"]]
        costs = cls(op_s=op_s, band_measured=bool(table.get("op_band_s")),
                   spread=[float(x) for x in table["band_spread"]]
                   if table.get("band_spread") else None,
                   overhead_s=[float(x) for x in over],
                   latency_s=[float(d.latency_s) for d in devs],
                   bandwidth_Bps=[float(d.bandwidth_Bps) for d in devs],
                   memory_bytes=[float(d.usable_bytes) for d in devs],
                   h=int(table["input"][0]), w=int(table["input"][1]),
                   n=int(table.get("batch", 1)), power=power,
                   load_Bps=[float(d.weight_load_Bps or d.disk_read_Bps or DEFAULT_LOAD_BPS)
                             for d in devs],
                   exchange_s=exchange, fixed_s=fixed,
                   layout_s=[float(x) for x in table["layout_s_per_byte"]]
                   if table.get("layout_s_per_byte") else None,
                   fetch_s=[float(x) for x in table["fetch_overhead_s"]]
                   if table.get("fetch_overhead_s") else None,
                   stream_s=[[None if t is None else max(0.0, float(t)) for t in r]
                             for r in table["op_stream_measured"]]
                   if table.get("op_stream_measured") else None,
                   allgather_s={int(k): tuple(map(float, v))
                                for k, v in table["allgather_s"].items()}
                   if table.get("allgather_s") else None,
                   credit_bytes=[float(x) for x in table["link_credit_bytes"]]
                   if table.get("link_credit_bytes") else None)
        if table.get("op_joined_measured") and costs.band_measured:
            pts = joined_points(costs, graph, table["op_joined_ranges"],
                                table["op_joined_measured"])
            if pts is not None:
                costs.joined = [[p[0] for p in row] for row in pts]
                costs.joined_pts = [[p[1] for p in row] for row in pts]
        return costs

    def exchange_work(self, i: int) -> float:
        """Device i's own seconds in one halo exchange (0 when the profile does not say)."""
        return self.exchange_s[i] if self.exchange_s else 0.0

    def copy_seconds(self, i: int, nbytes: float) -> float:
        """Device i's seconds copying `nbytes` of a map (0 when the profile does not say)."""
        return nbytes * self.layout_s[i] if self.layout_s else 0.0

    def allgather(self, i: int, k: int, nbytes: float) -> float:
        """Device i's seconds in an allgather among k ranks that moves `nbytes` through its
        port (the larger of what it sends and receives): the larger of the profile's short-
        and long-message lines (hepti.parallel.profile_links `measure_collectives`; profiles before
        revision 12 hold the short line alone)."""
        if self.allgather_s and k in self.allgather_s:
            line = self.allgather_s[k]
            return max(line[i] + nbytes * line[i + 1] for i in range(0, len(line) - 1, 2))
        return self.latency_s[i] + nbytes / self.bandwidth_Bps[i]

    def fixed(self, i: int, l: int) -> float:
        """Device i's seconds of op l that do not scale with its rows (0 when the profile does
        not say): charged whole to a rank with any rows of the op (`row_seconds` has the rest)."""
        return self.fixed_s[i][l] if self.fixed_s else 0.0


def _band_costs(table: dict, graph: Graph, op_s: list[list[float]]):
    """(op_s, fixed_s, overhead_s, exchange_s) from the profile's `op_band_s`: op l on a band of
    k rows takes a + b x k (hepti.parallel.profile_cnn.measure_band_costs), so its whole map
    a + b x rows and its fixed part a. The executor's own work around each op and the
    exchange's copies were timed in a and b, so the separate figures for them are 0."""
    shapes = graph.shapes(int(table["input"][0]), int(table["input"][1]))
    out_s, fixed = [list(r) for r in op_s], [[0.0] * len(r) for r in op_s]
    for i, per in enumerate(table["op_band_s"]):
        for l, ab in enumerate(per):
            if ab is not None:
                a, b = float(ab[0]), float(ab[1])
                out_s[i][l] = a + b * _op_rows(graph.ops[l], shapes)
                fixed[i][l] = a
    zeros = [0.0] * len(op_s)
    return out_s, fixed, zeros, list(zeros)


def joined_points(costs: CNNCosts, graph: Graph, ranges: list, measured: list
                  ) -> list[list[tuple]] | None:
    """Per device and op, (factor over all fractions, ((fraction, factor), ...)): the factor on
    an op's band seconds when it is in one of a group's inverted blocks (`joined_ops`,
    `group_cost`); (1.0, ()) elsewhere. From the profile's op_joined_measured
    (hepti.parallel.profile_cnn `measure_band_costs`), per device [(fraction, [seconds per
    range], [op by op, per range])] of rank 0 of two, with the spatial ops in `ranges` as
    groups, where the executor runs each range's runs of blocks as one call, against the same
    bands one op a group: per range, this model's bands in that group at the measured ratio of
    its op-by-op bands, less what it gives the range's ops outside blocks, over what it gives
    the blocks' ops; summed over the fractions, and each fraction's own (its band alone);
    clipped to [0.2, 1.5]. Why: on emu-mixed4 (2026-11-30) MobileNetV2's `grid` (one group)
    ran its slow ranks' compute in 51.6 and 42.6 ms against 93.5 and 90.7 predicted op by op.
    `group_cost` takes the factor at a band's own fraction (`joined_at`): what joining saves
    depends on the band. On emu-mixed4 (2026-12-01, MobileNetV2) a range's blocks joined took
    0.30-0.45 of their op-by-op time on bands of 15% of the rows and 0.51-0.61 on the whole
    map (the middle ranges, every device), so the sum over the fractions priced a whole map's
    blocks ~20% low: `pipeline` (every stage a whole map) ran 8-20% over its prediction in
    every round of four runs, `single` 2-11%. The sum stays `CNNCosts.joined`, for a caller
    without a band's fraction."""
    L = spatial_ops(graph)
    shapes = graph.shapes(costs.h, costs.w)
    per_row = row_seconds(costs, graph, costs.w, costs.n)
    if not joined_ops(graph, (0, L)):
        return None

    def seconds(i, l, r):
        if r is None or r[1] <= r[0]:
            return 0.0
        return (r[1] - r[0]) * per_row[i][l] + costs.fixed(i, l) + costs.overhead_s[i]

    def clip(x):
        return min(max(x, 0.2), 1.5)

    out = []
    for i, pts in enumerate(measured):
        row = [(1.0, ())] * len(graph.ops)
        for k, (a, b) in enumerate(ranges):
            blocks = joined_ops(graph, (a, b))
            sums = [0.0, 0.0, 0.0]  # want, other, chain over the fractions
            each = []
            for f, joined, by_op in pts or ():
                ratios = (float(f), 1.0 - float(f))
                one = needs(graph, shapes, (a, b), ratios, 0)
                alone = sum(seconds(i, l, needs(graph, shapes, (l, l + 1), ratios, 0).get(
                    graph.ops[l].output)) for l in range(a, b))
                want = float(joined[k]) / float(by_op[k]) * alone
                other = chain = 0.0
                for l in range(a, b):
                    t = seconds(i, l, one.get(graph.ops[l].output))
                    if l in blocks:
                        chain += t
                    else:
                        other += t
                sums = [sums[0] + want, sums[1] + other, sums[2] + chain]
                if chain > 0:
                    each.append((float(f), clip((want - other) / chain)))
            if sums[2] > 0:
                entry = (clip((sums[0] - sums[1]) / sums[2]), tuple(sorted(each)))
                for l in blocks:
                    row[l] = entry
        out.append(row)
    return out


def joined_at(points: tuple, fraction: float) -> float | None:
    """The joined factor at a band of `fraction` of the rows, linear between the measured
    fractions' `points` ((fraction, factor), ...), the nearest one's beyond them; None
    without points."""
    if not points:
        return None
    if fraction <= points[0][0]:
        return points[0][1]
    for (f0, k0), (f1, k1) in zip(points, points[1:]):
        if fraction <= f1:
            return k0 + (k1 - k0) * (fraction - f0) / (f1 - f0) if f1 > f0 else k1
    return points[-1][1]


def joined_ops(graph: Graph, group) -> frozenset:
    """The ops of `group` ([a, b)) that the band executor runs as inverted-residual blocks
    (hepti.graph.cnn `inverted_runs`: every op of a block that lies whole in the group; in a
    group split by rows, without streamed weights, consecutive blocks as one call)."""
    key = (id(graph), group[0], group[1])
    if _JOINED.get(key, (None,))[0] is not graph:
        a, b = group
        _JOINED[key] = (graph, frozenset(a + j + d for j, k in inverted_runs(graph.ops[a:b])
                                         for d in range(k)))
    return _JOINED[key][1]


_JOINED: dict = {}  # (id(graph), a, b) -> (graph, ops): the fusion search asks per group


# --- the cost model -----------------------------------------------------------------------------

def straggle(costs: CNNCosts, comp: list[float]) -> float:
    """Seconds a bulk-synchronous step ends after its slowest rank's mean: each rank's time
    scatters by its device's spread (`CNNCosts.spread`: sigma = time x spread), and the step
    waits for the last of the ranks with work: `expected_max` of their normals, less the
    slowest mean; 0 without a measured spread. Ranks in step wait E[max of k normals] x sigma,
    one far behind the rest waits for no one but itself.

    On emu-geneflow4 (2026-11-27) GenEFlow's MobileNetV2 plans of 46 one-op groups over 4
    devices ran 15-20% over a prediction that priced only the means. This was then E[max of k]
    x the largest sigma, as if the k ranks were always in step: re-predicted on the launches
    of the 3e2a83c grid (`git show 36ab859:results/geneflow-cnn.json`), that priced
    MobileNetV2's 4-device 50%-cap plan, channel-split ops and all, 15.2% above what it ran;
    this, 13.8%."""
    if not costs.spread:
        return 0.0
    busy = [(c, (c * s) ** 2) for c, s in zip(comp, costs.spread) if c > 0]
    if len(busy) < 2:
        return 0.0
    return max(0.0, expected_max(busy)[0] - max(c for c, _ in busy))


def _normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _normal_cdf(x: float) -> float:
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


def expected_max(clocks: list[tuple[float, float]]) -> tuple[float, float]:
    """(mean, variance) of the latest of independent normal times, each (mean, variance):
    Clark's moments of the max of two normals (Operations Research 9(2), 1961), applied
    pairwise. Ranks far apart in their means give the later one's; k ranks in step with
    sigma each give about E[max of k standard normals] x sigma (0.5642 for 2, 1.0294 for 4)."""
    m1, v1 = clocks[0]
    for m2, v2 in clocks[1:]:
        theta = math.sqrt(v1 + v2)
        if theta <= 1e-12 * max(1.0, abs(m1), abs(m2)):
            m1, v1 = (m1, v1) if m1 >= m2 else (m2, v2)
            continue
        a = (m1 - m2) / theta
        p, q, d = _normal_cdf(a), _normal_cdf(-a), _normal_pdf(a)
        mean = m1 * p + m2 * q + theta * d
        second = (m1 * m1 + v1) * p + (m2 * m2 + v2) * q + (m1 + m2) * theta * d
        m1, v1 = mean, max(0.0, second - mean * mean)
    return m1, v1


def _op_rows(op, shapes) -> int:
    """The rows an op's time is counted over: its output's (a pool's: its input's)."""
    return shapes[op.input][0] if op.kind == ADAPTIVE_AVG else shapes[op.output][0]


def row_seconds(costs: CNNCosts, graph: Graph, w: int, n: int) -> list[list[float]]:
    """Per device and op, the seconds of one output row at width w, batch n: the measured
    whole-map time less its fixed part (`CNNCosts.fixed`) over the measured map's rows, scaled
    by the row's width (w / costs.w) and the images (n / costs.n). A linear op's entry is its
    whole time per image batch. Kept per (graph, w, n): the fusion search asks for it in every
    group it costs (2,100 times for ResNet-50 at 4 devices, half of a 1.1 s plan)."""
    key = (id(graph), w, n)
    if key not in costs._rows:
        costs._rows[key] = (graph, _row_seconds(costs, graph, w, n))  # graph: keeps id unique
    return costs._rows[key][1]


def _row_seconds(costs: CNNCosts, graph: Graph, w: int, n: int) -> list[list[float]]:
    measured = graph.shapes(costs.h, costs.w)
    k = (w / costs.w) * (n / costs.n)
    out = []
    for i, times in enumerate(costs.op_s):
        row = []
        for l, (op, t) in enumerate(zip(graph.ops, times)):
            rows = _op_rows(op, measured) if op.kind != LINEAR else 1
            row.append((t - costs.fixed(i, l)) / rows * (k if op.kind != LINEAR else n / costs.n))
        out.append(row)
    return out


def group_cost(graph: Graph, shapes: dict, group, ratios, costs: CNNCosts, n: int = 1,
               w: int | None = None, moved: list | None = None, owners: dict | None = None,
               load: list[float] | None = None, holders: dict | None = None,
               partners: list | None = None
               ) -> tuple[float, float, list[float], list[float]]:
    """(slowest compute, slowest exchange, compute per rank, exchange per rank) of one group
    split by `ratios`; `owners` (Split.owners) says how the group's inputs are split, by
    `ratios` too if not given; `holders`: what each rank holds before it (`exchange_seconds`;
    updated); `moved`, [sent, received] bytes per rank, is added to; `partners`, a set per
    rank, gets each rank's exchange peers."""
    w = costs.w if w is None else w
    per_row = row_seconds(costs, graph, w, n)
    P = costs.size
    need = [needs(graph, shapes, group, ratios, r) for r in range(P)]
    comp = [0.0] * P
    a, b = group
    # a group's inverted blocks run as one call each run of them (not with streamed weights)
    blocks = joined_ops(graph, group) if costs.joined and load is None else ()
    for i in range(P):
        for l in range(a, b):
            r = need[i].get(graph.ops[l].output)
            if r is None or r[1] <= r[0]:
                continue
            s = (r[1] - r[0]) * per_row[i][l] + costs.fixed(i, l) + costs.overhead_s[i]
            if l in blocks:  # at the factor measured for a band of its fraction of the rows
                at = (joined_at(costs.joined_pts[i][l], (r[1] - r[0]) / shapes[
                    graph.ops[l].output][0]) if costs.joined_pts else None)
                s *= costs.joined[i][l] if at is None else at
            comp[i] += s
    if load is not None:  # the streamed weights' reads (`stream_seconds`), one per op run
        comp = [u + v for u, v in zip(comp, load)]
    comm, sent, got = exchange_seconds(graph, shapes, group, ratios, need, costs, n, owners,
                                       holders, partners)
    _held(graph, shapes, group, need, holders, False, P)
    if moved is not None:
        for i in range(P):
            moved[i][0] += sent[i]
            moved[i][1] += got[i]
    return max(comp) + straggle(costs, comp), max(comm), comp, comm


def _held(graph, shapes, group, need, holders, by_channels: bool, P: int) -> None:
    if holders is not None:
        made = [op.output for op in graph.ops[group[0]:group[1]]]
        inputs = sorted({t for nd in need for t in nd} - set(made))
        hold(holders, need, inputs, made, by_channels, shapes, P)


def stream_seconds(graph: Graph, group, rows: list[dict], costs: CNNCosts) -> list[float]:
    """Each rank's seconds reading and packing its rows (`rows[i]`: hepti.graph.split
    `conv_rows` of rank i) of the group's conv weights: each fetch's fixed cost and its bytes
    at the device's load rate; where the profile timed the conv streamed in a forward
    (`CNNCosts.stream_s`), that time, scaled to the rows by the same fixed + bytes line."""
    load = costs.load_Bps or [DEFAULT_LOAD_BPS] * costs.size
    fetch = costs.fetch_s or [0.0] * costs.size
    per_row = graph.row_bytes()
    ops = [(l, op) for l, op in enumerate(graph.ops[group[0]:group[1]], group[0])
           if op.kind == CONV]
    out = []
    for i, r in enumerate(rows):
        t = 0.0
        for l, op in ops:
            lo, hi = r.get(op.name, (0, 0))
            if hi <= lo:
                continue
            part = fetch[i] + (hi - lo) * per_row[op.name] / load[i]
            timed = costs.stream_s[i][l] if costs.stream_s else None
            if timed is not None:
                part *= timed / (fetch[i] + op.cout * per_row[op.name] / load[i])
            t += part
        out.append(t)
    return out


def channel_group_cost(graph: Graph, shapes: dict, group, ratios, costs: CNNCosts,
                       members: list[int], n: int = 1, w: int | None = None,
                       moved: list | None = None, owners: dict | None = None,
                       load: list[float] | None = None, holders: dict | None = None
                       ) -> tuple[float, float, list[float], list[float]]:
    """`group_cost` of a group split by channels (hepti.parallel.bands `_by_channels`): the
    exchange of the whole input maps to every rank with a share, then each op in turn, each
    rank computing its channels of every row and all of the `members` (the executor's
    sub-communicator) allgathering the whole output map; each op ends when its slowest rank
    has its map. Returns (the ops' slowest computes summed, the exchange's and the ops'
    slowest allgathers summed, compute per rank, communication per rank); `moved` gets the
    exchange's bytes (the allgathers' are not halo bytes)."""
    w = costs.w if w is None else w
    per_row = row_seconds(costs, graph, w, n)
    P = costs.size
    need = [channel_needs(graph, shapes, group, ratios, r) for r in range(P)]
    comm, sent, got = exchange_seconds(graph, shapes, group, ratios, need, costs, n, owners,
                                       holders)
    _held(graph, shapes, group, need, holders, True, P)
    c_sum, x_sum = 0.0, max(comm)
    comp = [0.0] * P
    comm = list(comm)
    for l in range(*group):
        op = graph.ops[l]
        hh, ww, c = shapes[op.output]
        per = out_channels(op, ratios, c)
        c_op, x_op = [0.0] * P, [0.0] * P
        for i in range(P):
            if per[i]:
                # its slice of the weight: the fixed part by its channels too, but for the
                # executor's own work in it (timed with it on bands), which is whole
                fixed = costs.fixed(i, l)
                c_op[i] = (hh * per_row[i][l] * per[i] / c + costs.overhead_s[i]
                           + (fixed if costs.band_measured else fixed * per[i] / c))
                # the copies of its slices: a depthwise conv's or a pool's input channels,
                # the residual's (hepti.parallel.bands `_by_channels`)
                i0, i1 = channel_slice(op, ratios, i, c)[2:4]
                h_in, w_in, c_in = shapes[op.input]
                sliced = (i1 - i0) * h_in * w_in if (i0, i1) != (0, c_in) else 0
                if op.residual is not None:
                    sliced += per[i] * hh * ww
                c_op[i] += costs.copy_seconds(i, F32 * n * sliced)
                if load is not None and l == group[0]:  # a channel group is one op
                    c_op[i] += load[i]
            if i in members:  # the gathered map laid out whole (`lay_out_channels`)
                c_op[i] += costs.copy_seconds(i, F32 * n * hh * ww * c)
        for i in (members if len(members) > 1 else ()):  # its channels to each other
            # member, and everyone else's to it
            out_b = F32 * n * hh * ww * per[i] * (len(members) - 1)
            in_b = F32 * n * hh * ww * (c - per[i])
            x_op[i] = costs.allgather(i, len(members), max(out_b, in_b))
        c_sum += max(c_op) + straggle(costs, c_op)
        x_sum += max(x_op)
        comp = [u + v for u, v in zip(comp, c_op)]
        comm = [u + v for u, v in zip(comm, x_op)]
    if moved is not None:
        for i in range(P):
            moved[i][0] += sent[i]
            moved[i][1] += got[i]
    return c_sum, x_sum, comp, comm


def exchange_seconds(graph, shapes, group, ratios, need, costs: CNNCosts, n: int,
                     owners: dict | None = None, holders: dict | None = None,
                     partners: list | None = None
                     ) -> tuple[list[float], list[float], list[float]]:
    """Each rank's time in the group's exchange, and its bytes sent and received: the rows
    it needs (`needs`) and does not hold, each from its owner (the pixels from rank 0), over
    the rank's link: hepti.graph.split `fetches`, the executor's own list. `holders`: what
    each rank holds of each tensor when the group starts (`predict` walks the groups as the
    executor does: after a split by channels every rank holds the whole map, and rows fetched
    once stay); when None, as a group costed on its own, each rank holds just its own rows.
    `partners`, a set per rank, gets the ranks each rank sends to or receives from."""
    P = costs.size
    a, b = group
    made = {op.output for op in graph.ops[a:b]}
    inputs = sorted({t for nd in need for t in nd} - made)
    by = {t: None if t == graph.input else (owners or {}).get(t, ratios) for t in inputs}
    if holders is None:
        holders = {t: owned(shapes[t][0], by[t], P) for t in inputs}
    sent, got = [0.0] * P, [0.0] * P
    for t, j, i, lo, hi in fetches(need, inputs, by, holders, shapes, P):
        h_t, w_t, c_t = shapes[t]
        nbytes = (hi - lo) * F32 * w_t * c_t * n
        sent[j] += nbytes
        got[i] += nbytes
        if partners is not None:
            partners[i].add(j)
            partners[j].add(i)
    credit = costs.credit_bytes or [0.0] * P  # what the link passes at once, idle before
    secs = [(costs.latency_s[i] + max(0.0, max(sent[i], got[i]) - credit[i])
             / costs.bandwidth_Bps[i] + costs.exchange_work(i)) if sent[i] or got[i] else 0.0
            for i in range(P)]
    return secs, sent, got


def tail_seconds(graph: Graph, shapes: dict, split: Split, costs: CNNCosts, n: int = 1
                 ) -> tuple[float, list[float], list[float]]:
    """(latency, compute per rank, communication per rank) of the pooling and the head, on
    the ranks the forward runs on (rank 0 and every rank with a share: the executor's
    sub-communicator, Split.members). The ops run one after the other, each ending in its
    allgather, which every member waits for: the latency is the sum over the ops of the
    slowest rank's compute and the slowest allgather. (It was the slowest rank's compute of
    all of them plus its allgathers, as if the head could run beside the pooling: in
    `pipeline` the last stage's rank pools, and rank 0 runs the head only once the pooled sums
    are in, 0.4 ms of MobileNetV2's head at 0.5 core on emu-mixed4 left out.)"""
    P, ratios = costs.size, split.ratios
    members = split.members()
    on = [i in members for i in range(P)]
    owners = split.owners(graph)
    per_row = row_seconds(costs, graph, shapes[graph.input][1], n)
    comp, comm = [0.0] * P, [0.0] * P
    latency = 0.0
    for l in range(spatial_ops(graph), len(graph.ops)):
        op = graph.ops[l]
        before = list(comp), list(comm)
        if op.kind == ADAPTIVE_AVG:
            hh, ww, c = shapes[op.input]
            for i, (o0, o1) in enumerate(owned(hh, owners.get(op.input, ratios), P)):
                if o1 > o0:
                    comp[i] += (o1 - o0) * per_row[i][l] + costs.fixed(i, l)
            rows = owned(hh, owners.get(op.input, ratios), P)
            holders = [o1 > o0 for o0, o1 in rows]
            for i in (members if len(members) > 1 else ()):
                if op.out_hw == (1, 1):  # each holder's partial sums (`bands.pooled_sum`)
                    got = (sum(holders) - holders[i]) * F32 * n * c
                    sent = holders[i] * (len(members) - 1) * F32 * n * c
                else:  # the whole map gathered
                    mine = (rows[i][1] - rows[i][0]) * F32 * n * ww * c
                    got, sent = F32 * n * hh * ww * c - mine, mine * (len(members) - 1)
                comm[i] += costs.allgather(i, len(members), max(got, sent))
        elif op.kind == LINEAR:
            if split.head == "primary" or P == 1:
                comp[0] += per_row[0][l] + costs.fixed(0, l)
            else:
                c = counts(op.cout, ratios)
                for i in range(P):
                    if c[i]:
                        comp[i] += c[i] / op.cout * per_row[i][l] + costs.fixed(i, l)
                    if on[i] and len(members) > 1:  # the columns allgathered
                        got = F32 * n * (op.cout - c[i])
                        sent = F32 * n * c[i] * (len(members) - 1)
                        comm[i] += costs.allgather(i, len(members), max(got, sent))
        latency += (max(u - v for u, v in zip(comp, before[0]))
                    + max(u - v for u, v in zip(comm, before[1])))
    return latency, comp, comm


def predict(graph: Graph, split: Split, costs: CNNCosts, h: int, w: int, n: int = 1) -> dict:
    """The cost model's account of a split at h x w, batch n: latency and per rank compute,
    exchange and (with declared powers) energy.

    The latency follows the executor's synchronisation (hepti.parallel.bands `forward`): a group
    split by rows starts on a rank when the rank and the peers of its halo exchange are done
    with what came before (`Comm.exchange`: point to point, no barrier), and a group with no
    exchange waits for no one; a group split by channels, whose ops end in allgathers, waits for
    every rank, and so do the pooling and the head. Each rank's time is carried as a normal (a
    mean, and a variance that each compute adds to by its device's measured spread), and a wait
    is the expected latest of the ranks it waits for (`expected_max`). It was the sum over
    groups of the slowest rank plus `straggle`, as if every group ended at a barrier in which k
    balanced ranks wait for the last: on a quiet host (2026-11-28) that priced GenEFlow's
    MobileNetV2 plans of 46 groups over 3 and 4 devices at 50% caps 15-23% above what they ran
    (this: within 11%): a barrier makes every rank pay each group's slowest rank, a halo only
    its peers."""
    shapes = graph.shapes(h, w)
    P = costs.size
    groups = split.group_ranges(graph)
    comp, comm = [0.0] * P, [0.0] * P
    moved = [[0.0, 0.0] for _ in range(P)]
    owners = split.owners(graph)
    holders = first_holders(graph, h, P)  # as the executor's program walks them
    members = split.members()
    if split.streamed and any(split.streamed):  # each rank's weight rows, once
        rows = [conv_rows(graph, split, i, P) for i in range(P)]
    spread = costs.spread or [0.0] * P
    clocks = [(0.0, 0.0)] * P  # each rank's (mean, variance) of when it is done so far
    for k, g in enumerate(groups):
        load = stream_seconds(graph, g, rows, costs) if split.group_streamed(k) else None
        if split.group_dim(k) == "channels":  # allgathers: every rank waits for all
            c_max, x_max, c, x = channel_group_cost(graph, shapes, g, split.group_ratios(k),
                                                    costs, members, n, w, moved, owners, load,
                                                    holders)
            clocks = [(expected_max(clocks)[0] + c_max + x_max, 0.0)] * P
        else:  # a halo exchange: each rank waits for its own peers only
            peers = [set() for _ in range(P)]
            c_max, x_max, c, x = group_cost(graph, shapes, g, split.group_ratios(k), costs, n,
                                            w, moved, owners, load, holders, peers)
            starts = [expected_max([clocks[j] for j in sorted(peers[i] | {i})])
                      for i in range(P)]
            clocks = [(m + x[i] + c[i], v + (c[i] * spread[i]) ** 2)
                      for i, (m, v) in enumerate(starts)]
        comp = [u + v for u, v in zip(comp, c)]
        comm = [u + v for u, v in zip(comm, x)]
    t, c, x = tail_seconds(graph, shapes, split, costs, n)
    latency = expected_max(clocks)[0] + t
    comp = [u + v for u, v in zip(comp, c)]
    comm = [u + v for u, v in zip(comm, x)]
    out = {"latency_s": latency, "groups": len(groups),
           # comm_s by kind, as every plan's per-rank prediction has it (hepti.plan.planfile;
           # what `hepti bench fit` and `bench hetero` sum); exchange_s: the same seconds,
           # the name the band plan's own report and readers use
           "per_rank": [{"rank": i, "compute_s": comp[i], "exchange_s": comm[i],
                         "comm_s": {"exchange": comm[i]},
                         "halo_bytes_sent": moved[i][0], "halo_bytes_recv": moved[i][1],
                         "rows": owned(shapes[graph.ops[0].output][0], split.ratios)[i]}
                        for i in range(P)]}
    if costs.power:
        for i, pr in enumerate(out["per_rank"]):
            pr["energy_j"] = costs.power[i][0] * comp[i] + costs.power[i][1] * comm[i]
        out["energy_j"] = sum(pr["energy_j"] for pr in out["per_rank"])
        out["energy_note"] = "predicted from the profile's declared powers; nothing was metered"
    return out


# --- the linear program -------------------------------------------------------------------------

def _interior_halo(op, shapes, n: int) -> tuple[int, int]:
    """(rows above, rows below) an interior band of op's output reads beyond the input rows
    its own share of the input holds (the same ratios on both maps), and the bytes per row."""
    top = op.padding
    bottom = max(0, op.dilation * (op.kernel - 1) + 1 - op.stride - op.padding)
    h_in, w_in, c_in = shapes[op.input]
    return top + bottom, F32 * w_in * c_in * n


def activation_peak(graph: Graph, h: int, w: int, n: int = 1) -> float:
    """Bytes of activations a whole forward holds at its peak when its ops run in BTSearch's
    order (hepti.order.search.executor_order), each tensor freed after its last reader, as the
    executors run it (hepti.model.cnn, hepti.parallel.bands). A rank of a height split holds
    about its share of it (its bands; the halos are a few rows). It replaces the largest
    input + output of one op, which left out what stays live across an op: ResNet-50's block
    input or downsample, held while conv1 and conv2 run (4.8 MB against 7.2 MB at 224)."""
    key = (id(graph), h, w, n)
    if _PEAKS.get(key, (None,))[0] is not graph:
        _PEAKS[key] = (graph, float(executor_order(from_cnn(graph, n, h, w)).peak_bytes))
    return _PEAKS[key][1]


_PEAKS: dict = {}  # (id(graph), h, w, n) -> (graph, peak): solve_ratios runs per device subset


def solve_ratios(graph: Graph, costs: CNNCosts, active: list[int], h: int, w: int, n: int = 1,
                 objective: str = "latency", deadline_s: float | None = None,
                 weight_bytes: list[float] | None = None) -> list[float] | None:
    """CoEdge's LP for the devices in `active` (rank order): each device's share of every
    map's rows, or None if infeasible (memory, or the deadline)."""
    from scipy.optimize import linprog  # local: start-up time (scipy.optimize)
    shapes = graph.shapes(h, w)
    per_row = row_seconds(costs, graph, w, n)
    L = spatial_ops(graph)
    A = len(active)
    nv = A + L  # r_i, then T_l
    rows_ub, b_ub = [], []
    comp_coef = np.zeros((A, nv))  # compute seconds of device a, as a row of coefficients
    comp_const = np.zeros(A)
    comm_const = np.zeros(A)
    for l in range(L):
        op = graph.ops[l]
        H = _op_rows(op, shapes)
        halo_rows, row_bytes = _interior_halo(op, shapes, n)
        for ai, i in enumerate(active):
            edge = ai in (0, A - 1)
            rows_in = halo_rows if A > 1 and not edge else (
                max(op.padding, halo_rows - op.padding) if A > 1 else 0)
            c = (costs.latency_s[i] + rows_in * row_bytes / costs.bandwidth_Bps[i]
                 + costs.exchange_work(i)) if rows_in else 0
            per_all = H * per_row[i][l]  # all rows of op l on device i
            row = np.zeros(nv)
            row[ai] = per_all
            row[A + l] = -1.0
            rows_ub.append(row)
            b_ub.append(-(costs.overhead_s[i] + costs.fixed(i, l) + c))
            comp_coef[ai, ai] += per_all
            comp_const[ai] += costs.overhead_s[i] + costs.fixed(i, l)
            comm_const[ai] += c
    # memory: the share of the activations' peak under BTSearch's order, and the weights
    peak_rows = activation_peak(graph, h, w, n)
    for ai, i in enumerate(active):
        row = np.zeros(nv)
        row[ai] = peak_rows
        rows_ub.append(row)
        b_ub.append(costs.memory_bytes[i] - (weight_bytes[i] if weight_bytes else 0.0))
    a_eq = np.zeros((1, nv))
    a_eq[0, :A] = 1.0
    lo = MIN_SHARE if A > 1 else 1.0
    bounds = [(lo, 1.0)] * A + [(0, None)] * L
    if objective == "energy":
        if not costs.power:
            raise PlanError("--objective energy needs each device's compute and transmit power "
                            "(watts): give --power, or declare them in the profile")
        if deadline_s is None:
            raise PlanError("--objective energy minimises energy under a latency deadline: "
                            "give --deadline-ms")
        c_obj = np.zeros(nv)
        for ai, i in enumerate(active):
            c_obj += costs.power[i][0] * comp_coef[ai]
        row = np.zeros(nv)
        row[A:] = 1.0
        rows_ub.append(row)
        b_ub.append(deadline_s)
    else:
        c_obj = np.zeros(nv)
        c_obj[A:] = 1.0
    res = linprog(c_obj, A_ub=np.array(rows_ub), b_ub=np.array(b_ub), A_eq=a_eq, b_eq=[1.0],
                  bounds=bounds, method="highs")
    if res.status != 0:
        return None
    ratios = [0.0] * costs.size
    for ai, i in enumerate(active):
        ratios[i] = float(res.x[ai])
    return ratios


def choose_groups(graph: Graph, ratios, costs: CNNCosts, h: int, w: int, n: int = 1,
                  max_fuse: int = MAX_FUSE) -> tuple[tuple[int, int], ...]:
    """The fused groups that minimise the cost model's latency for these ratios (DP)."""
    shapes = graph.shapes(h, w)
    L = spatial_ops(graph)
    best = [0.0] + [math.inf] * L
    came = [0] * (L + 1)
    for b in range(1, L + 1):
        for a in range(max(0, b - max_fuse), b):
            c_max, x_max, _, _ = group_cost(graph, shapes, (a, b), ratios, costs, n, w)
            if best[a] + c_max + x_max < best[b]:
                best[b], came[b] = best[a] + c_max + x_max, a
    groups, b = [], L
    while b > 0:
        groups.append((came[b], b))
        b = came[b]
    return tuple(reversed(groups))


def candidate_sets(costs: CNNCosts) -> list[list[int]]:
    """The device subsets the LP is solved for: all of them up to EXHAUSTIVE_MAX devices,
    else the k fastest for each k."""
    P = costs.size
    if P <= EXHAUSTIVE_MAX:
        return [list(s) for k in range(1, P + 1) for s in itertools.combinations(range(P), k)]
    speed = sorted(range(P), key=lambda i: sum(costs.op_s[i]))
    return [sorted(speed[:k]) for k in range(1, P + 1)]


def pipeline_split(graph: Graph, costs: CNNCosts) -> Split:
    """Layer ranges (PipeEdge's baseline, for one image): rank i runs a contiguous range of
    the spatial ops on whole maps, ranges sized so that each rank's share of the work is its
    share of the speed; each group is one rank's range, its vector one-hot on that rank."""
    P, L = costs.size, spatial_ops(graph)
    speed = [1.0 / sum(costs.op_s[i][:L]) for i in range(P)]
    work = [sum(costs.op_s[i][l] * speed[i] for i in range(P)) / P for l in range(L)]
    total, bounds, acc, i = sum(work), [0], 0.0, 0
    cum = [sum(speed[:j + 1]) / sum(speed) * total for j in range(P)]
    for l in range(L):
        acc += work[l]
        while i < P - 1 and acc >= cum[i] - 1e-12 and len(bounds) < P:
            bounds.append(l + 1)
            i += 1
    bounds = sorted(set(bounds + [L]))
    groups, per = [], []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        groups.append((a, b))
        per.append(tuple(1.0 if j == k else 0.0 for j in range(P)))
    return Split(tuple([1.0] + [0.0] * (P - 1)), tuple(groups), "primary", tuple(per))


def fixed_groups(graph: Graph, depth: int) -> tuple[tuple[int, int], ...]:
    """The spatial ops in groups of `depth` (0: one group of all of them)."""
    L = spatial_ops(graph)
    k = L if depth == 0 else depth
    return tuple((a, min(a + k, L)) for a in range(0, L, k))


def plan_cnn(graph: Graph, costs: CNNCosts, h: int, w: int, n: int = 1, strategy: str = "auto",
             objective: str = "latency", deadline_s: float | None = None,
             fuse: bool = True, head: str = "cols", fuse_depth: int | None = None) -> dict:
    """The plan for a CNN: {"split": Split, "predicted": predict(...), "explanation",
    "solve_s"}. Strategies: "auto" (the LP over every device subset, then fusion), "even"
    (equal rows), "proportional" (rows by each device's speed over the whole net: MoDNN),
    "grid" (DeepThings: equal bands, the whole spatial part one fused group), "pipeline"
    (layer ranges by speed), "single" (rank 0 alone, every op in one group: no exchange to
    save, and the executor then runs a group's inverted blocks as one call and ResNet's 1x1
    into its 3x3's bordered map, which one op a group runs op by op; so is "auto"'s split
    over one device); "auto" chooses its fusion, or with
    `fuse_depth` K is the best split over two or more devices fused in groups of K ops (the
    fixed depths the planner's choice is measured against: a split that one device alone
    would beat is still a split, or no depth would be measured at all)."""
    t0 = time.perf_counter()
    P = costs.size
    weights = [graph.weight_bytes()] * P
    whole = ((0, spatial_ops(graph)),)  # one device: every op in one group (`alone`)
    if strategy == "single":
        split = Split(tuple([1.0] + [0.0] * (P - 1)), whole, head="primary")
    elif strategy == "even":
        split = Split(tuple([1.0 / P] * P), head=head)
    elif strategy == "proportional":
        speed = [1.0 / sum(costs.op_s[i]) for i in range(P)]
        split = Split(tuple(s / sum(speed) for s in speed), head=head)
    elif strategy == "grid":  # DeepThings: equal tiles (here bands), every layer fused
        split = Split(tuple([1.0 / P] * P), ((0, spatial_ops(graph)),), head=head)
    elif strategy == "pipeline":
        split = pipeline_split(graph, costs)
    elif strategy == "auto":
        def key(s: Split) -> float:
            pred = predict(graph, s, costs, h, w, n)
            if objective == "energy":  # the LP's per-op model met the deadline; the exact one?
                return pred["energy_j"] if pred["latency_s"] <= deadline_s else math.inf
            return pred["latency_s"]
        found = []
        for active in candidate_sets(costs):
            ratios = solve_ratios(graph, costs, active, h, w, n, objective, deadline_s, weights)
            if ratios is not None:
                s = (Split(tuple(ratios), head=head) if len(active) > 1 else
                     Split(tuple(ratios), whole, head="primary"))
                found.append((key(s), len(active), s))
        found.sort(key=lambda x: x[0])
        if not found or found[0][0] == math.inf:
            raise PlanError("no split of the devices meets " + (
                f"the {deadline_s * 1e3:.0f} ms deadline" if objective == "energy" else
                "the memory caps") + "; give more devices, or a larger deadline")
        # fusion can turn a split that loses on its exchanges into the winner: the best few
        # splits over several devices are fused, and compared fused
        best = found[0]
        if fuse_depth is not None:
            fixed = [(key(f), m, f) for m, f in
                     ((m, Split(s.ratios, fixed_groups(graph, fuse_depth), s.head))
                      for _, m, s in found if m > 1)]
            best = min(fixed, key=lambda x: x[0]) if fixed else best
        elif fuse:
            for k, m, s in [f for f in found if f[1] > 1][:FUSE_CANDIDATES]:
                fused = Split(s.ratios, choose_groups(graph, s.ratios, costs, h, w, n), s.head)
                if key(fused) < best[0]:
                    best = (key(fused), m, fused)
        split = best[2]
    else:
        raise PlanError(f"unknown CNN strategy {strategy!r}; choose one of "
                        f"{', '.join(CNN_STRATEGIES)}")
    pred = predict(graph, split, costs, h, w, n)
    active = [i for i, r in enumerate(split.ratios) if r > 0]
    fused = split.groups is not None and len(split.groups) < spatial_ops(graph)
    why = (f"{strategy}: rows {', '.join(f'{r:.2f}' for r in split.ratios)} over rank(s) "
           f"{', '.join(map(str, active))}; "
           + ("every op in one group, no exchange" if len(active) == 1 and fused else
              f"{len(split.groups)} fused groups of the {spatial_ops(graph)} spatial ops "
              f"(one halo exchange each)" if fused else "one halo exchange per op")
           + f"; predicted {pred['latency_s'] * 1e3:.1f} ms")
    if objective == "energy":
        why += (f", {pred['energy_j']:.2f} J predicted (declared powers; not metered) under "
                f"the {deadline_s * 1e3:.0f} ms deadline")
    return {"split": split, "predicted": pred, "explanation": why,
            "solve_s": time.perf_counter() - t0}


def make_cnn_plan(config, profile, strategy: str = "auto", objective: str = "latency",
                  deadline_ms: float | None = None, power: list | None = None,
                  ratios: list[float] | None = None, size: tuple[int, int] | None = None,
                  batch: int | None = None, fuse_depth: int | None = None):
    """A plan file (hepti.plan.planfile.Plan, strategy "bands") for a CNN from a profile with
    CNN timings, at the profile's input size unless `size` (h, w) is given. `ratios` evaluates
    those shares (one group per op) instead of solving; `power` declares (compute W, transmit
    W) per device for the energy objective; `fuse_depth` K fixes the fusion of "auto" (and of
    given ratios) to groups of K ops (0: all of them) instead of choosing it."""
    graph = build(config)
    costs = CNNCosts.from_profile(profile, graph)
    if power is not None:
        if len(power) != costs.size:
            raise PlanError(f"--power gives {len(power)} devices' powers; the profile has "
                            f"{costs.size}")
        costs.power = [tuple(p) for p in power]
    h, w = size or (costs.h, costs.w)
    n = batch or costs.n
    deadline = None if deadline_ms is None else deadline_ms / 1e3
    if ratios is not None:
        split = Split(tuple(ratios))
        out = {"split": split, "explanation": "the given ratios, evaluated", "solve_s": 0.0}
    else:
        out = plan_cnn(graph, costs, h, w, n, strategy, objective, deadline,
                       fuse=fuse_depth is None, fuse_depth=fuse_depth)
    split = out["split"]
    if fuse_depth is not None:
        split = Split(split.ratios, fixed_groups(graph, fuse_depth), split.head)
        out["explanation"] += (f"; fused by a fixed depth of "
                               f"{fuse_depth or spatial_ops(graph)} ops (--fuse-depth)")
    pred = out["predicted"] = predict(graph, split, costs, h, w, n)
    return Plan(strategy="bands", world_size=costs.size, ratios={"rows": list(split.ratios)},
                groups=[list(g) for g in split.groups] if split.groups else None,
                group_ratios=[list(r) for r in split.per_group] if split.per_group else None,
                head=split.head, model=config.name, model_shape=config.shape, batch=n,
                counts={"rows": counts(graph.shapes(h, w)[graph.ops[0].output][0],
                                       split.ratios)},
                predicted_latency_s=pred["latency_s"],
                predicted={**pred, "input": [h, w], "objective": objective,
                           "planner": strategy if ratios is None else "given"},
                solve_s=out["solve_s"], explanation=out["explanation"]).validate()


def split_of(plan) -> Split:
    """The Split a "bands" plan describes."""
    return Split(tuple(plan.ratios["rows"]),
                 tuple(tuple(g) for g in plan.groups) if plan.groups else None,
                 plan.head or "cols",
                 tuple(tuple(r) for r in plan.group_ratios) if plan.group_ratios else None,
                 tuple(plan.group_dims) if plan.group_dims else None,
                 tuple(plan.group_streamed) if plan.group_streamed else None)
