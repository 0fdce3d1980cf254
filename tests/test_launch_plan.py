"""``launch/train.py +cfp=auto`` / ``+cfp=manual``: plan at launch on 4 gloo ranks, train with the plan,
check the first steps against the prediction; reuse the plan on a second launch into the same run directory; plan
again on 2 ranks and resume the checkpoint under the new plan; apply a saved plan by hand; refuse contradictory
constraints before any process group."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.plan import Plan, load_plan
from cfp_megatron.planner.launch_plan import check_constraints, plan_key
from tests.launcher import RunResult, run_train
from tests.multirank import MultiRankRuns, case
from tests.profiles import seed_profile_db

COMMON = ["model=gpt_tiny", "train.global_batch_size=16", "train.seq_length=64", "train.warmup_steps=0",
          "train.precision=fp32", "cfp.profile_budget_s=90", "cfp.profile_repeats=1"]


def _compose(*overrides: str):
    cfg = compose_config(["+cfp=auto", *overrides])
    return job_from_config(cfg), cfp_from_config(cfg)


def test_contradictory_pins_are_refused_before_any_group() -> None:
    job, cfp = _compose("model=gpt_tiny", "cfp.tp=3")
    with pytest.raises(ConfigError, match="no layout of gpt_tiny on 4 ranks") as info:
        check_constraints(job, 4, cfp)
    assert "cfp.tp=3: no layout of gpt_tiny on 4 ranks takes it: tp=3: does not divide the world size 4" in str(
        info.value)
    job, cfp = _compose("model=gpt_tiny", "cfp.tp=8")
    with pytest.raises(ConfigError, match="no layout of gpt_tiny on 8 ranks") as info:
        check_constraints(job, 8, cfp)
    assert "tp=8: 4 attention heads are not divisible by it" in str(info.value) and info.value.keys == ["cfp.tp"]
    job, cfp = _compose("model=gpt_tiny", "cfp.pp=8")
    with pytest.raises(ConfigError, match="4 layers do not fill 8 stages"):
        check_constraints(job, 8, cfp)


def test_plan_key_follows_inputs_not_the_parallel_section() -> None:
    job, cfp = _compose("model=gpt_tiny")
    same, _ = _compose("model=gpt_tiny", "parallel.tp=2", "train.steps=100", "train.lr=0.1",
                       "train.checkpoint_dir=/somewhere")
    assert plan_key(job, 4, cfp) == plan_key(same, 4, cfp)
    other, _ = _compose("model=gpt_tiny", "train.global_batch_size=32")
    assert plan_key(job, 4, cfp) != plan_key(other, 4, cfp)
    assert plan_key(job, 4, cfp) != plan_key(job, 2, cfp)
    _, pinned = _compose("model=gpt_tiny", "cfp.tp=2")
    assert plan_key(job, 4, cfp) != plan_key(job, 4, pinned)


def test_plan_key_leaves_trials_out() -> None:
    """Trials choose among the searched plans at launch (their pick is the plan stored under the key): the key is
    the same for any ``cfp.trials``, while a setting that shapes the search still changes it."""
    job, cfp = _compose("model=gpt_tiny")
    keys = {plan_key(job, 4, _compose("model=gpt_tiny", f"cfp.trials={t}")[1]) for t in ("auto", "0", "1", "3")}
    assert keys == {plan_key(job, 4, cfp)}
    assert plan_key(job, 4, _compose("model=gpt_tiny", "cfp.trials=3", "cfp.recompute=full")[1]) not in keys


def _events(result: RunResult, kind: str) -> list[dict]:
    return [r for r in result.records if r.get("event") == kind]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path, Path]:
    """One ``+cfp=auto`` launch on 4 ranks: profiles what its cache lacks, searches, trains 6 steps.

    The cache is seeded with a recorded profile (tests/profiles.py) less its TP=4 segments, so the launch profiles
    those alone (the segments round, in the order the search asks for) instead of minutes of every round; the
    2-rank launches below find theirs complete. Profiling every round from an empty cache is
    tests/test_profile_torchrun.py's."""
    root = tmp_path_factory.mktemp("auto")
    job = _compose(*COMMON)[0]
    seed_profile_db(root / "cache", job, world=4, drop=lambda section, r: section == "segments" and
                    r["partition"] == "tp4")
    seed_profile_db(root / "cache", job, world=2)
    mp = pytest.MonkeyPatch()
    mp.setenv("CFP_CACHE_DIR", str(root / "cache"))
    try:
        result = run_train(4, ["+cfp=auto", *COMMON, "train.steps=6", f"train.checkpoint_dir={root / 'ckpt'}"],
                           root / "first", run_dir=root / "run", timeout=900)
    finally:
        mp.undo()
    return result, root, root / "run"


@pytest.mark.slow
def test_auto_profiles_plans_and_trains(planned: tuple[RunResult, Path, Path]) -> None:
    result, root, run_dir = planned
    assert result.returncode == 0, result.output[-4000:]
    assert "cfp: profiled in" in result.output and "cfp: planned plan gpt_tiny@local" in result.output
    (stored,) = (run_dir / "cfp").glob("plan-*.json")
    plan = load_plan(stored)
    assert stored.name == f"plan-{plan.plan_hash()}.json"  # named by the hash it holds
    assert plan.canonical() in result.output and plan.predicted is not None
    start = _events(result, "start")[0]
    assert f"tp={plan.parallel.tp} pp={plan.parallel.pp}" in start["layout"]  # trained with the plan's layout
    losses = result.losses
    assert sorted(losses) == list(range(1, 7)) and losses[6] < losses[1]
    (check,) = _events(result, "plan_check")
    assert check["predicted_step_s"] == pytest.approx(plan.predicted.step_time_s, rel=1e-4)  # logged to 1 us
    assert check["measured_step_s"] > 0 and check["measured_peak_gib"] > 0
    db = json.loads(Path(check["stored"]).read_text())
    assert [c["plan"] for c in db["plan_checks"]] == [plan.canonical()]


def _after(planned: tuple[RunResult, Path, Path], monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """The first launch's folder and run directory, with its profile cache in the environment."""
    first, root, run_dir = planned
    assert first.returncode == 0, first.output[-4000:]
    monkeypatch.setenv("CFP_CACHE_DIR", str(root / "cache"))
    return root, run_dir


@pytest.mark.slow
def test_second_launch_reuses_the_plan_without_profiling(planned: tuple[RunResult, Path, Path],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root, run_dir = _after(planned, monkeypatch)
    result = run_train(4, ["+cfp=auto", *COMMON, "train.steps=8", f"train.checkpoint_dir={root / 'ckpt'}",
                           "train.resume=true"], root / "second", run_dir=run_dir, timeout=900)
    assert result.returncode == 0, result.output[-4000:]
    assert "cfp: cached plan" in result.output and "profiled in" not in result.output
    assert _events(result, "resume")[0]["step"] == 6
    assert sorted(result.losses) == [7, 8]


@pytest.fixture(scope="module")
def two_ranks(planned: tuple[RunResult, Path, Path],
              tmp_path_factory: pytest.TempPathFactory) -> tuple[int, str, list[dict], int]:
    """One 2-rank launch into the 4-rank runs' run directory, resuming their checkpoints (copied) under a plan
    searched again for 2 ranks, saving every 2 steps; rank 1 is killed 3 steps in under ``--max-restarts=1``.
    (torchrun's exit code, its output, rank 0's metrics records, the step the 4-rank runs saved last.) One launch
    for the two tests below: planning again on another world size, and a torchrun restart's reuse of that plan."""
    import os
    import shutil

    from cfp_megatron.engine import checkpoint
    from tests.launcher import run_killing_a_rank

    first, root, run_dir = planned
    assert first.returncode == 0, first.output[-4000:]
    work = tmp_path_factory.mktemp("two_ranks")
    ckpt, metrics = work / "ckpt", work / "metrics.jsonl"
    shutil.copytree(root / "ckpt", ckpt)  # the 4-rank runs' checkpoints, resumed under a 2-rank plan
    saved = checkpoint.latest_step(ckpt)
    assert saved is not None
    overrides = ["+cfp=auto", *COMMON, f"train.steps={saved + 8}", "train.save_interval=2", "train.resume=true",
                 f"train.checkpoint_dir={ckpt}", f"train.metrics_file={metrics}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CFP_CACHE_DIR": str(root / "cache")}
    returncode, output = run_killing_a_rank(2, overrides, work, metrics=metrics, kill_at_step=saved + 3, env=env,
                                            timeout=900)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    return returncode, output, records, saved


@pytest.mark.slow
def test_two_ranks_plan_again_and_resume(planned: tuple[RunResult, Path, Path],
                                         two_ranks: tuple[int, str, list[dict], int]) -> None:
    _, _, run_dir = planned
    returncode, output, records, saved = two_ranks
    assert returncode == 0, output[-4000:]
    assert "cfp: planned plan gpt_tiny@local" in output
    assert len(list((run_dir / "cfp").glob("plan-*.json"))) >= 2
    resume = next(r for r in records if r["event"] == "resume")
    start = next(r for r in records if r["event"] == "start")
    assert resume["step"] == saved and "world=2" in start["layout"]
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == list(range(saved + 1, saved + 9))


def _manual_plan(world: int = 4) -> Plan:
    """A TP=2 x PP=2 plan of gpt_tiny on ``world`` ranks, as a saved plan's string gives it."""
    job, _ = _compose("model=gpt_tiny", "train.global_batch_size=8")
    planned_job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, tp=2, pp=2))
    return Plan.from_job(planned_job, world_size=world, prediction=None, inputs_fingerprint="")


MANUAL = case(4, "+cfp=manual", f"cfp.plan='{_manual_plan().canonical()}'", "model=gpt_tiny", "train.steps=2",
              "train.global_batch_size=8")
"""A launch given that plan's string: a case of the multirank fixture's 4-rank job (tests/multirank.py)."""


@pytest.mark.slow
@pytest.mark.multirank(MANUAL)
def test_manual_applies_a_plan_string(multirank: MultiRankRuns) -> None:
    """The launch path trains the plan string's layout (nothing else on the command line sets one); the plan step
    takes it as the string's (in-process, on the same command line)."""
    from cfp_megatron.base.launch_env import LaunchEnv
    from cfp_megatron.planner.launch_plan import resolve_launch_plan

    plan = _manual_plan()
    result = multirank[MANUAL]
    assert result.returncode == 0, result.output[-4000:]
    assert "tp=2 pp=2" in _events(result, "start")[0]["layout"] and sorted(result.losses) == [1, 2]
    cfg = compose_config(list(MANUAL.overrides))
    env = LaunchEnv(rank=0, world_size=4, local_rank=0, local_world_size=4, restart_count=0, under_torchrun=True)
    launch = resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, None)
    assert launch is not None and launch.source == "string" and launch.plan.canonical() == plan.canonical()


def test_manual_plan_for_another_world_size_is_refused() -> None:
    """The launch's plan step on 2 ranks refuses a 4-rank plan string (in-process: what a 2-rank torchrun of the
    plan above runs before any process group)."""

    from cfp_megatron.base.launch_env import LaunchEnv
    from cfp_megatron.plan.errors import PlanError
    from cfp_megatron.planner.launch_plan import resolve_launch_plan

    plan = _manual_plan()
    cfg = compose_config(["+cfp=manual", f"cfp.plan='{plan.canonical()}'", "model=gpt_tiny", "train.steps=2"])
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0, under_torchrun=True)
    with pytest.raises(PlanError, match="the plan of cfp.plan is for 4 ranks") as caught:
        resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, None)
    assert caught.value.setting == "cfp.plan"  # the key that gave the plan, not cfp.plan_file


def test_plan_check_compares_and_calibrates() -> None:
    from dataclasses import dataclass

    from cfp_megatron.plan.check import PlanCheck, compare, differences, warnings_for
    from cfp_megatron.profile.db import ProfileDB
    from cfp_megatron.profile.fingerprint import current_fingerprint

    @dataclass
    class Step:
        step_time_s: float
        peak_bytes_max: float | None = None

    check = PlanCheck(plan="p", model_key="m", after_steps=4, predicted_step_s=0.1, calibration=1.0,
                      predicted_peak_bytes=1000.0)
    history = [Step(9.0), Step(0.12), Step(0.13), Step(5.0, peak_bytes_max=1010.0), Step(0.2)]
    assert compare(check, history[:3]) is None
    record = compare(check, history)
    assert record is not None and record.steps == 2  # the warm-up step and the memory step are left out
    assert record.measured_step_s == pytest.approx(0.125) and record.measured_peak_bytes == 1010.0
    assert differences(record)["step_time"] == pytest.approx(0.25)
    assert differences(record)["memory"] == pytest.approx(0.01)
    assert len(warnings_for(record)) == 1 and "step time" in warnings_for(record)[0]
    fp = current_fingerprint(world_size=4, nodes=1, backend="gloo")
    db = ProfileDB(fingerprint=fp).for_model("m")
    db = db.merged(plan_checks=[dataclasses.replace(record, profile_id=db.profile_id())])
    assert db.step_time_calibration() == pytest.approx(1.125)  # one run and the profile's own prediction
    again = compare(PlanCheck(plan="p", model_key="m", after_steps=4, predicted_step_s=0.1, calibration=1.25,
                              predicted_peak_bytes=None), history)
    assert again is not None and differences(again)["step_time"] == pytest.approx(0.0)
    again = dataclasses.replace(again, profile_id=db.profile_id())
    assert db.merged(plan_checks=[again]).step_time_calibration() == pytest.approx(1.25)  # raw ratios: no compounding
    assert ProfileDB.from_json(db.to_json()).plan_checks == db.plan_checks
    # The warm-up steps of a fresh process are not timed; a run too short for them times the steps after the first.
    slow_start = [Step(9.0), Step(0.5), Step(0.5), Step(0.1), Step(0.1), Step(0.12), Step(0.1, peak_bytes_max=1.0)]
    warm = PlanCheck(plan="p", model_key="m", after_steps=7, warmup_steps=3, predicted_step_s=0.1, calibration=1.0,
                     predicted_peak_bytes=None)
    record = compare(warm, slow_start)
    assert record is not None and record.steps == 3 and record.measured_step_s == pytest.approx(0.1)
    record = compare(dataclasses.replace(warm, warmup_steps=1), slow_start)
    assert record is not None and record.steps == 5 and record.measured_step_s == pytest.approx(0.12)
    short = compare(dataclasses.replace(warm, after_steps=3), slow_start)
    assert short is not None and short.steps == 2 and short.measured_step_s == pytest.approx(0.5)


@pytest.mark.slow
def test_two_agents_joined_by_c10d_plan_and_train_together(tmp_path: Path) -> None:
    """``--nnodes=2``: two torchrun agents on this machine (2 ranks each) rendezvous on 127.0.0.1, profile, plan and
    train as one 4-rank job of 2 nodes. The cache holds a recorded profile of this job less its collectives
    (tests/profiles.py): the agents' ranks profile those together, over the groups that span both agents."""
    import os
    import subprocess
    import sys

    from tests.launcher import TRAIN, free_port

    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "CFP_CACHE_DIR": str(tmp_path / "cache")}
    common = ["+cfp=auto", "cluster.nodes=2", "model=gpt_tiny", "train.steps=4", "train.global_batch_size=16",
              "cfp.profile_budget_s=40", "cfp.profile_repeats=1", f"train.metrics_file={tmp_path / 'metrics.jsonl'}"]
    seed_profile_db(tmp_path / "cache", _compose(*common[1:])[0], world=4, nodes=2,
                    drop=lambda section, r: section == "collectives" or r.get("name") == "collectives")
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                                "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=two-agents",
                                str(TRAIN), *common], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outputs = [agent.communicate(timeout=900)[0] for agent in agents]
    assert [agent.returncode for agent in agents] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    joined = "\n".join(outputs)
    assert "cfp: planned plan gpt_tiny@localx2x2:" in joined  # one plan for 2 nodes x 2 ranks
    assert "cfp: profiled in" in joined
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    start = next(r for r in records if r["event"] == "start")
    assert "world=4" in start["layout"]
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == [1, 2, 3, 4] and losses[4] < losses[1]


@pytest.mark.slow
def test_torchrun_restart_reuses_the_plan(two_ranks: tuple[int, str, list[dict], int]) -> None:
    """Rank 1 killed mid-run under ``--max-restarts=1`` (:func:`two_ranks`): the restarted workers
    (TORCHELASTIC_RESTART_COUNT=1) find the plan in the run directory, neither profile nor search, and resume from
    the last checkpoint."""
    returncode, output, records, saved = two_ranks
    assert returncode == 0, output[-4000:]
    assert output.count("cfp: planned plan") == 1 and output.count("cfp: cached plan") == 1
    resume = next(r for r in records if r["event"] == "resume" and r.get("restart_count") == 1)
    assert resume["step"] >= saved + 2
    assert max(r["step"] for r in records if r["event"] == "step") == saved + 8


@pytest.mark.slow
def test_the_main_jobs_records_are_the_ones_the_docs_show(planned: tuple[RunResult, Path, Path]) -> None:
    """The main job (this module's ``+cfp=auto`` launch on 4 ranks) prints its records as README.md and
    docs/getting-started.md show them: the same names, each on one line or as a block the same way (a warning only
    when the check is more than 10% off), and the planner's lines the pages start with."""
    from cfp_megatron.engine.metrics import record_lines
    from cfp_megatron.plan.check import TOLERANCE, PlanCheck, compare, warnings_for
    from tests.test_docs import CONDITIONAL_RECORDS, MAIN_JOB_PAGES, main_job_excerpt, record_shapes

    result, _, _ = planned
    assert result.returncode == 0, result.output[-4000:]
    printed = record_shapes(result.output)
    printed.pop("checkpoint", None)  # this launch saves into train.checkpoint_dir, which the main job does not set
    assert {"start", "step", "memory", "plan_check", "end"} <= set(printed), printed
    (check,) = _events(result, "plan_check")
    off = [d for d in (check["step_time_diff"], check.get("memory_diff")) if d is not None and abs(d) > TOLERANCE]
    assert bool(off) <= ("warning" in printed), check  # a check more than 10% off says so
    # The plan check's warning depends on how far the measured step time fell from the prediction, which the
    # machine's load decides: when this run printed none, the shape is the one a check 25% off prints (the same
    # sentence and printer), so the comparison below never rests on the run's timing.
    if "warning" not in printed:
        @dataclasses.dataclass
        class Step:
            step_time_s: float
            peak_bytes_max: float | None = None

        record = compare(PlanCheck(plan="p", model_key="m", after_steps=3, predicted_step_s=0.1, calibration=1.0,
                                   predicted_peak_bytes=None), [Step(1.0), Step(0.125), Step(0.125)])
        assert record is not None
        (warning,) = warnings_for(record)
        printed.update(record_shapes("\n".join(record_lines("warning", {"message": warning}))))
    for page in MAIN_JOB_PAGES:
        excerpt = main_job_excerpt(page)
        shown = record_shapes(excerpt)
        assert {name: printed.get(name) for name in shown} == shown, (page, shown, printed)
        for said in ("cfp: planned plan gpt_tiny@localx1x4:", "cfp:   1. "):
            assert said in excerpt and said in result.output, (page, said)
    full = record_shapes(main_job_excerpt("getting-started.md"))
    assert {n for n in printed if n not in CONDITIONAL_RECORDS} == {n for n in full if n not in CONDITIONAL_RECORDS}
