"""The typed error of the Plan artifact."""

from __future__ import annotations

from cfp_megatron.base.errors import CfpError


class PlanError(CfpError, ValueError):
    """A plan string or ``plan.json`` is malformed, was edited, comes from a newer version, does not fit the job it is
    applied to, or would overwrite an existing file. The message says what is wrong and, where there is one, the fix.
    """

    def __init__(self, problem: str, *, fix: str | None = None, setting: str | None = None) -> None:
        self.problem: str = problem
        """What is wrong, in one or two sentences."""
        self.fix: str | None = fix
        """What to change, or ``None`` when the problem says it."""
        self.setting: str | None = setting
        """The Hydra key involved (e.g. ``cfp.plan_file``), if any."""
        text = f"{setting}: {problem}" if setting else problem
        if fix:
            text += f" Fix: {fix}"
        super().__init__(text)
