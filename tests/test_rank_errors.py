"""A config error under torchrun is always said: once per node by its first rank (which fills torchrun's error file, so
torchrun's closing summary shows it), with the other ranks exiting only after it is out.

In-process checks of every rank's path (quick), and a drill that launches torchrun with 2 and 4 ranks repeatedly,
rank 0 held back so the other ranks reach the error first (the case that used to print nothing)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.planner import rank_errors
from cfp_megatron.planner.entry import main_with_errors
from cfp_megatron.planner.rank_errors import MARKER, report_error
from tests.launcher import torchrun_command

BAD = ["parallel.tp=3"]
"""Three-way tensor parallelism on 2 or 4 ranks: world size and heads not divisible."""
EXPECTED = "parallel.tp=3: world size"


class _Stderr(io.StringIO):
    """A stderr that records, at each flush, whether the node's marker existed already."""

    def __init__(self, marker: Path) -> None:
        super().__init__()
        self.marker = marker
        self.marker_at_flush: list[bool] = []

    def flush(self) -> None:
        self.marker_at_flush.append(self.marker.exists())
        super().flush()


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, rank: int, local_rank: int,
                  world: int = 2) -> Path:
    """Set the variables torchrun gives a worker; return its error file (``attempt_0/<local rank>/error.json``)."""
    error_file = tmp_path / "attempt_0" / str(local_rank) / "error.json"
    error_file.parent.mkdir(parents=True)
    for key, value in {"RANK": rank, "LOCAL_RANK": local_rank, "WORLD_SIZE": world, "LOCAL_WORLD_SIZE": world,
                       "TORCHELASTIC_ERROR_FILE": error_file}.items():
        monkeypatch.setenv(key, str(value))
    return error_file


def _config_error(world: int = 2) -> ConfigError:
    """The real ConfigError of ``parallel.tp=3`` on ``world`` ranks."""
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.planner.job_checks import validate_job

    with pytest.raises(ConfigError) as info:
        validate_job(job_from_config(compose_config(BAD)), world)
    return info.value


def test_first_rank_prints_flushes_then_marks_and_fills_torchruns_summary(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = _torchrun_env(monkeypatch, tmp_path, rank=0, local_rank=0)
    monkeypatch.setattr(rank_errors, "LEAVE_WAIT_S", 0.1)  # rank 1 is not there to leave
    marker = tmp_path / "attempt_0" / MARKER
    err = _Stderr(marker)
    monkeypatch.setattr(sys, "stderr", err)
    with pytest.raises(SystemExit) as info:
        main_with_errors(compose_config(BAD))
    assert info.value.code == 2
    text = err.getvalue()
    assert text.startswith("cfp-megatron: ConfigError\n") and EXPECTED in text and "Fix:" in text
    assert err.marker_at_flush and err.marker_at_flush[0] is False  # flushed before the marker was written
    assert marker.exists()
    # what torchrun's agent reads and prints last: our message as the root cause
    ours = ProcessFailure(local_rank=0, pid=1, exitcode=2, error_file=str(error_file))
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-15, error_file=str(tmp_path / "none.json"))
    summary = ChildFailedError("launch/train.py", {0: ours, 1: killed}).format_msg()
    root = summary.split("Root Cause (first observed failure):")[1]
    assert "rank      : 0" in root and "cfp-megatron: ConfigError" in root and EXPECTED in root


def test_other_rank_waits_for_the_first_and_says_nothing_but_to_torchrun(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """It prints nothing, but fills its own error file: when it exits first, torchrun's root cause is this rank."""
    error_file = _torchrun_env(monkeypatch, tmp_path, rank=1, local_rank=1)
    marker = tmp_path / "attempt_0" / MARKER
    config_error = _config_error()
    out = io.StringIO()
    timer = threading.Timer(0.3, lambda: marker.write_text("0\n"))  # rank 0 marks its message printed
    timer.start()
    try:
        printed = report_error(config_error, LaunchEnv.read(), stream=out)
    finally:
        timer.join()
    assert printed is False and marker.exists()
    assert out.getvalue() == ""
    waited = ProcessFailure(local_rank=1, pid=2, exitcode=2, error_file=str(error_file))
    killed = ProcessFailure(local_rank=0, pid=1, exitcode=-15, error_file=str(tmp_path / "none.json"))
    root = ChildFailedError("launch/train.py", {1: waited, 0: killed}).format_msg().split("Root Cause")[1]
    assert "rank      : 1" in root and "cfp-megatron: ConfigError [rank 1]" in root and EXPECTED in root


def test_a_rank_that_left_the_saying_to_the_first_ends_quietly_with_status_0(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """So that torchrun's closing summary lists one failure (the rank that said it), not a second one per rank."""
    _torchrun_env(monkeypatch, tmp_path, rank=1, local_rank=1)
    marker = tmp_path / "attempt_0" / MARKER
    marker.write_text("0\n")  # rank 0 has said it
    assert report_error(_config_error(), LaunchEnv.read(), stream=io.StringIO()) is False

    def ended(status: int) -> None:
        raise SystemExit(status)

    monkeypatch.setattr(rank_errors.os, "_exit", ended)
    with pytest.raises(SystemExit) as info:
        rank_errors.end_rank(2)
    assert info.value.code == 0
    assert (marker.parent / f"{rank_errors.LEFT}1").read_text() == f"{os.getpid()}\n"
    marker.unlink()  # a later error that rank 0 never says: this rank says it, and ends with the status
    printed = report_error(_config_error(), LaunchEnv.read(), stream=io.StringIO(), wait_s=0.0)
    with pytest.raises(SystemExit) as info:
        rank_errors.end_rank(2)
    assert printed and info.value.code == 2


def test_the_printing_rank_ends_after_the_ranks_that_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    _torchrun_env(monkeypatch, tmp_path, rank=0, local_rank=0)
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
    try:
        (tmp_path / "attempt_0" / f"{rank_errors.LEFT}1").write_text(f"{other.pid}\n")
        assert report_error(_config_error(), LaunchEnv.read(), stream=io.StringIO()) is True
        assert other.poll() is not None  # it had ended (a zombie until reaped) when rank 0 went on to end
    finally:
        other.kill()
        other.wait()


def test_other_rank_says_it_itself_when_the_first_never_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    error_file = _torchrun_env(monkeypatch, tmp_path, rank=3, local_rank=1, world=4)
    monkeypatch.setattr(rank_errors, "WAIT_S", 0.2)
    out = io.StringIO()
    assert report_error(_config_error(4), LaunchEnv.read(), stream=out) is True
    assert out.getvalue().startswith("cfp-megatron: ConfigError [rank 3]\n") and EXPECTED in out.getvalue()
    assert EXPECTED in error_file.read_text()
    assert not (tmp_path / "attempt_0" / MARKER).exists()  # only a node's first rank marks


def test_first_rank_of_another_node_says_it_with_its_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, tmp_path, rank=2, local_rank=0, world=4)
    monkeypatch.setattr(rank_errors, "LEAVE_WAIT_S", 0.1)
    out = io.StringIO()
    assert report_error(_config_error(4), LaunchEnv.read(), stream=out) is True
    assert out.getvalue().startswith("cfp-megatron: ConfigError [rank 2]\n")
    assert (tmp_path / "attempt_0" / MARKER).read_text() == "2\n"


def test_without_torchruns_error_file_every_rank_says_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "TORCHELASTIC_ERROR_FILE": ""}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(rank_errors, "WAIT_S", 60.0)  # not waited for: there is no marker to wait on
    out = io.StringIO()
    assert report_error(_config_error(), LaunchEnv.read(), stream=out) is True
    assert EXPECTED in out.getvalue()


# ------------------------------------------------------------------------------------------------ torchrun drill
HOLD_BACK = """import os, time
if os.environ.get("RANK") == "0" and os.environ.get("CFP_HOLD_RANK0_S"):
    time.sleep(float(os.environ["CFP_HOLD_RANK0_S"]))
"""
"""sitecustomize.py for the drill: rank 0 starts late, so the other ranks reach the config error first."""


@pytest.mark.drill
@pytest.mark.parametrize("nproc", [2, 4])
def test_torchrun_always_shows_a_config_error(nproc: int, tmp_path: Path) -> None:
    """5 launches each (about 1-2 minutes apiece on a loaded 2-core machine): message present, exit non-zero."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HOLD_BACK)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CFP_HOLD_RANK0_S": "3",
           "PYTHONPATH": os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])])}
    for attempt in range(5):
        run_dir = tmp_path / f"run{attempt}"
        proc = subprocess.run(torchrun_command(nproc, [*BAD, f"hydra.run.dir={run_dir}"]), cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        assert proc.returncode != 0, output
        assert "cfp-megatron: ConfigError" in output and EXPECTED in output, output
        summary = output.rsplit("Root Cause (first observed failure):", 1)[-1]
        assert EXPECTED in summary, output  # torchrun's closing block names it too
        time.sleep(0.1)


def test_a_later_launch_in_one_process_forgets_an_earlier_launchs_error_claim(tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A launch that ended with an error after its process group existed leaves its claim on saying it; a later
    launch in the same process (a notebook, the tests) must not take that claim for its own error and end the process
    without Python's shutdown (``exit_now``): its config error is a plain ``SystemExit(2)``."""
    from cfp_megatron.engine import rank_watch
    from cfp_megatron.planner import rank_errors

    _torchrun_env(monkeypatch, tmp_path, rank=0, local_rank=0, world=1)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    monkeypatch.setattr(rank_watch._state, "error", rank_watch.Turn(store=None, name="error", mine=True))

    def no_exit_now(status: int) -> None:
        raise AssertionError(f"exit_now({status}) for an error of this launch that no process group has seen")

    monkeypatch.setattr(rank_errors, "exit_now", no_exit_now)
    with pytest.raises(SystemExit) as info:
        main_with_errors(compose_config(BAD))
    assert info.value.code == 2 and rank_watch._state.error is None
