"""Activation recomputation: its settings together, the submodules selective recomputation names against the
model, and the layers full recomputation covers against a pipeline chunk."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from cfp_megatron.base.layout_rules.problem import Problem

KEY = "parallel.recompute_modules"


@dataclass(frozen=True, kw_only=True)
class ModelParts:
    """What the submodule rules read of a model."""

    name: str
    """The model's name, for the messages."""
    moe: bool
    """It has MoE layers."""
    dense_layers: bool
    """It has dense (non-MoE) MLP layers."""
    shared_expert: bool
    """Its MoE layers have a shared expert."""
    attention: str
    """Its attention kind (``standard``, ``mla``)."""


def settings(*, recompute: str, modules: str | None, method: str) -> list[Problem]:
    """The submodules to recompute (``modules``) are a choice of selective recomputation; the block ``method`` one of
    full recomputation."""
    found = []
    if modules is not None and recompute != "selective":
        found.append(Problem(key=KEY, value=modules,
                             problem="the submodules to recompute are a choice of selective recomputation; "
                                     f"parallel.recompute is {recompute}.",
                             fix="set parallel.recompute=selective, or parallel.recompute_modules=null.",
                             brief=f"recomputed submodules under recompute={recompute}"))
    if method == "block" and recompute != "full":
        found.append(Problem(key="parallel.recompute_method", value=method,
                             problem="the block method chooses which layers full recomputation covers; it needs "
                                     f"parallel.recompute=full (got {recompute}).",
                             fix="set parallel.recompute=full or parallel.recompute_method=uniform.",
                             brief=f"block recomputation under recompute={recompute}"))
    return found


def modules_fit(modules: Collection[str], model: ModelParts, *, named: str | None = None, shared_overlap: bool = False,
                te: bool = True) -> list[Problem]:
    """The submodules selective recomputation recomputes (``modules``: their values; ``named``: the setting) exist in
    ``model`` and can be recomputed with the shared expert's overlap (``shared_overlap``) and Transformer Engine
    (``te``)."""
    found: list[Problem] = []
    if not modules:
        return found

    def add(problem: str, fix: str) -> None:  # the messages are built only for a module that does not fit
        found.append(Problem(key=KEY, value=named, problem=problem, fix=fix, brief=problem.rstrip(".")))

    for module in ("moe_act", "moe", "shared_experts"):
        if module in modules and not model.moe:
            add(f"{module} recomputes part of a MoE layer; model {model.name} has no experts.",
                f"leave {module} out of parallel.recompute_modules.")
    if "mlp" in modules and not model.dense_layers:
        add(f"mlp recomputes dense MLPs; every layer of model {model.name} is a MoE layer.",
            "use moe (the whole MoE block) or moe_act, or leave mlp out.")
    if "shared_experts" in modules and not model.shared_expert:
        add(f"model {model.name} has no shared expert.", "leave shared_experts out of parallel.recompute_modules.")
    if "shared_experts" in modules and shared_overlap:
        add("Megatron-Core cannot recompute the shared expert while it overlaps the token exchange "
            "(parallel.moe_shared_expert_overlap).",
            "leave shared_experts out, or set parallel.moe_shared_expert_overlap=false.")
    if "mla_up_proj" in modules and model.attention != "mla":
        add(f"mla_up_proj recomputes multi-head latent attention's up-projections; model {model.name} has "
            f"{model.attention} attention.", "leave mla_up_proj out.")
    if "moe_act" in modules and not te:
        add("Megatron-Core recomputes the experts' activation only in its grouped-GEMM experts (moe_grouped_gemm: "
            "Transformer Engine on a GPU); it is not installed here.",
            "plan it for a GPU cluster with Transformer Engine, or leave moe_act out.")
    return found


def block_layers(layers: int, chunk_layers: int) -> list[Problem]:
    """Full recomputation covers at most the layers of a pipeline chunk (``chunk_layers``: the largest chunk's, 0
    where the split is invalid, which the pipeline rules report)."""
    if layers <= max(chunk_layers, 1):
        return []
    return [Problem(key="parallel.recompute_num_layers", value=layers,
                    problem=f"exceeds the {chunk_layers} layers of each pipeline chunk.",
                    fix=f"use at most {chunk_layers}.",
                    brief=f"{layers} recomputed layers exceed the {chunk_layers} of a pipeline chunk")]
