"""Under mpiexec -n 2: an int8 folder (`hepti convert --dtype int8`) run distributed equals the
same folder run on one device, within float32 tolerance: the ranks' int8 row slices (whole
groups, uneven shares) multiply to the same sums as the whole matrices. How close int8 is to
float32 is tests/test_weights.py's test_int8_encoder_against_its_twin_and_float32."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from equivalence import FIXTURES, TOL, check_case  # noqa: E402
from mpi_helpers import COMM, all_ok, shared_dir  # noqa: E402

from hepti.weights import convert_checkpoint  # noqa: E402

# tensor with uneven shares (rows reversed against heads and FFN columns: make_plan), a rank
# holding no units, and the primary moved; rows and stream with uneven shares
CASES = [("tensor", [0.7, 0.3]), ("tensor", [0.5, 0.5]), ("tensor", [0.0, 1.0]),
         ("rows", [0.7, 0.3]), ("stream", [0.3, 0.7])]


@pytest.fixture(scope="module")
def tiny_int8_dir():
    out = shared_dir("tiny-odd-int8")
    if COMM.Get_rank() == 0:
        convert_checkpoint(FIXTURES / "tiny-odd", out, progress=False, dtype="int8")
    COMM.Barrier()
    return out


@pytest.mark.parametrize("strategy,vec", CASES, ids=[f"{s}-{v[0]}" for s, v in CASES])
def test_int8_equals_int8_single_device(strategy, vec, tiny_int8_dir):
    res = check_case(tiny_int8_dir, strategy, vec, COMM.Get_size())
    if COMM.Get_rank() != 0:
        ok, msg = res is None, f"{strategy} {vec}: a rank other than the primary returned outputs"
    elif res is None:
        ok, msg = False, f"{strategy} {vec}: the primary returned no outputs"
    else:
        ok = res[0] <= TOL and res[1] <= TOL
        msg = f"{strategy} {vec}: max |diff| hidden {res[0]:.2e}, pooled {res[1]:.2e}"
    all_ok(ok, msg)
