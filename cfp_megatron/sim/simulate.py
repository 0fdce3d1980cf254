"""The simulator's entry point: :func:`simulate` predicts the step time (seconds) and peak memory (bytes per rank)
of one plan. How the step time is composed: docs/simulator.md, "simulate.py"."""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from cfp_megatron.base.config import ClusterSpec, JobSpec, MlpPartition, ParallelSpec, Precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.base.pipeline_split import (
    ChunkLayers,
    SplitKey,
    bf16_end_layers,
    job_chunks,
    job_split,
    split_chunks,
)
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Measurements, PipelineProbe, StepOverheads, partition_name
from cfp_megatron.sim.calibration import Efficiency, efficiency_for
from cfp_megatron.sim.format_costs import bf16_twin
from cfp_megatron.sim.host_costs import exchange_sync_s
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layer_cost import LayerCost, PassCost
from cfp_megatron.sim.layout import Layout, build_layout
from cfp_megatron.sim.memory import Stage, layout_memory, stage
from cfp_megatron.sim.options import PipelineSchedule, SimOptions
from cfp_megatron.sim.pass_costs import (
    CostCache,
    LayerParams,
    PassCosts,
    analytical_key,
    analytical_parts,
    collective_costs,
    params_key,
    pass_costs,
    plan_cost_key,
)
from cfp_megatron.sim.prediction import GIB, Event, EventKind, MemoryBreakdown, Prediction, TimeBreakdown
from cfp_megatron.sim.primepar_cost import megatron_twin
from cfp_megatron.sim.schedule import ScheduleResult, dependency_floors, first_backward, run_schedule
from cfp_megatron.sim.terms import TERMS, Placement, StepInputs, StepTimes
from cfp_megatron.sim.terms.host import with_host
from cfp_megatron.sim.terms.pipeline import (
    exchange_fit,
    exchange_fits,
    exchange_gather_s,
    exchange_nic_s,
    shared_cores_schedule,
)


def simulate(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
             options: SimOptions | None = None, efficiency: Efficiency | None = None, world_size: int | None = None,
             with_events: bool = False, cache: CostCache | None = None) -> Prediction:
    """Predict the step time (seconds) and peak memory (bytes per rank) of ``job`` on ``cluster`` (default:
    ``job.cluster``).

    ``measurements`` (profiled collectives and GEMMs) win over the cluster's nominal figures; ``efficiency``
    overrides the fitted efficiencies (for fitting); ``world_size`` defaults to nodes x GPUs per node;
    ``with_events`` keeps the timed schedule for timeline export; ``cache`` shares pass costs and cost models
    between the plans of one search (:class:`CostCache`). Returns a :class:`Prediction`.
    Raises :class:`~cfp_megatron.base.errors.ConfigError` for a plan that cannot run.
    """
    return typing.cast(Prediction, _simulate(job, cluster, measurements, options, efficiency, world_size,
                                             with_events, cache, None))  # None only with a prune_above


def simulate_unless_slower(job: JobSpec, prune_above: float, cluster: ClusterSpec | None = None,
                           measurements: Measurements | None = None, *, options: SimOptions | None = None,
                           world_size: int | None = None, cache: CostCache | None = None) -> Prediction | None:
    """:func:`simulate`, or ``None`` when a lower bound on the step time computed before the pipeline schedule is
    timed already exceeds ``prune_above`` seconds (a search's k-th best): the schedule is most of a simulation
    (docs/simulator.md, "Pruning bound")."""
    return _simulate(job, cluster, measurements, options, None, world_size, False, cache, prune_above)


def _simulate(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
              options: SimOptions | None, efficiency: Efficiency | None, world_size: int | None, with_events: bool,
              cache: CostCache | None, prune_above: float | None, exchange_s: float | None = None
              ) -> Prediction | None:
    """:func:`simulate` and :func:`simulate_unless_slower` (``None`` only when ``prune_above`` prunes the plan).
    ``exchange_s``: the seconds of one exchange between pipeline stages, given (the pipelined probe's pricing,
    :func:`_probe_calibration`) instead of found (:func:`_pipeline_terms`)."""
    job, layout, options, efficiency, kernels, costs, parts = _prepare(job, cluster, measurements, options,
                                                                       efficiency, world_size, cache)
    cluster = job.cluster
    dims = layout.dims
    model = job.model
    overheads = parts.overheads
    pp, vpp = dims.pp, dims.vpp
    split = _stage_split(job, layout, parts)
    layer_params, expert_params = split.layer_params, split.expert_params
    forward_costs, backward_costs, recompute_costs = _pass_grid(job, dims, parts)
    forward_s, backward_s = _grid_seconds(forward_costs, backward_costs, recompute_costs)
    if exchange_s is None:
        p2p_s, fixed_s, outside_s = _pipeline_terms(job, layout, kernels, costs, measurements, options, efficiency,
                                                    cache, overheads)
    else:
        p2p_s, fixed_s, outside_s = exchange_s, 0.0, 0.0
    # Every after-schedule lane of the cost terms per rank (the gradient sync, the optimizer step, ...).
    vocab_params = model.padded_vocab_size * model.hidden_size / dims.tp
    after = _after_lanes(StepInputs(
        job=job, layout=layout, kernels=kernels, collectives=costs, options=options, efficiency=efficiency,
        overheads=overheads, expert_params=tuple(expert_params), backward_s=tuple(sum(row) for row in backward_s),
        forward_s=tuple(sum(row) for row in forward_s), layer_params=tuple(layer_params),
        params=tuple(layer_params[rank] + split.vocab_tables[rank] * vocab_params for rank in range(pp))))
    if outside_s:
        # What a pipelined step paid outside its schedule beyond the probes without a pipeline (_pipeline_terms).
        after = _outside_corrected(after, outside_s)
    slowdown = measurements.busy_slowdown() if overheads is not None else None
    shared_cores = slowdown is not None and pp > 1
    schedule_kind = _schedule_kind(options, dims)
    # A zero-bubble schedule runs each rank's weight gradients as passes of their own (docs/simulator.md,
    # "Zero-bubble schedules").
    weight_s = (tuple(row[0].weight_grad_s for row in backward_costs)
                if schedule_kind in (PipelineSchedule.zb_h1, PipelineSchedule.zb_h2) else None)
    if prune_above is not None and schedule_kind is PipelineSchedule.megatron:
        # A lower bound on the step without timing the schedule (cfp_megatron.search.search): no schedule ends before
        # its dependencies allow (dependency_floors); with shared cores the mean rank's work bounds every rank.
        busy_s = tuple(dims.num_microbatches * (sum(forward_s[rank]) + sum(backward_s[rank])) for rank in range(pp))
        floors_s = [sum(busy_s) / pp] * pp if shared_cores else dependency_floors(forward_s, backward_s, busy_s)
        if max(_after_end(floors_s[rank] + fixed_s, after, rank) for rank in range(pp)) > prune_above:
            return None

    # Megatron-Core's non-interleaved schedule blocks both stages in every exchange and, on a GPU, synchronises
    # after it (docs/simulator.md, "Blocking exchanges"); the interleaved one overlaps them with the passes, where
    # Megatron-LM's before it blocked too ("Blocking interleaved exchanges").
    blocking = (pp > 1 and schedule_kind is PipelineSchedule.megatron
                and (vpp == 1 or options.blocking_interleaved))
    call_s = exchange_sync_s() if blocking and not cluster.on_cpu else 0.0
    # Megatron-LM's scatter/gather exchange: the receiver all-gathers each received share after the blocking
    # exchange, on its own (docs/simulator.md, "Blocking interleaved exchanges").
    gather_s = (exchange_gather_s(job, layout, kernels, costs, scatter_gather=options.pipeline_scatter_gather)
                if blocking else 0.0)
    # Interleaved, its steady state sends to both neighbours at once, over one NIC where they sit in other NVLink
    # domains (the schedule counts which: docs/simulator.md, "Exchanges that share a NIC").
    nic_s = exchange_nic_s(job, layout, kernels, costs, options) if blocking else None

    def timed() -> ScheduleResult:
        return _schedule(forward_s, backward_s, p2p_s, dims.num_microbatches, slowdown if shared_cores else None,
                         with_events, options, blocking=blocking, call_s=call_s, weight_s=weight_s, gather_s=gather_s,
                         nic_s=nic_s)

    if cache is not None and not with_events:  # plans that differ only outside the schedule (e.g. the optimizer)
        schedule_key = (tuple(map(tuple, forward_s)), tuple(map(tuple, backward_s)), p2p_s, dims.num_microbatches,
                        blocking, call_s, schedule_kind, weight_s, gather_s, nic_s)
        schedule = cache.schedules.get(schedule_key)
        if schedule is None:
            schedule = cache.schedules[schedule_key] = timed()
    else:
        schedule = timed()
    if fixed_s:  # what every pipelined step pays in its schedule whatever its micro-batches (_pipeline_terms)
        schedule = dataclasses.replace(schedule, end_s=tuple(max(end_s + fixed_s, 0.0) for end_s in schedule.end_s))

    finish_s = [_after_end(schedule.end_s[rank], after, rank) for rank in range(pp)]
    critical_rank = max(range(pp), key=lambda rank: finish_s[rank])
    step_s = finish_s[critical_rank]

    num_microbatches = dims.num_microbatches
    fwd_total = PassCost()
    bwd_total = PassCost()
    rec_total = PassCost()
    for chunk_index in range(vpp):
        fwd_total, bwd_total, rec_total = (fwd_total.plus(forward_costs[critical_rank][chunk_index]),
                                           bwd_total.plus(backward_costs[critical_rank][chunk_index]),
                                           rec_total.plus(recompute_costs[critical_rank][chunk_index]))
    # Each cost term's lanes on the critical rank (cfp_megatron.sim.terms). Where its schedule ends before its passes
    # add up (ranks sharing cores run some of them at once; a probe's negative fixed cost), the passes' lanes are
    # its schedule's shares, as the timeline draws them: the lanes add up to the step.
    busy_s, schedule_end_s = schedule.busy_s[critical_rank], schedule.end_s[critical_rank]
    if busy_s > schedule_end_s > 0:
        share = schedule_end_s / busy_s
        fwd_total, bwd_total, rec_total = (fwd_total.scaled(share), bwd_total.scaled(share), rec_total.scaled(share))
        busy_s = schedule_end_s
    breakdown = TimeBreakdown.of(TERMS.time(StepTimes(
        microbatches=num_microbatches, forward=fwd_total, backward=bwd_total, recompute=rec_total,
        schedule_s=schedule_end_s, busy_s=busy_s,
        after_s={name: seconds[critical_rank] for name, seconds in after.items()})))

    memory = _peak_memory(job, layout, options, measurements, split)
    world = dims.world_size
    sequences = layout.micro_batch * num_microbatches * dims.dp
    tokens_per_s = sequences * layout.seq_length / step_s / world
    events = _events(schedule, forward_costs, backward_costs, recompute_costs, after) if with_events else ()
    return Prediction(step_time_s=step_s, time=breakdown, memory=memory,
                      bubble_fraction=breakdown.pp_bubble_s / schedule_end_s if schedule_end_s else 0.0,
                      tokens_per_s_per_gpu=tokens_per_s,
                      model_tflops_per_gpu=tokens_per_s * training_flops_per_token(model, layout.seq_length) / 1e12,
                      num_microbatches=num_microbatches,
                      fits=cluster.hbm_gib is None or memory.total <= cluster.hbm_gib * GIB,
                      events=events)


def _prepare(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
             options: SimOptions | None, efficiency: Efficiency | None, world_size: int | None,
             cache: CostCache | None, layout: Layout | None = None
             ) -> tuple[JobSpec, Layout, SimOptions, Efficiency, KernelModel, CollectiveCosts, PassCosts]:
    """The validated layout, the cost models and the pass costs of ``job`` (from ``cache`` where it has them;
    ``layout``: ``job``'s, validated already)."""
    if cache is not None and cache.prepared is not None:
        args, found = cache.prepared
        if all(a is b for a, b in zip(args[:5], (job, cluster, measurements, options, efficiency), strict=True)) \
                and args[-1] == world_size:
            return found
    prepared = _prepared(job, cluster, measurements, options, efficiency, world_size, cache, layout)
    if cache is not None:
        cache.prepared = ((job, cluster, measurements, options, efficiency, world_size), prepared)
    return prepared


def _prepared(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
              options: SimOptions | None, efficiency: Efficiency | None, world_size: int | None,
              cache: CostCache | None, layout: Layout | None = None
              ) -> tuple[JobSpec, Layout, SimOptions, Efficiency, KernelModel, CollectiveCosts, PassCosts]:
    """:func:`_prepare`, computed."""
    cluster = cluster or job.cluster
    if cluster is not job.cluster:
        job = JobSpec(model=job.model, cluster=cluster, parallel=job.parallel, train=job.train, data=job.data)
    options = options or SimOptions()
    efficiency = efficiency or efficiency_for(cluster)
    if layout is None and cache is not None and cache.laid_out is not None and cache.laid_out[0] is job \
            and cache.laid_out[1] == world_size:
        layout = cache.laid_out[2]  # validated by the memory prediction just before
    layout = layout or build_layout(job, world_size)
    if cache is None:
        costs = collective_costs(cluster, measurements, efficiency)
        kernels = KernelModel(cluster, efficiency, NumberFormat.of(job.train), measurements=measurements)
    elif not cache.serves(job, measurements, options, efficiency):
        raise ValueError("a CostCache serves the plans of one model, cluster, precision, set of options and "
                         "measurements (CostCache.for_job)")
    else:
        kernels, costs = cache.kernels, cache.collectives

    def costs_of(plan: JobSpec) -> PassCosts:
        if cache is None:
            return pass_costs(plan, layout, kernels, costs, options, measurements)
        key = plan_cost_key(layout, plan.parallel, options)
        found = cache.costs.get(key)
        if found is None:  # the analytical parts are shared by the plan's recompute choices
            shared = analytical_key(key)
            parts = cache.analytical.get(shared)
            if parts is None:
                parts = cache.analytical[shared] = analytical_parts(plan, layout, kernels, costs, options)
            found = cache.costs[key] = pass_costs(plan, layout, kernels, costs, options, measurements, parts)
            cache.layer_params[params_key(key)] = LayerParams.of(found)
        return found

    parts = costs_of(job)
    ends_in_bf16 = job.parallel.num_layers_at_start_in_bf16 or job.parallel.num_layers_at_end_in_bf16
    if ends_in_bf16 and NumberFormat.of(job.train).low:  # the stack's ends run their GEMMs in bf16
        twin = bf16_twin(job)
        ends_key = ("bf16_ends", *plan_cost_key(layout, twin.parallel, options))
        ends = cache.costs.get(ends_key) if cache is not None else None
        if ends is None:  # priced without measured segments: they ran their GEMMs in the job's format
            ends = pass_costs(twin, layout, KernelModel(cluster, efficiency, NumberFormat(precision=Precision.bf16)),
                              costs, options, None)
            if cache is not None:
                cache.costs[ends_key] = ends
        parts = dataclasses.replace(parts, bf16_ends=(ends.dense, ends.moe))
    if job.parallel.primepar_layers is not None:  # the dense layers beyond it run its Megatron twin's
        parts = dataclasses.replace(parts, megatron_dense=costs_of(megatron_twin(job)).dense)
    return job, layout, options, efficiency, kernels, costs, parts


def prepare_costs(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                  options: SimOptions | None = None, world_size: int | None = None,
                  cache: CostCache | None = None, layout: Layout | None = None) -> PassCosts:
    """The per-micro-batch pass costs (seconds per layer kind) :func:`simulate` would use for ``job`` (validated;
    from ``cache`` where it has them): what a search's lower bound is built from. ``layout``: ``job``'s layout,
    validated already (:func:`~cfp_megatron.sim.layout.build_layout`), which is then not validated again."""
    return _prepare(job, cluster, measurements, options, None, world_size, cache, layout)[-1]


def schedule_fixed_s(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                     options: SimOptions | None = None, world_size: int | None = None,
                     cache: CostCache | None = None) -> float:
    """What :func:`simulate` adds to every pipeline rank's schedule of ``job`` whatever its split and micro-batches
    (the pipelined probe's ``fixed_s``, :func:`_pipeline_terms`; any sign, zero without a pipeline or a probe that
    prices it): a search's lower bound adds it too (cfp_megatron.sim.bounds)."""
    if measurements is None or job.parallel.pp == 1:
        return 0.0
    job, layout, options, efficiency, kernels, costs, parts = _prepare(job, cluster, measurements, options, None,
                                                                       world_size, cache)
    return _pipeline_terms(job, layout, kernels, costs, measurements, options, efficiency, cache, parts.overheads)[1]


def predict_memory(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                   options: SimOptions | None = None, world_size: int | None = None,
                   cache: CostCache | None = None) -> MemoryBreakdown:
    """Peak memory per rank (bytes) of the most loaded pipeline stage of ``job``: what :func:`simulate` reports as
    ``memory``, without timing the schedule (a search checks memory first)."""
    if cache is not None:  # parameters from pass costs of the same layout under other communication options
        found = _params_split(job, cluster, measurements, options, world_size, cache)
        if found is not None:
            plan, layout, plan_options, split = found
            return _peak_memory(plan, layout, plan_options, measurements, split)
    job, layout, options, _, _, _, parts = _prepare(job, cluster, measurements, options, None, world_size, cache)
    split = _stage_split(job, layout, parts)
    return _peak_memory(job, layout, options, measurements, split)


def _params_split(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
                  options: SimOptions | None, world_size: int | None, cache: CostCache
                  ) -> tuple[JobSpec, Layout, SimOptions, _StageSplit] | None:
    """``job`` validated and laid out, its options, and its :func:`_stage_split` from the :class:`LayerParams` of
    pass costs ``cache`` holds for its layout (:func:`params_key`), without pricing its own passes: ``None`` where
    the cache holds none, or holds ``job``'s prepared already (:func:`_prepare` then serves it). A layer's
    parameters on a rank read its layout and MLP partition, not its recompute choice, communication options or
    FSDP groups, which is all the key leaves out; the layout is validated as :func:`_prepared` validates it."""
    prepared = cache.prepared
    if prepared is not None and prepared[0][0] is job:
        return None
    cluster = cluster or job.cluster
    if cluster is not job.cluster:
        return None
    options = options or SimOptions()
    if not cache.serves(job, measurements, options, efficiency_for(cluster)):
        return None  # _prepared refuses it
    parallel = job.parallel
    layout = build_layout(job, world_size)
    cache.laid_out = (job, world_size, layout)
    params = cache.layer_params.get(params_key(plan_cost_key(layout, parallel, options)))
    if params is None:
        return None
    megatron = params.dense
    if parallel.primepar_layers is not None:  # the dense layers beyond it: its Megatron twin's
        twin = cache.layer_params.get(params_key(plan_cost_key(layout, megatron_twin(job).parallel, options)))
        if twin is None:
            return None
        megatron = twin.dense
    bf16_ends = bool(parallel.num_layers_at_start_in_bf16 or parallel.num_layers_at_end_in_bf16) \
        and NumberFormat.of(job.train).low
    return job, layout, options, _split_from(job, params, megatron, bool(bf16_ends))


@dataclass(frozen=True, kw_only=True)
class _StageSplit:
    """Parameters and MoE layers per pipeline rank (shared between the plans of one split: never modified)."""

    layer_params: tuple[float, ...]
    expert_params: tuple[float, ...]
    moe_layers: tuple[int, ...]
    layers: tuple[int, ...]
    """Decoder layers, and MTP layers counted as layers of their kind."""
    embedding: tuple[bool, ...]
    """Whether the rank holds the input embedding."""
    loss: tuple[bool, ...]
    """Whether the rank holds the output layer and loss."""
    mtp: tuple[int, ...]
    """MTP layers on the rank."""
    vocab_tables: tuple[int, ...]
    """Vocabulary-sized weights on the rank the gradient sync counts: the embedding's, the output layer's where the
    pipeline has more than one stage or the embeddings are untied, and the one an MTP layer on another rank builds
    (Megatron-Core embeds the shifted tokens there; the loss rank's output weight serves it where the embeddings are
    tied)."""
    bf16_layers: tuple[tuple[int, int], ...] = ()
    """Per rank: (dense, MoE) decoder layers kept in bf16 at the stack's ends
    (``parallel.num_layers_at_start_in_bf16`` / ``_end_in_bf16`` under FP8/FP4); empty: none on any rank."""
    bf16_params: tuple[float, ...] = ()
    """Their parameters on the rank."""


def _stage_split(job: JobSpec, layout: Layout, parts: PassCosts) -> _StageSplit:
    """Per pipeline rank: decoder-layer parameters on one rank (MTP layers' included), the routed experts' share of
    them, MoE layers and layers, over the rank's model chunks, and what the rank holds of the embedding, the loss and
    the MTP layers (:func:`_split_of`, from what it reads)."""
    megatron_dense = parts.megatron_dense or parts.dense  # the dense layers beyond parallel.primepar_layers
    return _split_from(job, LayerParams.of(parts), megatron_dense.params, parts.bf16_ends is not None)


def _split_from(job: JobSpec, params: LayerParams, megatron_params: float, bf16_ends: bool) -> _StageSplit:
    """:func:`_stage_split` from the layers' parameters ``params`` (``megatron_params``: a dense layer's under
    Megatron's MLP, for the layers beyond ``parallel.primepar_layers``), with layers kept in bf16 at the stack's
    ends or not (``bf16_ends``)."""
    model, parallel = job.model, job.parallel
    split = _split_of(job_split(job), parallel.mlp, parallel.primepar_layers, params.dense,
                      megatron_params, params.moe, params.moe + params.mtp_projection,
                      params.moe_experts, model.is_moe, model.tie_embeddings)
    if not bf16_ends:
        return split
    per_chunk = bf16_end_layers(job_chunks(job), parallel.num_layers_at_start_in_bf16,
                                parallel.num_layers_at_end_in_bf16)
    layers = tuple((sum(d for d, _ in row), sum(m for _, m in row)) for row in per_chunk)
    return dataclasses.replace(split, bf16_layers=layers,
                               bf16_params=tuple(d * params.dense + m * params.moe for d, m in layers))


@functools.lru_cache(maxsize=4096)
def _split_of(split: SplitKey, mlp: MlpPartition, primepar_layers: int | None, dense_params: float,
              megatron_params: float, moe_params: float, mtp_params: float, expert_params: float, is_moe: bool,
              tied: bool) -> _StageSplit:
    """:func:`_stage_split` of the split ``split`` (:func:`~cfp_megatron.base.pipeline_split.job_split`) under the
    MLP partition ``mlp`` with ``primepar_layers``, from one layer's parameters on one rank of each kind (a dense
    layer under the plan's partition and under Megatron's, a MoE layer, an MTP layer with its projection) and a
    MoE layer's routed experts', for a MoE model or not, with tied embeddings or not. Cached: the plans a search
    prices share a few splits and layer costs."""
    chunks = split_chunks(split)
    pp = len(chunks)
    layer_params = [0.0] * pp
    expert = [0.0] * pp
    moe_layers = [0] * pp
    layers = [0] * pp
    mtp = [0] * pp
    mtp_moe = int(is_moe)  # an MTP layer is of the model's last layer kind
    for rank, rank_chunks in enumerate(chunks):
        for chunk in rank_chunks:
            primepar = chunk.primepar_of(mlp, primepar_layers)
            layer_params[rank] += (primepar * dense_params + (chunk.dense - primepar) * megatron_params
                                   + chunk.moe * moe_params + chunk.mtp * mtp_params)
            expert[rank] += (chunk.moe + chunk.mtp * mtp_moe) * expert_params
            moe_layers[rank] += chunk.moe + chunk.mtp * mtp_moe
            layers[rank] += chunk.count + chunk.mtp
            mtp[rank] += chunk.mtp
    embedding = [any(chunk.embedding for chunk in row) for row in chunks]
    loss = [any(chunk.loss for chunk in row) for row in chunks]
    vocab_tables = [int(embedding[rank]) + int(loss[rank] and (pp > 1 or not tied))
                    + int(bool(mtp[rank]) and not embedding[rank] and not (loss[rank] and tied)) for rank in range(pp)]
    return _StageSplit(layer_params=tuple(layer_params), expert_params=tuple(expert), moe_layers=tuple(moe_layers),
                       layers=tuple(layers), embedding=tuple(embedding), loss=tuple(loss), mtp=tuple(mtp),
                       vocab_tables=tuple(vocab_tables))


def _peak_memory(job: JobSpec, layout: Layout, options: SimOptions, measurements: Measurements | None,
                 split: _StageSplit) -> MemoryBreakdown:
    """The largest memory over the pipeline ranks that can hold the peak, each rank's the cost terms' categories
    added up (:meth:`~cfp_megatron.sim.terms.base.Registry.memory`)."""
    memories = [TERMS.memory(found) for found in _peak_stages(job, layout, options, measurements, split)]
    return max(memories, key=lambda breakdown: breakdown.total)


def memory_stages(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                  options: SimOptions | None = None, world_size: int | None = None) -> tuple[Stage, ...]:
    """The pipeline ranks of ``job`` that can hold its memory peak, as the cost terms' memory sees them (what
    :func:`predict_memory` takes the largest of)."""
    job, layout, options, _, _, _, parts = _prepare(job, cluster, measurements, options, None, world_size, None)
    return _peak_stages(job, layout, options, measurements, _stage_split(job, layout, parts))


def _peak_stages(job: JobSpec, layout: Layout, options: SimOptions, measurements: Measurements | None,
                 split: _StageSplit) -> tuple[Stage, ...]:
    """The ranks that can hold the memory peak."""
    pp = layout.dims.pp
    # Ranks with the same parameters hold no more in-flight micro-batches than a lower rank (in_flight falls with the
    # rank), so only the lowest of each such set, the first and the last rank can hold the peak.
    seen: set[tuple[float, float, int, int]] = set()
    ranks = []
    for rank in range(pp):
        signature = (split.layer_params[rank], split.expert_params[rank], split.moe_layers[rank], split.layers[rank])
        if rank in (0, pp - 1) or signature not in seen:
            ranks.append(rank)
        seen.add(signature)
    common = layout_memory(job, layout, options)  # the same on every rank
    return tuple(stage(job, layout, options, rank=rank, layer_params=split.layer_params[rank],
                       expert_params=split.expert_params[rank], layers=split.layers[rank],
                       moe_layers=split.moe_layers[rank],
                       first=split.embedding[rank] and not options.measured_layer_only,
                       last=split.loss[rank] and not options.measured_layer_only, mtp=split.mtp[rank],
                       # measured segment memory (CFP), see cfp_megatron.sim.measured_memory
                       measurements=measurements if options.use_measured_segments else None, common=common,
                       bf16_layers=split.bf16_layers[rank] if split.bf16_layers else (0, 0),
                       bf16_params=split.bf16_params[rank] if split.bf16_params else 0.0)
                 for rank in ranks)


def _backward(cost: LayerCost, recomputed: int, layers: int) -> PassCost:
    """The backward passes of ``layers`` layers of ``cost``'s kind, ``recomputed`` of them recomputed."""
    plain = cost.unrecomputed_backward or cost.backward
    return cost.backward.scaled(recomputed).plus(plain.scaled(layers - recomputed))


def _pass_grid(job: JobSpec, dims: ParallelDims, parts: PassCosts
               ) -> tuple[list[list[PassCost]], list[list[PassCost]], list[list[PassCost]]]:
    """Per pipeline rank and model chunk: one micro-batch's forward, backward and recomputation costs."""
    model = job.model
    dense, moe, embedding, head = parts.dense, parts.moe, parts.embedding, parts.head
    megatron_dense = parts.megatron_dense or dense  # the dense layers beyond parallel.primepar_layers
    per_pass = parts.per_pass
    pp, vpp = dims.pp, dims.vpp
    chunks = job_chunks(job)
    heads = 1 + model.mtp_num_layers  # the loss chunk runs the output layer and loss once more per MTP layer
    # Per pipeline rank and model chunk: one micro-batch's forward, backward and recomputation costs.
    forward_costs: list[list[PassCost]] = []
    backward_costs: list[list[PassCost]] = []
    recompute_costs: list[list[PassCost]] = []
    chunk_costs: dict[tuple, tuple[PassCost, PassCost, PassCost]] = {}  # chunks that hold the same cost the same
    ends_counts = bf16_end_layers(chunks, job.parallel.num_layers_at_start_in_bf16,
                                  job.parallel.num_layers_at_end_in_bf16)
    for rank in range(pp):
        fwd_row, bwd_row, rec_row = [], [], []
        for chunk_index in range(vpp):
            chunk = chunks[rank][chunk_index]
            # The chunk's first dense layers run the plan's MLP partition, any beyond parallel.primepar_layers
            # Megatron's (the same layer when the plan's is Megatron's).
            primepar_layers = chunk.primepar(job.parallel)
            # Recomputed layers: all (uniform), or the chunk's first recompute_num_layers (block; dense ones first).
            rec_dense, rec_moe = chunk.recomputed(job.parallel)
            signature = (chunk.dense, chunk.moe, primepar_layers, rec_dense, rec_moe, chunk.mtp, chunk.embedding,
                         chunk.loss, ends_counts[rank][chunk_index])
            found = chunk_costs.get(signature)
            if found is None:
                fwd_cost = dense.forward.scaled(primepar_layers).plus(
                    megatron_dense.forward.scaled(chunk.dense - primepar_layers)).plus(moe.forward.scaled(chunk.moe))
                rec_primepar = min(rec_dense, primepar_layers)
                # Layers the block method leaves out run their backward alone beside FSDP's collectives.
                bwd_cost = _backward(dense, rec_primepar, primepar_layers).plus(
                    _backward(megatron_dense, rec_dense - rec_primepar, chunk.dense - primepar_layers)).plus(
                    _backward(moe, rec_moe, chunk.moe))
                rec_cost = dense.recompute.scaled(rec_primepar).plus(
                    megatron_dense.recompute.scaled(rec_dense - rec_primepar)).plus(moe.recompute.scaled(rec_moe))
                if parts.bf16_ends is not None and ends_counts[rank][chunk_index] != (0, 0):
                    # The stack's first/last layers in bf16 in place of the format's (rec_* counts them leading).
                    (b_dense, b_moe), (low_dense, low_moe) = parts.bf16_ends, (megatron_dense, moe)
                    for bf16, low, count, rec in ((b_dense, low_dense, ends_counts[rank][chunk_index][0], rec_dense),
                                                  (b_moe, low_moe, ends_counts[rank][chunk_index][1], rec_moe)):
                        rec = min(rec, count)
                        fwd_cost = fwd_cost.plus(bf16.forward.scaled(count)).plus(low.forward.scaled(-count))
                        bwd_cost = bwd_cost.plus(_backward(bf16, rec, count)).plus(
                            _backward(low, rec, count).scaled(-1))
                        rec_cost = rec_cost.plus(bf16.recompute.scaled(rec)).plus(low.recompute.scaled(-rec))
                if chunk.mtp:
                    # Each MTP layer: a decoder layer of the model's last kind (recomputed as the chunk's layers
                    # are) and its embedding, norms and projection (docs/simulator.md, "Multi-token prediction").
                    mtp_fwd, mtp_bwd = parts.mtp_projection
                    fwd_cost = fwd_cost.plus(moe.forward.plus(mtp_fwd).scaled(chunk.mtp))
                    bwd_cost = bwd_cost.plus(moe.backward.plus(mtp_bwd).scaled(chunk.mtp))
                    rec_cost = rec_cost.plus(moe.recompute.scaled(chunk.mtp))
                # The embedding and the head where the split puts them (the first and the last chunk, also under a
                # per-stage layout: Megatron-Core requires it).
                if chunk.embedding:
                    fwd_cost, bwd_cost = fwd_cost.plus(embedding[0]), bwd_cost.plus(embedding[1])
                if chunk.loss:
                    fwd_cost, bwd_cost = fwd_cost.plus(head[0].scaled(heads)), bwd_cost.plus(head[1].scaled(heads))
                if chunk.embedding or chunk.loss:
                    # The schedule's cost per micro-batch beyond the segments (StepOverheads.per_microbatch_s), paid
                    # by the stages that feed the batch in and compute the loss (cfp_megatron.sim.pass_costs).
                    fwd_cost, bwd_cost = fwd_cost.plus(per_pass), bwd_cost.plus(per_pass)
                if parts.host is not None:  # the host's launches and syncs against the GPU's time (terms.host)
                    mtp_moe = chunk.mtp if model.is_moe else 0
                    fwd_cost, bwd_cost = with_host(
                        parts.host, fwd_cost, bwd_cost, rec_cost, dense=chunk.dense + chunk.mtp - mtp_moe,
                        moe=chunk.moe + mtp_moe, embedding=chunk.embedding, heads=heads if chunk.loss else 0,
                        rec_dense=rec_dense, rec_moe=rec_moe, moe_forward_s=moe.forward.total_s)
                found = chunk_costs[signature] = (fwd_cost, bwd_cost, rec_cost)
            fwd_row.append(found[0])
            bwd_row.append(found[1])
            rec_row.append(found[2])
        forward_costs.append(fwd_row)
        backward_costs.append(bwd_row)
        recompute_costs.append(rec_row)
    if job.parallel.moe_a2a_overlap and model.is_moe:
        forward_costs, backward_costs = _unpaired_exchange(moe, dims, chunks, forward_costs, backward_costs)
    return forward_costs, backward_costs, recompute_costs


def _grid_seconds(forward_costs: list[list[PassCost]], backward_costs: list[list[PassCost]],
                  recompute_costs: list[list[PassCost]]) -> tuple[list[list[float]], list[list[float]]]:
    """Forward and backward (recomputation included) seconds per pipeline rank and chunk."""
    forward_s = [[cost.total_s for cost in row] for row in forward_costs]
    backward_s = [[bwd.total_s + rec.total_s for bwd, rec in zip(bwd_row, rec_row, strict=True)]
                  for bwd_row, rec_row in zip(backward_costs, recompute_costs, strict=True)]
    return forward_s, backward_s


def _schedule_kind(options: SimOptions, dims: ParallelDims) -> PipelineSchedule:
    """The pipeline schedule priced (``options.pipeline_schedule``; Megatron-Core's without a pipeline); raises
    :class:`ConfigError` for one other than Megatron-Core's over several model chunks a rank."""
    if dims.pp <= 1:
        return PipelineSchedule.megatron
    schedule = options.pipeline_schedule
    if schedule is not PipelineSchedule.megatron and dims.vpp > 1:
        raise ConfigError(ConfigIssue(
            key="sim.pipeline_schedule", value=schedule.value,
            problem=f"is timed with one model chunk a rank, and the plan has {dims.vpp} (parallel.vpp).",
            fix="leave parallel.vpp unset (1) for it, or price Megatron-Core's interleaved schedule (megatron)."))
    return schedule


def _schedule(f_s: list[list[float]], b_s: list[list[float]], p2p: float | tuple[float, ...], microbatches: int,
              slowdown: float | None, with_events: bool, options: SimOptions, *, blocking: bool = False,
              call_s: float = 0.0, weight_s: tuple[float, ...] | None = None, gather_s: float = 0.0,
              nic_s: tuple[float, ...] | None = None) -> ScheduleResult:
    """The timed pipeline schedule: on ranks that share cores (``slowdown``, pipelines only)
    :func:`~cfp_megatron.sim.terms.pipeline.shared_cores_schedule`,
    otherwise :func:`~cfp_megatron.sim.schedule.run_schedule` (``blocking``, ``call_s``, ``weight_s``, ``gather_s``,
    ``nic_s`` and ``options.pipeline_schedule``: as it takes them; ranks that share cores have no NIC)."""
    schedule = options.pipeline_schedule if len(f_s) > 1 else PipelineSchedule.megatron
    if slowdown is not None:
        return shared_cores_schedule(f_s, b_s, p2p, microbatches, slowdown, with_events, options, blocking=blocking,
                                     schedule=schedule, weight_s=weight_s, gather_s=gather_s)
    return run_schedule(f_s, b_s, p2p, microbatches, blocking=blocking, call_s=call_s, keep_ops=with_events,
                        max_ops=options.max_schedule_ops, schedule=schedule, weight_s=weight_s, gather_s=gather_s,
                        nic_s=nic_s)


def _pipeline_terms(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts,
                    measurements: Measurements | None, options: SimOptions, efficiency: Efficiency,
                    cache: CostCache | None, overheads: StepOverheads | None
                    ) -> tuple[float | tuple[float, ...], float, float]:
    """What a pipeline adds to a step, in seconds (all zero without a pipeline): the point-to-point exchange between
    stages (per pipeline rank ``r``, with rank ``r + 1``), what every step's schedule pays whatever its micro-batches,
    and what the step pays outside its schedule beyond what the probes without a pipeline give.

    The exchange is the send/receive fit of the activation (within or across NVLink domains as each pair of stages
    sits, :func:`~cfp_megatron.sim.terms.pipeline.exchange_fits`), plus what the overheads round's pipelined probe
    of the plan's partition at its micro-batch size paid per exchange beyond that fit where the pair sits as the
    probe's did; the other two are that probe's (:func:`_probe_calibration`), where the plan's first pair of stages
    sits as the probe's did; elsewhere the exchange is the fit alone (docs/simulator.md, "Pipeline exchanges")."""
    dims = layout.dims
    if dims.pp == 1:
        return 0.0, 0.0, 0.0
    fits_s = exchange_fits(job, layout, kernels, costs, options)
    if overheads is None or measurements is None:
        return fits_s, 0.0, 0.0
    partition = partition_name(dims.tp, sp=dims.sp)
    key = (partition, layout.micro_batch)
    if cache is not None and key in cache.exchanges:
        found = cache.exchanges[key]
    else:
        probe = measurements.pipeline_probe(partition, layout.micro_batch)
        found = (_probe_calibration(job, probe, dims.world_size, measurements, options, efficiency)
                 if probe is not None else None)
        if cache is not None:
            cache.exchanges[key] = found
    if found is None:
        return fits_s, 0.0, 0.0
    fits_s = tuple(max(fit_s + found.exchange_s - found.fit_s, 0.0) if crosses != found.intra_node else fit_s
                   for fit_s, crosses in zip(fits_s, layout.pair_crossings, strict=True))
    if found.intra_node != layout.pp_intra_node:
        return fits_s, 0.0, 0.0
    return fits_s, found.fixed_s, found.outside_s


@dataclass(frozen=True, kw_only=True)
class ProbeCalibration:
    """A pipelined probe's step against the simulator's pricing of it."""

    exchange_s: float
    """Seconds per exchange between stages with which the simulated schedules of the probe grow from one
    micro-batch to the probe's number as the measured ones did (without the one-micro-batch timing: with which the
    simulated schedule lasts the measured); zero where the simulated schedules already grow that much without any
    exchange."""
    fixed_s: float
    """Seconds every pipelined step's schedule pays beyond that, whatever its micro-batches: the measured schedule
    of one micro-batch less the simulated (any sign; zero without the one-micro-batch timing)."""
    fit_s: float
    """What the send/receive fit gives for the probe's exchange."""
    outside_s: float
    """The probe's measured step outside its schedule (gradient finalisation and the rest) less the simulated
    (DP sync and optimizer step of its critical rank); zero where the probe's finalisation was not timed."""
    intra_node: bool
    """Whether the probe's pipeline stayed within a node."""


_SOLVE_STEPS = 30
"""Bisection steps of :func:`_increasing_root` (the interval shrinks 2^30 times: below a nanosecond here)."""
_MAX_DOUBLINGS = 64
"""Doublings of :func:`_increasing_root`'s upper bound before it gives up and answers the last one."""


def _increasing_root(f: typing.Callable[[float], float], scale: float) -> float:
    """The smallest ``x >= 0`` (to bisection precision) where the non-decreasing ``f`` reaches zero: zero where
    ``f(0)`` already does; ``scale`` is the first upper bound tried."""
    if f(0.0) >= 0:
        return 0.0
    low, high = 0.0, max(scale, 1e-9)
    for _ in range(_MAX_DOUBLINGS):
        if f(high) >= 0:
            break
        low, high = high, 2.0 * high
    for _ in range(_SOLVE_STEPS):
        middle = 0.5 * (low + high)
        low, high = (middle, high) if f(middle) < 0 else (low, middle)
    return high


def _probe_calibration(job: JobSpec, probe: PipelineProbe, world: int, measurements: Measurements,
                       options: SimOptions, efficiency: Efficiency) -> ProbeCalibration | None:
    """Price the pipelined probe (``job``'s model cut to the probe's layers, its partition and stages over ``world``
    ranks, at its micro-batches and at one, from the same measurements) and set it against what it measured;
    ``None`` where the probe cannot be priced (its layout does not build, or the probes without a pipeline are
    missing)."""
    dp = world // (probe.tp * probe.pp)
    if dp < 1 or world % (probe.tp * probe.pp):
        return None
    cluster = job.cluster

    def probe_job(microbatches: int) -> JobSpec:
        return dataclasses.replace(
            job, model=dataclasses.replace(job.model, num_layers=probe.layers),
            parallel=ParallelSpec(tp=probe.tp, sp=probe.sp, pp=probe.pp, order=job.parallel.order),
            train=dataclasses.replace(job.train, micro_batch_size=probe.micro_batch,
                                      global_batch_size=probe.micro_batch * microbatches * dp))

    many, one = probe.microbatches, 1
    jobs = {many: probe_job(many), one: probe_job(one)}
    cache = CostCache.for_job(jobs[many], measurements, options, efficiency)  # the pass costs priced once

    def priced(microbatches: int, exchange_s: float) -> Prediction:
        found = _simulate(jobs[microbatches], cluster, measurements, options, efficiency, world, False, cache, None,
                          exchange_s)
        return typing.cast(Prediction, found)  # None only with a prune_above

    def schedule_s(microbatches: int, exchange_s: float) -> float:  # the critical rank's schedule
        found = priced(microbatches, exchange_s)
        schedule_end_s = found.step_time_s
        for lane in TERMS.lanes():  # less what follows the schedule (the DP sync, the optimizer step, ...)
            if lane.placement is Placement.after:
                schedule_end_s -= found.time.seconds(lane.name)
        return schedule_end_s

    try:
        _, layout, _, _, kernels, costs, parts = _prepare(jobs[many], cluster, measurements, options, efficiency,
                                                          world, cache)
    except ConfigError:
        return None
    if parts.overheads is None:
        return None
    if probe.single_schedule_s is not None and many > one:
        growth = probe.schedule_s - probe.single_schedule_s
        exchange_s = _increasing_root(lambda x: schedule_s(many, x) - schedule_s(one, x) - growth, probe.schedule_s)
        fixed_s = probe.single_schedule_s - schedule_s(one, exchange_s)
    else:
        exchange_s = _increasing_root(lambda x: schedule_s(many, x) - probe.schedule_s, probe.schedule_s)
        fixed_s = 0.0
    solved = priced(many, exchange_s)
    outside_s = 0.0
    if probe.finalize_s is not None:
        outside_s = probe.finalize_s + probe.rest_s - sum(solved.time.seconds(lane) for lane in OUTSIDE_LANES)
    fit_s = exchange_fit(jobs[many], layout, kernels, costs, scatter_gather=options.pipeline_scatter_gather)
    return ProbeCalibration(exchange_s=exchange_s, fixed_s=fixed_s, fit_s=fit_s, outside_s=outside_s,
                            intra_node=layout.pp_intra_node)


OUTSIDE_LANES = ("dp_comm_s", "embedding_sync_s", "token_sync_s", "optimizer_s")
"""The after-schedule lanes a pipelined probe's time outside its schedule is set against: the gradient finalisation
(``finalize_model_grads``) and the optimizer step (:attr:`ProbeCalibration.outside_s`)."""


def _outside_corrected(after: dict[str, list[float]], outside_s: float) -> dict[str, list[float]]:
    """``after`` with what a pipelined probe paid outside its schedule beyond the simulated ``outside_s`` (any
    sign) on every rank: :data:`OUTSIDE_LANES` scaled alike to their total plus it (never below zero), so each lane
    keeps what it holds; where they are all zero, a positive ``outside_s`` goes to the optimizer step."""
    corrected = dict(after)
    ranks = range(len(after["optimizer_s"]))
    totals = [sum(after[lane][rank] for lane in OUTSIDE_LANES) for rank in ranks]
    for lane in OUTSIDE_LANES:
        corrected[lane] = [after[lane][rank] * max(totals[rank] + outside_s, 0.0) / totals[rank] if totals[rank] > 0
                           else after[lane][rank] + (max(outside_s, 0.0) if lane == "optimizer_s" else 0.0)
                           for rank in ranks]
    return corrected


def _after_lanes(inputs: StepInputs) -> dict[str, list[float]]:
    """Seconds per pipeline rank of every after-schedule lane of the cost terms, in the registry's order."""
    found: dict[str, list[float]] = {}
    for term in TERMS:
        found.update(term.after_s(inputs))
    zero = [0.0] * inputs.layout.dims.pp
    return {lane.name: found.get(lane.name, zero) for lane in TERMS.lanes() if lane.placement is Placement.after}


def _after_end(start_s: float, after: dict[str, list[float]], rank: int) -> float:
    """When ``rank``'s after-schedule lanes end if they start at ``start_s``, one after another."""
    for seconds in after.values():
        start_s += seconds[rank]
    return start_s


def _events(schedule, forward_costs, backward_costs, recompute_costs, after) -> tuple[Event, ...]:
    """The schedule as events (seconds from the step's start): each pass split into its compute and its exposed
    communication, then each rank's after-schedule lanes (exposed DP sync, optimizer step, ...) in order."""
    events: list[Event] = []
    for op in schedule.ops:
        costs = ((forward_costs[op.rank][op.chunk],) if op.forward
                 else (backward_costs[op.rank][op.chunk], recompute_costs[op.rank][op.chunk]))
        # the pass as timed (shorter than its costs where a lone rank on shared cores ran it), split in their shares
        total_s = sum(cost.total_s for cost in costs)
        scale = (op.end_s - op.start_s) / total_s if total_s > 0 else 1.0
        comm_s = scale * sum(cost.comm_s + cost.host_s for cost in costs)  # what the GPU waits for in the pass
        collectives = tuple((name, scale * seconds) for name, seconds in (
            ("tp", sum(cost.tp_comm_s for cost in costs)), ("cp", sum(cost.cp_comm_s for cost in costs)),
            ("ep", sum(cost.ep_comm_s for cost in costs)), ("fsdp", sum(cost.fsdp_comm_s for cost in costs)),
            ("host", sum(cost.host_s for cost in costs)))
            if seconds > 0)
        compute_end_s = op.end_s - comm_s
        kind = EventKind.forward if op.forward else EventKind.backward
        events.append(Event(rank=op.rank, kind=kind, start_s=op.start_s, end_s=compute_end_s,
                            microbatch=op.microbatch, chunk=op.chunk))
        if comm_s > 0:
            events.append(Event(rank=op.rank, kind=EventKind.comm, start_s=compute_end_s, end_s=op.end_s,
                                microbatch=op.microbatch, chunk=op.chunk, collectives=collectives))
    kinds = {kind.value: kind for kind in EventKind}
    for rank, clock in enumerate(schedule.end_s):
        for name, seconds in after.items():
            if seconds[rank] > 0:
                lane = TERMS.lane(name)
                events.append(Event(rank=rank, kind=kinds.get(lane.key if lane else "", EventKind.step), lane=name,
                                    start_s=clock, end_s=clock + seconds[rank]))
            clock += seconds[rank]
    return tuple(events)


def _unpaired_exchange(moe: LayerCost, dims: ParallelDims, chunks: tuple[tuple[ChunkLayers, ...], ...],
                       forward_costs: list[list[PassCost]],
                       backward_costs: list[list[PassCost]]) -> tuple[list[list[PassCost]], list[list[PassCost]]]:
    """Under ``moe_a2a_overlap``, the passes Megatron-Core's combined 1F1B schedule cannot pair: the forwards before
    a rank's first backward (the warm-up, one more than the plain schedule's: the micro-batch the overlap keeps in
    flight) and as many cool-down backwards after its last forward run their expert exchange alone
    (:attr:`LayerCost.ep_alone_s` instead of ``ep_comm_s``). Each rank's chunk passes carry that share of the
    difference, spread over its passes (docs/simulator.md, "moe_cost.py")."""
    extra_fwd = max(moe.ep_alone_s[0] - moe.forward.ep_comm_s, 0.0)
    extra_bwd = max(moe.ep_alone_s[1] - moe.backward.ep_comm_s, 0.0)
    if extra_fwd <= 0 and extra_bwd <= 0:
        return forward_costs, backward_costs
    passes = dims.num_microbatches * dims.vpp  # each direction, per rank
    new_fwd, new_bwd = [], []
    for rank in range(dims.pp):
        # The forwards before the first backward: the plain schedule's warm-up and the first steady-state forward,
        # which the combined schedule runs alone too (its extra micro-batch in flight).
        unpaired = first_backward(rank, dims.pp, dims.vpp, dims.num_microbatches)
        share = min(unpaired, passes) / passes
        new_fwd.append([cost.plus(PassCost(ep_comm_s=share * (chunk.moe + chunk.mtp) * extra_fwd))
                        for cost, chunk in zip(forward_costs[rank], chunks[rank], strict=True)])
        new_bwd.append([cost.plus(PassCost(ep_comm_s=share * (chunk.moe + chunk.mtp) * extra_bwd))
                        for cost, chunk in zip(backward_costs[rank], chunks[rank], strict=True)])
    return new_fwd, new_bwd
