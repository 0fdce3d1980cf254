"""The CUDA environment a rank trains in: the variables the runtime sets where the user has not, read before CUDA
starts (docs/simulator.md, "Allocator band")."""

from __future__ import annotations

import os
from collections.abc import Mapping

RUNTIME_ENV: Mapping[str, str] = {
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
}
"""What every rank sets before CUDA starts, unless already set: one CUDA work queue, which Megatron's TP/SP overlap
relies on (as Megatron-LM's own launch scripts set), and PyTorch's caching allocator with expandable segments, as
Megatron-Bridge's performance recipes run (``src/megatron/bridge/perf_recipes/*/*/*.py``, ``PYTORCH_CUDA_ALLOC_CONF``,
read at 067f987df). Both do nothing on a CPU rank."""

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")
"""The variables PyTorch's allocator reads its settings from (torch 2.9 and newer read ``PYTORCH_ALLOC_CONF`` first);
a user who sets any of them, even empty, chooses the allocator's settings and the runtime adds none."""


def set_runtime_env(environ: os._Environ[str] | dict[str, str] | None = None) -> None:
    """Set :data:`RUNTIME_ENV` in ``environ`` (this process's) where the user has not: the allocator's settings only
    where none of :data:`ALLOC_CONF_VARS` is set."""
    environ = os.environ if environ is None else environ
    for key, value in RUNTIME_ENV.items():
        if key in ALLOC_CONF_VARS and any(var in environ for var in ALLOC_CONF_VARS):
            continue
        environ.setdefault(key, value)


def alloc_conf(environ: Mapping[str, str] | None = None) -> str:
    """The allocator settings a rank started from ``environ`` (this process's) runs with: the first of
    :data:`ALLOC_CONF_VARS` set, else the runtime's (:data:`RUNTIME_ENV`)."""
    environ = os.environ if environ is None else environ
    for var in ALLOC_CONF_VARS:
        if var in environ:
            return environ[var]
    return RUNTIME_ENV["PYTORCH_CUDA_ALLOC_CONF"]


def expandable_segments(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a rank started from ``environ`` runs the caching allocator with ``expandable_segments:True``
    (PyTorch parses ``key:value`` pairs separated by commas; the value ``True`` turns it on)."""
    on = False
    for pair in alloc_conf(environ).split(","):
        key, _, value = pair.partition(":")
        if key.strip() == "expandable_segments":
            on = value.strip() == "True"  # the last setting of a key is the one that holds
    return on
