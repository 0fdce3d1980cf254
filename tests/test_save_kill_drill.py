"""A kill inside a save, for both backends: rank 0 is SIGKILLed at each point of publishing a checkpoint (every
rank's files written but no manifest; manifest written but the folder not renamed; renamed but the pointer not
updated), torchrun restarts the job, and it resumes from the newest complete checkpoint with every loss equal to an
uninterrupted run; no partial folder is left and every checkpoint verifies. Drills: seven torchrun runs each."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from cfp_megatron.engine import checkpoint, manifest
from tests.launcher import run_train

pytestmark = pytest.mark.drill

STEPS = 6
COMMON = ["model=gpt_tiny", "train.global_batch_size=8", "train.seq_length=64", "train.precision=fp32",
          "train.warmup_steps=0", f"train.lr_decay_steps={STEPS}", f"train.steps={STEPS}"]
BACKENDS = {"megatron": (["train.micro_batch_size=2"], "iter_0000004"),
            "deepspeed": (["backend=deepspeed", "backend.zero_stage=1"], "global_step4")}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_kill_inside_a_save_resumes_from_the_last_complete_checkpoint(backend: str, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    if backend == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        pytest.skip("needs the deepspeed extra")
    extra, folder = BACKENDS[backend]
    common = [*COMMON, *extra]
    reference = run_train(2, common, tmp_path / "ref")
    assert reference.returncode == 0, reference.output[-4000:]
    for phase in ("manifest", "rename", "pointer"):
        ckpt = tmp_path / phase / "ckpt"
        monkeypatch.setenv(manifest.SAVE_FAULT_ENV, f"{phase}:{folder}")
        run = run_train(2, [*common, "train.save_interval=2", f"train.checkpoint_dir={ckpt}"], tmp_path / phase,
                        max_restarts=1)
        assert run.returncode == 0, (phase, run.output[-4000:])
        resume = [r for r in run.records if r.get("event") == "resume"]
        assert len(resume) == 1 and resume[0]["restart_count"] == 1, (phase, resume)
        assert resume[0]["step"] == 2, (phase, resume)  # step 4's save never became the newest
        assert sorted(run.losses) == list(range(1, STEPS + 1))
        for step in range(1, STEPS + 1):
            assert run.losses[step] == pytest.approx(reference.losses[step], rel=1e-5, abs=1e-5), (phase, step)
        assert not list(ckpt.glob("*.partial")), phase
        saved = sorted(p for p in ckpt.iterdir() if p.is_dir())
        assert saved and all(manifest.verify(p, trust_unverified=False, fix="") for p in saved), phase
        if backend == "megatron":
            assert checkpoint.latest_step(ckpt) == STEPS
        else:
            assert (ckpt / "latest").read_text().strip() == f"global_step{STEPS}"
