"""The Megatron-Core backend behind the planner's protocol (:class:`~cfp_megatron.backends.protocol.TrainingBackend`):
the layouts of :mod:`cfp_megatron.search` (TP, SP, PP, virtual PP, CP, EP, recompute, PrimePar, distributed
optimizer) on the simulator's costs, and Megatron's own training loop (:mod:`.trainer`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cfp_megatron.backends.megatron.report import print_result
from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.model.derive import partition_options
from cfp_megatron.plan.artifact import Plan, PlanPrediction
from cfp_megatron.plan.check import PlanCheck
from cfp_megatron.search.plan_options import option_label
from cfp_megatron.search.search import SearchResult, search
from cfp_megatron.sim.kernels import target_peak_tflops
from cfp_megatron.sim.options import options_here
from cfp_megatron.sim.uncertainty import error_band


class MegatronBackend:
    """Megatron-Core trains: DDP, its optimizer and pipeline schedules under the planned layout."""

    kind = BackendKind.megatron
    """The ``backend`` group's name of it."""

    def search(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
               measurements: Measurements | None, inputs_fingerprint: str, on_gpu: bool) -> PlannedSearch:
        """Branch and bound over the layouts (:func:`cfp_megatron.search.search.search`); each ranked layout as a
        Plan of the job's own cluster preset, its prediction's MFU against the cluster's peak."""
        # Planning on this machine (a profile was measured here) knows whether Transformer Engine is there; a
        # preflight plan for a GPU cluster assumes it, as NVIDIA's containers ship it.
        te = transformer_engine_available() if measurements is not None else True
        options = options_here(job.cluster) if measurements is not None else None
        # the planner's analysis stage: the model's partition options derived from its ParallelBlocks (cached)
        result = search(job, world, cfp, measurements=measurements, options=options, te_available=te,
                        partitions=partition_options(job))
        return self.planned(result, job, world, inputs_fingerprint=inputs_fingerprint)

    @staticmethod
    def planned(result: SearchResult, job: JobSpec, world: int, *, inputs_fingerprint: str) -> PlannedSearch:
        """A search's result (:func:`cfp_megatron.search.search.search` of ``job``) as the planner takes it: the
        chosen plan first, with why it was chosen (:mod:`cfp_megatron.search.choice`), then the others fastest
        first."""
        peak = target_peak_tflops(job)
        offered = result.preferred
        why = result.choice.reasons if result.choice is not None else ()
        why += (result.option_reason,) if result.option_reason is not None else ()  # the options chosen from a set
        plans = tuple(Plan.from_job(r.job, world_size=world, prediction=PlanPrediction.of(r.prediction, peak,
                                                                                      error_band(r.job),
                                                                                      r.unmeasured,
                                                                                      why if i == 0 else ()),
                                    inputs_fingerprint=inputs_fingerprint) for i, r in enumerate(offered))
        return PlannedSearch(plans=plans, labels=tuple(r.candidate.describe(world)
                                                       + option_label(r.job, result.option_choices) for r in offered),
                             searched=result.space_size, rejected=tuple((r.what, r.reason) for r in result.rejected),
                             seconds=result.seconds, report=lambda console: print_result(result, peak, console),
                             pinned=result.pinned)

    def train(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *,
              metrics_path: Path | None, check: PlanCheck | None, resume: Any) -> list[Any]:
        """Megatron's process groups for ``plan`` applied to the job, then its training loop from the checkpoint step
        ``resume`` (``None``: from the start)."""
        from cfp_megatron.backends.megatron.trainer import run_training
        from cfp_megatron.engine.distributed import destroy_distributed, init_distributed

        planned = plan.apply(job)
        dims = ParallelDims.build(planned, env.world_size)
        init_distributed(planned, dims, env)
        try:
            return run_training(planned, dims, env, start_step=resume, metrics_path=metrics_path, check=check)
        finally:
            destroy_distributed()


