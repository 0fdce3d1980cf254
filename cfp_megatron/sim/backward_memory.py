"""What one decoder layer's backward pass holds at once beyond the activations it keeps: the flowing gradients of
its linears and their weight-gradient temporaries, at the moment of each linear's weight-gradient GEMM (Megatron-Core
0.16.1's ``tensor_parallel/layers.py``, ``LinearWithGradAccumulationAndAsyncCommunication.backward``; docs/simulator.md,
"The backward's flowing gradients")."""

from __future__ import annotations

from dataclasses import dataclass

from cfp_megatron.base.config import AttentionKind, JobSpec
from cfp_megatron.base.flops import dense_linear_weights
from cfp_megatron.sim.format_costs import low_format_cost
from cfp_megatron.sim.grad_accumulation import accumulation_mode
from cfp_megatron.sim.kernels import element_bytes
from cfp_megatron.sim.layout import Layout
from cfp_megatron.sim.options import SimOptions, WeightGradAccumulation


@dataclass(frozen=True, kw_only=True, slots=True)
class LinearMoment:
    """Elements one linear's backward holds at its weight-gradient GEMM beyond the layer's kept activations, by
    cause (one rank, one micro-batch)."""

    residual_grad: float
    """The gradient of the block's output, held for the residual connection while its branch is differentiated
    (``[tokens, hidden]``, split over TP under SP)."""
    output_grad: float
    """The linear's output gradient (a row-parallel linear's under SP: gathered over TP into a new tensor,
    ``gather_from_sequence_parallel_region``'s backward; without SP it is the residual gradient itself, not
    counted twice)."""
    input_grad: float
    """The linear's input gradient, whole on every TP rank before its all-reduce (in place) or reduce-scatter."""
    scattered: float
    """Under SP, a column-parallel linear's reduce-scatter output (``sub_grad_input``), beside the whole gradient."""
    weight_grad: float
    """The weight gradient made as a new tensor (:func:`weight_grad_transient`), added to the main gradient and
    freed after the GEMM."""
    freed: float
    """The layer's kept tensors already released by autograd once their nodes ran (the MLP's FC2 input and its
    activation's input at FC1's backward), in elements of the compute precision."""

    @property
    def total(self) -> float:
        """Elements held at once."""
        return (self.residual_grad + self.output_grad + self.input_grad + self.scattered + self.weight_grad
                - self.freed)


def fused_into_main_grad(options: SimOptions, job: JobSpec) -> bool:
    """Whether the weight-gradient GEMM writes into ``main_grad`` and hands autograd Transformer Engine's cached
    placeholder: Megatron's ``gradient_accumulation_fusion`` (:attr:`WeightGradAccumulation.fused`) with Transformer
    Engine's linears (a flash core: the runtime builds their spec where it imports), under Megatron-Core's DDP or
    FSDP (``grad_added_to_main_grad``: :attr:`~cfp_megatron.sim.options.SimOptions.wgrad_placeholder`; PyTorch's
    FSDP keeps no ``main_grad``). A plan for a CPU cluster prices the runtime's options there
    (:func:`~cfp_megatron.sim.options.options_here`: the local spec's unfused core, the fusion off)."""
    fused = accumulation_mode(job, options) is WeightGradAccumulation.fused
    return fused and options.flash_attention and options.wgrad_placeholder and not options.torch_fsdp


def saved_input_bytes(job: JobSpec, options: SimOptions) -> float:
    """Bytes per element of an input a linear layer keeps for its weight gradient: the compute precision's, or
    under FP8/FP4 Transformer Engine's quantised copy that its weight-gradient GEMM reads (the format's
    ``saved_input_bytes``, ``cfp_megatron/sim/number_formats.yaml``); torchao's linears
    (:attr:`~cfp_megatron.sim.options.SimOptions.torchao_low_precision`) keep the high-precision input
    (pytorch/ao 36027d82 ``torchao/float8/float8_linear.py`` line 45, ``matmul_with_hp_or_float8_args``:
    ``ctx.save_for_backward(input_hp, weight_hp_t)``; the grouped MMs ``prototype/moe_training/fp8_grouped_mm.py``
    and ``mxfp8_grouped_mm.py`` save the bf16 ``padded_A`` / ``padded_input_act``)."""
    cost = low_format_cost(job)
    if cost is None or options.torchao_low_precision:
        return float(element_bytes(job))
    return cost.saved_input_bytes


def weight_grad_transient(options: SimOptions, job: JobSpec) -> bool:
    """Whether a linear's backward makes its weight gradient as a new tensor beside its flowing gradients: unless
    :func:`fused_into_main_grad`; Megatron-Core's local linears without Transformer Engine return ``torch.empty``
    of the weight's shape even when fused, Megatron-LM's before 2023 ``None``
    (:attr:`~cfp_megatron.sim.options.SimOptions.wgrad_placeholder`). Under PyTorch's FSDP the unsharded gradient
    is its gathered layer's (``fsdp_buffers``, the data-parallel term's), not counted again."""
    if options.torch_fsdp or fused_into_main_grad(options, job):
        return False
    return accumulation_mode(job, options) is not WeightGradAccumulation.fused or options.wgrad_placeholder


def linear_moments(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool) -> list[LinearMoment]:
    """The moments of one layer's backward, in its order: FC2 and FC1 (a dense layer's MLP), then the attention's
    projection and QKV (standard attention; MLA's and the experts' linears are not counted)."""
    model, dims = job.model, layout.dims
    tp, sp = dims.tp, dims.sp and dims.tp > 1
    tokens = layout.micro_batch * layout.seq_length / dims.cp
    hidden = model.hidden_size
    shard = tokens / tp if sp else tokens
    wgrad = 1.0 if weight_grad_transient(options, job) else 0.0

    def row(width: float) -> LinearMoment:
        return LinearMoment(residual_grad=shard * hidden, output_grad=tokens * hidden if sp else 0.0,
                            input_grad=tokens * width, scattered=0.0, weight_grad=wgrad * hidden * width, freed=0.0)

    def column(width: float, freed: float) -> LinearMoment:
        return LinearMoment(residual_grad=shard * hidden, output_grad=tokens * width, input_grad=tokens * hidden,
                            scattered=shard * hidden if sp else 0.0, weight_grad=wgrad * width * hidden,
                            freed=freed)

    # Each linear's output (column-parallel) or input (row-parallel) width on one TP rank.
    qkv, projection, fc1, fc2 = (weight / hidden / tp for weight in dense_linear_weights(model))
    moments = []
    if not moe:
        fc2_input = saved_input_bytes(job, options) / element_bytes(job)
        moments += [row(fc2), column(fc1, freed=tokens * (fc2 * fc2_input + fc1))]
    if model.attention is AttentionKind.standard:
        moments += [row(projection), column(qkv, freed=0.0)]
    return moments


def backward_flow_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, moe: bool) -> float:
    """Bytes one layer's backward pass holds at once on one rank beyond what it keeps: the largest of its
    :func:`linear_moments`, in the compute precision (the gradients' dtype)."""
    moments = linear_moments(job, layout, options, moe=moe)
    return max((moment.total for moment in moments), default=0.0) * float(element_bytes(job))


def dummy_wgrad_bytes(job: JobSpec, layout: Layout, options: SimOptions, *, dense: bool, moe: bool,
                      head: bool) -> float:
    """Bytes of the placeholder weight gradients a rank holds for the run where the weight-gradient GEMM writes into
    ``main_grad`` and Transformer Engine's linears return a cached tensor to autograd in its place (``module/base.py``,
    ``get_dummy_wgrad``: one ``torch.empty`` a weight shape and dtype, kept in ``_dummy_wgrads``; Megatron-Core's own
    output layer asks for it too where Transformer Engine imports, ``tensor_parallel/layers.py``): one tensor for each
    distinct shape among the rank's linears (a dense layer's four with standard attention, the routed experts' two, the
    output layer's), in the weights' dtype; none unless :func:`fused_into_main_grad`."""
    if not fused_into_main_grad(options, job):
        return 0.0
    model, tp = job.model, layout.dims.tp
    hidden = model.hidden_size
    qkv, projection, fc1, fc2 = (weight / hidden / tp for weight in dense_linear_weights(model))
    shapes: set[tuple[float, float]] = set()
    if (dense or moe) and model.attention is AttentionKind.standard:
        shapes |= {(qkv, hidden), (hidden, projection)}
    if dense:
        shapes |= {(fc1, hidden), (hidden, fc2)}
    if moe:
        expert, gate = model.moe_ffn_hidden_size or model.ffn_size, fc1 / fc2  # gate: 2 under SwiGLU
        shapes |= {(expert * gate, hidden), (hidden, float(expert))}
    if head:
        shapes.add((model.padded_vocab_size / tp, hidden))
    return sum(rows * cols for rows, cols in shapes) * float(element_bytes(job))
