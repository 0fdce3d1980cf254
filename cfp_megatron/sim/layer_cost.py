"""Seconds of one transformer layer (and of the embedding and output layer) for one micro-batch on one rank.

Work per layer follows Megatron-Core's layer: QKV projection (GQA-aware), attention core, output projection, the MLP
(GELU or SwiGLU) or the MoE block (router, experts as grouped GEMMs, shared experts), norms and residuals. GEMMs are
split over TP; the sequence over CP; tokens over EP. Collectives per layer: with TP, two all-reduces per pass
(or two all-gathers and two reduce-scatters with sequence parallelism) for attention and for a dense MLP; with CP,
the ring attention exchange of K and V (overlapped with the attention core, only the excess shows); with EP, the
all-to-all dispatch and combine; with FSDP, the layer's parameter all-gather and gradient reduce-scatter
(overlapped with the compute of the neighbouring layer). A PrimePar MLP (``parallel.mlp=primepar``) costs what
:mod:`cfp_megatron.sim.primepar_cost` says instead of the split GEMMs and their all-reduces. Backward is twice
the forward GEMM work (2.5x for the fused attention core, which recomputes scores).
"""

from __future__ import annotations

from dataclasses import dataclass

from cfp_megatron.base.config import Activation, AttentionKind, JobSpec, MlpPartition
from cfp_megatron.base.flops import attention_params, mlp_params
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.kernels import KernelModel, grad_element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.primepar_cost import MlpCost, ffn_gemms, mlp_activation_elements, primepar_mlp_cost


@dataclass(frozen=True, kw_only=True)
class PassCost:
    """Seconds of one pass (forward or backward) of one layer for one micro-batch on one rank."""

    compute_s: float = 0.0
    """GEMMs and element-wise kernels."""
    attention_core_s: float = 0.0
    """The attention core (part of compute, kept apart for selective recomputation)."""
    overhead_s: float = 0.0
    """Fixed per-layer cost."""
    tp_comm_s: float = 0.0
    """TP/SP collectives."""
    cp_comm_s: float = 0.0
    """Exposed context-parallel exchange."""
    ep_comm_s: float = 0.0
    """Expert all-to-all."""
    fsdp_comm_s: float = 0.0
    """Exposed FSDP parameter gather / gradient scatter."""

    @property
    def total_s(self) -> float:
        """Wall time of the pass."""
        return (self.compute_s + self.attention_core_s + self.overhead_s + self.tp_comm_s + self.cp_comm_s
                + self.ep_comm_s + self.fsdp_comm_s)

    @property
    def comm_s(self) -> float:
        """Communication part of the pass."""
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.fsdp_comm_s

    def scaled(self, n: float) -> PassCost:
        """Component-wise multiple (``n`` layers of the same kind)."""
        return PassCost(compute_s=n * self.compute_s, attention_core_s=n * self.attention_core_s,
                        overhead_s=n * self.overhead_s, tp_comm_s=n * self.tp_comm_s, cp_comm_s=n * self.cp_comm_s,
                        ep_comm_s=n * self.ep_comm_s, fsdp_comm_s=n * self.fsdp_comm_s)

    def plus(self, other: PassCost) -> PassCost:
        """Component-wise sum."""
        return PassCost(compute_s=self.compute_s + other.compute_s,
                        attention_core_s=self.attention_core_s + other.attention_core_s,
                        overhead_s=self.overhead_s + other.overhead_s, tp_comm_s=self.tp_comm_s + other.tp_comm_s,
                        cp_comm_s=self.cp_comm_s + other.cp_comm_s, ep_comm_s=self.ep_comm_s + other.ep_comm_s,
                        fsdp_comm_s=self.fsdp_comm_s + other.fsdp_comm_s)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Forward, backward and recomputation cost of one kind of layer."""

    forward: PassCost
    """Forward pass."""
    backward: PassCost
    """Backward pass without recomputation."""
    recompute: PassCost
    """Extra work the recompute choice adds to the backward pass."""
    params: float
    """Parameters of this layer held by one rank (before any DP sharding)."""
    expert_params: float
    """The part of ``params`` that belongs to routed experts (reduced over the expert-DP group)."""

    @property
    def total_s(self) -> float:
        """Forward + backward + recomputation seconds."""
        return self.forward.total_s + self.backward.total_s + self.recompute.total_s


def layer_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, options: SimOptions,
               *, moe: bool) -> LayerCost:
    """Cost of one dense (``moe=False``) or MoE layer of ``job`` under ``layout``."""
    m, p = job.model, job.parallel
    d = layout.dims
    t, cp, sp = d.tp, d.cp, d.sp
    b, s = layout.micro_batch, layout.seq_length
    e = kernels.elem
    h = m.hidden_size
    tokens = b * s / cp
    gated = m.activation is Activation.swiglu

    # Attention.
    attn_params = attention_params(m)
    if m.attention is AttentionKind.mla:
        head_dims = m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) / 2
        kv_width = m.kv_lora_rank + m.qk_pos_emb_head_dim
    else:
        head_dims = m.num_attention_heads * (m.kv_channels or h // m.num_attention_heads)
        kv_width = 2 * m.query_groups * (m.kv_channels or h // m.num_attention_heads)
    qkv_width = (attn_params - head_dims * h) / h  # QKV output columns (attention_params = QKV + projection)
    attn_gemm = kernels.gemm(tokens, qkv_width / t, h) + kernels.gemm(tokens, h, head_dims / t)
    # Fused (flash) kernels skip the masked upper triangle of causal attention; unfused ones compute all of it.
    core_flops = 4.0 * b * (s / cp) * s * head_dims / t * (0.5 if options.flash_attention else 1.0)
    core_fwd = kernels.attention(core_flops)
    core_bwd = core_fwd * (2.5 if options.flash_attention else 2.0)

    # Element-wise traffic per token, in elements: norms, residuals, bias/dropout (replicated unless SP),
    # rotary/bias on QKV and the MLP activation (split over TP).
    rep = 12.0 * h / (t if sp else 1)
    split = qkv_width / t
    if not options.flash_attention:
        split += 4.0 * m.num_attention_heads * s / t  # scores written, softmaxed, read back
    params = attn_params / t + 4 * h
    expert_params = 0.0
    ep_fwd = 0.0
    primepar: MlpCost | None = None
    if moe:
        fe = m.moe_ffn_hidden_size or m.ffn_size
        topk, n_exp = m.moe_router_topk, m.num_experts or 1
        etp, ep = d.etp, d.ep
        routed = topk * tokens / t * etp  # token copies an expert rank processes (balanced routing)
        local_experts = n_exp / ep
        per_expert = routed / local_experts
        mlp_gemm = local_experts * ffn_gemms(kernels, per_expert, h, fe / etp, gated)
        mlp_gemm += kernels.gemm(tokens / (t if sp else 1), n_exp, h, low_precision=False)
        shared = m.moe_shared_expert_intermediate_size or 0
        if shared:
            mlp_gemm += ffn_gemms(kernels, tokens, h, shared / t, gated)
            split += mlp_activation_elements(tp=t, ffn=shared, gated=gated)
        split += routed / tokens * ((3 if gated else 2) * fe / etp + kernels.eff.moe_token_elements * h)
        expert_params = mlp_params(m, fe) * local_experts / etp
        params += expert_params + mlp_params(m, shared) / t + h * n_exp
        a2a_bytes = topk * tokens / t * h * e
        ep_fwd = 2 * costs.seconds(Collective.all_to_all, a2a_bytes, ep, layout.ep_per_node)
        if etp > 1:
            ep_fwd += 2 * costs.seconds(Collective.all_gather, a2a_bytes * etp, etp, min(etp, layout.gpus_per_node))
        tp_ops = 2  # attention only; the experts talk over EP
    else:
        # The split GEMMs and the activation as sim.primepar_cost.megatron_mlp_cost has them (its all-reduce is
        # counted with attention's below).
        mlp_gemm = ffn_gemms(kernels, tokens, h, m.ffn_size / t, gated)
        split += mlp_activation_elements(tp=t, ffn=m.ffn_size, gated=gated)
        params += mlp_params(m, m.ffn_size) / t
        tp_ops = 4
        if p.mlp is MlpPartition.primepar and t > 1:  # the MLP's own GEMMs and communication (sim.primepar_cost)
            primepar = primepar_mlp_cost(kernels, costs, tp=t, tp_per_node=layout.tp_per_node, tokens=tokens,
                                         hidden=h, ffn=m.ffn_size, gated=gated,
                                         overlap=not job.cluster.on_cpu, sp=sp)
            mlp_gemm = primepar.forward_compute_s
            tp_ops = 2  # attention's all-reduce per pass; the MLP adds its exposed ring and all-gather below
    elementwise = kernels.memory((rep + split) * tokens * e)

    # TP / SP collectives: per pass, tp_ops/2 all-reduces, or as many all-gathers plus reduce-scatters with SP.
    act_bytes = tokens * h * e
    if t > 1:
        if sp:
            tp_pass = (tp_ops // 2) * (costs.seconds(Collective.all_gather, act_bytes, t, layout.tp_per_node)
                                       + costs.seconds(Collective.reduce_scatter, act_bytes, t, layout.tp_per_node))
        else:
            tp_pass = (tp_ops // 2) * costs.seconds(Collective.all_reduce, act_bytes, t, layout.tp_per_node)
    else:
        tp_pass = 0.0
    if tp_pass and options.tp_comm_overlap:
        covered = attn_gemm + (mlp_gemm if tp_ops == 4 else 0.0)
        tp_pass = max(tp_pass - covered, 0.0) + tp_pass / t

    # Context parallelism: cp-1 ring steps of this rank's K and V, overlapped with the attention core.
    if cp > 1:
        kv_bytes = b * (s / cp) * kv_width / t * e
        step = costs.seconds(Collective.send_recv, kv_bytes, 2, min(layout.cp_per_node, 2))
        cp_fwd = max(0.0, (cp - 1) * step - core_fwd * (cp - 1) / cp)
        cp_bwd = max(0.0, 2 * (cp - 1) * step - core_bwd * (cp - 1) / cp)
    else:
        cp_fwd = cp_bwd = 0.0

    # FSDP: gather the layer's weights before forward and backward, scatter its gradients after backward.
    fsdp_fwd = fsdp_bwd = 0.0
    fwd_compute = attn_gemm + mlp_gemm + elementwise
    bwd_compute = 2.0 * (attn_gemm + mlp_gemm) + 2.0 * elementwise
    if options.fsdp and d.dp > 1:
        shard = params * e
        gather = costs.seconds(Collective.all_gather, shard, d.dp * d.cp, layout.dp_per_node)
        scatter = costs.seconds(Collective.reduce_scatter, params * grad_element_bytes(job), d.dp * d.cp,
                                layout.dp_per_node)
        fsdp_fwd = max(0.0, gather - fwd_compute - core_fwd)
        fsdp_bwd = max(0.0, gather + scatter - bwd_compute - core_bwd)

    if primepar is not None:
        bwd_compute += primepar.backward_compute_s - 2.0 * primepar.forward_compute_s
        tp_fwd, tp_bwd = tp_pass + primepar.forward_comm_s, tp_pass + primepar.backward_comm_s
    else:
        tp_fwd = tp_bwd = tp_pass

    overhead = kernels.eff.layer_overhead_s
    forward = PassCost(compute_s=fwd_compute, attention_core_s=core_fwd, overhead_s=overhead, tp_comm_s=tp_fwd,
                       cp_comm_s=cp_fwd, ep_comm_s=ep_fwd, fsdp_comm_s=fsdp_fwd)
    backward = PassCost(compute_s=bwd_compute, attention_core_s=core_bwd, overhead_s=overhead, tp_comm_s=tp_bwd,
                        cp_comm_s=cp_bwd, ep_comm_s=ep_fwd, fsdp_comm_s=fsdp_bwd)
    if p.recompute.value == "full":
        recompute = PassCost(compute_s=fwd_compute, attention_core_s=core_fwd, overhead_s=overhead,
                             tp_comm_s=tp_fwd, cp_comm_s=cp_fwd, ep_comm_s=ep_fwd)
    elif p.recompute.value == "selective":
        recompute = PassCost(attention_core_s=core_fwd)
    else:
        recompute = PassCost()
    return LayerCost(forward=forward, backward=backward, recompute=recompute, params=params,
                     expert_params=expert_params)


def output_layer_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> tuple[
        PassCost, PassCost]:
    """(forward, backward) of the final norm, the vocabulary-parallel logits and the cross-entropy loss."""
    m, d = job.model, layout.dims
    tokens = layout.micro_batch * layout.seq_length / d.cp
    vocab = m.padded_vocab_size / d.tp
    gemm = kernels.gemm(tokens, vocab, m.hidden_size)
    loss = kernels.memory(tokens * vocab * 4.0 * 3)  # fp32 logits: softmax read/write, gradient write
    gather = 0.0
    if d.tp > 1 and d.sp:
        gather = costs.seconds(Collective.all_gather, tokens * m.hidden_size * kernels.elem, d.tp,
                               layout.tp_per_node)
    return (PassCost(compute_s=gemm + loss, tp_comm_s=gather),
            PassCost(compute_s=2 * gemm + loss, tp_comm_s=gather))


def embedding_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> tuple[
        PassCost, PassCost]:
    """(forward, backward) of the vocabulary-parallel input embedding."""
    m, d = job.model, layout.dims
    tokens = layout.micro_batch * layout.seq_length / d.cp
    nbytes = tokens * m.hidden_size * kernels.elem
    reduce = 0.0
    if d.tp > 1:
        op = Collective.reduce_scatter if d.sp else Collective.all_reduce
        reduce = costs.seconds(op, nbytes, d.tp, layout.tp_per_node)
    return PassCost(compute_s=kernels.memory(3 * nbytes), tp_comm_s=reduce), PassCost(
        compute_s=kernels.memory(3 * nbytes) + kernels.memory(nbytes * 2))
