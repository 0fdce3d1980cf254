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
