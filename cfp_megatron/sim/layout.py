"""The parallel layout the simulator works on: validated sizes plus where each process group's ranks sit (ranks of
each group per node)."""

from __future__ import annotations

from dataclasses import dataclass

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.costs import group_placement


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Sizes of one plan and the placement (ranks per node) of each of its groups."""

    dims: ParallelDims
    """The validated sizes (DP derived, micro-batch count)."""
    gpus_per_node: int
    """GPUs per node."""
    micro_batch: int
    """Sequences per micro-batch."""
    seq_length: int
    """Tokens per sequence (before context parallelism splits it)."""
    tp_per_node: int
    """Ranks of a TP group on one node."""
    cp_per_node: int
    """Ranks of a CP group on one node."""
    ep_per_node: int
    """Ranks of an EP group on one node."""
    dp_per_node: int
    """Ranks of the gradient-reduction group (DP x CP) on one node."""
    edp_per_node: int
    """Ranks of the expert-gradient reduction group on one node."""
    pp_intra_node: bool
    """Whether neighbouring pipeline stages share a node."""


def _strides(order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Rank stride of each group in ``sizes`` under Megatron's rank order ``order`` (e.g. ``"tp-cp-ep-dp-pp"``,
    fastest-varying first)."""
    stride, strides = 1, {}
    for name in order.split("-"):
        if name in sizes:
            strides[name] = stride
            stride *= sizes[name]
    return strides


def build_layout(job: JobSpec, world_size: int | None = None) -> Layout:
    """Validate ``job`` on its cluster (``world_size`` defaults to nodes x GPUs per node) and place its groups.
    Raises :class:`ConfigError` for a plan that does not fit the world size or a cluster without a world size."""
    cluster = job.cluster
    gpus_per_node = cluster.gpus_per_node
    if world_size is None:
        if gpus_per_node is None:
            raise ConfigError(ConfigIssue(key="cluster.gpus_per_node", value=None,
                                          problem="the simulator needs the world size.",
                                          fix="set cluster.gpus_per_node, or pass world_size to simulate()."))
        world_size = cluster.nodes * gpus_per_node
    if gpus_per_node is None:
        gpus_per_node = max(world_size // max(cluster.nodes, 1), 1)
    dims = ParallelDims.build(job, world_size, te_available=True)
    return place(job, dims, gpus_per_node)


def place(job: JobSpec, dims: ParallelDims, gpus_per_node: int) -> Layout:
    """Where the groups of ``dims`` (already validated, or taken as given) sit on nodes of ``gpus_per_node``."""
    dense = _strides(job.parallel.order, {"tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "pp": dims.pp})
    expert = _strides(job.parallel.order, {"tp": dims.etp, "ep": dims.ep, "dp": dims.expert_dp, "pp": dims.pp})
    tp_per_node = group_placement(dims.tp, dense["tp"], gpus_per_node)
    cp_per_node = group_placement(dims.cp, dense["cp"], gpus_per_node)
    ep_per_node = group_placement(dims.ep, expert["ep"], gpus_per_node)
    # Gradients of dense weights are reduced over DP x CP; with the standard order they form one strided block.
    dpcp_stride = min(dense["cp"], dense["dp"])
    dp_per_node = group_placement(dims.dp * dims.cp, dpcp_stride, gpus_per_node)
    edp_per_node = group_placement(dims.expert_dp, expert["dp"], gpus_per_node)
    return Layout(dims=dims, gpus_per_node=gpus_per_node, micro_batch=job.train.micro_batch_size,
                  seq_length=job.train.seq_length, tp_per_node=tp_per_node, cp_per_node=cp_per_node,
                  ep_per_node=ep_per_node, dp_per_node=dp_per_node, edp_per_node=edp_per_node,
                  pp_intra_node=dense["pp"] < gpus_per_node and dims.pp > 1 and dense["pp"] * 2 <= gpus_per_node)
