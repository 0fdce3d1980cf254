"""The base of the project's enumerations."""

from __future__ import annotations

import enum


class IdentityEnum(enum.Enum):
    """An enumeration hashed by identity: its members are singletons that compare by identity, so the object's hash
    agrees with equality. :class:`enum.Enum` hashes a member by its name in a Python-level method, which runs for
    every member of every cache key the search looks up (docs/benchmarks.md, "Search speed")."""

    __hash__ = object.__hash__
