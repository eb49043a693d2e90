"""`hepti plan` and `hepti generate --strategy auto` on a decoder (issue 46): the comparison printed,
a plan that does not fit refused naming the rank, bad combinations refused; and a decoder's
profile figures (`measure_decoder`) pass the profile's schema with its GeMV fields."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hepti.model.llama import LlamaConfig
from hepti.parallel.profile_compute import measure_decoder, measure_gemvs
from hepti.plan.profile import declared_profile
from hepti.weights.gguf import convert_gguf
from helpers import hepti

TINY_GGUF = Path(__file__).resolve().parent / "fixtures" / "llama-tiny-odd.gguf"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return convert_gguf(TINY_GGUF, tmp_path_factory.mktemp("w") / "llama-tiny", progress=False)


def _profile(tmp_path, memory_bytes=4e9, **link):
    dev = dict(gemm_flops=1e11, memory_bytes=memory_bytes, gemv_Bps=1e10, latency_s=1e-5,
               bandwidth_Bps=1e9, **link)
    p = tmp_path / "p.json"
    p.write_text(json.dumps(declared_profile([dev, dev]).to_dict()))
    return p


def test_plan_prints_the_comparison(tiny_dir, tmp_path):
    code, out, err = hepti("plan", "--model", tiny_dir, "--profile", _profile(tmp_path),
                           "--seq", 5, "--max-tokens", 8)
    assert code == 0, err
    assert "single on rank 0:" in out and "tensor" in out and "pipeline" in out
    assert out.strip().splitlines()[-1].startswith("-> ")
    code, out, err = hepti("plan", "--model", tiny_dir, "--profile", _profile(tmp_path),
                           "--seq", 5, "--max-tokens", 8, "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["strategy"] in ("single", "tensor") and doc["request"]["ctx"] == 13
    assert {c["strategy"] for c in doc["candidates"]} == {"single", "tensor", "pipeline"}


def test_plan_that_does_not_fit_names_the_rank(tiny_dir, tmp_path):
    code, out, err = hepti("plan", "--model", tiny_dir, "--profile", _profile(tmp_path),
                           "--strategy", "single", "--mem-budget", "1KiB")
    assert code != 0 and "Traceback" not in err
    assert "rank 0 short by" in err and "--max-tokens" in err


@pytest.mark.parametrize("args, needle", [
    (("--ctx", 3, "--seq", 5), "--ctx 3 is shorter"),
    (("--strategy", "stream"), "auto, single, tensor or pipeline"),
])
def test_plan_refuses_bad_input(tiny_dir, tmp_path, args, needle):
    code, out, err = hepti("plan", "--model", tiny_dir, "--profile", _profile(tmp_path), *args)
    assert code != 0 and "Traceback" not in err and needle in err, err


def test_generate_auto_refuses_ratios_and_profile_without_auto(tiny_dir, tmp_path):
    code, _, err = hepti("generate", "--model", tiny_dir, "--prompt", "hi", "--strategy", "auto",
                         "--ratios", "1")
    assert code != 0 and "Traceback" not in err and "drop --ratios" in err, err
    code, _, err = hepti("generate", "--model", tiny_dir, "--prompt", "hi", "--profile",
                         _profile(tmp_path))
    assert code != 0 and "are for --strategy auto" in err, err


def test_generate_auto_on_one_process_prints_the_plan(tiny_dir, tmp_path):
    one = tmp_path / "one.json"
    one.write_text(json.dumps(declared_profile([dict(gemm_flops=1e11, memory_bytes=4e9,
                                                     latency_s=0, bandwidth_Bps=1e9)]).to_dict()))
    code, out, err = hepti("generate", "--model", tiny_dir, "--prompt", "hi", "--max-tokens", 3,
                           "--strategy", "auto", "--profile", one, "--json")
    assert code == 0, err
    assert "single on rank 0:" in err and "-> single" in err
    assert "no gemv_Bps" in err  # the estimate is said
    assert json.loads(out.strip().splitlines()[-1])["strategy"] == "single"


def test_decoder_profile_figures_fit_the_schema():
    cfg = LlamaConfig(vocab_size=64, hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=96, head_dim=16)
    got = {**measure_decoder(cfg, rows=8), **measure_gemvs(cfg.hidden_size)}
    dev = declared_profile([dict(got, memory_bytes=1e9, latency_s=0, bandwidth_Bps=1e9)]).devices[0]
    assert dev.gemv_Bps == got["gemv_Bps"] and dev.gemv_int8_Bps == got["gemv_int8_Bps"]
    assert [s for s, _ in got["gemm_flops"]] == [8.0]
    assert dev.call_overhead_s == got["call_overhead_s"] > 0  # a decode step's call


def test_a_decoders_compute_is_work_an_emulated_devices_stretch_slows(tiny_dir):
    """Under `hepti emulate` a rank is slowed by the CPU it spends inside work spans
    (hepti.emulate.stretch). A generation's compute must be one, and on a group of one (no verb)
    each token pays its part: before, a decoder ran at its guard quota, twice its share, and
    `single` on emu-mixed4's 0.5-core device decoded 1.6x faster than its own profile."""
    from hepti.emulate import stretch
    from hepti.parallel.comm import Comm
    from hepti.parallel.decoder import DecoderGroup, Sampling
    from hepti.weights import WeightStore
    with WeightStore(tiny_dir) as store:
        dec = DecoderGroup(Comm(None), store, {d: [1.0] for d in ("heads", "ffn", "rows")})
    dec.warm_up()
    before = dict(stretch._stats)
    stretch.enable(0.5)
    try:
        tokens = dec.generate([1, 2, 3], 6, Sampling())
    finally:
        stretch.disable()
    assert len(tokens) >= 1
    assert stretch._stats["work_cpu_s"] > before["work_cpu_s"]  # its CPU was counted as work
    assert stretch._stats["payments"] > before["payments"]  # and paid for, as it went
