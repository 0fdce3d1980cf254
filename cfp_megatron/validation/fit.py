"""Fitting the hardware efficiencies (:mod:`cfp_megatron.sim.calibration`) to published runs: the bounds, the
neutral starting point, which source a row comes from, and a fast fit for leave-one-source-out cross-validation.

``bench/validate.py --fit`` fits the shipped efficiencies with Nelder-Mead over the simulator itself (minutes).
:func:`fit_linear` fits the same fields to the same objective (MAPE per GPU generation) on a model of the simulator
linearised once per row (:func:`sensitivities`: a few simulations per row), as a linear programme: seconds for every
held-out source together, deterministic, and a global optimum of its objective (no starting point that saw the
held-out rows). Reasoning: docs/validation.md, "Error bands, out of sample".
"""

from __future__ import annotations

from dataclasses import dataclass

from cfp_megatron.base.errors import CfpError
from cfp_megatron.sim.calibration import GENERATION_FIELDS, Efficiency, generation
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validation.results import RowPlan

BOUNDS: dict[str, tuple[float, float]] = {
    "gemm": (0.2, 0.98), "gemm_fp8": (0.15, 0.98), "attention": (0.05, 1.0), "memory": (0.2, 1.0),
    "layer_overhead_s": (1e-6, 3e-3), "optimizer_bytes_per_param": (16.0, 200.0),
    "intra_node_comm": (0.2, 1.0), "inter_node_comm": (0.2, 1.0)}
"""The range each fitted field may take (physically possible shares; a fit that ends at a bound says so)."""
NEUTRAL = Efficiency(gemm=0.7, gemm_fp8=0.6, attention=0.4, memory=0.8, layer_overhead_s=1e-5,
                     optimizer_bytes_per_param=34.0, intra_node_comm=0.8, inter_node_comm=0.8)
"""Starting point of every Nelder-Mead fit and the value of a field no training row informs: round, physically
plausible shares (not the shipped values, so that a fit without a source never starts from constants that saw it)."""
MIN_ROWS_FULL_FIT = 8
"""A generation with fewer training rows only refits its GEMM efficiencies; the rest comes from the
generation with the most rows."""
SMALL_FIT_FIELDS = ("gemm", "gemm_fp8")
"""The fields a generation with fewer than :data:`MIN_ROWS_FULL_FIT` rows refits."""
AMOUNTS = ("layer_overhead_s", "optimizer_bytes_per_param")
"""Fields the step time grows with in proportion (seconds, bytes moved); every other field of :data:`BOUNDS` is a share
of a rate, which the step time grows with in inverse proportion. :func:`sensitivities` linearises the step time in
each field's *time coordinate* (:func:`time_coordinate`: the amount, or one over the share), where a term that runs
on its own is exactly linear: only overlap (a term hidden under another until it outgrows it) bends it."""
STEP = 0.05
"""Relative step of the finite differences :func:`sensitivities` takes, towards the inside of :data:`BOUNDS`: small
enough to stay on the same side of an overlap's edge, large enough to stay clear of the simulator's rounding."""


PRIOR_WEIGHT = 1.0
"""What moving a field across its whole range (:data:`BOUNDS`, in its :func:`time_coordinate`) away from the neutral
start costs the linearised fit, in units of one row's error of 100%: it keeps a field the rows barely inform near the
neutral start, as Nelder-Mead started there leaves it, instead of at whichever bound the linear programme reaches
first. Chosen so that the fast fit's held-out errors follow the Nelder-Mead refits of ``bench/validate.py --loso``
source by source (the comparison: docs/validation.md, "Error bands, out of sample")."""


class FitError(CfpError, RuntimeError):
    """A fit that could not be solved (the linear programme failed)."""


def source_of(plan: RowPlan) -> str:
    """Short source name: the first author or organisation of the row's ``source`` (what cross-validation leaves out
    together)."""
    return plan.source.split(",")[0].split("(")[0].strip()[:40]


@dataclass(frozen=True, kw_only=True)
class Sensitivity:
    """How one row's predicted step time moves with its generation's efficiencies around a reference point."""

    plan: RowPlan
    """The row."""
    reference: Efficiency
    """The efficiencies the row was simulated with."""
    predicted_s: float
    """Predicted step time at ``reference``."""
    slopes: dict[str, float]
    """Seconds the prediction moves per unit of a field's :func:`time_coordinate`, per field of :data:`BOUNDS`
    that moves it."""


def time_coordinate(name: str, value: float) -> float:
    """``value`` of field ``name`` as the step time sees it: the amount itself (:data:`AMOUNTS`), or one over a
    share."""
    return value if name in AMOUNTS else 1.0 / value


def sensitivities(plans: list[RowPlan], reference: dict[str, Efficiency]) -> list[Sensitivity]:
    """Each row's prediction and its slopes in each field's :func:`time_coordinate`, one simulation per field of
    :data:`BOUNDS` (a relative step of :data:`STEP` towards the inside of the field's bounds)."""
    out = []
    for plan in plans:
        eff = reference[generation(plan.job.cluster)]
        base = simulate(plan.job, options=plan.options, efficiency=eff).step_time_s
        slopes = {}
        for name, (_, high) in BOUNDS.items():
            value = getattr(eff, name)
            stepped = value / (1 + STEP) if value * (1 + STEP) > high else value * (1 + STEP)
            moved = simulate(plan.job, options=plan.options, efficiency=eff.replace(**{name: stepped})).step_time_s
            if moved != base:
                slopes[name] = (moved - base) / (time_coordinate(name, stepped) - time_coordinate(name, value))
        out.append(Sensitivity(plan=plan, reference=eff, predicted_s=base, slopes=slopes))
    return out


def refit(rows: list[Sensitivity], generations: set[str], rounds: int = 1) -> dict[str, Efficiency]:
    """:func:`fit_linear` of ``rows``, then ``rounds`` times the rows of ``generations`` linearised again at the fit
    (sequential linear programming: the step time bends where a term outgrows the one it hides under)."""
    fitted = fit_linear(rows)
    for _ in range(rounds):
        again = [row for row in rows if generation(row.plan.job.cluster) in generations]
        redone = iter(sensitivities([row.plan for row in again], fitted))
        rows = [next(redone) if generation(row.plan.job.cluster) in generations else row for row in rows]
        fitted = fit_linear(rows)
    return fitted


def fit_linear(rows: list[Sensitivity], prior: Efficiency = NEUTRAL) -> dict[str, Efficiency]:
    """Efficiencies per GPU generation minimising the linearised MAPE of ``rows`` (each generation on its own rows),
    each field inside :data:`BOUNDS`. A field no row of a generation moves takes ``prior``'s value; a generation
    with fewer than :data:`MIN_ROWS_FULL_FIT` rows fits :data:`SMALL_FIT_FIELDS` only, the rest from the generation
    with the most rows. Generations without rows are not in the result."""
    by_gen: dict[str, list[Sensitivity]] = {}
    for row in rows:
        by_gen.setdefault(generation(row.plan.job.cluster), []).append(row)
    order = sorted(by_gen, key=lambda g: (-len(by_gen[g]), g))
    fitted: dict[str, Efficiency] = {}
    for gen in order:
        members = by_gen[gen]
        reference = members[0].reference
        moved = {name for row in members for name in row.slopes}
        free = [name for name in BOUNDS if name in moved]
        fixed: dict[str, float] = {name: getattr(prior, name) for name in BOUNDS if name not in moved}
        if len(members) < MIN_ROWS_FULL_FIT and fitted:
            donor = fitted[order[0]]
            fixed.update({name: getattr(donor, name) for name in free if name not in SMALL_FIT_FIELDS})
            free = [name for name in free if name in SMALL_FIT_FIELDS]
        fitted[gen] = _solve(members, reference, free, fixed)
    return fitted


def _solve(rows: list[Sensitivity], reference: Efficiency, free: list[str], fixed: dict[str, float],
           prior: Efficiency = NEUTRAL) -> Efficiency:
    """The L1 fit of one generation as a linear programme: variables the changes of ``free`` fields'
    :func:`time_coordinate` and one bound per row's absolute relative error; ``fixed`` fields set outright."""
    import numpy as np

    try:
        from scipy.optimize import linprog
    except ImportError:
        raise FitError("the fit needs scipy (its linear programming solver); install it: pip install scipy, or "
                       "pip install -e '.[dev]'") from None

    def moved(name: str, value: float) -> float:
        return time_coordinate(name, value) - time_coordinate(name, getattr(reference, name))

    shift = {name: moved(name, value) for name, value in fixed.items()}
    n, k = len(rows), len(free)
    offsets = np.array([(row.predicted_s + sum(row.slopes.get(name, 0.0) * d for name, d in shift.items()))
                        / row.plan.measured_s - 1.0 for row in rows])
    slopes = np.array([[row.slopes.get(name, 0.0) / row.plan.measured_s for name in free] for row in rows])
    slopes = slopes.reshape(n, k)
    # minimise sum(t) + PRIOR_WEIGHT * sum(s) with t >= |offset + slopes @ x| (each row's error) and
    # s >= |x - prior| / span (each field's distance from the neutral start, as a share of its range)
    spans = np.array([abs(moved(name, BOUNDS[name][1]) - moved(name, BOUNDS[name][0])) for name in free])
    start = np.array([moved(name, getattr(prior, name)) for name in free])
    scale = np.diag(1.0 / spans) if k else np.zeros((0, 0))
    cost = np.concatenate([np.zeros(k), np.ones(n), np.full(k, PRIOR_WEIGHT)])
    upper = np.block([[slopes, -np.eye(n), np.zeros((n, k))], [-slopes, -np.eye(n), np.zeros((n, k))],
                      [scale, np.zeros((k, n)), -np.eye(k)], [-scale, np.zeros((k, n)), -np.eye(k)]])
    bound = np.concatenate([-offsets, offsets, start / spans, -start / spans])
    limits: list[tuple[float, float | None]] = [tuple(sorted(moved(name, edge) for edge in BOUNDS[name]))
                                                for name in free]
    limits += [(0.0, None)] * (n + k)
    result = linprog(cost, A_ub=upper, b_ub=bound, bounds=limits, method="highs")
    if result.status != 0:
        raise FitError(f"the linearised fit of {len(rows)} rows failed: {result.message}")
    values = {name: _value(name, time_coordinate(name, getattr(reference, name)) + float(x))
              for name, x in zip(free, result.x[:k], strict=True)}
    values.update(fixed)
    return reference.replace(**{name: float(f"{values[name]:.4g}") for name in GENERATION_FIELDS if name in values})


def _value(name: str, coordinate: float) -> float:
    """The field's value at a :func:`time_coordinate`, clamped to :data:`BOUNDS` (the linear programme's bounds
    allow a rounding error beyond them)."""
    value = coordinate if name in AMOUNTS else 1.0 / coordinate
    low, high = BOUNDS[name]
    return min(max(value, low), high)
