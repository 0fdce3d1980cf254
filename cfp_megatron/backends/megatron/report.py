"""What a search says to a person: the top plans, the families it ruled out and why, and why the best plan beats the
runner-up, knob by knob (rich tables)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cfp_megatron.search.search import Ranked, SearchResult
from cfp_megatron.sim.prediction import GIB, mfu
from cfp_megatron.sim.terms import TERMS, exposed_comm_s
from cfp_megatron.sim.uncertainty import BAND_QUANTILE, best_published_mfu, error_band

_KNOBS = (("tp", "TP"), ("sp", "sequence parallel"), ("pp", "PP"), ("vpp", "virtual stages"), ("cp", "CP"),
          ("first_stage_layers", "first stage layers (0: even)"), ("last_stage_layers", "last stage layers (0: even)"),
          ("balanced", "balanced per-stage layout"),
          ("ep", "EP"), ("etp", "expert TP"), ("micro_batch", "micro-batch"), ("recompute", "recompute"),
          ("recompute_layers", "block-recomputed layers per chunk"), ("mlp", "MLP partition"),
          ("primepar_layers", "PrimePar layers per chunk (0: all)"), ("distributed_optimizer", "distributed optimizer"))


def ranking_table(result: SearchResult, peak_tflops: float | None) -> Table:
    """The top plans."""
    table = Table(title=f"Top {len(result.ranked)} of {result.space_size:,} layouts on {result.world} GPUs")
    for col in ("#", "layout", "step s", "± err", "tokens/s/GPU", "MFU", "peak GiB", "bubble", "exposed comm s"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, r in enumerate(result.ranked, 1):
        p = r.prediction
        u = mfu(p, peak_tflops)
        band = error_band(r.job)
        layout = r.candidate.describe(result.world) + (" [analytical]" if r.unmeasured else "")
        table.add_row(str(i), layout, f"{p.step_time_s:.3f}",
                      f"{band.pct:.0f}%" if band else "-", f"{p.tokens_per_s_per_gpu:,.0f}",
                      f"{u:.1%}" if u is not None else "-", f"{p.memory.total / GIB:.1f}", f"{p.bubble_fraction:.1%}",
                      f"{exposed_comm_s(p):.3f}")
    return table


def trust_notes(result: SearchResult, peak_tflops: float | None) -> list[str]:
    """What a person should know before trusting the ranking: the best plan's error band and where it comes from,
    whether the runner-up is inside it, and a predicted MFU above the best published run of its class."""
    if not result.ranked:
        return []
    best = result.ranked[0]
    band = error_band(best.job)
    notes = []
    if band is not None:
        where = ", ".join(band.classes)
        notes.append(f"error band ±{band.pct:.0f}%: {BAND_QUANTILE:.0%} of published runs of its class ({where}) "
                     f"were predicted that close (python -m cfp_megatron.validate, {band.rows} rows)"
                     + (f"; no published run covers {', '.join(band.untested)}" if band.untested else ""))
        if len(result.ranked) > 1:
            runner_up = result.ranked[1].prediction.step_time_s
            margin = (runner_up - best.prediction.step_time_s) / runner_up * 100
            if margin < band.pct:
                notes.append(f"the best plan's margin over the runner-up ({margin:.2f}%) is inside that band: the "
                             "runner-up may be as fast; measure both if it matters")
    marked = [i for i, r in enumerate(result.ranked, 1) if r.unmeasured]
    if marked:
        notes.append(f"[analytical] (plan {', '.join(map(str, marked))}): the profile lacks "
                     f"{', '.join(dict.fromkeys(u for r in result.ranked for u in r.unmeasured))}, priced by the "
                     "analytical model instead; complete the profile (torchrun ... -m cfp_megatron.profile) to "
                     "measure them")
    predicted = mfu(best.prediction, peak_tflops)
    published = best_published_mfu(best.job)
    if predicted is not None and published is not None and predicted > published.mfu:
        notes.append(f"predicted MFU {predicted:.1%} is above the best published run of this GPU and model kind "
                     f"({published.mfu:.1%}, run {published.row}): the prediction is likely optimistic")
    return notes


def rejections_table(result: SearchResult, limit: int = 20) -> Table:
    """Knob values and families ruled out, with why (the first ``limit``)."""
    table = Table(title=f"Ruled out ({len(result.rejected)} values or families)")
    table.add_column("value or family")
    table.add_column("why")
    for r in result.rejected[:limit]:
        table.add_row(r.what, r.reason)
    if len(result.rejected) > limit:
        table.add_row("...", f"{len(result.rejected) - limit} more")
    return table


def explain(best: Ranked, runner_up: Ranked | None) -> list[str]:
    """Why ``best`` beats ``runner_up``: the knobs that differ and the parts of the step and memory that moved."""
    if runner_up is None:
        return ["only one plan fits."]
    a, b = best.candidate, runner_up.candidate
    lines = []
    for name, label in _KNOBS:
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            lines.append(f"{label}: {_show(x)} (best) vs {_show(y)} (runner-up)")
    pa, pb = best.prediction, runner_up.prediction
    gap = pb.step_time_s - pa.step_time_s
    lines.append(f"step time: {pa.step_time_s:.4f} s vs {pb.step_time_s:.4f} s ({gap / pb.step_time_s:.2%} faster)")
    moved = sorted(((lane.label, pa.time.seconds(lane.name) - pb.time.seconds(lane.name)) for lane in TERMS.lanes()),
                   key=lambda kv: kv[1])
    for label, delta in moved:
        if abs(delta) >= 1e-4 * max(pb.step_time_s, 1e-12):
            lines.append(f"  {label}: {delta:+.4f} s on the critical pipeline rank")
    lines.append(f"peak memory: {pa.memory.total / GIB:.2f} GiB vs {pb.memory.total / GIB:.2f} GiB per GPU")
    return lines


def _show(v: object) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def print_result(result: SearchResult, peak_tflops: float | None, console: Console | None = None) -> None:
    """The ranking, the explanation and the rejections."""
    console = console or Console()
    console.print(ranking_table(result, peak_tflops))
    if result.ranked:
        console.print("[bold]Why the best plan wins over the runner-up[/bold]")
        for line in explain(result.ranked[0], result.ranked[1] if len(result.ranked) > 1 else None):
            console.print("  " + line)
        notes = trust_notes(result, peak_tflops)
        if notes:
            console.print("[bold]How far to trust it[/bold]")
            for line in notes:
                console.print("  " + line)
    console.print(rejections_table(result))
    limit = f"{result.memory_limit_gib:.1f} GiB" if result.memory_limit_gib is not None else "no limit"
    console.print(f"searched {result.space_size:,} layouts in {result.seconds:.2f} s: {result.simulated} simulated, "
                  f"{result.memory_checked} memory-checked, {result.over_memory} over memory ({limit}), "
                  f"{result.pruned:,} pruned by the step-time bound, {result.invalid} refused by validation")
