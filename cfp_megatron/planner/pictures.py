"""The pictures ``python -m cfp_megatron.plan`` writes beside plan.json: the best plan's simulated step as a Chrome
trace (``plan_trace.json``, for Perfetto's UI or chrome://tracing) and a PNG timeline (``plan_timeline.png``); what
they show and how large schedules are capped: docs/preflight.md, "Pictures"."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import write_atomic
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.sim.prediction import Prediction
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.timeline import MAX_PNG_RANKS, chrome_trace, write_png

TRACE_FILE = "plan_trace.json"
"""The Chrome trace's name beside plan.json."""

PNG_FILE = "plan_timeline.png"
"""The PNG timeline's name beside plan.json."""

MAX_TIMELINE_PASSES = 200_000
"""Most forward and backward passes (2 x pp x vpp x micro-batches) a plan's step is timed pass by pass for its
pictures; a longer schedule is not drawn (its step time is extrapolated: docs/simulator.md, "Long schedules")."""


def write_plan_pictures(plan: Plan, job: JobSpec, world: int, measurements: Measurements | None,
                        folder: Path, *, key: str | None = None) -> list[str]:
    """Simulate ``plan`` on ``job``'s cluster (``measurements`` where the search had them) with its events, and write
    :data:`TRACE_FILE` and :data:`PNG_FILE` into ``folder`` (an existing file is kept, never overwritten); return the
    lines to print: the paths, what was left out, or why nothing was drawn. Never raises for a picture: the plan is
    already saved (a disk that refuses a picture is said in one line naming ``key``, the setting or option that
    chose ``folder``, and leaves no half-written file)."""
    if plan.zero is not None:
        return ["timeline: not drawn for a DeepSpeed ZeRO plan (its cost model has no pipeline schedule to show)"]
    planned = plan.apply(job)
    pp, vpp = planned.parallel.pp, planned.parallel.virtual_stages
    passes = 2 * pp * vpp * plan.num_microbatches
    if passes > MAX_TIMELINE_PASSES:
        return [f"timeline: not drawn: the step has {passes:,} forward and backward passes (pp={pp} x vpp={vpp} x "
                f"{plan.num_microbatches} micro-batches x 2), more than the {MAX_TIMELINE_PASSES:,} timed one by one "
                "for pictures"]
    trace_path, png_path = folder / TRACE_FILE, folder / PNG_FILE
    lines = []
    try:
        prediction = simulate(planned, job.cluster, measurements, world_size=world, with_events=True)
        title = f"{plan.model} on {world} x {job.cluster.device_name}: {plan.describe()}"
        if plan.predicted is not None and abs(prediction.step_time_s / plan.predicted.step_time_s - 1) > 1e-6:
            lines.append(f"timeline: simulated again {prediction.step_time_s * 1e3:.4g} ms per step, the plan says "
                         f"{plan.predicted.step_time_s * 1e3:.4g} ms")
        mark = plan.plan_hash()
        for path, draw in ((trace_path, _trace_writer(prediction, title, mark, key)),
                           (png_path, _png_writer(prediction, title, mark, key))):
            owner = _owner(path)
            if owner == mark:
                lines.append(f"{path.name}: {path} (already drawn for this plan)")
            elif owner == "":
                lines.append(f"{path.name}: {path} (kept: cfp-megatron did not draw it; remove it to draw the plan's)")
            else:  # absent, or drawn for an earlier plan: replaced, as its exports are
                lines.append(f"{path.name}: {draw(path)}")
    except (CfpError, OSError, ValueError) as err:  # a picture that cannot be drawn never fails the plan
        lines.append(f"timeline: not drawn ({type(err).__name__}: {err})")
        return lines
    lines.append(f"open {TRACE_FILE} in Perfetto's UI (https://ui.perfetto.dev, 'Open trace file') or "
                 "chrome://tracing")
    return lines


_GENERATOR = "cfp-megatron"
"""What the pictures say drew them (the trace's ``otherData.generator``, the PNG's ``Software`` text), so a later
plan replaces its own pictures and never a file of the user's."""

_PNG_MARK = re.compile(rb"cfp-megatron plan ([0-9a-f]+)")
"""The PNG's ``Description`` text: the plan's hash."""


def _owner(path: Path) -> str | None:
    """The hash of the plan cfp-megatron drew ``path`` for; ``""`` for a file it did not draw (or cannot read);
    ``None`` where there is none."""
    if not path.exists():
        return None
    try:
        data = path.read_bytes()
    except OSError:
        return ""
    if path.suffix == ".png":
        found = _PNG_MARK.search(data[:4096])
        return found.group(1).decode() if found else ""
    try:
        other = json.loads(data).get("otherData", {})
    except (ValueError, AttributeError):
        return ""
    return str(other.get("plan_hash", "")) if isinstance(other, dict) and other.get("generator") == _GENERATOR else ""


def _trace_writer(prediction: Prediction, title: str, mark: str, key: str | None) -> Callable[[Path], str]:
    def write(path: Path) -> str:
        trace = chrome_trace(prediction, title=title)
        trace["otherData"].update(generator=_GENERATOR, plan_hash=mark)
        write_atomic(path, json.dumps(trace), key=key)
        note = trace["otherData"]["note"]
        return f"{path}" + (f" ({note})" if note else "")
    return write


def _png_writer(prediction: Prediction, title: str, mark: str, key: str | None) -> Callable[[Path], str]:
    def write(path: Path) -> str:
        write_png(prediction, path, title=title, key=key,
                  metadata={"Software": _GENERATOR, "Description": f"cfp-megatron plan {mark}"})
        ranks = len({event.rank for event in prediction.events})
        return f"{path}" + (f" (draws {MAX_PNG_RANKS} of {ranks} pipeline stages)" if ranks > MAX_PNG_RANKS else "")
    return write
