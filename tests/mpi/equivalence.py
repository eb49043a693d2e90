"""Distributed == single-device, for every strategy and baseline and several ratio vectors.

Used two ways:
- by tests/mpi/test_equivalence.py under `mpiexec -n 2 ... pytest` (its `output_diffs` and
  `output_verdict` on agreement.py's traced run of each case, which checks the messages too);
- standalone for other world sizes (tests/test_distributed_launch.py launches it):
  mpiexec -n N python -m mpi4py tests/mpi/equivalence.py --model DIR [--model DIR ...]
  prints one JSON line per case on rank 0 and exits 1 if any case is off.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import numpy as np

from hepti.inputs import Batch
from hepti.parallel.single import SingleDevice
from hepti.model.pooling import pool
from hepti.model.sizes import layer_slice_bytes
from hepti.counts import counts
from hepti.parallel.engine import run_plan
from hepti.parallel.world import world_comm
from hepti.parallel.pipeline import layer_ranges
from hepti.plan.planfile import DIMS, Plan
from hepti.weights import WeightStore

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
STRATEGIES = ("rows", "tensor", "stream", "even", "pipeline", "single", "mixed-attn-rows",
              "mixed-ffn-rows", "mixed-per-layer")
# GenEFlow's mixed plans (hepti.plan.genetic): one block by token rows, the other by its unit;
# or each layer its own (these four, in turn)
MIXED = {"mixed-attn-rows": ("rows", "unit"), "mixed-ffn-rows": ("unit", "rows"),
         "mixed-per-layer": ("unit", "rows", "rows", "unit", "rows", "rows", "unit", "unit")}
RATIOS = {
    1: {"even": [1.0]},
    2: {"even": [0.5, 0.5], "skewed": [0.7, 0.3], "zero": [0.0, 1.0]},
    3: {"even": [1 / 3] * 3, "skewed": [0.7, 0.2, 0.1], "zero": [0.5, 0.0, 0.5]},
    4: {"even": [0.25] * 4, "skewed": [0.4, 0.3, 0.2, 0.1], "zero": [0.5, 0.0, 0.5, 0.0]},
}
TOL = 1e-4


def inputs_for(model_dir: Path):
    """The fixture inputs that match the model (texts: padded batches of different lengths;
    images: the ViT fixture's pixels)."""
    cfg = WeightStore(model_dir).config
    if cfg.model_type == "vit":
        px = np.load(FIXTURES / "vit_expected.npz")["pixels"]
        return [Batch(None, np.ones((len(px), cfg.seq_len), np.int64), None, px)]
    name = "tiny_odd_expected.npz" if cfg.hidden_size == 96 else "minilm_expected.npz"
    z = np.load(FIXTURES / name)
    return [Batch(z["ids"], z["mask"], z["token_type"])]


def make_plan(strategy: str, vec: list[float], cfg, world: int, primary: int = 0) -> Plan:
    if strategy == "single":
        vec = [1.0] + [0.0] * (world - 1)
    if strategy == "even":
        vec = [1.0 / world] * world
    if strategy == "tensor" and len(vec) > 1 and vec[0] != vec[1]:
        # a different vector per dimension too: rows reversed
        ratios = {"heads": vec, "ffn": vec, "rows": vec[::-1]}
    else:
        ratios = {d: list(vec) for d in DIMS}
    if strategy in MIXED:  # every dimension its own shares: rows reversed against the units
        from hepti.families import family_graph
        from hepti.plan.genetic import block_assignment, blocks_of
        graph = family_graph(cfg, 1, 1)
        ratios = {"heads": list(vec), "ffn": list(vec), "rows": list(vec[::-1])}
        genes = MIXED[strategy]
        if len(genes) > len(blocks_of(graph)):  # per layer: the pattern over the model's layers
            genes = tuple(genes[i % len(genes)] for i in range(2 * cfg.num_hidden_layers))
        plan = Plan(strategy="mixed", world_size=world, ratios=ratios, primary=primary,
                    assignment=block_assignment(graph, blocks_of(graph), genes))
        return plan
    plan = Plan(strategy=strategy, world_size=world, ratios=ratios, primary=primary)
    if strategy == "pipeline":
        plan.layers = [list(r) for r in layer_ranges(cfg.num_hidden_layers, vec)]
    if strategy == "stream":  # a budget of two layers of the largest slice
        h = counts(cfg.num_attention_heads, vec)
        f = counts(cfg.intermediate_size, vec)
        plan.mem_budget = 2 * max(layer_slice_bytes(cfg, a, b) for a, b in zip(h, f))
    return plan


def cases(world: int):
    """(strategy, ratios' name, vector) to run. "moved": the last rank is the primary and rank 0
    (which still reads the inputs and takes the outputs) has no share."""
    for strategy in STRATEGIES:
        for rname, vec in RATIOS[world].items():
            if strategy in ("single", "even") and rname != "even":
                continue  # these ignore the ratio vector
            yield strategy, rname, vec
        if world > 1 and strategy in ("rows", "tensor", "stream", *MIXED):
            yield strategy, "moved", [0.0] + [1.0 / (world - 1)] * (world - 1)


def primary_of(rname: str, world: int) -> int:
    return world - 1 if rname == "moved" else 0


def check_case(model_dir, strategy, vec, world, reference=None, primary: int = 0):
    """Run one case on every rank; on rank 0 return (max |diff| hidden at real tokens, pooled)."""
    cfg = WeightStore(model_dir).config
    batches = inputs_for(model_dir)
    outs, _ = run_plan(model_dir, make_plan(strategy, vec, cfg, world, primary), batches)
    return output_diffs(model_dir, outs, reference)


def output_diffs(model_dir, outs, reference=None):
    """(max |diff| hidden at real tokens, pooled) of a run's outputs on the fixture batch
    against the single-device engine's (`reference`, else made once: `fixture_reference`);
    None where the run handed back no outputs (every rank but rank 0)."""
    if not outs:
        return None
    b = inputs_for(model_dir)[0]
    ref = reference if reference is not None else fixture_reference(str(model_dir))
    m = b.mask.astype(bool)
    dh = float(np.abs(outs[0][m] - ref[m]).max())
    dp = float(np.abs(pool(outs[0], b.mask, "mean", True) - pool(ref, b.mask, "mean", True)).max())
    return dh, dp


def output_verdict(res, rank: int) -> tuple[bool, str]:
    """A case's `output_diffs` judged on one rank: rank 0 (whatever the primary) must have
    outputs within TOL, and no other rank any."""
    if rank != 0:
        return (True, "none, as expected") if res is None else \
            (False, "a rank other than rank 0 returned outputs")
    if res is None:  # an empty result is a failure, not a pass
        return False, "rank 0 returned no outputs"
    return res[0] <= TOL and res[1] <= TOL, f"max |diff| hidden {res[0]:.2e}, pooled {res[1]:.2e}"


def single_reference(model_dir, b: Batch) -> np.ndarray:
    return SingleDevice.from_store(WeightStore(model_dir)).run(b)


@functools.lru_cache(maxsize=None)
def fixture_reference(model_dir: str) -> np.ndarray:
    """The single-device output for the model's fixture batch, made once per model and process:
    test_equivalence.py checks 29 cases per model against it, and each had run the
    single-device engine again for the same batch. Read-only, so no case can alter another's."""
    ref = single_reference(model_dir, inputs_for(Path(model_dir))[0])
    ref.setflags(write=False)
    return ref


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True)
    args = ap.parse_args(argv)
    world = world_comm()
    n = world.size
    bad = 0
    for d in args.model:
        ref = fixture_reference(d) if world.rank == 0 else None
        for strategy, rname, vec in cases(n):
            res = check_case(d, strategy, vec, n, ref, primary_of(rname, n))
            if world.rank == 0:
                ok, _ = output_verdict(res, 0)  # no outputs: a failure
                res = res or (float("inf"), float("inf"))
                bad += not ok
                print(json.dumps({"model": Path(d).name, "world": n, "strategy": strategy,
                                  "ratios": rname, "max_diff_hidden": res[0],
                                  "max_diff_pooled": res[1], "ok": ok}), flush=True)
    bad = world.mpi.bcast(bad)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
