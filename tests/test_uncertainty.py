"""Error bands from the validator's residuals, the best published MFU, and what the planner says with them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.backends.megatron.report import trust_notes
from cfp_megatron.plan.artifact import Plan, PlanPrediction
from cfp_megatron.search.search import search
from cfp_megatron.sim.uncertainty import BANDS_FILE, best_published_mfu, error_band, plan_classes, quantile
from cfp_megatron.validate import main
from tests.test_search import compose_job

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"
CSVS = [DATA / "published_runs.csv", DATA / "published_runs_moe.csv"]


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert quantile([1.0, 2.0], 0.8) == pytest.approx(1.8)
    assert quantile([7.0], 0.8) == 7.0


@pytest.mark.skipif(not all(p.exists() for p in CSVS), reason="shared/data is not here")
def test_stored_bands_are_the_validators_current_residuals(tmp_path: Path) -> None:
    """The file the planner reads is what validate computes now: a simulator change that moves the residuals
    fails here until ``python -m cfp_megatron.validate --bands cfp_megatron/sim/error_bands.json ...`` is rerun."""
    out = tmp_path / "bands.json"
    assert main([*map(str, CSVS), "--bands", str(out)]) == 0
    assert json.loads(out.read_text()) == json.loads(BANDS_FILE.read_text())


def test_a_plan_takes_the_widest_band_of_its_classes() -> None:
    stored = json.loads(BANDS_FILE.read_text())
    job, _ = compose_job("model=moe_tiny", "cluster=dgx_h100", "parallel.ep=4", "train.global_batch_size=16")
    assert plan_classes(job) == ("MoE", "GPU hopper")
    band = error_band(job)
    assert band is not None
    assert band.pct == max(stored["classes"][c]["pct"] for c in ("MoE", "GPU hopper"))
    blackwell, _ = compose_job("model=gpt_tiny", "cluster=b200")
    untested = error_band(blackwell)
    assert untested is not None and untested.untested == ("GPU blackwell",)
    assert untested.pct == max(stored["classes"]["dense"]["pct"], stored["all"]["pct"])
    cpu, _ = compose_job("model=gpt_tiny")
    assert error_band(cpu) is None  # a profiled CPU cluster: the plan check measures it instead


def test_the_planner_says_how_far_to_trust_its_pick() -> None:
    job, cfp = compose_job("model=llama_tiny", "cluster=dgx_a100", "cluster.nodes=1", "train.global_batch_size=32",
                           "train.seq_length=256", "cfp.top_k=3")
    result = search(job, 8, cfp)
    notes = trust_notes(result, peak_tflops=312.0)
    assert notes[0].startswith(f"error band ±{error_band(result.ranked[0].job).pct:.0f}%")
    margin = 1 - result.ranked[0].prediction.step_time_s / result.ranked[1].prediction.step_time_s
    assert any("inside that band" in n for n in notes) == (margin * 100 < error_band(result.ranked[0].job).pct)
    assert not any("above the best published" in n for n in notes)  # a tiny model is far from it
    published = best_published_mfu(job)
    assert published is not None
    # Against a peak a thousand times lower the same prediction claims an MFU no published run reached.
    assert any("above the best published" in n for n in trust_notes(result, peak_tflops=0.312))


def test_plan_json_carries_the_band_and_old_plans_still_load() -> None:
    job, cfp = compose_job("model=llama_tiny", "cluster=dgx_a100", "cluster.nodes=1", "train.global_batch_size=32",
                           "train.seq_length=256", "cfp.top_k=1")
    best = search(job, 8, cfp).ranked[0]
    prediction = PlanPrediction.of(best.prediction, 312.0, error_band(best.job))
    plan = Plan.from_job(best.job, world_size=8, prediction=prediction, inputs_fingerprint="")
    data = plan.to_json()
    assert data["prediction"]["error_band_pct"] == pytest.approx(error_band(best.job).pct)
    assert Plan.from_json(data) == plan
    del data["prediction"]["error_band_pct"]  # a plan written before the band (and before the content hash)
    data.pop("content_hash", None)
    data.pop("inputs", None)
    data["schema_version"] = 1  # version 2 requires the content hash
    assert Plan.from_json(data).predicted == dataclasses.replace(prediction, error_band_pct=None)
