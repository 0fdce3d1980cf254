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
