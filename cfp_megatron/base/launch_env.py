"""What torchrun tells a worker through its environment (no torch.distributed calls)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass


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


def run_id() -> str:
    """A name for this run that every rank of one torchrun job agrees on, and that survives worker restarts.

    torchrun's rendezvous id when it set one (``--rdzv-id``, or the uuid of ``--standalone``); otherwise the
    process id of the torchrun agent on this node; otherwise (a plain ``python`` run) a timestamp.
    """
    rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if rdzv and rdzv != "none":
        return rdzv
    if "LOCAL_RANK" in os.environ:
        return f"torchrun-{time.strftime('%Y-%m-%d')}-{os.getppid()}"
    return time.strftime("%Y-%m-%d_%H-%M-%S")
