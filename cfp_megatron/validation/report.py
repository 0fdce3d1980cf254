"""The figures of ``python -m cfp_megatron.validate``: each row's classes, the error per class, the ``--json``
report and the ``--bands`` table."""

from __future__ import annotations

import re

from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.kernels import target_peak_tflops
from cfp_megatron.sim.uncertainty import BAND_QUANTILE, quantile
from cfp_megatron.validation.results import RowResult, mape
from cfp_megatron.validation.rows import CsvRow, count_cell


def row_classes(row: dict) -> tuple[str, ...]:
    """The classes a row's error is reported under: ``MoE`` or ``dense``, and ``CP`` (context parallel) and ``FSDP``
    (fully sharded data parallel) where they apply."""
    moe = (row.get("arch_type") or "").strip().lower() == "moe" or bool((row.get("moe_experts") or "").strip())
    classes = ["MoE" if moe else "dense"]
    if (count_cell(row, "cp", 1) or 1) > 1:
        classes.append("CP")
    if re.search(r"fsdp|zero-?3", row.get("zero_or_fsdp") or "", re.IGNORECASE):
        classes.append("FSDP")
    return tuple(classes)


def has_step_time(row: dict) -> bool:
    """Whether a row measured a step time (``step_time_s``, ``derived_step_time_s`` or ``tokens_per_s_per_gpu``)."""
    return any((row.get(k) or "").strip() for k in ("step_time_s", "derived_step_time_s", "tokens_per_s_per_gpu"))


def class_errors(results: list[RowResult], rows_by_id: dict[str, dict]) -> dict[str, list[float]]:
    """Absolute percentage errors by class: each row's :func:`row_classes` and its GPU generation."""
    by_class: dict[str, list[float]] = {}
    for r in results:
        row = rows_by_id.get(r.plan.row_id, {})
        for name in (*row_classes(row), f"GPU {generation(r.plan.job.cluster)}"):
            by_class.setdefault(name, []).append(abs(r.error_pct))
    return by_class


def uncertainty_table(results: list[RowResult], rows_by_id: dict[str, dict]) -> dict:
    """What :mod:`cfp_megatron.sim.uncertainty` stores: per class the rows, MAPE and band (the
    :data:`~cfp_megatron.sim.uncertainty.BAND_QUANTILE` quantile of the absolute errors), the same over all rows, and
    per GPU generation and model kind the best MFU a measured run reached (against the dense bf16 peak, model FLOPs
    as the planner counts them; layer-only and FP8 rows left out)."""

    def summary(errors: list[float]) -> dict:
        return {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3),
                "pct": round(quantile(errors, BAND_QUANTILE), 3)}

    classes = {name: summary(errors) for name, errors in sorted(class_errors(results, rows_by_id).items())}
    best: dict[str, dict] = {}
    for r in results:
        job, plan = r.plan.job, r.plan
        peak = target_peak_tflops(job)
        if plan.options.measured_layer_only or plan.options.fp8 or not peak:
            continue  # FP8 runs do more per second than the bf16 peak the planner's MFU is counted against
        world = job.cluster.nodes * (job.cluster.gpus_per_node or 1)
        tokens_per_s = job.train.global_batch_size * job.train.seq_length / plan.measured_s / world
        measured = tokens_per_s * training_flops_per_token(job.model, job.train.seq_length) / (peak * 1e12)
        key = f"{generation(job.cluster)} {'MoE' if job.model.is_moe else 'dense'}"
        if key not in best or measured > best[key]["mfu"]:
            best[key] = {"mfu": round(measured, 4), "row": f"{plan.row_id} {plan.model}".strip()}
    everything = [abs(r.error_pct) for r in results]
    return {"quantile": BAND_QUANTILE, "classes": classes, "all": summary(everything) if everything else None,
            "best_mfu": dict(sorted(best.items()))}


REPORT_KEYS = frozenset({"rows", "refused", "coverage", "mape"})
"""Keys of the ``--json`` report (:func:`report`): an existing file holding them all is one this command wrote."""


def rows_by_id(rows: list[dict]) -> dict[str, dict]:
    """Each id's row: the first of that id (a later row of the same id is refused, :func:`predict_rows`)."""
    found: dict[str, dict] = {}
    for row in rows:
        found.setdefault((row.get("id") or "").strip(), row)
    return found


def report(results: list[RowResult], skipped: list[tuple[dict, str]], rows: list[dict]) -> dict:
    """The ``--json`` report: each modelled row (its prediction and flag), each row not modelled with its reason,
    the coverage, the MAPE per class and over all rows (``None`` when no row was modelled)."""
    by_id = rows_by_id(rows)

    def located(row: dict) -> dict:
        return {"file": str(row.file), "line": row.line} if isinstance(row, CsvRow) else {}

    return {
        "rows": [{"id": r.plan.row_id, **located(by_id.get(r.plan.row_id, {})), "model": r.plan.model,
                  "layout": r.plan.layout, "measured_s": r.plan.measured_s, "predicted_s": r.predicted_s,
                  "error_pct": round(r.error_pct, 3), "memory_gib": round(r.memory_gib, 3), "flag": r.flag or None}
                 for r in results],
        "refused": [{"id": row.get("id"), **located(row), "model": row.get("model"), "reason": reason}
                    for row, reason in skipped],
        "coverage": {"modelled": len(results), "with_step_time": sum(has_step_time(row) for row in rows)},
        "classes": {name: {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3)}
                    for name, errors in sorted(class_errors(results, by_id).items())},
        "mape": round(mape(results), 3) if results else None,
    }
