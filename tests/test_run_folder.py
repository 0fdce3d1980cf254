"""A tidy ``outputs/`` (issue S, deliverable 8): run folders named by the launch's start and its plan, the same on
every rank and after a torchrun restart; a failed launch's folder removed or marked; the run's records in its
``train.log``; plan files named by the hash they hold. In-process: the torchrun environment is set by hand."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv, launch_started, run_id
from cfp_megatron.engine.metrics import MetricsLog
from cfp_megatron.engine.rank_watch import RunInterrupted
from cfp_megatron.planner.launch_plan import INPUTS_INDEX, stored_plan
from cfp_megatron.planner.run_folder import ERROR_FILE, end_failed, settle

HASH = "0123456789abcdef"
ERR = ConfigError(ConfigIssue(key="parallel.tp", value=3, problem="does not divide 4.", fix="use 2."))


def _env(rank: int, *, local_rank: int | None = None, restart: int = 0) -> LaunchEnv:
    return LaunchEnv(rank=rank, world_size=2, local_rank=rank if local_rank is None else local_rank,
                     local_world_size=2, restart_count=restart, under_torchrun=True)


@pytest.fixture
def torchrun(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as a rank of a ``--standalone`` torchrun launch."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "5f3e9a1c-77aa-4b1e-9d2c-0e1f2a3b4c5d")


def _pending(base: Path) -> Path:
    folder = base / run_id(str(base))
    (folder / ".hydra").mkdir(parents=True)
    (folder / ".hydra" / "config.yaml").write_text("x: 1\n")
    (folder / "train.log").write_text("")
    return folder


def test_the_first_name_is_the_launch_start_and_id_and_every_rank_agrees(torchrun: None, tmp_path: Path) -> None:
    name = run_id(str(tmp_path))
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_launch-5f3e9a1c-77a", name), name
    assert run_id(str(tmp_path)) == name and launch_started() == launch_started()  # the agent's start, read alike


def test_rank_0_names_the_folder_by_the_plan_and_a_restart_finds_it(torchrun: None, tmp_path: Path) -> None:
    first = _pending(tmp_path)
    stamp = first.name.partition("_launch-")[0]
    settled = settle(first, HASH, _env(0))
    assert settled == tmp_path / f"{stamp}_{HASH}" and settled.is_dir() and not first.exists()
    assert (settled / ".hydra" / "config.yaml").read_text() == "x: 1\n"
    assert run_id(str(tmp_path)) == settled.name  # a torchrun restart of the launch resolves the named folder
    assert settle(settled, HASH, _env(0)) == settled  # named already


def test_a_taken_name_gets_a_count_and_a_folder_the_user_named_is_left(torchrun: None, tmp_path: Path) -> None:
    stamp = run_id(str(tmp_path)).partition("_launch-")[0]
    (tmp_path / f"{stamp}_{HASH}").mkdir()
    assert settle(_pending(tmp_path), HASH, _env(0)).name == f"{stamp}_{HASH}-2"
    mine = tmp_path / "my_run"
    mine.mkdir()
    assert settle(mine, HASH, _env(0)) == mine and mine.is_dir()
    assert settle(None, HASH, _env(0)) is None


def test_other_ranks_drop_the_empty_copy_their_hydra_made_once_rank_0_renamed(torchrun: None,
                                                                              tmp_path: Path) -> None:
    first = _pending(tmp_path)
    assert settle(first, HASH, _env(1)).name.endswith(HASH) and first.is_dir()  # rank 0's, not renamed yet: left
    settled = settle(first, HASH, _env(0))
    first.mkdir()  # rank 1's Hydra, starting after rank 0 renamed the folder
    assert settle(first, HASH, _env(1)) == settled and not first.exists()


def test_a_launch_that_failed_before_any_result_leaves_no_folder(torchrun: None, tmp_path: Path) -> None:
    first = _pending(tmp_path)
    end_failed(first, ERR, _env(1))
    assert first.is_dir()  # rank 0 decides
    end_failed(first, ERR, _env(0))
    assert list(tmp_path.iterdir()) == []


def test_a_failed_run_with_results_is_marked_failed_with_its_error(torchrun: None, tmp_path: Path) -> None:
    settled = settle(_pending(tmp_path), HASH, _env(0))
    (settled / "metrics.jsonl").write_text("{}\n")
    end_failed(tmp_path / "gone", ERR, _env(0))  # a folder that is not there: nothing
    assert not (tmp_path / "gone").exists()
    end_failed(settled, ERR, _env(0))
    (failed,) = tmp_path.iterdir()
    assert failed.name == f"{settled.name}_failed" and (failed / "metrics.jsonl").is_file()
    assert "parallel.tp=3: does not divide 4." in (failed / ERROR_FILE).read_text()


def test_a_stopped_run_is_marked_stopped_and_a_user_folder_only_gets_the_error(torchrun: None,
                                                                              tmp_path: Path) -> None:
    settled = settle(_pending(tmp_path), HASH, _env(0))
    (settled / "metrics.jsonl").write_text("{}\n")
    end_failed(settled, RunInterrupted("stopped by Ctrl-C at step 3"), _env(0))
    assert [p.name for p in tmp_path.iterdir()] == [f"{settled.name}_stopped"]
    mine = tmp_path / "my_run"
    (mine / ".hydra").mkdir(parents=True)
    end_failed(mine, ERR, _env(0))
    assert mine.is_dir() and "parallel.tp=3" in (mine / ERROR_FILE).read_text()


def test_the_run_log_file_holds_the_records_the_console_shows(tmp_path: Path, capsys) -> None:
    log_file = tmp_path / "train.log"
    handler = logging.FileHandler(log_file)  # what Hydra's job logging gives the root logger on rank 0
    logging.getLogger().addHandler(handler)
    try:
        log = MetricsLog(None, True)
        log.event("start", model="gpt_tiny", steps=3)
        log.event("end", step=3)
    finally:
        logging.getLogger().removeHandler(handler)
        handler.close()
    shown = capsys.readouterr().out
    text = log_file.read_text()
    assert "gpt_tiny" in shown and "gpt_tiny" in text and "end | step 3" in text


def test_a_plan_file_is_found_by_its_inputs_and_named_by_its_hash(tmp_path: Path) -> None:
    folder = tmp_path / "cfp"
    folder.mkdir()
    assert stored_plan(folder, "abc") is None
    (folder / f"plan-{HASH}.json").write_text("{}")
    (folder / f"{INPUTS_INDEX}abc").write_text(f"plan-{HASH}.json\n")
    assert stored_plan(folder, "abc") == folder / f"plan-{HASH}.json"
    (folder / f"{INPUTS_INDEX}bad").write_text("../../etc/passwd\n")
    assert stored_plan(folder, "bad") is None
