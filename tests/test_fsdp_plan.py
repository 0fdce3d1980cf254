"""Sharded data parallelism as a plan dimension: Megatron-FSDP's strategies and hybrid sharding, their rules, their
price in the one sharding model, the search's choice, the plan's string and its Megatron-LM arguments."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import FsdpStrategy, ParallelSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.cluster.costs import CollectiveCosts
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args
from cfp_megatron.search.search import search
from cfp_megatron.sim.sharding import Sharded, Sharding, StateBytes
from cfp_megatron.sim.simulate import predict_memory, simulate

FSDP = ("parallel.distributed_optimizer=true",)


@functools.lru_cache(maxsize=32)
def _job(*overrides: str):
    return job_from_config(compose_config(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=2",
                                           "train.global_batch_size=64", "train.seq_length=4096", *overrides]))


@pytest.mark.parametrize(("parallel", "key", "words"), [
    ({"fsdp": FsdpStrategy.optim_grads_params}, "parallel.fsdp", "distributed optimizer"),
    ({"fsdp": FsdpStrategy.optim, "distributed_optimizer": True}, "parallel.fsdp", "gradient norm"),
    ({"dp_shard_size": 8}, "parallel.dp_shard_size", "shards nothing"),
])
def test_settings_megatron_fsdp_does_not_train_are_refused_by_name(parallel: dict, key: str, words: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelSpec(**parallel)
    issue = err.value.issues[0]
    assert issue.key == key and words in issue.problem and issue.fix


def test_a_shard_group_divides_dp_x_cp_and_megatron_fsdps_hybrid_sharding_is_refused_on_cpu() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(_job(*FSDP, "parallel.dp_shard_size=3"), 16)
    assert err.value.issues[0].key == "parallel.dp_shard_size" and "16" in err.value.issues[0].problem
    ParallelDims.build(_job(*FSDP, "parallel.fsdp=optim_grads_params", "parallel.dp_shard_size=8"), 16)  # a GPU
    cpu = job_from_config(compose_config(["cluster=local", "cluster.gpus_per_node=2", *FSDP,
                                          "parallel.fsdp=optim_grads_params", "parallel.dp_shard_size=1"]))
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(cpu, 2)
    assert err.value.issues[0].key == "parallel.dp_shard_size" and "CPU" in err.value.issues[0].problem
    moe = job_from_config(compose_config(["model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=2", "parallel.ep=2",
                                          *FSDP, "parallel.fsdp=optim_grads_params", "parallel.dp_shard_size=8",
                                          "train.global_batch_size=16", "train.micro_batch_size=1"]))
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(moe, 16)
    assert [(i.key, "expert mesh" in i.problem) for i in err.value.issues] == [("parallel.dp_shard_size", True)]
    # the distributed optimizer alone hybrid-shards on CPU (the gloo run in tests/test_train_parallel.py)
    ParallelDims.build(job_from_config(compose_config(["cluster=local", "cluster.gpus_per_node=2", *FSDP,
                                                       "parallel.dp_shard_size=1"])), 2)


def test_each_strategy_shards_more_and_pays_its_collectives_in_the_passes() -> None:
    """ZeRO-1 (the distributed optimizer), ZeRO-2 and ZeRO-3 keep less of the states each; ZeRO-2 reduce-scatters
    every micro-batch's gradients in the backward passes, ZeRO-3 also gathers each layer's weights."""
    found = {}
    for fsdp in ("none", "optim_grads", "optim_grads_params"):
        found[fsdp] = simulate(_job(*FSDP, f"parallel.fsdp={fsdp}", "parallel.recompute=full"), world_size=16)
    states = {k: p.memory.parameters + p.memory.gradients + p.memory.optimizer_states for k, p in found.items()}
    assert states["none"] > states["optim_grads"] > states["optim_grads_params"]
    fsdp_s = {k: p.time.fsdp_comm_s for k, p in found.items()}
    assert fsdp_s["none"] == 0.0 < fsdp_s["optim_grads"] < fsdp_s["optim_grads_params"]
    # the exposed sync after the passes: ZeRO-1's reduce-scatter and gather, none left under ZeRO-2/3
    assert found["none"].time.dp_comm_s > found["optim_grads"].time.dp_comm_s


def test_pass_collectives_per_strategy_and_hybrid_sharding_all_reduces_across_replicas() -> None:
    costs = CollectiveCosts(_job().cluster)
    state = StateBytes.megatron(_job())
    for sharded, gathers, scatters in ((Sharded.optimizer, False, False), (Sharded.gradients, False, True),
                                       (Sharded.parameters, True, True)):
        gather_s, scatter_s = Sharding(sharded=sharded, state=state, group=16).pass_sync_s(
            costs, 2e8, weight_bytes=2.0, per_node=8)
        assert (gather_s > 0, scatter_s > 0) == (gathers, scatters)
    full = Sharding(sharded=Sharded.parameters, state=state, group=16)
    hybrid = Sharding(sharded=Sharded.parameters, state=state, group=8, replicas=2)
    assert full.step_sync_s(costs, 8e9, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8,
                            expert_per_node=8) == (0.0, 0.0)
    sync_s, _ = hybrid.step_sync_s(costs, 8e9, 0.0, grad_bytes=4.0, weight_bytes=2.0, per_node=8, expert_per_node=8)
    assert sync_s > 0  # each shard's gradients all-reduced over the 2 replicas, across the nodes
    # within a node the gather is faster than over both nodes
    assert hybrid.pass_sync_s(costs, 2e8, weight_bytes=2.0, per_node=8)[0] < full.pass_sync_s(
        costs, 2e8, weight_bytes=2.0, per_node=8)[0]
    assert hybrid.memory(8e9).weights == 2 * full.memory(8e9).weights
    memory = predict_memory(_job(*FSDP, "parallel.fsdp=optim_grads_params", "parallel.dp_shard_size=8"),
                            world_size=16)
    assert memory.parameters > predict_memory(_job(*FSDP, "parallel.fsdp=optim_grads_params"),
                                              world_size=16).parameters


def _search(*overrides: str):
    cfg = compose_config(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "+cfp=auto",
                          "cfp.constraints.tp=[1]", "cfp.constraints.pp=[1]", "cfp.constraints.cp=[1]",
                          "train.global_batch_size=16", "train.seq_length=4096", *overrides])
    job = job_from_config(cfg)
    return search(job, 8, cfp_from_config(cfg))


def test_the_search_shards_more_only_where_a_layout_does_not_fit_otherwise() -> None:
    roomy = _search("cluster.hbm_gib=400")
    assert roomy.ranked and all(r.job.parallel.fsdp is FsdpStrategy.none for r in roomy.ranked)
    tight = _search("cluster.hbm_gib=80")
    best = tight.best.job.parallel
    assert best.fsdp is not FsdpStrategy.none and best.distributed_optimizer
    # each plan that Megatron-FSDP shards would not fit with the distributed optimizer alone
    for r in tight.ranked:
        if r.job.parallel.fsdp is not FsdpStrategy.none:
            unsharded = dataclasses.replace(r.job.parallel, fsdp=FsdpStrategy.none, dp_shard_size=None)
            alone = predict_memory(dataclasses.replace(r.job, parallel=unsharded), world_size=8)
            assert alone.total_gib > r.prediction.memory.total_gib
    pinned = _search("cluster.hbm_gib=400", "cfp.fsdp=optim_grads")
    assert pinned.ranked and all(r.job.parallel.fsdp is FsdpStrategy.optim_grads for r in pinned.ranked)


def test_a_plan_carries_the_sharding_in_its_string_and_megatron_lm_arguments() -> None:
    job = _job(*FSDP, "parallel.fsdp=optim_grads_params", "parallel.dp_shard_size=8")
    plan = Plan.from_job(job, world_size=16, prediction=None, inputs_fingerprint="x")
    text = plan.canonical()
    assert "fsdp=optim_grads_params" in text and "dpsh=8" in text
    assert Plan.parse(text).parallel == plan.parallel and plan.zero_stage == 3
    args = megatron_lm_args(plan)
    assert args[args.index("--data-parallel-sharding-strategy") + 1] == "optim_grads_params"
    assert "--use-megatron-fsdp" in args and args[args.index("--num-distributed-optimizer-instances") + 1] == "2"
    assert args[args.index("--ckpt-format") + 1] == "fsdp_dtensor"
    plain = Plan.from_job(_job(*FSDP), world_size=16, prediction=None, inputs_fingerprint="x")
    assert "fsdp=" not in plain.canonical() and "--use-megatron-fsdp" not in megatron_lm_args(plain)


def test_megatron_fsdp_with_checkpoints_is_refused_and_the_search_leaves_it_out() -> None:
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(_job(*FSDP, "parallel.fsdp=optim_grads", "train.checkpoint_dir=/tmp/x"), 16)
    assert err.value.issues[0].key == "parallel.fsdp" and "train.checkpoint_dir" in err.value.issues[0].fix
    saved = _search("cluster.hbm_gib=80", "train.checkpoint_dir=/tmp/x")
    assert saved.ranked and all(r.job.parallel.fsdp is FsdpStrategy.none for r in saved.ranked)
    for pin, words in (("cfp.fsdp=optim_grads", "fsdp_dtensor"), ("cfp.fsdp=optim", "gradient norm")):
        with pytest.raises(ConfigError) as err:
            _search("cluster.hbm_gib=80", pin, *(["train.checkpoint_dir=/tmp/x"] if "grads" in pin else []))
        assert err.value.issues[0].key == "cfp.fsdp" and words in err.value.issues[0].problem


def test_the_distributed_optimizer_runs_adam_only_and_the_search_keeps_to_that() -> None:
    from cfp_megatron.planner.job_checks import validate_job

    with pytest.raises(ConfigError) as err:
        validate_job(_job(*FSDP, "train.optimizer=sgd"), 16)
    assert err.value.issues[0].key == "parallel.distributed_optimizer" and "train.optimizer=adam" in \
        err.value.issues[0].fix
    found = _search("cluster.hbm_gib=400", "train.optimizer=sgd")
    assert found.ranked and all(not r.job.parallel.distributed_optimizer for r in found.ranked)
    assert any(r.job.parallel.distributed_optimizer for r in _search("cluster.hbm_gib=400").ranked)


def test_the_measured_memory_finds_megatron_fsdps_gradient_buffers() -> None:
    """Megatron-FSDP's wrapper keeps its gradients in ``param_and_grad_buffer`` (its ``buffers`` is nn.Module's
    method): the plan check's memory step read that method as DDP's buffer list and stopped the run."""
    import types

    import torch

    from cfp_megatron.engine.memory import _grad_buffers

    grads = torch.zeros(4)
    group = types.SimpleNamespace(main_grad_buffer=types.SimpleNamespace(data=grads))
    chunk = torch.nn.Linear(2, 2)
    chunk.param_and_grad_buffer = types.SimpleNamespace(parameter_groups=[group])
    assert [t is grads for t in _grad_buffers([chunk])] == [True]
