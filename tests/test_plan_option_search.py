"""CUDA graphs and the MoE token policy chosen by the search from the sets the user allows
(``cfp.constraints.cuda_graph_impl``, ``moe_token_policy``): the same plans as searching each combination alone,
Megatron-Core's graph rules, the graphs' memory, what is left out where it cannot run, and the errors."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from cfp_megatron.base.cfp_spec import CfpSpec, cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import CudaGraphImpl, JobSpec, MoeTokenPolicy, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args, with_searched_token_policy
from cfp_megatron.search.plan_options import PlanOption, option_label, plan_options
from cfp_megatron.search.search import SearchResult, search
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.cuda_graphs import graph_buffers

MOE = ["model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=16",
       "train.micro_batch_size=1"]
SMALL = ["cfp.top_k=3", "cfp.constraints.tp=[1]", "cfp.constraints.pp=[1,2]", "cfp.constraints.ep=[1,4]",
         "cfp.constraints.max_micro_batch=2"]
SETS = ["cfp.constraints.cuda_graph_impl=[none,transformer_engine]",
        "cfp.constraints.moe_token_policy=[dropless,drop_pad]", "cfp.constraints.moe_capacity_factor=1.25"]


@functools.cache
def _job(*overrides: str) -> JobSpec:
    return job_from_config(compose_config([*MOE, *overrides]))


@functools.cache
def _cfp(*overrides: str) -> CfpSpec:
    return cfp_from_config(compose_config(["+cfp=auto", *SMALL, *overrides]))


@functools.cache
def _searched_sets() -> SearchResult:
    """moe_tiny searched on 8 ranks over SETS (frozen: the tests that read it share one search)."""
    return search(_job(), 8, _cfp(*SETS))


def test_the_search_chooses_graphs_and_a_token_policy_as_searching_each_alone_does() -> None:
    job, cfp = _job(), _cfp(*SETS)
    bounded, full = _searched_sets(), search(job, 8, cfp, exhaustive=True)
    assert [r.prediction.step_time_s for r in bounded.ranked] == [r.prediction.step_time_s for r in full.ranked]
    assert [r.candidate for r in bounded.ranked] == [r.candidate for r in full.ranked]
    assert bounded.simulated < full.simulated  # the later combinations start from the k-th best found
    # each combination searched alone (the model's own policy and graphs pinned): the best of them is the set's
    alone = []
    for policy, factor, pad in (("dropless", "null", "false"), ("drop_pad", "1.25", "true")):
        for graphs in ("none", "transformer_engine"):
            pinned = _job(f"model.moe_expert_capacity_factor={factor}",
                          f"model.moe_pad_expert_input_to_capacity={pad}", f"parallel.cuda_graph_impl={graphs}",
                          *(["parallel.cuda_graph_scope=attn+moe_router+moe_preprocess"]
                            if graphs != "none" and policy == "dropless" else []))
            cfp_alone = _cfp(*(["cfp.constraints.recompute=[none,selective]"] if graphs != "none" else []))
            alone.append(search(pinned, 8, cfp_alone).ranked[0].prediction.step_time_s)
    assert bounded.ranked[0].prediction.step_time_s == pytest.approx(min(alone))
    best = bounded.best.job
    assert MoeTokenPolicy.of(best.model) is MoeTokenPolicy.drop_pad  # moe_tiny: the host's syncs dominate dropless
    assert best.parallel.cuda_graph_impl is CudaGraphImpl.transformer_engine
    assert "moe_token_policy=drop_pad(1.25) chosen from" in bounded.option_reason
    assert "cuda_graph_impl=none moe_token_policy=dropless" in bounded.option_reason
    assert option_label(best, bounded.option_choices) == " drop_pad cg=transformer_engine"  # the plan's label


def test_without_a_set_the_jobs_own_settings_are_searched_alone() -> None:
    job = _job()
    result = search(job, 8, _cfp())
    assert result.option_reason is None and result.options == ()
    best = result.best.job
    assert best.parallel.cuda_graph_impl is CudaGraphImpl.none and best.model.moe_dropless
    assert plan_options(job, _cfp(), te_available=True)[0] == [PlanOption(graphs=None, policy=None)]


def test_the_graphs_scope_follows_the_token_policy_as_megatron_core_captures() -> None:
    job = _job()
    scope = {p: PlanOption(graphs=CudaGraphImpl.transformer_engine, policy=p, capacity=1.0).apply(job)
             .parallel.cuda_graph_scope for p in MoeTokenPolicy}
    assert scope == {MoeTokenPolicy.dropless: "attn+moe_router+moe_preprocess",
                     MoeTokenPolicy.drop: "attn+moe_router+moe_preprocess", MoeTokenPolicy.drop_pad: None}
    allgather = _job("model.moe_token_dispatcher=allgather")
    assert PlanOption(graphs=CudaGraphImpl.local, policy=None).apply(allgather).parallel.cuda_graph_scope == \
        "attn+moe_router"
    dense = job_from_config(compose_config(["model=gpt_tiny", "cluster=dgx_h100"]))
    assert PlanOption(graphs=CudaGraphImpl.local, policy=None).apply(dense).parallel.cuda_graph_scope is None


@pytest.mark.parametrize(("overrides", "key", "said"), [
    (["parallel.cuda_graph_impl=transformer_engine", "parallel.cuda_graph_scope=attn+moe"],
     "parallel.cuda_graph_scope", "drop-padding"),
    (["model.moe_expert_capacity_factor=1.0", "parallel.cuda_graph_impl=transformer_engine",
      "parallel.cuda_graph_scope=moe_router+moe_preprocess"], "parallel.cuda_graph_scope", "DtoH"),
    (["parallel.cuda_graph_impl=local", "parallel.recompute=full"], "parallel.cuda_graph_impl", "full recompute"),
    (["parallel.cuda_graph_impl=transformer_engine", "parallel.cuda_graph_scope=attn+moe+moe_router"],
     "parallel.cuda_graph_scope", "together"),
])
def test_megatron_cores_graph_rules_refuse_a_pinned_layout(overrides: list[str], key: str, said: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(_job(*overrides), 8, te_available=True)
    assert key in str(err.value) and said in str(err.value)


def test_drop_and_pad_is_captured_whole_and_graphs_under_full_iteration_take_full_recomputation() -> None:
    padded = ["model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
    ParallelDims.build(_job(*padded, "parallel.cuda_graph_impl=transformer_engine",
                            "parallel.cuda_graph_scope=attn+moe"), 8, te_available=True)
    ParallelDims.build(_job("parallel.cuda_graph_impl=local", "parallel.cuda_graph_scope=full_iteration",
                            "parallel.recompute=full"), 8, te_available=True)


def test_the_graphs_static_buffers_are_counted_per_captured_layer_and_micro_batch_in_flight() -> None:
    eager = simulate(_job(), world_size=8)
    graphed = simulate(_job("parallel.cuda_graph_impl=local"), world_size=8)
    buffers = dict(graphed.memory.parts)["cuda_graph_buffers"]
    m, seq = _job().model, _job().train.seq_length
    per_layer = graph_buffers().hidden_buffers * seq * m.hidden_size * 2  # bf16, one micro-batch, tp 1
    router = graph_buffers().router_bytes * seq * m.num_experts  # dropless: captured up to its router
    assert buffers == pytest.approx(m.num_layers * (per_layer + router))
    assert graphed.memory.total == pytest.approx(eager.memory.total + buffers)
    assert graphed.time.host_s < eager.time.host_s  # what they save
    te = dict(simulate(_job("parallel.cuda_graph_impl=transformer_engine"), world_size=8).memory.parts)
    assert te["cuda_graph_buffers"] == pytest.approx(buffers + m.num_layers * seq * seq)  # its bool attention mask
    piped = simulate(_job("parallel.cuda_graph_impl=local", "parallel.pp=2"), world_size=8)
    assert dict(piped.memory.parts)["cuda_graph_buffers"] > buffers / 2  # half the layers, two micro-batches held



def test_a_full_iteration_graph_keeps_each_micro_batchs_batch_not_per_layer_buffers() -> None:
    """Megatron-Core's full-iteration graph (``FullCudaGraphWrapper``) captures the forward-backward once: its static
    inputs are the data loader's batch of every micro-batch, not the per-layer graphs' hidden-state buffers."""
    whole = simulate(_job("parallel.cuda_graph_impl=local", "parallel.cuda_graph_scope=full_iteration"), world_size=8)
    per_layer = dict(simulate(_job("parallel.cuda_graph_impl=local"), world_size=8).memory.parts)
    j = _job()
    micro_batches = j.train.global_batch_size // j.train.micro_batch_size // 8  # DP 8
    batch = graph_buffers().batch_bytes * j.train.micro_batch_size * j.train.seq_length * micro_batches
    assert dict(whole.memory.parts)["cuda_graph_buffers"] == pytest.approx(batch)
    assert batch < per_layer["cuda_graph_buffers"] / 10
    assert whole.time.host_s == 0.0  # nothing launched by the host, no dropless wait

def test_graphs_are_left_out_where_they_cannot_run() -> None:
    sets = _cfp("cfp.constraints.cuda_graph_impl=[none,local,transformer_engine]")
    options, left = plan_options(_job(), sets, te_available=False)
    assert [o.graphs for o in options] == [CudaGraphImpl.local, CudaGraphImpl.none]
    assert [r.what for r in left] == ["cuda_graph_impl=transformer_engine"]
    cpu = job_from_config(compose_config(["cluster=local"]))
    options, left = plan_options(cpu, _cfp("cfp.constraints.cuda_graph_impl=[local]"), te_available=True)
    assert [o.graphs for o in options] == [CudaGraphImpl.none] and "this cluster is CPU" in left[0].reason
    with pytest.raises(ConfigError, match="cfp.constraints.cuda_graph_impl"):
        plan_options(_job(), _cfp("cfp.constraints.cuda_graph_impl=[transformer_engine]"), te_available=False)
    with pytest.raises(ConfigError, match="cfp.constraints.cuda_graph_impl"):
        plan_options(_job(), _cfp("cfp.constraints.cuda_graph_impl=[local]", "cfp.recompute=full"),
                     te_available=True)
    options, left = plan_options(_job(), _cfp("cfp.constraints.cuda_graph_impl=[local,none]", "cfp.recompute=full"),
                                 te_available=True)
    assert [o.graphs for o in options] == [CudaGraphImpl.none] and "full recomputation" in left[0].reason


def test_the_token_policy_is_chosen_only_from_the_set_and_refused_where_it_cannot_be() -> None:
    dropless = plan_options(_job(), _cfp("cfp.constraints.moe_token_policy=[dropless]"), te_available=True)[0]
    assert [o.policy for o in dropless] == [MoeTokenPolicy.dropless]
    own = plan_options(_job("model.moe_expert_capacity_factor=2.0"),
                       _cfp("cfp.constraints.moe_token_policy=[drop,drop_pad]"), te_available=True)[0]
    assert [(o.policy, o.capacity) for o in own] == [(MoeTokenPolicy.drop, 2.0), (MoeTokenPolicy.drop_pad, 2.0)]
    with pytest.raises(ConfigError, match="cfp.constraints.moe_capacity_factor"):
        plan_options(_job(), _cfp("cfp.constraints.moe_token_policy=[dropless,drop]"), te_available=True)
    dense = job_from_config(compose_config(["model=gpt_tiny", "cluster=dgx_h100"]))
    with pytest.raises(ConfigError, match="cfp.constraints.moe_token_policy"):
        plan_options(dense, _cfp("cfp.constraints.moe_token_policy=[dropless]"), te_available=True)
    flex = _job("model.moe_token_dispatcher=flex")
    options, left = plan_options(flex, _cfp("cfp.constraints.moe_token_policy=[dropless,drop_pad]",
                                            "cfp.constraints.moe_capacity_factor=1.0"), te_available=True)
    assert [o.policy for o in options] == [MoeTokenPolicy.dropless] and "DeepEP" in left[0].reason
    with pytest.raises(ConfigError, match="cfp.constraints.moe_capacity_factor"):
        _cfp("cfp.constraints.moe_capacity_factor=-1")


def test_the_chosen_policy_reaches_the_exports_and_the_launch_job_only_where_allowed() -> None:
    job, cfp = _job(), _cfp(*SETS)
    best = _searched_sets().best
    plan = Plan.from_job(best.job, world_size=8, prediction=None, inputs_fingerprint="x")
    args = megatron_lm_args(plan)
    assert args[args.index("--moe-expert-capacity-factor") + 1] == "1.25" and "--cuda-graph-impl" in args
    adopted = with_searched_token_policy(plan, job, cfp.constraints.moe_token_policy)
    assert plan.apply(adopted).model.moe_pad_expert_input_to_capacity
    assert with_searched_token_policy(plan, job, None) is job  # no set: the job's own, and the plan is refused
    with pytest.raises(ConfigError, match="model.moe_expert_capacity_factor"):
        plan.apply(job)
    narrow = with_searched_token_policy(plan, job, [MoeTokenPolicy.dropless])
    assert narrow is job  # a policy outside the set is never adopted
    assert dataclasses.replace(plan).job_inputs == plan.job_inputs
