"""The ``backend`` config group: which engine trains (``backend=megatron`` or ``backend=deepspeed``) and the
DeepSpeed knobs a user pins by hand (``backend.zero_stage=2``); ``null`` leaves a knob to the planner under
``+cfp=auto`` (and to DeepSpeed's default without it)."""

from __future__ import annotations

import base64
import copy
import dataclasses
import enum
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from cfp_megatron.base.config import LayoutKey, build_spec, layout_field, plain_config
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import json_loads_unique, read_user_file


class BackendKind(enum.Enum):
    """The engine that trains."""

    megatron = "megatron"
    """Megatron-Core's DDP, optimizer and pipeline schedules (:mod:`cfp_megatron.backends.megatron.trainer`)."""
    deepspeed = "deepspeed"
    """``deepspeed.initialize`` with a planned ZeRO configuration (:mod:`cfp_megatron.backends.deepspeed.trainer`)."""


ZERO_STAGES = (0, 1, 2, 3)
"""ZeRO stages: 0 plain data parallelism, 1 optimizer states, 2 and gradients, 3 and parameters partitioned."""

PLANNED_KEYS = ("zero_stage", "micro_batch", "activation_checkpointing", "offload_optimizer", "offload_param")
"""The knobs the DeepSpeed planner chooses."""


@dataclass(frozen=True, kw_only=True)
class ZeroSpec:
    """The ZeRO options of a DeepSpeed plan: the part of its layout the ``parallel`` group does not hold (the plan's
    ParallelSpec keeps data parallelism over every rank, activation checkpointing as ``recompute=full`` and ZeRO's
    sharded optimizer as ``distributed_optimizer``). Each field's :class:`~cfp_megatron.base.config.LayoutKey`
    gives its key in the plan's canonical string."""

    stage: int = layout_field(0, key="zero", megatron=None)
    """ZeRO stage 0-3."""
    offload_optimizer: bool = layout_field(False, key="oopt", megatron=None)
    """Optimizer states and the step on the host (ZeRO-Offload); stages 1-3."""
    offload_param: bool = layout_field(False, key="oparam", megatron=None)
    """Parameters on the host, fetched per layer; stage 3."""
    bucket_elements: int = layout_field(50_000_000, key="bucket", megatron=None)
    """Elements per reduce/all-gather/prefetch bucket."""

    def __post_init__(self) -> None:
        issues = zero_issues(self.stage, self.offload_optimizer, self.offload_param, self.bucket_elements)
        if issues:
            raise ConfigError(issues)


def zero_issues(stage: int | None, offload_optimizer: bool | None, offload_param: bool | None,
                bucket_elements: int) -> list[ConfigIssue]:
    """What does not go together among ZeRO options (``None``: left to the planner), named by their ``backend``
    keys: a stage outside 0-3, parameter offload without stage 3, optimizer offload at stage 0, no bucket."""
    issues: list[ConfigIssue] = []
    if stage is not None and stage not in ZERO_STAGES:
        issues.append(ConfigIssue(key="backend.zero_stage", value=stage, problem="is not a ZeRO stage.",
                                  fix="use 0, 1, 2 or 3 (or null to plan it)."))
    if offload_param and stage is not None and stage != 3:
        issues.append(ConfigIssue(key="backend.offload_param", value=True,
                                  problem=f"parameter offload needs ZeRO stage 3, not {stage}.",
                                  fix="set backend.zero_stage=3, or backend.offload_param=false."))
    if offload_optimizer and stage == 0:
        issues.append(ConfigIssue(key="backend.offload_optimizer", value=True,
                                  problem="optimizer offload needs a ZeRO stage of 1 or more.",
                                  fix="set backend.zero_stage=1 (or 2, 3), or backend.offload_optimizer=false."))
    if bucket_elements < 1:
        issues.append(ConfigIssue(key="backend.bucket_elements", value=bucket_elements,
                                  problem="must be positive.", fix="use e.g. 50000000."))
    return issues


def zero_keys() -> dict[str, LayoutKey]:
    """ZeroSpec field name -> its LayoutKey, in declaration order (the canonical string's order)."""
    return {f.name: f.metadata["layout"] for f in dataclasses.fields(ZeroSpec)}


@dataclass(frozen=True, kw_only=True)
class BackendSpec:
    """The ``backend`` group."""

    PREFIX: ClassVar[str] = "backend"

    name: BackendKind = BackendKind.megatron
    """Which engine trains."""
    zero_stage: int | None = None
    """DeepSpeed ZeRO stage 0-3; ``None``: planned under ``+cfp=auto``, else 0."""
    activation_checkpointing: bool | None = None
    """Recompute each transformer layer in the backward pass (keeps only layer inputs); ``None``: planned, else
    off."""
    offload_optimizer: bool | None = None
    """ZeRO-Offload: optimizer states (and the fp32 gradient partition) live in host memory and the optimizer step
    runs on the CPU (DeepSpeedCPUAdam); stages 1-3. ``None``: planned, else off."""
    offload_param: bool | None = None
    """ZeRO-Infinity's parameter offload to host memory, fetched per layer; stage 3 only. ``None``: planned, else
    off."""
    bucket_elements: int = 50_000_000
    """Elements per ZeRO reduce/all-gather bucket (``reduce_bucket_size``, ``allgather_bucket_size``,
    ``stage3_prefetch_bucket_size``); DeepSpeed's own default (5e8) holds 1-2 GB of buffers per GPU."""
    config_file: str | None = None
    """A DeepSpeed config to start from (read, never written): its keys are kept; values ``"auto"`` are planned,
    concrete ZeRO stage, micro-batch and offload values pin those knobs."""

    def __post_init__(self) -> None:
        issues = zero_issues(self.zero_stage, self.offload_optimizer, self.offload_param, self.bucket_elements)
        if self.name is BackendKind.megatron:
            for key in ("zero_stage", "activation_checkpointing", "offload_optimizer", "offload_param",
                        "config_file"):
                if getattr(self, key) is not None:
                    issues.append(ConfigIssue(key=f"backend.{key}", value=getattr(self, key),
                                              problem="is a DeepSpeed setting, and the Megatron backend trains.",
                                              fix="add backend=deepspeed, or remove the setting."))
        if self.config_file is not None and not Path(self.config_file).is_file():
            issues.append(ConfigIssue(key="backend.config_file", value=self.config_file,
                                      problem="is not a file.", fix="give the path of a DeepSpeed JSON config."))
        if issues:
            raise ConfigError(issues)

    @property
    def is_deepspeed(self) -> bool:
        """Whether DeepSpeed trains."""
        return self.name is BackendKind.deepspeed

    def base_config(self) -> dict[str, Any]:
        """The user's DeepSpeed config (``config_file``), or an empty one."""
        return {} if self.config_file is None else load_config(self.config_file, key="backend.config_file")

    def pins(self) -> dict[str, Any]:
        """The knobs fixed by hand: this group's non-null values, then concrete values of ``config_file`` (a value
        ``"auto"`` there is left to the planner). Keys are those of :data:`PLANNED_KEYS`."""
        pins = config_pins(self.base_config())
        for key in ("zero_stage", "activation_checkpointing", "offload_optimizer", "offload_param"):
            value = getattr(self, key)  # the micro-batch is pinned by cfp.micro_batch, not in this group
            if value is not None:
                if key in pins and pins[key] != value:
                    raise ConfigError(ConfigIssue(
                        key=f"backend.{key}", value=value,
                        problem=f"contradicts backend.config_file, which sets {pins[key]!r}.",
                        fix="remove one of the two, or set the file's value to \"auto\"."))
                pins[key] = value
        return pins


def load_config(config: dict[str, Any] | str | Path, *, key: str = "config") -> dict[str, Any]:
    """A copy of ``config`` (a dict), or the JSON object at its path (read, never written), or, as DeepSpeed
    accepts it, a base64-encoded JSON string; a :class:`ConfigError` under ``key`` for anything else."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    encoded = isinstance(config, str) and not Path(config).exists()
    try:
        text = base64.urlsafe_b64decode(config).decode("utf-8") if encoded else read_user_file(config, key)
        data = json_loads_unique(text)  # a key given twice is refused, not read one way
    except (OSError, ValueError) as err:  # JSONDecodeError, binascii.Error and UnicodeDecodeError are ValueErrors
        problem = ("is not a file, nor a base64-encoded JSON config." if encoded
                   else f"cannot be read as JSON ({err}).")
        raise ConfigError(ConfigIssue(key=key, value=str(config), problem=problem,
                                      fix="give a DeepSpeed config dict or the path of a JSON file.")) from None
    if not isinstance(data, dict):
        raise ConfigError(ConfigIssue(key=key, value=str(config), problem="does not hold a JSON object.",
                                      fix="give a DeepSpeed config dict or the path of a JSON file."))
    return data


CONFIG_KEYS = {"zero_stage": "zero_optimization.stage", "micro_batch": "train_micro_batch_size_per_gpu",
               "offload_optimizer": "zero_optimization.offload_optimizer.device",
               "offload_param": "zero_optimization.offload_param.device"}
"""The DeepSpeed config key that sets each planned knob (:func:`config_settings`); activation checkpointing has
none of its own."""


def config_settings(base: dict[str, Any]) -> dict[str, Any]:
    """How a DeepSpeed config sets the planned knobs (keys of :data:`PLANNED_KEYS`): a concrete value, ``"auto"``,
    or ``None`` where it says nothing (activation checkpointing has no key of its own: always ``None``)."""
    zero = base.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        zero = {}
    return {
        "zero_stage": zero.get("stage"),
        "micro_batch": base.get("train_micro_batch_size_per_gpu"),
        "offload_optimizer": _offload(zero.get("offload_optimizer")),
        "offload_param": _offload(zero.get("offload_param")),
        "activation_checkpointing": None,
    }


def config_pins(base: dict[str, Any]) -> dict[str, Any]:
    """The knobs a DeepSpeed config fixes: its concrete values of :func:`config_settings` (``"auto"`` and absent
    keys are left to the planner)."""
    return {k: v for k, v in config_settings(base).items() if v is not None and v != "auto"}


def _offload(section: Any) -> bool | str | None:
    """A ``zero_optimization.offload_*`` section as a pin: True for a CPU/NVMe device, False for ``none``."""
    if section is None:
        return None
    if section == "auto":
        return "auto"
    device = section.get("device") if isinstance(section, dict) else None
    if device in (None, "auto"):
        return None if device is None else "auto"
    return device != "none"


def backend_from_config(cfg: Any) -> BackendSpec:
    """The ``backend`` group of a composed config (the Megatron backend when the group is absent)."""
    from omegaconf import DictConfig

    raw = plain_config(cfg) if isinstance(cfg, DictConfig) else dict(cfg or {})
    section = raw.get("backend")
    if section is None:
        return BackendSpec()
    return build_spec(BackendSpec, dict(section))
