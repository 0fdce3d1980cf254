"""The same entry point on GPUs with NCCL and bf16 (skipped where CUDA is absent)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.launcher import run_train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_one_gpu_nccl_bf16(tmp_path: Path) -> None:
    result = run_train(1, ["model=llama_tiny", "train.steps=20", "train.precision=auto"], tmp_path)
    assert result.returncode == 0, result.output[-4000:]
    start = next(r for r in result.records if r["event"] == "start")
    assert start["backend"] == "nccl" and start["precision"] == "bf16" and start["device"] != "cpu"
    losses = [r["loss"] for r in result.steps]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_gpus_tensor_parallel_matches_one(tmp_path: Path) -> None:
    common = ["model=llama_tiny", "train.steps=4", "train.precision=fp32", "train.warmup_steps=0"]
    one = run_train(1, common, tmp_path / "one")
    two = run_train(2, [*common, "parallel.tp=2", "parallel.sp=true"], tmp_path / "two")
    assert one.returncode == 0 and two.returncode == 0, (one.output + two.output)[-4000:]
    for step, loss in one.losses.items():
        assert two.losses[step] == pytest.approx(loss, abs=1e-3)
