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
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.schedule import ScheduleResult, run_schedule
from cfp_megatron.sim.terms.base import CostTerm, Lane, LaneKind, MemoryCategory, Placement, StepTimes


def exchange_fit(job: JobSpec, layout: Layout, kernels: KernelModel, costs: CollectiveCosts) -> float:
    """What the send/receive fit gives for the activation one micro-batch hands to the next pipeline stage (this
    rank's TP and CP share), within or across nodes as the layout places the pipeline."""
    dims = layout.dims
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    return costs.seconds(Collective.send_recv, tokens * job.model.hidden_size * kernels.elem / dims.tp, 2,
                         2 if layout.pp_intra_node else 1)


def shared_cores_schedule(f_s: list[list[float]], b_s: list[list[float]], p2p: float, microbatches: int,
                          slowdown: float, with_events: bool, options: SimOptions) -> ScheduleResult:
    """The pipeline schedule where ranks share fewer cores than there are ranks (CPU): ``f_s`` and ``b_s`` are
    forward and backward seconds per rank and chunk, ``p2p`` the send/receive seconds, ``slowdown`` how much slower
    a rank runs with every rank busy than alone. Why it is bounded the way it is: docs/simulator.md,
    "Shared cores"."""
    alone = run_schedule([[seconds / slowdown for seconds in row] for row in f_s],
                         [[seconds / slowdown for seconds in row] for row in b_s],
                         p2p / slowdown, microbatches, keep_ops=with_events, max_ops=options.max_schedule_ops)
    busy_s = tuple(microbatches * (sum(fwd_row) + sum(bwd_row)) for fwd_row, bwd_row in zip(f_s, b_s, strict=True))
    exchanges_s = tuple(2 * microbatches * len(fwd_row) * p2p for fwd_row in f_s)
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
