"""The decoder across ranks by whole layers: `pipeline` (PipeEdge's split; issue 46).

Each rank holds a contiguous range of layers, in rank order (`--layers 20,10`, or a ratio vector
by largest remainder, `hepti.counts`), all of their heads and MLP columns, and its layers' KV
cache; a rank of 0 layers is skipped. Rank 0 also holds the embedding, the final RMSNorm and
the tied LM head: the head *is* the embedding, so keeping both ends on rank 0 holds one copy
of the largest matrix (49,152 x 576 for SmolLM2, a fifth of the model), where a head on the last
stage would need a second; the price is one more hop of C floats a token (the last row back
to rank 0), a few KiB.

One forward of T tokens (a prefill's prompt, or a decode step's one token):

    rank 0: embed [T, C] (and its own layers) -> next stage: its layers -> ... -> last stage
    last stage -> rank 0: the last row [1, C]; rank 0: final norm, head, the token's choice
    rank 0 -> every rank of the group: the chosen token (a Bcast of one int64)

The hops are point-to-point sends whose shapes both sides know (`Comm.send_known`, and the
matching receive posted then waited, `post_recv` / `complete_recv`), in the order
`hepti.plan.decoder.pipeline_hops` lists them (tests/mpi/test_decoder_agreement.py holds the
two equal). The token goes to every rank, those off the path included, so that every rank
leaves the loop at the same token and sees each one (`on_token`: serve's decoder workers
broadcast their stop-or-go in it, on every rank). Rank 0 has the whole vocabulary's logits, so
the choice is a `TokenChooser` on a group of one: greedy, sampling and top-p are the same code,
and the seed's draws the same, as on one process.

Each stage is a `LlamaModel` of the whole config (hepti.model.llama), with the rows of the
layers it does not hold empty (0-row arrays: nothing read, nothing packed) and only its own
layers' K and V allocated; it runs its layers with `LlamaModel.layer` and no sync, as one
device runs them, so the layer forward is the one `tensor` and `single` run. Nothing is
pipelined across tokens: decode is sequential (each token needs the one before), so one
token's latency is every stage's compute plus the hops. It pays where memory or links are
short, not for speed: a rank holds only its layers (weights and cache), and a token crosses
each link once (a few KiB) where `tensor` syncs 1 + 2L times (docs/generate.md).
"""
from __future__ import annotations

import numpy as np

from hepti.counts import counts, offsets
from hepti.errors import InputError
from hepti.model.llama import KVCache, LlamaModel, Shard, checked_ids, no_sync
from hepti.parallel.comm import Comm
from hepti.parallel.decoder import DecoderGroup, Sampling, TokenChooser
from hepti.plan.decoder import pipeline_path
from hepti.weights import layout
from hepti.weights.decoder import ShardWeights, arrays_mapped, expected_shapes

ENDS = ("emb.word", "head.weight", "final_ln.gamma")  # rank 0's: the embedding and the head
HOP_TAG = 0  # the hops' messages (each pair of ranks sees them in the order they are sent)


def layer_counts(n_layers: int, text: str, world_size: int) -> list[int]:
    """`--layers`: one whole number of layers per rank (0 skips a rank) adding up to the
    model's `n_layers`."""
    try:
        got = [int(x) for x in text.split(",")]
    except ValueError:
        raise InputError(f"--layers {text!r}: give whole numbers of layers separated by commas, "
                         "one per rank (e.g. 20,10)") from None
    if len(got) != world_size:
        raise InputError(f"--layers {text}: {len(got)} entries but there are {world_size} "
                         "ranks; give one per rank")
    if min(got) < 0 or sum(got) != n_layers:
        raise InputError(f"--layers {text}: the model has {n_layers} layers; give numbers of 0 "
                         f"or more that add up to {n_layers}")
    return got


def layers_from_ratios(n_layers: int, ratios: list[float]) -> list[int]:
    """Layers per rank from a share vector, by largest remainder (`hepti.counts`)."""
    return counts(n_layers, ratios)


def read_stage(store, layers: tuple[int, int], rank0: bool) -> dict:
    """What a stage reads from the HDF5 shards: its layers' tensors whole, the embedding, final
    norm and (untied) head on rank 0; every other tensor as 0 rows, which reads nothing."""
    out = ShardWeights()  # trims the heap as the model takes a layer's tensors
    for name in expected_shapes(store.config):
        i, _ = layout.local_name(name)
        held = layers[0] <= i < layers[1] if i is not None else rank0 and name in ENDS
        out[name] = store.read(name, None if held else (0, 0))
    return out


class StageModel(LlamaModel):
    """One rank's stage (module docstring): `forward` runs layers [a, b) of a token's way
    through the group's path, so `LlamaModel`'s prefill, decode and generate run it as they
    stand."""

    def __init__(self, comm: Comm, config, weights: dict, layers: list[int],
                 kernels: bool = True):
        rank0 = comm.rank == 0
        shard = Shard((0, config.num_key_value_heads), (0, config.intermediate_size),
                      (0, config.vocab_size if rank0 else 0))
        super().__init__(config, weights, kernels=kernels, shard=shard, consume=True)
        self.comm = comm
        first = offsets(layers)
        self.held = (first[comm.rank], first[comm.rank] + layers[comm.rank])
        self.layer_counts = list(layers)
        self.path = pipeline_path(layers)

    def new_cache(self, ctx: int | None = None) -> KVCache:
        """K and V for this stage's layers only (the others hold 0 heads: no memory)."""
        cache = KVCache(self.config, ctx or self.config.max_position_embeddings, kv_heads=0)
        shape = (self.n_kv, cache.ctx, self.config.head_dim)
        for i in range(*self.held):
            cache.k[i], cache.v[i] = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        return cache

    def forward(self, ids, cache: KVCache, all_logits: bool = False, sync=None) -> np.ndarray:
        """Tokens `ids` [T] after the cache's n, through the path (module docstring); every
        rank of the group calls it. The logits of the last position [V] on rank 0 (every
        position's [T, V] with all_logits), an empty array elsewhere. `sync` is not used: a
        stage holds whole layers."""
        c, r = self.config, self.comm.rank
        ids = checked_ids(ids, c.vocab_size)
        T, p0 = ids.shape[0], cache.n
        cache.check_room(T)
        path, last_stage = self.path, self.path[-1]
        back = T if all_logits else 1  # rows the last stage sends back to rank 0
        x = None
        if r == 0:
            x = self.embed(ids)
        elif r in path:
            x = self._recv(path[path.index(r) - 1], T)
        if self.held[1] > self.held[0]:
            cos, sin = cache.rope(p0, T)
            for i in range(*self.held):
                x = self.layer(x, i, cache, p0, cos, sin, no_sync)
        cache.n = p0 + T
        if r in path and r != last_stage:
            self.comm.send_known(x, path[path.index(r) + 1], HOP_TAG, name="Send(hidden)")
        elif r == last_stage and r != 0:
            self.comm.send_known(x[T - back:], 0, HOP_TAG, name="Send(hidden)")
        if r != 0:
            return np.empty((T, 0) if all_logits else 0, np.float32)
        last = self._recv(last_stage, back) if last_stage != 0 else x[T - back:]
        logits = self._mm(self._norm(last, self.final_gamma), self.head)
        return logits if all_logits else logits[0]

    def _recv(self, source: int, rows: int) -> np.ndarray:
        buf = np.empty((rows, self.config.hidden_size), np.float32)
        self.comm.complete_recv(self.comm.post_recv(buf, source, HOP_TAG), name="Recv(hidden)")
        return buf


class PipelineGroup(DecoderGroup):
    """This rank's stage of a decoder split by layers over `comm` (module docstring), with
    DecoderGroup's interface (`generate`, `warm_up`, `gather_logits`, ...), so `hepti
    generate` and serve's workers run it as they run `tensor`. `layers[i]`: rank i's layers."""

    def __init__(self, comm: Comm, store, layers: list[int], kernels: bool = True):
        self.comm, self.config = comm, store.config
        L = self.config.num_hidden_layers
        if len(layers) != comm.size or min(layers) < 0 or sum(layers) != L:
            raise InputError(f"layers {layers} for a group of {comm.size} ranks and a model of "
                             f"{L} layers; give one count per rank, adding up to {L}")
        self.layers = list(layers)
        first = offsets(self.layers)[comm.rank]
        with arrays_mapped():  # as DecoderGroup: each layer's stored arrays freed as packed
            weights = read_stage(store, (first, first + layers[comm.rank]), comm.rank == 0)
            self.weight_bytes = sum(int(w.nbytes) for w in weights.values())
            self.model = StageModel(comm, self.config, weights, self.layers, kernels=kernels)
        self.shard = self.model.shard
        self.sync = None  # a stage's layers are whole: nothing to sum

    def chooser(self, sampling: Sampling):
        """Rank 0 chooses from the whole vocabulary's logits, alone; the token goes to every
        rank (a Bcast of one int64)."""
        alone = TokenChooser(Comm(None), 0, sampling) if self.comm.rank == 0 else None

        def choose(logits: np.ndarray) -> int:
            tok = np.array([alone(logits)], np.int64) if alone is not None else None
            return int(self.comm.bcast_to_all(tok, (1,), np.int64)[0])
        return choose

    def gather_logits(self, local: np.ndarray) -> np.ndarray | None:
        """The whole logits [V] on rank 0, where they already are (None elsewhere)."""
        return local if self.comm.rank == 0 else None

    def kv_cache_bytes(self, ctx: int) -> int:
        """This stage's layers' K and V for `ctx` tokens, every KV head."""
        c = self.config
        return KVCache.bytes_for(c, ctx, c.num_key_value_heads) * self.layers[self.comm.rank] \
            // c.num_hidden_layers

