"""Checkpoints: crash-safe saves, exact resume under another layout, restart after a killed rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.engine import checkpoint, manifest
from tests.launcher import run_train, run_with_a_rank_killed

STEPS = 6
COMMON = ["train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64", "train.warmup_steps=0",
          "train.precision=fp32", f"train.lr_decay_steps={STEPS}"]
LOSS_ATOL = 1e-4


def _fake_checkpoint(root: Path, step: int) -> None:
    checkpoint.step_dir(root, step).mkdir(parents=True)
    manifest.write_manifest(checkpoint.step_dir(root, step))  # an empty but verified checkpoint
    (root / checkpoint.LATEST).write_text(f"{step}\n")


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 4)
    with pytest.raises(CheckpointError, match="train.checkpoint_dir=.*already holds checkpoints.*train.resume=true"):
        checkpoint.check_before_start(str(tmp_path), resume=False, restarted=False)
    assert checkpoint.check_before_start(str(tmp_path), resume=True, restarted=False) == 4
    # A torchrun restart of the same job continues from its own checkpoints without train.resume.
    assert checkpoint.check_before_start(str(tmp_path), resume=False, restarted=True) == 4


def test_resume_without_checkpoint_names_the_key(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="train.resume=true but train.checkpoint_dir="):
        checkpoint.check_before_start(str(tmp_path / "empty"), resume=True, restarted=False)


def test_interrupted_save_leaves_previous_checkpoint_current(tmp_path: Path) -> None:
    _fake_checkpoint(tmp_path, 4)
    (tmp_path / "iter_0000006.partial").mkdir()  # a save that died before its rename
    assert checkpoint.latest_step(tmp_path) == 4
    (tmp_path / checkpoint.LATEST).write_text("6\n")  # pointer to a folder that is not there
    with pytest.raises(CheckpointError, match="step 6 but .*iter_0000006 is missing"):
        checkpoint.latest_step(tmp_path)


@pytest.mark.slow
def test_distributed_optimizer_checkpoint_resumes_under_another_layout(tmp_path: Path) -> None:
    """The distributed optimizer's state (sharded over DP) saved under DP=4 resumes under TP=2 x DP=2 and continues
    with the reference's losses (the state is saved per parameter, not per DP shard, so it reshards)."""
    reference = run_train(1, ["model=gpt_tiny", *COMMON, "train.steps=4"], tmp_path / "ref")
    assert reference.returncode == 0, reference.output[-4000:]
    ckpt = tmp_path / "ckpt"
    first = run_train(4, ["model=gpt_tiny", *COMMON, "train.steps=2", "parallel.distributed_optimizer=true",
                          "train.micro_batch_size=1", f"train.checkpoint_dir={ckpt}"], tmp_path / "a")
    assert first.returncode == 0, first.output[-4000:]
    # Megatron-Core 0.16 loads the distributed optimizer's state only into the same kind: refused before any group.
    plain = run_train(4, ["model=gpt_tiny", *COMMON, "train.steps=4", "parallel.tp=2",
                          f"train.checkpoint_dir={ckpt}", "train.resume=true"], tmp_path / "plain")
    assert plain.returncode != 0 and plain.records == []
    assert "set parallel.distributed_optimizer=true" in plain.output
    second = run_train(4, ["model=gpt_tiny", *COMMON, "train.steps=4", "parallel.tp=2",
                           "parallel.distributed_optimizer=true", f"train.checkpoint_dir={ckpt}",
                           "train.resume=true"], tmp_path / "b")
    assert second.returncode == 0, second.output[-4000:]
    assert sorted(second.losses) == [3, 4]
    for step in (3, 4):
        assert second.losses[step] == pytest.approx(reference.losses[step], abs=LOSS_ATOL), f"step {step}"


@pytest.mark.slow
def test_save_under_tp2_pp2_resume_under_other_layouts(tmp_path: Path) -> None:
    reference = run_train(1, ["model=llama_tiny", *COMMON, f"train.steps={STEPS}"], tmp_path / "ref")
    assert reference.returncode == 0, reference.output[-4000:]

    ckpt = tmp_path / "ckpt"
    first = run_train(4, ["model=llama_tiny", *COMMON, "train.steps=3", "parallel.tp=2", "parallel.pp=2",
                          f"train.checkpoint_dir={ckpt}"], tmp_path / "a")
    assert first.returncode == 0, first.output[-4000:]
    assert checkpoint.latest_step(ckpt) == 3
    before = sorted(p.name for p in ckpt.iterdir())

    # A second fresh run into the same folder is refused before any process group, and changes nothing.
    refused = run_train(2, ["model=llama_tiny", *COMMON, "train.steps=6", f"train.checkpoint_dir={ckpt}"],
                        tmp_path / "refused", timeout=300)
    assert refused.returncode != 0 and refused.records == []
    assert "train.resume=true" in refused.output
    assert sorted(p.name for p in ckpt.iterdir()) == before

    # Resume under DP=2 x PP=1 x TP=1 (a different TP and PP): continues at step 4 with the reference's losses.
    second = run_train(2, ["model=llama_tiny", *COMMON, f"train.steps={STEPS}", f"train.checkpoint_dir={ckpt}",
                           "train.resume=true"], tmp_path / "b")
    assert second.returncode == 0, second.output[-4000:]
    resume = next(r for r in second.records if r["event"] == "resume")
    assert resume["step"] == 3 and "tp=2 pp=2" in resume["saved_under"]
    assert sorted(second.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second.losses[step] == pytest.approx(reference.losses[step], abs=LOSS_ATOL), f"step {step}"
    assert checkpoint.latest_step(ckpt) == STEPS


@pytest.mark.slow
def test_killed_rank_restarts_and_resumes_from_last_checkpoint(tmp_path: Path) -> None:
    steps = 10
    common = ["model=gpt_tiny", *COMMON[:-1], f"train.lr_decay_steps={steps}", f"train.steps={steps}"]
    reference = run_train(1, common, tmp_path / "ref")
    assert reference.returncode == 0, reference.output[-4000:]

    returncode, output, records, ckpt = run_with_a_rank_killed(2, common, tmp_path, kill_at_step=5)  # rank 1 dies
    assert returncode == 0, output[-4000:]

    resume = [r for r in records if r["event"] == "resume"]
    assert len(resume) == 1 and resume[0]["restart_count"] == 1
    resumed_at = resume[0]["step"]
    assert resumed_at >= 4 and resumed_at % 2 == 0  # the newest complete checkpoint at the time of the kill
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "step"}
    assert sorted(losses) == list(range(1, steps + 1))
    for step in range(1, steps + 1):
        assert losses[step] == pytest.approx(reference.losses[step], abs=LOSS_ATOL), f"step {step}"
    # No checkpoint is corrupted: no partial folder is left and every complete one is a loadable checkpoint.
    assert checkpoint.latest_step(ckpt) == steps
    assert not list(ckpt.glob("*.partial"))
    from megatron.core.dist_checkpointing import check_is_distributed_checkpoint

    saved = sorted(ckpt.glob("iter_*"))
    assert saved and all(check_is_distributed_checkpoint(str(d)) for d in saved)
