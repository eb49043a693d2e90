"""Opening an operator DAG (hepti.graph.opdag.OpDag) from a path or a model config: an .onnx
file (hepti.graph.onnx_import), a stored .json graph, or a model folder's config.json (a CNN, BERT
or ViT, built by hepti.graph.cnn and hepti.graph.encoder).

It sits above the builders, which sit above the OpDag type, so that none of them imports another
in a circle; it asks the family registry (hepti.families, in the model layer, and so is this
module) what a model folder's config is.
"""
from __future__ import annotations

import gzip
import json
from pathlib import Path

from hepti.errors import GraphError
from hepti.families import config_from_json, family, family_graph
from hepti.graph.onnx_import import import_onnx
from hepti.graph.opdag import OpDag, from_cnn, from_encoder


def load_graph(path: str | Path, batch: int | None = None,
               input_shape: tuple[int, ...] | None = None) -> OpDag:
    """An OpDag from an .onnx file, a .json graph (`hepti graph import --out`), or a converted
    hepti model folder (its config.json: a CNN, BERT or ViT). `batch` defaults to 1;
    `input_shape` is one sample's shape without the batch (ONNX: the input's dims after the
    first, e.g. 3x299x299; a CNN: 3xHxW; BERT: the tokens T)."""
    p = Path(path)
    if not p.exists():
        raise GraphError(f"{p}: no such file or folder")
    if p.is_dir():
        return _model_folder(p, batch or 1, input_shape)
    if p.suffix.lower() == ".json" or p.name.lower().endswith(".json.gz"):
        try:
            if p.suffix.lower() == ".gz":
                d = json.loads(gzip.decompress(p.read_bytes()))
            else:
                d = json.loads(p.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError, OSError, EOFError) as e:
            raise GraphError(f"{p} is not a JSON operator graph ({e})") from None
        dag = OpDag.from_dict(d, source=str(p))
        if input_shape:
            raise GraphError(f"{p}: a stored graph has fixed shapes; import the ONNX file again "
                             "with --input-shape")
        return dag.at_batch(batch) if batch else dag
    return import_onnx(p, batch=batch, input_shape=input_shape)


def _model_folder(p: Path, batch: int, input_shape) -> OpDag:
    """A checkpoint folder's config.json (a converted model's folder, whose config is inside its
    index.json, is read by the caller, which may import the weights layer: `model_graph`)."""
    if not (p / "config.json").exists():
        raise GraphError(f"{p} is a folder with neither index.json nor config.json: give a "
                         "converted hepti model folder (`hepti convert ... --out DIR`), a "
                         "checkpoint folder with config.json, an .onnx file or a .json operator "
                         "graph")
    return model_graph(config_from_json(p / "config.json"), batch, input_shape, p.name)


def model_graph(cfg, batch: int, input_shape, name: str) -> OpDag:
    """The operator DAG of a model config (a CNN, BERT or ViT) at `batch`; `input_shape` as
    `load_graph`'s."""
    fam = family(cfg)
    if fam.executor == "bands":
        h = w = cfg.image_size
        if input_shape:
            if len(input_shape) != 3 or input_shape[0] != cfg.num_channels:
                raise GraphError(f"--input-shape for a CNN is {cfg.num_channels}xHxW, got "
                                 + "x".join(map(str, input_shape)))
            h, w = input_shape[1:]
        try:
            return from_cnn(fam.graph(cfg), batch, h, w, name=name)
        except ValueError as e:
            raise GraphError(str(e)) from None
    if fam.executor != "interpreter":
        raise GraphError(f"{name}: a {fam.label} ({cfg.model_type}) has no operator graph yet")
    if "pixels" in fam.inputs:
        if input_shape:
            raise GraphError("a ViT's tokens follow from its image size; --input-shape is for "
                             "ONNX files, CNNs (3xHxW) and BERT (tokens)")
        T = cfg.seq_len
    else:
        T = input_shape[0] if input_shape else 128
        if input_shape and len(input_shape) != 1:
            raise GraphError("--input-shape for BERT is the tokens per sequence, e.g. 128")
    return from_encoder(family_graph(cfg, batch, T), name=name)
