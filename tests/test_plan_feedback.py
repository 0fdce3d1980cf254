"""Feedback that cannot poison and plans that say what was not measured: the measured/predicted ratio is a
robust median tied to its profile and layout family, a busy machine and an outlier run are recorded but not trusted,
memory is never said to be calibrated; a plan whose partitions were not measured is marked. Pure (no process
group)."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.config import MlpPartition, Recompute
from cfp_megatron.cluster.measured import NothingMeasured, unmeasured_partitions
from cfp_megatron.engine.metrics import StepMetrics
from cfp_megatron.plan.artifact import PlanPrediction
from cfp_megatron.plan.check import device_memory, warnings_for
from cfp_megatron.profile.db import ProfileDB, layout_family, robust_ratio
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.records import PlanCheckRecord, SegmentRecord

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)
PLAN = "gpt_tiny@localx1x4:tp=1,sp=0,pp=2,vpp=1,cp=1,ep=1,etp=1,dp=2,mb=4,gbs=8,seq=64,rc=none,do=1"
OTHER = "gpt_tiny@localx1x4:tp=2,sp=1,pp=1,vpp=1,cp=1,ep=1,etp=1,dp=2,mb=4,gbs=8,seq=64,rc=none,do=1"


def _segment(kind: str, partition: str, mb: int = 1, forward: float = 1e-3) -> SegmentRecord:
    return SegmentRecord(model="m", model_name="gpt_tiny", segment=f"{kind}-id", kind=kind, partition=partition,
                         tp=int(partition[2]), micro_batch=mb, seq_length=64, forward_s=forward, backward_s=2e-3,
                         confirmed=True, activation_bytes=1e5, transient_bytes=0.0, workspace_bytes=0.0)


def _db() -> ProfileDB:
    return ProfileDB(fingerprint=FP).for_model("m").merged(
        segments=[_segment(k, "tp1") for k in ("embedding", "dense", "head")])


def _check(db: ProfileDB, ratio: float, *, plan: str = PLAN, **extra: object) -> PlanCheckRecord:
    return PlanCheckRecord(model="m", plan=plan, steps=3, predicted_step_s=0.1, calibration=1.0,
                           measured_step_s=0.1 * ratio, predicted_peak_bytes=1000.0, measured_peak_bytes=1000.0,
                           time=0.0, profile_id=db.profile_id(), **extra)


def test_one_outlier_run_does_not_move_the_ratio_by_more_than_its_spread() -> None:
    db = _db()
    steady = [1.20, 1.25, 1.22, 1.28]
    db = db.merged(plan_checks=[_check(db, r) for r in steady])
    before = db.calibration(plan=PLAN)
    assert before is not None and before.ratio == pytest.approx(1.22) and before.runs == 4  # with the profile's 1
    after = db.merged(plan_checks=[_check(db, 5.84)]).calibration(plan=PLAN)
    assert after is not None and after.untrusted == pytest.approx((5.84,))  # recorded, not trusted
    assert abs(after.ratio - before.ratio) <= before.spread * before.ratio
    assert len(db.merged(plan_checks=[_check(db, 5.84)]).plan_checks) == 5  # it stays in the DB


def test_a_second_run_far_from_the_first_waits_for_a_third() -> None:
    found = robust_ratio([1.2, 5.84])
    assert found.ratio == pytest.approx(1.2) and found.untrusted == pytest.approx((5.84,))
    assert robust_ratio([1.2, 1.3]).ratio == pytest.approx(1.25)
    decided = robust_ratio([1.2, 5.84, 5.9, 6.0])  # the later runs agree: the first was the odd one
    assert decided.ratio == pytest.approx(5.9) and decided.untrusted == pytest.approx((1.2,))


def test_a_fresh_profile_drops_the_old_ratio() -> None:
    db = _db()
    db = db.merged(plan_checks=[_check(db, 1.5), _check(db, 1.6)])
    assert db.step_time_calibration(plan=PLAN) == pytest.approx(1.5)  # the median of 1, 1.5 and 1.6
    remeasured = db.merged(segments=[_segment("dense", "tp1", forward=2e-3)])  # --force, or a completed profile
    assert remeasured.profile_id() != db.profile_id()
    assert remeasured.step_time_calibration(plan=PLAN) is None and len(remeasured.plan_checks) == 2
    legacy = dataclasses.replace(_check(db, 1.5), profile_id=None)  # written before checks named their profile
    assert ProfileDB(fingerprint=FP).for_model("m").merged(plan_checks=[legacy]).step_time_calibration() is None


def test_the_ratio_belongs_to_its_layout_family() -> None:
    db = _db()
    db = db.merged(plan_checks=[_check(db, 1.3), _check(db, 5.0, plan=OTHER)])
    assert db.step_time_calibration(plan=PLAN) == pytest.approx(1.15)  # halfway: one run and the profile's own
    assert db.step_time_calibration(plan=OTHER) == pytest.approx(3.0)
    assert db.step_time_calibration(plan=PLAN.replace("mb=4", "mb=2")) == pytest.approx(1.15)  # same family
    assert layout_family(PLAN) == "tp=1,sp=0,pp=2,vpp=1,cp=1,ep=1,rc=none"


def test_a_busy_machine_is_said_and_does_not_calibrate() -> None:
    db = _db()
    busy = _check(db, 3.0, other_load=0.9)
    noisy = _check(db, 3.0, repeat_spread=0.8)
    assert busy.busy is not None and "cores" in busy.busy and noisy.busy is not None
    assert _check(db, 3.0, other_load=0.1, repeat_spread=0.05).busy is None
    db2 = db.merged(plan_checks=[busy, noisy])
    found = db2.calibration(plan=PLAN)
    assert found is not None and found.ratio is None and len(found.untrusted) == 2
    assert db2.step_time_calibration(plan=PLAN) is None
    (warning,) = [w for w in warnings_for(busy, found) if "step time" in w]
    assert "busy" in warning and "does not calibrate" in warning


def test_the_warning_promises_only_what_happens() -> None:
    db = _db()
    record = dataclasses.replace(_check(db, 1.5), measured_peak_bytes=1462.0)
    calibration = db.merged(plan_checks=[record]).calibration(plan=PLAN)
    step, memory = warnings_for(record, calibration)
    assert "scaled by 1.25" in step and "afresh" in step and "profile's own prediction" in step
    assert "+46.2%" in memory and "not calibrated" in memory and "calibrated with it" not in memory


def test_a_trusted_ratio_scales_the_next_plan_even_within_the_tolerance() -> None:
    """A profile's error on its plans is partly its own bias (docs/planning.md, "Plan check"): the median of its
    trusted runs' ratios and its own prediction (1) scales the next plan even when it is within the check's 10%;
    the warning says by how much."""
    db = _db()
    close = db.merged(plan_checks=[_check(db, 1.05), _check(db, 1.12)])
    assert close.calibration(plan=PLAN).ratio == pytest.approx(1.05)
    assert close.step_time_calibration(plan=PLAN) == pytest.approx(1.05)
    (step,) = warnings_for(_check(db, 1.12), close.calibration(plan=PLAN))
    assert "+12.0%" in step and "scaled by 1.05" in step and "median of 2 run(s)" in step
    one = db.merged(plan_checks=[_check(db, 0.93)])
    assert one.step_time_calibration(plan=PLAN) == pytest.approx(0.965)
    assert not warnings_for(_check(db, 0.93), one.calibration(plan=PLAN))  # within 10%: no warning, still scaled


def test_the_profile_counts_as_one_run() -> None:
    """One run moves the next prediction halfway to it; two runs on either side of the prediction leave it; two
    that agree move it all the way; without a prior the runs alone decide (:func:`robust_ratio`)."""
    db = _db()
    assert db.merged(plan_checks=[_check(db, 1.3)]).step_time_calibration(plan=PLAN) == pytest.approx(1.15)
    split = db.merged(plan_checks=[_check(db, 0.92), _check(db, 1.09)])
    assert split.step_time_calibration(plan=PLAN) == pytest.approx(1.0)
    agree = db.merged(plan_checks=[_check(db, 1.3), _check(db, 1.32)])
    assert agree.step_time_calibration(plan=PLAN) == pytest.approx(1.3)
    assert robust_ratio([1.3]).ratio == pytest.approx(1.3)
    assert robust_ratio([1.3], prior=1.0).ratio == pytest.approx(1.15)
    assert robust_ratio([1.3], prior=1.0).runs == 1


def test_a_plan_on_unmeasured_partitions_is_marked() -> None:
    db = _db()
    kinds = ("dense",)
    args = {"mlp": MlpPartition.megatron, "layer_kinds": kinds}
    assert unmeasured_partitions(db, tp=1, sp=False, recompute=Recompute.none, **args) == ()
    assert unmeasured_partitions(db, tp=2, sp=True, recompute=Recompute.none, **args) == (
        "embedding tp2-sp", "dense tp2-sp", "head tp2-sp")
    assert unmeasured_partitions(db, tp=1, sp=False, recompute=Recompute.full, **args) == ("dense tp1-full",)
    assert unmeasured_partitions(None, tp=2, sp=True, recompute=Recompute.none, **args) == ()
    assert unmeasured_partitions(NothingMeasured(), tp=2, sp=True, recompute=Recompute.none, **args) == ()
    pred = PlanPrediction(step_time_s=0.1, tokens_per_s_per_gpu=1.0, mfu=None, peak_memory_gib=0.01,
                          bubble_fraction=0.0, exposed_comm_s=0.0, analytical=("dense tp2-sp",))
    data = pred.to_json()
    assert data["analytical"] == ["dense tp2-sp"] and PlanPrediction.from_json(data) == pred
    del data["analytical"]  # a plan.json written before the mark existed
    assert PlanPrediction.from_json(data).analytical == ()


def test_the_search_marks_plans_the_profile_did_not_measure() -> None:
    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.base.compose import compose_job
    from cfp_megatron.search.search import search

    job = compose_job(["model=gpt_tiny", "cluster=local"])
    from cfp_megatron.profile.fingerprint import model_key

    key = model_key(job, on_gpu=False)
    rows = [dataclasses.replace(_segment(k, "tp1", mb), model=key) for k in ("embedding", "dense", "head")
            for mb in (1, 2, 4, 8)]
    db = ProfileDB(fingerprint=FP).for_model(key).merged(segments=rows)
    result = search(job, 4, CfpSpec(top_k=20), measurements=db)
    assert any(r.unmeasured for r in result.ranked)
    for r in result.ranked:
        p = r.job.parallel
        if p.tp == 1 and p.recompute is Recompute.none:
            assert r.unmeasured == ()
        if p.tp > 1:
            assert any(f"tp{p.tp}" in u for u in r.unmeasured)


def test_on_a_gpu_the_check_also_gives_the_allocators_peak() -> None:
    """The check's memory is the tracked tensors' peak; on GPUs the allocator's (what running out of memory is
    about) is given beside it, from the measured step; on CPU nothing is added."""
    def step(n: int, *, tracked: float | None = None, device: float | None = None) -> StepMetrics:
        return StepMetrics(step=n, loss=1.0, lr=1e-3, grad_norm=1.0, applied=True, step_time_s=0.1, tokens_per_s=1.0,
                           tflops_per_rank=1.0, mfu=0.1, peak_bytes_max=tracked, device_peak_bytes_max=device)

    record = _check(_db(), 1.0)
    gpu = [step(1), step(2, tracked=1000.0, device=1030.0), step(3)]
    assert device_memory(record, gpu) == {"device_peak_gib": round(1030.0 / 2**30, 4), "device_memory_diff": 0.03}
    assert device_memory(record, [step(1), step(2, tracked=1000.0), step(3)]) == {}


def test_a_trial_at_launch_calibrates_as_a_run_does() -> None:
    """``cfp.trials`` stores each trial as a plan check marked ``trial``: it calibrates the next plan of its family
    as a training run's check does, and the mark survives the ProfileDB's file."""
    db = _db()
    tried = db.merged(plan_checks=[_check(db, 0.93, trial=True)])
    assert tried.step_time_calibration(plan=PLAN) == pytest.approx(0.965)
    back = ProfileDB.from_json(tried.to_json()).for_model("m")
    assert back.plan_checks[0].trial and back.step_time_calibration(plan=PLAN) == pytest.approx(0.965)
    assert not ProfileDB.from_json(db.merged(plan_checks=[_check(db, 0.93)]).to_json()).plan_checks[0].trial
