"""JSON helpers: a stable JSON form of specs and config values, and installed package versions (for cache keys and
fingerprints)."""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
from typing import Any


def json_plain(value: Any) -> Any:
    """A JSON-stable form of config values and specs (enums by value, callables and types by qualified name)."""
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: json_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): json_plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple):
        return [json_plain(v) for v in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if callable(value) or isinstance(value, type):
        return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__qualname__)}"
    return str(value)


def installed_version(dist: str) -> str:
    """An installed distribution's version, read without importing it (so a cache hit stays fast)."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
