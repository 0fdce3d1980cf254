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
import functools
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from cfp_megatron.base.data_blend import Blend, read_blend
from cfp_megatron.base.enums import IdentityEnum
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.layout_rules import batch as batch_rules
from cfp_megatron.base.layout_rules import moe as moe_rules
from cfp_megatron.base.layout_rules import offload as offload_rules
from cfp_megatron.base.layout_rules import pipeline as pipeline_rules
from cfp_megatron.base.layout_rules import recompute as recompute_rules
from cfp_megatron.base.layout_rules import tensor as tensor_rules
from cfp_megatron.base.layout_rules.problem import issues as rule_issues
from cfp_megatron.base.layout_rules.tensor import primepar_grid_side as primepar_grid_side
from cfp_megatron.base.pipeline_layout import layout_issues


class Precision(IdentityEnum):
    """Number format of the training run: of parameters and activations, and of the linear layers' GEMMs
    (docs/configuration.md, "Number formats")."""

    auto = "auto"
    """bf16 on GPUs, fp32 on CPU."""
    fp32 = "fp32"
    """fp32 throughout."""
    bf16 = "bf16"
    """bf16 weights, activations and GEMMs (fp32 main weights and gradients)."""
    fp16 = "fp16"
    """fp16 with loss scaling."""
    fp8 = "fp8"
    """bf16 weights and activations, the linear layers' and grouped expert GEMMs in FP8 through Transformer Engine,
    scaled as ``train.fp8_recipe`` says (Megatron-Core's ``fp8``)."""
    fp4 = "fp4"
    """bf16 weights and activations, the linear layers' and grouped expert GEMMs in FP4 through Transformer Engine,
    scaled as ``train.fp4_recipe`` says (Megatron-Core's ``fp4``)."""


class Fp8Recipe(IdentityEnum):
    """How Transformer Engine scales FP8 tensors (Megatron-Core's ``fp8_recipe``)."""

    delayed = "delayed"
    """Per-tensor scales from an amax history of earlier steps (``DelayedScaling``)."""
    tensorwise = "tensorwise"
    """Per-tensor scales from the tensor itself, just in time (``Float8CurrentScaling``): an amax pass first."""
    blockwise = "blockwise"
    """A scale per 1 x 128 activation tile and 128 x 128 weight block (``Float8BlockScaling``, DeepSeek-V3's)."""
    mxfp8 = "mxfp8"
    """An E8M0 scale per 32 elements, computed by the tensor cores (``MXFP8BlockScaling``; Blackwell)."""


class Fp4Recipe(IdentityEnum):
    """How Transformer Engine scales FP4 tensors (Megatron-Core's ``fp4_recipe``)."""

    nvfp4 = "nvfp4"
    """An E4M3 scale per 16 elements and a tensor scale, random Hadamard transforms on the weight gradient's inputs
    (``NVFP4BlockScaling``; Blackwell)."""


class Recompute(IdentityEnum):
    """Activation recomputation (Megatron's ``recompute_granularity``)."""

    none = "none"
    selective = "selective"
    full = "full"


class RecomputeModule(IdentityEnum):
    """A submodule Megatron-Core's selective recomputation can recompute (``recompute_modules``)."""

    core_attn = "core_attn"
    """The core attention (its scores and softmax; Megatron-Core's default)."""
    moe_act = "moe_act"
    """The experts' activation function (output discarded, recomputed from the first expert GEMM's output)."""
    layernorm = "layernorm"
    """The two norms of the layer (their outputs, the inputs of the QKV and first MLP GEMMs, discarded)."""
    mla_up_proj = "mla_up_proj"
    """Multi-head latent attention's up-projections and rotary embedding (their outputs discarded)."""
    mlp = "mlp"
    """A dense layer's whole MLP (only its input kept)."""
    moe = "moe"
    """A MoE layer's whole MoE block, token exchange included (only its input kept)."""
    shared_experts = "shared_experts"
    """A MoE layer's shared expert (only its input kept)."""


RECOMPUTE_SEPARATOR = "+"
"""What joins the modules of ``parallel.recompute_modules`` (a comma would split a Hydra override into a sweep)."""


def recompute_modules(text: str | None) -> tuple[RecomputeModule, ...]:
    """The modules ``parallel.recompute_modules`` names, in :class:`RecomputeModule` order; ``None``: Megatron-Core's
    default (``core_attn``). Raises ``ValueError`` naming an unknown module."""
    if text is None:
        return (RecomputeModule.core_attn,)
    names = [n.strip() for n in text.split(RECOMPUTE_SEPARATOR)]
    unknown = [n for n in names if n not in RecomputeModule.__members__]
    if unknown or not text.strip():
        raise ValueError(f"unknown module(s) {unknown or [text]}")
    return tuple(m for m in RecomputeModule if m.value in names)


@functools.lru_cache(maxsize=256)
def _module_set(text: str | None) -> frozenset[RecomputeModule]:
    """:func:`recompute_modules` of a checked ``parallel.recompute_modules``, as a set (cached: the simulator reads a
    plan's modules for every rank of every plan a search prices)."""
    return frozenset(recompute_modules(text))


@functools.lru_cache(maxsize=256)
def _canonical_modules(text: str) -> str:
    """``parallel.recompute_modules`` as :class:`ParallelSpec` stores it: the modules in :class:`RecomputeModule`
    order, joined by :data:`RECOMPUTE_SEPARATOR`; ``ValueError`` for an unknown module."""
    return RECOMPUTE_SEPARATOR.join(m.value for m in recompute_modules(text))


class CpCommType(IdentityEnum):
    """How context-parallel attention exchanges keys and values (Megatron-Core's ``cp_comm_type``, Transformer
    Engine's implementations)."""

    p2p = "p2p"
    """A ring of point-to-point K/V exchanges, each step overlapped with one block of attention."""
    all_gather = "all_gather"
    """All-gather every rank's K/V before attention (reduce-scatter their gradients after)."""
    a2a = "a2a"
    """All-to-all from sequence to head sharding around attention (DeepSpeed-Ulysses); heads split over CP."""
    a2a_p2p = "a2a+p2p"
    """All-to-all inside a node, a point-to-point ring across nodes (hierarchical)."""


class FsdpStrategy(IdentityEnum):
    """What Megatron-FSDP shards over the data-parallel ranks (Megatron-Core's ``data_parallel_sharding_strategy``
    with ``use_megatron_fsdp``)."""

    none = "none"
    """No Megatron-FSDP: Megatron-Core's own DDP, with the distributed optimizer where
    ``parallel.distributed_optimizer`` says (Megatron-FSDP's ``no_shard`` does the same)."""
    optim = "optim"
    """The optimizer states and fp32 master weights (ZeRO-1): gradients reduce-scattered at the step, the updated
    weights all-gathered after it."""
    optim_grads = "optim_grads"
    """The gradients too (ZeRO-2): each micro-batch's gradients reduce-scattered to their owners."""
    optim_grads_params = "optim_grads_params"
    """The weights too (ZeRO-3): each layer's weights all-gathered before its forward and its backward, the next
    layer's prefetched."""


class CudaGraphImpl(IdentityEnum):
    """How CUDA graphs capture the step (Megatron-Core's ``cuda_graph_impl``)."""

    none = "none"
    """No CUDA graph: every kernel launched by the host."""
    local = "local"
    """Megatron-Core's ``CudaGraphManager`` per layer, or the whole forward-backward with ``full_iteration``."""
    transformer_engine = "transformer_engine"
    """Transformer Engine's ``make_graphed_callables`` per layer, over the scopes of ``cuda_graph_scope``."""


class MoeTokenPolicy(IdentityEnum):
    """How a MoE layer treats the tokens routed beyond an expert's capacity (``cfp.constraints.moe_token_policy``):
    Megatron-Core's ``moe_expert_capacity_factor`` and ``moe_pad_expert_input_to_capacity`` as one choice."""

    dropless = "dropless"
    """Every routed token reaches its experts (no capacity factor)."""
    drop = "drop"
    """Tokens beyond each expert's capacity are dropped (a capacity factor, no padding)."""
    drop_pad = "drop_pad"
    """Dropped beyond capacity, and each expert's input padded to its capacity (static shapes, no host sync)."""

    @classmethod
    def of(cls, model: ModelSpec) -> MoeTokenPolicy:
        """The policy ``model``'s capacity settings set."""
        if model.moe_expert_capacity_factor is None:
            return cls.dropless
        return cls.drop_pad if model.moe_pad_expert_input_to_capacity else cls.drop


CUDA_GRAPH_SCOPES = ("attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration")
"""Megatron-Core's ``CudaGraphScope`` names (megatron-core 0.16.1 ``transformer/enums.py``)."""


def cuda_graph_scopes(text: str | None) -> tuple[str, ...]:
    """``parallel.cuda_graph_scope`` as Megatron-Core's scope names (empty: the whole layer); ``ValueError`` naming
    what is not one."""
    if text is None or text == "full":
        return ()
    names = tuple(dict.fromkeys(name.strip() for name in text.split(RECOMPUTE_SEPARATOR)))
    unknown = [name for name in names if name not in CUDA_GRAPH_SCOPES]
    if unknown or not names:
        raise ValueError(f"{', '.join(unknown) or repr(text)} is not a CUDA graph scope")
    return names


class RecomputeMethod(IdentityEnum):
    """Which layers full recomputation covers (Megatron's ``recompute_method``)."""

    uniform = "uniform"
    """Every layer is recomputed, in groups of ``recompute_num_layers`` layers (each group keeps only its input)."""
    block = "block"
    """Only the first ``recompute_num_layers`` layers of each pipeline chunk (virtual stage) are recomputed; the
    chunk's other layers keep their activations."""


class MlpPartition(IdentityEnum):
    """How the dense MLP's two linear layers are split over the tensor-parallel group."""

    megatron = "megatron"
    """Megatron-Core's column-parallel ``linear_fc1`` then row-parallel ``linear_fc2`` (an all-reduce of the output
    in the forward pass and of the input gradient in the backward pass)."""
    primepar = "primepar"
    """PrimePar's spatial-temporal partition P_{2^k x 2^k} (:mod:`cfp_megatron.layers`): the TP group (4^k ranks) is
    a 2^k x 2^k grid, every weight and activation block is held once, partial sums accumulate locally over 2^k ring
    steps; the MLP's input is sliced from the replicated hidden states (all-gathered from the sequence shards first
    under sequence parallelism) and its output all-gathered (then cut to this rank's sequence shard under it)."""


class PositionEmbedding(IdentityEnum):
    """How token positions enter the model (Megatron's ``position_embedding_type``)."""

    learned_absolute = "learned_absolute"
    rope = "rope"
    none = "none"


class Normalization(IdentityEnum):
    """Layer normalisation kind."""

    LayerNorm = "LayerNorm"
    RMSNorm = "RMSNorm"


class Activation(IdentityEnum):
    """MLP activation."""

    gelu = "gelu"
    """GELU, not gated (GPT)."""
    swiglu = "swiglu"
    """A gated linear unit with SiLU (LLaMA style): ``silu(x1) * x2``."""
    quick_geglu = "quick_geglu"
    """GPT-OSS's gated unit: Megatron-Core's ``quick_gelu`` gate (``x1 * sigmoid(1.702 x1)``) times the linear half
    plus one (``glu_linear_offset=1.0``), optionally clamped first (:attr:`ModelSpec.activation_clamp`); in
    routed experts only (Megatron-Core fuses it only with their per-token probabilities)."""

    @property
    def gated(self) -> bool:
        """Whether fc1 writes two halves, a gate and a linear part (fc1 twice the FFN width)."""
        return self is not Activation.gelu


class AttentionKind(IdentityEnum):
    """Self-attention variant."""

    standard = "standard"
    """Multi-head or grouped-query attention (set ``num_query_groups`` for GQA)."""
    mla = "mla"
    """Multi-latent attention (DeepSeek-V2/V3), Megatron-Core's ``MLASelfAttention``."""


class AttentionKernel(IdentityEnum):
    """How the attention core runs, which decides what it keeps for the backward pass and what it reads and writes."""

    flash = "flash"
    """A fused kernel (Transformer Engine's FlashAttention/cuDNN backends) that keeps no ``s x s`` scores and skips
    the masked upper triangle of causal attention."""
    fused_softmax = "fused_softmax"
    """Megatron's unfused core with its fused scale-mask-softmax CUDA kernel (``scaled_masked_softmax_cuda``): the
    bf16 probabilities, which the context GEMM reads too, are what it keeps."""
    torch_softmax = "torch_softmax"
    """Megatron-Core's unfused core without that kernel (no Transformer Engine, no Apex): PyTorch's softmax in fp32
    (``attention_softmax_in_fp32``) keeps its fp32 output, and the context GEMM keeps the bf16 copy."""


class RouterScore(IdentityEnum):
    """MoE router score function."""

    softmax = "softmax"
    sigmoid = "sigmoid"


class TokenDispatcher(IdentityEnum):
    """MoE token dispatcher (Megatron's ``moe_token_dispatcher_type``)."""

    alltoall = "alltoall"
    """All-to-all of the routed token copies over the EP group (NCCL)."""
    allgather = "allgather"
    """All-gather of the EP group's tokens, each rank keeping its experts' (reduce-scatter on the way back)."""
    flex = "flex"
    """Fused dispatch/combine kernels (GPU only) of ``parallel.moe_flex_dispatcher_backend``: DeepEP or HybridEP,
    one copy of a token per destination rank inside the NVLink group, per destination node across it."""


class FlexBackend(IdentityEnum):
    """The flex dispatcher's kernels (Megatron-Core's ``moe_flex_dispatcher_backend``)."""

    deepep = "deepep"
    """DeepEP's normal kernels (``deep_ep.Buffer``): NVLink among the GPUs of one host (CUDA IPC), RDMA between
    hosts; the receiver permutes what arrives by expert. Megatron-Core's default."""
    hybridep = "hybridep"
    """HybridEP (``deep_ep.HybridEPBuffer``, DeepEP's ``hybrid-ep`` branch): NVLink over the whole NVLink domain
    (multi-node NVLink, e.g. GB200 NVL72), RDMA between domains; the permutation by expert, and the padding FP8/FP4
    need, fused into the dispatch kernel."""


class OptimizerKind(IdentityEnum):
    """Optimizer; both come from ``megatron.core.optimizer``."""

    adam = "adam"
    sgd = "sgd"


class LRSchedule(IdentityEnum):
    """Learning-rate decay after warm-up (``megatron.core.optimizer_param_scheduler``)."""

    constant = "constant"
    linear = "linear"
    cosine = "cosine"


class DataKind(IdentityEnum):
    """Where training tokens come from."""

    synthetic = "synthetic"
    """Deterministic generated sequences with learnable structure; needs no files."""
    indexed = "indexed"
    """Megatron's indexed dataset (``.bin``/``.idx``) read by ``megatron.core.datasets.GPTDataset``."""


class TokenizerKind(IdentityEnum):
    """Tokenizer used by the indexed dataset and its preprocessing tool."""

    byte = "byte"
    """UTF-8 bytes (vocabulary 256 plus end-of-document); needs no files."""
    huggingface = "huggingface"
    """A local ``tokenizer.json`` read with the ``tokenizers`` package."""


class Backend(IdentityEnum):
    """torch.distributed backend."""

    auto = "auto"
    """NCCL when CUDA is available, else gloo."""
    nccl = "nccl"
    """NCCL; on ROCm builds of torch the same backend name runs RCCL (AMD Instinct)."""
    gloo = "gloo"


class Network(IdentityEnum):
    """Scale-out fabric between NVLink domains (``cluster.network``)."""

    infiniband = "infiniband"
    """InfiniBand (NDR 400 Gb/s, XDR 800 Gb/s per port)."""
    roce = "roce"
    """RDMA over Converged Ethernet (Spectrum-X, Broadcom, AMD Pollara NICs)."""
    omnipath = "omnipath"
    """Intel/Cornelis Omni-Path (100 Gb/s OPA100, 400 Gb/s CN5000)."""
    efa = "efa"
    """AWS Elastic Fabric Adapter (100 Gb/s links: 4 on P4, 32 on P5)."""
    slingshot = "slingshot"
    """HPE Slingshot-11 (200 Gb/s links)."""
    ethernet = "ethernet"
    """Plain Ethernet without RDMA (NCCL's socket transport)."""


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


MAX_WORLD_SIZE = 2**20
"""Most ranks (GPUs) a job or plan may have: 1,048,576, ten times the largest clusters built (about 100k GPUs); the
published runs in ``shared/data`` use at most 6,144. Beyond it the planner's search runs for minutes to hours."""
MAX_GPUS_PER_NODE = 1024
"""Most GPUs (or CPU processes) per node: NVL72/NVL576 racks are one NVLink domain, but a node stays 4 to 8 GPUs."""
_SPEC_PATH = r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*"
"""The form of ``model.spec``: a dotted module path, a colon, a name in it."""
MAX_LAYERS = 4096
"""Most transformer layers (largest published: 128); 200,000 layers exhaust host memory while capturing the model."""
MAX_HIDDEN = 2**18
"""Largest hidden, head, rank or per-expert size (262,144; largest published hidden 25,600, FFN 102,400)."""
MAX_FFN = 2**20
"""Largest MLP hidden size (1,048,576)."""
MAX_HEADS = 4096
"""Most attention heads (largest published: 160)."""
MAX_VOCAB = 2**24
"""Largest vocabulary (16,777,216; today's largest are about 256k)."""
MAX_SEQUENCE = 2**24
"""Longest sequence and position embedding (16,777,216 tokens; the longest contexts trained today are about 10M)."""
MAX_EXPERTS = 2**16
"""Most routed experts per MoE layer (65,536; largest published 256)."""
MAX_GLOBAL_BATCH = 2**20
"""Most sequences per optimizer step (1,048,576; largest published 8,192, Llama 3 405B's 16M-token batch is 2,048 x
8,192)."""
MAX_MICROBATCHES = 2**16
"""Most micro-batches one data-parallel rank runs per step (65,536; published runs accumulate at most 128): more is
a typo, and the step would run for hours."""
MAX_STEPS = 10**9
"""Most optimizer steps (and warm-up, decay, log and save intervals): a 15T-token run is about a million steps."""
MAX_SEED = 2**32 - 1
"""Largest seed: Megatron's GPTDataset seeds ``numpy.random.RandomState``, which takes 32-bit seeds."""
MAX_TIMEOUT_S = 7 * 24 * 3600
"""Longest collective timeout (``train.collective_timeout_s``): a week; a stalled rank is named only after it."""


def _at_most(issues: list[ConfigIssue], prefix: str, obj: object, limit: int, what: str, *names: str) -> None:
    """Check that each named integer field is at most ``limit`` (``None`` is allowed); ``what`` says why."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, int) and value > limit:
            _issue(issues, False, f"{prefix}.{name}", value, f"exceeds {limit:,}, far beyond {what}.",
                   f"set {prefix}.{name} to at most {limit} (see docs/configuration.md, 'Bounds').")


def _finite(issues: list[ConfigIssue], prefix: str, obj: object, *names: str) -> None:
    """Check that each named float field is a finite number (not NaN or infinite)."""
    for name in names:
        value = getattr(obj, name)
        if isinstance(value, int | float) and not math.isfinite(value):
            _issue(issues, False, f"{prefix}.{name}", value, "must be a finite number.",
                   f"set {prefix}.{name} to a real number (its default is a good start).")


def resolve_precision(precision: Precision, on_gpu: bool) -> Precision:
    """The precision of parameters and activations: ``auto`` is bf16 on GPU and fp32 on CPU; ``fp8`` and ``fp4``
    keep bf16 weights and activations (only their GEMMs run in the low format)."""
    if precision is Precision.auto:
        return Precision.bf16 if on_gpu else Precision.fp32
    if precision in (Precision.fp8, Precision.fp4):
        return Precision.bf16
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
    activation_clamp: float | None = None
    """With ``activation=quick_geglu``: clamp fc1's output before the activation, the gate half at most this, the
    linear half within plus or minus it (Megatron-Core's ``activation_func_clamp_value``; GPT-OSS: 7.0); ``None``: no
    clamp."""
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
    window_size: int | None = None
    """Sliding-window attention: each query attends to itself and this many tokens before it (Megatron-Core's
    ``window_size = (window_size, 0)``); ``None``: every layer attends causally over the whole sequence."""
    window_attn_skip_freq: int | None = None
    """With ``window_size``: every this-many-th layer attends over the whole sequence, the others over the window
    (Megatron-Core's ``window_attn_skip_freq``; 2 alternates them, as GPT-OSS does); ``None``: every layer windowed."""
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
    moe_router_fp32: bool = True
    """The router's logits, scores and routing probabilities in fp32 (Megatron-Core's ``moe_router_dtype='fp32'``);
    ``False``: in the compute precision (``moe_router_dtype`` unset, as Megatron-Bridge's GPT-OSS and Qwen3 run)."""
    moe_router_fusion: bool = False
    """The router's score function, top-k and auxiliary loss as Transformer Engine's fused kernels (Megatron-Core's
    ``moe_router_fusion``, which Megatron-Bridge's performance recipes set): one kernel a pass for each, not
    PyTorch's element-wise ops (:func:`~cfp_megatron.sim.terms.expert_dispatch.fused_router_bytes`). Runs only where
    Transformer Engine is installed, on a GPU; left out on CPU with a note. ``False``: Megatron-Core's default."""
    moe_aux_loss_coeff: float = 0.0
    """Load-balancing auxiliary loss coefficient (0 disables it)."""
    moe_token_dispatcher: TokenDispatcher = TokenDispatcher.alltoall
    """How tokens reach their experts across expert-parallel ranks."""
    moe_expert_capacity_factor: float | None = None
    """Token-drop MoE: each expert takes at most this factor times its balanced share of the routed tokens
    (``capacity_factor x tokens x topk / experts``) and drops the rest (Megatron-Core's
    ``moe_expert_capacity_factor``); ``None``: dropless, every token reaches its experts (Megatron-Core's default),
    and the dispatcher syncs the token counts to the host in every MoE layer."""
    moe_pad_expert_input_to_capacity: bool = False
    """With ``moe_expert_capacity_factor``: pad each expert's input to its capacity, so the expert GEMMs and the
    all-to-all carry capacity rows whatever the routing, and no token count reaches the host (Megatron-Core's
    ``moe_pad_expert_input_to_capacity``)."""
    mtp_num_layers: int = 0
    """Multi-token prediction layers (DeepSeek-V3's MTP, Megatron-Core's ``mtp_num_layers``); 0: none. Each one
    predicts one token further with one more decoder layer of the model's last layer kind, fed by a projection
    (``2h -> h``) of the normed embedding of the shifted tokens next to the normed hidden state, and adds another
    pass of the output layer and loss on the chunk that holds the loss. Megatron-Core builds them in the last chunk
    of the last pipeline rank, or where ``parallel.pipeline_model_parallel_layout`` puts its ``m``."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP losses (their mean over the MTP layers) added to the language-model loss's gradient
    (Megatron-Core's ``mtp_loss_scaling_factor``; DeepSeek-V3 trained with 0.3, then 0.1). The reported loss is the
    language model's alone."""
    spec: str | None = None
    """A custom decoder layer through Megatron-Core's ``ModuleSpec``: ``package.module:name``, a module-level
    ``ModuleSpec`` (as Megatron-LM's ``--spec <module> <name>`` names one) or a function of the ``TransformerConfig``
    that returns one (``fn(config)``, or ``fn(config, vp_stage=...)``; Megatron-Bridge's ``transformer_layer_spec``);
    ``None``: Megatron-Core's GPT layer specs. Trained, captured and planned with (docs/analysis.md)."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "kv_channels", "vocab_size", "make_vocab_size_divisible_by",
                  "max_position_embeddings", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                  "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                  "qk_pos_emb_head_dim", "v_head_dim", "window_size", "window_attn_skip_freq")
        published = "the largest published models"
        _at_most(issues, p, self, MAX_LAYERS, f"{published} (128 layers)", "num_layers", "mtp_num_layers",
                 "moe_first_dense_layers")
        _at_most(issues, p, self, MAX_HIDDEN, f"{published} (hidden 25,600)", "hidden_size", "kv_channels",
                 "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")
        _at_most(issues, p, self, MAX_FFN, f"{published} (FFN 102,400)", "ffn_hidden_size", "moe_ffn_hidden_size",
                 "moe_shared_expert_intermediate_size")
        _at_most(issues, p, self, MAX_HEADS, f"{published} (160 heads)", "num_attention_heads", "num_query_groups")
        _at_most(issues, p, self, MAX_VOCAB, "today's vocabularies (about 256k)", "vocab_size",
                 "make_vocab_size_divisible_by")
        _at_most(issues, p, self, MAX_SEQUENCE, "today's longest contexts (about 10M tokens)",
                 "max_position_embeddings")
        _at_most(issues, p, self, MAX_EXPERTS, f"{published} (256 experts)", "num_experts", "moe_router_topk")
        _finite(issues, p, self, "rotary_base", "norm_epsilon", "init_method_std", "hidden_dropout",
                "attention_dropout", "moe_aux_loss_coeff", "activation_clamp")
        if self.activation_clamp is not None:
            _issue(issues, not math.isfinite(self.activation_clamp) or self.activation_clamp > 0,
                   f"{p}.activation_clamp", self.activation_clamp, "must be positive.", "use e.g. 7.0 (GPT-OSS).")
            _issue(issues, self.activation is Activation.quick_geglu, f"{p}.activation_clamp", self.activation_clamp,
                   f"clamps only the quick_geglu activation (model.activation={self.activation.value}: Megatron-Core's "
                   "fused SwiGLU and GELU ignore it).",
                   f"set {p}.activation=quick_geglu, or set this to null.")
        if self.activation is Activation.quick_geglu:
            dense = ("a dense model" if self.num_experts is None else "its dense first layers"
                     if self.moe_first_dense_layers else "its shared expert"
                     if self.moe_shared_expert_intermediate_size else None)
            _issue(issues, dense is None, f"{p}.activation", self.activation.value,
                   f"runs only in routed experts, not in {dense}: Megatron-Core's MLP fuses quick GEGLU only with the "
                   "experts' per-token probabilities and raises 'Only support fusion of gelu and swiglu' for a dense "
                   "MLP or shared expert under bias_activation_fusion, which GPU runs set.",
                   f"use {p}.activation=swiglu, or a MoE model without dense layers or shared experts (as GPT-OSS).")
        _issue(issues, not math.isfinite(self.rotary_base) or self.rotary_base > 0, f"{p}.rotary_base",
               self.rotary_base, "must be positive.", "use e.g. 10000 (500000 for LLaMA 3).")
        _issue(issues, not math.isfinite(self.norm_epsilon) or self.norm_epsilon > 0, f"{p}.norm_epsilon",
               self.norm_epsilon, "must be positive.", "use e.g. 1e-5.")
        _issue(issues, not math.isfinite(self.moe_aux_loss_coeff) or self.moe_aux_loss_coeff >= 0,
               f"{p}.moe_aux_loss_coeff", self.moe_aux_loss_coeff, "must not be negative.",
               "use 0 (off) or e.g. 1e-2.")
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
        issues += rule_issues(moe_rules.capacity(factor=self.moe_expert_capacity_factor,
                                                 pad=self.moe_pad_expert_input_to_capacity,
                                                 is_moe=self.num_experts is not None))
        if self.num_experts is None:
            _issue(issues, self.moe_shared_expert_intermediate_size is None,
                   f"{p}.moe_shared_expert_intermediate_size", self.moe_shared_expert_intermediate_size,
                   "shared experts need a MoE model.", "set model.num_experts, or set this to null.")
        _issue(issues, self.mtp_num_layers >= 0, f"{p}.mtp_num_layers", self.mtp_num_layers,
               "must not be negative.", f"set {p}.mtp_num_layers=0 (no MTP) or more.")
        _issue(issues, self.mtp_loss_scaling_factor >= 0.0, f"{p}.mtp_loss_scaling_factor",
               self.mtp_loss_scaling_factor, "must not be negative.",
               f"set {p}.mtp_loss_scaling_factor=0.1 (Megatron-Core's default).")
        _issue(issues, self.window_attn_skip_freq is None or self.window_size is not None,
               f"{p}.window_attn_skip_freq", self.window_attn_skip_freq, "has no effect without a sliding window.",
               f"set {p}.window_size (e.g. 128), or set this to null.")
        if self.spec is not None:
            _issue(issues, isinstance(self.spec, str) and re.fullmatch(_SPEC_PATH, self.spec) is not None,
                   f"{p}.spec", self.spec, "is not a path of the form package.module:name.",
                   "write the module and the name of its ModuleSpec, or of the function that returns one, with a "
                   "colon: e.g. model.spec=my_layers.specs:gated_mlp_spec (null for Megatron-Core's own specs).")
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
    def windowed_layers(self) -> int:
        """Decoder layers that attend over ``window_size`` tokens (Megatron-Core's ``is_layer_window_attention``:
        with ``window_attn_skip_freq`` N, every layer whose 1-based number is not a multiple of N)."""
        if self.window_size is None:
            return 0
        if self.window_attn_skip_freq is None:
            return self.num_layers
        return self.num_layers - self.num_layers // self.window_attn_skip_freq

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

    @property
    def moe_dropless(self) -> bool:
        """Whether every routed token reaches its experts (no ``moe_expert_capacity_factor``)."""
        return self.moe_expert_capacity_factor is None

    @property
    def moe_counts_to_host(self) -> bool:
        """Whether Megatron-Core's token dispatcher copies each MoE layer's token counts to the host and waits for
        them (a device-to-host synchronisation per MoE layer and forward pass): the all-gather dispatcher always
        (``MoEAllGatherTokenDispatcher``: ``.cpu()``); the all-to-all and flex dispatchers where dropless or
        token-drop without padding size their buffers by the counts (megatron-core 0.16.1 ``token_dispatcher.py``:
        ``_maybe_dtoh_and_synchronize``; DeepEP returns its receive counts to the host), not under drop-and-pad
        (``moe_pad_expert_input_to_capacity``), which knows its sizes (``MoEAlltoAllTokenDispatcher.preprocess``)."""
        if self.moe_token_dispatcher is TokenDispatcher.allgather:
            return self.is_moe
        return self.is_moe and not self.moe_pad_expert_input_to_capacity

    def expert_load(self, imbalance: float) -> float:
        """Rows each expert on the busiest expert rank computes (and its all-to-all carries), over the balanced share
        ``tokens x topk / experts``: dropless, the routing ``imbalance``; token-drop, at most the capacity factor;
        padded to capacity, the capacity factor whatever the routing."""
        factor = self.moe_expert_capacity_factor
        if factor is None:
            return imbalance
        return factor if self.moe_pad_expert_input_to_capacity else min(imbalance, factor)


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """The machines the job runs on (Hydra group ``cluster``). Figures are per GPU unless said otherwise."""

    PREFIX: ClassVar[str] = "cluster"
    NUMBER_FORMATS: ClassVar[tuple[str, ...]] = ("fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "mxfp6", "mxfp4",
                                                 "nvfp4")
    """The values ``number_formats`` may list."""

    name: str = "local"
    """Preset name."""
    nodes: int = 1
    """Number of nodes."""
    gpus_per_node: int | None = None
    """Accelerators (or, on CPU, processes) per node; ``None`` means what torchrun started (LOCAL_WORLD_SIZE)."""
    device_name: str = "cpu"
    """Accelerator model, for reports."""
    generation: str | None = None
    """Architecture generation of the accelerator (``ampere``, ``hopper``, ``blackwell``, ``cdna3``, ``cdna4``;
    ``cpu`` for CPU ranks): the simulator's fitted efficiencies are per generation
    (``cfp_megatron/sim/efficiencies.json``). ``None``, or a generation that file does not know: the file's fallback
    generation's efficiencies, said as a warning in the plan's output."""
    supports_tp_overlap: bool | None = None
    """Whether Transformer Engine's TP communication overlap (comm-GEMM overlap, ``parallel.tp_comm_overlap``) runs
    on this accelerator (Hopper and later). ``None``: not stated; the planner does not turn it on (the plan's output
    says so)."""
    number_formats: list[str] | None = None
    """Number formats its matrix units compute in, as its datasheet lists them: some of ``fp32``, ``tf32`` (fp32 on
    tensor cores), ``bf16``, ``fp16``, ``fp8``, ``mxfp8``, ``mxfp6``, ``mxfp4``, ``nvfp4`` (:attr:`NUMBER_FORMATS`).
    ``None``: not stated. The simulator reads the peaks (``peak_tflops_*``), not this list."""
    aliases: list[str] | None = None
    """Names the accelerator goes by in published tables (``H100 SXM``, ``H100-SXM5-80GB``); a row's GPU maps to
    the preset with the longest alias its text contains, compared without case, spaces or punctuation
    (:func:`~cfp_megatron.cluster.presets.preset_for_gpu`). ``None``: none."""
    peak_tflops_bf16: float | None = None
    """Dense bf16 peak in TFLOP/s; ``None`` means measure it at start-up (used for MFU)."""
    peak_tflops_fp8: float | None = None
    """Dense fp8 peak in TFLOP/s; ``None`` if the device has no fp8 tensor cores."""
    peak_tflops_fp4: float | None = None
    """Dense NVFP4 peak in TFLOP/s (without 2:4 sparsity); ``None`` if the device has no FP4 tensor cores."""
    peak_tflops_fp32: float | None = None
    """fp32 peak in TFLOP/s (TF32 tensor cores where present); ``None`` means measure it."""
    hbm_gib: float | None = None
    """Memory capacity per rank in GiB (the planner's limit); ``None``: the GPU's as torch reports it, or on a machine
    without one this host's memory shared by its ranks, less ``host_reserve_gib`` and ``rank_reserve_gib``."""
    host_reserve_gib: float | None = None
    """On CPU (``hbm_gib`` null): GiB of the host's memory left to the OS and other programs (``None``: none)."""
    rank_reserve_gib: float | None = None
    """On CPU (``hbm_gib`` null): GiB each rank's interpreter, torch and Megatron-Core take beyond what the memory
    model counts (``None``: none)."""
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
    host_link_gbps: float | None = None
    """Unidirectional bandwidth between one GPU and its host's memory in GB/s (PCIe Gen4/Gen5 x16 on DGX systems,
    NVLink-C2C on Grace superchips): what activation offloading (``parallel.cpu_offloading_num_layers``) copies over.
    ``None``: not stated; offloading's transfers are then not priced (its memory is), and DeepSpeed's ZeRO-Offload
    is left out of the search (pinned, it is refused)."""
    host_memory_bandwidth_gbps: float | None = None
    """CPU memory bandwidth of one node in GB/s, all sockets together (the host CPUs' datasheet figure: memory
    channels x transfer rate x 8 bytes), shared by the node's ranks: what DeepSpeed's ZeRO-Offload prices its CPU
    Adam step at, and on CPU ranks its host copies. ``None``: not stated; ZeRO-Offload is then left out of the
    DeepSpeed search (pinned, it is refused)."""
    rails_per_node: int | None = None
    """Network rails (NICs, each on its own leaf switch) per node; on DGX systems one per GPU, so GPU ``i`` of
    every node shares rail ``i`` and same-index GPUs talk across nodes without crossing the spine. ``None``: one
    NIC per GPU assumed. ``nics_per_node``, when set, replaces it (see :attr:`rails`)."""
    nvlink_domain_size: int | None = None
    """GPUs that share the scale-up fabric (NVLink/NVSwitch, AMD Infinity Fabric): a group inside one domain talks
    at the ``intra_node_*`` figures, a group that spans domains over the network (``inter_node_*``). ``None``: one
    node (``gpus_per_node``). 72 on an NVL72 rack (18 trays of 4 GPUs: TP/EP/CP groups of up to 72 ranks stay on
    NVLink); 2 on H100 NVL cards bridged in pairs. A multiple of ``gpus_per_node`` (whole nodes share it) or a
    divisor of it (several domains in a node). Memory and the world size stay per node."""
    nvlink_segment_nodes: int | None = None
    """Nodes of a job that spans several multi-node NVLink domains placed together in one domain (Slurm's
    ``--segment`` under its topology/block plugin): each domain then holds that many nodes of consecutive ranks,
    and groups are priced on domains of ``nvlink_segment_nodes x gpus_per_node`` GPUs. ``None``: the largest power of
    two that fits a domain (16 trays = 64 GPUs on an NVL72 rack), the segment NVIDIA recommends for jobs of 128 GPUs
    and more; a job that fits one domain runs in one. Unused where the domain is a node or smaller."""
    network: Network | None = None
    """Scale-out fabric between domains (``infiniband``, ``roce``, ``omnipath``, ``efa``, ``slingshot``,
    ``ethernet``): the cost model scales the network bandwidth by the share of line rate NCCL reaches on it relative
    to InfiniBand's, on which the efficiencies were fitted (``cfp_megatron/cluster/fabrics.yaml``, with sources:
    Omni-Path 0.34 / 0.85). ``None``: InfiniBand's."""
    nics_per_node: int | None = None
    """Network links (NIC ports of the GPU fabric) per node. With ``nic_gbps``, or alone (keeping the preset's link
    speed), it sets the per-GPU network bandwidth and the rails, and wins over ``inter_node_bandwidth_gbps`` and
    ``rails_per_node`` (see :attr:`network_bandwidth_gbps`). ``None``: the preset's figures."""
    nic_gbps: float | None = None
    """Line rate of one network link in Gb/s (200 HDR, 400 NDR/400GbE, 800 XDR/ConnectX-8). With
    ``nics_per_node``, or alone (keeping the preset's link count, ``rails_per_node``), it sets the per-GPU network
    bandwidth and wins over ``inter_node_bandwidth_gbps``. ``None``: the preset's figure."""
    max_sm_clock_mhz: float | None = None
    """Maximum (boost) SM clock in MHz: the clock the peak TFLOP/s figures are quoted at."""
    sm_count: int | None = None
    """Streaming multiprocessors (AMD: compute units) of one GPU: the tiles of a GEMM run in waves of this many
    (the grouped expert GEMMs' wave quantisation). ``None``: not stated, no wave quantisation."""
    sm_clock_mhz: float | None = None
    """SM clock the GPUs are held at (``nvidia-smi -lgc``, ``rocm-smi --setsclk``) in MHz; the compute peaks scale by
    ``sm_clock_mhz / max_sm_clock_mhz`` (HBM and link bandwidth do not). ``None``: the maximum clock. Needs
    ``max_sm_clock_mhz``."""
    tdp_w: float | None = None
    """Board power (TDP/TBP) in watts the peak figures are quoted at."""
    power_limit_w: float | None = None
    """Power cap in watts (``nvidia-smi -pl``); the compute peaks scale by the clock it sustains, approximated as
    ``(power_limit_w / tdp_w) ** (1/3)`` at most 1 (see :attr:`clock_scale`). ``None``: no cap. Needs ``tdp_w``."""
    backend: Backend = Backend.auto
    """torch.distributed backend."""

    @property
    def on_cpu(self) -> bool:
        """Whether the ranks are CPU processes (``device_name: cpu``): no fused CUDA kernels, and transfers are work
        on the same cores as the compute."""
        return self.device_name.strip().lower() == "cpu"

    def domain_size(self, gpus_per_node: int | None = None, world_size: int | None = None) -> int:
        """GPUs per scale-up (NVLink) domain: ``nvlink_domain_size``, else one node of ``gpus_per_node`` (the node
        size in use; default this cluster's, else 1). The cost model's fast link is "same domain", not "same node".

        With ``world_size``, the GPUs of that job per domain: a job larger than one multi-node domain is placed in
        segments of ``nvlink_segment_nodes`` nodes (:attr:`nvlink_segment_nodes`), one per domain."""
        node = gpus_per_node or self.gpus_per_node or 1
        domain = self.nvlink_domain_size or node
        if world_size is None or domain <= node or world_size <= domain:
            return domain
        segment = self.nvlink_segment_nodes or 1 << ((domain // node).bit_length() - 1)
        return min(segment * node, domain)

    @property
    def rails(self) -> int | None:
        """Network rails per node: ``nics_per_node``, else ``rails_per_node``, else one per GPU (``None`` when the
        cluster leaves the GPU count to torchrun)."""
        return self.nics_per_node or self.rails_per_node or self.gpus_per_node

    @property
    def network_bandwidth_gbps(self) -> float | None:
        """Unidirectional network bandwidth per GPU between domains in GB/s, as the cost model reads it.

        Without ``nics_per_node`` and ``nic_gbps`` it is ``inter_node_bandwidth_gbps``. With either, the NIC fields
        win: ``links x Gb/s per link / 8 / gpus_per_node``, where a missing ``nics_per_node`` is the preset's link
        count (:attr:`rails`) and a missing ``nic_gbps`` the preset's per-link speed
        (``inter_node_bandwidth_gbps x gpus_per_node / rails_per_node``)."""
        if self.nics_per_node is None and self.nic_gbps is None:
            return self.inter_node_bandwidth_gbps
        gpus = self.gpus_per_node
        preset_links = self.rails_per_node or gpus
        if gpus is None or preset_links is None:
            return self.inter_node_bandwidth_gbps  # refused by __post_init__; kept total for dataclasses.replace
        if self.nic_gbps is not None:
            per_link = self.nic_gbps / 8.0
        elif self.inter_node_bandwidth_gbps is not None:
            per_link = self.inter_node_bandwidth_gbps * gpus / preset_links
        else:
            return None
        return (self.nics_per_node or preset_links) * per_link / gpus

    @property
    def clock_scale(self) -> float:
        """Share of the quoted peak FLOP/s the GPUs run at: ``sm_clock_mhz / max_sm_clock_mhz`` for a held clock and
        ``(power_limit_w / tdp_w) ** (1/3)`` for a power cap (the smaller of the two where both are set), at most 1.

        The power cap's clock is an approximation: on the DVFS curve voltage rises roughly with frequency, so dynamic
        power goes as ``f x V^2 ~ f^3`` and a cap ``P`` sustains about ``f_max x (P / TDP)^(1/3)``; static (leakage)
        power and memory power are ignored, so deep caps are estimated optimistically. A measured peak (ProfileDB)
        already ran at the real clock and is used as measured."""
        scale = 1.0
        if self.sm_clock_mhz is not None and self.max_sm_clock_mhz:
            scale = min(scale, self.sm_clock_mhz / self.max_sm_clock_mhz)
        if self.power_limit_w is not None and self.tdp_w:
            scale = min(scale, (self.power_limit_w / self.tdp_w) ** (1.0 / 3.0))
        return scale

    def clocked_peak_tflops(self, dtype: str) -> float | None:
        """Dense peak TFLOP/s of ``dtype`` (``fp32``, ``bf16``, ``fp16``, ``fp8`` or ``fp4``) at the clock the GPUs
        run at: the preset's figure x :attr:`clock_scale`; ``None`` where the preset states none. The simulator's one
        place where peaks are read (MFU stays against the quoted peak)."""
        nominal = {"fp32": self.peak_tflops_fp32, "bf16": self.peak_tflops_bf16, "fp16": self.peak_tflops_bf16,
                   "fp8": self.peak_tflops_fp8, "fp4": self.peak_tflops_fp4}[dtype]
        return None if nominal is None else nominal * self.clock_scale

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "nodes", "gpus_per_node", "rails_per_node", "nvlink_domain_size", "nics_per_node",
                  "nvlink_segment_nodes", "sm_count")
        _at_most(issues, p, self, MAX_WORLD_SIZE, "the largest clusters built (about 100k GPUs)", "nodes",
                 "nvlink_domain_size")
        _at_most(issues, p, self, MAX_GPUS_PER_NODE, "any node built (4 to 8 GPUs)", "gpus_per_node",
                 "rails_per_node", "nics_per_node")
        if (isinstance(self.gpus_per_node, int) and 1 <= self.nodes <= MAX_WORLD_SIZE
                and 1 <= self.gpus_per_node <= MAX_GPUS_PER_NODE):
            world = self.nodes * self.gpus_per_node
            _issue(issues, world <= MAX_WORLD_SIZE, f"{p}.nodes", self.nodes,
                   f"cluster.nodes x cluster.gpus_per_node = {world:,} GPUs exceeds {MAX_WORLD_SIZE:,}, ten times the "
                   "largest clusters built (the planner's search would run for hours).",
                   f"set {p}.nodes to at most {MAX_WORLD_SIZE // self.gpus_per_node}.")
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if hints[f.name] == float | None and value is not None:
                _issue(issues, isinstance(value, int | float) and value > 0 and math.isfinite(value), f"{p}.{f.name}",
                       value, "must be positive and finite.", f"set a positive figure, or null for {p}.{f.name}.")
        unknown = [v for v in self.number_formats or () if v not in self.NUMBER_FORMATS]
        _issue(issues, not unknown, f"{p}.number_formats", self.number_formats,
               f"lists {', '.join(map(repr, unknown))}, not a number format the planner knows.",
               f"list some of {', '.join(self.NUMBER_FORMATS)}, or null.")
        if issues:
            raise ConfigError(issues)
        gpus, domain = self.gpus_per_node, self.nvlink_domain_size
        if domain is not None and gpus is not None:
            _issue(issues, domain % gpus == 0 or gpus % domain == 0, f"{p}.nvlink_domain_size", domain,
                   f"must be a multiple of {p}.gpus_per_node={gpus} (whole nodes share the fabric, e.g. 72 = 18 trays "
                   f"x 4 on an NVL72 rack) or divide it (several domains in a node, e.g. 2 for NVLink-bridged pairs).",
                   f"set {p}.nvlink_domain_size to a multiple or a divisor of {gpus}, or null for one node.")
        segment = self.nvlink_segment_nodes
        if isinstance(segment, int) and segment >= 1 and domain is not None and gpus is not None:
            _issue(issues, segment * gpus <= domain, f"{p}.nvlink_segment_nodes", segment,
                   f"{segment} nodes of {gpus} GPUs do not fit one NVLink domain of {p}.nvlink_domain_size={domain}.",
                   f"set {p}.nvlink_segment_nodes to at most {max(domain // gpus, 1)}, or null.")
        for key in ("nics_per_node", "nic_gbps"):
            if getattr(self, key) is not None and gpus is None:
                issues.append(ConfigIssue(key=f"{p}.{key}", value=getattr(self, key),
                                          problem=f"the per-GPU network bandwidth needs {p}.gpus_per_node.",
                                          fix=f"set {p}.gpus_per_node, or {p}.{key}=null."))
        if (self.nics_per_node is not None and self.nic_gbps is None and gpus is not None
                and self.inter_node_bandwidth_gbps is None):
            issues.append(ConfigIssue(key=f"{p}.nics_per_node", value=self.nics_per_node,
                                      problem=f"without {p}.nic_gbps the link speed comes from "
                                              f"{p}.inter_node_bandwidth_gbps, which is not set.",
                                      fix=f"set {p}.nic_gbps (Gb/s per link, e.g. 400)."))
        if self.sm_clock_mhz is not None:
            if self.max_sm_clock_mhz is None:
                issues.append(ConfigIssue(key=f"{p}.sm_clock_mhz", value=self.sm_clock_mhz,
                                          problem=f"scaling the peaks needs the clock they are quoted at "
                                                  f"({p}.max_sm_clock_mhz), which this preset does not state.",
                                          fix=f"set {p}.max_sm_clock_mhz too, or use {p}.power_limit_w."))
            elif self.sm_clock_mhz > self.max_sm_clock_mhz:
                issues.append(ConfigIssue(key=f"{p}.sm_clock_mhz", value=self.sm_clock_mhz,
                                          problem=f"is above the maximum clock {p}.max_sm_clock_mhz="
                                                  f"{self.max_sm_clock_mhz:g} the peaks are quoted at.",
                                          fix=f"set {p}.sm_clock_mhz to at most {self.max_sm_clock_mhz:g}, or null."))
        if self.power_limit_w is not None and self.tdp_w is None:
            issues.append(ConfigIssue(key=f"{p}.power_limit_w", value=self.power_limit_w,
                                      problem=f"scaling the peaks needs the board power they are quoted at "
                                              f"({p}.tdp_w), which this preset does not state.",
                                      fix=f"set {p}.tdp_w too, or {p}.power_limit_w=null."))
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
    cp_comm_type: CpCommType = layout_field(CpCommType.p2p, key="cpc", megatron="--cp-comm-type", optional=True)
    """With parallel.cp > 1: how attention exchanges keys and values over the CP group (``p2p`` ring, ``all_gather``,
    ``a2a``, ``a2a+p2p``; Transformer Engine's implementations)."""
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
    pipeline_model_parallel_layout: str | None = layout_field(
        None, key="pplayout", megatron="--pipeline-model-parallel-layout", optional=True)
    """Megatron-Core's per-stage layout (``pipeline_model_parallel_layout``): what each of the ``pp x vpp`` model
    chunks holds, stages separated by ``|`` in virtual-pipeline order, ``E`` the embedding, ``t`` a decoder layer,
    ``m`` an MTP layer, ``L`` the loss, ``x*N`` / ``(...)*N`` repeats, e.g. ``Et*3|t*1L`` (pp=2: three layers with
    the embedding, one with the loss) or DeepSeek-V3's ``Et|(tt|)*30mL`` (pp=8, vpp=4). ``None``: the split the
    other fields give. Excludes ``first_stage_layers``, ``last_stage_layers`` and the ``account_for_*`` fields;
    commas (cosmetic in Megatron's syntax) are not accepted, since the plan string separates its fields with them
    (:mod:`cfp_megatron.base.pipeline_layout`)."""
    recompute: Recompute = layout_field(Recompute.none, key="rc")
    """Activation recomputation: none, selective (the submodules of ``recompute_modules``; core attention by
    default), or full (every layer)."""
    recompute_modules: str | None = layout_field(None, key="rcmod", optional=True)
    """With ``recompute=selective``: the submodules Megatron-Core recomputes (``recompute_modules``), joined by ``+``
    (``moe_act+layernorm``): ``core_attn``, ``moe_act``, ``layernorm``, ``mla_up_proj``, ``mlp`` (dense layers),
    ``moe`` (MoE layers), ``shared_experts``. ``None``: ``core_attn``, Megatron-Core's default."""
    recompute_num_layers: int = layout_field(1, key="rcn")
    """With ``recompute=full``: layers per recomputed group (``uniform``), or recomputed layers per pipeline chunk
    (``block``)."""
    recompute_method: RecomputeMethod = layout_field(RecomputeMethod.uniform, key="rcm")
    """With ``recompute=full``: ``uniform`` recomputes every layer, ``block`` only the first
    ``recompute_num_layers`` layers of each pipeline chunk (the others keep their activations)."""
    distributed_optimizer: bool = layout_field(False, key="do", megatron="--use-distributed-optimizer")
    """Shard optimizer states over data-parallel ranks (ZeRO-1, Megatron's distributed optimizer)."""
    fsdp: FsdpStrategy = layout_field(FsdpStrategy.none, key="fsdp", megatron="", optional=True)
    """Megatron-FSDP and what it shards over the data-parallel ranks (``none``, ``optim``, ``optim_grads``,
    ``optim_grads_params``; Megatron-Core's ``use_megatron_fsdp`` and ``data_parallel_sharding_strategy``); with
    ``parallel.distributed_optimizer=true``, whose optimizer steps the shards. ``none``: Megatron-Core's DDP."""
    dp_shard_size: int | None = layout_field(None, key="dpsh", megatron="", optional=True)
    """Hybrid sharding (HSDP): data-parallel x context-parallel ranks each shard group spans, the groups replicating
    their shards and all-reducing the gradient shards across (Megatron-Core's
    ``num_distributed_optimizer_instances`` = DP x CP / ``dp_shard_size``); with the distributed optimizer or
    ``parallel.fsdp``. ``None``: one group over all of DP x CP."""
    overlap_grad_reduce: bool = layout_field(False, key="ogr", megatron="--overlap-grad-reduce")
    """Overlap data-parallel gradient reduction with the backward pass."""
    overlap_param_gather: bool = layout_field(False, key="opg", megatron="--overlap-param-gather")
    """With the distributed optimizer: overlap the parameter all-gather with the next forward."""
    fp8_param_gather: bool = layout_field(False, key="fp8pg", megatron="--fp8-param-gather", optional=True)
    """With ``train.precision=fp8`` and the distributed optimizer or ``parallel.fsdp``: keep the linear layers'
    weights in FP8 and all-gather them in FP8 (Megatron-Core's ``fp8_param`` and DDP's ``fp8_param_gather``; MXFP8
    also ``reuse_grad_buf_for_mxfp8_param_ag``, as NVIDIA's FP8 recipes set them): no 16-bit weights and no cached
    FP8 copies beside them; the fp32 master weights stay (docs/simulator.md, "Number formats")."""
    num_layers_at_start_in_bf16: int = layout_field(0, key="bf16s", megatron="", optional=True)
    """With ``train.precision=fp8`` (not the ``delayed`` recipe) or ``fp4``: the model's first decoder layers whose
    GEMMs stay in bf16 (Megatron-Core's ``first_last_layers_bf16`` with ``num_layers_at_start_in_bf16``, as NVIDIA's
    NVFP4 recipe keeps the stack's ends); 0: none. At most the layers of the first model chunk."""
    num_layers_at_end_in_bf16: int = layout_field(0, key="bf16e", megatron="", optional=True)
    """The same for the model's last decoder layers (Megatron-Core's ``num_layers_at_end_in_bf16``); at most the
    layers of the last model chunk."""
    tp_comm_overlap: bool = layout_field(False, key="tpco", megatron="--tp-comm-overlap", optional=True)
    """Overlap the TP/SP all-gathers and reduce-scatters with the GEMMs beside them (Transformer Engine's
    userbuffers, Megatron-Core's ``tp_comm_overlap``): needs sequence parallelism, a GPU and Transformer Engine; its
    buffers hold a few ``[tokens, hidden]`` activations."""
    moe_a2a_overlap: bool = layout_field(False, key="a2ao", megatron="--overlap-moe-expert-parallel-comm",
                                         optional=True)
    """Overlap the expert all-to-all of one micro-batch with the computation of another (Megatron-Core's
    ``overlap_moe_expert_parallel_comm``, the combined 1F1B schedule: one more micro-batch in flight). Needs EP > 1,
    the alltoall or flex dispatcher, an interleaved schedule when parallel.pp > 1, no full recomputation, and a GPU."""
    moe_flex_dispatcher_backend: FlexBackend = layout_field(FlexBackend.deepep, key="flexb",
                                                            megatron="--moe-flex-dispatcher-backend", optional=True)
    """With ``model.moe_token_dispatcher=flex``: the kernels that exchange the tokens (Megatron-Core's
    ``moe_flex_dispatcher_backend``): ``deepep`` (DeepEP; NVLink inside a host) or ``hybridep`` (HybridEP; NVLink over
    the whole NVLink domain, which pays on multi-node NVLink such as GB200 NVL72). Needs DeepEP, built from its
    ``hybrid-ep`` branch for ``hybridep``, and a GPU."""
    moe_shared_expert_overlap: bool = layout_field(False, key="seo", megatron="--moe-shared-expert-overlap",
                                                   optional=True)
    """Run the shared expert beside the token dispatch and combine (Megatron-Core's ``moe_shared_expert_overlap``;
    alltoall or flex dispatcher, not together with ``moe_a2a_overlap``)."""
    cuda_graph_impl: CudaGraphImpl = layout_field(CudaGraphImpl.none, key="cg", megatron="--cuda-graph-impl",
                                                  optional=True)
    """Replay captured CUDA graphs instead of launching each kernel (Megatron-Core's ``cuda_graph_impl``): ``none``,
    ``local`` or ``transformer_engine``; what is captured is ``cuda_graph_scope``. Needs a GPU (and Transformer Engine
    for ``transformer_engine``); the simulator's host term counts one launch per captured region and pass."""
    cuda_graph_scope: str | None = layout_field(None, key="cgs", megatron="", optional=True)
    """With ``cuda_graph_impl``: what is captured (Megatron-Core's ``cuda_graph_scope``), names joined by ``+``:
    ``attn``, ``mlp`` (dense layers), ``moe`` (drop-and-pad MoE layers), ``moe_router``, ``moe_preprocess`` (with
    ``moe_router``), ``mamba``, ``full_iteration`` (``local`` only: the whole forward-backward); ``None``: the whole
    layer."""
    cpu_offloading_num_layers: int = layout_field(0, key="offl", megatron="", optional=True)
    """Layers whose activations Megatron-Core offloads to host memory after their forward pass and reloads for their
    backward (``cpu_offloading`` with ``cpu_offloading_num_layers``, Transformer Engine's offload context; the first
    layers of the model); 0: none. Not with pipeline parallelism, recomputation or CUDA graphs (Megatron-Core's
    rules); the simulator's offload term prices the host link's transfers (docs/simulator.md, "Activation
    offloading")."""
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
                  "last_stage_layers", "primepar_layers", "dp_shard_size")
        _at_most(issues, p, self, MAX_WORLD_SIZE, "the largest clusters built (about 100k GPUs)", "tp", "pp", "cp",
                 "ep", "etp")
        _at_most(issues, p, self, MAX_LAYERS, "the layers of the largest published models (128)", "vpp",
                 "recompute_num_layers", "first_stage_layers", "last_stage_layers", "primepar_layers",
                 "num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16")
        for name in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
            _issue(issues, getattr(self, name) >= 0, f"{p}.{name}", getattr(self, name),
                   "counts decoder layers kept in bf16 and must not be negative.",
                   f"use 0 (none) or more: {p}.{name}=2.")
            _issue(issues, not getattr(self, name) or self.mlp is not MlpPartition.primepar, f"{p}.{name}",
                   getattr(self, name), "bf16 layers at the stack's ends are not combined with PrimePar's MLP "
                   "(parallel.mlp=primepar).", f"set {p}.{name}=0 or parallel.mlp=megatron.")
        dims = self.order.split("-")
        _issue(issues, sorted(dims) == sorted(["tp", "cp", "ep", "dp", "pp"]), f"{p}.order", self.order,
               "must name tp, cp, ep, dp and pp once each, separated by '-'.", "use the default tp-cp-ep-dp-pp.")
        issues += rule_issues([*tensor_rules.sequence_parallel_needs_tp(self.sp, self.tp),
                               *batch_rules.param_gather_overlap(self.overlap_param_gather,
                                                                 self.distributed_optimizer),
                               *batch_rules.fp8_param_gather_sharding(self.fp8_param_gather,
                                                                      self.distributed_optimizer),
                               *batch_rules.fsdp_settings(fsdp=self.fsdp.value,
                                                          distributed_optimizer=self.distributed_optimizer,
                                                          shard_size=self.dp_shard_size)])
        if self.recompute_modules is not None:
            try:
                modules = recompute_modules(self.recompute_modules)
            except ValueError as err:
                issues.append(ConfigIssue(key=f"{p}.recompute_modules", value=self.recompute_modules,
                                          problem=f"{err}: Megatron-Core recomputes "
                                                  f"{', '.join(m.value for m in RecomputeModule)}.",
                                          fix=f"name modules of that list joined by '{RECOMPUTE_SEPARATOR}', e.g. "
                                              "parallel.recompute_modules=moe_act+layernorm, or null."))
            else:
                object.__setattr__(self, "recompute_modules", RECOMPUTE_SEPARATOR.join(m.value for m in modules))
        issues += rule_issues(recompute_rules.settings(recompute=self.recompute.value, modules=self.recompute_modules,
                                                       method=self.recompute_method.value))
        if self.mlp is MlpPartition.primepar:
            issues += rule_issues(tensor_rules.primepar_grid(self.tp))
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
        counted = [name for name in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                   if getattr(self, name)]
        issues += self._cuda_graph_issues()
        issues += rule_issues(offload_rules.settings(layers=self.cpu_offloading_num_layers, pp=self.pp,
                                                     recompute=self.recompute.value,
                                                     cuda_graph_impl=self.cuda_graph_impl.value))
        issues += rule_issues(pipeline_rules.counted_in_split(counted=counted, first=self.first_stage_layers,
                                                              last=self.last_stage_layers, pp=self.pp))
        if self.pipeline_model_parallel_layout is not None:
            issues += self._layout_issues()
        issues += rule_issues([*pipeline_rules.interleave_needs_pp(self.vpp or 1, self.pp),
                               *tensor_rules.tp_overlap_needs_sp(self.tp_comm_overlap, self.sp),
                               *moe_rules.a2a_overlap_schedule(
                                   a2a_overlap=self.moe_a2a_overlap, shared_overlap=self.moe_shared_expert_overlap,
                                   full_recompute=self.recompute is Recompute.full, pp=self.pp, vpp=self.vpp or 1)])
        if issues:
            raise ConfigError(issues)

    def graph_scopes(self) -> tuple[str, ...]:
        """:attr:`cuda_graph_scope` as scope names (empty: the whole layer)."""
        return cuda_graph_scopes(self.cuda_graph_scope)

    def _cuda_graph_issues(self) -> list[ConfigIssue]:
        """What is wrong with ``cuda_graph_scope`` (its names, and the implementations they need)."""
        key, text = f"{self.PREFIX}.cuda_graph_scope", self.cuda_graph_scope
        if text is None:
            return []
        try:
            scopes = cuda_graph_scopes(text)
        except ValueError as err:
            return [ConfigIssue(key=key, value=text, problem=f"{err}: Megatron-Core captures "
                                f"{', '.join(CUDA_GRAPH_SCOPES)}.",
                                fix="name scopes of that list joined by '+', e.g. parallel.cuda_graph_scope="
                                    "attn+moe_router, or null (the whole layer).")]
        object.__setattr__(self, "cuda_graph_scope", RECOMPUTE_SEPARATOR.join(scopes) if scopes else None)
        if self.cuda_graph_impl is CudaGraphImpl.none:
            return [ConfigIssue(key=key, value=text, problem="it says what CUDA graphs capture, and "
                                "parallel.cuda_graph_impl=none captures none.",
                                fix="set parallel.cuda_graph_impl=transformer_engine (or local), or "
                                    "parallel.cuda_graph_scope=null.")]
        if "full_iteration" in scopes and (self.cuda_graph_impl is not CudaGraphImpl.local or len(scopes) > 1):
            return [ConfigIssue(key=key, value=text, problem="full_iteration captures the whole forward-backward "
                                "with Megatron-Core's own graphs, alone.",
                                fix="set parallel.cuda_graph_impl=local and parallel.cuda_graph_scope="
                                    "full_iteration, or name per-layer scopes.")]
        if "moe_preprocess" in scopes and "moe_router" not in scopes:
            return [ConfigIssue(key=key, value=text, problem="moe_preprocess is captured with the router "
                                "(Megatron-Core's CudaGraphScope: it requires moe_router).",
                                fix="add moe_router: parallel.cuda_graph_scope=moe_router+moe_preprocess.")]
        return []

    def _layout_issues(self) -> list[ConfigIssue]:
        """What is wrong with ``pipeline_model_parallel_layout`` before the model is known: the other split fields
        it excludes, commas, and what :func:`~cfp_megatron.base.pipeline_layout.layout_issues` finds."""
        key, layout = f"{self.PREFIX}.pipeline_model_parallel_layout", self.pipeline_model_parallel_layout
        issues: list[ConfigIssue] = []
        others = [name for name in ("first_stage_layers", "last_stage_layers",
                                    "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
                  if getattr(self, name) not in (None, False)]
        if others:
            issues.append(ConfigIssue(key=key, value=layout, problem=f"Megatron-Core takes a per-stage layout or "
                                      f"parallel.{others[0]}, not both (the layout says where every layer sits).",
                                      fix=f"set parallel.{others[0]} back to its default, or "
                                          f"parallel.pipeline_model_parallel_layout=null."))
        if not isinstance(layout, str) or not layout or set(layout) & set(", \t\n=:@"):
            issues.append(ConfigIssue(key=key, value=layout, problem="must be a non-empty layout string without "
                                      "commas, spaces or = : @ (the plan string separates its fields with them; "
                                      "Megatron-Core ignores commas).", fix="drop the commas and spaces, e.g. "
                                      "Et*3|(tt|)*29m|L."))
            return issues
        if self.pp == 1:
            issues.append(ConfigIssue(key=key, value=layout, problem="a layout places layers on pipeline stages; "
                                      "parallel.pp=1 has one.", fix="set parallel.pp to 2 or more, or "
                                      "parallel.pipeline_model_parallel_layout=null."))
            return issues
        return issues + layout_issues(layout, self.pp, self.virtual_stages, key)

    @property
    def virtual_stages(self) -> int:
        """Model chunks per pipeline rank (1 without interleaving)."""
        return self.vpp or 1

    @property
    def expert_tp(self) -> int:
        """Expert tensor-parallel size after defaults."""
        return self.etp or 1

    @property
    def recomputed_modules(self) -> frozenset[RecomputeModule]:
        """The submodules selective recomputation recomputes (empty without it)."""
        if self.recompute is not Recompute.selective:
            return frozenset()
        return _module_set(self.recompute_modules)

    @classmethod
    def _replaced(cls, base: ParallelSpec, *, checked: bool = True, **changes: Any) -> ParallelSpec:
        """``base`` with ``changes`` (known field names only), as :func:`dataclasses.replace` builds it but without its
        per-field copying: :meth:`__post_init__` checks it (``checked``), or only normalises ``recompute_modules``
        (``checked=False``). Unchecked is for the search alone (:meth:`Candidate.screened_job
        <cfp_megatron.search.space.Candidate.screened_job>`): its screens ran the same layout rules
        (:mod:`cfp_megatron.base.layout_rules`) on every value it sets and each group's representative went through
        the checks, and a search builds tens of thousands of layouts, whose checks were most of what each cost. Never
        unchecked for a layout a person or a file gives (``tests/test_search.py`` checks that the checked constructor
        accepts every layout the search builds unchecked, and equals it)."""
        spec = object.__new__(cls)
        values = spec.__dict__
        values.update(base.__dict__)
        values.update(changes)
        if checked:
            spec.__post_init__()
        elif values["recompute_modules"] is not None:
            values["recompute_modules"] = _canonical_modules(values["recompute_modules"])
        return spec


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
    """Number format (:class:`Precision`); ``auto`` is bf16 on GPU and fp32 on CPU; ``fp8`` and ``fp4`` keep bf16
    weights and run the linear layers' GEMMs in that format (``fp8_recipe``, ``fp4_recipe``). Under ``+cfp=auto``,
    ``cfp.constraints.precision`` lets the search choose from a set."""
    fp8_recipe: Fp8Recipe = Fp8Recipe.delayed
    """With ``precision=fp8``: how the FP8 tensors are scaled (Megatron-Core's ``fp8_recipe``, its default)."""
    fp4_recipe: Fp4Recipe = Fp4Recipe.nvfp4
    """With ``precision=fp4``: how the FP4 tensors are scaled (Megatron-Core's ``fp4_recipe``)."""
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
    trust_unverified_checkpoint: bool = False
    """Resume from a checkpoint folder without a manifest (saved by an older version): its files are unpickled
    unchecked, so only for folders you or your own job wrote (``docs/checkpoints.md``)."""
    metrics_file: str | None = None
    """JSON-lines metrics written by rank 0; ``None`` means ``metrics.jsonl`` in the Hydra run directory."""
    memory_step: int | None = None
    """Measure every rank's tensor memory during this step (1-based; ``MemTracker`` on CPU and GPU, plus
    ``torch.cuda.max_memory_allocated`` on GPU) and log it as a ``memory`` event; ``None`` measures nothing. Step 2 or
    later includes the optimizer states. The tracker's hooks slow that step: its logged time is no training figure."""
    collective_timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks (every process group, training and profiling) before the
    job ends naming the rank that stopped answering (torch's default, 10 minutes). Raise it for work that is
    legitimately slower between two collectives (a long save on a slow file system)."""

    def __post_init__(self) -> None:
        issues: list[ConfigIssue] = []
        p = self.PREFIX
        _positive(issues, p, self, "global_batch_size", "micro_batch_size", "seq_length", "log_interval",
                  "lr_decay_steps", "memory_step")
        for name in ("steps", "warmup_steps", "save_interval"):
            value = getattr(self, name)
            _issue(issues, value >= 0, f"{p}.{name}", value, "must not be negative.", f"set {p}.{name} to 0 or more.")
        _at_most(issues, p, self, MAX_GLOBAL_BATCH, "the largest published batches (8,192 sequences)",
                 "global_batch_size", "micro_batch_size")
        _at_most(issues, p, self, MAX_SEQUENCE, "today's longest contexts (about 10M tokens)", "seq_length")
        _at_most(issues, p, self, MAX_STEPS, "any training run (a 15T-token run is about a million steps)", "steps",
                 "warmup_steps", "lr_decay_steps", "log_interval", "save_interval")
        _issue(issues, 0 <= self.seed <= MAX_SEED, f"{p}.seed", self.seed,
               f"must be in [0, {MAX_SEED}] (Megatron's dataset seeds numpy with 32 bits).", "use e.g. 1234.")
        _issue(issues, 1 <= self.collective_timeout_s <= MAX_TIMEOUT_S, f"{p}.collective_timeout_s",
               self.collective_timeout_s, f"must be in [1, {MAX_TIMEOUT_S}] seconds (a week).",
               "use e.g. 600 (a stalled rank is then named after 10 minutes).")
        if self.memory_step is not None and self.memory_step >= 1:
            _issue(issues, self.memory_step <= self.steps, f"{p}.memory_step", self.memory_step,
                   f"is after the last step (train.steps={self.steps}), so nothing would be measured.",
                   f"set {p}.memory_step to at most {self.steps}, or null to measure nothing.")
        _finite(issues, p, self, "lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps", "clip_grad")
        _issue(issues, not math.isfinite(self.weight_decay) or self.weight_decay >= 0, f"{p}.weight_decay",
               self.weight_decay, "must not be negative.", "use 0 (off) or e.g. 0.01.")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            _issue(issues, not math.isfinite(value) or 0 <= value < 1, f"{p}.{name}", value, "must be in [0, 1).",
                   "use e.g. 0.9 (beta1) and 0.95 (beta2).")
        _issue(issues, not math.isfinite(self.adam_eps) or self.adam_eps > 0, f"{p}.adam_eps", self.adam_eps,
               "must be positive.", "use e.g. 1e-8.")
        _issue(issues, self.lr > 0, f"{p}.lr", self.lr, "must be positive.", "use e.g. 3e-4.")
        _issue(issues, 0 <= self.min_lr <= self.lr, f"{p}.min_lr", self.min_lr, f"must be in [0, train.lr={self.lr}].",
               "lower train.min_lr.")
        _issue(issues, self.clip_grad >= 0, f"{p}.clip_grad", self.clip_grad, "must not be negative.",
               "use 0 to disable clipping.")
        for name, reads, default in (("fp8_recipe", Precision.fp8, Fp8Recipe.delayed),
                                     ("fp4_recipe", Precision.fp4, Fp4Recipe.nvfp4)):
            value = getattr(self, name)
            # auto may still choose it (cfp.constraints.precision); another format never reads it
            _issue(issues, value is default or self.precision in (reads, Precision.auto), f"{p}.{name}", value.value,
                   f"is read only with train.precision={reads.value}, and train.precision={self.precision.value}: it "
                   "would be ignored.", f"add train.precision={reads.value}, or remove {p}.{name}.")
        if self.checkpoint_dir is not None:
            _issue(issues, bool(self.checkpoint_dir.strip()), f"{p}.checkpoint_dir", self.checkpoint_dir,
                   "is empty (a shell variable that is not set?): the run would save no checkpoint, or resume from "
                   "the current folder.", "name the folder, e.g. train.checkpoint_dir=ckpt/run1, or leave it out "
                   "(null) to save no checkpoint.")
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
    """Indexed dataset prefixes (``prefix.bin``/``prefix.idx``), blended in proportion to their training splits'
    tokens; or Megatron's weight-prefix pairs ``[w1, prefix1, w2, prefix2]``, blended in proportion to the weights."""
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
        if self.kind is DataKind.indexed:
            issues.extend(read_blend(self.path)[1])
        else:  # settings only indexed data reads: the run would train on synthetic sequences without a word
            defaults = DataSpec.__dataclass_fields__
            unread = [f"{p}.{name}" for name in ("path", "split", "tokenizer", "tokenizer_path", "cache_dir")
                      if (name != "split" or ok) and getattr(self, name) != (
                          defaults[name].default_factory() if name == "path" else defaults[name].default)]
            _issue(issues, not unread, f"{p}.kind", self.kind.value,
                   f"trains on synthetic sequences, but {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} "
                   "set, which only indexed data reads: the files would not be read.",
                   "add data=indexed to train on the files (or remove " + ", ".join(unread) + ").")
        if issues:
            raise ConfigError(issues)

    @property
    def blend(self) -> Blend:
        """The datasets of ``path`` and their weights (:func:`~cfp_megatron.base.data_blend.read_blend`)."""
        return read_blend(self.path)[0]


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

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for FP8 parameters (``parallel.fp8_param_gather``) in a format that is not
        FP8 (``auto`` may still choose FP8: the plan drops them where it does not), and for padding to capacity
        under the flex dispatcher's DeepEP backend."""
        padding = moe_rules.flex_padding(pad=self.model.moe_pad_expert_input_to_capacity,
                                         dispatcher=self.model.moe_token_dispatcher.value,
                                         backend=self.parallel.moe_flex_dispatcher_backend.value)
        if padding:
            raise ConfigError(rule_issues(padding))
        precision = self.train.precision
        ends = self.parallel.num_layers_at_start_in_bf16 or self.parallel.num_layers_at_end_in_bf16
        if ends and precision not in (Precision.fp8, Precision.fp4, Precision.auto):
            raise ConfigError(ConfigIssue(
                key="parallel.num_layers_at_start_in_bf16", value=self.parallel.num_layers_at_start_in_bf16,
                problem=f"keeps the stack's first/last layers in bf16 (with parallel.num_layers_at_end_in_bf16="
                        f"{self.parallel.num_layers_at_end_in_bf16}), and train.precision={precision.value} runs "
                        "every layer in it already (Megatron-Core's first_last_layers_bf16 acts under fp8 or fp4).",
                fix="add train.precision=fp8 (a recipe other than delayed) or train.precision=fp4, or set both "
                    "counts to 0."))
        if ends and precision is Precision.fp8 and self.train.fp8_recipe is Fp8Recipe.delayed:
            raise ConfigError(ConfigIssue(
                key="train.fp8_recipe", value=Fp8Recipe.delayed.value,
                problem="delayed scaling does not support bf16 layers at the stack's ends (Megatron-Core's "
                        "TransformerConfig refuses first_last_layers_bf16 with it: the per-layer FP8 context breaks "
                        "its amax reduction).",
                fix="use train.fp8_recipe=tensorwise|blockwise|mxfp8, or set parallel.num_layers_at_start_in_bf16=0 "
                    "and parallel.num_layers_at_end_in_bf16=0."))
        if self.parallel.fp8_param_gather and precision not in (Precision.fp8, Precision.auto):
            raise ConfigError(ConfigIssue(
                key="parallel.fp8_param_gather", value=True,
                problem=f"keeps the parameters in FP8, and train.precision={precision.value} trains in another "
                        "format (Megatron-Core's fp8_param needs fp8"
                        + ("; NVFP4 parameters gathered in FP4, DDP's fp4_param_gather, come only with Megatron-Core "
                           "releases after 0.16.1 and are not planned" if precision is Precision.fp4 else "") + ").",
                fix="add train.precision=fp8 (with its train.fp8_recipe), or set parallel.fp8_param_gather=false."))


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


def _blank_issue(key: str, value: str, default: Any) -> ConfigIssue:
    """The issue of a text setting given an empty or blank value: never a value of its own (a path, a name, a
    plan), and most often a shell variable that was not set (``train.checkpoint_dir=$CKPT``)."""
    unset = " (null: none)" if default is None else ""
    return ConfigIssue(key=key, value=value, problem="is empty (a shell variable that is not set?): it would "
                       "silently mean nothing, or the current folder.", fix=f"give it a value, or leave it out{unset}.")


def home_path(text: str) -> str:
    """``text`` with its leading ``~`` (``~`` or ``~user``) expanded as a shell would."""
    return os.path.expanduser(text)


def starts_with_home(value: object) -> bool:
    """Whether ``value`` is a text that starts with a home folder's ``~`` (``~``, ``~/...``, ``~user/...``)."""
    return isinstance(value, str) and value.startswith("~") and home_path(value) != value


def tilde_issue(key: str, value: str, *, listed: bool = False) -> ConfigIssue:
    """The issue of a path starting with ``~``: only a shell expands it (not after ``key=``, nor inside quotes), so
    it would name a folder called ``~`` in the current one (``listed``: an item of a list setting)."""
    full = f"[{home_path(value)}]" if listed else home_path(value)
    return ConfigIssue(key=key, value=value, problem="starts with '~', which only a shell expands (not after key=, "
                       "nor inside quotes): it would name a folder called '~' here.",
                       fix=f"write the full path: {key}={full}.")


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
        optional = [a for a in typing.get_args(ftype) if a is not type(None)]
        if value is not None and type(None) in typing.get_args(ftype) and len(optional) == 1:
            ftype = optional[0]  # an optional enum (cluster.network) converts like a plain one
        if isinstance(ftype, type) and issubclass(ftype, enum.Enum) and not isinstance(value, ftype):
            try:
                value = ftype(value)
            except ValueError:
                issues.append(ConfigIssue(key=f"{prefix}.{name}", value=value, problem="is not an allowed value.",
                                          fix=f"use one of {[m.value for m in ftype]}."))
                value = defaults[name].default  # keep checking the other fields
        elif isinstance(value, list):
            value = list(value)
            issues += [tilde_issue(f"{prefix}.{name}", item, listed=True) for item in value if starts_with_home(item)]
        elif ftype is str and isinstance(value, str) and not value.strip():
            issues.append(_blank_issue(f"{prefix}.{name}", value, defaults[name].default))
            value = defaults[name].default
        elif ftype is str and starts_with_home(value):
            issues.append(tilde_issue(f"{prefix}.{name}", value))
        kwargs[name] = value
    try:
        spec = cls(**kwargs)
    except ConfigError as err:
        raise ConfigError(issues + err.issues) from None
    if issues:
        raise ConfigError(issues)
    return spec


def plain_config(cfg: Any) -> Any:
    """A composed OmegaConf config as plain containers, every interpolation resolved (other objects as
    :func:`_to_plain` gives them); an interpolation that does not resolve or a missing value (``???``) is a
    :class:`ConfigError` naming the key."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if not isinstance(cfg, DictConfig):
        return _to_plain(cfg)
    try:
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "<config>"
        value: Any = OmegaConf.to_container(cfg, resolve=False)
        for part in key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        raise ConfigError(ConfigIssue(key=key, value=value,
                                      problem=f"cannot be resolved ({str(err).strip().splitlines()[0]}).",
                                      fix="give it a plain value, or an interpolation ${...} of a key that "
                                          "exists.")) from None


def job_from_config(cfg: Any) -> JobSpec:
    """Build frozen specs from a composed Hydra/OmegaConf config (or a plain dict).

    Every section is built even when an earlier one fails, and all problems are raised together.
    """
    raw = plain_config(cfg)
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
