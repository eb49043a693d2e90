"""Every strategy hepti knows, defined once: its name, what it splits, which executors run it
(hepti.families.EXECUTORS), whether a user may ask for it (`--strategy`) and whether a plan file
may record it. The CLI's choices and help, the planners' checks, plan files and the README's
table (tests/test_cli.py holds them together) all read `STRATEGIES`.
"""
from __future__ import annotations

from dataclasses import dataclass

INTERPRETER, BANDS = "interpreter", "bands"


@dataclass(frozen=True)
class Strategy:
    name: str
    what: str                      # what is split: for --help and the docs
    executors: tuple[str, ...]     # the executors that run it
    choosable: bool = True         # a --strategy choice
    in_plan: bool = True           # a plan file's `strategy`


STRATEGIES = (
    Strategy("auto", "profiles the devices, picks a strategy by memory status, solves the ratio "
             "vectors (a CNN: CoEdge's LP and the fusion)", (INTERPRETER, BANDS), in_plan=False),
    Strategy("proportional", "baseline: shares by compute speed alone, network ignored (MoDNN)",
             (INTERPRETER, BANDS), in_plan=False),
    Strategy("rows", "token rows by the ratio vector; weights replicated", (INTERPRETER,)),
    Strategy("tensor", "whole heads and FFN columns by the ratio vector; each rank holds only "
             "its slices", (INTERPRETER,)),
    Strategy("stream", "tensor, with only a window of layer slices in RAM, the next read from "
             "disk", (INTERPRETER,)),
    Strategy("even", "baseline: equal shares (Megatron-LM; a CNN: equal bands)",
             (INTERPRETER, BANDS)),
    Strategy("pipeline", "baseline: contiguous layer ranges per device (PipeEdge)",
             (INTERPRETER, BANDS)),
    Strategy("single", "rank 0 alone", (INTERPRETER, BANDS)),
    Strategy("grid", "a CNN's equal bands, every layer fused (DeepThings)", (BANDS,),
             in_plan=False),
    Strategy("bands", "a CNN's plan: fused groups of layers, each split by height (CoEdge) or "
             "its own way (GenEFlow)", (BANDS,), choosable=False),
    Strategy("mixed", "GenEFlow's plan: each layer's operators split their own way",
             (INTERPRETER,), choosable=False),
)
BY_NAME = {s.name: s for s in STRATEGIES}


def names(executor: str | None = None, *, choosable: bool | None = None,
          in_plan: bool | None = None) -> tuple[str, ...]:
    """The names of the strategies that `executor` runs (any, if None), filtered by the flags,
    in STRATEGIES' order."""
    return tuple(s.name for s in STRATEGIES
                 if (executor is None or executor in s.executors)
                 and (choosable is None or s.choosable == choosable)
                 and (in_plan is None or s.in_plan == in_plan))


def help_text(executor: str) -> str:
    """'name: what; ...' for the strategies a user may choose for `executor`."""
    return "; ".join(f"{s.name}: {s.what}" for s in STRATEGIES
                     if s.choosable and executor in s.executors)
