"""Under mpiexec -n N: each row verb of hepti.parallel.comm against the same arithmetic in numpy,
with uneven counts, ranks of zero rows, strided inputs and a tail of more than one axis, on both
transports (point-to-point messages; the shared window, when the ranks share a host)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.counts import offsets  # noqa: E402
from hepti.parallel.comm import RING, Comm, choose_transport  # noqa: E402

N, RANK = COMM.Get_size(), COMM.Get_rank()
ONE_HOST = N > 1 and choose_transport(COMM, "auto") == "shm"  # one rank: no transport at all
TRANSPORTS = ["p2p", pytest.param("shm", marks=pytest.mark.skipif(
    not ONE_HOST, reason="the ranks do not share a host (or HEPTI_COMM / MPIR_CVAR_NOLOCAL)"))]


@pytest.fixture(params=TRANSPORTS)
def group(request):
    g = Comm(COMM, transport=request.param)
    assert g.transport == (request.param if N > 1 else "solo")
    yield g
    g.close()


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
def test_row_verbs_match_numpy(group, rc, tail):
    g, o, m = group, offsets(rc), sum(rc)
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
    buf = g.partial_buffer(partial.shape)  # computed in place, as the forward's GeMMs do
    if buf is not None:
        buf[...] = partial
    got = g.reduce_scatter_rows(partial if buf is None else buf, rc)
    if got.shape != want.shape or not np.array_equal(got, want):
        errs.append("reduce_scatter_rows in partial_buffer")
    got = g.bcast_to_all(full if RANK == 0 else None, full.shape)
    if not np.array_equal(got, full):
        errs.append("bcast_to_all")
    all_ok(not errs, f"counts {rc}, tail {tail}: wrong {errs}")


def test_bytes_counted_once_per_message(group):
    """Each rank's sent bytes are what its peers received: the tracer counts what moved."""
    g = group
    rc = [2 * j + 1 for j in range(N)]
    m = sum(rc)
    g.allgather_rows(np.ones((rc[RANK], 4), np.float32), rc)
    g.reduce_scatter_rows(np.ones((m, 4), np.float32), rc)
    sent = COMM.allreduce(g.tracer.bytes_sent)
    recv = COMM.allreduce(g.tracer.bytes_recv)
    all_ok(sent == recv and sent == 2 * 4 * 4 * m * (N - 1), f"sent {sent} received {recv}")


def test_transports_sum_alike():
    """A Reduce_scatter's sums are bit for bit the same on both transports (rank order)."""
    rng = np.random.default_rng(RANK)
    rc = [5 + j for j in range(N)]
    partial = rng.standard_normal((sum(rc), 7)).astype(np.float32)
    got = {}
    for t in ("p2p", "shm") if ONE_HOST else ("p2p",):
        g = Comm(COMM, transport=t)
        got[t] = g.reduce_scatter_rows(partial, rc).copy()
        g.close()
    all_ok(all(np.array_equal(v, got["p2p"]) for v in got.values()), "p2p and shm sums differ")


@pytest.mark.skipif(not ONE_HOST, reason="the shared window needs the ranks on one host")
def test_shared_results_live_until_the_third_verb_after():
    """An Allgatherv result in the shared window survives the group's next RING - 2 verbs,
    also across the window's growth (the outgrown window is freed later, collectively)."""
    g = Comm(COMM, transport="shm")
    rc = [3] * N
    first = g.allgather_rows(np.full((3, 4), RANK, np.float32), rc)
    want = first.copy()
    g.reduce_scatter_rows(np.full((3 * N, 4), 7.0, np.float32), rc)
    g.allgather_rows(np.full((3, 4), -1.0, np.float32), rc)
    ok = np.array_equal(first, want)
    big = g.allgather_rows(np.full((1 << 16, 8), RANK, np.float32), [1 << 16] * N)  # grows
    want_big = big.copy()
    g.allgather_rows(np.full((3, 4), 5.0, np.float32), rc)
    ok = ok and np.array_equal(big, want_big) and RING >= 3
    for _ in range(2 * RING):  # cycles the ring and frees the outgrown window
        g.reduce_scatter_rows(np.ones((3 * N, 4), np.float32), rc)
    ok = ok and not g.shm.retired
    g.close()
    all_ok(ok, "a shared result was overwritten too soon, or the old window was kept")


def test_transport_choice():
    with pytest.raises(ValueError, match="HEPTI_COMM='tcp'"):
        choose_transport(COMM, "tcp")
    assert choose_transport(COMM, "p2p") == "p2p"
    if N > 1:
        assert choose_transport(COMM, "auto") == ("shm" if ONE_HOST else "p2p")


def test_service_verbs_command_and_report():
    """`hepti serve`'s per-batch verbs: bcast_idle gives every rank rank 0's command, in the
    order sent; gather_floats gives root each rank's floats in rank order (None elsewhere)."""
    w = Comm(COMM, transport="p2p")
    try:
        got = [w.bcast_idle(np.array([k, 10 * k], np.int64) if RANK == 0 else None, 2).tolist()
               for k in range(3)]
        rows = w.gather_floats([RANK, RANK + 0.5, -1.0])
        ok = got == [[0, 0], [1, 10], [2, 20]]
        if RANK == 0:
            ok = ok and rows == [[j, j + 0.5, -1.0] for j in range(N)]
        else:
            ok = ok and rows is None
        all_ok(ok)
    finally:
        w.close()
