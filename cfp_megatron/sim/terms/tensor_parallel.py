"""The tensor-parallel term: seconds of one layer pass's TP/SP collectives (after what TP communication overlap
hides), and the term's lane and bound (docs/simulator.md, "layer_cost.py")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.format_costs import low_format_cost
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import global_buffer_bytes, loss_logit_bytes, sp_gather_working_bytes
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Overlaps, Placement
from cfp_megatron.sim.terms.recompute import kept_and_working

if TYPE_CHECKING:
    from cfp_megatron.sim.layer_cost import LayerCost
    from cfp_megatron.sim.memory import Stage


def tp_pass_s(layout: Layout, costs: CollectiveCosts, *, act_bytes: float, tp_ops: int, overlap: bool,
              covered_s: float) -> float:
    """Seconds of one layer pass's TP/SP collectives on one rank: ``tp_ops / 2`` all-reduces of the ``act_bytes``
    activation, or as many all-gathers plus reduce-scatters under SP; with ``overlap`` (TP communication overlap)
    what ``covered_s`` of GEMMs hides, leaving at least ``1 / tp`` of it."""
    dims = layout.dims
    tp = dims.tp
    if tp > 1:
        if dims.sp:
            tp_pass = (tp_ops // 2) * (costs.seconds(Collective.all_gather, act_bytes, tp, layout.tp_per_node)
                                       + costs.seconds(Collective.reduce_scatter, act_bytes, tp, layout.tp_per_node))
        else:
            tp_pass = (tp_ops // 2) * costs.seconds(Collective.all_reduce, act_bytes, tp, layout.tp_per_node)
    else:
        tp_pass = 0.0
    if tp_pass and overlap:
        tp_pass = max(tp_pass - covered_s, 0.0) + tp_pass / tp
    return tp_pass


def tp_backward_async_s(layout: Layout, costs: CollectiveCosts, *, act_bytes: float,
                        column_gemms_s: tuple[float, ...]) -> float:
    """Seconds of one layer backward's TP/SP collectives on one rank as Megatron's linear layers run them
    (megatron/core/tensor_parallel/layers.py, ``LinearWithGradAccumulationAndAsyncCommunication.backward``), for the
    column-parallel layers whose forward GEMMs take ``column_gemms_s`` (QKV, FC1), each with its row-parallel twin
    (the projection, FC2). Without SP, a column-parallel layer's input-gradient all-reduce runs asynchronously beside
    its weight-gradient GEMM (``allreduce_dgrad``); a row-parallel layer's backward has none. Under SP, a
    row-parallel layer's backward all-gathers its output gradient before its GEMMs (``_ReduceScatterToSequence
    ParallelRegion.backward``, exposed); a column-parallel layer all-gathers its saved input shard again for its
    weight gradient beside the input-gradient GEMM, then reduce-scatters the input gradient beside the
    weight-gradient GEMM. A GEMM covers the collective beside it up to its own time (the dgrad and wgrad GEMMs each
    do the forward GEMM's FLOPs)."""
    dims = layout.dims
    tp = dims.tp
    if tp <= 1:
        return 0.0
    if not dims.sp:
        all_reduce = costs.seconds(Collective.all_reduce, act_bytes, tp, layout.tp_per_node)
        return sum(max(all_reduce - gemm_s, 0.0) for gemm_s in column_gemms_s)
    gather = costs.seconds(Collective.all_gather, act_bytes, tp, layout.tp_per_node)
    scatter = costs.seconds(Collective.reduce_scatter, act_bytes, tp, layout.tp_per_node)
    return sum(gather + max(gather - gemm_s, 0.0) + max(scatter - gemm_s, 0.0) for gemm_s in column_gemms_s)


USERBUFFERS_ALL_GATHER = 6
"""``[tokens, hidden]`` userbuffers Transformer Engine allocates once for TP communication overlap's all-gathers
(``module/base.py``, ``initialize_ub``: ``layers_all_gather_overlap``, ``qkv_fprop``, ``qkv_dgrad``, ``proj_dgrad``,
``fc1_fprop``, ``fc1_dgrad``, ``fc2_dgrad``), one a name, shared by every layer; one byte an element under an FP8
recipe (``fp8_buf``), else in the compute precision. Newer releases add ``proj_wgrad`` and ``fc2_wgrad``
(``external``), not counted."""

USERBUFFERS_REDUCE_SCATTER = 4
"""The same of its reduce-scatters (``layers_reduce_scatter_overlap``: ``proj_fprop``, ``fc2_fprop``, ``qkv_wgrad``,
``fc1_wgrad``), in the compute precision."""


class TensorParallel(CostTerm):
    """Tensor- and sequence-parallel collectives the passes wait for."""

    name = "tensor_parallel"
    lanes = (Lane(name="tp_comm_s", label="TP/SP comm", part="TP/CP/EP/FSDP comm", kind=LaneKind.comm,
                  placement=Placement.in_pass, pass_field="tp_comm_s", key="tp", trace="TP comm",
                  style=("TP/SP collectives", "#C44E52", "bad"), overlaps=("the layer's GEMMs (tp_comm_overlap)",)),)
    stores = (MemoryCategory(name="tp_buffers", label="TP/SP buffers", field="comm_buffers"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """Megatron-Core's global memory buffer, held for the run: sequence parallelism's all-gathered linear input
        or the unfused core's score buffer, one tensor (:func:`~cfp_megatron.sim.memory.global_buffer_bytes`);
        the gathered input Transformer Engine's linears make again in a layer's backward pass, where that pass is
        the rank's peak (beyond the loss's logits, which are freed before it:
        :func:`~cfp_megatron.sim.memory.sp_gather_working_bytes`); none else without SP, whose all-reduces run in
        place (``mappings.py``, ``_reduce``); and Transformer Engine's userbuffers under TP communication overlap,
        allocated once (:data:`USERBUFFERS_ALL_GATHER`, :data:`USERBUFFERS_REDUCE_SCATTER`; docs/simulator.md,
        "Sequence parallelism's buffers")."""
        if stage.measured is not None:
            return {"tp_buffers": 0.0}
        job, layout, options = stage.job, stage.layout, stage.options
        buffers = global_buffer_bytes(job, layout, options)
        transient = sp_gather_working_bytes(job, layout, options) if stage.layers else 0.0
        if transient:
            working = kept_and_working(stage)[1]
            logits = loss_logit_bytes(stage)
            buffers += max(logits, working + transient) - max(logits, working)
        if job.parallel.tp_comm_overlap:
            gathered = 1.0 if low_format_cost(job) is not None else stage.common.elem_bytes
            buffers += stage.common.tokens * job.model.hidden_size * (
                USERBUFFERS_ALL_GATHER * gathered + USERBUFFERS_REDUCE_SCATTER * stage.common.elem_bytes)
        return {"tp_buffers": buffers}

    def hideable(self, layer: LayerCost, overlaps: Overlaps) -> tuple[float, float]:
        """TP communication overlap leaves at least ``1 / tp`` of the TP communication."""
        if not overlaps.tp_comm:
            return 0.0, 0.0
        share = 1.0 - 1.0 / overlaps.tp
        return share * (layer.forward.tp_comm_s + layer.backward.tp_comm_s), share * layer.recompute.tp_comm_s
