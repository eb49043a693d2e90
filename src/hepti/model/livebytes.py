"""An allocation counter: the activation bytes an executor holds, live and at their high-water.

The memory model of operator order (hepti.order.memory) says what an order should need at its
peak; this measures what an executor actually holds, from the arrays themselves, so that the
two can be compared (`python -m hepti.bench.order_exec`). An executor notifies the counter as
it stores an activation under a name (`made`) and as it lets one go (`dropped`); the counter
keeps the live bytes and their largest value (`peak`), with the operator it was reached at.

What counts is memory, not names: an array's bytes are its *buffer's*, the ndarray at the end
of its `.base` chain, counted once however many held names view it (the interpreter's Q and
K/V are column views of one QKV output, which stays allocated until the last view goes), less
an aligned allocation's slack (`held_bytes`). An
array over memory numpy did not allocate (an MPI shared window) counts its own bytes.
Storing a name again counts the new array before the old one is let go: for that moment both
are held, as they are in the executor (a collective's result replacing its input, a band
widened by its halo).

`TrackedDict` is a dict of activations that notifies a counter itself, so an executor's
bookkeeping stays as it was. Nothing here imports the kernels or MPI: the counter is one
rank's, and a report gathers them.
"""
from __future__ import annotations

import numpy as np


def buffer_of(a: np.ndarray) -> np.ndarray:
    """The ndarray that owns `a`'s memory (`a` itself when it owns it): the last ndarray
    along its `.base` chain; `a` itself when that one wraps memory numpy did not allocate
    (a collective's result in an MPI shared window: its own bytes are what it holds of the
    window, whose slots are the transport's)."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    return a if root.base is not None else root


# hepti.kernels._views.aligned_empty starts an array on a 64-byte line inside a buffer up to
# this many bytes longer: that slack is the allocator's, as malloc's header is, not the
# activation's, and is not counted (the CNN executor's feature maps are made so)
ALIGN_SLACK = 64


def held_bytes(a: np.ndarray, buf: np.ndarray) -> int:
    """The bytes `a` holds of its buffer `buf` (`buffer_of`): the buffer's, except where `a` is
    the whole of a 1-D buffer but an alignment's slack at its ends (`ALIGN_SLACK`)."""
    if buf is not a and buf.ndim == 1 and 0 < buf.nbytes - a.nbytes <= ALIGN_SLACK:
        return a.nbytes
    return buf.nbytes


class AllocationCounter:
    """Live activation bytes of one executor on one rank, and their high-water mark.

    `live`: bytes held now; `peak`: the most held at once since the counter was made (or
    `reset`); `peak_at`: the label (an operator's name) that was running when it was reached;
    `steps`: with `record=True`, (label, live) after each `made`, for the tests."""

    def __init__(self, record: bool = False):
        self.record = record
        self.reset()

    def reset(self) -> None:
        self.live = 0
        self.peak = 0
        self.peak_at: str | None = None
        self.steps: list[tuple[str, int]] = []
        self._name_buf: dict[str, int] = {}  # name -> id of the buffer it views
        self._bufs: dict[int, list] = {}  # buffer id -> [bytes, names viewing it, the buffer]

    def made(self, name: str, a, label: str | None = None) -> None:
        """`name` now holds array `a` (what it held before is let go after `a` is counted)."""
        if not isinstance(a, np.ndarray):
            return
        buf = buffer_of(a)
        key = id(buf)
        entry = self._bufs.get(key)
        if entry is None:
            # the buffer is kept referenced while counted, so its id cannot be reused meanwhile
            held = held_bytes(a, buf)
            self._bufs[key] = [held, 1, buf]
            self.live += held
        else:
            entry[1] += 1
        old = self._name_buf.get(name)
        self._name_buf[name] = key
        if self.live > self.peak:
            self.peak, self.peak_at = self.live, label or name
        if self.record:
            self.steps.append((label or name, self.live))
        if old is not None:
            self._release(old)

    def dropped(self, name: str) -> None:
        """`name` no longer holds anything (nothing happens if it held nothing counted)."""
        key = self._name_buf.pop(name, None)
        if key is not None:
            self._release(key)

    def _release(self, key: int) -> None:
        entry = self._bufs[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._bufs[key]

    def held(self) -> list[str]:
        """The names held now."""
        return list(self._name_buf)

    def to_dict(self) -> dict:
        return {"live_bytes": self.live, "peak_bytes": self.peak, "peak_at": self.peak_at}


class TrackedDict(dict):
    """A dict of activations that tells `counter` what it stores and lets go. `label` (a
    callable, or None) names the operator running, for `peak_at`; `array_of` finds the array
    in a stored value that is not one (the band executor's `Band`)."""

    def __init__(self, counter: AllocationCounter, items=(), label=None, array_of=None):
        super().__init__()
        self.counter, self.label, self.array_of = counter, label, array_of
        for k, v in dict(items).items():
            self[k] = v

    def __setitem__(self, name, a):
        super().__setitem__(name, a)
        self.counter.made(name, a if self.array_of is None else self.array_of(a),
                          self.label() if self.label else None)

    def __delitem__(self, name):
        super().__delitem__(name)
        self.counter.dropped(name)

    def pop(self, name, *default):
        had = name in self
        out = super().pop(name, *default)
        if had:
            self.counter.dropped(name)
        return out


def track(env: dict, counter: AllocationCounter | None, label=None, array_of=None) -> dict:
    """`env` as a TrackedDict of `counter`, or `env` itself when there is no counter."""
    return env if counter is None else TrackedDict(counter, env, label, array_of)
