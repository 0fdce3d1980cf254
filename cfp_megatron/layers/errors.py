"""Typed errors of the PrimePar layers."""

from __future__ import annotations

from cfp_megatron.base.errors import CfpError


class PrimeParError(CfpError, ValueError):
    """A PrimePar grid or layer was given arguments that do not fit: a bad k, a position outside the square, a
    world size that does not split into squares, a tensor of the wrong shape. The message names the argument, the
    value it had and the fix.
    """

    def __init__(self, problem: str, *, fix: str, setting: str | None = None) -> None:
        self.problem: str = problem
        """What is wrong, in one or two sentences."""
        self.fix: str = fix
        """What to change."""
        self.setting: str | None = setting
        """The argument (or Hydra key) involved, e.g. ``in_features``, if any."""
        text = f"{setting}: {problem}" if setting else problem
        super().__init__(f"{text} Fix: {fix}")


class PrimeParShapeError(PrimeParError):
    """A dimension of a PrimePar tensor does not split evenly over the 2^k x 2^k square, or a block has the wrong
    shape for the layer it is fed to.
    """

    def __init__(self, *, dim: str, value: int, problem: str, fix: str) -> None:
        self.dim: str = dim
        """The dimension involved, e.g. ``in_features (N)`` or ``tokens (B*M)``."""
        self.value: int = value
        """Its value."""
        super().__init__(problem, fix=fix, setting=f"{dim}={value}")
