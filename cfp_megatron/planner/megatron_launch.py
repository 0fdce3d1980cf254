"""What the Megatron-Core backend adds to the one launch pipeline (:class:`MegatronLaunch`, the
:class:`~cfp_megatron.backends.protocol.LaunchHooks` of ``backend=megatron``): the layout checks, the resumed
optimizer's kind, the bounded search before profiling (its pins, its memory; reused after profiling where profiling
measured nothing) and the priorities it gives profiling, the calibration of earlier runs, the plan check with its
memory, and Megatron's trainer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cfp_megatron.backends.megatron.backend import MegatronBackend
from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec, Recompute, resolve_precision
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.cluster.measured import Measurements, partition_name
from cfp_megatron.plan import Plan
from cfp_megatron.plan.check import PlanCheck, with_breakdown
from cfp_megatron.planner.job_checks import validate_job, validate_rest
from cfp_megatron.planner.memory_fit import check_launch_fits, check_layout_fits
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.profile.fingerprint import model_key
from cfp_megatron.search.space import no_layout_issues


class MegatronLaunch:
    """The launch hooks of the Megatron-Core backend."""

    kind = BackendKind.megatron
    """The backend it launches."""
    keeps_group = False
    """Training makes its own groups (:func:`~cfp_megatron.engine.distributed.init_distributed`)."""

    def check_job(self, job: JobSpec, cfp: CfpSpec, world: int, *, planned: bool) -> None:
        """The whole job (:func:`~cfp_megatron.planner.job_checks.validate_job`); a planned one's layout later."""
        if planned:
            validate_rest(job, world)
        else:
            validate_job(job, world)

    def check_before_start(self, job: JobSpec, *, restarted: bool, writer: str | None,
                           note: Callable[[str], None], backend: BackendSpec | None = None,
                           world: int | None = None, planned: bool = False) -> int | None:
        """Megatron's checkpoint folder (:func:`cfp_megatron.engine.checkpoint.check_before_start`), its training
        state by this run's precision."""
        import torch

        from cfp_megatron.engine import checkpoint  # torch: a launch only

        t = job.train
        state = checkpoint.training_state(resolve_precision(t.precision, torch.cuda.is_available()), job.data)
        return checkpoint.check_before_start(t.checkpoint_dir, resume=t.resume, restarted=restarted,
                                             trust_unverified=t.trust_unverified_checkpoint, steps=t.steps,
                                             save_interval=t.save_interval, model=job.model, state=state,
                                             writer=writer, note=note)

    def resumed_backend(self, job: JobSpec, backend: BackendSpec, start_step: int | None, *, planned: bool,
                        note: Callable[[str], None]) -> BackendSpec:
        """``backend``: what a Megatron checkpoint fixes is pinned by :meth:`resume_pin`."""
        return backend

    def resume_pin(self, job: JobSpec, cfp: CfpSpec, start_step: int | None, *, planned: bool) -> bool | None:
        """The resumed checkpoint's optimizer kind (distributed or not), which Megatron-Core 0.16 loads only into
        the same kind: a setting asking for the other is refused; ``+cfp=auto`` without one plans with it pinned."""
        from cfp_megatron.engine import checkpoint  # torch: a launch only

        if start_step is None or job.train.checkpoint_dir is None:
            return None
        saved = checkpoint.saved_distributed_optimizer(job.train.checkpoint_dir, start_step)
        if not planned:
            same_optimizer_kind("parallel.distributed_optimizer", job.parallel.distributed_optimizer, saved)
        elif cfp.mode is CfpMode.auto and cfp.distributed_optimizer is not None:
            same_optimizer_kind("cfp.distributed_optimizer", cfp.distributed_optimizer, saved)
        return saved

    def hand_plan(self, job: JobSpec, backend: BackendSpec, world: int, *, on_gpu: bool) -> Plan:
        """``parallel`` as given."""
        return Plan.from_job(job, world_size=world, prediction=None, inputs_fingerprint="")

    def check_plan_fits(self, job: JobSpec, plan: Plan, world: int) -> None:
        """The layout checks, then the simulator's memory of the layout
        (:func:`~cfp_megatron.planner.memory_fit.check_layout_fits`)."""
        validate_job(job, world)
        check_layout_fits(job, world)

    def search_before_profiling(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
                                given: ClusterSpec, measurements: Measurements | None, on_gpu: bool,
                                inputs_fingerprint: str) -> PlannedSearch | None:
        """The pins (:func:`check_constraints`), then the search on this machine's figures for the best
        ``cfp.top_k``, as the search after profiling asks it (the bounded search's best can depend on ``top_k``):
        refused when no layout fits the memory (:func:`~cfp_megatron.planner.memory_fit.check_launch_fits`)."""
        original = dataclasses.replace(job, cluster=given)
        check_constraints(original, world, cfp)
        result = check_launch_fits(original, world, cfp, top_k=cfp.top_k, figures=(job.cluster, measurements))
        return MegatronBackend.planned(result, job, world, inputs_fingerprint=inputs_fingerprint)

    def priority(self, early: PlannedSearch | None) -> Callable[[], tuple[str, ...]] | None:
        """The partitions of the ``cfp.top_k`` layouts the search before profiling ranks best
        (:func:`priority_of`)."""
        plans = early.plans if early is not None else ()
        return lambda: priority_of(plans)

    def after_profiling(self, job: JobSpec, env: LaunchEnv, outcome: Any, console: Any, *,
                        on_gpu: bool) -> MegatronBackend:
        """Nothing more to measure."""
        return MegatronBackend()

    def show_search(self, found: PlannedSearch, console: Any) -> None:
        """Nothing here: the ranked plans are said with the plan."""

    def calibration(self, measurements: Measurements | None, plan: Plan) -> float:
        """Earlier runs of this model on this profile, checked against plans of the same layout family
        (:meth:`~cfp_megatron.profile.db.ProfileDB.step_time_calibration`; 1 without any)."""
        found = measurements.step_time_calibration(plan=plan.canonical()) if measurements is not None else None
        return found or 1.0

    def plan_check(self, job: JobSpec, plan: Plan, cfp: CfpSpec, *, calibration: float, on_gpu: bool,
                   picture: str | None) -> tuple[JobSpec, PlanCheck | None]:
        """Step time and peak memory after ``cfp.check_after_steps`` (the memory measured on that step unless
        ``train.memory_step`` is set), drawn with the plan's memory breakdown."""
        if plan.predicted is None or cfp.check_after_steps == 0:
            return job, None
        steps = min(cfp.check_after_steps, job.train.steps)  # a shorter run is checked at its last step
        if job.train.memory_step is None:
            job = dataclasses.replace(job, train=dataclasses.replace(job.train, memory_step=steps))
        check = PlanCheck(plan=plan.canonical(), model_key=model_key(job, on_gpu=on_gpu),
                          after_steps=steps, warmup_steps=cfp.check_warmup_steps,
                          predicted_step_s=plan.predicted.step_time_s, calibration=calibration,
                          predicted_peak_bytes=plan.predicted.peak_memory_gib * 2**30,
                          analytical=plan.predicted.analytical)
        if picture is not None:
            check = with_breakdown(check, job, plan.world_size, picture)
        return job, check

    def trainer(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *, folder: Path,
                console: Any) -> tuple[JobSpec, MegatronBackend]:
        """The layout checks on the planned job; Megatron's training loop."""
        validate_job(job, env.world_size)
        return job, MegatronBackend()


def same_optimizer_kind(key: str, value: bool, saved: bool) -> None:
    """Raise a ConfigError (before any process group) when ``key`` asks for another optimizer kind than the resumed
    checkpoint holds."""
    if value == saved:
        return
    raise ConfigError(ConfigIssue(
        key=key, value=value, problem=f"the checkpoint being resumed holds {'the distributed' if saved else 'a plain'} "
        "optimizer's state, which Megatron-Core 0.16 loads only into the same kind of optimizer.",
        fix=(f"set {key}={str(saved).lower()}" if key.endswith("distributed_optimizer")
             else f"apply a plan with the distributed optimizer {'on' if saved else 'off'}")
        + ", or start from a fresh train.checkpoint_dir."))


def check_constraints(job: JobSpec, world: int, cfp: CfpSpec) -> None:
    """Raise a :class:`ConfigError` when the pins and sets leave no layout for ``job`` on ``world`` ranks (before any
    process group or profiling), naming each pin or set that removes every layout on its own
    (:func:`~cfp_megatron.search.space.no_layout_issues`)."""
    issues = no_layout_issues(job, world, cfp, te_available=transformer_engine_available())
    if issues:
        raise ConfigError(issues)


def profile_priority(job: JobSpec, cfp: CfpSpec, world: int) -> tuple[str, ...]:
    """What profiling should measure first for ``job`` (:func:`priority_of` the plans a search on this machine's
    figures ranks best); empty when that search finds nothing (profiling then keeps its own order)."""
    cluster, measurements = local_measurements(job, world_size=world)
    try:
        early = MegatronLaunch().search_before_profiling(
            dataclasses.replace(job, cluster=cluster), world, cfp, BackendSpec(), given=job.cluster,
            measurements=measurements, on_gpu=not cluster.on_cpu, inputs_fingerprint="")
    except CfpError:
        return ()
    return priority_of(early.plans if early is not None else ())


def priority_of(plans: tuple[Plan, ...]) -> tuple[str, ...]:
    """The partitions and micro-batch sizes (``tp2-sp mbs=4``) of ``plans``, best first, with each plan's
    recomputed partition after its plain one."""
    out: dict[str, None] = {}
    for plan in plans:
        p, mbs = plan.parallel, plan.micro_batch_size
        out[f"{partition_name(p.tp, sp=p.sp)} mbs={mbs}"] = None  # the embedding, the head and the overheads
        out[f"{partition_name(p.tp, sp=p.sp, mlp=p.mlp)} mbs={mbs}"] = None  # the decoder layers
        if p.recompute is not Recompute.none:
            recomputed = partition_name(p.tp, sp=p.sp, mlp=p.mlp, recompute=p.recompute,
                                        recompute_modules=p.recompute_modules)
            out[f"{recomputed} mbs={mbs}"] = None
    return tuple(out)
