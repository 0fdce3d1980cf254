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
of the canonical string ``cfp.plan``; without either (and without ``cfp``), the plan of the layout as given. The same
for every backend: what one adds (its pins, memory checks, search, measurements after profiling) are its
:class:`~cfp_megatron.backends.protocol.LaunchHooks`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.backends.protocol import LaunchHooks, PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import (
    CACHE_ENV,
    WriteLocation,
    cache_dir,
    check_write_locations,
    read_user_file,
    write_atomic,
)
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.engine.metrics import METRICS_KIND
from cfp_megatron.model.layer_spec import keyed_model
from cfp_megatron.plan import Plan, PlanError, load_plan, save_plan
from cfp_megatron.plan.exports import with_searched_token_policy
from cfp_megatron.plan.trial_choice import measured_pick, picked, shortfall, trial_positions
from cfp_megatron.planner.megatron_launch import MegatronLaunch
from cfp_megatron.planner.megatron_launch import check_constraints as check_constraints
from cfp_megatron.planner.megatron_launch import profile_priority as profile_priority
from cfp_megatron.planner.plan_cli import inputs_fingerprint
from cfp_megatron.planner.plan_inputs import check_plan_applies, check_typed_before_plan, typed_keys
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.profile.progress import PREPARE, RoundProgress
from cfp_megatron.profile.records import RoundStatus
from cfp_megatron.sim.calibration import identity_warnings

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
    """``planned`` (profiled and searched now), ``cached`` (reused from the run directory), ``file``, ``string`` or
    ``pinned`` (the layout as given)."""
    path: Path | None
    """Where the plan is stored (``None`` for a canonical string)."""
    ranked: tuple[str, ...] = ()
    """The search's top plans, one line each (``planned`` only)."""
    calibration: float = 1.0
    """Measured over predicted step time of earlier runs of this model on this cluster (median, the profile's own
    prediction counted as one run: :meth:`~cfp_megatron.profile.db.ProfileDB.calibration`; 1 without any):
    the factor the step time shown and checked is scaled by (``planned`` only)."""


def plan_key(job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec | None = None) -> str:
    """What a launch's plan depends on: the model and cluster specs, the global batch, sequence length, precision
    and optimizer, the world size, the planner's settings that shape the search and a backend other than
    Megatron-Core's with its knobs (not the parallel section, which the plan replaces, nor the steps, learning
    rate, checkpoint and log settings, nor ``cfp.trials``: trials choose among the searched plans at launch, and
    their pick is the stored plan; docs/planning.md, "The plan key")."""
    t = job.train
    train = {"global_batch_size": t.global_batch_size, "seq_length": t.seq_length,
             "precision": NumberFormat.of(t).name,  # the value itself for 16/32 bits (earlier keys hold)
             "optimizer": t.optimizer.value}  # what the plan depends on; steps, LR, checkpoints and logs do not
    settings = json_plain(dataclasses.replace(cfp, plan_file=None, top_k=1, check_after_steps=0))
    settings.pop("trials", None)  # left out, not normalised: the keys of launches from before trials hold
    payload = {"model": keyed_model(job.model), "train": train, "cluster": json_plain(job.cluster),
               "world": world, "cfp": settings}
    if backend is not None and backend.name is not BackendKind.megatron:  # Megatron's keys predate the backends
        payload["backend"] = json_plain(backend)
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


def given_plan(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, console: Any = None, *, hooks: LaunchHooks,
               backend: BackendSpec, on_gpu: bool = False) -> LaunchPlan | None:
    """The plan of a launch that does not search (``None`` under ``+cfp=auto``): ``cfp.plan_file``'s, the string
    ``cfp.plan``'s, else the layout as given (``hooks``: the backend's); checked against this machine's memory
    (a plan this machine's search did not make) before any process group."""
    world = env.world_size
    if cfp.mode is CfpMode.auto:
        return None
    if cfp.mode is CfpMode.manual and (cfp.plan_file is not None or cfp.plan is not None):
        check_typed_before_plan(job, cfp, typed_keys())  # a typed setting the mode would drop: refused now
        if cfp.plan_file is not None:
            plan, source, path = load_plan(cfp.plan_file), "file", Path(cfp.plan_file)
        else:
            plan, source, path = Plan.parse(str(cfp.plan)), "string", None
        said = f"the plan of cfp.plan_file={cfp.plan_file}" if path is not None else "the plan of cfp.plan"
        planned = _apply(plan, job, world, source=said, setting="cfp.plan_file" if path is not None else "cfp.plan",
                         cfp=cfp, backend=backend, console=console)
    else:
        if cfp.mode is CfpMode.manual:
            check_typed_before_plan(job, cfp, typed_keys())
        plan, source, path = hooks.hand_plan(job, backend, world, on_gpu=on_gpu), "pinned", None
        planned = plan.apply(job)
    hooks.check_plan_fits(planned, plan, world)
    return LaunchPlan(plan=plan, job=planned, source=source, path=path)


def searched_plan(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, run_dir: Path | None, console: Any = None, *,
                  hooks: LaunchHooks, backend: BackendSpec, optimizer_kind: bool | None = None,
                  on_gpu: bool = False) -> LaunchPlan:
    """The plan of a ``+cfp=auto`` launch (see the module docstring; ``hooks``: the backend's). Every rank calls it
    and they profile together. ``optimizer_kind`` (a resumed checkpoint's: whether it holds the distributed
    optimizer) pins that knob: a stored plan with the other kind is not reused."""
    world = env.world_size
    check_typed_before_plan(job, cfp, typed_keys())  # a typed setting the mode would drop: refused now
    folder = (run_dir or Path("outputs")) / PLAN_DIR
    pinned = cfp if optimizer_kind is None else dataclasses.replace(cfp, distributed_optimizer=optimizer_kind)
    # the plan of these inputs, else (resuming) the one planned with the checkpoint's optimizer kind pinned
    keys = list(dict.fromkeys(plan_key(job, world, c, backend) for c in (cfp, pinned)))
    for inputs in keys:
        cached = stored_plan(folder, inputs)
        if cached is not None:
            plan = load_plan(cached)
            if optimizer_kind is None or plan.parallel.distributed_optimizer == optimizer_kind:
                return LaunchPlan(plan=plan, job=_apply(plan, _searched_policy(plan, job, cfp), world,
                                                        backend=backend), source="cached", path=cached)
    cfp = pinned
    if cfp.plan_file is not None:  # refused now rather than after the profiling budget
        check_write_locations([WriteLocation(key="cfp.plan_file", path=Path(cfp.plan_file), folder=False, new=True)])
    with RoundProgress(enabled=env.rank == 0 and console is not None) as progress:  # a row from the start
        progress.update(PREPARE, 0, 0, "reading this machine's profile, the search before profiling")
        # This machine's figures, read once: every rank checks the pins and the memory on them before profiling
        # (all refuse alike), and rank 0 reuses that search where profiling measures nothing.
        figures = local_measurements(job, world_size=world)
        key = figures[1].fingerprint.key if figures[1] is not None else None
        here = dataclasses.replace(job, cluster=figures[0])
        early = hooks.search_before_profiling(here, world, cfp, backend, given=job.cluster, measurements=figures[1],
                                              on_gpu=on_gpu, inputs_fingerprint=inputs_fingerprint(here, key))
        searched = _profile_and_search(job, cfp, env, console, hooks=hooks, backend=backend, early=early,
                                       figures=figures, on_gpu=on_gpu, progress=progress)
    plan = searched.plan
    cached = folder / f"plan-{plan.plan_hash()}.json"  # named by the hash it holds
    if env.rank == 0:
        if stored_plan(folder, keys[-1]) is None:  # a concurrent launch into the folder may have stored it
            if not cached.exists():
                save_plan(plan, cached, key="hydra.run.dir")  # a disk that refuses it: one FileWriteError naming it
            write_atomic(folder / f"{INPUTS_INDEX}{keys[-1]}", f"{cached.name}\n", key="hydra.run.dir")
        if cfp.plan_file is not None:
            save_plan(plan, cfp.plan_file)
    return dataclasses.replace(searched, job=_apply(plan, _searched_policy(plan, job, cfp), world, backend=backend),
                               path=cached)


def _searched_policy(plan: Plan, job: JobSpec, cfp: CfpSpec) -> JobSpec:
    """``job`` with the MoE token policy the search chose for ``plan`` from ``cfp.constraints.moe_token_policy``."""
    return with_searched_token_policy(plan, job, cfp.constraints.moe_token_policy)


INPUTS_INDEX = ".inputs-"
"""The hidden file of a run folder's ``cfp/`` that names the plan file searched for one set of inputs
(``.inputs-<plan_key>`` holding ``plan-<plan hash>.json``): how a relaunch or a restart into the folder finds it."""


def stored_plan(folder: Path, inputs: str) -> Path | None:
    """The plan file ``folder`` holds for the inputs whose :func:`plan_key` is ``inputs``, ``None`` when none."""
    index = folder / f"{INPUTS_INDEX}{inputs}"
    try:
        name = read_user_file(index, "hydra.run.dir").strip()
    except (CfpError, OSError):
        return None
    path = folder / name
    return path if name.startswith("plan-") and "/" not in name and path.is_file() else None


def resolve_launch_plan(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, run_dir: Path | None,
                        console: Any = None, *, optimizer_kind: bool | None = None) -> LaunchPlan | None:
    """The plan of a Megatron-Core launch (:func:`given_plan` or :func:`searched_plan`); ``None`` to train
    ``job.parallel`` as given."""
    if cfp.mode is CfpMode.off:
        return None
    hooks, backend, on_gpu = MegatronLaunch(), BackendSpec(), _on_gpu()
    if cfp.mode is CfpMode.manual:
        if cfp.plan_file is None and cfp.plan is None:
            check_typed_before_plan(job, cfp, typed_keys())
            return None
        return given_plan(job, cfp, env, console, hooks=hooks, backend=backend, on_gpu=on_gpu)
    return searched_plan(job, cfp, env, run_dir, console, hooks=hooks, backend=backend,
                         optimizer_kind=optimizer_kind, on_gpu=on_gpu)


def _on_gpu() -> bool:
    import torch

    return torch.cuda.is_available()


def _apply(plan: Plan, job: JobSpec, world: int, *, source: str = "the plan searched under +cfp=auto",
           setting: str = "cfp.plan_file", cfp: CfpSpec | None = None, backend: BackendSpec | None = None,
           console: Any = None) -> JobSpec:
    """``job`` under ``plan`` (``source`` names it in errors, ``setting`` is the key that gave it), refused where the
    plan is for another world size, model, optimizer, cluster or backend, or would change a setting the user typed
    or a ``cfp`` pin of ``cfp``; the ``train`` values it replaces are said on ``console``
    (:func:`~cfp_megatron.planner.plan_inputs.check_plan_applies`)."""
    planned = plan.nodes * plan.gpus_per_node
    if planned != world:
        raise PlanError(f"{source} is for {planned} ranks ({plan.nodes} x {plan.gpus_per_node}) but {world} were "
                        "started.", fix=f"start {planned} ranks, or plan again for {world} (+cfp=auto).",
                        setting=setting)
    check_plan_applies(plan, job, source=source, cfp=cfp, backend=backend, console=console)
    return plan.apply(job)


def _profile_and_search(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, console: Any, *, hooks: LaunchHooks,
                        backend: BackendSpec, early: PlannedSearch | None,
                        figures: tuple[ClusterSpec, Measurements | None], on_gpu: bool,
                        progress: RoundProgress) -> LaunchPlan:
    """Profile with every rank (what profiling measures first: the backend's priority), then search on rank 0 and
    broadcast the plan: the search before profiling where profiling measured nothing (the same ProfileDB), else a
    search on the ProfileDB profiling handed back (not read again)."""
    progress.update(PREPARE, 0, 0, "loading Megatron-Core")
    from cfp_megatron.engine.distributed import destroy_distributed, searched_on_rank0
    from cfp_megatron.profile.runner import profile_job

    shown = env.rank == 0 and console is not None
    began = time.perf_counter()  # the trials share the profiling budget (rank 0's clock decides)
    outcome = profile_job(job, env, budget_s=cfp.profile_budget_s, repeats=cfp.profile_repeats, keep_group=True,
                          priority=hooks.priority(early), progress=progress.update if shown else None)
    progress.close()
    if shown:
        for line in coverage_lines(outcome, cfp.profile_budget_s, env.world_size,
                                   [f"model={job.model.name}", f"cluster={job.cluster.name}"]):
            console.print(f"cfp: {line}", markup=False)
    world = env.world_size
    try:
        searcher = hooks.after_profiling(job, env, outcome, console, on_gpu=on_gpu)

        def search() -> dict[str, Any]:
            if outcome.reused and early is not None:  # the same ProfileDB: the search before profiling stands
                cluster, measurements = figures
                found = dataclasses.replace(early, plans=early.plans[:cfp.top_k], labels=early.labels[:cfp.top_k])
            else:
                cluster, measurements = local_measurements(job, world_size=world, db=outcome.db)
                here = dataclasses.replace(job, cluster=cluster)
                key = measurements.fingerprint.key if measurements is not None else None
                found = searcher.search(here, world, cfp, backend, measurements=measurements,
                                        inputs_fingerprint=inputs_fingerprint(here, key), on_gpu=on_gpu)
            if console is not None:
                hooks.show_search(found, console)
                for line in identity_warnings(cluster):  # the generation missing or unknown: whose efficiencies
                    console.print(f"cfp: {line}", markup=False)
            # Earlier runs of this model on this profile scale the step time shown and checked (the plan keeps the
            # simulator's; the ranking does not change).
            ranked = tuple(f"{label}: {p.predicted.step_time_s * hooks.calibration(measurements, p) * 1e3:.1f} ms, "
                           f"{p.predicted.peak_memory_gib:.3f} GiB"
                           + (f" [analytical: {', '.join(p.predicted.analytical)} not measured]"
                              if p.predicted.analytical else "")
                           for label, p in zip(found.labels, found.plans, strict=True) if p.predicted is not None)
            # The plan carries the job's own cluster preset (the measured figures are inputs, kept in the fingerprint).
            plan = dataclasses.replace(found.best, cluster=job.cluster.name)
            tried = trial_positions(found.plans, cfp.trial_count) if hooks.kind is BackendKind.megatron else ()
            short = shortfall(found.plans, cfp.trial_count, tried)
            if console is not None and short is not None:
                console.print(f"cfp: {short}", markup=False)
            return {"plan": plan.to_json(), "ranked": list(ranked),
                    "calibration": hooks.calibration(measurements, found.best),
                    "trials": [dataclasses.replace(found.plans[i], cluster=job.cluster.name).to_json()
                               for i in tried],
                    "trial_labels": [found.labels[i] for i in tried],
                    "trial_calibrations": [hooks.calibration(measurements, found.plans[i]) for i in tried],
                    "budget_left_s": cfp.profile_budget_s - (time.perf_counter() - began)}

        received = searched_on_rank0(search, outcome, env, console)
        # rank 0's canonical string and hash travel inside plan.json; from_json rebuilds the plan from its fields
        # and raises a PlanError unless this rank gets the same string and hash from them
        plan = Plan.from_json(received["plan"])
        calibration = float(received["calibration"])
        if received["trials"]:
            plan, calibration = _trials(job, cfp, env, console, received, plan, calibration, on_gpu=on_gpu)
    finally:
        if not hooks.keeps_group:
            destroy_distributed()
    return LaunchPlan(plan=plan, job=job, source="planned", path=None, ranked=tuple(received["ranked"]),
                      calibration=calibration)


def _trials(job: JobSpec, cfp: CfpSpec, env: LaunchEnv, console: Any, received: dict[str, Any], plan: Plan,
            calibration: float, *, on_gpu: bool) -> tuple[Plan, float]:
    """Run the trials rank 0's search asked for (``received``) on every rank, within what profiling left of the
    budget; the measured fastest and its calibration, else ``plan`` and ``calibration`` (fewer than two finished).
    Every rank reads the same measurements (rank 0's, handed round by the trials' round), so all pick alike."""
    from cfp_megatron.backends.megatron.trials import run_trials, trial_lines, trials_table

    plans = [Plan.from_json(d) for d in received["trials"]]
    labels, calibrations = list(received["trial_labels"]), [float(c) for c in received["trial_calibrations"]]
    shown = env.rank == 0 and console is not None
    with RoundProgress(enabled=shown) as progress:
        outcome = run_trials(job, plans, calibrations=calibrations, env=env, warmup_steps=cfp.check_warmup_steps,
                             budget_s=float(received["budget_left_s"]), on_gpu=on_gpu,
                             progress=progress.update if shown else None,
                             policies=cfp.constraints.moe_token_policy)
    pick = measured_pick(outcome.measured)
    if shown:
        predicted = [p.predicted.step_time_s * c if p.predicted is not None else 0.0
                     for p, c in zip(plans, calibrations, strict=True)]
        console.print(trials_table(labels, predicted, outcome.measured, pick))
        for line in trial_lines(outcome, pick, float(received["budget_left_s"])):
            console.print(f"cfp: {line}", markup=False)
    if pick is None:
        return plan, calibration
    return picked(plans[pick], labels, outcome.measured, pick), calibrations[pick]


def coverage_lines(outcome: Any, budget_s: float, world: int, overrides: list[str]) -> list[str]:
    """What profiling measured, reused, cut off per round, and (when partial) what is missing and how to complete
    it (``outcome``: :class:`~cfp_megatron.profile.runner.ProfileOutcome` on rank 0)."""
    from cfp_megatron.profile.runner import busy_hint, completion_hint, entry_counts

    parts = []
    for r in outcome.coverage:
        state = {RoundStatus.timeout: "stopped at its budget share", RoundStatus.failed: "failed"}.get(r.status, "")
        done, total = entry_counts(r)
        said = f"{r.name} {done}/{total}"
        said += (f" ({len(r.measured)} measured, {r.reused} reused"
                 + (f", {len(r.over_memory)} over memory" if r.over_memory else "") + (f", {state}" if state else "")
                 + (", machine busy" if r.busy else "") + ")")
        parts.append(said)
    lines = [f"profile (budget {budget_s:.0f} s): " + "; ".join(parts)] if parts else []
    return lines + completion_hint(outcome, overrides, world=world) + busy_hint(outcome, overrides, world=world)
