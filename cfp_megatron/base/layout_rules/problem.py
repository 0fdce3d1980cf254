"""What a layout rule returns: one problem, in the config checks' words and in the search's."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from cfp_megatron.base.errors import ConfigIssue


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One way a layout breaks one rule."""

    key: str
    """The Hydra key a config error names, e.g. ``parallel.tp``."""
    value: object
    """The value the key has."""
    problem: str
    """What is wrong, in one sentence naming the keys (the config checks' words)."""
    fix: str
    """What to change."""
    brief: str
    """The same in a clause, with the numbers (the analysis' options and the search's rejection reasons)."""

    def issue(self) -> ConfigIssue:
        """The config checks' rendering."""
        return ConfigIssue(key=self.key, value=self.value, problem=self.problem, fix=self.fix)


def issues(problems: Iterable[Problem]) -> list[ConfigIssue]:
    """The config checks' rendering of ``problems``."""
    return [p.issue() for p in problems] if problems else []  # most layouts follow every rule


def briefs(problems: Iterable[Problem]) -> list[str]:
    """The short rendering of ``problems``."""
    return [p.brief for p in problems] if problems else []
