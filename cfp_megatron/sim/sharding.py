"""Data-parallel sharding as one model: DDP, Megatron's distributed optimizer, ZeRO 1-3, FSDP, HSDP and offload are
configurations of :class:`Sharding` (what is sharded over which group, what is offloaded) with the bytes per
parameter of each state category (:class:`StateBytes`). It gives each rank's memory of the weights, gradients and
optimizer states, and the gradient sync and parameter gather a step pays for them (docs/simulator.md,
"Data-parallel sharding")."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from cfp_megatron.base.config import FsdpStrategy, JobSpec, OptimizerKind, Precision
from cfp_megatron.base.enums import IdentityEnum
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.format_costs import FP32_BYTES, weight_element_bytes
from cfp_megatron.sim.kernels import element_bytes, grad_element_bytes
from cfp_megatron.sim.options import ApexAdamStates

# Apex's DistributedFusedAdam (apex/contrib/optimizers/distributed_fused_adam.py, StateBucket.__init__, as of
# 2024-07): each state bucket's shard holds exp_avg and exp_avg_sq in optim.dtype and, with store_param_remainders,
# an int16 remainder a parameter (the low 16 bits of the fp32 master; the bf16 weight is its high half); with
# store_params=False no parameter copy. NeMo 1 (nemo/collections/nlp/models/language_modeling/megatron_base_model.py,
# setup_optimization at r2.0.0rc1) sets store_params=False and store_param_remainders=True for fp32 states over bf16
# weights (megatron_amp_O2), store_params=False where the states are bf16 like the weights.
APEX_ADAM_BYTES = {ApexAdamStates.remainders: (2.0, 2 * FP32_BYTES), ApexAdamStates.bf16: (0.0, 2 * 2.0)}
"""(master-weight bytes, moment bytes) per parameter of Apex's DistributedFusedAdam over bf16 weights."""


class Sharded(enum.IntEnum):
    """What a rank keeps only its share of (ZeRO's stages: each shards what the one before did, and more)."""

    nothing = 0
    """DDP (ZeRO-0): every rank keeps every state."""
    optimizer = 1
    """Megatron's distributed optimizer, ZeRO-1: the fp32 master weights, main gradients and optimizer states."""
    gradients = 2
    """ZeRO-2: the gradients too; each micro-batch's gradients are reduce-scattered to their owners."""
    parameters = 3
    """ZeRO-3, FSDP, HSDP: the weights too, gathered layer by layer before each pass that uses them."""


class Engine(IdentityEnum):
    """Whose implementation keeps the states (they differ in which fp32 copies they make)."""

    megatron = "megatron"
    """Megatron-Core's DDP, distributed optimizer and FSDP."""
    deepspeed = "deepspeed"
    """DeepSpeed's ZeRO engine."""


_FSDP_SHARDED = {FsdpStrategy.optim: Sharded.optimizer, FsdpStrategy.optim_grads: Sharded.gradients,
                 FsdpStrategy.optim_grads_params: Sharded.parameters}
"""What each Megatron-FSDP sharding strategy shards."""


def megatron_sharded(*, distributed_optimizer: bool, fsdp: FsdpStrategy = FsdpStrategy.none) -> Sharded:
    """What Megatron-Core shards: what Megatron-FSDP's strategy says (``parallel.fsdp``), else the optimizer's states
    under the distributed optimizer, nothing under DDP."""
    if fsdp is not FsdpStrategy.none:
        return _FSDP_SHARDED[fsdp]
    return Sharded.optimizer if distributed_optimizer else Sharded.nothing


def optimizer_state_bytes(optimizer: OptimizerKind) -> float:
    """fp32 bytes per parameter of the optimizer's own states: Adam's two moments, SGD's momentum."""
    return 2 * FP32_BYTES if optimizer is OptimizerKind.adam else FP32_BYTES


@dataclass(frozen=True, kw_only=True, slots=True)
class StateBytes:
    """Bytes per parameter of each state category, before sharding."""

    weights: float
    """The weights in compute precision."""
    gradients: float
    """The gradient buffer the backward pass accumulates into, in the dtype the data-parallel reduction moves."""
    main_gradients: float
    """An fp32 copy of the gradients the optimizer steps from (zero where it steps from the buffer itself);
    sharded with the optimizer states."""
    master_weights: float
    """fp32 master weights (zero where the weights are their own master); sharded with the optimizer states."""
    optimizer_states: float
    """The optimizer's own states (:func:`optimizer_state_bytes`)."""
    master_is_shard: bool = False
    """PyTorch's FSDP (FSDP1 ``FULL_SHARD``, FSDP2 ``fully_shard``) under mixed precision: the rank's shard is the
    fp32 parameter itself, its master weights; the ``weights`` in compute precision exist only gathered, layer by
    layer (``MixedPrecision(param_dtype=...)`` casts at the all-gather). Megatron-FSDP keeps a compute-precision shard
    beside its fp32 master weights (``False``)."""
    wire: float | None = None
    """Bytes per gradient element the data-parallel reduction moves where they differ from :attr:`gradients`
    (DeepSpeed's engine casts its gradients to its ``communication_data_type``); ``None``: :attr:`gradients`."""

    @classmethod
    def megatron(cls, job: JobSpec, *, torch_fsdp: bool = False,
                 apex_adam: ApexAdamStates | None = None) -> StateBytes:
        """Megatron-Core: weights in the compute precision, plus under FP8/FP4 the quantised copies Transformer
        Engine keeps (or, with ``parallel.fp8_param_gather``, the FP8 weights alone:
        :func:`~cfp_megatron.sim.format_costs.weight_element_bytes`; all weights are counted, though the router,
        embedding and logits keep none); gradients in Megatron's buffer
        (:func:`~cfp_megatron.sim.kernels.grad_element_bytes`), which the optimizer steps from (its fp32 cast of a
        bf16 buffer at the step is not counted); fp32 master weights with 16-bit weights. ``torch_fsdp``: the
        weights sharded as PyTorch's FSDP shards them (:attr:`master_is_shard`). ``apex_adam``: Adam over 16-bit
        weights stepped by Apex's DistributedFusedAdam, its master weights and moments of :data:`APEX_ADAM_BYTES`."""
        elem = float(element_bytes(job))
        master, states = FP32_BYTES if elem == 2 else 0.0, optimizer_state_bytes(job.train.optimizer)
        if apex_adam is not None and elem == 2 and job.train.optimizer is OptimizerKind.adam:
            master, states = APEX_ADAM_BYTES[apex_adam]
        # PyTorch's FSDP gathers its weights in the compute precision and keeps no quantised copy: torchao's float8
        # linears cast the gathered weight in each matmul and save the high-precision one (Transformer Engine's
        # cached FP8 copies are Megatron-Core's)
        weights = elem if torch_fsdp else weight_element_bytes(job, elem)
        return cls(weights=weights, gradients=grad_element_bytes(job), main_gradients=0.0,
                   master_weights=master, optimizer_states=states, master_is_shard=torch_fsdp and elem == 2)

    @classmethod
    def deepspeed(cls, *, elem: float, stage: int, optimizer: OptimizerKind = OptimizerKind.adam,
                  bf16_optimizer: bool = False) -> StateBytes:
        """DeepSpeed's ZeRO engine at ``stage`` with ``elem``-byte weights: gradients reduced in the weights'
        dtype; an fp32 gradient partition and fp32 master weights where the weights are 16-bit, and at stages 1
        and 2 also for fp32 weights (they clone the partition); stage 3 with fp32 weights steps its fp32 partitions
        in place, sub-group by sub-group (``stage3.py``: "we don't need another copy of the weights"). Stage 2 is
        counted as reducing each bucket straight into the fp32 partition (its gradient partition in the weights'
        dtype, ``elem`` bytes over the group, is not counted: docs/simulator.md, "Data-parallel sharding").
        ``bf16_optimizer``: its ``BF16_Optimizer`` (bf16 weights at stage 0 or 1, ``deepspeed/runtime/
        bf16_optimizer.py``): each micro-batch's bf16 gradients and the fp32 buffer they are added into, both whole
        on every rank (it shards only the fp32 master weights and Adam's states), the reduction in bf16."""
        if bf16_optimizer:
            return cls(weights=elem, gradients=elem + FP32_BYTES, main_gradients=0.0, master_weights=FP32_BYTES,
                       optimizer_states=optimizer_state_bytes(optimizer), wire=elem)
        copies = elem != FP32_BYTES or stage in (Sharded.optimizer, Sharded.gradients)
        return cls(weights=elem, gradients=0.0 if stage == Sharded.gradients else elem,
                   main_gradients=FP32_BYTES if copies else 0.0, master_weights=FP32_BYTES if copies else 0.0,
                   optimizer_states=optimizer_state_bytes(optimizer), wire=elem)

    @property
    def reduced(self) -> float:
        """Bytes per gradient element the data-parallel reduction moves (:attr:`wire`)."""
        return self.gradients if self.wire is None else self.wire

    @property
    def optimizer_side(self) -> float:
        """Master weights and optimizer states: what the optimizer step owns, counted as optimizer states."""
        return self.master_weights + self.optimizer_states

    def replicated(self, sharded: Sharded) -> float:
        """Bytes per parameter every rank keeps whatever the group size, when ``sharded`` is sharded."""
        kept = 0.0 if sharded >= Sharded.parameters else self.weights
        kept += 0.0 if sharded >= Sharded.gradients else self.gradients
        return kept + (0.0 if sharded >= Sharded.optimizer else self.main_gradients + self.optimizer_side)


MEGATRON_FSDP_MIN_UNIT = 1_000_000_000
"""Megatron-FSDP's least default communication unit, in parameters (megatron_fsdp.py, ``MegatronFSDP.__init__``:
``suggested_communication_unit_size`` unset is twice the mean FSDP unit's parameters, capped below at 10^9)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class FsdpBuffers:
    """How many whole layers Megatron-FSDP (megatron-core 0.16.1, ``megatron_fsdp/param_and_grad_buffer.py``) holds
    unsharded at once, from its all-gather prefetch and its reduce-scatter queue (docs/simulator.md, "What FSDP holds
    unsharded")."""

    unit_size: int | None = None
    """``suggested_communication_unit_size`` in parameters; ``None``: the default (twice a layer's parameters, at
    least :data:`MEGATRON_FSDP_MIN_UNIT`)."""
    double_buffer: bool = False
    """``fsdp_double_buffer``: two fixed buffers each for the gathered weights and the unsharded gradients (its
    ``FixedPoolAllocator``, ``size=2``), which cap both at two layers."""

    def layers(self, layer_params: float, layers: int | None = None) -> tuple[int, int]:
        """(layers of weights gathered, layers of unsharded gradients) at a layer's backward pass, for layers of
        ``layer_params`` parameters on the rank (``layers`` of them on the stage; ``None``: no bound).
        ``AllGatherPipeline.all_gather_params`` adds the next layers to the gather while what it prefetched is below
        half the unit;
        ``GradReducePipeline.reduce_gradients`` pops (waits for and frees) the oldest queued reduce-scatter only
        while the queue holds more than a unit, then queues this layer's: so the queue keeps ``unit // layer``
        layers, one more once queued, besides the layer whose gradients are being made. The double buffer's
        ``_enforce_double_buffer_limit`` keeps two layers of each."""
        if layer_params <= 0:
            return 0, 0
        unit = self.unit_size if self.unit_size is not None else max(MEGATRON_FSDP_MIN_UNIT, 2 * layer_params)
        prefetched = max(1, math.ceil(unit // 2 / layer_params))
        weights, grads = 1 + prefetched, int(unit // layer_params) + 2
        if self.double_buffer:
            weights, grads = min(weights, 2), min(grads, 2)
        return (weights, grads) if layers is None else (min(weights, layers), min(grads, layers))


@dataclass(frozen=True, kw_only=True, slots=True)
class StateMemory:
    """One rank's bytes of each state category."""

    weights: float
    """Weights on the device."""
    gradients: float
    """Gradient buffers and main gradients on the device."""
    optimizer_states: float
    """Master weights and optimizer states on the device."""
    host: float
    """What offload keeps in host memory instead."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Sharding:
    """How data parallelism keeps and syncs one model's states: what is sharded (:class:`Sharded`) over which group
    size, and what is offloaded to the host."""

    sharded: Sharded
    """What each rank keeps only its share of."""
    state: StateBytes
    """Bytes per parameter of each state category."""
    group: int = 1
    """Ranks the dense parameters' sharded states are split over (Megatron: DP x CP; HSDP: the shard group)."""
    expert_group: int | None = None
    """Ranks the routed experts' sharded states are split over (Megatron's expert-DP group); ``None``: ``group``."""
    replicas: int = 1
    """HSDP: groups the shards are replicated across; the gradient reduction spans them too."""
    offload_optimizer: bool = False
    """Master weights, optimizer states and the fp32 gradient partition live in host memory (ZeRO-Offload); the
    optimizer steps on the host."""
    offload_params: bool = False
    """The weights live in host memory, copied to the device at each gather (ZeRO-3 parameter offload)."""
    gathers_once: bool = False
    """PyTorch's FSDP2 under a pipeline: each layer's weights gathered once a step and held for every micro-batch
    (torchtitan's ``reshard_after_forward`` default is off with PP), its gradients reduce-scattered once after the
    last backward (``torch.distributed.pipelining``'s stage runs every backward with ``set_requires_gradient_sync
    (False)`` and ``set_reshard_after_backward(False)``, then ``perform_reduce_grad``)."""
    reduce_whole: bool = False
    """The gradients are all-reduced whole though the optimizer's states are sharded (DeepSpeed's ``BF16_Optimizer``
    all-reduces its fp32 buffer, then each rank steps its share)."""
    megatron_fsdp: FsdpBuffers | None = None
    """Megatron-FSDP's buffers where it shards the weights (:meth:`gathered_bytes` counts its prefetch and queue);
    ``None``: PyTorch's FSDP2 rule, the layer computing and the one prefetched, one layer's gradients."""
    unsharded_grad_bytes: float = 0.0
    """PyTorch's FSDP2: bytes per parameter of the unsharded gradient autograd makes in the compute precision, held
    beside the previous layer's reduce-scatter input (in the reduction's dtype, :attr:`StateBytes.gradients`) until
    its own is copied in (``foreach_reduce``; ``reduce_scatter_max_input_buffers`` 1); zero elsewhere."""

    def __post_init__(self) -> None:
        """Raises :class:`ConfigError` for a group below one rank or parameter offload of unsharded weights."""
        for name, size in (("group", self.group), ("expert_group", self.expert_group or 1),
                           ("replicas", self.replicas)):
            if size < 1:
                raise ConfigError(ConfigIssue(key=f"sharding.{name}", value=size, problem="must be at least 1.",
                                              fix="give a number of ranks."))
        if self.offload_params and self.sharded < Sharded.parameters:
            raise ConfigError(ConfigIssue(key="backend.offload_param", value=True,
                                          problem="offloads parameters that are not sharded (ZeRO-3 only).",
                                          fix="use backend.zero_stage=3, or leave the parameters on the device."))

    @classmethod
    def megatron(cls, job: JobSpec, dims: ParallelDims, *, torch_fsdp: bool = False,
                 apex_adam: ApexAdamStates | None = None, deepspeed_engine: bool = False,
                 fsdp_buffers: FsdpBuffers | None = None) -> Sharding:
        """Megatron-Core's data parallelism for ``job`` laid out as ``dims``: Megatron-FSDP's strategy
        (``parallel.fsdp``), the distributed optimizer (``parallel.distributed_optimizer``: the optimizer's states)
        or DDP; the dense parameters' states over DP x CP, or over shard groups of ``parallel.dp_shard_size`` of them
        replicated across the rest (HSDP); the routed experts' over the expert-DP group. ``torch_fsdp``: the
        weights sharded as PyTorch's FSDP shards them (:attr:`StateBytes.master_is_shard`), gathered once a step
        under a pipeline (:attr:`gathers_once`); ``apex_adam``: the optimizer's states as Apex keeps them
        (:meth:`StateBytes.megatron`). ``deepspeed_engine``: DeepSpeed's engine keeps and reduces them instead
        (:attr:`~cfp_megatron.sim.options.SimOptions.deepspeed_engine`): with bf16 weights its ``BF16_Optimizer``,
        which shards its fp32 states at ZeRO stage 0 too; otherwise its ZeRO-1 where the distributed optimizer is on
        (:meth:`StateBytes.deepspeed`). ``fsdp_buffers``: Megatron-FSDP's communication unit and double buffer as
        the run set them (``None``: its defaults), where it shards the weights and ``torch_fsdp`` is off."""
        p = job.parallel
        dp_cp = dims.dp * dims.cp
        if deepspeed_engine and p.fsdp is FsdpStrategy.none:
            bf16 = job.train.precision is Precision.bf16
            sharded = Sharded.optimizer if bf16 or p.distributed_optimizer else Sharded.nothing
            return cls(sharded=sharded, state=StateBytes.deepspeed(elem=float(element_bytes(job)), stage=sharded,
                                                                   optimizer=job.train.optimizer, bf16_optimizer=bf16),
                       group=dp_cp, expert_group=dims.expert_dp, reduce_whole=bf16)
        shard = min(p.dp_shard_size or dp_cp, dp_cp)
        sharded = megatron_sharded(distributed_optimizer=p.distributed_optimizer, fsdp=p.fsdp)
        return cls(sharded=sharded, state=StateBytes.megatron(job, torch_fsdp=torch_fsdp, apex_adam=apex_adam),
                   group=shard, expert_group=dims.expert_dp, replicas=max(dp_cp // shard, 1),
                   gathers_once=torch_fsdp and dims.pp > 1 and sharded >= Sharded.parameters,
                   megatron_fsdp=(fsdp_buffers or FsdpBuffers()) if sharded >= Sharded.parameters and not torch_fsdp
                   else None,
                   unsharded_grad_bytes=float(element_bytes(job)) if torch_fsdp and sharded >= Sharded.parameters
                   else 0.0)

    @classmethod
    def zero(cls, *, stage: int, dp: int, elem: float, offload_optimizer: bool = False,
             offload_params: bool = False) -> Sharding:
        """DeepSpeed's ZeRO ``stage`` over ``dp`` ranks with ``elem``-byte weights (DeepSpeed's data parallelism
        spans every rank; its cost model assumes Adam)."""
        return cls(sharded=Sharded(stage), state=StateBytes.deepspeed(elem=elem, stage=stage), group=dp,
                   offload_optimizer=offload_optimizer, offload_params=offload_params)

    def _over(self, params: float, expert_params: float, per_param: float, sharded: bool) -> float:
        """Bytes of ``per_param`` over ``params`` (``expert_params`` of them routed experts'), split over the
        groups where ``sharded``."""
        if not sharded:
            return params * per_param
        experts = self._expert_ranks
        return (params - expert_params) * per_param / self.group + expert_params * per_param / experts

    def memory(self, params: float, expert_params: float = 0.0) -> StateMemory:
        """One rank's bytes of each state category for ``params`` parameters on it (``expert_params`` of them
        routed experts'), offload moved to the host."""
        state, sharded = self.state, self.sharded
        weights = self._over(params, expert_params, state.weights, sharded >= Sharded.parameters)
        if state.master_is_shard and sharded >= Sharded.parameters:
            weights = 0.0  # the shard is the fp32 master, counted with the optimizer's side
        grads = self._over(params, expert_params, state.gradients, sharded >= Sharded.gradients)
        by_optimizer = sharded >= Sharded.optimizer
        if state.main_gradients:
            grads += self._over(params, expert_params, state.main_gradients, by_optimizer)
        optimizer = self._over(params, expert_params, state.optimizer_side, by_optimizer)
        host = 0.0
        if self.offload_optimizer:
            # The fp32 gradient partition the host's optimizer steps from: the main gradients, or the (fp32)
            # gradient shard itself where there are none.
            fp32_grads = self._over(params, expert_params, FP32_BYTES, by_optimizer)
            host += optimizer + fp32_grads
            grads, optimizer = max(grads - fp32_grads, 0.0), 0.0
        if self.offload_params:
            host += weights
            weights = 0.0
        return StateMemory(weights=weights, gradients=grads, optimizer_states=optimizer, host=host)

    def optimizer_params(self, params: float, expert_params: float = 0.0) -> float:
        """Parameters whose optimizer step this rank runs (its shard where the optimizer is sharded)."""
        if self.sharded < Sharded.optimizer:
            return params
        experts = self._expert_ranks
        return (params - expert_params) / self.group + expert_params / experts

    def gathered_bytes(self, layer_params: float, expert_params: float = 0.0, *, layers: int | None = None) -> float:
        """Bytes of whole layers' weights a rank holds at once where weights are gathered per pass (zero elsewhere):
        the layer computing and the one prefetched (under Megatron-FSDP as many as its prefetch gathers,
        :meth:`FsdpBuffers.layers`), for ``layer_params`` parameters a layer on the rank (``expert_params`` of them
        routed experts', gathered only where the expert-DP group shards them: over one rank they stay whole, counted
        with the weights); where they are gathered once a step (:attr:`gathers_once`), all ``layers`` of the stage
        (one where not given) with their unsharded gradients, held through every pass. The gradients made per pass
        are :meth:`backward_grad_bytes`."""
        if not self.gathers_per_pass:
            return 0.0
        gathered = self._gathered(layer_params, expert_params)
        if self.gathers_once:
            # the stage's ``layers`` held whole, with their unsharded gradients accumulated in the reduction's dtype
            # (FSDPParam.to_accumulated_grad_if_needed)
            return (layers or 1) * gathered * (self.state.weights + self.state.gradients)
        weights = 2 if self.megatron_fsdp is None else self.megatron_fsdp.layers(layer_params, layers)[0]
        return weights * gathered * self.state.weights

    def backward_grad_bytes(self, layer_params: float, expert_params: float = 0.0, *, layers: int | None = None,
                            freed_per_layer: float = 0.0) -> float:
        """Bytes of unsharded gradients a rank holds at once in a backward pass where weights are gathered per pass
        (zero elsewhere, and where they are gathered once a step: :meth:`gathered_bytes`): they exist only from a
        layer's backward on, so they are the backward's working set, not beside the loss's logits. PyTorch's FSDP2
        holds one layer's in each of two dtypes; Megatron-FSDP the layer's being made and those its reduce-scatter
        queue keeps (:meth:`FsdpBuffers.layers`), each queued layer's backward having freed ``freed_per_layer``
        bytes of its activations first, so the queue adds only what a layer's gradients exceed them by."""
        if not self.gathers_per_pass or self.gathers_once:
            return 0.0
        layer = self._gathered(layer_params, expert_params) * (self.state.gradients + self.unsharded_grad_bytes)
        if self.megatron_fsdp is None:
            return layer
        grads = self.megatron_fsdp.layers(layer_params, layers)[1]
        return layer + max(grads - 1, 0) * max(layer - freed_per_layer, 0.0)

    def _gathered(self, layer_params: float, expert_params: float) -> float:
        """Parameters of a layer a gather makes whole (the experts' not where one rank holds them)."""
        return layer_params - (expert_params if self._expert_ranks == 1 else 0.0)

    @property
    def _expert_ranks(self) -> int:
        """Ranks the routed experts' states are sharded over."""
        return self.group if self.expert_group is None else self.expert_group

    @property
    def reduce_op(self) -> Collective:
        """How gradients are reduced: all-reduced where every rank keeps them all, else reduce-scattered to the
        shards' owners."""
        return (Collective.all_reduce if self.sharded is Sharded.nothing or self.reduce_whole
                else Collective.reduce_scatter)

    @property
    def reduces_per_microbatch(self) -> bool:
        """Whether every micro-batch's gradients are reduced (sharded gradients have nowhere to accumulate whole),
        not once per step at the accumulation boundary."""
        return self.sharded >= Sharded.gradients

    @property
    def gathers_after_step(self) -> bool:
        """Whether the updated weights are all-gathered after the optimizer step (sharded optimizer, whole
        weights)."""
        return Sharded.optimizer <= self.sharded < Sharded.parameters

    @property
    def gathers_per_pass(self) -> bool:
        """Whether each layer's weights are all-gathered before every pass that uses them (sharded weights)."""
        return self.sharded >= Sharded.parameters

    def pass_sync_s(self, costs: CollectiveCosts, layer_params: float, *, weight_bytes: float, per_node: int,
                    expert_params: float = 0.0, expert_per_node: int = 1) -> tuple[float, float]:
        """(gather, scatter) seconds of one layer's collectives around its passes: its ``layer_params`` weights on
        the rank (``weight_bytes`` an element) all-gathered before each pass where weights are gathered per pass,
        its gradients reduce-scattered after the backward where they are reduced per micro-batch (zero elsewhere).
        The dense weights go over the group (``per_node`` ranks of it on a node), the ``expert_params`` of routed
        experts among them over the expert-DP group (``expert_per_node`` on a node; none where it is one rank):
        Megatron-FSDP keeps expert parameters in buffers of their own over the expert-DP group, torchtitan shards
        them over its ``efsdp`` mesh (docs/simulator.md, "Experts under FSDP"). What the passes leave exposed of
        them: the data-parallel term's FSDP lane."""
        gather_s = scatter_s = 0.0
        per_node = min(per_node, self.group)  # an HSDP shard group of consecutive ranks, inside a node or across
        dense = layer_params - expert_params
        experts = expert_params > 0 and self._expert_ranks > 1
        if self.gathers_per_pass:
            gather_s = costs.seconds(Collective.all_gather, dense * weight_bytes, self.group, per_node)
        if self.reduces_per_microbatch:
            scatter_s = costs.seconds(Collective.reduce_scatter, dense * self.state.gradients, self.group, per_node)
        if experts and self.gathers_per_pass:
            gather_s += costs.seconds(Collective.all_gather, expert_params * weight_bytes, self._expert_ranks,
                                      expert_per_node)
        if experts and self.reduces_per_microbatch:
            scatter_s += costs.seconds(Collective.reduce_scatter, expert_params * self.state.gradients,
                                       self._expert_ranks, expert_per_node)
        return gather_s, scatter_s

    def step_sync_s(self, costs: CollectiveCosts, dense_params: float, expert_params: float, *, grad_bytes: float,
                    weight_bytes: float, per_node: int, expert_per_node: int) -> tuple[float, float]:
        """(gradient sync, parameter gather) seconds a step pays once, after its passes, for ``dense_params`` dense
        and ``expert_params`` routed experts' parameters on the rank (gradients of ``grad_bytes``, weights of
        ``weight_bytes`` an element), each priced as one collective over its group
        (``per_node``/``expert_per_node`` ranks of it on a node): the all-reduce or reduce-scatter at the
        accumulation boundary and the gather after the step. Where gradients are reduced per micro-batch and
        weights gathered per pass, that happens in the passes (the layer cost's FSDP lane): here only HSDP's
        all-reduce of each shard across the replicas (also after the reduce-scatter of a sharded optimizer's
        instances, Megatron-Core's ``num_distributed_optimizer_instances``). Where weights are gathered once a step
        (:attr:`gathers_once`) the gradients are reduce-scattered here, once."""
        experts = self._expert_ranks
        across_s = 0.0
        if self.replicas > 1:
            across = max(1, per_node // self.group)  # the shard groups are consecutive ranks
            across_s = costs.seconds(Collective.all_reduce, dense_params * grad_bytes / self.group, self.replicas,
                                     across)
        if self.reduces_per_microbatch and not self.gathers_once:
            return across_s + (costs.seconds(Collective.all_reduce, expert_params * grad_bytes / experts,
                                             self.replicas, max(1, per_node // self.group))
                               if self.replicas > 1 else 0.0), 0.0
        in_group = min(per_node, self.group)
        sync_s = (costs.seconds(self.reduce_op, dense_params * grad_bytes, self.group, in_group)
                  + costs.seconds(self.reduce_op, expert_params * grad_bytes, experts, expert_per_node) + across_s)
        gather_s = 0.0
        if self.gathers_after_step:
            gather_s = (costs.seconds(Collective.all_gather, dense_params * weight_bytes, self.group, in_group)
                        + costs.seconds(Collective.all_gather, expert_params * weight_bytes, experts,
                                        expert_per_node))
        return sync_s, gather_s
