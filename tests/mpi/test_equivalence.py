"""Under mpiexec -n 2: every strategy and baseline equals the single-device engine, and every
strategy's verb calls equal its cost program's collectives. One run per case holds both: the
two checks were two tests (test_agreement.py beside this one), each running every case."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402
from agreement import check_case  # noqa: E402
from equivalence import cases, output_diffs, output_verdict, primary_of  # noqa: E402

CASES = list(cases(COMM.Get_size()))


@pytest.mark.parametrize("model", ["tiny", "minilm", "vit"])
@pytest.mark.parametrize("strategy,rname,vec", CASES, ids=[f"{s}-{r}" for s, r, _ in CASES])
def test_equals_single_device_and_messages_equal_the_program(model, strategy, rname, vec, tiny_dir,
                                                             minilm_dir, vit_dir):
    d = {"tiny": tiny_dir, "minilm": minilm_dir, "vit": vit_dir}[model]
    ok, msg, outs = check_case(d, strategy, vec, COMM, primary_of(rname, COMM.Get_size()))
    all_ok(ok, f"{strategy} {rname} messages: {msg}")
    ok, msg = output_verdict(output_diffs(d, outs), COMM.Get_rank())
    all_ok(ok, f"{strategy} {rname} outputs: {msg}")
