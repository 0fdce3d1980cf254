"""What adding each micro-batch's weight gradients into the step's costs: the way a run adds them and the HBM bytes
a weight that takes, for the decoder layers' backward (:func:`~cfp_megatron.sim.layer_cost.grad_accumulation_s`) and
for DeepSpeed's fp32 buffer after it (:func:`~cfp_megatron.sim.terms.data_parallel.after_backward_accumulation_s`)
(docs/simulator.md, "Weight-gradient accumulation")."""

from __future__ import annotations

from cfp_megatron.base.config import JobSpec, Precision
from cfp_megatron.sim.kernels import grad_element_bytes
from cfp_megatron.sim.options import SimOptions, WeightGradAccumulation


def accumulation_mode(job: JobSpec, options: SimOptions) -> WeightGradAccumulation:
    """How ``job``'s weight gradients are added to the step's: DeepSpeed's ``BF16_Optimizer`` where the run is its
    engine (:attr:`~cfp_megatron.sim.options.SimOptions.deepspeed_engine`) with bf16 weights, else
    ``options.weight_grad_accumulation``."""
    if options.deepspeed_engine and job.train.precision is Precision.bf16:
        return WeightGradAccumulation.bf16_optimizer
    return options.weight_grad_accumulation


def accumulation_bytes(job: JobSpec, how: WeightGradAccumulation, *, elem: float, microbatches: int) -> float:
    """HBM bytes a weight per micro-batch that adding its gradient (``elem`` bytes, the compute precision) to the
    step's moves beyond the weight-gradient GEMM, when ``how`` adds it, averaged over ``microbatches``:

    - ``fused``: none (the GEMM writes into the main gradient);
    - ``main_grad_hook``: the gradient and the main gradient read, the main gradient written;
    - ``autograd``: an in-place add in the compute precision (two reads, one write) from the second micro-batch on;
    - ``bf16_optimizer``: ``hp_grad.add_(lp.grad.to(hp_grad.dtype))``: the cast reads the gradient and writes an fp32
      copy (4), the add reads the copy and the fp32 buffer (4 + 4) and writes the buffer (4): 18 bytes in bf16."""
    if how is WeightGradAccumulation.main_grad_hook:
        return elem + 2 * grad_element_bytes(job)
    if how is WeightGradAccumulation.autograd:
        return 3 * elem * (microbatches - 1) / microbatches
    if how is WeightGradAccumulation.bf16_optimizer:
        return elem + 4.0 + 3 * 4.0
    return 0.0
