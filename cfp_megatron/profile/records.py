"""What one profiling run measured, as plain frozen records (JSON round trip, no torch)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from cfp_megatron.cluster.measured import Collective, CollectiveFit, Span
from cfp_megatron.profile.errors import ProfileFigureError

_RANGES: dict[str, tuple[str, Callable[[float], bool]]] = {
    "positive": ("a finite number above zero", lambda v: math.isfinite(v) and v > 0),
    "non_negative": ("a finite number at or above zero", lambda v: math.isfinite(v) and v >= 0),
    "finite": ("a finite number", math.isfinite),
    "count": ("a whole number at or above one", lambda v: isinstance(v, int) and v >= 1),
    "tally": ("a whole number at or above zero", lambda v: isinstance(v, int) and v >= 0),
}
"""The ranges a record's numbers can really have: what each one accepts, as said in the error, and the test."""


def check_figures(data: Mapping[str, Any], ranges: Mapping[str, str], *, nullable: Collection[str] = ()) -> None:
    """Raise :class:`ProfileFigureError` for the first field of a record's JSON ``data`` whose value is not a number
    in its range (``ranges``: field -> a key of :data:`_RANGES`); a field listed in ``nullable`` may be ``None``
    (not measured), an absent field is left to the record's constructor. The error names the field and value;
    :meth:`ProfileDB.from_json <cfp_megatron.profile.db.ProfileDB.from_json>` adds the file and the record."""
    for field, kind in ranges.items():
        if field not in data or (data[field] is None and field in nullable):
            continue
        value = data[field]
        expected, test = _RANGES[kind]
        if isinstance(value, bool) or not isinstance(value, int | float) or not test(value):
            raise ProfileFigureError(f"{field}={value!r} is not {expected}", record="", field=field, value=value,
                                     expected=expected)


class RoundStatus(enum.Enum):
    """How a profiling round ended."""

    ok = "ok"
    """Every planned step ran."""
    timeout = "timeout"
    """The round's share of the budget ran out; the steps done so far are kept."""
    failed = "failed"
    """A step raised on some rank; the steps done before it are kept."""


BUSY_OTHER_LOAD = 0.25
"""Share of the cores busy with other work (than the job's own ranks) above which the machine counts as busy, for a
profiling round and a plan check alike."""
BUSY_REFERENCE_SHARE = 0.6
"""A reference matmul (:func:`cfp_megatron.profile.load.reference_tflops`) slower than this share of its speed on a
quiet machine (:attr:`MachineLoad.quiet_reference_tflops`) marks the round it was timed before as busy."""


def load_busy(other_load: float | None, when: str = "") -> str | None:
    """Why a machine whose other work used ``other_load`` of its cores (0..1) counts as busy (``when`` says when it
    was read, e.g. ``" during the round"``); ``None`` when it stayed at or under :data:`BUSY_OTHER_LOAD`."""
    if other_load is not None and other_load > BUSY_OTHER_LOAD:
        return f"other work used {other_load:.0%} of the cores{when}"
    return None


@dataclass(frozen=True, kw_only=True)
class MachineLoad:
    """How busy the machine was around one profiling round (:mod:`cfp_megatron.profile.load`)."""

    other_before: float | None = None
    """Share of the cores (0..1, over the nodes) other processes than the job's ranks used while the ranks timed the
    reference matmul just before the round; ``None`` where the CPU time is not readable (not Linux)."""
    other_during: float | None = None
    """The same share over the whole round."""
    reference_tflops: float | None = None
    """The reference matmul's speed just before the round (TFLOP/s, the slowest rank's, all ranks at once)."""
    quiet_reference_tflops: float | None = None
    """The reference matmul's speed on this machine when quiet (the median of the ProfileDB's and this run's
    quiet readings) that ``reference_tflops`` was compared with; ``None`` before any quiet reading."""

    @property
    def busy(self) -> str | None:
        """Why the round counts as measured on a busy machine (other work on more than :data:`BUSY_OTHER_LOAD` of
        the cores before or during it, or the reference matmul under :data:`BUSY_REFERENCE_SHARE` of its quiet
        speed); ``None`` when the machine looked quiet."""
        found = load_busy(self.other_before, " before the round") or load_busy(self.other_during, " during the round")
        if found is not None:
            return found
        if self.reference_tflops is not None and self.quiet_reference_tflops:
            share = self.reference_tflops / self.quiet_reference_tflops
            if share < BUSY_REFERENCE_SHARE:
                return f"the reference matmul ran at {share:.0%} of its speed on the quiet machine"
        return None

    def describe(self) -> str:
        """``other work 12% of the cores, reference matmul at 95% of its quiet speed`` (what is known)."""
        other = [v for v in (self.other_before, self.other_during) if v is not None]
        parts = [f"other work {max(other):.0%} of the cores"] if other else []
        if self.reference_tflops is not None and self.quiet_reference_tflops:
            parts.append(f"reference matmul at {self.reference_tflops / self.quiet_reference_tflops:.0%} of its "
                         "quiet speed")
        return ", ".join(parts) or "load not measured"

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> MachineLoad:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a figure out of range."""
        check_figures(data, {"other_before": "non_negative", "other_during": "non_negative",
                             "reference_tflops": "positive", "quiet_reference_tflops": "positive"},
                      nullable=("other_before", "other_during", "reference_tflops", "quiet_reference_tflops"))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class RoundRecord:
    """One profiling round (collectives, gemm, segments) of one run."""

    name: str
    """Round name."""
    status: RoundStatus
    """How it ended."""
    reason: str = ""
    """Why it did not end ``ok`` (the exception, the deadline)."""
    steps_done: int = 0
    """Steps that completed."""
    steps_planned: int = 0
    """Steps it would have run with no deadline."""
    seconds: float = 0.0
    """Wall time it took."""
    model: str = ""
    """Model key the round's entries belong to (:func:`~cfp_megatron.profile.fingerprint.model_key`; ``""`` for the
    rounds of the cluster itself: collectives, gemm) and older records."""
    measured: tuple[str, ...] = ()
    """Entries (:func:`gemm_entry`, :func:`segment_entry`, ...) this run measured; empty in older records."""
    missing: tuple[str, ...] = ()
    """Entries the profile still lacks for the job after this run (a later run or ``python -m
    cfp_megatron.profile`` measures only these); empty when complete and in older records."""
    reused: int = 0
    """Entries the DB already held, not measured again."""
    over_memory: tuple[str, ...] = ()
    """Entries whose step ran out of device memory on this machine (a set-up step's: the entries that need it): not
    measured, and not retried by later runs; plans that would read them are priced by the analytical model."""
    load: MachineLoad | None = None
    """How busy the machine was before and during the round; ``None`` in older records (read as quiet)."""
    time: float | None = None
    """When the round ended (seconds since the epoch); ``None`` in older records."""

    @property
    def busy(self) -> str | None:
        """Why the round was measured on a busy machine (:attr:`MachineLoad.busy`); ``None`` when quiet."""
        return self.load.busy if self.load is not None else None

    @property
    def complete(self) -> bool:
        """Nothing of the round is missing for the job."""
        return not self.missing

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {**dataclasses.asdict(self), "status": self.status.value, "measured": list(self.measured),
                "missing": list(self.missing), "over_memory": list(self.over_memory),
                "load": self.load.to_json() if self.load is not None else None}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RoundRecord:
        """Parse :meth:`to_json`'s output (records written before ``model``, ``measured``, ``missing``, ``reused``
        and ``over_memory`` existed load with their defaults); :class:`ProfileFigureError` for a count or time out of
        range."""
        check_figures(data, {"steps_done": "tally", "steps_planned": "tally", "seconds": "non_negative",
                             "reused": "tally", "time": "non_negative"}, nullable=("time",))
        load = data.get("load")
        return cls(**{**data, "status": RoundStatus(data["status"]),
                      "load": MachineLoad.from_json(load) if load is not None else None,
                      "measured": tuple(data.get("measured", ())), "missing": tuple(data.get("missing", ())),
                      "over_memory": tuple(data.get("over_memory", ()))})


def gemm_entry(m: int, n: int, k: int, dtype: str) -> str:
    """The gemm round's entry (and step label) of one matmul shape."""
    return f"gemm {dtype} {m}x{n}x{k}"


def collective_entry(op: Collective, group_size: int, span: Span, message_bytes: int) -> str:
    """The collectives round's entry (and step label) of one collective, group pattern and message size."""
    return f"{op.value} g={group_size} {span.value} {message_bytes} B"


def collective_entry_key(entry: str) -> tuple[str, int, str]:
    """``(op, group size, span)`` of a :func:`collective_entry` (its fit's key, as values)."""
    op, size, span = entry.split()[:3]
    return op, int(size.removeprefix("g=")), span


def segment_entry(kind: str, partition: str, micro_batch: int) -> str:
    """The segments (or recompute) round's entry of one layer kind under one partition at one micro-batch size:
    its timing and memory steps."""
    return f"{kind} {partition} mbs={micro_batch}"


def overhead_entry(partition: str, layers: int, micro_batch: int, pp: int = 1) -> str:
    """The overheads round's entry of one probe at one micro-batch size (``pp2`` in it for a pipelined probe)."""
    stages = f" pp{pp}" if pp > 1 else ""
    return f"overheads {partition}{stages} L{layers} mbs={micro_batch}"


@dataclass(frozen=True, kw_only=True)
class CollectiveRecord:
    """A collective's timings over one group pattern and the fit through them."""

    fit: CollectiveFit
    """``latency + bytes / bandwidth``."""
    samples: tuple[tuple[int, float], ...]
    """``(message bytes, seconds)`` per timed size: the slowest rank's mean over the repeats."""
    pattern: str
    """How the groups were laid out: ``contiguous`` (neighbouring ranks) or ``strided`` (one rank per block)."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        f = self.fit
        return {"op": f.op.value, "group_size": f.group_size, "span": f.span.value, "latency_s": f.latency_s,
                "bandwidth_bytes_per_s": f.bandwidth_bytes_per_s, "points": f.points,
                "max_rel_error": f.max_rel_error, "pattern": self.pattern,
                "samples": [[b, s] for b, s in self.samples]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CollectiveRecord:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a figure out of range: the fit's latency
        (clamped at or above zero when fitted), bandwidth (above zero), a sample's size (above zero) and time (at or
        above zero)."""
        check_figures(data, {"group_size": "count", "latency_s": "non_negative", "bandwidth_bytes_per_s": "positive",
                             "points": "tally", "max_rel_error": "non_negative"})
        for i, sample in enumerate(data.get("samples") or ()):
            if not isinstance(sample, list | tuple) or len(sample) != 2:
                raise ProfileFigureError(f"samples[{i}]={sample!r} is not a [bytes, seconds] pair", record="",
                                         field=f"samples[{i}]", value=sample, expected="a [bytes, seconds] pair")
            check_figures({f"samples[{i}] bytes": sample[0], f"samples[{i}] seconds": sample[1]},
                          {f"samples[{i}] bytes": "count", f"samples[{i}] seconds": "non_negative"})
        fit = CollectiveFit(op=Collective(data["op"]), group_size=int(data["group_size"]), span=Span(data["span"]),
                            latency_s=float(data["latency_s"]),
                            bandwidth_bytes_per_s=float(data["bandwidth_bytes_per_s"]), points=int(data["points"]),
                            max_rel_error=float(data["max_rel_error"]))
        return cls(fit=fit, samples=tuple((int(b), float(s)) for b, s in data["samples"]), pattern=data["pattern"])


@dataclass(frozen=True, kw_only=True)
class GemmRecord:
    """Throughput of one ``(m x k) @ (k x n)`` matmul shape."""

    m: int
    """Rows of the left operand."""
    n: int
    """Columns of the right operand."""
    k: int
    """Inner dimension."""
    dtype: str
    """``fp32``, ``bf16`` or ``fp16``."""
    tflops: float
    """Achieved TFLOP/s (``2 m n k / seconds``), slowest rank."""
    seconds: float
    """Mean seconds per matmul, slowest rank."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GemmRecord:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a shape, throughput or time out of
        range."""
        check_figures(data, {"m": "count", "n": "count", "k": "count", "tflops": "positive", "seconds": "positive"})
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class SegmentRecord:
    """Forward and backward time (and activation memory) of one segment class under one partition at one micro-batch
    size."""

    model: str
    """Key of the model shape, sequence length and precision it was measured for (:func:`model_key`)."""
    model_name: str
    """The model preset's name, for people."""
    segment: str
    """Segment class id in the analysis JSON for the ``tp<N>`` mesh."""
    kind: str
    """Layer kind: ``embedding``, ``dense``, ``moe``, ``head``."""
    partition: str
    """Canonical partition string (:func:`partition_name`): ``tp<N>``, Megatron's tensor-parallel layout over N
    ranks, ``tp<N>-sp`` with sequence parallelism."""
    tp: int
    """Tensor-parallel size."""
    micro_batch: int
    """Sequences per micro-batch."""
    seq_length: int
    """Tokens per sequence."""
    forward_s: float
    """Seconds of the forward pass, slowest rank."""
    backward_s: float
    """Seconds of the backward pass, slowest rank."""
    confirmed: bool
    """The analysis found Megatron's TP layout among the class's candidate partitions."""
    activation_bytes: float | None = None
    """Tensor bytes one forward pass leaves alive for its backward (saved tensors, masks, its output), median over
    ranks and repeats; ``None`` in DBs written before it was measured."""
    transient_bytes: float | None = None
    """How far the live tensor bytes rise above ``activation_bytes`` during the forward or the backward pass (their
    transients, the input gradient), median; ``None`` when not measured."""
    workspace_bytes: float | None = None
    """Persistent buffers the first pass allocates and later passes reuse (Megatron's global memory buffer), median;
    ``None`` when not measured."""
    baseline_s: float | None = None
    """Under recomputation (partitions ``...-selective``, ``...-full``): forward plus backward seconds of the same
    layer without it, timed alternately with this one in the same round, slowest rank, so a drift of the machine's
    speed between rounds does not enter what recomputation adds; ``None`` otherwise and in older DBs."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SegmentRecord:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a size, time or byte count out of the
        range a measurement gives (times above zero; transient and workspace bytes at or above zero, being clamped
        there; activation bytes any finite number, being a difference of live bytes)."""
        check_figures(data, {"tp": "count", "micro_batch": "count", "seq_length": "count", "forward_s": "positive",
                             "backward_s": "positive", "baseline_s": "positive", "activation_bytes": "finite",
                             "transient_bytes": "non_negative", "workspace_bytes": "non_negative"},
                      nullable=("baseline_s", "activation_bytes", "transient_bytes", "workspace_bytes"))
        return cls(**data)


@dataclass(frozen=True, kw_only=True)
class OverheadRecord:
    """One probe model trained with the runtime's own step (:mod:`cfp_megatron.profile.overheads`) at one
    micro-batch size: its schedule and the rest of its step, under one partition."""

    model: str
    """Key of the model shape, sequence length and precision (:func:`model_key`)."""
    partition: str
    """Canonical partition string (:func:`partition_name`)."""
    tp: int
    """Tensor-parallel size (the rest of the world data-parallel, and pipeline-parallel by :attr:`pp`)."""
    layers: int
    """Decoder layers of the probe model."""
    params: int
    """Parameters on one rank of the probe (what its optimizer updates)."""
    micro_batch: int
    """Sequences per micro-batch."""
    microbatches: int
    """Micro-batches per timed step."""
    schedule_s: float
    """``forward_backward_func`` seconds of one step, the gradient finalisation taken out; median, slowest rank."""
    rest_s: float
    """The rest of the step: ``optimizer.step`` (grad norm, clipping, Adam), zeroing the gradient buffers, the loss
    all-reduce, the LR schedule; median, slowest rank."""
    finalize_s: float | None = None
    """The step's gradient finalisation (``finalize_model_grads``: the data-parallel gradient reduction, the token
    count's all-reduce) as the slowest rank pays it inside the step (the slowest whole schedule less the slowest
    schedule without it); median over the repeats. ``None`` in files written before it was recorded."""
    pp: int = 1
    """Pipeline stages of the probe: 1 for the probes a step's overheads come from
    (:meth:`~cfp_megatron.profile.db.ProfileDB.step_overheads`), 2 for the one that prices a pipeline's exchanges
    (:meth:`~cfp_megatron.profile.db.ProfileDB.pipeline_probe`); 1 in files written before pipelined probes."""
    single_schedule_s: float | None = None
    """A pipelined probe's schedule in a step of one micro-batch (median, slowest rank): with :attr:`schedule_s` it
    tells what each micro-batch adds from what every step pays; ``None`` for the other probes."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OverheadRecord:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a size or time out of range (the
        schedule above zero, the rest at or above zero)."""
        check_figures(data, {"tp": "count", "pp": "count", "layers": "count", "params": "count", "micro_batch": "count",
                             "microbatches": "count", "schedule_s": "positive", "rest_s": "non_negative",
                             "finalize_s": "non_negative", "single_schedule_s": "positive"},
                     nullable=("finalize_s", "single_schedule_s"))
        return cls(**data)


STEP_TOLERANCE = 0.10
"""Relative difference between a run's measured and predicted step time beyond which the plan check warns."""
BUSY_REPEAT_SPREAD = 0.5
"""(Slowest - fastest) / median of the timed steps above which a plan check's machine counts as busy."""


@dataclass(frozen=True, kw_only=True)
class PlanCheckRecord:
    """A training run's first steps measured against its plan's prediction (``+cfp=auto`` / ``+cfp=manual``)."""

    model: str
    """Key of the model shape, sequence length and precision (:func:`model_key`)."""
    plan: str
    """The plan's canonical string."""
    steps: int
    """Steps the measured step time is the median of."""
    predicted_step_s: float
    """Seconds per optimizer step the simulator predicted (before calibration)."""
    calibration: float
    """The factor the prediction was scaled by for the comparison (earlier runs' measured/predicted; 1 if none)."""
    measured_step_s: float
    """Measured seconds per optimizer step (median)."""
    predicted_peak_bytes: float | None
    """Predicted peak memory of the most loaded rank."""
    measured_peak_bytes: float | None
    """Measured peak memory of the most loaded rank (``None`` when not measured)."""
    time: float
    """When (seconds since the epoch)."""
    profile_id: str | None = None
    """The profile the prediction was measured against (:meth:`~cfp_megatron.profile.db.ProfileDB.profile_id`): a
    new profile of the model starts its calibration fresh; ``None`` in records written before it was kept (these
    calibrate nothing)."""
    other_load: float | None = None
    """Share of the machine's cores busy with other work than this job right after the checked steps, 0..1
    (:func:`cfp_megatron.profile.cpu_use.other_load`); ``None`` where not known."""
    repeat_spread: float | None = None
    """Spread of the timed steps: (slowest - fastest) / median; ``None`` with fewer than two."""
    trial: bool = False
    """Measured by a trial at launch (``cfp.trials``: a few steps of one of the top plans before training), not by
    the training run itself."""

    @property
    def step_ratio(self) -> float:
        """Measured over the simulator's predicted step time (what calibration is the median of)."""
        return self.measured_step_s / self.predicted_step_s

    @property
    def busy(self) -> str | None:
        """Why the machine looked busy while the steps were timed (other work on more than
        :data:`BUSY_OTHER_LOAD` of the cores, or step times more than :data:`BUSY_REPEAT_SPREAD` apart), so the run
        is recorded but does not calibrate; ``None`` when it looked quiet."""
        found = load_busy(self.other_load)
        if found is not None:
            return found
        if self.repeat_spread is not None and self.repeat_spread > BUSY_REPEAT_SPREAD:
            return f"the timed steps were {self.repeat_spread:.0%} apart"
        return None

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PlanCheckRecord:
        """Parse :meth:`to_json`'s output; :class:`ProfileFigureError` for a figure out of range (the measured step
        time and the calibration above zero; the rest at or above zero)."""
        check_figures(data, {"steps": "tally", "predicted_step_s": "non_negative", "calibration": "positive",
                             "measured_step_s": "positive", "predicted_peak_bytes": "non_negative",
                             "measured_peak_bytes": "non_negative", "time": "non_negative",
                             "other_load": "non_negative", "repeat_spread": "non_negative"},
                      nullable=("predicted_peak_bytes", "measured_peak_bytes", "other_load", "repeat_spread"))
        return cls(**data)
