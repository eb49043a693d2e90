"""Under mpiexec -n 2: the verbs a decoder's generation calls == the collectives of its cost
programs (hepti.graph.decoder), as tests/mpi/agreement.py holds the encoders'.

One greedy generation runs in `tensor` with every verb call recorded (kind, bytes sent, bytes
received: hepti.parallel.trace `record_messages`); the program's sequence is the prefill's
collectives, then the decode step's once for every token after the first, each rank's bytes by
hepti.plan.costmodel.rank_bytes at the counts hepti.plan.decoder derives from the same ratios.
Equal, count and bytes, or the test fails.

`pipeline` (hepti.parallel.decoder_pipeline) is held the same way to the transfers its planner
prices (hepti.plan.decoder.pipeline_hops, then the token's Bcast of TOKEN_BYTES): each rank's
sends and receives of the hidden rows, in order, and its part of the Bcast, per forward."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mpi_helpers import COMM, all_ok  # noqa: E402

from hepti.graph.decoder import decode_program, prefill_program  # noqa: E402
from hepti.parallel.comm import Comm  # noqa: E402
from hepti.parallel.decoder import DecoderGroup, Sampling  # noqa: E402
from hepti.parallel.decoder_pipeline import PipelineGroup  # noqa: E402
from hepti.parallel.trace import Tracer  # noqa: E402
from hepti.plan.costmodel import active_ranks, rank_bytes  # noqa: E402
from hepti.plan.decoder import TOKEN_BYTES, pipeline_hops, tensor_counts  # noqa: E402
from hepti.plan.planfile import parse_ratios  # noqa: E402
from hepti.weights import WeightStore  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "weights" / "smollm2"
pytestmark = pytest.mark.skipif(COMM.Get_size() != 2, reason="written for mpiexec -n 2")
PROMPT = [1, 5, 9, 2, 7, 3]


def program_messages(program, cnt, rank: int) -> list[tuple[str, int, int]]:
    """This rank's (kind, sent, received) for every collective of the program, in order."""
    cnt = {d: cnt[d] for d in program.totals}
    active = active_ranks(program, cnt, COMM.Get_size())
    out = []
    for phase in program.start + program.layer * program.repeat + program.end:  # run order
        if phase.collective is not None:
            sent, recv = rank_bytes(phase.collective, cnt, active)[rank]
            out.append((phase.collective.kind, int(sent), int(recv)))
    return out


def _generate(model_dir, make_group, prompt, max_tokens: int):
    """A greedy generation with every verb call recorded on this rank: (config, prompt ids,
    tokens, the calls)."""
    store = WeightStore(model_dir)
    cfg = store.config
    comm = Comm(COMM, Tracer(COMM.Get_rank(), record_messages=True))
    try:
        dec = make_group(comm, store)
        comm.tracer.reset()
        ids = [i % cfg.vocab_size for i in prompt]
        tokens = dec.generate(ids, max_tokens, Sampling())
        got = list(comm.tracer.messages)
    finally:
        comm.close()
        store.close()
    return cfg, ids, tokens, got


def _verdict(got, want):
    first = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    all_ok(got == want, f"rank {COMM.Get_rank()}: {len(got)} verb calls, the programs say "
                        f"{len(want)}; first difference at {first}: "
                        f"{got[first] if first is not None else None} vs "
                        f"{want[first] if first is not None else None}")


def _agree(model_dir, ratios_text: str, prompt, max_tokens: int):
    ratios = parse_ratios(ratios_text, 2)
    cfg, ids, tokens, got = _generate(model_dir, lambda c, s: DecoderGroup(c, s, ratios),
                                      prompt, max_tokens)
    ctx = len(ids) + max_tokens
    cnt = tensor_counts(cfg, ratios, len(ids))
    want = program_messages(prefill_program(cfg, len(ids), ctx), cnt, COMM.Get_rank())
    want += program_messages(decode_program(cfg, ctx), cnt, COMM.Get_rank()) * (len(tokens) - 1)
    _verdict(got, want)


def pipeline_messages(layers: list[int], rows: int, hidden: int, rank: int
                      ) -> list[tuple[str, int, int]]:
    """This rank's (kind, sent, received) for one pipeline forward and its token's Bcast."""
    out = []
    for j, k, nbytes in pipeline_hops(layers, rows, hidden):
        if j == rank:
            out.append(("send", int(nbytes), 0))
        elif k == rank:
            out.append(("recv", 0, int(nbytes)))
    n = len(layers)
    return out + [("bcast", TOKEN_BYTES * (n - 1), 0) if rank == 0 else ("bcast", 0, TOKEN_BYTES)]


def _agree_pipeline(model_dir, layers: list[int], prompt, max_tokens: int):
    cfg, ids, tokens, got = _generate(model_dir, lambda c, s: PipelineGroup(c, s, layers),
                                      prompt, max_tokens)
    C, r = cfg.hidden_size, COMM.Get_rank()
    want = pipeline_messages(layers, len(ids), C, r)
    want += pipeline_messages(layers, 1, C, r) * (len(tokens) - 1)
    _verdict(got, want)


@pytest.mark.parametrize("layers", [[3, 2], [0, 5], [5, 0]])
def test_tiny_pipeline_transfers_equal_its_program(llama_tiny_dir, layers):
    _agree_pipeline(llama_tiny_dir, layers, PROMPT, 4)


@pytest.mark.parametrize("ratios", ["0.7,0.3", "heads=0,1;ffn=0.6,0.4;rows=0.5,0.5"])
def test_tiny_verbs_equal_the_programs(llama_tiny_dir, ratios):
    _agree(llama_tiny_dir, ratios, PROMPT, 4)


def test_one_token_prompt_is_all_allreduces(llama_tiny_dir):
    _agree(llama_tiny_dir, "0.5,0.5", PROMPT[:1], 2)


@pytest.mark.skipif(not (SMOLLM2 / "index.json").is_file(), reason="weights/smollm2 is absent")
def test_smollm2_verbs_equal_the_programs():
    _agree(SMOLLM2, "0.6,0.4", PROMPT, 3)
    _agree_pipeline(SMOLLM2, [20, 10], PROMPT, 3)
