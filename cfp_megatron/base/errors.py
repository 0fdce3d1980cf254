"""Typed errors raised for bad user input.

Every error names the Hydra key, the value it had and how to fix it, so a user can act on the message without
reading code. Several problems found at once are reported together in one :class:`ConfigError`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class ConfigIssue:
    """One problem with one setting."""

    key: str
    """The Hydra key, e.g. ``parallel.tp``."""
    value: object
    """The value the key had."""
    problem: str
    """What is wrong, in one sentence."""
    fix: str
    """What to change."""

    def __str__(self) -> str:
        problem = self.problem.rstrip()
        problem += "" if problem.endswith((".", "?", "!")) else "."  # a sentence, ended before "Fix:"
        return f"{self.setting()}: {problem} Fix: {self.fix}"

    def setting(self) -> str:
        """The setting as a command line writes it: ``key=value``; a combination of keys under :attr:`key` (a
        ``value`` that maps each full key to its value, ``{"cfp.tp": 8, "cfp.pp": 2}``) as each ``key=value``."""
        if isinstance(self.value, dict) and self.value and all(
                isinstance(k, str) and k.startswith(f"{self.key}.") for k in self.value):
            return " ".join(f"{k}={v!r}" for k, v in self.value.items())
        return f"{self.key}={self.value!r}"


class CfpError(Exception):
    """Base class of all cfp-megatron errors."""


class ConfigError(CfpError, ValueError):
    """One or more settings are invalid; raised before any process group or device work starts."""

    def __init__(self, issues: list[ConfigIssue] | ConfigIssue) -> None:
        self.issues: list[ConfigIssue] = [issues] if isinstance(issues, ConfigIssue) else list(issues)
        lines = [f"{len(self.issues)} invalid setting(s):"] + [f"  - {issue}" for issue in self.issues]
        super().__init__("\n".join(lines))

    def __reduce__(self) -> tuple[type, tuple[list[ConfigIssue]]]:
        """Pickled as its issues (a worker process hands its error to the parent whole)."""
        return type(self), (self.issues,)

    @property
    def keys(self) -> list[str]:
        """The Hydra keys named by the issues, in order."""
        return [issue.key for issue in self.issues]


class CheckpointError(CfpError, RuntimeError):
    """A checkpoint is missing, incomplete or would overwrite a user's work."""
