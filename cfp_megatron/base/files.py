"""Writing files safely: atomically (a reader never sees half a file) and, for what a user keeps, never over an
existing one."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cfp_megatron.base.errors import ConfigError, ConfigIssue


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


@dataclass(frozen=True, kw_only=True)
class WriteLocation:
    """A place a run will write to, named by the setting that chose it (checked by :func:`check_write_locations`)."""

    key: str
    """The setting (``train.checkpoint_dir``, ``cfp.plan_file``, ``hydra.run.dir``, the ``CFP_CACHE_DIR``
    environment variable)."""
    path: Path
    """The folder, or the file."""
    folder: bool
    """``path`` is a folder files are written into (created when missing); else a file written into its folder."""
    new: bool = False
    """A file that is never written over: one already there is refused."""


def _blocking_file(folder: Path) -> Path | None:
    """The first existing non-folder on the way to ``folder`` (itself included), if any."""
    for part in (*reversed(folder.parents), folder):
        if part.exists() and not part.is_dir():
            return part
    return None


def writable_dir_problem(folder: str | os.PathLike[str]) -> str | None:
    """Why files cannot be written into ``folder``, or ``None`` when they can: the folder is created (with its
    parents) when missing, then a temporary file is written there and removed."""
    target = Path(folder).expanduser()
    blocking = _blocking_file(target)
    if blocking is not None:
        return f"a file is in the way: {blocking} is not a folder."
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        return f"the folder {target} cannot be created ({err.strerror or err})."
    try:
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".cfp-write-check-", suffix=".tmp")
    except OSError as err:
        return f"no file can be written into the folder {target} ({err.strerror or err})."
    os.close(fd)
    Path(tmp).unlink(missing_ok=True)
    return None


def writable_file_problem(path: str | os.PathLike[str], *, new: bool = False) -> str | None:
    """Why the file ``path`` cannot be written (a folder in its place, read-only, already there when ``new``, its
    folder not writable: :func:`writable_dir_problem`), or ``None`` when it can."""
    target = Path(path).expanduser()
    if target.is_dir():
        return f"{target} is a folder, not a file."
    if target.exists():
        if new:
            return f"{target} already exists, and it is never written over."
        if not os.access(target, os.W_OK):
            return f"{target} exists and is read-only."
    return writable_dir_problem(target.parent)


def check_write_locations(locations: Iterable[WriteLocation]) -> None:
    """Raise one :class:`ConfigError` naming every location of ``locations`` that cannot be written (before any
    process group, profiling or training starts); folders that are missing are created."""
    issues = []
    for loc in locations:
        problem = writable_dir_problem(loc.path) if loc.folder else writable_file_problem(loc.path, new=loc.new)
        if problem is not None:
            fix = (f"choose another {loc.key}, or remove {loc.path} first." if loc.new and loc.path.exists()
                   else f"point {loc.key} at a {'folder' if loc.folder else 'file in a folder'} this user can "
                        "write to (or fix the permissions, or move the file in the way).")
            issues.append(ConfigIssue(key=loc.key, value=str(loc.path), problem=problem, fix=fix))
    if issues:
        raise ConfigError(issues)
