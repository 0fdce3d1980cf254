"""Layout sweeps: rows of one job measured under several layouts, and whether the simulator orders them as measured.
A planner picks the layout its prediction says is fastest, so what matters there is the order of the layouts of one
job and what trusting the predicted favourite costs, not each row's error (docs/validation.md, "Layout sweeps")."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from cfp_megatron.search.choice import inside_band, ratio_band
from cfp_megatron.sim.uncertainty import ErrorBand, error_band
from cfp_megatron.validation.results import RowResult

JOB_COLUMNS = ("source", "framework", "model", "arch_type", "layers", "hidden", "ffn_hidden", "heads", "kv_heads",
               "vocab", "moe_experts", "moe_topk", "moe_expert_ffn", "gpu", "num_gpus", "interconnect", "seq_len",
               "global_batch_seqs", "precision")
"""The columns that define a job: rows alike in each of them (blank alike, compared without case or repeated blanks)
and built into different layouts are one job's sweep."""

TIE_MARGIN = 0.01
"""Two layouts whose measured step times differ by at most this fraction of the faster one's are a tie: their order
is within the tables' rounding and run-to-run spread, so the pair is not counted."""


@dataclass(frozen=True, kw_only=True)
class Pair:
    """Two layouts of one sweep whose measured step times differ by more than :data:`TIE_MARGIN`."""

    faster: str
    """The measured-faster row's id."""
    slower: str
    """The measured-slower row's id."""
    measured_gap: float
    """The slower's measured step time over the faster's, minus 1."""
    predicted_gap: float
    """The slower's predicted step time over the faster's, minus 1 (negative: predicted in the other order)."""
    band_pct: float | None = None
    """The band of the two predictions' ratio (:func:`~cfp_megatron.search.choice.ratio_band`, percent); ``None``
    where a row's is unknown."""

    @property
    def ordered(self) -> bool:
        """Whether the prediction orders the pair as measured (a predicted tie does not)."""
        return self.predicted_gap > 0

    @property
    def inside_band(self) -> bool:
        """Whether the predicted margin between the two is inside :attr:`band_pct`, where the planner lets the
        evidence choose rather than the predicted time (:func:`~cfp_megatron.search.choice.inside_band`)."""
        gap = abs(self.predicted_gap)
        return inside_band(1.0, 1.0 + gap, self.band_pct)


@dataclass(frozen=True, kw_only=True)
class Sweep:
    """One job's rows at several layouts, and how the prediction orders them."""

    name: str
    """The job, as the report prints it (model, GPUs)."""
    rows: tuple[str, ...]
    """The ids of its rows, in the order given."""
    pairs: tuple[Pair, ...]
    """Its pairs of layouts outside the tie margin."""
    regret: float
    """The measured step time of the predicted-fastest layout over the measured-fastest's, minus 1 (the slowest
    measured where several rows share the fastest prediction)."""

    @property
    def ordered(self) -> int:
        """How many of :attr:`pairs` the prediction orders as measured."""
        return sum(pair.ordered for pair in self.pairs)


def _cell(row: dict, column: str) -> str:
    return " ".join((row.get(column) or "").split()).lower()


def _band(result: RowResult) -> ErrorBand | None:
    return error_band(result.plan.job, result.plan.options)


def find_sweeps(results: list[RowResult], rows_by_id: dict[str, dict], margin: float = TIE_MARGIN,
                band_of: Callable[[RowResult], ErrorBand | None] = _band) -> list[Sweep]:
    """The sweeps among ``results`` (rows modelled and kept): rows alike in :data:`JOB_COLUMNS` whose plans are at
    least two different layouts (the validator's layout string); each with its pairs outside ``margin`` (with the
    band of their ratio, each row's from ``band_of``: the planner's out-of-sample band by default) and its regret.
    A job measured at one layout, however often, is no sweep."""
    jobs: dict[tuple[str, ...], list[RowResult]] = {}
    for result in results:
        row = rows_by_id.get(result.plan.row_id, {})
        jobs.setdefault(tuple(_cell(row, column) for column in JOB_COLUMNS), []).append(result)
    sweeps = []
    for members in jobs.values():
        if len({r.plan.layout for r in members}) < 2:
            continue
        pairs = []
        for i, a in enumerate(members):
            for b in members[i + 1:]:
                if a.plan.layout == b.plan.layout:
                    continue
                fast, slow = (a, b) if a.plan.measured_s <= b.plan.measured_s else (b, a)
                gap = slow.plan.measured_s / fast.plan.measured_s - 1
                if gap > margin:
                    pairs.append(Pair(faster=fast.plan.row_id, slower=slow.plan.row_id, measured_gap=gap,
                                      predicted_gap=slow.predicted_s / fast.predicted_s - 1,
                                      band_pct=ratio_band(band_of(fast), band_of(slow))))
        best_predicted = min(r.predicted_s for r in members)
        chosen = max(r.plan.measured_s for r in members if r.predicted_s == best_predicted)
        first = rows_by_id.get(members[0].plan.row_id, {})
        name = f"{' '.join((first.get('model') or '').split())} on {(first.get('num_gpus') or '').strip()} GPUs"
        sweeps.append(Sweep(name=name,
                            rows=tuple(r.plan.row_id for r in members), pairs=tuple(pairs),
                            regret=chosen / min(r.plan.measured_s for r in members) - 1))
    return sweeps


def sweep_summary(sweeps: list[Sweep]) -> dict:
    """The ``--json`` report's ``sweeps``: the tie margin, how many sweeps, pairs and pairs ordered as measured, how
    many pairs' predicted margins are inside their band (and of the pairs misordered, how many are not), the mean and
    worst regret (``None`` without a sweep), and each sweep with its pairs."""
    pairs = [pair for sweep in sweeps for pair in sweep.pairs]
    regrets = [sweep.regret for sweep in sweeps]
    return {
        "tie_margin": TIE_MARGIN, "count": len(sweeps), "pairs": len(pairs),
        "ordered": sum(pair.ordered for pair in pairs),
        "inside_band": sum(pair.inside_band for pair in pairs),
        "misordered_outside_band": sum(not pair.ordered and not pair.inside_band for pair in pairs),
        "mean_regret": round(sum(regrets) / len(regrets), 5) if regrets else None,
        "worst_regret": round(max(regrets), 5) if regrets else None,
        "sweeps": [{"name": sweep.name, "rows": list(sweep.rows), "ordered": sweep.ordered,
                    "regret": round(sweep.regret, 5),
                    "pairs": [{"faster": p.faster, "slower": p.slower, "measured_gap": round(p.measured_gap, 5),
                               "predicted_gap": round(p.predicted_gap, 5), "ordered": p.ordered,
                               "band_pct": p.band_pct, "inside_band": p.inside_band}
                              for p in sweep.pairs]}
                   for sweep in sweeps],
    }


def sweep_lines(sweeps: list[Sweep]) -> list[str]:
    """What ``python -m cfp_megatron.validate`` prints of the sweeps: a line a sweep, a line for each of its pairs the
    prediction orders otherwise than measured, then the totals."""
    if not sweeps:
        return ["layout sweeps: none (no job is measured at two layouts among the rows kept)"]
    lines = [f"layout sweeps (one job at several layouts; pairs whose measured step times differ by more than "
             f"{TIE_MARGIN:.0%}):"]
    for sweep in sweeps:
        lines.append(f"  {sweep.name[:44]:<44} rows {', '.join(sweep.rows):<22} {sweep.ordered} of "
                     f"{len(sweep.pairs)} pairs ordered, regret {sweep.regret:.1%}")
        lines += [f"      misordered: {p.faster} faster than {p.slower}, measured {p.measured_gap:+.1%}, predicted "
                  f"{p.predicted_gap:+.1%}, " + _band_words(p) for p in sweep.pairs if not p.ordered]
    pairs = [pair for sweep in sweeps for pair in sweep.pairs]
    ordered = sum(pair.ordered for pair in pairs)
    regrets = [sweep.regret for sweep in sweeps]
    share = f" ({ordered / len(pairs):.0%})" if pairs else ""
    inside = sum(pair.inside_band for pair in pairs)
    lines.append(f"  {inside} of {len(pairs)} pairs predicted within their band (where the planner lets the evidence "
                 f"choose); misordered outside it: {sum(not p.ordered and not p.inside_band for p in pairs)}")
    lines.append(f"layout sweeps: {ordered} of {len(pairs)} pairs ordered as measured{share} over {len(sweeps)} "
                 f"sweeps; regret of the predicted favourite {sum(regrets) / len(regrets):.1%} mean, "
                 f"{max(regrets):.1%} worst")
    return lines


def _band_words(pair: Pair) -> str:
    if pair.band_pct is None:
        return "no band known"
    return f"{'inside' if pair.inside_band else 'outside'} the ±{pair.band_pct:.0f}% band"
