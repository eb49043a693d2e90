"""Under mpiexec -n N: each row verb of hepti.parallel.comm against the same arithmetic in numpy,
with uneven counts, ranks of zero rows, strided inputs and a tail of more than one axis."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.counts import offsets  # noqa: E402
from hepti.parallel.comm import Comm  # noqa: E402

N, RANK = COMM.Get_size(), COMM.Get_rank()


def layouts():
    """Row counts per rank: even, uneven, a zero first, a zero last, all rows on one rank."""
    yield [3] * N
    yield [2 * j + 1 for j in range(N)]
    yield [0] + [4] * (N - 1)
    yield [4] * (N - 1) + [0]
    yield [0] * (N - 1) + [5]


def data(total: int, tail: tuple, salt: int) -> np.ndarray:
    """The same array on every rank: rank j's copy differs by j * 1000 when salt is its rank."""
    return (np.arange(total * int(np.prod(tail)), dtype=np.float32).reshape(total, *tail)
            + 1000 * salt)


@pytest.mark.parametrize("rc", list(layouts()), ids=str)
@pytest.mark.parametrize("tail", [(6,), (2, 3)], ids=str)
def test_row_verbs_match_numpy(rc, tail):
    g, o, m = Comm(COMM), offsets(rc), sum(rc)
    mine = slice(o[RANK], o[RANK] + rc[RANK])
    full = data(m, tail, 0)
    errs = []

    got = g.scatter_rows(full if RANK == 0 else None, rc, tail)
    if not np.array_equal(got, full[mine]):
        errs.append("scatter_rows")
    got = g.gather_rows(full[mine], rc)
    if RANK == 0 and not np.array_equal(got, full):
        errs.append("gather_rows")
    if RANK != 0 and got is not None:
        errs.append("gather_rows returned rows off the root")
    wide = np.concatenate([full, full], axis=-1)  # a strided view of its first half is the input
    got = g.allgather_rows(wide[mine][..., :tail[-1]], rc)
    if not np.array_equal(got, full):
        errs.append("allgather_rows")
    partial = data(m, tail, RANK)  # rank j holds full + 1000 j
    want = (full * N + 1000 * sum(range(N)))[mine]
    got = g.reduce_scatter_rows(partial, rc)
    if got.shape != want.shape or not np.array_equal(got, want):
        errs.append("reduce_scatter_rows")
    all_ok(not errs, f"counts {rc}, tail {tail}: wrong {errs}")


def test_bytes_counted_once_per_message():
    """Each rank's sent bytes are what its peers received: the tracer counts what moved."""
    g = Comm(COMM)
    rc = [2 * j + 1 for j in range(N)]
    m = sum(rc)
    g.allgather_rows(np.ones((rc[RANK], 4), np.float32), rc)
    g.reduce_scatter_rows(np.ones((m, 4), np.float32), rc)
    sent = COMM.allreduce(g.tracer.bytes_sent)
    recv = COMM.allreduce(g.tracer.bytes_recv)
    all_ok(sent == recv and sent == 2 * 4 * 4 * m * (N - 1), f"sent {sent} received {recv}")
