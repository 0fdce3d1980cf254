"""Process-group teardown: Megatron's groups rebuilt many times in one process (as profiling does) leave no group
behind once destroyed (one gloo process)."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from cfp_megatron.compat.cpu import install_if_needed
from cfp_megatron.engine.distributed import destroy_model_parallel_groups


def test_rebuilt_megatron_groups_are_destroyed(tmp_path) -> None:
    install_if_needed()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        registered = dist.distributed_c10d._world.pg_map
        for _ in range(3):
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
            assert len(registered) > 1  # Megatron's groups (and their gloo copies)
            destroy_model_parallel_groups()
            assert len(registered) == 1  # the default group only
            assert not parallel_state.model_parallel_is_initialized()
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
