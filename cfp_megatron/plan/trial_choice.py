"""Which of a search's top plans a launch measures by trials (``cfp.trials``), and which of the measured it trains.

Pure: the plans come with their predictions (the chosen one first, then the others fastest first, as
:class:`~cfp_megatron.backends.protocol.PlannedSearch` hands them), the measurements as the trials took them.
Why and how: docs/planning.md, "Trials at launch".
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from cfp_megatron.base.cfp_spec import AUTO_TRIALS
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.search.choice import inside_band


def layout(plan: Plan) -> tuple[object, ...]:
    """What makes two plans different layouts: the parallel sizes, sequence parallelism, the MLP's partition and the
    micro-batch size (not recomputation, the optimizer's sharding or the overlaps, which a trial of a few steps
    tells apart less than the model does)."""
    p = plan.parallel
    return (p.tp, p.sp, p.pp, p.vpp, p.cp, p.ep, p.etp, p.mlp, plan.micro_batch_size)


def distinct(plans: Sequence[Plan]) -> list[int]:
    """Positions of ``plans`` whose layout (:func:`layout`) no earlier plan has: one trial per layout, of its
    best-ranked plan."""
    seen: set[tuple[object, ...]] = set()
    out = []
    for i, plan in enumerate(plans):
        if layout(plan) not in seen:
            seen.add(layout(plan))
            out.append(i)
    return out


def band_pct(first: Plan, second: Plan) -> float | None:
    """The band (percent) of the ratio of two plans' predictions: the wider of their error bands
    (:func:`~cfp_megatron.search.choice.ratio_band`); ``None`` where either has none (a CPU cluster)."""
    a, b = first.predicted, second.predicted
    if a is None or b is None or a.error_band_pct is None or b.error_band_pct is None:
        return None
    return max(a.error_band_pct, b.error_band_pct)


def inside(first: Plan, second: Plan) -> bool:
    """Whether the predicted margin between two plans is inside their band
    (:func:`~cfp_megatron.search.choice.inside_band`): the model cannot tell which is faster."""
    if first.predicted is None or second.predicted is None:
        return False
    fast, slow = sorted((first.predicted.step_time_s, second.predicted.step_time_s))
    return fast > 0 and inside_band(fast, slow, band_pct(first, second))


def trial_positions(plans: Sequence[Plan], trials: int | None) -> tuple[int, ...]:
    """Positions of the plans to measure (the chosen one first); empty where no trial runs. ``trials``
    (``cfp.trials``): ``K``, the first K distinct plans; ``None`` (``auto``), the distinct plans inside the chosen
    plan's band (:func:`inside`), at most :data:`~cfp_megatron.base.cfp_spec.AUTO_TRIALS`, and none unless the
    runner-up is one of them. Fewer than two plans to compare: none."""
    positions = distinct(plans)
    if trials is None:
        if len(positions) < 2 or not inside(plans[positions[0]], plans[positions[1]]):
            return ()
        positions = [positions[0], *(i for i in positions[1:] if inside(plans[positions[0]], plans[i]))]
        trials = AUTO_TRIALS
    chosen = positions[:trials]
    return tuple(chosen) if len(chosen) >= 2 else ()


def shortfall(plans: Sequence[Plan], trials: int | None, tried: Sequence[int]) -> str | None:
    """What to say where ``cfp.trials=K`` gets fewer than K plans to try (``tried``: :func:`trial_positions`):
    the top plans hold fewer distinct layouts; ``None`` otherwise (and under ``auto``, which asks for none)."""
    if trials is None or trials < 2 or len(tried) >= trials:
        return None
    found = len(distinct(plans))
    said = f"cfp.trials={trials}: the search's top {len(plans)} plans hold {found} distinct layout(s)"
    return said + (", so none is tried" if not tried else f", so {len(tried)} are tried") + \
        " (raise cfp.top_k to look further down the ranking)"


def measured_pick(measured: Sequence[float | None]) -> int | None:
    """The position of the fastest measured step time (``None``: that trial did not finish); of equal times the
    earlier (the search ranked it higher). ``None`` unless two or more trials finished: one alone compares nothing."""
    done = [(seconds, i) for i, seconds in enumerate(measured) if seconds is not None and seconds > 0]
    if len(done) < 2:
        return None
    return min(done)[1]


def picked(plan: Plan, labels: Sequence[str], measured: Sequence[float | None], index: int) -> Plan:
    """``plan`` (the trials' pick, at ``index``) with why it runs in its prediction's ``choice``: the measured
    step times of every trial."""
    if plan.predicted is None:
        return plan
    times = ", ".join(f"{label} {seconds * 1e3:.1f} ms" if seconds is not None else f"{label} not finished"
                      for label, seconds in zip(labels, measured, strict=True))
    why = (f"the measured fastest of {len(labels)} trials at launch (cfp.trials; a few steps each, the median "
           f"after the warm-up): {times}",)
    return dataclasses.replace(plan, predicted=dataclasses.replace(plan.predicted, choice=why))
