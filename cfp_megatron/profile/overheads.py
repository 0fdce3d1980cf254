"""The overheads round: what a real training step costs beyond the segments' forward and backward passes.

For each tensor-parallel size of the segments round, a probe model (one layer per decoder kind, then up to
:data:`EXTRA_LAYERS` more, never more than the model has) is trained with the engine's own training step
(:mod:`cfp_megatron.engine.step`: Megatron DDP, optimizer with grad-norm clipping, ``get_forward_backward_func``,
``finalize_model_grads``, the loss all-reduce) on the live process groups, the rest of the world data-parallel, every
rank busy as in training. Each step is split into the schedule call (the gradient finalisation, which the simulator
models from the collective fits, taken out and recorded on its own), ``optimizer.step`` and the rest; the schedule is
timed with one and with several micro-batches of one sequence. From these the ProfileDB derives the per-micro-batch
cost of the schedule beyond the segments, the optimizer's fixed and per-parameter cost, the step's other fixed costs
and the gradient finalisation as it runs inside a step (:meth:`cfp_megatron.profile.db.ProfileDB.step_overheads`).

Where the world leaves at least two data-parallel ranks, the larger probe also runs over two pipeline stages
(:data:`PIPELINE_STAGES`): Megatron's pipelined schedule with its point-to-point exchanges, which the simulator's
exchange cost must reproduce (:meth:`cfp_megatron.profile.db.ProfileDB.pipeline_probe`; docs/simulator.md,
"Pipeline exchanges"). The collectives round's send/receive fit times a ring shift with every rank sending at once;
a pipeline hands a micro-batch to a stage that waits for it, and on ranks that share cores the two differ by up to
ten times from one measurement to the next.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.measured import partition_name
from cfp_megatron.data.batches import build_micro_batches
from cfp_megatron.engine.model import count_parameters
from cfp_megatron.engine.step import build_training, forward_backward, reduce_loss
from cfp_megatron.profile.control import Step, StepResult, barrier, slowest
from cfp_megatron.profile.records import OverheadRecord, overhead_entry
from cfp_megatron.profile.segments import SegmentCase, init_probe_groups

MICROBATCHES = 4
"""Micro-batches per timed step."""
WARMUP = 1
"""Untimed steps before each timed set (the first step after a build or at a new batch size runs slow)."""
PIPELINE_STAGES = 2
"""Stages of the pipelined probe (the larger probe's layers split evenly over them)."""
PIPELINE_REPEATS = 3
"""Times the pipelined probe repeats each timing the other probes repeat: its three figures (the exchange, the cost
of every pipelined step, the cost outside the schedule) come from differences of its timings and the simulator's,
and a step's time on ranks that share cores moves by 10% from one step to the next."""
EXTRA_LAYERS = 3
"""Layers the larger probe adds (capped by the model's own layers): one layer's time is the difference of the two
probes over the layers between them, so each added layer divides the timing noise of that difference."""


@dataclass(frozen=True, kw_only=True)
class OverheadCase:
    """One probe to train: a segment case's probe job with its own layers or a few more."""

    tp: int
    """Tensor-parallel size."""
    layers: int
    """Decoder layers of the probe model."""
    job: JobSpec
    """The probe job: ``layers`` layers, :data:`MICROBATCHES` micro-batches of one sequence per step."""
    dims: ParallelDims
    """Its layout over the whole world."""
    pp: int = 1
    """Pipeline stages (:data:`PIPELINE_STAGES` for the pipelined probe, 1 otherwise)."""


def overhead_cases(cases: Sequence[SegmentCase], world: int, model_layers: int) -> list[OverheadCase]:
    """Per segment case, its probe with its own layers and with up to :data:`EXTRA_LAYERS` more, at most
    ``model_layers`` (the difference is the layers as they run in training; the parameters they add give the
    optimizer's per-parameter cost)."""
    found = []
    for case in cases:
        if case.layers_only:  # PrimePar's MLP: the simulator scales its Megatron twin's probes by the segments
            continue
        base = case.job.model.num_layers
        extra = max(1, min(EXTRA_LAYERS, model_layers - base))
        dp = max(world // case.tp, 1)
        train = dataclasses.replace(case.job.train, micro_batch_size=1, global_batch_size=MICROBATCHES * dp)
        for layers in (base, base + extra):
            model = dataclasses.replace(case.job.model, num_layers=layers)
            job = dataclasses.replace(case.job, model=model, train=train)
            found.append(OverheadCase(tp=case.tp, layers=layers, job=job, dims=ParallelDims.build(job, world)))
        pipelined = _pipelined_case(case, world, base + extra)
        if pipelined is not None:
            found.append(pipelined)
    return found


def _pipelined_case(case: SegmentCase, world: int, layers: int) -> OverheadCase | None:
    """The larger probe over :data:`PIPELINE_STAGES` stages (its layers rounded down to a multiple of them), or
    ``None`` where the world has no room for the stages beside ``case``'s TP size, the layers do not split, or the
    model is a MoE model with leading dense layers (whose probes the simulator does not read)."""
    stages = PIPELINE_STAGES
    model = case.job.model
    layers -= layers % stages
    if (world // case.tp) % stages or layers < stages or (model.is_moe and model.moe_first_dense_layers):
        return None
    dp = world // (case.tp * stages)
    job = dataclasses.replace(
        case.job, model=dataclasses.replace(model, num_layers=layers),
        train=dataclasses.replace(case.job.train, micro_batch_size=1, global_batch_size=MICROBATCHES * dp),
        parallel=dataclasses.replace(case.job.parallel, pp=stages))
    try:
        dims = ParallelDims.build(job, world)
    except ConfigError:
        return None
    return OverheadCase(tp=case.tp, layers=layers, job=job, dims=dims, pp=stages)


class OverheadBench:
    """The probe's training state on this rank and its instrumented step."""

    def __init__(self, case: OverheadCase, *, repeats: int) -> None:

        d = case.dims
        init_probe_groups(d, case.job.train.seed)
        self.state = build_training(case.job, d)
        self.finalize_s = 0.0
        finalize = self.state.config.finalize_model_grads_func

        def timed_finalize(*args: Any, **kwargs: Any) -> Any:
            _sync()
            began = time.perf_counter()
            out = finalize(*args, **kwargs)
            _sync()
            self.finalize_s += time.perf_counter() - began
            return out

        self.state.config.finalize_model_grads_func = timed_finalize
        self.params = count_parameters(self.state.chunks)
        self.repeats = repeats
        self.case = case

    def _batches(self, micro_batch: int) -> list[dict[str, torch.Tensor]]:
        from megatron.core import parallel_state

        job, dp = self.case.job, self.case.dims.dp
        train = dataclasses.replace(job.train, micro_batch_size=micro_batch,
                                    global_batch_size=micro_batch * MICROBATCHES * dp)
        stream = build_micro_batches(dataclasses.replace(job, train=train),
                                     dp_rank=parallel_state.get_data_parallel_rank(), dp_size=dp)
        return [next(stream) for _ in range(MICROBATCHES)]

    def step(self, batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float]:
        """One instrumented training step: (schedule without the gradient finalisation, the rest, the schedule with
        it) in seconds."""
        state = self.state
        _sync()
        t0 = time.perf_counter()
        for c in state.ddp_chunks:
            c.zero_grad_buffer()
        state.optimizer.zero_grad()
        _sync()
        t1 = time.perf_counter()
        self.finalize_s = 0.0
        reports = forward_backward(state, iter(batches), len(batches), int(batches[0]["tokens"].shape[0]))
        _sync()
        t2 = time.perf_counter()
        applied, _, _ = state.optimizer.step()
        if applied:  # as the runtime's train_step: a step skipped by the loss scaler does not advance the schedule
            state.scheduler.step(increment=1)
        reduce_loss(reports, state)
        _sync()
        t3 = time.perf_counter()
        return t2 - t1 - self.finalize_s, (t1 - t0) + (t3 - t2), t2 - t1

    def time(self, micro_batch: int) -> list[float]:
        """Medians over the repeats (after :data:`WARMUP` untimed steps) of :meth:`step` at ``micro_batch``, each
        repeat started together on every rank and taken from its slowest rank: the schedule without the gradient
        finalisation, the rest, and the finalisation as the slowest rank pays it (the slowest whole schedule less
        the slowest schedule without it: a rank that arrives early waits for the others inside it); for a pipelined
        probe also the schedule of a step of one micro-batch.

        A training step lasts as long as its slowest rank, and which rank is slowest changes from step to step
        where ranks share cores (CPU): the median over steps of the slowest rank is longer than the slowest rank's
        median, and the former is what a step costs."""
        batches = self._batches(micro_batch)
        runs = self._slowest_steps(batches)
        found = [statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs),
                 statistics.median(max(r[2] - r[0], 0.0) for r in runs)]
        if self.case.pp > 1:  # the schedule with one micro-batch: what a pipelined step pays whatever their number
            found.append(statistics.median(r[0] for r in self._slowest_steps(batches[:1])))
        return found

    def _slowest_steps(self, batches: list[dict[str, torch.Tensor]]) -> list[tuple[float, ...]]:
        """:meth:`step`'s figures of the slowest rank over the repeats, each started together on every rank, after
        :data:`WARMUP` untimed steps (the first step after a build or at a new batch shape runs slow)."""
        for _ in range(WARMUP):
            self.step(batches)
        runs = []
        for _ in range(self.repeats):
            barrier()
            runs.append(slowest(self.step(batches)))
        return runs


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def overhead_steps(cases: Sequence[OverheadCase], micro_batch_sizes: Sequence[int], *, repeats: int
                   ) -> tuple[list[Step], dict[str, tuple[str, int, int, int, int]]]:
    """Per case: build the probe's training state (the step reports its parameters per rank), then time its step
    at each micro-batch size (``repeats`` times; the pipelined probe :data:`PIPELINE_REPEATS` times that).
    ``meaning`` maps a label to (partition, tp, layers, micro-batch (0 for the build),
    pipeline stages)."""
    holder: dict[str, OverheadBench] = {}
    steps: list[Step] = []
    meaning: dict[str, tuple[str, int, int, int, int]] = {}
    for case in cases:
        name = partition_name(case.tp, sp=case.dims.sp)
        tag = f"{name}{f' pp{case.pp}' if case.pp > 1 else ''} L{case.layers}"

        def setup(case: OverheadCase = case, tag: str = tag) -> list[float]:
            holder.clear()  # free the previous probe first
            holder[tag] = OverheadBench(case, repeats=repeats * (PIPELINE_REPEATS if case.pp > 1 else 1))
            return [float(holder[tag].params)]

        steps.append(Step(label=f"overheads build {tag}", run=setup))
        meaning[f"overheads build {tag}"] = (name, case.tp, case.layers, 0, case.pp)
        for mbs in micro_batch_sizes:
            label = overhead_entry(name, case.layers, mbs, case.pp)
            steps.append(Step(label=label, run=lambda tag=tag, mbs=mbs: holder[tag].time(mbs), entry=label,
                              needs=f"overheads build {tag}"))
            meaning[label] = (name, case.tp, case.layers, mbs, case.pp)
    return steps, meaning


def overhead_records(results: Sequence[StepResult], meaning: dict[str, tuple[str, int, int, int, int]], *,
                     key: str) -> list[OverheadRecord]:
    """Records of the finished timing steps of probes whose build finished."""
    params: dict[tuple[str, int, int], int] = {}
    rows = []
    for res in results:
        if res.label not in meaning or not res.values:
            continue
        name, tp, layers, mbs, pp = meaning[res.label]
        if mbs == 0:
            params[(name, layers, pp)] = int(res.values[0])
        elif (name, layers, pp) in params:
            rows.append(OverheadRecord(model=key, partition=name, tp=tp, layers=layers, pp=pp,
                                       params=params[(name, layers, pp)], micro_batch=mbs, microbatches=MICROBATCHES,
                                       schedule_s=res.values[0], rest_s=res.values[1],
                                       finalize_s=res.values[2] if len(res.values) > 2 else None,
                                       single_schedule_s=res.values[3] if len(res.values) > 3 else None))
    return rows
