"""What the cost terms' memory shares (:mod:`cfp_megatron.sim.terms`, each term's ``memory``): the pipeline
stage a rank holds (:class:`Stage`), the activation model (Korthikanti et al. 2022, term by term), the in-flight
counts and the measured activations (docs/simulator.md, "memory.py")."""

from __future__ import annotations

import dataclasses
import functools
import json
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base import cuda_env
from cfp_megatron.base.config import (
    AttentionKernel,
    AttentionKind,
    ClusterSpec,
    Fp8Recipe,
    FsdpStrategy,
    JobSpec,
    MlpPartition,
    ModelSpec,
    Normalization,
    PositionEmbedding,
    Precision,
    Recompute,
    RecomputeMethod,
    RecomputeModule,
)
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.pipeline_split import job_chunks
from cfp_megatron.cluster.measured import Measurements, SegmentMemory, partition_name
from cfp_megatron.sim.backward_memory import backward_flow_bytes, saved_input_bytes
from cfp_megatron.sim.format_costs import bf16_twin, low_format_cost
from cfp_megatron.sim.kernels import element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.measured_memory import measured_memory, peak_activation_bytes, pipeline_buffers
from cfp_megatron.sim.options import PipelineSchedule, SimOptions
from cfp_megatron.sim.primepar_cost import megatron_twin, primepar_stash_saving, primepar_weight_copies
from cfp_megatron.sim.schedule import zero_bubble_limit
from cfp_megatron.sim.sharding import FsdpBuffers, Sharding

BAND_FILE = Path(__file__).with_name("memory_band.json")
"""The allocator's band on the predicted memory of a GPU rank, measured (its ``source`` and ``measured``)."""


@dataclass(frozen=True, kw_only=True)
class MemoryBand:
    """What a GPU rank holds against the memory model's prediction, as multiples of it (:data:`BAND_FILE`)."""

    low: float
    """The least: every tensor the model counts is allocated (the allocator adds nothing)."""
    high: float
    """The most: the caching allocator's reserved over allocated bytes, as measured."""

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for a band that is not ``0 < low <= high``."""
        if not 0.0 < self.low <= self.high:
            raise ConfigError(ConfigIssue(key=str(BAND_FILE), value=(self.low, self.high),
                                          problem="the band must hold 0 < low <= high.",
                                          fix="restore the file (python bench/allocator_share.py measures high)."))


@functools.cache
def _gpu_band(setting: str) -> MemoryBand:
    with BAND_FILE.open() as fh:
        data = json.load(fh)
    return MemoryBand(low=float(data["low"]), high=float(data["high"][setting]))


def memory_band(cluster: ClusterSpec, *, expandable_segments: bool | None = None) -> MemoryBand:
    """The allocator's band for a rank of ``cluster``: the caching allocator's on a GPU, measured with and without
    ``expandable_segments`` (``None``: as this process's environment would start a rank,
    :func:`~cfp_megatron.base.cuda_env.expandable_segments`); none (1, 1) on a CPU cluster, whose ranks allocate
    with the C library (docs/simulator.md, "Allocator band")."""
    if cluster.on_cpu:
        return MemoryBand(low=1.0, high=1.0)
    expandable = cuda_env.expandable_segments() if expandable_segments is None else expandable_segments
    return _gpu_band("expandable_segments" if expandable else "default")


NORM_STATISTIC_BYTES = 4.0
"""Bytes per token a norm keeps per statistic for its backward pass: the fp32 reciprocal standard deviation (and
LayerNorm's mean), one value a token (Transformer Engine's fused norms; PyTorch's native_layer_norm and rms_norm)."""


def layer_extra_params(job: JobSpec, layout: Layout) -> float:
    """Parameters of one dense layer on one rank that the layer cost's count leaves out: the linear layers' biases
    (QKV and FC1 split over TP, the projection's and FC2's replicated) and, for RMSNorm, minus the norm biases the
    count assumes (it counts two LayerNorms, ``4 h``)."""
    model, tp = job.model, layout.dims.tp
    hidden = model.hidden_size
    extra = 0.0 if model.normalization is Normalization.LayerNorm else -2.0 * hidden
    if model.add_bias_linear and not model.is_moe:
        head_dim = model.kv_channels or hidden // model.num_attention_heads
        qkv_width = head_dim * (model.num_attention_heads + 2 * model.query_groups)
        fc1_width = model.ffn_size * (2 if model.activation.gated else 1)
        extra += (qkv_width + fc1_width) / tp + 2 * hidden
    return extra


def op_sac_gemms(job: JobSpec, layout: Layout, *, moe: bool) -> list[tuple[float, float]]:
    """The (output, input) widths of one layer's ``mm``/``linear`` calls per token on one rank, in the order
    torchtitan's blocks run them (attention's projections, then the dense MLP's or the shared expert's; the
    router's gate and the routed experts' grouped GEMMs are not counted: docs/validation.md, "torchtitan's
    activation checkpointing")."""
    model, tp = job.model, layout.dims.tp
    hidden, heads = model.hidden_size, model.num_attention_heads
    if model.attention is AttentionKind.mla:
        qk = model.qk_head_dim + model.qk_pos_emb_head_dim
        q = ([(model.q_lora_rank, hidden), (heads * qk / tp, model.q_lora_rank)] if model.q_lora_rank
             else [(heads * qk / tp, hidden)])
        gemms = q + [(model.kv_lora_rank + model.qk_pos_emb_head_dim, hidden),
                     (heads * (model.qk_head_dim + model.v_head_dim) / tp, model.kv_lora_rank),
                     (hidden, heads * model.v_head_dim / tp)]
    else:
        head_dim = model.kv_channels or hidden // heads
        kv = model.query_groups * head_dim / tp
        gemms = [(heads * head_dim / tp, hidden), (kv, hidden), (kv, hidden), (hidden, heads * head_dim / tp)]
    width = (model.moe_shared_expert_intermediate_size or 0) if moe else model.ffn_size
    if width:
        up = [(width / tp, hidden)] * (2 if model.activation.gated else 1)
        gemms += up + [(hidden, width / tp)]
    return gemms


TORCH_SWIGLU_SAVED_FFN = 4.0
"""Tensors of the FFN width (``[rows, ffn]``) autograd keeps through torchtitan's ``GroupedExperts``
(pytorch/torchtitan b5bcd76c, ``models/common/moe.py``) and its ``FeedForward`` (``models/common/feed_forward.py``,
the dense MLP and the shared experts; counted with ``torch.autograd.graph.saved_tensors_hooks``): ``silu``'s input
(``x @ w1``), the multiply's two (``silu``'s output and ``x @ w3``) and w2's input; beside them one copy of the
input, which both w1 and w3 keep. Megatron-Core's fused SwiGLU keeps fc1's output (two halves) and fc2's input:
three."""


TORCH_GPT_OSS_SAVED_FFN = 7.0
"""FFN-width (``[rows, ffn]``) tensors autograd keeps through torchtitan's ``GptOssGroupedExperts`` (pytorch/torchtitan
b5bcd76c, ``models/gpt_oss/moe.py``; counted with ``torch.autograd.graph.saved_tensors_hooks``): mlp1's biased
output (``[rows, 2 ffn]``, two; both clamps keep a strided half of it), the clamped gate and linear halves,
``sigmoid``'s output, the gate's product and mlp2's input; beside them the input once."""


def torch_swiglu_kept_bytes(elem: float, down_input_bytes: float, *, saved: float = TORCH_SWIGLU_SAVED_FFN) -> float:
    """Bytes a row keeps per FFN element through torchtitan's SwiGLU: ``saved`` tensors (:data:`TORCH_SWIGLU_SAVED_FFN`,
    GPT-OSS's :data:`TORCH_GPT_OSS_SAVED_FFN`), all in the compute precision (``elem``) but w2's input, at
    ``down_input_bytes`` (what its linear saves: :func:`~cfp_megatron.sim.backward_memory.saved_input_bytes`)."""
    return (saved - 1) * elem + down_input_bytes


def sp_gathered_kept(layout: Layout, options: SimOptions) -> bool:
    """Whether the column-wise linears keep their sequence-parallel input whole, as gathered: under TP with SP and
    DTensor's plan (:attr:`~cfp_megatron.sim.options.SimOptions.dtensor_tp`). torchtitan's ``FeedForward`` and
    attention redistribute the norm's ``Shard`` output to ``Replicate`` at their input (pytorch/torchtitan
    b5bcd76c, ``models/common/decoder_sharding.py``, ``set_dense_ffn_sharding`` and ``set_gqa_attention_sharding``:
    ``in_dst_shardings`` ``tp=spmd.R``), and w1 and w3 (wq, wk and wv) save that gathered tensor for their weight
    gradients; the gather's backward is a reduce-scatter of the gradient, so nothing is gathered again."""
    return options.dtensor_tp and layout.dims.tp > 1 and layout.dims.sp


def layer_activation_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool,
                           recompute: Recompute | None = None) -> tuple[float, float]:
    """(bytes kept for backward by one layer for one micro-batch on one rank, the same under full recomputation).

    ``recompute`` overrides the plan's recomputation for this layer (``block`` leaves some layers unrecomputed)."""
    model, dims = job.model, layout.dims
    tp, sp = dims.tp, dims.sp
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    hidden = model.hidden_size
    heads = model.num_attention_heads
    head_dim = model.kv_channels or hidden // heads
    q_width = heads * head_dim
    kv_width = model.query_groups * head_dim
    replicated_share = 1.0 / tp if sp else 1.0  # of the tensors replicated over TP unless SP
    hidden_mask = 1.0 if model.hidden_dropout > 0 else 0.0
    primepar = not moe and job.parallel.mlp is MlpPartition.primepar and tp > 1
    elem = float(element_bytes(job))  # an activation element in the compute precision (bf16: 2, fp32: 4)
    # Bytes per element of an input a linear layer keeps for its weight gradient (PrimePar's MLP and the MoE router
    # run in bf16).
    linear_input_bytes = saved_input_bytes(job, options)
    # A dense TE fc1 keeps its fused norm's output; the router reads bf16.
    mlp_input_bytes = elem if moe or primepar else linear_input_bytes
    recompute = job.parallel.recompute if recompute is None else recompute
    # Selective recomputation's submodules (parallel.recompute_modules) keep none of what they recompute.
    modules = job.parallel.recomputed_modules if recompute is Recompute.selective else frozenset()
    full_recompute_bytes = tokens * hidden * elem * replicated_share  # the layer's input only
    if recompute is Recompute.selective and options.torch_op_sac:
        return full_recompute_bytes + tokens * op_sac_saved_bytes(job, layout, options, moe=moe), full_recompute_bytes
    # Replicated over TP unless SP: two norm inputs, QKV input, MLP input (the norms' outputs), two dropout masks,
    # and each norm's fp32 reciprocal deviation per token (rstd; LayerNorm's mean too, as one more): Transformer
    # Engine's fused norms and PyTorch's native_layer_norm keep (input, mean, rstd), RMSNorm (input, rstd).
    qkv_input, mlp_input = ((0.0, 0.0) if RecomputeModule.layernorm in modules
                            else (linear_input_bytes * hidden, mlp_input_bytes * hidden))
    # DTensor's plan keeps QKV's input whole as gathered, and the dense MLP's (a MoE router reads its shard)
    gathered = sp_gathered_kept(layout, options)
    statistics = NORM_STATISTIC_BYTES * (2 if model.normalization is Normalization.LayerNorm else 1)
    per_token = ((elem * hidden + elem * hidden + 2 * hidden_mask * hidden + 2 * statistics) * replicated_share
                 + qkv_input * (1.0 if gathered else replicated_share)
                 + mlp_input * (1.0 if gathered and not moe else replicated_share))
    if job.cluster.on_cpu and model.normalization is Normalization.RMSNorm:
        # PyTorch's RMSNorm on CPU is composite (torch.nn.functional.rms_norm): its weight multiply also keeps the
        # normalised input, one more hidden tensor a norm (CUDA runs the fused kernel, which keeps input and rstd).
        per_token += 2 * elem * hidden * replicated_share
    # Split over TP: Q, K, V (MLA's up-projected ones are recomputed with mla_up_proj), attention output. An unfused
    # core (Megatron-Core's DotProductAttention) repeats K and V to every head before its GEMMs, which keep them.
    kv_kept = kv_width if options.flash_attention else max(kv_width, q_width)
    qkv = 0.0 if RecomputeModule.mla_up_proj in modules else elem * (q_width + 2 * kv_kept)
    if RecomputeModule.core_attn in modules and model.attention is AttentionKind.standard:
        # The checkpointed core keeps its inputs as they come (tensor_parallel.checkpoint's save_for_backward):
        # Q, K and V split as views of the QKV projection's output (attention.py, get_query_key_value_tensors:
        # torch.split), so V, never repeated before the core, keeps that whole output alive; RoPE makes Q and K
        # anew (out of place) beside it.
        rotated = q_width + kv_width if model.position_embedding is PositionEmbedding.rope else 0.0
        qkv = elem * (rotated + q_width + 2 * kv_width)
    per_token += (qkv + projection_input_bytes(job, options, modules, linear_input_bytes) * q_width) / tp
    if RecomputeModule.core_attn not in modules:  # the core keeps its scores (a fully recomputed layer makes them
        # again in its backward pass: its working set, docs/simulator.md "memory.py")
        per_token += heads * layout.seq_length * _kept_bytes_per_score(model, options, elem) / tp
    gated = model.activation.gated
    if moe:
        expert_ffn = model.moe_ffn_hidden_size or model.ffn_size
        # Token copies per local token on the busiest expert rank.
        routed = model.moe_router_topk * dims.etp / tp * model.expert_load(options.moe_routing_imbalance)
        whole = RecomputeModule.moe in modules  # the block keeps only its input (the norm's output, above)
        act_output = 0.0 if RecomputeModule.moe_act in modules else linear_input_bytes * expert_ffn / dims.etp
        if model.activation_clamp is not None and RecomputeModule.moe_act not in modules:
            # The clamp before the fused quick GEGLU keeps fc1's output for its comparisons, beside the clamped
            # copy the activation keeps (fused_bias_geglu.weighted_bias_quick_geglu_impl); moe_act's checkpoint
            # keeps fc1's output alone.
            act_output += elem * expert_ffn * 2 / dims.etp
        if options.torch_swiglu_experts(model):  # torchtitan's GroupedExperts (moe_act is Megatron-Core's)
            ffn_kept = torch_swiglu_kept_bytes(elem, linear_input_bytes) * expert_ffn / dims.etp
        elif options.torch_gpt_oss_experts(model):  # torchtitan's GptOssGroupedExperts
            ffn_kept = (torch_swiglu_kept_bytes(elem, linear_input_bytes, saved=TORCH_GPT_OSS_SAVED_FFN)
                        * expert_ffn / dims.etp)
        else:  # fc1's output and the activation's
            ffn_kept = elem * expert_ffn * (2 if gated else 1) / dims.etp + act_output
        if not whole:
            per_token += routed * (linear_input_bytes * hidden + ffn_kept)
        shared_ffn = model.moe_shared_expert_intermediate_size or 0
        if shared_ffn and not (whole or RecomputeModule.shared_experts in modules):
            if options.torch_swiglu_mlp(model):  # torchtitan's FeedForward
                per_token += torch_swiglu_kept_bytes(elem, linear_input_bytes) * shared_ffn / tp
            else:
                per_token += (elem * shared_ffn * (2 if gated else 1) + linear_input_bytes * shared_ffn) / tp
            if gathered:  # its input gathered whole beside the router's shard
                per_token += linear_input_bytes * hidden
    elif RecomputeModule.mlp not in modules:  # a recomputed dense MLP keeps only its input (the norm's output)
        fc2_input_bytes = elem if primepar else linear_input_bytes
        if options.torch_swiglu_mlp(model):  # torchtitan's FeedForward
            per_token += torch_swiglu_kept_bytes(elem, fc2_input_bytes) * model.ffn_size / tp
        else:
            per_token += (elem * model.ffn_size * (2 if gated else 1) + fc2_input_bytes * model.ffn_size) / tp
        if gated and job.cluster.on_cpu and not options.torch_swiglu_mlp(model):
            # Unfused SwiGLU (the fusion is CUDA-only): it also keeps SiLU's output and the linear half it multiplies.
            per_token += 2 * elem * model.ffn_size / tp
        if primepar:
            # fc1's input kept as one block of the grid, not replicated; the rotated weight blocks kept from the
            # forward to the backward pass (cfp_megatron.sim.primepar_cost).
            per_token -= primepar_stash_saving(tp=tp, tokens=1.0, hidden=hidden, elem=elem, sp=sp)
            per_token += primepar_weight_copies(tp=tp, hidden=hidden, ffn=model.ffn_size, gated=gated,
                                                elem=elem) / tokens
    kept = tokens * per_token
    if options.unfused_rope(model) and model.attention is AttentionKind.standard:
        # Megatron-Core's unfused RoPE (SimOptions.rope_fusion off, as the runtime builds it) keeps the cos and sin it
        # multiplies Q and K by: four [s / cp, head_dim] tensors a layer, broadcast over the micro-batch
        # (models/common/embeddings/rope_utils.py, _apply_rotary_pos_emb_bshd).
        kept += 4 * layout.seq_length / dims.cp * head_dim * elem
    if options.attention is AttentionKernel.torch_softmax and RecomputeModule.core_attn not in modules:
        # PyTorch's masked_fill keeps the boolean causal mask it applied: one byte an [s / cp, s] position a layer.
        kept += layout.seq_length / dims.cp * layout.seq_length
    return kept, full_recompute_bytes


def op_sac_saved_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool) -> float:
    """Bytes per token one layer keeps beyond its input under torchtitan's per-op selective checkpointing
    (:attr:`~cfp_megatron.sim.options.SimOptions.torch_op_sac`): the outputs of the first, third, ... ``mm`` of the
    block (:func:`op_sac_gemms`), SDPA's output and its fp32 log-sum-exp per head, and in a MoE layer the top-k
    scores and indices and, with EP, the dispatch's and the combine's all-to-all outputs."""
    model, dims = job.model, layout.dims
    elem = float(element_bytes(job))
    heads = model.num_attention_heads
    v_width = model.v_head_dim if model.attention is AttentionKind.mla else model.kv_channels or (
        model.hidden_size // heads)
    kept = elem * sum(n for n, _ in op_sac_gemms(job, layout, moe=moe)[0::2])
    kept += (elem * heads * v_width + 4.0 * heads) / dims.tp  # the fp32 log-sum-exp a head
    if moe:
        topk = model.moe_router_topk
        kept += topk * (4.0 + 8.0)  # fp32 scores, int64 indices
        if dims.ep > 1:
            routed = topk * model.expert_load(options.moe_routing_imbalance)
            kept += 2.0 * routed * elem * model.hidden_size
    return kept


def projection_input_bytes(job: JobSpec, options: SimOptions, modules: frozenset[RecomputeModule],
                           linear_input_bytes: float) -> float:
    """Bytes per element of the attention core's output a layer keeps for the output projection's backward pass
    (``linear_input_bytes``: what a linear layer keeps of its input). Under FP8 with a recipe other than delayed
    scaling, and under FP4, Megatron-Core makes ``linear_proj`` save its original input (``attention.py`` and
    ``multi_latent_attention.py``, ``set_save_original_input``: "the output of the fused core_attn is saved by
    itself"), the tensor a fused core keeps in the compute precision; under delayed scaling the projection keeps its
    quantised copy beside the fused core's own output (none where the core is recomputed or unfused: Megatron's
    unfused core needs only its probabilities and V). In 16 or 32 bits the two are one tensor."""
    if low_format_cost(job) is None or options.torchao_low_precision:  # the core's output is the saved input
        return linear_input_bytes
    elem = float(element_bytes(job))
    delayed = job.train.precision is Precision.fp8 and job.train.fp8_recipe is Fp8Recipe.delayed
    if not delayed:
        return elem
    core_keeps_output = options.flash_attention and RecomputeModule.core_attn not in modules
    return linear_input_bytes + (elem if core_keeps_output else 0.0)


def _kept_bytes_per_score(model: ModelSpec, options: SimOptions, elem: float) -> float:
    """Bytes an attention core keeps for its backward pass per ``s x s`` score (``elem``-byte activations): none
    for a fused (flash) kernel; the probabilities the context GEMM reads, or with dropout the softmax output, the
    dropout's mask and its output; PyTorch's fp32 softmax (no fused kernel) also keeps its fp32 output (in fp32, the
    probabilities themselves)."""
    if options.flash_attention:
        return 0.0
    mask = 1.0 if model.attention_dropout > 0 else 0.0
    if options.attention is AttentionKernel.torch_softmax:
        return 4 + (elem if elem != 4 else 0.0) + mask
    return elem + mask * (1 + elem)


def unfused_attention_working_bytes(job: JobSpec, layout: Layout, options: SimOptions) -> float:
    """Bytes an unfused attention core holds for a moment in one layer's backward pass on one rank, beyond what the
    model keeps: the scores' gradient through the softmax (in and out of the fused softmax kernel in the compute
    precision; PyTorch's fp32 softmax takes and returns fp32 gradients, 4 + 4 bytes a score), plus the scores
    themselves where selective recomputation recomputes the core. Zero for a fused (flash) kernel."""
    if options.flash_attention:
        return 0.0
    model, dims = job.model, layout.dims
    elem = float(element_bytes(job))
    per_score = 8.0 if options.attention is AttentionKernel.torch_softmax else 2 * elem
    if RecomputeModule.core_attn in job.parallel.recomputed_modules:
        per_score += _kept_bytes_per_score(model, options, elem)
    scores = layout.micro_batch * model.num_attention_heads * (layout.seq_length / dims.cp) * layout.seq_length
    return scores * per_score / dims.tp


def global_buffer_bytes(job: JobSpec, layout: Layout, options: SimOptions) -> float:
    """Bytes of Megatron-Core's global memory buffer on one rank (``parallel_state.get_global_memory_buffer``,
    ``utils.GlobalMemoryBuffer.get_tensor``): one tensor per name and dtype, grown to the largest request and held
    for the run, which every request of that name reuses. Its ``"mpu"`` tensor in the compute precision serves
    sequence parallelism's all-gathered linear input, ``[tokens, hidden]`` (``tensor_parallel/layers.py``,
    ``LinearWithGradAccumulationAndAsyncCommunication``, forward and again in the backward pass for the weight
    gradient: every column-parallel linear of the local spec, and the output layer, Megatron-Core's own
    ``ColumnParallelLinear`` under Transformer Engine's spec too) and the unfused core's ``baddbmm`` input,
    ``[b x heads / tp, s / cp, s]`` (``transformer/dot_product_attention.py``): the larger of the two."""
    dims = layout.dims
    if not options.global_memory_buffer:
        return 0.0
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    gather = tokens * job.model.hidden_size if dims.tp > 1 and dims.sp else 0.0
    scores = 0.0 if options.flash_attention else (
        layout.micro_batch * job.model.num_attention_heads / dims.tp * layout.seq_length / dims.cp
        * layout.seq_length)
    return max(gather, scores) * float(element_bytes(job))


def sp_gather_working_bytes(job: JobSpec, layout: Layout, options: SimOptions) -> float:
    """Bytes a layer's backward pass holds for a moment under sequence parallelism beyond what it keeps, on one rank:
    with Transformer Engine's linears (a flash core: the runtime builds their spec where it imports), each
    column-parallel GEMM gathers its saved input shard again into a new ``[tokens, hidden]`` tensor, in the format
    its weight-gradient GEMM reads, beside the input-gradient GEMM's output (``module/layernorm_linear.py``,
    ``_LayerNormLinear.backward``: ``ctx.ln_out_needs_gather``, gathered with the input's quantizer beside the
    dgrad GEMM), freed after the weight gradient; none under TP
    communication overlap, whose userbuffers hold it, nor with the local spec, whose gathers reuse the global buffer
    (:func:`global_buffer_bytes`), nor with DTensor's, which keep the gathered input (:func:`sp_gathered_kept`)."""
    dims = layout.dims
    if (dims.tp <= 1 or not dims.sp or not options.flash_attention or job.parallel.tp_comm_overlap
            or sp_gathered_kept(layout, options)):
        return 0.0
    return layout.micro_batch * layout.seq_length / dims.cp * job.model.hidden_size * saved_input_bytes(job, options)


LOSS_SOFTMAX_BYTES = 4.0
"""Bytes per logit Megatron-Core's vocab-parallel cross entropy keeps from its forward to its backward pass: its fp32
softmax, made in place in an fp32 copy of the logits (``tensor_parallel/cross_entropy.py``: ``calculate_logits_max``
casts with ``.float()``, ``calculate_predicted_logits`` and ``calculate_cross_entropy_loss`` work in place,
``save_for_backward(exp_logits, ...)``); its backward turns that buffer into the gradient in place."""


EAGER_TORCH_CE_BYTES = 12.0
"""Bytes per logit at the peak of PyTorch's ``cross_entropy`` run eagerly on an fp32 copy of the logits
(torchtitan's ``components/loss.py``, ``cross_entropy(pred.flatten(0, 1).float(), ...)``, without ``compile``): in
the backward the saved fp32 log-softmax (4), ``nll_loss``'s fp32 gradient (4) and ``log_softmax``'s fp32 gradient
input (4) at once; the forward's bf16 logits, fp32 copy and log-softmax (2 + 4 + 4) stay below it. Measured on
CPU: 12.2 (docs/simulator.md, the memory section)."""


EAGER_LOSS_PARALLEL_BYTES = 16.0
"""Bytes per logit (of the rank's vocabulary shard) at the peak of PyTorch's ``loss_parallel`` cross entropy run
eagerly on an fp32 copy of the logits (torchtitan under TP without ``compile`` of the loss; ``torch/distributed/
tensor/parallel/loss.py``): in the backward (``_nll_loss_and_log_softmax_backward``, which differentiates
``nll_loss`` and ``log_softmax`` at once) the saved fp32 log-softmax (4), the zeroed gradient ``grad_input`` (4),
``grad_input + exp(x)`` (4) and its product with the loss's gradient (4) at once (``exp(x)`` is freed before the
product is made); its forward holds the bf16 logits, the fp32 copy, the shifted logits and their exponential
(2 + 4 + 4 + 4) at most, and torchtitan frees the bf16 logits before the backward pass (``del pred``). The
measurement that checks it: docs/simulator.md, the memory section."""


def loss_bytes_per_logit(elem_bytes: float, mtp_layers: int = 0, *, te_cross_entropy: bool = False,
                         eager_torch: bool = False, loss_parallel: bool = False) -> float:
    """Bytes per logit (``tokens x vocab / tp`` on the loss rank) at the loss's peak: the fp32 softmax of the head
    and of each MTP layer (:data:`LOSS_SOFTMAX_BYTES`), kept until the backward pass, and one logit tensor in the
    compute precision beside one of them (the head's output while the forward casts it, its gradient while the
    backward casts the fp32 gradient back); in fp32 the cast is the tensor itself, so nothing beside it. Under
    ``te_cross_entropy`` (Transformer Engine's fused kernel, ``pytorch/triton/cross_entropy.py``: an online softmax
    over the logits as they are, the gradient written over them in place) each head keeps its logits alone; under
    ``eager_torch`` PyTorch's eager cross entropy, :data:`EAGER_TORCH_CE_BYTES` a head, or with ``loss_parallel``
    (the vocabulary split over TP) its ``loss_parallel``'s, :data:`EAGER_LOSS_PARALLEL_BYTES` a head."""
    if eager_torch:
        return (EAGER_LOSS_PARALLEL_BYTES if loss_parallel else EAGER_TORCH_CE_BYTES) * (1 + mtp_layers)
    if te_cross_entropy:
        return elem_bytes * (1 + mtp_layers)
    return LOSS_SOFTMAX_BYTES * (1 + mtp_layers) + (elem_bytes if elem_bytes != LOSS_SOFTMAX_BYTES else 0.0)


def loss_logit_bytes(stage: Stage) -> float:
    """Bytes of the loss's logits on one rank of ``stage`` at the loss's peak (zero off the loss rank): ``tokens x
    vocab / tp`` logits of :func:`loss_bytes_per_logit` each, the head's and each MTP layer's. The backward pass
    frees them before any layer's backward runs (docs/simulator.md, "memory.py")."""
    if not stage.last:
        return 0.0
    model, dims = stage.job.model, stage.layout.dims
    return (stage.common.tokens * model.padded_vocab_size / dims.tp
            * loss_bytes_per_logit(stage.common.elem_bytes, model.mtp_num_layers,
                                   te_cross_entropy=stage.options.te_cross_entropy,
                                   eager_torch=stage.options.eager_torch_loss, loss_parallel=dims.tp > 1))


def in_flight(rank: int, pp: int, vpp: int, microbatches: int,
              schedule: PipelineSchedule = PipelineSchedule.megatron) -> int:
    """Model-chunk micro-batches whose activations pipeline rank ``rank`` (of ``pp``, with ``vpp`` chunks each)
    holds at its peak over a step of ``microbatches`` micro-batches under ``schedule`` (GPipe: all of them; a
    zero-bubble one: its memory limit, :func:`~cfp_megatron.sim.schedule.zero_bubble_limit`)."""
    total = microbatches * vpp
    if schedule is PipelineSchedule.gpipe:
        return total
    if schedule is not PipelineSchedule.megatron:
        return zero_bubble_limit(pp, microbatches, schedule)
    if vpp == 1:
        return min(pp - rank, microbatches)
    warmup = total if microbatches == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    return min(warmup + 1, total)


def recomputed_layers(job: JobSpec, *, rank: int) -> tuple[int, int]:
    """(dense, MoE) layers of pipeline rank ``rank``, over its chunks, that full recomputation covers: all of them
    (``uniform``), or the first ``recompute_num_layers`` of each chunk (``block``; leading dense layers come first).
    Zero without full recomputation."""
    parallel = job.parallel
    if parallel.recompute is not Recompute.full:
        return 0, 0
    per_chunk = [chunk.recomputed(parallel) for chunk in job_chunks(job)[rank]]
    return sum(dense for dense, _ in per_chunk), sum(moe for _, moe in per_chunk)


def offload_resident_bytes(options: SimOptions, dense_act: float, moe_act: float, off_moe: int) -> float:
    """Bytes of offloaded activations on the GPU beside the last layer's passes (not beside the loss's logits, and
    none beside the rest at the peak): Transformer Engine's handler before 2.10 (:attr:`~cfp_megatron.sim.options.
    SimOptions.offload_v1`) frees the last offloaded layer's copy at the last layer's commit and reloads it at the
    first backward commit, one layer (``moe_act`` where the offloaded layers reach a MoE one, ``off_moe`` > 0, else
    ``dense_act``); TE 2.10's ``OffloadSynchronizer`` finishes each offload and starts each reload so that the rank
    holds the other layers' activations alone (docs/simulator.md, "Activation offloading")."""
    if not options.offload_v1:
        return 0.0
    return moe_act if off_moe else dense_act


def offloaded_layers(job: JobSpec, layers: int) -> tuple[int, int]:
    """(dense, MoE) layers of a pipeline rank holding ``layers`` layers whose activations Megatron-Core offloads to
    host memory: the model's first ``parallel.cpu_offloading_num_layers`` (the leading dense layers of a MoE model
    first). Offloading runs only without pipeline parallelism, so the rank holds the whole model."""
    count = min(job.parallel.cpu_offloading_num_layers, layers)
    if not count:
        return 0, 0
    model = job.model
    dense = min(count, model.moe_first_dense_layers) if model.is_moe else count
    return dense, count - dense


def primepar_split(job: JobSpec, *, rank: int) -> tuple[int, JobSpec] | None:
    """(dense layers of pipeline rank ``rank`` that run PrimePar's MLP, the plan with Megatron's partition that the
    others run) where ``parallel.primepar_layers`` leaves some of its dense layers to Megatron's split; ``None``
    where every dense layer runs the plan's partition."""
    parallel = job.parallel
    if parallel.primepar_layers is None:
        return None
    chunks = job_chunks(job)[rank]
    primepar_layers = sum(chunk.primepar(parallel) for chunk in chunks)
    return (primepar_layers, megatron_twin(job)) if primepar_layers < sum(chunk.dense for chunk in chunks) else None


def recomputed_units(job: JobSpec, chunk: list[SegmentMemory], hidden_bytes: float) -> list[SegmentMemory]:
    """A pipeline chunk's measured layers (in model order) as full recomputation runs them: Megatron checkpoints
    groups of ``recompute_num_layers`` layers (``uniform``) or each of the first ``recompute_num_layers`` layers
    (``block``). A checkpointed unit keeps only its output (``hidden_bytes``, the next unit's saved input) between
    its passes, and its backward pass adds the recomputed layers' activations and the largest transient
    (docs/simulator.md, "Recomputed units"). Other layers, and every layer without full recomputation, are
    returned unchanged."""
    parallel = job.parallel
    if parallel.recompute is not Recompute.full or not chunk:
        return chunk

    def unit(layers: list[SegmentMemory]) -> SegmentMemory:
        kept = sum(layer.activation_bytes for layer in layers)
        return SegmentMemory(activation_bytes=hidden_bytes,
                             transient_bytes=kept + max(layer.transient_bytes for layer in layers),
                             workspace_bytes=max(layer.workspace_bytes for layer in layers))

    unit_layers = max(parallel.recompute_num_layers, 1)
    if parallel.recompute_method is RecomputeMethod.block:
        return [unit([layer]) for layer in chunk[:unit_layers]] + chunk[unit_layers:]
    return [unit(chunk[start:start + unit_layers]) for start in range(0, len(chunk), unit_layers)]


def measured_activations(job: JobSpec, layout: Layout, measurements: Measurements | None, *, rank: int,
                         layers: int, moe_layers: int, first: bool, last: bool) -> float | None:
    """Activation bytes at the peak of pipeline rank ``rank`` from profiled segment memory
    (:mod:`cfp_megatron.sim.measured_memory`), with the pipeline's point-to-point tensors; ``None`` when the
    profile lacks a segment the stage runs under the plan's partition, or the plan splits the sequence over CP
    (profiling does not measure it). Which profiled partitions stand for recomputation: docs/simulator.md,
    "Measured activations"."""
    dims = layout.dims
    if measurements is None or dims.cp > 1:
        return None
    selective = Recompute.selective if job.parallel.recompute is Recompute.selective else Recompute.none
    partition = partition_name(dims.tp, sp=dims.sp)  # the embedding and the head
    modules = job.parallel.recompute_modules
    layer_partition = partition_name(dims.tp, sp=dims.sp, mlp=job.parallel.mlp, recompute=selective,
                                     recompute_modules=modules)
    megatron_partition = partition_name(dims.tp, sp=dims.sp, recompute=selective,
                                        recompute_modules=modules)  # layers past primepar_layers
    split = primepar_split(job, rank=rank)
    kinds = ["dense", "moe"] if moe_layers else ["dense"]
    if moe_layers == layers:
        kinds = ["moe"]
    found: dict[str, SegmentMemory] = {}
    for kind in [*kinds, *(["megatron"] if split else []), *(["embedding"] if first else []),
                 *(["head"] if last else [])]:
        where = {"embedding": partition, "head": partition, "megatron": megatron_partition}.get(kind, layer_partition)
        hit = measured_memory(measurements, "dense" if kind == "megatron" else kind, where, layout.micro_batch)
        if hit is None:
            return None
        found[kind] = hit
    # The rank's largest chunk stands for each of its chunks (they differ where the embedding or the loss is counted
    # in the pipeline split, or a first/last stage count leaves a remainder: the largest bounds the peak).
    largest = max(job_chunks(job)[rank], key=lambda chunk: (chunk.count, chunk.moe))
    chunk_layers = largest.count if layers else 0
    chunk_moe = min(largest.moe, chunk_layers)
    # The dense layers of each chunk run the plan's partition, or its first primepar_layers do (the rest Megatron's).
    chunk_own = split[0] // dims.vpp if split else chunk_layers - chunk_moe
    rest = chunk_layers - chunk_moe - chunk_own
    chunk = ([found["dense"]] * chunk_own if chunk_own else []) + ([found["megatron"]] * rest if rest else []) + (
        [found["moe"]] * chunk_moe if chunk_moe else [])
    elem_bytes = element_bytes(job)
    hidden_bytes = (layout.micro_batch * layout.seq_length * job.model.hidden_size * elem_bytes
                    / (dims.tp if dims.sp else 1))
    chunk = recomputed_units(job, chunk, hidden_bytes)
    if first and last and job.model.tie_embeddings and chunk:
        # One weight serves the embedding and the head: the head's weight gradient stays alive through every decoder
        # layer's backward pass (docs/simulator.md, "Measured activations").
        tied_bytes = job.model.padded_vocab_size * job.model.hidden_size / dims.tp * elem_bytes
        chunk = [dataclasses.replace(layer, transient_bytes=layer.transient_bytes + tied_bytes) for layer in chunk]
    in_chunks = in_flight(rank, dims.pp, dims.vpp, dims.num_microbatches)
    ends = ([found["embedding"]] if first else []) + ([found["head"]] if last else [])
    if dims.vpp == 1:
        segments = ([found["embedding"]] if first else []) + chunk + ([found["head"]] if last else [])
        activations = peak_activation_bytes(segments, in_chunks)
    else:  # the embedding and the head sit in one chunk each: held by that chunk's share of the micro-batches
        activations = peak_activation_bytes(chunk, in_chunks)
        activations += -(-in_chunks // dims.vpp) * sum(segment.activation_bytes for segment in ends)
    return activations + pipeline_buffers(hidden_bytes, pp=dims.pp, first=first, last=last, in_flight=in_chunks,
                                          microbatches=dims.num_microbatches)


@dataclass(frozen=True, kw_only=True, slots=True)  # slots: built per rank of every plan searched
class Stage:
    """One rank of a pipeline stage as the cost terms' memory sees it (:meth:`CostTerm.memory
    <cfp_megatron.sim.terms.base.CostTerm.memory>`)."""

    job: JobSpec
    """The plan."""
    layout: Layout
    """Its layout."""
    options: SimOptions
    """The simulator's options."""
    rank: int
    """The pipeline rank."""
    layer_params: float
    """Decoder-layer parameters on the rank (MTP layers' included)."""
    expert_params: float
    """The routed experts' share of them."""
    layers: int
    """Layers on the rank (its MTP layers counted among them)."""
    moe_layers: int
    """MoE layers among them."""
    first: bool
    """Whether the rank holds the embedding."""
    last: bool
    """Whether the rank holds the head (its logits once more per MTP layer of the model)."""
    mtp: int
    """The rank's MTP layers, which embed the shifted tokens with a table of their own where the rank has none
    (docs/simulator.md, "Multi-token prediction")."""
    measured: float | None
    """Activation bytes (the pipeline's buffers included) from the stage's profiled segments
    (:func:`measured_activations`), which stand for the analytical activations and buffers; ``None``: analytical."""
    common: LayoutMemory
    """What every rank of the job and layout shares (:func:`layout_memory`)."""
    bf16_layers: tuple[int, int] = (0, 0)
    """(dense, MoE) decoder layers among :attr:`layers` whose GEMMs stay in bf16 under the job's FP8/FP4 format
    (``parallel.num_layers_at_start_in_bf16`` / ``_end_in_bf16``): they keep bf16 activations and bf16 weights
    alone (:attr:`LayoutMemory.bf16_ends`)."""
    bf16_params: float = 0.0
    """Their parameters on the rank."""

    @property
    def tokens(self) -> float:
        """Tokens of one micro-batch on the rank (its CP share)."""
        return self.common.tokens


def stage(job: JobSpec, layout: Layout, options: SimOptions, *, rank: int, layer_params: float,
          expert_params: float, layers: int, moe_layers: int, first: bool, last: bool,
          measurements: Measurements | None = None, mtp: int = 0, common: LayoutMemory | None = None,
          bf16_layers: tuple[int, int] = (0, 0), bf16_params: float = 0.0) -> Stage:
    """The :class:`Stage` of pipeline rank ``rank``; with ``measurements`` that hold its segments' memory under the
    plan's partition, its activations measured (profiling measures neither FSDP nor an MTP layer). ``common``:
    :func:`layout_memory` of the job, built once by a caller that builds several of its stages (``None``: built
    here); ``bf16_layers`` / ``bf16_params``: the rank's decoder layers kept in bf16 at the stack's ends
    (:attr:`Stage.bf16_layers`)."""
    measured = None
    if measurements is not None and job.parallel.fsdp is FsdpStrategy.none and not mtp:
        measured = measured_activations(job, layout, measurements, rank=rank, layers=layers, moe_layers=moe_layers,
                                        first=first, last=last)
    return Stage(job=job, layout=layout, options=options, rank=rank, layer_params=layer_params,
                 expert_params=expert_params, layers=layers, moe_layers=moe_layers, first=first, last=last, mtp=mtp,
                 measured=measured, common=layout_memory(job, layout, options) if common is None else common,
                 bf16_layers=bf16_layers, bf16_params=bf16_params)


@dataclass(frozen=True, kw_only=True, slots=True)
class LayoutMemory:
    """What the memory of every rank of one job and layout shares: priced once per plan, not per rank."""

    elem_bytes: float
    """Bytes of an element in the plan's compute precision (:func:`~cfp_megatron.sim.kernels.element_bytes`)."""
    sharding: Sharding
    """How the plan's data parallelism keeps its states (:meth:`Sharding.megatron
    <cfp_megatron.sim.sharding.Sharding.megatron>`)."""
    dense: tuple[float, float]
    """:func:`layer_activation_bytes` of a dense layer (kept, kept under full recomputation)."""
    moe: tuple[float, float]
    """The same of a MoE layer (zero for a dense model)."""
    megatron: tuple[float, float]
    """The same of a dense layer beyond ``parallel.primepar_layers`` (Megatron's MLP partition; zero without)."""
    kept: tuple[float, float]
    """Bytes a dense and a MoE layer keep without recomputation, for block recomputation (zero without it)."""
    extra_params: float
    """:func:`layer_extra_params` of a layer."""
    bf16_ends: tuple[tuple[float, float], tuple[float, float]] | None
    """:attr:`dense` and :attr:`moe` of a layer kept in bf16 at the stack's ends (its bf16 twin,
    :func:`~cfp_megatron.sim.format_costs.bf16_twin`); ``None`` without such layers or in a 16/32-bit format."""
    tokens: float
    """Tokens of one micro-batch on a rank (its CP share)."""
    flows: tuple[float, float]
    """:func:`~cfp_megatron.sim.backward_memory.backward_flow_bytes` of a dense and of a MoE layer (zero for a dense
    model): the largest of a layer's backward moments."""
    unfused_working: float
    """:func:`unfused_attention_working_bytes` of a layer."""


def layout_memory(job: JobSpec, layout: Layout, options: SimOptions) -> LayoutMemory:
    """The :class:`LayoutMemory` of ``job`` laid out as ``layout``."""
    parallel, moe = job.parallel, job.model.is_moe
    block = parallel.recompute is Recompute.full and parallel.recompute_method is RecomputeMethod.block
    zero = (0.0, 0.0)
    return LayoutMemory(
        elem_bytes=float(element_bytes(job)),
        sharding=Sharding.megatron(job, layout.dims, torch_fsdp=options.torch_fsdp, apex_adam=options.apex_adam,
                                   deepspeed_engine=options.deepspeed_engine,
                                   fsdp_buffers=FsdpBuffers(unit_size=options.fsdp_unit_size,
                                                            double_buffer=options.fsdp_double_buffer)),
        dense=layer_activation_bytes(job, layout, options, moe=False),
        moe=layer_activation_bytes(job, layout, options, moe=True) if moe else zero,
        megatron=(layer_activation_bytes(megatron_twin(job), layout, options, moe=False)
                  if parallel.primepar_layers is not None else zero),
        kept=(layer_activation_bytes(job, layout, options, moe=False, recompute=Recompute.none)[0],
              layer_activation_bytes(job, layout, options, moe=True, recompute=Recompute.none)[0] if moe else 0.0)
        if block else zero, extra_params=layer_extra_params(job, layout),
        bf16_ends=((layer_activation_bytes(bf16_twin(job), layout, options, moe=False),
                    layer_activation_bytes(bf16_twin(job), layout, options, moe=True) if moe else zero)
                   if (parallel.num_layers_at_start_in_bf16 or parallel.num_layers_at_end_in_bf16)
                   and low_format_cost(job) is not None else None),
        tokens=layout.micro_batch * layout.seq_length / layout.dims.cp,
        flows=(backward_flow_bytes(job, layout, options, moe=False),
               backward_flow_bytes(job, layout, options, moe=True) if moe else 0.0),
        unfused_working=unfused_attention_working_bytes(job, layout, options))
