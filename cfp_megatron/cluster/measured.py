"""What the simulator may read from measurements: the contract between profiling (``cfp_megatron.profile``) and the
simulator (``cfp_megatron.sim``).

Profiling rounds fill a ProfileDB; the simulator only sees it through :class:`Measurements`, so it runs the same on a
preset (nothing measured: every method answers ``None`` and the ``ClusterSpec`` figures stand in) and on a profiled
cluster. Everything here is plain data: no ``torch.distributed``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol


class Collective(enum.Enum):
    """Collectives the search can produce."""

    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_to_all = "all_to_all"
    send_recv = "send_recv"


class Span(enum.Enum):
    """Where a group's ranks sit."""

    intra_node = "intra_node"
    """All ranks of the group on one node (NVLink/NVSwitch; shared memory or loopback on CPU)."""
    inter_node = "inter_node"
    """The group crosses nodes (InfiniBand/RoCE)."""


def ring_factor(op: Collective, group_size: int) -> float:
    """Bytes each rank moves per byte of message with the ring algorithm (NCCL's "bus bandwidth" factor).

    The message is what one rank passes in: the input of all-reduce and reduce-scatter, the output of all-gather, the
    total a rank sends in all-to-all, the tensor of a send/recv. all-reduce ``2(g-1)/g``, all-gather and
    reduce-scatter ``(g-1)/g``, all-to-all ``(g-1)/g``, send/recv 1.
    """
    g = max(int(group_size), 1)
    if op is Collective.send_recv:
        return 1.0
    if g == 1:
        return 0.0
    share = (g - 1) / g
    return 2 * share if op is Collective.all_reduce else share


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """``seconds(bytes) = latency_s + bytes / bandwidth_bytes_per_s`` for one collective on one group pattern."""

    op: Collective
    """The collective."""
    group_size: int
    """Ranks in the group."""
    span: Span
    """Inside one node or across nodes."""
    latency_s: float
    """Fitted fixed cost in seconds (intercept)."""
    bandwidth_bytes_per_s: float
    """Fitted message bytes per second (slope⁻¹), message as :func:`ring_factor` defines it."""
    points: int = 0
    """Timed message sizes the fit used."""
    max_rel_error: float = 0.0
    """Largest relative error of the fit over those points."""

    def seconds(self, message_bytes: float) -> float:
        """Predicted time for one call with a message of ``message_bytes``."""
        if message_bytes <= 0 or (self.group_size <= 1 and self.op is not Collective.send_recv):
            return 0.0
        return self.latency_s + message_bytes / self.bandwidth_bytes_per_s

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """Bandwidth per link the fit implies (message bandwidth x :func:`ring_factor`), comparable across sizes."""
        return self.bandwidth_bytes_per_s * ring_factor(self.op, self.group_size)


class Measurements(Protocol):
    """Read-only view of what profiling measured; every answer may be ``None`` (not measured)."""

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        """The fit for ``op`` over a group of ``group_size`` ranks within or across nodes."""
        ...

    def gemm_tflops(self, m: int, n: int, k: int, dtype: str) -> float | None:
        """Achieved TFLOP/s of an ``(m x k) @ (k x n)`` matmul in ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``),
        interpolated from the measured table."""
        ...

    def peak_tflops(self, dtype: str) -> float | None:
        """Best matmul throughput measured in ``dtype`` (the device's practical peak)."""
        ...

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds of one segment class (``segment``: its key in the analysis JSON)
        under one candidate partition (its canonical string) at micro-batch size ``micro_batch``."""
        ...


class NothingMeasured:
    """:class:`Measurements` for a preset cluster: nothing was measured."""

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        return None

    def gemm_tflops(self, m: int, n: int, k: int, dtype: str) -> float | None:
        return None

    def peak_tflops(self, dtype: str) -> float | None:
        return None

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        return None
