"""The data-parallel sharding model (cfp_megatron.sim.sharding): bytes per state category against the documented
formulas, the simulator's FSDP against DeepSpeed's ZeRO-3, HSDP and offload, and the rule kept in one place."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from cfp_megatron.backends.deepspeed.costs import simulate_zero
from cfp_megatron.backends.deepspeed.zero_plan import zero_plan
from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import OptimizerKind, Precision
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.sharding import FsdpBuffers, Sharded, Sharding, StateBytes
from cfp_megatron.sim.simulate import predict_memory

P = 1e9
"""Parameters on the rank in the table."""


def _megatron_bytes(precision: str, fp32_grads: bool = True) -> StateBytes:
    return StateBytes.megatron(compose_job(["model=llama3_8b", "cluster=dgx_a100", f"train.precision={precision}",
                                            f"parallel.grad_reduce_in_fp32={str(fp32_grads).lower()}"]))


# (what, sharding, dp, bytes per parameter of weights, gradients, optimizer states), worked by hand:
# Megatron-Core's distributed optimizer guide (docs/source/api-guide/dist_optimizer.md): bf16 weights with fp32
# gradients 18 bytes, 6 + 12/d with the distributed optimizer; fp32 weights 16 bytes, 8 + 8/d. The ZeRO paper
# (Rajbhandari et al. 2020, mixed-precision Adam: 2 + 2 + K with K = 12, each stage dividing one more by N);
# DeepSpeed's engine keeps the gradients in the weights' dtype and an fp32 gradient partition besides (+4/N from
# stage 1, +4 at stage 0 with bf16), and at stage 2 counts the reduction straight into that fp32 partition.
TABLE = [
    ("megatron ddp bf16", Sharded.nothing, 8, "bf16", 2.0, 4.0, 12.0),
    ("megatron distopt bf16", Sharded.optimizer, 8, "bf16", 2.0, 4.0, 12.0 / 8),
    ("megatron ddp fp32", Sharded.nothing, 8, "fp32", 4.0, 4.0, 8.0),
    ("megatron distopt fp32", Sharded.optimizer, 8, "fp32", 4.0, 4.0, 8.0 / 8),
    ("megatron fsdp bf16", Sharded.parameters, 8, "bf16", 2.0 / 8, 4.0 / 8, 12.0 / 8),
    ("megatron fsdp fp32", Sharded.parameters, 4, "fp32", 4.0 / 4, 4.0 / 4, 8.0 / 4),
    ("zero0 bf16", 0, 8, 2.0, 2.0, 2.0 + 4.0, 12.0),
    ("zero1 bf16", 1, 8, 2.0, 2.0, 2.0 + 4.0 / 8, 12.0 / 8),
    ("zero2 bf16", 2, 8, 2.0, 2.0, 4.0 / 8, 12.0 / 8),
    ("zero3 bf16", 3, 8, 2.0, 2.0 / 8, (2.0 + 4.0) / 8, 12.0 / 8),
    ("zero0 fp32", 0, 8, 4.0, 4.0, 4.0, 8.0),  # torch's Adam on fp32 weights: no copies
    ("zero1 fp32", 1, 8, 4.0, 4.0, 4.0 + 4.0 / 8, 12.0 / 8),  # stage 1 clones an fp32 master partition
    ("zero3 fp32", 3, 8, 4.0, 4.0 / 8, 4.0 / 8, 8.0 / 8),  # stage 3 steps its fp32 partition in place
    ("zero3 bf16 1 rank", 3, 1, 2.0, 2.0, 6.0, 12.0),  # = ZeRO-0 on one rank
]


@pytest.mark.parametrize("row", TABLE, ids=[row[0] for row in TABLE])
def test_bytes_per_category_match_the_documented_formulas(row) -> None:
    what, mode, dp, *rest = row
    if what.startswith("megatron"):
        precision, weights, grads, optimizer = rest
        sharding = Sharding(sharded=mode, state=_megatron_bytes(precision), group=dp, expert_group=dp)
    else:
        elem, weights, grads, optimizer = rest
        sharding = Sharding.zero(stage=mode, dp=dp, elem=elem)
    memory = sharding.memory(P)
    assert (memory.weights / P, memory.gradients / P, memory.optimizer_states / P) == pytest.approx(
        (weights, grads, optimizer), rel=1e-12)
    assert memory.host == 0.0
    # the ZeRO paper's sum, for mixed precision: (2 + 2 + 12) at stage 0, falling with each stage
    if what == "zero3 bf16":
        assert (memory.weights + memory.optimizer_states) / P == pytest.approx((2 + 12) / 8)


def test_megatron_bf16_gradients_count_no_fp32_main_gradient() -> None:
    """Megatron's guide counts 4 + 16/d for 16-bit gradients (an fp32 main gradient cast at the step); the model
    keeps the buffer the step reads from (4 + 12/d), as the simulator always did (docs/simulator.md)."""
    sharding = Sharding(sharded=Sharded.optimizer, state=_megatron_bytes("bf16", fp32_grads=False), group=8)
    memory = sharding.memory(P)
    assert (memory.weights + memory.gradients) / P == 4.0 and memory.optimizer_states / P == 12.0 / 8


def test_experts_shard_over_their_own_group_and_the_bound_never_exceeds_the_memory() -> None:
    state = _megatron_bytes("bf16")
    sharding = Sharding(sharded=Sharded.optimizer, state=state, group=8, expert_group=2)
    memory = sharding.memory(P, expert_params=0.25 * P)
    assert memory.optimizer_states / P == pytest.approx(0.75 * 12 / 8 + 0.25 * 12 / 2)
    assert sharding.optimizer_params(P, 0.25 * P) == pytest.approx(0.75 * P / 8 + 0.25 * P / 2)
    for mode in Sharded:
        for group in (1, 2, 64):
            kept = Sharding(sharded=mode, state=state, group=group).memory(P)
            assert state.replicated(mode) * P <= kept.weights + kept.gradients + kept.optimizer_states + 1e-3


def test_hsdp_shards_inside_its_group_and_all_reduces_the_shard_across_replicas() -> None:
    state = _megatron_bytes("bf16")
    hsdp = Sharding(sharded=Sharded.parameters, state=state, group=8, replicas=4)
    fsdp = Sharding(sharded=Sharded.parameters, state=state, group=8)
    assert hsdp.memory(P) == fsdp.memory(P)

    class Costs:  # records the collectives priced
        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def seconds(self, op, nbytes, size, per_node=None):
            self.calls.append((op, nbytes, size, per_node))
            return 1.0 if nbytes > 0 and size > 1 else 0.0

    costs = Costs()
    assert fsdp.step_sync_s(costs, P, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8, expert_per_node=8) == (
        0.0, 0.0)  # its reduce-scatters and gathers happen in the passes
    sync_s, gather_s = hsdp.step_sync_s(costs, P, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8,
                                        expert_per_node=8)
    assert (sync_s, gather_s) == (1.0, 0.0)
    assert costs.calls[0] == (Collective.all_reduce, P * 4.0 / 8, 4, 1)  # the shard, across the replicas' nodes
    ddp = Sharding(sharded=Sharded.nothing, state=state, group=32)
    dist = Sharding(sharded=Sharded.optimizer, state=state, group=32)
    costs.calls.clear()
    assert ddp.step_sync_s(costs, P, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8, expert_per_node=8)[1] == 0
    assert dist.step_sync_s(costs, P, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8, expert_per_node=8)[1] == 1
    assert [call[0] for call in costs.calls if call[1] > 0] == [Collective.all_reduce, Collective.reduce_scatter,
                                                              Collective.all_gather]


def test_fsdp_gathers_experts_over_the_expert_group_and_keeps_them_whole_over_one_rank() -> None:
    state = _megatron_bytes("bf16")
    calls: list[tuple] = []

    class Costs:  # records the collectives priced
        def seconds(self, op, nbytes, size, per_node=None):
            calls.append((op, nbytes, size, per_node))
            return 1.0 if nbytes > 0 and size > 1 else 0.0

    layer, experts = P, 0.75 * P
    over_two = Sharding(sharded=Sharded.parameters, state=state, group=16, expert_group=2)
    assert over_two.pass_sync_s(Costs(), layer, weight_bytes=2.0, per_node=8, expert_params=experts,
                                expert_per_node=1) == (2.0, 2.0)
    assert calls == [(Collective.all_gather, 0.25 * P * 2.0, 16, 8), (Collective.reduce_scatter, 0.25 * P * 4.0, 16, 8),
                     (Collective.all_gather, experts * 2.0, 2, 1), (Collective.reduce_scatter, experts * 4.0, 2, 1)]
    calls.clear()
    whole = Sharding(sharded=Sharded.parameters, state=state, group=8, expert_group=1)  # EP spans the whole DP group
    assert whole.pass_sync_s(Costs(), layer, weight_bytes=2.0, per_node=8, expert_params=experts) == (1.0, 1.0)
    assert [call[1] for call in calls] == [0.25 * P * 2.0, 0.25 * P * 4.0]  # the dense part alone
    # what a rank holds gathered at once: the dense part where the experts stay whole, the whole layer elsewhere
    assert whole.gathered_bytes(layer, experts) == pytest.approx(0.25 * P * 2 * 2.0)
    assert over_two.gathered_bytes(layer, experts) == pytest.approx(P * 2 * 2.0)
    assert whole.backward_grad_bytes(layer, experts) == pytest.approx(0.25 * P * 4.0)  # and in the backward
    assert over_two.backward_grad_bytes(layer, experts) == pytest.approx(P * 4.0)
    assert whole.memory(layer, experts).weights == pytest.approx(0.25 * P * 2.0 / 8 + experts * 2.0)


def test_offload_moves_the_optimizer_partition_and_the_weights_to_the_host() -> None:
    plain = Sharding.zero(stage=3, dp=8, elem=2.0).memory(P)
    off = Sharding.zero(stage=3, dp=8, elem=2.0, offload_optimizer=True, offload_params=True).memory(P)
    assert off.weights == off.optimizer_states == 0.0
    assert off.gradients == pytest.approx(plain.gradients - 4.0 * P / 8)
    assert off.host == pytest.approx(plain.weights + plain.optimizer_states + 4.0 * P / 8)
    with pytest.raises(ConfigError, match="backend.offload_param"):
        Sharding.zero(stage=2, dp=8, elem=2.0, offload_params=True)
    with pytest.raises(ConfigError, match="sharding.group"):
        Sharding(sharded=Sharded.optimizer, state=StateBytes.deepspeed(elem=2.0, stage=1), group=0)
    assert StateBytes.deepspeed(elem=2.0, stage=1, optimizer=OptimizerKind.sgd).optimizer_states == 4.0


def _states(memory) -> float:
    return memory.parameters + memory.gradients + memory.optimizer_states


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_simulators_fsdp_and_deepspeeds_zero3_keep_the_same_states(precision: str) -> None:
    """The same model on the same 8 data-parallel ranks: Megatron's FSDP (the simulator's ``fsdp`` mode) and
    DeepSpeed's ZeRO-3 shard every state over them alike. In fp32 they keep the same bytes; in bf16 DeepSpeed
    keeps its bf16 gradient partition besides the fp32 one Megatron reduces into (2 bytes a parameter over 8)."""
    job = compose_job(["model=llama3_8b", "cluster=dgx_a100", f"train.precision={precision}",
                       "train.global_batch_size=64", "train.seq_length=2048"])
    fsdp_job = compose_job(["model=llama3_8b", "cluster=dgx_a100", f"train.precision={precision}",
                            "train.global_batch_size=64", "train.seq_length=2048",
                            "parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params"])
    fsdp = predict_memory(fsdp_job, world_size=8)
    plan = zero_plan(job, world=8, zero_stage=3, micro_batch=1, activation_checkpointing=False,
                     offload_optimizer=False, offload_param=False, bucket_elements=50_000_000,
                     precision=Precision(precision))
    zero3 = simulate_zero(job, plan).memory
    elem = 4.0 if precision == "fp32" else 2.0
    params = zero3.parameters * 8 / elem
    extra = 0.0 if precision == "fp32" else 2.0 * params / 8
    assert _states(zero3) == pytest.approx(_states(fsdp) + extra, rel=1e-9)


def test_the_bytes_per_parameter_rule_lives_in_one_module() -> None:
    """No other module of the package writes the bytes per parameter of the optimizer states or master weights
    (the copies in sim/memory.py, search/search.py and backends/deepspeed/costs.py were moved to sim/sharding.py)."""
    root = Path(__file__).resolve().parents[1] / "cfp_megatron"
    rule = re.compile(r"opt_per_param|opt_bytes|adam = 12|\(8\.0 if .*adam|\(4\.0 if (mixed|elem)|"
                      r"\* 4\.0 / dp|4\.0 if elem == 4\.0")
    found = [f"{path.relative_to(root)}:{number}" for path in sorted(root.rglob("*.py"))
             if path.name != "sharding.py"
             for number, line in enumerate(path.read_text().splitlines(), 1) if rule.search(line)]
    assert found == []


def test_pytorch_fsdp_keeps_its_fp32_shard_as_the_master_weights() -> None:
    # PyTorch's FSDP under mixed precision shards the fp32 parameter itself (the master weights) and casts to bf16
    # only at the all-gather: 16 bytes a parameter over the group (fp32 shard, fp32 gradient, Adam), where
    # Megatron-FSDP keeps a bf16 shard beside its fp32 master weights (18).
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.sim.options import SimOptions

    job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.precision=bf16",
                       "parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params",
                       "train.global_batch_size=16"])
    dims = ParallelDims.build(job, 8, te_available=False)
    megatron, torch_fsdp = Sharding.megatron(job, dims), Sharding.megatron(job, dims, torch_fsdp=True)
    params = 8e9
    ours, theirs = megatron.memory(params), torch_fsdp.memory(params)
    assert theirs.weights == 0.0 and ours.weights == pytest.approx(params * 2 / 8)
    assert (theirs.gradients, theirs.optimizer_states) == (ours.gradients, ours.optimizer_states)
    assert (theirs.gradients + theirs.optimizer_states) * 8 / params == pytest.approx(16.0)
    # the layers gathered for the passes are bf16 either way; FSDP2 holds two of them and, in a backward pass, one
    # layer's reduce-scatter input in fp32 beside the next layer's unsharded gradient in bf16 (foreach_reduce);
    # Megatron-FSDP as many as its default unit (10^9 parameters) prefetches and queues: 4 and 7 (FsdpBuffers)
    assert torch_fsdp.gathered_bytes(2e8) == pytest.approx(2e8 * 2 * 2)
    assert torch_fsdp.backward_grad_bytes(2e8) == pytest.approx(2e8 * (4 + 2))
    assert megatron.gathered_bytes(2e8) == pytest.approx(2e8 * 4 * 2)
    assert megatron.backward_grad_bytes(2e8) == pytest.approx(2e8 * 7 * 4)
    full = dict(predict_memory(job).parts)["weights"]
    assert full > 0 and dict(predict_memory(job, options=SimOptions(torch_fsdp=True)).parts)["weights"] == 0.0


def test_apex_distributed_adam_keeps_remainders_or_bf16_states_instead_of_fp32_master_weights() -> None:
    # Apex's DistributedFusedAdam over bf16 weights (StateBucket: exp_avg, exp_avg_sq in optim.dtype, an int16
    # remainder a parameter with store_param_remainders): 2 + 8 bytes a parameter over DP with fp32 states, 4 with
    # bf16 ones, where Megatron-Core's distributed optimizer keeps 4 + 8; weights and gradients as Megatron-Core's.
    from cfp_megatron.base.parallel_dims import ParallelDims
    from cfp_megatron.sim.options import ApexAdamStates

    job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.precision=bf16",
                       "parallel.distributed_optimizer=true", "train.global_batch_size=16"])
    dims = ParallelDims.build(job, 8, te_available=False)
    params = 8e9
    megatron = Sharding.megatron(job, dims).memory(params)
    for states, per_param in ((ApexAdamStates.remainders, 10.0), (ApexAdamStates.bf16, 4.0)):
        apex = Sharding.megatron(job, dims, apex_adam=states).memory(params)
        assert apex.optimizer_states * 8 / params == pytest.approx(per_param)
        assert (apex.weights, apex.gradients) == (megatron.weights, megatron.gradients)
    assert megatron.optimizer_states * 8 / params == pytest.approx(12.0)
    fp32 = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.precision=fp32",
                        "parallel.distributed_optimizer=true", "train.global_batch_size=16"])
    assert (StateBytes.megatron(fp32, apex_adam=ApexAdamStates.bf16)  # fp32 weights are their own master
            == StateBytes.megatron(fp32))


def test_megatron_fsdp_holds_what_its_prefetch_and_reduce_scatter_queue_keep() -> None:
    """Megatron-FSDP (megatron-core 0.16.1) gathers the next layers while what it prefetched is below half its
    communication unit, and frees a queued reduce-scatter's unsharded gradients only once the queue holds more than a
    unit: with the default unit (twice a layer, at least 10^9 parameters) a 2e8-parameter layer is gathered with the
    next 3 (4 layers' weights) and 7 layers' gradients are held (5 queued, the one just queued, the one being made);
    a 10^9 one with the next (2) and 4; the double buffer keeps two of each; Megatron-Bridge's 800M unit on Llama 3
    70B's 855M-parameter layers also two."""
    assert FsdpBuffers().layers(2e8) == (4, 7)
    assert FsdpBuffers().layers(1e9) == (2, 4)
    assert FsdpBuffers(double_buffer=True).layers(2e8) == (2, 2)
    assert FsdpBuffers(unit_size=800_000_000).layers(855e6) == (2, 2)
    assert FsdpBuffers().layers(2e8, layers=3) == (3, 3)  # a stage of three layers holds no more
    state = _megatron_bytes("bf16")  # bf16 weights, fp32 gradients
    megatron = Sharding(sharded=Sharded.parameters, state=state, group=8, megatron_fsdp=FsdpBuffers())
    fsdp2 = Sharding(sharded=Sharded.parameters, state=state, group=8)
    assert megatron.gathered_bytes(2e8, layers=32) == pytest.approx(4 * 2e8 * 2)
    assert fsdp2.gathered_bytes(2e8, layers=32) == pytest.approx(2 * 2e8 * 2)
    # the gradients exist in the backward only: one layer's, and each queued layer's beyond the activations its
    # backward freed (0.5 GB here of a layer's 0.8 GB of fp32 gradients)
    assert megatron.backward_grad_bytes(2e8, layers=32) == pytest.approx(7 * 2e8 * 4)
    assert megatron.backward_grad_bytes(2e8, layers=32, freed_per_layer=5e8) == pytest.approx(8e8 + 6 * 3e8)
    assert megatron.backward_grad_bytes(2e8, layers=32, freed_per_layer=1e9) == pytest.approx(8e8)
    assert fsdp2.backward_grad_bytes(2e8, layers=32) == pytest.approx(2e8 * 4)
    # the plan's Megatron-FSDP is the runtime's, with its defaults; PyTorch's FSDP keeps the FSDP2 rule
    job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "parallel.distributed_optimizer=true",
                       "parallel.fsdp=optim_grads_params", "train.global_batch_size=16"])
    from cfp_megatron.base.parallel_dims import ParallelDims
    dims = ParallelDims.build(job, 8, te_available=False)
    assert Sharding.megatron(job, dims).megatron_fsdp == FsdpBuffers()
    assert Sharding.megatron(job, dims, torch_fsdp=True).megatron_fsdp is None


def test_pytorch_fsdp_under_fp8_gathers_its_weights_in_bf16_with_no_quantised_copy() -> None:
    """torchao's float8 linears (torchtitan) cast the gathered bf16 weight inside each matmul and save the
    high-precision weight and input for the backward (``matmul_with_hp_or_float8_args``), so FSDP2's gathered
    layers are 2 bytes a parameter; Megatron-Core's Transformer Engine layers keep FP8 copies beside them."""
    from cfp_megatron.base.parallel_dims import ParallelDims

    job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.precision=fp8",
                       "parallel.distributed_optimizer=true", "parallel.fsdp=optim_grads_params",
                       "train.global_batch_size=16"])
    dims = ParallelDims.build(job, 8, te_available=False)
    torch_fsdp, megatron = Sharding.megatron(job, dims, torch_fsdp=True), Sharding.megatron(job, dims)
    assert torch_fsdp.state.weights == 2.0 and megatron.state.weights > 2.0
    assert torch_fsdp.gathered_bytes(2e8) == pytest.approx(2e8 * 2 * 2)
