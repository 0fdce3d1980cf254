"""Every candidate found on Megatron's own layers runs with zero collectives on real gloo ranks."""

from __future__ import annotations

import pytest

from cfp_megatron.graph.blocks import (
    BlockCheck,
    GlooVerification,
    find_blocks,
    verify_blocks_on_gloo,
    verify_graphs_on_gloo,
)
from cfp_megatron.graph.opgraph import OpGraph
from cfp_megatron.graph.propagation import fake_mesh

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
    """Top-level (picklable) graph builder for the gloo ranks."""
    return _graph("llama_tiny", "dense")


def gpt_dense() -> OpGraph:
    """Top-level (picklable) graph builder for the gloo ranks."""
    return _graph("gpt_tiny", "dense")


def moe_layer() -> OpGraph:
    """Top-level (picklable) graph builder for the gloo ranks."""
    return _graph("moe_tiny", "moe")


BUILDS = {"llama-dense": llama_dense, "gpt-dense": gpt_dense, "moe": moe_layer}


@pytest.fixture(scope="module")
def one_dimensional() -> dict[str, tuple[list[BlockCheck], list[GlooVerification]]]:
    """Every candidate of each layer on a 1-D mesh of 2 ranks, replayed in one gloo spawn for the three layers
    (:func:`~cfp_megatron.graph.blocks.verify_graphs_on_gloo`): the checks and their results, by layer."""
    checks = {}
    for name, build in BUILDS.items():
        graph = build()  # captured before the fake process group (capture makes its own)
        with fake_mesh((2,), ("tp",)) as mesh:
            blocks = find_blocks(graph, mesh)
        checks[name] = [BlockCheck.of(b, c) for b in blocks for c in b.candidates]
    results = verify_graphs_on_gloo((2,), [(BUILDS[name], checks[name]) for name in BUILDS])
    return {name: (checks[name], found) for name, found in zip(BUILDS, results, strict=True)}


@pytest.mark.parametrize("layer", list(BUILDS))
def test_every_candidate_is_communication_free_on_gloo(
        layer: str, one_dimensional: dict[str, tuple[list[BlockCheck], list[GlooVerification]]]) -> None:
    checks, results = one_dimensional[layer]
    assert len(checks) >= 10
    for check, result in zip(checks, results, strict=True):
        assert result.error is None, (check, result.error)
        assert result.collectives == {}, (check, result.collectives)
        assert result.comm_free
        assert result.max_abs_error <= 1e-5 * max(result.scale, 1.0), check


def test_two_dimensional_mesh_candidates_are_communication_free_on_gloo() -> None:
    """A (dp, tp) = (2, 2) mesh on 4 gloo ranks: interleaved (strided) shards included.

    The maximal candidates are replayed (109 of 203): a candidate that is not maximal runs the first operators of a
    maximal one of its block's start with the same entry and parameter placements (each one is such a prefix), so
    its zero collectives are seen in that replay; every candidate's own exit is compared on the 1-D mesh above."""
    graph = llama_dense()
    with fake_mesh((2, 2), ("dp", "tp")) as mesh:
        blocks = find_blocks(graph, mesh)
    for b in blocks:  # each candidate left out is a prefix of a replayed one
        for c in b.candidates:
            assert c.maximal or any(
                o.start == b.start and o.stop > b.stop and any(
                    m.maximal and m.entry == c.entry and all(m.params.get(k) == v for k, v in c.params.items())
                    for m in o.candidates) for o in blocks), (b.start, b.stop, c.entry)
    checks = [BlockCheck.of(b, c) for b in blocks for c in b.candidates if c.maximal]
    assert any(";" in str(c.params) for c in checks)  # some candidate uses an interleaved weight
    results = verify_blocks_on_gloo(llama_dense, (2, 2), checks)
    for check, result in zip(checks, results, strict=True):
        assert result.error is None, (check, result.error)
        assert result.collectives == {}, (check, result.collectives)
        assert result.max_abs_error <= 1e-5 * max(result.scale, 1.0), check
