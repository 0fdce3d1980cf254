"""``backend=deepspeed +cfp=auto``: profile with every rank, search the DeepSpeed space on rank 0, broadcast the plan,
check it on every rank. The profiling rounds are the Megatron backend's (collectives, GEMMs, segments under each
partition and micro-batch, overheads) and share its ProfileDB, so a cluster profiled once serves both backends."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

from cfp_megatron.backends.deepspeed.backend import DeepSpeedBackend
from cfp_megatron.backends.deepspeed.engine_probe import load_probes, probe_path, run_probes
from cfp_megatron.base.backend_spec import BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSpec, ParallelSpec
from cfp_megatron.base.files import CACHE_KEY, FileWriteError, write_atomic
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck
from cfp_megatron.profile.cluster import local_measurements
from cfp_megatron.profile.fingerprint import model_key

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes
    from cfp_megatron.plan.check import PlanCheck


def planned(job: JobSpec, cfp: CfpSpec, backend: BackendSpec, env: LaunchEnv, console: Any, *,
            on_gpu: bool) -> tuple[Plan, PlanCheck | None]:
    """The plan every rank trains with, and the check of its first steps (``cfp.check_after_steps``)."""

    from cfp_megatron.engine.distributed import destroy_model_parallel_groups, searched_on_rank0
    from cfp_megatron.profile.runner import profile_job

    began = time.perf_counter()
    outcome = profile_job(job, env, budget_s=cfp.profile_budget_s, keep_group=True)
    destroy_model_parallel_groups()  # the profiling rounds' last Megatron groups; training makes its own
    # The default process group stays up for training: DeepSpeed's communication layer keeps the group it first
    # saw (during the probes), so it must not be replaced.
    probes = _engine_probes(job, env, outcome.db.fingerprint.key if outcome.db is not None else None, console,
                            on_gpu=on_gpu)
    received = searched_on_rank0(
        lambda: _search_on_rank0(job, cfp, backend, env.world_size, console, probes, on_gpu=on_gpu), outcome, env,
        console)
    plan = Plan.from_json(received["plan"])  # checks the canonical string and hash on this rank
    if console is not None:
        console.print(f"cfp: planned in {time.perf_counter() - began:.1f} s (profiling {outcome.wall_s:.1f} s)",
                      markup=False)
    if plan.predicted is None or cfp.check_after_steps == 0:
        return plan, None
    # kept apart from the Megatron backend's checks, which calibrate Megatron plans (ProfileDB.step_time_calibration)
    check = PlanCheck(plan=plan.canonical(), model_key=f"{model_key(job, on_gpu=on_gpu)}+deepspeed",
                      after_steps=min(cfp.check_after_steps, job.train.steps),  # a shorter run: its last step
                      warmup_steps=cfp.check_warmup_steps,
                      predicted_step_s=plan.predicted.step_time_s, calibration=1.0,
                      predicted_peak_bytes=None)
    return plan, check


def _engine_probes(job: JobSpec, env: LaunchEnv, fingerprint: str | None, console: Any, *,
                   on_gpu: bool) -> EngineProbes | None:
    """The DeepSpeed engine probes of this model on the cluster of ``fingerprint`` (rank 0's ProfileDB; ``None`` on
    the other ranks): stored ones, else measured now with every rank. Rank 0 decides and stores; only its answer
    is used (only rank 0 searches)."""

    import torch.distributed as dist

    from cfp_megatron.engine.distributed import destroy_model_parallel_groups, init_distributed

    key = model_key(job, on_gpu=on_gpu)
    world = env.world_size
    stored = path = None
    if fingerprint is not None:
        path = probe_path(fingerprint, key)
        stored = load_probes(path, world)
    box = [stored is None]  # rank 0's answer counts
    dist.broadcast_object_list(box, src=0)
    if not box[0]:
        return stored
    began = time.perf_counter()
    dims = ParallelDims.build(dataclasses.replace(job, parallel=ParallelSpec()), world)
    init_distributed(job, dims, env)  # Megatron's groups (all of size 1 but DP) and its RNG tracker
    try:
        probes = run_probes(job, dims, model=key)
    finally:
        destroy_model_parallel_groups()
    if env.rank == 0 and path is not None:
        try:  # a cache: the job goes on with the probes it holds, and says they were not kept
            write_atomic(path, json.dumps(probes.to_json(), indent=1) + "\n", key=CACHE_KEY)
            kept = str(path)
        except FileWriteError as err:
            kept = f"not stored, the next launch probes again: {err}"
        if console is not None:
            console.print(f"cfp: probed the DeepSpeed engine (stages {sorted(probes.stages)}) in "
                          f"{time.perf_counter() - began:.1f} s ({kept})", markup=False)
    return probes


def _search_on_rank0(job: JobSpec, cfp: CfpSpec, backend: BackendSpec, world: int, console: Any,
                     probes: EngineProbes | None, *, on_gpu: bool) -> dict[str, Any]:
    cluster, measurements = local_measurements(job, world_size=world)
    started = time.perf_counter()
    found = DeepSpeedBackend(probes=probes).search(dataclasses.replace(job, cluster=cluster), world, cfp, backend,
                                                   measurements=measurements, inputs_fingerprint="", on_gpu=on_gpu)
    searched = time.perf_counter() - started
    best = dataclasses.replace(found.best, cluster=job.cluster.name)
    if console is not None:
        found.report(console)
        console.print(f"cfp: searched {found.searched} DeepSpeed plans in {searched * 1e3:.0f} ms", markup=False)
    return {"plan": best.to_json()}
