"""What the simulator returns: step time and peak memory with breakdowns, and the simulated schedule."""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, fields

GIB = float(1 << 30)
"""Bytes in a GiB."""


class EventKind(enum.Enum):
    """Kinds of timed events in the simulated schedule."""

    forward = "forward"
    """A forward pass's compute."""
    backward = "backward"
    """A backward pass's compute (with its recomputation)."""
    comm = "comm"
    """Exposed collective communication (TP/SP, CP, EP, FSDP) inside a forward or backward pass, and the host's
    exposed launches and syncs (``host`` among its collectives)."""
    dp_sync = "dp_sync"
    """Data-parallel gradient reduction (and parameter all-gather) left exposed after the backward pass."""
    optimizer = "optimizer"
    """The optimizer step."""
    step = "step"
    """Another after-schedule lane of a cost term (:attr:`Event.lane` names it)."""


@dataclass(frozen=True, kw_only=True)
class Event:
    """One timed interval on one pipeline rank."""

    rank: int
    """Pipeline stage (rank in the pipeline group) the event runs on."""
    kind: EventKind
    """What runs."""
    start_s: float
    """Start, seconds from the beginning of the step."""
    end_s: float
    """End, seconds from the beginning of the step."""
    microbatch: int = -1
    """Micro-batch index (``-1`` for per-step events)."""
    chunk: int = 0
    """Model chunk (virtual pipeline stage) on this rank."""
    collectives: tuple[tuple[str, float], ...] = ()
    """For a ``comm`` event: its seconds per kind of collective (``tp``, ``cp``, ``ep``, ``fsdp``), in the order they
    are drawn, adding up to the event's length; empty where the split is not known."""
    lane: str = ""
    """For an after-schedule event: the breakdown lane it is (``dp_comm_s``, ``optimizer_s``, ``host_step_s``)."""


@dataclass(frozen=True, kw_only=True)
class TimeBreakdown:
    """Where the step time of the slowest pipeline rank goes, in seconds; the fields add up to the step time."""

    forward_compute_s: float
    """Forward GEMMs, attention and element-wise kernels of every micro-batch."""
    backward_compute_s: float
    """Backward kernels of every micro-batch."""
    recompute_s: float
    """Forward work repeated in the backward pass (selective or full recomputation)."""
    overhead_s: float
    """Fixed per-layer costs (launches, small kernels)."""
    tp_comm_s: float
    """Tensor/sequence-parallel collectives (not overlapped)."""
    cp_comm_s: float
    """Context-parallel ring exchange left exposed after overlapping with attention."""
    ep_comm_s: float
    """Expert-parallel all-to-all (dispatch and combine)."""
    fsdp_comm_s: float
    """FSDP/ZeRO-3 parameter all-gather and gradient reduce-scatter left exposed."""
    pp_bubble_s: float
    """Pipeline bubble and pipeline send/receive waits: idle time of this rank inside the schedule."""
    dp_comm_s: float
    """Data-parallel gradient sync (and distributed-optimizer parameter all-gather) left exposed."""
    optimizer_s: float
    """Optimizer step."""
    host_s: float = 0.0
    """Host work inside the passes the GPU work does not cover (kernel launches beyond a pass's GPU time, the
    dropless MoE dispatcher's synchronisations)."""
    host_step_s: float = 0.0
    """Host work once per step outside the passes (its synchronisations)."""
    offload_s: float = 0.0
    """Activation offloading's copies over the host link that the layers' computation does not hide."""
    embedding_sync_s: float = 0.0
    """The tied word embedding's gradient all-reduce between the first and the last pipeline stage."""
    token_sync_s: float = 0.0
    """The per-token loss's token count: broadcast over the pipeline group, all-reduced over DP x CP."""
    weight_cast_s: float = 0.0
    """The linear layers' weights quantised once per step under FP8/FP4 (beyond what the fitted FP8 share holds)."""
    grad_accum_s: float = 0.0
    """DeepSpeed's ``BF16_Optimizer`` adding every micro-batch's gradients into its fp32 buffer."""
    extra: tuple[tuple[str, float], ...] = ()
    """Lanes of cost terms registered beyond these fields (name, seconds)."""

    @classmethod
    def of(cls, lanes: Mapping[str, float]) -> TimeBreakdown:
        """The breakdown of the cost terms' ``lanes`` (name: seconds; the names that are not fields go to
        :attr:`extra`)."""
        names = {field.name for field in fields(cls)} - {"extra"}
        return cls(**{name: seconds for name, seconds in lanes.items() if name in names},
                   extra=tuple((name, seconds) for name, seconds in lanes.items() if name not in names))

    def seconds(self, lane: str) -> float:
        """Seconds of the lane named ``lane`` (zero for a lane it does not have)."""
        if lane != "extra" and lane in self.__dataclass_fields__:
            return getattr(self, lane)
        return dict(self.extra).get(lane, 0.0)

    @property
    def total_s(self) -> float:
        """Sum of the components (equals the step time)."""
        return (sum(getattr(self, field.name) for field in fields(self) if field.name != "extra")
                + sum(seconds for _, seconds in self.extra))


_MEMORY_FIELDS = ("parameters", "gradients", "optimizer_states", "activations", "comm_buffers", "other")
"""The fields of :class:`MemoryBreakdown` that memory categories add to."""


@dataclass(frozen=True, kw_only=True, slots=True)  # slots: built per rank of every plan searched
class MemoryBreakdown:
    """Peak memory of one rank of the most loaded pipeline stage, in bytes."""

    parameters: float
    """Model weights held by the rank (compute precision), plus gathered FSDP layers."""
    gradients: float
    """Gradient buffers (fp32 main gradients under mixed precision)."""
    optimizer_states: float
    """fp32 master weights and Adam moments (sharded over DP with the distributed optimizer or FSDP)."""
    activations: float
    """Activations kept for backward by all in-flight micro-batches, plus the working set of the layer in flight."""
    comm_buffers: float
    """Communication buffers (DDP buckets, TP/SP gather buffers, logits)."""
    stage: int
    """The pipeline stage this breakdown is for."""
    other: float = 0.0
    """Categories of cost terms registered beyond these fields."""
    parts: tuple[tuple[str, float], ...] = ()
    """Bytes of each cost term's memory category (name, bytes), in the registry's order; empty where the breakdown
    was not built from the terms."""

    @classmethod
    def of(cls, parts: Mapping[str, float], fields_of: Mapping[str, str], *, stage: int) -> MemoryBreakdown:
        """The breakdown of the cost terms' memory ``parts`` (category: bytes), each added, in order, to the field
        ``fields_of`` names for it (to :attr:`other` where it names none)."""
        names = tuple(parts)
        return cls.of_parts(parts, names, tuple(fields_of[name] for name in names), stage=stage)

    @classmethod
    def of_parts(cls, parts: Mapping[str, float], names: tuple[str, ...], fields: tuple[str, ...], *,
                 stage: int) -> MemoryBreakdown:
        """:meth:`of` over the categories ``names``, in order, each added to its field in ``fields`` (empty:
        :attr:`other`); a category ``parts`` lacks counts zero bytes."""
        sizes = tuple(map(parts.get, names, itertools.repeat(0.0)))
        sums = dict.fromkeys(_MEMORY_FIELDS, 0.0)
        for field, size in zip(fields, sizes, strict=True):
            sums[field or "other"] += size
        return cls(**sums, stage=stage, parts=tuple(zip(names, sizes, strict=True)))

    @property
    def total(self) -> float:
        """Peak bytes."""
        return (self.parameters + self.gradients + self.optimizer_states + self.activations + self.comm_buffers
                + self.other)

    @property
    def total_gib(self) -> float:
        """Peak GiB."""
        return self.total / GIB


@dataclass(frozen=True, kw_only=True)
class Prediction:
    """Predicted step time and memory of one plan."""

    step_time_s: float
    """Seconds per optimizer step."""
    time: TimeBreakdown
    """Step time by component, on the slowest pipeline rank."""
    memory: MemoryBreakdown
    """Peak memory by component, on the most loaded stage."""
    bubble_fraction: float
    """Idle share of the pipeline schedule (bubble / schedule length) on the slowest rank."""
    tokens_per_s_per_gpu: float
    """Trained tokens per second per GPU."""
    model_tflops_per_gpu: float
    """Model FLOPs (6N + attention, no recompute) per second per GPU, in TFLOP/s."""
    num_microbatches: int
    """Micro-batches per step on each data-parallel rank."""
    fits: bool
    """Whether the peak memory fits in the device memory (always true when the capacity is unknown)."""
    events: tuple[Event, ...] = ()
    """The simulated schedule (one list of timed events per pipeline rank, flattened), when it was built."""


def mfu(prediction: Prediction, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (share of the dense peak ``peak_tflops``, in TFLOP/s) of a prediction; ``None``
    without a peak."""
    if not peak_tflops:
        return None
    return prediction.model_tflops_per_gpu / peak_tflops

