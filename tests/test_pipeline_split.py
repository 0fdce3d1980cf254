"""The layer split of pipeline ranks and chunks against Megatron-Core's own functions."""

from __future__ import annotations

import random

import pytest
import torch

from cfp_megatron.base.pipeline_split import chunk_layers, split_issues, stage_counts


def _megatron(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, *, embedding: bool = False,
              loss: bool = False) -> list[list[tuple[int, int]]]:
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               num_layers_in_first_pipeline_stage=first, num_layers_in_last_pipeline_stage=last,
                               account_for_embedding_in_pipeline_split=embedding,
                               account_for_loss_in_pipeline_split=loss)
    return [[(get_transformer_layer_offset(config, vp_stage=c if vpp > 1 else None, pp_rank=r),
              get_num_layers_to_build(config, vp_stage=c if vpp > 1 else None, pp_rank=r)) for c in range(vpp)]
            for r in range(pp)]


def _splits(seed: int, n: int) -> list[tuple[int, int, int, int | None, int | None]]:
    rng = random.Random(seed)
    out: list[tuple[int, int, int, int | None, int | None]] = []
    while len(out) < n:
        pp, vpp = rng.choice([2, 3, 4, 8]), rng.choice([1, 1, 2, 3])
        first = rng.choice([None, vpp, 2 * vpp, 3 * vpp])
        last = rng.choice([None, vpp, 2 * vpp, 4 * vpp])
        middle = pp - (first is not None) - (last is not None)
        num_layers = (first or 0) + (last or 0) + middle * vpp * rng.randint(1, 3)
        if first is None and last is None:
            num_layers = pp * vpp * rng.randint(1, 3)
        if num_layers and not split_issues(num_layers, pp, vpp, first, last):
            out.append((num_layers, pp, vpp, first, last))
    return out


@pytest.mark.parametrize("split", _splits(0, 40) + [(126, 16, 1, 7, 7), (61, 16, 1, 1, None), (61, 8, 1, 7, 6)])
def test_split_matches_megatron(split: tuple[int, int, int, int | None, int | None]) -> None:
    num_layers, pp, vpp, first, last = split
    assert not split_issues(num_layers, pp, vpp, first, last)
    ours = chunk_layers(num_layers, pp, vpp, first, last)
    assert [[(c.offset, c.count) for c in row] for row in ours] == _megatron(num_layers, pp, vpp, first, last)
    assert sum(c.count for row in ours for c in row) == num_layers
    assert sorted(c.offset for row in ours for c in row) == sorted({c.offset for row in ours for c in row})
    assert [sum(c.count for c in row) for row in ours] == stage_counts(num_layers, pp, first, last)


@pytest.mark.parametrize(("num_layers", "pp", "vpp", "embedding", "loss"), [
    (94, 8, 4, True, True),  # Qwen3-235B as Megatron-Bridge runs it: 96 units, 3 per chunk
    (6, 2, 1, True, True), (6, 2, 2, True, True), (7, 4, 2, True, False), (7, 2, 1, False, True),
    (30, 4, 2, True, True), (63, 8, 1, True, False)])
def test_embedding_and_loss_counted_in_the_split_match_megatron(num_layers: int, pp: int, vpp: int, embedding: bool,
                                                                loss: bool) -> None:
    assert not split_issues(num_layers, pp, vpp, None, None, embedding=embedding, loss=loss)
    ours = chunk_layers(num_layers, pp, vpp, embedding=embedding, loss=loss)
    assert [[(c.offset, c.count) for c in row] for row in ours] == _megatron(num_layers, pp, vpp, None, None,
                                                                            embedding=embedding, loss=loss)
    assert sum(c.count for row in ours for c in row) == num_layers
    assert [sum(c.count for c in row) for row in ours] == stage_counts(num_layers, pp, embedding=embedding, loss=loss)
    assert split_issues(num_layers + 1, pp, vpp, None, None, embedding=embedding, loss=loss)[0].key == "parallel.pp"


def test_moe_layers_follow_the_leading_dense_ones() -> None:
    rows = chunk_layers(8, 2, 2, first_dense=3)
    # chunks in order: r0c0 [0,2) r1c0 [2,4) r0c1 [4,6) r1c1 [6,8); layers 3.. are MoE
    assert [[(c.offset, c.moe) for c in row] for row in rows] == [[(0, 0), (4, 2)], [(2, 1), (6, 2)]]
    assert rows[1][0].leading(1) == (1, 0) and rows[1][0].leading(2) == (1, 1)


@pytest.mark.parametrize(("num_layers", "pp", "vpp", "first", "last", "key"), [
    (10, 4, 1, None, None, "parallel.pp"),
    (10, 4, 1, 3, None, "parallel.first_stage_layers"),
    (12, 4, 2, 3, 3, "parallel.first_stage_layers"),
    (12, 1, 1, 3, None, "parallel.first_stage_layers"),
    (6, 2, 1, 2, 2, "parallel.first_stage_layers"),
    (6, 3, 1, None, 6, "parallel.last_stage_layers"),
    (8, 2, 2, 4, 4, "parallel.vpp"),
    (8, 2, 1, 0, None, "parallel.first_stage_layers"),
])
def test_invalid_splits_name_the_setting(num_layers: int, pp: int, vpp: int, first: int | None, last: int | None,
                                         key: str) -> None:
    issues = split_issues(num_layers, pp, vpp, first, last)
    assert issues and issues[0].key == key and issues[0].fix


# --------------------------------------------------------------------------------------------------------------------
# Per-stage layouts (parallel.pipeline_model_parallel_layout) against Megatron-Core's PipelineParallelLayerLayout.

_LAYOUTS = [  # (layout, pp, num_layers, mtp layers)
    ("Et*3|tL", 2, 4, 0), ("Et|t|tt|L", 2, 4, 0), ("Ett|(t|)*2tL", 2, 5, 0), ("Et*3|(tt|)*29m|L", 16, 61, 1),
    ("Et|(tt|)*30mL", 8, 61, 1), ("E|t*4|t*3|tL", 2, 8, 0), ("Ettt|t|tt|ttmmL", 2, 8, 2),
    ("Et*2|(t*3|)*5t*2L", 7, 19, 0), ("Et,t|t,tL", 2, 4, 0),
]


@pytest.fixture
def megatron_vpp():
    """Sets Megatron-Core's virtual pipeline world size (its layout reads it to pick a rank's chunk) and restores it."""
    pytest.importorskip("megatron.core")
    from megatron.core import parallel_state

    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    yield parallel_state.set_virtual_pipeline_model_parallel_world_size
    parallel_state.set_virtual_pipeline_model_parallel_world_size(before)


def _megatron_stages(layout: str) -> tuple[str, ...]:
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.pipeline_parallel_layer_layout import PipelineParallelLayerLayout

    chars = {LayerType.embedding: "E", LayerType.decoder: "t", LayerType.mtp: "m", LayerType.loss: "L"}
    return tuple("".join(chars[kind] for kind in stage) for stage in PipelineParallelLayerLayout.parse_str_to_list(
        layout))


@pytest.mark.parametrize("layout", [case[0] for case in _LAYOUTS] + [
    "(tt|)*3", "Et*12|(t*3|)*4tt*2L", "t*0|L", "E(t|)*2,L", "Ett|(|)*3L", "(Et)*2|L", "(Et|)tL", "((t|)*2)*2L"])
def test_layout_parse_matches_megatron(layout: str) -> None:
    pytest.importorskip("megatron.core")
    from cfp_megatron.base.pipeline_layout import LayoutSyntaxError, layout_stages

    try:
        theirs: tuple[str, ...] | None = _megatron_stages(layout)
    except (AssertionError, KeyError, ValueError):
        theirs = None
    if theirs is None:
        with pytest.raises(LayoutSyntaxError):
            layout_stages(layout)
    else:
        assert layout_stages(layout) == theirs


@pytest.mark.parametrize(("layout", "pp", "num_layers", "mtp"), _LAYOUTS)
def test_layout_split_matches_megatron(layout: str, pp: int, num_layers: int, mtp: int, megatron_vpp) -> None:
    """Each chunk's first layer and layer count (under a layout Megatron-Core's get_transformer_layer_offset /
    get_num_layers_to_build return its PipelineParallelLayerLayout's get_layer_offset / get_num_layers_to_build for
    the calling rank, asked here for every rank), its MTP layers, and which chunk holds the embedding and the
    loss."""
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.base.pipeline_layout import layout_count_issues, layout_issues, layout_stages

    vpp = len(layout_stages(layout)) // pp
    layout = layout.replace(",", "")
    assert not layout_issues(layout, pp, vpp) and not layout_count_issues(layout, num_layers, mtp)
    megatron_vpp(vpp if vpp > 1 else None)
    config = TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                               pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                               virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                               mtp_num_layers=mtp or None, pipeline_model_parallel_layout=layout)
    theirs = config.pipeline_model_parallel_layout
    ours = chunk_layers(num_layers, pp, vpp, layout=layout, mtp=mtp, first_dense=1)
    for r in range(pp):
        for c in range(vpp):
            vp = c if vpp > 1 else None
            chunk = ours[r][c]
            assert (chunk.offset, chunk.count) == (
                theirs.get_layer_offset(LayerType.decoder, vp_stage=vp, pp_rank=r),
                theirs.get_num_layers_to_build(LayerType.decoder, vp_stage=vp, pp_rank=r))
            assert chunk.mtp == theirs.get_num_layers_to_build(LayerType.mtp, vp_stage=vp, pp_rank=r)
            assert chunk.embedding == (LayerType.embedding in theirs.layout[r][c]) == ((r, c) == (0, 0))
            assert chunk.loss == (LayerType.loss in theirs.layout[r][c]) == ((r, c) == (pp - 1, vpp - 1))
            assert chunk.moe == chunk.count - (1 if chunk.offset == 0 and chunk.count else 0)
    assert [sum(c.count for c in row) for row in ours] == stage_counts(num_layers, pp, layout=layout)


def test_without_a_layout_the_mtp_layers_sit_with_the_loss() -> None:
    rows = chunk_layers(8, 2, 2, mtp=1)
    assert [[(c.embedding, c.loss, c.mtp) for c in row] for row in rows] == [
        [(True, False, 0), (False, False, 0)], [(False, False, 0), (False, True, 1)]]


def _random_layout(rng: random.Random) -> tuple[str, int, int, int]:
    """A random layout of random stages (most of them invalid in some way), its pp, decoder and MTP counts."""
    pp, vpp = rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 3])
    stages = ["".join(rng.choice("ttttttmEL") for _ in range(rng.randint(0, 4))) for _ in range(pp * vpp)]
    if rng.random() < 0.7:  # mostly well-formed ends
        stages = [s.replace("E", "").replace("L", "") for s in stages]
        stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    if rng.random() < 0.5:  # MTP layers only in the last stage, after every decoder layer
        stages = [s.replace("m", "") for s in stages]
        stages[-1] = stages[-1].replace("L", "") + "m" * rng.randint(0, 2) + "L"
    flat = "".join(stages)
    return "|".join(stages), pp, flat.count("t") + rng.choice([0, 0, 0, 1]), flat.count("m")


@pytest.mark.parametrize("seed", range(6))
def test_layout_checks_accept_what_megatron_accepts(seed: int) -> None:
    """Over random layouts: what layout_issues and layout_count_issues accept, Megatron-Core's TransformerConfig
    accepts; what it accepts with the embedding first in the first stage, they accept (they are stricter only in
    writing E first, where Megatron builds it)."""
    pytest.importorskip("megatron.core")
    from megatron.core.transformer.transformer_config import TransformerConfig

    from cfp_megatron.base.pipeline_layout import layout_count_issues, layout_issues

    rng = random.Random(seed)
    accepted = 0
    for _ in range(60):
        layout, pp, num_layers, mtp = _random_layout(rng)
        if num_layers < 1:
            continue
        vpp = (layout.count("|") + 1) // pp
        ours = not layout_issues(layout, pp, vpp) and not layout_count_issues(layout, num_layers, mtp)
        try:
            TransformerConfig(num_layers=num_layers, hidden_size=64, num_attention_heads=4,
                              pipeline_model_parallel_size=pp, pipeline_dtype=torch.float32,
                              virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
                              mtp_num_layers=mtp or None, pipeline_model_parallel_layout=layout)
            theirs = True
        except (AssertionError, IndexError, ValueError):
            theirs = False
        if ours:
            assert theirs, layout
            accepted += 1
        elif theirs:
            assert not layout.startswith("E"), layout
    assert accepted > 0


def test_balanced_layout_is_megatron_deepspeeds_uniform_partition() -> None:
    from cfp_megatron.base.pipeline_layout import balanced_layout, uniform_partition

    deepspeed_utils = pytest.importorskip("deepspeed.runtime.utils")
    for items in range(1, 70):
        for parts in (1, 2, 3, 4, 8, 16, 32):
            bounds = deepspeed_utils.partition_uniform(items, parts)
            assert uniform_partition(items, parts) == [b - a for a, b in zip(bounds, bounds[1:], strict=False)]
    # In virtual-pipeline order, each chunk its share: 61 layers over 8 x 4 chunks, the first 29 holding two.
    rows = chunk_layers(61, 8, 4, layout=balanced_layout(61, 8, 4))
    assert [rows[s % 8][s // 8].count for s in range(32)] == uniform_partition(61, 32)
    # The ends counted as layers: Megatron-Bridge's DeepSeek-V3 layout at PP=8 x VP=4, and Qwen3-235B's split.
    assert balanced_layout(61, 8, 4, mtp_layers=1, ends_counted=True) == "Et|(tt|)*30mL"
    assert chunk_layers(94, 8, 4, layout=balanced_layout(94, 8, 4, ends_counted=True)) == chunk_layers(
        94, 8, 4, embedding=True, loss=True)
