"""Plan the DeepSpeed config of a user's own model inside ``deepspeed.initialize`` (the hook of
:mod:`cfp_megatron.backends.deepspeed.hook`), instead of DeepSpeed's autotuner.

What the user's config (a dict or a JSON path; read, never written) leaves as ``"auto"`` is planned:
``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``zero_optimization.stage`` and the devices of
``zero_optimization.offload_optimizer`` / ``offload_param``, with ``train_batch_size`` the global batch. A concrete
value pins its knob; a knob the config does not mention keeps DeepSpeed's default (stage 0, no offload; micro-batch
and accumulation derived from ``train_batch_size``). Activation checkpointing is not planned: DeepSpeed cannot
switch it on for a plain ``nn.Module`` (the model must call ``deepspeed.checkpointing`` itself), so the hook's space
leaves it out and its plans never recompute.

How (every rank takes part; rank 0 searches and broadcasts, so every rank gets the same plan):

1. **Passes, measured on the live ranks.** The model itself (no copy) runs forward and backward on the example input
   re-batched along dim 0 to micro-batches of 1, 2 and 4 sequences: two warm-up passes, then the median of 5 timed
   repeats, every rank at once (a barrier before each), the slowest rank's medians (an all-reduce). A least-squares
   line (fixed + per-sample seconds) through them gives the forward and the backward at any micro-batch. Gradients are
   put back as they were (no optimizer step), and the model's buffers and the RNG states are restored, so the
   user's weights and the training that follows are untouched.
2. **Activations, measured.** The bytes the forward pass saves for the backward pass (``saved_tensors_hooks``, each
   storage once, the parameters left out) at the same micro-batches, fitted the same way. The capture's graphs hold no
   saved-tensor figures, so this is measured, not read from them.
3. **Optimizer.** One AdamW step timed on a flat fp32 tensor (up to 4M elements) and scaled per parameter: a proxy
   for the optimizer over each rank's partition (the user's own optimizer is not run).
4. **Collectives.** The ProfileDB of this machine in ``$CFP_CACHE_DIR`` where it holds fits for the world group
   (``python -m cfp_megatron.profile`` or a ``+cfp=auto`` launch writes one), else a quick fit now: all-reduce,
   reduce-scatter and all-gather on the world group at three message sizes (the profiling round's own benchmark and
   fit, :mod:`cfp_megatron.profile.collectives`).
5. **Engine probes** (``probe_budget_s``, 30 s by default; 0 turns them off). DeepSpeed's own costs around the
   passes (its per-module hooks, bucket copies, reductions, gathers and the optimizer over fp32 partitions) are
   measured as the ``backend=deepspeed`` path measures them (:mod:`cfp_megatron.backends.deepspeed.engine_probe`,
   the same timing loop): per ZeRO stage the search may choose (the pinned one only; on GPUs those with a plan at
   micro-batch 1 within the memory), DeepSpeed's engine is built around a deep copy of the model (the user's config
   at micro-batch 1 without offload, its optimizer section or torch's AdamW; monitors left out) and timed at 1, 2
   and 4 micro-batches of the example's first sample per step, in turn, the slowest rank's median of 5 rounds;
   then destroyed and its memory freed. The line through the points gives the engine's cost per step and per
   micro-batch beyond the measured passes at micro-batch 1
   (:attr:`~cfp_megatron.backends.deepspeed.costs.ZeroPasses.single_pass_s`). Stages not reached within the budget keep
   the analytical terms. The user's model, its weights and the RNG states are untouched: the engine
   ``deepspeed.initialize`` builds afterwards is the first around the model.
6. **Search.** Every stage x micro-batch x offload the pins leave (offload only on GPU ranks unless pinned), each
   simulated by :func:`cfp_megatron.backends.deepspeed.costs.zero_step` (the ZeRO terms the ``backend=deepspeed`` path
   uses) with the measured passes (:class:`~cfp_megatron.backends.deepspeed.costs.ZeroPasses`) and the stage's probe,
   which replaces the analytical reduction, gather and optimizer terms; on GPUs plans over the device's memory less the
   headroom are dropped; the fastest wins, ties broken by the canonical string.

Left out: micro-batches above 4 come from the fitted line; the passes run in the model's own dtype (a ``bf16``
config with an fp32 model is timed in fp32, while its probes run in bf16); the probes are not cached (each
planning takes them again); the whole model must fit one device to be measured (a model built under
``deepspeed.zero.Init`` is refused).
"""


from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from cfp_megatron.backends.deepspeed.costs import ZeroPasses, zero_sharding, zero_step
from cfp_megatron.backends.deepspeed.hook_config import HookRequest, filled_config
from cfp_megatron.backends.deepspeed.hook_measure import (
    DEFAULT_PROBE_BUDGET_S,
    live_cluster,
    measure_passes,
    probe_engines,
)
from cfp_megatron.backends.deepspeed.search import rank_zero_plans, ranking_table, zero_candidates
from cfp_megatron.backends.deepspeed.zero_plan import write_json_file
from cfp_megatron.base.backend_spec import CONFIG_KEYS, ZeroSpec
from cfp_megatron.base.cfp_spec import SearchConstraints
from cfp_megatron.base.config import ClusterSpec, ParallelSpec, Recompute
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.engine.distributed import searched_on_rank0
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.backend_part import DeepSpeedPart
from cfp_megatron.sim.pass_costs import collective_costs
from cfp_megatron.sim.prediction import GIB

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.costs import ZeroPasses, ZeroPredictionResult
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes
    from cfp_megatron.backends.deepspeed.hook_measure import MeasuredPasses
    from cfp_megatron.backends.deepspeed.search import ZeroKnobs, ZeroSearchResult

MEMORY_HEADROOM: float = SearchConstraints.memory_headroom
"""Share of a GPU's memory left free (``cfp.constraints.memory_headroom``'s default)."""


@dataclass(frozen=True, kw_only=True)
class HookPlan:
    """What the hook planned: the plan, the filled config and where the figures came from."""

    plan: Plan
    """The chosen plan (rank 0's, checked by canonical string and hash on every rank)."""
    config: dict[str, Any]
    """The user's config with the ``"auto"`` values filled; what ``deepspeed.initialize`` gets."""
    measured: MeasuredPasses
    """The model's measured passes."""
    collectives: str
    """Where the collective costs came from (the ProfileDB's path, or the quick fit)."""
    planning_s: float
    """Seconds from the start of the measurements to the broadcast plan."""
    written: Path | None = None
    """``ds_config.json`` written on rank 0 into ``output_dir``, if one was given."""
    probes: EngineProbes | None = None
    """The engine probes the search used (the same on every rank); ``None`` when they were off."""
    probe_s: float = 0.0
    """Seconds the engine probes took."""

    @property
    def probed_stages(self) -> tuple[int, ...]:
        """The ZeRO stages whose engine was probed."""
        return tuple(sorted(self.probes.stages)) if self.probes is not None else ()


# -- the config ----------------------------------------------------------------------------------------------------


def zero_fetches(model: torch.nn.Module, threshold: int) -> int:
    """ZeRO-3's parameter fetches per pass: modules holding a parameter of more than ``threshold`` elements
    (smaller ones stay whole on every rank)."""
    return sum(1 for m in model.modules() if any(p.numel() > threshold for p in m.parameters(recurse=False)))


def hook_passes(measured: MeasuredPasses, plan: Plan, *, layers: int, fetches: int,
                flops_per_token: float) -> ZeroPasses:
    """The measured passes as the ZeRO terms read them for ``plan``: the fitted lines at its micro-batch, times its
    accumulation steps; no recomputation; one micro-batch of one sample as the engine probes' reference (module
    docstring)."""

    mb, steps = plan.micro_batch_size, plan.gradient_accumulation_steps
    (f0, f1), (b0, b1), (a0, a1) = measured.forward, measured.backward, measured.activations
    stepped = zero_sharding(plan).optimizer_params(float(measured.params))  # the rank's optimizer shard
    return ZeroPasses(forward_s=steps * (f0 + f1 * mb), backward_s=steps * (b0 + b1 * mb), recompute_s=0.0,
                      overhead_s=0.0, optimizer_s=measured.optimizer_s_per_param * stepped,
                      params=float(measured.params), layers=max(layers, 1), fetches=fetches,
                      activation_bytes=a0 + a1 * mb, flops_per_token=flops_per_token,
                      single_pass_s=f0 + f1 + b0 + b1)


# -- the cluster ---------------------------------------------------------------------------------------------------


def model_name(name: str) -> str:
    """``name`` as the canonical string allows it (letters, digits, ``_.+-``)."""
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", name) or "model"


def hook_zero_plan(request: HookRequest, cluster: ClusterSpec, knobs: ZeroKnobs, *, name: str, seq_length: int,
                   local_world: int) -> Plan:
    """The plan of one candidate's ``knobs`` for the request on ``cluster``."""
    stage, mb, ckpt, oopt, oparam = knobs
    world = request.world
    per_node = max(min(local_world, world), 1)
    zero = ZeroSpec(stage=stage, offload_optimizer=oopt, offload_param=oparam,
                    bucket_elements=request.bucket_elements)
    parallel = ParallelSpec(recompute=Recompute.full if ckpt else Recompute.none, distributed_optimizer=stage >= 1)
    return Plan(model=model_name(name), cluster=cluster.name, nodes=max(world // per_node, 1),
                gpus_per_node=per_node, parallel=parallel, micro_batch_size=mb, global_batch_size=request.global_batch,
                seq_length=seq_length, precision=request.precision, backend_part=DeepSpeedPart(zero=zero))


def search_hook(request: HookRequest, measured: MeasuredPasses, cluster: ClusterSpec,
                measurements: Measurements | None, *, name: str, seq_length: int, layers: int, fetches: int,
                flops_per_token: float, local_world: int, headroom: float = MEMORY_HEADROOM, top_k: int = 5,
                probes: EngineProbes | None = None) -> ZeroSearchResult:
    """Every plan the request's pins leave, simulated with the measured passes and, where ``probes`` has the
    plan's stage, the engine's measured costs, and ranked (module docstring, step 6). Pure: no process-group
    calls."""

    costs = collective_costs(cluster, measurements)
    world = request.world
    per_node = max(min(local_world, world), 1)
    candidates, rejected = zero_candidates(
        request.pins, list(request.micro_batches), cluster=cluster,
        offload_pins='config.zero_optimization.offload_optimizer/offload_param (device "cpu")')

    def plan_of(knobs: ZeroKnobs) -> Plan:
        return hook_zero_plan(request, cluster, knobs, name=name, seq_length=seq_length, local_world=local_world)

    def evaluate(plan: Plan) -> ZeroPredictionResult:
        passes = hook_passes(measured, plan, layers=layers, fetches=fetches, flops_per_token=flops_per_token)
        probe = probes.stages.get(plan.zero_stage) if probes is not None else None
        return zero_step(plan, passes, costs, cluster, dp_per_node=per_node, probe=probe)

    return rank_zero_plans(candidates, plan_of, evaluate, hbm_gib=cluster.hbm_gib, headroom=headroom,
                           peak_tflops=None, top_k=top_k, rejected=rejected, subject=f"{name} on {world} ranks",
                           key="config", pins={k: v for k, v in request.pins.items()
                                               if k != "activation_checkpointing"},
                           pinned=tuple(f"config's {CONFIG_KEYS[k]}" for k in request.pins if k in CONFIG_KEYS))


def probe_stage_list(request: HookRequest, measured: MeasuredPasses, cluster: ClusterSpec, *, seq_length: int,
                     layers: int, fetches: int, local_world: int, headroom: float = MEMORY_HEADROOM) -> tuple[int, ...]:
    """The ZeRO stages to probe (module docstring, step 5): the pinned stage, else every stage; on GPUs only those
    whose probe (micro-batch 1, no offload) the memory model fits within the device less ``headroom``. Pure."""

    pinned = request.pins.get("zero_stage")
    stages = (int(pinned),) if pinned is not None else (0, 1, 2, 3)
    if cluster.hbm_gib is None:
        return stages
    costs = collective_costs(cluster, None)
    per_node = max(min(local_world, request.world), 1)
    limit = cluster.hbm_gib * GIB * (1.0 - headroom)

    def fits(stage: int) -> bool:
        plan = hook_zero_plan(request, cluster, (stage, 1, False, False, False), name="probe",
                              seq_length=seq_length, local_world=local_world)
        passes = hook_passes(measured, plan, layers=layers, fetches=fetches, flops_per_token=0.0)
        return zero_step(plan, passes, costs, cluster, dp_per_node=per_node).memory.total <= limit

    return tuple(s for s in stages if fits(s))


def _refuse_partitioned(model: torch.nn.Module) -> None:
    """A :class:`ConfigError` for a model built under ``deepspeed.zero.Init`` (it cannot be run to be measured)."""
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise ConfigError(ConfigIssue(key="config.zero_optimization.stage", value="auto",
                                      problem="the model was built under deepspeed.zero.Init, so its parameters are "
                                              "already partitioned and the hook cannot run it to measure it.",
                                      fix="build the model without zero.Init, or pin the config's values."))


def _launch_env(request: HookRequest) -> Any:
    """This rank's :class:`~cfp_megatron.base.launch_env.LaunchEnv` on the initialised process group, checked
    against the request's world size."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if world != request.world:
        raise ConfigError(ConfigIssue(key="WORLD_SIZE", value=world,
                                      problem=f"the process group has {world} ranks, the config was checked for "
                                              f"{request.world}.", fix="set WORLD_SIZE as the launcher does."))
    env = LaunchEnv.read()
    return LaunchEnv(rank=rank, world_size=world, local_rank=env.local_rank,
                     local_world_size=min(env.local_world_size, world), restart_count=env.restart_count,
                     under_torchrun=env.under_torchrun)


def _hook_probes(model: torch.nn.Module, example_input: Any, request: HookRequest, stages: tuple[int, ...], *,
                 name: str, loss_fn: Callable[[Any], torch.Tensor] | None, budget_s: float,
                 console: Any) -> tuple[EngineProbes | None, float]:
    """The engine probes of rank 0's ``stages`` (module docstring, step 5; every rank calls this) and their
    seconds; none when ``budget_s`` is 0 or no stage is left. Rank 0 prints what it probed to ``console``."""

    import torch.distributed as dist

    if budget_s <= 0:
        return None, 0.0
    box = [stages]
    dist.broadcast_object_list(box, src=0)  # every rank probes rank 0's stages: the probes are collective
    if not box[0]:
        return None, 0.0
    began = time.perf_counter()
    probes = probe_engines(model, example_input, request, box[0], name=name, loss_fn=loss_fn, budget_s=budget_s)
    elapsed = time.perf_counter() - began
    if console is not None:
        console.print(f"cfp: probed the DeepSpeed engine (stages {sorted(probes.stages)}) in {elapsed:.1f} s",
                      markup=False)
    return probes, elapsed


def plan_model(model: torch.nn.Module, example_input: Any, request: HookRequest, *, name: str, seq_length: int,
               layers: int, flops_per_token: float, loss_fn: Callable[[Any], torch.Tensor] | None = None,
               output_dir: str | Path | None = None, console: Any = None,
               probe_budget_s: float = DEFAULT_PROBE_BUDGET_S) -> HookPlan:
    """Measure, probe the engine within ``probe_budget_s`` (0: not), search on rank 0, broadcast, fill the config
    (module docstring); every rank of the initialised process group calls this. Rank 0 prints the ranking to
    ``console`` and writes ``ds_config.json`` into ``output_dir`` when one is given (never over another file)."""

    began = time.perf_counter()
    _refuse_partitioned(model)
    env = _launch_env(request)
    first = next(iter(model.parameters()), None)
    if torch.cuda.is_available() and first is not None and first.device.type == "cpu":
        model.to(torch.device("cuda", torch.cuda.current_device()))  # where DeepSpeed's engine puts it
    measured = measure_passes(model, example_input, loss_fn=loss_fn)
    cluster, measurements, source = live_cluster(request.world, env.local_world_size)
    fetches = zero_fetches(model, request.persistence_threshold)
    stages = probe_stage_list(request, measured, cluster, seq_length=seq_length, layers=layers, fetches=fetches,
                              local_world=env.local_world_size)
    probes, probe_s = _hook_probes(model, example_input, request, stages, name=name, loss_fn=loss_fn,
                                   budget_s=probe_budget_s, console=console)

    def search() -> dict[str, Any]:
        started = time.perf_counter()
        result = search_hook(request, measured, cluster, measurements, name=name, seq_length=seq_length,
                             layers=layers, fetches=fetches, flops_per_token=flops_per_token,
                             local_world=env.local_world_size, probes=probes)
        if console is not None:
            console.print(ranking_table(result))
            console.print(f"cfp: searched {result.evaluated} DeepSpeed plans of {name} in "
                          f"{(time.perf_counter() - started) * 1e3:.0f} ms; collectives: {source}", markup=False)
            for what, why in result.rejected:
                console.print(f"cfp:   left out {what}: {why}", markup=False)
        return {"plan": result.best.plan.to_json()}

    received = searched_on_rank0(search, None, env, None)
    plan = Plan.from_json(received["plan"])  # checks the canonical string and hash on this rank
    config = filled_config(request, plan)
    written = None
    if output_dir is not None and env.rank == 0:
        written = write_json_file(config, Path(output_dir) / "ds_config.json")
    planning = time.perf_counter() - began
    if console is not None:
        console.print(f"cfp: planned {plan.describe()} ({plan.canonical()}) in {planning:.2f} s (measuring "
                      f"{measured.wall_s:.2f} s, probing {probe_s:.2f} s)" + (f"; config {written}" if written else ""),
                      markup=False)
    return HookPlan(plan=plan, config=config, measured=measured, collectives=source, planning_s=planning,
                    written=written, probes=probes, probe_s=probe_s)


def flops_per_token(total_flops: float, micro_batch: int, seq_length: int) -> float:
    """FLOPs per token of a capture's forward and backward (``total_flops`` at ``micro_batch`` x ``seq_length``)."""
    return total_flops / max(micro_batch * seq_length, 1) if math.isfinite(total_flops) else 0.0
