"""``data.path`` as Megatron writes a data blend: prefixes only (``[p1, p2]``: blended in proportion to the tokens
of their training splits), or weight-prefix pairs (``[w1, p1, w2, p2]``, Megatron-LM's ``--data-path`` form: blended
in proportion to the weights). Read here once, with the reason where the list is neither."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from cfp_megatron.base.errors import ConfigIssue

KEY = "data.path"
"""The setting the blend comes from."""

_NUMBER = re.compile(r"\s*[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?\s*")
"""An entry that reads as a weight (a prefix is a path: it never looks like a bare number)."""
_PERCENT = re.compile(r"\s*[-+]?(\d+(\.\d*)?|\.\d+)\s*%\s*")
"""A weight written as a percentage, which Megatron does not read as one."""


@dataclass(frozen=True, kw_only=True)
class Blend:
    """The datasets of ``data.path`` and their weights."""

    prefixes: tuple[str, ...]
    """Dataset prefixes (``prefix.bin``/``prefix.idx``), in the order given."""
    weights: tuple[float, ...] | None
    """Each prefix's weight as given (Megatron normalises them); ``None``: in proportion to their tokens."""


def _is_weight(entry: str) -> bool:
    return _NUMBER.fullmatch(entry) is not None


def read_blend(entries: list[str] | tuple[str, ...]) -> tuple[Blend, list[ConfigIssue]]:
    """The blend ``entries`` (``data.path``) give, and the issues that keep it from being read as one: weights that
    do not pair with a prefix each, a weight that is not a positive finite number, a prefix given twice."""
    entries = [str(entry) for entry in entries]
    example = "data.path=[30,/data/web_text_document,70,/data/books_text_document]"
    issues: list[ConfigIssue] = []
    percents = [entry for entry in entries if _PERCENT.fullmatch(entry)]
    if percents:  # read as weights, so the pairs are checked too; said once
        issues.append(ConfigIssue(key=KEY, value=entries, problem=f"gives weights as percentages ("
                                  f"{', '.join(percents)}): Megatron's weights are plain numbers (it normalises them).",
                                  fix=f"drop the % signs, e.g. {example}."))
        entries = [entry.replace("%", "") if _PERCENT.fullmatch(entry) else entry for entry in entries]
    numeric = [_is_weight(entry) for entry in entries]
    if not any(numeric):
        blend = Blend(prefixes=tuple(entries), weights=None)
    elif len(entries) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        weights = tuple(float(entry) for entry in entries[0::2])
        blend = Blend(prefixes=tuple(entries[1::2]), weights=weights)
        for weight, prefix in zip(weights, blend.prefixes, strict=True):
            if not (math.isfinite(weight) and weight > 0):
                issues.append(ConfigIssue(
                    key=KEY, value=entries, problem=f"the weight {weight:g} of {prefix} is not a positive number "
                    "(Megatron samples each dataset in proportion to its weight, and none from one of weight 0).",
                    fix=f"give {prefix} a positive weight, or remove the pair from the list."))
    else:
        shown = ", ".join(entry for entry, is_number in zip(entries, numeric, strict=True) if is_number)
        issues.append(ConfigIssue(
            key=KEY, value=entries, problem=f"mixes weights ({shown}) and prefixes without pairing each weight with "
            f"the prefix after it ({len(entries)} entries): it is neither a list of prefixes nor Megatron's "
            "[weight, prefix, weight, prefix, ...] blend.",
            fix=f"give prefixes only (blended by their sizes), or a weight before every prefix, e.g. {example}."))
        blend = Blend(prefixes=tuple(entry for entry, is_number in zip(entries, numeric, strict=True)
                                     if not is_number), weights=None)
    seen: dict[str, str] = {}
    for prefix in blend.prefixes:
        same = os.path.normpath(prefix)
        if same in seen:
            issues.append(ConfigIssue(
                key=KEY, value=entries, problem=f"names the dataset {prefix} twice"
                + (f" (also as {seen[same]})" if seen[same] != prefix else "") + ": it would be blended in twice.",
                fix="give each prefix once (to read one dataset more often, give it a larger weight: "
                    f"{example})."))
        seen.setdefault(same, prefix)
    return blend, issues
