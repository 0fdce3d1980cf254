"""Issue R, inputs checked where they enter (plan side): a plan applies only to the job it was made for (model,
optimizer, cluster, and what the user typed), a typed setting holds or is refused (never dropped), conflicting pins
are refused; plan.json's content hash is required for the current schema, duplicate keys and named pipes are refused,
an earlier DeepSpeed zero_plan.json is checked as its own version was. All before any process group or profiling."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig
from omegaconf import open_dict

from cfp_megatron.backends.deepspeed.zero_plan import zero_plan
from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import CONF_DIR, compose_config, register_configs
from cfp_megatron.base.config import Precision, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.plan import Plan, PlanError, load_plan, save_plan
from cfp_megatron.plan.artifact import content_hash
from cfp_megatron.planner.launch_plan import resolve_launch_plan
from cfp_megatron.planner.plan_inputs import check_typed_before_plan, plan_conflicts, typed_keys


@pytest.fixture(autouse=True)
def _no_hydra_left() -> Iterator[None]:
    yield
    HydraConfig.instance().cfg = None  # type: ignore[assignment]


def _typed(overrides: list[str]) -> None:
    """Make ``overrides`` what the user typed, as Hydra records it inside the application."""
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=overrides, return_hydra_config=True)
    with open_dict(cfg):
        cfg.hydra.runtime.output_dir = "/nonexistent-run-dir"
    HydraConfig.instance().set_config(cfg)


class _Console:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def print(self, text: str, **_: object) -> None:
        self.lines.append(text)


def _launch(overrides: list[str], tmp_path: Path, *, world: int = 1, console: _Console | None = None):
    """``launch/train.py`` up to its plan: the job under the plan (or the error), with ``overrides`` typed."""
    _typed(overrides)
    cfg = compose_config(overrides)
    env = dataclasses.replace(LaunchEnv.read(), world_size=world, rank=0)
    return resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, tmp_path / "run", console)


def _plan_file(tmp_path: Path, *overrides: str, world: int = 1, name: str = "plan.json") -> Path:
    job = job_from_config(compose_config(["model=gpt_tiny", *overrides]))
    return save_plan(Plan.from_job(job, world_size=world, prediction=None, inputs_fingerprint="f00d"),
                     tmp_path / name)


# ---------------------------------------------------------------------------------------------- what was typed

def test_typed_keys_are_what_hydra_records(tmp_path: Path) -> None:
    assert typed_keys() == ()  # outside a Hydra application
    _typed(["+cfp=auto", "model=llama_tiny", "cfp.tp=1", "parallel.tp=2", "++train.seed=3", "train.steps=5"])
    assert typed_keys() == ("cfp.tp", "parallel.tp", "train.seed", "train.steps")


@pytest.mark.parametrize(("extra", "keys", "says"), [
    (["cfp.tp=1", "parallel.tp=2"], ["parallel.tp"], "cfp.tp=1 pins another value"),
    (["parallel.tp=2"], ["parallel.tp"], "pin it with cfp.tp=2 instead of parallel.tp"),
    (["parallel.recompute=full"], ["parallel.recompute"], "cfp.recompute=full"),
    (["train.micro_batch_size=4"], ["train.micro_batch_size"], "cfp.micro_batch=4"),
    (["parallel.recompute_num_layers=2"], ["parallel.recompute_num_layers"], "has no cfp pin"),
    (["parallel.overlap_grad_reduce=true"], ["parallel.overlap_grad_reduce"], "cfp.overlap=false"),
])
def test_auto_refuses_a_typed_setting_the_search_would_drop(tmp_path: Path, extra: list[str], keys: list[str],
                                                            says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        _launch(["+cfp=auto", "model=gpt_tiny", *extra], tmp_path, world=2)
    assert info.value.keys == keys
    assert not (tmp_path / "run").exists()  # before profiling: nothing planned or stored


def test_auto_keeps_what_the_search_keeps() -> None:
    cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "cfp.tp=2", "parallel.tp=2", "cfp.overlap=false"])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    # a pin asking for the same value, the overlaps under cfp.overlap=false, a field the search keeps
    check_typed_before_plan(job, cfp, ("cfp.tp", "parallel.tp", "parallel.overlap_grad_reduce", "parallel.order",
                                       "train.global_batch_size", "train.seq_length"))


def test_manual_without_a_plan_refuses_a_pin_that_contradicts_parallel(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contradicts parallel.tp=1: \\+cfp=manual trains the parallel section") \
            as info:
        _launch(["+cfp=manual", "model=gpt_tiny", "cfp.tp=2"], tmp_path)
    assert info.value.keys == ["cfp.tp"]
    assert _launch(["+cfp=manual", "model=gpt_tiny", "cfp.tp=2", "parallel.tp=2"], tmp_path, world=2) is None


# ------------------------------------------------------------------------------------- a plan for another job

@pytest.mark.parametrize(("extra", "key", "says"), [
    (["model.num_layers=8"], "model.num_layers", "was made for model.num_layers=4, not 8"),
    (["model.hidden_size=128"], "model.hidden_size", "was made for model.hidden_size=64, not 128"),
    (["train.optimizer=sgd"], "train.optimizer", "was made for train.optimizer=adam, not sgd"),
    (["model=llama_tiny"], "model", "was made for model=gpt_tiny"),
    (["cluster=dgx_a100", "cluster.nodes=1", "cluster.gpus_per_node=1"], "cluster", "was made for cluster=local"),
    (["train.global_batch_size=4"], "train.global_batch_size", "sets train.global_batch_size=16"),
    (["train.seq_length=32"], "train.seq_length", "sets train.seq_length=64"),
    (["train.micro_batch_size=1"], "train.micro_batch_size", "sets train.micro_batch_size=2"),
    (["train.precision=bf16"], "train.precision", "sets train.precision=fp32"),
    (["parallel.recompute=full"], "parallel.recompute", "sets parallel.recompute=none"),
    (["cfp.tp=2"], "cfp.tp", "pins another value than the plan"),
])
def test_a_plan_file_applies_only_to_its_job(tmp_path: Path, extra: list[str], key: str, says: str) -> None:
    plan = _plan_file(tmp_path, "train.global_batch_size=16", "train.precision=fp32")
    with pytest.raises(ConfigError, match=says) as info:
        _launch(["+cfp=manual", f"cfp.plan_file={plan}", *extra], tmp_path)
    assert info.value.keys == [key] and f"cfp.plan_file={plan}" in str(info.value)


def test_untyped_settings_take_the_plans_values_with_a_note(tmp_path: Path) -> None:
    plan = _plan_file(tmp_path, "train.global_batch_size=16", "train.precision=fp32")
    console = _Console()
    launch = _launch(["+cfp=manual", f"cfp.plan_file={plan}"], tmp_path, console=console)
    assert launch is not None and launch.job.train.global_batch_size == 16
    assert launch.job.train.precision is Precision.fp32  # the plan's precision is applied
    assert any("sets train.global_batch_size=16 (the config had 8)" in line for line in console.lines)
    # typed with the plan's own values: nothing to say, nothing refused
    typed = _launch(["+cfp=manual", f"cfp.plan_file={plan}", "train.global_batch_size=16", "parallel.tp=1",
                     "train.precision=auto"], tmp_path, console=(quiet := _Console()))
    assert typed is not None and typed.job.train.global_batch_size == 16 and quiet.lines == []


def test_a_plan_string_is_held_to_the_same_rules(tmp_path: Path) -> None:
    job = job_from_config(compose_config(["model=gpt_tiny", "parallel.tp=2"]))
    canonical = Plan.from_job(job, world_size=2, prediction=None, inputs_fingerprint="").canonical()
    with pytest.raises(ConfigError, match="sets parallel.tp=2") as info:
        _launch(["+cfp=manual", f"cfp.plan='{canonical}'", "parallel.tp=1"], tmp_path, world=2)
    assert info.value.keys == ["parallel.tp"]


def test_a_deepspeed_plan_names_what_differs() -> None:
    job = job_from_config(compose_config(["model=gpt_tiny", "backend=deepspeed"]))
    plan = zero_plan(job, world=2, zero_stage=2, micro_batch=2, activation_checkpointing=False,
                     offload_optimizer=False, offload_param=False, bucket_elements=1000, precision=Precision.fp32)
    other = job_from_config(compose_config(["model=gpt_tiny", "backend=deepspeed", "model.num_layers=6",
                                            "train.seq_length=32"]))
    issues = plan_conflicts(plan, other, ("train.seq_length",), source="the plan")
    assert [i.key for i in issues] == ["model.num_layers", "train.seq_length"]
    assert plan_conflicts(plan, job, ("train.precision",), source="the plan") == []  # auto accepts fp32


# ------------------------------------------------------------------------------------------------ the file

def test_the_current_schema_requires_the_content_hash(tmp_path: Path) -> None:
    data = json.loads(_plan_file(tmp_path).read_text())
    assert data["schema_version"] == 2 and data["inputs"]["model.num_layers"] == 4
    del data["content_hash"]
    with pytest.raises(PlanError, match="schema_version 2\\) has no content_hash"):
        Plan.from_json(data)
    data = json.loads(_plan_file(tmp_path, name="b.json").read_text())
    data["inputs"]["model.num_layers"] = 8  # the inputs are inside the content hash
    with pytest.raises(PlanError, match="content hash mismatch"):
        Plan.from_json(data)
    del data["content_hash"], data["inputs"]  # an older file by its declared version: read as version 1 was
    data["schema_version"] = 1
    assert Plan.from_json(data).job_inputs == ()
    data["inputs"] = {}
    with pytest.raises(PlanError, match="unknown keys \\['inputs'\\]"):
        Plan.from_json(data)


def test_a_key_given_twice_is_refused_by_name(tmp_path: Path) -> None:
    path = _plan_file(tmp_path)
    text = path.read_text().replace('"global_batch_size": 8,', '"global_batch_size": 8,\n  "global_batch_size": 64,')
    path.with_name("twice.json").write_text(text)
    with pytest.raises(PlanError, match="key 'global_batch_size' appears twice in one object \\(values 8 and 64"):
        load_plan(path.with_name("twice.json"))


def test_a_named_pipe_as_the_plan_file_is_refused_not_waited_on(tmp_path: Path) -> None:
    fifo = tmp_path / "plan.fifo"
    os.mkfifo(fifo)
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("load_plan waited on a named pipe"))
    signal.alarm(20)
    try:
        with pytest.raises(PlanError, match="named pipe \\(FIFO\\), not a regular file") as info:
            load_plan(fifo)
        with pytest.raises(PlanError, match="named pipe"):
            _launch(["+cfp=manual", f"cfp.plan_file={fifo}"], tmp_path)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert info.value.setting == "cfp.plan_file"


def _zero_plan_json(**change: object) -> dict:
    """An earlier DeepSpeed plan file (schema 1), with ``change`` made to its plan fields or top-level keys."""
    data = json.loads((Path(__file__).parent / "data" / "zero_plan_schema1.json").read_text())
    for key, value in change.items():
        (data["plan"] if key in data["plan"] else data)[key] = value
    return data


@pytest.mark.parametrize(("change", "says"), [
    ({"hash": "0123456789abcdef"}, "hash mismatch"),
    ({"zero_stage": 3}, "zero_stage=3 \\(the string says 2\\)"),
    ({"global_batch_size": 64}, "global_batch_size=64 \\(the string says 8\\)"),
    ({"schema_version": 2}, "has schema_version 2; those files have version 1"),
])
def test_an_earlier_zero_plan_json_is_checked_as_its_version_was(change: dict, says: str) -> None:
    assert Plan.from_json(_zero_plan_json()).zero_stage == 2
    with pytest.raises(PlanError, match=says):
        Plan.from_json(_zero_plan_json(**change))


def test_content_hash_helper_still_matches_the_file(tmp_path: Path) -> None:
    data = json.loads(_plan_file(tmp_path).read_text())
    assert data["content_hash"] == content_hash({k: v for k, v in data.items() if k != "content_hash"})


# ------------------------------------------------------------- what else a plan was made for, what manual reads

def _given(overrides: list[str], world: int):
    """``launch/train.py`` up to its plan with the hooks and ``backend`` group the config names (both backends)."""
    from cfp_megatron.base.backend_spec import backend_from_config
    from cfp_megatron.planner.backends import launch_hooks
    from cfp_megatron.planner.launch_plan import given_plan

    _typed(overrides)
    cfg = compose_config(overrides)
    backend = backend_from_config(cfg)
    env = LaunchEnv(rank=0, world_size=world, local_rank=0, local_world_size=world, restart_count=0,
                    under_torchrun=False)
    return given_plan(job_from_config(cfg), cfp_from_config(cfg), env, hooks=launch_hooks(backend.name),
                      backend=backend)


ZERO_PLAN = Path(__file__).parent / "data" / "zero_plan_schema1.json"
"""An earlier DeepSpeed run's zero_plan.json: ZeRO stage 2 with optimizer offload on 4 ranks."""


@pytest.mark.parametrize(("extra", "world", "key", "says"), [
    (["backend=deepspeed"], 1, "backend", "is a plan for backend=megatron: its layout would not be run"),
    ([f"cfp.plan_file={ZERO_PLAN}"], 4, "backend", "is a plan for backend=deepspeed: its ZeRO options"),
    ([f"cfp.plan_file={ZERO_PLAN}", "backend=deepspeed", "backend.zero_stage=3"], 4, "backend.zero_stage",
     "sets zero_stage=3, but the plan of cfp.plan_file"),
    ([f"cfp.plan_file={ZERO_PLAN}", "backend=deepspeed", "backend.bucket_elements=5000"], 4,
     "backend.bucket_elements", "has bucket_elements=1000"),
])
def test_a_plan_is_refused_under_another_backend_or_other_zero_knobs(tmp_path: Path, extra: list[str], world: int,
                                                                    key: str, says: str) -> None:
    plan = _plan_file(tmp_path)
    overrides = ["+cfp=manual", *(["cfp.plan_file=" + str(plan)] if not any("plan_file" in e for e in extra)
                                  else []), *extra]
    with pytest.raises(ConfigError, match=says) as info:
        _given(overrides, world)
    assert info.value.keys == [key]
    # the plan offloads the optimizer on CPU ranks, which is priced at the host memory bandwidth the cluster states
    held = _given(["+cfp=manual", f"cfp.plan_file={ZERO_PLAN}", "backend=deepspeed", "backend.zero_stage=2",
                   "cluster.host_memory_bandwidth_gbps=20"], 4)
    assert held.plan.zero_stage == 2  # typed with the plan's own value: it holds
    with pytest.raises(ConfigError, match="cluster.host_memory_bandwidth_gbps=None: is not stated"):
        _given(["+cfp=manual", f"cfp.plan_file={ZERO_PLAN}", "backend=deepspeed", "backend.zero_stage=2"], 4)


def test_a_plan_for_another_cluster_shape_is_refused(tmp_path: Path) -> None:
    plan = _plan_file(tmp_path, "cluster.nodes=2", world=2)
    with pytest.raises(ConfigError, match="was made for 2 node\\(s\\) of 1 rank\\(s\\) \\(cluster.nodes=2\\)") as info:
        _launch(["+cfp=manual", f"cfp.plan_file={plan}"], tmp_path, world=2)
    assert info.value.keys == ["cluster.nodes"]
    assert _launch(["+cfp=manual", f"cfp.plan_file={plan}", "cluster.nodes=2"], tmp_path, world=2) is not None


@pytest.mark.parametrize(("extra", "key", "says"), [
    (["cfp.top_k=3"], "cfp.top_k", "is read by the search of \\+cfp=auto only"),
    (["cfp.constraints.memory_headroom=0.5"], "cfp.constraints.memory_headroom", "would do nothing"),
    (["cfp.profile_budget_s=30"], "cfp.profile_budget_s", "would do nothing"),
    (["cfp.constraints.tp=[2]"], "cfp.constraints.tp", "allows other values than the plan of cfp.plan_file"),
    (["cfp.constraints.max_micro_batch=1"], "cfp.constraints.max_micro_batch", "train.micro_batch_size=2"),
])
def test_manual_holds_a_typed_cfp_setting_to_the_plan_or_refuses_it(tmp_path: Path, extra: list[str], key: str,
                                                                    says: str) -> None:
    plan = _plan_file(tmp_path)
    with pytest.raises(ConfigError, match=says) as info:
        _launch(["+cfp=manual", f"cfp.plan_file={plan}", *extra], tmp_path)
    assert info.value.keys == [key]
    # the sets the plan meets, and what +cfp=manual reads itself, hold
    assert _launch(["+cfp=manual", f"cfp.plan_file={plan}", "cfp.constraints.tp=[1,2]",
                    "cfp.constraints.max_micro_batch=2", "cfp.check_after_steps=0"], tmp_path) is not None


def test_manual_without_a_plan_holds_a_typed_set_to_the_parallel_section(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="contradicts parallel.tp=1.* set parallel.tp=2") as info:
        _launch(["+cfp=manual", "model=gpt_tiny", "cfp.constraints.tp=[2]"], tmp_path, world=2)
    assert info.value.keys == ["cfp.constraints.tp"]
    with pytest.raises(ConfigError, match="would do nothing") as info:
        _launch(["+cfp=manual", "model=gpt_tiny", "cfp.top_k=2"], tmp_path)
    assert info.value.keys == ["cfp.top_k"]


def test_a_plan_string_under_auto_is_refused_not_ignored() -> None:
    with pytest.raises(ConfigError, match="\\+cfp=auto searches a plan of its own: it would be ignored") as info:
        cfp_from_config(compose_config(["+cfp=auto", "cfp.plan='gpt_tiny@localx1x1:tp=1'"]))
    assert info.value.keys == ["cfp.plan"]


def test_a_plan_without_model_settings_says_so(tmp_path: Path) -> None:
    job = job_from_config(compose_config(["model=gpt_tiny"]))
    canonical = Plan.from_job(job, world_size=1, prediction=None, inputs_fingerprint="").canonical()
    console = _Console()
    assert _launch(["+cfp=manual", f"cfp.plan='{canonical}'"], tmp_path, console=console) is not None
    assert any("records no model settings (a plan string carries none): only model=gpt_tiny is compared" in line
               for line in console.lines)


def _rehashed(tmp_path: Path, name: str, change) -> Path:
    """The sample plan.json with ``change`` made and its content hash written again (a generator's or a careful
    editor's file: only the reader's own checks stand)."""
    data = json.loads(_plan_file(tmp_path, name=f"src-{name}").read_text())
    change(data)
    data.pop("content_hash")
    data["content_hash"] = content_hash(data)
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("change", "says"), [
    (lambda d: d["parallel"].__setitem__("tp", True), "parallel.tp=True must be an integer"),
    (lambda d: d["parallel"].__setitem__("tp", "1"), "parallel.tp='1' must be an integer"),
    (lambda d: d["parallel"].__setitem__("recompute", 0), "parallel.recompute=0 must be one of"),
    (lambda d: d.update(backend="deepspeed", zero=[2]), "plan.json's zero must be a mapping, not list"),
    (lambda d: d.__setitem__("requires", "transformer-engine"), "requires='transformer-engine' is not a list"),
])
def test_fields_of_the_wrong_json_type_are_refused_by_name(tmp_path: Path, change, says: str) -> None:
    with pytest.raises(PlanError, match=says):
        load_plan(_rehashed(tmp_path, "typed.json", change))


@pytest.mark.parametrize(("text", "says"), [
    ("[" * 100_000 + "]" * 100_000, "arrays or objects nested too deeply to read"),
    ('{"schema_version": ' + "9" * 5000 + "}", "a number that cannot be read"),
], ids=["nested", "digits"])
def test_json_the_parser_cannot_hold_is_not_json(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "odd.json"
    path.write_text(text)
    with pytest.raises(PlanError, match=f"is not valid JSON: {says}"):
        load_plan(path)


def test_text_after_the_plan_is_said_and_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    path = _plan_file(tmp_path)
    text = path.read_text()
    (tmp_path / "extra.json").write_text(text + "\nnotes\n")
    with pytest.raises(PlanError, match="more text follows the plan's closing '}'") as info:
        load_plan(tmp_path / "extra.json")
    assert "truncated" not in str(info.value)
    (tmp_path / "bom.json").write_bytes(b"\xef\xbb\xbf" + text.encode())  # as some editors save it
    assert load_plan(tmp_path / "bom.json") == load_plan(path)
