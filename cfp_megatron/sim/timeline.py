"""Export the simulated schedule: Chrome trace JSON (opens in Perfetto's UI, ui.perfetto.dev, or chrome://tracing)
and a PNG timeline.

One process per pipeline rank (stage), with a thread (lane) each for compute (forward and backward passes, the
optimizer step), each kind of exposed communication the plan has (TP, CP, EP, FSDP inside the passes; the DP gradient
sync, the tied embedding's all-reduce and the token count's syncs after them) and idle time (pipeline bubble and p2p
waits inside the schedule, then the wait for the slowest stage). Large schedules are capped: the trace keeps whole
ranks up to :data:`MAX_TRACE_EVENTS` events, the PNG draws at most :data:`MAX_PNG_RANKS` ranks and merges slices
narrower than a pixel; both say what they left out (docs/simulator.md, "Timeline pictures").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import atomic_writer, write_atomic
from cfp_megatron.sim.prediction import EventKind, Prediction
from cfp_megatron.sim.terms import TERMS, Placement


def trace_lanes() -> tuple[str, ...]:
    """Lanes of a pipeline rank, top to bottom (thread ids in the trace are their indices), from the cost terms'
    lanes (:data:`~cfp_megatron.sim.terms.TERMS`): compute, each in-pass communication lane, ``comm`` (exposed
    communication whose split by collective is not known), each after-schedule lane, idle."""
    lanes = TERMS.lanes()
    in_pass = [lane.trace for lane in lanes if lane.placement is Placement.in_pass and lane.trace]
    after = [lane.trace for lane in lanes if lane.placement is Placement.after and lane.trace]
    return tuple(dict.fromkeys(["compute", *in_pass, "comm", *after, "idle"]))


LANES: tuple[str, ...] = trace_lanes()
""":func:`trace_lanes` of the registered terms."""

MAX_TRACE_EVENTS = 300_000
"""Most slices a trace keeps (about 60 MB of JSON); beyond it, whole pipeline ranks are left out."""

MAX_PNG_RANKS = 8
"""Most pipeline ranks the PNG draws (the first, the last, the slowest and evenly spaced others)."""

MAX_PNG_PASSES = 240
"""Most passes on a rank the PNG draws one by one; beyond, each lane is drawn as :data:`_COLUMNS` columns coloured by
what takes most of each column's time, shaded by how much of it is taken (a pass would be narrower than a few
pixels)."""

_COLUMNS = 1500
"""Columns across the step in the PNG (about its width in pixels); slices of a lane closer than one column are
merged."""

# What the slices no cost term owns are drawn as: label in the legend, colour in the PNG, reserved colour in
# chrome://tracing (the terms' lanes bring their own, Lane.style).
_PASS_STYLE = {"forward": ("forward", "#4C72B0", "thread_state_running"),
               "backward": ("backward", "#55A868", "good")}
_OTHER_STYLE = {"comm": ("communication", "#C44E52", "bad"),
                "bubble": ("pipeline bubble / p2p wait", "#B0B0B0", "grey"),
                "wait": ("waits for the slowest stage", "#F6D9A8", "white")}


def _styles(prediction: Prediction | None = None) -> dict[str, tuple[str, str, str]]:
    """Every style by key: the passes', the cost terms' lanes' (in the registry's order), the rest; the backward
    passes labelled with their recomputation where ``prediction`` recomputes."""
    passes = dict(_PASS_STYLE)
    if prediction is not None and prediction.time.recompute_s > 0:
        passes["backward"] = ("backward (with recompute)", *passes["backward"][1:])
    return {**passes, **{lane.key: lane.style for lane in TERMS.lanes() if lane.style and lane.key},
            **_OTHER_STYLE}


def _count(number: int, noun: str) -> str:
    """``1 micro-batch``, ``4 micro-batches``."""
    return f"{number} {noun}" + ("" if number == 1 else "es" if noun.endswith("h") else "s")


@dataclass(frozen=True, kw_only=True)
class Slice:
    """One interval on one lane of one pipeline rank, as drawn."""

    rank: int
    """Pipeline rank."""
    lane: str
    """One of :func:`trace_lanes`."""
    style: str
    """What it is (a key of the styles: ``forward``, ``tp``, ``bubble``, ...)."""
    name: str
    """Its label in the trace (``F3.c0``: forward of micro-batch 3, chunk 0)."""
    start_s: float
    """Start, seconds from the step's start."""
    end_s: float
    """End, seconds from the step's start."""
    microbatch: int = -1
    """Micro-batch (``-1`` for per-step slices)."""
    chunk: int = 0
    """Model chunk on the rank."""


def _need_events(prediction: Prediction) -> None:
    """Raise :class:`ConfigError` unless ``prediction`` carries its schedule."""
    if not prediction.events:
        raise ConfigError(ConfigIssue(key="simulate.with_events", value=False,
                                      problem="the prediction carries no schedule.",
                                      fix="call simulate(..., with_events=True) before exporting a timeline."))


def slices(prediction: Prediction) -> list[Slice]:
    """Every slice of the schedule on its lane, the idle gaps of each rank included (up to the step time)."""
    _need_events(prediction)
    out: list[Slice] = []
    for event in prediction.events:
        kind = event.kind
        if kind in (EventKind.forward, EventKind.backward):
            name = f"{'F' if kind is EventKind.forward else 'B'}{event.microbatch}.c{event.chunk}"
            out.append(Slice(rank=event.rank, lane="compute", style=kind.value, name=name, start_s=event.start_s,
                             end_s=event.end_s, microbatch=event.microbatch, chunk=event.chunk))
        elif kind is EventKind.comm:  # exposed communication inside a pass, split by collective where known
            parts = event.collectives or (("comm", event.end_s - event.start_s),)
            start_s = event.start_s
            for collective, seconds in parts:
                owner = TERMS.lane(collective)
                lane = owner.trace if owner is not None and owner.trace else "comm"
                out.append(Slice(rank=event.rank, lane=lane, style=collective if lane != "comm" else "comm",
                                 name=f"{collective.upper() if lane != 'comm' else 'comm'} mb{event.microbatch}",
                                 start_s=start_s, end_s=start_s + seconds, microbatch=event.microbatch,
                                 chunk=event.chunk))
                start_s += seconds
        else:  # an after-schedule lane of a cost term (DP sync, optimizer step, ...)
            owner = TERMS.lane(event.lane or kind.value)
            if owner is None:
                continue
            out.append(Slice(rank=event.rank, lane=owner.trace or "compute", style=owner.key, name=owner.part,
                             start_s=event.start_s, end_s=event.end_s))
    return out + _idle(out, prediction.step_time_s)


def _idle(busy: list[Slice], step_s: float) -> list[Slice]:
    """Each rank's gaps between its slices (``bubble``) and after its last one up to ``step_s`` (``wait``)."""
    by_rank: dict[int, list[tuple[float, float]]] = {}
    for piece in busy:
        by_rank.setdefault(piece.rank, []).append((piece.start_s, piece.end_s))
    tolerance = step_s * 1e-9
    out = []
    for rank, spans in sorted(by_rank.items()):
        clock = 0.0
        for start_s, end_s in sorted(spans):
            if start_s > clock + tolerance:
                out.append(Slice(rank=rank, lane="idle", style="bubble", name="bubble", start_s=clock, end_s=start_s))
            clock = max(clock, end_s)
        if step_s > clock + tolerance:
            out.append(Slice(rank=rank, lane="idle", style="wait", name="wait", start_s=clock, end_s=step_s))
    return out


def _critical_rank(pieces: Sequence[Slice]) -> int:
    """The rank whose last busy slice ends last (the one that sets the step time)."""
    return max((p for p in pieces if p.lane != "idle"), key=lambda p: (p.end_s, -p.rank)).rank


def shown_ranks(ranks: Sequence[int], critical: int, limit: int) -> list[int]:
    """At most ``limit`` of ``ranks`` (sorted): the first, the last, ``critical`` and evenly spaced others."""
    ranks = sorted(ranks)
    if len(ranks) <= limit:
        return ranks
    keep = {ranks[0], ranks[-1], critical}
    step = (len(ranks) - 1) / max(limit - 1, 1)
    for index in range(limit):
        if len(keep) >= limit:
            break
        keep.add(ranks[round(index * step)])
    return sorted(keep)[:max(limit, 3)]


def _lanes(pieces: Sequence[Slice]) -> list[str]:
    """The lanes drawn: compute and idle always, the communication lanes that hold a slice."""
    used = {p.lane for p in pieces}
    return [lane for lane in trace_lanes() if lane in used or lane in ("compute", "idle")]


def chrome_trace(prediction: Prediction, *, title: str = "", max_events: int = MAX_TRACE_EVENTS) -> dict:
    """The schedule as a Chrome trace-event dict (``traceEvents``, times in microseconds): a process per pipeline rank,
    a thread per lane (:func:`trace_lanes`). Over ``max_events`` slices, whole ranks are left out (the first, the
    last and the slowest kept) and ``otherData.note`` says which."""
    pieces = slices(prediction)
    ranks = sorted({p.rank for p in pieces})
    critical = _critical_rank(pieces)
    all_lanes, styles = trace_lanes(), _styles()
    keep = ranks
    if len(pieces) > max_events:
        per_rank = len(pieces) / len(ranks)
        keep = shown_ranks(ranks, critical, max(int(max_events // per_rank), 1))
    kept = set(keep)
    pieces = [p for p in pieces if p.rank in kept]
    note = "" if keep == ranks else (f"{len(keep)} of {len(ranks)} pipeline ranks kept ({_ranks_text(keep)}): the "
                                     f"whole schedule has more than {max_events:,} slices")
    lanes = _lanes(pieces)
    trace: list[dict] = []
    for rank in keep:
        label = f"pipeline stage {rank}" + (" (slowest)" if rank == critical and len(ranks) > 1 else "")
        trace.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": label}})
        trace.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for lane in lanes:
            tid = all_lanes.index(lane)
            trace.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": lane}})
            trace.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                          "args": {"sort_index": tid}})
    for p in pieces:
        category = "idle" if p.lane == "idle" else "compute" if p.lane == "compute" else "comm"
        trace.append({"ph": "X", "name": p.name, "cat": category, "pid": p.rank, "tid": all_lanes.index(p.lane),
                      "ts": p.start_s * 1e6, "dur": (p.end_s - p.start_s) * 1e6, "cname": styles[p.style][2],
                      "args": {"kind": p.style, "microbatch": p.microbatch, "chunk": p.chunk}})
    return {"traceEvents": trace, "displayTimeUnit": "ms",
            "otherData": {"title": title, "step_time_s": prediction.step_time_s,
                          "bubble_fraction": prediction.bubble_fraction,
                          "num_microbatches": prediction.num_microbatches, "pipeline_ranks": len(ranks),
                          "slowest_rank": critical, "note": note}}


def _ranks_text(ranks: Sequence[int]) -> str:
    return ", ".join(str(rank) for rank in ranks)


def write_chrome_trace(prediction: Prediction, path: str | Path, *, title: str = "",
                       max_events: int = MAX_TRACE_EVENTS, key: str | None = None) -> Path:
    """Write :func:`chrome_trace` to ``path`` (JSON, atomically: a refused write is a
    :class:`~cfp_megatron.base.files.FileWriteError` naming ``key``); returns the path."""
    return write_atomic(path, json.dumps(chrome_trace(prediction, title=title, max_events=max_events)), key=key)


def _merged(spans: list[tuple[float, float]], gap: float) -> list[tuple[float, float]]:
    """``spans`` (sorted) with those less than ``gap`` apart joined: what a pixel can show."""
    out: list[list[float]] = []
    for start, end in spans:
        if out and start - out[-1][1] < gap:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(start, end - start) for start, end in out]


def _draw_columns(ax: object, pieces: Sequence[Slice], rows: dict[tuple[int, str], float], step_s: float,
                  scale: float) -> None:
    """Draw each lane as :data:`_COLUMNS` columns: the colour of the style that takes most of a column's time, its
    opacity from the share of the column the lane is busy (at least a quarter where anything runs)."""
    import numpy as np
    from matplotlib.colors import to_rgb

    style_table = _styles()
    styles = list(style_table)
    width = step_s / _COLUMNS
    busy = np.zeros((len(rows), len(styles), _COLUMNS))
    index = {key: position for position, key in enumerate(rows)}
    for p in pieces:
        row, style = index[(p.rank, p.lane)], styles.index(p.style)
        first, last = int(p.start_s / width), min(int(p.end_s / width), _COLUMNS - 1)
        for column in range(first, last + 1):
            overlap = min(p.end_s, (column + 1) * width) - max(p.start_s, column * width)
            if overlap > 0:
                busy[row, style, column] += overlap
    colours = np.array([to_rgb(style_table[style][1]) for style in styles])
    share = np.clip(busy.sum(axis=1) / width, 0.0, 1.0)
    image = np.zeros((len(rows), _COLUMNS, 4))
    image[..., :3] = colours[busy.argmax(axis=1)]
    image[..., 3] = np.where(share > 0, 0.25 + 0.75 * share, 0.0)
    for key, position in index.items():
        row = rows[key]
        ax.imshow(image[position:position + 1], extent=(0, step_s * scale, row + 0.4, row - 0.4), aspect="auto",
                  interpolation="nearest")


def write_png(prediction: Prediction, path: str | Path, *, title: str = "", max_ranks: int = MAX_PNG_RANKS,
              metadata: dict[str, str] | None = None, key: str | None = None) -> Path:
    """Draw the schedule as a timeline to ``path`` (PNG, with the text chunks ``metadata``, written atomically: a
    refused write is a :class:`~cfp_megatron.base.files.FileWriteError` naming ``key``; returns the path): per
    pipeline rank a row each for compute, the communication the plan exposes and idle time, time since the step's
    start on the x axis. At most ``max_ranks`` ranks are drawn (the picture says which)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    pieces = slices(prediction)
    ranks = sorted({p.rank for p in pieces})
    critical = _critical_rank(pieces)
    keep = shown_ranks(ranks, critical, max_ranks)
    kept = set(keep)
    pieces = [p for p in pieces if p.rank in kept]
    lanes = _lanes(pieces)
    styles = _styles(prediction)
    step_s = prediction.step_time_s
    unit, scale = ("ms", 1e3) if step_s < 2 else ("s", 1.0)
    rows = {(rank, lane): index * (len(lanes) + 0.6) + position
            for index, rank in enumerate(keep) for position, lane in enumerate(lanes)}
    total_rows = len(keep) * (len(lanes) + 0.6)
    passes = sum(1 for p in pieces if p.rank == critical and p.style in ("forward", "backward"))
    dense = passes > MAX_PNG_PASSES
    height = 1.6 + 0.21 * total_rows + 0.15 * (keep != ranks) + 0.15 * dense
    fig, ax = plt.subplots(figsize=(15, height))
    if dense:
        _draw_columns(ax, pieces, rows, step_s, scale)
    else:
        spans: dict[tuple[int, str, str], list[tuple[float, float]]] = {}
        for p in pieces:
            spans.setdefault((p.rank, p.lane, p.style), []).append((p.start_s * scale, p.end_s * scale))
        for (rank, lane, style), intervals in spans.items():
            ax.broken_barh(_merged(sorted(intervals), step_s * scale / _COLUMNS), (rows[(rank, lane)] - 0.4, 0.8),
                           facecolors=styles[style][1], edgecolor="white" if lane == "compute" else "none",
                           linewidth=0.4)
    ticks = sorted(rows.items(), key=lambda item: item[1])
    ax.set_yticks([row for _, row in ticks],
                  [f"stage {rank}" + ("*" if rank == critical and len(ranks) > 1 else "") + f"  {lane}"
                   if lane == "compute" else lane for (rank, lane), row in ticks], fontsize=8)
    for index in range(1, len(keep)):
        ax.axhline(index * (len(lanes) + 0.6) - 0.8, color="#888888", linewidth=0.6)
    ax.set_ylim(total_rows - 0.4, -0.8)
    ax.set_xlim(0, step_s * scale * 1.005)
    ax.set_xlabel(f"time since the step's start ({unit})")
    ax.grid(axis="x", color="#DDDDDD", linewidth=0.5)
    ax.set_axisbelow(True)
    header = title or "simulated training step"
    facts = (f"step {step_s * scale:.4g} {unit}, {_count(prediction.num_microbatches, 'micro-batch')}, bubble "
             f"{prediction.bubble_fraction:.1%} of the schedule on the slowest stage"
             + (" (marked *)" if len(ranks) > 1 else ""))
    if dense:
        facts += (f"\n{passes} passes per stage: each column shows what takes most of its time on the lane, "
                  "fainter where the lane is partly idle")
    if keep != ranks:
        facts += f"\nshowing {len(keep)} of {len(ranks)} pipeline stages ({_ranks_text(keep)}); the trace has all"
    ax.set_title(f"{header}\n{facts}", fontsize=10, loc="left")
    present = {p.style for p in pieces}
    handles = [Patch(color=colour, label=label) for style, (label, colour, _) in styles.items() if style in present]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False,
               bbox_to_anchor=(0.5, 0.0))
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))
    path = Path(path)
    try:
        with atomic_writer(path, "wb", key=key) as fh:
            fig.savefig(fh, format="png", dpi=110, metadata=metadata)
    finally:
        plt.close(fig)
    return path
