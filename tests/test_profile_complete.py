"""Complete profiles: every round records which of its entries it measured and which are missing, and the
next run measures only the missing ones until the profile is complete. Pure: the rounds' real step lists (closures,
nothing runs), with made-up figures for the steps a cut-off round would have finished (no process group)."""

from __future__ import annotations

import hashlib
import json
import re
import time
from typing import Any

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.profile import runner
from cfp_megatron.profile.control import Step, StepResult, run_round, select_steps
from cfp_megatron.profile.db import ProfileDB, store_db
from cfp_megatron.profile.fingerprint import Fingerprint, model_key
from cfp_megatron.profile.records import RoundRecord, RoundStatus, overhead_entry
from cfp_megatron.profile.runner import ROUNDS, _coverage, _merge, round_entries, round_steps, rounds_needed
from cfp_megatron.profile.segments import MEMORY_SUFFIX, micro_batches
from tests.spawned_rounds import oom_on_one_rank

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)
WORLD = 4


@pytest.fixture(scope="module")
def job() -> JobSpec:
    return compose_job(["model=gpt_tiny", "cluster=local"])


def _values(label: str) -> tuple[float, ...]:
    """Figures a finished step reports (shapes as the real steps return them)."""
    if label.startswith(("groups of", "build ")):
        return ()
    if label.startswith("overheads build"):
        return (10_000.0,)
    if label.startswith("overheads "):
        return (0.01, 0.001, 0.002)
    if label.startswith("gemm "):
        return (1e-3,)
    if label.endswith(MEMORY_SUFFIX):
        return (1e5, 1e4, 0.0)
    if " B" in label and "g=" in label:  # a collective: seconds, actual bytes
        size = float(label.split()[-2])
        return (1e-4 + size * 1e-9, size)
    return (1e-3, 2e-3)


def _run(db: ProfileDB | None, job: JobSpec, *, share: float) -> tuple[ProfileDB, tuple[RoundRecord, ...]]:
    """One profiling run in which every round finishes the first ``share`` of its (selected) steps and then runs
    out of time, as :func:`cfp_megatron.profile.control.run_round` leaves a round cut off by the budget."""
    key = model_key(job, on_gpu=False)
    planned = round_entries(job, WORLD, on_gpu=False)
    plan: dict[str, Any] = {"rounds": rounds_needed(db, key, planned, force=False), "planned": planned,
                            "force": False, "classes": {}, "model_key": key}
    results: dict[str, tuple[RoundRecord, Any]] = {}
    done: list[RoundRecord] = []
    for name, entries in plan["rounds"].items():
        steps, meaning, _ = round_steps(name, job, WORLD, on_gpu=False, device=None)  # type: ignore[arg-type]
        steps = select_steps(steps, entries)
        cut = len(steps) if share >= 1 else max(int(len(steps) * share), 1)
        finished = [StepResult(label=s.label, values=_values(s.label)) for s in steps[:cut]]
        status = RoundStatus.ok if cut == len(steps) else RoundStatus.timeout
        record = RoundRecord(name=name, status=status, steps_done=cut, steps_planned=len(steps))
        results[name] = (record, (finished, meaning))
        done.append(record)
    merged = _merge(db or ProfileDB(fingerprint=FP), job, plan, results, done)
    return ProfileDB.from_json(merged.to_json()), _coverage(plan, done)  # through JSON, as stored


def test_the_analysis_runs_for_the_tp_sizes_this_run_measures(job: JobSpec, tmp_path: Any,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's plan analyses the model only under the TP sizes whose segment entries the run measures: every size
    from an empty cache, TP=2 alone for a profile lacking only TP=2's segments, none for a complete one."""
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    analysed: list[int] = []
    monkeypatch.setattr(runner, "analysis_classes", lambda job, tp: analysed.append(tp) or {})

    def plan() -> dict[str, Any]:
        analysed.clear()
        return runner._plan_on_rank0(job, FP, WORLD, force=False, on_gpu=False, started=time.perf_counter())

    first = plan()
    assert analysed == [1, 2, 4] and first["records"][0]["steps_planned"] == 3
    complete, _ = _run(None, job, share=1.0)
    without_tp2 = ProfileDB.from_json({**complete.to_json(), "segments": [
        r.to_json() for r in complete.segments if not r.partition.startswith("tp2")]})
    store_db(without_tp2)
    lacking = plan()
    assert set(lacking["rounds"]) == {"segments", "recompute"} and all(
        re.search(r" tp2[ -]", entry) for name in lacking["rounds"] for entry in lacking["rounds"][name])
    assert analysed == [2] and lacking["records"][0]["steps_done"] == 1
    store_db(complete, base=without_tp2)
    assert plan()["rounds"] == {} and analysed == []


def test_select_steps_keeps_the_set_up_steps_of_what_it_keeps() -> None:
    steps = [Step(label="build a", run=list), Step(label="x", run=list, entry="x", needs="build a"),
             Step(label="x memory", run=list, entry="x", needs="build a"),
             Step(label="build b", run=list), Step(label="y", run=list, entry="y", needs="build b")]
    assert [s.label for s in select_steps(steps, ["y"])] == ["build b", "y"]
    assert [s.label for s in select_steps(steps, ["x"])] == ["build a", "x", "x memory"]
    assert select_steps(steps, []) == []


def test_a_profile_cut_off_in_every_round_is_completed_by_the_next_runs(job: JobSpec) -> None:
    planned = round_entries(job, WORLD, on_gpu=False)
    assert all(planned[name] for name in ROUNDS)
    db, coverage = _run(None, job, share=0.5)
    key = model_key(job, on_gpu=False)
    need = rounds_needed(db, key, planned, force=False)
    assert set(need) == set(ROUNDS)  # every round was cut off
    by_name = {r.name: r for r in coverage}
    for name in ROUNDS:
        record = by_name[name]
        assert record.status is RoundStatus.timeout and record.measured and record.missing
        # the DB says which entries each round measured and which are missing, and they add up to the job's
        assert set(record.measured) | set(record.missing) == set(planned[name])
        assert not set(record.measured) & set(record.missing)
        assert list(record.missing) == need[name]
        stored = [r for r in db.rounds if r.name == name][-1]
        assert stored.missing == record.missing and stored.model == ("" if name in ("collectives", "gemm") else key)
    # the next run measures only what is missing, and reuses the rest
    db2, coverage2 = _run(db, job, share=1.0)
    for record in coverage2:
        assert record.complete and set(record.measured) == set(need[record.name])
        assert record.reused == len(planned[record.name]) - len(need[record.name])
    assert rounds_needed(db2, key, planned, force=False) == {}
    assert rounds_needed(db2, key, planned, force=True).keys() == set(ROUNDS)
    # a third run measures nothing and says everything was reused
    db3, coverage3 = _run(db2, job, share=1.0)
    assert all(r.reused == len(planned[r.name]) and not r.measured for r in coverage3)


def test_a_run_cut_off_again_keeps_going_from_where_it_stopped(job: JobSpec) -> None:
    db, _ = _run(None, job, share=0.3)
    key = model_key(job, on_gpu=False)
    planned = round_entries(job, WORLD, on_gpu=False)
    before = {n: len(m) for n, m in rounds_needed(db, key, planned, force=False).items()}
    db, _ = _run(db, job, share=0.5)
    after = {n: len(m) for n, m in rounds_needed(db, key, planned, force=False).items()}
    assert all(after.get(n, 0) < before[n] for n in before)  # every round moved on


def test_collective_fits_use_the_sizes_of_both_runs(job: JobSpec) -> None:
    db, _ = _run(None, job, share=0.5)
    first = {(r.fit.op, r.fit.group_size, r.fit.span): len(r.samples) for r in db.collectives}
    db2, _ = _run(db, job, share=1.0)
    second = {(r.fit.op, r.fit.group_size, r.fit.span): len(r.samples) for r in db2.collectives}
    assert second.keys() >= first.keys()
    assert all(second[k] >= first[k] for k in first) and sum(second.values()) > sum(first.values())


def test_older_db_files_load_and_are_read_off_their_records(job: JobSpec) -> None:
    """A DB written before rounds recorded their entries: its round records load, and what it holds counts."""
    db, _ = _run(None, job, share=1.0)
    old = db.to_json()
    for r in old["rounds"]:
        for field in ("model", "measured", "missing", "reused"):
            r.pop(field, None)
    legacy = ProfileDB.from_json(old)
    assert all(r.measured == () and r.missing == () for r in legacy.rounds)
    key = model_key(job, on_gpu=False)
    # every fit exists, so the collectives count as measured; the rest is read off the records
    assert rounds_needed(legacy, key, round_entries(job, WORLD, on_gpu=False), force=False) == {}
    partial = ProfileDB.from_json({**old, "segments": old["segments"][: len(old["segments"]) // 2]})
    need = set(rounds_needed(partial, key, round_entries(job, WORLD, on_gpu=False), force=False))
    assert need and need <= {"segments", "recompute"}


def test_the_launch_says_what_is_missing_and_how_to_complete_it(job: JobSpec) -> None:
    from cfp_megatron.planner.launch_plan import coverage_lines
    from cfp_megatron.profile.runner import ProfileOutcome

    _, coverage = _run(None, job, share=0.5)
    partial = ProfileOutcome(db=None, path=None, reused=False, rounds=(), notes=(), wall_s=1.0, coverage=coverage)
    first, *hint = coverage_lines(partial, 240, WORLD, ["model=gpt_tiny"])
    assert "stopped at its budget share" in first and "timed out" not in first
    assert all(name in first for name in ROUNDS)
    assert hint and "partial" in hint[0] and "recompute" in hint[0]
    assert "-m cfp_megatron.profile model=gpt_tiny" in hint[1]
    db, _ = _run(None, job, share=1.0)
    _, complete = _run(db, job, share=1.0)
    done = ProfileOutcome(db=None, path=None, reused=True, rounds=(), notes=(), wall_s=1.0, coverage=complete)
    (line,) = coverage_lines(done, 240, WORLD, [])
    assert "reused" in line and "stopped" not in line


def test_rounds_measure_first_the_partitions_the_search_ranks_best(job: JobSpec) -> None:
    """Planning at launch passes the partitions of the layouts an analytical search ranks best; the segments,
    overheads and recompute rounds then measure those first (one probe build per partition), and still measure
    every entry they were asked for, once."""
    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.planner.launch_plan import profile_priority
    from cfp_megatron.profile.control import grouped_steps
    from cfp_megatron.profile.runner import prioritized

    priority = profile_priority(job, CfpSpec(), WORLD)
    assert priority, "the analytical search found no plan for the default model"
    best_partition, best_mbs = priority[0].split()
    planned = round_entries(job, WORLD, on_gpu=False)
    for name in ("segments", "overheads"):
        ordered = prioritized(planned[name], priority)
        assert sorted(ordered) == sorted(planned[name])
        steps, _, _ = round_steps(name, job, WORLD, on_gpu=False, device=None)  # type: ignore[arg-type]
        run = grouped_steps(steps, ordered)
        assert {s.entry for s in run if s.entry} == set(planned[name])
        assert run[0].entry is None  # the probe of the best partition is built first ...
        first = run[1].entry or ""
        assert best_partition in first.split() and best_mbs in first.split(), (name, first, priority)
        builds = [s.label for s in run if s.entry is None]
        assert len(builds) == len(set(builds))  # ... and every probe once
    # an order the search asks for moves a later partition to the front
    other = next(e for e in planned["segments"] if best_partition not in e.split()).split()[1]
    moved = prioritized(planned["segments"], (f"{other} mbs=8",))
    assert moved[0].split()[1:] == [other, "mbs=8"]
    assert prioritized(planned["segments"], ()) == planned["segments"]


@pytest.fixture()
def one_rank_group() -> Any:
    """A one-rank gloo group, as run_round syncs its steps over the default group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_a_step_out_of_device_memory_is_recorded_and_the_round_goes_on(one_rank_group: Any) -> None:
    import torch

    def oom() -> list[float]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 8.00 GiB.")

    def unbuildable() -> list[float]:
        raise torch.OutOfMemoryError("CUDA out of memory while building the probe.")

    ran: list[str] = []
    steps = [Step(label="build a", run=lambda: ran.append("build a") or []),
             Step(label="a mbs=1", run=lambda: ran.append("a1") or [1.0], entry="a mbs=1", needs="build a"),
             Step(label="a mbs=8", run=oom, entry="a mbs=8", needs="build a"),
             Step(label="a mbs=8 memory", run=lambda: ran.append("a8 memory") or [5.0], entry="a mbs=8",
                  needs="build a"),
             Step(label="a mbs=2", run=lambda: ran.append("a2") or [2.0], entry="a mbs=2", needs="build a"),
             Step(label="build b", run=unbuildable),
             Step(label="b mbs=1", run=lambda: ran.append("b1") or [3.0], entry="b mbs=1", needs="build b"),
             Step(label="c mbs=1", run=lambda: ran.append("c1") or [4.0], entry="c mbs=1")]
    results, record = run_round("overheads", steps, seconds=60.0)
    # The round ends ok: the step that did not fit and the steps of the probe that could not be built are recorded
    # as over memory, and every other step ran.
    assert record.status is RoundStatus.ok and not record.reason
    assert record.over_memory == ("a mbs=8", "b mbs=1")
    assert ran == ["build a", "a1", "a2", "c1"]
    assert [r.label for r in results] == ["build a", "a mbs=1", "a mbs=2", "c mbs=1"]
    # Any other failure still ends the round.
    _, failed = run_round("overheads", [Step(label="x", run=lambda: 1 / 0, entry="x"),
                                        Step(label="y", run=lambda: [1.0], entry="y")], seconds=60.0)
    assert failed.status is RoundStatus.failed and "ZeroDivisionError" in failed.reason


def test_entries_out_of_memory_are_not_retried(job: JobSpec) -> None:
    key = model_key(job, on_gpu=False)
    planned = round_entries(job, WORLD, on_gpu=False)
    db, _ = _run(None, job, share=1.0)
    assert rounds_needed(db, key, planned, force=False) == {}
    # The same profile, had its largest overhead probes run out of memory: not missing, so not measured again.
    too_big = tuple(e for e in planned["overheads"] if e.endswith(f"mbs={max(micro_batches(job))}"))
    assert too_big
    kept = [r for r in db.overheads if overhead_entry(r.partition, r.layers, r.micro_batch) not in too_big]
    rounds = [*db.rounds, RoundRecord(name="overheads", status=RoundStatus.ok, model=key, over_memory=too_big)]
    lacking = ProfileDB.from_json({**db.to_json(), "overheads": [r.to_json() for r in kept],
                                   "rounds": [r.to_json() for r in rounds]})
    assert lacking.missing_entries("overheads", key, planned["overheads"]) == []
    # Without the record they would be.
    plain = ProfileDB.from_json({**db.to_json(), "overheads": [r.to_json() for r in kept]})
    assert plain.missing_entries("overheads", key, planned["overheads"]) == list(too_big)


def test_a_step_out_of_memory_on_one_rank_is_recorded_by_every_rank(tmp_path: Any) -> None:
    import json

    import torch.multiprocessing as mp

    mp.spawn(oom_on_one_rank, args=(2, str(tmp_path)), nprocs=2)
    seen = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert seen[0] == seen[1]  # the same steps, the same record, on both ranks
    assert seen[0]["status"] == "ok" and seen[0]["over_memory"] == ["a mbs=8"]
    assert seen[0]["results"] == [["build a", []], ["a mbs=1", [2.0]], ["a mbs=2", [2.0]]]  # the slowest rank's


def test_a_model_without_a_sliding_window_keeps_the_profile_key_it_had_before_windows() -> None:
    """ProfileDB entries are keyed by the model's fields: the window and token-drop fields, added later, enter the
    key only when set, so the profiles users already measured stay theirs."""
    job = compose_job([])
    model = json_plain(job.model)
    for name in ("mtp_loss_scaling_factor", "window_size", "window_attn_skip_freq", "moe_expert_capacity_factor",
                 "moe_pad_expert_input_to_capacity", "activation_clamp", "moe_router_fp32", "moe_router_fusion",
                 "spec"):
        model.pop(name)
    before = hashlib.sha256(json.dumps({"model": model, "seq_length": job.train.seq_length, "precision": "fp32"},
                                       sort_keys=True).encode()).hexdigest()[:16]
    assert model_key(job, on_gpu=False) == before
    assert model_key(compose_job(["model.window_size=8"]), on_gpu=False) != before


def test_profile_repeats_set_every_probes_timed_repeats(job: JobSpec, monkeypatch: pytest.MonkeyPatch) -> None:
    """``cfp.profile_repeats`` (``--repeats``) reaches every round's probes; unset, each round keeps its own count
    (the segments' and overheads' defaults, the collectives' and GEMMs' by size); the entries stay the same."""
    import torch

    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.base.errors import ConfigError
    from cfp_megatron.profile import gemm, runner
    from cfp_megatron.profile.cli import parse_args

    seen: dict[str, int | None] = {}

    def spy(name: str) -> Any:
        real = getattr(runner, name)

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            seen[name] = kwargs.get("repeats")
            return real(*args, **kwargs)
        return wrapped

    for name in ("collective_steps", "gemm_steps", "segment_steps", "overhead_steps"):
        monkeypatch.setattr(runner, name, spy(name))
    cpu = torch.device("cpu")
    labels = []
    for repeats, expected in ((None, {"collective_steps": None, "gemm_steps": None, "segment_steps": 7,
                                      "overhead_steps": 4}),
                              (1, {"collective_steps": 1, "gemm_steps": 1, "segment_steps": 1, "overhead_steps": 1})):
        seen.clear()
        steps = {name: round_steps(name, job, WORLD, on_gpu=False, device=cpu, repeats=repeats)[0] for name in ROUNDS}
        assert seen == expected
        labels.append({name: [s.label for s in found] for name, found in steps.items()})
    assert labels[0] == labels[1]
    # a GEMM step times as many matmuls as asked (the collectives' steps read the setting the same way)
    timed_repeats: list[int] = []
    monkeypatch.setattr(gemm, "timed", lambda fn, *, repeats, warmup: timed_repeats.append(repeats) or 1e-3)
    for repeats in (None, 1):
        steps, _ = gemm.gemm_steps(["fp32"], on_gpu=False, device=cpu, repeats=repeats)
        steps[0].run()
    first = gemm.gemm_shapes(gemm.CPU_DIMS)[0]
    assert timed_repeats == [gemm.repeats_for(*first, on_gpu=False), 1] and timed_repeats[0] > 1
    assert parse_args(["model=gpt_tiny", "--repeats", "2"]).repeats == 2 and parse_args([]).repeats is None
    with pytest.raises(ConfigError, match="cfp.profile_repeats"):
        CfpSpec(profile_repeats=0)
