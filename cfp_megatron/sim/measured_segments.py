"""Per-layer pass times from profiled segments (CFP): where profiling timed a segment class under the plan's
partition, its measured forward and backward seconds replace the analytical layer cost.

A segment is timed as the real Megatron module (embedding, decoder layer of each kind, head) on the live
tensor-parallel group, so the time includes its kernels, its TP/SP collectives and the framework's own per-layer
overhead, which no FLOP count sees (it dominates small models and CPUs). Profiling times a few micro-batch sizes;
a pass is a fixed cost plus a part proportional to the tokens, so with three or more sizes the least-squares line
through them gives every size; with fewer, the sizes between are interpolated linearly.
"""

from __future__ import annotations

import statistics

from cfp_megatron.base.config import JobSpec, Recompute
from cfp_megatron.cluster.measured import Measurements, interpolate_rows, least_squares_line, partition_name
from cfp_megatron.sim.layer_cost import LayerCost, PassCost


def _points(measurements: Measurements, kind: str, partition: str) -> list[tuple[int, float, float]]:
    found = []
    for mb in measurements.segment_micro_batches(kind, partition):
        hit = measurements.segment_seconds(kind, partition, mb)
        if hit is not None:
            found.append((mb, hit[0], hit[1]))
    return found


def measured_pass(measurements: Measurements, kind: str, partition: str,
                  micro_batch: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``kind`` under ``partition`` at ``micro_batch``; ``None`` when nothing was
    measured for that kind and partition.

    With three or more measured sizes: the least-squares line ``fixed + per-sequence x micro_batch`` through them
    (each timing on a busy machine is noisy; the line uses every size). With fewer: the measured value, else linear
    interpolation between the two nearest sizes (extrapolation from the two nearest).
    """
    points = _points(measurements, kind, partition)
    if len(points) >= 3:
        fa, fb = least_squares_line([(mb, f) for mb, f, _ in points])
        ba, bb = least_squares_line([(mb, b) for mb, _, b in points])
        return fa + fb * micro_batch, ba + bb * micro_batch
    exact = measurements.segment_seconds(kind, partition, micro_batch)
    if exact is not None:
        return exact
    if not points:
        return None
    forward, backward = interpolate_rows([(float(mb), (f, b)) for mb, f, b in points], micro_batch)
    return forward, backward


def recompute_share(measurements: Measurements, kind: str, plain: str, checkpointed: str) -> float | None:
    """What a ``kind`` layer's forward plus backward takes beyond the plain partition ``plain`` under recomputation
    (the recompute round's partition ``checkpointed``: ``tp2-selective``, its core attention checkpointed;
    ``tp2-full``, the layer checkpointed whole), as a share of the plain layer's time: the median over the
    micro-batch sizes timed under both of ``checkpointed / plain - 1``, never below zero; ``None`` when no size was.

    The plain time of a size is the one the recompute round took alternately with the checkpointed layer
    (:meth:`~cfp_megatron.cluster.measured.Measurements.segment_baseline_seconds`) where it has one, else the
    segments round's, a minute or more earlier on a machine whose speed drifts. A share per size and their
    median, not the difference of two fitted lines: each size is one timing on a busy machine, and one slow size
    would tilt both lines; the median of the shares passes over it."""
    shares = []
    for mb in measurements.segment_micro_batches(kind, checkpointed):
        again = measurements.segment_seconds(kind, checkpointed, mb)
        base = measurements.segment_baseline_seconds(kind, checkpointed, mb)
        if base is None:
            base_pair = measurements.segment_seconds(kind, plain, mb)
            base = sum(base_pair) if base_pair is not None else None
        if again is not None and base is not None and base > 0:
            shares.append(sum(again) / base - 1.0)
    return max(statistics.median(shares), 0.0) if shares else None


def _as_pass(seconds: float) -> PassCost:
    return PassCost(compute_s=seconds)


def apply_measured(job: JobSpec, measurements: Measurements | None, micro_batch: int, dense: LayerCost,
                   moe: LayerCost, emb: tuple[PassCost, PassCost], out: tuple[PassCost, PassCost]
                   ) -> tuple[LayerCost, LayerCost, tuple[PassCost, PassCost], tuple[PassCost, PassCost]]:
    """The layer costs with measured segments in place of the analytical ones where profiling has them.

    Returns ``(dense, moe, embedding, head)``. Under recomputation, where the recompute round measured the layer
    (partition ``tp<N>-selective`` or ``tp<N>-full``), a recomputed layer's recomputation costs the share of the
    plain layer's forward and backward that the checkpointed layer took beyond it (:func:`recompute_share`):
    selective, the core attention run again and the checkpoint's own bookkeeping (RNG states, a nested backward),
    which on a small model or a CPU outweighs the attention's FLOPs; full, the forward run again less what the
    first forward saves by running without autograd. Otherwise the analytical model's share of the measured
    forward pass (full: the whole forward; selective: the attention core's).
    """
    if measurements is None:
        return dense, moe, emb, out
    p = job.parallel
    partition = partition_name(p.tp, sp=p.sp)  # the embedding and the head
    layers = partition_name(p.tp, sp=p.sp, mlp=p.mlp)
    checkpointed = partition_name(p.tp, sp=p.sp, mlp=p.mlp, recompute=p.recompute)

    def layer(kind: str, cost: LayerCost) -> LayerCost:
        hit = measured_pass(measurements, kind, layers, micro_batch)
        if hit is None:
            return cost
        share = recompute_share(measurements, kind, layers, checkpointed) \
            if p.recompute is not Recompute.none else None
        if share is not None:
            extra = share * sum(hit)
        else:
            extra = hit[0] * (cost.recompute.total_s / cost.forward.total_s if cost.forward.total_s > 0 else 0.0)
        return LayerCost(forward=_as_pass(hit[0]), backward=_as_pass(hit[1]), recompute=_as_pass(extra),
                         params=cost.params, expert_params=cost.expert_params)

    def ends(kind: str, cost: tuple[PassCost, PassCost]) -> tuple[PassCost, PassCost]:
        hit = measured_pass(measurements, kind, partition, micro_batch)
        if hit is None:
            return cost
        return _as_pass(hit[0]), _as_pass(hit[1])

    new_dense = layer("dense", dense)
    new_moe = layer("moe", moe) if job.model.is_moe else new_dense
    return new_dense, new_moe, ends("embedding", emb), ends("head", out)
