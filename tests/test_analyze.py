"""ParallelBlocks and segments of real Megatron layers (GPT, LLaMA, MoE) through the analysis entry point."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from cfp_megatron.analyze import RESULT_KEYS, main
from cfp_megatron.base.config import job_from_config
from cfp_megatron.model import analysis as analyze_module
from cfp_megatron.model.analysis import analyze


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))


def _job(model: str, **parallel: int):
    import yaml

    conf = Path(__file__).resolve().parent.parent / "conf" / "model" / f"{model}.yaml"
    return job_from_config({"model": yaml.safe_load(conf.read_text()), "parallel": parallel,
                            "train": {"seq_length": 32}})


def _class(result: dict, kind: str) -> dict:
    return next(c for c in result["classes"] if kind in c["kinds"])


@pytest.mark.parametrize("model", ["gpt_tiny", "llama_tiny", "moe_tiny"])
def test_megatron_tp_layout_is_a_candidate_of_every_layer(model: str) -> None:
    result = analyze(_job(model, tp=2, sp=model == "moe_tiny"))  # Megatron-Core trains MoE under TP with SP only
    layer_kinds = [c for c in result["classes"] if set(c["kinds"]) & {"dense", "moe"}]
    assert layer_kinds
    for cls in layer_kinds:
        # Some block of the layer is entered replicated with Megatron's column/row-parallel weights and leaves
        # Partial (the all-reduce at the block boundary is Megatron's own).
        tp_blocks = [b for b in cls["blocks"] if b["megatron_tp"]]
        assert tp_blocks, cls["kinds"]
        assert any(c["entry"] == "R" and c["exit"].startswith("P") for b in tp_blocks for c in b["megatron_tp"])


@pytest.mark.parametrize(("model", "fc1"), [("gpt_tiny", "S(0)"), ("llama_tiny", "S(0;2)")])
def test_mlp_column_then_row_is_one_block_for_the_split_hidden_entry(model: str, fc1: str) -> None:
    # LLaMA's fused SwiGLU fc1 is chunked into gate and up: comm-free only in Megatron's interleaved layout.
    dense = _class(analyze(_job(model, tp=2)), "dense")
    mlp_blocks = [b for b in dense["blocks"]
                  if any(m.endswith("linear_fc1") for m in b["modules"])
                  and any(m.endswith("linear_fc2") for m in b["modules"])]
    found = [c for b in mlp_blocks for c in b["candidates"]
             if c["params"].get("mlp.linear_fc1.weight") == fc1
             and c["params"].get("mlp.linear_fc2.weight") == "S(1)"]
    assert found, [b["modules"] for b in mlp_blocks]
    assert all(c["exit"].startswith("P") for c in found)


def test_a_deep_model_has_a_handful_of_segment_classes() -> None:
    model = dataclasses.asdict(_job("gpt_tiny").model)
    job = job_from_config({"model": {**model, "num_layers": 24}, "parallel": {"tp": 2}, "train": {"seq_length": 32}})
    result = analyze(job)
    assert result["segments"] == 26  # embedding, 24 layers, head
    assert len(result["classes"]) == 3
    assert [r["count"] for r in result["runs"]] == [1, 24, 1]
    layer = _class(result, "dense")
    assert layer["params"] * 24 < result["params"]


def test_two_dimensional_mesh_and_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    job = job_from_config({"model": {"name": "gpt_tiny"}, "parallel": {"tp": 2},
                           "cluster": {"nodes": 1, "gpus_per_node": 4}, "train": {"seq_length": 32}})
    first = analyze(job)
    assert first["mesh"] == {"shape": [2, 2], "names": ["dp", "tp"]}

    def not_again(*args: object, **kwargs: object) -> None:
        raise AssertionError("the second analysis must come from the cache")

    monkeypatch.setattr(analyze_module, "_analyze", not_again)
    assert analyze(job) == first


def test_command_line_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "a.json"
    assert main(["model=llama_tiny", "parallel.tp=2", "train.seq_length=32", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["model"] == "llama_tiny" and data["classes"]
    assert RESULT_KEYS <= set(data)  # what a later --json on this file checks before replacing it
    printed = capsys.readouterr().out
    assert "Segment classes" in printed and "Megatron TP" in printed


def test_command_line_reports_bad_settings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["model=llama_tiny", "parallel.tp=3", "cluster.gpus_per_node=8"]) == 2
    assert "parallel.tp=3" in capsys.readouterr().err

