"""Under mpiexec -n 2: a rank holds and reads only what its share needs, and `stream` keeps
its resident weights within the budget."""
from __future__ import annotations

import numpy as np
import pytest

from hepti.config import BertConfig
from hepti.inputs import Batch
from hepti.model.sizes import layer_bytes, layer_slice_bytes
from hepti.parallel.engine import run_plan
from hepti.plan.planfile import DIMS, Plan
from hepti.weights import write_random
from mpi_helpers import COMM, all_ok

RANK = COMM.Get_rank()


def batch(cfg, T=64):
    rng = np.random.default_rng(0)
    ids = rng.integers(1, cfg.vocab_size, (1, T))
    return [Batch(ids, np.ones((1, T), np.int64), np.zeros((1, T), np.int64))]


@pytest.fixture(scope="module")
def deep_dir(tmp_path_factory):
    """16 layers of hidden 512: big enough that holding every layer shows in RSS."""
    cfg = BertConfig.from_dict(dict(model_type="bert", vocab_size=1000, hidden_size=512,
                                    num_hidden_layers=16, num_attention_heads=8,
                                    intermediate_size=2048, max_position_embeddings=128),
                               name="deep-test")
    import tempfile
    from pathlib import Path
    base = COMM.bcast(tempfile.mkdtemp(prefix="hepti-mem-") if RANK == 0 else None)
    out = Path(base) / "deep"
    if RANK == 0:
        write_random(cfg, out, seed=1, progress=False)
    COMM.Barrier()
    return out, cfg


def test_tensor_rank_holds_and_reads_its_share(minilm_dir):
    from hepti.weights import WeightStore
    cfg = WeightStore(minilm_dir).config
    plan = Plan(strategy="tensor", world_size=2, ratios={d: [0.75, 0.25] for d in DIMS})
    _, job = run_plan(minilm_dir, plan, batch(cfg))
    st = job.rank_stats([])
    model_layers = cfg.num_hidden_layers * layer_bytes(cfg)
    want = 0.25 * model_layers
    if RANK == 1:
        ok = (abs(st["layer_weight_bytes_resident"] - want) <= 0.1 * want
              and st["weight_bytes_read"] <= 1.1 * want)
        msg = (f"resident {st['layer_weight_bytes_resident']} read {st['weight_bytes_read']} "
               f"want ~{want:.0f}")
    else:
        ok, msg = True, ""
    all_ok(ok, msg)


STREAM_OVERHEAD = 48 * 2**20  # activations, one layer slice in flight (read + packed), HDF5 caches


def test_stream_peak_rss_within_budget(deep_dir):
    """Peak RSS growth during the run stays within budget + a constant; `tensor` (all layers
    resident) would not, which is what makes this test able to fail."""
    d, cfg = deep_dir
    per_layer = layer_slice_bytes(cfg, 4, 1024)  # even split: 4 heads, 1024 FFN columns
    budget = 2 * per_layer
    plan = Plan(strategy="stream", world_size=2, ratios={d_: [0.5, 0.5] for d_ in DIMS},
                mem_budget=budget)
    _, job = run_plan(d, plan, batch(cfg) * 3)
    st = job.rank_stats([])
    grew = st["peak_rss_bytes"] - st["rss_before_load_bytes"]
    all_layers = cfg.num_hidden_layers * per_layer
    ok = (st["layer_weight_bytes_resident"] <= budget and grew <= budget + STREAM_OVERHEAD
          and all_layers > budget + STREAM_OVERHEAD)
    all_ok(ok, f"rank {RANK}: peak resident layers {st['layer_weight_bytes_resident']}, RSS grew "
               f"{grew / 2**20:.1f} MiB; budget {budget / 2**20:.1f} MiB + {STREAM_OVERHEAD / 2**20:.0f} MiB")
