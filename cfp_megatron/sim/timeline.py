"""Export the simulated schedule: Chrome trace JSON (opens in Perfetto / chrome://tracing) and a PNG timeline.

One process per pipeline rank (stage), with two threads: compute (forward/backward passes, optimizer) and
communication (exposed TP/CP/EP/FSDP collectives, data-parallel sync).
"""

from __future__ import annotations

import json
from pathlib import Path

from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.sim.prediction import EventKind, Prediction

_COLOURS = {EventKind.forward: "#4C72B0", EventKind.backward: "#55A868", EventKind.comm: "#C44E52",
            EventKind.dp_sync: "#CCB974", EventKind.optimizer: "#64B5CD"}
_CNAMES = {EventKind.forward: "thread_state_running", EventKind.backward: "good", EventKind.comm: "bad",
           EventKind.dp_sync: "yellow", EventKind.optimizer: "olive"}


def _need_events(prediction: Prediction) -> None:
    """Raise :class:`ConfigError` unless ``prediction`` carries its schedule."""
    if not prediction.events:
        raise ConfigError(ConfigIssue(key="simulate.with_events", value=False,
                                      problem="the prediction carries no schedule.",
                                      fix="call simulate(..., with_events=True) before exporting a timeline."))


def chrome_trace(prediction: Prediction) -> dict:
    """The schedule as a Chrome trace-event dict (``traceEvents``, times in microseconds)."""
    _need_events(prediction)
    trace: list[dict] = []
    ranks = sorted({event.rank for event in prediction.events})
    for rank in ranks:
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"pipeline stage {rank}"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 0, "args": {"name": "compute"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": 1, "args": {"name": "communication"}})
    for event in prediction.events:
        if event.kind in (EventKind.forward, EventKind.backward):
            name = f"{'F' if event.kind is EventKind.forward else 'B'}{event.microbatch}.c{event.chunk}"
        else:
            name = event.kind.value
        trace.append({"ph": "X", "name": name, "cat": "comm" if event.is_comm else "compute", "pid": event.rank,
                      "tid": 1 if event.is_comm else 0, "ts": event.start_s * 1e6,
                      "dur": (event.end_s - event.start_s) * 1e6, "cname": _CNAMES[event.kind],
                      "args": {"kind": event.kind.value, "microbatch": event.microbatch, "chunk": event.chunk}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": prediction.step_time_s, "bubble_fraction": prediction.bubble_fraction}}


def write_chrome_trace(prediction: Prediction, path: str | Path) -> Path:
    """Write :func:`chrome_trace` to ``path`` (JSON); returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(prediction)))
    return path


def write_png(prediction: Prediction, path: str | Path, *, title: str = "") -> Path:
    """Draw the schedule as a Gantt chart (one row per stage: compute above, communication below; seconds on the x
    axis) to ``path`` (PNG); returns the path."""
    _need_events(prediction)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({event.rank for event in prediction.events})
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(ranks) + 1.5))
    for event in prediction.events:
        row = ranks.index(event.rank)
        offset = 0.22 if event.is_comm else -0.12
        height = 0.18 if event.is_comm else 0.5
        ax.broken_barh([(event.start_s, event.end_s - event.start_s)], (row + offset, height),
                       facecolors=_COLOURS[event.kind], edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"stage {rank}" for rank in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"simulated step {prediction.step_time_s:.3f} s, bubble {prediction.bubble_fraction:.1%}")
    present = {event.kind for event in prediction.events}
    handles = [Patch(color=colour, label=kind.value) for kind, colour in _COLOURS.items() if kind in present]
    ax.legend(handles=handles, loc="upper center", fontsize=7, ncol=6,
              bbox_to_anchor=(0.5, -0.12 - 0.3 / len(ranks)), frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
