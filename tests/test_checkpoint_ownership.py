"""Checkpoint folders are owned and never clobbered (issue R, part 1), for both backends: step folders count
whatever the pointer says, a save never removes a folder it did not write, a folder lock names the other job, a
resume under another model is refused naming the keys, a resume with nothing to do says so, the pointer holds ASCII
digits only, and a save on a full disk is one error on every rank with the previous checkpoint intact.

In-process (fake folders with manifests); the drills run torchrun: the lost-checkpoint repro, two jobs on one
folder, and a save on a full tmpfs (skipped where mounting is not allowed)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfp_megatron.backends.deepspeed import checkpoint as ds
from cfp_megatron.base.config import ModelSpec
from cfp_megatron.base.errors import CheckpointError
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.engine import checkpoint, checkpoint_lock, manifest
from cfp_megatron.engine.checkpoint import MEGATRON, Scheme
from tests.launcher import REPO, run_train, torchrun_command

SCHEMES = {"megatron": MEGATRON, "deepspeed": ds.SCHEME}


def _folder(root: Path, scheme: Scheme, step: int, *, pointer: bool = True, writer: str | None = None,
            model: ModelSpec | None = None) -> Path:
    """A saved-looking step folder with its manifest (recording ``model`` and ``writer``)."""
    folder = scheme.step_dir(root, step)
    folder.mkdir(parents=True)
    (folder / "shard.distcp").write_bytes(os.urandom(256))
    manifest.write_manifest(folder, {"model": json_plain(model) if model else None, "writer": writer})
    if pointer:
        (root / scheme.pointer).write_text(scheme.pointer_text.format(step))
    return folder


def _check(root: Path, scheme: Scheme, **kw) -> int | None:
    kw.setdefault("resume", True)
    kw.setdefault("restarted", False)
    kw.setdefault("trust_unverified", False)
    return checkpoint.check_folder(str(root), scheme, **kw)


# --- step folders count whatever the pointer says ------------------------------------------------------------
@pytest.mark.parametrize("backend", list(SCHEMES))
def test_fresh_run_refuses_step_folders_without_a_pointer(tmp_path: Path, backend: str) -> None:
    scheme = SCHEMES[backend]
    for step in (2, 4):
        _folder(tmp_path, scheme, step)
    (tmp_path / scheme.pointer).unlink()  # the repro: the pointer removed, the folders there
    with pytest.raises(CheckpointError, match=rf"already holds checkpoints .*{scheme.folder.format(4)}.*no "
                                              rf"{scheme.pointer}.*train.resume=true"):
        _check(tmp_path, scheme, resume=False, steps=4, save_interval=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [scheme.folder.format(2), scheme.folder.format(4)]


@pytest.mark.parametrize("backend", list(SCHEMES))
def test_resume_without_a_pointer_takes_the_newest_folder_that_verifies(tmp_path: Path, backend: str) -> None:
    scheme = SCHEMES[backend]
    for step in (2, 4, 6):
        _folder(tmp_path, scheme, step)
    (scheme.step_dir(tmp_path, 6) / "shard.distcp").write_bytes(b"damaged")
    (tmp_path / scheme.pointer).unlink()
    notes: list[str] = []
    assert _check(tmp_path, scheme, note=notes.append) == 4
    assert len(notes) == 1 and f"resuming from {scheme.step_dir(tmp_path, 4)}" in notes[0]
    assert f"{scheme.folder.format(6)}: " in notes[0] and "truncated" in notes[0]
    # ... but a run that would save into the damaged folder is refused rather than replacing it
    with pytest.raises(CheckpointError, match=rf"would save step 6 into .*{scheme.folder.format(6)}.*move"):
        _check(tmp_path, scheme, steps=8, save_interval=2)
    assert _check(tmp_path, scheme, steps=5, save_interval=2) == 4  # saves at step 5 only


def test_resume_without_a_pointer_and_nothing_verifying_names_what_it_found(tmp_path: Path) -> None:
    for step in (2, 4):
        (_folder(tmp_path, MEGATRON, step, pointer=False) / manifest.MANIFEST).unlink()
    with pytest.raises(CheckpointError, match=r"has no latest_checkpointed_iteration.txt and none of its 2 step "
                                              r"folder\(s\) verifies: iter_0000004: .*has no cfp_manifest.json.*"
                                              r"train.trust_unverified_checkpoint=true"):
        _check(tmp_path, MEGATRON)
    assert _check(tmp_path, MEGATRON, trust_unverified=True) == 4


@pytest.mark.parametrize(("backend", "text"), [
    ("megatron", "²"), ("megatron", "٣"), ("megatron", "-1"), ("megatron", ""), ("megatron", "4 4"),
    ("megatron", b"\xff\xfe4"), ("megatron", "+4"),
    ("deepspeed", "global_step²"), ("deepspeed", "global_step٣"), ("deepspeed", "4"), ("deepspeed", ""),
    ("deepspeed", "../global_step4"),
])
def test_a_pointer_that_is_not_ascii_digits_is_one_error(tmp_path: Path, backend: str, text: str | bytes) -> None:
    scheme = SCHEMES[backend]
    _folder(tmp_path, scheme, 4)
    pointer = tmp_path / scheme.pointer
    pointer.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(CheckpointError, match=rf"{scheme.pointer} holds .*not a step .*ASCII digits.*Fix:"):
        _check(tmp_path, scheme)
    with pytest.raises(CheckpointError, match=scheme.pointer):
        _check(tmp_path, scheme, resume=False)


def test_a_pointer_that_is_a_folder_is_one_error(tmp_path: Path) -> None:
    _folder(tmp_path, MEGATRON, 4, pointer=False)
    (tmp_path / checkpoint.LATEST).mkdir()
    with pytest.raises(CheckpointError, match="latest_checkpointed_iteration.txt is a folder"):
        _check(tmp_path, MEGATRON)


# --- a save never removes a folder it did not write ----------------------------------------------------------
@pytest.mark.parametrize("backend", list(SCHEMES))
def test_a_run_that_would_write_an_existing_folder_is_refused_before_start(tmp_path: Path, backend: str) -> None:
    scheme = SCHEMES[backend]
    _folder(tmp_path, scheme, 4, writer="another-job")
    _folder(tmp_path, scheme, 2)  # the pointer names step 2, older than a folder that is there
    pointer = scheme.pointer_text.format(4)
    with pytest.raises(CheckpointError, match=rf"would save step 4 into .*{scheme.folder.format(4)}.*write "
                                              rf"'{pointer}' into"):
        _check(tmp_path, scheme, steps=6, save_interval=2)
    with pytest.raises(CheckpointError, match="would save step 4"):  # the final save at step 4
        _check(tmp_path, scheme, steps=4, save_interval=None)
    notes: list[str] = []
    assert _check(tmp_path, scheme, steps=3, save_interval=2, note=notes.append) == 2
    assert len(notes) == 1 and f"newer step folders are there too ({scheme.folder.format(4)})" in notes[0]
    # this job's own folder (a save killed before its pointer was updated, then torchrun's restart) is its to redo
    assert _check(tmp_path, scheme, steps=6, save_interval=2, writer="another-job") == 2


def test_publish_refuses_a_folder_another_run_wrote(tmp_path: Path) -> None:
    final = _folder(tmp_path, MEGATRON, 4, writer="theirs")
    before = (final / "shard.distcp").read_bytes()
    partial = tmp_path / "iter_0000004.partial"
    partial.mkdir()
    (partial / "shard.distcp").write_bytes(b"mine")
    for writer in ("mine", None):
        with pytest.raises(CheckpointError, match="iter_0000004 is already there and was not written by this job"):
            manifest.publish(partial, final, tmp_path / checkpoint.LATEST, "4\n", {"writer": writer})
        assert (final / "shard.distcp").read_bytes() == before
    manifest.publish(partial, final, tmp_path / checkpoint.LATEST, "4\n", {"writer": "theirs"})  # its own: redone
    assert (final / "shard.distcp").read_bytes() == b"mine"
    assert manifest.read_record(final) == {"writer": "theirs"}


def test_a_save_cleans_partial_folders_only_under_its_own_lock(tmp_path: Path) -> None:
    theirs = tmp_path / "iter_0000002.partial"
    theirs.mkdir(parents=True)  # another job's save in flight (no lock of ours)
    final = tmp_path / "iter_0000004"
    assert checkpoint.prepare_save(tmp_path, final, MEGATRON) is None
    assert theirs.is_dir() and (tmp_path / "iter_0000004.partial").is_dir()
    problem = checkpoint.prepare_save(tmp_path, final, MEGATRON)  # the same partial again: not removed
    assert problem is not None and "iter_0000004.partial is already there" in problem and "remove" in problem
    shutil.rmtree(tmp_path / "iter_0000004.partial")
    checkpoint_lock.acquire(tmp_path)  # this job owns the folder now, but not a partial that was there before
    assert checkpoint.prepare_save(tmp_path, final, MEGATRON) is None
    assert theirs.is_dir() and (tmp_path / "iter_0000004.partial").is_dir()
    assert checkpoint.prepare_save(tmp_path, final, MEGATRON) is None  # its own partial: cleaned, made again
    # a dead job's lock taken over: its unfinished saves are the new owner's to clean
    root = tmp_path / "other"
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _write_lock(root, _other(proc.pid))
    dead = root / "iter_0000002.partial"
    dead.mkdir()
    checkpoint_lock.acquire(root)
    assert checkpoint.prepare_save(root, root / "iter_0000004", MEGATRON) is None
    assert not dead.exists() and (root / "iter_0000004.partial").is_dir()


def test_a_failed_write_removes_the_partial_folder_and_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    _folder(tmp_path, MEGATRON, 2)
    partial = tmp_path / "iter_0000004.partial"
    partial.mkdir()
    (partial / "shard.distcp").write_bytes(b"half")
    err = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 128 vs 0")
    err.__cause__ = OSError(errno.ENOSPC, "No space left on device")
    with pytest.raises(CheckpointError, match=r"saving into .*iter_0000004.partial failed on rank 0: .*the disk is "
                                              r"full. Fix: free space .*previous checkpoint"):
        checkpoint.finish_save(partial, tmp_path / "iter_0000004", tmp_path / checkpoint.LATEST, "4\n", {}, err)
    assert not partial.exists() and not (tmp_path / "iter_0000004").exists()
    assert checkpoint.latest_step(tmp_path) == 2


def test_publishing_on_a_full_disk_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    """A real full disk (a 64k tmpfs): the manifest cannot be written; one CheckpointError naming the file and the
    fix, the partial folder removed, the previous pointer intact."""
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "64k"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        _folder(disk, MEGATRON, 2)
        partial = disk / "iter_0000004.partial"
        partial.mkdir()
        with pytest.raises(OSError), open(partial / "shard.distcp", "wb") as fh:  # fill the disk
            fh.write(os.urandom(1 << 20))
        with pytest.raises(CheckpointError, match=r"cfp_manifest.json \(train.checkpoint_dir\) cannot be written: "
                                                  r"the disk is full. Fix: free space"):
            checkpoint.finish_save(partial, disk / "iter_0000004", disk / checkpoint.LATEST, "4\n", {}, None)
        assert not partial.exists() and not (disk / "iter_0000004").exists()
        assert checkpoint.latest_step(disk) == 2
    finally:
        subprocess.run(["umount", str(disk)], check=False)


# --- the folder lock -----------------------------------------------------------------------------------------
def _other(pid: int, host: str | None = None, job: str = "other-job") -> checkpoint_lock.Owner:
    return checkpoint_lock.Owner(job=job, host=host or socket.gethostname(), pid=pid,
                                 started=checkpoint_lock.process_start(pid), token="t-other")


def _write_lock(root: Path, owner: checkpoint_lock.Owner) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / checkpoint_lock.LOCK).write_text(json.dumps(owner.__dict__))


def test_the_lock_names_its_job_and_refuses_a_second_one(tmp_path: Path) -> None:
    mine = checkpoint_lock.acquire(tmp_path)
    saved = json.loads((tmp_path / checkpoint_lock.LOCK).read_text())
    assert saved["host"] == socket.gethostname() and saved["pid"] == os.getpid() and saved["token"] == mine.token
    assert checkpoint_lock.acquire(tmp_path).token == mine.token  # the same job keeps it
    assert checkpoint_lock.check(tmp_path) == mine.token == checkpoint_lock.held_token(tmp_path)
    other = _other(os.getppid())  # a live process on this host
    with pytest.raises(CheckpointError, match=rf"in use by another job: .*names job {mine.job} \(host "
                                              rf"{socket.gethostname()}, pid {os.getpid()}, started 20.*is still "
                                              r"running.*Fix: choose another train.checkpoint_dir"):
        checkpoint_lock.acquire(tmp_path, me=other)
    with pytest.raises(CheckpointError, match="in use by another job"):
        checkpoint_lock.check(tmp_path, me=other)
    checkpoint_lock.release(tmp_path, "not-the-token")
    assert (tmp_path / checkpoint_lock.LOCK).exists()
    checkpoint_lock.release(tmp_path, mine.token)
    assert not (tmp_path / checkpoint_lock.LOCK).exists()


def test_a_dead_jobs_lock_is_taken_over_with_a_note(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    _write_lock(tmp_path, _other(proc.pid))
    notes: list[str] = []
    assert checkpoint_lock.check(tmp_path, note=notes.append) is None
    assert len(notes) == 1 and f"pid {proc.pid}" in notes[0] and "is gone" in notes[0]
    taken = checkpoint_lock.acquire(tmp_path)
    assert taken.pid == os.getpid() and checkpoint_lock.read_lock(tmp_path) == taken
    # a live pid whose process started at another time is a reused pid: the lock is stale too
    _write_lock(tmp_path, checkpoint_lock.Owner(job="j", host=socket.gethostname(), pid=os.getppid(),
                                                started=1.0, token="t"))
    assert checkpoint_lock.check(tmp_path) is None


def test_a_lock_from_another_host_is_refused_unless_it_is_this_job(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "rdzv-42")
    me = checkpoint_lock.this_job()
    assert me.job == "rdzv-42" and me.pid == os.getppid()  # torchrun's agent
    _write_lock(tmp_path, _other(12345, host="node-b.cluster"))
    with pytest.raises(CheckpointError, match=r"host node-b.cluster, pid 12345.*runs on another host.*ps -p 12345"):
        checkpoint_lock.check(tmp_path)
    _write_lock(tmp_path, _other(12345, host="node-b.cluster", job="rdzv-42"))  # a rank of this job on node b
    assert checkpoint_lock.check(tmp_path) == "t-other"
    # a restarted worker (TORCHELASTIC_RESTART_COUNT>0) has the same agent: it keeps the lock
    (tmp_path / checkpoint_lock.LOCK).unlink()
    first = checkpoint_lock.acquire(tmp_path)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert checkpoint_lock.acquire(tmp_path).token == first.token
    # the static rendezvous (run id "none"): the store's address is the job's id on every node
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    monkeypatch.setenv("MASTER_ADDR", "node-a")
    monkeypatch.setenv("MASTER_PORT", "29500")
    assert checkpoint_lock.this_job().job == "node-a:29500"


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.mkdir(), "is a folder, not the lock file"),
    (lambda p: p.write_text("{not json"), "cannot be read"),
    (lambda p: p.write_bytes(b"\xff\xfe\x00"), "cannot be read"),
    (lambda p: p.write_text('{"job": "x"}'), "is not a lock cfp-megatron wrote"),
    (lambda p: p.write_text("[1, 2]"), "is not a lock cfp-megatron wrote"),
])
def test_a_broken_lock_path_is_one_error(tmp_path: Path, make, message: str) -> None:
    make(tmp_path / checkpoint_lock.LOCK)
    with pytest.raises(CheckpointError, match=rf"cfp_lock.json.*{message}.*Fix:"):
        checkpoint_lock.check(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        checkpoint_lock.acquire(tmp_path)


# --- the model, and nothing left to do -----------------------------------------------------------------------
@pytest.mark.parametrize("backend", list(SCHEMES))
def test_a_resume_under_another_model_names_each_key(tmp_path: Path, backend: str) -> None:
    scheme = SCHEMES[backend]
    _folder(tmp_path, scheme, 4, model=ModelSpec())
    with pytest.raises(CheckpointError, match=r"saved from another model .*model.hidden_size: saved 64, now 128; "
                                              r"model.num_layers: saved 4, now 8\. .*another layout.*is fine"):
        _check(tmp_path, scheme, model=ModelSpec(num_layers=8, hidden_size=128))
    # the label and training knobs (dropout) may change; so may the layout (not part of the model)
    assert _check(tmp_path, scheme, model=ModelSpec(name="renamed", hidden_dropout=0.1)) == 4


def test_an_old_manifest_without_the_model_loads_as_before(tmp_path: Path) -> None:
    _folder(tmp_path, MEGATRON, 4)
    assert "model" not in manifest.read_record(checkpoint.step_dir(tmp_path, 4))
    assert _check(tmp_path, MEGATRON, model=ModelSpec(num_layers=8)) == 4


@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_launch_checks_come_before_any_process_group(tmp_path: Path, backend: str,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """train_from_config, in-process: a resume with nothing left to do says so (and returns), a resume under another
    model and a folder held by a live job are refused; none starts a process group."""
    import torch.distributed as dist

    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.planner.entry import train_from_config

    scheme = SCHEMES[backend]
    extra = ["backend=deepspeed"] if backend == "deepspeed" else []
    root = tmp_path / "ckpt"
    _folder(root, scheme, 4, model=ModelSpec(name="gpt_tiny", num_layers=4, hidden_size=64, vocab_size=257,
                                             ffn_hidden_size=256, max_position_embeddings=256))

    def run(*overrides: str) -> list:
        return train_from_config(compose_config([*extra, f"train.checkpoint_dir={root}", "train.resume=true",
                                                 f"hydra.run.dir={tmp_path / 'run'}", *overrides]))

    assert run("train.steps=4") == []
    out = capsys.readouterr().out
    assert "nothing to train: train.checkpoint_dir=" in out and "set train.steps above 4" in out
    with pytest.raises(CheckpointError, match="model.num_layers: saved 4, now 8"):
        run("train.steps=6", "model.num_layers=8")
    _write_lock(root, _other(os.getppid()))
    with pytest.raises(CheckpointError, match="in use by another job"):
        run("train.steps=6")
    assert not dist.is_initialized()


# --- second review: names, places, the lock's and the manifest's fields, the saved state -------------------
@pytest.mark.parametrize(("backend", "odd"), [("megatron", "iter_4"), ("megatron", "iter_00000004"),
                                              ("deepspeed", "global_step04")])
def test_step_folders_count_only_by_their_exact_name(tmp_path: Path, backend: str, odd: str) -> None:
    """A folder named almost as a step folder is not read as one (its step's folder has another name, so a load
    would miss it): a resume says what it found instead of resuming from it."""
    scheme = SCHEMES[backend]
    (_folder(tmp_path, scheme, 4, pointer=False)).rename(tmp_path / odd)
    assert checkpoint.step_folders(tmp_path, scheme) == {}
    with pytest.raises(CheckpointError, match=rf"holds no complete {scheme.backend} checkpoint.*{odd} is named "
                                              rf"like a step folder but not as {scheme.backend} names them "
                                              rf"\({scheme.folder.format(4)} for step 4\).*rename"):
        _check(tmp_path, scheme)
    assert _check(tmp_path, scheme, resume=False, steps=2) is None  # a fresh run leaves it alone


def test_steps_past_ten_million_keep_their_folders(tmp_path: Path) -> None:
    big = _folder(tmp_path, MEGATRON, 12_345_678, pointer=False)
    assert big.name == "iter_12345678" and checkpoint.step_folders(tmp_path) == {12_345_678: big}
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        _check(tmp_path, MEGATRON, resume=False)


@pytest.mark.parametrize("inside", ["iter_0000004", "iter_0000004/sub", "iter_0000002.partial"])
def test_a_checkpoint_dir_in_another_checkpoints_step_folder_is_refused(tmp_path: Path, inside: str) -> None:
    root = tmp_path / "ckpt"
    _folder(root, MEGATRON, 4)
    (root / "iter_0000002.partial").mkdir()
    target = root / inside
    before = sorted(p.name for p in (root / "iter_0000004").iterdir())
    for resume in (True, False):
        with pytest.raises(CheckpointError, match=rf"(is|lies inside) the step folder .*iter_000000[24].* of the "
                                                  rf"checkpoint folder {root}.*train.checkpoint_dir='{root}'"):
            _check(target, MEGATRON, resume=resume, steps=2)
    link = tmp_path / "link"
    link.symlink_to(root / "iter_0000004")  # the same place by another name
    with pytest.raises(CheckpointError, match="is the step folder"):
        _check(link, MEGATRON, resume=False)
    assert sorted(p.name for p in (root / "iter_0000004").iterdir()) == before


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.write_text("x"), "is not a folder"),
    (lambda p: p.symlink_to(p.with_name("nowhere")), "is a symbolic link to .*which does not exist"),
    (lambda p: (p.symlink_to(p.with_name("loop2")), p.with_name("loop2").symlink_to(p)),
     "is a symbolic link that leads back to itself"),
])
def test_a_checkpoint_dir_that_is_no_folder_is_one_error(tmp_path: Path, make, message: str) -> None:
    root = tmp_path / "ckpt"
    make(root)
    for resume in (True, False):
        with pytest.raises(CheckpointError, match=rf"train.checkpoint_dir='{root}': {root} {message}.*Fix: point"):
            _check(root, MEGATRON, resume=resume)
    assert checkpoint_lock.check(root) is None  # the lock check leaves it to the message above


def test_an_unreadable_checkpoint_dir_is_one_error(tmp_path: Path) -> None:
    """chmod 000 on the folder, on a step folder and on a manifest, checked as a user without root's override
    (``setpriv`` drops it where the tests run as root)."""
    root = tmp_path / "ckpt"
    for step in (2, 4):
        _folder(root, MEGATRON, step)
    locked = tmp_path / "locked"
    locked.mkdir()
    probe = (f"import sys; sys.path.insert(0, {str(REPO)!r})\n"
             "from cfp_megatron.engine import checkpoint_lock, manifest\n"
             "from cfp_megatron.base.errors import CfpError\n"
             "for call in (lambda: print(checkpoint_lock.folder_problem(sys.argv[1])),\n"
             "             lambda: manifest.verify(__import__('pathlib').Path(sys.argv[2]), trust_unverified=False,"
             " fix='FIX'),\n"
             "             lambda: manifest.verify(__import__('pathlib').Path(sys.argv[3]), trust_unverified=False,"
             " fix='FIX')):\n"
             "    try:\n        call()\n    except CfpError as err:\n        print(err)\n")
    (root / "iter_0000002").chmod(0)
    (root / "iter_0000004" / manifest.MANIFEST).chmod(0)
    locked.chmod(0)
    argv = [sys.executable, "-c", probe, str(locked), str(root / "iter_0000002"), str(root / "iter_0000004")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("running as root without setpriv: permissions cannot be denied")
        argv = ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *argv]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    finally:
        for path in (locked, root / "iter_0000002", root / "iter_0000004" / manifest.MANIFEST):
            path.chmod(0o700)
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stdout.splitlines()
    assert f"the folder {locked} cannot be read (Permission denied)" in lines[0]
    assert "iter_0000002 cannot be read (Permission denied). FIX" in lines[1]
    assert "cfp_manifest.json cannot be read (Permission denied)" in lines[2]


@pytest.mark.parametrize(("backend", "holds", "message"), [
    ("megatron", lambda r: (_folder(r, ds.SCHEME, 4), r), r"it holds DeepSpeed checkpoints \(global_step4\): resume "
                                                          r"those with backend=deepspeed"),
    ("deepspeed", lambda r: (_folder(r, MEGATRON, 4), r), r"it holds Megatron checkpoints \(iter_0000004\): resume "
                                                          r"those with backend=megatron"),
    ("megatron", lambda r: (r.mkdir(), (r / "iter_0000002.partial").mkdir()), r"iter_0000002.partial: unfinished"),
    ("megatron", lambda r: None, r"ckpt does not exist"),
])
def test_a_resume_from_a_folder_without_checkpoints_says_what_it_holds(tmp_path: Path, backend: str, holds,
                                                                      message: str) -> None:
    root = tmp_path / "ckpt"
    holds(root)
    with pytest.raises(CheckpointError, match=rf"holds no complete {SCHEMES[backend].backend} checkpoint.*{message}"):
        _check(root, SCHEMES[backend])


def test_a_fresh_run_refuses_the_other_backends_checkpoints(tmp_path: Path) -> None:
    _folder(tmp_path, ds.SCHEME, 4)
    with pytest.raises(CheckpointError, match=r"already holds checkpoints \(DeepSpeed: global_step4; no latest_"
                                              r"checkpointed_iteration.txt\).*with backend=deepspeed"):
        _check(tmp_path, MEGATRON, resume=False, steps=4)


def _lock_text(**changes: object) -> str:
    fields = {"job": "j", "host": socket.gethostname(), "pid": os.getppid(),
              "started": checkpoint_lock.process_start(os.getppid()), "token": "t", **changes}
    return json.dumps(fields)


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: p.write_text(_lock_text(pid=0)), "'pid' is 0, not a process id"),
    (lambda p: p.write_text(_lock_text(pid=-1)), "'pid' is -1"),
    (lambda p: p.write_text(_lock_text(pid=1 << 40)), "'pid' is 1099511627776"),
    (lambda p: p.write_text(_lock_text(pid=True)), "'pid' is True"),
    (lambda p: p.write_text(_lock_text(pid=1.5)), "'pid' is 1.5"),
    (lambda p: p.write_text(_lock_text(started=1e400)), "'started' is inf"),
    (lambda p: p.write_text(_lock_text(started="now")), "'started' is 'now'"),
    (lambda p: p.write_text(_lock_text(host="")), "'host' is ''"),
    (lambda p: p.write_text(_lock_text(token=None)), "'token' is None"),
    (lambda p: p.write_text(_lock_text()[:-1] + ', "pid": 99999}'), "the key 'pid' appears twice"),
    (lambda p: p.symlink_to(p.with_name("gone.json")), "is a symbolic link"),
    (lambda p: p.symlink_to("/etc/hostname"), "is a symbolic link"),
    (lambda p: os.mkfifo(p), "is a named pipe"),
    (lambda p: p.write_bytes(b" " * (checkpoint_lock.LOCK_LIMIT + 1)), "is longer than"),
])
def test_a_lock_file_is_read_only_as_the_project_writes_it(tmp_path: Path, make, message: str) -> None:
    """Fields of the wrong type or range (a pid the kernel never gives, a time that cannot be printed), duplicate
    keys, a link, a named pipe (which would block the reader) or an oversized file: one error naming the file."""
    make(tmp_path / checkpoint_lock.LOCK)
    for call in (checkpoint_lock.check, checkpoint_lock.acquire):
        with pytest.raises(CheckpointError, match=rf"cfp_lock.json.*{re.escape(message)}.*Fix:.*remove"):
            call(tmp_path)


def _edit_manifest(folder: Path, edit) -> None:
    path = folder / manifest.MANIFEST
    raw = json.loads(path.read_text())
    out = edit(raw)
    path.write_text(out if isinstance(out, str) else json.dumps(raw))


def _first(raw: dict) -> dict:
    return raw["files"][next(iter(raw["files"]))]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda raw: raw.pop("model"), "a format-2 manifest records the model, and this one has none"),
    (lambda raw: raw.__setitem__("model", "gpt_tiny"), "its 'model' is 'gpt_tiny', not a JSON object"),
    (lambda raw: raw.__setitem__("model", None), "its 'model' is None"),
    (lambda raw: raw.__setitem__("state", [1]), "its 'state' is [1]"),
    (lambda raw: raw.__setitem__("writer", 5), "its 'writer' is 5, not a JSON string"),
    (lambda raw: raw.__setitem__("format", True), "format True"),
    (lambda raw: raw.__setitem__("format", 3), "format 3"),
    (lambda raw: raw.__setitem__("files", []), "its 'files' is []"),
    (lambda raw: _first(raw).__setitem__("size", float(_first(raw)["size"])), "not a byte count"),
    (lambda raw: _first(raw).__setitem__("size", True), "not a byte count"),
    (lambda raw: _first(raw).__setitem__("digest", "zz"), "not a blake2b-128 hex digest"),
    (lambda raw: raw["files"].__setitem__("/etc/hostname", {"size": 1, "digest": "0" * 32}), "not a path inside"),
    (lambda raw: raw["files"].__setitem__("../x", {"size": 1, "digest": "0" * 32}), "not a path inside"),
    (lambda raw: json.dumps(raw)[:-1] + ', "model": {}}', "the key 'model' appears twice"),
    (lambda raw: "[]", "it holds a JSON list"),
])
def test_a_manifest_is_read_only_as_a_save_writes_it(tmp_path: Path, edit, message: str) -> None:
    """A manifest edited (a key removed, a field of the wrong type, a file outside the folder, a key given twice)
    is one error naming it, before the model check or anything else reads it."""
    folder = _folder(tmp_path, MEGATRON, 4, model=ModelSpec())
    assert json.loads((folder / manifest.MANIFEST).read_text())["format"] == manifest.FORMAT == 2
    _edit_manifest(folder, edit)
    with pytest.raises(CheckpointError, match=rf"cfp_manifest.json cannot be read \(.*{re.escape(message)}"):
        _check(tmp_path, MEGATRON, model=ModelSpec(num_layers=8))
    assert manifest.read_record(folder) == {}  # the save-time checks see no writer either


def test_a_manifest_or_pointer_that_is_a_named_pipe_does_not_block(tmp_path: Path) -> None:
    folder = _folder(tmp_path, MEGATRON, 4, model=ModelSpec())
    (folder / manifest.MANIFEST).unlink()
    os.mkfifo(folder / manifest.MANIFEST)
    with pytest.raises(CheckpointError, match="cfp_manifest.json is a named pipe"):
        _check(tmp_path, MEGATRON)
    assert manifest.read_record(folder) == {}
    (tmp_path / checkpoint.LATEST).unlink()
    os.mkfifo(tmp_path / checkpoint.LATEST)
    with pytest.raises(CheckpointError, match=r"latest_checkpointed_iteration.txt is a named pipe.*not the pointer"):
        _check(tmp_path, MEGATRON, resume=False)


def _stated(root: Path, scheme: Scheme, state: dict) -> Path:
    folder = _folder(root, scheme, 4, model=ModelSpec())
    _edit_manifest(folder, lambda raw: raw.__setitem__("state", state))
    return folder


def test_a_resume_under_another_precision_is_refused_before_start(tmp_path: Path) -> None:
    folder = _stated(tmp_path, MEGATRON, checkpoint.training_state("fp32"))
    with pytest.raises(CheckpointError, match=r"saved under other training settings than this run's: "
                                              r"train.precision: saved 'fp32', now 'bf16'.*Fix: resume with the saved "
                                              r"values"):
        _check(tmp_path, MEGATRON, state=checkpoint.training_state("bf16"))
    assert _check(tmp_path, MEGATRON, state=checkpoint.training_state("fp32")) == 4
    with pytest.raises(CheckpointError, match="train.precision: saved 'fp32', now 'bf16'"):  # and at the load
        checkpoint.check_state(folder, MEGATRON, checkpoint.training_state("bf16"))


def test_a_resume_under_another_tokenizer_is_refused(tmp_path: Path) -> None:
    """Two tokenizer.json files (the same vocabulary size: the model check passes): the checkpoint's embeddings
    belong to the first; synthetic data records no tokenizer."""
    from cfp_megatron.base.config import DataKind, DataSpec, TokenizerKind

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text('{"model": "a"}')
    second.write_text('{"model": "b"}')

    def data(path: Path | None) -> DataSpec:
        return DataSpec(kind=DataKind.indexed, path=["corpus"], tokenizer=TokenizerKind.huggingface if path
                        else TokenizerKind.byte, tokenizer_path=str(path) if path else None)

    root = tmp_path / "ckpt"
    _stated(root, MEGATRON, checkpoint.training_state("fp32", data(first)))
    assert _check(root, MEGATRON, state=checkpoint.training_state("fp32", data(first))) == 4
    assert _check(root, MEGATRON, state=checkpoint.training_state("fp32", DataSpec())) == 4
    for other, shown in ((second, "'huggingface:"), (None, "'byte'")):
        with pytest.raises(CheckpointError, match=rf"data.tokenizer: saved 'huggingface:[0-9a-f]+', now {shown}"):
            _check(root, MEGATRON, state=checkpoint.training_state("fp32", data(other)))


@pytest.mark.parametrize(("saved", "now", "refused"), [
    ((1, 2), (2, 2), None),  # stages 1 and 2 share their optimizer state's form
    ((1, 2), (0, 2), "backend.zero_stage: saved 1, now 0"),
    ((2, 2), (3, 2), "backend.zero_stage: saved 2, now 3"),
    ((1, 2), (1, 1), "data-parallel ranks: saved 2, now 1"),
    ((3, 4), (3, 2), "data-parallel ranks: saved 4, now 2"),
    ((0, 2), (0, 1), None),  # stage 0 keeps whole states: any data-parallel size
    ((1, 2), (None, 2), None),  # a stage the search will choose: compared when the plan loads it
    ((1, 2), (None, 1), "data-parallel ranks: saved 2, now 1"),
])
def test_a_deepspeed_resume_keeps_what_its_zero_stage_needs(tmp_path: Path, saved: tuple, now: tuple,
                                                            refused: str | None) -> None:
    _stated(tmp_path, ds.SCHEME, ds.training_state("fp32", *saved))
    state = ds.training_state("fp32", *now)
    if refused is None:
        assert _check(tmp_path, ds.SCHEME, state=state) == 4
    else:
        with pytest.raises(CheckpointError, match=rf"{re.escape(refused)}.*settings its state depends on"):
            _check(tmp_path, ds.SCHEME, state=state)
    with pytest.raises(CheckpointError, match="train.precision: saved 'fp32', now 'bf16'"):
        _check(tmp_path, ds.SCHEME, state=ds.training_state("bf16", *saved))


def test_a_planned_deepspeed_resume_keeps_the_saved_zero_stage(tmp_path: Path) -> None:
    """``+cfp=auto`` with no stage pinned: the search keeps the checkpoint's stage (said), rather than choosing one
    whose optimizer state DeepSpeed cannot load; a pinned stage, a hand plan and a fresh run are left as given."""
    from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.planner.deepspeed_launch import DeepSpeedLaunch

    _stated(tmp_path, ds.SCHEME, ds.training_state("fp32", 2, 2))
    job = job_from_config(compose_config(["backend=deepspeed", f"train.checkpoint_dir={tmp_path}",
                                          "train.resume=true"]))
    free, pinned = BackendSpec(name=BackendKind.deepspeed), BackendSpec(name=BackendKind.deepspeed, zero_stage=1)
    notes: list[str] = []
    hooks = DeepSpeedLaunch()
    assert hooks.resumed_backend(job, free, 4, planned=True, note=notes.append).zero_stage == 2
    assert len(notes) == 1 and "global_step4 was saved under ZeRO stage 2: the search keeps it" in notes[0]
    assert hooks.resumed_backend(job, pinned, 4, planned=True, note=notes.append) is pinned
    assert hooks.resumed_backend(job, free, 4, planned=False, note=notes.append) is free
    assert hooks.resumed_backend(job, free, None, planned=True, note=notes.append) is free
    assert len(notes) == 1


def test_a_folder_another_tool_wrote_is_refused_even_when_trusted(tmp_path: Path) -> None:
    """Megatron-LM's older format (``mp_rank_00/model_optim_rng.pt``), loaded with the override: the first read
    before the start is one error naming the folder, not dist_checkpointing's traceback."""
    import torch

    folder = tmp_path / "iter_0000004" / "mp_rank_00"
    folder.mkdir(parents=True)
    torch.save({"iteration": 4}, folder / "model_optim_rng.pt")
    (tmp_path / checkpoint.LATEST).write_text("4\n")
    assert _check(tmp_path, MEGATRON, trust_unverified=True) == 4
    with pytest.raises(CheckpointError, match=r"iter_0000004 cannot be read \(CheckpointingException: .*not a "
                                              r"distributed checkpoint"):
        checkpoint.saved_distributed_optimizer(str(tmp_path), 4)


def test_an_empty_checkpoint_dir_setting_is_refused() -> None:
    """``train.checkpoint_dir=$CK`` with ``CK`` unset: not "no checkpoints", not the current folder; a quoted ``~``
    (which no shell expanded) is refused naming the full path, not saved into a folder named '~'."""
    from cfp_megatron.base.compose import compose_config
    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.base.errors import ConfigError

    for value in ("", "  "):
        with pytest.raises(ConfigError, match=r"train.checkpoint_dir.*is empty \(a shell variable that is not set"):
            job_from_config(compose_config([f"train.checkpoint_dir={value}", "train.save_interval=2"]))
    with pytest.raises(ConfigError, match=rf"train.checkpoint_dir='~/ckpt'.*{Path.home() / 'ckpt'}"):
        job_from_config(compose_config(["train.checkpoint_dir='~/ckpt'"]))


# --- drills: torchrun --------------------------------------------------------------------------------------------
COMMON = ["model=gpt_tiny", "train.global_batch_size=8", "train.micro_batch_size=2", "train.seq_length=64",
          "train.precision=fp32"]


@pytest.mark.drill
def test_the_lost_checkpoint_repro_is_refused_and_resumes_the_newest(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*COMMON, "train.steps=4", "train.save_interval=2", f"train.checkpoint_dir={ckpt}"]
    first = run_train(2, args, tmp_path / "a")
    assert first.returncode == 0, first.output[-3000:]
    assert not (ckpt / checkpoint_lock.LOCK).exists()  # released at the end
    digests = {p.name: manifest.read_manifest(p, "") for p in ckpt.glob("iter_*")}
    (ckpt / checkpoint.LATEST).unlink()
    again = run_train(2, args, tmp_path / "b")
    assert again.returncode != 0 and again.records == []
    assert "already holds checkpoints (Megatron: iter_0000002, iter_0000004" in again.output
    assert {p.name: manifest.read_manifest(p, "") for p in ckpt.glob("iter_*")} == digests
    done = run_train(2, [*args, "train.resume=true"], tmp_path / "c")
    assert done.returncode == 0 and done.records == []
    assert "resuming from" in done.output and "nothing to train" in done.output
    more = run_train(2, [*args[:-3], "train.steps=6", "train.save_interval=2", f"train.checkpoint_dir={ckpt}",
                         "train.resume=true"], tmp_path / "d")
    assert more.returncode == 0, more.output[-3000:]
    assert [r["step"] for r in more.records if r.get("event") == "resume"] == [4]
    assert checkpoint.latest_step(ckpt) == 6


@pytest.mark.drill
def test_a_second_job_on_a_folder_in_use_is_refused_naming_the_first(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    args = [*COMMON, "train.steps=400", "train.save_interval=2", f"train.checkpoint_dir={ckpt}",
            f"hydra.run.dir={tmp_path / 'a'}"]
    first = subprocess.Popen(torchrun_command(2, args), cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not (ckpt / "iter_0000002").exists() and time.monotonic() < deadline and first.poll() is None:
            time.sleep(0.5)
        assert (ckpt / "iter_0000002").exists(), "the first job never saved"
        lock = checkpoint_lock.read_lock(ckpt)
        assert lock is not None
        second = run_train(2, [*COMMON, "train.steps=400", "train.resume=true", f"train.checkpoint_dir={ckpt}"],
                           tmp_path / "b", timeout=240)
        assert second.returncode != 0 and second.records == []
        assert f"pid {lock.pid}" in second.output and "in use by another job" in second.output
        assert first.poll() is None  # the first job trains on, its saves untouched
    finally:
        os.killpg(first.pid, 9)
        first.communicate()


def _without_launcher_traceback(output: str) -> str:
    """``output`` without torchrun's own traceback (its agent's ``ChildFailedError``, printed after the workers)."""
    return re.sub(r"Traceback \(most recent call last\):\n(?:[ \t].*\n|\n)*"
                  r"torch\.distributed\.elastic\.multiprocessing\.errors\.ChildFailedError.*", "", output)


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return done.returncode == 0


@pytest.mark.drill
@pytest.mark.parametrize("backend", ["megatron", "deepspeed"])
def test_a_save_on_a_full_disk_is_one_error_and_keeps_the_previous_checkpoint(tmp_path: Path, backend: str) -> None:
    """A tmpfs that holds one checkpoint but not two: the second save fails on a rank; every rank ends with the one
    error (no hang), the first checkpoint and its pointer stay, no partial folder is left."""
    if backend == "deepspeed":
        pytest.importorskip("deepspeed")
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "5000k"):
        pytest.skip("mounting a tmpfs needs root (CAP_SYS_ADMIN)")
    try:
        extra = ["backend=deepspeed", "backend.zero_stage=1"] if backend == "deepspeed" else []
        ckpt = disk / "ckpt"
        run = run_train(2, [*COMMON, *extra, "train.steps=4", "train.save_interval=2",
                            f"train.checkpoint_dir={ckpt}"], tmp_path / "run", timeout=400)
        assert run.returncode != 0
        assert "cfp-megatron: CheckpointError" in run.output and "the disk is full" in run.output
        assert "Traceback" not in _without_launcher_traceback(run.output)
        scheme = SCHEMES[backend]
        assert checkpoint.read_pointer(ckpt, scheme) == 2
        assert manifest.verify(scheme.step_dir(ckpt, 2), trust_unverified=False, fix="")
        assert not list(ckpt.glob("*.partial"))
    finally:
        subprocess.run(["umount", str(disk)], check=False)
