"""One training step on Megatron-Core: the model chunks wrapped in Megatron DDP, its optimizer and LR schedule, the
forward step and loss of the pipeline schedules, and one optimizer step (used by the trainer and the overheads
probe)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.module import Float16Module
from megatron.core.utils import get_batch_on_this_cp_rank

from cfp_megatron.base.config import FsdpStrategy, JobSpec, Precision, resolve_precision
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.compat.optimizer import retain_shard_grads
from cfp_megatron.engine.distributed import model_groups, optimizer_instances
from cfp_megatron.engine.init import layout_independent_init
from cfp_megatron.engine.model import build_model_chunks
from cfp_megatron.model.megatron_config import transformer_config


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
    groups: ProcessGroupCollection
    """The process groups the model, DDP and the schedules run on (passed to each; the optimizer reads the same
    groups from Megatron's globals, see :func:`build_training`)."""
    step: int = 0
    """Optimizer steps completed so far."""


def build_training(job: JobSpec, dims: ParallelDims, groups: ProcessGroupCollection | None = None) -> TrainState:
    """Model chunks, DDP, optimizer and LR schedule for this rank on ``groups`` (default: the groups
    :func:`~cfp_megatron.engine.distributed.init_distributed` made, :func:`~cfp_megatron.engine.distributed.
    model_groups`)."""
    groups = groups or model_groups()
    on_gpu = torch.cuda.is_available()
    precision = resolve_precision(job.train.precision, on_gpu)
    config = transformer_config(job, dims, on_gpu=on_gpu)
    chunks = build_model_chunks(job, config, dims, groups)
    if job.train.layout_independent_init:
        layout_independent_init(chunks, config, job.train.seed)
    p, t = job.parallel, job.train
    fsdp = p.fsdp is not FsdpStrategy.none
    fp8_params = NumberFormat.of(t).param_fields(p.fp8_param_gather)  # parallel.fp8_param_gather
    ddp_config = DistributedDataParallelConfig(
        **fp8_params,
        grad_reduce_in_fp32=p.grad_reduce_in_fp32,
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.distributed_optimizer,
        use_megatron_fsdp=fsdp,
        data_parallel_sharding_strategy=p.fsdp.value if fsdp else "no_shard",
        num_distributed_optimizer_instances=optimizer_instances(job, dims),
        # fp16 relies on the dynamic loss scaler, whose first scales overflow on purpose and skip their steps.
        check_for_nan_in_grad=precision is not Precision.fp16,
    )
    # As Megatron-LM does: bf16/fp16 chunks run inside Float16Module, which casts the inputs of the first stage and
    # the outputs of the last one.
    compute = [Float16Module(config, c) if precision is not Precision.fp32 else c for c in chunks]
    ddp_chunks = [wrap_data_parallel(config, ddp_config, chunk, disable_bucketing=i > 0, groups=groups)
                  for i, chunk in enumerate(compute)]
    opt_config = OptimizerConfig(
        optimizer=t.optimizer.value, lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
        adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps, clip_grad=t.clip_grad,
        bf16=precision is Precision.bf16, fp16=precision is Precision.fp16, params_dtype=config.params_dtype,
        use_distributed_optimizer=p.distributed_optimizer,
        reuse_grad_buf_for_mxfp8_param_ag=fp8_params["reuse_grad_buf_for_mxfp8_param_ag"],
    )
    # The optimizer reads Megatron's global groups: given explicit ones, Megatron-Core 0.16 refuses the gloo groups its
    # distributed optimizer gathers checkpoint state over (get_megatron_optimizer's use_gloo_process_groups).
    optimizer = get_megatron_optimizer(opt_config, ddp_chunks)
    retain_shard_grads(optimizer)  # fp32 shards are non-leaf views whose .grad Megatron assigns (compat.optimizer)
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
                      scheduler=scheduler, config=config, groups=groups)


def wrap_data_parallel(config: Any, ddp_config: DistributedDataParallelConfig, chunk: torch.nn.Module, *,
                       disable_bucketing: bool, groups: ProcessGroupCollection) -> Any:
    """``chunk`` in Megatron-Core's DDP, or in Megatron-FSDP's wrapper where the config says ``use_megatron_fsdp``
    (on this rank's device: the CPU without CUDA, where Megatron-FSDP would name ``cuda:<current device>``)."""
    if not ddp_config.use_megatron_fsdp:
        return DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                       disable_bucketing=disable_bucketing, pg_collection=groups)
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    device = (torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available()
              else torch.device("cpu"))
    return FullyShardedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                    disable_bucketing=disable_bucketing, device=device, pg_collection=groups)


def loss_func(loss_mask: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Summed token loss of one micro-batch, its token count, and the (loss, tokens) pair to report."""
    losses = output.float().reshape(-1)
    mask = loss_mask.float().reshape(-1)
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), mask.sum().detach()])
    return loss, num_tokens, {"lm loss": report}


def forward_step(data_iterator: Iterator[dict[str, torch.Tensor]], model: torch.nn.Module) -> tuple:
    """Megatron's ``forward_step_func``: the next micro-batch through ``model`` (this CP rank's part of it)."""
    batch = next(data_iterator)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    if parallel_state.get_context_parallel_world_size() > 1:
        batch = get_batch_on_this_cp_rank(batch)
    # The loss mask reaches the model for its MTP losses (the main loss is masked in loss_func).
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   loss_mask=batch["loss_mask"])
    return output, partial(loss_func, batch["loss_mask"])


def reduce_loss(reports: list[dict], state: TrainState) -> float:
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


def forward_backward(state: TrainState, data: Any, num_microbatches: int, micro_batch_size: int) -> list[dict]:
    """Forward and backward of ``num_microbatches`` micro-batches from ``data`` (an iterator, or one per model chunk)
    through Megatron's schedule for the layout, on the state's process groups; the loss reports."""
    dims = state.dims
    groups: dict[str, Any] = {"pg_collection": state.groups}
    if dims.pp > 1:  # the pipelined schedules take the point-to-point communicator with the groups
        groups["p2p_communicator"] = P2PCommunicator(pp_group=state.groups.pp, config=state.config)
    return get_forward_backward_func(pp_size=dims.pp, vp_size=dims.vpp if dims.vpp > 1 else None)(
        forward_step_func=forward_step, data_iterator=data, model=state.ddp_chunks,
        num_microbatches=num_microbatches, seq_length=state.job.train.seq_length,
        micro_batch_size=micro_batch_size, forward_only=False, **groups)


def train_step(state: TrainState, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, float, float, bool]:
    """One optimizer step over the given micro-batches; returns (loss, grad norm, learning rate, applied).

    ``applied`` is False when fp16's loss scaler found an overflow and skipped the update.
    """
    job, dims = state.job, state.dims
    for c in state.ddp_chunks:
        c.zero_grad_buffer()
    state.optimizer.zero_grad()
    iterators: Any = [iter(micro_batches) for _ in state.ddp_chunks]
    reports = forward_backward(state, iterators if len(iterators) > 1 else iterators[0], dims.num_microbatches,
                           job.train.micro_batch_size)
    lr = state.optimizer.param_groups[0]["lr"]
    applied, grad_norm, _ = state.optimizer.step()
    if applied:  # as Megatron-LM: a step skipped by the loss scaler does not advance the schedule
        state.scheduler.step(increment=1)
    state.step += 1
    return reduce_loss(reports, state), float(grad_norm or 0.0), float(lr), bool(applied)
