"""What tests/test_profile_complete.py's gloo ranks run (``mp.spawn`` pickles a function by its module): a module
that imports only the round runner, so each spawned rank does not import the test module and what it imports
(Hydra's composition, the profiler's rounds, Megatron-Core)."""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from cfp_megatron.profile.control import Step, run_round


def oom_on_one_rank(rank: int, world: int, tmp: str) -> None:
    """One of two gloo ranks runs out of memory in one step: both record it and go on together (each rank writes
    its round's status, entries out of memory and results to ``{tmp}/rank{rank}.json``)."""
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    try:
        def big() -> list[float]:
            if rank == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (rank 1 only)")
            return [1.0]

        steps = [Step(label="build a", run=list),
                 Step(label="a mbs=1", run=lambda: [float(rank + 1)], entry="a mbs=1", needs="build a"),
                 Step(label="a mbs=8", run=big, entry="a mbs=8", needs="build a"),
                 Step(label="a mbs=2", run=lambda: [2.0], entry="a mbs=2", needs="build a")]
        results, record = run_round("segments", steps, seconds=60.0)
        with open(f"{tmp}/rank{rank}.json", "w") as fh:
            json.dump({"status": record.status.value, "over_memory": list(record.over_memory),
                       "results": [[r.label, list(r.values)] for r in results]}, fh)
    finally:
        dist.destroy_process_group()
