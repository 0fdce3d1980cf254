"""ParallelBlocks over recorded forward operators, and a communication-free candidate run on real gloo ranks."""

from __future__ import annotations

import functools
import json
import pickle
import time
from collections.abc import Callable

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from cfp_megatron.graph.blocks import (
    BlockError,
    GlooVerification,
    ParallelBlock,
    find_blocks,
    forward_operators,
    verify_layouts_on_gloo,
)
from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.propagation import fake_mesh, parse_placements
from cfp_megatron.graph.record import record_step

R, P = Replicate(), Partial()


def _mlp(hidden: int = 16, ffn: int = 64, *, norm: bool = False) -> torch.nn.Module:
    layers = [torch.nn.Linear(hidden, ffn), torch.nn.GELU(), torch.nn.Linear(ffn, hidden)]
    return torch.nn.Sequential(*layers, *([torch.nn.LayerNorm(hidden)] if norm else []))


def _record(build: Callable[[], torch.nn.Module] | None = None, shape: tuple[int, ...] = (4, 8, 16),
            **kw) -> OpGraph:
    with torch.device("meta"):
        module = build() if build is not None else _mlp(**kw)
        x = torch.randn(*shape, requires_grad=True)
    return record_step(module, (x,), kind="mlp")


def _whole(blocks: list[ParallelBlock], n: int) -> list[ParallelBlock]:
    return [b for b in blocks if b.start == 0 and b.stop == n]


def test_a_recorded_graph_pickles_with_its_operators_by_name():
    """What the gloo replays send their ranks: the same graph back, each operator's ``OpOverload`` the very one that
    ran (``aten.mm.default`` and the rest found again in ``torch.ops``)."""
    graph = _record(_Layer, (2, 16, 32))
    again = pickle.loads(pickle.dumps(graph))
    assert again == graph
    assert all(a.op is b.op for a, b in zip(again.operators, graph.operators, strict=True))
    names = {o.name for o in again.operators}
    assert "aten.mm.default" in names and any(not n.endswith(".default") for n in names)  # named overloads too


def test_forward_operators_drop_the_loss():
    graph = _record()
    ops = forward_operators(graph)
    assert ops and all(o.module != "Global" for o in ops)
    assert ops[-1].name == "aten.view.default"


def test_mlp_is_one_block_for_the_split_hidden_entry():
    graph = _record()
    n = len(forward_operators(graph))
    with fake_mesh((4,), ("tp",)) as mesh:
        blocks = find_blocks(graph, mesh)
    (whole,) = _whole(blocks, n)
    tp = whole.candidate((R,))
    assert tp is not None and tp.maximal
    assert tp.exit == (P,)
    assert tp.params["0.weight"] == (Shard(0),) and tp.params["2.weight"] == (Shard(1),)
    assert whole.entry == graph.inputs[0] and whole.exit == forward_operators(graph)[-1].outputs[0]
    # entering with the hidden dimension split needs an all-reduce after the first linear (before GELU)
    assert whole.candidate((Shard(2),)) is None
    stopped = {s.entry: s for s in whole.stopped}
    assert stopped[(Shard(2),)].collectives


def test_blocks_break_where_a_collective_is_needed():
    graph = _record(norm=True)
    ops = forward_operators(graph)
    ln = next(i for i, o in enumerate(ops) if o.name == "aten.native_layer_norm.default")
    with fake_mesh((4,), ("tp",)) as mesh:
        blocks = find_blocks(graph, mesh)
    # the tensor-parallel entry crosses the MLP and stops at the norm (all-reduce of the partial sum)
    tp_blocks = [b for b in blocks if b.start == 0 and b.candidate((R,)) is not None and b.candidate((R,)).maximal]
    assert [b.stop for b in tp_blocks] == [ln]
    assert tp_blocks[0].candidate((R,)).exit == (P,)
    assert all(b.candidate((R,)) is None for b in blocks if b.start == 0 and b.stop > ln)
    stop = next(s for s in _whole(blocks, len(ops))[0].stopped if s.entry == (R,))
    assert stop.at == ops[ln].index and stop.collectives
    # a new block starts at the norm: its entry is the MLP output, and there a replicated entry is free again
    at_norm = [b for b in blocks if b.start == ln]
    assert at_norm and at_norm[0].entry == ops[ln].inputs[0]
    assert at_norm[0].candidate((R,)) is not None and at_norm[0].candidate((Shard(2),)) is None


class _Layer(torch.nn.Module):
    """A pre-norm transformer layer: RMSNorm, attention (SDPA), residual; RMSNorm, SwiGLU MLP, residual."""

    def __init__(self, hidden: int = 32, heads: int = 4, ffn: int = 64) -> None:
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = torch.nn.RMSNorm(hidden), torch.nn.RMSNorm(hidden)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate, self.up = torch.nn.Linear(hidden, ffn, bias=False), torch.nn.Linear(hidden, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.n1(x)
        q, k, v = (m(y).view(b, t, self.heads, h // self.heads).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, h))
        y = self.n2(x)
        return x + self.down(torch.nn.functional.silu(self.gate(y)) * self.up(y))


def test_transformer_layer_tensor_parallel_path():
    graph = _record(_Layer, (2, 16, 32))
    ops = forward_operators(graph)
    n2 = next(i for i, o in enumerate(ops) if o.module.endswith("n2"))
    with fake_mesh((2,), ("tp",)) as mesh:
        start = time.perf_counter()
        blocks = find_blocks(graph, mesh)
        print(f"find_blocks, transformer layer, {len(ops)} ops, 2 ranks: {time.perf_counter() - start:.3f} s, "
              f"{len(blocks)} blocks")
    attention = next(b for b in blocks if b.start == 0 and b.stop == n2)
    tp = attention.candidate((R,))
    assert tp is not None and tp.maximal and tp.exit == (P,)
    assert all(tp.params[f"{w}.weight"] == (Shard(0),) for w in "qkv") and tp.params["o.weight"] == (Shard(1),)
    mlp = next(b for b in blocks if b.start == n2 and b.stop == len(ops))
    tp = mlp.candidate((R,))
    assert tp is not None and tp.maximal and tp.exit == (P,)
    assert tp.params["gate.weight"] == tp.params["up.weight"] == (Shard(0),)
    assert tp.params["down.weight"] == (Shard(1),)
    # the whole layer is one block only for batch sharding (replicated weights: data parallel)
    whole = [b for b in blocks if b.start == 0 and b.stop == len(ops)]
    assert whole and whole[0].candidate((Shard(0),)) is not None and whole[0].candidate((R,)) is None


@functools.cache
def mlp_2x2() -> tuple[OpGraph, list[ParallelBlock]]:
    """The MLP's blocks on a (dp, tp) = (2, 2) mesh, found once per session (seconds on 2 cores): for the test
    below and tests/test_blocks_megatron.py's replay on 4 gloo ranks."""
    graph = _mlp_graph()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        start = time.perf_counter()
        blocks = find_blocks(graph, mesh)
        print(f"find_blocks, 2x2 mesh, {len(forward_operators(graph))} ops: {time.perf_counter() - start:.3f} s, "
              f"{len(blocks)} blocks")
    return graph, blocks


@pytest.fixture(scope="module")
def mlp_2x2_blocks() -> tuple[OpGraph, list[ParallelBlock]]:
    """:func:`mlp_2x2`."""
    return mlp_2x2()


def test_2d_mesh_megatron_layout_among_candidates(mlp_2x2_blocks: tuple[OpGraph, list[ParallelBlock]]):
    graph, blocks = mlp_2x2_blocks
    n = len(forward_operators(graph))
    (whole,) = _whole(blocks, n)
    dp_tp = whole.candidate((Shard(0), R))
    assert dp_tp is not None and dp_tp.exit == (Shard(0), P)
    assert dp_tp.params["0.weight"] == (R, Shard(0)) and dp_tp.params["2.weight"] == (R, Shard(1))


def test_json_form():
    graph = _record()
    with fake_mesh((4,), ("tp",)) as mesh:
        blocks = find_blocks(graph, mesh)
    data = json.loads(json.dumps([b.to_json() for b in blocks]))
    assert [d["index"] for d in data] == list(range(len(blocks)))
    first = data[0]
    assert {"start", "stop", "ops", "entry", "exit", "candidates", "stopped"} <= set(first)
    for d, b in zip(data, blocks, strict=True):
        assert [parse_placements(c["entry"]) for c in d["candidates"]] == [c.entry for c in b.candidates]


def test_find_blocks_rejects_empty():
    graph = _record()
    with fake_mesh((2,), ("tp",)) as mesh:
        with pytest.raises(BlockError):
            find_blocks(graph, mesh, ops=())


# ------------------------------------------------------------------------------------------------------- gloo


def _build_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return _mlp()


def _make_input() -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randn(4, 8, 16)


NEEDS_A_GATHER = ("S(2)", {"0.weight": "S(0)", "0.bias": "S(0)", "2.weight": "S(1)"})
"""Not a candidate: the hidden dimension split on entry with a column-parallel first weight (DTensor must gather
inside the block)."""


@pytest.fixture(scope="module")
def mlp_on_gloo() -> list[GlooVerification]:
    """The whole MLP's candidates entered replicated and batch-split, then :data:`NEEDS_A_GATHER`, run as modules
    on 2 gloo ranks in one spawn (:func:`~cfp_megatron.graph.blocks.verify_layouts_on_gloo`); results in that
    order."""
    graph = _record()
    n = len(forward_operators(graph))
    with fake_mesh((2,), ("tp",)) as mesh:
        (whole,) = _whole(find_blocks(graph, mesh), n)
    candidates = [whole.candidate(entry) for entry in [(R,), (Shard(0),)]]
    assert all(c is not None for c in candidates)
    layouts = [*((c.entry, c.params) for c in candidates), NEEDS_A_GATHER]
    return verify_layouts_on_gloo(_build_mlp, _make_input, layouts, world_size=2)


@pytest.mark.slow
def test_comm_free_candidates_run_with_zero_collectives_on_gloo(mlp_on_gloo: list[GlooVerification]):
    for result in mlp_on_gloo[:2]:
        assert result.comm_free, result.collectives
        assert result.max_abs_error < 1e-5


@pytest.mark.slow
def test_gloo_check_sees_a_needed_collective(mlp_on_gloo: list[GlooVerification]):
    result = mlp_on_gloo[2]
    assert not result.comm_free
    assert result.max_abs_error < 1e-5


def _layer_graph() -> OpGraph:
    """The transformer layer's recorded graph."""
    return _record(_Layer, (2, 16, 32))


def _mlp_graph() -> OpGraph:
    """The MLP's recorded graph."""
    return _record()

