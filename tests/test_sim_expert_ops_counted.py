"""The byte counts ``sim.terms.expert_dispatch`` prices for GPT-OSS's experts (the clamp before quick GEGLU, the fc2
bias added per expert) against Megatron-Core 0.16.1's own code run on CPU: every aten op of its forward and autograd
backward counted by a ``TorchDispatchMode`` (the bytes of its inputs and outputs), with the feature less without it.
Where Megatron-Core changes these lines, the priced constants no longer match what it runs."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from cfp_megatron.sim.terms.expert_dispatch import clamp_bytes, expert_bias_bytes

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    import megatron.core.fusions.fused_bias_geglu as fused_bias_geglu
    from megatron.core.transformer.moe.experts import TEGroupedMLP

ROWS, HIDDEN, FFN, EXPERTS = 64, 48, 40, 4
SPLIT = [ROWS // EXPERTS] * EXPERTS
SMALL = 200
"""Tensors under this many elements (biases, per-row probabilities, scalars) are left out of the count: the priced
constants count the ``[rows, width]`` passes alone."""
MOVES_NOTHING = {"view", "_unsafe_view", "split", "split_with_sizes", "slice", "chunk", "narrow", "expand",
                 "unsqueeze", "t", "as_strided", "alias", "detach", "squeeze", "select", "permute", "transpose",
                 "unbind", "empty", "empty_like", "new_empty", "empty_strided", "lift_fresh", "scalar_tensor"}
"""Aten ops that read and write no tensor data (views, allocations)."""


class ByteCount(TorchDispatchMode):
    """Sums the bytes of every tensor an op reads or writes (of at least :data:`SMALL` elements)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ not in MOVES_NOTHING:
            tensors = [t for t in tree_flatten((args, kwargs, out))[0]
                       if isinstance(t, torch.Tensor) and t.numel() >= SMALL]
            self.bytes += sum(t.numel() * t.element_size() for t in tensors)
        return out


def counted(fn: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor],
            params: Sequence[torch.Tensor] = ()) -> tuple[int, int]:
    """(forward, backward) bytes of ``fn(*inputs)`` and of its gradient with respect to ``inputs`` and ``params``."""
    forward = ByteCount()
    with forward:
        out = fn(*inputs)
    backward = ByteCount()
    with backward:
        torch.autograd.grad(out, [*inputs, *params], torch.ones_like(out), allow_unused=True)
    return forward.bytes, backward.bytes


def bias_bytes(prob_dtype: torch.dtype, *, grouped: bool, biased: bool) -> tuple[int, int]:
    """Bytes of the experts' output stage on ``[ROWS, HIDDEN]`` bf16 rows: ``TEGroupedMLP._apply_bias`` (grouped) or
    each ``SequentialMLP`` expert's ``output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)``
    (megatron/core/transformer/mlp.py, copied here: it sits inside ``MLP.forward``) with or without biases."""
    rows = torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(ROWS, 1, dtype=prob_dtype).requires_grad_()
    biases = [torch.randn(HIDDEN, dtype=torch.bfloat16, requires_grad=True) for _ in range(EXPERTS)]

    def grouped_mlp(out: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return TEGroupedMLP._apply_bias(out, biases if biased else None, SPLIT, p)

    def sequential_mlp(out: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        outputs = []
        for output, output_bias, per_token_scale in zip(torch.split(out, SPLIT), biases,
                                                        torch.split(p.view(-1), SPLIT), strict=True):
            output = output.clone()  # the expert's own fc2 output
            if biased:
                output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
            outputs.append(output)
        return torch.cat(outputs)

    return counted(grouped_mlp if grouped else sequential_mlp, (rows, probs), biases)


@pytest.mark.parametrize("prob_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("grouped", [True, False])
def test_the_fc2_bias_costs_what_megatron_cores_experts_move(prob_dtype: torch.dtype, grouped: bool) -> None:
    with_bias, without = (bias_bytes(prob_dtype, grouped=grouped, biased=b) for b in (True, False))
    per_element = tuple((a - b) / (ROWS * HIDDEN) for a, b in zip(with_bias, without, strict=True))
    prob = torch.empty(0, dtype=prob_dtype).element_size()
    assert per_element == expert_bias_bytes(2.0, prob, grouped_gemm=grouped)


class _FusedKernel(torch.autograd.Function):
    """Stands in for the fused quick-GEGLU kernel (``WeightedQuickGeGLUFunction``), which moves nothing here: the
    count is the clamp's around it."""

    @staticmethod
    def forward(ctx, inp: torch.Tensor, weights: torch.Tensor, fp8: bool, offset: torch.Tensor) -> torch.Tensor:
        ctx.shape = inp.shape
        return inp.new_empty(inp.shape[0], inp.shape[1] // 2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return grad.new_empty(ctx.shape), None, None, None


def test_the_clamp_costs_what_megatron_cores_quick_geglu_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fused_bias_geglu, "WeightedQuickGeGLUFunction", _FusedKernel)

    def moved(clamp: float | None) -> tuple[int, int]:
        fc1_out = torch.randn(ROWS, 2 * FFN, dtype=torch.bfloat16).requires_grad_()
        probs = torch.rand(ROWS, 1, dtype=torch.bfloat16)
        return counted(lambda x: fused_bias_geglu.weighted_bias_quick_geglu_impl(x, None, probs, False, 1.0, clamp),
                       (fc1_out,))

    with_clamp, without = moved(7.0), moved(None)
    per_element = tuple((a - b) / (ROWS * 2 * FFN) for a, b in zip(with_clamp, without, strict=True))
    assert per_element == clamp_bytes(2.0)
