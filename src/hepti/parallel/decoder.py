"""The decoder across ranks (issue 46): `tensor` by KV heads, MLP columns and vocabulary rows.

Each rank holds a `Shard` of the model (hepti.model.llama), its counts from the ratio vectors by
`hepti.counts.counts` (largest remainder), zeros allowed:

- whole KV heads with the G query heads that share each (`--ratios heads=`), and the slice of
  the KV cache for them, which never leaves the rank;
- MLP columns (`ffn=`), independent of the heads: gate and up column-wise, down block-wise;
- vocabulary rows (the `ffn` vector too: like the MLP's, a column split of one GeMM that can be
  as fine as it likes), of the embedding and of the tied head.

Weights are read from the rank's own copy of the sharded HDF5, its rows only
(`hepti.weights.decoder.read_shard`). One group of one process (`Comm(None)`, or a group
`Comm.split` leaves with one rank) runs the same code: its syncs return at once.

**Syncs.** The forward (`LlamaModel.forward` / `.layer`) calls `sync` three times per step
where a partial sum must become the whole: the embedding (each rank looks up the ids in its
vocabulary rows), after attention's o projection and after the MLP's down projection (each rank
sums over its own heads or columns; the group's rank 0 adds the residual). Which collective
does the sum depends on the rows (`DecoderGroup.sync`):

- decode, one row of C floats (2.3 KiB for SmolLM2): latency-bound, so one round,
  `comm.allreduce_sum`: each rank sends its row to every peer (or writes one shared slot) and
  sums in rank order. A reduce-scatter then an allgather would be two rounds for a row that
  does not split usefully (C / N floats a rank), and per token there are 1 + 2L of these: on a
  slow link every round's latency is paid 61 times for SmolLM2.
- prefill, T rows: `reduce_scatter_rows` then `allgather_rows` over row counts from the `rows`
  ratio vector: each rank sends about 2 (N-1)/N of the array, where the one-round allreduce
  sends N-1 times it; at 3 ranks that is 1.33 against 2 arrays a sync, and prefill's arrays are
  T times larger, so bandwidth, not latency, decides. (At 2 ranks the bytes are equal and the
  allreduce's one round would win by a latency; prefill runs once a request, so we keep one
  rule.)

The allgathered rows are copied out of a shared slot ("shm" transport: a result lives only a
few verbs), since x lives through the layer.

**Choosing a token without gathering the logits** (`TokenChooser`). Each rank has the logits
of its vocabulary rows only.

- Greedy: each rank sends its best (value, index); the largest value wins, ties to the lower
  index (numpy's argmax over the whole vector does the same). One allgather of 2 floats a rank.
- Sampling over the whole vocabulary (top_p = 1): each rank sends its max and its sum of
  exp((z - max)) (z = logits / temperature): that gives the softmax's normaliser. One uniform u
  in [0, 1) per token, drawn from `numpy.random.default_rng(seed)` the same on every rank,
  picks the token whose cumulative probability, in vocabulary order, first passes u; the rank
  whose rows hold that point finds it and a second small allgather tells the others.
- Top-p: the nucleus is the smallest set of the most probable tokens (order: logit down, index
  up) whose probabilities sum to at least top_p. Each rank sends its k best (value, index) pairs
  (k = 64 first) and its max and sum; every rank merges the same candidates the same way. The
  nucleus is settled once the merged list reaches top_p at a value above every value a rank
  left unsent (the k-th value of each rank that has more); else k grows fourfold and the
  ranks send again. Then u picks within the nucleus as above.

Every decision is computed from the same gathered numbers on every rank, so the group agrees
without another message; it depends only on the logits, the order of the vocabulary and the
seed's draws, never on how the vocabulary is split, so the same seed gives the same tokens at
any number of ranks (up to the last bits of the logits, which partial sums in another order
can move: tests/mpi/decoder_check.py holds 2 and 3 ranks equal to 1 on the fixtures' prompts).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hepti.counts import counts, offsets
from hepti.errors import InputError
from hepti.model.llama import KVCache, LlamaConfig, LlamaModel, Shard
from hepti.parallel.comm import Comm
from hepti.weights.decoder import arrays_mapped, read_shard

FIRST_CANDIDATES = 64  # top-p: each rank's best (value, index) pairs in the first round
# the categories the verbs time themselves under (Tracer.seconds): a rank's communication
# (send and recv: the pipeline's hops, hepti.parallel.decoder_pipeline)
COMM_KINDS = ("allreduce", "allgather", "reduce_scatter", "allgatherv", "gatherv", "bcast",
              "send", "recv")


@dataclass(frozen=True)
class Sampling:
    """How the next token is chosen: temperature 0 is greedy; top_p in (0, 1]."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise InputError(f"--temperature {self.temperature}: give 0 (greedy) or more")
        if not 0 < self.top_p <= 1:
            raise InputError(f"--top-p {self.top_p}: give a probability in (0, 1]")


def shards(config: LlamaConfig, ratios: dict[str, list[float]]) -> list[Shard]:
    """Every rank's shard from the ratio vectors (`heads`, `ffn`; hepti.plan.planfile's
    dimensions): KV heads by `heads`, MLP columns and vocabulary rows by `ffn`, as counts by
    largest remainder. Rank 0 adds the residual."""
    ranges = {}
    for what, total, vec in (("kv", config.num_key_value_heads, ratios["heads"]),
                             ("ffn", config.intermediate_size, ratios["ffn"]),
                             ("vocab", config.vocab_size, ratios["ffn"])):
        cnt = counts(total, vec)
        ranges[what] = [(o, o + c) for o, c in zip(offsets(cnt), cnt)]
    n = len(ratios["heads"])
    return [Shard(ranges["kv"][r], ranges["ffn"][r], ranges["vocab"][r], residual=r == 0)
            for r in range(n)]


def group_members(strategy: str, layers: list[int] | None, ratios: dict | None,
                  world_size: int) -> list[bool]:
    """Which ranks of the world compute: for `tensor`, rank 0 and those with KV heads or MLP
    columns (a rank of neither would only add its link to every sync of every token: on
    emu-mixed4, the 100 Mbit/s one); rank 0 and those holding layers for `pipeline`; rank 0
    alone for `single`."""
    if world_size == 1:
        return [True]
    if strategy == "tensor":
        return [r == 0 or ratios["heads"][r] > 0 or ratios["ffn"][r] > 0
                for r in range(world_size)]
    if strategy == "pipeline":
        return [r == 0 or n > 0 for r, n in enumerate(layers)]
    return [r == 0 for r in range(world_size)]


def members_ratios(ratios: dict[str, list[float]], members: list[bool]) -> dict[str, list[float]]:
    """The members' entries of each ratio vector (a vector with nothing left: equal shares)."""
    out = {}
    for d, vec in ratios.items():
        mine = [x for x, m in zip(vec, members) if m]
        out[d] = mine if sum(mine) > 0 else [1.0 / len(mine)] * len(mine)
    return out


def join_group(world, strategy: str, layers: list[int] | None, ratios: dict | None):
    """Collective on `world`: the group that runs the decoder, and the members' shares.

    Returns (group, ratios, layers): the Comm of the ranks that compute (`group_members`), None
    on a rank left out (it computes nothing and sends nothing a token); for `tensor`, the
    members' ratio vectors (`members_ratios`); for `pipeline`, the members' layer counts.
    `hepti generate` and `hepti serve` both build their groups here."""
    members = group_members(strategy, layers, ratios, world.size)
    group = world if all(members) else world.split(members[world.rank])
    if strategy == "tensor" and not all(members):
        ratios = members_ratios(ratios, members)
    if strategy == "pipeline" and layers is not None:
        layers = [n for n, m in zip(layers, members) if m]
    return group, ratios, layers


class DecoderGroup:
    """This rank's part of a decoder split over `comm` (module docstring): its shard's weights,
    read from `store`, and the syncs and token choice that join it to the others.

    What `hepti generate` and serve's decoder workers call (`generate`, `gather_logits`,
    `warm_up`, `comm_seconds`, `kv_cache_bytes`, `weight_bytes`, `config`) is also what
    hepti.parallel.decoder_pipeline's `PipelineGroup` offers, so either runs there."""

    def __init__(self, comm: Comm, store, ratios: dict[str, list[float]], kernels: bool = True):
        self.comm = comm
        self.config = store.config
        if len(ratios["heads"]) != comm.size:
            raise InputError(f"{len(ratios['heads'])} shares for a group of {comm.size} ranks; "
                             "give one share per rank")
        self.shards = shards(self.config, ratios)  # every rank's, for the logits' Gatherv
        self.shard = self.shards[comm.rank]
        self.rows = list(ratios["rows"])
        with arrays_mapped():  # each layer's stored arrays freed as it is packed
            weights = read_shard(store, self.shard)
            self.weight_bytes = sum(int(w.nbytes) for w in weights.values())  # int8 + scales
            self.model = LlamaModel(self.config, weights, kernels=kernels, shard=self.shard,
                                    consume=True)

    def sync(self, partial: np.ndarray) -> np.ndarray:
        """Sum a partial [T, C] over the group: an allreduce for one row, a reduce-scatter over
        row shares then an allgather for more (module docstring)."""
        T = partial.shape[0]
        if self.comm.solo:
            return partial
        if T == 1:
            return self.comm.allreduce_sum(partial)
        cnt = counts(T, self.rows)
        mine = self.comm.reduce_scatter_rows(partial, cnt)  # (cnt[rank], C), summed
        return np.array(self.comm.allgather_rows(mine, cnt))  # (T, C), out of the shared slot

    def generate(self, prompt_ids, max_tokens: int, sampling: Sampling, stop_ids=(),
                 on_token=None, logits_out: list | None = None) -> list[int]:
        """Prefill and decode on every rank of the group; the same tokens come back on each."""
        # a work span: on an emulated device the stretch slows only the CPU spent inside one
        # (hepti.emulate.stretch), paid as each verb's span opens (and each token's on a group
        # of one: TokenChooser); without it a decoder ran at its guard quota, twice its share
        with self.comm.tracer.span("generate", "compute"):
            return self.model.generate(prompt_ids, max_tokens, stop_ids, logits_out=logits_out,
                                       choose=self.chooser(sampling), sync=self.sync,
                                       on_token=on_token)

    def chooser(self, sampling: Sampling):
        """`choose(logits of this rank's rows) -> token id`, the same on every rank."""
        return TokenChooser(self.comm, self.shard.vocab[0], sampling)

    def kv_cache_bytes(self, ctx: int) -> int:
        """What this rank's KV cache holds for `ctx` tokens (its KV heads, every layer)."""
        return KVCache.bytes_for(self.config, ctx, self.model.n_kv)

    def gather_logits(self, local: np.ndarray) -> np.ndarray | None:
        """The whole logits [V] on the group's rank 0 (None elsewhere), from each rank's
        vocabulary rows: a Gatherv, for --logits-out only; the token choice never needs it."""
        vocab = [s.vocab[1] - s.vocab[0] for s in self.shards]
        return self.comm.gather_rows(np.ascontiguousarray(local, np.float32), vocab)

    def warm_up(self) -> None:
        """Two tokens then one through the whole group, so that neither the first timed
        prefill (GeMM, the reduce-scatter and allgather) nor the first decode step (GeMV, the
        one-row allreduce) loads or compiles kernels: those of the weights this shard holds,
        float32 or int8, and only those."""
        cache = self.model.new_cache(3)
        self.model.forward([0, 0], cache, sync=self.sync)
        self.model.forward([0], cache, sync=self.sync)

    def comm_seconds(self) -> float:
        """Seconds this rank spent in the verbs so far (its tracer's communication kinds)."""
        sec = self.comm.tracer.seconds
        return float(sum(sec.get(k, 0.0) for k in COMM_KINDS))


class TokenChooser:
    """The next token from logits split by vocabulary rows over a group, exchanging a few
    numbers per rank (module docstring). `__call__(logits of this rank's rows) -> token id`,
    the same on every rank."""

    def __init__(self, comm: Comm, vocab0: int, sampling: Sampling):
        self.comm, self.v0, self.s = comm, int(vocab0), sampling
        self.rng = np.random.default_rng(sampling.seed)  # the same draws on every rank

    def __call__(self, logits: np.ndarray) -> int:
        if self.comm.solo:  # no verb's span to pay an emulated device's stretch: pay each token's
            with self.comm.tracer.span("token", "compute"):
                pass
        if self.s.temperature == 0:
            return self.greedy(logits)
        u = float(self.rng.random())  # one draw per token, on every rank
        z = np.asarray(logits, np.float64) / self.s.temperature
        if self.s.top_p >= 1:
            return self._sample_all(z, u)
        return self._sample_top_p(z, u)

    def greedy(self, logits: np.ndarray) -> int:
        """The largest logit over the group; ties to the lower index."""
        if logits.size:
            i = int(np.argmax(logits))
            if self.comm.solo:  # a group of one: its own best (no gather, no sort)
                return self.v0 + i
            mine = (float(logits[i]), self.v0 + i)
        else:
            mine = (-np.inf, np.inf)
        g = self.comm.allgather_small(mine).tolist()  # N x [best value, its index]
        # the largest value, ties to the lower index (a sort of N pairs, in Python: cheaper
        # than numpy's calls for a handful of ranks at a decode step)
        return int(max(g, key=lambda p: (p[0], -p[1]))[1])

    def _normaliser(self, m: float, s: float) -> tuple[float, float]:
        """From this rank's max m of z and sum s of exp(z - m): the group's max M and the sum
        Z of exp(z - M) over the whole vocabulary."""
        g = self.comm.allgather_small((m, s))  # (N, 2)
        M = float(g[:, 0].max())
        return M, float(np.sum(g[:, 1] * np.exp(g[:, 0] - M)))

    def _sample_all(self, z: np.ndarray, u: float) -> int:
        """Sample from softmax(z) over the whole vocabulary, by cumulative probability in
        vocabulary order."""
        m = float(z.max()) if z.size else -np.inf
        s = float(np.exp(z - m).sum()) if z.size else 0.0
        g = self.comm.allgather_small((m, s))  # (N, 2)
        M = float(g[:, 0].max())
        per_rank = np.where(g[:, 1] > 0, g[:, 1] * np.exp(g[:, 0] - M), 0.0)
        cum = np.cumsum(per_rank)
        target = u * cum[-1]
        owner = min(int(np.searchsorted(cum, target, side="right")),
                    int(np.flatnonzero(per_rank > 0)[-1]))  # rounding past the end: the last
        tok = -1.0
        if self.comm.rank == owner:
            c = np.cumsum(np.exp(z - M))
            i = min(int(np.searchsorted(c, target - (cum[owner] - per_rank[owner]),
                                        side="right")), z.size - 1)
            tok = float(self.v0 + i)
        return int(self.comm.allgather_small((tok,))[:, 0].max())

    def _sample_top_p(self, z: np.ndarray, u: float) -> int:
        """Sample within the nucleus (module docstring), asking the ranks for more candidates
        until it is settled."""
        order = np.argsort(-z, kind="stable")  # this rank's rows, best first, ties by index
        zs, ids = z[order], (self.v0 + order).astype(np.float64)
        m = float(zs[0]) if z.size else -np.inf
        s = float(np.exp(z - m).sum()) if z.size else 0.0
        k = FIRST_CANDIDATES
        while True:
            sent = min(k, z.size)
            pad = k - sent
            pack = np.concatenate([[m, s, sent, z.size], zs[:sent], np.full(pad, -np.inf),
                                   ids[:sent], np.full(pad, -1.0)])
            g = self.comm.allgather_small(pack)  # (N, 4 + 2k)
            M = float(g[:, 0].max())
            Z = float(np.sum(np.where(g[:, 1] > 0, g[:, 1] * np.exp(g[:, 0] - M), 0.0)))
            vals, idx = g[:, 4:4 + k].reshape(-1), g[:, 4 + k:].reshape(-1)
            keep = idx >= 0
            vals, idx = vals[keep], idx[keep]
            best = np.lexsort((idx, -vals))  # logit down, index up
            vals, idx = vals[best], idx[best]
            more = g[:, 2] < g[:, 3]  # ranks that hold rows they have not sent
            bound = max((float(g[j, 4 + int(g[j, 2]) - 1]) for j in np.flatnonzero(more)),
                        default=-np.inf)
            cum = np.cumsum(np.exp(vals - M) / Z)
            cut = min(int(np.searchsorted(cum, self.s.top_p, side="left")), vals.size - 1)
            if not more.any() or (cum[cut] >= self.s.top_p and vals[cut] > bound):
                break
            k *= 4
        w = np.cumsum(np.exp(vals[:cut + 1] - M))
        i = min(int(np.searchsorted(w, u * w[-1], side="right")), cut)
        return int(idx[i])
