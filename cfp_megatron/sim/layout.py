"""The parallel layout the simulator works on: validated sizes plus where each process group's ranks sit (ranks of
each group per NVLink domain: a node, unless ``cluster.nvlink_domain_size`` makes the fast link wider, e.g. a 72-GPU
NVL72 rack, or narrower, e.g. NVLink-bridged pairs)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.costs import group_placement


@dataclass(frozen=True, kw_only=True)
class Layout:
    """Sizes of one plan and the placement (ranks per NVLink domain) of each of its groups. The ``*_per_node``
    fields count ranks per domain, the unit the cost model's fast link spans; a domain is a node unless
    ``cluster.nvlink_domain_size`` says otherwise."""

    dims: ParallelDims
    """The validated sizes (DP derived, micro-batch count)."""
    gpus_per_node: int
    """GPUs per node."""
    domain_size: int
    """GPUs per NVLink (scale-up) domain: ``cluster.nvlink_domain_size``, else ``gpus_per_node``."""
    micro_batch: int
    """Sequences per micro-batch."""
    seq_length: int
    """Tokens per sequence (before context parallelism splits it)."""
    tp_per_node: int
    """Ranks of a TP group in one NVLink domain."""
    cp_per_node: int
    """Ranks of a CP group in one NVLink domain."""
    ep_per_node: int
    """Ranks of an EP group in one NVLink domain."""
    ep_per_host: int
    """Ranks of an EP group on one host (node of ``gpus_per_node``) and NVLink domain: where DeepEP's NVLink buffers
    reach."""
    dp_per_node: int
    """Ranks of the gradient-reduction group (DP x CP) in one NVLink domain."""
    edp_per_node: int
    """Ranks of the expert-gradient reduction group in one NVLink domain."""
    pp_intra_node: bool
    """Whether neighbouring pipeline stages share an NVLink domain (the first two stages do; later pairs may not,
    :attr:`pp_crossings`)."""
    pp_crossings: tuple[bool, ...] = ()
    """Per pipeline rank ``r``: whether its exchange with rank ``r + 1`` (the last entry: rank ``pp - 1`` with rank
    0, which the interleaved schedule's chunks cross) leaves an NVLink domain for some of the stage's ranks; empty
    without a pipeline."""

    @property
    def pair_crossings(self) -> tuple[bool, ...]:
        """:attr:`pp_crossings`, or, for a layout made without them, every pair placed as the first
        (:attr:`pp_intra_node`)."""
        return self.pp_crossings or (not self.pp_intra_node,) * (self.dims.pp if self.dims.pp > 1 else 0)


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
    """Where the groups of ``dims`` (already validated, or taken as given) sit on the NVLink domains of a cluster
    with nodes of ``gpus_per_node`` (a domain is a node unless ``cluster.nvlink_domain_size`` says otherwise).

    A job larger than one domain of several nodes holds ``cluster.nvlink_segment_nodes`` nodes of each (64 GPUs of
    an NVL72 rack by default). Such a domain need not be a multiple of a group's span: there the groups are counted
    over the world, and a group that straddles two domains gets its smaller share (``group_placement``)."""
    domain = job.cluster.domain_size(gpus_per_node, dims.world_size)
    world = dims.world_size if domain != gpus_per_node else None

    def per_domain(size: int, stride: int) -> int:
        return group_placement(size, stride, domain, world_size=world)

    dense = _strides(job.parallel.order, {"tp": dims.tp, "cp": dims.cp, "dp": dims.dp, "pp": dims.pp})
    expert = _strides(job.parallel.order, {"tp": dims.etp, "ep": dims.ep, "dp": dims.expert_dp, "pp": dims.pp})
    tp_per_node = per_domain(dims.tp, dense["tp"])
    cp_per_node = per_domain(dims.cp, dense["cp"])
    ep_per_node = per_domain(dims.ep, expert["ep"])
    ep_per_host = min(ep_per_node, group_placement(dims.ep, expert["ep"], gpus_per_node))
    # Gradients of dense weights are reduced over DP x CP; with the standard order they form one strided block.
    dpcp_stride = min(dense["cp"], dense["dp"])
    dp_per_node = per_domain(dims.dp * dims.cp, dpcp_stride)
    edp_per_node = per_domain(dims.expert_dp, expert["dp"])
    return Layout(dims=dims, gpus_per_node=gpus_per_node, domain_size=domain, micro_batch=job.train.micro_batch_size,
                  seq_length=job.train.seq_length, tp_per_node=tp_per_node, cp_per_node=cp_per_node,
                  ep_per_node=ep_per_node, ep_per_host=ep_per_host, dp_per_node=dp_per_node, edp_per_node=edp_per_node,
                  pp_intra_node=dense["pp"] < domain and dims.pp > 1 and dense["pp"] * 2 <= domain,
                  pp_crossings=pp_crossings(dense["pp"], dims.pp, domain, dims.world_size))


@functools.lru_cache(maxsize=1024)
def pp_crossings(stride: int, pp: int, domain: int, world: int) -> tuple[bool, ...]:
    """:attr:`Layout.pp_crossings` of a pipeline of ``pp`` stages whose ranks are ``stride`` apart (Megatron's rank
    order), in a world of ``world`` ranks on NVLink domains of ``domain`` consecutive ranks: a stage's ranks are
    ``i + r x stride + j x stride x pp`` (``i < stride``), and the pair crosses where any of them sits in another
    domain than its neighbour."""
    if pp <= 1:
        return ()
    period = stride * pp
    # a rank's position in its domain repeats every domain / gcd(period, domain) groups of stages
    groups = range(max(1, min(world // period, domain // math.gcd(period, domain))))
    found = []
    for rank in range(pp):
        low, offset = (rank * stride, stride) if rank < pp - 1 else (0, (pp - 1) * stride)
        found.append(offset >= domain or any((i + low + j * period) % domain + offset >= domain
                                              for i in range(stride) for j in groups))
    return tuple(found)
