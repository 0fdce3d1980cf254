"""The collectives round: every :class:`Collective` over every group pattern at several message sizes."""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from cfp_megatron.cluster.measured import Collective, Span
from cfp_megatron.engine import rank_watch
from cfp_megatron.profile.control import Step, StepResult, timed
from cfp_megatron.profile.errors import ProfileError
from cfp_megatron.profile.fit import fit_collective
from cfp_megatron.profile.records import CollectiveRecord, collective_entry

CPU_SIZES = tuple(4 << (2 * i) for i in range(5, 11))
"""Message bytes timed under gloo: 4 KiB ... 4 MiB (x4 apart)."""
GPU_SIZES = tuple(1 << s for s in range(16, 29, 2))
"""Message bytes timed under NCCL: 64 KiB ... 256 MiB (x4 apart)."""


@dataclass(frozen=True, kw_only=True)
class GroupPattern:
    """How the world is cut into equal groups for one measurement; all groups run at once."""

    size: int
    """Ranks per group."""
    span: Span
    """Within a node or across nodes."""
    layout: str
    """``contiguous`` (ranks ``[i*g, (i+1)*g)``) or ``strided`` (ranks ``j, j + W/g, ...``)."""
    groups: tuple[tuple[int, ...], ...]
    """The groups, as global ranks."""


def _span(group: Sequence[int], per_node: int) -> Span:
    return Span.intra_node if len({r // per_node for r in group}) == 1 else Span.inter_node


def group_patterns(world: int, nodes: int) -> list[GroupPattern]:
    """Group patterns to measure: sizes 2, 4, ... up to the world (and the world itself); contiguous groups, and
    strided ones where they span nodes. One pattern per (size, span), sorted by size."""
    per_node = max(world // max(nodes, 1), 1)
    sizes, g = [], 2
    while g <= world:
        if world % g == 0:
            sizes.append(g)
        g *= 2
    if world > 1 and world not in sizes:
        sizes.append(world)
    found: dict[tuple[int, Span], GroupPattern] = {}
    for size in sizes:
        count = world // size
        contiguous = tuple(tuple(range(i * size, (i + 1) * size)) for i in range(count))
        strided = tuple(tuple(range(j, world, count)) for j in range(count))
        for layout, groups in (("contiguous", contiguous), ("strided", strided)):
            spans = {_span(grp, per_node) for grp in groups}
            if len(spans) != 1:
                continue
            span = spans.pop()
            found.setdefault((size, span), GroupPattern(size=size, span=span, layout=layout, groups=groups))
    return sorted(found.values(), key=lambda p: (p.size, p.span.value))


def repeats_for(message_bytes: int, *, on_gpu: bool) -> int:
    """Timed calls per size: more for small messages (deterministic, so every rank agrees)."""
    budget = (1 << 30) if on_gpu else (4 << 20)
    return max(2, min(10, budget // max(message_bytes, 1)))


class CollectiveBench:
    """Tensors and groups for timing the collectives of one pattern on this rank."""

    def __init__(self, pattern: GroupPattern, dtype: torch.dtype, device: torch.device) -> None:
        self.pattern = pattern
        self.dtype = dtype
        self.device = device
        rank = dist.get_rank()
        self.group: dist.ProcessGroup | None = None
        self.ranks: tuple[int, ...] = ()
        if pattern.size == dist.get_world_size():
            self.group, self.ranks = dist.group.WORLD, pattern.groups[0]
        else:
            for ranks in pattern.groups:  # every rank creates every group, in the same order
                group = dist.new_group(list(ranks), timeout=datetime.timedelta(seconds=rank_watch.timeout_s()))
                if rank in ranks:
                    self.group, self.ranks = group, ranks
        if self.group is None:
            raise ProfileError(f"rank {rank} is in no group of {pattern}.")

    def _elements(self, message_bytes: int) -> int:
        per = torch.empty((), dtype=self.dtype).element_size()
        g = self.pattern.size
        return max(message_bytes // per // g, 1) * g

    def call(self, op: Collective, message_bytes: int) -> tuple[int, object]:
        """(actual message bytes, a function doing one call) for ``op`` with a message of about ``message_bytes``."""
        n = self._elements(message_bytes)
        g, group = self.pattern.size, self.group
        per = torch.empty((), dtype=self.dtype).element_size()
        make = lambda count: torch.ones(count, dtype=self.dtype, device=self.device)  # noqa: E731
        if op is Collective.all_reduce:
            buf = make(n)
            return n * per, lambda: dist.all_reduce(buf, group=group)
        if op is Collective.all_gather:
            out, inp = make(n), make(n // g)
            return n * per, lambda: dist.all_gather_into_tensor(out, inp, group=group)
        if op is Collective.reduce_scatter:
            inp, out = make(n), make(n // g)
            return n * per, lambda: dist.reduce_scatter_tensor(out, inp, group=group)
        if op is Collective.all_to_all:
            inp, out = make(n), make(n)
            return n * per, lambda: dist.all_to_all_single(out, inp, group=group)
        if op is Collective.send_recv:
            # A ring shift inside each group, as pipeline stages pass activations: send to the next, receive from
            # the previous (batched, as Megatron's p2p communication does).
            me = self.ranks.index(dist.get_rank())
            nxt, prv = self.ranks[(me + 1) % g], self.ranks[(me - 1) % g]
            send, recv = make(n), make(n)

            def shift() -> None:
                ops = [dist.P2POp(dist.isend, send, nxt, group), dist.P2POp(dist.irecv, recv, prv, group)]
                for req in dist.batch_isend_irecv(ops):
                    req.wait()

            return n * per, shift
        raise ProfileError(f"unknown collective {op!r}")


def _setup_label(pattern: GroupPattern) -> str:
    return f"groups of {pattern.size} ({pattern.span.value}, {pattern.layout})"


def collective_steps(world: int, nodes: int, *, on_gpu: bool, dtype: torch.dtype, device: torch.device,
                     repeats: int | None = None
                     ) -> tuple[list[Step], dict[str, tuple[Collective, GroupPattern, int]], Callable[[], None]]:
    """The round's steps (group set-up first, then the smallest and largest size of every collective on every
    pattern, then the sizes between, so a short budget still yields a fit for each), what each timing step
    measures, by label, and a function that destroys the groups the steps created (call it after the round: left
    alive they would slow the later rounds). ``repeats``: timed calls per size (``cfp.profile_repeats``; ``None``:
    :func:`repeats_for`'s)."""
    sizes = GPU_SIZES if on_gpu else CPU_SIZES
    patterns = group_patterns(world, nodes)
    benches: dict[int, CollectiveBench] = {}
    steps: list[Step] = []
    meaning: dict[str, tuple[Collective, GroupPattern, int]] = {}
    for i, pattern in enumerate(patterns):
        def setup(i: int = i, pattern: GroupPattern = pattern) -> list[float]:
            benches[i] = CollectiveBench(pattern, dtype, device)
            return []

        steps.append(Step(label=_setup_label(pattern), run=setup))
    order = [sizes[0], sizes[-1], *sizes[1:-1]]
    for size_index, size in enumerate(order):
        for i, pattern in enumerate(patterns):
            for op in Collective:
                label = collective_entry(op, pattern.size, pattern.span, size)

                def measure(i: int = i, op: Collective = op, size: int = size) -> list[float]:
                    bench = benches[i]
                    actual, fn = bench.call(op, size)
                    seconds = timed(fn, repeats=repeats or repeats_for(size, on_gpu=on_gpu), warmup=2,
                                    group=bench.group)
                    return [seconds, float(actual)]

                steps.append(Step(label=label, run=measure, entry=label, needs=_setup_label(pattern)))
                meaning[label] = (op, patterns[i], size_index)
    def release() -> None:
        for bench in benches.values():
            if bench.group is not dist.group.WORLD:
                dist.destroy_process_group(bench.group)
        benches.clear()

    return steps, meaning, release


def fit_results(results: Sequence[StepResult],
                meaning: dict[str, tuple[Collective, GroupPattern, int]],
                prior: Sequence[CollectiveRecord] = ()) -> tuple[list[CollectiveRecord], list[str]]:
    """One fit per (collective, pattern) with two or more sizes timed (with the samples of ``prior`` records of an
    earlier run at the sizes this run did not time: a size timed again replaces its old sample); and what could not
    be fitted, with why."""
    samples: dict[tuple[Collective, int, Span], list[tuple[int, float]]] = {}
    layouts = {(rec.fit.op, rec.fit.group_size, rec.fit.span): rec.pattern for rec in prior}
    for res in results:
        if res.label not in meaning:
            continue
        op, pattern, _ = meaning[res.label]
        seconds, actual = res.values
        key = (op, pattern.size, pattern.span)
        samples.setdefault(key, []).append((int(actual), seconds))
        layouts[key] = pattern.layout
    for rec in prior:
        key = (rec.fit.op, rec.fit.group_size, rec.fit.span)
        timed = {size for size, _ in samples.get(key, [])}
        samples.setdefault(key, []).extend(point for point in rec.samples if point[0] not in timed)
    records, missing = [], []
    for key in sorted({(op, p.size, p.span) for op, p, _ in meaning.values()}, key=lambda k: (k[0].value, k[1],
                                                                                               k[2].value)):
        points = sorted(samples.get(key, []))
        try:
            fit = fit_collective(key[0], key[1], key[2], points)
        except ProfileError as err:
            missing.append(str(err))
            continue
        records.append(CollectiveRecord(fit=fit, samples=tuple(points), pattern=layouts[key]))
    return records, missing
