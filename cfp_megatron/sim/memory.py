"""Peak memory per rank: weights, gradients, optimizer states, activations of the in-flight micro-batches.

Activations per layer follow Korthikanti et al. (2022), Table 2, term by term, so the same formula covers GQA
(smaller K and V), SwiGLU (a wider first MLP output), MoE (routed token copies through expert MLPs), dropout masks
only when dropout is on, fused attention (no ``s x s`` scores), TP with and without sequence parallelism, and CP
(each rank keeps ``s / cp`` tokens). For GPT-style MHA with dropout this is ``s b h (34 + 5 a s / h)`` bytes without
TP, ``s b h (10 + 24 / t + 5 a s / (h t))`` with TP, ``s b h / t (34 + 5 a s / h)`` with TP + SP; selective
recomputation drops the ``a s`` terms; full recomputation keeps only each layer's input. Stage ``r`` of 1F1B holds
``pp - r`` micro-batches; the interleaved schedule holds its warm-up count of model chunks plus one.
"""

from __future__ import annotations

from cfp_megatron.config import Activation, JobSpec, OptimizerKind, Precision, Recompute
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.prediction import MemoryBreakdown


def layer_activation_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool) -> tuple[float, float]:
    """(bytes kept for backward by one layer for one micro-batch, the same under full recomputation)."""
    m, d = job.model, layout.dims
    t, sp = d.tp, d.sp
    tokens = layout.micro_batch * layout.seq_length / d.cp
    h = m.hidden_size
    heads = m.num_attention_heads
    head_dim = m.kv_channels or h // heads
    q_width = heads * head_dim
    kv_width = m.query_groups * head_dim
    rep = 1.0 / t if sp else 1.0
    hidden_mask = 1.0 if m.hidden_dropout > 0 else 0.0
    # Replicated over TP unless SP: two norm inputs, QKV input, MLP input, two dropout masks.
    per_token = (2 * h + 2 * h + 2 * h + 2 * h + 2 * hidden_mask * h) * rep
    # Split over TP: Q, K, V, attention output (projection input).
    per_token += (2 * q_width + 2 * kv_width + 2 * kv_width + 2 * q_width) / t
    recompute = job.parallel.recompute
    if not options.flash_attention and recompute is Recompute.none:
        attn_mask = 1.0 if m.attention_dropout > 0 else 0.0
        per_token += heads * layout.seq_length * (2 + attn_mask + 2 * attn_mask) / t
    gated = m.activation is Activation.swiglu
    if moe:
        fe = m.moe_ffn_hidden_size or m.ffn_size
        routed = m.moe_router_topk * d.etp / t  # token copies per local token
        per_token += routed * (2 * h + 2 * fe * (2 if gated else 1) / d.etp + 2 * fe / d.etp)
        shared = m.moe_shared_expert_intermediate_size or 0
        per_token += (2 * shared * (2 if gated else 1) + 2 * shared) / t
    else:
        per_token += (2 * m.ffn_size * (2 if gated else 1) + 2 * m.ffn_size) / t
    full = tokens * h * 2 * rep
    return tokens * per_token, full


def in_flight(rank: int, pp: int, vpp: int, microbatches: int) -> int:
    """Model-chunk micro-batches whose activations rank ``rank`` holds at its peak."""
    total = microbatches * vpp
    if vpp == 1:
        return min(pp - rank, microbatches)
    warm = total if microbatches == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    return min(warm + 1, total)


def stage_memory(job: JobSpec, layout: Layout, options: SimOptions, *, rank: int, layer_params: float,
                 expert_params: float, layers: int, moe_layers: int, first: bool, last: bool) -> MemoryBreakdown:
    """Memory of one rank of pipeline stage ``rank`` holding ``layers`` layers (``moe_layers`` of them MoE)."""
    m, d, p = job.model, layout.dims, job.parallel
    elem = 4 if job.train.precision is Precision.fp32 else 2
    vocab_params = m.padded_vocab_size * m.hidden_size / d.tp
    params = layer_params
    if first:
        params += vocab_params
    if last and (d.pp > 1 or not m.tie_embeddings):
        params += vocab_params
    dense_params = params - expert_params
    mixed = elem == 2
    adam = job.train.optimizer is OptimizerKind.adam
    opt_per_param = (4.0 if mixed else 0.0) + (8.0 if adam else 4.0)
    grad_per_param = 4.0
    dp_group = d.dp * d.cp
    if options.fsdp:
        weights = params * elem / dp_group
        grads = params * grad_per_param / dp_group
        optim = params * opt_per_param / dp_group
    else:
        weights = params * elem
        grads = params * grad_per_param
        if p.distributed_optimizer:
            optim = dense_params * opt_per_param / dp_group + expert_params * opt_per_param / d.expert_dp
        else:
            optim = params * opt_per_param
    dense_act, dense_full = layer_activation_bytes(job, layout, options, moe=False)
    if moe_layers:
        moe_act, moe_full = layer_activation_bytes(job, layout, options, moe=True)
    else:
        moe_act = moe_full = 0.0
    dense_layers = layers - moe_layers
    chunk_mbs = in_flight(rank, d.pp, d.vpp, d.num_microbatches)
    per_mb_layers = chunk_mbs / d.vpp  # whole-rank micro-batches held
    if p.recompute is Recompute.full:
        kept = dense_layers * dense_full + moe_layers * moe_full
        working = max(dense_act, moe_act)
    else:
        kept = dense_layers * dense_act + moe_layers * moe_act
        working = 0.0
    tokens = layout.micro_batch * layout.seq_length / d.cp
    activations = kept * per_mb_layers + working
    if last:
        activations += 2 * tokens * m.padded_vocab_size / d.tp * 4.0  # fp32 logits and their gradient
    buffers = 0.0
    if d.tp > 1:
        buffers += 2 * tokens * m.hidden_size * elem
    if d.pp > 1:
        buffers += 2 * tokens * m.hidden_size * elem / (d.tp if d.sp else 1)
    if options.fsdp and layers:
        per_layer = layer_params / layers
        buffers += 2 * per_layer * elem + per_layer * grad_per_param
    return MemoryBreakdown(parameters=weights, gradients=grads, optimizer_states=optim, activations=activations,
                           comm_buffers=buffers, stage=rank)
