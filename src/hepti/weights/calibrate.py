"""`--keep-float32 auto`: which `down` matrices an int8 decoder keeps float32, found by running it.

int8 in groups holds most of a decoder's matrices well (docs/generate.md, "int8 accuracy"), but
not a `down` whose input carries *massive activations*: a few channels of silu(gate) * up that
reach hundreds of times the input's RMS at a few tokens (Sun et al., "Massive Activations in
Large Language Models", 2024). Channel f's value multiplies row f of `down`, so that row's
rounding reaches the residual stream hundreds of times over, at the tokens the attention of
every later layer leans on. SmolLM2 has two such layers, and keeping them float32 is what lifts
its top-1 agreement with float32 over issue 46's 97% (docs/generate.md's table).

Which layers they are is a property of the weights, not of the text: on SmolLM2, this module's
text, Alice's first chapter and docs/architecture.md all put layers 11 and 28 at 650-840x the
RMS, and every other layer under 420x. So the converter runs the float32 model once over a short
text of its own (`calibration.txt`, prose written for this purpose, not the accuracy bench's
text) and keeps float32 every `down` whose input peaks at MASSIVE times its RMS or more.

Why the peak and not the product's error: the int8 product's relative error on the same rows
does not single these layers out (SmolLM2: 0.6-1.3% at every layer, layers 11 and 28 among the
rest), because the error that matters is where the massive value lands (the attention sinks),
not how large it is next to the row's other outputs. MASSIVE = 500 sits in the gap between the
two groups (SmolLM2: 694 and 667 above, 349 below on this text), near the order of magnitude
(~1000x the median) at which Sun et al. call an activation massive.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from hepti.model.llama import LlamaConfig, LlamaModel

MASSIVE = 500.0  # peak / RMS of down's input at which its matrix stays float32 (docstring)
TEXT = Path(__file__).with_name("calibration.txt")


def down_input_peaks(config: LlamaConfig, weights: dict, ids: list[int]) -> list[float]:
    """Per layer, max |x| / RMS(x) of `down`'s input x = silu(gate) * up over a float32 prefill
    of `ids`. `weights` (stored names, float32) is consumed: the model packs and frees them."""
    model = LlamaModel(config, weights, kernels=True, consume=True)
    layer_of = {id(model.layers[i]["down"]): i for i in range(config.num_hidden_layers)}
    peaks = [0.0] * config.num_hidden_layers
    product = model._mm

    def watched(x, w, residual=None):
        i = layer_of.get(id(w))
        if i is not None:
            rms = float(np.sqrt(np.mean(np.square(x, dtype=np.float64))))
            peaks[i] = float(np.abs(x).max()) / rms if rms > 0 else 0.0
        return product(x, w, residual=residual)

    model._mm = watched  # the one product every matrix goes through
    model.forward(ids, model.new_cache(len(ids)))
    return peaks


def massive_downs(peaks: list[float]) -> list[str]:
    """The stored names of the `down` matrices whose input peaks at MASSIVE x its RMS or more."""
    return [f"layer.{i}.ffn.down.weight" for i, p in enumerate(peaks) if p >= MASSIVE]


def calibration_ids(tokenizer, config: LlamaConfig) -> list[int]:
    """The calibration text's token ids (cut to the model's context)."""
    ids = tokenizer.encode(TEXT.read_text()).ids
    return ids[:config.max_position_embeddings]
