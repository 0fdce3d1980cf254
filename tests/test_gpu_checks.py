"""The GPU checks' CPU paths: ``bench/gpu_ops.py`` (small shapes, predictions from the simulator's kernel model),
``bench/gpu_memory.py`` (every case in one process) and ``tools/device_check.sh`` (parts skipped, timed out, the
rest still run). What they measure on a GPU is the device run's (docs/benchmarks.md, "On a GPU")."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import Precision, job_from_config
from cfp_megatron.sim.calibration import efficiency_for
from cfp_megatron.sim.kernels import KernelModel

ROOT = Path(__file__).resolve().parent.parent


def _bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpu_ops() -> ModuleType:
    return _bench("gpu_ops")


@pytest.fixture(scope="module")
def h200() -> KernelModel:
    job = job_from_config(compose_config(["model=llama3_8b", "cluster=h200"]))
    return KernelModel(job.cluster, efficiency_for(job.cluster), Precision.bf16)


def test_gpu_ops_on_cpu_prints_the_simulators_prediction_beside_each_figure(gpu_ops: ModuleType, h200: KernelModel,
                                                                            tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    gpu_ops.main(["--parts", "gemm", "grouped", "launch", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["cluster"] == "h200" and result["skipped"] == []
    gemm = result["parts"]["gemm"]["rows"]
    assert gemm and all(r["measured_s"] > 0 for r in gemm)
    for r in gemm:  # the prediction is KernelModel.gemm of the same shape on the H200 preset
        assert r["predicted_s"] == pytest.approx(h200.gemm(r["m"], r["n"], r["k"]))
    grouped = result["parts"]["grouped"]["rows"]
    assert {r["impl"] for r in grouped} == {"loop"}  # no CUDA: the per-expert loop alone
    for r in grouped:  # priced as the MoE term prices the experts: a grouped GEMM per linear (gated fc1, fc2)
        hidden, ffn, tokens = 64, 128, r["tokens_per_expert"]
        expected = (h200.grouped_gemm(gpu_ops.LOCAL_EXPERTS, tokens, 2 * ffn, hidden)
                    + h200.grouped_gemm(gpu_ops.LOCAL_EXPERTS, tokens, hidden, ffn))
        assert r["predicted_s"] == pytest.approx(expected)
    launch = result["parts"]["launch"]["rows"]
    assert [r["side"] for r in launch] == ["host"] and launch[0]["measured_s"] > 0


def test_gpu_ops_skips_parts_past_its_budget(gpu_ops: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "ops.json"
    gpu_ops.main(["--parts", "launch", "gemm", "--budget-s", "0", "--out", str(out)])
    assert not out.exists() or json.loads(out.read_text())["parts"] == {}


def test_host_launch_constant_is_read_from_a_launch_key(gpu_ops: ModuleType) -> None:
    data = {"about": "x", "host": {"per_launch_us": 4.5, "fixed_s": 0.01}}
    assert gpu_ops._launch_number(data, "f.yaml") == (pytest.approx(4.5e-6), "f.yaml:host:per_launch_us")
    assert gpu_ops._launch_number({"launch_s": 2e-6}, "g.json") == (pytest.approx(2e-6), "g.json:launch_s")
    assert gpu_ops._launch_number({"other": 1.0}, "h.json") is None
    seconds, where = gpu_ops.host_launch_constant()
    assert (seconds is None) == (where == "n/a")


def test_gpu_memory_cases_build_one_model_per_recompute_choice() -> None:
    memory = _bench("gpu_memory")
    args = type("Args", (), {"model": "llama3_8b", "cluster": "h200", "seq": 4096})()
    full = memory.overrides(args, "full", 4, 4)
    assert {"parallel.recompute=full", "parallel.recompute_method=uniform", "train.micro_batch_size=4",
            "model.num_layers=4", "cluster.gpus_per_node=1", "train.layout_independent_init=false"} <= set(full)
    # The micro-batch size is the only difference between a recompute choice's cases (one model serves them all).
    one, two = memory.overrides(args, "none", 1, 4), memory.overrides(args, "none", 2, 4)
    assert {a for a in one if a not in two} == {"train.micro_batch_size=1", "train.global_batch_size=2"}
    pred = memory.predicted_memory(tuple(full))
    assert sum(getattr(pred, c) for c in memory.PREDICTED_CATEGORIES) == pytest.approx(pred.total)


@pytest.mark.slow
def test_gpu_memory_runs_every_case_in_one_process(tmp_path: Path) -> None:
    out = tmp_path / "memory.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_memory.py"), "--model", "gpt_tiny", "--seq",
                           "64", "--layers", "1", "--cluster", "h200", "--recompute", "none", "full",
                           "--micro-batches", "1", "2", "--out", str(out)], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    cases = json.loads(out.read_text())["cases"]
    assert [(c["recompute"], c["micro_batch"]) for c in cases] == [("none", 1), ("none", 2), ("full", 1), ("full", 2)]
    assert all(c["tracked_bytes"] > 0 and c["predicted_bytes"] > 0 for c in cases)
    # A larger micro-batch keeps more activations, full recomputation fewer than none.
    act = {(c["recompute"], c["micro_batch"]): c["tracked"]["activations"] for c in cases}
    assert act["none", 2] > act["none", 1] and act["full", 2] < act["none", 2]


def test_device_check_goes_on_after_a_part_times_out(tmp_path: Path) -> None:
    script = ROOT / "tools" / "device_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = {**os.environ, "OUT": str(tmp_path), "OPS_S": "1", "LAUNCHES_S": "0", "MEMORY_S": "0", "AUTO_S": "0"}
    proc = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    log = (tmp_path / "device_check.log").read_text()
    assert "== gpu_ops: rc=124" in log  # stopped by its own timeout
    assert "== gpu_memory: skipped (0 s)" in log and "== auto: skipped (0 s)" in log and "== done" in log
    assert not (tmp_path / "outputs.tgz").exists()
