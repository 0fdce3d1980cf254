"""From a composed Hydra config to a finished run: validate, check checkpoints, set up groups, train."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from cfp_megatron.config import AttentionKind, DataKind, JobSpec, job_from_config
from cfp_megatron.errors import CfpError, ConfigError, ConfigIssue
from cfp_megatron.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.runtime.launch_env import LaunchEnv


def hydra_run_dir() -> Path | None:
    """The Hydra run directory when called inside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def validate_job(job: JobSpec, world_size: int) -> ParallelDims:
    """Every check that needs no process group: the layout, and the data files when data.kind=indexed.

    Problems from both are raised together in one ConfigError.
    """
    issues: list[ConfigIssue] = []
    dims: ParallelDims | None = None
    try:
        dims = ParallelDims.build(job, world_size)
    except ConfigError as err:
        issues.extend(err.issues)
    if job.model.attention is AttentionKind.mla and not transformer_engine_available():
        issues.append(ConfigIssue(
            key="model.attention", value="mla",
            problem="Megatron-Core's multi-latent attention runs only on Transformer Engine's DotProductAttention "
                    "(its local attention has no separate key/value head sizes), and Transformer Engine is not "
                    "installed.",
            fix="install transformer-engine (GPU), or approximate MLA with multi-head attention: "
                "model.attention=standard model.kv_channels=192."))
    if job.data.kind is DataKind.indexed:
        from cfp_megatron.data.indexed import validate_indexed

        try:
            validate_indexed(job)
        except ConfigError as err:
            issues.extend(err.issues)
    if issues or dims is None:
        raise ConfigError(issues)
    return dims


def train_from_config(cfg: Any) -> list:
    """Validate ``cfg`` completely before any process group exists, then train; return rank 0's step metrics."""
    from cfp_megatron.runtime import checkpoint

    env = LaunchEnv.read()
    job = job_from_config(cfg)
    dims = validate_job(job, env.world_size)
    start_step = checkpoint.check_before_start(job.train.checkpoint_dir, resume=job.train.resume,
                                               restarted=env.restart_count > 0)
    if job.train.metrics_file is not None:
        metrics_path: Path | None = Path(job.train.metrics_file)
    else:
        run_dir = hydra_run_dir()
        metrics_path = run_dir / "metrics.jsonl" if run_dir is not None else None

    from cfp_megatron.compat import moe
    from cfp_megatron.compat.cpu import install_if_needed

    install_if_needed()
    if job.model.is_moe and not transformer_engine_available():
        moe.install()
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
            console = Console(stderr=True, highlight=False, soft_wrap=True)
            console.print(f"[bold red]cfp-megatron: {type(err).__name__}[/]")
            console.print(str(err), markup=False)
        sys.exit(2)
