"""Which of the top plans to run: the fastest, unless a plan whose predicted margin behind it lies inside the error
band rests on more evidence (:class:`Evidence`). It runs on the top-k a search returns, never inside the search.
Why this ordering and this band: docs/preflight.md, "Which plan runs".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.uncertainty import ErrorBand, error_band

if TYPE_CHECKING:
    from cfp_megatron.search.search import Ranked


@dataclass(frozen=True, kw_only=True, order=True)
class Evidence:
    """What a plan's prediction rests on, compared field by field in this order: the smaller rests on more."""

    analytical: int
    """Partitions its prediction reads that the profile did not measure (:attr:`Ranked.unmeasured`), priced by the
    analytical model instead: measured segments first."""
    band_pct: float
    """The error band of its classes (:func:`~cfp_megatron.sim.uncertainty.error_band`, percent; infinite where none
    is known): the class the published runs predict more closely first."""
    cp: int
    """Its context-parallel size: every plan the choice compares fits, so CP beyond the smallest among them is more
    than the sequence needs to fit in memory, and the published runs test CP least."""
    ep_domains: int
    """NVLink domains one expert group spans (1 where it stays inside one, or without EP): an all-to-all across the
    network where the experts fit in fewer is likewise more than the model needs."""


@dataclass(frozen=True, kw_only=True)
class Choice:
    """The plan chosen among a search's ranked plans, and why."""

    index: int
    """Its position among the ranked plans (fastest first): 0 where the fastest is chosen."""
    tied: tuple[int, ...]
    """Positions of the plans whose predicted margin behind the fastest is inside the band (:func:`inside_band`),
    the fastest included: the plans the evidence decides between."""
    evidence: tuple[Evidence, ...]
    """Each ranked plan's evidence, in ranked order."""
    reasons: tuple[str, ...]
    """Why it was chosen, one sentence each (the report's "Why this plan" and plan.json's ``prediction.choice``)."""


def ratio_band(first: ErrorBand | None, second: ErrorBand | None) -> float | None:
    """The band (percent) of the ratio of two predictions of one job: the wider of their bands; ``None`` where either
    is unknown. One band, not their sum: two layouts of one job share the model, the GPU and its fitted efficiencies,
    so their errors are correlated, yet on published layout sweeps the ratio still errs about as much as either."""
    if first is None or second is None:
        return None
    return max(first.pct, second.pct)


def gain_interval(gain: float, band_pct: float) -> tuple[float, float]:
    """The interval of a predicted speed-up ``gain`` (the slower plan's step time over the faster's) under a band of
    ``band_pct`` percent on the ratio (:func:`ratio_band`)."""
    share = band_pct / 100.0
    return gain * (1.0 - share), gain * (1.0 + share)


def inside_band(fast_s: float, slow_s: float, band_pct: float | None) -> bool:
    """Whether the predicted gain of a plan of ``fast_s`` seconds over one of ``slow_s`` is inside the band: its
    interval (:func:`gain_interval`) reaches 1, i.e. the margin ``1 - fast / slow`` is at most the band. Never
    without a band."""
    if band_pct is None:
        return False
    return gain_interval(slow_s / fast_s, band_pct)[0] <= 1.0


def evidence_of(ranked: Ranked, band: ErrorBand | None, world: int) -> Evidence:
    """The evidence of one ranked plan on ``world`` ranks with its error ``band``."""
    job = ranked.job
    ep = job.parallel.ep
    domains = 1
    if ep > 1:
        per_domain = max(build_layout(job, world).ep_per_node, 1)
        domains = -(-ep // per_domain)
    return Evidence(analytical=len(ranked.unmeasured), band_pct=band.pct if band is not None else math.inf,
                    cp=job.parallel.cp, ep_domains=domains)


def choose(ranked: Sequence[Ranked], world: int, options: SimOptions | None = None) -> Choice | None:
    """The plan to run among ``ranked`` (fastest first, on ``world`` ranks): of the plans whose margin behind the
    fastest is inside the band of the two predictions (:func:`inside_band`, :func:`ratio_band`), the one with the
    most evidence (the least :class:`Evidence`), then the fastest, then the first ranked. ``None`` without plans."""
    if not ranked:
        return None
    bands = [error_band(r.job, options) for r in ranked]
    evidence = tuple(evidence_of(r, b, world) for r, b in zip(ranked, bands, strict=True))
    fast_s = ranked[0].prediction.step_time_s
    tied = tuple(i for i, r in enumerate(ranked)
                 if i == 0 or inside_band(fast_s, r.prediction.step_time_s, ratio_band(bands[0], bands[i])))
    index = min(tied, key=lambda i: (evidence[i], ranked[i].prediction.step_time_s, i))
    return Choice(index=index, tied=tied, evidence=evidence,
                  reasons=_reasons(ranked, bands, evidence, tied, index, world))


def _reasons(ranked: Sequence[Ranked], bands: list[ErrorBand | None], evidence: tuple[Evidence, ...],
             tied: tuple[int, ...], index: int, world: int) -> tuple[str, ...]:
    """Why plan ``index`` was chosen, one sentence each."""
    fast = ranked[0]
    if index == 0:
        if bands[0] is None:
            return ("the fastest predicted plan; no error band is known here (a profiled CPU cluster: the plan check "
                    "after the first steps measures the error), so the predicted time decides",)
        if len(tied) > 1:
            others = ", ".join(f"#{i + 1}" for i in tied[1:])
            return (f"the fastest predicted plan; {others} {'is' if len(tied) == 2 else 'are'} inside the band of "
                    f"its prediction but rest{'s' if len(tied) == 2 else ''} on no more evidence (measured "
                    "partitions, class band, CP, expert-group span), so the predicted time decides",)
        if len(ranked) > 1:
            second = ranked[1].prediction.step_time_s
            band = ratio_band(bands[0], bands[1])
            where = f"the ±{band:.0f}% band of the two predictions" if band is not None else "any known band"
            return (f"the fastest predicted plan, {1 - fast.prediction.step_time_s / second:.2%} ahead of #2: "
                    f"outside {where}",)
        return ("the only plan that fits",)
    chosen = ranked[index]
    margin = 1 - fast.prediction.step_time_s / chosen.prediction.step_time_s
    band = ratio_band(bands[0], bands[index])
    head = (f"chosen over the fastest plan (#1, {fast.candidate.describe(world)}), predicted {margin:.2%} faster: "
            f"inside the ±{band:.0f}% band of the two predictions, and this plan's prediction rests on more "
            f"evidence: {_why(evidence[index], evidence[0], chosen, fast, bands[0])}")
    return (head,)


def _why(mine: Evidence, theirs: Evidence, chosen: Ranked, fast: Ranked, fast_band: ErrorBand | None) -> str:
    """The first criterion of :class:`Evidence` on which the chosen plan (``mine``) beats the fastest (``theirs``,
    its band ``fast_band``)."""
    if mine.analytical != theirs.analytical:
        lacks = ", ".join(fast.unmeasured) or "nothing"
        return (f"#1 reads {theirs.analytical} partition(s) the profile did not measure ({lacks}), priced by the "
                f"analytical model; this plan reads {mine.analytical}")
    if mine.band_pct != theirs.band_pct:
        return (f"its class predicts published runs within ±{mine.band_pct:.1f}%, #1's class "
                f"({', '.join(fast_band.classes if fast_band else ())}) within ±{theirs.band_pct:.1f}%")
    if mine.cp != theirs.cp:
        seq = chosen.job.train.seq_length
        return (f"#1 uses CP={theirs.cp} at {seq:,} tokens and this plan fits with CP={mine.cp}: the sequence does not "
                "need more context parallelism to fit in memory")
    return (f"#1's expert group spans {theirs.ep_domains} NVLink domains, this plan's {mine.ep_domains}, and it "
            "fits: the experts need no all-to-all over more of the network")

