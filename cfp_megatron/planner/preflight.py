"""What a preflight plan took from the defaults rather than from the user's overrides, said before the search runs.

``python -m cfp_megatron.plan model=llama3_8b cluster=dgx_h100 cluster.nodes=4`` plans the ``train`` group's global
batch of 8 sequences (the tiny CPU example's) on 32 GPUs unless told otherwise; the preflight names each such value,
what it means for this job, and the key that changes it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import OmegaConf

from cfp_megatron.base.config import Precision, resolve_precision


@dataclass(frozen=True)
class DefaultUsed:
    """One setting the plan took from the defaults."""

    key: str
    """The Hydra key (or group) that sets it."""
    value: str
    """The value used, as it would be written on the command line."""
    note: str
    """What it means for this job."""


def given(overrides: Sequence[str], key: str) -> bool:
    """Whether the overrides set ``key`` (``key=...``, ``+key=...``, ``++key=...``)."""
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def _shown(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return str(value.value)
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def defaults_used(overrides: Sequence[str], cfg: Any, *, world: int, on_gpu: bool) -> list[DefaultUsed]:
    """The settings of the composed ``cfg`` that no override set and that change the plan, with their meaning."""
    gbs = int(cfg.train.global_batch_size)
    precision = Precision(_shown(cfg.train.precision))
    candidates = [
        ("model", cfg.model.name, "the tiny CPU test model: set model=<preset> (cfp --help lists them)"),
        ("cluster", cfg.cluster.name, "this machine: set cluster=<preset> to plan for a GPU cluster"),
        ("cluster.nodes", cfg.cluster.nodes, f"{world} ranks in all"),
        ("train.global_batch_size", gbs,
         "sequences per optimizer step, the CPU example's default: "
         + (f"data parallelism is at most {gbs}-way on these {world} ranks; set it to the batch you will train"
            if gbs < world else "set it to the batch you will train")),
        ("train.precision", precision.value,
         f"{resolve_precision(precision, on_gpu).value} on {'GPUs' if on_gpu else 'CPU'}"
         if precision is Precision.auto else "as set in the train group"),
        ("train.optimizer", cfg.train.optimizer, "its state sets the optimizer memory"),
        ("parallel.grad_reduce_in_fp32", cfg.parallel.grad_reduce_in_fp32,
         "gradients accumulated and reduced in fp32 (false: in the compute precision, half the memory and traffic)"),
        ("backend", cfg.backend.name, "Megatron-Core's layouts (backend=deepspeed plans ZeRO)"),
    ]
    if cfg.cfp is not None:
        constraints = cfg.cfp.constraints
        if cfg.cfp.micro_batch is None and constraints.micro_batch is None:
            candidates.append(("cfp.constraints.max_micro_batch", constraints.max_micro_batch,
                               "largest micro-batch searched (each also divides the batch per DP rank)"))
        candidates += [
            ("cfp.constraints.memory_headroom", constraints.memory_headroom, "share of each GPU's memory left free"),
            ("cfp.constraints.tp_within_node", constraints.tp_within_node, "TP groups stay inside an NVLink domain"),
        ]
        if on_gpu:
            candidates.append(("cfp.overlap", cfg.cfp.overlap,
                               "communication overlaps on where Megatron-Core runs them and their memory fits"))
    used = []
    for key, value, note in candidates:
        if key in ("model", "cluster") and given(overrides, key):
            continue
        if key == "cluster.nodes" and (cfg.cluster.name == "local" or given(overrides, key)):
            continue
        if not given(overrides, key):
            used.append(DefaultUsed(key=key, value=_shown(OmegaConf.to_object(value) if OmegaConf.is_config(value)
                                                          else value), note=note))
    return used


def default_lines(used: Sequence[DefaultUsed]) -> list[str]:
    """The aligned lines the preflight prints (empty when every setting came from the overrides)."""
    if not used:
        return []
    key_w = max(len(u.key) for u in used)
    value_w = max(len(u.value) for u in used)
    return ["defaults used (no override set them; key=value changes one):",
            *(f"  {u.key:<{key_w}}  {u.value:<{value_w}}  {u.note}" for u in used)]
