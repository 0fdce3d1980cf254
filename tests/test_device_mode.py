"""The CPU layer's device rewrite stays on through ``backward()``: a backward pass run from ``loss.backward()`` or
``torch.autograd.backward`` (as DeepSpeed's engine calls it) still maps CUDA placements to the CPU, which Megatron's
recomputation in the backward pass needs."""

from __future__ import annotations

import pytest
import torch

from cfp_megatron.compat import cpu
from cfp_megatron.compat.device_mode import DeviceRewriteMode


class _MakesCudaTensorInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad * torch.full((1,), 2.0, device="cuda")  # fails on a CPU-only build unless rewritten


@pytest.mark.parametrize("how", ["tensor", "autograd", "autograd_with_grads"])
def test_backward_runs_with_the_rewrite_on(how: str) -> None:
    if torch.cuda.is_available():
        pytest.skip("the rewrite is for machines without CUDA")
    x = torch.ones(3, requires_grad=True)
    with DeviceRewriteMode(sources=("cuda",), target="cpu"):
        y = _MakesCudaTensorInBackward.apply(x)
        if how == "tensor":
            y.sum().backward()
        elif how == "autograd":
            torch.autograd.backward([y.sum()])
        else:
            torch.autograd.backward(y, grad_tensors=torch.full((3,), 3.0))
    assert x.grad.tolist() == ([6.0] * 3 if how == "autograd_with_grads" else [2.0] * 3)
    if not cpu._installed:  # the CPU layer's own mode (another test may have installed it) would rewrite too
        with pytest.raises((AssertionError, RuntimeError)):  # without a mode the same backward fails
            _MakesCudaTensorInBackward.apply(torch.ones(3, requires_grad=True)).sum().backward()
