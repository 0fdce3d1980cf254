"""What running a plan needs beyond Megatron-Core on PyTorch: the packages and hardware its layout and model use.

The preflight prints them and writes them to plan.json (``requires``), so that a plan made on a laptop for a GPU
cluster says up front that, for example, its context parallelism runs only on Transformer Engine's attention.
"""

from __future__ import annotations

from cfp_megatron.base.backend_spec import BackendKind
from cfp_megatron.base.config import (
    AttentionKind,
    CudaGraphImpl,
    FlexBackend,
    MlpPartition,
    ModelSpec,
    TokenDispatcher,
)
from cfp_megatron.plan.artifact import Plan

FLEX_PACKAGES = {
    FlexBackend.deepep: ("Buffer", "DeepEP (github.com/deepseek-ai/DeepEP)"),
    FlexBackend.hybridep: ("HybridEPBuffer", "DeepEP's hybrid-ep branch (github.com/deepseek-ai/DeepEP/tree/hybrid-ep; "
                                             "built with HYBRID_EP_MULTINODE=1 where the EP group leaves an NVLink "
                                             "domain)"),
}
"""Per flex backend, the ``deep_ep`` class it runs on and where that comes from (Megatron-Core 0.16.1's
``fused_a2a.py`` imports ``deep_ep.Buffer`` for DeepEP and ``deep_ep.HybridEPBuffer`` for HybridEP)."""


def flex_needs(backend: FlexBackend) -> str:
    """The requirement line of the flex dispatcher's ``backend`` (:data:`FLEX_PACKAGES`)."""
    name, source = FLEX_PACKAGES[backend]
    return (f"deep_ep.{name} from {source} and a GPU: model.moe_token_dispatcher=flex with "
            f"parallel.moe_flex_dispatcher_backend={backend.value} (its dispatch/combine kernels)")


def plan_requirements(plan: Plan, model: ModelSpec) -> tuple[str, ...]:
    """One line per requirement of ``plan`` on ``model``: what is needed, then (after a colon) the setting that needs
    it; empty when plain Megatron-Core on PyTorch runs it."""
    p, needs = plan.parallel, []
    if plan.backend is BackendKind.deepspeed:
        needs.append("DeepSpeed: backend=deepspeed (pip install cfp-megatron[deepspeed])")
    fmt = plan.number_format
    if fmt.low:
        needs.append(f"Transformer Engine and a GPU that computes {fmt.needs}: {' '.join(fmt.overrides())} "
                     "(Megatron-Core runs FP8 and FP4 GEMMs only in Transformer Engine's layers)")
    if p.cp > 1:
        needs.append(f"Transformer Engine: parallel.cp={p.cp} (context parallelism runs on Transformer Engine's "
                     "attention)")
    if p.tp_comm_overlap:
        needs.append("Transformer Engine and a GPU: parallel.tp_comm_overlap=true (userbuffers overlap of the TP "
                     "communication)")
    if model.attention is AttentionKind.mla:
        needs.append("Transformer Engine: model.attention=mla (Megatron-Core runs multi-latent attention only on "
                     "Transformer Engine's attention)")
    if model.is_moe and model.moe_token_dispatcher is TokenDispatcher.flex:
        needs.append(flex_needs(p.moe_flex_dispatcher_backend))
    if p.moe_a2a_overlap:
        needs.append("a GPU: parallel.moe_a2a_overlap=true (the expert all-to-all overlap runs on CUDA streams)")
    if p.cuda_graph_impl is CudaGraphImpl.transformer_engine:
        needs.append("Transformer Engine and a GPU: parallel.cuda_graph_impl=transformer_engine (its "
                     "make_graphed_callables captures the layers)")
    elif p.cuda_graph_impl is CudaGraphImpl.local:
        needs.append("a GPU: parallel.cuda_graph_impl=local (CUDA graphs capture CUDA streams)")
    if p.cpu_offloading_num_layers:
        needs.append(f"Transformer Engine and a GPU: parallel.cpu_offloading_num_layers={p.cpu_offloading_num_layers} "
                     "(Megatron-Core offloads activations with Transformer Engine's CPU offload context)")
    if p.mlp is MlpPartition.primepar:
        needs.append("cfp-megatron's trainer (launch/train.py): parallel.mlp=primepar (Megatron-LM's scripts have "
                     "no PrimePar MLP)")
    return tuple(needs)
