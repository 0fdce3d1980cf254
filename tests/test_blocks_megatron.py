"""Every candidate found on Megatron's own layers, and on tests/test_blocks.py's transformer layer and MLP, runs
with zero collectives on real gloo ranks: one gloo spawn per mesh for all of them (docs/testing.md)."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Replicate, Shard

from cfp_megatron.graph.blocks import (
    BlockCheck,
    GlooVerification,
    find_blocks,
    forward_operators,
    verify_graphs_on_gloo,
)
from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.propagation import fake_mesh
from tests.test_blocks import _layer_graph, mlp_2x2

pytestmark = pytest.mark.slow


def _graph(model: str, kind: str) -> OpGraph:
    from pathlib import Path

    import yaml

    from cfp_megatron.base.config import Precision, job_from_config
    from cfp_megatron.model.capture import capture_job

    conf = Path(__file__).resolve().parent.parent / "conf" / "model" / f"{model}.yaml"
    job = job_from_config({"model": yaml.safe_load(conf.read_text())})
    return capture_job(job, seq_length=16, micro_batch_size=2, precision=Precision.fp32).graphs[kind]


def llama_dense() -> OpGraph:
    """LLaMA's dense layer."""
    return _graph("llama_tiny", "dense")


def gpt_dense() -> OpGraph:
    """GPT's dense layer."""
    return _graph("gpt_tiny", "dense")


def moe_layer() -> OpGraph:
    """The MoE layer."""
    return _graph("moe_tiny", "moe")


BUILDS = {"llama-dense": llama_dense, "gpt-dense": gpt_dense, "moe": moe_layer}


R = Replicate()

Replays = dict[str, tuple[list[BlockCheck], list[GlooVerification]]]
"""Checks and their results, by graph."""


def _layer_checks() -> tuple[OpGraph, list[BlockCheck]]:
    """tests/test_blocks.py's transformer layer and its checks: every candidate on 2 ranks, then one non-candidate
    (the attention block's tensor-parallel candidate entered split on the hidden dimension). The non-candidate goes
    last: its collectives come after every candidate's."""
    graph = _layer_graph()
    ops = forward_operators(graph)
    n2 = next(i for i, o in enumerate(ops) if o.module.endswith("n2"))
    with fake_mesh((2,), ("tp",)) as mesh:
        blocks = find_blocks(graph, mesh)
    checks = [BlockCheck.of(b, c) for b in blocks for c in b.candidates]
    # Megatron's tensor-parallel layout is among them: attention and MLP blocks entered replicated
    assert any(c.start == 0 and c.stop == n2 and c.placements == "R" for c in checks)
    assert any(c.start == n2 and c.stop == len(ops) and c.placements == "R" for c in checks)
    attention = next(b for b in blocks if b.start == 0 and b.stop == n2)
    assert attention.candidate((Shard(2),)) is None  # the norm needs the whole hidden dimension
    bad = dataclasses.replace(BlockCheck.of(attention, attention.candidate((R,))), placements="S(2)")
    return graph, [*checks, bad]


@pytest.fixture(scope="module")
def one_dimensional() -> Replays:
    """Every candidate of each Megatron layer on a 1-D mesh of 2 ranks, and :func:`_layer_checks` ("layer"),
    replayed in one gloo spawn (:func:`~cfp_megatron.graph.blocks.verify_graphs_on_gloo`)."""
    graphs, checks = {}, {}
    for name, build in BUILDS.items():
        graphs[name] = build()  # captured before the fake process group (capture makes its own)
        with fake_mesh((2,), ("tp",)) as mesh:
            blocks = find_blocks(graphs[name], mesh)
        checks[name] = [BlockCheck.of(b, c) for b in blocks for c in b.candidates]
    graphs["layer"], checks["layer"] = _layer_checks()
    results = verify_graphs_on_gloo((2,), [(graphs[name], checks[name]) for name in graphs])
    return {name: (checks[name], found) for name, found in zip(graphs, results, strict=True)}


@pytest.fixture(scope="module")
def two_dimensional() -> Replays:
    """The maximal candidates of LLaMA's layer ("llama-dense") and of tests/test_blocks.py's MLP blocks that start
    at its first operator ("mlp") on a (dp, tp) = (2, 2) mesh, replayed in one spawn of 4 gloo ranks."""
    graph = llama_dense()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        blocks = find_blocks(graph, mesh)
    for b in blocks:  # each candidate left out is a prefix of a replayed one
        for c in b.candidates:
            assert c.maximal or any(
                o.start == b.start and o.stop > b.stop and any(
                    m.maximal and m.entry == c.entry and all(m.params.get(k) == v for k, v in c.params.items())
                    for m in o.candidates) for o in blocks), (b.start, b.stop, c.entry)
    mlp_graph, mlp_blocks = mlp_2x2()
    checks = {"llama-dense": [BlockCheck.of(b, c) for b in blocks for c in b.candidates if c.maximal],
              "mlp": [BlockCheck.of(b, c) for b in mlp_blocks if b.start == 0 for c in b.candidates if c.maximal]}
    results = verify_graphs_on_gloo((2, 2), [(graph, checks["llama-dense"]), (mlp_graph, checks["mlp"])])
    return {name: (checks[name], found) for name, found in zip(checks, results, strict=True)}


@pytest.mark.parametrize("layer", list(BUILDS))
def test_every_candidate_is_communication_free_on_gloo(layer: str, one_dimensional: Replays) -> None:
    checks, results = one_dimensional[layer]
    assert len(checks) >= 10
    for check, result in zip(checks, results, strict=True):
        assert result.error is None, (check, result.error)
        assert result.collectives == {}, (check, result.collectives)
        assert result.comm_free
        assert result.max_abs_error <= 1e-5 * max(result.scale, 1.0), check


def test_two_dimensional_mesh_candidates_are_communication_free_on_gloo(two_dimensional: Replays) -> None:
    """A (dp, tp) = (2, 2) mesh on 4 gloo ranks: interleaved (strided) shards included.

    The maximal candidates are replayed (109 of 203): a candidate that is not maximal runs the first operators of a
    maximal one of its block's start with the same entry and parameter placements (each one is such a prefix,
    :func:`two_dimensional` checks), so its zero collectives are seen in that replay; every candidate's own exit is
    compared on the 1-D mesh above."""
    checks, results = two_dimensional["llama-dense"]
    assert any(";" in str(c.params) for c in checks)  # some candidate uses an interleaved weight
    for check, result in zip(checks, results, strict=True):
        assert result.error is None, (check, result.error)
        assert result.collectives == {}, (check, result.collectives)
        assert result.max_abs_error <= 1e-5 * max(result.scale, 1.0), check


def test_every_transformer_candidate_replayed_on_gloo_with_zero_collectives(one_dimensional: Replays) -> None:
    """tests/test_blocks.py's transformer layer: every candidate on 2 ranks."""
    checks, results = one_dimensional["layer"]
    assert len(results[:-1]) == len(checks[:-1]) > 10
    for check, result in zip(checks[:-1], results[:-1], strict=True):
        assert result.comm_free, (check, result.collectives, result.error)
        assert result.relative_error < 1e-5, (check, result.max_abs_error, result.scale)  # float32, other sum order


def test_block_replay_sees_collectives_of_a_non_candidate(one_dimensional: Replays) -> None:
    """The last check of :func:`_layer_checks`: not a candidate, so the replay sees a collective (or DTensor's
    refusal)."""
    bad, result = one_dimensional["layer"][0][-1], one_dimensional["layer"][1][-1]
    assert bad.placements == "S(2)" and bad.start == 0
    assert not result.comm_free
    assert result.collectives or result.error


def test_2d_mesh_candidates_replayed_on_gloo(two_dimensional: Replays) -> None:
    """tests/test_blocks.py's MLP on the (2, 2) mesh: its maximal candidates from the first operator, data-parallel
    entries included."""
    checks, results = two_dimensional["mlp"]
    assert any(c.placements == "R,R" for c in checks) and any(c.placements == "S(0),R" for c in checks)
    for check, result in zip(checks, results, strict=True):
        assert result.comm_free, (check, result.collectives, result.error)
        assert result.relative_error < 1e-5, (check, result.max_abs_error, result.scale)
