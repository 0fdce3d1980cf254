"""Writing files safely: atomically (a reader never sees half a file) and, for what a user keeps, never over an
existing one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _temporary(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_atomic(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` through a temporary file and one rename (a cache entry: replaced if present)."""
    target = Path(path)
    tmp = _temporary(target, text)
    try:
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def write_new(path: str | os.PathLike[str], text: str) -> Path:
    """Write ``text`` to ``path`` atomically, only if nothing is there: raises ``FileExistsError`` otherwise (also
    when another writer gets there first: the temporary file is hard-linked into place, which fails on an existing
    name; where the file system has no hard links, an existence check and a rename)."""
    target = Path(path)
    if target.exists():
        raise FileExistsError(target)
    tmp = _temporary(target, text)
    try:
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise
        except OSError:
            if target.exists():
                raise FileExistsError(target) from None
            os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


CACHE_ENV = "CFP_CACHE_DIR"
"""Environment variable overriding the cache root."""


def cache_dir() -> Path:
    """The cache root; each kind of entry has a section folder in it (``capture/``, ``analysis/``)."""
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "cfp-megatron"
