"""The operator graph of one training step of one layer kind: aten operators with shapes, FLOPs, bytes, modules.

Recorded by :mod:`cfp_megatron.graph.record` from a real forward + backward run (on the meta device, so it costs no
memory). Each operator keeps its exact ``OpOverload`` and arguments, with tensors replaced by :class:`TensorRef`, so
the graph can be replayed, e.g. on DTensors to propagate partitions (:mod:`cfp_megatron.graph.propagation`).
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field, fields
from typing import Any

import torch


class Phase(enum.Enum):
    """Which pass of the training step an operator belongs to."""

    forward = "forward"
    backward = "backward"


@dataclass(frozen=True, kw_only=True)
class TensorRef:
    """Stands for a tensor inside an operator's recorded arguments."""

    id: int
    """Key into :attr:`OpGraph.tensors`."""


@dataclass(frozen=True, kw_only=True)
class TensorMeta:
    """A tensor of the graph."""

    id: int
    """Unique within the graph."""
    shape: tuple[int, ...]
    """Size of each dimension."""
    dtype: str
    """``torch`` dtype name, e.g. ``float32``."""
    param: str | None = None
    """Fully qualified parameter name when the tensor is a module parameter (or its gradient's source)."""
    producer: int | None = None
    """Index of the operator that wrote it; ``None`` for graph inputs and parameters."""

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True, kw_only=True)
class Operator:
    """One aten operator call."""

    index: int
    """Position in execution order."""
    op: Any
    """The ``torch._ops.OpOverload`` that ran (e.g. ``aten.mm.default``)."""
    name: str
    """Its printable name, e.g. ``aten.mm.default``."""
    phase: Phase
    """Forward or backward."""
    module: str
    """Innermost module the call ran in (``ModuleTracker`` path, e.g. ``TransformerLayer.mlp.linear_fc1``)."""
    args: tuple[Any, ...]
    """Positional arguments, tensors replaced by :class:`TensorRef`."""
    kwargs: dict[str, Any]
    """Keyword arguments, tensors replaced by :class:`TensorRef`."""
    inputs: tuple[int, ...]
    """Ids of the tensors read, in argument order."""
    outputs: tuple[int, ...]
    """Ids of the tensors written."""
    flops: int
    """Floating-point operations (PyTorch's ``flop_counter`` rules; 0 for operators it does not count)."""
    bytes_read: int
    """Bytes of all input tensors."""
    bytes_written: int
    """Bytes of all output tensors."""

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled with :attr:`op` by its name (an ``OpOverload`` does not pickle), so a recorded graph can be sent
        to other processes (:func:`cfp_megatron.graph.blocks.verify_graphs_on_gloo`'s ranks)."""
        return _operator, ({f.name: getattr(self, f.name) for f in fields(self) if f.name != "op"},)


def _operator(state: dict[str, Any]) -> Operator:
    """An unpickled :class:`Operator`: its ``OpOverload`` found again by name (``aten.mm.default`` is
    ``torch.ops.aten.mm.default``)."""
    return Operator(op=functools.reduce(getattr, state["name"].split("."), torch.ops), **state)


@dataclass(frozen=True, kw_only=True)
class OpGraph:
    """Operators of one forward + backward pass of one layer kind."""

    kind: str
    """Layer kind, e.g. ``dense``, ``moe``, ``embedding``, ``head``."""
    tensors: dict[int, TensorMeta]
    """Every tensor read or written, by id."""
    operators: tuple[Operator, ...]
    """Operators in execution order."""
    inputs: tuple[int, ...]
    """Ids of the activations fed in (before the parameters)."""
    params: dict[str, int] = field(default_factory=dict)
    """Parameter name -> tensor id."""

    def phase(self, phase: Phase) -> tuple[Operator, ...]:
        """The operators of one pass."""
        return tuple(o for o in self.operators if o.phase is phase)

    @property
    def flops(self) -> int:
        """Total FLOPs of the step."""
        return sum(o.flops for o in self.operators)

    @property
    def param_count(self) -> int:
        """Parameters of the layer."""
        return sum(self.tensors[i].numel for i in self.params.values())

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready summary (operators without their Python argument objects)."""
        return {
            "kind": self.kind,
            "flops": self.flops,
            "params": self.param_count,
            "inputs": list(self.inputs),
            "tensors": {str(t.id): {"shape": list(t.shape), "dtype": t.dtype, "param": t.param,
                                    "producer": t.producer} for t in self.tensors.values()},
            "operators": [{"index": o.index, "op": o.name, "phase": o.phase.value, "module": o.module,
                           "inputs": list(o.inputs), "outputs": list(o.outputs), "flops": o.flops,
                           "bytes_read": o.bytes_read, "bytes_written": o.bytes_written} for o in self.operators],
        }
