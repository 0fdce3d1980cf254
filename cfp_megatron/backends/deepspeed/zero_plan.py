"""A DeepSpeed plan: a :class:`~cfp_megatron.plan.artifact.Plan` with ``backend=deepspeed`` and its ZeRO options
(:class:`~cfp_megatron.base.backend_spec.ZeroSpec`), built by :func:`zero_plan`; the ``ds_config.json`` that runs
it (:func:`ds_config`); the job its model is simulated and built as (:func:`model_job`).

Its canonical string is the Plan's, with the backend and the ZeRO options after the precision::

    gpt_tiny@localx1x4:tp=1,...,dp=4,mb=2,gbs=8,seq=64,...,rc=full,...,do=1,...,prec=fp32,backend=deepspeed,zero=2,
    oopt=0,oparam=0,bucket=50000000
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from cfp_megatron.base.backend_spec import ZeroSpec
from cfp_megatron.base.config import JobSpec, LRSchedule, OptimizerKind, Precision
from cfp_megatron.base.files import write_new
from cfp_megatron.plan.artifact import Plan, PlanPrediction
from cfp_megatron.plan.errors import PlanError
from cfp_megatron.plan.exports import deepspeed_config


def zero_plan(job: JobSpec, *, world: int, zero_stage: int, micro_batch: int, activation_checkpointing: bool,
              offload_optimizer: bool, offload_param: bool, bucket_elements: int, precision: Precision,
              predicted: PlanPrediction | None = None) -> Plan:
    """The DeepSpeed plan of ``job`` on ``world`` data-parallel ranks with the given knobs (a ConfigError naming
    the ``backend`` key for knobs that do not go together, a PlanError for a batch they do not split)."""
    if job.train.global_batch_size % (micro_batch * world):
        raise PlanError(f"train.global_batch_size={job.train.global_batch_size} is not a multiple of micro-batch "
                        f"{micro_batch} x {world} data-parallel ranks.",
                        fix="pick a micro-batch size that divides global batch / ranks.",
                        setting="train.global_batch_size")
    zero = ZeroSpec(stage=zero_stage, offload_optimizer=offload_optimizer, offload_param=offload_param,
                    bucket_elements=bucket_elements)
    return Plan.for_deepspeed(job, world=world, zero=zero, micro_batch=micro_batch,
                              activation_checkpointing=activation_checkpointing, precision=precision,
                              predicted=predicted)


def ds_config(plan: Plan, job: JobSpec, *, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config that runs ``plan`` for ``job``: ``base`` (a user's config, copied) with the batch,
    ZeRO, offload, precision, clipping, optimizer and LR-schedule keys set. Keys of ``base`` the plan does not
    choose are kept; a user's own ``optimizer`` or ``scheduler`` section is kept as well."""
    t = job.train
    config = json.loads(json.dumps(base or {}))
    planned = deepspeed_config(plan, gradient_clipping=t.clip_grad)
    zero: dict[str, Any] = dict(config.get("zero_optimization") or {})
    zero = {k: v for k, v in zero.items() if v != "auto"}
    if plan.zero_stage != 3:
        zero.pop("offload_param", None)
    config.update(planned)
    config["zero_optimization"] = {**zero, **planned["zero_optimization"]}
    config["steps_per_print"] = 10**9  # the trainer logs each step itself
    if "optimizer" not in config:
        kind = "AdamW" if t.optimizer is OptimizerKind.adam else "SGD"
        params: dict[str, Any] = {"lr": t.lr, "weight_decay": t.weight_decay}
        if t.optimizer is OptimizerKind.adam:
            params.update(betas=[t.adam_beta1, t.adam_beta2], eps=t.adam_eps)
            # torch's AdamW without the CPU/fused builds (ZeRO-Offload uses DeepSpeedCPUAdam whatever this says)
            params["torch_adam"] = not plan.offload_optimizer
        config["optimizer"] = {"type": kind, "params": params}
    if "scheduler" not in config:
        config["scheduler"] = _scheduler(job)
    return config


def _scheduler(job: JobSpec) -> dict[str, Any]:
    """DeepSpeed's LR schedule closest to ``train``'s: linear warm-up, then cosine, linear or constant."""
    t = job.train
    decay = max(t.lr_decay_steps or t.steps, t.warmup_steps + 1)
    if t.lr_schedule is LRSchedule.cosine:
        # DeepSpeed's cosine schedule needs a warm-up step: without warm-up it is one step at the full rate.
        return {"type": "WarmupCosineLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": max(t.warmup_steps, 1),
            "warmup_min_ratio": 0.0 if t.warmup_steps else 1.0,
            "warmup_type": "linear", "cos_min_ratio": t.min_lr / t.lr if t.lr else 0.0}}
    if t.lr_schedule is LRSchedule.linear:
        return {"type": "WarmupDecayLR", "params": {
            "total_num_steps": decay, "warmup_num_steps": t.warmup_steps, "warmup_min_lr": 0.0,
            "warmup_max_lr": t.lr, "warmup_type": "linear"}}
    return {"type": "WarmupLR", "params": {"warmup_num_steps": t.warmup_steps, "warmup_min_lr": 0.0,
                                           "warmup_max_lr": t.lr, "warmup_type": "linear"}}


def write_json_file(config: dict[str, Any], path: Path) -> Path:
    """Write ``config`` (ds_config.json, plan.json) as JSON to ``path`` and return where it went. A file
    already there is never overwritten:
    one with the same content is reused, otherwise ``<stem>-<hash><suffix>`` next to it is written."""
    text = json.dumps(config, indent=2, sort_keys=True) + "\n"
    path = Path(path)
    for target in (path, path.with_name(f"{path.stem}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
                                        f"{path.suffix}")):
        if target.exists() and target.read_text() == text:
            return target
        try:
            return write_new(target, text, key="hydra.run.dir")  # a refused write: one FileWriteError naming it
        except FileExistsError:
            continue
    raise PlanError(f"{path} and its hashed sibling exist with other content.", fix="choose another run directory.",
                    setting="hydra.run.dir")


def model_job(plan: Plan, job: JobSpec) -> JobSpec:
    """``job`` as the Megatron-Core model under ``plan`` is built and simulated: the plan's layout (no model
    parallelism: DeepSpeed's data parallelism spans every rank; full per-layer recomputation where the plan
    checkpoints activations), micro-batch, global batch and (resolved) precision."""
    applied = plan.apply(job)
    return dataclasses.replace(applied, train=dataclasses.replace(applied.train, precision=Precision(plan.precision)))
