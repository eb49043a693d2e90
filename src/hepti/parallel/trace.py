"""Per-rank timing: seconds and bytes by kind, and a Chrome/Perfetto trace-event timeline.

Every rank measures on its own `time.perf_counter`, relative to an epoch taken right after a
barrier, so all ranks share one clock to within the barrier's release skew (microseconds on one
box, about one network latency on a real cluster). `Tracer.span(name, cat)` times a block: its
seconds add to `seconds[cat]` and, when tracing is on, it becomes one "X" event.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager


class Tracer:
    def __init__(self, rank: int, record_events: bool = False):
        self.rank = rank
        self.record_events = record_events
        self.epoch = time.perf_counter()
        self.reset()

    def reset(self):
        self.seconds: dict[str, float] = defaultdict(float)  # by category (compute kinds, collectives)
        self.bytes_sent = 0
        self.bytes_recv = 0
        self.events: list[dict] = []

    def set_epoch(self):
        """Call right after a barrier on every rank."""
        self.epoch = time.perf_counter()

    @contextmanager
    def span(self, name: str, cat: str, **args):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            t1 = time.perf_counter()
            self.seconds[cat] += t1 - t0
            if self.record_events:
                ev = {"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": self.rank,
                      "ts": (t0 - self.epoch) * 1e6, "dur": (t1 - t0) * 1e6}
                if args:
                    ev["args"] = args
                self.events.append(ev)

    def add_bytes(self, sent: int, recv: int):
        self.bytes_sent += int(sent)
        self.bytes_recv += int(recv)


def chrome_trace(events_by_rank: list[list[dict]], meta: dict | None = None) -> dict:
    """One trace file: a track (thread) per rank, named 'rank i', in one process 'hepti'."""
    evs = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "hepti"}}]
    for r, events in enumerate(events_by_rank):
        evs.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r, "args": {"name": f"rank {r}"}})
        evs.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r, "args": {"sort_index": r}})
        evs.extend(events)
    return {"traceEvents": evs, "displayTimeUnit": "ms", "otherData": meta or {}}
