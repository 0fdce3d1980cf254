"""The ProfileDB shared by concurrent jobs: read-modify-write under a file lock keeps every job's entries and
plan checks (two processes at once, repeated), and a lock that never frees says so instead of writing."""

from __future__ import annotations

import dataclasses
import multiprocessing
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock

import cfp_megatron.profile.db as dbmod
from cfp_megatron.plan import check
from cfp_megatron.profile.db import ProfileDB, db_path, load_db, lock_path, store_db, update_db
from cfp_megatron.profile.errors import ProfileDBError
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.records import GemmRecord, PlanCheckRecord, RoundRecord, RoundStatus

FP = Fingerprint(device_name="Test CPU", device_count=2, nodes=1, gpus_per_node=2, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)
REPEATS = 3
JOIN_S = 120.0
"""Generous: the machine is shared."""

FORK = pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="needs fork (POSIX)")


def _gemms(job: int) -> list[GemmRecord]:
    return [GemmRecord(m=64 * (job + 1), n=n, k=64, dtype="fp32", tflops=0.05, seconds=1e-3) for n in (64, 128)]


def _round(job: int) -> RoundRecord:
    return RoundRecord(name="gemm", status=RoundStatus.ok, steps_done=2, steps_planned=2, seconds=0.1 * (job + 1))


def _plan_check(job: int) -> PlanCheckRecord:
    return PlanCheckRecord(model="abc", plan=f"megatron:tp=1,sp=0,pp={job + 1}", steps=5, predicted_step_s=0.1,
                           calibration=1.0, measured_step_s=0.12 + 0.01 * job, predicted_peak_bytes=None,
                           measured_peak_bytes=None, time=1000.0 + job)


def _slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Widen the window between a writer's read and its rename, so unlocked writers would overlap."""
    real = dbmod.write_atomic

    def slow(path, text, **options):  # noqa: ANN001, ANN003, ANN202 - the same signature as write_atomic
        time.sleep(0.3)
        return real(path, text, **options)

    monkeypatch.setattr(dbmod, "write_atomic", slow)


def _profile_job(job: int, barrier) -> None:  # noqa: ANN001 - a multiprocessing barrier
    """What a profiling run does: read the DB at its start, measure, write at its end."""
    base = load_db(FP) or ProfileDB(fingerprint=FP)
    barrier.wait(timeout=JOIN_S)  # both jobs have read before either writes: the lost-update case
    store_db(base.merged(gemms=_gemms(job), rounds=[_round(job)]), base=base)


def _training_job(job: int, barrier) -> None:  # noqa: ANN001
    """What a checked training run does at its end: store its plan check."""
    barrier.wait(timeout=JOIN_S)
    check.store(_plan_check(job), world_size=2, nodes=1, backend="gloo")


def _run_all(*targets: tuple) -> None:
    ctx = multiprocessing.get_context("fork")
    barrier = ctx.Barrier(len(targets))
    procs = [ctx.Process(target=fn, args=(job, barrier)) for job, fn in targets]
    for p in procs:
        p.start()
    for p in procs:
        p.join(JOIN_S)
    assert [p.exitcode for p in procs] == [0] * len(procs)


@FORK
def test_two_profiling_jobs_keep_each_others_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _slow_writes(monkeypatch)
    for i in range(REPEATS):
        monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / f"cache{i}"))
        store_db(ProfileDB(fingerprint=FP).merged(gemms=_gemms(9), plan_checks=[_plan_check(9)]))
        _run_all((0, _profile_job), (1, _profile_job))
        db = load_db(FP)
        assert db is not None
        assert set(db.gemms) == {*_gemms(9), *_gemms(0), *_gemms(1)}
        assert sorted(r.seconds for r in db.rounds) == pytest.approx([0.1, 0.2])
        assert db.plan_checks == (_plan_check(9),)  # the feedback stored before survives both writes


@FORK
def test_plan_checks_and_a_profile_written_at_once_all_survive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    _slow_writes(monkeypatch)
    monkeypatch.setattr(check, "current_fingerprint", lambda **_: FP)
    for i in range(REPEATS):
        monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / f"cache{i}"))
        _run_all((0, _training_job), (1, _training_job), (2, _profile_job))
        db = load_db(FP)
        assert db is not None
        assert sorted(r.plan for r in db.plan_checks) == [_plan_check(0).plan, _plan_check(1).plan]
        assert set(db.gemms) == set(_gemms(2))
        assert not list(db_path(FP).parent.glob("*.tmp"))  # every temporary file was renamed into place


def test_threads_of_one_process_are_serialised_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))

    def add(job: int) -> None:
        def change(current: ProfileDB | None) -> ProfileDB:
            db = current or ProfileDB(fingerprint=FP)
            time.sleep(0.05)  # a read-modify-write that would interleave without the lock
            return db.merged(plan_checks=[_plan_check(job)])

        update_db(FP, change)

    threads = [threading.Thread(target=add, args=(job,)) for job in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    db = load_db(FP)
    assert db is not None and sorted(r.time for r in db.plan_checks) == [1000.0, 1001.0, 1002.0, 1003.0]


def test_storing_what_was_read_adds_nothing_twice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    first = ProfileDB(fingerprint=FP).merged(gemms=_gemms(0), rounds=[_round(0)], plan_checks=[_plan_check(0)])
    store_db(first)
    loaded = load_db(FP)
    store_db(loaded)  # no base: every record counts as new, but one already stored is not appended again
    store_db(loaded.merged(rounds=[_round(1)]), base=loaded)
    again = load_db(FP)
    assert again.plan_checks == first.plan_checks and again.gemms == first.gemms
    assert again.rounds == (_round(0), _round(1))


def test_a_lock_that_never_frees_is_an_error_and_nothing_is_written(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dbmod, "LOCK_TIMEOUT_S", 0.2)
    path = db_path(FP)
    path.parent.mkdir(parents=True)
    holder = FileLock(lock_path(path))
    done: list[BaseException] = []

    def write() -> None:  # another thread: the lock's holder is this thread
        try:
            store_db(ProfileDB(fingerprint=FP).merged(gemms=_gemms(0)))
        except ProfileDBError as err:
            done.append(err)

    with holder:
        t = threading.Thread(target=write)
        t.start()
        t.join(JOIN_S)
    assert len(done) == 1 and str(lock_path(path)) in str(done[0]) and "Fix:" in str(done[0])
    assert not path.exists()


def test_plan_check_is_not_stored_over_an_unreadable_db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(check, "current_fingerprint", lambda **_: FP)
    path = db_path(FP)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ProfileDBError, match="not JSON"):
        check.store(_plan_check(0), world_size=2, nodes=1, backend="gloo")
    assert path.read_text() == "{not json"  # left for the user to look at; a profiling run replaces it
    stored = store_db(ProfileDB(fingerprint=FP).merged(gemms=_gemms(0)))
    assert load_db(FP).gemms == tuple(_gemms(0)) and stored == path


def test_stored_plan_check_is_stamped_with_the_profile_on_disk(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(check, "current_fingerprint", lambda **_: FP)
    store_db(ProfileDB(fingerprint=FP).merged(gemms=_gemms(0)))
    path, stored, _ = check.store(_plan_check(0), world_size=2, nodes=1, backend="gloo")
    db = load_db(FP)
    assert path == str(db_path(FP))
    assert stored == dataclasses.replace(_plan_check(0), profile_id=db.for_model("abc").profile_id())
    assert db.plan_checks == (stored,)
