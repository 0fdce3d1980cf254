"""The MoE block's cost and memory: dispatchers, overlap, imbalance, and the checks before any group starts."""

from __future__ import annotations

import json
import math

import pytest

from cfp_megatron.base.config import FlexBackend, JobSpec, Precision, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim import SimOptions, simulate
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import GROUPED_GEMM_FILE, KernelModel, grouped_gemm_shape
from cfp_megatron.sim.layer_cost import LayerCost, layer_cost
from cfp_megatron.sim.layout import Layout, build_layout
from cfp_megatron.sim.pass_costs import CostCache, collective_costs
from cfp_megatron.sim.terms import expert_dispatch
from cfp_megatron.sim.terms.expert_dispatch import (
    DispatchRatesError,
    MoeCost,
    all_to_all_costs,
    dispatch_rates,
    expected_remote_nodes,
    flex_kernels,
    flex_nvlink_rates,
    moe_block_cost,
    quantization_padding_copies,
    rank_hit_share,
)
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
    return (build_layout(j, world), KernelModel(j.cluster, eff, j.train.precision),
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
    # DeepEP lands the tokens by source rank: it skips the sender's permutation (less element-wise work).
    assert flex.time.forward_compute_s < a2a.time.forward_compute_s


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
    # Experts of 3,072: their forward outlasts the dispatch beside it, the attention does not outlast the combine.
    j = job(nodes=8, ep=32, pp=2, vpp=2, gbs=512, moe_a2a_overlap=True, model={"moe_ffn_hidden_size": 3072})
    layout, kernels, comm = models(j, 64)
    block = moe_block_cost(j, layout, kernels, comm)
    layer = layer_cost(j, layout, kernels, comm, SimOptions(), moe=True)
    routed = 4096 * 8 / 1  # one micro-batch's tokens to their top-8 experts, no TP
    assert block.combine_s == pytest.approx(comm.seconds(Collective.all_to_all, routed * 4096 * 2.0, 32, 8))
    dispatch = block.dispatch_s - block.combine_s  # the tokens' all-to-all and their probabilities'
    experts_fwd = block.gemm_s + kernels.memory(block.elements_per_token * 4096 * 2.0)
    experts_bwd = block.gemm_bwd_s + 2 * kernels.memory(block.elements_per_token * 4096 * 2.0)
    attention_fwd = layer.forward.compute_s + layer.forward.attention_core_s - experts_fwd
    attention_bwd = layer.backward.compute_s + layer.backward.attention_core_s - experts_bwd

    def exposed(comm_s: float, window_s: float) -> float:
        return sum(overlapped(comm_s, window_s))

    assert layer.forward.ep_comm_s == pytest.approx(block.metadata_s + exposed(dispatch, experts_bwd)
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
    a2a_comm = all_to_all_costs(comm, job(ep=8))  # NCCL's all-to-all at its NVLink ceiling
    assert a2a.dispatch_s == pytest.approx(2 * a2a_comm.seconds(Collective.all_to_all, routed * 4096 * 2.0, 8, 8)
                                           + a2a_comm.seconds(Collective.all_to_all, routed * 4.0, 8, 8))
    assert a2a.metadata_s == pytest.approx(comm.seconds(Collective.all_gather, 64 * 8.0 * 8, 8, 8))


def test_the_expert_all_to_all_runs_at_nccls_nvlink_ceiling() -> None:
    """NCCL's all-to-all has no NVLink SHARP path: inside an NVLink domain it moves at most
    ``DispatchRates.nccl_nvlink_share`` of the nominal NVLink bandwidth, however high the fitted share (Hopper's is
    1.0); a fitted share below the ceiling stands, the network is not capped, and a CPU cluster is left alone."""
    j = job(ep=8)
    _, _, comm = models(j, 4 * 8)
    ceiling = j.cluster.intra_node_bandwidth_gbps * 1e9 * dispatch_rates().nccl_nvlink_share
    assert comm.intra.bandwidth_bytes_per_s > ceiling  # the fitted share is above the ceiling
    capped = all_to_all_costs(comm, j)
    assert capped.intra.bandwidth_bytes_per_s == pytest.approx(ceiling)
    assert capped.inter == comm.inter and comm.intra.bandwidth_bytes_per_s > ceiling
    inside = 64e6
    assert capped.seconds(Collective.all_to_all, inside, 8, 8) > comm.seconds(Collective.all_to_all, inside, 8, 8)
    low = CollectiveCosts(j.cluster, intra_efficiency=0.5)
    assert all_to_all_costs(low, j) is low
    cpu = job(nodes=1, cluster={"name": "local", "device_name": "cpu", "gpus_per_node": 1})
    assert all_to_all_costs(comm, cpu) is comm


def test_token_drop_settings_are_checked_and_reach_megatron_core() -> None:
    """``moe_expert_capacity_factor`` (None: dropless) and ``moe_pad_expert_input_to_capacity`` are model options:
    checked as Megatron-Core checks them, and passed to its TransformerConfig."""
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.model.megatron_config import transformer_config

    cpu = {"name": "local", "device_name": "cpu", "gpus_per_node": 1}
    drop = job(nodes=1, cluster=cpu, model={"moe_expert_capacity_factor": 1.25,
                                            "moe_pad_expert_input_to_capacity": True})
    config = transformer_config(drop, ParallelDims.build(drop, 1, te_available=False), on_gpu=False)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity) == (1.25, True)
    dropless = job(nodes=1, cluster=cpu)
    config = transformer_config(dropless, ParallelDims.build(dropless, 1, te_available=False), on_gpu=False)
    assert (config.moe_expert_capacity_factor, config.moe_pad_expert_input_to_capacity) == (None, False)
    for model, key, says in (({"moe_expert_capacity_factor": 0.0}, "model.moe_expert_capacity_factor", "positive"),
                             ({"moe_expert_capacity_factor": float("nan")}, "model.moe_expert_capacity_factor",
                              "positive"),
                             ({"moe_pad_expert_input_to_capacity": True}, "model.moe_pad_expert_input_to_capacity",
                              "needs a capacity"),
                             ({"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True,
                               "moe_token_dispatcher": "flex"}, "model.moe_pad_expert_input_to_capacity", "DeepEP"),
                             ({"num_experts": None, "moe_router_topk": 1, "moe_expert_capacity_factor": 1.0},
                              "model.moe_expert_capacity_factor", "needs experts")):
        with pytest.raises(ConfigError) as err:
            job(model=model)
        assert key in err.value.keys and says in str(err.value), str(err.value)


def test_grouped_gemm_pays_for_whole_tiles_whole_waves_and_each_experts_weights() -> None:
    """The expert GEMMs from the kernel's shape: a fixed launch cost, then the longer of the tiles' arithmetic and
    the operands' traffic; a partial 128-row tile costs a whole one, the tiles of all experts run in waves of one per
    SM (132 on an H100), and each expert's weights are read once whatever its rows, so the rate per row falls far
    below the large-GEMM rate at small tokens per expert."""
    j = job()
    _, kernels, _ = models(j, 32)
    shape = grouped_gemm_shape()
    assert kernels.sm_count == 132
    tile_rate = kernels.gemm_flops_per_s * shape.plateau_vs_dense

    def rate(m: float, groups: int = 16) -> float:  # TFLOP/s of 16 experts' fc1 at m rows each
        return 2.0 * groups * m * 1536 * 2048 / kernels.grouped_gemm(groups, m, 1536, 2048) / 1e12

    rates = [rate(m) for m in (64, 256, 1024, 4096)]
    assert rates == sorted(rates) and rates[0] < 0.25 * rates[-1]
    # Compute-bound (one expert, 256 columns, k = 8,192): 66 x 2 tiles fill one wave, one row more takes two; a
    # partial tile of rows costs the whole tile.
    wave = 2.0 * 132 * 128 * 128 * 8192 / tile_rate
    assert kernels.grouped_gemm(1, 66 * 128, 256, 8192) == pytest.approx(shape.launch_s + wave)
    assert kernels.grouped_gemm(1, 66 * 128 + 1, 256, 8192) == pytest.approx(shape.launch_s + 2 * wave)
    assert kernels.grouped_gemm(1, 65 * 128 + 1, 256, 8192) == pytest.approx(shape.launch_s + wave)
    # At 16 rows the weights' bytes bound it: the arithmetic runs under them.
    traffic = kernels.memory(16 * (16 * 2048 + 2048 * 1536 + 16 * 1536) * 2.0)
    assert kernels.grouped_gemm(16, 16, 1536, 2048) == pytest.approx(shape.launch_s + traffic)


def test_a_grouped_gemm_costs_its_measured_launch_and_runs_large_shapes_at_the_dense_rate() -> None:
    """The grouped GEMM's two measured constants (one H200, torch._grouped_mm): however small, one costs its launch
    (about 30 us, so 8 tiny experts are no faster than the floor), and on large shapes its tiles run at the measured
    share of the dense GEMM rate the efficiencies give; each constant names its measurement."""
    j = job()
    _, kernels, _ = models(j, 32)
    shape = grouped_gemm_shape()
    assert 1e-5 < shape.launch_s < 1e-4 and 0.8 < shape.plateau_vs_dense < 1.2
    assert kernels.grouped_gemm(8, 1, 128, 128) == pytest.approx(shape.launch_s, rel=0.05)
    m, n, k = 4096, 28672, 4096  # Mixtral's fc1, 8 experts at 4,096 tokens each: whole tiles, nearly whole waves
    seconds = kernels.grouped_gemm(8, m, n, k) - shape.launch_s
    tiles = 8 * (m // 128) * (n // 128)
    flops = 2.0 * math.ceil(tiles / 132) * 132 * 128 * 128 * k
    assert seconds == pytest.approx(flops / (kernels.gemm_flops_per_s * shape.plateau_vs_dense))
    measured = json.loads(GROUPED_GEMM_FILE.read_text())["measured"]
    assert {"command", "date", "device", "launch_s", "plateau_vs_dense"} <= set(measured)


def test_token_drop_pads_to_capacity_and_dropless_follows_the_busiest_expert() -> None:
    """Dropless, the busiest expert rank computes and exchanges its routed tokens (the imbalance); token-drop, at
    most its capacity; padded to capacity, exactly its capacity whatever the routing, and with no count exchange."""
    def block(imbalance: float, **model) -> MoeCost:
        j = job(ep=8, model=model)
        layout, kernels, comm = models(j, 32)
        return moe_block_cost(j, layout, kernels, comm, imbalance=imbalance)

    pad = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    drop = {"moe_expert_capacity_factor": 1.25}
    dropless = (block(1.0), block(1.5))
    assert dropless[1].gemm_s > 1.3 * dropless[0].gemm_s and dropless[1].dispatch_s > 1.4 * dropless[0].dispatch_s
    padded = (block(1.0, **pad), block(1.5, **pad))
    assert padded[0].gemm_s == padded[1].gemm_s == dropless[0].gemm_s
    assert padded[0].dispatch_s == padded[1].dispatch_s == dropless[0].dispatch_s
    assert padded[0].metadata_s == 0 < dropless[0].metadata_s
    assert block(1.0, **{**pad, "moe_expert_capacity_factor": 1.5}).gemm_s == pytest.approx(dropless[1].gemm_s)
    assert block(1.5, **drop).gemm_s == pytest.approx(block(1.25).gemm_s)  # capped at the capacity
    assert block(1.1, **drop).gemm_s == pytest.approx(block(1.1).gemm_s)  # under it: what was routed
    assert block(1.5, **drop).metadata_s > 0  # sized by the counts, like dropless
    # The step follows: padded to capacity, an imbalanced routing costs nothing more.
    skew = SimOptions(moe_routing_imbalance=1.5)
    padded_skewed, padded_balanced = simulate(job(ep=8, model=pad), options=skew), simulate(job(ep=8, model=pad))
    assert padded_skewed.step_time_s == pytest.approx(padded_balanced.step_time_s)
    assert padded_skewed.memory.activations == pytest.approx(padded_balanced.memory.activations)
    assert simulate(job(ep=8), options=skew).step_time_s > simulate(job(ep=8)).step_time_s


def test_which_dispatchers_wait_for_the_token_counts_on_the_host() -> None:
    """What the host-time term reads: every MoE dispatcher but drop-and-pad copies the counts to the host."""
    pad = job(model={"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}).model
    assert not pad.moe_counts_to_host and not pad.moe_dropless
    assert job().model.moe_counts_to_host and job().model.moe_dropless
    assert job(model={"moe_expert_capacity_factor": 1.0}).model.moe_counts_to_host
    assert not job(model={"num_experts": None, "moe_router_topk": 1}).model.moe_counts_to_host


def test_routing_traffic_is_counted_from_the_kernels_megatron_core_runs() -> None:
    """The router's element-wise kernels grow with the experts (and the auxiliary loss reads the scores again), the
    permutations with the routed copies, and FP8 adds the quantisation of each grouped linear's input."""
    def block(**model) -> MoeCost:
        fp8 = model.pop("fp8", False)
        j = job(ep=8, model=model)
        layout, _, comm = models(j, 32)
        kernels = KernelModel(j.cluster, efficiency_for(j.cluster), Precision.fp8 if fp8 else j.train.precision)
        return moe_block_cost(j, layout, kernels, comm)

    def elements(**model) -> float:
        return block(**model).elements_per_token

    def router(**model) -> tuple[float, float]:
        return block(**model).router_bytes_per_token

    base = elements()
    # The router's bytes (fp32 scores here) grow with the experts: 64 more experts' 6d + 17 forward, 3d backward;
    # the auxiliary loss adds its fp32 scores' passes and its own routing map (unfused_router_bytes).
    assert elements(num_experts=128) == pytest.approx(base)
    assert tuple(b - a for a, b in zip(router(), router(num_experts=128), strict=True)) == pytest.approx(
        (64 * (6 * 4.0 + 17.0), 64 * 3 * 4.0))
    assert tuple(b - a for a, b in zip(router(), router(moe_aux_loss_coeff=0.01), strict=True)) == pytest.approx(
        (64 * (2 * 4.0 + 4 * 4.0 + 18.0), 64 * (3 * 4.0 + 2 * 4.0)))
    # Top-4 instead of top-8: half the copies through permutation 1/2 and the unpermutation (and the activation).
    assert elements(moe_router_topk=4) < 0.6 * base
    # FP8: each grouped linear's input quantised, and the experts' rows copied into the padded buffer and back
    # (dropless: the counts are the routing's, not multiples of 16).
    assert elements(fp8=True) - base == pytest.approx(8 * (4096 + 1536) * 4.0 / 2.0 + 2 * 2.0 * 8 * 4096)


def test_fp8_experts_copy_their_rows_to_the_padded_buffer_unless_already_aligned() -> None:
    """Megatron-Core's TEGroupedMLP pads each expert's rows to a multiple of 16 (32 for MXFP8/NVFP4) under FP8/FP4
    by a copy, unless every expert's rows already are one: dropless and unpadded token-drop copy, drop-and-pad copies
    only where its capacity is not a multiple, the flex dispatcher's DeepEP lands the routing's counts (copied),
    HybridEP pads in its dispatch (none), 16-bit formats never pad."""
    def copies(precision: Precision | str = Precision.fp8, tokens: int = 4096, backend: str = "deepep",
               **model) -> bool:
        j = job(ep=8, model=model, moe_flex_dispatcher_backend=backend)
        layout, _, _ = models(j, 32)
        kernels = KernelModel(j.cluster, efficiency_for(j.cluster), precision)
        return quantization_padding_copies(j, layout, kernels, local_tokens=tokens)

    assert copies()  # dropless alltoall
    assert copies(moe_expert_capacity_factor=1.0)  # token-drop, unpadded: the routing's counts
    assert not copies(Precision.bf16)
    assert copies(moe_token_dispatcher="flex")  # DeepEP
    assert not copies(moe_token_dispatcher="flex", backend="hybridep")
    padded = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    # 4,096 tokens x top-8 over 64 experts: 512 rows from each of 8 ranks, a multiple of 16; 4,100 tokens: 513 x 8.
    assert not copies(**padded)
    assert copies(tokens=4100, **padded)
    assert copies(tokens=4098, **padded) and not copies(tokens=4094, **padded)  # 513 x 8 = 4104; 512 x 8


def test_the_validator_reads_token_drop_rows_from_their_notes() -> None:
    """A MoE row's notes name a token-drop variant (Megatron-Bridge's: capacity 1.0, padded); any other runs
    dropless, Megatron-Core's default."""
    from cfp_megatron.validation.moe_routing import routing

    footnote = "MoE benchmarks force-balanced routing, token-dropless unless noted. "
    assert routing({"notes": footnote + "Token-drop variant."}).model_fields() == {
        "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    # Under the flex dispatcher (priced as DeepEP, which does not pad): the capacity, unpadded.
    assert routing({"notes": "Token-drop variant"}).model_fields(flex=True) == {
        "moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": False}
    for notes in (footnote, "", None, "Dropless."):
        assert routing({"notes": notes}).model_fields() == {
            "moe_expert_capacity_factor": None, "moe_pad_expert_input_to_capacity": False}


def test_the_plan_says_how_the_experts_take_their_tokens(tmp_path, capsys) -> None:
    """The preflight prints the MoE routing it priced, and plan.json carries it among the job's inputs."""
    import json

    from cfp_megatron.planner import plan_cli

    assert plan_cli.main(["model=moe_tiny", "cluster=dgx_h100", "cluster.gpus_per_node=2", "train.global_batch_size=4",
                          "model.moe_expert_capacity_factor=1.25", "model.moe_pad_expert_input_to_capacity=true",
                          "--out", str(tmp_path)]) == 0
    assert "MoE routing: token-drop at capacity factor 1.25, padded to capacity" in capsys.readouterr().out
    (plan,) = tmp_path.glob("*/plan.json")
    inputs = dict(json.loads(plan.read_text())["inputs"])
    assert inputs["model.moe_expert_capacity_factor"] == 1.25 and inputs["model.moe_pad_expert_input_to_capacity"]


def test_an_expert_group_inside_a_multi_node_nvlink_domain_talks_over_nvlink() -> None:
    """An NVL72 rack is one NVLink domain of 72 GPUs over 18 trays of 4: an EP=16 group spanning 4 trays all-to-alls
    over NVLink; the same group where each tray were its own domain crosses the network with the per-GPU links."""
    rack = load_preset("gb200_nvl72")
    inside = simulate(job(nodes=4, cluster=rack, ep=16))
    across = simulate(job(nodes=4, cluster={**rack, "nvlink_domain_size": None}, ep=16))
    assert 0 < 3 * inside.time.ep_comm_s < across.time.ep_comm_s
    assert inside.time.forward_compute_s == pytest.approx(across.time.forward_compute_s)


def test_on_a_cpu_cluster_each_expert_is_a_plain_gemm() -> None:
    """CPU ranks run Megatron-Core's SequentialMLP, one matmul per expert: no tiles to pad, no waves."""
    cpu = job(nodes=1, cluster={"name": "local", "device_name": "cpu", "gpus_per_node": 8})
    _, kernels, _ = models(cpu, 8)
    assert kernels.grouped_gemm(4, 16, 96, 64) == pytest.approx(4 * kernels.gemm(16, 96, 64))


def test_hybridep_inside_an_nvl72_domain_runs_at_its_measured_rates() -> None:
    """On GB200 NVL72 an EP group of 64 ranks on 256 GPUs (64 per rack) stays on NVLink under HybridEP (multi-node
    NVLink), and its dispatch and combine each move the rows a rank receives (one per token and destination rank, as
    DeepEP and HybridEP send them and their benchmarks count them) at HybridEP's measured rate for that many ranks
    (an SM-bound kernel's rate, below DeepEP's share of NVLink 5's 900 GB/s); on H100 the share of its 450 GB/s is
    lower and stands."""
    gb200 = {**load_preset("gb200_nvl72"), "nodes": 64}
    flex = {"moe_token_dispatcher": "flex"}
    for ep, world, ranks in ((64, 256, 36), (8, 8, 8)):
        j = job(nodes=world // 4, model=flex, cluster=gb200, ep=ep, gbs=world, moe_flex_dispatcher_backend="hybridep")
        layout, kernels, comm = models(j, world)
        assert layout.ep_per_node == ep  # the whole EP group inside one NVLink domain: no RDMA part
        block = moe_block_cost(j, layout, kernels, comm)
        _, dispatch_gbps, combine_gbps = next(row for row in dispatch_rates().hybridep_nvlink_gbps
                                            if row[0] == ranks)
        assert dispatch_gbps * 1e9 < dispatch_rates().deepep_intra_share * comm.intra.bandwidth_bytes_per_s
        # the rows a rank receives: one bf16 row per token that has any of its experts (4,096 tokens per rank)
        hit = 1 - math.comb(64 - 64 // ep, 8) / math.comb(64, 8)  # 64 experts, top-8
        assert rank_hit_share(64, 64 // ep, 8) == pytest.approx(hit)
        sent = 4096 * ep * hit * MOE["hidden_size"] * 2.0
        assert block.combine_s == pytest.approx(sent / (combine_gbps * 1e9) + comm.intra.latency_s)
        assert block.dispatch_s - block.combine_s == pytest.approx(sent / (dispatch_gbps * 1e9)
                                                                   + comm.intra.latency_s)
    h100 = job(model=flex, ep=8)
    layout, kernels, comm = models(h100, 32)
    share = dispatch_rates().deepep_intra_share
    for backend in FlexBackend:
        assert flex_nvlink_rates(comm, layout.ep_per_node, flex_kernels(backend)) == (
            share * comm.intra.bandwidth_bytes_per_s,) * 2


def test_deepep_on_nvl72_reaches_over_nvlink_only_inside_a_host() -> None:
    """DeepEP's NVLink buffers (CUDA IPC) span one host: on GB200 NVL72 (4 GPUs a host) an EP group of 64 ranks in
    one rack sends to the other 15 hosts over RDMA, one copy per destination host, and is slower than HybridEP, whose
    kernels span the rack; a backend the source does not state (the validator's) keeps DeepEP's rates over the whole
    domain, whose 24-rank row is its slowest combine."""
    gb200 = {**load_preset("gb200_nvl72"), "nodes": 64}
    flex = {"moe_token_dispatcher": "flex"}
    blocks = {}
    for backend in FlexBackend:
        j = job(nodes=64, model=flex, cluster=gb200, ep=64, gbs=256, moe_flex_dispatcher_backend=backend.value)
        layout, kernels, comm = models(j, 256)
        assert (layout.ep_per_node, layout.ep_per_host) == (64, 4)
        blocks[backend] = moe_block_cost(j, layout, kernels, comm)
    deepep, hybridep = blocks[FlexBackend.deepep], blocks[FlexBackend.hybridep]
    tokens = 4096 * MOE["hidden_size"] * 2.0
    rdma = tokens * expected_remote_nodes(MOE["moe_router_topk"], 16) / (
        comm.inter.bandwidth_bytes_per_s * dispatch_rates().deepep_inter_share) + comm.inter.latency_s
    assert deepep.combine_s >= rdma - 1e-12 and deepep.combine_s == pytest.approx(rdma)
    assert deepep.dispatch_s > hybridep.dispatch_s
    unstated = moe_block_cost(j, layout, kernels, comm, flex_unstated=True)
    _, _, combine_gbps = dispatch_rates().deepep_nvlink_gbps[-1]
    sent = 4096 * 64 * rank_hit_share(64, 1, 8) * MOE["hidden_size"] * 2.0
    assert unstated.combine_s == pytest.approx(sent / (combine_gbps * 1e9) + comm.intra.latency_s)


def test_hybridep_gathers_the_routing_map_before_each_forward_dispatch() -> None:
    """HybridEP's metadata preprocessing all-gathers the routing map (one bool per token and expert) over the EP
    group in every forward dispatch (``HybridEPBuffer.dispatch_with_permute`` without a handle, as Megatron-Core
    calls it); DeepEP exchanges nothing before its dispatch. Both permute what arrives, by the same rows."""
    flex = {"moe_token_dispatcher": "flex"}
    blocks = {}
    for backend in FlexBackend:
        j = job(model=flex, ep=8, moe_flex_dispatcher_backend=backend.value)
        layout, kernels, comm = models(j, 32)
        blocks[backend] = moe_block_cost(j, layout, kernels, comm)
    assert blocks[FlexBackend.deepep].metadata_s == 0.0
    gathered = 4096 * MOE["num_experts"] * expert_dispatch.ROUTING_MAP_BYTES * 8
    assert blocks[FlexBackend.hybridep].metadata_s == pytest.approx(
        comm.seconds(Collective.all_gather, gathered, 8, layout.ep_per_node))
    assert blocks[FlexBackend.deepep].elements_per_token == blocks[FlexBackend.hybridep].elements_per_token


def test_alltoall_inside_an_nvl72_rack_stays_on_nvlink_at_nccls_ceiling() -> None:
    """The alltoall dispatcher at EP 64 on 256 GB200s (64 GPUs a rack): the group is inside one NVLink domain, and
    its token all-to-all is priced on NVLink at NCCL's all-to-all ceiling (370 / 450 of the 900 GB/s line rate), not
    over the network."""
    gb200 = {**load_preset("gb200_nvl72"), "nodes": 64}
    j = job(nodes=64, cluster=gb200, ep=64, gbs=256)
    layout, kernels, comm = models(j, 256)
    assert layout.ep_per_node == 64
    block = moe_block_cost(j, layout, kernels, comm)
    link = all_to_all_costs(comm, j).intra
    assert link.bandwidth_bytes_per_s == pytest.approx(900e9 * dispatch_rates().nccl_nvlink_share)
    routed = 4096 * MOE["moe_router_topk"] * MOE["hidden_size"] * 2.0
    assert block.combine_s == pytest.approx(63 * link.latency_s + routed * 63 / 64 / link.bandwidth_bytes_per_s)


def test_the_dispatch_rates_come_from_their_data_file() -> None:
    """The dispatchers' shares and HybridEP's rates are the data file's, its NCCL share the bus rate over the line
    rate; the file ships with the package."""
    import yaml

    data = yaml.safe_load(expert_dispatch.RATES_FILE.read_text())
    rates = dispatch_rates()
    assert rates.deepep_intra_share == data["deepep_intra_share"]
    assert rates.deepep_inter_share == data["deepep_inter_share"]
    assert rates.nccl_nvlink_share == data["nccl_nvlink"]["bus_gbps"] / data["nccl_nvlink"]["line_gbps"]
    assert [row[0] for row in rates.hybridep_nvlink_gbps] == [row["ranks"] for row in data["hybridep_nvlink"]]
    assert rates.deepep_nvlink_gbps == tuple((row["ranks"], row["dispatch_gbps"], row["combine_gbps"])
                                             for row in data["deepep_nvlink"])
    assert 0 < rates.nccl_nvlink_share < 1 and 0 < rates.deepep_intra_share < 1
    assert all(combine <= dispatch for _, dispatch, combine in rates.deepep_nvlink_gbps)


@pytest.mark.parametrize(("text", "named"), [
    ("deepep_intra_share: 0.77\n", "deepep_inter_share"),
    ("deepep_intra_share: 0.77\ndeepep_inter_share: 0.9\nnccl_nvlink: {bus_gbps: 370, line_gbps: 450}\n"
     "deepep_nvlink: [{ranks: 8, dispatch_gbps: 1, combine_gbps: 1}]\n"
     "hybridep_nvlink: [{ranks: 16, dispatch_gbps: 1, combine_gbps: 1}, {ranks: 8, dispatch_gbps: 1, combine_gbps: 1}]"
     "\n", "hybridep_nvlink has rows at ranks \\[16, 8\\]"),
])
def test_a_malformed_dispatch_rates_file_is_refused_by_name(tmp_path, monkeypatch: pytest.MonkeyPatch, text: str,
                                                            named: str) -> None:
    """A rates file missing a key, or with HybridEP's rows out of order, raises an error naming the file and the
    fix."""
    path = tmp_path / "dispatch_rates.yaml"
    path.write_text(text)
    monkeypatch.setattr(expert_dispatch, "RATES_FILE", path)
    dispatch_rates.cache_clear()
    try:
        with pytest.raises(DispatchRatesError, match=named) as raised:
            dispatch_rates()
        assert str(path) in str(raised.value) and "fix:" in str(raised.value)
    finally:
        dispatch_rates.cache_clear()
