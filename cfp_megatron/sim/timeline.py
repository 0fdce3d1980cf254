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
    if not prediction.events:
        raise ConfigError(ConfigIssue(key="simulate.with_events", value=False,
                                      problem="the prediction carries no schedule.",
                                      fix="call simulate(..., with_events=True) before exporting a timeline."))


def chrome_trace(prediction: Prediction) -> dict:
    """The schedule as a Chrome trace-event dict (``traceEvents``, times in microseconds)."""
    _need_events(prediction)
    trace: list[dict] = []
    ranks = sorted({e.rank for e in prediction.events})
    for r in ranks:
        trace.append({"ph": "M", "name": "process_name", "pid": r, "args": {"name": f"pipeline stage {r}"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 0, "args": {"name": "compute"}})
        trace.append({"ph": "M", "name": "thread_name", "pid": r, "tid": 1, "args": {"name": "communication"}})
    for e in prediction.events:
        if e.kind in (EventKind.forward, EventKind.backward):
            name = f"{'F' if e.kind is EventKind.forward else 'B'}{e.microbatch}.c{e.chunk}"
        else:
            name = e.kind.value
        trace.append({"ph": "X", "name": name, "cat": "comm" if e.is_comm else "compute", "pid": e.rank,
                      "tid": 1 if e.is_comm else 0, "ts": e.start_s * 1e6, "dur": (e.end_s - e.start_s) * 1e6,
                      "cname": _CNAMES[e.kind],
                      "args": {"kind": e.kind.value, "microbatch": e.microbatch, "chunk": e.chunk}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"step_time_s": prediction.step_time_s, "bubble_fraction": prediction.bubble_fraction}}


def write_chrome_trace(prediction: Prediction, path: str | Path) -> Path:
    """Write :func:`chrome_trace` to ``path`` (JSON)."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(prediction)))
    return path


def write_png(prediction: Prediction, path: str | Path, *, title: str = "") -> Path:
    """Draw the schedule as a Gantt chart (one row per stage: compute above, communication below) to ``path``."""
    _need_events(prediction)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e.rank for e in prediction.events})
    fig, ax = plt.subplots(figsize=(14, 0.6 * len(ranks) + 1.5))
    for e in prediction.events:
        y = ranks.index(e.rank)
        offset = 0.22 if e.is_comm else -0.12
        height = 0.18 if e.is_comm else 0.5
        ax.broken_barh([(e.start_s, e.end_s - e.start_s)], (y + offset, height), facecolors=_COLOURS[e.kind],
                       edgecolor="white", linewidth=0.3)
    ax.set_yticks(range(len(ranks)), [f"stage {r}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"simulated step {prediction.step_time_s:.3f} s, bubble {prediction.bubble_fraction:.1%}")
    present = {e.kind for e in prediction.events}
    handles = [Patch(color=c, label=k.value) for k, c in _COLOURS.items() if k in present]
    ax.legend(handles=handles, loc="upper center", fontsize=7, ncol=6,
              bbox_to_anchor=(0.5, -0.12 - 0.3 / len(ranks)), frameon=False)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
