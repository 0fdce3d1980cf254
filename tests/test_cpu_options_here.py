"""A plan for a CPU cluster prices the model the runtime builds there (Megatron-Core's local spec: the unfused core
with PyTorch's softmax, no grouped GEMM, the weight gradients through Megatron's DDP hook), read from the same
predicates as ``megatron_config`` (base/parallel_dims.py), with no CPU case in the weight-gradient rule."""

from __future__ import annotations

import dataclasses

from megatron.core.transformer.enums import AttnBackend

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.model import megatron_config
from cfp_megatron.sim.backward_memory import linear_moments, weight_grad_transient
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import layer_activation_bytes
from cfp_megatron.sim.options import AttentionKernel, SimOptions, WeightGradAccumulation, options_here

CPU_JOB = ["model=llama_tiny", "model.num_layers=2", "cluster=local", "cluster.gpus_per_node=2", "parallel.tp=2",
           "train.seq_length=64", "train.micro_batch_size=2", "train.global_batch_size=2"]


def test_a_cpu_plan_prices_the_options_the_cpu_runtime_builds() -> None:
    job = compose_job(CPU_JOB)
    assert job.cluster.on_cpu
    built = megatron_config.transformer_config(job, ParallelDims.build(job, 2), on_gpu=False)
    priced = options_here(job.cluster)
    # The local spec's DotProductAttention without the masked-softmax fusion: PyTorch's softmax over kept scores.
    assert built.attention_backend is AttnBackend.local and not built.masked_softmax_fusion
    assert priced.attention is AttentionKernel.torch_softmax
    assert not built.gradient_accumulation_fusion
    assert priced.weight_grad_accumulation is WeightGradAccumulation.main_grad_hook
    assert priced.grouped_gemm is False


def test_the_weight_gradient_transient_on_cpu_follows_the_options_alone() -> None:
    # Megatron-Core's local linears without the fusion return grad_weight as a new tensor (the hook adds it into
    # main_grad): counted under the runtime's options; the same job priced with Megatron-LM's fused defaults and a
    # flash core counts none, as on a GPU (no CPU case in fused_into_main_grad).
    job = compose_job(CPU_JOB)
    layout = build_layout(job)
    here = options_here(job.cluster)
    assert weight_grad_transient(here, job)
    assert all(m.weight_grad > 0.0 for m in linear_moments(job, layout, here, moe=False))
    fused_flash = SimOptions(attention=AttentionKernel.flash)
    assert not weight_grad_transient(fused_flash, job)
    assert all(m.weight_grad == 0.0 for m in linear_moments(job, layout, fused_flash, moe=False))


def test_a_plan_for_this_machine_keeps_the_unfused_ropes_cos_and_sin_on_a_gpu_as_on_cpu() -> None:
    # The runtime builds apply_rope_fusion off everywhere (Megatron-Core's default), so each layer's RoPE keeps its
    # cos and sin, four [s, head_dim] tensors a layer: priced from options_here, not from the cluster being a CPU.
    job = compose_job(CPU_JOB)
    built = megatron_config.transformer_config(job, ParallelDims.build(job, 2), on_gpu=False)
    assert built.apply_rope_fusion is options_here(job.cluster).rope_fusion is False
    gpu_job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "parallel.tp=8",
                           "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=8"])
    layout = build_layout(gpu_job)
    here = options_here(gpu_job.cluster)
    assert here.rope_fusion is False
    fused = dataclasses.replace(here, rope_fusion=True)
    unfused_kept = layer_activation_bytes(gpu_job, layout, here, moe=False)[0]
    fused_kept = layer_activation_bytes(gpu_job, layout, fused, moe=False)[0]
    head_dim = gpu_job.model.hidden_size // gpu_job.model.num_attention_heads
    assert unfused_kept - fused_kept == 4 * 4096 * head_dim * 2  # bf16, no CP
