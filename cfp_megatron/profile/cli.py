"""``torchrun --nproc_per_node=N -m cfp_megatron.profile [overrides] [--budget S] [--repeats N] [--force]
[--export FILE]``."""

from __future__ import annotations

import argparse
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

from cfp_megatron.base.cfp_spec import DEFAULT_PROFILE_BUDGET_S
from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config_help import config_help
from cfp_megatron.base.cuda_env import set_runtime_env
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import CACHE_KEY, WriteLocation, cache_dir, check_write_locations
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.compat.import_cost import import_megatron
from cfp_megatron.compat.quiet import quiet_expected_warnings, say_once
from cfp_megatron.engine import rank_watch
from cfp_megatron.profile.cluster import describe_cluster, measured_cluster
from cfp_megatron.profile.db import export_db
from cfp_megatron.profile.progress import RoundProgress
from cfp_megatron.profile.report import render


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Hydra overrides plus the profiler's own options."""

    parser = argparse.ArgumentParser(prog="torchrun --nproc_per_node=N -m cfp_megatron.profile",
                                     description="Profile the live cluster (collectives, GEMMs, segments) into "
                                                 "the ProfileDB of its fingerprint.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=config_help())
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. model=gpt_tiny cluster=local")
    parser.add_argument("--budget", type=float, default=DEFAULT_PROFILE_BUDGET_S, help="seconds for the whole run")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed repeats of every probe (cfp.profile_repeats; default: each probe's own count)")
    parser.add_argument("--force", action="store_true", help="measure again even if the DB has the results")
    parser.add_argument("--export", default=None, help="also write the DB to this file (never over an existing one)")
    args = parser.parse_args(argv)
    if args.budget <= 0:
        parser.error(f"--budget={args.budget}: must be positive (seconds), e.g. --budget 60")
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats}: must be 1 or more, e.g. --repeats 1 for a quick profile")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Profile, print the summary and the DB path on rank 0; exit status 2 on a user error."""

    rank_watch.tie_to_launcher()  # under torchrun: end with it; Ctrl-C said in one line
    set_runtime_env()  # before CUDA starts
    note = quiet_expected_warnings()  # before Megatron-Core is imported (by the runner)
    import_megatron()  # with its import costs cut (compat/import_cost.py)
    from cfp_megatron.profile.runner import busy_hint, completion_hint, profile_job

    warnings.filterwarnings("ignore", category=FutureWarning, module="torch.distributed")
    args = parse_args(argv)
    say_once(note)
    from rich.console import Console

    env = LaunchEnv.read()
    console = Console(stderr=False, highlight=False)
    try:
        job = compose_job(args.overrides, typed=True, runs_hydra=False)
        # where the ProfileDB (and --export) go, refused now rather than after the whole budget
        check_write_locations([WriteLocation(key=CACHE_KEY, path=cache_dir() / "profile",
                                             folder=True),
                               *([WriteLocation(key="--export", path=Path(args.export), folder=False, new=True)]
                                 if args.export else [])])

        with RoundProgress(enabled=env.rank == 0) as progress:
            outcome = profile_job(job, env, budget_s=args.budget, force=args.force, progress=progress.update,
                                  repeats=args.repeats)
        if env.rank == 0 and outcome.db is not None:
            ran = {r.name for r in outcome.rounds}
            render(outcome.db, (*outcome.rounds, *(r for r in outcome.coverage if r.name not in ran)),
                   console=console)
            for note in outcome.notes:
                console.print(f"note: {note}", markup=False)
            for line in (*completion_hint(outcome, args.overrides, env.world_size),
                         *busy_hint(outcome, args.overrides, env.world_size)):
                console.print(f"note: {line}", markup=False)
            cluster = measured_cluster(job.cluster, outcome.db, gpus_per_node=outcome.db.fingerprint.gpus_per_node)
            console.print(f"cluster {cluster.name} with measured figures: {describe_cluster(cluster)}", markup=False)
            state = "reused (nothing measured)" if outcome.reused else f"profiled in {outcome.wall_s:.1f} s"
            state += f", {outcome.measured_under}" if outcome.measured_under else ""
            console.print(f"ProfileDB: {outcome.path} ({state})", markup=False)
            if args.export:
                console.print(f"exported: {export_db(outcome.db, args.export, key='--export')}", markup=False)
    except (CfpError, RuntimeError, OSError, KeyboardInterrupt) as caught:
        err = rank_watch.explained(caught)  # a stalled rank or Ctrl-C too, said once
        if err is None:
            raise
        if rank_watch.my_turn(err, env.rank):
            err_console = Console(stderr=True, highlight=False, soft_wrap=True)
            title, body = rank_watch.error_text(err, env.rank)
            err_console.print(title, style="bold red", markup=False)
            if body:
                err_console.print(body, markup=False)
            rank_watch.said(err)
        return rank_watch.exit_status(err)
    return 0


if __name__ == "__main__":
    sys.exit(main())
