"""After the first steps of a run with a plan: the measured step time and memory against the plan's prediction.

The measured step time is the median of the first ``cfp.check_after_steps`` steps without the first (warm-up) and
without the step memory was measured on (its hooks slow it); the measured memory is that step's peak over the ranks
(``train.memory_step``, which a planned run sets to the last checked step unless it is set). A difference beyond
:data:`TOLERANCE` is a warning. Rank 0 stores the comparison in the ProfileDB of this cluster
(:class:`~cfp_megatron.profile.records.PlanCheckRecord`), where the next plan's search reads it
(:meth:`~cfp_megatron.profile.db.ProfileDB.step_time_calibration`).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.profile.db import ProfileDB, load_db, store_db
from cfp_megatron.profile.fingerprint import current_fingerprint
from cfp_megatron.profile.records import PlanCheckRecord

TOLERANCE = 0.10
"""Relative difference between measured and predicted beyond which a run warns."""


@dataclass(frozen=True, kw_only=True)
class PlanCheck:
    """What a run with a plan compares after its first steps."""

    plan: str
    """The plan's canonical string."""
    model_key: str
    """The ProfileDB's key of the model (:func:`~cfp_megatron.profile.fingerprint.model_key`)."""
    after_steps: int
    """Steps of this launch after which the comparison is made."""
    predicted_step_s: float
    """Seconds per step the simulator predicted."""
    calibration: float
    """Factor from earlier runs the prediction is scaled by for the comparison (1 without any)."""
    predicted_peak_bytes: float | None
    """Predicted peak memory of the most loaded rank."""


def compare(check: PlanCheck, history: Sequence[Any]) -> PlanCheckRecord | None:
    """The comparison once ``history`` (this launch's :class:`~cfp_megatron.engine.metrics.StepMetrics`) holds
    ``check.after_steps`` steps; ``None`` before."""
    if len(history) < check.after_steps or check.after_steps < 1:
        return None
    first = list(history[:check.after_steps])
    timed = [m.step_time_s for m in first[1:] if m.peak_bytes_max is None] or [m.step_time_s for m in first]
    peak = next((m.peak_bytes_max for m in first if m.peak_bytes_max is not None), None)
    return PlanCheckRecord(model=check.model_key, plan=check.plan, steps=len(timed),
                           predicted_step_s=check.predicted_step_s, calibration=check.calibration,
                           measured_step_s=statistics.median(timed),
                           predicted_peak_bytes=check.predicted_peak_bytes, measured_peak_bytes=peak,
                           time=time.time())


def differences(record: PlanCheckRecord) -> dict[str, float | None]:
    """Relative differences (measured / predicted - 1) of step time (against the calibrated prediction) and peak
    memory."""
    memory = None
    if record.measured_peak_bytes is not None and record.predicted_peak_bytes:
        memory = record.measured_peak_bytes / record.predicted_peak_bytes - 1.0
    return {"step_time": record.step_ratio / record.calibration - 1.0, "memory": memory}


def warnings_for(record: PlanCheckRecord) -> list[str]:
    """A sentence per quantity whose measurement differs from the prediction by more than :data:`TOLERANCE`."""
    out = []
    for name, diff in differences(record).items():
        if diff is not None and abs(diff) > TOLERANCE:
            out.append(f"measured {name.replace('_', ' ')} differs from the plan's prediction by {diff:+.1%} "
                       f"(more than {TOLERANCE:.0%}); the next plan on this cluster is calibrated with it")
    return out


def store(record: PlanCheckRecord, *, world_size: int, nodes: int, backend: str) -> str:
    """Add ``record`` to this cluster's ProfileDB (created if the cluster was never profiled); return its path."""
    fp = current_fingerprint(world_size=world_size, nodes=nodes, backend=backend)
    db = load_db(fp) or ProfileDB(fingerprint=fp)
    return str(store_db(db.merged(plan_checks=[record])))


def log_plan_check(check: PlanCheck, history: list[StepMetrics], log: MetricsLog, job: JobSpec, env: LaunchEnv, *,
                   backend: str) -> None:
    """Log the plan check; rank 0 stores it in the ProfileDB of the cluster ``job`` runs on with the
    torch.distributed ``backend`` (a failure to store is said, not raised)."""
    if env.rank != 0:
        return
    record = compare(check, history)
    if record is None:
        return
    diff = differences(record)
    stored = None
    try:
        stored = store(record, world_size=env.world_size, nodes=job.cluster.nodes, backend=backend)
    except (OSError, CfpError) as err:
        log.event("warning", message=f"the plan check was not stored in the ProfileDB: {err}")
    log.event("plan_check", steps=record.steps, predicted_step_s=round(record.predicted_step_s, 6),
              calibration=round(record.calibration, 4),
              measured_step_s=round(record.measured_step_s, 6), step_time_diff=round(diff["step_time"], 4),
              predicted_peak_gib=None if record.predicted_peak_bytes is None
              else round(record.predicted_peak_bytes / 2**30, 4),
              measured_peak_gib=None if record.measured_peak_bytes is None
              else round(record.measured_peak_bytes / 2**30, 4),
              memory_diff=None if diff["memory"] is None else round(diff["memory"], 4), stored=stored)
    for warning in warnings_for(record):
        log.event("warning", message=warning)
