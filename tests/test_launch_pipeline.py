"""One launch pipeline for both backends (issue M, deliverable 5): every launch takes the same steps with its
backend's hooks; ``+cfp=auto`` searches once per ProfileDB state and reads the ProfileDB once. In-process: the
profiling round and the broadcast are stood in for."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from cfp_megatron.backends.protocol import PlannedSearch
from cfp_megatron.base.backend_spec import BackendKind, BackendSpec
from cfp_megatron.base.cfp_spec import cfp_from_config
from cfp_megatron.base.compose import compose_config
from cfp_megatron.base.config import job_from_config
from cfp_megatron.base.launch_env import LaunchEnv
from cfp_megatron.plan import Plan
from cfp_megatron.plan.backend_part import DeepSpeedPart, MegatronPart
from cfp_megatron.planner import backends as planner_backends
from cfp_megatron.profile.db import db_path, read_db
from cfp_megatron.profile.fingerprint import current_fingerprint

MEASURED = Path(__file__).resolve().parent / "data" / "profile_gpt_tiny_2ranks_cpu.json"
"""A real ProfileDB of gpt_tiny on 2 gloo ranks (tests/test_input_checks.py)."""

STEPS = ("check_job", "check_before_start", "resume_pin", "hand_plan", "check_plan_fits", "plan_check", "trainer")
"""The hooks a launch of a layout given by hand calls, in order."""


class _Trainer:
    """A trainer that records what it was handed instead of training."""

    def __init__(self, calls: list[tuple[str, Any]]) -> None:
        self.calls = calls

    def train(self, job: Any, plan: Any, env: Any, backend: Any, **kwargs: Any) -> list:
        self.calls.append(("train", plan))
        return []


def _recording(real: type) -> type:
    """The hooks of ``real`` (a backend's), each call recorded, its trainer replaced by :class:`_Trainer`."""

    class Recording(real):  # type: ignore[misc, valid-type]
        calls: list[tuple[str, Any]] = []

        def __getattribute__(self, name: str) -> Any:
            value = super().__getattribute__(name)
            if name in STEPS and callable(value):
                def recorded(*args: Any, **kwargs: Any) -> Any:
                    Recording.calls.append((name, None))
                    out = value(*args, **kwargs)
                    return (out[0], _Trainer(Recording.calls)) if name == "trainer" else out
                return recorded
            return value

    Recording.calls = []
    return Recording


@pytest.mark.parametrize(("kind", "part"), [(BackendKind.megatron, MegatronPart),
                                            (BackendKind.deepspeed, DeepSpeedPart)])
def test_each_backend_goes_through_the_one_pipeline_with_its_hooks(kind: BackendKind, part: type,
                                                                   monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from cfp_megatron.planner.entry import train_from_config

    hooks = _recording(planner_backends.LAUNCH_HOOKS[kind])
    monkeypatch.setitem(planner_backends.LAUNCH_HOOKS, kind, hooks)
    monkeypatch.chdir(tmp_path)
    assert train_from_config(compose_config([f"backend={kind.value}", "model=gpt_tiny", "train.steps=1"])) == []
    assert [name for name, _ in hooks.calls] == [*STEPS, "train"]
    plan = hooks.calls[-1][1]
    assert isinstance(plan, Plan) and isinstance(plan.backend_part, part) and plan.backend is kind  # never None


def test_a_plan_json_of_the_previous_schema_still_loads() -> None:
    """plan.json files written before the plan held a typed backend part (schema version 2, its ``backend`` and
    ``zero`` keys) load into the part, and are written back the same, less the keys added since with their defaults
    (and so a new content hash), and a rewritten file reads back unchanged."""
    stored = json.loads((Path(__file__).resolve().parent / "data" / "plan_schema2.json").read_text())
    megatron, deepspeed = Plan.from_json(stored["megatron"]), Plan.from_json(stored["deepspeed"])
    assert isinstance(megatron.backend_part, MegatronPart) and megatron.zero is None
    assert isinstance(deepspeed.backend_part, DeepSpeedPart) and deepspeed.zero is not None
    assert deepspeed.zero_stage == 2 and deepspeed.backend is BackendKind.deepspeed
    for plan, old in ((megatron, stored["megatron"]), (deepspeed, stored["deepspeed"])):
        new = plan.to_json()
        assert Plan.from_json(new).to_json() == new
        added = {(section, key): new[section].pop(key) for section, key in ADDED_SINCE_SCHEMA2}
        assert added == {("prediction", "choice"): [], ("parallel", "cuda_graph_impl"): "none",
                         ("parallel", "cuda_graph_scope"): None, ("parallel", "cpu_offloading_num_layers"): 0,
                         ("parallel", "fsdp"): "none", ("parallel", "dp_shard_size"): None,
                         ("parallel", "fp8_param_gather"): False, ("parallel", "num_layers_at_start_in_bf16"): 0,
                         ("parallel", "num_layers_at_end_in_bf16"): 0,
                         ("parallel", "moe_flex_dispatcher_backend"): "deepep"}
        assert {k: v for k, v in new.items() if k != "content_hash"} \
            == {k: v for k, v in old.items() if k != "content_hash"}


ADDED_SINCE_SCHEMA2 = (("prediction", "choice"), ("parallel", "cuda_graph_impl"), ("parallel", "cuda_graph_scope"),
                       ("parallel", "cpu_offloading_num_layers"), ("parallel", "fsdp"), ("parallel", "dp_shard_size"),
                       ("parallel", "fp8_param_gather"), ("parallel", "num_layers_at_start_in_bf16"),
                       ("parallel", "num_layers_at_end_in_bf16"), ("parallel", "moe_flex_dispatcher_backend"))
"""plan.json keys added after ``tests/data/plan_schema2.json`` was written (issues N and O), with their defaults on
load."""


@dataclasses.dataclass
class _Outcome:
    """What :func:`cfp_megatron.profile.runner.profile_job` hands back, as far as planning reads it."""

    db: Any
    reused: bool
    path: Path | None = None
    wall_s: float = 0.0
    coverage: tuple = ()
    notes: tuple = ()
    incomplete: tuple = ()
    busy: tuple = ()
    measured_under: str = ""
    retry: str = ""


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, int]:
    """A seeded ProfileDB of this machine on 2 ranks; the searches and the reads of the DB counted."""
    from cfp_megatron.backends.megatron import backend as megatron_backend
    from cfp_megatron.engine import distributed
    from cfp_megatron.planner import memory_fit
    from cfp_megatron.profile import cluster

    monkeypatch.setenv("CFP_CACHE_DIR", str(tmp_path / "cache"))
    here = current_fingerprint(world_size=2, nodes=1, backend="gloo")
    path = db_path(here)
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**json.loads(MEASURED.read_text()), "fingerprint": here.to_json(),
                                "fingerprint_key": here.key}))
    counts = {"search": 0, "load_db": 0}

    def counting(name: str, real: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return real(*args, **kwargs)
        return call

    monkeypatch.setattr(memory_fit, "search", counting("search", memory_fit.search))
    monkeypatch.setattr(megatron_backend, "search", counting("search", megatron_backend.search))
    monkeypatch.setattr(cluster, "load_db", counting("load_db", cluster.load_db))
    monkeypatch.setattr(distributed, "searched_on_rank0", lambda search, outcome, env, console: search())
    monkeypatch.setattr(distributed, "destroy_distributed", lambda: None)
    return counts


def _auto_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, reused: bool) -> Plan:
    """``+cfp=auto`` on rank 0 of 2 up to its plan, profiling stood in for (``reused``: it measured nothing)."""
    from cfp_megatron.planner.launch_plan import resolve_launch_plan
    from cfp_megatron.profile import runner

    here = current_fingerprint(world_size=2, nodes=1, backend="gloo")
    db = read_db(db_path(here), expected=here)
    asked: list[tuple[str, ...]] = []

    def profile_job(job: Any, env: Any, *, priority: Any = None, **kwargs: Any) -> _Outcome:
        asked.append(priority())  # the rounds to measure would ask for it
        return _Outcome(db=db, reused=reused)

    monkeypatch.setattr(runner, "profile_job", profile_job)
    cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "train.global_batch_size=16", "train.precision=fp32"])
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0, under_torchrun=True)
    launch = resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, tmp_path / f"run{reused}")
    assert launch is not None and launch.source == "planned" and asked and asked[0]
    return launch.plan


def test_auto_searches_once_per_profiledb_state(counted: dict[str, int], monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    """Profiling that measured nothing: the search before profiling (the memory check, the priorities) is the plan's
    search, one in all; profiling that measured: one search before and one after on the DB it handed back. The
    ProfileDB is read once either way, and both choose the plan a search of that ProfileDB chooses."""
    from cfp_megatron.backends.megatron.backend import MegatronBackend
    from cfp_megatron.profile.cluster import local_measurements

    reused = _auto_launch(monkeypatch, tmp_path, reused=True)
    assert counted == {"search": 1, "load_db": 1}
    counted.update(search=0, load_db=0)
    measured = _auto_launch(monkeypatch, tmp_path, reused=False)
    assert counted == {"search": 2, "load_db": 1}
    cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "train.global_batch_size=16", "train.precision=fp32"])
    job, cfp = job_from_config(cfg), cfp_from_config(cfg)
    cluster, measurements = local_measurements(job, world_size=2)
    found: PlannedSearch = MegatronBackend().search(dataclasses.replace(job, cluster=cluster), 2, cfp, BackendSpec(),
                                                    measurements=measurements, inputs_fingerprint="", on_gpu=False)
    assert reused.plan_hash() == measured.plan_hash() == found.best.plan_hash()
    assert reused.to_json() == measured.to_json()  # prediction and inputs' fingerprint too


def test_auto_warns_of_an_unknown_generation_after_its_search(counted: dict[str, int],
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      tmp_path: Path) -> None:
    """``+cfp=auto`` on a cluster whose generation has no fitted efficiencies says so in the launch's output once
    its search has run, naming the efficiencies it priced the plans with instead (issue M, item 2: a warning, never
    a silent fallback); a stated generation is not warned of."""
    import io

    from rich.console import Console

    from cfp_megatron.planner.launch_plan import resolve_launch_plan
    from cfp_megatron.profile import runner
    from cfp_megatron.sim.calibration import TABLE

    here = current_fingerprint(world_size=2, nodes=1, backend="gloo")
    db = read_db(db_path(here), expected=here)
    monkeypatch.setattr(runner, "profile_job", lambda job, env, **kwargs: _Outcome(db=db, reused=True))
    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None)
    env = LaunchEnv(rank=0, world_size=2, local_rank=0, local_world_size=2, restart_count=0, under_torchrun=True)
    for generation, warned in (("rubin", True), ("cpu", False)):
        out.seek(0)
        out.truncate()
        cfg = compose_config(["+cfp=auto", "model=gpt_tiny", "train.global_batch_size=16", "train.precision=fp32",
                              f"cluster.generation={generation}"])
        launch = resolve_launch_plan(job_from_config(cfg), cfp_from_config(cfg), env, tmp_path / generation, console)
        assert launch is not None and launch.source == "planned"
        text = " ".join(out.getvalue().split())
        warning = (f"cfp: warning: cluster local (cpu) states cluster.generation=rubin, which has no fitted "
                   f"efficiencies: the simulator prices it with {TABLE.fallback}'s efficiencies instead")
        assert (warning in text) == warned, text
