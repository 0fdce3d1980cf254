"""Megatron-LM's interleaved schedule before Megatron-Core, as it ran (megatron/schedules.py and
p2p_communication.py of 2021): every exchange blocks and is followed by a device synchronisation, and each step of
the steady state exchanges with both neighbours at once; Megatron-Core's asynchronous interleaved schedule is priced
as before (docs/simulator.md, "Blocking interleaved exchanges")."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from cfp_megatron.sim.schedule import Exchange, Transfer, interleaved_blocking_order, rank_order, run_schedule

EQUAL = [[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2  # pp 2, vp 2: forward 1 s, backward 2 s a chunk


def test_two_stages_two_chunks_four_micro_batches_by_hand() -> None:
    """pp 2, vp 2, 4 micro-batches; stages 0-3 are rank 0 chunk 0, rank 1 chunk 0, rank 0 chunk 1, rank 1 chunk 1.
    Rank 0 warms up with 4 forwards, rank 1 with 2; every exchange of rank 0 after its k-th pass group meets
    exchange k - 1 of rank 1 (its first is recv_forward), so the two ranks leave each exchange together and each
    of the 11 pairs adds its slowest transfer and the synchronisation c. The work between pairs is max(rank 0's,
    rank 1's): F|-, F|F, F|F, F|FB, FB|FB x 4, B|FB, B|B, B|B = 1 + 1 + 1 + 3 + 12 + 3 + 2 + 2 = 25, then rank 0's
    last backward and its last (empty) exchange: 27. Tensors across stages 0-1 and 2-3 cross link 0 (x0), across
    1-2 link 1 (x1); pairs 1 (activation 0 -> 1), 4 and 8 (activation 2 -> 3, gradient 3 -> 2) and 11 (gradient
    1 -> 0) cross link 0 only, the 7 others link 1 too."""
    x0, x1, c = 0.1, 0.3, 0.05
    blocked = run_schedule(*EQUAL, (x0, x1), 4, blocking=True, call_s=c)
    links = 4 * x0 + 7 * max(x0, x1)
    assert blocked.end_s == pytest.approx((27 + links + 12 * c, 25 + links + 11 * c))
    # the same with one link and no synchronisation: 11 exchanges on rank 0's critical path
    assert run_schedule(*EQUAL, 0.25, 4, blocking=True).end_s == pytest.approx((27 + 11 * 0.25, 25 + 11 * 0.25))


def test_megatron_cores_asynchronous_interleaved_schedule_is_unchanged_by_hand() -> None:
    """The same passes with Megatron-Core's exchanges (a transfer only delays the pass that needs it), x = 0.25:
    rank 0's last backward waits for rank 1's, which waited for rank 0's: 27 + 6x; rank 1 ends at 25 + 5x."""
    x = 0.25
    assert run_schedule(*EQUAL, x, 4).end_s == pytest.approx((27 + 6 * x, 25 + 5 * x))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 2), (2, 3, 6), (3, 2, 3), (4, 3, 8), (4, 2, 20), (5, 4, 10), (8, 2, 24)])
def test_every_transfer_is_sent_once_and_received_once_by_its_neighbour(pp: int, vpp: int, m: int) -> None:
    """The order transcribed from megatron/schedules.py runs rank_order's passes, and its receives, identified by
    the schedule's own bookkeeping (a chunk's tensors arrive in micro-batch order), meet every send once: each
    activation across each pair of stages and each gradient back, once per micro-batch."""
    sent, received = Counter(), Counter()
    for rank in range(pp):
        order = interleaved_blocking_order(rank, pp, vpp, m)
        assert [item for item in order if not isinstance(item, Exchange)] == list(rank_order(rank, pp, vpp, m))
        for item in order:
            if isinstance(item, Exchange):
                for transfer in item.sends:
                    sent[transfer] += 1
                    assert rank == (transfer.boundary + (0 if transfer.activation else 1)) % pp
                for transfer in item.receives:
                    received[transfer] += 1
                    assert rank == (transfer.boundary + (1 if transfer.activation else 0)) % pp
    every = Counter(Transfer(activation, boundary, microbatch) for activation in (True, False)
                    for boundary in range(pp * vpp - 1) for microbatch in range(m))
    assert sent == every == received


def test_the_schedule_asserts_its_micro_batch_groups() -> None:
    with pytest.raises(ValueError, match="groups of pp"):
        interleaved_blocking_order(0, 4, 2, 6)


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 3, 8), (8, 2, 16), (3, 4, 9)])
def test_equal_stages_without_exchange_time_keep_the_interleaved_bubble(pp: int, vpp: int, m: int) -> None:
    """Lock-step costs nothing where every pass of a step is as long as the others: the bubble stays
    (pp - 1) / vp passes of a rank, as without blocking."""
    f, b = [[1.0 / vpp] * vpp] * pp, [[2.0 / vpp] * vpp] * pp
    expected = m * 3.0 + (pp - 1) * 3.0 / vpp
    assert max(run_schedule(f, b, 0.0, m, blocking=True).end_s) == pytest.approx(expected)
    assert max(run_schedule(f, b, 0.0, m).end_s) == pytest.approx(expected)


def both(f: list[list[float]], b: list[list[float]], x: float, m: int) -> tuple[float, float]:
    """The step of the blocking and of the asynchronous interleaved schedule."""
    return max(run_schedule(f, b, x, m, blocking=True).end_s), max(run_schedule(f, b, x, m).end_s)


def test_the_lock_step_ties_each_step_to_its_slowest_pass() -> None:
    """Exchanging with both neighbours each step ties every rank to the slowest pass of the step. One rank heavier
    in every step (the last rank's last chunk holding the logits) paces both schedules alike; heavier passes on
    two ranks in different steps (the first rank's embedding backward too) cost the lock-step each steady-state
    group (all in the warm-up, m = pp: nothing): with free exchanges the blocking schedule is then slower, and never
    faster than the asynchronous one."""
    for pp, vpp, groups, x in itertools.product((2, 4, 8), (2, 3), (1, 3), (0.0, 0.05)):
        f = [[0.3] * vpp for _ in range(pp)]
        b = [[0.7] * vpp for _ in range(pp)]
        f[-1][-1] += 0.25
        one = both(f, b, x, groups * pp)
        b[0][0] += 0.25
        two = both(f, b, x, groups * pp)
        assert one[0] >= one[1] - 1e-9 and two[0] >= two[1] - 1e-9
        if x == 0.0:
            assert one[0] == pytest.approx(one[1])
            assert two[0] > two[1] + 0.1 if groups > 1 else two[0] == pytest.approx(two[1])


@pytest.mark.parametrize("pp,vpp,m", [(4, 3, 64), (3, 2, 60)])
def test_long_blocking_interleaved_schedules_extrapolate_exactly(pp: int, vpp: int, m: int) -> None:
    f = [[0.3] * vpp for _ in range(pp)]
    b = [[0.7] * vpp for _ in range(pp)]
    f[-1][-1] += 0.25
    full = run_schedule(f, b, 0.05, m, blocking=True, call_s=0.01)
    short = run_schedule(f, b, 0.05, m, blocking=True, call_s=0.01, max_ops=1)
    assert full.simulated and not short.simulated
    assert short.end_s == pytest.approx(full.end_s, rel=1e-9)



def test_each_received_share_is_gathered_one_after_the_other_by_hand() -> None:
    """Megatron-LM's _communicate all-gathers each received scatter/gather share after the synchronisation, one after
    the other, on the receiving rank alone. The pp 2, vp 2, 4 micro-batch schedule of the first test with exchanges
    that are all the receiver's gather g (transfers of no time): after each of the 11 pairs each rank gathers what it
    received (rank 0 | rank 1: 0|1, 1|1, 1|1, 1|1, 1|2, 2|2, 2|1, 1|1, 1|1, 1|1, 1|0; the steady state receives from
    both neighbours) and the next pair waits for the longer work, or for both gathers where the work is equal (F|F,
    FB|FB, B|B): 1, 1, 1 (F|FB), 1, 2, 2, 2, 1 (B|FB), 1, 1 = 13 g before the last pair, where rank 1 ends; rank 0
    then gathers 1 more. With g inside the transfer both ranks pay one g per pair: 11 g."""
    g = 0.01
    received = [[len(item.receives) for item in interleaved_blocking_order(rank, 2, 2, 4)
                 if isinstance(item, Exchange)] for rank in range(2)]
    assert received == [[0, 1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 0], [1, 1, 1, 1, 2, 2, 1, 1, 1, 1, 0]]
    assert run_schedule(*EQUAL, g, 4, blocking=True, gather_s=g).end_s == pytest.approx((27 + 14 * g, 25 + 13 * g))
    assert run_schedule(*EQUAL, g, 4, blocking=True).end_s == pytest.approx((27 + 11 * g, 25 + 11 * g))
