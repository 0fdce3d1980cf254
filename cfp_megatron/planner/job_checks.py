"""Checks of a composed job that need no process group (run on every rank before any group exists), and where the
run's files go."""

from __future__ import annotations

from pathlib import Path

from cfp_megatron.base.config import AttentionKind, DataKind, JobSpec, PositionEmbedding
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
    """What the runtime refuses of MTP layers under pipelining. Megatron-Core (0.16) builds an embedding copy in
    the MTP layers' chunk; with learned absolute positions, the copy's position table is neither tied to the first
    stage's in checkpoints (their save fails its sharding check) nor synced with it (the position-embedding group is
    the first stage alone). A standalone MTP stage (MTP layers in a stage without the loss) is Megatron-Core's too
    (it then exchanges tensor shapes before each transfer), but on gloo that exchange hung in our runs; the runtime
    trains the MTP layers in the stage that holds the loss, where Megatron-Core puts them without a layout."""
    m, layout = job.model, job.parallel.pipeline_model_parallel_layout
    if not m.mtp_num_layers or dims.pp == 1:
        return []
    issues: list[ConfigIssue] = []
    if m.position_embedding is PositionEmbedding.learned_absolute:
        issues.append(ConfigIssue(
            key="model.position_embedding", value=m.position_embedding.value,
            problem=f"model.mtp_num_layers={m.mtp_num_layers} with parallel.pp={dims.pp}: the MTP layers' stage "
                    "keeps its own copy of the learned position table, which Megatron-Core neither syncs nor "
                    "checkpoints with the first stage's.",
            fix="use rotary positions (model.position_embedding=rope, as MTP models do), or parallel.pp=1."))
    if layout is not None and MTP not in layout_stages(layout)[-1]:
        issues.append(ConfigIssue(
            key="parallel.pipeline_model_parallel_layout", value=layout,
            problem="its MTP layers (m) sit in a stage without the loss (L); this runtime trains them only in the "
                    "last stage, beside the loss (a standalone MTP stage is planned and simulated, not trained).",
            fix="write the m's in the last stage, before the L (e.g. ...|tt|mL)."))
    return issues


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
