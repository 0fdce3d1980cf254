"""GPT-OSS's experts as Megatron-Core 0.16.1 runs them: the clamp before quick GEGLU, the fc2 bias added per expert
outside the grouped GEMM, the router in bf16 (docs/simulator.md, "GPT-OSS's experts"), and the settings reaching
Megatron-Core's ``TransformerConfig``."""

from __future__ import annotations

import dataclasses

import pytest

from cfp_megatron.base.compose import compose_job
from cfp_megatron.base.config import Activation, JobSpec, job_from_config
from cfp_megatron.base.errors import ConfigError
from cfp_megatron.base.parallel_dims import ParallelDims
from cfp_megatron.profile.fingerprint import model_key
from cfp_megatron.sim import SimOptions
from cfp_megatron.sim.layer_cost import layer_cost
from cfp_megatron.sim.layout import build_layout
from cfp_megatron.sim.memory import layer_activation_bytes
from cfp_megatron.sim.terms.expert_dispatch import (
    clamp_bytes,
    expert_bias_bytes,
    moe_block_cost,
    probability_bytes,
)
from cfp_megatron.validate import load_preset
from tests.test_sim_moe import H100, models

SMALL = {"name": "oss_test", "num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "vocab_size": 256,
         "max_position_embeddings": 256, "activation": "quick_geglu", "num_experts": 8, "moe_router_topk": 2,
         "moe_ffn_hidden_size": 32, "add_bias_linear": False}
TOKENS = 128  # one micro-batch of one 128-token sequence: 2 routed copies a token (top-2, no EP or TP)
FC1 = 2 * 2 * 32  # fc1's output elements per token: two copies, each a gate and a linear half of 32
FC2 = 2 * 64  # fc2's output elements per token: two copies of the hidden size


def job(model: dict | None = None, cluster: dict | None = None, gpus: int = 1, **parallel) -> JobSpec:
    train = {"global_batch_size": 8, "micro_batch_size": 1, "seq_length": TOKENS, "precision": "bf16"}
    return job_from_config({"model": {**SMALL, **(model or {})},
                            "cluster": {**(cluster or H100), "nodes": 1, "gpus_per_node": gpus},
                            "parallel": parallel, "train": train})


def test_the_clamp_costs_its_counted_passes_over_fc1s_output_forward_backward_and_recomputed() -> None:
    """Forward: two clamps each read and write their half, the cat reads and writes the whole (8 bytes an element
    in bf16); backward: 5.5 passes (11 bytes) and 4 bytes of boolean masks (15)."""
    assert clamp_bytes(2.0) == (8.0, 15.0)
    plain = job()
    clamped = job({"activation_clamp": 7.0})
    layout, kernels, comm = models(clamped, 1)
    assert moe_block_cost(plain, layout, kernels, comm).unfused_bytes_per_token == (0.0, 0.0)
    block = moe_block_cost(clamped, layout, kernels, comm)
    assert block.unfused_bytes_per_token == pytest.approx((FC1 * 8.0, FC1 * 15.0))
    assert block.recomputed_bytes_per_token == pytest.approx(FC1 * 8.0)
    base, with_clamp = (layer_cost(j, layout, kernels, comm, SimOptions(), moe=True) for j in (plain, clamped))
    assert with_clamp.forward.compute_s - base.forward.compute_s == pytest.approx(
        kernels.memory(FC1 * 8.0 * TOKENS))
    assert with_clamp.backward.compute_s - base.backward.compute_s == pytest.approx(
        kernels.memory(FC1 * 15.0 * TOKENS))
    recomputed = {"recompute": "selective", "recompute_modules": "moe_act"}
    base, with_clamp = (layer_cost(job(m, **recomputed), layout, kernels, comm, SimOptions(), moe=True)
                        for m in (None, {"activation_clamp": 7.0}))
    assert with_clamp.recompute.compute_s - base.recompute.compute_s == pytest.approx(
        kernels.memory(FC1 * 8.0 * TOKENS))


def test_the_fc2_bias_bytes_follow_the_experts_code_path_and_the_probabilities_dtype() -> None:
    """Bytes per element of fc2's output, counted from experts.py (bf16 activations): TEGroupedMLP._apply_bias and
    SequentialMLP's MLP (``output += output_bias * per_token_scale``), with bf16 or fp32 probabilities."""
    assert expert_bias_bytes(2.0, 2.0, grouped_gemm=True) == (12.0, 16.0)  # b*p 2, add 2+2+2, cat 2+2
    assert expert_bias_bytes(2.0, 4.0, grouped_gemm=True) == (28.0, 40.0)  # ... in fp32, and the casts back
    assert expert_bias_bytes(2.0, 2.0, grouped_gemm=False) == (8.0, 12.0)  # b*p 2, add_ 2+2+2
    assert expert_bias_bytes(2.0, 4.0, grouped_gemm=False) == (12.0, 30.0)
    biased = job({"add_bias_linear": True, "moe_router_fp32": False})
    layout, kernels, comm = models(biased, 1)
    assert moe_block_cost(biased, layout, kernels, comm).unfused_bytes_per_token == pytest.approx(
        (FC2 * 12.0, FC2 * 16.0))
    fp32 = job({"add_bias_linear": True})
    assert moe_block_cost(fp32, layout, kernels, comm).unfused_bytes_per_token == pytest.approx(
        (FC2 * 28.0, FC2 * 40.0))


def test_the_grouped_gemm_option_not_the_cluster_picks_the_bias_path() -> None:
    """SimOptions.grouped_gemm decides whether the experts are TEGroupedMLP or SequentialMLP, on a CPU cluster too."""
    cpu = load_preset("local")
    for cluster in (H100, cpu):
        j = job({"add_bias_linear": True, "moe_router_fp32": False}, cluster=cluster)
        layout, kernels, comm = models(j, 1)
        grouped = moe_block_cost(j, layout, kernels, comm, grouped_gemm=True).unfused_bytes_per_token
        sequential = moe_block_cost(j, layout, kernels, comm, grouped_gemm=False).unfused_bytes_per_token
        elem = kernels.elem
        assert grouped == pytest.approx(tuple(FC2 * b for b in expert_bias_bytes(elem, elem, grouped_gemm=True)))
        assert sequential == pytest.approx(tuple(FC2 * b for b in expert_bias_bytes(elem, elem, grouped_gemm=False)))
        by_option = {flag: layer_cost(j, layout, kernels, comm, SimOptions(grouped_gemm=flag), moe=True)
                     for flag in (True, False)}
        assert by_option[True].forward.compute_s - by_option[False].forward.compute_s == pytest.approx(
            kernels.memory((grouped[0] - sequential[0]) * TOKENS))


def test_a_bf16_router_moves_half_the_bytes_of_its_scores_and_probabilities() -> None:
    """The router's passes over its [tokens, experts] scores (6 forward, 3 backward, beside the routing map's bytes)
    and the dispatched probabilities in bf16 without moe_router_dtype='fp32'; DeepEP and HybridEP cast the
    probabilities to fp32."""
    fp32, bf16 = job(), job({"moe_router_fp32": False})
    layout, kernels, comm = models(fp32, 1)
    gap = tuple(a - b for a, b in zip(moe_block_cost(fp32, layout, kernels, comm).router_bytes_per_token,
                                      moe_block_cost(bf16, layout, kernels, comm).router_bytes_per_token,
                                      strict=True))
    assert gap == pytest.approx((8 * 6 * (4.0 - 2.0), 8 * 3 * (4.0 - 2.0)))  # 8 experts, 4 bytes a score less 2
    assert (probability_bytes(fp32, 2), probability_bytes(bf16, 2)) == (4.0, 2.0)
    assert probability_bytes(job({"moe_router_fp32": False, "moe_token_dispatcher": "flex"}), 2) == 4.0
    fp32_ep, bf16_ep = job(gpus=2, ep=2), job({"moe_router_fp32": False}, gpus=2, ep=2)
    layout, kernels, comm = models(fp32_ep, 2)
    a, b = (moe_block_cost(j, layout, kernels, comm) for j in (fp32_ep, bf16_ep))
    assert b.combine_s == pytest.approx(a.combine_s) and b.dispatch_s < a.dispatch_s


def test_the_clamp_keeps_fc1s_output_beside_its_clamped_copy_unless_moe_act_is_recomputed() -> None:
    layout = build_layout(job(), 1)
    extra = TOKENS * FC1 * 2.0  # one more [rows, 2 ffn] bf16 tensor per routed copy
    plain, clamped = (layer_activation_bytes(job(m), layout, SimOptions(), moe=True)[0]
                      for m in (None, {"activation_clamp": 7.0}))
    assert clamped - plain == pytest.approx(extra)
    recomputed = {"recompute": "selective", "recompute_modules": "moe_act"}
    plain, clamped = (layer_activation_bytes(job(m, **recomputed), layout, SimOptions(), moe=True)[0]
                      for m in (None, {"activation_clamp": 7.0}))
    assert clamped == pytest.approx(plain)


def test_gpt_oss_reaches_megatron_core_as_its_provider_sets_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    from cfp_megatron.model import megatron_config
    from cfp_megatron.model.megatron_config import transformer_config

    oss = compose_job(["model=gpt_oss_120b", "cluster=dgx_h100", "cluster.nodes=8", "train.global_batch_size=128"])
    assert oss.model.activation is Activation.quick_geglu and oss.model.activation.gated
    config = transformer_config(oss, ParallelDims.build(oss, 64, te_available=False), on_gpu=False)
    assert config.activation_func is quick_gelu and config.gated_linear_unit
    assert (config.glu_linear_offset, config.activation_func_clamp_value, config.moe_router_dtype) == (1.0, 7.0, None)
    assert config.add_bias_linear
    tiny = compose_job(["model=moe_tiny"])
    config = transformer_config(tiny, ParallelDims.build(tiny, 1, te_available=False), on_gpu=False)
    assert (config.glu_linear_offset, config.activation_func_clamp_value, config.moe_router_dtype) == (0.0, None,
                                                                                                      "fp32")
    # On a GPU with grouped-GEMM experts, TEGroupedMLP refuses bias_dropout_fusion for biased experts.
    monkeypatch.setattr(megatron_config, "grouped_gemm_here", lambda *, on_gpu: on_gpu)
    for model, fused in ((oss, False), (tiny, not tiny.model.add_bias_linear)):
        kwargs = megatron_config_kwargs(model, monkeypatch)
        assert kwargs["bias_dropout_fusion"] is fused


def megatron_config_kwargs(j: JobSpec, monkeypatch: pytest.MonkeyPatch) -> dict:
    """The keyword arguments :func:`transformer_config` builds for ``j`` on a GPU (the config class stubbed)."""
    from cfp_megatron.model import megatron_config

    seen: dict = {}
    monkeypatch.setattr(megatron_config, "TransformerConfig", lambda **kwargs: seen.update(kwargs))
    world = j.cluster.nodes * (j.cluster.gpus_per_node or 1)
    megatron_config.transformer_config(j, ParallelDims.build(j, world, te_available=False), on_gpu=True)
    return seen


def test_a_clamp_needs_quick_geglu_and_enters_the_profile_key_only_when_set() -> None:
    with pytest.raises(ConfigError) as err:
        job({"activation": "swiglu", "activation_clamp": 7.0})
    assert "model.activation_clamp" in str(err.value) and "quick_geglu" in str(err.value)
    with pytest.raises(ConfigError):
        job({"activation_clamp": -1.0})
    base = job()
    keys = {model_key(dataclasses.replace(base, model=dataclasses.replace(base.model, **change)), on_gpu=False)
            for change in ({}, {"activation_clamp": 7.0}, {"moe_router_fp32": False})}
    assert len(keys) == 3


def test_the_validators_moe_rows_read_the_biases_activation_and_router_their_sources_state() -> None:
    """GPT-OSS's rows take its preset's clamped quick GEGLU, biases and bf16 router; DeepSeek-V3's (its preset) and
    Qwen3's (model_families.yaml) rows have no biases, so no per-expert fc2 bias is priced for them; DeepSeek-V3's
    router runs in fp32, Qwen3's in bf16 (model_families.yaml)."""
    from cfp_megatron.validate import read_rows, row_plan
    from cfp_megatron.validation.rows import PUBLISHED_RUNS

    rows = {r["id"]: r for path in PUBLISHED_RUNS for r in read_rows(path)}
    oss = row_plan(rows["79"]).job.model
    assert (oss.activation, oss.activation_clamp, oss.add_bias_linear, oss.moe_router_fp32) == (
        Activation.quick_geglu, 7.0, True, False)
    for rid, fp32 in (("73", True), ("74", False), ("80", False)):  # DeepSeek-V3, Qwen3 30B-A3B (both files)
        model = row_plan(rows[rid]).job.model
        assert not model.add_bias_linear and model.activation is Activation.swiglu
        assert model.moe_router_fp32 is fp32


@pytest.mark.parametrize(("change", "named"), [({"num_experts": None}, "a dense model"),
                                               ({"moe_first_dense_layers": 1}, "its dense first layers"),
                                               ({"moe_shared_expert_intermediate_size": 64}, "its shared expert")])
def test_quick_geglu_is_refused_where_a_dense_mlp_would_run_it(change: dict, named: str) -> None:
    """Megatron-Core's MLP.forward fuses quick GEGLU only with per-token scales (the routed experts'): a dense MLP or
    shared expert raises under bias_activation_fusion, which GPU runs set."""
    with pytest.raises(ConfigError) as err:
        job(change)
    assert "model.activation" in str(err.value) and named in str(err.value)
    assert job().model.activation is Activation.quick_geglu  # routed experts alone: accepted
