"""Trials at launch (``cfp.trials``): which of the top plans are measured (the band default, K distinct layouts),
which of the measured trains, the setting's checks; and one 2-rank launch that trials two plans and trains the
measured faster (docs/planning.md, "Trials at launch")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import AUTO_TRIALS, cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import Recompute, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.plan import Plan
from cfp_megatron.plan.artifact import PlanPrediction
from cfp_megatron.plan.trial_choice import inside, layout, measured_pick, picked, trial_positions
from tests.launcher import RunResult, run_train
from tests.profiles import seed_profile_db

JOB = compose_job(["model=gpt_tiny", "train.global_batch_size=16"])


def _plan(step_ms: float, band: float | None, *, tp: int = 1, pp: int = 1, mb: int = 4,
          recompute: Recompute = Recompute.none) -> Plan:
    """A 4-rank plan of gpt_tiny predicted at ``step_ms`` with an error band of ``band`` percent."""
    parallel = dataclasses.replace(JOB.parallel, tp=tp, pp=pp, recompute=recompute)
    job = dataclasses.replace(JOB, parallel=parallel, train=dataclasses.replace(JOB.train, micro_batch_size=mb))
    prediction = PlanPrediction(step_time_s=step_ms / 1e3, tokens_per_s_per_gpu=1.0, mfu=None, peak_memory_gib=0.01,
                                bubble_fraction=0.0, exposed_comm_s=0.0, error_band_pct=band)
    return Plan.from_job(job, world_size=4, prediction=prediction, inputs_fingerprint="")


def test_auto_trials_only_where_the_runner_up_is_inside_the_band() -> None:
    inside_ = [_plan(100, 10), _plan(104, 10, tp=2), _plan(108, 10, pp=2), _plan(109, 10, tp=2, pp=2),
               _plan(200, 10, mb=2)]
    # the plans inside the chosen one's band, at most AUTO_TRIALS; the one 50% behind is not tried
    assert trial_positions(inside_, None) == (0, 1, 2)[:AUTO_TRIALS]
    assert not inside(inside_[0], inside_[4])
    # the runner-up outside the band: no trial, whatever comes after it
    assert trial_positions([_plan(100, 10), _plan(130, 10, tp=2), _plan(101, 10, pp=2)], None) == ()
    # no band known (a CPU cluster): the model is all there is to go by under auto
    assert trial_positions([_plan(100, None), _plan(100.5, None, tp=2)], None) == ()
    # a wider band on either plan is the ratio's band (the chosen plan may be the slower: evidence chose it)
    assert trial_positions([_plan(100, 5), _plan(92, 12, tp=2)], None) == (0, 1)


def test_k_trials_take_the_first_distinct_layouts_whatever_the_band() -> None:
    plans = [_plan(100, None), _plan(101, None, recompute=Recompute.selective), _plan(150, None, tp=2),
             _plan(300, None, pp=2)]
    assert layout(plans[0]) == layout(plans[1])  # recomputation alone is not another layout
    assert trial_positions(plans, 2) == (0, 2)
    assert trial_positions(plans, 5) == (0, 2, 3)
    assert trial_positions(plans, 1) == () and trial_positions(plans, 0) == ()
    assert trial_positions(plans[:2], 2) == ()  # one layout: nothing to compare


def test_the_measured_fastest_trains_and_says_why() -> None:
    assert measured_pick([0.040, 0.035, 0.037]) == 1
    assert measured_pick([0.035, 0.035]) == 0  # equal: the one the search ranked higher
    assert measured_pick([None, 0.050, 0.045]) == 2  # a trial that did not finish is not picked
    assert measured_pick([0.040, None]) is None  # one finished: nothing was compared
    plans = [_plan(100, None), _plan(104, None, tp=2)]
    chosen = picked(plans[1], ["dp4 tp1", "dp2 tp2"], [0.041, 0.036], 1)
    assert chosen.canonical() == plans[1].canonical()
    assert chosen.predicted is not None and "measured fastest of 2 trials" in chosen.predicted.choice[0]
    assert "dp2 tp2 36.0 ms" in chosen.predicted.choice[0] and "dp4 tp1 41.0 ms" in chosen.predicted.choice[0]
    assert Plan.from_json(chosen.to_json()).canonical() == chosen.canonical()


def test_a_real_search_trials_its_plans_inside_the_band() -> None:
    """gpt_tiny on one DGX H100 (a published band) and on this CPU (none): the search's own ranked plans."""
    from cfp_megatron.backends.megatron.backend import MegatronBackend

    for cluster, banded in (("dgx_h100", True), ("local", False)):
        cfg = compose_config(["+cfp=auto", "model=gpt_tiny", f"cluster={cluster}", "cluster.nodes=1",
                              "train.global_batch_size=16"])
        job, cfp = job_from_config(cfg), cfp_from_config(cfg)
        world = 8 if banded else 4
        found = MegatronBackend().search(job, world, cfp, BackendSpec(), measurements=None, inputs_fingerprint="",
                                         on_gpu=False)
        tried = trial_positions(found.plans, None)
        if not banded:
            assert tried == ()
            continue
        assert len(tried) >= 2 and tried[0] == 0
        assert all(inside(found.plans[0], found.plans[i]) for i in tried)
        assert len({layout(found.plans[i]) for i in tried}) == len(tried)


def test_the_setting_is_checked_with_its_fix() -> None:
    for overrides, said in ((["cfp.trials=two"], "must be auto or a count"),
                            (["cfp.top_k=2", "cfp.trials=3"], "raise cfp.top_k to 3")):
        with pytest.raises(ConfigError, match=said) as caught:
            cfp_from_config(compose_config(["+cfp=auto", *overrides]))
        assert caught.value.keys == ["cfp.trials"]
    assert cfp_from_config(compose_config(["+cfp=auto", "cfp.trials=2"])).trial_count == 2
    assert cfp_from_config(compose_config(["+cfp=auto"])).trial_count is None


def test_deepspeed_refuses_k_trials_before_any_group() -> None:
    from cfp_megatron.planner.deepspeed_entry import check_layout

    cfg = compose_config(["+cfp=auto", "backend=deepspeed", "cfp.trials=2"])
    with pytest.raises(ConfigError, match="trials train Megatron-Core layouts") as caught:
        check_layout(job_from_config(cfg), cfp_from_config(cfg))
    assert caught.value.keys == ["cfp.trials"]


COMMON = ["model=gpt_tiny", "train.global_batch_size=16", "train.seq_length=64", "train.warmup_steps=0",
          "train.precision=fp32", "cfp.profile_budget_s=120", "cfp.profile_repeats=1"]


def _records(result: RunResult, kind: str) -> list[dict]:
    return [r for r in result.records if r.get("event") == kind]


@pytest.mark.slow
def test_two_trials_then_training_with_the_measured_faster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 gloo ranks, a recorded profile (nothing profiled): both trials run and are stored as trials, the plan that
    trains is the one measured faster, training runs with it to the end, and the trials saved nothing (the only
    checkpoint is the run's own last step; one ``start``; one plan)."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("CFP_CACHE_DIR", str(cache))
    db = seed_profile_db(cache, compose_job([*COMMON, "+cfp=auto"]), world=2)
    ckpt = tmp_path / "ckpt"
    result = run_train(2, [*COMMON, "+cfp=auto", "cfp.trials=2", "train.steps=4", "cfp.check_after_steps=4",
                           f"train.checkpoint_dir={ckpt}", "train.save_interval=0"], tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    assert "trials at launch (cfp.trials)" in result.output and "cfp: trials: 2 of 2 measured" in result.output
    checks = json.loads(db.read_text())["plan_checks"]
    trials = [c for c in checks if c.get("trial")]
    assert len(trials) == 2 and trials[0]["plan"] != trials[1]["plan"]
    fastest = min(trials, key=lambda c: c["measured_step_s"])
    plan = json.loads(next((tmp_path / "run" / "cfp").glob("plan-*.json")).read_text())
    assert plan["canonical"] == fastest["plan"]
    assert "measured fastest of 2 trials" in plan["prediction"]["choice"][0]
    # training ran with it: its own plan check is of that plan, and it trained every step
    run_checks = [c for c in checks if not c.get("trial")]
    assert [c["plan"] for c in run_checks] == [fastest["plan"]]
    assert len(_records(result, "start")) == 1 and sorted(result.losses) == [1, 2, 3, 4]
    saved = sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())
    assert {p.split("/")[0] for p in saved} == {"iter_0000004", "latest_checkpointed_iteration.txt"}, saved
    assert len(list((tmp_path / "run" / "cfp").iterdir())) == 1
