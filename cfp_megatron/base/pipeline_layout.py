"""Megatron-Core's per-stage pipeline layouts (``pipeline_model_parallel_layout``), read without Megatron: the parse,
the checks Megatron-Core makes of a layout, and the balanced layout of a decoder whose layers do not divide.

Syntax (Megatron-Core's ``PipelineParallelLayerLayout.from_str``): stages separated by ``|``, listed in
virtual-pipeline order (stage ``c x pp + r`` is model chunk ``c`` of pipeline rank ``r``); ``E`` is the embedding,
``t`` a decoder layer, ``m`` a multi-token-prediction (MTP) layer, ``L`` the output layer and loss; ``x*N`` repeats
one character ``N`` times and ``(...)*N`` a group (groups do not nest); commas are cosmetic. DeepSeek-V3's
``Et*3|(tt|)*29,m|L`` is 32 stages: the embedding and three layers, 29 stages of two layers, the MTP layer alone,
the loss alone. :func:`layout_stages` expands a layout exactly as Megatron-Core does (the tests compare the two).

Megatron-Core requires the embedding to open the first stage and the loss to close the last (it builds them on the
first and the last chunk whatever the string says), every decoder layer before any MTP layer, and the MTP layers
together in one stage that is the last model chunk of its pipeline rank; :func:`layout_issues` says so before any
process group starts.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence

from cfp_megatron.base.errors import ConfigIssue

EMBEDDING, DECODER, MTP, LOSS = "E", "t", "m", "L"
"""The layer characters of a layout."""

_GROUP = re.compile(r"\(([^)]+)\)\*(\d+)")
"""A repeated group, ``(...)*N`` (Megatron-Core's first expansion)."""
_REPEAT = re.compile(r"(.)\*(\d+)")
"""A repeated character, ``x*N`` (its second)."""
MAX_UNITS = 1_000_000
"""The most characters a layout may expand to (a guard against a repeat count typed wrong)."""


class LayoutSyntaxError(ValueError):
    """A layout string that Megatron-Core cannot parse; the message says where."""


def _expand(pattern: re.Pattern[str], text: str) -> str:
    """``text`` with every match of ``pattern`` replaced by its first group repeated by its second, as ``re.sub``
    does, refusing an expansion past :data:`MAX_UNITS` characters before building it."""
    size = len(text) + sum(len(match.group(1)) * int(match.group(2)) - len(match.group(0))
                           for match in pattern.finditer(text))
    if size > MAX_UNITS:
        raise LayoutSyntaxError(f"it expands to {size:,} characters (at most {MAX_UNITS:,}); a repeat count is too "
                                "large")
    return pattern.sub(lambda match: match.group(1) * int(match.group(2)), text)


@functools.lru_cache(maxsize=1024)
def layout_stages(layout: str) -> tuple[str, ...]:
    """The stages of ``layout`` in virtual-pipeline order, each as its layer characters (``E``, ``t``, ``m``,
    ``L``) in order: Megatron-Core's ``PipelineParallelLayerLayout.parse_str_to_list`` without Megatron.

    Raises :class:`LayoutSyntaxError` for a character that is not a layer, ``|``, a repeat or a group."""
    text = _expand(_REPEAT, _expand(_GROUP, layout.replace(",", "")))
    bad = sorted({ch for ch in text if ch not in (EMBEDDING, DECODER, MTP, LOSS, "|")})
    if bad:
        raise LayoutSyntaxError(f"{''.join(bad)!r} after expanding the repeats is not a layer (E embedding, "
                                "t decoder layer, m MTP layer, L loss), '|' or a repeat 'x*N' / '(...)*N'")
    return tuple(text.split("|"))


def layout_issues(layout: str, pp: int, vpp: int, key: str = "parallel.pipeline_model_parallel_layout"
                  ) -> list[ConfigIssue]:
    """What Megatron-Core refuses in ``layout`` over ``pp`` pipeline ranks of ``vpp`` model chunks, before the
    model is known (its syntax, the stage count, where the embedding, the loss and the MTP layers sit), as
    :class:`~cfp_megatron.base.errors.ConfigIssue` values naming ``key``; :func:`layout_count_issues` checks the
    layer counts against the model."""

    def issue(problem: str, fix: str) -> list[ConfigIssue]:
        return [ConfigIssue(key=key, value=layout, problem=problem, fix=fix)]

    try:
        stages = layout_stages(layout)
    except LayoutSyntaxError as err:
        return issue(f"Megatron-Core cannot parse it: {err}.",
                     "write stages of E, t, m and L separated by '|', with x*N or (...)*N for repeats, e.g. "
                     "Et*3|t*2L.")
    found: list[ConfigIssue] = []
    if len(stages) != pp * vpp:
        found += issue(f"it has {len(stages)} stages; parallel.pp x parallel.vpp = {pp} x {vpp} = {pp * vpp} "
                       "model chunks need one stage each (in virtual-pipeline order).",
                       f"write {pp * vpp} stages separated by '|', or set parallel.vpp to the stage count divided "
                       f"by parallel.pp.")
    flat = "".join(stages)
    if flat.count(EMBEDDING) != 1 or not stages[0].startswith(EMBEDDING):
        found += issue("Megatron-Core needs the embedding (E) once, first in the first stage (it builds it on the "
                       "first model chunk).", "start the layout with E and write no other E.")
    if flat.count(LOSS) != 1 or not stages[-1].endswith(LOSS):
        found += issue("Megatron-Core needs the loss (L) once, last in the last stage (it builds the output layer "
                       "on the last model chunk).", "end the layout with L and write no other L.")
    mtp_stages = [index for index, stage in enumerate(stages) if MTP in stage]
    if mtp_stages:
        if DECODER in flat[flat.index(MTP):]:
            found += issue("Megatron-Core needs every decoder layer (t) before the first MTP layer (m).",
                           "move the m layers after the last t.")
        if len(mtp_stages) > 1:
            found += issue(f"the MTP layers sit in {len(mtp_stages)} stages; Megatron-Core builds them all in one.",
                           "write every m in one stage.")
        elif len(stages) == pp * vpp and mtp_stages[0] // pp != vpp - 1:
            found += issue(f"the MTP layers sit in stage {mtp_stages[0]}, model chunk {mtp_stages[0] // pp} of "
                           f"pipeline rank {mtp_stages[0] % pp}; Megatron-Core builds them only in a rank's last "
                           f"chunk (stages {(vpp - 1) * pp}..{vpp * pp - 1}).",
                           "move the m layers into one of the last pp stages.")
    return found


def layout_count_issues(layout: str, num_layers: int, mtp_layers: int,
                        key: str = "parallel.pipeline_model_parallel_layout") -> list[ConfigIssue]:
    """What is wrong with the decoder and MTP layer counts of a (parsable) ``layout`` for a model of ``num_layers``
    decoder layers and ``mtp_layers`` MTP layers (Megatron-Core's ``validate_layer_layout``)."""
    flat = "".join(layout_stages(layout))
    found = []
    if flat.count(DECODER) != num_layers:
        found.append(ConfigIssue(key=key, value=layout, problem=f"it places {flat.count(DECODER)} decoder layers "
                                 f"(t); model.num_layers={num_layers}.",
                                 fix=f"write {num_layers} t's over the stages."))
    if flat.count(MTP) != mtp_layers:
        found.append(ConfigIssue(key=key, value=layout, problem=f"it places {flat.count(MTP)} MTP layers (m); "
                                 f"model.mtp_num_layers={mtp_layers}.",
                                 fix=f"write {mtp_layers} m's before the final L." if mtp_layers
                                 else "remove the m's, or set model.mtp_num_layers."))
    return found


def uniform_partition(items: int, parts: int) -> list[int]:
    """``items`` spread as evenly as possible over ``parts`` parts, the first ``items mod parts`` holding one more:
    the part sizes of Megatron-DeepSpeed's uniform partition (DeepSpeed's ``partition_uniform``)."""
    each, extra = divmod(items, parts)
    return [each + (index < extra) for index in range(parts)]


@functools.lru_cache(maxsize=4096)
def balanced_layout(num_layers: int, pp: int, vpp: int, *, mtp_layers: int = 0, ends_counted: bool = False) -> str:
    """The layout that spreads the decoder as evenly as possible over ``pp x vpp`` model chunks in
    virtual-pipeline order (:func:`uniform_partition`: the first chunks hold one layer more), the embedding opening
    the first chunk and the ``mtp_layers`` MTP layers and the loss closing the last.

    ``ends_counted``: the embedding, each MTP layer and the loss count as one layer each in the spread (as
    Megatron-Bridge's DeepSeek-V3 recipe at PP=8 x VP=4 writes ``Et|(tt|)*30mL``); the MTP layers stay with the
    loss in the last chunk."""
    chunks = pp * vpp
    if ends_counted:
        counts = uniform_partition(num_layers + mtp_layers + 2, chunks)
        counts[0] -= 1  # the embedding's unit
        counts[-1] -= mtp_layers + 1  # the MTP layers' and the loss's
        # A chunk whose units the ends took all of (or more) passes the shortfall on to its neighbours.
        for index in range(chunks - 1, 0, -1):
            if counts[index] < 0:
                counts[index - 1] += counts[index]
                counts[index] = 0
        for index in range(chunks - 1):
            if counts[index] < 0:
                counts[index + 1] += counts[index]
                counts[index] = 0
    else:
        counts = uniform_partition(num_layers, chunks)
    stages = [DECODER * count for count in counts]
    stages[0] = EMBEDDING + stages[0]
    stages[-1] += MTP * mtp_layers + LOSS
    return compact_layout(stages)


def compact_layout(stages: Sequence[str]) -> str:
    """``stages`` (each its layer characters) as a layout string: runs of three or more equal characters as
    ``x*N``, runs of equal stages as ``(stage|)*N``, so that :func:`layout_stages` gives ``stages`` back."""
    def stage_text(stage: str) -> str:
        return re.sub(r"(.)\1{2,}", lambda run: f"{run.group(1)}*{len(run.group(0))}", stage)

    runs: list[tuple[str, int]] = []
    for stage in stages:
        if runs and runs[-1][0] == stage:
            runs[-1] = (stage, runs[-1][1] + 1)
        else:
            runs.append((stage, 1))
    parts = []
    for index, (stage, count) in enumerate(runs):
        text, last = stage_text(stage), index == len(runs) - 1
        if count == 1:
            parts.append(text if last else f"{text}|")
        elif last:  # the closing stage stays outside the group (no '|' after it)
            parts.append((f"({text}|)*{count - 1}" if count > 2 else f"{text}|") + text)
        else:
            parts.append(f"({text}|)*{count}")
    return "".join(parts)
