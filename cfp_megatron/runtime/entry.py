"""From a composed Hydra config to a finished run: validate, check checkpoints, set up groups, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from cfp_megatron.config import job_from_config
from cfp_megatron.errors import CfpError
from cfp_megatron.parallel_dims import ParallelDims
from cfp_megatron.runtime.launch_env import LaunchEnv


def hydra_run_dir() -> Path | None:
    """The Hydra run directory when called inside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def train_from_config(cfg: Any) -> list:
    """Validate ``cfg`` completely before any process group exists, then train; return rank 0's step metrics."""
    from cfp_megatron.runtime import checkpoint

    env = LaunchEnv.read()
    job = job_from_config(cfg)
    dims = ParallelDims.build(job, env.world_size)
    start_step = checkpoint.check_before_start(job.train.checkpoint_dir, resume=job.train.resume,
                                               restarted=env.restart_count > 0)
    if job.train.metrics_file is not None:
        metrics_path: Path | None = Path(job.train.metrics_file)
    else:
        run_dir = hydra_run_dir()
        metrics_path = run_dir / "metrics.jsonl" if run_dir is not None else None

    from cfp_megatron.compat.cpu import install_if_needed

    install_if_needed()
    from cfp_megatron.runtime.distributed import destroy_distributed, init_distributed
    from cfp_megatron.runtime.trainer import run_training

    init_distributed(job, dims, env)
    try:
        return run_training(job, dims, env, start_step=start_step, metrics_path=metrics_path)
    finally:
        destroy_distributed()


def main_with_errors(cfg: Any) -> None:
    """Run :func:`train_from_config`; report user errors in one clean message (rank 0) and exit with status 2."""
    try:
        train_from_config(cfg)
    except CfpError as err:
        if LaunchEnv.read().rank == 0:
            Console(stderr=True, highlight=False).print(f"[bold red]cfp-megatron: {type(err).__name__}[/]\n{err}")
        sys.exit(2)
