"""The family registry (hepti.families) and the strategies (hepti.plan.strategies), each defined
once: lookups go through them, and the commands, the job driver and serve name no family."""
from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from hepti import cli, families
from hepti.errors import ConfigError, InputError
from hepti.families import (EXECUTORS, FAMILIES, INPUT_KINDS, PLANNERS, config_from_dict, family,
                            family_graph, preset_config)
from hepti.plan import coedge, partition, planfile, strategies
from hepti.plan.strategies import BANDS, INTERPRETER, STRATEGIES
from hepti.runner import prepare

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "hepti"
# The commands, the job driver and serve ask the family record; they never test model_type.
NO_FAMILY_BRANCHES = ["cli.py", "runner.py", "parallel/engine.py", "parallel/distributed.py",
                      "parallel/plans.py", "parallel/single.py", "serve"]
BRANCH = re.compile(r"model_type\s*(==|!=|in\b|not in\b)|\.get\(\"model_type\"\)\s*(==|!=)")


def test_every_family_is_declared_whole():
    for mt, fam in FAMILIES.items():
        assert fam.model_type == mt
        assert fam.executor in EXECUTORS and fam.planner in PLANNERS
        assert fam.inputs and set(fam.inputs) <= set(INPUT_KINDS)
        assert fam.config.__dataclass_fields__["model_type"].default == mt
        if fam.executor != "decoder":
            assert fam.graph is not None
    assert set(FAMILIES) == {"bert", "vit", "cnn", "llama"}


def test_an_unknown_model_type_gets_one_error_listing_the_known_ones():
    for lookup in (lambda: family("gpt2"), lambda: config_from_dict({"model_type": "gpt2"}),
                   lambda: family_graph(type("C", (), {"model_type": "gpt2"})(), 1, 1)):
        with pytest.raises(ConfigError, match="unsupported model_type 'gpt2'; hepti supports: "
                                              "bert, vit, cnn, llama"):
            lookup()
    with pytest.raises(ConfigError, match="no model_type; hepti supports: bert, vit, cnn, llama"):
        config_from_dict({})


def test_the_config_class_comes_from_the_registry():
    for name, mt in (("tiny-odd", "bert"), ("vit-base", "vit"), ("resnet50", "cnn")):
        cfg = preset_config(name)
        assert isinstance(cfg, FAMILIES[mt].config) and family(cfg) is FAMILIES[mt]
    llama = config_from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 48,
                              "head_dim": 8})
    assert family(llama).executor == "decoder"


def test_only_interpreter_families_have_an_operator_graph():
    with pytest.raises(ValueError, match="no operator graph for model_type 'cnn'"):
        family_graph(preset_config("resnet50"), 1, 1)


def test_commands_job_and_serve_do_not_branch_on_model_type():
    hits = []
    for rel in NO_FAMILY_BRANCHES:
        paths = sorted((SRC / rel).rglob("*.py")) if (SRC / rel).is_dir() else [SRC / rel]
        for p in paths:
            for i, line in enumerate(p.read_text().splitlines(), 1):
                if BRANCH.search(line):
                    hits.append(f"{p.relative_to(SRC)}:{i}: {line.strip()}")
    assert not hits, "ask hepti.families.family(config) instead:\n" + "\n".join(hits)


def test_strategies_are_defined_once():
    assert cli.PLANNERS == strategies.names(choosable=True)
    assert partition.PLANNERS == strategies.names(INTERPRETER, choosable=True)
    assert coedge.CNN_STRATEGIES == strategies.names(BANDS, choosable=True)
    assert planfile.STRATEGIES == strategies.names(in_plan=True)
    assert len({s.name for s in STRATEGIES}) == len(STRATEGIES)


def test_the_readme_table_lists_every_transformer_strategy():
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("| `--strategy` |"):]
    table = table[:table.index("\n\n")]
    assert set(re.findall(r"`(\w+)`", table)) - {"--strategy"} == set(
        strategies.names(INTERPRETER, choosable=True))


def test_run_help_lists_the_strategies(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for s in STRATEGIES:
        if s.choosable:
            assert s.name in out
    assert families.FAMILIES  # the registry imports without starting MPI (tests/test_layers.py)


def test_hepti_run_refuses_a_decoder_by_its_executor():
    llama = config_from_dict({"model_type": "llama", "vocab_size": 64, "hidden_size": 32,
                              "num_hidden_layers": 1, "num_attention_heads": 4,
                              "num_key_value_heads": 2, "intermediate_size": 48, "head_dim": 8})
    args = argparse.Namespace(output=None, force=False, resume=False, report=None, trace=None,
                              top=None, normalize=False, pool="mean")
    with pytest.raises(InputError, match="is a Llama decoder .* runs the families whose executor "
                                         "is interpreter or bands: bert, vit, cnn"):
        prepare(args, llama, Path("m"))
