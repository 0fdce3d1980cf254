"""What the simulator may read from measurements: the contract between profiling (``cfp_megatron.profile``) and the
simulator (``cfp_megatron.sim``).

Profiling rounds fill a ProfileDB; the simulator only sees it through :class:`Measurements`, so it runs the same on a
preset (nothing measured: every method answers ``None`` and the ``ClusterSpec`` figures stand in) and on a profiled
cluster. Everything here is plain data: no ``torch.distributed``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from cfp_megatron.base.config import MlpPartition, Recompute, RecomputeModule
from cfp_megatron.base.enums import IdentityEnum


class Collective(IdentityEnum):
    """Collectives the search can produce."""

    all_reduce = "all_reduce"
    all_gather = "all_gather"
    reduce_scatter = "reduce_scatter"
    all_to_all = "all_to_all"
    send_recv = "send_recv"


class Span(IdentityEnum):
    """Where a group's ranks sit."""

    intra_node = "intra_node"
    """All ranks of the group on one node (NVLink/NVSwitch; shared memory or loopback on CPU)."""
    inter_node = "inter_node"
    """The group crosses nodes (InfiniBand/RoCE)."""


RECOMPUTE_SUFFIXES = {Recompute.selective: "-selective", Recompute.full: "-full"}
"""Ending of the partition names of decoder layers profiled under selective or full recomputation."""


def partition_name(tp: int, *, sp: bool = False, mlp: MlpPartition = MlpPartition.megatron,
                   recompute: Recompute = Recompute.none, recompute_modules: str | None = None) -> str:
    """Canonical string of the tensor-parallel layout over ``tp`` ranks, the key profiling stores segments under:
    ``tp1``, ``tp2``, ...; with sequence parallelism (activations outside the TP regions split along the sequence,
    meaningful only with ``tp > 1``) ``tp2-sp``; with PrimePar's MLP (``parallel.mlp=primepar``) ``tp4-primepar``
    (only the decoder layers differ: the embedding and the head run Megatron's layout); a decoder layer under
    selective recomputation (Megatron checkpoints its core attention, which changes what the layer keeps for its
    backward pass) ``tp1-selective``, ``tp2-sp-selective``; a decoder layer checkpointed whole, as full
    recomputation runs it (its forward without autograd, then again with it in the backward pass) ``tp1-full``.
    Full recomputation's memory is read from the plain partition (:func:`cfp_megatron.sim.memory.recomputed_units`),
    only its time from ``-full``. Selective recomputation of other submodules than the core attention
    (``parallel.recompute_modules``) names them: ``tp1-layernorm+mlp-selective``, a partition profiling does not
    measure (the simulator prices it analytically and says so)."""
    name = f"tp{int(tp)}" + ("-sp" if sp and tp > 1 else "")
    name += "-primepar" if mlp is MlpPartition.primepar and tp > 1 else ""
    if recompute is Recompute.selective and recompute_modules not in (None, RecomputeModule.core_attn.value):
        name += f"-{recompute_modules}"
    return name + RECOMPUTE_SUFFIXES.get(recompute, "")


def unmeasured_partitions(measurements: Measurements | None, *, tp: int, sp: bool, mlp: MlpPartition,
                          recompute: Recompute, layer_kinds: tuple[str, ...],
                          recompute_modules: str | None = None) -> tuple[str, ...]:
    """What a layout under ``tp`` / ``sp`` / ``mlp`` / ``recompute`` reads from the profile that ``measurements``
    lack, as ``<kind> <partition>`` (``dense tp2-sp``): the embedding and head under the plain partition, each decoder
    kind of ``layer_kinds`` (``dense``, ``moe``) under the layer partition and, with recomputation, under the
    recomputed one. The simulator prices these by the analytical model. Empty without measurements (a preflight
    prices everything that way)."""
    if measurements is None or isinstance(measurements, NothingMeasured):
        return ()
    plain = partition_name(tp, sp=sp)
    layer = partition_name(tp, sp=sp, mlp=mlp)
    wanted = [("embedding", plain), *((k, layer) for k in layer_kinds), ("head", plain)]
    if recompute is not Recompute.none:
        wanted += [(k, partition_name(tp, sp=sp, mlp=mlp, recompute=recompute, recompute_modules=recompute_modules))
                   for k in layer_kinds]
    return tuple(f"{kind} {part}" for kind, part in wanted if not measurements.segment_micro_batches(kind, part))


def partition_recompute(name: str) -> Recompute:
    """The recomputation a partition name (:func:`partition_name`) was profiled under."""
    return next((r for r, suffix in RECOMPUTE_SUFFIXES.items() if name.endswith(suffix)), Recompute.none)


def ring_factor(op: Collective, group_size: int) -> float:
    """Bytes each rank moves per byte of message with the ring algorithm (NCCL's "bus bandwidth" factor).

    The message is what one rank passes in: the input of all-reduce and reduce-scatter, the output of all-gather, the
    total a rank sends in all-to-all, the tensor of a send/recv. all-reduce ``2(g-1)/g``, all-gather and
    reduce-scatter ``(g-1)/g``, all-to-all ``(g-1)/g``, send/recv 1.
    """
    g = max(int(group_size), 1)
    if op is Collective.send_recv:
        return 1.0
    if g == 1:
        return 0.0
    share = (g - 1) / g
    return 2 * share if op is Collective.all_reduce else share


@dataclass(frozen=True, kw_only=True)
class CollectiveFit:
    """``seconds(bytes) = latency_s + bytes / bandwidth_bytes_per_s`` for one collective on one group pattern."""

    op: Collective
    """The collective."""
    group_size: int
    """Ranks in the group."""
    span: Span
    """Inside one node or across nodes."""
    latency_s: float
    """Fitted fixed cost in seconds (intercept)."""
    bandwidth_bytes_per_s: float
    """Fitted message bytes per second (slope⁻¹), message as :func:`ring_factor` defines it."""
    points: int = 0
    """Timed message sizes the fit used."""
    max_rel_error: float = 0.0
    """Largest relative error of the fit over those points."""

    def seconds(self, message_bytes: float) -> float:
        """Predicted time for one call with a message of ``message_bytes``."""
        if message_bytes <= 0 or (self.group_size <= 1 and self.op is not Collective.send_recv):
            return 0.0
        return self.latency_s + message_bytes / self.bandwidth_bytes_per_s

    @property
    def bus_bandwidth_bytes_per_s(self) -> float:
        """Bandwidth per link the fit implies (message bandwidth x :func:`ring_factor`), comparable across sizes."""
        return self.bandwidth_bytes_per_s * ring_factor(self.op, self.group_size)


@dataclass(frozen=True, kw_only=True)
class StepOverheads:
    """A training step as the runtime runs it, beyond the isolated segment times, under one partition at one
    micro-batch size: measured on probe models trained with the runtime's own step
    (:mod:`cfp_megatron.profile.overheads`)."""

    partition: str
    """Canonical partition string (``tp<N>``, ``tp<N>-sp``) the probes ran under."""
    micro_batch: int
    """Sequences per micro-batch."""
    layer_s: float
    """Forward plus backward seconds of one decoder layer per micro-batch inside the real schedule (the probes'
    difference in one layer): with Megatron DDP's gradient hooks and the TP collectives as they run in training."""
    per_microbatch_s: float
    """Seconds per micro-batch beyond the layers, the embedding and the head: the forward-step function, the loss
    function, the schedule's bookkeeping (one stage doing every part); never below zero. The simulator charges it to
    the pipeline stages that hold the embedding or the head."""
    ends_s: float = 0.0
    """Seconds per micro-batch by which the embedding and the head together run faster inside the schedule than
    the segments round timed them alone (zero or below; never more than their isolated time): where the probes'
    schedule beyond their layers falls short of the isolated embedding and head, the difference is theirs, not a
    negative cost of every stage's passes."""
    step_base_s: float
    """Seconds per step outside the schedule that do not grow with the parameters: the grad-norm all-reduce over the
    probe's model-parallel group (``tp`` ranks), the loss all-reduce over the world, zeroing, the LR schedule."""
    step_per_param_s: float
    """Seconds per step outside the schedule per parameter on the rank (optimizer update, grad copy and norm)."""
    finalize_share: float = 1.0
    """The gradient finalisation as the probes timed it inside their training steps, every rank busy, over what the
    collective fits give for the same messages: how much more the step's collectives cost than the collectives round
    timed alone (1 in profiles from before it was recorded)."""


@dataclass(frozen=True, kw_only=True)
class PipelineProbe:
    """A probe model trained with the runtime's own step over a pipeline (:mod:`cfp_megatron.profile.overheads`):
    what Megatron's pipelined schedule cost, point-to-point exchanges included, against which the simulator prices
    a plan's exchanges (:func:`cfp_megatron.sim.simulate.simulate`)."""

    tp: int
    """Tensor-parallel size (the rest of the world data-parallel)."""
    sp: bool
    """Whether sequence parallelism was on."""
    pp: int
    """Pipeline stages."""
    layers: int
    """Decoder layers of the probe model, split evenly over the stages."""
    micro_batch: int
    """Sequences per micro-batch."""
    microbatches: int
    """Micro-batches per timed step."""
    schedule_s: float
    """Seconds of the schedule (``forward_backward_func`` without the gradient finalisation), slowest rank, median
    over the repeats."""
    rest_s: float
    """Seconds of the step outside the schedule and the gradient finalisation (optimizer step, zeroing, the loss
    all-reduce), slowest rank, median over the repeats."""
    finalize_s: float | None
    """Seconds of the gradient finalisation inside the step, as the slowest rank paid it (``None`` where not
    timed)."""
    single_schedule_s: float | None = None
    """Seconds of the schedule in a step of one micro-batch, slowest rank, median (``None`` where not timed)."""


@dataclass(frozen=True, kw_only=True)
class SegmentMemory:
    """Tensor memory of one segment class's forward and backward pass for one micro-batch, counted as PyTorch's
    ``MemTracker`` counts a training step's memory (measured by the profiling segments round)."""

    activation_bytes: float
    """Bytes one forward pass leaves alive for its backward (saved tensors, masks, its output), per micro-batch."""
    transient_bytes: float
    """How far the live bytes rise above that during the forward or the backward pass (transients, the input
    gradient)."""
    workspace_bytes: float = 0.0
    """Persistent buffers the segment's first pass allocates and every later pass reuses (Megatron's global memory
    buffer for the unfused attention scores), counted once per rank."""


def interpolate_rows(points: list[tuple[float, tuple[float, ...]]], x: float, *,
                     proportional: bool = True) -> tuple[float, ...]:
    """Values at ``x`` from measured rows ``(x_i, values_i)`` (sorted by ``x_i``), each value linear in ``x``:
    between the two nearest measured ``x_i``, extrapolated from the two smallest or largest, never below zero.
    A single row scales its values with ``x`` (``proportional``: a pass proportional to the tokens) or stands for
    every ``x``."""
    if not points:
        raise ValueError("interpolate_rows needs at least one measured row")
    for xi, values in points:
        if xi == x:
            return values
    if len(points) == 1:
        xi, values = points[0]
        return tuple(v * x / xi for v in values) if proportional else values
    below = [p for p in points if p[0] <= x]
    above = [p for p in points if p[0] >= x]
    if below and above:
        lo, hi = below[-1], above[0]
    elif above:
        lo, hi = points[0], points[1]
    else:
        lo, hi = points[-2], points[-1]
    share = (x - lo[0]) / (hi[0] - lo[0])
    return tuple(max(a + share * (b - a), 0.0) for a, b in zip(lo[1], hi[1], strict=True))


def free_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the ordinary least-squares line through ``(x, y)`` points, either sign; one point
    (or one ``x``) gives a flat line at the mean, none the zero line."""
    if not points:
        return 0.0, 0.0
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / den if den > 0 else 0.0
    return my - slope * mx, slope


def least_squares_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of the least-squares line through ``(x, y)`` points (:func:`free_line`), both kept at
    zero or above (a pass is a fixed cost plus a part that grows with the work): a falling fit becomes flat at the
    mean, a negative intercept a line through the origin."""
    intercept, slope = free_line(points)
    if slope <= 0:
        return (sum(y for _, y in points) / len(points) if points else 0.0), 0.0
    if intercept < 0:
        return 0.0, max(sum(x * y for x, y in points) / sum(x * x for x, _ in points), 0.0)
    return intercept, slope


class Measurements(Protocol):
    """Read-only view of what profiling measured; every answer may be ``None`` (not measured)."""

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        """The fit for ``op`` over a group of ``group_size`` ranks within or across nodes."""
        ...

    def gemm_tflops(self, m: int, n: int, k: int, dtype: str) -> float | None:
        """Achieved TFLOP/s of an ``(m x k) @ (k x n)`` matmul in ``dtype`` (``"bf16"``, ``"fp16"``, ``"fp32"``),
        interpolated from the measured table."""
        ...

    def peak_tflops(self, dtype: str) -> float | None:
        """Best matmul throughput measured in ``dtype`` (the device's practical peak)."""
        ...

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        """Measured (forward, backward) seconds of one segment class (``segment``: its key in the analysis JSON)
        under one candidate partition (its canonical string) at micro-batch size ``micro_batch``."""
        ...

    def segment_micro_batches(self, segment: str, partition: str) -> tuple[int, ...]:
        """The micro-batch sizes at which ``segment`` was measured under ``partition``, ascending."""
        ...

    def step_overheads(self, partition: str, micro_batch: int) -> StepOverheads | None:
        """A training step beyond the isolated segments under ``partition`` at ``micro_batch`` (``None`` if not
        measured)."""
        ...

    def pipeline_probe(self, partition: str, micro_batch: int) -> PipelineProbe | None:
        """The pipelined probe of ``partition`` (``tp<N>``, ``tp<N>-sp``) at ``micro_batch`` (``None`` if not
        measured)."""
        ...

    def busy_slowdown(self) -> float | None:
        """How much slower a pass runs with every rank of a node busy, as profiling timed it, than alone: ranks per
        node over cores where the ranks share fewer cores (CPU); ``None`` where each rank has its own device."""
        ...

    def segment_baseline_seconds(self, segment: str, partition: str, micro_batch: int) -> float | None:
        """For a partition under recomputation (``tp2-selective``, ``tp2-full``): forward plus backward seconds of
        the same layer without it, timed alternately with the recomputed one (``None`` if not measured)."""
        ...

    def segment_memory(self, segment: str, partition: str, micro_batch: int) -> SegmentMemory | None:
        """Measured tensor memory of one segment class (as :meth:`segment_seconds`) under ``partition`` at
        ``micro_batch`` (median over ranks and repeats)."""
        ...


class NothingMeasured:
    """:class:`Measurements` for a preset cluster: nothing was measured."""

    def collective(self, op: Collective, group_size: int, span: Span) -> CollectiveFit | None:
        return None

    def gemm_tflops(self, m: int, n: int, k: int, dtype: str) -> float | None:
        return None

    def peak_tflops(self, dtype: str) -> float | None:
        return None

    def segment_seconds(self, segment: str, partition: str, micro_batch: int) -> tuple[float, float] | None:
        return None

    def segment_micro_batches(self, segment: str, partition: str) -> tuple[int, ...]:
        return ()

    def segment_baseline_seconds(self, segment: str, partition: str, micro_batch: int) -> float | None:
        return None

    def step_overheads(self, partition: str, micro_batch: int) -> StepOverheads | None:
        return None

    def pipeline_probe(self, partition: str, micro_batch: int) -> PipelineProbe | None:
        return None

    def segment_memory(self, segment: str, partition: str, micro_batch: int) -> SegmentMemory | None:
        return None

    def busy_slowdown(self) -> float | None:
        return None
