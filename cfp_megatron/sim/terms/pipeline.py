"""The pipeline term: the bubble and the waits of the schedule (timed in :mod:`cfp_megatron.sim.schedule`), the
exchange between stages, and the schedule of ranks that share cores (docs/simulator.md, "Pipeline exchanges",
"Shared cores"). What a pipelined probe calibrates of the exchange stays with the simulator, which it reruns
(:func:`cfp_megatron.sim.simulate._pipeline_terms`)."""

from __future__ import annotations

import dataclasses

from cfp_megatron.base.config import JobSpec
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.cluster.measured import Collective
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.memory import Stage
from cfp_megatron.sim.options import PipelineSchedule, SimOptions
from cfp_megatron.sim.schedule import ScheduleResult, per_rank_links, run_schedule
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Placement, StepTimes


def exchange_fit(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, *,
                 crosses: bool | None = None, scatter_gather: bool = False) -> float:
    """What the send/receive fit gives for the activation one micro-batch hands to the next pipeline stage, as
    Megatron-Core's ``get_tensor_shapes`` sizes it (sequence / CP x micro-batch x hidden in the pipeline dtype, the
    sequence also split over TP under sequence parallelism: every TP rank sends the whole tensor without it), across
    NVLink domains where ``crosses`` (default: where the layout's first pair of stages does). ``scatter_gather``:
    Megatron-LM's exchange before Megatron-Core (:attr:`~cfp_megatron.sim.options.SimOptions.pipeline_scatter_gather`):
    each TP rank sends its 1/TP share and the receiving stage all-gathers the tensor over TP."""
    crosses = not layout.pp_intra_node if crosses is None else crosses
    seconds = costs.seconds(Collective.send_recv, _sent_bytes(job, layout, kernels, scatter_gather), 2,
                            1 if crosses else 2)
    return seconds + exchange_gather_s(job, layout, kernels, costs, scatter_gather=scatter_gather)


def exchange_nic_s(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts,
                   options: SimOptions) -> tuple[float, ...]:
    """Per pipeline rank ``r`` (as :func:`exchange_fits`), the seconds its transfer to rank ``r + 1`` spends on the
    sending GPU's NIC: the bandwidth part of the send/receive across NVLink domains (what one more byte-for-byte
    transfer adds, ``t(2m) - t(m)`` of the fit, so a measured fit's own latency stays out), zero where the pair
    shares a domain (NVLink does not use the NIC). What the blocking schedule adds for each other tensor that
    leaves the GPU in the same direction at once (docs/simulator.md, "Exchanges that share a NIC")."""
    message = _sent_bytes(job, layout, kernels, options.pipeline_scatter_gather)
    crossing = (costs.seconds(Collective.send_recv, 2 * message, 2, 1)
                - costs.seconds(Collective.send_recv, message, 2, 1))
    return tuple(max(crossing, 0.0) if crosses else 0.0 for crosses in layout.pair_crossings)


def exchange_gather_s(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts, *,
                      scatter_gather: bool) -> float:
    """The part of :func:`exchange_fit` that only the receiving stage pays, after the transfer: under
    ``scatter_gather`` without sequence parallelism, the all-gather over TP of the received 1/TP shares
    (``gather_split_1d_tensor`` in Megatron-LM's ``p2p_communication._communicate``, once per received tensor);
    zero otherwise."""
    dims = layout.dims
    if not scatter_gather or dims.sp or dims.tp == 1:
        return 0.0
    return costs.seconds(Collective.all_gather, _exchanged_bytes(job, layout, kernels), dims.tp, layout.tp_per_node)


def _exchanged_bytes(job: JobSpec, layout: Layout, kernels: KernelModel) -> float:
    """Bytes of the whole activation one micro-batch hands to the next pipeline stage (before any TP split)."""
    return layout.micro_batch * layout.seq_length / layout.dims.cp * job.model.hidden_size * kernels.elem


def _sent_bytes(job: JobSpec, layout: Layout, kernels: KernelModel, scatter_gather: bool) -> float:
    """Bytes each TP rank of a stage sends the next one for a micro-batch: the whole activation, its 1/TP share
    under sequence parallelism or Megatron-LM's scatter/gather exchange (:func:`exchange_fit`)."""
    dims = layout.dims
    return _exchanged_bytes(job, layout, kernels) / (dims.tp if dims.sp or scatter_gather else 1)


def exchange_fits(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts,
                  options: SimOptions) -> tuple[float, ...]:
    """:func:`exchange_fit` per pipeline rank ``r`` for its exchange with rank ``r + 1`` (the last: rank ``pp - 1``
    with rank 0), across NVLink domains where the layout's pair crosses them (:attr:`Layout.pp_crossings`)."""
    crossings = layout.pair_crossings
    found: dict[bool, float] = {}
    for crosses in crossings:
        if crosses not in found:
            found[crosses] = exchange_fit(job, layout, kernels, costs, crosses=crosses,
                                          scatter_gather=options.pipeline_scatter_gather)
    return tuple(found[crosses] for crosses in crossings)


def shared_cores_schedule(f_s: list[list[float]], b_s: list[list[float]], p2p: float | tuple[float, ...],
                          microbatches: int, slowdown: float, with_events: bool, options: SimOptions, *,
                          blocking: bool = False, schedule: PipelineSchedule = PipelineSchedule.megatron,
                          weight_s: tuple[float, ...] | None = None, gather_s: float = 0.0) -> ScheduleResult:
    """The pipeline schedule where ranks share fewer cores than there are ranks (CPU): ``f_s`` and ``b_s`` are
    forward and backward seconds per rank and chunk, ``p2p`` the send/receive seconds (one figure, or one per rank
    for its exchange with the next, as :func:`~cfp_megatron.sim.schedule.run_schedule` takes them), ``slowdown``
    how much slower a rank runs with every rank busy than alone, ``blocking`` the non-interleaved schedule's
    exchanges as Megatron-Core runs them, ``schedule``, ``weight_s`` and ``gather_s`` the schedule, its W passes and
    the receiver's own part of an exchange
    (:func:`~cfp_megatron.sim.schedule.run_schedule`). Why it is bounded the way it is: docs/simulator.md, "Shared
    cores"."""
    pp = len(f_s)
    links = per_rank_links(p2p, pp)
    alone = run_schedule([[seconds / slowdown for seconds in row] for row in f_s],
                         [[seconds / slowdown for seconds in row] for row in b_s],
                         tuple(seconds / slowdown for seconds in links), microbatches, blocking=blocking,
                         keep_ops=with_events, max_ops=options.max_schedule_ops, schedule=schedule,
                         weight_s=None if weight_s is None else tuple(seconds / slowdown for seconds in weight_s),
                         gather_s=gather_s / slowdown)
    busy_s = tuple(microbatches * (sum(fwd_row) + sum(bwd_row)) for fwd_row, bwd_row in zip(f_s, b_s, strict=True))
    # per micro-batch and chunk, an exchange with each neighbour (the one before and the one after)
    exchanges_s = tuple(microbatches * len(f_s[rank]) * (links[rank - 1] + links[rank]) for rank in range(pp))
    mean_work_s = (sum(busy_s) + sum(exchanges_s)) / len(busy_s)
    return dataclasses.replace(alone, end_s=tuple(max(end_s, mean_work_s) for end_s in alone.end_s), busy_s=busy_s)


class Pipeline(CostTerm):
    """Idle time of the slowest rank inside its schedule: the bubble and the waits for the stages' exchanges."""

    name = "pipeline"
    lanes = (Lane(name="pp_bubble_s", label="pipeline bubble", part="pipeline bubble", kind=LaneKind.idle,
                  placement=Placement.schedule, trace="idle"),)
    stores = (MemoryCategory(name="pp_buffers", label="pipeline send/receive buffers", field="comm_buffers"),)

    def memory(self, stage: Stage) -> dict[str, float]:
        """The two activations a stage sends and receives (its TP share under SP); the micro-batches in flight
        multiply the kept activations (:func:`cfp_megatron.sim.memory.in_flight`)."""
        job, dims = stage.job, stage.layout.dims
        if dims.pp <= 1 or stage.measured is not None:
            return {"pp_buffers": 0.0}
        return {"pp_buffers": 2 * stage.common.tokens * job.model.hidden_size * stage.common.elem_bytes
                / (dims.tp if dims.sp else 1)}

    def time(self, step: StepTimes) -> dict[str, float]:
        """The schedule's length less the rank's passes."""
        return {"pp_bubble_s": max(0.0, step.schedule_s - step.busy_s)}
