"""`hepti generate`: text from a converted decoder, on one process or under `mpiexec -n N`.

Every rank runs `generate_on_every_rank`: the prompt is checked (and, with --chat, wrapped in the
model's own chat template) before any weights load. The group that computes is every rank with
a share (`tensor`, by --ratios or equal shares; rank 0 always), rank 0 and the ranks holding
layers (`pipeline`, by --layers, --ratios or as equal as whole layers go) or rank 0 alone
(`single`); ranks left out wait asleep until the end. `auto` chooses among the three by
hepti.plan.decoder's comparison on a profile (`auto_plan`). Each member reads its part of the
weights and runs hepti.parallel.decoder's `DecoderGroup` or hepti.parallel.decoder_pipeline's
`PipelineGroup` (the same interface). Rank 0 alone prints: the tokens as they are made on
stdout, a timing line on stderr, and with --json one
JSON object at the end. Errors follow `hepti run`'s discipline (`run_guarded_fn`): a bad input
raised on every rank is reported once, with exit code 2; anything else on any rank names the
rank and ends the whole job.

The chat template and the streamed text are hepti.model.chat's, which `hepti serve` shares.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from hepti.errors import InputError
from hepti.families import FAMILIES, family
from hepti.model.chat import TextStream, render_chat, stop_ids
from hepti.model.llama import check_request
from hepti.parallel.comm import Comm
from hepti.parallel.decoder import DecoderGroup, Sampling, join_group
from hepti.parallel.decoder_pipeline import PipelineGroup, layer_counts, layers_from_ratios
from hepti.parallel.engine import FAULT_ENV
from hepti.parallel.world import agree, run_guarded_fn
from hepti.parallel.profiling import cached_profile
from hepti.parallel.trace import Tracer
from hepti.plan.decoder import DecoderPlan, Request, plan_decoder, weight_bytes_of
from hepti.plan.planfile import DIMS, parse_ratios
from hepti.plan.profile import load_profile
from hepti.weights import WeightStore
from hepti.weights.decoder import load_tokenizer

STRATEGIES = ("single", "tensor", "pipeline")  # what the decoder executors run (auto chooses one)
PROFILE_ROWS = 128  # the rows `auto` measures a profile at: `hepti profile`'s default --seq,
#                     so that its cached profile serves every prompt length


def generate_guarded(args) -> int:
    """`hepti generate` on every rank, with the failure discipline of the module docstring."""
    return run_guarded_fn("generate", generate_on_every_rank, args)


def generate_on_every_rank(args) -> int:
    """Check, load, generate, report (module docstring); every rank calls it."""
    mpi = MPI.COMM_WORLD
    world = Comm(mpi if mpi.Get_size() > 1 else None, Tracer(mpi.Get_rank()))
    rank0 = world.rank == 0
    args.strategy = args.strategy or ("tensor" if world.size > 1 else "single")
    if args.logits_out:
        args.logits_out = agree(world, lambda: logits_path(args.logits_out))
    sampling = agree(world, lambda: Sampling(args.temperature, args.top_p, args.seed))
    store = agree(world, lambda: open_decoder(args.model))
    cfg = store.config
    tok, meta = load_tokenizer(args.model)
    ids = agree(world, lambda: prompt_ids(args, cfg, tok, meta))
    agree(world, lambda: check_auto_args(args))
    layers = None  # pipeline: layers per rank of the world
    if args.strategy == "auto":
        plan = auto_plan(args, world, store, len(ids))
        if rank0:
            print(plan.format(), file=sys.stderr, flush=True)
        args.strategy = plan.chosen.strategy
        ratios = plan.chosen.ratios or {d: [1.0] for d in DIMS}
        layers = plan.chosen.layers
    elif args.strategy == "pipeline":
        ratios = None
        layers = agree(world, lambda: pipeline_layers(args, cfg.num_hidden_layers, world.size))
    else:
        ratios = agree(world, lambda: group_ratios(args, world.size))
    stop = stop_ids(cfg, tok, meta)

    group, ratios, layers_in = join_group(world, args.strategy, layers, ratios)
    report = None
    if group is not None:
        t0 = time.perf_counter()
        if args.strategy == "pipeline":
            dec = agree(group, lambda: PipelineGroup(group, store, layers_in))
        else:
            dec = agree(group, lambda: DecoderGroup(group, store, ratios))
        load_s = time.perf_counter() - t0
        report = run_group(args, dec, ids, sampling, stop, tok, rank0)
        report["load_s"] = load_s
        report["layers"] = layers  # pipeline's, every rank's of the world (else None)
    store.close()
    world.barrier_idle()  # ranks left out (`single`, pipeline's of 0 layers) wait here asleep
    # per rank (zeros for a rank left out)
    keys = ("compute_s", "comm_s", "weight_bytes", "kv_cache_bytes")
    mine = [report[k] for k in keys] if report else [0.0] * len(keys)
    per_rank = world.gather_floats(mine)
    if group is not None and group is not world:
        group.close()
    world.close()  # collective: frees the shared window of the "shm" transport
    if rank0:
        finish(args, report, per_rank, ids, world.size, tok)
    return 0


def open_decoder(path) -> WeightStore:
    """The converted model, refused unless its family runs on the decoder executor."""
    store = WeightStore(path)
    fam = family(store.config)
    if fam.executor != "decoder":
        store.close()
        runs = ", ".join(f.model_type for f in FAMILIES.values() if f.executor == "decoder")
        raise InputError(f"{path} holds a {fam.label} model ({store.config.model_type}); `hepti "
                         f"generate` runs decoders ({runs}). Use `hepti run` for it.")
    return store


def prompt_ids(args, cfg, tok, meta) -> list[int]:
    """The prompt's token ids: the raw text (special tokens parsed as such), or with --chat
    the user message in the model's chat template (its default system prompt included)."""
    if tok is None:
        raise InputError(f"{args.model} has no tokenizer.json; re-convert it from its GGUF "
                         "(`hepti convert FILE.gguf --out DIR`)")
    if not args.prompt:
        raise InputError("--prompt is empty; give the text to continue (or, with --chat, a "
                         "question)")
    text = chat_text(args.prompt, meta, args.model) if args.chat else args.prompt
    ids = tok.encode(text).ids
    check_request(cfg, len(ids), args.max_tokens)
    return ids


def chat_text(prompt: str, meta: dict, model) -> str:
    """One user message rendered by the model's chat template, with the generation prompt."""
    return render_chat([{"role": "user", "content": prompt}], meta, model,
                       "drop --chat and write the prompt in the model's format yourself")


def check_auto_args(args) -> None:
    """--profile and --ctx plan `auto`; --ratios are `tensor`'s (or `pipeline`'s) own shares,
    --layers `pipeline`'s."""
    if args.strategy == "auto" and args.ratios:
        raise InputError("--strategy auto chooses the shares; drop --ratios (or give "
                         "--strategy tensor with them)")
    if args.layers and args.strategy != "pipeline":
        raise InputError(f"--layers sets pipeline's layers per rank; add --strategy pipeline "
                         f"(or drop --layers for {args.strategy})")
    if args.strategy != "auto" and (args.profile or args.ctx):
        raise InputError("--profile and --ctx are for --strategy auto; add it or drop them")


def auto_plan(args, world: Comm, store, n_prompt: int) -> DecoderPlan:
    """`auto` on every rank (docs/generate.md, Plans): the profile (--profile, else the
    cached or newly measured one: collective), then hepti.plan.decoder's comparison for this
    request, the same on every rank. A plan that does not fit raises, naming the rank."""
    if args.profile:
        profile = agree(world, lambda: load_profile(args.profile, world_size=world.size))
        notes = agree(world, lambda: profile.check_model(store.config, f"--profile {args.profile}"))
        if world.rank == 0:
            for note in notes:
                print(f"hepti generate: {note}", file=sys.stderr)
    else:
        profile, _, _ = cached_profile(MPI.COMM_WORLD, store.config, PROFILE_ROWS)
    return agree(world, lambda: plan_decoder(
        store.config, profile, Request(n_prompt, args.max_tokens, args.ctx),
        weight_bytes_of(store.index), "auto"))


def group_ratios(args, world_size: int) -> dict[str, list[float]]:
    """Shares per dimension for the group that computes: --ratios (tensor only), else equal;
    `single` is rank 0's group of one."""
    if args.strategy == "single" and args.ratios and world_size > 1:
        raise InputError("--strategy single runs on rank 0 alone; drop --ratios")
    if args.strategy == "single" or world_size == 1:
        if args.ratios:
            parse_ratios(args.ratios, world_size)  # one share per rank, even for one rank
        return {d: [1.0] for d in DIMS}
    if args.ratios:
        return parse_ratios(args.ratios, world_size)
    return {d: [1.0 / world_size] * world_size for d in DIMS}


def pipeline_layers(args, n_layers: int, world_size: int) -> list[int]:
    """Layers per rank for `pipeline`: --layers, else --ratios' one vector by largest
    remainder, else as equal as whole layers allow."""
    if args.layers and args.ratios:
        raise InputError("--layers and --ratios both set pipeline's layers; give one of them")
    if args.layers:
        return layer_counts(n_layers, args.layers, world_size)
    if args.ratios and "=" in args.ratios:
        raise InputError(f"--ratios {args.ratios}: pipeline splits layers only; give one vector "
                         "(e.g. 0.7,0.3) or --layers 20,10")
    vec = parse_ratios(args.ratios, world_size)["heads"] if args.ratios else [1.0] * world_size
    return layers_from_ratios(n_layers, vec)


class Stream:
    """Prints the text of the tokens made so far as it grows (rank 0; hepti.model.chat's
    TextStream keeps a character that spans tokens whole)."""

    def __init__(self, tok, on: bool):
        self.text, self.on = TextStream(tok), on

    def __call__(self, token: int) -> None:
        if self.on and (new := self.text.push(token)):
            sys.stdout.write(new)
            sys.stdout.flush()


def run_group(args, dec: DecoderGroup | PipelineGroup, ids, sampling, stop, tok, rank0: bool) -> dict:
    """Generate on a member of the computing group; what this rank measured."""
    dec.warm_up()
    dec.comm.barrier()
    dec.comm.tracer.reset()
    if os.environ.get(FAULT_ENV) == str(MPI.COMM_WORLD.Get_rank()):  # test-only, as hepti run
        raise RuntimeError(f"injected fault ({FAULT_ENV})")
    stream = Stream(tok, rank0)
    marks: list[float] = []  # perf_counter when each token was chosen
    t0 = time.perf_counter()
    first: list = []
    tokens = dec.generate(ids, args.max_tokens, sampling, stop,
                          on_token=lambda t: (marks.append(time.perf_counter()), stream(t)),
                          logits_out=first)
    wall = time.perf_counter() - t0
    logits = dec.gather_logits(first[0]) if args.logits_out else None
    if rank0 and args.logits_out:
        np.save(args.logits_out, np.asarray(logits, np.float32))
    comm_s = dec.comm_seconds()
    return {"tokens": tokens, "prefill_s": marks[0] - t0, "decode_s": marks[-1] - marks[0],
            "wall_s": wall, "comm_s": comm_s, "compute_s": wall - comm_s,
            "weight_bytes": dec.weight_bytes, "text": tok.decode(tokens),
            "kv_cache_bytes": dec.kv_cache_bytes(len(ids) + args.max_tokens)}


def finish(args, r: dict, per_rank, ids, world_size: int, tok) -> None:
    """Rank 0: the end of the streamed text, the timing line, the JSON object."""
    n_dec = len(r["tokens"]) - 1  # the first token comes from the prefill
    prefill_tps = len(ids) / r["prefill_s"] if r["prefill_s"] > 0 else None
    decode_tps = n_dec / r["decode_s"] if n_dec and r["decode_s"] > 0 else None
    sys.stdout.write("\n")
    sys.stdout.flush()
    print(f"hepti generate: {args.strategy} on {world_size} rank(s): prompt {len(ids)} tokens, "
          f"prefill {_rate(prefill_tps)}; {len(r['tokens'])} tokens, decode {_rate(decode_tps)}"
          f"; weights loaded in {r['load_s']:.1f} s", file=sys.stderr, flush=True)
    if args.logits_out:
        print(f"hepti generate: wrote the prefill's last-position logits to {args.logits_out}",
              file=sys.stderr)
    if args.json:
        doc = {"prompt_ids": list(map(int, ids)), "token_ids": list(map(int, r["tokens"])),
               "text": r["text"], "strategy": args.strategy, "ranks": world_size,
               "layers": r["layers"],
               "prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": decode_tps,
               "prefill_s": r["prefill_s"], "decode_s": r["decode_s"],
               "per_rank": [{"rank": i, "compute_s": c, "comm_s": m, "weight_bytes": int(b),
                             "kv_cache_bytes": int(kv)}
                            for i, (c, m, b, kv) in enumerate(per_rank)]}
        print(json.dumps(doc))
    sys.stdout.flush()


def _rate(tps) -> str:
    return f"{tps:.1f} tokens/s" if tps else "n/a"


def logits_path(text: str) -> Path:
    """--logits-out: a .npy path whose folder exists."""
    p = Path(text)
    if p.suffix != ".npy":
        raise InputError(f"--logits-out {text}: give a .npy file name")
    if not p.parent.is_dir():
        raise InputError(f"--logits-out {text}: the folder {p.parent} does not exist")
    return p
