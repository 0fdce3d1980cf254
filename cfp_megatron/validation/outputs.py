"""The files ``python -m cfp_megatron.validate`` writes besides its table: each target checked before any row is
predicted (``--plot``, ``--bands``, ``--json``), and the ``--plot`` scatter."""

from __future__ import annotations

from pathlib import Path

from cfp_megatron.base.files import atomic_writer, own_json_problem, writable_file_problem
from cfp_megatron.validation.report import REPORT_KEYS, row_classes
from cfp_megatron.validation.results import RowResult, mape

PLOT_BAND = 0.10
"""Relative error band the ``--plot`` scatter shades around y = x."""

_PLOT_STYLES = (("#4C72B0", "o"), ("#DD8452", "s"), ("#55A868", "^"), ("#C44E52", "D"), ("#8172B3", "v"),
                ("#937860", "P"), ("#DA8BC3", "X"), ("#8C8C8C", "*"))
"""Colour and marker of each class in the ``--plot`` scatter, in the order the classes sort."""


def plot_class(row: dict) -> str:
    """The one class a row is drawn under in the ``--plot`` scatter: its :func:`row_classes` joined (``MoE + CP``),
    CP named for what it serves (long context)."""
    return " + ".join("CP (long context)" if name == "CP" else name for name in row_classes(row))


def check_plot_path(path: str) -> str | None:
    """Why ``--plot`` cannot write ``path`` (a PNG, a new file in an existing folder), ``None`` when it can."""
    target = Path(path)
    if target.suffix.lower() != ".png":
        return f"--plot {path}: the picture is a PNG; name a file ending in .png"
    if target.is_dir():
        return f"--plot {path}: is a directory; name a .png file in it"
    if not target.parent.is_dir():
        return f"--plot {path}: folder {target.parent} does not exist; create it or name a .png file in another"
    if target.exists():
        return f"--plot {path}: the file exists and is never overwritten; remove it or name another .png file"
    return _unwritable("--plot", target)


def _unwritable(option: str, target: Path) -> str | None:
    """Why ``option``'s file ``target`` (in an existing folder) cannot be written, found before any row is predicted
    (a read-only file system, no permission); ``None`` when it can."""
    problem = writable_file_problem(target)
    return None if problem is None else (f"{option} {target}: {problem} Fix: name a file in a folder this user can "
                                         "write to.")


def write_plot(results: list[RowResult], rows_by_id: dict[str, dict], path: str | Path) -> Path:
    """Draw predicted against measured step time (seconds, log axes), a colour and marker per :func:`plot_class`
    with its rows and MAPE in the legend, the line y = x and the ±:data:`PLOT_BAND` band, to ``path`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[str, list[RowResult]] = {}
    for r in results:
        groups.setdefault(plot_class(rows_by_id.get(r.plan.row_id, {})), []).append(r)
    fig, ax = plt.subplots(figsize=(8.5, 7.5))
    values = [v for r in results for v in (r.plan.measured_s, r.predicted_s)]
    low, high = min(values) / 1.6, max(values) * 1.6
    line = [low, high]
    ax.fill_between(line, [v * (1 - PLOT_BAND) for v in line], [v * (1 + PLOT_BAND) for v in line],
                    color="#DDDDDD", label=f"within ±{PLOT_BAND:.0%}", zorder=0)
    ax.plot(line, line, color="#555555", linewidth=1, label="predicted = measured", zorder=1)
    ordered = sorted(groups.items(), key=lambda item: (-len(item[1]), item[0]))
    for index, (name, members) in enumerate(ordered):
        colour, marker = _PLOT_STYLES[index % len(_PLOT_STYLES)]
        ax.scatter([r.plan.measured_s for r in members], [r.predicted_s for r in members], s=42, color=colour,
                   marker=marker, edgecolor="black", linewidth=0.4, alpha=0.85, zorder=2,
                   label=f"{name}: {len(members)} rows, MAPE {mape(members):.1f}%")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(low, high)
    ax.set_ylim(low, high)
    ax.set_aspect("equal")
    ax.set_xlabel("measured step time (s)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(f"predicted vs measured step time: MAPE {mape(results):.1f}% over {len(results)} rows", fontsize=11)
    ax.grid(which="major", color="#E5E5E5", linewidth=0.6)
    ax.legend(loc="upper left", fontsize=8.5, framealpha=0.9)
    fig.tight_layout()
    path = Path(path)
    try:
        with atomic_writer(path, "wb", key="--plot") as fh:  # a full disk leaves no half-drawn picture
            fig.savefig(fh, format="png", dpi=120)
    finally:
        plt.close(fig)
    return path


def check_bands_path(path: str) -> str | None:
    """Why ``--bands FILE`` cannot be written (``None`` when it can): a folder, a missing folder, one this user
    cannot write to, or an existing file that is not an error-band table this command wrote (replacing one of those
    is what ``--bands`` is for; anything else is kept)."""
    return own_json_problem(path, "--bands", {"quantile", "classes"}, "an error-band table written by --bands")


def check_json_path(path: str) -> str | None:
    """Why ``--json FILE`` cannot be written, as :func:`check_bands_path` (an existing file is replaced only when it
    is a report this command wrote)."""
    return own_json_problem(path, "--json", REPORT_KEYS, "a report written by validate --json")


def same_output_problem(outputs: dict[str, str | None]) -> str | None:
    """Why the files ``outputs`` names (option -> path, ``None`` where not asked for) cannot all be written: two
    options naming one file (the second would replace the first's file); ``None`` when each has its own."""
    seen: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        same = Path(path).expanduser().resolve()
        if same in seen:
            return (f"{option} {path}: {seen[same]} names the same file, so one would replace the other. Fix: "
                    "give each option its own file.")
        seen[same] = option
    return None
