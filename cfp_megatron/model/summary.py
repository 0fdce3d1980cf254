"""JSON-ready summaries of a capture: what later stages need once the live operator graphs are gone.

An :class:`~cfp_megatron.graph.opgraph.OpGraph` keeps live ``OpOverload`` objects and argument trees (needed to replay
it on DTensors); those do not serialise. :class:`CaptureSummary` keeps, per layer kind, the counts and the operator
list of ``OpGraph.to_json()`` (names, phases, modules, tensor shapes, FLOPs, bytes): enough for the simulator and
for reports, and what :mod:`cfp_megatron.model.cache` stores. Re-capture when the live graphs are needed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SCHEMA_VERSION = 1
"""Version of the JSON layout below; part of every cache key."""


@dataclass(frozen=True, kw_only=True)
class KindSummary:
    """One layer kind of a captured model."""

    kind: str
    """Layer kind, e.g. ``embedding``, ``dense``, ``moe``, ``head``."""
    count: int
    """How many times the kind occurs in the model."""
    params: int
    """Parameters of one instance."""
    flops: int
    """FLOPs of one instance for one micro-batch, forward + backward."""
    forward_flops: int
    """FLOPs of one instance for one micro-batch, forward only."""
    operators: int
    """Aten operators of one instance's forward + backward."""
    graph: dict[str, Any]
    """``OpGraph.to_json()`` of the instance (empty when the summary was built without graphs)."""

    def to_json(self, *, with_graph: bool = True) -> dict[str, Any]:
        """A JSON-ready dict."""
        out: dict[str, Any] = {"kind": self.kind, "count": self.count, "params": self.params, "flops": self.flops,
                               "forward_flops": self.forward_flops, "operators": self.operators}
        if with_graph:
            out["graph"] = self.graph
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KindSummary:
        """Inverse of :meth:`to_json`."""
        return cls(kind=data["kind"], count=int(data["count"]), params=int(data["params"]), flops=int(data["flops"]),
                   forward_flops=int(data["forward_flops"]), operators=int(data["operators"]),
                   graph=data.get("graph", {}))


@dataclass(frozen=True, kw_only=True)
class CaptureSummary:
    """A captured model in JSON-ready form."""

    model: str
    """Model name."""
    seq_length: int
    """Tokens per sequence the capture ran with."""
    micro_batch_size: int
    """Sequences per micro-batch the capture ran with."""
    layer_kinds: tuple[str, ...]
    """Kind of each decoder layer, in order."""
    kinds: dict[str, KindSummary]
    """Every kind (``embedding`` and ``head`` included), by name."""
    shared_params: int = 0
    """Parameters counted in more than one kind (tied input/output embeddings); subtracted once from the total."""

    @property
    def sequence(self) -> tuple[str, ...]:
        """The model as a sequence of kinds: embedding, each decoder layer, head (those present)."""
        pre = ("embedding",) if "embedding" in self.kinds else ()
        post = ("head",) if "head" in self.kinds else ()
        return pre + self.layer_kinds + post

    @property
    def total_params(self) -> int:
        """Parameters of the whole model."""
        return sum(k.params * k.count for k in self.kinds.values()) - self.shared_params

    @property
    def total_flops(self) -> int:
        """FLOPs of one micro-batch's forward + backward through the whole model."""
        return sum(k.flops * k.count for k in self.kinds.values())

    def to_json(self, *, with_graphs: bool = True) -> dict[str, Any]:
        """A JSON-ready dict (``with_graphs=False`` drops the operator lists)."""
        return {"schema": SCHEMA_VERSION, "model": self.model, "seq_length": self.seq_length,
                "micro_batch_size": self.micro_batch_size, "layer_kinds": list(self.layer_kinds),
                "shared_params": self.shared_params, "total_params": self.total_params,
                "total_flops": self.total_flops,
                "kinds": {name: k.to_json(with_graph=with_graphs) for name, k in self.kinds.items()}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CaptureSummary:
        """Inverse of :meth:`to_json`."""
        return cls(model=data["model"], seq_length=int(data["seq_length"]),
                   micro_batch_size=int(data["micro_batch_size"]), layer_kinds=tuple(data["layer_kinds"]),
                   kinds={name: KindSummary.from_json(k) for name, k in data["kinds"].items()},
                   shared_params=int(data.get("shared_params", 0)))
