"""Settings of a simulated run that the training specs do not carry (yet)."""

from __future__ import annotations

from dataclasses import dataclass

from cfp_megatron.base.config import Activation, AttentionKernel, ClusterSpec, ModelSpec, PositionEmbedding
from cfp_megatron.base.enums import IdentityEnum
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import (
    attention_kernel_here,
    gradient_accumulation_fusion_here,
    grouped_gemm_here,
    rope_fusion_here,
    router_fusion_here,
)


class ApexAdamStates(IdentityEnum):
    """How Apex's ``DistributedFusedAdam`` (NeMo 1's ``optim.name=distributed_fused_adam``) keeps the master weights
    and moments of bf16 weights (:meth:`~cfp_megatron.sim.sharding.StateBytes.megatron`)."""

    remainders = "remainders"
    """fp32 moments and, beside the bf16 weights, int16 remainders instead of fp32 master weights (``optim.dtype``
    fp32, NeMo's default: it sets ``store_params=False, store_param_remainders=True``)."""
    bf16 = "bf16"
    """bf16 moments and no master copy (``optim.dtype=bf16``: NeMo sets ``store_params=False``)."""


class WeightGradAccumulation(IdentityEnum):
    """How a micro-batch's weight gradients are added to the step's (docs/simulator.md, "Weight-gradient
    accumulation")."""

    fused = "fused"
    """The weight-gradient GEMM accumulates into the main gradient itself (Megatron's ``gradient_accumulation_fusion``,
    Megatron-LM's default since 2022; not the runtime's, which trains with the fusion off): nothing beyond the
    GEMM."""
    main_grad_hook = "main_grad_hook"
    """Megatron's DDP hook adds each gradient into its main gradient buffer (``main_grad.add_(param.grad)``) every
    micro-batch (Megatron-Core without the fusion, the runtime's): the gradient and the buffer read, the buffer
    written."""
    autograd = "autograd"
    """The gradients accumulate in ``param.grad`` as autograd adds them (PyTorch DDP, or Megatron-LM's local DDP of
    2021 without contiguous buffers): from the second micro-batch on, an in-place add in the compute precision."""
    bf16_optimizer = "bf16_optimizer"
    """DeepSpeed's ``BF16_Optimizer`` (its engine with bf16 weights) casts and adds the bf16 gradients into an fp32
    buffer once the micro-batch's whole backward is done (``update_hp_grads``), not inside each layer's."""

    @property
    def after_backward(self) -> bool:
        """Whether the add runs once after the micro-batch's backward, not inside each layer's."""
        return self is WeightGradAccumulation.bf16_optimizer


class PipelineSchedule(IdentityEnum):
    """The pipeline schedule a run used (docs/simulator.md, "schedule.py"): Megatron-Core's, or one the runtime does
    not train with that published runs state (the validator reads it from their ``pp_schedule``)."""

    megatron = "megatron"
    """Megatron-Core's 1F1B, interleaved over the plan's model chunks where it has several."""
    gpipe = "gpipe"
    """GPipe: every micro-batch's forward, then every backward (one chunk a rank); all micro-batches in flight."""
    zb_h1 = "zb_h1"
    """Zero bubble with 1F1B's memory (ZB-H1, ZB-1p): the backward split into its input-gradient (B) and
    weight-gradient (W) passes, W filling the bubbles (one chunk a rank)."""
    zb_h2 = "zb_h2"
    """Zero bubble with twice 1F1B's memory (ZB-H2, ZB-2p): more forwards in the warm-up, W filling the rest."""


@dataclass(frozen=True, kw_only=True)
class SimOptions:
    """What the simulator should assume beyond the :class:`~cfp_megatron.base.config.JobSpec`."""

    attention: AttentionKernel = AttentionKernel.flash
    """How the attention core runs: a fused kernel that stores no ``s x s`` scores (FlashAttention / cuDNN, the
    default: NVIDIA's containers ship Transformer Engine), or Megatron's unfused core with or without its fused
    softmax kernel (:func:`cfp_megatron.base.parallel_dims.attention_kernel_here` says which one this machine runs)."""
    grouped_gemm: bool = True
    """The routed experts' GEMMs run as one grouped GEMM per linear layer (Megatron-Core's ``moe_grouped_gemm``, which
    it runs where Transformer Engine is installed): their launches do not grow with the local experts. ``False``:
    Megatron-Core's ``SequentialMLP`` loops over the local experts, launching each one's kernels from Python (the host
    term's launches per local expert, :mod:`cfp_megatron.sim.host_costs`)."""
    overlap_grad_reduce: bool | None = None
    """Overlap the DP gradient reduction with the backward pass; ``None`` follows ``parallel.overlap_grad_reduce``."""
    async_tp_backward: bool = True
    """The backward's TP/SP collectives run as Megatron's linear layers run them, beside the weight- and
    input-gradient GEMMs (:func:`~cfp_megatron.sim.terms.tensor_parallel.tp_backward_async_s`; Megatron-LM's
    ``async_tensor_model_parallel_allreduce``, megatron-core's ``allreduce_dgrad``); ``False``: each waited for, as
    the forward's (Megatron-LM before it, 2021)."""
    global_memory_buffer: bool = True
    """Megatron's global memory buffer holds sequence parallelism's gathers and the unfused core's score input for
    the run (:func:`~cfp_megatron.sim.memory.global_buffer_bytes`: Megatron-Core, Megatron-LM since 2022); ``False``:
    Megatron-LM before it (2021), whose core allocates that input in each layer's pass and frees it at once."""
    wgrad_placeholder: bool = True
    """Under ``gradient_accumulation_fusion`` Megatron's linears hand autograd a placeholder of the weight's shape
    (Megatron-Core: ``grad_added_to_main_grad``, set by its DDP; :func:`~cfp_megatron.sim.backward_memory.
    weight_grad_transient`); ``False``: ``None`` (Megatron-LM before 2023), no tensor."""
    measured_layer_only: bool = False
    """Time one forward and backward pass of the layers alone (no embedding, logits, optimizer or DP sync): for
    layer-level measurements."""
    use_measured_segments: bool = True
    """Where the measurements hold profiled segment times for the plan's partition (CFP), use them for the layers,
    embedding and head instead of the analytical cost (:mod:`cfp_megatron.sim.measured_segments`)."""
    moe_routing_imbalance: float = 1.0
    """Routed tokens the busiest expert rank receives, as a multiple of the balanced share: its expert GEMMs and its
    all-to-all grow by that factor. 1.0 is forced or perfect balance (NVIDIA's MoE benchmarks force it); training
    with an auxiliary balancing loss typically stays within 1.1-1.3 of it after the first steps."""
    pipeline_scatter_gather: bool = False
    """The exchange between pipeline stages as Megatron-LM ran it before Megatron-Core (its
    ``--scatter-gather-tensors-in-pipeline``, on by default there): each TP rank sends its 1/TP share of the
    activation and the receiving stage all-gathers it over TP. ``False``: Megatron-Core's, where every TP rank sends
    the whole tensor unless sequence parallelism split it (:func:`~cfp_megatron.sim.terms.pipeline.exchange_fit`)."""
    blocking_interleaved: bool = False
    """The interleaved schedule's exchanges as Megatron-LM ran them before Megatron-Core's ``overlap_p2p_comm``
    (``megatron/schedules.py`` and ``p2p_communication.py`` until 2023): each step one batched send and receive with
    both neighbouring stages, waited for, then the device synchronised
    (:func:`~cfp_megatron.sim.schedule.interleaved_blocking_order`). ``False``: Megatron-Core's, posted
    asynchronously and waited for by the pass that needs them, as the runtime trains. Without interleaving every
    exchange blocks either way."""
    te_cross_entropy: bool = False
    """The loss runs Transformer Engine's fused cross entropy (Megatron-Core's ``cross_entropy_loss_fusion`` with
    ``cross_entropy_fusion_impl='te'``, which NVIDIA's performance recipes set): it keeps the logits in their own
    dtype and turns them into their gradient in place, no fp32 copy (memory only; :func:`~cfp_megatron.sim.memory.
    loss_bytes_per_logit`). ``False``: Megatron-Core's default vocab-parallel cross entropy (and its ``native``
    fusion), which keeps an fp32 softmax beside them, as the runtime trains."""
    eager_torch_loss: bool = False
    """The loss is PyTorch's ``cross_entropy`` on an fp32 copy of the logits, run eagerly (torchtitan without
    ``compile`` of the loss; memory only: :data:`~cfp_megatron.sim.memory.EAGER_TORCH_CE_BYTES`), under TP its
    ``loss_parallel`` (:data:`~cfp_megatron.sim.memory.EAGER_LOSS_PARALLEL_BYTES`). ``False``: Megatron-Core's
    cross entropy."""
    torch_fsdp: bool = False
    """Sharded weights (``parallel.fsdp=optim_grads_params``) as PyTorch's FSDP keeps them (FSDP1 ``FULL_SHARD``,
    FSDP2 ``fully_shard``: torchtitan, llm-foundry): the fp32 shard is the parameter and its master weights, with no
    compute-precision shard beside it (memory only; :attr:`~cfp_megatron.sim.sharding.StateBytes.master_is_shard`).
    ``False``: Megatron-FSDP's, as the runtime trains."""
    offload_v1: bool = False
    """Activation offloading (``parallel.cpu_offloading_num_layers``) runs Transformer Engine's handler before 2.10
    (``AsyncDoubleBufferGroupOffloadHandler``; ``cpu_offload_v1.py`` with ``NVTE_CPU_OFFLOAD_V1=1`` from 2.10): its
    last offloaded layer is on the GPU beside the last layer's passes (memory only,
    :func:`~cfp_megatron.sim.memory.offload_resident_bytes`). ``False``: TE 2.10's ``OffloadSynchronizer``, the
    default of the Transformer Engine the runtime installs."""
    fsdp_unit_size: int | None = None
    """Megatron-FSDP's ``suggested_communication_unit_size`` (parameters) where the run set one: its reduce-scatter
    queue keeps that many parameters' unsharded gradients and its all-gather prefetches half as many
    (:class:`~cfp_megatron.sim.sharding.FsdpBuffers`; memory only). ``None``: Megatron-FSDP's default, twice a
    layer's parameters and at least 10^9, as the runtime trains."""
    fsdp_double_buffer: bool = False
    """Megatron-FSDP's ``fsdp_double_buffer``: two persistent buffers for the gathered weights and two for the
    unsharded gradients, so at most two layers of each at once (memory only). ``False``: its default, as the runtime
    trains."""
    torch_fused_adamw: bool = False
    """The optimizer step is PyTorch's fused AdamW over fp32 parameter shards after ``clip_grad_norm_``
    (torchtitan's default ``implementation="fused"``): its HBM traffic per parameter is
    :data:`~cfp_megatron.sim.terms.optimizer.TORCH_FUSED_ADAMW_BYTES`, not the fitted
    ``Efficiency.optimizer_bytes_per_param`` of Megatron-Core's distributed optimizer (the analytical step only).
    ``False``: Megatron-Core's, as the runtime trains."""
    moe_layer_syncs: int | None = None
    """Device-to-host synchronisations in each dropless MoE layer's forward; ``None``: Megatron-Core's
    (``cfp_megatron/sim/host.yaml``, ``moe_layer_syncs``). torchtitan's all-to-all dispatcher has one."""
    torch_op_sac: bool = False
    """Selective recomputation (``parallel.recompute=selective``) is torchtitan's per-op policy (``SelectiveAC``):
    every second ``mm`` of a block, the routed experts' grouped GEMMs and the element-wise kernels recomputed, the
    attention core and the all-to-all saved (:func:`~cfp_megatron.sim.terms.recompute.op_sac_recompute_s`; what
    its layers keep: :func:`~cfp_megatron.sim.memory.op_sac_saved_bytes`). ``False``: Megatron-Core's
    ``recompute_modules``, as the runtime trains."""
    torch_moe_combine: bool = False
    """The MoE layer is torchtitan's: its ``AllToAllTokenDispatcher`` sends the tokens alone (no routing
    probabilities' all-to-all), gathers and scatters the rows and combines them by their scores in fp32, each op's
    bytes counted forward and backward (:func:`~cfp_megatron.sim.terms.expert_dispatch.torch_dispatch_bytes`), and
    its ``GroupedExperts`` write their weight gradients once in bf16 (``torch._grouped_mm``). ``False``:
    Megatron-Core's ``MoEAlltoAllTokenDispatcher`` and ``TEGroupedMLP``."""
    torch_swiglu: bool = False
    """A SwiGLU model's MLPs are torchtitan's modules: its ``FeedForward`` (the dense MLP and the MoE layer's shared
    experts, ``w2(F.silu(w1(x)) * w3(x))``) and, in its MoE layer (:attr:`torch_moe_combine`), its
    ``GroupedExperts``: w1 and w3 two GEMMs, ``silu`` and the multiply unfused
    (:func:`~cfp_megatron.sim.terms.expert_dispatch.torch_swiglu_bytes`), what autograd keeps
    (:data:`~cfp_megatron.sim.memory.TORCH_SWIGLU_SAVED_FFN`) and their launches (:mod:`~cfp_megatron.sim.
    host_costs`). ``False``: Megatron-Core's one fc1 GEMM and fused SwiGLU."""
    dtensor_tp: bool = False
    """Tensor parallelism is torchtitan's DTensor plan (``SequenceParallel`` norms, the block's input redistributed
    to ``Replicate`` before its column-wise linears): under sequence parallelism the all-gathered input is the
    tensor autograd keeps for the linears' weight gradients, whole, and no backward gathers it again (memory:
    :func:`~cfp_megatron.sim.memory.sp_gathered_kept`). ``False``: Transformer Engine's linears, which keep their
    ``1 / tp`` shard and gather it again in the backward."""
    torchao_low_precision: bool = False
    """FP8/FP4 linears and grouped expert GEMMs are torchao's (``Float8Linear``, its scaled grouped MMs), which keep
    their high-precision input for the backward and quantise it again there (memory:
    :func:`~cfp_megatron.sim.memory.saved_input_bytes`). ``False``: Transformer Engine's, which keep the quantised
    copy their weight gradient reads."""
    flex_backend_unstated: bool = False
    """The flex dispatcher's backend is not known (a published run whose source names none): priced with DeepEP's
    rates and permutation over the whole NVLink domain, padded for FP8/FP4 in the kernel
    (:func:`~cfp_megatron.sim.terms.expert_dispatch.flex_kernels`). ``False``: ``parallel.moe_flex_dispatcher_backend``
    as Megatron-Core runs it."""
    apex_adam: ApexAdamStates | None = None
    """The distributed optimizer is Apex's ``DistributedFusedAdam`` keeping its states so (memory only;
    :meth:`~cfp_megatron.sim.sharding.StateBytes.megatron`). ``None``: Megatron-Core's distributed optimizer (fp32
    master weights and moments), as the runtime trains."""
    weight_grad_accumulation: WeightGradAccumulation = WeightGradAccumulation.fused
    """How each micro-batch's weight gradients join the step's (:class:`WeightGradAccumulation`); ``bf16_optimizer``
    wherever ``deepspeed_engine`` runs bf16 weights (:func:`~cfp_megatron.sim.grad_accumulation.accumulation_mode`).
    The default, ``fused``, is Megatron-LM's; a plan for this machine prices the runtime's
    (:func:`options_here`: ``main_grad_hook``, the fusion being off)."""
    rope_fusion: bool = True
    """Rotary position embeddings run as one fused kernel that keeps nothing beyond Q and K (Megatron-LM's
    default); ``False``: Megatron-Core's unfused RoPE (:meth:`unfused_rope`), which keeps its cos and sin for the
    backward pass (:func:`~cfp_megatron.sim.memory.layer_activation_bytes`) and makes more element-wise passes over
    Q and K (:data:`~cfp_megatron.sim.layer_cost.UNFUSED_ROPE_PASSES`), as the runtime trains (:func:`options_here`)
    and as Megatron-Core runs a YaRN embedding whose scale Transformer Engine's fused kernel lacks."""
    router_fusion: bool = True
    """A MoE model that sets :attr:`~cfp_megatron.base.config.ModelSpec.moe_router_fusion` runs Transformer Engine's
    fused router (:meth:`fused_router`); ``False``: Transformer Engine is missing where it trains, so Megatron-Core's
    PyTorch router runs instead (:func:`options_here` on CPU,
    :func:`~cfp_megatron.base.parallel_dims.router_fusion_here`)."""
    pipeline_schedule: PipelineSchedule = PipelineSchedule.megatron
    """The pipeline schedule priced (:class:`PipelineSchedule`); those other than Megatron-Core's run one model chunk
    a rank."""
    deepspeed_engine: bool = False
    """Data parallelism and the optimizer are DeepSpeed's engine's under its ``PipelineEngine`` (Megatron-DeepSpeed):
    the gradients all-reduced in the weights' dtype (its ``communication_data_type``) after the last micro-batch;
    with bf16 weights its ``BF16_Optimizer``, which adds each micro-batch's bf16 gradients into an fp32 buffer every
    rank keeps whole, all-reduces them whole and each rank steps its share of the fp32 states (at ZeRO stage 0 too)
    (:meth:`~cfp_megatron.sim.sharding.StateBytes.deepspeed`, :attr:`WeightGradAccumulation.bf16_optimizer`;
    docs/validation.md, "Megatron-DeepSpeed"). ``False``: Megatron-Core's DDP and distributed
    optimizer, as the runtime trains."""
    max_schedule_ops: int = 200_000
    """Largest pipeline schedule (ranks x micro-batches x chunks x 2) simulated event by event; larger ones use
    two shorter schedules extrapolated (:func:`cfp_megatron.sim.schedule.run_schedule`)."""

    def unfused_rope(self, model: ModelSpec) -> bool:
        """Whether ``model``'s rotary embedding runs Megatron-Core's unfused path (``rope_fusion`` off; a model
        without RoPE has none)."""
        return not self.rope_fusion and model.position_embedding is PositionEmbedding.rope

    def fused_router(self, model: ModelSpec) -> bool:
        """Whether ``model``'s router runs Transformer Engine's fused top-k and auxiliary-loss kernels
        (:attr:`~cfp_megatron.base.config.ModelSpec.moe_router_fusion` where :attr:`router_fusion` lets it), not
        in torchtitan's MoE layer (:attr:`torch_moe_combine`), whose router is its own."""
        return self.router_fusion and model.is_moe and model.moe_router_fusion and not self.torch_moe_combine

    @property
    def te_grouped_experts(self) -> bool:
        """Whether the routed experts are Transformer Engine's grouped linears (Megatron-Core's ``TEGroupedMLP``),
        whose C++ loops launch per-expert GEMMs and quantisation kernels: grouped GEMMs, and not torchtitan's experts
        (one ``torch._grouped_mm`` a linear, quantised by torchao: :attr:`torch_moe_combine`)."""
        return self.grouped_gemm and not self.torch_moe_combine

    def torch_swiglu_mlp(self, model: ModelSpec) -> bool:
        """Whether ``model``'s dense MLP and shared experts are torchtitan's ``FeedForward`` (:attr:`torch_swiglu` on a
        SwiGLU model): w1 and w3 two linears, ``silu(w1(x)) * w3(x)`` unfused."""
        return self.torch_swiglu and model.activation is Activation.swiglu

    def torch_swiglu_experts(self, model: ModelSpec) -> bool:
        """Whether ``model``'s routed experts are torchtitan's ``GroupedExperts`` (:meth:`torch_swiglu_mlp` in
        torchtitan's MoE layer, :attr:`torch_moe_combine`): w1 and w3 two grouped GEMMs, ``silu(x @ w1) * (x @ w3)``
        unfused (GPT-OSS's: :meth:`torch_gpt_oss_experts`)."""
        return self.torch_moe_combine and self.torch_swiglu_mlp(model)

    def torch_gpt_oss_experts(self, model: ModelSpec) -> bool:
        """Whether ``model``'s routed experts are torchtitan's ``GptOssGroupedExperts`` (its modules,
        :attr:`torch_swiglu`, in its MoE layer, :attr:`torch_moe_combine`, on GPT-OSS's clamped quick GEGLU): mlp1
        one grouped GEMM, its bias, the clamped SwiGLU and mlp2's bias unfused
        (:func:`~cfp_megatron.sim.terms.expert_dispatch.torch_gpt_oss_bytes`)."""
        return self.torch_moe_combine and self.torch_swiglu and model.activation is Activation.quick_geglu

    @property
    def flash_attention(self) -> bool:
        """Whether the attention core is a fused kernel that keeps no scores."""
        return self.attention is AttentionKernel.flash

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for an imbalance outside 1-64, negative syncs, a non-positive FSDP unit size or a
        ``max_schedule_ops`` below 1."""
        if not 1.0 <= self.moe_routing_imbalance <= 64.0:
            raise ConfigError(ConfigIssue(key="sim.moe_routing_imbalance", value=self.moe_routing_imbalance,
                                          problem="must be between 1 (balanced) and 64.",
                                          fix="use 1.0 for forced balance, e.g. 1.2 for aux-loss balancing."))
        if self.moe_layer_syncs is not None and self.moe_layer_syncs < 0:
            raise ConfigError(ConfigIssue(key="sim.moe_layer_syncs", value=self.moe_layer_syncs,
                                          problem="must be zero or more.",
                                          fix="count the synchronisations of one MoE layer's forward, e.g. 1."))
        if self.fsdp_unit_size is not None and self.fsdp_unit_size < 1:
            raise ConfigError(ConfigIssue(key="sim.fsdp_unit_size", value=self.fsdp_unit_size,
                                          problem="must be a positive number of parameters.",
                                          fix="give Megatron-FSDP's suggested_communication_unit_size, or None."))
        if self.max_schedule_ops < 1:
            raise ConfigError(ConfigIssue(key="sim.max_schedule_ops", value=self.max_schedule_ops,
                                          problem="must be positive.", fix="use e.g. 200000."))


def weight_grad_accumulation_here() -> WeightGradAccumulation:
    """How the runtime adds each micro-batch's weight gradients, on CPU as on a GPU: ``fused`` where it builds the
    linears with ``gradient_accumulation_fusion``
    (:func:`~cfp_megatron.base.parallel_dims.gradient_accumulation_fusion_here`, what
    :mod:`cfp_megatron.model.megatron_config` sets), else Megatron's DDP hook."""
    return (WeightGradAccumulation.fused if gradient_accumulation_fusion_here()
            else WeightGradAccumulation.main_grad_hook)


def options_here(cluster: ClusterSpec) -> SimOptions:
    """The options of a plan made for this machine from its profile, as the runtime builds the model here: the
    attention core (:func:`~cfp_megatron.base.parallel_dims.attention_kernel_here`: on CPU and on a GPU without
    Transformer Engine Megatron's unfused core, keeping its scores), whether the experts run a grouped GEMM and how
    the weight gradients are added (:func:`weight_grad_accumulation_here`) and whether RoPE is fused
    (:func:`~cfp_megatron.base.parallel_dims.rope_fusion_here`) and whether a router asking for it runs fused
    (:func:`~cfp_megatron.base.parallel_dims.router_fusion_here`). On CPU too: its layers' times come from
    their measured segments, but their memory follows these options."""
    on_gpu = not cluster.on_cpu
    return SimOptions(attention=attention_kernel_here(on_gpu=on_gpu), grouped_gemm=grouped_gemm_here(on_gpu=on_gpu),
                      weight_grad_accumulation=weight_grad_accumulation_here(), rope_fusion=rope_fusion_here(),
                      router_fusion=router_fusion_here(on_gpu=on_gpu))
