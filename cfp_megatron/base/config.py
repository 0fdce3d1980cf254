"""Structured configuration: one frozen, keyword-only dataclass per config group.

The frozen specs here are the source of truth. Hydra cannot override fields of a frozen dataclass (OmegaConf marks
such nodes read-only), so :func:`register_configs` stores a mutable twin of :class:`JobSpec` in Hydra's
ConfigStore as the schema (``cfp_schema``); after composition :func:`job_from_config` turns the composed config
into frozen specs, which runs every ``__post_init__`` check. Each check names the Hydra key, the value and the fix.
Checks that need several groups at once (world size, heads vs TP, ...) live in
:mod:`cfp_megatron.base.parallel_dims`.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cfp_megatron.base.errors import ConfigError, ConfigIssue


class Precision(enum.Enum):
    """Numeric format of parameters and activations."""

    auto = "auto"
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Recompute(enum.Enum):
    """Activation recomputation (Megatron's ``recompute_granularity``)."""

    none = "none"
    selective = "selective"
    full = "full"


class RecomputeMethod(enum.Enum):
    """Which layers full recomputation covers (Megatron's ``recompute_method``)."""

    uniform = "uniform"
    """Every layer is recomputed, in groups of ``recompute_num_layers`` layers (each group keeps only its input)."""
    block = "block"
    """Only the first ``recompute_num_layers`` layers of each pipeline chunk (virtual stage) are recomputed; the
    chunk's other layers keep their activations."""


class MlpPartition(enum.Enum):
    """How the dense MLP's two linear layers are split over the tensor-parallel group."""

    megatron = "megatron"
    """Megatron-Core's column-parallel ``linear_fc1`` then row-parallel ``linear_fc2`` (an all-reduce of the output
    in the forward pass and of the input gradient in the backward pass)."""
    primepar = "primepar"
    """PrimePar's spatial-temporal partition P_{2^k x 2^k} (:mod:`cfp_megatron.layers`): the TP group (4^k ranks) is
    a 2^k x 2^k grid, every weight and activation block is held once, partial sums accumulate locally over 2^k ring
    steps; the MLP's input is sliced from the replicated hidden states (all-gathered from the sequence shards first
    under sequence parallelism) and its output all-gathered (then cut to this rank's sequence shard under it)."""


def primepar_grid_side(tp: int) -> int | None:
    """The side 2^k of PrimePar's square grid on a tensor-parallel group of ``tp = 4^k`` ranks (k >= 1); ``None``
    for any other size."""
    side = math.isqrt(tp)
    return side if tp >= 4 and side * side == tp and not side & (side - 1) else None


class PositionEmbedding(enum.Enum):
    """How token positions enter the model (Megatron's ``position_embedding_type``)."""

    learned_absolute = "learned_absolute"
    rope = "rope"
    none = "none"


class Normalization(enum.Enum):
    """Layer normalisation kind."""

    LayerNorm = "LayerNorm"
    RMSNorm = "RMSNorm"


class Activation(enum.Enum):
    """MLP activation; ``swiglu`` is a gated linear unit with SiLU (LLaMA style)."""

    gelu = "gelu"
    swiglu = "swiglu"


class AttentionKind(enum.Enum):
    """Self-attention variant."""

    standard = "standard"
    """Multi-head or grouped-query attention (set ``num_query_groups`` for GQA)."""
    mla = "mla"
    """Multi-latent attention (DeepSeek-V2/V3), Megatron-Core's ``MLASelfAttention``."""


class RouterScore(enum.Enum):
    """MoE router score function."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class TokenDispatcher(enum.Enum):
    """MoE token dispatcher (Megatron's ``moe_token_dispatcher_type``)."""

    alltoall = "alltoall"
    allgather = "allgather"


class OptimizerKind(enum.Enum):
    """Optimizer; both come from ``megatron.core.optimizer``."""

    adam = "adam"
    sgd = "sgd"


class LRSchedule(enum.Enum):
    """Learning-rate decay after warm-up (``megatron.core.optimizer_param_scheduler``)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class DataKind(enum.Enum):
    """Where training tokens come from."""

    synthetic = "synthetic"
    """Deterministic generated sequences with learnable structure; needs no files."""
    indexed = "indexed"
    """Megatron's indexed dataset (``.bin``/``.idx``) read by ``megatron.core.datasets.GPTDataset``."""


class TokenizerKind(enum.Enum):
    """Tokenizer used by the indexed dataset and its preprocessing tool."""

    byte = "byte"
    """UTF-8 bytes (vocabulary 256 plus end-of-document); needs no files."""
    huggingface = "huggingface"
    """A local ``tokenizer.json`` read with the ``tokenizers`` package."""


class Backend(enum.Enum):
    """torch.distributed backend."""

    auto = "auto"
    """NCCL when CUDA is available, else gloo."""
    nccl = "nccl"
    gloo = "gloo"


def _issue(issues: list[ConfigIssue], ok: bool, key: str, value: object, problem: str, fix: str) -> None:
    """Append an issue when ``ok`` is false."""
    if not ok:
        issues.append(ConfigIssue(key=key, value=value, problem=problem, fix=fix))


def _positive(issues: list[ConfigIssue], prefix: str, obj: object, *names: str) -> None:
    """Check that each named integer field is >= 1 (``None`` is allowed and means 'derive it')."""
    for name in names:
        value = getattr(obj, name)
        if value is not None:
            _issue(issues, value >= 1, f"{prefix}.{name}", value, "must be a positive integer.",
                   f"set {prefix}.{name} to 1 or more.")


def resolve_precision(precision: Precision, on_gpu: bool) -> Precision:
    """``auto`` is bf16 on GPU and fp32 on CPU."""
    if precision is Precision.auto:
        return Precision.bf16 if on_gpu else Precision.fp32
    return precision


@dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """The model's shape, in Megatron-Core's ``TransformerConfig`` vocabulary (Hydra group ``model``)."""

    PREFIX: ClassVar[str] = "model"

    name: str = "gpt_tiny"
    """Name of the preset (the Hydra option that chose it)."""
    num_layers: int = 4
    """Number of transformer layers."""
    hidden_size: int = 64
    """Transformer hidden size."""
    ffn_hidden_size: int | None = None
    """Dense MLP hidden size; ``None`` means 4 x ``hidden_size``."""
    num_attention_heads: int = 4
    """Number of query heads."""
    num_query_groups: int | None = None
    """Number of key/value heads for grouped-query attention; ``None`` means one per query head (MHA)."""
    kv_channels: int | None = None
    """Per-head dimension; ``None`` means ``hidden_size / num_attention_heads``."""
    vocab_size: int = 256
    """Tokenizer vocabulary size before padding."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this. Unlike Megatron-LM it is not multiplied by TP, so the padded
    vocabulary, and therefore the loss, is the same under every layout."""
    max_position_embeddings: int = 4096
    """Longest sequence the position embedding supports."""
    position_embedding: PositionEmbedding = PositionEmbedding.learned_absolute
    """Learned absolute positions (GPT) or rotary (LLaMA)."""
    rotary_base: float = 10000.0
    """RoPE base frequency."""
    normalization: Normalization = Normalization.LayerNorm
    """LayerNorm (GPT) or RMSNorm (LLaMA)."""
    norm_epsilon: float = 1e-5
    """Epsilon of the normalisation layers."""
    activation: Activation = Activation.gelu
    """MLP activation."""
    add_bias_linear: bool = True
    """Biases in linear layers (GPT yes, LLaMA no)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen style)."""
    qk_layernorm: bool = False
    """Normalise queries and keys per head."""
    tie_embeddings: bool = True
    """Share the input embedding with the output layer."""
    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout of attention probabilities."""
    attention: AttentionKind = AttentionKind.standard
    """Attention variant."""
    q_lora_rank: int | None = None
    """MLA: rank of the query down-projection; ``None`` means no query compression."""
    kv_lora_rank: int = 512
    """MLA: rank of the key/value down-projection."""
    qk_head_dim: int = 128
    """MLA: per-head query/key dimension without the rotary part."""
    qk_pos_emb_head_dim: int = 64
    """MLA: per-head rotary dimension."""
    v_head_dim: int = 128
    """MLA: per-head value dimension."""
    num_experts: int | None = None
    """Routed experts per MoE layer; ``None`` means a dense model."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_ffn_hidden_size: int | None = None
    """Hidden size of each routed expert; ``None`` means ``ffn_hidden_size``."""
    moe_shared_expert_intermediate_size: int | None = None
    """Total hidden size of the shared experts (DeepSeek); ``None`` means none."""
    moe_first_dense_layers: int = 0
    """The first this-many layers use a dense MLP instead of MoE (DeepSeek's ``first_k_dense_replace``)."""
    moe_router_score: RouterScore = RouterScore.softmax
    """Router score function."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it)."""
    moe_token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall
    """How tokens reach their experts across expert-parallel ranks."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "vocab_size", "make_vocab_size_divisible_by",
                  "max_position_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                  "qk_pos_emb_head_dim", "v_head_dim")
        if self.num_query_groups and self.num_attention_heads >= 1:
            _issue(issues, self.num_attention_heads % self.num_query_groups == 0, f"{p}.num_query_groups",
                   self.num_query_groups,
                   f"must divide model.num_attention_heads={self.num_attention_heads}.",
                   "use a divisor of the number of heads (or null for multi-head attention).")
        if self.kv_channels is None and self.attention is AttentionKind.standard and self.num_attention_heads >= 1:
            _issue(issues, self.hidden_size % self.num_attention_heads == 0, f"{p}.hidden_size", self.hidden_size,
                   f"is not divisible by model.num_attention_heads={self.num_attention_heads}.",
                   "make hidden_size a multiple of the head count, or set model.kv_channels.")
        _issue(issues, self.init_method_std > 0, f"{p}.init_method_std", self.init_method_std, "must be positive.",
               "use e.g. 0.02.")
        for name in ("hidden_dropout", "attention_dropout"):
            value = getattr(self, name)
            _issue(issues, 0.0 <= value < 1.0, f"{p}.{name}", value, "must be in [0, 1).", f"set {p}.{name}=0.0.")
        if self.num_experts is not None and self.num_experts >= 1 and self.moe_router_topk >= 1:
            _issue(issues, self.moe_router_topk <= self.num_experts, f"{p}.moe_router_topk", self.moe_router_topk,
                   f"exceeds model.num_experts={self.num_experts}.", "route each token to at most num_experts.")
            _issue(issues, 0 <= self.moe_first_dense_layers < self.num_layers, f"{p}.moe_first_dense_layers",
                   self.moe_first_dense_layers, f"must be in [0, model.num_layers={self.num_layers}).",
                   "leave at least one MoE layer, or set model.num_experts=null for a dense model.")
        if self.num_experts is None:
            _issue(issues, self.moe_shared_expert_intermediate_size is None,
                   f"{p}.moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size,
                   "shared experts need a MoE model.", "set model.num_experts, or set this to null.")
        if self.attention is AttentionKind.mla:
            _issue(issues, self.position_embedding is PositionEmbedding.rope, f"{p}.position_embedding",
                   self.position_embedding.value, "multi-latent attention needs rotary embeddings.",
                   "set model.position_embedding=rope.")
        if issues:
            raise ConfigError(issues)

    @property
    def ffn_size(self) -> int:
        """Dense MLP hidden size after defaults."""
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def query_groups(self) -> int:
        """Key/value heads after defaults."""
        return self.num_query_groups or self.num_attention_heads

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary padded to ``make_vocab_size_divisible_by``."""
        d = self.make_vocab_size_divisible_by
        return -(-self.vocab_size // d) * d

    @property
    def is_moe(self) -> bool:
        """Whether the model has MoE layers."""
        return self.num_experts is not None


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The machines the job runs on (Hydra group ``cluster``). Figures are per GPU unless said otherwise."""

    PREFIX: ClassVar[str] = "cluster"

    name: str = "local"
    """Preset name."""
    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int | None = None
    """Accelerators (or, on CPU, processes) per node; ``None`` means what torchrun started (LOCAL_WORLD_SIZE)."""
    device_name: str = "cpu"
    """Accelerator model, for reports."""
    peak_tflops_bf16: float | None = None
    """Dense bf16 peak in TFLOP/s; ``None`` means measure it at start-up (used for MFU)."""
    peak_tflops_fp8: float | None = None
    """Dense fp8 peak in TFLOP/s; ``None`` if the device has no fp8 tensor cores."""
    peak_tflops_fp32: float | None = None
    """fp32 peak in TFLOP/s (TF32 tensor cores where present); ``None`` means measure it."""
    hbm_gib: float | None = None
    """Device memory capacity in GiB; ``None`` means host memory is used (CPU)."""
    hbm_bandwidth_gbps: float | None = None
    """Device memory bandwidth in GB/s."""
    intra_node_bandwidth_gbps: float | None = None
    """Unidirectional bandwidth per GPU inside a node (NVLink/NVSwitch) in GB/s."""
    intra_node_latency_us: float | None = None
    """Latency of a small intra-node transfer in microseconds."""
    inter_node_bandwidth_gbps: float | None = None
    """Unidirectional network bandwidth per GPU between nodes (one NIC rail per GPU) in GB/s."""
    inter_node_latency_us: float | None = None
    """Latency of a small inter-node transfer in microseconds."""
    rails_per_node: int | None = None
    """Network rails (NICs, each on its own leaf switch) per node; on DGX systems one per GPU, so GPU ``i`` of
    every node shares rail ``i`` and same-index GPUs talk across nodes without crossing the spine. ``None``: one
    NIC per GPU assumed."""
    backend: Backend = Backend.auto
    """torch.distributed backend."""

    @property
    def on_cpu(self) -> bool:
        """Whether the ranks are CPU processes (``device_name: cpu``): no fused CUDA kernels, and transfers are work
        on the same cores as the compute."""
        return self.device_name.strip().lower() == "cpu"

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        _positive(issues, self.PREFIX, self, "nodes", "gpus_per_node", "rails_per_node")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hints[f.name] == float | None and value is not None:
                _issue(issues, isinstance(value, int | float) and value > 0, f"{self.PREFIX}.{f.name}", value,
                       "must be positive.", f"set a positive figure, or null for {self.PREFIX}.{f.name}.")
        if issues:
            raise ConfigError(issues)


@dataclass(frozen=True)
class LayoutKey:
    """How one field of :class:`ParallelSpec` appears outside the config: in a plan's canonical string and in the
    Megatron-LM arguments (the plan, its exports and the search read these, so a new field is declared once)."""

    key: str
    """Its key in the plan's canonical string."""
    megatron: str | None
    """Its Megatron-LM flag (a switch for a bool, else followed by the value); ``""``: rendered by
    :func:`~cfp_megatron.plan.exports.megatron_lm_args` itself; ``None``: Megatron-LM has none (a value away from
    the default cannot be exported)."""
    head: bool
    """Written before the derived data-parallel size and the batch in the canonical string (the parallel sizes)."""
    none_means: int | None
    """The size ``None`` stands for (``vpp``, ``etp``: 1); the canonical string writes it."""
    optional: bool = False
    """Written in the canonical string only away from its default (a field added after plans were saved: their
    strings, and so their hashes, stay as they were)."""


def layout_field(default: Any, *, key: str, megatron: str | None = "", head: bool = False,
                 none_means: int | None = None, optional: bool = False) -> Any:
    """A :class:`ParallelSpec` field with its :class:`LayoutKey` (``dataclasses.field`` metadata ``layout``)."""
    return field(default=default, metadata={"layout": LayoutKey(key=key, megatron=megatron, head=head,
                                                                 none_means=none_means, optional=optional)})


def layout_keys() -> dict[str, LayoutKey]:
    """ParallelSpec field name -> its :class:`LayoutKey`, in declaration order (the canonical string's order)."""
    return {f.name: f.metadata["layout"] for f in dataclasses.fields(ParallelSpec)}


@dataclass(frozen=True, kw_only=True)
class ParallelSpec:
    """How the model and batch are split across ranks (Hydra group ``parallel``). DP is what is left over."""

    PREFIX: ClassVar[str] = "parallel"

    tp: int = layout_field(1, key="tp", megatron="--tensor-model-parallel-size", head=True)
    """Tensor-parallel size."""
    sp: bool = layout_field(False, key="sp", megatron="--sequence-parallel", head=True)
    """Sequence parallelism (shards LayerNorm/dropout activations along the sequence over the TP group)."""
    pp: int = layout_field(1, key="pp", megatron="--pipeline-model-parallel-size", head=True)
    """Pipeline-parallel size."""
    vpp: int | None = layout_field(None, key="vpp", head=True, none_means=1)
    """Virtual pipeline stages (model chunks) per pipeline rank for the interleaved 1F1B schedule; ``None`` = 1."""
    cp: int = layout_field(1, key="cp", megatron="--context-parallel-size", head=True)
    """Context-parallel size (splits the sequence in attention)."""
    ep: int = layout_field(1, key="ep", megatron="--expert-model-parallel-size", head=True)
    """Expert-parallel size (MoE only)."""
    etp: int | None = layout_field(None, key="etp", megatron="--expert-tensor-parallel-size", head=True, none_means=1)
    """Tensor-parallel size inside experts; ``None`` means 1 (Megatron's recommended default with EP)."""
    first_stage_layers: int | None = layout_field(None, key="ppf")
    """Decoder layers on the first pipeline stage (Megatron's ``num_layers_in_first_pipeline_stage``); ``None``:
    as many as the other stages. The stages with no count of their own share the remaining layers evenly."""
    last_stage_layers: int | None = layout_field(None, key="ppl")
    """Decoder layers on the last pipeline stage (``num_layers_in_last_pipeline_stage``), which also holds the
    output layer and loss; ``None``: as many as the other stages."""
    account_for_embedding_in_pipeline_split: bool = layout_field(
        False, key="ppemb", megatron="--account-for-embedding-in-pipeline-split", optional=True)
    """Count the embedding as one layer of the pipeline split (Megatron-Core's
    ``account_for_embedding_in_pipeline_split``): the decoder's layers plus one split evenly over ``pp x vpp``
    chunks, the first chunk of the first stage holding one decoder layer fewer."""
    account_for_loss_in_pipeline_split: bool = layout_field(
        False, key="pploss", megatron="--account-for-loss-in-pipeline-split", optional=True)
    """Count the output layer and loss as one layer of the pipeline split (``account_for_loss_in_pipeline_split``):
    the last chunk of the last stage holds one decoder layer fewer."""
    recompute: Recompute = layout_field(Recompute.none, key="rc")
    """Activation recomputation: none, selective (core attention), or full (every layer)."""
    recompute_num_layers: int = layout_field(1, key="rcn")
    """With ``recompute=full``: layers per recomputed group (``uniform``), or recomputed layers per pipeline chunk
    (``block``)."""
    recompute_method: RecomputeMethod = layout_field(RecomputeMethod.uniform, key="rcm")
    """With ``recompute=full``: ``uniform`` recomputes every layer, ``block`` only the first
    ``recompute_num_layers`` layers of each pipeline chunk (the others keep their activations)."""
    distributed_optimizer: bool = layout_field(False, key="do", megatron="--use-distributed-optimizer")
    """Shard optimizer states over data-parallel ranks (ZeRO-1, Megatron's distributed optimizer)."""
    overlap_grad_reduce: bool = layout_field(False, key="ogr", megatron="--overlap-grad-reduce")
    """Overlap data-parallel gradient reduction with the backward pass."""
    overlap_param_gather: bool = layout_field(False, key="opg", megatron="--overlap-param-gather")
    """With the distributed optimizer: overlap the parameter all-gather with the next forward."""
    grad_reduce_in_fp32: bool = layout_field(True, key="gf32")
    """Accumulate and reduce gradients in fp32 (Megatron-Core's ``DistributedDataParallelConfig.grad_reduce_in_fp32``;
    Megatron-LM always does so for bf16). ``false`` keeps the gradient buffers and their data-parallel reduction in
    the compute precision, as NeMo's performance recipes do (``grad_reduce_in_fp32=False``, NeMo 1's
    ``optim.grad_sync_dtype=bf16``): with bf16, half the gradient memory and data-parallel traffic."""
    order: str = layout_field("tp-cp-ep-dp-pp", key="order")
    """Megatron's rank order, fastest-varying first."""
    mlp: MlpPartition = layout_field(MlpPartition.megatron, key="mlp", megatron=None)
    """Partition of the dense MLP over the TP group: Megatron's column/row split, or PrimePar's P_{2^k x 2^k} (needs
    parallel.tp = 4, 16, 64, ...; with sequence parallelism it all-gathers its input's sequence shards first)."""
    primepar_layers: int | None = layout_field(None, key="mlpn", megatron=None)
    """With ``mlp=primepar``: only the first ``primepar_layers`` layers of each pipeline chunk run PrimePar's MLP,
    the others Megatron's column/row split (as ``recompute_method=block`` counts recomputed layers); ``None``: every
    layer. The planner sets it to the most PrimePar layers that fit in memory where all of them do not and PrimePar's
    layer is the faster."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "tp", "pp", "vpp", "cp", "ep", "etp", "recompute_num_layers", "first_stage_layers",
                  "last_stage_layers", "primepar_layers")
        dims = self.order.split("-")
        _issue(issues, sorted(dims) == sorted(["tp", "cp", "ep", "dp", "pp"]), f"{p}.order", self.order,
               "must name tp, cp, ep, dp and pp once each, separated by '-'.", "use the default tp-cp-ep-dp-pp.")
        if self.sp and self.tp == 1:
            issues.append(ConfigIssue(key=f"{p}.sp", value=True, problem="sequence parallelism needs parallel.tp > 1.",
                                      fix="set parallel.sp=false or parallel.tp to 2 or more."))
        if self.overlap_param_gather and not self.distributed_optimizer:
            issues.append(ConfigIssue(key=f"{p}.overlap_param_gather", value=True,
                                      problem="overlapping the parameter all-gather needs the distributed optimizer.",
                                      fix="set parallel.distributed_optimizer=true or parallel.overlap_param_gather"
                                          "=false."))
        if self.recompute_method is RecomputeMethod.block and self.recompute is not Recompute.full:
            issues.append(ConfigIssue(key=f"{p}.recompute_method", value=self.recompute_method.value,
                                      problem="the block method chooses which layers full recomputation covers; it "
                                              f"needs parallel.recompute=full (got {self.recompute.value}).",
                                      fix="set parallel.recompute=full or parallel.recompute_method=uniform."))
        if self.mlp is MlpPartition.primepar:
            if primepar_grid_side(self.tp) is None:
                issues.append(ConfigIssue(key=f"{p}.mlp", value=self.mlp.value,
                                          problem=f"PrimePar's P_{{2^k x 2^k}} needs a square grid of 4^k ranks as the "
                                                  f"tensor-parallel group; parallel.tp={self.tp} is not 4, 16, 64, ...",
                                          fix="set parallel.tp to 4 or 16, or parallel.mlp=megatron."))
        if self.primepar_layers is not None and self.mlp is not MlpPartition.primepar:
            issues.append(ConfigIssue(key=f"{p}.primepar_layers", value=self.primepar_layers,
                                      problem="it counts the layers of each pipeline chunk that run PrimePar's MLP; "
                                              f"parallel.mlp={self.mlp.value} runs none.",
                                      fix="set parallel.mlp=primepar or parallel.primepar_layers=null."))
        if self.primepar_layers is not None and self.recompute_method is RecomputeMethod.block:
            issues.append(ConfigIssue(key=f"{p}.primepar_layers", value=self.primepar_layers,
                                      problem="PrimePar on only some layers of each chunk is not combined with "
                                              "block recomputation (parallel.recompute_method=block).",
                                      fix="set parallel.primepar_layers=null (every layer PrimePar) or "
                                          "parallel.recompute_method=uniform."))
        accounted = [name for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                     if getattr(self, name)] if (self.account_for_embedding_in_pipeline_split
                                                 or self.account_for_loss_in_pipeline_split) else []
        if accounted and (self.first_stage_layers is not None or self.last_stage_layers is not None):
            issues.append(ConfigIssue(key=f"{p}.{accounted[0]}", value=True,
                                      problem="Megatron-Core does not count the embedding or loss in the split "
                                              "together with a first/last stage layer count of its own.",
                                      fix="set parallel.first_stage_layers=null and parallel.last_stage_layers=null, "
                                          f"or parallel.{accounted[0]}=false."))
        if accounted and self.pp == 1:
            issues.append(ConfigIssue(key=f"{p}.{accounted[0]}", value=True,
                                      problem="counting the embedding or loss as a layer splits pipeline stages; "
                                              "parallel.pp=1 has one.", fix="set parallel.pp to 2 or more."))
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            issues.append(ConfigIssue(key=f"{p}.vpp", value=self.vpp,
                                      problem="virtual pipeline stages need parallel.pp > 1.",
                                      fix="set parallel.vpp=null or parallel.pp to 2 or more."))
        if issues:
            raise ConfigError(issues)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return self.vpp or 1

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size after defaults."""
        return self.etp or 1


@dataclass(frozen=True, kw_only=True)
class TrainSpec:
    """The training run (Hydra group ``train``)."""

    PREFIX: ClassVar[str] = "train"

    global_batch_size: int = 8
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: int = 2
    """Sequences per forward/backward pass on one rank."""
    seq_length: int = 64
    """Tokens per sequence."""
    steps: int = 20
    """Optimizer steps to train for (the total, counting steps done before a resume)."""
    optimizer: OptimizerKind = OptimizerKind.adam
    """Optimizer."""
    lr: float = 1e-3
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of decay."""
    lr_schedule: LRSchedule = LRSchedule.cosine
    """Decay style after warm-up."""
    warmup_steps: int = 0
    """Linear warm-up steps."""
    lr_decay_steps: int | None = None
    """Steps over which the rate decays; ``None`` means ``steps``."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    adam_beta1: float = 0.9
    """Adam beta1."""
    adam_beta2: float = 0.95
    """Adam beta2."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 1.0
    """Gradient-norm clipping threshold (0 disables it)."""
    precision: Precision = Precision.auto
    """Parameter/activation precision; ``auto`` is bf16 on GPU and fp32 on CPU."""
    seed: int = 1234
    """Seed for initialisation and data."""
    layout_independent_init: bool = True
    """Initialise every weight from a generator keyed by its global name, so the same seed gives the same model
    under every TP/PP/EP layout. Costs one full-size random tensor per weight at start-up; set false for very large
    models to keep Megatron's per-rank initialisation."""
    log_interval: int = 1
    """Steps between log lines."""
    save_interval: int = 0
    """Steps between checkpoints; 0 saves only at the end. Needs ``checkpoint_dir``."""
    checkpoint_dir: str | None = None
    """Where checkpoints go; ``None`` disables checkpointing."""
    resume: bool = False
    """Continue from the latest checkpoint in ``checkpoint_dir`` (at its exact step)."""
    metrics_file: str | None = None
    """JSON-lines metrics written by rank 0; ``None`` means ``metrics.jsonl`` in the Hydra run directory."""
    memory_step: int | None = None
    """Measure every rank's tensor memory during this step (1-based; ``MemTracker`` on CPU and GPU, plus
    ``torch.cuda.max_memory_allocated`` on GPU) and log it as a ``memory`` event; ``None`` measures nothing. Step 2 or
    later includes the optimizer states. The tracker's hooks slow that step: its logged time is no training figure."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "global_batch_size", "micro_batch_size", "seq_length", "log_interval",
                  "lr_decay_steps", "memory_step")
        for name in ("steps", "warmup_steps", "save_interval"):
            value = getattr(self, name)
            _issue(issues, value >= 0, f"{p}.{name}", value, "must not be negative.", f"set {p}.{name} to 0 or more.")
        _issue(issues, self.lr > 0, f"{p}.lr", self.lr, "must be positive.", "use e.g. 3e-4.")
        _issue(issues, 0 <= self.min_lr <= self.lr, f"{p}.min_lr", self.min_lr, f"must be in [0, train.lr={self.lr}].",
               "lower train.min_lr.")
        _issue(issues, self.clip_grad >= 0, f"{p}.clip_grad", self.clip_grad, "must not be negative.",
               "use 0 to disable clipping.")
        if self.resume:
            _issue(issues, self.checkpoint_dir is not None, f"{p}.resume", True,
                   "resuming needs a checkpoint directory.",
                   "set train.checkpoint_dir to the directory the earlier run saved into.")
        if self.save_interval > 0:
            _issue(issues, self.checkpoint_dir is not None, f"{p}.save_interval", self.save_interval,
                   "saving needs a checkpoint directory.", "set train.checkpoint_dir, or train.save_interval=0.")
        if issues:
            raise ConfigError(issues)


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """Training data (Hydra group ``data``)."""

    PREFIX: ClassVar[str] = "data"

    kind: DataKind = DataKind.synthetic
    """Synthetic sequences or Megatron's indexed dataset."""
    path: list[str] = field(default_factory=list)
    """Indexed dataset prefixes (``prefix.bin``/``prefix.idx``), blended in proportion to their sizes."""
    split: str = "100,0,0"
    """Train/validation/test split of the indexed documents, as Megatron writes it."""
    tokenizer: TokenizerKind = TokenizerKind.byte
    """Tokenizer the dataset was preprocessed with."""
    tokenizer_path: str | None = None
    """``tokenizer.json`` for the ``huggingface`` tokenizer."""
    cache_dir: str | None = None
    """Where GPTDataset caches its index files; ``None`` means next to the data."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        if self.kind is DataKind.indexed:
            _issue(issues, len(self.path) > 0, f"{p}.path", list(self.path), "the indexed dataset needs file prefixes.",
                   "set data.path=[/data/corpus_text_document] (run python -m cfp_megatron.data.preprocess first).")
        if self.tokenizer is TokenizerKind.huggingface:
            _issue(issues, self.tokenizer_path is not None, f"{p}.tokenizer_path", self.tokenizer_path,
                   "the huggingface tokenizer needs a tokenizer.json.", "set data.tokenizer_path=/path/tokenizer.json.")
        parts = self.split.replace("/", ",").split(",")
        ok = len(parts) == 3 and all(x.strip().replace(".", "", 1).isdigit() for x in parts)
        _issue(issues, ok, f"{p}.split", self.split, "must be three comma-separated weights.", "use e.g. 98,1,1.")
        if issues:
            raise ConfigError(issues)


@dataclass(frozen=True, kw_only=True)
class JobSpec:
    """Everything one training job needs, after Hydra composed it."""

    model: ModelSpec = field(default_factory=ModelSpec)
    """Model shape."""
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    """Machines."""
    parallel: ParallelSpec = field(default_factory=ParallelSpec)
    """Parallel layout."""
    train: TrainSpec = field(default_factory=TrainSpec)
    """Training run."""
    data: DataSpec = field(default_factory=DataSpec)
    """Training data."""


SECTIONS: dict[str, type] = {f.name: typing.get_type_hints(JobSpec)[f.name] for f in dataclasses.fields(JobSpec)}
"""Config groups and the spec each one builds."""


def mutable_twin(cls: type, cache: dict[type, type]) -> type:
    """A non-frozen copy of a (nested) frozen dataclass, used only as the Hydra schema."""
    if cls in cache:
        return cache[cls]
    hints = typing.get_type_hints(cls)
    fields = []
    for f in dataclasses.fields(cls):
        ftype = hints[f.name]
        if dataclasses.is_dataclass(ftype):
            twin = mutable_twin(ftype, cache)
            fields.append((f.name, twin, field(default_factory=twin)))
        elif f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, ftype, field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, ftype, field(default=f.default)))
    twin = dataclasses.make_dataclass(f"{cls.__name__}Schema", fields, kw_only=True)
    cache[cls] = twin
    return twin


JobSchema = mutable_twin(JobSpec, {})
"""Mutable twin of :class:`JobSpec`, stored in Hydra's ConfigStore as ``cfp_schema``."""


def _to_plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def build_spec(cls: type, values: dict[str, Any]) -> Any:
    """Construct a frozen spec from a mapping, converting strings to enums (runs ``__post_init__``)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    prefix = getattr(cls, "PREFIX", cls.__name__)
    if unknown:
        raise ConfigError([ConfigIssue(key=f"{prefix}.{k}", value=values[k], problem="is not a known setting.",
                                       fix=f"remove it; known keys are {sorted(known)}.") for k in unknown])
    kwargs: dict[str, Any] = {}
    issues: list[ConfigIssue] = []
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for name, value in values.items():
        ftype = hints[name]
        if isinstance(ftype, type) and issubclass(ftype, enum.Enum) and not isinstance(value, ftype):
            try:
                value = ftype(value)
            except ValueError:
                issues.append(ConfigIssue(key=f"{prefix}.{name}", value=value, problem="is not an allowed value.",
                                          fix=f"use one of {[m.value for m in ftype]}."))
                value = defaults[name].default  # keep checking the other fields
        elif isinstance(value, list):
            value = list(value)
        kwargs[name] = value
    try:
        spec = cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(issues + err.issues) from None
    if issues:
        raise ConfigError(issues)
    return spec


def job_from_config(cfg: Any) -> JobSpec:
    """Build frozen specs from a composed Hydra/OmegaConf config (or a plain dict).

    Every section is built even when an earlier one fails, and all problems are raised together.
    """
    from omegaconf import DictConfig, OmegaConf

    if isinstance(cfg, DictConfig):
        raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    else:
        raw = _to_plain(cfg)
    if not isinstance(raw, dict):
        raise ConfigError(ConfigIssue(key="<root>", value=type(raw).__name__, problem="the config is not a mapping.",
                                      fix="compose it with Hydra from conf/config.yaml."))
    issues: list[ConfigIssue] = []
    built: dict[str, Any] = {}
    for name, cls in SECTIONS.items():
        try:
            built[name] = build_spec(cls, _to_plain(raw.get(name, {})))
        except ConfigError as err:
            issues.extend(err.issues)
    # cfp: the planner's group (cfp_from_config); backend: the training engine's (backend_from_config)
    extra = sorted(set(raw) - set(SECTIONS) - {"hydra", "cfp", "backend"})
    issues.extend(ConfigIssue(key=k, value=raw[k], problem="is not a known config group.",
                              fix=f"remove it; groups are {sorted(SECTIONS)}.") for k in extra)
    if issues:
        raise ConfigError(issues)
    return JobSpec(**built)
