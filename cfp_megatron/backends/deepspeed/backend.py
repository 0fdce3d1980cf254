"""The DeepSpeed backend behind the planner's protocol (:class:`~cfp_megatron.backends.protocol.TrainingBackend`):
ZeRO stage x micro-batch x activation checkpointing x offload (:mod:`.search`) on the simulator's costs
(:mod:`.costs`), and ``deepspeed.initialize`` around the Megatron-Core model (:mod:`.trainer`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cfp_megatron.backends.deepspeed.search import ranking_table, search_zero
from cfp_megatron.backends.deepspeed.zero_plan import ds_config
from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSpec, ParallelSpec
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck
from cfp_megatron.sim.uncertainty import mfu_check

if TYPE_CHECKING:
    from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes


@dataclasses.dataclass
class DeepSpeedBackend:
    """DeepSpeed trains: ZeRO data parallelism over every rank."""

    probes: EngineProbes | None = None
    """The engine's measured costs per ZeRO stage (:mod:`.engine_probe`), where a launch probed them."""
    config: dict[str, Any] | None = None
    """The DeepSpeed config to train with, where the launch built (and wrote) it already; else built from the plan."""
    kind = BackendKind.deepspeed
    """The ``backend`` group's name of it."""

    def search(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
               measurements: Measurements | None, inputs_fingerprint: str, on_gpu: bool) -> PlannedSearch:
        """Every ZeRO plan the pins leave, simulated (:func:`.search.search_zero`, exhaustive: a few hundred)."""
        started = time.perf_counter()
        result = search_zero(job, world, cfp, backend, measurements=measurements, probes=self.probes, on_gpu=on_gpu)
        plans = tuple(dataclasses.replace(r.plan, inputs_fingerprint=inputs_fingerprint) for r in result.ranked)

        def report(console: Any) -> None:
            console.print(ranking_table(result, job))
            predicted = result.ranked[0].plan.predicted if result.ranked else None
            check = mfu_check(job)
            said = check.note(predicted.mfu) if check and predicted else None  # against comparable published runs
            if said:
                console.print(f"cfp: {said}", markup=False)
            for what, why in result.rejected:
                console.print(f"cfp:   left out {what}: {why}", markup=False)

        return PlannedSearch(plans=plans, labels=tuple(p.describe() for p in plans), searched=result.evaluated,
                             rejected=result.rejected, seconds=time.perf_counter() - started, report=report)

    def train(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *,
              metrics_path: Path | None, check: PlanCheck | None, resume: Any) -> list[Any]:
        """Megatron's groups (all of size 1 but data parallelism, for the model and its RNG), then
        ``deepspeed.initialize`` with the plan's config (``backend.config_file``'s other keys kept) and its loop,
        resuming from ``train.checkpoint_dir`` at step ``resume`` (``None``: from the start)."""
        from cfp_megatron.backends.deepspeed.trainer import run_training
        from cfp_megatron.engine.distributed import destroy_distributed, init_distributed

        config = self.config if self.config is not None else ds_config(plan, job, base=backend.base_config())
        dims = ParallelDims.build(dataclasses.replace(job, parallel=ParallelSpec()), env.world_size)
        init_distributed(job, dims, env)
        try:
            return run_training(job, plan, config, dims, env, metrics_path=metrics_path, check=check,
                                resume=resume)
        finally:
            destroy_distributed()
