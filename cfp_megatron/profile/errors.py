"""Typed errors of profiling and the ProfileDB."""

from __future__ import annotations

from cfp_megatron.base.errors import CfpError


class ProfileError(CfpError, RuntimeError):
    """Profiling could not produce a result (too few points to fit, a bad round request)."""


class ProfileDBError(CfpError, ValueError):
    """A ProfileDB file cannot be used: unreadable, another schema version, another fingerprint, or a path that
    would overwrite a user's file."""


class ProfileFigureError(ProfileDBError):
    """A number of a ProfileDB record is not one a measurement can give (NaN, infinite, negative where only zero or
    more is real, zero where only a positive value is, not a number): the file names it, the record, the field, the
    value and the range, and the fix."""

    def __init__(self, message: str, *, record: str, field: str, value: object, expected: str) -> None:
        self.record: str = record
        """The record it is in (``segments[3] dense tp2 mbs=1``)."""
        self.field: str = field
        """The field (``forward_s``)."""
        self.value: object = value
        """The value found."""
        self.expected: str = expected
        """The range the field has (``a finite number above zero``)."""
        super().__init__(message)


class SchemaVersionError(ProfileDBError):
    """The file was written with another ProfileDB schema version."""

    def __init__(self, path: object, found: object, expected: int) -> None:
        self.found = found
        self.expected = expected
        super().__init__(f"{path}: ProfileDB schema version {found!r}, this cfp-megatron reads version {expected}. "
                         "Fix: profile again with --force (or delete the file).")


class FingerprintMismatchError(ProfileDBError):
    """The file was measured on other hardware or software than the current run."""

    def __init__(self, path: object, found: dict, expected: dict) -> None:
        self.found = found
        self.expected = expected
        diff = sorted(k for k in set(found) | set(expected) if found.get(k) != expected.get(k))
        detail = ", ".join(f"{k}: {found.get(k)!r} != {expected.get(k)!r}" for k in diff)
        super().__init__(f"{path}: measured on another cluster or software ({detail}). "
                         "Fix: profile this cluster (the DB for it is kept separately), or load the file that matches.")
