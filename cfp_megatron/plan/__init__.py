"""The Plan artifact: what the planner chose, as a canonical string, plan.json, and exports for Megatron-LM,
DeepSpeed and torchrun (see :mod:`cfp_megatron.plan.artifact` for the formats)."""

from cfp_megatron.plan.artifact import (
    PLAN_FILE_SETTING,
    SCHEMA_VERSION,
    Plan,
    PlanPrediction,
    load_plan,
    save_plan,
)
from cfp_megatron.plan.errors import PlanError
from cfp_megatron.plan.exports import deepspeed_config, hydra_overrides, megatron_lm_args, torchrun_command

__all__ = [
    "PLAN_FILE_SETTING",
    "SCHEMA_VERSION",
    "Plan",
    "PlanError",
    "PlanPrediction",
    "deepspeed_config",
    "hydra_overrides",
    "load_plan",
    "megatron_lm_args",
    "save_plan",
    "torchrun_command",
]
