"""The training loop: Megatron DDP and optimizer, ``get_forward_backward_func`` schedules, logging, checkpoints."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_batch_on_this_cp_rank
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from cfp_megatron.config import JobSpec, Precision, resolve_precision
from cfp_megatron.errors import CfpError
from cfp_megatron.parallel_dims import ParallelDims
from cfp_megatron.runtime import checkpoint, plan_check
from cfp_megatron.runtime.flops import training_flops_per_token
from cfp_megatron.runtime.init import layout_independent_init
from cfp_megatron.runtime.launch_env import LaunchEnv
from cfp_megatron.runtime.memory import measure_step
from cfp_megatron.runtime.model import build_model_chunks, count_parameters, transformer_config
from cfp_megatron.runtime.peak import peak_tflops
from cfp_megatron.runtime.plan_check import PlanCheck


@dataclass(frozen=True, kw_only=True)
class StepMetrics:
    """What one optimizer step did, as rank 0 logs it."""

    step: int
    """Optimizer steps completed (1-based)."""
    loss: float
    """Mean token loss over the global batch."""
    lr: float
    """Learning rate used for this step."""
    grad_norm: float
    """Gradient norm before clipping (0 when the update was skipped)."""
    applied: bool
    """False when the fp16 loss scaler found an overflow and skipped the update."""
    step_time_s: float
    """Wall-clock seconds of the step (forward, backward, optimizer)."""
    tokens_per_s: float
    """Trained tokens per second, whole job."""
    tflops_per_rank: float
    """Model TFLOP/s per rank."""
    mfu: float
    """Model FLOPs utilisation: ``tflops_per_rank`` / peak."""
    peak_bytes_max: float | None = None
    """Peak memory of the most loaded rank, on the step memory was measured (``train.memory_step``)."""


@dataclass(kw_only=True)
class TrainState:
    """The live objects of a training run on this rank."""

    job: JobSpec
    """The validated job."""
    dims: ParallelDims
    """Its parallel layout."""
    chunks: list[torch.nn.Module]
    """Unwrapped GPTModel chunks (one per virtual stage)."""
    ddp_chunks: list[DistributedDataParallel]
    """The same chunks wrapped in Megatron DDP."""
    optimizer: Any
    """Megatron's optimizer (``MegatronOptimizer`` or ``ChainedOptimizer`` with MoE)."""
    scheduler: OptimizerParamScheduler
    """Learning-rate and weight-decay schedule."""
    config: Any
    """The ``TransformerConfig`` the chunks were built with (carries the schedule hooks)."""
    step: int = 0
    """Optimizer steps completed so far."""


def build_training(job: JobSpec, dims: ParallelDims) -> TrainState:
    """Model chunks, DDP, optimizer and LR schedule for this rank (process groups must exist)."""
    on_gpu = torch.cuda.is_available()
    precision = resolve_precision(job.train.precision, on_gpu)
    config = transformer_config(job, dims, on_gpu=on_gpu)
    chunks = build_model_chunks(job, config, dims)
    if job.train.layout_independent_init:
        layout_independent_init(chunks, config, job.train.seed)
    p, t = job.parallel, job.train
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=p.grad_reduce_in_fp32,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.distributed_optimizer,
        # fp16 relies on the dynamic loss scaler, whose first scales overflow on purpose and skip their steps.
        check_for_nan_in_grad=precision is not Precision.fp16,
    )
    # As Megatron-LM does: bf16/fp16 chunks run inside Float16Module, which casts the inputs of the first stage and
    # the outputs of the last one.
    compute = [Float16Module(config, c) if precision is not Precision.fp32 else c for c in chunks]
    ddp_chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                          disable_bucketing=i > 0) for i, chunk in enumerate(compute)]
    opt_config = OptimizerConfig(
        optimizer=t.optimizer.value, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
        bf16=precision is Precision.bf16, fp16=precision is Precision.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=p.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    decay = max(t.lr_decay_steps or t.steps, t.warmup_steps + 1)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if t.warmup_steps else t.lr, max_lr=t.lr, min_lr=t.min_lr,
        lr_warmup_steps=t.warmup_steps, lr_decay_steps=decay, lr_decay_style=t.lr_schedule.value,
        start_wd=t.weight_decay, end_wd=t.weight_decay, wd_incr_steps=decay, wd_incr_style="constant",
    )
    config.no_sync_func = [c.no_sync for c in ddp_chunks] if len(ddp_chunks) > 1 else ddp_chunks[0].no_sync
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if p.overlap_param_gather:
        config.param_sync_func = [c.start_param_sync for c in ddp_chunks]
        if len(ddp_chunks) == 1:
            config.param_sync_func = config.param_sync_func[0]
    return TrainState(job=job, dims=dims, chunks=chunks, ddp_chunks=ddp_chunks, optimizer=optimizer,
                      scheduler=scheduler, config=config)


def _loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    losses = output.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def _forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple:
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(batch)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, partial(_loss_func, batch["loss_mask"])


def _reduce_loss(reports: list[dict], state: TrainState) -> float:
    """Mean token loss over the global batch, known on every rank."""
    total = torch.zeros(2, dtype=torch.float64)
    contributes = (parallel_state.is_pipeline_last_stage(ignore_virtual=True)
                   and parallel_state.get_tensor_model_parallel_rank() == 0)
    if contributes:
        for r in reports:
            total += r["lm loss"].detach().to("cpu", torch.float64)
    if torch.cuda.is_available():
        total = total.cuda()
    dist.all_reduce(total)
    return float(total[0] / total[1].clamp(min=1))


def train_step(state: TrainState, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float, bool]:
    """One optimizer step over the given micro-batches; returns (loss, grad norm, learning rate, applied).

    ``applied`` is False when fp16's loss scaler found an overflow and skipped the update.
    """
    job, dims = state.job, state.dims
    for c in state.ddp_chunks:
        c.zero_grad_buffer()
    state.optimizer.zero_grad()
    iterators: Any = [iter(micro_batches) for _ in state.ddp_chunks]
    reports = get_forward_backward_func()(
        forward_step_func=_forward_step,
        data_iterator=iterators if len(iterators) > 1 else iterators[0],
        model=state.ddp_chunks,
        num_microbatches=dims.num_microbatches,
        seq_length=job.train.seq_length,
        micro_batch_size=job.train.micro_batch_size,
        forward_only=False,
    )
    lr = state.optimizer.param_groups[0]["lr"]
    applied, grad_norm, _ = state.optimizer.step()
    if applied:  # as Megatron-LM: a step skipped by the loss scaler does not advance the schedule
        state.scheduler.step(increment=1)
    state.step += 1
    return _reduce_loss(reports, state), float(grad_norm or 0.0), float(lr), bool(applied)


class MetricsLog:
    """Rank 0's log: readable lines on the console and one JSON object per line in ``metrics.jsonl``."""

    def __init__(self, path: Path | None, enabled: bool) -> None:
        self.enabled = enabled
        self.console = Console(highlight=False)
        self.path = path
        # A live bar on a terminal only; logs and pipes get the step lines alone.
        self.progress = Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TimeRemainingColumn(), console=self.console, transient=True,
                                 disable=not (enabled and self.console.is_terminal))
        if enabled and path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def event(self, kind: str, **fields: Any) -> None:
        """Write a non-step record (start, resume, checkpoint, end) and say it on the console."""
        self._write({"event": kind, "time": time.time(), **fields})
        if self.enabled:
            detail = " | ".join(f"{k} {v}" for k, v in fields.items() if v is not None)
            self.console.print(f"[bold]{kind}[/] | {detail}", soft_wrap=True)

    def step(self, m: StepMetrics, total: int) -> None:
        """Write one step's metrics and print its line."""
        self._write({"event": "step", **asdict(m)})
        if self.enabled:
            self.console.print(
                f"step {m.step:>5}/{total} | loss {m.loss:.4f} | lr {m.lr:.2e} | "
                f"{f'grad {m.grad_norm:.3f}' if m.applied else 'skipped (loss-scale overflow)'} | "
                f"{m.step_time_s * 1000:.0f} ms | {m.tokens_per_s:,.0f} tok/s | "
                f"{m.tflops_per_rank:.3f} TFLOP/s/rank | MFU {m.mfu * 100:.1f}%", soft_wrap=True)

    def _write(self, record: dict) -> None:
        if self.enabled and self.path is not None:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(record) + "\n")


def run_training(job: JobSpec, dims: ParallelDims, env: LaunchEnv, *, start_step: int | None,
                 metrics_path: Path | None, check: PlanCheck | None = None) -> list[StepMetrics]:
    """Build everything, resume if asked, train to ``train.steps``, checkpoint; return rank 0's step metrics.

    With ``check`` (a run with a plan), the first steps are compared with the plan's prediction
    (:mod:`cfp_megatron.runtime.plan_check`)."""
    from cfp_megatron.data.batches import build_micro_batches

    t = job.train
    log = MetricsLog(metrics_path, enabled=env.rank == 0)
    state = build_training(job, dims)
    if start_step is not None and t.checkpoint_dir is not None:
        extra = checkpoint.load(t.checkpoint_dir, start_step, state.chunks, state.optimizer, state.scheduler,
                                heterogeneous=job.parallel.primepar_layers is not None)
        state.step = start_step
        log.event("resume", step=start_step, saved_under=extra.get("layout"), layout=dims.describe(),
                  restart_count=env.restart_count)
    precision = resolve_precision(t.precision, torch.cuda.is_available())
    peak, peak_source = peak_tflops(job.cluster, precision)
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
            if not _train_one(state, stream, log, history, flops_per_token, peak):
                break
            log.progress.update(bar, completed=state.step)
            if check is not None and len(history) == check.after_steps:
                _check_plan(check, history, log, job, env)
            if t.checkpoint_dir and t.save_interval and state.step % t.save_interval == 0:
                _save(state, log)
                last_saved = state.step
    if t.checkpoint_dir and last_saved != state.step:
        _save(state, log)
    log.event("end", step=state.step)
    return history


def _train_one(state: TrainState, stream: Iterator[dict[str, torch.Tensor]], log: MetricsLog,
               history: list[StepMetrics], flops_per_token: float, peak: float) -> bool:
    """Train one step from ``stream`` and log it; False when the data ran out."""
    t, dims = state.job.train, state.dims
    tokens_per_step = t.global_batch_size * t.seq_length
    micro_batches = list(itertools.islice(stream, dims.num_microbatches))
    if len(micro_batches) < dims.num_microbatches:
        log.event("data_exhausted", step=state.step)
        return False
    start = time.perf_counter()
    report, peak_bytes = None, None
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
        log.event("memory", step=state.step, ranks=reports, peak_bytes_max=peak_bytes)
    tflops = flops_per_token * tokens_per_step / elapsed / dims.world_size / 1e12
    m = StepMetrics(step=state.step, loss=loss, lr=lr, grad_norm=grad_norm, applied=applied, step_time_s=elapsed,
                    tokens_per_s=tokens_per_step / elapsed, tflops_per_rank=tflops, mfu=tflops / peak,
                    peak_bytes_max=peak_bytes)
    history.append(m)
    if state.step % t.log_interval == 0 or state.step == t.steps:
        log.step(m, t.steps)
    return True


def _check_plan(check: PlanCheck, history: list[StepMetrics], log: MetricsLog, job: JobSpec,
                env: LaunchEnv) -> None:
    """Log the plan check; rank 0 stores it in the ProfileDB (a failure to store is said, not raised)."""
    if env.rank != 0:
        return
    record = plan_check.compare(check, history)
    if record is None:
        return
    diff = plan_check.differences(record)
    stored = None
    try:
        stored = plan_check.store(record, world_size=env.world_size, nodes=job.cluster.nodes,
                                  backend=dist.get_backend())
    except (OSError, CfpError) as err:
        log.event("warning", message=f"the plan check was not stored in the ProfileDB: {err}")
    log.event("plan_check", steps=record.steps, predicted_step_s=round(record.predicted_step_s, 6),
              calibration=round(record.calibration, 4),
              measured_step_s=round(record.measured_step_s, 6), step_time_diff=round(diff["step_time"], 4),
              predicted_peak_gib=None if record.predicted_peak_bytes is None
              else round(record.predicted_peak_bytes / 2**30, 4),
              measured_peak_gib=None if record.measured_peak_bytes is None
              else round(record.measured_peak_bytes / 2**30, 4),
              memory_diff=None if diff["memory"] is None else round(diff["memory"], 4), stored=stored)
    for warning in plan_check.warnings_for(record):
        log.event("warning", message=warning)


def _save(state: TrainState, log: MetricsLog) -> None:
    folder = checkpoint.save(str(state.job.train.checkpoint_dir), state.step, state.chunks, state.optimizer,
                             state.scheduler, {"layout": state.dims.describe(), "model": state.job.model.name})
    log.event("checkpoint", step=state.step, path=str(folder))
