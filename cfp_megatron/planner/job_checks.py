"""Checks of a composed job that need no process group (run on every rank before any group exists), and where the
run's files go."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from cfp_megatron.base.config import (
    AttentionKind,
    DataKind,
    FlexBackend,
    JobSpec,
    MlpPartition,
    Precision,
    TokenDispatcher,
    resolve_precision,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.layout_rules import batch
from cfp_megatron.base.layout_rules.problem import issues as rule_issues
from cfp_megatron.base.number_format import (
    NumberFormat,
    bf16_ends_issues,
    format_key,
    fp8_params_issues,
    presets_computing,
)
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.base.pipeline_layout import MTP, layout_stages
from cfp_megatron.model import layer_spec
from cfp_megatron.plan.requirements import FLEX_PACKAGES


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
    issues += rule_issues(batch.distributed_optimizer_kind(job.parallel.distributed_optimizer,
                                                           job.train.optimizer.value))  # Megatron-Core's own
    if dims is not None:
        issues += _mtp_stage_issues(job, dims)
    if issues or dims is None:
        raise ConfigError(issues)
    return dims


def validate_rest(job: JobSpec, world_size: int | None = None) -> None:
    """The checks of :func:`validate_job` that do not involve the layout (a planned run's layout comes later): the
    attention kind against Transformer Engine, the data files when data.kind=indexed, and with ``world_size`` the
    cluster's shape against it (:func:`world_issues`: every layout a search could try would be refused for it)."""
    issues = _rest_issues(job) + (world_issues(job, world_size) if world_size is not None else [])
    if issues:
        raise ConfigError(issues)


def world_issues(job: JobSpec, world_size: int) -> list[ConfigIssue]:
    """The cluster's ``nodes x gpus_per_node`` (where it states the GPUs per node) against the ranks started or
    planned: whatever the layout, so said before a search instead of once per layout it would try."""
    c = job.cluster
    return rule_issues(batch.cluster_world(world_size, c.nodes, c.gpus_per_node))


def check_node_shape(job: JobSpec, env: LaunchEnv) -> None:
    """Under torchrun, the cluster's shape against the ranks torchrun started on this node (``LOCAL_WORLD_SIZE``,
    the same on every node): ``cluster.gpus_per_node`` where set, and ``cluster.nodes`` (``WORLD_SIZE`` over the
    ranks of a node). A plan, its network and each rank's share of this host's memory are computed for the cluster's
    shape, so a shape other than the job's (``cluster.nodes=2`` with both ranks on this host: each planned with the
    whole host) is refused before any process group."""
    if not env.under_torchrun or env.local_world_size < 1 or env.world_size % env.local_world_size:
        return
    c, here = job.cluster, env.local_world_size
    nodes = env.world_size // here
    issues = []
    if c.gpus_per_node is not None and c.gpus_per_node != here:
        issues.append(ConfigIssue(key="cluster.gpus_per_node", value=c.gpus_per_node,
                                  problem=f"torchrun started {here} rank(s) on this node "
                                          f"(--nproc_per_node={here}): the plan and each rank's memory would be "
                                          f"those of {c.gpus_per_node} per node.",
                                  fix=f"set cluster.gpus_per_node={here}, or start {c.gpus_per_node} ranks per "
                                      "node."))
    if c.nodes != nodes:
        issues.append(ConfigIssue(key="cluster.nodes", value=c.nodes,
                                  problem=f"torchrun started {env.world_size} rank(s), {here} on this node: "
                                          f"{nodes} node(s) (--nnodes={nodes}); the plan, its network and each "
                                          f"rank's share of a node's memory would be those of {c.nodes} node(s).",
                                  fix=f"set cluster.nodes={nodes}, or start the job with torchrun "
                                      f"--nnodes={c.nodes}."))
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
    issues += format_runs_here(job) + flex_backend_runs_here(job)
    try:
        layer_spec.check(job.model)  # model.spec imports and gives a ModuleSpec: said before any process group
    except ConfigError as err:
        issues.extend(err.issues)
    if job.model.spec is not None and job.parallel.mlp is MlpPartition.primepar:
        issues.append(ConfigIssue(
            key="parallel.mlp", value="primepar",
            problem=f"PrimePar's layers replace Megatron-Core's own MLP, and model.spec={job.model.spec} gives the "
                    "layers of its own.", fix="use parallel.mlp=megatron with model.spec, or leave model.spec out."))
    if job.parallel.fp8_param_gather and job.train.precision is Precision.auto:
        import torch

        resolved = resolve_precision(Precision.auto, on_gpu=torch.cuda.is_available())
        issues += fp8_params_issues(True, NumberFormat(precision=resolved))
    if (job.parallel.num_layers_at_start_in_bf16 or job.parallel.num_layers_at_end_in_bf16) \
            and job.train.precision is Precision.auto:
        import torch

        resolved = resolve_precision(Precision.auto, on_gpu=torch.cuda.is_available())
        issues += bf16_ends_issues(job.parallel.num_layers_at_start_in_bf16, job.parallel.num_layers_at_end_in_bf16,
                                   NumberFormat(precision=resolved))
    if job.data.kind is DataKind.indexed:
        try:
            validate_indexed(job)
        except ConfigError as err:
            issues.extend(err.issues)
    return issues


def flex_backend_runs_here(job: JobSpec) -> list[ConfigIssue]:
    """The flex dispatcher's backend on this machine: on a GPU, a GPU cluster's MoE job with
    ``model.moe_token_dispatcher=flex`` needs ``deep_ep`` with the backend's class
    (:data:`~cfp_megatron.plan.requirements.FLEX_PACKAGES`); refused with the key, the value and the fix where it
    is missing, before Megatron-Core's dispatcher would raise inside the first MoE layer. A CPU cluster refuses the
    flex dispatcher in the layout checks; a machine without a GPU (planning for another) is not checked."""
    import torch

    model, backend = job.model, job.parallel.moe_flex_dispatcher_backend
    if (not model.is_moe or model.moe_token_dispatcher is not TokenDispatcher.flex or job.cluster.on_cpu
            or not torch.cuda.is_available()):
        return []
    name, source = FLEX_PACKAGES[backend]
    try:
        found = importlib.util.find_spec("deep_ep") is not None and hasattr(importlib.import_module("deep_ep"), name)
    except ImportError:  # built for another CUDA or torch
        found = False
    if found:
        return []
    other = next(b for b in FlexBackend if b is not backend)
    return [ConfigIssue(key="parallel.moe_flex_dispatcher_backend", value=backend.value,
                        problem=f"the flex dispatcher's {backend.value} backend runs deep_ep.{name}, which this "
                                "machine's Python does not have.",
                        fix=f"install {source}, or set parallel.moe_flex_dispatcher_backend={other.value} (if its "
                            "package is installed) or model.moe_token_dispatcher=alltoall.")]


_TE_CHECKS: dict[str, str] = {"fp8-delayed": "check_fp8_support", "fp8-tensorwise": "check_fp8_support",
                              "fp8-blockwise": "check_fp8_block_scaling_support", "fp8-mxfp8": "check_mxfp8_support",
                              "fp4-nvfp4": "check_nvfp4_support"}
"""Transformer Engine's own test of whether this GPU (and build) runs each format
(``transformer_engine.pytorch.fp8``)."""


def format_runs_here(job: JobSpec) -> list[ConfigIssue]:
    """The job's FP8/FP4 format on this machine: Megatron-Core runs it only through Transformer Engine on a GPU
    that computes it (Transformer Engine's ``check_*_support``); refused with the key, the value and the fix where
    either is missing (always on a CPU machine). 16- and 32-bit formats run everywhere. The plan CLI, which plans
    for other machines, does not run this check."""
    import torch

    fmt = NumberFormat.of(job.train)
    if not fmt.low:
        return []
    key = format_key(fmt)
    value = job.train.fp8_recipe.value if key == "train.fp8_recipe" else job.train.precision.value
    fix = ("train with train.precision=bf16 here, or on a GPU machine with Transformer Engine installed that "
           f"computes {fmt.needs} ({', '.join(presets_computing(fmt))}); python -m cfp_megatron.plan "
           f"{' '.join(fmt.overrides())} plans it on any machine.")
    if not transformer_engine_available() or not torch.cuda.is_available():
        missing = " and ".join(w for w, ok in (("Transformer Engine", transformer_engine_available()),
                                               ("a GPU", torch.cuda.is_available())) if not ok)
        return [ConfigIssue(key=key, value=value, problem=f"{fmt.name} runs its GEMMs only in Transformer Engine's "
                            f"layers on a GPU, and this machine has no {missing}.", fix=fix)]
    from transformer_engine.pytorch import fp8 as te_fp8

    check = getattr(te_fp8, _TE_CHECKS[fmt.name], None)
    if check is None:
        return [ConfigIssue(key=key, value=value, problem=f"the installed Transformer Engine has no {fmt.name} "
                            f"recipe ({_TE_CHECKS[fmt.name]} is missing).",
                            fix="install a Transformer Engine that has it (NVFP4: 2.8 or later), or " + fix)]
    supported, reason = check()
    if not supported:
        return [ConfigIssue(key=key, value=value, problem=f"this GPU ({torch.cuda.get_device_name()}) does not run "
                            f"{fmt.name}: {reason}", fix=fix)]
    return []
