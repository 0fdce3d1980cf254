"""Pipeline schedules as timed events: 1F1B (PipeDream-Flush) and Megatron's interleaved 1F1B, each rank's passes
in Megatron-Core's order, timed as a dependency graph (docs/simulator.md, "schedule.py"); the non-interleaved one
also with its exchanges as Megatron-Core runs them, blocking both stages ("Blocking exchanges"), and the interleaved
one as Megatron-LM ran it before Megatron-Core, every exchange blocking and with both neighbours at once ("Blocking
interleaved exchanges"). Also GPipe and the zero-bubble schedules with the backward split into B and W passes
("Zero-bubble schedules")."""

from __future__ import annotations

import dataclasses
import functools
import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from cfp_megatron.base.errors import CfpError
from cfp_megatron.sim.options import PipelineSchedule


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


def zero_bubble_limit(pp: int, microbatches: int, schedule: PipelineSchedule) -> int:
    """Micro-batches a pipeline rank of ``pp`` holds at most under a zero-bubble ``schedule`` (forwards run whose W
    pass has not), the same on every rank as the zero-bubble runtime's memory limit sets it (its
    ``--zero-bubble-max-pending-backward`` times a forward's activations): ``pp`` for ZB-H1 / ZB-1p (1F1B's peak),
    ``2 pp`` for ZB-H2 / ZB-2p; never more than ``microbatches`` (docs/simulator.md, "Zero-bubble schedules")."""
    return min((2 if schedule is PipelineSchedule.zb_h2 else 1) * pp, microbatches)


@functools.lru_cache(maxsize=4096)
def rank_order(rank: int, pp: int, vpp: int, microbatches: int, *, all_forward: bool = False
               ) -> tuple[tuple[bool, int, int], ...]:
    """Megatron-Core's order of passes on pipeline rank ``rank`` of ``pp`` with ``vpp`` model chunks and
    ``microbatches`` micro-batches: ``(is_forward, microbatch, chunk)`` per pass (cached: a search times many plans
    with the same pipeline shape). ``all_forward`` (one chunk): GPipe's, every forward before the first backward."""
    if vpp == 1:
        warmup = microbatches if all_forward else _warmup(rank, pp, vpp, microbatches)
        order = [(True, index, 0) for index in range(warmup)]
        for index in range(microbatches - warmup):
            order.append((True, warmup + index, 0))
            order.append((False, index, 0))
        order.extend((False, index, 0) for index in range(microbatches - warmup, microbatches))
        return tuple(order)
    total = microbatches * vpp  # (micro-batch, chunk) passes in each direction
    warmup = _warmup(rank, pp, vpp, microbatches)

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


def _warmup(rank: int, pp: int, vpp: int, microbatches: int) -> int:
    """Forwards pipeline rank ``rank`` runs before its first backward in :func:`rank_order` (Megatron-Core's warm-up
    of the 1F1B schedule, plain or interleaved over ``vpp`` chunks)."""
    if vpp == 1:
        return min(pp - rank - 1, microbatches)
    total = microbatches * vpp
    return total if microbatches == pp else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)


def first_backward(rank: int, pp: int, vpp: int, microbatches: int) -> int:
    """The position of pipeline rank ``rank``'s first backward pass in :func:`rank_order` (its length where it has
    none), without building the order: the warm-up's forwards, then one steady-state forward where any is left."""
    total, warmup = microbatches * vpp, _warmup(rank, pp, vpp, microbatches)
    return warmup + 1 if warmup < total else total


class Transfer(NamedTuple):
    """One tensor handed between neighbouring pipeline ranks (a named tuple: a long schedule holds many)."""

    activation: bool
    """A forward activation (stage ``boundary`` to ``boundary + 1``), else a gradient (back)."""
    boundary: int
    """The pair of stages it crosses: ``boundary`` and ``boundary + 1``, counted over every rank's chunks (chunk
    ``c`` of rank ``r`` is stage ``c pp + r``; one chunk a rank: the ranks), so over ranks ``boundary mod pp`` and
    the next one."""
    microbatch: int
    """Micro-batch index."""


class Exchange(NamedTuple):
    """One call of the pipeline's send/receive (Megatron-Core's ``P2PCommunicator``, Megatron-LM's
    ``p2p_communication._communicate`` before it): its sends and receives, grouped and waited for together."""

    sends: tuple[Transfer, ...]
    """What the rank sends."""
    receives: tuple[Transfer, ...]
    """What the rank receives."""


def blocking_order(rank: int, pp: int, microbatches: int) -> tuple[tuple[bool, int] | Exchange, ...]:
    """What pipeline rank ``rank`` of ``pp`` runs in Megatron-Core's non-interleaved 1F1B schedule
    (``forward_backward_pipelining_without_interleaving``) over ``microbatches`` micro-batches, in order: passes as
    ``(is_forward, microbatch)`` and its exchanges (``recv_forward``, ``send_forward``,
    ``send_forward_recv_backward``, ``send_backward_recv_forward``, ``recv_backward``, ``send_backward``; none on the
    side of the first or last stage that has no neighbour)."""
    first, last = rank == 0, rank == pp - 1
    warmup = min(pp - rank - 1, microbatches)

    def act(boundary: int, microbatch: int) -> Transfer:
        return Transfer(True, boundary, microbatch)

    def grad(boundary: int, microbatch: int) -> Transfer:
        return Transfer(False, boundary, microbatch)

    order: list[tuple[bool, int] | Exchange] = []

    def exchange(sends: tuple[Transfer, ...], receives: tuple[Transfer, ...]) -> None:
        if sends or receives:
            order.append(Exchange(sends, receives))

    for index in range(warmup):
        exchange((), () if first else (act(rank - 1, index),))  # recv_forward
        order.append((True, index))
        exchange(() if last else (act(rank, index),), ())  # send_forward
    if microbatches > warmup:
        exchange((), () if first else (act(rank - 1, warmup),))
    for index in range(microbatches - warmup):
        order.append((True, warmup + index))
        if not last:  # send_forward_recv_backward
            exchange((act(rank, warmup + index),), (grad(rank, index),))
        order.append((False, index))
        if not first:  # send_backward (the last one), else send_backward_recv_forward
            final = index == microbatches - warmup - 1
            exchange((grad(rank - 1, index),), () if final else (act(rank - 1, warmup + index + 1),))
    for index in range(microbatches - warmup, microbatches):
        exchange((), () if last else (grad(rank, index),))  # recv_backward
        order.append((False, index))
        exchange(() if first else (grad(rank - 1, index),), ())  # send_backward
    return tuple(order)


def interleaved_blocking_order(rank: int, pp: int, vpp: int, microbatches: int
                               ) -> tuple[tuple[bool, int, int] | Exchange, ...]:
    """What pipeline rank ``rank`` of ``pp`` runs in Megatron-LM's interleaved 1F1B schedule before Megatron-Core
    (``forward_backward_pipelining_with_interleaving`` in ``megatron/schedules.py``, 2020-2023) over ``vpp`` model
    chunks and ``microbatches`` micro-batches, in order: passes as ``(is_forward, microbatch, chunk)`` and every call
    of ``p2p_communication._communicate``, each with what it sends and receives: ``recv_forward`` first (not on rank
    0), after each warm-up forward ``send_forward_recv_forward`` (the last one, where a steady state follows,
    ``send_forward_backward_recv_forward_backward``), after each steady-state forward and backward one
    ``send_forward_backward_recv_forward_backward`` with both neighbours, ``recv_backward`` (where every pass is in
    the warm-up, not on the last rank) and after each cool-down backward ``send_backward_recv_backward``; rank 0's
    neighbour before it is rank ``pp - 1``. Which tensors they receive follows the schedule's own bookkeeping: a
    chunk's activations and gradients arrive in micro-batch order (docs/simulator.md, "Blocking interleaved
    exchanges"). Raises ``ValueError`` unless ``microbatches`` is a multiple of ``pp``, as the schedule asserts."""
    if microbatches % pp:
        raise ValueError(f"the interleaved schedule runs micro-batches in groups of pp: {microbatches} micro-batches "
                         f"over pp={pp}")
    total, group = microbatches * vpp, pp * vpp
    first, last = rank == 0, rank == pp - 1
    all_warmup = microbatches == pp
    warmup = total if all_warmup else min((pp - rank - 1) * 2 + (vpp - 1) * pp, total)
    remaining = total - warmup
    received = {True: [0] * vpp, False: [0] * vpp}  # activations, gradients received so far per chunk

    def chunk(nth: int, forward: bool) -> int:  # get_model_chunk_id
        found = nth % group // pp
        return found if forward else vpp - 1 - found

    def microbatch(nth: int) -> int:
        return nth // group * pp + nth % pp

    def sent(nth: int, forward: bool) -> tuple[Transfer, ...]:  # the output of the nth forward, or input gradient
        stage = chunk(nth, forward) * pp + rank
        if forward:
            return () if stage == group - 1 else (Transfer(True, stage, microbatch(nth)),)
        return () if stage == 0 else (Transfer(False, stage - 1, microbatch(nth)),)

    def receive(activation: bool, into: int) -> tuple[Transfer, ...]:
        index = received[activation][into]
        received[activation][into] += 1
        return (Transfer(activation, into * pp + rank - (1 if activation else 0), index),)

    order: list[tuple[bool, int, int] | Exchange] = []
    if not first:  # recv_forward for chunk 0
        order.append(Exchange((), receive(True, 0)))
    for nth in range(warmup):
        order.append((True, microbatch(nth), chunk(nth, True)))
        recv_prev = not (first and chunk(nth + 1, True) == 0) and nth != total - 1
        receives = receive(True, chunk(nth + 1, True)) if recv_prev else ()
        if nth == warmup - 1 and not all_warmup and not last:  # send_forward_backward_recv_forward_backward
            receives += receive(False, vpp - 1)
        order.append(Exchange(sent(nth, True), receives))
    for nth in range(remaining):
        forward_nth = nth + warmup
        order.append((True, microbatch(forward_nth), chunk(forward_nth, True)))
        order.append((False, microbatch(nth), chunk(nth, False)))
        # the first (last) rank runs pp - 1 passes ahead of the last (first), whose chunk it receives
        next_forward = chunk(forward_nth - (pp - 1), True) + 1 if first else chunk(forward_nth + 1, True)
        next_backward = chunk(nth - (pp - 1), False) - 1 if last else chunk(nth + 1, False)
        recv_prev = not (first and next_forward == vpp) and nth != remaining - 1
        recv_next = not (last and next_backward == -1)
        receives = ((receive(True, next_forward) if recv_prev else ())
                    + (receive(False, next_backward) if recv_next else ()))
        order.append(Exchange(sent(forward_nth, True) + sent(nth, False), receives))
    if all_warmup and not last:  # recv_backward for the last chunk
        order.append(Exchange((), receive(False, vpp - 1)))
    for nth in range(remaining, total):
        order.append((False, microbatch(nth), chunk(nth, False)))
        next_backward = chunk(nth + 1, False)
        recv_next = not (last and next_backward == vpp - 1) and nth != total - 1
        order.append(Exchange(sent(nth, False), receive(False, next_backward) if recv_next else ()))
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


def per_rank_links(p2p_s: float | Sequence[float], pp: int) -> tuple[float, ...]:
    """The send/receive seconds of each pipeline rank's exchange with the next (:func:`run_schedule`'s ``p2p_s``:
    one figure for every pair, or one per rank)."""
    links = (float(p2p_s),) * pp if isinstance(p2p_s, (int, float)) else tuple(p2p_s)
    if len(links) != pp:
        raise ValueError(f"p2p_s has {len(links)} exchanges for {pp} pipeline ranks")
    return links


def run_schedule(forward_s: list[list[float]], backward_s: list[list[float]], p2p_s: float | Sequence[float],
                 microbatches: int, *, blocking: bool = False, call_s: float = 0.0, keep_ops: bool = False,
                 max_ops: int = 200_000, schedule: PipelineSchedule = PipelineSchedule.megatron,
                 weight_s: Sequence[float] | None = None, gather_s: float = 0.0,
                 nic_s: Sequence[float] | None = None) -> ScheduleResult:
    """Time the schedule for per-rank, per-chunk pass durations ``forward_s[rank][chunk]`` and
    ``backward_s[rank][chunk]`` (seconds, one micro-batch) over ``microbatches`` micro-batches.

    ``p2p_s`` is the send/receive time (seconds) between consecutive stages: one figure, or one per rank ``r`` for
    its exchange with rank ``r + 1`` (the last entry: rank ``pp - 1`` with rank 0, which only the interleaved
    schedule's chunks cross). ``blocking`` times every exchange as blocking: each stage waits in it until its
    neighbours join it and its transfers end, then ``call_s`` more; with one chunk a rank Megatron-Core's exchanges
    (:func:`blocking_order`; docs/simulator.md, "Blocking exchanges"), over several Megatron-LM's interleaved
    schedule before Megatron-Core (:func:`interleaved_blocking_order`, "Blocking interleaved exchanges"); otherwise a
    transfer only delays the pass that needs it (Megatron-Core's interleaved schedule). ``gather_s``: the part of
    each ``p2p_s`` that only the receiver pays after a blocking exchange (Megatron-LM's all-gather of a received
    scatter/gather share): a blocking transfer lasts ``p2p_s`` less it, and the receiver pays it once per tensor it
    received, one after the other. ``nic_s``: per link, the seconds its transfer spends on the sending GPU's NIC
    (zero where the pair shares an NVLink domain); where a blocking exchange moves ``k`` tensors in one direction
    over the NIC at once (the interleaved schedule's sends to both neighbours), each of them lasts ``k - 1`` such
    shares longer (:func:`nic_sharing`; docs/simulator.md, "Exchanges that share a NIC"). ``keep_ops`` keeps every
    timed pass. Schedules with more than ``max_ops`` passes are extrapolated from two shorter ones (docs/simulator.md,
    "Long schedules"). ``schedule`` other than
    Megatron-Core's (one chunk a rank, not blocking): GPipe's order, or a zero-bubble one whose backward of each rank
    splits into B (``backward_s`` less ``weight_s[rank]``) and W (``weight_s[rank]``, default zero) passes
    (:func:`_run_zero_bubble`). Raises :class:`ScheduleError` on a deadlock.
    """
    pp, vpp = len(forward_s), len(forward_s[0])
    links = per_rank_links(p2p_s, pp)
    if schedule is not PipelineSchedule.megatron and (vpp != 1 or blocking):
        raise ValueError(f"the {schedule.value} schedule is timed with one chunk per rank and no blocking exchanges")
    num_ops = 2 * pp * vpp * microbatches
    busy = tuple(microbatches * (sum(forward_s[rank]) + sum(backward_s[rank])) for rank in range(pp))
    short_microbatches = 4 * pp + microbatches % pp
    zero_bubble = schedule in (PipelineSchedule.zb_h1, PipelineSchedule.zb_h2)
    if num_ops > max_ops and not keep_ops and microbatches > short_microbatches + pp and not zero_bubble:
        short = run_schedule(forward_s, backward_s, links, short_microbatches, blocking=blocking, call_s=call_s,
                             max_ops=num_ops, schedule=schedule, weight_s=weight_s, gather_s=gather_s, nic_s=nic_s)
        longer = run_schedule(forward_s, backward_s, links, short_microbatches + pp, blocking=blocking,
                              call_s=call_s, max_ops=num_ops, schedule=schedule, weight_s=weight_s,
                              gather_s=gather_s, nic_s=nic_s)
        steps = (microbatches - short_microbatches) / pp
        floors = dependency_floors(forward_s, backward_s, busy)
        ends = tuple(max(short_end + steps * (longer_end - short_end), floor)
                     for short_end, longer_end, floor in zip(short.end_s, longer.end_s, floors, strict=True))
        return ScheduleResult(end_s=ends, busy_s=busy, ops=(), simulated=False)
    if zero_bubble:
        return _run_zero_bubble([row[0] for row in forward_s], [row[0] for row in backward_s],
                                list(weight_s) if weight_s is not None else [0.0] * pp, links, microbatches,
                                (zero_bubble_limit(pp, microbatches, schedule),) * pp, busy, keep_ops)
    if blocking and pp > 1:
        return _run_blocking(tuple(map(tuple, forward_s)), tuple(map(tuple, backward_s)),
                             tuple(max(link - gather_s, 0.0) for link in links), microbatches, call_s, gather_s, busy,
                             keep_ops, None if nic_s is None else per_rank_links(nic_s, pp))
    gpipe = schedule is PipelineSchedule.gpipe
    # Each pass as indices into one array of pass ends (-1: not run yet; a cell at 0.0 stands for the first stage's
    # input), its link's and its own seconds (_pass_program: what it waits for, per rank).
    ends = [-1.0] * (2 * pp * vpp * microbatches) + [0.0]
    seconds = [(*forward_s[rank], *backward_s[rank]) for rank in range(pp)]
    links_or_none = (*links, 0.0)
    programs = [_pass_program(rank, pp, vpp, microbatches, gpipe) for rank in range(pp)]
    next_pass = [0] * pp  # index in its order of each rank's next pass
    free_s = [0.0] * pp  # when each rank finished its last timed pass
    ops: list[Op] = []
    remaining = sum(len(program) for program in programs)
    while remaining:
        progressed = False
        for rank in range(pp):
            program = programs[rank]
            index = next_pass[rank]
            clock_s = free_s[rank]
            rank_s = seconds[rank]
            count = len(program)
            while index < count:
                dep, link, out, own = program[index]
                dep_end_s = ends[dep]
                if dep_end_s < 0:
                    break
                ready_s = dep_end_s + links_or_none[link]  # + 0.0 (exact) where the pass waits for no link
                start_s = clock_s if clock_s > ready_s else ready_s
                clock_s = start_s + rank_s[own]
                ends[out] = clock_s
                if keep_ops:
                    is_fwd, microbatch, chunk = rank_order(rank, pp, vpp, microbatches, all_forward=gpipe)[index]
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


@functools.lru_cache(maxsize=4096)
def _pass_program(rank: int, pp: int, vpp: int, microbatches: int,
                  gpipe: bool) -> tuple[tuple[int, int, int, int], ...]:
    """:func:`rank_order` on ``rank`` as :func:`run_schedule`'s non-blocking loop walks it: per pass, the index of
    the pass end it waits for (a forward: the previous stage's forward of its micro-batch, the first stage's input
    cell at zero for the first stage; a backward: the next stage's backward, its own stage's forward on the last
    stage), of the link that end crosses (``pp``: none), of its own end, and of its seconds among the rank's
    (forwards by chunk, then backwards)."""
    num_stages = pp * vpp
    backward = num_stages * microbatches  # the backward ends follow the forward ones
    first_input = 2 * backward  # the cell at 0.0
    program = []
    for is_fwd, microbatch, chunk in rank_order(rank, pp, vpp, microbatches, all_forward=gpipe):
        stage = chunk * pp + rank
        if is_fwd:
            dep, link = ((first_input, pp) if stage == 0
                         else ((stage - 1) * microbatches + microbatch, (stage - 1) % pp))
            program.append((dep, link, stage * microbatches + microbatch, chunk))
        else:
            dep, link = ((stage * microbatches + microbatch, pp) if stage == num_stages - 1
                         else (backward + (stage + 1) * microbatches + microbatch, stage % pp))
            program.append((dep, link, backward + stage * microbatches + microbatch, vpp + chunk))
    return tuple(program)


@functools.lru_cache(maxsize=4096)
def _blocking_program(rank: int, pp: int, vpp: int, microbatches: int) -> tuple[tuple, ...]:
    """What :func:`_run_blocking` walks on ``rank``: :func:`blocking_order` (one chunk a rank) or
    :func:`interleaved_blocking_order`, as seven numbers an item: a pass as ``(is_forward, microbatch, chunk, -1, -1,
    -1, 0)``; an exchange over one link (one or two transfers, one chunk a rank) as ``(-1, link, mine, theirs, mine,
    theirs, received)`` with the slots of its transfers' two sides (its own and the neighbour's, :func:`_slot`; -1
    where it has one transfer; two on one link move in opposite directions); any other as ``(-2, transfers, -1, -1,
    -1, -1, received)``, per transfer ``(mine, theirs, link, sending)``. ``link`` indexes ``links``; ``received``
    counts the tensors the exchange receives."""
    order = (blocking_order(rank, pp, microbatches) if vpp == 1
             else interleaved_blocking_order(rank, pp, vpp, microbatches))
    program: list[tuple] = []
    for item in order:
        if isinstance(item, Exchange):
            transfers = [(_slot(transfer, sending, microbatches), _slot(transfer, not sending, microbatches),
                          transfer.boundary % pp, sending)
                         for sending, transfers in ((True, item.sends), (False, item.receives))
                         for transfer in transfers]
            received = len(item.receives)
            if len(transfers) == 1:
                mine, theirs, link, _ = transfers[0]
                program.append((-1, link, mine, theirs, -1, -1, received))
            elif len(transfers) == 2 and transfers[0][2] == transfers[1][2]:
                (mine, theirs, link, _), (mine2, theirs2, _, _) = transfers
                program.append((-1, link, mine, theirs, mine2, theirs2, received))
            else:
                program.append((-2, tuple(transfers), -1, -1, -1, -1, received))
        else:
            program.append((int(item[0]), item[1], item[2] if vpp > 1 else 0, -1, -1, -1, 0))
    return tuple(program)


def _slot(transfer: Transfer, sending: bool, microbatches: int) -> int:
    """Index of one side (the sender's or the receiver's) of ``transfer`` in :func:`_run_blocking`'s arrivals."""
    return ((transfer.boundary * microbatches + transfer.microbatch) * 2 + transfer.activation) * 2 + sending


def nic_sharing(programs: Sequence[tuple[tuple, ...]], nic_s: Sequence[float], slots: int) -> tuple[int, ...]:
    """Per side of each transfer in :func:`_run_blocking`'s ``programs`` (its slot, :func:`_slot`, of ``slots``):
    how many tensors the exchange that holds it moves over the NIC in that side's direction at once (its sends, or
    its receives, over links whose ``nic_s`` is positive); one where it moves only this one or none crosses a NIC.
    An exchange over one link holds at most one transfer each way (an InfiniBand NIC is full duplex: a send and a
    receive do not share it), so only the others can count more."""
    counts = [1] * slots
    for program in programs:
        for kind, value, *_ in program:
            if kind != -2:
                continue
            for sending in (True, False):
                sides = [mine for mine, _, link, way in value if way is sending and nic_s[link] > 0]
                for side in sides:
                    counts[side] = len(sides)
    return tuple(counts)


@functools.lru_cache(maxsize=1024)
def _run_blocking(forward_s: tuple[tuple[float, ...], ...], backward_s: tuple[tuple[float, ...], ...],
                  links: tuple[float, ...], microbatches: int, call_s: float, gather_s: float,
                  busy: tuple[float, ...], keep_ops: bool, nic_s: tuple[float, ...] | None = None) -> ScheduleResult:
    """:func:`run_schedule` with blocking exchanges: each rank runs :func:`_blocking_program`; a transfer ends
    ``links[boundary mod pp]`` after both its sender and its receiver reached the exchange that holds it (the
    transfers of an exchange move at once, each over its own direction of its link), and an exchange ends when its
    last transfer did (at once where it has none), plus ``call_s``, then ``gather_s`` for each tensor it received
    (the all-gathers after the synchronisation, on the rank's own stream). A transfer whose two sides move ``k``
    tensors over the NIC in its direction at once (the larger of the sender's and the receiver's
    :func:`nic_sharing`) lasts ``(k - 1) x nic_s[link]`` longer. A rank waits only for its neighbours
    (over model chunks rank 0 and rank ``pp - 1`` are neighbours too), so after a rank advances only they are tried
    again. Kept
    by its arguments (a frozen result): the validator's refits and sensitivities time the same schedule again
    wherever a changed efficiency leaves its passes as they were."""
    pp, vpp = len(forward_s), len(forward_s[0])
    programs = [_blocking_program(rank, pp, vpp, microbatches) for rank in range(pp)]
    neighbours = [sorted({(rank - 1) % pp, (rank + 1) % pp} - {rank}) if vpp > 1
                  else [other for other in (rank - 1, rank + 1) if 0 <= other < pp] for rank in range(pp)]
    reached = [-1.0] * (4 * pp * vpp * microbatches)  # when each side of each transfer reached its exchange
    shared = (nic_sharing(programs, nic_s, len(reached))
              if nic_s is not None and any(seconds > 0 for seconds in nic_s) else None)
    next_item = [0] * pp
    free_s = [0.0] * pp
    ops: list[Op] = []
    pending = deque(range(pp))
    queued = [True] * pp
    while pending:
        rank = pending.popleft()
        queued[rank] = False
        program = programs[rank]
        rank_forward_s, rank_backward_s = forward_s[rank], backward_s[rank]
        index = next_item[rank]
        clock_s = free_s[rank]
        length = len(program)
        while index < length:
            kind, value, mine, theirs, mine2, theirs2, received = program[index]
            if kind >= 0:  # a pass: value is its micro-batch, mine its chunk
                start_s = clock_s
                clock_s += rank_forward_s[mine] if kind else rank_backward_s[mine]
                if keep_ops:
                    ops.append(Op(rank=rank, forward=bool(kind), microbatch=value, chunk=mine, start_s=start_s,
                                  end_s=clock_s))
                index += 1
            elif kind == -1:  # one link, one or two transfers
                reached[mine] = clock_s
                other_s = reached[theirs]
                if mine2 >= 0:
                    reached[mine2] = clock_s
                    second_s = reached[theirs2]
                    if second_s < 0:
                        break
                    if second_s > other_s:
                        other_s = second_s
                if other_s < 0:  # the neighbour has not reached it yet
                    break
                # both transfers start when the later side arrived: one transfer's time after that
                clock_s = (clock_s if clock_s > other_s else other_s) + links[value] + call_s + received * gather_s
                if shared is not None:  # the neighbour's side may move others over its NIC at once
                    clock_s += (max(shared[theirs], shared[theirs2] if mine2 >= 0 else 1) - 1) * nic_s[value]
                index += 1
            else:  # any transfers, each over its own link: (mine, theirs, link, sending) each
                for side, *_ in value:
                    reached[side] = clock_s
                end_s = clock_s
                for side, other, link, _ in value:
                    other_s = reached[other]
                    if other_s < 0:
                        break
                    other_s = (clock_s if clock_s > other_s else other_s) + links[link]
                    if shared is not None:
                        other_s += (max(shared[side], shared[other]) - 1) * nic_s[link]
                    if other_s > end_s:
                        end_s = other_s
                else:
                    clock_s = end_s + call_s + received * gather_s
                    index += 1
                    continue
                break
        if index != next_item[rank]:
            next_item[rank] = index
            free_s[rank] = clock_s
            for neighbour in neighbours[rank]:
                if not queued[neighbour]:
                    pending.append(neighbour)
                    queued[neighbour] = True
    if any(index < len(program) for index, program in zip(next_item, programs, strict=True)):
        raise ScheduleError(f"pipeline schedule deadlocked (pp={pp}, vpp={vpp}, blocking, "
                            f"microbatches={microbatches})")
    return ScheduleResult(end_s=tuple(free_s), busy_s=busy, ops=tuple(ops), simulated=True)


def _run_zero_bubble(forward_s: list[float], backward_s: list[float], weight_s: list[float], links: tuple[float, ...],
                     microbatches: int, limits: tuple[int, ...], busy: tuple[float, ...], keep_ops: bool
                     ) -> ScheduleResult:
    """:func:`run_schedule` of a zero-bubble schedule, event by event: each rank, whenever it is free, runs the B pass
    of its oldest micro-batch whose gradient has arrived, else the forward of the next micro-batch where its input
    has arrived and it holds fewer than ``limits[rank]`` micro-batches (forwards whose W has not run), else a
    pending W pass (the oldest), else waits for an arrival. A B pass takes ``backward_s - weight_s`` and sends its
    gradient on at once; W (``weight_s``) only frees the micro-batch. The runtime validates the optimizer step after
    it instead of synchronising the stages before it, so each rank's next step follows its own last pass and the
    steps tile: each rank's times are counted from its first pass (its end is its span; docs/simulator.md,
    "Zero-bubble schedules")."""
    pp = len(forward_s)
    b_s = [max(total - weight, 0.0) for total, weight in zip(backward_s, weight_s, strict=True)]
    forward_end = [[-1.0] * microbatches for _ in range(pp)]
    b_end = [[-1.0] * microbatches for _ in range(pp)]
    done_f, done_b, done_w = [0] * pp, [0] * pp, [0] * pp
    free_s = [0.0] * pp
    first_s: list[float | None] = [None] * pp
    ops: list[Op] = []
    events = [(0.0, rank) for rank in range(pp)]  # (time, rank): the rank may start something then
    while events:
        now, rank = heapq.heappop(events)
        if now < free_s[rank]:  # busy until its own completion, which is an event too
            continue
        kind = -1  # 0 forward, 1 B, 2 W
        if done_b[rank] < done_f[rank]:
            index = done_b[rank]
            ready = (forward_end[rank][index] if rank == pp - 1 else
                     b_end[rank + 1][index] + links[rank] if b_end[rank + 1][index] >= 0 else None)
            if ready is not None and ready <= now:
                kind = 1
        if kind < 0 and done_f[rank] < microbatches and done_f[rank] - done_w[rank] < limits[rank]:
            index = done_f[rank]
            ready = (0.0 if rank == 0 else
                     forward_end[rank - 1][index] + links[rank - 1] if forward_end[rank - 1][index] >= 0 else None)
            if ready is not None and ready <= now:
                kind = 0
        if kind < 0 and done_w[rank] < done_b[rank]:
            kind = 2
        if kind < 0:
            continue  # an arrival wakes it
        if first_s[rank] is None:
            first_s[rank] = now
        counts = (done_f, done_b, done_w)[kind]
        index = counts[rank]
        counts[rank] += 1
        end = now + (forward_s[rank], b_s[rank], weight_s[rank])[kind]
        free_s[rank] = end
        heapq.heappush(events, (end, rank))
        if kind == 0:
            forward_end[rank][index] = end
            if rank < pp - 1:
                heapq.heappush(events, (end + links[rank], rank + 1))
        elif kind == 1:
            b_end[rank][index] = end
            if rank > 0:
                heapq.heappush(events, (end + links[rank - 1], rank - 1))
        if keep_ops:  # W is drawn as a backward pass of its micro-batch
            ops.append(Op(rank=rank, forward=kind == 0, microbatch=index, chunk=0, start_s=now, end_s=end))
    if any(count < microbatches for count in (*done_f, *done_b, *done_w)):
        raise ScheduleError(f"pipeline schedule deadlocked (pp={pp}, zero bubble, microbatches={microbatches})")
    starts = [start or 0.0 for start in first_s]
    ops = [dataclasses.replace(op, start_s=op.start_s - starts[op.rank], end_s=op.end_s - starts[op.rank])
           for op in ops]
    return ScheduleResult(end_s=tuple(end - start for end, start in zip(free_s, starts, strict=True)), busy_s=busy,
                          ops=tuple(ops), simulated=True)
