"""The ProfileDB: what profiling measured on one cluster, as versioned JSON keyed by its :class:`Fingerprint`.

One file per fingerprint under ``$CFP_CACHE_DIR/profile/<fingerprint key>.json``; a run on the same hardware and
software finds it by its key and reuses it, a run with another fingerprint never opens it (another key), and a file
whose stored fingerprint or schema does not match is refused with a typed error. Writes are atomic (temporary file +
rename). The DB implements :class:`~cfp_megatron.cluster.measured.Measurements`, the simulator's only view of it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.cluster.measured import Collective, CollectiveFit, Span
from cfp_megatron.profile.errors import FingerprintMismatchError, ProfileDBError, SchemaVersionError
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.gemm_table import interpolate_tflops
from cfp_megatron.profile.records import (
    CollectiveRecord,
    GemmRecord,
    RoundRecord,
    RoundStatus,
    SegmentRecord,
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
    rounds: tuple[RoundRecord, ...] = ()
    """Every round of every run that wrote this DB, in order, with how it ended."""
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

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        """(forward, backward) seconds of a segment class under ``partition`` (``tp<N>``) at ``micro_batch``.

        ``segment`` is the class id of the analysis JSON, or a layer kind (``embedding``, ``dense``, ``moe``,
        ``head``) of the model chosen with :meth:`for_model` (or of the only model in the DB).
        """
        models = {r.model for r in self.segments}
        kind_model = self.model if self.model is not None else (next(iter(models)) if len(models) == 1 else None)
        for rec in reversed(self.segments):  # the newest measurement wins
            if rec.partition != partition or rec.micro_batch != micro_batch:
                continue
            if rec.segment == segment or (rec.kind == segment and rec.model == kind_model):
                return rec.forward_s, rec.backward_s
        return None

    # ------------------------------------------------------------------------------------------------ queries
    def for_model(self, model: str) -> ProfileDB:
        """The same DB with kind names resolving against ``model`` (a :func:`model_key`)."""
        return dataclasses.replace(self, model=model)

    def has_segments(self, model: str, tp: int, micro_batch: int) -> bool:
        """Whether segment times of ``model`` under ``tp`` at ``micro_batch`` are stored."""
        return any(r.model == model and r.tp == tp and r.micro_batch == micro_batch for r in self.segments)

    def round_complete(self, name: str) -> bool:
        """Whether a round called ``name`` has ended ``ok`` in some run."""
        return any(r.name == name and r.status is RoundStatus.ok for r in self.rounds)

    # ---------------------------------------------------------------------------------------------- updates
    def merged(self, *, collectives: Iterable[CollectiveRecord] = (), gemms: Iterable[GemmRecord] = (),
               segments: Iterable[SegmentRecord] = (), rounds: Iterable[RoundRecord] = ()) -> ProfileDB:
        """A new DB with these records added; a new record replaces an old one with the same key."""
        def merge(old: tuple, new: Iterable, key: Any) -> tuple:
            fresh = list(new)
            keys = {key(r) for r in fresh}
            return tuple([r for r in old if key(r) not in keys] + fresh)

        return dataclasses.replace(
            self,
            collectives=merge(self.collectives, collectives, lambda r: (r.fit.op, r.fit.group_size, r.fit.span)),
            gemms=merge(self.gemms, gemms, lambda r: (r.m, r.n, r.k, r.dtype)),
            segments=merge(self.segments, segments, lambda r: (r.model, r.segment, r.kind, r.partition,
                                                               r.micro_batch)),
            rounds=self.rounds + tuple(rounds))

    # ------------------------------------------------------------------------------------------------- JSON
    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"schema_version": self.schema_version, "fingerprint": self.fingerprint.to_json(),
                "fingerprint_key": self.fingerprint.key,
                "collectives": [r.to_json() for r in self.collectives], "gemms": [r.to_json() for r in self.gemms],
                "segments": [r.to_json() for r in self.segments], "rounds": [r.to_json() for r in self.rounds]}

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
                       collectives=tuple(CollectiveRecord.from_json(r) for r in data["collectives"]),
                       gemms=tuple(GemmRecord.from_json(r) for r in data["gemms"]),
                       segments=tuple(SegmentRecord.from_json(r) for r in data["segments"]),
                       rounds=tuple(RoundRecord.from_json(r) for r in data["rounds"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ProfileDBError(f"{source}: malformed ProfileDB ({type(err).__name__}: {err}). "
                                 "Fix: profile again with --force.") from None


# --------------------------------------------------------------------------------------------------- storage
def db_path(fingerprint: Fingerprint) -> Path:
    """Where the DB of ``fingerprint`` lives: ``$CFP_CACHE_DIR/profile/<key>.json``."""
    from cfp_megatron.model.cache import cache_dir

    return cache_dir() / SECTION / f"{fingerprint.key}.json"


def read_db(path: str | Path, *, expected: Fingerprint | None = None) -> ProfileDB:
    """Read the DB at ``path``; with ``expected``, refuse one measured elsewhere (:class:`FingerprintMismatchError`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
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


def _atomic_write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def store_db(db: ProfileDB) -> Path:
    """Write ``db`` to its cache path atomically (the cache file of the same fingerprint is replaced); return it."""
    path = db_path(db.fingerprint)
    _atomic_write(path, json.dumps(db.to_json(), indent=1))
    return path


def export_db(db: ProfileDB, path: str | Path, *, overwrite: bool = False) -> Path:
    """Write a copy of ``db`` to a path the user chose; an existing file is kept unless ``overwrite``."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise ProfileDBError(f"{path}: exists; the ProfileDB is not written over a file you saved. "
                             "Fix: choose another path or delete the file.")
    _atomic_write(path, json.dumps(db.to_json(), indent=1))
    return path


def empty_db(fingerprint: Fingerprint) -> ProfileDB:
    """A DB with nothing measured yet."""
    return ProfileDB(fingerprint=fingerprint)


__all__ = ["SCHEMA_VERSION", "ProfileDB", "db_path", "empty_db", "export_db", "load_db", "read_db",
           "store_db"]
