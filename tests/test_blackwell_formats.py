"""NVFP4 and MXFP8 priced as Transformer Engine runs them on Blackwell (issue O): each format's GEMM rate per GPU
(the datasheet peak, bounded by the measured kernel rate against FP8's), the casts (the random Hadamard transform on
the inputs' and gradients' wgrad copies, not on the weights), the weights' quantisation once per step, and the
logits in bf16."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.format_costs import format_cost, step_weight_cast_bytes
from cfp_megatron.sim.kernels import KernelModel
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.validate import row_plan

LLAMA_8B = ["model=llama3_8b", "parallel.tp=1", "parallel.pp=1", "parallel.distributed_optimizer=true",
            "train.seq_length=8192", "train.micro_batch_size=2"]
"""Llama 3.1 8B as Megatron-Bridge's Blackwell performance recipes train it (TP1, seq 8192, a small batch)."""
NVFP4 = ["train.precision=fp4", "train.fp4_recipe=nvfp4"]
MXFP8 = ["train.precision=fp8", "train.fp8_recipe=mxfp8"]


def _job(cluster: str, *extra: str, gbs: int = 32):
    return compose_job([*LLAMA_8B, f"cluster={cluster}", "cluster.nodes=2" if cluster.startswith("gb") else
                        "cluster.nodes=1", f"train.global_batch_size={gbs}", *extra])


@pytest.mark.parametrize(("cluster", "fp4_peak"), [("b200", 9000.0), ("gb200_nvl72", 10000.0),
                                                   ("b300", 13500.0), ("gb300_nvl72", 15000.0)])
def test_nvfp4_runs_at_the_lesser_of_its_peak_and_the_measured_multiple_of_fp8(cluster: str,
                                                                               fp4_peak: float) -> None:
    job = _job(cluster, *NVFP4)
    spec, eff = job.cluster, efficiency_for(job.cluster)
    assert spec.peak_tflops_fp4 == fp4_peak  # the datasheet's dense FP4 rate of each GPU
    cost = format_cost(NumberFormat.of(job.train), spec)
    fp8_rate = spec.peak_tflops_fp8 * eff.gemm_fp8
    assert cost.gemm_tflops(spec, eff) == pytest.approx(min(fp4_peak * eff.gemm_fp8, cost.rate_vs_fp8 * fp8_rate))
    # Blackwell Ultra's 3 x FP4 peak is not what the kernels reach: the measured 1.81 x FP8 bounds B300 and GB300
    assert cost.gemm_tflops(spec, eff) < fp4_peak * eff.gemm_fp8
    # a GPU whose FP4 peak were FP8's would get no FP4 speed-up: the peak still bounds the rate
    flat = dataclasses.replace(spec, peak_tflops_fp4=spec.peak_tflops_fp8)
    assert cost.gemm_tflops(flat, eff) == pytest.approx(fp8_rate)


def test_mxfp8_kernels_run_a_little_below_the_per_tensor_fp8_ones() -> None:
    mxfp8, current = _job("b200", *MXFP8), _job("b200", "train.precision=fp8", "train.fp8_recipe=tensorwise")
    eff = efficiency_for(mxfp8.cluster)
    rate = format_cost(NumberFormat.of(mxfp8.train), mxfp8.cluster).gemm_tflops(mxfp8.cluster, eff)
    per_tensor = format_cost(NumberFormat.of(current.train), current.cluster).gemm_tflops(current.cluster, eff)
    assert rate == pytest.approx(0.951 * per_tensor)


def test_the_hadamard_transform_is_paid_on_wgrad_inputs_not_on_the_weights() -> None:
    job = _job("b200", *NVFP4)
    cost = format_cost(NumberFormat.of(job.train), job.cluster)
    # inputs and gradients: a row-wise copy and a column-wise (wgrad) copy through the transform; weights: 2D
    # blocks, no transform, the bytes their cast moves (read 2 + amax 2, two copies of 0.5 + 1/16)
    assert cost.weight_cast_bytes == pytest.approx(2 + 2 + 2 * (0.5 + 1 / 16))
    assert cost.cast_bytes > cost.weight_cast_bytes
    delayed = format_cost(NumberFormat.parse("fp8-delayed"), job.cluster)
    layers = 7.0e9
    assert step_weight_cast_bytes(job, layers, layers / 8) == pytest.approx(
        layers * (cost.weight_cast_bytes - delayed.step_weight_cast_bytes))


def test_weights_are_quantised_once_per_step_whatever_the_micro_batches() -> None:
    few, many = simulate(_job("b200", *NVFP4, gbs=16)), simulate(_job("b200", *NVFP4, gbs=64))
    assert few.num_microbatches < many.num_microbatches
    assert few.time.seconds("weight_cast_s") == pytest.approx(many.time.seconds("weight_cast_s"))
    assert few.time.seconds("weight_cast_s") > 0
    assert simulate(_job("b200", gbs=16)).time.seconds("weight_cast_s") == 0.0  # bf16: nothing to quantise


def test_nvfp4_is_faster_than_mxfp8_and_the_logits_stay_bf16() -> None:
    nvfp4, mxfp8 = _job("b300", *NVFP4), _job("b300", *MXFP8)
    eff = efficiency_for(nvfp4.cluster)
    k4 = KernelModel(nvfp4.cluster, eff, NumberFormat.of(nvfp4.train))
    k8 = KernelModel(mxfp8.cluster, eff, NumberFormat.of(mxfp8.train))
    big = (16384, 14336, 4096)
    assert k4.gemm(*big) < k8.gemm(*big)
    logits = (16384, 128256, 4096)
    assert k4.gemm(*logits, low_precision=False) == k8.gemm(*logits, low_precision=False)
    assert simulate(nvfp4).step_time_s < simulate(mxfp8).step_time_s


def _row(**cells: str) -> dict:
    """A Llama 3.1 8B row of Megatron-Bridge's Blackwell recipes (a temporary case, not a published run)."""
    row = {"id": "t1", "model": "Llama 3.1 8B", "layers": "32", "hidden": "4096", "ffn_hidden": "14336",
           "heads": "32", "kv_heads": "8", "vocab": "128256", "seq_len": "8192", "gpu": "B200", "num_gpus": "64",
           "framework": "Megatron-Bridge / NeMo 26.02", "tp": "1", "pp": "1", "cp": "1", "micro_batch": "1",
           "global_batch_seqs": "128", "zero_or_fsdp": "distributed optimizer", "precision": "NVFP4",
           "step_time_s": "0.5"}
    return {**row, **cells}


def test_megatron_bridge_rows_overlap_the_parameter_gather_as_their_recipes_set_it() -> None:
    bridge = row_plan(_row())
    assert bridge.job.parallel.overlap_param_gather and NumberFormat.of(bridge.job.train).name == "fp4-nvfp4"
    other = row_plan(_row(framework="Megatron-LM"))
    assert not other.job.parallel.overlap_param_gather
    assert simulate(bridge.job, options=bridge.options).time.dp_comm_s < simulate(
        other.job, options=bridge.options).time.dp_comm_s
