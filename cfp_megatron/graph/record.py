"""Record the aten operators of a forward + backward pass into an :class:`~cfp_megatron.graph.opgraph.OpGraph`.

A ``TorchDispatchMode`` sees every aten call below autograd (forward and backward alike); PyTorch's own
``flop_counter`` rules give the FLOPs and ``ModuleTracker`` the module each call ran in. Run it on meta tensors and
a 405B-parameter layer costs no memory.
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import flop_registry
from torch.utils.module_tracker import ModuleTracker
from torch.utils.weak import WeakIdKeyDictionary

from cfp_megatron.graph.opgraph import Operator, OpGraph, Phase, TensorMeta, TensorRef


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _tensors(x: Any, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results, appended to ``out`` in pytree's order (tuples and lists
    in order, dicts by insertion): ``tree_flatten`` without its per-node type dispatch, on the recorder's hot path."""
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif isinstance(x, tuple | list):
        for v in x:
            _tensors(v, out)
    elif isinstance(x, dict):
        for v in x.values():
            _tensors(v, out)
    return out


def _mapped(fn: Callable[[torch.Tensor], Any], x: Any) -> Any:
    """``tree_map(fn, x)`` for tensors inside plain tuples, lists and dicts; other containers go to ``tree_map``."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    kind = type(x)
    if kind is tuple:
        return tuple(_mapped(fn, v) for v in x)
    if kind is list:
        return [_mapped(fn, v) for v in x]
    if kind is dict:
        return {k: _mapped(fn, v) for k, v in x.items()}
    if isinstance(x, tuple | list | dict):
        return tree_map(lambda v: fn(v) if isinstance(v, torch.Tensor) else v, x)
    return x


class OpRecorder(TorchDispatchMode):
    """Collects every aten call made while it is active."""

    def __init__(self, tracker: ModuleTracker, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.tracker = tracker
        self.phase = Phase.forward
        self._ids: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._keep: list[torch.Tensor] = []  # keeps recorded tensors alive so their ids stay unique
        self.tensors: dict[int, TensorMeta] = {}
        self.operators: list[Operator] = []
        self.params: dict[str, int] = {name: self.tensor_id(p, param=name) for name, p in params.items()}

    def tensor_id(self, t: torch.Tensor, *, param: str | None = None, producer: int | None = None) -> int:
        """The id of ``t``, registering it on first sight."""
        found = self._ids.get(t)
        if found is not None:
            return found
        new = len(self.tensors)
        self._ids[t] = new
        self._keep.append(t)
        self.tensors[new] = TensorMeta(id=new, shape=tuple(int(s) for s in t.shape),
                                       dtype=str(t.dtype).removeprefix("torch."), param=param, producer=producer)
        return new

    def _module(self) -> str:
        parents = [p for p in self.tracker.parents if p != "Global"]
        return max(parents, key=len) if parents else "Global"

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        index = len(self.operators)
        flat_in = _tensors(kwargs, _tensors(args, []))
        inputs = tuple(self.tensor_id(t) for t in flat_in)
        flat_out = _tensors(out, [])
        outputs = tuple(self.tensor_id(t, producer=index) for t in flat_out)
        rule = flop_registry.get(func._overloadpacket)
        flops = int(rule(*args, **kwargs, out_val=out)) if rule is not None else 0

        def ref(x: torch.Tensor) -> TensorRef:
            return TensorRef(id=self.tensor_id(x))

        self.operators.append(Operator(
            index=index, op=func, name=str(func), phase=self.phase, module=self._module(),
            args=_mapped(ref, args), kwargs=_mapped(ref, kwargs), inputs=inputs, outputs=outputs, flops=flops,
            bytes_read=sum(_nbytes(t) for t in flat_in), bytes_written=sum(_nbytes(t) for t in flat_out)))
        return out


class _ForwardTracker(ModuleTracker):
    """``ModuleTracker`` for a forward pass with no backward after it: the same module names, without the gradient
    hooks it registers on every module's inputs and outputs to follow the backward pass."""

    def _fw_pre_hook(self, mod: torch.nn.Module, input: Any) -> None:
        self.parents.add(self._get_mod_name(mod))

    def _fw_post_hook(self, mod: torch.nn.Module, input: Any, output: Any) -> None:
        self.parents.discard(self._get_mod_name(mod))


_FORWARD_ONLY: contextvars.ContextVar[bool] = contextvars.ContextVar("cfp_forward_only", default=False)


@contextmanager
def forward_only() -> Iterator[None]:
    """While inside, :func:`record_step` records the forward pass only (what the partition analysis replays)."""
    token = _FORWARD_ONLY.set(True)
    try:
        yield
    finally:
        _FORWARD_ONLY.reset(token)


def record_step(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, kind: str,
                loss_fn: Callable[[Any], torch.Tensor] | None = None,
                forward: Callable[..., Any] | None = None) -> OpGraph:
    """Run ``module`` forward on ``inputs`` and backward from ``loss_fn(output)``; return what ran.

    ``forward`` replaces ``module(*inputs)`` when the call needs more arguments. The default loss sums the first
    output, so the backward pass receives a gradient of ones, as a real loss would send one of the same shape.
    """
    tracker = _ForwardTracker() if _FORWARD_ONLY.get() else ModuleTracker()
    params = dict(module.named_parameters())
    with tracker, OpRecorder(tracker, params) as recorder:
        input_ids = tuple(recorder.tensor_id(t) for t in inputs)
        out = forward(*inputs) if forward is not None else module(*inputs)
        first = out[0] if isinstance(out, tuple | list) else out
        loss = loss_fn(out) if loss_fn is not None else first.float().sum()
        if not _FORWARD_ONLY.get():
            recorder.phase = Phase.backward
            loss.backward()
    return OpGraph(kind=kind, tensors=recorder.tensors, operators=tuple(recorder.operators), inputs=input_ids,
                   params=recorder.params)
