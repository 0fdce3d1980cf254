"""torch.distributed and Megatron-Core process groups for a validated layout."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import inspect
import os
from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from cfp_megatron.base.config import Backend, JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims, hierarchical_cp_sizes
from cfp_megatron.engine import rank_watch

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=10)
"""Least time the rendezvous waits for every rank to arrive (torch's default)."""


def resolve_backend(backend: Backend) -> str:
    """NCCL with CUDA, gloo without; ``cluster.backend=nccl`` where NCCL cannot run is a :class:`ConfigError`
    (torch's ``RuntimeError`` as the process group starts)."""
    if backend is Backend.auto:
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend is Backend.nccl and not (torch.cuda.is_available() and dist.is_nccl_available()):
        raise ConfigError(ConfigIssue(key="cluster.backend", value="nccl", problem="needs GPUs and a torch built with "
                                      "NCCL; this machine has "
                                      f"{'a torch without NCCL' if torch.cuda.is_available() else 'no GPU'}.",
                                      fix="leave cluster.backend=auto (NCCL with GPUs, gloo without), or set "
                                          "cluster.backend=gloo."))
    return backend.value


def prepare_device_and_env(env: LaunchEnv, *, port: int) -> None:
    """Tie this rank to torchrun (:func:`~cfp_megatron.engine.rank_watch.tie_to_launcher`, for entries that did not
    yet), bind its GPU (when there is one) and, outside torchrun, set up a one-process ``env://`` rendezvous."""
    rank_watch.tie_to_launcher()
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
    if not env.under_torchrun:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")


def init_distributed(job: JobSpec, dims: ParallelDims, env: LaunchEnv) -> None:
    """Create the default process group (env:// from torchrun) and Megatron's model-parallel groups, then seed.
    Every group waits at most ``train.collective_timeout_s`` in a collective; each rank's progress is recorded in
    the default group's store (:mod:`cfp_megatron.engine.rank_watch`) so a stalled rank can be named."""
    prepare_device_and_env(env, port=29511)
    timeout = datetime.timedelta(seconds=job.train.collective_timeout_s)
    backend = resolve_backend(job.cluster.backend)  # refused before the rendezvous where it cannot run
    if not dist.is_initialized():
        kwargs: dict = {}
        if torch.cuda.is_available():
            kwargs["device_id"] = torch.device("cuda", env.local_rank)
        # torchrun's store outlives a worker restart, and process-group keys (Megatron creates dozens of groups)
        # would then resolve to the dead workers' addresses; keep each attempt's keys apart. The rendezvous waits
        # for every rank to arrive (rank 0 may plan first): at least torch's default 10 minutes.
        store, rank, world = next(dist.rendezvous("env://", env.rank, env.world_size,
                                                  timeout=max(timeout, RENDEZVOUS_TIMEOUT)))
        store = dist.PrefixStore(f"/cfp/attempt_{env.restart_count}", store)
        rank_watch.at("start-up: the process groups, the model and the optimizer (before this run's first step)")
        init_default_group(backend, store, rank, world, timeout, **kwargs)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=dims.tp,
        pipeline_model_parallel_size=dims.pp,
        virtual_pipeline_model_parallel_size=dims.vpp if dims.vpp > 1 else None,
        context_parallel_size=dims.cp,
        hierarchical_context_parallel_sizes=hierarchical_cp_sizes(job, dims),
        expert_model_parallel_size=dims.ep,
        expert_tensor_parallel_size=dims.etp,
        order=dims.order,
        num_distributed_optimizer_instances=optimizer_instances(job, dims),
        distributed_timeout_minutes=job.train.collective_timeout_s / 60,  # a timedelta's minutes: fractions work
    )
    if job.parallel.tp_comm_overlap:
        initialize_tp_communicators(job, dims)
    # Megatron's RNG tracker: same seed on TP peers for replicated work, distinct where Megatron wants it.
    torch.manual_seed(job.train.seed)
    model_parallel_cuda_manual_seed(job.train.seed)


def optimizer_instances(job: JobSpec, dims: ParallelDims) -> int:
    """Megatron-Core's ``num_distributed_optimizer_instances``: the hybrid shard groups (``parallel.dp_shard_size``)
    DP x CP splits into, 1 without hybrid sharding."""
    shard = job.parallel.dp_shard_size
    return 1 if shard is None else dims.dp * dims.cp // shard


def init_default_group(backend: str, store: dist.Store, rank: int, world: int, timeout: datetime.timedelta,
                       **kwargs: Any) -> None:
    """The default process group on ``store``, every collective bounded by ``timeout``, and this rank's progress
    recorded in ``store`` (:func:`cfp_megatron.engine.rank_watch.watch`). Joining it may take longer (ranks arrive
    minutes apart while rank 0 plans or draws): up to :data:`RENDEZVOUS_TIMEOUT` when ``timeout`` is shorter; a
    rank missing after that is named (:class:`~cfp_megatron.engine.rank_watch.RankStalledError`)."""
    rank_watch.watch(store, rank=rank, world=world, timeout_s=timeout.total_seconds())
    joining = max(timeout, RENDEZVOUS_TIMEOUT)
    try:
        dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=joining, **kwargs)
    except Exception as err:
        if rank_watch.is_collective_timeout(err):
            raise rank_watch.stalled(err, limit_s=joining.total_seconds()) from None
        raise
    if joining != timeout:
        dist.distributed_c10d._set_pg_timeout(timeout)  # torch's own setter (gloo and NCCL), for later work


def bound_every_group(timeout_s: float) -> None:
    """Bound the collectives of every process group this rank joined by ``timeout_s``
    (``train.collective_timeout_s``): the groups made without a timeout (DeepSpeed's, PrimePar's grids) have
    torch's 30 minutes otherwise."""
    timeout = datetime.timedelta(seconds=timeout_s)
    for group in list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else ():
        with contextlib.suppress(ValueError, RuntimeError):  # a group this rank is not in, or one already gone
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def initialize_tp_communicators(job: JobSpec, dims: ParallelDims) -> None:
    """Transformer Engine's userbuffers for ``parallel.tp_comm_overlap``, as Megatron-LM's training setup creates
    them (``_initialize_tp_communicators``): one buffer shape, a micro-batch's tokens on a CP rank by the hidden
    size, over the TP group; TE's default overlap method for each GEMM. GPU and Transformer Engine only (the plan's
    checks refuse it elsewhere)."""
    from transformer_engine.pytorch import module as te_module  # GPU only; checked before any group starts

    shape = [job.train.seq_length * job.train.micro_batch_size // dims.cp, job.model.hidden_size]
    parameters = inspect.signature(te_module.base.initialize_ub).parameters
    if "quantization_modes" in parameters:  # Transformer Engine 2.7 and later
        modes = [te_module.base.UserBufferQuantizationMode.NONE]
        te_module.base.initialize_ub(shape=shape, tp_size=dims.tp, quantization_modes=modes)
    else:
        te_module.base.initialize_ub(shape=shape, tp_size=dims.tp, use_fp8=False)


def destroy_tp_communicators() -> None:
    """Transformer Engine's userbuffers (:func:`initialize_tp_communicators`), destroyed so that another layout of
    the same process can make its own (trials at launch); nothing without Transformer Engine."""
    try:
        from transformer_engine.pytorch import module as te_module
    except ImportError:
        return
    te_module.base.destroy_ub()


def model_groups() -> ProcessGroupCollection:
    """The process groups :func:`init_distributed` made (Megatron-Core's own, read once from ``parallel_state``),
    as the collection the model, DDP, the optimizer and the schedules are given."""
    return ProcessGroupCollection.use_mpu_process_groups()


def destroy_model_parallel_groups() -> None:
    """Megatron's ``destroy_model_parallel``, and destroy the groups it only forgets.

    ``destroy_model_parallel`` drops its references but destroys only its gloo copies; the other groups stay
    registered with torch.distributed, each with its threads and connections (communicators under NCCL). Megatron
    lists every group this rank joined in ``parallel_state._global_process_group_list``; those still registered are
    destroyed here (a local operation, no collective). Needed where groups are rebuilt in one process (profiling
    builds them for every probe: left alive they slow the later probes on a CPU with fewer cores than ranks); at the
    end of a job ``dist.destroy_process_group()`` destroys every group anyway. A destroyed gloo group
    keeps its threads (two workers and a TCP loop) until the Python object goes, and the old model, DDP buffers and
    optimizer that hold it sit in reference cycles: a garbage collection ends them here (the threads it saved, measured:
    docs/validation.md)."""
    groups = [g for g in (parallel_state._global_process_group_list or ()) if g is not None]
    parallel_state.destroy_model_parallel()
    registered = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    for group in groups:
        if group in registered:  # Megatron destroyed its gloo copies itself
            dist.destroy_process_group(group)
    gc.collect()


def destroy_distributed() -> None:
    """Tear down Megatron's groups and the default process group."""
    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def searched_on_rank0(search: Any, outcome: Any, env: LaunchEnv, console: Any) -> dict[str, Any]:
    """Say how profiling went and run ``search`` (returning a JSON-ready payload) on rank 0, then give its payload
    to every rank; a :class:`ConfigError` on rank 0 is raised on every rank."""
    payload: dict[str, Any] | None = None
    rank_watch.at("the search for a plan (rank 0 searches while the others wait)")
    if env.rank == 0:
        if console is not None:
            state = "reused the ProfileDB" if outcome.reused else f"profiled in {outcome.wall_s:.1f} s"
            under = f", {outcome.measured_under}" if outcome.measured_under else ""
            console.print(f"cfp: {state}{under} ({outcome.path})", markup=False)
        try:
            payload = search()
        except ConfigError as err:
            payload = {"error": [dataclasses.asdict(i) for i in err.issues]}
    box = [payload]
    dist.broadcast_object_list(box, src=0)
    received: dict[str, Any] = box[0] or {}
    if "error" in received:
        raise ConfigError([ConfigIssue(**i) for i in received["error"]])
    return received
