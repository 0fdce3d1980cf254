"""Number formats as a plan dimension (issue O, deliverable 1): the schema, the pricing (one format model for the
planner and the validator), the set the search chooses from, the plan's exports, and the refusal where Transformer
Engine or the GPU lacks the format (before any process group)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job, group_presets
from cfp_megatron.base.config import ClusterSpec, Precision
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.number_format import NumberFormat, all_formats, format_names
from cfp_megatron.base.parallel_dims import ParallelDims, transformer_engine_available
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args, torchrun_command
from cfp_megatron.search.formats import format_options
from cfp_megatron.search.search import search
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.format_costs import format_cost
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.simulate import simulate

LLAMA_70B = ["model=llama3_70b", "cluster.nodes=8", "parallel.tp=8", "parallel.pp=4", "parallel.sp=true",
             "train.global_batch_size=64", "train.micro_batch_size=1", "train.seq_length=4096"]
no_gpu_stack = pytest.mark.skipif(torch.cuda.is_available() and transformer_engine_available(),
                                  reason="Transformer Engine on a GPU runs the formats it supports")


def _job(cluster: str, *fmt: str):
    return compose_job([*LLAMA_70B, f"cluster={cluster}", *fmt])


def test_every_format_has_one_name_that_parses_back() -> None:
    assert format_names() == ["auto", "fp32", "bf16", "fp16", "fp8-delayed", "fp8-tensorwise", "fp8-blockwise",
                              "fp8-mxfp8", "fp4-nvfp4"]
    for fmt in all_formats():
        assert NumberFormat.parse(fmt.name) == fmt
    with pytest.raises(ValueError, match="fp8-mxfp8"):
        NumberFormat.parse("fp8-current")
    job = compose_job(["train.precision=fp8", "train.fp8_recipe=blockwise"])
    assert NumberFormat.of(job.train).name == "fp8-blockwise" and job.train.fp4_recipe.value == "nvfp4"
    with pytest.raises(ConfigError) as info:  # a recipe beside a format that never reads it: refused, not ignored
        compose_job(["train.precision=bf16", "train.fp8_recipe=mxfp8"])
    assert info.value.issues[0].key == "train.fp8_recipe" and "train.precision=fp8" in info.value.issues[0].fix
    assert compose_job(["train.fp8_recipe=mxfp8"]).train.precision is Precision.auto  # a set may still choose it


def test_fp8_is_faster_than_bf16_on_h100_for_a_gemm_bound_layer() -> None:
    bf16, fp8 = _job("dgx_h100"), _job("dgx_h100", "train.precision=fp8")
    eff = efficiency_for(bf16.cluster)
    big = (8192, 28672, 8192)
    assert KernelModel(fp8.cluster, eff, NumberFormat.of(fp8.train)).gemm(*big) < 0.7 * KernelModel(
        bf16.cluster, eff, NumberFormat.of(bf16.train)).gemm(*big)
    p16, p8 = simulate(bf16), simulate(fp8)
    assert p8.time.forward_compute_s < 0.8 * p16.time.forward_compute_s and p8.step_time_s < p16.step_time_s
    # The inputs kept for the weight gradients are the one-byte copies: less activation memory, and the cached
    # FP8 weight copies are more weight memory.
    assert p8.memory.activations < p16.memory.activations and p8.memory.parameters > p16.memory.parameters


def test_current_scaling_pays_its_amax_pass_and_the_logits_stay_bf16() -> None:
    delayed, current = _job("dgx_h100", "train.precision=fp8"), _job("dgx_h100", "train.precision=fp8",
                                                                     "train.fp8_recipe=tensorwise")
    eff = efficiency_for(delayed.cluster)
    k_delayed = KernelModel(delayed.cluster, eff, NumberFormat.of(delayed.train))
    k_current = KernelModel(current.cluster, eff, NumberFormat.of(current.train))
    assert k_current.gemm(8192, 8192, 8192) > k_delayed.gemm(8192, 8192, 8192)
    assert k_current.gemm(8192, 8192, 8192, low_precision=False) == k_delayed.gemm(8192, 8192, 8192,
                                                                                   low_precision=False)
    assert simulate(current).step_time_s > simulate(delayed).step_time_s


def test_nvfp4_and_mxfp8_only_where_the_preset_computes_them() -> None:
    nvfp4, mxfp8 = NumberFormat.parse("fp4-nvfp4"), NumberFormat.parse("fp8-mxfp8")
    for name, values in group_presets("cluster"):
        cluster = ClusterSpec(**values)
        blackwell = cluster.generation == "blackwell"
        assert ("nvfp4" in cluster.number_formats) == blackwell == (cluster.peak_tflops_fp4 is not None), name
        for fmt in (nvfp4, mxfp8):
            if fmt.needs in cluster.number_formats:
                assert format_cost(fmt, cluster).low
            else:
                with pytest.raises(ConfigError):
                    format_cost(fmt, cluster)
    b200 = _job("b200")
    eff = efficiency_for(b200.cluster)
    assert KernelModel(b200.cluster, eff, nvfp4).gemm(8192, 28672, 8192) < KernelModel(
        b200.cluster, eff, NumberFormat.parse("fp8-delayed")).gemm(8192, 28672, 8192)
    assert simulate(_job("b200", "train.precision=fp4")).step_time_s < simulate(
        _job("b200", "train.precision=fp8", "train.fp8_recipe=mxfp8")).step_time_s


def test_nvfp4_on_hopper_is_refused_naming_the_key_what_it_computes_and_where_it_runs() -> None:
    with pytest.raises(ConfigError) as info:
        simulate(_job("dgx_h100", "train.precision=fp4"))
    issue = info.value.issues[0]
    assert (issue.key, issue.value) == ("train.precision", "fp4")
    assert "nvfp4" in issue.problem and "hopper" in issue.problem and "fp8" in issue.problem
    assert "cluster=b200" in issue.fix and "train.precision=fp8" in issue.fix
    with pytest.raises(ConfigError) as info:
        simulate(_job("dgx_h100", "train.precision=fp8", "train.fp8_recipe=mxfp8"))
    assert info.value.issues[0].key == "train.fp8_recipe" and info.value.issues[0].value == "mxfp8"


@pytest.mark.parametrize(("fmt", "args"), [
    (["train.precision=fp8", "train.fp8_recipe=mxfp8"], ["--bf16", "--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]),
    (["train.precision=fp8", "train.fp8_recipe=blockwise"], ["--bf16", "--fp8-format", "e4m3", "--fp8-recipe",
                                                              "blockwise"]),
    (["train.precision=fp4"], ["--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4"]),
    (["train.precision=bf16"], ["--bf16"]),
])
def test_the_plan_carries_the_format_to_every_export(fmt: list[str], args: list[str]) -> None:
    job = _job("b200", *fmt)
    plan = Plan.from_job(job, world_size=job.cluster.nodes * job.cluster.gpus_per_node, prediction=None,
                         inputs_fingerprint="")
    name = NumberFormat.of(job.train).name
    assert plan.precision == name and plan.canonical().endswith(f",prec={name}")
    assert Plan.parse(plan.canonical()) == plan and Plan.from_json(plan.to_json()) == plan
    assert megatron_lm_args(plan)[-len(args):] == args
    assert all(o in torchrun_command(plan) for o in fmt)
    applied = plan.apply(dataclasses.replace(job, train=dataclasses.replace(job.train, precision=Precision.auto)))
    assert NumberFormat.of(applied.train) == NumberFormat.of(job.train)
    config = transformer_config(job, ParallelDims.build(job, plan.world_size), on_gpu=False)
    fields = NumberFormat.of(job.train).megatron_fields()
    assert {k: getattr(config, k) for k in fields} == fields and config.bf16
    if not fields:
        assert config.fp8 is None and config.fp4 is None


@no_gpu_stack
@pytest.mark.parametrize(("fmt", "key", "value"), [
    (["train.precision=fp8"], "train.precision", "fp8"),
    (["train.precision=fp8", "train.fp8_recipe=mxfp8"], "train.fp8_recipe", "mxfp8"),
    (["train.precision=fp4"], "train.precision", "fp4"),
    (["+cfp=auto", "train.precision=fp8"], "train.precision", "fp8"),
])
def test_a_format_this_machine_cannot_run_is_refused_before_any_process_group(fmt: list[str], key: str,
                                                                               value: str) -> None:
    import torch.distributed as dist

    from cfp_megatron.planner.entry import train_from_config

    with pytest.raises(ConfigError) as info:
        train_from_config(compose_config(["train.steps=1", *fmt]))
    issue = next(i for i in info.value.issues if i.key == key)
    assert issue.value == value and "Transformer Engine" in issue.problem
    assert "train.precision=bf16" in issue.fix and "python -m cfp_megatron.plan" in issue.fix
    assert not dist.is_initialized()


def test_the_search_chooses_a_format_from_the_set_as_the_exhaustive_search_does() -> None:
    job = compose_job(["model=llama3_8b", "cluster=dgx_h100", "cluster.nodes=1", "train.global_batch_size=16",
                       "train.seq_length=4096"])
    cfp = cfp_from_config(compose_config(["+cfp=auto", "cfp.top_k=3", "cfp.constraints.precision=[bf16,fp8,fp4]",
                                          "cfp.constraints.fp8_recipe=[delayed,tensorwise,mxfp8]",
                                          "cfp.constraints.tp=[1,2]", "cfp.constraints.pp=[1]"]))
    bounded, full = search(job, 8, cfp), search(job, 8, cfp, exhaustive=True)
    assert [r.prediction.step_time_s for r in bounded.ranked] == pytest.approx(
        [r.prediction.step_time_s for r in full.ranked])
    assert NumberFormat.of(bounded.best.job.train).name == "fp8-delayed"  # Hopper: FP8, its cheapest scaling
    assert bounded.simulated < full.simulated  # the later formats start from the k-th best found
    left = {r.what: r.reason for r in bounded.rejected}
    assert "needs nvfp4 tensor cores" in left["precision=fp4-nvfp4"] and "precision=fp8-mxfp8" in left
    assert "fp8-delayed chosen from [fp8-delayed, fp8-tensorwise, bf16]" in bounded.format_reason
    alone = search(job, 8, dataclasses.replace(cfp, constraints=dataclasses.replace(cfp.constraints,
                                                                                    precision=None)))
    assert alone.best.job.train.precision is Precision.auto and alone.format_reason is None  # as before: no set
    pinned = dataclasses.replace(job, train=dataclasses.replace(job.train, precision=Precision.fp16))
    with pytest.raises(ConfigError, match="outside cfp.constraints.precision"):
        search(pinned, 8, cfp)


def test_the_jobs_own_format_keeps_the_measured_segments_under_precision_auto() -> None:
    """``train.precision=auto`` (the default) is the format the profile measured in: the search prices it with the
    measured segments; only another format of a set drops them."""
    job = _job("dgx_h100")
    assert job.train.precision is Precision.auto
    measured = object()  # what profiling measured: only whether there is any matters here
    assert format_options(job, NumberFormat.of(job.train), measured, None) is None
    assert format_options(job, NumberFormat(precision=Precision.bf16), measured, None) is None
    fp8 = format_options(job, NumberFormat(precision=Precision.fp8), measured, None)
    assert fp8 is not None and fp8.use_measured_segments is False
