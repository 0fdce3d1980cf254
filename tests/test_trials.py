"""Trials at launch (``cfp.trials``): which of the top plans are measured (the band default, K distinct layouts),
which of the measured trains, the setting's checks; and one 2-rank launch that trials two plans and trains the
measured faster (docs/planning.md, "Trials at launch")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.backends.megatron.trials import TIMED_STEPS, trials_table
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import AUTO_TRIALS, cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import Recompute, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.plan import Plan
from cfp_megatron.plan.artifact import PlanPrediction
from cfp_megatron.plan.trial_choice import inside, layout, measured_pick, picked, shortfall, trial_positions
from tests.multirank import TMP, MultiRankRuns, case
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
    assert "hold 1 distinct layout(s), so none is tried" in shortfall(plans[:2], 2, ())
    assert "hold 3 distinct layout(s), so 3 are tried" in shortfall(plans, 5, (0, 2, 3))
    assert shortfall(plans, 3, (0, 2, 3)) is None and shortfall(plans, None, ()) is None


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


def _seed(folder: Path) -> None:
    """The recorded 2-rank profile of gpt_tiny in the case's own cache: nothing is profiled."""
    seed_profile_db(folder / "trials_cache", compose_job([*COMMON, "+cfp=auto"]), world=2)


TRIALS = case(2, *COMMON, "+cfp=auto", "cfp.trials=2", "train.steps=4", "cfp.check_after_steps=4",
              f"train.checkpoint_dir={TMP}/trials_ckpt", "train.save_interval=0", prepare=_seed,
              env={"CFP_CACHE_DIR": f"{TMP}/trials_cache"})
"""A launch that trials two plans: a case of the multirank fixture's 2-rank job (tests/multirank.py)."""


@pytest.mark.slow
@pytest.mark.multirank(TRIALS)
def test_two_trials_then_training_with_the_measured_faster(multirank: MultiRankRuns) -> None:
    """2 gloo ranks, a recorded profile (nothing profiled): both trials run and are stored as trials, the plan that
    trains is the one measured faster, training runs with it to the end, and the trials saved nothing (the only
    checkpoint is the run's own last step; one ``start``; one plan)."""
    result = multirank[TRIALS]
    assert result.returncode == 0, result.output[-4000:]
    (db,) = (multirank.path("trials_cache") / "profile").glob("*.json")
    checks = json.loads(db.read_text())["plan_checks"]
    trials = [c for c in checks if c.get("trial")]
    assert len(trials) == 2 and trials[0]["plan"] != trials[1]["plan"]
    assert all(c["steps"] == TIMED_STEPS for c in trials)  # timed as the plan check times: after the warm-up
    fastest = min(trials, key=lambda c: c["measured_step_s"])
    run_dir = multirank.run_dir(TRIALS)
    (stored,) = (run_dir / "cfp").glob("plan-*.json")
    plan = json.loads(stored.read_text())
    assert plan["canonical"] == fastest["plan"]
    assert "measured fastest of 2 trials" in plan["prediction"]["choice"][0]
    # training ran with it: its own plan check is of that plan, and it trained every step
    assert [c["plan"] for c in checks if not c.get("trial")] == [fastest["plan"]]
    starts = [r for r in result.records if r.get("event") == "start"]
    assert len(starts) == 1 and sorted(result.losses) == [1, 2, 3, 4]
    before, after = multirank.files(TRIALS)
    assert not before and {p.split("/")[0] for p in after} == {"iter_0000004", "latest_checkpointed_iteration.txt"}


def test_the_table_shows_predicted_and_measured_per_trial() -> None:
    from rich.console import Console

    console = Console(record=True, width=140)
    console.print(trials_table(["dp4 tp1 mb4", "dp2 tp2 mb4"], [0.0363, 0.0368], [0.0441, 0.0402], 1))
    text = console.export_text()
    assert "36.3 ms" in text and "44.1 ms" in text and "1.21" in text
    rows = {line.split("│")[2].strip(): line for line in text.splitlines() if "dp" in line}
    assert "trains" in rows["dp2 tp2 mb4"] and "trains" not in rows["dp4 tp1 mb4"]


def test_manual_refuses_typed_trials() -> None:
    """``+cfp=manual`` trains its plan as given: a typed ``cfp.trials`` would do nothing."""
    from cfp_megatron.planner.plan_inputs import check_typed_before_plan

    cfg = compose_config(["+cfp=manual", "cfp.trials=2"])
    with pytest.raises(ConfigError, match="would do nothing") as caught:
        check_typed_before_plan(job_from_config(cfg), cfp_from_config(cfg), ("cfp.trials",))
    assert caught.value.keys == ["cfp.trials"]


@pytest.fixture()
def one_rank_group():
    """A one-rank gloo group, as the trials' round syncs over the default group."""
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


def test_trials_get_only_what_profiling_left_of_the_budget(one_rank_group: None) -> None:
    """Nothing left of ``cfp.profile_budget_s``: no trial runs, none is stored, and the search's plan trains."""
    from cfp_megatron.backends.megatron.trials import run_trials, trial_lines
    from cfp_megatron.base.launch_env import LaunchEnv

    env = LaunchEnv(rank=0, world_size=1, local_rank=0, local_world_size=1, restart_count=0, under_torchrun=False)
    plans = [_plan(100, None), _plan(104, None, tp=2)]
    outcome = run_trials(JOB, plans, calibrations=[1.0, 1.0], env=env, warmup_steps=3, budget_s=0.0, on_gpu=False)
    assert outcome.measured == (None, None) and outcome.round.status.value == "timeout"
    assert outcome.records == (None, None)
    pick = measured_pick(outcome.measured)
    said = trial_lines(outcome, pick, 0.0)
    assert pick is None and "raise cfp.profile_budget_s" in said[1] and "the search's plan trains" in said[-1]
