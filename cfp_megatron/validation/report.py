"""The figures of ``python -m cfp_megatron.validate``: each row's classes, the error per class, the ``--json``
report (the ``--bands`` file: :mod:`cfp_megatron.validation.bands`)."""

from __future__ import annotations

import re

from cfp_megatron.sim.calibration import generation
from cfp_megatron.validation.memory_failures import memory_failures
from cfp_megatron.validation.results import RowResult, mape
from cfp_megatron.validation.rows import CsvRow, count_cell
from cfp_megatron.validation.sweeps import find_sweeps, sweep_summary


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


REPORT_KEYS = frozenset({"rows", "refused", "coverage", "mape"})
"""Keys of the ``--json`` report (:func:`report`): an existing file holding them all is one this command wrote."""


def rows_by_id(rows: list[dict]) -> dict[str, dict]:
    """Each id's row: the first of that id (a later row of the same id is refused, :func:`predict_rows`)."""
    found: dict[str, dict] = {}
    for row in rows:
        found.setdefault((row.get("id") or "").strip(), row)
    return found


def report(results: list[RowResult], skipped: list[tuple[dict, str]], rows: list[dict],
           superseded: dict[str, str] | None = None) -> dict:
    """The ``--json`` report: each modelled row (its prediction, flag and, where its source superseded it, why:
    ``superseded``, row id -> reason), each row not modelled with its reason, the coverage, the MAPE per class and
    over the rows kept (``None`` when no row was kept), and over all modelled rows (``mape_all``), the memory
    failures and the layout sweeps among the rows kept (:mod:`cfp_megatron.validation.sweeps`)."""
    by_id = rows_by_id(rows)
    superseded = superseded or {}
    kept = [r for r in results if r.plan.row_id not in superseded]

    def located(row: dict) -> dict:
        return {"file": str(row.file), "line": row.line} if isinstance(row, CsvRow) else {}

    return {
        "rows": [{"id": r.plan.row_id, **located(by_id.get(r.plan.row_id, {})), "model": r.plan.model,
                  "layout": r.plan.layout, "measured_s": r.plan.measured_s, "predicted_s": r.predicted_s,
                  "error_pct": round(r.error_pct, 3), "memory_gib": round(r.memory_gib, 3), "flag": r.flag or None,
                  "approximations": list(r.plan.approximations),
                  "superseded": superseded.get(r.plan.row_id)}
                 for r in results],
        "refused": [{"id": row.get("id"), **located(row), "model": row.get("model"), "reason": reason}
                    for row, reason in skipped],
        "coverage": {"modelled": len(results), "with_step_time": sum(has_step_time(row) for row in rows)},
        "classes": {name: {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3)}
                    for name, errors in sorted(class_errors(kept, by_id).items())},
        "mape": round(mape(kept), 3) if kept else None,
        "mape_all": round(mape(results), 3) if results else None,
        "memory_failures": memory_failures(results),
        "sweeps": sweep_summary(find_sweeps(kept, by_id)),
    }
