"""Converted weights: convert (HF safetensors -> sharded HDF5), the slice-reading store, verify.

Layout and names: `hepti.weights.layout`; index.json schema: `hepti.weights.index`.
"""
from hepti.weights.convert import (DEFAULT_MODEL_PACKAGE, convert_checkpoint, convert_package,
                                   find_package_model, write_random)
from hepti.weights.store import WeightStore
from hepti.weights.verify import verify

__all__ = ["DEFAULT_MODEL_PACKAGE", "WeightStore", "convert_checkpoint", "convert_package",
           "find_package_model", "verify", "write_random"]
