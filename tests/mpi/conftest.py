"""Distributed tests: every rank runs the same tests in the same order (mpiexec -n 2 ...
python -m mpi4py -m pytest). Only rank 0 reports; verdicts are reduced across ranks first
(`all_ok`), so every rank passes or fails together and none is left waiting in a collective.
An exception outside a collective assertion aborts the job through `python -m mpi4py`."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from helpers import (FIXTURES, ROOT, convert_mobilenet, convert_once, convert_tiny_cnn,  # noqa: E402
                     minilm_source)
from mpi_helpers import COMM, remove_shared, shared_dir  # noqa: E402


@pytest.hookimpl(trylast=True)  # after the terminal plugin has registered its reporter
def pytest_configure(config):
    if COMM.Get_rank() != 0:
        rep = config.pluginmanager.getplugin("terminalreporter")
        if rep is not None:
            config.pluginmanager.unregister(rep)


def pytest_sessionfinish(session, exitstatus):
    remove_shared()  # the converted copies below: one per session, made on rank 0, seen by all


@pytest.fixture(scope="session")
def tiny_dir():
    out = shared_dir("tiny-odd")
    if COMM.Get_rank() == 0:
        convert_once(FIXTURES / "tiny-odd", out)
    COMM.Barrier()
    return out


@pytest.fixture(scope="session")
def vit_dir():
    out = shared_dir("vit-tiny-odd")
    if COMM.Get_rank() == 0:
        convert_once(FIXTURES / "vit-tiny-odd", out)
    COMM.Barrier()
    return out


@pytest.fixture(scope="session")
def minilm_dir():
    made = ROOT / "weights" / "minilm-l6"
    if (made / "index.json").exists():
        return made
    out = shared_dir("minilm")
    if COMM.Get_rank() == 0:
        convert_once(minilm_source(), out)
    COMM.Barrier()
    return out


def _cnn_dir(name: str, make):
    out = shared_dir(name)
    if COMM.Get_rank() == 0:
        make(out)
    COMM.Barrier()
    return out


@pytest.fixture(scope="session")
def resnet_tiny_dir():
    return _cnn_dir("resnet50-tiny", lambda out: convert_tiny_cnn("resnet50_tiny", out))


@pytest.fixture(scope="session")
def vgg_tiny_dir():
    return _cnn_dir("vgg16-tiny", lambda out: convert_tiny_cnn("vgg16_tiny", out))


@pytest.fixture(scope="session")
def mobilenet_dir():
    return _cnn_dir("mobilenet-v2", convert_mobilenet)


def pytest_collection_modifyitems(session, config, items):
    """test_memory.py first: it measures how much RSS a batch adds, and in a process that had
    run the CNN band tests before it (test_cnn_bands.py, many feature maps allocated and freed)
    a `tensor` batch of the wide test model grew RSS by 0.0-0.1 MiB against 20 predicted: the
    memory was already resident. The sort is stable and the same on every rank, so the
    collective tests stay in step."""
    items.sort(key=lambda item: 0 if item.path.name == "test_memory.py" else 1)


@pytest.fixture(scope="session")
def llama_tiny_dir():
    """The odd-shaped decoder fixture (tests/fixtures/llama-tiny-odd.gguf), converted once."""
    return _tiny_decoder("llama-tiny-odd")


@pytest.fixture(scope="session")
def llama_tiny_int8_dir():
    """The same decoder stored int8 (`hepti convert --dtype int8`), converted once."""
    return _tiny_decoder("llama-tiny-odd-int8", dtype="int8")


@pytest.fixture(scope="session")
def llama_tiny_mixed_dir():
    """The same decoder int8 but two matrices float32 (`--keep-float32`), converted once."""
    return _tiny_decoder("llama-tiny-odd-mixed", dtype="int8",
                         keep_float32=("layer.1.ffn.down.weight", "layer.0.attn.o.weight"))


def _tiny_decoder(name: str, **kw) -> Path:
    from hepti.weights.gguf import convert_gguf  # local: as the tests' own imports, after sys.path
    out = shared_dir(name)
    if COMM.Get_rank() == 0 and not (out / "index.json").exists():
        convert_gguf(FIXTURES / "llama-tiny-odd.gguf", out, progress=False, **kw)
    COMM.Barrier()
    return out


@pytest.fixture(scope="module")
def traced_comm():
    """A hepti Comm over the world with a tracer (the decoder tests count its verbs)."""
    from hepti.parallel.comm import Comm  # local: as the tests' own imports, after sys.path
    from hepti.parallel.trace import Tracer
    c = Comm(COMM, Tracer(COMM.Get_rank()))
    yield c
    c.close()

