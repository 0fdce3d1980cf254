"""What a layer's backward holds beyond its kept activations: the linears' flowing gradients and weight-gradient
temporaries, moment by moment, against Megatron-Core 0.16.1's linear backward (docs/simulator.md, "The backward's
flowing gradients")."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.sim.backward_memory import (
    backward_flow_bytes,
    dummy_wgrad_bytes,
    linear_moments,
    weight_grad_transient,
)
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import AttentionKernel, SimOptions, WeightGradAccumulation, options_here
from cfp_megatron.sim.simulate import predict_memory

LOCAL = SimOptions(attention=AttentionKernel.torch_softmax)  # Megatron-Core's local spec, as on this CPU
TOKENS, HIDDEN, FFN = 128, 256, 512  # micro-batch 2 x 64 tokens


def _job(*overrides: str, cluster: str = "local"):
    """llama_tiny on two ranks; ``cluster`` a GPU preset where Transformer Engine's linears are meant (a CPU rank
    builds the local spec)."""
    return compose_job(["model=llama_tiny", "model.num_layers=2", "model.hidden_size=256", "model.ffn_hidden_size=512",
                        f"cluster={cluster}", "cluster.gpus_per_node=2", "parallel.tp=2", "train.seq_length=64",
                        "train.micro_batch_size=2", "train.global_batch_size=2", *overrides])


def test_each_linears_moment_holds_its_gradients_as_megatron_cores_backward_makes_them() -> None:
    # layers.py: grad_input = grad_output.matmul(weight) whole on every TP rank (all-reduced in place without SP,
    # reduce-scattered into sub_grad_input under it), grad_weight = grad_output.t().matmul(total_input) without the
    # fusion; the layer output's gradient waits for the residual add; under SP a row-parallel linear's output
    # gradient is gathered into a new tensor. At FC1, autograd has released FC2's input and SwiGLU's input.
    tp = 2
    fc2, fc1, proj, qkv = FFN / tp, 2 * FFN / tp, HIDDEN / tp, (HIDDEN + 2 * 2 * 64) / tp  # 4 heads, 2 groups of 64
    for sp in (False, True):
        job = _job(f"parallel.sp={str(sp).lower()}")
        shard = TOKENS / tp if sp else TOKENS
        moments = linear_moments(job, build_layout(job), LOCAL, moe=False)
        gathered = TOKENS * HIDDEN if sp else 0.0
        assert [m.total for m in moments] == [
            shard * HIDDEN + gathered + TOKENS * fc2 + HIDDEN * fc2,
            shard * HIDDEN + TOKENS * fc1 + TOKENS * HIDDEN + (shard * HIDDEN if sp else 0.0) + fc1 * HIDDEN
            - TOKENS * (fc2 + fc1),
            shard * HIDDEN + gathered + TOKENS * proj + HIDDEN * proj,
            shard * HIDDEN + TOKENS * qkv + TOKENS * HIDDEN + (shard * HIDDEN if sp else 0.0) + qkv * HIDDEN,
        ], sp
        assert backward_flow_bytes(job, build_layout(job), LOCAL, moe=False) == 4 * max(m.total for m in moments)


def test_the_weight_gradient_is_a_temporary_unless_fused_into_main_grad_by_transformer_engine() -> None:
    # fused + TE's linears: get_dummy_wgrad, cached for the run; fused + the local linears: torch.empty of the
    # weight's shape all the same; any other accumulation: the GEMM's output, added to main_grad or .grad and freed.
    job = _job(cluster="dgx_h100")
    flash = SimOptions(attention=AttentionKernel.flash)
    assert not weight_grad_transient(flash, job)
    assert weight_grad_transient(LOCAL, job)
    for how in (WeightGradAccumulation.main_grad_hook, WeightGradAccumulation.autograd):
        assert weight_grad_transient(SimOptions(attention=AttentionKernel.flash, weight_grad_accumulation=how), job)
    moments = linear_moments(job, build_layout(job), flash, moe=False)
    assert all(m.weight_grad == 0.0 for m in moments)
    assert all(m.weight_grad > 0.0 for m in linear_moments(job, build_layout(job), LOCAL, moe=False))


def test_a_rank_without_the_loss_holds_the_flow_on_top_of_its_activations() -> None:
    # Stage 0 of two has no logits to free before its layers' backward: the largest moment adds in full; on the
    # loss's stage it counts only beyond the logits.
    pp = ["parallel.tp=1", "parallel.pp=2", "model.num_layers=4", "train.global_batch_size=4"]
    options = SimOptions(attention=AttentionKernel.flash, weight_grad_accumulation=WeightGradAccumulation.autograd)
    job = _job(*pp, cluster="dgx_h100")
    first = predict_memory(job, options=options, world_size=2)
    assert first.stage == 0
    flow = backward_flow_bytes(job, build_layout(job), options, moe=False)
    fused = predict_memory(job, options=SimOptions(attention=AttentionKernel.flash), world_size=2)
    fused_flow = backward_flow_bytes(job, build_layout(job), SimOptions(attention=AttentionKernel.flash), moe=False)
    assert flow > fused_flow > 0.0
    assert (dict(first.parts)["layer_activations"] - dict(fused.parts)["layer_activations"]
            == pytest.approx(flow - fused_flow))


def test_transformer_engines_fused_accumulation_holds_one_placeholder_a_weight_shape() -> None:
    # get_dummy_wgrad caches one torch.empty per (shape, dtype) for the run: a dense layer's QKV, projection, FC1
    # and FC2 shapes on every layer's rank, the output layer's on the loss's; none where the gradient is a temporary.
    job = _job("parallel.sp=true", "train.precision=bf16", cluster="dgx_h100")
    layout, flash = build_layout(job), SimOptions(attention=AttentionKernel.flash)
    tp = 2
    qkv, fc2 = ((HIDDEN + 2 * 2 * 64) / tp, HIDDEN), (HIDDEN, FFN / tp)
    assert qkv == fc2  # both 256 x 256 here: one cached tensor serves the two
    layer = qkv[0] * qkv[1] + HIDDEN * HIDDEN / tp + 2 * FFN / tp * HIDDEN
    head = job.model.padded_vocab_size / tp * HIDDEN
    assert dummy_wgrad_bytes(job, layout, flash, dense=True, moe=False, head=False) == 2 * layer
    assert dummy_wgrad_bytes(job, layout, flash, dense=True, moe=False, head=True) == 2 * (layer + head)
    assert dummy_wgrad_bytes(job, layout, LOCAL, dense=True, moe=False, head=True) == 0.0
    parts = dict(predict_memory(job, options=flash, world_size=2).parts)
    assert parts["dummy_wgrads"] == 2 * (layer + head)
    assert dict(predict_memory(job, options=LOCAL, world_size=2).parts)["dummy_wgrads"] == 0.0
    # A CPU plan prices the local spec through the runtime's options (options_here), not a CPU case here: no
    # placeholder, the weight gradient a temporary.
    cpu = _job("parallel.sp=true")
    here = options_here(cpu.cluster)
    assert dummy_wgrad_bytes(cpu, build_layout(cpu), here, dense=True, moe=False, head=True) == 0.0
    assert weight_grad_transient(here, cpu)


def test_pytorchs_fsdp_keeps_no_main_grad_and_counts_its_unsharded_gradient_once() -> None:
    # llm-foundry's and torchtitan's FSDP: autograd makes each layer's whole gradient, the gathered layer's share of
    # fsdp_buffers; no placeholder, no second weight gradient in the linears' moments.
    job = _job()
    torch_fsdp = SimOptions(attention=AttentionKernel.flash, torch_fsdp=True)
    assert not weight_grad_transient(torch_fsdp, job)
    assert dummy_wgrad_bytes(job, build_layout(job), torch_fsdp, dense=True, moe=False, head=True) == 0.0


def test_megatron_lm_before_2023_returns_no_weight_gradient_when_fused() -> None:
    # Its layers.py: wgrad_gemm_accum_fp32 into main_grad, then grad_weight = None (no grad_added_to_main_grad);
    # unfused (autograd) it is the GEMM's output all the same.
    job = _job()
    old = SimOptions(attention=AttentionKernel.fused_softmax, wgrad_placeholder=False)
    assert not weight_grad_transient(old, job)
    unfused = dataclasses.replace(old, weight_grad_accumulation=WeightGradAccumulation.autograd)
    assert weight_grad_transient(unfused, job)
    assert dummy_wgrad_bytes(job, build_layout(job), dataclasses.replace(old, attention=AttentionKernel.flash),
                             dense=True, moe=False, head=True) == 0.0
    assert all(m.weight_grad == 0.0 for m in linear_moments(job, build_layout(job), old, moe=False))


@pytest.mark.parametrize("model", ["llama_tiny", "moe_tiny"])
def test_the_plans_shared_memory_holds_each_layer_kinds_moments_as_computed_per_rank(model: str) -> None:
    # layout_memory prices the moments once per plan; they are every rank's, computed again here.
    from cfp_megatron.sim.memory import layout_memory, unfused_attention_working_bytes

    job = _job() if model == "llama_tiny" else compose_job([f"model={model}", "cluster=local",
                                                             "cluster.gpus_per_node=2"])
    layout = build_layout(job)
    for options in (LOCAL, SimOptions(attention=AttentionKernel.flash)):
        common = layout_memory(job, layout, options)
        assert common.flows == (backward_flow_bytes(job, layout, options, moe=False),
                                backward_flow_bytes(job, layout, options, moe=True) if job.model.is_moe else 0.0)
        assert common.unfused_working == unfused_attention_working_bytes(job, layout, options)
