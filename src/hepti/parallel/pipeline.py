"""`pipeline` (PipeEdge baseline): contiguous layer ranges per rank, activations passed along.

Stage s runs layers [start_s, stop_s) on all M rows and sends [M, C] (with the batch's key mask)
to the next stage; the last stage sends the hidden state back to the primary. A batch is never
split: in a run of several batches, while stage 2 works on batch k, stage 1 already works on
batch k+1, so throughput is set by the slowest stage, and one batch's latency is the sum of the
stages'. The primary posts the receive for a batch's output before it sends the batch, so the
ring of blocking sends can never deadlock; it keeps at most `window` batches in flight (one per
stage and one more), so its memory does not grow with the number of batches.
"""
from __future__ import annotations
from collections import deque

import numpy as np

from hepti.counts import counts, offsets


def layer_ranges(n_layers: int, ratios: list[float]) -> list[tuple[int, int]]:
    """Contiguous [start, stop) per rank from a ratio vector (largest remainder)."""
    c = counts(n_layers, ratios)
    return [(o, o + n) for o, n in zip(offsets(c), c)]


class PipelineExecutor:
    name = "pipeline"

    def __init__(self, world, stage, ranges):
        """stage: a hepti.parallel.interpreter.Interpreter of this rank's layers on a group of
        itself alone (None on a rank without layers); ranges: every rank's [start, stop)."""
        self.w, self.stage, self.ranges = world, stage, ranges
        self.stages = [r for r, (a, b) in enumerate(ranges) if b > a]  # ranks that hold layers

    def _run_layers(self, x, key_mask):
        B, T = key_mask.shape
        graph = self.stage.graph
        layers_read = graph.layer[0].inputs[0]  # and rewrite: what goes to the next stage
        out = graph.output if self.w.rank == self.stages[-1] else layers_read
        return self.stage.run({layers_read: x, "mask": key_mask}, None, B, T, out)

    def forward_many(self, inputs, n: int, on_output=None):
        """inputs: on the primary an iterable of (x0 [M, C], key_mask [B, T]); n batches in all.
        On the primary on_output(k, hidden [M, C]) is called for each batch, in order."""
        w, rank = self.w, self.w.rank
        stages = self.stages
        if rank == 0:
            self._feed(inputs, on_output or (lambda k, x: None))
            return
        if rank not in stages:
            return
        prev = self._prev(rank)
        nxt = self._next(rank)
        for _ in range(n):
            x, mask = w.recv_array(prev)
            x = self._run_layers(x, mask)
            if nxt is None:
                w.send_known(x, 0, tag=1, name="Send(output)")
            else:
                w.send_array(x, nxt, meta=mask)

    def _feed(self, inputs, on_output) -> None:
        """The primary: send batches in, take outputs back, at most `window` in flight."""
        w, last = self.w, self.stages[-1]
        window = len(self.stages) + 1
        pending = deque()  # (k, output buffer, its posted receive)

        def take_oldest():
            k, buf, handle = pending.popleft()
            w.complete_recv(handle, name="Recv(output)")
            on_output(k, buf)

        for k, (x0, mask) in enumerate(inputs):
            if last == 0:  # rank 0 is the only stage
                on_output(k, self._run_layers(x0, mask))
                continue
            if len(pending) == window:
                take_oldest()
            buf = np.empty(x0.shape, np.float32)
            pending.append((k, buf, w.post_recv(buf, last, tag=1)))
            x = self._run_layers(x0, mask) if 0 in self.stages else x0
            w.send_array(x, self._next(0), meta=mask)
        while pending:
            take_oldest()

    def _prev(self, rank):
        before = [s for s in self.stages if s < rank]
        return before[-1] if before else 0

    def _next(self, rank):
        after = [s for s in self.stages if s > rank]
        return after[0] if after else None
