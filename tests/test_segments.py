"""Segments: layers with identical blocks form one class; the model is runs of classes."""

from __future__ import annotations

import torch

from cfp_megatron.graph.blocks import find_blocks
from cfp_megatron.graph.propagation import fake_mesh
from cfp_megatron.graph.record import record_step
from cfp_megatron.graph.segments import segment_model


def _mlp_graph(hidden: int, ffn: int, kind: str):
    with torch.device("meta"):
        mlp = torch.nn.Sequential(torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden))
        x = torch.randn(4, 8, hidden, requires_grad=True)
    return record_step(mlp, (x,), kind=kind)


def test_identical_layers_form_one_class_and_runs_are_counted() -> None:
    graphs = {"a": _mlp_graph(32, 64, "a"), "a_twin": _mlp_graph(32, 64, "a_twin"), "b": _mlp_graph(32, 128, "b")}
    with fake_mesh((2,), ("tp",)) as mesh:
        blocks = {kind: find_blocks(graph, mesh) for kind, graph in graphs.items()}
    sequence = ["a"] * 5 + ["a_twin"] * 2 + ["b"] + ["a"] * 3
    seg = segment_model(sequence, blocks, graphs)
    assert seg.segments == len(sequence)
    # a and a_twin have the same structure and behaviour: one class; b's wider MLP is another.
    assert len(seg.classes) == 2
    first, second = seg.classes
    assert set(first.kinds) == {"a", "a_twin"} and first.instances == 10
    assert second.kinds == ("b",) and second.instances == 1
    assert [(r.first, r.count) for r in seg.runs] == [(0, 7), (7, 1), (8, 3)]
    assert first.params == 32 * 64 * 2 + 64 + 32 and second.flops > first.flops
    assert seg.to_json()["runs"][0] == {"class": first.id, "first": 0, "count": 7}
