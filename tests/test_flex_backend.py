"""The flex dispatcher's backend (``parallel.moe_flex_dispatcher_backend``: DeepEP or HybridEP) end to end: the
schema's rule, the plan's canonical string and Megatron-LM arguments, Megatron-Core's field, the requirements, the
check before any process group, and the search's set. The simulator's pricing of each: tests/test_sim_moe.py."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config, compose_job
from cfp_megatron.base.config import FlexBackend
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args, torchrun_command
from cfp_megatron.plan.requirements import plan_requirements
from cfp_megatron.planner.job_checks import flex_backend_runs_here
from cfp_megatron.search.plan_options import BACKEND_KEY, plan_options

MIXTRAL = ["model=mixtral_8x7b", "cluster=dgx_h100", "cluster.nodes=4", "parallel.ep=8",
           "train.global_batch_size=256", "train.micro_batch_size=1", "train.seq_length=4096"]
FLEX = "model.moe_token_dispatcher=flex"
KEY = "parallel.moe_flex_dispatcher_backend"


def _job(*more: str):
    return compose_job([*MIXTRAL, *more])


def test_a_backend_without_the_flex_dispatcher_is_refused_by_name() -> None:
    with pytest.raises(ConfigError) as raised:
        ParallelDims.build(_job(f"{KEY}=hybridep"), 32)
    issue = next(i for i in raised.value.issues if i.key == KEY)
    assert issue.value == "hybridep" and "alltoall" in issue.problem and FLEX in issue.fix
    ParallelDims.build(_job(FLEX, f"{KEY}=hybridep"), 32)  # with the flex dispatcher it stands


def test_a_value_outside_the_enum_lists_the_backends() -> None:
    with pytest.raises(ConfigError) as raised:
        _job(FLEX, f"{KEY}=nccl")
    assert "deepep" in str(raised.value) and "hybridep" in str(raised.value) and KEY in str(raised.value)


def test_the_plan_carries_the_backend_to_megatron() -> None:
    job = _job(FLEX, f"{KEY}=hybridep")
    plan = Plan.from_job(job, world_size=32, prediction=None, inputs_fingerprint="")
    assert ",flexb=hybridep," in plan.canonical() and Plan.parse(plan.canonical()) == plan
    assert Plan.from_json(plan.to_json()) == plan
    args = megatron_lm_args(plan)
    assert args[args.index("--moe-flex-dispatcher-backend") + 1] == "hybridep"
    assert f"{KEY}=hybridep" in torchrun_command(plan)
    config = transformer_config(job, ParallelDims.build(job, 32), on_gpu=False)
    assert config.moe_flex_dispatcher_backend == "hybridep"
    default = Plan.from_job(_job(FLEX), world_size=32, prediction=None, inputs_fingerprint="")
    assert "flexb" not in default.canonical() and "--moe-flex-dispatcher-backend" not in megatron_lm_args(default)
    assert transformer_config(_job(FLEX), ParallelDims.build(_job(FLEX), 32),
                              on_gpu=False).moe_flex_dispatcher_backend == "deepep"  # Megatron-Core's default


def test_the_requirements_name_each_backends_package() -> None:
    def needs(backend: str) -> str:
        job = _job(FLEX, f"{KEY}={backend}")
        plan = Plan.from_job(job, world_size=32, prediction=None, inputs_fingerprint="")
        return next(need for need in plan_requirements(plan, job.model) if "moe_token_dispatcher=flex" in need)

    assert "deep_ep.Buffer" in needs("deepep") and "HybridEP" not in needs("deepep")
    assert "deep_ep.HybridEPBuffer" in needs("hybridep") and "hybrid-ep branch" in needs("hybridep")


def test_a_missing_backend_package_stops_before_any_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU where ``deep_ep`` (or its HybridEP class) is missing, the check names the key, the value and the fix;
    a CPU cluster is left to the layout rules, which refuse the flex dispatcher there."""
    import importlib.util

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deep_ep" else object())
    for backend in FlexBackend:
        [issue] = flex_backend_runs_here(_job(FLEX, f"{KEY}={backend.value}"))
        assert (issue.key, issue.value) == (KEY, backend.value) and "install" in issue.fix
    assert flex_backend_runs_here(_job()) == []  # the alltoall dispatcher needs no DeepEP
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert flex_backend_runs_here(_job(FLEX)) == []  # a machine without a GPU plans for another
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cpu = compose_job(["model=moe_tiny", "cluster=local", FLEX, "parallel.ep=2"])
    assert flex_backend_runs_here(cpu) == []


def _cfp(*more: str):
    return cfp_from_config(compose_config(["+cfp=auto", *MIXTRAL, *more]))


def test_the_search_tries_each_backend_of_the_set() -> None:
    job = _job(FLEX)
    options, left = plan_options(job, _cfp(FLEX, "cfp.constraints.moe_flex_dispatcher_backend=[deepep,hybridep]"),
                                 te_available=True)
    assert [o.backend for o in options] == [FlexBackend.deepep, FlexBackend.hybridep] and not left
    assert options[1].name == "moe_flex_dispatcher_backend=hybridep"
    assert options[1].apply(job).parallel.moe_flex_dispatcher_backend is FlexBackend.hybridep
    with pytest.raises(ConfigError) as raised:
        plan_options(_job(), _cfp("cfp.constraints.moe_flex_dispatcher_backend=[hybridep]"), te_available=True)
    assert raised.value.issues[0].key == BACKEND_KEY and FLEX in raised.value.issues[0].fix
    assert dataclasses.replace(options[0], backend=None).name == "the job's own"


def test_hybridep_pads_to_capacity_and_deepep_is_refused_by_name() -> None:
    """Megatron-Core lets HybridEP drop and pad (``_HybridEPManager``) and refuses it with DeepEP; the search's sets
    keep drop-and-pad with HybridEP and say why not with DeepEP."""
    padded = [FLEX, "model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true"]
    assert _job(*padded, f"{KEY}=hybridep").model.moe_pad_expert_input_to_capacity
    with pytest.raises(ConfigError) as raised:
        _job(*padded)
    issue = raised.value.issues[0]
    assert issue.key == "model.moe_pad_expert_input_to_capacity" and f"{KEY}=hybridep" in issue.fix
    sets = ["cfp.constraints.moe_flex_dispatcher_backend=[deepep,hybridep]",
            "cfp.constraints.moe_token_policy=[dropless,drop_pad]", "cfp.constraints.moe_capacity_factor=1.0"]
    options, left = plan_options(_job(FLEX), _cfp(FLEX, *sets), te_available=True)
    assert [(o.policy.value, o.backend.value) for o in options] == [
        ("dropless", "deepep"), ("dropless", "hybridep"), ("drop_pad", "hybridep")]
    assert [r.what for r in left] == ["moe_token_policy=drop_pad(1) moe_flex_dispatcher_backend=deepep"]
    assert "DeepEP" in left[0].reason


@pytest.mark.parametrize(("dispatcher", "backend"), [("flex", "nccl"), ("alltoall", "hybridep")])
def test_a_recipe_states_a_flex_backend_only_with_the_flex_dispatcher(tmp_path, dispatcher: str, backend: str) -> None:
    """``recipes.yaml``'s ``flex_backend`` is one of the backends, under ``dispatcher: flex``; the shipped file's
    entries that state one load with it."""
    import yaml

    from cfp_megatron.validation.data import RECIPES_FILE, ValidationDataError, load_recipes

    assert {r.flex_backend for r in load_recipes() if r.dispatcher == "flex"} == {"deepep", "hybridep", None}
    data = yaml.safe_load(RECIPES_FILE.read_text())
    entry = next(e for e in data["recipes"] if e.get("flex_backend"))
    data["recipes"] = [{**entry, "dispatcher": dispatcher, "flex_backend": backend}]
    path = tmp_path / "recipes.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValidationDataError, match="flex_backend"):
        load_recipes(path)
