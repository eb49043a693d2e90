"""The decoder executor (hepti.parallel.decoder) on every rank of a group, against transformers'
fixtures and against itself on one rank; used by tests/mpi/test_decoder.py (mpiexec -n 2) and
run as a script at 3 ranks by tests/test_decoder_launch.py:

    mpiexec -n 3 python -m mpi4py tests/mpi/decoder_check.py --model DIR:FIXTURE.npz:RATIOS ...

RATIOS is `tensor`'s --ratios, or `layers=10,0,20` for `pipeline` (layers per rank); each case
prints one JSON row per case on rank 0 ({"ok": ...}); it exits non-zero if any case failed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hepti.parallel.comm import Comm
from hepti.parallel.decoder import DecoderGroup, Sampling
from hepti.parallel.decoder_pipeline import PipelineGroup, layer_counts
from hepti.parallel.trace import Tracer
from hepti.plan.planfile import DIMS, parse_ratios
from hepti.weights import WeightStore
from hepti.weights.decoder import load_tokenizer

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
LOGIT_TOL = 1e-3  # as tests/test_llama.py
ALONE_TOL = 1e-4  # the same weights in another summation order: float32 rounding only
GREEDY = 32  # tokens, as the fixtures hold
SAMPLED = 16
SAMPLINGS = (Sampling(0.8, 1.0, 11), Sampling(0.7, 0.9, 5))
LAYERS = "layers="  # a case's RATIOS that asks for `pipeline`


def expected(name: str) -> list[dict]:
    z = np.load(FIXTURES / name)
    return [{"text": str(z[f"prompt{k}_text"]), "ids": z[f"prompt{k}_ids"].tolist(),
             "logits": z[f"prompt{k}_logits"], "greedy": z[f"prompt{k}_greedy"].tolist()}
            for k in range(int(z["n_prompts"]))]


def group(model_dir, ratios: str | None, comm: Comm) -> DecoderGroup:
    """`tensor` by a ratio text, `pipeline` by "layers=N,M,...", or one rank alone (None)."""
    with WeightStore(model_dir) as store:
        if ratios and ratios.startswith(LAYERS):
            n = layer_counts(store.config.num_hidden_layers, ratios[len(LAYERS):], comm.size)
            return PipelineGroup(comm, store, n)
        vec = parse_ratios(ratios, comm.size) if ratios else {d: [1.0] for d in DIMS}
        return DecoderGroup(comm, store, vec)


def greedy_with_logits(dec: DecoderGroup, ids) -> tuple[list[int], np.ndarray | None]:
    """GREEDY tokens from the group, and the prefill's last-position logits gathered on the
    group's rank 0 (None elsewhere)."""
    first: list = []
    greedy = dec.generate(ids, GREEDY, Sampling(), logits_out=first)
    return greedy, dec.gather_logits(first[0])


def check_fixture(model_dir, fixture: str, ratios: str, comm: Comm) -> list[dict]:
    """Per prompt: prompt_ids equal, the prefill's logits within LOGIT_TOL, 32 greedy tokens
    equal to transformers'. Rows on the group's rank 0 (the logits are gathered there)."""
    dec = group(model_dir, ratios, comm)
    tok, _ = load_tokenizer(model_dir)
    rows = []
    for k, case in enumerate(expected(fixture)):
        ids = tok.encode(case["text"]).ids
        greedy, logits = greedy_with_logits(dec, ids)
        if comm.rank == 0:
            diff = float(np.abs(logits - case["logits"]).max())
            rows.append({"case": "fixture", "model": Path(model_dir).name, "ratios": ratios,
                         "prompt": k, "shard": str(dec.shard), "ids_equal": ids == case["ids"],
                         "logit_diff": diff, "greedy_equal": greedy == case["greedy"],
                         "ok": ids == case["ids"] and diff < LOGIT_TOL
                         and greedy == case["greedy"]})
    return rows


def check_sampling(model_dir, fixture: str, ratios: str, comm: Comm, prompts=None) -> list[dict]:
    """With a seed, the group samples the same tokens as one rank alone (top-p 1 and below);
    every rank of the group returns the same tokens too."""
    dec = group(model_dir, ratios, comm)
    alone = group(model_dir, None, Comm(None)) if comm.rank == 0 else None
    tok, _ = load_tokenizer(model_dir)
    rows = []
    for k, case in enumerate(expected(fixture)):
        if prompts is not None and k not in prompts:
            continue
        ids = tok.encode(case["text"]).ids
        for s in SAMPLINGS:
            got = dec.generate(ids, SAMPLED, s)
            same_everywhere = len({tuple(t) for t in comm.mpi.allgather(got)}) == 1 \
                if not comm.solo else True
            if comm.rank == 0:
                want = alone.generate(ids, SAMPLED, s)
                rows.append({"case": "sampling", "model": Path(model_dir).name, "ratios": ratios,
                             "prompt": k, "sampling": str(s), "tokens": got, "alone": want,
                             "ok": got == want and same_everywhere})
    return rows


def check_against_one_rank(model_dir, fixture: str, ratios: str, comm: Comm,
                           tol: float = ALONE_TOL) -> list[dict]:
    """The group's prefill logits within `tol` of one rank alone's and the same greedy tokens
    (for a model with no outside reference of its own precision: an int8 folder, whose weights
    the group and the single rank share exactly). Rows on the group's rank 0."""
    dec = group(model_dir, ratios, comm)
    alone = group(model_dir, None, Comm(None)) if comm.rank == 0 else None
    tok, _ = load_tokenizer(model_dir)
    rows = []
    for k, case in enumerate(expected(fixture)):
        ids = tok.encode(case["text"]).ids
        greedy, logits = greedy_with_logits(dec, ids)
        if comm.rank == 0:
            one: list = []
            want = alone.generate(ids, GREEDY, Sampling(), logits_out=one)
            diff = float(np.abs(logits - one[0]).max())
            rows.append({"case": "one rank", "model": Path(model_dir).name, "ratios": ratios,
                         "prompt": k, "shard": str(dec.shard), "logit_diff": diff,
                         "greedy_equal": greedy == want, "ok": diff < tol and greedy == want})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", action="append", required=True, metavar="DIR:FIXTURE:RATIOS")
    ap.add_argument("--sampling", action="append", default=[], metavar="DIR:FIXTURE:RATIOS")
    args = ap.parse_args()
    mpi = MPI.COMM_WORLD
    comm = Comm(mpi, Tracer(mpi.Get_rank()))
    rows = []
    for spec in args.model:
        d, fixture, ratios = spec.rsplit(":", 2)
        rows += check_fixture(d, fixture, ratios, comm)
    for spec in args.sampling:
        d, fixture, ratios = spec.rsplit(":", 2)
        rows += check_sampling(d, fixture, ratios, comm)
    if comm.rank == 0:
        for r in rows:
            print(json.dumps(r), flush=True)
    ok = all(r["ok"] for r in rows)
    return 0 if mpi.bcast(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
