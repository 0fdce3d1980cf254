"""The plan check's picture: predicted against measured step time and peak memory of a run with a plan
(:mod:`cfp_megatron.plan.check`). The run measures only the whole step (median) and the peak memory, so each
measurement is one bar beside the prediction's breakdown, stacked (docs/planning.md, on the plan check)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from cfp_megatron.base.files import atomic_writer
from cfp_megatron.profile.records import PlanCheckRecord
from cfp_megatron.sim.prediction import GIB

_TIME_COLOURS = {"forward": "#4C72B0", "backward": "#55A868", "per-layer overhead": "#8C8C8C",
                 "TP/CP/EP/FSDP comm": "#C44E52", "pipeline bubble": "#B0B0B0", "DP sync": "#CCB974",
                 "tied-embedding sync": "#E1A35B", "token-count sync": "#937860", "optimizer": "#8172B3",
                 "host": "#64B5CD"}
_MEMORY_COLOURS = {"parameters": "#4C72B0", "gradients": "#55A868", "optimizer states": "#8172B3",
                   "activations": "#DD8452", "comm buffers": "#C44E52"}
_MEASURED = "#333333"
_PLAIN = "#9DB4D3"


def free_path(path: str | Path) -> Path:
    """``path``, or ``<stem>-2<suffix>``, ``-3``, ... where it is taken (a picture of an earlier launch is kept)."""
    path = Path(path)
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.stem}-{number}{path.suffix}")
    return candidate


def _stack(ax: object, x: float, parts: Sequence[tuple[str, float]], colours: dict[str, str], scale: float,
           labelled: set[str]) -> float:
    """Stack ``parts`` (name, value) at ``x``, each scaled by ``scale``; return the top."""
    bottom = 0.0
    for name, value in parts:
        height = value * scale
        if height <= 0:
            continue
        label = name if name not in labelled else None
        labelled.add(name)
        ax.bar(x, height, bottom=bottom, width=0.6, color=colours.get(name, _PLAIN), label=label,
               edgecolor="white", linewidth=0.5)
        bottom += height
    return bottom


def _diff(measured: float, predicted: float) -> str:
    return f"{measured / predicted - 1:+.1%}" if predicted > 0 else "n/a"


def write_check_png(record: PlanCheckRecord, path: str | Path, *,
                    time_parts: Sequence[tuple[str, float]] = (), memory_parts: Sequence[tuple[str, float]] = (),
                    title: str = "", note: str = "", key: str | None = None) -> Path:
    """Draw ``record`` to ``path`` (PNG; returns the path): step time in ms (the predicted breakdown ``time_parts``,
    seconds by part, stacked where given, else the predicted total; the calibrated prediction where a calibration
    scaled it; the measured median) and peak memory in GiB per rank (``memory_parts`` in bytes likewise; the
    measured peak where it was measured). ``note`` is said under the title. Written atomically: a refused write is a
    :class:`~cfp_megatron.base.files.FileWriteError` naming ``key``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(11, 6.2), gridspec_kw={"width_ratios": [3, 2]})
    labelled: set[str] = set()
    # step time, milliseconds
    predicted_ms = record.predicted_step_s * 1e3
    labels = ["predicted"]
    if time_parts:
        _stack(time_ax, 0, time_parts, _TIME_COLOURS, 1e3, labelled)
    else:
        time_ax.bar(0, predicted_ms, width=0.6, color=_PLAIN, label="predicted (no breakdown)")
    bars = [predicted_ms]
    calibrated_ms = predicted_ms * record.calibration
    if record.calibration != 1.0:
        time_ax.bar(len(labels), calibrated_ms, width=0.6, color=_PLAIN, hatch="//", edgecolor="white",
                    label="predicted x calibration")
        labels.append(f"calibrated\n(x {record.calibration:.3f})")
        bars.append(calibrated_ms)
    measured_ms = record.measured_step_s * 1e3
    x = len(labels)
    spread = f"; red: spread {record.repeat_spread:.0%}" if record.repeat_spread else ""
    time_ax.bar(x, measured_ms, width=0.6, color=_MEASURED,
                label=f"measured (median of {record.steps} steps{spread})")
    half = measured_ms * (record.repeat_spread or 0.0) / 2
    if half:
        time_ax.errorbar(x, measured_ms, yerr=half, color="#D62728", capsize=5, linewidth=1.2)
    labels.append("measured")
    bars.append(measured_ms)
    top = max(bars[:-1] + [measured_ms + half]) * 1.22
    for position, value in enumerate(bars):
        text = f"{value:.4g} ms"
        if position == x:
            text += f"\n{_diff(measured_ms, calibrated_ms)}" + (" vs calibrated" if record.calibration != 1.0 else "")
        time_ax.text(position, value + (half if position == x else 0.0) + top * 0.015, text, ha="center",
                     va="bottom", fontsize=9)
    time_ax.set_xticks(range(len(labels)), labels)
    time_ax.set_ylim(0, top)
    time_ax.set_ylabel("step time (ms)")
    time_ax.set_title("step time", fontsize=11)
    time_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, frameon=False, ncol=3)
    # peak memory, GiB per rank
    memory_labels: list[str] = []
    memory_bars: list[float] = []
    if record.predicted_peak_bytes is not None:
        if memory_parts:
            _stack(memory_ax, 0, memory_parts, _MEMORY_COLOURS, 1 / GIB, labelled)
        else:
            memory_ax.bar(0, record.predicted_peak_bytes / GIB, width=0.6, color=_PLAIN)
        memory_labels.append("predicted")
        memory_bars.append(record.predicted_peak_bytes / GIB)
    if record.measured_peak_bytes is not None:
        memory_ax.bar(len(memory_labels), record.measured_peak_bytes / GIB, width=0.6, color=_MEASURED)
        memory_labels.append("measured")
        memory_bars.append(record.measured_peak_bytes / GIB)
    if memory_bars:
        top = max(memory_bars) * 1.22
        for position, value in enumerate(memory_bars):
            text = f"{value:.3g} GiB"
            if memory_labels[position] == "measured" and record.predicted_peak_bytes:
                text += f"\n{_diff(value, record.predicted_peak_bytes / GIB)}"
            memory_ax.text(position, value + top * 0.015, text, ha="center", va="bottom", fontsize=9)
        memory_ax.set_ylim(0, top)
        memory_ax.set_xticks(range(len(memory_labels)), memory_labels)
        if memory_parts and record.predicted_peak_bytes is not None:
            memory_ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), fontsize=8, frameon=False, ncol=2)
    else:
        memory_ax.set_xticks([])
        memory_ax.set_yticks([])
        memory_ax.text(0.5, 0.5, "peak memory neither predicted\nnor measured", ha="center", va="center",
                       transform=memory_ax.transAxes, fontsize=9)
    if record.measured_peak_bytes is None and memory_bars:
        memory_ax.text(0.98, 0.97, "not measured", ha="right", va="top", transform=memory_ax.transAxes, fontsize=8)
    memory_ax.set_xlim(-0.6, 1.6)
    memory_ax.set_ylabel("peak memory per rank (GiB)")
    memory_ax.set_title("peak memory (most loaded rank)", fontsize=11)
    heading = title or "plan check: predicted vs measured"
    facts = [note] if note else []
    if record.busy:
        facts.append(f"machine busy while timed: {record.busy}")
    fig.suptitle("\n".join([heading, *facts]), fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_writer(path, "wb", key=key) as fh:
            fig.savefig(fh, format="png", dpi=110)
    finally:
        plt.close(fig)
    return path
