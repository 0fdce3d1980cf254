"""Every write atomic and checked (issue R, family 8), and the metrics file never appended to a file cfp-megatron did
not create (family 9). The disks are real: small tmpfs mounts, full or read-only; where this machine cannot mount
(not root, no CAP_SYS_ADMIN) those tests skip, saying so. The commands are called in-process (their ``main``)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.files import (
    CACHE_ENV,
    FileWriteError,
    WriteLocation,
    append_record,
    check_write_locations,
    write_atomic,
)
from cfp_megatron.engine.metrics import METRICS_KIND, MetricsLog, StepMetrics

MOUNT_SIZE = "64k"
"""Size of each tmpfs: a few pages."""


@dataclass(frozen=True, kw_only=True)
class Disks:
    """Three small tmpfs mounts."""

    full: Path
    """Every byte taken (a file of zeros fills it; files can still be created, empty)."""
    read_only: Path
    """Mounted read-only; holds ``kept.json`` (written before the remount)."""
    small: Path
    """Empty, with :data:`MOUNT_SIZE` free: what writes more than that fills it half-way."""


def _mount(folder: Path, options: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                              text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        pytest.skip(f"cannot mount a tmpfs here ({err}): full and read-only disks need root with CAP_SYS_ADMIN")
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): full and read-only "
                    "disks need root with CAP_SYS_ADMIN")


def _fill(folder: Path) -> None:
    """Write zeros into ``folder`` until its disk is full."""
    with open(folder / "filler", "ab", buffering=0) as fh:
        try:
            while True:
                fh.write(b"\0" * 4096)
        except OSError as err:
            assert err.errno == errno.ENOSPC


@pytest.fixture
def disks(tmp_path: Path) -> Iterator[Disks]:
    mounted: list[Path] = []
    try:
        full, read_only, small = tmp_path / "full", tmp_path / "ro", tmp_path / "small"
        for folder in (full, read_only, small):
            _mount(folder, f"size={MOUNT_SIZE}")
            mounted.append(folder)
        _fill(full)
        (read_only / "kept.json").write_text('{"kept": true}\n')
        remount = subprocess.run(["mount", "-o", "remount,ro", str(read_only)], capture_output=True, text=True,
                                 timeout=30, check=False)
        if remount.returncode != 0:
            pytest.skip(f"cannot remount a tmpfs read-only here ({remount.stderr.strip()})")
        yield Disks(full=full, read_only=read_only, small=small)
    finally:
        for folder in reversed(mounted):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True, timeout=30, check=False)


def _files(folder: Path) -> list[str]:
    """The files under ``folder`` (the filler aside): what a refused write left behind."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != "filler")


# ----------------------------------------------------------------------------------------------------- the helpers


def test_a_refused_atomic_write_keeps_the_earlier_file(disks: Disks) -> None:
    target = disks.small / "result.json"
    target.write_text('{"earlier": 1}\n')
    with pytest.raises(FileWriteError, match=r"result.json \(--json\) cannot be written: the disk is full\. Fix: "
                                             r"free space .* or point --json at another folder"):
        write_atomic(target, "x" * 200_000, key="--json")  # more than the disk holds: it fills half-way
    assert target.read_text() == '{"earlier": 1}\n'
    assert _files(disks.small) == ["result.json"]  # no temporary left
    with pytest.raises(FileWriteError, match=r"\(--json\) cannot be written: the file system is read-only"):
        write_atomic(disks.read_only / "kept.json", "new", key="--json")
    assert (disks.read_only / "kept.json").read_text() == '{"kept": true}\n'


def test_a_full_disk_is_found_before_the_work(disks: Disks) -> None:
    with pytest.raises(ConfigError) as found:
        check_write_locations([WriteLocation(key="hydra.run.dir", path=disks.full / "run", folder=True),
                               WriteLocation(key="--json", path=disks.read_only / "a.json", folder=False)])
    text = str(found.value)
    assert "hydra.run.dir=" in text and "the disk is full" in text and "on a disk with free space" in text
    assert "--json=" in text and "the file system is read-only" in text


# ------------------------------------------------------------------------------------------------ the metrics file


def _step(step: int) -> StepMetrics:
    return StepMetrics(step=step, loss=2.0, lr=1e-3, grad_norm=1.0, applied=True, step_time_s=0.1,
                       tokens_per_s=100.0, tflops_per_rank=0.01, mfu=0.01)


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_metrics_file_begins_with_its_header_and_a_resumed_run_continues_it(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    MetricsLog(path, enabled=True).event("start", steps=2)
    log = MetricsLog(path, enabled=True)  # a resumed run: the same file
    log.event("resume", step=1)
    log.step(_step(2), total=2)
    records = _records(path)
    assert records[0]["kind"] == METRICS_KIND and records[0]["event"] == "header"
    assert [r["event"] for r in records] == ["header", "start", "resume", "step"]  # one header only
    empty = tmp_path / "empty.jsonl"
    empty.touch()
    MetricsLog(empty, enabled=True).event("start")
    assert [r["event"] for r in _records(empty)] == ["header", "start"]


@pytest.mark.parametrize("content", ["my notes\n", '{"event": "step", "loss": 1}\n', "\n{}", '{"kind": "other"}\n'])
def test_a_file_cfp_megatron_did_not_create_is_never_appended_to(tmp_path: Path, content: str) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text(content)
    from cfp_megatron.base.cfp_spec import cfp_from_config
    from cfp_megatron.planner.launch_plan import write_locations

    cfg = compose_config(["model=gpt_tiny", f"train.metrics_file={notes}"])
    job = job_from_config(cfg)
    with pytest.raises(ConfigError, match=r"train.metrics_file='.*notes.txt': the file exists and cfp-megatron did "
                                          r"not write it .* Fix: point train.metrics_file at another file"):
        check_write_locations(write_locations(job, cfp_from_config(cfg), None))
    with pytest.raises(FileWriteError, match="did not write it"):  # and a writer that gets there anyway refuses
        append_record(notes, {"event": "start"}, kind=METRICS_KIND, key="train.metrics_file")
    assert notes.read_text() == content


def test_a_named_pipe_as_the_metrics_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    location = WriteLocation(key="train.metrics_file", path=fifo, folder=False, own_kind=METRICS_KIND)
    with pytest.raises(ConfigError, match=r"is a named pipe, not a file: appending to it could wait forever"):
        check_write_locations([location])
    with pytest.raises(FileWriteError, match=r"metrics.fifo \(train.metrics_file\) cannot be written"):
        append_record(fifo, {"event": "start"}, kind=METRICS_KIND, key="train.metrics_file")  # no reader: no wait
    check_write_locations([WriteLocation(key="train.metrics_file", path=Path(os.devnull), folder=False,
                                         own_kind=METRICS_KIND)])  # /dev/null: metrics thrown away, as asked


def test_a_user_file_is_refused_by_a_launch_before_any_process_group(tmp_path: Path) -> None:
    import torch.distributed as dist

    from cfp_megatron.planner.entry import train_from_config

    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    with pytest.raises(ConfigError, match=r"train.metrics_file=.*cfp-megatron did not write it"):
        train_from_config(compose_config(["model=gpt_tiny", "train.steps=1", f"train.metrics_file={notes}",
                                          f"hydra.run.dir={tmp_path / 'run'}"]))
    assert not dist.is_initialized()
    assert notes.read_text() == "my notes\n"


def test_a_disk_full_mid_training_stops_the_metrics_file_with_one_warning(disks: Disks,
                                                                           capsys: pytest.CaptureFixture) -> None:
    path = disks.small / "metrics.jsonl"
    log = MetricsLog(path, enabled=True)
    step = 0
    while log.failed is None:
        step += 1
        log.event("note", padding="x" * 1500)  # fills the 64 KiB disk within a few dozen records
        assert step < 100
    for later in range(3):
        log.step(_step(later), total=3)  # not written, not warned again: no gap in the file
    err = capsys.readouterr().err
    assert err.count("the metrics file stops here") == 1 and "training goes on" in err
    assert "(train.metrics_file) cannot be written: the disk is full" in err
    records = _records(path)  # whole lines only: the short write was undone
    assert records[0]["kind"] == METRICS_KIND and len(records) == step  # the header and step - 1 notes
    assert all(r["event"] != "step" for r in records)


def test_a_metrics_file_on_a_read_only_disk_is_one_warning(disks: Disks, capsys: pytest.CaptureFixture) -> None:
    log = MetricsLog(disks.read_only / "metrics.jsonl", enabled=True)
    log.event("start")
    log.event("end")
    err = capsys.readouterr().err
    assert err.count("the metrics file stops here") == 1 and "the file system is read-only" in err
    assert not (disks.read_only / "metrics.jsonl").exists()


# ------------------------------------------------------------------------------------------------------ commands


def test_plan_out_on_a_full_or_read_only_disk(disks: Disks, capsys: pytest.CaptureFixture) -> None:
    from cfp_megatron.planner.plan_cli import main as plan_main

    for folder, reason in ((disks.full, "the disk is full"), (disks.read_only, "the file system is read-only")):
        assert plan_main(["--world", "2", "--out", str(folder / "plans")]) == 2
        out = " ".join(capsys.readouterr().out.split())
        assert "--out=" in out and reason in out and "Traceback" not in out
    assert _files(disks.full) == []


def test_plan_files_on_a_disk_that_fills_name_the_option_and_leave_nothing(disks: Disks) -> None:
    from cfp_megatron.plan import PlanPrediction, save_plan
    from cfp_megatron.plan.artifact import Plan
    from cfp_megatron.plan.exports import write_exports

    job = job_from_config(compose_config(["model=gpt_tiny", "parallel.tp=2", "train.global_batch_size=8"]))
    prediction = PlanPrediction(step_time_s=0.25, tokens_per_s_per_gpu=1000.0, mfu=0.25, peak_memory_gib=0.5,
                                bubble_fraction=0.0, exposed_comm_s=0.0)
    plan = Plan.from_job(job, world_size=4, prediction=prediction, inputs_fingerprint="f00d")
    with pytest.raises(FileWriteError, match=r"plan.json \(--out\) cannot be written: the disk is full"):
        save_plan(plan, disks.full / "p" / "plan.json", key="--out")
    with pytest.raises(FileWriteError, match=r"\(cfp.plan_file\) cannot be written: the file system is read-only"):
        save_plan(plan, disks.read_only / "plan.json")
    with pytest.raises(FileWriteError, match=r"\(--out\) cannot be written: the disk is full"):
        write_exports(disks.full / "p", {"torchrun.sh": "x" * 100_000}, plan=plan, key="--out")
    assert _files(disks.full) == []


def test_analyze_json_on_a_full_disk_keeps_the_earlier_result(disks: Disks, capsys: pytest.CaptureFixture,
                                                             monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cfp_megatron.analyze import main as analyze_main

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    earlier = disks.small / "analysis.json"
    text = json.dumps({"model": "gpt_tiny", "seq_length": 64, "mesh": {}, "runs": [], "options": []})
    earlier.write_text(text)  # an earlier analysis: what --json replaces
    _fill(disks.small)
    assert analyze_main(["--json", str(earlier)]) == 2
    err = capsys.readouterr().err
    assert f"--json {earlier}" in err and "the disk is full" in err and "Traceback" not in err
    assert earlier.read_text() == text


def test_analyze_json_never_replaces_a_file_that_is_not_an_analysis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture) -> None:
    from cfp_megatron.analyze import main as analyze_main

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    assert analyze_main(["--json", str(notes)]) == 2
    assert "exists and is not an analysis written by analyze --json; it is left as it is" in capsys.readouterr().err
    assert notes.read_text() == "my notes\n"
    from cfp_megatron.analyze import RESULT_KEYS
    from cfp_megatron.base.files import own_json_problem

    earlier = tmp_path / "analysis.json"
    earlier.write_text(json.dumps(dict.fromkeys(RESULT_KEYS, 1)))
    assert own_json_problem(earlier, "--json", RESULT_KEYS, "an analysis") is None  # an earlier analysis: replaced


def test_preprocess_on_a_disk_that_fills_leaves_no_dataset(disks: Disks, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture) -> None:
    from cfp_megatron.data.preprocess import main as preprocess_main

    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": f"document {i} " * 20}) + "\n" for i in range(2000)))
    assert preprocess_main(["--input", str(corpus), "--output-prefix", str(disks.small / "data" / "c")]) == 2
    err = capsys.readouterr().err
    assert "c.bin (--output-prefix) cannot be written: the disk is full" in err and "Traceback" not in err
    assert _files(disks.small) == []  # no .bin/.idx, no temporaries
    assert preprocess_main(["--input", str(corpus), "--output-prefix", str(disks.read_only / "c")]) == 2
    assert "--output-prefix=" in capsys.readouterr().err
    unreadable = tmp_path / "folder.jsonl"
    unreadable.mkdir()
    assert preprocess_main(["--input", str(unreadable), "--output-prefix", str(tmp_path / "out")]) == 2


def _indexed_job(prefix: str, cache_dir: str | None = None, steps: int = 4):
    from cfp_megatron.base.config import DataKind, DataSpec, JobSpec, ModelSpec, TrainSpec

    return JobSpec(model=ModelSpec(vocab_size=257), train=TrainSpec(global_batch_size=8, micro_batch_size=2,
                                                                   seq_length=32, steps=steps),
                   data=DataSpec(kind=DataKind.indexed, path=[prefix], cache_dir=cache_dir))


def _corpus(folder: Path) -> str:
    from cfp_megatron.data.preprocess import preprocess
    from cfp_megatron.data.tokenizer import ByteTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "c.txt").write_text("\n\n".join(f"document {i} " * 8 for i in range(40)))
    preprocess(str(folder / "c.txt"), str(folder / "c"), tokenizer=ByteTokenizer())
    return str(folder / "c")


def test_megatrons_index_cache_on_a_read_only_disk_is_refused_unless_prepared(tmp_path: Path) -> None:
    from cfp_megatron.data.batches import build_micro_batches
    from cfp_megatron.data.indexed import validate_indexed

    disk = tmp_path / "data-disk"
    _mount(disk, "size=1m")
    try:
        prepared, bare = _corpus(disk / "prepared"), _corpus(disk / "bare")
        next(build_micro_batches(_indexed_job(prepared), dp_rank=0, dp_size=1))  # its index cache beside the data
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True, timeout=30)
        next(build_micro_batches(_indexed_job(prepared), dp_rank=0, dp_size=1))  # read, not written: it runs
        with pytest.raises(ConfigError) as err:
            validate_indexed(_indexed_job(bare))  # before any process group: nothing built
        assert err.value.keys == ["data.cache_dir"]
        assert f"into {bare}/cache/GPTDataset_indices (data.cache_dir is unset" in str(err.value)
        assert "the file system is read-only" in str(err.value)
        validate_indexed(_indexed_job(bare, cache_dir=str(tmp_path / "cache")))  # the fix
    finally:
        subprocess.run(["umount", "-l", str(disk)], capture_output=True, timeout=30, check=False)


def test_megatrons_index_cache_on_a_disk_that_fills_is_one_error_and_no_truncated_index(
        disks: Disks, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy

    from cfp_megatron.data import index_cache
    from cfp_megatron.data.batches import build_micro_batches

    prefix = _corpus(tmp_path / "data")
    with pytest.raises(ConfigError) as err:  # full: refused before the build
        build_micro_batches(_indexed_job(prefix, str(disks.full / "cache")), dp_rank=0, dp_size=1)
    assert err.value.keys == ["data.cache_dir"] and "the disk is full" in str(err.value)
    _fill(disks.small)
    os.truncate(disks.small / "filler", (disks.small / "filler").stat().st_size - 8192)  # room for the first files
    cache = disks.small / "cache"
    with pytest.raises(ConfigError) as err:  # less room than the index takes: refused before the build too
        build_micro_batches(_indexed_job(prefix, str(cache), steps=200), dp_rank=0, dp_size=1)
    assert "bytes free and the index takes up to" in str(err.value) and not list(cache.glob("*.npy"))
    # another writer fills the disk between the check and the save: the save is one error, no truncated index
    monkeypatch.setattr(index_cache, "cache_bytes", lambda job, splits: dict.fromkeys([cache], 0))
    with pytest.raises(FileWriteError, match=r"\(data.cache_dir\) cannot be written: the disk is full") as info:
        build_micro_batches(_indexed_job(prefix, str(cache), steps=200), dp_rank=0, dp_size=1)
    assert info.value.path.parent == cache
    saved = sorted(cache.glob("*.npy"))
    assert saved and all(numpy.load(p, allow_pickle=True).size > 0 for p in saved)  # whole files, or none
    assert not list(cache.glob(".*"))  # no temporaries
    os.remove(disks.small / "filler")
    next(build_micro_batches(_indexed_job(prefix, str(cache), steps=200), dp_rank=0, dp_size=1))  # rebuilt


def test_megatrons_wrapper_of_rank_zeros_cache_error_is_unwrapped(tmp_path: Path) -> None:
    import errno as codes

    from cfp_megatron.base.config import DataKind, DataSpec
    from cfp_megatron.data.index_cache import atomic_index_cache

    data = DataSpec(kind=DataKind.indexed, path=[str(tmp_path / "c")], cache_dir=str(tmp_path / "cache"))
    full = OSError(codes.ENOSPC, "No space left on device", str(tmp_path / "cache" / "x-description.txt"))
    with pytest.raises(FileWriteError, match=r"x-description.txt \(data.cache_dir\) cannot be written: the disk"):
        with atomic_index_cache(data):  # what BlendedMegatronDatasetBuilder raises under torch.distributed
            raise Exception("Failed to write dataset materials to the data cache directory.") from full
    with pytest.raises(ValueError, match="not a disk"), atomic_index_cache(data):
        raise ValueError("not a disk error")  # anything else goes through untouched


def test_profile_db_store_export_and_lock(disks: Disks, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from cfp_megatron.profile.db import ProfileDB, db_path, export_db, lock_path, store_db
    from cfp_megatron.profile.errors import ProfileDBError
    from cfp_megatron.profile.fingerprint import Fingerprint

    fp = Fingerprint(device_name="Test CPU", device_count=2, nodes=1, gpus_per_node=2, backend="gloo",
                     torch="2.13.0", megatron_core="0.16.1", cpu_cores=2)
    db = ProfileDB(fingerprint=fp)
    monkeypatch.setenv(CACHE_ENV, str(disks.full / "cache"))
    with pytest.raises(FileWriteError, match=r"\(CFP_CACHE_DIR \(environment variable\)\) cannot be written: the "
                                             "disk is full"):
        store_db(db)
    monkeypatch.setenv(CACHE_ENV, str(disks.read_only / "cache"))
    with pytest.raises(ProfileDBError, match="cannot be created .*Fix: point CFP_CACHE_DIR at a folder"):
        store_db(db)
    with pytest.raises(FileWriteError, match=r"db.json \(--export\) cannot be written: the disk is full"):
        export_db(db, disks.full / "db.json")
    assert _files(disks.full) == [f"cache/profile/{fp.key}.json.lock"]  # the lock (empty, kept), no DB
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    lock_path(db_path(fp)).mkdir(parents=True)  # family 11: a lock path that is a folder
    with pytest.raises(ProfileDBError, match=r"the ProfileDB's lock file is a folder.*Fix: move that folder away"):
        store_db(db)
    assert not db_path(fp).exists()


def test_profile_export_on_a_read_only_disk_is_refused_before_profiling(disks: Disks, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    from cfp_megatron.profile.cli import main as profile_main

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    assert profile_main(["model=gpt_tiny", "--export", str(disks.read_only / "db.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--export=" in err and "the file system is read-only" in err


def test_pictures_on_a_full_disk(disks: Disks) -> None:
    from cfp_megatron.plan.plots import write_check_png
    from cfp_megatron.profile.records import PlanCheckRecord
    from cfp_megatron.sim.simulate import simulate
    from cfp_megatron.sim.timeline import write_chrome_trace, write_png

    job = job_from_config(compose_config(["model=gpt_tiny", "cluster=dgx_a100", "parallel.pp=2"]))
    prediction = simulate(job, job.cluster, None, world_size=8, with_events=True)
    with pytest.raises(FileWriteError, match=r"t.png \(--out\) cannot be written: the disk is full"):
        write_png(prediction, disks.full / "t.png", key="--out")
    with pytest.raises(FileWriteError, match=r"t.json cannot be written: the file system is read-only"):
        write_chrome_trace(prediction, disks.read_only / "t.json")
    record = PlanCheckRecord(model="m", plan="p", steps=4, predicted_step_s=0.1, calibration=1.0, measured_step_s=0.1,
                             predicted_peak_bytes=None, measured_peak_bytes=None, time=0.0)
    with pytest.raises(FileWriteError, match="check.png cannot be written: the disk is full"):
        write_check_png(record, disks.full / "check.png")
    assert _files(disks.full) == []


def test_plan_pictures_on_a_full_disk_are_one_line(disks: Disks) -> None:
    from cfp_megatron.plan import PlanPrediction
    from cfp_megatron.plan.artifact import Plan
    from cfp_megatron.planner.pictures import write_plan_pictures

    job = job_from_config(compose_config(["model=gpt_tiny", "cluster=dgx_a100", "parallel.pp=2"]))
    prediction = PlanPrediction(step_time_s=0.25, tokens_per_s_per_gpu=1000.0, mfu=0.25, peak_memory_gib=0.5,
                                bubble_fraction=0.0, exposed_comm_s=0.0)
    plan = Plan.from_job(job, world_size=8, prediction=prediction, inputs_fingerprint="f00d")
    lines = write_plan_pictures(plan, job, 8, None, disks.full, key="--out")
    assert any("not drawn (FileWriteError:" in line and "(--out) cannot be written: the disk is full" in line
               for line in lines), lines
    assert _files(disks.full) == []


def test_a_full_run_folder_is_refused_before_hydra(disks: Disks, capsys: pytest.CaptureFixture) -> None:
    from cfp_megatron.planner.entry import check_run_dir_arg

    with pytest.raises(SystemExit) as ended:
        check_run_dir_arg([f"hydra.run.dir={disks.full / 'run'}"])
    assert ended.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "hydra.run.dir=" in err and "the disk is full" in err


def test_the_rank_reports_folder_on_a_read_only_disk(disks: Disks, monkeypatch: pytest.MonkeyPatch) -> None:
    import tempfile

    from cfp_megatron.graph.blocks import _rank_folder

    # Python's gettempdir() passes over a TMPDIR it cannot write when it first looks; one that turns read-only or
    # fills up later is the ranks' folder's to report
    monkeypatch.setattr(tempfile, "tempdir", str(disks.read_only))
    with pytest.raises(FileWriteError, match=r"\(TMPDIR \(environment variable\)\) cannot be written: the file "
                                             "system is read-only"), _rank_folder():
        pass
    monkeypatch.setattr(tempfile, "tempdir", str(disks.full))
    with pytest.raises(FileWriteError, match="the disk is full"), _rank_folder():
        pass
    assert _files(disks.full) == []
    assert os.listdir(disks.full) == ["filler"]


# ------------------------------------------------------------------------------------------------------ catalogue


def test_a_disk_case_that_cannot_mount_is_counted_as_skipped_not_clear(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("bad_inputs", Path(__file__).resolve().parent.parent / "bench"
                                                  / "bad_inputs.py")
    assert spec is not None and spec.loader is not None
    bad_inputs = sys.modules.get("bad_inputs") or importlib.util.module_from_spec(spec)
    if "bad_inputs" not in sys.modules:
        sys.modules["bad_inputs"] = bad_inputs
        spec.loader.exec_module(bad_inputs)
    case = next(c for c in bad_inputs.cases() if c.id == "disk-plan-out-full")
    monkeypatch.setenv("PATH", str(tmp_path))  # no `mount` here: as on a machine that does not allow mounting
    (verdict,) = bad_inputs.run_cases([case], tmp_path, echo=False)
    assert verdict.outcome == bad_inputs.SKIPPED and "cannot mount a tmpfs here" in verdict.message
    assert bad_inputs.totals_line([verdict]).endswith("0 silent, 1 skipped (cannot run on this machine)")


# ---------------------------------------------------------------------------------------------------- drills


def _torchrun(args: list[str], cache: Path, timeout_s: float = 300.0) -> subprocess.CompletedProcess:
    import socket
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, CACHE_ENV: str(cache)}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", f"--master_port={port}", *args],
                          cwd=Path(__file__).resolve().parent.parent, env=env, capture_output=True, text=True,
                          timeout=timeout_s, check=False)


@pytest.mark.drill
def test_training_goes_on_when_the_metrics_disk_fills(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    _mount(tiny, "size=4k")
    try:
        run = _torchrun(["--nproc_per_node=1", "launch/train.py", "train.steps=14",
                         f"train.metrics_file={tiny / 'metrics.jsonl'}", f"hydra.run.dir={tmp_path / 'run'}"],
                        tmp_path / "cache")
        output = run.stdout + run.stderr
        assert run.returncode == 0, output[-3000:]
        assert output.count("the metrics file stops here") == 1 and "end | step 14" in output
        records = _records(tiny / "metrics.jsonl")  # whole lines only
        assert records[0]["kind"] == METRICS_KIND and records[-1]["event"] == "step" and records[-1]["step"] < 14
    finally:
        subprocess.run(["umount", "-l", str(tiny)], capture_output=True, timeout=30, check=False)


@pytest.mark.drill
def test_a_profile_store_on_a_disk_that_fills_is_one_message_on_two_ranks(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny"
    _mount(tiny, "size=4k")
    try:
        run = _torchrun(["--nproc_per_node=2", "-m", "cfp_megatron.profile", "model=gpt_tiny", "--budget", "20"],
                        tiny)
        output = run.stdout + run.stderr
        assert run.returncode != 0
        assert output.count("(CFP_CACHE_DIR (environment variable)) cannot be written: the disk is full") == 1
        assert "[rank1]: Traceback" not in output and "Connection closed by peer" not in output, output[-3000:]
        assert not list((tiny / "profile").glob("*.json"))  # the lock only, no half-written DB
    finally:
        subprocess.run(["umount", "-l", str(tiny)], capture_output=True, timeout=30, check=False)


def test_deepspeed_engine_probes_that_cannot_be_stored_are_said_and_kept(disks: Disks, monkeypatch: pytest.MonkeyPatch,
                                                                        capsys: pytest.CaptureFixture) -> None:
    import torch.distributed as dist
    from rich.console import Console

    import cfp_megatron.engine.distributed as distributed
    from cfp_megatron.base.launch_env import LaunchEnv
    from cfp_megatron.planner import deepspeed_launch

    class Probes:  # what run_probes returns, as far as the store needs it
        stages = (0, 1)

        def to_json(self) -> dict:
            return {"stages": [0, 1], "padding": "x" * 100_000}

    probes = Probes()
    monkeypatch.setenv(CACHE_ENV, str(disks.small))
    monkeypatch.setattr(dist, "broadcast_object_list", lambda box, src: None)
    monkeypatch.setattr(distributed, "init_distributed", lambda *args: None)
    monkeypatch.setattr(distributed, "destroy_model_parallel_groups", lambda: None)
    monkeypatch.setattr(deepspeed_launch, "run_probes", lambda *args, **kwargs: probes)
    env = LaunchEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, restart_count=0, under_torchrun=False)
    job = job_from_config(compose_config(["model=gpt_tiny"]))
    found = deepspeed_launch._engine_probes(job, env, "f00d", Console(highlight=False), on_gpu=False)
    assert found is probes  # the launch goes on with the probes it measured
    out = " ".join(capsys.readouterr().out.split())
    assert "not stored, the next launch probes again" in out and "(CFP_CACHE_DIR (environment variable)) cannot be " \
        "written: the disk is full" in out
    assert _files(disks.small) == []
