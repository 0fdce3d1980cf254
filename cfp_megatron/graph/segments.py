"""Segments (CFP): block sequences with identical structure and behaviour, clustered into classes.

The model is composed from layer graphs (embedding, one graph per decoder-layer kind, head), so the natural
repeating unit is one layer: a *segment* is the ParallelBlock sequence of one layer instance. Two segments belong to
the same *class* when their blocks have the same signature: the same operators with the same shapes (structure) and
the same candidate entry partitions leading to the same exit partitions (behaviour). Only one segment per class needs
profiling; the model's cost is the sum over its runs. A 96-layer GPT has three classes (embedding, layer, head).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cfp_megatron.graph.blocks import ParallelBlock
from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.propagation import placement_str


def block_signature(block: ParallelBlock) -> str:
    """Structure and behaviour of a block, as a short hash (positions and tensor ids left out)."""
    behaviour = sorted((placement_str(c.entry), placement_str(c.exit)) for c in block.candidates)
    text = repr((block.names, block.entry_shape, block.exit_shape, behaviour))
    return hashlib.sha256(text.encode()).hexdigest()[:12]


@dataclass(frozen=True, kw_only=True)
class SegmentClass:
    """Segments with identical blocks; one representative is profiled."""

    id: str
    """Short hash of the block signatures."""
    kinds: tuple[str, ...]
    """Layer kinds whose graphs have these blocks (normally one)."""
    blocks: tuple[ParallelBlock, ...]
    """The blocks of one segment, in order."""
    instances: int
    """Segments of this class in the model."""
    flops: int
    """FLOPs of one segment's training step (forward + backward)."""
    params: int
    """Parameters of one segment."""

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"id": self.id, "kinds": list(self.kinds), "instances": self.instances, "flops": self.flops,
                "params": self.params, "blocks": [b.to_json() for b in self.blocks]}


@dataclass(frozen=True, kw_only=True)
class SegmentRun:
    """Consecutive segments of one class."""

    class_id: str
    """:attr:`SegmentClass.id`."""
    first: int
    """Position of the first segment in the model's layer sequence."""
    count: int
    """How many in a row."""


@dataclass(frozen=True, kw_only=True)
class Segmentation:
    """The model as runs of segment classes."""

    classes: tuple[SegmentClass, ...]
    """Distinct classes, in order of first appearance."""
    runs: tuple[SegmentRun, ...]
    """The whole sequence, run-length encoded."""

    @property
    def segments(self) -> int:
        """Segments in the model."""
        return sum(r.count for r in self.runs)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready form."""
        return {"classes": [c.to_json() for c in self.classes],
                "runs": [{"class": r.class_id, "first": r.first, "count": r.count} for r in self.runs]}


def segment_model(sequence: Sequence[str], blocks: Mapping[str, Sequence[ParallelBlock]],
                  graphs: Mapping[str, OpGraph]) -> Segmentation:
    """Cluster the layer sequence (kinds in model order, e.g. embedding, dense x L, head) into segment classes."""
    class_of_kind: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    for kind in dict.fromkeys(sequence):
        digest = hashlib.sha256("|".join(block_signature(b) for b in blocks[kind]).encode()).hexdigest()[:12]
        class_of_kind[kind] = digest
        members.setdefault(digest, []).append(kind)
    counts: dict[str, int] = {}
    runs: list[SegmentRun] = []
    for position, kind in enumerate(sequence):
        cid = class_of_kind[kind]
        counts[cid] = counts.get(cid, 0) + 1
        if runs and runs[-1].class_id == cid:
            runs[-1] = SegmentRun(class_id=cid, first=runs[-1].first, count=runs[-1].count + 1)
        else:
            runs.append(SegmentRun(class_id=cid, first=position, count=1))
    classes = tuple(SegmentClass(id=cid, kinds=tuple(kinds), blocks=tuple(blocks[kinds[0]]), instances=counts[cid],
                                 flops=graphs[kinds[0]].flops, params=graphs[kinds[0]].param_count)
                    for cid, kinds in members.items())
    return Segmentation(classes=classes, runs=tuple(runs))
