"""The deepspeed.initialize hook's planning without processes: reading a user's config (pins, "auto", bad input),
filling it, measuring a model without changing it, the search over measured passes and engine probes, the probes'
config, stages, model copy and timing loop."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from cfp_megatron.backends.deepspeed.costs import zero_sharding
from cfp_megatron.backends.deepspeed.engine_probe import EngineProbes, StageProbe, probe_stages
from cfp_megatron.backends.deepspeed.hook_config import PROBE_OPTIMIZER, filled_config, plan_request, probe_config
from cfp_megatron.backends.deepspeed.hook_measure import MeasuredPasses, measure_passes, model_copy
from cfp_megatron.backends.deepspeed.hook_plan import hook_passes, hook_zero_plan, probe_stage_list, search_hook
from cfp_megatron.base.config import ClusterSpec
from cfp_megatron.base.errors import ConfigError


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList([torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16),
                                                               torch.nn.Dropout(0.1)) for _ in range(2)])
        self.norm = torch.nn.BatchNorm1d(8)  # a buffer the measurements must not move
        self.out = torch.nn.Linear(16, 50)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = x + block(x)
        return self.out(self.norm(x))


def _auto(**values: object) -> dict:
    return {"train_batch_size": 16, "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": "auto"},
            **values}


@pytest.mark.parametrize(("config", "world", "key", "text"), [
    ({"train_micro_batch_size_per_gpu": "auto"}, 2, "config.train_batch_size", "global batch is needed"),
    (_auto(train_batch_size=7), 2, "config.train_batch_size", "not a multiple of the 2"),
    (_auto(zero_optimization={"stage": 1, "offload_param": {"device": "cpu"}}), 2,
     "config.zero_optimization.offload_param", "needs ZeRO stage 3"),
    (_auto(zero_optimization={"offload_optimizer": {"device": "cpu"}}), 2,
     "config.zero_optimization.offload_optimizer", "needs ZeRO stage 1-3"),
    (_auto(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3), 2,
     "config.gradient_accumulation_steps", "contradicts train_batch_size=16"),
    (_auto(train_micro_batch_size_per_gpu=3), 2, "config.train_micro_batch_size_per_gpu", "does not divide the 8"),
    (_auto(zero_optimization={"stage": 4}), 2, "config.zero_optimization.stage", "is not a ZeRO stage"),
    (_auto(gradient_clipping="auto"), 2, "config.gradient_clipping", "not a setting the cfp hook plans"),
])
def test_bad_config_is_refused_naming_key_value_and_fix(config: dict, world: int, key: str, text: str) -> None:
    with pytest.raises(ConfigError, match=text) as info:
        plan_request(config, world)
    assert key in info.value.keys and "Fix:" in str(info.value)


def test_bad_config_is_refused_before_capture_or_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.backends.deepspeed.hook import initialize

    monkeypatch.setenv("WORLD_SIZE", "2")
    user = tmp_path / "ds.json"
    text = json.dumps(_auto(train_batch_size=9))
    user.write_text(text)
    model = _Net()
    with pytest.raises(ConfigError, match=r"config.train_batch_size=9: is not a multiple of the 2"):
        initialize(model=model, example_input=torch.zeros(2, 8, dtype=torch.long), config=str(user))
    assert not hasattr(model, "cfp_capture") and user.read_text() == text  # nothing captured, the file unwritten


def test_pins_auto_and_defaults() -> None:
    assert plan_request({"train_batch_size": 16, "zero_optimization": {"stage": 2}}, 2) is None
    request = plan_request(_auto(zero_optimization={"stage": 3, "offload_param": {"device": "auto"}}), 2)
    assert request is not None
    assert request.micro_batches == (1, 2, 4, 8) and request.global_batch == 16
    assert request.pins == {"activation_checkpointing": False, "zero_stage": 3, "offload_optimizer": False}
    assert set(request.planned) == {"train_micro_batch_size_per_gpu", "zero_optimization.offload_param.device"}
    # accumulation pinned: the micro-batch follows; no train_batch_size but both pinned: the batch follows
    pinned = plan_request(_auto(gradient_accumulation_steps=4), 2)
    assert pinned is not None and pinned.micro_batches == (2,)
    derived = plan_request({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3,
                            "zero_optimization": {"stage": "auto"}}, 2)
    assert derived is not None and derived.global_batch == 12 and derived.pins["micro_batch"] == 2


def _measured() -> MeasuredPasses:
    return MeasuredPasses(forward=(1e-3, 1e-4), backward=(2e-3, 2e-4), activations=(0.0, 1e6),
                          optimizer_s_per_param=1e-8, params=10_000_000, points=(), wall_s=0.0)


def test_search_over_measured_passes_keeps_pins_and_fills_the_config() -> None:
    request = plan_request(_auto(zero_optimization={"stage": "auto", "offload_optimizer": "auto",
                                                    "offload_param": {"device": "auto", "pin_memory": True}}),
                           2)
    assert request is not None
    cpu = ClusterSpec(name="local", nodes=1, gpus_per_node=2)
    result = search_hook(request, _measured(), cpu, None, name="my model", seq_length=8, layers=2, fetches=6,
                         flops_per_token=1e6, local_world=2)
    assert result.evaluated == 4 * 4  # stages x micro-batches; offload left out on CPU ranks
    assert any(what == "offload" for what, _ in result.rejected)
    times = [r.result.step_time_s for r in result.ranked]
    assert times == sorted(times)
    best = result.best.plan
    assert best.model == "my_model" and not best.activation_checkpointing
    config = filled_config(request, best)
    zero = config["zero_optimization"]
    assert config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * 2 == 16
    assert zero["stage"] == best.zero_stage and zero["offload_optimizer"] == {"device": "none"}
    assert ("offload_param" in zero) == (best.zero_stage == 3)
    # on a GPU cluster a plan over its memory is left out: 10M parameters at ZeRO-0 need 160 MB of states
    # (with host figures, so that offload is tried: without them the search leaves it out)
    gpu = ClusterSpec(name="local", nodes=1, gpus_per_node=2, device_name="H100", hbm_gib=0.15, host_link_gbps=64.0,
                      host_memory_bandwidth_gbps=600.0)
    pinned = plan_request(_auto(zero_optimization={"stage": 0}), 2)
    assert pinned is not None
    with pytest.raises(ConfigError, match="no DeepSpeed plan of m on 2 ranks fits"):
        search_hook(pinned, _measured(), gpu, None, name="m", seq_length=8, layers=2, fetches=6,
                    flops_per_token=1e6, local_world=2)
    fitting = search_hook(request, _measured(), gpu, None, name="m", seq_length=8, layers=2, fetches=6,
                          flops_per_token=1e6, local_world=2)
    assert fitting.best.plan.zero_stage != 0 and fitting.best.result.memory.total <= 0.15 * 2**30 * 0.9


@pytest.mark.parametrize(("stage", "world", "stepped"), [(0, 4, 10_000_000), (1, 4, 2_500_000), (2, 2, 5_000_000),
                                                         (3, 4, 2_500_000)])
def test_measured_optimizer_step_covers_the_sharding_models_shard(stage: int, world: int, stepped: float) -> None:
    """The measured optimizer step is priced over the parameters the data-parallel sharding model says the rank
    steps (its shard from ZeRO-1 on), not a rule of the hook's own."""
    request = plan_request(_auto(train_batch_size=8, zero_optimization={"stage": stage}), world)
    assert request is not None
    cpu = ClusterSpec(name="local", nodes=1, gpus_per_node=world)
    plan = hook_zero_plan(request, cpu, (stage, 1, False, False, False), name="m", seq_length=8, local_world=world)
    passes = hook_passes(_measured(), plan, layers=2, fetches=6, flops_per_token=1e6)
    assert zero_sharding(plan).optimizer_params(passes.params) == stepped
    assert passes.optimizer_s == pytest.approx(1e-8 * stepped)


def test_measuring_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = _Net().eval()
    ids = torch.randint(0, 50, (3, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    measured = measure_passes(model, ids, repeats=2, warmup=1)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state()) and not model.training
    assert all(p.grad is None for p in model.parameters())
    assert [p[0] for p in measured.points] == [1, 2, 4] and measured.params == sum(
        p.numel() for p in model.parameters())
    # the saved activations grow with the micro-batch
    assert measured.activations[1] > 0 and measured.points[2][3] > measured.points[0][3]
    assert measured.forward[0] + measured.forward[1] > 0 and measured.optimizer_s_per_param > 0


def _probe(stage: int, one: float, slope: float) -> StageProbe:
    return StageProbe(stage=stage, points=tuple((n, one + slope * (n - 1)) for n in (1, 2, 4)))


def test_search_uses_the_engine_probes() -> None:
    """A probed stage's reduction, gather and optimizer terms are the probe's line: the step time follows it and
    the choice moves to the stage the probes find cheapest."""
    request = plan_request(_auto(), 2)
    assert request is not None
    cpu = ClusterSpec(name="local", nodes=1, gpus_per_node=2)
    kwargs = {"name": "m", "seq_length": 8, "layers": 2, "fetches": 6, "flops_per_token": 1e6, "local_world": 2}
    plain = search_hook(request, _measured(), cpu, None, **kwargs)
    assert all(r.result.time.engine_s == 0 for r in plain.ranked)
    costly = next(s for s in (0, 1, 2, 3) if s != plain.best.plan.zero_stage)
    probes = EngineProbes(model="m", world=2, stages={
        s: _probe(s, 0.05 if s == costly else 5.0, 0.02 if s == costly else 1.0) for s in (0, 1, 2, 3)})
    probed = search_hook(request, _measured(), cpu, None, probes=probes, **kwargs)
    best = probed.best
    assert best.plan.zero_stage == costly and best.result.time.engine_s > 0
    single = 1e-3 + 1e-4 + 2e-3 + 2e-4  # forward + backward lines at micro-batch 1
    probe = probes.stages[costly]
    assert best.result.time.engine_s == pytest.approx(
        best.plan.gradient_accumulation_steps * probe.per_microbatch_s(single) + probe.per_step_s)
    assert best.result.time.grad_reduce_s == 0 and best.result.time.optimizer_s == 0


def test_probe_config_and_stages() -> None:
    user = _auto(tensorboard={"enabled": True}, bf16={"enabled": True}, gradient_clipping=1.0,
                 zero_optimization={"stage": "auto", "offload_optimizer": {"device": "auto"}, "overlap_comm": True})
    request = plan_request(user, 2)
    assert request is not None
    config = probe_config(request, 3)
    assert (config["train_batch_size"], config["train_micro_batch_size_per_gpu"],
            config["gradient_accumulation_steps"]) == (2, 1, 1)
    assert config["zero_optimization"] == {"stage": 3, "overlap_comm": True}  # no offload
    assert "tensorboard" not in config and config["bf16"] == {"enabled": True} and config["gradient_clipping"] == 1.0
    assert config["optimizer"] == PROBE_OPTIMIZER
    assert request.config == user  # the request's copy is unchanged
    own = plan_request(_auto(optimizer={"type": "SGD", "params": {"lr": 0.1}}), 2)
    assert own is not None and probe_config(own, 0)["optimizer"] == {"type": "SGD", "params": {"lr": 0.1}}
    # the stages to probe: the pinned one; every stage on CPU; on a GPU those whose probe fits its memory
    kwargs = {"seq_length": 8, "layers": 2, "fetches": 6, "local_world": 2}
    cpu = ClusterSpec(name="local", nodes=1, gpus_per_node=2)
    assert probe_stage_list(request, _measured(), cpu, **kwargs) == (0, 1, 2, 3)
    pinned = plan_request(_auto(zero_optimization={"stage": 2}), 2)
    assert pinned is not None and probe_stage_list(pinned, _measured(), cpu, **kwargs) == (2,)
    # (with host figures, so that offload is tried: without them the search leaves it out)
    gpu = ClusterSpec(name="local", nodes=1, gpus_per_node=2, device_name="H100", hbm_gib=0.15, host_link_gbps=64.0,
                      host_memory_bandwidth_gbps=600.0)
    small = plan_request(_auto(zero_optimization={"stage": "auto", "reduce_bucket_size": 1_000_000}), 2)
    assert small is not None  # 10M parameters: 160 MB of ZeRO-0 states
    assert probe_stage_list(small, _measured(), gpu, **kwargs) == (2, 3)


def test_probe_budget_is_checked_before_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    from cfp_megatron.backends.deepspeed.hook import initialize

    monkeypatch.setenv("WORLD_SIZE", "2")
    model = _Net()
    with pytest.raises(ConfigError, match=r"probe_budget_s=-1: is not a number of seconds"):
        initialize(model=model, example_input=torch.zeros(2, 8, dtype=torch.long), config=_auto(), probe_budget_s=-1)
    assert not hasattr(model, "cfp_capture")


def test_model_copy_leaves_the_model_alone() -> None:
    model = _Net().eval()
    object.__setattr__(model, "cfp_capture", object())
    model.out.weight.grad = torch.ones_like(model.out.weight)
    twin = model_copy(model)
    assert twin.training and not model.training and all(p.grad is None for p in twin.parameters())
    assert model.out.weight.grad is not None and twin.cfp_capture is model.cfp_capture  # shared, not copied
    assert all(a is not b and torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters(), strict=True))


class _FakeEngine:
    """Records what the timing loop asks of an engine."""

    def __init__(self, log: list) -> None:
        self.log = log

    def set_train_batch_size(self, size: int) -> None:
        self.log.append(("batch", size))

    def destroy(self) -> None:
        self.log.append(("destroy",))


@pytest.fixture
def one_rank_group():
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_rank_group")
def test_probe_timing_loop_takes_the_counts_in_turn_and_keeps_to_the_budget() -> None:
    """The loop shared by the backend's probes and the hook's: after a warm-up round, the counts in turn; the
    median per count; a budget of 0 stops after the first stage, whose engine is destroyed."""
    log: list = []

    def build(stage: int):
        log.append(("build", stage))

        def step(n: int):
            log.append(("prepare", n))
            return lambda: log.append(("run", n))
        return _FakeEngine(log), step

    found = probe_stages((1, 3), build, world=2, rounds=2, budget_s=0.0)
    assert list(found) == [1] and [n for n, _ in found[1].points] == [1, 2, 4]
    assert all(t >= 0 for _, t in found[1].points)
    one_round = [e for n in (1, 2, 4) for e in (("batch", 2 * n), ("prepare", n), ("run", n))]
    assert log == [("build", 1), *one_round * 3, ("destroy",)]
    both = probe_stages((1, 3), build, world=2, rounds=1, budget_s=60.0)
    assert list(both) == [1, 3]
