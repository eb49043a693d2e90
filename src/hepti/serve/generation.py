"""The workers' side of `hepti serve` for a decoder: one generation request at a time, streamed.

hepti.serve.worker runs the same job as for an encoder (watch lines, beats, hello, commands
broadcast by rank 0); with a decoder its state is a `DecoderWorker`: every rank holds its
shard of the model (hepti.parallel.decoder's `DecoderGroup`, `tensor` by --ratios or equal
shares; one rank runs it whole; or with --strategy pipeline hepti.parallel.decoder_pipeline's
`PipelineGroup`, whole layers by --ratios' vector, which calls `on_token` on every rank
too) and, per "generate" command, runs prefill and decode together.

- Rank 0 receives the request (the prompt's ids as the frame's payload, the sampling in its
  header) and broadcasts it; each token is sent to the front end in a frame of its own
  (`{"op": "token"}`) as soon as the group has chosen it, then one `{"op": "result"}` with the
  finish reason.
- A request the front end no longer wants (its client went away, a stop string was reached)
  gets a `{"op": "cancel"}` frame on the channel. Rank 0 looks for it after every token without
  waiting, and broadcasts one number a token (stop or go) so that every rank leaves the decode
  loop at the same step: a float on the "shm" transport, ~1% of a step's 1 + 2L syncs. A cancel
  that comes after the result is dropped by the command loop (`stray_cancel`).
"""
from __future__ import annotations

import select
import time

import numpy as np

from hepti.model.chat import stop_ids
from hepti.parallel.comm import Comm
from hepti.parallel.decoder import DecoderGroup, Sampling, group_members, join_group
from hepti.parallel.decoder_pipeline import PipelineGroup, layers_from_ratios
from hepti.parallel.world import agree
from hepti.plan.planfile import DIMS, parse_ratios
from hepti.serve import protocol
from hepti.weights.decoder import load_tokenizer



class Cancelled(Exception):
    """Raised on every rank together when the front end cancelled the request."""


def decoder_ratios(ratios: str | None, world_size: int) -> dict[str, list[float]]:
    """The group's shares per dimension: --ratios, else equal. A decoder is served in `tensor`
    over every rank, or in `pipeline` with --strategy pipeline (`hepti serve` refuses the
    others: app.py); one rank holds the whole model."""
    if ratios:
        return parse_ratios(ratios, world_size)
    return {d: [1.0 / world_size] * world_size for d in DIMS}


class DecoderWorker:
    """Every rank's part of a served decoder (module docstring)."""

    def __init__(self, world: Comm, store, args):
        self.world, self.rank0 = world, world.rank == 0
        ratios = agree(world, lambda: decoder_ratios(args.ratios, world.size))
        layers = None
        pipeline = args.strategy == "pipeline"
        if pipeline:  # whole layers by --ratios' vector (the same interface)
            layers = layers_from_ratios(store.config.num_hidden_layers, ratios["heads"])
        # a rank of no share (no heads and no MLP columns; no layers) leaves the group, as in
        # `hepti generate`: it still takes the commands, but no token waits on its link
        group, mine, layers_in = join_group(world, "pipeline" if pipeline else "tensor", layers,
                                            ratios)
        self.group = group

        def build():
            if group is None:
                return None
            if pipeline:
                return PipelineGroup(group, store, layers_in)
            return DecoderGroup(group, store, mine)

        self.dec = agree(world, build)
        if self.dec is not None:
            self.dec.warm_up()  # the kernels compile before the hello, not in the first request
        tok, meta = load_tokenizer(args.model)
        self.stop = stop_ids(store.config, tok, meta)
        # what the hello reports as the plan (/metrics): no prediction for a decoder yet
        strategy = "tensor" if world.size > 1 else "single"
        # group: the world ranks that compute (a decoder's; join_group leaves the others out)
        self.plan = {"strategy": "pipeline" if layers else strategy, "ratios": ratios,
                     "layers": layers, "predicted_latency_s": None,
                     "group": [r for r, m in enumerate(group_members(
                         "pipeline" if pipeline else "tensor", layers, ratios, world.size)) if m]}

    def generate(self, header, data, sock):
        """One request on every rank; rank 0 streams the tokens on `sock` and returns the
        result frame, (header, None); other ranks return None."""
        w = self.world
        req = w.bcast_obj((np.frombuffer(data, np.int64).tolist(), int(header["max_tokens"]),
                           float(header["temperature"]), float(header["top_p"]),
                           int(header["seed"])) if self.rank0 else None)
        ids, max_tokens, temperature, top_p, seed = req
        if self.dec is None:  # left out of the group: nothing to compute
            return None
        g = self.group
        made: list[int] = []

        def on_token(token: int) -> None:
            made.append(token)
            go = 1.0
            if self.rank0:
                protocol.send(sock, {"op": "token", "id": header["id"], "token": int(token)})
                go = 0.0 if _cancel_waiting(sock) else 1.0
            go = g.bcast_to_all(np.array([go], np.float32) if self.rank0 else None, (1,))
            if float(go[0]) == 0.0:
                raise Cancelled

        t0 = time.perf_counter()
        reason = "length"
        try:
            self.dec.generate(ids, max_tokens, Sampling(temperature, top_p, seed), self.stop,
                              on_token=on_token)
            if made and made[-1] in self.stop:
                reason = "stop"
        except Cancelled:
            reason = "cancelled"
        if not self.rank0:
            return None
        return {"op": "result", "finish_reason": reason, "tokens": len(made),
                "wall_s": time.perf_counter() - t0}, None

    def close(self) -> None:
        """Collective on the group: frees the communicator `join_group` split off, if any."""
        if self.group is not None and self.group is not self.world:
            self.group.close()


def _cancel_waiting(sock) -> bool:
    """Rank 0, between two tokens: whether the front end sent a cancel (without waiting). A
    channel that closed counts as one; the command loop then sees it close."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        header, _ = protocol.recv(sock)
    except (OSError, protocol.ChannelClosed):
        return True
    if header.get("op") != "cancel":
        raise RuntimeError(f"a {header.get('op')!r} frame during a generation; the front end "
                           "sends only cancel then")
    return True


def stray_cancel(header: dict) -> bool:
    """A cancel that reached rank 0 after its request's result: nothing to stop."""
    return header.get("op") == "cancel"
