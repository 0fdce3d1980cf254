"""Train a Megatron-Core GPT model with ``deepspeed.initialize`` under a DeepSpeed plan
(:class:`~cfp_megatron.plan.artifact.Plan` with ``backend=deepspeed``).

The model is Megatron-Core's ``GPTModel`` built as the Megatron backend builds it (no model parallelism: Megatron's
groups have size 1, DeepSpeed's data parallelism spans every rank), with Megatron's full per-layer recomputation where
the plan checkpoints activations. DeepSpeed owns the rest: ZeRO partitioning, gradient accumulation (``backward`` and
``step`` per micro-batch; the optimizer steps at the accumulation boundary), clipping, the optimizer and the LR
schedule of ``ds_config.json``, and checkpoints (``engine.save_checkpoint``). The loss of a micro-batch is its mean
token loss; DeepSpeed averages over accumulation steps and data-parallel ranks, so a step's loss is the global batch's
mean token loss, as the Megatron backend reports it.
"""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from cfp_megatron.backends.deepspeed import checkpoint
from cfp_megatron.backends.deepspeed.zero_plan import model_job
from cfp_megatron.base.config import JobSpec, Precision
from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.compat.deepspeed_import import import_deepspeed
from cfp_megatron.data.batches import build_micro_batches
from cfp_megatron.engine import rank_watch
from cfp_megatron.engine.distributed import bound_every_group, model_groups
from cfp_megatron.engine.init import layout_independent_init
from cfp_megatron.engine.metrics import MetricsLog, StepMetrics
from cfp_megatron.engine.model import build_model_chunks
from cfp_megatron.engine.peak import peak_tflops
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck, log_plan_check
from cfp_megatron.profile.cluster import profiled_peak


def build_engine(job: JobSpec, plan: Plan, config: dict[str, Any], dims: ParallelDims) -> tuple[Any, Any]:
    """The model (Megatron-Core GPTModel) and the DeepSpeed engine around it. Process groups must exist."""
    deepspeed = import_deepspeed()

    on_gpu = torch.cuda.is_available()
    mjob = model_job(plan, job)
    mconfig = transformer_config(mjob, dims, on_gpu=on_gpu)
    # DeepSpeed casts the module to bf16/fp16 itself (config "bf16"/"fp16"); build it in fp32 like a user's model.
    (model,) = build_model_chunks(mjob, mconfig, dims, model_groups())
    if job.train.layout_independent_init:
        layout_independent_init([model], mconfig, job.train.seed)
    if plan.zero_stage == 3 and model.share_embeddings_and_output_weights and model.post_process:
        # The output layer multiplies by the embedding's weight, which ZeRO-3 gathers only for the module that owns
        # it: register it with the output layer too (as Megatron-DeepSpeed does for tied embeddings).
        deepspeed.zero.register_external_parameter(model.output_layer, model.shared_embedding_or_output_weight())
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                          if p.requires_grad], config=config)
    return model, engine


def _micro_loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    device = engine.device
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    losses = engine(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    mask = batch["loss_mask"].float()
    return (losses.float() * mask).sum() / mask.sum().clamp(min=1.0)


def train_step(engine: Any, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float, bool]:
    """One optimizer step (backward and step per micro-batch; DeepSpeed steps at the accumulation boundary);
    returns (global mean loss, gradient norm, learning rate used, whether the update was applied: fp16's loss
    scaler skips it on an overflow)."""
    lr = float(engine.get_lr()[0])
    before = engine.global_steps
    total = torch.zeros((), dtype=torch.float64)
    own_norm = None
    for i, batch in enumerate(micro_batches):
        loss = _micro_loss(engine, batch)
        engine.backward(loss)
        if i == len(micro_batches) - 1 and engine.zero_optimization_stage() == 0:
            own_norm = _module_grad_norm(engine)  # DeepSpeed keeps no norm at stage 0; step() clears the grads
        engine.step()
        total += loss.detach().to("cpu", torch.float64)
    if engine.global_steps != before + 1:
        raise RuntimeError(f"{len(micro_batches)} micro-batches made {engine.global_steps - before} DeepSpeed "
                           "optimizer steps, not one: the micro-batches do not match ds_config's accumulation.")
    mean = total / len(micro_batches)
    if torch.cuda.is_available():
        mean = mean.cuda()
    dist.all_reduce(mean)
    norm = engine.get_global_grad_norm()
    if norm is None or (own_norm is not None and float(norm) == 0.0):
        norm = own_norm
    return float(mean) / dist.get_world_size(), float(norm or 0.0), lr, bool(engine.was_step_applied())


def _module_grad_norm(engine: Any) -> float | None:
    """The global L2 norm of the module's gradients before clipping, read after the accumulation boundary's backward
    (at ZeRO stage 0 DeepSpeed has all-reduced them over data parallelism then, so every rank holds the same full
    gradients and no further reduction is needed; ``None`` when the optimizer keeps its own gradient copies)."""
    grads = [p.grad for p in engine.module.parameters() if p.grad is not None]
    if not grads:
        return None
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))


def run_training(job: JobSpec, plan: Plan, config: dict[str, Any], dims: ParallelDims, env: LaunchEnv, *,
                 metrics_path: Path | None, check: PlanCheck | None = None,
                 resume: int | None = None) -> list[StepMetrics]:
    """Build the engine, resume from ``train.checkpoint_dir`` at step ``resume`` (decided before the start:
    ``None``, a fresh start), train to ``train.steps``, save; return rank 0's step metrics."""
    t = job.train
    log = MetricsLog(metrics_path, enabled=env.rank == 0)
    model, engine = build_engine(job, plan, config, dims)
    bound_every_group(t.collective_timeout_s)  # DeepSpeed's own groups too
    saved_state = _state(plan, job)  # what a save records and a resume must match
    step = 0
    if resume is not None and t.checkpoint_dir is not None:
        path, step = checkpoint.load(engine, t.checkpoint_dir, trust_unverified=t.trust_unverified_checkpoint,
                                     step=resume, state=saved_state)
        rank_watch.saved(str(path))
        log.event("resume", step=step, path=path, restart_count=env.restart_count)
    precision = Precision(plan.precision)
    peak, peak_source = peak_tflops(job.cluster, precision,
                                    profiled=profiled_peak(job, world_size=env.world_size, precision=precision))
    flops_per_token = training_flops_per_token(job.model, t.seq_length)
    log.event("start", model=job.model.name, backend="deepspeed", plan=plan.describe(),
              params_on_rank0=sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()),
              steps=t.steps, start_step=step, precision=plan.precision, comm=dist.get_backend(),
              device=torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
              peak_tflops_per_rank=round(peak, 3), peak_source=peak_source, restart_count=env.restart_count,
              metrics=str(metrics_path) if metrics_path else None)
    stream = build_micro_batches(job, dp_rank=env.rank, dp_size=env.world_size, start_step=step)
    tokens_per_step = t.global_batch_size * t.seq_length
    history: list[StepMetrics] = []
    ga = plan.gradient_accumulation_steps
    last_saved = step if resume is not None else None
    while step < t.steps:
        rank_watch.at(f"step {step + 1} of {t.steps}")
        micro_batches = list(itertools.islice(stream, ga))
        if len(micro_batches) < ga:
            log.event("data_exhausted", step=step)
            break
        start = time.perf_counter()
        loss, grad_norm, lr, applied = train_step(engine, micro_batches)
        elapsed = time.perf_counter() - start
        step += 1
        tflops = flops_per_token * tokens_per_step / elapsed / env.world_size / 1e12
        m = StepMetrics(step=step, loss=loss, lr=lr, grad_norm=grad_norm, applied=applied, step_time_s=elapsed,
                        tokens_per_s=tokens_per_step / elapsed, tflops_per_rank=tflops, mfu=tflops / peak)
        history.append(m)
        if step % t.log_interval == 0 or step == t.steps:
            log.step(m, t.steps)
        if check is not None and len(history) == check.after_steps:
            log_plan_check(check, history, log, job, env, backend=dist.get_backend())
        if t.checkpoint_dir and t.save_interval and step % t.save_interval == 0:
            _save(engine, t.checkpoint_dir, step, plan, log, job, saved_state)
            last_saved = step
    if t.checkpoint_dir and last_saved != step:
        _save(engine, t.checkpoint_dir, step, plan, log, job, saved_state)
    log.event("end", step=step)
    return history


def _state(plan: Plan, job: JobSpec) -> dict[str, Any]:
    """The training state of ``plan`` (:func:`.checkpoint.training_state`) on this job's ranks."""
    return checkpoint.training_state(plan.precision, plan.zero_stage, dist.get_world_size(), job.data)


def _save(engine: Any, folder: str, step: int, plan: Plan, log: MetricsLog, job: JobSpec,
          saved_state: dict[str, Any]) -> None:
    rank_watch.at(f"the save of step {step}'s checkpoint")
    saved = checkpoint.save(engine, folder, step, client_state={"plan": plan.canonical()}, model=job.model,
                            state=saved_state)
    rank_watch.saved(str(saved))
    log.event("checkpoint", step=step, path=str(saved))
