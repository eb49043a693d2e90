"""The `hepti` command end to end: outputs, and bad input answered with a clear message and a
non-zero exit, never a traceback as the only explanation."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import hepti  # noqa: F401 - other test files import it from here


def assert_clean_error(code, err, *needles):
    assert code != 0
    assert "Traceback" not in err, err
    for n in needles:
        assert n in err, f"{n!r} not in {err!r}"


def test_info():
    code, out, err = hepti("info", "--json")
    assert code == 0, err
    info = json.loads(out)
    for k in ("python", "numpy", "numba", "mpi4py", "mpi_library", "h5py", "cpu_flags"):
        assert k in info


def test_help_explains():
    code, out, _ = hepti("run", "--help")
    assert code == 0 and "--input-ids" in out and "--strategy" in out


def test_run_texts_json_and_output(minilm_dir, tmp_path):
    out, report = tmp_path / "emb.npy", tmp_path / "report.json"
    code, stdout, err = hepti("run", "--model", minilm_dir, "--text", "a cat", "a dog sat down",
                              "--normalize", "--output", out, "--json", "--repeat", "2",
                              "--report", report)
    assert code == 0, err
    rep = json.loads(stdout)
    assert rep["n_inputs"] == 2 and len(rep["latency_s"]["runs"]) == 2
    assert json.loads(report.read_text()) == rep  # --report writes what --json prints
    e = np.load(out)
    assert e.shape == (2, 384) and np.allclose(np.linalg.norm(e, axis=1), 1, atol=1e-5)


def test_run_input_ids_hidden_keeps_length(tiny_dir, tmp_path):
    ids = np.array([[2, 5, 7, 0, 0, 0, 0], [3, 4, 5, 6, 7, 8, 9]])
    f = tmp_path / "ids.npz"
    np.savez(f, ids=ids, mask=(ids > 0).astype(np.int64))
    out = tmp_path / "h.npy"
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", f, "--pool", "none", "--output", out,
                         "--batch-size", "1")
    assert code == 0, err
    assert np.load(out).shape == (2, 7, 96)


def test_run_input_file_batches(minilm_dir, tmp_path):
    f = tmp_path / "in.txt"
    f.write_text("one\n\ntwo words\nthree words here\n")
    out = tmp_path / "e.npy"
    code, _, err = hepti("run", "--model", minilm_dir, "--input", f, "--batch-size", "2", "--output", out)
    assert code == 0, err
    assert np.load(out).shape == (4, 384)  # row i is line i: the blank line is the empty text


def test_error_missing_shard(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    shard = sorted(d.glob("shard-*.h5"))[-1]
    shard.unlink()
    code, _, err = hepti("run", "--model", d, "--input-ids", _ids(tmp_path))
    assert_clean_error(code, err, shard.name)


def test_error_corrupted_shard(tiny_dir, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_dir, d)
    shard = sorted(d.glob("shard-*.h5"))[-1]
    raw = bytearray(shard.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 64] = bytes(255 - b for b in raw[mid:mid + 64])  # flip bytes inside the data
    shard.write_bytes(bytes(raw))
    code, _, err = hepti("run", "--model", d, "--input-ids", _ids(tmp_path))
    assert_clean_error(code, err, shard.name)
    code, out, err = hepti("verify", d)
    assert code != 0 and shard.name in err


def test_error_unsupported_model_type(tmp_path, fixtures_dir):
    src = tmp_path / "src"
    shutil.copytree(fixtures_dir / "tiny-odd", src)
    cfg = json.loads((src / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (src / "config.json").write_text(json.dumps(cfg))
    code, _, err = hepti("convert", src, "--out", tmp_path / "out")
    assert_clean_error(code, err, "gpt2", "bert")
    assert not (tmp_path / "out").exists()


def test_error_empty_input_file(minilm_dir, tmp_path):
    f = tmp_path / "empty.txt"
    f.write_text("")
    code, _, err = hepti("run", "--model", minilm_dir, "--input", f)
    assert_clean_error(code, err, "empty")


def test_error_ids_file_without_ids(tiny_dir, tmp_path):
    f = tmp_path / "x.npz"
    np.savez(f, tokens=np.zeros((1, 3), np.int64))
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", f)
    assert_clean_error(code, err, "`ids`", "tokens")


def test_error_ids_outside_vocab(tiny_dir, tmp_path):
    f = tmp_path / "x.npz"
    np.savez(f, ids=np.array([[1, 2, 5000]]))
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", f)
    assert_clean_error(code, err, "5000", "vocabulary")


def test_error_unknown_flag():
    code, _, err = hepti("run", "--text", "x", "--no-such-flag")
    assert_clean_error(code, err, "--no-such-flag")


def test_error_output_in_missing_folder(tiny_dir, tmp_path):
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", _ids(tmp_path),
                         "--output", tmp_path / "nope" / "o.npy")
    assert_clean_error(code, err, "does not exist")


def test_error_report_in_missing_folder(tiny_dir, tmp_path):
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", _ids(tmp_path),
                         "--report", tmp_path / "nope" / "r.json")
    assert_clean_error(code, err, "--report")


def test_error_missing_model(tmp_path):
    code, _, err = hepti("run", "--model", tmp_path / "nothing", "--text", "x")
    assert_clean_error(code, err, "hepti convert")


def test_error_text_on_a_model_without_tokenizer(tmp_path):
    """A `convert --random` model has no tokenizer: the error says to pass --input-ids and how
    to make the .npz."""
    code, _, err = hepti("convert", "--random", "tiny-odd", "--out", tmp_path / "rnd")
    assert code == 0, err
    code, _, err = hepti("run", "--model", tmp_path / "rnd", "--text", "hi")
    assert code == 2
    assert_clean_error(code, err, "no tokenizer.json", "convert --random", "--input-ids FILE.npz",
                       "`ids` [n, L]", "np.savez(")


def _ids(tmp_path):
    f = tmp_path / "ok.npz"
    np.savez(f, ids=np.array([[1, 2, 3]]))
    return f


def _profile(tmp_path, devices, **extra):
    p = tmp_path / "profile.json"
    p.write_text(json.dumps({"hepti_profile": 1, "created": extra.pop("created", 0),
                             "source": extra.pop("source", "declared"),
                             "devices": [dict(d, rank=i) if "gemm_flops" in d and "memory_bytes" in d else d
                                         for i, d in enumerate(devices)], **extra}))
    return p


DEV = {"gemm_flops": 5e10, "memory_bytes": 4e9, "latency_s": 1e-4, "bandwidth_Bps": 1.2e8}


def test_plan_explains_and_writes_plan_file(minilm_dir, tmp_path):
    prof = _profile(tmp_path, [dict(DEV), dict(DEV, gemm_flops=2e10, bandwidth_Bps=1.2e7)])
    code, out, err = hepti("plan", "--model", minilm_dir, "--profile", prof)
    assert code == 0, err
    assert "predicted latency" in out and "rank" in out
    code, out, err = hepti("plan", "--model", minilm_dir, "--profile", prof, "--json")
    plan = json.loads(out)
    assert plan["hepti_plan"] == 1 and plan["predicted_latency_s"] > 0 and plan["solve_s"] >= 0
    assert plan["explanation"]


def test_plan_evaluates_given_ratios(minilm_dir, tmp_path):
    prof = _profile(tmp_path, [dict(DEV), dict(DEV)])
    code, out, err = hepti("plan", "--model", minilm_dir, "--profile", prof, "--strategy", "tensor",
                           "--ratios", "0.75,0.25", "--json")
    assert code == 0, err
    assert json.loads(out)["ratios"]["heads"] == [0.75, 0.25]


@pytest.mark.parametrize("devices,extra,needle", [
    ([dict(DEV, gemm_flops=0), dict(DEV)], {}, "gemm"),
    ([dict(DEV, memory_bytes=0), dict(DEV)], {}, "memory"),
    ([{"rank": 0, "gemm_flops": 1e9}, dict(DEV, rank=1)], {}, "memory_bytes"),
    ([dict(DEV), dict(DEV)], {"source": "measured", "created": 1.0}, "old"),
])
def test_plan_rejects_bad_profiles(minilm_dir, tmp_path, devices, extra, needle):
    prof = _profile(tmp_path, devices, **extra)
    code, _, err = hepti("plan", "--model", minilm_dir, "--profile", prof, "--max-age", "3600")
    assert_clean_error(code, err, needle)


def test_plan_rejects_malformed_profile(minilm_dir, tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{not json")
    code, _, err = hepti("plan", "--model", minilm_dir, "--profile", p)
    assert_clean_error(code, err, "JSON")


def test_plan_says_how_much_memory_is_missing(minilm_dir, tmp_path):
    prof = _profile(tmp_path, [dict(DEV, memory_bytes=20e6), dict(DEV, memory_bytes=20e6)])
    code, _, err = hepti("plan", "--model", minilm_dir, "--profile", prof)
    assert_clean_error(code, err, "MB")


def test_run_matches_pytorch_fixture(minilm_dir, fixtures_dir, tmp_path):
    """`hepti run` end to end (ids in, .npy out) against transformers' outputs."""
    exp = np.load(fixtures_dir / "minilm_expected.npz")
    ids = tmp_path / "ids.npz"
    np.savez(ids, ids=exp["ids"], mask=exp["mask"], token_type=exp["token_type"])
    emb, hid = tmp_path / "emb.npy", tmp_path / "hid.npy"
    assert hepti("run", "--model", minilm_dir, "--input-ids", ids, "--normalize", "--output", emb)[0] == 0
    assert hepti("run", "--model", minilm_dir, "--input-ids", ids, "--pool", "none", "--output", hid)[0] == 0
    m = exp["mask"].astype(bool)
    assert np.abs(np.load(emb) - exp["mean_normalized"]).max() <= 1e-4
    assert np.abs(np.load(hid)[m] - exp["hidden"][m]).max() <= 1e-3


def test_run_texts_match_pytorch_fixture(minilm_dir, fixtures_dir, tmp_path):
    """Texts through hepti's tokenizer give transformers' embeddings."""
    exp = np.load(fixtures_dir / "minilm_expected.npz")
    emb = tmp_path / "emb.npy"
    code, _, err = hepti("run", "--model", minilm_dir, "--text", *[str(t) for t in exp["texts"]],
                         "--normalize", "--output", emb)
    assert code == 0, err
    assert np.abs(np.load(emb) - exp["mean_normalized"]).max() <= 1e-4


@pytest.mark.parametrize("module", ["scaling", "fit", "hetero", "offload", "against", "slowdown", "filejob"])
def test_bench_scripts_start(module):
    """Every python -m hepti.bench.X behind a bin/bench-*.sh imports and explains itself (a
    renamed helper once broke bench.fit with nothing else noticing)."""
    p = subprocess.run([sys.executable, "-m", f"hepti.bench.{module}", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "usage" in p.stdout


def test_serve_defaults_are_the_services_not_the_run_watchdogs():
    """`hepti serve`'s --stall-floor and --read-timeout default to hepti.serve's own values
    (a 4 s floor), not to `hepti run`'s watchdog floor of the same name (30 s): a refactor
    once gave serve the 30 s floor, and a silent rank then held a batch for 30 s."""
    from hepti.cli import build_parser
    from hepti.parallel import watchdog
    from hepti.serve import http, stall
    args = build_parser().parse_args(["serve", "--model", "m"])
    assert args.stall_floor == stall.STALL_FLOOR_S != watchdog.STALL_FLOOR_S
    assert args.read_timeout == http.READ_TIMEOUT_S
