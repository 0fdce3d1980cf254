"""The host's work per layer kind and pass of one plan: the kernels Megatron-Core launches (counted,
``kernel_launches.json``), the host's seconds per launch and per synchronisation (``host.yaml``), CUDA graphs that
replace a captured region's launches with one, and the dropless MoE dispatcher's device-to-host synchronisation.
Priced once per plan's layout (:func:`host_costs`); the term :mod:`cfp_megatron.sim.terms.host` sets them against the
GPU's time of each pass (docs/simulator.md, "Host time")."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from cfp_megatron.base.config import CudaGraphImpl, JobSpec, ModelSpec, Recompute, cuda_graph_scopes

HERE = Path(__file__).resolve().parent
CONSTANTS_FILE = HERE / "host.yaml"
"""The host's seconds per launch and per synchronisation, with their sources."""
COUNTS_FILE = HERE / "kernel_launches.json"
"""Kernels per layer kind and pass, written by ``bench/kernel_launches.py``."""

DENSE_PARTS = ("attention", "mlp")
"""The parts of a dense decoder layer the counts name (``attention``: input norm to the attention's residual add)."""
MOE_PARTS = ("attention", "router", "dispatch", "experts")
"""The parts of a MoE decoder layer the counts name (``dispatch``: the MoE block's norm, token dispatch,
permutation, unpermutation, combine and residual add)."""


@dataclass(frozen=True, kw_only=True)
class HostConstants:
    """What the host spends per launch and per synchronisation (``host.yaml``)."""

    forward_launch_s: float
    """Host seconds per kernel a forward (or recomputation) launches."""
    backward_launch_s: float
    """Host seconds per kernel a backward pass launches."""
    sync_s: float
    """Seconds a plain device-to-host synchronisation costs beyond the GPU work it waits for."""
    moe_sync_stall_s: float
    """Seconds each synchronisation of the dropless MoE dispatcher costs its layer's forward beyond the GPU work (the
    drain, the host's split sizes and its next launch)."""
    moe_layer_syncs: int
    """Synchronisations per dropless MoE layer's forward."""
    step_syncs: int
    """Synchronisations per step outside the passes."""
    graph_launches_per_region: int
    """Launches one CUDA graph replay costs per captured region and pass."""
    kernel_floor_s: float
    """GPU seconds of a kernel that does next to nothing, launched back to back (a single-thread kernel's cost)."""


@functools.cache
def host_constants() -> HostConstants:
    """:class:`HostConstants` from ``host.yaml``."""
    data = yaml.safe_load(CONSTANTS_FILE.read_text())
    return HostConstants(forward_launch_s=float(data["forward_launch_us"]) * 1e-6,
                         backward_launch_s=float(data["backward_launch_us"]) * 1e-6,
                         sync_s=float(data["sync_us"]) * 1e-6,
                         moe_sync_stall_s=float(data["moe_sync_stall_us"]) * 1e-6,
                         moe_layer_syncs=int(data["moe_layer_syncs"]), step_syncs=int(data["step_syncs"]),
                         graph_launches_per_region=int(data["graph_launches_per_region"]),
                         kernel_floor_s=float(data["kernel_floor_us"]) * 1e-6)


def exchange_sync_s() -> float:
    """Seconds each blocking exchange of a pipeline schedule costs its stage on a GPU beyond the transfer:
    Megatron-Core's non-interleaved schedule synchronises the device after every batched send/receive
    (``batch_p2p_sync``, on by default: ``P2PCommunicator._communicate``), as Megatron-LM's ``_communicate`` did
    after every exchange before it, so the GPU then waits for the synchronisation and for the next pass's first
    launch (docs/simulator.md, "Blocking exchanges")."""
    constants = host_constants()
    return constants.sync_s + constants.forward_launch_s


@dataclass(frozen=True, kw_only=True)
class Launches:
    """Kernels launched by one forward and one backward pass."""

    forward: float
    """Forward pass."""
    backward: float
    """Backward pass."""

    def plus(self, other: Launches) -> Launches:
        """Both passes' sums."""
        return Launches(forward=self.forward + other.forward, backward=self.backward + other.backward)

    def times(self, n: float) -> Launches:
        """``n`` of them."""
        return Launches(forward=n * self.forward, backward=n * self.backward)


GROUPED_GEMMS = (2, 4)
"""(forward, backward) grouped GEMMs of a routed expert MLP: fc1 and fc2; each one's data gradient and weight
gradient (Transformer Engine's ``GroupedLinear``, two per MoE layer)."""
GROUPED_QUANTISED = (2, 2)
"""(forward, backward) grouped-linear tensors quantised per pass under FP8/FP4: fc1's and fc2's inputs; the output
gradients of fc2 and fc1 (their inputs' column-wise copies are kept from the forward)."""


TORCH_EXPERT_OPS = Launches(forward=6, backward=10)
"""Operators torchtitan's ``GroupedExperts`` dispatch per pass (pytorch/torchtitan b5bcd76c, ``models/common/
moe.py``; counted with a ``TorchDispatchMode``): forward the offsets' ``cumsum``, w1's, w3's and w2's
``torch._grouped_mm``, ``silu`` and the multiply; backward each grouped GEMM's data and weight gradient (6), the
multiply's two gradients, ``silu_backward`` and the ``add`` of the input's two gradients. Each is one launch from
Python, in place of Megatron-Core's experts' in ``kernel_launches.json``."""
TORCH_GPT_OSS_EXPERT_OPS = Launches(forward=22, backward=27)
"""Operators torchtitan's GPT-OSS experts dispatch per pass (pytorch/torchtitan b5bcd76c, ``models/gpt_oss/moe.py``,
``GptOssGroupedExperts.forward``; counted with a ``TorchDispatchMode``): forward the offsets, the tail slack and
each bias's ``cat``, ``repeat_interleave`` and ``index_select``, the two grouped GEMMs, the bias adds and the
clamped SwiGLU's seven; backward the GEMMs' four gradients and the rest's autograd. One launch each from Python,
in place of Megatron-Core's experts' in ``kernel_launches.json``."""
TORCH_GPT_OSS_GROUPED_MMS = (2, 4)
"""(forward, backward) ``torch._grouped_mm`` calls of the same (each with its preparation kernel:
:data:`TORCH_GROUPED_MMS`)."""
TORCH_FEED_FORWARD_EXTRA = Launches(forward=1, backward=2)
"""Operators torchtitan's ``FeedForward`` dispatches per pass (pytorch/torchtitan b5bcd76c, ``models/common/
feed_forward.py``, ``w2(F.silu(w1(x)) * w3(x))``; counted with a ``TorchDispatchMode``: 5 forward, 10 backward)
beyond the same SwiGLU with w1 and w3 one linear of twice the width, chunked (the counted MLP's one fc1): forward
w3's GEMM; backward its data and weight gradients and autograd's ``add`` of the input's two gradients, less the
chunk's ``cat`` of the halves' gradients. Each is one launch from Python, added to ``kernel_launches.json``'s
dense MLP and shared expert."""
TORCH_GROUPED_MMS = (3, 6)
"""(forward, backward) ``torch._grouped_mm`` calls of the same, each of which launches a second kernel from C++
before its CUTLASS GEMM (pytorch/pytorch ``aten/src/ATen/native/cuda/GroupMM.cu``,
``bf16bf16_grouped_gemm_impl_sm90_sm100``: ``prepare_grouped_gemm_data`` fills the groups' pointers and shapes)."""
UNFUSED_ROUTER_OPS = Launches(forward=26, backward=17)
"""Operators the counted MoE layer's router dispatches per pass (``kernel_launches.json``'s Mixtral 8x7B: fp32
softmax router, top-2, with the load-balancing loss, at TP 1; the counts' forward part ``router`` is these 26),
without ``moe_router_fusion``, as Megatron-Core 0.16.1 runs it (transformer/moe/router.py, moe_utils.py; counted
under ``TorchDispatchMode``, views left out: tests/test_sim_fused_router.py). Forward: the gating's two casts and
GEMM (3); ``topk_routing_with_score_function``'s top-k, softmax, two ``zeros_like``, two ``scatter`` and the casts
to int and bool (8); ``compute_routing_scores_for_aux_loss``'s softmax, top-k, ``zeros_like``, casts and scatter
(6); the token counts' sum (1); ``switch_load_balancing_loss_func``'s sum, product, sum and scale (4); the loss
tracker's division, add and copy, and the per-token scale (4). Backward: ``MoEAuxLossAutoScaler``'s ``ones_like``
and scale, the per-token scale's, the loss' scale's and product's gradients (5), the scores' softmax backward (1),
the scatter's gather, the softmax backward and the top-k's zeroed scatter (4), the logits' two gradients added (1),
the gating's casts and two GEMMs (6)."""
FUSED_ROUTER_OPS = Launches(forward=11, backward=13)
"""The same router's under ``moe_router_fusion`` (Megatron-Core 0.16.1 calling Transformer Engine's
transformer_engine/pytorch/router.py, one kernel a call): forward, the gating (3), the fused top-k (1), the fused
aux-loss scores (1), the token counts' sum (1), the fused loss (1), the tracker and the per-token scale (4);
backward, the auto-scaler's and the per-token scale's (3), the fused loss', scores' and top-k's backward (3), the
logits' gradients added (1) and the gating's (6)."""


def router_launches(counted: Launches, *, fused: bool) -> Launches:
    """The router's launches per pass: ``counted`` (its share of the counted layer's), scaled per pass by
    :data:`FUSED_ROUTER_OPS` over :data:`UNFUSED_ROUTER_OPS` where it runs fused."""
    if not fused:
        return counted
    return Launches(forward=counted.forward * FUSED_ROUTER_OPS.forward / UNFUSED_ROUTER_OPS.forward,
                    backward=counted.backward * FUSED_ROUTER_OPS.backward / UNFUSED_ROUTER_OPS.backward)


def grouped_linear_launches(local_experts: int, expert_cast_launches: float) -> Launches:
    """The kernels Transformer Engine's grouped linears launch per pass from C++ loops over ``local_experts``
    experts: one cuBLAS GEMM an expert per grouped GEMM (``general_grouped_gemm``: ``nvte_multi_stream_cublas_gemm``
    over 4 streams, its default path on Hopper, :data:`GROUPED_GEMMS`) and ``expert_cast_launches`` an expert per
    quantised tensor (:attr:`~cfp_megatron.sim.format_costs.FormatCost.expert_cast_launches`,
    :data:`GROUPED_QUANTISED`)."""
    return Launches(forward=local_experts * (GROUPED_GEMMS[0] + GROUPED_QUANTISED[0] * expert_cast_launches),
                    backward=local_experts * (GROUPED_GEMMS[1] + GROUPED_QUANTISED[1] * expert_cast_launches))


def expert_scalar_kernels_s(local_experts: int, expert_scalar_kernels: float) -> tuple[float, float]:
    """(forward, backward) GPU seconds of the single-thread kernels a format's per-expert quantisation runs
    (:attr:`~cfp_megatron.sim.format_costs.FormatCost.expert_scalar_kernels` an expert per quantised tensor,
    :data:`GROUPED_QUANTISED`), each at ``kernel_floor_us`` (``host.yaml``)."""
    each = host_constants().kernel_floor_s * local_experts * expert_scalar_kernels
    return GROUPED_QUANTISED[0] * each, GROUPED_QUANTISED[1] * each


@dataclass(frozen=True, kw_only=True)
class LaunchCounts:
    """The counted kernels per layer kind and pass (``kernel_launches.json``)."""

    counted: str
    """Where they were counted: ``cpu`` (dispatched operators, the proxy) or ``gpu`` (the host's launch calls)."""
    spec: str
    """The layer spec counted: ``local`` (Megatron-Core's, unfused) or ``transformer_engine``."""
    embedding: Launches
    """The input embedding."""
    head: Launches
    """The final norm, the logits and the cross-entropy loss."""
    dense: dict[str, Launches]
    """A dense decoder layer's parts (:data:`DENSE_PARTS`)."""
    moe: dict[str, Launches]
    """A MoE decoder layer's parts (:data:`MOE_PARTS`), its experts' without their launches per local expert."""
    per_local_expert: Launches
    """The experts' launches per local expert (one GEMM chain each without a grouped GEMM)."""


def _parts(kind: dict[str, Any], names: tuple[str, ...]) -> dict[str, Launches]:
    """A kind's launches per part: its forward and backward shared out over the parts as its forward's operators are
    (the forward hooks name the parts; the backward's kernels run outside any module's hooks)."""
    forward = kind["forward_parts"]
    total = sum(forward.values()) or 1
    return {name: Launches(forward=kind["forward"] * forward.get(name, 0) / total,
                           backward=kind["backward"] * forward.get(name, 0) / total) for name in names}


@functools.cache
def launch_counts() -> LaunchCounts:
    """:class:`LaunchCounts` from ``kernel_launches.json``: the MoE layer counted at two numbers of local experts
    gives the launches per local expert (the difference of the whole layer's, as the GPU's copies and memsets per
    expert fall outside the dispatched operators) and the rest, shared out over the parts as the forward's operators
    are once the experts' per-expert operators are taken out."""
    data = json.loads(COUNTS_FILE.read_text())
    kinds = data["kinds"]
    many, few = kinds["moe"], kinds["moe_4_experts"]
    local, extra = many["local_experts"], many["local_experts"] - 4
    per_expert = Launches(forward=(many["forward"] - few["forward"]) / extra,
                          backward=(many["backward"] - few["backward"]) / extra)
    ops = {name: float(many["forward_parts"].get(name, 0)) for name in MOE_PARTS}
    ops["experts"] = max(ops["experts"] - local * (ops["experts"] - few["forward_parts"].get("experts", 0)) / extra,
                         0.0)
    total = sum(ops.values()) or 1.0
    fixed = Launches(forward=max(many["forward"] - local * per_expert.forward, 0.0),
                     backward=max(many["backward"] - local * per_expert.backward, 0.0))
    many_parts = {name: Launches(forward=fixed.forward * n / total, backward=fixed.backward * n / total)
                  for name, n in ops.items()}
    return LaunchCounts(counted=data["counted"], spec=data["spec"],
                        embedding=Launches(forward=kinds["embedding"]["forward"],
                                           backward=kinds["embedding"]["backward"]),
                        head=Launches(forward=kinds["head"]["forward"], backward=kinds["head"]["backward"]),
                        dense=_parts(kinds["dense"], DENSE_PARTS), moe=many_parts, per_local_expert=per_expert)


@dataclass(frozen=True, kw_only=True)
class HostCosts:
    """Host seconds per layer kind and pass of one plan (launch counts x seconds per launch, CUDA graphs applied)."""

    dense: tuple[float, float]
    """(forward, backward) host seconds of one dense decoder layer."""
    moe: tuple[float, float]
    """(forward, backward) host seconds of one MoE decoder layer (the dense layer's for a dense model)."""
    embedding: tuple[float, float]
    """(forward, backward) host seconds of the embedding."""
    head: tuple[float, float]
    """(forward, backward) host seconds of the final norm, logits and loss."""
    dense_recompute_s: float
    """Host seconds of one recomputed dense layer: its forward's launches under full recomputation; zero under
    selective recomputation (the core attention's few kernels are not counted) and none."""
    moe_recompute_s: float
    """The same for a MoE layer."""
    recompute_syncs: bool
    """Whether a recomputed MoE layer synchronises again (full recomputation runs its dispatcher's forward again)."""
    moe_sync_s: float
    """What each forward (and recomputation) of a MoE layer waits beyond its GPU work at the dispatcher's
    device-to-host synchronisations: each drain, the host's work after it and its next launch (the host's queue
    ahead is lost); zero where the layer does not synchronise."""


def moe_syncs(job: JobSpec) -> bool:
    """Whether each MoE layer's token dispatch makes the host wait for the device
    (:attr:`~cfp_megatron.base.config.ModelSpec.moe_counts_to_host`, which says which dispatchers do)."""
    return job.model.moe_counts_to_host


def _graphed(parallel_scope: tuple[str, ...], part: str, *, moe: bool, dropless: bool) -> bool:
    """Whether a CUDA graph captures ``part`` of a layer under the scopes ``parallel_scope`` (empty: the whole
    layer; Megatron-Core's ``CudaGraphScope``: ``attn``, ``mlp`` dense only, ``moe`` drop-and-pad only,
    ``moe_router`` the router, ``moe_preprocess`` the dispatch's preprocessing with the router)."""
    whole = not parallel_scope
    if part == "attention":
        return whole or "attn" in parallel_scope
    if part == "mlp":
        return not moe and (whole or "mlp" in parallel_scope)
    if dropless:  # a dropless MoE block's shapes follow the routing: only its router can be captured
        return part == "router" and (whole or "moe_router" in parallel_scope or "moe_preprocess" in parallel_scope)
    if part == "router":
        return whole or bool({"moe", "moe_router", "moe_preprocess"} & set(parallel_scope))
    return whole or "moe" in parallel_scope


def _layer(parts: dict[str, Launches], scope: tuple[str, ...] | None, constants: HostConstants, *, moe: bool,
           dropless: bool) -> Launches:
    """One layer's launches, the parts a CUDA graph captures (``scope`` not ``None``) replaced by its replays."""
    total = Launches(forward=0.0, backward=0.0)
    graph = Launches(forward=constants.graph_launches_per_region, backward=constants.graph_launches_per_region)
    for name, launches in parts.items():
        captured = scope is not None and _graphed(scope, name, moe=moe, dropless=dropless)
        total = total.plus(graph if captured else launches)
    return total


def host_costs(job: JobSpec, local_experts: int, *, grouped_gemm: bool = True, te_experts: bool = True,
               torch_experts: bool = False, torch_gpt_oss: bool = False, torch_mlp: bool = False,
               moe_layer_syncs: int | None = None, expert_cast_launches: float = 0.0,
               fused_router: bool = False) -> HostCosts:
    """The host's seconds per layer kind and pass of ``job`` with ``local_experts`` routed experts per rank; with
    ``grouped_gemm`` the experts run grouped GEMMs, not each expert's Python kernels, and with ``te_experts`` too
    (:attr:`~cfp_megatron.sim.options.SimOptions.te_grouped_experts`) as Transformer Engine's grouped linears, whose
    C++ loops launch per expert (:func:`grouped_linear_launches`, with ``expert_cast_launches`` per expert and
    quantised tensor: the format's); with ``torch_experts`` they are torchtitan's ``GroupedExperts``
    (:meth:`~cfp_megatron.sim.options.SimOptions.torch_swiglu_experts`: :data:`TORCH_EXPERT_OPS` from Python and
    :data:`TORCH_GROUPED_MMS` from C++), with ``torch_gpt_oss`` its GPT-OSS experts
    (:meth:`~cfp_megatron.sim.options.SimOptions.torch_gpt_oss_experts`: :data:`TORCH_GPT_OSS_EXPERT_OPS`,
    :data:`TORCH_GPT_OSS_GROUPED_MMS`); with ``torch_mlp`` the dense MLP and the shared expert are torchtitan's
    ``FeedForward`` (:meth:`~cfp_megatron.sim.options.SimOptions.torch_swiglu_mlp`, :data:`TORCH_FEED_FORWARD_EXTRA`);
    ``moe_layer_syncs``: a dropless MoE layer's synchronisations per forward (``None``: ``host.yaml``'s count,
    Megatron-Core's); ``fused_router``: the router runs Transformer Engine's fused kernels
    (:meth:`~cfp_megatron.sim.options.SimOptions.fused_router`, :func:`router_launches`)."""
    parallel = job.parallel
    return _host_costs(job.model, parallel.cuda_graph_impl, parallel.cuda_graph_scope,
                       parallel.recompute is Recompute.full, moe_syncs(job), local_experts,
                       grouped_gemm and te_experts, grouped_gemm,
                       (TORCH_EXPERT_OPS, TORCH_GROUPED_MMS) if torch_experts
                       else (TORCH_GPT_OSS_EXPERT_OPS, TORCH_GPT_OSS_GROUPED_MMS) if torch_gpt_oss else None,
                       torch_mlp, moe_layer_syncs, expert_cast_launches, fused_router)


@functools.lru_cache(maxsize=1024)
def _host_costs(model: ModelSpec, impl: CudaGraphImpl, scope_text: str | None, full: bool, syncs: bool,
                local_experts: int, te_loops: bool, grouped_gemm: bool,
                torch_experts: tuple[Launches, tuple[int, int]] | None, torch_mlp: bool,
                moe_layer_syncs: int | None, expert_cast_launches: float, fused_router: bool) -> HostCosts:
    """:func:`host_costs` from what it reads of the plan (the search prices thousands of layouts that share them):
    the model, the CUDA graphs (``impl``, ``parallel.cuda_graph_scope``'s text), whether recomputation is full and
    whether its MoE layers synchronise (:func:`moe_syncs`)."""
    constants, counts = host_constants(), launch_counts()
    scope = None if impl is CudaGraphImpl.none else cuda_graph_scopes(scope_text)
    if scope is not None and "full_iteration" in scope:  # the whole iteration replays as one graph
        zero = (0.0, 0.0)
        return HostCosts(dense=zero, moe=zero, embedding=zero, head=zero, dense_recompute_s=0.0,
                         moe_recompute_s=0.0, recompute_syncs=False, moe_sync_s=0.0)
    mlp = counts.dense["mlp"].plus(TORCH_FEED_FORWARD_EXTRA) if torch_mlp else counts.dense["mlp"]
    dense = _layer({**counts.dense, "mlp": mlp}, scope, constants, moe=False, dropless=syncs)
    moe_parts = dict(counts.moe)
    moe_parts["router"] = router_launches(counts.moe["router"], fused=fused_router)
    if torch_experts is not None:  # torchtitan's experts' operators and grouped GEMMs in place of Megatron-Core's
        moe_parts["experts"] = torch_experts[0]
    elif not grouped_gemm:  # Megatron-Core's SequentialMLP: each local expert's kernels, launched from Python
        moe_parts["experts"] = counts.moe["experts"].plus(counts.per_local_expert.times(local_experts))
    if model.moe_shared_expert_intermediate_size:  # a shared expert runs a dense MLP's kernels
        moe_parts["shared_expert"] = mlp
    moe = _layer(moe_parts, scope, constants, moe=True, dropless=syncs) if model.is_moe else dense
    fwd, bwd = constants.forward_launch_s, constants.backward_launch_s

    def seconds(launches: Launches) -> tuple[float, float]:
        return launches.forward * fwd, launches.backward * bwd

    moe_s = seconds(moe)
    if model.is_moe and te_loops and not (scope is not None and _graphed(scope, "experts", moe=True,
                                                                              dropless=syncs)):
        # Transformer Engine's C++ loops over the experts, at the C++ launch's cost in both passes
        te = grouped_linear_launches(local_experts, expert_cast_launches)
        moe_s = (moe_s[0] + te.forward * bwd, moe_s[1] + te.backward * bwd)
    if model.is_moe and torch_experts is not None and not (
            scope is not None and _graphed(scope, "experts", moe=True, dropless=syncs)):
        # each grouped GEMM's preparation kernel, at the C++ launch's cost
        grouped = torch_experts[1]
        moe_s = (moe_s[0] + grouped[0] * bwd, moe_s[1] + grouped[1] * bwd)
    return HostCosts(dense=seconds(dense), moe=moe_s, embedding=seconds(counts.embedding),
                     head=seconds(counts.head), dense_recompute_s=dense.forward * fwd if full else 0.0,
                     moe_recompute_s=moe_s[0] if full else 0.0, recompute_syncs=full and syncs,
                     moe_sync_s=(constants.moe_layer_syncs if moe_layer_syncs is None else moe_layer_syncs)
                     * constants.moe_sync_stall_s if syncs else 0.0)


def step_host_s() -> float:
    """Host seconds per step outside the passes on a GPU cluster: its synchronisations, each followed by a launch
    the GPU waits for."""
    constants = host_constants()
    return constants.step_syncs * (constants.sync_s + constants.forward_launch_s)
