"""One ``TorchFunctionMode`` that moves explicit device placements: CUDA to CPU on machines without a GPU
(:mod:`cfp_megatron.compat.cpu`), CPU/CUDA to meta during capture (:mod:`cfp_megatron.model.meta_env`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode


def device_type_of(device: Any) -> str | None:
    """``cuda``/``cpu``/``meta``... for a device argument; a bare int is a CUDA index (``current_device()``)."""
    if isinstance(device, torch.device):
        return device.type
    if isinstance(device, str):
        return torch.device(device).type
    if isinstance(device, int) and not isinstance(device, bool):
        return "cuda"
    return None


class DeviceRewriteMode(TorchFunctionMode):
    """Rewrite ``device=`` arguments (and ``Tensor.to``/``Tensor.cuda`` positional devices) whose device type is in
    ``sources`` to ``target``."""

    def __init__(self, sources: tuple[str, ...], target: str) -> None:
        super().__init__()
        self.sources = sources
        self.target = target

    def _moves(self, device: Any) -> bool:
        return device_type_of(device) in self.sources

    def _backward(self, tensors: Any, grads: Any, retain: bool | None, create: bool, inputs: Any) -> None:
        """``torch.autograd.backward`` with this mode on (scalar outputs get a gradient of one, as there)."""
        tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
        if grads is None:
            grads = (None,) * len(tensors)
        grads = (grads,) if isinstance(grads, torch.Tensor) else tuple(grads)
        grads = tuple(torch.ones_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True))
        inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        with self:
            torch.autograd.Variable._execution_engine.run_backward(
                tensors, grads, create if retain is None else bool(retain), create, inputs,
                allow_unreachable=True, accumulate_grad=True)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            # A mode is off while its handler runs, and ``loss.backward()`` (as DeepSpeed's engine calls it) runs the
            # whole backward pass, recomputed forwards included, inside the handler. Run it with the mode on, through
            # the autograd engine's own entry point, as Megatron's schedules call it (``custom_backward``).
            names = (("gradient", "retain_graph", "create_graph", "inputs") if func is torch.Tensor.backward else
                     ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs"))
            first, *rest = args
            bound = dict(zip(names, rest, strict=False), **kwargs)
            self._backward(first, bound.get("gradient", bound.get("grad_tensors")), bound.get("retain_graph"),
                           bool(bound.get("create_graph", False)), bound.get("inputs"))
            return None
        if func is torch.device and args and isinstance(args[0], str) and args[0].startswith("cuda:") \
                and "cuda" in self.sources:
            # ``torch.device(f"cuda:{torch.cuda.current_device()}")`` (Megatron-FSDP) where the CPU layer answers
            # the current device with the CPU: the device named is the target.
            return torch.device(self.target)
        if "device" in kwargs and self._moves(kwargs["device"]):
            kwargs = {**kwargs, "device": self.target}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            args = tuple(self.target if i > 0 and self._moves(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)
