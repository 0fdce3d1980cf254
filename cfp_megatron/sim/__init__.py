"""Step-time and memory simulator: :func:`simulate` a plan, export its schedule as a timeline."""

from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.prediction import Event, EventKind, MemoryBreakdown, Prediction, TimeBreakdown
from cfp_megatron.sim.simulate import simulate

__all__ = ["Event", "EventKind", "MemoryBreakdown", "Prediction", "SimOptions", "TimeBreakdown", "simulate"]
