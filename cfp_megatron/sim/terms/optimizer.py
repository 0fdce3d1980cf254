"""The optimizer-step term: the step over the rank's shard of the parameters (as the sharding shards the optimizer,
:mod:`cfp_megatron.sim.sharding`) with the gradient norm's all-reduce (docs/simulator.md, "Cost terms",
"Gradient sync and optimizer step")."""

from __future__ import annotations

from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.sharding import Sharded, Sharding
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, Placement, StepInputs


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
    memory traffic of the fitted bytes per parameter and the gradient norm's all-reduce."""
    job, dims, overheads = inputs.job, inputs.layout.dims, inputs.overheads
    sharding = Sharding.megatron(job, dims, deepspeed_engine=inputs.options.deepspeed_engine)
    out = []
    for rank in range(dims.pp):
        if inputs.options.measured_layer_only:
            out.append(0.0)
            continue
        shard_params = sharding.optimizer_params(inputs.params[rank], inputs.expert_params[rank])
        if overheads is None:  # the HBM traffic, and the gradient norm's all-reduce over its whole group
            out.append(inputs.kernels.memory(shard_params * inputs.efficiency.optimizer_bytes_per_param)
                       + grad_norm_extra(inputs.collectives, 1, dims.tp * dims.pp,
                                         dims.world_size if sharding.sharded is Sharded.optimizer else None))
            continue
        out.append(overheads.step_base_s + overheads.step_per_param_s * shard_params
                   + grad_norm_extra(inputs.collectives, dims.tp, dims.pp,
                                     dims.world_size if sharding.sharded is Sharded.optimizer else None))
    return out


class OptimizerStep(CostTerm):
    """The optimizer step after the gradient sync (with the gradient norm's all-reduce)."""

    name = "optimizer"
    lanes = (Lane(name="optimizer_s", label="optimizer", part="optimizer", kind=LaneKind.compute,
                  placement=Placement.after, key="optimizer", trace="compute",
                  style=("optimizer step", "#8172B3", "olive")),)

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """The optimizer step per pipeline rank (:func:`optimizer_step`)."""
        return {"optimizer_s": optimizer_step(inputs)}
