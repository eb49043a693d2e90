"""Every benchmark by name: `hepti bench NAME [OPTIONS]`.

A bench is a module of hepti.bench with `add_arguments(parser)` (its options) and `run(args)`
(an exit code). This table names each one and says in a line what it measures; `hepti bench
--help` lists it, and the module is imported only when its bench runs (or explains itself), so
`hepti --help` stays fast. `python -m hepti.bench.MODULE` runs the same bench, through `main`.

To add a bench: a module with those two functions, one line here, a test that its `--help`
works (tests/test_bench_harness.py covers every entry), and its command line in
docs/results/NAME.md.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from hepti.errors import HeptiError

# name -> (module under hepti.bench, what it measures in one line)
BENCHES: dict[str, tuple[str, str]] = {
    "kernels": ("kernels", "GFLOP/s of hepti's GeMM against numpy's, single-threaded, interleaved"),
    "model": ("model", "single-thread forward latency of a converted encoder, and PyTorch's"),
    "solver": ("solver", "the planner's solve time on random declared clusters of 2-32 devices"),
    "comm": ("comm", "under mpiexec -n N: hepti's row verbs against MPI's collectives"),
    "int8": ("int8", "int8 weights against float32: GeMV GB/s of weight bytes, GeMM GFLOP/s"),
    "membw": ("membw", "this machine's memory read bandwidth: one core against all at once"),
    "conv": ("convbench", "the convolution kernels: im2col + GeMM against in place, depthwise"),
    "cnn-single": ("cnnsingle", "one CNN on one device: hepti against PyTorch and onnxruntime"),
    "cnn-ops": ("cnnops", "ResNet-50 op by op, one thread: hepti against onnxruntime's node profile"),
    "cnn-program": ("cnn_program", "a CNN's band split priced three ways: program, CoEdge, measured"),
    "scaling": ("scaling", "1 rank against N ranks for each strategy, at even shares"),
    "fit": ("fit", "the planner's predicted latency against the measured one, N local ranks"),
    "hetero": ("hetero", "every strategy on emulated heterogeneous clusters (sudo)"),
    "geneflow": ("geneflow", "GenEFlow's genetic plans against the LP's, predicted and measured"),
    "offload": ("offload", "one layer chain offloaded in shares 0 to 1 to an emulated second device (sudo)"),
    "slowdown": ("slowdown", "how the emulator slows a device: CPU quota against time stretch (sudo)"),
    "adapt": ("adapt", "re-planning a service under drift, hangs and flapping links (sudo)"),
    "stall": ("stall", "a service's answer to a stalled or killed rank, and re-admission"),
    "serve": ("serve", "hepti serve's throughput and latency at 1-16 clients, and a file job's"),
    "file": ("filejob", "the file job: lines embedded to a file on N ranks, wall time and RSS"),
    "against": ("against", "this tree's latency against commit REV's, interleaved"),
    "order": ("order", "operator orders' peak activation memory: BTSearch, exact, random"),
    "order-exec": ("order_exec", "the executors' measured peak memory against the order's model"),
    "llm": ("llm", "decode tokens/s of a decoder against distributed-llama and llama.cpp, same devices"),
    "decoder-accuracy": ("decoder_accuracy", "int8 against float32: a decoder's perplexity, top-1 agreement on a text"),
}


def module(name: str):
    """The bench's module (imported now)."""
    if name not in BENCHES:
        raise KeyError(f"no bench {name!r}; the benches are: {', '.join(BENCHES)}")
    return importlib.import_module(f"hepti.bench.{BENCHES[name][0]}")


def name_of(module_name: str) -> str:
    """The bench name of a module of hepti.bench (`hepti.bench.filejob` -> `file`)."""
    short = module_name.rpartition(".")[2]
    for name, (mod, _) in BENCHES.items():
        if mod == short:
            return name
    raise KeyError(f"{module_name} is not a registered bench")


def build_parser(name: str) -> argparse.ArgumentParser:
    """The bench's own options, its docstring as the description."""
    mod = module(name)
    ap = argparse.ArgumentParser(prog=f"hepti bench {name}", description=mod.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    mod.add_arguments(ap)
    return ap


def main(name: str, argv=None) -> int:
    """Parse argv with the bench's options and run it. Bad input ends with its message and exit
    code 2, a failed launch with its (the command and the tail of its stderr) and exit code 1,
    neither with a traceback."""
    from hepti.bench.harness import LaunchError  # local: start-up time (hepti bench --help)
    args = build_parser(name).parse_args(argv)
    try:
        return module(name).run(args) or 0
    except HeptiError as e:  # bad input: what was wrong and how to fix it
        print(f"hepti bench {name}: error: {e}", file=sys.stderr)
        return 2
    except LaunchError as e:
        print(f"hepti bench {name}: error: {e}", file=sys.stderr)
        return 1


def module_main(module_name: str) -> int:
    """`python -m hepti.bench.MODULE ARGS`: the same as `hepti bench NAME ARGS`."""
    return main(name_of(module_name), sys.argv[1:])
