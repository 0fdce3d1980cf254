"""Layout sweeps (:mod:`cfp_megatron.validation.sweeps`): one job's rows at several layouts, the pairs the prediction
orders as measured and the regret of trusting its favourite, exactly, on synthetic rows and through the CLI."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.uncertainty import ErrorBand
from cfp_megatron.validate import main
from cfp_megatron.validation.results import RowPlan, RowResult
from cfp_megatron.validation.sweeps import TIE_MARGIN, find_sweeps, sweep_lines, sweep_summary

JOB = {"source": "Some paper", "framework": "Megatron-LM", "model": "GPT 22B", "layers": "48", "hidden": "6144",
       "heads": "64", "seq_len": "2048", "gpu": "A100-80GB", "num_gpus": "8", "global_batch_seqs": "4",
       "precision": "bf16"}


@pytest.fixture(scope="module")
def job():
    return compose_job([])


def _runs(job, *runs: tuple[str, str, float, float], **job_columns: str):
    """(results, rows by id) of runs (id, layout, measured s, predicted s) of one job (``JOB`` with ``job_columns``)."""
    rows = {rid: {**JOB, **job_columns, "id": rid} for rid, *_ in runs}
    results = [RowResult(plan=RowPlan(row_id=rid, source=rows[rid]["source"], model=rows[rid]["model"],
                                      layout=layout, job=job, options=SimOptions(), measured_s=measured),
                         predicted_s=predicted, memory_gib=1.0) for rid, layout, measured, predicted in runs]
    return results, rows


def test_a_sweep_ordered_as_measured_costs_nothing(job) -> None:
    results, rows = _runs(job, ("1", "tp8 full", 1.5, 1.6), ("2", "tp8 sp selective", 1.2, 1.25),
                          ("3", "tp4 pp2 full", 2.0, 1.9))
    [sweep] = find_sweeps(results, rows)
    assert sweep.rows == ("1", "2", "3") and sweep.name == "GPT 22B on 8 GPUs"
    assert [(p.faster, p.slower) for p in sweep.pairs] == [("2", "1"), ("1", "3"), ("2", "3")]
    assert [p.ordered for p in sweep.pairs] == [True, True, True] and sweep.ordered == 3
    assert sweep.pairs[0].measured_gap == pytest.approx(0.25) and sweep.pairs[0].predicted_gap == pytest.approx(0.28)
    assert sweep.regret == 0.0


def test_a_reversed_sweep_counts_its_pair_and_the_regret_of_the_predicted_favourite(job) -> None:
    results, rows = _runs(job, ("1", "tp8", 1.0, 1.2), ("2", "tp4 pp2", 1.1, 1.0))
    [sweep] = find_sweeps(results, rows)
    [pair] = sweep.pairs
    assert (pair.faster, pair.slower, pair.ordered) == ("1", "2", False)
    assert pair.measured_gap == pytest.approx(0.1) and pair.predicted_gap == pytest.approx(1.0 / 1.2 - 1)
    assert sweep.ordered == 0 and sweep.regret == pytest.approx(0.1)  # trusting the prediction runs row 2: 10% slower


def test_ties_are_no_pair_and_a_predicted_tie_is_not_an_order(job) -> None:
    inside = 1.0 * (1 + TIE_MARGIN / 2)
    results, rows = _runs(job, ("1", "a", 1.0, 1.0), ("2", "b", inside, 1.1), ("3", "c", 1.2, 1.0))
    [sweep] = find_sweeps(results, rows)
    # 1 and 2 differ by half the margin: no pair; 3 is slower than both by more than the margin
    assert [(p.faster, p.slower) for p in sweep.pairs] == [("1", "3"), ("2", "3")]
    # 1 and 3 are predicted alike (no order), 2 is predicted slower than 3 (reversed)
    assert [p.ordered for p in sweep.pairs] == [False, False]
    assert sweep.regret == pytest.approx(0.2)  # 1 and 3 share the fastest prediction: the slower measured counts


def test_one_layout_or_one_row_is_no_sweep_and_a_job_column_splits_jobs(job) -> None:
    single, rows = _runs(job, ("1", "tp8", 1.0, 1.1))
    assert find_sweeps(single, rows) == []
    again, rows = _runs(job, ("1", "tp8", 1.0, 1.1), ("2", "tp8", 1.3, 1.1))  # one layout measured twice
    assert find_sweeps(again, rows) == []
    one, rows_one = _runs(job, ("1", "tp8", 1.0, 1.1))
    other, rows_other = _runs(job, ("2", "tp4 pp2", 2.0, 1.0), global_batch_seqs="8")  # another job's batch
    assert find_sweeps(one + other, {**rows_one, **rows_other}) == []
    # job columns compare without case or repeated blanks
    spaced, rows_spaced = _runs(job, ("3", "tp4 pp2", 2.0, 1.0), model="gpt  22b ", precision="BF16")
    [sweep] = find_sweeps(one + spaced, {**rows_one, **rows_spaced})
    assert sweep.rows == ("1", "3")


def _band(pct: float):
    return lambda result: ErrorBand(pct=pct, rows=10, classes=("dense", "GPU ampere"))


def test_the_band_of_a_pair_is_the_wider_of_its_rows_and_says_whether_the_planner_would_trust_the_gap(job) -> None:
    results, rows = _runs(job, ("1", "tp8", 1.0, 1.2), ("2", "tp4 pp2", 1.1, 1.0), ("3", "tp2 pp4", 1.5, 1.6))
    bands = {"1": 5.0, "2": 20.0, "3": 5.0}
    [sweep] = find_sweeps(results, rows, band_of=lambda r: ErrorBand(pct=bands[r.plan.row_id], rows=10,
                                                                     classes=("dense",)))
    by_ids = {(p.faster, p.slower): p for p in sweep.pairs}
    assert by_ids[("1", "2")].band_pct == 20.0 and by_ids[("1", "2")].inside_band  # predicted 16.7% apart, +-20%
    assert by_ids[("1", "3")].band_pct == 5.0 and not by_ids[("1", "3")].inside_band  # 33% apart, +-5%
    [pair] = find_sweeps(results[:2], rows, band_of=lambda r: None)[0].pairs
    assert pair.band_pct is None and not pair.inside_band  # no band: never inside (as the planner's choice)


def test_the_totals_over_sweeps(job) -> None:
    right, rows_right = _runs(job, ("1", "tp8 full", 1.5, 1.6), ("2", "tp8 sp selective", 1.2, 1.25))
    wrong, rows_wrong = _runs(job, ("3", "tp8", 1.0, 1.2), ("4", "tp4 pp2", 1.1, 1.0), num_gpus="16")
    lone, rows_lone = _runs(job, ("5", "tp8", 1.0, 1.0), num_gpus="32")
    sweeps = find_sweeps(right + wrong + lone, {**rows_right, **rows_wrong, **rows_lone}, band_of=_band(10.0))
    summary = sweep_summary(sweeps)
    assert (summary["count"], summary["pairs"], summary["ordered"]) == (2, 2, 1)
    # predicted 28% and 16.7% apart: both outside +-10%, and the misordered pair with them
    assert (summary["inside_band"], summary["misordered_outside_band"]) == (0, 1)
    assert summary["mean_regret"] == pytest.approx(0.05) and summary["worst_regret"] == pytest.approx(0.1)
    assert [s["rows"] for s in summary["sweeps"]] == [["1", "2"], ["3", "4"]]
    lines = sweep_lines(sweeps)
    assert ("misordered: 3 faster than 4, measured +10.0%, predicted -16.7%, outside the ±10% band" in lines[-3])
    assert lines[-2] == ("  0 of 2 pairs predicted within their band (where the planner lets the evidence choose); "
                         "misordered outside it: 1")
    assert lines[-1] == ("layout sweeps: 1 of 2 pairs ordered as measured (50%) over 2 sweeps; regret of the "
                         "predicted favourite 5.0% mean, 10.0% worst")
    assert sweep_lines([]) == ["layout sweeps: none (no job is measured at two layouts among the rows kept)"]
    assert sweep_summary([])["mean_regret"] is None


FIELDS = ["id", "source", "model", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus", "tp", "pp", "dp",
          "micro_batch", "global_batch_seqs", "recompute", "step_time_s"]
ROW = {"id": "1", "source": "Some lab", "model": "GPT 1.3B", "layers": "24", "hidden": "2048", "heads": "16",
       "seq_len": "2048", "gpu": "A100-80GB", "num_gpus": "8", "tp": "1", "pp": "1", "dp": "8", "micro_batch": "4",
       "global_batch_seqs": "32", "recompute": "", "step_time_s": "1.0"}


def test_the_cli_prints_the_sweeps_after_the_classes_and_reports_them(tmp_path: Path, capsys) -> None:
    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows([ROW, {**ROW, "id": "2", "recompute": "full", "step_time_s": "1.3"},
                          {**ROW, "id": "3", "tp": "2", "dp": "4", "global_batch_seqs": "64", "step_time_s": "2.0"}])
    report = tmp_path / "report.json"
    assert main([str(path), "--json", str(report)]) == 0
    out = capsys.readouterr().out
    assert out.index("layout sweeps (one job") > out.index("\ndense ")  # after the classes
    data = json.loads(report.read_text())
    predicted = {row["id"]: row["predicted_s"] for row in data["rows"]}
    ordered = predicted["2"] > predicted["1"]  # full recomputation measured 30% slower than none
    assert data["sweeps"]["count"] == 1 and data["sweeps"]["sweeps"][0]["rows"] == ["1", "2"]  # row 3: another batch
    assert (data["sweeps"]["pairs"], data["sweeps"]["ordered"]) == (1, int(ordered))
    assert data["sweeps"]["mean_regret"] == (0.0 if ordered else 0.3)
    assert re.search(rf"^layout sweeps: {int(ordered)} of 1 pairs ordered as measured .* over 1 sweeps;", out,
                     re.MULTILINE)


def test_a_superseded_row_is_left_out_of_the_sweeps(tmp_path: Path, monkeypatch, capsys) -> None:
    from cfp_megatron.validation import superseded

    path = tmp_path / "runs.csv"
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*FIELDS, "source_detail"])
        writer.writeheader()
        writer.writerows([{**ROW, "source_detail": "24.01"},
                          {**ROW, "id": "2", "recompute": "full", "step_time_s": "1.3", "source_detail": "24.01"}])
    entry = tmp_path / "superseded.yaml"
    monkeypatch.setattr(superseded, "SUPERSEDED_FILE", entry)
    text = ('version: 1\nsuperseded:\n  - name: GPT 1.3B full\n    row: "2"\n    row_source: Some lab\n'
            '    figure_column: step_time_s\n    measured: 1.3\n    container: "24.01"\n'
            '    same: {num_gpus: 8}\n    remeasured: {container: "24.01.01", figure: 1.2}\n'
            '    where: the page, line 2\n    source: the page\n')
    entry.write_text(text.replace("row_source: Some lab", "row_source: Another lab"))  # names no row here
    assert main([str(path)]) == 0
    assert "over 1 sweeps;" in capsys.readouterr().out
    entry.write_text(text)
    assert main([str(path)]) == 0
    assert "layout sweeps: none" in capsys.readouterr().out
