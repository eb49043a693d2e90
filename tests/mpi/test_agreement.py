"""Under mpiexec -n 2: every strategy's verb calls equal its cost program's collectives."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402
from agreement import cases, check_case  # noqa: E402
from equivalence import primary_of  # noqa: E402

CASES = list(cases(COMM.Get_size()))


@pytest.mark.parametrize("model", ["tiny", "minilm", "vit"])
@pytest.mark.parametrize("strategy,rname,vec", CASES, ids=[f"{s}-{r}" for s, r, _ in CASES])
def test_messages_equal_the_program(model, strategy, rname, vec, tiny_dir, minilm_dir, vit_dir):
    d = {"tiny": tiny_dir, "minilm": minilm_dir, "vit": vit_dir}[model]
    ok, msg = check_case(d, strategy, vec, COMM, primary_of(rname, COMM.Get_size()))
    all_ok(ok, f"{strategy} {rname}: {msg}")
