"""Profiles measured on a busy machine: the load read around each round, the round marked in the ProfileDB, its
entries measured again once the machine is quiet, the reuse line naming when and under what load; the MFU peak read
from the profile; the progress text. In process: simulated CPU counters, a one-rank gloo group for real rounds."""

from __future__ import annotations

import dataclasses
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from rich.console import Console

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import JobSpec, Precision
from cfp_megatron.engine import peak
from cfp_megatron.profile import load
from cfp_megatron.profile.db import ProfileDB, store_db
from cfp_megatron.profile.fingerprint import Fingerprint, current_fingerprint, model_key
from cfp_megatron.profile.progress import RoundProgress
from cfp_megatron.profile.records import (
    BUSY_OTHER_LOAD,
    GemmRecord,
    MachineLoad,
    PlanCheckRecord,
    RoundRecord,
    RoundStatus,
)
from cfp_megatron.profile.runner import (
    ProfileOutcome,
    _merge,
    _retry_busy,
    _run_rounds,
    busy_hint,
    entries_done,
    round_entries,
    share_note,
    status_text,
)

FP = Fingerprint(device_name="Test CPU", device_count=1, nodes=1, gpus_per_node=1, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)


@pytest.fixture(scope="module")
def job() -> JobSpec:
    return compose_job(["model=gpt_tiny", "cluster=local"])


@pytest.fixture()
def one_rank() -> Iterator[None]:
    """A one-rank gloo group, as the rounds sync their steps over the default group."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def _machine(monkeypatch: pytest.MonkeyPatch, *, busy: bool) -> None:
    """Simulated CPU counters: with ``busy``, other work keeps every core busy (ten times the cores' time, so the
    job's own CPU time never covers it); else the cores' busy time does not grow. The reference matmul at 1 TFLOP/s."""
    cores = os.cpu_count() or 1
    monkeypatch.delenv(load.LOAD_ENV, raising=False)  # read, not told (tests/conftest.py tells the others "quiet")

    def counters() -> tuple[float, float]:
        return 0.0, (10.0 * cores * time.perf_counter() if busy else 1.0)

    monkeypatch.setattr(load, "cpu_times", counters)
    monkeypatch.setattr(load, "reference_tflops", lambda: 1.0)


def test_the_busy_verdict_is_one_rule_for_rounds_and_plan_checks() -> None:
    assert MachineLoad(other_before=0.1, other_during=0.2, reference_tflops=1.0).busy is None
    assert "during the round" in (MachineLoad(other_during=BUSY_OTHER_LOAD + 0.1).busy or "")
    slow = MachineLoad(other_before=0.0, reference_tflops=0.3, quiet_reference_tflops=1.0)
    assert "reference matmul ran at 30%" in (slow.busy or "")
    check = PlanCheckRecord(model="m", plan="p", steps=3, predicted_step_s=1.0, calibration=1.0, measured_step_s=1.0,
                            predicted_peak_bytes=None, measured_peak_bytes=None, time=0.0,
                            other_load=BUSY_OTHER_LOAD + 0.1)
    assert check.busy == MachineLoad(other_before=BUSY_OTHER_LOAD + 0.1).busy.removesuffix(" before the round")


def test_round_records_keep_their_load_through_json_and_older_ones_read_as_quiet() -> None:
    record = RoundRecord(name="gemm", status=RoundStatus.ok, measured=("a",), time=1.7e9,
                         load=MachineLoad(other_before=0.9, other_during=0.8, reference_tflops=0.5))
    again = RoundRecord.from_json(record.to_json())
    assert again == record and again.busy is not None
    older = record.to_json()
    older.pop("load"), older.pop("time")
    assert RoundRecord.from_json(older).busy is None


def test_the_test_hook_tells_every_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = load.LoadWatch(ranks_here=1, nodes=1)
    monkeypatch.setattr(load, "reference_tflops", lambda: pytest.fail("timed the reference"))
    monkeypatch.setenv(load.LOAD_ENV, "busy")
    assert watch.after(watch.before(None)).busy is not None
    monkeypatch.setenv(load.LOAD_ENV, "quiet")
    assert watch.after(watch.before(None)) == MachineLoad(other_before=0.0, other_during=0.0)


def test_the_load_watch_tells_a_busy_machine_from_a_quiet_one(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = load.LoadWatch(ranks_here=1, nodes=1)
    _machine(monkeypatch, busy=True)
    reading = watch.after(watch.before(None))
    assert reading.other_before == pytest.approx(1.0) and reading.busy is not None
    _machine(monkeypatch, busy=False)
    reading = watch.after(watch.before(None))
    assert reading.other_before == 0.0 and reading.other_during == 0.0 and reading.busy is None
    assert reading.reference_tflops == 1.0


def _gemm_plan(job: JobSpec, db: ProfileDB | None, entries: list[str]) -> dict[str, Any]:
    planned = round_entries(job, 1, on_gpu=False)
    return {"rounds": {"gemm": entries}, "planned": {"gemm": planned["gemm"]}, "force": False, "classes": {},
            "model_key": model_key(job, on_gpu=False), "notes": [], "busy": {}, "quiet": None,
            "db": db.to_json() if db else None}


def test_a_round_on_a_busy_machine_is_marked_and_measured_again_once_quiet(
        job: JobSpec, one_rank: None, monkeypatch: pytest.MonkeyPatch) -> None:
    entries = round_entries(job, 1, on_gpu=False)["gemm"][:2]
    key = model_key(job, on_gpu=False)
    watch = load.LoadWatch(ranks_here=1, nodes=1)
    _machine(monkeypatch, busy=True)
    plan = _gemm_plan(job, None, entries)
    results = _run_rounds(job, plan, world=1, on_gpu=False, budget_s=600.0, started=time.perf_counter(), rank=0,
                          progress=None, watch=watch)
    record = results["gemm"][0]
    assert record.status is RoundStatus.ok and record.busy is not None and record.time is not None
    db = ProfileDB.from_json(_merge(ProfileDB(fingerprint=FP), job, plan, results, [record]).to_json())
    assert db.busy_entries("gemm", key, entries) == entries  # marked in the DB, per entry
    under, busy = db.measured_under(key, {"gemm": entries})
    assert "1 of 1 rounds on a busy machine" in under and busy and busy[0].startswith("gemm (other work used")
    # the next run: nothing is missing, but the busy entries are measured again when the machine is quiet ...
    later = {**_gemm_plan(job, db, []), "rounds": {}, "busy": {"gemm": entries}}
    _machine(monkeypatch, busy=False)
    retried = _retry_busy(later, watch)
    assert retried["rounds"] == {"gemm": entries} and "measuring again 2 entries" in retried["retry"]
    results = _run_rounds(job, retried, world=1, on_gpu=False, budget_s=600.0, started=time.perf_counter(), rank=0,
                          progress=None, watch=watch)
    quiet = results["gemm"][0]
    assert quiet.busy is None
    db = _merge(db, job, retried, results, [quiet])
    assert db.busy_entries("gemm", key, entries) == []
    assert "machine quiet (other work at most 0%" in db.measured_under(key, {"gemm": entries})[0]
    # two runs that each measured some entries busy: the round is named once
    half = {"gemm": entries[:1]}
    twice = db.merged(rounds=[dataclasses.replace(record, measured=(e,), time=1.8e9 + i)
                              for i, e in enumerate(entries)])
    assert twice.measured_under(key, {"gemm": entries})[0].endswith("1 of 1 rounds on a busy machine")
    assert twice.measured_under(key, half)[1] == [f"gemm ({record.busy})"]
    # ... and kept, with a note, when it is busy then too
    _machine(monkeypatch, busy=True)
    kept = _retry_busy(later, watch)
    assert kept["rounds"] == {} and "busy now too" in kept["retry"]
    said = busy_hint(ProfileOutcome(db=None, path=None, reused=True, rounds=(), notes=(), wall_s=1.0,
                                    retry=kept["retry"], busy=("gemm (other work used 100% of the cores)",)))
    assert len(said) == 2 and "busy now too" in said[0] and "--force" in said[1]


def test_the_busy_hint_names_the_rounds_and_how_to_profile_again() -> None:
    outcome = ProfileOutcome(db=None, path=None, reused=True, rounds=(), notes=(), wall_s=1.0,
                             busy=("segments (other work used 85% of the cores during the round)",))
    (line,) = busy_hint(outcome, ["model=gpt_tiny"], 4)
    assert "busy machine: segments (first: other work used 85% of the cores during the round)" in line
    assert "torchrun --nproc_per_node=4 -m cfp_megatron.profile model=gpt_tiny --force" in line
    assert busy_hint(ProfileOutcome(db=None, path=None, reused=True, rounds=(), notes=(), wall_s=1.0)) == []


def test_the_reuse_line_says_when_and_under_what_load(monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.engine.distributed import searched_on_rank0

    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src: None)
    out = io.StringIO()
    outcome = ProfileOutcome(db=None, path=Path("db.json"), reused=True, rounds=(), notes=(), wall_s=1.0,
                             measured_under="measured 2026-12-01 23:40 UTC, machine quiet (other work at most 8% of "
                                            "the cores)")
    env = type("Env", (), {"rank": 0})()
    searched_on_rank0(lambda: {}, outcome, env, Console(file=out, width=300))
    assert ("cfp: reused the ProfileDB, measured 2026-12-01 23:40 UTC, machine quiet (other work at most 8% of the "
            "cores) (db.json)") in out.getvalue()


def test_progress_counts_entries_and_says_how_rounds_end() -> None:
    out = io.StringIO()
    with RoundProgress(enabled=True, console=Console(file=out, width=200)) as progress:
        progress.update("segments", 30, 64, "dense tp1 mbs=1 [its share: 71 s of the 240 s budget, 30 reused]")
        record = RoundRecord(name="segments", status=RoundStatus.timeout, seconds=39.04)
        progress.update("segments", 40, 64, f"{status_text(record)} [{share_note(71, 240, 30)}]", final=True)
    text = out.getvalue()
    assert "starting" in text  # a line before the first round
    assert "40/64  stopped at its budget share after 39.0 s [its share: 71 s of the 240 s budget, 30 reused]" in text
    assert "timed out" not in text and "dense tp1" not in text  # a log gets one line per round, as it ends
    busy = RoundRecord(name="gemm", status=RoundStatus.ok, seconds=2.0, load=MachineLoad(other_during=0.9))
    assert status_text(busy) == "done in 2.0 s, machine busy: other work used 90% of the cores during the round"


def test_the_rows_end_on_the_counts_of_the_summary_line() -> None:
    from cfp_megatron.planner.launch_plan import coverage_lines
    from cfp_megatron.profile.runner import entry_counts

    record = RoundRecord(name="segments", status=RoundStatus.timeout, measured=tuple("abcdefghij"),
                         missing=("k", "l"), reused=30, over_memory=("m",))
    outcome = ProfileOutcome(db=None, path=None, reused=False, rounds=(), notes=(), wall_s=1.0, coverage=(record,))
    (line,) = coverage_lines(outcome, 240, 4, [])[:1]
    assert entry_counts(record) == (41, 43) and "segments 41/43 (10 measured, 30 reused, 1 over memory" in line
    out = io.StringIO()
    with RoundProgress(enabled=True, console=Console(file=out, width=200)) as progress:
        progress.update("segments", *entry_counts(record), "stopped", final=True)
    assert "segments         41/43  stopped" in out.getvalue()


def test_entries_done_counts_an_entry_once_all_its_steps_ran() -> None:
    from cfp_megatron.profile.control import Step

    steps = [Step(label="build", run=list), Step(label="a", run=list, entry="a", needs="build"),
             Step(label="a memory", run=list, entry="a", needs="build"), Step(label="b", run=list, entry="b")]
    assert entries_done(steps) == [0, 0, 0, 1]


def test_mfu_is_against_the_peak_the_profile_stored(job: JobSpec, monkeypatch: pytest.MonkeyPatch,
                                                    tmp_path: Path) -> None:
    from cfp_megatron.engine.distributed import resolve_backend
    from cfp_megatron.profile.cluster import profiled_peak

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    fp = current_fingerprint(world_size=2, nodes=1, backend=resolve_backend(job.cluster.backend))
    assert profiled_peak(job, world_size=2, precision=Precision.fp32) is None  # not profiled
    gemms = [GemmRecord(m=m, n=m, k=m, dtype="fp32", seconds=1e-3, tflops=t) for m, t in ((64, 0.01), (512, 0.04))]
    store_db(ProfileDB(fingerprint=fp, gemms=tuple(gemms)))
    found = profiled_peak(job, world_size=2, precision=Precision.fp32)
    assert found == 0.04

    def never(*args: object, **kwargs: object) -> float:
        raise AssertionError("measured the peak again")

    monkeypatch.setattr(peak, "measure_matmul_tflops", never)
    value, source = peak.peak_tflops(job.cluster, Precision.fp32, profiled=found)
    assert value == 0.04 and source.startswith("ProfileDB")
