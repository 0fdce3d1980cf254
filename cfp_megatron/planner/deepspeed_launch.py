"""What the DeepSpeed backend adds to the one launch pipeline (:class:`DeepSpeedLaunch`, the
:class:`~cfp_megatron.backends.protocol.LaunchHooks` of ``backend=deepspeed``): no model parallelism, its checkpoint
folder, the plan of the ``backend`` knobs, its memory checks, the engine probes after profiling, the ZeRO search
and ``ds_config.json``. The profiling rounds are the Megatron backend's (collectives, GEMMs, segments under each
partition and micro-batch, overheads) and share its ProfileDB, so a cluster profiled once serves both backends."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfp_megatron.backends.deepspeed.backend import DeepSpeedBackend
from cfp_megatron.backends.deepspeed.engine_probe import load_probes, probe_path, run_probes
from cfp_megatron.backends.deepspeed.zero_plan import ds_config, write_json_file
from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec, ParallelSpec, resolve_precision
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.files import CACHE_KEY, FileWriteError, write_atomic
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck
from cfp_megatron.planner.deepspeed_entry import check_checkpoint_dir, check_layout, manual_plan
from cfp_megatron.planner.deepspeed_memory import check_zero_plan_fits, check_zero_search_fits
from cfp_megatron.planner.job_checks import validate_rest
from cfp_megatron.profile.fingerprint import model_key

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes


def check_precision(precision: str, key: str) -> None:
    """A :class:`ConfigError` naming ``key`` when this machine's DeepSpeed accelerator cannot train in
    ``precision`` (fp16 on CPU: DeepSpeed's ``ValueError`` as the engine starts, after profiling)."""
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    supported = {"fp16": accelerator.is_fp16_supported, "bf16": accelerator.is_bf16_supported}.get(precision)
    if supported is not None and not supported():
        name = getattr(accelerator, "device_name", lambda: "this device")()
        raise ConfigError(ConfigIssue(key=key, value=precision, problem=f"is not supported by DeepSpeed's "
                                      f"accelerator here ({name}): its engine would refuse it as it starts.",
                                      fix="use train.precision=bf16 or fp32 here (auto: bf16 on GPUs, fp32 on CPU), "
                                          "or train fp16 with backend=megatron."))


class DeepSpeedLaunch:
    """The launch hooks of the DeepSpeed backend."""

    kind = BackendKind.deepspeed
    """The backend it launches."""
    keeps_group = True
    """DeepSpeed's communication layer keeps the group it first saw (during the probes): it must not be replaced."""

    def check_job(self, job: JobSpec, cfp: CfpSpec, world: int, *, planned: bool) -> None:
        """No model parallelism (:func:`~cfp_megatron.planner.deepspeed_entry.check_layout`), a precision this
        machine's DeepSpeed accelerator has (:func:`check_precision`), then the rest."""
        import torch

        check_layout(job, cfp)
        check_precision(resolve_precision(job.train.precision, torch.cuda.is_available()).value, "train.precision")
        validate_rest(job, world)

    def check_before_start(self, job: JobSpec, *, restarted: bool, writer: str | None,
                           note: Callable[[str], None], backend: BackendSpec | None = None,
                           world: int | None = None, planned: bool = False) -> int | None:
        """DeepSpeed's checkpoint folder (:func:`~cfp_megatron.planner.deepspeed_entry.check_checkpoint_dir`)."""
        import torch

        return check_checkpoint_dir(job, restarted=restarted, writer=writer, note=note, backend=backend,
                                    world=world, on_gpu=torch.cuda.is_available(), planned=planned)

    def resumed_backend(self, job: JobSpec, backend: BackendSpec, start_step: int | None, *, planned: bool,
                        note: Callable[[str], None]) -> BackendSpec:
        """A planned resume keeps the checkpoint's ZeRO stage where no stage is pinned (DeepSpeed loads a
        checkpoint's optimizer state only under a stage of its family: :func:`~cfp_megatron.backends.deepspeed
        .checkpoint.zero_differences`); a pinned or hand-set stage was checked before the start."""
        from cfp_megatron.backends.deepspeed import checkpoint as ds_checkpoint  # torch: a launch only

        root = job.train.checkpoint_dir
        if start_step is None or root is None or not planned or "zero_stage" in backend.pins():
            return backend
        saved = ds_checkpoint.saved_state(root, start_step).get(ds_checkpoint.STAGE)
        if not isinstance(saved, int):
            return backend
        note(f"cfp: {ds_checkpoint.tag(start_step)} was saved under ZeRO stage {saved}: the search keeps it "
             f"(backend.zero_stage={saved}), since DeepSpeed resumes its optimizer state under that stage's family "
             "only.")
        return dataclasses.replace(backend, zero_stage=saved)

    def resume_pin(self, job: JobSpec, cfp: CfpSpec, start_step: int | None, *, planned: bool) -> bool | None:
        """Nothing: DeepSpeed resumes under any ZeRO stage."""
        return None

    def hand_plan(self, job: JobSpec, backend: BackendSpec, world: int, *, on_gpu: bool) -> Plan:
        """The ``backend`` knobs as given (:func:`~cfp_megatron.planner.deepspeed_entry.manual_plan`)."""
        return manual_plan(job, backend, world, on_gpu=on_gpu)

    def check_plan_fits(self, job: JobSpec, plan: Plan, world: int) -> None:
        """The plan's precision here (:func:`check_precision`), and the DeepSpeed cost model's memory of its ZeRO
        stage (:func:`~cfp_megatron.planner.deepspeed_memory.check_zero_plan_fits`)."""
        check_precision(plan.precision, "the plan's precision (prec=)")
        check_zero_plan_fits(job, plan, world)

    def search_before_profiling(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
                                given: ClusterSpec, measurements: Measurements | None, on_gpu: bool,
                                inputs_fingerprint: str) -> PlannedSearch | None:
        """No ZeRO plan fits: refused (:func:`~cfp_megatron.planner.deepspeed_memory.check_zero_search_fits`). Not
        reusable: the search after profiling has the engine probes."""
        check_zero_search_fits(dataclasses.replace(job, cluster=given), world, cfp, backend, on_gpu=on_gpu,
                               figures=(job.cluster, measurements))
        return None

    def priority(self, early: PlannedSearch | None) -> Callable[[], tuple[str, ...]] | None:
        """None: profiling keeps its own order."""
        return None

    def after_profiling(self, job: JobSpec, env: LaunchEnv, outcome: Any, console: Any, *,
                        on_gpu: bool) -> DeepSpeedBackend:
        """The engine probes (stored, else measured now with every rank: :func:`_engine_probes`); the default
        process group stays up for training."""
        from cfp_megatron.engine.distributed import destroy_model_parallel_groups

        destroy_model_parallel_groups()  # the profiling rounds' last Megatron groups; training makes its own
        fingerprint = outcome.db.fingerprint.key if outcome.db is not None else None
        return DeepSpeedBackend(probes=_engine_probes(job, env, fingerprint, console, on_gpu=on_gpu))

    def show_search(self, found: PlannedSearch, console: Any) -> None:
        """The ZeRO ranking and what was left out."""
        found.report(console)
        console.print(f"cfp: searched {found.searched} DeepSpeed plans in {found.seconds * 1e3:.0f} ms", markup=False)

    def calibration(self, measurements: Measurements | None, plan: Plan) -> float:
        """1: the plan checks of Megatron plans calibrate Megatron plans only."""
        return 1.0

    def plan_check(self, job: JobSpec, plan: Plan, cfp: CfpSpec, *, calibration: float, on_gpu: bool,
                   picture: str | None) -> tuple[JobSpec, PlanCheck | None]:
        """The step time after ``cfp.check_after_steps``, kept apart from the Megatron backend's checks (its model
        key ends in ``+deepspeed``)."""
        if plan.predicted is None or cfp.check_after_steps == 0:
            return job, None
        return job, PlanCheck(plan=plan.canonical(), model_key=f"{model_key(job, on_gpu=on_gpu)}+deepspeed",
                              after_steps=min(cfp.check_after_steps, job.train.steps),  # a shorter run: its last
                              warmup_steps=cfp.check_warmup_steps,
                              predicted_step_s=plan.predicted.step_time_s, calibration=1.0,
                              predicted_peak_bytes=None)

    def trainer(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *, folder: Path,
                console: Any) -> tuple[JobSpec, DeepSpeedBackend]:
        """ds_config.json of the plan (``backend.config_file``'s other keys kept) and plan.json, written into the run
        directory by rank 0 (never over a different file); DeepSpeed's engine with that config."""
        config = ds_config(plan, job, base=backend.base_config())
        if env.rank == 0:
            written = write_json_file(config, folder / "ds_config.json")
            write_json_file(plan.to_json(), folder / "plan.json")
            if console is not None:
                console.print(f"cfp: DeepSpeed plan {plan.describe()} ({plan.canonical()}); config {written}",
                              markup=False)
        return job, DeepSpeedBackend(config=config)


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
