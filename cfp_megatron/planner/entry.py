"""From a composed Hydra config to a finished run, the one launch pipeline of both backends: validate, check
checkpoints, plan, set up groups, train (a backend adds its hooks: :class:`~cfp_megatron.backends.protocol
.LaunchHooks`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from rich.console import Console

from cfp_megatron.base.backend_spec import backend_from_config
from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
from cfp_megatron.base.config import job_from_config, starts_with_home, tilde_issue
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import WriteLocation, check_write_locations
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.compat import moe
from cfp_megatron.compat.import_cost import import_megatron
from cfp_megatron.engine import checkpoint_lock, rank_watch
from cfp_megatron.engine.metrics import log_to_run_file
from cfp_megatron.planner import run_folder
from cfp_megatron.planner.backends import launch_hooks
from cfp_megatron.planner.hydra_args import override_value, read_hydra_args
from cfp_megatron.planner.job_checks import check_node_shape, hydra_run_dir
from cfp_megatron.planner.launch_plan import LaunchPlan, given_plan, metrics_location, searched_plan, write_locations
from cfp_megatron.planner.megatron_launch import same_optimizer_kind
from cfp_megatron.planner.memory_fit import check_training_machine
from cfp_megatron.planner.rank_errors import end_rank, report_and_exit, report_error


def train_from_config(cfg: Any) -> list:
    """The one launch pipeline of every backend (``backend``: its hooks, :func:`~cfp_megatron.planner.backends
    .launch_hooks`): read the config, check the job completely before any process group exists, check the checkpoint
    folder and every place the run writes, resolve the plan (the layout given, a plan file or string, or searched
    with profiling under ``+cfp=auto``) and check that it fits, broadcast it, configure the backend, train, report;
    rank 0's step metrics."""

    import torch

    from cfp_megatron.compat.cpu import install_if_needed

    import_megatron()  # the checks below import it: with its import costs cut (compat/import_cost.py)
    rank_watch.new_run()
    env = LaunchEnv.read()
    backend = backend_from_config(cfg)
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    hooks = launch_hooks(backend.name)
    on_gpu = torch.cuda.is_available()
    planned = cfp.mode is CfpMode.auto or (cfp.mode is CfpMode.manual and bool(cfp.plan_file or cfp.plan))
    hooks.check_job(job, cfp, env.world_size, planned=planned)  # a planned job's layout: once it has its plan
    check_node_shape(job, env)  # the cluster's shape against torchrun's: its plan and memory are the job's
    check_training_machine(job, env.world_size)  # a GPU preset without a GPU; more memory than this machine has
    t, say = job.train, checkpoint_lock.note_printer(env.rank)
    writer = checkpoint_lock.check(t.checkpoint_dir, note=say)  # another live job's folder: refused here
    start_step = hooks.check_before_start(job, restarted=env.restart_count > 0, writer=writer, note=say,
                                         backend=backend, world=env.world_size, planned=planned)
    if start_step is not None and t.checkpoint_dir is not None and start_step >= t.steps:
        from cfp_megatron.engine import checkpoint  # Megatron-Core's checkpointing: imported where used (seconds)

        say(checkpoint.nothing_left(t.checkpoint_dir, start_step, t.steps))
        if env.rank == 0:
            checkpoint_lock.release(t.checkpoint_dir, writer)
        return []
    backend = hooks.resumed_backend(job, backend, start_step, planned=planned, note=say)
    pin = hooks.resume_pin(job, cfp, start_step, planned=planned)
    run_dir = hydra_run_dir()
    metrics = metrics_location(job, run_dir)
    check_write_locations(write_locations(job, cfp, run_dir))  # before profiling, training and the first save
    console = Console(highlight=False, soft_wrap=True) if env.rank == 0 else None
    launch = given_plan(job, cfp, env, console, hooks=hooks, backend=backend, on_gpu=on_gpu)
    lock = checkpoint_lock.acquire(t.checkpoint_dir) if t.checkpoint_dir is not None and env.rank == 0 else None
    if launch is None:  # +cfp=auto: every rank profiles, rank 0 searches and broadcasts the plan
        launch = searched_plan(job, cfp, env, run_dir, console, hooks=hooks, backend=backend, optimizer_kind=pin,
                               on_gpu=on_gpu)
    if pin is not None and launch.source in ("file", "string"):  # a plan applied by hand
        same_optimizer_kind("cfp.plan_file" if cfp.plan_file else "cfp.plan",
                            launch.job.parallel.distributed_optimizer, pin)
    settled = run_folder.settle(run_dir, launch.plan.plan_hash(), env)  # outputs/<time>_<plan hash>
    if settled != run_dir and run_dir is not None and settled is not None:
        if launch.path is not None and launch.path.is_relative_to(run_dir):
            launch = dataclasses.replace(launch, path=settled / launch.path.relative_to(run_dir))
        run_dir, metrics = settled, metrics_location(job, settled)
    if launch.source != "pinned":
        _say_plan(launch, console)
    picture = str(run_dir / "plan_check.png") if console is not None and run_dir is not None else None
    job, check = hooks.plan_check(launch.job, launch.plan, cfp, calibration=launch.calibration, on_gpu=on_gpu,
                                  picture=picture)
    job, trainer = hooks.trainer(job, launch.plan, env, backend, folder=run_dir or Path("outputs"), console=console)
    install_if_needed()
    if job.model.is_moe and not transformer_engine_available():
        moe.install()
    history = trainer.train(job, launch.plan, env, backend, metrics_path=metrics.path if metrics else None,
                            check=check, resume=start_step)
    if lock is not None:
        checkpoint_lock.release(t.checkpoint_dir, lock.token)  # a successful run gives the folder back
    return history


def _say_plan(launch: LaunchPlan, console: Console | None) -> None:
    """The plan on rank 0: where it came from, the search's ranking, its prediction (also in the run's log file)."""
    if console is None:
        return
    plan = launch.plan
    where = f" ({launch.path})" if launch.path is not None else ""
    lines = [f"cfp: {launch.source} plan {plan.canonical()}{where}"]
    lines += [f"cfp:   {i}. {line}" for i, line in enumerate(launch.ranked, 1)]
    if launch.ranked and launch.calibration != 1.0:
        lines.append(f"cfp:   (step times scaled by {launch.calibration:.3f}, the median measured/predicted ratio "
                     "of earlier runs of this layout family on this profile, the profile's own prediction counted "
                     "as one)")
    if plan.predicted is not None:
        calibrated = "" if launch.calibration == 1.0 else \
            f" ({plan.predicted.step_time_s * launch.calibration * 1e3:.1f} ms calibrated by earlier runs)"
        lines.append(f"cfp: predicted {plan.predicted.step_time_s * 1e3:.1f} ms per step{calibrated}, "
                     f"{plan.predicted.peak_memory_gib:.3f} GiB peak per rank")
        if plan.predicted.analytical:
            lines.append(f"cfp: the prediction prices {', '.join(plan.predicted.analytical)} by the analytical "
                         "model: the profile has not measured them")
    for line in lines:
        console.print(line, markup=False)
    log_to_run_file(*lines)


RUN_DIR_KEY = "hydra.run.dir"
"""The Hydra key of the run directory (conf/config.yaml: ``outputs/${cfp_run_id:outputs}``, named by time and plan:
:mod:`cfp_megatron.planner.run_folder`)."""


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
            else (RUN_DIR_KEY, "outputs/", "<time>_<plan hash>")
        given, raw = override_value(args.overrides, key)
        value = None if not given else "" if raw is None else str(raw)
        if value is not None and not value.strip():
            raise ConfigError(ConfigIssue(key=key, value=raw, problem="is empty: Hydra would write the run's files "
                                          f"into the current folder ({Path.cwd()}).", fix=f"name a folder, e.g. "
                                          f"{key}={default}my_run, or leave it out for {default}{shown}."))
        if value is not None and starts_with_home(value):
            raise ConfigError(tilde_issue(key, value))
        static = default if value is None else value.split("${", 1)[0]
        folder = Path(static or ".") if value is None or "${" not in value or static.endswith("/") \
            else Path(static).parent
        check_write_locations([WriteLocation(key=key, path=folder, folder=True)])
    except ConfigError as err:
        report_error(err, LaunchEnv.read())
        end_rank(2)


def main_with_errors(cfg: Any) -> None:
    """Run :func:`train_from_config`; report a user error in one clean message per node and exit with status 2, on
    every rank only once the message is on stderr (:func:`~cfp_megatron.planner.rank_errors.report_error`). A rank
    that stopped answering (a collective timed out) and Ctrl-C are said the same way, once per job
    (:func:`~cfp_megatron.engine.rank_watch.explained`; exit status 2 and 130)."""
    try:
        train_from_config(cfg)
    except (Exception, KeyboardInterrupt) as caught:
        err = rank_watch.explained(caught)
        log_to_run_file(f"{type(err or caught).__name__}: {err or caught}")
        run_folder.end_failed(hydra_run_dir(), err or caught, LaunchEnv.read())  # no folder that looks like a run
        if err is None:
            raise
        report_and_exit(err, LaunchEnv.read())
