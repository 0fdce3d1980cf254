"""The one search driver every backend's space runs on: best-first over lower bounds, the k fastest plans that fit.

A space hands the driver queue entries ``(bound, kind, item, extra)``: a :data:`GROUP` entry stands for several
candidates whose step times are all at least ``bound`` and is expanded (:meth:`SearchSpace.expand`) when it reaches
the head of the queue; a :data:`CANDIDATE` entry is evaluated (:meth:`SearchSpace.evaluate`: memory, then the
simulator). Entries leave the queue in increasing ``(bound, kind, item)`` order, and the visit stops at the first
bound above the k-th best step time found: every later candidate is provably slower. A space without bounds (bound
0 for every candidate) is searched exhaustively. Ties are broken by the outcome's ``tie`` key (the candidate's key, a
canonical string), so the answer is the same in every process.
"""

from __future__ import annotations

import bisect
import contextlib
import gc
import heapq
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

GROUP, CANDIDATE = 0, 1
"""Kinds of queue entries (a group sorts before the candidates of equal bound)."""

Entry = tuple[float, int, Any, Any]
"""``(lower bound on the step time in seconds, GROUP or CANDIDATE, item, extra)``; ``extra`` goes to
:meth:`SearchSpace.evaluate` (the Megatron space: the group and split of a candidate, whose memory it bounds then)."""


class Ranked(NamedTuple):
    """A candidate that fits, simulated (the outcomes are tuples: a search makes one per visited candidate)."""

    step_time_s: float
    """Its simulated step time in seconds (what the ranking sorts by)."""
    tie: Any
    """What breaks a tie of step times (orderable, the same in every process)."""
    result: Any
    """The space's record of it (its plan and prediction)."""
    checked: int = 1
    """Memory predictions it took."""


class OverMemory(NamedTuple):
    """A candidate over the memory limit."""

    label: Any
    """What it is reported under (orderable: the Megatron space's family, DeepSpeed's ZeRO stage)."""
    gib: float
    """Its predicted peak (or weights alone) in GiB per GPU."""
    checked: int = 1
    """Memory predictions it took (0 where its weights alone were over)."""


class Refused(NamedTuple):
    """A candidate the runtime's validation refuses."""


class Slower(NamedTuple):
    """A candidate fits but a bound with its exact costs already exceeds the k-th best step time."""

    checked: int = 1
    """Memory predictions it took."""


Outcome = Ranked | OverMemory | Refused | Slower
"""What :meth:`SearchSpace.evaluate` says of one candidate."""


class SearchSpace(Protocol):
    """A backend's space of plans as the driver searches it."""

    def entries(self) -> Iterable[Entry]:
        """The queue's first entries."""
        ...

    def expand(self, item: Any, cut: float) -> Iterable[Entry]:
        """The entries of a group's candidates whose bound is ``cut`` seconds or less."""
        ...

    def evaluate(self, item: Any, extra: Any, kth: float) -> Outcome:
        """One candidate: over memory, refused, slower than ``kth`` seconds, or ranked with its step time."""
        ...


@dataclass(kw_only=True)
class DriverResult:
    """What the driver found and counted."""

    ranked: list[Ranked] = field(default_factory=list)
    """The k fastest candidates that fit, fastest first."""
    over: dict[Any, list[float]] = field(default_factory=lambda: defaultdict(list))
    """Peaks in GiB of the candidates over memory, by label."""
    visited: int = 0
    """Candidates taken from the queue."""
    checked: int = 0
    """Memory predictions made."""
    simulated: int = 0
    """Candidates simulated in full."""
    over_memory: int = 0
    """Candidates over the memory limit."""
    refused: int = 0
    """Candidates the runtime's validation refused."""
    slower: int = 0
    """Candidates dropped by the bound with their exact costs."""


def run(space: SearchSpace, top_k: int, *, exhaustive: bool = False, cutoff: float = math.inf) -> DriverResult:
    """The ``top_k`` fastest candidates of ``space`` that fit (module docstring); ``exhaustive`` evaluates every
    candidate (the reference the bounded search is tested against). ``cutoff``: the k-th best step time of another
    space searched for the same ranking (another number format): candidates provably slower are not visited, so
    the result holds only those that may enter the merged top k."""
    with gc_paused():
        return _run(space, top_k, exhaustive, cutoff)


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cyclic garbage collector paused inside: a search allocates hundreds of thousands of short-lived
    tuples and few cycles, and the collector's passes over them are pure overhead (docs/benchmarks.md). What the
    pause leaves alive ends in the oldest generation, for the next full collection, without a young collection over
    it first (unless objects are frozen already: ``gc.freeze``, theirs to unfreeze)."""
    enabled = gc.isenabled()
    if not enabled:  # paused already (a search inside another's pause)
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if not gc.get_freeze_count():
            gc.freeze()  # every tracked object, moved in one step; the counts that start a collection reset
            gc.unfreeze()  # back into the oldest generation
        gc.enable()


def _run(space: SearchSpace, k: int, exhaustive: bool, cutoff: float = math.inf) -> DriverResult:
    queue = list(space.entries())
    heapq.heapify(queue)
    out = DriverResult()
    best: list[tuple[float, Any, Ranked]] = []  # the k best so far, by (step time, tie)
    kth = cutoff  # the k-th best step time so far (the cutoff until there are k, infinite when exhaustive)
    while queue:
        bound, kind, item, extra = heapq.heappop(queue)
        if bound > kth:
            break  # this and every later candidate is slower than the k-th best
        if kind == GROUP:  # candidates bounded above the k-th best so far are never queued (the k-th only falls)
            for entry in space.expand(item, kth):
                heapq.heappush(queue, entry)
            continue
        out.visited += 1
        outcome = space.evaluate(item, extra, kth)
        if isinstance(outcome, OverMemory):
            out.over_memory += 1
            out.checked += outcome.checked
            out.over[outcome.label].append(outcome.gib)
        elif isinstance(outcome, Refused):
            out.refused += 1
        elif isinstance(outcome, Slower):
            out.checked += outcome.checked
            out.slower += 1
        else:
            out.checked += outcome.checked
            out.simulated += 1
            bisect.insort(best, (outcome.step_time_s, outcome.tie, outcome), key=lambda e: e[:2])
            del best[k:]
            if len(best) == k and not exhaustive:
                kth = min(cutoff, best[-1][0])
    out.ranked = [r for _, _, r in best]
    return out
