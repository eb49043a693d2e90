"""What `hepti profile` measures of a rank's compute for a CNN: each op over the whole map,
bands of it as the band executor runs them, the layout copy of a split by channels and the
cost of streaming a conv's weights, and how these are pooled across devices into the profile's
`cnn` table (hepti.plan.coedge plans from it).

No communication: a band is timed on rank 0 of a two-rank split whose messages are not sent
(`_Unsent`), so every rank measures alone, at once with the others (hepti.parallel.profiling
puts the results together). The pooling functions (`pooled_band`, `pooled_overhead`,
`stream_fit`, `band_spread`) are pure arithmetic on what the ranks measured.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from hepti.counts import counts
from hepti.emulate import stretch as _stretch
from hepti.graph.cnn import CONV, inverted_runs
from hepti.graph.split import Split, spatial_ops
from hepti.model.cnn import Weights, apply
from hepti.parallel.bands import BandExecutor, lay_out_channels
from hepti.parallel.trace import Tracer


def measure_cnn_ops(model, h: int, w: int, batch: int = 1, rounds: int = 5) -> list[float]:
    """Seconds of each op of a CNN (hepti.model.cnn.CNNModel) over the whole h x w map, batch
    `batch`: the median of `rounds` forwards after a warm-up, each op timed alone (stretched as
    one unit of work on an emulated device, as the runtime's compute spans are)."""
    g = model.graph
    g.shapes(h, w)
    run = _stretch.wrap(apply) if _stretch.ON else apply
    x0 = np.random.default_rng(4).standard_normal((batch, h, w, 3), dtype=np.float32)
    times = [[] for _ in g.ops]
    last = g.last_use()
    for r in range(rounds + 1):
        env = {g.input: x0}
        for i, op in enumerate(g.ops):
            res = env[op.residual] if op.residual is not None else None
            t0 = time.perf_counter()
            env[op.output] = run(op, env[op.input], model.weights, res, threads=model.threads)
            if r:
                times[i].append(time.perf_counter() - t0)
            for t in (op.input, op.residual):
                if t is not None and last.get(t) == i:
                    del env[t]
    return [statistics.median(t) for t in times]


def measure_layout_rate(rounds: int = 9) -> float:
    """Seconds per byte of laying a map split by channels out whole (hepti.parallel.bands
    `lay_out_channels`, what every member of a split by channels does after each op's
    allgather), as the device pays them (stretched on an emulated one): ResNet-50's 14x14x1024
    map from two halves, 0.8 MB."""
    shape, per = (1, 14, 14, 1024), [512, 512]
    flat = np.random.default_rng(6).standard_normal(14 * 14 * 1024, dtype=np.float32)
    run = _stretch.wrap(lay_out_channels) if _stretch.ON else lay_out_channels
    run(flat, per, shape)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        run(flat, per, shape)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / flat.nbytes


class _Unsent:
    """Rank 0 of two whose messages are not sent (`measure_band_costs`): the exchange
    runs its span and zeroes what it would receive, and the verbs after the spatial part hand
    back what one rank has. Every other line of a forward is the band executor's own."""

    size, rank = 2, 0

    def __init__(self):
        self.tracer = Tracer(0)

    def bcast_obj(self, obj):
        return obj

    def exchange(self, sends: dict, recvs: dict) -> None:
        with self.tracer.span("Halo", "halo"):
            for buf in recvs.values():
                buf.fill(0.0)

    def allgather_rows(self, a, counts):
        out = np.zeros((sum(counts),) + a.shape[1:], np.float32)
        out[:a.shape[0]] = a
        return out


BAND_FRACTIONS = (0.15, 0.5)  # the bands `measure_band_costs` times: a slow device's, a half
# The band rounds go on past their minimum count until this many seconds have passed (and so
# do the stream pairs). Seven rounds of MobileNetV2's bands take under a second, and this
# host's speed moves in spells of seconds (a matmul probe's median, 3.8 or 6 ms by turns): the
# same plan was predicted 47.2, 30.6 and 30.5 ms from three profiles of its devices taken
# minutes apart (2026-11-27). ResNet-50's seven rounds already take longer than this.
BAND_MIN_S = 4.0
BAND_MAX_ROUNDS = 61


def measure_band_costs(model, h: int, w: int, batch: int = 1, rounds: int = 7,
                       fractions: tuple = BAND_FRACTIONS, read=None,
                       min_s: float = BAND_MIN_S) -> tuple:
    """(points, spread, stream, joined). Points: per op, [(k, seconds)] for a band of k output
    rows at each fraction of the rows, as the band executor runs it at h x w: rank 0 of a
    two-rank split with the messages left out (`_Unsent`), one group per op, each band made
    from the one before as a forward makes it, stretched on an emulated device as the runtime
    is; the fractions interleaved round by round (at least `rounds`, and on for `min_s`), the median
    of the rounds. An op's time is from the end of the op before to its own end: the
    executor's bookkeeping around it, the exchange's copies and the stretch's payment for both
    are in it; None for the ops after the spatial part. `pooled_band` makes each device's
    a + b x k of them. Spread: `band_spread` of the rounds at the larger band. Stream (with
    `read`, the weight store's): per conv, the seconds its weights add when streamed
    (`Weights.fetch` and `drop` around it, as a streamed group runs it): after the bands'
    rounds (a streamed forward's reads and allocations would be in the next forward's times),
    the largest band with every conv streamed, alternating with the resident one, for as
    long, the median of each pair's difference; None for other ops (`stream_fit` fits them).
    Joined (a network with inverted-residual blocks, else None): (ranges, [(fraction, [seconds
    per range], [op by op, per range])]): the same bands and the whole map (fraction 1) in
    `joined_ranges`' groups, where the executor runs each run of blocks as one call
    (`BandExecutor._chains`), each group from the end of the one before to its own, in the
    same rotation, and each range's ops together in the op-by-op forward:
    hepti.plan.coedge `joined_points` prices each range's blocks by their ratio. The whole
    map, as one device runs it: on emu-mixed4 (2026-11-30) a factor from the bands alone
    priced `single` 22% under what it ran. Ranges: what joining saves differs along the net
    (there, 0.40-0.49 of the op-by-op time on the first range, 0.66-0.77 on the last). The
    ratio of two forwards' parts, not of a forward to the sum of its ops' medians: on a
    loaded host (load 6 on 2 cores, 2026-11-30) a 15-25 ms forward was preempted in every
    round and its median ran 2.3-2.9x its ops' medians summed, where quiet it ran 0.64-0.66x.

    Why not the whole-map timings and a one-row band, joined by a line (profiler revision 8):
    on emu-geneflow4 (four devices sharing two cores, 2026-11-27) MobileNetV2's bands ran
    1.34, 1.51, 1.67 and 1.84 times that line at 15% of the rows and 1.10-1.38 at 40% (the
    four devices, fastest first), and natively 1.1-1.3 times (a map made long before, or on
    another core, is read from further away than the whole-map forward's just-made one);
    GenEFlow's plans that give the slow devices small bands ran 30-60% over their prediction."""
    g = model.graph
    shapes = g.shapes(h, w)
    n = spatial_ops(g)
    x = np.random.default_rng(5).standard_normal((batch, 3, h, w), dtype=np.float32)
    runs, joined_s, whole_s = [], {}, {}
    for f in fractions:
        unsent = _Unsent()
        unsent.tracer.record_events = True
        ex = BandExecutor(unsent, g, Split((f, 1.0 - f), head="primary"), model.weights,
                          model.threads, band_runs=False)  # one compute span an op
        run = _stretch.wrap(ex.forward) if _stretch.ON else ex.forward
        run(x)
        runs.append((f, unsent.tracer, run, [[] for _ in range(n)]))
    joins = []  # the same bands in a few groups: the runs of blocks as the executor joins them
    ranges = joined_ranges(g, n)
    for f in (fractions + (1.0,)) if ranges else ():
        for groups in ([ranges] if f < 1.0 else [ranges, None]):  # the whole map: both
            unsent = _Unsent()
            unsent.tracer.record_events = True
            ex = BandExecutor(unsent, g, Split((f, 1.0 - f), groups, head="primary"),
                              model.weights, model.threads, band_runs=False)
            run = _stretch.wrap(ex.forward) if _stretch.ON else ex.forward
            run(x)
            joins.append((f, unsent.tracer, run, None if groups else [[] for _ in range(n)]))
    for f, tracer, run, spans in _band_rotation(runs + joins, rounds, min_s):
        if spans is None:
            _joined_round(tracer, run, x, joined_s.setdefault(f, []))
        else:
            _band_round(tracer, run, x, spans, n,
                        whole_s.setdefault(f, []) if ranges else None, ranges)
    stream = None
    if read is not None:  # the largest band again, every conv's weights streamed
        unsent = _Unsent()
        unsent.tracer.record_events = True
        streamed = Weights(g, read, streamed={op.name for op in g.ops if op.kind == CONV})
        ex = BandExecutor(unsent, g, Split((fractions[-1], 1.0 - fractions[-1]),
                                           head="primary"), streamed, model.threads)
        run = _stretch.wrap(ex.forward) if _stretch.ON else ex.forward
        run(x)
        pair = [(unsent.tracer, run, [[] for _ in range(n)]),
                (runs[-1][1], runs[-1][2], [[] for _ in range(n)])]
        # after the bands' rounds: its reads stay out of their times
        for tracer, run, spans in _band_rotation(pair, rounds, min_s):
            _band_round(tracer, run, x, spans, n)
        (_, _, s_spans), (_, _, r_spans) = pair
        stream = [statistics.median(a - b for a, b in zip(s_spans[l], r_spans[l]))
                  if l < n and g.ops[l].kind == CONV else None for l in range(len(g.ops))]
    out = []
    for l, op in enumerate(g.ops):
        pts = []
        for f, _, _, spans in runs if l < n else ():
            k = counts(shapes[op.output][0], (f, 1.0 - f))[0]
            if k and spans[l]:
                pts.append((k, statistics.median(spans[l])))
        out.append(sorted(pts) or None)
    med = lambda xs: [statistics.median(t) for t in zip(*xs)]  # noqa: E731 (per range)
    joined = [(f, med(joined_s[f]), med(whole_s[f])) for f in fractions + (1.0,)
              if joined_s.get(f)]
    return out, band_spread(runs[-1][3]), stream, (ranges, joined) if joined else None


JOINED_RANGES = 4  # the spatial ops' ranges `measure_band_costs` times joined, each alone


def joined_ranges(graph, n: int, k: int = JOINED_RANGES) -> tuple | None:
    """The first n ops in k ranges ([start, stop)) with about as many inverted-residual blocks
    each, cut where a block starts (hepti.graph.cnn `inverted_runs`); None with no blocks."""
    starts = [j for j, _ in inverted_runs(graph.ops[:n])]
    if not starts:
        return None
    cuts = sorted({starts[round(q * len(starts) / k)] for q in range(1, k)} - {0})
    bounds = [0] + cuts + [n]
    return tuple(zip(bounds, bounds[1:]))


def stream_fit(stream: list, graph) -> tuple[float, float]:
    """(seconds a fetch, stored bytes/s) of a device's streamed convs: fixed + bytes / rate
    through `measure_band_costs`' per-conv stream seconds and each conv's stored bytes, by
    least squares on the relative error (the planner prices each conv by its own timing and
    takes from this only how a slice of it scales: `stream_seconds`); through the origin when
    the fixed part comes out negative. Relative, not absolute: ResNet-50's largest convs
    (2-9 MB) load slower per byte than its small ones, and a plain fit's fixed part came out
    -1.8 to 0 ms where its smallest convs took 1.2-4.7 ms. Why in the executor's forward,
    with every rank measuring at once: timed alone (each conv's `fetch` and `drop` in a loop,
    page cache warm, profiler revisions 7-9) MobileNetV2's load rate on emu-geneflow4's four
    devices ranged 327-525, 147-427, 77-221 and 42-192 MB/s over five profiles, and in the
    forward 394-583, 282-368, 140-223 and 66-156 (2026-11-27); GenEFlow's 2-device plan at a
    50% cap, 19 of its 48 groups streamed, ran 27% over its prediction on the lone timing,
    its streamed groups at 1.3-2.7 times their modelled compute, and -7% to +7% on this."""
    row = graph.row_bytes()
    pts = [(row[op.name] * op.cout, t) for op, t in zip(graph.ops, stream or ())
           if op.kind == CONV and t is not None]
    if not pts:
        return 0.0, 1e12  # nothing streamed: no cost
    b = np.array([p[0] for p in pts], float)
    t = np.maximum(np.array([p[1] for p in pts], float), 0.0)
    rel = 1.0 / np.maximum(t, 1e-5)
    if len(pts) >= 2 and np.ptp(b) > 0:
        (fixed, per_byte), *_ = np.linalg.lstsq(np.vstack([rel, b * rel]).T, t * rel,
                                                rcond=None)
        if per_byte > 0 and fixed >= 0:
            return float(fixed), float(1.0 / per_byte)
        per_byte = float(np.median(t / b))  # a line through the origin, then
        if per_byte > 0:
            return 0.0, 1.0 / per_byte
    return 0.0, float(b.sum() / max(t.sum(), 1e-12))


def _band_rotation(items: list, rounds: int, min_s: float):
    """`items` round by round, each round starting one further along (a burst of load from
    elsewhere falls on all of them alike): at least `rounds` rounds, and more until `min_s`
    seconds have passed, `BAND_MAX_ROUNDS` at most."""
    start, r = time.perf_counter(), 0
    while r < rounds or (time.perf_counter() - start < min_s and r < BAND_MAX_ROUNDS):
        k = r % len(items)
        yield from items[k:] + items[:k]
        r += 1


def _band_round(tracer, run, x, spans: list[list[float]], n: int,
                whole: list[float] | None = None, ranges=()) -> None:
    """One forward of a `measure_band_costs` executor: each of the first n ops' seconds, from
    the end of the op before to its own end, appended to its list (and to `whole`, each of
    `ranges`' ops' together, as a list)."""
    tracer.reset()
    tracer.set_epoch()
    run(x)
    ends = [e["ts"] + e["dur"] for e in tracer.events if e["cat"] == "compute"]
    for l, (t0, t1) in enumerate(zip([0.0] + ends, ends[:n])):
        spans[l].append((t1 - t0) * 1e-6)
    if whole is not None:
        whole.append([(ends[b - 1] - (ends[a - 1] if a else 0.0)) * 1e-6 for a, b in ranges])


def _joined_round(tracer, run, x, times: list) -> None:
    """One forward of a `measure_band_costs` executor in a few groups: each group's seconds,
    from the end of the one before (the forward's start) to its compute span's end (the
    exchange before it included, as an op's band time includes the exchange before it), a
    list appended to `times`."""
    tracer.reset()
    tracer.set_epoch()
    run(x)
    ends = [e["ts"] + e["dur"] for e in tracer.events if e["cat"] == "compute"]
    times.append([(t1 - t0) * 1e-6 for t0, t1 in zip([0.0] + ends, ends)])


def band_spread(spans: list[list[float]]) -> tuple[float, float]:
    """(relative, seconds): a device's spread of one op's time from round to round, the median
    over ops of 1.4826 x the median absolute deviation (a normal's sigma), over the op's median
    and in seconds. The cost model's `straggle` takes the relative one: a group ends when the
    slowest of its ranks ends, and the slowest of k ranks whose times scatter ends later than
    the slowest mean. (The seconds, charged alike to every group, predicted ResNet-50's
    capped 4-device plans 9% and 21% above what they measured; the relative spread 2% and 1%.)"""
    rel, ab = [], []
    for ts in spans:
        if len(ts) >= 3:
            m = statistics.median(ts)
            if m > 0:
                ab.append(1.4826 * statistics.median(abs(t - m) for t in ts))
                rel.append(ab[-1] / m)
    return (statistics.median(rel), statistics.median(ab)) if rel else (0.0, 0.0)


def pooled_band(points: list[list]) -> list[list]:
    """Each device's (a, b) per op (seconds of a band of k rows = a + b x k) from its
    `measure_band_costs` points: its own time at the largest band, split into a and b by the
    devices' median share of it that is fixed (the line through a device's own two points
    alone moved with every burst of load: MobileNetV2's fixed parts summed to 28-50 ms on
    emu-geneflow4's 0.15-core device in profiles minutes apart). None where not timed."""
    out = [[None] * len(p) for p in points]
    for l in range(len(points[0]) if points else 0):
        shares, tops = [], []
        for per in points:
            pts = per[l]
            if not pts:
                tops.append(None)
                continue
            (k1, t1), (k2, t2) = pts[0], pts[-1]
            tops.append((k2, t2))
            if k2 > k1 and t2 > 0:
                b = max(0.0, (t2 - t1) / (k2 - k1))
                shares.append(min(max(t1 - b * k1, 0.0), t2) / t2)
        share = statistics.median(shares) if shares else 0.0
        for i, top in enumerate(tops):
            if top is not None:
                k2, t2 = top
                out[i][l] = (share * t2, (1.0 - share) * t2 / k2)
    return out


def pooled_overhead(op_s: list[list[float]], measured: list[float]) -> list[float]:
    """Each device's per-op overhead as the devices' least (measured overhead / the device's
    summed op seconds), times its own summed op seconds: the same code pays its bookkeeping
    in proportion to how fast the device runs it, and load from elsewhere only ever adds time,
    so the least inflated reading is the closest to the device's own cost (as the least of
    repeated timings is). Why: on emu-geneflow4 node-d's own figure for ResNet-50 read 1.2 to
    2.3 ms in eight profiles over 2.5 hours, node-c's 0.85 to 1.6 ms, and GenEFlow's capped
    plans, which load the slow devices, were predicted 16-20% slow. A traced run of one such
    plan showed 0.30, 0.46, 0.73 and 1.28 ms on the four devices (each rank's compute less its
    ops' predicted arithmetic); pooled by the least, the 02:12 profile gives 0.31, 0.50, 0.78
    and 1.03 ms; pooled by the median, 0.37, 0.59, 0.93 and 1.24 (the grid at 5cda293, with
    the median, then predicted ResNet-50's plans 10-29% slow). On real devices whose
    bookkeeping and arithmetic scale apart (a board whose GeMM is slower than its Python),
    the pooled figure is as wrong as that gap."""
    totals = [sum(t) for t in op_s]
    norm = [o / t for o, t in zip(measured, totals) if t > 0 and o > 0]
    if len(norm) < 2:
        return [float(o) for o in measured]
    k = min(norm)
    return [k * t for t in totals]
