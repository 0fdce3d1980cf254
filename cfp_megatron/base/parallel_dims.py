"""One validated object for the parallel sizes of a job (after torchtitan's ``ParallelDims``).

:meth:`ParallelDims.build` checks everything that involves more than one config group (world size against the
parallel sizes, heads against TP, layers against PP x VPP, experts against EP, batch against DP, sequence against
CP/SP, options that do not go together) and raises one :class:`~cfp_megatron.base.errors.ConfigError` listing every
problem. It is pure: it runs before any process group exists.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field

from cfp_megatron.base.config import (
    MAX_MICROBATCHES,
    MAX_WORLD_SIZE,
    AttentionKernel,
    AttentionKind,
    CpCommType,
    JobSpec,
    MlpPartition,
    ModelSpec,
    ParallelSpec,
    PositionEmbedding,
    Recompute,
    RecomputeModule,
    TokenDispatcher,
    primepar_grid_side,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.pipeline_layout import layout_stages
from cfp_megatron.base.pipeline_split import chunk_layers, max_chunk_count, split_issues


def transformer_engine_available() -> bool:
    """Whether Transformer Engine can be imported (it provides CP attention and fused kernels)."""
    return importlib.util.find_spec("transformer_engine") is not None


def attention_kernel_here() -> AttentionKernel:
    """How Megatron-Core runs the attention core on this machine's GPU as the runtime builds the model: Transformer
    Engine's fused attention where it imports (:mod:`cfp_megatron.engine.model`), else Megatron's unfused core, with
    its fused softmax kernel where that CUDA extension imports (:mod:`cfp_megatron.model.megatron_config`)."""
    if transformer_engine_available():
        return AttentionKernel.flash
    if importlib.util.find_spec("scaled_masked_softmax_cuda") is not None:
        return AttentionKernel.fused_softmax
    return AttentionKernel.torch_softmax


def primepar_misfits(model: ModelSpec, tp: int, tokens: int) -> list[tuple[str, str]]:
    """(problem, fix) for each way ``model`` does not fit PrimePar's MLP on a grid of ``tp`` ranks with ``tokens``
    tokens per micro-batch (the grid splits tokens, hidden and FFN sizes by its side); the grid itself is checked by
    :class:`~cfp_megatron.base.config.ParallelSpec` (a ``tp`` that is not 4^k gives no more problems here)."""
    side = primepar_grid_side(tp)
    if side is None:
        return []
    found = []
    if model.is_moe:
        found.append((f"model {model.name} has MoE layers; the PrimePar MLP replaces the dense MLP only.",
                      "set parallel.mlp=megatron."))
    for key, size in (("model.hidden_size", model.hidden_size), ("model.ffn_hidden_size", model.ffn_size),
                      ("train.micro_batch_size x train.seq_length", tokens)):
        if size % side:
            found.append((f"the PrimePar grid of parallel.tp={tp} ranks splits {key}={size} into {side} blocks.",
                          f"use sizes divisible by {side}, or parallel.mlp=megatron."))
    return found


def sequence_parallel_required(model: ModelSpec, tp: int) -> bool:
    """Whether Megatron-Core requires sequence parallelism for ``model`` under ``tp``-way tensor parallelism: a MoE
    model under TP, with or without EP (its ``MoELayer`` refuses to train without it)."""
    return model.is_moe and tp > 1


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

        def need(ok: bool, key: str, value: object, problem: str, fix: str) -> None:
            if not ok:
                issues.append(ConfigIssue(key=key, value=value, problem=problem, fix=fix))

        if not 1 <= world_size <= MAX_WORLD_SIZE:
            raise ConfigError(ConfigIssue(key="world size", value=world_size,
                                          problem=f"must be in [1, {MAX_WORLD_SIZE:,}] ranks.",
                                          fix="start fewer ranks (torchrun --nnodes/--nproc_per_node), or pass a "
                                              "smaller --world."))
        vpp = p.virtual_stages
        etp = p.expert_tp
        model_parallel = p.tp * p.cp * p.pp
        need(world_size % model_parallel == 0, "parallel.tp", p.tp,
             f"world size {world_size} is not divisible by parallel.tp x parallel.cp x parallel.pp "
             f"= {p.tp} x {p.cp} x {p.pp} = {model_parallel}.",
             f"choose sizes whose product divides {world_size}, or start {model_parallel}*k ranks "
             f"(torchrun --nproc_per_node).")
        dp = data_parallel_size(world_size, p.tp, p.cp, p.pp)
        if c.gpus_per_node is not None:
            need(world_size == c.nodes * c.gpus_per_node, "cluster.nodes", c.nodes,
                 f"cluster.nodes x cluster.gpus_per_node = {c.nodes} x {c.gpus_per_node} = "
                 f"{c.nodes * c.gpus_per_node} but {world_size} ranks were started.",
                 "start that many ranks, or set cluster.nodes/cluster.gpus_per_node to match torchrun.")

        # Heads, hidden sizes and vocabulary against TP.
        need(m.num_attention_heads % p.tp == 0, "parallel.tp", p.tp,
             f"model.num_attention_heads={m.num_attention_heads} is not divisible by parallel.tp={p.tp}.",
             f"use a parallel.tp that divides {m.num_attention_heads}.")
        if m.attention is AttentionKind.standard:
            need(m.query_groups % p.tp == 0, "parallel.tp", p.tp,
                 f"model.num_query_groups={m.query_groups} (key/value heads) is not divisible by parallel.tp={p.tp}.",
                 f"use a parallel.tp that divides {m.query_groups}.")
        has_dense_mlp = not m.is_moe or m.moe_first_dense_layers > 0
        need(not has_dense_mlp or m.ffn_size % p.tp == 0, "parallel.tp", p.tp,
             f"model.ffn_hidden_size={m.ffn_size} is not divisible by parallel.tp={p.tp}.",
             f"use a parallel.tp that divides {m.ffn_size}.")
        need(m.padded_vocab_size % p.tp == 0, "parallel.tp", p.tp,
             f"the padded vocabulary {m.padded_vocab_size} is not divisible by parallel.tp={p.tp}.",
             "raise model.make_vocab_size_divisible_by to a multiple of parallel.tp.")

        if p.mlp is MlpPartition.primepar:
            for problem, fix in primepar_misfits(m, p.tp, t.micro_batch_size * t.seq_length):
                need(False, "parallel.mlp", p.mlp.value, problem, fix)

        # Layers against PP x VPP (and the first/last stage's own counts).
        accounted = {"embedding": p.account_for_embedding_in_pipeline_split and p.pp > 1,
                     "loss": p.account_for_loss_in_pipeline_split and p.pp > 1}
        layout = {"layout": p.pipeline_model_parallel_layout if p.pp > 1 else None, "mtp": m.mtp_num_layers}
        issues += split_issues(m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers, **accounted,
                               **layout)

        # Experts against EP.
        if m.is_moe:
            num_experts = m.num_experts or 1
            need(num_experts % p.ep == 0, "parallel.ep", p.ep,
                 f"model.num_experts={m.num_experts} is not divisible by parallel.ep={p.ep}.",
                 f"use a parallel.ep that divides {m.num_experts}.")
            expert_ffn = m.moe_ffn_hidden_size or m.ffn_size
            need(expert_ffn % etp == 0, "parallel.etp", p.etp,
                 f"the expert hidden size {expert_ffn} is not divisible by the expert TP size {etp}.",
                 f"use a parallel.etp that divides {expert_ffn}.")
            shared = m.moe_shared_expert_intermediate_size
            need(shared is None or shared % p.tp == 0, "parallel.tp", p.tp,
                 f"model.moe_shared_expert_intermediate_size={shared} is not divisible by parallel.tp={p.tp}.",
                 f"use a parallel.tp that divides {shared}.")
            need(world_size % (etp * p.ep * p.pp) == 0, "parallel.ep", p.ep,
                 f"world size {world_size} is not divisible by parallel.etp x parallel.ep x parallel.pp "
                 f"= {etp} x {p.ep} x {p.pp}.", "choose expert sizes whose product with parallel.pp divides "
                 "the world size.")
            overlaps = [name for name in ("moe_a2a_overlap", "moe_shared_expert_overlap") if getattr(p, name)]
            for name in overlaps:
                need(m.moe_token_dispatcher is not TokenDispatcher.allgather, f"parallel.{name}", True,
                     "Megatron-Core overlaps expert communication only with the alltoall or flex dispatcher "
                     f"(model.moe_token_dispatcher={m.moe_token_dispatcher.value}).",
                     f"set model.moe_token_dispatcher=alltoall, or parallel.{name}=false.")
            need(not p.moe_a2a_overlap or p.ep > 1, "parallel.moe_a2a_overlap", True,
                 "there is no expert all-to-all to overlap without expert parallelism (parallel.ep=1).",
                 "set parallel.ep to 2 or more, or parallel.moe_a2a_overlap=false.")
            need(not p.moe_shared_expert_overlap or m.moe_shared_expert_intermediate_size,
                 "parallel.moe_shared_expert_overlap", True, f"model {m.name} has no shared expert.",
                 "set parallel.moe_shared_expert_overlap=false.")
            need(not p.moe_a2a_overlap or not c.on_cpu, "parallel.moe_a2a_overlap", True,
                 "the combined 1F1B schedule runs on CUDA streams in bf16/fp16; this cluster is CPU.",
                 "plan it for a GPU cluster (cluster=dgx_h100 ...), or set parallel.moe_a2a_overlap=false.")
            need(m.moe_token_dispatcher is not TokenDispatcher.flex or not c.on_cpu, "model.moe_token_dispatcher",
                 "flex", "the flex dispatcher runs DeepEP's CUDA kernels; this cluster is CPU.",
                 "plan it for a GPU cluster, or set model.moe_token_dispatcher=alltoall.")
        else:
            need(not (p.moe_a2a_overlap or p.moe_shared_expert_overlap), "parallel.moe_a2a_overlap", True,
                 f"model {m.name} has no experts.", "set parallel.moe_a2a_overlap=false and "
                 "parallel.moe_shared_expert_overlap=false.")
            need(p.ep == 1, "parallel.ep", p.ep, f"model {m.name} has no experts.",
                 "set parallel.ep=1, or choose a MoE model (e.g. model=moe_tiny).")
            need(p.etp is None or p.etp == 1, "parallel.etp", p.etp, f"model {m.name} has no experts.",
                 "set parallel.etp=null.")

        # Selective recomputation's submodules against the model.
        modules = p.recomputed_modules
        named = p.recompute_modules
        for module in (RecomputeModule.moe_act, RecomputeModule.moe, RecomputeModule.shared_experts):
            need(module not in modules or m.is_moe, "parallel.recompute_modules", named,
                 f"{module.value} recomputes part of a MoE layer; model {m.name} has no experts.",
                 f"leave {module.value} out of parallel.recompute_modules.")
        need(RecomputeModule.mlp not in modules or not m.is_moe or m.moe_first_dense_layers > 0,
             "parallel.recompute_modules", named, f"mlp recomputes dense MLPs; every layer of model {m.name} is a "
             "MoE layer.", "use moe (the whole MoE block) or moe_act, or leave mlp out.")
        need(RecomputeModule.shared_experts not in modules or bool(m.moe_shared_expert_intermediate_size),
             "parallel.recompute_modules", named, f"model {m.name} has no shared expert.",
             "leave shared_experts out of parallel.recompute_modules.")
        need(RecomputeModule.shared_experts not in modules or not p.moe_shared_expert_overlap,
             "parallel.recompute_modules", named, "Megatron-Core cannot recompute the shared expert while it "
             "overlaps the token exchange (parallel.moe_shared_expert_overlap).",
             "leave shared_experts out, or set parallel.moe_shared_expert_overlap=false.")
        need(RecomputeModule.mla_up_proj not in modules or m.attention is AttentionKind.mla,
             "parallel.recompute_modules", named, f"mla_up_proj recomputes multi-head latent attention's "
             f"up-projections; model {m.name} has {m.attention.value} attention.", "leave mla_up_proj out.")
        need(RecomputeModule.moe_act not in modules or te, "parallel.recompute_modules", named,
             "Megatron-Core recomputes the experts' activation only in its grouped-GEMM experts (moe_grouped_gemm: "
             "Transformer Engine on a GPU); it is not installed here.",
             "plan it for a GPU cluster with Transformer Engine, or leave moe_act out.")

        # Batch against DP.
        per_step = t.micro_batch_size * dp
        need(t.global_batch_size % per_step == 0, "train.global_batch_size", t.global_batch_size,
             f"is not divisible by train.micro_batch_size x data-parallel size = {t.micro_batch_size} x {dp}"
             f" = {per_step}.",
             f"use a multiple of {per_step}, e.g. "
             f"train.global_batch_size={per_step * max(1, t.global_batch_size // per_step)}.")
        num_microbatches = max(t.global_batch_size // per_step, 1)
        need(num_microbatches <= MAX_MICROBATCHES, "train.global_batch_size", t.global_batch_size,
             f"means {num_microbatches:,} micro-batches per step on each data-parallel rank (train.global_batch_size "
             f"/ (train.micro_batch_size x data-parallel size {dp})), more than {MAX_MICROBATCHES:,}: one step would "
             "run for hours (published runs accumulate at most 128).",
             f"set train.global_batch_size to at most {MAX_MICROBATCHES * per_step}, or raise "
             "train.micro_batch_size or the data-parallel size.")
        if vpp > 1:
            need(num_microbatches % p.pp == 0, "train.global_batch_size", t.global_batch_size,
                 f"the interleaved schedule needs the micro-batch count ({num_microbatches}) to be a multiple of "
                 f"parallel.pp={p.pp}.",
                 f"use train.global_batch_size={math.lcm(num_microbatches, p.pp) * per_step}.")

        # Sequence against CP, TP with SP, and positions.
        if p.cp > 1:
            need(t.seq_length % (2 * p.cp) == 0, "train.seq_length", t.seq_length,
                 f"context parallelism splits the sequence into 2 x parallel.cp = {2 * p.cp} chunks.",
                 f"use a multiple of {2 * p.cp}.")
            need(te, "parallel.cp", p.cp,
                 "context parallelism needs Transformer Engine's attention (TEDotProductAttention); it is not "
                 "installed, and Megatron-Core's local attention does not support CP.",
                 "install transformer-engine (GPU only), or set parallel.cp=1.")
            if p.cp_comm_type in (CpCommType.a2a, CpCommType.a2a_p2p):
                a2a_size = p.cp if p.cp_comm_type is CpCommType.a2a else _cp_inner(
                    p.cp, p.tp, c.domain_size(c.gpus_per_node or world_size, world_size))
                heads_per_rank = m.num_attention_heads // p.tp
                groups_per_rank = m.query_groups // p.tp if m.attention is AttentionKind.standard else heads_per_rank
                need(heads_per_rank % a2a_size == 0 and groups_per_rank % a2a_size == 0, "parallel.cp_comm_type",
                     p.cp_comm_type.value,
                     f"the all-to-all splits each TP rank's {heads_per_rank} heads and {groups_per_rank} key/value "
                     f"groups over {a2a_size} CP ranks.",
                     "use parallel.cp_comm_type=p2p (or all_gather), or a parallel.cp that divides them.")
        if p.tp_comm_overlap:
            need(not c.on_cpu and te, "parallel.tp_comm_overlap", True,
                 "Transformer Engine's userbuffers overlap TP communication on GPUs; "
                 + ("this cluster is CPU." if c.on_cpu else "Transformer Engine is not installed."),
                 "plan it for a GPU cluster with transformer-engine installed, or set parallel.tp_comm_overlap=false.")
        if p.sp:
            need((t.seq_length // p.cp) % p.tp == 0, "train.seq_length", t.seq_length,
                 f"sequence parallelism shards each context-parallel rank's {t.seq_length // p.cp} tokens over "
                 f"parallel.tp={p.tp}.",
                 f"use a multiple of {p.tp * p.cp}, or set parallel.sp=false.")
        elif sequence_parallel_required(m, p.tp):
            need(False, "parallel.sp", False, "Megatron-Core needs sequence parallelism for MoE with TP (its "
                 "MoELayer refuses to train under TP without it).", "set parallel.sp=true.")
        if m.position_embedding is PositionEmbedding.learned_absolute:
            # Megatron-Core (0.16) builds an embedding copy in the MTP layers' chunk whose position table is neither
            # synced (the position-embedding group is the first stage alone) nor checkpointed with the first stage's.
            need(not (m.mtp_num_layers and p.pp > 1), "model.position_embedding", m.position_embedding.value,
                 f"model.mtp_num_layers={m.mtp_num_layers} with parallel.pp={p.pp}: the MTP layers' stage keeps its "
                 "own copy of the learned position table, which Megatron-Core neither syncs nor checkpoints with the "
                 "first stage's.", "use rotary positions (model.position_embedding=rope, as MTP models do), or "
                 "parallel.pp=1.")
            need(t.seq_length <= m.max_position_embeddings, "train.seq_length", t.seq_length,
                 f"exceeds model.max_position_embeddings={m.max_position_embeddings}.",
                 "shorten the sequence or raise model.max_position_embeddings.")

        # Options that do not go together.
        if p.recompute is Recompute.full:  # both methods: uniform's group and block's recomputed layers per chunk
            valid = not split_issues(m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers,
                                     **accounted, **layout) and not (layout["layout"] and len(
                                         layout_stages(layout["layout"])) != p.pp * vpp)
            layers_per_chunk = max_chunk_count(chunk_layers(
                m.num_layers, p.pp, vpp, p.first_stage_layers, p.last_stage_layers, **accounted,
                layout=layout["layout"])) if valid else 0
            need(p.recompute_num_layers <= max(layers_per_chunk, 1), "parallel.recompute_num_layers",
                 p.recompute_num_layers, f"exceeds the {layers_per_chunk} layers of each pipeline chunk.",
                 f"use at most {layers_per_chunk}.")
        if m.attention is AttentionKind.mla:
            need(p.cp == 1, "parallel.cp", p.cp, "multi-latent attention does not support context parallelism.",
                 "set parallel.cp=1.")

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
