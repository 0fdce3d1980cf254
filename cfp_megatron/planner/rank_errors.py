"""Saying a user error (a :class:`~cfp_megatron.base.errors.CfpError`) once per node, on every rank's way out.

Every rank finds the same config error before any process group exists, and torchrun stops the other ranks as soon
as the first one exits: a rank that exits before the message is out may get the printing rank killed. So the first
rank of each node (local rank 0) prints the message, flushes stderr, writes it to its torchrun error file (torchrun
then shows it as the root cause in its closing summary) and leaves a marker in the attempt's log folder; the other
ranks wait for that marker (at most :data:`WAIT_S`), write the message to their own error file (whichever rank
exits first is the summary's root cause) before exiting, and print the message themselves, prefixed with
their rank, when it does not come (the error hit only them, or no marker folder exists). See
docs/configuration.md ("When a setting is wrong").

An error found once the process group exists (a stalled rank, Ctrl-C, a file one rank cannot read:
:mod:`cfp_megatron.engine.rank_watch`) has a :class:`~cfp_megatron.engine.rank_watch.Turn` instead
(:func:`~cfp_megatron.engine.rank_watch.turn_of`): the first rank to claim it in the process group's store says it,
on any node, at once, and the others wait for it to be said; :func:`report_and_exit` ends the rank with the status
each kind has (2; 128 + the signal for an interrupt: 130 for Ctrl-C).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from pathlib import Path
from typing import NoReturn, TextIO

from rich.console import Console

from cfp_megatron.base.errors import CfpError
from cfp_megatron.base.files import write_atomic
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.engine.rank_watch import RunInterrupted, SaidOnce, error_text, exit_now, exit_status, turn_of

WAIT_S = 30.0
"""How long a rank other than its node's first waits for that rank to have printed the message."""
INTERRUPT_WAIT_S = 3.0
"""The same wait for an interrupt seen before any process group exists (Ctrl-C reaches every rank at once; a
``kill -INT`` of one rank only that one, which then says it itself)."""
POLL_S = 0.05
"""How often a waiting rank looks for the marker."""
MARKER = "cfp-error-printed"
"""File the printing rank writes into torchrun's attempt log folder once the message is on stderr."""
LEFT = "cfp-error-left-"
"""File a rank that left the saying to its node's first rank writes beside :data:`MARKER` as it ends
(``cfp-error-left-<local rank>``, holding its process id)."""
LEAVE_WAIT_S = 5.0
"""How long the printing rank waits for the node's other ranks to have ended quietly before it ends itself."""
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
"""Where torchrun reads a worker's error (``<log dir>/<run>/attempt_<n>/<local rank>/error.json``)."""


def marker_path() -> Path | None:
    """The marker of this torchrun attempt on this node: beside the local ranks' error-file folders (one folder per
    launch and attempt, made by torchrun); ``None`` without torchrun's error file."""
    error_file = os.environ.get(ERROR_FILE_ENV, "")
    if not error_file or error_file == os.devnull:
        return None
    return Path(error_file).parent.parent / MARKER


def report_error(err: CfpError, env: LaunchEnv | None = None, *, stream: TextIO | None = None,
                 wait_s: float | None = None) -> bool:
    """Say ``err`` as described in the module docstring; return whether this rank printed it. Returns only once the
    message is on ``stream`` (default ``sys.stderr``, flushed) or the rank whose turn it is (the node's first, or
    the error's :class:`~cfp_megatron.engine.rank_watch.Turn`) has marked it said; ``wait_s`` (default
    :data:`WAIT_S`, read at the call) bounds that wait."""
    wait_s = WAIT_S if wait_s is None else wait_s
    env = env if env is not None else LaunchEnv.read()
    _quiet.left_to_first = False
    found = time.time()
    marker = marker_path()
    title, body = error_text(err, env.rank)
    turn = turn_of(err)
    if turn is not None and not turn.mine and turn.wait_said(wait_s):
        _write_error_file(f"{title}\n{body}".rstrip(), found)  # torchrun's summary may pick this rank
        return False
    if turn is None and env.under_torchrun and env.local_rank != 0 and marker is not None \
            and _wait_for(marker, wait_s):
        _write_error_file(f"{title}\n{body}".rstrip(), found)  # this rank may exit first: torchrun's root cause
        _quiet.left_to_first = not isinstance(err, RunInterrupted)  # end_rank ends it quietly
        return False
    out = stream if stream is not None else sys.stderr
    console = Console(file=out, highlight=False, soft_wrap=True)
    console.print(title, style="bold red", markup=False)
    if body:
        console.print(body, markup=False)
    out.flush()
    _write_error_file(f"{title}\n{body}".rstrip(), found)
    if turn is not None:
        turn.said()
    if env.local_rank == 0 and marker is not None:
        with contextlib.suppress(OSError):  # else the waiting ranks print it themselves after WAIT_S
            write_atomic(marker, f"{env.rank}\n")
        if turn is None and env.under_torchrun and not isinstance(err, RunInterrupted):
            _wait_for_the_others(marker, env.local_world_size)
    return True


class _Quiet:
    left_to_first = False
    """The last :func:`report_error` of this process left the saying to its node's first rank."""


_quiet = _Quiet()


def end_rank(status: int) -> NoReturn:
    """End this rank after :func:`report_error` said a config error: with ``status``; a rank that left the saying
    to its node's first rank ends with status 0 at once instead (its process has nothing to clean up: no process
    group exists yet), after marking that it left (:data:`LEFT`). The first rank waits for that before it ends, so
    torchrun's closing summary lists one failure, the rank that said it (torchrun prints its traceback and summary
    for any rank that ends with another status than 0, and ends with status 1)."""
    marker = marker_path()
    if _quiet.left_to_first and marker is not None:
        env = LaunchEnv.read()
        with contextlib.suppress(OSError):
            write_atomic(marker.with_name(f"{LEFT}{env.local_rank}"), f"{os.getpid()}\n")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(status)


def _wait_for_the_others(marker: Path, ranks: int) -> None:
    """Wait (at most :data:`LEAVE_WAIT_S`) until the node's other ``ranks - 1`` ranks have marked that they left
    and their processes have ended (gone, or a zombie torchrun has not reaped yet)."""
    deadline = time.monotonic() + LEAVE_WAIT_S
    for local_rank in range(1, ranks):
        left = marker.with_name(f"{LEFT}{local_rank}")
        if not _wait_for(left, max(0.0, deadline - time.monotonic())):
            return  # that rank did not meet the error (or is slow): torchrun stops it, as before
        try:
            pid = int(left.read_text())
        except (OSError, ValueError):
            continue
        while not _ended(pid) and time.monotonic() < deadline:
            time.sleep(POLL_S)


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie torchrun has not reaped yet (Linux's ``/proc``;
    elsewhere once it is gone)."""
    if not Path("/proc/self").exists():
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except OSError:
            return False
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X")


def report_and_exit(err: CfpError, env: LaunchEnv | None = None) -> NoReturn:
    """Say ``err`` (:func:`report_error`) and end this rank: status 128 + the signal for an interrupt
    (:class:`~cfp_megatron.engine.rank_watch.RunInterrupted`), 2 otherwise; once the process group exists (the error
    has a turn) without Python's shutdown: a group left with a collective in flight aborts it, or hangs it until
    torchrun's SIGTERM, and the finalizers of objects the error left half-built print tracebacks."""
    report_error(err, env, wait_s=INTERRUPT_WAIT_S if isinstance(err, RunInterrupted) and err.turn is None
                 else WAIT_S)
    if isinstance(err, SaidOnce) or turn_of(err) is not None:
        exit_now(exit_status(err))
    end_rank(exit_status(err))


def _wait_for(marker: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not marker.exists():
        if time.monotonic() >= deadline:
            return False
        time.sleep(POLL_S)
    return True


def _write_error_file(text: str, found: float) -> None:
    """Write ``text`` to torchrun's error file in the layout its ``ProcessFailure`` reads (the ``py_callstack`` is
    what its summary shows); nothing without one."""
    path = os.environ.get(ERROR_FILE_ENV, "")
    if not path or path == os.devnull:
        return
    data = {"message": {"message": text.splitlines()[0], "extraInfo": {"py_callstack": text,
                                                                        "timestamp": str(int(found))}}}
    with contextlib.suppress(OSError):  # the message is on stderr already
        write_atomic(path, json.dumps(data))


__all__ = ["INTERRUPT_WAIT_S", "LEAVE_WAIT_S", "LEFT", "WAIT_S", "end_rank", "marker_path", "report_and_exit",
           "report_error"]
