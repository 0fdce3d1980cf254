"""The simulator's cost terms, one module per concern, and their ordered registry :data:`TERMS`
(docs/simulator.md, "Cost terms")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from cfp_megatron.sim.terms.base import (
    CostTerm,
    Lane,
    LaneKind,
    MemoryCategory,
    Overlaps,
    Placement,
    Registry,
    StepInputs,
    StepTimes,
)
from cfp_megatron.sim.terms.compute import Compute
from cfp_megatron.sim.terms.context_parallel import ContextParallel
from cfp_megatron.sim.terms.cuda_graphs import CudaGraphs
from cfp_megatron.sim.terms.data_parallel import DataParallel
from cfp_megatron.sim.terms.expert_dispatch import ExpertDispatch
from cfp_megatron.sim.terms.host import HostWork
from cfp_megatron.sim.terms.offload import ActivationOffload
from cfp_megatron.sim.terms.optimizer import OptimizerStep
from cfp_megatron.sim.terms.pipeline import Pipeline
from cfp_megatron.sim.terms.recompute import Recomputation
from cfp_megatron.sim.terms.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from cfp_megatron.sim.prediction import Prediction

TERMS = Registry((Compute(), Recomputation(), TensorParallel(), ContextParallel(), ExpertDispatch(), Pipeline(),
                  DataParallel(), OptimizerStep(), HostWork(), ActivationOffload(), CudaGraphs()))
"""Every cost term, in the order of the breakdown's lanes (and of the plan check's parts) and of the memory
categories."""


def exposed_comm_s(prediction: Prediction) -> float:
    """Seconds of communication the step waits for: every communication lane of the prediction's breakdown."""
    time = prediction.time
    return sum(time.seconds(lane.name) for lane in TERMS.lanes() if lane.kind is LaneKind.comm)


__all__ = ["TERMS", "CostTerm", "Lane", "LaneKind", "MemoryCategory", "Overlaps", "Placement", "Registry",
           "StepInputs", "StepTimes", "exposed_comm_s"]
