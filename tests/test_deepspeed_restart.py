"""DeepSpeed restart parity with the Megatron backend: a torchrun restart resumes from the newest complete
checkpoint, ``train.resume=true`` on an empty folder is a CheckpointError, the gradient norm is logged at ZeRO stage 0,
and DeepSpeed's pickles are verified (manifest) and loaded weights-only. All drills: several torchrun runs each."""

from __future__ import annotations

import importlib.util
import pickle
import re
import shutil
from pathlib import Path

import pytest

from cfp_megatron.engine import manifest
from tests.launcher import run_train, run_with_a_rank_killed

pytestmark = [pytest.mark.drill,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed extra")]

COMMON = ["backend=deepspeed", "model=gpt_tiny", "train.global_batch_size=8", "train.seq_length=64",
          "train.precision=fp32", "train.warmup_steps=0"]


class _Planted:
    """A pickle that creates a marker file when loaded."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def test_restarted_workers_resume_their_own_checkpoint(tmp_path: Path) -> None:
    steps = 8
    common = [*COMMON, "backend.zero_stage=1", f"train.steps={steps}"]
    reference = run_train(2, common, tmp_path / "ref")
    assert reference.returncode == 0, reference.output[-4000:]
    returncode, output, records, ckpt = run_with_a_rank_killed(2, common, tmp_path, kill_at_step=5)
    assert returncode == 0, output[-4000:]
    assert "would write over" not in output
    resume = [r for r in records if r["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["restart_count"] == 1
    assert resume[0]["step"] >= 4 and resume[0]["step"] % 2 == 0
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert losses[step] == pytest.approx(reference.losses[step], rel=1e-5, abs=1e-5), f"step {step}"
    # every checkpoint is complete and verifies; no partial save is left
    assert (ckpt / "latest").read_text().strip() == f"global_step{steps}"
    assert not list(ckpt.glob("*.partial"))
    for folder in ckpt.glob("global_step*"):
        assert manifest.verify(folder, trust_unverified=False, fix="")


def test_resume_on_an_empty_folder_is_an_error(tmp_path: Path) -> None:
    result = run_train(2, [*COMMON, "train.steps=2", f"train.checkpoint_dir={tmp_path / 'empty'}",
                           "train.resume=true"], tmp_path, timeout=300)
    assert result.returncode != 0 and result.steps == []
    assert "CheckpointError" in result.output and "holds no complete DeepSpeed checkpoint" in result.output


def test_gradient_norm_is_logged_at_stage_0(tmp_path: Path) -> None:
    stage0 = run_train(2, [*COMMON, "train.steps=2", "backend.zero_stage=0"], tmp_path / "s0")
    stage1 = run_train(2, [*COMMON, "train.steps=2", "backend.zero_stage=1"], tmp_path / "s1")
    for result in (stage0, stage1):
        assert result.returncode == 0, result.output[-4000:]
    assert all(n > 0 for n in stage0.grad_norms.values())
    # the same global gradient as DeepSpeed's own norm at stage 1
    assert stage0.grad_norms == pytest.approx(stage1.grad_norms, rel=1e-4)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("ds_saved")
    result = run_train(1, [*COMMON, "train.steps=2", "backend.zero_stage=1", "train.save_interval=1",
                           f"train.checkpoint_dir={work / 'ckpt'}"], work)
    assert result.returncode == 0, result.output[-4000:]
    return work / "ckpt"


def _resume_damaged(saved: Path, tmp_path: Path, damage) -> str:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage(ckpt / "global_step2")
    result = run_train(1, [*COMMON, "train.steps=3", "backend.zero_stage=1", f"train.checkpoint_dir={ckpt}",
                           "train.resume=true"], tmp_path / "resume", timeout=300)
    assert result.returncode != 0 and result.steps == [], result.output[-3000:]
    assert "cfp-megatron: CheckpointError" in result.output, result.output[-3000:]
    # one clear error: torchrun's own summary of the failed worker, no traceback from the worker's code
    assert not re.search(r'File ".*(cfp_megatron|megatron/core|deepspeed|torch/distributed/checkpoint)/', result.output)
    return result.output


def test_planted_model_states_pickle_is_never_executed(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    output = _resume_damaged(saved, tmp_path, lambda f: (f / "mp_rank_00_model_states.pt").write_bytes(
        pickle.dumps(_Planted(marker))))
    assert "global_step2/mp_rank_00_model_states.pt" in output and "global_step1" in output
    assert not marker.exists()


def test_weights_only_load_stops_a_pickle_even_with_a_rewritten_manifest(saved: Path, tmp_path: Path) -> None:
    """A writer who rewrites the manifest too gets past the check; DeepSpeed's load is weights-only, so no code runs."""
    import torch

    marker = tmp_path / "payload_ran"

    def plant(folder: Path) -> None:
        torch.save({"module": _Planted(marker)}, folder / "mp_rank_00_model_states.pt")
        manifest.write_manifest(folder)

    output = _resume_damaged(saved, tmp_path, plant)
    assert "weights-only loader refuses" in output
    assert not marker.exists()
