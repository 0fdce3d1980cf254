"""What the DeepSpeed backend checks of a launch (``launch/train.py backend=deepspeed``) before any process group
exists: the layout (DeepSpeed's data parallelism spans every rank, so ``parallel`` and the ``cfp`` pins must have no
model parallelism), its checkpoint folder, and the plan of the ``backend`` knobs as given (unset ones take
DeepSpeed's defaults: stage 0, no checkpointing, no offload) with ``train.micro_batch_size``. The launch itself is
the one pipeline of both backends (:mod:`cfp_megatron.planner.entry`) with DeepSpeed's hooks
(:mod:`cfp_megatron.planner.deepspeed_launch`): ``+cfp=auto`` profiles, probes the engine and searches the ZeRO
space; ``+cfp=manual cfp.plan=...`` (or ``cfp.plan_file=plan.json``) applies that plan (an earlier run's
``zero_plan.json`` or DeepSpeed plan string is read too); rank 0 writes ``ds_config.json`` and ``plan.json`` into
the run directory (never over a different file).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Callable
from typing import Any

from cfp_megatron.backends.deepspeed.zero_plan import zero_plan
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpMode, CfpSpec
from cfp_megatron.base.config import JobSpec, ParallelSpec, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.plan import Plan, PlanError

_MODEL_PARALLEL = ("tp", "pp", "cp", "ep")

_MEGATRON_KNOBS = {
    "sp": "DeepSpeed's data parallelism has no sequence parallelism",
    "mlp": "DeepSpeed trains the dense MLP unpartitioned",
    "recompute": "pin DeepSpeed's activation checkpointing (whole layers) with backend.activation_checkpointing="
                 "true|false",
    "distributed_optimizer": "pin the ZeRO stage with backend.zero_stage (0: no sharding, 1-3 shard the optimizer "
                             "states)",
    "fsdp": "pin the ZeRO stage with backend.zero_stage (3 partitions the parameters too)",
}
"""The ``cfp`` knobs of Megatron-Core's search the ZeRO search does not read, with what to set instead."""


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
    for name, instead in _MEGATRON_KNOBS.items() if cfp.mode is not CfpMode.off else ():
        allowed = cfp.allowed(name)
        if allowed is None:
            continue
        key = f"cfp.{name}" if getattr(cfp, name) is not None else f"cfp.constraints.{name}"
        issues.append(ConfigIssue(key=key, value=[v.value if isinstance(v, enum.Enum) else v for v in allowed],
                                  problem="is a knob of Megatron-Core's layouts, which the DeepSpeed backend's ZeRO "
                                          "search does not read: it would be ignored.",
                                  fix=f"remove {key}; {instead}, or plan with backend=megatron."))
    for name in ("precision", "fp8_recipe") if cfp.mode is not CfpMode.off else ():
        allowed = getattr(cfp.constraints, name)
        if allowed is not None:
            issues.append(ConfigIssue(key=f"cfp.constraints.{name}", value=[v.value for v in allowed],
                                      problem="is a set of number formats for Megatron-Core's search; the DeepSpeed "
                                              "backend trains in train.precision: it would be ignored.",
                                      fix=f"remove cfp.constraints.{name} (set train.precision), or plan with "
                                          "backend=megatron."))
    fmt = NumberFormat.of(job.train)
    if fmt.low:
        issues.append(ConfigIssue(key="train.precision", value=job.train.precision.value,
                                  problem=f"{fmt.name} runs the GEMMs through Transformer Engine's layers in "
                                          "Megatron-Core; the DeepSpeed backend trains the model's own layers in 16 "
                                          "or 32 bits.",
                                  fix="use train.precision=bf16 with backend=deepspeed, or train "
                                      f"{' '.join(fmt.overrides())} with backend=megatron."))
    if cfp.mode is CfpMode.auto and (cfp.trial_count or 0) > 1:
        issues.append(ConfigIssue(key="cfp.trials", value=cfp.trials,
                                  problem="trials train Megatron-Core layouts at launch; the DeepSpeed backend's ZeRO "
                                          "plans are not tried: it would be ignored.",
                                  fix="remove cfp.trials (or set cfp.trials=0), or plan with backend=megatron."))
    if cfp.mode is not CfpMode.off and cfp.overlap is not None:
        issues.append(ConfigIssue(key="cfp.overlap", value=cfp.overlap,
                                  problem="sets Megatron-Core's communication overlaps, which the DeepSpeed backend "
                                          "does not run: it would be ignored.",
                                  fix="remove cfp.overlap (DeepSpeed's overlap_comm is a key of its own config, "
                                      "backend.config_file), or plan with backend=megatron."))
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


def check_checkpoint_dir(job: JobSpec, *, restarted: bool, writer: str | None, note: Callable[[str], None],
                         backend: BackendSpec | None = None, world: int | None = None,
                         on_gpu: bool = False, planned: bool = False) -> int | None:
    """The step to resume from, as the Megatron backend decides it (:func:`.checkpoint.check_before_start`; the
    folder's lock is checked before, ``writer`` its token where this job holds it): ``train.resume`` needs a
    checkpoint there (the pointer's, or the newest step folder that verifies); a folder holding one is refused rather
    than written over unless torchrun restarted this job (``restarted``: its own checkpoints); the checkpoint is
    verified, its model compared with this run's and its saved state (precision, ZeRO stage, data-parallel size)
    with what ``backend`` on ``world`` ranks trains with, where known before the plan (a stage left to the search
    is compared when the plan loads it); no step folder the run would save into may exist unless this job wrote
    it."""
    from cfp_megatron.backends.deepspeed import checkpoint as ds_checkpoint  # torch: a launch only

    t = job.train
    if t.checkpoint_dir is None and t.resume:
        raise ConfigError(ConfigIssue(key="train.resume", value=True, problem="there is no train.checkpoint_dir.",
                                      fix="set train.checkpoint_dir, or train.resume=false."))
    pins = backend.pins() if backend is not None else {}
    stage = pins.get("zero_stage", None if planned or backend is None else 0)  # a hand plan's default: stage 0
    state = ds_checkpoint.training_state(resolve_precision(t.precision, on_gpu), stage, world, job.data)
    return ds_checkpoint.check_before_start(t.checkpoint_dir, resume=t.resume, restarted=restarted,
                                            trust_unverified=t.trust_unverified_checkpoint, steps=t.steps,
                                            save_interval=t.save_interval, model=job.model, state=state,
                                            writer=writer, note=note)
