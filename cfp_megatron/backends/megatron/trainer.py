"""The training loop on Megatron-Core: Megatron DDP and optimizer (:mod:`cfp_megatron.engine.step`),
``get_forward_backward_func`` schedules, logging, checkpoints, and the plan check after the first steps."""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from cfp_megatron.base.config import JobSpec, resolve_precision
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.data.batches import build_micro_batches
from cfp_megatron.engine import checkpoint, rank_watch
from cfp_megatron.engine.distributed import bound_every_group
from cfp_megatron.engine.memory import measure_step
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.engine.model import count_parameters
from cfp_megatron.engine.peak import peak_tflops
from cfp_megatron.engine.step import TrainState, build_training, train_step
from cfp_megatron.model.megatron_config import cpu_notes
from cfp_megatron.plan.check import PlanCheck, log_plan_check
from cfp_megatron.profile.cluster import profiled_peak


def run_training(job: JobSpec, dims: ParallelDims, env: LaunchEnv, *, start_step: int | None,
                 metrics_path: Path | None, check: PlanCheck | None = None) -> list[StepMetrics]:
    """Build everything, resume if asked, train to ``train.steps``, checkpoint; return rank 0's step metrics.

    With ``check`` (a run with a plan), the first steps are compared with the plan's prediction
    (:mod:`cfp_megatron.plan.check`)."""
    t = job.train
    log = MetricsLog(metrics_path, enabled=env.rank == 0)
    if env.rank == 0 and not torch.cuda.is_available():
        for note in cpu_notes(job):
            print(note, file=sys.stderr, flush=True)
    state = build_training(job, dims)
    bound_every_group(t.collective_timeout_s)  # the groups made without one (PrimePar's grids)
    precision = resolve_precision(t.precision, torch.cuda.is_available())
    saved_state = checkpoint.training_state(precision, job.data)  # what a save records and a resume must match
    if start_step is not None and t.checkpoint_dir is not None:
        extra = checkpoint.load(t.checkpoint_dir, start_step, state.chunks, state.optimizer, state.scheduler,
                                heterogeneous=job.parallel.primepar_layers is not None, state=saved_state)
        state.step = start_step
        rank_watch.saved(str(checkpoint.step_dir(Path(t.checkpoint_dir), start_step)))
        log.event("resume", step=start_step, saved_under=extra.get("layout"), layout=dims.describe(),
                  restart_count=env.restart_count)
    peak, peak_source = peak_tflops(job.cluster, precision,
                                    profiled=profiled_peak(job, world_size=env.world_size, precision=precision))
    flops_per_token = training_flops_per_token(job.model, t.seq_length)
    log.event("start", model=job.model.name, layout=dims.describe(), mlp=job.parallel.mlp.value,
              primepar_layers=job.parallel.primepar_layers,
              params_on_rank0=count_parameters(state.chunks),
              steps=t.steps, start_step=state.step, precision=precision.value, backend=dist.get_backend(),
              device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              peak_tflops_per_rank=round(peak, 3), peak_source=peak_source, restart_count=env.restart_count,
              metrics=str(metrics_path) if metrics_path else None)
    dp_rank = parallel_state.get_data_parallel_rank()
    stream = build_micro_batches(job, dp_rank=dp_rank, dp_size=dims.dp, start_step=state.step)
    history: list[StepMetrics] = []
    last_saved = state.step if start_step is not None else None
    with log.progress:
        bar = log.progress.add_task("train", total=t.steps, completed=state.step)
        while state.step < t.steps:
            rank_watch.at(f"step {state.step + 1} of {t.steps}")
            if not train_one(state, stream, log, history, flops_per_token, peak):
                break
            log.progress.update(bar, completed=state.step)
            if check is not None and len(history) == check.after_steps:
                log_plan_check(check, history, log, job, env, backend=dist.get_backend())
            if t.checkpoint_dir and t.save_interval and state.step % t.save_interval == 0:
                _save(state, log, saved_state)
                last_saved = state.step
    if t.checkpoint_dir and last_saved != state.step:
        _save(state, log, saved_state)
    log.event("end", step=state.step)
    return history


def train_one(state: TrainState, stream: Iterator[dict[str, torch.Tensor]], log: MetricsLog,
               history: list[StepMetrics], flops_per_token: float, peak: float) -> bool:
    """Train one step from ``stream`` and log it; False when the data ran out."""
    t, dims = state.job.train, state.dims
    tokens_per_step = t.global_batch_size * t.seq_length
    micro_batches = list(itertools.islice(stream, dims.num_microbatches))
    if len(micro_batches) < dims.num_microbatches:
        log.event("data_exhausted", step=state.step)
        return False
    start = time.perf_counter()
    report, peak_bytes, device_peak = None, None, None
    if t.memory_step is not None and state.step + 1 == t.memory_step:
        # MemTracker's hooks slow this step itself; gathering and logging the report is kept out of its time.
        (loss, grad_norm, lr, applied), report = measure_step(
            lambda: train_step(state, micro_batches), chunks=state.ddp_chunks, optimizer=state.optimizer,
            rank=dist.get_rank(), step_number=state.step + 1)
    else:
        loss, grad_norm, lr, applied = train_step(state, micro_batches)
    elapsed = time.perf_counter() - start
    if report is not None:
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, report.to_json())
        peak_bytes = float(max(r["peak_bytes"] for r in reports))
        allocated = [r["device_max_allocated_bytes"] for r in reports if r["device_max_allocated_bytes"] is not None]
        device_peak = float(max(allocated)) if allocated else None
        log.event("memory", step=state.step, ranks=reports, peak_bytes_max=peak_bytes)
    tflops = flops_per_token * tokens_per_step / elapsed / dims.world_size / 1e12
    m = StepMetrics(step=state.step, loss=loss, lr=lr, grad_norm=grad_norm, applied=applied, step_time_s=elapsed,
                    tokens_per_s=tokens_per_step / elapsed, tflops_per_rank=tflops, mfu=tflops / peak,
                    peak_bytes_max=peak_bytes, device_peak_bytes_max=device_peak)
    history.append(m)
    if state.step % t.log_interval == 0 or state.step == t.steps:
        log.step(m, t.steps)
    return True


def _save(state: TrainState, log: MetricsLog, saved_state: dict[str, Any]) -> None:
    rank_watch.at(f"the save of step {state.step}'s checkpoint")
    folder = checkpoint.save(str(state.job.train.checkpoint_dir), state.step, state.chunks, state.optimizer,
                             state.scheduler, {"layout": state.dims.describe(), "model": state.job.model.name},
                             model=state.job.model, state=saved_state)
    rank_watch.saved(str(folder))
    log.event("checkpoint", step=state.step, path=str(folder))
