"""Checks of a composed job that need no process group (run on every rank before any group exists), and where the
run's files go."""

from __future__ import annotations

from pathlib import Path

from cfp_megatron.base.config import AttentionKind, DataKind, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.base.pipeline_layout import MTP, layout_stages


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
    if dims is not None:
        issues += _mtp_stage_issues(job, dims)
    if issues or dims is None:
        raise ConfigError(issues)
    return dims


def validate_rest(job: JobSpec) -> None:
    """The checks of :func:`validate_job` that do not involve the layout (a planned run's layout comes later): the
    attention kind against Transformer Engine, and the data files when data.kind=indexed."""
    issues = _rest_issues(job)
    if issues:
        raise ConfigError(issues)


def _mtp_stage_issues(job: JobSpec, dims: ParallelDims) -> list[ConfigIssue]:
    """MTP layers in a stage without the loss: Megatron-Core runs such a standalone MTP stage (it then exchanges
    tensor shapes before each transfer), but on gloo that exchange hung in our runs, and the embedding copy of an MTP
    chunk that shares a rank with the first stage has no gradient sync in Megatron-Core 0.16 (by its code:
    ``finalize_model_grads`` reduces one embedding per rank); the runtime trains the
    MTP layers in the stage that holds the loss, where Megatron-Core puts them without a layout. (Learned positions
    under pipelining, which MTP cannot train with either, are refused by the layout checks, for plans too.)"""
    layout = job.parallel.pipeline_model_parallel_layout
    if not job.model.mtp_num_layers or dims.pp == 1 or layout is None or MTP in layout_stages(layout)[-1]:
        return []
    return [ConfigIssue(
        key="parallel.pipeline_model_parallel_layout", value=layout,
        problem="its MTP layers (m) sit in a stage without the loss (L); this runtime trains them only in the last "
                "stage, beside the loss (a standalone MTP stage is planned and simulated, not trained).",
        fix="write the m's in the last stage, before the L (e.g. ...|tt|mL).")]


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
    if job.data.kind is DataKind.indexed:
        try:
            validate_indexed(job)
        except ConfigError as err:
            issues.extend(err.issues)
    return issues
