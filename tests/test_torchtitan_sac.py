"""torchtitan's per-op selective activation checkpointing (SelectiveAC, frameworks.yaml's torchtitan entry
``torch_op_sac``): what it recomputes and what it keeps, priced through the recomputation term (docs/validation.md,
"torchtitan's activation checkpointing")."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import Recompute
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import EAGER_TORCH_CE_BYTES, layer_activation_bytes, loss_bytes_per_logit
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.expert_dispatch import moe_block_cost, torch_dispatch_bytes
from cfp_megatron.validate import row_plan
from cfp_megatron.validation.defaults import LAYER_AC_DEFAULT_EVERY, layer_checkpoint_every
from tests.test_torch_fsdp_moe import ROW

SAC = SimOptions(torch_op_sac=True)


@functools.cache  # composing is the slow part; the specs are frozen
def _job(model: str, *overrides: str):
    return compose_job([f"model={model}", "cluster=dgx_h100", "cluster.nodes=1", "parallel.recompute=selective",
                        "train.micro_batch_size=1", "train.seq_length=4096", "train.global_batch_size=8",
                        *overrides])


def _costs(job, options: SimOptions, *, moe: bool):
    layout = build_layout(job)
    efficiency = efficiency_for(job.cluster)
    kernels = KernelModel(job.cluster, efficiency, NumberFormat.of(job.train))
    costs = collective_costs(job.cluster, None, efficiency)
    return layout, kernels, layer_cost(job, layout, kernels, costs, options, moe=moe)


def test_a_dense_block_recomputes_every_second_mm_and_its_element_wise_kernels() -> None:
    job = _job("llama3_8b")
    layout, kernels, sac = _costs(job, SAC, moe=False)
    model, tokens = job.model, 4096
    head = model.hidden_size // model.num_attention_heads
    q, kv, h, ffn = model.num_attention_heads * head, model.query_groups * head, model.hidden_size, model.ffn_size
    # the forward's GEMMs as the layer prices them (fused QKV, fused gated fc1), the rest its element-wise kernels
    gemms = (kernels.gemm(tokens, q + 2 * kv, h) + kernels.gemm(tokens, h, q) + kernels.gemm(tokens, 2 * ffn, h)
             + kernels.gemm(tokens, h, ffn))
    elementwise = sac.forward.compute_s - gemms
    # wq, wk, wv, wo, w1, w3, w2 in the order the block runs them: wq, wv, w1 and w2 saved, wk, wo, w3 recomputed
    recomputed = kernels.gemm(tokens, kv, h) + kernels.gemm(tokens, h, q) + kernels.gemm(tokens, ffn, h)
    assert sac.recompute.compute_s == pytest.approx(recomputed + elementwise)
    # SDPA is saved: no attention core runs again (Megatron-Core's selective recomputes only the core)
    megatron = _costs(job, SimOptions(), moe=False)[2]
    assert sac.recompute.attention_core_s == 0.0 < megatron.recompute.attention_core_s
    full = _costs(dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, recompute=Recompute.full)), SAC,
                  moe=False)[2]
    assert 0.0 < sac.recompute.compute_s < full.recompute.compute_s


def test_a_moe_block_recomputes_its_routed_experts_but_not_its_exchange() -> None:
    job = _job("mixtral_8x7b", "parallel.ep=8")
    _, _, sac = _costs(job, SAC, moe=True)
    plain = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, recompute=Recompute.none))
    _, _, none = _costs(plain, SAC, moe=True)
    assert sac.forward.ep_comm_s > 0.0 and sac.recompute.ep_comm_s == 0.0  # the all-to-all outputs are saved
    # the grouped GEMMs (torch._grouped_mm is not in the save list) and the router run again: most of the block
    assert sac.recompute.compute_s > 0.5 * (sac.forward.compute_s - _attention_gemms(job))
    assert none.recompute.compute_s == 0.0


def _attention_gemms(job) -> float:
    layout = build_layout(job)
    kernels = KernelModel(job.cluster, efficiency_for(job.cluster), NumberFormat.of(job.train))
    model = job.model
    head = model.hidden_size // model.num_attention_heads
    q, kv, h = model.num_attention_heads * head, model.query_groups * head, model.hidden_size
    tokens = layout.micro_batch * layout.seq_length
    return kernels.gemm(tokens, q + 2 * kv, h) + kernels.gemm(tokens, h, q)


def test_its_layers_keep_the_saved_outputs_and_the_block_input() -> None:
    job = _job("llama3_8b")
    layout = build_layout(job)
    model, tokens, elem = job.model, 4096, 2.0
    head = model.hidden_size // model.num_attention_heads
    q, kv, h, ffn = model.num_attention_heads * head, model.query_groups * head, model.hidden_size, model.ffn_size
    kept, full = layer_activation_bytes(job, layout, SAC, moe=False)
    # the block's input; wq's, wv's, w1's and w2's outputs; SDPA's output and its fp32 log-sum-exp a head
    per_token = elem * h + elem * (q + kv + ffn + h) + elem * q + 4.0 * model.num_attention_heads
    assert kept == pytest.approx(tokens * per_token)
    assert full == pytest.approx(tokens * elem * h)
    assert full < kept < layer_activation_bytes(job, layout, SimOptions(), moe=False)[0]


def test_a_torchtitan_row_reads_selective_as_its_per_op_policy() -> None:
    titan = row_plan({**ROW, "recompute": "selective"})
    assert titan.options.torch_op_sac and titan.job.parallel.recompute.value == "selective"
    other = row_plan({**ROW, "recompute": "selective", "framework": "Megatron-Core r0.8.0",
                      "zero_or_fsdp": "distributed optimizer"})
    assert not other.options.torch_op_sac


def test_layer_wise_checkpointing_recomputes_every_nth_block_whole() -> None:
    assert layer_checkpoint_every("selective") is None and layer_checkpoint_every("full") is None
    assert layer_checkpoint_every("selective (every 3rd layer)") == 3
    assert layer_checkpoint_every("selective, layer") == LAYER_AC_DEFAULT_EVERY == 2
    every = row_plan({**ROW, "recompute": "selective (layer, every 2)"})
    parallel = every.job.parallel
    # 24 of the 48 blocks recomputed whole, the others keeping their activations, as the block method counts them
    assert (parallel.recompute.value, parallel.recompute_method.value, parallel.recompute_num_layers) == (
        "full", "block", 24)
    full, none = (simulate(row_plan({**ROW, "recompute": r}).job, options=every.options) for r in ("full", "none"))
    half = simulate(every.job, options=every.options)
    assert none.time.recompute_s == 0.0
    assert half.time.recompute_s == pytest.approx(full.time.recompute_s / 2, rel=0.01)
    assert full.memory.total_gib < half.memory.total_gib < none.memory.total_gib


def test_the_blocks_block_recomputation_leaves_out_hide_fsdp_behind_their_backward_alone() -> None:
    # 64 GPUs, EP 8 in a node, one micro-batch: FSDP's backward collectives outlast a layer's backward
    row = {**ROW, "num_gpus": "64", "micro_batch": "1", "global_batch_seqs": "64"}
    every, full, none = (row_plan({**row, "recompute": r}) for r in ("selective (every 2nd layer)", "full", "none"))
    half_s, full_s, none_s = (simulate(p.job, options=p.options) for p in (every, full, none))
    # half the layers recompute, and only theirs widen FSDP's window: between the two, not faster than either
    assert none_s.time.fsdp_comm_s > half_s.time.fsdp_comm_s > full_s.time.fsdp_comm_s
    assert half_s.time.fsdp_comm_s == pytest.approx((none_s.time.fsdp_comm_s + full_s.time.fsdp_comm_s) / 2,
                                                    rel=0.02)
    assert none_s.step_time_s < half_s.step_time_s < full_s.step_time_s


def test_torchtitans_dispatch_sends_no_probabilities_and_its_combine_scores_in_fp32() -> None:
    job = _job("mixtral_8x7b", "parallel.ep=8")
    layout = build_layout(job)
    efficiency = efficiency_for(job.cluster)
    kernels = KernelModel(job.cluster, efficiency, NumberFormat.of(job.train))
    costs = collective_costs(job.cluster, None, efficiency)
    megatron = moe_block_cost(job, layout, kernels, costs)
    titan = moe_block_cost(job, layout, kernels, costs, torch_combine=True)
    # the same token rows cross the group; only the probabilities' all-to-all is gone
    assert titan.combine_s == pytest.approx(megatron.combine_s)
    assert 0.0 < megatron.dispatch_s - titan.dispatch_s < 0.2 * megatron.dispatch_s
    # each copy a rank's tokens send is gathered (2 + 2 bytes a hidden element), and its combine casts it to fp32,
    # scores it, casts it back and scatter-adds it where Megatron-Core's unpermutation moved 2 rows
    assert torch_dispatch_bytes(2.0).sent[0] == (2 + 2) + (2 + 4) + (4 + 4) + (4 + 2) + (2 + 2 + 2)
    assert titan.unfused_bytes_per_token[0] > megatron.unfused_bytes_per_token[0] == 0.0
    assert row_plan(ROW).options.torch_moe_combine


def test_torchtitans_eager_loss_keeps_twelve_bytes_a_logit_unless_its_recipe_compiles_it() -> None:
    assert EAGER_TORCH_CE_BYTES == 4 + 4 + 4  # saved log-softmax, nll's gradient, log-softmax's gradient input
    assert loss_bytes_per_logit(2.0, eager_torch=True) == 12.0 > loss_bytes_per_logit(2.0) == 6.0
    eager = row_plan(ROW)  # Qwen3-30B-A3B: torchtitan's Qwen3 recipes leave compile off
    assert eager.options.eager_torch_loss
    compiled = row_plan({**ROW, "model": "DeepSeek-V3 16B"})  # its recipes compile the loss
    assert not compiled.options.eager_torch_loss
    logits = eager.job.train.micro_batch_size * 4096 * eager.job.model.padded_vocab_size
    grew = (simulate(eager.job, options=eager.options).memory.total_gib
            - simulate(eager.job, options=dataclasses.replace(eager.options, eager_torch_loss=False)).memory.total_gib)
    assert grew * 2**30 == pytest.approx(logits * (12.0 - 6.0), rel=0.01)


def test_under_tp_torchtitans_eager_loss_parallel_keeps_sixteen_bytes_a_logit_of_its_shard() -> None:
    plan = row_plan({**ROW, "tp": "2", "ep": "4"})
    assert plan.options.eager_torch_loss and plan.job.parallel.tp == 2
    logits = plan.job.train.micro_batch_size * 4096 * plan.job.model.padded_vocab_size / 2
    grew = (simulate(plan.job, options=plan.options).memory.total_gib
            - simulate(plan.job, options=dataclasses.replace(plan.options, eager_torch_loss=False)).memory.total_gib)
    assert grew * 2**30 == pytest.approx(logits * (16.0 - 6.0), rel=0.01)


def test_torchtitans_selective_keeps_less_than_no_recomputation_where_a_checkpointed_flash_core_keeps_more() -> None:
    """torchtitan's per-op policy keeps a subset of what the layer keeps; Megatron-Core's checkpointed core under a
    fused kernel keeps its inputs, RoPE's Q and K and the QKV output V is a view of, where the fused core alone keeps
    contiguous Q, K and V (Megatron-Core warns that a fused core need not be recomputed: transformer_config.py)."""
    titan = row_plan({**ROW, "recompute": "selective"})
    job, options = titan.job, titan.options
    layout = build_layout(job)
    none = layer_activation_bytes(job, layout, options, moe=True, recompute=Recompute.none)[0]
    assert options.flash_attention and options.torch_op_sac
    assert layer_activation_bytes(job, layout, options, moe=True)[0] < none
    megatron = layer_activation_bytes(job, layout, dataclasses.replace(options, torch_op_sac=False), moe=True)[0]
    model = job.model
    head = model.kv_channels or model.hidden_size // model.num_attention_heads
    q, kv = model.num_attention_heads * head, model.query_groups * head
    assert megatron - none == pytest.approx(2 * 4096 * 2 * (q + kv))  # bf16, mb2 x 4096 tokens: rotated Q and K
