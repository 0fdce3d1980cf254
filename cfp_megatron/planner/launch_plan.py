"""The plan a training launch runs with (``launch/train.py +cfp=auto`` or ``+cfp=manual``).

``auto``: before any process group, the pins and sets are checked against the model and the world size (a
contradiction is a :class:`~cfp_megatron.base.errors.ConfigError` naming the ``cfp`` keys); then every rank takes part
in the profiling rounds (:func:`cfp_megatron.profile.runner.profile_job`, which reuses what the ProfileDB of this
cluster already holds), rank 0 searches with the measurements (:func:`cfp_megatron.search.search.search`) and
broadcasts plan.json's content (canonical string, hash and fields), and every rank rebuilds the plan from the fields
and checks that they give rank 0's string and hash. The plan is
stored under the run directory, keyed by its inputs (model, training, cluster, world size, planner settings), so a
torchrun restart (``TORCHELASTIC_RESTART_COUNT`` > 0) or a second launch into the same run directory reuses it without
profiling or searching again, and a different world size plans again. ``manual``: the plan of ``cfp.plan_file`` or
of the canonical string ``cfp.plan``; without either, ``parallel`` as given.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.backends.megatron.backend import MegatronBackend
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import JobSpec, Recompute
from cfp_megatron.base.errors import CfpError, ConfigError
from cfp_megatron.base.files import CACHE_ENV, WriteLocation, cache_dir, check_write_locations
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.cluster.measured import partition_name
from cfp_megatron.engine.metrics import METRICS_KIND
from cfp_megatron.plan import Plan, PlanError, load_plan, save_plan
from cfp_megatron.planner.memory_fit import check_launch_fits
from cfp_megatron.planner.plan_cli import inputs_fingerprint
from cfp_megatron.planner.plan_inputs import check_plan_applies, check_typed_before_plan, typed_keys
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.profile.progress import RoundProgress
from cfp_megatron.search.space import no_layout_issues

PLAN_DIR = "cfp"
"""Folder of the run directory that holds the plans of its launches."""


@dataclass(frozen=True, kw_only=True)
class LaunchPlan:
    """The plan a launch trains with."""

    plan: Plan
    """The plan (with its prediction where one was made)."""
    job: JobSpec
    """The job under the plan."""
    source: str
    """``planned`` (profiled and searched now), ``cached`` (reused from the run directory), ``file`` or ``string``."""
    path: Path | None
    """Where the plan is stored (``None`` for a canonical string)."""
    ranked: tuple[str, ...] = ()
    """The search's top plans, one line each (``planned`` only)."""
    calibration: float = 1.0
    """Measured over predicted step time of earlier runs of this model on this cluster (median, the profile's own
    prediction counted as one run: :meth:`~cfp_megatron.profile.db.ProfileDB.calibration`; 1 without any):
    the factor the step time shown and checked is scaled by (``planned`` only)."""


def plan_key(job: JobSpec, world: int, cfp: CfpSpec) -> str:
    """What a launch's plan depends on: the model and cluster specs, the global batch, sequence length, precision
    and optimizer, the world size and the planner's settings (not the parallel section, which the plan replaces,
    nor the steps, learning rate, checkpoint and log settings)."""
    t = job.train
    train = {"global_batch_size": t.global_batch_size, "seq_length": t.seq_length, "precision": t.precision.value,
             "optimizer": t.optimizer.value}  # what the plan depends on; steps, LR, checkpoints and logs do not
    payload = {"model": json_plain(job.model), "train": train, "cluster": json_plain(job.cluster),
               "world": world, "cfp": json_plain(dataclasses.replace(cfp, plan_file=None, top_k=1,
                                                                     check_after_steps=0))}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def metrics_location(job: JobSpec, run_dir: Path | None) -> WriteLocation | None:
    """Where rank 0's metrics go: ``train.metrics_file``, else ``metrics.jsonl`` in the Hydra run directory."""
    if job.train.metrics_file is not None:
        return WriteLocation(key="train.metrics_file", path=Path(job.train.metrics_file), folder=False,
                             own_kind=METRICS_KIND)
    if run_dir is None:
        return None
    return WriteLocation(key="hydra.run.dir", path=run_dir / "metrics.jsonl", folder=False, own_kind=METRICS_KIND)


def write_locations(job: JobSpec, cfp: CfpSpec, run_dir: Path | None) -> list[WriteLocation]:
    """Every place a training launch writes to, by the setting that chose it: the checkpoint folder, the metrics
    file, the run directory (its plans, DeepSpeed's config), and with ``+cfp=auto`` the profile cache. Checked with
    :func:`~cfp_megatron.base.files.check_write_locations` before any process group (``cfp.plan_file`` once a plan
    is to be written: :func:`resolve_launch_plan`)."""
    found = []
    if job.train.checkpoint_dir is not None:
        found.append(WriteLocation(key="train.checkpoint_dir", path=Path(job.train.checkpoint_dir), folder=True))
    metrics = metrics_location(job, run_dir)
    if metrics is not None:
        found.append(metrics)
    if run_dir is not None or cfp.mode is CfpMode.auto:
        found.append(WriteLocation(key="hydra.run.dir", path=run_dir or Path("outputs"), folder=True))
    if cfp.mode is CfpMode.auto:
        found.append(WriteLocation(key=f"{CACHE_ENV} (environment variable)", path=cache_dir(), folder=True))
    return found


def check_constraints(job: JobSpec, world: int, cfp: CfpSpec) -> None:
    """Raise a :class:`ConfigError` when the pins and sets leave no layout for ``job`` on ``world`` ranks (before any
    process group or profiling), naming each pin or set that removes every layout on its own
    (:func:`~cfp_megatron.search.space.no_layout_issues`)."""
    issues = no_layout_issues(job, world, cfp, te_available=transformer_engine_available())
    if issues:
        raise ConfigError(issues)


def resolve_launch_plan(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, run_dir: Path | None,
                        console: Any = None, *, optimizer_kind: bool | None = None) -> LaunchPlan | None:
    """The plan this launch trains with (see the module docstring), ``None`` to train ``job.parallel`` as given.
    Every rank calls it; with ``auto`` they profile together. ``optimizer_kind`` (a resumed checkpoint's: whether it
    holds the distributed optimizer) pins that knob: a stored plan with the other kind is not reused."""
    if cfp.mode is CfpMode.off:
        return None
    world = env.world_size
    check_typed_before_plan(job, cfp, typed_keys())  # a typed setting the mode would drop: refused now
    if cfp.mode is CfpMode.manual:
        if cfp.plan_file is not None:
            plan, source, path = load_plan(cfp.plan_file), "file", Path(cfp.plan_file)
        elif cfp.plan is not None:
            plan, source, path = Plan.parse(cfp.plan), "string", None
        else:
            return None
        said = f"the plan of cfp.plan_file={cfp.plan_file}" if path is not None else "the plan of cfp.plan"
        return LaunchPlan(plan=plan, job=_apply(plan, job, world, source=said, cfp=cfp, console=console),
                          source=source, path=path)
    folder = (run_dir or Path("outputs")) / PLAN_DIR
    pinned = cfp if optimizer_kind is None else dataclasses.replace(cfp, distributed_optimizer=optimizer_kind)
    # the plan of these inputs, else (resuming) the one planned with the checkpoint's optimizer kind pinned
    paths = dict.fromkeys(folder / f"plan-{plan_key(job, world, c)}.json" for c in (cfp, pinned))
    for cached in paths:
        if cached.exists():
            plan = load_plan(cached)
            if optimizer_kind is None or plan.parallel.distributed_optimizer == optimizer_kind:
                return LaunchPlan(plan=plan, job=_apply(plan, job, world), source="cached", path=cached)
    cfp = pinned
    if cfp.plan_file is not None:  # refused now rather than after the profiling budget
        check_write_locations([WriteLocation(key="cfp.plan_file", path=Path(cfp.plan_file), folder=False, new=True)])
    check_constraints(job, world, cfp)
    check_launch_fits(job, world, cfp)  # every rank reads the same memory figure: all refuse, before profiling
    plan, ranked, scale = _profile_and_search(job, cfp, env, console)
    if env.rank == 0:
        if not cached.exists():  # a concurrent launch into the same folder may have stored the same inputs' plan
            save_plan(plan, cached, key="hydra.run.dir")  # a disk that refuses it: one FileWriteError naming the key
        if cfp.plan_file is not None:
            save_plan(plan, cfp.plan_file)
    return LaunchPlan(plan=plan, job=_apply(plan, job, world), source="planned", path=cached, ranked=ranked,
                      calibration=scale)


def _apply(plan: Plan, job: JobSpec, world: int, *, source: str = "the plan searched under +cfp=auto",
           cfp: CfpSpec | None = None, console: Any = None) -> JobSpec:
    """``job`` under ``plan`` (``source`` names it in errors), refused where the plan is for another world size,
    model, optimizer or cluster, or would change a setting the user typed or a ``cfp`` pin of ``cfp``; the
    ``train`` values it replaces are said on ``console`` (:func:`~cfp_megatron.planner.plan_inputs
    .check_plan_applies`)."""
    planned = plan.nodes * plan.gpus_per_node
    if planned != world:
        raise PlanError(f"the plan is for {planned} ranks ({plan.nodes} x {plan.gpus_per_node}) but {world} were "
                        "started.", fix=f"start {planned} ranks, or plan again for {world} (+cfp=auto).",
                        setting="cfp.plan_file")
    check_plan_applies(plan, job, source=source, cfp=cfp, console=console)
    return plan.apply(job)


def _profile_and_search(job: JobSpec, cfp: CfpSpec, env: LaunchEnv,
                        console: Any) -> tuple[Plan, tuple[str, ...], float]:
    from cfp_megatron.engine.distributed import destroy_distributed, searched_on_rank0
    from cfp_megatron.profile.runner import profile_job

    with RoundProgress(enabled=env.rank == 0 and console is not None) as progress:
        outcome = profile_job(job, env, budget_s=cfp.profile_budget_s, keep_group=True,
                              priority=lambda: profile_priority(job, cfp, env.world_size),
                              progress=progress.update if env.rank == 0 and console is not None else None)
    if env.rank == 0 and console is not None:
        for line in coverage_lines(outcome, cfp.profile_budget_s, env.world_size,
                                   [f"model={job.model.name}", f"cluster={job.cluster.name}"]):
            console.print(f"cfp: {line}", markup=False)
    try:
        def search() -> dict[str, Any]:
            plan, ranked, scale = _search_on_rank0(job, cfp, env.world_size)
            return {"plan": plan.to_json(), "ranked": list(ranked), "calibration": scale}

        received = searched_on_rank0(search, outcome, env, console)
        # rank 0's canonical string and hash travel inside plan.json; from_json rebuilds the plan from its fields
        # and raises a PlanError unless this rank gets the same string and hash from them
        plan = Plan.from_json(received["plan"])
        return plan, tuple(received["ranked"]), float(received["calibration"])
    finally:
        destroy_distributed()


def profile_priority(job: JobSpec, cfp: CfpSpec, world: int) -> tuple[str, ...]:
    """What profiling should measure first for this job: the partitions and micro-batch sizes (``tp2-sp mbs=4``) of
    the layouts a search ranks best before this run's rounds (on the stored profile where one exists, else on the
    analytical model), best first, with each plan's recomputed partition after its plain one. Empty when that search
    finds nothing (profiling then keeps its own order)."""
    try:
        cluster, measurements = local_measurements(job, world_size=world)
        found = MegatronBackend().search(dataclasses.replace(job, cluster=cluster), world,
                                         dataclasses.replace(cfp, top_k=max(cfp.top_k, PRIORITY_PLANS)), BackendSpec(),
                                         measurements=measurements, inputs_fingerprint="",
                                         on_gpu=not cluster.on_cpu)
    except CfpError:
        return ()
    out: dict[str, None] = {}
    for plan in found.plans:
        p, mbs = plan.parallel, plan.micro_batch_size
        out[f"{partition_name(p.tp, sp=p.sp)} mbs={mbs}"] = None  # the embedding, the head and the overheads
        out[f"{partition_name(p.tp, sp=p.sp, mlp=p.mlp)} mbs={mbs}"] = None  # the decoder layers
        if p.recompute is not Recompute.none:
            recomputed = partition_name(p.tp, sp=p.sp, mlp=p.mlp, recompute=p.recompute,
                                        recompute_modules=p.recompute_modules)
            out[f"{recomputed} mbs={mbs}"] = None
    return tuple(out)


PRIORITY_PLANS = 8
"""Plans of the search before profiling whose partitions are measured first."""


def _search_on_rank0(job: JobSpec, cfp: CfpSpec, world: int) -> tuple[Plan, tuple[str, ...], float]:
    cluster, measurements = local_measurements(job, world_size=world)
    planned = dataclasses.replace(job, cluster=cluster)
    key = measurements.fingerprint.key if measurements is not None else None
    found = MegatronBackend().search(planned, world, cfp, BackendSpec(), measurements=measurements,
                                     inputs_fingerprint=inputs_fingerprint(planned, key), on_gpu=not cluster.on_cpu)
    # Earlier runs of this model on this profile, checked against plans of the same layout family, scale the step
    # time shown and checked (the plan keeps the simulator's; the ranking does not change).
    def scale_of(p: Plan) -> float:
        found = measurements.step_time_calibration(plan=p.canonical()) if measurements is not None else None
        return found or 1.0

    # The plan carries the job's own cluster preset (the measured figures are inputs, kept in the fingerprint).
    plan = dataclasses.replace(found.best, cluster=job.cluster.name)
    ranked = tuple(f"{label}: {p.predicted.step_time_s * scale_of(p) * 1e3:.1f} ms, "
                   f"{p.predicted.peak_memory_gib:.3f} GiB"
                   + (f" [analytical: {', '.join(p.predicted.analytical)} not measured]" if p.predicted.analytical
                      else "")
                   for label, p in zip(found.labels, found.plans, strict=True) if p.predicted is not None)
    return plan, ranked, scale_of(found.best)


def coverage_lines(outcome: Any, budget_s: float, world: int, overrides: list[str]) -> list[str]:
    """What profiling measured, reused, cut off per round, and (when partial) what is missing and how to complete
    it (``outcome``: :class:`~cfp_megatron.profile.runner.ProfileOutcome` on rank 0)."""
    from cfp_megatron.profile.runner import completion_hint

    parts = []
    for r in outcome.coverage:
        total = len(r.measured) + len(r.missing) + r.reused + len(r.over_memory)
        state = "timed out" if r.status.value == "timeout" else r.status.value if r.status.value != "ok" else ""
        said = f"{r.name} {total - len(r.missing)}/{total}"
        said += (f" ({len(r.measured)} measured, {r.reused} reused"
                 + (f", {len(r.over_memory)} over memory" if r.over_memory else "") + (f", {state}" if state else "")
                 + ")")
        parts.append(said)
    lines = [f"profile (budget {budget_s:.0f} s): " + "; ".join(parts)] if parts else []
    return lines + completion_hint(outcome, overrides, world=world)
