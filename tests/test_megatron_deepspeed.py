"""Megatron-DeepSpeed rows (frameworks.yaml's entry, sim option ``deepspeed_engine``): which entry a row takes, what
it reads as, and the terms DeepSpeed's PipelineEngine and BF16_Optimizer execute (docs/validation.md,
"Megatron-DeepSpeed")."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.config import AttentionKernel, Recompute
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.grad_accumulation import accumulation_bytes, accumulation_mode
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions, WeightGradAccumulation
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.sharding import Sharded, Sharding, StateBytes
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validate import row_plan
from cfp_megatron.validation.data import FRAMEWORKS_FILE, ValidationDataError, load_data, load_frameworks
from cfp_megatron.validation.defaults import framework_of

DATA = load_data()
BLOOM_1B3 = {"id": "t1", "model": "BLOOM-1B3", "layers": "24", "hidden": "2048", "ffn_hidden": "8192", "heads": "16",
             "vocab": "250880", "seq_len": "2048", "gpu": "A100-80GB", "num_gpus": "16",
             "interconnect": "4 x 100 Gb/s Omni-Path per node", "framework": "Megatron-DeepSpeed", "tp": "2",
             "pp": "1", "micro_batch": "1", "global_batch_seqs": "64", "precision": "bf16", "step_time_s": "1"}


def _row(**columns: str) -> dict:
    return {**BLOOM_1B3, **columns}


@pytest.mark.parametrize("framework", ["Megatron-DeepSpeed", "Megatron-DeepSpeed (2022)", "megatron deepspeed",
                                       "bigscience Megatron-DeepSpeed (BLOOM)", "Meg-DS", "DeepSpeed-Megatron",
                                       "Megatron-LM + DeepSpeed", "Megatron-LM with DeepSpeed (ZeRO-1)", "MegDS"])
def test_a_megatron_deepspeed_row_takes_its_own_entry(framework: str) -> None:
    assert framework_of({"framework": framework}, DATA).name == "Megatron-DeepSpeed"


@pytest.mark.parametrize(("framework", "entry"), [("Megatron-LM (2022)", "Megatron-LM before 2023"),
                                                  ("Megatron-LM (2021)", "Megatron-LM before 2022"),
                                                  ("DeepSpeed", "any other framework")])
def test_other_frameworks_keep_theirs(framework: str, entry: str) -> None:
    assert framework_of({"framework": framework}, DATA).name == entry


def test_a_framework_pattern_that_does_not_compile_is_refused_by_entry(tmp_path) -> None:
    text = FRAMEWORKS_FILE.read_text().replace("match: {pattern: 'megatron", "match: {pattern: '(megatron", 1)
    (tmp_path / "frameworks.yaml").write_text(text)
    refused = r"entry 1 \('Megatron-DeepSpeed'\) has match pattern=.*not a regular"
    with pytest.raises(ValidationDataError, match=refused):
        load_frameworks(tmp_path / "frameworks.yaml")


def test_the_row_runs_what_the_pipeline_engine_executes() -> None:
    plan = row_plan(_row(pp="2"), data=DATA)
    parallel, options = plan.job.parallel, plan.options
    assert options.deepspeed_engine and options.pipeline_scatter_gather
    assert options.attention is AttentionKernel.fused_softmax
    assert plan.job.model.tie_embeddings
    assert not parallel.overlap_grad_reduce and not parallel.tp_comm_overlap
    assert parallel.grad_reduce_in_fp32  # BF16_Optimizer's fp32 buffer
    assert not parallel.distributed_optimizer  # blank: ZeRO stage 0, as the bigscience scripts configure it...
    bf16 = Sharding.megatron(plan.job, build_layout(plan.job).dims, deepspeed_engine=True)
    assert bf16.sharded is Sharded.optimizer  # ...where BF16_Optimizer shards its fp32 states all the same
    assert parallel.recompute is Recompute.full  # blank: the bigscience scripts' --checkpoint-activations
    assert " ds" in plan.layout
    stated = row_plan(_row(recompute="selective", zero_or_fsdp="none", precision="fp16"), data=DATA).job.parallel
    assert stated.recompute is Recompute.selective and not stated.distributed_optimizer
    assert not stated.grad_reduce_in_fp32  # FP16_Optimizer: fp16 gradients
    other = row_plan(_row(framework="Megatron-LM (2021)"), data=DATA)
    assert not other.options.deepspeed_engine and not other.job.model.tie_embeddings


def test_bf16_optimizer_keeps_its_fp32_buffer_whole_and_reduces_in_bf16() -> None:
    state = StateBytes.deepspeed(elem=2.0, stage=Sharded.optimizer, bf16_optimizer=True)
    assert (state.weights, state.gradients, state.reduced) == (2.0, 6.0, 2.0)  # bf16 grads + the whole fp32 buffer
    assert state.master_weights + state.optimizer_states == 12.0  # sharded over DP with the optimizer
    assert StateBytes.deepspeed(elem=2.0, stage=1).reduced == 2.0  # the ZeRO engine: the weights' dtype


def _priced(plan, monkeypatch):
    """(prediction, what the gradient sync was priced with) of a ``pp = 1`` plan: the sharding, the parameters on
    the rank, the gradient bytes, and the (sync, gather) seconds :meth:`Sharding.step_sync_s` returned."""
    calls = []
    original = Sharding.step_sync_s

    def recorded(self, costs, dense_params, expert_params, **kwargs):
        out = original(self, costs, dense_params, expert_params, **kwargs)
        calls.append((self, dense_params, kwargs["grad_bytes"], kwargs["weight_bytes"], out))
        return out

    monkeypatch.setattr(Sharding, "step_sync_s", recorded)
    pred = simulate(plan.job, options=plan.options)
    monkeypatch.undo()
    (sharding, params, grad_bytes, weight_bytes, (sync_s, gather_s)), = calls
    return pred, sharding, params, grad_bytes, weight_bytes, sync_s + gather_s


@pytest.mark.parametrize(("precision", "zero", "reduce", "gathers"), [
    ("bf16", "", Collective.all_reduce, True),  # BF16_Optimizer: its whole buffer, then the weights gathered
    ("bf16", "ZeRO-1", Collective.all_reduce, True),
    ("fp16", "", Collective.all_reduce, False),  # FP16_Optimizer: every rank steps every weight
    ("fp16", "ZeRO-1", Collective.reduce_scatter, True)])  # the ZeRO-1 optimizer: to the partitions' owners
def test_the_dp_reduction_is_exposed_after_the_passes_in_the_weights_dtype(precision: str, zero: str, reduce,
                                                                            gathers: bool, monkeypatch) -> None:
    plan = row_plan(_row(precision=precision, zero_or_fsdp=zero), data=DATA)
    pred, sharding, params, grad_bytes, weight_bytes, priced = _priced(plan, monkeypatch)
    # In 2 bytes, the engine's communication dtype, and none of it hidden by the backward passes, though longer.
    assert sharding.reduce_op is reduce and sharding.gathers_after_step is gathers
    assert (grad_bytes, weight_bytes) == (2.0, 2.0)
    layout = build_layout(plan.job)
    costs = collective_costs(plan.job.cluster, None)
    dp, per_node = layout.dims.dp, layout.dp_per_node
    assert priced == pytest.approx(costs.seconds(reduce, params * 2.0, dp, per_node) + (
        costs.seconds(Collective.all_gather, params * 2.0, dp, per_node) if gathers else 0.0), rel=1e-9)
    assert pred.time.backward_compute_s > priced
    assert pred.time.dp_comm_s == pytest.approx(priced, rel=1e-9)
    overlapped = simulate(plan.job, options=SimOptions(deepspeed_engine=True, overlap_grad_reduce=True))
    assert overlapped.time.dp_comm_s < priced  # what overlapping it with the backward would have hidden
    _, megatron, _, megatron_bytes, _, _ = _priced(dataclasses.replace(plan, options=SimOptions()), monkeypatch)
    if precision == "bf16":  # Megatron-Core: its fp32 buffer (a reduce-scatter under its distributed optimizer)
        assert megatron_bytes == 4.0
        assert megatron.reduce_op is (Collective.reduce_scatter if zero else Collective.all_reduce)


def test_bf16_optimizer_accumulates_every_micro_batch_into_fp32(monkeypatch) -> None:
    plan = row_plan(_row(), data=DATA)
    pred, _, params, *_ = _priced(plan, monkeypatch)
    # update_hp_grads: the cast reads 2 and writes 4, the add reads 4 + 4 and writes 4 bytes a parameter
    kernels = KernelModel(plan.job.cluster, efficiency_for(plan.job.cluster), plan.job.train.precision)
    assert pred.time.grad_accum_s > 0
    assert pred.time.grad_accum_s == pytest.approx(
        pred.num_microbatches * kernels.memory(params * 18.0), rel=1e-9)
    doubled = simulate(row_plan(_row(global_batch_seqs="128"), data=DATA).job, options=plan.options)
    assert doubled.time.grad_accum_s == pytest.approx(2 * pred.time.grad_accum_s, rel=1e-9)
    fp16 = row_plan(_row(precision="fp16"), data=DATA)
    assert simulate(fp16.job, options=fp16.options).time.grad_accum_s == 0.0  # autograd's own accumulation
    assert simulate(plan.job, options=SimOptions()).time.grad_accum_s == 0.0  # Megatron-Core: fused into the GEMM
    megatron = simulate(plan.job, options=SimOptions())
    # bf16 gradients and the whole fp32 buffer (6 bytes), against Megatron-Core's fp32 buffer (4)
    assert pred.memory.gradients == pytest.approx(1.5 * megatron.memory.gradients, rel=1e-9)


def test_bf16_optimizer_is_one_way_of_adding_weight_gradients_priced_once() -> None:
    """DeepSpeed's accumulation is a mode of ``WeightGradAccumulation`` (docs/simulator.md, "Weight-gradient
    accumulation"): stated or read from ``deepspeed_engine`` with bf16 it prices the same, after the backward and
    not also inside each layer's."""
    plan = row_plan(_row(), data=DATA)
    assert accumulation_mode(plan.job, plan.options) is WeightGradAccumulation.bf16_optimizer
    assert accumulation_mode(plan.job, SimOptions()) is WeightGradAccumulation.fused
    fp16 = row_plan(_row(precision="fp16"), data=DATA)
    assert accumulation_mode(fp16.job, fp16.options) is WeightGradAccumulation.fused  # FP16_Optimizer: none of it
    stated = SimOptions(weight_grad_accumulation=WeightGradAccumulation.bf16_optimizer)
    engine, alone = simulate(plan.job, options=plan.options), simulate(plan.job, options=stated)
    assert alone.time.grad_accum_s == pytest.approx(engine.time.grad_accum_s, rel=1e-12)
    plain = simulate(plan.job, options=SimOptions())
    assert alone.time.backward_compute_s == pytest.approx(plain.time.backward_compute_s, rel=1e-12)
    assert alone.step_time_s == pytest.approx(plain.step_time_s + alone.time.grad_accum_s, rel=1e-9)
    hook = simulate(plan.job, options=SimOptions(weight_grad_accumulation=WeightGradAccumulation.main_grad_hook))
    assert hook.time.grad_accum_s == 0.0 and hook.time.backward_compute_s > plain.time.backward_compute_s
    # 18 bytes against the hook's 2 + 2 x 4, one function pricing both
    assert accumulation_bytes(plan.job, WeightGradAccumulation.bf16_optimizer, elem=2, microbatches=4) == 18.0
    assert accumulation_bytes(plan.job, WeightGradAccumulation.main_grad_hook, elem=2, microbatches=4) == 10.0


@pytest.mark.parametrize(("precision", "grad_bytes"), [("bf16", 4.0), ("fp16", 2.0)])
def test_the_tied_embedding_is_all_reduced_between_the_end_stages(precision: str, grad_bytes: float) -> None:
    plan = row_plan(_row(pp="2", precision=precision), data=DATA)
    job = plan.job
    pred = simulate(job, options=plan.options)
    layout = build_layout(job)
    model = job.model
    vocab_params = model.padded_vocab_size * model.hidden_size / layout.dims.tp
    crosses = layout.pair_crossings[-1]
    costs = collective_costs(job.cluster, None)
    # BF16_Optimizer all-reduces the embedding's fp32 _hp_grad, FP16_Optimizer its fp16 grad
    assert pred.time.embedding_sync_s == pytest.approx(costs.seconds(
        Collective.all_reduce, vocab_params * grad_bytes, 2, 1 if crosses else 2), rel=1e-6)
    assert crosses  # the two stages are on two nodes: over Omni-Path


@pytest.mark.parametrize("text, links, gbps", [
    ("4x OPA 100Gb/s per node", 4, 100.0),  # the count is the node's links: no Omni-Path link runs at 25 Gb/s
    ("Omni-Path 100 Gb/s x4", 4, 100.0),
    ("4 Omni-Path 100Gb/s links per node", 4, 100.0),
    ("Jean Zay: 4 Omni-Path 100 Gbit/s NICs per node", 4, 100.0),
    ("Omni-Path 100Gb/s (4 per node)", 4, 100.0),
    ("4 Omni-Path links, 400 Gb/s per node", 4, 100.0),  # the node's 400 over its 4 links
    ("4 × 100 Gb/s Omni-Path", 4, 100.0),
    ("8 x HDR 200 Gb/s, 1.6 Tb/s per node", 8, 200.0),
    ("8 RoCE NICs, 3.2 Tbps per node", 8, 400.0),
])
def test_the_links_a_node_has_are_read_however_the_row_words_them(text: str, links: int, gbps: float) -> None:
    cluster = row_plan(_row(interconnect=text), data=DATA).job.cluster
    assert (cluster.nics_per_node, cluster.nic_gbps) == (links, gbps)
