"""Capture a plain PyTorch model handed to ``deepspeed.initialize``.

The repeated blocks are the children of the model's largest ``nn.ModuleList`` (by parameters). Blocks with the same
module types and parameter shapes are one kind. On a meta copy of the model, one forward pass (not recorded; free on
meta) finds each block's input; then one block of each kind is recorded, and the rest of the model (``rest``:
embeddings, final norm, head, loss) is recorded with every block replaced by a pass-through. The model is the
sequence ``rest`` (once), then the kind of each block.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map

from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.record import record_step
from cfp_megatron.model.capture import ModelCapture, _unique_names
from cfp_megatron.model.errors import CaptureError
from cfp_megatron.model.megatron_layers import layer_signature, meta_copy
from cfp_megatron.model.meta_env import meta_device


class DeepSpeedUnavailable(CaptureError):
    """``deepspeed`` is not installed; the capture was made, the engine was not."""


def largest_module_list(model: torch.nn.Module) -> tuple[str, torch.nn.ModuleList]:
    """The ``nn.ModuleList`` of ``model`` holding the most parameters, with its path."""
    best: tuple[int, str, torch.nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) > 0:
            size = sum(p.numel() for p in module.parameters())
            if best is None or size > best[0]:
                best = (size, path, module)
    if best is None:
        raise CaptureError(f"{type(model).__name__} has no nn.ModuleList of repeated blocks to capture.")
    return best[1], best[2]


class _PassThrough(torch.nn.Module):
    """Stands in for a block: returns its input as the block's output would carry it."""

    def __init__(self, tuple_output: bool) -> None:
        super().__init__()
        self.tuple_output = tuple_output

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The first input, alone or as the first item of a tuple."""
        return (x,) if self.tuple_output else x


def _to_meta(x: Any) -> Any:
    return torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) and x.device.type != "meta" else x


def _fresh_input(x: Any) -> Any:
    """A new leaf meta tensor (gradient-requiring when floating point) for a recorded input."""
    if not isinstance(x, torch.Tensor):
        return x
    return torch.empty_like(x, device="meta").requires_grad_(x.is_floating_point())


def capture_deepspeed_model(model: torch.nn.Module, example_input: Any, *, name: str | None = None,
                            loss_fn: Callable[[Any], torch.Tensor] | None = None) -> ModelCapture:
    """Capture ``model`` (any device; recorded on a meta copy) run on ``example_input`` (a tensor or a tuple).

    ``loss_fn`` maps the model's output to a scalar loss (default: the sum of its first output).
    """
    meta = meta_copy(model)
    meta.train()
    path, blocks = largest_module_list(meta)
    inputs = tuple(tree_map(_to_meta, example_input if isinstance(example_input, tuple) else (example_input,)))
    signatures = [layer_signature(b) for b in blocks]
    first: dict[tuple, int] = {}
    for i, sig in enumerate(signatures):
        first.setdefault(sig, i)
    seen: dict[int, tuple[tuple, dict, bool]] = {}

    def probe(index: int) -> Callable[..., None]:
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
            seen.setdefault(index, (args, kwargs, isinstance(out, tuple | list)))
        return hook

    handles = [blocks[i].register_forward_hook(probe(i), with_kwargs=True) for i in first.values()]
    try:
        with meta_device(), torch.no_grad():
            meta(*inputs)
    finally:
        for h in handles:
            h.remove()
    if len(seen) != len(first):
        raise CaptureError(f"the blocks of {path!r} did not all run in the forward pass on the example input.")
    names = dict(zip(first, _unique_names(["block"] * len(first)), strict=True))
    graphs: dict[str, OpGraph] = {}
    with meta_device():
        for sig, i in first.items():
            args, kwargs, _ = seen[i]
            block = blocks[i]
            args = tuple(tree_map(_fresh_input, args))
            kwargs = tree_map(lambda x: torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x,
                              kwargs)
            graphs[names[sig]] = record_step(block, args, kind=names[sig],
                                             forward=lambda *a, b=block, kw=kwargs: b(*a, **kw))
        originals = list(blocks)
        for i, sig in enumerate(signatures):
            blocks[i] = _PassThrough(seen[first[sig]][2])
        try:
            graphs["rest"] = record_step(meta, inputs, kind="rest", loss_fn=loss_fn)
        finally:
            for i, block in enumerate(originals):
                blocks[i] = block
    return ModelCapture(model=name or type(model).__name__, seq_length=_seq_length(inputs), micro_batch_size=
                        _batch(inputs), graphs=graphs, layer_kinds=tuple(names[s] for s in signatures))


def _seq_length(inputs: tuple) -> int:
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    return int(first.shape[1]) if first is not None and first.dim() >= 2 else 1


def _batch(inputs: tuple) -> int:
    first = next((x for x in inputs if isinstance(x, torch.Tensor)), None)
    return int(first.shape[0]) if first is not None and first.dim() >= 1 else 1


def initialize(*, model: torch.nn.Module, example_input: Any, name: str | None = None,
               loss_fn: Callable[[Any], torch.Tensor] | None = None, **kwargs: Any) -> Any:
    """Capture ``model`` (attached as ``model.cfp_capture``), then return ``deepspeed.initialize(model=model, ...)``.

    Raises :class:`DeepSpeedUnavailable` after capturing when DeepSpeed is not installed.
    """
    capture = capture_deepspeed_model(model, example_input, name=name, loss_fn=loss_fn)
    object.__setattr__(model, "cfp_capture", capture)
    if importlib.util.find_spec("deepspeed") is None:
        raise DeepSpeedUnavailable("deepspeed is not installed: the capture is in model.cfp_capture; install "
                                   "deepspeed (pip install deepspeed) to build the engine.")
    import deepspeed

    return deepspeed.initialize(model=model, **kwargs)
