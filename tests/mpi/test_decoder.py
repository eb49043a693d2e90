"""Under mpiexec -n 2: the decoder in `tensor` (KV heads, MLP columns, vocabulary rows by
uneven ratios, zeros included) and in `pipeline` (whole layers per rank, a rank of none
included: "layers=...") against transformers' fixtures and against one rank alone
(tests/mpi/decoder_check.py holds the checks; test_decoder_launch.py runs them at 3 ranks)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoder_check import check_fixture, check_sampling  # noqa: E402
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.parallel.comm import Comm  # noqa: E402
from hepti.parallel.trace import Tracer  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "weights" / "smollm2"
pytestmark = pytest.mark.skipif(COMM.Get_size() != 2, reason="written for mpiexec -n 2")


def _verdict(rows):
    if COMM.Get_rank() == 0:
        all_ok(bool(rows) and all(r["ok"] for r in rows),
               "\n".join(str(r) for r in rows if not r["ok"]) or "no rows")
    else:
        all_ok(not rows, "a rank other than 0 returned rows")


@pytest.mark.parametrize("ratios", ["0.7,0.3", "0,1", "layers=0,5", "layers=4,1"])
def test_tiny_equals_transformers(traced_comm, llama_tiny_dir, ratios):
    _verdict(check_fixture(llama_tiny_dir, "llama_tiny_expected.npz", ratios, traced_comm))


@pytest.mark.parametrize("ratios", ["0.3,0.7", "layers=2,3"])
def test_tiny_sampling_equals_one_rank(traced_comm, llama_tiny_dir, ratios):
    _verdict(check_sampling(llama_tiny_dir, "llama_tiny_expected.npz", ratios, traced_comm))


@pytest.mark.skipif(not (SMOLLM2 / "index.json").is_file(), reason="weights/smollm2 is absent")
# pipeline's rank 0 of no layers on SmolLM2 (0,30) is left to the tiny decoder (0,5: the same
# code, 18 s less a run); test_decoder_launch.py runs SmolLM2 at 3 ranks with a rank skipped
@pytest.mark.parametrize("ratios", ["0.7,0.3", "heads=0,1;ffn=0.6,0.4;rows=0.5,0.5",
                                    "layers=20,10"])
def test_smollm2_equals_transformers(traced_comm, ratios):
    _verdict(check_fixture(SMOLLM2, "smollm2_expected.npz", ratios, traced_comm))


@pytest.mark.skipif(not (SMOLLM2 / "index.json").is_file(), reason="weights/smollm2 is absent")
def test_smollm2_sampling_equals_one_rank(traced_comm):
    _verdict(check_sampling(SMOLLM2, "smollm2_expected.npz", "0.7,0.3", traced_comm, prompts=(1,)))


def test_the_syncs_are_the_docstrings(llama_tiny_dir):
    """hepti.parallel.decoder's docstring, counted: a prefill syncs 1 + 2L times by a
    reduce-scatter and an allgather of rows, a decode step 1 + 2L times by one allreduce of
    [1, C]; each greedy choice is one allgather of 2 floats a rank; nothing else moves."""
    from decoder_check import group
    from hepti.parallel.decoder import Sampling
    c = Comm(COMM, Tracer(COMM.Get_rank(), record_messages=True))
    try:
        dec = group(llama_tiny_dir, "0.6,0.4", c)
        cfg = dec.config
        c.tracer.reset()
        dec.generate([5, 17, 250, 3], 2, Sampling())  # a prefill of 4 rows, one decode step
        kinds = [k for k, _, _ in c.tracer.messages]
        syncs = 1 + 2 * cfg.num_hidden_layers
        want = (["reduce_scatter", "allgatherv"] * syncs + ["allgather"]
                + ["allreduce"] * syncs + ["allgather"])
        row = 4 * cfg.hidden_size  # bytes of one row of the residual stream
        decode = [(s, r) for k, s, r in c.tracer.messages if k == "allreduce"]
        ok = kinds == want and set(decode) == {(row, row)}
        all_ok(ok, f"{kinds[:6]}... ({len(kinds)} verbs, {len(want)} expected); {set(decode)}")
    finally:
        c.close()
