"""Backends as one axis: both implement the planner's protocol over the one search driver and the one Plan."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, backend_from_config
from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.plan import Plan, load_plan
from cfp_megatron.planner.backends import backend_for
from cfp_megatron.planner.plan_cli import main as plan_main

PRESET = ["model=gpt_tiny", "cluster=dgx_h100", "train.global_batch_size=16", "+cfp=auto"]


@pytest.mark.parametrize("kind", list(BackendKind))
def test_each_backend_searches_into_ranked_plans(kind: BackendKind) -> None:
    cfg = compose_config([*PRESET, f"backend={kind.value}"])
    job, cfp, backend = job_from_config(cfg), cfp_from_config(cfg), backend_from_config(cfg)
    found = backend_for(kind).search(job, 8, cfp, backend, measurements=None, inputs_fingerprint="abc",
                                     on_gpu=True)
    assert isinstance(found, PlannedSearch) and found.plans and len(found.labels) == len(found.plans)
    times = [p.predicted.step_time_s for p in found.plans]
    assert times == sorted(times) and found.searched >= len(found.plans)
    for plan in found.plans:
        assert plan.backend is kind and plan.inputs_fingerprint == "abc" and plan.world_size == 8
        assert Plan.parse(plan.canonical()).plan_hash() == plan.plan_hash()
    assert (found.best.zero is not None) == (kind is BackendKind.deepspeed)


def test_preflight_plans_a_deepspeed_job_into_the_same_artifact(tmp_path: Path) -> None:
    assert plan_main([*PRESET, "backend=deepspeed", "--out", str(tmp_path)]) == 0
    (folder,) = tmp_path.iterdir()
    plan = load_plan(folder / "plan.json")
    assert plan.backend is BackendKind.deepspeed and plan.predicted is not None
    config = json.loads((folder / "deepspeed_config.json").read_text())
    assert config["zero_optimization"]["stage"] == plan.zero_stage and "optimizer" in config
    command = (folder / "torchrun.sh").read_text()
    assert "backend=deepspeed" in command and f"backend.zero_stage={plan.zero_stage}" in command
    assert (folder / "megatron_args.txt").read_text().startswith("# ")  # Megatron-LM cannot run it: said why
