"""Who owns a checkpoint folder: a lock file naming the job that writes into it, taken before any process group.

``<train.checkpoint_dir>/cfp_lock.json`` holds the owning job's id, host, launcher pid and start time, and a token
(random, made when the lock is taken) that every manifest saved under the lock records as its writer, so a later
save knows which step folders its own job wrote (:func:`cfp_megatron.engine.checkpoint.check_before_start`).

Which processes are one job (every rank, every node, every torchrun restart):

- on the lock's host, the launcher: the torchrun agent, the ranks' parent process (``os.getppid()``), the same for
  every local rank and every restart of the workers; its pid and start time (read from ``/proc``, so a reused pid
  is not mistaken for it); without torchrun, the process itself;
- on another host (a multi-node job, or a restart that moved rank 0), the job id: torchrun's rendezvous id
  (``TORCHELASTIC_RUN_ID``: ``--rdzv-id``, or the uuid of a single-node launch) when set, else the static
  rendezvous' ``MASTER_ADDR:MASTER_PORT`` (fixed for the life of a job; no two live jobs share it). Multi-node jobs
  under the c10d rendezvous should give ``--rdzv-id`` (torchrun asks for it anyway).

A lock whose launcher is gone (same host, pid not alive or started at another time) is taken over with a note; a
lock held by a live job, or by a job on another host (whose liveness cannot be seen from here), is refused naming
that job and the fix. Rank 0 takes the lock; the other ranks only check it. It is released at the end of a
successful run; a failed job's lock stays (its partial folders are its own) until the next job on that host takes
it over.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import stat
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.files import (
    DuplicateKeyError,
    FileWriteError,
    NotRegularFileError,
    json_loads_unique,
    read_regular,
    write_error,
    write_new,
)

LOCK = "cfp_lock.json"
"""Name of the lock file inside ``train.checkpoint_dir``."""
KEY = "train.checkpoint_dir"
"""The setting that names the locked folder."""


@dataclass(frozen=True, kw_only=True)
class Owner:
    """The job that holds (or asks for) a checkpoint folder's lock."""

    job: str
    """Id shared by every rank and restart of one job (see the module docstring)."""
    host: str
    """Host name of the process that took the lock."""
    pid: int
    """The launcher's pid there (torchrun's agent, or the process itself without torchrun)."""
    started: float | None
    """The launcher's start time (seconds since the epoch; ``None`` where ``/proc`` cannot say)."""
    token: str = ""
    """Random id of this hold of the lock, recorded by every manifest saved under it (empty: not holding)."""

    def describe(self) -> str:
        """``job <id> (host <h>, pid <p>, started <time>)``, as messages name it."""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started)) if self.started else "unknown"
        return f"job {self.job} (host {self.host}, pid {self.pid}, started {started})"


def process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch, from ``/proc``), or ``None`` where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def this_job() -> Owner:
    """The job this process belongs to (no token)."""
    env = os.environ
    under_torchrun = "LOCAL_RANK" in env and "TORCHELASTIC_RUN_ID" in env
    pid = os.getppid() if under_torchrun else os.getpid()
    host = socket.gethostname()
    rdzv = env.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        job = rdzv
    elif under_torchrun and env.get("MASTER_ADDR") and env.get("MASTER_PORT"):
        job = f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}"
    else:
        job = f"{host}:{pid}"
    return Owner(job=job, host=host, pid=pid, started=process_start(pid))


def _same_start(a: float | None, b: float | None) -> bool:
    return a is None or b is None or abs(a - b) < 2.0


def same_job(lock: Owner, me: Owner) -> bool:
    """Whether ``lock`` was taken by ``me``'s job (see the module docstring)."""
    if lock.host == me.host:
        return lock.pid == me.pid and _same_start(lock.started, me.started)
    return lock.job == me.job


def _alive(owner: Owner) -> bool:
    """Whether the launcher that took ``owner``'s lock on this host still runs."""
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process
    return _same_start(owner.started, process_start(owner.pid))


LOCK_LIMIT = 1 << 16
"""Most bytes a lock file holds (it is a few hundred); a longer one is not a lock this project wrote."""
PID_MAX = 1 << 22
"""Largest process id Linux hands out (``/proc/sys/kernel/pid_max`` at most)."""


def folder_problem(root: str | os.PathLike[str]) -> str | None:
    """Why ``root`` cannot serve as a checkpoint folder whatever it holds (something other than a folder in its
    place, a symbolic link to nothing or a loop, a folder this user cannot read), or ``None`` (a folder, or
    nothing there yet)."""
    path = Path(root)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"{path} is a symbolic link to {os.readlink(path)!r}, which does not exist"
        return None
    except NotADirectoryError:
        return f"a file is in the way of {path}: one of the folders above it is not a folder"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"{path} is a symbolic link that leads back to itself (a loop)"
        return f"{path} cannot be inspected ({err.strerror or err})"
    if not stat.S_ISDIR(mode):
        return f"{path} is not a folder"
    try:
        os.listdir(path)  # read permission
        os.stat(os.path.join(path, "."))  # search permission: its files can be opened
    except OSError as err:
        return f"the folder {path} cannot be read ({err.strerror or err})"
    return None


def _lock_problem(raw: object) -> str | None:
    """What is wrong with the parsed lock file ``raw`` (``None``: a lock :func:`acquire` wrote)."""
    if not isinstance(raw, dict):
        return f"it holds a JSON {type(raw).__name__}, not an object"
    for key in ("job", "host", "token"):
        if not isinstance(raw.get(key), str) or not raw[key].strip():
            return f"its {key!r} is {raw.get(key)!r}, not a name"
    pid = raw.get("pid")
    if type(pid) is not int or not 0 < pid <= PID_MAX:
        return f"its 'pid' is {pid!r}, not a process id (1 to {PID_MAX})"
    started = raw.get("started")
    if started is not None and (type(started) not in (int, float) or not 0 < started < 1e11):
        return f"its 'started' is {started!r}, not a time (seconds since 1970)"
    kept = raw.get(KEPT, [])
    if not isinstance(kept, list) or not all(isinstance(k, str) for k in kept):
        return f"its {KEPT!r} is {kept!r}, not a list of folder names"
    return None


def _read_raw(root: str | os.PathLike[str]) -> dict | None:
    """The lock file's JSON object, checked (``None``: no lock file); a CheckpointError when the lock path is a
    folder, a symbolic link, a named pipe, unreadable or not a lock this project wrote."""
    path = Path(root) / LOCK
    where = f"the lock of {KEY}={str(root)!r}"
    fix = (f"if no job is writing into {root}, remove {path} (a lock file cfp-megatron writes; the next run takes "
           f"the folder), or choose another {KEY}.")
    if os.path.islink(path):
        raise CheckpointError(f"{path} is a symbolic link (to {os.readlink(path)!r}), not {where}: a lock is a "
                              f"file of its own, taken and released in place. Fix: {fix}")
    try:
        if path.is_dir():
            raise CheckpointError(f"{path} is a folder, not the lock file of {KEY}={str(root)!r}. Fix: move it "
                                  f"away, or choose another {KEY}.")
        data = read_regular(path, LOCK_LIMIT)
    except FileNotFoundError:
        return None
    except NotRegularFileError as err:
        raise CheckpointError(f"{err.strerror} It is not {where}. Fix: {fix}") from None
    except OSError as err:
        raise CheckpointError(f"{path}, {where}, cannot be read ({err.strerror or err}). Fix: {fix}") from None
    try:
        raw = json_loads_unique(data.decode("utf-8"))
    except DuplicateKeyError as err:
        raise CheckpointError(f"{path}, {where}, is not a lock cfp-megatron wrote ({err}). Fix: {fix}") from None
    except (UnicodeDecodeError, ValueError) as err:
        raise CheckpointError(f"{path}, {where}, cannot be read "
                              f"({type(err).__name__}: {err}). Fix: {fix}") from None
    problem = _lock_problem(raw)
    if problem is not None:
        raise CheckpointError(f"{path}, {where}, is not a lock cfp-megatron wrote ({problem}). Fix: {fix}")
    return raw


def read_lock(root: str | os.PathLike[str]) -> Owner | None:
    """The owner recorded in ``root``'s lock file, ``None`` when there is none; a CheckpointError when the lock
    path is a folder, a symbolic link, unreadable or not a lock this project wrote (:func:`_read_raw`)."""
    raw = _read_raw(root)
    if raw is None:
        return None
    started = raw.get("started")
    return Owner(job=raw["job"], host=raw["host"], pid=raw["pid"], started=None if started is None else
                 float(started), token=raw["token"])


def _refusal(root: str | os.PathLike[str], lock: Owner) -> CheckpointError:
    path = Path(root) / LOCK
    where = ("is still running" if lock.host == socket.gethostname()
             else f"runs on another host, so whether it still runs cannot be seen from here (on {lock.host}: "
                  f"ps -p {lock.pid})")
    return CheckpointError(
        f"{KEY}={str(root)!r} is in use by another job: {path} names {lock.describe()}, which {where}. Two jobs "
        f"saving into one folder would remove each other's checkpoints. Fix: choose another {KEY}, or wait for "
        f"that job to end; if it is gone, remove {path}.")


def check(root: str | os.PathLike[str] | None, *, me: Owner | None = None,
          note: Callable[[str], None] | None = None) -> str | None:
    """On every rank, before any process group: refuse ``root`` when a live other job holds its lock; return the
    lock's token when this job holds it already (a torchrun restart), else ``None``."""
    if root is None or folder_problem(root) is not None or not Path(root).is_dir():
        return None  # nothing to own yet; a folder that cannot serve is reported by the checkpoint checks
    lock = read_lock(root)
    me = me or this_job()
    if lock is None:
        return None
    if same_job(lock, me):
        return lock.token
    if lock.host == me.host and not _alive(lock):
        if note is not None:
            note(f"{Path(root) / LOCK} names {lock.describe()}, which is gone, so the folder is free: this job "
                 "takes it over once it starts (and its saves remove that job's unfinished ones, *.partial).")
        return None
    raise _refusal(root, lock)


def acquire(root: str | os.PathLike[str], *, me: Owner | None = None) -> Owner:
    """On rank 0, before any process group: take ``root``'s lock (or keep this job's, or take over a dead job's
    on this host); return it. A live other job's lock is a CheckpointError naming it."""
    me = me or this_job()
    path = Path(root) / LOCK
    for _ in range(3):
        lock = read_lock(root)
        # unfinished saves already there when no job held the folder are not this job's: its saves keep them
        kept = sorted(p.name for p in Path(root).glob("*.partial")) if lock is None else []
        if lock is not None:
            if same_job(lock, me):
                return lock
            if lock.host != me.host or _alive(lock):
                raise _refusal(root, lock)
            aside = path.with_name(f"{LOCK}.stale-{me.pid}-{os.getpid()}")
            try:
                os.rename(path, aside)  # one taker wins the rename
            except FileNotFoundError:
                continue
            except OSError as err:
                raise write_error(err, path, KEY) from None
            aside.unlink(missing_ok=True)
        mine = Owner(job=me.job, host=me.host, pid=me.pid, started=me.started, token=uuid.uuid4().hex)
        try:
            write_new(path, json.dumps({**asdict(mine), KEPT: kept}, indent=1) + "\n", key=KEY)
        except FileExistsError:
            continue  # another job got there first: judge its lock
        except FileWriteError:
            raise
        return mine
    lock = read_lock(root)
    raise _refusal(root, lock) if lock is not None else CheckpointError(
        f"{path} keeps changing: another job is taking {KEY}={str(root)!r}. Fix: choose another {KEY}.")


KEPT = "kept"
"""Key of the lock file listing the ``.partial`` folders that were there when the lock was taken with no job holding
the folder (of unknown origin: never removed by this job's saves). A dead job's, taken over, are the new job's."""


def kept_partials(root: str | os.PathLike[str]) -> set[str]:
    """The ``.partial`` folder names this job's saves must leave alone (:data:`KEPT`)."""
    try:
        raw = _read_raw(root)
    except CheckpointError:
        return set()
    return set(raw.get(KEPT, [])) if raw is not None else set()


def held_token(root: str | os.PathLike[str]) -> str | None:
    """The token of ``root``'s lock when this job holds it, else ``None`` (no lock, or another job's)."""
    try:
        lock = read_lock(root)
    except CheckpointError:
        return None
    return lock.token if lock is not None and same_job(lock, this_job()) else None


def release(root: str | os.PathLike[str] | None, token: str | None) -> None:
    """Remove ``root``'s lock if it is still the hold ``token`` (the end of a successful run, on rank 0)."""
    if root is None or not token:
        return
    with contextlib.suppress(CheckpointError, OSError):
        lock = read_lock(root)
        if lock is not None and lock.token == token:
            (Path(root) / LOCK).unlink()


def note_printer(rank: int) -> Callable[[str], None]:
    """How a launch says what it decided about its checkpoint folder before the start (a resume without pointer
    file, a lock taken over, nothing left to train): one line on stdout on rank 0, prefixed ``cfp:``."""

    def say(text: str) -> None:
        if rank == 0:
            print(text if text.startswith("cfp:") else f"cfp: {text}", flush=True)

    return say
