"""The compute term: the passes' kernels (GEMMs, attention, element-wise work) and their fixed per-layer cost. The
layer's kernels are timed in :func:`~cfp_megatron.sim.layer_cost.layer_cost` with the kernel model
(:mod:`cfp_megatron.sim.kernels`); this term names their lanes and bounds them (docs/simulator.md, "Cost terms")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cfp_megatron.sim.memory import loss_logit_bytes
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Overlaps, Placement, StepTimes

if TYPE_CHECKING:
    from cfp_megatron.sim.layer_cost import LayerCost
    from cfp_megatron.sim.memory import Stage


class Compute(CostTerm):
    """Forward and backward kernels of every micro-batch, and the fixed per-layer cost (launches, small kernels)."""

    name = "compute"
    lanes = (Lane(name="forward_compute_s", label="forward compute", part="forward", kind=LaneKind.compute,
                  placement=Placement.in_pass),
             Lane(name="backward_compute_s", label="backward compute", part="backward", kind=LaneKind.compute,
                  placement=Placement.in_pass),
             Lane(name="overhead_s", label="framework overhead", part="per-layer overhead", kind=LaneKind.compute,
                  placement=Placement.in_pass, pass_field="overhead_s"))
    stores = (MemoryCategory(name="logits", label="fp32 logits", field="activations"),
              MemoryCategory(name="measured_activations", label="measured activations", field="activations"))

    def memory(self, stage: Stage) -> dict[str, float]:
        """The loss's logits on the loss rank (:func:`~cfp_megatron.sim.memory.loss_logit_bytes`);
        where profiling measured the stage, its measured activations instead (which stand for every analytical
        activation and buffer category)."""
        if stage.measured is not None:
            return {"logits": 0.0, "measured_activations": stage.measured}
        return {"logits": loss_logit_bytes(stage), "measured_activations": 0.0}

    def time(self, step: StepTimes) -> dict[str, float]:
        """The forward's and the backward's kernels (compute and attention core) and every pass's overhead."""
        m, fwd, bwd, rec = step.microbatches, step.forward, step.backward, step.recompute
        return {"forward_compute_s": m * (fwd.compute_s + fwd.attention_core_s),
                "backward_compute_s": m * (bwd.compute_s + bwd.attention_core_s),
                "overhead_s": m * (fwd.overhead_s + bwd.overhead_s + rec.overhead_s)}

    def lower_bound(self, layer: LayerCost, overlaps: Overlaps) -> float:
        """One layer's forward and backward kernels and its passes' overhead."""
        fwd, bwd, rec = layer.forward, layer.backward, layer.recompute
        return (fwd.compute_s + fwd.attention_core_s + bwd.compute_s + bwd.attention_core_s
                + fwd.overhead_s + bwd.overhead_s + rec.overhead_s)
