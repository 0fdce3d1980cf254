"""The expert-dispatch term: seconds and parameters of one MoE block (router, token dispatch, routed experts,
shared expert) for one micro-batch on one rank, as Megatron-Core runs it, the part of its token exchange the step
waits for, and the term's lane and bound. How each part is modelled and where its figures come from:
docs/simulator.md, "moe_cost.py".
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from cfp_megatron.base.config import FlexBackend, JobSpec, TokenDispatcher
from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.flops import mlp_params
from cfp_megatron.cluster.costs import CollectiveCosts, Link
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import Stage
from cfp_megatron.sim.primepar_cost import ffn_gemms, mlp_activation_elements
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Overlaps, Placement
from cfp_megatron.sim.terms.overlap import COMM_SM_SHARE, overlapped

if TYPE_CHECKING:
    from cfp_megatron.sim.layer_cost import LayerCost

RATES_FILE = Path(__file__).resolve().parent.parent / "dispatch_rates.yaml"
"""The dispatchers' measured shares and rates, with their sources."""


class DispatchRatesError(CfpError, ValueError):
    """A rates file that does not hold what :func:`dispatch_rates` reads; the message names the file and the key."""


@dataclass(frozen=True, kw_only=True)
class DispatchRates:
    """What the token dispatchers' kernels reach on their links (``dispatch_rates.yaml``, with sources)."""

    deepep_intra_share: float
    """Share of the nominal per-direction NVLink bandwidth DeepEP's normal (training) kernels reach inside a node."""
    deepep_inter_share: float
    """Share of the NIC bandwidth DeepEP's normal kernels reach across nodes, counted on de-duplicated tokens (one
    copy per destination node)."""
    deepep_nvlink_gbps: tuple[tuple[int, float, float], ...]
    """DeepEP's measured rates inside one NVLink domain, per GPU and direction, by ascending group size: (ranks of
    the EP group in the domain, dispatch GB/s, combine GB/s). They cap :attr:`deepep_intra_share` of the link."""
    hybridep_nvlink_gbps: tuple[tuple[int, float, float], ...]
    """HybridEP's, the same way."""
    nccl_nvlink_share: float
    """Share of the nominal per-direction NVLink bandwidth NCCL's all-to-all reaches inside an NVLink domain (its bus
    bandwidth over the line rate; the all-to-all has no NVLink SHARP path)."""


@functools.cache
def dispatch_rates() -> DispatchRates:
    """:class:`DispatchRates` from :data:`RATES_FILE`."""
    data = yaml.safe_load(RATES_FILE.read_text())
    tables = ("deepep_nvlink", "hybridep_nvlink")
    try:
        rows = {name: tuple((int(row["ranks"]), float(row["dispatch_gbps"]), float(row["combine_gbps"]))
                            for row in data[name]) for name in tables}
        nccl = data["nccl_nvlink"]
        rates = DispatchRates(deepep_intra_share=float(data["deepep_intra_share"]),
                              deepep_inter_share=float(data["deepep_inter_share"]),
                              deepep_nvlink_gbps=rows["deepep_nvlink"], hybridep_nvlink_gbps=rows["hybridep_nvlink"],
                              nccl_nvlink_share=float(nccl["bus_gbps"]) / float(nccl["line_gbps"]))
    except (KeyError, TypeError, ValueError) as err:
        raise DispatchRatesError(f"{RATES_FILE}: missing or malformed key ({err!r}); fix: restore the file's "
                                 "deepep_intra_share, deepep_inter_share, deepep_nvlink and hybridep_nvlink rows "
                                 "(ranks, dispatch_gbps, combine_gbps) and nccl_nvlink (bus_gbps, line_gbps)") from err
    for name in tables:
        ranks = [row[0] for row in rows[name]]
        if not ranks or ranks != sorted(ranks):
            raise DispatchRatesError(f"{RATES_FILE}: {name} has rows at ranks {ranks}; fix: give at least one row, "
                                     "by ascending ranks")
    return rates


@dataclass(frozen=True, kw_only=True)
class FlexKernels:
    """How one backend of the flex dispatcher runs, as the term prices it (docs/simulator.md, "moe_cost.py")."""

    nvlink_gbps: tuple[tuple[int, float, float], ...]
    """Its measured NVLink rates (:class:`DispatchRates`), which cap :attr:`DispatchRates.deepep_intra_share` of
    the link."""
    host_nvlink: bool
    """Whether its NVLink part spans one host only (DeepEP's CUDA IPC buffers), the other ranks of an NVLink domain
    reached over RDMA; else the whole NVLink domain (multi-node NVLink)."""
    gathers_routing_map: bool
    """Whether each forward dispatch first all-gathers the routing map over the expert TP x EP group
    (HybridEP's metadata preprocessing, ``HybridEPBuffer.dispatch_with_permute``: one bool per token and expert)."""
    pads_for_quantization: bool
    """Whether the dispatch kernel pads each expert's rows to the FP8/FP4 alignment (no ``Fp8Padding`` copies)."""


def flex_kernels(backend: FlexBackend | None) -> FlexKernels:
    """The :class:`FlexKernels` of ``backend`` as Megatron-Core 0.16.1 runs it (``_DeepepManager``,
    ``_HybridEPManager``); ``None``: a flex dispatcher whose backend its source does not state
    (:attr:`~cfp_megatron.sim.options.SimOptions.flex_backend_unstated`): DeepEP's rates and permutation over the
    whole NVLink domain, padded in the kernel."""
    rates = dispatch_rates()
    if backend is FlexBackend.hybridep:
        return FlexKernels(nvlink_gbps=rates.hybridep_nvlink_gbps, host_nvlink=False, gathers_routing_map=True,
                           pads_for_quantization=True)
    return FlexKernels(nvlink_gbps=rates.deepep_nvlink_gbps, host_nvlink=backend is FlexBackend.deepep,
                       gathers_routing_map=False, pads_for_quantization=backend is None)


def all_to_all_costs(costs: CollectiveCosts, job: JobSpec) -> CollectiveCosts:
    """``costs`` with the NVLink share of the modelled all-to-all capped at
    :attr:`DispatchRates.nccl_nvlink_share` of the cluster's nominal NVLink bandwidth (a GPU cluster stating it;
    measured collective fits still win)."""
    nominal = job.cluster.intra_node_bandwidth_gbps
    if job.cluster.on_cpu or not nominal:
        return costs
    ceiling = nominal * 1e9 * dispatch_rates().nccl_nvlink_share
    if costs.intra.bandwidth_bytes_per_s <= ceiling:
        return costs
    return costs.with_intra(Link(latency_s=costs.intra.latency_s, bandwidth_bytes_per_s=ceiling))


@dataclass(frozen=True, kw_only=True)
class MoeCost:
    """One MoE block's work for one micro-batch on one rank (forward pass; the layer cost derives the backward)."""

    gemm_s: float
    """Forward GEMM seconds: routed experts (one grouped GEMM per linear, :meth:`KernelModel.grouped_gemm`), the
    router, the shared expert."""
    gemm_bwd_s: float = 0.0
    """Backward GEMM seconds of the same: each grouped linear's data gradient and weight gradient (the latter a
    reduction over the expert's rows, tiled over its weight, accumulated into fp32 main gradients under
    Megatron-Core, written in bf16 under torchtitan), twice the forward for the router and shared expert."""
    shared_gemm_s: float
    """Of ``gemm_s``, the shared expert's (what ``moe_shared_expert_overlap`` runs beside the dispatch)."""
    elements_per_token: float
    """Element-wise HBM traffic per token of the micro-batch and pass on this rank, in elements: the router's score
    function, top-k and auxiliary loss (unfused; fused: ``router_bytes_per_token``), the permutations
    (:data:`PERMUTE_ROW_PASSES`), the experts' and shared expert's activations."""
    activation_elements_per_token: float = 0.0
    """Of ``elements_per_token``, the routed experts' fused activation function's (what ``moe_act`` recomputes;
    torchtitan's unfused one is in ``unfused_bytes_per_token``)."""
    shared_elements_per_token: float = 0.0
    """Of ``elements_per_token``, the shared expert's activation's (recomputed with ``shared_experts``)."""
    unfused_bytes_per_token: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) HBM bytes per token of the micro-batch on this rank of the routed experts' PyTorch
    element-wise ops beside their fused kernels, whose backward is not twice their forward as ``elements_per_token``
    takes it: the clamp before the activation (:func:`clamp_bytes`), the fc2 bias added per expert
    (:func:`expert_bias_bytes`), torchtitan's dispatcher's gathers, scatters and fp32 combine
    (:func:`torch_dispatch_bytes`) and its routed and shared experts' unfused SwiGLU (:func:`torch_swiglu_bytes`)."""
    router_bytes_per_token: tuple[float, float] = (0.0, 0.0)
    """(forward, backward) HBM bytes per token of the micro-batch of the router's element-wise work on the tokens
    this rank scores: Transformer Engine's fused kernels (:func:`fused_router_bytes`) or Megatron-Core's PyTorch ops
    (:func:`unfused_router_bytes`); what ``moe`` recomputation repeats of it: the forward's."""
    recomputed_bytes_per_token: float = 0.0
    """Of the forward's ``unfused_bytes_per_token``, the clamp's or torchtitan's SwiGLU's: what ``moe_act``
    recomputes with the activation (the fc2 bias is added after fc2, outside it)."""
    dispatch_s: float
    """Communication of one pass (dispatch and combine), seconds, before any overlap."""
    combine_s: float = 0.0
    """Of ``dispatch_s``, the combine's part (the outputs' way back; in the backward pass, the gradient's way out):
    what ``moe_a2a_overlap`` hides behind attention, the dispatch's part behind the experts."""
    metadata_s: float = 0.0
    """The forward pass's exchange before the dispatch, which the dispatch waits for (no overlap): the alltoall
    dispatcher's all-gather of one token count per expert over the expert TP x EP group (with EP or expert TP), or
    HybridEP's all-gather of the routing map over it."""
    params: float
    """Parameters on one rank: local experts, shared expert, router."""
    expert_params: float
    """Of ``params``, the routed experts' (reduced over the expert-data-parallel group)."""


FP32_BYTES = 4.0
"""Bytes of an fp32 element: the router's logits, scores and probabilities under ``moe_router_dtype='fp32'``."""
UNFUSED_TOPK_PASSES = (6.0, 3.0)
"""(forward, backward) passes per token and expert over the router's ``[tokens, experts]`` tensors in its dtype
(:func:`router_bytes`) of Megatron-Core 0.16.1's unfused ``topk_routing_with_score_function`` (transformer/moe/
moe_utils.py, softmax scores): forward, ``torch.topk`` reads the logits (1), ``zeros_like(logits).scatter`` writes
the zeros and copies them into the dense probabilities (3), and the routing map's ``zeros_like(logits).int()``
writes zeros and reads them (2); backward, the top-k's gradient is a ``new_zeros`` filled by ``scatter`` (3). The
top-k's own ``[tokens, topk]`` tensors are left out."""
UNFUSED_TOPK_MAP_BYTES = (17.0, 0.0)
"""(forward, backward) bytes per token and expert of the same routing map: the int32 copy written (4), its
``scatter`` (read 4, written 4) and ``.bool()`` (read 4, written 1)."""
UNFUSED_AUX_LOSS_PASSES = (2.0, 3.0)
"""(forward, backward) passes per token and expert in the router's dtype the load-balancing loss adds, unfused
(``moe_aux_loss_coeff > 0``: ``compute_routing_scores_for_aux_loss`` and ``switch_load_balancing_loss_func``):
forward, its own map's ``zeros_like(logits).int()`` (2); backward, autograd's add of its gradient to the top-k's
(read 2, written 1)."""
UNFUSED_AUX_LOSS_FP32_PASSES = (4.0, 2.0)
"""The same loss' passes over its fp32 scores (``torch.softmax(logits, dtype=torch.float32)``): forward, the softmax
(read and written, 2), ``torch.topk`` (1) and the scores' sum over tokens (1); backward, the softmax's backward
reads its output and writes the gradient (2; the incoming gradient is the sum's, broadcast). Where the router's
dtype is not fp32, the cast to fp32 adds a read in its dtype and an fp32 write, and its backward the reverse."""
UNFUSED_AUX_LOSS_MAP_BYTES = (18.0, 0.0)
"""(forward, backward) bytes per token and expert of that loss' routing map: as :data:`UNFUSED_TOPK_MAP_BYTES` (17)
and its sum over tokens (1)."""
FUSED_TOPK_PASSES = (3.0, 3.0)
"""(forward, backward) passes per token and expert over the router's ``[tokens, experts]`` tensors (in the
router's dtype, :func:`router_bytes`) of Transformer Engine's fused top-k (``fused_topk_with_score_function``,
Megatron-Core's ``moe_router_fusion``), counted from its kernels (transformer_engine/common/fused_router/
fused_topk_with_score_function.cu, the same global accesses at v2.7, v2.9 and v2.12): the forward reads the logits
once and writes the dense probabilities and the score function's output it keeps for the backward
(``intermediate_output``), each row zeroed in the lines its top-k entries then fill (3); the backward reads the
probabilities' gradient and that output and writes the logits' gradient (3)."""
FUSED_TOPK_MAP_BYTES = (1.0, 1.0)
"""(forward, backward) bytes per token and expert of the fused top-k's boolean routing map: written by its forward,
read by its backward (fused_topk_with_score_function.cu)."""
FUSED_AUX_LOSS_PASSES = (4.0, 7.0)
"""(forward, backward) passes per token and expert the load-balancing loss adds under ``moe_router_fusion``
(``moe_aux_loss_coeff > 0``), counted from Transformer Engine's kernels as :data:`FUSED_TOPK_PASSES`: forward,
``fused_compute_score_for_moe_aux_loss`` reads the logits and writes the scores and its intermediate output
(fused_score_for_moe_aux_loss.cu, 3) and ``fused_moe_aux_loss`` reads the scores (fused_moe_aux_loss.cu, 1);
backward, the loss's kernel writes the scores' gradient (1), the scores' kernel reads it and its intermediate output
and writes the logits' gradient (3), and autograd adds that to the top-k's (read 2, written 1)."""
FUSED_AUX_LOSS_MAP_BYTES = (2.0, 0.0)
"""(forward, backward) bytes per token and expert of the loss's own routing map: written by
``fused_compute_score_for_moe_aux_loss`` and read by ``routing_map.sum(dim=0)`` (Megatron-Core's
``get_tokens_per_expert_and_token_count``, transformer/moe/moe_utils.py); its backward has none."""
CLAMP_FORWARD_PASSES = 4.0
"""Passes over fc1's output (``[rows, 2 ffn]`` in the compute precision) of the clamp Megatron-Core runs in PyTorch
before the fused quick-GEGLU kernel (``weighted_bias_quick_geglu_impl``, megatron/core/fusions/fused_bias_geglu.py):
``x_glu.clamp(max=v)`` and ``x_linear.clamp(-v, v)`` each read and write their half (1 + 1), ``torch.cat`` reads
both and writes the whole (2)."""
CLAMP_BACKWARD_PASSES = 5.5
"""The same in its backward (autograd's ``clamp_backward``: a comparison of the saved half, ``where(mask, grad,
0)``): the gate half's ``<=`` reads it (0.5) and its ``where`` reads the gradient and writes its own (1); the
linear half's ``>=`` and ``<=`` read it (1) and its ``where`` reads and writes (1); the gradient of ``chunk`` is a
``cat`` of the halves' gradients (2)."""
CLAMP_MASK_BYTES = 4.0
"""Bytes per element of fc1's output of the clamp's boolean masks in its backward (one byte per element of a half
each comparison writes and each read back): the gate half's mask written and read (1), the linear half's two
written, combined by ``logical_and_`` (read 2, written 1) and read by its ``where`` (3)."""
MAIN_GRAD_BYTES = 8.0
"""Bytes per weight element an expert's weight-gradient GEMM moves into its gradient: Megatron-Core's
``gradient_accumulation_fusion`` (Megatron-LM's default, on with Transformer Engine: ``TEGroupedLinear`` passes it as
``fuse_wgrad_accumulation``) accumulates into the fp32 ``main_grad``, a read and a write of 4 bytes."""


@dataclass(frozen=True, kw_only=True)
class TorchDispatchBytes:
    """(forward, backward) HBM bytes per hidden element of torchtitan's ``AllToAllTokenDispatcher``
    (``models/common/token_dispatcher.py``) around its experts, counted op by op (:func:`torch_dispatch_bytes`)."""

    sent: tuple[float, float]
    """Per routed copy of this rank's tokens: ``_local_reorder``'s gather (``x_TD[indices]``) and the combine's
    score multiply in fp32 and ``deterministic_scatter_add``."""
    received: tuple[float, float]
    """Per routed copy this rank's experts receive, with EP only: ``_permute``'s gather and ``_unpermute``'s
    ``index_put_``."""
    token: tuple[float, float]
    """Per token entering the block: the combine's ``zeros_like`` output and the out-of-place ``scatter_add``'s copy
    of it (forward); the reorder gather's zeroed input gradient (backward)."""


def torch_dispatch_bytes(elem: float) -> TorchDispatchBytes:
    """torchtitan's dispatcher's bytes per hidden element with ``elem``-byte activations (fp32 scores, ``f``):
    forward, a gather reads and writes a row (2 elem), the casts read one dtype and write the other (elem + f), the
    multiply reads and writes fp32 (2 f; the scores are a column), the scatter-add reads its source row and
    reads and writes the output row it adds into (3 elem); backward, the scatter-add's gradient is a gather
    (2 elem), each cast's a cast back (elem + f), the multiply's the gradient times the score (2 f) and the score's
    gradient (the gradient times the saved fp32 input, then its row sum: 4 f), a gather's an ``index_put_`` with
    ``accumulate`` into a zeroed buffer (the source row read, the destination row read and written: 3 elem, the
    buffer's zeroing per row of it)."""
    f = FP32_BYTES
    return TorchDispatchBytes(sent=(2 * elem + (elem + f) + 2 * f + (f + elem) + 3 * elem,
                                    2 * elem + (elem + f) + 2 * f + 4 * f + (f + elem) + 3 * elem),
                              received=(2 * elem + 2 * elem, 2 * elem + (elem + 3 * elem)),
                              token=(elem + 2 * elem, elem))


@dataclass(frozen=True, kw_only=True)
class TorchSwigluBytes:
    """(forward, backward) HBM bytes of torchtitan's ``GroupedExperts`` around their grouped GEMMs
    (``models/common/moe.py``) and of its ``FeedForward`` around its linears, counted op by op
    (:func:`torch_swiglu_bytes`)."""

    ffn: tuple[float, float]
    """Per element of the experts' FFN width (``[rows, ffn]``): ``silu`` and the multiply, and their gradients."""
    hidden: tuple[float, float]
    """Per element of the experts' input (``[rows, hidden]``): the sum of the input's two gradients (backward)."""

    def per_row(self, ffn: float, hidden: float) -> tuple[float, float]:
        """(forward, backward) bytes a row of ``ffn`` FFN elements (this rank's share) and ``hidden`` input
        elements."""
        return self.ffn[0] * ffn + self.hidden[0] * hidden, self.ffn[1] * ffn + self.hidden[1] * hidden


def torch_swiglu_bytes(elem: float) -> TorchSwigluBytes:
    """torchtitan's ``h = F.silu(x @ w1) * (x @ w3)`` with ``elem``-byte activations (pytorch/torchtitan b5bcd76c,
    ``GroupedExperts.forward``, w1 and w3 two ``torch._grouped_mm``; ``models/common/feed_forward.py``
    ``FeedForward.forward``, ``w2(F.silu(w1(x)) * w3(x))``, w1 and w3 two linears, the dense MLP's and the shared
    experts'): forward, ``silu`` reads and writes (2 elem) and the multiply reads two and writes one (3 elem);
    backward, the multiply's two gradients (3 elem each) and ``silu_backward`` (reads the gradient and the saved
    input, writes: 3 elem), and autograd's ``add`` of the two GEMMs' gradients of ``x`` (3 elem a hidden element).
    Megatron-Core's fused SwiGLU is 3 elem and twice that (:func:`~cfp_megatron.sim.primepar_cost.
    mlp_activation_elements`)."""
    return TorchSwigluBytes(ffn=(5.0 * elem, 9.0 * elem), hidden=(0.0, 3.0 * elem))


def torch_gpt_oss_bytes(elem: float) -> TorchSwigluBytes:
    """torchtitan's GPT-OSS experts around their two grouped GEMMs with ``elem``-byte activations (pytorch/torchtitan
    b5bcd76c, ``models/gpt_oss/moe.py``, ``GptOssGroupedExperts.forward`` and ``swiglu``; counted op by op), per
    element of the FFN width (half mlp1's interleaved ``[rows, 2 ffn]``) and of the hidden size: forward, mlp1's
    bias expanded per row (``repeat_interleave``'s ``index_select``, 2 elem) and added (6), the two strided clamps
    (2 each), ``alpha * x``, ``sigmoid`` (2 each), the multiply (3) and ``addcmul`` (4): 23 elem; mlp2's bias
    expanded and added, 4 a hidden element. Backward, autograd's gradients of the same (``addcmul``'s and the
    multiplies', ``sigmoid_backward``, the gate's two sums, the clamps' ``where``, ``slice_backward``'s two
    zero-filled ``[rows, 2 ffn]`` tensors and their sum, mlp1's bias gradient's ``index_add``): 48 elem and 8
    bytes of boolean masks; mlp2's bias gradient reads the rows' gradient once, 1 a hidden element. Megatron-Core's
    fused quick GEGLU with its clamp (:func:`clamp_bytes`) and fc2 bias (:func:`expert_bias_bytes`) in its place."""
    return TorchSwigluBytes(ffn=(23.0 * elem, 48.0 * elem + 8.0), hidden=(4.0 * elem, 1.0 * elem))


PERMUTE_ROW_PASSES = 2.0
"""HBM passes over one hidden-size row per routed copy of one permutation (a gather reads the token's row and
writes the copy's; the unpermutation reads the copy's row and accumulates it into the token's)."""
COUNT_BYTES = 8.0
"""Bytes of one token count (int64) in the dispatcher's count exchange."""
ROUTING_MAP_BYTES = 1.0
"""Bytes of one routing-map entry (``torch.bool``): the router writes one per token and expert, HybridEP all-gathers
them."""


def router_bytes(job: JobSpec, elem: float) -> float:
    """Bytes of one of the router's scores: fp32 with :attr:`~cfp_megatron.base.config.ModelSpec.moe_router_fp32`,
    else the compute precision's ``elem`` (Megatron-Core's ``TopKRouter.gating`` computes the logits in
    ``moe_router_dtype``, or in the input's dtype where it is unset, and ``topk_routing_with_score_function`` keeps
    their dtype: ``softmax(..., dtype=torch.float32).type_as(logits)``)."""
    return FP32_BYTES if job.model.moe_router_fp32 else float(elem)


def fused_router_bytes(job: JobSpec, elem: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token and expert of the router's element-wise work under
    ``moe_router_fusion`` (:attr:`~cfp_megatron.base.config.ModelSpec.moe_router_fusion`), in the router's dtype
    (:func:`router_bytes`) with ``elem``-byte activations: the fused top-k (:data:`FUSED_TOPK_PASSES`,
    :data:`FUSED_TOPK_MAP_BYTES`) and, with the load-balancing loss, its fused kernels
    (:data:`FUSED_AUX_LOSS_PASSES`, :data:`FUSED_AUX_LOSS_MAP_BYTES`)."""
    score = router_bytes(job, elem)
    aux = 1.0 if job.model.moe_aux_loss_coeff > 0 else 0.0

    def one(i: int) -> float:
        return (FUSED_TOPK_PASSES[i] * score + FUSED_TOPK_MAP_BYTES[i]
                + aux * (FUSED_AUX_LOSS_PASSES[i] * score + FUSED_AUX_LOSS_MAP_BYTES[i]))

    return one(0), one(1)


def unfused_router_bytes(job: JobSpec, elem: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token and expert of the router's element-wise work without
    ``moe_router_fusion``, in the router's dtype (:func:`router_bytes`) with ``elem``-byte activations, counted from
    Megatron-Core 0.16.1's PyTorch ops (tests/test_sim_fused_router.py counts them again): the top-k
    (:data:`UNFUSED_TOPK_PASSES`, :data:`UNFUSED_TOPK_MAP_BYTES`) and, with the load-balancing loss,
    :data:`UNFUSED_AUX_LOSS_PASSES`, :data:`UNFUSED_AUX_LOSS_FP32_PASSES` and :data:`UNFUSED_AUX_LOSS_MAP_BYTES`."""
    score = router_bytes(job, elem)
    aux = job.model.moe_aux_loss_coeff > 0
    cast = score + FP32_BYTES if aux and score != FP32_BYTES else 0.0  # the aux loss' softmax casts to fp32

    def one(i: int) -> float:
        loss = (UNFUSED_AUX_LOSS_PASSES[i] * score + UNFUSED_AUX_LOSS_FP32_PASSES[i] * FP32_BYTES
                + UNFUSED_AUX_LOSS_MAP_BYTES[i] + cast) if aux else 0.0
        return UNFUSED_TOPK_PASSES[i] * score + UNFUSED_TOPK_MAP_BYTES[i] + loss

    return one(0), one(1)


def probability_bytes(job: JobSpec, elem: float) -> float:
    """Bytes of one routed copy's probability as the experts get it: the router's (:func:`router_bytes`), but fp32
    under the flex dispatcher, whose DeepEP and HybridEP managers cast them (``token_dispatcher.py``: "DeepEP only
    supports float32 probs", "HybridEP only supports float32 probs")."""
    if job.model.moe_token_dispatcher is TokenDispatcher.flex:
        return FP32_BYTES
    return router_bytes(job, elem)


def clamp_bytes(elem: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per element of fc1's output (``[rows, 2 ffn]``) of the activation's clamp
    (:attr:`~cfp_megatron.base.config.ModelSpec.activation_clamp`) in ``elem``-byte elements:
    :data:`CLAMP_FORWARD_PASSES`, and :data:`CLAMP_BACKWARD_PASSES` plus :data:`CLAMP_MASK_BYTES`."""
    return CLAMP_FORWARD_PASSES * elem, CLAMP_BACKWARD_PASSES * elem + CLAMP_MASK_BYTES


def expert_bias_bytes(elem: float, prob: float, *, grouped_gemm: bool) -> tuple[float, float]:
    """(forward, backward) HBM bytes per element of fc2's output (``[rows, hidden]``) of the fc2 bias Megatron-Core's
    experts add per expert, scaled by each row's probability, outside the GEMM (megatron/core/transformer/moe/
    experts.py, 0.16.1), with ``elem``-byte activations and ``prob``-byte probabilities (:func:`probability_bytes`);
    ``b x p`` and its sum come out in the wider dtype ``w``. ``grouped_gemm``: ``TEGroupedMLP._apply_bias`` splits
    the rows by expert, writes ``b x p`` (w), adds it to the rows (read elem + w, write w), concatenates the sums
    (w + w) and casts them back (w + elem where ``w > elem``); backward, the cast's gradient (elem + w, where
    ``w > elem``), per expert the rows' gradient cast back (w + elem, the same), the bias' and the probabilities'
    gradients (a product read and written and a sum read, 3w each), and the ``split``'s gradient, a ``cat`` of the
    rows' (elem + elem). Else ``SequentialMLP`` runs each expert's ``MLP``, whose ``output += output_bias x
    per_token_scale`` writes ``b x p`` (w) and adds it in place (read elem + w, write elem); backward, the
    gradient cast to w (elem + w, where ``w > elem``) and the two products and sums (3w each)."""
    wide = max(elem, prob)
    cast = wide + elem if wide > elem else 0.0
    if grouped_gemm:
        return 5.0 * wide + elem + cast, 2.0 * cast + 6.0 * wide + 2.0 * elem
    return 2.0 * wide + 2.0 * elem, cast + 6.0 * wide


def expected_remote_nodes(topk: int, nodes: int) -> float:
    """Expected number of other nodes a token's ``topk`` routed copies land on when its experts are spread
    uniformly over ``nodes`` nodes (DeepEP sends one copy per destination node): ``(n - 1) (1 - (1 - 1/n)^k)``."""
    if nodes <= 1:
        return 0.0
    return (nodes - 1) * (1.0 - (1.0 - 1.0 / nodes) ** topk)


def moe_block_cost(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, *,
                   imbalance: float = 1.0, torch_combine: bool = False, flex_unstated: bool = False,
                   grouped_gemm: bool = True, torch_swiglu: bool = False, torch_gpt_oss: bool = False,
                   fused_router: bool = False, torch_shared_expert: bool = False) -> MoeCost:
    """Cost of ``job``'s MoE block under ``layout``, as Megatron-Core runs it: dropless, the rank holding the busiest
    experts processes ``imbalance`` times the balanced share of routed tokens (1.0: forced or perfect balance);
    token-drop, at most the capacity factor times it; padded to capacity, exactly that
    (:meth:`~cfp_megatron.base.config.ModelSpec.expert_load`). ``torch_combine``: the MoE layer is torchtitan's
    (:attr:`~cfp_megatron.sim.options.SimOptions.torch_moe_combine`): its dispatcher's element-wise work counted
    forward and backward (:func:`torch_dispatch_bytes`, in ``unfused_bytes_per_token``), its experts' weight
    gradients written once in bf16. ``flex_unstated``: the flex
    dispatcher's backend is not stated (:attr:`~cfp_megatron.sim.options.SimOptions.flex_backend_unstated`).
    ``grouped_gemm``: the experts are ``TEGroupedMLP`` (:attr:`~cfp_megatron.sim.options.SimOptions.grouped_gemm`),
    else ``SequentialMLP``, which add a biased model's fc2 bias differently (:func:`expert_bias_bytes`).
    ``torch_swiglu``: the experts are torchtitan's (:meth:`~cfp_megatron.sim.options.SimOptions.torch_swiglu_experts`):
    w1 and w3 two grouped GEMMs of the FFN width each (two launches, two reads of the input), the SwiGLU unfused
    (:func:`torch_swiglu_bytes`, in ``unfused_bytes_per_token``); ``torch_gpt_oss``: they are torchtitan's GPT-OSS
    experts (:meth:`~cfp_megatron.sim.options.SimOptions.torch_gpt_oss_experts`): mlp1 one grouped GEMM, its bias,
    the clamped SwiGLU and mlp2's bias unfused (:func:`torch_gpt_oss_bytes`). ``fused_router``: the router runs
    Transformer Engine's fused kernels (:meth:`~cfp_megatron.sim.options.SimOptions.fused_router`), counted forward
    and backward (:func:`fused_router_bytes`, in ``router_bytes_per_token``), else its PyTorch ops
    (:func:`unfused_router_bytes`).
    ``torch_shared_expert``: the shared experts are torchtitan's ``FeedForward``
    (:meth:`~cfp_megatron.sim.options.SimOptions.torch_swiglu_mlp`), the
    same two GEMMs and unfused SwiGLU over every token."""
    model, dims = job.model, layout.dims
    flex = flex_kernels(None if flex_unstated else job.parallel.moe_flex_dispatcher_backend)
    tp, etp, ep, sp = dims.tp, dims.etp, dims.ep, dims.sp
    hidden = model.hidden_size
    gated = model.activation.gated
    tokens = layout.micro_batch * layout.seq_length / dims.cp  # one micro-batch's tokens on one CP rank
    local_tokens = tokens / tp if sp else tokens  # what enters the block on this rank
    expert_ffn = model.moe_ffn_hidden_size or model.ffn_size
    topk, num_experts = model.moe_router_topk, model.num_experts or 1
    local_experts = max(1, num_experts // ep)
    # Routed token copies one expert rank processes: its EP group's tokens x top-k / EP, over the ETP group's
    # tokens (each ETP rank computes its slice of every copy) -- the balanced share times the expert load.
    routed = topk * tokens / tp * etp * model.expert_load(imbalance)
    per_expert = routed / local_experts
    ffn = expert_ffn / etp
    width = ffn * (2 if gated else 1)
    # fc1 as one grouped GEMM of the gated width (Megatron-Core), or torchtitan's w1 and w3 apart
    fc1_gemms, fc1_width = (2, ffn) if torch_swiglu else (1, width)
    fc1 = fc1_gemms * kernels.grouped_gemm(local_experts, per_expert, fc1_width, hidden)
    fc2 = kernels.grouped_gemm(local_experts, per_expert, hidden, ffn)
    gemm_s = fc1 + fc2
    # Backward: fc1's and fc2's data gradients (rows x hidden, rows x ffn) and weight gradients (each weight's
    # tiles, reduced over the expert's rows, accumulated into Megatron-Core's fp32 main gradients; torchtitan's
    # torch._grouped_mm writes each once in bf16, which FSDP2 reduces after the backward).
    wgrad_bytes = None if torch_combine else MAIN_GRAD_BYTES
    gemm_bwd_s = (fc1_gemms * (kernels.grouped_gemm(local_experts, per_expert, hidden, fc1_width)
                               + kernels.grouped_gemm(local_experts, fc1_width, hidden, per_expert,
                                                      out_bytes=wgrad_bytes))
                  + kernels.grouped_gemm(local_experts, per_expert, ffn, hidden)
                  + kernels.grouped_gemm(local_experts, hidden, ffn, per_expert, out_bytes=wgrad_bytes))
    router_s = kernels.gemm(local_tokens, num_experts, hidden, low_precision=False)  # fp32 logits
    # Megatron-Core's fused activation in elements; torchtitan's unfused ones in bytes (below)
    torch_experts = (torch_swiglu_bytes(kernels.elem) if torch_swiglu
                     else torch_gpt_oss_bytes(kernels.elem) if torch_gpt_oss else None)
    activation = 0.0 if torch_experts else routed / tokens * mlp_activation_elements(tp=etp, ffn=expert_ffn,
                                                                                    gated=gated)
    shared_ffn = model.moe_shared_expert_intermediate_size or 0
    shared_s = shared_elements = 0.0
    shared_unfused = (0.0, 0.0)
    if shared_ffn:
        shared_s = ffn_gemms(kernels, tokens, hidden, shared_ffn / tp, gated, split_gate=torch_shared_expert)
        if torch_shared_expert:  # torchtitan's FeedForward: its unfused SwiGLU in bytes (below)
            shared_unfused = torch_swiglu_bytes(kernels.elem).per_row(shared_ffn / tp, hidden)
        else:
            shared_elements = mlp_activation_elements(tp=tp, ffn=shared_ffn, gated=gated)
    gemm_s += router_s + shared_s
    gemm_bwd_s += 2.0 * (router_s + shared_s)
    elements = activation + shared_elements + _routing_elements(job, layout, kernels, routed=routed, flex=flex,
                                                                torch_combine=torch_combine,
                                                                local_tokens=local_tokens) / tokens
    scored = local_tokens * num_experts / tokens  # the router's [tokens, experts] entries per token of the batch
    fwd_bytes, bwd_bytes = (fused_router_bytes if fused_router else unfused_router_bytes)(job, kernels.elem)
    router = (scored * fwd_bytes, scored * bwd_bytes)
    # The routed experts' PyTorch element-wise ops beside their fused kernels, per token of the micro-batch.
    clamp = clamp_bytes(kernels.elem) if model.activation_clamp is not None and not torch_gpt_oss else (0.0, 0.0)
    bias = (expert_bias_bytes(kernels.elem, probability_bytes(job, kernels.elem), grouped_gemm=grouped_gemm)
            if model.add_bias_linear and not torch_gpt_oss else (0.0, 0.0))
    fc1_out, fc2_out = routed / tokens * width, routed / tokens * hidden  # elements per token of the micro-batch
    unfused = (fc1_out * clamp[0] + fc2_out * bias[0] + shared_unfused[0],
               fc1_out * clamp[1] + fc2_out * bias[1] + shared_unfused[1])
    recomputed = fc1_out * clamp[0]  # what moe_act runs again: the clamp, or torchtitan's activation
    if torch_experts is not None:
        per_token = tuple(routed / tokens * b for b in torch_experts.per_row(ffn, hidden))
        unfused = (unfused[0] + per_token[0], unfused[1] + per_token[1])
        recomputed += per_token[0]
    if _torch_alltoall(job, torch_combine):
        unfused = tuple(u + d for u, d in zip(unfused, _torch_dispatch_per_token(
            job, layout, kernels, routed=routed, local_tokens=local_tokens, tokens=tokens), strict=True))
    expert_params = mlp_params(model, expert_ffn) * local_experts / etp
    params = expert_params + mlp_params(model, shared_ffn) / tp + hidden * num_experts
    dispatch_s, combine_s = _dispatch_s(job, layout, kernels, costs, routed=routed / etp, local_tokens=local_tokens,
                                        probabilities=not torch_combine, flex=flex)
    return MoeCost(gemm_s=gemm_s, gemm_bwd_s=gemm_bwd_s, shared_gemm_s=shared_s, elements_per_token=elements,
                   activation_elements_per_token=activation, shared_elements_per_token=shared_elements,
                   unfused_bytes_per_token=unfused, router_bytes_per_token=router,
                   recomputed_bytes_per_token=recomputed,
                   dispatch_s=dispatch_s, combine_s=combine_s,
                   metadata_s=_metadata_s(job, layout, costs, flex=flex, local_tokens=local_tokens),
                   params=params, expert_params=expert_params)


def _sent_copies(job: JobSpec, local_tokens: float) -> float:
    """Routed copies of this rank's ``local_tokens`` it sends and gets back (top-k each, at the balanced load)."""
    return job.model.moe_router_topk * local_tokens * job.model.expert_load(1.0)


def _torch_alltoall(job: JobSpec, torch_combine: bool) -> bool:
    """Whether the all-to-all dispatcher is torchtitan's (``torch_combine``), whose permutations and combine are
    counted in bytes forward and backward (:func:`torch_dispatch_bytes`), not in the routing's elements."""
    return torch_combine and job.model.moe_token_dispatcher is TokenDispatcher.alltoall


def _torch_dispatch_per_token(job: JobSpec, layout: Layout, kernels: KernelModel, *, routed: float,
                              local_tokens: float, tokens: float) -> tuple[float, float]:
    """(forward, backward) HBM bytes per token of the micro-batch of torchtitan's dispatcher around the experts
    (:func:`torch_dispatch_bytes`): the copies this rank's ``local_tokens`` send, those its experts receive
    (``routed``, over EP alone), and its tokens."""
    model, dims = job.model, layout.dims
    counted = torch_dispatch_bytes(kernels.elem)
    sent = _sent_copies(job, local_tokens)
    received = routed / dims.etp if dims.ep > 1 else 0.0  # without EP, LocalTokenDispatcher: no _permute
    return tuple(model.hidden_size * (sent * counted.sent[i] + received * counted.received[i]
                                      + local_tokens * counted.token[i]) / tokens for i in (0, 1))


def _routing_elements(job: JobSpec, layout: Layout, kernels: KernelModel, *, routed: float,
                      local_tokens: float, flex: FlexKernels, torch_combine: bool = False) -> float:
    """Elements (of the compute precision) the routing moves through HBM on this rank in one forward pass,
    memory-bound kernels counted from what Megatron-Core's ``TopKRouter`` and ``MoEAlltoAllTokenDispatcher`` run:
    the first permutation of the copies this rank sends and the unpermutation of those it
    gets back, and, where an expert rank holds several experts, the sort of the ``routed`` rows it receives by
    expert and the unsort before the combine (``sort_chunks_by_idxs``); each a gather/scatter of
    :data:`PERMUTE_ROW_PASSES` rows per copy. The flex dispatcher (DeepEP and HybridEP alike: ``_DeepepManager``'s
    ``permute``, HybridEP's local permute after its dispatch) permutes only what arrives. Under FP8 and
    FP4, the quantisation of each grouped linear's input (the format's ``cast_bytes``,
    ``cfp_megatron/sim/number_formats.yaml``). ``torch_combine``: torchtitan's dispatcher, whose permutations and
    combine are counted forward and backward apart (:func:`torch_dispatch_bytes`, :func:`moe_block_cost`), not
    here, and whose FP8/FP4 permutation pads the rows in place (no ``Fp8Padding`` copies). The router's own
    element-wise work is counted apart, forward and backward (:func:`fused_router_bytes`,
    :func:`unfused_router_bytes`)."""
    model, dims = job.model, layout.dims
    num_experts, hidden = model.num_experts or 1, model.hidden_size
    elements = 0.0
    received = routed / dims.etp  # the rows this rank's experts take, as they arrive
    if model.moe_token_dispatcher is TokenDispatcher.flex:
        # DeepEP and HybridEP read the tokens where they are and land them by source rank: one permutation by
        # local expert of what arrives, and its inverse.
        elements += 2 * PERMUTE_ROW_PASSES * received * hidden
    elif not _torch_alltoall(job, torch_combine):
        sent = _sent_copies(job, local_tokens)
        elements += 2 * PERMUTE_ROW_PASSES * sent * hidden  # permutation 1 and the unpermutation
        if num_experts // dims.ep > 1:
            elements += 2 * PERMUTE_ROW_PASSES * received * hidden  # permutation 2 and its inverse
    if kernels.low:  # fc1's input (hidden) and fc2's (the expert's FFN share) quantised row by row
        ffn = (model.moe_ffn_hidden_size or model.ffn_size) / dims.etp
        elements += routed * (hidden + ffn) * kernels.format.cast_bytes / kernels.elem
        # torchtitan pads each expert's rows inside its permutation (TorchAOTokenDispatcher's permute_and_pad)
        if not torch_combine and quantization_padding_copies(job, layout, kernels, local_tokens=local_tokens,
                                                             flex=flex):
            # Fp8Padding copies the experts' input into the padded buffer, Fp8Unpadding their output back.
            elements += 2 * PERMUTE_ROW_PASSES * routed * hidden
    return elements


def quantization_padding_copies(job: JobSpec, layout: Layout, kernels: KernelModel, *, local_tokens: float,
                                flex: FlexKernels | None = None) -> bool:
    """Whether Megatron-Core's ``TEGroupedMLP`` copies the experts' rows into a padded buffer and back in each
    forward (``Fp8Padding`` / ``Fp8Unpadding``, megatron/core/transformer/moe/experts.py; Transformer Engine's
    ``fp8_padding.py`` copies unless every local expert's rows are already a multiple of the format's
    ``expert_row_align``): under FP8/FP4 with the alltoall or all-gather dispatcher or DeepEP, whenever the rows
    follow the routing (dropless, token-drop without padding: the counts are the routing's, not multiples of 16),
    and under drop-and-pad where the capacity's rows are not a multiple (``get_capacity`` of this rank's tokens x
    top-k over the experts, from every rank of the expert TP x EP group). The flex dispatcher's HybridEP backend pads
    each expert's rows inside its dispatch kernel (``fused_a2a.hybrid_ep_dispatch``'s ``pad_multiple``, set under
    FP8/FP4 in ``_HybridEPManager.dispatch``), which leaves nothing to copy (``flex``:
    :attr:`FlexKernels.pads_for_quantization`; ``None``: the job's backend's). Megatron-Core's
    ``moe_router_padding_for_quantization`` (off by default; not exported by this plugin) would pad the routing map
    instead."""
    model = job.model
    align = kernels.format.expert_row_align
    if not kernels.low or align <= 0:
        return False
    if model.moe_token_dispatcher is TokenDispatcher.flex:
        if (flex or flex_kernels(job.parallel.moe_flex_dispatcher_backend)).pads_for_quantization:
            return False
        return True  # DeepEP lands the routing's counts: TEGroupedMLP pads them
    factor = model.moe_expert_capacity_factor
    if factor is None or not model.moe_pad_expert_input_to_capacity:
        return True
    capacity = math.ceil(local_tokens * model.moe_router_topk / (model.num_experts or 1) * factor)
    return (capacity * layout.dims.ep * layout.dims.etp) % align != 0


def _dispatch_s(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, *, routed: float,
                local_tokens: float, flex: FlexKernels, probabilities: bool = True) -> tuple[float, float]:
    """(dispatch and combine, of which the combine) seconds of one pass's token exchange on one rank under the
    model's dispatcher. ``routed``: the token copies this rank sends (and receives) over the EP group;
    ``local_tokens``: the tokens entering the block; ``probabilities``: the alltoall dispatcher sends each copy's
    routing probability (Megatron-Core's; torchtitan's keeps the scores where the token is); ``flex``: the flex
    dispatcher's backend."""
    model, dims = job.model, layout.dims
    hidden, elem = model.hidden_size, kernels.elem
    ep, etp = dims.ep, dims.etp
    dispatch = combine = 0.0
    if etp > 1:  # the expert-TP group gathers the tokens its experts split, and scatters their outputs back
        gathered = routed * hidden * elem * etp  # the all-gather's output, the reduce-scatter's input
        dispatch += costs.seconds(Collective.all_gather, gathered, etp, min(etp, layout.domain_size))
        combine += costs.seconds(Collective.reduce_scatter, gathered, etp, min(etp, layout.domain_size))
    if ep > 1:
        dispatcher = model.moe_token_dispatcher
        a2a_bytes = routed * hidden * elem
        if dispatcher is TokenDispatcher.allgather:
            # Every rank gathers the EP group's tokens, keeps those of its experts, and reduce-scatters the outputs.
            gathered = local_tokens * hidden * elem * ep  # the all-gather's output, the reduce-scatter's input
            dispatch += costs.seconds(Collective.all_gather, gathered, ep, layout.ep_per_node)
            combine += costs.seconds(Collective.reduce_scatter, gathered, ep, layout.ep_per_node)
        elif dispatcher is TokenDispatcher.flex:
            token_bytes = local_tokens * hidden * elem
            per_group = layout.ep_per_host if flex.host_nvlink else layout.ep_per_node
            rates = flex_nvlink_rates(costs, per_group, flex)
            experts = model.num_experts or 1
            dispatch += _deepep_s(costs, layout, a2a_bytes, token_bytes, topk=model.moe_router_topk,
                                  nvlink_bytes_per_s=rates[0], num_experts=experts, per_node=per_group)
            combine += _deepep_s(costs, layout, a2a_bytes, token_bytes, topk=model.moe_router_topk,
                                 nvlink_bytes_per_s=rates[1], num_experts=experts, per_node=per_group)
        else:
            # alltoall: every routed copy crosses the group (a token going to two experts of one rank is sent
            # twice), in the dispatch and in the combine; the dispatch sends each copy's routing probability too
            # (probability_bytes each, its own all-to-all in Megatron-Core's MoEAlltoAllTokenDispatcher.token_dispatch,
            # and in the backward pass its gradient).
            a2a = all_to_all_costs(costs, job)  # NCCL's all-to-all at its NVLink ceiling
            one_way = a2a.seconds(Collective.all_to_all, a2a_bytes, ep, layout.ep_per_node)
            dispatch += one_way
            if probabilities:
                dispatch += a2a.seconds(Collective.all_to_all, routed * probability_bytes(job, elem), ep,
                                        layout.ep_per_node)
            combine += one_way
    return dispatch + combine, combine


def _metadata_s(job: JobSpec, layout: Layout, costs: CollectiveCosts, *, flex: FlexKernels,
                local_tokens: float) -> float:
    """Seconds of the dispatcher's exchange before the dispatch in one forward pass (:attr:`MoeCost.metadata_s`):
    Megatron-Core's ``MoEAlltoAllTokenDispatcher.preprocess`` all-gathers each rank's token count per expert
    (int64) over the expert TP x EP group to size its all-to-alls (padded to capacity, every split is the capacity
    and nothing is exchanged); HybridEP all-gathers the routing map of the ``local_tokens`` entering the block
    (:data:`ROUTING_MAP_BYTES` per token and expert of the expert TP x EP group) for its metadata preprocessing."""
    dims = layout.dims
    group = dims.ep * dims.etp
    span = min(group, layout.ep_per_node * dims.etp)
    if job.model.moe_token_dispatcher is TokenDispatcher.flex and flex.gathers_routing_map and group > 1:
        routing_map = local_tokens * (job.model.num_experts or 0) * dims.etp * ROUTING_MAP_BYTES * group
        return costs.seconds(Collective.all_gather, routing_map, group, span)
    if (job.model.moe_token_dispatcher is not TokenDispatcher.alltoall or group <= 1
            or job.model.moe_pad_expert_input_to_capacity):
        return 0.0
    counts = (job.model.num_experts or 0) * COUNT_BYTES * group  # the all-gather's output
    return costs.seconds(Collective.all_gather, counts, group, span)


def flex_nvlink_rates(costs: CollectiveCosts, ranks: int, flex: FlexKernels) -> tuple[float, float]:
    """(dispatch, combine) bytes per second per GPU of the flex dispatcher's ``flex`` kernels over NVLink for an EP
    group with ``ranks`` ranks there: :attr:`DispatchRates.deepep_intra_share` of the link, capped at the backend's
    :attr:`FlexKernels.nvlink_gbps` of the largest measured group not larger than it (the smallest measured for
    smaller groups)."""
    shared = costs.intra.bandwidth_bytes_per_s * dispatch_rates().deepep_intra_share
    measured = flex.nvlink_gbps[0]
    for row in flex.nvlink_gbps:
        if row[0] <= ranks:
            measured = row
    return min(shared, measured[1] * 1e9), min(shared, measured[2] * 1e9)


def rank_hit_share(num_experts: int, local_experts: int, topk: int) -> float:
    """Chance that a token's ``topk`` distinct experts, drawn uniformly from ``num_experts``, include one of a rank's
    ``local_experts``: ``1 - C(E - L, k) / C(E, k)``."""
    missed = 1.0
    for i in range(min(topk, num_experts)):
        missed *= max(num_experts - local_experts - i, 0) / (num_experts - i)
    return 1.0 - missed


def _deepep_s(costs: CollectiveCosts, layout: Layout, routed_bytes: float, token_bytes: float, *,
              topk: int, nvlink_bytes_per_s: float, num_experts: int, per_node: int) -> float:
    """One DeepEP dispatch (or combine): the NVLink part carries the rows a rank receives, one per token that has
    any of its experts (DeepEP and HybridEP send a token once to each rank it goes to, the receiver expands it per
    local expert; tokens from other nodes forwarded to it over NVLink), at ``nvlink_bytes_per_s``
    (:func:`flex_nvlink_rates`; their benchmarks' rates count the same rows, ``recv_x`` / ``dispatched_hidden``); the
    RDMA part one copy of each token per other NVLink group it goes to at DeepEP's measured share. ``routed_bytes``:
    the routed copies the rank takes (their balance and imbalance); ``token_bytes``: the tokens it sends;
    ``per_node``: the EP ranks of one NVLink group (a host for DeepEP, the NVLink domain for HybridEP)."""
    ep, per_node = layout.dims.ep, max(per_node, 1)
    nodes = max(1, ep // per_node)
    hit = rank_hit_share(num_experts, max(1, num_experts // ep), topk)
    intra_bytes = routed_bytes * ep * hit / topk  # routed copies, one row per (token, rank) instead of per expert
    intra_s = intra_bytes / nvlink_bytes_per_s + costs.intra.latency_s
    if nodes <= 1:
        return intra_s
    inter_bytes = token_bytes * expected_remote_nodes(topk, nodes)
    inter_bandwidth = costs.inter.bandwidth_bytes_per_s * dispatch_rates().deepep_inter_share
    inter_s = inter_bytes / inter_bandwidth + costs.inter.latency_s
    return max(intra_s, inter_s)


def expert_comm(job: JobSpec, block: MoeCost, *, attention_s: tuple[float, float],
                experts_s: tuple[float, float]) -> tuple[float, float]:
    """(forward, backward) seconds of the expert dispatch and combine left on the critical path (the forward's count
    exchange always), with the SM share the hidden part takes from the computation it overlaps. ``attention_s`` and
    ``experts_s``: (forward, backward) seconds of the layer's attention side and of its experts.

    ``moe_a2a_overlap`` runs Megatron-Core's combined 1F1B layer schedule (``TransformerLayerSchedulePlan.run``):
    each communication of one micro-batch beside one computation of another, pair by pair -- the backward combine
    beside the forward attention, the forward dispatch beside the backward experts, the backward dispatch beside
    the forward experts, the forward combine beside the backward attention. ``moe_shared_expert_overlap`` hides the
    exchange behind the shared expert (twice as long backward)."""
    parallel = job.parallel
    if parallel.moe_a2a_overlap:
        return paired_exchange(block, attention_s=attention_s, experts_s=experts_s)
    if parallel.moe_shared_expert_overlap:
        fwd = [overlapped(block.dispatch_s, block.shared_gemm_s)]
        bwd = [overlapped(block.dispatch_s, 2.0 * block.shared_gemm_s)]
    else:  # nothing beside it: LayerCost.ep_alone_s
        return block.metadata_s + block.dispatch_s, block.dispatch_s
    return block.metadata_s + sum(a + b for a, b in fwd), sum(a + b for a, b in bwd)


def paired_exchange(block: MoeCost, *, attention_s: tuple[float, float],
                    experts_s: tuple[float, float]) -> tuple[float, float]:
    """:func:`expert_comm` under ``moe_a2a_overlap`` (its combined 1F1B layer schedule), whatever the plan sets."""
    dispatch = block.dispatch_s - block.combine_s
    fwd = [overlapped(dispatch, experts_s[1]), overlapped(block.combine_s, attention_s[1])]
    bwd = [overlapped(block.combine_s, attention_s[0]), overlapped(dispatch, experts_s[0])]
    return block.metadata_s + sum(a + b for a, b in fwd), sum(a + b for a, b in bwd)


class ExpertDispatch(CostTerm):
    """The expert all-to-all (dispatch and combine, and the token counts before them) the passes wait for."""

    name = "expert_dispatch"
    lanes = (Lane(name="ep_comm_s", label="EP comm", part="TP/CP/EP/FSDP comm", kind=LaneKind.comm,
                  placement=Placement.in_pass, pass_field="ep_comm_s", key="ep", trace="EP comm",
                  style=("EP all-to-all", "#937860", "rail_response"),
                  overlaps=("the other micro-batch's attention and experts (moe_a2a_overlap)",
                            "the shared expert (moe_shared_expert_overlap)")),)
    stores = (MemoryCategory(name="ep_buffers", label="expert dispatch buffers", field="comm_buffers"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """The permuted token copies before and after the all-to-all (send and receive buffers) of one layer, on
        the busiest expert rank."""
        job, dims = stage.job, stage.layout.dims
        if not stage.moe_layers or dims.ep <= 1 or stage.measured is not None:
            return {"ep_buffers": 0.0}
        model = job.model
        return {"ep_buffers": (2 * model.moe_router_topk * stage.common.tokens / dims.tp * model.hidden_size
                               * stage.common.elem_bytes * model.expert_load(stage.options.moe_routing_imbalance))}

    def hideable(self, layer: LayerCost, overlaps: Overlaps) -> tuple[float, float]:
        """The expert overlap leaves at least the SM share (:data:`COMM_SM_SHARE`) of the forward and backward
        exchange."""
        if not overlaps.expert_a2a:
            return 0.0, 0.0
        return (1.0 - COMM_SM_SHARE) * (layer.forward.ep_comm_s + layer.backward.ep_comm_s), 0.0
