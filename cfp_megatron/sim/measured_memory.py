"""Activation memory per rank (bytes) from profiled segments (CFP): where profiling measured the tensor memory of
each segment class under the plan's partition, the stage's activations come from those measurements and the pipeline
schedule instead of the analytical (Korthikanti) formulas. What is measured and how the peak is composed:
docs/simulator.md, "measured_memory.py".
"""

from __future__ import annotations

from collections.abc import Sequence

from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.cluster.measured import Measurements, SegmentMemory, interpolate_rows


def interpolate(points: Sequence[tuple[int, SegmentMemory]], micro_batch: int) -> SegmentMemory:
    """The memory at ``micro_batch`` from measured ``(micro-batch size, memory)`` points: linear between the two
    nearest sizes, extrapolated from the two smallest or largest, proportional to the size with one point; never
    negative. Raises :class:`ConfigError` for no points or a size below 1."""
    if micro_batch < 1:
        raise ConfigError(ConfigIssue(key="train.micro_batch_size", value=micro_batch, problem="must be 1 or more.",
                                      fix="use a positive micro-batch size."))
    ordered = sorted(points, key=lambda point: point[0])
    if not ordered:
        raise ConfigError(ConfigIssue(key="measurements", value=None, problem="no segment memory measured.",
                                      fix="profile the cluster (python -m cfp_megatron.profile)."))
    rows = [(float(size), (memory.activation_bytes, memory.transient_bytes, memory.workspace_bytes))
            for size, memory in ordered]
    activation, transient, workspace = interpolate_rows(rows, micro_batch)
    return SegmentMemory(activation_bytes=activation, transient_bytes=transient, workspace_bytes=workspace)


def measured_memory(measurements: Measurements, kind: str, partition: str, micro_batch: int) -> SegmentMemory | None:
    """Memory (bytes) of segment ``kind`` under ``partition`` at ``micro_batch`` sequences, measured or interpolated;
    ``None`` when nothing was measured for that kind and partition."""
    exact = measurements.segment_memory(kind, partition, micro_batch)
    if exact is not None:
        return exact
    points = [(size, hit) for size in measurements.segment_micro_batches(kind, partition)
              if (hit := measurements.segment_memory(kind, partition, size)) is not None]
    return interpolate(points, micro_batch) if points else None


def peak_activation_bytes(segments: Sequence[SegmentMemory], in_flight: int) -> float:
    """Peak activation bytes of a stage that runs ``segments`` (in model order) per micro-batch and holds
    ``in_flight`` micro-batches (``n``) at its peak: ``(n - 1) K + max_i (K_1 + ... + K_i + T_i)``, with ``K_i`` the
    bytes segment ``i`` keeps for backward, ``K`` their sum and ``T_i`` its transient bytes, plus the largest
    workspace (shared: one buffer per rank). Raises :class:`ConfigError` for ``in_flight`` below 1."""
    if in_flight < 1:
        raise ConfigError(ConfigIssue(key="in_flight", value=in_flight, problem="must be 1 or more.",
                                      fix="pass the in-flight micro-batches of the schedule."))
    if not segments:
        return 0.0
    kept = sum(segment.activation_bytes for segment in segments)
    running = 0.0  # K_1 + ... + K_i
    current_peak = 0.0  # max over the segments so far of running + T_i
    for segment in segments:
        running += segment.activation_bytes
        current_peak = max(current_peak, running + segment.transient_bytes)
    return (in_flight - 1) * kept + current_peak + max(segment.workspace_bytes for segment in segments)


def pipeline_buffers(hidden_bytes: float, *, pp: int, first: bool, last: bool, in_flight: int,
                     microbatches: int) -> float:
    """Bytes of the point-to-point tensors of Megatron's pipeline schedule alive at the stage's peak, counted in
    units of the tensor passed between stages (``hidden_bytes``, one micro-batch's hidden states on this rank), for
    a stage of ``pp`` that is the ``first`` or ``last`` and holds ``in_flight`` of ``microbatches`` micro-batches
    (which tensors: docs/simulator.md, "Pipeline buffers")."""
    if pp <= 1:
        return 0.0
    units = 0.0  # tensors of hidden_bytes each
    if not first:
        units += in_flight
    if not last:
        units += 1 - in_flight
    elif microbatches > 1:
        units += 1
    return units * hidden_bytes
