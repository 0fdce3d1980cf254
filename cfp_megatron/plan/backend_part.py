"""The part of a :class:`~cfp_megatron.plan.artifact.Plan` only one backend has: :class:`MegatronPart` (nothing
beyond the layout, whose options are ``ParallelSpec``'s) or :class:`DeepSpeedPart` (the ZeRO options). plan.json
keeps writing them as its ``backend`` and ``zero`` keys (schema version 2, unchanged)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from cfp_megatron.base.backend_spec import BackendKind, ZeroSpec
from cfp_megatron.plan.errors import PlanError


@dataclass(frozen=True, kw_only=True)
class MegatronPart:
    """What a Megatron-Core plan adds to the layout: nothing (its options are the ``parallel`` fields)."""

    kind: ClassVar[BackendKind] = BackendKind.megatron
    """The backend that trains the plan."""

    @property
    def zero(self) -> None:
        """A Megatron plan has no ZeRO options."""
        return None


@dataclass(frozen=True, kw_only=True)
class DeepSpeedPart:
    """What a DeepSpeed plan adds to the layout (data parallel over every rank)."""

    kind: ClassVar[BackendKind] = BackendKind.deepspeed
    """The backend that trains the plan."""
    zero: ZeroSpec
    """The ZeRO stage, offloads and bucket size."""


BackendPart = MegatronPart | DeepSpeedPart
"""The per-backend part of a plan."""


def backend_part(kind: BackendKind, zero: ZeroSpec | None) -> BackendPart:
    """The part of ``kind`` with ``zero`` (plan.json's ``backend`` and ``zero``); a :class:`PlanError` for a Megatron
    plan with ZeRO options or a DeepSpeed plan without them."""
    if kind is BackendKind.deepspeed:
        if not isinstance(zero, ZeroSpec):
            raise PlanError("invalid plan: a DeepSpeed plan needs its ZeRO options (zero).",
                            fix="build plans with Plan.from_job, Plan.parse or load_plan from a valid job.")
        return DeepSpeedPart(zero=zero)
    if not isinstance(kind, BackendKind):
        raise PlanError(f"invalid plan: backend={kind!r} must be one of {[b.value for b in BackendKind]}.")
    if zero is not None:
        raise PlanError("invalid plan: a Megatron plan has no ZeRO options (zero must be None).",
                        fix="build plans with Plan.from_job, Plan.parse or load_plan from a valid job.")
    return MegatronPart()
