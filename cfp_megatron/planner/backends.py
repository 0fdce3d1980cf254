"""The training backend of a job: the implementation of :class:`~cfp_megatron.backends.protocol.TrainingBackend`
the ``backend`` group names."""

from __future__ import annotations

from cfp_megatron.backends.deepspeed.backend import DeepSpeedBackend
from cfp_megatron.backends.megatron.backend import MegatronBackend
from cfp_megatron.backends.protocol import TrainingBackend
from cfp_megatron.base.backend_spec import BackendKind


def backend_for(kind: BackendKind) -> TrainingBackend:
    """The implementation of ``kind``."""
    return {BackendKind.megatron: MegatronBackend(), BackendKind.deepspeed: DeepSpeedBackend()}[kind]
