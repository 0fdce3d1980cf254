"""The row reader of ``python -m cfp_megatron.validate``: runs files in the schema of the published runs that ship
with the package (:data:`PUBLISHED_RUNS`) read into rows, and each cell read as what its column holds (a count, a
measured figure, yes/no, a power limit), with the reason where it cannot be."""

from __future__ import annotations

import csv
import difflib
import math
import re
from pathlib import Path

from cfp_megatron.base.config import (
    MAX_EXPERTS,
    MAX_FFN,
    MAX_GLOBAL_BATCH,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_MICROBATCHES,
    MAX_SEQUENCE,
    MAX_VOCAB,
    MAX_WORLD_SIZE,
)
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import regular_file_problem


class RowError(CfpError, ValueError):
    """A row cannot be modelled; the message says why."""


COLUMNS = ("id", "source", "source_detail", "source_location", "model", "arch_type", "params_b", "layers", "hidden",
           "ffn_hidden", "heads", "kv_heads", "vocab", "seq_len", "moe_experts", "moe_topk", "moe_expert_ffn", "gpu",
           "num_gpus", "interconnect", "framework", "tp", "pp", "dp", "cp", "ep", "vp", "pp_schedule",
           "sequence_parallel", "zero_or_fsdp", "micro_batch", "global_batch_seqs", "grad_accum", "recompute",
           "precision", "step_time_s", "tokens_per_s_per_gpu", "tflops_per_gpu", "mfu_pct", "hfu_pct",
           "other_measured", "derived_step_time_s", "derived_fields", "arch_source", "notes")
"""The columns of the runs schema (:data:`SCHEMA_FILE`), in its order."""
PUBLISHED_RUNS_DIR = Path(__file__).resolve().parent / "published_runs"
"""The published runs that ship with the package, with a README naming their sources (copies of the project's
shared data folder: tests/test_validate.py checks they are identical where it exists)."""
PUBLISHED_RUNS = (PUBLISHED_RUNS_DIR / "published_runs.csv", PUBLISHED_RUNS_DIR / "published_runs_moe.csv")
"""What ``validate`` reads without a file: the dense, long-sequence and FSDP runs, then the MoE runs."""
SCHEMA_FILE = "cfp_megatron/validation/published_runs/published_runs.csv"
"""The runs file whose columns are the schema, as messages name it."""
REQUIRED_COLUMNS = ("id", "layers", "hidden", "heads", "seq_len", "gpu", "num_gpus")
"""Columns without which no row of a file can be modelled."""


class InputFileError(CfpError, ValueError):
    """A file ``validate`` cannot read as runs; the message names the file and the fix."""


class CsvRow(dict):
    """One row of a runs file: its columns' text (a dict, as :class:`csv.DictReader` gives it) and where it was
    read, for the reasons and the report."""

    def __init__(self, values: dict[str, str], *, file: Path, line: int, problem: str | None = None) -> None:
        super().__init__(values)
        self.file = file
        """The file."""
        self.line = line
        """The line the row starts on (1 is the header)."""
        self.problem = problem
        """Why the row's fields do not line up with the header (too many or too few), else ``None``."""


def where(row: dict) -> str:
    """Where a row was read (``runs.csv line 5``), or ``row <id>`` for a row built in code."""
    if isinstance(row, CsvRow):
        return f"{row.file} line {row.line}"
    return f"row {row.get('id', '?')}"


def _header(path: Path, names: list[str], fix: str) -> list[str]:
    """The header's column names, stripped; :class:`InputFileError` for a name given twice, or one that is not in
    the schema but close to a schema column the file lacks (a misspelt column would leave its value unread)."""
    columns = [name.strip() for name in names]
    for index, name in enumerate(columns):
        if name and name in columns[:index]:
            raise InputFileError(f"{path}: column {name!r} appears twice in the header (columns "
                                 f"{columns.index(name) + 1} and {index + 1}); keep one. {fix}")
    for name in unread_columns(columns):
        near = difflib.get_close_matches(name.lower(), [c for c in COLUMNS if c not in columns], n=1, cutoff=0.75)
        if near:
            raise InputFileError(f"{path}: column {name!r} is not in the runs schema, so its values would not be "
                                 f"read; rename it {near[0]!r}. {fix}")
    return columns


def unread_columns(columns: list[str]) -> list[str]:
    """The header names of ``columns`` that are not in the runs schema (:data:`COLUMNS`), blank names left out."""
    return [name for name in columns if name and name not in COLUMNS]


def read_rows(path: str | Path) -> list[dict]:
    """Rows of a CSV file as :class:`CsvRow` dicts (a UTF-8 byte-order mark, as spreadsheets write it, is skipped;
    header names are stripped). Raises :class:`InputFileError` for a file that is missing, a directory, not text,
    empty, without the columns a run needs (:data:`REQUIRED_COLUMNS`), or whose header names a column twice or
    misspells one (:func:`_header`). A row whose fields do not line up with the header is returned with its
    :attr:`CsvRow.problem` (and refused by :func:`predict_rows`)."""
    path = Path(path)
    fix = f"pass a CSV file in the schema of {SCHEMA_FILE}."
    if not path.is_file():  # a named pipe or device is refused too, not waited on
        said = "is a directory" if path.is_dir() else "no such file" if not path.exists() else \
            str(regular_file_problem(path)).removesuffix(".")
        raise InputFileError(f"{path}: {said}; {fix}")
    rows: list[dict] = []
    try:
        with open(path, newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            columns = _header(path, next(reader, []), fix)
            last = reader.line_num
            for fields in reader:
                line, last = last + 1, reader.line_num
                if not any(field.strip() for field in fields):
                    continue
                problem = None if len(fields) == len(columns) else (
                    f"{path} line {line} has {len(fields)} fields where the header has {len(columns)} (a comma inside "
                    "an unquoted value, or a field left out). Fix: quote the value, or add the missing fields")
                rows.append(CsvRow(dict(zip(columns, fields, strict=False)), file=path, line=line, problem=problem))
    except (UnicodeDecodeError, csv.Error) as err:
        raise InputFileError(f"{path}: not a readable CSV text file ({err}); {fix}") from None
    missing = [name for name in REQUIRED_COLUMNS if name not in columns]
    separator = next((name for sign, name in (("\t", "tabs"), (";", "semicolons"), ("|", "bars"))
                      if len(columns) == 1 and sign in columns[0]), None)
    if missing and separator:  # one header field holding every name: another separator than the comma
        raise InputFileError(f"{path}: the header is one field of names separated by {separator}, not commas: "
                             f"validate reads comma-separated values. Fix: save the file as CSV (comma-separated); "
                             f"{fix}")
    if missing:
        raise InputFileError(f"{path}: no column {', '.join(missing)}; {fix}")
    if not rows:
        raise InputFileError(f"{path}: a header and no rows; {fix}")
    return rows


POWER_WORDS = r"power|cap|limit|watt|tdp|tgp|board"
"""Words that make a wattage in a row's notes a statement of the GPUs' power (:func:`power_limit`)."""


def power_limit(row: dict) -> float | None:
    """The GPUs' power limit in watts a row states, or None: a wattage (``500 W``, ``450W``) in its ``gpu`` column,
    or in ``notes``, ``source_detail`` or ``other_measured`` within a few words of "power", "cap", "limit", "TDP"...
    A figure at or above the preset's TDP changes nothing (the clock is capped at its maximum)."""
    watts = r"(\d{3,4}(?:\.\d+)?)\s*W\b"
    found = re.search(watts, row.get("gpu") or "")
    for column in ("notes", "source_detail", "other_measured"):
        if found:
            break
        text = row.get(column) or ""
        found = (re.search(rf"(?:{POWER_WORDS})\w*\W+(?:\w+\W+){{0,4}}?{watts}", text, re.IGNORECASE)
                 or re.search(rf"{watts}\W+(?:\w+\W+){{0,2}}?(?:{POWER_WORDS})", text, re.IGNORECASE))
    return float(found.group(1)) if found else None


COUNT_COLUMNS: dict[str, tuple[str, int, str]] = {
    "num_gpus": ("GPUs", MAX_WORLD_SIZE, "MAX_WORLD_SIZE"), "layers": ("layers", MAX_LAYERS, "MAX_LAYERS"),
    "hidden": ("a hidden size", MAX_HIDDEN, "MAX_HIDDEN"), "ffn_hidden": ("an MLP size", MAX_FFN, "MAX_FFN"),
    "heads": ("heads", MAX_HEADS, "MAX_HEADS"), "kv_heads": ("key/value heads", MAX_HEADS, "MAX_HEADS"),
    "vocab": ("a vocabulary", MAX_VOCAB, "MAX_VOCAB"), "seq_len": ("tokens", MAX_SEQUENCE, "MAX_SEQUENCE"),
    "moe_experts": ("experts", MAX_EXPERTS, "MAX_EXPERTS"), "moe_topk": ("experts", MAX_EXPERTS, "MAX_EXPERTS"),
    "moe_expert_ffn": ("an expert MLP size", MAX_FFN, "MAX_FFN"),
    **{name: ("ranks", MAX_WORLD_SIZE, "MAX_WORLD_SIZE") for name in ("tp", "pp", "dp", "cp", "ep", "vp")},
    "micro_batch": ("sequences", MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
    "global_batch_seqs": ("sequences", MAX_GLOBAL_BATCH, "MAX_GLOBAL_BATCH"),
    "grad_accum": ("micro-batches", MAX_MICROBATCHES, "MAX_MICROBATCHES"),
}
"""Columns that hold a count, with what they count and their largest value: the training config's own bound
(:mod:`cfp_megatron.base.config`, named here for the message)."""


def count_cell(row: dict, key: str, default: int | None = None) -> int | None:
    """A count column of the row (:data:`COUNT_COLUMNS`): ``default`` where blank; :class:`RowError` naming the
    column, the value and the fix where it is not a whole number from 1 to its bound (32.5 GPUs are not modelled as
    32; a count above the training config's bound is a typo, not a run)."""
    raw = (row.get(key) or "").strip()
    if not raw:
        return default
    what, bound, name = COUNT_COLUMNS.get(key, ("a count", MAX_WORLD_SIZE, "MAX_WORLD_SIZE"))
    try:
        value = float(raw)
    except ValueError:
        raise RowError(f"column {key} is not a number: {raw!r}. Fix: write a whole number of {what}, or leave it "
                       "blank") from None
    if not math.isfinite(value) or value != int(value):
        raise RowError(f"column {key}={raw}: a count of {what} is a whole number. Fix: correct the row")
    if not 1 <= value <= bound:
        raise RowError(f"column {key}={raw}: must be from 1 to {bound:,} ({name} in cfp_megatron/base/config.py). "
                       "Fix: correct the row, or leave the column blank where the row does not state it")
    return int(value)


EXPERT_COLUMNS = ("moe_topk", "moe_expert_ffn")
"""Columns a MoE row must state besides ``moe_experts``: each token's experts and each expert's MLP size set the
experts' compute and memory, and Megatron's defaults for them (2 experts, the dense ``ffn_hidden``) describe no
published model in particular."""


def experts_cell(row: dict) -> int | None:
    """The row's ``moe_experts`` (``None`` for a dense row); :class:`RowError` for a MoE row leaving an
    :data:`EXPERT_COLUMNS` column blank, and for a row stating experts' fields (``moe_topk``, ``moe_expert_ffn``,
    ``ep`` above 1, ``arch_type`` MoE) without ``moe_experts`` (modelled dense it would not be what ran)."""
    experts = count_cell(row, "moe_experts")
    if experts:
        blank = [column for column in EXPERT_COLUMNS if not (row.get(column) or "").strip()]
        if blank:
            raise RowError(f"a MoE row (moe_experts={experts}) with {' and '.join(blank)} blank: they set the "
                           "experts' compute and memory. Fix: give the experts per token (moe_topk) and each "
                           "expert's MLP size (moe_expert_ffn)")
        return experts
    stated = [f"{column}={(row.get(column) or '').strip()}" for column in EXPERT_COLUMNS
              if (row.get(column) or "").strip()]
    stated += [f"ep={row['ep'].strip()}"] if (count_cell(row, "ep") or 1) > 1 else []
    stated += [f"arch_type={row['arch_type'].strip()}"] if "moe" in (row.get("arch_type") or "").lower() else []
    if stated:
        raise RowError(f"states experts ({', '.join(stated)}) but moe_experts is blank: modelled as a dense model it "
                       "would not be the run. Fix: give moe_experts, or clear the experts' columns of a dense run")
    return None


def figure_cell(row: dict, key: str) -> float | None:
    """A measured figure of the row: ``None`` where blank; :class:`RowError` naming the column where it is not a
    finite positive number (a negative, zero, NaN or text step time never enters the MAPE)."""
    raw = (row.get(key) or "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise RowError(f"column {key} is not a number: {raw!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise RowError(f"column {key} must be a finite positive number, not {raw!r}")
    return value


NO_WORDS = frozenset({"no", "n", "none", "not", "n/a", "na", "false", "off", "0", "disabled", "without", "-"})
"""First words of a yes/no cell that say no (:func:`yes_cell`)."""
UNSTATED_WORDS = frozenset({"unknown", "unstated", "?"})
"""First words of a yes/no cell that state nothing, read as blank."""


def yes_cell(raw: str) -> bool | None:
    """A yes/no cell: ``None`` where blank or unstated (``unknown``, ``?``), ``False`` where its first word says no
    (:data:`NO_WORDS`: ``no``, ``none``, ``off``, ``false``, ``0`` ...), else ``True``: a cell that names the
    setting in its own words (``SequenceParallel norms``, ``SP``, ``enabled``) states it on."""
    words = re.findall(r"[a-z0-9/?-]+", raw.strip().lower())
    if not words or words[0] in UNSTATED_WORDS:
        return None
    return words[0] not in NO_WORDS
