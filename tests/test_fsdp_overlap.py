"""FSDP's collectives beside the passes (cfp_megatron.sim.terms.data_parallel): the backward's gather and scatter
hide behind the layer's recomputation, which runs inside its backward, and behind an expert exchange that waits on
another link (docs/simulator.md, "FSDP beside recomputation and the expert exchange")."""

from __future__ import annotations

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.terms.data_parallel import fsdp_beside_experts, fsdp_exposed, fsdp_sync
from cfp_megatron.sim.terms.overlap import COMM_SM_SHARE


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
    gather_s, scatter_s = fsdp_sync(plain, layout, costs, params=without.params, elem_bytes=kernels.elem,
                                    expert_params=without.expert_params)
    backward, recompute = with_full.backward, with_full.recompute
    assert recompute.compute_s > 0
    window_s = backward.compute_s + backward.attention_core_s + recompute.compute_s + recompute.attention_core_s
    beside_s = backward.ep_comm_s + recompute.ep_comm_s  # EP inside the node, the expert gathers across nodes
    assert backward.fsdp_comm_s == pytest.approx(fsdp_exposed(gather_s + scatter_s, window_s, beside_s=beside_s))
    # the 8-node expert gathers outlast the backward alone, so the recomputation hides some of them
    assert gather_s + scatter_s > without.backward.compute_s + without.backward.attention_core_s
    assert with_full.backward.fsdp_comm_s < without.backward.fsdp_comm_s
    assert with_full.forward.fsdp_comm_s == pytest.approx(without.forward.fsdp_comm_s)  # the forward is the same
