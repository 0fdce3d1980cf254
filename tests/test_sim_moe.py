"""The MoE block's cost and memory: dispatchers, overlap, imbalance, and the checks before any group starts."""

from __future__ import annotations

import pytest

from cfp_megatron.base.config import JobSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import LayerCost, layer_cost
from cfp_megatron.sim.layout import Layout, build_layout
from cfp_megatron.sim.pass_costs import CostCache, collective_costs
from cfp_megatron.sim.terms.expert_dispatch import MoeCost, expected_remote_nodes, moe_block_cost
from cfp_megatron.sim.terms.overlap import COMM_SM_SHARE, overlapped
from cfp_megatron.validate import load_preset

H100 = load_preset("dgx_h100")
MOE = {"name": "moe_test", "num_layers": 8, "hidden_size": 4096, "num_attention_heads": 32, "vocab_size": 51200,
       "max_position_embeddings": 4096, "activation": "swiglu", "num_experts": 64, "moe_router_topk": 8,
       "moe_ffn_hidden_size": 1536, "add_bias_linear": False}


def job(nodes: int = 4, model: dict | None = None, cluster: dict | None = None, **parallel):
    train = {"global_batch_size": parallel.pop("gbs", 64), "micro_batch_size": 1, "seq_length": 4096,
             "precision": "bf16"}
    return job_from_config({"model": {**MOE, **(model or {})}, "cluster": {**(cluster or H100), "nodes": nodes},
                            "parallel": parallel, "train": train})


def models(j: JobSpec, world: int) -> tuple[Layout, KernelModel, CollectiveCosts]:
    """The layout of ``j`` on ``world`` GPUs, and the kernel and collective models of its preset."""
    eff = efficiency_for(j.cluster)
    return (build_layout(j, world), KernelModel(j.cluster, eff, j.train.precision, fp8=False),
            collective_costs(j.cluster, None, eff))


def test_expected_remote_nodes() -> None:
    assert expected_remote_nodes(8, 1) == 0.0
    assert expected_remote_nodes(1, 4) == pytest.approx(0.75)  # one copy, on another node 3 times in 4
    assert expected_remote_nodes(8, 2) == pytest.approx(1 - 0.5 ** 8)
    assert expected_remote_nodes(64, 4) == pytest.approx(3.0, rel=1e-6)  # every other node


def test_deepep_sends_one_copy_per_node_and_is_cheaper_across_nodes() -> None:
    a2a = simulate(job(ep=32))
    flex = simulate(job(ep=32, model={"moe_token_dispatcher": "flex"}))
    # Top-8 over 4 nodes: at most 3 remote copies of a token instead of about 7 routed ones.
    assert flex.time.ep_comm_s < 0.6 * a2a.time.ep_comm_s
    assert flex.time.forward_compute_s == pytest.approx(a2a.time.forward_compute_s)


def test_expert_groups_inside_a_node_talk_faster_than_across() -> None:
    inside = simulate(job(ep=8))  # EP varies fastest after TP: one node
    across = simulate(job(ep=8, order="tp-cp-dp-ep-pp"))  # EP ranks 4 apart: two per node
    assert 0 < inside.time.ep_comm_s < across.time.ep_comm_s
    assert inside.time.forward_compute_s == pytest.approx(across.time.forward_compute_s)


def test_a2a_overlap_hides_the_all_to_all_and_costs_a_micro_batch_of_memory() -> None:
    plain = simulate(job(nodes=8, ep=32, pp=2, vpp=2, gbs=512))
    overlap = simulate(job(nodes=8, ep=32, pp=2, vpp=2, gbs=512, moe_a2a_overlap=True))
    assert overlap.time.ep_comm_s < plain.time.ep_comm_s
    assert overlap.step_time_s < plain.step_time_s
    # What is hidden still takes its share of the SMs.
    assert overlap.time.ep_comm_s >= COMM_SM_SHARE * 0.5 * plain.time.ep_comm_s
    assert overlap.memory.activations > plain.memory.activations


def test_a2a_overlap_pairs_each_exchange_with_one_computation_as_megatron_core_schedules_it() -> None:
    """Megatron-Core's combined 1F1B layer schedule runs each communication of one micro-batch beside one
    computation of another: backward combine | forward attention, forward dispatch | backward experts, backward
    dispatch | forward experts, forward combine | backward attention. A combine longer than the attention's forward
    is not hidden by the experts' computation after it, as a whole-layer window would have it."""
    j = job(nodes=8, ep=32, pp=2, vpp=2, gbs=512, moe_a2a_overlap=True)
    layout, kernels, comm = models(j, 64)
    block = moe_block_cost(j, layout, kernels, comm)
    layer = layer_cost(j, layout, kernels, comm, SimOptions(), moe=True)
    routed = 4096 * 8 / 1  # one micro-batch's tokens to their top-8 experts, no TP
    assert block.combine_s == pytest.approx(comm.seconds(Collective.all_to_all, routed * 4096 * 2.0, 32, 8))
    dispatch = block.dispatch_s - block.combine_s  # the tokens' all-to-all and their probabilities'
    experts_fwd = block.gemm_s + kernels.memory(block.elements_per_token * 4096 * 2.0)
    attention_fwd = layer.forward.compute_s + layer.forward.attention_core_s - experts_fwd
    attention_bwd = layer.backward.compute_s + layer.backward.attention_core_s - 2 * experts_fwd

    def exposed(comm_s: float, window_s: float) -> float:
        return sum(overlapped(comm_s, window_s))

    assert layer.forward.ep_comm_s == pytest.approx(block.metadata_s + exposed(dispatch, 2 * experts_fwd)
                                                    + exposed(block.combine_s, attention_bwd))
    assert layer.backward.ep_comm_s == pytest.approx(exposed(block.combine_s, attention_fwd)
                                                     + exposed(dispatch, experts_fwd))
    assert block.combine_s > attention_fwd  # here the backward combine outlasts the attention beside it
    whole_layer = exposed(block.dispatch_s, layer.forward.compute_s + layer.forward.attention_core_s)
    assert whole_layer < layer.backward.ep_comm_s < block.dispatch_s


def test_a2a_overlap_leaves_the_unpaired_passes_exchange_exposed() -> None:
    """Without pipelining the combined schedule runs the first forward and the last backward alone: over the step,
    one micro-batch's worth of each pass pays its exchange as if nothing overlapped it."""
    j = job(nodes=8, ep=32, gbs=256, moe_a2a_overlap=True)
    plain_j = job(nodes=8, ep=32, gbs=256)
    layout, kernels, comm = models(j, 64)
    paired = layer_cost(j, layout, kernels, comm, SimOptions(), moe=True)
    lone = layer_cost(plain_j, layout, kernels, comm, SimOptions(), moe=True)
    assert lone.forward.ep_comm_s > paired.forward.ep_comm_s
    assert paired.ep_alone_s == pytest.approx((lone.forward.ep_comm_s, lone.backward.ep_comm_s))
    pred = simulate(j)
    microbatches, layers = pred.num_microbatches, 8
    assert microbatches > 1
    paired_s = microbatches * layers * (paired.forward.ep_comm_s + paired.backward.ep_comm_s)
    alone_s = layers * (lone.forward.ep_comm_s - paired.forward.ep_comm_s
                        + lone.backward.ep_comm_s - paired.backward.ep_comm_s)
    assert pred.time.ep_comm_s == pytest.approx(paired_s + alone_s)


def test_shared_expert_overlap_hides_at_most_the_shared_expert() -> None:
    shared = {"moe_shared_expert_intermediate_size": 4096}
    plain = simulate(job(ep=32, model=shared))
    overlap = simulate(job(ep=32, model=shared, moe_shared_expert_overlap=True))
    assert overlap.time.ep_comm_s < plain.time.ep_comm_s
    assert overlap.time.forward_compute_s == pytest.approx(plain.time.forward_compute_s)


def test_routing_imbalance_slows_the_step_and_grows_memory() -> None:
    balanced = simulate(job(ep=8))
    skewed = simulate(job(ep=8), options=SimOptions(moe_routing_imbalance=1.3))
    assert skewed.step_time_s > balanced.step_time_s
    assert skewed.time.ep_comm_s == pytest.approx(1.3 * balanced.time.ep_comm_s, rel=0.05)
    assert skewed.memory.activations > balanced.memory.activations
    with pytest.raises(ConfigError, match="sim.moe_routing_imbalance"):
        SimOptions(moe_routing_imbalance=0.5)


def test_allgather_dispatcher_moves_every_token_to_every_rank() -> None:
    top2 = {"moe_router_topk": 2}
    a2a = simulate(job(nodes=1, ep=8, model=top2))
    allgather = simulate(job(nodes=1, ep=8, model={**top2, "moe_token_dispatcher": "allgather"}))
    # Top-2: the all-to-all moves two copies of each token, the all-gather all eight ranks' tokens.
    assert allgather.time.ep_comm_s > 2 * a2a.time.ep_comm_s


@pytest.mark.parametrize(("parallel", "model", "key"), [
    ({"ep": 8, "pp": 2, "moe_a2a_overlap": True}, {}, "parallel.moe_a2a_overlap"),
    ({"ep": 8, "moe_a2a_overlap": True, "recompute": "full"}, {}, "parallel.moe_a2a_overlap"),
    ({"ep": 1, "moe_a2a_overlap": True}, {}, "parallel.moe_a2a_overlap"),
    ({"ep": 8, "moe_a2a_overlap": True}, {"moe_token_dispatcher": "allgather"}, "parallel.moe_a2a_overlap"),
    ({"ep": 8, "moe_shared_expert_overlap": True}, {}, "parallel.moe_shared_expert_overlap"),
    ({"ep": 8, "moe_a2a_overlap": True, "moe_shared_expert_overlap": True},
     {"moe_shared_expert_intermediate_size": 1024}, "parallel.moe_shared_expert_overlap"),
])
def test_overlap_options_megatron_refuses_are_refused_by_name(parallel: dict, model: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        simulate(job(model=model, **parallel))


def test_gpu_only_moe_options_are_refused_on_a_cpu_cluster() -> None:
    cpu = {"name": "local", "device_name": "cpu", "gpus_per_node": 8}
    with pytest.raises(ConfigError, match="parallel.moe_a2a_overlap"):
        simulate(job(nodes=1, cluster=cpu, ep=8, moe_a2a_overlap=True))
    with pytest.raises(ConfigError, match="model.moe_token_dispatcher"):
        simulate(job(nodes=1, cluster=cpu, ep=8, model={"moe_token_dispatcher": "flex"}))


def test_a_shared_cost_cache_keeps_overlapped_and_plain_plans_apart() -> None:
    plain = job(nodes=8, ep=32, pp=2, vpp=2, gbs=512)
    overlap = job(nodes=8, ep=32, pp=2, vpp=2, gbs=512, moe_a2a_overlap=True)
    cache = CostCache.for_job(plain, None, SimOptions())
    simulate(plain, cache=cache)
    assert simulate(overlap, cache=cache).step_time_s == simulate(overlap).step_time_s


def test_the_alltoall_dispatcher_exchanges_counts_and_probabilities_too() -> None:
    """Megatron-Core's alltoall dispatcher all-gathers the per-expert token counts over the expert TP x EP group
    before each forward dispatch, and sends each routed copy's probability (fp32) in an all-to-all of its own: with
    EP both cost; without EP, or with DeepEP, neither."""
    def costs(j: JobSpec) -> tuple[MoeCost, LayerCost]:
        layout, kernels, comm = models(j, 4 * 8)
        return (moe_block_cost(j, layout, kernels, comm),
                layer_cost(j, layout, kernels, comm, SimOptions(), moe=True))

    (a2a, layer), (flex, _), (none, _) = costs(job(ep=8)), costs(job(ep=8, model={"moe_token_dispatcher": "flex"})), \
        costs(job())
    assert a2a.metadata_s > 0 and flex.metadata_s == 0 and none.metadata_s == 0 and none.dispatch_s == 0
    # On the forward pass only, beside the dispatch and combine both passes run.
    assert layer.forward.ep_comm_s - layer.backward.ep_comm_s == pytest.approx(a2a.metadata_s)
    assert layer.backward.ep_comm_s == pytest.approx(a2a.dispatch_s)
    # The probabilities' all-to-all: with the tokens' two, three all-to-alls of the routed copies a pass.
    _, _, comm = models(job(ep=8), 4 * 8)
    routed = 4096 * 8  # one micro-batch's tokens, each to its top-8 experts (balanced routing)
    assert a2a.dispatch_s == pytest.approx(2 * comm.seconds(Collective.all_to_all, routed * 4096 * 2.0, 8, 8)
                                           + comm.seconds(Collective.all_to_all, routed * 4.0, 8, 8))
    assert a2a.metadata_s == pytest.approx(comm.seconds(Collective.all_gather, 64 * 8.0 * 8, 8, 8))
