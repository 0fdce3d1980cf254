"""What ``python -m cfp_megatron.validate`` makes of a row: its plan (:class:`RowPlan`), its prediction
(:class:`RowResult`) and their mean absolute percentage error."""

from __future__ import annotations

import math
from dataclasses import dataclass

from cfp_megatron.base.config import JobSpec
from cfp_megatron.sim.options import SimOptions


@dataclass(frozen=True, kw_only=True)
class RowPlan:
    """One row turned into what the simulator needs."""

    row_id: str
    """The row's ``id``."""
    source: str
    """The row's ``source`` (for grouping results)."""
    source_detail: str = ""
    """The row's ``source_detail`` (which table of the source)."""
    model: str
    """The row's model name (for display only)."""
    layout: str
    """Short layout string for display."""
    job: JobSpec
    """The plan."""
    options: SimOptions
    """Simulator options from the row (FSDP, layer-only; its number format is the job's train.precision)."""
    measured_s: float
    """Measured (or derived from measurements) step time."""
    approximations: tuple[str, ...] = ()
    """What the row's stated columns say that the simulator prices only approximately or could not read
    (:mod:`cfp_megatron.validation.columns`: a fabric, schedule, precision variant or power limit), one sentence
    each; the row stays in the figures."""


@dataclass(frozen=True, kw_only=True)
class RowResult:
    """Prediction for one row."""

    plan: RowPlan
    """The row."""
    predicted_s: float
    """Predicted step time."""
    memory_gib: float
    """Predicted peak memory per GPU."""
    flag: str = ""
    """Why the prediction may not be what ran, though the row is kept in the figures (:func:`memory_problem`);
    empty: nothing to say."""

    @property
    def error_pct(self) -> float:
        """Signed relative error of the prediction, percent."""
        return 100.0 * (self.predicted_s - self.plan.measured_s) / self.plan.measured_s

def mape(results: list[RowResult]) -> float:
    """Mean absolute percentage error of the step time."""
    return sum(abs(r.error_pct) for r in results) / len(results) if results else math.nan
