"""The number formats a search chooses from (``cfp.constraints.precision``, ``cfp.constraints.fp8_recipe``) and
the order it searches them in: fastest GEMMs first, so that the later formats' searches start from the k-th best
step time found and prune with it (a format scales the GEMM time; the bound of every candidate holds per format)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSpec, Precision, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.number_format import NumberFormat, bf16_ends_issues, format_issues, fp8_params_issues
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.search.space import Rejection
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.format_costs import format_cost
from cfp_megatron.sim.options import SimOptions


@dataclass(frozen=True, kw_only=True)
class FormatOutcome:
    """What the search found for one number format of the set."""

    name: str
    """The format (:attr:`~cfp_megatron.base.number_format.NumberFormat.name`)."""
    best_s: float | None
    """Its fastest plan's step time in seconds; ``None`` where none entered the top k (every plan provably slower
    than the k-th best of the formats searched before it, or none fits)."""


def set_formats(job: JobSpec, cfp: CfpSpec, *, te_available: bool) -> tuple[list[NumberFormat], list[Rejection]]:
    """The formats the search tries for ``job`` (one, the job's own, without a set), fastest GEMMs first, and those
    of the set left out with why (the cluster does not compute it; Transformer Engine missing where the search runs
    for this machine). Raises :class:`ConfigError` for a ``train.precision`` outside the set, or a set of which
    nothing is left."""
    if cfp.constraints.precision is None:
        own = _resolved(job, NumberFormat.of(job.train))
        issues = fp8_params_issues(job.parallel.fp8_param_gather, own) + bf16_ends_issues(
            job.parallel.num_layers_at_start_in_bf16, job.parallel.num_layers_at_end_in_bf16, own)
        if issues:
            raise ConfigError(issues)
        return [NumberFormat.of(job.train)], []
    allowed = list(cfp.constraints.precision)
    if job.train.precision is not Precision.auto:  # a pin, as cfp.<knob> pins within cfp.constraints.<knob>
        if job.train.precision not in allowed:
            raise ConfigError(ConfigIssue(key="train.precision", value=job.train.precision.value,
                                          problem=f"is outside cfp.constraints.precision="
                                                  f"[{','.join(p.value for p in allowed)}].",
                                          fix="set train.precision=auto to let the search choose, or widen the set."))
        allowed = [job.train.precision]
    recipes = cfp.constraints.fp8_recipe or [job.train.fp8_recipe]
    wanted: list[NumberFormat] = []
    resolved = [resolve_precision(p, on_gpu=not job.cluster.on_cpu) if p is Precision.auto else p for p in allowed]
    for precision in dict.fromkeys(resolved):
        if precision is Precision.fp8:
            wanted += [NumberFormat(precision=precision, recipe=r) for r in dict.fromkeys(recipes)]
        elif precision is Precision.fp4:
            wanted.append(NumberFormat(precision=precision, recipe=job.train.fp4_recipe))
        else:
            wanted.append(NumberFormat(precision=precision))
    kept, left = [], []
    for fmt in wanted:
        issues = format_issues(job.cluster, fmt)
        if not issues and fmt.low:  # bf16 layers at the stack's ends: not with delayed scaling
            issues = bf16_ends_issues(job.parallel.num_layers_at_start_in_bf16,
                                      job.parallel.num_layers_at_end_in_bf16, fmt)
        if not issues and fmt.low and not te_available:
            issues = [ConfigIssue(key="train.precision", value=fmt.name, problem="runs only in Transformer Engine's "
                                  "layers, which this machine lacks.", fix="install transformer-engine.")]
        if issues:
            left.append(Rejection(what=f"precision={fmt.name}", reason=issues[0].problem))
        else:
            kept.append(fmt)
    if not kept:
        raise ConfigError(ConfigIssue(key="cfp.constraints.precision", value=[p.value for p in allowed],
                                      problem="leaves no number format this cluster computes: "
                                              + "; ".join(f"{r.what}: {r.reason}" for r in left),
                                      fix="add bf16 to the set, or plan on a cluster that computes them."))
    return sorted(kept, key=lambda f: (-_gemm_rate(job, f), f.name)), left


def _gemm_rate(job: JobSpec, fmt: NumberFormat) -> float:
    """The achieved rate (TFLOP/s) of a large GEMM in ``fmt`` on the job's cluster: the order formats are searched."""
    return format_cost(fmt, job.cluster).gemm_tflops(job.cluster, efficiency_for(job.cluster))


def format_options(job: JobSpec, fmt: NumberFormat, measurements: Measurements | None,
                   options: SimOptions | None) -> SimOptions | None:
    """The simulator options a format of the set is searched with: as given, except that a format other than the one
    the profile measured (the job's own) is priced without the measured segments (they ran their GEMMs in the
    job's format) but with everything else measured."""
    if measurements is None or _resolved(job, fmt) == _resolved(job, NumberFormat.of(job.train)):
        return options
    return dataclasses.replace(options or SimOptions(), use_measured_segments=False)


def _resolved(job: JobSpec, fmt: NumberFormat) -> NumberFormat:
    """``fmt`` with ``auto`` resolved as ``job``'s cluster trains it (bf16 on a GPU)."""
    if fmt.precision is not Precision.auto:
        return fmt
    return NumberFormat(precision=resolve_precision(fmt.precision, on_gpu=not job.cluster.on_cpu))


def with_format(job: JobSpec, fmt: NumberFormat) -> JobSpec:
    """``job`` trained in ``fmt``; FP8 parameters (``parallel.fp8_param_gather``) kept only in an FP8 format, bf16
    layers at the stack's ends (``parallel.num_layers_at_start_in_bf16`` / ``_end_in_bf16``) only in FP8 or FP4."""
    parallel = job.parallel
    if parallel.fp8_param_gather and fmt.precision is not Precision.fp8:
        parallel = dataclasses.replace(parallel, fp8_param_gather=False)
    if not fmt.low and (parallel.num_layers_at_start_in_bf16 or parallel.num_layers_at_end_in_bf16):
        parallel = dataclasses.replace(parallel, num_layers_at_start_in_bf16=0, num_layers_at_end_in_bf16=0)
    return dataclasses.replace(job, parallel=parallel, train=dataclasses.replace(job.train, **fmt.train_fields()))


def format_reason(outcomes: list[FormatOutcome], chosen: str) -> str:
    """One sentence on the format the search chose from a set: its step time against each other format's best."""
    best = {o.name: o.best_s for o in outcomes}
    others = [f"{o.name} {o.best_s:.3f} s" if o.best_s is not None else f"{o.name} slower (pruned by the bound)"
              for o in outcomes if o.name != chosen]
    at = best.get(chosen)
    return (f"number format {chosen} chosen from [{', '.join(o.name for o in outcomes)}]"
            + (f": its best plan {at:.3f} s per step" if at is not None else "")
            + (f"; {', '.join(others)}" if others else ""))
