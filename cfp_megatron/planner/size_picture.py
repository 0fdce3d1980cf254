"""The sizing's picture: time to train against GPU-hours of every candidate cluster with a plan, one colour per
kind, the Pareto front joined, the deadline drawn (``cfp size``, docs/sizing.md)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cfp_megatron.base.files import atomic_writer
from cfp_megatron.planner.sizing import DAY_S, Sized


def load_matplotlib() -> object:
    """matplotlib's pyplot on the Agg backend (imported once; :func:`~cfp_megatron.planner.sizing.size_all` has it
    imported while the workers plan)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_sizing_png(rows: Sequence[Sized], front: Sequence[Sized], path: Path, *, title: str,
                     deadline_s: float | None = None, key: str | None = None) -> Path:
    """Draw ``rows`` (those with a plan; error bars: the band) to ``path``, ``front`` joined and ringed; written
    atomically (a refused write is a :class:`~cfp_megatron.base.files.FileWriteError` naming ``key``)."""
    plt = load_matplotlib()
    fig, ax = plt.subplots(figsize=(9, 6))
    kinds = list(dict.fromkeys(r.cluster for r in rows if r.time_s is not None))
    colours = plt.get_cmap("tab10")
    for i, kind in enumerate(kinds):
        own = [r for r in rows if r.cluster == kind and r.time_s is not None]
        x = [r.gpu_hours for r in own]
        y = [r.time_s / DAY_S for r in own]
        err = [r.time_s * r.band_pct / 100 / DAY_S if r.band_pct is not None else 0.0 for r in own]
        ax.errorbar(x, y, yerr=err, fmt="o", color=colours(i), capsize=3, markersize=5, label=kind, alpha=0.85)
        for r in own:
            ax.annotate(f"{r.gpus:,}", (r.gpu_hours, r.time_s / DAY_S), textcoords="offset points", xytext=(4, 4),
                        fontsize=7, color=colours(i))
    if front:
        ax.plot([r.gpu_hours for r in front], [r.time_s / DAY_S for r in front], "-", color="#333333",
                linewidth=1.0, zorder=1, label="Pareto front")
        ax.scatter([r.gpu_hours for r in front], [r.time_s / DAY_S for r in front], s=110, facecolors="none",
                   edgecolors="#333333", linewidths=1.2, zorder=3)
    if deadline_s is not None:
        ax.axhline(deadline_s / DAY_S, color="#D62728", linestyle="--", linewidth=1.0,
                   label=f"deadline ({deadline_s / DAY_S:g} days)")
    ax.set_xlabel("GPU-hours")
    ax.set_ylabel("time to train (days)")
    ax.set_yscale("log")
    ax.set_title(title, fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.text(0.01, 0.01, "labels: GPUs; bars: the prediction's error band; ringed: the Pareto front", fontsize=7,
             color="#555555")
    fig.tight_layout()
    with atomic_writer(path, "wb", key=key) as fh:
        fig.savefig(fh, format="png", dpi=110, metadata={"Software": "cfp-megatron"})
    plt.close(fig)
    return path
