"""``model.spec`` (model/layer_spec.py): what it names is checked before any process group, its identity enters
the keys that depend on the layers, and the exports carry it (in-process; the training run under a plan is
tests/test_custom_layer_train.py's)."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cfp_megatron.base.cfp_spec import CfpSpec
from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.jsonio import json_plain
from cfp_megatron.model import cache, layer_spec
from cfp_megatron.plan import Plan, PlanError, megatron_lm_args, torchrun_command
from cfp_megatron.planner.job_checks import validate_rest
from cfp_megatron.planner.launch_plan import plan_key

MODULE = '''
import dataclasses

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec

from tests.custom_layers import gated_mlp_module

_base = get_gpt_layer_local_spec()
LAYER = dataclasses.replace(_base, submodules=dataclasses.replace(_base.submodules,
                                                                  mlp=ModuleSpec(module=gated_mlp_module())))


def layer(config):
    return LAYER


def four_layers(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    return get_gpt_decoder_block_spec(dataclasses.replace(config, num_layers=4), use_transformer_engine=False)
'''
"""A user's spec module: a module-level ModuleSpec (``LAYER``, Megatron-LM's ``--spec`` form) and a function."""


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """``my_layers.py`` on ``sys.path`` (imported afresh by each test)."""
    path = tmp_path / "my_layers.py"
    path.write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_layers", None)
    layer_spec.spec_identity.cache_clear()
    yield path
    sys.modules.pop("my_layers", None)
    layer_spec.spec_identity.cache_clear()


def _job(*overrides: str):
    return compose_job(["model=gpt_tiny", "train.global_batch_size=8", *overrides], typed=True, runs_hydra=False)


def test_the_spec_identity_follows_its_structure_and_source(user_module: Path) -> None:
    """The same path after its module changed is another key (capture, derivation, plan); a model without a spec
    keeps the keys it had before the field existed."""
    plain, custom = _job(), _job("model.spec=my_layers:layer")
    without = json_plain(plain.model)
    without.pop("spec")
    assert layer_spec.keyed_model(plain.model) == without  # the keys of every earlier model hold
    first = layer_spec.spec_identity(custom.model)
    assert first is not None and first["path"] == "my_layers:layer"
    assert layer_spec.spec_identity(_job("model.spec=my_layers:LAYER").model) != first  # another object

    def keys(job) -> tuple[str, str]:
        return (cache.cache_key(cache.job_cache_inputs(job, seq_length=64, micro_batch_size=1)),
                plan_key(job, 2, CfpSpec()))

    before = keys(custom)
    assert all(a != b for a, b in zip(before, keys(plain), strict=True))
    user_module.write_text(MODULE.replace("return LAYER", "return dataclasses.replace(LAYER, params={})"))
    sys.modules.pop("my_layers", None)
    layer_spec.spec_identity.cache_clear()
    assert layer_spec.spec_identity(custom.model)["structure"] != first["structure"]
    assert all(a != b for a, b in zip(before, keys(custom), strict=True))


def test_a_spec_of_a_part_and_not_of_a_layer_is_refused_before_any_group() -> None:
    import torch.distributed as dist

    job = _job("model.spec=tests.custom_layers:mlp_only_spec")
    with pytest.raises(ConfigError, match="a ModuleSpec of ThreeProjectionMLP, not of a transformer layer") as err:
        validate_rest(job)
    assert err.value.keys == ["model.spec"] and not dist.is_initialized()


def test_a_block_of_another_layer_count_is_refused(user_module: Path) -> None:
    """GPTModel builds every layer a block spec lists: a block of 4 for a 6-layer model would train another model."""
    validate_rest(_job("model.spec=my_layers:four_layers"))  # gpt_tiny has 4
    with pytest.raises(ConfigError, match="a block of 4 layer specs where this pipeline stage builds 6"):
        validate_rest(_job("model.spec=my_layers:four_layers", "model.num_layers=6"))


def test_the_exports_carry_the_spec(user_module: Path) -> None:
    """Megatron-LM's ``--spec <module> <name>`` for a module-level ModuleSpec; for a function, a PlanError naming
    model.spec (Megatron-LM uses the object it imports as the spec itself); the torchrun command sets it."""
    for name, megatron in (("LAYER", ["--spec", "my_layers", "LAYER"]), ("layer", None)):
        job = _job(f"model.spec=my_layers:{name}")
        job = dataclasses.replace(job, parallel=dataclasses.replace(job.parallel, tp=2))
        plan = Plan.from_job(job, world_size=2, prediction=None, inputs_fingerprint="")
        assert dict(plan.job_inputs)["model.spec"] == f"my_layers:{name}"  # plan.json records it
        assert f"model.spec=my_layers:{name}" in torchrun_command(plan)
        if megatron is not None:
            args = megatron_lm_args(plan)
            assert args[-3:] == megatron and "--tensor-model-parallel-size" in args
        else:
            with pytest.raises(PlanError, match="names a function") as err:
                megatron_lm_args(plan)
            assert err.value.setting == "model.spec"
    assert "--spec" not in megatron_lm_args(Plan.from_job(_job(), world_size=1, prediction=None,
                                                          inputs_fingerprint=""))


def test_a_module_level_spec_is_captured_with_its_third_projection(user_module: Path) -> None:
    """The capture builds what ``model.spec`` names (here the ModuleSpec object): its MLP's three projections."""
    from cfp_megatron.model.capture import capture_job

    capture = capture_job(_job("model.spec=my_layers:LAYER"), seq_length=16)
    (kind,) = set(capture.layer_kinds)
    params = capture.graphs[kind].params
    assert {"mlp.linear_fc1.weight", "mlp.linear_fc2.weight", "mlp.linear_fc3.weight"} <= set(params), params


def test_under_a_process_group_the_spec_is_checked_as_far_as_it_can_be_and_keeps_its_identity() -> None:
    """A script that keeps a process group between runs (tests/scripts/multirank_cases.py) has no Megatron state to
    build a spec on: the check imports it and leaves the build to the trainer; the identity is the one computed
    before any group (it never builds the spec)."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    from torch.testing._internal.distributed.fake_pg import FakeStore

    job = _job("model.spec=tests.custom_layers:custom_layer_spec")
    layer_spec.spec_identity.cache_clear()
    before = layer_spec.spec_identity(job.model)
    layer_spec.spec_identity.cache_clear()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        validate_rest(job)
        assert layer_spec.spec_identity(job.model) == before
        with pytest.raises(ConfigError, match="does not import"):
            validate_rest(_job("model.spec=no_such_layers.specs:gated_mlp_spec"))
        assert not parallel_state.model_parallel_is_initialized()
    finally:
        dist.destroy_process_group()


def test_megatrons_line_for_a_custom_mlp_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """Megatron-Core logs "Unknown MLP type" for every layer of a custom MLP it builds (dozens while profiling):
    once per process is enough; its other lines pass."""
    import logging

    from cfp_megatron.compat.quiet import quiet_expected_warnings

    quiet_expected_warnings()
    logger = logging.getLogger("megatron.core.transformer.transformer_layer")
    for f in logger.filters:  # said already by an earlier test's build: counted afresh here
        if hasattr(f, "seen"):
            f.seen = False
    with caplog.at_level(logging.WARNING):
        for _ in range(3):
            logger.warning("Unknown MLP type: <class 'x'>. Using default kwargs.")
        logger.warning("something else")
    said = [r.getMessage() for r in caplog.records if r.name == logger.name]
    assert said == ["Unknown MLP type: <class 'x'>. Using default kwargs.", "something else"]


def test_primepar_is_not_offered_for_a_custom_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    """PrimePar's layers replace Megatron-Core's own MLP: a derived PrimePar option of a model.spec model is not
    offered to the search (a model without one keeps it), and asking for it is refused before any group."""
    from cfp_megatron.model import derive

    found = (derive.DerivedOption(part="mlp", name="megatron-1d", knob="tp", choice=None, block="-", communication="-",
                                  rule="dense_mlp", sizes={"ffn": 256}, kinds=("dense",)),
             derive.DerivedOption(part="mlp", name="primepar-2d", knob="tp", choice=("mlp", "primepar"), block="-",
                                  communication="-", rule="primepar",
                                  sizes={"hidden": 64, "ffn": 256, "moe": False}, kinds=("dense",)))
    monkeypatch.setattr(derive, "derived_options", lambda job, use_cache=True: found)
    spec = "model.spec=tests.custom_layers:custom_layer_spec"
    assert [o.name for o in derive.partition_options(_job())] == ["megatron-1d", "primepar-2d"]
    assert [o.name for o in derive.partition_options(_job(spec))] == ["megatron-1d"]
    with pytest.raises(ConfigError, match="PrimePar's layers replace Megatron-Core's own MLP") as err:
        validate_rest(_job(spec, "parallel.tp=4", "parallel.mlp=primepar"))
    assert err.value.keys == ["parallel.mlp"]
