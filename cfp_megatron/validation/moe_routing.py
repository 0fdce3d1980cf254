"""How a MoE row's token routing reads: dropless, or token-drop with a capacity factor and padding, from the row's
``notes`` by the words of ``moe_routing.yaml`` beside this module (each entry with its source)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from cfp_megatron.validation.data import DATA_DIR, ValidationDataError, _entries, _Entry, _read

ROUTING_FILE = DATA_DIR / "moe_routing.yaml"
"""The routings and the words that name them."""


@dataclass(frozen=True, kw_only=True)
class Routing:
    """One way a MoE run routes its tokens (an entry of ``moe_routing.yaml``)."""

    name: str
    """The routing, as a person names it."""
    words: str
    """A regular expression (case-insensitive) the row's ``notes`` match."""
    capacity_factor: float | None
    """``model.moe_expert_capacity_factor``; ``None``: dropless."""
    pad_to_capacity: bool
    """``model.moe_pad_expert_input_to_capacity``."""
    tag: str
    """What the layout column shows for it; empty: nothing."""
    source: str
    """Where this comes from."""

    def model_fields(self, *, flex: bool = False) -> dict[str, Any]:
        """The ``model.*`` keys it sets. Under ``flex``, the flex dispatcher's DeepEP or a backend the preset does not
        name (Megatron-Core does not let DeepEP pad), a padded routing keeps its capacity unpadded: the same rows
        under the balanced routing the simulator assumes."""
        return {"moe_expert_capacity_factor": self.capacity_factor,
                "moe_pad_expert_input_to_capacity": self.pad_to_capacity and not flex}


@lru_cache(maxsize=4)
def load_routings(path: Path = ROUTING_FILE) -> tuple[tuple[Routing, ...], Routing]:
    """The entries of ``path`` in match order and the one a row whose notes name none runs as (``blank:``);
    :class:`ValidationDataError` names a malformed entry."""
    path = Path(path)
    data = _read(path)
    found = []
    for index, raw in enumerate(_entries(path, data, "routings")):
        entry = _Entry(path, index, raw, {"words", "capacity_factor", "pad_to_capacity", "tag"})
        factor = entry.get("capacity_factor", (int, float, type(None)))
        pad = entry.get("pad_to_capacity", bool)
        if factor is not None and not factor > 0:
            entry.fail(f"has capacity_factor={factor!r}; a positive number, or null (dropless)")
        if pad and factor is None:
            entry.fail("pads to capacity without a capacity_factor")
        found.append(Routing(name=raw["name"], words=entry.pattern("words"),
                             capacity_factor=None if factor is None else float(factor), pad_to_capacity=pad,
                             tag=entry.get("tag", str, ""), source=" ".join(raw["source"].split())))
    blank = next((routing for routing in found if routing.name == data.get("blank")), None)
    if blank is None:
        raise ValidationDataError(f"{path}: 'blank:' names no entry of the file. Fix: name the entry a row whose "
                                  "notes say nothing of its routing runs as.")
    return tuple(found), blank


def routing(row: dict, path: Path = ROUTING_FILE) -> Routing:
    """The routing a MoE ``row`` ran with: the first entry whose words its ``notes`` match, else the blank one."""
    entries, blank = load_routings(path)
    notes = row.get("notes") or ""
    return next((entry for entry in entries if re.search(entry.words, notes, re.IGNORECASE)), blank)
