"""One validated object for the parallel sizes of a job (after torchtitan's ``ParallelDims``).

:meth:`ParallelDims.build` checks everything that involves more than one config group (world size against the
parallel sizes, heads against TP, layers against PP x VPP, experts against EP, batch against DP, sequence against
CP/SP, options that do not go together) and raises one :class:`~cfp_megatron.base.errors.ConfigError` listing every
problem. It is pure: it runs before any process group exists. The rules themselves are
:mod:`cfp_megatron.base.layout_rules`' (the search's screens call the same ones); this module applies them to a job.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

from cfp_megatron.base.config import (
    MAX_MICROBATCHES,
    MAX_WORLD_SIZE,
    AttentionKernel,
    AttentionKind,
    CpCommType,
    CudaGraphImpl,
    JobSpec,
    MlpPartition,
    ModelSpec,
    ParallelSpec,
    PositionEmbedding,
    Recompute,
    TokenDispatcher,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.layout_rules import batch, graphs, moe, offload, pipeline, recompute, sequence, tensor
from cfp_megatron.base.layout_rules.problem import Problem
from cfp_megatron.base.layout_rules.problem import issues as rule_issues
from cfp_megatron.base.pipeline_layout import layout_stages
from cfp_megatron.base.pipeline_split import chunk_layers, job_chunks, max_chunk_count, split_issues


def transformer_engine_available() -> bool:
    """Whether Transformer Engine can be imported (it provides CP attention and fused kernels)."""
    return importlib.util.find_spec("transformer_engine") is not None


def masked_softmax_fusion_here() -> bool:
    """Whether Megatron's fused masked-softmax CUDA extension imports (Apex's or Megatron's own build)."""
    return importlib.util.find_spec("scaled_masked_softmax_cuda") is not None


def attention_kernel_here(*, on_gpu: bool) -> AttentionKernel:
    """How Megatron-Core runs the attention core on this machine as the runtime builds the model: on a GPU,
    Transformer Engine's fused attention where it imports (:mod:`cfp_megatron.engine.model`), else Megatron's unfused
    core, with its fused softmax kernel where that CUDA extension imports (:mod:`cfp_megatron.model.megatron_config`);
    on CPU the local spec's unfused core with PyTorch's softmax (the fusions are CUDA-only)."""
    if not on_gpu:
        return AttentionKernel.torch_softmax
    if transformer_engine_available():
        return AttentionKernel.flash
    if masked_softmax_fusion_here():
        return AttentionKernel.fused_softmax
    return AttentionKernel.torch_softmax


def grouped_gemm_here(*, on_gpu: bool) -> bool:
    """Whether the runtime runs the routed experts as one grouped GEMM a linear (Megatron-Core's
    ``moe_grouped_gemm``): on a GPU where Transformer Engine imports, never on CPU."""
    return on_gpu and transformer_engine_available()


def router_fusion_here(*, on_gpu: bool) -> bool:
    """Whether the runtime can run a MoE router with Megatron-Core's ``moe_router_fusion`` (Transformer Engine's
    fused top-k and auxiliary-loss kernels, which Megatron-Core raises for without it): on a GPU where Transformer
    Engine imports, never on CPU. Read by :mod:`cfp_megatron.model.megatron_config` and
    :func:`cfp_megatron.sim.options.options_here`."""
    return on_gpu and transformer_engine_available()


def gradient_accumulation_fusion_here() -> bool:
    """Whether the runtime builds Megatron-Core's linears with ``gradient_accumulation_fusion`` (the weight-gradient
    GEMM writing into ``main_grad``): never, on a GPU too, so its weight gradients join the step's through Megatron's
    DDP hook (docs/simulator.md, "Weight-gradient accumulation", says why the fusion stays off). Read by
    :mod:`cfp_megatron.model.megatron_config` and :func:`cfp_megatron.sim.options.options_here`."""
    return False


def rope_fusion_here() -> bool:
    """Whether the runtime applies rotary position embeddings with Megatron-Core's fused kernel
    (``apply_rope_fusion``): never, Megatron-Core's default, so each layer's unfused RoPE keeps the cos and sin it
    multiplies Q and K by, on a GPU as on CPU. Read by :mod:`cfp_megatron.model.megatron_config` and
    :func:`cfp_megatron.sim.options.options_here`."""
    return False


def sequence_parallel_required(model: ModelSpec, tp: int) -> bool:
    """Whether Megatron-Core requires sequence parallelism for ``model`` under ``tp``-way tensor parallelism
    (:func:`cfp_megatron.base.layout_rules.sequence.sequence_parallel_required`)."""
    return sequence.sequence_parallel_required(model.is_moe, tp)


def has_dense_mlp(model: ModelSpec) -> bool:
    """Whether ``model`` has dense MLP layers (not MoE, or MoE after some dense layers)."""
    return not model.is_moe or model.moe_first_dense_layers > 0


def model_parts(model: ModelSpec) -> recompute.ModelParts:
    """What the recomputation rules read of ``model``."""
    return recompute.ModelParts(name=model.name, moe=model.is_moe, dense_layers=has_dense_mlp(model),
                                shared_expert=bool(model.moe_shared_expert_intermediate_size),
                                attention=model.attention.value)


def moe_problems(job: JobSpec, world_size: int) -> list[Problem]:
    """The expert sizes and overlaps of ``job`` on ``world_size`` ranks against its model
    (:mod:`cfp_megatron.base.layout_rules.moe`)."""
    m, p, c = job.model, job.parallel, job.cluster
    backend = moe.flex_backend(backend=p.moe_flex_dispatcher_backend.value,
                               dispatcher=m.moe_token_dispatcher.value)
    if not m.is_moe:
        return [*moe.dense_model(model=m.name, a2a_overlap=p.moe_a2a_overlap,
                                 shared_overlap=p.moe_shared_expert_overlap, ep=p.ep, etp=p.etp), *backend]
    return [*backend, *moe.experts(m.num_experts, p.ep),
            *moe.expert_ffn(m.moe_ffn_hidden_size or m.ffn_size, p.expert_tp),
            *moe.shared_expert(m.moe_shared_expert_intermediate_size, p.tp),
            *moe.expert_world(world_size, p.expert_tp, p.ep, p.pp),
            *moe.overlap_dispatcher(overlaps=[name for name in moe.OVERLAPS if getattr(p, name)],
                                    dispatcher=m.moe_token_dispatcher.value),
            *moe.a2a_overlap_needs_ep(p.moe_a2a_overlap, p.ep),
            *moe.overlaps_on_gpu(a2a_overlap=p.moe_a2a_overlap, shared_overlap=p.moe_shared_expert_overlap,
                                 has_shared=bool(m.moe_shared_expert_intermediate_size), model=m.name,
                                 flex=m.moe_token_dispatcher is TokenDispatcher.flex, on_cpu=c.on_cpu)]


def recompute_problems(job: JobSpec, *, te: bool = True) -> list[Problem]:
    """The checks of :meth:`ParallelDims.build` that read the recompute choice (granularity, method, layer count,
    modules), and only those: a job that differs from one that passed it only in its recomputation passes it too
    where these pass (a search validates the recompute choices of one layout so; ``tests/test_layout_rules.py``
    checks it)."""
    return [*_modules_problems(job, te), *_block_problems(job),
            *(graph_problems(job) if job.parallel.cuda_graph_impl is not CudaGraphImpl.none else [])]


def _modules_problems(job: JobSpec, te: bool) -> list[Problem]:
    """The submodules selective recomputation recomputes, against the model."""
    p = job.parallel
    recomputed = p.recomputed_modules
    if not recomputed:
        return []
    return recompute.modules_fit({module.value for module in recomputed}, model_parts(job.model),
                                 named=p.recompute_modules, shared_overlap=p.moe_shared_expert_overlap, te=te)


def _split_arguments(job: JobSpec) -> tuple[dict[str, bool], dict[str, Any]]:
    """What the split checks read besides the layer and stage counts: whether the embedding and the loss count as
    layers of the split, and the per-stage layout string and MTP layers."""
    m, p = job.model, job.parallel
    accounted = {"embedding": p.account_for_embedding_in_pipeline_split and p.pp > 1,
                 "loss": p.account_for_loss_in_pipeline_split and p.pp > 1}
    return accounted, {"layout": p.pipeline_model_parallel_layout if p.pp > 1 else None, "mtp": m.mtp_num_layers}


def _block_problems(job: JobSpec) -> list[Problem]:
    """Full recomputation's layers per model chunk (both methods: uniform's group and block's recomputed layers per
    chunk) against the split."""
    m, p = job.model, job.parallel
    if p.recompute is not Recompute.full:
        return []
    vpp = p.virtual_stages
    accounted, layout = _split_arguments(job)
    valid = not split_issues(m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers,
                             **accounted, **layout) and not (layout["layout"] and len(
                                 layout_stages(layout["layout"])) != p.pp * vpp)
    layers_per_chunk = max_chunk_count(chunk_layers(
        m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers, **accounted,
        layout=layout["layout"])) if valid else 0
    return recompute.block_layers(p.recompute_num_layers, layers_per_chunk)


def graph_model_problems(job: JobSpec) -> list[Problem]:
    """The CUDA graph scope of ``job`` against its model, whatever the layout
    (:func:`cfp_megatron.base.layout_rules.graphs.model_scopes`); none without graphs."""
    m, p = job.model, job.parallel
    if p.cuda_graph_impl is CudaGraphImpl.none:
        return []
    return graphs.model_scopes(p.graph_scopes(), moe=m.is_moe, dense_layers=has_dense_mlp(m),
                               drop_pad=m.moe_pad_expert_input_to_capacity,
                               capacity=m.moe_expert_capacity_factor is not None,
                               dispatcher=m.moe_token_dispatcher.value)


def graph_problems(job: JobSpec) -> list[Problem]:
    """The CUDA graphs of ``job`` against its model and recomputation (:mod:`cfp_megatron.base.layout_rules.graphs`)."""
    m, p = job.model, job.parallel
    scopes = p.graph_scopes()
    return [*graph_model_problems(job),
            *graphs.with_recompute(scopes, impl=p.cuda_graph_impl.value, recompute=p.recompute.value,
                                   modules=frozenset(mod.value for mod in p.recomputed_modules),
                                   attention_dropout=m.attention_dropout, hidden_dropout=m.hidden_dropout)]


def data_parallel_size(world_size: int, tp: int, cp: int, pp: int) -> int:
    """Data-parallel size of dense weights: what the world leaves, ``world / (tp x cp x pp)`` (at least 1)."""
    return max(world_size // (tp * cp * pp), 1)


def expert_data_parallel_size(world_size: int, etp: int, ep: int, pp: int) -> int:
    """Data-parallel size of expert weights: ``world / (etp x ep x pp)`` (at least 1)."""
    return max(world_size // (etp * ep * pp), 1)


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """A job's parallel layout (:class:`~cfp_megatron.base.config.ParallelSpec`) on a world of ranks, with the sizes
    derived from it: data-parallel sizes and micro-batches per step. :meth:`build` validates it against the job."""

    parallel: ParallelSpec
    """The layout's degrees and options."""
    world_size: int
    """Total ranks."""
    num_microbatches: int
    """Micro-batches per optimizer step on each data-parallel rank."""

    tp: int = field(init=False)
    """Tensor-parallel size (derived from ``parallel``, as every field below)."""
    pp: int = field(init=False)
    """Pipeline-parallel size."""
    vpp: int = field(init=False)
    """Model chunks per pipeline rank (1 = no interleaving)."""
    cp: int = field(init=False)
    """Context-parallel size."""
    ep: int = field(init=False)
    """Expert-parallel size."""
    etp: int = field(init=False)
    """Expert tensor-parallel size."""
    sp: bool = field(init=False)
    """Sequence parallelism on."""
    order: str = field(init=False)
    """Megatron rank order string."""
    dp: int = field(init=False)
    """Data-parallel size (:func:`data_parallel_size`)."""
    expert_dp: int = field(init=False)
    """Data-parallel size of expert weights (:func:`expert_data_parallel_size`)."""

    def __post_init__(self) -> None:
        # Read once here: the simulator and the search read these sizes hundreds of thousands of times.
        p = self.parallel
        etp = p.etp or 1
        self.__dict__.update(tp=p.tp, pp=p.pp, vpp=p.vpp or 1, cp=p.cp, ep=p.ep, etp=etp, sp=p.sp, order=p.order,
                             dp=data_parallel_size(self.world_size, p.tp, p.cp, p.pp),
                             expert_dp=expert_data_parallel_size(self.world_size, etp, p.ep, p.pp))

    @classmethod
    def build(cls, job: JobSpec, world_size: int, *, te_available: bool | None = None) -> ParallelDims:
        """Validate ``job`` for ``world_size`` ranks; raise one ConfigError naming every problem."""
        m, p, t, c = job.model, job.parallel, job.train, job.cluster
        te = transformer_engine_available() if te_available is None else te_available
        issues: list[ConfigIssue] = []
        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ConfigError(ConfigIssue(key="world size", value=world_size,
                                          problem=f"must be in [1, {MAX_WORLD_SIZE:,}] ranks.",
                                          fix="start fewer ranks (torchrun --nnodes/--nproc_per_node), or pass a "
                                              "smaller --world."))
        vpp = p.virtual_stages
        dp = data_parallel_size(world_size, p.tp, p.cp, p.pp)
        issues += rule_issues([
            *batch.model_parallel_world(world_size, p.tp, p.cp, p.pp),
            *batch.cluster_world(world_size, c.nodes, c.gpus_per_node),
            # heads, hidden sizes and vocabulary against TP
            *tensor.attention_heads(m.num_attention_heads,
                                    m.query_groups if m.attention is AttentionKind.standard else None, p.tp),
            *tensor.dense_mlp(m.ffn_size if has_dense_mlp(m) else None, p.tp),
            *tensor.vocabulary(m.padded_vocab_size, p.tp),
            *(tensor.primepar_sizes(model=m.name, moe=m.is_moe, hidden=m.hidden_size, ffn=m.ffn_size,
                                    tokens=t.micro_batch_size * t.seq_length, tp=p.tp)
              if p.mlp is MlpPartition.primepar else [])])

        # Layers against PP x VPP (and the first/last stage's own counts).
        accounted, layout = _split_arguments(job)
        issues += split_issues(m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers, **accounted,
                               **layout)

        problems = moe_problems(job, world_size) + _modules_problems(job, te)

        # Batch against DP.
        per_step = t.micro_batch_size * dp
        num_microbatches = max(t.global_batch_size // per_step, 1)
        problems += batch.global_batch(t.global_batch_size, t.micro_batch_size, dp)
        problems += batch.microbatch_count(t.global_batch_size, t.micro_batch_size, dp, MAX_MICROBATCHES)
        problems += batch.fsdp_checkpoints(p.fsdp.value, t.checkpoint_dir)
        problems += batch.shard_groups(p.dp_shard_size, dp_cp=dp * p.cp, fsdp=p.fsdp.value, on_cpu=c.on_cpu,
                                       ep=p.ep)
        problems += pipeline.interleaved_microbatches(microbatches=num_microbatches, pp=p.pp, vpp=vpp,
                                                      global_batch=t.global_batch_size, per_step=per_step)

        # Sequence against CP, TP with SP, and positions.
        problems += sequence.context_chunks(t.seq_length, p.cp) + sequence.context_needs_te(p.cp, te)
        if p.cp > 1 and p.cp_comm_type in (CpCommType.a2a, CpCommType.a2a_p2p):
            a2a_size = p.cp if p.cp_comm_type is CpCommType.a2a else _cp_inner(
                p.cp, p.tp, c.domain_size(c.gpus_per_node or world_size, world_size))
            heads_per_rank = m.num_attention_heads // p.tp
            groups_per_rank = m.query_groups // p.tp if m.attention is AttentionKind.standard else heads_per_rank
            problems += sequence.context_all_to_all(comm_type=p.cp_comm_type.value, a2a_size=a2a_size,
                                                    heads_per_rank=heads_per_rank, groups_per_rank=groups_per_rank)
        problems += tensor.tp_overlap_runs(p.tp_comm_overlap, on_cpu=c.on_cpu, te=te)
        problems += sequence.sequence_parallel_split(p.sp, t.seq_length, p.cp, p.tp)
        problems += sequence.sequence_parallel_missing(p.sp, m.is_moe, p.tp)
        if m.position_embedding is PositionEmbedding.learned_absolute:
            problems += sequence.learned_positions(value=m.position_embedding.value, mtp_layers=m.mtp_num_layers,
                                                   pp=p.pp, seq=t.seq_length, max_positions=m.max_position_embeddings)

        # Options that do not go together.
        problems += _block_problems(job)
        if (p.num_layers_at_start_in_bf16 or p.num_layers_at_end_in_bf16) and not split_issues(
                m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers, **accounted, **layout):
            chunks = job_chunks(job)  # the first layers sit in the first chunk, the last in the last one
            for name, count, chunk in (("num_layers_at_start_in_bf16", p.num_layers_at_start_in_bf16, chunks[0][0]),
                                       ("num_layers_at_end_in_bf16", p.num_layers_at_end_in_bf16, chunks[-1][-1])):
                if count > chunk.count:
                    issues.append(ConfigIssue(
                        key=f"parallel.{name}", value=count,
                        problem=f"is more than the {chunk.count} decoder layer(s) of the model chunk that holds "
                                "them (Megatron-Core allows at most a pipeline stage's layers; the planner prices "
                                "those of the end chunk).",
                        fix=f"use parallel.{name}={chunk.count} or less, or fewer pipeline stages/chunks."))
        problems += sequence.context_attention(m.attention is AttentionKind.mla, p.cp)
        if p.cuda_graph_impl is not CudaGraphImpl.none:
            problems += graph_problems(job)
        if p.cpu_offloading_num_layers:
            problems += offload.within_model(p.cpu_offloading_num_layers, m.num_layers)
            problems += offload.runs(p.cpu_offloading_num_layers, on_cpu=c.on_cpu, te=te)
        issues += rule_issues(problems)

        if issues:
            raise ConfigError(issues)
        return cls(parallel=p, world_size=world_size, num_microbatches=num_microbatches)

    def describe(self) -> str:
        """A one-line summary such as ``world=8 tp=2 pp=2 vpp=1 cp=1 ep=1 etp=1 dp=2 sp=True mb=4``."""
        return (f"world={self.world_size} tp={self.tp} pp={self.pp} vpp={self.vpp} cp={self.cp} ep={self.ep} "
                f"etp={self.etp} dp={self.dp} sp={self.sp} microbatches={self.num_microbatches}")


def hierarchical_cp_sizes(job: JobSpec, dims: ParallelDims) -> list[int] | None:
    """Megatron-Core's ``hierarchical_context_parallel_sizes`` for ``parallel.cp_comm_type=a2a+p2p``: the CP ranks
    inside an NVLink domain (all-to-all), then the domains they span (point-to-point ring); ``None`` for the other
    types. The domain is ``cluster.nvlink_domain_size`` GPUs, else a node (the whole world where the node size is
    unset), the TP ranks varying fastest."""
    if dims.cp <= 1 or job.parallel.cp_comm_type is not CpCommType.a2a_p2p:
        return None
    inner = _cp_inner(dims.cp, dims.tp,
                      job.cluster.domain_size(job.cluster.gpus_per_node or dims.world_size, dims.world_size))
    return [inner, dims.cp // inner]


def _cp_inner(cp: int, tp: int, domain: int) -> int:
    """CP ranks inside one NVLink domain of ``domain`` GPUs when TP varies fastest."""
    return math.gcd(cp, max(domain // tp, 1))
