"""Writing files safely: atomically (a reader never sees half a file), with one clear error when the disk refuses
(full, read-only, no permission), and, for what a user keeps, never over an existing one."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import stat
import tempfile
from collections.abc import Iterable, Iterator, Mapping
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
    if err.errno == errno.EEXIST:
        return f"remove {path} or move it away, or {elsewhere}."
    return f"check the disk holding {folder}, or {elsewhere}."


def write_error(err: OSError, path: str | os.PathLike[str], key: str | None = None) -> FileWriteError:
    """The :class:`FileWriteError` for ``err`` raised while writing ``path`` (``key``: the setting or option that
    chose the path, named in the message and its fix)."""
    return err if isinstance(err, FileWriteError) else FileWriteError(Path(path), err, key)


class FileAccessError(CfpError, OSError):
    """A file could not be opened or read where the run used it, past the checks made before the run (a data file
    only one host cannot read, a file removed or an I/O error while the run read it): named with the reason."""

    def __init__(self, err: OSError, where: str) -> None:
        self.path = Path(os.fsdecode(err.filename))
        self.errno_code = err.errno
        reason = {errno.ENOENT: "it is not there (removed or renamed while the run used it?)",
                  errno.EIO: "an I/O error (a failing disk or network file system)"}.get(err.errno or 0, _reason(err))
        super().__init__(f"{self.path} cannot be used: {reason} (in {where}). Fix: make it readable to this user on "
                         "this host (every host reads its own copy of the data and the checkpoints: permissions, the "
                         "mount, the disk), then start the job again.")


def access_error(err: BaseException, where: str) -> FileAccessError | None:
    """``err`` (or the error it was raised from) as a :class:`FileAccessError` when it is an ``OSError`` naming a
    file (a failure of the file, not of the code: ``PermissionError``, ``FileNotFoundError``, ``EIO``); else
    ``None``."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and not isinstance(current, CfpError) and current.filename is not None \
                and current.errno in (errno.EACCES, errno.EPERM, errno.ENOENT, errno.EIO, errno.ESTALE):
            return FileAccessError(current, where)
        current = current.__cause__ or current.__context__
    return None


def _sync(fh: IO[Any]) -> None:
    fh.flush()
    os.fsync(fh.fileno())


@contextlib.contextmanager
def _staged(target: Path, mode: str, key: str | None) -> Iterator[tuple[IO[Any], Path]]:
    """A temporary file beside ``target`` (same extension, so writers that read it, such as matplotlib, see the
    format) and its path; removed on the way out, whatever happened (a caller moves it into place first). An
    ``OSError`` other than ``FileExistsError`` becomes one :class:`FileWriteError`."""
    tmp: Path | None = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=f".tmp{target.suffix}")
        tmp = Path(name)
        with os.fdopen(fd, mode, **({"encoding": "utf-8"} if mode == "w" else {})) as fh:
            yield fh, tmp
    except FileExistsError:
        raise
    except OSError as err:
        raise write_error(err, target, key) from None
    finally:
        if tmp is not None:
            tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str], mode: str = "w", *, key: str | None = None,
                  sync: bool = False) -> Iterator[IO[Any]]:
    """Open a temporary file beside ``path``, yield it, then rename it over ``path``; on any error the temporary
    file is removed and ``path`` keeps its earlier content. An ``OSError`` becomes one :class:`FileWriteError`
    naming the file, ``key`` and the fix. ``mode``: ``"w"`` (text, UTF-8) or ``"wb"``; ``sync``: fsync the file and
    its folder (for what must survive a crash, such as checkpoint pointers)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_writer mode {mode!r}: use 'w' or 'wb'")
    target = Path(path)
    with _staged(target, mode, key) as (fh, tmp):
        yield fh
        if sync:
            _sync(fh)
        fh.close()
        os.replace(tmp, target)
        if sync:
            fsync_dir(target.parent)


def write_atomic(path: str | os.PathLike[str], text: str | bytes, *, key: str | None = None,
                 sync: bool = False) -> Path:
    """Write ``text`` to ``path`` through a temporary file and one rename (replaced if present); an ``OSError`` is
    one :class:`FileWriteError` and leaves ``path`` as it was (:func:`atomic_writer`)."""
    with atomic_writer(path, "wb" if isinstance(text, bytes) else "w", key=key, sync=sync) as fh:
        fh.write(text)
    return Path(path)


def write_new(path: str | os.PathLike[str], text: str, *, key: str | None = None) -> Path:
    """Write ``text`` to ``path`` atomically, only if nothing is there: raises ``FileExistsError`` otherwise (also
    when another writer gets there first: the temporary file is hard-linked into place, which fails on an existing
    name; where the file system has no hard links, an existence check and a rename). Other ``OSError``s are one
    :class:`FileWriteError`."""
    target = Path(path)
    if target.exists():
        raise FileExistsError(target)
    with _staged(target, "w", key) as (fh, tmp):
        fh.write(text)
        fh.close()
        try:
            os.link(tmp, target)
        except FileExistsError:
            raise
        except OSError:
            if target.exists():
                raise FileExistsError(target) from None
            os.replace(tmp, target)
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

CACHE_KEY = f"{CACHE_ENV} (environment variable)"
"""How errors about a file in the cache name the setting that chose its place."""


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
    own_kind: str | None = None
    """A file appended to, but only when it is cfp-megatron's: one already there and not empty must begin with the
    record :func:`append_record` writes first, of this ``kind`` (:func:`first_record_kind`); else it is refused."""


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
        return f"the folder {target} cannot be created: {_reason(err)}."
    tmp: str | None = None
    try:
        fd, tmp = tempfile.mkstemp(dir=target, prefix=".cfp-write-check-", suffix=".tmp")
        try:
            os.write(fd, b"cfp-megatron write check\n")  # a byte needs a block: a full disk is found now
        finally:
            os.close(fd)
    except OSError as err:
        return f"no file can be written into the folder {target}: {_reason(err)}."
    finally:
        if tmp is not None:
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
                        "write to, on a disk with free space (or free space there, fix the permissions, or move the "
                        "file in the way).")
            issues.append(ConfigIssue(key=loc.key, value=str(loc.path), problem=problem, fix=fix))
        elif loc.own_kind is not None and (problem := _append_problem(loc.path, loc.own_kind)) is not None:
            issues.append(ConfigIssue(
                key=loc.key, value=str(loc.path), problem=problem,
                fix=f"point {loc.key} at another file (a new one, or one cfp-megatron wrote for an earlier run), "
                    f"or remove {loc.path} first."))
    if issues:
        raise ConfigError(issues)


def own_json_problem(path: str | os.PathLike[str], option: str, keys: Iterable[str], what: str) -> str | None:
    """Why the JSON file ``path`` that ``option`` names cannot be written, found before the work (``None`` when it
    can): a folder, a missing folder, a folder this user cannot write to, or an existing file that is not ``what``
    (a JSON object with every key of ``keys``). Replacing an earlier file of that kind is what ``option`` is for;
    anything else there (a user's notes, another tool's JSON) is kept."""
    target = Path(path)
    if target.is_dir():
        return f"{option} {path}: is a folder. Fix: name a .json file."
    if not target.exists():
        if not target.parent.is_dir():
            return f"{option} {path}: the folder {target.parent} does not exist. Fix: create it or name another file."
    else:
        try:
            with open_regular(target, "rb") as fh:
                old = json.loads(fh.read(64 << 20))
        except (OSError, UnicodeDecodeError, ValueError):
            old = None
        if not (isinstance(old, dict) and set(keys) <= set(old)):
            return (f"{option} {path}: exists and is not {what}; it is left as it is. "
                    "Fix: name a new file, or remove that one first.")
    problem = writable_file_problem(target)
    return None if problem is None else (f"{option} {target}: {problem} Fix: name a file in a folder this user can "
                                         "write to.")


FIRST_LINE_LIMIT = 1 << 16
"""Most bytes of a file's first line read to find its record kind (:func:`first_record_kind`)."""


def first_record_kind(path: str | os.PathLike[str]) -> str | None:
    """The ``kind`` of the JSON object on ``path``'s first line, or ``None`` (no such file, empty, unreadable, not
    JSON, no ``kind``)."""
    try:
        with open(path, "rb") as fh:
            line = fh.readline(FIRST_LINE_LIMIT)
        record = json.loads(line)
    except (OSError, ValueError):
        return None
    kind = record.get("kind") if isinstance(record, dict) else None
    return kind if isinstance(kind, str) else None


def _append_problem(path: Path, kind: str) -> str | None:
    """Why records of ``kind`` may not be appended to ``path``, or ``None``: it is absent, empty, or begins with a
    record of ``kind`` (a named pipe or socket is refused: writing to it can wait forever)."""
    try:
        st = path.expanduser().stat()
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"{path} cannot be inspected: {err.strerror or err}."
    if stat.S_ISFIFO(st.st_mode) or stat.S_ISSOCK(st.st_mode):
        return f"{path} is a {'named pipe' if stat.S_ISFIFO(st.st_mode) else 'socket'}, not a file: appending to it " \
               "could wait forever."
    if st.st_size == 0 or first_record_kind(path.expanduser()) == kind:
        return None
    return (f'the file exists and cfp-megatron did not write it (its first line is not a {{"kind": "{kind}", ...}} '
            "record); it is never appended to.")


def append_record(path: str | os.PathLike[str], record: Mapping[str, Any], *, kind: str,
                  header: Mapping[str, Any] | None = None, key: str | None = None) -> None:
    """Append ``record`` as one JSON line to ``path``, in one ``write`` of the whole line (``O_APPEND``); where the
    file is absent or empty, the line ``{"kind": kind, **header}`` comes first, in the same write. A file that does
    not begin with that record is refused (:class:`FileWriteError`, ``EEXIST``), as :func:`check_write_locations`
    refuses it before a run. A write the disk cuts short is undone (the file is truncated to its length before),
    so the file only ever holds whole lines; an ``OSError`` is one :class:`FileWriteError`."""
    target = Path(path)
    data = (json.dumps(record) + "\n").encode("utf-8")
    try:
        fd, created = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL, 0o666), True
    except FileExistsError:
        fd, created = None, False
    except OSError as err:
        raise write_error(err, target, key) from None
    try:  # never blocks: a named pipe without a reader is refused (ENXIO), not waited on
        fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK) if fd is None else fd
    except OSError as err:
        raise write_error(err, target, key) from None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            data = (json.dumps({"kind": kind, **(header or {})}) + "\n").encode("utf-8") + data
        elif first_record_kind(target) != kind:
            raise write_error(FileExistsError(errno.EEXIST, f"it does not begin with a {kind!r} record, so "
                                              "cfp-megatron did not write it"), target, key)
        try:
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        except OSError as err:
            with contextlib.suppress(OSError):
                os.ftruncate(fd, size)
                if created:  # nothing of it is left
                    target.unlink()
            raise write_error(err, target, key) from None
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------------------- reading a user's files

class NotRegularFileError(OSError):
    """A path a user named is a folder, a named pipe, a socket or a device: not a file that can be read to its end
    (a named pipe with no writer would block the reader forever)."""


def _kind_problem(path: str | os.PathLike[str], mode: int) -> str | None:
    """Why a file of ``mode`` (``st_mode``) cannot be read as a user's file, or ``None`` for a regular file."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return f"{path} is a folder, not a file."
    kind = ("a named pipe (FIFO)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")
    return f"{path} is {kind}, not a regular file: reading it could wait forever or never end."


def regular_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why ``path`` cannot be read as a file a user named (absent, a folder, a named pipe, socket or device), or
    ``None`` for a regular file (symbolic links followed). Opens nothing, so a named pipe does not block."""
    try:
        mode = os.stat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return f"{path} does not exist."
    except OSError as err:
        return f"{path} cannot be inspected: {err.strerror or err}."
    return _kind_problem(path, mode)


@contextlib.contextmanager
def open_regular(path: str | os.PathLike[str], mode: str = "r", **kwargs: Any) -> Iterator[IO[Any]]:
    """Open ``path`` for reading (``mode`` ``"r"`` or ``"rb"``; ``kwargs`` go to :func:`open`) only if it is a
    regular file: it is opened without blocking and checked on the open descriptor, so a named pipe or a device
    swapped in after a check is refused too (:class:`NotRegularFileError`); other failures are the usual
    ``OSError`` subclasses (``FileNotFoundError``, ``PermissionError``...)."""
    if mode not in ("r", "rb"):
        raise ValueError(f"open_regular mode {mode!r}: use 'r' or 'rb'")
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        problem = _kind_problem(path, os.fstat(fd).st_mode)
        if problem is not None:
            raise NotRegularFileError(errno.EINVAL, problem, str(path))
        os.set_blocking(fd, True)
        fh = os.fdopen(fd, mode, **({"encoding": "utf-8"} | kwargs if mode == "r" else kwargs))
    except BaseException:
        os.close(fd)
        raise
    with fh:
        yield fh


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The bytes of the regular file ``path`` (:func:`open_regular`: a folder, named pipe, socket or device is a
    :class:`NotRegularFileError`, and nothing blocks), when it holds at most ``limit`` of them: a longer one is an
    ``OSError`` (``EFBIG``). For small files the project reads back (a lock, a pointer, a manifest)."""
    with open_regular(path, "rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"{path} is longer than {limit:,} bytes, more than such a file ever holds",
                      str(path))
    return data


def read_user_file(path: str | os.PathLike[str], key: str, *, binary: bool = False,
                   fix: str | None = None) -> Any:
    """The content of the file ``path`` that the setting ``key`` names (``str``, UTF-8; ``bytes`` when ``binary``);
    one :class:`ConfigError` naming ``key``, the path, what is wrong (absent, a folder, a named pipe or device, no
    permission, not UTF-8 text) and ``fix`` (by default: point ``key`` at a regular file)."""
    fix = fix or f"point {key} at a regular file this user can read."
    try:
        with open_regular(path, "rb") as fh:
            data = fh.read()
    except NotRegularFileError as err:
        raise ConfigError(ConfigIssue(key=key, value=str(path), problem=str(err.strerror), fix=fix)) from None
    except (FileNotFoundError, NotADirectoryError):
        raise ConfigError(ConfigIssue(key=key, value=str(path), problem=f"{path} does not exist.", fix=fix)) from None
    except OSError as err:
        raise ConfigError(ConfigIssue(key=key, value=str(path), problem=f"{path} cannot be read: "
                                      f"{err.strerror or err}.", fix=fix)) from None
    if binary:
        return data
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(ConfigIssue(key=key, value=str(path), problem=f"{path} is not UTF-8 text (byte {err.start} "
                                      f"is {data[err.start:err.start + 1]!r}): a binary or damaged file.",
                                      fix=fix)) from None


class DuplicateKeyError(ValueError):
    """A JSON object gives one key twice: readers keep the first or the last value, so the file means two things."""

    def __init__(self, key: str, first: Any, second: Any) -> None:
        self.key = key
        """The repeated key."""
        super().__init__(f"the key {key!r} appears twice in one object (values {_brief(first)} and "
                         f"{_brief(second)}); JSON readers keep one or the other, so the file is ambiguous")


def _brief(value: Any, limit: int = 60) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKeyError(key, out[key], value)
        out[key] = value
    return out


def json_loads_unique(text: str | bytes) -> Any:
    """``json.loads`` that refuses an object giving a key twice (:class:`DuplicateKeyError`, a ``ValueError``);
    for files a user hands in (plan files, profile imports), where either reading would be a guess. What the parser
    cannot hold (nesting deeper than Python's recursion limit, an integer of more digits than Python converts) is a
    ``json.JSONDecodeError`` saying so, like any other text that is not JSON."""
    try:
        return json.loads(text, object_pairs_hook=_unique_pairs)
    except RecursionError:
        raise json.JSONDecodeError("arrays or objects nested too deeply to read", "", 0) from None
    except (json.JSONDecodeError, DuplicateKeyError):
        raise
    except ValueError as err:  # int(): "Exceeds the limit (4300 digits) for integer string conversion"
        raise json.JSONDecodeError(f"a number that cannot be read ({str(err).split(';')[0]})", "", 0) from None
