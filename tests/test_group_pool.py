"""tests/group_pool.py: Megatron's groups set aside between the multi-rank job's cases and reused only for the same
layout, only while alive (one gloo process)."""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from cfp_megatron.compat.cpu import install_if_needed
from cfp_megatron.engine import distributed
from tests.group_pool import GroupPool


def test_groups_are_reused_for_the_same_layout_only_and_never_once_destroyed(tmp_path) -> None:
    install_if_needed()
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    registered = dist.distributed_c10d._world.pg_map
    pool = GroupPool()
    try:
        pool.initialize(tensor_model_parallel_size=1, distributed_timeout_minutes=3)
        tp, buffer = parallel_state.get_tensor_model_parallel_group(), parallel_state.get_global_memory_buffer()
        parallel_state.set_virtual_pipeline_model_parallel_rank(1)  # what a case's schedule leaves behind
        pool.release()
        assert not parallel_state.model_parallel_is_initialized() and tp in registered  # set aside, alive
        assert parallel_state.get_virtual_pipeline_model_parallel_rank() is None
        pool.initialize(tensor_model_parallel_size=1, distributed_timeout_minutes=3)
        assert (pool.made, pool.reused) == (1, 1) and parallel_state.get_tensor_model_parallel_group() is tp
        assert parallel_state.get_global_memory_buffer() is not buffer  # scratch tensors not carried over
        assert parallel_state.get_virtual_pipeline_model_parallel_rank() is None  # as the first call left it
        pool.release()
        pool.initialize(tensor_model_parallel_size=1, distributed_timeout_minutes=2)  # another layout: its own
        assert (pool.made, pool.reused) == (2, 1) and parallel_state.get_tensor_model_parallel_group() is not tp
        pool.release()
        pool.initialize(tensor_model_parallel_size=1, distributed_timeout_minutes=3)
        assert (pool.made, pool.reused) == (2, 2) and parallel_state.get_tensor_model_parallel_group() is tp
        distributed.destroy_model_parallel_groups()  # as a profiling probe ends whatever groups are up
        assert tp not in registered
        pool.initialize(tensor_model_parallel_size=1, distributed_timeout_minutes=3)  # made again, not reused
        assert (pool.made, pool.reused) == (3, 2) and parallel_state.get_tensor_model_parallel_group() is not tp
        assert parallel_state.get_tensor_model_parallel_group() in registered
        pool.clear()
        assert len(registered) == 1 and not parallel_state.model_parallel_is_initialized()  # the default group only
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_serving_routes_the_launch_paths_groups_through_the_pool_and_puts_it_back() -> None:
    before = distributed.init_distributed, distributed.destroy_distributed
    pool = GroupPool()
    with pool.serving():
        assert distributed.destroy_distributed == pool.release and distributed.init_distributed is not before[0]
    assert (distributed.init_distributed, distributed.destroy_distributed) == before
