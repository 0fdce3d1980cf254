"""``launch/train.py +cfp=auto`` / ``+cfp=manual`` (issue E): plan at launch on 4 gloo ranks, train with the plan,
check the first steps against the prediction; reuse the plan on a second launch into the same run directory; plan
again on 2 ranks and resume the checkpoint under the new plan; apply a saved plan by hand; refuse contradictory
constraints before any process group."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfp_megatron.config import compose_config, job_from_config
from cfp_megatron.errors import ConfigError
from cfp_megatron.plan import Plan, load_plan
from cfp_megatron.runtime.launch_plan import check_constraints, plan_key
from cfp_megatron.search.spec import cfp_from_config
from tests.launcher import RunResult, run_train

COMMON = ["model=gpt_tiny", "train.global_batch_size=16", "train.seq_length=64", "train.warmup_steps=0",
          "train.precision=fp32", "cfp.profile_budget_s=90"]


def _compose(*overrides: str):
    cfg = compose_config(["+cfp=auto", *overrides])
    return job_from_config(cfg), cfp_from_config(cfg)


def test_contradictory_pins_are_refused_before_any_group() -> None:
    job, cfp = _compose("model=gpt_tiny", "cfp.tp=3")
    with pytest.raises(ConfigError, match="no layout of gpt_tiny on 4 ranks") as info:
        check_constraints(job, 4, cfp)
    assert "cfp.tp=3: does not divide the world size 4" in str(info.value)
    job, cfp = _compose("model=gpt_tiny", "cfp.tp=8")
    with pytest.raises(ConfigError, match="no layout of gpt_tiny on 8 ranks") as info:
        check_constraints(job, 8, cfp)
    assert "cfp='tp=8': 4 attention heads are not divisible by it" in str(info.value)
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


def _events(result: RunResult, kind: str) -> list[dict]:
    return [r for r in result.records if r.get("event") == kind]


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[RunResult, Path, Path]:
    """One ``+cfp=auto`` launch on 4 ranks: profiles this machine into a fresh cache, searches, trains 6 steps."""
    root = tmp_path_factory.mktemp("auto")
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


@pytest.mark.slow
def test_two_ranks_plan_again_and_resume(planned: tuple[RunResult, Path, Path],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    root, run_dir = _after(planned, monkeypatch)
    ckpt = root / "ckpt2"
    import shutil

    shutil.copytree(root / "ckpt", ckpt)  # the 4-rank runs' checkpoints, resumed under a 2-rank plan
    from cfp_megatron.runtime import checkpoint

    saved = checkpoint.latest_step(ckpt)
    result = run_train(2, ["+cfp=auto", *COMMON, f"train.steps={saved + 2}", f"train.checkpoint_dir={ckpt}",
                           "train.resume=true"], root / "third", run_dir=run_dir, timeout=900)
    assert result.returncode == 0, result.output[-4000:]
    assert "cfp: planned plan gpt_tiny@local" in result.output
    assert len(list((run_dir / "cfp").glob("plan-*.json"))) >= 2
    assert _events(result, "resume")[0]["step"] == saved and "world=2" in _events(result, "start")[0]["layout"]
    assert sorted(result.losses) == [saved + 1, saved + 2]


@pytest.mark.slow
def test_manual_applies_a_plan_string(tmp_path: Path) -> None:
    job, _ = _compose("model=gpt_tiny", "train.global_batch_size=8")
    import dataclasses

    planned_job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, tp=2, pp=2))
    plan = Plan.from_job(planned_job, world_size=4, prediction=None, inputs_fingerprint="")
    result = run_train(4, ["+cfp=manual", f"cfp.plan='{plan.canonical()}'", "model=gpt_tiny", "train.steps=2",
                           "train.global_batch_size=8"], tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    assert "cfp: string plan" in result.output
    assert "tp=2 pp=2" in _events(result, "start")[0]["layout"]
    wrong = run_train(2, ["+cfp=manual", f"cfp.plan='{plan.canonical()}'", "model=gpt_tiny", "train.steps=2"],
                      tmp_path / "wrong")
    assert wrong.returncode != 0 and "the plan is for 4 ranks" in wrong.output
