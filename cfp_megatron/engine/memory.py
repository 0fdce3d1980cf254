"""Tensor memory of one training step per rank, measured: what the simulator's memory prediction is checked against.

PyTorch's :class:`torch.distributed._tools.mem_tracker.MemTracker` (a ``TorchDispatchMode``) follows every tensor
storage created during the step and, through ``track_external``, the ones that already exist (the model, Megatron's
contiguous gradient buffers, the optimizer's states), and keeps the peak with a breakdown. It works on CPU as on GPU
(exact bytes on CPU; the CUDA caching allocator's 512-byte rounding on GPU). On GPU the allocator's own
``torch.cuda.max_memory_allocated`` is reported next to it.

Categories (bytes at the step's peak): ``parameters`` (model weights and buffers), ``gradients`` (Megatron's
``main_grad`` buffers; they are views of one contiguous buffer per DDP bucket group, not ``.grad``), ``optimizer``
(fp32 main weights and Adam moments), ``activations`` (what the forward passes keep, incl. recompute), ``temporary``
(the backward's transient tensors). ``total`` is their sum at the peak.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

T = TypeVar("T")

_CATEGORY = {"Parameter": "parameters", "Buffer": "parameters", "Gradient": "gradients", "Other": "gradients",
             "Optstate": "optimizer", "Activation": "activations", "Temp": "temporary"}


@dataclass(frozen=True, kw_only=True)
class MemoryReport:
    """Tensor memory of one rank during one training step."""

    rank: int
    """Global rank."""
    step: int
    """The optimizer step measured (1-based, as the metrics log counts)."""
    peak_bytes: int
    """Largest live tensor bytes on the rank's device during the step."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes per category at the peak (module docstring)."""
    device_max_allocated_bytes: int | None = None
    """``torch.cuda.max_memory_allocated`` over the step on GPU; ``None`` on CPU."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"rank": self.rank, "step": self.step, "peak_bytes": self.peak_bytes, "breakdown": self.breakdown,
                "device_max_allocated_bytes": self.device_max_allocated_bytes}


def _torch_optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    """The ``torch.optim`` optimizers inside Megatron's wrappers (chained, mixed precision, distributed)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return [optimizer]
    found: list[torch.optim.Optimizer] = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [getattr(optimizer, "optimizer", None)]:
        if inner is not None and inner is not optimizer:
            found.extend(_torch_optimizers(inner))
    return found


def _grad_buffers(chunks: Iterable[Any]) -> list[torch.Tensor]:
    """Megatron DDP's contiguous gradient buffers (``main_grad`` lives in them), or Megatron-FSDP's (each parameter
    group's ``main_grad_buffer`` of its ``param_and_grad_buffer``)."""
    found = []
    for chunk in chunks:
        fsdp = getattr(chunk, "param_and_grad_buffer", None)
        if fsdp is not None and hasattr(fsdp, "parameter_groups"):  # Megatron-FSDP (its .buffers is nn.Module's)
            found.extend(group.main_grad_buffer.data for group in fsdp.parameter_groups
                         if group.main_grad_buffer is not None
                         and isinstance(getattr(group.main_grad_buffer, "data", None), torch.Tensor))
            continue
        for buffer in [*getattr(chunk, "buffers", []), *getattr(chunk, "expert_parallel_buffers", [])]:
            grad = getattr(buffer, "grad_data", None)
            if isinstance(grad, torch.Tensor):
                found.append(grad)
    return found


def _fp32_main_params(optimizer: Any) -> list[torch.Tensor]:
    """Main fp32 copies a mixed-precision optimizer keeps outside its ``torch.optim`` state."""
    found: list[torch.Tensor] = []
    for inner in getattr(optimizer, "chained_optimizers", None) or [optimizer]:
        for groups in (getattr(inner, "fp32_from_float16_groups", None) or [],
                       getattr(inner, "shard_fp32_from_float16_groups", None) or []):
            for group in groups:
                found.extend(t for t in group if isinstance(t, torch.Tensor))
    return found


def tensor_tracker() -> Any:
    import weakref

    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    class ForwardModTracker(ModTracker):
        """``ModTracker`` that follows modules through forward passes only (whether the backward pass runs it reads
        from the autograd engine, as ``ModTracker`` does).

        ``ModTracker`` follows the backward pass with a multi-grad hook on each module's inputs and outputs. On a
        leaf input, such as the tensor a pipeline stage receives (``requires_grad``, handed to the decoder), the
        hook's closure holds the leaf's ``AccumulateGrad`` node, which holds the leaf, which holds the hook: a
        reference cycle through C++ that the garbage collector cannot see, so every received input and its gradient
        stay alive (on the last stage of two, at 16 micro-batches a step, 31 such tensors by its last backward
        pass). The memory measured would then be the tracker's, not the training's."""

        def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
            if torch._dynamo.eval_frame._is_in_optimized_module():  # as ModTracker: compiled modules are not followed
                return
            self._get_append_fn(weakref.ref(mod), self._get_mod_name(mod), False)()
            if self._user_pre_fw_hook is not None:
                self._user_pre_fw_hook(mod, input)

        def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:
            if torch._dynamo.eval_frame._is_in_optimized_module():
                return
            if self._user_post_fw_hook is not None:
                self._user_post_fw_hook(mod, input, output)
            self._get_pop_fn(weakref.ref(mod), self._get_mod_name(mod), False)()

    class StepMemTracker(MemTracker):
        """``MemTracker`` for a whole training step of Megatron: the peak and its breakdown only.

        ``MemTracker`` keeps per-module snapshots and refuses a root module called twice (one step runs several
        micro-batches and pipeline chunks); here the module hooks only register parameters and buffers the first
        time a module runs and follow activation recomputation (so recomputed tensors count as activations).
        Megatron's DDP wrapper has a ``buffers`` attribute (its gradient buffers, a list) that shadows
        ``nn.Module.buffers()``; it is set aside while the wrapper's own buffers are read.
        """

        def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> Any:
            shadow = module.__dict__.pop("buffers", None) if not callable(module.buffers) else None
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                if shadow is not None:
                    module.__dict__["buffers"] = shadow

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = ForwardModTracker()
            self._seen: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()

        def _pre_fw_hook(self, module: torch.nn.Module, inputs: Any) -> None:
            if module not in self._seen:
                self._track_module_params_and_buffers(module, install_grad_hooks=False)
                self._seen.add(module)
            elif self._mod_tracker.is_bw and self._ac_mod is None:  # recomputation of a checkpointed module
                self._ac_mod = weakref.ref(module)
                self._in_ac = True

        def _post_fw_hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod = None
                self._in_ac = False

        def _pre_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            return None

        def _post_bw_hook(self, module: torch.nn.Module, args: Any) -> None:
            return None

    return StepMemTracker()


def measure_step(step: Callable[[], T], *, chunks: Iterable[torch.nn.Module], optimizer: Any, rank: int,
                 step_number: int) -> tuple[T, MemoryReport]:
    """Run ``step()`` (one training step) under ``MemTracker`` and return its result with the rank's report.

    ``chunks`` are the DDP-wrapped model chunks, ``optimizer`` Megatron's optimizer; their existing tensors are
    registered as external so the peak includes them.
    """
    chunks = list(chunks)
    tracker = tensor_tracker()
    tracker.track_external(*chunks, *_torch_optimizers(optimizer))
    tracker.track_external(*_grad_buffers(chunks))
    main_params = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                       for t in _fp32_main_params(optimizer)}.values())
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    with tracker:
        result = step()
    if cuda:
        torch.cuda.synchronize()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    snapshot = tracker.get_tracker_snapshot("peak").get(device, {})
    breakdown: dict[str, int] = {}
    for key, value in snapshot.items():
        if key in _CATEGORY:
            breakdown[_CATEGORY[key]] = breakdown.get(_CATEGORY[key], 0) + int(value)
    if main_params:  # live for the whole step, outside the torch.optim state MemTracker follows
        breakdown["optimizer"] = breakdown.get("optimizer", 0) + main_params
    report = MemoryReport(rank=rank, step=step_number, peak_bytes=int(snapshot.get("Total", 0)) + main_params,
                          breakdown=breakdown,
                          device_max_allocated_bytes=int(torch.cuda.max_memory_allocated()) if cuda else None)
    return result, report
