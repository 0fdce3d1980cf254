"""Search speed and quality.

Run: ``python bench/search.py [--published FILE.csv ...] [--skip-speed] [--markdown docs/figures/search.md]`` (both
shared files by default; ``--markdown`` also writes the figures as a snippet for the docs, with the date and machine).

1. Speed, on one core (the process is pinned to CPU 0): the full space of
   GPT-3 175B on 1,024 A100 (gbs 1,536 x 2,048), Llama-3 405B on 16,384 H100 (gbs 2,048 x 8,192) and DeepSeek-V3
   on 2,048 H100 (gbs 15,360 x 4,096); prints the space size, how many plans were simulated, the wall time and the
   CPU time of the search (median of five runs each: the CPU time is the steadier on a shared machine) and the plan
   found. Targets: 0.5 s, 5 s, 1.5 s.
2. Quality: for every published layout the validator can model (``python -m cfp_megatron.validate``), searches the
   same model on the same GPUs with the same global batch, sequence, precision and simulator options (the default
   top-k, so the choice among them acts: :mod:`cfp_megatron.search.choice`), and prints the published layout's
   predicted step time over the chosen plan's (the predicted gain, about 1 or more: the search finds a plan at least
   as fast as the published one by the same simulator, less what the choice gives up inside the band) with its
   interval under the band of the two predictions (the wider of the two: ``search.choice.ratio_band``) and whether
   the gain is outside it (its interval above 1), then how many gains are. The
   published layout is outside the search's space where it puts TP across nodes or does not fit the memory limit
   (HBM less the headroom); those rows say so, and under each the search is run again allowing what the published
   layout uses (its predicted peak memory, the GPU's capacity raised to it where the simulator puts it above; TP
   across nodes), with that ratio. Last, the chosen plans that are exotic (CP at 8k tokens or fewer, EP across
   nodes) with the two parts of the step they save most on.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

import snippet

from cfp_megatron.base.cfp_spec import CfpSpec, SearchConstraints, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.search.choice import gain_interval, ratio_band
from cfp_megatron.search.search import Ranked, search
from cfp_megatron.sim.prediction import GIB
from cfp_megatron.sim.terms import TERMS
from cfp_megatron.validation.rows import PUBLISHED_RUNS

ROOT = Path(__file__).resolve().parent.parent

CASES = (
    ("GPT-3 175B, 1,024 A100", ["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128",
                                "train.global_batch_size=1536", "train.seq_length=2048"], 0.5),
    ("Llama-3 405B, 16,384 H100", ["model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=2048",
                                   "train.global_batch_size=2048", "train.seq_length=8192"], 5.0),
    ("DeepSeek-V3, 2,048 H100", ["model=deepseek_v3", "cluster=dgx_h100", "cluster.nodes=256",
                                 "train.global_batch_size=15360", "train.seq_length=4096"], 1.5),
)

REPEATS = 5
"""Searches timed per case (their median is reported)."""


def speed() -> list[list[str]]:
    """Time the search on each of :data:`CASES`; returns the rows of the docs' table."""
    rows: list[list[str]] = []
    print(f"{'case':<28} {'layouts':>9} {'simulated':>9} {'seconds':>8} {'CPU s':>6} {'target':>7}  best plan")
    for name, overrides, target in CASES:
        cfg = compose_config(["+cfp=auto", *overrides])
        job, cfp = job_from_config(cfg), cfp_from_config(cfg)
        world = job.cluster.nodes * job.cluster.gpus_per_node
        times, cpu, result = [], [], None
        for _ in range(REPEATS):
            started = time.process_time()
            result = search(job, world, cfp)
            cpu.append(time.process_time() - started)
            times.append(result.seconds)
        wall_s, cpu_s = statistics.median(times), statistics.median(cpu)
        if result.ranked:
            best = result.best
            found = (f"{best.candidate.describe(world)}: {best.prediction.step_time_s:.3f} s, "
                     f"{best.prediction.memory.total / GIB:.1f} GiB")
        else:
            pps = sorted({int(r.what[3:]) for r in result.rejected if r.what.startswith("pp=")})
            found = (f"no plan fits ({result.over_memory:,} over memory; PP sizes ruled out by the layer count: "
                     f"{pps[:6]}...)")
        print(f"{name:<28} {result.space_size:>9,} {result.simulated:>9} {wall_s:>8.3f} {cpu_s:>6.3f} {target:>7.1f}  "
              f"{found}", flush=True)
        batch = f"gbs {job.train.global_batch_size:,} x {job.train.seq_length:,}"
        rows.append([f"{name}, {batch}", f"{result.space_size:,}", str(result.simulated), f"{wall_s:.3f}",
                     f"{cpu_s:.3f}", f"{target:g}", found])
    return rows


def exotic(job, world: int) -> list[str]:
    """What makes a plan unusual among published layouts: context parallelism at a short context, or an expert group
    that leaves the node (NVLink domain)."""
    from cfp_megatron.sim.layout import build_layout

    layout = build_layout(job, world)
    dims, reasons = layout.dims, []
    if dims.cp > 1 and job.train.seq_length <= 8192:
        reasons.append(f"CP={dims.cp} at {job.train.seq_length} tokens")
    if dims.ep > 1 and layout.ep_per_node < dims.ep:
        reasons.append(f"EP={dims.ep} across {dims.ep // max(layout.ep_per_node, 1)} nodes")
    return reasons


def why(chosen, reference) -> str:
    """The two lanes of the step's breakdown (the cost terms' registry) the chosen plan saves most on against the
    published layout's prediction."""
    mine = chosen.prediction.time
    saved = sorted(((reference.time.seconds(lane.name) - mine.seconds(lane.name), lane.label)
                    for lane in TERMS.lanes()), reverse=True)
    return ", ".join(f"{label} -{delta:.2f} s" for delta, label in saved[:2] if delta > 0)


def published(paths: list[Path]) -> list[str]:
    """Search each published layout's job; returns the summary as Markdown lines (none without a modelled row)."""
    from cfp_megatron.sim.simulate import simulate
    from cfp_megatron.sim.uncertainty import error_band
    from cfp_megatron.validate import RowError, read_rows, row_plan

    print(f"\n{'row':>4} {'model':<22} {'GPUs':>6} {'published layout':<34} {'published s':>11} {'chosen s':>9} "
          f"{'gain':>6} {'interval':>11} {'±':>3}  chosen (* gain outside the band, ^ not the fastest: evidence)")
    ratios: list[float] = []
    outside: list[bool] = []  # whether each gain's interval lies above 1
    passed_over = 0  # rows where the choice ran a plan other than the fastest
    allowed: list[float] = []  # the ratio where the published layout is in the space, else the re-searched one
    unusual: list[str] = []
    for row in (row for path in paths for row in read_rows(path)):
        try:
            rp = row_plan(row)
        except RowError:
            continue
        if rp.options.measured_layer_only:
            continue
        job = rp.job
        world = job.cluster.nodes * job.cluster.gpus_per_node
        ref = simulate(job, options=rp.options, world_size=world)
        cfp = CfpSpec(constraints=SearchConstraints())
        result = search(job, world, cfp, options=rp.options)
        note = ""
        if job.parallel.tp > job.cluster.gpus_per_node:
            note = " (published TP spans nodes)"
        elif result.memory_limit_gib is not None and ref.memory.total / GIB > result.memory_limit_gib:
            note = f" (published needs {ref.memory.total / GIB:.0f} GiB > {result.memory_limit_gib:.0f})"
        head = f"{rp.row_id:>4} {rp.model[:22]:<22} {world:>6} {rp.layout[:34]:<34} {ref.step_time_s:>11.3f}"
        if not result.ranked:
            print(f"{head} {'-':>9} {'-':>6}  no plan fits{note}")
            continue
        published_band = error_band(job, rp.options)
        band = ratio_band(published_band, error_band(result.best.job, rp.options))
        ratio = _row(head, ref.step_time_s, result.best, world, note, band, result.best is not result.ranked[0])
        ratios.append(ratio)
        outside.append(band is not None and gain_interval(ratio, band)[0] > 1.0)
        passed_over += result.best is not result.ranked[0]
        reasons = exotic(result.best.job, world)
        if reasons:
            unusual.append(f"{rp.row_id:>4} {rp.model[:22]:<22} {'; '.join(reasons)}: x{ratio:.3f}, "
                           f"{why(result.best, ref)}")
        if not note:
            allowed.append(ratio)
        else:
            # The same search where the published layout is allowed: as much memory as it is predicted to need (the
            # GPU's capacity raised to it where it is over), TP across nodes where it puts TP there.
            peak = ref.memory.total / GIB
            cluster = job.cluster
            if cluster.hbm_gib is not None and peak > cluster.hbm_gib:
                cluster = dataclasses.replace(cluster, hbm_gib=peak)
            headroom = 0.0 if cluster.hbm_gib is None else max(0.0, 1.0 - peak / cluster.hbm_gib)
            same_cfp = CfpSpec(constraints=SearchConstraints(
                memory_headroom=headroom, tp_within_node=job.parallel.tp <= job.cluster.gpus_per_node))
            found = search(dataclasses.replace(job, cluster=cluster), world, same_cfp, options=rp.options)
            same_band = ratio_band(published_band, error_band(found.best.job, rp.options))
            allowed.append(_row(f"{'':>4} {'':<22} {'':>6} {'  same memory as published':<34} {'':>11}",
                                ref.step_time_s, found.best, world, "", same_band, found.best is not found.ranked[0]))
    if ratios:
        below = sum(r < 1 - 1e-9 for r in ratios)
        print(f"ratio published/chosen over {len(ratios)} rows: min {min(ratios):.3f}, median "
              f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}; rows where the chosen plan is slower: {below}")
        print(f"with the published layout's own memory (and TP placement) allowed: min {min(allowed):.3f}; rows "
              f"where the chosen plan is slower: {sum(r < 1 - 1e-9 for r in allowed)}")
        print(f"gains outside the band (interval above 1): {sum(outside)} of {len(ratios)}; inside it (the band "
              f"does not support them): {len(ratios) - sum(outside)}; chosen plan not the fastest (more evidence "
              f"inside the band): {passed_over} of {len(ratios)}")
        print(f"exotic chosen plans (CP at <= 8k tokens, EP across nodes): {len(unusual)} of {len(ratios)}")
        for line in unusual:
            print("  " + line)
        slower = sum(r < 1 - 1e-9 for r in allowed)
        return [f"Over {len(ratios)} published layouts of {', '.join(f'`{p.name}`' for p in paths)}, the published "
                f"layout's predicted step time over the chosen plan's: min {min(ratios):.3f}, median "
                f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}; the chosen plan is predicted slower in "
                f"{below} row{'s' if below != 1 else ''}. With the published layout's own memory (and TP placement) "
                f"allowed: min {min(allowed):.3f}, slower in {slower or 'none'}. Gains outside the band of the two "
                f"predictions (interval above 1): {sum(outside)} of {len(ratios)}; the chosen plan is not the "
                f"fastest (more evidence inside the band) in {passed_over}. Exotic chosen plans (CP at 8k "
                f"tokens or fewer, EP across nodes): {len(unusual)} of {len(ratios)}."]
    return []


def _row(head: str, published_s: float, chosen: Ranked, world: int, note: str, band: float | None,
         passed_over: bool) -> float:
    """Print one row (``head``: the published layout's columns; ``band``: the band of the gain, percent;
    ``passed_over``: the choice ran a plan other than the fastest) and return the predicted gain, published / chosen
    step time."""
    ratio = published_s / chosen.prediction.step_time_s
    if band is None:
        interval, shown, mark = "-", "-", " "
    else:
        low, high = gain_interval(ratio, band)
        interval, shown, mark = f"{low:.2f}-{high:.2f}", f"{band:.0f}", "*" if low > 1.0 else " "
    print(f"{head} {chosen.prediction.step_time_s:>9.3f} {ratio:>6.3f} {interval:>11} {shown:>3}{mark}"
          f"{'^' if passed_over else ' '} {chosen.candidate.describe(world)}{note}", flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--published", nargs="*", default=[str(p) for p in PUBLISHED_RUNS])
    parser.add_argument("--skip-speed", action="store_true")
    parser.add_argument("--markdown", type=snippet.check_path, metavar="FILE.md",
                        help="also write the figures as a Markdown snippet for the docs (docs/figures/search.md)")
    args = parser.parse_args()
    paths = [Path(p) for p in args.published]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"--published: no such file: {', '.join(missing)} (give the published runs' CSV files)")
    first_line = snippet.header()
    lines: list[str] = []
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if not args.skip_speed:
        t = time.perf_counter()
        rows = speed()
        print(f"(speed cases in {time.perf_counter() - t:.1f} s)")
        lines += [f"Search speed (the search alone, pinned to one core, median of {REPEATS}):", "",
                  *snippet.table(["case", "layouts", "simulated", "seconds", "CPU s", "target s",
                                  "best plan (predicted step, peak per GPU)"], rows, "lrrrrrl"), ""]
    if paths:
        lines += published(paths)
    if args.markdown:
        snippet.write(args.markdown, first_line, lines)


if __name__ == "__main__":
    main()
