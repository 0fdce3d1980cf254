"""Mixture of experts: expert and expert-tensor parallelism against the experts, the expert ranks against the
world, and when the expert communication may overlap."""

from __future__ import annotations

import math

from cfp_megatron.base.layout_rules.problem import Problem

OVERLAPS = ("moe_a2a_overlap", "moe_shared_expert_overlap")
"""The ParallelSpec fields that overlap expert communication."""


def experts(num_experts: int | None, ep: int) -> list[Problem]:
    """The experts are split over the EP group."""
    if not (num_experts or 1) % ep:
        return []
    return [Problem(key="parallel.ep", value=ep,
                    problem=f"model.num_experts={num_experts} is not divisible by parallel.ep={ep}.",
                    fix=f"use a parallel.ep that divides {num_experts}.",
                    brief=f"model.num_experts={num_experts} is not divisible by it")]


def expert_ffn(ffn: int, etp: int) -> list[Problem]:
    """Each expert's FFN size is split over the expert TP group."""
    if not ffn % etp:
        return []
    return [Problem(key="parallel.etp", value=etp,
                    problem=f"the expert hidden size {ffn} is not divisible by the expert TP size {etp}.",
                    fix=f"use a parallel.etp that divides {ffn}.",
                    brief=f"the expert FFN size {ffn} is not divisible by it")]


def shared_expert(size: int | None, tp: int) -> list[Problem]:
    """The shared expert (``size``: its FFN size, ``None``: none) is split over the dense TP group."""
    if size is None or not size % tp:
        return []
    return [Problem(key="parallel.tp", value=tp,
                    problem=f"model.moe_shared_expert_intermediate_size={size} is not divisible by parallel.tp={tp}.",
                    fix=f"use a parallel.tp that divides {size}.",
                    brief=f"the shared expert's FFN size {size} is not divisible by it")]


def expert_world(world: int, etp: int, ep: int, pp: int) -> list[Problem]:
    """The expert layout (expert TP x EP x PP) tiles the world."""
    if not world % (etp * ep * pp):
        return []
    return [Problem(key="parallel.ep", value=ep,
                    problem=f"world size {world} is not divisible by parallel.etp x parallel.ep x parallel.pp "
                            f"= {etp} x {ep} x {pp}.",
                    fix="choose expert sizes whose product with parallel.pp divides the world size.",
                    brief=f"expert TP x EP x PP = {etp * ep * pp} does not divide the world size {world}")]


def overlap_dispatcher(*, overlaps: list[str], dispatcher: str) -> list[Problem]:
    """Megatron-Core overlaps expert communication (``overlaps``: the :data:`OVERLAPS` fields that are on) only
    with the alltoall or flex token ``dispatcher``."""
    if dispatcher != "allgather":
        return []
    return [Problem(key=f"parallel.{name}", value=True,
                    problem="Megatron-Core overlaps expert communication only with the alltoall or flex dispatcher "
                            f"(model.moe_token_dispatcher={dispatcher}).",
                    fix=f"set model.moe_token_dispatcher=alltoall, or parallel.{name}=false.",
                    brief="the allgather dispatcher overlaps no expert communication") for name in overlaps]


def a2a_overlap_needs_ep(a2a_overlap: bool, ep: int) -> list[Problem]:
    """Overlapping the expert all-to-all needs one (EP > 1)."""
    if not a2a_overlap or ep > 1:
        return []
    return [Problem(key="parallel.moe_a2a_overlap", value=True,
                    problem="there is no expert all-to-all to overlap without expert parallelism (parallel.ep=1).",
                    fix="set parallel.ep to 2 or more, or parallel.moe_a2a_overlap=false.",
                    brief="no expert all-to-all to overlap at EP 1")]


def a2a_overlap_schedule(*, a2a_overlap: bool, shared_overlap: bool, full_recompute: bool, pp: int,
                         vpp: int | None) -> list[Problem]:
    """The combined 1F1B schedule that overlaps the expert all-to-all with another micro-batch: not with the shared
    expert's overlap nor full recomputation, and interleaved where pipelined (``vpp=None``: some chunk count may
    be)."""
    if not a2a_overlap:
        return []
    found = []
    if shared_overlap:
        found.append(Problem(key="parallel.moe_shared_expert_overlap", value=True,
                             problem="Megatron-Core does not overlap the shared expert when the expert all-to-all "
                                     "overlaps another micro-batch (parallel.moe_a2a_overlap).",
                             fix="set one of parallel.moe_shared_expert_overlap / parallel.moe_a2a_overlap to false.",
                             brief="the shared expert's overlap excludes the all-to-all's"))
    if full_recompute:
        found.append(Problem(key="parallel.moe_a2a_overlap", value=True,
                             problem="the combined 1F1B schedule does not run with full recomputation.",
                             fix="set parallel.recompute to none or selective, or parallel.moe_a2a_overlap=false.",
                             brief="the combined 1F1B schedule does not run with full recomputation"))
    if pp > 1 and vpp == 1:
        found.append(Problem(key="parallel.moe_a2a_overlap", value=True,
                             problem="with pipeline parallelism, Megatron-Core overlaps the expert all-to-all only "
                                     "under the interleaved schedule.",
                             fix="set parallel.vpp to 2 or more, or parallel.moe_a2a_overlap=false.",
                             brief="the all-to-all overlaps only under the interleaved schedule when pipelined"))
    return found


def overlaps_on_gpu(*, a2a_overlap: bool, shared_overlap: bool, has_shared: bool, model: str, flex: bool,
                    on_cpu: bool) -> list[Problem]:
    """The shared expert's overlap needs a shared expert; the combined 1F1B schedule and the flex dispatcher
    (DeepEP) run on GPUs."""
    found = []
    if shared_overlap and not has_shared:
        found.append(Problem(key="parallel.moe_shared_expert_overlap", value=True,
                             problem=f"model {model} has no shared expert.",
                             fix="set parallel.moe_shared_expert_overlap=false.",
                             brief=f"model {model} has no shared expert"))
    if a2a_overlap and on_cpu:
        found.append(Problem(key="parallel.moe_a2a_overlap", value=True,
                             problem="the combined 1F1B schedule runs on CUDA streams in bf16/fp16; this cluster is "
                                     "CPU.",
                             fix="plan it for a GPU cluster (cluster=dgx_h100 ...), or set "
                                 "parallel.moe_a2a_overlap=false.",
                             brief="the combined 1F1B schedule runs on GPUs"))
    if flex and on_cpu:
        found.append(Problem(key="model.moe_token_dispatcher", value="flex",
                             problem="the flex dispatcher runs DeepEP's CUDA kernels; this cluster is CPU.",
                             fix="plan it for a GPU cluster, or set model.moe_token_dispatcher=alltoall.",
                             brief="the flex dispatcher runs on GPUs"))
    return found


def flex_backend(*, backend: str, dispatcher: str) -> list[Problem]:
    """A flex ``backend`` away from Megatron-Core's default (``deepep``) needs the flex ``dispatcher``: no other one
    reads it."""
    if backend == "deepep" or dispatcher == "flex":
        return []
    return [Problem(key="parallel.moe_flex_dispatcher_backend", value=backend,
                    problem=f"it chooses the flex dispatcher's kernels, and model.moe_token_dispatcher={dispatcher} "
                            "runs none of them.",
                    fix="set model.moe_token_dispatcher=flex, or parallel.moe_flex_dispatcher_backend=deepep.",
                    brief=f"the {dispatcher} dispatcher has no flex backend")]


def dense_model(*, model: str, a2a_overlap: bool, shared_overlap: bool, ep: int, etp: int | None) -> list[Problem]:
    """A model without experts has no expert sizes or expert overlaps."""
    found = []
    if a2a_overlap or shared_overlap:
        found.append(Problem(key="parallel.moe_a2a_overlap", value=True, problem=f"model {model} has no experts.",
                             fix="set parallel.moe_a2a_overlap=false and parallel.moe_shared_expert_overlap=false.",
                             brief=f"{model} is a dense model: it has no experts to overlap"))
    if ep != 1:
        found.append(Problem(key="parallel.ep", value=ep, problem=f"model {model} has no experts.",
                             fix="set parallel.ep=1, or choose a MoE model (e.g. model=moe_tiny).",
                             brief=f"{model} is a dense model: it has no experts to split"))
    if etp is not None and etp != 1:
        found.append(Problem(key="parallel.etp", value=etp, problem=f"model {model} has no experts.",
                             fix="set parallel.etp=null.",
                             brief=f"{model} is a dense model: it has no experts to split"))
    return found


def capacity(*, factor: float | None, pad: bool, is_moe: bool) -> list[Problem]:
    """Token-drop settings (Megatron-Core's ``TransformerConfig.__post_init__``): a capacity ``factor`` is positive
    and finite, needs experts, and padding to capacity needs a factor."""
    found = []
    if factor is not None and not (math.isfinite(factor) and factor > 0):
        found.append(Problem(key="model.moe_expert_capacity_factor", value=factor,
                             problem="the expert capacity factor must be a positive number.",
                             fix="use e.g. 1.0 (token-drop at the balanced share), or null (dropless).",
                             brief=f"capacity factor {factor} is not positive"))
    if factor is not None and not is_moe:
        found.append(Problem(key="model.moe_expert_capacity_factor", value=factor,
                             problem="a capacity factor needs experts (model.num_experts is null).",
                             fix="set model.moe_expert_capacity_factor=null, or set model.num_experts.",
                             brief="a dense model has no expert capacity"))
    if pad and factor is None:
        found.append(Problem(key="model.moe_pad_expert_input_to_capacity", value=True,
                             problem="padding to capacity needs a capacity (model.moe_expert_capacity_factor is "
                                     "null, dropless).",
                             fix="set model.moe_expert_capacity_factor (e.g. 1.0), or "
                                 "model.moe_pad_expert_input_to_capacity=false.",
                             brief="padding to capacity needs a capacity factor"))
    return found


def flex_padding(*, pad: bool, dispatcher: str, backend: str) -> list[Problem]:
    """Padding to capacity under the flex dispatcher: HybridEP pads (``_HybridEPManager``'s drop-and-pad), DeepEP
    does not (Megatron-Core's ``TransformerConfig.__post_init__`` refuses it)."""
    if not pad or dispatcher != "flex" or backend != "deepep":
        return []
    return [Problem(key="model.moe_pad_expert_input_to_capacity", value=True,
                    problem="the flex dispatcher's DeepEP backend does not pad expert inputs to capacity "
                            "(parallel.moe_flex_dispatcher_backend=deepep).",
                    fix="set parallel.moe_flex_dispatcher_backend=hybridep (HybridEP pads), "
                        "model.moe_token_dispatcher=alltoall, or model.moe_pad_expert_input_to_capacity=false.",
                    brief="DeepEP does not pad to capacity")]
