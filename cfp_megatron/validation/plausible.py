"""Whether a row's measured step time is one its GPUs could have run: the model FLOPs utilisation it implies,
against the GPU's quoted peak, above 100% is faster than the hardware (a step time cut short, a batch overstated),
and far below every published run is a unit slip (milliseconds written as seconds, a per-epoch figure)."""

from __future__ import annotations

from cfp_megatron.base.flops import training_flops_per_token
from cfp_megatron.base.number_format import NumberFormat
from cfp_megatron.sim.kernels import target_peak_tflops
from cfp_megatron.validation.results import RowPlan

MIN_MFU = 0.01
"""The lowest model FLOPs utilisation a row may imply: 14 times below the lowest of the shared files' runs (14.4%,
against the bf16 peak), while a step time in milliseconds read as seconds implies 1,000 times less."""


def measured_mfu(plan: RowPlan) -> float | None:
    """The model FLOPs utilisation the row's measured step time implies, against its GPU's dense peak in the
    precision it trains in (the planner's MFU: model FLOPs, no recomputation); ``None`` for a layer-level
    measurement (one layer, no embedding or logits) or a GPU without a stated peak."""
    job = plan.job
    peak = target_peak_tflops(job)
    if plan.options.measured_layer_only or not peak:
        return None
    world = job.cluster.nodes * (job.cluster.gpus_per_node or 1)
    tokens_per_s = job.train.global_batch_size * job.train.seq_length / plan.measured_s / world
    return tokens_per_s * training_flops_per_token(job.model, job.train.seq_length) / (peak * 1e12)


def implausible_step_time(plan: RowPlan) -> str | None:
    """Why the row's measured step time cannot be what its run took (``None`` when it can): faster than its GPUs'
    fastest peak for the row's precision (FP8's where the row trains in FP8), or below :data:`MIN_MFU`."""
    mfu = measured_mfu(plan)
    if mfu is None:
        return None
    cluster = plan.job.cluster
    peak = target_peak_tflops(plan.job) or 0.0
    fmt = NumberFormat.of(plan.job.train)
    fastest = max(peak, cluster.peak_tflops_fp8 or 0.0, cluster.peak_tflops_fp4 or 0.0) if fmt.low else peak
    said = (f"the measured step time {plan.measured_s:.4g} s means {mfu * 100:.3g}% of the GPUs' {peak:g} TFLOP/s "
            "(model FLOPs utilisation)")
    if mfu * peak > fastest:
        return (f"{said}: faster than the hardware (its fastest peak for this precision is {fastest:g} TFLOP/s), "
                "so the step time, batch, sequence or GPU count does not describe what ran. Fix: correct the row")
    if mfu < MIN_MFU:
        return (f"{said}, below {MIN_MFU:.0%}: far slower than any published run (a step time in milliseconds, or "
                "per epoch?). Fix: give the step time in seconds, or correct the row")
    return None
