"""Interpolation in a measured GEMM throughput table (pure)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from cfp_megatron.profile.records import GemmRecord


def _log2(x: float) -> float:
    return math.log2(max(float(x), 1.0))


def _bracket(axis: Sequence[int], value: int) -> tuple[int, int, float]:
    """The two grid values around ``value`` (clamped to the ends) and the weight of the upper one, in log2 space."""
    if value <= axis[0]:
        return axis[0], axis[0], 0.0
    if value >= axis[-1]:
        return axis[-1], axis[-1], 0.0
    for lo, hi in zip(axis, axis[1:], strict=False):
        if lo <= value <= hi:
            return lo, hi, (_log2(value) - _log2(lo)) / (_log2(hi) - _log2(lo))
    return axis[-1], axis[-1], 0.0  # unreachable for a sorted axis


def interpolate_tflops(records: Sequence[GemmRecord], m: int, n: int, k: int) -> float | None:
    """TFLOP/s of an ``m x n x k`` matmul from ``records`` (one dtype).

    Trilinear in log2(m), log2(n), log2(k) when the eight surrounding grid points were measured (sizes beyond the
    table are clamped to its edge); otherwise inverse-distance weighting (power 2, log2 space) over every point,
    which also serves a table a deadline left partly filled. ``None`` for an empty table.
    """
    if not records:
        return None
    table = {(r.m, r.n, r.k): r.tflops for r in records}
    if (m, n, k) in table:
        return table[(m, n, k)]
    axes = [sorted({key[i] for key in table}) for i in range(3)]
    per_axis = []
    for axis, value in zip(axes, (m, n, k), strict=True):
        lo, hi, w = _bracket(axis, value)
        per_axis.append([(lo, 1.0)] if lo == hi else [(lo, 1.0 - w), (hi, w)])
    corners = [((a, b, c), wa * wb * wc) for a, wa in per_axis[0] for b, wb in per_axis[1] for c, wc in per_axis[2]]
    if all(c in table for c, _ in corners):
        return sum(table[c] * w for c, w in corners)
    target = (_log2(m), _log2(n), _log2(k))
    num = den = 0.0
    for (a, b, c), value in table.items():
        d2 = (_log2(a) - target[0]) ** 2 + (_log2(b) - target[1]) ** 2 + (_log2(c) - target[2]) ** 2
        weight = 1.0 / max(d2, 1e-12)
        num += weight * value
        den += weight
    return num / den
