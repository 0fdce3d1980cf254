"""Activation offloading (``parallel.cpu_offloading_num_layers``): Megatron-Core's rules, the export, the memory it
frees, the host-link copies it exposes, and the presets' host links."""

from __future__ import annotations

import pytest

from cfp_megatron.base.config import CudaGraphImpl, ParallelSpec, Recompute, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.model.megatron_config import transformer_config
from cfp_megatron.plan.artifact import Plan
from cfp_megatron.plan.exports import megatron_lm_args
from cfp_megatron.plan.requirements import plan_requirements
from cfp_megatron.sim.memory import offloaded_layers
from cfp_megatron.sim.options import SimOptions
from cfp_megatron.sim.simulate import simulate
from cfp_megatron.sim.terms.offload import exposed_copy_s
from cfp_megatron.validate import load_preset

H100 = load_preset("dgx_h100")
TINY = {"name": "offload_tiny", "num_layers": 6, "hidden_size": 512, "num_attention_heads": 8, "vocab_size": 1024,
        "max_position_embeddings": 2048, "activation": "swiglu", "add_bias_linear": False}
KEY = "parallel.cpu_offloading_num_layers"


def job(*, link: float | None = 64.0, seq: int = 2048, **parallel):
    cluster = {**H100, "nodes": 1, "host_link_gbps": link}
    train = {"global_batch_size": 16, "micro_batch_size": 2, "seq_length": seq, "precision": "bf16"}
    return job_from_config({"model": TINY, "cluster": cluster, "parallel": parallel, "train": train})


@pytest.mark.parametrize(("parallel", "problem"), [
    ({"pp": 2}, "pipeline parallelism"),
    ({"recompute": Recompute.full}, "recomputation"),
    ({"recompute": Recompute.selective}, "recomputation"),
    ({"cuda_graph_impl": CudaGraphImpl.local}, "CUDA graphs"),
    ({"cpu_offloading_num_layers": -1}, "cannot be negative"),
])
def test_megatrons_offloading_rules_are_config_errors(parallel: dict, problem: str) -> None:
    with pytest.raises(ConfigError) as err:
        ParallelSpec(**{"cpu_offloading_num_layers": 4, **parallel})
    text = str(err.value)
    assert problem in text and KEY in text and "set " in text  # names the setting, what is wrong and the fix


def test_offloading_counts_fewer_layers_than_the_model() -> None:
    assert ParallelDims.build(job(cpu_offloading_num_layers=5), 8, te_available=True).dp == 8
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(job(cpu_offloading_num_layers=6), 8, te_available=True)
    assert KEY in str(err.value) and "at most 5" in str(err.value)


def test_offloading_is_exported_shown_and_parsed_back() -> None:
    offloaded = job(cpu_offloading_num_layers=3)
    plan = Plan.from_job(offloaded, world_size=8, prediction=None, inputs_fingerprint="x")
    args = megatron_lm_args(plan)
    assert "--cpu-offloading" in args and args[args.index("--cpu-offloading-num-layers") + 1] == "3"
    assert "offload=3L" in plan.describe()
    assert "offl=3" in plan.canonical() and Plan.parse(plan.canonical()).parallel.cpu_offloading_num_layers == 3
    assert any(KEY in need for need in plan_requirements(plan, offloaded.model))
    plain = Plan.from_job(job(), world_size=8, prediction=None, inputs_fingerprint="x")
    assert "--cpu-offloading" not in megatron_lm_args(plain) and "offl=" not in plain.canonical()
    assert "offload=" not in plain.describe()


def test_offloading_reaches_megatrons_config_on_a_gpu_only() -> None:
    offloaded = job(cpu_offloading_num_layers=3)
    dims = ParallelDims.build(offloaded, 8, te_available=True)
    assert transformer_config(offloaded, dims, on_gpu=False).cpu_offloading is False  # no TE offload context on CPU


def test_offloaded_layers_are_the_first_ones() -> None:
    assert offloaded_layers(job(cpu_offloading_num_layers=4), 6) == (4, 0)
    assert offloaded_layers(job(), 6) == (0, 0)


def _layer_activations(options: SimOptions | None = None, **parallel) -> float:
    return dict(simulate(job(**parallel), options=options).memory.parts)["layer_activations"]


def test_offloaded_layers_leave_the_gpu_as_transformer_engines_handlers_free_them() -> None:
    """TE 2.10's OffloadSynchronizer finishes layer i's offload at layer N - n + i's forward and starts its reload at
    layer N - 1 - n + i's backward, so each offloaded layer frees its whole kept activations at the peak; TE's
    handler before 2.10 frees the last offloaded layer at the last layer's commit and reloads it at the first
    backward commit: one layer back beside the last layer's passes, not beside the loss's logits."""
    from cfp_megatron.sim.layout import build_layout
    from cfp_megatron.sim.memory import layer_activation_bytes

    none = _layer_activations()
    plain = job()
    per_layer = layer_activation_bytes(plain, build_layout(plain), SimOptions(), moe=False)[0]
    for count in (1, 2, 5):
        assert none - _layer_activations(cpu_offloading_num_layers=count) == pytest.approx(count * per_layer)
    old = _layer_activations(SimOptions(offload_v1=True), cpu_offloading_num_layers=5)
    new = _layer_activations(cpu_offloading_num_layers=5)
    assert new < old <= new + per_layer  # the layer back beside the last layer's backward, against the logits


def test_a_copy_is_exposed_only_beyond_the_layer_it_hides_behind() -> None:
    assert exposed_copy_s(0.004, 0.010) == 0.0
    assert exposed_copy_s(0.010, 0.004) == pytest.approx(0.006)


def test_offload_time_is_the_host_links_copies_the_compute_does_not_hide() -> None:
    base = simulate(job())
    fast = simulate(job(cpu_offloading_num_layers=4, link=1e6))
    slow_job = job(cpu_offloading_num_layers=4, link=0.5)
    slow = simulate(slow_job)
    unstated = simulate(job(cpu_offloading_num_layers=4, link=None))
    lane = {name: p.time.offload_s for name, p in
            (("base", base), ("fast", fast), ("slow", slow), ("unstated", unstated))}
    assert lane["base"] == lane["fast"] == lane["unstated"] == 0.0
    assert lane["slow"] > 0 and slow.step_time_s == pytest.approx(base.step_time_s + lane["slow"])
    # 4 layers x 2 copies (out after the forward, back before the backward) x micro-batches, each less its layer
    per_layer = (_layer_activations() / TINY["num_layers"]) / 0.5e9
    microbatches = 16 // (2 * 8)
    assert lane["slow"] == pytest.approx(4 * 2 * microbatches * per_layer, rel=0.1)


@pytest.mark.parametrize(("preset", "gbps"), [("dgx_a100", 32.0), ("dgx_h100", 64.0), ("b200", 64.0),
                                               ("gb200_nvl72", 225.0), ("gb300_nvl72", 225.0)])
def test_presets_state_their_host_link(preset: str, gbps: float) -> None:
    assert load_preset(preset)["host_link_gbps"] == gbps


def test_the_host_link_is_a_checked_cluster_figure() -> None:
    with pytest.raises(ConfigError) as err:
        job(link=-1.0)
    assert "cluster.host_link_gbps" in str(err.value)


def test_offloading_needs_a_gpu_with_transformer_engine() -> None:
    assert ParallelDims.build(job(cpu_offloading_num_layers=3), 8, te_available=True).dp == 8
    with pytest.raises(ConfigError) as err:
        ParallelDims.build(job(cpu_offloading_num_layers=3), 8, te_available=False)
    assert KEY in str(err.value) and "Transformer Engine is not installed" in str(err.value)
