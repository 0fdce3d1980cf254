"""The optimizer-step term: the step over the rank's shard of the parameters (as the sharding shards the optimizer,
:mod:`cfp_megatron.sim.sharding`) with the gradient norm's all-reduce (docs/simulator.md, "Cost terms",
"Gradient sync and optimizer step")."""

from __future__ import annotations

from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.format_costs import step_weight_cast_bytes
from cfp_megatron.sim.sharding import Sharded, Sharding
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, Placement, StepInputs

TORCH_FUSED_ADAMW_BYTES = 40.0
"""HBM bytes per parameter of PyTorch's fused AdamW step over fp32 shards with its gradient clipping, counted from
what runs (torch/optim/adamw.py ``fused=True``, ``_fused_adamw_``; torch/nn/utils/clip_grad.py): the kernel reads
the parameter, its gradient and both moments and writes the parameter and both moments (7 x 4 bytes);
``get_total_norm`` reads the gradients (4) and ``clip_grads_with_norm_`` scales them in place (4 + 4)."""


def grad_norm_extra(costs: CollectiveCosts, tp: int, pp: int, world: int | None = None) -> float:
    """Seconds the grad-norm all-reduce takes beyond the one over ``tp`` ranks that the measured optimizer step had:
    Megatron reduces the norm over the model-parallel group (``tp x pp`` ranks), and under the distributed optimizer
    (``world``) over every rank of the optimizer instance, its gradients being sharded over data parallelism too."""
    group = world if world is not None else tp * pp
    if group <= tp:
        return 0.0
    return max(costs.seconds(Collective.all_reduce, 8.0, group)
               - costs.seconds(Collective.all_reduce, 8.0, tp, tp), 0.0)


def optimizer_step(inputs: StepInputs) -> list[float]:
    """Seconds of the optimizer step per pipeline rank over the parameters whose step the rank runs: the overheads
    probes' fit (base + per parameter) with the gradient norm's wider all-reduce on a profiled cluster, else the
    memory traffic of the fitted bytes per parameter (PyTorch's fused AdamW's own under
    ``SimOptions.torch_fused_adamw``) and the gradient norm's all-reduce."""
    job, dims, overheads = inputs.job, inputs.layout.dims, inputs.overheads
    sharding = Sharding.megatron(job, dims, deepspeed_engine=inputs.options.deepspeed_engine)
    out = []
    for rank in range(dims.pp):
        if inputs.options.measured_layer_only:
            out.append(0.0)
            continue
        shard_params = sharding.optimizer_params(inputs.params[rank], inputs.expert_params[rank])
        if overheads is None:  # the HBM traffic, and the gradient norm's all-reduce over its whole group
            per_param = (TORCH_FUSED_ADAMW_BYTES if inputs.options.torch_fused_adamw
                         else inputs.efficiency.optimizer_bytes_per_param)
            out.append(inputs.kernels.memory(shard_params * per_param)
                       + grad_norm_extra(inputs.collectives, 1, dims.tp * dims.pp,
                                         dims.world_size if sharding.sharded is Sharded.optimizer else None))
            continue
        out.append(overheads.step_base_s + overheads.step_per_param_s * shard_params
                   + grad_norm_extra(inputs.collectives, dims.tp, dims.pp,
                                     dims.world_size if sharding.sharded is Sharded.optimizer else None))
    return out


def weight_casts(inputs: StepInputs) -> list[float]:
    """Seconds per pipeline rank of the once-per-step quantisation of its linear layers' weights in the job's
    FP8/FP4 format (:func:`~cfp_megatron.sim.format_costs.step_weight_cast_bytes`), memory-bound; zero in 16/32 bits
    and with ``measured_layer_only``."""
    job, dims = inputs.job, inputs.layout.dims
    if inputs.options.measured_layer_only:
        return [0.0] * dims.pp
    sharding = Sharding.megatron(job, dims)
    layers = inputs.layer_params or inputs.params
    return [inputs.kernels.memory(step_weight_cast_bytes(
        job, layers[rank], sharding.optimizer_params(layers[rank], inputs.expert_params[rank])))
        for rank in range(dims.pp)]


class OptimizerStep(CostTerm):
    """The optimizer step after the gradient sync (with the gradient norm's all-reduce), and the step's weight
    quantisation under FP8/FP4."""

    name = "optimizer"
    lanes = (Lane(name="optimizer_s", label="optimizer", part="optimizer", kind=LaneKind.compute,
                  placement=Placement.after, key="optimizer", trace="compute",
                  style=("optimizer step", "#8172B3", "olive")),
             Lane(name="weight_cast_s", label="weight quantisation (once per step)", part="optimizer",
                  kind=LaneKind.compute, placement=Placement.after, key="weight_cast", trace="compute",
                  style=("weight quantisation (FP8/FP4)", "#A38FD0", "olive")))

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """The optimizer step and the weight casts per pipeline rank (:func:`optimizer_step`,
        :func:`weight_casts`)."""
        return {"optimizer_s": optimizer_step(inputs), "weight_cast_s": weight_casts(inputs)}
