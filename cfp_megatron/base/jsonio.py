"""JSON helpers: a stable JSON form of specs and config values, and installed package versions (for cache keys and
fingerprints)."""

from __future__ import annotations

import dataclasses
import enum
import importlib.metadata
import math
import typing
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


def json_type_problem(hint: Any, value: Any) -> str | None:
    """Why a value read from a JSON file does not have the type ``hint`` of the spec field it fills (``int``,
    ``float``, ``bool``, ``str``, an enum by its value, each optionally ``| None``), or ``None`` when it does: a JSON
    ``true`` is no integer, ``"2"`` no number, a list or an object no scalar. Other hints are not checked here."""
    args = typing.get_args(hint)
    if type(None) in args:
        if value is None:
            return None
        kinds = [a for a in args if a is not type(None)]
        if len(kinds) != 1:
            return None
        hint = kinds[0]
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        return None if ok else "a finite number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        allowed = [m.value for m in hint]
        return None if isinstance(value, str) and value in allowed else f"one of {allowed}"
    return None
