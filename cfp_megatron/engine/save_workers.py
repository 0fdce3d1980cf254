"""Keep Megatron's checkpoint-writer processes from outliving the rank that started them.

``dist_checkpointing.save`` (torch_dist format, synchronous or asynchronous) writes through Megatron's
``FileSystemWriterAsync``: it forks one writer per bucket, and the first save starts a ``multiprocessing`` Manager
(a *spawned* interpreter) whose queue collects the writers' results. A spawned interpreter re-imports the
parent's ``__main__`` script (the launch script: torch, Megatron-Core and Hydra, ~350 MB and seconds of CPU per
rank), which the Manager's server never uses: :func:`_results_queue` starts it with ``__main__`` hidden.
When the rank is killed (SIGKILL, OOM killer, torchrun tearing a failed job down), nothing stops that Manager: it is
reparented to init and lives on. Here the Manager is started by us with ``PR_SET_PDEATHSIG`` (Linux: the kernel
sends SIGKILL when its parent dies) and every child forked during a save gets the same, so a kill of the rank ends
its writers too. A clean exit shuts the Manager down as before (multiprocessing's finalizer).
The queue's items (the writers' ``WriteResult`` lists, torch.distributed.checkpoint objects) travel to and from the
Manager's server already pickled (:class:`BytesQueueProxy`): a server that unpickled them would import torch for
them (seconds of CPU and ~250 MB per saving rank) only to pickle them again for the reader.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import types
from collections.abc import Iterator
from multiprocessing.managers import BaseProxy, SyncManager
from typing import Any

_PR_SET_PDEATHSIG = 1
_state: dict[str, Any] = {"active": False, "hooked": False, "manager": None, "parent": None}


def die_with_parent(parent_pid: int) -> None:
    """In a child process: ask the kernel for SIGKILL when the parent dies; exit now if it died already."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def _before_fork() -> None:
    _state["parent"] = os.getpid()


def _after_fork_in_child() -> None:
    if _state["active"] and _state["parent"] is not None:
        die_with_parent(_state["parent"])


@contextlib.contextmanager
def _main_hidden() -> Iterator[None]:
    """While inside, ``__main__`` is an empty module: a process spawned then does not run the parent's script's
    imports (``multiprocessing.spawn`` re-imports the main module's file or module name in the child)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


class BytesQueueProxy(BaseProxy):
    """A proxy of a Manager's ``queue.Queue`` whose items are pickled by the process that puts them and unpickled by
    the one that gets them: the server holds bytes and never imports the items' classes. The methods Megatron's
    writer uses (``put``, ``get_nowait``) and ``get``."""

    _exposed_ = ("put", "get", "get_nowait")

    def put(self, item: Any, block: bool = True, timeout: float | None = None) -> None:
        """Put ``item`` (pickled here)."""
        self._callmethod("put", (pickle.dumps(item), block, timeout))

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        """The next item (``queue.Empty`` as ``queue.Queue.get``)."""
        return pickle.loads(self._callmethod("get", (block, timeout)))

    def get_nowait(self) -> Any:
        """The next item, or ``queue.Empty``."""
        return pickle.loads(self._callmethod("get_nowait"))


class _SaveManager(SyncManager):
    """The Manager of the save's results queue (:class:`BytesQueueProxy`)."""


_SaveManager.register("BytesQueue", queue.Queue, BytesQueueProxy)


def _results_queue() -> Any:
    """A Manager queue whose server process dies with this one (the queue Megatron's writers report to)."""
    if _state["manager"] is None:
        manager = _SaveManager(ctx=mp.get_context("spawn"))
        with _main_hidden():
            manager.start(initializer=die_with_parent, initargs=(os.getpid(),))
        _state["manager"] = manager
        _state["queue"] = manager.BytesQueue()
    return _state["queue"]


@contextlib.contextmanager
def tied_to_this_process() -> Iterator[None]:
    """Around ``dist_checkpointing.save``: the writers it forks and the Manager it uses die with this process.
    Only from the main thread on Linux (the parent-death signal follows the thread that forked); elsewhere a no-op."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        yield
        return
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not _state["hooked"]:
        os.register_at_fork(before=_before_fork, after_in_child=_after_fork_in_child)
        _state["hooked"] = True
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = _results_queue()
    _state["active"] = True
    try:
        yield
    finally:
        _state["active"] = False
