"""The ``cfp`` command: ``--help`` lists the config groups read from conf/ and the common keys, each subcommand runs
the same main as its ``python -m`` form, and the preflight names the defaults it used and what its plan needs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cfp_megatron import cli
from cfp_megatron.base.compose import CONF_DIR
from cfp_megatron.base.config_help import COMMON_KEYS, config_groups
from cfp_megatron.plan import load_plan
from cfp_megatron.planner import plan_cli

_TABLE_CHARS = re.compile(r"[┏┃┡│└━┳╇┓┩┗┛┻─]")


def test_cfp_help_lists_every_group_option_and_the_common_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for sub in cli.SUBCOMMANDS:
        assert re.search(rf"^  {sub}\s+\S", out, re.M), sub
    groups = config_groups()
    assert {"model", "cluster", "parallel", "train", "cfp", "backend", "data"} <= set(groups)
    for group, (options, _) in groups.items():
        line = out[out.index(f"  {group} "):]
        for option in options:
            assert re.search(rf"\b{option}\b", line), (group, option)
    assert set(groups["model"][0]) == {p.stem for p in (CONF_DIR / "model").glob("*.yaml")}
    assert "gpt_tiny*" in out and "local*" in out  # the defaults conf/config.yaml composes
    for group in COMMON_KEYS:
        for name in group.fields:
            assert re.search(rf"^  {re.escape(group.prefix)}\.{name}\s+\S", out, re.M), f"{group.prefix}.{name}"
    # one line each, described by the spec's docstring, with the default from conf/
    assert re.search(r"^  train\.global_batch_size\s+Sequences per optimizer step.*\[default 8\]$", out, re.M)


def test_subcommand_help_is_the_python_m_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        plan_cli.main(["--help"])
    assert done.value.code == 0
    direct = capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["plan", "--help"])
    assert capsys.readouterr().out == direct
    assert "Hydra config groups" in direct and "parallel.tp" in direct and "cfp.constraints.<knob>" in direct
    with pytest.raises(SystemExit):
        cli.main(["profile", "--help"])
    assert "train.seq_length" in capsys.readouterr().out
    assert cli.main(["train", "--help"]) == 0
    assert "torchrun --nproc_per_node=N" in capsys.readouterr().out


def test_unknown_subcommand_is_refused_with_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["model=llama3_8b"]) == 2
    err = capsys.readouterr().err
    assert "unknown subcommand 'model=llama3_8b'" in err and "plan, size, analyze, validate, profile, train" in err
    assert cli.main([]) == 2


def _normalised(text: str, out: Path) -> list[str]:
    return [line for line in text.replace(str(out), "<out>").splitlines()
            if not line.startswith("searched ")]  # the search's own seconds


def test_cfp_plan_equals_python_m_plan_and_names_defaults_and_requirements(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=4"]
    assert plan_cli.main([*args, "--out", str(tmp_path / "a")]) == 0
    direct = capsys.readouterr().out
    assert cli.main(["plan", *args, "--out", str(tmp_path / "b")]) == 0
    via_cfp = capsys.readouterr().out
    assert _normalised(direct, tmp_path / "a") == _normalised(via_cfp, tmp_path / "b")
    (first,), (second,) = (list((tmp_path / d).glob("*/plan.json")) for d in "ab")
    assert json.loads(first.read_text())["hash"] == json.loads(second.read_text())["hash"]

    # the defaults it used, each with its key; the keys given are not among them
    block = direct[direct.index("defaults used"):]
    block = block[:block.index("\n\n")] if "\n\n" in block else block
    block = _TABLE_CHARS.split(block)[0]
    assert re.search(r"^  train\.global_batch_size\s+8\s+.*at most 8-way on these 32 ranks", block, re.M)
    assert re.search(r"^  train\.precision\s+auto\s+bf16 on GPUs", block, re.M)
    assert re.search(r"^  cfp\.constraints\.max_micro_batch\s+64\s", block, re.M)
    assert "cluster.nodes" not in block and not re.search(r"^  model\s", block, re.M)

    # what the plan needs, printed and in plan.json
    plan = load_plan(first)
    assert plan.parallel.tp_comm_overlap and any("tp_comm_overlap" in r for r in plan.requires)
    assert "the plan needs:" in direct and "Transformer Engine" in direct

    assert plan_cli.main([*args, "train.global_batch_size=256", "train.precision=bf16",
                          "--out", str(tmp_path / "c")]) == 0
    given = capsys.readouterr().out
    block = _TABLE_CHARS.split(given[given.index("defaults used"):])[0]
    assert "train.global_batch_size" not in block and "train.precision" not in block
    assert "train.optimizer" in block
