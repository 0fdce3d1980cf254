"""How far a prediction may be off: the simulator's error on published runs of the same class, and the best
model FLOPs utilisation published runs of that class reached.

``error_bands.json`` beside this module holds, per class (``dense``, ``MoE``, ``CP``, ``FSDP``, ``GPU <generation>``),
the validator's absolute step-time errors summarised, and per GPU generation and model kind the best MFU a measured
run reached; ``python -m cfp_megatron.validate --bands cfp_megatron/sim/error_bands.json FILE.csv ...`` writes it
from the published runs (tests/test_uncertainty.py checks it matches the shared files). Reasoning:
docs/simulator.md, "uncertainty.py".
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.config import JobSpec
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.options import SimOptions

BANDS_FILE = Path(__file__).with_name("error_bands.json")
"""The stored bands."""
BAND_QUANTILE = 0.8
"""The share of a class's published runs whose absolute step-time error lies inside its band."""


@dataclass(frozen=True, kw_only=True)
class ErrorBand:
    """How far a prediction of one class may be off."""

    pct: float
    """Absolute step-time error (percent) that :data:`BAND_QUANTILE` of the class's published runs stay within."""
    rows: int
    """Published runs the band was taken from."""
    classes: tuple[str, ...]
    """The prediction's classes; the band is the widest of theirs."""
    untested: tuple[str, ...] = ()
    """Of ``classes``, those no published run covers (the band then comes from the others, or from all runs)."""


@dataclass(frozen=True, kw_only=True)
class PublishedMfu:
    """The best model FLOPs utilisation a published run of one GPU generation and model kind reached."""

    mfu: float
    """Model FLOPs utilisation (0..1) against the GPU's dense bf16 peak, model FLOPs as the planner counts them."""
    row: str
    """The run (its ``id`` and model)."""


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (linear interpolation between order statistics)."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = q * (len(ordered) - 1)
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def plan_classes(job: JobSpec, options: SimOptions | None = None) -> tuple[str, ...]:
    """The classes a plan's prediction belongs to, named as the validator names them."""
    options = options or SimOptions()
    classes = ["MoE" if job.model.is_moe else "dense"]
    if job.parallel.cp > 1:
        classes.append("CP")
    if options.fsdp:
        classes.append("FSDP")
    classes.append(f"GPU {generation(job.cluster)}")
    return tuple(classes)


@functools.lru_cache(maxsize=4)
def _stored(path: Path = BANDS_FILE) -> dict:
    if not path.exists():
        return {"classes": {}, "all": None, "best_mfu": {}}
    with open(path) as fh:
        return json.load(fh)


def error_band(job: JobSpec, options: SimOptions | None = None) -> ErrorBand | None:
    """The widest band among the plan's classes (:func:`plan_classes`), over all published runs where none covers
    one of them; ``None`` without stored bands, and on a CPU cluster (profiled, not published: the plan check after
    the first steps measures how far it is off)."""
    if job.cluster.on_cpu:
        return None
    stored = _stored()
    classes = plan_classes(job, options)
    known = [stored["classes"][name] for name in classes if name in stored["classes"]]
    untested = tuple(name for name in classes if name not in stored["classes"])
    if untested and stored.get("all"):
        known.append(stored["all"])
    if not known:
        return None
    widest = max(known, key=lambda band: band["pct"])
    return ErrorBand(pct=widest["pct"], rows=widest["rows"], classes=classes, untested=untested)


def best_published_mfu(job: JobSpec) -> PublishedMfu | None:
    """The best MFU a published run on the plan's GPU generation with its kind of model (dense or MoE) reached;
    ``None`` where no published run covers them."""
    key = f"{generation(job.cluster)} {'MoE' if job.model.is_moe else 'dense'}"
    found = _stored()["best_mfu"].get(key)
    return PublishedMfu(mfu=found["mfu"], row=found["row"]) if found else None
