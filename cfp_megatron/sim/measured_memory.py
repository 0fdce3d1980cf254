"""Activation memory per rank from profiled segments (CFP): where profiling measured the tensor memory of each
segment class under the plan's partition, the stage's activations come from those measurements and the pipeline
schedule instead of the analytical (Korthikanti) formulas.

Profiling measures, per segment and micro-batch size, as PyTorch's ``MemTracker`` counts a training step
(:meth:`cfp_megatron.profile.segments.SegmentBench.memory`): the bytes one forward pass keeps for its backward, how far
the live bytes rise above that while the segment runs (forward or backward transients), and persistent workspace
buffers counted once per rank. Other micro-batch sizes are interpolated linearly between the two nearest measured
sizes (extrapolated from the two largest or smallest), as :mod:`cfp_megatron.sim.measured_segments` does for times.

A stage's peak (``in_flight`` micro-batches held, per :func:`cfp_megatron.sim.memory.in_flight`): every in-flight
micro-batch keeps all its segments' activations, except that the micro-batch being processed has only run the
segments up to the one at the peak (the forward pass has not run the rest yet; the backward pass has freed them), so
the peak is ``(n - 1) K + max_i (K_1 + ... + K_i + T_i)`` over the stage's segments ``i`` in model order, plus the
workspace and the pipeline's point-to-point tensors (:func:`pipeline_buffers`).
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
    ordered = sorted(points, key=lambda p: p[0])
    if not ordered:
        raise ConfigError(ConfigIssue(key="measurements", value=None, problem="no segment memory measured.",
                                      fix="profile the cluster (python -m cfp_megatron.profile)."))
    rows = [(float(mb), (m.activation_bytes, m.transient_bytes, m.workspace_bytes)) for mb, m in ordered]
    activation, transient, workspace = interpolate_rows(rows, micro_batch)
    return SegmentMemory(activation_bytes=activation, transient_bytes=transient, workspace_bytes=workspace)


def measured_memory(measurements: Measurements, kind: str, partition: str, micro_batch: int) -> SegmentMemory | None:
    """Memory of segment ``kind`` under ``partition`` at ``micro_batch``, measured or interpolated; ``None`` when
    nothing was measured for that kind and partition."""
    exact = measurements.segment_memory(kind, partition, micro_batch)
    if exact is not None:
        return exact
    points = [(mb, hit) for mb in measurements.segment_micro_batches(kind, partition)
              if (hit := measurements.segment_memory(kind, partition, mb)) is not None]
    return interpolate(points, micro_batch) if points else None


def peak_activation_bytes(segments: Sequence[SegmentMemory], in_flight: int) -> float:
    """Peak activation bytes of a stage that runs ``segments`` (in model order) per micro-batch and holds
    ``in_flight`` micro-batches at its peak: ``(n - 1) K + max_i (K_1 + ... + K_i + T_i)`` plus the largest
    workspace (shared: one buffer per rank). Raises :class:`ConfigError` for ``in_flight`` below 1."""
    if in_flight < 1:
        raise ConfigError(ConfigIssue(key="in_flight", value=in_flight, problem="must be 1 or more.",
                                      fix="pass the in-flight micro-batches of the schedule."))
    if not segments:
        return 0.0
    kept = sum(s.activation_bytes for s in segments)
    running = 0.0
    top = 0.0
    for seg in segments:
        running += seg.activation_bytes
        top = max(top, running + seg.transient_bytes)
    return (in_flight - 1) * kept + top + max(s.workspace_bytes for s in segments)


def pipeline_buffers(hidden_bytes: float, *, pp: int, first: bool, last: bool, in_flight: int,
                     microbatches: int) -> float:
    """Point-to-point tensors of Megatron's pipeline schedule alive at the stage's peak, in units of the tensor
    passed between stages (``hidden_bytes``, one micro-batch's hidden states on this rank).

    Every stage after the first holds its received input per in-flight micro-batch (the probe's segments did not
    create their input); every stage before the last frees each sent output (``deallocate_pipeline_outputs``, which
    the runtime sets), so the output its last segment counted is gone, and holds the received output gradient during
    the backward pass; the last stage in steady 1F1B (more than one micro-batch) still holds the previous
    micro-batch's input gradient (the schedule's ``input_tensor_grad``) while the next runs.
    """
    if pp <= 1:
        return 0.0
    units = 0.0
    if not first:
        units += in_flight
    if not last:
        units += 1 - in_flight
    elif microbatches > 1:
        units += 1
    return units * hidden_bytes
