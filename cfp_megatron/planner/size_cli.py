"""``cfp size [overrides...]`` (``python -m cfp_megatron.size``): how many GPUs of which kind train a token budget by
a deadline, and what it costs.

    cfp size model=llama3_70b train.tokens=15T train.global_batch_size=1024 train.seq_length=8192 \\
        cluster=[dgx_h100,gb200_nvl72] cluster.nodes=range(8,72,8) --deadline 90d --price 2.5

plans the job on each cluster preset at each node count (``[4,8,16]``, ``4,8,16`` or ``range(start,stop,step)``, the
stop left out as in Python) with the preflight's search, and prints per candidate the plan, its step time, the time
to train, GPU-hours, the GPUs' board energy and the price (each with its error band), the smallest cluster of each
kind that meets the deadline, and draws time to train against GPU-hours with the Pareto front marked. A kind that
fits nowhere in the range gets the smallest size that would (docs/sizing.md).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table
from rich.text import Text

from cfp_megatron.base.backend_spec import backend_from_config
from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.config_help import config_help
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import WriteLocation, check_write_locations, write_atomic
from cfp_megatron.plan.plots import free_path
from cfp_megatron.planner.plan_cli import planned_config, run_reporting
from cfp_megatron.planner.preflight import default_lines, defaults_used
from cfp_megatron.planner.size_picture import load_matplotlib, write_sizing_png
from cfp_megatron.planner.sizing import (
    DAY_S,
    TOKENS_KEY,
    Beyond,
    Planner,
    Sized,
    SizingRequest,
    beyond_range,
    count,
    duration_s,
    pareto_front,
    size_all,
    sizing_request,
    smallest_meeting,
)


def prices(given: Sequence[str], clusters: Sequence[str]) -> dict[str, float]:
    """``--price`` values: ``2.5`` for every preset, or ``preset=2.5`` for one (later ones win)."""
    out: dict[str, float] = {}
    for text in given:
        name, _, value = text.rpartition("=")
        if name and name not in clusters:
            raise ConfigError(ConfigIssue(key="--price", value=text, problem=f"names {name}, which is not among "
                                          f"the clusters sized ({', '.join(clusters)}).",
                                          fix="name one of them, e.g. --price " + f"{clusters[0]}=2.5."))
        price = count("--price", value)
        out.update({name: price} if name else dict.fromkeys(clusters, price))
    return out


MAX_JOBS = 4
"""Most processes ``--jobs`` starts by default (the searches are short; more mostly adds start-up)."""


def jobs(given: int | None) -> int:
    """``--jobs``: as given (at least 1), else the cores this process may use, at most :data:`MAX_JOBS`."""
    if given is not None:
        if given < 1:
            raise ConfigError(ConfigIssue(key="--jobs", value=given, problem="must be at least 1.",
                                          fix="pass --jobs 1 to plan in this process, or leave it out."))
        return given
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(cores, MAX_JOBS))


def planners(request: SizingRequest, console: Console) -> list[Planner]:
    """One planner per cluster preset, its config composed once (the node counts vary on the composed spec)."""
    out = []
    for i, preset in enumerate(request.clusters):
        overrides = list(request.overrides)
        if not any(o.lstrip("+").startswith("cfp=") for o in overrides):
            overrides.insert(0, "+cfp=auto")
        overrides += [f"cluster={preset}", f"cluster.nodes={request.nodes[0]}"]
        cfg, note = planned_config(overrides)
        if note and i == 0:
            console.print(note, markup=False)
        cfp = cfp_from_config(cfg)
        if cfp.mode is CfpMode.manual:
            raise ConfigError(ConfigIssue(key="cfp", value="manual", problem="cfp size searches a plan on each "
                                          "cluster; +cfp=manual applies one.", fix="drop +cfp=manual."))
        if backend_from_config(cfg).is_deepspeed:
            raise ConfigError(ConfigIssue(key="backend", value="deepspeed", problem="cfp size plans Megatron-Core's "
                                          "layouts (the DeepSpeed backend's ZeRO plans are not sized yet).",
                                          fix="drop backend=deepspeed; plan one ZeRO cluster with cfp plan."))
        job = job_from_config(cfg)
        if job.cluster.on_cpu or job.cluster.gpus_per_node is None:
            raise ConfigError(ConfigIssue(key="cluster", value=preset, problem="is not a GPU cluster preset with "
                                          "GPUs per node: sizing prices clusters from their datasheet figures.",
                                          fix="name GPU presets (conf/cluster/), e.g. cluster=[dgx_h100,b200]."))
        if i == 0:
            for line in default_lines(defaults_used(overrides, cfg, world=request.nodes[0] * job.cluster.gpus_per_node,
                                                    on_gpu=True)):
                console.print(line, markup=False, soft_wrap=True)
        out.append(Planner(job=job, cfp=cfp))
    return out


def _time(seconds: float) -> str:
    days = seconds / DAY_S
    return f"{days:,.1f} d" if days >= 1 else f"{seconds / 3600:,.1f} h"


def _banded(row: Sized, value: float | None, shown: str) -> str:
    band = row.banded(value)
    return shown if band is None else f"{shown} ±{row.band_pct:.0f}%"


def table(rows: Sequence[Sized], front: Sequence[Sized], meeting: dict[str, Sized | None]) -> Table:
    """The candidates as a rich table (``*``: on the Pareto front; ``<``: the smallest of its kind that meets the
    deadline)."""
    t = Table(title="candidate clusters (* Pareto front of time and GPU-hours, < smallest of its kind within the "
                    "deadline)", title_justify="left")
    for name in ("cluster", "GPUs", "plan", "step", "time to train", "GPU-hours", "energy (board)", "price", ""):
        t.add_column(name, justify="left" if name in ("cluster", "plan", "") else "right")
    on_front = {id(r) for r in front}
    chosen = {id(r) for r in meeting.values() if r is not None}
    for r in rows:
        marks = ("*" if id(r) in on_front else "") + ("<" if id(r) in chosen else "")
        if r.plan is None:
            cells = [r.cluster, f"{r.gpus:,}", f"no plan: {r.why_not}", "", "", "", "", "", ""]
        else:
            energy = "" if r.energy_mwh is None else _banded(r, r.energy_mwh, f"{r.energy_mwh:,.1f} MWh")
            cost = "" if r.cost is None else _banded(r, r.cost, f"{r.cost:,.0f}")
            cells = [r.cluster, f"{r.gpus:,}", r.plan, f"{r.step_time_s:.3g} s", _banded(r, r.time_s, _time(r.time_s)),
                     _banded(r, r.gpu_hours, f"{r.gpu_hours:,.0f}"), energy, cost, marks]
        t.add_row(*(Text(cell) for cell in cells))  # labels such as rc=selective[moe_act] are text, not markup
    return t


def deadline_lines(meeting: dict[str, Sized | None], deadline_s: float, rows: Sequence[Sized] = ()) -> list[str]:
    """The smallest cluster of each kind that meets the deadline, and whether it still does at its band's end; for
    a kind none of whose ``rows`` does, its fastest."""
    lines = [f"smallest cluster of each kind that trains within {_time(deadline_s)} (predicted):"]
    for cluster, row in meeting.items():
        if row is None:
            planned = [r for r in rows if r.cluster == cluster and r.time_s is not None]
            fastest = min(planned, key=lambda r: r.time_s, default=None)
            lines.append(f"  {cluster}: none of those sized" + ("" if fastest is None else
                         f" (the fastest, {fastest.gpus:,} GPUs, takes {_time(fastest.time_s)}: size it larger)"))
            continue
        high = row.banded(row.time_s)
        note = "" if high is None else (f" (within it also at the band's slow end, {_time(high[1])})"
                                        if high[1] <= deadline_s else
                                        f" (not at the band's slow end, {_time(high[1])}: size up to be sure)")
        lines.append(f"  {cluster}: {row.nodes} nodes, {row.gpus:,} GPUs, {_time(row.time_s)}{note}")
    return lines


def rows_json(rows: Sequence[Sized], front: Sequence[Sized], meeting: dict[str, Sized | None],
              beyond: Sequence[Beyond]) -> str:
    """The sizing for machines."""
    on_front, chosen = {id(r) for r in front}, {id(r) for r in meeting.values() if r is not None}
    out = [{"cluster": r.cluster, "device": r.device, "nodes": r.nodes, "gpus": r.gpus, "plan": r.plan,
            "why_not": r.why_not, "step_time_s": r.step_time_s, "peak_gib": r.peak_gib, "steps": r.steps,
            "time_to_train_s": r.time_s, "gpu_hours": r.gpu_hours, "energy_mwh": r.energy_mwh, "board_w": r.board_w,
            "price_per_gpu_hour": r.price_per_gpu_hour, "cost": r.cost, "band_pct": r.band_pct,
            "pareto": id(r) in on_front, "smallest_within_deadline": id(r) in chosen} for r in rows]
    return json.dumps({"candidates": out, "beyond_range": [b.line() for b in beyond]}, indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``cfp size``; exit status 2 for a bad setting (one message naming it)."""
    parser = argparse.ArgumentParser(prog="cfp size", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help())
    parser.add_argument("overrides", nargs="*", help=f"Hydra overrides: model=..., {TOKENS_KEY}=N, cluster=[a,b], "
                        "cluster.nodes=[...] or range(start,stop,step), train.global_batch_size=...")
    parser.add_argument("--deadline", default=None, help="time to train within, e.g. 90d, 720h")
    parser.add_argument("--price", action="append", default=[], help="price per GPU-hour: 2.5 for every cluster, or "
                        "preset=2.5 (repeat for each)")
    parser.add_argument("--jobs", type=int, default=None, help="processes that plan the candidates (default: the "
                        "cores this process may use, at most 4)")
    parser.add_argument("--out", default="outputs/sizing", help="folder for the PNG and JSON (default "
                        "outputs/sizing/; an existing file is never replaced)")
    return run_reporting(_run, parser.parse_args(sys.argv[1:] if argv is None else argv), width=180)


def _run(args: argparse.Namespace, console: Console) -> int:
    request = sizing_request(args.overrides)
    deadline = None if args.deadline is None else duration_s("--deadline", args.deadline)
    price = prices(args.price, request.clusters)
    out = Path(args.out)
    check_write_locations([WriteLocation(key="--out", path=out, folder=True)])
    found = planners(request, console)
    job = found[0].job
    console.print(f"sizing {job.model.name} for {request.tokens:,.4g} tokens (global batch "
                  f"{job.train.global_batch_size:,} x {job.train.seq_length:,} tokens) on "
                  f"{', '.join(request.clusters)} at {', '.join(map(str, request.nodes))} nodes", soft_wrap=True,
                  markup=False)
    rows = size_all(found, request.nodes, tokens=request.tokens, price_of=price.get, jobs=jobs(args.jobs),
                    meanwhile=load_matplotlib)
    front = pareto_front(rows)
    meeting = smallest_meeting(rows, deadline) if deadline is not None else {}
    console.print(table(rows, front, meeting))
    if deadline is not None:
        for line in deadline_lines(meeting, deadline, rows):
            console.print(line, markup=False, soft_wrap=True)
    beyond = [b for p in found if (b := beyond_range(p, rows, tokens=request.tokens,
                                                        price=price.get(p.job.cluster.name))) is not None]
    for b in beyond:
        console.print(b.line(), markup=False, soft_wrap=True)
    console.print("energy: the GPUs' board power (cluster.tdp_w, the datasheet's, or cluster.power_limit_w) times "
                  "their hours; hosts, network and cooling not counted. Bands: the simulator's error on published "
                  "runs of the plan's class (cfp_megatron/sim/error_bands.json).", soft_wrap=True, markup=False)
    stem = f"size-{job.model.name}-{datetime.now(UTC):%Y%m%d-%H%M%S}"
    json_path = write_atomic(free_path(out / f"{stem}.json"), rows_json(rows, front, meeting, beyond), key="--out")
    console.print(f"sizing JSON: {json_path}", markup=False)
    if any(r.plan is not None for r in rows):
        title = (f"{job.model.name}, {request.tokens:,.4g} tokens, batch {job.train.global_batch_size:,} x "
                 f"{job.train.seq_length:,}")
        png = write_sizing_png(rows, front, free_path(out / f"{stem}.png"), title=title, deadline_s=deadline,
                               key="--out")
        console.print(f"picture: {png}", markup=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
