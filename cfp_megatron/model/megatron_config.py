"""A job as Megatron-Core's ``TransformerConfig``: the model's shape, its parallel sizes, precision, recomputation,
MoE and MLA settings, and the fusions this machine can run (used by capture on the meta device and by the engine)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from cfp_megatron.base.config import (
    Activation,
    AttentionKind,
    CudaGraphImpl,
    JobSpec,
    Precision,
    Recompute,
    recompute_modules,
    resolve_precision,
)
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import (
    ParallelDims,
    gradient_accumulation_fusion_here,
    grouped_gemm_here,
    hierarchical_cp_sizes,
    masked_softmax_fusion_here,
    rope_fusion_here,
    router_fusion_here,
)

ACTIVATION_FUNCS = {Activation.gelu: F.gelu, Activation.swiglu: F.silu, Activation.quick_geglu: quick_gelu}
"""Megatron-Core's ``activation_func`` of each activation (the gated ones with ``gated_linear_unit``)."""
QUICK_GEGLU_LINEAR_OFFSET = 1.0
"""What quick GEGLU adds to the linear half before gating (Megatron-Core's ``glu_linear_offset``; GPT-OSS's
``(up + 1)``, Megatron-Bridge's ``GPTOSSProvider``)."""


def params_dtype(precision: Precision) -> torch.dtype:
    """Parameter dtype of the model for a resolved precision."""
    return {Precision.fp32: torch.float32, Precision.bf16: torch.bfloat16, Precision.fp16: torch.float16}[precision]


def transformer_config(job: JobSpec, dims: ParallelDims, *, on_gpu: bool) -> TransformerConfig:
    """Megatron-Core's ``TransformerConfig`` (or ``MLATransformerConfig``) for ``job`` under ``dims``."""
    m, p = job.model, job.parallel
    precision = resolve_precision(job.train.precision, on_gpu)
    dtype = params_dtype(precision)
    kwargs: dict = dict(
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        ffn_hidden_size=m.ffn_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.query_groups,
        kv_channels=m.kv_channels,
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        num_layers_in_first_pipeline_stage=p.first_stage_layers if dims.pp > 1 else None,
        num_layers_in_last_pipeline_stage=p.last_stage_layers if dims.pp > 1 else None,
        account_for_embedding_in_pipeline_split=p.account_for_embedding_in_pipeline_split and dims.pp > 1,
        account_for_loss_in_pipeline_split=p.account_for_loss_in_pipeline_split and dims.pp > 1,
        # A per-stage layout (Megatron-Core parses it; the embedding and loss stay on the first and last chunk).
        pipeline_model_parallel_layout=p.pipeline_model_parallel_layout if dims.pp > 1 else None,
        # Multi-token prediction: Megatron-Core builds the MTP block on the chunk the layout (or, without one, the
        # last pipeline stage) gives it and adds its loss through MTPLossAutoScaler.
        mtp_num_layers=m.mtp_num_layers or None,
        mtp_loss_scaling_factor=m.mtp_loss_scaling_factor,
        context_parallel_size=dims.cp,
        cp_comm_type=p.cp_comm_type.value if dims.cp > 1 else None,
        hierarchical_context_parallel_sizes=hierarchical_cp_sizes(job, dims),
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        sequence_parallel=dims.sp,
        tp_comm_overlap=p.tp_comm_overlap,
        normalization=m.normalization.value,
        layernorm_epsilon=m.norm_epsilon,
        gated_linear_unit=m.activation.gated,
        activation_func=ACTIVATION_FUNCS[m.activation],
        glu_linear_offset=QUICK_GEGLU_LINEAR_OFFSET if m.activation is Activation.quick_geglu else 0.0,
        activation_func_clamp_value=m.activation_clamp,
        add_bias_linear=m.add_bias_linear,
        add_qkv_bias=m.add_qkv_bias,
        qk_layernorm=m.qk_layernorm,
        hidden_dropout=m.hidden_dropout,
        attention_dropout=m.attention_dropout,
        window_size=(m.window_size, 0) if m.window_size is not None else None,
        window_attn_skip_freq=m.window_attn_skip_freq,
        init_method_std=m.init_method_std,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=precision is Precision.bf16,
        fp16=precision is Precision.fp16,
        # FP8 / FP4 GEMMs through Transformer Engine (fp8 + fp8_recipe, fp4 + fp4_recipe); the job checks refuse
        # them before any process group where Transformer Engine or the GPU lacks the format (job_checks.py).
        **NumberFormat.of(job.train).megatron_fields(),
        # Parameters kept in FP8 (parallel.fp8_param_gather): Transformer Engine builds them as quantised tensors.
        fp8_param=NumberFormat.of(job.train).param_fields(job.parallel.fp8_param_gather)["fp8_param_gather"],
        # The stack's first/last layers in bf16 (parallel.num_layers_at_start_in_bf16 / _end_in_bf16).
        first_last_layers_bf16=bool(p.num_layers_at_start_in_bf16 or p.num_layers_at_end_in_bf16),
        num_layers_at_start_in_bf16=p.num_layers_at_start_in_bf16,
        num_layers_at_end_in_bf16=p.num_layers_at_end_in_bf16,
        # Per-token loss: the step's loss is (sum of token losses) / (tokens in the global batch) under every layout.
        calculate_per_token_loss=True,
        # CPU initialisation builds full weights and splits them, so TP layouts start alike (and needs no CUDA).
        use_cpu_initialization=not on_gpu,
        perform_initialization=True,
        # Fusions: the bias/activation and bias/dropout ones are TorchScript (CUDA only); the masked-softmax one is
        # a compiled extension that only Apex or Megatron's own build provides. Megatron fuses GELU with a bias and
        # SwiGLU or quick GEGLU with or without one (Megatron-LM's --swiglu default), not a bias-free GELU.
        bias_activation_fusion=on_gpu and (m.add_bias_linear or m.activation.gated),
        masked_softmax_fusion=on_gpu and masked_softmax_fusion_here(),
        # TEGroupedMLP refuses it for experts with biases (its fc2 bias is added per expert, not by the
        # bias-dropout-add), as Megatron-Bridge's GPT-OSS sets it off.
        bias_dropout_fusion=on_gpu and not (m.is_moe and m.add_bias_linear and grouped_gemm_here(on_gpu=on_gpu)),
        apply_rope_fusion=rope_fusion_here(),
        # Off: the weight gradients join main_grad through Megatron's DDP hook (the predicate says why).
        gradient_accumulation_fusion=gradient_accumulation_fusion_here(),
        persist_layer_norm=False,
        deallocate_pipeline_outputs=True,
        # gloo matches point-to-point messages by (peer, tag) in posting order, so the batched isend/irecv of the
        # interleaved steady state can swap an activation and a gradient of equal shape; NCCL groups them safely.
        # On GPUs the interleaved schedule overlaps its sends and receives with computation, as Megatron-LM does by
        # default (--overlap-p2p-communication; the simulator times a transfer as a delay between dependent passes).
        batch_p2p_comm=on_gpu and dims.vpp == 1,
        overlap_p2p_comm=on_gpu and dims.vpp > 1,
        attention_backend=AttnBackend.auto if on_gpu else AttnBackend.local,
    )
    if p.cuda_graph_impl is not CudaGraphImpl.none and on_gpu:  # CUDA graphs capture CUDA streams only (cpu_notes)
        kwargs.update(cuda_graph_impl=p.cuda_graph_impl.value, cuda_graph_scope=list(p.graph_scopes()))
    if p.cpu_offloading_num_layers and on_gpu:  # Transformer Engine's offload context copies over CUDA streams
        kwargs.update(cpu_offloading=True, cpu_offloading_num_layers=p.cpu_offloading_num_layers,
                      cpu_offloading_activations=True, cpu_offloading_weights=False)
    if p.recompute is Recompute.selective:
        kwargs.update(recompute_granularity="selective",
                      recompute_modules=[m.value for m in recompute_modules(p.recompute_modules)])
    elif p.recompute is Recompute.full:
        # uniform: every layer, in groups of recompute_num_layers; block: the first recompute_num_layers of the chunk.
        kwargs.update(recompute_granularity="full", recompute_method=p.recompute_method.value,
                      recompute_num_layers=p.recompute_num_layers)
    if m.is_moe:
        freq: int | list[int] = 1
        if m.moe_first_dense_layers:
            freq = [0] * m.moe_first_dense_layers + [1] * (m.num_layers - m.moe_first_dense_layers)
        kwargs.update(
            num_moe_experts=m.num_experts,
            moe_router_topk=m.moe_router_topk,
            moe_ffn_hidden_size=m.moe_ffn_hidden_size or m.ffn_size,
            moe_shared_expert_intermediate_size=m.moe_shared_expert_intermediate_size,
            moe_layer_freq=freq,
            moe_router_score_function=m.moe_router_score.value,
            moe_aux_loss_coeff=m.moe_aux_loss_coeff,
            moe_router_load_balancing_type="aux_loss" if m.moe_aux_loss_coeff > 0 else "none",
            moe_token_dispatcher_type=m.moe_token_dispatcher.value,
            moe_flex_dispatcher_backend=p.moe_flex_dispatcher_backend.value,
            moe_expert_capacity_factor=m.moe_expert_capacity_factor,
            moe_pad_expert_input_to_capacity=m.moe_pad_expert_input_to_capacity,
            moe_grouped_gemm=grouped_gemm_here(on_gpu=on_gpu),
            moe_router_dtype="fp32" if m.moe_router_fp32 else None,
            # Transformer Engine's fused router kernels: Megatron-Core raises for them without it (cpu_notes).
            moe_router_fusion=m.moe_router_fusion and router_fusion_here(on_gpu=on_gpu),
            moe_shared_expert_overlap=p.moe_shared_expert_overlap,
            overlap_moe_expert_parallel_comm=p.moe_a2a_overlap,
        )
        if m.moe_router_score.value == "sigmoid":
            kwargs.update(moe_router_enable_expert_bias=False)
    if m.attention is AttentionKind.mla:
        kwargs.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_head_dim=m.qk_head_dim,
                      qk_pos_emb_head_dim=m.qk_pos_emb_head_dim, v_head_dim=m.v_head_dim,
                      rotary_base=m.rotary_base, rope_type="rope")
        kwargs.pop("kv_channels")
        return MLATransformerConfig(**kwargs)
    return TransformerConfig(**kwargs)


def cpu_notes(job: JobSpec) -> list[str]:
    """One line for each setting of ``job`` that :func:`transformer_config` leaves out on CPU, where it has no
    effect: CUDA graphs (``parallel.cuda_graph_impl``) capture CUDA streams; the fused router
    (``model.moe_router_fusion``) is Transformer Engine's CUDA kernels."""
    p, notes = job.parallel, []
    if p.cuda_graph_impl is not CudaGraphImpl.none:
        scope = f" (scope {p.cuda_graph_scope})" if p.cuda_graph_scope else ""
        notes.append(f"cfp: parallel.cuda_graph_impl={p.cuda_graph_impl.value}{scope} is ignored on CPU: CUDA graphs "
                     "capture CUDA streams; every kernel is launched as it runs.")
    if job.model.is_moe and job.model.moe_router_fusion:
        notes.append("cfp: model.moe_router_fusion=true is ignored on CPU: Transformer Engine's fused router kernels "
                     "run on a GPU; the router runs Megatron-Core's PyTorch ops.")
    return notes
