"""Run Megatron-Core on CPU with gloo: a thin layer that maps its CUDA-only calls to the CPU.

Installed only when CUDA is absent (:func:`install_if_needed`). It changes no Megatron algorithm: it redirects
device placement (``device="cuda"``, ``torch.cuda.current_device()``, ``Tensor.cuda``) to the CPU, makes CUDA
streams/events no-ops, backs Megatron's CUDA RNG tracker with the CPU generator (the one CPU dropout uses), and
keeps Megatron's recomputation checkpoints out of Transformer Engine's FP8 contexts where TE is absent.
MoE without Transformer Engine needs the fixes in :mod:`cfp_megatron.compat.moe` (on any device).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any

import torch

from cfp_megatron.compat.device_mode import DeviceRewriteMode

log = logging.getLogger(__name__)

_installed = False
_mode: DeviceRewriteMode | None = None


class _NoOpStream:
    """Stands in for ``torch.cuda.Stream``: work on CPU is already ordered."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cpu")

    def wait_stream(self, other: Any) -> None:
        """No-op."""

    def wait_event(self, event: Any) -> None:
        """No-op."""

    def record_event(self, event: Any = None) -> _NoOpEvent:
        """Return a completed event."""
        return event or _NoOpEvent()

    def synchronize(self) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def __enter__(self) -> _NoOpStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


class _NoOpEvent:
    """Stands in for ``torch.cuda.Event``; timings come from wall clock."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._t = 0.0

    def record(self, stream: Any = None) -> None:
        """Remember the wall-clock time."""
        self._t = time.perf_counter()

    def synchronize(self) -> None:
        """No-op."""

    def wait(self, stream: Any = None) -> None:
        """No-op."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def elapsed_time(self, end: _NoOpEvent) -> float:
        """Milliseconds between two recorded events."""
        return (end._t - self._t) * 1000.0


def _cpu_rng_state(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    torch.set_rng_state(state)


def _patch_torch_cuda() -> None:
    cuda = torch.cuda
    # Megatron mostly writes ``device=torch.cuda.current_device()``: answering with the CPU device keeps those calls
    # right even where the TorchFunctionMode is not on the stack (code run inside an intercepted Python function,
    # such as the nested torch.autograd.backward of activation recomputation).
    cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    cuda.set_device = lambda *a, **k: None  # type: ignore[assignment]
    cuda.synchronize = lambda *a, **k: None  # type: ignore[assignment]
    cuda.empty_cache = lambda: None  # type: ignore[assignment]
    cuda.Stream = _NoOpStream  # type: ignore[assignment,misc]
    cuda.Event = _NoOpEvent  # type: ignore[assignment,misc]
    default_stream = _NoOpStream()
    cuda.current_stream = lambda *a, **k: default_stream  # type: ignore[assignment]
    cuda.default_stream = lambda *a, **k: default_stream  # type: ignore[assignment]
    cuda.stream = lambda *a, **k: contextlib.nullcontext()  # type: ignore[assignment]
    cuda.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    cuda.set_rng_state = _set_cpu_rng_state  # type: ignore[assignment]
    cuda.random.get_rng_state = _cpu_rng_state  # type: ignore[assignment]
    cuda.random.set_rng_state = _set_cpu_rng_state  # type: ignore[assignment]
    # The "CUDA" generator is the CPU default generator; torch.manual_seed already seeds it and then calls
    # cuda.manual_seed_all, which therefore must not recurse.
    cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed)) and None  # type: ignore[assignment]
    cuda.manual_seed_all = lambda seed: None  # type: ignore[assignment]
    cuda.memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.max_memory_allocated = lambda *a, **k: 0  # type: ignore[assignment]
    cuda.reset_peak_memory_stats = lambda *a, **k: None  # type: ignore[assignment]
    torch.Tensor.cuda = lambda self, *a, **k: self  # type: ignore[method-assign]
    # Megatron's optimizers check ``tensor.type() == 'torch.cuda.FloatTensor'``: CPU tensors stand in for CUDA ones.
    original_type = torch.Tensor.type

    def _type(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        name = original_type(self, *args, **kwargs)
        plain = isinstance(name, str) and name.startswith("torch.") and not name.startswith("torch.cuda.")
        if not args and not kwargs and plain and self.device.type == "cpu":
            return "torch.cuda." + name[len("torch."):]
        return name

    torch.Tensor.type = _type  # type: ignore[method-assign]


def _patch_megatron() -> None:
    from megatron.core.tensor_parallel import random as mrandom
    from megatron.core.transformer import torch_norm

    mrandom._get_cuda_rng_state = _cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state

    # Without Apex/TE the local spec uses WrappedTorchNorm, which refuses sequence parallelism only because it does
    # not tag its parameters. Tag them as Megatron's fused norms do, so finalize_model_grads all-reduces their
    # gradients over the TP group (each TP rank saw a different part of the sequence).
    original_new = torch_norm.WrappedTorchNorm.__new__

    def _new(cls: type, config: Any, hidden_size: int, eps: float = 1e-5, **kwargs: Any) -> torch.nn.Module:
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, eps, **kwargs)
        norm = original_new(cls, dataclasses.replace(config, sequence_parallel=False), hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = _new  # type: ignore[method-assign]

    # megatron-core 0.16.1's CheckpointWithoutOutput (selective recomputation of the norms, recompute_modules
    # layernorm) reads its fp8 flag as "fp8 is not None", so fp8=False enters Transformer Engine's FP8 contexts,
    # which are not imported without TE. Without TE there is no FP8, so the flag is false (the recomputation stays
    # Megatron's).
    if not mrandom.HAVE_TE:
        original_init = mrandom.CheckpointWithoutOutput.__init__

        def _init(self: Any, fp8: Any = False) -> None:
            original_init(self, fp8)
            self.fp8 = False

        mrandom.CheckpointWithoutOutput.__init__ = _init  # type: ignore[method-assign]


def install_if_needed() -> bool:
    """Install the CPU layer when CUDA is unavailable; return whether it is active. Idempotent."""
    global _installed, _mode
    if torch.cuda.is_available():
        return False
    if _installed:
        return True
    _patch_torch_cuda()
    _patch_megatron()
    _mode = DeviceRewriteMode(sources=("cuda",), target="cpu")
    _mode.__enter__()
    _installed = True
    log.info("cfp_megatron.compat.cpu: CUDA absent; Megatron-Core CUDA calls mapped to CPU")
    return True
