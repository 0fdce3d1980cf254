"""Trials at launch (``cfp.trials``): each of the top plans trained for a few steps on the live cluster, one after
another in the process group profiling made, measured as the plan check measures a run, nothing saved.

Every rank calls :func:`run_trials` with the same plans. The trials are the steps of one profiling round
(:func:`~cfp_megatron.profile.control.run_round`: rank 0 stops before a trial it expects to end past the budget,
a trial that fails or runs out of memory is recorded, never raised), each building its layout's Megatron groups,
model and optimizer afresh (:func:`~cfp_megatron.engine.distributed.init_distributed` on the live default group,
:func:`~cfp_megatron.engine.distributed.destroy_model_parallel_groups` after it, as the profiling probes do) from
the job's seed. Rank 0 times its steps and compares them with the prediction
(:func:`~cfp_megatron.plan.check.compare`); the round hands every rank rank 0's median, so all pick alike. Rank 0
stores each trial's comparison in the ProfileDB (``trial`` set), where it calibrates later plans as a plan check
does. docs/planning.md, "Trials at launch".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from rich.table import Table

from cfp_megatron.backends.megatron.trainer import train_one
from cfp_megatron.base.config import JobSpec, MoeTokenPolicy
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.data.batches import build_micro_batches
from cfp_megatron.engine.distributed import (
    bound_every_group,
    destroy_model_parallel_groups,
    destroy_tp_communicators,
    init_distributed,
)
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.engine.step import build_training
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck, compare, other_load, store
from cfp_megatron.plan.exports import with_searched_token_policy
from cfp_megatron.profile.control import Step, run_round
from cfp_megatron.profile.fingerprint import model_key
from cfp_megatron.profile.records import PlanCheckRecord, RoundRecord

TIMED_STEPS = 5
"""Steps of a trial that are timed, after the ``cfp.check_warmup_steps`` first (the plan check's warm-up)."""


@dataclass(frozen=True, kw_only=True)
class TrialOutcome:
    """What the trials measured (the same on every rank but ``records`` and ``notes``, rank 0's)."""

    measured: tuple[float | None, ...]
    """Per plan, rank 0's median step time in seconds; ``None`` where its trial did not finish."""
    round: RoundRecord
    """The round's record: its status (a trial failed, the budget ran out) and seconds."""
    records: tuple[PlanCheckRecord | None, ...] = ()
    """Per plan, rank 0's comparison with the prediction (as stored in the ProfileDB); empty on other ranks."""
    notes: tuple[str, ...] = ()
    """What rank 0 has to say (a comparison not stored)."""


def trial_job(job: JobSpec, plan: Plan, steps: int, policies: list[MoeTokenPolicy] | None = None) -> JobSpec:
    """``job`` under ``plan`` for a trial of ``steps`` steps that saves nothing: no checkpoint folder, resume, memory
    step or metrics file; the job's seed and data; the MoE token policy ``plan`` chose from ``policies``
    (``cfp.constraints.moe_token_policy``: :func:`~cfp_megatron.plan.exports.with_searched_token_policy`)."""
    planned = plan.apply(with_searched_token_policy(plan, job, policies))
    train = dataclasses.replace(planned.train, steps=steps, checkpoint_dir=None, resume=False, save_interval=0,
                                memory_step=None, metrics_file=None)
    return dataclasses.replace(planned, train=train)


def run_trials(job: JobSpec, plans: Sequence[Plan], *, calibrations: Sequence[float], env: LaunchEnv,
               warmup_steps: int, budget_s: float, on_gpu: bool,
               progress: Callable[[str, int, int, str], None] | None = None,
               policies: list[MoeTokenPolicy] | None = None) -> TrialOutcome:
    """Train each of ``plans`` for ``warmup_steps`` + :data:`TIMED_STEPS` steps within ``budget_s`` seconds (rank
    0's figure) on the live default group (see the module docstring); ``calibrations``: each plan's factor from
    earlier runs, kept in its comparison."""
    steps = warmup_steps + TIMED_STEPS
    records: dict[int, PlanCheckRecord] = {}

    def trial(index: int) -> list[float]:
        plan = plans[index]
        planned = trial_job(job, plan, steps, policies)
        dims = ParallelDims.build(planned, env.world_size)
        destroy_model_parallel_groups()  # the last probe's groups, or the previous trial's
        init_distributed(planned, dims, env)  # the default group is up: Megatron's groups and the seed only
        history: list[StepMetrics] = []
        try:
            state = build_training(planned, dims)
            bound_every_group(planned.train.collective_timeout_s)
            stream = build_micro_batches(planned, dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dims.dp)
            log = MetricsLog(None, enabled=False)  # nothing logged: the trials are not the run
            flops = training_flops_per_token(planned.model, planned.train.seq_length)
            while state.step < steps and train_one(state, stream, log, history, flops, float("inf")):
                pass  # MFU (against an infinite peak: 0) is not read
            del state, stream
        finally:
            if planned.parallel.tp_comm_overlap:
                destroy_tp_communicators()  # the next trial, and training, make their own
            destroy_model_parallel_groups()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        if env.rank != 0:
            return [0.0]  # the round's maximum over ranks hands every rank rank 0's figure
        predicted = plan.predicted
        check = PlanCheck(plan=plan.canonical(), model_key=model_key(planned, on_gpu=on_gpu), after_steps=steps,
                          warmup_steps=warmup_steps,
                          predicted_step_s=predicted.step_time_s if predicted is not None else 0.0,
                          calibration=calibrations[index],
                          predicted_peak_bytes=predicted.peak_memory_gib * 2**30 if predicted is not None else None,
                          analytical=predicted.analytical if predicted is not None else ())
        record = compare(check, history, load=other_load(env.local_world_size))
        if record is None:
            return [0.0]
        records[index] = dataclasses.replace(record, trial=True)
        return [record.measured_step_s]

    work = [Step(label=f"trial {i + 1} of {len(plans)}", run=lambda i=i: trial(i), entry=plan.canonical())
            for i, plan in enumerate(plans)]
    results, record = run_round("trials", work, seconds=budget_s, on_step=(
        (lambda i, n, label: progress("trials", i, n, label)) if progress is not None else None))
    by_label = {r.label: r.values[0] for r in results}
    measured = tuple(by_label.get(s.label) or None for s in work)
    if env.rank != 0:
        return TrialOutcome(measured=measured, round=record)
    stored: list[PlanCheckRecord | None] = []
    notes: list[str] = []
    for i in range(len(plans)):
        found = records.get(i) if measured[i] is not None else None
        if found is not None:
            try:
                _, found, _ = store(found, world_size=env.world_size, nodes=job.cluster.nodes,
                                    backend=dist.get_backend())
            except (OSError, CfpError) as err:
                notes.append(f"trial {i + 1}'s measurement was not stored in the ProfileDB: {err}")
        stored.append(found)
    return TrialOutcome(measured=measured, round=record, records=tuple(stored), notes=tuple(notes))


def trials_table(labels: Sequence[str], predicted_s: Sequence[float], measured: Sequence[float | None],
                 pick: int | None) -> Table:
    """The trials for people: per plan its predicted step time (calibrated by earlier runs), the measured median,
    their ratio, and which trains."""
    table = Table(title="trials at launch (cfp.trials)", title_justify="left")
    for name, justify in (("#", "right"), ("plan", "left"), ("predicted", "right"), ("measured", "right"),
                          ("measured/predicted", "right"), ("", "left")):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    for i, (label, want, got) in enumerate(zip(labels, predicted_s, measured, strict=True)):
        table.add_row(str(i + 1), label, f"{want * 1e3:.1f} ms",
                      "not finished" if got is None else f"{got * 1e3:.1f} ms",
                      "" if got is None or want <= 0 else f"{got / want:.2f}", "trains" if i == pick else "")
    return table


def trial_lines(outcome: TrialOutcome, pick: int | None, budget_s: float) -> list[str]:
    """What rank 0 says under the table: the trials' cost against the budget and what trains."""
    done = sum(m is not None for m in outcome.measured)
    r = outcome.round
    said = [f"trials: {done} of {len(outcome.measured)} measured in {r.seconds:.1f} s (the profiling budget had "
            f"{max(budget_s, 0.0):.1f} s left)"]
    if r.status.value != "ok":
        said.append(f"trials: {'timed out' if r.status.value == 'timeout' else r.status.value}: {r.reason}"
                    + (" (raise cfp.profile_budget_s to measure them all)" if r.status.value == "timeout" else ""))
    if r.over_memory:
        said.append(f"trials: out of memory: {', '.join(r.over_memory)}")
    if pick is None:
        said.append("trials: fewer than two finished; the search's plan trains")
    return said + list(outcome.notes)
