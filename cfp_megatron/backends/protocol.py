"""The one protocol every training backend implements for the planner: its search space searched on the simulator's
costs into ranked :class:`~cfp_megatron.plan.artifact.Plan` objects (the one plan artifact), and its trainer.

The planner picks the implementation by the ``backend`` group
(:func:`cfp_megatron.planner.backends.backend_for`)
and drives both the same way: search on rank 0 (or offline, ``python -m cfp_megatron.plan``), broadcast the plan,
train it. :class:`LaunchHooks` is what a backend adds to the one launch pipeline (docs/architecture.md, "The launch
pipeline").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import ClusterSpec, JobSpec
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck
from cfp_megatron.search.search import no_plan_fix, nothing_left


@dataclass(frozen=True, kw_only=True)
class PlannedSearch:
    """What a backend's search hands the planner."""

    plans: tuple[Plan, ...]
    """The best plans that fit, each with its prediction (at most ``cfp.top_k``): the chosen one first (the fastest,
    unless a plan inside its error band rests on more evidence: :mod:`cfp_megatron.search.choice`), then the others
    fastest first."""
    labels: tuple[str, ...]
    """A short label of each plan (its layout in the backend's terms)."""
    searched: int
    """Candidates in the space."""
    rejected: tuple[tuple[str, str], ...]
    """What was ruled out, with why: ``(value or family, reason)``."""
    seconds: float
    """Wall time of the search."""
    report: Callable[[Any], None]
    """Prints the backend's own tables (ranking, what was ruled out, why the best wins) to a rich console."""
    pinned: tuple[str, ...] = ()
    """The keys of the pins and sets the search kept to (``cfp.tp``, ``backend.zero_stage``)."""

    @property
    def best(self) -> Plan:
        """The chosen plan (the first); a :class:`ConfigError` when none fits."""
        if not self.plans:
            raise nothing_left(list(self.rejected[:8]), no_plan_fix(self.pinned))
        return self.plans[0]


class TrainingBackend(Protocol):
    """A training backend as the planner drives it."""

    kind: BackendKind
    """Which backend it is (the ``backend`` group's ``name``)."""

    def search(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
               measurements: Measurements | None, inputs_fingerprint: str, on_gpu: bool) -> PlannedSearch:
        """The ``cfp.top_k`` fastest plans of ``job`` on ``world`` ranks that fit, by the simulator's costs (with
        ``measurements`` where profiling made them), each plan carrying ``inputs_fingerprint``."""
        ...

    def train(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *,
              metrics_path: Path | None, check: PlanCheck | None, resume: Any) -> list[Any]:
        """Set up the process groups for ``plan`` (a layout given by hand is a plan too), train ``job`` under it (from
        ``resume``: the backend's resume point), tear the groups down; rank 0's step metrics."""
        ...


class LaunchHooks(Protocol):
    """What one backend adds to the one launch pipeline (:func:`cfp_megatron.planner.entry.train_from_config`, which
    reads the config, checks the job, resolves the plan, checks that it fits, broadcasts, configures, trains and
    reports for every backend). The planner implements one per backend (:mod:`cfp_megatron.planner.backends`)."""

    kind: BackendKind
    """The backend it launches."""
    keeps_group: bool
    """Whether training keeps the default process group that profiling made (DeepSpeed's communication layer keeps
    the first group it saw) rather than making its own."""

    def check_job(self, job: JobSpec, cfp: CfpSpec, world: int, *, planned: bool) -> None:
        """Its checks of ``job`` before any process group (``planned``: the layout comes from a plan)."""
        ...

    def check_before_start(self, job: JobSpec, *, restarted: bool, writer: str | None,
                           note: Callable[[str], None], backend: BackendSpec | None = None,
                           world: int | None = None, planned: bool = False) -> int | None:
        """The checkpoint step to resume from by its folder's rules (``None``: a fresh start), its saved training
        state compared with what ``backend`` on ``world`` ranks would train with, where known before the plan
        (``planned``: the plan comes from ``cfp``, so what it leaves open is compared when it loads)."""
        ...

    def resumed_backend(self, job: JobSpec, backend: BackendSpec, start_step: int | None, *, planned: bool,
                        note: Callable[[str], None]) -> BackendSpec:
        """``backend`` with what a resumed checkpoint fixes and a search would otherwise choose (DeepSpeed: its
        ZeRO stage), said in ``note``; ``backend`` itself where nothing is fixed."""
        ...

    def resume_pin(self, job: JobSpec, cfp: CfpSpec, start_step: int | None, *, planned: bool) -> bool | None:
        """What a resumed checkpoint pins (whether it holds the distributed optimizer), checked against the job's
        settings; ``None`` where nothing is pinned."""
        ...

    def hand_plan(self, job: JobSpec, backend: BackendSpec, world: int, *, on_gpu: bool) -> Plan:
        """The plan of the layout given by hand (no plan from ``cfp``)."""
        ...

    def check_plan_fits(self, job: JobSpec, plan: Plan, world: int) -> None:
        """A plan this machine's search did not choose (by hand, a file, a string) against each rank's memory;
        ``job`` is under the plan."""
        ...

    def search_before_profiling(self, job: JobSpec, world: int, cfp: CfpSpec, backend: BackendSpec, *,
                                given: ClusterSpec, measurements: Measurements | None, on_gpu: bool,
                                inputs_fingerprint: str) -> PlannedSearch | None:
        """``+cfp=auto`` on every rank before profiling (``job``'s cluster filled with this machine's figures,
        ``given`` as configured): a :class:`ConfigError` when its pins or the memory leave no plan; else its search,
        for profiling's priorities and for rank 0 to reuse where profiling measures nothing (``None``: not
        reusable)."""
        ...

    def priority(self, early: PlannedSearch | None) -> Callable[[], tuple[str, ...]] | None:
        """What profiling measures first (:func:`cfp_megatron.profile.runner.profile_job`'s ``priority``)."""
        ...

    def after_profiling(self, job: JobSpec, env: LaunchEnv, outcome: Any, console: Any, *,
                        on_gpu: bool) -> TrainingBackend:
        """Every rank, after profiling: its own measurements; the backend that searches on rank 0."""
        ...

    def show_search(self, found: PlannedSearch, console: Any) -> None:
        """Rank 0: what it says of the search after profiling."""
        ...

    def calibration(self, measurements: Measurements | None, plan: Plan) -> float:
        """The factor the step time of ``plan`` is shown and checked with (earlier runs' measured over predicted)."""
        ...

    def plan_check(self, job: JobSpec, plan: Plan, cfp: CfpSpec, *, calibration: float, on_gpu: bool,
                   picture: str | None) -> tuple[JobSpec, PlanCheck | None]:
        """The check of the first steps against ``plan``'s prediction (drawn to ``picture`` where given), and the
        job it needs (the memory measured on the checked step)."""
        ...

    def trainer(self, job: JobSpec, plan: Plan, env: LaunchEnv, backend: BackendSpec, *, folder: Path,
                console: Any) -> tuple[JobSpec, TrainingBackend]:
        """The job as it trains and its trainer, configured (its files written under ``folder`` on rank 0)."""
        ...
