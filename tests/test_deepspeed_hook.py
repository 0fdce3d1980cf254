"""A model handed to deepspeed.initialize through the hook is captured, planned where its config says "auto", and
DeepSpeed then trains it."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.launcher import free_port

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")]

SCRIPT = Path(__file__).resolve().parent / "scripts" / "deepspeed_hook_run.py"


def _env(rank: int, world: int, port: int) -> dict[str, str]:
    return {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _start(args: list[str], rank: int, world: int, port: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], env=_env(rank, world, port),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen) -> dict:
    """The process's JSON line, with what it printed before under ``"printed"``."""
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    return {**json.loads(out.strip().splitlines()[-1]), "printed": out}


def test_deepspeed_initialize_hook_captures_then_trains_with_zero1() -> None:
    result = _result(_start([], 0, 1, free_port()))
    # One block kind (4 identical residual blocks: LayerNorm 64 + Linear 32x32+32) and the rest recorded once.
    assert result["kinds"]["block"] == 64 + 32 * 32 + 32
    assert result["sequence"].count("block") == 4
    assert result["zero_stage"] == 1
    assert result["losses"][-1] < result["losses"][0]


def test_hook_plans_auto_config_on_two_ranks_and_trains_like_one_rank(tmp_path: Path) -> None:
    """Two gloo ranks plan "auto" stage, micro-batch and accumulation (then a config pinning stage 2), probing the
    engine of every stage the search may choose around copies of the model, and train with the losses of a
    single-rank ZeRO-0 run of the same model, seed and global batch."""
    port = free_port()
    ranks = [_start(["planned", str(tmp_path)], rank, 2, port) for rank in range(2)]
    reference = _start(["reference"], 0, 1, free_port())
    results = [_result(p) for p in ranks]
    ref = _result(reference)
    assert ref["planned"] is False  # a config without "auto" passes through unplanned
    for phase in ("auto", "pinned"):
        plans = [r[phase] for r in results]
        assert plans[0]["canonical"] == plans[1]["canonical"]  # one plan, broadcast from rank 0
        for key in ("stage", "mb", "ga", "train_batch_size"):
            assert plans[0][key] == plans[1][key]
        p = plans[0]
        assert p["train_batch_size"] == 8 and p["mb"] * p["ga"] * 2 == 8 and p["stage"] in (0, 1, 2, 3)
        assert f",dp=2,mb={p['mb']},gbs=8," in p["canonical"] and f",backend=deepspeed,zero={p['stage']}," in \
            p["canonical"]
        assert p["weights_unchanged"] in (True, None)  # None: ZeRO-3 partitioned them before the check
        for rank_losses in (r[phase]["losses"] for r in results):
            assert rank_losses == pytest.approx(ref["losses"], abs=1e-5)
    assert results[1]["pinned"]["stage"] == 2  # the config's concrete stage pins the search
    _check_probes(results)
    written = Path(results[0]["auto"]["written"])
    assert written == tmp_path / "ds_config.json" and results[1]["auto"]["written"] is None
    config = json.loads(written.read_text())
    p = results[0]["auto"]
    assert (config["zero_optimization"]["stage"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (p["stage"], p["mb"], p["ga"])
    assert config["optimizer"]["type"] == "AdamW"  # the user's other keys are kept


def _check_probes(results: list[dict]) -> None:
    """The engine probes: every stage unpinned, the pinned one only; the same points on both ranks (the slowest
    rank's), each a measured time (not compared: on 2 shared cores a step of 4 micro-batches of this
    tiny model timed faster than one in a CI run); each probe engine built around a copy, and the user's engine
    built last, with the user's weights and RNG state as they were before the hook; the copies freed afterwards."""
    assert "cfp: probed the DeepSpeed engine (stages [0, 1, 2, 3]) in" in results[0]["printed"]
    assert "cfp: probed the DeepSpeed engine (stages [2]) in" in results[0]["printed"]
    for phase, stages in (("auto", [0, 1, 2, 3]), ("pinned", [2])):
        assert results[0][phase]["probes"] == results[1][phase]["probes"]
        for result in (r[phase] for r in results):
            assert result["probed"] == stages and result["probe_s"] > 0
            for stage in stages:
                points = dict(result["probes"][str(stage)])
                assert sorted(points) == [1, 2, 4] and all(0 < t < 60 for t in points.values()), (stage, points)
            calls = result["initialize_calls"]
            assert [c["user_model"] for c in calls] == [False] * len(stages) + [True]
            assert all(c["weights_unchanged"] and c["rng_unchanged"] for c in calls), calls
            assert result["probe_copies_alive"] == 0
