"""The host-side term: time the host spends that the GPU work does not cover. A pass takes the larger of its GPU
time and the host's time to launch its kernels (the host runs ahead of the GPU only by its launch queue), and each
device-to-host synchronisation (the dropless MoE dispatcher's token counts, the step's gradient norm) drains the
queue: the GPU waits for the sync and for the next launch (docs/simulator.md, "Host time"). What the host spends per
layer kind and pass: :mod:`cfp_megatron.sim.host_costs`."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from cfp_megatron.sim.host_costs import HostCosts, step_host_s
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, Overlaps, Placement, StepInputs

if TYPE_CHECKING:
    from cfp_megatron.sim.layer_cost import PassCost
    from cfp_megatron.sim.pass_costs import PassCosts


class HostWork(CostTerm):
    """Host work the step waits for beyond its GPU work: in the passes (launches, the MoE dispatcher's syncs) and
    once per step (its synchronisations)."""

    name = "host"
    lanes = (Lane(name="host_s", label="host work (launches, syncs)", part="host", kind=LaneKind.host,
                  placement=Placement.in_pass, pass_field="host_s", key="host", trace="host",
                  overlaps=("the GPU work of the same pass (the larger of the two counts)",),
                  style=("host work (launches, syncs)", "#64B5CD", "generic_work")),
             Lane(name="host_step_s", label="host work per step", part="host", kind=LaneKind.host,
                  placement=Placement.after, key="host_step", trace="host",
                  style=("host work per step (syncs)", "#8172B2", "generic_work")))

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """The step's synchronisations outside the passes on every pipeline rank (none on a CPU cluster)."""
        step_s = 0.0 if inputs.job.cluster.on_cpu else step_host_s()
        return {"host_step_s": [step_s] * inputs.layout.dims.pp}

    def chunk_floor(self, parts: PassCosts, moe: bool, overlaps: Overlaps) -> tuple[float, float]:
        """What :func:`with_host` adds for each MoE layer whatever its chunk holds, where the layer synchronises:
        its forward's stretch (:func:`moe_stretch_s`) and, under full recomputation, its recomputation's syncs. No
        schedule hides them (the combined 1F1B schedule's unpaired passes add expert exchange only). The stretch's
        launches beyond the layer's GPU time count only where the group's candidates may turn on no overlap (then
        their MoE forward is the representative's; an overlap may lengthen it); the launches a chunk's layers share
        one maximum with its other layers, embedding and head do not count (a per-layer share of that maximum holds
        only for chunks of one kind)."""
        host = parts.host
        if host is None or not moe or not host.moe_sync_s:
            return 0.0, 0.0
        exact = not (overlaps.tp_comm or overlaps.expert_a2a)
        forward = moe_stretch_s(host, parts.moe.forward.total_s) if exact else host.moe_sync_s
        return forward, host.moe_sync_s * host.recompute_syncs


def moe_stretch_s(host: HostCosts, moe_forward_s: float) -> float:
    """Host seconds one synchronising MoE layer's forward adds beyond its GPU time ``moe_forward_s``: the sync and
    the next launch exposed, then what its launches outlast its GPU work."""
    return host.moe_sync_s + max(host.moe[0] - moe_forward_s, 0.0)


def with_host(host: HostCosts, forward: PassCost, backward: PassCost, recompute: PassCost, *, dense: float,
              moe: float, embedding: bool, heads: int, rec_dense: float, rec_moe: float, moe_forward_s: float
              ) -> tuple[PassCost, PassCost]:
    """One model chunk's forward and backward (recomputation included) with the host's exposed seconds added: a pass
    lasts the larger of its GPU time and the host's launches, except that each MoE layer that synchronises is a
    stretch of its own (the sync and the next launch exposed, then the larger of the layer's GPU time
    ``moe_forward_s`` and its launches). ``dense``/``moe``: the chunk's decoder layers of each kind (MTP layers
    counted in their kind), ``heads``: output layers and losses, ``rec_dense``/``rec_moe``: its recomputed layers."""
    launch_f = (dense * host.dense[0] + moe * host.moe[0] + embedding * host.embedding[0] + heads * host.head[0])
    launch_b = (dense * host.dense[1] + moe * host.moe[1] + embedding * host.embedding[1] + heads * host.head[1]
                + rec_dense * host.dense_recompute_s + rec_moe * host.moe_recompute_s)
    gpu_f = forward.total_s
    gpu_b = backward.total_s + recompute.total_s
    if host.moe_sync_s and moe:
        # each MoE layer from its sync on: the sync, one launch, then the larger of its GPU time and its launches
        per_moe = moe_stretch_s(host, moe_forward_s)
        forward_host = moe * per_moe + max(launch_f - moe * host.moe[0] - (gpu_f - moe * moe_forward_s), 0.0)
        backward_host = rec_moe * host.moe_sync_s * host.recompute_syncs + max(launch_b - gpu_b, 0.0)
    else:
        forward_host = max(launch_f - gpu_f, 0.0)
        backward_host = max(launch_b - gpu_b, 0.0)
    return (dataclasses.replace(forward, host_s=forward.host_s + forward_host),
            dataclasses.replace(backward, host_s=backward.host_s + backward_host))
