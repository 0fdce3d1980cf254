"""CUDA graphs and the MoE token policy as plan options: a pin the search keeps, carried in the plan's exports,
priced, applied on GPU and, for CUDA graphs, said to be ignored on CPU."""

from __future__ import annotations

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.model.megatron_config import cpu_notes
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import hydra_overrides, megatron_lm_args
from cfp_megatron.search.search import search
from cfp_megatron.sim.simulate import simulate

MOE = ["model=moe_tiny", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=16",
       "train.micro_batch_size=1"]
PINS = ["+cfp=auto", "cfp.tp=2", "cfp.pp=1", "cfp.cp=1", "cfp.micro_batch=1"]  # a small space


def _plan(*overrides: str) -> tuple[Plan, object]:
    cfg = compose_config([*MOE, *PINS, *overrides])
    job = job_from_config(cfg)
    best = search(job, 8, cfp_from_config(cfg)).best
    return Plan.from_job(best.job, world_size=8, prediction=None, inputs_fingerprint="x"), best


def test_a_pinned_token_policy_and_cuda_graphs_stay_in_the_searched_plan_and_its_exports() -> None:
    plan, best = _plan("model.moe_expert_capacity_factor=1.25", "model.moe_pad_expert_input_to_capacity=true",
                       "parallel.cuda_graph_impl=transformer_engine", "parallel.cuda_graph_scope=attn")
    assert best.job.parallel.cuda_graph_impl.value == "transformer_engine" and "cg=transformer_engine" in \
        plan.canonical()
    args = megatron_lm_args(plan)
    assert args[args.index("--moe-expert-capacity-factor") + 1] == "1.25"
    assert "--moe-pad-expert-input-to-capacity" in args
    assert args[args.index("--cuda-graph-impl") + 1] == "transformer_engine"
    overrides = hydra_overrides(plan)
    assert "model.moe_expert_capacity_factor=1.25" in overrides
    assert "model.moe_pad_expert_input_to_capacity=true" in overrides
    # a dropless plan says so to the torchrun command, and Megatron-LM's default is dropless
    dropless = Plan.from_job(job_from_config(compose_config(MOE)), world_size=8, prediction=None,
                             inputs_fingerprint="x")
    assert "model.moe_expert_capacity_factor=null" in hydra_overrides(dropless)
    assert "--moe-expert-capacity-factor" not in megatron_lm_args(dropless)


def test_the_token_policy_and_cuda_graphs_are_priced() -> None:
    base = job_from_config(compose_config(MOE))
    dropless = simulate(base, world_size=8)
    padded = simulate(job_from_config(compose_config([*MOE, "model.moe_expert_capacity_factor=2.0",
                                                      "model.moe_pad_expert_input_to_capacity=true"])), world_size=8)
    graphed = simulate(job_from_config(compose_config([*MOE, "parallel.cuda_graph_impl=local",
                                                       "parallel.cuda_graph_scope=full_iteration"])), world_size=8)
    assert padded.step_time_s != dropless.step_time_s  # each expert computes its whole capacity, and no sync
    assert graphed.time.host_s < dropless.time.host_s


def test_cuda_graphs_are_said_to_be_ignored_on_cpu_in_one_line() -> None:
    job = job_from_config(compose_config(["cluster=local", "parallel.cuda_graph_impl=local"]))
    (note,) = cpu_notes(job)
    assert "parallel.cuda_graph_impl=local" in note and "ignored on CPU" in note and "\n" not in note
    assert cpu_notes(job_from_config(compose_config(["cluster=local"]))) == []
