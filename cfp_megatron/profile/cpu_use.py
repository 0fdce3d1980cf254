"""The CPU time other processes take on this machine (``/proc/stat``, else the load average): read by the plan check
and around every profiling round (:class:`~cfp_megatron.profile.load.LoadWatch`). Kept apart from
:mod:`cfp_megatron.profile.load` so planning and the plan check import it without torch."""

from __future__ import annotations

import os
import time

SAMPLE_S = 0.5
"""Seconds rank 0 samples the machine's CPU use for :func:`other_load`, while the job's other ranks wait for it."""


def cpu_times() -> tuple[float, float] | None:
    """(idle, total) seconds of all CPUs since boot from ``/proc/stat``; ``None`` off Linux."""
    try:
        with open("/proc/stat") as f:
            fields = [float(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (fields[3] + (fields[4] if len(fields) > 4 else 0.0)) / tick, sum(fields) / tick


def other_load(ranks_here: int, *, sample_s: float = SAMPLE_S) -> float | None:
    """Share of this machine's CPUs busy with work other than this job, 0..1 per core: on Linux, rank 0 samples the
    CPUs' busy time for ``sample_s`` while it idles (the job's other ranks soon wait for it in a collective);
    elsewhere the 1-minute load average less the ``ranks_here`` ranks of the job, over the cores. ``None`` where
    neither is known."""
    cores = os.cpu_count() or 1
    before = cpu_times()
    if before is not None:
        time.sleep(sample_s)
        after = cpu_times()
        if after is not None and after[1] > before[1]:
            return max(1.0 - (after[0] - before[0]) / (after[1] - before[1]), 0.0)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        return None
    return max(load - ranks_here, 0.0) / cores
