"""Whether a DeepSpeed job fits the memory of the machine it is about to run on, checked before profiling and before
any process group (the DeepSpeed side of :mod:`cfp_megatron.planner.memory_fit`, with its messages): ``+cfp=auto``
refuses a job no ZeRO plan of which fits (the DeepSpeed search on this machine's figures, before the engine probes),
and a plan given by hand (the ``backend`` knobs, ``cfp.plan``, ``cfp.plan_file``) is refused when the DeepSpeed cost
model's memory for its ZeRO stage exceeds each rank's memory."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cfp_megatron.backends.deepspeed.costs import simulate_zero
from cfp_megatron.backends.deepspeed.search import ZeroSearchResult, pin_keys, search_zero, zero_pins
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.planner.memory_fit import gib, memory_issue, ranks
from cfp_megatron.planner.sizing import GROWTH, growth_limit, resized, smallest_fitting, world_of
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.sim.prediction import GIB

ZERO_MEMORY_FIX = ("start fewer ranks per node (torchrun --nproc_per_node), train a smaller model (model=..., "
                   "model.num_layers), train with backend=megatron (model parallelism), or use a cluster with more "
                   "memory (cluster=<preset>, cluster.hbm_gib).")
"""What to change when no DeepSpeed plan fits."""



def zero_pins_fix(pinned: tuple[str, ...]) -> str:
    """What to change first when no DeepSpeed plan the search may try fits: the knobs pinned by hand (their keys,
    :func:`~cfp_megatron.backends.deepspeed.search.pin_keys`) left to the search; nothing where none is."""
    return f"leave the pinned knobs to the search (remove {', '.join(pinned)}), " if pinned else ""


@dataclass(kw_only=True)
class _ZeroSizes:
    """The DeepSpeed search of one job at several node counts of its cluster, as
    :func:`~cfp_megatron.planner.sizing.smallest_fitting` asks it."""

    job: JobSpec
    """The job on its preset."""
    cfp: CfpSpec
    """The planner's settings."""
    backend: BackendSpec
    """The backend group."""
    best: dict[int, ZeroSearchResult] = field(default_factory=dict)
    """Each node count's search where a plan fits."""

    def fits(self, nodes: int) -> bool:
        """Whether a ZeRO plan fits on ``nodes`` nodes."""
        job = resized(self.job, nodes)
        try:
            self.best[nodes] = search_zero(job, world_of(job), dataclasses.replace(self.cfp, top_k=1), self.backend,
                                           on_gpu=True)
        except ConfigError:
            return False
        return True


def zero_what_fits(job: JobSpec, cfp: CfpSpec, backend: BackendSpec) -> tuple[str, str]:
    """Where no ZeRO plan of ``job`` fits on its preset (every rank a GPU of it): the fewest nodes at which one
    does, planned (doubling then bisecting, as :func:`~cfp_megatron.planner.sizing.smallest_fitting`), as a
    sentence and the fix; empty where the cluster does not state its GPUs per node."""
    gpn = job.cluster.gpus_per_node
    if not gpn or job.cluster.on_cpu:
        return "", ""
    batch = job.train.global_batch_size
    top = min(batch // gpn, growth_limit(job.cluster.nodes, gpn))  # every rank holds a sequence of the batch
    if top <= job.cluster.nodes:
        return (f"More nodes of cluster={job.cluster.name} would not take it: ZeRO gives every rank whole sequences, "
                f"and train.global_batch_size={batch} has none for more ranks.",
                "raise train.global_batch_size (a multiple of the ranks) and start more ranks; else ")
    sizes = _ZeroSizes(job=job, cfp=cfp, backend=backend)
    nodes = smallest_fitting(sizes, job.cluster.nodes, limit_nodes=top)
    if nodes is None:
        return (f"None fits on up to {top:,} nodes of cluster={job.cluster.name} either (the most tried: "
                + (f"{GROWTH} times as many" if top * gpn < batch else f"train.global_batch_size={batch} has a "
                   "sequence for each rank of no more") + ").", "")
    best = sizes.best[nodes].best
    return (f"The fewest nodes of cluster={job.cluster.name} on which one fits: cluster.nodes={nodes} "
            f"({ranks(nodes * gpn)}): {best.plan.describe()}, {gib(best.result.memory.total / GIB)} per rank.",
            f"size the cluster to cluster.nodes={nodes} or more; else ")

ZERO_PLAN_FIX = ("partition more of the model (backend.zero_stage=3 partitions parameters, gradients and optimizer "
                 "states), recompute activations (backend.activation_checkpointing=true), lower "
                 "train.micro_batch_size, or let +cfp=auto find a plan that fits; else ")
"""What to change first when a DeepSpeed plan given by hand does not fit."""


def check_zero_search_fits(job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *, on_gpu: bool,
                           figures: tuple[ClusterSpec, Measurements | None] | None = None) -> None:
    """Before profiling (``+cfp=auto``): the DeepSpeed search on this machine's ``figures`` (its cluster and stored
    profile, else the analytical model: :func:`~cfp_megatron.profile.cluster.local_measurements`); a
    :class:`ConfigError` naming the memory the smallest plan needs and the memory each rank has when plans exist but
    none fits. Other refusals of the search (its pins) are raised as the search raises them."""
    cluster, measurements = figures or local_measurements(job, world_size=world)
    if cluster.hbm_gib is None:
        return
    here = dataclasses.replace(job, cluster=cluster)
    try:
        search_zero(here, world, dataclasses.replace(cfp, top_k=1), backend, measurements=measurements,
                    on_gpu=on_gpu)
        return
    except ConfigError:
        # Without the memory limit: no plan at all is the pins' refusal (raised here as the search words it);
        # plans that exist mean memory is the cause.
        unlimited = search_zero(dataclasses.replace(here, cluster=dataclasses.replace(cluster, hbm_gib=None)), world,
                                dataclasses.replace(cfp, top_k=1_000_000), backend, measurements=measurements,
                                on_gpu=on_gpu)
    need = min(r.result.memory.total for r in unlimited.ranked) / GIB
    headroom = cfp.constraints.memory_headroom
    what = (f"no DeepSpeed ZeRO plan of {job.model.name} on {ranks(world)} fits in memory: the smallest of the "
            f"{unlimited.evaluated:,} checked needs at least")
    pinned = pin_keys(zero_pins(backend, cfp), backend, cfp)
    issue = memory_issue(job.cluster, cluster, world, what=what, need_gib=need,
                         limit_gib=cluster.hbm_gib * (1.0 - headroom), headroom=headroom,
                         fix=zero_pins_fix(pinned) + ZERO_MEMORY_FIX)
    if not pinned and measurements is None and world == job.cluster.nodes * (job.cluster.gpus_per_node or 0):
        fits, fix = zero_what_fits(job, cfp, backend)  # a preflight on a preset: plan the sizes that would fit
        issue = dataclasses.replace(issue, problem=f"{issue.problem} {fits}".rstrip(), fix=fix + issue.fix)
    raise ConfigError(issue)


def check_zero_plan_fits(job: JobSpec, plan: Plan, world: int) -> None:
    """Before any process group, for a DeepSpeed plan not chosen by this machine's search: a :class:`ConfigError`
    when its predicted peak (:func:`~cfp_megatron.backends.deepspeed.costs.simulate_zero`) exceeds each rank's
    memory (no headroom: the user chose it)."""
    cluster, measurements = local_measurements(job, world_size=world)
    if cluster.hbm_gib is None:
        return
    need = simulate_zero(job, plan, measurements, cluster=cluster).memory.total / GIB
    if need > cluster.hbm_gib:
        raise ConfigError(memory_issue(job.cluster, cluster, world, need_gib=need, limit_gib=cluster.hbm_gib,
                                       what=f"the DeepSpeed plan {plan.describe()} of {job.model.name} on "
                                            f"{ranks(world)} needs", headroom=None,
                                       fix=ZERO_PLAN_FIX + ZERO_MEMORY_FIX))
