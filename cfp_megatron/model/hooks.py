"""Capture from a user's Megatron ``model_provider``.

:func:`wrap_model_provider` returns a provider with Megatron's signature that builds the user's model on the meta device
(under :func:`~cfp_megatron.model.meta_env.megatron_meta_env`, so no GPU, process group or memory is needed) and
records its capture. The model it returns lives on meta: this is for planning, not for training.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cfp_megatron.model.capture import ModelCapture, capture_model
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.meta_env import megatron_meta_env, meta_device


class CapturingProvider:
    """A model provider that builds on meta and records a :class:`ModelCapture` per model built."""

    def __init__(self, provider: Callable[..., Any], *, seq_length: int, micro_batch_size: int = 1,
                 name: str | None = None) -> None:
        self.provider = provider
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.name = name or getattr(provider, "__name__", "model")
        self.captures: list[ModelCapture] = []
        """One capture per model the provider built (a list when it returns several chunks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Build the model on meta with the user's arguments, capture it, return it (a meta model)."""
        with megatron_meta_env():
            with meta_device():
                built = self.provider(*args, **kwargs)
            models = built if isinstance(built, list | tuple) else [built]
            for model in models:
                if not isinstance(model, torch.nn.Module):
                    raise CaptureError(f"the model provider returned {type(model).__name__}, not a torch.nn.Module.")
                self.captures.append(capture_model(model, seq_length=self.seq_length,
                                                   micro_batch_size=self.micro_batch_size, name=self.name))
        return built


def wrap_model_provider(provider: Callable[..., Any], *, seq_length: int, micro_batch_size: int = 1,
                        name: str | None = None) -> CapturingProvider:
    """``provider`` wrapped so each call builds on meta and appends its capture to ``.captures``."""
    return CapturingProvider(provider, seq_length=seq_length, micro_batch_size=micro_batch_size, name=name)


def capture_model_provider(provider: Callable[..., Any], *, seq_length: int, micro_batch_size: int = 1,
                           name: str | None = None, **provider_kwargs: Any) -> ModelCapture:
    """Call ``provider(**provider_kwargs)`` once on meta and return the capture of the (first) model it built."""
    wrapped = wrap_model_provider(provider, seq_length=seq_length, micro_batch_size=micro_batch_size, name=name)
    wrapped(**provider_kwargs)
    if not wrapped.captures:
        raise CaptureError("the model provider built no model.")
    return wrapped.captures[0]
