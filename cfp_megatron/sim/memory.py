"""Peak memory per rank: weights, gradients, optimizer states, activations of the in-flight micro-batches.

Activations per layer follow Korthikanti et al. (2022), Table 2, term by term, so the same formula covers GQA
(smaller K and V), SwiGLU (a wider first MLP output), MoE (routed token copies through expert MLPs), dropout masks
only when dropout is on, fused attention (no ``s x s`` scores), TP with and without sequence parallelism, CP (each
rank keeps ``s / cp`` tokens) and FP8 (the linear layers' saved inputs are one-byte copies). For GPT-style MHA with
dropout this is ``s b h (34 + 5 a s / h)`` bytes without TP, ``s b h (10 + 24 / t + 5 a s / (h t))`` with TP, ``s b h
/ t (34 + 5 a s / h)`` with TP + SP; selective recomputation drops the ``a s`` terms; full recomputation keeps only
each layer's input (with the ``block`` method only for the first ``recompute_num_layers`` layers of each pipeline
chunk; the others keep everything). Stage ``r`` of 1F1B holds ``pp - r`` micro-batches; the interleaved schedule
holds its warm-up count of model chunks plus one.
"""

from __future__ import annotations

import dataclasses

from cfp_megatron.base.config import (
    Activation,
    JobSpec,
    MlpPartition,
    Normalization,
    OptimizerKind,
    PositionEmbedding,
    Recompute,
    RecomputeMethod,
)
from cfp_megatron.base.pipeline_split import job_chunks
from cfp_megatron.cluster.measured import Measurements, SegmentMemory, partition_name
from cfp_megatron.sim.kernels import element_bytes, grad_element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.measured_memory import measured_memory, peak_activation_bytes, pipeline_buffers
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.prediction import MemoryBreakdown
from cfp_megatron.sim.primepar_cost import megatron_twin, primepar_stash_saving, primepar_weight_copies


def layer_extra_params(job: JobSpec, layout: Layout) -> float:
    """Parameters of one dense layer on one rank that the layer cost's count leaves out: the linear layers' biases
    (QKV and FC1 split over TP, the projection's and FC2's replicated) and, for RMSNorm, minus the norm biases the
    count assumes (it counts two LayerNorms, ``4 h``)."""
    m, t = job.model, layout.dims.tp
    h = m.hidden_size
    extra = 0.0 if m.normalization is Normalization.LayerNorm else -2.0 * h
    if m.add_bias_linear and not m.is_moe:
        head_dim = m.kv_channels or h // m.num_attention_heads
        qkv = head_dim * (m.num_attention_heads + 2 * m.query_groups)
        fc1 = m.ffn_size * (2 if m.activation is Activation.swiglu else 1)
        extra += (qkv + fc1) / t + 2 * h
    return extra


def layer_activation_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool,
                           recompute: Recompute | None = None) -> tuple[float, float]:
    """(bytes kept for backward by one layer for one micro-batch, the same under full recomputation).

    ``recompute`` overrides the plan's recomputation for this layer (``block`` leaves some layers unrecomputed)."""
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
    primepar = not moe and job.parallel.mlp is MlpPartition.primepar and t > 1
    # Bytes per element of an input a linear layer keeps for its weight gradient: Transformer Engine's FP8 layers
    # keep the one-byte FP8 copy their forward GEMM read (PrimePar's MLP and the MoE router run in bf16).
    lin = 1.0 if options.fp8 else 2.0
    mlp_in = 2.0 if moe or primepar else lin  # a dense TE fc1 keeps its fused norm's output; the router reads bf16
    # Replicated over TP unless SP: two norm inputs, QKV input, MLP input, two dropout masks.
    per_token = (2 * h + 2 * h + lin * h + mlp_in * h + 2 * hidden_mask * h) * rep
    # Split over TP: Q, K, V, attention output (projection input).
    per_token += (2 * q_width + 2 * kv_width + 2 * kv_width + lin * q_width) / t
    recompute = job.parallel.recompute if recompute is None else recompute
    if not options.flash_attention and recompute is Recompute.none:
        attn_mask = 1.0 if m.attention_dropout > 0 else 0.0
        per_token += heads * layout.seq_length * (2 + attn_mask + 2 * attn_mask) / t
    gated = m.activation is Activation.swiglu
    if moe:
        fe = m.moe_ffn_hidden_size or m.ffn_size
        routed = m.moe_router_topk * d.etp / t  # token copies per local token
        per_token += routed * (lin * h + 2 * fe * (2 if gated else 1) / d.etp + lin * fe / d.etp)
        shared = m.moe_shared_expert_intermediate_size or 0
        per_token += (2 * shared * (2 if gated else 1) + lin * shared) / t
    else:
        fc2_in = 2.0 if primepar else lin
        per_token += (2 * m.ffn_size * (2 if gated else 1) + fc2_in * m.ffn_size) / t
        if gated and job.cluster.on_cpu:
            # Unfused SwiGLU (the fusion is CUDA-only): it also keeps SiLU's output and the linear half it multiplies.
            per_token += 2 * 2 * m.ffn_size / t
        if primepar:
            # fc1's input kept as one block of the grid, not replicated; the rotated weight blocks kept from the
            # forward to the backward pass (cfp_megatron.sim.primepar_cost).
            per_token -= primepar_stash_saving(tp=t, tokens=1.0, hidden=h, elem=2.0, sp=sp)
            per_token += primepar_weight_copies(tp=t, hidden=h, ffn=m.ffn_size, gated=gated, elem=2.0) / tokens
    full = tokens * h * 2 * rep
    return tokens * per_token, full


def in_flight(rank: int, pp: int, vpp: int, microbatches: int) -> int:
    """Model-chunk micro-batches whose activations rank ``rank`` holds at its peak."""
    total = microbatches * vpp
    if vpp == 1:
        return min(pp - rank, microbatches)
    warm = total if microbatches == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    return min(warm + 1, total)


def recomputed_layers(job: JobSpec, *, rank: int) -> tuple[int, int]:
    """(dense, MoE) layers of pipeline rank ``rank``, over its chunks, that full recomputation covers: all of them
    (``uniform``), or the first ``recompute_num_layers`` of each chunk (``block``; leading dense layers come first).
    Zero without full recomputation."""
    p = job.parallel
    if p.recompute is not Recompute.full:
        return 0, 0
    per_chunk = [chunk.recomputed(p) for chunk in job_chunks(job)[rank]]
    return sum(d for d, _ in per_chunk), sum(m for _, m in per_chunk)


def primepar_split(job: JobSpec, *, rank: int) -> tuple[int, JobSpec] | None:
    """(dense layers of pipeline rank ``rank`` that run PrimePar's MLP, the plan with Megatron's partition that the
    others run) where ``parallel.primepar_layers`` leaves some of its dense layers to Megatron's split; ``None``
    where every dense layer runs the plan's partition."""
    p = job.parallel
    if p.primepar_layers is None:
        return None
    chunks = job_chunks(job)[rank]
    prime = sum(c.primepar(p) for c in chunks)
    return (prime, megatron_twin(job)) if prime < sum(c.dense for c in chunks) else None


def recomputed_units(job: JobSpec, chunk: list[SegmentMemory], hidden_bytes: float) -> list[SegmentMemory]:
    """A pipeline chunk's measured layers (in model order) as full recomputation runs them: Megatron checkpoints
    groups of ``recompute_num_layers`` layers (``uniform``) or each of the first ``recompute_num_layers`` layers
    (``block``). A checkpointed unit keeps only its output (the next unit's saved input, ``hidden_bytes``) between
    its forward and its backward pass; in the backward pass it runs its layers' forward again, so on top of what it
    keeps the live bytes rise by every layer's kept activations, its output made anew among them, plus the largest
    transient (the recompute round's ``tp<N>-full`` layer, one per unit, measured exactly that for gpt_tiny at
    every TP size and micro-batch size it ran, 16 records; without the new output a unit came out one hidden tensor
    low). Layers outside the units are
    unchanged, and so is every layer without full recomputation."""
    p = job.parallel
    if p.recompute is not Recompute.full or not chunk:
        return chunk

    def unit(layers: list[SegmentMemory]) -> SegmentMemory:
        kept = sum(x.activation_bytes for x in layers)
        return SegmentMemory(activation_bytes=hidden_bytes,
                             transient_bytes=kept + max(x.transient_bytes for x in layers),
                             workspace_bytes=max(x.workspace_bytes for x in layers))

    k = max(p.recompute_num_layers, 1)
    if p.recompute_method is RecomputeMethod.block:
        return [unit([x]) for x in chunk[:k]] + chunk[k:]
    return [unit(chunk[i:i + k]) for i in range(0, len(chunk), k)]


def measured_activations(job: JobSpec, layout: Layout, measurements: Measurements | None, *, rank: int,
                         layers: int, moe_layers: int, first: bool, last: bool) -> float | None:
    """Activation bytes at the peak of pipeline rank ``rank`` from profiled segment memory
    (:mod:`cfp_megatron.sim.measured_memory`), with the pipeline's point-to-point tensors; ``None`` when the
    profile lacks a segment the stage runs under the plan's partition, or the plan splits the sequence over CP
    (profiling does not measure it). Under selective recomputation the decoder layers' figures are those profiled
    under it (``tp2-selective``: the checkpointed core attention keeps only its inputs, and runs again in the
    backward pass); under full recomputation each recomputed unit keeps only its output (:func:`recomputed_units`)."""
    d = layout.dims
    if measurements is None or d.cp > 1:
        return None
    selective = Recompute.selective if job.parallel.recompute is Recompute.selective else Recompute.none
    partition = partition_name(d.tp, sp=d.sp)  # the embedding and the head
    layer_partition = partition_name(d.tp, sp=d.sp, mlp=job.parallel.mlp, recompute=selective)
    megatron_partition = partition_name(d.tp, sp=d.sp, recompute=selective)  # layers past primepar_layers
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
    chunk_layers = layers // d.vpp
    chunk_moe = min(moe_layers // d.vpp, chunk_layers)
    # The dense layers of each chunk run the plan's partition, or its first primepar_layers do (the rest Megatron's).
    chunk_own = split[0] // d.vpp if split else chunk_layers - chunk_moe
    rest = chunk_layers - chunk_moe - chunk_own
    chunk = ([found["dense"]] * chunk_own if chunk_own else []) + ([found["megatron"]] * rest if rest else []) + (
        [found["moe"]] * chunk_moe if chunk_moe else [])
    elem = element_bytes(job)
    hidden = layout.micro_batch * layout.seq_length * job.model.hidden_size * elem / (d.tp if d.sp else 1)
    chunk = recomputed_units(job, chunk, hidden)
    if first and last and job.model.tie_embeddings and chunk:
        # One weight serves the embedding and the head: autograd sums its two gradients before accumulating them, so
        # the head's weight gradient (freed at once in the head's probe) stays alive through every decoder layer's
        # backward pass, until the embedding's. It decides the peak under full recomputation, whose peak is a
        # layer's backward pass.
        tied = job.model.padded_vocab_size * job.model.hidden_size / d.tp * elem
        chunk = [dataclasses.replace(x, transient_bytes=x.transient_bytes + tied) for x in chunk]
    in_chunks = in_flight(rank, d.pp, d.vpp, d.num_microbatches)
    ends = ([found["embedding"]] if first else []) + ([found["head"]] if last else [])
    if d.vpp == 1:
        segments = ([found["embedding"]] if first else []) + chunk + ([found["head"]] if last else [])
        activations = peak_activation_bytes(segments, in_chunks)
    else:  # the embedding and the head sit in one chunk each: held by that chunk's share of the micro-batches
        activations = peak_activation_bytes(chunk, in_chunks)
        activations += -(-in_chunks // d.vpp) * sum(s.activation_bytes for s in ends)
    return activations + pipeline_buffers(hidden, pp=d.pp, first=first, last=last, in_flight=in_chunks,
                                          microbatches=d.num_microbatches)


def stage_memory(job: JobSpec, layout: Layout, options: SimOptions, *, rank: int, layer_params: float,
                 expert_params: float, layers: int, moe_layers: int, first: bool, last: bool,
                 measurements: Measurements | None = None) -> MemoryBreakdown:
    """Memory of one rank of pipeline stage ``rank`` holding ``layers`` layers (``moe_layers`` of them MoE).

    With ``measurements`` that hold the stage's segments' memory under the plan's partition, the activations (and
    the pipeline's buffers) come from them (:func:`measured_activations`) instead of the analytical model."""
    m, d, p = job.model, layout.dims, job.parallel
    elem = element_bytes(job)
    vocab_params = m.padded_vocab_size * m.hidden_size / d.tp
    params = layer_params + layers * layer_extra_params(job, layout)
    if first:
        params += vocab_params
        if m.position_embedding is PositionEmbedding.learned_absolute:
            params += m.max_position_embeddings * m.hidden_size  # replicated over TP
    if last:
        params += m.hidden_size * (2 if m.normalization is Normalization.LayerNorm else 1)  # final norm
    if last and (d.pp > 1 or not m.tie_embeddings):
        params += vocab_params
    dense_params = params - expert_params
    mixed = elem == 2
    adam = job.train.optimizer is OptimizerKind.adam
    opt_per_param = (4.0 if mixed else 0.0) + (8.0 if adam else 4.0)
    grad_per_param = grad_element_bytes(job)
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
    # Dense layers beyond parallel.primepar_layers keep Megatron's MLP partition, and its activations.
    split = primepar_split(job, rank=rank)
    own = split[0] if split else layers - moe_layers
    mega_act, mega_full = layer_activation_bytes(split[1], layout, options, moe=False) if split else (0.0, 0.0)
    if moe_layers:
        moe_act, moe_full = layer_activation_bytes(job, layout, options, moe=True)
    else:
        moe_act = moe_full = 0.0
    dense_layers = layers - moe_layers
    chunk_mbs = in_flight(rank, d.pp, d.vpp, d.num_microbatches)
    per_mb_layers = chunk_mbs / d.vpp  # whole-rank micro-batches held
    if p.recompute is Recompute.full and p.recompute_method is RecomputeMethod.block:
        # The recomputed layers keep their input; the others keep what they would without recomputation.
        rec_dense, rec_moe = recomputed_layers(job, rank=rank)
        dense_kept = layer_activation_bytes(job, layout, options, moe=False, recompute=Recompute.none)[0]
        moe_kept = (layer_activation_bytes(job, layout, options, moe=True, recompute=Recompute.none)[0]
                    if moe_layers else 0.0)
        kept = (rec_dense * dense_full + rec_moe * moe_full + (dense_layers - rec_dense) * dense_kept
                + (moe_layers - rec_moe) * moe_kept)
        working = max(dense_act, moe_act)
    elif p.recompute is Recompute.full:
        kept = own * dense_full + (dense_layers - own) * mega_full + moe_layers * moe_full
        working = max(dense_act, mega_act, moe_act)
    else:
        kept = own * dense_act + (dense_layers - own) * mega_act + moe_layers * moe_act
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
    measured = measured_activations(job, layout, measurements, rank=rank, layers=layers, moe_layers=moe_layers,
                                    first=first, last=last) if not options.fsdp else None
    if measured is not None:
        activations, buffers = measured, 0.0
    return MemoryBreakdown(parameters=weights, gradients=grads, optimizer_states=optim, activations=activations,
                           comm_buffers=buffers, stage=rank)
