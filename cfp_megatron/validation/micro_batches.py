"""Micro-batch sizes a row's source states outside its tables (its run scripts), by ``micro_batches.yaml`` beside this
module (each entry with its source): what a blank ``micro_batch`` of such a row reads as."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from cfp_megatron.validation.data import DATA_DIR, _entries, _Entry, _read

MICRO_BATCHES_FILE = DATA_DIR / "micro_batches.yaml"
"""The stated micro-batch sizes."""


@dataclass(frozen=True, kw_only=True)
class StatedMicroBatch:
    """One entry of ``micro_batches.yaml``."""

    name: str
    """What the entry covers, as a person names it."""
    source_words: str
    """A regular expression (case-insensitive) the row's ``source`` matches."""
    model_words: str
    """A regular expression (case-insensitive) the row's ``model`` matches."""
    micro_batch: int
    """The micro-batch size (sequences) the source's script sets."""
    source: str
    """Where this comes from."""


@lru_cache(maxsize=4)
def load_micro_batches(path: Path = MICRO_BATCHES_FILE) -> tuple[StatedMicroBatch, ...]:
    """The entries of ``path`` in match order; :class:`~cfp_megatron.validation.data.ValidationDataError` names a
    malformed entry."""
    path = Path(path)
    found = []
    for index, raw in enumerate(_entries(path, _read(path), "micro_batches")):
        entry = _Entry(path, index, raw, {"source_words", "model_words", "micro_batch"})
        micro = entry.get("micro_batch", int)
        if micro < 1:
            entry.fail(f"has micro_batch={micro!r}; a whole number of sequences, at least 1")
        found.append(StatedMicroBatch(name=raw["name"], source_words=entry.pattern("source_words"),
                                      model_words=entry.pattern("model_words"), micro_batch=micro,
                                      source=" ".join(raw["source"].split())))
    return tuple(found)


def stated_micro_batch(row: dict, path: Path = MICRO_BATCHES_FILE) -> int | None:
    """The micro-batch the first entry that ``row``'s ``source`` and ``model`` match states; ``None``: none does."""
    source, model = row.get("source") or "", (row.get("model") or "").strip()
    return next((entry.micro_batch for entry in load_micro_batches(path)
                 if re.search(entry.source_words, source, re.IGNORECASE)
                 and re.search(entry.model_words, model, re.IGNORECASE)), None)
