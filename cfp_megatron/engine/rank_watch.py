"""A rank's life under torchrun: it dies with its launcher, records how far it got, and its failures are said once.

- **Launcher death.** :func:`tie_to_launcher` asks Linux for SIGKILL when torchrun's agent (the rank's parent) dies
  (``PR_SET_PDEATHSIG``, as :func:`~cfp_megatron.engine.save_workers.die_with_parent` does for checkpoint writers),
  so ``kill -9`` of torchrun leaves no rank training as an orphan.
- **Progress.** Every rank records where it is (:func:`at`: ``step 8 of 20``, a save, a profiling round's step) in
  the default process group's store (torchrun's agent holds it, so it answers while any rank is stalled).
- **A stalled rank** cannot speak, so the ranks waiting for it do: a collective that outlives
  ``train.collective_timeout_s`` raises on them (gloo's ``Timed out waiting ...``; NCCL's watchdog error where torch
  raises it rather than aborting), and :func:`explained` turns that into one :class:`RankStalledError` naming the
  ranks that did not mark themselves as waiting within :data:`GRACE_S`, with their host, pid and progress.
- **Ctrl-C, SIGTERM, SIGHUP.** The first SIGINT raises ``KeyboardInterrupt`` once (later ones, torchrun's forward of
  the same Ctrl-C included, are ignored while the rank winds down). Once the process group exists (:func:`watch`),
  SIGTERM (a scheduler ending the job, ``kill``, torchrun stopping the other ranks after one failed) and SIGHUP (the
  terminal closed) do the same instead of killing the rank without a word; a rank stopped by torchrun because another
  rank already ended the job with a message (:func:`explained` marks it in the store) exits quietly. Where the
  interrupt lands in code whose exceptions Python ignores (a
  finalizer, the ``os.register_at_fork`` callbacks that run while a checkpoint save forks its writers), Python's
  unraisable hook is told, and the interrupt is raised again at once (:func:`_unraisable`) rather than lost and
  printed as "Exception ignored in" with a traceback; :func:`explained` makes it a :class:`RunInterrupted` naming the
  signal, the step and the last checkpoint (exit status 128 + the signal's number, as a shell reports it).

Each such error carries a :class:`Turn`: the first rank to claim it says the message, the others wait for it to be
said before exiting (torchrun stops every rank once the first one exits).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import access_error
from cfp_megatron.engine.save_workers import die_with_parent

TIMEOUT_KEY = "train.collective_timeout_s"
"""The setting that bounds every collective (:class:`~cfp_megatron.base.config.TrainSpec`)."""
GRACE_S = 5.0
"""How long a rank whose collective timed out waits for the other waiting ranks to say so, before naming the
ranks that did not as stalled (they time out within a step of each other)."""
SAID_WAIT_S = 30.0
"""How long a rank that does not say a shared message waits for the rank that does."""
POLL_S = 0.1
"""How often the store is read while waiting."""
RAISE_AGAIN_S = 0.01
"""How soon an interrupt lost where Python ignores exceptions is raised again (:func:`_unraisable`)."""
STOP_SIGNALS: dict[int, str] = {signal.SIGINT: "", signal.SIGTERM: "sent by a scheduler ending the job, by kill, or "
                                "by torchrun stopping this rank after another one failed",
                                signal.SIGHUP: "the terminal that started the job closed: start it under nohup, tmux "
                                "or a scheduler to keep it running"}
"""The signals that end a run with one line (:func:`interrupted`), with what usually sends each; SIGINT raises from
:func:`tie_to_launcher` on, the others from :func:`watch` on (before, they end the rank as the system does)."""
ERROR_STATUS = 2
"""Exit status of a run ended by a stalled rank (the status of every error the entry points report)."""
_TIMEOUT_MARKS = ("Timed out waiting", "Application timeout caused pair closure",
                  "Watchdog caught collective operation timeout", "before timing out", "timed out after",
                  "wait timeout after")
"""Parts of the errors gloo and NCCL raise when a collective outlives the process group's timeout (the last: the
store's, when a rank does not join a group)."""
_PEER_GONE_MARKS = ("Connection closed by peer", "Connection reset by peer")
"""Parts of the errors gloo raises on a rank whose peer closed its connections (exited)."""
PEER_WAIT_S = 3.0
"""How long a rank whose peer went away looks in the store for that peer's reason (an interrupt, a stall)."""
_PREFIX = "cfp/watch"
"""Store keys of this module (inside the attempt's prefix of :func:`~cfp_megatron.engine.distributed.
init_distributed`)."""


@dataclass(kw_only=True)
class _Watch:
    """This process's record (module state: one per rank process)."""

    where: str = "start-up (before the first step)"
    """What the rank is doing now (:func:`at`)."""
    checkpoint: str | None = None
    """The newest checkpoint this run saved or resumed from."""
    store: Any = None
    """The default process group's store (``None`` before :func:`watch`)."""
    rank: int = 0
    """This rank."""
    world: int = 1
    """Ranks in the job."""
    timeout_s: float = 600.0
    """The collective timeout the groups were made with."""
    tied: bool = False
    """:func:`tie_to_launcher` ran."""
    interrupt: Turn | None = None
    """This rank's claim on saying the interrupt (made in the SIGINT handler, before any teardown)."""
    error: Turn | None = None
    """This rank's claim on saying an error without a turn of its own (:func:`turn_of`), made by :func:`explained`
    before the job is marked as ended."""
    interrupted: bool = False
    """The stop-signal handler raised ``KeyboardInterrupt``, or the rank is winding down after an error it explains
    (a later stop signal is ignored, unless :attr:`raise_again`)."""
    signum: int = signal.SIGINT
    """The stop signal that raised it (:data:`STOP_SIGNALS`)."""
    raise_again: bool = False
    """That ``KeyboardInterrupt`` was lost where Python ignores exceptions: the next SIGINT (sent by
    :func:`_unraisable`) raises it again."""
    pid: int = 0
    """The rank's process (:func:`tie_to_launcher`); the processes it forks (checkpoint writers) inherit the SIGINT
    handler and must leave the interrupt to it."""
    stop_watch: bool = False
    """The stop watch runs (:func:`_start_stop_watch`)."""


_state = _Watch()

_PROCESS_FIELDS = ("tied", "pid", "stop_watch")
"""What :func:`new_run` keeps: this process's ties to its launcher and its stop watch, not a launch's."""


def new_run() -> None:
    """Forget what an earlier launch in this process left (its store, its claim on saying an error, an interrupt, its
    checkpoint and step): a process may run several launches one after another (a notebook, the tests), and a claim
    left by the first would make a later one's error end the process at once (:func:`turn_of`)."""
    fresh = _Watch()
    for f in fields(_Watch):
        if f.name not in _PROCESS_FIELDS:
            setattr(_state, f.name, getattr(fresh, f.name))


class SaidOnce(CfpError):
    """An error several ranks meet at once, said by the rank whose :class:`Turn` it is."""

    def __init__(self, message: str, *, turn: Turn | None = None) -> None:
        super().__init__(message)
        self.turn = turn
        """Which rank says it (``None``: every rank decides alone)."""


class RankStalledError(SaidOnce, RuntimeError):
    """A collective outlived ``train.collective_timeout_s``: some rank stopped answering."""


class RunInterrupted(SaidOnce):
    """The run was stopped by a signal of :data:`STOP_SIGNALS` (Ctrl-C, ``kill``, a scheduler); said in one line."""

    def __init__(self, message: str, *, turn: Turn | None = None, signum: int = signal.SIGINT) -> None:
        super().__init__(message, turn=turn)
        self.signum = signum
        """The signal (the exit status is 128 + it)."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    """Who says a message shared by several ranks: the first to claim ``name`` in the store."""

    store: Any
    """The default process group's store."""
    name: str
    """The message's key."""
    mine: bool
    """This rank claimed it first."""

    @classmethod
    def claim(cls, store: Any, name: str) -> Turn | None:
        """Claim ``name``; ``None`` when the store does not answer."""
        try:
            return cls(store=store, name=name, mine=int(store.add(f"{_PREFIX}/{name}/claimed", 1)) == 1)
        except Exception:  # noqa: BLE001 - the store (torchrun's agent) is gone: each rank decides alone
            return None

    def said(self) -> None:
        """Tell the waiting ranks the message is out."""
        with contextlib.suppress(Exception):
            self.store.set(f"{_PREFIX}/{self.name}/said", "1")

    def wait_said(self, seconds: float = SAID_WAIT_S) -> bool:
        """Wait until the claiming rank said it (at most ``seconds``); whether it did."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                if self.store.check([f"{_PREFIX}/{self.name}/said"]):
                    return True
            except Exception:  # noqa: BLE001
                return False
            time.sleep(POLL_S)
        return False


def tie_to_launcher() -> None:
    """Under torchrun on Linux: end this rank (SIGKILL) when its launcher dies, exit now when it has died already,
    and make Ctrl-C raise ``KeyboardInterrupt`` once. Call first thing in a rank; again is a no-op."""
    if _state.tied or "TORCHELASTIC_RUN_ID" not in os.environ and "LOCAL_RANK" not in os.environ:
        return
    _state.tied, _state.pid = True, os.getpid()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _interrupt_once)
        sys.unraisablehook = _unraisable_then(sys.unraisablehook)
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        if _launcher_gone(parent):
            os._exit(1)
        die_with_parent(parent)


def _launcher_gone(parent: int) -> bool:
    """Whether this rank was reparented to init (its launcher died before :func:`tie_to_launcher`): its parent is
    process 1 and that is no launcher (torchrun may itself be process 1 in a container)."""
    if parent != 1:
        return False
    try:
        command = Path("/proc/1/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return not any(name in command for name in ("torchrun", "torch.distributed", "deepspeed"))


def _interrupt_once(signum: int, frame: Any) -> None:
    if os.getpid() != _state.pid:  # a forked child (a checkpoint writer): its rank decides, and it dies with it
        return
    if not _LOCK.acquire(blocking=False):
        return  # the stop watch is ending the rank already (a handler must not wait for it)
    try:
        if _state.interrupted and not _state.raise_again:
            return  # the same Ctrl-C again (torchrun forwards it) while winding down
        again = _state.raise_again
        _state.interrupted, _state.raise_again = True, False
        if not again:
            _state.signum = signum
    finally:
        _LOCK.release()
    if not again and signum != signal.SIGINT and _ended_by_another():
        exit_now(128 + signum)  # torchrun stops this rank after another one said why the job ends
    _interrupt_turn()  # before this rank's teardown closes its connections: the peers then find the reason
    raise KeyboardInterrupt


_LOCK = threading.Lock()
"""Held while the SIGINT handler or the stop watch (:func:`_stop_watch`) decides who ends the rank."""
STOP_GRACE_S = 5.0
"""How long the main thread has to act on a stop signal before the stop watch says it and ends the rank itself:
Python runs signal handlers only between bytecodes, so a rank blocked in a collective (its peer stalled or gone)
would not act on it before ``train.collective_timeout_s``, and torchrun kills it 30 s after its SIGTERM."""


def _start_stop_watch() -> None:
    """Have the stop signals written to a pipe (``signal.set_wakeup_fd``, done by the interpreter as a signal
    arrives, whatever the main thread does) that a daemon thread reads (:func:`_stop_watch`); not in forked
    children, which leave stop signals to their rank. Main thread only; once."""
    if _state.stop_watch:
        return
    read, write = os.pipe()
    os.set_blocking(write, False)
    signal.set_wakeup_fd(write, warn_on_full_buffer=False)
    os.register_at_fork(after_in_child=_untie_wakeup)
    _state.stop_watch = True
    threading.Thread(target=_stop_watch, args=(read,), name="cfp-stop-watch", daemon=True).start()


def _untie_wakeup() -> None:
    with contextlib.suppress(ValueError):  # a child forked by another thread than its main one
        signal.set_wakeup_fd(-1)


def _stop_watch(fd: int) -> None:
    """For each stop signal read from ``fd``: when the main thread has not acted on it within :data:`STOP_GRACE_S`,
    say it (once per job: the interrupt's turn) and end the rank with 128 + the signal."""
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            return
        for signum in data:
            if signum not in STOP_SIGNALS:
                continue
            deadline = time.monotonic() + STOP_GRACE_S
            while not _state.interrupted and time.monotonic() < deadline:
                time.sleep(POLL_S)
            with _LOCK:
                if _state.interrupted:
                    continue  # the main thread acts on it (or is winding down already)
                _state.interrupted, _state.signum = True, signum
            _end_from_watch(signum)


STORE_WAIT_S = 2.0
"""How long the stop watch waits for the store: the main thread may hold the store's one connection, blocked in a
call that waits for a peer (joining a process group), and the store then answers nobody else."""


def _end_from_watch(signum: int) -> None:
    """End this rank for ``signum`` from the stop watch: quietly when another rank has said why the job ends, else
    after saying it where it is this rank's turn (rank 0's when the store does not answer)."""
    answered, ended = _bounded(_ended_by_another)
    if signum != signal.SIGINT and ended:
        exit_now(128 + signum)
    claimed = answered and _bounded(_interrupt_turn)[0]
    err = interrupted(signum, claim=claimed)
    if my_turn(err, _state.rank):
        with contextlib.suppress(Exception):
            print(interrupt_line(err, _state.rank), file=sys.stderr, flush=True)
        said(err)
    exit_now(128 + signum)


def _bounded(fn: Any) -> tuple[bool, Any]:
    """``fn()`` run in a daemon thread for at most :data:`STORE_WAIT_S`: whether it returned, and what."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    worker.start()
    worker.join(STORE_WAIT_S)
    return (True, out[0]) if out else (False, None)


def interrupt_line(err: RunInterrupted, rank: int) -> str:
    """The one line that says ``err`` on rank ``rank`` (``[rank N]`` for a rank other than 0)."""
    return f"cfp-megatron{f' [rank {rank}]' if rank else ''}: {err}"


def error_text(err: CfpError, rank: int | None = None) -> tuple[str, str]:
    """The title (with ``[rank N]`` for a rank other than 0) and the body of the message for ``err`` (an interrupt:
    one line, no body)."""
    if isinstance(err, RunInterrupted):
        return interrupt_line(err, rank or 0), ""
    return f"cfp-megatron: {type(err).__name__}{f' [rank {rank}]' if rank else ''}", str(err)


def _ended_by_another() -> bool:
    """Whether another rank has ended the job with a message (:func:`explained`'s mark in the store)."""
    try:
        return bool(_state.store is not None and _state.store.check([f"{_PREFIX}/ended"]))
    except Exception:  # noqa: BLE001 - the store is gone: nothing known
        return False


def _winding_down(err: CfpError) -> None:
    """This rank ends the job with ``err``: later stop signals (torchrun's SIGTERM once the first rank exits) are
    ignored, the first rank to end the job with an error that has no turn of its own says it (:func:`turn_of`), and
    the ranks torchrun stops, or whose collectives fail, after that exit quietly (:func:`_ended_by_another`)."""
    _state.interrupted = True
    if _state.store is None:
        return
    if not isinstance(err, SaidOnce) and _state.error is None:
        _state.error = Turn.claim(_state.store, "error")  # before the mark: a peer that sees it finds the claim
    with contextlib.suppress(Exception):
        _state.store.set(f"{_PREFIX}/ended", str(_state.rank))


def _unraisable_then(previous: Any) -> Any:
    """``sys.unraisablehook`` that raises a lost interrupt again (:func:`_unraisable`), else calls ``previous``."""
    def hook(unraisable: Any) -> None:
        if not _unraisable(unraisable):
            previous(unraisable)
    return hook


def _unraisable(unraisable: Any) -> bool:
    """Whether ``unraisable`` is this rank's ``KeyboardInterrupt``, lost where Python ignores exceptions; it is then
    raised again once that code has returned: a SIGINT for :func:`_interrupt_once`, sent from a thread after
    :data:`RAISE_AGAIN_S` (sent from the hook itself, it would be handled, and lost, inside the hook)."""
    if not (_state.interrupted and isinstance(unraisable.exc_value, KeyboardInterrupt) and os.getpid() == _state.pid):
        return False
    _state.raise_again = True
    timer = threading.Timer(RAISE_AGAIN_S, os.kill, (os.getpid(), signal.SIGINT))
    timer.daemon = True
    timer.start()
    return True


def _interrupt_turn() -> Turn | None:
    if _state.interrupt is None and _state.store is not None:
        _state.interrupt = Turn.claim(_state.store, "interrupted")
        if _state.interrupt is not None and _state.interrupt.mine:
            with contextlib.suppress(Exception):  # which signal, for the peers that follow (_said_by_peer)
                _state.store.set(f"{_PREFIX}/interrupted/signal", str(int(_state.signum)))
    return _state.interrupt


def watch(store: Any, *, rank: int, world: int, timeout_s: float) -> None:
    """Record progress in ``store`` (the default process group's) from now on; under :func:`tie_to_launcher`, SIGTERM
    and SIGHUP end the run in one line from now on, as SIGINT does."""
    _state.store, _state.rank, _state.world, _state.timeout_s = store, rank, world, timeout_s
    if _state.tied and threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, _interrupt_once)
        _start_stop_watch()
    at(_state.where)


def at(where: str) -> None:
    """Say what this rank does now (``step 8 of 20``); kept locally and, once :func:`watch` ran, in the store."""
    _state.where = where
    if _state.store is None:
        return
    record = {"where": where, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    with contextlib.suppress(Exception):  # progress is advisory; a store that is gone shows at the next collective
        _state.store.set(f"{_PREFIX}/rank/{_state.rank}", json.dumps(record))


def timeout_s() -> float:
    """The collective timeout of the default process group (:func:`watch`; torch's 600 s before)."""
    return _state.timeout_s


def saved(checkpoint: str) -> None:
    """Remember the newest checkpoint this run saved or resumed from (said when the run is interrupted)."""
    _state.checkpoint = checkpoint


def is_collective_timeout(err: BaseException) -> bool:
    """Whether ``err`` (or an error it was raised from) is a collective outliving the process group's timeout."""
    return _has_mark(err, _TIMEOUT_MARKS)


def _has_mark(err: BaseException, marks: tuple[str, ...]) -> bool:
    """Whether ``err`` or an error it was raised from is a RuntimeError whose text holds one of ``marks``."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError) and any(mark in str(current) for mark in marks):
            return True
        current = current.__cause__ or current.__context__
    return False


class RankLostError(SaidOnce, RuntimeError):
    """A peer of this rank closed its connections without saying why (killed, crashed): said once per job."""


def _said_by_peer() -> CfpError | None:
    """This rank's peer went away: when it did so because it was interrupted, named a stalled rank or ended the
    job with an error (its claim is in the store, looked for during :data:`PEER_WAIT_S`), the same error, said by
    that peer; else a :class:`RankLostError` (the first rank to lose a peer says it); ``None`` without a store."""
    store = _state.store
    if store is None:
        return None
    deadline = time.monotonic() + PEER_WAIT_S
    while True:
        try:
            if store.check([f"{_PREFIX}/interrupted/claimed"]):
                key = f"{_PREFIX}/interrupted/signal"
                signum = int(store.get(key)) if store.check([key]) else _state.signum
                return interrupted(signum)
            if store.check([f"{_PREFIX}/stalled/claimed"]):
                return RankStalledError(f"a peer of rank {_state.rank} ended the job for a rank that stopped "
                                        f"answering while rank {_state.rank} was in {_state.where}.",
                                        turn=Turn.claim(store, "stalled"))
            if store.check([f"{_PREFIX}/ended"]):
                return SaidOnce(f"another rank ended the job with an error (its message says which) while rank "
                                f"{_state.rank} was in {_state.where}.", turn=Turn.claim(store, "error"))
        except Exception:  # noqa: BLE001 - the store is gone too
            return None
        if time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return RankLostError(f"a peer of rank {_state.rank} closed its connections without saying why while rank "
                         f"{_state.rank} was in {_state.where}: it was killed (the OOM killer, kill -9) or crashed "
                         f"(its own output above says how); torchrun's summary names it{_last_checkpoint()}.\n"
                         "Fix: see why that rank ended (its traceback, dmesg for the OOM killer), then start the job "
                         "again.",
                         turn=Turn.claim(store, "error"))


def explained(err: BaseException) -> CfpError | None:
    """``err`` as the error a user should read: a CfpError as it is, a collective timeout as a
    :class:`RankStalledError`, a ``KeyboardInterrupt`` as a :class:`RunInterrupted`, a peer gone as what it said
    (or a :class:`RankLostError`), a file that cannot be read or opened where the run used it as a
    :class:`~cfp_megatron.base.files.FileAccessError`; ``None`` for anything else (its traceback stands)."""
    try:
        found = _explain(err)
    except KeyboardInterrupt:  # a stop signal while this rank looked for the reason (a peer's claim)
        found = interrupted()
    if found is not None:
        _winding_down(found)
    return found


def _explain(err: BaseException) -> CfpError | None:
    if isinstance(err, CfpError):
        return err
    if isinstance(err, KeyboardInterrupt):
        return interrupted()
    if is_collective_timeout(err):
        return stalled(err)
    if _has_mark(err, _PEER_GONE_MARKS):
        return _said_by_peer()
    return access_error(err, _state.where)


def _last_checkpoint() -> str:
    """The clause that ends a message of a run that stopped: where to continue from."""
    return (f"; the last checkpoint is {_state.checkpoint} (continue from it with train.resume=true)"
            if _state.checkpoint else "; no checkpoint was saved by this run")


def interrupted(signum: int | None = None, *, claim: bool = True) -> RunInterrupted:
    """The run stopped by a stop signal (default: the one this rank got, SIGINT if none) where this rank is;
    ``claim`` false: without a turn (the store cannot be asked)."""
    signum = _state.signum if signum is None else signum
    name = signal.Signals(signum).name
    sender = STOP_SIGNALS.get(signum, "")
    return RunInterrupted(f"interrupted ({name}{': ' + sender if sender else ''}) at {_state.where}"
                          f"{_last_checkpoint()}.",
                          turn=_interrupt_turn() if claim else None, signum=signum)


def stalled(err: BaseException, *, limit_s: float | None = None) -> RankStalledError:
    """The ranks that stopped answering, as seen from this rank whose collective timed out (``err``) after
    ``limit_s`` (default: the collective timeout)."""
    store, limit = _state.store, _state.timeout_s if limit_s is None else limit_s
    cause = _first_line(err)
    fix = (f"find why it stopped (stopped by a signal, swapping, a hung device or file system: its log, `top`, "
           f"`py-spy dump --pid PID` on its host); if the work is legitimately slower than {limit:g} s between two "
           f"collectives (a slow save, a first step that compiles), raise {TIMEOUT_KEY} (now {_state.timeout_s:g}).")
    if store is None:
        return RankStalledError(f"a collective did not complete within {limit:g} s ({TIMEOUT_KEY}) while rank "
                                f"{_state.rank} was in {_state.where} ({cause}).\nFix: {fix}")
    waiting, records = _waiting_ranks(store)
    behind = [r for r in range(_state.world) if r not in waiting]
    turn = Turn.claim(store, "stalled")
    return RankStalledError(stall_message(behind, sorted(waiting), records, limit=limit, cause=cause, fix=fix,
                                          here=_state.where), turn=turn)


def _first_line(err: BaseException) -> str:
    """The error's first line without gloo's ``[source.cc:78]`` prefix."""
    text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text


def _waiting_ranks(store: Any) -> tuple[set[int], dict[int, dict[str, Any]]]:
    """Mark this rank as waiting; within :data:`GRACE_S`, the ranks that marked so too and every rank's record."""
    waiting: set[int] = set()
    records: dict[int, dict[str, Any]] = {}
    with contextlib.suppress(Exception):
        store.set(f"{_PREFIX}/waiting/{_state.rank}", _state.where)
        deadline = time.monotonic() + GRACE_S
        while True:
            keys = [f"{_PREFIX}/waiting/{r}" for r in range(_state.world)]
            waiting = {r for r, key in enumerate(keys) if store.check([key])}
            if len(waiting) >= _state.world - 1 or time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        for r in range(_state.world):
            key = f"{_PREFIX}/rank/{r}"
            if store.check([key]):
                records[r] = json.loads(store.get(key))
    return waiting, records


def stall_message(behind: list[int], waiting: list[int], records: dict[int, dict[str, Any]], *, limit: float,
                  cause: str, fix: str, here: str) -> str:
    """The message naming the ranks ``behind`` (with their host, pid and progress from ``records``) that the ranks
    ``waiting`` gave up on after ``limit`` seconds, in a collective of ``here`` (the saying rank's progress)."""
    def who(rank: int) -> str:
        r = records.get(rank)
        if r is None:
            return f"rank {rank} (no progress recorded)"
        since = f" (for {time.time() - r['time']:.0f} s)" if rank not in waiting else ""
        return f"rank {rank} (host {r['host']}, pid {r['pid']}) in {r['where']}{since}"

    def ranks(items: list[int]) -> str:
        return f"rank{'s' if len(items) != 1 else ''} {', '.join(str(r) for r in items)}" if items else "no rank"

    if behind:
        head = (f"{'; '.join(who(r) for r in behind)} stopped answering: {ranks(waiting)} waited {limit:g} s "
                f"({TIMEOUT_KEY}) for {'it' if len(behind) == 1 else 'them'} in a collective of {here} and gave up")
    else:
        head = (f"every rank waited {limit:g} s ({TIMEOUT_KEY}) in a collective that did not complete "
                f"({'; '.join(who(r) for r in sorted(records))})")
    return f"{head} ({cause}).\nFix: {fix}"


def turn_of(err: CfpError) -> Turn | None:
    """Who says ``err``: its own :class:`Turn` (a stalled rank, an interrupt); for another error met once the process
    group exists, the first rank to end the job with one (:func:`explained`'s claim), so an error only one rank
    meets is said at once, by it, and one every rank meets is said once per job; ``None`` before the group."""
    return err.turn if isinstance(err, SaidOnce) else _state.error


def my_turn(err: CfpError, rank: int, *, wait_s: float = SAID_WAIT_S) -> bool:
    """Whether this rank says ``err``: its :func:`turn_of` is this rank's, or it never came from the rank whose it is
    (waited for at most ``wait_s``); rank 0 for an error without one."""
    turn = turn_of(err)
    if turn is None:
        return rank == 0
    return turn.mine or not turn.wait_said(wait_s)


def said(err: CfpError) -> None:
    """Tell the ranks waiting in :func:`my_turn` that ``err`` is out."""
    turn = turn_of(err)
    if turn is not None:
        turn.said()


def exit_status(err: CfpError) -> int:
    """The exit status for ``err``: 128 + the signal after an interrupt (130 for SIGINT), else 2."""
    return 128 + int(err.signum) if isinstance(err, RunInterrupted) else ERROR_STATUS


def exit_now(status: int) -> None:
    """Flush and end the process with ``status`` without Python's shutdown (a process group left with a timed-out
    collective aborts the interpreter at exit: 'terminate called without an active exception')."""
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(status)


__all__ = ["ERROR_STATUS", "GRACE_S", "STOP_GRACE_S", "STOP_SIGNALS", "TIMEOUT_KEY",
           "RankLostError", "RankStalledError", "RunInterrupted", "SaidOnce", "Turn", "at", "error_text", "exit_now",
           "exit_status", "explained", "new_run", "interrupt_line", "interrupted", "is_collective_timeout", "my_turn",
           "said", "saved", "stall_message", "stalled", "tie_to_launcher", "timeout_s", "turn_of", "watch"]
