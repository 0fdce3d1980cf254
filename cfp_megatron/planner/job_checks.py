"""Checks of a composed job that need no process group (run on every rank before any group exists), and where the
run's files go."""

from __future__ import annotations

from pathlib import Path

from cfp_megatron.base.config import AttentionKind, DataKind, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available


def hydra_run_dir() -> Path | None:
    """The Hydra run directory when called inside a Hydra app."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir) if HydraConfig.initialized() else None


def validate_job(job: JobSpec, world_size: int) -> ParallelDims:
    """Every check that needs no process group: the layout, and what :func:`validate_rest` checks.

    Problems from both are raised together in one ConfigError.
    """
    issues: list[ConfigIssue] = []
    dims: ParallelDims | None = None
    try:
        dims = ParallelDims.build(job, world_size)
    except ConfigError as err:
        issues.extend(err.issues)
    issues += _rest_issues(job)
    if issues or dims is None:
        raise ConfigError(issues)
    return dims


def validate_rest(job: JobSpec) -> None:
    """The checks of :func:`validate_job` that do not involve the layout (a planned run's layout comes later): the
    attention kind against Transformer Engine, and the data files when data.kind=indexed."""
    issues = _rest_issues(job)
    if issues:
        raise ConfigError(issues)


def _rest_issues(job: JobSpec) -> list[ConfigIssue]:
    from cfp_megatron.data.indexed import validate_indexed

    issues: list[ConfigIssue] = []
    if job.model.attention is AttentionKind.mla and not transformer_engine_available():
        issues.append(ConfigIssue(
            key="model.attention", value="mla",
            problem="Megatron-Core's multi-latent attention runs only on Transformer Engine's DotProductAttention "
                    "(its local attention has no separate key/value head sizes), and Transformer Engine is not "
                    "installed.",
            fix="install transformer-engine (GPU), or approximate MLA with multi-head attention: "
                "model.attention=standard model.kv_channels=192."))
    if job.model.mtp_num_layers:
        issues.append(ConfigIssue(
            key="model.mtp_num_layers", value=job.model.mtp_num_layers,
            problem="the runtime does not build Megatron-Core's multi-token-prediction block yet (its passes run "
                    "on CPU, but its chunk placement, the embedding it shares with the first stage over the "
                    "pipeline and its loss are not wired and checked against the single-rank reference); the "
                    "planner, the simulator and the validator price it, so plan with it but train without.",
            fix="set model.mtp_num_layers=0 to train (and drop the m's from parallel.pipeline_model_parallel_layout)."))
    if job.data.kind is DataKind.indexed:
        try:
            validate_indexed(job)
        except ConfigError as err:
            issues.extend(err.issues)
    return issues
