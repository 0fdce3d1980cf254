"""Per-layer pass times (seconds) from profiled segments (CFP): where profiling timed a segment class under the plan's
partition, its measured forward and backward seconds replace the analytical layer cost. What a segment's time holds
and how sizes between the measured ones are filled in: docs/simulator.md, "measured_segments.py".
"""

from __future__ import annotations

import statistics

from cfp_megatron.base.config import JobSpec, Recompute
from cfp_megatron.cluster.measured import Measurements, interpolate_rows, least_squares_line, partition_name
from cfp_megatron.sim.layer_cost import LayerCost, PassCost


def _points(measurements: Measurements, kind: str, partition: str) -> list[tuple[int, float, float]]:
    """``(micro-batch size, forward seconds, backward seconds)`` of every size timed for ``kind`` under
    ``partition``."""
    found = []
    for size in measurements.segment_micro_batches(kind, partition):
        hit = measurements.segment_seconds(kind, partition, size)
        if hit is not None:
            found.append((size, hit[0], hit[1]))
    return found


def measured_pass(measurements: Measurements, kind: str, partition: str,
                  micro_batch: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of ``kind`` under ``partition`` at ``micro_batch`` sequences; ``None`` when nothing
    was measured for that kind and partition.

    With three or more measured sizes: the least-squares line ``fixed + per-sequence x micro_batch`` through them.
    With fewer: the measured value, else linear interpolation between the two nearest sizes (extrapolation from the
    two nearest). Why: docs/simulator.md, "measured_segments.py".
    """
    points = _points(measurements, kind, partition)
    if len(points) >= 3:
        fwd_fixed, fwd_per_seq = least_squares_line([(size, forward) for size, forward, _ in points])
        bwd_fixed, bwd_per_seq = least_squares_line([(size, backward) for size, _, backward in points])
        return fwd_fixed + fwd_per_seq * micro_batch, bwd_fixed + bwd_per_seq * micro_batch
    exact = measurements.segment_seconds(kind, partition, micro_batch)
    if exact is not None:
        return exact
    if not points:
        return None
    forward, backward = interpolate_rows([(float(size), (fwd, bwd)) for size, fwd, bwd in points], micro_batch)
    return forward, backward


def recompute_share(measurements: Measurements, kind: str, plain: str, checkpointed: str) -> float | None:
    """What a ``kind`` layer's forward plus backward takes beyond the plain partition ``plain`` under recomputation
    (the recompute round's partition ``checkpointed``: ``tp2-selective``, its core attention checkpointed;
    ``tp2-full``, the layer checkpointed whole), as a share of the plain layer's time (dimensionless): the median over
    the micro-batch sizes timed under both of ``checkpointed / plain - 1``, never below zero; ``None`` when no size
    was. Which plain time and why a median: docs/simulator.md, "Recompute share"."""
    shares = []
    for size in measurements.segment_micro_batches(kind, checkpointed):
        checkpointed_pair = measurements.segment_seconds(kind, checkpointed, size)
        plain_s = measurements.segment_baseline_seconds(kind, checkpointed, size)
        if plain_s is None:
            plain_pair = measurements.segment_seconds(kind, plain, size)
            plain_s = sum(plain_pair) if plain_pair is not None else None
        if checkpointed_pair is not None and plain_s is not None and plain_s > 0:
            shares.append(sum(checkpointed_pair) / plain_s - 1.0)
    return max(statistics.median(shares), 0.0) if shares else None


def _as_pass(seconds: float) -> PassCost:
    """A pass of ``seconds`` compute."""
    return PassCost(compute_s=seconds)


def apply_measured(job: JobSpec, measurements: Measurements | None, micro_batch: int, dense: LayerCost,
                   moe: LayerCost, emb: tuple[PassCost, PassCost], out: tuple[PassCost, PassCost]
                   ) -> tuple[LayerCost, LayerCost, tuple[PassCost, PassCost], tuple[PassCost, PassCost]]:
    """The layer costs (seconds per micro-batch of ``micro_batch`` sequences) with measured segments in place of the
    analytical ``dense``, ``moe``, embedding ``emb`` and head ``out`` where profiling has them.

    Returns ``(dense, moe, embedding, head)``. A recomputed layer's recomputation costs the measured share
    (:func:`recompute_share`) where the recompute round measured it, else the analytical model's share of the
    measured forward pass (docs/simulator.md, "Recompute share").
    """
    if measurements is None:
        return dense, moe, emb, out
    parallel = job.parallel
    partition = partition_name(parallel.tp, sp=parallel.sp)  # the embedding and the head
    layer_partition = partition_name(parallel.tp, sp=parallel.sp, mlp=parallel.mlp)
    checkpointed = partition_name(parallel.tp, sp=parallel.sp, mlp=parallel.mlp, recompute=parallel.recompute,
                                  recompute_modules=parallel.recompute_modules)

    def layer(kind: str, cost: LayerCost) -> LayerCost:
        hit = measured_pass(measurements, kind, layer_partition, micro_batch)
        if hit is None:
            return cost
        share = recompute_share(measurements, kind, layer_partition, checkpointed) \
            if parallel.recompute is not Recompute.none else None
        if share is not None:
            recompute_s = share * sum(hit)
        else:
            recompute_s = hit[0] * (cost.recompute.total_s / cost.forward.total_s if cost.forward.total_s > 0
                                    else 0.0)
        # The segments round times MoE layers with every expert on the rank (EP = expert TP = 1): the plan's expert
        # token exchange (none for a dense layer) is none of the measured time, so it stays the model's.
        return LayerCost(forward=PassCost(compute_s=hit[0], ep_comm_s=cost.forward.ep_comm_s),
                         backward=PassCost(compute_s=hit[1], ep_comm_s=cost.backward.ep_comm_s),
                         recompute=PassCost(compute_s=recompute_s, ep_comm_s=cost.recompute.ep_comm_s),
                         params=cost.params, expert_params=cost.expert_params, ep_alone_s=cost.ep_alone_s)

    def ends(kind: str, cost: tuple[PassCost, PassCost]) -> tuple[PassCost, PassCost]:
        hit = measured_pass(measurements, kind, partition, micro_batch)
        if hit is None:
            return cost
        return _as_pass(hit[0]), _as_pass(hit[1])

    new_dense = layer("dense", dense)
    new_moe = layer("moe", moe) if job.model.is_moe else new_dense
    return new_dense, new_moe, ends("embedding", emb), ends("head", out)
