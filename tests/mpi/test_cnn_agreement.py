"""Under mpiexec -n 2: the band executor's verb calls equal its band program's collectives
(tests/mpi/cnn_agreement.py; 3 ranks: tests/test_distributed_launch.py runs it standalone)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402
from cnn_agreement import cases, check_case  # noqa: E402


@pytest.mark.parametrize("model", ["resnet-tiny", "vgg-tiny", "mobilenet"])
def test_band_messages_equal_the_program(model, resnet_tiny_dir, vgg_tiny_dir, mobilenet_dir):
    d = {"resnet-tiny": resnet_tiny_dir, "vgg-tiny": vgg_tiny_dir, "mobilenet": mobilenet_dir}[model]
    bad = []
    for name, split in cases(d, COMM.Get_size()):
        ok, msg = check_case(d, split, COMM)
        oks = COMM.allgather((ok, msg))
        bad += [f"{name}: rank {r}: {m}" for r, (o, m) in enumerate(oks) if not o]
    all_ok(not bad, "; ".join(bad))
