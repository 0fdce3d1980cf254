"""Pipeline schedules: order, bubbles, closed form."""

from __future__ import annotations

import random

import pytest

from cfp_megatron.sim.options import PipelineSchedule
from cfp_megatron.sim.schedule import first_backward, rank_order, run_schedule


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (8, 8), (4, 1), (3, 7)])
def test_1f1b_bubble_matches_formula(pp: int, m: int) -> None:
    f, b = 1.0, 2.0
    res = run_schedule([[f]] * pp, [[b]] * pp, 0.0, m)
    assert res.simulated
    end = max(res.end_s)
    assert end == pytest.approx((m + pp - 1) * (f + b))
    bubble = (end - res.busy_s[0]) / end
    assert bubble == pytest.approx((pp - 1) / (m + pp - 1))


@pytest.mark.parametrize("pp,vpp,m", [(2, 2, 4), (4, 2, 8), (4, 3, 8), (4, 2, 4)])
def test_interleaved_bubble_is_smaller(pp: int, vpp: int, m: int) -> None:
    f, b = 1.0, 2.0
    plain = max(run_schedule([[f]] * pp, [[b]] * pp, 0.0, m).end_s)
    inter = run_schedule([[f / vpp] * vpp] * pp, [[b / vpp] * vpp] * pp, 0.0, m)
    end = max(inter.end_s)
    assert end < plain
    # Megatron's interleaved bubble: (p - 1) / vpp micro-batch times.
    assert end == pytest.approx((m + (pp - 1) / vpp) * (f + b))


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 8), (4, 2, 8), (3, 1, 5), (2, 3, 4)])
def test_every_pass_runs_once_in_dependency_order(pp: int, vpp: int, m: int) -> None:
    res = run_schedule([[1.0] * vpp] * pp, [[2.0] * vpp] * pp, 0.1, m, keep_ops=True)
    assert len(res.ops) == 2 * pp * vpp * m
    fend = {(op.chunk * pp + op.rank, op.microbatch): op.end_s for op in res.ops if op.forward}
    for op in res.ops:
        g = op.chunk * pp + op.rank
        if op.forward and g > 0:
            assert op.start_s >= fend[(g - 1, op.microbatch)] + 0.1 - 1e-9
    for r in range(pp):
        mine = sorted((op for op in res.ops if op.rank == r), key=lambda o: o.start_s)
        assert all(a.end_s <= b.start_s + 1e-9 for a, b in zip(mine, mine[1:], strict=False))
        assert len(rank_order(r, pp, vpp, m)) == 2 * vpp * m


def test_p2p_lengthens_fill_and_drain() -> None:
    base = max(run_schedule([[1.0]] * 4, [[2.0]] * 4, 0.0, 8).end_s)
    slow = max(run_schedule([[1.0]] * 4, [[2.0]] * 4, 0.5, 8).end_s)
    assert slow >= base + 2 * 3 * 0.5 - 1e-9


@pytest.mark.parametrize("pp,vpp,m", [(4, 1, 64), (8, 1, 96), (4, 2, 64), (3, 1, 50)])
@pytest.mark.parametrize("p2p", [0.0, 0.1])
def test_extrapolated_schedule_matches_simulation(pp: int, vpp: int, m: int, p2p: float) -> None:
    """Stages that differ only by the embedding (first) and the head (last), with and without send/receive time:
    the extrapolation from two shorter schedules equals the full event-by-event timing on every rank."""
    f = [[0.3] * vpp for _ in range(pp)]
    b = [[0.7] * vpp for _ in range(pp)]
    f[0][0] += 0.1
    b[-1][-1] += 0.25
    sim = run_schedule(f, b, p2p, m)
    short = run_schedule(f, b, p2p, m, max_ops=1)
    assert sim.simulated and not short.simulated
    assert short.end_s == pytest.approx(sim.end_s, rel=1e-9)
    assert short.busy_s == sim.busy_s


def test_shared_cores_count_each_stages_exchanges_per_micro_batch_and_chunk() -> None:
    """On shared cores the mean stage's timeline (passes plus two blocking exchanges per micro-batch and chunk)
    bounds the schedule; without exchanges (p2p 0) it is the mean busy time, and the dependency chain at a lone
    rank's speed bounds it from below too."""
    from cfp_megatron.sim.options import SimOptions
    from cfp_megatron.sim.terms.pipeline import shared_cores_schedule as shared_cores

    f_s, b_s = [[1.0, 1.0], [1.0, 1.0]], [[2.0, 2.0], [2.0, 2.0]]  # pp 2, vpp 2
    m, p2p, slowdown = 8, 0.25, 2.0
    quiet = shared_cores(f_s, b_s, 0.0, m, slowdown, False, SimOptions())
    assert max(quiet.end_s) == pytest.approx(m * 6.0)
    loaded = shared_cores(f_s, b_s, p2p, m, slowdown, False, SimOptions())
    assert max(loaded.end_s) == pytest.approx(m * 6.0 + 2 * m * 2 * p2p)
    assert loaded.busy_s == quiet.busy_s
    # One micro-batch over 4 stages: the fill and drain at a lone rank's speed bind, and a lone pair of ranks
    # exchanges at that speed too: 4 forwards (0.5) + 4 backwards (1.0) + 6 exchanges (0.5) on the first stage.
    lone = shared_cores([[1.0]] * 4, [[2.0]] * 4, 1.0, 1, 2.0, False, SimOptions())
    assert lone.end_s[0] == pytest.approx(4 * 0.5 + 4 * 1.0 + 6 * 0.5)


# GPipe and the zero-bubble schedules (docs/simulator.md, "Zero-bubble schedules"): forward, input-gradient (B) and
# weight-gradient (W) passes of one time unit each, as the zero-bubble paper's bubbles assume.


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8), (3, 7)])
def test_gpipe_has_1f1bs_bubble_on_equal_stages(pp: int, m: int) -> None:
    res = run_schedule([[1.0]] * pp, [[2.0]] * pp, 0.0, m, schedule=PipelineSchedule.gpipe, keep_ops=True)
    assert max(res.end_s) == pytest.approx((m + pp - 1) * 3.0)
    last = [op for op in res.ops if op.rank == pp - 1]
    assert all(op.forward for op in last[:m]) and not any(op.forward for op in last[m:])  # every forward first


def _zero_bubble(pp: int, m: int, schedule: PipelineSchedule, link: float = 0.0):
    return run_schedule([[1.0]] * pp, [[2.0]] * pp, link, m, schedule=schedule, weight_s=[1.0] * pp, keep_ops=True)


def _held(ops, rank: int) -> int:
    """Most micro-batches ``rank`` held at once: forwards run whose W (a micro-batch's second backward-side pass)
    had not."""
    seen: dict[int, int] = {}
    held = peak = 0
    for op in sorted((op for op in ops if op.rank == rank), key=lambda op: op.start_s):
        if op.forward:
            held += 1
        else:
            seen[op.microbatch] = seen.get(op.microbatch, 0) + 1
            held -= seen[op.microbatch] == 2
        peak = max(peak, held)
    return peak


@pytest.mark.parametrize("pp,m", [(4, 8), (4, 12), (8, 24), (8, 64)])
def test_zb_h2_leaves_no_bubble_and_holds_at_most_twice_1f1bs(pp: int, m: int) -> None:
    """ZB-H2 with equal passes: every rank busy from its first pass to its last (the steps tile, the optimizer
    validated after them), at most 2 pp micro-batches held."""
    res = _zero_bubble(pp, m, PipelineSchedule.zb_h2)
    assert max(res.end_s) == pytest.approx(3.0 * m)
    assert all(_held(res.ops, rank) <= 2 * pp for rank in range(pp))
    assert len(res.ops) == 3 * pp * m


@pytest.mark.parametrize("pp,m", [(4, 8), (8, 24), (16, 48)])
def test_zb_h1_keeps_1f1bs_memory_and_a_bubble_between_the_papers_and_1f1bs(pp: int, m: int) -> None:
    """ZB-H1's bubble is (pp - 1)(F + B - W) = pp - 1 passes in the paper's hand-made order; the greedy order under
    the same memory limit lies between that and 1F1B's 3 (pp - 1), holding no more than 1F1B's first stage."""
    res = _zero_bubble(pp, m, PipelineSchedule.zb_h1)
    bubble = max(res.end_s) - 3.0 * m
    assert pp - 1 <= bubble + 1e-9 < 3 * (pp - 1)
    assert all(_held(res.ops, rank) <= pp for rank in range(pp))


def test_zero_bubble_exchanges_delay_the_schedule() -> None:
    assert max(_zero_bubble(4, 8, PipelineSchedule.zb_h2, 0.1).end_s) > max(_zero_bubble(4, 8,
                                                                                         PipelineSchedule.zb_h2).end_s)


def test_other_schedules_refuse_chunks_and_blocking() -> None:
    with pytest.raises(ValueError, match="one chunk per rank"):
        run_schedule([[1.0, 1.0]] * 2, [[2.0, 2.0]] * 2, 0.0, 4, schedule=PipelineSchedule.zb_h1)


@pytest.mark.parametrize("vpp", [1, 2, 3])
def test_first_backward_is_where_rank_order_puts_it(vpp: int) -> None:
    """first_backward names the position of each rank's first backward in rank_order (its length without one), over
    warm-ups shorter than, as long as and longer than the micro-batches."""
    for pp in (1, 2, 4, 8):
        for microbatches in (0, 1, 2, pp, pp + 1, 3 * pp):
            for rank in range(pp):
                order = rank_order(rank, pp, vpp, microbatches)
                expected = next((i for i, (forward, _, _) in enumerate(order) if not forward), len(order))
                assert first_backward(rank, pp, vpp, microbatches) == expected, (rank, pp, vpp, microbatches)


def _reference_run(forward_s, backward_s, links, microbatches, gpipe):
    """The non-blocking schedule as timed pass by pass over per-stage tables (what ``run_schedule`` computes)."""
    pp, vpp = len(forward_s), len(forward_s[0])
    num_stages = pp * vpp
    forward_end = [[-1.0] * microbatches for _ in range(num_stages)]
    backward_end = [[-1.0] * microbatches for _ in range(num_stages)]
    orders = [rank_order(rank, pp, vpp, microbatches, all_forward=gpipe) for rank in range(pp)]
    next_pass, free_s, ops = [0] * pp, [0.0] * pp, []
    remaining = sum(len(order) for order in orders)
    while remaining:
        for rank in range(pp):
            order, index, clock_s = orders[rank], next_pass[rank], free_s[rank]
            while index < len(order):
                is_fwd, microbatch, chunk = order[index]
                stage = chunk * pp + rank
                if is_fwd:
                    if stage == 0:
                        ready_s = 0.0
                    elif forward_end[stage - 1][microbatch] < 0:
                        break
                    else:
                        ready_s = forward_end[stage - 1][microbatch] + links[(stage - 1) % pp]
                    clock_s = max(clock_s, ready_s) + forward_s[rank][chunk]
                    forward_end[stage][microbatch] = clock_s
                else:
                    if stage == num_stages - 1:
                        ready_s = forward_end[stage][microbatch]
                    elif backward_end[stage + 1][microbatch] < 0:
                        break
                    else:
                        ready_s = backward_end[stage + 1][microbatch] + links[stage % pp]
                    clock_s = max(clock_s, ready_s) + backward_s[rank][chunk]
                    backward_end[stage][microbatch] = clock_s
                ops.append((rank, is_fwd, microbatch, chunk, clock_s))
                index += 1
            remaining -= index - next_pass[rank]
            next_pass[rank], free_s[rank] = index, clock_s
    return tuple(free_s), ops


@pytest.mark.parametrize("seed", range(20))
def test_the_schedule_loop_times_every_pass_as_the_per_stage_tables_do(seed: int) -> None:
    """``run_schedule``'s loop over its pass programs (``_pass_program``) gives every rank's end and every pass's
    end to the bit of the same schedule timed over per-stage tables, interleaved or not, GPipe's too, one link
    time or one per rank."""
    rng = random.Random(seed)
    pp, vpp = rng.choice([2, 3, 4]), rng.choice([1, 2, 3])
    microbatches = pp * rng.choice([1, 2, 3]) if vpp > 1 else rng.choice([1, 3, 5, 8])
    gpipe = vpp == 1 and rng.random() < 0.3
    forward_s = [[rng.uniform(0.1, 2.0) for _ in range(vpp)] for _ in range(pp)]
    backward_s = [[rng.uniform(0.1, 4.0) for _ in range(vpp)] for _ in range(pp)]
    links = tuple(rng.uniform(0.0, 0.5) for _ in range(pp))
    found = run_schedule(forward_s, backward_s, links, microbatches, keep_ops=True,
                         schedule=PipelineSchedule.gpipe if gpipe else PipelineSchedule.megatron)
    ends, ops = _reference_run(forward_s, backward_s, links, microbatches, gpipe)
    assert found.end_s == ends
    assert [(op.rank, op.forward, op.microbatch, op.chunk, op.end_s) for op in found.ops] == ops
    assert run_schedule(forward_s, backward_s, links, microbatches,
                        schedule=PipelineSchedule.gpipe if gpipe else PipelineSchedule.megatron).end_s == ends
