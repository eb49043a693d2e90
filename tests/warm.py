"""Fill Numba's on-disk cache on the second core while the unit tests run on the first.

On a cold cache (a fresh clone, CI, edited kernels) the suite compiles each kernel the first time
a test calls it, on the one core pytest uses, while the machine's second core mostly idles. bin/test
starts this script in the background (at low priority) before pytest: it compiles the kernels
through the runtime's own loaders (each family's `load_kernels`: the call types a forward uses,
for float32 and int8 weights, on one thread and on two), in about the order the suite first
needs them, so that a later test loads them from the cache (cache=True, per source file) instead
of compiling. It checks nothing and changes no result: a kernel it has not reached yet is compiled
by the test as before, and a failure here only costs the time it would have saved (its output
goes to bin/test's run folder, warm.log). A kernel signature a test is compiling is
loaded here once the test has saved it, not compiled a second time (hepti.kernels._cache
.share_compiles); one this process is compiling is compiled by a test that wants it too, as
before: the test does not wait for a process at nice 19.

Cache files written by two processes at once: Numba's IndexDataCacheFile.save reads the index,
takes the first free data-file number, then writes both, with no lock. Two processes saving
different signatures of one function at the same moment could take the same number, and the
index would then name the other signature's code. This process therefore numbers its data files
from WARM_NUMBERS up, a range no other process takes; the worst a race with a test can do is
drop one index entry, which that signature's next caller compiles again. (hepti.kernels._cache.share_compiles
now also has processes save one function's signatures one at a time; the numbering stays for
a process without it.)

`python tests/warm.py [STEP ...]` (default: every step, in order); `--list` prints the steps.
"""
from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/helpers.py

WARM_NUMBERS = 1000  # this process's data files: NAME.1001.nbc, ... (others take 1, 2, ...)


def own_numbers() -> bool:
    """Number this process's cache data files from WARM_NUMBERS + 1 (the docstring says why);
    False when this Numba has no such method to adjust, and then nothing is warmed."""
    from numba.core import caching
    cls = getattr(caching, "IndexDataCacheFile", None)
    plain = getattr(cls, "_data_name", None)
    if plain is None:
        return False
    cls._data_name = lambda self, number: plain(self, number + WARM_NUMBERS)
    return True


def _cnn(threads):
    from hepti.model import cnn
    cnn.load_kernels(threads)


def _bert(threads, int8=False):
    from hepti.model import bert
    bert.load_kernels(threads, int8=int8)


def _vit(threads, int8=False):
    from hepti.model import vit
    vit.load_kernels(threads, int8=int8)


def _models(tmp: Path):
    """Each family's real single-process forward on the fixtures the suite converts: weights read
    from their files (read-only arrays, so their packing has its own signatures), every path a
    model takes (a ResNet's bottleneck, a decoder's prefill and one-row decode, float32 and int8)."""
    import numpy as np

    from helpers import FIXTURES, ROOT, convert_once, convert_tiny_cnn
    from hepti.inputs import Batch
    from hepti.model.llama import LlamaModel
    from hepti.parallel.single import SingleCNN, SingleDevice
    from hepti.weights import WeightStore
    from hepti.weights.decoder import load_decoder
    from hepti.weights.gguf import convert_gguf

    rng = np.random.default_rng(0)
    for name in ("resnet50_tiny", "vgg16_tiny"):
        with WeightStore(convert_tiny_cnn(name, tmp / name)) as store:
            SingleCNN.from_store(store).forward(rng.standard_normal((1, 3, 40, 36)).astype(np.float32))
    bert = [convert_once(FIXTURES / "tiny-odd", tmp / "tiny-odd")]
    bert += [ROOT / "weights" / "minilm-l6"] if (ROOT / "weights" / "minilm-l6" / "index.json").exists() else []
    for d in bert:
        store = WeightStore(d)
        ids = np.ones((2, 7), np.int64)
        SingleDevice.from_store(store).run(Batch(ids, np.ones_like(ids), np.zeros_like(ids)))
    store = WeightStore(convert_once(FIXTURES / "vit-tiny-odd", tmp / "vit-tiny-odd"))
    cfg = store.config
    pixels = rng.standard_normal((1, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    SingleDevice.from_store(store).run(Batch(None, np.ones((1, cfg.seq_len), np.int64), None, pixels))
    for dtype in ("float32", "int8"):
        out = convert_gguf(FIXTURES / "llama-tiny-odd.gguf", tmp / f"llama-{dtype}", progress=False,
                           dtype=dtype)
        model = LlamaModel(*load_decoder(out))
        cache = model.new_cache(3)
        model.forward([0, 0], cache)
        model.forward([0], cache)


def _int8_dots():
    """The int8 one-row product at each integer-dot level this CPU has (tests/test_kernels_int8.py
    runs them all; a model only the best), the float32 one-row products, quantize_x16."""
    import numpy as np

    from hepti import kernels as K
    from hepti.kernels import config
    from hepti.kernels.int8 import quantize_x16

    rng = np.random.default_rng(2)
    r = lambda *shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    best = config.INT_DOT
    try:
        for level in range(config.host_int_dot() + 1):
            config.INT_DOT = level
            for trans in (True, False):
                w = K.pack_q(K.quantize(r(64, 64)), trans=trans)
                for threads in (1, 2):
                    x = r(1, 64)
                    K.gemm_any(x, w, bias=r(64), gelu=True, threads=threads)
                    K.gemm_any(x, w, residual=r(1, 64), out=np.empty_like(x), threads=threads)
    finally:
        config.INT_DOT = best
    for trans in (True, False):  # the float32 one-row product, on one thread and on two
        w = K.pack_b(r(64, 64), trans=trans)
        for threads in (1, 2):
            K.gemm(r(1, 64), w, bias=r(64), threads=threads)
    K.matmul(r(1, 64), r(64, 64))
    quantize_x16(r(64), 64)


# (name, call): in about the order the suite first needs them: the decoders', the ViT's and the
# integer-dot levels' early, a CNN's after them (conftest.py runs the modules that first use a
# CNN's kernels after all the others, several minutes in), the threads' last. Not the encoders'
# float32 set first: the suite's first tests compile it themselves at once, and the steps here
# that call it (int8, bert) then load it.
STEPS = [
    ("int8", lambda: _bert(1, int8=True)),
    ("models", None),  # _models, in a temporary folder
    ("vit", lambda: _vit(1)),
    ("int8-dots", _int8_dots),
    ("cnn", lambda: _cnn(1)),
    ("cnn-threads", lambda: _cnn(2)),
    ("bert-threads", lambda: _bert(2, int8=True)),
    ("bert", lambda: _bert(1)),
]


def main(argv: list[str]) -> int:
    names = [n for n, _ in STEPS]
    if argv == ["--list"]:
        print("\n".join(names))
        return 0
    unknown = [a for a in argv if a not in names]
    if unknown:
        print(f"warm.py: unknown step {', '.join(unknown)}; steps: {', '.join(names)}", file=sys.stderr)
        return 2
    if os.environ.get("NUMBA_DISABLE_JIT") == "1" or not own_numbers():
        print("warm.py: nothing to warm (JIT off, or this Numba's cache files are not numbered "
              "as expected)", file=sys.stderr)
        return 0
    t0 = time.perf_counter()
    import hepti.kernels  # (sets Numba's code-generation options first)
    hepti.kernels._cache.HOLD = False  # at nice 19: the suite never waits for this process
    print(f"warm.py: imports {time.perf_counter() - t0:.1f} s", flush=True)
    for name, call in STEPS:
        if argv and name not in argv:
            continue
        t = time.perf_counter()
        if call is None:
            with tempfile.TemporaryDirectory(prefix="hepti-warm-") as tmp:
                _models(Path(tmp))
        else:
            call()
        print(f"warm.py: {name} {time.perf_counter() - t:.1f} s", flush=True)
    print(f"warm.py: done in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
