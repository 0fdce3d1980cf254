"""FSDP's collectives beside the passes (cfp_megatron.sim.terms.data_parallel): the backward's gather and scatter
hide behind the layer's recomputation, which runs inside its backward, and behind an expert exchange that waits on
another link (docs/simulator.md, "FSDP beside recomputation and the expert exchange")."""

from __future__ import annotations

import functools

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.sharding import Sharding
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.data_parallel import fsdp_beside_experts, fsdp_exposed, fsdp_sync
from cfp_megatron.sim.terms.overlap import COMM_SM_SHARE


@functools.cache  # composing is the slow part; the specs are frozen
def _job(*overrides: str):
    return compose_job(["model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=8", "parallel.ep=8",
                        "parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params",
                        "train.micro_batch_size=1", "train.seq_length=4096", "train.global_batch_size=64",
                        *overrides])


def _layer(job):
    layout = build_layout(job)
    efficiency = efficiency_for(job.cluster)
    costs = collective_costs(job.cluster, None, efficiency)
    kernels = KernelModel(job.cluster, efficiency, NumberFormat.of(job.train))
    return layout, costs, kernels, layer_cost(job, layout, kernels, costs, SimOptions(), moe=True)


def test_exposed_share_hides_behind_computation_then_the_other_links_wait() -> None:
    assert fsdp_exposed(10.0, 4.0) == pytest.approx(6.0 + 4.0 * COMM_SM_SHARE)
    # the exchange's wait on another link hides the rest, and slows no computation
    assert fsdp_exposed(10.0, 4.0, beside_s=3.0) == pytest.approx(3.0 + 4.0 * COMM_SM_SHARE)
    assert fsdp_exposed(10.0, 4.0, beside_s=30.0) == pytest.approx(4.0 * COMM_SM_SHARE)


def test_fsdp_is_beside_the_experts_only_where_they_take_different_links() -> None:
    # EP 8 inside each node, the expert-DP group one rank per node across the 8 nodes
    assert fsdp_beside_experts(_job(), build_layout(_job()))
    # one node: both on NVLink
    one = _job("cluster.nodes=1", "train.global_batch_size=8")
    assert not fsdp_beside_experts(one, build_layout(one))
    # EP 64 across the nodes and FSDP across them too: both on the NICs
    wide = _job("parallel.ep=64", "model.num_experts=64")
    assert not fsdp_beside_experts(wide, build_layout(wide))
    # no expert parallelism: nothing to be beside
    dense = _job("parallel.ep=1")
    assert not fsdp_beside_experts(dense, build_layout(dense))


def test_the_backward_gather_and_scatter_hide_behind_the_recomputation() -> None:
    plain, full = _job(), _job("parallel.recompute=full")
    layout, costs, kernels, without = _layer(plain)
    _, _, _, with_full = _layer(full)
    _, backward_comm_s = fsdp_sync(plain, layout, costs, params=without.params, elem_bytes=kernels.elem,
                                   expert_params=without.expert_params)  # the gather and the scatter
    backward, recompute = with_full.backward, with_full.recompute
    assert recompute.compute_s > 0
    window_s = backward.compute_s + backward.attention_core_s + recompute.compute_s + recompute.attention_core_s
    beside_s = backward.ep_comm_s + recompute.ep_comm_s  # EP inside the node, the expert gathers across nodes
    assert backward.fsdp_comm_s == pytest.approx(fsdp_exposed(backward_comm_s, window_s, beside_s=beside_s))
    # the 8-node expert gathers outlast the backward alone, so the recomputation hides some of them
    assert backward_comm_s > without.backward.compute_s + without.backward.attention_core_s
    assert with_full.backward.fsdp_comm_s < without.backward.fsdp_comm_s
    assert with_full.forward.fsdp_comm_s == pytest.approx(without.forward.fsdp_comm_s)  # the forward is the same


def test_pytorch_fsdp2_under_a_pipeline_gathers_once_and_scatters_after_the_passes() -> None:
    job = _job("parallel.pp=2", "train.global_batch_size=256")  # DP 32, 8 micro-batches of 1
    layout, costs, kernels, megatron = _layer(job)
    assert layout.dims.num_microbatches == 8
    torch = layer_cost(job, layout, kernels, costs, SimOptions(torch_fsdp=True), moe=True)
    gather_s, _ = fsdp_sync(job, layout, costs, params=megatron.params, elem_bytes=kernels.elem,
                            expert_params=megatron.expert_params)  # Megatron-FSDP: the forward's gather
    once = fsdp_sync(job, layout, costs, params=megatron.params, elem_bytes=kernels.elem,
                     expert_params=megatron.expert_params, torch_fsdp=True)
    assert once == pytest.approx((gather_s / 8, 0.0))  # a micro-batch's share of the one gather, nothing backward
    assert torch.backward.fsdp_comm_s == 0.0 < megatron.backward.fsdp_comm_s
    # the reduce-scatter once a step, after the passes, where Megatron-FSDP's are in every backward
    assert simulate(job, options=SimOptions(torch_fsdp=True)).time.dp_comm_s > 0.0 == simulate(job).time.dp_comm_s
    # without a pipeline FSDP2 gathers and scatters every micro-batch, as Megatron-FSDP does
    flat = _job()
    _, flat_costs, _, flat_layer = _layer(flat)
    assert fsdp_sync(flat, build_layout(flat), flat_costs, params=flat_layer.params, elem_bytes=kernels.elem,
                     expert_params=flat_layer.expert_params, torch_fsdp=True) == fsdp_sync(
        flat, build_layout(flat), flat_costs, params=flat_layer.params, elem_bytes=kernels.elem,
        expert_params=flat_layer.expert_params)


def test_pytorch_fsdp2_under_a_pipeline_holds_its_stages_layers_whole() -> None:
    job = _job("parallel.pp=2", "train.global_batch_size=256")
    dims = build_layout(job).dims
    torch, megatron = Sharding.megatron(job, dims, torch_fsdp=True), Sharding.megatron(job, dims)
    assert torch.gathers_once and not megatron.gathers_once
    layer, experts = 1e9, 0.5e9  # the experts sharded over their expert-DP group (4 ranks here)
    # 16 layers' bf16 weights and fp32 gradients (FSDP2 accumulates the unsharded gradient in its reduce dtype)
    assert torch.gathered_bytes(layer, experts, layers=16) == pytest.approx(16 * layer * (2 + 4))
    # Megatron-FSDP's default unit (twice a layer) prefetches one layer and, in the backward, queues two layers'
    # gradients besides the one being made and the one just queued (FsdpBuffers.layers)
    assert megatron.gathered_bytes(layer, experts, layers=16) == pytest.approx(layer * 2 * 2)
    assert megatron.backward_grad_bytes(layer, experts, layers=16) == pytest.approx(layer * 4 * 4)
    assert torch.backward_grad_bytes(layer, experts, layers=16) == 0.0  # held through the passes, gathered_bytes
