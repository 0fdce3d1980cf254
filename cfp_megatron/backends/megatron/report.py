"""What a search says to a person: the top plans, the families it ruled out and why, and why the chosen plan
(the fastest, or one inside its error band that rests on more evidence) and not the others, knob by knob (rich
tables)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from cfp_megatron.base.config import MoeTokenPolicy
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.search.plan_options import option_label
from cfp_megatron.search.search import Ranked, SearchResult
from cfp_megatron.sim.prediction import GIB, mfu
from cfp_megatron.sim.terms import TERMS, exposed_comm_s
from cfp_megatron.sim.uncertainty import BAND_QUANTILE, error_band, mfu_check

_KNOBS = (("tp", "TP"), ("sp", "sequence parallel"), ("pp", "PP"), ("vpp", "virtual stages"), ("cp", "CP"),
          ("first_stage_layers", "first stage layers (0: even)"), ("last_stage_layers", "last stage layers (0: even)"),
          ("balanced", "balanced per-stage layout"),
          ("ep", "EP"), ("etp", "expert TP"), ("micro_batch", "micro-batch"), ("recompute", "recompute"),
          ("recompute_layers", "block-recomputed layers per chunk"), ("mlp", "MLP partition"),
          ("primepar_layers", "PrimePar layers per chunk (0: all)"), ("distributed_optimizer", "distributed optimizer"),
          ("fsdp", "Megatron-FSDP"), ("dp_shard", "hybrid shard group (0: all of DP x CP)"))


def ranking_table(result: SearchResult, peak_tflops: float | None) -> Table:
    """The top plans."""
    chosen = result.choice.index if result.choice is not None else 0
    table = Table(title=f"Top {len(result.ranked)} of {result.space_size:,} layouts on {result.world} GPUs",
                  caption="* the chosen plan (why: below)")
    for col in ("#", "layout", "step s", "± err", "tokens/s/GPU", "MFU", "peak GiB", "bubble", "exposed comm s"):
        table.add_column(col, justify="left" if col == "layout" else "right")
    for i, r in enumerate(result.ranked, 1):
        p = r.prediction
        u = mfu(p, peak_tflops)
        band = error_band(r.job)
        check = mfu_check(r.job)  # "!": above every comparable published run (how far to trust it, below)
        layout = (r.candidate.describe(result.world) + option_label(r.job, result.option_choices)
                  + (" [analytical]" if r.unmeasured else ""))
        table.add_row(f"{i}*" if i - 1 == chosen else str(i), layout, f"{p.step_time_s:.3f}",
                      f"{band.pct:.0f}%" if band else "-", f"{p.tokens_per_s_per_gpu:,.0f}",
                      f"{u:.1%}" + (" !" if check and check.above_all(u) else "") if u is not None else "-",
                      f"{p.memory.total / GIB:.1f}", f"{p.bubble_fraction:.1%}",
                      f"{exposed_comm_s(p):.3f}")
    return table


def trust_notes(result: SearchResult, peak_tflops: float | None) -> list[str]:
    """What a person should know before trusting the ranking: the best plan's error band and where it comes from,
    whether the runner-up is inside it, and its predicted MFU against comparable published runs (same GPU generation,
    kind and precision, a model within 2x of its size: :func:`~cfp_megatron.sim.uncertainty.mfu_check`)."""
    if not result.ranked:
        return []
    best = result.best
    band = error_band(best.job)
    notes = []
    if band is not None:
        where = ", ".join(band.classes)
        notes.append(f"error band ±{band.pct:.0f}%: {BAND_QUANTILE:.0%} of published runs of "
                     + (band.basis if band.basis else f"its classes ({where})") + " were predicted that close with "
                     f"efficiencies fitted without their source (leave-one-source-out, {band.rows} rows)"
                     + (f"; no published run covers {', '.join(band.untested)}" if band.untested else "")
                     + (f"; too few cover {', '.join(band.borrowed)} (all runs' band)" if band.borrowed else ""))
        if len(result.ranked) > 1 and best is result.ranked[0]:  # a plan chosen over the fastest says why above
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
    check = mfu_check(best.job)
    said = check.note(mfu(best.prediction, peak_tflops)) if check is not None else None
    if said:
        notes.append(said)
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


def explain(best: Ranked, runner_up: Ranked | None, *, other: str = "runner-up") -> list[str]:
    """Why ``best`` beats ``runner_up`` (named ``other``): the knobs that differ and the parts of the step and memory
    that moved."""
    if runner_up is None:
        return ["only one plan fits."]
    a, b = best.candidate, runner_up.candidate
    lines = []
    for name, label in _KNOBS:
        x, y = getattr(a, name), getattr(b, name)
        if x != y:
            lines.append(f"{label}: {_show(x)} (chosen) vs {_show(y)} ({other})")
    fa, fb = NumberFormat.of(best.job.train).name, NumberFormat.of(runner_up.job.train).name
    if fa != fb:
        lines.append(f"number format: {fa} (chosen) vs {fb} ({other})")
    for label, of in (("CUDA graphs", lambda j: j.parallel.cuda_graph_impl.value),
                      ("MoE token policy", lambda j: MoeTokenPolicy.of(j.model).value)):
        if of(best.job) != of(runner_up.job):
            lines.append(f"{label}: {of(best.job)} (chosen) vs {of(runner_up.job)} ({other})")
    pa, pb = best.prediction, runner_up.prediction
    gap = pb.step_time_s - pa.step_time_s
    lines.append(f"step time: {pa.step_time_s:.4f} s vs {pb.step_time_s:.4f} s ({abs(gap) / pb.step_time_s:.2%} "
                 f"{'faster' if gap >= 0 else 'slower'})")
    moved = sorted(((lane.label, pa.time.seconds(lane.name) - pb.time.seconds(lane.name)) for lane in TERMS.lanes()),
                   key=lambda kv: kv[1])
    for label, delta in moved:
        if abs(delta) >= 1e-4 * max(pb.step_time_s, 1e-12):
            lines.append(f"  {label}: {delta:+.4f} s on the critical pipeline rank")
    lines.append(f"peak memory: {pa.memory.total / GIB:.2f} GiB vs {pb.memory.total / GIB:.2f} GiB per GPU")
    return lines


def choice_lines(result: SearchResult) -> list[str]:
    """Why the chosen plan (:mod:`cfp_megatron.search.choice`): the reason, then the knobs and parts of the step
    against the fastest plan where another was chosen, else against the runner-up."""
    ranked, best = result.ranked, result.best
    reasons = list(result.choice.reasons) if result.choice is not None else []
    if result.format_reason is not None:
        reasons.append(result.format_reason)
    if result.option_reason is not None:
        reasons.append(result.option_reason)
    if best is not ranked[0]:
        return (["Why this plan and not the fastest (#1)"] + [f"  {r}" for r in reasons]
                + [f"  {line}" for line in explain(best, ranked[0], other="fastest")])
    return (["Why the best plan wins over the runner-up"] + [f"  {r}" for r in reasons]
            + [f"  {line}" for line in explain(best, ranked[1] if len(ranked) > 1 else None)])


def _show(v: object) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    return str(v)


def print_result(result: SearchResult, peak_tflops: float | None, console: Console | None = None) -> None:
    """The ranking, the explanation and the rejections."""
    console = console or Console()
    console.print(ranking_table(result, peak_tflops))
    if result.ranked:
        head, *lines = choice_lines(result)
        console.print(head, style="bold", markup=False)
        for line in lines:
            console.print(line, markup=False)
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
