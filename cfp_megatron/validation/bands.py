"""The error-band file the planner ships (``cfp_megatron/sim/error_bands.json``, written by ``python -m
cfp_megatron.validate ... --bands FILE``): each class's band from leave-one-source-out cross-validation, and each
published run's model FLOPs utilisation for the planner's MFU check. Reasoning: docs/validation.md, "Error bands, out
of sample"."""

from __future__ import annotations

import datetime
from pathlib import Path

from cfp_megatron.base.flops import active_matmul_params_per_token
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import FITTED, TABLE, generation
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.uncertainty import BAND_QUANTILE, MIN_BAND_ROWS, combination, quantile
from cfp_megatron.validation.fit import refit, sensitivities, source_of
from cfp_megatron.validation.plausible import measured_mfu
from cfp_megatron.validation.report import row_classes
from cfp_megatron.validation.results import RowPlan, RowResult

METHOD = ("leave-one-source-out cross-validation: for each source (the first author or organisation of a row's "
          "`source`), the efficiencies refitted without that source's rows (cfp_megatron/validation/fit.py, "
          "refit: MAPE per GPU generation on the simulator linearised at the shipped efficiencies and once more at "
          "the result, a field no remaining row informs at the neutral start and the others held towards it by a "
          "tie-breaker), the held-out rows simulated with "
          "them; a class's band is the quantile of its rows' absolute held-out errors")
"""How the bands are computed, as the file records it."""


REFINE_ROUNDS = 1
"""Times a held-out fit is linearised again at its result (:func:`~cfp_megatron.validation.fit.refit`): one round
takes most of what refining gives (docs/validation.md, "Error bands, out of sample")."""


def sources_problem(plans: list[RowPlan]) -> str | None:
    """Why the bands cannot be computed out of sample from ``plans`` (``None`` when they can): leaving one source
    out needs another source's rows to fit the efficiencies on."""
    sources = sorted({source_of(plan) for plan in plans})
    if len(sources) >= 2:
        return None
    return (f"--bands: the {len(plans)} modelled rows come from {len(sources)} source ({', '.join(sources) or 'none'})"
            ": the bands are computed leaving each source out, which leaves no rows to fit on. Fix: pass rows of at "
            "least two sources (the source column), e.g. no file: the published runs that ship with the package")


def held_out_predictions(plans: list[RowPlan]) -> dict[str, float]:
    """Each row's predicted step time (by row id) with efficiencies fitted without the rows of its source (rows of
    two sources at least: :func:`sources_problem`)."""
    found = sensitivities(plans, FITTED)
    predicted: dict[str, float] = {}
    for source in sorted({source_of(plan) for plan in plans}):
        held = [s for s in found if source_of(s.plan) == source]
        fitted = refit([s for s in found if source_of(s.plan) != source],
                       {generation(s.plan.job.cluster) for s in held}, REFINE_ROUNDS)
        largest = next(iter(fitted))
        for s in held:
            # a generation whose rows are all held out: priced like one without calibration rows (the fallback's)
            eff = fitted.get(generation(s.plan.job.cluster)) or fitted.get(TABLE.fallback) or fitted[largest]
            predicted[s.plan.row_id] = simulate(s.plan.job, options=s.plan.options, efficiency=eff).step_time_s
    return predicted


def _summary(errors: list[float]) -> dict:
    return {"rows": len(errors), "mape": round(sum(errors) / len(errors), 3),
            "pct": round(quantile(errors, BAND_QUANTILE), 3)}


def band_table(results: list[RowResult], rows_by_id: dict[str, dict], data: list[str | Path]) -> dict:
    """The error-band file's content: the method, date and data; per class the rows, held-out MAPE and band (the
    :data:`~cfp_megatron.sim.uncertainty.BAND_QUANTILE` quantile of absolute held-out errors; a class with fewer than
    :data:`~cfp_megatron.sim.uncertainty.MIN_BAND_ROWS` rows takes the band over all rows and says so) and the
    in-sample band beside it; the same over all rows; the same per combination of classes a row has (all of them,
    and its kind with its GPU generation: what :func:`~cfp_megatron.sim.uncertainty.error_band` reads first); per
    held-out source its rows and MAPE; each published run's MFU
    (:func:`published_mfu`)."""
    held = held_out_predictions([r.plan for r in results])
    by_class: dict[str, list[float]] = {}
    in_sample: dict[str, list[float]] = {}
    by_combination: dict[str, list[float]] = {}
    combination_in_sample: dict[str, list[float]] = {}
    by_source: dict[str, list[float]] = {}
    for r in results:
        error = abs(100.0 * (held[r.plan.row_id] - r.plan.measured_s) / r.plan.measured_s)
        classes = (*row_classes(rows_by_id.get(r.plan.row_id, {})), f"GPU {generation(r.plan.job.cluster)}")
        for name in classes:
            by_class.setdefault(name, []).append(error)
            in_sample.setdefault(name, []).append(abs(r.error_pct))
        for key in dict.fromkeys((combination(classes), combination((classes[0], classes[-1])))):
            by_combination.setdefault(key, []).append(error)
            combination_in_sample.setdefault(key, []).append(abs(r.error_pct))
        by_source.setdefault(source_of(r.plan), []).append(error)
    everything = [e for errors in by_source.values() for e in errors]
    overall = _summary(everything) if everything else None
    classes = {}
    for name, errors in sorted(by_class.items()):
        entry = {**_summary(errors), "in_sample_pct": round(quantile(in_sample[name], BAND_QUANTILE), 3)}
        if len(errors) < MIN_BAND_ROWS and overall is not None:  # too few rows for a quantile: all rows' band
            entry.update(pct=overall["pct"], borrowed_from="all")
        classes[name] = entry
    return {"about": "Error bands of the simulator's step time per class, out of sample, and published runs' MFU "
                     "(cfp_megatron/sim/uncertainty.py reads it; docs/validation.md, \"Error bands, out of "
                     "sample\"). Written by python -m cfp_megatron.validate FILE.csv ... --bands FILE: do not edit.",
            "method": METHOD, "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
            "data": [Path(p).name for p in data], "quantile": BAND_QUANTILE, "min_rows": MIN_BAND_ROWS,
            "classes": classes, "all": overall,
            "combinations": {key: {**_summary(errors), "in_sample_pct": round(quantile(
                combination_in_sample[key], BAND_QUANTILE), 3)} for key, errors in sorted(by_combination.items())},
            "sources": {name: {"rows": len(e), "mape": round(sum(e) / len(e), 3)}
                        for name, e in sorted(by_source.items())},
            "published_mfu": published_mfu(results)}


def published_mfu(results: list[RowResult]) -> list[dict]:
    """Each modelled run's measured MFU (against its GPU's dense bf16 peak, model FLOPs as the planner counts them)
    with what the planner compares a plan on: GPU generation, MoE or dense, FP8, the model's active matmul
    parameters (billions); layer-only rows left out. Sorted by generation, kind and size."""
    runs = []
    for r in results:
        job, plan = r.plan.job, r.plan
        measured = measured_mfu(plan)
        if measured is None:
            continue
        world = job.cluster.nodes * (job.cluster.gpus_per_node or 1)
        runs.append({"generation": generation(job.cluster), "moe": job.model.is_moe,
                     "fp8": NumberFormat.of(job.train).low,
                     "active_params_b": round(active_matmul_params_per_token(job.model) / 1e9, 2),
                     "gpus": world, "mfu": round(measured, 4), "row": f"{plan.row_id} {plan.model}".strip()})
    return sorted(runs, key=lambda run: (run["generation"], run["moe"], run["fp8"], run["active_params_b"],
                                         run["row"]))
