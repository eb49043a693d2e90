"""Under mpiexec -n 2: every strategy and baseline equals the single-device engine."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402
from equivalence import TOL, cases, check_case, primary_of  # noqa: E402

CASES = list(cases(COMM.Get_size()))


@pytest.mark.parametrize("model", ["tiny", "minilm", "vit"])
@pytest.mark.parametrize("strategy,rname,vec", CASES, ids=[f"{s}-{r}" for s, r, _ in CASES])
def test_equals_single_device(model, strategy, rname, vec, tiny_dir, minilm_dir, vit_dir):
    d = {"tiny": tiny_dir, "minilm": minilm_dir, "vit": vit_dir}[model]
    res = check_case(d, strategy, vec, COMM.Get_size(), primary=primary_of(rname, COMM.Get_size()))
    if COMM.Get_rank() != 0:  # only rank 0 (whatever the primary) hands back outputs
        ok, msg = res is None, f"{strategy} {rname}: a rank other than the primary returned outputs"
    elif res is None:  # an empty result is a failure, not a pass
        ok, msg = False, f"{strategy} {rname}: the primary returned no outputs"
    else:
        ok = res[0] <= TOL and res[1] <= TOL
        msg = f"{strategy} {rname}: max |diff| hidden {res[0]:.2e}, pooled {res[1]:.2e}"
    all_ok(ok, msg)
