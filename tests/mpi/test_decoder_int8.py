"""Under mpiexec -n 2: an int8 decoder folder (`hepti convert --dtype int8`) in `tensor` at skewed
ratios (a zero share included), and in `pipeline` (layers=3,2), against the same folder on one
rank alone: the same int8 weights, so the prefill's logits agree to float32 rounding and the
greedy tokens are equal (the int8 model's distance from transformers' float32 is
tests/test_llama.py's)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoder_check import check_against_one_rank  # noqa: E402
from mpi_helpers import COMM, all_ok  # noqa: E402


pytestmark = pytest.mark.skipif(COMM.Get_size() != 2, reason="written for mpiexec -n 2")


@pytest.mark.parametrize("ratios", ["0.7,0.3", "heads=0,1;ffn=0.35,0.65;rows=0.6,0.4",
                                    "layers=3,2"])
@pytest.mark.parametrize("folder", ["llama_tiny_int8_dir", "llama_tiny_mixed_dir"])
def test_tiny_int8_equals_one_rank(traced_comm, request, folder, ratios):
    """All int8, and int8 with two matrices kept float32 (`--keep-float32`: float32 and int8
    packed weights side by side, split alike)."""
    rows = check_against_one_rank(request.getfixturevalue(folder), "llama_tiny_expected.npz",
                                  ratios, traced_comm)
    if COMM.Get_rank() == 0:
        all_ok(bool(rows) and all(r["ok"] for r in rows),
               "\n".join(str(r) for r in rows if not r["ok"]) or "no rows")
    else:
        all_ok(not rows, "a rank other than 0 returned rows")
