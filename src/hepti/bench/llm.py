"""`hepti bench llm`: decode (and prefill) tokens/s of hepti, distributed-llama and llama.cpp on
the same weights and the same devices (issue 46, "Against the peers").

The weights: `hepti convert --random llama-1b --out weights/llama-1b --export-hf
weights/llama-1b-hf --export-gguf weights/llama-1b.gguf` (hepti.weights.export). The peers are
benchmark-only tools that hepti never ships, builds or imports:

- **distributed-llama** (github b4rtaz/distributed-llama), built by hand outside this
  repository with its own `make dllama`; `--dllama PATH` is the checkout (or the binary in
  it). Its converters (`converter/convert-hf.py`, `convert-tokenizer-hf.py`; they need torch,
  safetensors and sentencepiece) turn the exported HF folder into its .m and .t files once,
  into `--dllama-dir` (or give `--dllama-model` and `--dllama-tokenizer`). It runs as a root
  (`dllama inference`) and N-1 workers (`dllama worker`), **N a power of two** that divides
  the attention heads and the KV heads (its slices are even: `nHeads % nNodes`).
- **llama.cpp** through `llama-cpp-python` (PyPI builds llama.cpp from source; bench-only,
  `pip install -e .[bench-llm]`), on the exported GGUF, 1 thread and `--threads` threads.
- **hepti**: `hepti generate --json` with `--strategy`, under `mpiexec -n N`.

Every variant runs in its own launch, as a user would run it: `mpiexec -n N` of this module's
`rank` command, which execs the right program per rank (rank 0 the root, the others workers
listening on a port), or, with `--cluster SPEC`, the same under `hepti emulate --cluster SPEC
--`, so rank i lands on emulated device i (its namespace, shaped link, CPU and memory caps)
exactly as hepti's ranks do. Off the emulator the workers listen on 127.0.0.1, one port each.
The emulator's CPU share is kept by a stretch inside hepti's own ranks
(hepti.emulate.stretch), which a foreign program does not run: the peers' launches set
HEPTI_EMULATE_STRETCH=0, so their devices are held at their share by the cgroup quota alone.
A quota lets a program that waited run a short burst at full speed, so this favours the
peers, never hepti (docs/emulate.md). A hepti variant ending in `:quota`
(`hepti:auto:2:quota`) runs hepti the peers' way too, held by the quota alone: the
like-for-like figure beside the stretched one.

Variants take turns in rounds (hepti.bench.harness.interleave: each round runs every variant
once, the order rotating), each figure is the median over rounds, and each variant's decode and
prefill tokens/s are divided by the baseline's (`--baseline`, default the first peer; above 1
is faster). The JSON goes to `--out` (results/llm.json), every run in it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hepti.bench import harness, registry
from hepti.bench.harness import at_least, hepti_cmd, result_doc, write_json
from hepti.errors import ConfigError, HeptiError

DEFAULT_PROMPT = ("The quick brown fox jumps over the lazy dog, and the dog sleeps on in the warm "
                  "sun while the fox runs to the river.")
DLLAMA_PORT = 9990  # distributed-llama's default worker port; off the emulator, port + rank
READY_TIMEOUT_S = 120.0  # a worker that is not listening by then has failed to start
LISTEN = "0A"  # /proc/net/tcp's state of a listening socket


# --- what runs -----------------------------------------------------------------------------------

def parse_variants(text: str) -> list[dict]:
    """`dllama:1,dllama:2,llamacpp:1,llamacpp:2,hepti:tensor:2,hepti:auto:4` -> variant dicts.

    dllama:N (N nodes), llamacpp:T (T threads, one device), hepti:STRATEGY:N (N ranks), and
    hepti:STRATEGY:N:quota (held at its devices' share by the quota alone, as the peers are)."""
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        try:
            if parts[0] == "dllama" and len(parts) == 2:
                out.append({"name": item, "kind": "dllama", "nodes": int(parts[1])})
            elif parts[0] == "llamacpp" and len(parts) == 2:
                out.append({"name": item, "kind": "llamacpp", "threads": int(parts[1])})
            elif parts[0] == "hepti" and (len(parts) == 3 or parts[3:] == ["quota"]):
                out.append({"name": item, "kind": "hepti", "strategy": parts[1],
                            "nodes": int(parts[2]), "quota": len(parts) == 4})
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(f"variant {item!r} is not dllama:N, llamacpp:THREADS or "
                              "hepti:STRATEGY:N[:quota] (e.g. dllama:2,llamacpp:1,hepti:tensor:2)"
                              ) from None
    if not out:
        raise ConfigError("no variants given; e.g. --variants dllama:1,dllama:2,llamacpp:1")
    return out


def check_dllama_nodes(nodes: int, config: dict) -> None:
    """distributed-llama's own limits, said before it is launched: 2^n nodes, even head split."""
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    if nodes < 1 or nodes & (nodes - 1):
        raise ConfigError(f"distributed-llama runs on 2^n nodes (1, 2, 4, 8, ...), not {nodes}")
    if heads % nodes or kv % nodes:
        raise ConfigError(f"distributed-llama splits the heads evenly: {nodes} nodes must divide "
                          f"the {heads} attention heads and the {kv} KV heads; use fewer nodes")
    d = config.get("head_dim") or config["hidden_size"] // heads
    widths = {"hidden_size": config["hidden_size"], "attention width per node": heads * d // nodes,
              "KV width per node": kv * d // nodes,
              "MLP width per node": config["intermediate_size"] // nodes}
    odd = [f"{k} {w}" for k, w in widths.items() if w % 8]
    if config["intermediate_size"] % nodes or odd:
        raise ConfigError(f"distributed-llama's float32 kernels take widths in multiples of 8 "
                          f"and an even MLP split; at {nodes} nodes this model has "
                          f"{', '.join(odd) or 'an MLP that does not split evenly'}")


# distributed-llama's weight types and the buffer (activation) type each runs with: its Q40
# matmuls take Q80 inputs; f32 weights keep f32 buffers, so nothing is rounded on the way.
BUFFER_TYPE = {"f32": "f32", "q40": "q80"}


def dllama_paths(path: str | None) -> tuple[Path, Path]:
    """(the dllama binary, the checkout's converter folder) from --dllama (checkout or binary)."""
    if not path:
        raise ConfigError("distributed-llama variants need --dllama PATH: a checkout of "
                          "github.com/b4rtaz/distributed-llama built by hand with its own "
                          "`make dllama` (hepti does not build or ship it), or the dllama "
                          "binary in it")
    p = Path(path)
    binary = p / "dllama" if p.is_dir() else p
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise ConfigError(f"{binary}: no dllama program there; build it in the checkout with "
                          "`make dllama` and give the checkout or the binary to --dllama")
    return binary, binary.parent / "converter"


def dllama_files(args, converter: Path) -> tuple[Path, Path]:
    """distributed-llama's .m and .t files: given, made before (in --dllama-dir) or made now
    from the HF export with the checkout's own converters."""
    if args.dllama_model and args.dllama_tokenizer:
        return Path(args.dllama_model), Path(args.dllama_tokenizer)
    if not args.hf:
        raise ConfigError("distributed-llama variants need its model files: --dllama-model "
                          "FILE.m and --dllama-tokenizer FILE.t, or --hf DIR (the Hugging Face "
                          "folder `hepti convert ... --export-hf DIR` wrote) to convert")
    hf = Path(args.hf)
    out = Path(args.dllama_dir or f"{hf}-dllama")
    name = hf.name
    wtype = args.dllama_weights
    model, tok = out / f"dllama_model_{name}_{wtype}.m", out / f"dllama_tokenizer_{name}.t"
    out.mkdir(parents=True, exist_ok=True)
    for script, argv, made in (("convert-hf.py", [str(hf.resolve()), wtype, name], model),
                               ("convert-tokenizer-hf.py", [str(hf.resolve()), name], tok)):
        if made.is_file():
            continue
        p = subprocess.run([sys.executable, str(converter / script)] + argv, cwd=out,
                           capture_output=True, text=True)
        if p.returncode != 0 or not made.is_file():
            raise ConfigError(f"distributed-llama's {script} failed on {hf} (it needs torch, "
                              f"safetensors and sentencepiece):\n{p.stdout[-800:]}{p.stderr[-1200:]}")
    return model, tok


# --- one launch ----------------------------------------------------------------------------------

def launch(args, cmd: list[str], nodes: int, quota_only: bool) -> harness.Launch:
    """The harness's launch: `mpiexec -n nodes CMD`, under `hepti emulate --cluster SPEC --`
    when a cluster is given; a failure is returned (the variant records it), not raised.
    quota_only: no stretch (a foreign program runs none; a `:quota` hepti variant): the devices
    held at their share by the cgroup quota alone."""
    env = {"HEPTI_EMULATE_STRETCH": "0"} if quota_only and args.cluster else None
    return harness.launch(cmd, ranks=nodes, spec=args.cluster, env=env, timeout=args.timeout,
                          check=False)


def self_cmd(*argv) -> list[str]:
    return [sys.executable, "-m", "hepti.bench.llm", *map(str, argv)]


def run_dllama(args, v: dict, files, n_prompt: int, rdv: Path, tokens: int | None = None) -> dict:
    """One launch of distributed-llama at v's nodes: prefill n_prompt tokens (in its own
    tokenizer's count, `dllama_prompt_tokens`), then decode `tokens` (default --tokens)."""
    binary, model, tok = files
    shutil.rmtree(rdv, ignore_errors=True)
    rdv.mkdir(parents=True)
    steps = n_prompt - 1 + (args.tokens if tokens is None else tokens)  # it counts positions
    cmd = self_cmd("rank", "--rendezvous", rdv, "--port", args.dllama_port, "--threads",
                   args.dllama_threads, "--", binary,
                   "inference", "--model", model, "--tokenizer", tok,
                   "--buffer-float-type", BUFFER_TYPE[args.dllama_weights],
                   "--prompt", args.prompt, "--steps", steps,
                   "--max-seq-len", steps + 8, "--nthreads", args.dllama_threads,
                   "--temperature", "0", "--seed", "1")
    p = launch(args, cmd, v["nodes"], quota_only=True)
    if p.rc != 0:
        return failed(p)
    return parse_dllama(p.stdout)


def dllama_prompt_tokens(args, v: dict, files, rdv: Path) -> int:
    """The prompt's length in distributed-llama's own tokenizer (it merges by scores, so it may
    split the text into more tokens than the BPE does): one warm-up launch, at most a token per
    byte, one decoded; it also brings the weights into the page cache for the timed runs."""
    res = run_dllama(args, v, files, len(args.prompt.encode()) + 2, rdv, tokens=1)
    if res["status"] != "ok":
        raise HeptiError(f"distributed-llama's warm-up launch failed: {res['reason']}")
    return res["prompt_tokens"]


def parse_dllama(text: str) -> dict:
    """Its closing report: Evaluation (prefill) and Prediction (decode) tokens and tokens/s."""
    found = re.findall(r"(Evaluation|Prediction)\s*\n(?:\s*nBatches:.*\n)?\s*nTokens:\s*(\d+)\s*\n"
                       r"\s*tokens/s:\s*([\d.]+)", text)
    got = {k: (int(n), float(r)) for k, n, r in found}
    if set(got) != {"Evaluation", "Prediction"}:
        return {"status": "failed", "reason": "no Evaluation/Prediction report in its output: "
                + " | ".join(text.strip().splitlines()[-3:])}
    return {"status": "ok", "workers": re.findall(r"connecting to (\S+) worker", text),
            "prompt_tokens": got["Evaluation"][0] + 1,
            "decode_tokens": got["Prediction"][0],
            "prefill_tok_s": got["Evaluation"][1], "decode_tok_s": got["Prediction"][1]}


def run_llamacpp(args, v: dict) -> dict:
    cmd = self_cmd("llamacpp", "--gguf", args.gguf, "--threads", v["threads"], "--prompt",
                   args.prompt, "--tokens", args.tokens)
    p = launch(args, cmd, 1, quota_only=True)
    if p.rc != 0:
        return failed(p)
    return {"status": "ok", **json.loads(p.stdout.strip().splitlines()[-1])}


def run_hepti(args, v: dict) -> dict:
    """`hepti generate --json` (issue 46's decoder) at v's strategy and ranks, greedy. It asks
    for --tokens + 1 new tokens: the first comes from the prefill, so it decodes --tokens
    steps, as the peers' runs do."""
    cmd = hepti_cmd() + ["generate", "--model", args.model, "--prompt", args.prompt,
                         "--max-tokens", str(args.tokens + 1), "--temperature", "0",
                         "--strategy", v["strategy"], "--json"]
    p = launch(args, cmd, v["nodes"], quota_only=v.get("quota", False))
    if p.rc != 0:
        return failed(p)
    return hepti_rates(json.loads(p.stdout.strip().splitlines()[-1]))


def hepti_rates(report: dict) -> dict:
    """The figures of `hepti generate --json`'s report (hepti.generate.finish), as the peers'
    runs give them. Its decode rate is None when it made one token only (the prefill's)."""
    out = {"status": "ok", "prompt_tokens": len(report["prompt_ids"]),
           "decode_tokens": len(report["token_ids"]) - 1,  # the first comes from the prefill
           "prefill_tok_s": report["prefill_tokens_per_s"],
           "decode_tok_s": report["decode_tokens_per_s"]}
    if out["decode_tok_s"] is None or out["prefill_tok_s"] is None:
        return {"status": "failed", "reason": "hepti generate stopped before decoding (an end "
                "token right after the prompt?); no decode rate"}
    return out


def failed(p: harness.Launch) -> dict:
    lines = [ln for ln in (p.stderr + p.stdout).strip().splitlines() if "%|" not in ln]
    return {"status": "failed", "reason": f"exit {p.rc}: " + " | ".join(lines[-4:])}


# --- the benchmark ---------------------------------------------------------------------------------

def run(args) -> int:
    """Rounds of every variant, interleaved; medians and ratios to --out (the registry's
    entry point, with add_arguments; ConfigError for what cannot run, before any launch)."""
    variants = parse_variants(args.variants)
    kinds = {v["kind"] for v in variants}
    config = model_config(args)
    if args.cluster:
        n_dev = len(json.loads(Path(args.cluster).read_text())["devices"])
        wide = [v["name"] for v in variants if v.get("nodes", 1) > n_dev]
        if wide:
            raise ConfigError(f"{args.cluster} has {n_dev} devices; {', '.join(wide)} need more")
    files = None
    if "dllama" in kinds:
        for v in variants:
            if v["kind"] == "dllama":
                check_dllama_nodes(v["nodes"], config)
        binary, converter = dllama_paths(args.dllama)
        files = (binary, *dllama_files(args, converter))
    if "llamacpp" in kinds:
        if not args.gguf:
            raise ConfigError("llama.cpp variants need --gguf FILE (`hepti convert ... "
                              "--export-gguf FILE` writes it)")
        check_llama_cpp()
    if "hepti" in kinds and not args.model:
        raise ConfigError("hepti variants need --model DIR (the converted decoder)")
    n_prompt = prompt_tokens(args)
    rdv = Path(args.workdir or f"/tmp/hepti-bench-llm-{os.getpid()}")
    by_name = {v["name"]: v for v in variants}
    if args.baseline and args.baseline not in by_name:
        raise ConfigError(f"--baseline {args.baseline} is not one of the variants: "
                          f"{', '.join(by_name)}")
    state = {"n_dllama": None}  # the prompt's tokens in distributed-llama's tokenizer

    def run_one(name: str, k: int) -> dict:
        v = by_name[name]
        t0 = time.perf_counter()
        if v["kind"] == "dllama":
            if state["n_dllama"] is None:
                state["n_dllama"] = dllama_prompt_tokens(args, v, files, rdv)
            res = run_dllama(args, v, files, state["n_dllama"], rdv)
        elif v["kind"] == "llamacpp":
            res = run_llamacpp(args, v)
        else:
            res = run_hepti(args, v)
        res["wall_s"] = round(time.perf_counter() - t0, 2)
        note = (f"decode {res['decode_tok_s']:.2f} tok/s, prefill {res['prefill_tok_s']:.2f}"
                if res["status"] == "ok" else f"{res['status']}: {res['reason']}")
        print(f"round {k + 1}/{args.rounds} {name}: {note}", file=sys.stderr)
        return res

    try:
        results = harness.interleave(list(by_name), args.rounds, run_one)
    finally:
        shutil.rmtree(rdv, ignore_errors=True)
    summary = summarise(results, args.baseline or next(
        (v["name"] for v in variants if v["kind"] != "hepti"), None))
    counts = prompt_counts(results)
    if not same_prompt(counts, by_name):
        print(f"hepti bench llm: warning: llama.cpp and hepti read the prompt as different "
              f"numbers of tokens ({counts}): their prefill rates are not of the same work; "
              "check that the GGUF carries the folder's tokenizer (`hepti convert "
              "--export-gguf` writes it)", file=sys.stderr)
    doc = result_doc("llm", cluster=args.cluster, prompt=args.prompt,
                     prompt_tokens_hepti_tokenizer=n_prompt, prompt_tokens=counts,
                     same_prompt_tokens=same_prompt(counts, by_name), decode_tokens=args.tokens,
                     rounds=args.rounds, model=config, dllama_threads=args.dllama_threads,
                     dllama_weights=args.dllama_weights,
                     variants=variants, runs=results, **summary)
    write_json(doc, args.out)
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0 if all(r and r[-1]["status"] != "failed" for r in results.values()) else 1


def summarise(results: dict, baseline: str | None) -> dict:
    """The harness's medians and ratios (variant / baseline: above 1 is faster, these being
    rates), of decode and of prefill tokens/s, over each variant's rounds that ran. A round
    that failed drops out of its variant alone, so `paired_ratio` pairs rounds in order."""
    out = {}
    for key in ("decode_tok_s", "prefill_tok_s"):
        rates = {name: [r[key] for r in runs if r["status"] == "ok" and r[key]]
                 for name, runs in results.items()}
        base = baseline if baseline in rates and rates[baseline] else None
        out[key] = harness.summarise(rates, base)
    return {"baseline": baseline, **out}


def prompt_counts(results: dict) -> dict[str, list[int]]:
    """Each variant's prompt length in tokens as its runs reported it (distinct values)."""
    return {name: sorted({r["prompt_tokens"] for r in runs if r["status"] == "ok"})
            for name, runs in results.items()}


def same_prompt(counts: dict[str, list[int]], by_name: dict) -> bool:
    """Whether llama.cpp's and hepti's runs read the prompt as the same number of tokens
    (they share the GGUF's tokenizer; distributed-llama's own one may split it otherwise)."""
    seen = {n for name, c in counts.items() if by_name[name]["kind"] != "dllama" for n in c}
    return len(seen) <= 1


def model_config(args) -> dict:
    """The model's shape (config.json of the HF export, else of the converted folder's index)."""
    if args.hf and (Path(args.hf) / "config.json").is_file():
        return json.loads((Path(args.hf) / "config.json").read_text())
    if args.model:
        return json.loads((Path(args.model) / "index.json").read_text())["config"]
    raise ConfigError("give --hf DIR (the HF export) or --model DIR (the converted decoder)")


def prompt_tokens(args) -> int:
    """The prompt's length in the model's own tokenizer (the peers' may differ by a token or
    two; each run reports its own)."""
    from tokenizers import Tokenizer  # local: only a run needs it, not `--help`
    folder = Path(args.hf or args.model)
    return len(Tokenizer.from_file(str(folder / "tokenizer.json")).encode(args.prompt).ids)


def check_llama_cpp() -> None:
    p = subprocess.run([sys.executable, "-c", "import llama_cpp"], capture_output=True, text=True)
    if p.returncode != 0:
        raise ConfigError("llama.cpp variants need llama-cpp-python in this environment: "
                          "`pip install -e .[bench-llm]` (it builds llama.cpp; minutes on 2 "
                          "cores)")


# --- inside a launch: a rank of distributed-llama, llama.cpp on one device -----------------------

def rank_main(args) -> int:
    """One rank of a distributed-llama launch: rank 0 runs PROGRAM (its root) once every worker
    listens; rank i > 0 runs `PROGRAM worker` on its port until the root is done.

    Ranks meet through files in --rendezvous (the devices share the file system, not the
    network): `ready-i` when worker i listens, `failed-i` when it could not (rank 0 stops at
    once), `done` when the root has finished (also on failure, so the workers, which serve
    forever, always end). Nothing here is MPI, so no MPI_Abort ends the others: these files do."""
    rank, size = int(os.environ.get("PMI_RANK", 0)), int(os.environ.get("PMI_SIZE", 1))
    rdv, program = Path(args.rendezvous), args.program
    if not program:
        raise SystemExit("rank: give the root's command after --")
    hosts, ports = rank_addresses(size, args.port)
    if rank == 0:
        try:
            wait_ready(rdv, size)
            workers = [f"{h}:{p}" for h, p in zip(hosts[1:], ports[1:])]
            cmd = program + (["--workers", *workers] if workers else [])
            p = subprocess.run(cmd, capture_output=True, text=True)
            sys.stdout.write(p.stdout)
            sys.stderr.write(p.stderr)
            return p.returncode
        finally:
            (rdv / "done").touch()
    # bound to the address the root reaches it at (127.0.0.1, or its emulated device's), not
    # distributed-llama's default of every interface
    worker = subprocess.Popen([program[0], "worker", "--host", hosts[rank], "--port",
                               str(ports[rank]), "--nthreads", str(args.threads)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not listening(ports[rank]):
            if worker.poll() is not None or time.monotonic() > deadline:
                why = (worker.stderr.read()[-500:] if worker.poll() is not None
                       else f"nothing after {READY_TIMEOUT_S:.0f} s")
                raise SystemExit(f"rank {rank}: distributed-llama's worker did not listen on "
                                 f"port {ports[rank]}: {why}")
            time.sleep(0.05)
        (rdv / f"ready-{rank}").touch()
        while not (rdv / "done").exists():
            if worker.poll() is not None:
                raise SystemExit(f"rank {rank}: distributed-llama's worker exited "
                                 f"({worker.returncode}): {worker.stderr.read()[-500:]}")
            time.sleep(0.1)
        return 0
    except SystemExit as e:  # tell rank 0, which would otherwise wait for this worker
        (rdv / f"failed-{rank}").write_text(str(e.code))
        raise
    finally:
        if worker.poll() is None:
            worker.terminate()
            worker.wait(10)


def rank_addresses(size: int, port: int) -> tuple[list[str], list[int]]:
    """Each rank's address and worker port: the emulated devices' addresses (the hostfile
    `hepti emulate` gives Hydra, one device a line), one port; else loopback, a port each."""
    hostfile = os.environ.get("HYDRA_HOST_FILE")
    if hostfile and Path(hostfile).is_file():
        hosts = [ln.split(":")[0] for ln in Path(hostfile).read_text().split() if ln.strip()]
        if len(hosts) < size:
            raise SystemExit(f"{hostfile} lists {len(hosts)} hosts for {size} ranks")
        return hosts[:size], [port] * size
    return ["127.0.0.1"] * size, [port + i for i in range(size)]


def wait_ready(rdv: Path, size: int) -> None:
    """Until every worker rank listens; SystemExit at once if one failed (its `failed-i`: the
    launch is not MPI, so mpiexec would wait for rank 0), or after READY_TIMEOUT_S."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        failed = sorted(rdv.glob("failed-*"))
        if failed:
            raise SystemExit(f"rank 0: not starting distributed-llama's root: "
                             f"{failed[0].read_text()}")
        missing = [i for i in range(1, size) if not (rdv / f"ready-{i}").exists()]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"rank 0: worker rank(s) {missing} not listening after "
                             f"{READY_TIMEOUT_S:.0f} s")
        time.sleep(0.05)


def listening(port: int) -> bool:
    """Whether a socket of this network namespace listens on TCP `port` (/proc/net/tcp)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for ln in lines:
            f = ln.split()
            if f[3] == LISTEN and int(f[1].rsplit(":", 1)[1], 16) == port:
                return True
    return False


def llamacpp_main(args) -> int:
    """llama.cpp on this device: prefill the prompt, then greedy decode; one JSON line."""
    import numpy as np  # local: only this command needs it
    import llama_cpp  # local: an optional, bench-only dependency (llama-cpp-python)
    llm = llama_cpp.Llama(model_path=str(args.gguf), n_ctx=0, n_threads=args.threads,
                          n_threads_batch=args.threads, n_batch=512, verbose=False, seed=1)
    ids = llm.tokenize(args.prompt.encode(), add_bos=False, special=True)
    n_ctx, n_vocab = llm.n_ctx(), llm.n_vocab()
    if len(ids) + args.tokens > n_ctx:
        raise SystemExit(f"{len(ids)} prompt tokens and {args.tokens} new ones exceed the "
                         f"context of {n_ctx}")

    def greedy() -> int:  # the last position's logits, as hepti's greedy choice reads them
        return int(np.argmax(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                                   shape=(n_vocab,))))

    t0 = time.perf_counter()
    llm.eval(ids)
    tok = greedy()
    t1 = time.perf_counter()
    for _ in range(args.tokens):
        llm.eval([tok])
        tok = greedy()
    t2 = time.perf_counter()
    print(json.dumps({"prompt_tokens": len(ids), "decode_tokens": args.tokens,
                      "prefill_tok_s": len(ids) / (t1 - t0),
                      "decode_tok_s": args.tokens / (t2 - t1)}))
    return 0


# --- command line ------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--variants", default="dllama:1,dllama:2,llamacpp:1,hepti:tensor:2",
                   help="comma-separated: dllama:N (distributed-llama, N nodes: a power of two "
                        "that divides the attention and KV heads), llamacpp:THREADS (one "
                        "device), hepti:STRATEGY:N (`hepti generate`, N ranks; "
                        "with :quota under --cluster, held by the CPU quota alone as the peers "
                        "are, not by hepti's stretch). Default: %(default)s")
    p.add_argument("--cluster", metavar="SPEC.json",
                   help="run every variant under `hepti emulate --cluster SPEC` (root), rank i "
                        "on device i; default: this machine, workers on 127.0.0.1")
    p.add_argument("--model", help="hepti's converted decoder (weights/llama-1b)")
    p.add_argument("--hf", help="its Hugging Face export (`hepti convert --export-hf DIR`), "
                                "converted for distributed-llama with its own converters")
    p.add_argument("--gguf", help="its GGUF export (`hepti convert --export-gguf FILE`), for "
                                  "llama.cpp")
    p.add_argument("--dllama", metavar="PATH",
                   help="a distributed-llama checkout built by hand (`make dllama`), or its "
                        "dllama binary; hepti never builds or ships it")
    p.add_argument("--dllama-dir", help="where its .m/.t files are made (default HF-dllama)")
    p.add_argument("--dllama-model", help="its .m file, made before (skips the conversion)")
    p.add_argument("--dllama-tokenizer", help="its .t file, made before")
    p.add_argument("--dllama-weights", choices=sorted(BUFFER_TYPE), default="f32",
                   help="the weight type its converter writes: f32, or q40 (its 4-bit blocks, "
                        "run with q80 buffers, as its README advises; compare with hepti's "
                        "int8). Default f32")
    p.add_argument("--dllama-threads", type=int, default=1,
                   help="threads per distributed-llama node (default 1)")
    p.add_argument("--dllama-port", type=int, default=DLLAMA_PORT,
                   help=f"workers' port (default {DLLAMA_PORT}; off the emulator port + rank)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (raw text)")
    p.add_argument("--tokens", type=at_least(1), default=32, help="tokens to decode (default 32)")
    p.add_argument("--rounds", type=at_least(1), default=3,
                   help="rounds, each running every variant once, in turn (default 3)")
    p.add_argument("--baseline", help="the variant to divide by (default: the first peer)")
    p.add_argument("--timeout", type=float, default=1800, help="per launch, seconds")
    p.add_argument("--workdir", help="rendezvous folder of the distributed-llama ranks")
    p.add_argument("--out", default="results/llm.json", help="the JSON (default %(default)s)")


def main(argv=None) -> int:
    """`python -m hepti.bench.llm [OPTIONS]` is `hepti bench llm`; `rank` and `llamacpp` are
    what its launches run inside mpiexec (one rank of distributed-llama, llama.cpp on one
    device), not for users."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["rank"]:
        r = argparse.ArgumentParser(prog="python -m hepti.bench.llm rank")
        r.add_argument("--rendezvous", required=True)
        r.add_argument("--port", type=int, default=DLLAMA_PORT)
        r.add_argument("--threads", type=int, default=1, help="each worker's --nthreads")
        r.add_argument("program", nargs=argparse.REMAINDER, help="-- DLLAMA inference ARGS...")
        args = r.parse_args(argv[1:])
        args.program = args.program[1:] if args.program[:1] == ["--"] else args.program
        return rank_main(args)
    if argv[:1] == ["llamacpp"]:
        c = argparse.ArgumentParser(prog="python -m hepti.bench.llm llamacpp")
        c.add_argument("--gguf", required=True)
        c.add_argument("--threads", type=int, default=1)
        c.add_argument("--prompt", required=True)
        c.add_argument("--tokens", type=int, default=32)
        return llamacpp_main(c.parse_args(argv[1:]))
    return registry.main("llm", argv)


if __name__ == "__main__":
    sys.exit(main())
