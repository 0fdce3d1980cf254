"""Checkpoint integrity: every save writes a manifest, a resume verifies it before anything is unpickled,
and each kind of damage is one CheckpointError naming the file (quick, in-process); the drills run the real trainer
under torchrun against planted pickles, zeroed and truncated shards, and a kill of a rank that saved."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.engine import checkpoint, manifest, save_workers
from tests.launcher import run_train, torchrun_command


class _Planted:
    """A pickle that, when loaded, creates a marker file (what a planted payload would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple:
        return (Path.touch, (self.marker,))


def _folder(root: Path, step: int) -> Path:
    """A saved-looking Megatron checkpoint folder at ``step`` with its manifest, and the pointer naming it."""
    folder = checkpoint.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / ".metadata").write_bytes(pickle.dumps({"state": "metadata"}))
    (folder / "__0_0.distcp").write_bytes(os.urandom(8192))
    (folder / "common.pt").write_bytes(os.urandom(512))
    (folder / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    manifest.write_manifest(folder)
    (root / checkpoint.LATEST).write_text(f"{step}\n")
    return folder


def _resume(root: Path, **kw: bool) -> int | None:
    return checkpoint.check_before_start(str(root), resume=True, restarted=False, **kw)


def test_manifest_lists_every_file_and_verifies(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 4)
    files = json.loads((folder / manifest.MANIFEST).read_text())["files"]
    assert sorted(files) == [".metadata", "__0_0.distcp", "common.pt", "metadata.json"]
    assert files["__0_0.distcp"]["size"] == 8192
    assert not (folder / (manifest.MANIFEST + ".tmp")).exists()
    assert _resume(tmp_path) == 4


@pytest.mark.parametrize(("damage", "message"), [
    (lambda f: (f / "__0_0.distcp").write_bytes(bytes(8192)), r"__0_0\.distcp differs from what the save wrote"),
    (lambda f: (f / "__0_0.distcp").write_bytes((f / "__0_0.distcp").read_bytes()[:4096]),
     r"__0_0\.distcp is truncated: 4096 bytes, the save wrote 8192"),
    (lambda f: (f / "common.pt").unlink(), r"common\.pt is missing"),
    (lambda f: (f / "extra.pt").write_bytes(b"x"), r"extra\.pt was not written by the save \(a pickle-format file"),
    (lambda f: (f / manifest.MANIFEST).write_text("{not json"), r"cfp_manifest\.json cannot be read"),
])
def test_each_damage_is_one_error_naming_the_file(tmp_path: Path, damage, message: str) -> None:
    _folder(tmp_path, 2)
    damage(_folder(tmp_path, 4))
    with pytest.raises(CheckpointError, match=message) as err:
        _resume(tmp_path)
    # the fix names the previous complete checkpoint, and a fresh start
    assert "write '2' into" in str(err.value) and "train.resume=false" in str(err.value)


def test_planted_pickle_is_refused_before_it_is_unpickled(tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    folder = _folder(tmp_path / "ckpt", 4)
    (folder / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(CheckpointError, match=r"\.metadata (differs|is truncated|is longer)"):
        _resume(tmp_path / "ckpt")
    assert not marker.exists()
    pickle.loads((folder / ".metadata").read_bytes())  # the payload is live: the check is what stopped it
    assert marker.exists()


def test_checkpoint_without_manifest_needs_the_override(tmp_path: Path) -> None:
    folder = _folder(tmp_path, 4)
    (folder / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match="has no cfp_manifest.json.*train.trust_unverified_checkpoint=true"):
        _resume(tmp_path)
    assert _resume(tmp_path, trust_unverified=True) == 4
    # a torchrun restart verifies too
    with pytest.raises(CheckpointError, match="has no cfp_manifest.json"):
        checkpoint.check_before_start(str(tmp_path), resume=False, restarted=True)


def test_deepspeed_resume_rules_match_megatrons(tmp_path: Path) -> None:
    from cfp_megatron.backends.deepspeed import checkpoint as ds

    with pytest.raises(CheckpointError, match="train.resume=true but train.checkpoint_dir=.*holds no complete"):
        ds.check_before_start(str(tmp_path / "empty"), resume=True, restarted=False, trust_unverified=False)
    folder = tmp_path / "ckpt" / "global_step4"
    folder.mkdir(parents=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(os.urandom(256))
    manifest.write_manifest(folder)
    (tmp_path / "ckpt" / "global_step6.partial").mkdir()  # a save killed before its rename
    (tmp_path / "ckpt" / ds.LATEST).write_text("global_step4")
    root = str(tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(DeepSpeed: global_step4"):
        ds.check_before_start(root, resume=False, restarted=False, trust_unverified=False)
    # torchrun's restarted workers recognise their own run's folder
    assert ds.check_before_start(root, resume=False, restarted=True, trust_unverified=False) == 4
    assert ds.check_before_start(root, resume=True, restarted=False, trust_unverified=False) == 4
    (folder / "mp_rank_00_model_states.pt").write_bytes(os.urandom(256))
    with pytest.raises(CheckpointError, match="mp_rank_00_model_states.pt differs"):
        ds.check_before_start(root, resume=True, restarted=False, trust_unverified=False)


_ORPHAN_CHILD = """
import os, signal, sys
from megatron.core.dist_checkpointing.strategies import filesystem_async
from cfp_megatron.engine import save_workers
if __name__ == "__main__":
    with save_workers.tied_to_this_process():
        assert filesystem_async._results_queue is not None
        pid = save_workers._state["manager"]._process.pid
        child = os.fork()
        if child == 0:
            signal.pause()
    print(pid, child, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.drill
def test_checkpoint_writers_die_with_the_rank(tmp_path: Path) -> None:
    """Megatron's save Manager (spawned) and a writer forked during a save end when the rank is SIGKILLed."""
    import psutil

    script = tmp_path / "child.py"
    script.write_text(_ORPHAN_CHILD)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 60
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    for pid in alive:  # do not leave them behind if the check fails
        os.kill(pid, signal.SIGKILL)
    assert alive == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_save_managers_queue_carries_results_without_importing_torch() -> None:
    """The results queue Megatron's writers put into (the Manager of :mod:`cfp_megatron.engine.save_workers`) gives
    back what was put, says ``queue.Empty`` as a queue does, and its server never loads torch for the items."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.storage import WriteResult

    with save_workers.tied_to_this_process():
        results = filesystem_async._results_queue
    item = {0: [WriteResult(index=MetadataIndex("layer.weight", offset=None), size_in_bytes=64, storage_data=None)]}
    results.put(item)
    assert results.get_nowait() == item
    with pytest.raises(queue.Empty):
        results.get_nowait()
    server = save_workers._state["manager"]._process.pid
    assert "libtorch" not in Path(f"/proc/{server}/maps").read_text()


# --- drills: the real trainer under torchrun ----------------------------------------------------------------------

COMMON = ["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=4", "train.seq_length=64",
          "train.warmup_steps=0", "train.precision=fp32"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Megatron checkpoint folder with steps 1 and 2, saved by one rank."""
    work = tmp_path_factory.mktemp("integrity")
    result = run_train(1, [*COMMON, "train.steps=2", "train.save_interval=1", f"train.checkpoint_dir={work / 'ckpt'}"],
                       work / "save")
    assert result.returncode == 0, result.output[-4000:]
    return work / "ckpt"


def _damaged_resume(saved: Path, tmp_path: Path, damage) -> tuple[str, Path]:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    damage(checkpoint.step_dir(ckpt, 2))
    result = run_train(1, [*COMMON, "train.steps=4", f"train.checkpoint_dir={ckpt}", "train.resume=true"],
                       tmp_path / "resume", timeout=300)
    assert result.returncode != 0 and result.steps == [], result.output[-3000:]
    assert "cfp-megatron: CheckpointError" in result.output, result.output[-3000:]
    # one clear error: torchrun's own summary of the failed worker, no traceback from the worker's code
    assert not re.search(r'File ".*(cfp_megatron|megatron/core|deepspeed|torch/distributed/checkpoint)/', result.output)
    return result.output, ckpt


@pytest.mark.drill
def test_planted_metadata_pickle_is_never_executed(saved: Path, tmp_path: Path) -> None:
    marker = tmp_path / "payload_ran"
    output, _ = _damaged_resume(saved, tmp_path,
                                lambda f: (f / ".metadata").write_bytes(pickle.dumps(_Planted(marker))))
    assert "CheckpointError" in output and "iter_0000002/.metadata" in output
    assert "iter_0000001" in output  # the fix names the previous checkpoint
    assert not marker.exists()


@pytest.mark.drill
def test_zeros_in_a_shard_stop_the_resume(saved: Path, tmp_path: Path) -> None:
    def zero(folder: Path) -> None:
        shard = next(folder.glob("*.distcp"))
        with open(shard, "r+b") as fh:
            fh.seek(1024)
            fh.write(bytes(4096))

    output, _ = _damaged_resume(saved, tmp_path, zero)
    assert ".distcp differs from what the save wrote" in output


@pytest.mark.drill
def test_truncated_and_missing_pieces_stop_the_resume(saved: Path, tmp_path: Path) -> None:
    def truncate(folder: Path) -> None:
        shard = next(folder.glob("*.distcp"))
        os.truncate(shard, shard.stat().st_size // 2)
        (folder / "common.pt").unlink()

    output, _ = _damaged_resume(saved, tmp_path, truncate)
    assert "is missing" in output or "is truncated" in output


@pytest.mark.drill
def test_killed_rank_leaves_no_checkpoint_writer_behind(tmp_path: Path) -> None:
    """SIGKILL the only rank after it saved (Megatron's save Manager is alive then): nothing it started survives."""
    import psutil

    metrics = tmp_path / "metrics.jsonl"
    args = [*COMMON, "train.steps=200", "train.save_interval=1", f"train.checkpoint_dir={tmp_path / 'ckpt'}",
            f"train.metrics_file={metrics}", f"hydra.run.dir={tmp_path / 'run'}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with (tmp_path / "torchrun.log").open("w") as out:
        proc = subprocess.Popen(torchrun_command(1, args), cwd=tmp_path, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    descendants: list = []
    try:
        deadline = time.monotonic() + 600
        while not (metrics.exists() and metrics.read_text().count('"checkpoint"') >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()[-3000:]
            time.sleep(0.2)
        worker = next(p for p in psutil.Process(proc.pid).children() if any("train.py" in a for a in p.cmdline()))
        descendants = worker.children(recursive=True)
        assert descendants, "the save started no helper process"
        worker.kill()
        proc.wait(timeout=300)
        deadline = time.monotonic() + 60
        alive = descendants
        while alive and time.monotonic() < deadline:
            alive = [p for p in descendants if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
            time.sleep(0.2)
        assert alive == [], [p.cmdline() for p in alive]
    finally:
        for p in descendants:
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.drill
def test_verified_checkpoint_resumes_and_the_next_save_has_a_manifest(saved: Path, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved, ckpt)
    result = run_train(1, [*COMMON, "train.steps=3", f"train.checkpoint_dir={ckpt}", "train.resume=true"],
                       tmp_path / "resume")
    assert result.returncode == 0, result.output[-4000:]
    assert sorted(result.losses) == [3]
    assert checkpoint.latest_step(ckpt) == 3
    assert manifest.verify(checkpoint.step_dir(ckpt, 3), trust_unverified=False, fix="")
