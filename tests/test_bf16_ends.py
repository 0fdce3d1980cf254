"""The stack's first and last decoder layers kept in bf16 under FP8 or FP4 (``parallel.num_layers_at_start_in_bf16``
/ ``_end_in_bf16``, Megatron-Core's ``first_last_layers_bf16``): priced at bf16 where they sit, refused where
Megatron-Core cannot run them, carried by the plan to Megatron-LM's arguments and Megatron-Core's fields
(docs/configuration.md, "Number formats")."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.base.pipeline_split import bf16_end_layers, job_chunks
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args, torchrun_command
from cfp_megatron.search.formats import set_formats, with_format
from cfp_megatron.search.search import search
from cfp_megatron.sim.simulate import simulate

LLAMA_70B = ["model=llama3_70b", "cluster=b200", "cluster.nodes=8", "parallel.tp=8", "parallel.sp=true",
             "parallel.distributed_optimizer=true", "train.global_batch_size=64", "train.micro_batch_size=1",
             "train.seq_length=4096"]
ENDS = ["parallel.num_layers_at_start_in_bf16=2", "parallel.num_layers_at_end_in_bf16=4"]


def _job(*more: str):
    return compose_job([*LLAMA_70B, *more])


def test_the_end_layers_sit_in_the_first_and_last_chunks() -> None:
    moe = compose_job(["model=deepseek_v3", "cluster=dgx_h100", "cluster.nodes=64", "parallel.pp=4",
                       "parallel.ep=8", "train.global_batch_size=512", "train.seq_length=4096"])
    chunks = job_chunks(moe)
    counts = bf16_end_layers(chunks, 4, 2)
    # DeepSeek-V3's first 3 layers are dense: the start's 4 are 3 dense and a MoE one, the end's 2 MoE layers
    assert counts[0][0] == (3, 1) and counts[-1][-1] == (0, 2)
    assert all(c == (0, 0) for row in counts[1:-1] for c in row)
    one = job_chunks(_job("train.precision=fp4", "parallel.pp=1"))
    assert bf16_end_layers(one, 2, 4) == (((6, 0),),)  # one chunk holds both ends
    assert bf16_end_layers(one, 60, 60) == (((80, 0),),)  # never more than the chunk's layers


@pytest.mark.parametrize("fmt", [["train.precision=fp4"], ["train.precision=fp8", "train.fp8_recipe=mxfp8"]])
def test_the_end_layers_cost_bf16_time_on_their_stages(fmt: list[str]) -> None:
    low, ends, bf16 = (simulate(_job("parallel.pp=4", *more)) for more in
                       (fmt, [*fmt, *ENDS], ["train.precision=bf16"]))
    assert low.step_time_s < ends.step_time_s < bf16.step_time_s
    # pp=1: the step grows by the 6 layers' bf16 time over their low-format time, 6/80 of the gap at most
    one = [simulate(_job("parallel.pp=1", "cluster.nodes=1", "train.global_batch_size=8", *more)).step_time_s
           for more in (fmt, [*fmt, *ENDS], ["train.precision=bf16"])]
    assert one[0] < one[1] < one[0] + (one[2] - one[0]) * 6 / 80 * 1.05


def test_the_end_layers_keep_bf16_weights_and_activations() -> None:
    low = simulate(_job("parallel.pp=4", "train.precision=fp8", "train.fp8_recipe=tensorwise"))
    ends = simulate(_job("parallel.pp=4", "train.precision=fp8", "train.fp8_recipe=tensorwise", *ENDS))
    # the peak's rank (the first) keeps 2 layers' weights without FP8 copies and their bf16 saved inputs
    assert ends.memory.parameters < low.memory.parameters
    assert ends.memory.activations > low.memory.activations


@pytest.mark.parametrize(("more", "key", "named"), [
    (["train.precision=bf16"], "parallel.num_layers_at_start_in_bf16", "train.precision=fp4"),
    (["train.precision=fp8", "train.fp8_recipe=delayed"], "train.fp8_recipe", "tensorwise"),
    (["train.precision=fp4", "parallel.mlp=primepar"], "parallel.num_layers_at_start_in_bf16", "parallel.mlp"),
    (["train.precision=fp4", "parallel.num_layers_at_start_in_bf16=-1"], "parallel.num_layers_at_start_in_bf16",
     "0"),
])
def test_end_layers_are_refused_where_megatron_cannot_run_them(more: list[str], key: str, named: str) -> None:
    with pytest.raises(ConfigError) as info:
        _job(*ENDS, *more)
    issue = next(i for i in info.value.issues if i.key == key)
    assert named in issue.fix


def test_more_end_layers_than_the_end_chunk_holds_are_refused() -> None:
    job = _job("train.precision=fp4", "parallel.pp=4", "parallel.vpp=5", "parallel.num_layers_at_end_in_bf16=8")
    with pytest.raises(ConfigError) as info:
        ParallelDims.build(job, 64)
    issue = next(i for i in info.value.issues if i.key == "parallel.num_layers_at_end_in_bf16")
    assert issue.value == 8 and "parallel.num_layers_at_end_in_bf16=4" in issue.fix  # 80 / (4 x 5) a chunk


def test_the_search_keeps_end_layers_only_in_a_low_format_it_can_run_them_in() -> None:
    job = _job(*ENDS)  # auto: a set may still choose FP8/FP4
    cfp = cfp_from_config(compose_config(["+cfp=auto"]))
    with pytest.raises(ConfigError) as info:  # no set: auto trains in bf16, where they mean nothing
        set_formats(job, cfp, te_available=True)
    assert info.value.issues[0].key == "parallel.num_layers_at_start_in_bf16"
    allowed = dataclasses.replace(cfp, constraints=dataclasses.replace(
        cfp.constraints, precision=[NumberFormat.parse("bf16").precision, NumberFormat.parse("fp4-nvfp4").precision,
                                    NumberFormat.parse("fp8-delayed").precision],
        fp8_recipe=[NumberFormat.parse("fp8-delayed").recipe, NumberFormat.parse("fp8-tensorwise").recipe]))
    kept, left = set_formats(job, allowed, te_available=True)
    assert {f.name for f in kept} == {"bf16", "fp4-nvfp4", "fp8-tensorwise"}
    assert [r.what for r in left] == ["precision=fp8-delayed"]  # delayed scaling refuses them
    assert with_format(job, NumberFormat.parse("bf16")).parallel.num_layers_at_start_in_bf16 == 0
    assert with_format(job, NumberFormat.parse("fp4-nvfp4")).parallel.num_layers_at_end_in_bf16 == 4


def test_the_plan_carries_end_layers_to_megatron() -> None:
    job = _job("train.precision=fp4", "parallel.pp=2", *ENDS)
    plan = Plan.from_job(job, world_size=64, prediction=None, inputs_fingerprint="")
    assert ",bf16s=2,bf16e=4," in plan.canonical() and Plan.parse(plan.canonical()) == plan
    assert Plan.from_json(plan.to_json()) == plan
    args = megatron_lm_args(plan)
    at = args.index("--first-last-layers-bf16")
    assert args[at:at + 5] == ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2",
                               "--num-layers-at-end-in-bf16", "4"]
    command = torchrun_command(plan)
    assert "parallel.num_layers_at_start_in_bf16=2" in command and "parallel.num_layers_at_end_in_bf16=4" in command
    config = transformer_config(job, ParallelDims.build(job, 64), on_gpu=False)
    assert config.first_last_layers_bf16 and (config.num_layers_at_start_in_bf16,
                                              config.num_layers_at_end_in_bf16) == (2, 4)
    plain = _job("train.precision=fp4", "parallel.pp=2")
    plain_plan = Plan.from_job(plain, world_size=64, prediction=None, inputs_fingerprint="")
    assert "bf16s" not in plain_plan.canonical() and "--first-last-layers-bf16" not in megatron_lm_args(plain_plan)
    assert not transformer_config(plain, ParallelDims.build(plain, 64), on_gpu=False).first_last_layers_bf16


def test_the_search_with_end_layers_finds_what_an_exhaustive_search_finds() -> None:
    job = compose_job(["model=moe_tiny", "cluster=b200", "cluster.nodes=1", "train.global_batch_size=16",
                       "train.micro_batch_size=1", "train.precision=fp4", "parallel.num_layers_at_start_in_bf16=1",
                       "parallel.num_layers_at_end_in_bf16=1"])
    cfp = cfp_from_config(compose_config(["+cfp=auto", "cfp.top_k=3", "cfp.constraints.tp=[1,2]",
                                          "cfp.constraints.pp=[1,2]", "cfp.constraints.ep=[1,4]",
                                          "cfp.constraints.max_micro_batch=2"]))
    bounded, full = search(job, 8, cfp), search(job, 8, cfp, exhaustive=True)
    # the bounds hold with the bf16 layers (each layer at least the faster of the format's and bf16's)
    assert [r.candidate for r in bounded.ranked] == [r.candidate for r in full.ranked]
    assert all(r.job.parallel.num_layers_at_end_in_bf16 == 1 for r in bounded.ranked)
