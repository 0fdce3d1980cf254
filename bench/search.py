"""Search speed and quality (issue D).

Run: ``python bench/search.py [--published ../shared/data/published_runs.csv] [--skip-speed]``.

1. Speed, on one core (the process is pinned to CPU 0): the full space of
   GPT-3 175B on 1,024 A100 (gbs 1,536 x 2,048), Llama-3 405B on 16,384 H100 (gbs 2,048 x 8,192) and DeepSeek-V3
   on 2,048 H100 (gbs 15,360 x 4,096); prints the space size, how many plans were simulated, the wall time (best of
   three) and the plan found. Targets: 1 s, 5 s, 5 s.
2. Quality: for every published layout the validator can model (``python -m cfp_megatron.validate``), searches the
   same model on the same GPUs with the same global batch, sequence, precision and simulator options, and prints the
   published layout's predicted step time over the chosen plan's (a ratio of 1 or more: the search finds a plan at
   least as fast as the published one by the same simulator). The published layout is outside the search's space
   where it puts TP across nodes or does not fit the memory limit (HBM less the headroom); those rows say so, and
   under each the search is run again allowing what the published layout uses (its predicted peak memory, the GPU's
   capacity raised to it where the simulator puts it above; TP across nodes), with that ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from pathlib import Path

from cfp_megatron.base.cfp_spec import CfpSpec, SearchConstraints, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.search.search import Ranked, search
from cfp_megatron.sim.prediction import GIB

ROOT = Path(__file__).resolve().parent.parent

CASES = (
    ("GPT-3 175B, 1,024 A100", ["model=gpt3_175b", "cluster=dgx_a100", "cluster.nodes=128",
                                "train.global_batch_size=1536", "train.seq_length=2048"], 1.0),
    ("Llama-3 405B, 16,384 H100", ["model=llama3_405b", "cluster=dgx_h100", "cluster.nodes=2048",
                                   "train.global_batch_size=2048", "train.seq_length=8192"], 5.0),
    ("DeepSeek-V3, 2,048 H100", ["model=deepseek_v3", "cluster=dgx_h100", "cluster.nodes=256",
                                 "train.global_batch_size=15360", "train.seq_length=4096"], 5.0),
)


def speed() -> None:
    print(f"{'case':<28} {'layouts':>9} {'simulated':>9} {'seconds':>8} {'target':>7}  best plan")
    for name, overrides, target in CASES:
        cfg = compose_config(["+cfp=auto", *overrides])
        job, cfp = job_from_config(cfg), cfp_from_config(cfg)
        world = job.cluster.nodes * job.cluster.gpus_per_node
        times, result = [], None
        for _ in range(3):
            result = search(job, world, cfp)
            times.append(result.seconds)
        if result.ranked:
            best = result.best
            found = (f"{best.candidate.describe(world)}: {best.prediction.step_time_s:.3f} s, "
                     f"{best.prediction.memory.total / GIB:.1f} GiB")
        else:
            pps = sorted({int(r.what[3:]) for r in result.rejected if r.what.startswith("pp=")})
            found = (f"no plan fits ({result.over_memory:,} over memory; PP sizes ruled out by the layer count: "
                     f"{pps[:6]}...)")
        print(f"{name:<28} {result.space_size:>9,} {result.simulated:>9} {min(times):>8.3f} {target:>7.1f}  {found}",
              flush=True)


def published(path: Path) -> None:
    from cfp_megatron.sim.simulate import simulate
    from cfp_megatron.validate import RowError, read_rows, row_plan

    print(f"\n{'row':>4} {'model':<22} {'GPUs':>6} {'published layout':<34} {'published s':>11} {'chosen s':>9} "
          f"{'ratio':>6}  chosen")
    ratios: list[float] = []
    allowed: list[float] = []  # the ratio where the published layout is in the space, else the re-searched one
    for row in read_rows(path):
        try:
            rp = row_plan(row)
        except RowError:
            continue
        if rp.options.measured_layer_only:
            continue
        job = rp.job
        world = job.cluster.nodes * job.cluster.gpus_per_node
        ref = simulate(job, options=rp.options, world_size=world)
        cfp = CfpSpec(top_k=1, constraints=SearchConstraints())
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
        ratio = _row(head, ref.step_time_s, result.best, world, note)
        ratios.append(ratio)
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
            same_cfp = CfpSpec(top_k=1, constraints=SearchConstraints(
                memory_headroom=headroom, tp_within_node=job.parallel.tp <= job.cluster.gpus_per_node))
            same = search(dataclasses.replace(job, cluster=cluster), world, same_cfp, options=rp.options).best
            allowed.append(_row(f"{'':>4} {'':<22} {'':>6} {'  same memory as published':<34} {'':>11}",
                                ref.step_time_s, same, world, ""))
    if ratios:
        below = sum(r < 1 - 1e-9 for r in ratios)
        print(f"ratio published/chosen over {len(ratios)} rows: min {min(ratios):.3f}, median "
              f"{statistics.median(ratios):.3f}, max {max(ratios):.3f}; rows where the chosen plan is slower: {below}")
        print(f"with the published layout's own memory (and TP placement) allowed: min {min(allowed):.3f}; rows "
              f"where the chosen plan is slower: {sum(r < 1 - 1e-9 for r in allowed)}")


def _row(head: str, published_s: float, chosen: Ranked, world: int, note: str) -> float:
    """Print one row (``head``: the published layout's columns) and return published / chosen step time."""
    ratio = published_s / chosen.prediction.step_time_s
    print(f"{head} {chosen.prediction.step_time_s:>9.3f} {ratio:>6.3f}  {chosen.candidate.describe(world)}{note}",
          flush=True)
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--published", default=str(ROOT.parent / "shared" / "data" / "published_runs.csv"))
    parser.add_argument("--skip-speed", action="store_true")
    args = parser.parse_args()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    if not args.skip_speed:
        t = time.perf_counter()
        speed()
        print(f"(speed cases in {time.perf_counter() - t:.1f} s)")
    if args.published and Path(args.published).exists():
        published(Path(args.published))


if __name__ == "__main__":
    main()
