"""Runs that ran, predicted above their GPU's memory: a class of failure of the memory model, not only a flag. A
measured run fit its GPUs, so a row whose predicted peak at the allocator band's lower end
(:func:`~cfp_megatron.sim.memory.memory_band`) exceeds its GPU's memory is a memory model that would have refused
what a team trained (docs/validation.md, "Memory failures")."""

from __future__ import annotations

from cfp_megatron.sim.memory import memory_band
from cfp_megatron.validation.results import RowResult


def memory_failures(results: list[RowResult]) -> dict:
    """The ``--json`` report's ``memory_failures``: how many modelled rows (of those whose GPU states its memory)
    are predicted above it at the band's lower end, and each such row (id, model, layout, predicted and lower-band
    GiB, the GPU's GiB, how many times it)."""
    rows, checked = [], 0
    for r in results:
        hbm = r.plan.job.cluster.hbm_gib
        if not hbm:
            continue
        checked += 1
        lower = r.memory_gib * memory_band(r.plan.job.cluster).low
        if lower > hbm:
            rows.append({"id": r.plan.row_id, "model": r.plan.model, "layout": r.plan.layout,
                         "memory_gib": round(r.memory_gib, 3), "lower_gib": round(lower, 3), "gpu_gib": hbm,
                         "times": round(lower / hbm, 3)})
    return {"count": len(rows), "checked": checked, "rows": rows}


def memory_failure_lines(results: list[RowResult]) -> list[str]:
    """What ``python -m cfp_megatron.validate`` prints of :func:`memory_failures`: the count, then a line a row."""
    found = memory_failures(results)
    lines = [f"memory failures: {found['count']} of {found['checked']} rows that ran are predicted above their "
             "GPU's memory (at the allocator band's lower end)"]
    lines += [f"  {row['id']:>5}  {row['model'][:28]:<28} {row['lower_gib']:.1f} GiB on {row['gpu_gib']:g} "
              f"({row['times']:.2f}x)" for row in found["rows"]]
    return lines
