"""Typed errors of profiling and the ProfileDB."""

from __future__ import annotations

from cfp_megatron.base.errors import CfpError


class ProfileError(CfpError, RuntimeError):
    """Profiling could not produce a result (too few points to fit, a bad round request)."""


class ProfileDBError(CfpError, ValueError):
    """A ProfileDB file cannot be used: unreadable, another schema version, another fingerprint, or a path that
    would overwrite a user's file."""


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
