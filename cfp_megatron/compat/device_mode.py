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

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if "device" in kwargs and self._moves(kwargs["device"]):
            kwargs = {**kwargs, "device": self.target}
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            args = tuple(self.target if i > 0 and self._moves(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)
