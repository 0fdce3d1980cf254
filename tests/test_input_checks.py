"""Inputs checked where they enter: a ProfileDB's numbers on every load, a plan file's prediction (hashed and in
range) and its bytes, the exports written beside it, and every place a launch, the profiler or the preflight writes
to, before anything starts. All in-process and quick (no torchrun)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.errors import CfpError, ConfigError
from cfp_megatron.base.files import WriteLocation, check_write_locations, writable_dir_problem
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.plan import Plan, PlanError, PlanPrediction, load_plan, save_plan
from cfp_megatron.plan.artifact import content_hash
from cfp_megatron.plan.exports import EXPORTS_MANIFEST
from cfp_megatron.planner.entry import check_run_dir_arg, train_from_config
from cfp_megatron.planner.launch_plan import resolve_launch_plan
from cfp_megatron.planner.plan_cli import main as plan_main
from cfp_megatron.profile.cli import main as profile_main
from cfp_megatron.profile.db import ProfileDB, db_path, read_db
from cfp_megatron.profile.errors import ProfileFigureError
from cfp_megatron.profile.fingerprint import Fingerprint, current_fingerprint

MEASURED = Path(__file__).resolve().parent / "data" / "profile_gpt_tiny_2ranks_cpu.json"
"""A real ProfileDB: gpt_tiny profiled at launch on 2 gloo ranks of a 2-core CPU (tests/test_launch_plan.py's
two-rank launch), with the negative activation bytes (the embedding under tp2-sp), zero activation bytes (full
recomputation) and zero workspaces a measurement gives."""

PRESET = ["model=gpt_tiny", "cluster=dgx_h100", "train.global_batch_size=16", "+cfp=auto"]
"""A preflight plan that searches in about a second."""


def _measured() -> dict:
    return json.loads(MEASURED.read_text())


def _write(path: Path, data: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


# ------------------------------------------------------------------------------------------------------ ProfileDB


def test_a_measured_profile_loads_with_its_zero_figures() -> None:
    db = read_db(MEASURED)
    assert len(db.segments) == 60 and db.collectives and db.gemms and db.overheads
    # what measuring gives and the checks must let through (the first version of the checks refused the first)
    assert [(s.kind, s.partition) for s in db.segments if s.activation_bytes < 0] == [("embedding", "tp2-sp")] * 2
    assert any(s.activation_bytes == 0.0 for s in db.segments)
    assert any(s.workspace_bytes == 0.0 for s in db.segments)
    assert ProfileDB.from_json(db.to_json()) == db


def _index(data: dict, section: str, **match: object) -> int:
    return next(i for i, r in enumerate(data[section]) if all(r.get(k) == v for k, v in match.items()))


@pytest.mark.parametrize(("section", "match", "field", "value", "label"), [
    ("segments", {"kind": "dense", "partition": "tp1", "micro_batch": 1}, "forward_s", math.nan, "dense tp1 mbs=1"),
    ("segments", {"kind": "dense", "partition": "tp1", "micro_batch": 1}, "backward_s", -0.001, "dense tp1 mbs=1"),
    ("segments", {"kind": "head", "partition": "tp2", "micro_batch": 2}, "forward_s", 0.0, "head tp2 mbs=2"),
    ("segments", {"kind": "dense", "partition": "tp2-full"}, "baseline_s", math.inf, "dense tp2-full"),
    ("segments", {"kind": "dense", "partition": "tp1"}, "forward_s", "fast", "dense tp1"),
    ("segments", {"kind": "dense", "partition": "tp1"}, "transient_bytes", -1.0, "dense tp1"),
    ("overheads", {"partition": "tp1", "layers": 1}, "schedule_s", 0.0, "overheads tp1 L1"),
    ("overheads", {"partition": "tp1", "layers": 1}, "rest_s", -0.5, "overheads tp1 L1"),
    ("gemms", {}, "tflops", math.inf, "gemm fp32"),
    ("collectives", {}, "bandwidth_bytes_per_s", 0.0, "g=2"),
    ("collectives", {}, "latency_s", -1e-3, "g=2"),
    ("rounds", {}, "seconds", math.nan, "round "),
])
def test_a_figure_out_of_range_is_refused_naming_file_record_field_and_fix(
        tmp_path: Path, section: str, match: dict, field: str, value: object, label: str) -> None:
    data = _measured()
    i = _index(data, section, **match)
    data[section][i][field] = value
    path = _write(tmp_path / "db.json", data)
    with pytest.raises(ProfileFigureError) as info:
        read_db(path)
    text = str(info.value)
    assert str(path) in text and f"{section}[{i}] (" in text and label in text
    assert f"{field}={value!r}" in text and "is not a finite number" in text
    assert "-m cfp_megatron.profile" in text and "--force" in text and "delete the file" in text
    err = info.value
    assert err.field == field and (err.value == value or (value != value and err.value != err.value))


def test_a_collective_sample_out_of_range_is_refused() -> None:
    data = _measured()
    data["collectives"][0]["samples"][2][1] = math.nan
    with pytest.raises(ProfileFigureError, match=r"collectives\[0\] .*samples\[2\] seconds=nan"):
        ProfileDB.from_json(data, source="db.json")


def test_a_plan_check_out_of_range_is_refused(tmp_path: Path) -> None:
    data = _measured()
    data["plan_checks"] = [{"model": "m", "plan": "p", "steps": 3, "predicted_step_s": 0.05, "calibration": 1.0,
                            "measured_step_s": math.inf, "predicted_peak_bytes": None, "measured_peak_bytes": None,
                            "time": 1.0}]
    ProfileDB.from_json({**data, "plan_checks": [{**data["plan_checks"][0], "measured_step_s": 0.07}]})
    with pytest.raises(ProfileFigureError, match=r"plan_checks\[0\] \(plan p\): measured_step_s=inf"):
        ProfileDB.from_json(data, source="db.json")


def test_figures_a_measurement_can_give_at_the_edge_of_their_range_load() -> None:
    """Activation bytes are a difference of live bytes (zero, or below under full recomputation); workspaces,
    transients and the rest of a step can be zero; a fit's latency is clamped at zero or above."""
    data = _measured()
    data["segments"][0].update(activation_bytes=-4096.0, workspace_bytes=0.0, transient_bytes=0.0)
    data["overheads"][0]["rest_s"] = 0.0
    data["collectives"][0]["latency_s"] = 0.0
    db = ProfileDB.from_json(data)
    assert db.segments[0].activation_bytes == -4096.0 and db.overheads[0].rest_s == 0.0


def test_a_nan_profile_no_longer_changes_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A NaN forward time of the dense layer made the search pick another layout (tp=2 instead of tp=1 on 4 ranks,
    measured); now the planner's read of this machine's DB refuses it by name."""
    from cfp_megatron.profile.cluster import local_measurements

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    here: Fingerprint = current_fingerprint(world_size=2, nodes=1, backend="gloo")
    data = {**_measured(), "fingerprint": here.to_json(), "fingerprint_key": here.key}
    job = job_from_config(compose_config(["model=gpt_tiny", "train.global_batch_size=16", "train.precision=fp32"]))
    _write(db_path(here), data)
    _, clean = local_measurements(job, world_size=2, backend="gloo")
    assert clean is not None and clean.segment_seconds("dense", "tp1", 1) is not None
    i = _index(data, "segments", kind="dense", partition="tp1", micro_batch=1)
    data["segments"][i]["forward_s"] = math.nan
    _write(db_path(here), data)
    with pytest.raises(ProfileFigureError, match=rf"{db_path(here)}: segments\[{i}\] .*forward_s=nan"):
        local_measurements(job, world_size=2, backend="gloo")


# -------------------------------------------------------------------------------------------------------- plan file


def _plan(step_time_s: float = 0.25) -> Plan:
    job = job_from_config(compose_config(["model=gpt_tiny", "parallel.tp=2", "train.global_batch_size=8"]))
    prediction = PlanPrediction(step_time_s=step_time_s, tokens_per_s_per_gpu=1000.0, mfu=0.25, peak_memory_gib=0.5,
                                bubble_fraction=0.0, exposed_comm_s=0.0)
    return Plan.from_job(job, world_size=4, prediction=prediction, inputs_fingerprint="f00d")


def test_the_prediction_is_inside_the_content_hash() -> None:
    d = _plan().to_json()
    assert d["content_hash"] == content_hash({k: v for k, v in d.items() if k != "content_hash"})
    assert Plan.from_json(d).predicted.step_time_s == 0.25
    d["prediction"]["step_time_s"] = 0.01  # a faster plan, edited in: the layout hash alone did not see it
    with pytest.raises(PlanError, match="plan.json was edited: content hash mismatch"):
        Plan.from_json(d)
    d = _plan().to_json()
    d["inputs_fingerprint"] = "beef"
    with pytest.raises(PlanError, match="content hash mismatch"):
        Plan.from_json(d)


@pytest.mark.parametrize(("field", "value"), [("step_time_s", -0.5), ("step_time_s", math.nan),
                                              ("peak_memory_gib", 0.0), ("tokens_per_s_per_gpu", math.inf),
                                              ("bubble_fraction", 1.5), ("exposed_comm_s", -1.0)])
def test_a_prediction_out_of_range_is_refused_even_when_hashed(field: str, value: float) -> None:
    d = _plan().to_json()
    d["prediction"][field] = value
    d["content_hash"] = content_hash({k: v for k, v in d.items() if k != "content_hash"})  # consistently written
    with pytest.raises(PlanError, match=rf"prediction\.{field}={value!r} is not "):
        Plan.from_json(d)


def test_a_plan_file_from_before_the_content_hash_is_read_with_its_prediction_checked() -> None:
    d = _plan().to_json()
    del d["content_hash"], d["inputs"]  # a version-1 file (version 2 requires the content hash)
    d["schema_version"] = 1
    assert Plan.from_json(d) == dataclasses.replace(_plan(), schema_version=1)
    d["prediction"]["step_time_s"] = -1.0
    with pytest.raises(PlanError, match=r"prediction\.step_time_s=-1.0 is not a finite number above zero"):
        Plan.from_json(d)


@pytest.mark.parametrize(("content", "says"), [
    (b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR\xff\xfe", "not UTF-8 text"),
    (b'{"schema_version": 1, "canonical": "gpt_tiny@localx1x4:tp=2', "not valid JSON.*truncated"),
    (b"", "not valid JSON"),
    (b"[1, 2]", "must hold a JSON object"),
])
def test_a_binary_or_truncated_plan_file_is_a_clear_error(tmp_path: Path, content: bytes, says: str) -> None:
    path = tmp_path / "plan.json"
    path.write_bytes(content)
    with pytest.raises(PlanError, match=says) as info:
        load_plan(path)
    assert str(path) in str(info.value) and "Fix:" in str(info.value)
    with pytest.raises(PlanError, match="is a directory"):
        load_plan(tmp_path)


# -------------------------------------------------------------------------------------------- preflight exports


def _exports(folder: Path) -> dict[str, str]:
    return {n: (folder / n).read_text() for n in ("torchrun.sh", "megatron_args.txt", "deepspeed_config.json")}


def test_a_second_plan_file_in_the_folder_replaces_the_first_plans_exports(tmp_path: Path) -> None:
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert plan_main([*PRESET, f"cfp.plan_file={first}"]) == 0
    before = _exports(tmp_path)
    assert plan_main([*PRESET, "train.global_batch_size=64", f"cfp.plan_file={second}"]) == 0
    after = _exports(tmp_path)
    plan = load_plan(second)
    assert load_plan(first).global_batch_size == 16 and plan.global_batch_size == 64
    assert after != before and "train.global_batch_size=64" in after["torchrun.sh"]
    assert json.loads(after["deepspeed_config.json"])["train_batch_size"] == 64
    assert json.loads((tmp_path / EXPORTS_MANIFEST).read_text())["hash"] == plan.plan_hash()
    assert plan_main([*PRESET, "train.global_batch_size=64", f"cfp.plan_file={second}"]) == 0  # same plan again
    assert _exports(tmp_path) == after


def test_exports_never_overwrite_a_file_cfp_did_not_write(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    mine = tmp_path / "torchrun.sh"
    mine.write_text("#!/bin/sh\n# my own launcher\n")
    target = tmp_path / "plan.json"
    assert plan_main([*PRESET, f"cfp.plan_file={target}"]) == 2
    out = capsys.readouterr().out
    assert "PlanError" in out and str(mine) in out and "move those files away" in out
    assert mine.read_text() == "#!/bin/sh\n# my own launcher\n" and not target.exists()
    assert not (tmp_path / "megatron_args.txt").exists()


def test_preflight_refuses_a_damaged_plan_file_at_its_path(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "plan.json"
    target.write_bytes(b"\x00\x01binary")
    assert plan_main([*PRESET, f"cfp.plan_file={target}"]) == 2
    out = capsys.readouterr().out
    assert "PlanError" in out and str(target) in out and "Traceback" not in out
    assert target.read_bytes() == b"\x00\x01binary"


def test_preflight_refuses_a_plan_file_it_cannot_write_before_searching(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("x")
    assert plan_main([*PRESET, f"cfp.plan_file={tmp_path / 'afile' / 'plan.json'}"]) == 2
    out = capsys.readouterr().out
    assert "cfp.plan_file=" in out and "a file is in the way" in out and "top plans" not in out.lower()


# ------------------------------------------------------------------------------------------------ write locations


def _read_only_folder(tmp_path: Path) -> Path:
    """A folder nothing can be written into: chmod 555, or (as root, who writes anyway) a read-only file system."""
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o555)
    if writable_dir_problem(folder) is None:
        folder = Path("/sys/cfp-input-check")
        if not Path("/sys").is_dir() or writable_dir_problem(folder) is None:
            pytest.skip("no read-only folder here")
    return folder


def test_write_location_checks(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    new = tmp_path / "new" / "deeper"
    check_write_locations([WriteLocation(key="k", path=new, folder=True)])
    assert new.is_dir() and not list(new.iterdir())  # created, the probe removed
    with pytest.raises(ConfigError) as info:
        check_write_locations([WriteLocation(key="a.dir", path=tmp_path / "afile" / "sub", folder=True),
                               WriteLocation(key="a.file", path=tmp_path, folder=False),
                               WriteLocation(key="a.new", path=tmp_path / "afile", folder=False, new=True),
                               WriteLocation(key="a.ro", path=_read_only_folder(tmp_path) / "x", folder=True)])
    assert info.value.keys == ["a.dir", "a.file", "a.new", "a.ro"]
    text = str(info.value)
    assert "a file is in the way" in text and "is a folder, not a file" in text and "never written over" in text


def _launch(*overrides: str) -> None:
    train_from_config(compose_config(["model=gpt_tiny", "train.steps=1", *overrides]))


def test_a_checkpoint_dir_behind_a_file_is_refused_before_training(tmp_path: Path) -> None:
    import torch.distributed as dist

    (tmp_path / "afile").write_text("x")
    with pytest.raises(CfpError, match=r"train.checkpoint_dir='.*afile/ckpt': a file is in the way"):
        _launch(f"train.checkpoint_dir={tmp_path / 'afile' / 'ckpt'}")
    assert not dist.is_initialized()


def test_a_read_only_checkpoint_dir_is_refused_before_training(tmp_path: Path) -> None:
    folder = _read_only_folder(tmp_path)
    with pytest.raises(ConfigError, match=r"train.checkpoint_dir=.*Fix: point train.checkpoint_dir at a folder"):
        _launch(f"train.checkpoint_dir={folder / 'ckpt'}")


def test_a_metrics_file_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train.metrics_file=.*is a folder, not a file"):
        _launch(f"train.metrics_file={tmp_path}")


def test_auto_refuses_a_cache_dir_behind_a_file_before_profiling(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "afile" / "cache"))
    with pytest.raises(ConfigError, match=r"CFP_CACHE_DIR \(environment variable\)=.*a file is in the way"):
        _launch("+cfp=auto")


def test_auto_refuses_an_existing_plan_file_before_profiling(tmp_path: Path) -> None:
    saved = save_plan(_plan(), tmp_path / "mine.json")
    cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "train.global_batch_size=8", f"cfp.plan_file={saved}"])
    env = dataclasses.replace(LaunchEnv.read(), world_size=4)
    with pytest.raises(ConfigError, match=r"cfp.plan_file=.*already exists, and it is never written over"):
        resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, tmp_path / "run")
    assert load_plan(saved) == _plan()


def test_a_run_dir_behind_a_file_is_said_before_hydra_starts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("x")
    for value in (f"{tmp_path / 'afile' / 'run'}", f"{tmp_path / 'afile'}/${{now:%H}}"):
        with pytest.raises(SystemExit) as info:
            check_run_dir_arg(["model=gpt_tiny", f"hydra.run.dir={value}"])
        assert info.value.code == 2
        err = capsys.readouterr().err
        assert "hydra.run.dir=" in err and "a file is in the way" in err
    check_run_dir_arg([f"hydra.run.dir={tmp_path / 'ok'}/${{now:%H}}"])  # the static part is fine: no exit


def test_the_profiler_refuses_an_unwritable_cache_or_export_before_profiling(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "afile"))
    assert profile_main(["model=gpt_tiny", "--budget", "5"]) == 2
    err = capsys.readouterr().err
    assert "CFP_CACHE_DIR (environment variable)" in err and "a file is in the way" in err
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    assert profile_main(["model=gpt_tiny", "--budget", "5", "--export", str(tmp_path / "afile")]) == 2
    err = capsys.readouterr().err
    assert "--export=" in err and "never written over" in err
    assert not os.path.exists(tmp_path / "cache" / "profile" / "rounds")
