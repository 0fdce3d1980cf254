"""Seconds of one transformer layer (and of the embedding and output layer) for one micro-batch on one rank: its
kernels, its TP/SP, CP, EP and FSDP communication, and its recomputation. What each term models:
docs/simulator.md, "layer_cost.py".
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from cfp_megatron.base.config import (
    AttentionKernel,
    AttentionKind,
    FsdpStrategy,
    JobSpec,
    MlpPartition,
    ModelSpec,
)
from cfp_megatron.base.flops import attention_params, causal_score_share, mlp_params
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.grad_accumulation import accumulation_bytes, accumulation_mode
from cfp_megatron.sim.host_costs import expert_scalar_kernels_s
from cfp_megatron.sim.kernels import KernelModel, grad_element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.primepar_cost import MlpCost, ffn_gemms, mlp_activation_elements, primepar_mlp_cost
from cfp_megatron.sim.terms.context_parallel import chunk_slowdown, cp_cost
from cfp_megatron.sim.terms.data_parallel import fsdp_beside_experts, fsdp_exposed, fsdp_sync
from cfp_megatron.sim.terms.expert_dispatch import (
    MoeCost,
    expert_comm,
    moe_block_cost,
    paired_exchange,
    torch_swiglu_bytes,
)
from cfp_megatron.sim.terms.recompute import op_sac_recompute_s, selective_recompute
from cfp_megatron.sim.terms.tensor_parallel import tp_backward_async_s, tp_pass_s


@dataclass(frozen=True, kw_only=True)
class PassCost:
    """Seconds of one pass (forward or backward) of one layer for one micro-batch on one rank."""

    compute_s: float = 0.0
    """GEMMs and element-wise kernels, seconds."""
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
    host_s: float = 0.0
    """Host time the GPU work does not cover: launches beyond the pass's GPU time, synchronisations
    (:mod:`cfp_megatron.sim.terms.host`; set per model chunk by the simulator, zero on one layer's cost)."""
    weight_grad_s: float = 0.0
    """The part of ``compute_s`` that computes weight gradients (a backward's weight-gradient GEMMs and the
    embedding's gradient): what a zero-bubble schedule runs as its own W pass (docs/simulator.md, "Zero-bubble
    schedules"); zero where unknown (a measured pass)."""

    @property
    def total_s(self) -> float:
        """Wall time of the pass."""
        return (self.compute_s + self.attention_core_s + self.overhead_s + self.tp_comm_s + self.cp_comm_s
                + self.ep_comm_s + self.fsdp_comm_s + self.host_s)

    @property
    def comm_s(self) -> float:
        """Communication part of the pass."""
        return self.tp_comm_s + self.cp_comm_s + self.ep_comm_s + self.fsdp_comm_s

    def scaled(self, n: float) -> PassCost:
        """Component-wise multiple: ``n`` layers of the same kind (a count, may be fractional)."""
        return PassCost(compute_s=n * self.compute_s, attention_core_s=n * self.attention_core_s,
                        overhead_s=n * self.overhead_s, tp_comm_s=n * self.tp_comm_s, cp_comm_s=n * self.cp_comm_s,
                        ep_comm_s=n * self.ep_comm_s, fsdp_comm_s=n * self.fsdp_comm_s, host_s=n * self.host_s,
                        weight_grad_s=n * self.weight_grad_s)

    def plus(self, other: PassCost) -> PassCost:
        """Component-wise sum."""
        return PassCost(compute_s=self.compute_s + other.compute_s,
                        attention_core_s=self.attention_core_s + other.attention_core_s,
                        overhead_s=self.overhead_s + other.overhead_s, tp_comm_s=self.tp_comm_s + other.tp_comm_s,
                        cp_comm_s=self.cp_comm_s + other.cp_comm_s, ep_comm_s=self.ep_comm_s + other.ep_comm_s,
                        fsdp_comm_s=self.fsdp_comm_s + other.fsdp_comm_s, host_s=self.host_s + other.host_s,
                        weight_grad_s=self.weight_grad_s + other.weight_grad_s)


@dataclass(frozen=True, kw_only=True)
class LayerCost:
    """Forward, backward and recomputation cost (seconds, one micro-batch, one rank) of one kind of layer, and its
    parameters on one rank."""

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
    ep_alone_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of the expert token exchange a pass pays with nothing beside it to hide it
    (what its ``ep_comm_s`` would be without ``moe_a2a_overlap``): the combined 1F1B schedule's unpaired passes."""
    unrecomputed_backward: PassCost | None = None
    """The backward pass of a layer that block recomputation leaves out (FSDP's collectives beside its backward
    alone); ``None``: ``backward``."""
    ep_paired_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of the expert token exchange a pass pays under ``moe_a2a_overlap``'s combined
    1F1B schedule, paired with another micro-batch's pass, whatever the plan sets
    (:func:`~cfp_megatron.sim.terms.expert_dispatch.paired_exchange`; zero for a dense layer)."""

    @property
    def total_s(self) -> float:
        """Forward + backward + recomputation seconds."""
        return self.forward.total_s + self.backward.total_s + self.recompute.total_s


@dataclass(frozen=True, kw_only=True)
class LayerPasses:
    """A layer's forward and backward passes and parameters, which its recompute choice does not change, with what
    its recomputation is priced from (:func:`layer_passes`, :func:`with_recompute`)."""

    forward: PassCost
    """Forward pass."""
    backward: PassCost
    """Backward pass without recomputation."""
    params: float
    """Parameters of this layer held by one rank (:attr:`LayerCost.params`)."""
    expert_params: float
    """The routed experts' part of ``params``."""
    ep_alone_s: tuple[float, float]
    """:attr:`LayerCost.ep_alone_s`."""
    mlp_gemm_s: float
    """The MLP's (or the MoE block's) forward GEMM seconds."""
    moe_block: MoeCost | None
    """The MoE block's costs (``None`` for a dense layer)."""
    fsdp_sync_s: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) seconds of FSDP's collectives around the layer (:func:`~cfp_megatron.sim.terms.
    data_parallel.fsdp_sync`); the backward's exposed share is priced with the recomputation
    (:func:`with_recompute`), which runs inside the layer's backward."""
    fsdp_beside_experts: bool = False
    """Whether FSDP's collectives also hide behind the exposed expert exchange
    (:func:`~cfp_megatron.sim.terms.data_parallel.fsdp_beside_experts`)."""
    ep_paired_s: tuple[float, float] = (0.0, 0.0)
    """:attr:`LayerCost.ep_paired_s`."""
    op_sac_s: float | None = None
    """Selective recomputation's compute seconds where it is torchtitan's per-op policy
    (:attr:`~cfp_megatron.sim.options.SimOptions.torch_op_sac`, :func:`~cfp_megatron.sim.terms.recompute.
    op_sac_recompute_s`); ``None``: Megatron-Core's modules."""
    op_sac_tp_s: float = 0.0
    """The TP all-gathers torchtitan's per-op policy runs again with its recomputation: under sequence parallelism
    with DTensor's plan (:attr:`~cfp_megatron.sim.options.SimOptions.dtensor_tp`) each column-wise block's input
    is gathered anew, as its save list holds ``reduce_scatter_tensor`` and ``all_to_all_single`` but not
    ``all_gather_into_tensor`` (pytorch/torchtitan b5bcd76c, ``distributed/activation_checkpoint.py``,
    ``_get_default_save_ops``)."""


FUSED_SOFTMAX_SCORE_ELEMENTS = (4.0, 7.0)
"""(forward, backward) elements of HBM traffic per attention score of the unfused core with Megatron's fused softmax
kernel (``FusedScaleMaskSoftmax``, megatron/core/fusions/fused_softmax.py), dropout aside. Forward: the ``baddbmm``
writes the scores, the kernel reads them and writes the probabilities, the context ``bmm`` reads them. Backward: the
context ``bmm``'s input gradient is written and its value gradient reads the probabilities, the softmax's backward
(``scaled_*_softmax_backward``) reads the gradient and the saved probabilities and writes the scores' gradient, which
the query and key gradients' ``bmm`` each read."""
TORCH_SOFTMAX_SCORE_ELEMENTS = (16.0, 32.0)
"""The same without the fused kernel: PyTorch's fp32 softmax also copies the scores to fp32, masks them in place,
softmaxes and copies back (32 bytes a score in bf16); its backward taken as twice that, as the layer's other
element-wise kernels."""


UNFUSED_ROPE_PASSES = 10.0
"""Element passes over Q and K (their rotary channels) that Megatron-Core's unfused RoPE makes beyond the fused
kernel's one read and one write (``rope_utils._apply_rotary_pos_emb_bshd``, ``t * cos + _rotate_half(t) * sin``
then ``torch.cat((t, t_pass))``): ``_rotate_half``'s negation (half read, half written) and ``torch.cat`` (2), the
two multiplies (2 each), the add (3) and the final ``cat`` (2): 12 passes, less the fused kernel's 2."""
QK_NORM_PASSES = 2.0
"""Element passes over Q and K of the per-head query and key norms (``qk_layernorm``: Megatron-Core's
``q_layernorm`` / ``k_layernorm``, Transformer Engine's ``RMSNorm`` on ``[s, b, heads, head_dim]``): one kernel
that reads its input and writes its output."""


def qk_elementwise_elements(model: ModelSpec, options: SimOptions) -> float:
    """Forward element-wise elements per token over all heads (before the TP split) that the queries and keys add
    beyond the layer's fused kernels: the unfused RoPE's passes (:meth:`SimOptions.unfused_rope`,
    :data:`UNFUSED_ROPE_PASSES`; MLA: the rotary channels only) and the QK norms' (:data:`QK_NORM_PASSES`,
    standard attention; MLA's latent norms are not counted)."""
    if model.attention is AttentionKind.mla:
        rotated = (model.num_attention_heads + 1) * model.qk_pos_emb_head_dim
        normed = 0.0
    else:
        head_dim = model.kv_channels or model.hidden_size // model.num_attention_heads
        rotated = normed = (model.num_attention_heads + model.query_groups) * head_dim
    return (UNFUSED_ROPE_PASSES * rotated * options.unfused_rope(model)
            + QK_NORM_PASSES * normed * model.qk_layernorm)


def unfused_core_bytes(kernel: AttentionKernel, elem: int, *, dropout: bool) -> tuple[float, float, float, float]:
    """HBM bytes per attention score of the unfused core beyond its GEMMs' FLOPs: the softmax's (forward, backward)
    (:data:`FUSED_SOFTMAX_SCORE_ELEMENTS`, :data:`TORCH_SOFTMAX_SCORE_ELEMENTS`) and the attention dropout's
    (forward, backward). The dropout (``torch.nn.Dropout`` on the probabilities, ``attention_dropout > 0``:
    Megatron's ``CoreAttention``/``DotProductAttention``) is ``at::native_dropout``: it reads the probabilities and
    writes its output (``elem`` bytes each) and a one-byte mask; its backward reads the gradient and the mask and
    writes the input's gradient: ``2 elem + 1`` bytes each way."""
    forward, backward = (TORCH_SOFTMAX_SCORE_ELEMENTS if kernel is AttentionKernel.torch_softmax
                         else FUSED_SOFTMAX_SCORE_ELEMENTS)
    mask = 2.0 * elem + 1.0 if dropout else 0.0
    return forward * elem, backward * elem, mask, mask


def layer_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, options: SimOptions,
               *, moe: bool) -> LayerCost:
    """Cost of one dense (``moe=False``) or MoE layer of ``job`` under ``layout``: seconds of its forward, backward
    and recomputation for one micro-batch on one rank (``kernels`` times the kernels, ``costs`` the collectives),
    and its parameters on one rank."""
    return with_recompute(layer_passes(job, layout, kernels, costs, options, moe=moe), job, layout, kernels)


def with_recompute(passes: LayerPasses, job: JobSpec, layout: Layout, kernels: KernelModel) -> LayerCost:
    """The :class:`LayerCost` of ``passes`` under ``job``'s recompute choice (plans that differ only in it share
    their passes)."""
    parallel = job.parallel
    forward = passes.forward
    if parallel.recompute.value == "full":
        recompute = PassCost(compute_s=forward.compute_s, attention_core_s=forward.attention_core_s,
                             overhead_s=forward.overhead_s, tp_comm_s=forward.tp_comm_s, cp_comm_s=forward.cp_comm_s,
                             ep_comm_s=forward.ep_comm_s)
    elif parallel.recompute.value == "selective" and passes.op_sac_s is not None:
        recompute = PassCost(compute_s=passes.op_sac_s, tp_comm_s=passes.op_sac_tp_s)
    elif parallel.recompute.value == "selective":
        rec_compute, rec_core, rec_ep = selective_recompute(job, layout, kernels, moe_block=passes.moe_block,
                                                            mlp_gemm=passes.mlp_gemm_s,
                                                            core_fwd_s=forward.attention_core_s,
                                                            ep_fwd_s=forward.ep_comm_s)
        recompute = PassCost(compute_s=rec_compute, attention_core_s=rec_core, ep_comm_s=rec_ep)
    else:
        recompute = PassCost()
    backward = unrecomputed = passes.backward
    comm_s = passes.fsdp_sync_s[1]
    if comm_s > 0:
        # The backward's gather (prefetched) and the scatter run beside the layer's whole backward, its
        # recomputation included (the checkpointed layer recomputes inside its own backward).
        window_s = backward.compute_s + backward.attention_core_s + recompute.compute_s + recompute.attention_core_s
        beside_s = backward.ep_comm_s + recompute.ep_comm_s if passes.fsdp_beside_experts else 0.0
        backward = dataclasses.replace(backward, fsdp_comm_s=fsdp_exposed(comm_s, window_s, beside_s=beside_s))
        alone_s = fsdp_exposed(comm_s, unrecomputed.compute_s + unrecomputed.attention_core_s,
                               beside_s=unrecomputed.ep_comm_s if passes.fsdp_beside_experts else 0.0)
        unrecomputed = dataclasses.replace(unrecomputed, fsdp_comm_s=alone_s)
    block = parallel.recompute.value == "full" and parallel.recompute_method.value == "block"
    return LayerCost(forward=forward, backward=backward, recompute=recompute, params=passes.params,
                     expert_params=passes.expert_params, ep_alone_s=passes.ep_alone_s,
                     unrecomputed_backward=unrecomputed if block and comm_s > 0 else None,
                     ep_paired_s=passes.ep_paired_s)


def layer_passes(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, options: SimOptions,
                 *, moe: bool) -> LayerPasses:
    """The passes of :func:`layer_cost` without its recomputation (what every recompute choice shares)."""
    model, parallel = job.model, job.parallel
    dims = layout.dims
    tp, cp, sp = dims.tp, dims.cp, dims.sp
    micro_batch, seq_length = layout.micro_batch, layout.seq_length
    elem_bytes = kernels.elem
    hidden = model.hidden_size
    tokens = micro_batch * seq_length / cp
    gated = model.activation.gated

    # Attention.
    attn_params = attention_params(model)
    if model.attention is AttentionKind.mla:
        head_dims = model.num_attention_heads * (model.qk_head_dim + model.qk_pos_emb_head_dim + model.v_head_dim) / 2
        kv_width = model.kv_lora_rank + model.qk_pos_emb_head_dim
    else:
        head_dims = model.num_attention_heads * (model.kv_channels or hidden // model.num_attention_heads)
        kv_width = 2 * model.query_groups * (model.kv_channels or hidden // model.num_attention_heads)
    qkv_width = (attn_params - head_dims * hidden) / hidden  # QKV output columns (attention_params = QKV + projection)
    qkv_gemm = kernels.gemm(tokens, qkv_width / tp, hidden)
    attn_gemm = qkv_gemm + kernels.gemm(tokens, hidden, head_dims / tp)
    # Fused (flash) kernels skip the masked upper triangle of causal attention, and the tiles a sliding window does
    # not reach; unfused ones compute all of it.
    core_flops = 4.0 * micro_batch * (seq_length / cp) * seq_length * head_dims / tp * (
        causal_score_share(model, seq_length) if options.flash_attention else 1.0)
    # A CP rank's kernel runs on blocks of seq / (2 cp) queries, where it reaches less of its throughput.
    core_fwd = kernels.attention(core_flops) * chunk_slowdown(seq_length, cp)
    core_bwd = core_fwd * (2.5 if options.flash_attention else 2.0)
    if not options.flash_attention:  # the unfused core's softmax and dropout over the scores (unfused_core_bytes)
        scores = tokens * model.num_attention_heads * seq_length / tp
        softmax_fwd, softmax_bwd, dropout_fwd, dropout_bwd = unfused_core_bytes(options.attention, kernels.elem,
                                                                                 dropout=model.attention_dropout > 0)
        core_fwd += kernels.memory(scores * (softmax_fwd + dropout_fwd))
        core_bwd += kernels.memory(scores * (softmax_bwd + dropout_bwd))

    # Element-wise traffic per token, in elements: norms, residuals, bias/dropout (replicated unless SP),
    # rotary/bias on QKV and the MLP activation (split over TP).
    replicated_elements = 12.0 * hidden / (tp if sp else 1)
    split_elements = (qkv_width + qk_elementwise_elements(model, options)) / tp
    params = attn_params / tp + 4 * hidden
    expert_params = 0.0
    primepar: MlpCost | None = None
    moe_block = None
    unfused = (0.0, 0.0)  # (forward, backward) bytes per token of PyTorch element-wise ops beside fused kernels
    scalar_fwd = scalar_bwd = 0.0  # the experts' per-expert single-thread quantisation kernels (GPU floor)
    if moe:
        moe_block = moe_block_cost(job, layout, kernels, costs, imbalance=options.moe_routing_imbalance,
                                   torch_combine=options.torch_moe_combine,
                                   flex_unstated=options.flex_backend_unstated, grouped_gemm=options.grouped_gemm,
                                   torch_swiglu=options.torch_swiglu_experts(model),
                                   fused_router=options.fused_router(model),
                                   torch_gpt_oss=options.torch_gpt_oss_experts(model),
                                   torch_shared_expert=options.torch_swiglu_mlp(model))
        if options.te_grouped_experts:  # Transformer Engine's per-expert quantisation kernels
            scalar_fwd, scalar_bwd = expert_scalar_kernels_s(max(1, (model.num_experts or 1) // dims.ep),
                                                             kernels.format.expert_scalar_kernels)
        mlp_gemm = moe_block.gemm_s
        split_elements += moe_block.elements_per_token
        expert_params = moe_block.expert_params
        params += moe_block.params
        tp_ops = 2  # attention only; the experts talk over EP
    else:
        # The split GEMMs and the activation as sim.primepar_cost.megatron_mlp_cost has them (its all-reduce is
        # counted with attention's below).
        torch_mlp = options.torch_swiglu_mlp(model)  # torchtitan's FeedForward: w1 and w3 apart, SwiGLU unfused
        mlp_gemm = ffn_gemms(kernels, tokens, hidden, model.ffn_size / tp, gated, split_gate=torch_mlp)
        if torch_mlp:
            unfused = torch_swiglu_bytes(elem_bytes).per_row(model.ffn_size / tp, hidden)
        else:
            split_elements += mlp_activation_elements(tp=tp, ffn=model.ffn_size, gated=gated)
        params += mlp_params(model, model.ffn_size) / tp
        tp_ops = 4
        if parallel.mlp is MlpPartition.primepar and tp > 1:  # the MLP's own GEMMs and communication (primepar_cost)
            primepar = primepar_mlp_cost(kernels, costs, tp=tp, tp_per_node=layout.tp_per_node, tokens=tokens,
                                         hidden=hidden, ffn=model.ffn_size, gated=gated,
                                         overlap=not job.cluster.on_cpu, sp=sp)
            mlp_gemm = primepar.forward_compute_s
            tp_ops = 2  # attention's all-reduce per pass; the MLP adds its exposed ring and all-gather below
    elementwise = kernels.memory((replicated_elements + split_elements) * tokens * elem_bytes)
    # PyTorch ops beside the fused kernels (the experts' clamp, per-expert fc2 bias, torchtitan's dispatcher and
    # SwiGLU; torchtitan's FeedForward's SwiGLU), forward and backward; and the router's element-wise work, on the
    # attention side of moe_a2a_overlap's windows (below).
    router_fwd = router_bwd = 0.0
    if moe_block is not None:
        unfused = moe_block.unfused_bytes_per_token
        router_fwd, router_bwd = (kernels.memory(nbytes * tokens) for nbytes in moe_block.router_bytes_per_token)
    unfused_fwd, unfused_bwd = (kernels.memory(nbytes * tokens) for nbytes in unfused)

    # TP / SP collectives (the tensor-parallel term), less what the GEMMs hide under TP communication overlap.
    tp_pass = tp_pass_s(layout, costs, act_bytes=tokens * hidden * elem_bytes, tp_ops=tp_ops,
                        overlap=parallel.tp_comm_overlap,
                        covered_s=attn_gemm + (mlp_gemm if tp_ops == 4 else 0.0))

    # Context parallelism: the K/V exchange of the plan's CP type, what the attention core does not hide.
    cp_exchange = cp_cost(job, layout, costs, elem_bytes=elem_bytes, q_width=head_dims, kv_width=kv_width,
                          core_fwd_s=core_fwd, core_bwd_s=core_bwd)
    cp_fwd, cp_bwd = cp_exchange.forward_s, cp_exchange.backward_s

    # FSDP (the data-parallel term): gather the layer's weights before forward and backward, scatter its gradients
    # after backward.
    fsdp_fwd_comm = fsdp_bwd_comm = 0.0
    fwd_compute = attn_gemm + mlp_gemm + elementwise + unfused_fwd + router_fwd + scalar_fwd
    mlp_bwd_gemm = moe_block.gemm_bwd_s if moe_block is not None else 2.0 * mlp_gemm
    bwd_compute = 2.0 * attn_gemm + mlp_bwd_gemm + 2.0 * elementwise + unfused_bwd + router_bwd + scalar_bwd
    if job.parallel.fsdp is not FsdpStrategy.none:
        fsdp_fwd_comm, fsdp_bwd_comm = fsdp_sync(job, layout, costs, params=params, elem_bytes=elem_bytes,
                                                 expert_params=expert_params, torch_fsdp=options.torch_fsdp)

    ep_fwd = ep_bwd = 0.0
    ep_alone = ep_paired = (0.0, 0.0)
    if moe_block is not None:
        ep_alone = (moe_block.metadata_s + moe_block.dispatch_s, moe_block.dispatch_s)
        # The experts' share of the layer's computation (their GEMMs and element-wise traffic); the rest is the
        # attention side (attention, norms, router): the two windows moe_a2a_overlap hides the exchange behind.
        moe_elementwise = kernels.memory(moe_block.elements_per_token * tokens * elem_bytes)
        mlp_fwd = mlp_gemm + moe_elementwise + unfused_fwd + scalar_fwd
        mlp_bwd = mlp_bwd_gemm + 2.0 * moe_elementwise + unfused_bwd + scalar_bwd
        windows = {"attention_s": (fwd_compute + core_fwd - mlp_fwd, bwd_compute + core_bwd - mlp_bwd),
                   "experts_s": (mlp_fwd, mlp_bwd)}
        ep_fwd, ep_bwd = expert_comm(job, moe_block, **windows)
        ep_paired = paired_exchange(moe_block, **windows)

    if primepar is not None:
        bwd_compute += primepar.backward_compute_s - 2.0 * primepar.forward_compute_s
        tp_fwd, tp_bwd = tp_pass + primepar.forward_comm_s, tp_pass + primepar.backward_comm_s
    elif options.async_tp_backward and not parallel.tp_comm_overlap:
        column_gemms = (qkv_gemm,) if tp_ops == 2 else (
            qkv_gemm, kernels.gemm(tokens, model.ffn_size / tp * (2 if gated else 1), hidden))
        tp_fwd = tp_pass
        tp_bwd = tp_backward_async_s(layout, costs, act_bytes=tokens * hidden * elem_bytes,
                                     column_gemms_s=column_gemms)
    else:
        tp_fwd = tp_bwd = tp_pass

    # Without gradient-accumulation fusion each micro-batch's weight gradients are added to the step's by a kernel
    # of their own (docs/simulator.md, "Weight-gradient accumulation").
    accumulate_s = grad_accumulation_s(job, layout, kernels, options, params)
    bwd_compute += accumulate_s
    # FSDP's forward gather beside the layer's forward (the backward's: with_recompute).
    beside_experts = moe_block is not None and fsdp_beside_experts(job, layout)
    fsdp_fwd = fsdp_exposed(fsdp_fwd_comm, fwd_compute + core_fwd, beside_s=ep_fwd if beside_experts else 0.0)
    overhead = kernels.eff.layer_overhead_s
    forward = PassCost(compute_s=fwd_compute, attention_core_s=core_fwd, overhead_s=overhead, tp_comm_s=tp_fwd,
                       cp_comm_s=cp_fwd, ep_comm_s=ep_fwd, fsdp_comm_s=fsdp_fwd)
    # the weight-gradient GEMMs: as many FLOPs as the forward's (half of the backward's GEMMs)
    backward = PassCost(compute_s=bwd_compute, attention_core_s=core_bwd, overhead_s=overhead, tp_comm_s=tp_bwd,
                        cp_comm_s=cp_bwd, ep_comm_s=ep_bwd, weight_grad_s=attn_gemm + mlp_bwd_gemm / 2 + accumulate_s)
    # torchtitan's per-op policy re-runs every element-wise op, its dispatcher's and the experts' unfused ones too.
    op_sac_s = (op_sac_recompute_s(job, layout, kernels, moe_block=moe_block,
                                   elementwise_s=elementwise + unfused_fwd + router_fwd)
                if options.torch_op_sac else None)
    op_sac_tp_s = ((tp_ops // 2) * costs.seconds(Collective.all_gather, tokens * hidden * elem_bytes, tp,
                                                  layout.tp_per_node)
                   if options.torch_op_sac and options.dtensor_tp and tp > 1 and sp else 0.0)
    return LayerPasses(forward=forward, backward=backward, params=params, expert_params=expert_params,
                       ep_alone_s=ep_alone, ep_paired_s=ep_paired, mlp_gemm_s=mlp_gemm, moe_block=moe_block,
                       fsdp_sync_s=(fsdp_fwd_comm, fsdp_bwd_comm), fsdp_beside_experts=beside_experts,
                       op_sac_s=op_sac_s, op_sac_tp_s=op_sac_tp_s)


def grad_accumulation_s(job: JobSpec, layout: Layout, kernels: KernelModel, options: SimOptions,
                        params: float) -> float:
    """Seconds per micro-batch that adding the weight gradients of ``params`` weights (on one rank) to the step's
    takes inside their backward, beyond their GEMMs (:func:`~cfp_megatron.sim.grad_accumulation.accumulation_bytes`
    a weight at HBM speed); zero where the run adds them after the whole backward
    (:attr:`~cfp_megatron.sim.options.WeightGradAccumulation.after_backward`: the data-parallel term's)."""
    how = accumulation_mode(job, options)
    if how.after_backward:
        return 0.0
    return kernels.memory(params * accumulation_bytes(job, how, elem=kernels.elem,
                                                      microbatches=layout.dims.num_microbatches))


CROSS_ENTROPY_FP32_FORWARD_BYTES = 32.0
"""HBM bytes per logit of Megatron-Core's unfused ``VocabParallelCrossEntropy`` forward on its fp32 copy of the
logits (megatron/core/tensor_parallel/cross_entropy.py, 0.16.1): the max over the vocabulary reads it (4), the
subtraction of the max (in place) reads and writes it (8), ``exp`` in place (8), the sum reads it (4), and the
division by the sum that leaves the softmax kept for the backward reads and writes it (8). The predicted logit's
gather, the log and the TP all-reduces touch one number per token."""
CROSS_ENTROPY_FP32_BACKWARD_BYTES = 8.0
"""HBM bytes per logit of its backward on the saved fp32 softmax: the one-hot subtraction touches one element per
token, then ``grad_input.mul_(grad_output)`` reads and writes every logit (8)."""


def cross_entropy_bytes(elem: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes per logit of the vocabulary-parallel cross-entropy when the logits come in
    ``elem``-byte elements: the fp32 passes (:data:`CROSS_ENTROPY_FP32_FORWARD_BYTES`,
    :data:`CROSS_ENTROPY_FP32_BACKWARD_BYTES`) plus, for bf16/fp16 logits, ``calculate_logits_max``'s ``.float()``
    (read ``elem``, write 4) and, in the backward, its cast of the fp32 gradient back (read 4, write ``elem``)."""
    cast = elem + 4.0 if elem < 4 else 0.0
    return CROSS_ENTROPY_FP32_FORWARD_BYTES + cast, CROSS_ENTROPY_FP32_BACKWARD_BYTES + cast


def output_layer_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> tuple[
        PassCost, PassCost]:
    """(forward, backward) seconds of the final norm, the vocabulary-parallel logits and the cross-entropy loss for
    one micro-batch on one rank (the loss' traffic: :func:`cross_entropy_bytes`)."""
    model, dims = job.model, layout.dims
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    vocab_shard = model.padded_vocab_size / dims.tp
    # Megatron-Core's output layer is its own ColumnParallelLinear, not Transformer Engine's: bf16 under FP8/FP4.
    gemm_s = kernels.gemm(tokens, vocab_shard, model.hidden_size, low_precision=False)
    loss_fwd_bytes, loss_bwd_bytes = cross_entropy_bytes(kernels.elem)
    loss_fwd_s = kernels.memory(tokens * vocab_shard * loss_fwd_bytes)
    loss_bwd_s = kernels.memory(tokens * vocab_shard * loss_bwd_bytes)
    gather_s = 0.0
    if dims.tp > 1 and dims.sp:
        gather_s = costs.seconds(Collective.all_gather, tokens * model.hidden_size * kernels.elem, dims.tp,
                                 layout.tp_per_node)
    return (PassCost(compute_s=gemm_s + loss_fwd_s, tp_comm_s=gather_s),
            PassCost(compute_s=2 * gemm_s + loss_bwd_s, tp_comm_s=gather_s, weight_grad_s=gemm_s))


def embedding_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> tuple[
        PassCost, PassCost]:
    """(forward, backward) seconds of the vocabulary-parallel input embedding for one micro-batch on one rank. Its
    backward also writes the weight gradient of the whole vocabulary shard (PyTorch's ``embedding_dense_backward``
    zero-fills a dense ``vocab / TP x hidden`` gradient before it adds the tokens' rows) and Megatron's gradient hook
    adds it into the gradient buffer (``main_grad.add_(grad)``): every micro-batch (docs/simulator.md,
    "Pipeline stages")."""
    model, dims = job.model, layout.dims
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    hidden_bytes = tokens * model.hidden_size * kernels.elem
    reduce_s = 0.0
    if dims.tp > 1:
        collective = Collective.reduce_scatter if dims.sp else Collective.all_reduce
        reduce_s = costs.seconds(collective, hidden_bytes, dims.tp, layout.tp_per_node)
    # the dense gradient written (zero-filled) and read once, the buffer read and written once
    weight_grad_bytes = model.padded_vocab_size / dims.tp * model.hidden_size * (
        2 * kernels.elem + 2 * grad_element_bytes(job))
    weight_grad_s = kernels.memory(weight_grad_bytes)
    return PassCost(compute_s=kernels.memory(3 * hidden_bytes), tp_comm_s=reduce_s), PassCost(
        compute_s=kernels.memory(3 * hidden_bytes) + kernels.memory(hidden_bytes * 2) + weight_grad_s,
        weight_grad_s=weight_grad_s)


def mtp_projection_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> tuple[
        PassCost, PassCost, float]:
    """(forward, backward) seconds of what one multi-token-prediction layer runs besides its decoder layer, for one
    micro-batch on one rank, and those parts' parameters on one rank: the embedding of the shifted tokens
    (:func:`embedding_cost`), the two norms of it and of the hidden state and the one after the layer, the
    projection of their concatenation (``2h -> h``, column-parallel, then gathered over TP: Megatron-Core's
    ``MultiTokenPredictionLayer``)."""
    model, dims = job.model, layout.dims
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    hidden = model.hidden_size
    hidden_bytes = tokens * hidden * kernels.elem
    embed_fwd, embed_bwd = embedding_cost(job, layout, kernels, costs)
    proj_s = kernels.gemm(tokens, hidden / dims.tp, 2 * hidden)
    norms_s = kernels.memory(3 * 2 * hidden_bytes)  # three norms, each reading and writing the hidden state
    gather_s = (costs.seconds(Collective.all_gather, hidden_bytes, dims.tp, layout.tp_per_node) if dims.tp > 1
                else 0.0)
    params = 2 * hidden * hidden / dims.tp + 3 * hidden
    return (embed_fwd.plus(PassCost(compute_s=proj_s + norms_s, tp_comm_s=gather_s)),
            embed_bwd.plus(PassCost(compute_s=2 * proj_s + 2 * norms_s, tp_comm_s=gather_s)), params)
