"""Collective communication time: a measured fit where profiling produced one, else an alpha-beta ring model.

:class:`CollectiveCosts` answers "how long does one ``op`` with a message of ``B`` bytes take over a group of ``g``
ranks that puts ``k`` ranks on each node". The message is what one rank passes in, as
:func:`~cfp_megatron.cluster.measured.ring_factor` defines it.

* A :class:`~cfp_megatron.cluster.measured.CollectiveFit` from :class:`Measurements` for exactly that
  (op, group size, span) wins.
* Otherwise the ring model: ``steps x latency + ring_factor x bytes / (bandwidth x efficiency)`` with the latency and
  per-GPU bandwidth of the :class:`~cfp_megatron.base.config.ClusterSpec` (NVLink inside an NVLink domain, the NIC
  rail across domains) and a fitted efficiency (the share of the nominal bandwidth NCCL reaches), across domains
  scaled by the fabric's share of line rate over InfiniBand's (:mod:`~cfp_megatron.cluster.fabrics`).
* "Node" in this module means the scale-up (NVLink) domain: one node unless ``cluster.nvlink_domain_size`` says
  otherwise (72 GPUs on an NVL72 rack, so a TP=16 or EP=64 group there is priced at NVLink speed; 2 on H100 NVL
  cards bridged in pairs). ``ranks_per_node`` is the group's ranks in one domain; the measured fits' ``intra_node``
  span is the fast link.
* A group that crosses domains with several ranks per domain is hierarchical, as NCCL runs it: all-reduce is an
  intra-domain reduce-scatter, an inter-domain all-reduce of ``1/k`` of the message on every rail at once, and an
  intra-domain all-gather; all-gather and reduce-scatter likewise; all-to-all moves its intra- and inter-domain
  shares at the same time over their own links.

Pure Python, no ``torch.distributed``.
"""

from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

from cfp_megatron.base.config import ClusterSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.cluster.fabrics import bandwidth_scale
from cfp_megatron.cluster.measured import Collective, Measurements, Span, ring_factor
from cfp_megatron.cluster.unstated import unstated_rates


@dataclass(frozen=True, kw_only=True)
class Link:
    """One level of the network as the ring model sees it."""

    latency_s: float
    """Fixed cost of one ring step in seconds."""
    bandwidth_bytes_per_s: float
    """Effective unidirectional bytes per second per GPU (nominal x efficiency)."""


def group_placement(size: int, stride: int, domain_size: int, *, world_size: int | None = None) -> int:
    """Ranks per NVLink domain (a node, unless ``cluster.nvlink_domain_size`` says otherwise) of a process group of
    ``size`` ranks whose members are ``stride`` ranks apart (the product of the faster-varying dimensions in
    Megatron's rank order), on domains of ``domain_size`` GPUs.

    Without ``world_size`` the groups are taken as aligned to the domains (``domain_size // stride`` per domain),
    which holds for power-of-two groups on 8-GPU nodes. With it, the groups of that many ranks are counted: where
    they do not tile the domains (groups of 16 ranks on two 72-GPU racks), some group straddles two domains, and the
    answer is the smallest share of one domain any group has (that group is the slowest, and the others wait for
    it); aligned groups get the same answer either way."""
    if size <= 1:
        return 1
    g = max(domain_size, 1)
    if stride >= g:
        return 1
    if world_size is None:
        return max(1, min(size, g // stride))
    return _smallest_share(size, stride, g, world_size)


@functools.lru_cache(maxsize=1024)
def _smallest_share(size: int, stride: int, domain: int, world: int) -> int:
    """Fewest members one domain of ``domain`` consecutive ranks holds of a group it holds any of, over the groups
    of ``size`` ranks ``stride`` apart in a world of ``world`` ranks (group bases ``j x size x stride + o``,
    ``o < stride``)."""
    span = size * stride
    smallest = size
    for block_start in range(0, world, span):
        for offset in range(stride):
            first = block_start + offset
            last = min(first + (size - 1) * stride, first + (world - 1 - first) // stride * stride)
            first_domain, last_domain = first // domain, last // domain
            if first_domain == last_domain:
                continue
            head = -(-((first_domain + 1) * domain - first) // stride)
            tail = (last - last_domain * domain) // stride + 1
            middle = domain // stride if last_domain - first_domain > 1 else size
            smallest = min(smallest, head, tail, middle)
    return max(smallest, 1)


class CollectiveCosts:
    """Seconds of one collective call on a cluster, measured or modelled (see the module docstring)."""

    def __init__(self, cluster: ClusterSpec, measurements: Measurements | None = None, *,
                 intra_efficiency: float = 1.0, inter_efficiency: float = 1.0) -> None:
        issues = []
        for key, value in (("intra_efficiency", intra_efficiency), ("inter_efficiency", inter_efficiency)):
            if not 0 < value <= 1.5:
                issues.append(ConfigIssue(key=f"costs.{key}", value=value, problem="must be in (0, 1.5].",
                                          fix="pass the share of nominal bandwidth NCCL reaches, e.g. 0.8."))
        if issues:
            raise ConfigError(issues)
        self.cluster = cluster
        self.measurements = measurements
        self.gpus_per_node = cluster.gpus_per_node or 1
        # GPUs that share the fast link: the NVLink domain, a node unless cluster.nvlink_domain_size says otherwise.
        self.domain_size = cluster.domain_size(self.gpus_per_node)
        unstated = unstated_rates()  # the figures of a cluster that states none (cluster/unstated.yaml)
        intra_bw = (cluster.intra_node_bandwidth_gbps or unstated.intra_node_bandwidth_gbps) * 1e9 * intra_efficiency
        # The fitted inter_efficiency holds InfiniBand's share of line rate; another fabric scales it by its own
        # share (cluster/fabrics.yaml: Omni-Path reaches 0.40 of InfiniBand's).
        inter_bw = ((cluster.network_bandwidth_gbps or unstated.inter_node_bandwidth_gbps) * 1e9 * inter_efficiency
                    * bandwidth_scale(cluster.network))
        self.intra = Link(latency_s=(cluster.intra_node_latency_us or unstated.latency_us) * 1e-6,
                          bandwidth_bytes_per_s=intra_bw)
        self.inter = Link(latency_s=(cluster.inter_node_latency_us or unstated.latency_us) * 1e-6,
                          bandwidth_bytes_per_s=inter_bw)
        self._cache: dict[tuple[Collective, int, Span], object] = {}
        self._seconds: dict[tuple[Collective, float, int, int | None], float] = {}  # seconds() by its arguments

    def _fit(self, op: Collective, size: int, span: Span):
        key = (op, size, span)
        if key not in self._cache:
            self._cache[key] = self.measurements.collective(op, size, span) if self.measurements else None
        return self._cache[key]

    def flat(self, op: Collective, message_bytes: float, size: int, span: Span) -> float:
        """One collective over a flat group on one network level (a measured fit if there is one)."""
        if message_bytes <= 0 or (size <= 1 and op is not Collective.send_recv):
            return 0.0
        fit = self._fit(op, size, span)
        if fit is not None:
            return fit.seconds(message_bytes)
        link = self.intra if span is Span.intra_node else self.inter
        if op is Collective.send_recv:
            steps = 1
        elif op is Collective.all_reduce:
            steps = 2 * (size - 1) if span is Span.intra_node else 2 * math.ceil(math.log2(size))
        else:
            steps = size - 1
        return steps * link.latency_s + ring_factor(op, size) * message_bytes / link.bandwidth_bytes_per_s

    def with_intra(self, intra: Link) -> CollectiveCosts:
        """These costs with the NVLink domain's link ``intra`` instead (the timings cached so far are not carried
        over: they were priced on the other link)."""
        other = copy.copy(self)
        other.intra, other._cache, other._seconds = intra, {}, {}
        return other

    def seconds(self, op: Collective, message_bytes: float, size: int, ranks_per_node: int | None = None) -> float:
        """One collective over ``size`` ranks with ``ranks_per_node`` of them in each NVLink domain (a node unless
        ``cluster.nvlink_domain_size`` says otherwise; default: as many as fit, i.e. a contiguous group); computed
        once per distinct call (a search prices the same collectives for many plans)."""
        key = (op, message_bytes, size, ranks_per_node)
        found = self._seconds.get(key)
        if found is None:
            found = self._seconds[key] = self._uncached(op, message_bytes, size, ranks_per_node)
        return found

    def _uncached(self, op: Collective, message_bytes: float, size: int, ranks_per_node: int | None) -> float:
        """:meth:`seconds`, computed."""
        if message_bytes <= 0 or (size <= 1 and op is not Collective.send_recv):
            return 0.0
        k = min(size, self.domain_size) if ranks_per_node is None else max(1, min(ranks_per_node, size))
        if op is Collective.send_recv:
            return self.flat(op, message_bytes, 2, Span.intra_node if k > 1 else Span.inter_node)
        if k >= size:
            return self.flat(op, message_bytes, size, Span.intra_node)
        measured = self._fit(op, size, Span.inter_node)
        if measured is not None:
            return measured.seconds(message_bytes)
        nodes = -(-size // k)
        if k == 1:
            return self.flat(op, message_bytes, size, Span.inter_node)
        if op is Collective.all_reduce:
            return (self.flat(Collective.reduce_scatter, message_bytes, k, Span.intra_node)
                    + self.flat(Collective.all_reduce, message_bytes / k, nodes, Span.inter_node)
                    + self.flat(Collective.all_gather, message_bytes, k, Span.intra_node))
        if op in (Collective.all_gather, Collective.reduce_scatter):
            return (self.flat(op, message_bytes / k, nodes, Span.inter_node)
                    + self.flat(op, message_bytes, k, Span.intra_node))
        # all-to-all: the intra-node and inter-node shares move at once over their own links.
        intra_bytes = message_bytes * (k - 1) / size
        inter_bytes = message_bytes * (size - k) / size
        return max(self.intra.latency_s * (k - 1) + intra_bytes / self.intra.bandwidth_bytes_per_s,
                   self.inter.latency_s * (nodes - 1) + inter_bytes / self.inter.bandwidth_bytes_per_s)
