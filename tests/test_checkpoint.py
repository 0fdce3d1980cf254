"""Checkpoints: crash-safe saves, exact resume under another layout, restart after a killed rank."""

from __future__ import annotations

from pathlib import Path

import pytest

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.engine import checkpoint, manifest
from tests.launcher import run_with_a_rank_killed
from tests.multirank import TMP, MultiRankRuns, case

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


# The runs below are cases of the multirank fixture's jobs (tests/multirank.py): one torchrun per world size for
# every file's cases; a world's cases run in the order listed, the largest world first.
DOPT_CKPT = f"train.checkpoint_dir={TMP}/dopt_ckpt"
DOPT = {"reference": case(1, "model=gpt_tiny", *COMMON, "train.steps=4"),
        "first": case(4, "model=gpt_tiny", *COMMON, "train.steps=2", "parallel.distributed_optimizer=true",
                      "train.micro_batch_size=1", DOPT_CKPT),
        "plain": case(4, "model=gpt_tiny", *COMMON, "train.steps=4", "parallel.tp=2", DOPT_CKPT, "train.resume=true"),
        "second": case(4, "model=gpt_tiny", *COMMON, "train.steps=4", "parallel.tp=2",
                       "parallel.distributed_optimizer=true", DOPT_CKPT, "train.resume=true")}


@pytest.mark.slow
@pytest.mark.multirank(*DOPT.values())
def test_distributed_optimizer_checkpoint_resumes_under_another_layout(multirank: MultiRankRuns) -> None:
    """The distributed optimizer's state (sharded over DP) saved under DP=4 resumes under TP=2 x DP=2 and continues
    with the reference's losses (the state is saved per parameter, not per DP shard, so it reshards)."""
    reference = multirank[DOPT["reference"]]
    assert reference.returncode == 0, reference.output[-4000:]
    first = multirank[DOPT["first"]]
    assert first.returncode == 0, first.output[-4000:]
    # Megatron-Core 0.16 loads the distributed optimizer's state only into the same kind: refused before any group
    # (by the launch path's checks, before Megatron's groups: the job's default group is up) and changes nothing.
    plain = multirank[DOPT["plain"]]
    assert plain.returncode != 0 and plain.records == []
    assert "set parallel.distributed_optimizer=true" in plain.output
    before, after = multirank.files(DOPT["plain"])
    assert before and after == before
    second = multirank[DOPT["second"]]
    assert second.returncode == 0, second.output[-4000:]
    assert sorted(second.losses) == [3, 4]
    for step in (3, 4):
        assert second.losses[step] == pytest.approx(reference.losses[step], abs=LOSS_ATOL), f"step {step}"


RESHARD_CKPT = f"train.checkpoint_dir={TMP}/tp2_pp2_ckpt"
RESHARD = {"reference": case(1, "model=llama_tiny", *COMMON, f"train.steps={STEPS}"),
           "first": case(4, "model=llama_tiny", *COMMON, "train.steps=3", "parallel.tp=2", "parallel.pp=2",
                         RESHARD_CKPT),
           "refused": case(2, "model=llama_tiny", *COMMON, "train.steps=6", RESHARD_CKPT),
           "second": case(2, "model=llama_tiny", *COMMON, f"train.steps={STEPS}", RESHARD_CKPT, "train.resume=true")}


@pytest.mark.slow
@pytest.mark.multirank(*RESHARD.values())
def test_save_under_tp2_pp2_resume_under_other_layouts(multirank: MultiRankRuns) -> None:
    reference = multirank[RESHARD["reference"]]
    assert reference.returncode == 0, reference.output[-4000:]

    first = multirank[RESHARD["first"]]
    assert first.returncode == 0, first.output[-4000:]
    # its last save is step 3's, and that is the newest folder it leaves (checkpoint.latest_step then)
    assert [r["step"] for r in first.records if r["event"] == "checkpoint"][-1] == 3
    saved = sorted({name.split("/")[0] for name in multirank.files(RESHARD["first"])[1] if name.startswith("iter_")})
    assert saved[-1] == checkpoint.step_dir(Path("."), 3).name

    # A second fresh run into the same folder is refused before any process group (in the launch path's checks,
    # before Megatron's groups), and changes nothing.
    refused = multirank[RESHARD["refused"]]
    assert refused.returncode != 0 and refused.records == []
    assert "train.resume=true" in refused.output
    before, after = multirank.files(RESHARD["refused"])
    assert before == multirank.files(RESHARD["first"])[1] and after == before

    # Resume under DP=2 x PP=1 x TP=1 (a different TP and PP): continues at step 4 with the reference's losses.
    second = multirank[RESHARD["second"]]
    assert second.returncode == 0, second.output[-4000:]
    resume = next(r for r in second.records if r["event"] == "resume")
    assert resume["step"] == 3 and "tp=2 pp=2" in resume["saved_under"]
    assert sorted(second.losses) == [4, 5, 6]
    for step in (4, 5, 6):
        assert second.losses[step] == pytest.approx(reference.losses[step], abs=LOSS_ATOL), f"step {step}"
    assert checkpoint.latest_step(multirank.path("tp2_pp2_ckpt")) == STEPS


KILLED_STEPS = 10
KILLED_COMMON = ["model=gpt_tiny", *COMMON[:-1], f"train.lr_decay_steps={KILLED_STEPS}", f"train.steps={KILLED_STEPS}"]


@pytest.mark.slow
@pytest.mark.multirank(case(1, *KILLED_COMMON))
def test_killed_rank_restarts_and_resumes_from_last_checkpoint(tmp_path: Path, multirank: MultiRankRuns) -> None:
    """The killed job runs in a torchrun of its own (its restart is the point); its single-rank reference is a
    multirank case."""
    steps, common = KILLED_STEPS, KILLED_COMMON
    reference = multirank[case(1, *KILLED_COMMON)]
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
