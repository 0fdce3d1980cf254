"""The simulator's entry point: :func:`simulate` predicts step time and peak memory of one plan.

Step time = the pipeline schedule of per-stage, per-micro-batch passes (compute + exposed communication, see
:mod:`cfp_megatron.sim.layer_cost`), timed event by event (:mod:`cfp_megatron.sim.schedule`), then the part of the
data-parallel gradient sync that the last micro-batch's backward pass does not hide, then the optimizer step
(memory-bound). The slowest pipeline rank sets the step time; its breakdown is reported.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass

from cfp_megatron.base.config import ClusterSpec, JobSpec
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.pipeline_split import job_chunks
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective, Measurements
from cfp_megatron.sim.calibration import Efficiency, efficiency_for
from cfp_megatron.sim.kernels import KernelModel, grad_element_bytes
from cfp_megatron.sim.layer_cost import PassCost
from cfp_megatron.sim.layout import Layout, build_layout
from cfp_megatron.sim.memory import stage_memory
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.pass_costs import CostCache, PassCosts, collective_costs, cost_key, pass_costs
from cfp_megatron.sim.prediction import GIB, Event, EventKind, MemoryBreakdown, Prediction, TimeBreakdown
from cfp_megatron.sim.primepar_cost import megatron_twin
from cfp_megatron.sim.schedule import ScheduleResult, dependency_floors, run_schedule

_BUCKET_PARAMS = 40_000_000
"""Megatron DDP's default gradient bucket size in parameters."""


def simulate(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
             options: SimOptions | None = None, efficiency: Efficiency | None = None, world_size: int | None = None,
             with_events: bool = False, cache: CostCache | None = None) -> Prediction:
    """Predict the step time and peak memory of ``job`` on ``cluster`` (default: ``job.cluster``).

    ``measurements`` (profiled collectives and GEMMs) win over the cluster's nominal figures; ``efficiency``
    overrides the fitted efficiencies (for fitting); ``with_events`` keeps the timed schedule for timeline export;
    ``cache`` shares pass costs and cost models between the plans of one search (:class:`CostCache`).
    Raises :class:`~cfp_megatron.base.errors.ConfigError` for a plan that cannot run.
    """
    return typing.cast(Prediction, _simulate(job, cluster, measurements, options, efficiency, world_size,
                                             with_events, cache, None))  # None only with a prune_above


def simulate_unless_slower(job: JobSpec, prune_above: float, cluster: ClusterSpec | None = None,
                           measurements: Measurements | None = None, *, options: SimOptions | None = None,
                           world_size: int | None = None, cache: CostCache | None = None) -> Prediction | None:
    """:func:`simulate`, or ``None`` when a lower bound on the step time computed before the pipeline schedule is
    timed already exceeds ``prune_above`` seconds (a search's k-th best): the schedule is most of a simulation."""
    return _simulate(job, cluster, measurements, options, None, world_size, False, cache, prune_above)


def _simulate(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
              options: SimOptions | None, efficiency: Efficiency | None, world_size: int | None, with_events: bool,
              cache: CostCache | None, prune_above: float | None) -> Prediction | None:
    job, layout, options, eff, kernels, costs, parts = _prepare(job, cluster, measurements, options, efficiency,
                                                                world_size, cache)
    cluster = job.cluster
    d = layout.dims
    m = job.model
    dense, moe, emb, out = parts.dense, parts.moe, parts.embedding, parts.head
    mega = parts.megatron_dense or dense  # the dense layers beyond parallel.primepar_layers
    per_pass, overheads = parts.per_pass, parts.overheads
    pp, vpp = d.pp, d.vpp
    stages = pp * vpp
    chunks = job_chunks(job)
    fwd: list[list[PassCost]] = []
    bwd: list[list[PassCost]] = []
    rec: list[list[PassCost]] = []
    split = _stage_split(job, layout, parts)
    layer_params, expert_params = split.layer_params, split.expert_params
    for r in range(pp):
        f_row, b_row, r_row = [], [], []
        for c in range(vpp):
            g = c * pp + r
            chunk = chunks[r][c]
            # The chunk's first dense layers run the plan's MLP partition, any beyond parallel.primepar_layers
            # Megatron's (the same layer when the plan's is Megatron's).
            prime = chunk.primepar(job.parallel)
            f = dense.forward.scaled(prime).plus(mega.forward.scaled(chunk.dense - prime)).plus(
                moe.forward.scaled(chunk.moe))
            b = dense.backward.scaled(prime).plus(mega.backward.scaled(chunk.dense - prime)).plus(
                moe.backward.scaled(chunk.moe))
            # Recomputed layers: all (uniform), or the chunk's first recompute_num_layers (block; dense ones first).
            rec_dense, rec_moe = chunk.recomputed(job.parallel)
            rec_prime = min(rec_dense, prime)
            x = dense.recompute.scaled(rec_prime).plus(mega.recompute.scaled(rec_dense - rec_prime)).plus(
                moe.recompute.scaled(rec_moe))
            if g == 0:
                f, b = f.plus(emb[0]), b.plus(emb[1])
            if g == stages - 1:
                f, b = f.plus(out[0]), b.plus(out[1])
            if g == 0 or g == stages - 1:
                # The schedule's cost per micro-batch beyond the segments (StepOverheads.per_microbatch_s), paid by
                # the stages that feed the batch in and compute the loss (cfp_megatron.sim.pass_costs).
                f, b = f.plus(per_pass), b.plus(per_pass)
            f_row.append(f)
            b_row.append(b)
            r_row.append(x)
        fwd.append(f_row)
        bwd.append(b_row)
        rec.append(r_row)
    f_s = [[x.total_s for x in row] for row in fwd]
    b_s = [[bwd[r][c].total_s + rec[r][c].total_s for c in range(vpp)] for r in range(pp)]
    tokens = layout.micro_batch * layout.seq_length / d.cp
    p2p_bytes = tokens * m.hidden_size * kernels.elem / d.tp
    p2p = costs.seconds(Collective.send_recv, p2p_bytes, 2, 2 if layout.pp_intra_node else 1) if pp > 1 else 0.0
    # Data-parallel gradient sync and optimizer step, per pipeline rank.
    dp_group = d.dp * d.cp
    overlap = job.parallel.overlap_grad_reduce if options.overlap_grad_reduce is None else options.overlap_grad_reduce
    dp_exposed, opt_s = [], []
    grad_b = grad_element_bytes(job)
    token_count_s = _token_count_sync(costs, layout) if overheads is not None else 0.0  # the same on every rank
    for r in range(pp):
        vocab = m.padded_vocab_size * m.hidden_size / d.tp
        params = layer_params[r] + (vocab if r == 0 else 0.0) + (vocab if r == pp - 1 and pp > 1 else 0.0)
        dense_p = params - expert_params[r]
        if options.measured_layer_only:
            dp_exposed.append(0.0)
            opt_s.append(0.0)
            continue
        sync = gather = 0.0
        if not options.fsdp:
            if job.parallel.distributed_optimizer:
                sync = (costs.seconds(Collective.reduce_scatter, dense_p * grad_b, dp_group, layout.dp_per_node)
                        + costs.seconds(Collective.reduce_scatter, expert_params[r] * grad_b, d.expert_dp,
                                        layout.edp_per_node))
                gather = (costs.seconds(Collective.all_gather, dense_p * kernels.elem, dp_group, layout.dp_per_node)
                          + costs.seconds(Collective.all_gather, expert_params[r] * kernels.elem, d.expert_dp,
                                          layout.edp_per_node))
            else:
                sync = (costs.seconds(Collective.all_reduce, dense_p * grad_b, dp_group, layout.dp_per_node)
                        + costs.seconds(Collective.all_reduce, expert_params[r] * grad_b, d.expert_dp,
                                        layout.edp_per_node))
        bucket_share = min(1.0, _BUCKET_PARAMS / max(params, 1.0))
        if overlap:
            window = sum(b_s[r])
            sync = max(sync - window, sync * bucket_share)
        if job.parallel.overlap_param_gather:
            gather *= bucket_share
        dp_exposed.append(sync + gather)
        sharded = options.fsdp or job.parallel.distributed_optimizer
        shard = (dense_p / dp_group + expert_params[r] / d.expert_dp) if sharded else params
        if overheads is None:
            opt_s.append(kernels.memory(shard * eff.optimizer_bytes_per_param))
            continue
        dp_exposed[r] += _tied_embedding_sync(job, costs, vocab, r) + token_count_s
        opt_s.append(overheads.step_base_s + overheads.step_per_param_s * shard + _grad_norm_extra(costs, d.tp, pp))
    slowdown = measurements.busy_slowdown() if overheads is not None else None
    shared = slowdown is not None and pp > 1
    if prune_above is not None:
        # A lower bound on the step without timing the schedule (cfp_megatron.search.search): no schedule ends before
        # its dependencies allow (dependency_floors); with shared cores the mean rank's work bounds every rank.
        busy = tuple(d.num_microbatches * (sum(f_s[r]) + sum(b_s[r])) for r in range(pp))
        ends = [sum(busy) / pp] * pp if shared else dependency_floors(f_s, b_s, busy)
        if max(ends[r] + dp_exposed[r] + opt_s[r] for r in range(pp)) > prune_above:
            return None

    def timed() -> ScheduleResult:
        if shared:
            return _shared_cores(f_s, b_s, p2p, d.num_microbatches, slowdown, with_events, options)
        return run_schedule(f_s, b_s, p2p, d.num_microbatches, keep_ops=with_events,
                            max_ops=options.max_schedule_ops)

    if cache is not None and not with_events:  # plans that differ only outside the schedule (e.g. the optimizer)
        skey = (tuple(map(tuple, f_s)), tuple(map(tuple, b_s)), p2p, d.num_microbatches)
        sched = cache.schedules.get(skey)
        if sched is None:
            sched = cache.schedules[skey] = timed()
    else:
        sched = timed()

    finish = [sched.end_s[r] + dp_exposed[r] + opt_s[r] for r in range(pp)]
    crit = max(range(pp), key=lambda r: finish[r])
    step = finish[crit]

    mb = d.num_microbatches
    f_tot = PassCost()
    b_tot = PassCost()
    r_tot = PassCost()
    for c in range(vpp):
        f_tot, b_tot, r_tot = f_tot.plus(fwd[crit][c]), b_tot.plus(bwd[crit][c]), r_tot.plus(rec[crit][c])
    busy = sched.busy_s[crit]
    breakdown = TimeBreakdown(
        forward_compute_s=mb * (f_tot.compute_s + f_tot.attention_core_s),
        backward_compute_s=mb * (b_tot.compute_s + b_tot.attention_core_s),
        recompute_s=mb * (r_tot.compute_s + r_tot.attention_core_s),
        overhead_s=mb * (f_tot.overhead_s + b_tot.overhead_s + r_tot.overhead_s),
        tp_comm_s=mb * (f_tot.tp_comm_s + b_tot.tp_comm_s + r_tot.tp_comm_s),
        cp_comm_s=mb * (f_tot.cp_comm_s + b_tot.cp_comm_s + r_tot.cp_comm_s),
        ep_comm_s=mb * (f_tot.ep_comm_s + b_tot.ep_comm_s + r_tot.ep_comm_s),
        fsdp_comm_s=mb * (f_tot.fsdp_comm_s + b_tot.fsdp_comm_s + r_tot.fsdp_comm_s),
        pp_bubble_s=max(0.0, sched.end_s[crit] - busy),
        dp_comm_s=dp_exposed[crit], optimizer_s=opt_s[crit])

    memory = _peak_memory(job, layout, options, measurements, split)
    world = d.world_size
    seqs = layout.micro_batch * mb * d.dp
    tok_s = seqs * layout.seq_length / step / world
    events = _events(sched, fwd, bwd, rec, dp_exposed, opt_s, finish, sched.end_s) if with_events else ()
    return Prediction(step_time_s=step, time=breakdown, memory=memory,
                      bubble_fraction=breakdown.pp_bubble_s / sched.end_s[crit] if sched.end_s[crit] else 0.0,
                      tokens_per_s_per_gpu=tok_s,
                      model_tflops_per_gpu=tok_s * training_flops_per_token(m, layout.seq_length) / 1e12,
                      num_microbatches=mb,
                      fits=cluster.hbm_gib is None or memory.total <= cluster.hbm_gib * GIB,
                      events=events)


def _prepare(job: JobSpec, cluster: ClusterSpec | None, measurements: Measurements | None,
             options: SimOptions | None, efficiency: Efficiency | None, world_size: int | None,
             cache: CostCache | None) -> tuple[JobSpec, Layout, SimOptions, Efficiency, KernelModel, CollectiveCosts,
                                               PassCosts]:
    """The validated layout, the cost models and the pass costs of ``job`` (from ``cache`` where it has them)."""
    cluster = cluster or job.cluster
    if cluster is not job.cluster:
        job = JobSpec(model=job.model, cluster=cluster, parallel=job.parallel, train=job.train, data=job.data)
    options = options or SimOptions()
    eff = efficiency or efficiency_for(cluster)
    layout = build_layout(job, world_size)
    if cache is None:
        costs = collective_costs(cluster, measurements, eff)
        kernels = KernelModel(cluster, eff, job.train.precision, fp8=options.fp8, measurements=measurements)
    elif not cache.serves(job, measurements, options, eff):
        raise ValueError("a CostCache serves the plans of one model, cluster, precision, set of options and "
                         "measurements (CostCache.for_job)")
    else:
        kernels, costs = cache.kernels, cache.collectives

    def costs_of(plan: JobSpec) -> PassCosts:
        if cache is None:
            return pass_costs(plan, layout, kernels, costs, options, measurements)
        key = cost_key(layout, plan.parallel.recompute, options, plan.parallel.mlp)
        if key not in cache.costs:
            cache.costs[key] = pass_costs(plan, layout, kernels, costs, options, measurements)
        return cache.costs[key]

    parts = costs_of(job)
    if job.parallel.primepar_layers is not None:  # the dense layers beyond it run its Megatron twin's
        parts = dataclasses.replace(parts, megatron_dense=costs_of(megatron_twin(job)).dense)
    return job, layout, options, eff, kernels, costs, parts


def prepare_costs(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                  options: SimOptions | None = None, world_size: int | None = None,
                  cache: CostCache | None = None) -> PassCosts:
    """The per-micro-batch pass costs :func:`simulate` would use for ``job`` (validated; from ``cache`` where it
    has them): what a search's lower bound is built from."""
    return _prepare(job, cluster, measurements, options, None, world_size, cache)[-1]


def predict_memory(job: JobSpec, cluster: ClusterSpec | None = None, measurements: Measurements | None = None, *,
                   options: SimOptions | None = None, world_size: int | None = None,
                   cache: CostCache | None = None) -> MemoryBreakdown:
    """Peak memory per rank of the most loaded pipeline stage of ``job``: what :func:`simulate` reports as
    ``memory``, without timing the schedule (a search checks memory first)."""
    job, layout, options, _, _, _, parts = _prepare(job, cluster, measurements, options, None, world_size, cache)
    split = _stage_split(job, layout, parts)
    return _peak_memory(job, layout, options, measurements, split)


@dataclass(frozen=True, kw_only=True)
class _StageSplit:
    """Parameters and MoE layers per pipeline rank."""

    layer_params: list[float]
    expert_params: list[float]
    moe_layers: list[int]
    layers: list[int]


def _stage_split(job: JobSpec, layout: Layout, parts: PassCosts) -> _StageSplit:
    d = layout.dims
    layer_params = [0.0] * d.pp
    expert_params = [0.0] * d.pp
    moe_layers = [0] * d.pp
    layers = [0] * d.pp
    mega = parts.megatron_dense or parts.dense  # the dense layers beyond parallel.primepar_layers
    for r, row in enumerate(job_chunks(job)):
        for chunk in row:
            prime = chunk.primepar(job.parallel)
            layer_params[r] += (prime * parts.dense.params + (chunk.dense - prime) * mega.params
                                + chunk.moe * parts.moe.params)
            expert_params[r] += chunk.moe * parts.moe.expert_params
            moe_layers[r] += chunk.moe
            layers[r] += chunk.count
    return _StageSplit(layer_params=layer_params, expert_params=expert_params, moe_layers=moe_layers, layers=layers)


def _peak_memory(job: JobSpec, layout: Layout, options: SimOptions, measurements: Measurements | None,
                 split: _StageSplit) -> MemoryBreakdown:
    pp = layout.dims.pp
    # Ranks with the same parameters hold no more in-flight micro-batches than a lower rank (in_flight falls with the
    # rank), so only the lowest of each such set, the first and the last rank can hold the peak.
    seen: set[tuple[float, float, int, int]] = set()
    ranks = []
    for r in range(pp):
        sig = (split.layer_params[r], split.expert_params[r], split.moe_layers[r], split.layers[r])
        if r in (0, pp - 1) or sig not in seen:
            ranks.append(r)
        seen.add(sig)
    memories = [stage_memory(job, layout, options, rank=r, layer_params=split.layer_params[r],
                             expert_params=split.expert_params[r], layers=split.layers[r],
                             moe_layers=split.moe_layers[r],
                             first=r == 0 and not options.measured_layer_only,
                             last=r == pp - 1 and not options.measured_layer_only,
                             # measured segment memory (CFP), see cfp_megatron.sim.measured_memory
                             measurements=measurements if options.use_measured_segments else None)
                for r in ranks]
    return max(memories, key=lambda x: x.total)


def _shared_cores(f_s: list[list[float]], b_s: list[list[float]], p2p: float, microbatches: int, slowdown: float,
                  with_events: bool, options: SimOptions) -> ScheduleResult:
    """The pipeline schedule where ranks share fewer cores than there are ranks (CPU). The pass times were measured
    with every rank busy; a rank waiting in the pipeline's fill or drain leaves its core to the others. So the
    schedule is bounded below by its dependencies at the speed of a rank alone (its passes and its exchanges with
    a neighbour, both timed with every rank busy, ``slowdown`` times faster) and by the mean stage's own timeline:
    its passes at the measured speed plus, per micro-batch and model chunk, its two blocking exchanges with the
    neighbouring stages (the forward's and the backward's), each a send/receive as the collectives round timed it
    with every rank busy. A rank blocked in an exchange gives its core away but
    waits for its neighbour to be scheduled again, so on shared cores the exchanges are not hidden behind other
    stages' work as they are behind a GPU's."""
    alone = run_schedule([[x / slowdown for x in row] for row in f_s], [[x / slowdown for x in row] for row in b_s],
                         p2p / slowdown, microbatches, keep_ops=with_events, max_ops=options.max_schedule_ops)
    busy = tuple(microbatches * (sum(f) + sum(b)) for f, b in zip(f_s, b_s, strict=True))
    exchanges = tuple(2 * microbatches * len(f) * p2p for f in f_s)
    work = (sum(busy) + sum(exchanges)) / len(busy)
    return dataclasses.replace(alone, end_s=tuple(max(end, work) for end in alone.end_s), busy_s=busy)


def _tied_embedding_sync(job: JobSpec, costs: CollectiveCosts, vocab_params: float, rank: int) -> float:
    """Megatron's all-reduce of the tied word-embedding gradient between the first and the last pipeline stage
    (``finalize_model_grads``), on those two stages."""
    pp = job.parallel.pp
    if pp == 1 or not job.model.tie_embeddings or rank not in (0, pp - 1):
        return 0.0
    return costs.seconds(Collective.all_reduce, vocab_params * grad_element_bytes(job), 2)


def _token_count_sync(costs: CollectiveCosts, layout: Layout) -> float:
    """The rest of Megatron's ``finalize_model_grads`` under the runtime's per-token loss
    (``calculate_per_token_loss``): the step's token count broadcast from the last pipeline stage over the pipeline
    group, then all-reduced over DP x CP, on every rank. Both carry one number, so they cost their latency; a
    broadcast is costed as the all-gather over the same group (the nearest measured collective). The overheads
    probes time ``finalize_model_grads`` out of their schedule (:mod:`cfp_megatron.profile.overheads`), so only
    this term counts them."""
    d = layout.dims
    bcast = (costs.seconds(Collective.all_gather, 4.0 * d.pp, d.pp, d.pp if layout.pp_intra_node else 1)
             if d.pp > 1 else 0.0)
    return bcast + costs.seconds(Collective.all_reduce, 4.0, d.dp * d.cp, layout.dp_per_node)


def _grad_norm_extra(costs: CollectiveCosts, tp: int, pp: int) -> float:
    """The grad-norm all-reduce runs over the model-parallel group (``tp x pp`` ranks); the measured optimizer
    step had ``tp``: the difference."""
    if pp == 1:
        return 0.0
    return max(costs.seconds(Collective.all_reduce, 8.0, tp * pp)
               - costs.seconds(Collective.all_reduce, 8.0, tp, tp), 0.0)


def _events(sched, fwd, bwd, rec, dp_exposed, opt_s, finish, ends) -> tuple[Event, ...]:
    """The schedule as events: each pass split into its compute and its exposed communication."""
    out: list[Event] = []
    for op in sched.ops:
        if op.forward:
            comm = fwd[op.rank][op.chunk].comm_s
        else:
            comm = bwd[op.rank][op.chunk].comm_s + rec[op.rank][op.chunk].comm_s
        split = op.end_s - comm
        kind = EventKind.forward if op.forward else EventKind.backward
        out.append(Event(rank=op.rank, kind=kind, start_s=op.start_s, end_s=split, microbatch=op.microbatch,
                         chunk=op.chunk))
        if comm > 0:
            out.append(Event(rank=op.rank, kind=EventKind.comm, start_s=split, end_s=op.end_s,
                             microbatch=op.microbatch, chunk=op.chunk))
    for r, end in enumerate(ends):
        if dp_exposed[r] > 0:
            out.append(Event(rank=r, kind=EventKind.dp_sync, start_s=end, end_s=end + dp_exposed[r]))
        if opt_s[r] > 0:
            out.append(Event(rank=r, kind=EventKind.optimizer, start_s=end + dp_exposed[r], end_s=finish[r]))
    return tuple(out)
