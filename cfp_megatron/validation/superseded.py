"""Rows whose measurement their own source superseded (``superseded.yaml`` beside this module): the same layout and
settings re-measured by the same source. They are predicted and printed, in a section of their own, but set apart
from the headline MAPE, the class figures and the out-of-sample bands (docs/validation.md, "Rows their source
superseded")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.validation.data import DATA_DIR, ValidationDataError, _entries, _Entry, _read
from cfp_megatron.validation.results import RowResult
from cfp_megatron.validation.rows import RowError, count_cell, figure_cell

SUPERSEDED_FILE = DATA_DIR / "superseded.yaml"
"""The superseded rows, each with its re-measurement and source."""

FIGURE_COLUMNS = ("tokens_per_s_per_gpu", "step_time_s", "derived_step_time_s", "tflops_per_gpu")
"""Columns an entry may name as the row's figure."""


@dataclass(frozen=True, kw_only=True)
class Superseded:
    """One row its source re-measured (an entry of ``superseded.yaml``)."""

    name: str
    """The run, as a person names it."""
    row: str
    """The row's ``id``."""
    row_source: str
    """Text the row's ``source`` column contains: a row of another source with the same id is not this run."""
    figure_column: str
    """The column holding the row's figure (:data:`FIGURE_COLUMNS`)."""
    measured: float
    """The row's figure, as the entry read it from the source."""
    container: str
    """The container the row's figure was measured in."""
    same: tuple[tuple[str, int | str], ...]
    """(column, value) the re-measurement states alike, as the row has them."""
    remeasured_container: str
    """The container of the re-measurement."""
    remeasured: float
    """The re-measured figure (the unit of :attr:`measured`)."""
    where: str
    """The file, commit and lines of both figures."""
    source: str
    """Where this comes from."""

    @property
    def reason(self) -> str:
        """What the report says of the row."""
        return (f"superseded by its source: the same layout and settings ({', '.join(f'{k} {v}' for k, v in self.same)}"
                f") re-measured in the {self.remeasured_container} container at {self.remeasured:g} "
                f"{self.figure_column} against this row's {self.measured:g} ({self.container}; "
                f"{self.remeasured / self.measured:.2f}x); {self.where}")


def _number(entry: _Entry, value: object, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        entry.fail(f"has {key}={value!r}, not a positive number")
    return float(value)


def load_superseded(path: Path = SUPERSEDED_FILE) -> tuple[Superseded, ...]:
    """The entries of ``path``; :class:`ValidationDataError` names a malformed one (an unknown or missing key, a
    figure that is not a positive number, two entries for one row)."""
    path = Path(path)
    found: list[Superseded] = []
    keys = {"row", "row_source", "figure_column", "measured", "container", "same", "remeasured", "where"}
    for index, raw in enumerate(_entries(path, _read(path), "superseded")):
        entry = _Entry(path, index, raw, keys)
        row = entry.get("row", str).strip()
        if not row:
            entry.fail("has a blank row id")
        if any(other.row == row for other in found):
            entry.fail(f"names row {row}, which an earlier entry names too")
        column = entry.get("figure_column", str)
        if column not in FIGURE_COLUMNS:
            entry.fail(f"has figure_column={column!r}, not one of {', '.join(FIGURE_COLUMNS)}")
        same = entry.get("same", dict)
        if not same or not all(isinstance(k, str) and isinstance(v, (int, str)) and not isinstance(v, bool)
                               for k, v in same.items()):
            entry.fail(f"has same={same!r}; it maps each column the re-measurement states alike to its value")
        again = entry.get("remeasured", dict)
        if sorted(again) != ["container", "figure"] or not isinstance(again["container"], str):
            entry.fail(f"has remeasured={again!r}; it gives the container (text) and the figure")
        texts = {key: entry.get(key, str).strip() for key in ("row_source", "container", "where")}
        if not all(texts.values()):
            entry.fail(f"leaves {', '.join(k for k, v in texts.items() if not v)} blank")
        found.append(Superseded(
            name=raw["name"], row=row, row_source=texts["row_source"], figure_column=column,
            measured=_number(entry, entry.get("measured", (int, float)), "measured"), container=texts["container"],
            same=tuple(same.items()), remeasured_container=again["container"].strip(),
            remeasured=_number(entry, again["figure"], "remeasured.figure"), where=" ".join(texts["where"].split()),
            source=" ".join(raw["source"].split())))
    return tuple(found)


def _mismatch(entry: Superseded, row: dict) -> str | None:
    """What of ``row`` differs from what ``entry`` says of it (``None``: nothing)."""
    try:
        figure = figure_cell(row, entry.figure_column)
        if figure != entry.measured:
            return f"{entry.figure_column}={row.get(entry.figure_column)!r} where the entry says {entry.measured:g}"
        if entry.container not in (row.get("source_detail") or "").split():
            return f"source_detail={row.get('source_detail')!r} does not name the container {entry.container}"
        for column, value in entry.same:
            have = (count_cell(row, column) if isinstance(value, int)
                    else (row.get(column) or "").strip().lower())
            if have != (value if isinstance(value, int) else value.strip().lower()):
                return f"{column}={row.get(column)!r} where the entry says {value!r}"
    except RowError as err:
        return str(err)
    return None


def set_apart(results: list[RowResult], rows_by_id: dict[str, dict], path: Path | None = None) -> dict[str, str]:
    """Row id -> reason, for each modelled row an entry of ``path`` (default :data:`SUPERSEDED_FILE`) names (its id,
    and its source containing the entry's ``row_source``). :class:`ValidationDataError` where such a row differs
    from the entry (its figure, its container, a column of ``same``): the entry then does not describe that row."""
    path = Path(path) if path is not None else SUPERSEDED_FILE
    entries = {entry.row: entry for entry in load_superseded(path)}
    found: dict[str, str] = {}
    for result in results:
        entry = entries.get(result.plan.row_id)
        row = rows_by_id.get(result.plan.row_id, {})
        if entry is None or entry.row_source not in (row.get("source") or ""):
            continue
        problem = _mismatch(entry, row)
        if problem is not None:
            raise ValidationDataError(f"{path}: entry {entry.name!r} names row {entry.row}, but that row has "
                                      f"{problem}. Fix: correct the entry (or the row), or remove the entry.")
        found[result.plan.row_id] = entry.reason
    return found
