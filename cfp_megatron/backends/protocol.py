"""The one protocol every training backend implements for the planner: its search space searched on the simulator's
costs into ranked :class:`~cfp_megatron.plan.artifact.Plan` objects (the one plan artifact), and its trainer.

The planner picks the implementation by the ``backend`` group
(:func:`cfp_megatron.planner.backends.backend_for`)
and drives both the same way: search on rank 0 (or offline, ``python -m cfp_megatron.plan``), broadcast the plan,
train it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.config import JobSpec
from cfp_megatron.base.errors import ConfigError, ConfigIssue
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.cluster.measured import Measurements
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.check import PlanCheck


@dataclass(frozen=True, kw_only=True)
class PlannedSearch:
    """What a backend's search hands the planner."""

    plans: tuple[Plan, ...]
    """The best plans that fit, fastest first, each with its prediction (at most ``cfp.top_k``)."""
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

    @property
    def best(self) -> Plan:
        """The fastest plan that fits; a :class:`ConfigError` when none does."""
        if not self.plans:
            raise ConfigError([ConfigIssue(key="cfp", value=what, problem=why, fix="relax the pins and constraints.")
                               for what, why in self.rejected[:8]] or
                              [ConfigIssue(key="cfp", value="", problem="no plan is left.", fix="add GPUs.")])
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

    def train(self, job: JobSpec, plan: Plan | None, env: LaunchEnv, backend: BackendSpec, *,
              metrics_path: Path | None, check: PlanCheck | None, resume: Any) -> list[Any]:
        """Set up the process groups for ``plan`` (``None``: ``job`` as it is, where a backend allows it), train
        ``job`` with it (from ``resume``: the backend's resume point), tear the groups down; rank 0's step metrics."""
        ...
