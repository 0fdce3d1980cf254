"""The one overlap rule the terms share: communication beside computation hides up to the computation's length and
slows the computation by the share of the GPU the communication kernel takes (docs/simulator.md, "moe_cost.py")."""

from __future__ import annotations

COMM_SM_SHARE = 0.15
"""Share of the GPU's streaming multiprocessors a communication kernel occupies while it overlaps with computation
(DeepSeek-V3 report, section 3.2.2: 20 of the H800's 132 SMs for the all-to-all): overlapped computation runs that
much slower for as long as the communication lasts."""


def overlapped(comm_s: float, window_s: float) -> tuple[float, float]:
    """(communication left exposed, computation slowdown) when ``comm_s`` of communication runs beside
    ``window_s`` of computation: the computation loses :data:`COMM_SM_SHARE` of its speed while they overlap."""
    hidden = min(comm_s, window_s)
    return comm_s - hidden, hidden * COMM_SM_SHARE
