"""ProfileDB, fits, fingerprints and group patterns: pure tests (no process group)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from cfp_megatron.base.config import ClusterSpec
from cfp_megatron.cluster.measured import Collective, Span, partition_name
from cfp_megatron.profile.cluster import measured_cluster
from cfp_megatron.profile.collectives import group_patterns
from cfp_megatron.profile.db import SCHEMA_VERSION, ProfileDB, db_path, export_db, load_db, read_db, store_db
from cfp_megatron.profile.errors import FingerprintMismatchError, ProfileDBError, ProfileError, SchemaVersionError
from cfp_megatron.profile.fingerprint import Fingerprint
from cfp_megatron.profile.fit import fit_collective
from cfp_megatron.profile.records import (
    CollectiveRecord,
    GemmRecord,
    RoundRecord,
    RoundStatus,
    SegmentRecord,
)

FP = Fingerprint(device_name="Test CPU", device_count=4, nodes=1, gpus_per_node=4, backend="gloo", torch="2.13.0",
                 megatron_core="0.16.1", cpu_cores=2)


def _db() -> ProfileDB:
    fit = fit_collective(Collective.send_recv, 2, Span.intra_node, [(1000, 2e-5), (1_000_000, 1.1e-3)])
    rec = CollectiveRecord(fit=fit, samples=((1000, 2e-5), (1_000_000, 1.1e-3)), pattern="contiguous")
    gemms = [GemmRecord(m=m, n=m, k=m, dtype="fp32", tflops=m / 1000, seconds=1.0) for m in (64, 256, 1024)]
    seg = SegmentRecord(model="abc", model_name="gpt_tiny", segment="5933c33a899f", kind="dense",
                        partition=partition_name(2), tp=2, micro_batch=1, seq_length=64, forward_s=0.01,
                        backward_s=0.02, confirmed=True)
    rounds = [RoundRecord(name="gemm", status=RoundStatus.timeout, reason="budget", steps_done=3, steps_planned=27)]
    return ProfileDB(fingerprint=FP).merged(collectives=[rec], gemms=gemms, segments=[seg], rounds=rounds)


def test_fit_recovers_latency_and_bandwidth() -> None:
    latency, bandwidth = 5e-5, 2e9
    points = [(b, latency + b / bandwidth) for b in (4096, 65536, 1 << 20, 1 << 22)]
    fit = fit_collective(Collective.all_reduce, 4, Span.intra_node, points)
    assert fit.latency_s == pytest.approx(latency, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=1e-6)
    assert fit.points == 4 and fit.max_rel_error < 1e-9
    assert fit.seconds(1 << 20) == pytest.approx(latency + (1 << 20) / bandwidth)


def test_fit_keeps_latency_positive_and_reports_error() -> None:
    # noisy small messages pull the intercept below zero: it is clamped and the slope refitted
    fit = fit_collective(Collective.all_gather, 2, Span.intra_node, [(1000, 1e-7), (1_000_000, 1e-3),
                                                                    (2_000_000, 2.5e-3)])
    assert fit.latency_s > 0 and fit.bandwidth_bytes_per_s > 0 and fit.max_rel_error > 0
    with pytest.raises(ProfileError, match="two or more"):
        fit_collective(Collective.all_gather, 2, Span.intra_node, [(1000, 1e-5)])


def test_db_round_trip_and_measurements(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    db = _db()
    path = store_db(db)
    assert path == db_path(FP) and path.parent == tmp_path / "profile"
    loaded = load_db(FP)
    assert loaded == db
    fit = loaded.collective(Collective.send_recv, 2, Span.intra_node)
    assert fit is not None and fit.latency_s > 0 and fit.bandwidth_bytes_per_s > 0
    assert loaded.collective(Collective.all_reduce, 2, Span.intra_node) is None
    assert loaded.peak_tflops("fp32") == pytest.approx(1.024)
    assert loaded.peak_tflops("bf16") is None
    assert loaded.gemm_tflops(256, 256, 256, "fp32") == pytest.approx(0.256)
    between = loaded.gemm_tflops(128, 128, 128, "fp32")
    assert 0.064 < between < 0.256
    assert loaded.segment_seconds("5933c33a899f", "tp2", 1) == (0.01, 0.02)
    assert loaded.segment_seconds("dense", "tp2", 1) == (0.01, 0.02)  # kind name, the only model in the DB
    assert loaded.segment_seconds("dense", "tp4", 1) is None
    assert loaded.rounds[0].status is RoundStatus.timeout
    assert not list(tmp_path.glob("profile/*.tmp"))  # the atomic write left no temporary file


def test_other_fingerprint_never_reads_the_db(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    store_db(_db())
    other = dataclasses.replace(FP, device_count=2, gpus_per_node=2)
    assert other.key != FP.key
    assert load_db(other) is None
    with pytest.raises(FingerprintMismatchError, match="device_count"):
        read_db(db_path(FP), expected=other)


def test_fingerprint_leaves_out_host_and_time() -> None:
    names = {f.name for f in dataclasses.fields(Fingerprint)}
    assert not names & {"hostname", "host", "time", "timestamp"}
    assert Fingerprint.from_json(FP.to_json()).key == FP.key


def test_schema_errors(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    path = store_db(_db())
    data = json.loads(path.read_text())
    data["schema_version"] = SCHEMA_VERSION + 1
    path.write_text(json.dumps(data))
    with pytest.raises(SchemaVersionError, match="schema version") as err:
        load_db(FP)
    assert err.value.found == SCHEMA_VERSION + 1
    data["schema_version"] = SCHEMA_VERSION
    del data["gemms"]
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileDBError, match="malformed"):
        load_db(FP)
    path.write_text("{not json")
    with pytest.raises(ProfileDBError, match="not JSON"):
        load_db(FP)


def test_export_never_overwrites_a_users_file(tmp_path) -> None:
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    with pytest.raises(ProfileDBError, match="exists"):
        export_db(_db(), mine)
    assert mine.read_text() == "my notes"
    assert read_db(export_db(_db(), tmp_path / "copy.json"), expected=FP) == _db()


def test_group_patterns_intra_and_inter_node() -> None:
    one = group_patterns(4, 1)
    assert [(p.size, p.span, p.layout) for p in one] == [(2, Span.intra_node, "contiguous"),
                                                         (4, Span.intra_node, "contiguous")]
    two = group_patterns(8, 2)
    found = {(p.size, p.span): p for p in two}
    assert found[(2, Span.intra_node)].groups[0] == (0, 1)
    assert found[(2, Span.inter_node)].groups[0] == (0, 4)  # strided: one rank per node
    assert found[(8, Span.inter_node)].layout == "contiguous"
    assert (8, Span.intra_node) not in found


def test_measured_cluster_replaces_figures() -> None:
    spec = ClusterSpec(name="local")
    filled = measured_cluster(spec, _db(), gpus_per_node=4)
    fit = _db().collective(Collective.send_recv, 2, Span.intra_node)
    assert filled.peak_tflops_fp32 == pytest.approx(1.024)
    assert filled.intra_node_bandwidth_gbps == pytest.approx(fit.bandwidth_bytes_per_s / 1e9)
    assert filled.intra_node_latency_us == pytest.approx(fit.latency_s * 1e6)
    assert filled.inter_node_bandwidth_gbps is None and filled.gpus_per_node == 4


def test_local_measurements_fill_the_job_cluster_from_this_machines_db(tmp_path, monkeypatch) -> None:
    import dataclasses

    from cfp_megatron.base.config import job_from_config
    from cfp_megatron.profile.cluster import local_measurements
    from cfp_megatron.profile.db import store_db
    from cfp_megatron.profile.fingerprint import current_fingerprint

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path))
    job = job_from_config({"model": {"name": "gpt_tiny"}})
    cluster, db = local_measurements(job, world_size=4, backend="gloo")
    # not profiled: the preset as it is, with this host's memory shared by the 4 ranks (on CPU)
    assert db is None and dataclasses.replace(cluster, hbm_gib=None) == job.cluster and cluster.hbm_gib > 0
    here = current_fingerprint(world_size=4, nodes=1, backend="gloo")
    store_db(dataclasses.replace(_db(), fingerprint=here))
    cluster, db = local_measurements(job, world_size=4, backend="gloo")
    assert db is not None and db.fingerprint == here
    assert cluster.peak_tflops_fp32 == pytest.approx(1.024) and cluster.gpus_per_node == here.gpus_per_node


@pytest.mark.parametrize(("device", "memory_gib", "preset"), [
    ("NVIDIA H200", 139.8, "h200"), ("NVIDIA H100 80GB HBM3", 79.2, "dgx_h100"), ("NVIDIA H100 NVL", 93.1, "h100_nvl"),
    ("NVIDIA A100-SXM4-40GB", 39.4, "dgx_a100_40gb"), ("NVIDIA A100-SXM4-80GB", 79.2, "dgx_a100"),
    ("AMD Instinct MI300X", 191.5, "mi300x"), ("NVIDIA GeForce RTX 4090", 23.6, None)])
def test_a_device_finds_its_vendor_preset_by_model_and_memory(device: str, memory_gib: float,
                                                               preset: str | None) -> None:
    from cfp_megatron.profile.cluster import device_preset

    found = device_preset(device, memory_gib)
    assert (found["name"] if found else None) == preset


def test_the_local_cluster_on_a_gpu_takes_its_memory_and_bandwidth(monkeypatch) -> None:
    """On a GPU the ``local`` preset gets the device's memory (the planner's limit) and name, and its vendor
    preset's memory bandwidth (the optimizer's rate; 50 GB/s was assumed before, 7x too slow a step on an H200)."""
    import types

    import torch

    from cfp_megatron.profile import cluster as cluster_module
    from cfp_megatron.profile.cluster import host_share_gib, this_device

    spec = ClusterSpec(name="local")
    assert this_device(spec) == dataclasses.replace(spec, hbm_gib=host_share_gib(spec, 1))  # CPU: the host's
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA H200", total_memory=150_110_011_392))
    filled = this_device(spec)
    assert filled.hbm_gib == pytest.approx(139.8, abs=0.05) and filled.device_name == "NVIDIA H200"
    assert filled.hbm_bandwidth_gbps == 4800.0 and filled.peak_tflops_fp8 == 1979.0 and not filled.on_cpu
    assert filled.peak_tflops_bf16 is None  # measured by profiling, not taken from the datasheet
    assert this_device(ClusterSpec(name="h200", hbm_gib=141.0)).hbm_bandwidth_gbps is None  # a preset stays itself
    # A GPU without a preset: its measured copy rate, no fp8 figure.
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda index: types.SimpleNamespace(name="NVIDIA GeForce RTX 4090", total_memory=24 * 2**30))
    monkeypatch.setattr(cluster_module, "copy_bandwidth_gbps", lambda: 912.5)
    other = this_device(spec)
    assert other.hbm_bandwidth_gbps == 912.5 and other.peak_tflops_fp8 is None and other.hbm_gib == 24.0
