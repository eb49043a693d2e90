"""The single-device engine against PyTorch/transformers outputs (dumped by
tests/fixtures/make_fixtures.py), and the numpy reference against the same."""
from __future__ import annotations

import numpy as np
import pytest

from helpers import load_all
from hepti.parallel.single import BertEncoder
from hepti.model.pooling import pool
from hepti.model.reference import reference_forward
from hepti.weights import WeightStore


def real(h, mask):
    """Hidden states at real tokens only (padding rows are unconstrained)."""
    return h[mask.astype(bool)]


@pytest.fixture(scope="module")
def tiny_expected(fixtures_dir):
    return dict(np.load(fixtures_dir / "tiny_odd_expected.npz"))


@pytest.fixture(scope="module")
def minilm_expected(fixtures_dir):
    return dict(np.load(fixtures_dir / "minilm_expected.npz"))


@pytest.mark.parametrize("which", ["tiny", "minilm"])
def test_reference_matches_torch(which, tiny_dir, minilm_dir, tiny_expected, minilm_expected):
    d, exp = (tiny_dir, tiny_expected) if which == "tiny" else (minilm_dir, minilm_expected)
    cfg = WeightStore(d).config
    h = reference_forward(load_all(d), cfg, exp["ids"], exp["mask"], exp["token_type"])
    assert np.abs(real(h, exp["mask"]) - real(exp["hidden"], exp["mask"])).max() <= 1e-4


@pytest.mark.parametrize("which", ["tiny", "minilm"])
@pytest.mark.parametrize("threads", [1, 2])
def test_engine_matches_torch(which, threads, tiny_dir, minilm_dir, tiny_expected, minilm_expected):
    d, exp = (tiny_dir, tiny_expected) if which == "tiny" else (minilm_dir, minilm_expected)
    eng = BertEncoder.from_store(WeightStore(d), threads=threads)
    h = eng.forward(exp["ids"], exp["mask"], exp["token_type"])
    assert h.shape == exp["hidden"].shape and h.dtype == np.float32
    assert np.abs(real(h, exp["mask"]) - real(exp["hidden"], exp["mask"])).max() <= 1e-3
    emb = pool(h, exp["mask"], "mean", normalize=True)
    assert np.abs(emb - exp["mean_normalized"]).max() <= 1e-4
    cls = pool(h, exp["mask"], "cls")
    assert np.abs(cls - exp["cls"]).max() <= 1e-3


def test_an_engine_built_for_two_threads_runs_one_thread_fused(tiny_dir, tiny_expected):
    """`threads` set to 1 on an engine built for 2 (how `hepti bench model --threads 2` times
    its 1-thread forward) runs the one-thread engine's fused layer calls (K.EncoderLayer, made
    on first use), not the op-by-op path of 2 threads: the speedup it reports is over hepti's
    own best on one thread. Bit-equal to a 1-thread engine's output."""
    two = BertEncoder.from_store(WeightStore(tiny_dir), threads=2)
    executor = two.engine.executor
    h2 = two.forward(tiny_expected["ids"], tiny_expected["mask"], tiny_expected["token_type"])
    assert not executor._layer_calls  # two threads: no fused layer call made
    executor.threads = 1
    h1 = two.forward(tiny_expected["ids"], tiny_expected["mask"], tiny_expected["token_type"])
    assert executor._layer_calls  # one thread: the fused layers ran
    ref = BertEncoder.from_store(WeightStore(tiny_dir), threads=1).forward(
        tiny_expected["ids"], tiny_expected["mask"], tiny_expected["token_type"])
    np.testing.assert_array_equal(h1, ref)
    assert np.abs(h2 - ref).max() <= 1e-4


@pytest.mark.parametrize("variant", ["tiny-odd-sharded", "tiny-odd-mlm"])
def test_checkpoint_variants_convert_alike(variant, fixtures_dir, tiny_dir, tmp_path, tiny_expected):
    """Sharded safetensors without a pooler, and a BertForMaskedLM checkpoint (bert. prefix,
    cls.* heads), give the same encoder as the plain single-file checkpoint."""
    from hepti.weights import convert_checkpoint
    out = convert_checkpoint(fixtures_dir / variant, tmp_path / variant, progress=False)
    h = BertEncoder.from_store(WeightStore(out)).forward(tiny_expected["ids"], tiny_expected["mask"])
    assert np.abs(real(h, tiny_expected["mask"]) - real(tiny_expected["hidden"], tiny_expected["mask"])).max() <= 1e-3


def test_tokenizer_matches_fixture(minilm_dir, minilm_expected):
    from hepti.model.tokenize import TextTokenizer
    tok = TextTokenizer(minilm_dir / "tokenizer.json", 512)
    ids, mask, tt = tok.encode([str(t) for t in minilm_expected["texts"]])
    assert np.array_equal(ids, minilm_expected["ids"])
    assert np.array_equal(mask, minilm_expected["mask"])


def test_long_input_truncated_with_warning(minilm_dir, caplog):
    """Inputs are counted in tokens before any work: one warning for all that are too long."""
    from hepti.inputs import InputSource
    from hepti.model.tokenize import TextTokenizer
    tok = TextTokenizer(minilm_dir / "tokenizer.json", 16)
    src = InputSource.from_texts(["word " * 40, "short", "word " * 30], tok, 2, None, 0)
    assert "2 input(s) longer than 16 tokens will be truncated (first: input 0)" in caplog.text
    assert src.lengths == [16, 16]
    b = src.batch(0)
    assert b.ids.shape == (2, 16) and b.mask[1].sum() < 16


def test_pooling_ignores_padding():
    h = np.arange(2 * 3 * 2, dtype=np.float32).reshape(2, 3, 2)
    m = np.array([[1, 1, 0], [1, 0, 0]])
    assert np.allclose(pool(h, m, "mean"), [[1, 2], [6, 7]])
    assert np.allclose(pool(h, m, "cls"), [[0, 1], [6, 7]])
    n = pool(h, m, "mean", normalize=True)
    assert np.allclose(np.linalg.norm(n, axis=1), 1)


def test_padding_does_not_change_real_tokens(tiny_dir):
    """The same sentence alone and padded inside a batch gives the same hidden states."""
    eng = BertEncoder.from_store(WeightStore(tiny_dir))
    ids = np.array([[5, 17, 300, 9, 0, 0], [5, 6, 7, 8, 9, 10]])
    mask = (np.arange(6) < np.array([[4], [6]])).astype(np.int64)
    both = eng.forward(ids, mask)
    alone = eng.forward(ids[:1, :4], mask[:1, :4])
    assert np.abs(both[0, :4] - alone[0]).max() <= 1e-5
