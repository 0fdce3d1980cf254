"""Upstream warnings that are expected without Transformer Engine, Apex or a GPU: filtered one by one (exact
message and module), and said once in one line instead.

Megatron-Core warns at import, once per module, that Transformer Engine and Apex are absent and that it falls back to
PyTorch code (seven warnings per process, per rank under torchrun); its ``TransformerConfig`` warns that ``core_attn``
recompute may be redundant with Transformer Engine's fused attention (which is not in use without TE), and that its
own default ``cuda_graph_scope="full"`` is deprecated; PyTorch's DTensor logs that gloo has no all-to-all. None of
them is something the user can act on (a custom MLP's "Unknown MLP type" line, logged per layer built, is let
through once per process): :func:`quiet_expected_warnings` filters exactly these (installed before
Megatron-Core is imported) and returns the one line that says what they meant. Every other warning still shows.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class ExpectedWarning:
    """One upstream warning that is expected in some environment."""

    message: str
    """Regular expression matched at the start of the warning's text."""
    module: str
    """Regular expression matched at the start of the module the warning is attributed to."""
    without: str | None
    """The package whose absence makes the warning expected (``None``: expected everywhere)."""


EXPECTED: tuple[ExpectedWarning, ...] = (
    ExpectedWarning(r"Transformer Engine and Apex are not installed\. Falling back to ", r"megatron", "apex"),
    ExpectedWarning(r"Apex is not installed\. Falling back to Torch Norm", r"megatron\.core\.", "apex"),
    ExpectedWarning(r"If you are using transformer_engine as the transformer implementation, the core_attn is from "
                    r"transformer_engine", r"megatron\.core\.transformer\.transformer_config", "transformer_engine"),
    # Megatron-Core 0.16's own default (cuda_graph_scope="full") trips its own deprecation warning; nothing to do.
    ExpectedWarning(r"full scope is deprecated\. Use empty cuda_graph_scope", r"megatron\.core\.transformer\.", None),
)
"""The filtered warnings (``warnings.filterwarnings`` with these messages and modules)."""

_GLOO_ALLTOALL = "CPU process group does not support alltoall yet"
"""PyTorch DTensor's log line (not a warning) when it redistributes over gloo: expected on CPU."""

_DTENSOR_LOGGER = "torch.distributed.tensor._collective_utils"
"""The logger that says it."""

_said = False


class _DropGlooAlltoall(logging.Filter):
    """Drops DTensor's "no alltoall on CPU" line; the note of :func:`quiet_expected_warnings` says it."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_GLOO_ALLTOALL)


_CUSTOM_MLP = "Unknown MLP type"
"""Megatron-Core's ``TransformerLayer`` log line for an MLP of a custom spec (``model.spec``), once per layer built."""

_LAYER_LOGGER = "megatron.core.transformer.transformer_layer"
"""The logger that says it."""


class _OnceOnly(logging.Filter):
    """Lets the first record whose message starts with ``prefix`` through and drops its repeats."""

    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix
        self.seen = False

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(self.prefix):
            return True
        first, self.seen = not self.seen, True
        return first


def missing_kernels() -> list[str]:
    """The optional kernel packages Megatron-Core falls back from here (``Transformer Engine``, ``Apex``)."""
    names = {"transformer_engine": "Transformer Engine", "apex": "Apex"}
    return [shown for module, shown in names.items() if importlib.util.find_spec(module) is None]


def quiet_expected_warnings(*, distributed: bool = True) -> str | None:
    """Filter the :data:`EXPECTED` warnings of the packages missing here (call it before importing Megatron-Core)
    and DTensor's gloo line; return the one line that says what they meant (with the gloo fallback when the tool
    runs collectives: ``distributed``), or ``None`` when nothing is missing."""
    absent = {name for name in ("transformer_engine", "apex") if importlib.util.find_spec(name) is None}
    for w in EXPECTED:
        if w.without is None or w.without in absent:
            warnings.filterwarnings("ignore", message=w.message, category=UserWarning, module=w.module)
    logger = logging.getLogger(_DTENSOR_LOGGER)
    if not any(isinstance(f, _DropGlooAlltoall) for f in logger.filters):
        logger.addFilter(_DropGlooAlltoall())
    layers = logging.getLogger(_LAYER_LOGGER)  # a custom MLP's line: once per process, not once per layer built
    if not any(isinstance(f, _OnceOnly) for f in layers.filters):
        layers.addFilter(_OnceOnly(_CUSTOM_MLP))
    import torch

    missing = missing_kernels()
    if not missing:
        return None
    gloo = distributed and not torch.cuda.is_available()
    cpu = "; on CPU (gloo) DTensor's all-to-all runs as all-gather + chunk" if gloo else ""
    return (f"cfp: running without {'/'.join(missing)}: Megatron-Core falls back to its local kernels (PyTorch "
            f"norms, attention and optimizers){cpu}")


def say_once(note: str | None) -> None:
    """Print ``note`` on stderr once per process, on rank 0 only (torchrun's ``RANK``)."""
    global _said
    if note is None or _said or os.environ.get("RANK", "0") != "0":
        return
    _said = True
    print(note, file=sys.stderr, flush=True)
