"""What a pipelined step pays as Megatron-Core runs it: the non-interleaved schedule's blocking exchanges (both
stages wait, then the device synchronisation), the exchanges of the pairs of stages that leave an NVLink domain at
the network's speed, the message Megatron-Core sends (whole without sequence parallelism), the tied embedding's
all-reduce between the first and the last stage, and the embedding's dense weight gradient (docs/simulator.md,
"Pipeline stages", "Blocking exchanges")."""

from __future__ import annotations

import dataclasses
import itertools
import sys

import pytest

from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.measured import Collective, Span
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.host_costs import exchange_sync_s
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import embedding_cost, layer_cost
from cfp_megatron.sim.layout import build_layout, pp_crossings
from cfp_megatron.sim.options import PipelineSchedule, SimOptions, WeightGradAccumulation
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.schedule import (
    Exchange,
    _blocking_program,
    blocking_order,
    interleaved_blocking_order,
    nic_sharing,
    rank_order,
    run_schedule,
)
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.data_parallel import tied_embedding_sync
from cfp_megatron.sim.terms.pipeline import exchange_fit, exchange_fits, exchange_gather_s, exchange_nic_s
from cfp_megatron.validate import load_preset

A100 = load_preset("dgx_a100")
GPT = {"name": "gpt_pipe", "num_layers": 16, "hidden_size": 2048, "num_attention_heads": 16, "vocab_size": 51200,
       "max_position_embeddings": 2048}


def job(nodes: int = 1, model: dict | None = None, cluster: dict | None = None, gbs: int = 32, **parallel):
    train = {"global_batch_size": gbs, "micro_batch_size": 1, "seq_length": 2048, "precision": "bf16"}
    return job_from_config({"model": model or GPT, "cluster": {**(cluster or A100), "nodes": nodes},
                            "parallel": parallel, "train": train})


def models(job_):
    efficiency = efficiency_for(job_.cluster)
    return KernelModel(job_.cluster, efficiency, job_.train.precision), collective_costs(job_.cluster,
                                                                                                  None)


# --- the schedule ---------------------------------------------------------------------------------------------------

def test_blocking_exchanges_of_two_stages_by_hand() -> None:
    """pp 2, two micro-batches, forward 1 s, backward 2 s, exchange x, call c. Rank 0: F0, send (with rank 1's
    receive: 1 + x + c), F1, then the exchange with rank 1's first send_backward_recv_forward, which rank 1 reaches
    after its F0 and B0 (4 + x + c): ends 4 + 2x + 2c; B0, recv_backward until rank 1's last send (after F1, B1:
    7 + 2x + 2c, ends 7 + 3x + 3c), B1. Without blocking the senders go on at once: 9 + 2x."""
    x, c = 0.25, 0.05
    blocked = run_schedule([[1.0]] * 2, [[2.0]] * 2, x, 2, blocking=True, call_s=c)
    assert blocked.end_s == pytest.approx((9 + 3 * x + 3 * c, 7 + 3 * x + 3 * c))
    assert max(run_schedule([[1.0]] * 2, [[2.0]] * 2, x, 2).end_s) == pytest.approx(9 + 2 * x)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 8), (4, 1), (3, 7), (6, 3)])
def test_blocking_without_exchange_time_is_the_bubble_formula(pp: int, m: int) -> None:
    res = run_schedule([[1.0]] * pp, [[2.0]] * pp, 0.0, m, blocking=True)
    assert max(res.end_s) == pytest.approx((m + pp - 1) * 3.0)


@pytest.mark.parametrize("pp,m", [(2, 1), (2, 5), (4, 8), (5, 3), (8, 16)])
def test_blocking_order_is_megatrons_and_every_transfer_meets_one_partner(pp: int, m: int) -> None:
    """Every pass runs once per rank in rank_order's order; each activation and gradient is sent in one exchange
    and received in one exchange of the neighbour, and an exchange with two transfers meets one exchange of the
    neighbour that holds both."""
    sides: dict[tuple, list[tuple[int, int]]] = {}
    for rank in range(pp):
        order = blocking_order(rank, pp, m)
        passes = [item for item in order if not isinstance(item, Exchange)]
        assert passes == [(fwd, mb) for fwd, mb, _ in rank_order(rank, pp, 1, m)]
        for position, item in enumerate(order):
            if isinstance(item, Exchange):
                neighbours = {t.boundary for t in (*item.sends, *item.receives)}
                assert len(neighbours) == 1 and neighbours <= {rank - 1, rank}
                for sending, transfers in ((True, item.sends), (False, item.receives)):
                    for transfer in transfers:
                        sides.setdefault((transfer, sending), []).append((rank, position))
    for transfer in {key[0] for key in sides}:
        assert len(sides[(transfer, True)]) == 1 and len(sides[(transfer, False)]) == 1
        (sender, _), (receiver, _) = sides[(transfer, True)][0], sides[(transfer, False)][0]
        assert (sender, receiver) == ((transfer.boundary, transfer.boundary + 1) if transfer.activation
                                      else (transfer.boundary + 1, transfer.boundary))
    for rank in range(pp):
        for item in blocking_order(rank, pp, m):
            if isinstance(item, Exchange) and len(item.sends) + len(item.receives) == 2:
                partners = {sides[(t, not sending)][0] for sending, ts in ((True, item.sends),
                                                                           (False, item.receives)) for t in ts}
                assert len(partners) == 1


def test_blocking_is_never_shorter_than_a_delay_between_passes() -> None:
    for pp, m, x in itertools.product((2, 3, 4, 8), (1, 4, 13), (0.05, 0.4)):
        f = [[1.0 + 0.3 * (rank == pp - 1)] for rank in range(pp)]  # the head on the last stage
        b = [[2.0 + 0.1 * (rank == 0)] for rank in range(pp)]  # the embedding's weight gradient on the first
        assert max(run_schedule(f, b, x, m, blocking=True).end_s) >= max(run_schedule(f, b, x, m).end_s) - 1e-9


def test_one_slow_pair_of_stages_slows_the_blocking_steady_state() -> None:
    """In the steady state each stage of a pair meets their exchange once per micro-batch (rank 1 after its
    forward, rank 2 after its backward), so one slower pair (a node boundary) adds its extra time to every
    micro-batch; the wrap-around entry (rank pp - 1 to 0) is not crossed without interleaving, and is with it."""
    pp, m, fast, slow = 4, 32, 0.01, 0.5
    base = max(run_schedule([[1.0]] * pp, [[2.0]] * pp, fast, m, blocking=True).end_s)
    crossing = max(run_schedule([[1.0]] * pp, [[2.0]] * pp, (fast, slow, fast, fast), m, blocking=True).end_s)
    assert crossing - base >= m * (slow - fast) - 1e-9
    wrapped = (fast, fast, fast, slow)
    assert max(run_schedule([[1.0]] * pp, [[2.0]] * pp, wrapped, m, blocking=True).end_s) == pytest.approx(base)
    assert max(run_schedule([[1.0]] * pp, [[2.0]] * pp, wrapped, m).end_s) == pytest.approx(
        max(run_schedule([[1.0]] * pp, [[2.0]] * pp, fast, m).end_s))
    interleaved = [[0.5, 0.5]] * pp, [[1.0, 1.0]] * pp
    assert max(run_schedule(*interleaved, wrapped, m).end_s) > max(run_schedule(*interleaved, fast, m).end_s)


@pytest.mark.parametrize("pp,m", [(4, 64), (3, 50)])
def test_long_blocking_schedules_extrapolate_exactly(pp: int, m: int) -> None:
    f = [[0.3] for _ in range(pp)]
    b = [[0.7] for _ in range(pp)]
    f[-1][0] += 0.25
    full = run_schedule(f, b, 0.05, m, blocking=True, call_s=0.01)
    short = run_schedule(f, b, 0.05, m, blocking=True, call_s=0.01, max_ops=1)
    assert full.simulated and not short.simulated
    assert short.end_s == pytest.approx(full.end_s, rel=1e-9)


def test_the_simulator_blocks_and_synchronises_as_megatron_core_runs_each_schedule(monkeypatch) -> None:
    """A GPU plan without interleaving asks for blocking exchanges and the synchronisation after each
    (batch_p2p_sync); with interleaving (overlap_p2p_comm) neither, unless it prices Megatron-LM's interleaved
    schedule before Megatron-Core (SimOptions.blocking_interleaved, both, and slower); on a CPU cluster (gloo)
    blocking without the synchronisation."""
    asked = []
    simulate_module = sys.modules["cfp_megatron.sim.simulate"]
    real = simulate_module.run_schedule

    def spy(*args, **kwargs):
        asked.append((kwargs.get("blocking", False), kwargs.get("call_s", 0.0)))
        return real(*args, **kwargs)

    monkeypatch.setattr(simulate_module, "run_schedule", spy)
    simulate(job(pp=2))
    asynchronous = simulate(job(pp=2, vpp=2))
    simulate(job(cluster={**A100, "device_name": "cpu"}, pp=2))
    blocked = simulate(job(pp=2, vpp=2), options=SimOptions(blocking_interleaved=True))
    assert asked[0] == (True, pytest.approx(exchange_sync_s())) and exchange_sync_s() > 0
    assert asked[1] == (False, 0.0)
    assert asked[2] == (True, 0.0)
    assert asked[3] == (True, pytest.approx(exchange_sync_s()))
    assert blocked.step_time_s > asynchronous.step_time_s



def test_interleaved_sends_to_both_neighbours_share_the_nic_by_hand() -> None:
    """pp 2, vpp 2, four micro-batches, forward 1 s, backward 2 s, free transfers except y on the NIC. Three
    exchanges of the steady state send to both neighbours at once (rank 0 after F2.c0 / B0.c1, the activation of
    micro-batch 2 and the gradient of 0; rank 1 after F2.c0 / B0.c0 and after F3.c0 / B1.c0, the second met by rank
    0's after F3.c0 / B1.c1), the others one tensor each way; the two ranks wait for each other in each, so both end
    3y later. Where only one link leaves the node, no exchange sends two tensors over it: nothing changes; nor
    without interleaving, whose exchanges send and receive over one link, opposite directions of a duplex NIC."""
    y, f, b = 0.1, [[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2
    free = run_schedule(f, b, 0.0, 4, blocking=True)
    shared = run_schedule(f, b, 0.0, 4, blocking=True, nic_s=(y, y))
    assert shared.end_s == pytest.approx(tuple(end + 3 * y for end in free.end_s))
    assert run_schedule(f, b, 0.0, 4, blocking=True, nic_s=(y, 0.0)).end_s == free.end_s
    one = [[1.0]] * 2, [[2.0]] * 2
    assert (run_schedule(*one, 0.25, 4, blocking=True, nic_s=(y, y)).end_s
            == run_schedule(*one, 0.25, 4, blocking=True).end_s)
    # Megatron-Core's interleaved schedule (asynchronous) is not walked exchange by exchange: unchanged
    assert run_schedule(f, b, 0.0, 4, nic_s=(y, y)).end_s == run_schedule(f, b, 0.0, 4).end_s


def test_each_side_counts_the_tensors_its_exchange_moves_over_the_nic_each_way() -> None:
    """The steady-state exchange of rank 0 that sends micro-batch 2's activation and 0's gradient and receives 1's
    gradient: two sends, one receive; rank 1's matching exchange receives both."""
    programs = [_blocking_program(rank, 2, 2, 4) for rank in range(2)]
    counts = nic_sharing(programs, (0.1, 0.1), 4 * 2 * 2 * 4)
    exchange = next(item for item in interleaved_blocking_order(0, 2, 2, 4)
                    if isinstance(item, Exchange) and len(item.sends) == 2 and len(item.receives) == 1)
    position = interleaved_blocking_order(0, 2, 2, 4).index(exchange)
    _, transfers, *_ = programs[0][position]
    assert sorted(counts[mine] for mine, _, _, _ in transfers) == [1, 2, 2]
    assert all(counts[theirs] == 2 for _, theirs, _, sending in transfers if sending)
    assert nic_sharing(programs, (0.0, 0.0), 4 * 2 * 2 * 4) == (1,) * 64


def test_the_nic_share_is_the_bandwidth_part_of_the_pairs_that_leave_a_node() -> None:
    """16 stages on two DGX A100: pairs 7 -> 8 and 15 -> 0 leave the node, and their transfer spends the message
    over the NIC's bandwidth on it (no latency); the others move over NVLink."""
    plan = job(nodes=2, pp=16, gbs=64)
    kernels, costs = models(plan)
    nic = exchange_nic_s(plan, build_layout(plan), kernels, costs, SimOptions())
    message = 2048 * 2048 * 2
    assert nic[7] == pytest.approx(message / costs.inter.bandwidth_bytes_per_s)
    assert nic[15] == nic[7] and nic[0] == 0.0 and sum(value > 0 for value in nic) == 2
    assert nic[7] < exchange_fits(plan, build_layout(plan), kernels, costs, SimOptions())[7]


def test_the_2021_interleaved_schedule_pays_for_the_shared_nic(monkeypatch) -> None:
    """TP 8, PP 2 over two DGX A100, two chunks a rank, Megatron-LM's blocking interleaved schedule: slower with the
    shared NIC priced than with it free; Megatron-Core's asynchronous schedule is not asked for it."""
    plan, options = job(nodes=2, tp=8, pp=2, vpp=2), SimOptions(blocking_interleaved=True)
    priced = simulate(plan, options=options).step_time_s
    asynchronous = simulate(plan).step_time_s
    simulate_module = sys.modules["cfp_megatron.sim.simulate"]
    monkeypatch.setattr(simulate_module, "exchange_nic_s", lambda *args: (0.0, 0.0))
    assert priced > simulate(plan, options=options).step_time_s
    assert simulate(plan).step_time_s == asynchronous

# --- where the exchanges run and what they carry --------------------------------------------------------------------

def test_pairs_of_stages_that_leave_a_node_are_found() -> None:
    assert pp_crossings(1, 8, 8, 8) == (False,) * 8  # one node
    assert pp_crossings(1, 16, 8, 16) == (*(False,) * 7, True, *(False,) * 7, True)  # stage 7 -> 8, wrap 15 -> 0
    assert pp_crossings(4, 4, 8, 16) == (False, True, False, True)  # two stages a node (TP 4)
    assert pp_crossings(8, 4, 8, 32) == (True,) * 4  # a node a stage (TP 8)
    assert pp_crossings(2, 4, 8, 16) == (False,) * 4  # each pipeline in its own node (DP 2)
    assert pp_crossings(1, 1, 8, 8) == ()
    layout = build_layout(job(nodes=2, pp=16))
    assert layout.pp_intra_node and layout.pp_crossings == pp_crossings(1, 16, 8, 16)


def test_a_pipeline_over_two_nodes_pays_the_network_where_it_crosses() -> None:
    """16 stages on two DGX A100: the pair 7 -> 8 exchanges over InfiniBand (one NIC per GPU), the others over
    NVLink; the same plan on one 16-GPU NVLink domain is faster by the blocking steady state's exchanges there."""
    plan = job(nodes=2, pp=16, gbs=64)
    kernels, costs = models(plan)
    layout = build_layout(plan)
    fits = exchange_fits(plan, layout, kernels, costs, SimOptions())
    message = 2048 * 2048 * 2
    assert fits[7] == pytest.approx(costs.flat(Collective.send_recv, message, 2, Span.inter_node))
    assert fits[0] == pytest.approx(costs.flat(Collective.send_recv, message, 2, Span.intra_node))
    assert fits[7] > 5 * fits[0]
    one_domain = job(nodes=2, pp=16, gbs=64, cluster={**A100, "nvlink_domain_size": 16})
    assert simulate(plan).step_time_s > simulate(one_domain).step_time_s + 32 * (fits[7] - fits[0])


def test_the_message_is_whole_without_sequence_parallelism() -> None:
    """Megatron-Core's get_tensor_shapes: (sequence / CP [/ TP under SP], micro-batch, hidden); Megatron-LM's old
    scatter/gather sent 1/TP and all-gathered it over TP on arrival."""
    plain, sp = job(tp=2, pp=2), job(tp=2, sp=True, pp=2)
    kernels, costs = models(plain)
    message = 2048 * 2048 * 2
    intra = Span.intra_node
    assert exchange_fit(plain, build_layout(plain), kernels, costs) == pytest.approx(
        costs.flat(Collective.send_recv, message, 2, intra))
    assert exchange_fit(sp, build_layout(sp), kernels, costs) == pytest.approx(
        costs.flat(Collective.send_recv, message / 2, 2, intra))
    assert exchange_fit(plain, build_layout(plain), kernels, costs, scatter_gather=True) == pytest.approx(
        costs.flat(Collective.send_recv, message / 2, 2, intra) + costs.seconds(Collective.all_gather, message, 2, 2))
    # the all-gather is the receiver's own part of it; under SP the 1/TP share is the tensor, gathered by no one
    gather = costs.seconds(Collective.all_gather, message, 2, 2)
    assert exchange_gather_s(plain, build_layout(plain), kernels, costs, scatter_gather=True) == pytest.approx(gather)
    assert exchange_gather_s(sp, build_layout(sp), kernels, costs, scatter_gather=True) == 0.0
    assert exchange_gather_s(plain, build_layout(plain), kernels, costs, scatter_gather=False) == 0.0


def test_only_the_receiver_gathers_after_a_blocking_exchange_by_hand() -> None:
    """pp 2, one micro-batch, forward 1 s, backward 2 s, an exchange of x of which g is the receiver's all-gather
    after it (Megatron-LM's scatter/gather). Rank 0: F0 (1), send_forward: the transfer ends at 1 + x - g and rank 0,
    which received nothing, goes on; rank 1 gathers: 1 + x, F0, B0 (4 + x), its send_backward ends at 4 + 2x - g
    (rank 0 waits in recv_backward), rank 0 gathers (4 + 2x) and runs B0: 6 + 2x. With g inside the transfer both
    sides pay it: rank 1 ends at 4 + 2x."""
    x, g = 0.25, 0.1
    f, b = [[1.0]] * 2, [[2.0]] * 2
    assert run_schedule(f, b, x, 1, blocking=True, gather_s=g).end_s == pytest.approx((6 + 2 * x, 4 + 2 * x - g))
    assert run_schedule(f, b, x, 1, blocking=True).end_s == pytest.approx((6 + 2 * x, 4 + 2 * x))
    # Megatron-Core's delays: the pass that needs the tensor waits for all of it, gathered or not
    assert run_schedule(f, b, x, 1, gather_s=g).end_s == run_schedule(f, b, x, 1).end_s


# --- what the ends of the pipeline pay ------------------------------------------------------------------------------

def test_tied_embeddings_all_reduce_between_the_ends_without_a_profile() -> None:
    """Tied (or with MTP layers) and pipelined: the first and the last rank all-reduce the word embedding's fp32
    gradient, over the network where they sit on different nodes; untied, or one stage: nothing."""
    vocab_params = 51200 * 2048
    for nodes, inter in ((1, False), (2, True)):
        plan = job(nodes=nodes, pp=8 * nodes, gbs=64)
        layout = build_layout(plan)
        _, costs = models(plan)
        expected = costs.seconds(Collective.all_reduce, vocab_params * 4.0, 2, 1 if inter else 2)
        assert [tied_embedding_sync(plan, layout, costs, vocab_params, r) for r in (0, 3, 8 * nodes - 1)] == [
            pytest.approx(expected), 0.0, pytest.approx(expected)]
        untied = dataclasses.replace(plan, model=dataclasses.replace(plan.model, tie_embeddings=False))
        assert tied_embedding_sync(untied, layout, costs, vocab_params, 0) == 0.0
        mtp = dataclasses.replace(untied, model=dataclasses.replace(untied.model, mtp_num_layers=1))
        assert tied_embedding_sync(mtp, layout, costs, vocab_params, 0) == pytest.approx(expected)
    tied, untied = job(pp=2), job(pp=2, model={**GPT, "tie_embeddings": False})
    assert simulate(tied).time.embedding_sync_s > 0 == simulate(untied).time.embedding_sync_s


def test_an_untied_output_layer_is_reduced_with_the_embedding_on_one_stage() -> None:
    tied, untied = job(gbs=64), job(gbs=64, model={**GPT, "tie_embeddings": False})
    assert simulate(untied).time.dp_comm_s > simulate(tied).time.dp_comm_s


def test_the_embedding_writes_its_whole_weight_gradient_every_micro_batch() -> None:
    """PyTorch's embedding backward zero-fills a dense vocab / TP x hidden gradient and Megatron adds it into the
    fp32 gradient buffer: bf16 written and read, fp32 read and written, per micro-batch."""
    for tp in (1, 2):
        plan = job(tp=tp)
        kernels, costs = models(plan)
        backward = embedding_cost(plan, build_layout(plan), kernels, costs)[1]
        hidden_bytes = 2048 * 2048 * 2
        tokens_s = kernels.memory(3 * hidden_bytes) + kernels.memory(2 * hidden_bytes)
        assert backward.compute_s - tokens_s == pytest.approx(kernels.memory(51200 / tp * 2048 * (2 * 2 + 2 * 4)))


def test_a_zero_bubble_schedule_runs_the_weight_gradients_as_passes_of_their_own() -> None:
    """Each layer's backward carries its weight-gradient GEMMs (as many FLOPs as the forward's GEMMs), which ZB-H2
    runs as W passes in the bubbles: faster than Megatron-Core's 1F1B of the same plan; over model chunks it is
    refused, naming the option (docs/simulator.md, "Zero-bubble schedules")."""
    plain = job(pp=4)
    zero_bubble = SimOptions(pipeline_schedule=PipelineSchedule.zb_h2)
    layer = simulate(plain, with_events=True)
    assert simulate(plain, options=zero_bubble).step_time_s < layer.step_time_s
    kernels, costs = models(plain)
    backward = layer_cost(plain, build_layout(plain), kernels, costs, SimOptions(), moe=False).backward
    assert 0.3 * backward.compute_s < backward.weight_grad_s < 0.5 * backward.compute_s
    with pytest.raises(ConfigError, match="sim.pipeline_schedule"):
        simulate(job(pp=4, vpp=2), options=zero_bubble)


@pytest.mark.parametrize("how, bytes_per_weight, first_free", [
    (WeightGradAccumulation.main_grad_hook, 2 + 2 * 4, False),  # bf16 gradient read, fp32 main gradient read+write
    (WeightGradAccumulation.autograd, 3 * 2, True),  # param.grad += new, in place, from the second micro-batch on
])
def test_unfused_weight_gradients_cost_their_add_every_micro_batch(how: WeightGradAccumulation,
                                                                   bytes_per_weight: int, first_free: bool) -> None:
    """Without gradient-accumulation fusion each layer's backward adds its weights' gradients to the step's with a
    memory-bound kernel of its own, a W pass's part under a zero-bubble schedule (docs/simulator.md,
    "Weight-gradient accumulation")."""
    plain = job(pp=4)  # 32 sequences, 8 micro-batches
    kernels, costs = models(plain)
    layout = build_layout(plain)
    fused = layer_cost(plain, layout, kernels, costs, SimOptions(), moe=False)
    unfused = layer_cost(plain, layout, kernels, costs, SimOptions(weight_grad_accumulation=how), moe=False)
    microbatches = layout.dims.num_microbatches
    added_s = kernels.memory(fused.params * bytes_per_weight) * ((microbatches - 1) / microbatches if first_free
                                                                 else 1.0)
    assert unfused.backward.compute_s - fused.backward.compute_s == pytest.approx(added_s)
    assert unfused.backward.weight_grad_s - fused.backward.weight_grad_s == pytest.approx(added_s)
    assert unfused.forward == fused.forward
    assert simulate(plain, options=SimOptions(weight_grad_accumulation=how)).step_time_s > simulate(plain).step_time_s
