"""What one micro-batch costs on one rank (seconds), per kind of layer, before the schedule arranges it.

:func:`pass_costs` gathers the analytical layer costs (:mod:`cfp_megatron.sim.layer_cost`), replaces them with
profiled segments where the measurements hold them (CFP, :mod:`cfp_megatron.sim.measured_segments`), and applies the
measured in-schedule overheads (docs/simulator.md, "pass_costs.py"). Plans of one search that agree on everything
these costs read share one computation through a :class:`CostCache` (:func:`cost_key` names that).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from cfp_megatron.base.config import ClusterSpec, FsdpStrategy, JobSpec, MlpPartition, ParallelSpec, Recompute
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Measurements, StepOverheads, partition_name
from cfp_megatron.sim.calibration import Efficiency, efficiency_for
from cfp_megatron.sim.host_costs import HostCosts, host_costs
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import (
    LayerCost,
    LayerPasses,
    PassCost,
    embedding_cost,
    grad_accumulation_s,
    layer_passes,
    mtp_projection_cost,
    output_layer_cost,
    with_recompute,
)
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.measured_segments import apply_measured, measured_pass
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.schedule import ScheduleResult


def collective_costs(cluster: ClusterSpec, measurements: Measurements | None,
                     efficiency: Efficiency | None = None) -> CollectiveCosts:
    """The collective cost model (seconds per collective) of ``cluster``: measured fits where ``measurements`` has
    them, else the links at the shares of nominal bandwidth ``efficiency`` (the cluster generation's fitted one by
    default) gives."""
    efficiency = efficiency or efficiency_for(cluster)
    return CollectiveCosts(cluster, measurements, intra_efficiency=efficiency.intra_node_comm,
                           inter_efficiency=efficiency.inter_node_comm)


@dataclass(frozen=True, kw_only=True)
class PassCosts:
    """Per-micro-batch costs (seconds) on one rank of each kind of layer of one plan."""

    dense: LayerCost
    """One dense decoder layer (its MLP under the plan's partition)."""
    megatron_dense: LayerCost | None
    """One dense decoder layer with Megatron's MLP partition where the plan leaves layers to it beyond
    ``parallel.primepar_layers`` (``None`` where every dense layer runs :attr:`dense`; see
    :func:`~cfp_megatron.sim.primepar_cost.megatron_twin`)."""
    moe: LayerCost
    """One MoE decoder layer (the dense one for a dense model)."""
    embedding: tuple[PassCost, PassCost]
    """Forward and backward of the embedding (on the first stage)."""
    head: tuple[PassCost, PassCost]
    """Forward and backward of the final norm, output layer and loss (on the last stage)."""
    per_pass: PassCost
    """The schedule's own cost added to the forward and to the backward call of the stages that hold the embedding
    or the head (measured; else zero)."""
    overheads: StepOverheads | None
    """The measured step overheads used, if any."""
    mtp_projection: tuple[PassCost, PassCost] = (PassCost(), PassCost())
    """Forward and backward of what one multi-token-prediction layer runs besides its decoder layer (a layer of
    :attr:`moe`'s kind, the model's last): the shifted tokens' embedding, three norms and the ``2h -> h``
    projection (:func:`~cfp_megatron.sim.layer_cost.mtp_projection_cost`); zero without MTP. Its output head and
    loss are another :attr:`head` on the chunk that holds the loss."""
    mtp_projection_params: float = 0.0
    """Parameters of those parts on one rank (the projection and the norms; the embedding table is counted where
    the chunk holds one)."""
    bf16_ends: tuple[LayerCost, LayerCost] | None = None
    """A dense and a MoE decoder layer (:attr:`dense`, :attr:`moe`) with their GEMMs in bf16: the layers
    ``parallel.num_layers_at_start_in_bf16`` / ``_end_in_bf16`` keep out of the job's FP8/FP4 format (``None``
    without them, or in a 16/32-bit format)."""
    host: HostCosts | None = None
    """The host's seconds per layer kind and pass (:func:`~cfp_megatron.sim.host_costs.host_costs`), which the
    simulator sets against each model chunk's GPU time (:mod:`cfp_megatron.sim.terms.host`); ``None`` where the host
    is not priced apart: on a CPU cluster (the host is the device) and where measured decoder-layer times stand in
    (the probes' timings hold the host's launches; measurements that time no layer of the plan leave it priced)."""


def comm_options(parallel: ParallelSpec) -> tuple[Any, ...]:
    """The plan's communication options the layer costs read (CP exchange type, expert and TP overlaps, the flex
    dispatcher's backend, Megatron-FSDP's strategy and shard group), and its CUDA graphs (the host's launches,
    :attr:`PassCosts.host`)."""
    return (parallel.cp_comm_type, parallel.tp_comm_overlap, parallel.moe_a2a_overlap,
            parallel.moe_flex_dispatcher_backend, parallel.moe_shared_expert_overlap, parallel.cuda_graph_impl,
            parallel.cuda_graph_scope, parallel.fsdp, parallel.dp_shard_size)


def cost_key(layout: Layout, recompute: Recompute, options: SimOptions,
             mlp: MlpPartition = MlpPartition.megatron, *, sp: bool | None = None,
             micro_batch: int | None = None, comm: tuple[Any, ...] = (),
             recompute_modules: str | None = None) -> tuple[Any, ...]:
    """Everything of a plan that :func:`pass_costs` reads (its layout, recompute choice and modules, MLP partition and
    communication options, :func:`comm_options`), for plans of one model on one cluster with one set of options and
    measurements, as a hashable tuple: equal keys, equal costs. ``sp`` and ``micro_batch`` stand in for the layout's
    own (they do not move groups between nodes: a search places a family once for all of them)."""
    dims = layout.dims
    sharded = any(isinstance(c, FsdpStrategy) and c is not FsdpStrategy.none for c in comm)
    fsdp = (dims.dp, layout.dp_per_node) if sharded else ()  # the FSDP lane's groups
    return (dims.tp, dims.sp if sp is None else sp, dims.cp, dims.ep, dims.etp,
            layout.micro_batch if micro_batch is None else micro_batch, layout.seq_length, recompute,
            layout.tp_per_node, layout.cp_per_node, layout.ep_per_node, layout.ep_per_host, layout.domain_size, fsdp,
            mlp, comm,
            recompute_modules if recompute is Recompute.selective else None)


def plan_cost_key(layout: Layout, parallel: ParallelSpec, options: SimOptions) -> tuple[Any, ...]:
    """:func:`cost_key` of a plan laid out as ``layout`` with ``parallel``'s recompute choice and modules, MLP
    partition and communication options."""
    return cost_key(layout, parallel.recompute, options, parallel.mlp, comm=comm_options(parallel),
                    recompute_modules=parallel.recompute_modules)


@dataclass(kw_only=True)
class CostCache:
    """Cost models, pass costs and timed schedules shared by the plans of one search: one model, cluster,
    precision, set of options and measurements (:meth:`for_job`); :func:`~cfp_megatron.sim.simulate.simulate`
    refuses it for anything else."""

    job: JobSpec
    """A job of the search (its model, cluster and precision are what the cache serves)."""
    measurements: Measurements | None
    """The measurements used."""
    options: SimOptions
    """The simulator options used."""
    efficiency: Efficiency
    """The efficiencies used."""
    kernels: KernelModel
    """The kernel model of that cluster and precision."""
    collectives: CollectiveCosts
    """The collective cost model of that cluster."""
    costs: dict[tuple[Any, ...], PassCosts] = field(default_factory=dict)
    """Pass costs by :func:`cost_key`."""
    analytical: dict[tuple[Any, ...], AnalyticalParts] = field(default_factory=dict)
    """What pass costs share across recompute choices, by :func:`analytical_key`."""
    schedules: dict[tuple[Any, ...], ScheduleResult] = field(default_factory=dict)
    """Timed pipeline schedules by their pass durations, send/receive time and micro-batch count."""
    groups: dict[tuple[Any, ...], Any] = field(default_factory=dict)
    """What a search's bound counts for a group of candidates (:class:`~cfp_megatron.sim.bounds.GroupCosts`) by the
    search's group key, for the groups the runtime's validation passed: what searches of several node counts share
    (:meth:`resized`)."""
    kept_bytes: dict[tuple[Any, ...], tuple[float, float]] = field(default_factory=dict)
    """Activation bytes a dense and a MoE decoder layer keep per micro-batch at least, by what they depend on (the
    search's memory bound; none of it the node count)."""
    exchanges: dict[tuple[str, int], Any] = field(default_factory=dict)
    """The pipelined probe of a partition at a micro-batch size against its pricing
    (:class:`~cfp_megatron.sim.simulate.ProbeCalibration`, ``None`` where none can be had), by partition and size."""
    layer_params: dict[tuple[Any, ...], LayerParams] = field(default_factory=dict)
    """The parameters of the pass costs computed so far, by :func:`params_key` (what a memory prediction reads of
    them: :func:`~cfp_megatron.sim.simulate.predict_memory`)."""
    laid_out: tuple[JobSpec, int | None, Layout] | None = None
    """The last plan a memory prediction validated and laid out without pricing its passes (the job, by identity,
    its world size and its layout): the simulator reads the layout from it when it simulates the same job."""
    prepared: tuple[tuple[Any, ...], Any] | None = None
    """The last plan :func:`~cfp_megatron.sim.simulate.simulate` prepared (its arguments, by identity, and its
    validated layout and pass costs): a search predicts a candidate's memory, then simulates the same job."""

    @classmethod
    def for_job(cls, job: JobSpec, measurements: Measurements | None, options: SimOptions,
                efficiency: Efficiency | None = None) -> CostCache:
        """An empty cache for the plans of ``job``'s model on its cluster."""
        efficiency = efficiency or efficiency_for(job.cluster)
        return cls(job=job, measurements=measurements, options=options, efficiency=efficiency,
                   kernels=KernelModel(job.cluster, efficiency, NumberFormat.of(job.train),
                                       measurements=measurements),
                   collectives=collective_costs(job.cluster, measurements, efficiency))

    def resized(self, job: JobSpec, measurements: Measurements | None, options: SimOptions) -> CostCache:
        """This cache's costs for ``job``, whose cluster may differ from the cache's in its node count alone; a new,
        empty cache where anything else differs. The pass costs read where a plan's groups sit (:func:`cost_key`),
        never how many nodes there are, so the searches of one model on clusters of one kind and several sizes
        share them (``cfp size``)."""
        cluster = self.job.cluster
        if job.cluster is not cluster and dataclasses.replace(job.cluster, nodes=cluster.nodes) != cluster:
            return CostCache.for_job(job, measurements, options)
        resized = dataclasses.replace(self, job=job)  # the same dictionaries: what one search adds, the next reads
        if not resized.serves(job, measurements, options, efficiency_for(job.cluster)):
            return CostCache.for_job(job, measurements, options)
        return resized

    def serves(self, job: JobSpec, measurements: Measurements | None, options: SimOptions,
               efficiency: Efficiency) -> bool:
        """Whether ``job`` (under these measurements, options and efficiencies) is a plan this cache was made for."""
        return (job.cluster is self.job.cluster or job.cluster == self.job.cluster) \
            and (job.model is self.job.model or job.model == self.job.model) \
            and job.train.precision is self.job.train.precision and job.train.fp8_recipe is self.job.train.fp8_recipe \
            and job.train.fp4_recipe is self.job.train.fp4_recipe and measurements is self.measurements \
            and (options is self.options or options == self.options) \
            and (efficiency is self.efficiency or efficiency == self.efficiency)


@dataclass(frozen=True, kw_only=True)
class AnalyticalParts:
    """The analytical costs of a plan that its recompute choice does not change (plans that differ only in it share
    them: :func:`analytical_key`)."""

    dense: LayerPasses
    """One dense decoder layer's passes."""
    moe: LayerPasses
    """One MoE decoder layer's passes (the dense one's for a dense model)."""
    embedding: tuple[PassCost, PassCost]
    """Forward and backward of the embedding (zero with ``measured_layer_only``)."""
    head: tuple[PassCost, PassCost]
    """Forward and backward of the final norm, output layer and loss (zero with ``measured_layer_only``)."""
    mtp: tuple[PassCost, PassCost, float]
    """:attr:`PassCosts.mtp_projection` and :attr:`PassCosts.mtp_projection_params`."""


def analytical_parts(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts,
                     options: SimOptions) -> AnalyticalParts:
    """The :class:`AnalyticalParts` of ``job`` under ``layout``."""
    model = job.model
    dense = layer_passes(job, layout, kernels, costs, options, moe=False)
    moe = layer_passes(job, layout, kernels, costs, options, moe=True) if model.is_moe else dense
    if options.measured_layer_only:
        embedding = head = (PassCost(), PassCost())
    else:
        embedding = embedding_cost(job, layout, kernels, costs)
        head = output_layer_cost(job, layout, kernels, costs)
        if layout.dims.pp > 1 or not model.tie_embeddings:
            # the output layer's own weight (the embedding's cost holds the tied weight's add)
            accumulate_s = grad_accumulation_s(job, layout, kernels, options,
                                               model.padded_vocab_size * model.hidden_size / layout.dims.tp)
            head = (head[0], head[1].plus(PassCost(compute_s=accumulate_s, weight_grad_s=accumulate_s)))
    mtp = (PassCost(), PassCost(), 0.0)
    if model.mtp_num_layers and not options.measured_layer_only:
        mtp = mtp_projection_cost(job, layout, kernels, costs)
    return AnalyticalParts(dense=dense, moe=moe, embedding=embedding, head=head, mtp=mtp)


class LayerParams(NamedTuple):
    """Parameters on one rank of :class:`PassCosts`' layers: what a memory prediction reads of them."""

    dense: float
    """One dense decoder layer's (:attr:`PassCosts.dense`)."""
    moe: float
    """One MoE decoder layer's (:attr:`PassCosts.moe`)."""
    moe_experts: float
    """Its routed experts' share."""
    mtp_projection: float
    """:attr:`PassCosts.mtp_projection_params`."""

    @classmethod
    def of(cls, parts: PassCosts) -> LayerParams:
        """Those of ``parts``."""
        return cls(dense=parts.dense.params, moe=parts.moe.params, moe_experts=parts.moe.expert_params,
                   mtp_projection=parts.mtp_projection_params)


def params_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`cost_key`'s ``key`` less the recompute choice and modules, the FSDP lane's groups and the
    communication options: what a layer's parameters on a rank read (its TP, expert and expert-TP sizes and its MLP
    partition, :func:`~cfp_megatron.sim.layer_cost.layer_passes`; the rest is kept to match whole layouts), so plans
    of one layout that differ only in those share their :class:`LayerParams`."""
    return key[:7] + key[8:13] + key[14:15]


def analytical_key(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """:func:`cost_key`'s ``key`` less the recompute choice and modules: what :class:`AnalyticalParts` read."""
    return key[:7] + key[8:-1]


def pass_costs(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, options: SimOptions,
               measurements: Measurements | None, analytical: AnalyticalParts | None = None) -> PassCosts:
    """The per-micro-batch costs (seconds) of ``job`` under ``layout`` on one rank (see the module docstring),
    computed with ``kernels`` and the collective model ``costs``, without :attr:`PassCosts.megatron_dense` (the
    simulator adds its Megatron twin's dense layer where the plan needs it); ``analytical``: its
    :class:`AnalyticalParts` where another recompute choice of the plan computed them already."""
    model = job.model
    if analytical is None:
        analytical = analytical_parts(job, layout, kernels, costs, options)
    dense = with_recompute(analytical.dense, job, layout, kernels)
    moe = with_recompute(analytical.moe, job, layout, kernels) if model.is_moe else dense
    embedding, head = analytical.embedding, analytical.head
    overheads = None
    analytical_layers = (dense, moe)
    if options.use_measured_segments:
        dense, moe, measured_embedding, measured_head = apply_measured(job, measurements, layout.micro_batch, dense,
                                                                       moe, embedding, head)
        if not options.measured_layer_only:
            embedding, head = measured_embedding, measured_head
            if measurements is not None and not (model.is_moe and model.moe_first_dense_layers):
                # one decoder layer kind (a dense model, or a MoE model without dense layers): the probes' layer
                overheads = _step_overheads(job, measurements, layout.micro_batch)
    per_pass = PassCost()
    if overheads is not None:
        # The layer as it runs inside the training schedule, and the schedule's own cost per micro-batch beyond the
        # segments, on the forward and backward call of the stages that hold the embedding or the head (why the
        # ends pay it: docs/simulator.md, "In-schedule overheads").
        dense = in_schedule(dense, overheads.layer_s)
        moe = in_schedule(moe, overheads.layer_s) if model.is_moe else dense
        per_pass = PassCost(overhead_s=overheads.per_microbatch_s / 2)
        embedding, head = _ends_in_schedule(embedding, head, overheads.ends_s)
    mtp = analytical.mtp
    host = None
    if not job.cluster.on_cpu and dense is analytical_layers[0] and moe is analytical_layers[1]:
        # priced apart only where no measured layer time stands in (a probe's timing holds the host's launches)
        host = host_costs(job, local_experts=(model.num_experts or 1) // layout.dims.ep,
                          grouped_gemm=options.grouped_gemm, te_experts=options.te_grouped_experts,
                          torch_experts=options.torch_swiglu_experts(model),
                          torch_gpt_oss=options.torch_gpt_oss_experts(model),
                          torch_mlp=options.torch_swiglu_mlp(model),
                          moe_layer_syncs=options.moe_layer_syncs,
                          expert_cast_launches=kernels.format.expert_cast_launches,
                          fused_router=options.fused_router(model))
    return PassCosts(dense=dense, megatron_dense=None, moe=moe, embedding=embedding, head=head, per_pass=per_pass,
                     overheads=overheads, mtp_projection=mtp[:2], mtp_projection_params=mtp[2], host=host)


def _step_overheads(job: JobSpec, measurements: Measurements, micro_batch: int) -> StepOverheads | None:
    """The overheads round's figures for the plan's partition at ``micro_batch`` sequences; ``None`` where they
    cannot be had. A PrimePar MLP borrows its Megatron twin's (docs/simulator.md, "In-schedule overheads")."""
    parallel = job.parallel
    base = partition_name(parallel.tp, sp=parallel.sp)
    overheads = measurements.step_overheads(base, micro_batch)
    if overheads is None or parallel.mlp is MlpPartition.megatron:
        return overheads
    own = measured_pass(measurements, "dense", partition_name(parallel.tp, sp=parallel.sp, mlp=parallel.mlp),
                        micro_batch)
    twin = measured_pass(measurements, "dense", base, micro_batch)
    if own is None or twin is None or sum(twin) <= 0:
        return None
    return dataclasses.replace(overheads, partition=partition_name(parallel.tp, sp=parallel.sp, mlp=parallel.mlp),
                               layer_s=overheads.layer_s * sum(own) / sum(twin))


def _ends_in_schedule(emb: tuple[PassCost, PassCost], out: tuple[PassCost, PassCost], ends_s: float
                      ) -> tuple[tuple[PassCost, PassCost], tuple[PassCost, PassCost]]:
    """The embedding's and the head's (forward, backward) scaled together by the share ``ends_s`` seconds (zero or
    below, :attr:`~cfp_megatron.cluster.measured.StepOverheads.ends_s`) takes off their isolated time."""
    total_s = sum(cost.total_s for cost in (*emb, *out))
    if ends_s >= 0 or total_s <= 0:
        return emb, out
    keep_share = max(1.0 + ends_s / total_s, 0.0)
    return ((emb[0].scaled(keep_share), emb[1].scaled(keep_share)),
            (out[0].scaled(keep_share), out[1].scaled(keep_share)))


def in_schedule(cost: LayerCost, layer_s: float) -> LayerCost:
    """``cost`` with its forward and backward (and recomputation) rescaled to ``layer_s`` seconds of forward plus
    backward, keeping its forward-to-backward split; its expert token exchange, which the probes (no expert
    parallelism) did not run, is kept beside it."""
    fwd, bwd, rec = (p.total_s - p.ep_comm_s for p in (cost.forward, cost.backward, cost.recompute))
    if fwd + bwd <= 0:
        return cost
    forward_share = fwd / (fwd + bwd)
    recompute_ratio = rec / fwd if fwd > 0 else 0.0
    return LayerCost(forward=PassCost(compute_s=forward_share * layer_s, ep_comm_s=cost.forward.ep_comm_s),
                     backward=PassCost(compute_s=(1 - forward_share) * layer_s, ep_comm_s=cost.backward.ep_comm_s),
                     recompute=PassCost(compute_s=recompute_ratio * forward_share * layer_s,
                                        ep_comm_s=cost.recompute.ep_comm_s),
                     params=cost.params, expert_params=cost.expert_params, ep_alone_s=cost.ep_alone_s)
