"""From a composed Hydra config to a finished run: validate, check checkpoints, set up groups, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console

from cfp_megatron.base.backend_spec import backend_from_config
from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import WriteLocation, check_write_locations
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.compat import moe
from cfp_megatron.engine import checkpoint_lock, rank_watch
from cfp_megatron.plan.check import PlanCheck, with_breakdown
from cfp_megatron.planner.backends import backend_for
from cfp_megatron.planner.deepspeed_entry import train_from_config as train_deepspeed
from cfp_megatron.planner.hydra_args import override_value, read_hydra_args
from cfp_megatron.planner.job_checks import hydra_run_dir, validate_job, validate_rest
from cfp_megatron.planner.launch_plan import resolve_launch_plan, write_locations
from cfp_megatron.planner.memory_fit import check_layout_fits, check_training_machine
from cfp_megatron.planner.rank_errors import report_and_exit, report_error
from cfp_megatron.profile.fingerprint import model_key

if TYPE_CHECKING:
    from cfp_megatron.base.cfp_spec import CfpSpec
    from cfp_megatron.plan.check import PlanCheck
    from cfp_megatron.planner.launch_plan import LaunchPlan


def train_from_config(cfg: Any) -> list:
    """Validate ``cfg`` completely before any process group exists, plan when the ``cfp`` group asks for it, then
    train; return rank 0's step metrics. ``backend=deepspeed`` hands the job to
    :mod:`cfp_megatron.planner.deepspeed_entry`."""

    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine import checkpoint

    backend = backend_from_config(cfg)
    if backend.is_deepspeed:
        return train_deepspeed(cfg, backend)

    env = LaunchEnv.read()
    job = job_from_config(cfg)
    cfp = cfp_from_config(cfg)
    planned = cfp.mode is CfpMode.auto or (cfp.mode is CfpMode.manual and (cfp.plan_file or cfp.plan))
    if planned:
        validate_rest(job)  # the layout comes from the plan
    else:
        validate_job(job, env.world_size)
    check_training_machine(job)  # a GPU preset on a machine without a GPU
    if not planned:
        check_layout_fits(job, env.world_size)  # a layout by hand, against this machine's memory
    t, say = job.train, checkpoint_lock.note_printer(env.rank)
    writer = checkpoint_lock.check(t.checkpoint_dir, note=say)  # another live job's folder: refused here
    start_step = checkpoint.check_before_start(t.checkpoint_dir, resume=t.resume, restarted=env.restart_count > 0,
                                               trust_unverified=t.trust_unverified_checkpoint, steps=t.steps,
                                               save_interval=t.save_interval, model=job.model, writer=writer,
                                               note=say)
    if start_step is not None and t.checkpoint_dir is not None and start_step >= t.steps:
        say(checkpoint.nothing_left(t.checkpoint_dir, start_step, t.steps))
        if env.rank == 0:
            checkpoint_lock.release(t.checkpoint_dir, writer)
        return []
    saved_dopt = None
    if start_step is not None and job.train.checkpoint_dir is not None:
        saved_dopt = checkpoint.saved_distributed_optimizer(job.train.checkpoint_dir, start_step)
        if not planned:
            _same_optimizer_kind("parallel.distributed_optimizer", job.parallel.distributed_optimizer, saved_dopt)
        elif cfp.mode is CfpMode.auto and cfp.distributed_optimizer is not None:  # else auto pins the saved kind
            _same_optimizer_kind("cfp.distributed_optimizer", cfp.distributed_optimizer, saved_dopt)
    run_dir = hydra_run_dir()
    if job.train.metrics_file is not None:
        metrics_path: Path | None = Path(job.train.metrics_file)
    else:
        metrics_path = run_dir / "metrics.jsonl" if run_dir is not None else None
    check_write_locations(write_locations(job, cfp, run_dir))  # before profiling, training and the first save
    lock = checkpoint_lock.acquire(t.checkpoint_dir) if t.checkpoint_dir is not None and env.rank == 0 else None

    install_if_needed()
    if job.model.is_moe and not transformer_engine_available():
        moe.install()

    console = Console(highlight=False, soft_wrap=True) if env.rank == 0 else None
    launch = resolve_launch_plan(job, cfp, env, run_dir, console, optimizer_kind=saved_dopt)
    check = None
    if launch is not None:
        job, check = _with_plan(launch, cfp, console)
        if check is not None and console is not None and run_dir is not None:  # rank 0 draws the check's picture
            check = with_breakdown(check, job, env.world_size, str(run_dir / "plan_check.png"))
        if saved_dopt is not None:  # a plan applied by hand
            _same_optimizer_kind("cfp.plan_file" if cfp.plan_file else "cfp.plan", job.parallel.distributed_optimizer,
                                 saved_dopt)
    validate_job(job, env.world_size)
    if launch is not None and launch.source in ("file", "string"):  # a plan this machine's search did not make
        check_layout_fits(job, env.world_size)
    history = backend_for(backend.name).train(job, None, env, backend, metrics_path=metrics_path, check=check,
                                              resume=start_step)
    if lock is not None:
        checkpoint_lock.release(t.checkpoint_dir, lock.token)  # a successful run gives the folder back
    return history


def _same_optimizer_kind(key: str, value: bool, saved: bool) -> None:
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


def _with_plan(launch: LaunchPlan, cfp: CfpSpec, console: Console | None) -> tuple[JobSpec, PlanCheck | None]:
    """The planned job (the memory measured on the checked step unless ``train.memory_step`` is set), the check of
    its first steps, and the plan said on rank 0."""

    import dataclasses

    import torch

    job, plan = launch.job, launch.plan
    if console is not None:
        where = f" ({launch.path})" if launch.path is not None else ""
        console.print(f"cfp: {launch.source} plan {plan.canonical()}{where}", markup=False)
        for i, line in enumerate(launch.ranked, 1):
            console.print(f"cfp:   {i}. {line}", markup=False)
        if launch.ranked and launch.calibration != 1.0:
            console.print(f"cfp:   (step times scaled by {launch.calibration:.3f}, the median measured/predicted ratio "
                          "of earlier runs of this layout family on this profile, the profile's own prediction "
                          "counted as one)", markup=False)
        if plan.predicted is not None:
            calibrated = "" if launch.calibration == 1.0 else \
                f" ({plan.predicted.step_time_s * launch.calibration * 1e3:.1f} ms calibrated by earlier runs)"
            console.print(f"cfp: predicted {plan.predicted.step_time_s * 1e3:.1f} ms per step{calibrated}, "
                          f"{plan.predicted.peak_memory_gib:.3f} GiB peak per rank", markup=False)
            if plan.predicted.analytical:
                console.print(f"cfp: the prediction prices {', '.join(plan.predicted.analytical)} by the analytical "
                              "model: the profile has not measured them", markup=False)
    if plan.predicted is None or cfp.check_after_steps == 0:
        return job, None
    steps = min(cfp.check_after_steps, job.train.steps)  # a shorter run is checked at its last step
    if job.train.memory_step is None:
        job = dataclasses.replace(job, train=dataclasses.replace(job.train, memory_step=steps))
    check = PlanCheck(plan=plan.canonical(), model_key=model_key(job, on_gpu=torch.cuda.is_available()),
                      after_steps=steps, warmup_steps=cfp.check_warmup_steps,
                      predicted_step_s=plan.predicted.step_time_s, calibration=launch.calibration,
                      predicted_peak_bytes=plan.predicted.peak_memory_gib * 2**30,
                      analytical=plan.predicted.analytical)
    return job, check


RUN_DIR_KEY = "hydra.run.dir"
"""The Hydra key of the run directory (conf/config.yaml: ``outputs/${cfp_run_id:}``)."""


SWEEP_DIR_KEY = "hydra.sweep.dir"
"""The Hydra key of a multirun's (``-m``) folder (Hydra's default: ``multirun/<date>/<time>``)."""


def check_run_dir_arg(argv: list[str]) -> None:
    """Before Hydra starts (it creates the run directory and writes its files there, with a traceback when it
    cannot): report a ``hydra.run.dir`` override (``hydra.sweep.dir`` under ``-m``), or the default ``outputs/``
    (``multirun/``), that is empty or cannot be written in one clean message and exit with status 2. An empty or
    blank one is refused (Hydra would write into the current folder); its part before the first ``${``
    interpolation is checked (created when missing, a temporary file written and removed)."""
    try:
        args = read_hydra_args(argv)
        key, default, shown = (SWEEP_DIR_KEY, "multirun/", "<date>/<time>") if args.multirun \
            else (RUN_DIR_KEY, "outputs/", "<run id>")
        given, raw = override_value(args.overrides, key)
        value = None if not given else "" if raw is None else str(raw)
        if value is not None and not value.strip():
            raise ConfigError(ConfigIssue(key=key, value=raw, problem="is empty: Hydra would write the run's files "
                                          f"into the current folder ({Path.cwd()}).", fix=f"name a folder, e.g. "
                                          f"{key}={default}my_run, or leave it out for {default}{shown}."))
        static = default if value is None else value.split("${", 1)[0]
        folder = Path(static or ".") if value is None or "${" not in value or static.endswith("/") \
            else Path(static).parent
        check_write_locations([WriteLocation(key=key, path=folder, folder=True)])
    except ConfigError as err:
        report_error(err, LaunchEnv.read())
        sys.exit(2)


def main_with_errors(cfg: Any) -> None:
    """Run :func:`train_from_config`; report a user error in one clean message per node and exit with status 2, on
    every rank only once the message is on stderr (:func:`~cfp_megatron.planner.rank_errors.report_error`). A rank
    that stopped answering (a collective timed out) and Ctrl-C are said the same way, once per job
    (:func:`~cfp_megatron.engine.rank_watch.explained`; exit status 2 and 130)."""
    try:
        train_from_config(cfg)
    except (Exception, KeyboardInterrupt) as caught:
        err = rank_watch.explained(caught)
        if err is None:
            raise
        report_and_exit(err, LaunchEnv.read())
