"""The cost-term interface: what one concern of the step (compute, a kind of communication, the pipeline, the
optimizer, ...) contributes to the simulated step, and the ordered registry of the terms the simulator, its
breakdown, its timeline, the plan check, the search report and the search's bound iterate over
(docs/simulator.md, "Cost terms")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cfp_megatron.base.enums import IdentityEnum
from cfp_megatron.sim.prediction import MemoryBreakdown

if TYPE_CHECKING:
    from cfp_megatron.base.config import JobSpec
    from cfp_megatron.cluster.costs import CollectiveCosts
    from cfp_megatron.cluster.measured import StepOverheads
    from cfp_megatron.sim.calibration import Efficiency
    from cfp_megatron.sim.kernels import KernelModel
    from cfp_megatron.sim.layer_cost import LayerCost, PassCost
    from cfp_megatron.sim.layout import Layout
    from cfp_megatron.sim.memory import Stage
    from cfp_megatron.sim.options import SimOptions
    from cfp_megatron.sim.pass_costs import PassCosts


class LaneKind(IdentityEnum):
    """What a lane's seconds are."""

    compute = "compute"
    """Kernels of the passes (and the optimizer step)."""
    comm = "comm"
    """Communication the step waits for (what the report's "exposed comm" column adds up)."""
    idle = "idle"
    """Time a rank waits inside the schedule (pipeline bubble)."""
    host = "host"
    """Host-side time the GPU work does not cover (launches, synchronisations)."""


class Placement(IdentityEnum):
    """Where a lane's time sits in the step."""

    in_pass = "in_pass"
    """Inside each forward or backward pass (a :class:`~cfp_megatron.sim.layer_cost.PassCost` field): the schedule
    arranges it."""
    schedule = "schedule"
    """Idle time inside the pipeline schedule."""
    after = "after"
    """After the rank's schedule, once per step (gradient sync, optimizer step, host work): the step ends with it."""


@dataclass(frozen=True, kw_only=True)
class Lane:
    """One line of the step-time breakdown, owned by exactly one term."""

    name: str
    """Its key in :class:`~cfp_megatron.sim.prediction.TimeBreakdown` (``tp_comm_s``)."""
    label: str
    """What a person reads (the search report's explanation)."""
    part: str
    """The coarser part the plan check's picture stacks it in (lanes with the same part are added)."""
    kind: LaneKind
    """What its seconds are."""
    placement: Placement
    """Where its time sits in the step."""
    overlaps: tuple[str, ...] = ()
    """What it may overlap with (names of other lanes, or of what hides it), in words; empty: nothing."""
    key: str = ""
    """Its name in the simulated schedule's events and the trace's slices (``tp``: the ``collectives`` of a comm
    event; ``dp_sync``: an after-schedule event); empty for the compute lanes the passes draw."""
    trace: str = ""
    """The timeline's lane (thread) it is drawn on (``TP comm``); empty: drawn with the passes."""
    style: tuple[str, str, str] | None = None
    """(legend label, PNG colour, chrome://tracing colour name) of its slices; ``None``: drawn with the passes."""
    pass_field: str = ""
    """For an ``in_pass`` lane of one kind of communication: the :class:`PassCost` field that holds it."""


@dataclass(frozen=True, kw_only=True)
class MemoryCategory:
    """One category of a rank's memory, owned by exactly one term."""

    name: str
    """Its key in :attr:`~cfp_megatron.sim.prediction.MemoryBreakdown.parts` (``cp_buffers``)."""
    label: str
    """What a person reads."""
    field: str = ""
    """The :class:`~cfp_megatron.sim.prediction.MemoryBreakdown` field its bytes add to (``comm_buffers``); empty:
    :attr:`~cfp_megatron.sim.prediction.MemoryBreakdown.other` (a term registered beyond the five fields)."""


@dataclass(frozen=True, kw_only=True)
class StepTimes:
    """What the simulator timed of one step on its slowest pipeline rank: what the terms read their lanes from."""

    microbatches: int
    """Micro-batches per step on the rank."""
    forward: PassCost
    """One micro-batch's forward over the rank's chunks."""
    backward: PassCost
    """One micro-batch's backward over the rank's chunks (without recomputation)."""
    recompute: PassCost
    """One micro-batch's recomputation over the rank's chunks."""
    schedule_s: float
    """When the rank's schedule ends, seconds."""
    busy_s: float
    """Seconds the rank spends in passes."""
    after_s: Mapping[str, float]
    """Seconds of each after-schedule lane on the rank."""

    def in_pass(self, field: str) -> float:
        """Seconds of the :class:`PassCost` field ``field`` over the step's passes (forward, backward and
        recomputation of every micro-batch)."""
        return self.microbatches * (getattr(self.forward, field) + getattr(self.backward, field)
                                    + getattr(self.recompute, field))


@dataclass(frozen=True, kw_only=True)
class StepInputs:
    """What an after-schedule term may read to cost its lanes on each pipeline rank."""

    job: JobSpec
    """The plan."""
    layout: Layout
    """Its layout."""
    kernels: KernelModel
    """The kernel model."""
    collectives: CollectiveCosts
    """The collective cost model."""
    options: SimOptions
    """The simulator's options."""
    efficiency: Efficiency
    """The fitted efficiencies."""
    overheads: StepOverheads | None
    """What the overheads probes timed of a step of the plan's partition (``None``: not profiled)."""
    params: tuple[float, ...]
    """Parameters per pipeline rank the gradient sync and the optimizer step count (its decoder layers' and
    vocabulary tables')."""
    expert_params: tuple[float, ...]
    """The routed experts' share of them per pipeline rank."""
    backward_s: tuple[float, ...]
    """Seconds of one micro-batch's backward passes (recomputation included) over each rank's chunks: the window
    an overlapped gradient sync hides in."""
    forward_s: tuple[float, ...] = ()
    """Seconds of one micro-batch's forward passes over each rank's chunks: the window activation offloading's
    copies to the host hide in."""
    layer_params: tuple[float, ...] = ()
    """The decoder layers' share of :attr:`params` per pipeline rank: the Transformer Engine layers whose weights a
    FP8/FP4 format quantises (empty: taken as :attr:`params`)."""


@dataclass(frozen=True, kw_only=True)
class Overlaps:
    """What the overlaps a group of candidates may turn on can hide (a bound's view)."""

    tp: int = 1
    """Tensor-parallel size."""
    tp_comm: bool = False
    """Whether TP communication may overlap with the GEMMs."""
    expert_a2a: bool = False
    """Whether the expert all-to-all may overlap (``moe_a2a_overlap``)."""


class CostTerm:
    """One concern of the step. Subclasses set :attr:`name` and :attr:`lanes` and override what they cost."""

    name: str = ""
    """The term's name."""
    lanes: tuple[Lane, ...] = ()
    """The breakdown lanes it owns."""
    stores: tuple[MemoryCategory, ...] = ()
    """The memory categories it owns."""

    def time(self, step: StepTimes) -> dict[str, float]:
        """Seconds of each of its lanes on the slowest rank (default: its ``in_pass`` lanes' :attr:`Lane.pass_field`,
        its after-schedule lanes as timed; a term with other lanes overrides it)."""
        out = {}
        for lane in self.lanes:
            if lane.placement is Placement.in_pass and lane.pass_field:
                out[lane.name] = step.in_pass(lane.pass_field)
            elif lane.placement is Placement.after:
                out[lane.name] = step.after_s.get(lane.name, 0.0)
        return out

    def after_s(self, inputs: StepInputs) -> dict[str, list[float]]:
        """Seconds per pipeline rank of its after-schedule lanes (default none)."""
        return {}

    def memory(self, stage: Stage) -> dict[str, float]:
        """Bytes of each of its memory categories (:attr:`stores`) on one rank of ``stage`` (default none)."""
        return {}

    def hideable(self, layer: LayerCost, overlaps: Overlaps) -> tuple[float, float]:
        """Seconds of its lanes in one layer's forward + backward and in its recomputation (one micro-batch) that the
        overlaps a candidate may turn on can hide, at most (default none)."""
        return 0.0, 0.0

    def chunk_floor(self, parts: PassCosts, moe: bool, overlaps: Overlaps) -> tuple[float, float]:
        """Seconds of its in-pass lanes the simulator adds to each layer of one kind beyond that layer's cost (lanes
        it sets per model chunk, which one layer's cost leaves at zero), in the layer's forward + backward and in its
        recomputation (one micro-batch), at least, whatever overlap a candidate with ``overlaps`` turns on:
        ``parts``, the plan's pass costs; ``moe``, the MoE kind (else the dense one) (default none)."""
        return 0.0, 0.0

    def lower_bound(self, layer: LayerCost, overlaps: Overlaps) -> float:
        """Seconds of its lanes one layer's cost holds per micro-batch at least, whatever overlap a candidate with
        these ``overlaps`` turns on: what the search prunes with (its in-pass lanes less :meth:`hideable`; what it
        sets per model chunk is :meth:`chunk_floor`'s)."""
        own = 0.0
        for lane in self.lanes:
            if lane.placement is Placement.in_pass and lane.pass_field:
                own += sum(getattr(p, lane.pass_field) for p in (layer.forward, layer.backward, layer.recompute))
        return own - sum(self.hideable(layer, overlaps))


class Registry:
    """The cost terms, in order: the order of the breakdown's lanes, the timeline's and the plan check's parts."""

    def __init__(self, terms: tuple[CostTerm, ...]) -> None:
        self._set(terms)

    def _set(self, terms: tuple[CostTerm, ...]) -> None:
        self._terms = terms
        self._lanes = tuple(lane for term in terms for lane in term.lanes)
        self._stores = tuple(store for term in terms for store in term.stores)
        # What memory() reads per stage, fixed by the terms: those that cost memory, each category's name and field.
        self._memory_terms = tuple(term for term in terms if type(term).memory is not CostTerm.memory)
        self._store_names = tuple(store.name for store in self._stores)
        self._store_fields = tuple(store.field or "other" for store in self._stores)
        self._hiding = tuple(term for term in terms if type(term).hideable is not CostTerm.hideable)
        self._floored = tuple(term for term in terms if type(term).chunk_floor is not CostTerm.chunk_floor)

    def __iter__(self) -> Iterator[CostTerm]:
        return iter(self._terms)

    def __len__(self) -> int:
        return len(self._terms)

    def lanes(self) -> tuple[Lane, ...]:
        """Every term's lanes, in order."""
        return self._lanes

    def lane(self, name: str) -> Lane | None:
        """The lane named ``name`` (a breakdown key, or an event key), or ``None``."""
        return next((lane for lane in self._lanes if name in (lane.name, lane.key)), None)

    def stores(self) -> tuple[MemoryCategory, ...]:
        """Every term's memory categories, in order."""
        return self._stores

    def memory(self, stage: Stage) -> MemoryBreakdown:
        """The memory of one rank of ``stage``: every term's categories, added into the breakdown's fields in the
        registry's order."""
        parts: dict[str, float] = {}
        for term in self._memory_terms:
            parts.update(term.memory(stage))
        return MemoryBreakdown.of_parts(parts, self._store_names, self._store_fields, stage=stage.rank)

    def hiding(self) -> tuple[CostTerm, ...]:
        """The terms an overlap may hide some of (those that give :meth:`CostTerm.hideable`), in order."""
        return self._hiding

    def floored(self) -> tuple[CostTerm, ...]:
        """The terms that add to a layer kind beyond its cost (those that give :meth:`CostTerm.chunk_floor`), in
        order."""
        return self._floored

    def time(self, step: StepTimes) -> dict[str, float]:
        """Seconds of every lane on the slowest rank, in order."""
        out: dict[str, float] = {}
        for term in self._terms:
            out.update(term.time(step))
        return out

    @contextlib.contextmanager
    def added(self, term: CostTerm) -> Iterator[CostTerm]:
        """``term`` registered (last) while the block runs: how a test, or an experiment, adds a term."""
        before = self._terms
        self._set((*before, term))
        try:
            yield term
        finally:
            self._set(before)
