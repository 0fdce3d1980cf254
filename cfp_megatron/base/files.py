"""Writing files safely: atomically (a reader never sees half a file), with one clear error when the disk refuses
(full, read-only, no permission), and, for what a user keeps, never over an existing one."""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from cfp_megatron.base.errors import CfpError, ConfigError, ConfigIssue


class FileWriteError(CfpError, OSError):
    """A file could not be written (full disk, read-only file system, no permission, a folder in the way). Nothing
    is left half-written: the target keeps its earlier content, or stays absent."""

    def __init__(self, path: Path, err: OSError, key: str | None = None) -> None:
        self.path = path
        self.key = key
        self.errno_code = err.errno
        where = f" ({key})" if key else ""
        super().__init__(f"{path}{where} cannot be written: {_reason(err)}. Fix: {_fix(err, path, key)}")


def _reason(err: OSError) -> str:
    return {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exhausted",
            errno.EROFS: "the file system is read-only", errno.EACCES: "permission denied",
            errno.EPERM: "permission denied", errno.EISDIR: "a folder is in the way",
            errno.ENOTDIR: "a file is in the way of its folder",
            errno.ENAMETOOLONG: "the name is too long"}.get(err.errno or 0, err.strerror or str(err))


def _fix(err: OSError, path: Path, key: str | None) -> str:
    elsewhere = f"point {key} at another folder" if key else "write it to another folder"
    folder = path.parent
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free space where {folder} lives (df -h {folder}), or {elsewhere}."
    if err.errno == errno.EROFS:
        return f"{elsewhere}, on a writable file system."
    if err.errno in (errno.EACCES, errno.EPERM):
        return f"give this user write permission on {folder}, or {elsewhere}."
    if err.errno in (errno.EISDIR, errno.ENOTDIR):
        return f"move what is in the way, or {elsewhere}."
    return f"check the disk holding {folder}, or {elsewhere}."


def write_error(err: OSError, path: str | os.PathLike[str], key: str | None = None) -> FileWriteError:
    """The :class:`FileWriteError` for ``err`` raised while writing ``path`` (``key``: the setting or option that
    chose the path, named in the message and its fix)."""
    return err if isinstance(err, FileWriteError) else FileWriteError(Path(path), err, key)


def _sync(fh: IO[Any]) -> None:
    fh.flush()
    os.fsync(fh.fileno())


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w", *, key: str | None = None,
                  sync: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path`` (same extension, so writers that read it, such as matplotlib, see the
    format), yield it, then rename it over ``path``; on any error the temporary file is removed and ``path`` keeps
    its earlier content. An ``OSError`` becomes one :class:`FileWriteError` naming the file, ``key`` and the fix.
    ``mode``: ``"w"`` (text, UTF-8) or ``"wb"``; ``sync``: fsync the file and its folder (for what must survive a
    crash, such as checkpoint pointers)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode {mode!r}: use 'w' or 'wb'")
    target = Path(path)
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
        tmp = Path(name)
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh
            if sync:
                _sync(fh)
        os.replace(tmp, target)
        tmp = None
        if sync:
            fsync_dir(target.parent)
    except OSError as err:
        raise write_error(err, target, key) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


def write_atomic(path: str | os.PathLike[str], text: str | bytes, *, key: str | None = None,
                 sync: bool = False) -> Path:
    """Write ``text`` to ``path`` through a temporary file and one rename (replaced if present); an ``OSError`` is
    one :class:`FileWriteError` and leaves ``path`` as it was (:func:`atomic_writer`)."""
    with atomic_writer(path, "wb" if isinstance(text, bytes) else "w", key=key, sync=sync) as fh:
        fh.write(text)
    return Path(path)


def _temporary(path: Path, text: str, key: str | None) -> Path:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise write_error(err, path, key) from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise write_error(err, path, key) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def write_new(path: str | os.PathLike[str], text: str, *, key: str | None = None) -> Path:
    """Write ``text`` to ``path`` atomically, only if nothing is there: raises ``FileExistsError`` otherwise (also
    when another writer gets there first: the temporary file is hard-linked into place, which fails on an existing
    name; where the file system has no hard links, an existence check and a rename). Other ``OSError``s are one
    :class:`FileWriteError`."""
    target = Path(path)
    if target.exists():
        raise FileExistsError(target)
    tmp = _temporary(target, text, key)
    try:
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise
        except OSError:
            if target.exists():
                raise FileExistsError(target) from None
            os.replace(tmp, target)
    except FileExistsError:
        raise
    except OSError as err:
        raise write_error(err, target, key) from None
    finally:
        tmp.unlink(missing_ok=True)
    return target


def fsync_dir(folder: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in ``folder`` durable (no-op where directories cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
