"""Megatron-Core imported for the planner's analysis without paying for what it does not use.

Two costs dominate a cold analysis process besides the work itself (docs/analysis.md, "Time"):

- Megatron-Core decorates its fused kernels with ``jit_fuser = torch.compile`` when its modules load; the first
  ``torch.compile`` call imports TorchInductor and AOTAutograd (about a second of CPU), though nothing compiled runs
  on the meta device. :func:`deferred_torch_compile` makes the decorations made while it is active compile at their
  first call instead, with the same arguments: a process that runs a fused kernel compiles it as before.
- Python's cyclic garbage collector walks every live object on each full collection and once more at exit; torch
  and Megatron-Core leave millions of them, all alive as long as the process. :func:`heavy_imports` imports with
  the collector paused and then moves the imported heap out of its sight (``gc.freeze``); :func:`collector_paused`
  keeps it off while a stage makes many short-lived objects.

A launch's ranks (and the profiler's) pay the same at their first import of Megatron-Core, once per process:
:func:`import_megatron` imports it with these costs cut (torchrun start-up: docs/testing.md, "Keeping the suite
fast").
"""

from __future__ import annotations

import contextlib
import functools
import gc
import inspect
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while inside; on again after, if it was on (garbage made inside is
    collected then)."""
    was_on = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_on:
            gc.enable()


def _compile_at_first_call(compile_fn: Callable[..., Any], fn: Callable[..., Any],
                           kwargs: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` as ``compile_fn(fn, **kwargs)`` would wrap it, compiled when it is first called. Called while a
    ``TorchDispatchMode`` is active (the capture's recorder), it runs ``fn`` eagerly and compiles nothing, as
    TorchDynamo runs a compiled function's frames there (its default ``inline_torch_dispatch_torch_compile``)."""
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack

    compiled: list[Callable[..., Any]] = []
    lock = threading.Lock()

    @functools.wraps(fn)
    def call(*args: Any, **kw: Any) -> Any:
        if not compiled and any_torch_dispatch_mode_on_stack():
            return fn(*args, **kw)
        if not compiled:
            with lock:
                if not compiled:
                    compiled.append(compile_fn(fn, **kwargs))
        return compiled[0](*args, **kw)

    return call


@contextlib.contextmanager
def deferred_torch_compile() -> Iterator[None]:
    """While inside, ``torch.compile`` of a plain function (as a decorator, with or without arguments) returns a
    wrapper that compiles it at its first call; anything else (a module, a compile with no function) goes to
    ``torch.compile`` at once."""
    import torch

    real = torch.compile

    def deferred(model: Any = None, **kwargs: Any) -> Any:
        if model is None:
            return lambda fn: deferred(fn, **kwargs)
        if inspect.isfunction(model):
            return _compile_at_first_call(real, model, kwargs)
        return real(model, **kwargs)

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


@contextlib.contextmanager
def heavy_imports() -> Iterator[None]:
    """For the imports made inside, in a process that has not imported Megatron-Core yet: the collector paused and
    ``torch.compile`` deferred while they run, and what they leave frozen (``gc.freeze``) after; elsewhere a no-op.
    Objects alive at the freeze are never collected as cycles: they are the imported modules' and the caller's,
    which live as long as the process."""
    if "megatron.core" in sys.modules:
        yield
        return
    with collector_paused(), deferred_torch_compile():
        yield
        gc.freeze()


def import_megatron() -> None:
    """Megatron-Core, and TorchDynamo (torch's optimizers import it when the first one is made), imported under
    :func:`heavy_imports`: a rank's import costs less than half the CPU time. Call it where a process is about to
    import Megatron-Core anyway (after ``quiet_expected_warnings``); nothing new when it is imported already."""
    with heavy_imports():
        import megatron.core  # noqa: F401
        import torch._dynamo  # noqa: F401
