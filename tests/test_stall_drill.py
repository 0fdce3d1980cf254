"""Drills with real signals under torchrun (the catalogue's ``_stall_cases``, bench/bad_inputs.py): a rank stopped
with SIGSTOP is named by the rank that waited for it, within ``train.collective_timeout_s`` (10 s here), in training
(Megatron, DeepSpeed) and in profiling; ``kill -9`` of torchrun leaves no rank running; SIGINT to one rank, to
torchrun or to the whole job is one line naming the step and the last checkpoint, without a KeyboardInterrupt
traceback, and so are SIGTERM (a scheduler's) and SIGHUP (a closed terminal), to torchrun, a rank or the whole job,
under DeepSpeed and in profiling, also while a rank is blocked in a collective; a data file only one rank cannot
read is that rank's error, said once. About 20-60 s each on 2 cores."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.drill

_SPEC = importlib.util.spec_from_file_location("bad_inputs", Path(__file__).resolve().parent.parent / "bench"
                                               / "bad_inputs.py")
assert _SPEC is not None and _SPEC.loader is not None
bad_inputs = importlib.util.module_from_spec(_SPEC)
sys.modules.setdefault("bad_inputs", bad_inputs)
_SPEC.loader.exec_module(bad_inputs)

CASES = {case.id: case for case in bad_inputs._stall_cases()}


def _run(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    case = CASES[case_id]
    result = case.run(tmp_path)
    assert bad_inputs.classify(case, result) == "clear", result.output[-6000:]
    return bad_inputs.without_launcher_traceback(result.output)


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("stall-")])
def test_a_stalled_rank_is_named_once(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _run(case_id, tmp_path, monkeypatch)
    stalled = "0" if case_id == "stall-rank0-step" else "1"
    found = re.search(rf"^rank {stalled} \(host \S+, pid \d+\) in (step \d+ of 1000|profiling round .+?) \(for "
                      r"\d+ s\) stopped answering: rank \d waited 10 s \(train.collective_timeout_s\)", output,
                      flags=re.M)
    assert found, output[-4000:]
    assert "raise train.collective_timeout_s (now 10)" in output
    assert "Traceback" not in output


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("orphan-")])
def test_no_rank_outlives_its_launcher(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert "ended with their launcher" in _run(case_id, tmp_path, monkeypatch)


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("sigint-")])
def test_an_interrupt_is_one_line(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _run(case_id, tmp_path, monkeypatch)
    said = [line for line in output.splitlines() if line.startswith("cfp-megatron") and "interrupted" in line]
    assert len(said) == 1, output[-4000:]
    assert re.search(r"interrupted \(SIGINT\) at (step \d+ of 1000|the save of step \d+'s checkpoint); the last "
                     r"checkpoint is \S+iter_00000\d\d \(continue from it with train.resume=true\)", said[0]), said
    assert "KeyboardInterrupt" not in output and "Traceback" not in output


_STOPPED = (r"interrupted \((SIGTERM|SIGHUP): [^)]+\) at (step \d+ of 1000|the save of step \d+'s checkpoint|profiling "
            r"round .+?); (the last checkpoint is \S+(iter_00000\d\d|global_step\d+) \(continue from it with "
            r"train.resume=true\)|no checkpoint was saved by this run)\.$")


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith(("sigterm-", "sighup-"))])
def test_a_stop_signal_is_one_line_naming_it(case_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    output = _run(case_id, tmp_path, monkeypatch)
    said = [line for line in output.splitlines() if line.startswith("cfp-megatron") and "interrupted" in line]
    assert len(said) == 1, output[-4000:]
    found = re.search(_STOPPED, said[0])
    assert found and found.group(1) == ("SIGHUP" if case_id.startswith("sighup") else "SIGTERM"), said
    if "profile" not in case_id and "stalled" not in case_id:  # the runs that saved two checkpoints name the last
        assert "the last checkpoint is" in said[0], said
    if case_id == "sigterm-stalled-peer":  # said by rank 0, blocked in a collective with the stopped rank 1
        assert said[0].startswith("cfp-megatron: interrupted"), said
    assert "KeyboardInterrupt" not in output and "Traceback" not in output


def test_a_file_only_one_rank_cannot_read_is_that_rank_s_error(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    output = _run("rank1-cannot-read-data", tmp_path, monkeypatch)
    said, _, _ = output.partition("launch/train.py FAILED")  # torchrun's closing summary repeats it
    assert said.count("cfp-megatron: FileAccessError [rank 1]") == 1, output[-4000:]
    assert re.search(r"corpus\.bin cannot be used: permission denied \(in start-up", said), said[-2000:]
    assert "Traceback" not in output and "Exception ignored" not in output


@pytest.mark.parametrize("case_id", [c for c in CASES if c.startswith("kill9-")])
def test_a_rank_killed_is_said_once_by_the_ranks_left(case_id: str, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    output = _run(case_id, tmp_path, monkeypatch)
    said, _, summary = output.partition("launch/train.py FAILED" if "step" in case_id else "FAILED")
    lines = [line for line in said.splitlines() if line.startswith("cfp-megatron")]
    assert len(lines) == 1, output[-4000:]
    assert "Signal 9 (SIGKILL)" in summary  # torchrun names the killed rank
    assert "Traceback" not in output and "Connection closed by peer" not in output
