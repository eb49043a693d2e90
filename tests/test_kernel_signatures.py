"""The big kernels compile once per type, not once per constant a caller passes them.

Numba types a constant argument of a call from jitted code (a 0 offset, ldc NR, accumulate
False, a True inside an epilogue tuple or a 1 inside a geometry) as a literal, and compiles the
callee once per literal value: the register-tile kernels take 3-30 s each to compile, and such
copies were 94 s of the 278 s of CPU a cold test_cnn.py + test_bench_hetero.py spent compiling.
Their callers pass np.int64 / np.bool_ instead. After a forward of each CNN path (ResNet's
bottleneck, VGG's pooled chain, MobileNetV2's inverted blocks) and of a BERT in this process,
none of these kernels holds two signatures that are one type once their literals are plain."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys

import numpy as np
from numba.core import types

from helpers import ROOT

# (module under hepti.kernels, function): the kernels that take seconds to compile
HEAVY = ([("_microkernels", f) for f in ("full_tiles", "direct_tiles", "direct_tiles_epi",
                                          "_tile1", "_tile2", "_tile4", "micro_tile",
                                          "epilogue_strip")]
         + [("conv", f) for f in ("_conv_rows", "_depthwise", "_tiles_fused", "_rows_fused",
                                  "_padded_fused", "_rows_block")]
         + [("packed_gemm", f) for f in ("_panel_range", "_on_the_fly", "_strip", "_ir_tiles",
                                         "_finish")]
         + [("attention_core", f) for f in ("_items", "_attend")])


def literal_copies(dispatcher) -> list[list[str]]:
    """Groups of a dispatcher's signatures that differ only in literal types."""
    groups = collections.defaultdict(list)
    for sig in dispatcher.signatures:
        groups[tuple(types.unliteral(t) for t in sig)].append(str(sig))
    return [g for g in groups.values() if len(g) > 1]


def test_literal_copies_are_found():
    from numba import njit

    @njit
    def callee(a, b):
        return a + b

    @njit
    def caller(x):
        return callee(x, 0) + callee(x, 1) + callee(x, np.int64(2))

    assert caller(np.int64(1)) == 6
    assert len(literal_copies(callee)) == 1  # Literal[int](0), Literal[int](1), int64: one group


CHECK = """
import importlib, json, sys
import numpy as np
from hepti.inputs import Batch
from hepti.parallel.single import SingleCNN, SingleDevice
from hepti.weights import WeightStore
from test_kernel_signatures import HEAVY, literal_copies
*cnns, bert = sys.argv[1:]
rng = np.random.default_rng(0)
for d in cnns:
    with WeightStore(d) as store:
        model = SingleCNN.from_store(store)
    for shape in ((1, 3, 40, 36), (2, 3, 100, 132)):  # warm.py's, test_cnn's batch
        model.forward(rng.standard_normal(shape).astype(np.float32))
ids = np.ones((2, 7), np.int64)
SingleDevice.from_store(WeightStore(bert)).run(Batch(ids, np.ones_like(ids), np.zeros_like(ids)))
found = {}
for mod, name in HEAVY:
    fn = getattr(importlib.import_module("hepti.kernels." + mod), name)
    if literal_copies(fn):
        found[mod + "." + name] = literal_copies(fn)
print(json.dumps(found))
"""


def test_heavy_kernels_have_one_signature_per_type(resnet_tiny_dir, vgg_tiny_dir, mobilenet_dir,
                                                    tiny_dir):
    """In a process of its own: what this suite's other tests compiled (their own jitted
    callers, their orders) is not this check's."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT / "src"), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", CHECK, str(resnet_tiny_dir), str(vgg_tiny_dir),
                        str(mobilenet_dir), str(tiny_dir)], env=env, capture_output=True,
                       text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    found = json.loads(p.stdout.strip().splitlines()[-1])
    assert not found, f"a caller passes a literal constant (np.int64 / np.bool_ it): {found}"
