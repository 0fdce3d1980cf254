"""The user's DeepSpeed config as the ``deepspeed.initialize`` hook reads it
(:mod:`cfp_megatron.backends.deepspeed.hook_plan`).

A dict or a JSON path, read and never written. What it leaves as ``"auto"`` is planned
(``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``zero_optimization.stage`` and the offload
devices, with ``train_batch_size`` the global batch); a concrete value pins its knob; a knob it does not mention keeps
DeepSpeed's default. Bad values are a :class:`~cfp_megatron.base.errors.ConfigError` naming the key, the value and the
fix, raised before anything is built.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

from cfp_megatron.base.backend_spec import config_settings
from cfp_megatron.base.cfp_spec import SearchConstraints
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.plan.artifact import Plan

MAX_MICRO_BATCH: int = SearchConstraints.max_micro_batch
"""Largest micro-batch the search tries (``cfp.constraints.max_micro_batch``'s default)."""

DEEPSPEED_PERSISTENCE_THRESHOLD = 100_000
"""DeepSpeed's default ``stage3_param_persistence_threshold`` (``DeepSpeedZeroConfig.param_persistence_threshold``
in ``deepspeed/runtime/zero/config.py``; tests/test_deepspeed_plan.py checks it against the installed DeepSpeed):
parameters of at most that many elements stay whole on every rank under ZeRO-3: what a user's config that sets
none runs with (an exported plan sets its own, :data:`~cfp_megatron.plan.exports.ZERO3_PERSISTENCE_THRESHOLD`)."""

DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
"""DeepSpeed's default ``reduce_bucket_size`` (used where the config sets none)."""


PROBE_OPTIMIZER: dict[str, Any] = {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}
"""The engine probes' optimizer where the user's config names none (the user's own optimizer object, if any, is
bound to the user's parameters): torch's AdamW, which needs no compiled DeepSpeed op."""

PROBE_LEFT_OUT = ("tensorboard", "wandb", "csv_monitor", "comet", "flops_profiler", "comms_logger", "autotuning",
                  "wall_clock_breakdown")
"""Keys of the user's config the engine probes leave out: monitors and profilers would write its logs or print."""

_PLANNED_PATHS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "zero_optimization.stage", "zero_optimization.offload_optimizer",
                  "zero_optimization.offload_optimizer.device", "zero_optimization.offload_param",
                  "zero_optimization.offload_param.device")


@dataclass(frozen=True, kw_only=True)
class HookRequest:
    """What a user's DeepSpeed config asks the hook to plan, checked against the world size."""

    config: dict[str, Any]
    """The user's config (a copy)."""
    world: int
    """Data-parallel ranks (every rank)."""
    global_batch: int
    """Sequences per optimizer step (``train_batch_size``)."""
    micro_batches: tuple[int, ...]
    """Micro-batch sizes to try, ascending."""
    pins: dict[str, Any]
    """Fixed knobs, keys of :data:`~cfp_megatron.base.backend_spec.PLANNED_KEYS` (activation checkpointing
    always ``False``)."""
    planned: tuple[str, ...]
    """The config keys that said ``"auto"``."""
    precision: str
    """``fp32``, ``bf16`` or ``fp16``, from the config's ``bf16`` / ``fp16`` sections."""
    bucket_elements: int
    """``zero_optimization.reduce_bucket_size`` (DeepSpeed's default where unset)."""
    persistence_threshold: int
    """``zero_optimization.stage3_param_persistence_threshold`` (DeepSpeed's default where unset)."""


def auto_paths(config: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every ``"auto"`` value in ``config``."""
    if config == "auto":
        return [prefix]
    if isinstance(config, dict):
        return [p for k, v in config.items() for p in auto_paths(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(config, list):
        return [p for i, v in enumerate(config) for p in auto_paths(v, f"{prefix}[{i}]")]
    return []


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def plan_request(config: dict[str, Any], world: int) -> HookRequest | None:
    """What ``config`` asks to plan on ``world`` ranks; ``None`` when it holds no ``"auto"`` (it then passes through
    unplanned). Raises a :class:`ConfigError` naming each bad key, its value and the fix, before any work."""
    planned = auto_paths(config)
    if not planned:
        return None
    issues = [ConfigIssue(key=f"config.{path}", value="auto", problem="is not a setting the cfp hook plans.",
                          fix="set a value; the hook plans train_micro_batch_size_per_gpu, "
                              "gradient_accumulation_steps, zero_optimization.stage and the offload devices.")
              for path in planned if path not in _PLANNED_PATHS]
    zero = config.get("zero_optimization", {})
    if not isinstance(zero, dict):
        issues.append(ConfigIssue(key="config.zero_optimization", value=zero, problem="is not a JSON object.",
                                  fix='write e.g. {"stage": "auto"}.'))
        zero = {}
    pins = _zero_pins(config, zero, issues)
    batch: dict[str, int | str | None] = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        value = config.get(key)
        if value is not None and value != "auto" and not _positive_int(value):
            issues.append(ConfigIssue(key=f"config.{key}", value=value, problem="is not a positive integer.",
                                      fix='use a positive integer or "auto".'))
            value = None
        batch[key] = value
    if world < 1:
        issues.append(ConfigIssue(key="WORLD_SIZE", value=world, problem="is not a number of ranks.",
                                  fix="start the ranks with torchrun or the deepspeed launcher."))
    if issues:
        raise ConfigError(issues)
    tbs, micro = _batch_sizes(batch, world)
    if len(micro) == 1:
        pins["micro_batch"] = micro[0]
    bf16, fp16 = (config.get(k) or {} for k in ("bf16", "fp16"))
    precision = "bf16" if isinstance(bf16, dict) and bf16.get("enabled") is True else (
        "fp16" if isinstance(fp16, dict) and fp16.get("enabled") is True else "fp32")
    bucket = zero.get("reduce_bucket_size")
    threshold = zero.get("stage3_param_persistence_threshold")
    return HookRequest(config=copy.deepcopy(config), world=world, global_batch=tbs, micro_batches=tuple(micro),
                       pins=pins, planned=tuple(planned), precision=precision,
                       bucket_elements=int(bucket) if _positive_int(bucket) else DEEPSPEED_BUCKET_ELEMENTS,
                       persistence_threshold=int(threshold) if isinstance(threshold, int)
                       else DEEPSPEED_PERSISTENCE_THRESHOLD)


def _zero_pins(config: dict[str, Any], zero: dict[str, Any], issues: list[ConfigIssue]) -> dict[str, Any]:
    """The stage and offload pins of ``config`` (absent: DeepSpeed's defaults, stage 0 and no offload; ``"auto"``:
    not pinned), with activation checkpointing pinned off; problems go to ``issues``."""
    settings = config_settings(config)
    stage = settings["zero_stage"]
    pins: dict[str, Any] = {"activation_checkpointing": False}
    if stage is not None and stage != "auto" and (isinstance(stage, bool) or stage not in (0, 1, 2, 3)):
        issues.append(ConfigIssue(key="config.zero_optimization.stage", value=stage, problem="is not a ZeRO stage.",
                                  fix='use 0, 1, 2, 3 or "auto".'))
        return pins
    if stage != "auto":
        pins["zero_stage"] = 0 if stage is None else stage
    for key in ("offload_optimizer", "offload_param"):
        section = zero.get(key)
        device = section.get("device") if isinstance(section, dict) else section
        if section is not None and device not in ("auto", "cpu", "nvme", "none", None):
            issues.append(ConfigIssue(key=f"config.zero_optimization.{key}.device", value=device,
                                      problem="is not an offload device.", fix='use "cpu", "nvme", "none" or "auto".'))
        elif settings[key] != "auto":
            pins[key] = bool(settings[key])
    stage = pins.get("zero_stage")
    if pins.get("offload_param") and stage is not None and stage != 3:
        issues.append(ConfigIssue(key="config.zero_optimization.offload_param", value=zero.get("offload_param"),
                                  problem=f"parameter offload needs ZeRO stage 3, and the config pins stage {stage}.",
                                  fix='set zero_optimization.stage to 3 or "auto", or offload_param\'s device to '
                                      '"none".'))
    if pins.get("offload_optimizer") and stage == 0:
        issues.append(ConfigIssue(key="config.zero_optimization.offload_optimizer",
                                  value=zero.get("offload_optimizer"),
                                  problem="optimizer offload needs ZeRO stage 1-3, and the config pins stage 0 (or "
                                          "leaves it at DeepSpeed's default, 0).",
                                  fix='set zero_optimization.stage to 1, 2, 3 or "auto".'))
    return pins


def _batch_sizes(batch: dict[str, int | str | None], world: int) -> tuple[int, list[int]]:
    """The global batch and the micro-batch sizes to try from ``batch``'s ``train_batch_size``,
    ``train_micro_batch_size_per_gpu`` and ``gradient_accumulation_steps`` (each a positive integer, ``"auto"``, or
    ``None`` where absent), as DeepSpeed relates them: ``train_batch_size = micro-batch x accumulation x ranks``."""
    def concrete(key: str) -> int | None:
        value = batch[key]
        return value if isinstance(value, int) else None

    tbs, mb, ga = (concrete(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                         "gradient_accumulation_steps"))
    if tbs is None:
        if mb is None or ga is None:
            raise ConfigError(ConfigIssue(
                key="config.train_batch_size", value=batch["train_batch_size"] or "(absent)",
                problem="the global batch is needed to plan the micro-batch and accumulation, and "
                        "train_micro_batch_size_per_gpu / gradient_accumulation_steps do not give it.",
                fix=f"set train_batch_size to the global batch (a multiple of the {world} ranks), or pin both "
                    f"train_micro_batch_size_per_gpu and gradient_accumulation_steps."))
        tbs = mb * ga * world
    if tbs % world:
        raise ConfigError(ConfigIssue(key="config.train_batch_size", value=tbs,
                                      problem=f"is not a multiple of the {world} data-parallel ranks.",
                                      fix=f"use a multiple of {world}, or start another number of ranks."))
    per_rank = tbs // world
    if mb is not None and per_rank % mb:
        raise ConfigError(ConfigIssue(key="config.train_micro_batch_size_per_gpu", value=mb,
                                      problem=f"does not divide the {per_rank} sequences per rank per step "
                                              f"(train_batch_size={tbs} over {world} ranks).",
                                      fix=f'use a divisor of {per_rank}, or "auto".'))
    if ga is not None:
        if per_rank % ga or (mb is not None and mb * ga != per_rank):
            with_mb = f" with train_micro_batch_size_per_gpu={mb}." if mb is not None else \
                f" ({per_rank} sequences per rank)."
            raise ConfigError(ConfigIssue(key="config.gradient_accumulation_steps", value=ga,
                                          problem=f"contradicts train_batch_size={tbs} on {world} ranks{with_mb}",
                                          fix='make train_batch_size = micro-batch x accumulation x ranks, or set '
                                              'one of them to "auto".'))
        return tbs, [per_rank // ga]
    if mb is not None:
        return tbs, [mb]
    if batch["train_micro_batch_size_per_gpu"] is None and batch["gradient_accumulation_steps"] is None:
        return tbs, [per_rank]  # DeepSpeed's default: one micro-batch per step
    return tbs, [m for m in range(1, min(per_rank, MAX_MICRO_BATCH) + 1) if per_rank % m == 0]


def filled_config(request: HookRequest, plan: Plan) -> dict[str, Any]:
    """The user's config with the plan's values in place of ``"auto"`` (other keys kept; the batch keys set so
    that ``train_batch_size = micro-batch x accumulation x ranks``)."""
    config = copy.deepcopy(request.config)
    config["train_batch_size"] = plan.global_batch_size
    config["train_micro_batch_size_per_gpu"] = plan.micro_batch_size
    config["gradient_accumulation_steps"] = plan.gradient_accumulation_steps
    zero = dict(config.get("zero_optimization") or {})
    zero["stage"] = plan.zero_stage
    for key, on in (("offload_optimizer", plan.offload_optimizer), ("offload_param", plan.offload_param)):
        section = zero.get(key)
        if section == "auto":
            section = {"device": "cpu" if on else "none"}
        elif isinstance(section, dict) and section.get("device") == "auto":
            section = {**section, "device": "cpu" if on else "none"}
        else:
            continue
        if key == "offload_param" and plan.zero_stage != 3:
            zero.pop(key)
        else:
            zero[key] = section
    config["zero_optimization"] = zero
    return config


def probe_config(request: HookRequest, stage: int) -> dict[str, Any]:
    """The config of the engine probe of ZeRO ``stage``: the user's (its precision and other keys kept, monitors
    and profilers left out, :data:`PROBE_LEFT_OUT`) at micro-batch 1 and one accumulation step, without offload,
    with the user's optimizer section or :data:`PROBE_OPTIMIZER`."""
    config = {k: copy.deepcopy(v) for k, v in request.config.items() if k not in PROBE_LEFT_OUT}
    config.update(train_batch_size=request.world, train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1,
                  steps_per_print=10**9)
    zero = {k: v for k, v in (config.get("zero_optimization") or {}).items()
            if k not in ("offload_optimizer", "offload_param")}
    zero["stage"] = stage
    config["zero_optimization"] = zero
    config.setdefault("optimizer", copy.deepcopy(PROBE_OPTIMIZER))
    return config
