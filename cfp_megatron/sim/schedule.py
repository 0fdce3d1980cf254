"""Pipeline schedules as timed events: 1F1B (PipeDream-Flush) and Megatron's interleaved 1F1B, each rank's passes
in Megatron-Core's order, timed as a dependency graph (docs/simulator.md, "schedule.py")."""

from __future__ import annotations

import functools
from dataclasses import dataclass

from cfp_megatron.base.errors import CfpError


class ScheduleError(CfpError, RuntimeError):
    """The schedule cannot be run (a dependency cycle): a bug in the order, never a user error."""


@dataclass(frozen=True, kw_only=True)
class Op:
    """One timed pass in the schedule."""

    rank: int
    """Pipeline rank."""
    forward: bool
    """Forward (true) or backward pass."""
    microbatch: int
    """Micro-batch index."""
    chunk: int
    """Model chunk on this rank."""
    start_s: float
    """Start time, seconds from the step's start."""
    end_s: float
    """End time, seconds from the step's start."""


@dataclass(frozen=True, kw_only=True)
class ScheduleResult:
    """Timing of one pipeline schedule."""

    end_s: tuple[float, ...]
    """Time each rank finishes its last pass, seconds."""
    busy_s: tuple[float, ...]
    """Time each rank spends in passes, seconds."""
    ops: tuple[Op, ...]
    """Every pass with its times (empty when the closed form was used)."""
    simulated: bool
    """Whether the schedule was run event by event (false: closed form)."""


@functools.lru_cache(maxsize=4096)
def rank_order(rank: int, pp: int, vpp: int, microbatches: int) -> tuple[tuple[bool, int, int], ...]:
    """Megatron-Core's order of passes on pipeline rank ``rank`` of ``pp`` with ``vpp`` model chunks and
    ``microbatches`` micro-batches: ``(is_forward, microbatch, chunk)`` per pass (cached: a search times many plans
    with the same pipeline shape)."""
    if vpp == 1:
        warmup = min(pp - rank - 1, microbatches)
        order = [(True, index, 0) for index in range(warmup)]
        for index in range(microbatches - warmup):
            order.append((True, warmup + index, 0))
            order.append((False, index, 0))
        order.extend((False, index, 0) for index in range(microbatches - warmup, microbatches))
        return tuple(order)
    total = microbatches * vpp  # (micro-batch, chunk) passes in each direction
    warmup = total if microbatches == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    # The n-th forward (backward) of the rank: chunks advance every pp micro-batches, in groups of pp x vpp.
    def fwd(nth: int) -> tuple[bool, int, int]:
        return True, (nth // (pp * vpp)) * pp + nth % pp, (nth // pp) % vpp

    def bwd(nth: int) -> tuple[bool, int, int]:
        return False, (nth // (pp * vpp)) * pp + nth % pp, vpp - 1 - (nth // pp) % vpp

    order = [fwd(nth) for nth in range(warmup)]
    for index in range(total - warmup):
        order.append(fwd(warmup + index))
        order.append(bwd(index))
    order.extend(bwd(nth) for nth in range(total - warmup, total))
    return tuple(order)


def dependency_floors(forward_s: list[list[float]], backward_s: list[list[float]],
                      busy: tuple[float, ...]) -> list[float]:
    """Seconds before which no schedule of these passes can end, per rank, from the pass seconds
    ``forward_s[rank][chunk]``, ``backward_s[rank][chunk]`` and each rank's total ``busy`` seconds
    (docs/simulator.md, "Dependency floors")."""
    pp = len(forward_s)
    own = [busy[rank] + sum(forward_s[earlier][0] for earlier in range(rank)) for rank in range(pp)]
    chain = max(own[rank] + sum(backward_s[earlier][0] for earlier in range(rank)) for rank in range(pp))
    return [max(own[0], chain), *own[1:]]


def run_schedule(forward_s: list[list[float]], backward_s: list[list[float]], p2p_s: float, microbatches: int, *,
                 keep_ops: bool = False, max_ops: int = 200_000) -> ScheduleResult:
    """Time the schedule for per-rank, per-chunk pass durations ``forward_s[rank][chunk]`` and
    ``backward_s[rank][chunk]`` (seconds, one micro-batch) over ``microbatches`` micro-batches.

    ``p2p_s`` is the send/receive time (seconds) between consecutive stages; ``keep_ops`` keeps every timed pass.
    Schedules with more than ``max_ops`` passes are extrapolated from two shorter ones (docs/simulator.md,
    "Long schedules"). Raises :class:`ScheduleError` on a deadlock.
    """
    pp, vpp = len(forward_s), len(forward_s[0])
    num_ops = 2 * pp * vpp * microbatches
    busy = tuple(microbatches * (sum(forward_s[rank]) + sum(backward_s[rank])) for rank in range(pp))
    short_microbatches = 4 * pp + microbatches % pp
    if num_ops > max_ops and not keep_ops and microbatches > short_microbatches + pp:
        short = run_schedule(forward_s, backward_s, p2p_s, short_microbatches, max_ops=num_ops)
        longer = run_schedule(forward_s, backward_s, p2p_s, short_microbatches + pp, max_ops=num_ops)
        steps = (microbatches - short_microbatches) / pp
        floors = dependency_floors(forward_s, backward_s, busy)
        ends = tuple(max(short_end + steps * (longer_end - short_end), floor)
                     for short_end, longer_end, floor in zip(short.end_s, longer.end_s, floors, strict=True))
        return ScheduleResult(end_s=ends, busy_s=busy, ops=(), simulated=False)
    num_stages = pp * vpp
    # End of each pass per global stage and micro-batch (-1: not run yet).
    forward_end = [[-1.0] * microbatches for _ in range(num_stages)]
    backward_end = [[-1.0] * microbatches for _ in range(num_stages)]
    orders = [rank_order(rank, pp, vpp, microbatches) for rank in range(pp)]
    next_pass = [0] * pp  # index in its order of each rank's next pass
    free_s = [0.0] * pp  # when each rank finished its last timed pass
    ops: list[Op] = []
    remaining = sum(len(order) for order in orders)
    while remaining:
        progressed = False
        for rank in range(pp):
            order = orders[rank]
            index = next_pass[rank]
            clock_s = free_s[rank]
            rank_forward_s, rank_backward_s = forward_s[rank], backward_s[rank]
            while index < len(order):
                is_fwd, microbatch, chunk = order[index]
                stage = chunk * pp + rank
                if is_fwd:
                    if stage == 0:
                        ready_s = 0.0
                    else:
                        dep_end_s = forward_end[stage - 1][microbatch]
                        if dep_end_s < 0:
                            break
                        ready_s = dep_end_s + p2p_s
                    start_s = clock_s if clock_s > ready_s else ready_s
                    clock_s = start_s + rank_forward_s[chunk]
                    forward_end[stage][microbatch] = clock_s
                else:
                    if stage == num_stages - 1:
                        ready_s = forward_end[stage][microbatch]
                    else:
                        dep_end_s = backward_end[stage + 1][microbatch]
                        if dep_end_s < 0:
                            break
                        ready_s = dep_end_s + p2p_s
                    start_s = clock_s if clock_s > ready_s else ready_s
                    clock_s = start_s + rank_backward_s[chunk]
                    backward_end[stage][microbatch] = clock_s
                if keep_ops:
                    ops.append(Op(rank=rank, forward=is_fwd, microbatch=microbatch, chunk=chunk, start_s=start_s,
                                  end_s=clock_s))
                index += 1
            if index != next_pass[rank]:
                remaining -= index - next_pass[rank]
                next_pass[rank] = index
                free_s[rank] = clock_s
                progressed = True
        if not progressed:
            raise ScheduleError(f"pipeline schedule deadlocked (pp={pp}, vpp={vpp}, microbatches={microbatches})")
    return ScheduleResult(end_s=tuple(free_s), busy_s=busy, ops=tuple(ops), simulated=True)
