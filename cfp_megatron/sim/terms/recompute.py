"""The recomputation term: the forward work selective recomputation repeats in a layer's backward pass, and the
term's lane and bound (full recomputation repeats the whole forward: :func:`~cfp_megatron.sim.layer_cost.layer_cost`;
docs/simulator.md, "layer_cost.py")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cfp_megatron.base.config import AttentionKind, JobSpec, Recompute, RecomputeMethod, RecomputeModule
from cfp_megatron.base.pipeline_split import job_chunks
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import (
    Stage,
    in_flight,
    loss_logit_bytes,
    offload_resident_bytes,
    offloaded_layers,
    op_sac_gemms,
    primepar_split,
    recomputed_layers,
)
from cfp_megatron.sim.primepar_cost import mlp_activation_elements
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Overlaps, Placement, StepTimes

if TYPE_CHECKING:
    from cfp_megatron.sim.layer_cost import LayerCost
    from cfp_megatron.sim.terms.expert_dispatch import MoeCost


def selective_recompute(job: JobSpec, layout: Layout, kernels: KernelModel, *, moe_block: MoeCost | None,
                        mlp_gemm: float, core_fwd_s: float, ep_fwd_s: float) -> tuple[float, float, float]:
    """The forward work selective recomputation repeats in one layer's backward pass: the core attention, the two
    norms, the experts' activation, MLA's up-projections, a dense layer's MLP, a MoE layer's whole block (its token
    exchange included) or its shared expert, as ``parallel.recompute_modules`` names them: its (compute, attention
    core, expert exchange) seconds."""
    model, dims = job.model, layout.dims
    modules = job.parallel.recomputed_modules
    tp, hidden, gated = dims.tp, model.hidden_size, model.activation.gated
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    elements = gemm_s = ep_s = unfused = 0.0  # elements and unfused (bytes): per token
    if RecomputeModule.layernorm in modules:  # two norms, each reading and writing the hidden state
        elements += 4.0 * hidden / (tp if dims.sp else 1)
    if moe_block is not None:
        if RecomputeModule.moe in modules:
            gemm_s += moe_block.gemm_s
            elements += moe_block.elements_per_token
            unfused += moe_block.unfused_bytes_per_token[0] + moe_block.router_bytes_per_token[0]
            ep_s += ep_fwd_s
        else:
            if RecomputeModule.moe_act in modules:
                elements += moe_block.activation_elements_per_token
                unfused += moe_block.recomputed_bytes_per_token
            if RecomputeModule.shared_experts in modules:
                gemm_s += moe_block.shared_gemm_s
                elements += moe_block.shared_elements_per_token
    elif RecomputeModule.mlp in modules:
        gemm_s += mlp_gemm
        elements += mlp_activation_elements(tp=tp, ffn=model.ffn_size, gated=gated)
    if RecomputeModule.mla_up_proj in modules and model.attention is AttentionKind.mla:
        heads = model.num_attention_heads
        gemm_s += kernels.gemm(tokens, heads * (model.qk_head_dim + model.qk_pos_emb_head_dim) / tp,
                               model.q_lora_rank or hidden)
        gemm_s += kernels.gemm(tokens, heads * (model.qk_head_dim + model.v_head_dim) / tp, model.kv_lora_rank)
    core_s = core_fwd_s if RecomputeModule.core_attn in modules else 0.0
    return gemm_s + kernels.memory((elements * kernels.elem + unfused) * tokens), core_s, ep_s


def op_sac_recompute_s(job: JobSpec, layout: Layout, kernels: KernelModel, *, moe_block: MoeCost | None,
                       elementwise_s: float) -> float:
    """The forward work torchtitan's per-op selective activation checkpointing (``SelectiveAC``, ``mode =
    "selective"`` with ``selective_ac_option = "op"``) repeats in one layer's backward: every second ``mm`` of the
    block (:func:`op_sac_gemms`; the first, third, ... are saved), the router's gate (force-recomputed), the routed
    experts' grouped GEMMs (``_grouped_mm`` is not in its save list) and every element-wise kernel
    (``elementwise_s``); the attention core (SDPA), the all-to-all and the host copy of the token counts are saved,
    so neither the core nor the exchange nor the synchronisation runs again."""
    tokens = layout.micro_batch * layout.seq_length / layout.dims.cp
    gemms = op_sac_gemms(job, layout, moe=moe_block is not None)
    seconds = sum(kernels.gemm(tokens, n, k) for n, k in gemms[1::2])
    if moe_block is not None:
        seconds += moe_block.gemm_s - moe_block.shared_gemm_s
    return seconds + elementwise_s


def layer_activations(stage: Stage) -> float:
    """Bytes the rank's layers keep for their backward passes over the micro-batches in flight, as the plan's
    recomputation keeps them, plus the working set of the layer in flight (a recomputed layer's whole activations,
    an unfused attention core's scores or its linears' flowing gradients) beyond the loss's logits, which are gone
    before it is made."""
    kept, working = kept_and_working(stage)
    # The backward pass frees the loss's logits (the compute term's) before any layer's backward runs: the working
    # set counts only where it exceeds them.
    return kept + max(working - loss_logit_bytes(stage), 0.0)


def kept_and_working(stage: Stage) -> tuple[float, float]:
    """(bytes the rank's layers keep over the micro-batches in flight, the working set of one layer's backward pass
    beyond them, before the loss's logits are set against it): :func:`layer_activations`' two parts."""
    job, layout, options, rank = stage.job, stage.layout, stage.options, stage.rank
    dims, parallel = layout.dims, job.parallel
    layers, moe_layers = stage.layers, stage.moe_layers
    common = stage.common  # each kind of layer's bytes, the same on every rank
    dense_act, dense_full = common.dense
    # Dense layers beyond parallel.primepar_layers keep Megatron's MLP partition, and its activations.
    split = primepar_split(job, rank=rank)
    plan_dense = split[0] if split else layers - moe_layers  # dense layers under the plan's own MLP partition
    megatron_act, megatron_full = common.megatron if split else (0.0, 0.0)
    if moe_layers:
        moe_act, moe_full = common.moe
    else:
        moe_act = moe_full = 0.0
    dense_layers = layers - moe_layers
    chunk_microbatches = in_flight(rank, dims.pp, dims.vpp, dims.num_microbatches, options.pipeline_schedule)
    if parallel.moe_a2a_overlap and moe_layers:  # the combined 1F1B schedule runs one more micro-batch ahead
        chunk_microbatches = min(chunk_microbatches + 1, dims.num_microbatches * dims.vpp)
    held_microbatches = chunk_microbatches / dims.vpp  # whole-rank micro-batches held
    resident = 0.0  # offloaded activations back on the GPU beside the last layer's passes
    off_dense, off_moe = offloaded_layers(job, layers)
    if parallel.recompute is Recompute.full and parallel.recompute_method is RecomputeMethod.block:
        # The recomputed layers keep their input; the others keep what they would without recomputation.
        rec_dense, rec_moe = recomputed_layers(job, rank=rank)
        dense_kept = common.kept[0]
        moe_kept = common.kept[1] if moe_layers else 0.0
        kept = (rec_dense * dense_full + rec_moe * moe_full + (dense_layers - rec_dense) * dense_kept
                + (moe_layers - rec_moe) * moe_kept)
        working = max(dense_act, moe_act)
    elif parallel.recompute is Recompute.full:
        kept = plan_dense * dense_full + (dense_layers - plan_dense) * megatron_full + moe_layers * moe_full
        working = max(dense_act, megatron_act, moe_act)
        # Megatron checkpoints each chunk's layers in groups of recompute_num_layers (uniform), each group keeping
        # its input alone; its backward pass runs every one of its layers' forward again (docs/simulator.md,
        # "What full recomputation keeps").
        unit = max(parallel.recompute_num_layers, 1)
        counts = [chunk.count for chunk in job_chunks(job)[rank]]
        if unit > 1 and sum(counts):
            kept *= sum(-(-count // unit) for count in counts) / sum(counts)
            working *= min(unit, max(counts))
    else:
        kept = plan_dense * dense_act + (dense_layers - plan_dense) * megatron_act + moe_layers * moe_act
        working = 0.0
        if off_dense or off_moe:  # their activations wait in host memory; one may be back beside the last layer's
            kept -= off_dense * dense_act + off_moe * moe_act
            resident = offload_resident_bytes(options, dense_act, moe_act, off_moe)
    if common.bf16_ends is not None and stage.bf16_layers != (0, 0):
        # The layers kept in bf16 at the stack's ends keep their bf16 twin's activations in place of the format's.
        full = parallel.recompute is Recompute.full and parallel.recompute_method is RecomputeMethod.uniform
        for (bf16_act, bf16_full), (act, full_act), count in zip(common.bf16_ends, (common.dense, common.moe),
                                                                 stage.bf16_layers, strict=True):
            kept += count * ((bf16_full - full_act) if full else (bf16_act - act))
    if layers:
        # The backward's moments: the unfused core's scores, or a linear's flowing gradients and weight gradient
        # (docs/simulator.md, "The backward's flowing gradients"), whichever holds more.
        flows = [flow for flow, count in zip(common.flows, (dense_layers, moe_layers), strict=True) if count]
        working += max(common.unfused_working, *flows)
        # FSDP's unsharded gradients exist from a layer's backward on; each layer whose gradients its reduce-scatter
        # queue keeps has freed its activations first (none while offloaded layers are reloaded in their place).
        kinds = (dense_full, moe_full) if parallel.recompute is Recompute.full else (dense_act, moe_act)
        freed = 0.0 if off_dense or off_moe else min(
            kind for kind, count in zip(kinds, (dense_layers, moe_layers), strict=True) if count)
        working += common.sharding.backward_grad_bytes(stage.layer_params / layers, stage.expert_params / layers,
                                                       layers=layers, freed_per_layer=freed)
    return kept * held_microbatches, working + resident


class Recomputation(CostTerm):
    """Forward work repeated in the backward pass (selective or full recomputation); its communication is counted
    in the communication terms' lanes, its per-layer overhead in the compute term's."""

    name = "recompute"
    lanes = (Lane(name="recompute_s", label="recompute", part="backward", kind=LaneKind.compute,
                  placement=Placement.in_pass),)
    stores = (MemoryCategory(name="layer_activations", label="layer activations", field="activations"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """The layers' activations as the recomputation keeps them (:func:`layer_activations`; measured instead
        where profiling measured the stage: the compute term's)."""
        return {"layer_activations": layer_activations(stage) if stage.measured is None else 0.0}

    def time(self, step: StepTimes) -> dict[str, float]:
        """The recomputation's kernels (its compute and attention core) over the step."""
        rec = step.recompute
        return {"recompute_s": step.microbatches * (rec.compute_s + rec.attention_core_s)}

    def lower_bound(self, layer: LayerCost, overlaps: Overlaps) -> float:
        """One layer's recomputed kernels."""
        return layer.recompute.compute_s + layer.recompute.attention_core_s
