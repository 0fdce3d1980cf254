"""The activation-offloading term: the host-link copies of the offloaded layers' activations that their neighbours'
computation does not hide (docs/simulator.md, "Activation offloading"). Their memory is the recomputation term's
(:func:`~cfp_megatron.sim.terms.recompute.layer_activations` keeps them off the GPU)."""

from __future__ import annotations

from cfp_megatron.base.config import Recompute
from cfp_megatron.sim.memory import layer_activation_bytes, offloaded_layers
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, Placement, StepInputs


def exposed_copy_s(copy_s: float, layer_s: float) -> float:
    """Seconds one layer's copy over the host link adds to a pass: the copy runs on its own CUDA stream beside the
    next layer's kernels (the offload after a layer's forward, the reload ahead of a layer's backward), so only
    what outlasts that layer's computation is exposed."""
    return max(copy_s - layer_s, 0.0)


def offload_s(inputs: StepInputs) -> list[float]:
    """Exposed seconds of activation offloading per pipeline rank over the step: each offloaded layer's kept
    activations (:func:`~cfp_megatron.sim.memory.layer_activation_bytes`) go to the host after its forward pass and
    come back for its backward, at ``cluster.host_link_gbps``, each copy hidden by one layer's forward or backward
    (the rank's pass over its layers, per layer). Zero without offloading or without a stated host link.
    Offloading runs without pipeline parallelism, so the lane after the schedule adds what the passes would."""
    job, layout = inputs.job, inputs.layout
    dims, link = layout.dims, job.cluster.host_link_gbps
    layers = job.model.num_layers
    off_dense, off_moe = offloaded_layers(job, layers)
    if not (off_dense or off_moe) or link is None or not inputs.forward_s:
        return [0.0] * dims.pp
    forward_layer_s, backward_layer_s = inputs.forward_s[0] / layers, inputs.backward_s[0] / layers
    rate = link * 1e9
    seconds = 0.0
    for count, moe in ((off_dense, False), (off_moe, True)):
        if count:
            copy_s = layer_activation_bytes(job, layout, inputs.options, moe=moe, recompute=Recompute.none)[0] / rate
            seconds += count * (exposed_copy_s(copy_s, forward_layer_s) + exposed_copy_s(copy_s, backward_layer_s))
    return [dims.num_microbatches * seconds] + [0.0] * (dims.pp - 1)


class ActivationOffload(CostTerm):
    """Offloaded layers' activation copies over the host link, exposed where they outlast a layer's computation."""

    name = "offload"
    lanes = (Lane(name="offload_s", label="activation offload (exposed)", part="host", kind=LaneKind.comm,
                  placement=Placement.after, key="offload", trace="host link",
                  style=("activation offload (host link)", "#937860", "grey"),
                  overlaps=("the next layer's forward (offload)", "the next layer's backward (reload)")),)

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """The exposed copies per pipeline rank (:func:`offload_s`)."""
        return {"offload_s": offload_s(inputs)}
