"""The decoder at 3 ranks, launched by the test itself (`mpiexec -n 3`): tests/mpi/decoder_check.py
against transformers' fixtures, `tensor` with skewed ratios and `pipeline` with skewed layers,
zeros included, and sampling equal to one rank's. SmolLM2-135M runs once each way here (it is
the slow one); the tiny odd decoder in four cases; all in one launch."""
from __future__ import annotations

import json

import pytest

from test_distributed_launch import ROOT, launch, launch_runs

SMOLLM2 = ROOT / "weights" / "smollm2"


@pytest.fixture(scope="module")
def llama_tiny_dir(tmp_path_factory):
    from hepti.weights.gguf import convert_gguf
    return convert_gguf(ROOT / "tests/fixtures/llama-tiny-odd.gguf",
                        tmp_path_factory.mktemp("w") / "llama-tiny", progress=False)


def test_decoder_at_3_ranks(llama_tiny_dir):
    tiny = f"{llama_tiny_dir}:llama_tiny_expected.npz"
    args = ["--model", f"{tiny}:0.5,0,0.5", "--model", f"{tiny}:0.2,0.5,0.3",
            "--model", f"{tiny}:layers=1,0,4", "--model", f"{tiny}:layers=0,2,3",
            "--sampling", f"{tiny}:0.2,0.5,0.3", "--sampling", f"{tiny}:layers=2,1,2"]
    smol = (SMOLLM2 / "index.json").is_file()
    if smol:
        args += ["--model", f"{SMOLLM2}:smollm2_expected.npz:0.5,0,0.5",
                 "--model", f"{SMOLLM2}:smollm2_expected.npz:layers=10,0,20"]
    code, out, err, _ = launch(3, "-m", "mpi4py", ROOT / "tests/mpi/decoder_check.py", *args,
                               timeout=900)
    rows = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert code == 0, err[-3000:] + "\n" + "\n".join(map(str, rows))
    # tiny: 2 prompts x 4 cases + 2 prompts x 2 samplings x 2; SmolLM2: 3 prompts x 2
    assert len(rows) == 16 + (6 if smol else 0) and all(r["ok"] for r in rows), rows
    assert {r["ratios"] for r in rows} >= {"layers=1,0,4", "layers=0,2,3", "layers=2,1,2"}
    assert {r["shard"] for r in rows if r["case"] == "fixture" and r["ratios"] == "0.5,0,0.5"} \
        >= {"Shard(kv=(0, 1), ffn=(0, 100), vocab=(0, 150), residual=True)"}


def _json_tail(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_generate_cli_at_2_ranks(llama_tiny_dir, tmp_path):
    """`mpiexec -n 2 hepti generate`: tensor with a zero share, single, pipeline with rank 0 of
    no layers, and auto choosing pipeline (devices too small alone, slow links) give the
    fixture's ids, logits and tokens, printed once; a ratio vector of the wrong length is
    refused once, before any work, without a traceback."""
    import numpy as np
    z = np.load(ROOT / "tests/fixtures/llama_tiny_expected.npz")
    text, ids = str(z["prompt0_text"]), z["prompt0_ids"].tolist()
    greedy = z["prompt0_greedy"].tolist()
    from hepti.plan.profile import declared_profile
    # two devices that cannot hold the tiny decoder alone, on slow links: auto runs pipeline
    declared_profile([dict(gemm_flops=1e11, memory_bytes=1.2e6, latency_s=2e-3,
                           bandwidth_Bps=1.2e7, gemv_Bps=1.5e10)] * 2).save(tmp_path / "p.json")
    runs = (("tensor", ["--ratios", "0,1"]), ("tensor", ["--ratios", "1,0"]),
            ("single", ["--strategy", "single"]),
            ("pipeline", ["--strategy", "pipeline", "--layers", "0,5"]),
            ("pipeline", ["--strategy", "auto", "--profile", tmp_path / "p.json"]))
    logits = [tmp_path / f"logits{i}.npy" for i in range(len(runs))]
    # the five runs and the refusal in one job (tests/mpi/runs.py: the ranks' start-up paid
    # once, not six times)
    codes, outs, errs = launch_runs(
        2, *[["generate", "--model", llama_tiny_dir, "--prompt", text, "--max-tokens", 32,
              "--json", "--logits-out", out_file, *extra]
             for out_file, (_, extra) in zip(logits, runs)],
        ["generate", "--model", llama_tiny_dir, "--prompt", "hi", "--ratios", "0.2,0.3,0.5"],
        timeout=600)
    for (ran, extra), out_file, code, out, err in zip(runs, logits, codes, outs, errs):
        assert code == 0, err
        doc = _json_tail(out)
        assert out.count('"prompt_ids"') == 1 and err.count("hepti generate: ") == 2, (out, err)
        assert doc["strategy"] == ran, (doc["strategy"], err)
        assert doc["prompt_ids"] == ids and doc["token_ids"] == greedy[:len(doc["token_ids"])]
        assert len(doc["per_rank"]) == 2
        assert np.abs(np.load(out_file) - z["prompt0_logits"]).max() < 1e-3
        if extra[-1] in ("0,1", "0,5"):  # rank 0 holds no KV head (no layer): no cache either
            assert all(r["comm_s"] > 0 for r in doc["per_rank"])
            assert [r["kv_cache_bytes"] > 0 for r in doc["per_rank"]] == [False, True]
            assert doc["layers"] == ([0, 5] if extra[-1] == "0,5" else None)
        elif ran == "single" or extra[-1] == "1,0":  # rank 1 was left out: no shard, no syncs
            assert doc["per_rank"][1]["weight_bytes"] == 0
            assert doc["per_rank"][1]["comm_s"] == 0 and doc["per_rank"][0]["comm_s"] == 0
    msg = "3 entries but there are 2 ranks"
    assert codes[-1] == 2 and errs[-1].count(msg) == 1 and "Traceback" not in errs[-1], errs[-1]
    # printed once (by rank 0) in the whole job too, whichever command's part a line reached
    assert "".join(outs).count('"prompt_ids"') == len(runs), outs
    assert "".join(errs).count("hepti generate: ") == 2 * len(runs) + 1, errs  # + the refusal
    assert "".join(errs).count(msg) == 1 and "Traceback" not in "".join(errs), errs


def test_tensor_group_leaves_out_ranks_of_no_share():
    """`tensor`: a rank with neither KV heads nor MLP columns leaves the group (rank 0 stays,
    it prints and holds the residual); the members' shares are what the group gets."""
    from hepti.parallel.decoder import group_members, members_ratios
    r = {"heads": [0.5, 0.0, 0.5, 0.0], "ffn": [0.0, 0.0, 0.7, 0.3], "rows": [0.2, 0.8, 0.0, 0.0]}
    members = group_members("tensor", None, r, 4)
    assert members == [True, False, True, True]
    assert members_ratios(r, members) == {"heads": [0.5, 0.5, 0.0], "ffn": [0.0, 0.7, 0.3],
                                          "rows": [0.2, 0.0, 0.0]}
    assert members_ratios({"rows": [0.0, 1.0, 0.0]}, [True, False, True]) == {"rows": [0.5, 0.5]}
    assert group_members("tensor", None, {"heads": [0, 1], "ffn": [0, 1]}, 2) == [True, True]
    assert group_members("pipeline", [0, 3, 0], None, 3) == [True, True, False]
    assert group_members("single", None, None, 3) == [True, False, False]


def test_pipeline_layers_are_checked():
    """--layers: one whole number per rank adding up to the model's layers, else a message
    that says what to give; --ratios' one vector by largest remainder; equal by default."""
    from types import SimpleNamespace
    from hepti.errors import InputError
    from hepti.generate import pipeline_layers

    def layers(n, **kw):
        return pipeline_layers(SimpleNamespace(**{"layers": None, "ratios": None, **kw}), 30, n)
    assert layers(2, layers="20,10") == [20, 10] and layers(3, layers="10,0,20") == [10, 0, 20]
    assert layers(2, ratios="0.7,0.3") == [21, 9] and layers(4) == [8, 8, 7, 7]
    for kw, msg in ((dict(layers="20,20"), "add up to 30"), (dict(layers="30"), "one per rank"),
                    (dict(layers="20,x"), "whole numbers"), (dict(layers="31,-1"), "0 or more"),
                    (dict(layers="20,10", ratios="0.5,0.5"), "give one of them"),
                    (dict(ratios="heads=1,0;ffn=0.5,0.5"), "one vector")):
        with pytest.raises(InputError, match=msg):
            layers(2, **kw)


def test_generate_refuses_bad_input_at_2_ranks(llama_tiny_dir):
    """Issue 46's bad requests under `mpiexec -n 2 hepti generate`: exit 2, the message, no
    traceback, and no rank left waiting. A prompt longer than the context is checked on every
    rank and reported once; --max-tokens 0 and a negative temperature are refused by argparse
    before MPI starts, which prints its message on each rank."""
    cases = [(["--prompt", "the cat " * 200], "do not fit the model's context of 256", 1),
             (["--prompt", "hi", "--max-tokens", 0], "must be at least 1", None),
             (["--prompt", "hi", "--temperature", -0.5], "give 0 or more", None)]
    for extra, msg, times in cases:
        code, _, err, _ = launch(2, "-m", "hepti", "generate", "--model", llama_tiny_dir,
                                 *extra, timeout=120)
        assert code == 2 and msg in err and "Traceback" not in err, (extra, err)
        assert times is None or err.count(msg) == times, err


def test_a_failing_rank_ends_the_whole_generation(llama_tiny_dir, sweeps_killed_job):
    """A rank that fails after loading (rank 1 here, while rank 0 waits in the prefill's first
    collective) ends the job with its rank and message, and no rank hangs."""
    import os
    env = dict(os.environ, HEPTI_FAULT_RANK="1")
    code, out, err, secs = launch(2, "-m", "hepti", "generate", "--model", llama_tiny_dir,
                                  "--prompt", "hi", env=env, timeout=120)
    assert code != 0 and "rank 1" in err and "injected fault" in err, err
