"""Typed errors of model capture."""

from __future__ import annotations

from cfp_megatron.base.errors import CfpError


class CaptureError(CfpError, RuntimeError):
    """A model could not be captured: an unsupported structure, or inputs that do not fit it."""
