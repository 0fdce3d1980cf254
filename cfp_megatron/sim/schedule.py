"""Pipeline schedules as timed events: 1F1B (PipeDream-Flush) and Megatron's interleaved 1F1B.

Each pipeline rank gets the exact order of forward and backward passes Megatron-Core's schedules run (warm-up
forwards, steady one-forward-one-backward, cool-down backwards; the interleaved schedule walks model chunks in groups
of ``pp`` micro-batches). The passes are then timed as a dependency graph: a forward of global stage ``g`` waits for
the forward of stage ``g-1`` plus the send/receive time, a backward waits for the backward of stage ``g+1`` plus the
send/receive time, and every rank runs its passes one at a time in its order. The idle time left on a rank is its
pipeline bubble.
"""

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
    """Start time."""
    end_s: float
    """End time."""


@dataclass(frozen=True, kw_only=True)
class ScheduleResult:
    """Timing of one pipeline schedule."""

    end_s: tuple[float, ...]
    """Time each rank finishes its last pass."""
    busy_s: tuple[float, ...]
    """Time each rank spends in passes."""
    ops: tuple[Op, ...]
    """Every pass with its times (empty when the closed form was used)."""
    simulated: bool
    """Whether the schedule was run event by event (false: closed form)."""


@functools.lru_cache(maxsize=4096)
def rank_order(rank: int, pp: int, vpp: int, microbatches: int) -> tuple[tuple[bool, int, int], ...]:
    """Megatron-Core's order of passes on one pipeline rank: ``(is_forward, microbatch, chunk)`` (cached: a search
    times many plans with the same pipeline shape)."""
    m = microbatches
    if vpp == 1:
        warm = min(pp - rank - 1, m)
        order = [(True, i, 0) for i in range(warm)]
        for i in range(m - warm):
            order.append((True, warm + i, 0))
            order.append((False, i, 0))
        order.extend((False, i, 0) for i in range(m - warm, m))
        return tuple(order)
    total = m * vpp
    warm = total if m == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)

    def fwd(k: int) -> tuple[bool, int, int]:
        return True, (k // (pp * vpp)) * pp + k % pp, (k // pp) % vpp

    def bwd(k: int) -> tuple[bool, int, int]:
        return False, (k // (pp * vpp)) * pp + k % pp, vpp - 1 - (k // pp) % vpp

    order = [fwd(k) for k in range(warm)]
    for i in range(total - warm):
        order.append(fwd(warm + i))
        order.append(bwd(i))
    order.extend(bwd(k) for k in range(total - warm, total))
    return tuple(order)


def dependency_floors(forward_s: list[list[float]], backward_s: list[list[float]],
                      busy: tuple[float, ...]) -> list[float]:
    """Times before which no schedule of these passes can end, per rank: rank ``r`` runs its passes (``busy``) one
    after another, after micro-batch 0 went forward through the first chunks of the ranks before it; and rank 0's
    last pass, the backward of the last micro-batch's first chunk, follows the last pass of every rank ``r``
    and that micro-batch's backward through the ranks before it."""
    pp = len(forward_s)
    own = [busy[r] + sum(forward_s[q][0] for q in range(r)) for r in range(pp)]
    chain = max(own[r] + sum(backward_s[q][0] for q in range(r)) for r in range(pp))
    return [max(own[0], chain), *own[1:]]


def run_schedule(forward_s: list[list[float]], backward_s: list[list[float]], p2p_s: float, microbatches: int, *,
                 keep_ops: bool = False, max_ops: int = 200_000) -> ScheduleResult:
    """Time the schedule for per-rank, per-chunk pass durations ``forward_s[rank][chunk]`` (one micro-batch).

    ``p2p_s`` is the send/receive time between consecutive stages. Schedules with more than ``max_ops`` passes are
    timed event by event with ``m0 = 4 pp + m mod pp`` and ``m0 + pp`` micro-batches and extrapolated linearly to
    ``m`` (the steady state repeats every ``pp`` micro-batches: exact to rounding for stages that differ only by the
    embedding and the head, within about 2% for arbitrary stages), never below :func:`dependency_floors`.
    """
    pp, vpp, m = len(forward_s), len(forward_s[0]), microbatches
    n_ops = 2 * pp * vpp * m
    busy = tuple(m * (sum(forward_s[r]) + sum(backward_s[r])) for r in range(pp))
    m0 = 4 * pp + m % pp
    if n_ops > max_ops and not keep_ops and m > m0 + pp:
        short = run_schedule(forward_s, backward_s, p2p_s, m0, max_ops=n_ops)
        longer = run_schedule(forward_s, backward_s, p2p_s, m0 + pp, max_ops=n_ops)
        steps = (m - m0) / pp
        floors = dependency_floors(forward_s, backward_s, busy)
        ends = tuple(max(a + steps * (b - a), floor)
                     for a, b, floor in zip(short.end_s, longer.end_s, floors, strict=True))
        return ScheduleResult(end_s=ends, busy_s=busy, ops=(), simulated=False)
    stages = pp * vpp
    fend = [[-1.0] * m for _ in range(stages)]
    bend = [[-1.0] * m for _ in range(stages)]
    orders = [rank_order(r, pp, vpp, m) for r in range(pp)]
    ptr = [0] * pp
    free = [0.0] * pp
    ops: list[Op] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            i = ptr[r]
            t = free[r]
            fr, br = forward_s[r], backward_s[r]
            while i < len(order):
                is_fwd, mb, c = order[i]
                g = c * pp + r
                if is_fwd:
                    if g == 0:
                        ready = 0.0
                    else:
                        dep = fend[g - 1][mb]
                        if dep < 0:
                            break
                        ready = dep + p2p_s
                    start = t if t > ready else ready
                    t = start + fr[c]
                    fend[g][mb] = t
                else:
                    if g == stages - 1:
                        ready = fend[g][mb]
                    else:
                        dep = bend[g + 1][mb]
                        if dep < 0:
                            break
                        ready = dep + p2p_s
                    start = t if t > ready else ready
                    t = start + br[c]
                    bend[g][mb] = t
                if keep_ops:
                    ops.append(Op(rank=r, forward=is_fwd, microbatch=mb, chunk=c, start_s=start, end_s=t))
                i += 1
            if i != ptr[r]:
                remaining -= i - ptr[r]
                ptr[r] = i
                free[r] = t
                progressed = True
        if not progressed:
            raise ScheduleError(f"pipeline schedule deadlocked (pp={pp}, vpp={vpp}, microbatches={m})")
    return ScheduleResult(end_s=tuple(free), busy_s=busy, ops=tuple(ops), simulated=True)
