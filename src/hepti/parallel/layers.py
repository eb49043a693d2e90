"""Where a rank's layer slices live: all resident in RAM, or streamed through a window.

`ResidentLayers` reads and packs every slice once. `StreamingLayers` keeps at most `window`
packed slices in RAM: a background thread reads (and packs) the next layers' slices from the
local HDF5 shards while the current one computes (the kernels release the GIL), and a semaphore
of `window` slots bounds what is resident. Both give `get(i)` / `done(i)` to the executors.
"""
from __future__ import annotations

import queue
import threading

from hepti.parallel.slices import LayerSlice


def slice_packer(graph):
    """pack(i, tensors) -> the LayerSlice of layer i for the interpreter."""
    return lambda i, tensors: LayerSlice.pack(graph, i, tensors)


class ResidentLayers:
    def __init__(self, store, n_layers: int, heads, ffn, pack, layers: range | None = None,
                 progress=None, ranges=None):
        """`ranges`, if given, is each layer's own (heads, ffn) ranges instead (a GenEFlow
        plan whose layers split differently: hepti.plan.genetic)."""
        self.layers = {}
        for i in (layers if layers is not None else range(n_layers)):
            h, f = ranges[i] if ranges is not None else (heads, ffn)
            self.layers[i] = pack(i, store.read_layer_slice(i, h, f))
            if progress is not None:
                progress.update(1)
        self.peak_bytes = self.resident_bytes

    @property
    def resident_bytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())

    def get(self, i: int):
        return self.layers[i]

    def done(self, i: int) -> None:
        pass

    def close(self) -> None:
        pass


class StreamingLayers:
    """Layer slices 0..L-1, over and over (one pass per forward), at most `window` in RAM."""

    def __init__(self, store, n_layers: int, heads, ffn, pack, window: int):
        if window < 1:
            raise ValueError("window must be >= 1")
        self.store, self.n_layers, self.heads, self.ffn, self.window = store, n_layers, heads, ffn, window
        self.pack = pack
        self.slots = threading.Semaphore(window)
        self.ready: queue.Queue = queue.Queue()
        self.stop = threading.Event()
        self.resident = 0
        self.peak_bytes = 0
        self.lock = threading.Lock()
        self.current: dict = {}
        self.thread = threading.Thread(target=self._prefetch, name="hepti-prefetch", daemon=True)
        self.thread.start()

    def _prefetch(self):
        i = 0
        try:
            while not self.stop.is_set():
                while not self.slots.acquire(timeout=0.1):
                    if self.stop.is_set():
                        return
                s = self.pack(i, self.store.read_layer_slice(i, self.heads, self.ffn))
                with self.lock:
                    self.resident += s.nbytes
                    self.peak_bytes = max(self.peak_bytes, self.resident)
                self.ready.put(s)
                i = (i + 1) % self.n_layers
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            self.ready.put(e)

    @property
    def resident_bytes(self) -> int:
        return self.resident

    def get(self, i: int):
        s = self.ready.get()
        if isinstance(s, BaseException):
            raise RuntimeError(f"reading layer {i}'s weights failed: {s}") from s
        assert s.index == i, (s.index, i)
        self.current[i] = s
        return s

    def done(self, i: int) -> None:
        s = self.current.pop(i)
        with self.lock:
            self.resident -= s.nbytes
        del s
        self.slots.release()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=5)
