"""Two terms of Megatron's unfused layer as it runs: the attention core's softmax and dropout over the scores (which
selective recomputation repeats with the core), and the backward's TP/SP collectives beside the gradient GEMMs
(Megatron's linear layers: the input-gradient all-reduce beside the weight-gradient GEMM; under SP the row-parallel
layers' gradient all-gather waited for, the column-parallel layers' input re-gather and gradient reduce-scatter
beside their GEMMs)."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.config import AttentionKernel
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim import SimOptions
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import FUSED_SOFTMAX_SCORE_ELEMENTS, layer_cost, unfused_core_bytes
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.terms.tensor_parallel import tp_backward_async_s
from tests.test_sim import job

UNFUSED = SimOptions(attention=AttentionKernel.fused_softmax)
HEADS, SEQ, HIDDEN, TP = 32, 2048, 4096, 8


def _cost(options: SimOptions, *, model: dict | None = None, **parallel):
    plan = job(model=model, tp=TP, **parallel)
    layout = build_layout(plan)
    kernels = KernelModel(plan.cluster, efficiency_for(plan.cluster), plan.train.precision)
    costs = CollectiveCosts(plan.cluster)
    return plan, layout, kernels, costs, layer_cost(plan, layout, kernels, costs, options, moe=False)


def test_dropout_bytes_per_score() -> None:
    # bf16: read the probabilities and write the output (2 bytes each) and a one-byte mask; the same back.
    softmax_fwd, softmax_bwd, drop_fwd, drop_bwd = unfused_core_bytes(AttentionKernel.fused_softmax, 2, dropout=True)
    assert (drop_fwd, drop_bwd) == (5.0, 5.0)
    assert (softmax_fwd, softmax_bwd) == (2 * FUSED_SOFTMAX_SCORE_ELEMENTS[0], 2 * FUSED_SOFTMAX_SCORE_ELEMENTS[1])
    assert unfused_core_bytes(AttentionKernel.fused_softmax, 2, dropout=False)[2:] == (0.0, 0.0)


def test_the_unfused_core_holds_its_softmax_and_dropout() -> None:
    plan, _, kernels, _, dropped = _cost(UNFUSED, model={"attention_dropout": 0.1})
    *_, plain = _cost(UNFUSED, model={"attention_dropout": 0.0})
    scores = 1 * SEQ * HEADS * SEQ / TP  # micro-batch 1
    assert dropped.forward.attention_core_s - plain.forward.attention_core_s == pytest.approx(
        kernels.memory(scores * 5.0))
    assert dropped.backward.attention_core_s - plain.backward.attention_core_s == pytest.approx(
        kernels.memory(scores * 5.0))
    # the rest of the layer does not change with the attention dropout
    assert dropped.forward.compute_s == pytest.approx(plain.forward.compute_s)
    # a fused (flash) kernel runs its softmax and dropout inside: nothing more
    *_, flash_dropped = _cost(SimOptions(), model={"attention_dropout": 0.1})
    *_, flash_plain = _cost(SimOptions(), model={"attention_dropout": 0.0})
    assert flash_dropped.forward.attention_core_s == pytest.approx(flash_plain.forward.attention_core_s)


def test_selective_recomputation_repeats_the_softmax_and_dropout() -> None:
    *_, none = _cost(UNFUSED, model={"attention_dropout": 0.1})
    plan, _, kernels, _, selective = _cost(UNFUSED, model={"attention_dropout": 0.1}, recompute="selective")
    # the checkpointed core attention re-runs its whole forward: QK^T, the fused softmax, the dropout, the context
    assert selective.recompute.attention_core_s == pytest.approx(none.forward.attention_core_s)
    scores = SEQ * HEADS * SEQ / TP
    beyond_gemms = kernels.memory(scores * (2 * FUSED_SOFTMAX_SCORE_ELEMENTS[0] + 5.0))
    assert selective.recompute.attention_core_s > beyond_gemms > 0


@pytest.mark.parametrize("sp", [False, True])
def test_the_backward_collectives_beside_the_gemms(sp: bool) -> None:
    plan, layout, kernels, costs, cost = _cost(UNFUSED, sp=sp)
    act = SEQ * HIDDEN * 2
    all_reduce = costs.seconds(Collective.all_reduce, act, TP, layout.tp_per_node)
    gather = costs.seconds(Collective.all_gather, act, TP, layout.tp_per_node)
    # the forward waits for each of its two all-reduces (or all-gather and reduce-scatter pairs under SP)
    waited = cost.forward.tp_comm_s
    assert waited == pytest.approx(2 * (gather + costs.seconds(Collective.reduce_scatter, act, TP,
                                                                layout.tp_per_node)) if sp else 2 * all_reduce)
    # A GEMM as long as the collective hides it whole: without SP nothing is left; under SP the row-parallel layers'
    # gradient all-gathers remain.
    assert tp_backward_async_s(layout, costs, act_bytes=act, column_gemms_s=(1.0, 1.0)) == pytest.approx(
        2 * gather if sp else 0.0)
    # No GEMM time: all of it is waited for (and under SP the column-parallel layers' input re-gathers too).
    alone = tp_backward_async_s(layout, costs, act_bytes=act, column_gemms_s=(0.0, 0.0))
    assert alone == pytest.approx(2 * (2 * gather + costs.seconds(Collective.reduce_scatter, act, TP,
                                                                    layout.tp_per_node)) if sp else 2 * all_reduce)
    assert 0.0 <= cost.backward.tp_comm_s < waited if not sp else cost.backward.tp_comm_s >= 2 * gather


def test_sp_saves_less_in_the_backward_than_in_the_forward() -> None:
    # SP divides the norms' and dropouts' work by TP in both passes, but its backward waits for the row-parallel
    # layers' gradient all-gathers where the all-reduces without SP run beside the weight-gradient GEMMs.
    *_, plain = _cost(UNFUSED, mb=4)
    *_, sp = _cost(UNFUSED, mb=4, sp=True)
    forward_saving = plain.forward.total_s - sp.forward.total_s
    backward_saving = plain.backward.total_s - sp.backward.total_s
    assert forward_saving > 0
    assert backward_saving < forward_saving


def test_waited_backward_collectives_where_the_framework_does_not_overlap_them() -> None:
    *_, overlapped = _cost(UNFUSED)
    *_, waited = _cost(dataclasses.replace(UNFUSED, async_tp_backward=False))
    assert waited.backward.tp_comm_s == pytest.approx(waited.forward.tp_comm_s)
    assert overlapped.backward.tp_comm_s < waited.backward.tp_comm_s
    assert overlapped.forward.tp_comm_s == pytest.approx(waited.forward.tp_comm_s)
