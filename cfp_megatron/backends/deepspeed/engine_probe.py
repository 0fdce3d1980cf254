"""The DeepSpeed engine's own costs on the live cluster: one profiling round of the DeepSpeed backend.

The model's passes come from the segment profiles (CFP); what DeepSpeed adds around them (ZeRO's gradient
reductions and parameter gathers with their hooks and bucket copies, the optimizer step over fp32 partitions, the
parameter all-gather after it) depends on the stage and the parameter count, not on the micro-batch. So for each ZeRO
stage the real engine is built once around the real model at micro-batch 1 and timed with
:data:`ACCUMULATIONS` micro-batches per step, switched between steps with DeepSpeed's ``set_train_batch_size`` and
taken in turn (1, 2, 4, 1, 2, 4, ...), so that a slow spell of the machine falls on every point alike. Each point is
the median over rounds of the step's slowest rank. The least-squares line ``T(n) = a + b n`` through the points gives

- ``per_step_s`` = ``a``: what a step costs once (the optimizer and what follows it);
- ``per_microbatch_s`` = ``b - C``: what a micro-batch costs beyond its passes (C, the simulator's pass time at
  micro-batch 1).

(Two points, ``2 T(1) - T(2)`` and ``T(2) - T(1)``, made the per-step cost a difference of two noisy step times; three
points in turn fit it with a third of that difference's variance.) The figures are kept as JSON next to the ProfileDB
(``$CFP_CACHE_DIR/profile/<fingerprint>-deepspeed-<model>.json``) and reused by the next launch on the same hardware
and software.

The timing (:func:`probe_stages` over :func:`time_accumulations`) is shared with the ``deepspeed.initialize`` hook,
which probes a user's own model the same way (:func:`cfp_megatron.backends.deepspeed.hook_measure.probe_engines`).
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cfp_megatron.backends.deepspeed.zero_plan import ds_config, zero_plan
from cfp_megatron.base.config import JobSpec, resolve_precision
from cfp_megatron.base.files import cache_dir
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.measured import least_squares_line

PROBE_SCHEMA_VERSION = 2
"""Version of the probe file's layout (2: the points of the accumulation line)."""

ACCUMULATIONS: tuple[int, ...] = (1, 2, 4)
"""Micro-batches per step the probes time, in turn."""


@dataclass(frozen=True, kw_only=True)
class StageProbe:
    """One ZeRO stage timed at micro-batch 1 with several micro-batches per step."""

    stage: int
    """ZeRO stage."""
    points: tuple[tuple[int, float], ...]
    """(micro-batches per step, step time in seconds: the median over rounds of the slowest rank), by count."""

    def line(self) -> tuple[float, float]:
        """``(a, b)`` of the least-squares line ``T(n) = a + b n`` through :attr:`points` (both at zero or above)."""
        return least_squares_line([(float(n), t) for n, t in self.points])

    @property
    def per_step_s(self) -> float:
        """Cost paid once per step beyond the passes: the line's intercept."""
        return self.line()[0]

    def per_microbatch_s(self, pass_s: float) -> float:
        """Cost per micro-batch beyond its passes, given the passes' time ``pass_s`` at micro-batch 1: the line's
        slope less ``pass_s`` (not below 0)."""
        return max(self.line()[1] - pass_s, 0.0)

    def seconds(self, accumulation: int) -> float | None:
        """The measured step time with ``accumulation`` micro-batches per step, if that point was timed."""
        return dict(self.points).get(accumulation)


@dataclass(frozen=True, kw_only=True)
class EngineProbes:
    """The engine probes of one model on one cluster."""

    model: str
    """The model key (:func:`cfp_megatron.profile.fingerprint.model_key`)."""
    world: int
    """Ranks the probes ran on."""
    stages: dict[int, StageProbe]
    """By ZeRO stage."""

    def to_json(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {"schema_version": PROBE_SCHEMA_VERSION, "model": self.model, "world": self.world,
                "stages": [{"stage": s.stage, "points": [list(p) for p in s.points]} for s in self.stages.values()]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EngineProbes | None:
        """Rebuild, or ``None`` for another schema version."""
        if data.get("schema_version") != PROBE_SCHEMA_VERSION:
            return None
        stages = {int(s["stage"]): StageProbe(stage=int(s["stage"]),
                                              points=tuple((int(n), float(t)) for n, t in s["points"]))
                  for s in data["stages"]}
        return cls(model=data["model"], world=int(data["world"]), stages=stages)


def probe_path(fingerprint_key: str, model: str) -> Path:
    """Where the probes of ``model`` on the cluster of ``fingerprint_key`` are kept."""
    return cache_dir() / "profile" / f"{fingerprint_key}-deepspeed-{model.replace('/', '_')}.json"


def load_probes(path: Path, world: int) -> EngineProbes | None:
    """The stored probes at ``path`` for ``world`` ranks, or ``None``."""
    try:
        probes = EngineProbes.from_json(json.loads(path.read_text()))
    except (OSError, json.JSONDecodeError, KeyError, TypeError):
        return None
    return probes if probes is not None and probes.world == world else None


StepCall = Callable[[int], Callable[[], object]]
"""Given ``n``, prepares one optimizer step of ``n`` micro-batches on this rank (its data) and returns the call that
runs it, the part that is timed."""

EngineBuilder = Callable[[int], tuple[Any, StepCall]]
"""Given a ZeRO stage, builds the DeepSpeed engine at micro-batch 1 and returns it with its :data:`StepCall`."""


def time_accumulations(engine: Any, step: StepCall, *, world: int, rounds: int) -> tuple[tuple[int, float], ...]:
    """The points of a :class:`StageProbe` for a ready ``engine`` (every rank calls this): ``rounds`` timed rounds
    (after one untimed) of one step per count in :data:`ACCUMULATIONS`, in turn, switched with
    ``set_train_batch_size``; each step timed between a barrier and its end, the slowest rank's time (an
    all-reduce), the median over rounds per count."""

    from cfp_megatron.profile.control import barrier, slowest

    samples: dict[int, list[float]] = {n: [] for n in ACCUMULATIONS}
    for round_ in range(rounds + 1):
        for accumulation in ACCUMULATIONS:
            engine.set_train_batch_size(world * accumulation)
            run = step(accumulation)
            barrier()
            start = time.perf_counter()
            run()
            (elapsed,) = slowest([time.perf_counter() - start])
            if round_ > 0:  # the first round warms up every count
                samples[accumulation].append(elapsed)
    return tuple((n, statistics.median(samples[n])) for n in ACCUMULATIONS)


def release_engine(engine: Any) -> None:
    """Destroy ``engine`` and drop what DeepSpeed's ZeRO-3 keeps of it in module globals (0.19: its modules on
    ``parameter_offload.FWD_MODULE_STACK``, entries of the parameter coordinator's class-level release cache), which
    would otherwise keep the engine, its model and optimizer states alive after it is gone."""
    engine.destroy()
    module = getattr(engine, "module", None)
    try:
        from deepspeed.runtime.zero import parameter_offload
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
    except ImportError:
        return
    stack = getattr(parameter_offload, "FWD_MODULE_STACK", None)
    if isinstance(stack, list) and module is not None:
        ours = {id(m) for m in module.modules()}
        stack[:] = [m for m in stack if id(m) not in ours]
    cached = getattr(PartitionedParameterCoordinator, "_PartitionedParameterCoordinator__params_to_release", None)
    for cell in getattr(cached, "__closure__", None) or ():  # the lru_cache inside DeepSpeed's NVTX wrapper
        clear = getattr(cell.cell_contents, "cache_clear", None)
        if callable(clear):
            clear()  # a cache: the live engines' entries are recomputed on their next use


def _probe_stage(stage: int, build: EngineBuilder, *, world: int, rounds: int) -> StageProbe:
    """One stage's probe: its engine built, timed and released (its memory is freed on return)."""
    engine, step = build(stage)
    points = time_accumulations(engine, step, world=world, rounds=rounds)
    release_engine(engine)
    return StageProbe(stage=stage, points=points)


def probe_stages(stages: Iterable[int], build: EngineBuilder, *, world: int, rounds: int,
                 budget_s: float) -> dict[int, StageProbe]:
    """Probe each of ``stages`` in order with the engines of ``build`` (every rank calls this), stopping once
    ``budget_s`` has passed on any rank (at least one stage is probed); the engines' memory is freed between
    stages."""

    import gc

    import torch

    from cfp_megatron.profile.control import slowest

    began = time.perf_counter()
    found: dict[int, StageProbe] = {}
    for stage in stages:
        found[stage] = _probe_stage(stage, build, world=world, rounds=rounds)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        if slowest([time.perf_counter() - began])[0] > budget_s:  # every rank stops after the same stage
            break
    return found


def run_probes(job: JobSpec, dims: ParallelDims, *, model: str, rounds: int = 5,
               budget_s: float = 30.0) -> EngineProbes:
    """Time every ZeRO stage's engine (every rank calls this; process groups for ``dims``, data parallel over every
    rank, must exist): ``rounds`` timed rounds (after one untimed) of one step per count in :data:`ACCUMULATIONS`.
    Stages not reached within ``budget_s`` are left out (the simulator's analytical terms stand in)."""

    import torch
    import torch.distributed as dist

    from cfp_megatron.backends.deepspeed.trainer import build_engine, train_step
    from cfp_megatron.data.batches import build_micro_batches

    on_gpu = torch.cuda.is_available()
    world = dims.world_size

    def build(stage: int) -> tuple[Any, StepCall]:
        train = dataclasses.replace(job.train, global_batch_size=world, micro_batch_size=1, warmup_steps=0)
        pjob = dataclasses.replace(job, train=train)
        plan = zero_plan(pjob, world=world, zero_stage=stage, micro_batch=1, activation_checkpointing=False,
                                 offload_optimizer=False, offload_param=False, bucket_elements=50_000_000,
                                 precision=resolve_precision(job.train.precision, on_gpu))
        _, engine = build_engine(pjob, plan, ds_config(plan, pjob), dims)
        stream = build_micro_batches(pjob, dp_rank=dist.get_rank(), dp_size=world)

        def step(accumulation: int) -> Callable[[], object]:
            batch = [next(stream) for _ in range(accumulation)]
            return lambda: train_step(engine, batch)

        return engine, step

    found = probe_stages((0, 1, 2, 3), build, world=world, rounds=rounds, budget_s=budget_s)
    return EngineProbes(model=model, world=world, stages=found)
