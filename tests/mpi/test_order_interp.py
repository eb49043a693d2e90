"""Under mpiexec -n 2: each rank's allocation counter on the transformer interpreter against
the schedule's activation model (hepti.graph.lower.activation_memory, tensors only) at that
rank's counts, for `rows` and `tensor` on tiny BERT and ViT."""
from __future__ import annotations

import pytest

from mpi_helpers import COMM, all_ok
from order_helpers import encoder_batch


@pytest.mark.parametrize("which", ["tiny_dir", "vit_dir"])
@pytest.mark.parametrize("strategy,ratios", [("tensor", (0.5, 0.5)), ("tensor", (0.7, 0.3)),
                                             ("rows", (0.6, 0.4))])
def test_counter_against_the_schedule_model(which, strategy, ratios, request):
    from hepti.counts import counts
    from hepti.graph import lower
    from hepti.families import family_graph
    from hepti.model.livebytes import AllocationCounter
    from hepti.parallel.comm import Comm
    from hepti.parallel.engine import Job
    from hepti.plan.costmodel import held_bytes
    from hepti.plan.planfile import DIMS, Plan
    from hepti.weights import WeightStore
    store = WeightStore(request.getfixturevalue(which))
    cfg = store.config
    b, T = encoder_batch(cfg, 11)
    world = Comm(COMM)
    job = Job(world, store, Plan(strategy=strategy, world_size=2,
                                 ratios={d: list(ratios) for d in DIMS}))
    ex = job.executor
    c = AllocationCounter()
    ex.forward(b if world.rank == 0 else None, 1, T, counter=c)
    g = family_graph(cfg, 1, T)
    steps = lower.schedule(g, lower.assignment(g, strategy), cfg.num_hidden_layers)
    terms = lower.activation_memory(g, steps, keep=(g.output,), scratch=False)
    cnt = {"rows": counts(T, ex.row_ratios)[world.rank],
           "heads": ex.units["heads"][world.rank], "ffn": ex.units["ffn"][world.rank]}
    modelled = held_bytes(terms, cnt, world.rank == 0, 1)["activations"]
    job.close()
    world.close()
    store.close()
    all_ok(c.peak == modelled, f"{which} {strategy} {ratios}: counter {c.peak} "
                               f"({c.peak_at}), model {modelled:.0f}")
