"""A plan for this machine's GPUs prices the weight-gradient accumulation the runtime builds: ``options_here`` and
``megatron_config`` read one predicate (base/parallel_dims.py, ``gradient_accumulation_fusion_here``)."""

from __future__ import annotations

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.model import megatron_config
from cfp_megatron.sim import options as sim_options
from cfp_megatron.sim.options import SimOptions, WeightGradAccumulation, options_here
from cfp_megatron.sim.simulate import simulate

GPU_JOB = ["model=llama3_8b", "cluster=h200", "parallel.tp=1", "train.global_batch_size=64", "train.micro_batch_size=1"]
"""A GPU job with several micro-batches a step whose backward the GPU, not the host, bounds, so each micro-batch's
accumulation shows in the step time."""


@pytest.mark.parametrize("fusion", [True, False])
def test_options_here_prices_the_accumulation_megatron_config_sets(monkeypatch: pytest.MonkeyPatch,
                                                                    fusion: bool) -> None:
    for module in (megatron_config, sim_options):
        monkeypatch.setattr(module, "gradient_accumulation_fusion_here", lambda: fusion)
    job = compose_job(GPU_JOB)
    built = megatron_config.transformer_config(job, ParallelDims.build(job, 8), on_gpu=True)
    priced = options_here(job.cluster)
    assert priced is not None
    assert built.gradient_accumulation_fusion is fusion
    assert (priced.weight_grad_accumulation is WeightGradAccumulation.fused) is fusion
    if not fusion:
        assert priced.weight_grad_accumulation is WeightGradAccumulation.main_grad_hook


def test_the_runtime_trains_without_the_fusion_and_its_plans_pay_the_hook() -> None:
    job = compose_job(GPU_JOB)
    built = megatron_config.transformer_config(job, ParallelDims.build(job, 8), on_gpu=True)
    assert not built.gradient_accumulation_fusion
    here = options_here(job.cluster)
    assert here is not None and here.weight_grad_accumulation is WeightGradAccumulation.main_grad_hook
    fused = SimOptions(attention=here.attention, grouped_gemm=here.grouped_gemm,
                       weight_grad_accumulation=WeightGradAccumulation.fused)
    assert simulate(job, options=here).step_time_s > simulate(job, options=fused).step_time_s
