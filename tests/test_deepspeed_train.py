"""``launch/train.py backend=deepspeed`` on gloo ranks: each ZeRO stage chosen by a plan trains with the
single-rank reference's losses; ``+cfp=auto`` profiles, probes the engine, plans and trains."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from cfp_megatron.backends.deepspeed.engine_probe import load_probes
from cfp_megatron.compat.deepspeed_import import import_deepspeed
from cfp_megatron.plan import Plan
from tests.launcher import RunResult, run_train
from tests.multirank import TMP, Case, MultiRankRuns, case
from tests.profiles import seed_profile_db

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")]

COMMON = ["backend=deepspeed", "model=gpt_tiny", "train.global_batch_size=8", "train.seq_length=64",
          "train.steps=4", "train.precision=fp32", "train.warmup_steps=0"]


def _losses(result: RunResult) -> list[float]:
    assert result.returncode == 0, result.output[-4000:]
    return [result.losses[s] for s in sorted(result.losses)]


def test_deepspeed_as_the_launch_imports_it_builds_no_shared_memory_all_reduce() -> None:
    """On the CPU accelerator DeepSpeed's communication backend builds, at its start, a C++ shared-memory all-reduce
    that only inference calls; imported as the launch imports it, the backend's build step (``build_shm_op``) finds
    it unavailable and gives ``None`` without compiling anything."""
    import_deepspeed()
    # after import_deepspeed: DeepSpeed picks its accelerator when first imported
    from deepspeed.accelerator import get_accelerator
    from deepspeed.comm.torch import build_shm_op

    if get_accelerator().get_op_builder("ShareMemCommBuilder") is None:
        pytest.skip("this accelerator has no shared-memory all-reduce")
    assert build_shm_op() is None


REFERENCE = case(1, *COMMON, "backend.zero_stage=0", "train.micro_batch_size=8")
"""One rank, ZeRO stage 0, the whole batch as one micro-batch (a case of the multirank fixture's world-1 job)."""


@pytest.fixture
def reference(multirank: MultiRankRuns) -> list[float]:
    """:data:`REFERENCE`'s losses (a test that takes it is marked ``multirank(REFERENCE)``)."""
    return _losses(multirank[REFERENCE])


def _plan_case(ranks: int, plan: str) -> Case:
    """A DeepSpeed plan's run: a case of the multirank fixture's job of ``ranks`` ranks (tests/multirank.py)."""
    return case(ranks, *COMMON, "+cfp=manual", f"cfp.plan='gpt_tiny@localx1x{ranks}:{plan}'")


ZERO_PLANS = [(2, "zero=1,dp=2,mb=2,ga=2,gbs=8,seq=64,ckpt=0,oopt=0,oparam=0,bucket=50000000,prec=fp32"),
              (2, "zero=2,dp=2,mb=4,ga=1,gbs=8,seq=64,ckpt=1,oopt=0,oparam=0,bucket=50000000,prec=fp32"),
              (4, "zero=3,dp=4,mb=1,ga=2,gbs=8,seq=64,ckpt=1,oopt=0,oparam=0,bucket=50000000,prec=fp32")]


@pytest.mark.parametrize(("ranks", "plan"), [
    pytest.param(ranks, plan, marks=pytest.mark.multirank(_plan_case(ranks, plan), REFERENCE))
    for ranks, plan in ZERO_PLANS])
def test_each_zero_stage_of_a_plan_trains_with_the_reference_loss(multirank: MultiRankRuns, reference: list[float],
                                                                   ranks: int, plan: str) -> None:
    canonical = f"gpt_tiny@localx1x{ranks}:{plan}"
    result = multirank[_plan_case(ranks, plan)]
    losses = _losses(result)
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)
    assert losses[-1] < losses[0]
    run_dir = multirank.run_dir(_plan_case(ranks, plan))
    config = json.loads((run_dir / "ds_config.json").read_text())
    stage = int(plan.split(",")[0].split("=")[1])
    assert config["zero_optimization"]["stage"] == stage
    # the DeepSpeed plan string of earlier runs is read, and plan.json holds it in the one Plan form
    assert json.loads((run_dir / "plan.json").read_text())["canonical"] == Plan.parse(canonical).canonical()
    start = next(r for r in result.records if r.get("event") == "start")
    assert start["backend"] == "deepspeed" and start["plan"].startswith(f"zero{stage}")


@pytest.mark.multirank(REFERENCE)
def test_auto_plans_with_engine_probes_and_trains(tmp_path: Path, reference: list[float],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.base.compose import compose_job

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    # the profiling rounds find a recorded profile (tests/profiles.py); the engine probes are measured
    seed_profile_db(tmp_path / "cache", compose_job([*COMMON, "+cfp=auto"]), world=2)
    result = run_train(2, [*COMMON, "+cfp=auto", "cfp.profile_budget_s=60", "cfp.profile_repeats=1",
                           "cfp.check_after_steps=2"], tmp_path)
    losses = _losses(result)
    assert losses == pytest.approx(reference, rel=1e-5, abs=1e-5)
    assert "cfp: probed the DeepSpeed engine (stages [0, 1, 2, 3])" in result.output
    plan = json.loads((tmp_path / "run" / "plan.json").read_text())
    assert plan["backend"] == "deepspeed" and plan["prediction"]["step_time_s"] > 0
    checks = [r for r in result.records if r.get("event") == "plan_check"]
    assert checks and checks[0]["predicted_step_s"] == pytest.approx(plan["prediction"]["step_time_s"], rel=1e-3)
    stored = list((tmp_path / "cache" / "profile").glob("*-deepspeed-*.json"))
    assert len(stored) == 1
    probes = load_probes(stored[0], 2)
    assert probes is not None and sorted(probes.stages) == [0, 1, 2, 3]
    for p in probes.stages.values():  # three points per stage; four micro-batches take longer than one
        assert [n for n, _ in p.points] == [1, 2, 4]
        assert 0 < p.seconds(1) < p.seconds(4)


DS_CKPT = f"{TMP}/ds_ckpt"
FIRST = case(2, *COMMON, "backend.zero_stage=1", f"train.checkpoint_dir={DS_CKPT}")
RESUMED = case(2, *COMMON, "backend.zero_stage=1", f"train.checkpoint_dir={DS_CKPT}", "train.resume=true",
               "train.steps=6")
"""A ZeRO-1 run that saves into a folder, then one that resumes from it (the multirank fixture's 2-rank job, in
that order)."""


@pytest.mark.multirank(FIRST, RESUMED)
def test_checkpoint_folder_is_not_written_over(multirank: MultiRankRuns) -> None:
    _losses(multirank[FIRST])
    before, after = multirank.files(FIRST)
    assert not before and "latest" in after and any(f.startswith("global_step4/") for f in after), after
    assert not any(f.startswith("global_step6/") for f in after)
    # a second launch into the folder is refused by the launch's check before any process group (the pipeline
    # calls it: tests/test_launch_pipeline.py), run here in-process on the folder the launches wrote
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.base.errors import CheckpointError
    from cfp_megatron.planner.deepspeed_launch import DeepSpeedLaunch

    folder = multirank.path("ds_ckpt")
    again = compose_job([*COMMON, "backend.zero_stage=1", f"train.checkpoint_dir={folder}"])
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(DeepSpeed: global_step4"):
        DeepSpeedLaunch().check_before_start(again, restarted=False, writer=None, note=lambda line: None)
    assert multirank.files(RESUMED)[0] == after  # it resumed from the first run's folder as that run left it
    assert sorted(_losses_by_step(multirank[RESUMED])) == [5, 6]


def _losses_by_step(result: RunResult) -> dict[int, float]:
    assert result.returncode == 0, result.output[-4000:]
    return result.losses
