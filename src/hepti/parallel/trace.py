"""Per-rank timing: seconds and bytes by kind, and a Chrome/Perfetto trace-event timeline.

Every rank measures on its own `time.perf_counter`, relative to an epoch taken right after a
barrier, so all ranks share one clock to within the barrier's release skew (microseconds on one
box, about one network latency on a real cluster). `Tracer.span(name, cat)` times a block: its
seconds add to `seconds[cat]` and, when tracing is on, it becomes one "X" event, with the
thread's CPU seconds in it (`args.cpu_us`: a block whose wall time is far above its CPU time
waited or, on an emulated device, paid the stretch).

Under `hepti emulate` (unless HEPTI_EMULATE_STRETCH=0) the spans are also where an emulated
device is slowed down uniformly (hepti.emulate.stretch): a "compute" span ends by paying the
device's backlog, and any other span but "batch" (a collective, a wait for weights) pays it
before it starts; what is paid there counts as compute. Outside the emulator that is one test
of a module flag per span.
"""
from __future__ import annotations

import time
from collections import defaultdict

from hepti.emulate import stretch as _stretch


class Tracer:
    def __init__(self, rank: int, record_events: bool = False, record_messages: bool = False):
        self.rank = rank
        self.record_events = record_events
        # with record_messages: (verb kind, bytes sent, bytes received) of every verb call, in
        # order (tests/mpi/agreement.py compares them with the planner's program)
        self.messages: list[tuple[str, int, int]] | None = [] if record_messages else None
        self.epoch = time.perf_counter()
        self.reset()

    def reset(self):
        self.seconds: dict[str, float] = defaultdict(float)  # by category (compute kinds, collectives)
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.events: list[dict] = []
        if self.messages is not None:
            self.messages = []

    def set_epoch(self):
        """Call right after a barrier on every rank."""
        self.epoch = time.perf_counter()

    def span(self, name: str, cat: str, **args) -> "_Span":
        """`with tracer.span(...)`: time the block (see the module docstring)."""
        return _Span(self, name, cat, args)

    def add_bytes(self, kind: str, sent: int, recv: int):
        """What one verb call moved: `kind` is the collective ("allgatherv", ...) or "send"/"recv"."""
        self.bytes_sent += int(sent)
        self.bytes_recv += int(recv)
        if self.messages is not None:
            self.messages.append((kind, int(sent), int(recv)))


class _Span:
    """One timed block. A plain class, not a generator context manager: 0.56 against 1.05 us
    a span, measured hot, and a forward opens some fifty."""

    __slots__ = ("tracer", "name", "cat", "args", "t0", "c0")

    def __init__(self, tracer: Tracer, name: str, cat: str, args: dict):
        self.tracer, self.name, self.cat, self.args = tracer, name, cat, args

    def __enter__(self):
        if _stretch.ON:
            paid = _stretch.span_enter(self.cat)
            if paid:
                self.tracer.seconds["compute"] += paid
        self.t0 = time.perf_counter()
        if self.tracer.record_events:
            self.c0 = time.thread_time()
        return self

    def __exit__(self, *exc) -> bool:
        tr = self.tracer
        record = tr.record_events and hasattr(self, "c0")
        if record:  # the block's own CPU, before the stretch pays for it
            cpu = time.thread_time() - self.c0
        if _stretch.ON:
            _stretch.span_exit(self.cat)
        t1 = time.perf_counter()
        tr.seconds[self.cat] += t1 - self.t0
        if record:
            ev = {"name": self.name, "cat": self.cat, "ph": "X", "pid": 0, "tid": tr.rank,
                  "ts": (self.t0 - tr.epoch) * 1e6, "dur": (t1 - self.t0) * 1e6}
            ev["args"] = {**self.args, "cpu_us": cpu * 1e6}
            tr.events.append(ev)
        return False


def chrome_trace(events_by_rank: list[list[dict]], meta: dict | None = None) -> dict:
    """One trace file: a track (thread) per rank, named 'rank i', in one process 'hepti'."""
    evs = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hepti"}}]
    for r, events in enumerate(events_by_rank):
        evs.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        evs.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        evs.extend(events)
    return {"traceEvents": evs, "displayTimeUnit": "ms", "otherData": meta or {}}
