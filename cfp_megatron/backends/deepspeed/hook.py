"""Capture a plain PyTorch model handed to ``deepspeed.initialize``.

The repeated blocks are the children of the model's largest ``nn.ModuleList`` (by parameters). Blocks with the same
module types and parameter shapes are one kind. On a meta copy of the model, one forward pass (not recorded; free on
meta) finds each block's input; then one block of each kind is recorded, and the rest of the model (``rest``:
embeddings, final norm, head, loss) is recorded with every block replaced by a pass-through. The model is the
sequence ``rest`` (once), then the kind of each block.

:func:`initialize` wraps ``deepspeed.initialize``: it captures the model and, when the DeepSpeed config holds
``"auto"`` values, plans them for this model on the live ranks
(:mod:`cfp_megatron.backends.deepspeed.hook_plan`) before DeepSpeed builds its engine.
"""

from __future__ import annotations

import copy
import importlib.util
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_map

from cfp_megatron.backends.deepspeed.hook_config import plan_request
from cfp_megatron.backends.deepspeed.hook_measure import DEFAULT_PROBE_BUDGET_S
from cfp_megatron.backends.deepspeed.hook_plan import flops_per_token, plan_model
from cfp_megatron.base.backend_spec import load_config
from cfp_megatron.base.errors import ConfigError, ConfigIssue
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
               loss_fn: Callable[[Any], torch.Tensor] | None = None, output_dir: str | Path | None = None,
               probe_budget_s: float = DEFAULT_PROBE_BUDGET_S, **kwargs: Any) -> Any:
    """``deepspeed.initialize(model=model, **kwargs)`` with the DeepSpeed config planned for this model.

    ``model`` is captured first (attached as ``model.cfp_capture``). When the config (``config=``, a dict or a JSON
    path, read and never written; or ``config_params=``, or ``args.deepspeed_config``) holds ``"auto"`` for
    ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``zero_optimization.stage`` or an offload
    device, the hook plans them (:mod:`cfp_megatron.backends.deepspeed.hook_plan`): it measures the model's forward
    and backward on ``example_input`` re-batched to 1, 2 and 4 sequences on every rank (weights untouched), fits
    the collectives (or reads the ProfileDB), probes DeepSpeed's engine for each ZeRO stage it may choose around a
    deep copy of the model within ``probe_budget_s`` seconds (0: no probes; the stages not reached keep the
    analytical ZeRO terms), simulates every ZeRO stage x micro-batch x offload the config's
    concrete values leave with :func:`cfp_megatron.backends.deepspeed.costs.zero_step`, and hands DeepSpeed the fastest
    plan's config (rank 0 plans and broadcasts; the plan is attached as ``model.cfp_plan``, and written as
    ``output_dir/ds_config.json`` on rank 0 when ``output_dir`` is given). Activation checkpointing is not planned
    (DeepSpeed cannot switch it on for a plain module). ``loss_fn`` maps the model's output to a scalar loss for the
    capture and the measurements (default: the sum of its first output). A config without ``"auto"`` passes through
    unplanned.

    Raises a :class:`~cfp_megatron.base.errors.ConfigError` naming the key, its value and the fix for a config that
    cannot be planned or a bad ``probe_budget_s`` (checked before the capture and before any engine),
    :class:`DeepSpeedUnavailable` after capturing when DeepSpeed is not installed, and an
    :class:`~cfp_megatron.backends.deepspeed.hook_measure.EngineProbeError` when the model cannot be copied or its
    probe engine cannot be built.
    """
    raw = kwargs.get("config", kwargs.get("config_params"))
    args = kwargs.get("args")
    if raw is None and getattr(args, "deepspeed_config", None) is not None:
        raw = args.deepspeed_config
    request = None
    if raw is not None:
        request = plan_request(load_config(raw), _world_size())
    _check_budget(probe_budget_s)
    for key in ("mpu", "mesh_param"):
        if request is not None and kwargs.get(key) is not None:
            raise ConfigError(ConfigIssue(key=key, value=type(kwargs[key]).__name__,
                                          problem="the hook plans data parallelism over every rank, and model "
                                                  "parallelism changes the data-parallel size.",
                                          fix=f'pin the config\'s "auto" values, or leave out {key}.'))
    capture = capture_deepspeed_model(model, example_input, name=name, loss_fn=loss_fn)
    object.__setattr__(model, "cfp_capture", capture)
    if importlib.util.find_spec("deepspeed") is None:
        raise DeepSpeedUnavailable("deepspeed is not installed: the capture is in model.cfp_capture; install "
                                   "deepspeed (pip install deepspeed) to build the engine.")
    import deepspeed

    if request is None:
        return deepspeed.initialize(model=model, **kwargs)
    from deepspeed import comm
    from deepspeed.accelerator import get_accelerator

    # as deepspeed.initialize itself starts the process group (a no-op when it is up)
    comm.init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                          distributed_port=kwargs.get("distributed_port", 29500),
                          dist_init_required=kwargs.get("dist_init_required"))
    console = None
    if comm.get_rank() == 0:
        from rich.console import Console

        console = Console(highlight=False, soft_wrap=True)
    planned = plan_model(model, example_input, request, name=capture.model, seq_length=capture.seq_length,
                         layers=len(capture.layer_kinds),
                         flops_per_token=flops_per_token(capture.total_flops, capture.micro_batch_size,
                                                         capture.seq_length),
                         loss_fn=loss_fn, output_dir=output_dir, console=console, probe_budget_s=probe_budget_s)
    object.__setattr__(model, "cfp_plan", planned)
    kwargs.pop("config_params", None)
    kwargs["config"] = planned.config
    if getattr(args, "deepspeed_config", None) is not None:
        args = copy.copy(args)
        args.deepspeed_config = None  # DeepSpeed refuses a config given twice
        kwargs["args"] = args
    return deepspeed.initialize(model=model, **kwargs)


def _check_budget(probe_budget_s: Any) -> None:
    """A :class:`ConfigError` unless ``probe_budget_s`` is a finite number of seconds at 0 or above."""
    ok = isinstance(probe_budget_s, int | float) and not isinstance(probe_budget_s, bool)
    if not ok or not math.isfinite(probe_budget_s) or probe_budget_s < 0:
        raise ConfigError(ConfigIssue(key="probe_budget_s", value=probe_budget_s,
                                      problem="is not a number of seconds at 0 or above.",
                                      fix="give the seconds the engine probes may take, or 0 to plan without them."))


def _world_size() -> int:
    """Ranks of the job: the process group's, else the launcher's ``WORLD_SIZE`` (1 without one)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))
