"""``launch/train.py backend=deepspeed``: from the composed config to a DeepSpeed run.

Everything is checked before any process group exists: the layout (DeepSpeed's data parallelism spans every rank, so
``parallel`` must have no model parallelism), the ``backend`` knobs, the batch against the world size. Then the plan:

- ``+cfp=auto``: every rank takes part in the profiling rounds (the same ProfileDB as the Megatron backend), rank 0
  searches the ZeRO space (:func:`cfp_megatron.backends.deepspeed.search.search_zero`) and broadcasts the plan, and
  every rank checks its canonical string and hash;
- ``+cfp=manual cfp.plan=...`` (or ``cfp.plan_file=plan.json``): that plan (an earlier run's ``zero_plan.json``
  or DeepSpeed plan string is read too);
- no ``cfp`` group: the ``backend`` knobs as given (unset ones take DeepSpeed's defaults: stage 0, no checkpointing,
  no offload) with ``train.micro_batch_size``.

Rank 0 writes ``ds_config.json`` and ``plan.json`` into the run directory (never over a different file), and
every rank trains with that config.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from cfp_megatron.backends.deepspeed.backend import DeepSpeedBackend
from cfp_megatron.backends.deepspeed.zero_plan import ds_config, write_json_file, zero_plan
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec, cfp_from_config
from cfp_megatron.base.config import JobSpec, ParallelSpec, job_from_config, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import check_write_locations
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine import checkpoint_lock
from cfp_megatron.plan import Plan, PlanError, load_plan
from cfp_megatron.planner.deepspeed_launch import planned
from cfp_megatron.planner.deepspeed_memory import check_zero_plan_fits, check_zero_search_fits
from cfp_megatron.planner.job_checks import hydra_run_dir, validate_rest
from cfp_megatron.planner.launch_plan import write_locations
from cfp_megatron.planner.memory_fit import check_training_machine
from cfp_megatron.planner.plan_inputs import check_plan_applies

_MODEL_PARALLEL = ("tp", "pp", "cp", "ep")


def check_layout(job: JobSpec, cfp: CfpSpec) -> None:
    """Raise a ConfigError when ``parallel`` or the ``cfp`` pins ask for model parallelism DeepSpeed's data-parallel
    ZeRO does not do here."""
    p, default = job.parallel, ParallelSpec()
    issues = [ConfigIssue(key=f"parallel.{name}", value=getattr(p, name),
                          problem="the DeepSpeed backend trains data parallel (ZeRO over every rank) without model "
                                  "parallelism.",
                          fix=f"remove parallel.{name}, or train with backend=megatron.")
              for name in (*_MODEL_PARALLEL, "sp", "vpp", "mlp", "first_stage_layers", "last_stage_layers")
              if getattr(p, name) != getattr(default, name)]
    for name in (*_MODEL_PARALLEL, "vpp", "etp"):
        allowed = cfp.allowed(name) if cfp.mode is not CfpMode.off else None
        if allowed is not None and allowed != [1]:
            issues.append(ConfigIssue(key=f"cfp.{name}", value=allowed,
                                      problem="the DeepSpeed backend plans ZeRO data parallelism only.",
                                      fix=f"remove cfp.{name}, or plan with backend=megatron."))
    if job.model.is_moe:
        issues.append(ConfigIssue(key="model", value=job.model.name,
                                  problem="MoE models need expert parallelism, which the DeepSpeed backend does not "
                                          "configure.", fix="train MoE models with backend=megatron."))
    if issues:
        raise ConfigError(issues)


def manual_plan(job: JobSpec, backend: BackendSpec, world: int, *, on_gpu: bool) -> Plan:
    """The plan of the ``backend`` knobs as given (unset: stage 0, no checkpointing, no offload) and
    ``train.micro_batch_size``."""
    pins = backend.pins()
    return _plan_or_config_error(lambda: zero_plan(
        job, world=world, zero_stage=pins.get("zero_stage", 0),
        micro_batch=pins.get("micro_batch", job.train.micro_batch_size),
        activation_checkpointing=bool(pins.get("activation_checkpointing", False)),
        offload_optimizer=bool(pins.get("offload_optimizer", False)),
        offload_param=bool(pins.get("offload_param", False)), bucket_elements=backend.bucket_elements,
        precision=resolve_precision(job.train.precision, on_gpu)), "backend")


def _plan_or_config_error(build: Any, key: str) -> Plan:
    try:
        return build()
    except PlanError as err:
        raise ConfigError(ConfigIssue(key=err.setting or key, value="-", problem=err.problem,
                                      fix=err.fix or "see the problem.")) from None
    except (OSError, json.JSONDecodeError) as err:
        raise ConfigError(ConfigIssue(key=key, value="-", problem=f"the plan file cannot be read ({err}).",
                                      fix="give the plan.json a DeepSpeed launch wrote.")) from None


def train_from_config(cfg: Any, backend: BackendSpec) -> list:
    """Validate, plan (see the module docstring), write ds_config.json, train; rank 0's step metrics."""

    import torch

    from cfp_megatron.compat.cpu import install_if_needed
    from cfp_megatron.engine.checkpoint import nothing_left

    env = LaunchEnv.read()
    job = job_from_config(cfg)
    cfp = cfp_from_config(cfg)
    check_layout(job, cfp)
    validate_rest(job)
    check_training_machine(job)  # a GPU preset on a machine without a GPU
    on_gpu = torch.cuda.is_available()
    if cfp.mode is CfpMode.auto:  # no ZeRO plan fits this machine's memory: refused before profiling
        check_zero_search_fits(job, env.world_size, cfp, backend, on_gpu=on_gpu)
    run_dir = hydra_run_dir()
    say = checkpoint_lock.note_printer(env.rank)
    resume = _check_checkpoint_dir(job, restarted=env.restart_count > 0, note=say)
    ckpt = job.train.checkpoint_dir
    if resume is not None and ckpt is not None and resume >= job.train.steps:
        say(nothing_left(ckpt, resume, job.train.steps))
        if env.rank == 0:
            checkpoint_lock.release(ckpt, checkpoint_lock.held_token(ckpt))
        return []
    check_write_locations(write_locations(job, cfp, run_dir))  # before profiling, training and the first save
    lock = checkpoint_lock.acquire(ckpt) if ckpt is not None and env.rank == 0 else None
    console = Console(highlight=False, soft_wrap=True) if env.rank == 0 else None
    install_if_needed()
    check = None
    if cfp.mode is CfpMode.auto:
        plan, check = planned(job, cfp, backend, env, console, on_gpu=on_gpu)
    elif cfp.mode is CfpMode.manual and (cfp.plan or cfp.plan_file):
        plan = _plan_or_config_error(
            (lambda: Plan.parse(cfp.plan)) if cfp.plan else
            (lambda: load_plan(str(cfp.plan_file))),
            "cfp.plan" if cfp.plan else "cfp.plan_file")
        check_plan_applies(plan, job, cfp=cfp, console=console,  # the model, cluster and typed settings it fits
                           source="the plan of cfp.plan" if cfp.plan else f"the plan of cfp.plan_file={cfp.plan_file}")
    else:
        plan = manual_plan(job, backend, env.world_size, on_gpu=on_gpu)
    if plan.dp != env.world_size:
        raise ConfigError(ConfigIssue(key="cfp.plan", value=plan.canonical(),
                                      problem=f"the plan is for {plan.dp} ranks but {env.world_size} were started.",
                                      fix=f"start {plan.dp} ranks, or plan again (+cfp=auto)."))
    if cfp.mode is not CfpMode.auto:  # a plan by hand, against this machine's memory
        check_zero_plan_fits(job, plan, env.world_size)
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch_size=plan.micro_batch_size))
    config = ds_config(plan, job, base=backend.base_config())
    folder = run_dir or Path("outputs")
    if env.rank == 0:
        written = write_json_file(config, folder / "ds_config.json")
        write_json_file(plan.to_json(), folder / "plan.json")
        if console is not None:
            console.print(f"cfp: DeepSpeed plan {plan.describe()} ({plan.canonical()}); config {written}",
                          markup=False)

    metrics = job.train.metrics_file
    metrics_path = Path(metrics) if metrics else (run_dir / "metrics.jsonl" if run_dir is not None else None)
    history = DeepSpeedBackend(config=config).train(job, plan, env, backend, metrics_path=metrics_path, check=check,
                                                    resume=resume)
    if lock is not None:
        checkpoint_lock.release(ckpt, lock.token)  # a successful run gives the folder back
    return history


def _check_checkpoint_dir(job: JobSpec, *, restarted: bool, note: Callable[[str], None]) -> int | None:
    """The step to resume from, as the Megatron backend decides it (:func:`.checkpoint.check_before_start`):
    another live job's folder is refused (:mod:`.checkpoint_lock`); ``train.resume`` needs a checkpoint there (the
    pointer's, or the newest step folder that verifies); a folder holding one is refused rather than written over
    unless torchrun restarted this job (``restarted``: its own checkpoints); the checkpoint is verified and its model
    compared with this run's; no step folder the run would save into may exist unless this job wrote it."""
    from cfp_megatron.backends.deepspeed import checkpoint as ds_checkpoint  # torch: a launch only

    t = job.train
    if t.checkpoint_dir is None and t.resume:
        raise ConfigError(ConfigIssue(key="train.resume", value=True, problem="there is no train.checkpoint_dir.",
                                      fix="set train.checkpoint_dir, or train.resume=false."))
    writer = checkpoint_lock.check(t.checkpoint_dir, note=note)
    return ds_checkpoint.check_before_start(t.checkpoint_dir, resume=t.resume, restarted=restarted,
                                            trust_unverified=t.trust_unverified_checkpoint, steps=t.steps,
                                            save_interval=t.save_interval, model=job.model, writer=writer,
                                            note=note)
