"""The ProfileDB: what profiling measured on one cluster, as versioned JSON keyed by its :class:`Fingerprint`.

One file per fingerprint under ``$CFP_CACHE_DIR/profile/<fingerprint key>.json``; a run on the same hardware and
software finds it by its key and reuses it, a run with another fingerprint never opens it (another key), and a file
whose stored fingerprint or schema does not match is refused with a typed error. Writes are atomic (temporary file +
rename) and merge this job's additions into the file as it is then, under a lock file (:func:`store_db`,
:func:`update_db`), so concurrent jobs sharing the cache keep each other's entries. The DB implements
:class:`~cfp_megatron.cluster.measured.Measurements`, the simulator's only view of it.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import math
import statistics
import sys
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from filelock import FileLock, Timeout

from cfp_megatron.base.config import Recompute
from cfp_megatron.base.files import (
    CACHE_ENV,
    CACHE_KEY,
    cache_dir,
    json_loads_unique,
    open_regular,
    write_atomic,
    write_error,
    write_new,
)
from cfp_megatron.cluster.measured import (
    Collective,
    CollectiveFit,
    PipelineProbe,
    SegmentMemory,
    Span,
    StepOverheads,
    free_line,
    interpolate_rows,
    least_squares_line,
    partition_recompute,
)
from cfp_megatron.profile.errors import (
    FingerprintMismatchError,
    ProfileDBError,
    ProfileFigureError,
    SchemaVersionError,
)
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.gemm_table import interpolate_tflops
from cfp_megatron.profile.records import (
    CollectiveRecord,
    GemmRecord,
    OverheadRecord,
    PlanCheckRecord,
    RoundRecord,
    SegmentRecord,
    collective_entry_key,
    gemm_entry,
    overhead_entry,
    segment_entry,
)

SCHEMA_VERSION = 1
"""Version of the JSON layout; a file of another version is refused with :class:`SchemaVersionError`."""
SECTION = "profile"
"""Folder of the cache root that holds ProfileDB files."""


@dataclass(frozen=True, kw_only=True)
class ProfileDB:
    """Measurements of one cluster (implements :class:`~cfp_megatron.cluster.measured.Measurements`)."""

    fingerprint: Fingerprint
    """Hardware and software the figures belong to."""
    collectives: tuple[CollectiveRecord, ...] = ()
    """One fit per (collective, group size, span)."""
    gemms: tuple[GemmRecord, ...] = ()
    """GEMM throughput table."""
    segments: tuple[SegmentRecord, ...] = ()
    """Segment forward/backward times, for every model profiled on this cluster."""
    overheads: tuple[OverheadRecord, ...] = ()
    """Training-step costs beyond the segments (probe models per partition), for every model profiled here."""
    rounds: tuple[RoundRecord, ...] = ()
    """Every round of every run that wrote this DB, in order, with how it ended."""
    plan_checks: tuple[PlanCheckRecord, ...] = ()
    """Training runs' measured step time and memory against their plans' predictions, oldest first."""
    model: str | None = None
    """Model key that kind names (``dense``) resolve against in :meth:`segment_seconds`; see :meth:`for_model`."""
    schema_version: int = SCHEMA_VERSION
    """JSON layout version."""

    # ---------------------------------------------------------------------------------------------- Measurements
    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        """The fit for ``op`` over ``group_size`` ranks within or across nodes (``None`` if not measured)."""
        for rec in self.collectives:
            f = rec.fit
            if f.op is op and f.group_size == group_size and f.span is span:
                return f
        return None

    def gemm_tflops(self, m: int, n: int, k: int, dtype: str) -> float | None:
        """TFLOP/s of an ``(m x k) @ (k x n)`` matmul in ``dtype``, interpolated from the table."""
        return interpolate_tflops([g for g in self.gemms if g.dtype == dtype], m, n, k)

    def peak_tflops(self, dtype: str) -> float | None:
        """Best measured matmul throughput in ``dtype``."""
        values = [g.tflops for g in self.gemms if g.dtype == dtype]
        return max(values) if values else None

    def _segment_records(self, segment: str, partition: str) -> list[SegmentRecord]:
        """Records of a segment class under ``partition``, newest first. ``segment`` is the class id of the analysis
        JSON, or a layer kind (``embedding``, ``dense``, ``moe``, ``head``) of the model chosen with
        :meth:`for_model` (or of the only model in the DB)."""
        models = {r.model for r in self.segments}
        kind_model = self.model if self.model is not None else (next(iter(models)) if len(models) == 1 else None)
        return [rec for rec in reversed(self.segments) if rec.partition == partition
                and (rec.segment == segment or (rec.kind == segment and rec.model == kind_model))]

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of a segment class under ``partition`` (``tp<N>``) at ``micro_batch``
        (``segment`` as in :meth:`_segment_records`; the newest measurement wins)."""
        for rec in self._segment_records(segment, partition):
            if rec.micro_batch == micro_batch:
                return rec.forward_s, rec.backward_s
        return None

    def segment_baseline_seconds(self, segment: str, partition: str, micro_batch: int) -> float | None:
        """The recomputed layer's alternately timed plain forward plus backward
        (:attr:`~cfp_megatron.profile.records.SegmentRecord.baseline_s`), newest measurement."""
        for rec in self._segment_records(segment, partition):
            if rec.micro_batch == micro_batch:
                return rec.baseline_s
        return None

    def segment_micro_batches(self, segment: str, partition: str) -> tuple[int, ...]:
        """The micro-batch sizes at which a segment class was timed under ``partition``, ascending."""
        return tuple(sorted({rec.micro_batch for rec in self._segment_records(segment, partition)}))

    def segment_memory(self, segment: str, partition: str, micro_batch: int) -> SegmentMemory | None:
        """Tensor memory of a segment class under ``partition`` at ``micro_batch``; ``None`` when not measured
        (also for records written before memory was)."""
        for rec in self._segment_records(segment, partition):
            if rec.micro_batch == micro_batch and rec.activation_bytes is not None:
                return SegmentMemory(activation_bytes=rec.activation_bytes,
                                     transient_bytes=rec.transient_bytes or 0.0,
                                     workspace_bytes=rec.workspace_bytes or 0.0)
        return None

    def step_overheads(self, partition: str, micro_batch: int) -> StepOverheads | None:
        """A training step beyond the isolated segments under ``partition`` at ``micro_batch``, from the overheads
        round's probes of the model chosen with :meth:`for_model` (or of the only model with probes in the DB).

        Per measured micro-batch size: one layer = the difference of the two probes' schedules per micro-batch; the
        rest of a micro-batch = the smaller probe's schedule per micro-batch minus its layers and the embedding and
        head segments. Both as least-squares lines in the micro-batch size through three or more measured sizes
        (the layer's kept at zero or above; the rest's free, since it may fall with the size); with fewer, linear
        interpolation between the nearest two (extrapolation from the two nearest). A rest above zero is the
        schedule's cost per micro-batch (on the stages with the embedding or the head); one below zero is the
        embedding and head running faster in the schedule than alone
        (:attr:`~cfp_megatron.cluster.measured.StepOverheads.ends_s`). Outside the schedule: a line in the
        parameters per rank, one slope for all partitions. The gradient finalisation as the probes timed it inside
        their steps, by their parameters. ``None`` when no pair of probes ran under ``partition``.
        """
        model = self._overheads_model()
        rows = [r for r in self.overheads if r.model == model and r.partition == partition and r.pp == 1]
        by_mb: dict[int, dict[int, OverheadRecord]] = {}
        for r in rows:
            by_mb.setdefault(r.micro_batch, {})[r.layers] = r
        points = []
        ends: dict[int, float] = {}
        for mb, probes in sorted(by_mb.items()):
            emb = self.segment_seconds("embedding", partition, mb)
            head = self.segment_seconds("head", partition, mb)
            if len(probes) < 2 or emb is None or head is None:
                continue
            small, big = probes[min(probes)], probes[max(probes)]
            ends[mb] = sum(emb) + sum(head)
            s_small = small.schedule_s / small.microbatches
            s_big = big.schedule_s / big.microbatches
            layer = max((s_big - s_small) / (big.layers - small.layers), 0.0)
            points.append((mb, layer, s_small - small.layers * layer - sum(emb) - sum(head)))  # noisy: any sign
        if not points:
            return None
        if len(points) >= 3:  # noisy timings: the least-squares lines through every size
            la, lb = least_squares_line([(mb, layer) for mb, layer, _ in points])
            pa, pb = free_line([(mb, extra) for mb, _, extra in points])
            layer_s, per_micro = la + lb * micro_batch, pa + pb * micro_batch
        else:
            layer_s, per_micro = interpolate_rows([(mb, (layer, extra)) for mb, layer, extra in points],
                                                  micro_batch, proportional=False)
        (isolated,) = interpolate_rows(sorted((mb, (s,)) for mb, s in ends.items()), micro_batch, proportional=False)
        ends_s = max(min(per_micro, 0.0), -max(isolated, 0.0))
        per_micro = max(per_micro, 0.0)
        per_param = self._step_per_param(model)
        base = sum(r.rest_s - per_param * r.params for r in rows) / len(rows)
        return StepOverheads(partition=partition, micro_batch=micro_batch, layer_s=layer_s,
                             per_microbatch_s=per_micro, ends_s=ends_s, step_base_s=max(base, 0.0),
                             step_per_param_s=per_param, finalize_share=self._finalize_share(rows))

    def _overheads_model(self) -> str | None:
        """The model whose probes answer: the one chosen with :meth:`for_model`, or the only one with probes."""
        models = {r.model for r in self.overheads}
        return self.model if self.model is not None else (next(iter(models)) if len(models) == 1 else None)

    def pipeline_probe(self, partition: str, micro_batch: int) -> PipelineProbe | None:
        """The pipelined probe of the overheads round (:attr:`OverheadRecord.pp` above 1) under ``partition`` at
        ``micro_batch``, of the model chosen as for :meth:`step_overheads`; the newest measurement wins."""
        model = self._overheads_model()
        for r in reversed(self.overheads):
            if r.model == model and r.partition == partition and r.pp > 1 and r.micro_batch == micro_batch:
                return PipelineProbe(tp=r.tp, sp=partition.endswith("-sp"), pp=r.pp, layers=r.layers,
                                     micro_batch=r.micro_batch, microbatches=r.microbatches, schedule_s=r.schedule_s,
                                     rest_s=r.rest_s, finalize_s=r.finalize_s,
                                     single_schedule_s=r.single_schedule_s)
        return None

    def _finalize_share(self, rows: Sequence[OverheadRecord]) -> float:
        """The median over ``rows`` (one partition's probes) of the gradient finalisation they timed inside their
        steps over what this DB's all-reduce fit gives for it over their data-parallel group (the fp32 gradients,
        as the probes reduce them, and the token count); 1 without timed probes, data parallelism or a fit."""
        fp = self.fingerprint
        dp = fp.nodes * fp.gpus_per_node // max(rows[0].tp, 1)
        fit = self.collective(Collective.all_reduce, dp, Span.intra_node if fp.nodes == 1 else Span.inter_node)
        if fit is None or dp < 2:
            return 1.0
        ratios = [r.finalize_s / (fit.seconds(4.0 * r.params) + fit.seconds(4.0)) for r in rows
                  if r.finalize_s is not None]
        return statistics.median(ratios) if ratios else 1.0

    def busy_slowdown(self) -> float | None:
        """Ranks per node over CPU cores where the ranks of a CPU-only cluster share fewer cores than there are ranks
        (every round times with all ranks busy); ``None`` on accelerators or with a core per rank."""
        fp = self.fingerprint
        if fp.cuda is not None or not fp.cpu_cores or fp.gpus_per_node <= fp.cpu_cores:
            return None
        return fp.gpus_per_node / fp.cpu_cores

    def _step_per_param(self, model: str | None) -> float:
        """Seconds outside the schedule per parameter: one least-squares slope through every probe of ``model``,
        each partition its own intercept (its grad-norm all-reduce); never below zero."""
        by_partition: dict[str, list[tuple[int, float]]] = {}
        for r in self.overheads:
            if r.model == model and r.pp == 1:
                by_partition.setdefault(r.partition, []).append((r.params, r.rest_s))
        num = den = 0.0
        for pts in by_partition.values():
            mean_p = sum(p for p, _ in pts) / len(pts)
            mean_s = sum(s for _, s in pts) / len(pts)
            num += sum((p - mean_p) * (s - mean_s) for p, s in pts)
            den += sum((p - mean_p) ** 2 for p, _ in pts)
        return max(num / den, 0.0) if den > 0 else 0.0

    # ------------------------------------------------------------------------------------------------ queries
    def step_time_calibration(self, model: str | None = None, *, plan: str | None = None) -> float | None:
        """The ratio of :meth:`calibration`; ``None`` without a trusted run."""
        found = self.calibration(model, plan=plan)
        return found.ratio if found is not None else None

    def profile_id(self, model: str | None = None) -> str:
        """Identity of the profile ``model``'s predictions read (default: this DB's :meth:`for_model` key): a hash of
        the collective fits, the GEMM table and the model's segments and probes. Any new measurement makes a new
        profile, whose plan checks start afresh."""
        key = model or self.model
        payload = {"collectives": [r.to_json() for r in self.collectives], "gemms": [r.to_json() for r in self.gemms],
                   "segments": [r.to_json() for r in self.segments if r.model == key],
                   "overheads": [r.to_json() for r in self.overheads if r.model == key]}
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]

    def calibration(self, model: str | None = None, *, plan: str | None = None) -> StepCalibration | None:
        """Measured over predicted step time of the training runs of ``model`` (default: this DB's :meth:`for_model`
        key) checked against plans read from this very profile (:meth:`profile_id`) and, with ``plan`` (a canonical
        string), of its layout family (:func:`layout_family`): the median over the runs and the profile's own
        prediction (:data:`PROFILE_VOTE`), where a run on a busy machine (:attr:`PlanCheckRecord.busy`) or far
        outside the others (:func:`robust_ratio`) is recorded but not trusted. ``None`` without any run."""
        key = model or self.model
        current = self.profile_id(key)
        family = layout_family(plan) if plan is not None else None
        checks = [r for r in self.plan_checks if r.model == key and r.predicted_step_s > 0
                  and r.profile_id == current and (family is None or layout_family(r.plan) == family)]
        if not checks:
            return None
        busy = [r.step_ratio for r in checks if r.busy is not None]
        return robust_ratio([r.step_ratio for r in checks if r.busy is None], busy=busy, prior=PROFILE_VOTE)

    def missing_entries(self, round_name: str, model: str, planned: Sequence[str]) -> list[str]:
        """The entries of ``planned`` (a round's entries for a job, in the order the round runs them) this DB lacks:
        GEMM shapes, segment timings with their memory, probes with their gradient finalisation (``model``'s) are
        read off the records themselves
        (so a DB written before rounds recorded their entries is completed too); a collective's size counts once
        its fit exists and a run recorded it as measured (in a DB whose runs recorded none, once its fit
        exists)."""
        if round_name == "collectives":
            fitted = {(r.fit.op.value, r.fit.group_size, r.fit.span.value) for r in self.collectives}
            recorded = [r for r in self.rounds if r.name == "collectives" and r.measured]
            done = {e for r in recorded for e in r.measured}
            return [e for e in planned if collective_entry_key(e) not in fitted or (recorded and e not in done)]
        if round_name == "gemm":
            have = {gemm_entry(g.m, g.n, g.k, g.dtype) for g in self.gemms}
        elif round_name in ("segments", "recompute"):
            have = {segment_entry(r.kind, r.partition, r.micro_batch) for r in self.segments
                    if r.model == model and r.activation_bytes is not None}
        elif round_name == "overheads":
            have = {overhead_entry(r.partition, r.layers, r.micro_batch, r.pp) for r in self.overheads
                    if r.model == model and r.finalize_s is not None}  # earlier probes did not time it: again
        else:
            raise ProfileDBError(f"unknown profiling round {round_name!r}. Fix: one of collectives, gemm, segments, "
                                 "overheads, recompute.")
        # What ran out of device memory here is not retried: it would again.
        have |= {e for r in self.rounds if r.name == round_name and r.model == model for e in r.over_memory}
        return [e for e in planned if e not in have]

    def _latest_rounds(self, round_name: str, model: str) -> dict[str, RoundRecord]:
        """Per entry of ``round_name`` (``model``'s, or the cluster's for collectives and GEMMs), the newest round
        record that measured it."""
        own = "" if round_name in ("collectives", "gemm") else model
        latest: dict[str, RoundRecord] = {}
        for r in self.rounds:
            if r.name == round_name and r.model == own:
                latest.update(dict.fromkeys(r.measured, r))
        return latest

    def busy_entries(self, round_name: str, model: str, planned: Sequence[str]) -> list[str]:
        """The entries of ``planned`` whose newest measurement was taken on a busy machine
        (:attr:`~cfp_megatron.profile.records.RoundRecord.busy`): a later run measures them again when it finds
        the machine quiet."""
        latest = self._latest_rounds(round_name, model)
        return [e for e in planned if e in latest and latest[e].busy is not None]

    def measured_under(self, model: str, planned: Mapping[str, Sequence[str]]) -> tuple[str, list[str]]:
        """When and under what load the entries of ``planned`` (per round) were measured: a phrase
        (``measured 2026-12-01 23:40-23:44 UTC, machine quiet (other work at most 8% of the cores)``) and, per
        round measured on a busy machine, ``segments (other work used 85% of the cores during the round)``; ``""``
        when none of them was measured."""
        records = {id(r): r for name, entries in planned.items()
                   for e, r in self._latest_rounds(name, model).items() if e in set(entries)}.values()
        if not records:
            return "", []
        times = sorted(r.time for r in records if r.time is not None)
        when = ("measured " + _utc(times[0]) + (f" to {_utc(times[-1])[11:]}" if times[-1] - times[0] >= 60 else "")
                + " UTC") if times else "measured before loads were recorded"
        busy = {r.name: f"{r.name} ({r.busy})" for r in sorted(records, key=lambda r: r.time or 0.0)
                if r.busy is not None}  # per round, its newest busy record's reason
        names = {r.name for r in records}
        others = [v for r in records if r.load is not None for v in (r.load.other_before, r.load.other_during)
                  if v is not None]
        if busy:
            order = [name for name in planned if name in busy]
            return f"{when}, {len(busy)} of {len(names)} rounds on a busy machine", [busy[name] for name in order]
        if others:
            return f"{when}, machine quiet (other work at most {max(others):.0%} of the cores)", []
        return when, []

    def for_model(self, model: str) -> ProfileDB:
        """The same DB with kind names resolving against ``model`` (a :func:`model_key`)."""
        return dataclasses.replace(self, model=model)

    def has_overheads(self, model: str, tp: int) -> bool:
        """Whether the overheads round's probes of ``model`` under ``tp`` are stored."""
        return any(r.model == model and r.tp == tp and r.pp == 1 for r in self.overheads)

    def has_segments(self, model: str, tp: int, micro_batch: int, *,
                     recompute: Recompute = Recompute.none) -> bool:
        """Whether segment times and memory of ``model`` under ``tp`` at ``micro_batch`` are stored (records from
        before memory was measured do not count, so the next run measures them again); with ``recompute``
        selective or full, those of its decoder layers under it (partitions ``...-selective``, ``...-full``)."""
        return any(r.model == model and r.tp == tp and r.micro_batch == micro_batch and r.activation_bytes is not None
                   and partition_recompute(r.partition) is recompute for r in self.segments)

    # ---------------------------------------------------------------------------------------------- updates
    def merged(self, *, collectives: Iterable[CollectiveRecord] = (), gemms: Iterable[GemmRecord] = (),
               segments: Iterable[SegmentRecord] = (), rounds: Iterable[RoundRecord] = (),
               overheads: Iterable[OverheadRecord] = (),
               plan_checks: Iterable[PlanCheckRecord] = ()) -> ProfileDB:
        """A new DB with these records added; a new record replaces an old one with the same key."""
        def merge(old: tuple, new: Iterable, key: Any) -> tuple:
            fresh = list(new)
            keys = {key(r) for r in fresh}
            return tuple([r for r in old if key(r) not in keys] + fresh)

        return dataclasses.replace(
            self,
            plan_checks=(*self.plan_checks, *plan_checks),
            collectives=merge(self.collectives, collectives, lambda r: (r.fit.op, r.fit.group_size, r.fit.span)),
            gemms=merge(self.gemms, gemms, lambda r: (r.m, r.n, r.k, r.dtype)),
            segments=merge(self.segments, segments, lambda r: (r.model, r.segment, r.kind, r.partition,
                                                               r.micro_batch)),
            overheads=merge(self.overheads, overheads, lambda r: (r.model, r.partition, r.layers, r.pp,
                                                                 r.micro_batch)),
            rounds=self.rounds + tuple(rounds))

    # ------------------------------------------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"schema_version": self.schema_version, "fingerprint": self.fingerprint.to_json(),
                "fingerprint_key": self.fingerprint.key,
                "collectives": [r.to_json() for r in self.collectives], "gemms": [r.to_json() for r in self.gemms],
                "segments": [r.to_json() for r in self.segments],
                "overheads": [r.to_json() for r in self.overheads], "rounds": [r.to_json() for r in self.rounds],
                "plan_checks": [r.to_json() for r in self.plan_checks]}

    @classmethod
    def from_json(cls, data: Any, *, source: object = "<json>") -> ProfileDB:
        """Parse :meth:`to_json`'s output; raise :class:`SchemaVersionError` or :class:`ProfileDBError`."""
        if not isinstance(data, dict):
            raise ProfileDBError(f"{source}: not a ProfileDB (a JSON object was expected). "
                                 "Fix: point at a file cfp_megatron.profile wrote.")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise SchemaVersionError(source, version, SCHEMA_VERSION)
        try:
            return cls(fingerprint=Fingerprint.from_json(data["fingerprint"]),
                       collectives=_records(CollectiveRecord, "collectives", data["collectives"], source),
                       gemms=_records(GemmRecord, "gemms", data["gemms"], source),
                       segments=_records(SegmentRecord, "segments", data["segments"], source),
                       overheads=_records(OverheadRecord, "overheads", data.get("overheads", []), source),
                       rounds=_records(RoundRecord, "rounds", data["rounds"], source),
                       plan_checks=_records(PlanCheckRecord, "plan_checks", data.get("plan_checks", []), source))
        except ProfileFigureError:
            raise
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileDBError(f"{source}: malformed ProfileDB ({type(err).__name__}: {err}). "
                                 f"Fix: {REPROFILE_FIX}") from None


REPROFILE_FIX = ("profile this cluster again with `torchrun --nproc_per_node=N -m cfp_megatron.profile <overrides> "
                 "--force`, or delete the file (the next +cfp=auto launch profiles afresh).")
"""The fix of a ProfileDB file that cannot be used as it is."""


def _record_label(section: str, data: Any) -> str:
    """A record's entry (``dense tp2 mbs=4``, ``gemm fp32 64x64x64``) for an error message, where it can be read."""
    try:
        if section == "collectives":
            return f"{data['op']} g={data['group_size']} {data['span']}"
        if section == "gemms":
            return gemm_entry(data["m"], data["n"], data["k"], data["dtype"])
        if section == "segments":
            return segment_entry(data["kind"], data["partition"], data["micro_batch"])
        if section == "overheads":
            return overhead_entry(data["partition"], data["layers"], data["micro_batch"], data.get("pp", 1))
        if section == "rounds":
            return f"round {data['name']}"
        if section == "plan_checks":
            return f"plan {data['plan']}"
    except (KeyError, TypeError):
        pass
    return ""


def _records(kind: Any, section: str, rows: Any, source: object) -> tuple:
    """``kind.from_json`` of every row of ``section``; a number out of range is a :class:`ProfileFigureError` naming
    the file, the record (section, index, entry), the field, the value, its range and the fix."""
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(kind.from_json(row))
        except ProfileFigureError as err:
            label = _record_label(section, row)
            record = f"{section}[{i}]" + (f" ({label})" if label else "")
            raise ProfileFigureError(
                f"{source}: {record}: {err.field}={err.value!r} is not {err.expected}; a measurement never gives "
                f"it, and the planner would read it. Fix: {REPROFILE_FIX}", record=record, field=err.field,
                value=err.value, expected=err.expected) from None
    return tuple(out)


def _utc(seconds: float) -> str:
    """``2026-12-01 23:40`` (UTC) of a time in seconds since the epoch."""
    return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC).strftime("%Y-%m-%d %H:%M")


# ----------------------------------------------------------------------------------------------- calibration
OUTLIER_FACTOR = 1.5
"""A run whose ratio is this factor or more off the others' median (and beyond 3 robust deviations) is an outlier."""
PROFILE_VOTE = 1.0
"""The profile's own prediction, as a measured/predicted ratio, counted as one run in the calibration's median: one
run moves the next prediction halfway to it, two that agree all the way (docs/planning.md, "Plan check")."""


@dataclass(frozen=True, kw_only=True)
class StepCalibration:
    """Measured over predicted step time of earlier runs: what the next plan's step time is scaled by."""

    ratio: float | None
    """Median over the trusted runs and, where a ``prior`` was given (:func:`robust_ratio`), the profile's own
    prediction counted as one more run; ``None`` when no run is trusted (all on a busy machine)."""
    runs: int
    """Trusted runs the median is over."""
    spread: float
    """(Largest - smallest) / median of the trusted ratios; 0 with one run."""
    untrusted: tuple[float, ...] = ()
    """Ratios recorded but left out: outliers far from the rest, runs on a busy machine."""


def robust_ratio(ratios: Sequence[float], *, busy: Sequence[float] = (),
                 prior: float | None = None) -> StepCalibration:
    """The median of ``ratios`` (oldest first) with a run far outside the rest left out: with three or more, one
    whose log-ratio is more than max(3 robust standard deviations (1.4826 x MAD), log :data:`OUTLIER_FACTOR`) from
    the median; with two that disagree by :data:`OUTLIER_FACTOR` or more, the later one (the earlier stands until a
    third run decides). ``busy``: ratios of runs on a busy machine, only recorded. ``prior``: a ratio the median
    also counts as one run (the profile's own prediction, 1: :meth:`ProfileDB.calibration`), where any run is
    trusted."""
    logs = [math.log(r) for r in ratios if r > 0]
    trusted, outliers = list(logs), []
    if len(logs) == 2 and abs(logs[1] - logs[0]) >= math.log(OUTLIER_FACTOR):
        trusted, outliers = [logs[0]], [logs[1]]
    elif len(logs) >= 3:
        mid = statistics.median(logs)
        mad = statistics.median(abs(x - mid) for x in logs)
        limit = max(3 * 1.4826 * mad, math.log(OUTLIER_FACTOR))
        trusted = [x for x in logs if abs(x - mid) <= limit]
        outliers = [x for x in logs if abs(x - mid) > limit]
    if not trusted:
        return StepCalibration(ratio=None, runs=0, spread=0.0, untrusted=(*map(math.exp, outliers), *busy))
    values = [math.exp(x) for x in trusted]
    ratio = statistics.median(values if prior is None else [prior, *values])
    return StepCalibration(ratio=ratio, runs=len(values), spread=(max(values) - min(values)) / ratio,
                           untrusted=(*map(math.exp, outliers), *busy))


FAMILY_KEYS = ("tp", "sp", "pp", "vpp", "cp", "ep", "rc")
"""Fields of a plan's canonical string that make its layout family: runs of one family calibrate its plans."""


def layout_family(plan: str) -> str:
    """The layout family of a plan's canonical string (``tp=1,sp=0,pp=2,vpp=1,cp=1,ep=1,rc=none``): its parallel
    sizes and recomputation, not its micro-batch or optimizer; the string itself when it has no fields."""
    _, _, fields = plan.partition(":")
    pairs = dict(part.split("=", 1) for part in fields.split(",") if "=" in part)
    found = [f"{k}={pairs[k]}" for k in FAMILY_KEYS if k in pairs]
    return ",".join(found) if found else plan


# --------------------------------------------------------------------------------------------------- storage
def db_path(fingerprint: Fingerprint) -> Path:
    """Where the DB of ``fingerprint`` lives: ``$CFP_CACHE_DIR/profile/<key>.json``."""
    return cache_dir() / SECTION / f"{fingerprint.key}.json"


def read_db(path: str | Path, *, expected: Fingerprint | None = None) -> ProfileDB:
    """Read the DB at ``path``; with ``expected``, refuse one measured elsewhere (:class:`FingerprintMismatchError`)."""
    path = Path(path)
    try:
        with open_regular(path) as fh:  # a named pipe or device is refused, not waited on
            data = json_loads_unique(fh.read())  # a key given twice is refused, not read one way
    except OSError as err:
        raise ProfileDBError(f"{path}: cannot read ({err.strerror}). Fix: check the path.") from None
    except ValueError as err:
        raise ProfileDBError(f"{path}: not JSON ({err}). Fix: profile again with --force.") from None
    db = ProfileDB.from_json(data, source=path)
    if expected is not None and db.fingerprint != expected:
        raise FingerprintMismatchError(path, db.fingerprint.to_json(), expected.to_json())
    return db


def load_db(fingerprint: Fingerprint) -> ProfileDB | None:
    """The stored DB of ``fingerprint``, or ``None`` when this cluster has not been profiled.

    Raises :class:`SchemaVersionError` for a file of another schema version.
    """
    path = db_path(fingerprint)
    if not path.exists():
        return None
    return read_db(path, expected=fingerprint)


LOCK_TIMEOUT_S = 120.0
"""How long a write waits for another job's write of the same DB (held for a read, a merge and a rename: well under
a second on a local disk); the wait is said on stderr when it starts."""
_SECTIONS = ("collectives", "gemms", "segments", "overheads", "rounds", "plan_checks")


def lock_path(path: str | Path) -> Path:
    """The lock file that serialises writers of the DB at ``path``: ``<key>.json.lock`` beside it (kept, empty)."""
    path = Path(path)
    return path.with_name(f"{path.name}.lock")


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Hold ``path``'s lock file (``flock``: released by the kernel when a holder dies, so it never goes stale)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ProfileDBError(f"{path.parent}: the ProfileDB folder cannot be created ({err.strerror or err}); "
                             f"nothing was written. Fix: point {CACHE_ENV} at a folder you can write "
                             "(it is created if missing).") from None
    lock = FileLock(lock_path(path), timeout=LOCK_TIMEOUT_S)
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:  # another job is storing: say so, then wait for it
            print(f"cfp: waiting for another job's write of {path} (lock {lock_path(path)}; at most "
                  f"{LOCK_TIMEOUT_S:.0f} s)", file=sys.stderr, flush=True)
            lock.acquire()
    except IsADirectoryError:
        raise ProfileDBError(f"{lock_path(path)}: the ProfileDB's lock file is a folder, so no job can take the lock; "
                             "nothing was written. Fix: move that folder away (cfp-megatron creates the lock as an "
                             f"empty file), or point {CACHE_ENV} at another folder.") from None
    except Timeout:
        raise ProfileDBError(f"{path}: another job held its lock {lock_path(path)} for {LOCK_TIMEOUT_S:.0f} s; "
                             "nothing was written. Fix: wait for that job to finish storing and run again (on a "
                             "network file system, check that it supports flock).") from None
    except OSError as err:  # read-only, no permission, a file in the way of the folder
        raise write_error(err, lock_path(path), CACHE_KEY) from None
    try:
        yield
    finally:
        lock.release()


def update_db(fingerprint: Fingerprint, change: Callable[[ProfileDB | None], ProfileDB], *,
              replace_unreadable: bool = False) -> tuple[Path, ProfileDB]:
    """Read-modify-write the stored DB of ``fingerprint`` under its lock: ``change`` gets the DB on disk now
    (``None`` when there is none) and returns the DB to write atomically; return the path and that DB. A stored file
    that cannot be used raises :class:`ProfileDBError`, or with ``replace_unreadable`` counts as absent."""
    path = db_path(fingerprint)
    with _locked(path):
        try:
            current = load_db(fingerprint)
        except ProfileDBError:
            if not replace_unreadable:
                raise
            current = None
        db = change(current)
        write_atomic(path, json.dumps(db.to_json(), indent=1), key=CACHE_KEY)
    return path, db


def _added(db: ProfileDB, base: ProfileDB | None, current: ProfileDB) -> dict[str, list[Any]]:
    """Per section, the records of ``db`` that ``base`` lacks (counted with repeats) and ``current`` lacks."""
    def key(record: Any) -> str:
        return json.dumps(record.to_json(), sort_keys=True)

    out: dict[str, list[Any]] = {}
    for name in _SECTIONS:
        seen = Counter(key(r) for r in getattr(base, name)) if base is not None else Counter()
        stored = {key(r) for r in getattr(current, name)}
        fresh = []
        for record in getattr(db, name):
            k = key(record)
            if seen[k] > 0:
                seen[k] -= 1
            elif k not in stored:
                fresh.append(record)
        out[name] = fresh
    return out


def store_db(db: ProfileDB, *, base: ProfileDB | None = None) -> Path:
    """Add this job's records to the DB stored now and return its path: those of ``db`` that ``base`` (the DB as the
    job read it; without it, every record) lacks are merged (:meth:`ProfileDB.merged`) into the file read under its
    lock, so concurrent jobs sharing the cache keep each other's entries; written atomically. A stored file that
    cannot be used is replaced."""
    def add(current: ProfileDB | None) -> ProfileDB:
        start = current if current is not None else ProfileDB(fingerprint=db.fingerprint)
        return start.merged(**_added(db, base, start))

    path, _ = update_db(db.fingerprint, add, replace_unreadable=True)
    return path


def export_db(db: ProfileDB, path: str | Path, *, key: str = "--export") -> Path:
    """Write a copy of ``db`` to a path the user chose (by ``key``), atomically; never over an existing file."""
    try:
        return write_new(path, json.dumps(db.to_json(), indent=1), key=key)
    except FileExistsError:
        raise ProfileDBError(f"{path}: exists; the ProfileDB is not written over a file you saved. "
                             "Fix: choose another path or delete the file.") from None


__all__ = ["SCHEMA_VERSION", "ProfileDB", "StepCalibration", "db_path", "export_db", "layout_family", "load_db",
           "lock_path", "read_db", "robust_ratio", "store_db", "update_db"]
