"""After the first steps of a run with a plan: the measured step time and memory against the plan's prediction.

The measured step time is the median of the first ``cfp.check_after_steps`` steps without the
``cfp.check_warmup_steps`` first and without the step memory was measured on (its hooks slow it); the measured
memory is that step's peak over the ranks (``train.memory_step``, which a planned run sets to the last checked step
unless it is set). A difference beyond :data:`TOLERANCE` is a warning. Rank 0 stores the comparison in the
ProfileDB of this cluster (:class:`~cfp_megatron.profile.records.PlanCheckRecord`), where the next plan's search
reads it (:meth:`~cfp_megatron.profile.db.ProfileDB.step_time_calibration`).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.plan.plots import free_path, write_check_png
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.profile.cpu_use import other_load
from cfp_megatron.profile.db import ProfileDB, StepCalibration, update_db
from cfp_megatron.profile.fingerprint import current_fingerprint
from cfp_megatron.profile.records import STEP_TOLERANCE, PlanCheckRecord
from cfp_megatron.sim.options import options_here
from cfp_megatron.sim.prediction import Prediction
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms import TERMS

TOLERANCE = STEP_TOLERANCE
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
    warmup_steps: int = 1
    """The first steps not timed (``cfp.check_warmup_steps``); where fewer than one step would be left, only the
    first is left out."""
    analytical: tuple[str, ...] = ()
    """What the prediction read that the profile had not measured, priced by the analytical model
    (:attr:`~cfp_megatron.plan.artifact.PlanPrediction.analytical`)."""
    time_parts: tuple[tuple[str, float], ...] = ()
    """The predicted step time by part (name, seconds; :func:`breakdown`), drawn stacked beside the measured step;
    empty where not known (the picture then shows the predicted total)."""
    memory_parts: tuple[tuple[str, float], ...] = ()
    """The predicted peak memory by part (name, bytes; :func:`breakdown`)."""
    breakdown_note: str = ""
    """Why the parts are missing, said on the picture (empty when they are there or nobody asked)."""
    plot_file: str | None = None
    """Where rank 0 draws the comparison (PNG, :func:`~cfp_megatron.plan.plots.write_check_png`; the next free
    ``-2``, ``-3`` name where a file is there); ``None``: not drawn."""


BREAKDOWN_MATCH = 0.02
"""Largest relative difference between the plan's predicted step time and a new simulation of it for which the new
simulation's breakdown is drawn as the plan's (the profile may have changed since the plan was made)."""


def breakdown(prediction: Prediction, *, step_s: float | None = None, peak_bytes: float | None = None
              ) -> tuple[tuple[tuple[str, float], ...], tuple[tuple[str, float], ...]]:
    """A prediction's step time by part (seconds: the cost terms' lanes added up by their
    :attr:`~cfp_megatron.sim.terms.Lane.part` -- forward, backward, per-layer overhead, exposed TP/CP/EP/FSDP
    communication, pipeline bubble, DP sync, tied-embedding sync, optimizer, ...; they add up to the step time) and
    peak memory by part (bytes), the parts that are not zero. ``step_s`` / ``peak_bytes``: the totals the parts are
    shares of where they differ from the prediction's (a plan's figures, simulated again), so the stack adds up to
    the figure it is drawn under."""
    t, m = prediction.time, prediction.memory
    parts: dict[str, float] = {}
    for lane in TERMS.lanes():
        parts[lane.part] = parts.get(lane.part, 0.0) + t.seconds(lane.name)
    memory = {"parameters": m.parameters, "gradients": m.gradients, "optimizer states": m.optimizer_states,
              "activations": m.activations, "comm buffers": m.comm_buffers}
    return _shares(parts, step_s), _shares(memory, peak_bytes)


def _shares(parts: dict[str, float], total: float | None) -> tuple[tuple[str, float], ...]:
    """The positive ``parts`` (name, value), scaled to add up to ``total`` where given."""
    whole = sum(value for value in parts.values() if value > 0)
    scale = total / whole if total is not None and whole > 0 else 1.0
    return tuple((name, value * scale) for name, value in parts.items() if value > 0)


def with_breakdown(check: PlanCheck, job: JobSpec, world: int, plot_file: str | None) -> PlanCheck:
    """``check`` drawn to ``plot_file``, with the predicted breakdown of ``job`` (the planned job) on ``world`` ranks
    of this machine: simulated again with this cluster's profile, kept where its step time is within
    :data:`BREAKDOWN_MATCH` of the plan's and drawn as shares of the plan's figures (else ``breakdown_note`` says why
    it is missing). Never raises for it."""
    check = dataclasses.replace(check, plot_file=plot_file)
    try:
        cluster, measurements = local_measurements(job, world_size=world)
        prediction = simulate(dataclasses.replace(job, cluster=cluster), cluster, measurements, world_size=world,
                              options=options_here(cluster) if measurements is not None else None)
    except (CfpError, OSError, ValueError) as err:
        return dataclasses.replace(check, breakdown_note=f"no predicted breakdown: simulating again failed ({err})")
    if abs(prediction.step_time_s / check.predicted_step_s - 1.0) > BREAKDOWN_MATCH:
        return dataclasses.replace(check, breakdown_note=(
            f"no predicted breakdown: simulated again now the step takes {prediction.step_time_s * 1e3:.4g} ms, not "
            f"the plan's {check.predicted_step_s * 1e3:.4g} ms (the profile changed since the plan was made)"))
    time_parts, memory_parts = breakdown(prediction, step_s=check.predicted_step_s,
                                         peak_bytes=check.predicted_peak_bytes)
    return dataclasses.replace(check, time_parts=time_parts, memory_parts=memory_parts)


def compare(check: PlanCheck, history: Sequence[Any], *, load: float | None = None) -> PlanCheckRecord | None:
    """The comparison once ``history`` (this launch's :class:`~cfp_megatron.engine.metrics.StepMetrics`) holds
    ``check.after_steps`` steps; ``None`` before. ``load``: :func:`other_load` while they ran (kept, with the timed
    steps' spread, to tell a busy machine)."""
    if len(history) < check.after_steps or check.after_steps < 1:
        return None
    first = list(history[:check.after_steps])
    timed = ([m.step_time_s for m in first[max(check.warmup_steps, 1):] if m.peak_bytes_max is None]
             or [m.step_time_s for m in first[1:] if m.peak_bytes_max is None] or [m.step_time_s for m in first])
    peak = next((m.peak_bytes_max for m in first if m.peak_bytes_max is not None), None)
    return PlanCheckRecord(model=check.model_key, plan=check.plan, steps=len(timed),
                           predicted_step_s=check.predicted_step_s, calibration=check.calibration,
                           measured_step_s=statistics.median(timed),
                           predicted_peak_bytes=check.predicted_peak_bytes, measured_peak_bytes=peak,
                           time=time.time(), other_load=load,
                           repeat_spread=(max(timed) - min(timed)) / statistics.median(timed)
                           if len(timed) > 1 and statistics.median(timed) > 0 else None)


def differences(record: PlanCheckRecord) -> dict[str, float | None]:
    """Relative differences (measured / predicted - 1) of step time (against the calibrated prediction) and peak
    memory."""
    memory = None
    if record.measured_peak_bytes is not None and record.predicted_peak_bytes:
        memory = record.measured_peak_bytes / record.predicted_peak_bytes - 1.0
    return {"step_time": record.step_ratio / record.calibration - 1.0, "memory": memory}


def warnings_for(record: PlanCheckRecord, calibration: StepCalibration | None = None) -> list[str]:
    """A sentence per quantity whose measurement differs from the prediction by more than :data:`TOLERANCE`, saying
    what happens with it: the step time calibrates the next plans of this layout family on this profile (unless
    the machine was busy, or the run is an outlier of ``calibration``, the one that includes it); memory is not
    calibrated."""
    out = []
    diffs = differences(record)
    step, memory = diffs["step_time"], diffs["memory"]
    if step is not None and abs(step) > TOLERANCE:
        said = f"measured step time differs from the plan's prediction by {step:+.1%} (more than {TOLERANCE:.0%})"
        if record.busy is not None:
            what = f"the machine was busy ({record.busy}): recorded, but it does not calibrate the next plan"
        elif calibration is not None and calibration.ratio is not None and any(
                math.isclose(record.step_ratio, u) for u in calibration.untrusted):
            what = (f"far from the other runs' ratio {calibration.ratio:.2f}: recorded as an outlier, it does not "
                    "calibrate the next plan")
        elif calibration is not None and calibration.ratio is not None:
            what = (f"the next plan of this layout family on this profile is scaled by {calibration.ratio:.2f}, the "
                    f"median of {calibration.runs} run(s) (spread {calibration.spread:.0%}) and the profile's own "
                    "prediction; a new profile starts afresh")
        else:
            what = "recorded; the next plan's step time is not calibrated by it"
        out.append(f"{said}; {what}")
    if memory is not None and abs(memory) > TOLERANCE:
        out.append(f"measured memory differs from the plan's prediction by {memory:+.1%} (more than {TOLERANCE:.0%}); "
                   "recorded, but memory predictions are not calibrated: the next plan's memory is predicted the "
                   "same way")
    return out


def store(record: PlanCheckRecord, *, world_size: int, nodes: int, backend: str
          ) -> tuple[str, PlanCheckRecord, StepCalibration | None]:
    """Add ``record`` to this cluster's ProfileDB (created if the cluster was never profiled), stamped with the
    profile it was checked against; return the path, the stored record and the calibration its layout family has
    now. Read, stamped and written under the DB's lock (:func:`~cfp_megatron.profile.db.update_db`), so a
    concurrent job's records and checks are kept."""
    fp = current_fingerprint(world_size=world_size, nodes=nodes, backend=backend)

    def add(current: ProfileDB | None) -> ProfileDB:
        db = (current or ProfileDB(fingerprint=fp)).for_model(record.model)
        return db.merged(plan_checks=[dataclasses.replace(record, profile_id=db.profile_id())])

    path, db = update_db(fp, add)
    stored = db.plan_checks[-1]
    return str(path), stored, db.calibration(plan=stored.plan)


def device_memory(record: PlanCheckRecord, steps: Sequence[StepMetrics]) -> dict[str, float]:
    """On GPUs, the allocator's peak of the measured step (``device_peak_gib``) and its difference from the
    prediction (``device_memory_diff``) beside the tracked tensors' (the check's own ``memory_diff``); empty on CPU.
    On one H200 the allocator held 3 GiB (2.9%) more than the tracked tensors."""
    peak = next((m.device_peak_bytes_max for m in steps if m.device_peak_bytes_max is not None), None)
    if peak is None:
        return {}
    out = {"device_peak_gib": round(peak / 2**30, 4)}
    if record.predicted_peak_bytes:
        out["device_memory_diff"] = round(peak / record.predicted_peak_bytes - 1.0, 4)
    return out


def log_plan_check(check: PlanCheck, history: list[StepMetrics], log: MetricsLog, job: JobSpec, env: LaunchEnv, *,
                   backend: str) -> None:
    """Log the plan check; rank 0 stores it in the ProfileDB of the cluster ``job`` runs on with the
    torch.distributed ``backend`` (a failure to store is said, not raised)."""
    if env.rank != 0:
        return
    record = compare(check, history, load=other_load(env.local_world_size))
    if record is None:
        return
    diff = differences(record)
    stored, calibration = None, None
    try:
        stored, record, calibration = store(record, world_size=env.world_size, nodes=job.cluster.nodes,
                                            backend=backend)
    except (OSError, CfpError) as err:
        log.event("warning", message=f"the plan check was not stored in the ProfileDB: {err}")
    log.event("plan_check", steps=record.steps, predicted_step_s=round(record.predicted_step_s, 6),
              calibration=round(record.calibration, 4),
              measured_step_s=round(record.measured_step_s, 6), step_time_diff=round(diff["step_time"], 4),
              predicted_peak_gib=None if record.predicted_peak_bytes is None
              else round(record.predicted_peak_bytes / 2**30, 4),
              measured_peak_gib=None if record.measured_peak_bytes is None
              else round(record.measured_peak_bytes / 2**30, 4),
              memory_diff=None if diff["memory"] is None else round(diff["memory"], 4),
              **device_memory(record, history[:check.after_steps]), stored=stored,
              other_load=None if record.other_load is None else round(record.other_load, 3),
              repeat_spread=None if record.repeat_spread is None else round(record.repeat_spread, 3),
              busy=record.busy, analytical=list(check.analytical) or None)
    for warning in warnings_for(record, calibration):
        if check.analytical:
            warning += (f" (the prediction priced {', '.join(check.analytical)} by the analytical model: the profile "
                        "had not measured them)")
        log.event("warning", message=warning)
    if check.plot_file is not None:
        try:
            path = write_check_png(record, free_path(check.plot_file), time_parts=check.time_parts,
                                   memory_parts=check.memory_parts, note=check.breakdown_note,
                                   title=f"plan check after {check.after_steps} steps: {check.plan.split(':')[0]}")
        except (OSError, ValueError, RuntimeError) as err:  # a picture never stops training
            log.event("warning", message=f"the plan check's picture was not drawn: {err}")
        else:
            log.event("plan_check_plot", path=str(path))
