"""Where a rank's layer slices live: all resident in RAM, or streamed through a window.

`ResidentLayers` reads and packs every slice once. `StreamingLayers` keeps at most `window`
packed slices in RAM: a background thread reads (and packs) the next layers' slices from the
local HDF5 shards while the current one computes (the kernels release the GIL), and a semaphore
of `window` slots bounds what is resident. Both give `get(i)` / `done(i)` to the executors.
`SpareLayers` holds resident slices no plan uses, which the kernel may take back.
"""
from __future__ import annotations

import mmap
import os
import queue
import threading

import numpy as np

from hepti.parallel.slices import LayerSlice
from hepti.resources import lazy_free


def slice_packer(graph):
    """pack(i, tensors) -> the LayerSlice of layer i for the interpreter."""
    return lambda i, tensors: LayerSlice.pack(graph, i, tensors)


class ResidentLayers:
    def __init__(self, store, n_layers: int, heads, ffn, pack, layers: range | None = None,
                 progress=None, ranges=None, on_layer=None):
        """`ranges`, if given, is each layer's own (heads, ffn) ranges instead (a GenEFlow
        plan whose layers split differently: hepti.plan.genetic). `on_layer(slice)` is called
        with each layer's slice as soon as it is read (`SpareLayers.add`)."""
        self.layers = {}
        for i in (layers if layers is not None else range(n_layers)):
            h, f = ranges[i] if ranges is not None else (heads, ffn)
            self.layers[i] = pack(i, store.read_layer_slice(i, h, f))
            if on_layer is not None:
                on_layer(self.layers[i])
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
        """Let the slices go: what still refers to this object (a closed job, a caller's
        name for it) then no longer holds their memory (hepti.serve.worker's switch reads the
        next plan's slices once the current ones are gone)."""
        self.layers = {}


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


class SpareLayers:
    """Resident slices kept beside a plan (the plan before, an idle rank's standby copy of the
    whole model, or the next plan's until the switch), for a switch that then reads nothing,
    which the kernel may take back before it kills anything for memory.

    Why: tests/test_serve_memory.py's squeeze failed in CI at 97d3bd5, and 1 run in 8 on a
    loaded box. A re-plan for speed moved node-b's share a few seconds before another program
    took 250 of its 267 MiB free. The previous share was kept beside the new one, and the OOM
    killer took the rank. The rank reads its memory every 2 s and lets a kept copy go after a
    batch; the program took the memory in a fraction of a second, sharing the device's CPU
    quota with the rank. No reading between batches can be fast enough. The kernel is: the
    packed arrays' pages are handed to it as lazily free (`lazy_free`, MADV_FREE). It reclaims
    them like page cache when memory runs short, and until then they stay as they are.

    A page it took reads back as zeros. So each page's last word is set to a sentinel first,
    with its value kept aside. `take` writes every page's first word before it looks at the
    sentinels: the write keeps a page still there, or maps a zero page in place of one taken,
    whose sentinel then reads 0. So a page taken at any moment is seen, and the slices are used
    only whole. Where the kernel refuses the advice, they are plain memory (`lazy` False), kept
    while there is room (hepti.serve.worker `_trim`)."""

    SENTINEL = np.uint64(0x5EED_CAFE_F00D_BEEF)

    def __init__(self, layers: ResidentLayers | None = None):
        """`layers` whole, or (None) none yet: then each slice is handed over by `add` as it is
        read, and `layers` set once all are."""
        self.layers, self.nbytes = layers, 0
        self._pages = []  # (words [n_pages, page // 8] of one buffer, first words, last words)
        self._seen: set = set()
        self._refused = False
        for one in (layers.layers.values() if layers is not None else ()):
            self.add(one)

    def add(self, one) -> None:
        """Hand one more slice's packed buffers to the kernel. The next plan's slices go one
        by one as they are read (hepti.serve.worker): a squeeze *during* the read then finds
        all but the slice in hand lazily free, where handing them over once all were read
        left every one of them plain memory until the last."""
        self.nbytes += one.nbytes
        page = os.sysconf("SC_PAGE_SIZE")
        for buf in _packed_buffers([one], self._seen):
            if self._refused:
                return
            addr = buf.ctypes.data
            lo, hi = -(-addr // page) * page, (addr + buf.nbytes) // page * page
            if hi <= lo:
                continue
            words = buf.reshape(-1).view(np.uint8)[lo - addr:hi - addr].view(np.uint64)
            words = words.reshape(-1, page // 8)
            first, last = words[:, 0].copy(), words[:, -1].copy()
            words[:, -1] = self.SENTINEL
            if not lazy_free(lo, hi - lo):
                words[:, -1] = last
                self._refused = True  # refused once (no MADV_FREE here): refused for every buffer
                return
            self._pages.append((words, first, last))

    @property
    def lazy(self) -> bool:
        """Whether the kernel may take them (the advice was taken, and not yet taken back)."""
        return bool(self._pages)

    @property
    def lazy_bytes(self) -> int:
        """What MemAvailable and the cgroup count as free though it is still held."""
        return sum(w.nbytes for w, _, _ in self._pages)

    def lost(self) -> bool:
        """Whether the kernel took any page (it reads only: a page taken stays taken)."""
        return any((w[:, -1] != self.SENTINEL).any() for w, _, _ in self._pages)

    def take(self) -> bool:
        """Make the slices plain memory again, to serve with (`layers`): True if every page
        was still there, else False (then they are of no use: close them).

        It looks before it writes: a read of a page the kernel took maps the shared zero page,
        a write maps a fresh page. Writing first made a copy the kernel had emptied in a
        squeeze whole again in memory (zeros), at the moment memory was short, beside the plan
        in force, before it was found missing and let go. Only a page taken between the look
        and the write is mapped again."""
        if self.lost():
            return False
        for words, first, _ in self._pages:
            words[:, 0] = first  # a write: the page stays, or a zero page takes its place
        if self.lost():
            return False
        for words, _, last in self._pages:
            words[:, -1] = last
        self._pages = []
        return True

    def close(self) -> None:
        self._pages = []
        if self.layers is not None:
            self.layers.close()


def _in_mapping(a: np.ndarray) -> bool:
    """Whether a is a view of a `K.huge_empty` mapping (a layer's weights in huge pages,
    parallel/slices.py): then a itself is the buffer, not the whole mapping."""
    root = a.base.base if isinstance(a.base, np.ndarray) else None
    return isinstance(getattr(root, "obj", root), mmap.mmap)  # np.frombuffer's memoryview


def _packed_buffers(slices, seen: set) -> list[np.ndarray]:
    """The buffers of the packed weights in `slices` (the float32 and int8 panels and their
    scales, which packing made and nothing else refers to), each once: `seen` holds the
    addresses of those met before. Biases and norms are left out: small, and possibly the
    store's own arrays."""
    out = []
    for s in slices:
        for entry in s.params.values():
            for w in entry if isinstance(entry, tuple) else ():
                for name in ("panels", "q", "scales"):
                    a = getattr(w, name, None)
                    while isinstance(a, np.ndarray) and isinstance(a.base, np.ndarray) \
                            and not _in_mapping(a):
                        a = a.base
                    if isinstance(a, np.ndarray) and (a.flags.owndata or _in_mapping(a)) \
                            and a.flags.writeable and a.flags.c_contiguous \
                            and a.ctypes.data not in seen:
                        seen.add(a.ctypes.data)
                        out.append(a)
    return out
