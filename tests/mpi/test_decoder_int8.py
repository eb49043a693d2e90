"""Under mpiexec -n 2: an int8 decoder folder (`hepti convert --dtype int8`) in `tensor` at skewed
ratios (a zero share included) against the same folder on one rank alone: the same int8 weights,
so the prefill's logits agree to float32 rounding and the greedy tokens are equal (the int8
model's distance from transformers' float32 is tests/test_llama.py's)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decoder_check import check_against_one_rank  # noqa: E402
from mpi_helpers import COMM, all_ok, shared_dir  # noqa: E402

from hepti.parallel.comm import Comm  # noqa: E402
from hepti.parallel.trace import Tracer  # noqa: E402
from hepti.weights.gguf import convert_gguf  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(COMM.Get_size() != 2, reason="written for mpiexec -n 2")


@pytest.fixture(scope="module")
def comm():
    c = Comm(COMM, Tracer(COMM.Get_rank()))
    yield c
    c.close()


@pytest.fixture(scope="module")
def llama_tiny_int8_dir():
    out = shared_dir("llama-tiny-odd-int8")
    if COMM.Get_rank() == 0 and not (out / "index.json").exists():
        convert_gguf(ROOT / "tests/fixtures/llama-tiny-odd.gguf", out, progress=False,
                     dtype="int8")
    COMM.Barrier()
    return out


@pytest.mark.parametrize("ratios", ["0.7,0.3", "heads=0,1;ffn=0.35,0.65;rows=0.6,0.4"])
def test_tiny_int8_equals_one_rank(comm, llama_tiny_int8_dir, ratios):
    rows = check_against_one_rank(llama_tiny_int8_dir, "llama_tiny_expected.npz", ratios, comm)
    if COMM.Get_rank() == 0:
        all_ok(bool(rows) and all(r["ok"] for r in rows),
               "\n".join(str(r) for r in rows if not r["ok"]) or "no rows")
    else:
        all_ok(not rows, "a rank other than 0 returned rows")
