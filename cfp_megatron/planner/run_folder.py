"""The run folder under ``outputs/``: named by when its launch started and the plan it trains, and a failed launch's
folder removed or marked.

Hydra makes ``outputs/<YYYY-mm-dd_HH-MM-SS>_launch-<launch id>`` before the plan exists
(:func:`~cfp_megatron.base.launch_env.run_id`); once every rank has the plan, rank 0 renames it
``<time>_<plan hash>`` (:func:`settle`) and leaves the launch's marker in its ``.hydra/``, so that a torchrun restart
resolves the same folder. A launch that fails leaves no folder that looks like a run (:func:`end_failed`): one that
holds nothing but Hydra's own files is removed, any other has ``_failed`` (``_stopped`` after a stop signal) added to
its name and the error in ``error.txt``. A ``hydra.run.dir`` the user named is theirs: never renamed nor removed (a
failure is written to its ``error.txt``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from pathlib import Path

from cfp_megatron.base.files import write_atomic
from cfp_megatron.base.launch_env import LAUNCH_MARKER, PENDING, LaunchEnv, launch_folder, launch_id
from cfp_megatron.engine.rank_watch import RunInterrupted

FAILED = "_failed"
"""What a failed launch's run folder gets added to its name."""
STOPPED = "_stopped"
"""What the run folder of a launch stopped by a signal (Ctrl-C, SIGTERM) gets added to its name."""
ERROR_FILE = "error.txt"
"""The failed launch's message, in its run folder."""
HYDRA_OWN = frozenset({".hydra", "train.log"})
"""What Hydra writes into every run folder before the job runs: a folder with nothing else holds no result."""
_PENDING_NAME = re.compile(rf"(\d{{4}}-\d\d-\d\d_\d\d-\d\d-\d\d){re.escape(PENDING)}[\w.-]+")
_SETTLED_NAME = re.compile(r"\d{4}-\d\d-\d\d_\d\d-\d\d-\d\d_[0-9a-f]{16}(-\d+)?")


def settle(run_dir: Path | None, plan_hash: str, env: LaunchEnv) -> Path | None:
    """The run folder once the plan is known: a folder of the default name (``<time>_launch-<id>``) renamed by rank 0
    to ``<time>_<plan_hash>`` (``-2``, ``-3``... where that is taken), with the launch's marker in it. The other ranks
    get the name it will have (they write nothing there) and remove the empty copy of the first name their own Hydra
    made where rank 0 renamed it already, or on another node. Any other folder stays as it is."""
    if run_dir is None:
        return None
    pending = _PENDING_NAME.fullmatch(run_dir.name)
    if pending is None:
        return run_dir
    target = run_dir.with_name(f"{pending.group(1)}_{plan_hash}")
    if env.rank != 0:
        if env.rank != env.local_rank or launch_folder(run_dir.parent) is not None:
            with contextlib.suppress(OSError):  # not empty: rank 0's, not renamed yet
                run_dir.rmdir()
        return target
    n = 2
    while target.exists():
        target = run_dir.with_name(f"{pending.group(1)}_{plan_hash}-{n}")
        n += 1
    try:
        (run_dir / ".hydra").mkdir(exist_ok=True)
        (run_dir / ".hydra" / f"{LAUNCH_MARKER}{launch_id()}").touch()  # renamed with the folder, in one step
        os.rename(run_dir, target)
    except OSError:
        return run_dir  # the folder keeps its first name; the run goes on in it
    return target


def end_failed(run_dir: Path | None, err: BaseException, env: LaunchEnv) -> None:
    """On rank 0, after ``err`` (a user error, or a crash) ended the launch whose Hydra run folder is ``run_dir``
    (or the folder :func:`settle` renamed it to): remove a folder of the project's naming that holds only Hydra's
    files; add ``_failed`` (``_stopped`` for an interrupt) to one that holds more and write ``err`` to its
    ``error.txt``; write only the ``error.txt`` of a folder the user named."""
    if run_dir is None or env.rank != 0:
        return
    if not run_dir.is_dir() and _PENDING_NAME.fullmatch(run_dir.name):
        run_dir = launch_folder(run_dir.parent) or run_dir
    if not run_dir.is_dir():
        return
    ours = _PENDING_NAME.fullmatch(run_dir.name) or _SETTLED_NAME.fullmatch(run_dir.name)
    with contextlib.suppress(OSError):
        if ours and {p.name for p in run_dir.iterdir()} <= HYDRA_OWN and env.restart_count == 0:
            shutil.rmtree(run_dir)
            return
        folder = run_dir
        if ours:
            folder = run_dir.with_name(run_dir.name + (STOPPED if isinstance(err, RunInterrupted) else FAILED))
            os.rename(run_dir, folder)
        write_atomic(folder / ERROR_FILE, f"{type(err).__name__}: {err}\n")


__all__ = ["ERROR_FILE", "FAILED", "HYDRA_OWN", "STOPPED", "end_failed", "settle"]
