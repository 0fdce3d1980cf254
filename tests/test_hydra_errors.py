"""Hydra's composition failures as one clear error (issue R, deliverable 6): every override Hydra refuses, or accepts
silently (``~model``), is one :class:`ConfigError` naming the key and the fix (``+cfp=auto``, the nearest key, the
group's options), said once per job with exit status 2 before Hydra runs; ``hydra.run.dir`` empty is refused; Hydra's
own flags keep working.

In-process checks of the composition and of ``launch/train.py``'s command-line check, and one short torchrun launch
(a typo on 2 ranks: said once, nothing created)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cfp_megatron.base import compose
from cfp_megatron.base.compose import compose_config, default_groups, group_options, repeated_overrides
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.planner.entry import check_run_dir_arg
from cfp_megatron.planner.hydra_args import check_command_line, check_hydra_args, read_hydra_args
from tests.launcher import torchrun_command

REFUSED = [
    (["cfp.tp=2"], "cfp.tp", "+cfp=auto cfp.tp=2"),
    (["cfp.constraints.tp=[2,4]"], "cfp.constraints.tp", "+cfp=auto"),
    (["train.step=5"], "train.step", "train.steps=5"),
    (["trian.steps=5"], "trian.steps", "train.steps=5"),
    (["num_layers=3"], "num_layers", "model.num_layers=3"),
    (["+cfp=auto", "cfp.tpp=2"], "cfp.tpp", "cfp.tp=2"),
    (["+model.not_a_key=1"], "model.not_a_key", "the keys of model are"),
    (["+train.steps=5"], "train.steps", "drop the +: train.steps=5"),
    (["~model.num_layers"], "model.num_layers", "leave it out"),
    (["model=gpt_tini"], "model", "model=gpt_tiny"),
    (["model=llama3-8b"], "model", "write model=llama3_8b."),  # case and separators do not count
    (["model=Llama3_8B"], "model", "write model=llama3_8b."),
    (["model=mixtral"], "model", "write model=mixtral_8x7b."),  # the start of an option's name
    (["cluster=h100"], "cluster", "write cluster=dgx_h100."),  # a whole part of an option's name (not h800)
    (["cluster=gb200"], "cluster", "write cluster=gb200_nvl72."),  # (not b200)
    (["train.seq=64"], "train.seq", "write train.seq_length=64."),
    (["model=llama_tiny.yaml"], "model", "model=llama_tiny"),
    (["model=../x"], "model", "llama3_8b"),
    (["model=[gpt_tiny,llama_tiny]"], "model", "not a list"),
    (["+model=llama_tiny"], "model", "drop the +: model=llama_tiny"),
    (["++model=llama_tiny"], "model", "drop the +: model=llama_tiny"),
    (["cfp=auto"], "cfp", "+cfp=auto"),
    (["~cfp"], "cfp", "drop ~cfp"),
    (["+cfp=null"], "cfp", "'auto', 'manual'"),
    (["+cfp=auto", "+cfp=manual"], "cfp", "add it once"),
    (["model.num_layers==3"], "model.num_layers", "model.num_layers=3"),
    (["model.num_layers='3"], "model.num_layers", "close it"),
    (["train.steps=[1"], "train.steps", "close them"),
    (["model.num_layers"], "model.num_layers", "model.num_layers=<value>"),
    (["model=gpt_tiny,llama_tiny"], "model", "add -m"),
    (["hydra.run.dri=/tmp/x"], "hydra.run.dri", "write hydra.run.dir=/tmp/x"),
    (["hydra/launcher=joblib"], "hydra/launcher", "--hydra-help lists them"),
    (["hydra.run.dir=/tmp/a,/tmp/b"], "hydra.run.dir", "add -m"),  # was Hydra's "Ambiguous value" of <override>
]


def test_the_nearest_name_is_a_near_twin_before_a_name_holding_the_word() -> None:
    """``train.step`` is ``train.steps`` (one letter), not ``train.memory_step`` (which holds ``step``); a bare
    ``tp`` is no key of another group's that happens to hold it."""
    keys = compose.schema_keys()
    assert compose.nearest("train.step", keys) == "train.steps"
    assert compose.nearest("tp", keys) is None
    assert compose.nearest("LOCAL", group_options("cluster")) == "local"
    assert compose.nearest("x", group_options("model")) is None


@pytest.mark.parametrize(("overrides", "key", "fix"), REFUSED, ids=[" ".join(r[0]) for r in REFUSED])
def test_an_override_hydra_refuses_is_one_error_naming_the_key_and_the_fix(overrides: list[str], key: str,
                                                                           fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        compose_config(overrides, typed=True)
    assert info.value.keys == [key], str(info.value)
    assert fix.lower() in str(info.value).lower()


@pytest.mark.parametrize("group", sorted(default_groups()))
@pytest.mark.parametrize("form", ["~{g}", "{g}=null", "{g}=", "{g}=' '", "~{g}={default}"])
def test_a_required_group_left_without_an_option_is_refused_with_its_options(group: str, form: str) -> None:
    override = form.format(g=group, default=default_groups()[group])
    with pytest.raises(ConfigError) as info:
        compose_config([override])
    assert info.value.keys == [group]
    assert "every job needs one" in str(info.value) and str(group_options(group)) in str(info.value)


def test_a_group_removed_by_any_other_way_is_refused_after_composition(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compose, "override_issues", lambda overrides, **_: [])  # as if nothing caught it before Hydra
    with pytest.raises(ConfigError) as info:
        compose_config(["~model"])
    assert info.value.keys == ["model"] and "has no option chosen" in str(info.value)


@pytest.mark.parametrize("overrides", [["+cfp=auto", "cfp.tp=2"], ["++train.steps=3"], ["hydra.run.dir=/tmp/x"],
                                       ["model=llama_tiny", "+cfp=manual"], ["+cfp=auto", "~cfp"]])
def test_what_hydra_takes_still_composes(overrides: list[str]) -> None:
    assert compose_config(overrides, typed=True).model.name


def test_an_option_from_an_added_search_path_is_left_to_hydra(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "mine.yaml").write_text((compose.CONF_DIR / "model" / "gpt_tiny.yaml").read_text())
    cfg = compose_config([f"hydra.searchpath=[file://{tmp_path}]", "model=mine"], typed=True)
    assert cfg.model.num_layers == compose_config([]).model.num_layers


def test_a_key_given_twice_is_said_once_naming_the_value_used(capsys: pytest.CaptureFixture[str],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    assert repeated_overrides(["train.steps=3", "model=gpt_tiny", "train.steps=3"]) == []
    [line] = repeated_overrides(["train.steps=3", "model=gpt_tiny", "train.steps=4"])
    assert line == "train.steps is given 2 times (train.steps=3, train.steps=4): Hydra uses the last, train.steps=4"
    monkeypatch.setenv("RANK", "0")
    assert compose_config(["train.steps=3", "train.steps=4"], typed=True).train.steps == 4
    assert capsys.readouterr().err == f"cfp: {line}\n"
    monkeypatch.setenv("RANK", "1")  # every rank composes the same overrides: rank 0 says it
    compose_config(["train.steps=3", "train.steps=4"], typed=True)
    assert capsys.readouterr().err == ""


def test_hydras_flags_are_read_as_hydra_reads_them() -> None:
    assert read_hydra_args(["-m", "train.steps=1,2"]).multirun
    assert read_hydra_args(["--help"]).help_only and read_hydra_args(["--cfg", "job"]).prints_only
    assert read_hydra_args(["--config-name", "other"]).own_config
    for argv, said in [(["--foo"], "--foo: not a flag"), (["--cfg", "jobx"], "invalid choice: 'jobx'")]:
        with pytest.raises(ConfigError, match=said):
            read_hydra_args(argv)


def test_a_multirun_is_checked_job_by_job_and_refused_on_several_ranks() -> None:
    check_hydra_args(read_hydra_args(["-m", "train.steps=1,2"]), world_size=1)
    check_hydra_args(read_hydra_args(["-m", "train.steps=1"]), world_size=2)  # one job: nothing to set up again
    with pytest.raises(ConfigError, match=r"did you mean gpt_tiny\? \(in the sweep's job model=gpt_tini\)"):
        check_hydra_args(read_hydra_args(["-m", "model=gpt_tiny,gpt_tini"]), world_size=1)
    with pytest.raises(ConfigError) as info:
        check_hydra_args(read_hydra_args(["-m", "train.steps=1,2"]), world_size=2)
    assert info.value.keys == ["-m"] and "one torchrun per job" in str(info.value)


def _rank(monkeypatch: pytest.MonkeyPatch, rank: int) -> io.StringIO:
    """Variables of a torchrun rank without torchrun's error file (the message is said at once); stderr captured."""
    for key, value in {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                       "TORCHELASTIC_ERROR_FILE": ""}.items():
        monkeypatch.setenv(key, str(value))
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    return err


def test_the_command_line_check_exits_2_with_the_message(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _rank(monkeypatch, 0)
    with pytest.raises(SystemExit) as info:
        check_command_line(["train.step=5"])
    assert info.value.code == 2
    assert err.getvalue().startswith("cfp-megatron: ConfigError\n") and "did you mean train.steps?" in err.getvalue()
    assert check_command_line(["--cfg", "job", "train.steps=5"]).prints_only  # rank 0 goes on to Hydra's print


def test_another_rank_leaves_hydras_printing_to_rank_0(monkeypatch: pytest.MonkeyPatch) -> None:
    err = _rank(monkeypatch, 1)
    with pytest.raises(SystemExit) as info:
        check_command_line(["--cfg", "job"])
    assert info.value.code == 0 and err.getvalue() == ""


@pytest.mark.parametrize(("argv", "key"), [(["hydra.run.dir="], "hydra.run.dir"),
                                           (["hydra.run.dir= "], "hydra.run.dir"),
                                           (["hydra.run.dir='  '"], "hydra.run.dir"),
                                           (["-m", "hydra.sweep.dir="], "hydra.sweep.dir")])
def test_an_empty_run_directory_is_refused(argv: list[str], key: str, monkeypatch: pytest.MonkeyPatch,
                                           tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    err = _rank(monkeypatch, 0)
    with pytest.raises(SystemExit) as info:
        check_run_dir_arg(argv)
    assert info.value.code == 2
    assert f"{key}=" in err.getvalue() and "is empty" in err.getvalue() and "current folder" in err.getvalue()
    assert list(tmp_path.iterdir()) == []


def test_a_typo_under_torchrun_is_said_once_and_creates_nothing(tmp_path: Path) -> None:
    """2 ranks, one message (not Hydra's message per rank), exit status 2 on rank 0 and 0 on rank 1 (torchrun's
    summary: one failure), no run folder (Hydra never ran). torchrun's own traceback and summary stay: it prints
    them for any rank that ends with a status other than 0."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(torchrun_command(2, ["train.step=5", f"hydra.run.dir={run_dir}"]), cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output
    said, _, summary = output.partition("launch/train.py FAILED")  # torchrun's closing summary repeats it
    root_cause = summary.partition("Root Cause (first observed failure):")[2]
    lines = [line.strip() for line in said.splitlines()]
    assert lines.count("cfp-megatron: ConfigError") == 1, output
    assert sum("did you mean train.steps? Fix: write train.steps=5." in line for line in lines) == 1, output
    assert "did you mean train.steps?" in root_cause and "exitcode  : 2" in root_cause
    # rank 1 left the saying to rank 0 and ended quietly first: torchrun lists one failure and stops no rank
    assert "<NO_OTHER_FAILURES>" in summary and "SIGTERM" not in output, output
    assert "HYDRA_FULL_ERROR" not in output and "Could not override" not in output
    assert not run_dir.exists()


@pytest.mark.parametrize(("override", "key"), [
    ("train.checkpoint_dir=''", "train.checkpoint_dir"),  # saved nothing, said nothing (and locked the cwd)
    ("train.metrics_file='  '", "train.metrics_file"),
    ("data.cache_dir=''", "data.cache_dir"),
    ("model.name=''", "model.name"),
    ("+cfp=manual cfp.plan_file=''", "cfp.plan_file")])
def test_an_empty_text_setting_is_refused_not_read_as_none_or_the_current_folder(override: str, key: str) -> None:
    from cfp_megatron.base.cfp_spec import cfp_from_config
    from cfp_megatron.base.config import job_from_config

    cfg = compose_config(override.split(" ", 1) if override.startswith("+") else [override], typed=True)
    with pytest.raises(ConfigError) as info:
        job_from_config(cfg)
        cfp_from_config(cfg)
    assert info.value.keys == [key] and "is empty (a shell variable that is not set?)" in str(info.value)


@pytest.mark.parametrize(("override", "key", "fix"), [
    ("train.checkpoint_dir='~/ck'", "train.checkpoint_dir", f"train.checkpoint_dir={Path.home() / 'ck'}"),
    ("data=indexed data.path=['~/corpus']", "data.path", f"data.path=[{Path.home() / 'corpus'}]")])
def test_a_quoted_home_path_is_refused_naming_the_full_path(override: str, key: str, fix: str) -> None:
    from cfp_megatron.base.config import job_from_config

    with pytest.raises(ConfigError) as info:
        job_from_config(compose_config(override.split(" ")))
    assert info.value.keys == [key] and "only a shell expands" in str(info.value) and fix in str(info.value)


@pytest.mark.parametrize("argv", [["train.checkpoint_dir=~/ck"], ["hydra.run.dir=~/runs"],
                                  ["hydra.run.dir='~/runs'"]])
def test_an_unquoted_or_run_folder_home_path_names_the_full_path(argv: list[str], monkeypatch: pytest.MonkeyPatch,
                                                                 tmp_path: Path) -> None:
    monkeypatch.chdir(tmp_path)
    err = _rank(monkeypatch, 0)
    with pytest.raises(SystemExit) as info:
        check_command_line(argv)
        check_run_dir_arg(argv)
    assert info.value.code == 2
    assert f"write the full path: {argv[0].partition('=')[0]}={Path.home()}/" in err.getvalue(), err.getvalue()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("argv", "key", "said"), [
    (["--config-name", "confg"], "--config-name", "did you mean config? Fix: write --config-name config."),
    (["--config-name", "nope", "train.steps=2"], "--config-name", "is not a config in"),
    (["--config-path", "/nope"], "--config-path", "/nope is not a folder"),
    (["--config-path", "conf"], "--config-path", "a relative --config-path is read from"),
    (["-cd", "/nope"], "--config-dir", "/nope is not a folder"),
    (["--config-name", "config", "train.step=5"], "train.step", "write train.steps=5")])
def test_hydras_config_flags_are_checked_before_hydra(argv: list[str], key: str, said: str) -> None:
    """Hydra says these in a paragraph on every rank, exit 1; the project's own config named by its flags is
    checked as without them."""
    with pytest.raises(ConfigError) as info:
        check_hydra_args(read_hydra_args(argv))
    assert info.value.keys == [key] and said in str(info.value)


def test_another_config_that_exists_is_left_to_hydra(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - config\n  - _self_\n")
    check_hydra_args(read_hydra_args(["-cd", str(tmp_path), "-cn", "mine", "train.step=5"]))
    check_hydra_args(read_hydra_args(["--config-path", str(compose.CONF_DIR), "--config-name", "config.yaml"]))


@pytest.mark.parametrize("value", ["true", "True"])
def test_moving_the_job_into_its_run_folder_is_refused(value: str) -> None:
    """Relative paths would silently mean folders in a new run folder each run (a resume finds nothing)."""
    for argv in ([f"hydra.job.chdir={value}"], ["-m", f"hydra.job.chdir={value}", "train.steps=1,2"]):
        with pytest.raises(ConfigError) as info:
            check_hydra_args(read_hydra_args(argv))
        assert info.value.keys == ["hydra.job.chdir"] and "a resume would not find" in str(info.value)
    check_hydra_args(read_hydra_args(["hydra.job.chdir=false"]))


@pytest.mark.parametrize("override", ["hydra.run.dir=/tmp/x", "hydra.job.chdir=true", "hydra/job_logging=none"])
def test_a_command_that_only_composes_refuses_hydras_run_settings(override: str) -> None:
    """``python -m cfp_megatron.plan hydra.run.dir=...`` ignored it, silently; launch/train.py's Hydra reads it."""
    with pytest.raises(ConfigError) as info:
        compose_config([override], typed=True, runs_hydra=False)
    assert info.value.keys == [override.partition("=")[0]] and "would ignore it" in str(info.value)
    compose_config(["hydra.searchpath=[]"], typed=True, runs_hydra=False)  # it changes what is composed
