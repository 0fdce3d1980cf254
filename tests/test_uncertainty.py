"""Error bands out of sample (leave-one-source-out), the MFU check against comparable published runs, and what the
planner says with them."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.backends.megatron.report import ranking_table, trust_notes
from cfp_megatron.base.config import Precision
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.plan.artifact import Plan, PlanPrediction
from cfp_megatron.search.search import search
from cfp_megatron.sim.calibration import FITTED, Efficiency
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.uncertainty import BANDS_FILE, MIN_BAND_ROWS, error_band, mfu_check, plan_classes, quantile
from cfp_megatron.validate import main
from cfp_megatron.validation.bands import band_table, held_out_predictions
from cfp_megatron.validation.fit import NEUTRAL, refit, sensitivities
from cfp_megatron.validation.results import RowPlan, RowResult
from cfp_megatron.validation.rows import PUBLISHED_RUNS
from tests.test_search import compose_job

CSVS = list(PUBLISHED_RUNS)


def test_quantile_interpolates_between_order_statistics() -> None:
    assert quantile([4.0, 1.0, 3.0, 2.0, 5.0], 0.5) == 3.0
    assert quantile([1.0, 2.0], 0.8) == pytest.approx(1.8)
    assert quantile([7.0], 0.8) == 7.0


def test_stored_bands_are_the_validators_current_residuals(tmp_path: Path) -> None:
    """The file the planner reads is what validate computes now (but the date it ran): a simulator change that
    moves the residuals fails here until ``python -m cfp_megatron.validate --bands cfp_megatron/sim/error_bands.json
    ...`` is rerun."""
    out = tmp_path / "bands.json"
    assert main([*map(str, CSVS), "--bands", str(out)]) == 0
    written, stored = json.loads(out.read_text()), json.loads(BANDS_FILE.read_text())
    written.pop("date")
    assert stored.pop("date")
    assert _rounded(written) == _rounded(stored)


def test_a_plan_takes_the_band_of_the_runs_most_like_it() -> None:
    stored = json.loads(BANDS_FILE.read_text())
    job, _ = compose_job("model=moe_tiny", "cluster=dgx_h100", "parallel.ep=4", "train.global_batch_size=16")
    assert plan_classes(job) == ("MoE", "GPU hopper")
    band = error_band(job)
    assert band is not None and band.basis == "MoE, GPU hopper"  # the runs with all its classes
    assert band.pct == stored["combinations"]["MoE, GPU hopper"]["pct"]
    cp, _ = compose_job("model=llama_tiny", "cluster=dgx_h100", "parallel.cp=2", "train.seq_length=256")
    assert stored["combinations"].get("dense, CP, GPU hopper", {"rows": 0})["rows"] < MIN_BAND_ROWS
    # Too few CP runs: its kind on its generation, but never narrower than the CP class's own band (all runs',
    # borrowed), so a plan with CP never looks better evidenced than the same plan without it.
    cp_band, no_cp = error_band(cp), error_band(compose_job("model=llama_tiny", "cluster=dgx_h100",
                                                            "train.seq_length=256")[0])
    assert cp_band.pct == max(stored["combinations"]["dense, GPU hopper"]["pct"], stored["classes"]["CP"]["pct"])
    assert cp_band.pct >= no_cp.pct and "CP" in cp_band.borrowed
    fsdp = ("model=llama_tiny", "cluster=dgx_a100", "parallel.fsdp=optim_grads_params",
            "parallel.distributed_optimizer=true", "train.seq_length=256")
    assert stored["combinations"].get("dense, CP, FSDP, GPU ampere", {"rows": 0})["rows"] < MIN_BAND_ROWS
    with_cp, without = error_band(compose_job(*fsdp, "parallel.cp=2")[0]), error_band(compose_job(*fsdp)[0])
    assert without.basis == "dense, FSDP, GPU ampere"  # the runs with all its classes
    assert with_cp.pct >= without.pct  # the FSDP class the kind-on-generation runs leave out still counts
    blackwell, _ = compose_job("model=gpt_tiny", "cluster=b200")  # no run on its generation: the widest of classes
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
    # the band of the plan the search chose (the fastest, or one inside its band resting on more evidence)
    assert notes[0].startswith(f"error band ±{error_band(result.best.job).pct:.0f}%")
    if result.best is result.ranked[0]:
        margin = 1 - result.ranked[0].prediction.step_time_s / result.ranked[1].prediction.step_time_s
        assert any("inside that band" in n for n in notes) == (margin * 100 < error_band(result.best.job).pct)
    else:  # the chosen plan says why it was chosen over the fastest, not its margin
        assert not any("inside that band" in n for n in notes)
    assert any("no published run is comparable" in n for n in notes)  # no published model is as tiny
    check = mfu_check(job)
    assert check is not None and check.runs == ()
    assert not check.above_all(10.0)  # nothing comparable: no flag, and the note says so


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


def _rounded(value: object) -> object:
    """``value`` with its numbers to 2 decimals (the linear programme's last digits may differ between machines)."""
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return round(value, 2) if isinstance(value, float) else value


def _rows(source: str, fp8: bool, truth: Efficiency) -> list[RowPlan]:
    """Four runs of a LLaMA-3-8B-sized model on one H100 node from ``source``, "measured" as the simulator predicts
    them with the efficiencies ``truth``."""
    rows = []
    for tp, gbs in ((1, 64), (2, 64), (4, 128), (8, 128)):
        job, _ = compose_job("model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", f"parallel.tp={tp}",
                             f"parallel.sp={tp > 1}", f"train.global_batch_size={gbs}", "train.micro_batch_size=1",
                             "train.seq_length=4096", "parallel.recompute=selective",
                             *(["train.precision=fp8"] if fp8 else []))
        options = SimOptions()
        measured = simulate(job, options=options, efficiency=truth).step_time_s
        rows.append(RowPlan(row_id=f"{source}{tp}", source=f"{source}, a table", model="llama3_8b",
                            layout=f"tp{tp}", job=job, options=options, measured_s=measured))
    return rows


def test_the_band_is_out_of_sample() -> None:
    """Two sources of BF16 runs measured as the neutral efficiencies predict, and one of FP8 runs whose FP8 GEMMs
    reach 85% of the peak (the neutral start says 60%): fitted with them, the FP8 efficiency absorbs it (in sample
    they look right); held out, no other source informs FP8, so they are predicted with the neutral share and miss,
    and the band widens. A band from the fitted rows would stay narrow."""
    plans = (_rows("A", False, NEUTRAL) + _rows("B", False, NEUTRAL)
             + _rows("C", True, NEUTRAL.replace(gemm_fp8=0.85)))
    outliers = [p for p in plans if NumberFormat.of(p.job.train).low]
    fitted = refit(sensitivities(plans, FITTED), {"hopper"})
    in_sample = [abs(simulate(p.job, options=p.options, efficiency=fitted["hopper"]).step_time_s / p.measured_s - 1)
                 for p in outliers]
    assert max(in_sample) < 0.01  # fitted on them, the outliers look right
    without = refit(sensitivities([p for p in plans if not NumberFormat.of(p.job.train).low], FITTED), {"hopper"})
    assert without["hopper"].gemm_fp8 == NEUTRAL.gemm_fp8  # no row informs it: the neutral start, not the shipped
    held = held_out_predictions(plans)
    missed = [abs(held[p.row_id] / p.measured_s - 1) for p in outliers]
    assert sum(missed) / len(missed) > 0.10 and min(missed) > 0.05  # held out, they are missed
    results = [RowResult(plan=p, predicted_s=simulate(p.job, options=p.options).step_time_s, memory_gib=0.0)
               for p in plans]
    table = band_table(results, {}, ["runs.csv"])
    assert table["sources"]["C"]["mape"] > 10 and table["sources"]["A"]["mape"] < 3
    assert table["combinations"]["dense, GPU hopper"]["pct"] > 10  # the band shows the held-out miss
    assert table["method"].startswith("leave-one-source-out")


def test_the_mfu_check_compares_runs_like_the_plan() -> None:
    """GPT-3 175B on A100s is compared with the published A100 runs of 87-350B dense models (Megatron-LM's GPT-3
    and 145-310B runs), not with MPT-7B's 64%; a plan above all of them is flagged in the table."""
    job, _ = compose_job("model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128",
                         "train.global_batch_size=1536", "train.seq_length=2048")
    check = mfu_check(job)
    assert check is not None and check.runs
    assert all(87 <= run.active_params_b <= 350 for run in check.runs)
    assert not any("MPT-7b" in run.row for run in check.runs)
    best = check.runs[0].mfu
    assert best < 0.58
    assert check.above_all(best + 0.01) and not check.above_all(best - 0.01)
    assert "above every comparable published run" in check.note(best + 0.01)
    fp8_job = dataclasses.replace(job, train=dataclasses.replace(job.train, precision=Precision.fp8))
    assert mfu_check(fp8_job).runs == ()  # no FP8 run on A100s


def test_the_table_flags_an_mfu_above_every_comparable_run() -> None:
    job, cfp = compose_job("model=llama2_7b", "cluster=dgx_a100", "cluster.nodes=1", "train.global_batch_size=64",
                           "train.seq_length=2048", "cfp.top_k=2")
    result = search(job, 8, cfp)
    check = mfu_check(job)
    assert check is not None and check.runs  # MPT-7B and MPT-13B on 8 A100s
    table = ranking_table(result, peak_tflops=31.2)  # a tenth of the peak: ten times the MFU, above them all
    cells = list(table.columns[5].cells)
    assert cells and all(cell.endswith(" !") for cell in cells)
    assert any("above every comparable" in n for n in trust_notes(result, peak_tflops=31.2))
    assert not any(cell.endswith("!") for cell in ranking_table(result, peak_tflops=3120.0).columns[5].cells)


def test_the_deepspeed_table_flags_an_mfu_above_every_comparable_run() -> None:
    from cfp_megatron.backends.deepspeed.search import ranking_table as zero_table
    from cfp_megatron.backends.deepspeed.search import search_zero
    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.base.cfp_spec import cfp_from_config
    from cfp_megatron.base.compose import compose_config

    cfg = compose_config(["+cfp=auto", "backend=deepspeed"])
    cfp, backend = cfp_from_config(cfg), backend_from_config(cfg)
    # At a tenth of the A100's peak the GEMMs dominate the step (MFU near their efficiency, 77%, above every
    # published 4-16B run on A100s); at ten times it memory-bound work and communication do (35%).
    for peak, flagged in ((31.2, True), (3120.0, False)):
        job, _ = compose_job("model=llama3_8b", "cluster=dgx_a100", "cluster.nodes=1",
                             f"cluster.peak_tflops_bf16={peak}", "train.global_batch_size=64",
                             "train.seq_length=2048", "train.precision=bf16")
        result = search_zero(job, 8, cfp, backend, on_gpu=True)
        cells = list(zero_table(result, job).columns[4].cells)
        assert cells and all(cell.endswith(" !") == flagged for cell in cells)
        assert not any(cell.endswith("!") for cell in zero_table(result).columns[4].cells)  # no job: no check
