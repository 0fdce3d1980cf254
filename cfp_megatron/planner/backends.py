"""The training backend of a job: the implementation of :class:`~cfp_megatron.backends.protocol.TrainingBackend`
the ``backend`` group names, and its hooks in the one launch pipeline
(:class:`~cfp_megatron.backends.protocol.LaunchHooks`)."""

from __future__ import annotations

from cfp_megatron.backends.deepspeed.backend import DeepSpeedBackend
from cfp_megatron.backends.megatron.backend import MegatronBackend
from cfp_megatron.backends.protocol import LaunchHooks, TrainingBackend
from cfp_megatron.base.backend_spec import BackendKind
from cfp_megatron.planner.deepspeed_launch import DeepSpeedLaunch
from cfp_megatron.planner.megatron_launch import MegatronLaunch

LAUNCH_HOOKS: dict[BackendKind, type[LaunchHooks]] = {BackendKind.megatron: MegatronLaunch,
                                                      BackendKind.deepspeed: DeepSpeedLaunch}
"""The launch hooks of each backend (a test registers its own here)."""


def backend_for(kind: BackendKind) -> TrainingBackend:
    """The implementation of ``kind``."""
    return {BackendKind.megatron: MegatronBackend(), BackendKind.deepspeed: DeepSpeedBackend()}[kind]


def launch_hooks(kind: BackendKind) -> LaunchHooks:
    """What ``kind`` adds to the one launch pipeline."""
    return LAUNCH_HOOKS[kind]()
