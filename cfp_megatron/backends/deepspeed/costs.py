"""Step time and memory of a DeepSpeed ZeRO plan (DeepSpeed :class:`~cfp_megatron.plan.artifact.Plan`).

The model's passes (:class:`ZeroPasses`) come from one of two sources. For a Megatron-Core model
(``backend=deepspeed``, :func:`simulate_zero`) they are the Megatron simulator's for the same model without model
parallelism (DeepSpeed's data parallelism spans every rank;
:func:`~cfp_megatron.backends.deepspeed.zero_plan.model_job`), with full per-layer recomputation where the plan
checkpoints activations: profiled segment times where the ProfileDB has them (CFP), else the analytical kernels. For
a user's own model handed to ``deepspeed.initialize`` (:mod:`cfp_megatron.backends.deepspeed.hook_plan`) they are
measured on the live ranks. What ZeRO changes is modelled on top by :func:`zero_step`, the same for both, from
DeepSpeed's engine:

- **Gradient reduction.** What is reduced and gathered when follows from the sharding model (all-reduce or
  reduce-scatter, per step or per micro-batch, gathered after the step or per pass); DeepSpeed prices it per bucket
  and per module fetch. Stage 0 all-reduces every gradient at the accumulation boundary; stage 1 reduces to the
  partition owners there (a reduce-scatter's volume); stages 2 and 3 reduce-scatter in every micro-batch's backward
  pass (``overlap_comm`` lets it overlap the backward on GPUs). Stages 1 and 2 all-gather the updated parameters after
  the step; stage 3 keeps them partitioned and instead all-gathers each layer's parameters before its forward, its
  backward and its recomputation, in every micro-batch (prefetched on GPUs, so only what compute does not cover is
  exposed). Each collective is one call per bucket (stage 3: one per module fetch), so small models pay latency.
- **Offload.** ZeRO-Offload moves the fp32 gradient partition to the host and the updated parameters back in every
  step and runs Adam on the host (memory-bound at the host's bandwidth); parameter offload (stage 3) copies each
  gathered partition from the host in every fetch. On CPU ranks host and device memory are the same: the copies cost
  a memory copy.
- **Memory per rank.** The stage is a configuration of the data-parallel sharding model
  (:func:`zero_sharding`, :class:`~cfp_megatron.sim.sharding.Sharding` with DeepSpeed's
  :meth:`~cfp_megatron.sim.sharding.StateBytes.deepspeed` bytes: weights in compute precision, gradients, an fp32
  gradient partition, fp32 master weights and Adam's states, each divided by the data-parallel size where the stage
  partitions it, offload moved to the host); plus ZeRO's buckets, stage 3's live gathered parameters, and the
  activations of one micro-batch (the Megatron memory model; measured segment memory where profiled).

CPU ranks share cores: nothing overlaps there (gloo's collectives are CPU work), so every term adds up.

Where the DeepSpeed engine was probed on the live cluster (:mod:`cfp_megatron.backends.deepspeed.engine_probe`), its
measured costs per micro-batch and per step replace the analytical reduction, gather and optimizer terms of that
stage (stage 3 with checkpointing adds the analytical gather of the recomputation; offload stays analytical).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cfp_megatron.backends.deepspeed.zero_plan import model_job
from cfp_megatron.base.config import ClusterSpec, JobSpec, ModelSpec, Recompute
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.flops import dense_linear_weights, training_flops_per_token
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective, Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import ZERO3_PERSISTENCE_THRESHOLD
from cfp_megatron.sim.format_costs import FP32_BYTES
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache
from cfp_megatron.sim.prediction import GIB, MemoryBreakdown
from cfp_megatron.sim.sharding import Sharded, Sharding
from cfp_megatron.sim.simulate import simulate

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes, StageProbe


ADAM_HOST_BYTES_PER_PARAM = 32.0
"""Bytes CPU Adam moves per parameter: fp32 weight, gradient and two moments read, three written, a compute-
precision copy written."""

ZERO_SIM_OPTIONS = SimOptions(overlap_grad_reduce=False)
"""The Megatron simulator's options for a ZeRO plan's passes (its own DP terms are replaced here); a
:class:`CostCache` for :func:`simulate_zero` is made with them."""


def zero3_fetches(model: ModelSpec, threshold: int = ZERO3_PERSISTENCE_THRESHOLD) -> int:
    """ZeRO-3 parameter fetches per pass over a Megatron-Core model: in each transformer layer the QKV,
    attention-output, FC1 and FC2 linears whose weight holds more than ``threshold`` elements (DeepSpeed's
    ``stage3_param_persistence_threshold``, the exported plan's by default; norms and biases stay whole), and the
    embedding and the output layer likewise. The linears' shapes are multi- and grouped-query attention's and a
    dense MLP's (:func:`~cfp_megatron.base.flops.dense_linear_weights`)."""
    per_layer = sum(1 for n in dense_linear_weights(model) if n > threshold)
    ends = 2 if model.padded_vocab_size * model.hidden_size > threshold else 0
    return model.num_layers * per_layer + ends


@dataclass(frozen=True, kw_only=True)
class ZeroTimeBreakdown:
    """Where a ZeRO step's time goes; the fields add up to the step time."""

    compute_s: float
    """Forward, backward and recomputation of every micro-batch, with their fixed overheads."""
    grad_reduce_s: float
    """Gradient all-reduce (stage 0) or reduce-scatter (1-3) left exposed."""
    param_gather_s: float
    """Parameter all-gathers left exposed: after the step (stages 1-2), per layer fetch (stage 3)."""
    offload_s: float
    """Host-device copies left exposed (offload)."""
    optimizer_s: float
    """The optimizer step (on the host with optimizer offload)."""
    engine_s: float = 0.0
    """The DeepSpeed engine's measured costs beyond the passes (probed stages: reductions, gathers, hooks and the
    optimizer step together)."""
    in_passes: bool = False
    """Whether the reductions, gathers and host copies happen in the passes (stage 3 gathers each layer per pass),
    not after them: which data-parallel lane of the cost-term registry they are (:meth:`seconds`)."""

    @property
    def total_s(self) -> float:
        """Their sum: the step time."""
        return (self.compute_s + self.grad_reduce_s + self.param_gather_s + self.offload_s + self.optimizer_s
                + self.engine_s)

    def seconds(self, lane: str) -> float:
        """Seconds on the cost-term registry's lane named ``lane`` (:data:`~cfp_megatron.sim.terms.TERMS`; zero for a
        lane ZeRO has no share of): the exposed reductions, gathers and host copies are the data-parallel sharding
        term's, in the passes (``fsdp_comm_s``) or after them (``dp_comm_s``, :attr:`in_passes`); the optimizer step
        is the optimizer term's. The passes (:attr:`compute_s`) and the engine's measured costs (:attr:`engine_s`)
        are not split into lanes."""
        comm = self.grad_reduce_s + self.param_gather_s + self.offload_s
        return {"fsdp_comm_s" if self.in_passes else "dp_comm_s": comm, "optimizer_s": self.optimizer_s}.get(lane, 0.0)


@dataclass(frozen=True, kw_only=True)
class ZeroPredictionResult:
    """The simulator's answer for one ZeRO plan."""

    step_time_s: float
    """Seconds per optimizer step."""
    time: ZeroTimeBreakdown
    """Step time by component."""
    memory: MemoryBreakdown
    """Peak device memory per rank by component (``comm_buffers`` holds ZeRO's buckets and stage 3's gathered
    parameters)."""
    host_bytes: float
    """Host memory per rank that offload uses (fp32 partitions, optimizer states, offloaded parameters)."""
    tokens_per_s_per_gpu: float
    """Trained tokens per second per GPU."""
    model_tflops_per_gpu: float
    """Model FLOP/s per GPU in TFLOP/s."""
    fits: bool
    """Whether the peak fits the device memory (always true when the capacity is unknown)."""


@dataclass(frozen=True, kw_only=True)
class ZeroPasses:
    """The model's side of one ZeRO plan, as the ZeRO terms of :func:`zero_step` read it: its passes, size and
    activations. Two sources: the Megatron simulator for a Megatron-Core model (:func:`megatron_passes`, the
    ``backend=deepspeed`` path) and the live measurements of a user's own model
    (:mod:`cfp_megatron.backends.deepspeed.hook_plan`, the ``deepspeed.initialize`` hook). Times are for the plan's
    whole step (every micro-batch of it), so the ZeRO terms stay exactly what they were before the split."""

    forward_s: float
    """Forward seconds of every micro-batch of one step, compute only."""
    backward_s: float
    """Backward seconds of every micro-batch of one step (the recomputation not included)."""
    recompute_s: float
    """Recomputation seconds (activation checkpointing) of every micro-batch of one step."""
    overhead_s: float
    """Fixed seconds per step around the passes (the schedule's own cost per micro-batch, summed)."""
    optimizer_s: float
    """The optimizer step on the device, over what the plan leaves on each rank (its partition from stage 1)."""
    params: float
    """Parameters on each rank before ZeRO partitions them (the whole model: no model parallelism)."""
    layers: int
    """Repeated blocks (transformer layers); stage 3's live gathered parameters are one block's."""
    fetches: int
    """ZeRO-3 parameter fetches (all-gather calls) per pass over the model."""
    activation_bytes: float
    """Peak activation memory of one micro-batch (saved for the backward pass, plus the working set)."""
    comm_buffers_bytes: float = 0.0
    """Communication buffers the passes hold beyond ZeRO's own (logits, gather buffers)."""
    flops_per_token: float
    """Model FLOPs (forward and backward, no recomputation) per trained token, for the MFU figure."""
    single_pass_s: float | None = None
    """Forward, backward and overhead seconds of one micro-batch of one sample without checkpointing: what the
    engine probes' per-micro-batch cost is measured beyond (``None``: not needed, no probes)."""

    @property
    def compute_s(self) -> float:
        """Forward, backward, recomputation and overhead of the step."""
        return self.forward_s + self.backward_s + self.recompute_s + self.overhead_s


def megatron_passes(job: JobSpec, plan: Plan, measurements: Measurements | None, *, cluster: ClusterSpec,
                    cache: CostCache, single_pass: bool = False) -> ZeroPasses:
    """The passes of ``job``'s Megatron-Core model under ``plan`` from the Megatron simulator (module docstring);
    ``single_pass`` adds :attr:`ZeroPasses.single_pass_s` (one more simulation, for the engine probes)."""
    world = plan.dp
    mjob = dataclasses.replace(model_job(plan, job), cluster=cluster)
    base = simulate(mjob, cluster, measurements, world_size=world, options=ZERO_SIM_OPTIONS, cache=cache)
    t = base.time
    elem = _element_bytes(plan)
    single = None
    if single_pass:
        one = dataclasses.replace(plan, micro_batch_size=1, global_batch_size=plan.dp, predicted=None,
                                  parallel=dataclasses.replace(plan.parallel, recompute=Recompute.none))
        t1 = simulate(dataclasses.replace(model_job(one, job), cluster=cluster), cluster, measurements,
                      world_size=world, options=ZERO_SIM_OPTIONS, cache=cache).time
        single = t1.forward_compute_s + t1.backward_compute_s + t1.overhead_s
    layers = job.model.num_layers
    return ZeroPasses(forward_s=t.forward_compute_s, backward_s=t.backward_compute_s, recompute_s=t.recompute_s,
                      overhead_s=t.overhead_s, optimizer_s=t.optimizer_s,
                      params=base.memory.parameters / elem,  # every parameter on the rank (no model parallelism)
                      layers=layers, fetches=zero3_fetches(job.model),
                      activation_bytes=base.memory.activations, comm_buffers_bytes=base.memory.comm_buffers,
                      flops_per_token=training_flops_per_token(job.model, plan.seq_length), single_pass_s=single)


def simulate_zero(job: JobSpec, plan: Plan, measurements: Measurements | None = None, *,
                  cluster: ClusterSpec | None = None, cache: CostCache | None = None,
                  probes: EngineProbes | None = None) -> ZeroPredictionResult:
    """Predict one step of ``plan`` for ``job`` (see the module docstring). ``cache`` shares pass costs between the
    plans of one search (made for the job of :func:`model_job`); ``probes`` are the engine's measured costs."""
    cluster = cluster or job.cluster
    mjob = dataclasses.replace(model_job(plan, job), cluster=cluster)
    cache = cache or CostCache.for_job(mjob, measurements, ZERO_SIM_OPTIONS)
    probe = probes.stages.get(plan.zero_stage) if probes is not None else None
    passes = megatron_passes(job, plan, measurements, cluster=cluster, cache=cache, single_pass=probe is not None)
    layout = build_layout(mjob, plan.dp)
    return zero_step(plan, passes, cache.collectives, cluster, dp_per_node=layout.dp_per_node, probe=probe)


def zero_step(plan: Plan, passes: ZeroPasses, costs: CollectiveCosts, cluster: ClusterSpec, *,
              dp_per_node: int, probe: StageProbe | None = None) -> ZeroPredictionResult:
    """One step of ``plan`` given the model's ``passes``: ZeRO's reductions, gathers, offload, optimizer and memory
    on top (module docstring). ``costs`` prices the collectives over the ``plan.dp`` ranks, ``dp_per_node`` of them
    on each node; ``probe`` is the engine's measured cost of this stage."""
    world = plan.dp
    elem = _element_bytes(plan)
    on_cpu = cluster.on_cpu
    compute = passes.compute_s
    backward = passes.backward_s + passes.recompute_s
    mb = plan.gradient_accumulation_steps
    params = passes.params
    layers = passes.layers
    dp, per_node = world, dp_per_node
    bucket = float(plan.bucket_elements)

    def calls(op: Collective, total_bytes: float, count: float) -> float:
        """``count`` equal calls of ``op`` moving ``total_bytes`` together."""
        if count <= 0 or total_bytes <= 0:
            return 0.0
        return count * costs.seconds(op, total_bytes / count, dp, per_node)

    sharding = zero_sharding(plan)
    grad_bytes = sharding.state.reduced  # DeepSpeed reduces gradients in their own dtype
    buckets = max(1.0, math.ceil(params / bucket))
    reduction = calls(sharding.reduce_op, params * grad_bytes, buckets)  # every gradient reduced once
    reduce_s = gather_s = offload_s = 0.0
    if not sharding.gathers_per_pass:
        if sharding.reduces_per_microbatch:  # in each micro-batch's backward pass
            reduce_s = mb * (reduction if on_cpu else max(reduction - backward / mb, reduction / buckets))
        else:  # at the accumulation boundary
            reduce_s = reduction
        if sharding.gathers_after_step:
            gather_s = calls(Collective.all_gather, params * elem, buckets)
    else:
        passes_per_mb = 3 if plan.activation_checkpointing else 2
        fetches = passes.fetches
        gather_mb = passes_per_mb * calls(Collective.all_gather, params * elem, fetches)
        reduce_mb = reduction
        if sharding.offload_params:
            offload_mb = passes_per_mb * _host_copy(params * elem / dp, cluster, per_node)
        else:
            offload_mb = 0.0
        if on_cpu:
            gather_s, reduce_s, offload_s = mb * gather_mb, mb * reduce_mb, mb * offload_mb
        else:  # prefetched: exposed only where the micro-batch's compute does not cover it, and the first fetch
            covered = compute / mb
            comm = gather_mb + reduce_mb + offload_mb
            exposed = max(comm - covered, comm / max(fetches, 1))
            share = exposed / comm if comm > 0 else 0.0
            gather_s, reduce_s, offload_s = mb * gather_mb * share, mb * reduce_mb * share, mb * offload_mb * share
    optimizer_s = passes.optimizer_s
    if sharding.offload_optimizer:
        shard = sharding.optimizer_params(params)
        optimizer_s = shard * ADAM_HOST_BYTES_PER_PARAM / _host_memory_rate(cluster, per_node)
        offload_s += (_host_copy(shard * FP32_BYTES, cluster, per_node)
                      + _host_copy(shard * elem, cluster, per_node))
    engine_s = 0.0
    if probe is not None:
        if passes.single_pass_s is None:
            raise ValueError("zero_step with an engine probe needs ZeroPasses.single_pass_s")
        engine_s = mb * probe.per_microbatch_s(passes.single_pass_s) + probe.per_step_s
        extra = gather_s / 3 if plan.zero_stage == 3 and plan.activation_checkpointing else 0.0
        reduce_s, gather_s, optimizer_s = 0.0, extra, (optimizer_s if plan.offload_optimizer else 0.0)
    time = ZeroTimeBreakdown(compute_s=compute, grad_reduce_s=reduce_s, param_gather_s=gather_s,
                             offload_s=offload_s, optimizer_s=optimizer_s, engine_s=engine_s,
                             in_passes=sharding.gathers_per_pass)
    memory, host = _memory(plan, sharding, passes, elem, layers)
    step = time.total_s
    tok = plan.global_batch_size * plan.seq_length / step / world
    return ZeroPredictionResult(step_time_s=step, time=time, memory=memory, host_bytes=host,
                                tokens_per_s_per_gpu=tok, model_tflops_per_gpu=tok * passes.flops_per_token / 1e12,
                                fits=cluster.hbm_gib is None or memory.total <= cluster.hbm_gib * GIB)


def _element_bytes(plan: Plan) -> float:
    """Bytes per parameter in the plan's compute precision."""
    return 2.0 if plan.precision in ("bf16", "fp16") else 4.0


def offload_unpriced(cluster: ClusterSpec, *, optimizer: bool) -> tuple[str, ...]:
    """The cluster fields ZeRO-Offload's terms need that ``cluster`` leaves unset, for optimizer offload
    (``optimizer``) or parameter offload: ``host_link_gbps`` for the copies on GPUs, ``host_memory_bandwidth_gbps``
    for CPU Adam and for the copies on CPU ranks; empty where it states them."""
    needed = () if cluster.on_cpu else ("host_link_gbps",)
    if optimizer or cluster.on_cpu:
        needed += ("host_memory_bandwidth_gbps",)
    return tuple(key for key in needed if getattr(cluster, key) is None)


def _stated(cluster: ClusterSpec, key: str) -> float:
    """``cluster.<key>``, a host figure ZeRO-Offload's terms need; a :class:`ConfigError` naming it where unset."""
    value = getattr(cluster, key)
    if value is None:
        raise ConfigError([ConfigIssue(
            key=f"cluster.{key}", value=None, problem="is not stated, and ZeRO-Offload's host terms need it.",
            fix=f"set cluster.{key} (its field's docstring says what it is; the DGX presets state it with its "
                "source), or plan without offload (backend.offload_optimizer=false backend.offload_param=false).")])
    return float(value)


def _host_memory_rate(cluster: ClusterSpec, ranks_per_node: int) -> float:
    """Bytes per second of host memory one rank's share of its node's CPU memory bandwidth reaches."""
    return _stated(cluster, "host_memory_bandwidth_gbps") * 1e9 / max(ranks_per_node, 1)


def _host_copy(nbytes: float, cluster: ClusterSpec, ranks_per_node: int) -> float:
    """Seconds to copy ``nbytes`` between host and device memory over one GPU's host link
    (``cluster.host_link_gbps``); on CPU ranks a memory copy at the rank's share of host memory bandwidth."""
    if cluster.on_cpu:
        return nbytes / _host_memory_rate(cluster, ranks_per_node)
    return nbytes / (_stated(cluster, "host_link_gbps") * 1e9)


def zero_sharding(plan: Plan) -> Sharding:
    """``plan``'s ZeRO stage and offload as a configuration of the data-parallel sharding model
    (:class:`~cfp_megatron.sim.sharding.Sharding`): the bytes of each state, what is sharded over the ``plan.dp``
    ranks, what is offloaded."""
    return Sharding.zero(stage=plan.zero_stage, dp=plan.dp, elem=_element_bytes(plan),
                         offload_optimizer=plan.offload_optimizer, offload_params=plan.offload_param)


def _memory(plan: Plan, sharding: Sharding, passes: ZeroPasses, elem: float,
            layers: int) -> tuple[MemoryBreakdown, float]:
    """Device memory per rank and host memory per rank under ``plan`` (module docstring): the states as
    ``sharding`` keeps them, and ZeRO's own buffers."""
    params = passes.params
    states = sharding.memory(params)
    bucket = min(float(plan.bucket_elements), params)
    buffers = 0.0
    if sharding.sharded is not Sharded.nothing:  # the reduction bucket, and the partition it lands in per micro-batch
        buffers = (2 if sharding.reduces_per_microbatch else 1) * bucket * elem
    if sharding.gathers_per_pass:  # the gathered parameters live at once: prefetched, at most two buckets
        live = min(2.0 * float(plan.bucket_elements), 2.0 * params / max(layers, 1) + bucket)
        buffers += live * elem
    memory = MemoryBreakdown(parameters=states.weights, gradients=states.gradients,
                             optimizer_states=states.optimizer_states, activations=passes.activation_bytes,
                             comm_buffers=passes.comm_buffers_bytes + buffers, stage=0)
    return memory, states.host
