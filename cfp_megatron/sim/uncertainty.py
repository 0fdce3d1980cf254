"""How far a prediction may be off: the simulator's error, out of sample, on published runs of the same class, and
the model FLOPs utilisation comparable published runs reached.

``error_bands.json`` beside this module holds, per class (``dense``, ``MoE``, ``CP``, ``FSDP``, ``GPU <generation>``),
the absolute step-time errors of leave-one-source-out cross-validation summarised (each row predicted with
efficiencies fitted without its source's rows), and each published run's MFU with its GPU generation, kind and size;
``python -m cfp_megatron.validate FILE.csv ... --bands cfp_megatron/sim/error_bands.json`` writes it from the
published runs (:mod:`cfp_megatron.validation.bands`; tests/test_uncertainty.py checks it matches the shared files).
Reasoning: docs/validation.md, "Error bands, out of sample".
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.config import FsdpStrategy, JobSpec
from cfp_megatron.base.flops import active_matmul_params_per_token
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import generation
from cfp_megatron.sim.options import SimOptions

BANDS_FILE = Path(__file__).with_name("error_bands.json")
"""The stored bands."""
BAND_QUANTILE = 0.8
"""The share of a class's published runs whose absolute held-out step-time error lies inside its band: a band most
runs keep to, resting on several rows (the 80th percentile of 13 rows lies between the 10th and 11th largest; a 95%
band of a class of 13 rows would be its largest error, one row's)."""
MIN_BAND_ROWS = 8
"""A class with fewer held-out rows takes the band over all rows, and a plan does not take the band of a combination
of classes with fewer (with so few, the quantile is one or two rows' error)."""
SIZE_RATIO = 2.0
"""A published run is comparable for the MFU check when its model's active matmul parameters are within this factor
of the plan's (and its GPU generation, MoE or dense, and FP8 or not are the plan's)."""


@dataclass(frozen=True, kw_only=True)
class ErrorBand:
    """How far a prediction of one class may be off."""

    pct: float
    """Absolute step-time error (percent) that :data:`BAND_QUANTILE` of the class's published runs stay within."""
    rows: int
    """Published runs the band was taken from."""
    classes: tuple[str, ...]
    """The prediction's classes (:func:`plan_classes`)."""
    untested: tuple[str, ...] = ()
    """Of ``classes``, those no published run covers (the band then comes from the others, or from all runs)."""
    basis: str = ""
    """The published runs the band comes from: a :func:`combination` of classes with at least :data:`MIN_BAND_ROWS`
    runs; empty: the widest band of ``classes`` taken one by one."""
    borrowed: tuple[str, ...] = ()
    """Of ``classes``, those with fewer than :data:`MIN_BAND_ROWS` published runs, whose band is all runs'."""


@dataclass(frozen=True, kw_only=True)
class PublishedMfu:
    """The model FLOPs utilisation one published run reached."""

    mfu: float
    """Model FLOPs utilisation (0..1) against the GPU's dense bf16 peak, model FLOPs as the planner counts them."""
    row: str
    """The run (its ``id`` and model)."""
    active_params_b: float
    """Its model's active matmul parameters per token, billions (the size the planner compares)."""
    gpus: int
    """GPUs it ran on."""


@dataclass(frozen=True, kw_only=True)
class MfuCheck:
    """A plan's model size and the published runs it is compared with."""

    active_params_b: float
    """The plan's model's active matmul parameters per token, billions."""
    generation: str
    """Its GPU generation."""
    moe: bool
    """Whether its model is a mixture of experts (compared with MoE runs only, a dense one with dense runs)."""
    fp8: bool
    """Whether its GEMMs run in FP8 (compared with FP8 runs only: their MFU against the bf16 peak runs higher)."""
    runs: tuple[PublishedMfu, ...]
    """Published runs of the same generation, kind and precision with a model within :data:`SIZE_RATIO` of its
    size, highest MFU first; empty: none is comparable."""

    def above_all(self, predicted: float | None) -> bool:
        """Whether ``predicted`` (0..1) is above every comparable run (``False`` where none is comparable)."""
        return predicted is not None and bool(self.runs) and predicted > self.runs[0].mfu

    def note(self, predicted: float | None) -> str | None:
        """What the planner says of a predicted MFU (0..1) against the comparable runs; ``None`` without one."""
        if predicted is None:
            return None
        kind = ("MoE" if self.moe else "dense") + (" FP8" if self.fp8 else "")
        low, high = self.active_params_b / SIZE_RATIO, self.active_params_b * SIZE_RATIO
        which = (f"{self.generation} GPUs, {kind} models of {_size(low)}-{_size(high)} active parameters (within "
                 f"{SIZE_RATIO:g}x of this model's {_size(self.active_params_b)})")
        if not self.runs:
            return (f"predicted MFU {predicted:.1%}: no published run is comparable ({which}), nothing to check it "
                    "against (python -m cfp_megatron.validate --bands)")
        best, worst = self.runs[0], self.runs[-1]
        reached = (f"{len(self.runs)} published runs on {which} reached {worst.mfu:.1%}-{best.mfu:.1%} "
                   f"(best: run {best.row}, {best.gpus} GPUs)")
        if self.above_all(predicted):
            return (f"predicted MFU {predicted:.1%} (! in the table) is above every comparable published run: "
                    f"{reached}; the prediction is likely optimistic")
        return f"predicted MFU {predicted:.1%} is no higher than the best comparable published run: {reached}"


def _size(billions: float) -> str:
    """A parameter count for a person: ``175B``, ``221M``."""
    return f"{billions:.3g}B" if billions >= 1 else f"{billions * 1e3:.3g}M"


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
    if job.parallel.fsdp is not FsdpStrategy.none:
        classes.append("FSDP")
    classes.append(f"GPU {generation(job.cluster)}")
    return tuple(classes)


def combination(classes: tuple[str, ...] | list[str]) -> str:
    """The name of the runs that have all of ``classes`` (``dense, FSDP, GPU ampere``), as the error-band file keys
    them."""
    return ", ".join(classes)


@functools.lru_cache(maxsize=4)
def _stored(path: Path = BANDS_FILE) -> dict:
    if not path.exists():
        return {"classes": {}, "all": None, "published_mfu": []}
    with open(path) as fh:
        return json.load(fh)


def error_band(job: JobSpec, options: SimOptions | None = None) -> ErrorBand | None:
    """The out-of-sample band of the published runs most like the plan: those with all its classes
    (:func:`plan_classes`), else those of its kind on its GPU generation (never narrower than the band of a class
    those leave out), where :data:`MIN_BAND_ROWS` runs or more are; else the widest band among its classes, over all
    published runs where none covers one of them. ``None`` without stored bands, and on a CPU cluster (profiled, not
    published: the plan check after the first steps measures how far it is off)."""
    if job.cluster.on_cpu:
        return None
    stored = _stored()
    classes = plan_classes(job, options)
    combinations = stored.get("combinations", {})
    known = [stored["classes"][name] for name in classes if name in stored["classes"]]
    untested = tuple(name for name in classes if name not in stored["classes"])
    if untested and stored.get("all"):
        known.append(stored["all"])
    borrowed = tuple(name for name in classes if stored["classes"].get(name, {}).get("borrowed_from"))
    found = combinations.get(combination(classes))
    if found and found["rows"] >= MIN_BAND_ROWS:
        return ErrorBand(pct=found["pct"], rows=found["rows"], classes=classes, basis=combination(classes))
    key = combination((classes[0], classes[-1]))
    found = combinations.get(key)
    if found and found["rows"] >= MIN_BAND_ROWS:
        # The classes the kind-on-generation runs leave out (CP, FSDP) are less tested than those runs: the band is
        # never narrower than theirs, so a plan with an extra class never looks better evidenced than one without.
        dropped = [stored["classes"][name] for name in classes[1:-1] if name in stored["classes"]]
        if any(name not in stored["classes"] for name in classes[1:-1]) and stored.get("all"):
            dropped.append(stored["all"])
        wider = max(dropped, key=lambda band: band["pct"], default=None)
        if wider is None or wider["pct"] <= found["pct"]:
            return ErrorBand(pct=found["pct"], rows=found["rows"], classes=classes, basis=key, borrowed=borrowed)
        return ErrorBand(pct=wider["pct"], rows=wider["rows"], classes=classes, untested=untested, borrowed=borrowed)
    if not known:
        return None
    widest = max(known, key=lambda band: band["pct"])
    return ErrorBand(pct=widest["pct"], rows=widest["rows"], classes=classes, untested=untested, borrowed=borrowed)


def mfu_check(job: JobSpec, options: SimOptions | None = None) -> MfuCheck | None:
    """The published runs a plan's MFU is compared with: same GPU generation, MoE or dense, FP8 or not, and a model
    whose active matmul parameters are within :data:`SIZE_RATIO` of the plan's; ``None`` on a CPU cluster (profiled,
    not published)."""
    if job.cluster.on_cpu:
        return None
    fp8 = NumberFormat.of(job.train).low
    size = active_matmul_params_per_token(job.model) / 1e9
    gen = generation(job.cluster)
    runs = [PublishedMfu(mfu=run["mfu"], row=run["row"], active_params_b=run["active_params_b"], gpus=run["gpus"])
            for run in _stored().get("published_mfu", ())
            if run["generation"] == gen and run["moe"] == job.model.is_moe and run["fp8"] == fp8
            and size / SIZE_RATIO <= run["active_params_b"] <= size * SIZE_RATIO]
    return MfuCheck(active_params_b=size, generation=gen, moe=job.model.is_moe, fp8=fp8,
                    runs=tuple(sorted(runs, key=lambda r: (-r.mfu, r.row))))
