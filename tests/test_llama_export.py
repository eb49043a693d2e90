"""Exporting a decoder for the peers (issue 46): the HF folder distributed-llama converts, the GGUF
llama.cpp reads, the `llama-1b` preset and its tokenizer, and bench/llm's own logic.

The oracle is the tiny random Llama GGUF that tests/fixtures/dump_smollm2.py wrote with
llama.cpp's conventions (Q/K permuted, F16 matrices), and transformers' outputs for it
(llama_tiny_expected.npz): a GGUF hepti exports must hold the same bytes where the fixture's
types allow, and a model read back from it must give transformers' logits and tokens.
"""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from helpers import FIXTURES, ROOT, hepti

gguf = pytest.importorskip("gguf")

from hepti.bench import llm  # noqa: E402
from hepti.errors import ConfigError, WeightsError  # noqa: E402
from hepti.families import config_from_dict, preset_config  # noqa: E402
from hepti.model.llama import LlamaModel  # noqa: E402
from hepti.weights.convert import write_random  # noqa: E402
from hepti.weights.decoder import load_decoder, load_tokenizer  # noqa: E402
from hepti.weights.export import export_gguf, export_hf, hf_name, permute_qk  # noqa: E402
from hepti.weights.gguf import GGUFFile, convert_gguf, unpermute_qk  # noqa: E402
from hepti.weights.source import SafetensorsFile  # noqa: E402
from hepti.weights.vocab import random_vocab  # noqa: E402

TINY_GGUF = FIXTURES / "llama-tiny-odd.gguf"
LOGIT_TOL = 1e-3  # test_llama.py's
ODD = dict(model_type="llama", vocab_size=1000, hidden_size=72, num_hidden_layers=2,
           num_attention_heads=6, num_key_value_heads=2, intermediate_size=200,
           max_position_embeddings=128, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return convert_gguf(TINY_GGUF, tmp_path_factory.mktemp("w") / "tiny", progress=False)


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("x")
    return {"hf": export_hf(tiny_dir, out / "hf"),
            "f32": export_gguf(tiny_dir, out / "tiny-f32.gguf", "f32"),
            "f16": export_gguf(tiny_dir, out / "tiny-f16.gguf", "f16")}


# --- GGUF ----------------------------------------------------------------------------------------

def test_permute_is_llama_cpps_and_inverts():
    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    p = permute_qk(w, 3)
    assert not np.array_equal(p, w)
    # llama.cpp's convert_hf_to_gguf.py, LlamaModel.permute, written out
    ref = w.reshape(3, 2, 4, 5).swapaxes(1, 2).reshape(24, 5)
    np.testing.assert_array_equal(p, ref)
    np.testing.assert_array_equal(unpermute_qk(p, 3), w)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_exported_gguf_holds_the_fixtures_values(exported, dtype):
    """Tensor by tensor, the export's raw data (Q/K in llama.cpp's permuted order) equals the
    fixture's, widened to f32 or, in f16, as the fixture stored its F16 matrices."""
    ours = gguf.GGUFReader(str(exported[dtype]))
    ref = {t.name: t for t in gguf.GGUFReader(str(TINY_GGUF)).tensors}
    assert sorted(t.name for t in ours.tensors) == sorted(ref)
    for t in ours.tensors:
        r = ref[t.name]
        assert list(t.shape) == list(r.shape), t.name
        want = np.asarray(r.data, np.float32)
        if dtype == "f16" and len(r.shape) > 1:
            assert t.tensor_type.name == "F16", t.name
            if r.tensor_type.name == "F16":
                np.testing.assert_array_equal(np.asarray(t.data), np.asarray(r.data), t.name)
            else:
                np.testing.assert_allclose(np.asarray(t.data, np.float32), want, rtol=1e-3,
                                           atol=1e-4, err_msg=t.name)
        else:
            assert t.tensor_type.name == "F32", t.name
            np.testing.assert_array_equal(np.asarray(t.data, np.float32).reshape(want.shape),
                                          want, t.name)


def test_exported_gguf_round_trips_to_transformers_outputs(exported, tiny_dir, tmp_path):
    back = convert_gguf(exported["f32"], tmp_path / "back", progress=False)
    c0, w0 = load_decoder(tiny_dir)
    c1, w1 = load_decoder(back)
    assert c1.shape == c0.shape and c1.rope_theta == c0.rope_theta
    assert c1.rms_norm_eps == pytest.approx(c0.rms_norm_eps)
    for k in w0:
        np.testing.assert_array_equal(w1[k], w0[k], k)
    tok, meta = load_tokenizer(back)
    assert meta["eos_token"] == "<|im_end|>" and meta["chat_template"]
    model = LlamaModel(c1, w1, kernels=False)  # test_llama.py covers the kernels
    z = np.load(FIXTURES / "llama_tiny_expected.npz")
    for k in range(int(z["n_prompts"])):
        ids = tok.encode(str(z[f"prompt{k}_text"])).ids
        assert ids == z[f"prompt{k}_ids"].tolist()
        first: list = []
        assert model.generate(ids, 32, logits_out=first) == z[f"prompt{k}_greedy"].tolist()
        assert np.abs(first[0] - z[f"prompt{k}_logits"]).max() < LOGIT_TOL


def test_llama_cpp_reads_the_exported_gguf_as_transformers_does(exported):
    """The peer itself on the export (bench-only llama-cpp-python; skipped without it): the
    same prompt ids from the GGUF's tokenizer and the prefill's last logits of transformers'
    fixture, within what llama.cpp's own float32 kernels leave (it sums in other orders)."""
    llama_cpp = pytest.importorskip("llama_cpp")
    llm = llama_cpp.Llama(model_path=str(exported["f32"]), n_ctx=128, n_threads=1,
                          verbose=False)
    z = np.load(FIXTURES / "llama_tiny_expected.npz")
    for k in range(int(z["n_prompts"])):
        text, ids = str(z[f"prompt{k}_text"]), z[f"prompt{k}_ids"].tolist()
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == ids
        llm.reset()
        llm.eval(ids)
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(llm.n_vocab(),))
        assert np.abs(logits - z[f"prompt{k}_logits"]).max() < 1e-2, k
        assert int(np.argmax(logits)) == int(np.argmax(z[f"prompt{k}_logits"]))


# --- Hugging Face folder -----------------------------------------------------------------------

def test_exported_hf_folder_holds_the_fixtures_tensors(exported, tiny_dir):
    """Read back through hepti's own safetensors reader: every tensor by its HF name and
    orientation equals the fixture GGUF's, un-permuted (GGUFFile.read gives HF's order)."""
    hf = exported["hf"]
    cfg = json.loads((hf / "config.json").read_text())
    c, _ = load_decoder(tiny_dir)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["hidden_act"] == "silu" and cfg["num_key_value_heads"] == 2
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5) and cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (c.bos_token_id, c.eos_token_id)
    tok_cfg = json.loads((hf / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"  # distributed-llama needs it
    assert (hf / "tokenizer.json").read_bytes() == (tiny_dir / "tokenizer.json").read_bytes()
    st = SafetensorsFile(hf / "model.safetensors")
    g = GGUFFile(TINY_GGUF)
    names = {hf_name(stored)[0]: gname for stored, gname in g.sources.items()}
    assert set(st.entries) == set(names)
    assert "lm_head.weight" not in st.entries  # tied: the converters take the embedding
    for key, gname in names.items():
        shape = st.shape(key)
        got = st.rows(key, 0, shape[0], transpose=False)
        np.testing.assert_array_equal(got, g.read(gname), key)
    assert "model.layers.1.self_attn.o_proj.weight" in st.entries
    assert st.shape("model.layers.1.mlp.down_proj.weight") == (72, 200)  # HF's [out, in]
    st.close()


def test_export_refuses_what_it_cannot_write(exported, tiny_dir, tmp_path):
    with pytest.raises(WeightsError, match="exists; give a new file name"):
        export_gguf(tiny_dir, exported["f32"])
    with pytest.raises(WeightsError, match="not an empty folder"):
        export_hf(tiny_dir, exported["hf"])
    with pytest.raises(WeightsError, match="choose one of f32, f16, q8_0"):
        export_gguf(tiny_dir, tmp_path / "x.gguf", "q4_0")
    with pytest.raises(WeightsError, match="hidden_size 72, intermediate_size 200, heads x "
                                           "head_dim 72 are not multiples of 32"):
        export_gguf(tiny_dir, tmp_path / "x.gguf", "q8_0")  # the fixture's odd widths
    assert not (tmp_path / "x.gguf").exists()
    bert = write_random(preset_config("tiny-odd"), tmp_path / "bert", progress=False)
    with pytest.raises(WeightsError, match="take a Llama decoder"):
        export_hf(bert, tmp_path / "hf")


# --- llama-1b and the random decoders' tokenizer -------------------------------------------------

def test_llama_1b_preset_is_the_issues_shape():
    c = preset_config("llama-1b")
    assert c.shape == {"layers": 16, "hidden": 2048, "heads": 32, "kv_heads": 8, "ffn": 8192,
                       "vocab": 32000}
    assert (c.head_dim, c.tie_word_embeddings, c.bos_token_id, c.eos_token_id) == (64, True, 1, 2)
    tokens, merges, types = random_vocab(c.vocab_size)
    assert len(tokens) == len(set(tokens)) == len(types) == 32000
    assert tokens[:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] and types[:4] == [3, 3, 3, 1]
    with pytest.raises(ConfigError, match="at least 961"):
        random_vocab(900)


def test_random_decoder_round_trips_with_its_tokenizer(tmp_path):
    """A random decoder (odd shape) exported and read back: same weights, same token ids,
    finite logits of a sensible spread."""
    cfg = config_from_dict(ODD, name="odd")
    src = write_random(cfg, tmp_path / "odd", seed=3, progress=False)
    f = export_gguf(src, tmp_path / "odd.gguf")
    back = convert_gguf(f, tmp_path / "back", progress=False)
    (c0, w0), (c1, w1) = load_decoder(src), load_decoder(back)
    assert c1.vocab_size == 1000
    for k in w0:
        np.testing.assert_array_equal(w1[k], w0[k], k)
    text = "<|im_start|>user\nThe cat sat on 12 mats, naïvely.<|im_end|>"
    t0, t1 = load_tokenizer(src)[0], load_tokenizer(back)[0]
    ids = t0.encode(text).ids
    assert ids == t1.encode(text).ids and ids[0] == 1 and ids[-1] == 2
    assert t0.decode(ids, skip_special_tokens=False) == text
    model = LlamaModel(c0, w0, kernels=False)
    logits = model.prefill(ids, model.new_cache(64))
    assert np.isfinite(logits).all() and 0.05 < float(logits.std()) < 5


def test_q8_0_export_is_llama_cpps_blocks_of_the_same_weights(tmp_path):
    """--gguf-type q8_0 (llama.cpp's Q8_0 against hepti's int8, issue 46): the matrices are the
    gguf package's own Q8_0 quantisation of the folder's float32 weights (Q/K permuted), the
    norms F32, and the tokenizer's metadata (pre-tokenizer, chat template) carried over; read
    back by hepti, each weight is within half a Q8_0 step (and its scale's float16 rounding)
    of the original."""
    cfg = config_from_dict(dict(ODD, hidden_size=64, num_attention_heads=4, intermediate_size=96),
                           name="q8")
    src = write_random(cfg, tmp_path / "q8", seed=5, progress=False)
    f = export_gguf(src, tmp_path / "q8.gguf", "q8_0")
    f32 = {t.name: t for t in gguf.GGUFReader(str(export_gguf(src, tmp_path / "f32.gguf")))
           .tensors}
    r = gguf.GGUFReader(str(f))
    assert int(r.fields["general.file_type"].parts[-1][0]) == 7  # LLAMA_FTYPE_MOSTLY_Q8_0
    pre = r.fields["tokenizer.ggml.pre"]
    assert bytes(pre.parts[pre.data[0]]).decode() == json.loads(
        (src / "tokenizer_config.json").read_text()).get("tokenizer_pre", "default")
    for t in r.tensors:
        want = np.asarray(f32[t.name].data, np.float32)
        if len(t.shape) == 1:
            assert t.tensor_type.name == "F32", t.name
            continue
        assert t.tensor_type.name == "Q8_0", t.name
        expect = gguf.quants.quantize(want, gguf.GGMLQuantizationType.Q8_0)
        np.testing.assert_array_equal(np.asarray(t.data), expect, t.name)
    back = convert_gguf(f, tmp_path / "back", progress=False)
    (_, w0), (_, w1) = load_decoder(src), load_decoder(back)
    for k in w0:
        step = np.abs(w0[k]).max() / 127  # a bound on every block's step
        # half a step, and the block's scale rounded to float16 (2^-11 relative) times 127
        assert np.abs(w1[k] - w0[k]).max() <= step * (0.5 + 127 / 2048) + 1e-7, k
    assert load_tokenizer(back)[1].get("chat_template") == load_tokenizer(src)[1].get(
        "chat_template")


def test_convert_cli_exports_and_refuses_taken_targets(tmp_path):
    cfgfile = tmp_path / "odd.json"
    cfgfile.write_text(json.dumps(ODD))
    base = ["convert", "--random", cfgfile]
    code, _, err = hepti(*base, "--out", tmp_path / "m", "--export-hf", tmp_path / "hf",
                         "--export-gguf", tmp_path / "m.gguf", "--gguf-type", "f16", cwd=ROOT)
    assert code == 0, err
    assert (tmp_path / "hf" / "model.safetensors").is_file()
    assert GGUFFile(tmp_path / "m.gguf").config.hidden_size == 72
    code, _, err = hepti(*base, "--out", tmp_path / "m2", "--export-gguf", tmp_path / "m.gguf", cwd=ROOT)
    assert code != 0 and "Traceback" not in err
    assert "m.gguf exists" in err and not (tmp_path / "m2").exists()


# --- bench/llm: what it decides before launching anything ---------------------------------------

def test_bench_llm_variants_and_dllama_limits():
    v = llm.parse_variants("dllama:2, llamacpp:1,hepti:auto:4")
    assert [x["kind"] for x in v] == ["dllama", "llamacpp", "hepti"]
    assert (v[0]["nodes"], v[1]["threads"], v[2]["strategy"], v[2]["nodes"]) == (2, 1, "auto", 4)
    assert not v[2]["quota"] and llm.parse_variants("hepti:auto:2:quota")[0]["quota"]
    for bad in ("dllama", "hepti:auto:2:fast"):
        with pytest.raises(ConfigError, match="not dllama:N"):
            llm.parse_variants(bad)
    big = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2048,
           "intermediate_size": 8192}
    for n in (1, 2, 4, 8):
        llm.check_dllama_nodes(n, big)
    with pytest.raises(ConfigError, match="2\\^n nodes"):
        llm.check_dllama_nodes(3, big)
    with pytest.raises(ConfigError, match="divide"):
        llm.check_dllama_nodes(16, big)
    with pytest.raises(ConfigError, match="multiples of 8"):
        llm.check_dllama_nodes(2, dict(big, num_attention_heads=6, num_key_value_heads=2,
                                       hidden_size=72, intermediate_size=200))
    with pytest.raises(ConfigError, match="--dllama PATH"):
        llm.dllama_paths(None)


def test_bench_llm_reads_the_reports():
    text = ("🔶 Pred    0 ms Sync    0 ms | x\n\nEvaluation\n   nBatches: 32\n    nTokens: 21\n"
            "   tokens/s: 472.22 (2.12 ms/tok)\nPrediction\n    nTokens: 11\n"
            "   tokens/s: 50.50 (0.02 ms/tok)\n")
    text = "⭕ Socket[0]: connecting to 10.213.0.11:9990 worker\n" + text
    assert llm.parse_dllama(text) == {"status": "ok", "workers": ["10.213.0.11:9990"],
                                      "prompt_tokens": 22, "decode_tokens": 11,
                                      "prefill_tok_s": 472.22, "decode_tok_s": 50.5}
    assert llm.parse_dllama("🚨 Critical error: x")["status"] == "failed"
    report = {"prompt_ids": [1, 2], "token_ids": [3, 4, 5], "prefill_tokens_per_s": 10.0,
              "decode_tokens_per_s": 4.0}  # hepti.generate.finish's keys
    assert llm.hepti_rates(report) == {"status": "ok", "prompt_tokens": 2, "decode_tokens": 2,
                                       "prefill_tok_s": 10.0, "decode_tok_s": 4.0}
    assert llm.hepti_rates(dict(report, decode_tokens_per_s=None))["status"] == "failed"
    ok = {"status": "ok"}
    s = llm.summarise({"a": [dict(ok, decode_tok_s=2.0, prefill_tok_s=8.0),
                             dict(ok, decode_tok_s=4.0, prefill_tok_s=6.0),
                             {"status": "failed", "reason": "x"}],
                       "b": [dict(ok, decode_tok_s=1.0, prefill_tok_s=2.0),
                             dict(ok, decode_tok_s=1.0, prefill_tok_s=2.0)]}, "b")
    assert s["baseline"] == "b"
    assert s["decode_tok_s"]["a"]["median"] == 3.0 and s["decode_tok_s"]["a"]["runs"] == 2
    assert s["decode_tok_s"]["a"]["ratio"] == 3.0 and s["prefill_tok_s"]["a"]["ratio"] == 3.5
    assert llm.summarise({"a": [{"status": "failed", "reason": "x"}]}, None)[
        "decode_tok_s"] == {"a": {"median": None, "runs": 0}}


def test_bench_llm_checks_llama_cpp_and_hepti_read_the_same_prompt():
    """llama.cpp and hepti share the GGUF's tokenizer, so their prompt lengths must agree;
    distributed-llama's own tokenizer may split the prompt otherwise and is left out."""
    by_name = {v["name"]: v for v in llm.parse_variants("llamacpp:1,hepti:single:1,dllama:1")}
    ok = {"status": "ok"}
    results = {"llamacpp:1": [dict(ok, prompt_tokens=28)],
               "hepti:single:1": [dict(ok, prompt_tokens=28), {"status": "failed"}],
               "dllama:1": [dict(ok, prompt_tokens=31)]}
    counts = llm.prompt_counts(results)
    assert counts == {"llamacpp:1": [28], "hepti:single:1": [28], "dllama:1": [31]}
    assert llm.same_prompt(counts, by_name)
    assert not llm.same_prompt(dict(counts, **{"llamacpp:1": [29]}), by_name)


FAKE_DLLAMA = '''#!{python}
"""A stand-in for distributed-llama's dllama: a worker listens; the root connects to each."""
import socket, sys, time
a = sys.argv
if a[1] == "worker":
    if "{worker}" == "dies":
        sys.exit("worker: cannot bind")
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((a[a.index("--host") + 1], int(a[a.index("--port") + 1])))  # the wrapper's --host
    s.listen()
    s.accept()
    time.sleep(600)
workers = a[a.index("--workers") + 1:] if "--workers" in a else []
for w in workers:
    print(f"Socket[0]: connecting to {{w}} worker")
    socket.create_connection((w.split(":")[0], int(w.split(":")[1])), timeout=5).close()
print("Evaluation\\n   nBatches: 32\\n    nTokens: 5\\n   tokens/s: 10.0 (1 ms/tok)\\n"
      "Prediction\\n    nTokens: 3\\n   tokens/s: 5.0 (1 ms/tok)")
'''


@pytest.mark.parametrize("worker", ["listens", "dies"])
def test_bench_llm_rank_wrapper_starts_root_and_workers(tmp_path, worker):
    """Under mpiexec, rank 0 runs the root once every worker listens, the workers end when it
    is done; a worker that fails ends the whole launch with its rank's message, never a hang."""
    from hepti.bench.harness import mpiexec
    fake = tmp_path / "dllama"
    fake.write_text(FAKE_DLLAMA.format(python=sys.executable, worker=worker))
    fake.chmod(0o755)
    with __import__("socket").socket() as s:  # a free port (and the next one, rank 1's)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [mpiexec(), "-n", "2", sys.executable, "-m", "hepti.bench.llm", "rank",
           "--rendezvous", str(tmp_path), "--port", str(port), "--", str(fake), "inference",
           "--nthreads", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    if worker == "dies":
        assert p.returncode != 0
        assert "rank 1: distributed-llama's worker did not listen" in p.stderr + p.stdout
        return
    assert p.returncode == 0, p.stderr
    res = llm.parse_dllama(p.stdout)
    assert res["status"] == "ok" and res["workers"] == [f"127.0.0.1:{port + 1}"]
    assert res["decode_tok_s"] == 5.0 and (tmp_path / "done").exists()
