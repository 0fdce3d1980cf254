"""Least-squares fits of timed collectives: ``seconds = latency + bytes / bandwidth`` (pure, no torch)."""

from __future__ import annotations

from collections.abc import Sequence

from cfp_megatron.cluster.measured import Collective, CollectiveFit, Span
from cfp_megatron.profile.errors import ProfileError

MIN_LATENCY_S = 1e-9
"""Floor of a fitted latency: a negative intercept (noise on small messages) is clamped to this."""


def fit_collective(op: Collective, group_size: int, span: Span,
                   points: Sequence[tuple[float, float]]) -> CollectiveFit:
    """Fit ``(message_bytes, seconds)`` points to ``latency + bytes / bandwidth`` by ordinary least squares.

    A negative intercept is clamped to :data:`MIN_LATENCY_S` and the slope refitted through it; a non-positive slope
    (times that do not grow with size, i.e. latency-bound over the whole range) falls back to the bandwidth the
    largest message implies. ``max_rel_error`` is the largest ``|predicted - measured| / measured``.
    """
    pts = [(float(x), float(y)) for x, y in points if x > 0 and y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        raise ProfileError(f"fitting {op.value} over {group_size} ranks ({span.value}) needs timings at two or more "
                           f"message sizes; got {len(pts)} usable point(s) of {len(points)}.")
    n = len(pts)
    mean_x = sum(x for x, _ in pts) / n
    mean_y = sum(y for _, y in pts) / n
    sxx = sum((x - mean_x) ** 2 for x, _ in pts)
    sxy = sum((x - mean_x) * (y - mean_y) for x, y in pts)
    slope = sxy / sxx
    latency = mean_y - slope * mean_x
    if latency < MIN_LATENCY_S:
        latency = MIN_LATENCY_S
        slope = sum(x * (y - latency) for x, y in pts) / sum(x * x for x, _ in pts)
    if slope <= 0:
        x_max, y_max = max(pts)
        slope = max(y_max - latency, y_max * 1e-3) / x_max
    bandwidth = 1.0 / slope
    errors = [abs(latency + x / bandwidth - y) / y for x, y in pts]
    return CollectiveFit(op=op, group_size=group_size, span=span, latency_s=latency,
                         bandwidth_bytes_per_s=bandwidth, points=n, max_rel_error=max(errors))
