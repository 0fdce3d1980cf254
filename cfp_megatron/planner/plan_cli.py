"""``python -m cfp_megatron.plan [overrides...]``: plan a job offline (preflight) and write ``plan.json``.

Composes the real Hydra configs with ``+cfp=auto`` and the overrides, e.g.::

    python -m cfp_megatron.plan model=gpt3_175b cluster=dgx_a100 cluster.nodes=128 train.global_batch_size=1536

searches the plans of the job's backend (``backend=deepspeed``: ZeRO; else Megatron-Core's layouts) on ``cluster.nodes
x cluster.gpus_per_node`` GPUs (``--world`` for the local cluster; without ``train.seq_length``, the model's context up
to 8,192 tokens is planned), prints the top plans, why the best wins, what was ruled out, and writes ``plan.json``
(never over an existing file), the Megatron-LM arguments, a DeepSpeed config and the torchrun command that reproduces
the plan. On the local cluster the ProfileDB of this machine (``python -m cfp_megatron.profile``) supplies measurements.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from cfp_megatron.backends.deepspeed.zero_plan import ds_config
from cfp_megatron.base.backend_spec import backend_from_config
from cfp_megatron.base.cfp_spec import CfpMode, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import MAX_WORLD_SIZE, job_from_config
from cfp_megatron.base.config_help import config_help
from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.base.files import WriteLocation, check_write_locations
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.base.parallel_dims import transformer_engine_available
from cfp_megatron.model.layer_spec import keyed_model
from cfp_megatron.plan import deepspeed_config, load_plan, megatron_lm_args, save_plan, torchrun_command
from cfp_megatron.plan.errors import PlanError
from cfp_megatron.plan.exports import check_exports, with_searched_token_policy, write_exports
from cfp_megatron.plan.requirements import plan_requirements
from cfp_megatron.planner.backends import backend_for
from cfp_megatron.planner.deepspeed_entry import check_layout
from cfp_megatron.planner.deepspeed_memory import check_zero_search_fits
from cfp_megatron.planner.job_checks import world_issues
from cfp_megatron.planner.memory_fit import check_no_plan
from cfp_megatron.planner.pictures import write_plan_pictures
from cfp_megatron.planner.preflight import default_lines, defaults_used
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.sim.calibration import identity_warnings
from cfp_megatron.sim.options import options_here

SEQ_CAP = 8192
"""Longest sequence planned when ``train.seq_length`` is not given (the pre-training context of today's LLMs)."""


def inputs_fingerprint(job: object, measurements_key: str | None) -> str:
    """A hash of what a plan was computed from: the model, cluster and training specs and the measurements used."""
    payload = {"model": keyed_model(job.model), "cluster": json_plain(job.cluster), "train": json_plain(job.train),
               "measurements": measurements_key or "presets"}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def planned_config(overrides: list[str]) -> tuple[Any, str | None]:
    """The config a preflight plans (composed as a person's command line), at the model's context where
    ``train.seq_length`` is not given (the training default, 64 tokens, is for the tiny CPU models), and the line
    that says so (``None`` where it was given)."""
    cfg = compose_config(overrides, typed=True, runs_hydra=False)
    if any(o.lstrip("+").startswith("train.seq_length=") for o in overrides):
        return cfg, None
    seq = min(int(cfg.model.max_position_embeddings), SEQ_CAP)
    note = (f"train.seq_length not given: planning {seq} tokens per sequence (the model's context, at most "
            f"{SEQ_CAP}); pass train.seq_length=N to change it")
    return compose_config([*overrides, f"train.seq_length={seq}"]), note


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cfp_megatron.plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (model=..., cluster=..., cfp.tp=4, ...)")
    parser.add_argument("--world", type=int, default=None, help="ranks (default: nodes x gpus_per_node)")
    parser.add_argument("--out", default=None, help="folder for plan.json and exports (default: outputs/plans/)")
    return run_reporting(_run, parser.parse_args(argv))


def run_reporting(run: Callable[[argparse.Namespace, Console], int], args: argparse.Namespace, *,
                  width: int = 150) -> int:
    """``run(args, console)`` on a rich console (``width`` columns where the output is not a terminal: wide tables
    in logs and pipes); a :class:`CfpError` is printed as one message and gives exit status 2."""
    console = Console(width=None if sys.stdout.isatty() else width)
    try:
        return run(args, console)
    except CfpError as err:
        # The message as written: rich would read its lists ("use one of [auto, fp32, ...]") as markup tags.
        console.print(f"cfp-megatron: {type(err).__name__}", style="red", markup=False)
        console.print(str(err), markup=False)
        return 2


def _run(args: argparse.Namespace, console: Console) -> int:
    overrides = list(args.overrides)
    if args.world is not None and not 1 <= args.world <= MAX_WORLD_SIZE:
        raise ConfigError(ConfigIssue(key="--world", value=args.world, problem=f"must be in [1, {MAX_WORLD_SIZE:,}] "
                                      "ranks (ten times the largest clusters built).", fix="pass a smaller --world."))
    if not any(o.lstrip("+").startswith("cfp=") for o in overrides):
        overrides.insert(0, "+cfp=auto")
    cfg, note = planned_config(overrides)
    if note:
        console.print(note)
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    if cfp.mode is CfpMode.manual:
        raise ConfigError(ConfigIssue(
            key="cfp", value="manual", problem="python -m cfp_megatron.plan searches a plan (+cfp=auto); +cfp=manual "
            "trains a plan given to it (cfp.plan_file, cfp.plan) or the parallel section as given, with nothing to "
            "search.", fix="drop +cfp=manual to plan; train a saved plan with torchrun ... launch/train.py "
            "+cfp=manual cfp.plan_file=<plan.json>."))
    backend = backend_from_config(cfg)
    check_write_locations([WriteLocation(key="cfp.plan_file", path=Path(cfp.plan_file), folder=False) if cfp.plan_file
                           else WriteLocation(key="--out", path=Path(args.out or "outputs/plans"), folder=True)])
    c = job.cluster
    world = args.world or (c.nodes * c.gpus_per_node if c.gpus_per_node else None)
    if world is None:
        raise ConfigError(ConfigIssue(key="--world", value=None, problem=f"cluster {c.name} does not say how many "
                                      "GPUs a node has.", fix="pass --world N, or set cluster.gpus_per_node."))
    issues = world_issues(job, world)  # whatever the layout: said once, not for each layout the search tries
    if issues:
        raise ConfigError(issues)
    if backend.is_deepspeed:
        check_layout(job, cfp)  # the pins its ZeRO search does not read: refused, not ignored
    measurements, cluster, key = None, c, None
    if c.gpus_per_node is None or c.name == "local":
        cluster, measurements = local_measurements(job, world_size=world)
        key = measurements.fingerprint.key if measurements is not None else None
    job = dataclasses.replace(job, cluster=cluster)
    console.print(f"planning {job.model.name} on {world} x {cluster.device_name} ({cluster.name}), global batch "
                  f"{job.train.global_batch_size} x {job.train.seq_length} tokens"
                  + ("" if measurements is None else f", measurements {key}"), markup=False)
    if job.model.is_moe:  # how its experts take their tokens (model.moe_expert_capacity_factor), priced as it runs
        m = job.model
        console.print("MoE routing: " + ("dropless (the token counts reach the host in every MoE layer)"
                                         if m.moe_dropless else
                                         f"token-drop at capacity factor {m.moe_expert_capacity_factor:g}"
                                         + (", padded to capacity" if m.moe_pad_expert_input_to_capacity else "")),
                      markup=False, soft_wrap=True)
    for line in default_lines(defaults_used(args.overrides, cfg, world=world, on_gpu=not cluster.on_cpu)):
        console.print(line, markup=False, soft_wrap=True)
    for line in identity_warnings(cluster):  # a generation missing or unknown: whose efficiencies price it instead
        console.print(line, markup=False, soft_wrap=True)
    if backend.is_deepspeed:  # no ZeRO plan fits: said in the memory checks' words (the launch's)
        check_zero_search_fits(dataclasses.replace(job, cluster=c), world, cfp, backend, on_gpu=not cluster.on_cpu,
                               figures=(cluster, measurements))
    found = backend_for(backend.name).search(job, world, cfp, backend, measurements=measurements,
                                             inputs_fingerprint=inputs_fingerprint(job, key),
                                             on_gpu=not cluster.on_cpu)
    found.report(console)
    if not found.plans and not backend.is_deepspeed:  # the cause named: a pin or set, or the memory (exit 2)
        measured = measurements is not None  # as the backend searched: a preflight for GPUs assumes TE
        check_no_plan(job, world, cfp, given=c, measurements=measurements,
                      te_available=transformer_engine_available() if measured else True,
                      options=options_here(cluster) if measured else None)
    plan = dataclasses.replace(found.best, cluster=job.cluster.name, requires=plan_requirements(found.best, job.model))
    if plan.requires:
        console.print("the plan needs:\n" + "\n".join(f"  {r}" for r in plan.requires), markup=False, soft_wrap=True)
    out = Path(args.out or "outputs/plans") / f"{job.model.name}-{plan.plan_hash()}"
    target = Path(cfp.plan_file) if cfp.plan_file else out / "plan.json"
    key = "cfp.plan_file" if cfp.plan_file else "--out"  # named when the disk refuses a file
    try:
        megatron_args = " ".join(megatron_lm_args(plan, num_layers=job.model.num_layers))
    except PlanError as err:  # a plan Megatron-LM cannot run (PrimePar's MLP, DeepSpeed's ZeRO): say so in the file
        megatron_args = f"# {err}"
    ds_json = ds_config(plan, job, base=backend.base_config()) if plan.zero is not None else deepspeed_config(plan)
    exports = {"megatron_args.txt": megatron_args + "\n",
               "deepspeed_config.json": json.dumps(ds_json, indent=2) + "\n",
               "torchrun.sh": torchrun_command(plan) + "\n"}
    check_exports(target.parent, exports)  # before plan.json: nothing is written beside a file it would overwrite
    if target.exists() and load_plan(target).plan_hash() == plan.plan_hash():
        console.print(f"plan.json: {target} (the same plan is already saved there)", markup=False)
    else:
        save_plan(plan, target, key=key)
        console.print(f"plan.json: {target}", markup=False)
    write_exports(target.parent, exports, plan=plan, key=key)  # all together, replacing an earlier plan's
    console.print(f"plan {plan.canonical()}\nhash {plan.plan_hash()}", markup=False)
    console.print(f"reproduce with:\n  {torchrun_command(plan)}", markup=False)
    console.print(f"Megatron-LM: {exports['megatron_args.txt'].strip()}", markup=False)
    pictured = with_searched_token_policy(plan, job, cfp.constraints.moe_token_policy)  # the policy it chose
    for line in write_plan_pictures(plan, pictured, world, measurements, target.parent, key=key):
        console.print(line, markup=False, soft_wrap=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
