"""What torchrun tells a worker through its environment (no torch.distributed calls)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, kw_only=True)
class LaunchEnv:
    """Rank facts read from torchrun's environment variables (or a single process without torchrun)."""

    rank: int
    """Global rank (RANK)."""
    world_size: int
    """Number of ranks (WORLD_SIZE)."""
    local_rank: int
    """Rank on this node (LOCAL_RANK)."""
    local_world_size: int
    """Ranks on this node (LOCAL_WORLD_SIZE)."""
    restart_count: int
    """How often torchrun restarted the workers (TORCHELASTIC_RESTART_COUNT)."""
    under_torchrun: bool
    """Whether torchrun (or another launcher setting RANK/WORLD_SIZE) started this process."""

    @classmethod
    def read(cls) -> LaunchEnv:
        """Read the current process's environment."""
        env = os.environ
        under = "RANK" in env and "WORLD_SIZE" in env
        world = int(env.get("WORLD_SIZE", "1"))
        return cls(rank=int(env.get("RANK", "0")), world_size=world, local_rank=int(env.get("LOCAL_RANK", "0")),
                   local_world_size=int(env.get("LOCAL_WORLD_SIZE", str(world))),
                   restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", "0")), under_torchrun=under)


STAMP_FORMAT = "%Y-%m-%d_%H-%M-%S"
"""How a run folder's name writes the time its launch started."""
PENDING = "_launch-"
"""What a run folder's name holds, after the time, until the plan is known: ``<time>_launch-<launch id>``."""
LAUNCH_MARKER = "cfp-launch-"
"""The file in a run folder's ``.hydra/`` that names the launch it belongs to (``cfp-launch-<launch id>``), so that
a torchrun restart of that launch finds the folder again once it is named by its plan."""


def launch_id() -> str:
    """This launch's id, the same on every rank of one torchrun job and across its restarts: torchrun's rendezvous
    id where it set one (``--rdzv-id``, or the uuid of ``--standalone``; at most 12 characters), else the process id
    of the torchrun agent; the process's own id without torchrun."""
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return "".join(c if c.isalnum() or c in "-." else "-" for c in rdzv)[:12]
    return str(os.getppid() if "LOCAL_RANK" in os.environ else os.getpid())


def launch_started() -> float:
    """When this launch started (seconds since the epoch): under torchrun on Linux the agent's start, which every
    local rank reads alike (``/proc``); else now."""
    if "LOCAL_RANK" in os.environ:
        try:
            stat = Path(f"/proc/{os.getppid()}/stat").read_text()
            ticks = int(stat.rpartition(")")[2].split()[19])  # field 22, starttime, in clock ticks since boot
            boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                        if line.startswith("btime "))
            return boot + ticks / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError, StopIteration):
            pass
    return time.time()


def run_id(base: str = "") -> str:
    """The run folder's name that every rank of one torchrun job agrees on (``hydra.run.dir``'s
    ``${cfp_run_id:outputs}``): ``<YYYY-mm-dd_HH-MM-SS>_launch-<launch id>`` (:func:`launch_started`,
    :func:`launch_id`), renamed to ``<time>_<plan hash>`` once the plan is known
    (:mod:`cfp_megatron.planner.run_folder`); a restart of the launch finds that folder again in ``base`` by its
    :data:`LAUNCH_MARKER`."""
    found = launch_folder(Path(base)) if base and "LOCAL_RANK" in os.environ else None
    if found is not None:
        return found.name
    return time.strftime(STAMP_FORMAT, time.localtime(int(launch_started()))) + PENDING + launch_id()


def launch_folder(base: Path) -> Path | None:
    """The run folder in ``base`` that this launch named by its plan (the one holding its :data:`LAUNCH_MARKER`),
    ``None`` before that."""
    for marker in sorted(base.glob(f"*/.hydra/{LAUNCH_MARKER}{launch_id()}")):
        return marker.parent.parent
    return None
