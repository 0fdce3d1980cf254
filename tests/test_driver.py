"""The one search driver on a synthetic space: the bounded visit finds what the exhaustive one finds."""

from __future__ import annotations

import random
from dataclasses import dataclass

from cfp_megatron.search import driver


@dataclass
class _Space:
    """Groups of candidates whose time is at least their group's bound; some over memory, some refused."""

    groups: list[list[tuple[float, str]]]

    def entries(self) -> list[driver.Entry]:
        return [(min(t for t, _ in g), driver.GROUP, i, None) for i, g in enumerate(self.groups)]

    def expand(self, item: int, cut: float) -> list[driver.Entry]:
        return [(t, driver.CANDIDATE, name, t) for t, name in self.groups[item] if t <= cut]

    def evaluate(self, item: str, extra: float, kth: float) -> driver.Outcome:
        if item.endswith("big"):
            return driver.OverMemory(label=item[0], gib=99.0)
        if item.endswith("bad"):
            return driver.Refused()
        return driver.Ranked(step_time_s=extra * 1.5, tie=item, result=item)


def _space(seed: int) -> _Space:
    rng = random.Random(seed)
    groups = []
    for g in range(30):
        base = rng.uniform(1, 10)
        groups.append([(base + rng.uniform(0, 3), f"{chr(97 + g % 26)}{g}-{c}" + rng.choice(["", "", "", "big", "bad"]))
                       for c in range(rng.randint(1, 12))])
    return _Space(groups)


def test_the_bounded_visit_equals_the_exhaustive_one() -> None:
    for seed in range(20):
        space = _space(seed)
        bounded = driver.run(space, 3)
        everything = driver.run(space, 3, exhaustive=True)
        assert [r.result for r in bounded.ranked] == [r.result for r in everything.ranked]
        assert bounded.visited <= everything.visited
        times = [r.step_time_s for r in everything.ranked]
        assert times == sorted(times)
    assert any(driver.run(_space(s), 3).visited < driver.run(_space(s), 3, exhaustive=True).visited
               for s in range(20))


def test_counts_and_ties() -> None:
    space = _Space([[(1.0, "b"), (1.0, "a"), (2.0, "xbig"), (3.0, "ybad")]])
    found = driver.run(space, 5)
    assert [r.result for r in found.ranked] == ["a", "b"]  # equal times: the tie key decides
    assert (found.visited, found.simulated, found.over_memory, found.refused) == (4, 2, 1, 1)
    assert dict(found.over) == {"x": [99.0]}



_PAUSE_CHECK = """
import gc, weakref
from cfp_megatron.search import driver

class Node:
    pass

with driver.gc_paused():
    assert not gc.isenabled()
    with driver.gc_paused():  # nested: the outer pause's to end
        pass
    assert not gc.isenabled()
    kept = [(i, [i]) for i in range(10_000)]
    cycle = Node()
    cycle.self = cycle
    gone = weakref.ref(cycle)
    del cycle
    before = [generation["collections"] for generation in gc.get_stats()]
made = [[] for _ in range(10)]  # containers made after: a collection due would run here
after = [generation["collections"] for generation in gc.get_stats()]
assert after == before  # no collection over what the pause made as it ends
assert any(o is kept for o in gc.get_objects(generation=2))  # in the oldest generation
assert gc.isenabled() and gc.get_freeze_count() == 0
gc.collect()
assert gone() is None
print("ok")
"""


def test_the_collector_pause_ends_with_the_collector_on_and_the_pauses_garbage_still_collectable() -> None:
    # in a fresh process: this one may hold frozen objects (gc.freeze), which the pause leaves alone
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _PAUSE_CHECK], capture_output=True, text=True, check=False)
    assert run.stdout.strip() == "ok", run.stderr
